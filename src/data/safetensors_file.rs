//! Datasets stored as safetensors files: how a user brings their own data.
//!
//! Owns: the file format of a dataset (two tensors, `x` and `y`), every check that a
//! file is usable — each problem an error naming the file and the problem — and the
//! atomic writer. The container is `safetensors_io`'s: the header length is checked
//! before anything is read, the file is mapped rather than read whole, and the
//! `safetensors` crate validates offsets against it, so the only indexing done here is
//! over data whose length the crate has checked. Features are copied out of the mapping
//! once, after the memory they need has been checked (`memory::check_bytes`), and F32
//! features must be finite: the first NaN or infinity is named by sample and value.
//!
//! Format:
//! - `x`: (N, C, H, W) or (N, F), dtype F32 or U8 (u8 stays u8 in memory: a quarter
//!   of the size; a Rescaling layer in the model scales it).
//! - `y`: (N,), dtype I64, I32 or U8: class ids `0..num_classes`.
//! - optional header metadata `num_classes` (written by [`save_safetensors_dataset`]),
//!   so that a round trip keeps classes no sample happens to use, and `class_names`, a
//!   JSON list of one name per class (what `predict` prints).
//!
//! Prediction reads `x` alone ([`load_safetensors_inputs`]): a file of inputs needs no
//! labels, and what labels it has are not checked.
//!
//! The PyTorch oracle cases in `shared/oracle/*/data.safetensors` have this layout.
//!
//! A token file is the other layout: one tensor `tokens` (N, T+1) of ids, dtype U8,
//! U16, I32 or I64, each row a sample of T ids whose labels are the same row one id on
//! (`Dataset::sequences`); the vocabulary is the header's `vocab_size` when stated, else
//! 256 for U8 ids, else the largest id + 1.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::Dtype;

use crate::safetensors_io::{self, TensorData};

use super::{Dataset, Features};
use crate::error::{Error, Result};

/// The metadata key holding the number of classes.
const NUM_CLASSES_KEY: &str = "num_classes";
/// The metadata key holding the class names, a JSON list of strings.
const CLASS_NAMES_KEY: &str = "class_names";

/// Loads a dataset; the number of classes is the header's `num_classes` entry when the
/// file has one, else the largest label + 1 (at least 2: a classifier of one class is
/// not one), at most [`super::MAX_INFERRED_CLASSES`]: a larger label is an error naming
/// the sample, since one bad label would otherwise size the model.
pub fn load_safetensors_dataset(path: &Path) -> Result<Dataset> {
    load(path, None)
}

/// Loads a dataset whose labels must lie in `0..num_classes` (`num_classes` ≥ 2); any
/// `num_classes` entry in the file's header is ignored.
pub fn load_safetensors_dataset_with_classes(path: &Path, num_classes: usize) -> Result<Dataset> {
    if num_classes < 2 {
        return Err(Error::config("num_classes", format!("{num_classes} (a classifier needs at least 2)")));
    }
    load(path, Some(num_classes))
}

/// The inputs of a dataset file, for prediction: `x` alone (`y` is not read, and need not
/// be there). The samples get label 0 of one class, or of as many as the header's
/// `class_names` names, which are kept (what `predict` prints); `num_classes` is not read.
pub fn load_safetensors_inputs(path: &Path) -> Result<Dataset> {
    let file = safetensors_io::map_file(path)?;
    let bad = |detail: String| Error::format(path, detail);
    let metadata = file.metadata()?;
    let st = file.parse()?;
    let x = st.tensor("x").map_err(|_| {
        let mut found: Vec<&str> = st.names();
        found.sort_unstable();
        bad(format!("no tensor 'x' (the file holds: [{}]); the inputs are a dataset's 'x'", found.join(", ")))
    })?;
    let names = metadata.get(CLASS_NAMES_KEY).map(|text| read_class_names(path, text)).transpose()?;
    inputs_from_tensor(path, &x, names)
}

/// The inputs of [`load_safetensors_inputs`] given as an array `x` in memory (a host's
/// `predict`), checked and read as a file's `x` is; errors name the array as `name`.
pub fn inputs_from_array(name: &str, x: &Array<'_>) -> Result<Dataset> {
    let origin = Path::new(name);
    inputs_from_tensor(origin, &array_view(origin, "x", x)?, None)
}

/// Inputs from tensor `x`, with label 0 of one class, or of as many as `names` names.
fn inputs_from_tensor(
    path: &Path,
    x: &safetensors::tensor::TensorView<'_>,
    names: Option<Vec<String>>,
) -> Result<Dataset> {
    let bad = |detail: String| Error::format(path, detail);
    let (sample_shape, features) = read_x(path, x)?;
    let n = x.shape()[0];
    if n == 0 {
        return Err(bad("tensor 'x' has 0 samples".into()));
    }
    if sample_shape.contains(&0) {
        return Err(bad(format!("tensor 'x' has shape {:?}: a sample has no elements", x.shape())));
    }
    let classes = names.as_ref().map_or(1, |n| n.len().max(1));
    let ds = Dataset::new(path.display().to_string(), sample_shape, features, vec![0; n], classes)?;
    match names {
        Some(names) if !names.is_empty() => ds.with_class_names(names),
        _ => Ok(ds),
    }
}

