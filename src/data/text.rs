//! Text as tokens: a file's bytes (`--data text:FILE`), Debian's `fortunes` package
//! (`--data fortunes`), each a vocabulary of 256 byte values, cut by position into a
//! training part (the first 90%) and a validation part (the rest), each a token stream
//! whose samples are its windows (`Dataset::windows`); and token files, safetensors
//! holding `tokens` (N, T+1) of ids, whose rows are the samples
//! (`Dataset::sequences`, read by `data::safetensors_file`).
//!
//! Owns: where text comes from and how it becomes token ids. How windows are drawn per
//! step is the sampler's (`train::scatter::window_draws`).

use std::path::{Path, PathBuf};

use super::{Dataset, Splits};
use crate::error::{Error, Result};

/// Bytes as tokens: a vocabulary of every byte value.
pub const BYTE_VOCAB: usize = 256;

/// The share of a text, by position, that trains; the rest validates (nanoGPT's
/// `prepare.py` splits Shakespeare so).
pub const TRAIN_SHARE: f64 = 0.9;
// A text of 10·(T + 1) bytes is the shortest with a window on both sides; the errors say so.
const _: () = assert!(TRAIN_SHARE == 0.9);

/// Where `apt-get install fortunes` puts its text files (beside their `.dat` indexes and
/// `.u8` variants).
pub const FORTUNES_DIR: &str = "/usr/share/games/fortunes";

/// The Debian package that holds them.
pub const FORTUNES_PACKAGE: &str = "fortunes";

/// The environment variable that points at another fortunes directory.
pub const FORTUNES_DIR_VAR: &str = "LOCKSTEP_FORTUNES_DIR";

/// Memory per byte of a text while it is cut: the byte, and its id as a u32 in the
/// training or the validation stream (`split_text`).
const BYTES_PER_TEXT_BYTE: u64 = 1 + 4;

/// What a text's bytes become, for a refusal of its memory.
const BECOMES: &str = "each byte and its u32 token id";

/// A file's bytes as a training and a validation stream of windows of `context` tokens:
/// a regular file only (a FIFO or a device such as `/dev/zero` never ends), read once the
/// memory its tokens take is known to fit (`fsutil::read_whole`).
pub fn load_text(path: &Path, context: usize) -> Result<Splits> {
    let bytes = crate::fsutil::read_whole(path, BYTES_PER_TEXT_BYTE, BECOMES)?;
    split_text(&path.display().to_string(), &bytes, context)
}

/// The text files of the fortunes package (every regular file of [`FORTUNES_DIR`], or
/// of `$LOCKSTEP_FORTUNES_DIR`, but the `.dat` indexes and `.u8` copies), concatenated
/// in name order, as a training and a validation stream; their memory checked first, as
/// one text's.
pub fn load_fortunes(context: usize) -> Result<Splits> {
    let dir = std::env::var_os(FORTUNES_DIR_VAR).map_or_else(|| PathBuf::from(FORTUNES_DIR), PathBuf::from);
    let files = fortune_files(&dir)?;
    let total = files.iter().map(|f| std::fs::metadata(f).map_or(0, |m| m.len())).fold(0u64, u64::saturating_add);
    crate::memory::check_bytes(
        &format!("reading {}", dir.display()),
        total.saturating_mul(BYTES_PER_TEXT_BYTE),
        format!("{} bytes of {} files, {BECOMES}", crate::units::count(total), files.len()),
    )?;
    let mut text = Vec::new();
    for f in &files {
        text.extend(crate::fsutil::read_whole(f, 1, "the file's bytes")?);
    }
    split_text("fortunes", &text, context)
}

