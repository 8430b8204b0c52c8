//! The `lockstep` binary from the outside: the lesson's run through `train --model toy`,
//! the lesson-form step lines, `inspect` and `bench allreduce`, MNIST directories,
//! model spec files and `predict`, and every bad input
//! the CLI must refuse with a non-zero exit code, ONE line on stderr naming the
//! problem, and no panic.
//!
//! Expected numbers: the lesson ("Training on GPUs") trains its 2-30-20-2 MLP with SGD
//! lr 0.5, batch 2, 3 epochs on 5 points and ends with training and test accuracy 1.0;
//! the CLI's toy defaults are that configuration.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn lockstep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockstep")).args(args).output().expect("the binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lockstep-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The number after `final test accuracy:`.
fn final_test_accuracy(out: &str) -> f64 {
    let line =
        out.lines().find(|l| l.starts_with("final test accuracy:")).unwrap_or_else(|| panic!("no accuracy: {out}"));
    line["final test accuracy:".len()..].split_whitespace().next().unwrap().parse().unwrap()
}

/// Exit code ≠ 0, exactly one line on stderr, starting `error:`, containing `needle`,
/// and no panic.
fn assert_refused(args: &[&str], needle: &str) {
    let o = lockstep(args);
    let err = stderr(&o);
    assert!(!o.status.success(), "{args:?} succeeded: {}", stdout(&o));
    assert_ne!(o.status.code(), Some(101), "{args:?} panicked: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: not one line: {err}");
    assert!(err.starts_with("error: "), "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: expected '{needle}' in: {err}");
}