/// The header's `class_names`: a JSON list of strings.
fn read_class_names(path: &Path, text: &str) -> Result<Vec<String>> {
    serde_json::from_str(text).map_err(|_| {
        Error::format(
            path,
            format!(
                "metadata {CLASS_NAMES_KEY} is not a JSON list of strings: {}",
                text.chars().take(80).collect::<String>()
            ),
        )
    })
}

/// Writes `ds` as `x` (its stored dtype, shape (N, sample shape...)) and `y` (I64, (N,)),
/// with its number of classes in the header metadata. The file is written under a
/// temporary name in the same directory and renamed over `path`, so `path` never holds a
/// half-written file.
pub fn save_safetensors_dataset(ds: &Dataset, path: &Path) -> Result<()> {
    if ds.is_empty() {
        return Err(Error::Data { name: ds.name().into(), detail: "cannot save an empty dataset".into() });
    }
    let mut x_shape = vec![ds.len()];
    x_shape.extend_from_slice(ds.sample_shape().dims());
    let (x_dtype, x_bytes): (Dtype, Vec<u8>) = match ds.features() {
        Features::F32(v) => (Dtype::F32, v.iter().flat_map(|f| f.to_le_bytes()).collect()),
        Features::U8(v) => (Dtype::U8, v.clone()),
    };
    let y_bytes: Vec<u8> = ds.labels().iter().flat_map(|&l| i64::from(l).to_le_bytes()).collect();
    // x: (N, ...), y: (N,)
    let tensors = [
        TensorData { name: "x", dtype: x_dtype, shape: &x_shape, data: &x_bytes },
        TensorData { name: "y", dtype: Dtype::I64, shape: &[ds.len()], data: &y_bytes },
    ];
    let mut metadata = BTreeMap::from([(NUM_CLASSES_KEY.to_string(), ds.num_classes().to_string())]);
    if let Some(names) = ds.class_names() {
        metadata.insert(CLASS_NAMES_KEY.to_string(), serde_json::to_string(names).expect("strings serialise"));
    }
    let bytes = safetensors_io::serialize(&tensors, &metadata).map_err(|e| Error::format(path, e.to_string()))?;
    write_atomically(path, &bytes)
}

/// Writes `bytes` to `path` as every file lockstep writes (`fsutil`: atomically, never
/// over what is not a regular file but a FIFO or a device, written through).
/// The metadata key holding a token file's vocabulary size.
const VOCAB_KEY: &str = "vocab_size";

/// A token file's rows as sequences (the file's docs).
fn load_tokens(path: &Path, t: &safetensors::tensor::TensorView<'_>, vocab: Option<&str>) -> Result<Dataset> {
    let bad = |detail: String| Error::format(path, detail);
    let &[n, width] = t.shape() else {
        return Err(bad(format!(
            "tensor 'tokens' has shape {:?}; expected (N, T+1): rows of a context and its next token",
            t.shape()
        )));
    };
    if n == 0 || width < 2 {
        return Err(bad(format!("tensor 'tokens' has shape {:?}: no row of at least two ids", t.shape())));
    }
    crate::memory::check_bytes(
        &format!("loading {}", path.display()),
        (n * width * 4) as u64,
        format!("tensor 'tokens' ({n}, {width})"),
    )?;
    let d = t.data();
    let ids: Vec<i64> = match t.dtype() {
        Dtype::U8 => d.iter().map(|&b| i64::from(b)).collect(),
        Dtype::U16 => d.chunks_exact(2).map(|b| i64::from(u16::from_le_bytes([b[0], b[1]]))).collect(),
        Dtype::I32 => d.chunks_exact(4).map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect(),
        Dtype::I64 => d.chunks_exact(8).map(|b| i64::from_le_bytes(std::array::from_fn(|k| b[k]))).collect(),
        other => return Err(bad(format!("tensor 'tokens' has dtype {other}; expected U8, U16, I32 or I64"))),
    };
    if let Some(i) = ids.iter().position(|&v| v < 0) {
        return Err(bad(format!("token id {} at row {}, position {} is negative", ids[i], i / width, i % width)));
    }
    let max = ids.iter().copied().max().unwrap_or(0);
    let vocab = match vocab {
        Some(text) => text
            .parse::<usize>()
            .ok()
            .filter(|v| (1..=1 << 24).contains(v))
            .ok_or_else(|| bad(format!("metadata {VOCAB_KEY} = '{text}' is not an integer in 1..=2^24")))?,
        None if t.dtype() == Dtype::U8 => 256,
        None => usize::try_from(max).map_or(usize::MAX, |m| m + 1),
    };
    if let Some(i) = ids.iter().position(|&v| v as u64 >= vocab as u64) {
        return Err(bad(format!(
            "token id {} at row {}, position {} is at or above the vocabulary of {vocab}",
            ids[i],
            i / width,
            i % width
        )));
    }
    if vocab > 1 << 24 {
        return Err(bad(format!("a vocabulary of {vocab}: ids must be below 2^24 (exact as f32)")));
    }
    let ids: Vec<u32> = ids.into_iter().map(|v| v as u32).collect();
    Dataset::sequences(path.display().to_string(), &ids, width - 1, vocab)
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    crate::fsutil::write_atomic(path, bytes)
}

