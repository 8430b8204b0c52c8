//! One run per checkpoint directory: an advisory lock on `DIR/lockstep.lock`, held for
//! the whole run.
//!
//! The lock is `flock(2)`, taken without waiting: the kernel releases it when the
//! holder's file is closed, which happens on every exit — a return, a panic, SIGKILL —
//! so a crashed run never leaves a lock that blocks the next one. The file also holds
//! the holder's pid, which is how a refused run names the run it collided with, and how
//! a lock left by a dead process is recognised: taking a lock whose file names a process
//! that no longer runs is reported as taking over a stale lock. On filesystems without
//! `flock` (some network mounts answer ENOLCK or EOPNOTSUPP) the pid alone decides: the
//! lock is free when the process it names is gone.
//!
//! Within one process, several holders share one lock (the command line takes it before
//! loading anything; the fit loop takes it again for library callers): a second `flock`
//! on another descriptor of the same file would refuse the process its own lock. Only
//! one of them may be running a training at a time ([`DirLock::begin_run`]).
//!
//! `rustix` makes the calls (safe wrappers of `flock` and `kill(pid, 0)`); it is already
//! in the dependency tree, under `tempfile`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rustix::fs::{flock, FlockOperation};
use rustix::io::Errno;

use crate::error::{Error, Result};

/// The lock file's name inside a checkpoint directory.
pub const LOCK_FILE: &str = "lockstep.lock";

struct HeldLock {
    /// Open for as long as the lock is held: closing it releases the `flock`.
    file: File,
    path: PathBuf,
    running: AtomicBool,
}

impl Drop for HeldLock {
    /// A lock released in order leaves an empty file: only a holder that died leaves
    /// its pid behind, which is what "stale" means.
    fn drop(&mut self) {
        let _ = self.file.set_len(0);
    }
}

/// The locks this process holds, by canonical directory.
fn held() -> &'static Mutex<HashMap<PathBuf, Weak<HeldLock>>> {
    static HELD: OnceLock<Mutex<HashMap<PathBuf, Weak<HeldLock>>>> = OnceLock::new();
    HELD.get_or_init(Default::default)
}

/// This process's hold on a checkpoint directory; released when the last clone drops.
#[derive(Clone)]
pub struct DirLock {
    held: Arc<HeldLock>,
    stale: Option<u32>,
}

impl std::fmt::Debug for DirLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirLock").field("path", &self.held.path).field("stale", &self.stale).finish()
    }
}

impl DirLock {
    /// Takes the lock of `dir` (which must exist), or fails naming the pid of the
    /// process that holds it.
    pub fn acquire(dir: &Path) -> Result<DirLock> {
        let canonical = dir.canonicalize().map_err(|e| Error::io(dir, e))?;
        let mut table = held().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = table.get(&canonical).and_then(Weak::upgrade) {
            return Ok(DirLock { held: h, stale: None });
        }
        let path = canonical.join(LOCK_FILE);
        // The lock file is the directory's own: a link is never followed (a checkpoint
        // directory on shared storage could otherwise point it at any file the runner
        // may write, which taking the lock would truncate).
        if std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(Error::format(&path, "is a symbolic link: the lock file must be the directory's own file"));
        }
        let mut file = {
            use std::os::unix::fs::OpenOptionsExt as _;
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
                .open(&path)
                .map_err(|e| Error::io(&path, e))?
        };
        if !file.metadata().map_err(|e| Error::io(&path, e))?.is_file() {
            return Err(Error::format(&path, "is not a regular file: the lock file must be the directory's own file"));
        }
        let mut text = String::new();
        let _ = file.read_to_string(&mut text);
        let previous: Option<u32> = text.trim().parse().ok().filter(|&p| p != std::process::id());
        let in_use = |pid: Option<u32>| Error::Locked { dir: dir.to_path_buf(), pid };
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(Errno::WOULDBLOCK) => return Err(in_use(previous)),
            // No flock here: the recorded holder decides.
            Err(Errno::NOLCK | Errno::OPNOTSUPP) if previous.is_some_and(alive) => return Err(in_use(previous)),
            Err(Errno::NOLCK | Errno::OPNOTSUPP) => {}
            Err(e) => return Err(Error::io(&path, e.into())),
        }
        let write = (|| -> std::io::Result<()> {
            file.set_len(0)?;
            file.rewind()?;
            writeln!(file, "{}", std::process::id())?;
            file.sync_all()
        })();
        write.map_err(|e| Error::io(&path, e))?;
        let h = Arc::new(HeldLock { file, path, running: AtomicBool::new(false) });
        table.retain(|_, w| w.strong_count() > 0);
        table.insert(canonical, Arc::downgrade(&h));
        // Whatever pid the file named no longer holds the lock. It is reported as a dead
        // owner only when no process has that pid: a live one is some unrelated process
        // (one that reused the number, or wrote the file), never "no longer running".
        Ok(DirLock { held: h, stale: previous.filter(|&p| !alive(p)) })
    }

    /// The pid of the dead process whose lock this took over, if any.
    pub fn stale_owner(&self) -> Option<u32> {
        self.stale
    }

    /// Marks the directory as trained into by this holder until the guard drops; a
    /// second run of this process on it at the same time is refused.
    pub fn begin_run(&self) -> Result<RunGuard> {
        if self.held.running.swap(true, Ordering::SeqCst) {
            let dir = self.held.path.parent().unwrap_or(&self.held.path).to_path_buf();
            return Err(Error::Locked { dir, pid: Some(std::process::id()) });
        }
        Ok(RunGuard { held: Arc::clone(&self.held) })
    }
}

