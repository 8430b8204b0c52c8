//! The command lines of README.md and of the guide (docs/*.md), run with the built binary,
//! so that no stale command or output lands in the docs. (Their Rust blocks are run by
//! rustdoc: the `guide` module at the end of src/lib.rs.)
//!
//! The convention, also stated in docs/README.md:
//! - A ```` ```console ```` block is run. Each line that starts with `$ ` is a command, and
//!   must be `$ lockstep ARGS` or `$ cargo run --release -- ARGS`; both run this build's
//!   binary with ARGS (split on spaces; no shell). Any other command in a console block
//!   fails this test: write it in an `sh` block.
//! - The lines under a command, up to the next command, are what it prints: each one,
//!   with every run of spaces read as one, must begin some line of the command's stdout or
//!   stderr (so a line may be shown without a trailing `| best`). Its numbers are compared
//!   digit for digit where this processor is of the kind that printed the page (see
//!   below), and read as "some number" elsewhere; timings, rates and sizes of memory
//!   (`0.57s`, `2563 samples/s`, `109.7 MB`) and whatever `bench`, `devices` and a
//!   `--devices cuda` run print are always "some number".
//!   A line `...` stands for lines left out. A first shown line `error: ...` means the
//!   command is refused: it must exit with code 2 (a bad input); otherwise it must exit 0.
//! - A page that shows a number that is compared says once which processor printed it, in
//!   a note that begins a line with `(Printed on ` and names its vector width (`AVX-512`
//!   or `AVX2`): the last digits of a loss or an accuracy differ between widths (the GEMM's
//!   small-product kernel sums 16 lanes at a time, or 8). Where this processor's width is
//!   another, the page's numbers are not compared, and the run says so through the skip
//!   helper. A shown command whose output depends on the cores (`cpu:2` says how many
//!   threads each device has) is written with its threads (`cpu:2x1`).
//! - The commands of one block run in order in one fresh temporary directory (files one
//!   command writes, the next reads), in which `examples` links to the repository's
//!   `examples/`.
//! - A `train` command must train: its epoch lines count up to its `--epochs` (when it
//!   gives one, and no `--steps`, early stopping or resume cuts the run short), every
//!   epoch line's losses are finite, it prints `trained N steps` and its final accuracy,
//!   and the files it was asked to write (`--save`, `--metrics-out`, `--save-best`,
//!   `--checkpoint-dir`) exist afterwards. A `--resume` of a finished run says so instead.
//! - A command that needs what this machine may lack is skipped with a line on stderr
//!   saying why: `--data fashion-mnist` without `/usr/share/datasets/fashion-mnist` (or
//!   `LOCKSTEP_FASHION_MNIST_DIR`), `--devices cuda...` without a GPU and NVRTC. The rest
//!   of its block still runs (a command that reads its files is skipped too).
//! - ```` ```sh ```` blocks are never run: installation, MPI launchers, runs that take
//!   minutes. The text beside each says why.
//!
//! The main job, `cargo run --release -- train` (15 epochs of the convnet on the digits),
//! is run in full, as the README shows it (how long it takes is the README's shown output),
//! and must reach at least 97% on any processor; the rest of the guide's commands take
//! about as long again. A command that takes over 2 s says so on stderr.
//!
//! The README's "Measured" table is a copy of rows of docs/performance.md's table of
//! figures, the one place each figure lives; a test here keeps the copy equal.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

#[path = "../src/testing/skip.rs"]
mod skip;

/// One command of a console block, with the lines the docs show under it.
#[derive(Debug)]
struct Shown {
    /// `file:line` of the command.
    at: String,
    args: Vec<String>,
    output: Vec<String>,
}

/// Where the reader of a markdown file is.
enum Fence {
    Text,
    Console(Vec<Shown>),
    /// Inside a block of another language.
    Other,
}