/// The fortunes text files of `dir`, in name order.
pub fn fortune_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let missing = || {
        Error::format(
            dir,
            format!(
                "not found: install Debian's {FORTUNES_PACKAGE} package (apt-get install {FORTUNES_PACKAGE}), or point {FORTUNES_DIR_VAR} at a directory of fortune files"
            ),
        )
    };
    match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => {
            let what = crate::safetensors_io::not_a_file(&m).unwrap_or("a file");
            return Err(Error::format(
                dir,
                format!("is {what}, not a directory: point {FORTUNES_DIR_VAR} at a directory of fortune files"),
            ));
        }
        Ok(_) => {}
        Err(_) => return Err(missing()),
    }
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut files = Vec::new();
    for e in entries {
        let path = e.map_err(|e| Error::io(dir, e))?.path();
        let ext = path.extension().and_then(|x| x.to_str());
        if matches!(ext, Some("dat") | Some("u8")) || !path.is_file() {
            continue;
        }
        files.push(path);
    }
    if files.is_empty() {
        return Err(missing());
    }
    files.sort();
    Ok(files)
}

/// `bytes` as tokens, the first [`TRAIN_SHARE`] by position training and the rest
/// validating, each cut into windows of `context`: both parts must hold one window
/// and its next token.
pub fn split_text(name: &str, bytes: &[u8], context: usize) -> Result<Splits> {
    split_tokens(name, bytes.iter().map(|&t| u32::from(t)).collect(), context, BYTE_VOCAB, "bytes")
}

