//! The everyday workflow through the binary (issue 13): `--resume DIR` alone continues a
//! run from the flags its checkpoints store, and extends a finished one; early stopping
//! and the best epoch's weights on a validation split; `predict --format`; and
//! Fashion-MNIST from Debian's `dataset-fashion-mnist` package.

use std::path::Path;
use std::process::{Command, Output};

mod common;

use lockstep::data::safetensors_file::save_safetensors_dataset;
use lockstep::data::{Dataset, Features};

use common::{skip, Rng};

fn lockstep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockstep")).args(args).output().expect("the binary runs")
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ok(args: &[&str]) -> String {
    let o = lockstep(args);
    assert!(o.status.success(), "{args:?}: {}", err(&o));
    out(&o)
}

/// The run of these tests: the lesson's MLP on toy-enlarged (20 training points, batch 2:
/// 10 steps per epoch), a constant learning rate of 0.1 and seed 3.
const RUN: [&str; 10] = ["train", "--model", "toy", "--data", "toy-enlarged", "--lr", "0.1", "--seed", "3", "--epochs"];

#[test]
fn resume_alone_continues_from_the_stored_flags_and_extends_a_finished_run() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let (resumed, full) = (dir.path().join("resumed.safetensors"), dir.path().join("full.safetensors"));
    ok(&[&RUN[..], &["2", "--checkpoint-dir", s(&ck)]].concat());
    // Finished at step 20 of 20: said so, nothing trained.
    let text = ok(&["train", "--resume", s(&ck)]);
    assert_eq!(
        text.trim_end(),
        format!(
            "lockstep: the run in {} is complete: step 20 of 20 (2 epochs); nothing to train. Give a larger --epochs or --steps to continue it.",
            ck.display()
        )
    );
    // --epochs 4 continues it with its model, data, learning rate and seed, optimiser state
    // included: bitwise the run that trained 4 epochs at once (a constant rate, so the
    // longer run's first 2 epochs are the shorter one's), and byte for byte the same file.
    let text = ok(&["train", "--resume", s(&ck), "--epochs", "4", "--save", s(&resumed)]);
    assert!(text.contains("lockstep: resuming ") && text.contains(" at step 20 (epoch 3)"), "{text}");
    assert!(text.contains("trained 20 steps (to step 40) in "), "{text}");
    assert!(text.starts_with("lockstep: toy (752 parameters, 2 classes) | "), "{text}");
    ok(&[&RUN[..], &["4", "--save", s(&full)]].concat());
    assert_eq!(std::fs::read(&resumed).unwrap(), std::fs::read(&full).unwrap());

    // Flags that would change the arithmetic must agree with the stored ones.
    let o = lockstep(&["train", "--resume", s(&ck), "--epochs", "6", "--lr", "0.2", "--batch-size", "4"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        err(&o).trim_end(),
        format!(
            "error: --resume '{}': --batch-size 4 differs from the run's --batch-size 2; --lr 0.2 differs from the run's --lr 0.1 (only --epochs, --steps, --devices, --early-stopping, --save, --save-dtype, --save-best, checkpoint and logging flags may change when resuming)",
            ck.display()
        )
    );
    let o = lockstep(&["train", "--resume", s(&ck), "--validation-split", "0.2", "--init", s(&full)]);
    assert_eq!(
        err(&o).trim_end(),
        format!(
            "error: --resume '{}': --init starts a run; a resumed run continues from its checkpoint's weights; the run had no --validation-split (only --epochs, --steps, --devices, --early-stopping, --save, --save-dtype, --save-best, checkpoint and logging flags may change when resuming)",
            ck.display()
        )
    );
    // The same values, written another way, agree.
    let text = ok(&["train", "--resume", s(&ck), "--lr", "1e-1", "--model", "toy", "--epochs", "5", "--steps", "41"]);
    assert!(text.contains("trained 1 steps (to step 41)"), "{text}");
}

/// 2-D points with random labels (see tests/early_stopping.rs: the validation loss turns
/// once the model memorises), as a safetensors file.
fn noise_file(path: &Path, n: usize) {
    let mut g = Rng(11);
    let x: Vec<f32> = (0..2 * n).map(|_| g.next_f32() * 2.0 - 1.0).collect();
    let y: Vec<u32> = (0..n).map(|_| (g.next_u64() % 2) as u32).collect();
    save_safetensors_dataset(&Dataset::new("noise", [2], Features::F32(x), y, 2).unwrap(), path).unwrap();
}

