//! `examples/notebook.ipynb` cannot rot: its cells are `examples/notebook.rs`'s (which
//! `cargo test` compiles, and this file runs), and where Jupyter's headless runner and
//! the evcxr kernel are installed, the notebook itself is executed and its numbers
//! compared with the program's.
//!
//! `LOCKSTEP_WRITE_NOTEBOOK=1 cargo test --release --test notebook_example` rewrites the
//! notebook from the program after a change to it.

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "../src/testing/skip.rs"]
mod skip;

use serde_json::{json, Value};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The program's cells: (kind, lines), as `examples/notebook.rs`'s docs define them.
fn cells(program: &str) -> Vec<(&'static str, Vec<String>)> {
    let mut cells: Vec<(&'static str, Vec<String>)> = Vec::new();
    let mut open = false;
    for line in program.lines() {
        let body = line.strip_prefix("    ").unwrap_or(line);
        match body.trim_end() {
            "// %% end" => open = false,
            "// %%" => {
                cells.push(("code", Vec::new()));
                open = true;
            }
            "// %% md" => {
                cells.push(("markdown", Vec::new()));
                open = true;
            }
            "// %% kernel" => {
                cells.push(("kernel", Vec::new()));
                open = true;
            }
            text if open => {
                let (kind, lines) = cells.last_mut().expect("a cell is open");
                let text = match *kind {
                    "markdown" | "kernel" => {
                        let t =
                            text.strip_prefix("//").unwrap_or_else(|| panic!("not a comment in a {kind} cell: {line}"));
                        t.strip_prefix(' ').unwrap_or(t).to_string()
                    }
                    _ => text.to_string(),
                };
                lines.push(text);
            }
            _ => {}
        }
    }
    for (kind, lines) in &mut cells {
        while lines.last().is_some_and(|l| l.is_empty()) {
            lines.pop();
        }
        // The cell's value: `show(&x);` in the program is `x` in the notebook.
        if *kind == "code" {
            if let Some(last) = lines.last_mut() {
                if let Some(value) = last.strip_prefix("show(&").and_then(|v| v.strip_suffix(");")) {
                    *last = value.to_string();
                }
            }
            assert!(lines.iter().all(|l| !l.contains("show(")), "show(&x); may only end a cell: {lines:?}");
        }
        // The kernel's set-up is a code cell of the notebook.
        if *kind == "kernel" {
            *kind = "code";
        }
    }
    cells
}

/// The notebook the program makes (nbformat 4, no outputs).
fn notebook(program: &str) -> Value {
    let cells: Vec<Value> = cells(program)
        .into_iter()
        .map(|(kind, lines)| {
            let n = lines.len();
            let source: Vec<String> =
                lines.into_iter().enumerate().map(|(i, l)| if i + 1 < n { format!("{l}\n") } else { l }).collect();
            match kind {
                "markdown" => json!({ "cell_type": "markdown", "metadata": {}, "source": source }),
                _ => json!({
                    "cell_type": "code", "execution_count": null, "metadata": {}, "outputs": [], "source": source
                }),
            }
        })
        .collect();
    json!({
        "cells": cells,
        "metadata": {
            "kernelspec": { "display_name": "Rust", "language": "rust", "name": "rust" },
            "language_info": {
                "codemirror_mode": "rust", "file_extension": ".rs", "mimetype": "text/rust",
                "name": "Rust", "pygment_lexer": "rust", "version": ""
            }
        },
        "nbformat": 4,
        "nbformat_minor": 4
    })
}

fn program() -> String {
    std::fs::read_to_string(root().join("examples/notebook.rs")).unwrap()
}

#[test]
fn the_notebooks_cells_are_the_programs() {
    let want = notebook(&program());
    let path = root().join("examples/notebook.ipynb");
    if std::env::var_os("LOCKSTEP_WRITE_NOTEBOOK").is_some() {
        let text = serde_json::to_string_pretty(&want).unwrap() + "\n";
        std::fs::write(&path, text).unwrap();
    }
    let text = std::fs::read_to_string(&path).unwrap();
    let have: Value = serde_json::from_str(&text).unwrap();
    // The sources and kinds decide; outputs a saved notebook may carry do not.
    let strip = |nb: &Value| -> Vec<(Value, Value)> {
        nb["cells"].as_array().unwrap().iter().map(|c| (c["cell_type"].clone(), c["source"].clone())).collect()
    };
    assert_eq!(
        strip(&have),
        strip(&want),
        "examples/notebook.ipynb is not examples/notebook.rs's cells: \
         LOCKSTEP_WRITE_NOTEBOOK=1 cargo test --release --test notebook_example rewrites it"
    );
    assert_eq!(have["metadata"]["kernelspec"]["name"], "rust");
    // The first code cell sets the kernel up: the library without the command line's
    // weight, and optimised code without debug assertions (a notebook's build is a debug
    // build).
    let cells = strip(&want);
    let setup = cells.iter().find(|(kind, _)| kind == "code").expect("a code cell").1.to_string();
    for needed in ["default-features = false", "notebook", ":opt 3", "CARGO_PROFILE_DEV_DEBUG_ASSERTIONS=false"] {
        assert!(setup.contains(needed), "the set-up cell lacks {needed}: {setup}");
    }
}

/// The example's binary, built by `cargo test` beside this test's.
fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("examples/notebook")
}

