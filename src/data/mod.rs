//! Datasets: where samples come from, and how a global batch is gathered.
//!
//! A [`Dataset`] holds every sample of one split in host memory, features stored in the
//! dtype they came in (u8 images stay u8: a quarter of the memory) and converted to f32
//! only when a batch is gathered. A sample of a model of several inputs is their parts'
//! values one after another ([`Dataset::from_inputs`]). Shuffling, sharding and device placement belong to the
//! trainer (`train::sampler`, `train::scatter`); this module only knows samples, and
//! what augmenting a training image makes of it (`augment`).

pub mod augment;
pub mod digits;
pub mod fashion_mnist;
pub mod idx;
pub mod safetensors_file;
pub mod text;
pub mod toy;

use crate::digest::Fnv1a;
use crate::error::{Error, Result};
use crate::rng::{derive_key, purpose, SplitMix64};
use crate::tensor::Shape;

/// The most classes lockstep infers from the largest label of a file that does not state
/// its class count: a label is data, and one corrupt or hostile label must not size a
/// model (label 2^31 − 1 would make a toy MLP of 45 billion parameters). Files with more
/// classes say so (a safetensors dataset's `num_classes` metadata, `--classes`).
pub const MAX_INFERRED_CLASSES: usize = 1 << 16;

/// "label 200 of sample 17 is outside the model's 10 classes (0 to 9)": the one wording
/// of a label that does not fit, `whose` being "" or e.g. "model's ".
pub fn label_outside(label: i64, sample: usize, classes: usize, whose: &str) -> String {
    format!(
        "label {label} of sample {sample} is outside the {whose}{classes} classes (0 to {})",
        classes.saturating_sub(1)
    )
}

/// Feature values of every sample, row-major, sample after sample.
#[derive(Clone, Debug, PartialEq)]
pub enum Features {
    /// f32 values, used as they are.
    F32(Vec<f32>),
    /// Raw bytes (e.g. 0..255 pixels), converted to f32 without scaling: a model that
    /// wants 0..1 starts with a Rescaling layer, as Keras models do.
    U8(Vec<u8>),
}

impl Features {
    fn len(&self) -> usize {
        match self {
            Features::F32(v) => v.len(),
            Features::U8(v) => v.len(),
        }
    }
}

/// Samples and labels of one split: stored samples, each with its label (a class) or
/// its labels (a sequence's next token at every position), or a token stream whose
/// samples are its windows ([`Dataset::windows`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    name: String,
    /// Shape of ONE sample, e.g. `(1, 28, 28)` for an image, `(2,)` for the toy points,
    /// `(T,)` for a sequence of T token ids. A sample of several model inputs is their
    /// values one after another, in the model's input order: `(Σ numel_k,)`.
    sample_shape: Shape,
    /// The shape of each model input's part of a sample, in the model's input order: one
    /// part (the sample shape) for a model of one input ([`Dataset::from_inputs`]).
    inputs: Vec<Shape>,
    features: Features,
    /// Class ids, `targets` per sample, each `< num_classes`. Empty for a token stream.
    labels: Vec<u32>,
    /// Labels per sample: 1 for a classifier's samples, T for a sequence's.
    targets: usize,
    /// A token stream whose samples are its windows of `sample_shape` tokens (labels:
    /// the same window one token on), instead of stored samples.
    stream: Option<Vec<u32>>,
    num_classes: usize,
    /// A name per class where the data has them (Fashion-MNIST's "Ankle boot", a
    /// safetensors file's `class_names` metadata), for `predict`'s output.
    class_names: Option<Vec<String>>,
}