/// A stream of token ids below `vocab`, split as [`split_text`] splits a text's bytes;
/// `unit` names a token in errors ("bytes", "tokens").
pub fn split_tokens(name: &str, tokens: Vec<u32>, context: usize, vocab: usize, unit: &str) -> Result<Splits> {
    if tokens.is_empty() {
        return Err(Error::Data { name: name.into(), detail: "is empty: a text needs at least one window".into() });
    }
    let len = tokens.len();
    let cut = (len as f64 * TRAIN_SHARE).floor() as usize;
    // In u128: a context near usize::MAX must not wrap the sizes said to 0.
    let need = context as u128 + 1;
    let short = |part: &str, left: usize| {
        Error::Data {
        name: name.into(),
        detail: format!(
            "{len} {unit} leave {left} for its {part} part, fewer than a window of {need} (a context of {context} and its next token); the text needs at least {} {unit}",
            need * 10
        ),
    }
    };
    if (cut as u128) < need {
        return Err(short("training", cut));
    }
    if ((len - cut) as u128) < need {
        return Err(short("validation", len - cut));
    }
    let mut train = tokens;
    let val = train.split_off(cut);
    let train = Dataset::windows(format!("{name} (training part)"), train, context, vocab)?;
    let val = Dataset::windows(format!("{name} (validation part)"), val, context, vocab)?;
    Ok(Splits { train, test: Some(val) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::Batch;

    /// Issue 41: `--context 18446744073709551615` said "a window needs 0", the sizes
    /// wrapped; they are said as they are (2^64, and ten times it).
    #[test]
    fn a_context_near_the_largest_integer_is_said_without_wrapping() {
        let e = split_text("t", &[7u8; 100], usize::MAX).unwrap_err().to_string();
        assert!(
            e.contains("fewer than a window of 18446744073709551616 (a context of 18446744073709551615 and its next token); the text needs at least 184467440737095516160 bytes"),
            "{e}"
        );
        let e = Dataset::windows("w", vec![1; 10], usize::MAX, 256).unwrap_err().to_string();
        assert!(e.ends_with("10 tokens are too few for a context of 18446744073709551615: a window needs 18446744073709551615 tokens and the next one"), "{e}");
    }

    #[test]
    fn a_text_is_cut_at_nine_tenths_and_its_windows_predict_the_next_byte() {
        let text: Vec<u8> = (0..100u8).collect();
        let s = split_text("t", &text, 4).unwrap();
        let (train, val) = (&s.train, s.test.as_ref().unwrap());
        // 90 training bytes make 86 windows of 4 (each with its next byte); 10 make 6.
        assert_eq!((train.len(), val.len()), (86, 6));
        assert_eq!(train.targets_per_sample(), 4);
        let b = Batch::gather(train, &[0, 85]);
        assert_eq!(b.x, [0.0, 1.0, 2.0, 3.0, 85.0, 86.0, 87.0, 88.0]);
        assert_eq!(b.y, [1, 2, 3, 4, 86, 87, 88, 89]);
        let v = Batch::gather(val, &[5]);
        assert_eq!(v.x, [95.0, 96.0, 97.0, 98.0]);
        assert_eq!(v.y, [96, 97, 98, 99]);
        // Drawn windows (held-out ones, `fit`) are the same windows, stored as bytes.
        let drawn = val.subset("drawn", &[5, 0]);
        assert_eq!(drawn.features(), &crate::data::Features::U8(vec![95, 96, 97, 98, 90, 91, 92, 93]));
        let b = Batch::gather(&drawn, &[0, 1]);
        assert_eq!(b.y, [96, 97, 98, 99, 91, 92, 93, 94]);
    }

    #[test]
    fn a_text_too_short_for_a_window_on_either_side_is_refused() {
        let e = split_text("t", b"", 4).unwrap_err().to_string();
        assert!(e.contains("is empty"), "{e}");
        let e = split_text("t", &[b'a'; 30], 4).unwrap_err().to_string();
        assert!(e.contains("leave 3 for its validation part") && e.contains("at least 50 bytes"), "{e}");
        let e = split_text("t", &[b'a'; 4], 4).unwrap_err().to_string();
        assert!(e.contains("for its training part"), "{e}");
        assert!(split_text("t", &[b'a'; 50], 4).is_ok());
    }

    #[test]
    fn a_directory_a_device_and_a_fifo_are_not_a_text() {
        let dir = tempfile::tempdir().unwrap();
        let e = load_text(dir.path(), 4).unwrap_err().to_string();
        assert!(e.contains("is a directory, not a regular file"), "{e}");
        // /dev/zero never ends: refused by its kind before a byte is read.
        let e = load_text(Path::new("/dev/zero"), 4).unwrap_err().to_string();
        assert_eq!(e, "/dev/zero: is a device, not a regular file: lockstep reads only regular files whole");
        // A FIFO with no writer would block its opener forever: refused unopened.
        let fifo = dir.path().join("pipe");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let e = load_text(&fifo, 4).unwrap_err().to_string();
        assert!(e.ends_with("pipe: is a FIFO, not a regular file: lockstep reads only regular files whole"), "{e}");
    }

    #[test]
    fn a_text_larger_than_memory_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sparse.txt");
        // A 2^40-byte hole (1 TiB): each byte would become 5 bytes of memory, 5.5 TB.
        std::fs::File::create(&file).unwrap().set_len(1 << 40).unwrap();
        let e = load_text(&file, 4).unwrap_err().to_string();
        assert!(e.contains(" needs an estimated 5.5 TB but "), "{e}");
        assert!(e.contains("(1,099,511,627,776 bytes of file, each byte and its u32 token id)"), "{e}");
    }

    #[test]
    fn a_fortunes_directory_that_is_a_file_is_said_so() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("fortunes.txt");
        std::fs::write(&file, "a fortune").unwrap();
        let e = fortune_files(&file).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "{}: is a file, not a directory: point LOCKSTEP_FORTUNES_DIR at a directory of fortune files",
                file.display()
            )
        );
    }

    #[test]
    fn fortunes_are_the_text_files_in_name_order() {
        let dir = std::env::temp_dir().join(format!("lockstep-fortunes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, body) in [("b", "bee"), ("a", "ay"), ("a.dat", "index"), ("a.u8", "copy")] {
            std::fs::write(dir.join(name), body).unwrap();
        }
        let files = fortune_files(&dir).unwrap();
        let names: Vec<_> = files.iter().map(|p| p.file_name().unwrap().to_str().unwrap()).collect();
        assert_eq!(names, ["a", "b"]);
        std::fs::remove_dir_all(&dir).unwrap();
        let e = fortune_files(&dir).unwrap_err().to_string();
        assert!(e.contains("apt-get install fortunes"), "{e}");
    }
}
