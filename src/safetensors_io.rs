//! The safetensors container as lockstep reads and writes it: weights, checkpoints and
//! datasets all go through here.
//!
//! Reading: a file is checked before anything of it is loaded — it must be a regular
//! file (a directory or a FIFO is named as such), hold the 8-byte header length, and that
//! length must fit the file and the format's 100 MB cap — and only then mapped
//! (`memmap2`), never read whole: parsing the header touches its pages alone, and a
//! tensor's bytes are paged in when the caller reads them. A 4 GB file whose header
//! length is 0 is refused after reading 8 bytes. A header that gives a key twice (two
//! tensors named alike) is refused ([`check_keys`]); the crate would keep the last.
//!
//! Writing: [`serialize`] lays the header out in ONE order — `__metadata__` first with
//! its keys sorted, then the tensors in the order given — so that the same tensors and
//! metadata always make the same bytes (the `safetensors` crate's writer serialises the
//! metadata from a `HashMap`, whose order changes from run to run). The parsing and
//! validation of offsets stays the `safetensors` crate's.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The largest header the format allows (the `safetensors` crate's limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// A safetensors file whose header length has been checked, mapped into memory.
pub struct MappedFile {
    path: PathBuf,
    map: memmap2::Mmap,
}

impl std::ops::Deref for MappedFile {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl MappedFile {
    /// The file's path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed container (header and offsets validated by the `safetensors` crate).
    pub fn parse(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.map)
            .map_err(|e| Error::format(&self.path, format!("not a valid safetensors file: {e}")))
    }

    /// The header's `__metadata__` entries (empty when there are none).
    pub fn metadata(&self) -> Result<BTreeMap<String, String>> {
        let (_, header) = SafeTensors::read_metadata(&self.map)
            .map_err(|e| Error::format(&self.path, format!("not a valid safetensors file: {e}")))?;
        Ok(header.metadata().clone().unwrap_or_default().into_iter().collect())
    }
}

/// What a path is when it is not a regular file: "a directory", "a FIFO", ...; `None`
/// for a regular file (or a link to one).
pub fn not_a_file(meta: &std::fs::Metadata) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt as _;
    let t = meta.file_type();
    if meta.is_file() {
        None
    } else if meta.is_dir() {
        Some("a directory")
    } else if t.is_fifo() {
        Some("a FIFO")
    } else if t.is_socket() {
        Some("a socket")
    } else if t.is_block_device() || t.is_char_device() {
        Some("a device")
    } else {
        Some("not a regular file")
    }
}

/// Opens `path`, checks its header length against its size, and maps it.
pub fn map_file(path: &Path) -> Result<MappedFile> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if let Some(what) = not_a_file(&meta) {
        return Err(Error::format(path, format!("is {what}, not a safetensors file")));
    }
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let len = meta.len();
    let mut head = [0u8; 8];
    if len < 8 {
        return Err(Error::format(path, format!("not a valid safetensors file: {len} bytes, too short for a header")));
    }
    file.read_exact(&mut head).map_err(|e| Error::io(path, e))?;
    let n = u64::from_le_bytes(head);
    // The smallest header is "{}".
    if !(2..=MAX_HEADER_BYTES).contains(&n) || n > len - 8 {
        let why = if n > MAX_HEADER_BYTES {
            format!("above the format's limit of {MAX_HEADER_BYTES}")
        } else if n < 2 {
            "too small for any header".to_string()
        } else {
            format!("past the end of the {len}-byte file")
        };
        return Err(Error::format(path, format!("not a valid safetensors file: header length {n} is {why}")));
    }
    let mapped = map(path, &file)?;
    check_keys(path, &mapped)?;
    Ok(mapped)
}