/// The console blocks of one markdown file, each a list of commands. Panics on a console
/// command that is not lockstep's, on a bare ``` block and on an unclosed fence.
fn console_blocks(file: &str, text: &str) -> Vec<Vec<Shown>> {
    let mut blocks = Vec::new();
    let mut fence = Fence::Text;
    for (i, line) in text.lines().enumerate() {
        let at = format!("{file}:{}", i + 1);
        if let Some(info) = line.trim_start().strip_prefix("```") {
            fence = match (fence, info.trim()) {
                (Fence::Text, "console") => Fence::Console(Vec::new()),
                (Fence::Text, "") => {
                    panic!("{at}: a bare ``` block (rustdoc would compile it as Rust): name its language")
                }
                (Fence::Text, _) => Fence::Other,
                (Fence::Console(block), _) => {
                    blocks.push(block);
                    Fence::Text
                }
                (Fence::Other, _) => Fence::Text,
            };
            continue;
        }
        let Fence::Console(block) = &mut fence else { continue };
        if let Some(command) = line.strip_prefix("$ ") {
            let words: Vec<&str> = command.split_whitespace().collect();
            let args = match words.as_slice() {
                ["lockstep", rest @ ..] => rest,
                ["cargo", "run", "--release", "--", rest @ ..] => rest,
                _ => panic!("{at}: `{command}` in a console block is not a lockstep command: use an sh block"),
            };
            block.push(Shown { at, args: args.iter().map(|a| a.to_string()).collect(), output: Vec::new() });
        } else if let Some(last) = block.last_mut() {
            last.output.push(line.to_string());
        } else if !line.trim().is_empty() {
            panic!("{at}: a console block's first line must be a command: `{line}`");
        }
    }
    assert!(matches!(fence, Fence::Text), "{file}: a ``` block is not closed");
    blocks
}

/// How the numbers of a shown line are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Numbers {
    /// Every number is "some number": the page was printed on a processor of another
    /// vector width, or the command prints the machine's own figures.
    Any,
    /// Digit for digit, but timings, rates and sizes of memory.
    Exact,
}

/// The units after a number that make it a measurement of this run (a time, a rate, an
/// amount of memory), which differs from run to run and machine to machine.
const MEASURED: [&str; 15] =
    ["s", "ms", "µs", "us", "samples/s", "tokens/s", "GB/s", "B", "KB", "MB", "GB", "KiB", "MiB", "GiB", "%"];

/// JSON keys whose values are measurements.
const MEASURED_KEYS: [&str; 2] = ["\"samples_per_sec\":", "\"seconds\":"];

/// Whether the number between `before` and `after` is a measurement (see [`MEASURED`]).
fn measured(before: &str, after: &str) -> bool {
    let unit: String =
        after.trim_start().chars().take_while(|c| !c.is_whitespace() && !matches!(c, ')' | ',' | '|' | ';')).collect();
    MEASURED.contains(&unit.as_str()) || MEASURED_KEYS.iter().any(|k| before.ends_with(k))
}

/// What a shown line and a printed line must share: every run of spaces becomes one, and
/// every number that is not compared (all of them under [`Numbers::Any`], the measurements
/// under [`Numbers::Exact`]) becomes `#` for each run of its digits (`0.57` is `#.#`).
/// Column widths vary, and so do the numbers the mode leaves out.
fn shape(line: &str, numbers: Numbers) -> String {
    fn push(out: &mut String, c: char) {
        if !((c == '#' || c == ' ') && out.ends_with(c)) {
            out.push(c);
        }
    }
    let chars: Vec<char> = line.trim_end().chars().collect();
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_digit() {
            push(&mut out, chars[i]);
            i += 1;
            continue;
        }
        // A number: digits, and a '.' between two digits.
        let start = i;
        while i < chars.len()
            && (chars[i].is_ascii_digit() || (chars[i] == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit)))
        {
            i += 1;
        }
        let before: String = chars[..start].iter().collect();
        let after: String = chars[i..].iter().collect();
        for &c in &chars[start..i] {
            match numbers {
                Numbers::Exact if !measured(&before, &after) => out.push(c),
                _ => push(&mut out, if c == '.' { '.' } else { '#' }),
            }
        }
    }
    out
}

/// The vector width of a processor: what the last digits of a loss depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Width {
    Avx512,
    Avx2,
    /// Neither: no page names one, so nothing is compared there.
    Other,
}

