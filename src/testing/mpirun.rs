//! What the crate's MPI tests share (the `mpi` feature): starting copies of this test
//! executable under `mpirun` as the processes of one world, each running one ignored child
//! test, and reading back what they did. A parent test names its child test by path
//! ([`spawn`]); the child reads what it is to do from its environment ([`child_case`]).
//!
//! The tests of the command line across processes (the binary under `mpirun`) are
//! tests/mpi.rs's; these are the checks that need the crate's inside: the exchange between
//! processes against the shared-memory one (`exchange::mpi`), the NCCL clique id
//! (`exchange::gpu`), and faults that the library, not the CLI, carries (`world::mpi`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::skip::{skip, Need};

/// The variable that tells a child what to do, and the one that names its folder.
const CHILD: &str = "LOCKSTEP_MPI_CHILD";
const CHILD_DIR: &str = "LOCKSTEP_MPI_CHILD_DIR";

/// True where `mpirun` is on PATH; otherwise the one skip helper says that `test` did not run.
pub(crate) fn ready(test: &str) -> bool {
    match Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => true,
        _ => {
            skip(test, Need::Tool, "no mpirun on PATH (apt-get install openmpi-bin libopenmpi-dev)");
            false
        }
    }
}

/// `mpirun` for `np` processes on this machine, as CI runs it (root in a container, more
/// processes than cores), with `extra` arguments (e.g. MCA parameters).
pub(crate) fn mpirun(np: usize, extra: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string()]).args(extra);
    // A run that hangs must fail the test, not CI: mpirun's own timeout ends the job.
    c.args(["--timeout", "120"]);
    c
}

/// A scratch directory for one test's processes, removed when dropped.
pub(crate) struct Scratch(tempfile::TempDir);

impl Scratch {
    pub(crate) fn new() -> Scratch {
        Scratch(tempfile::Builder::new().prefix("lockstep-mpi-").tempdir().unwrap())
    }

    pub(crate) fn dir(&self) -> &Path {
        self.0.path()
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

/// Starts `np` copies of this test executable under mpirun (with `extra` arguments), each
/// running the ignored test `child` (its path, [`super::test_path`]) alone, told to do
/// `what`, with `dir` for its files; returns mpirun, its output piped.
pub(crate) fn spawn(np: usize, extra: &[&str], child: &str, what: &str, dir: &Path) -> Child {
    mpirun(np, extra)
        .arg(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", child, "--nocapture", "--test-threads", "1"])
        .env(CHILD, what)
        .env(CHILD_DIR, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// In a child started by [`spawn`]: what it is to do, and its folder. None in any other run
/// of the ignored test (which then does nothing).
pub(crate) fn child_case() -> Option<(String, PathBuf)> {
    let what = std::env::var(CHILD).ok()?;
    let dir = std::env::var(CHILD_DIR).unwrap_or_else(|_| panic!("{CHILD} without {CHILD_DIR}"));
    Some((what, PathBuf::from(dir)))
}

/// The pids the children wrote (`pid-<process>` in `dir`), once all `np` are there.
pub(crate) fn pids(dir: &Path, np: usize) -> Vec<u32> {
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

/// True once process `pid` is gone (or a zombie).
pub(crate) fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |s| s.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with(['Z', 'X'])))
}

/// Waits for mpirun; returns its output, and how long after `since` it ended.
pub(crate) fn finish(child: Child, since: Instant) -> (Output, Duration) {
    let o = child.wait_with_output().unwrap();
    (o, since.elapsed())
}

/// A run's stdout and stderr, one after the other.
pub(crate) fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}
