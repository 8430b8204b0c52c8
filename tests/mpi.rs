//! Several processes under `mpirun` (issue 11): P processes × D CPU devices train bitwise
//! as one process with the same logical replicas — toy and the full convnet (BatchNorm,
//! dropout), on Open MPI's shared-memory and TCP transports, resumed on another process
//! count — with one voice; faults end every process within seconds, naming the process,
//! the device, the step and the cause; a binary without the `mpi` feature refuses a
//! launched run.
//!
//! Needs the `mpi` feature and `mpirun` on PATH (`.ci/run` installs Open MPI and runs
//! `cargo test --release --features mpi --test mpi`); without either, each test says it is
//! skipped, on stderr, and the refusal test runs instead (it needs neither).
//!
//! Fault injection follows tests/faults.rs: a layer that fails on one device at one step,
//! in a copy of this test binary started by mpirun (the ignored test `mpi_child`), so
//! that the library, not the CLI, carries the fault. Expected weights are never numbers
//! written here: every comparison is bitwise, between runs that must agree.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn lockstep() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lockstep"))
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[path = "../src/testing/skip.rs"]
mod skip;

/// The one skip helper, for what these tests need of the machine (MPI, or the feature).
fn skip(test: &str, why: &str) {
    skip::skip(test, skip::Need::Tool, why);
}

/// True where MPI runs can be tested: the feature is built and mpirun is there.
fn mpi_ready(test: &str) -> bool {
    if !cfg!(feature = "mpi") {
        skip(test, "built without --features mpi (cargo test --release --features mpi --test mpi)");
        return false;
    }
    match Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => true,
        _ => {
            skip(test, "no mpirun on PATH (apt-get install openmpi-bin libopenmpi-dev)");
            false
        }
    }
}

/// `mpirun` for `np` processes on this machine, as CI runs it (root in a container, more
/// processes than cores), with `extra` MCA arguments (e.g. the TCP transport).
fn mpirun(np: usize, extra: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string()]).args(extra);
    // A run that hangs must fail the test, not CI: mpirun's own timeout ends the job.
    c.args(["--timeout", "120"]);
    c
}

/// A scratch directory, removed when dropped.
struct Scratch(tempfile::TempDir);

impl Scratch {
    fn new() -> Scratch {
        Scratch(tempfile::Builder::new().prefix("lockstep-mpi-").tempdir().unwrap())
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

/// A weights file's tensors: (name, bytes), sorted by name.
type Tensors = Vec<(String, Vec<u8>)>;

/// Every tensor of a safetensors file, by name (the header's metadata order may vary).
fn tensors(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<_> = st.tensors().into_iter().map(|(n, t)| (n, t.data().to_vec())).collect();
    v.sort();
    v
}

/// `lockstep train args --devices cpu:D --save FILE` on `np` processes (one process
/// without mpirun when `np` is 0), successfully; returns the output.
fn train(np: usize, d: usize, mca: &[&str], args: &[&str], save: &Path) -> String {
    let devices = format!("cpu:{d}x1");
    let mut tail: Vec<&str> = args.to_vec();
    tail.extend(["--devices", &devices, "--save", save.to_str().unwrap()]);
    let o = match np {
        0 => lockstep().arg("train").args(&tail).output().unwrap(),
        n => mpirun(n, mca).arg(env!("CARGO_BIN_EXE_lockstep")).arg("train").args(&tail).output().unwrap(),
    };
    let out = text(&o);
    assert!(o.status.success(), "{np} × cpu:{d} {args:?}: {out}");
    out
}

/// Runs `layouts` ((processes, devices per process); 0 processes: no mpirun) of one
/// training and asserts that all save bitwise the same tensors as the first.
fn assert_bitwise(name: &str, args: &[&str], layouts: &[(usize, usize)], mca: &[&str]) {
    let dir = Scratch::new();
    let mut first: Option<(String, Tensors)> = None;
    for &(np, d) in layouts {
        let save = dir.path(&format!("{name}-{np}x{d}.safetensors"));
        train(np, d, mca, args, &save);
        let got = tensors(&save);
        let label = format!("{np} process(es) × cpu:{d} {mca:?}");
        match &first {
            None => first = Some((label, got)),
            Some((l0, want)) => {
                assert_eq!(got.len(), want.len(), "{name}: {label} vs {l0}");
                for ((n, a), (_, b)) in got.iter().zip(want) {
                    assert!(a == b, "{name}: tensor {n} of {label} differs from {l0}'s");
                }
            }
        }
    }
}

/// The toy MLP on the enlarged toy set: 40 steps of 8 (one round per exchange: 752
/// parameters are below the one-round limit).
const TOY: &[&str] = &["--model", "toy", "--data", "toy-enlarged", "--batch-size", "8", "--epochs", "8", "--seed", "5"];
/// The full convnet (BatchNorm, dropout 0.5) on the digits: 8 steps of 32 (its 200 KB
/// slot goes in one round between 2 processes, in two — reduce-scatter, all-gather —
/// between 3 or more: `exchange::mpi::GATHER_BELOW`).
const CONVNET: &[&str] =
    &["--model", "convnet", "--steps", "8", "--batch-size", "32", "--dropout", "0.5", "--seed", "3"];

#[test]
fn toy_and_convnet_on_1_2_and_4_processes_save_the_same_tensors() {
    if !mpi_ready("toy_and_convnet_on_1_2_and_4_processes_save_the_same_tensors") {
        return;
    }
    for (name, base) in [("toy", TOY), ("convnet", CONVNET)] {
        let r4: Vec<&str> = base.iter().copied().chain(["--replicas", "4"]).collect();
        assert_bitwise(name, &r4, &[(0, 4), (2, 2), (4, 1)], &[]);
        let r2: Vec<&str> = base.iter().copied().chain(["--replicas", "2"]).collect();
        assert_bitwise(name, &r2, &[(0, 2), (2, 1)], &[]);
    }
}

/// resnet8 on the digits: 6 steps of 24, its residual blocks and PyTorch BatchNorm.
const RESNET8: &[&str] = &["--model", "resnet8", "--steps", "6", "--batch-size", "24", "--seed", "2"];

#[test]
fn resnet8_on_2_processes_saves_the_tensors_of_one_process_with_every_ddp_feature() {
    if !mpi_ready("resnet8_on_2_processes_saves_the_tensors_of_one_process_with_every_ddp_feature") {
        return;
    }
    // 2 × cpu:1 against 1 × cpu:2, R = 2; and R = 4 on 2 × cpu:2 against 1 × cpu:4.
    type Feature<'a> = (&'a str, &'a [&'a str]);
    let features: [Feature<'_>; 4] = [
        ("resnet8", &[]),
        ("resnet8 accumulate", &["--accumulate", "2"]),
        ("resnet8 bf16", &["--grad-compression", "bf16"]),
        ("resnet8 shard-optimizer", &["--shard-optimizer"]),
    ];
    for (name, flags) in features {
        let args: Vec<&str> = RESNET8.iter().copied().chain(["--replicas", "2"]).chain(flags.iter().copied()).collect();
        assert_bitwise(name, &args, &[(0, 2), (2, 1)], &[]);
    }
    let r4: Vec<&str> = RESNET8.iter().copied().chain(["--replicas", "4"]).collect();
    assert_bitwise("resnet8 R = 4", &r4, &[(0, 4), (2, 2)], &[]);
}

