//! The command line over text (issue 21): a GPT trained on a file's bytes prints its eval
//! lines and saves weights that `generate` continues a prompt with, the same text for
//! the same seed; and every bad input is one `error:` line with exit code 2, naming the
//! problem. Issue 41: `eval` scores a GPT per token, `predict` points it to `generate`,
//! the GPT's sizes are read from its weights (its heads from their metadata), a weights
//! file given to the wrong model says which model it is, `generate` streams and bounds
//! its tokens, and `bench step --model gpt` runs.

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
    // The sizes are read from the weights: no shape flags.
    let generate = |seed: &str| {
        let out = bin()
            .args(["generate", "--weights", weights.to_str().unwrap(), "--prompt", "The ", "--tokens", "40"])
            .args(["--seed", seed, "--top-k", "20"])
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

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A small GPT (SHAPE) trained 3 steps on the README, saved in `dir`.
fn small_gpt(dir: &Path) -> PathBuf {
    let w = dir.join("gpt.safetensors");
    let out = bin()
        .args(["train", "--model", "gpt", "--data", &readme(), "--steps", "3", "--eval-every", "3"])
        .args(["--eval-batches", "1", "--devices", "cpu:1", "--save", s(&w)])
        .args(SHAPE)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out).1);
    w
}

/// A directory of fortunes: the README, for `LOCKSTEP_FORTUNES_DIR`.
fn fortunes_dir(dir: &Path) -> PathBuf {
    let d = dir.join("fortunes");
    std::fs::create_dir(&d).unwrap();
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"), d.join("readme")).unwrap();
    d
}

/// `eval` read the GPT's (T, V) output as T·V classes and refused the weights train saved
/// (a vocabulary of 128); `eval --model gpt` said "--data 'fortunes': no such file". Now:
/// loss per token, perplexity and next-token accuracy over the text's validation part in
/// consecutive windows, the sizes read from the weights.
#[test]
fn eval_scores_a_gpt_per_token_over_the_validation_part() {
    let dir = tempfile::tempdir().unwrap();
    let w = small_gpt(dir.path());
    let eval = |extra: &[&str]| {
        let out = bin()
            .args(["eval", "--model", "gpt", "--weights", s(&w), "--devices", "cpu:2"])
            .args(extra)
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        stdout
    };
    let stdout = eval(&["--data", &readme()]);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    // The tokens scored: the README's last tenth (src/data/text.rs: the first
    // floor(0.9·B) bytes train), its windows of 16 starting every 16 bytes while a window
    // and its next byte fit: ceil((V − 16) / 16) windows of 16 tokens.
    let b = std::fs::metadata(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap().len() as usize;
    let v = b - (b as f64 * 0.9).floor() as usize;
    let windows = (v - 16).div_ceil(16);
    assert!(
        lines[0].ends_with(&format!(
            "on {}/README.md (validation part): {windows} windows of 16 tokens on cpu:0, cpu:1 (1 thread each)",
            env!("CARGO_MANIFEST_DIR")
        )),
        "{stdout}"
    );
    assert!(lines[0].contains("(gpt: 1 block, width 32, 2 heads, vocabulary 256, context 16)"), "{stdout}");
    // loss per token L | perplexity exp(L) | next-token accuracy c/n, n the tokens.
    let fields: Vec<&str> = lines[1].split(' ').collect();
    assert_eq!(
        (fields[0], fields[1], fields[2], fields[5], fields[8], fields[9]),
        ("loss", "per", "token", "perplexity", "next-token", "accuracy"),
        "{stdout}"
    );
    let (loss, perplexity): (f64, f64) = (fields[3].parse().unwrap(), fields[6].parse().unwrap());
    // Both printed to 4 decimals: exp of a loss rounded by 5e-5 is within 5e-5 relative.
    assert!((perplexity - loss.exp()).abs() <= 1e-4 * perplexity + 1e-4, "{stdout}");
    // Three steps from nanoGPT's initialisation: near a uniform guess over 256 bytes, ln 256 = 5.545.
    assert!((loss - 256f64.ln()).abs() < 0.2, "{stdout}");
    assert!(fields[11].ends_with(&format!("/{})", windows * 16)), "{stdout}");
    // --classes of the vocabulary changes nothing (no confusion matrix of T·V classes).
    assert_eq!(eval(&["--data", &readme(), "--classes", "256"]).lines().nth(1), Some(lines[1]));
    // The default data is the fortunes, as train takes them.
    let fortunes = fortunes_dir(dir.path());
    let out = bin()
        .args(["eval", "--model", "gpt", "--weights", s(&w), "--devices", "cpu:1"])
        .env("LOCKSTEP_FORTUNES_DIR", &fortunes)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains(&format!("on fortunes (validation part): {windows} windows of 16 tokens")), "{stdout}");
}