/// Refuses a header that gives a key twice: the `safetensors` crate reads the header
/// into a map, so of two tensors named 'x' the last would silently win (two views of one
/// region accepted as one tensor, or the first region reported as "invalid offset").
/// `bytes` is the whole file; a header that is too short or not UTF-8 is left to the
/// crate's parse to report.
pub fn check_keys(path: &Path, bytes: &[u8]) -> Result<()> {
    use crate::json_keys::Step;
    let header = bytes
        .get(..8)
        .and_then(|b| usize::try_from(u64::from_le_bytes(b.try_into().expect("8 bytes"))).ok())
        .and_then(|n| bytes.get(8..8usize.checked_add(n)?))
        .and_then(|h| std::str::from_utf8(h).ok());
    let Some(dup) = header.and_then(crate::json_keys::first_duplicate) else {
        return Ok(());
    };
    let what = match dup.path.as_slice() {
        [] if dup.key == "__metadata__" => "'__metadata__' is given twice".to_string(),
        [] => format!("tensor '{}' is named twice in the header", dup.key),
        [Step::Key(m), ..] if m == "__metadata__" => format!("metadata key '{}' is given twice", dup.key),
        [Step::Key(t)] => format!("tensor '{t}': field '{}' is given twice", dup.key),
        [Step::Key(t), ..] => format!("tensor '{t}': key '{}' is given twice", dup.key),
        [Step::Index(_), ..] => format!("key '{}' is given twice", dup.key),
    };
    Err(Error::format(path, format!("not a valid safetensors file: {what}")))
}

/// Maps an opened file read-only.
fn map(path: &Path, file: &File) -> Result<MappedFile> {
    // SAFETY: the map is read-only, and lockstep never writes a file in place (every
    // writer writes a temporary file and renames it over the destination, which leaves
    // an existing mapping on the old inode). What the mapping cannot guard against is
    // another program truncating the file while it is read: the read would fault.
    // That is the price of not reading multi-gigabyte files whole, as the issue asks.
    let map = unsafe { memmap2::Mmap::map(file) }.map_err(|e| Error::io(path, e))?;
    Ok(MappedFile { path: path.to_path_buf(), map })
}

