//! Writing files so that a reader never sees half of one, and never replacing what is not
//! ours: every file lockstep writes (weights, checkpoints, datasets, plots) goes through
//! [`replace_with`].
//!
//! - A regular file, or a path that does not exist, is written to a temporary file in the
//!   same directory, flushed to disk, then renamed over the destination (atomic on the
//!   same filesystem). On any failure the temporary file is removed and the destination
//!   keeps its previous contents.
//! - A symbolic link is followed: the file it names is replaced that way, and the link
//!   stays.
//! - A FIFO or a character device (`/dev/null`, `/dev/stdout`) is written through, as a
//!   shell redirection would: renaming over it would replace the system's device with a
//!   regular file.
//! - Anything else (a directory, a socket, a block device) is refused, naming it.
//!
//! The temporary files being written are known ([`remove_unfinished`]), so that a process
//! ended at once (a second Ctrl-C in the middle of a checkpoint) leaves none behind.
//!
//! Also here, the two questions every writer asks of the files around it: whether two
//! paths are one file ([`same_file`], through symbolic and hard links: an output must
//! never be an input), and how a file read whole is read ([`read_whole`]: only a regular
//! file, its kind asked before it is opened, so that a FIFO with no writer cannot block;
//! only as much as it said it held; only once the memory it becomes has been checked).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// The temporary files [`replace_with`] is writing now.
static UNFINISHED: parking_lot::Mutex<Vec<PathBuf>> = parking_lot::Mutex::new(Vec::new());

/// One temporary file, known in [`UNFINISHED`] while it lives, removed from the disk
/// unless it was renamed into place.
struct Unfinished(PathBuf);

impl Unfinished {
    fn new(path: PathBuf) -> Unfinished {
        UNFINISHED.lock().push(path.clone());
        Unfinished(path)
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        let mut known = UNFINISHED.lock();
        if let Some(i) = known.iter().position(|p| *p == self.0) {
            known.swap_remove(i);
        }
        // Gone already after a rename; an error here leaves nothing to undo.
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Removes every temporary file a write of this process has not finished, for a process
/// about to end without finishing them (the second of two signals). Their destinations
/// keep their previous contents. Writes after this call are not affected.
#[cfg(feature = "cli")]
pub fn remove_unfinished() {
    for path in UNFINISHED.lock().drain(..) {
        let _ = std::fs::remove_file(path);
    }
}

/// What a destination is, as [`replace_with`] treats it.
enum Destination {
    /// A regular file, or nothing yet: replaced atomically at this path (a link's target).
    File(PathBuf),
    /// A FIFO or a character device: written through.
    Stream,
}

/// What `path` is, or why lockstep must not write it.
fn destination(path: &Path) -> Result<Destination> {
    use std::os::unix::fs::FileTypeExt as _;
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // Nothing there, or a link to nothing: a link is followed to where it points.
            return match std::fs::read_link(path) {
                Ok(target) => Ok(Destination::File(path.parent().unwrap_or(Path::new(".")).join(target))),
                Err(_) => Ok(Destination::File(path.to_path_buf())),
            };
        }
        Err(e) => return Err(Error::io(path, e)),
    };
    let t = meta.file_type();
    if meta.is_file() {
        let linked = std::fs::symlink_metadata(path).map(|m| m.file_type().is_symlink()).unwrap_or(false);
        let at = if linked { std::fs::canonicalize(path).map_err(|e| Error::io(path, e))? } else { path.to_path_buf() };
        Ok(Destination::File(at))
    } else if t.is_fifo() || t.is_char_device() {
        Ok(Destination::Stream)
    } else {
        let what = crate::safetensors_io::not_a_file(&meta).unwrap_or("not a regular file");
        Err(Error::format(path, format!("is {what}: lockstep writes only regular files, FIFOs and character devices")))
    }
}

/// Writes `path` through `fill`, which writes the whole content to the temporary path it is
/// given, as the file's docs say: atomically for a regular file, through for a FIFO or a
/// character device, refused for anything else.
pub fn replace_with(path: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let at = match destination(path)? {
        Destination::File(at) => at,
        Destination::Stream => {
            // The content is made first, beside nothing that could be mistaken for it.
            let dir = std::env::temp_dir();
            let tmp = Unfinished::new(dir.join(format!(
                ".lockstep-stream-{}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            )));
            return fill(&tmp.0).and_then(|()| {
                let bytes = std::fs::read(&tmp.0).map_err(|e| Error::io(&tmp.0, e))?;
                let mut out = std::fs::OpenOptions::new().write(true).open(path).map_err(|e| Error::io(path, e))?;
                out.write_all(&bytes).and_then(|()| out.flush()).map_err(|e| Error::io(path, e))
            });
        }
    };
    let dir = match at.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = at.file_name().ok_or_else(|| Error::format(path, "not a file path"))?;
    // Kept after the name, so that a writer picking its format by the ending (a PNG) sees it.
    let ending = at.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    let unique = format!(
        ".{}.tmp-{}-{}{ending}",
        name.to_string_lossy(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let tmp = Unfinished::new(dir.join(unique));
    fill(&tmp.0).and_then(|()| std::fs::rename(&tmp.0, &at).map_err(|e| Error::io(path, e)))
}

/// Writes `bytes` to `path` through [`replace_with`], flushed to disk before the rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    replace_with(path, |tmp| {
        let mut f = std::fs::File::create(tmp).map_err(|e| Error::io(path, e))?;
        f.write_all(bytes).and_then(|()| f.sync_all()).map_err(|e| Error::io(path, e))
    })
}

/// Whether `a` and `b` name one file: both exist and have the same device and inode, so
/// that a symbolic link, a hard link or another spelling of the path are all seen through.
/// A path that does not exist is no file yet, and the same as none.
#[cfg(any(feature = "cli", feature = "plot"))]
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => (x.dev(), x.ino()) == (y.dev(), y.ino()),
        _ => false,
    }
}

