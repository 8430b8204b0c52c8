//! The command line's files against careless and hostile names (issue 41): no output is
//! ever written over an input or over a checkpoint, whatever links lie between them; a
//! file read whole is a regular file whose memory was checked first (never `/dev/zero`,
//! never a FIFO that nobody writes, which would block the reader forever); the held-out
//! windows of a text run are part of its memory estimate; and a copy of a checkpoint
//! directory does not resume onto the original run's files. Each refusal is one line,
//! exit code 2, before any work, and the input is left as it was.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use lockstep::data::safetensors_file::save_safetensors_dataset;
use lockstep::data::{Dataset, Features};

fn lockstep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockstep")).args(args).output().expect("the binary runs")
}

/// `args` run with nothing on stdin, killed after 20 s: a command that would block
/// forever (opening a FIFO with no writer) fails the test instead of hanging it.
fn lockstep_in_time(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(20) {
            child.kill().unwrap();
            panic!("{args:?} did not end in 20 s: it blocked");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Refused with exit code 2 and exactly one stderr line, which is returned.
fn refused_by(o: Output, args: &[&str]) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}{out}");
    assert_eq!(err.lines().count(), 1, "{args:?}: not one line: {err}");
    assert!(!out.contains("epoch ") && !out.contains("step "), "{args:?} trained: {out}");
    err.trim_end().to_string()
}

fn refused(args: &[&str]) -> String {
    refused_by(lockstep_in_time(args), args)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn mkfifo(path: &Path) {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success());
}

/// A toy dataset file: 8 samples of 2 features, 2 classes.
fn toy_file(path: &Path) {
    let x: Vec<f32> = (0..16).map(|i| i as f32 / 16.0).collect();
    let ds = Dataset::new("d", [2], Features::F32(x), (0..8).map(|i| i % 2).collect(), 2).unwrap();
    save_safetensors_dataset(&ds, path).unwrap();
}

/// Runs `lockstep` in `dir`, so that relative paths are the test's own.
fn lockstep_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockstep")).current_dir(dir).args(args).output().expect("the binary runs")
}

