//! MNIST-format IDX files: `train-images-idx3-ubyte` and friends, plain or gzipped.
//!
//! Owns: the IDX container (a 4-byte magic `00 00 <dtype> <ndims>`, `ndims` big-endian
//! u32 dimensions, then the values), every check that a file is usable — each problem an
//! error naming the file — the MNIST directory layout, and the writers the tests use.
//! Turning the bytes into a [`Dataset`] is [`Dataset::new`]'s job; scaling pixels to
//! 0..1 is the model's (a Rescaling layer), as in Keras.
//!
//! Untrusted input: the header is parsed before any body byte is read, its dimension
//! product is computed with checked arithmetic, and checked against the file's size (a
//! plain file) and the memory available (`memory::check_bytes`, which also stops a gzip
//! bomb) before the body is read through a `take` limited to that product plus one
//! byte. A header that claims 4 billion images allocates nothing: a short plain file is
//! a "truncated data" error before its body is read. Gzip is
//! recognised by its magic bytes `1f 8b` (whatever the file is called); a corrupt or
//! truncated gzip stream is an error, never a panic. A gzip file of several members
//! (`pigz`, concatenated downloads) is read member after member, as `gunzip` does, under
//! the same `take`: a trailing member past the header's values is refused after one value
//! too many, never inflated whole; bytes after the last member that are not a member are
//! an error, as trailing bytes of a plain file are.
//!
//! Only unsigned-byte data (dtype code 0x08) is accepted: MNIST, Fashion-MNIST and
//! KMNIST all use it.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, Write};
use std::path::{Path, PathBuf};

use flate2::bufread::GzDecoder;
use flate2::write::GzEncoder;

use super::{Dataset, Features, Splits};
use crate::error::{Error, Result};

/// Magic of an images file: u8 values, 3 dimensions (N, H, W).
pub const IDX3_U8_MAGIC: u32 = 0x0000_0803;
/// Magic of a labels file: u8 values, 1 dimension (N,).
pub const IDX1_U8_MAGIC: u32 = 0x0000_0801;
/// The IDX dtype code of unsigned bytes.
const DTYPE_U8: u8 = 0x08;
/// The two bytes every gzip stream starts with.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// The classes of an MNIST-format directory: MNIST, Fashion-MNIST and KMNIST all have
/// 10. A label outside them is an error naming the file, the sample and the value (a
/// corrupt label must not widen the model); a dataset with more classes states its count
/// ([`load_mnist_dir_with_classes`], `--classes`).
pub const MNIST_CLASSES: usize = 10;

/// The four files of an MNIST directory, each found as is or with a `.gz` suffix.
pub const MNIST_FILES: [&str; 4] =
    ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"];

/// Loads an images file: u8 pixels, row-major, image after image, and (N, H, W).
/// N, H and W are all at least 1.
pub fn load_idx_images(path: &Path) -> Result<(Vec<u8>, [usize; 3])> {
    let (data, dims) = load(path, IDX3_U8_MAGIC, "images (N, H, W)")?;
    let dims = [dims[0], dims[1], dims[2]];
    if dims.contains(&0) {
        return Err(Error::format(path, format!("empty: dimensions {}×{}×{} (N×H×W)", dims[0], dims[1], dims[2])));
    }
    Ok((data, dims))
}

/// Loads a labels file: one u8 class id per sample (at least one sample).
pub fn load_idx_labels(path: &Path) -> Result<Vec<u8>> {
    let (data, _) = load(path, IDX1_U8_MAGIC, "labels (N,)")?;
    if data.is_empty() {
        return Err(Error::format(path, "empty: 0 labels"));
    }
    Ok(data)
}

/// Loads an MNIST directory: `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
/// `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`, each plain or with `.gz` (the
/// plain file wins when both are there). Samples are (1, H, W) u8, in
/// [`MNIST_CLASSES`] classes.
pub fn load_mnist_dir(dir: &Path) -> Result<Splits> {
    load_mnist_dir_with_classes(dir, MNIST_CLASSES)
}