/// The wrong model for a weights file printed every tensor that differs (3.3 KB for a
/// GPT); `predict` read a GPT's output as classes; `generate --heads 4` ran 2-head
/// weights silently; the wrong data named the shapes, not the mistake.
#[test]
fn the_wrong_model_or_data_for_a_gpt_is_named_and_its_sizes_read_from_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let w = small_gpt(dir.path());
    let run = |args: &[&str]| bin().args(args).output().unwrap();
    let is_a = "these weights are a gpt (1 block, width 32, context 16, vocabulary 256, 2 heads; read from the file)";
    refused(
        &run(&["eval", "--model", "toy", "--weights", s(&w)]),
        &[&format!("--weights '{}': {is_a}, not a toy: pass --model gpt", w.display())],
    );
    refused(
        &run(&["predict", "--weights", s(&w), "--data", "digits"]),
        &[&format!(
            "{is_a}, not a convnet: predict classifies; a gpt continues text: lockstep generate --model gpt --weights {}",
            w.display()
        )],
    );
    refused(
        &run(&["predict", "--model", "gpt", "--weights", s(&w), "--data", &readme()]),
        &["--model gpt is a language model", "`lockstep generate --weights", "`lockstep eval --weights"],
    );
    // train --init into the flags' default GPT: the flags that build the file's.
    refused(
        &run(&["train", "--model", "gpt", "--data", &readme(), "--init", s(&w), "--steps", "1"]),
        &[
            &format!("--init '{}': {is_a}", w.display()),
            "not the one the flags build: pass --layers 1 --width 32 --context 16 --heads 2",
        ],
    );
    let wants_text = "the gpt model is a language model, which reads text: --data fortunes, text:FILE, or a token file";
    refused(&run(&["train", "--model", "gpt", "--data", "digits"]), &[&format!("--data digits: {wants_text}")]);
    refused(&run(&["eval", "--model", "gpt", "--weights", s(&w), "--data", "digits"]), &[wants_text]);
    refused(
        &run(&["train", "--model", "convnet", "--data", &readme()]),
        &["is text, which a language model reads", "the convnet model does not"],
    );
    // Heads: recorded by train, so another count is refused; a file without the record
    // (a nanoGPT state_dict) needs --heads, and with it generates what the recorded file does.
    refused(
        &run(&["generate", "--weights", s(&w), "--heads", "4"]),
        &["--heads 4 disagrees with --weights", "trained with 2 heads"],
    );
    let bare = dir.path().join("bare.safetensors");
    {
        let bytes = std::fs::read(&w).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        safetensors::serialize_to_file(st.tensors(), None, &bare).unwrap();
    }
    refused(
        &run(&["generate", "--weights", s(&bare)]),
        &["does not record its attention heads", "pass --heads H as it was trained"],
    );
    let generate = |file: &Path, extra: &[&str]| {
        let out = run(&[&["generate", "--weights", s(file), "--tokens", "30", "--seed", "5"][..], extra].concat());
        assert!(out.status.success(), "{}", text(&out).1);
        out.stdout
    };
    assert_eq!(generate(&bare, &["--heads", "2"]), generate(&w, &[]));
}

/// `--tokens 18446744073709551615` panicked ("capacity overflow"), 10^11 aborted, and a
/// long generation printed nothing until its end. Refused past the bound; each token
/// printed as it is drawn; a reader that goes away ends it with exit 0.
#[test]
fn generate_streams_its_tokens_and_bounds_their_count() {
    let dir = tempfile::tempdir().unwrap();
    let w = small_gpt(dir.path());
    for n in ["18446744073709551615", "100000000000", "1000001"] {
        let out = bin().args(["generate", "--weights", s(&w), "--tokens", n]).output().unwrap();
        refused(&out, &[&format!("--tokens {n} is more than 1000000, the most one generate prints")]);
    }
    // A million tokens take minutes of this GPT: the first 64 bytes come long before.
    let mut child = bin()
        .args(["generate", "--weights", s(&w), "--tokens", "1000000"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::Read as _;
        let mut first = [0u8; 64];
        let got = stdout.read_exact(&mut first).is_ok();
        tx.send(got).unwrap();
        stdout // dropped by the caller: the pipe's reader goes away
    });
    let streamed = rx.recv_timeout(std::time::Duration::from_secs(60)).unwrap_or(false);
    if !streamed {
        let _ = child.kill();
    }
    assert!(streamed, "no 64 bytes within 60 s");
    drop(reader.join().unwrap());
    // The reader gone, the next write fails and generate stops, exit 0.
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if t0.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(status.and_then(|s| s.code()), Some(0), "generate went on after its reader left");
}

/// `bench step --model gpt` was documented and always failed; `--context 2^64 − 1` said
/// "a window needs 0".
#[test]
fn bench_step_runs_the_gpt_and_an_absurd_context_is_refused_by_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    let out = bin()
        .args([
            "bench",
            "step",
            "--model",
            "gpt",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--batch-size",
            "2",
            "--devices",
            "cpu:1",
        ])
        .env("LOCKSTEP_FORTUNES_DIR", fortunes_dir(dir.path()))
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    // nanoGPT's CPU recipe (V 256, C 128, T 64, 4 blocks; the head tied to wte): wte
    // 32,768 + wpe 8,192 + 4 × (ln_1 256 + c_attn 49,536 + attn c_proj 16,512 + ln_2 256
    // + c_fc 66,048 + mlp c_proj 65,664) + ln_f 256 = 834,304.
    assert!(stdout.starts_with("lockstep bench step: gpt (834304 parameters)"), "{stdout}");
    assert!(stdout.contains(" tokens/s) | median step "), "{stdout}");
    let out = bin().args(["train", "--model", "gpt", "--context", "18446744073709551615"]).output().unwrap();
    refused(&out, &["--context 18446744073709551615 is more than 1048576, the largest size of a model"]);
}