impl Width {
    /// This processor's, by its features: `avx512f`, else `avx2`.
    fn here() -> Width {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Width::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Width::Avx2;
            }
        }
        Width::Other
    }

    fn name(self) -> &'static str {
        match self {
            Width::Avx512 => "AVX-512",
            Width::Avx2 => "AVX2",
            Width::Other => "neither AVX-512 nor AVX2",
        }
    }
}

/// The vector width named by the page's note `(Printed on ...)`, which says which processor
/// printed the outputs it shows: AVX-512 or AVX2, never `Other`. Panics on a second note,
/// or one that names no width.
fn printed_on(file: &str, text: &str) -> Option<Width> {
    let mut notes = text.lines().enumerate().filter(|(_, l)| l.trim_start().starts_with("(Printed on "));
    let (i, note) = notes.next()?;
    if let Some((j, _)) = notes.next() {
        panic!("{file}:{}: a second `(Printed on` note (the first is line {}): say it once a page", j + 1, i + 1);
    }
    let width = if note.contains("AVX-512") {
        Width::Avx512
    } else if note.contains("AVX2") {
        Width::Avx2
    } else {
        panic!("{file}:{}: the note names no vector width (AVX-512 or AVX2): {note}", i + 1)
    };
    Some(width)
}

/// Whether a command prints figures of the machine that runs it (timings, its cores, a
/// GPU's roundings) rather than of the computation.
fn prints_the_machine(args: &[String]) -> bool {
    matches!(args.first().map(String::as_str), Some("bench" | "devices"))
        || flag(args, "--devices").is_some_and(|d| d.starts_with("cuda"))
}

/// How the numbers of `cmd`'s shown lines are read, on a page printed on `page`.
fn numbers_for(cmd: &Shown, page: Option<Width>) -> Numbers {
    if page == Some(Width::here()) && !prints_the_machine(&cmd.args) {
        Numbers::Exact
    } else {
        Numbers::Any
    }
}

/// Whether some shown line of `cmd` has a number that is compared on the page's processor.
fn shows_compared_numbers(cmd: &Shown) -> bool {
    !prints_the_machine(&cmd.args) && cmd.output.iter().any(|l| shape(l, Numbers::Exact) != shape(l, Numbers::Any))
}

/// The value of `--flag VALUE` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
}

/// Why this machine cannot run `args`, if it cannot.
fn missing(args: &[String], machine: &Machine) -> Option<String> {
    if flag(args, "--data") == Some("fashion-mnist") || flag(args, "--val-data") == Some("fashion-mnist") {
        let dir = std::env::var_os("LOCKSTEP_FASHION_MNIST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/share/datasets/fashion-mnist"));
        if !dir.is_dir() {
            return Some(format!("{} is absent (apt-get install dataset-fashion-mnist)", dir.display()));
        }
    }
    if flag(args, "--devices").is_some_and(|d| d.starts_with("cuda")) && !machine.gpu {
        return Some("no GPU with NVRTC here (`lockstep devices` says why)".to_string());
    }
    None
}

/// What this machine offers, from `lockstep devices`.
struct Machine {
    gpu: bool,
}

impl Machine {
    fn probe() -> Machine {
        let o = Command::new(env!("CARGO_BIN_EXE_lockstep")).arg("devices").output().expect("the binary runs");
        let out = String::from_utf8_lossy(&o.stdout);
        let line = |name: &str| out.lines().find(|l| l.starts_with(name)).unwrap_or("").to_string();
        let gpu = !line("cuda:").contains("none") && !line("nvrtc:").contains("not found");
        Machine { gpu }
    }
}

/// The lines of a run's stdout and stderr, together.
fn printed(o: &Output) -> Vec<String> {
    let text = format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    text.lines().map(str::to_string).collect()
}

/// Each shown line (but `...`) must begin a printed line, its numbers read as `numbers` says.
fn check_shown(cmd: &Shown, lines: &[String], numbers: Numbers) {
    let shapes: Vec<String> = lines.iter().map(|l| shape(l, numbers)).collect();
    for want in cmd.output.iter().filter(|l| l.trim() != "..." && !l.trim().is_empty()) {
        let want = shape(want, numbers);
        assert!(
            shapes.iter().any(|got| got.starts_with(&want)),
            "{}: the docs show\n  {want}\nbut `lockstep {}` printed no line of that form ({numbers:?} numbers):\n{}",
            cmd.at,
            cmd.args.join(" "),
            lines.join("\n")
        );
    }
}

