//! The one way a test says it did not check something: [`skip`], which every test of the
//! crate and of `tests/` calls (the integration tests include this file by `#[path]`).
//!
//! A skip is loud (a line on stderr that the harness does not capture), counted (a record
//! in a folder of this `cargo test` run, which the suite's last binary,
//! `tests/zz_skipped.rs`, reads to end the run with the count of what was skipped and
//! why), and, where the thing must be there, a failure: `LOCKSTEP_REQUIRE_GPU=1` (which
//! `scripts/gpu-check.sh` sets) turns every skip for want of a GPU into a panic, so that a
//! green run on a GPU machine cannot mean "nothing ran".
//!
//! The records of one run are the files of `lockstep-skips/<cargo's process id>/` in the
//! system's temporary directory: every test binary of one `cargo test` is a child of the
//! same cargo process, so its id names the run without any set-up.

#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;

/// What a skipped test lacked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// A CUDA driver and a GPU (or two, or NCCL): a failure under `LOCKSTEP_REQUIRE_GPU=1`.
    Gpu,
    /// A tool or library of the machine (a C++ compiler, NVRTC, Python, MPI, ...).
    Tool,
    /// Data a package installs (Debian's Fashion-MNIST, fortunes).
    Data,
    /// A processor of the kind that printed what a page shows: the last digits of a loss
    /// differ between vector widths (tests/guide.rs compares them only on the page's).
    Processor,
}

impl Need {
    fn word(self) -> &'static str {
        match self {
            Need::Gpu => "gpu",
            Need::Tool => "tool",
            Need::Data => "data",
            Need::Processor => "processor",
        }
    }
}

/// The environment variable that turns a skip for want of a GPU into a failure.
pub const REQUIRE_GPU: &str = "LOCKSTEP_REQUIRE_GPU";

/// Says that `test` did not check what needs `need`, because `why`: a line on stderr and
/// a record for the run's count. Under `LOCKSTEP_REQUIRE_GPU=1`, a [`Need::Gpu`] skip
/// panics instead.
#[track_caller]
pub fn skip(test: &str, need: Need, why: &str) {
    if need == Need::Gpu && std::env::var(REQUIRE_GPU).is_ok_and(|v| v == "1") {
        panic!("{test}: needs a GPU, and {REQUIRE_GPU}=1 forbids skipping: {why}");
    }
    // Written to the stderr handle, not eprintln!, so the harness does not swallow it.
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
    let line = format!("{}\t{test}\t{}\n", need.word(), why.replace(['\n', '\t'], " "));
    if let Some(dir) = run_dir() {
        let _ = std::fs::create_dir_all(&dir);
        let file = dir.join(format!("{}.skips", std::process::id()));
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(file) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// The folder of this run's skip records: `lockstep-skips/<parent process id>` in the
/// temporary directory (the parent is cargo, or nextest, for every binary of one run).
pub fn run_dir() -> Option<PathBuf> {
    let ppid = parent_id()?;
    Some(std::env::temp_dir().join("lockstep-skips").join(ppid.to_string()))
}

/// This process's parent, from `/proc/self/stat` (its fourth field); None elsewhere.
fn parent_id() -> Option<u32> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The second field, the command in parentheses, may hold spaces: read after its ')'.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}