impl Dataset {
    /// Builds a dataset, checking that sizes agree and every label is in range.
    pub fn new(
        name: impl Into<String>,
        sample_shape: impl Into<Shape>,
        features: Features,
        labels: Vec<u32>,
        num_classes: usize,
    ) -> Result<Dataset> {
        let name = name.into();
        let sample_shape = sample_shape.into();
        let per = sample_shape.numel();
        let err = |detail: String| Error::Data { name: name.clone(), detail };
        if per == 0 {
            return Err(err(format!("sample shape {sample_shape} has no elements")));
        }
        if features.len() != per * labels.len() {
            return Err(err(format!(
                "{} feature values for {} labels of shape {sample_shape} (expected {})",
                features.len(),
                labels.len(),
                per * labels.len()
            )));
        }
        if num_classes == 0 {
            return Err(err("zero classes".into()));
        }
        if let Some((i, &l)) = labels.iter().enumerate().find(|(_, &l)| l as usize >= num_classes) {
            return Err(err(label_outside(l.into(), i, num_classes, "")));
        }
        Ok(Dataset {
            name,
            inputs: vec![sample_shape.clone()],
            sample_shape,
            features,
            labels,
            targets: 1,
            stream: None,
            num_classes,
            class_names: None,
        })
    }

    /// Samples of a model of several inputs (Keras's `fit([x1, x2], y)`): one part per
    /// model input, in the model's input order, each its per-sample shape and the values
    /// of all N samples (N, *shape_k) row-major; and `labels`, `targets` per sample (1 for
    /// a classifier, T for a sequence's next token at every position), each below
    /// `num_classes`. Every part must hold the same N samples. A sample is stored as its
    /// parts' values one after another (the sample shape is `(Σ numel_k,)`), which the
    /// trainer cuts back into one tensor (N, *shape_k) per input (`Batch::input_rows`).
    /// The parts are stored as bytes when all of them are bytes, else as f32 (a byte
    /// converts exactly). One part is [`Dataset::new`]'s dataset (for `targets` 1).
    pub fn from_inputs(
        name: impl Into<String>,
        parts: Vec<(Shape, Features)>,
        labels: Vec<u32>,
        targets: usize,
        num_classes: usize,
    ) -> Result<Dataset> {
        let name = name.into();
        let err = |detail: String| Error::Data { name: name.clone(), detail };
        if parts.is_empty() {
            return Err(err("no input parts: give one (shape, features) part per model input".into()));
        }
        if targets == 0 {
            return Err(err("zero labels per sample".into()));
        }
        if num_classes == 0 {
            return Err(err("zero classes".into()));
        }
        // N from the labels; every part must hold N samples of its shape.
        if !labels.len().is_multiple_of(targets) {
            return Err(err(format!("{} labels are not samples of {targets} label(s) each", labels.len())));
        }
        let n = labels.len() / targets;
        for (k, (shape, features)) in parts.iter().enumerate() {
            let per = shape.numel();
            if per == 0 {
                return Err(err(format!("input part {k} has shape {shape}, which has no elements")));
            }
            if features.len() != per * n {
                let held = match features.len().is_multiple_of(per) {
                    true => format!("{} samples", features.len() / per),
                    false => "not a whole number of samples".into(),
                };
                return Err(err(format!(
                    "input part {k} of shape {shape} holds {} values ({held}), where the {} labels make {n} samples (expected {} values): every part holds the same samples",
                    features.len(),
                    labels.len(),
                    per * n
                )));
            }
        }
        if let Some((i, &l)) = labels.iter().enumerate().find(|(_, &l)| l as usize >= num_classes) {
            return Err(err(label_outside(l.into(), i / targets, num_classes, "")));
        }
        let inputs: Vec<Shape> = parts.iter().map(|(s, _)| s.clone()).collect();
        let (sample_shape, features) = match parts.len() {
            1 => parts.into_iter().next().expect("one part"),
            _ => {
                let total: usize = inputs.iter().map(Shape::numel).sum();
                (Shape::new([total]), interleave(&parts, n))
            }
        };
        Ok(Dataset {
            name,
            sample_shape,
            inputs,
            features,
            labels,
            targets,
            stream: None,
            num_classes,
            class_names: None,
        })
    }