/// [`load_mnist_dir`] for a dataset of `classes` classes (EMNIST's 47, say): every label
/// must lie in `0..classes`.
pub fn load_mnist_dir_with_classes(dir: &Path, classes: usize) -> Result<Splits> {
    if classes < 2 {
        return Err(Error::config("classes", format!("{classes} (a classifier needs at least 2)")));
    }
    if !dir.is_dir() {
        return Err(Error::format(dir, "not a directory (expected the four MNIST IDX files in it)"));
    }
    let [train_x, train_y, test_x, test_y] = MNIST_FILES.map(|name| find(dir, name));
    let (train_x, train_y, test_x, test_y) = (train_x?, train_y?, test_x?, test_y?);
    let (train_px, train_dims) = load_idx_images(&train_x)?;
    let train_labels = load_idx_labels(&train_y)?;
    let (test_px, test_dims) = load_idx_images(&test_x)?;
    let test_labels = load_idx_labels(&test_y)?;
    check_counts(&train_x, train_dims[0], &train_y, train_labels.len())?;
    check_counts(&test_x, test_dims[0], &test_y, test_labels.len())?;
    if train_dims[1..] != test_dims[1..] {
        return Err(Error::format(
            &test_x,
            format!(
                "images are {}×{} but the training images ({}) are {}×{}",
                test_dims[1],
                test_dims[2],
                train_x.display(),
                train_dims[1],
                train_dims[2]
            ),
        ));
    }
    for (path, labels) in [(&train_y, &train_labels), (&test_y, &test_labels)] {
        if let Some((i, &l)) = labels.iter().enumerate().find(|(_, &l)| usize::from(l) >= classes) {
            let whose = if classes == MNIST_CLASSES { "MNIST format's " } else { "" };
            return Err(Error::format(path, super::label_outside(l.into(), i, classes, whose)));
        }
    }
    let make = |path: &Path, px: Vec<u8>, dims: [usize; 3], labels: Vec<u8>| {
        let labels = labels.into_iter().map(u32::from).collect();
        Dataset::new(path.display().to_string(), [1, dims[1], dims[2]], Features::U8(px), labels, classes)
    };
    Ok(Splits {
        train: make(&train_x, train_px, train_dims, train_labels)?,
        test: Some(make(&test_x, test_px, test_dims, test_labels)?),
    })
}

/// The test images file of an MNIST directory (`t10k-images-idx3-ubyte`, plain or
/// `.gz`): what `predict` reads of `mnist:DIR`, no labels nor training images needed.
pub fn mnist_test_images(dir: &Path) -> Result<PathBuf> {
    if !dir.is_dir() {
        return Err(Error::format(dir, "not a directory (expected the MNIST IDX files in it)"));
    }
    find(dir, MNIST_FILES[2])
}

/// Writes an images file (N, H, W) of u8 pixels; gzipped when `path` ends in `.gz`.
/// Atomic: `path` never holds half a file.
pub fn save_idx_images(path: &Path, pixels: &[u8], dims: [usize; 3]) -> Result<()> {
    let n = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    if n != Some(pixels.len()) {
        return Err(Error::format(path, format!("{} pixels do not make {dims:?} images", pixels.len())));
    }
    save(path, IDX3_U8_MAGIC, &dims, pixels)
}

/// Writes a labels file (N,); gzipped when `path` ends in `.gz`. Atomic.
pub fn save_idx_labels(path: &Path, labels: &[u8]) -> Result<()> {
    save(path, IDX1_U8_MAGIC, &[labels.len()], labels)
}

fn save(path: &Path, magic: u32, dims: &[usize], data: &[u8]) -> Result<()> {
    let mut bytes = Vec::with_capacity(4 + 4 * dims.len() + data.len());
    bytes.extend_from_slice(&magic.to_be_bytes());
    for &d in dims {
        let d = u32::try_from(d).map_err(|_| Error::format(path, format!("dimension {d} does not fit in 32 bits")))?;
        bytes.extend_from_slice(&d.to_be_bytes());
    }
    bytes.extend_from_slice(data);
    if path.extension().is_some_and(|e| e == "gz") {
        let mut gz = GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&bytes).and_then(|()| gz.finish()).map(|b| bytes = b).map_err(|e| Error::io(path, e))?;
    }
    crate::fsutil::write_atomic(path, &bytes)
}