#[test]
fn a_gpt_on_2_processes_saves_the_tensors_of_one_process() {
    if !mpi_ready("a_gpt_on_2_processes_saves_the_tensors_of_one_process") {
        return;
    }
    // A small GPT on the README's bytes: its windows drawn by (seed, step, row) whichever
    // process holds the row, the loss over every token of the global batch, the tied head.
    let text = format!("text:{}", concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"));
    let gpt: Vec<&str> = vec![
        "--model",
        "gpt",
        "--data",
        &text,
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--batch-size",
        "8",
        "--layers",
        "1",
        "--width",
        "32",
        "--heads",
        "2",
        "--context",
        "16",
        "--replicas",
        "2",
    ];
    assert_bitwise("gpt", &gpt, &[(0, 2), (2, 1)], &[]);
    let bf16: Vec<&str> = gpt.iter().copied().chain(["--grad-compression", "bf16"]).collect();
    assert_bitwise("gpt bf16", &bf16, &[(0, 2), (2, 1)], &[]);
}

#[test]
fn partial_sums_inside_a_process_follow_the_one_tree() {
    if !mpi_ready("partial_sums_inside_a_process_follow_the_one_tree") {
        return;
    }
    // R = 6 on 2 processes: the tree ((0+1)+(2+3))+(4+5) has the leaves 0..2, 2..3 on
    // process 0 and 3..4, 4..6 on process 1, and the top ((L0+L1)+L2)+L3 — not the tree
    // over four leaves. Both exchange paths (toy: one round; convnet: two).
    for (name, base) in [("toy", TOY), ("convnet", CONVNET)] {
        let r6: Vec<&str> = base.iter().copied().chain(["--replicas", "6"]).collect();
        assert_bitwise(name, &r6, &[(0, 3), (2, 1), (2, 3), (3, 2)], &[]);
    }
    // With 16-bit codes: on 2 × cpu:1 the leaves of one slot (2..3, 3..4) travel as
    // codes, those of two (0..2, 4..6) as f32 partial sums; on 3 × cpu:2 (0..2, 2..4,
    // 4..6) all are partial sums and only the sum travels as codes.
    let r6: Vec<&str> = CONVNET.iter().copied().chain(["--replicas", "6", "--grad-compression", "fp16"]).collect();
    assert_bitwise("convnet fp16", &r6, &[(0, 3), (2, 1), (3, 2)], &[]);
}

#[test]
fn accumulation_sync_batchnorm_16_bit_gradients_and_sharding_across_processes() {
    if !mpi_ready("accumulation_sync_batchnorm_16_bit_gradients_and_sharding_across_processes") {
        return;
    }
    // Each feature of issue 12 over processes: bitwise one process with the same R. The
    // 16-bit codecs round each slot and the sum as the shared-memory exchange's wires do;
    // synchronized BatchNorm gathers every logical replica's statistics across processes
    // (2 × cpu:2: two devices' payloads per process; 4 × cpu:1: one).
    // (name, flags, layouts: processes and devices per process)
    type Feature<'a> = (&'a str, &'a [&'a str], &'a [(usize, usize)]);
    // Issue 18's recipes: the clip's norm is read whole by every device of every process
    // (a sharded one too), in the one association of `optim::GradNorm`.
    const RECIPES: &[&str] = &[
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--momentum",
        "0.9",
        "--nesterov",
        "--weight-decay",
        "5e-4",
        "--warmup-steps",
        "3",
        "--clip-grad-norm",
        "0.5",
    ];
    let sharded_recipes = [RECIPES, &["--shard-optimizer", "--grad-compression", "bf16"]].concat();
    let features: [Feature<'_>; 7] = [
        ("bf16", &["--grad-compression", "bf16"], &[(0, 4), (2, 2), (4, 1)]),
        ("fp16", &["--grad-compression", "fp16"], &[(0, 4), (2, 2), (4, 1)]),
        ("sync-batchnorm", &["--sync-batchnorm"], &[(0, 4), (2, 2), (4, 1)]),
        ("accumulate", &["--accumulate", "2"], &[(0, 4), (2, 2)]),
        ("shard-optimizer", &["--shard-optimizer"], &[(0, 4), (2, 2), (4, 1)]),
        ("issue 18 recipes", RECIPES, &[(0, 4), (2, 2), (4, 1)]),
        ("issue 18 recipes, sharded, bf16", &sharded_recipes, &[(0, 4), (2, 2)]),
    ];
    for (name, flags, layouts) in features {
        let args: Vec<&str> = CONVNET.iter().copied().chain(["--replicas", "4"]).chain(flags.iter().copied()).collect();
        assert_bitwise(name, &args, layouts, &[]);
    }
    // 16-bit codes on the wire: with R = 2 on 2 × cpu:1 every process's leaf is its one
    // slot, whose codes travel both ways (R = 4 on 4 × cpu:1 above: two rounds among 4;
    // on 2 × cpu:2, f32 partial sums, then the sum's codes); over TCP as well.
    for codec in ["bf16", "fp16"] {
        let args: Vec<&str> = CONVNET.iter().copied().chain(["--replicas", "2", "--grad-compression", codec]).collect();
        assert_bitwise(codec, &args, &[(0, 2), (2, 1)], &[]);
        assert_bitwise(codec, &args, &[(0, 2), (2, 1)], &["--mca", "btl", "self,tcp"]);
    }
}

#[test]
fn the_tcp_transport_gives_the_same_tensors() {
    if !mpi_ready("the_tcp_transport_gives_the_same_tensors") {
        return;
    }
    // Both rounds' paths: 2 processes (one round), 4 (two rounds, for the convnet).
    for (name, base, np) in [("toy", TOY, 2), ("convnet", CONVNET, 2), ("convnet", CONVNET, 4)] {
        let r4: Vec<&str> = base.iter().copied().chain(["--replicas", "4"]).collect();
        let dir = Scratch::new();
        let (one, tcp) = (dir.path("one.safetensors"), dir.path("tcp.safetensors"));
        train(0, 4, &[], &r4, &one);
        train(np, 4 / np, &["--mca", "btl", "self,tcp"], &r4, &tcp);
        assert!(tensors(&one) == tensors(&tcp), "{name}: {np} processes over TCP differ from 1 × cpu:4");
    }
}