    /// The shape of each model input's part of a sample, in the model's input order (one
    /// part, the sample shape, for data of one input).
    pub fn input_shapes(&self) -> &[Shape] {
        &self.inputs
    }

    /// Sequences of token ids as samples: `rows` holds N rows of T + 1 ids each (a token
    /// file's `tokens` (N, T+1)); sample n is row n's first T ids, its labels the last T
    /// (each position's next token). Every id must be below `vocab`.
    pub fn sequences(name: impl Into<String>, rows: &[u32], context: usize, vocab: usize) -> Result<Dataset> {
        let name = name.into();
        let err = |detail: String| Error::Data { name: name.clone(), detail };
        if context == 0 || !rows.len().is_multiple_of(context + 1) {
            return Err(err(format!(
                "{} token ids are not rows of {} (a context of {context} and its next token)",
                rows.len(),
                context + 1
            )));
        }
        check_tokens(&name, rows, vocab)?;
        let (mut x, mut labels) = (Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()));
        for row in rows.chunks_exact(context + 1) {
            x.extend_from_slice(&row[..context]);
            labels.extend_from_slice(&row[1..]);
        }
        let features = token_features(x, vocab);
        Ok(Dataset {
            name,
            sample_shape: Shape::new([context]),
            inputs: vec![Shape::new([context])],
            features,
            labels,
            targets: context,
            stream: None,
            num_classes: vocab,
            class_names: None,
        })
    }

    /// A token stream whose samples are its windows of `context` ids, one per starting
    /// position (`tokens.len() − context` of them): sample i is `tokens[i..i + context]`,
    /// its labels `tokens[i + 1..i + context + 1]`. Every id must be below `vocab`, and
    /// the stream must hold one window and its next token.
    pub fn windows(name: impl Into<String>, tokens: Vec<u32>, context: usize, vocab: usize) -> Result<Dataset> {
        let name = name.into();
        if context == 0 || tokens.len() <= context {
            // Said without `context + 1`, which a context of usize::MAX would wrap to 0.
            return Err(Error::Data {
                name,
                detail: format!(
                    "{} tokens are too few for a context of {context}: a window needs {context} tokens and the next one",
                    tokens.len()
                ),
            });
        }
        check_tokens(&name, &tokens, vocab)?;
        Ok(Dataset {
            name,
            sample_shape: Shape::new([context]),
            inputs: vec![Shape::new([context])],
            features: Features::U8(Vec::new()),
            labels: Vec::new(),
            targets: context,
            stream: Some(tokens),
            num_classes: vocab,
            class_names: None,
        })
    }

    /// Labels per sample: 1 for a classifier's samples, T for a sequence of T tokens.
    pub fn targets_per_sample(&self) -> usize {
        self.targets
    }

    /// The token stream, for a dataset of windows ([`Dataset::windows`]): its samples
    /// are drawn, not permuted (`train::scatter::window_draws`).
    pub fn stream(&self) -> Option<&[u32]> {
        self.stream.as_deref()
    }

    /// The same dataset with a name per class; there must be exactly `num_classes`.
    pub fn with_class_names(mut self, names: Vec<String>) -> Result<Dataset> {
        if names.len() != self.num_classes {
            return Err(Error::Data {
                name: self.name.clone(),
                detail: format!("{} class names for {} classes", names.len(), self.num_classes),
            });
        }
        self.class_names = Some(names);
        Ok(self)
    }

    /// The name of each class, where the data has them.
    pub fn class_names(&self) -> Option<&[String]> {
        self.class_names.as_deref()
    }

    /// The first sample whose label is `classes` or more, and that label: what a model
    /// of `classes` outputs cannot be trained or scored on.
    pub fn first_label_outside(&self, classes: usize) -> Option<(usize, u32)> {
        let (labels, per) = match &self.stream {
            Some(t) => (t.as_slice(), 1),
            None => (self.labels.as_slice(), self.targets),
        };
        labels.iter().position(|&l| l as usize >= classes).map(|i| (i / per, labels[i]))
    }

    /// For a sequence's data (a token stream or token rows): the first input id at or
    /// above `vocab`, as (sample, position, id); the labels are checked as labels.
    pub fn first_token_outside(&self, vocab: usize) -> Option<(usize, usize, u32)> {
        if let Some(t) = &self.stream {
            return t.iter().position(|&id| id as usize >= vocab).map(|i| (i, 0, t[i]));
        }
        // Several inputs' values (tokens beside positions, say) are not all token ids:
        // the embedding that reads the tokens checks them.
        if self.targets == 1 || self.inputs.len() > 1 {
            return None;
        }
        let per = self.sample_shape.numel();
        let at = |i: usize, id: u32| (i / per, i % per, id);
        match &self.features {
            Features::U8(v) => v.iter().position(|&id| id as usize >= vocab).map(|i| at(i, v[i].into())),
            Features::F32(v) => v.iter().position(|&id| id as usize >= vocab).map(|i| at(i, v[i] as u32)),
        }
    }

    /// The dataset's name, used in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of samples (of windows, for a token stream).
    pub fn len(&self) -> usize {
        match &self.stream {
            Some(t) => t.len() - self.sample_shape.numel(),
            None => self.labels.len() / self.targets,
        }
    }

    /// True when there is no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Shape of one sample.
    pub fn sample_shape(&self) -> &Shape {
        &self.sample_shape
    }

    /// Number of classes.
    pub fn num_classes(&self) -> usize {
        self.num_classes
    }

    /// All labels.
    pub fn labels(&self) -> &[u32] {
        &self.labels
    }

    /// The stored features.
    pub fn features(&self) -> &Features {
        &self.features
    }

    /// A 64-bit digest (FNV-1a) of the sample shape, every feature value and every label:
    /// two datasets with the same digest hold, for all practical purposes, the same
    /// samples in the same order. Checkpoints use it to refuse resuming on other data.
    pub fn digest(&self) -> u64 {
        let mut h = self.sample_shape.dims().iter().fold(Fnv1a::new(), |h, &d| h.u64_le(d as u64));
        // Data of several inputs says how its samples are cut (data of one input hashes as
        // it always has: its checkpoints' digests stay valid).
        if self.inputs.len() > 1 {
            h = h.bytes(b"inputs");
            for s in &self.inputs {
                h = s.dims().iter().fold(h.u64_le(s.ndim() as u64), |h, &d| h.u64_le(d as u64));
            }
        }
        if let Some(t) = &self.stream {
            return t.iter().fold(h.bytes(b"windows"), |h, id| h.bytes(&id.to_le_bytes())).finish();
        }
        let h = match &self.features {
            Features::F32(v) => v.iter().fold(h, |h, x| h.bytes(&x.to_le_bytes())),
            Features::U8(v) => h.bytes(v),
        };
        self.labels.iter().fold(h, |h, l| h.bytes(&l.to_le_bytes())).finish()
    }

    /// Copies the samples `indices` (in that order) into `x` as f32 and their labels into
    /// `y`. `x` must hold `indices.len()` samples, `y` their labels.
    pub fn gather_into(&self, indices: &[usize], x: &mut [f32], y: &mut [u32]) {
        let per = self.sample_shape.numel();
        debug_assert_eq!(x.len(), indices.len() * per);
        debug_assert_eq!(y.len(), indices.len() * self.targets);
        if let Some(t) = &self.stream {
            for ((&i, xr), yr) in indices.iter().zip(x.chunks_exact_mut(per)).zip(y.chunks_exact_mut(per)) {
                for (o, &id) in xr.iter_mut().zip(&t[i..i + per]) {
                    *o = id as f32;
                }
                yr.copy_from_slice(&t[i + 1..i + 1 + per]);
            }
            return;
        }
        let l = self.targets;
        for ((&i, xr), yr) in indices.iter().zip(x.chunks_exact_mut(per)).zip(y.chunks_exact_mut(l)) {
            match &self.features {
                Features::F32(v) => xr.copy_from_slice(&v[i * per..(i + 1) * per]),
                Features::U8(v) => {
                    for (o, &b) in xr.iter_mut().zip(&v[i * per..(i + 1) * per]) {
                        *o = f32::from(b);
                    }
                }
            }
            yr.copy_from_slice(&self.labels[i * l..(i + 1) * l]);
        }
    }

    /// A new dataset with the samples `indices`, in that order (stored samples, a token
    /// stream's windows too).
    pub fn subset(&self, name: impl Into<String>, indices: &[usize]) -> Dataset {
        let per = self.sample_shape.numel();
        if let Some(t) = &self.stream {
            // Each window and its labels (the window one token on) straight from the
            // stream: a held-out set of many windows is made with no f32 copy on the way.
            let n = indices.len() * per;
            let ids = indices.iter().flat_map(|&i| t[i..i + per].iter().copied());
            let features = token_features_of(n, ids, self.num_classes);
            let mut labels = Vec::with_capacity(n);
            for &i in indices {
                labels.extend_from_slice(&t[i + 1..i + 1 + per]);
            }
            return Dataset {
                name: name.into(),
                sample_shape: self.sample_shape.clone(),
                inputs: self.inputs.clone(),
                features,
                labels,
                targets: self.targets,
                stream: None,
                num_classes: self.num_classes,
                class_names: None,
            };
        }
        let l = self.targets;
        let features = match &self.features {
            Features::F32(v) => {
                Features::F32(indices.iter().flat_map(|&i| &v[i * per..(i + 1) * per]).copied().collect())
            }
            Features::U8(v) => {
                Features::U8(indices.iter().flat_map(|&i| &v[i * per..(i + 1) * per]).copied().collect())
            }
        };
        Dataset {
            name: name.into(),
            sample_shape: self.sample_shape.clone(),
            inputs: self.inputs.clone(),
            features,
            labels: indices.iter().flat_map(|&i| &self.labels[i * l..(i + 1) * l]).copied().collect(),
            targets: l,
            stream: None,
            num_classes: self.num_classes,
            class_names: self.class_names.clone(),
        }
    }
}