#[test]
fn early_stopping_marks_the_best_epoch_and_saves_its_weights() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("noise.safetensors");
    noise_file(&data, 80);
    let best = dir.path().join("best.safetensors");
    // The lesson's recipe, which a file of one's own does not get by default: its constant
    // learning rate makes a shorter run's epochs those of the longer one (below).
    let args = [
        "train",
        "--model",
        "toy",
        "--data",
        s(&data),
        "--validation-split",
        "0.25",
        "--optimizer",
        "sgd",
        "--lr",
        "0.5",
        "--lr-schedule",
        "constant",
        "--epochs",
        "200",
    ];
    let text = ok(&[&args[..], &["--early-stopping", "3", "--save-best", s(&best), "--batch-size", "4"]].concat());
    let epochs: Vec<&str> = text.lines().filter(|l| l.starts_with("epoch ")).collect();
    let marked: Vec<usize> =
        epochs.iter().enumerate().filter(|(_, l)| l.ends_with(" | best")).map(|(i, _)| i).collect();
    let best_epoch = *marked.last().unwrap();
    // Patience 3: the best epoch and three more, then the stop; far fewer than 200.
    assert_eq!(epochs.len(), best_epoch + 4, "{text}");
    assert_eq!(marked[0], 0, "the first epoch is the best so far: {text}");
    assert!(
        text.contains(&format!(
            "early stopping: no improvement of the validation loss in 3 epochs since epoch {}",
            best_epoch + 1
        )),
        "{text}"
    );
    let line = text.lines().find(|l| l.starts_with("best epoch ")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.starts_with(&format!("best epoch {}: validation loss ", best_epoch + 1)), "{line}");
    assert!(line.ends_with(&format!("(weights in {})", best.display())), "{line}");
    // The file holds the weights after the best epoch: byte for byte what a run of that
    // many epochs saves (the toy's constant learning rate makes them the same epochs).
    let shorter = dir.path().join("shorter.safetensors");
    let epochs_flag = (best_epoch + 1).to_string();
    ok(&[&args[..14], &[epochs_flag.as_str(), "--batch-size", "4", "--save", s(&shorter)]].concat());
    assert_eq!(std::fs::read(&best).unwrap(), std::fs::read(&shorter).unwrap());

    // Early stopping monitors a validation set, never the test split.
    let o = lockstep(&["train", "--model", "toy", "--early-stopping", "2"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        err(&o).trim_end(),
        "error: --early-stopping monitors the validation loss: give --validation-split F or --val-data (the test split only measures)"
    );
}

#[test]
fn predict_writes_text_csv_and_json_with_probabilities_and_class_names() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path().join("toy.safetensors");
    ok(&["train", "--model", "toy", "--save", s(&w)]);
    // The lesson's two test points, with names for their classes.
    let splits = lockstep::data::toy::toy();
    let named = splits.test.unwrap().with_class_names(vec!["left".into(), "right, or up".into()]).unwrap();
    let data = dir.path().join("named.safetensors");
    save_safetensors_dataset(&named, &data).unwrap();
    let base = ["predict", "--model", "toy", "--weights", s(&w), "--data", s(&data)];
    // The lesson: test accuracy 1.0, so the top classes are the labels, 0 then 1.
    let text = ok(&[&base[..], &["--format", "text"]].concat());
    let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split("  ").collect()).collect();
    assert_eq!(rows.len(), 2);
    assert_eq!((rows[0][0], rows[0][1], rows[0][3]), ("0", "0", "left"));
    assert_eq!((rows[1][0], rows[1][1], rows[1][3]), ("1", "1", "right, or up"));
    let csv = ok(&[&base[..], &["--format", "csv"]].concat());
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines[0], "index,class,name,probability,p0,p1");
    assert!(lines[1].starts_with("0,0,left,"), "{csv}");
    assert!(lines[2].starts_with("1,1,\"right, or up\","), "{csv}");
    let json = ok(&[&base[..], &["--format", "json"]].concat());
    for (i, line) in json.lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!((v["index"].as_u64(), v["class"].as_u64()), (Some(i as u64), Some(i as u64)), "{v}");
        let p: Vec<f64> = v["probabilities"].as_array().unwrap().iter().map(|p| p.as_f64().unwrap()).collect();
        // Softmax probabilities sum to 1 (f32 rounding: within 1e-6), the top one is "probability".
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-6, "{v}");
        assert_eq!(v["probability"].as_f64().unwrap(), p[i], "{v}");
        assert_eq!(v["name"], ["left", "right, or up"][i]);
    }
    // Data without names: the text has three fields, JSON a null name.
    let plain = ok(&["predict", "--model", "toy", "--weights", s(&w), "--data", "toy", "--format", "json"]);
    assert!(plain.lines().all(|l| l.contains("\"name\":null")), "{plain}");
}