/// `epoch k/E | train loss L ... | test loss L ...`: (k, E) and whether every loss is finite.
fn epoch_line(line: &str) -> Option<(usize, usize, bool)> {
    let rest = line.strip_prefix("epoch ")?.trim_start();
    let (k, rest) = rest.split_once('/')?;
    let (e, rest) = rest.split_once(" | ")?;
    let finite = rest
        .split(" | ")
        .filter_map(|part| part.split_once(" loss ").map(|(_, v)| v.split_whitespace().next().unwrap_or("")))
        .all(|v| v.parse::<f64>().is_ok_and(f64::is_finite));
    Some((k.parse().ok()?, e.parse().ok()?, finite))
}

/// What every run of `train` must have printed and written.
fn check_trained(cmd: &Shown, lines: &[String], dir: &Path) {
    let run = format!("{}: `lockstep {}`", cmd.at, cmd.args.join(" "));
    let all = lines.join("\n");
    let has = |name: &str| cmd.args.iter().any(|a| a == name);
    if has("--resume") && all.contains("is complete") {
        return;
    }
    let epochs: Vec<(usize, usize, bool)> = lines.iter().filter_map(|l| epoch_line(l)).collect();
    assert!(!epochs.is_empty() || has("--steps"), "{run} printed no epoch line:\n{all}");
    assert!(epochs.iter().all(|e| e.2), "{run}: a loss that is not a finite number:\n{all}");
    assert!(epochs.windows(2).all(|w| w[1].0 == w[0].0 + 1), "{run}: epochs not in order:\n{all}");
    if let (Some(e), false) = (flag(&cmd.args, "--epochs"), has("--steps") || has("--early-stopping")) {
        let e: usize = e.parse().expect("--epochs is a number");
        assert_eq!(epochs.last().map(|l| (l.0, l.1)), Some((e, e)), "{run}: not {e} epochs:\n{all}");
    }
    let trained = lines
        .iter()
        .find_map(|l| l.strip_prefix("trained ")?.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("{run} printed no `trained N steps` line:\n{all}"));
    assert!(trained > 0, "{run} trained no step:\n{all}");
    let accuracy = lines
        .iter()
        .filter_map(|l| l.strip_prefix("final ").and_then(|l| l.split_once(" accuracy")))
        .filter_map(|(_, v)| v.trim_start_matches(':').split_whitespace().next()?.parse::<f64>().ok())
        .next_back()
        .unwrap_or_else(|| panic!("{run} printed no final accuracy:\n{all}"));
    assert!((0.0..=1.0).contains(&accuracy), "{run}: accuracy {accuracy}:\n{all}");
    if cmd.args == ["train"] {
        // The main job: the README shows what seed 0 reaches on its page's processor (compared
        // digit for digit there, by check_shown) and states the range over seeds 0–4; 97%
        // leaves room for another vector width's summation order (or a GPU's).
        assert!(accuracy >= 0.97, "{run}: the main job reached {accuracy}, below the README's range:\n{all}");
    }
    for out in ["--save", "--metrics-out", "--save-best", "--checkpoint-dir"] {
        if let Some(path) = flag(&cmd.args, out) {
            assert!(dir.join(path).exists(), "{run} did not write {path}:\n{all}");
        }
    }
}

