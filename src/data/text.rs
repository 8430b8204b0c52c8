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

/// A file's bytes as a training and a validation stream of windows of `context` tokens.
pub fn load_text(path: &Path, context: usize) -> Result<Splits> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_dir() {
        return Err(Error::format(path, "is a directory, not a text file"));
    }
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    split_text(&path.display().to_string(), &bytes, context)
}

/// The text files of the fortunes package (every regular file of [`FORTUNES_DIR`], or
/// of `$LOCKSTEP_FORTUNES_DIR`, but the `.dat` indexes and `.u8` copies), concatenated
/// in name order, as a training and a validation stream.
pub fn load_fortunes(context: usize) -> Result<Splits> {
    let dir = std::env::var_os(FORTUNES_DIR_VAR).map_or_else(|| PathBuf::from(FORTUNES_DIR), PathBuf::from);
    let files = fortune_files(&dir)?;
    let mut text = Vec::new();
    for f in &files {
        text.extend(std::fs::read(f).map_err(|e| Error::io(f, e))?);
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
    let entries = std::fs::read_dir(dir).map_err(|_| missing())?;
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
    if bytes.is_empty() {
        return Err(Error::Data { name: name.into(), detail: "is empty: a text needs at least one window".into() });
    }
    let cut = (bytes.len() as f64 * TRAIN_SHARE).floor() as usize;
    let tokens = |b: &[u8]| b.iter().map(|&t| u32::from(t)).collect::<Vec<u32>>();
    // In u128: a context near usize::MAX must not wrap the sizes said to 0.
    let need = context as u128 + 1;
    let short = |part: &str, len: usize| {
        Error::Data {
        name: name.into(),
        detail: format!(
            "{} bytes leave {len} for its {part} part, fewer than a window of {need} (a context of {context} and its next token); the text needs at least {} bytes",
            bytes.len(),
            need * 10
        ),
    }
    };
    if (cut as u128) < need {
        return Err(short("training", cut));
    }
    if ((bytes.len() - cut) as u128) < need {
        return Err(short("validation", bytes.len() - cut));
    }
    let train = Dataset::windows(format!("{name} (training part)"), tokens(&bytes[..cut]), context, BYTE_VOCAB)?;
    let val = Dataset::windows(format!("{name} (validation part)"), tokens(&bytes[cut..]), context, BYTE_VOCAB)?;
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
    fn a_directory_is_not_a_text() {
        let dir = std::env::temp_dir();
        let e = load_text(&dir, 4).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
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
