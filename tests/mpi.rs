//! Several processes under `mpirun` (issue 11), through the command line: P processes × D
//! CPU devices train bitwise as one process with the same logical replicas — toy and the
//! full convnet (BatchNorm, dropout), on Open MPI's shared-memory and TCP transports,
//! resumed on another process count — with one voice; settings that disagree are refused
//! on every process; Ctrl-C checkpoints and the run resumes exactly; a binary without the
//! `mpi` feature refuses a launched run.
//!
//! Needs the `mpi` feature and `mpirun` on PATH (`.ci/run` installs Open MPI and runs
//! `cargo test --release --features mpi --test mpi`); without either, each test says it is
//! skipped, on stderr, and the refusal test runs instead (it needs neither). Expected
//! weights are never numbers written here: every comparison is bitwise, between runs that
//! must agree.
//!
//! What needs the crate's inside runs in the library's own tests (`cargo test --release
//! --features mpi --lib mpi`, beside the code): the exchange between processes against the
//! shared-memory one and the bytes it hands MPI (src/exchange/mpi/under_mpirun.rs), faults
//! that the library carries, an error, a panic or a SIGKILL in one process ending every
//! process (src/world/mpi/under_mpirun.rs), and the NCCL clique id process 0 makes
//! (src/exchange/gpu/tests.rs).

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
    // Processes of other device counts are told so, not that their --replicas (counted
    // from the devices when not given: 2 and 4 here) differ.
    let o = mpirun(1, &[])
        .args([bin, "train", "--model", "toy", "--devices", "cpu:1", "--batch-size", "8"])
        .args([":", "-np", "1", bin, "train", "--model", "toy", "--devices", "cpu:2", "--batch-size", "8"])
        .output()
        .unwrap();
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(
        out.contains("error: the processes of this run disagree: process 1 has --devices 2 CPU devices per process, process 0 has 1 CPU device per process"),
        "{out}"
    );
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

// ---------------------------------------------------------------------------------------
// Ctrl-C on mpirun

/// True once process `pid` is gone (or a zombie).
fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |s| s.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with(['Z', 'X'])))
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