/// While alive, the directory's run is in progress (see [`DirLock::begin_run`]).
pub struct RunGuard {
    held: Arc<HeldLock>,
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        self.held.running.store(false, Ordering::SeqCst);
    }
}

/// Whether a process of this pid exists (signal 0 asks without sending anything; EPERM
/// means it exists under another user).
fn alive(pid: u32) -> bool {
    let Some(pid) = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) else { return false };
    !matches!(rustix::process::test_kill_process(pid), Err(Errno::SRCH))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_shares_its_lock_but_runs_one_training_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let a = DirLock::acquire(dir.path()).unwrap();
        let b = DirLock::acquire(dir.path()).unwrap();
        let text = std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
        assert_eq!(text.trim(), std::process::id().to_string());
        let run = a.begin_run().unwrap();
        let e = b.begin_run().err().unwrap().to_string();
        assert!(e.contains(&format!("(pid {})", std::process::id())), "{e}");
        drop(run);
        assert!(b.begin_run().is_ok());
    }

    #[test]
    fn a_lock_file_that_is_a_link_is_refused_and_its_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim.txt");
        std::fs::write(&victim, b"precious").unwrap();
        let ck = dir.path().join("ck");
        std::fs::create_dir(&ck).unwrap();
        std::os::unix::fs::symlink(&victim, ck.join(LOCK_FILE)).unwrap();
        let e = DirLock::acquire(&ck).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link: the lock file must be the directory's own file"), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }

    #[test]
    fn a_live_pid_in_the_file_is_never_called_stale() {
        // A live process that holds no lock (it only wrote its pid): taken, but not
        // reported as a dead owner.
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        std::fs::write(dir.path().join(LOCK_FILE), format!("{}\n", child.id())).unwrap();
        let lock = DirLock::acquire(dir.path()).unwrap();
        assert_eq!(lock.stale_owner(), None);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_lock_file_of_a_dead_process_is_taken_over_as_stale() {
        let dir = tempfile::tempdir().unwrap();
        // A child that has exited: its pid names no process (until reused, which the
        // kernel does only after cycling through the pid space).
        let child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let status = { child }.wait().unwrap();
        assert!(status.success());
        std::fs::write(dir.path().join(LOCK_FILE), format!("{pid}\n")).unwrap();
        let lock = DirLock::acquire(dir.path()).unwrap();
        assert_eq!(lock.stale_owner(), Some(pid));
        assert!(!alive(pid));
        assert!(alive(std::process::id()));
    }
}