#[test]
fn train_toy_reaches_the_lessons_accuracy_and_saves_weights() {
    let dir = scratch("toy");
    let w = dir.join("toy.safetensors");
    let o = lockstep(&["train", "--model", "toy", "--save", w.to_str().unwrap()]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    // The lesson: test accuracy 1.0 after 3 epochs (a tolerance of 0: 2 of 2 samples).
    assert_eq!(final_test_accuracy(&out), 1.0, "{out}");
    assert!(out.contains("final train loss") && out.contains("accuracy 1.0000"), "{out}");
    assert_eq!(out.lines().filter(|l| l.starts_with("epoch ")).count(), 3, "{out}");
    assert!(out.contains(&format!("weights saved to {}", w.display())), "{out}");

    let o = lockstep(&["inspect", w.to_str().unwrap()]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    let row = out.lines().find(|l| l.starts_with("dense0.weight")).unwrap_or_else(|| panic!("{out}"));
    assert!(row.contains("F32") && row.contains("(30, 2)"), "{row}");

    let o = lockstep(&["eval", "--weights", w.to_str().unwrap(), "--model", "toy"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.contains("accuracy 1.0000 (2/2)") && out.contains("confusion matrix"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn log_every_step_prints_the_lessons_lines() {
    let o = lockstep(&["train", "--model", "toy", "--devices", "cpu:2", "--log-every-step"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    // 3 epochs of ceil(5/2) = 3 steps, 2 replicas each: 18 lines, e.g.
    // `[cpu:1] Epoch: 001/003 | Batchsize 001 | Train/Val Loss: 0.48`.
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("[cpu:")).collect();
    assert_eq!(lines.len(), 18, "{out}");
    for l in &lines {
        let (dev, rest) = l.split_once("] Epoch: ").unwrap_or_else(|| panic!("{l}"));
        assert!(dev == "[cpu:0" || dev == "[cpu:1", "{l}");
        let (epoch, rest) = rest.split_once(" | Batchsize ").unwrap();
        assert!(["001/003", "002/003", "003/003"].contains(&epoch), "{l}");
        let (batch, loss) = rest.split_once(" | Train/Val Loss: ").unwrap();
        assert_eq!(batch.len(), 3, "{l}");
        // Global batch 2 on 2 replicas: 1 sample per shard, 0 for the second replica of
        // the last, single-sample batch (its loss is printed as '-').
        match batch {
            "001" => assert!(loss.parse::<f64>().unwrap() >= 0.0, "{l}"),
            "000" => assert_eq!(loss, "-", "{l}"),
            _ => panic!("{l}"),
        }
    }
    assert!(lines.contains(&"[cpu:1] Epoch: 001/003 | Batchsize 000 | Train/Val Loss: -"), "{out}");
}

#[test]
fn bad_inputs_are_refused_in_one_line() {
    assert_refused(&["train", "--model", "resnet"], "'resnet'");
    assert_refused(&["train", "--model", "toy", "--batch-size", "0"], "--batch-size");
    assert_refused(&["train", "--model", "toy", "--epochs", "0"], "--epochs");
    assert_refused(&["train", "--model", "toy", "--lr", "-1"], "--lr");
    assert_refused(&["train", "--model", "toy", "--dropout", "1.5"], "--dropout");
    assert_refused(&["train", "--model", "toy", "--data", "/nonexistent/d.safetensors"], "no such file");
    assert_refused(&["train", "--model", "toy", "--devices", "cpu:0"], "device count must be at least 1");
    assert_refused(&["train", "--model", "toy", "--devices", "gpu:1"], "unknown device kind");
    assert_refused(&["train", "--model", "toy", "--replicas", "3", "--devices", "cpu:2"], "--replicas 3");
    assert_refused(&["inspect", "/nonexistent/w.safetensors"], "no such file");
}

#[test]
fn malformed_data_and_weights_files_are_refused() {
    let dir = scratch("malformed");
    let bad = dir.join("bad.safetensors");
    std::fs::write(&bad, b"\x08\x00\x00\x00\x00\x00\x00\x00{not json").unwrap();
    assert_refused(&["train", "--model", "toy", "--data", bad.to_str().unwrap()], "not a valid safetensors file");
    assert_refused(&["train", "--model", "toy", "--init", bad.to_str().unwrap()], "--init");
    assert_refused(&["inspect", bad.to_str().unwrap()], "not a valid safetensors file");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn save_into_a_missing_directory_is_refused_before_training() {
    let dir = scratch("save");
    let missing = dir.join("no-such-dir");
    let target = missing.join("w.safetensors");
    let o = lockstep(&["train", "--model", "toy", "--save", target.to_str().unwrap()]);
    assert_refused(&["train", "--model", "toy", "--save", target.to_str().unwrap()], "does not exist");
    // Refused before any work: no epoch line, and nothing left behind.
    assert!(!stdout(&o).contains("epoch "), "{}", stdout(&o));
    assert!(!Path::new(&missing).exists());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_allreduce_prints_a_table_with_busbw() {
    let o = lockstep(&["bench", "allreduce", "--devices", "cpu:2", "--sizes", "4K", "--iters", "20"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    let header = out.lines().find(|l| l.contains("size(B)")).unwrap_or_else(|| panic!("{out}"));
    assert_eq!(header.matches("busbw(GB/s)").count(), 2, "trainer and classic columns: {header}");
    let row: Vec<&str> = out.lines().find(|l| l.trim_start().starts_with("4096")).unwrap().split_whitespace().collect();
    // size, count, then (time, algbw, busbw) twice with '|' separators.
    assert_eq!(row[1], "1024", "{row:?}");
    let numbers: Vec<f64> = row.iter().filter(|t| **t != "|").map(|t| t.parse().unwrap()).collect();
    assert_eq!(numbers.len(), 8, "{row:?}");
    // Two members: busbw = algbw · 2(n−1)/n = algbw.
    assert!(numbers[2] > 0.0 && (numbers[3] - numbers[4]).abs() <= 0.01, "{row:?}");
}

/// Writes a tiny MNIST directory: `n_train` and `n_test` 28×28 images whose label is
/// the row of their single bright stripe (0..9), so that a classifier has something to
/// learn; returns the directory.
fn tiny_mnist(name: &str, n_train: usize, n_test: usize) -> PathBuf {
    use lockstep::data::idx::{save_idx_images, save_idx_labels};
    let dir = scratch(name);
    for (prefix, n, gz) in [("train", n_train, false), ("t10k", n_test, true)] {
        let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
        let mut px = vec![0u8; n * 28 * 28];
        for (img, &l) in px.chunks_exact_mut(28 * 28).zip(&labels) {
            img[(2 + 2 * l as usize) * 28..(3 + 2 * l as usize) * 28].fill(255);
        }
        let sfx = if gz { ".gz" } else { "" };
        save_idx_images(&dir.join(format!("{prefix}-images-idx3-ubyte{sfx}")), &px, [n, 28, 28]).unwrap();
        save_idx_labels(&dir.join(format!("{prefix}-labels-idx1-ubyte{sfx}")), &labels).unwrap();
    }
    dir
}

#[test]
fn train_then_predict_on_an_mnist_directory() {
    let dir = tiny_mnist("mnist", 64, 16);
    let data = format!("mnist:{}", dir.display());
    let w = dir.join("w.safetensors");
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/mnist_convnet.json");
    let o = lockstep(&[
        "train",
        "--model",
        spec,
        "--data",
        &data,
        "--epochs",
        "1",
        "--devices",
        "cpu:2",
        "--save",
        w.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    // 64 training and 16 test samples, as written above.
    assert!(out.contains("64 samples") && out.contains("16 samples"), "{out}");
    let acc = final_test_accuracy(&out);
    assert!((0.0..=1.0).contains(&acc), "{out}");

    // predict: one line `index  class  probability` per input, in order; --limit cuts.
    let images = dir.join("t10k-images-idx3-ubyte.gz");
    for (data, limit, lines) in [(data.as_str(), "5", 5), (images.to_str().unwrap(), "100", 16)] {
        let o =
            lockstep(&["predict", "--weights", w.to_str().unwrap(), "--model", spec, "--data", data, "--limit", limit]);
        let out = stdout(&o);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(out.lines().count(), lines, "{out}");
        for (i, line) in out.lines().enumerate() {
            let f: Vec<&str> = line.split("  ").collect();
            assert_eq!(f.len(), 3, "{line}");
            assert_eq!(f[0].parse::<usize>().unwrap(), i, "{line}");
            assert!(f[1].parse::<usize>().unwrap() < 10, "{line}");
            let p: f64 = f[2].parse().unwrap();
            // The top probability of 10 classes is at least 1/10 (rounded to 4 places).
            assert!((0.0999..=1.0).contains(&p), "{line}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_spec_file_trains_like_the_built_in_toy() {
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/toy_mlp.json");
    let o = lockstep(&["train", "--model", spec, "--data", "toy"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    // The lesson's result, as for --model toy above (flat specs get the toy's defaults).
    assert_eq!(final_test_accuracy(&out), 1.0, "{out}");
    let o =
        lockstep(&["train", "--model", "toy", "--data", "toy-enlarged", "--epochs", "1", "--validation-split", "0.5"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    // The held-out half replaces the test split in the evaluation and the final line.
    assert!(out.contains("final validation accuracy:"), "{out}");
}

#[test]
fn bad_mnist_files_and_specs_are_refused_in_one_line() {
    let dir = tiny_mnist("mnist-bad", 4, 2);
    let data = format!("mnist:{}", dir.display());
    let labels = dir.join("train-labels-idx1-ubyte");
    let images = dir.join("train-images-idx3-ubyte");
    // Count mismatch: 3 labels for 4 images.
    std::fs::write(&labels, [0, 0, 8, 1, 0, 0, 0, 3, 1, 2, 3]).unwrap();
    assert_refused(&["train", "--data", &data], "train-labels-idx1-ubyte: 3 labels for the 4 images");
    // Wrong magic: an images header in the labels file.
    std::fs::write(&labels, [0, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 7]).unwrap();
    assert_refused(&["train", "--data", &data], "wrong magic number 0x00000803, expected 0x00000801");
    // Truncated: the header promises 4 images of 28×28, the file stops after 10 bytes.
    let bytes = std::fs::read(&images).unwrap();
    std::fs::write(&images, &bytes[..26]).unwrap();
    assert_refused(&["train", "--data", &data], "train-images-idx3-ubyte: truncated data: 10 values");
    assert_refused(&["predict", "--weights", "w", "--data", images.to_str().unwrap()], "no such file");
    assert_refused(&["train", "--data", "mnist:/nonexistent"], "/nonexistent: not a directory");

    let spec = dir.join("bad.json");
    std::fs::write(
        &spec,
        r#"{"input_shape": [1, 28, 28], "layers": [{"type": "relu"}, {"type": "relu"}, {"type": "relu"},
            {"type": "conv2d", "filters": -1, "kernel_size": 3}]}"#,
    )
    .unwrap();
    assert_refused(
        &["train", "--model", spec.to_str().unwrap()],
        "bad.json: layer 3 (conv2d): field 'filters' must be a positive integer",
    );
    assert_refused(&["train", "--model", "toy", "--validation-split", "1.5"], "--validation-split");
    assert_refused(&["train", "--model", "toy", "--val-data", "/nonexistent.safetensors"], "no such file");
    std::fs::remove_dir_all(&dir).unwrap();
}
