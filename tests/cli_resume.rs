//! The command line's checkpoints: a run killed with SIGKILL at an arbitrary moment and
//! resumed (on another number of devices, the logical replicas fixed) saves bitwise the
//! weights of the run that was never interrupted; Ctrl-C (SIGINT) finishes the step,
//! writes a checkpoint, says where and exits non-zero; bad checkpoint input is refused; the
//! run's record (issue 12's features, issue 18's augmentation and label smoothing among
//! it) is restored or compared, and is JSON of one format.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lockstep"))
}

/// A fresh temporary directory, removed with the guard.
fn tmp() -> (tempfile::TempDir, PathBuf) {
    let guard = tempfile::tempdir().unwrap();
    let d = guard.path().to_path_buf();
    (guard, d)
}

/// The run under test: the convnet on the digits, 40 steps of 32, 2 logical replicas.
fn train_args(extra: &[&str]) -> Vec<String> {
    let base = ["train", "--steps", "40", "--replicas", "2", "--seed", "3"];
    base.iter().chain(extra).map(|s| s.to_string()).collect()
}

/// Every tensor of a safetensors file, by name (the header's metadata order may vary).
fn tensors(path: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<_> = st.tensors().into_iter().map(|(n, t)| (n, t.data().to_vec())).collect();
    v.sort();
    v
}

fn checkpoints(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| {
        d.filter(|e| e.as_ref().is_ok_and(|e| e.file_name().to_string_lossy().starts_with("checkpoint-"))).count()
    })
}

/// SIGKILL at an arbitrary moment of the run of `model` (flags), resumed on one device.
fn sigkill_then_resume(model: &[&str]) {
    let (_guard, dir) = tmp();
    let (full, resumed, ck) = (dir.join("full.safetensors"), dir.join("resumed.safetensors"), dir.join("ck"));
    let out =
        bin().args(train_args(&["--devices", "cpu:2", "--save", full.to_str().unwrap()])).args(model).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let ck_s = ck.to_str().unwrap();
    let mut child = bin()
        .args(train_args(&[
            "--devices",
            "cpu:2",
            "--checkpoint-dir",
            ck_s,
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "100",
        ]))
        .args(model)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill it somewhere in the middle: once a few checkpoints exist.
    let t0 = Instant::now();
    while checkpoints(&ck) < 5 && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert!(!status.success(), "the run was meant to be killed before it finished");

    let out = bin()
        .args(train_args(&["--devices", "cpu:1", "--resume", ck_s, "--save", resumed.to_str().unwrap()]))
        .args(model)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("resuming"), "{stdout}");
    assert!(tensors(&full) == tensors(&resumed), "resumed weights differ from the uninterrupted run's");
}

#[test]
fn sigkill_then_resume_on_other_devices_gives_the_same_weights() {
    sigkill_then_resume(&[]);
}

/// The same of resnet8 (its BatchNorm counters, the residual blocks), with its batch 24.
#[test]
fn resnet8_resumes_bitwise_after_sigkill() {
    sigkill_then_resume(&["--model", "resnet8", "--batch-size", "24"]);
}

/// The same of the DenseNet (a graph: its concatenations, its 27 BatchNorms' counters),
/// with the batch of its reference cases (24).
#[test]
fn densenet_resumes_bitwise_after_sigkill() {
    sigkill_then_resume(&["--model", "densenet", "--batch-size", "24"]);
}

/// The same of a small GPT on text (its windows drawn by step and row, its tied head,
/// AdamW with warm-up, cosine and clipping: nanoGPT's recipe, shrunk).
#[test]
fn a_gpt_resumes_bitwise_after_sigkill() {
    let text = format!("text:{}", concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"));
    let shape = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "16", "--eval-every", "10"];
    let args: Vec<&str> =
        ["--model", "gpt", "--data", text.as_str(), "--batch-size", "8"].into_iter().chain(shape).collect();
    sigkill_then_resume(&args);
}

/// Spawns `command` with its output piped, waits for its first line (printed once the
/// signal handlers are in place), and drains the rest of its stdout on a thread.
fn started(command: &mut Command) -> (std::process::Child, std::thread::JoinHandle<std::io::Result<usize>>) {
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut first).unwrap();
    assert!(first.starts_with("lockstep:"), "{first}");
    let drain = std::thread::spawn(move || std::io::Read::read_to_end(&mut stdout, &mut Vec::new()));
    (child, drain)
}