#[test]
fn fashion_mnist_is_found_or_its_package_named() {
    let o = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["train", "--data", "fashion-mnist"])
        .env("LOCKSTEP_FASHION_MNIST_DIR", "/nonexistent/fashion")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        err(&o).trim_end(),
        "error: --data fashion-mnist: /nonexistent/fashion: not a directory (named by LOCKSTEP_FASHION_MNIST_DIR); unset it to use /usr/share/datasets/fashion-mnist from Debian's dataset-fashion-mnist package"
    );
    if !Path::new(lockstep::data::fashion_mnist::DEBIAN_DIR).is_dir() {
        let why = "the real data is not installed (apt-get install dataset-fashion-mnist)";
        skip::skip("fashion_mnist_is_found_or_its_package_named", skip::Need::Data, why);
        return;
    }
    // The package's files: 60,000 training and 10,000 test images of 10 classes. Three
    // steps of the convnet, then the test split is evaluated (the run's last step ends it).
    let o = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["train", "--data", "fashion-mnist", "--steps", "3", "--devices", "cpu:1"])
        .env_remove("LOCKSTEP_FASHION_MNIST_DIR")
        .output()
        .unwrap();
    let text = out(&o);
    assert!(o.status.success(), "{}", err(&o));
    let first = text.lines().next().unwrap();
    assert!(first.starts_with("lockstep: convnet (49242 parameters, 10 classes) | "), "{first}");
    assert!(
        first.ends_with(
            "data: /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz 60000 samples, /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz 10000 samples"
        ),
        "{first}"
    );
    assert!(text.contains("trained 3 steps in ") && text.contains("/10000)"), "{text}");
}

/// Issue 41: `predict` complained about labels it does not need. A file of inputs alone
/// (`x`, no `y`) is predicted, as is one whose labels are past the model's classes.
#[test]
fn predict_needs_no_labels() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path().join("toy.safetensors");
    ok(&["train", "--model", "toy", "--save", s(&w)]);
    let x: Vec<u8> = [0.1f32, 0.2, 0.9, 0.8].iter().flat_map(|v| v.to_le_bytes()).collect();
    let y: Vec<u8> = [7i64, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = |dtype, shape: Vec<usize>, data| safetensors::tensor::TensorView::new(dtype, shape, data).unwrap();
    let inputs = dir.path().join("inputs.safetensors");
    safetensors::serialize_to_file([("x", view(safetensors::Dtype::F32, vec![2, 2], &x))], None, &inputs).unwrap();
    let labelled = dir.path().join("labelled.safetensors");
    let tensors =
        [("x", view(safetensors::Dtype::F32, vec![2, 2], &x)), ("y", view(safetensors::Dtype::I64, vec![2], &y))];
    safetensors::serialize_to_file(tensors, None, &labelled).unwrap();
    let a = ok(&["predict", "--model", "toy", "--weights", s(&w), "--data", s(&inputs)]);
    assert_eq!(a.lines().count(), 2, "{a}");
    // The same inputs, the same lines, labels 7 and 9 of a 2-class model notwithstanding.
    assert_eq!(ok(&["predict", "--model", "toy", "--weights", s(&w), "--data", s(&labelled)]), a);
    // An MNIST directory holding its test images alone: no labels, no training images.
    let conv = dir.path().join("convnet.safetensors");
    ok(&["train", "--steps", "1", "--devices", "cpu:1", "--save", s(&conv)]);
    let mnist = dir.path().join("mnist");
    std::fs::create_dir(&mnist).unwrap();
    lockstep::data::idx::save_idx_images(&mnist.join("t10k-images-idx3-ubyte"), &[128; 3 * 28 * 28], [3, 28, 28])
        .unwrap();
    let text = ok(&["predict", "--weights", s(&conv), "--data", &format!("mnist:{}", mnist.display())]);
    assert_eq!(text.lines().count(), 3, "{text}");
}