impl Dataset {
    /// Splits off a validation set: the samples are put in a fixed order drawn from
    /// `seed` (a Fisher–Yates shuffle keyed by (seed, `purpose::SPLIT`), independent of
    /// the epoch shuffles), and the LAST `round(fraction · N)` of that order become the
    /// validation set, the rest (in that shuffled order) the training set. `fraction` must
    /// lie strictly between 0 and 1 and leave at least one sample on each side.
    pub fn split_validation(&self, fraction: f64, seed: u64) -> Result<(Dataset, Dataset)> {
        if !(fraction > 0.0 && fraction < 1.0) {
            return Err(Error::config("validation split", format!("{fraction} is not strictly between 0 and 1")));
        }
        if self.stream.is_some() {
            return Err(Error::config(
                "validation split",
                format!("{} is a text, whose validation part is its last tenth by position", self.name),
            ));
        }
        let n = self.len();
        let n_val = (n as f64 * fraction).round() as usize;
        if n_val == 0 || n_val >= n {
            return Err(Error::Data {
                name: self.name.clone(),
                detail: format!(
                    "a validation split of {fraction} of {n} samples leaves {n_val} for validation and {} for training (each needs at least 1)",
                    n - n_val.min(n)
                ),
            });
        }
        let mut order: Vec<usize> = (0..n).collect();
        let mut g = SplitMix64::new(derive_key(seed, &[purpose::SPLIT]));
        g.shuffle(&mut order);
        let (train, val) = order.split_at(n - n_val);
        Ok((
            self.subset(format!("{} (training part)", self.name), train),
            self.subset(format!("{} (validation part)", self.name), val),
        ))
    }
}

