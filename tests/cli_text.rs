//! The command line over text (issue 21): a GPT trained on a file's bytes prints its eval
//! lines and saves weights that `generate` continues a prompt with, the same text for
//! the same seed; and every bad input is one `error:` line with exit code 2, naming the
//! problem.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lockstep"))
}

fn readme() -> String {
    format!("text:{}", concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
}

/// A small GPT's shape flags.
const SHAPE: [&str; 8] = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "16"];

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The run failed with exit code 2 and one `error:` line holding every one of `want`.
fn refused(out: &Output, want: &[&str]) {
    let (_, stderr) = text(out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    for w in want {
        assert!(errors[0].contains(w), "{w:?} not in {stderr}");
    }
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn a_gpt_trains_on_text_and_generates_the_same_text_for_the_same_seed() {
    let dir = tempfile::tempdir().unwrap();
    let weights = dir.path().join("gpt.safetensors");
    let out = bin()
        .args(["train", "--model", "gpt", "--data", &readme(), "--steps", "20", "--eval-every", "10"])
        .args(["--eval-batches", "2", "--devices", "cpu:2", "--save", weights.to_str().unwrap()])
        .args(SHAPE)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    // Two eval lines, each with the validation loss and tokens/s.
    let evals: Vec<&str> = stdout.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(evals.len(), 2, "{stdout}");
    assert!(evals[1].starts_with("step 20/20 | train loss ") && evals[1].contains("| validation loss "), "{stdout}");
    assert!(evals[1].contains(" tokens/s | "), "{stdout}");
    let generate = |seed: &str| {
        let out = bin()
            .args(["generate", "--weights", weights.to_str().unwrap(), "--prompt", "The ", "--tokens", "40"])
            .args(["--seed", seed, "--top-k", "20"])
            .args(SHAPE)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out).1);
        out.stdout
    };
    let (a, b, c) = (generate("1"), generate("1"), generate("2"));
    assert_eq!(a, b, "the same seed, the same text");
    assert_eq!(a.len(), 41, "40 bytes and a newline");
    assert_ne!(a, c, "another seed, another text");
    // A prompt longer than the context is cropped, and said so.
    let long = "x".repeat(40);
    let out = bin()
        .args(["generate", "--weights", weights.to_str().unwrap(), "--prompt", &long, "--tokens", "3"])
        .args(SHAPE)
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("the prompt's 40 bytes are cropped to its last 16"), "{stderr}");
}

#[test]
fn bad_text_input_is_one_error_line_with_exit_code_2() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let train = |data: &str, extra: &[&str]| {
        bin()
            .args(["train", "--model", "gpt", "--data", data, "--steps", "2"])
            .args(SHAPE)
            .args(extra)
            .output()
            .unwrap()
    };
    // A text shorter than a window on either side, an empty one, a directory, none.
    let short = write(d, "short.txt", b"too short for a window of seventeen");
    refused(&train(&format!("text:{}", short.display()), &[]), &["fewer than a window of 17", "at least 170 bytes"]);
    let empty = write(d, "empty.txt", b"");
    refused(&train(&format!("text:{}", empty.display()), &[]), &["is empty"]);
    refused(&train(&format!("text:{}", d.display()), &[]), &["is a directory"]);
    refused(&train("text:/nonexistent.txt", &[]), &["no such file"]);
    // Heads that do not divide the width.
    let out =
        bin().args(["train", "--model", "gpt", "--data", &readme(), "--width", "32", "--heads", "3"]).output().unwrap();
    refused(&out, &["--heads 3 does not divide --width 32"]);
    // Epochs: a text run is counted in steps.
    refused(&train(&readme(), &["--epochs", "2"]), &["counted in steps"]);
    // A token file with an id at or above the vocabulary of 256.
    let ids: Vec<u8> = [1i64, 2, 300, 4].iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![1, 4], &ids).unwrap();
    let tokens = d.join("tokens.safetensors");
    safetensors::serialize_to_file([("tokens", view)], None, &tokens).unwrap();
    let out = bin()
        .args(["train", "--model", "gpt", "--data", tokens.to_str().unwrap(), "--steps", "1"])
        .args(["--layers", "1", "--width", "8", "--heads", "2", "--context", "3"])
        .output()
        .unwrap();
    refused(&out, &["token id 300", "at or above the"]);
    // A spec whose input is longer than its positional table.
    let spec = r#"{"input_shape": [80], "layers": [{"type": "embedding", "vocab": 256, "width": 8},
        {"type": "positional_embedding", "length": 64}, {"type": "dense", "units": 256}]}"#;
    let spec = write(d, "long.json", spec.as_bytes());
    let out =
        bin().args(["train", "--model", spec.to_str().unwrap(), "--data", &readme(), "--steps", "1"]).output().unwrap();
    refused(&out, &["a context of 80 positions is above the positional table's 64"]);
    // A tied head whose shape does not match the table it names.
    let spec = r#"{"input_shape": [16], "layers": [{"type": "embedding", "vocab": 256, "width": 8, "name": "wte"},
        {"type": "dense", "units": 100, "use_bias": false, "tied_to": "wte.weight"}]}"#;
    let spec = write(d, "tied.json", spec.as_bytes());
    let out =
        bin().args(["train", "--model", spec.to_str().unwrap(), "--data", &readme(), "--steps", "1"]).output().unwrap();
    refused(&out, &["(100, 8) does not match wte.weight (256, 8)"]);
}
