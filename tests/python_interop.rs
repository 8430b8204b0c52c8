//! What a Python user does with lockstep's files, run as the guide shows it.
//!
//! - Weights into PyTorch and back, for every built-in model: the modules of
//!   scripts/torch_models.py load what `lockstep train --save` writes with
//!   `load_state_dict(strict=True)`, every tensor equal to the file's, and what they save
//!   loads as `--init`; the Python of docs/checkpoints.md's "In PyTorch" section, as a
//!   reader pastes it, and the command after it.
//! - A dataset from numpy: the Python of docs/library.md's "Your own data" section writes a
//!   file that `lockstep train --data` trains on.
//!
//! Needs `python3` with torch, safetensors and numpy (torch_resnet.py, whose ResNet the
//! module table imports, needs numpy; the dataset, numpy and safetensors only); where they
//! are absent, a test says so through the one skip helper and checks nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use lockstep::data::safetensors_file::save_safetensors_dataset;
use lockstep::data::{Dataset, Features};

#[path = "../src/testing/skip.rs"]
mod skip;

/// The Python modules the weights tests import.
const TORCH: [&str; 3] = ["torch", "safetensors", "numpy"];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Whether `python3` finds `modules` (looked up, not imported: importing torch takes
/// seconds); otherwise the skip helper says that `test` did not run.
fn python_present(test: &str, modules: &[&str]) -> bool {
    let find = format!(
        "import importlib.util, sys\nmissing = [m for m in {modules:?} if importlib.util.find_spec(m) is None]\nprint(' '.join(missing))\nsys.exit(1 if missing else 0)"
    );
    match Command::new("python3").args(["-c", &find]).output() {
        Ok(o) if o.status.success() => true,
        Ok(o) => {
            let why = format!(
                "python3 lacks {} (pip install {})",
                String::from_utf8_lossy(&o.stdout).trim(),
                modules.join(" ")
            );
            skip::skip(test, skip::Need::Tool, &why);
            false
        }
        Err(e) => {
            skip::skip(test, skip::Need::Tool, &format!("no python3 ({e})"));
            false
        }
    }
}

/// `lockstep ARGS` in `dir`; panics, with what it printed, unless it exits 0.
fn lockstep(dir: &Path, args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_lockstep")).args(args).current_dir(dir).output().expect("the binary runs");
    assert!(
        o.status.success(),
        "`lockstep {}` exited {:?}:\n{}\n{}",
        args.join(" "),
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// Runs `script` with python3 in `dir`, scripts/ on its path; panics, with what it
/// printed, unless it exits 0; returns its stdout.
fn python(dir: &Path, script: &str) -> String {
    let file = dir.join("script.py");
    std::fs::write(&file, script).unwrap();
    let o = Command::new("python3")
        .arg(&file)
        .env("PYTHONPATH", root().join("scripts"))
        .current_dir(dir)
        .output()
        .expect("python3 runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "python3 failed ({:?}) on\n{script}\n{out}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// A text of a few kilobytes for the GPT: enough windows of 32 tokens for two steps.
fn write_text(dir: &Path) -> PathBuf {
    let path = dir.join("text.txt");
    let text: String =
        (0..200).map(|i| format!("line {i}: the quick brown fox jumps over {} lazy dogs.\n", i % 7)).collect();
    std::fs::write(&path, text).unwrap();
    path
}

/// 24 images of 1×28×28 (a fixed pattern) in 10 classes, as a dataset file: data the image models
/// train two steps on in a blink (the embedded digits' 360 test images would take seconds
/// of resnet20's evaluation).
fn write_images(dir: &Path) {
    let (n, per) = (24, 28 * 28);
    let pixels: Vec<u8> = (0..n * per).map(|i| (i * 37 % 256) as u8).collect();
    let labels: Vec<u32> = (0..n as u32).map(|i| i % 10).collect();
    let data = Dataset::new("images", [1, 28, 28], Features::U8(pixels), labels, 10).unwrap();
    save_safetensors_dataset(&data, &dir.join("images.safetensors")).unwrap();
}

/// One built-in model: its `--model` name, the flags of its data and sizes, and the same
/// sizes as keyword arguments of `torch_models.build`.
struct Case {
    name: &'static str,
    flags: &'static [&'static str],
    sizes: &'static str,
}

/// Every built-in model (src/cli/mod.rs's ModelName), the GPT and the Llama smaller than
/// their defaults so that their sizes are read from the flags on both sides.
const CASES: [Case; 8] = [
    Case { name: "toy", flags: &["--data", "toy"], sizes: "" },
    Case { name: "convnet", flags: &["--data", "images.safetensors"], sizes: "" },
    Case { name: "convnet-nobn", flags: &["--data", "images.safetensors"], sizes: "" },
    Case { name: "resnet8", flags: &["--data", "images.safetensors"], sizes: "" },
    Case { name: "resnet20", flags: &["--data", "images.safetensors"], sizes: "" },
    Case { name: "densenet", flags: &["--data", "images.safetensors"], sizes: "" },
    Case {
        name: "gpt",
        flags: &["--data", "text:text.txt", "--context", "32", "--layers", "2", "--heads", "2", "--width", "64"],
        sizes: "context=32, layers=2, heads=2, width=64",
    },
    Case {
        name: "llama",
        flags: &["--data", "text:text.txt", "--context", "32", "--layers", "2", "--heads", "2", "--width", "64"],
        sizes: "context=32, layers=2, heads=2, width=64",
    },
];

#[test]
fn every_built_in_models_weights_load_strictly_into_its_pytorch_module_and_back() {
    let test = "every_built_in_models_weights_load_strictly_into_its_pytorch_module_and_back";
    if !python_present(test, &TORCH) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    write_text(dir.path());
    write_images(dir.path());
    // Two steps: the BatchNorm running statistics and num_batches_tracked move off their
    // initial values, so a tensor loaded into the wrong place would differ.
    for case in &CASES {
        let save = format!("{}.safetensors", case.name);
        let mut args = vec!["train", "--model", case.name, "--steps", "2", "--devices", "cpu:2", "--save", &save];
        args.extend(case.flags);
        lockstep(dir.path(), &args);
    }
    let table: String = CASES.iter().map(|c| format!("    ({:?}, dict({})),\n", c.name, c.sizes)).collect();
    let script = format!(
        r#"import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch_models import build

for name, sizes in [
{table}]:
    path = name + ".safetensors"
    model = build(name, **sizes)
    model.load_state_dict(load_file(path), strict=True)
    state = model.state_dict()
    with safe_open(path, "pt") as f:
        assert sorted(f.keys()) == sorted(state), (name, sorted(f.keys()), sorted(state))
        for key in f.keys():
            want = f.get_tensor(key)
            assert state[key].dtype == want.dtype and torch.equal(state[key], want), (name, key)
    save_file({{k: t.detach().clone().contiguous() for k, t in state.items()}}, name + ".torch.safetensors")
    print(name, len(state))
"#
    );
    let out = python(dir.path(), &script);
    for case in &CASES {
        assert!(
            out.lines().any(|l| l.split_whitespace().next() == Some(case.name)),
            "{} not checked:\n{out}",
            case.name
        );
        let init = format!("{}.torch.safetensors", case.name);
        let mut args = vec!["train", "--model", case.name, "--steps", "1", "--devices", "cpu:2", "--init", &init];
        args.extend(case.flags);
        lockstep(dir.path(), &args);
    }
}

/// The fenced blocks of the section `## {heading}` of the guide's `page`, in order: each
/// block's language and text.
fn section_blocks(page: &str, heading: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(root().join(page)).unwrap();
    let start = text.find(&format!("\n## {heading}\n")).unwrap_or_else(|| panic!("{page} has no `## {heading}`"));
    let section = &text[start + 1..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |i| i + 1)];
    let (mut blocks, mut fence) = (Vec::new(), None::<(String, String)>);
    for line in section.lines() {
        match (fence.take(), line.strip_prefix("```")) {
            (None, Some(info)) => fence = Some((info.trim().to_string(), String::new())),
            (Some(block), Some(_)) => blocks.push(block),
            (Some((info, mut body)), None) => {
                body.push_str(line);
                body.push('\n');
                fence = Some((info, body));
            }
            (None, None) => {}
        }
    }
    blocks
}

/// The texts of the blocks of language `lang` among `blocks`.
fn of_language(blocks: &[(String, String)], lang: &str) -> Vec<String> {
    blocks.iter().filter(|(info, _)| info == lang).map(|(_, body)| body.clone()).collect()
}

#[test]
fn the_pytorch_section_of_the_guide_runs_as_shown() {
    let blocks = section_blocks("docs/checkpoints.md", "In PyTorch");
    let python_blocks = of_language(&blocks, "python");
    assert_eq!(python_blocks.len(), 2, "the section shows loading and saving: {blocks:?}");
    assert!(python_blocks[0].contains("strict=True"), "the guide loads strictly: {}", python_blocks[0]);
    let commands = of_language(&blocks, "sh").concat();
    let command: Vec<&str> = commands.split_whitespace().collect();
    assert_eq!(command.first(), Some(&"lockstep"), "its sh block is one lockstep command: {commands}");
    if !python_present("the_pytorch_section_of_the_guide_runs_as_shown", &TORCH) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // What the section says comes first: `lockstep train --model convnet --save convnet.safetensors`.
    lockstep(dir.path(), &["train", "--model", "convnet", "--steps", "2", "--save", "convnet.safetensors"]);
    python(dir.path(), &python_blocks.concat());
    let o = lockstep(dir.path(), &command[1..]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("final test accuracy"), "{out}");
}

#[test]
fn a_dataset_written_from_numpy_as_the_guide_shows_trains() {
    let test = "a_dataset_written_from_numpy_as_the_guide_shows_trains";
    let blocks = of_language(&section_blocks("docs/library.md", "Your own data"), "python");
    assert_eq!(blocks.len(), 1, "the section shows one Python block: {blocks:?}");
    if !python_present(test, &["numpy", "safetensors"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    python(dir.path(), &blocks[0]);
    // The block's file: 1000 images of 1×28×28 and 10 classes (its num_classes), which the
    // convnet, an image model's default, trains on.
    let o = lockstep(dir.path(), &["train", "--data", "mine.safetensors", "--steps", "2", "--devices", "cpu:2"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("convnet (49242 parameters, 10 classes)"), "{out}");
    assert!(out.contains("mine.safetensors 1000 samples"), "{out}");
}