/// Runs every command of one block in a fresh directory, on a page printed on `page`;
/// returns the commands run.
fn run_block(block: &[Shown], machine: &Machine, page: Option<Width>) -> usize {
    let dir = tempfile::tempdir().unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    std::os::unix::fs::symlink(&examples, dir.path().join("examples")).unwrap();
    let mut ran = 0;
    let mut skipped_because: Option<String> = None;
    for cmd in block {
        let why = missing(&cmd.args, machine).or_else(|| {
            // A later command may read what a skipped one would have written.
            skipped_because.as_ref().map(|w| format!("an earlier command of its block was skipped ({w})"))
        });
        if let Some(why) = why {
            skip::skip(&format!("{}: `lockstep {}`", cmd.at, cmd.args.join(" ")), skip::Need::Tool, &why);
            skipped_because.get_or_insert(why);
            continue;
        }
        let start = Instant::now();
        let o = Command::new(env!("CARGO_BIN_EXE_lockstep"))
            .args(&cmd.args)
            .current_dir(dir.path())
            .output()
            .expect("the binary runs");
        if start.elapsed().as_secs_f64() > 2.0 {
            eprintln!("guide: {} took {:.1}s", cmd.at, start.elapsed().as_secs_f64());
        }
        let lines = printed(&o);
        let refused = cmd.output.iter().find(|l| l.trim() != "...").is_some_and(|l| l.starts_with("error: "));
        let want = if refused { 2 } else { 0 };
        assert_eq!(
            o.status.code(),
            Some(want),
            "{}: `lockstep {}` exited {:?}, the docs expect {want}:\n{}",
            cmd.at,
            cmd.args.join(" "),
            o.status,
            lines.join("\n")
        );
        check_shown(cmd, &lines, numbers_for(cmd, page));
        if cmd.args.first().map(String::as_str) == Some("train") && !refused {
            check_trained(cmd, &lines, dir.path());
        }
        ran += 1;
    }
    ran
}

/// README.md and docs/*.md, in name order.
fn documents() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let mut chapters: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ is the guide")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    chapters.sort();
    files.extend(chapters);
    files
        .into_iter()
        .map(|p| {
            let name = p.strip_prefix(root).unwrap().display().to_string();
            let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, text)
        })
        .collect()
}

#[test]
fn every_command_line_of_the_readme_and_the_guide_runs_as_shown() {
    let machine = Machine::probe();
    let start = Instant::now();
    let (mut ran, mut trains) = (0, 0);
    for (name, text) in documents() {
        let blocks = console_blocks(&name, &text);
        let page = printed_on(&name, &text);
        if let Some(cmd) = blocks.iter().flatten().find(|c| shows_compared_numbers(c)) {
            let width = page.unwrap_or_else(|| {
                panic!(
                    "{}: shows numbers that differ by processor, and the page has no `(Printed on ...)` note",
                    cmd.at
                )
            });
            if width != Width::here() {
                let why = format!(
                    "printed on {} (the page's note), run on {}: its numbers read as any number",
                    width.name(),
                    Width::here().name()
                );
                skip::skip(&format!("{name}: the shown numbers"), skip::Need::Processor, &why);
            }
        }
        for block in blocks {
            ran += run_block(&block, &machine, page);
            trains += block.iter().filter(|c| c.args.first().map(String::as_str) == Some("train")).count();
        }
    }
    eprintln!("guide: ran {ran} commands ({trains} of them train) in {:.1}s", start.elapsed().as_secs_f64());
    // The README's own examples are among them: the main job and the five-line example.
    assert!(trains >= 3 && ran >= 7, "too few commands found: the convention above is not being read");
}

#[test]
fn every_chapter_is_compiled_by_rustdoc_and_linked_from_the_index() {
    let lib = include_str!("../src/lib.rs");
    let index = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/README.md")).unwrap();
    for (name, _) in documents() {
        let include = format!("include_str!(\"../{name}\")");
        assert!(lib.contains(&include), "src/lib.rs's guide module does not compile {name}'s Rust blocks");
        if let Some(chapter) = name.strip_prefix("docs/").filter(|c| *c != "README.md") {
            assert!(index.contains(&format!("]({chapter})")), "docs/README.md does not link to {chapter}");
        }
    }
}

#[test]
fn the_readme_points_at_the_one_table_of_layer_types() {
    // src/spec.rs's test keeps docs/command-line.md's table equal to nn::LAYER_TYPES and
    // refuses a page that lists only some of the types; the README links to it.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(readme.contains("(docs/command-line.md#models-without-rust)"), "README.md links to the table");
    let chapter = std::fs::read_to_string(root.join("docs/command-line.md")).unwrap();
    assert!(chapter.contains("\n## Models without Rust\n"), "the anchor the README links to");
}