/// One tensor to write: its name, dtype, shape and little-endian bytes.
pub struct TensorData<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// The bytes of a safetensors file holding `tensors` (in this order) and `metadata`, the
/// same bytes for the same inputs. The header is padded with spaces to a multiple of 8
/// bytes, as the `safetensors` crate pads it, so the data starts aligned.
pub fn serialize(tensors: &[TensorData<'_>], metadata: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let mut header = Map::new();
    if !metadata.is_empty() {
        let meta: Map<String, Value> = metadata.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
        header.insert("__metadata__".into(), Value::Object(meta));
    }
    let mut offset = 0usize;
    for t in tensors {
        let count = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let expected = count.and_then(|c| c.checked_mul(t.dtype.bitsize())).map(|bits| bits.div_ceil(8));
        if expected != Some(t.data.len()) || t.name == "__metadata__" {
            return Err(Error::config(
                "tensor",
                format!("{}: {} bytes do not hold a {:?} tensor of shape {:?}", t.name, t.data.len(), t.dtype, t.shape),
            ));
        }
        let info = serde_json::json!({
            "dtype": t.dtype.to_string(),
            "shape": t.shape,
            "data_offsets": [offset, offset + t.data.len()],
        });
        if header.insert(t.name.to_string(), info).is_some() {
            return Err(Error::config("tensor", format!("{}: two tensors of this name", t.name)));
        }
        offset += t.data.len();
    }
    let mut text = serde_json::to_string(&Value::Object(header))
        .map_err(|e| Error::config("safetensors header", e.to_string()))?
        .into_bytes();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + text.len() + offset);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    for t in tensors {
        out.extend_from_slice(t.data);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_same_inputs_make_the_same_bytes_and_the_crate_reads_them_back() {
        let (a, b) = ([1u8, 2, 3, 4, 5, 6, 7, 8], [9u8; 3]);
        let tensors = [
            TensorData { name: "w", dtype: Dtype::F32, shape: &[2], data: &a },
            TensorData { name: "labels", dtype: Dtype::U8, shape: &[3], data: &b },
        ];
        // Many keys: a HashMap would order them differently from call to call.
        let m = meta(&[("z", "1"), ("a", "2"), ("m", "3"), ("b", "4"), ("y", "5"), ("c", "6")]);
        let first = serialize(&tensors, &m).unwrap();
        for _ in 0..8 {
            assert_eq!(serialize(&tensors, &m.clone().into_iter().rev().collect()).unwrap(), first);
        }
        let header_len = u64::from_le_bytes(first[..8].try_into().unwrap()) as usize;
        assert_eq!(header_len % 8, 0, "the data starts 8-aligned");
        let header = std::str::from_utf8(&first[8..8 + header_len]).unwrap();
        assert!(
            header.starts_with(r#"{"__metadata__":{"a":"2","b":"4","c":"6","m":"3","y":"5","z":"1"},"w":"#),
            "{header}"
        );
        let st = SafeTensors::deserialize(&first).unwrap();
        assert_eq!(st.tensor("w").unwrap().data(), &a);
        assert_eq!(st.tensor("labels").unwrap().data(), &b);
        let e = serialize(&[TensorData { name: "w", dtype: Dtype::F32, shape: &[3], data: &a }], &m).unwrap_err();
        assert_eq!(e.to_string(), "invalid tensor: w: 8 bytes do not hold a F32 tensor of shape [3]");
    }

    /// A safetensors file of `header` (padded to 8 bytes) and `data`.
    fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
        let mut header = header.to_string();
        while !header.len().is_multiple_of(8) {
            header.push(' ');
        }
        [&(header.len() as u64).to_le_bytes()[..], header.as_bytes(), data].concat()
    }

    #[test]
    fn a_tensor_named_twice_is_refused_naming_it() {
        // Issue 19. The safetensors crate reads the header into a map, so of two tensors
        // named 'x' the last wins: two views of the same 4 bytes (an F32, then an I32)
        // were accepted as one I32 tensor.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("twice.safetensors");
        let at = p.display().to_string();
        let err = |bytes: Vec<u8>| {
            std::fs::write(&p, bytes).unwrap();
            map_file(&p).and_then(|f| f.parse().map(|_| ())).expect_err("refused").to_string()
        };
        let same = r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}"#;
        assert_eq!(
            err(raw_file(same, &[0; 4])),
            format!("{at}: not a valid safetensors file: tensor 'x' is named twice in the header")
        );
        // Two regions under one name: the crate said "invalid offset" for the survivor.
        let two = r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        assert_eq!(
            err(raw_file(two, &[0; 8])),
            format!("{at}: not a valid safetensors file: tensor 'x' is named twice in the header")
        );
        let meta = r#"{"__metadata__":{"num_classes":"3","num_classes":"10"},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        assert_eq!(
            err(raw_file(meta, &[0; 4])),
            format!("{at}: not a valid safetensors file: metadata key 'num_classes' is given twice")
        );
        let field = r#"{"x":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]}}"#;
        assert_eq!(
            err(raw_file(field, &[0; 4])),
            format!("{at}: not a valid safetensors file: tensor 'x': field 'dtype' is given twice")
        );
        // The bytes of a parse in memory are checked alike.
        let e = crate::weights::parse(&p, &raw_file(same, &[0; 4])).expect_err("refused").to_string();
        assert_eq!(e, format!("{at}: not a valid safetensors file: tensor 'x' is named twice in the header"));
    }

    #[test]
    fn headers_are_checked_before_the_file_is_mapped() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.safetensors");
        let err = |bytes: &[u8]| {
            std::fs::write(&p, bytes).unwrap();
            map_file(&p).err().expect("refused").to_string()
        };
        let at = p.display().to_string();
        assert_eq!(err(b"abc"), format!("{at}: not a valid safetensors file: 3 bytes, too short for a header"));
        assert_eq!(
            err(&[0; 16]),
            format!("{at}: not a valid safetensors file: header length 0 is too small for any header")
        );
        let mut big = 200_000_000u64.to_le_bytes().to_vec();
        big.extend_from_slice(b"{}");
        assert_eq!(
            err(&big),
            format!(
                "{at}: not a valid safetensors file: header length 200000000 is above the format's limit of 100000000"
            )
        );
        let mut past = 64u64.to_le_bytes().to_vec();
        past.extend_from_slice(b"{}");
        assert_eq!(
            err(&past),
            format!("{at}: not a valid safetensors file: header length 64 is past the end of the 10-byte file")
        );
        let e = map_file(dir.path()).err().unwrap().to_string();
        assert_eq!(e, format!("{}: is a directory, not a safetensors file", dir.path().display()));
    }
}