fn load(path: &Path, num_classes: Option<usize>) -> Result<Dataset> {
    let file = safetensors_io::map_file(path)?;
    let bad = |detail: String| Error::format(path, detail);
    let metadata = file.metadata()?;
    let st = file.parse()?;
    let tensor = |name: &str| {
        st.tensor(name).map_err(|_| {
            let mut found: Vec<&str> = st.names();
            found.sort_unstable();
            bad(format!("no tensor '{name}' (the file holds: [{}]); a dataset needs 'x' and 'y'", found.join(", ")))
        })
    };
    let names = st.names();
    if names.contains(&"tokens") {
        // Two layouts in one file: which one the user meant is not the reader's guess.
        if let Some(other) = ["x", "y"].into_iter().find(|n| names.contains(n)) {
            return Err(bad(format!(
                "holds both 'tokens' (a token file: rows of ids, each its next-token labels) and '{other}' (a dataset of samples 'x' and labels 'y'); keep the tensors of one layout"
            )));
        }
        let t = st.tensor("tokens").expect("listed");
        return load_tokens(path, &t, metadata.get(VOCAB_KEY).map(String::as_str));
    }
    let x = tensor("x")?;
    let y = tensor("y")?;
    from_tensors(path, &x, &y, num_classes, &metadata)
}

/// An array in memory, as a host program hands it over (`cli::hosted`): its numpy dtype's
/// name (`float32`, `uint8`, `int64`, `int32`), its shape and its values' bytes,
/// C-contiguous and little-endian.
pub struct Array<'a> {
    pub dtype: &'a str,
    pub shape: Vec<usize>,
    pub bytes: &'a [u8],
}

/// The dataset of samples `x` and labels `y` given as arrays, checked and read exactly as
/// a dataset file's tensors `x` and `y` are (the same dataset for the same values), its
/// classes `num_classes` or inferred from the labels; errors name the arrays as `name`.
pub fn dataset_from_arrays(name: &str, x: &Array<'_>, y: &Array<'_>, num_classes: Option<usize>) -> Result<Dataset> {
    let origin = Path::new(name);
    let (xv, yv) = (array_view(origin, "x", x)?, array_view(origin, "y", y)?);
    from_tensors(origin, &xv, &yv, num_classes, &BTreeMap::new())
}

/// Token ids given as a one-dimensional array of integers (int64, int32 or uint8), each
/// at least 0 and below 2^24 (exact in f32, as a token file's); errors name the array as
/// `name`.
pub fn tokens_from_array(name: &str, a: &Array<'_>) -> Result<Vec<u32>> {
    let origin = Path::new(name);
    let bad = |detail: String| Error::format(origin, detail);
    let view = array_view(origin, "tokens", a)?;
    if a.shape.len() != 1 {
        return Err(bad(format!("token ids of shape {:?}; expected one dimension, the text's ids in order", a.shape)));
    }
    let d = view.data();
    let ids: Vec<i64> = match view.dtype() {
        Dtype::I64 => d.chunks_exact(8).map(|b| i64::from_le_bytes(std::array::from_fn(|k| b[k]))).collect(),
        Dtype::I32 => d.chunks_exact(4).map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect(),
        Dtype::U8 => d.iter().map(|&b| i64::from(b)).collect(),
        other => return Err(bad(format!("token ids of dtype {other}; expected integers (int64, int32 or uint8)"))),
    };
    if let Some(i) = ids.iter().position(|&v| !(0..1 << 24).contains(&v)) {
        return Err(bad(format!("token id {} at position {i} is negative or not below 2^24", ids[i])));
    }
    Ok(ids.into_iter().map(|v| v as u32).collect())
}

/// Array `which` of [`dataset_from_arrays`] as a tensor view, its bytes checked against
/// its dtype and shape.
fn array_view<'b>(origin: &Path, which: &str, a: &Array<'b>) -> Result<safetensors::tensor::TensorView<'b>> {
    let dtype = match a.dtype {
        "float32" => Dtype::F32,
        "uint8" => Dtype::U8,
        "int64" => Dtype::I64,
        "int32" => Dtype::I32,
        other => {
            return Err(Error::format(
                origin,
                format!(
                "array '{which}' has dtype {other}; expected float32 or uint8 samples, int64, int32 or uint8 labels"
            ),
            ))
        }
    };
    safetensors::tensor::TensorView::new(dtype, a.shape.clone(), a.bytes).map_err(|e| {
        Error::format(
            origin,
            format!("array '{which}' of shape {:?}: its {} bytes do not match it ({e})", a.shape, a.bytes.len()),
        )
    })
}

