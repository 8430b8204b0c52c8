//! What one layer type of the spec format is: its entry ([`LayerType`]: the `type` name,
//! the fields as the docs' table lists them, an example, and how its fields are read) and
//! the reader every entry reads its fields with ([`Fields`]), which words each bad field's
//! error alike and records which fields were asked for.
//!
//! Owns: the entry's shape and the field reader. Each op's entry lives in the op's own
//! folder, beside its forward and backward (`Conv2d::SPEC` in `ops/conv2d/`), and
//! `model::LAYER_TYPES` lists them. Reading a layer object by its `type` (which needs that
//! list), and the file format around the entries — `input_shape`, the `layers` list, the
//! running shape, errors naming the spec, the layer's index and its type — are
//! `model::spec_objects`' and `crate::spec`'s; nothing here imports them, so that the ops
//! stay below the format that describes them.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use super::{Layer, Padding};
use crate::tensor::Shape;

/// The largest integer a size field (filters, units, kernel, input dimension) may hold.
pub const MAX_DIM: u64 = 1 << 20;

/// A field's problem, or a layer's against the running shape, worded for the spec's user;
/// `crate::spec` prefixes the spec, the layer's index and its type.
pub type FieldResult<T> = std::result::Result<T, String>;

/// One layer type of the spec format.
pub struct LayerType {
    /// The value of the `type` field.
    pub name: &'static str,
    /// Its fields and their defaults, as the tables of the docs (`crate::spec`'s and the
    /// guide's) list them.
    pub fields: &'static str,
    /// A per-sample input shape and a layer object of this type that applies to it: the
    /// table test builds it (it shows every field that has no default).
    pub example: (&'static [usize], &'static str),
    /// Reads the fields (everything but `type`), each with its default and its error, and
    /// says how to build the layers once the running input shape is known. Reading every
    /// field before any shape is what lets a spec report a bad field of any layer before
    /// the shapes are followed through the stack.
    pub(crate) parse: fn(&mut Fields<'_>) -> FieldResult<Build>,
    /// Its kernel file (`kernels/<op>.cu`, declared in the op's `gpu.rs`), or None for an
    /// op whose GPU form launches no kernel of its own (Flatten's copies).
    #[cfg(feature = "cuda")]
    pub kernels: Option<&'static crate::cuda::KernelFile>,
    /// What the conformance test needs of the op beyond this entry (`ops::conformance`).
    #[cfg(test)]
    pub(crate) conformance: Conformance,
}

/// What the conformance test (`ops::conformance`) needs of an op beyond its entry, written
/// in the op's folder beside its checks.
#[cfg(test)]
pub(crate) struct Conformance {
    /// What the gradient check feeds the example's layer.
    pub input: TestInput,
    /// Runs every kernel of the op's file on the host against the op's CPU functions: the
    /// conformance test holds the kernels it launched to the file's. None exactly when the
    /// op has no kernel file.
    #[cfg(feature = "cuda")]
    pub host: Option<fn(&crate::cuda::host::Checker)>,
}

/// The input the gradient check feeds an op.
#[cfg(test)]
#[derive(Clone, Copy, Debug)]
pub(crate) enum TestInput {
    /// Real values in [−1, 1); the input gradient is checked too.
    Values,
    /// Real values no two of which are closer than the check's steps could bridge (a grid
    /// of spacing 0.04, shuffled): for an op whose gradient jumps where two inputs tie (max
    /// pooling); the input gradient is checked too.
    Distinct,
    /// Token ids below `vocab` (an embedding's input): only the parameters' gradients.
    Ids { vocab: usize },
}

type BuildFn = dyn Fn(&[Shape]) -> FieldResult<Built> + Send + Sync;

/// What a layer object builds: a chain of layers (most objects: one layer, or a layer
/// and the ReLU of its `"activation": "relu"`), or the nodes of a small graph (a residual
/// block, `model::residual`).
pub enum Built {
    Layers(Vec<Box<dyn Layer>>),
    Parts(Vec<Part>),
}

/// One node of the small graph a layer object builds (a residual block's).
pub struct Part {
    /// Its name under the object's (`conv1`, `shortcut.conv0`, `add`): the node is
    /// named `<object's name>.<this>`.
    pub name: String,
    pub layer: Box<dyn Layer>,
    /// What it reads, in the order its layer takes them.
    pub inputs: Vec<PartInput>,
    /// Where the index its context carries (`Ctx::layer_index`: dropout's masks) comes
    /// from: the object's own index, then for each (branch, position) of the path the
    /// index of that position in that branch (`model::residual::branch_index`). Empty:
    /// the object's own index.
    pub path: Vec<(u64, usize)>,
}

/// Where a [`Part`] reads one of its inputs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum PartInput {
    /// The object's input.
    Input,
    /// The output of the object's part `j` (an earlier one).
    Part(usize),
}