/// The epoch lines a run printed, in order.
fn epoch_lines(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.starts_with("epoch "))
        .map(|l| {
            // The rate and the time vary from run to run; the numbers of the model do not.
            l.split(" | ").filter(|p| !p.ends_with("samples/s") && !p.ends_with('s')).collect::<Vec<_>>().join(" | ")
        })
        .collect()
}

#[test]
fn the_program_runs_and_trains_as_the_command_line_does() {
    let o = Command::new(example()).output().expect("the example is built by cargo test");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    // `lockstep train --epochs 3 --devices cpu:2`'s numbers, which the program's first
    // cells say they are.
    let cli = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["train", "--epochs", "3", "--devices", "cpu:2"])
        .output()
        .unwrap();
    assert!(cli.status.success(), "{}", String::from_utf8_lossy(&cli.stderr));
    let cli_lines = epoch_lines(&String::from_utf8_lossy(&cli.stdout));
    assert_eq!(cli_lines.len(), 3, "{cli_lines:?}");
    // Progress's lines, then the report's Display: the same three, twice.
    let lines = epoch_lines(&out);
    assert_eq!(lines[..3], cli_lines[..], "{out}");
    assert_eq!(lines[3..], cli_lines[..], "{out}");
    assert!(out.contains("(the curves: a "), "{out}");
    assert!(out.contains("test accuracy after 5 more steps: "), "{out}");
}

/// Where `python3 -c 'import nbclient'` works and the evcxr kernel is installed (`jupyter
/// kernelspec` knows "rust"), the notebook runs headless, and its report cell shows the
/// table of epochs and the curves, with the program's numbers. Elsewhere it says why it
/// skips. The first cell compiles lockstep for the kernel: minutes on a small machine.
#[test]
fn the_notebook_runs_in_jupyter_where_the_kernel_is_installed() {
    let python = std::env::var("LOCKSTEP_NOTEBOOK_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python)
        .args(["-c", "import nbclient, jupyter_client; print(jupyter_client.kernelspec.find_kernel_specs()['rust'])"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        _ => {
            let why = format!(
                "the notebook needs {python} with nbclient and the evcxr kernel (cargo install --locked \
                 evcxr_jupyter && evcxr_jupyter --install; pip install nbclient ipykernel); LOCKSTEP_NOTEBOOK_PYTHON \
                 names another python"
            );
            skip::skip("the_notebook_runs_in_jupyter_where_the_kernel_is_installed", skip::Need::Tool, &why);
            return;
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let executed = dir.path().join("executed.ipynb");
    let script = r#"
import sys, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, timeout=1800, kernel_name="rust", resources={"metadata": {"path": sys.argv[2]}}).execute()
nbformat.write(nb, sys.argv[3])
"#;
    let nb = root().join("examples/notebook.ipynb");
    let o = Command::new(&python)
        .args(["-c", script])
        .arg(&nb)
        .arg(root().join("examples"))
        .arg(&executed)
        .output()
        .unwrap();
    assert!(o.status.success(), "the notebook failed: {}", String::from_utf8_lossy(&o.stderr));
    let run: Value = serde_json::from_str(&std::fs::read_to_string(&executed).unwrap()).unwrap();
    let mut text = String::new();
    let mut html = String::new();
    for cell in run["cells"].as_array().unwrap() {
        for output in cell["outputs"].as_array().into_iter().flatten() {
            assert_ne!(output["output_type"], "error", "a cell failed: {output}");
            let joined = |v: &Value| match v {
                Value::Array(parts) => parts.iter().filter_map(Value::as_str).collect::<String>(),
                Value::String(s) => s.clone(),
                _ => String::new(),
            };
            text.push_str(&joined(&output["text"]));
            text.push_str(&joined(&output["data"]["text/plain"]));
            html.push_str(&joined(&output["data"]["text/html"]));
        }
    }
    // The report cell: a row per epoch, and the curves inline.
    assert_eq!(html.matches("<tr><td>").count(), 3, "{html}");
    assert!(html.contains("data:image/png;base64,"), "no inline curves");
    // The same numbers as the program.
    let program = Command::new(example()).output().unwrap();
    let want = epoch_lines(&String::from_utf8_lossy(&program.stdout));
    assert_eq!(epoch_lines(&text), want, "{text}");
}
