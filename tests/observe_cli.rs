//! What a run leaves to read and look at, from the outside: `train --log-format json`,
//! `train --metrics-out`, and `plot`, with the inputs they must refuse.
//!
//! Expected counts: the toy run is the lesson's (5 training points, global batch 2,
//! 3 epochs, `--model toy` defaults), so an epoch is ceil(5/2) = 3 steps and the run is
//! 3 × 3 = 9 steps and 3 epochs.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn lockstep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockstep")).args(args).output().expect("the binary runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lockstep-observe-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const STEPS: usize = 9;
const EPOCHS: usize = 3;

#[test]
fn json_log_is_one_object_per_line_on_stdout() {
    let o = lockstep(&["train", "--model", "toy", "--devices", "cpu:2", "--log-format", "json"]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(o.status.success(), "{err}");
    let objects: Vec<Value> = out
        .lines()
        .enumerate()
        .map(|(i, l)| serde_json::from_str(l).unwrap_or_else(|e| panic!("line {}: {e}: {l}", i + 1)))
        .collect();
    let steps: Vec<&Value> = objects.iter().filter(|v| v["kind"] == "step").collect();
    let epochs: Vec<&Value> = objects.iter().filter(|v| v["kind"] == "epoch").collect();
    assert_eq!(steps.len(), STEPS, "{out}");
    assert_eq!(epochs.len(), EPOCHS, "{out}");
    assert_eq!(steps.len() + epochs.len(), objects.len(), "{out}");
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["step"], i as u64 + 1, "{s}");
        assert_eq!(s["epoch"], i as u64 / 3 + 1, "{s}");
        for k in ["loss", "compute_ms", "allreduce_ms", "data_wait_ms", "samples_per_sec"] {
            assert!(s[k].as_f64().is_some_and(|x| x >= 0.0), "{k}: {s}");
        }
    }
    // The last batch of each epoch holds the 5th point alone.
    assert_eq!(steps[2]["samples"], 1);
    let last = epochs.last().unwrap();
    assert_eq!(last["epoch"], 3);
    assert_eq!(last["step"], STEPS as u64);
    // The toy data's held-out set is its test split: test_*, and no val_*.
    for k in ["train_accuracy", "test_accuracy"] {
        let a = last[k].as_f64().unwrap_or_else(|| panic!("{k}: {last}"));
        assert!((0.0..=1.0).contains(&a), "{k}: {last}");
    }
    assert!(last["val_accuracy"].is_null() && last["val_loss"].is_null(), "{last}");
    // The human lines went to stderr.
    assert_eq!(err.lines().filter(|l| l.starts_with("epoch ")).count(), EPOCHS, "{err}");
    assert!(err.contains("final test accuracy"), "{err}");
}