/// How a layer object, its fields read, becomes layers: given the running input shapes
/// (batch included: (2, ...) as a graph checks them; one for most layers, a merge's
/// several in its `inbound` order), fresh layers, or why those shapes do not suit it.
/// Several layers for one object: `"activation": "relu"` appends a ReLU; a residual
/// block builds the nodes of a small graph ([`Built::Parts`]).
#[derive(Clone)]
pub struct Build(Arc<BuildFn>);

impl Build {
    /// A build of one layer of one input.
    pub fn layer<L: Layer + 'static>(f: impl Fn(&Shape) -> FieldResult<L> + Send + Sync + 'static) -> Build {
        Build(Arc::new(move |inputs| Ok(Built::Layers(vec![Box::new(f(one(inputs)?)?) as Box<dyn Layer>]))))
    }

    /// A build of any number of layers of one input.
    pub fn layers(f: impl Fn(&Shape) -> FieldResult<Vec<Box<dyn Layer>>> + Send + Sync + 'static) -> Build {
        Build(Arc::new(move |inputs| f(one(inputs)?).map(Built::Layers)))
    }

    /// A build of one merge, a layer of several inputs (their shapes in `inbound` order).
    pub fn merge<L: Layer + 'static>(f: impl Fn(&[Shape]) -> FieldResult<L> + Send + Sync + 'static) -> Build {
        Build(Arc::new(move |inputs| Ok(Built::Layers(vec![Box::new(f(inputs)?) as Box<dyn Layer>]))))
    }

    /// A build of the nodes of a small graph of one input.
    pub fn parts(f: impl Fn(&Shape) -> FieldResult<Vec<Part>> + Send + Sync + 'static) -> Build {
        Build(Arc::new(move |inputs| f(one(inputs)?).map(Built::Parts)))
    }

    /// What the object builds for inputs of these shapes (batch included), in `inbound`
    /// order.
    pub fn build(&self, inputs: &[Shape]) -> FieldResult<Built> {
        (self.0)(inputs)
    }

    /// Fresh layers for inputs of these shapes (batch included), in `inbound` order: the
    /// chain the object builds (the layers of its parts, for an object that builds a
    /// graph).
    pub fn build_many(&self, inputs: &[Shape]) -> FieldResult<Vec<Box<dyn Layer>>> {
        Ok(match self.build(inputs)? {
            Built::Layers(layers) => layers,
            Built::Parts(parts) => parts.into_iter().map(|p| p.layer).collect(),
        })
    }
}

/// The one input of a layer that takes one.
fn one(inputs: &[Shape]) -> FieldResult<&Shape> {
    match inputs {
        [x] => Ok(x),
        _ => Err(format!("takes one input, given {} (its inbound names {} layers)", inputs.len(), inputs.len())),
    }
}

/// The channels of an input of images, (N, C, H, W), or the spec's words for another.
pub fn expect_images(input: &Shape) -> FieldResult<usize> {
    match input.dims() {
        [_, c, _, _] => Ok(*c),
        _ => Err(format!("expects images (C, H, W), got samples of shape {}", per_sample(input))),
    }
}