/// Starts a long convnet run with `extra` flags, waits for its first line (printed once
/// the signal handlers are in place) and a little training, sends `signal`, and returns
/// its exit code and stderr.
fn interrupt(signal: &str, extra: &[&str]) -> (Option<i32>, String) {
    let (child, drain) = started(bin().args(["train", "--epochs", "50", "--devices", "cpu:1"]).args(extra));
    std::thread::sleep(Duration::from_millis(300));
    let ok = Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap();
    assert!(ok.success());
    let out = child.wait_with_output().unwrap();
    drain.join().unwrap().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn ctrl_c_and_sigterm_finish_the_step_write_a_checkpoint_and_exit_128_plus_the_signal() {
    // Exit codes: the shell's 128 + N, SIGINT = 2 → 130, SIGTERM = 15 → 143.
    for (signal, name, code) in [("-INT", "SIGINT", 130), ("-TERM", "SIGTERM", 143)] {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("ck");
        let (status, stderr) =
            interrupt(signal, &["--checkpoint-dir", ck.to_str().unwrap(), "--checkpoint-every", "1000000"]);
        assert_eq!(status, Some(code), "{stderr}");
        assert!(stderr.contains(&format!("lockstep: interrupted by {name} after step ")), "{stderr}");
        assert!(stderr.contains("; checkpoint written to ") && !stderr.contains("error:"), "{stderr}");
        assert_eq!(checkpoints(&ck), 1);
    }
}

/// Issue 41: SIGTERM during a long held-out evaluation waited for its end (24 s, near the
/// 30 s a scheduler gives before SIGKILL). The evaluation gives way within a chunk: the run
/// exits 143 with the checkpoint of its last step, says how far the evaluation got before
/// it was given up, and the resumed run does the evaluation first (its report is the
/// uninterrupted run's, to the last digit), then ends with bitwise the uninterrupted run's
/// weights. A small GPT evaluated on 3,000 batches of 8 windows after steps 5 and 10
/// (about 1.5 s an evaluation, a step about a millisecond, on this project's development
/// machine): the signal is sent as soon as step 5's line is read, inside that evaluation.
///
/// Nothing here is timed (a loaded machine may run the child at any pace): that the
/// evaluation stops within a chunk of the flag's rise is `train::step`'s unit test
/// (`a_stop_raised_during_a_chunk_gives_the_evaluation_up_after_that_chunk`); this test
/// shows that SIGTERM raises it during an evaluation and that the run, given up there,
/// says so, reports nothing of it, and resumes to the same bits.
#[test]
fn sigterm_during_a_long_evaluation_stops_it_checkpoints_and_resumes_bitwise() {
    let (_guard, dir) = tmp();
    let (full, resumed, ck) = (dir.join("full.safetensors"), dir.join("resumed.safetensors"), dir.join("ck"));
    let text = format!("text:{}", concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"));
    let gpt = |extra: &[&str]| {
        let mut c = bin();
        c.args(["train", "--model", "gpt", "--data", &text, "--batch-size", "8", "--layers", "1", "--width", "32"])
            .args(["--heads", "2", "--context", "16", "--eval-every", "5", "--eval-batches", "3000", "--steps", "10"])
            .args(["--devices", "cpu:2", "--log-format", "json"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    // Reads `child`'s JSON lines up to the one that starts with `prefix`.
    let read_to = |lines: &mut dyn Iterator<Item = String>, prefix: &str| -> String {
        for line in lines {
            if line.starts_with(prefix) {
                return line;
            }
        }
        panic!("no line {prefix}")
    };
    let lines = |child: &mut std::process::Child| {
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        std::io::BufRead::lines(out).map(|l| l.unwrap())
    };

    // Uninterrupted: what the first evaluation reports.
    let mut child = gpt(&["--save", full.to_str().unwrap()]).spawn().unwrap();
    let mut out = lines(&mut child);
    let first_epoch = read_to(&mut out, r#"{"kind":"epoch","epoch":1,"#);
    out.for_each(drop);
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // SIGTERM as step 5's evaluation begins.
    let mut child = gpt(&["--checkpoint-dir", ck.to_str().unwrap(), "--checkpoint-every", "1000"]).spawn().unwrap();
    let mut out = lines(&mut child);
    read_to(&mut out, r#"{"kind":"step","step":5,"#);
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let rest: Vec<String> = out.collect();
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(143), "{stderr}");
    assert!(rest.is_empty(), "the stopped evaluation reports nothing: {rest:?}");
    // "... after step 5; its evaluation given up after E of 24000 samples, unreported;
    // checkpoint written to ...": 24,000 = 3,000 batches of 8 windows (the flags above),
    // and E below it, the samples the devices evaluated before each gave its part up.
    let checkpoint = ck.join("checkpoint-000000000005.safetensors");
    let line = stderr.lines().find(|l| l.starts_with("lockstep: interrupted by")).unwrap_or_else(|| panic!("{stderr}"));
    let head = "lockstep: interrupted by SIGTERM after step 5; its evaluation given up after ";
    let tail = format!(" of 24000 samples, unreported; checkpoint written to {}", checkpoint.display());
    let evaluated = line.strip_prefix(head).and_then(|l| l.strip_suffix(&tail)).unwrap_or_else(|| panic!("{line}"));
    let evaluated: u64 = evaluated.parse().unwrap_or_else(|_| panic!("{line}"));
    assert!(evaluated < 24000, "{line}");

    // Resumed: the evaluation of step 5 first, as the uninterrupted run reported it.
    let mut child = gpt(&["--resume", ck.to_str().unwrap(), "--save", resumed.to_str().unwrap()]).spawn().unwrap();
    let mut out = lines(&mut child);
    let epoch = read_to(&mut out, r#"{"kind":"epoch","epoch":1,"#);
    let scores = |l: &str| l.split(r#""best""#).next().unwrap().to_string();
    assert_eq!(scores(&epoch), scores(&first_epoch), "the resumed evaluation differs");
    out.for_each(drop);
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(tensors(&full) == tensors(&resumed), "resumed weights differ from the uninterrupted run's");
}

/// Issue 41: SIGUSR1 prints the flight recorder (each device's state and last collective
/// calls) to stderr and the run goes on to its end, exit 0, every step taken.
#[test]
fn sigusr1_prints_the_flight_recorder_and_the_run_goes_on() {
    let mut child = bin()
        .args(["train", "--steps", "150", "--devices", "cpu:2", "--log-format", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap())).map(|l| l.unwrap());
    // Training has begun (the recorder is listed): the first step's line.
    assert!(lines.any(|l| l.starts_with(r#"{"kind":"step","step":1,"#)), "no first step");
    assert!(Command::new("kill").args(["-USR1", &child.id().to_string()]).status().unwrap().success());
    let last = lines.filter(|l| l.starts_with(r#"{"kind":"step""#)).last().unwrap_or_default();
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(last.starts_with(r#"{"kind":"step","step":150,"#), "{last}");
    assert!(stderr.contains("trained 150 steps"), "{stderr}");
    assert_eq!(stderr.matches("lockstep: flight recorder (SIGUSR1), ").count(), 1, "{stderr}");
    for device in ["cpu:0", "cpu:1"] {
        // In a sum, or between two: either way its state, then its calls (a sum a step).
        let state = format!("lockstep: {device}: in ");
        assert!(stderr.lines().any(|l| l.starts_with(&state)), "{stderr}");
        assert!(stderr.contains(&format!("lockstep: {device}'s last ")), "{stderr}");
    }
    assert!(stderr.contains(" sum ") && stderr.contains(" kB at "), "{stderr}");
}

/// `--time-limit`: the run stops at the step boundary past its time, writes its checkpoint,
/// says how to go on and exits 75 (EX_TEMPFAIL); resumed, it ends with the weights of
/// the run never stopped. A value that is no duration is refused, quoted.
#[test]
fn a_time_limit_checkpoints_exits_75_and_resumes_to_the_same_weights() {
    let (_guard, dir) = tmp();
    let (full, resumed, ck) = (dir.join("full.safetensors"), dir.join("resumed.safetensors"), dir.join("ck"));
    let ck_s = ck.to_str().unwrap();
    let out = bin().args(train_args(&["--devices", "cpu:2", "--save", full.to_str().unwrap()])).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // A limit of zero: past it after the first step.
    let out = bin()
        .args(train_args(&["--devices", "cpu:2", "--checkpoint-dir", ck_s, "--time-limit", "0s"]))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{stderr}");
    let first = ck.join("checkpoint-000000000001.safetensors");
    let said = format!(
        "lockstep: stopped at the time limit (0s) after step 1; checkpoint written to {}; go on with --resume {ck_s}",
        first.display()
    );
    assert!(stderr.lines().any(|l| l == said), "{stderr}");
    assert!(first.is_file());

    // Resumed on one device with an hour to spare: it completes.
    let resume =
        ["--devices", "cpu:1", "--resume", ck_s, "--time-limit", "1:00:00", "--save", resumed.to_str().unwrap()];
    let out = bin().args(train_args(&resume)).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(tensors(&full) == tensors(&resumed), "resumed weights differ from the uninterrupted run's");

    let out = bin().args(train_args(&["--time-limit", "5x"])).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("'5x' is not a duration (unknown unit 'x': the units are d, h, m and s"), "{stderr}");
}

/// Issue 19, defect 3, as it was found: one checkpoint of a seed-7 run copied into the
/// directory of a seed-0 run. `--resume` continued the seed-7 run without a word, and its
/// pruning deleted the seed-0 run's checkpoints; now it refuses, naming both, and deletes
/// nothing.
#[test]
fn a_foreign_checkpoint_in_the_directory_is_refused_naming_both_runs() {
    let (_guard, dir) = tmp();
    let (zero, seven) = (dir.join("zero"), dir.join("seven"));
    for (ck, seed) in [(&zero, "0"), (&seven, "7")] {
        let args =
            ["train", "--model", "toy", "--epochs", "3", "--seed", seed, "--checkpoint-dir", ck.to_str().unwrap()];
        let out = bin().args(args).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let newest = std::fs::read_dir(&seven)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .max()
        .unwrap();
    std::fs::copy(&newest, zero.join(newest.file_name().unwrap())).unwrap();
    let before = checkpoints(&zero);
    let out = bin().args(["train", "--resume", zero.to_str().unwrap(), "--epochs", "6"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("holds the checkpoints of 2 runs, which differ in seed: 0 in checkpoint-"), "{stderr}");
    assert!(stderr.contains("7 in checkpoint-"), "{stderr}");
    assert_eq!(checkpoints(&zero), before, "nothing is deleted");
}

/// Issue 19: a run that took 10 steps, resumed with `--steps 5`, said "complete: step 10 of
/// 5"; it says that it is already past step 5.
#[test]
fn a_run_resumed_with_fewer_steps_than_it_took_says_it_is_past_them() {
    let (_guard, dir) = tmp();
    let ck = dir.join("ck");
    let out = bin()
        .args(["train", "--model", "toy", "--epochs", "10", "--steps", "10", "--checkpoint-dir", ck.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = bin().args(["train", "--resume", ck.to_str().unwrap(), "--steps", "5"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("is already past step 5: it is at step 10 (1 step into epoch 4)"), "{stdout}");
    assert!(!stdout.contains("step 10 of 5"), "{stdout}");
}

#[test]
fn without_a_checkpoint_directory_a_signal_still_writes_save() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path().join("w.safetensors");
    let (status, stderr) = interrupt("-TERM", &["--save", w.to_str().unwrap()]);
    assert_eq!(status, Some(143), "{stderr}");
    let line = stderr.lines().find(|l| l.contains("interrupted by SIGTERM")).unwrap_or_else(|| panic!("{stderr}"));
    // "... after step N; the weights at that step saved to W"
    let step: u64 = line.split("after step ").nth(1).unwrap().split(';').next().unwrap().parse().unwrap();
    assert!(step >= 1, "{line}");
    assert!(line.ends_with(&format!("; the weights at that step saved to {}", w.display())), "{line}");
    // The weights load as the convnet's (all or nothing, every value finite).
    let model = lockstep::models::convnet(lockstep::models::ConvnetOptions::default()).unwrap();
    lockstep::weights::load(&model, &w).unwrap();
}

#[test]
fn an_absurd_epoch_count_is_capped_by_steps_not_a_crash() {
    let out =
        bin().args(["train", "--model", "toy", "--epochs", "18446744073709551615", "--steps", "3"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("trained 3 steps"), "{stdout}");
}

#[test]
fn checkpoint_input_errors_are_one_line() {
    let (_guard, dir) = tmp();
    let missing = dir.join("nope");
    let out = bin().args(["train", "--resume", missing.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(err.contains("no such directory") && err.lines().count() == 1, "{err}");

    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = bin().args(["train", "--resume", empty.to_str().unwrap()]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("no checkpoint in it"));

    // A new run into a directory that holds another run's checkpoints would mix the two.
    let used = dir.join("used");
    let out = bin()
        .args(["train", "--model", "toy", "--checkpoint-dir", used.to_str().unwrap(), "--checkpoint-every", "2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = bin()
        .args(["train", "--model", "toy", "--seed", "5", "--checkpoint-dir", used.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("already holds checkpoints of a run (newest: step 9)") && err.contains("--resume"), "{err}");

    let out = bin().args(["train", "--checkpoint-dir", "/proc/lockstep-unwritable/ck"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--checkpoint-dir"), "{err}");
}

/// What changes a run's arithmetic is stored with its checkpoints: a run with
/// `--accumulate 2` and 16-bit gradients is resumed with both (given or not), and a flag
/// given with `--resume` that disagrees is refused, naming it.
#[test]
fn issue_12_settings_are_part_of_a_checkpoints_configuration() {
    let (_guard, dir) = tmp();
    let d = dir.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args: Vec<&str> = vec!["train", "--model", "toy", "--steps", "2", "--devices", "cpu:2"];
        args.extend_from_slice(extra);
        bin().args(&args).output().unwrap()
    };
    let o = run(&["--checkpoint-dir", d, "--accumulate", "2", "--grad-compression", "bf16", "--shard-optimizer"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = run(&["--resume", d, "--accumulate", "3"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--accumulate 3 differs from the run's --accumulate 2"), "{err}");
    let o = run(&["--resume", d, "--grad-compression", "fp16"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--grad-compression fp16 differs from the run's"), "{err}");
    // The stored settings, restored: both steps were taken, nothing is left to do.
    let o = run(&["--resume", d]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("is complete: step 2 of 2"), "{out}");
}

/// The recipes of issue 18 are stored flags: a run resumed with `--resume DIR` alone
/// (and another device count) continues with Nesterov momentum, weight decay on every
/// parameter, the warm-up and the clip it started with, and saves bitwise the weights of
/// the run that was never interrupted; a recipe flag that disagrees is refused.
#[test]
fn issue_18_recipes_are_stored_restored_and_resume_bitwise() {
    let (_guard, dir) = tmp();
    let (full, resumed, ck) = (dir.join("full.safetensors"), dir.join("resumed.safetensors"), dir.join("ck"));
    let ck_s = ck.to_str().unwrap();
    let recipe = [
        "train",
        "--steps",
        "8",
        "--batch-size",
        "16",
        "--replicas",
        "2",
        "--seed",
        "3",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--momentum",
        "0.9",
        "--nesterov",
        "--weight-decay",
        "5e-4",
        "--weight-decay-on",
        "all",
        "--warmup-steps",
        "3",
        "--clip-grad-norm",
        "0.5",
    ];
    let run = |extra: &[&str]| {
        let o = bin().args(recipe).args(extra).output().unwrap();
        assert!(o.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let out = run(&["--devices", "cpu:2", "--checkpoint-dir", ck_s, "--checkpoint-every", "2", "--save"]
        .into_iter()
        .chain([full.to_str().unwrap()])
        .collect::<Vec<_>>());
    assert!(out.contains("sgd lr 0.05 momentum 0.9 (nesterov) weight decay 0.0005"), "{out}");
    // Back to step 4: the later checkpoints go.
    for step in [6, 8] {
        std::fs::remove_file(ck.join(format!("checkpoint-{step:012}.safetensors"))).unwrap();
    }
    let o = bin()
        .args(["train", "--resume", ck_s, "--devices", "cpu:1", "--save", resumed.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("resuming") && stdout.contains("at step 4"), "{stdout}");
    assert!(tensors(&full) == tensors(&resumed), "the resumed run's weights differ");
    let o = bin().args(["train", "--resume", ck_s, "--clip-grad-norm", "1"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--clip-grad-norm 1 differs from the run's --clip-grad-norm 0.5"), "{err}");
}

/// Issue 18's `--augment` and `--label-smoothing` are stored in the checkpoints: `--resume
/// DIR` alone continues with them, to bitwise the weights of the run never interrupted;
/// one given that disagrees, or added to a run that had none, is refused naming it.
#[test]
fn augmentation_and_label_smoothing_are_restored_by_resume() {
    let (_guard, dir) = tmp();
    let (ck, full, resumed) = (dir.join("ck"), dir.join("full.safetensors"), dir.join("resumed.safetensors"));
    let (ck_s, full_s, resumed_s) = (ck.to_str().unwrap(), full.to_str().unwrap(), resumed.to_str().unwrap());
    // A constant rate: the run cut at step 3 has the schedule of the whole one.
    let run = |extra: &[&str]| {
        let mut args = vec!["train", "--seed", "3", "--replicas", "2", "--lr-schedule", "constant", "--devices"];
        args.extend_from_slice(extra);
        bin().args(&args).output().unwrap()
    };
    let recipe = ["--augment", "crop=3,flip", "--label-smoothing", "0.1"];
    let o = run(&[&["cpu:2", "--steps", "6", "--save", full_s][..], &recipe].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("lockstep: augment crop=3,flip | label smoothing 0.1"), "{out}");
    let o = run(&[&["cpu:2", "--steps", "3", "--checkpoint-dir", ck_s][..], &recipe].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for (flags, problem) in [
        (&["--label-smoothing", "0.2"][..], "--label-smoothing 0.2 differs from the run's --label-smoothing 0.1"),
        (&["--augment", "flip"][..], "--augment flip differs from the run's --augment crop=3,flip"),
    ] {
        let o = run(&[&["cpu:1", "--steps", "6", "--resume", ck_s][..], flags].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(problem), "{err}");
    }
    let o = run(&["cpu:1", "--steps", "6", "--resume", ck_s, "--save", resumed_s]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("augment crop=3,flip | label smoothing 0.1"));
    assert!(tensors(&full) == tensors(&resumed), "the resumed run's weights differ from the uninterrupted run's");

    // A run without them does not gain them on resume.
    let plain = dir.join("plain");
    let plain_s = plain.to_str().unwrap();
    let o = run(&["cpu:1", "--steps", "1", "--checkpoint-dir", plain_s]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = run(&["cpu:1", "--steps", "2", "--resume", plain_s, "--augment", "flip"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.code() == Some(2) && err.contains("the run had no --augment"), "{err}");
}

/// Issue 19: a second SIGTERM during a large checkpoint write went on for seconds and
/// wrote another checkpoint. It ends the process at once, from the signal thread: the
/// checkpoint being written is abandoned, its temporary file removed, nothing renamed in.
/// The model is 8.7 M parameters, so that the checkpoint (weights and Adam's two moments,
/// about 105 MB, flushed to disk) takes long enough to be caught in the act; a write
/// finished before the second signal is sent is retried, not counted.
#[test]
fn a_second_sigterm_during_a_checkpoint_write_ends_the_process_leaving_no_file() {
    let (_guard, dir) = tmp();
    let spec = dir.join("wide.json");
    std::fs::write(
        &spec,
        r#"{"input_shape": [64], "layers": [{"type": "dense", "units": 4096, "activation": "relu"},
            {"type": "dense", "units": 2048, "activation": "relu"}, {"type": "dense", "units": 10}]}"#,
    )
    .unwrap();
    let unfinished = |ck: &Path| {
        std::fs::read_dir(ck).is_ok_and(|d| d.flatten().any(|e| e.file_name().to_string_lossy().contains(".tmp-")))
    };
    for attempt in 1..=5 {
        let ck = dir.join(format!("ck{attempt}"));
        let (mut child, drain) =
            started(
                bin().args(["train", "--model", spec.to_str().unwrap(), "--data", "digits", "--epochs", "1000"]).args(
                    ["--devices", "cpu:1", "--checkpoint-dir", ck.to_str().unwrap(), "--checkpoint-every", "1000000"],
                ),
            );
        std::thread::sleep(Duration::from_millis(300));
        let pid = child.id().to_string();
        let kill = || assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        kill();
        // The first signal's checkpoint begins as a temporary file beside the others.
        let start = Instant::now();
        let caught = loop {
            if unfinished(&ck) {
                break true;
            }
            if child.try_wait().unwrap().is_some() || start.elapsed() > Duration::from_secs(60) {
                break false;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        if caught {
            kill();
        }
        let out = child.wait_with_output().unwrap();
        drain.join().unwrap().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(143), "{stderr}");
        if !caught || stderr.contains("checkpoint written to") {
            // The write ended before the second signal came: not the case under test.
            continue;
        }
        assert!(!stderr.contains("error:"), "{stderr}");
        assert!(!unfinished(&ck), "a temporary file was left in {}", ck.display());
        assert_eq!(checkpoints(&ck), 0, "the abandoned checkpoint must not appear");
        return;
    }
    panic!("in 5 runs no checkpoint write was caught in the act");
}

/// Issue 19: `--resume DIR` of a run started with `--save W` did not write W. `--save`
/// and `--save-dtype` are stored like `--save-best`, and a resume may name another file.
#[test]
fn a_resumed_run_writes_save_where_the_run_was_started_to() {
    let (_guard, dir) = tmp();
    let (w, other, ck) = (dir.join("w.safetensors"), dir.join("other.safetensors"), dir.join("ck"));
    let ck_s = ck.to_str().unwrap();
    let out = bin()
        .args(["train", "--model", "toy", "--epochs", "2", "--checkpoint-dir", ck_s])
        .args(["--save", w.to_str().unwrap(), "--save-dtype", "bf16"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_file(&w).unwrap();
    let out = bin().args(["train", "--resume", ck_s, "--epochs", "4"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(&format!("weights saved to {} (bf16)", w.display())), "{stdout}");
    let dtypes: Vec<String> = {
        let bytes = std::fs::read(&w).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensors().into_iter().map(|(_, t)| format!("{:?}", t.dtype())).collect()
    };
    assert!(dtypes.iter().all(|d| d == "BF16"), "{dtypes:?}");
    // Another file may be named when resuming.
    let out =
        bin().args(["train", "--resume", ck_s, "--epochs", "5", "--save", other.to_str().unwrap()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(other.exists());
}

/// A checkpoint records how its run is configured as one JSON value (`lockstep.run`): the
/// library's `TrainConfig` and the command line's own choices, of format 1, no flag stored
/// as text. One of a lockstep from before the record (its flags as text, `stored.<flag>`)
/// is refused, naming it and what to do.
#[test]
fn a_checkpoint_records_its_run_as_json_and_an_earlier_format_is_refused() {
    let (_guard, dir) = tmp();
    let ck = dir.join("ck");
    let run = ["train", "--model", "toy", "--epochs", "1", "--lr", "0.1", "--devices", "cpu:2", "--checkpoint-dir"];
    let out = bin().args(run).arg(&ck).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let files = std::fs::read_dir(&ck).unwrap().flatten().map(|e| e.path());
    let newest = files.filter(|p| p.extension().is_some_and(|x| x == "safetensors")).max().unwrap();
    let bytes = std::fs::read(&newest).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone().unwrap();
    assert!(!meta.keys().any(|k| k.starts_with("stored.")), "{meta:?}");
    let record: serde_json::Value = serde_json::from_str(&meta["lockstep.run"]).unwrap();
    assert_eq!(record["format"], 1);
    assert_eq!(record["train"]["epochs"], 1);
    assert_eq!(record["train"]["optimizer"]["sgd"]["lr"], 0.1);
    assert_eq!(record["train"]["replicas"], 2);
    assert_eq!(record["cli"]["model"], serde_json::json!({"builtin": "toy"}));
    assert_eq!((&record["cli"]["data"], &record["cli"]["devices"]), (&"toy".into(), &"cpu:2".into()));

    // The header of an earlier lockstep's checkpoint, as it was written.
    let old = dir.join("old");
    std::fs::create_dir_all(&old).unwrap();
    let file = old.join("checkpoint-000000000003.safetensors");
    let meta: std::collections::BTreeMap<String, String> =
        [("lockstep.step", "3"), ("config.model", "toy"), ("stored.model", "toy"), ("stored.lr", "0.1")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    std::fs::write(&file, lockstep::weights::to_safetensors_bytes(&[], &meta).unwrap()).unwrap();
    let out = bin().args(["train", "--resume"]).arg(&old).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        format!(
            "error: {}: made by an earlier lockstep (the run's flags stored as text, before the run record of format 1); resume it with that version or start again",
            file.display()
        )
    );
}