/// The bytes of the regular file `path`, read whole, once the memory they become is
/// known to fit: `per_byte` bytes of memory for each byte of the file (the file's bytes
/// and what they are turned into), `becomes` saying what, for the refusal. A FIFO, a
/// device (`/dev/zero`), a socket or a directory is refused by its kind, asked of the
/// file system before anything is opened (opening a FIFO with no writer waits forever);
/// a file that grows while it is read is read to the size it had and refused.
pub fn read_whole(path: &Path, per_byte: u64, becomes: &str) -> Result<Vec<u8>> {
    use std::io::Read as _;
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if let Some(what) = crate::safetensors_io::not_a_file(&meta) {
        return Err(Error::format(
            path,
            format!("is {what}, not a regular file: lockstep reads only regular files whole"),
        ));
    }
    let len = meta.len();
    crate::memory::check_bytes(
        &format!("reading {}", path.display()),
        len.saturating_mul(per_byte),
        format!("{} bytes of file, {becomes}", crate::units::count(len)),
    )?;
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(usize::MAX));
    // One byte past the size stat gave tells a file that grew from one that did not.
    file.take(len.saturating_add(1)).read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > len {
        return Err(Error::format(path, format!("grew while it was read (it held {len} bytes when it was opened)")));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(any(feature = "cli", feature = "plot"))]
    fn links_of_both_kinds_are_the_same_file_and_a_missing_path_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.csv");
        std::fs::write(&file, b"x").unwrap();
        let (soft, hard, other) = (dir.path().join("soft"), dir.path().join("hard"), dir.path().join("b"));
        std::os::unix::fs::symlink(&file, &soft).unwrap();
        std::fs::hard_link(&file, &hard).unwrap();
        std::fs::write(&other, b"x").unwrap();
        assert!(same_file(&file, &soft) && same_file(&hard, &file) && same_file(&soft, &hard));
        assert!(same_file(&file, &dir.path().join(".").join("a.csv")));
        assert!(!same_file(&file, &other));
        assert!(
            !same_file(&file, &dir.path().join("missing"))
                && !same_file(&dir.path().join("missing"), &dir.path().join("missing"))
        );
    }

    #[test]
    fn only_a_regular_file_is_read_whole_and_a_fifo_is_refused_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.txt");
        std::fs::write(&file, b"hello").unwrap();
        assert_eq!(read_whole(&file, 5, "tokens").unwrap(), b"hello");
        // A FIFO that nobody writes: opened, it would block this test forever.
        let fifo = dir.path().join("pipe");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let e = read_whole(&fifo, 1, "text").unwrap_err().to_string();
        assert!(e.ends_with("pipe: is a FIFO, not a regular file: lockstep reads only regular files whole"), "{e}");
        let e = read_whole(Path::new("/dev/zero"), 1, "text").unwrap_err().to_string();
        assert_eq!(e, "/dev/zero: is a device, not a regular file: lockstep reads only regular files whole");
        let e = read_whole(dir.path(), 1, "text").unwrap_err().to_string();
        assert!(e.contains("is a directory, not a regular file"), "{e}");
    }

    #[test]
    fn a_sparse_file_larger_than_memory_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("huge.txt");
        // 2^40 bytes (1 TiB) of hole: nothing on disk (ext4 takes files up to 16 TiB), and
        // at 5 bytes of memory a byte more than a machine has.
        let f = std::fs::File::create(&file).unwrap();
        f.set_len(1 << 40).unwrap();
        let e = read_whole(&file, 5, "byte tokens").unwrap_err().to_string();
        // 5 · 2^40 B = 5,497,558,138,880 B, 5.5 TB as units::human writes it.
        assert!(e.starts_with(&format!("reading {} needs an estimated 5.5 TB but ", file.display())), "{e}");
        assert!(e.contains("(1,099,511,627,776 bytes of file, byte tokens)"), "{e}");
    }

    #[test]
    fn a_fifo_is_written_through_and_stays_a_fifo() {
        use std::os::unix::fs::FileTypeExt as _;
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read(&fifo).unwrap())
        };
        write_atomic(&fifo, b"weights").unwrap();
        assert_eq!(reader.join().unwrap(), b"weights");
        assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
        // Nothing left beside it.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_link_is_followed_and_kept_and_a_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("real.safetensors");
        std::fs::write(&file, b"old").unwrap();
        let link = dir.path().join("link.safetensors");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        write_atomic(&link, b"new").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&file).unwrap(), b"new");
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let e = write_atomic(&sub, b"x").unwrap_err().to_string();
        assert!(e.contains("is a directory: lockstep writes only regular files, FIFOs and character devices"), "{e}");
        assert!(sub.is_dir());
        // A plain file is replaced, and nothing temporary stays.
        let plain = dir.path().join("plain.bin");
        write_atomic(&plain, b"1").unwrap();
        write_atomic(&plain, b"2").unwrap();
        assert_eq!(std::fs::read(&plain).unwrap(), b"2");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 4, "{names:?}");
    }
}