/// A dataset from its tensors `x` and `y` and its header's `metadata`, every check of the
/// file format's; `path` names where they came from in errors and is the dataset's name.
fn from_tensors(
    path: &Path,
    x: &safetensors::tensor::TensorView<'_>,
    y: &safetensors::tensor::TensorView<'_>,
    num_classes: Option<usize>,
    metadata: &BTreeMap<String, String>,
) -> Result<Dataset> {
    let bad = |detail: String| Error::format(path, detail);
    let (sample_shape, features) = read_x(path, x)?;
    let n = x.shape()[0];

    // y: (N,)
    if y.shape().len() != 1 {
        return Err(bad(format!(
            "tensor 'y' is {}-dimensional (shape {:?}); expected (N,)",
            y.shape().len(),
            y.shape()
        )));
    }
    if y.shape()[0] != n {
        return Err(bad(format!("tensor 'x' has {n} samples but 'y' has {} labels", y.shape()[0])));
    }
    if n == 0 {
        return Err(bad("empty dataset: 'x' and 'y' have 0 samples".into()));
    }
    if sample_shape.contains(&0) {
        return Err(bad(format!("tensor 'x' has shape {:?}: a sample has no elements", x.shape())));
    }
    let labels: Vec<i64> = match y.dtype() {
        Dtype::I64 => y.data().chunks_exact(8).map(|b| i64::from_le_bytes(std::array::from_fn(|k| b[k]))).collect(),
        Dtype::I32 => {
            y.data().chunks_exact(4).map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect()
        }
        Dtype::U8 => y.data().iter().map(|&b| i64::from(b)).collect(),
        other => return Err(bad(format!("tensor 'y' has dtype {other}; expected I64, I32 or U8"))),
    };

    if let Some((i, l)) = labels.iter().enumerate().find(|(_, &l)| l < 0) {
        return Err(bad(format!("label {l} of sample {i} is negative")));
    }
    let max_label = labels.iter().copied().max().unwrap_or(0);
    let num_classes = match num_classes {
        Some(k) => k,
        None => match metadata.get(NUM_CLASSES_KEY) {
            Some(text) => match text.parse::<usize>() {
                Ok(k) if k >= 2 => k,
                _ => return Err(bad(format!("metadata {NUM_CLASSES_KEY} = '{text}' is not an integer ≥ 2"))),
            },
            None => {
                let inferred = usize::try_from(max_label).map_or(usize::MAX, |m| m.saturating_add(1)).max(2);
                if inferred > super::MAX_INFERRED_CLASSES {
                    let i = labels.iter().position(|&l| l == max_label).expect("the maximum is a label");
                    return Err(bad(format!(
                        "label {max_label} of sample {i} is above the {} classes lockstep infers from labels; a dataset with more states its class count (metadata '{NUM_CLASSES_KEY}', or --classes)",
                        super::MAX_INFERRED_CLASSES
                    )));
                }
                inferred
            }
        },
    };
    if let Some((i, l)) = labels.iter().enumerate().find(|(_, &l)| l as u64 >= num_classes as u64) {
        return Err(bad(super::label_outside(*l, i, num_classes, "")));
    }
    if num_classes > u32::MAX as usize {
        return Err(bad(format!("{num_classes} classes: labels must fit in 32 bits")));
    }
    let labels: Vec<u32> = labels.into_iter().map(|l| l as u32).collect();
    let ds = Dataset::new(path.display().to_string(), sample_shape, features, labels, num_classes)?;
    match metadata.get(CLASS_NAMES_KEY) {
        None => Ok(ds),
        Some(text) => {
            let names = read_class_names(path, text)?;
            if names.len() != num_classes {
                return Err(bad(format!(
                    "metadata {CLASS_NAMES_KEY} names {} classes, the data has {num_classes}",
                    names.len()
                )));
            }
            ds.with_class_names(names)
        }
    }
}