/// `dir/name`, else `dir/name.gz`, else an error naming both.
fn find(dir: &Path, name: &str) -> Result<PathBuf> {
    let plain = dir.join(name);
    if plain.is_file() {
        return Ok(plain);
    }
    let gz = dir.join(format!("{name}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    Err(Error::format(plain, format!("no such file (nor {name}.gz) in the MNIST directory")))
}

fn check_counts(images: &Path, n_images: usize, labels: &Path, n_labels: usize) -> Result<()> {
    if n_images != n_labels {
        return Err(Error::format(
            labels,
            format!("{n_labels} labels for the {n_images} images of {}", images.display()),
        ));
    }
    Ok(())
}

/// Human description of an IDX dtype code, for messages.
fn dtype_name(code: u8) -> &'static str {
    match code {
        0x08 => "unsigned byte",
        0x09 => "signed byte",
        0x0B => "short",
        0x0C => "int",
        0x0D => "float",
        0x0E => "double",
        _ => "not an IDX dtype",
    }
}

/// Reads exactly `buf.len()` bytes of the header, or says which part was cut short.
fn read_header(r: &mut impl Read, buf: &mut [u8], path: &Path, what: &str) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(Error::format(
                    path,
                    format!("truncated header: the file ends after {got} of the {} bytes of the {what}", buf.len()),
                ))
            }
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(stream_error(path, e)),
        }
    }
    Ok(())
}

/// The inflated bytes of a gzip file of one or more members, read one member after the
/// other. flate2's `MultiGzDecoder` does the same but reads whatever follows a member as a
/// gzip header, so trailing bytes would be a "corrupt gzip stream"; here they are
/// [`TrailingBytes`], which names where they start.
struct GzMembers {
    /// The member being inflated; `None` once the file has ended (or failed).
    member: Option<GzDecoder<BufReader<File>>>,
}

/// Bytes after the last gzip member that do not start another: `len` of them from byte
/// `at` of the file.
#[derive(Debug)]
struct TrailingBytes {
    at: u64,
    len: u64,
}

impl std::fmt::Display for TrailingBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "unexpected bytes after the last gzip member: the {} bytes from byte {} are not a gzip member",
            self.len, self.at
        )
    }
}

impl std::error::Error for TrailingBytes {}

impl Read for GzMembers {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while let Some(member) = self.member.as_mut() {
            let n = member.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            // This member has ended (its checksum and length checked): another follows,
            // or the file ends, or what follows is not ours.
            let mut rest = self.member.take().expect("a member is being read").into_inner();
            let next = rest.fill_buf()?;
            if next.is_empty() {
                return Ok(0);
            }
            if !next.starts_with(&GZIP_MAGIC[..next.len().min(2)]) {
                let at = rest.stream_position()?;
                let len = rest.get_ref().metadata()?.len().saturating_sub(at);
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, TrailingBytes { at, len }));
            }
            self.member = Some(GzDecoder::new(rest));
        }
        Ok(0)
    }
}

/// A read failure: a decoding error of a gzip stream is a format problem, anything else
/// an I/O one.
fn stream_error(path: &Path, e: std::io::Error) -> Error {
    if let Some(trailing) = e.get_ref().and_then(|inner| inner.downcast_ref::<TrailingBytes>()) {
        return Error::format(path, trailing.to_string());
    }
    match e.kind() {
        std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof => {
            Error::format(path, format!("corrupt gzip stream: {e}"))
        }
        _ => Error::io(path, e),
    }
}