#[test]
fn process_0_is_the_one_voice() {
    if !mpi_ready("process_0_is_the_one_voice") {
        return;
    }
    let dir = Scratch::new();
    let args = ["--model", "toy", "--replicas", "2", "--log-every-step"];
    let (csv1, csv2) = (dir.path("one.csv"), dir.path("two.csv"));
    let one = train(0, 2, &[], &[&args[..], &["--metrics-out", csv1.to_str().unwrap()]].concat(), &dir.path("a"));
    let two = train(2, 1, &[], &[&args[..], &["--metrics-out", csv2.to_str().unwrap()]].concat(), &dir.path("b"));
    // The lesson's 3 epochs of 3 steps, 2 shards each: 18 step lines, named with the
    // process, printed once (by process 0 alone).
    let lines: Vec<&str> = two.lines().filter(|l| l.starts_with("[process ")).collect();
    assert_eq!(lines.len(), 18, "{two}");
    assert!(lines[0].starts_with("[process 0, cpu:0] Epoch: 001/003 | Batchsize 001 | Train/Val Loss: "), "{two}");
    assert!(lines[1].starts_with("[process 1, cpu:0] Epoch: 001/003 | Batchsize 001 | Train/Val Loss: "), "{two}");
    assert_eq!(two.lines().filter(|l| l.starts_with("epoch ")).count(), 3, "{two}");
    assert_eq!(two.lines().filter(|l| l.starts_with("lockstep: toy")).count(), 1, "{two}");
    assert!(two.contains("devices: 2 processes × cpu:0 (1 thread each) | replicas: 2"), "{two}");
    // The shard losses are those of one process with the same logical replicas.
    let losses = |out: &str| -> Vec<String> {
        out.lines()
            .filter(|l| l.contains("Train/Val Loss"))
            .map(|l| l.rsplit(' ').next().unwrap().to_string())
            .collect()
    };
    assert_eq!(losses(&one), losses(&two));
    // The metrics, reduced across the processes, are one process's (samples/s aside).
    let cells = |p: &Path| -> Vec<String> {
        let t = std::fs::read_to_string(p).unwrap();
        t.lines().map(|l| l.rsplit_once(',').unwrap().0.to_string()).collect()
    };
    assert_eq!(cells(&csv1), cells(&csv2));
    assert!(dir.path("b").exists());
}

#[test]
fn a_checkpoint_of_2_processes_resumes_on_4_and_on_1() {
    if !mpi_ready("a_checkpoint_of_2_processes_resumes_on_4_and_on_1") {
        return;
    }
    resumes_on_4_and_on_1(&[], &[]);
}

#[test]
fn a_sharded_optimiser_spans_the_processes_and_its_checkpoints_resume_anywhere() {
    if !mpi_ready("a_sharded_optimiser_spans_the_processes_and_its_checkpoints_resume_anywhere") {
        return;
    }
    // Each device of the world keeps the state of one of 4 parts: on 2 × cpu:2 and
    // 4 × cpu:1 process 0's devices hold what devices 0 and 1 of 1 × cpu:4 hold (Adam's
    // m and v of the same parts), a quarter of the whole; the weights are the unsharded
    // run's.
    let bytes = |np: usize, d: usize| -> Vec<usize> {
        let devices = format!("cpu:{d}");
        let args = ["bench", "step", "--model", "convnet", "--batch-size", "32", "--devices", &devices];
        let args = [&args[..], &["--steps", "2", "--warmup", "1", "--shard-optimizer"]].concat();
        let o = match np {
            0 => lockstep().args(&args).output().unwrap(),
            n => mpirun(n, &[]).arg(env!("CARGO_BIN_EXE_lockstep")).args(&args).output().unwrap(),
        };
        let out = text(&o);
        assert!(o.status.success(), "{out}");
        let line = out.lines().find_map(|l| l.strip_prefix("optimizer state per device: ")).expect("the state line");
        line.trim_end_matches(" bytes").split(", ").map(|b| b.parse().unwrap()).collect()
    };
    let one = bytes(0, 4);
    assert_eq!(one.len(), 4);
    assert_eq!(bytes(2, 2), one[..2].to_vec());
    assert_eq!(bytes(4, 1), one[..1].to_vec());
    let dir = Scratch::new();
    let base: Vec<&str> = CONVNET.iter().copied().chain(["--replicas", "4"]).collect();
    let sharded: Vec<&str> = base.iter().copied().chain(["--shard-optimizer"]).collect();
    let (plain, spread) = (dir.path("plain.safetensors"), dir.path("spread.safetensors"));
    train(0, 4, &[], &base, &plain);
    train(4, 1, &[], &sharded, &spread);
    assert!(tensors(&plain) == tensors(&spread), "sharded on 4 × cpu:1: not the unsharded run's weights");
    // Checkpoints of 2 × cpu:2 sharded hold the whole state (process 0 gathers it):
    // resumed sharded on 4 × cpu:1 and unsharded on 1 × cpu:4, each ends bitwise where
    // the uninterrupted run does.
    resumes_on_4_and_on_1(&["--shard-optimizer"], &[]);
    resumes_on_4_and_on_1(&["--shard-optimizer"], &["--shard-optimizer"]);
}