#[test]
fn metrics_csv_has_the_header_and_a_row_per_step_and_epoch() {
    let dir = scratch("csv");
    let csv = dir.join("m.csv");
    let o = lockstep(&["train", "--model", "toy", "--metrics-out", csv.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let body = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = body.lines().collect();
    assert_eq!(
        lines[0],
        "kind,step,epoch,loss,accuracy,val_loss,val_accuracy,test_loss,test_accuracy,best,samples_per_sec"
    );
    assert_eq!(lines.len(), 1 + STEPS + EPOCHS, "{body}");
    let epoch_rows: Vec<Vec<&str>> =
        lines.iter().filter(|l| l.starts_with("epoch,")).map(|l| l.split(',').collect()).collect();
    // Each epoch row carries the steps done by its end: 3, 6, 9.
    assert_eq!(epoch_rows.iter().map(|r| r[1]).collect::<Vec<_>>(), ["3", "6", "9"]);
    for r in &epoch_rows {
        assert_eq!(r.len(), 11, "{r:?}");
        // The held-out set is the toy's test split: test_* filled, val_* empty.
        assert_eq!((r[5], r[6]), ("", ""), "{r:?}");
        let test_acc: f64 = r[8].parse().unwrap();
        assert!((0.0..=1.0).contains(&test_acc), "{r:?}");
        assert!(r[9] == "0" || r[9] == "1", "{r:?}");
    }
    for l in lines.iter().filter(|l| l.starts_with("step,")) {
        let r: Vec<&str> = l.split(',').collect();
        assert_eq!((r.len(), &r[5..10]), (11, &["", "", "", "", ""][..]), "{l}");
        assert!(r[3].parse::<f64>().unwrap() >= 0.0, "{l}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_validation_split_is_val_per_epoch_and_the_test_split_is_evaluated_at_the_end() {
    // toy-enlarged: 20 training points (4 copies of the lesson's 5) and 8 test points; a
    // split of 0.25 holds out 5 of the 20 for validation.
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("m.csv");
    let args = ["train", "--model", "toy", "--data", "toy-enlarged", "--validation-split", "0.25", "--epochs", "2"];
    let o = lockstep(&[&args[..], &["--log-format", "json", "--metrics-out", csv.to_str().unwrap()]].concat());
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(o.status.success(), "{err}");
    let objects: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let epochs: Vec<&Value> = objects.iter().filter(|v| v["kind"] == "epoch").collect();
    assert_eq!(epochs.len(), 2);
    for e in &epochs {
        assert!(e["val_loss"].as_f64().is_some() && e["test_loss"].is_null(), "{e}");
    }
    // The first epoch is always the best so far.
    assert_eq!(epochs[0]["best"], true);
    let test = objects.last().unwrap();
    assert_eq!(test["kind"], "test", "{out}");
    // 2 epochs of ceil(15 / 2) = 8 steps.
    assert_eq!(test["step"], 16);
    assert!((0.0..=1.0).contains(&test["test_accuracy"].as_f64().unwrap()), "{test}");
    assert!(err.contains("final validation accuracy: ") && err.contains("final test accuracy: "), "{err}");
    assert!(err.contains("toy/train (validation part) 5 samples, toy/test 8 samples"), "{err}");
    let body = std::fs::read_to_string(&csv).unwrap();
    let last = body.lines().last().unwrap();
    assert!(last.starts_with("test,16,,,,,,"), "{last}");
}

#[test]
fn plot_draws_a_png_and_names_a_malformed_line() {
    let dir = scratch("plot");
    let csv = dir.join("m.csv");
    let o = lockstep(&["train", "--model", "toy", "--metrics-out", csv.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    for x in ["step", "epoch"] {
        let png = dir.join(format!("curves-{x}.png"));
        let o = lockstep(&["plot", csv.to_str().unwrap(), "-o", png.to_str().unwrap(), "--x", x]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let bytes = std::fs::read(&png).unwrap();
        // The PNG signature (RFC 2083, 3.1); a blank 1400×560 PNG compresses to a few KB,
        // two panels with text and curves to tens of KB.
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(bytes.len() > 20_000, "{} bytes", bytes.len());
    }

    let bad = dir.join("bad.csv");
    let mut body = std::fs::read_to_string(&csv).unwrap();
    body = body.replacen("step,2,1,", "step,2,1,not-a-loss,", 1);
    std::fs::write(&bad, body).unwrap();
    let out = dir.join("bad.png");
    let o = lockstep(&["plot", bad.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    let err = text(&o.stderr);
    assert!(!o.status.success());
    assert_ne!(o.status.code(), Some(101), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    // Header on line 1, step 1 on line 2, step 2 on line 3.
    assert!(err.starts_with("error: ") && err.contains("line 3"), "{err}");
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn metrics_out_into_a_missing_directory_is_refused_before_training() {
    let dir = scratch("missing");
    let target = dir.join("no-such-dir").join("m.csv");
    let o = lockstep(&["train", "--model", "toy", "--metrics-out", target.to_str().unwrap()]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("--metrics-out") && err.contains("does not exist"), "{err}");
    assert!(!text(&o.stdout).contains("epoch "), "{}", text(&o.stdout));
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}