/// Every id of `tokens` must be below `vocab`: the one check of token data, naming the
/// first id that is not.
fn check_tokens(name: &str, tokens: &[u32], vocab: usize) -> Result<()> {
    match tokens.iter().position(|&t| t as usize >= vocab) {
        Some(i) => Err(Error::Data {
            name: name.into(),
            detail: format!("token id {} at position {i} is at or above the vocabulary of {vocab}", tokens[i]),
        }),
        None => Ok(()),
    }
}

/// The parts of `n` samples as one sample after another, each sample its parts' values
/// one after another: bytes when every part is bytes, else f32.
fn interleave(parts: &[(Shape, Features)], n: usize) -> Features {
    let total: usize = parts.iter().map(|(s, _)| s.numel()).sum();
    if parts.iter().all(|(_, f)| matches!(f, Features::U8(_))) {
        let mut out = Vec::with_capacity(n * total);
        for i in 0..n {
            for (s, f) in parts {
                let Features::U8(v) = f else { unreachable!("every part is bytes") };
                out.extend_from_slice(&v[i * s.numel()..(i + 1) * s.numel()]);
            }
        }
        return Features::U8(out);
    }
    let mut out = Vec::with_capacity(n * total);
    for i in 0..n {
        for (s, f) in parts {
            let r = i * s.numel()..(i + 1) * s.numel();
            match f {
                Features::F32(v) => out.extend_from_slice(&v[r]),
                Features::U8(v) => out.extend(v[r].iter().map(|&b| f32::from(b))),
            }
        }
    }
    Features::F32(out)
}