#[test]
fn no_output_of_train_is_written_over_an_input_through_any_link() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let text = d.join("t.txt");
    let body = "the quick brown fox jumps over the lazy dog\n".repeat(20);
    std::fs::write(&text, &body).unwrap();
    let (soft, hard) = (d.join("soft.txt"), d.join("hard.txt"));
    std::os::unix::fs::symlink(&text, &soft).unwrap();
    std::fs::hard_link(&text, &hard).unwrap();
    let data = format!("text:{}", s(&text));
    let gpt = ["--model", "gpt", "--layers", "1", "--width", "16", "--heads", "2", "--context", "8", "--steps", "1"];
    for (flag, out, link) in
        [("--save", &text, ""), ("--metrics-out", &soft, ", through a link"), ("--save", &hard, ", through a link")]
    {
        let args: Vec<&str> = gpt.iter().copied().chain(["--data", &data, flag, s(out)]).collect();
        let e = refused(&[&["train"][..], &args].concat());
        assert_eq!(
            e,
            format!(
                "error: {flag} '{}' is the file --data reads ({}{link}): writing it would destroy the run's input; give {flag} a file of its own",
                out.display(),
                text.display()
            )
        );
    }
    assert_eq!(std::fs::read_to_string(&text).unwrap(), body, "the text is untouched");

    // A dataset file, its --val-data, the --init weights and a --model spec: inputs too.
    let (train, val) = (d.join("train.safetensors"), d.join("val.safetensors"));
    toy_file(&train);
    toy_file(&val);
    let weights = d.join("w.safetensors");
    let o = lockstep(&["train", "--model", "toy", "--data", s(&train), "--steps", "1", "--save", s(&weights)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let base = ["train", "--model", "toy", "--data", s(&train), "--steps", "1"];
    let cases: [(&[&str], &str, &str, &Path); 4] = [
        (&["--val-data", s(&val), "--save-best", s(&val)], "--save-best", "--val-data", &val),
        (&["--save", s(&train)], "--save", "--data", &train),
        (&["--init", s(&weights), "--metrics-out", s(&weights)], "--metrics-out", "--init", &weights),
        (
            &["--init", s(&weights), "--save-best", s(&weights), "--validation-split", "0.25"],
            "--save-best",
            "--init",
            &weights,
        ),
    ];
    let before = std::fs::read(&weights).unwrap();
    for (extra, output, flag, input) in cases {
        let e = refused(&[&base[..], extra].concat());
        assert_eq!(
            e,
            format!(
                "error: {output} '{0}' is the file {flag} reads ({0}): writing it would destroy the run's input; give {output} a file of its own",
                input.display()
            )
        );
    }
    assert_eq!(std::fs::read(&weights).unwrap(), before, "the weights are untouched");
    let spec = d.join("mlp.json");
    std::fs::write(&spec, r#"{"input_shape": [2], "layers": [{"type": "dense", "units": 2}]}"#).unwrap();
    let e = refused(&["train", "--model", s(&spec), "--data", s(&train), "--steps", "1", "--metrics-out", s(&spec)]);
    assert!(e.contains(&format!("is the file --model reads ({})", spec.display())), "{e}");

    // --init W --save W continues the weights in place: allowed (docs/command-line.md).
    let o = lockstep(&[&base[..], &["--init", s(&weights), "--save", s(&weights)]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_ne!(std::fs::read(&weights).unwrap(), before, "one more step was saved over them");

    // A file the checkpoints write, under another flag's name.
    let ck = d.join("ck");
    std::fs::create_dir(&ck).unwrap();
    let named = ck.join("checkpoint-000000000001.safetensors");
    let e = refused(&[&base[..], &["--checkpoint-dir", s(&ck), "--save", s(&named)]].concat());
    assert_eq!(
        e,
        format!(
            "error: --save '{}' is a file of the checkpoint directory '{}', which the run's checkpoints write and remove: give --save a file outside it, or another name",
            named.display(),
            ck.display()
        )
    );
}

#[test]
fn what_is_read_whole_is_a_regular_file_and_a_fifo_never_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe");
    mkfifo(&fifo);
    let gpt = ["--model", "gpt", "--layers", "1", "--width", "16", "--heads", "2", "--context", "8", "--steps", "1"];
    for (path, kind) in [(Path::new("/dev/zero"), "a device"), (fifo.as_path(), "a FIFO")] {
        let spec = format!("text:{}", s(path));
        let e = refused(&[&["train", "--data", &spec][..], &gpt].concat());
        assert_eq!(
            e,
            format!(
                "error: --data {spec}: {}: is {kind}, not a regular file: lockstep reads only regular files whole",
                path.display()
            )
        );
        let png = dir.path().join("m.png");
        let e = refused(&["plot", s(path), "-o", s(&png)]);
        assert_eq!(
            e,
            format!(
                "error: {}: is {kind}, not a regular file: lockstep reads only regular files whole",
                path.display()
            )
        );
    }
    // A fortunes directory that is a file says so, not "not found".
    let file = dir.path().join("fortunes");
    std::fs::write(&file, "a fortune\n").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args([&["train", "--data", "fortunes"][..], &gpt].concat())
        .env("LOCKSTEP_FORTUNES_DIR", &file)
        .output()
        .unwrap();
    let e = refused_by(o, &["train", "--data", "fortunes"]);
    assert_eq!(
        e,
        format!(
            "error: --data fortunes: {}: is a file, not a directory: point LOCKSTEP_FORTUNES_DIR at a directory of fortune files",
            file.display()
        )
    );
}

#[test]
fn plot_never_draws_over_its_own_csv() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("m.csv");
    let o = lockstep(&["train", "--model", "toy", "--epochs", "1", "--metrics-out", s(&csv)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let metrics = std::fs::read(&csv).unwrap();
    let (soft, hard) = (dir.path().join("soft.png"), dir.path().join("hard.png"));
    std::os::unix::fs::symlink(&csv, &soft).unwrap();
    std::fs::hard_link(&csv, &hard).unwrap();
    for out in [&csv, &soft, &hard] {
        let e = refused(&["plot", s(&csv), "-o", s(out)]);
        assert_eq!(
            e,
            format!(
                "error: {}: is the metrics CSV being plotted ({}): give the PNG a file of its own",
                out.display(),
                csv.display()
            )
        );
    }
    assert_eq!(std::fs::read(&csv).unwrap(), metrics, "the metrics are untouched");
    let png = dir.path().join("m.png");
    let o = lockstep(&["plot", s(&csv), "-o", s(&png)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn the_held_out_windows_of_a_text_are_counted_in_the_estimate() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "the quick brown fox jumps over the lazy dog\n".repeat(20)).unwrap();
    let data = format!("text:{}", s(&text));
    // 10^9 batches of 12 windows of 64 tokens: 7.68 · 10^11 tokens at 13 bytes (a byte id
    // and a u32 label kept, an f32 input and a u32 label gathered at each evaluation) and
    // 1.2 · 10^10 windows at 16 bytes (an index drawn, an index gathered): 10.2 TB.
    let e = refused(&["train", "--model", "gpt", "--data", &data, "--eval-batches", "1000000000", "--steps", "1"]);
    assert!(e.starts_with("error: training needs an estimated 10.2 TB but "), "{e}");
    assert!(
        e.contains(": held-out windows 10.2 TB (12,000,000,000 windows of 64 tokens, --eval-batches 1000000000 × --batch-size 12, drawn once and gathered at each evaluation)"),
        "{e}"
    );
}

#[test]
fn a_copy_of_a_checkpoint_directory_does_not_resume_onto_the_original_runs_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = |args: &[&str]| lockstep_in(d, args);
    let o = run(&["train", "--model", "toy", "--epochs", "1", "--checkpoint-dir", "ck", "--save", "w.safetensors"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let original = std::fs::read(d.join("w.safetensors")).unwrap();
    assert!(Command::new("cp").current_dir(d).args(["-r", "ck", "copy"]).status().unwrap().success());
    let e = refused_by(run(&["train", "--resume", "copy", "--epochs", "2"]), &["--resume", "copy"]);
    let ck = d.join("ck").canonicalize().unwrap();
    assert_eq!(
        e,
        format!(
            "error: --resume 'copy': its checkpoints were written in '{0}', so this is a copy of that run's directory (or it was moved), and the run's --save 'w.safetensors' is the original run's file: give --save FILE for this run's own output (the same path, to replace that file), or resume '{0}' itself",
            ck.display()
        )
    );
    assert_eq!(std::fs::read(d.join("w.safetensors")).unwrap(), original);
    // Given anew, the copy's output is its own.
    let o = run(&["train", "--resume", "copy", "--epochs", "2", "--save", "copy.safetensors"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(d.join("copy.safetensors").is_file());
    assert_eq!(std::fs::read(d.join("w.safetensors")).unwrap(), original);
    // The original directory resumes onto its own file, as before.
    let o = run(&["train", "--resume", "ck", "--epochs", "2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_ne!(std::fs::read(d.join("w.safetensors")).unwrap(), original);
}