/// The features of a layer that applies to the last dimension of flat samples (F,) or of
/// sequences (T, F), as `dense` does (Keras's Dense over the last axis); images are
/// refused, a flatten or global_average_pooling2d layer named as the way to flat samples.
pub fn expect_features(input: &Shape) -> FieldResult<usize> {
    match input.dims() {
        [_, f] | [_, _, f] => Ok(*f),
        _ => Err(format!(
            "expects flat samples (F,) or sequences (T, F), got {}; add a flatten or global_average_pooling2d layer before it",
            per_sample(input)
        )),
    }
}

fn per_sample(input: &Shape) -> Shape {
    Shape::new(&input.dims()[1..])
}

/// What a conv2d or dense layer applies after itself (`Activation::after`, beside the
/// activation layers in `ops::relu`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Activation {
    Linear,
    Relu,
}

impl Activation {
    /// The spec's name: `linear` or `relu`.
    pub fn name(self) -> &'static str {
        match self {
            Activation::Linear => "linear",
            Activation::Relu => "relu",
        }
    }
}

/// The refusal of a number that JSON holds but an f32 (what every layer computes in)
/// cannot: finite as written, infinite once read.
fn overflows_f32(name: &str, v: &Value) -> String {
    format!("field '{name}' is out of range (got {v}): it overflows f32, whose largest magnitude is {:e}", f32::MAX)
}

/// The fields of one layer object, recording which ones were asked for so that the
/// others can be reported as unknown, and what each resolved to (its default where
/// absent) so that two objects that build the same layers compare equal.
pub struct Fields<'a> {
    map: &'a Map<String, Value>,
    known: Vec<&'static str>,
    resolved: Vec<(&'static str, Value)>,
}

impl<'a> Fields<'a> {
    /// The fields of the layer object `map`.
    pub(crate) fn new(map: &'a Map<String, Value>) -> Fields<'a> {
        Fields { map, known: Vec::new(), resolved: Vec::new() }
    }

    fn get(&mut self, name: &'static str) -> Option<&'a Value> {
        self.known.push(name);
        self.map.get(name).filter(|v| !v.is_null())
    }

    /// Records what a field read resolved to, as the spec would write it.
    fn record<T>(&mut self, name: &'static str, r: FieldResult<T>, value: impl Fn(&T) -> Value) -> FieldResult<T> {
        if let Ok(v) = &r {
            self.resolved.push((name, value(v)));
        }
        r
    }

    /// A size: an integer in 1..=MAX_DIM.
    pub fn size(&mut self, name: &'static str, default: Option<usize>) -> FieldResult<usize> {
        let r = match (self.get(name), default) {
            (None, Some(d)) => Ok(d),
            (None, None) => Err(format!("missing field '{name}' (a positive integer)")),
            (Some(v), _) => as_size(v).ok_or_else(|| size_problem(name, v)),
        };
        self.record(name, r, |&s| json!(s))
    }

    /// A size or a pair of sizes `[a, b]`.
    pub fn pair(&mut self, name: &'static str, default: Option<(usize, usize)>) -> FieldResult<(usize, usize)> {
        let msg = |v: &Value| match v {
            Value::Array(a) => match a.iter().find(|x| as_size(x).is_none()) {
                Some(x) if a.len() == 2 => size_problem(name, x),
                _ => format!("field '{name}' must be a positive integer or a list of two (got {v})"),
            },
            _ if v.is_number() => size_problem(name, v),
            _ => format!("field '{name}' must be a positive integer or a list of two (got {v})"),
        };
        let r = match (self.get(name), default) {
            (None, Some(d)) => Ok(d),
            (None, None) => Err(format!("missing field '{name}' (a positive integer or a list of two)")),
            (Some(Value::Array(a)), _) if a.len() == 2 => match (as_size(&a[0]), as_size(&a[1])) {
                (Some(x), Some(y)) => Ok((x, y)),
                _ => Err(msg(&Value::Array(a.clone()))),
            },
            (Some(v), _) => as_size(v).map(|s| (s, s)).ok_or_else(|| msg(v)),
        };
        self.record(name, r, |&(a, b)| json!([a, b]))
    }

    /// A finite number; `check` says what else it must satisfy.
    pub fn number(
        &mut self,
        name: &'static str,
        default: Option<f64>,
        check: (fn(f64) -> bool, &str),
    ) -> FieldResult<f32> {
        let r = match (self.get(name), default) {
            (None, Some(d)) => Ok(d as f32),
            (None, None) => Err(format!("missing field '{name}' ({})", check.1)),
            (Some(v), _) => match v.as_f64() {
                Some(x) if x.is_finite() && !(x as f32).is_finite() => Err(overflows_f32(name, v)),
                Some(x) if x.is_finite() && check.0(x) => Ok(x as f32),
                _ => Err(format!("field '{name}' must be {} (got {v})", check.1)),
            },
        };
        self.record(name, r, |&x| json!(x))
    }

    /// An optional positive finite number (absent or null: None).
    pub fn optional_positive(&mut self, name: &'static str) -> FieldResult<Option<f32>> {
        let r = match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && !(x as f32).is_finite() => Err(overflows_f32(name, v)),
                Some(x) if x > 0.0 && x.is_finite() && x as f32 > 0.0 => Ok(Some(x as f32)),
                _ => Err(format!("field '{name}' must be a positive number (got {v})")),
            },
        };
        self.record(name, r, |&x| json!(x))
    }