/// A run of 2 × cpu:2 (with `flags`) checkpointing every step, cut after step 3, resumed
/// on 4 × cpu:1 and on 1 × cpu:4 (with `resumed`), each bitwise the uninterrupted run.
fn resumes_on_4_and_on_1(flags: &[&str], resumed: &[&str]) {
    let dir = Scratch::new();
    let plain: Vec<&str> = CONVNET.iter().copied().chain(["--replicas", "4"]).collect();
    let base: Vec<&str> = plain.iter().chain(flags).copied().collect();
    let full = dir.path("full.safetensors");
    train(2, 2, &[], &base, &full);
    let ck = dir.path("ck");
    let ck_s = ck.to_str().unwrap();
    let with_ck: Vec<&str> = base
        .iter()
        .copied()
        .chain(["--checkpoint-dir", ck_s, "--checkpoint-every", "1", "--keep-checkpoints", "100"])
        .collect();
    train(2, 2, &[], &with_ck, &dir.path("ignored.safetensors"));
    // As if the run had stopped after step 3: its later checkpoints never written.
    for e in std::fs::read_dir(&ck).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("checkpoint-") && name != "checkpoint-000000000003.safetensors" {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    let kept = dir.path("kept");
    copy_dir(&ck, &kept);
    let resume: Vec<&str> = plain.iter().chain(resumed).copied().chain(["--resume", ck_s]).collect();
    let on_4 = dir.path("on4.safetensors");
    let out = train(4, 1, &[], &resume, &on_4);
    assert!(out.contains("resuming") && out.contains("at step 3"), "{out}");
    assert!(
        tensors(&on_4) == tensors(&full),
        "{flags:?} resumed on 4 × cpu:1 {resumed:?}: not the uninterrupted run's"
    );
    let resume_kept: Vec<&str> =
        plain.iter().chain(resumed).copied().chain(["--resume", kept.to_str().unwrap()]).collect();
    let on_1 = dir.path("on1.safetensors");
    train(0, 4, &[], &resume_kept, &on_1);
    assert!(
        tensors(&on_1) == tensors(&full),
        "{flags:?} resumed on 1 × cpu:4 {resumed:?}: not the uninterrupted run's"
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Issue 19, defect 5: every setting that changes a number is compared before any work,
/// and the refusal names it in the words it was given with; each of these trained
/// together before (with different weights per process, or a hang).
#[test]
fn every_setting_and_the_data_must_agree() {
    if !mpi_ready("every_setting_and_the_data_must_agree") {
        return;
    }
    let bin = env!("CARGO_BIN_EXE_lockstep");
    let dir = Scratch::new();
    // Two copies of one dataset but for one label.
    let data = lockstep::data::toy::toy_enlarged(4, 0).unwrap().train;
    let a = dir.path("a.safetensors");
    let b = dir.path("b.safetensors");
    lockstep::data::safetensors_file::save_safetensors_dataset(&data, &a).unwrap();
    let mut labels = data.labels().to_vec();
    labels[3] = 1 - labels[3];
    let other = lockstep::data::Dataset::new("b", [2], data.features().clone(), labels, 2).unwrap();
    lockstep::data::safetensors_file::save_safetensors_dataset(&other, &b).unwrap();
    let (a, b) = (a.to_str().unwrap().to_string(), b.to_str().unwrap().to_string());
    let convnet = ["--model", "convnet", "--steps", "2"];
    // (flags both processes get, process 0's own, process 1's own, what is said)
    type Case<'a> = (&'a [&'a str], &'a [&'a str], &'a [&'a str], &'a str);
    let cases: [Case; 8] = [
        (&convnet, &["--dropout", "0.5"], &["--dropout", "0.1"], "process 1 has --dropout 0.1, process 0 has 0.5"),
        (&convnet, &[], &["--bn-momentum", "0.5"], "process 1 has --bn-momentum 0.5, process 0 has 0.9"),
        (&["--model", "toy"], &[], &["--accumulate", "2"], "process 1 has --accumulate 2, process 0 has 1"),
        (&["--model", "toy"], &[], &["--no-shuffle"], "process 1 has --no-shuffle true, process 0 has (not given)"),
        (&["--model", "toy"], &[], &["--drop-last"], "process 1 has --drop-last true, process 0 has (not given)"),
        (&["--model", "toy"], &["--lr", "0.01"], &["--lr", "0.1"], "process 1 has --lr 0.1, process 0 has 0.01"),
        (&convnet, &[], &["--sync-batchnorm"], "process 1 has --sync-batchnorm true, process 0 has (not given)"),
        (&["--model", "toy"], &["--data", &a], &["--data", &b], "process 1 has training data digest "),
    ];
    for (common, zero, one, said) in cases {
        let base = ["train", "--devices", "cpu:1"];
        let o = mpirun(1, &[])
            .arg(bin)
            .args(base)
            .args(common)
            .args(zero)
            .args([":", "-np", "1", bin])
            .args(base)
            .args(common)
            .args(one)
            .output()
            .unwrap();
        let out = text(&o);
        assert!(!o.status.success(), "{one:?}: {out}");
        assert!(out.contains(&format!("error: the processes of this run disagree: {said}")), "{one:?}: {out}");
    }
}

/// `--time-limit` across processes: the first process past its limit stops them all at the
/// same step (here process 1, with no time at all, stops process 0, which has an hour);
/// one checkpoint, of step 1, and both processes exit 75.
#[test]
fn a_time_limit_on_one_process_stops_every_process_at_the_same_step() {
    if !mpi_ready("a_time_limit_on_one_process_stops_every_process_at_the_same_step") {
        return;
    }
    let bin = env!("CARGO_BIN_EXE_lockstep");
    let dir = Scratch::new();
    let ck = dir.path("ck");
    let base = ["train", "--model", "toy", "--devices", "cpu:1", "--checkpoint-dir", ck.to_str().unwrap()];
    let o = mpirun(1, &["--mca", "orte_abort_on_non_zero_status", "0"])
        .arg(bin)
        .args(base)
        .args(["--time-limit", "1h"])
        .args([":", "-np", "1", bin])
        .args(base)
        .args(["--time-limit", "0s"])
        .output()
        .unwrap();
    let out = text(&o);
    assert!(out.contains("lockstep: stopped at the time limit (1h) after step 1; checkpoint written to "), "{out}");
    let names: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    assert_eq!(names, ["checkpoint-000000000001.safetensors"], "{out}");
    // Neither process went on: a second step would have been reported by process 0.
    assert!(!out.contains("epoch 1/"), "{out}");
}

#[test]
fn arguments_that_disagree_are_refused_on_every_process() {
    if !mpi_ready("arguments_that_disagree_are_refused_on_every_process") {
        return;
    }
    let bin = env!("CARGO_BIN_EXE_lockstep");
    let t0 = Instant::now();
    // Open MPI's MPMD form: process 0 and process 1 started with different batch sizes.
    let o = mpirun(1, &[])
        .args([bin, "train", "--model", "toy", "--devices", "cpu:1", "--batch-size", "2"])
        .args([":", "-np", "1", bin, "train", "--model", "toy", "--devices", "cpu:1", "--batch-size", "4"])
        .output()
        .unwrap();
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(
        out.contains("error: the processes of this run disagree: process 1 has --batch-size 4, process 0 has 2"),
        "{out}"
    );
    assert!(out.contains("Exit code:    2"), "exits 2, as for any bad argument: {out}");
    assert!(t0.elapsed() < Duration::from_secs(20), "took {:?}", t0.elapsed());
    // Process 0 alone checks the files it writes: its refusal reaches process 1, which
    // would otherwise wait in the first collective (mpirun is not let end the job here).
    let t0 = Instant::now();
    let o = mpirun(2, &["--mca", "orte_abort_on_non_zero_status", "0"])
        .args([bin, "train", "--model", "toy", "--devices", "cpu:1", "--save", "/nonexistent-dir/w.safetensors"])
        .output()
        .unwrap();
    let out = text(&o);
    let took = t0.elapsed();
    assert_eq!(out.matches("error: --save '/nonexistent-dir/w.safetensors'").count(), 1, "{out}");
    assert!(took < Duration::from_secs(10), "process 1 ended {took:?} after the start: {out}");
    let o = mpirun(2, &[])
        .args([bin, "train", "--model", "toy", "--devices", "cpu:1", "--replicas", "3"])
        .output()
        .unwrap();
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(
        out.contains(
            "error: --replicas 3 cannot be shared evenly by 2 devices (2 processes × 1) (use a multiple of 2)"
        ),
        "{out}"
    );
}

/// Issue 19: `LOCKSTEP_MPI_TIMEOUT_S=abc` (or `inf`, or empty) printed two processes'
/// errors interleaved into "error: error: invalid…". Every process meets it, so process
/// 0 alone says it, in one line naming the variable and the value.
#[test]
fn a_bad_timeout_setting_is_said_once() {
    if !mpi_ready("a_bad_timeout_setting_is_said_once") {
        return;
    }
    let bin = env!("CARGO_BIN_EXE_lockstep");
    for value in ["abc", "inf", ""] {
        let o = mpirun(2, &["-x", &format!("LOCKSTEP_MPI_TIMEOUT_S={value}")])
            .args([bin, "train", "--model", "toy", "--devices", "cpu:1"])
            .output()
            .unwrap();
        let out = text(&o);
        assert!(!o.status.success(), "{out}");
        let said = format!("error: invalid LOCKSTEP_MPI_TIMEOUT_S: '{value}' is not a number of seconds");
        let lines: Vec<&str> = out.lines().filter(|l| l.contains("error:")).collect();
        assert_eq!(lines, [said.as_str()], "{value:?}: {out}");
        assert!(!out.contains("epoch 1/"), "{out}");
    }
}

/// The rows of a bench table: its lines that are not comments, cut into cells.
fn table_rows(out: &str) -> Vec<Vec<&str>> {
    out.lines()
        .filter(|l| !l.starts_with('#') && l.contains('|'))
        .map(|l| l.split_whitespace().filter(|c| *c != "|").collect())
        .collect()
}

/// Issue 19, defect 6: `bench allreduce` with disagreeing arguments ended in Open MPI's
/// MPI_ERR_TRUNCATE (other sizes) or a hang (other counts); it now refuses as `train`
/// does, naming the argument.
#[test]
fn bench_allreduce_refuses_processes_that_disagree() {
    if !mpi_ready("bench_allreduce_refuses_processes_that_disagree") {
        return;
    }
    let bin = env!("CARGO_BIN_EXE_lockstep");
    let base = ["bench", "allreduce", "--devices", "cpu:1", "--warmup", "1"];
    for (zero, one, said) in [
        (["--sizes", "4K"], ["--sizes", "8K"], "process 1 has --sizes 8192, process 0 has 4096"),
        (["--iters", "3"], ["--iters", "4"], "process 1 has --iters 4, process 0 has 3"),
    ] {
        let t0 = Instant::now();
        let o = mpirun(1, &[])
            .arg(bin)
            .args(base)
            .args(zero)
            .args([":", "-np", "1", bin])
            .args(base)
            .args(one)
            .output()
            .unwrap();
        let out = text(&o);
        assert!(!o.status.success(), "{out}");
        assert!(out.contains(&format!("error: the processes of this run disagree: {said}")), "{out}");
        assert!(t0.elapsed() < Duration::from_secs(20), "took {:?}", t0.elapsed());
    }
}

#[test]
fn bench_allreduce_sets_the_exchange_beside_mpi_allreduce() {
    if !mpi_ready("bench_allreduce_sets_the_exchange_beside_mpi_allreduce") {
        return;
    }
    let o = mpirun(2, &[])
        .args([env!("CARGO_BIN_EXE_lockstep"), "bench", "allreduce", "--devices", "cpu:1"])
        .args(["--sizes", "4K,256K", "--iters", "3", "--warmup", "1"])
        .output()
        .unwrap();
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    // One table (process 0's), a row per size with both collectives and their ratio.
    assert_eq!(out.lines().filter(|l| l.starts_with("# lockstep bench allreduce: 2 processes")).count(), 1, "{out}");
    let rows = table_rows(&out);
    assert_eq!(rows.len(), 2, "{out}");
    for (row, bytes) in rows.iter().zip([4096, 262_144]) {
        assert_eq!(row.len(), 9, "{row:?}");
        assert_eq!(row[0].parse::<usize>().unwrap(), bytes);
        assert_eq!(row[1].parse::<usize>().unwrap(), bytes / 4);
        let t: Vec<f64> = row[2..].iter().map(|c| c.parse().unwrap()).collect();
        assert!(t.iter().all(|v| *v > 0.0 && v.is_finite()), "{row:?}");
        // ratio = MPI time / lockstep time, to the printed precision.
        assert!((t[6] - t[3] / t[0]).abs() <= 0.01 + 0.01 * t[6], "{row:?}");
    }
    assert!(out.contains("# sums: lockstep's and MPI_Allreduce's are bitwise equal at every size"), "{out}");
    // f32 moves 4 bytes a value: process 0 hands MPI the 1,024 values whole (one round),
    // or chunk 1 of its slot and its summed chunk 0 (two rounds): the slot's bytes.
    assert!(out.contains("# 4096 B: process 0 handed MPI 4096 B per sum"), "{out}");
    assert!(out.contains("# 262144 B: process 0 handed MPI 262144 B per sum"), "{out}");

    // With bf16: the coded exchange beside the f32 one and MPI_Allreduce, a ratio each.
    let o = mpirun(2, &[])
        .args([env!("CARGO_BIN_EXE_lockstep"), "bench", "allreduce", "--devices", "cpu:1"])
        .args(["--sizes", "4K,1M", "--iters", "3", "--warmup", "1", "--grad-compression", "bf16"])
        .output()
        .unwrap();
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let rows = table_rows(&out);
    assert_eq!(rows.len(), 2, "{out}");
    for (row, bytes) in rows.iter().zip([4096usize, 1 << 20]) {
        assert_eq!(row.len(), 13, "{row:?}");
        let t: Vec<f64> = row[2..].iter().map(|c| c.parse().unwrap()).collect();
        assert!(t.iter().all(|v| *v > 0.0 && v.is_finite()), "{row:?}");
        // bf16/f32 = f32 time / bf16 time; ratio = MPI time / f32 time.
        assert!((t[10] - t[3] / t[0]).abs() <= 0.01 + 0.01 * t[10], "{row:?}");
        assert!((t[9] - t[6] / t[3]).abs() <= 0.01 + 0.01 * t[9], "{row:?}");
        // The whole buffer is a gradient: 2 bytes a value (1M: two rounds, 4K: one).
        let sent = format!(
            "# {bytes} B: process 0 handed MPI {} B with bf16, {bytes} B with f32 (0.5000 of it) per sum",
            bytes / 2
        );
        assert!(out.contains(&sent), "{sent}: {out}");
    }
    assert!(
        out.contains("# sums: lockstep bf16's and bf16(round(a) + round(b)) computed in one process are bitwise equal"),
        "{out}"
    );
}

/// Bytes process 0 of `np` processes × `devices` hands MPI per sum of slots of `len`
/// values whose first `encoded` are encoded (`compression` "none", "bf16", "fp16"), one
/// logical replica per device, derived from the exchange's buffers (exchange::mpi):
/// - a leaf of this process is its one slot (one device) — codes, 2 bytes a value of the
///   encoded part, fp16 1 byte a block of 1,024 of them, 4 bytes a value of the tail —
///   or the partial sum of its two slots (two devices), f32, 4 bytes a value;
/// - one round, when every other process's leaves come to at most 256 KiB (they do for
///   the small slots here, not for 300,000 values): the leaf whole to each other process;
/// - two rounds: chunk q of the leaf to process q, then this process's summed chunk 0
///   (rounded to the codec: codes) to every other; chunks of len/np values rounded up to
///   a multiple of 1,024 values with a codec (so that each is encoded as the whole sum
///   is), of 16 without.
fn expected_bytes(np: usize, devices: usize, compression: &str, len: usize, encoded: usize) -> usize {
    let coded = |r: std::ops::Range<usize>| -> usize {
        let enc = r.start.min(encoded)..r.end.min(encoded);
        match compression {
            "none" => 4 * r.len(),
            c => 2 * enc.len() + if c == "fp16" { enc.len().div_ceil(1024) } else { 0 } + 4 * (r.len() - enc.len()),
        }
    };
    let leaf = |r: std::ops::Range<usize>| if devices == 1 { coded(r) } else { 4 * r.len() };
    if (np - 1) * leaf(0..len) <= 256 << 10 {
        return (np - 1) * leaf(0..len);
    }
    let align = if compression == "none" { 16 } else { 1024 };
    let chunk0 = 0..len.div_ceil(np).div_ceil(align) * align;
    leaf(0..len) - leaf(chunk0.clone()) + (np - 1) * coded(chunk0)
}

#[test]
fn sixteen_bit_gradients_cross_between_processes_as_16_bit_values() {
    if !mpi_ready("sixteen_bit_gradients_cross_between_processes_as_16_bit_values") {
        return;
    }
    // 2 × cpu:1: every leaf one slot, codes both ways; 2 × cpu:2: the reduce-scatter's
    // leaves are f32 partial sums, the all-gather codes; 4 × cpu:1: two rounds among 4.
    for (np, devices) in [(2, 1), (2, 2), (4, 1)] {
        let dir = Scratch::new();
        let (o, _) = finish(children(np, &[], &format!("exchange-{devices}"), dir.0.path()), Instant::now());
        let out = text(&o);
        assert!(o.status.success(), "{out}");
        let mut seen = 0;
        // (A process's first line follows the harness's "test mpi_child ... ".)
        for line in out.lines().filter_map(|l| Some(&l[l.find("exchange ")? + 9..])) {
            // "bf16 len 300000 encoded 299000 process 0: 601000 B per sum, bitwise true"
            let w: Vec<&str> = line.split_whitespace().collect();
            let (c, len, encoded): (&str, usize, usize) = (w[0], w[2].parse().unwrap(), w[4].parse().unwrap());
            assert_eq!(w[12], "true", "{np} × cpu:{devices}: not the one-process sum: {line}");
            if w[6] == "0:" {
                let got: usize = w[7].parse().unwrap();
                assert_eq!(got, expected_bytes(np, devices, c, len, encoded), "{np} × cpu:{devices}: {line}");
                seen += 1;
            }
        }
        assert_eq!(seen, 9, "{out}");
    }
    // The figure the codec halves, spelled out for the two-round slot on 2 × cpu:1:
    // 299,000 codes and 1,000 f32 against 300,000 f32.
    assert_eq!(expected_bytes(2, 1, "bf16", 300_000, 299_000), 2 * 299_000 + 4 * 1000);
    assert_eq!(expected_bytes(2, 1, "none", 300_000, 299_000), 4 * 300_000);
    assert_eq!(expected_bytes(2, 1, "fp16", 300_000, 299_000), 2 * 299_000 + 292 + 4 * 1000);
}

// ---------------------------------------------------------------------------------------
// Faults, in copies of this binary under mpirun

/// Starts `np` copies of this test binary's `mpi_child` under mpirun (with `mca`), doing
/// `what`, with `dir` for their files; returns mpirun.
fn children(np: usize, mca: &[&str], what: &str, dir: &Path) -> std::process::Child {
    mpirun(np, mca)
        .arg(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "mpi_child", "--nocapture", "--test-threads", "1"])
        .env("LOCKSTEP_MPI_CHILD", what)
        .env("LOCKSTEP_MPI_CHILD_DIR", dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The pids the children wrote (`pid-<process>`), once all `np` are there.
fn child_pids(dir: &Path, np: usize) -> Vec<u32> {
    let t0 = Instant::now();
    loop {
        let pids: Vec<u32> = (0..np)
            .filter_map(|r| std::fs::read_to_string(dir.join(format!("pid-{r}"))).ok()?.trim().parse().ok())
            .collect();
        if pids.len() == np {
            return pids;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the children did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |s| s.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with(['Z', 'X'])))
}

/// Waits for mpirun; returns its output, and how long after `since` it ended.
fn finish(child: std::process::Child, since: Instant) -> (Output, Duration) {
    let o = child.wait_with_output().unwrap();
    (o, since.elapsed())
}

/// An error or a panic on process 1's device at step 5 ends both processes, non-zero,
/// within the bound, naming process, device, step and cause.
fn fault(what: &str, cause: &str) {
    let dir = Scratch::new();
    let t0 = Instant::now();
    // mpirun is told not to end the job when a process exits non-zero (it would SIGTERM
    // the others, then SIGKILL them a second later): what ends process 0 is lockstep's
    // notice. mpirun then exits 0; each process wrote its exit code.
    let child = children(2, &["--mca", "orte_abort_on_non_zero_status", "0"], what, dir.0.path());
    let pids = child_pids(dir.0.path(), 2);
    let (o, took) = finish(child, t0);
    let out = text(&o);
    for r in 0..2 {
        assert_eq!(
            std::fs::read_to_string(dir.path(&format!("exit-{r}"))).ok().as_deref(),
            Some("1"),
            "process {r}: {out}"
        );
    }
    // Process 1 names itself; process 0, told by process 1's notice (mpirun is not let
    // end the job for it here), names the same.
    assert!(out.contains(&format!("process 1: error: process 1, cpu:0, step 6: {cause}")), "{out}");
    assert!(out.contains(&format!("process 0: error: process 1, cpu:0, step 6: {cause}")), "{out}");
    assert!(pids.iter().all(|&p| gone(p)), "a process outlived mpirun: {pids:?}");
    // A panic is said once per process, as its error, never by the standard hook.
    assert!(!out.contains("thread '"), "{out}");
    assert!(out.matches("injected").count() <= 2, "{out}");
    // Start-up (MPI, two processes) and five steps of a tiny model, then the fault.
    assert!(took < Duration::from_secs(10), "took {took:?}: {out}");
    let _ =
        writeln!(std::io::stderr(), "{what} on process 1 at step 5: every process ended {took:?} after mpirun started");
}

#[test]
fn an_error_on_process_1_at_step_5_ends_every_process() {
    if mpi_ready("an_error_on_process_1_at_step_5_ends_every_process") {
        fault("error", "invalid test layer: injected failure");
    }
}

#[test]
fn a_panic_on_process_1_at_step_5_ends_every_process() {
    if mpi_ready("a_panic_on_process_1_at_step_5_ends_every_process") {
        fault("panic", "panicked at ");
    }
}

#[test]
fn sigkill_of_one_process_ends_the_others() {
    if !mpi_ready("sigkill_of_one_process_ends_the_others") {
        return;
    }
    let dir = Scratch::new();
    // Process 0 takes mpirun's SIGTERM as a stop request, as the binary does, so that
    // mpirun's SIGKILL a second later is all that mpirun would do: ending it before is
    // lockstep's doing. (Open MPI 4.1's mpirun hangs after a killed process when told
    // not to abort the job, so it is left its default here.)
    let child = children(2, &[], "long", dir.0.path());
    let pids = child_pids(dir.0.path(), 2);
    // Kill process 1 in the middle of training: once it has taken a few steps.
    let t0 = Instant::now();
    while std::fs::read_to_string(dir.path("steps-1")).map_or(true, |s| s.trim().parse::<u64>().unwrap_or(0) < 20) {
        assert!(t0.elapsed() < Duration::from_secs(30), "process 1 did not train");
        std::thread::sleep(Duration::from_millis(2));
    }
    let (killed, killed_at) = (Instant::now(), std::time::SystemTime::now());
    Command::new("kill").args(["-KILL", &pids[1].to_string()]).status().unwrap();
    let (o, took) = finish(child, killed);
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(gone(pids[0]), "process 0 outlived mpirun");
    assert!(took < Duration::from_secs(5), "process 0 ended {took:?} after the kill: {out}");
    // mpirun is not let end the job: process 0 saw the death itself (its waits watch the
    // processes on its machine) and names it.
    let want =
        format!("process 0: error: process 1 (pid {}, on this machine) has exited without a word (killed?)", pids[1]);
    assert!(out.contains(&want), "{out}");
    assert_eq!(std::fs::read_to_string(dir.path("exit-0")).ok().as_deref(), Some("1"), "{out}");
    let left = std::fs::metadata(dir.path("exit-0")).unwrap().modified().unwrap();
    let _ = writeln!(
        std::io::stderr(),
        "SIGKILL of process 1: process 0 left {:?} later, mpirun ended {took:?} later",
        left.duration_since(killed_at).unwrap_or_default()
    );
}

#[test]
fn ctrl_c_on_mpirun_checkpoints_and_the_run_resumes_exactly() {
    if !mpi_ready("ctrl_c_on_mpirun_checkpoints_and_the_run_resumes_exactly") {
        return;
    }
    let dir = Scratch::new();
    let ck = dir.path("ck");
    let ck_s = ck.to_str().unwrap();
    // 3000 epochs of 7 steps of the toy: long enough to be interrupted, short to redo.
    let base = ["--model", "toy", "--data", "toy-enlarged", "--batch-size", "4", "--epochs", "3000", "--replicas", "2"];
    let full = dir.path("full.safetensors");
    train(0, 2, &[], &base, &full);
    let mut run = mpirun(2, &[])
        .arg(env!("CARGO_BIN_EXE_lockstep"))
        .arg("train")
        .args(base)
        .args(["--devices", "cpu:1", "--checkpoint-dir", ck_s, "--checkpoint-every", "2000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while checkpoint_steps(&ck).is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(60), "no checkpoint was written");
        std::thread::sleep(Duration::from_millis(2));
    }
    // Ctrl-C: mpirun sends SIGTERM to every process (and SIGKILL a second later).
    Command::new("kill").args(["-INT", &run.id().to_string()]).status().unwrap();
    let status = run.wait().unwrap();
    assert!(!status.success());
    // The processes finish the step they are in, agree on it, and process 0 writes it.
    let t1 = Instant::now();
    while lockstep_processes(ck_s) > 0 {
        assert!(t1.elapsed() < Duration::from_secs(5), "the processes outlived the interrupt");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The interrupt's checkpoint is the newest, before the run's end (21,000 steps).
    let steps = checkpoint_steps(&ck);
    let last = *steps.last().unwrap();
    assert!(last < 21_000, "the run was not interrupted: {steps:?}");
    let resumed = dir.path("resumed.safetensors");
    let out = train(2, 1, &[], &[&base[..], &["--resume", ck_s]].concat(), &resumed);
    assert!(out.contains(&format!("at step {last}")), "{out}");
    assert!(tensors(&resumed) == tensors(&full), "resumed after Ctrl-C: not the uninterrupted run's weights");
}

fn checkpoint_steps(dir: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(dir).map_or(Vec::new(), |d| {
        d.flatten()
            .filter_map(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.strip_prefix("checkpoint-")?.strip_suffix(".safetensors")?.parse().ok()
            })
            .collect()
    });
    v.sort();
    v
}

/// Processes whose command line names `marker` (the run's checkpoint directory).
fn lockstep_processes(marker: &str) -> usize {
    std::fs::read_dir("/proc").map_or(0, |d| {
        d.flatten()
            .filter(|e| e.file_name().to_string_lossy().chars().all(|c| c.is_ascii_digit()))
            .filter(|e| {
                std::fs::read(e.path().join("cmdline")).is_ok_and(|c| {
                    let c = String::from_utf8_lossy(&c);
                    c.contains(marker) && !c.starts_with("mpirun")
                })
            })
            .filter(|e| !gone(e.file_name().to_string_lossy().parse().unwrap_or(0)))
            .count()
    })
}

#[test]
fn process_0_makes_the_nccl_id_and_every_process_gets_it() {
    if !mpi_ready("process_0_makes_the_nccl_id_and_every_process_gets_it") {
        return;
    }
    let dir = Scratch::new();
    let (o, _) = finish(children(2, &[], "nccl-id", dir.0.path()), Instant::now());
    let out = text(&o);
    if let Some((_, why)) = out.split_once("nccl-id: skipped: ") {
        skip("process_0_makes_the_nccl_id_and_every_process_gets_it", why.lines().next().unwrap_or(""));
        return;
    }
    assert!(o.status.success(), "{out}");
    let ids: Vec<&str> = out.lines().filter_map(|l| Some(&l[l.find("nccl-id ")? + 8..])).collect();
    assert_eq!(ids.len(), 2, "{out}");
    let (a, b) = (ids[0].split_once(' ').unwrap(), ids[1].split_once(' ').unwrap());
    assert_ne!(a.0, b.0, "two processes: {out}");
    assert_eq!(a.1, b.1, "the same id on both: {out}");
    assert!(a.1.chars().any(|c| c != '0'), "a made id, not zeros: {out}");
}

/// A process of the fault tests (started by them under mpirun; does nothing otherwise).
#[test]
#[ignore = "a process of the MPI tests, started by them under mpirun"]
fn mpi_child() {
    let Ok(what) = std::env::var("LOCKSTEP_MPI_CHILD") else { return };
    #[cfg(feature = "mpi")]
    child::run(&what, Path::new(&std::env::var("LOCKSTEP_MPI_CHILD_DIR").unwrap()));
    #[cfg(not(feature = "mpi"))]
    panic!("mpi_child {what}: built without the mpi feature");
}

#[cfg(feature = "mpi")]
mod child {
    use std::path::Path;

    use lockstep::data::toy;
    use lockstep::devices::Devices;
    use lockstep::error::{Error, Result};
    use lockstep::nn::{Ctx, InputGrad, Layer, Linear, Params, ParamsMut, Relu, Sequential};
    use lockstep::optim::OptimizerConfig;
    use lockstep::tensor::{Device, Shape, Tensor};
    use lockstep::train::{train_data_parallel_with, Observer, StepEvent, TrainConfig};

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum How {
        Error,
        Panic,
        Never,
    }

    /// The identity, except on `device` of process `process`, at `step`,
    /// where it fails as told (in forward).
    #[derive(Clone, Debug)]
    struct Faulty {
        process: usize,
        here: usize,
        device: Device,
        step: u64,
        how: How,
    }

    impl Layer for Faulty {
        fn kind(&self) -> &'static str {
            "faulty"
        }
        fn output_shape(&self, input: &Shape) -> Result<Shape> {
            Ok(input.clone())
        }
        fn forward(&mut self, x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
            if self.here == self.process && ctx.device == self.device && ctx.step == self.step {
                match self.how {
                    How::Error => return Err(Error::config("test layer", "injected failure")),
                    How::Panic => panic!("injected panic"),
                    How::Never => {}
                }
            }
            Ok(x)
        }
        fn backward(
            &mut self,
            d: Tensor,
            _p: Params<'_>,
            _g: ParamsMut<'_>,
            _i: InputGrad,
            _ctx: &Ctx,
        ) -> Result<Option<Tensor>> {
            Ok(Some(d))
        }
        fn boxed_clone(&self) -> Box<dyn Layer> {
            Box::new(self.clone())
        }
        fn describe(&self) -> String {
            "Faulty".into()
        }
    }

    /// Writes the steps taken to `steps-<process>`.
    struct Steps(std::path::PathBuf);
    impl Observer for Steps {
        fn on_step(&mut self, e: &StepEvent<'_>) {
            let _ = std::fs::write(&self.0, (e.report.step + 1).to_string());
        }
    }

    pub fn run(what: &str, dir: &Path) {
        let world = lockstep::world::init().expect("the world starts");
        let process = world.process();
        std::fs::write(dir.join(format!("pid-{process}")), std::process::id().to_string()).unwrap();
        if what == "nccl-id" {
            return nccl_id(world);
        }
        if let Some(devices) = what.strip_prefix("exchange-") {
            return exchange(world, devices.parse().expect("exchange-<devices per process>"));
        }
        let how = match what {
            "error" => How::Error,
            "panic" => How::Panic,
            _ => How::Never,
        };
        let faulty = Faulty { process: 1, here: process, device: Device::Cpu(0), step: 5, how };
        let model = Sequential::new(
            [2],
            vec![Box::new(Linear::new(2, 8)), Box::new(Relu::new()), Box::new(faulty), Box::new(Linear::new(8, 2))],
        )
        .unwrap();
        let data = toy::toy_enlarged(20, 1).unwrap().train;
        let epochs = if how == How::Never { 100_000 } else { 5 };
        let cfg = TrainConfig { epochs, batch_size: 8, optimizer: OptimizerConfig::sgd(0.1), ..Default::default() };
        let mut steps = Steps(dir.join(format!("steps-{process}")));
        // As the binary does under mpirun: SIGTERM asks the run to stop (at a step every
        // process agrees on).
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        world.stop_on_signals(&stop).unwrap();
        let cfg = TrainConfig { stop: Some(stop), ..cfg };
        let r = train_data_parallel_with(&model, &data, None, &Devices::cpu(1, 1).unwrap(), &cfg, &mut steps);
        match r {
            Ok(_) => world.finalize(),
            Err(e) => {
                // Every process says how it ended, named, so that the test sees each.
                // One write, so that mpirun does not interleave it with another's.
                let line = format!("process {process}: error: {e}\n");
                let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
                std::fs::write(dir.join(format!("exit-{process}")), "1").unwrap();
                std::process::exit(1);
            }
        }
    }

    /// Shard `shard`'s value at element `i` in sum `step`: many significant bits (the
    /// codecs round them), and magnitudes from 1e-3 to 1e3 from one codec block to the
    /// next (fp16's exponents differ).
    fn value(shard: usize, step: usize, i: usize) -> f32 {
        let scale = 10f32.powi(((i / 1024 + shard) % 7) as i32 - 3);
        let sign = if (i + shard + step).is_multiple_of(3) { -1.0 } else { 1.0 };
        sign * scale * (1.0 + 0.123_457 * (shard + 1) as f32 + 1.3e-4 * (i % 4099) as f32 + 0.01 * step as f32)
    }

    /// The whole sum `x` holds, piece by piece.
    fn whole_sum(x: &impl lockstep::exchange::Exchange<Mem = lockstep::exchange::Host>) -> Vec<f32> {
        let mut out = vec![0.0f32; x.width()];
        x.for_each_sum(|off, piece| {
            out[off..off + piece.len()].copy_from_slice(piece);
            Ok(())
        })
        .unwrap();
        out
    }

    /// The exchange between processes alone, `devices` threads a process, one logical
    /// replica each: per case (format, slot length, encoded part), three sums of
    /// changing values, each compared bitwise with the shared-memory exchange of all the
    /// world's slots in this one process; prints, per process, the bytes it handed MPI
    /// per sum and whether every sum was bitwise the one-process sum.
    fn exchange(world: &lockstep::world::World, devices: usize) {
        use lockstep::exchange::codec::{Codec, Compression};
        use lockstep::exchange::mpi::MpiGroup;
        use lockstep::exchange::shm::ShmGroup;
        use lockstep::exchange::{Exchange, Wait};
        let (process, shards) = (world.process(), world.size() * devices);
        // Two rounds with a 1,000-value f32 tail; one round; the eager blocks.
        for (len, encoded) in [(300_000, 299_000), (3000, 2500), (1500, 1200)] {
            for compression in [Compression::None, Compression::Bf16, Compression::Fp16] {
                let codec = Codec::new(compression, encoded);
                let group = MpiGroup::new(world, devices, shards, len, Wait::Park, codec).unwrap();
                let one = ShmGroup::with_codec(1, shards, len, Wait::Park, codec).unwrap();
                let mut bitwise = true;
                for step in 0..3 {
                    let mut whole = one.member(0);
                    for shard in 0..shards {
                        whole.with_slot(shard, |s| {
                            s.iter_mut().enumerate().for_each(|(i, v)| *v = value(shard, step, i))
                        });
                    }
                    whole.sum().unwrap();
                    let want = whole_sum(&whole);
                    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
                        let handles: Vec<_> = (0..devices)
                            .map(|d| {
                                let group = &group;
                                s.spawn(move || {
                                    let mut me = group.member(d);
                                    let shard = process * devices + d;
                                    me.with_slot(0, |s| {
                                        s.iter_mut().enumerate().for_each(|(i, v)| *v = value(shard, step, i))
                                    });
                                    me.sum().unwrap();
                                    whole_sum(&me)
                                })
                            })
                            .collect();
                        handles.into_iter().map(|h| h.join().unwrap()).collect()
                    });
                    bitwise &= sums.iter().all(|got| got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
                }
                println!(
                    "exchange {} len {len} encoded {encoded} process {process}: {} B per sum, bitwise {bitwise}",
                    compression.name(),
                    group.bytes_sent() / 3
                );
            }
        }
        world.finalize();
    }

    fn nccl_id(world: &lockstep::world::World) {
        let made = match world.process() {
            0 => lockstep::exchange::gpu::new_clique_id().map_err(|e| e.to_string()),
            _ => Ok([0u8; 128]),
        };
        // Every process must learn whether process 0 could make one.
        let mut flag = [u8::from(made.is_ok())];
        world.broadcast(0, &mut flag).unwrap();
        if flag[0] == 0 {
            if world.process() == 0 {
                println!("nccl-id: skipped: {}", made.err().unwrap_or_default());
            }
            return world.finalize();
        }
        let mut id = made.unwrap_or([0u8; 128]);
        world.broadcast(0, &mut id).unwrap();
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        println!("nccl-id {} {hex}", world.process());
        world.finalize();
    }
}

// ---------------------------------------------------------------------------------------
// Without the feature

#[test]
fn without_the_feature_a_launched_run_is_refused() {
    if cfg!(feature = "mpi") {
        skip("without_the_feature_a_launched_run_is_refused", "this binary is built with the mpi feature");
        return;
    }
    let want = "error: MPI: this is process 1 of 2, launched by Open MPI (OMPI_COMM_WORLD_SIZE=2), \
                but this lockstep was built without MPI, so it would train alone, one of 2 copies: \
                build it with `cargo build --release --features mpi`";
    // What mpirun puts in a process's environment is enough to be refused.
    let o = lockstep()
        .args(["train", "--model", "toy"])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .env("OMPI_COMM_WORLD_RANK", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with(want), "{err}");
    // `lockstep devices` still lists the machine, and says why it would refuse.
    let o =
        lockstep().arg("devices").env("OMPI_COMM_WORLD_SIZE", "2").env("OMPI_COMM_WORLD_RANK", "1").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{out}");
    assert!(out.contains("mpi: not built in (build with --features mpi)"), "{out}");
    assert!(out.contains("world: none: MPI: this is process 1 of 2, launched"), "{out}");
    // And under a real mpirun, where there is one: both processes refuse, nothing trains.
    if Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success()) {
        let o = mpirun(2, &[]).args([env!("CARGO_BIN_EXE_lockstep"), "train", "--model", "toy"]).output().unwrap();
        let out = text(&o);
        assert!(!o.status.success(), "{out}");
        assert!(out.contains("but this lockstep was built without MPI"), "{out}");
        assert!(!out.contains("epoch 1/3"), "{out}");
    } else {
        skip("without_the_feature_a_launched_run_is_refused (under mpirun)", "no mpirun on PATH");
    }
}