/// Tensor `x` of a dataset file: (N, C, H, W) or (N, F), F32 (finite) or U8, its sample
/// shape and its values (after the memory they need has been checked).
fn read_x(path: &Path, x: &safetensors::tensor::TensorView<'_>) -> Result<(Vec<usize>, Features)> {
    let bad = |detail: String| Error::format(path, detail);
    // x: (N, C, H, W) or (N, F)
    let x_shape = x.shape();
    if !matches!(x_shape.len(), 2 | 4) {
        return Err(bad(format!(
            "tensor 'x' is {}-dimensional (shape {x_shape:?}); expected (N, C, H, W) or (N, F)",
            x_shape.len()
        )));
    }
    let sample_shape = &x_shape[1..];
    let per_sample = sample_shape.iter().product::<usize>().max(1);
    if matches!(x.dtype(), Dtype::F32 | Dtype::U8) {
        crate::memory::check_bytes(
            &format!("loading {}", path.display()),
            x.data().len() as u64,
            format!("tensor 'x' {x_shape:?}"),
        )?;
    }
    let features = match x.dtype() {
        Dtype::F32 => {
            let values: Vec<f32> =
                x.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            if let Some((i, v)) = crate::weights::first_non_finite(&values) {
                return Err(bad(format!(
                    "tensor 'x' holds {v} at sample {}, value {} (flat index {i}): features must be finite",
                    i / per_sample,
                    i % per_sample
                )));
            }
            Features::F32(values)
        }
        Dtype::U8 => Features::U8(x.data().to_vec()),
        other => return Err(bad(format!("tensor 'x' has dtype {other}; expected F32 or U8"))),
    };
    Ok((sample_shape.to_vec(), features))
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;
    use safetensors::SafeTensors;
    use std::collections::HashMap;
    use std::fs;
    use std::path::PathBuf;

    thread_local! {
        /// Each test's scratch directory: libtest runs a test on its own thread, whose
        /// end drops (removes) it.
        static SCRATCH: tempfile::TempDir = tempfile::tempdir().unwrap();
    }

    /// A path in this test's scratch directory.
    fn temp_path(tag: &str) -> PathBuf {
        SCRATCH.with(|d| d.path().join(format!("{tag}.safetensors")))
    }

    /// Writes tensors given as (name, dtype, shape, little-endian bytes).
    fn write(tag: &str, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> PathBuf {
        let views: Vec<(&str, TensorView)> = tensors
            .iter()
            .map(|(name, dtype, shape, data)| (*name, TensorView::new(*dtype, shape.clone(), data).unwrap()))
            .collect();
        let path = temp_path(tag);
        fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
        path
    }

    fn i64s(v: &[i64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
    fn i32s(v: &[i32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// The error text of loading `path`, which must fail; checks it names the path.
    fn load_err(path: &Path) -> String {
        let e = load_safetensors_dataset(path).expect_err("expected an error").to_string();
        assert!(e.contains(&path.display().to_string()), "error does not name the path: {e}");
        e
    }

    fn good_x() -> (&'static str, Dtype, Vec<usize>, Vec<u8>) {
        ("x", Dtype::F32, vec![3, 2], f32s(&[0.5, -1.0, 2.0, 3.0, -4.5, 6.25]))
    }

    #[test]
    fn loads_u8_nchw_with_i64_labels() {
        // x: (2, 1, 2, 3) bytes 0..12; y: [1, 4] → 5 classes (max + 1).
        let path = write(
            "u8_nchw_i64",
            &[("x", Dtype::U8, vec![2, 1, 2, 3], (0..12).collect()), ("y", Dtype::I64, vec![2], i64s(&[1, 4]))],
        );
        let ds = load_safetensors_dataset(&path).unwrap();
        assert_eq!(ds.sample_shape().dims(), &[1, 2, 3]);
        assert_eq!(ds.features(), &Features::U8((0..12).collect()));
        assert_eq!(ds.labels(), &[1, 4]);
        assert_eq!(ds.num_classes(), 5);
        assert_eq!(load_safetensors_dataset_with_classes(&path, 10).unwrap().num_classes(), 10);
    }

    #[test]
    fn loads_f32_nf_with_i32_labels_and_at_least_two_classes() {
        // All labels 0: max + 1 = 1, raised to the minimum of 2.
        let path = write("f32_nf_i32", &[good_x(), ("y", Dtype::I32, vec![3], i32s(&[0, 0, 0]))]);
        let ds = load_safetensors_dataset(&path).unwrap();
        assert_eq!(ds.sample_shape().dims(), &[2]);
        assert_eq!(ds.features(), &Features::F32(vec![0.5, -1.0, 2.0, 3.0, -4.5, 6.25]));
        assert_eq!(ds.labels(), &[0, 0, 0]);
        assert_eq!(ds.num_classes(), 2);
    }

    #[test]
    fn loads_u8_labels() {
        let path = write("u8_labels", &[good_x(), ("y", Dtype::U8, vec![3], vec![2, 0, 255])]);
        let ds = load_safetensors_dataset(&path).unwrap();
        assert_eq!(ds.labels(), &[2, 0, 255]);
        assert_eq!(ds.num_classes(), 256);
    }

    /// Issue 41: `predict` complained about labels it does not need. Its inputs are `x`
    /// alone: no `y`, or a `y` of any labels, and the class names where the file has them.
    #[test]
    fn inputs_are_x_alone_with_the_class_names() {
        let path = write("x_only", &[good_x()]);
        assert!(load_err(&path).contains("no tensor 'y'"));
        let ds = load_safetensors_inputs(&path).unwrap();
        assert_eq!((ds.len(), ds.sample_shape().dims(), ds.num_classes()), (3, &[2usize][..], 1));
        assert_eq!(ds.features(), &Features::F32(vec![0.5, -1.0, 2.0, 3.0, -4.5, 6.25]));
        let bad_labels = write("bad_labels", &[good_x(), ("y", Dtype::I64, vec![3], i64s(&[-1, 0, 1]))]);
        assert!(load_err(&bad_labels).contains("label -1 of sample 0 is negative"));
        assert_eq!(load_safetensors_inputs(&bad_labels).unwrap().len(), 3);
        let ds = Dataset::new("n", [2], Features::F32(vec![1.0; 6]), vec![0, 1, 2], 3)
            .unwrap()
            .with_class_names(vec!["a".into(), "b".into(), "c".into()])
            .unwrap();
        let named = temp_path("named");
        save_safetensors_dataset(&ds, &named).unwrap();
        let ds = load_safetensors_inputs(&named).unwrap();
        assert_eq!(ds.class_names().unwrap(), &["a", "b", "c"]);
        let tokens = write("tokens_only", &[("tokens", Dtype::U8, vec![1, 3], vec![1, 2, 3])]);
        let e = load_safetensors_inputs(&tokens).unwrap_err().to_string();
        assert!(e.contains("no tensor 'x' (the file holds: [tokens]); the inputs are a dataset's 'x'"), "{e}");
    }

    #[test]
    fn missing_file_is_an_io_error() {
        let path = temp_path("does_not_exist");
        let e = load_safetensors_dataset(&path).unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e:?}");
        assert!(e.to_string().contains("does_not_exist.safetensors"), "{e}");
    }

    #[test]
    fn garbage_and_truncated_files_are_format_errors() {
        let path = temp_path("garbage");
        fs::write(&path, b"hello, this is not a safetensors file").unwrap();
        let e = load_err(&path);
        assert!(e.contains("not a valid safetensors file"), "{e}");
        fs::write(&path, b"abc").unwrap();
        assert!(load_err(&path).contains("3 bytes, too short for a header"));

        let good = write("to_truncate", &[good_x(), ("y", Dtype::I64, vec![3], i64s(&[0, 1, 0]))]);
        let bytes = fs::read(&good).unwrap();
        let cut = temp_path("truncated");
        fs::write(&cut, &bytes[..bytes.len() - 5]).unwrap();
        let e = load_err(&cut);
        assert!(e.contains("not a valid safetensors file: incomplete metadata"), "{e}");
        fs::write(&cut, &bytes[..20]).unwrap();
        assert!(load_err(&cut).contains("is past the end of the 20-byte file"));
    }

    #[test]
    fn missing_tensors_are_named() {
        let path = write("no_y", &[good_x(), ("labels", Dtype::I64, vec![3], i64s(&[0, 1, 0]))]);
        let e = load_err(&path);
        assert!(e.contains("no tensor 'y' (the file holds: [labels, x]); a dataset needs 'x' and 'y'"), "{e}");
        let path = write("no_x", &[("y", Dtype::I64, vec![3], i64s(&[0, 1, 0]))]);
        assert!(load_err(&path).contains("no tensor 'x' (the file holds: [y])"));
    }

    #[test]
    fn wrong_dtypes_are_named_with_the_accepted_ones() {
        let path = write("x_f64", &[("x", Dtype::F64, vec![1, 1], vec![0; 8]), ("y", Dtype::I64, vec![1], i64s(&[0]))]);
        assert!(load_err(&path).contains("tensor 'x' has dtype F64; expected F32 or U8"));
        let path = write("y_f32", &[good_x(), ("y", Dtype::F32, vec![3], f32s(&[0.0, 1.0, 0.0]))]);
        assert!(load_err(&path).contains("tensor 'y' has dtype F32; expected I64, I32 or U8"));
    }

    #[test]
    fn wrong_dimension_counts_are_errors() {
        let path =
            write("x_ndim3", &[("x", Dtype::U8, vec![2, 2, 2], vec![0; 8]), ("y", Dtype::U8, vec![2], vec![0, 1])]);
        assert!(
            load_err(&path).contains("tensor 'x' is 3-dimensional (shape [2, 2, 2]); expected (N, C, H, W) or (N, F)")
        );
        let path = write("x_ndim1", &[("x", Dtype::U8, vec![2], vec![0; 2]), ("y", Dtype::U8, vec![2], vec![0, 1])]);
        assert!(load_err(&path).contains("tensor 'x' is 1-dimensional"));
        let path = write("y_ndim2", &[good_x(), ("y", Dtype::I64, vec![3, 1], i64s(&[0, 1, 0]))]);
        assert!(load_err(&path).contains("tensor 'y' is 2-dimensional (shape [3, 1]); expected (N,)"));
    }

    #[test]
    fn sample_counts_must_agree_and_be_positive() {
        let path = write("n_mismatch", &[good_x(), ("y", Dtype::I64, vec![2], i64s(&[0, 1]))]);
        assert!(load_err(&path).contains("tensor 'x' has 3 samples but 'y' has 2 labels"));
        let path = write("empty", &[("x", Dtype::F32, vec![0, 2], vec![]), ("y", Dtype::I64, vec![0], vec![])]);
        assert!(load_err(&path).contains("empty dataset: 'x' and 'y' have 0 samples"));
        let path =
            write("zero_features", &[("x", Dtype::F32, vec![2, 0], vec![]), ("y", Dtype::U8, vec![2], vec![0, 1])]);
        assert!(load_err(&path).contains("tensor 'x' has shape [2, 0]: a sample has no elements"));
    }

    #[test]
    fn bad_labels_name_the_sample() {
        let path = write("negative", &[good_x(), ("y", Dtype::I64, vec![3], i64s(&[0, 1, -3]))]);
        assert!(load_err(&path).contains("label -3 of sample 2 is negative"));
        let path = write("negative_i32", &[good_x(), ("y", Dtype::I32, vec![3], i32s(&[-1, 1, 0]))]);
        assert!(load_err(&path).contains("label -1 of sample 0 is negative"));
        let path = write("too_big", &[good_x(), ("y", Dtype::I64, vec![3], i64s(&[0, 5, 1]))]);
        let e = load_safetensors_dataset_with_classes(&path, 3).unwrap_err().to_string();
        assert!(e.contains("label 5 of sample 1 is outside the 3 classes (0 to 2)"), "{e}");
        assert!(e.contains("too_big.safetensors"), "{e}");
        let e = load_safetensors_dataset_with_classes(&path, 1).unwrap_err().to_string();
        assert_eq!(e, "invalid num_classes: 1 (a classifier needs at least 2)");
        // The case: one label 2^31 − 1 made a toy model of 45 billion parameters.
        let path = write("huge", &[good_x(), ("y", Dtype::I64, vec![3], i64s(&[0, (1 << 31) - 1, 1]))]);
        assert!(load_err(&path).ends_with(
            "label 2147483647 of sample 1 is above the 65536 classes lockstep infers from labels; a dataset with more states its class count (metadata 'num_classes', or --classes)"
        ));
        // 65,536 classes (label 65,535) is the most inferred; stated, more are taken.
        let path = write("widest", &[good_x(), ("y", Dtype::I64, vec![3], i64s(&[0, 65_535, 1]))]);
        assert_eq!(load_safetensors_dataset(&path).unwrap().num_classes(), 65_536);
        let path = write("wider", &[good_x(), ("y", Dtype::I64, vec![3], i64s(&[0, 65_536, 1]))]);
        assert!(load_err(&path).contains("label 65536 of sample 1 is above the 65536 classes"));
        assert_eq!(load_safetensors_dataset_with_classes(&path, 70_000).unwrap().num_classes(), 70_000);
        let path = write("vast", &[good_x(), ("y", Dtype::I64, vec![3], i64s(&[0, 1 << 40, 1]))]);
        let e = load_safetensors_dataset_with_classes(&path, usize::MAX).unwrap_err().to_string();
        assert!(e.contains("labels must fit in 32 bits"), "{e}");
    }

    #[test]
    fn non_finite_features_are_named_by_sample_and_value() {
        let dir = tempfile::tempdir().unwrap();
        let y = ("y", Dtype::I64, vec![3], i64s(&[0, 1, 0]));
        for (value, shown) in [(f32::NAN, "NaN"), (f32::INFINITY, "inf"), (f32::NEG_INFINITY, "-inf")] {
            // x (3, 2): flat index 3 is sample 1, value 1.
            let x = ("x", Dtype::F32, vec![3, 2], f32s(&[0.5, -1.0, 2.0, value, -4.5, 6.25]));
            let both = [x, y.clone()];
            let views: Vec<(&str, TensorView)> = both
                .iter()
                .map(|(name, dtype, shape, data)| (*name, TensorView::new(*dtype, shape.clone(), data).unwrap()))
                .collect();
            let path = dir.path().join("nan.safetensors");
            fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
            let e = load_safetensors_dataset(&path).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "{}: tensor 'x' holds {shown} at sample 1, value 1 (flat index 3): features must be finite",
                    path.display()
                )
            );
        }
    }

    #[test]
    fn class_names_round_trip_and_saving_twice_gives_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let names = vec!["cat".to_string(), "dog \"the good\"".to_string(), "émeu".to_string()];
        let ds = Dataset::new("pets", [2], Features::F32(vec![0.0, 1.0, 2.0, 3.0]), vec![2, 0], 3)
            .unwrap()
            .with_class_names(names.clone())
            .unwrap();
        let (a, b) = (dir.path().join("a.safetensors"), dir.path().join("b.safetensors"));
        save_safetensors_dataset(&ds, &a).unwrap();
        save_safetensors_dataset(&ds, &b).unwrap();
        assert_eq!(fs::read(&a).unwrap(), fs::read(&b).unwrap());
        let back = load_safetensors_dataset(&a).unwrap();
        assert_eq!(back.class_names(), Some(names.as_slice()));
        assert_eq!(back.num_classes(), 3);
    }

    #[test]
    fn bad_num_classes_metadata_is_an_error() {
        let x = f32s(&[1.0, 2.0]);
        let y = i64s(&[0, 1]);
        let views = [
            ("x", TensorView::new(Dtype::F32, vec![2, 1], &x).unwrap()),
            ("y", TensorView::new(Dtype::I64, vec![2], &y).unwrap()),
        ];
        let meta = HashMap::from([(NUM_CLASSES_KEY.to_string(), "two".to_string())]);
        let path = temp_path("bad_meta");
        fs::write(&path, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
        assert!(load_err(&path).contains("metadata num_classes = 'two' is not an integer ≥ 2"));
    }

    #[test]
    fn no_byte_pattern_panics() {
        // Every single-byte corruption (three values per byte) of a small valid file, and
        // every prefix of it: each must load or fail with an error, never panic.
        let good = write("fuzz_base", &[good_x(), ("y", Dtype::I64, vec![3], i64s(&[0, 1, 0]))]);
        let bytes = fs::read(&good).unwrap();
        let path = temp_path("fuzz");
        let mut loaded = 0;
        for i in 0..bytes.len() {
            for v in [0u8, 0xff, bytes[i] ^ 0x01] {
                let mut b = bytes.clone();
                b[i] = v;
                fs::write(&path, &b).unwrap();
                loaded += usize::from(load_safetensors_dataset(&path).is_ok());
            }
            fs::write(&path, &bytes[..i]).unwrap();
            assert!(load_safetensors_dataset(&path).is_err(), "a prefix of {i} bytes loaded");
        }
        // Any bit pattern of the 24 bytes of x (3·2 f32) that stays finite is a valid
        // feature: of the 24 · 3 = 72 corruptions of x, 0xff over the top byte of -1.0
        // (0xBF80_0000), -4.5 (0xC090_0000) and 6.25 (0x40C8_0000) sets every exponent
        // bit (byte 2's top bit is 1), making -inf, NaN and NaN, which are refused: 69 load.
        assert!(loaded >= 69, "only {loaded} corrupted files loaded");
    }

    #[test]
    fn a_file_of_tokens_and_samples_is_refused_naming_both_layouts() {
        let tokens = ("tokens", Dtype::U8, vec![2, 3], (0..6).collect::<Vec<u8>>());
        let (x, y) = (good_x(), ("y", Dtype::I64, vec![3], i64s(&[0, 1, 0])));
        for (tag, tensors) in [
            ("tokens_x_y", vec![tokens.clone(), x.clone(), y.clone()]),
            ("tokens_x", vec![tokens.clone(), x]),
            ("tokens_y", vec![tokens.clone(), y]),
        ] {
            let e = load_err(&write(tag, &tensors));
            let other = if tag == "tokens_y" { "'y'" } else { "'x'" };
            assert!(
                e.ends_with(&format!(": holds both 'tokens' (a token file: rows of ids, each its next-token labels) and {other} (a dataset of samples 'x' and labels 'y'); keep the tensors of one layout")),
                "{e}"
            );
        }
        // Alone, each layout reads.
        assert_eq!(load_safetensors_dataset(&write("tokens_alone", &[tokens])).unwrap().len(), 2);
    }

    #[test]
    fn save_then_load_round_trips() {
        let u8_ds =
            Dataset::new("imgs", [1, 2, 2], Features::U8(vec![0, 9, 128, 255, 1, 2, 3, 4]), vec![3, 0], 7).unwrap();
        let path = temp_path("round_trip_u8");
        save_safetensors_dataset(&u8_ds, &path).unwrap();
        let back = load_safetensors_dataset(&path).unwrap();
        assert_eq!(back.features(), u8_ds.features());
        assert_eq!(back.labels(), u8_ds.labels());
        assert_eq!(back.sample_shape(), u8_ds.sample_shape());
        assert_eq!(back.num_classes(), 7, "num_classes survives through the metadata");

        let f32_ds =
            Dataset::new("pts", [2], Features::F32(vec![0.1, -2.5, f32::MIN_POSITIVE, 1e30]), vec![1, 1], 2).unwrap();
        let path = temp_path("round_trip_f32");
        save_safetensors_dataset(&f32_ds, &path).unwrap();
        save_safetensors_dataset(&f32_ds, &path).unwrap(); // overwriting is fine
        let back = load_safetensors_dataset(&path).unwrap();
        assert_eq!(back.features(), f32_ds.features(), "f32 bits are kept exactly");
        assert_eq!(back.labels(), &[1, 1]);
        // y is stored as I64, whatever the dtype it was loaded from.
        let bytes = fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("y").unwrap().dtype(), Dtype::I64);
        assert_eq!(st.tensor("x").unwrap().shape(), &[2, 2]);
        // No temporary file is left beside it.
        let dir = path.parent().unwrap();
        let leftovers: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn save_failures_are_errors_and_leave_nothing() {
        let ds = Dataset::new("pts", [1], Features::F32(vec![1.0]), vec![0], 2).unwrap();
        let path = temp_path("no_such_dir").with_file_name("no_such_dir/inner/ds.safetensors");
        let e = save_safetensors_dataset(&ds, &path).unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e:?}");
        let empty = ds.subset("none", &[]);
        let e = save_safetensors_dataset(&empty, &temp_path("empty_save")).unwrap_err().to_string();
        assert_eq!(e, "dataset none: cannot save an empty dataset");
    }

    #[test]
    fn loads_the_pytorch_oracle_data() {
        // Shapes and dtypes as documented in shared/oracle/README.md: toy f32 (N, 2),
        // convnet u8 (N, 1, 28, 28), y i64; N = K·B (toy 50·64, convnet 20·64).
        use crate::testing::oracle::oracle_case;
        let toy = load_safetensors_dataset(&oracle_case("toy_s0_k50_b64_w1").join("data.safetensors")).unwrap();
        assert_eq!(toy.len(), 3200);
        assert_eq!(toy.sample_shape().dims(), &[2]);
        assert!(matches!(toy.features(), Features::F32(_)));
        assert_eq!(toy.num_classes(), 2);

        let conv = load_safetensors_dataset(&oracle_case("convnet_s0_k20_b64_w1").join("data.safetensors")).unwrap();
        assert_eq!(conv.len(), 1280);
        assert_eq!(conv.sample_shape().dims(), &[1, 28, 28]);
        assert!(matches!(conv.features(), Features::U8(v) if v.len() == 1280 * 28 * 28));
        // The labels of this case span 0..9 (read from the file's header and data with
        // Python's struct module), so max + 1 = 10.
        assert_eq!(conv.num_classes(), 10);
    }
}