/// The Rust blocks of a markdown file (```` ```rust ````, alone or with rustdoc's
/// attributes: `rust,no_run`), each with the `file:line` of its fence.
fn rust_blocks(file: &str, text: &str) -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, String)> = None;
    let mut other = false;
    for (i, line) in text.lines().enumerate() {
        let Some(info) = line.trim_start().strip_prefix("```") else {
            if let Some((_, body)) = &mut open {
                body.push_str(line);
                body.push('\n');
            }
            continue;
        };
        if let Some(block) = open.take() {
            blocks.push(block);
        } else if other {
            other = false;
        } else if info.trim() == "rust" || info.trim().starts_with("rust,") {
            open = Some((format!("{file}:{}", i + 1), String::new()));
        } else {
            other = true;
        }
    }
    blocks
}

/// The names, as Rust writes them (`-` as `_`), of every crate this crate depends on in
/// Cargo.toml (its dependencies, dev-dependencies and build-dependencies, for any target).
fn dependency_names(manifest: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut in_dependencies = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_dependencies = line.trim_matches(['[', ']']).ends_with("dependencies");
        } else if let Some((name, _)) = line.split_once('=').filter(|_| in_dependencies && !line.starts_with('#')) {
            names.push(name.trim().replace('-', "_"));
        }
    }
    names
}

/// Whether Rust code names the crate `name` (a path `name::...` not inside another path,
/// or `extern crate name`).
fn names_crate(code: &str, name: &str) -> bool {
    let path = format!("{name}::");
    code.match_indices(&path).any(|(i, _)| !code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':'))
        || code.contains(&format!("extern crate {name}"))
}

#[test]
fn every_rust_block_pastes_into_a_crate_that_depends_on_lockstep_alone() {
    // rustdoc compiles the guide's blocks with this crate's dev-dependencies at hand
    // (tempfile, regex, ...), which a reader's new crate, whose one dependency is
    // lockstep, does not have; nor lockstep's own dependencies (safetensors, serde_json):
    // a block names none of them.
    let manifest = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).unwrap();
    let names = dependency_names(&manifest);
    assert!(["tempfile", "safetensors", "serde_json"].iter().all(|n| names.iter().any(|m| m == n)), "{names:?}");
    assert!(names_crate("let dir = tempfile::tempdir();", "tempfile"));
    assert!(!names_crate("let x = lockstep::half::f16::ONE; std::fs::write(p, b)", "half"));
    assert!(!names_crate("std::fs::write(p, b)", "fs"));
    let mut blocks = 0;
    for (name, text) in documents() {
        for (at, code) in rust_blocks(&name, &text) {
            blocks += 1;
            for dependency in &names {
                assert!(
                    !names_crate(&code, dependency),
                    "{at}: the block uses the crate `{dependency}`, which a crate whose only dependency is \
                     lockstep does not have (the temporary folder: std::env::temp_dir())"
                );
            }
        }
    }
    assert!(blocks >= 15, "only {blocks} Rust blocks found: the fences are not being read");
}

/// The first markdown table under the line `heading` of `text`: its column names, and its
/// rows as cells in the columns' order.
fn table_under(file: &str, text: &str, heading: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let cells = |line: &str| -> Vec<String> {
        line.trim().trim_start_matches('|').trim_end_matches('|').split('|').map(|c| c.trim().to_string()).collect()
    };
    let mut lines = text.lines().skip_while(|l| *l != heading);
    assert!(lines.next().is_some(), "{file}: no line `{heading}`");
    let mut table = lines.skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|'));
    let columns = cells(table.next().unwrap_or_else(|| panic!("{file}: no table under `{heading}`")));
    let rows: Vec<Vec<String>> = table.skip(1).map(cells).collect();
    for row in &rows {
        assert_eq!(
            row.len(),
            columns.len(),
            "{file}: a row of the table under `{heading}` has another count of cells: {row:?}"
        );
    }
    (columns, rows)
}