    /// An optional non-empty string (absent or null: None).
    pub fn optional_text(&mut self, name: &'static str) -> FieldResult<Option<String>> {
        let r = match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
            Some(v) => Err(format!("field '{name}' must be a non-empty string (got {v})")),
        };
        self.record(name, r, |x| json!(x))
    }

    /// `true` or `false`.
    pub fn boolean(&mut self, name: &'static str, default: bool) -> FieldResult<bool> {
        let r = match self.get(name) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(format!("field '{name}' must be true or false (got {v})")),
        };
        self.record(name, r, |&b| json!(b))
    }

    /// One of the words of `options` (as `word` names each), the first the default.
    pub fn choice<T: Copy + 'static>(
        &mut self,
        name: &'static str,
        options: &[T],
        word: fn(T) -> &'static str,
    ) -> FieldResult<T> {
        let words = || options.iter().map(|&o| format!("\"{}\"", word(o))).collect::<Vec<_>>().join(" or ");
        let r = match self.get(name) {
            None => Ok(options[0]),
            Some(Value::String(s)) => options
                .iter()
                .copied()
                .find(|&o| word(o) == s)
                .ok_or_else(|| format!("field '{name}' must be {} (got \"{s}\")", words())),
            Some(v) => Err(format!("field '{name}' must be {} (got {v})", words())),
        };
        self.record(name, r, |&o| json!(word(o)))
    }

    /// `activation`: "linear" (the default) or "relu".
    pub fn activation(&mut self) -> FieldResult<Activation> {
        let r = match self.get("activation") {
            None => Ok(Activation::Linear),
            Some(Value::String(s)) if s == "linear" => Ok(Activation::Linear),
            Some(Value::String(s)) if s == "relu" => Ok(Activation::Relu),
            Some(v) => Err(format!(
                "field 'activation' must be \"relu\" or \"linear\" (got {v}; a softmax belongs to the loss)"
            )),
        };
        self.record("activation", r, |a| json!(a.name()))
    }

    /// `axis` of a layer that works along the last axis alone (Keras's RMSNormalization
    /// and Softmax): -1, the default; another axis is refused by name.
    pub fn last_axis(&mut self) -> FieldResult<i64> {
        let r = match self.get("axis") {
            None => Ok(-1),
            Some(v) if v.as_i64() == Some(-1) => Ok(-1),
            Some(v) => {
                Err(format!("field 'axis' must be -1, the last axis, the only one this layer works along (got {v})"))
            }
        };
        self.record("axis", r, |&a| json!(a))
    }

    /// `padding`: "valid" (the default), "same", or PyTorch's explicit pads: an integer
    /// or `[PH, PW]` (zero allowed).
    pub fn padding(&mut self) -> FieldResult<Padding> {
        let pad = |v: &Value| v.as_u64().filter(|&p| p <= MAX_DIM).map(|p| p as usize);
        let bad = |v: &Value| {
            format!("field 'padding' must be \"valid\", \"same\", or pads as an integer or [ph, pw] (got {v})")
        };
        let r = match self.get("padding") {
            None => Ok(Padding::Valid),
            Some(Value::String(s)) if s == "valid" => Ok(Padding::Valid),
            Some(Value::String(s)) if s == "same" => Ok(Padding::Same),
            Some(v @ Value::Array(a)) => match (a.len(), a.first().and_then(pad), a.get(1).and_then(pad)) {
                (2, Some(ph), Some(pw)) => Ok(Padding::Explicit(ph, pw)),
                _ => Err(bad(v)),
            },
            Some(v) => pad(v).map(|p| Padding::Explicit(p, p)).ok_or_else(|| bad(v)),
        };
        self.record("padding", r, |p| p.to_json())
    }

    /// A field read by the caller's own reader (a container's list of layer objects:
    /// `model::spec_objects::read_layers`): `read` gets the field's value, or None when it
    /// is absent, and `resolved` writes back what it resolved to.
    pub fn custom<T>(
        &mut self,
        name: &'static str,
        read: impl FnOnce(Option<&'a Value>) -> FieldResult<T>,
        resolved: impl Fn(&T) -> Value,
    ) -> FieldResult<T> {
        let r = read(self.get(name));
        self.record(name, r, resolved)
    }

    /// Fails on a field nobody asked for; else what each field resolved to, in the order
    /// read.
    pub(crate) fn finish(self) -> FieldResult<Vec<(&'static str, Value)>> {
        let mut keys: Vec<&String> = self.map.keys().filter(|k| *k != "type" && *k != "name").collect();
        keys.sort();
        match keys.into_iter().find(|k| !self.known.contains(&k.as_str())) {
            None => Ok(self.resolved),
            Some(k) if self.known.is_empty() => Err(format!("unknown field '{k}' (this layer takes none)")),
            Some(k) => Err(format!("unknown field '{k}' (expected one of: type, {})", self.known.join(", "))),
        }
    }
}

fn as_size(v: &Value) -> Option<usize> {
    v.as_u64().filter(|&d| (1..=MAX_DIM).contains(&d)).map(|d| d as usize)
}

/// Why `v` is not a size, saying the limit: `1e9` is a whole number, only too large.
/// The number is quoted as read, never with digits nobody wrote: an integer up to
/// 2^64 − 1 digit for digit (through f64, 18446744073709551615 would print as …616), a
/// whole f64 below 2^53 (`1e9`) as its integer, a larger one in the shortest form that
/// reads back to it (`1e23`).
fn size_problem(name: &str, v: &Value) -> String {
    let whole = v.as_f64().filter(|x| x.fract() == 0.0 && x.is_finite());
    let quoted = match (v.as_u64(), whole) {
        (Some(n), _) => n.to_string(),
        (None, Some(x)) if x.abs() < 2f64.powi(53) => format!("{x:.0}"),
        _ => v.to_string(),
    };
    match whole {
        Some(x) if x > MAX_DIM as f64 => {
            format!("field '{name}' is {quoted}, above the limit of {MAX_DIM} (2^20) for a size")
        }
        _ => format!("field '{name}' must be a positive integer, at most {MAX_DIM} (got {v})"),
    }
}