/// Token ids as features: bytes for a vocabulary of at most 256, else f32 (exact for
/// every id below 2^24).
fn token_features(ids: Vec<u32>, vocab: usize) -> Features {
    token_features_of(ids.len(), ids.into_iter(), vocab)
}

/// [`token_features`] of `n` ids as they come, stored without an intermediate copy.
fn token_features_of(n: usize, ids: impl Iterator<Item = u32>, vocab: usize) -> Features {
    if vocab <= 256 {
        let mut v = Vec::with_capacity(n);
        v.extend(ids.map(|t| t as u8));
        Features::U8(v)
    } else {
        let mut v = Vec::with_capacity(n);
        v.extend(ids.map(|t| t as f32));
        Features::F32(v)
    }
}

/// A training split and an optional test (validation) split.
#[derive(Clone, Debug)]
pub struct Splits {
    pub train: Dataset,
    pub test: Option<Dataset>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_split_is_disjoint_complete_and_seeded() {
        let ds = Dataset::new("d", [1], Features::U8((0..10).collect()), (0..10).map(|i| i % 2).collect(), 2).unwrap();
        let (train, val) = ds.split_validation(0.2, 7).unwrap();
        // round(0.2 · 10) = 2 validation samples.
        assert_eq!((train.len(), val.len()), (8, 2));
        let (Features::U8(a), Features::U8(b)) = (train.features(), val.features()) else { panic!() };
        let mut all: Vec<u8> = a.iter().chain(b).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..10).collect::<Vec<u8>>(), "every sample exactly once");
        for (x, y) in a.iter().zip(train.labels()).chain(b.iter().zip(val.labels())) {
            assert_eq!(u32::from(*x) % 2, *y, "labels travel with their samples");
        }
        assert_eq!(ds.split_validation(0.2, 7).unwrap().1, val, "the same seed, the same split");
        assert!(ds.split_validation(0.0, 7).is_err());
        assert!(ds.split_validation(1.0, 7).is_err());
        assert!(ds.split_validation(f64::NAN, 7).is_err());
        let e = ds.split_validation(0.01, 7).unwrap_err().to_string();
        assert!(e.contains("leaves 0 for validation"), "{e}");
    }

    #[test]
    fn parts_of_several_inputs_are_stored_one_after_another_per_sample() {
        // Two samples: part 0 is (2,) bytes, part 1 is (1, 2) f32; labels 2 per sample.
        let parts = vec![
            (Shape::new([2]), Features::U8(vec![1, 2, 3, 4])),
            (Shape::new([1, 2]), Features::F32(vec![0.5, 0.25, -1.0, 8.0])),
        ];
        let ds = Dataset::from_inputs("d", parts, vec![0, 1, 1, 0], 2, 2).unwrap();
        assert_eq!((ds.len(), ds.targets_per_sample()), (2, 2));
        assert_eq!(ds.sample_shape(), &Shape::new([4]));
        assert_eq!(ds.input_shapes(), &[Shape::new([2]), Shape::new([1, 2])]);
        // A byte part beside an f32 part is stored as f32 (exactly).
        assert_eq!(ds.features(), &Features::F32(vec![1.0, 2.0, 0.5, 0.25, 3.0, 4.0, -1.0, 8.0]));
        let sub = ds.subset("s", &[1]);
        assert_eq!(
            (sub.input_shapes(), sub.features()),
            (ds.input_shapes(), &Features::F32(vec![3.0, 4.0, -1.0, 8.0]))
        );
        // All bytes stay bytes.
        let parts =
            vec![(Shape::new([1]), Features::U8(vec![1, 2])), (Shape::new([2]), Features::U8(vec![3, 4, 5, 6]))];
        let ds = Dataset::from_inputs("b", parts, vec![0, 1], 1, 2).unwrap();
        assert_eq!(ds.features(), &Features::U8(vec![1, 3, 4, 2, 5, 6]));
        // How a sample is cut is part of what the digest says.
        let parts =
            vec![(Shape::new([2]), Features::U8(vec![1, 3, 4, 2])), (Shape::new([1]), Features::U8(vec![5, 6]))];
        assert_ne!(ds.digest(), Dataset::from_inputs("c", parts, vec![0, 1], 1, 2).unwrap().digest());
    }

    #[test]
    fn one_part_is_the_dataset_of_one_input() {
        let one = Dataset::new("d", [2], Features::U8(vec![1, 2, 3, 4]), vec![0, 1], 2).unwrap();
        let part = vec![(Shape::new([2]), Features::U8(vec![1, 2, 3, 4]))];
        let from = Dataset::from_inputs("d", part, vec![0, 1], 1, 2).unwrap();
        assert_eq!(from, one);
        assert_eq!(from.digest(), one.digest(), "the digest of data of one input is unchanged");
        assert_eq!(one.input_shapes(), &[Shape::new([2])]);
    }

    #[test]
    fn parts_that_disagree_are_refused_naming_the_part() {
        let err = |parts: Vec<(Shape, Features)>, labels: Vec<u32>, targets| {
            Dataset::from_inputs("d", parts, labels, targets, 3).unwrap_err().to_string()
        };
        let e = err(
            vec![(Shape::new([2]), Features::U8(vec![0; 4])), (Shape::new([3]), Features::U8(vec![0; 5]))],
            vec![0, 1],
            1,
        );
        assert!(e.contains("input part 1 of shape (3) holds 5 values (not a whole number of samples)"), "{e}");
        assert!(e.contains("make 2 samples (expected 6 values)"), "{e}");
        let e = err(vec![(Shape::new([0]), Features::U8(vec![]))], vec![0], 1);
        assert!(e.contains("input part 0 has shape (0)"), "{e}");
        let e = err(vec![(Shape::new([1]), Features::U8(vec![0]))], vec![0, 1, 2], 2);
        assert!(e.contains("3 labels are not samples of 2 label(s) each"), "{e}");
        let e = err(vec![(Shape::new([1]), Features::U8(vec![0, 0]))], vec![0, 3, 1, 1], 2);
        assert!(e.contains("label 3 of sample 0"), "{e}");
    }
}
