//! The command line against hostile and careless input (issue 13): labels that would size
//! the model, runs and benchmarks that cannot fit in memory, files whose headers lie,
//! two runs on one checkpoint directory, non-finite values, and the messages that used
//! to mislead. Each case asserts the exact message (the parts a machine changes — its
//! free memory, a pid — are matched around), the exit code 2, and that the refusal comes
//! before any work.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use lockstep::data::idx::{save_idx_images, save_idx_labels};
use lockstep::data::safetensors_file::save_safetensors_dataset;
use lockstep::data::{Dataset, Features};

fn lockstep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockstep")).args(args).output().expect("the binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Refused with exit code 2 and exactly one stderr line, which is returned.
fn refused(args: &[&str]) -> String {
    let o = lockstep(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}{}", stdout(&o));
    assert_eq!(err.lines().count(), 1, "{args:?}: not one line: {err}");
    assert!(!stdout(&o).contains("epoch "), "{args:?} trained: {}", stdout(&o));
    err.trim_end().to_string()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// An MNIST-format directory of 8 training and 2 test images (28×28) with labels 0..7 and
/// 0, 1; the training label of sample 3 replaced by `label3`.
fn mnist_dir(dir: &Path, label3: u8) -> PathBuf {
    let d = dir.join("mnist");
    std::fs::create_dir_all(&d).unwrap();
    let mut labels: Vec<u8> = (0..8).collect();
    labels[3] = label3;
    save_idx_images(&d.join("train-images-idx3-ubyte"), &vec![7; 8 * 28 * 28], [8, 28, 28]).unwrap();
    save_idx_labels(&d.join("train-labels-idx1-ubyte"), &labels).unwrap();
    save_idx_images(&d.join("t10k-images-idx3-ubyte.gz"), &vec![7; 2 * 28 * 28], [2, 28, 28]).unwrap();
    save_idx_labels(&d.join("t10k-labels-idx1-ubyte.gz"), &[0, 1]).unwrap();
    d
}

/// Writes a dataset of flat samples `x` (N, F) with labels `y`, declaring `classes`.
fn flat_dataset(path: &Path, features: usize, x: Vec<f32>, y: Vec<u32>, classes: usize) {
    let ds = Dataset::new("d", [features], Features::F32(x), y, classes).unwrap();
    save_safetensors_dataset(&ds, path).unwrap();
}

/// Writes raw safetensors bytes of `x` (F32, (N, F)) and `y` (I64), no metadata: a file
/// whose class count lockstep must infer.
fn raw_dataset(path: &Path, features: usize, x: &[f32], y: &[i64]) {
    use safetensors::tensor::{Dtype, TensorView};
    let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let yb: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
    let views = [
        ("x", TensorView::new(Dtype::F32, vec![y.len(), features], &xb).unwrap()),
        ("y", TensorView::new(Dtype::I64, vec![y.len()], &yb).unwrap()),
    ];
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

#[test]
fn labels_outside_the_models_classes_are_refused_naming_file_sample_and_value() {
    let dir = tempfile::tempdir().unwrap();
    // Fashion-MNIST's format with one label 200: it used to train a 201-class convnet.
    let mnist = mnist_dir(dir.path(), 200);
    let data = format!("mnist:{}", mnist.display());
    assert_eq!(
        refused(&["train", "--data", &data]),
        format!(
            "error: {}: label 200 of sample 3 is outside the MNIST format's 10 classes (0 to 9)",
            mnist.join("train-labels-idx1-ubyte").display()
        )
    );
    // A stated class count takes it, and the first line says how many the model has.
    let o = lockstep(&["train", "--data", &data, "--classes", "201", "--steps", "1", "--devices", "cpu:1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The convnet has 46,672 parameters before its last Dense, which has 256·201 + 201 =
    // 51,657 (see the table in src/models.rs): 98,329.
    let first = stdout(&o).lines().next().unwrap().to_string();
    assert!(first.starts_with("lockstep: convnet (98329 parameters, 201 classes) | "), "{first}");

    // A safetensors label of 2^31 − 1 (it made a toy model of 45 billion parameters).
    let big = dir.path().join("big-label.safetensors");
    raw_dataset(&big, 2, &[0.0; 6], &[0, (1 << 31) - 1, 1]);
    assert_eq!(
        refused(&["train", "--model", "toy", "--data", s(&big)]),
        format!(
            "error: {}: label 2147483647 of sample 1 is above the 65536 classes lockstep infers from labels; a dataset with more states its class count (metadata 'num_classes', or --classes)",
            big.display()
        )
    );
    // A model of fixed classes (a spec with 2 outputs) names the first label it cannot output.
    let three = dir.path().join("three.safetensors");
    raw_dataset(&three, 2, &[0.0; 6], &[0, 1, 2]);
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/toy_mlp.json");
    assert_eq!(
        refused(&["train", "--model", spec, "--data", s(&three)]),
        format!("error: dataset {}: label 2 of sample 2 is outside the model's 2 classes (0 to 1)", three.display())
    );
    // The toy model's first line states its classes: the lesson's 2.
    let o = lockstep(&["train", "--model", "toy", "--steps", "1"]);
    assert!(stdout(&o).starts_with("lockstep: toy (752 parameters, 2 classes) | "), "{}", stdout(&o));
}

#[test]
fn eval_takes_the_class_count_from_the_weights_and_refuses_labels_beyond_it() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path().join("toy.safetensors");
    let o = lockstep(&["train", "--model", "toy", "--save", s(&w)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let three = dir.path().join("three.safetensors");
    raw_dataset(&three, 2, &[0.0; 6], &[0, 1, 2]);
    assert_eq!(
        refused(&["eval", "--model", "toy", "--weights", s(&w), "--data", s(&three)]),
        format!("error: dataset {}: label 2 of sample 2 is outside the model's 2 classes (0 to 1)", three.display())
    );
}

#[test]
fn what_cannot_fit_in_memory_is_refused_before_any_allocation() {
    let dir = tempfile::tempdir().unwrap();
    // The issue's conv of 1,048,576 filters on 28×28 images. Per sample its output is
    // 2^20 · 784 = 822,083,584 values; a training shard of 32 keeps the conv's input and
    // output and holds the widest pair around the running layer: 318.1 GB of activations,
    // more than any machine this runs on (the evaluation after each epoch passes no more
    // than a training pass's 32 images, not the test set's 360 in one chunk).
    let spec = dir.path().join("wide.json");
    std::fs::write(
        &spec,
        r#"{"input_shape": [1, 28, 28], "layers": [{"type": "conv2d", "filters": 1048576, "kernel_size": 3, "padding": "same"},
            {"type": "global_average_pooling2d"}, {"type": "dense", "units": 10}]}"#,
    )
    .unwrap();
    let t0 = Instant::now();
    let e = refused(&["train", "--model", s(&spec), "--devices", "cpu:1"]);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(e.starts_with("error: training needs an estimated 318.9 GB but "), "{e}");
    assert!(e.contains(": activations 318.1 GB (1 device(s) × a shard of 32 samples), "), "{e}");
    // Parameters: 2^20 · 9 + 2^20 (the conv) + 2^20 · 10 + 10 (the Dense) = 20,971,530,
    // in a flat buffer whose tensors start on multiples of 64 (the Dense bias takes 64):
    // 20,971,584 values.
    assert!(e.contains("weights 167.8 MB (2 copies of 20,971,584 values)"), "{e}");

    // A global batch past the training set is the whole set at every step: the digits'
    // 1,437 images, estimated as such (a batch of 100,000 would be 26 GB).
    let o = lockstep(&["train", "--batch-size", "100000", "--steps", "1", "--devices", "cpu:1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains(" | global batch 1437 (every training sample; --batch-size 100000) | "),
        "{}",
        stdout(&o)
    );

    // Logical replicas past the batch size: each would hold a gradient slot for no sample.
    assert_eq!(
        refused(&["train", "--replicas", "1000000", "--devices", "cpu:1"]),
        "error: --replicas 1000000 is more than the global batch of 32: each logical replica needs a sample of every batch (at most 32, or a larger --batch-size)"
    );

    // Benchmarks: a 1 TiB all-reduce on 2 members needs 5 buffers of it (a slot and a
    // buffer per member, the reduced chunks): 5 · 2^40 B = 5.5 TB.
    let e = refused(&["bench", "allreduce", "--devices", "cpu:2", "--sizes", "1024G"]);
    assert!(
        e.starts_with("error: bench allreduce of 1099511627776 bytes on 2 members needs an estimated 5.5 TB but "),
        "{e}"
    );
    assert_eq!(
        refused(&["bench", "allreduce", "--devices", "cpu:2", "--sizes", "4K", "--iters", "100000000000"]),
        "error: --iters 100000000000 is more than the 1000000 a benchmark runs at most"
    );
    assert_eq!(
        refused(&["bench", "step", "--model", "toy", "--steps", "2000000"]),
        "error: --steps 2000000 is more than the 1000000 a benchmark runs at most"
    );
    let cores = lockstep::devices::available_cores();
    assert_eq!(
        refused(&["bench", "layers", "--threads", "100000"]),
        format!("error: --threads 100000 is more than 64 per core ({} here)", 64 * cores)
    );
    // 10 million convnet samples at 225,984 B each (see `memory::shard_activations`) and
    // the gathered batch of 784 f32 each: 2.29 TB.
    let e = refused(&["bench", "layers", "--batch-size", "10000000", "--threads", "1"]);
    assert!(e.starts_with("error: bench layers needs an estimated 2.3 TB but "), "{e}");
    let e = refused(&["bench", "allreduce", "--devices", "cpu:100000"]);
    assert!(e.contains("threads in all is more than 64 per core"), "{e}");
}

#[test]
fn a_4_gb_file_with_a_zero_header_length_fails_at_once() {
    let dir = tempfile::tempdir().unwrap();
    // 4 GiB, sparse: its header length (the first 8 bytes) is 0. Read whole, it took 24 s
    // and 4.1 GB of memory; checked first, it takes a few milliseconds.
    let big = dir.path().join("big.safetensors");
    std::fs::File::create(&big).unwrap().set_len(4 << 30).unwrap();
    let expected =
        format!("{}: not a valid safetensors file: header length 0 is too small for any header", big.display());
    let ck = dir.path().join("ck");
    std::fs::create_dir_all(&ck).unwrap();
    std::fs::hard_link(&big, ck.join("checkpoint-000000000001.safetensors")).unwrap();
    let cases: [(Vec<&str>, String); 5] = [
        (vec!["inspect", s(&big)], format!("error: {expected}")),
        (vec!["train", "--model", "toy", "--data", s(&big)], format!("error: {expected}")),
        (vec!["train", "--model", "toy", "--init", s(&big)], format!("error: --init: {expected}")),
        (vec!["eval", "--model", "toy", "--weights", s(&big)], format!("error: --weights: {expected}")),
        (
            vec!["train", "--resume", s(&ck)],
            format!(
                "error: {}: not a valid safetensors file: header length 0 is too small for any header; pass --resume-fallback to continue from the newest intact checkpoint",
                ck.join("checkpoint-000000000001.safetensors").display()
            ),
        ),
    ];
    for (args, message) in cases {
        let t0 = Instant::now();
        assert_eq!(refused(&args), message);
        let took = t0.elapsed();
        // A generous bound for a loaded machine: reading 4 GB took 24 s.
        assert!(took < Duration::from_secs(2), "{args:?} took {took:?}");
    }
}

#[test]
fn a_second_run_on_a_checkpoint_directory_is_refused_naming_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let mut first = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["train", "--epochs", "50", "--devices", "cpu:1", "--checkpoint-dir", s(&ck)])
        .args(["--checkpoint-every", "1000000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Its first line comes after it took the lock.
    let mut out = std::io::BufReader::new(first.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let pid = first.id();
    let e = refused(&["train", "--model", "toy", "--checkpoint-dir", s(&ck)]);
    assert_eq!(
        e,
        format!(
            "error: --checkpoint-dir: {}: in use by another lockstep run (pid {pid}); wait for it to end, or choose another directory",
            ck.display()
        )
    );
    let e = refused(&["train", "--resume", s(&ck)]);
    assert!(e.contains(&format!("in use by another lockstep run (pid {pid})")), "{e}");
    // Killed outright, it leaves its pid in the lock file; the kernel has released the
    // lock, so the next run takes it over and says so.
    first.kill().unwrap();
    first.wait().unwrap();
    let o = lockstep(&["train", "--model", "toy", "--checkpoint-dir", s(&ck)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        stderr(&o).trim_end(),
        format!("lockstep: {}: taking over the lock of pid {pid}, which is no longer running", ck.display())
    );
    // Released in order, the lock file is empty: the next run has nothing to take over.
    assert_eq!(std::fs::read_to_string(ck.join("lockstep.lock")).unwrap(), "");
}

#[test]
fn the_same_run_saves_byte_identical_files() {
    // The same flags twice, the same --save path included (a checkpoint records it, for
    // --resume); the first run's files are moved aside before the second.
    let dir = tempfile::tempdir().unwrap();
    let (w, first) = (dir.path().join("w.safetensors"), dir.path().join("first.safetensors"));
    let (ck, ca) = (dir.path().join("ck"), dir.path().join("ca"));
    let run = || {
        let o = lockstep(&["train", "--model", "toy", "--save", s(&w), "--checkpoint-dir", s(&ck)]);
        assert!(o.status.success(), "{}", stderr(&o));
    };
    run();
    std::fs::rename(&w, &first).unwrap();
    std::fs::rename(&ck, &ca).unwrap();
    run();
    assert_eq!(std::fs::read(&first).unwrap(), std::fs::read(&w).unwrap());
    // The lesson's 9 steps, one checkpoint per epoch of 3: the last three, 3, 6 and 9.
    for step in [3, 6, 9] {
        let name = format!("checkpoint-{step:012}.safetensors");
        assert_eq!(std::fs::read(ca.join(&name)).unwrap(), std::fs::read(ck.join(&name)).unwrap(), "{name}");
    }
}

#[test]
fn non_finite_values_are_named_on_load() {
    let dir = tempfile::tempdir().unwrap();
    // x (4, 2): flat index 5 is sample 2, value 1.
    let nan = dir.path().join("nan.safetensors");
    let mut x = vec![0.25f32; 8];
    x[5] = f32::NAN;
    flat_dataset(&nan, 2, x, vec![0, 1, 0, 1], 2);
    assert_eq!(
        refused(&["train", "--model", "toy", "--data", s(&nan)]),
        format!(
            "error: {}: tensor 'x' holds NaN at sample 2, value 1 (flat index 5): features must be finite",
            nan.display()
        )
    );
    // Weights with an infinity: refused for --init, and by eval (which used to print an
    // accuracy of chance).
    let w = dir.path().join("w.safetensors");
    let o = lockstep(&["train", "--model", "toy", "--save", s(&w)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let model = lockstep::models::toy_mlp(2, 2).unwrap();
    let mut store = lockstep::weights::load(&model, &w).unwrap();
    let bias = model.param_infos().iter().find(|t| t.name == "dense0.bias").unwrap().range.start;
    store.params[bias + 1] = f32::INFINITY;
    let bad = dir.path().join("inf.safetensors");
    lockstep::weights::save(&model, &store, &bad).unwrap();
    let problem = format!(
        "{}: these weights cannot be loaded into the model: tensor 'dense0.bias' holds inf at index 1",
        bad.display()
    );
    assert_eq!(refused(&["train", "--model", "toy", "--init", s(&bad)]), format!("error: --init: {problem}"));
    assert_eq!(refused(&["eval", "--model", "toy", "--weights", s(&bad)]), format!("error: --weights: {problem}"));
}

#[test]
fn messages_say_what_is_actually_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    // A spec size beyond the limit states the limit.
    let spec = dir.path().join("huge.json");
    std::fs::write(&spec, r#"{"input_shape": [2], "layers": [{"type": "dense", "units": 1e9}]}"#).unwrap();
    let cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec!["train", "--model", s(&spec)],
            format!("error: {}: layer 0 (dense): field 'units' is 1000000000, above the limit of 1048576 (2^20) for a size", spec.display()),
        ),
        (
            vec!["train", "--resume", s(&file)],
            format!("error: --resume '{}': is a file, not a checkpoint directory (give the directory --checkpoint-dir wrote)", file.display()),
        ),
        (vec!["train", "--model", "toy", "--checkpoint-dir", s(&file)], format!("error: --checkpoint-dir '{}': is a file, not a directory", file.display())),
        (vec!["inspect", s(dir.path())], format!("error: inspect '{}': is a directory, not a file", dir.path().display())),
        (vec!["train", "--model", "toy", "--data", s(&fifo)], format!("error: --data '{}': is not a regular file (a FIFO)", fifo.display())),
        (vec!["eval", "--model", "toy", "--weights", s(&fifo)], format!("error: --weights '{}': is not a regular file (a FIFO)", fifo.display())),
    ];
    for (args, message) in cases {
        assert_eq!(refused(&args), message, "{args:?}");
    }
    // The same file for two outputs: the second writer would destroy the first's.
    let x = dir.path().join("x");
    assert_eq!(
        refused(&["train", "--model", "toy", "--save", s(&x), "--metrics-out", s(&x)]),
        format!("error: --metrics-out '{}' is the file --save writes too: give each output its own file", x.display())
    );
    let rel = dir.path().join(".").join("x");
    let e = refused(&["train", "--model", "toy", "--save", s(&x), "--save-best", s(&rel), "--validation-split", "0.5"]);
    assert!(e.contains("is the file --save writes too"), "{e}");
}

#[test]
fn a_directory_of_corrupt_checkpoints_and_a_finished_run_are_said_so() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let o = lockstep(&["train", "--model", "toy", "--checkpoint-dir", s(&ck)]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The lesson's 9 steps, one checkpoint per epoch: steps 3, 6, 9.
    let o = lockstep(&["train", "--resume", s(&ck)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        stdout(&o).trim_end(),
        format!(
            "lockstep: the run in {} is complete: step 9 of 9 (3 epochs); nothing to train. Give a larger --epochs or --steps to continue it.",
            ck.display()
        )
    );
    for step in [3, 6, 9] {
        let path = ck.join(format!("checkpoint-{step:012}.safetensors"));
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 1] ^= 1; // the last byte of the last tensor: the header still reads
        std::fs::write(&path, &bytes).unwrap();
    }
    assert_eq!(
        refused(&["train", "--resume", s(&ck), "--resume-fallback"]),
        format!(
            "error: {}: every checkpoint in it is corrupt (3 files; the newest, checkpoint-000000000009.safetensors: checksum mismatch: the checkpoint is corrupt)",
            ck.display()
        )
    );
}

#[test]
fn a_checkpoint_of_another_configuration_is_named_in_words() {
    // The issue: mismatches printed as Rust debug (`Some(600) there, Some(900) here`). A
    // spec edited between a run and its resume: the layers differ, said as layers.
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.json");
    let ck = dir.path().join("ck");
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/toy_mlp.json")).unwrap();
    std::fs::write(&spec, &text).unwrap();
    let o = lockstep(&["train", "--model", s(&spec), "--data", "toy", "--checkpoint-dir", s(&ck), "--steps", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::write(&spec, text.replace("\"units\": 20", "\"units\": 21")).unwrap();
    assert_eq!(
        refused(&["train", "--resume", s(&ck), "--epochs", "5"]),
        format!(
            "error: {}: written by a different run: layers is Dense(2→30) → ReLU → Dense(30→20) → ReLU → Dense(20→2) there, Dense(2→30) → ReLU → Dense(30→21) → ReLU → Dense(21→2) here",
            ck.join("checkpoint-000000000004.safetensors").display()
        )
    );
}

/// The optimiser recipes of issue 18: a clip norm that is not a positive number, a
/// negative or NaN weight decay, Nesterov without momentum or with Adam, a warm-up that is
/// no step count, an unknown parameter group: each refused in one line naming the flag,
/// with exit code 2, before any work.
#[test]
fn bad_optimizer_recipes_are_refused_in_one_line() {
    let train = |extra: &[&str]| {
        let mut args = vec!["train", "--model", "toy"];
        args.extend_from_slice(extra);
        refused(&args)
    };
    let clip = "error: --clip-grad-norm must be a positive number (the largest gradient norm), got";
    // A value that starts with '-' is the flag's, whatever clap makes of it as a number.
    for (value, shown) in [("0", "0"), ("-1", "-1"), ("NaN", "NaN"), ("inf", "inf"), ("-0", "-0"), ("-1e-3", "-0.001")]
    {
        assert_eq!(train(&["--clip-grad-norm", value]), format!("{clip} {shown}"));
    }
    assert_eq!(
        train(&["--clip-grad-norm", "abc"]),
        "error: invalid value 'abc' for '--clip-grad-norm <C>': invalid float literal"
    );
    for (value, shown) in [("-0.1", "-0.1"), ("NaN", "NaN"), ("inf", "inf")] {
        assert_eq!(
            train(&["--weight-decay", value]),
            format!("error: --weight-decay must be a number >= 0, got {shown}")
        );
    }
    assert_eq!(train(&["--nesterov"]), "error: --nesterov needs --momentum above 0 (Nesterov momentum)");
    // Each optimiser's settings are refused with the other, whatever their value, naming it.
    let adam_own = "its own are --adam-beta1, --adam-beta2 and --adam-eps";
    assert_eq!(
        train(&["--optimizer", "adamw", "--nesterov"]),
        format!("error: --nesterov is an SGD setting; --optimizer adamw has none ({adam_own})")
    );
    for momentum in ["0.9", "0"] {
        assert_eq!(
            train(&["--optimizer", "adam", "--momentum", momentum]),
            format!("error: --momentum is an SGD setting; --optimizer adam has none ({adam_own})")
        );
    }
    for flag in ["--adam-beta1", "--adam-beta2", "--adam-eps"] {
        assert_eq!(
            train(&[flag, "0.5"]),
            format!("error: {flag} is an Adam and AdamW setting; --optimizer sgd has none (its own are --momentum and --nesterov)")
        );
    }
    assert_eq!(
        train(&["--warmup-steps", "-3"]),
        "error: invalid value '-3' for '--warmup-steps <N>': a negative number: this flag takes a whole number, 0 or more"
    );
    assert_eq!(
        train(&["--weight-decay-on", "biases"]),
        "error: invalid value 'biases' for '--weight-decay-on <WHICH>' [possible values: weights, all]"
    );
}

/// Issue 41, the command line as typed: a mistyped flag keeps clap's tip (on the one
/// line of the error); a value that starts with '-' is its flag's, judged by the flag's
/// own check (`--prompt -abc` is a prompt); a time limit names the units it takes and
/// refuses a clock's 99 minutes.
#[test]
fn mistyped_flags_hyphen_values_and_time_limits_are_said_in_one_line() {
    for (typed, meant) in [("--epoch", "--epochs"), ("--devcies", "--devices"), ("--batchsize", "--batch-size")] {
        assert_eq!(
            refused(&["train", typed, "3"]),
            format!("error: unexpected argument '{typed}' found; tip: a similar argument exists: '{meant}'")
        );
    }
    let limit = |v: &str, why: &str| {
        format!("error: invalid value '{v}' for '--time-limit <DURATION>': '{v}' is not a duration ({why}); write e.g. 90s, 45m, 3h50m or 1:30:00")
    };
    for (v, why) in [
        ("-1s", "negative: a time limit is 0 or more"),
        ("1ms", "unknown unit 'ms': the units are d, h, m and s, as in 1d2h3m4.5s"),
        ("1:99:00", "99 minutes: a clock's minutes are below 60"),
    ] {
        assert_eq!(refused(&["train", "--model", "toy", "--time-limit", v]), limit(v, why));
    }
    // The prompt parses: what is refused is the missing weights file.
    let e = refused(&["generate", "--weights", "/nonexistent/w.safetensors", "--prompt", "-abc"]);
    assert!(e.starts_with("error: --weights '/nonexistent/w.safetensors'"), "{e}");
}

/// Issue 18's `--augment` and `--label-smoothing`: a value out of range, a word the
/// augmentation does not know, and augmenting data that are not images (C, H, W) are each
/// one line naming the problem, before any work.
#[test]
fn bad_augmentation_and_label_smoothing_are_refused_naming_the_problem() {
    let padding = |p: &str| {
        format!(
            "error: invalid value 'crop={p}' for '--augment <crop=P,flip>': crop={p}: the padding P must be a whole number of pixels from 1 to 65536"
        )
    };
    let owned = |flags: &[&str]| flags.iter().map(|f| f.to_string()).collect::<Vec<String>>();
    let mut cases: Vec<(Vec<String>, String)> = ["0", "-3", "abc", "", "1.5", "99999999999999999999999"]
        .iter()
        .map(|p| (vec!["--augment".to_string(), format!("crop={p}")], padding(p)))
        .collect();
    cases.extend([
        (
            owned(&["--augment", "rotate"]),
            "error: invalid value 'rotate' for '--augment <crop=P,flip>': unknown augmentation 'rotate' (expected crop=P and/or flip, e.g. crop=4,flip)".to_string(),
        ),
        (
            owned(&["--augment", "flip,flip"]),
            "error: invalid value 'flip,flip' for '--augment <crop=P,flip>': flip is given twice".to_string(),
        ),
        (
            owned(&["--model", "toy", "--augment", "crop=4,flip"]),
            "error: --augment crop=4,flip needs image data (samples of shape (C, H, W)); the samples of toy/train are (2)".to_string(),
        ),
        (
            owned(&["--model", "toy", "--data", "toy-enlarged", "--augment", "flip"]),
            "error: --augment flip needs image data (samples of shape (C, H, W)); the samples of toy/train are (2)".to_string(),
        ),
    ]);
    for eps in ["-0.1", "1", "1.5", "NaN", "inf"] {
        let shown = eps.parse::<f32>().unwrap();
        cases.push((
            owned(&["--label-smoothing", eps]),
            format!("error: --label-smoothing must be in [0, 1), got {shown}"),
        ));
    }
    cases.push((
        owned(&["--label-smoothing", "lots"]),
        "error: invalid value 'lots' for '--label-smoothing <EPS>': invalid float literal".to_string(),
    ));
    for (flags, message) in cases {
        let args: Vec<&str> = ["train", "--devices", "cpu:1", "--epochs", "1"]
            .into_iter()
            .chain(flags.iter().map(String::as_str))
            .collect();
        assert_eq!(refused(&args), message, "{args:?}");
    }
}

// ---------------------------------------------------------------------------------------
// Issue 19's minor items: each case failed (or said something untrue) before its fix.

/// A spec whose output is not (N, classes), here a convolution's (4, 26, 26), is refused
/// by the shapes before any step (it failed at step 0 with exit 1).
#[test]
fn a_spec_whose_output_is_not_one_row_of_classes_is_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("noflat.json");
    std::fs::write(
        &spec,
        r#"{"input_shape": [1, 28, 28], "layers": [{"type": "conv2d", "filters": 4, "kernel_size": 3}]}"#,
    )
    .unwrap();
    assert_eq!(
        refused(&["train", "--model", s(&spec), "--data", "digits"]),
        "error: dataset digits/train: samples with 1 label(s) each do not fit the model's output (4, 26, 26)"
    );
}

/// `"filters": 18446744073709551615` was quoted as …616 (through f64).
#[test]
fn a_huge_integer_in_a_spec_is_quoted_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("huge.json");
    std::fs::write(
        &spec,
        r#"{"input_shape": [1, 8, 8], "layers": [{"type": "conv2d", "filters": 18446744073709551615, "kernel_size": 3},
            {"type": "flatten"}, {"type": "dense", "units": 10}]}"#,
    )
    .unwrap();
    assert_eq!(
        refused(&["train", "--model", s(&spec), "--data", "digits"]),
        format!(
            "error: {}: layer 0 (conv2d): field 'filters' is 18446744073709551615, above the limit of 1048576 (2^20) for a size",
            spec.display()
        )
    );
}

/// `--classes 7` with a model of 2 outputs was ignored while the first line said "7
/// classes"; the same for eval and predict. A built-in model is sized by it and agrees.
#[test]
fn classes_that_disagree_with_the_model_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/toy_mlp.json");
    let said = "error: --classes 7 disagrees with the model, whose output (2) has 2 classes";
    assert_eq!(refused(&["train", "--model", spec, "--data", "toy", "--classes", "7"]), said);
    let w = dir.path().join("w.safetensors");
    let o = lockstep(&["train", "--model", spec, "--data", "toy", "--classes", "2", "--save", s(&w)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("2 classes"), "{}", stdout(&o));
    for cmd in ["eval", "predict"] {
        assert_eq!(refused(&[cmd, "--model", spec, "--data", "toy", "--weights", s(&w), "--classes", "7"]), said);
    }
    let o = lockstep(&["train", "--model", "toy", "--classes", "3", "--epochs", "1"]);
    assert!(o.status.success() && stdout(&o).contains("3 classes"), "{}", stderr(&o));
}

/// `predict` and `eval` of a 2-class model on a file naming 3 classes (`class_names`)
/// were accepted, and predict printed no names. Refused, naming the file's classes; a
/// file whose names fit prints them.
#[test]
fn class_names_that_do_not_fit_the_model_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path().join("toy.safetensors");
    let o = lockstep(&["train", "--model", "toy", "--save", s(&w)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let named = |path: &Path, names: &[&str]| {
        let ds = Dataset::new("d", [2], Features::F32(vec![0.5; 8]), vec![0, 1, 0, 1], names.len()).unwrap();
        let ds = ds.with_class_names(names.iter().map(|n| n.to_string()).collect()).unwrap();
        save_safetensors_dataset(&ds, path).unwrap();
    };
    let three = dir.path().join("three.safetensors");
    named(&three, &["cat", "dog", "bird"]);
    for cmd in ["eval", "predict"] {
        assert_eq!(
            refused(&[cmd, "--model", "toy", "--weights", s(&w), "--data", s(&three)]),
            format!(
                "error: dataset {}: names 3 classes (cat, dog, bird: its class_names), but the model has 2 outputs",
                three.display()
            )
        );
    }
    let two = dir.path().join("two.safetensors");
    named(&two, &["left", "right"]);
    let o = lockstep(&["predict", "--model", "toy", "--weights", s(&w), "--data", s(&two)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("left") || stdout(&o).contains("right"), "{}", stdout(&o));
}

/// `--devices cpu:100000` was quoted as 'cpu:100000x1', a spec nobody typed.
#[test]
fn a_refused_device_spec_is_quoted_as_typed() {
    let e = refused(&["train", "--model", "toy", "--devices", "cpu:100000"]);
    assert!(e.starts_with("error: invalid device spec 'cpu:100000': 100000 threads in all"), "{e}");
}

/// Steps and epochs in the non-finite loss message are numbered as the progress and
/// epoch lines number them, from 1: an overflow in the first step is "step 1 (epoch
/// 1)" (it said "step 0 (epoch 0)"), and a rate of 1e30 diverges at the second.
#[test]
fn a_non_finite_loss_names_the_step_and_epoch_from_1() {
    let dir = tempfile::tempdir().unwrap();
    // 64 features of 3e38 overflow the first layer's sums to infinity in the first
    // forward pass, whatever the weights; the softmax of infinities is NaN.
    let (big, wide) = (dir.path().join("big.safetensors"), dir.path().join("wide.json"));
    flat_dataset(&big, 64, vec![3e38; 4 * 64], vec![0, 1, 0, 1], 2);
    std::fs::write(
        &wide,
        r#"{"input_shape": [64], "layers": [{"type": "dense", "units": 16}, {"type": "relu"}, {"type": "dense", "units": 2}]}"#,
    )
    .unwrap();
    let o = lockstep(&["train", "--model", s(&wide), "--data", s(&big), "--epochs", "2"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains(" at step 1 (epoch 1)"), "{}", stderr(&o));
    let o = lockstep(&["train", "--model", "toy", "--lr", "1e30", "--optimizer", "sgd", "--epochs", "3"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains(" at step 2 (epoch 1)"), "{}", stderr(&o));
}

/// `--validation-split -0.1` and `--seed -1` gave clap's "unexpected argument '-0'
/// found": a negative number is taken as the flag's value, then refused for what it is.
#[test]
fn negative_values_are_refused_for_what_they_are() {
    assert_eq!(
        refused(&["train", "--model", "toy", "--validation-split", "-0.1"]),
        "error: --validation-split must be strictly between 0 and 1, got -0.1"
    );
    assert_eq!(
        refused(&["train", "--model", "toy", "--seed", "-1"]),
        "error: invalid value '-1' for '--seed <SEED>': a negative number: this flag takes a whole number, 0 or more"
    );
    let e = refused(&["train", "--model", "toy", "--batch-size", "-8"]);
    assert!(e.contains("'-8'") && e.contains("a negative number"), "{e}");
}