#[test]
fn the_readmes_measured_rows_are_rows_of_the_performance_table() {
    // The figures live in docs/performance.md's table; the README's "Measured" table shows
    // some of its rows, which this holds to be the same facts: for each README row, the
    // performance table's row of the same `what` has the same cell in every README column
    // (figures, ratio, machine and date).
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let chapter = std::fs::read_to_string(root.join("docs/performance.md")).unwrap();
    let (columns, rows) = table_under("README.md", &readme, "## Measured");
    let (all_columns, all_rows) = table_under("docs/performance.md", &chapter, "## Figures");
    let at = |cols: &[String], name: &str| cols.iter().position(|c| c == name);
    let what = at(&all_columns, "what").expect("the performance table has a `what` column");
    for (i, row) in all_rows.iter().enumerate() {
        assert!(
            all_rows[..i].iter().all(|r| r[what] != row[what]),
            "docs/performance.md: two rows `{}`: each figure once",
            row[what]
        );
    }
    assert!(columns.first().is_some_and(|c| c == "what") && rows.len() >= 3, "README.md's table: {columns:?}");
    for row in &rows {
        let theirs = all_rows
            .iter()
            .find(|r| r[what] == row[0])
            .unwrap_or_else(|| panic!("README.md's row `{}` is not a row of docs/performance.md's table", row[0]));
        for (c, name) in columns.iter().enumerate() {
            let j = at(&all_columns, name).unwrap_or_else(|| {
                panic!("README.md's column `{name}` is not a column of docs/performance.md's table")
            });
            assert_eq!(row[c], theirs[j], "README.md's row `{}`, column `{name}`: not docs/performance.md's", row[0]);
        }
    }
}

#[test]
fn the_convention_reads_commands_output_and_skips_other_blocks() {
    let doc = "text\n```sh\n$ mpirun -np 2 lockstep train\n```\n```console\n$ lockstep train --epochs 1\nepoch 1/1 | x\n...\n$ cargo run --release -- devices\n```\n";
    let blocks = console_blocks("t.md", doc);
    assert_eq!(blocks.len(), 1, "{blocks:?}");
    assert_eq!(blocks[0][0].args, ["train", "--epochs", "1"]);
    assert_eq!(blocks[0][0].output, ["epoch 1/1 | x", "..."]);
    assert_eq!(blocks[0][1].args, ["devices"]);
    assert_eq!(blocks[0][1].at, "t.md:9");
    assert_eq!(
        shape("epoch 12/15 | loss 0.0535 |  2742 samples/s ", Numbers::Any),
        "epoch #/# | loss #.# | # samples/s"
    );
    assert_eq!(
        shape("epoch 12/15 | loss 0.0535 |  2742 samples/s | 0.57s", Numbers::Exact),
        "epoch 12/15 | loss 0.0535 | # samples/s | #.#s"
    );
    assert_eq!(
        shape("trained 675 steps in 11.97s (2023 samples/s)", Numbers::Exact),
        "trained 675 steps in #.#s (# samples/s)"
    );
    assert_eq!(shape("an estimated 109.7 MB of the 22.7 GB", Numbers::Exact), "an estimated #.# MB of the #.# GB");
    assert_eq!(shape("{\"loss\":0.25,\"seconds\":0.0012}", Numbers::Exact), "{\"loss\":0.25,\"seconds\":#.#}");
    assert_eq!(shape("weights saved (f32).", Numbers::Exact), "weights saved (f32).");
    let page = "text\n(Printed on an Intel Xeon with AVX-512; the last digits differ elsewhere.)\n";
    assert_eq!(printed_on("t.md", page), Some(Width::Avx512));
    assert_eq!(printed_on("t.md", "no note"), None);
    let bench = &console_blocks("t.md", "```console\n$ lockstep bench step\n181332 samples/s | 0.3 ms\n```\n")[0][0];
    assert!(!shows_compared_numbers(bench) && numbers_for(bench, Some(Width::here())) == Numbers::Any);
    assert_eq!(epoch_line("epoch  1/15 | train loss 2.2914 acc 0.15 | test loss NaN acc 0.1"), Some((1, 15, false)));
}

#[test]
#[should_panic(expected = "not a lockstep command")]
fn a_console_block_holds_only_lockstep_commands() {
    console_blocks("t.md", "```console\n$ mpirun -np 2 lockstep train\n```\n");
}