/// Reads an IDX file whose magic must be `magic`: its values and dimensions.
fn load(path: &Path, magic: u32, what: &str) -> Result<(Vec<u8>, Vec<usize>)> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut buffered = BufReader::new(file);
    let head = buffered.fill_buf().map_err(|e| Error::io(path, e))?;
    let gzipped = head.starts_with(&GZIP_MAGIC);
    let mut reader: Box<dyn Read> =
        if gzipped { Box::new(GzMembers { member: Some(GzDecoder::new(buffered)) }) } else { Box::new(buffered) };

    let mut found = [0u8; 4];
    read_header(&mut reader, &mut found, path, "magic number")?;
    let found_magic = u32::from_be_bytes(found);
    let expected = magic.to_be_bytes();
    if found[..2] != [0, 0] || found[3] != expected[3] {
        let hint = match found_magic {
            IDX1_U8_MAGIC => " (this is a labels file)",
            IDX3_U8_MAGIC => " (this is an images file)",
            _ if path.extension().is_some_and(|e| e == "gz") && !gzipped => " (named .gz but not gzipped)",
            _ => "",
        };
        return Err(Error::format(
            path,
            format!("wrong magic number 0x{found_magic:08X}, expected 0x{magic:08X} (IDX u8 {what}){hint}"),
        ));
    }
    if found[2] != DTYPE_U8 {
        return Err(Error::format(
            path,
            format!(
                "wrong dtype code 0x{:02X} ({}), expected 0x{DTYPE_U8:02X} (unsigned byte)",
                found[2],
                dtype_name(found[2])
            ),
        ));
    }
    let ndims = usize::from(found[3]);
    let mut raw = vec![0u8; 4 * ndims];
    read_header(&mut reader, &mut raw, path, &format!("{ndims} dimensions"))?;
    let dims: Vec<usize> = raw.chunks_exact(4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize).collect();
    let text = || dims.iter().map(usize::to_string).collect::<Vec<_>>().join("×");
    let count = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::format(path, format!("dimensions {} overflow: too many values to address", text())))?;

    // A plain file's size says at once whether the body is all there.
    if !gzipped {
        let header = 4 + 4 * ndims as u64;
        let body = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len().saturating_sub(header);
        if body < count as u64 {
            return Err(Error::format(
                path,
                format!("truncated data: {body} values for dimensions {} ({count} expected)", text()),
            ));
        }
        if body > count as u64 {
            return Err(Error::format(
                path,
                format!("unexpected bytes after the {count} values of dimensions {}", text()),
            ));
        }
    }
    // A gzip stream's size is known only once inflated: a header may claim what no
    // machine holds (a small bomb of zeros); refuse that before reading.
    crate::memory::check_bytes(&format!("loading {}", path.display()), count as u64, format!("{} values", text()))?;
    // The body: at most `count + 1` bytes, so that trailing data is seen without reading
    // an arbitrarily long stream; the vector grows with what actually arrives.
    let mut data = if gzipped { Vec::new() } else { Vec::with_capacity(count) };
    let limit = u64::try_from(count).map_or(u64::MAX, |c| c.saturating_add(1));
    reader.by_ref().take(limit).read_to_end(&mut data).map_err(|e| stream_error(path, e))?;
    if data.len() < count {
        return Err(Error::format(
            path,
            format!("truncated data: {} values for dimensions {} ({count} expected)", data.len(), text()),
        ));
    }
    if data.len() > count {
        return Err(Error::format(path, format!("unexpected bytes after the {count} values of dimensions {}", text())));
    }
    Ok((data, dims))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh temporary directory (removed with the guard) and its path.
    fn temp_dir() -> (tempfile::TempDir, PathBuf) {
        let guard = tempfile::tempdir().unwrap();
        let dir = guard.path().to_path_buf();
        (guard, dir)
    }

    /// The error text of loading `path` as images, which must fail; checks it names the path.
    fn images_err(path: &Path) -> String {
        let e = load_idx_images(path).expect_err("expected an error").to_string();
        assert!(e.contains(&path.display().to_string()), "error does not name the path: {e}");
        e
    }

    /// Header bytes: magic, then big-endian dimensions.
    fn header(magic: u32, dims: &[u32]) -> Vec<u8> {
        let mut b = magic.to_be_bytes().to_vec();
        for d in dims {
            b.extend_from_slice(&d.to_be_bytes());
        }
        b
    }

    /// 3 images of 2×2: pixel values 0..12, labels 0, 1, 2.
    fn write_small_mnist(dir: &Path, gz: bool) {
        let sfx = if gz { ".gz" } else { "" };
        let px: Vec<u8> = (0..12).collect();
        save_idx_images(&dir.join(format!("train-images-idx3-ubyte{sfx}")), &px, [3, 2, 2]).unwrap();
        save_idx_labels(&dir.join(format!("train-labels-idx1-ubyte{sfx}")), &[0, 1, 2]).unwrap();
        save_idx_images(&dir.join(format!("t10k-images-idx3-ubyte{sfx}")), &px[..4], [1, 2, 2]).unwrap();
        save_idx_labels(&dir.join(format!("t10k-labels-idx1-ubyte{sfx}")), &[9]).unwrap();
    }

    #[test]
    fn round_trips_plain_and_gzip() {
        let (_guard, dir) = temp_dir();
        let px: Vec<u8> = (0..24).map(|i| i * 10).collect();
        for name in ["x-idx3-ubyte", "x-idx3-ubyte.gz"] {
            let p = dir.join(name);
            save_idx_images(&p, &px, [2, 3, 4]).unwrap();
            assert_eq!(load_idx_images(&p).unwrap(), (px.clone(), [2, 3, 4]));
        }
        // The gzip magic decides, not the name: a gzipped file without .gz loads too.
        std::fs::copy(dir.join("x-idx3-ubyte.gz"), dir.join("renamed")).unwrap();
        assert_eq!(load_idx_images(&dir.join("renamed")).unwrap().1, [2, 3, 4]);
        let p = dir.join("y-idx1-ubyte.gz");
        save_idx_labels(&p, &[3, 1, 4, 1, 5]).unwrap();
        assert_eq!(load_idx_labels(&p).unwrap(), vec![3, 1, 4, 1, 5]);
        // The plain file is exactly 16 header bytes + 24 pixels (the IDX layout).
        assert_eq!(std::fs::metadata(dir.join("x-idx3-ubyte")).unwrap().len(), 16 + 24);
    }

    #[test]
    fn loads_an_mnist_directory_plain_or_gzipped() {
        for gz in [false, true] {
            let (_guard, dir) = temp_dir();
            write_small_mnist(&dir, gz);
            let s = load_mnist_dir(&dir).unwrap();
            assert_eq!(s.train.len(), 3);
            assert_eq!(s.train.sample_shape().dims(), &[1, 2, 2]);
            assert_eq!(s.train.features(), &Features::U8((0..12).collect()));
            assert_eq!(s.train.labels(), &[0, 1, 2]);
            let test = s.test.unwrap();
            assert_eq!(test.labels(), &[9]);
            // Labels up to 9: MNIST's 10 classes, in both splits.
            assert_eq!((s.train.num_classes(), test.num_classes()), (10, 10));
        }
    }

    #[test]
    fn a_label_outside_the_ten_classes_is_refused_naming_file_sample_and_value() {
        // The case: one label 200 in Fashion-MNIST's labels must not make a
        // 201-class model.
        let (_guard, dir) = temp_dir();
        write_small_mnist(&dir, false);
        let labels = dir.join("train-labels-idx1-ubyte");
        save_idx_labels(&labels, &[0, 200, 2]).unwrap();
        let e = load_mnist_dir(&dir).unwrap_err().to_string();
        assert_eq!(
            e,
            format!("{}: label 200 of sample 1 is outside the MNIST format's 10 classes (0 to 9)", labels.display())
        );
        // Stated, a wider class count takes it: 201 classes, both splits.
        let s = load_mnist_dir_with_classes(&dir, 201).unwrap();
        assert_eq!((s.train.num_classes(), s.test.unwrap().num_classes()), (201, 201));
        let e = load_mnist_dir_with_classes(&dir, 100).unwrap_err().to_string();
        assert!(e.ends_with("label 200 of sample 1 is outside the 100 classes (0 to 99)"), "{e}");
    }

    #[test]
    fn directory_problems_name_the_file() {
        let (_guard, dir) = temp_dir();
        let e = load_mnist_dir(&dir.join("nope")).unwrap_err().to_string();
        assert!(e.contains("nope: not a directory"), "{e}");
        write_small_mnist(&dir, false);
        std::fs::remove_file(dir.join("t10k-labels-idx1-ubyte")).unwrap();
        let e = load_mnist_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("t10k-labels-idx1-ubyte: no such file (nor t10k-labels-idx1-ubyte.gz)"), "{e}");
        save_idx_labels(&dir.join("t10k-labels-idx1-ubyte"), &[1, 2]).unwrap();
        let e = load_mnist_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("t10k-labels-idx1-ubyte: 2 labels for the 1 images of"), "{e}");
        save_idx_labels(&dir.join("t10k-labels-idx1-ubyte"), &[1]).unwrap();
        save_idx_images(&dir.join("t10k-images-idx3-ubyte"), &[0; 9], [1, 3, 3]).unwrap();
        let e = load_mnist_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("t10k-images-idx3-ubyte: images are 3×3 but the training images"), "{e}");
    }

    #[test]
    fn bad_headers_are_named() {
        let (_guard, dir) = temp_dir();
        let p = dir.join("f");
        std::fs::write(&p, [0, 0]).unwrap();
        assert!(images_err(&p).contains("truncated header: the file ends after 2 of the 4 bytes of the magic number"));
        std::fs::write(&p, header(IDX3_U8_MAGIC, &[2, 2])).unwrap();
        assert!(images_err(&p).contains("truncated header: the file ends after 8 of the 12 bytes of the 3 dimensions"));
        std::fs::write(&p, header(IDX1_U8_MAGIC, &[2])).unwrap();
        assert!(images_err(&p).contains(
            "wrong magic number 0x00000801, expected 0x00000803 (IDX u8 images (N, H, W)) (this is a labels file)"
        ));
        std::fs::write(&p, b"PK\x03\x04whatever").unwrap();
        assert!(images_err(&p).contains("wrong magic number 0x504B0304, expected 0x00000803"));
        std::fs::write(&p, header(0x0000_0D03, &[1, 1, 1])).unwrap();
        assert!(images_err(&p).contains("wrong dtype code 0x0D (float), expected 0x08 (unsigned byte)"));
        // 65536³ = 2^48 values fit a usize; 2^32·... more do not: 4294967295^3 > 2^64.
        std::fs::write(&p, header(IDX3_U8_MAGIC, &[u32::MAX, u32::MAX, u32::MAX])).unwrap();
        assert!(images_err(&p).contains("dimensions 4294967295×4294967295×4294967295 overflow"));
        // A header claiming 2^48 values on a 16-byte file: an error, no allocation.
        std::fs::write(&p, header(IDX3_U8_MAGIC, &[65536, 65536, 65536])).unwrap();
        assert!(images_err(&p).contains("truncated data: 0 values for dimensions 65536×65536×65536 (281474976710656"));
        let named_gz = dir.join("plain.gz");
        std::fs::write(&named_gz, [1, 2, 3, 4]).unwrap();
        assert!(images_err(&named_gz).contains("(named .gz but not gzipped)"));
    }

    #[test]
    fn bad_bodies_are_named() {
        let (_guard, dir) = temp_dir();
        let p = dir.join("f");
        let mut b = header(IDX3_U8_MAGIC, &[2, 2, 2]);
        b.extend_from_slice(&[7; 7]);
        std::fs::write(&p, &b).unwrap();
        assert!(images_err(&p).contains("truncated data: 7 values for dimensions 2×2×2 (8 expected)"));
        b.extend_from_slice(&[7; 2]);
        std::fs::write(&p, &b).unwrap();
        assert!(images_err(&p).contains("unexpected bytes after the 8 values of dimensions 2×2×2"));
        std::fs::write(&p, header(IDX3_U8_MAGIC, &[0, 28, 28])).unwrap();
        assert!(images_err(&p).contains("empty: dimensions 0×28×28"));
        std::fs::write(&p, header(IDX1_U8_MAGIC, &[0])).unwrap();
        let e = load_idx_labels(&p).unwrap_err().to_string();
        assert!(e.ends_with("f: empty: 0 labels"), "{e}");
        // A gzip stream cut in the middle.
        let gz = dir.join("g.gz");
        save_idx_images(&gz, &[5; 64], [4, 4, 4]).unwrap();
        let bytes = std::fs::read(&gz).unwrap();
        std::fs::write(&gz, &bytes[..bytes.len() - 10]).unwrap();
        let e = images_err(&gz);
        assert!(e.contains("corrupt gzip stream") || e.contains("truncated"), "{e}");
    }

    /// `bytes` as one gzip member.
    fn gzip_member(bytes: &[u8]) -> Vec<u8> {
        let mut gz = GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(bytes).unwrap();
        gz.finish().unwrap()
    }

    #[test]
    fn a_multi_member_gzip_file_is_read_whole_within_the_size_bound() {
        // Issue 19, defect 7: `gzip.compress(a) + gzip.compress(b)`, what pigz and
        // concatenated downloads make (gunzip reads it whole). Only the first member was
        // read: "truncated data: 5 values for dimensions 2×2×3 (12 expected)".
        let (_guard, dir) = temp_dir();
        let px: Vec<u8> = (0..12).collect();
        let mut file = header(IDX3_U8_MAGIC, &[2, 2, 3]);
        file.extend_from_slice(&px);
        let p = dir.join("multi.gz");
        // The header and 5 values, an empty member, then the other 7 values.
        let whole = [gzip_member(&file[..21]), gzip_member(&[]), gzip_member(&file[21..])].concat();
        std::fs::write(&p, &whole).unwrap();
        assert_eq!(load_idx_images(&p).unwrap(), (px.clone(), [2, 2, 3]));
        // A member split inside the header reads too.
        std::fs::write(&p, [gzip_member(&file[..6]), gzip_member(&file[6..])].concat()).unwrap();
        assert_eq!(load_idx_images(&p).unwrap(), (px.clone(), [2, 2, 3]));

        // Bytes after the last member that are not a gzip member: an error, as trailing
        // bytes of a plain file are (they used to be ignored).
        std::fs::write(&p, [&whole[..], b"junk"].concat()).unwrap();
        assert_eq!(
            images_err(&p),
            format!(
                "{}: unexpected bytes after the last gzip member: the 4 bytes from byte {} are not a gzip member",
                p.display(),
                whole.len()
            )
        );
        // A trailing member past the header's values: refused once one value too many has
        // been inflated (the body is read through a `take` of the values plus one), never
        // inflated whole: the 8 GiB of trailing members, here 64 MiB of zeros.
        let mut zeros = GzEncoder::new(Vec::new(), flate2::Compression::fast());
        for _ in 0..64 {
            zeros.write_all(&[0u8; 1 << 20]).unwrap();
        }
        std::fs::write(&p, [&whole[..], &zeros.finish().unwrap()[..]].concat()).unwrap();
        assert_eq!(
            images_err(&p),
            format!("{}: unexpected bytes after the 12 values of dimensions 2×2×3", p.display())
        );
    }

    #[test]
    fn missing_file_is_an_io_error_naming_it() {
        let e = load_idx_labels(Path::new("/nonexistent/labels-idx1-ubyte")).unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e:?}");
        assert!(e.to_string().starts_with("/nonexistent/labels-idx1-ubyte: "), "{e}");
    }

    #[test]
    fn no_byte_pattern_panics() {
        // Every single-byte corruption (three values per byte) and every prefix of a small
        // valid file, plain and gzipped: each loads or fails with an error.
        let (_guard, dir) = temp_dir();
        for name in ["base", "base.gz"] {
            let base = dir.join(name);
            save_idx_images(&base, &(0..18).collect::<Vec<u8>>(), [2, 3, 3]).unwrap();
            let bytes = std::fs::read(&base).unwrap();
            let p = dir.join("mutant");
            for i in 0..bytes.len() {
                for v in [0u8, 0xff, bytes[i] ^ 0x01] {
                    let mut b = bytes.clone();
                    b[i] = v;
                    std::fs::write(&p, &b).unwrap();
                    let _ = load_idx_images(&p);
                    let _ = load_idx_labels(&p);
                }
                std::fs::write(&p, &bytes[..i]).unwrap();
                assert!(load_idx_images(&p).is_err(), "{name}: a prefix of {i} bytes loaded");
            }
        }
    }
}
