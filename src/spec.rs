//! Model specs: a [`Sequential`] stack described in JSON with Keras's layer names, so a
//! user can train their own network from the command line (`--model FILE.json`).
//!
//! Owns: the spec format, its validation — every problem an error naming the spec, the
//! layer's index (0-based, its position in `layers`) and type, and the field — and the
//! translation into layers. The layers themselves (`crate::nn`) own their arithmetic;
//! the shapes are checked here layer by layer, so that an incompatibility is reported
//! against the spec's own numbering rather than the built stack's (`conv1`, `relu3`).
//!
//! ```json
//! {"input_shape": [1, 28, 28],
//!  "layers": [{"type": "rescaling", "scale": 0.00392156862745098},
//!             {"type": "conv2d", "filters": 12, "kernel_size": 3, "strides": 1,
//!              "padding": "same", "use_bias": false},
//!             {"type": "batch_normalization", "scale": false, "center": true,
//!              "epsilon": 0.001, "momentum": 0.99},
//!             {"type": "relu"},
//!             {"type": "global_average_pooling2d"},
//!             {"type": "dense", "units": 256, "activation": "relu"},
//!             {"type": "dropout", "rate": 0.5},
//!             {"type": "dense", "units": 10}]}
//! ```
//!
//! | type | fields (default) |
//! |---|---|
//! | `rescaling` | `scale` (required), `offset` (0) |
//! | `conv2d` | `filters`, `kernel_size` (int or [kh, kw]), `strides` (1; int or [s, s]), `padding` ("valid" or "same"; "valid"), `use_bias` (true), `activation` ("linear") |
//! | `batch_normalization` | `scale` (true), `center` (true), `epsilon` (0.001), `momentum` (0.99), `synchronized` (false) |
//! | `relu` | none |
//! | `dense` | `units`, `use_bias` (true), `activation` ("linear") |
//! | `dropout` | `rate` in [0, 1) |
//! | `flatten` | none |
//! | `global_average_pooling2d` | none |
//! | `max_pooling2d` | `pool_size` (2; int or [kh, kw]), `strides` (the pool size; int or [sh, sw]), `padding` ("valid" or "same"; "valid") |
//!
//! The defaults are Keras's. Input channels and features are inferred from the running
//! shape; `"activation": "relu"` appends a ReLU layer (softmax belongs to the loss, so
//! the last layer stays linear). Unknown types and fields are errors, so a typo never
//! silently becomes a default. Integer fields are at most 2^20 and a model at most 2^31
//! values per sample and parameters, so that no size arithmetic can overflow.
//!
//! # Adding a layer type
//! [`LAYER_TYPES`] is the one list of types: the names in errors, the parse dispatch and
//! [`LayerSpec::type_name`] all read it, and its test parses every entry's example, builds
//! it, requires each built layer to have a GPU form ([`Layer::op`]), writes the ops back
//! as a spec ([`op_to_spec`], an exhaustive `match`: a new [`LayerOp`] is a compile error
//! there) and parses that again, expecting the same ops. A `LayerKind` variant without a
//! table entry is never constructed, which `cargo clippy -D warnings` refuses; the build
//! `match` over `LayerKind` is exhaustive; a table row missing from the docs above or from
//! the README fails a test.

use std::path::Path;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::{Error, Result};
use crate::nn::{
    BatchNorm2d, BatchStats, Conv2d, Dropout, Flatten, GlobalAvgPool2d, Layer, LayerOp, Linear, MaxPool2d, Padding,
    Relu, Rescaling, Sequential,
};
use crate::tensor::Shape;

/// The largest integer a size field (filters, units, kernel, input dimension) may hold.
pub const MAX_DIM: u64 = 1 << 20;
/// The most values a sample may have at any layer, and the most parameters in all.
pub const MAX_ELEMENTS: usize = 1 << 31;
/// The largest spec file read (a spec of a thousand layers is some 100 kB).
pub const MAX_SPEC_BYTES: u64 = 16 << 20;

/// What a conv2d or dense layer applies after itself.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Activation {
    Linear,
    Relu,
}

/// One entry of `layers`, validated: its type (an entry of [`LAYER_TYPES`]) and fields.
#[derive(Clone, PartialEq, Debug)]
pub struct LayerSpec {
    type_name: &'static str,
    kind: LayerKind,
}

impl LayerSpec {
    /// The spec's name of the layer type, from [`LAYER_TYPES`].
    pub fn type_name(&self) -> &'static str {
        self.type_name
    }
}

/// The validated fields of one layer. Private, so that a variant no [`LAYER_TYPES`] entry
/// constructs is dead code (a lint error under `-D warnings`), not a silent gap.
#[derive(Clone, PartialEq, Debug)]
enum LayerKind {
    Rescaling {
        scale: f32,
        offset: f32,
    },
    Conv2d {
        filters: usize,
        kernel: (usize, usize),
        stride: usize,
        padding: Padding,
        use_bias: bool,
        activation: Activation,
    },
    BatchNormalization {
        scale: bool,
        center: bool,
        epsilon: f32,
        momentum: f32,
        synchronized: bool,
    },
    Dense {
        units: usize,
        use_bias: bool,
        activation: Activation,
    },
    Dropout {
        rate: f32,
    },
    Relu,
    Flatten,
    GlobalAveragePooling2d,
    MaxPooling2d {
        pool_size: (usize, usize),
        strides: (usize, usize),
        padding: Padding,
    },
}

/// One layer type of the spec format.
pub struct LayerType {
    /// The value of the `type` field.
    pub name: &'static str,
    /// Its fields and their defaults, as the tables of the docs (above, and the README's)
    /// list them.
    pub fields: &'static str,
    /// A per-sample input shape and a layer object of this type that applies to it: the
    /// table test builds it (it shows every field that has no default).
    pub example: (&'static [usize], &'static str),
    /// Reads the fields (everything but `type`).
    parse: fn(&mut Fields<'_>) -> FieldResult<LayerKind>,
}

/// Every layer type of the spec format, in the order errors list them.
pub const LAYER_TYPES: &[LayerType] = &[
    LayerType {
        name: "rescaling",
        fields: "`scale` (required), `offset` (0)",
        example: (&[1, 4, 4], r#"{"type": "rescaling", "scale": 0.00392156862745098, "offset": -0.5}"#),
        parse: |f| {
            Ok(LayerKind::Rescaling {
                scale: f.number("scale", None, (|_| true, "a finite number"))?,
                offset: f.number("offset", Some(0.0), (|_| true, "a finite number"))?,
            })
        },
    },
    LayerType {
        name: "conv2d",
        fields: "`filters`, `kernel_size` (int or [kh, kw]), `strides` (1; int or [s, s]), `padding` (\"valid\" or \"same\"; \"valid\"), `use_bias` (true), `activation` (\"linear\")",
        example: (
            &[2, 7, 6],
            r#"{"type": "conv2d", "filters": 3, "kernel_size": [3, 2], "strides": 2, "padding": "same", "use_bias": false, "activation": "relu"}"#,
        ),
        parse: |f| {
            let filters = f.size("filters", None)?;
            let kernel = f.pair("kernel_size", None)?;
            let (sh, sw) = f.pair("strides", Some((1, 1)))?;
            if sh != sw {
                return Err(format!("field 'strides' [{sh}, {sw}]: only equal strides are supported"));
            }
            Ok(LayerKind::Conv2d {
                filters,
                kernel,
                stride: sh,
                padding: f.padding()?,
                use_bias: f.boolean("use_bias", true)?,
                activation: f.activation()?,
            })
        },
    },
    LayerType {
        name: "batch_normalization",
        fields: "`scale` (true), `center` (true), `epsilon` (0.001), `momentum` (0.99), `synchronized` (false)",
        example: (
            &[3, 4, 4],
            r#"{"type": "batch_normalization", "scale": false, "epsilon": 0.01, "momentum": 0.9, "synchronized": true}"#,
        ),
        parse: |f| {
            Ok(LayerKind::BatchNormalization {
                scale: f.boolean("scale", true)?,
                center: f.boolean("center", true)?,
                epsilon: f.number("epsilon", Some(1e-3), (|x| x > 0.0, "a positive number"))?,
                momentum: f.number("momentum", Some(0.99), (|x| (0.0..=1.0).contains(&x), "a number in [0, 1]"))?,
                synchronized: f.boolean("synchronized", false)?,
            })
        },
    },
    LayerType {
        name: "relu",
        fields: "none",
        example: (&[5], r#"{"type": "relu"}"#),
        parse: |_| Ok(LayerKind::Relu),
    },
    LayerType {
        name: "dense",
        fields: "`units`, `use_bias` (true), `activation` (\"linear\")",
        example: (&[5], r#"{"type": "dense", "units": 4, "use_bias": false, "activation": "relu"}"#),
        parse: |f| {
            Ok(LayerKind::Dense {
                units: f.size("units", None)?,
                use_bias: f.boolean("use_bias", true)?,
                activation: f.activation()?,
            })
        },
    },
    LayerType {
        name: "dropout",
        fields: "`rate` in [0, 1)",
        example: (&[5], r#"{"type": "dropout", "rate": 0.25}"#),
        parse: |f| {
            Ok(LayerKind::Dropout { rate: f.number("rate", None, (|x| (0.0..1.0).contains(&x), "a number in [0, 1)"))? })
        },
    },
    LayerType {
        name: "flatten",
        fields: "none",
        example: (&[2, 3, 3], r#"{"type": "flatten"}"#),
        parse: |_| Ok(LayerKind::Flatten),
    },
    LayerType {
        name: "global_average_pooling2d",
        fields: "none",
        example: (&[2, 3, 3], r#"{"type": "global_average_pooling2d"}"#),
        parse: |_| Ok(LayerKind::GlobalAveragePooling2d),
    },
    LayerType {
        name: "max_pooling2d",
        fields: "`pool_size` (2; int or [kh, kw]), `strides` (the pool size; int or [sh, sw]), `padding` (\"valid\" or \"same\"; \"valid\")",
        example: (&[2, 7, 6], r#"{"type": "max_pooling2d", "pool_size": [3, 2], "strides": [2, 1], "padding": "same"}"#),
        parse: |f| {
            let pool_size = f.pair("pool_size", Some((2, 2)))?;
            Ok(LayerKind::MaxPooling2d {
                pool_size,
                strides: f.pair("strides", Some(pool_size))?,
                padding: f.padding()?,
            })
        },
    },
];

/// The type names, for errors: `rescaling, conv2d, ...`.
fn type_list() -> String {
    LAYER_TYPES.iter().map(|t| t.name).collect::<Vec<_>>().join(", ")
}

/// The spec layer object that builds a layer computing `op` (input channels and features
/// are inferred from the running shape, as when parsing). Exhaustive: a new [`LayerOp`]
/// does not compile until it has a spec form.
pub fn op_to_spec(op: &LayerOp) -> Value {
    match *op {
        LayerOp::Linear { out_features, bias, .. } => json!({"type": "dense", "units": out_features, "use_bias": bias}),
        LayerOp::Conv2d { filters, window, bias, .. } => json!({
            "type": "conv2d",
            "filters": filters,
            "kernel_size": [window.kernel.0, window.kernel.1],
            "strides": [window.stride.0, window.stride.1],
            "padding": window.padding.name(),
            "use_bias": bias,
        }),
        LayerOp::BatchNorm2d { eps, momentum, scale, center, stats, .. } => json!({
            "type": "batch_normalization", "scale": scale, "center": center, "epsilon": eps, "momentum": momentum,
            "synchronized": stats == BatchStats::Global,
        }),
        LayerOp::Relu => json!({"type": "relu"}),
        LayerOp::Rescaling { scale, offset } => json!({"type": "rescaling", "scale": scale, "offset": offset}),
        LayerOp::Dropout { rate } => json!({"type": "dropout", "rate": rate}),
        LayerOp::Flatten => json!({"type": "flatten"}),
        LayerOp::GlobalAvgPool2d => json!({"type": "global_average_pooling2d"}),
        LayerOp::MaxPool2d { window } => json!({
            "type": "max_pooling2d",
            "pool_size": [window.kernel.0, window.kernel.1],
            "strides": [window.stride.0, window.stride.1],
            "padding": window.padding.name(),
        }),
    }
}

/// A spec (`{"input_shape": ..., "layers": [...]}`) that builds `model` again, or an
/// error naming the first layer that has no [`LayerOp`] (a layer of the user's own).
pub fn model_to_spec(model: &Sequential) -> Result<Value> {
    let layers = model
        .layers()
        .iter()
        .zip(model.layer_names())
        .map(|(l, name)| {
            l.op()
                .map(|op| op_to_spec(&op))
                .ok_or_else(|| Error::config("model spec", format!("layer {name} ({}) has no spec form", l.describe())))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(json!({"input_shape": model.input_shape().dims(), "layers": layers}))
}

/// A parsed and checked spec: building it cannot fail on shapes.
#[derive(Clone, PartialEq, Debug)]
pub struct ModelSpec {
    /// Shape of one input sample, e.g. `[1, 28, 28]` or `[2]`.
    pub input_shape: Vec<usize>,
    pub layers: Vec<LayerSpec>,
    /// Where the spec came from (a path, or a name given by the caller), for messages.
    pub origin: String,
}

/// The top level of a spec file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecFile {
    input_shape: Value,
    layers: Vec<Value>,
}

/// Builds the network a spec describes; `origin` names the spec in errors.
pub fn model_from_spec_str(text: &str, origin: &str) -> Result<Sequential> {
    ModelSpec::parse(text, origin)?.build()
}

/// Reads and builds a spec file.
pub fn model_from_spec_file(path: &Path) -> Result<Sequential> {
    ModelSpec::from_file(path)?.build()
}

impl ModelSpec {
    /// Reads and checks a spec file (at most [`MAX_SPEC_BYTES`], checked before reading).
    pub fn from_file(path: &Path) -> Result<ModelSpec> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if let Some(what) = crate::safetensors_io::not_a_file(&meta) {
            return Err(Error::format(path, format!("is {what}, not a model spec file")));
        }
        if meta.len() > MAX_SPEC_BYTES {
            return Err(Error::format(
                path,
                format!("{} bytes: a model spec is at most {MAX_SPEC_BYTES} bytes of JSON", meta.len()),
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        ModelSpec::parse(&text, &path.display().to_string())
    }

    /// Parses and checks a spec: syntax, every field, and the shapes through the stack.
    pub fn parse(text: &str, origin: &str) -> Result<ModelSpec> {
        let bad = |detail: String| Error::format(origin, detail);
        let file: SpecFile = serde_json::from_str(text).map_err(|e| bad(format!("not a valid model spec: {e}")))?;
        let input_shape = match &file.input_shape {
            Value::Array(dims) if !dims.is_empty() => dims
                .iter()
                .map(|d| d.as_u64().filter(|&d| (1..=MAX_DIM).contains(&d)).map(|d| d as usize))
                .collect::<Option<Vec<usize>>>(),
            _ => None,
        }
        .ok_or_else(|| {
            bad(format!(
                "field 'input_shape' must be a non-empty list of integers in 1..={MAX_DIM}, e.g. [1, 28, 28] (got {})",
                file.input_shape
            ))
        })?;
        if file.layers.is_empty() {
            return Err(bad("field 'layers' is empty: a model needs at least one layer".into()));
        }
        let layers =
            file.layers.iter().enumerate().map(|(i, v)| parse_layer(i, v).map_err(bad)).collect::<Result<Vec<_>>>()?;
        let spec = ModelSpec { input_shape, layers, origin: origin.to_string() };
        spec.layers_checked()?;
        Ok(spec)
    }

    /// The network, with fresh layers.
    pub fn build(&self) -> Result<Sequential> {
        let layers = self.layers_checked()?;
        Sequential::new(self.input_shape.clone(), layers)
            .map_err(|e| Error::format(&self.origin, format!("cannot build the model: {e}")))
    }

    /// The layers, built one at a time against the running shape (batch of 2, as
    /// `Sequential` checks), each problem named by its spec index.
    fn layers_checked(&self) -> Result<Vec<Box<dyn Layer>>> {
        let bad = |i: usize, l: &LayerSpec, detail: String| {
            Error::format(&self.origin, format!("layer {i} ({}): {detail}", l.type_name()))
        };
        let per_sample: usize =
            self.input_shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).unwrap_or(usize::MAX);
        if per_sample > MAX_ELEMENTS {
            return Err(Error::format(
                &self.origin,
                format!("field 'input_shape' {:?} has more than {MAX_ELEMENTS} values", self.input_shape),
            ));
        }
        let mut dims = vec![2];
        dims.extend_from_slice(&self.input_shape);
        let mut shape = Shape::new(dims);
        let mut total_params = 0usize;
        let mut out: Vec<Box<dyn Layer>> = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let sample = Shape::new(&shape.dims()[1..]);
            let images = || -> std::result::Result<usize, String> {
                match shape.dims() {
                    [_, c, _, _] => Ok(*c),
                    _ => Err(format!("expects images (C, H, W), got samples of shape {sample}")),
                }
            };
            let flat = || -> std::result::Result<usize, String> {
                match shape.dims() {
                    [_, f] => Ok(*f),
                    _ => Err(format!(
                        "expects flat samples (F,), got {sample}; add a flatten or global_average_pooling2d layer before it"
                    )),
                }
            };
            let mut new: Vec<Box<dyn Layer>> = Vec::new();
            let act = |a: Activation, new: &mut Vec<Box<dyn Layer>>| {
                if a == Activation::Relu {
                    new.push(Box::new(Relu::new()));
                }
            };
            match l.kind {
                LayerKind::Rescaling { scale, offset } => new.push(Box::new(Rescaling::new(scale, offset))),
                LayerKind::Conv2d { filters, kernel, stride, padding, use_bias, activation } => {
                    let c = images().map_err(|e| bad(i, l, e))?;
                    let conv = Conv2d::new(c, filters, kernel, stride, padding, use_bias)
                        .map_err(|e| bad(i, l, e.to_string()))?;
                    new.push(Box::new(conv));
                    act(activation, &mut new);
                }
                LayerKind::BatchNormalization { scale, center, epsilon, momentum, synchronized } => {
                    let c = images().map_err(|e| bad(i, l, e))?;
                    let stats = if synchronized { BatchStats::Global } else { BatchStats::Shard };
                    let bn = BatchNorm2d::new(c).scale(scale).center(center).eps(epsilon).momentum(momentum);
                    new.push(Box::new(bn.batch_stats(stats)));
                }
                LayerKind::Dense { units, use_bias, activation } => {
                    let f = flat().map_err(|e| bad(i, l, e))?;
                    let dense = Linear::new(f, units);
                    new.push(Box::new(if use_bias { dense } else { dense.without_bias() }));
                    act(activation, &mut new);
                }
                LayerKind::Dropout { rate } => {
                    new.push(Box::new(Dropout::new(rate).map_err(|e| bad(i, l, e.to_string()))?))
                }
                LayerKind::Relu => new.push(Box::new(Relu::new())),
                LayerKind::Flatten => new.push(Box::new(Flatten::new())),
                LayerKind::GlobalAveragePooling2d => {
                    images().map_err(|e| bad(i, l, e))?;
                    new.push(Box::new(GlobalAvgPool2d::new()));
                }
                LayerKind::MaxPooling2d { pool_size, strides, padding } => {
                    images().map_err(|e| bad(i, l, e))?;
                    let pool = MaxPool2d::new(pool_size, strides, padding).map_err(|e| bad(i, l, e.to_string()))?;
                    new.push(Box::new(pool));
                }
            }
            for layer in &new {
                // Parameter counts first, with checked arithmetic: `Shape::numel` of an
                // absurd kernel would overflow.
                for p in layer.params().iter().chain(&layer.buffers()) {
                    let n = p.shape.dims().iter().try_fold(1usize, |a, &d| a.checked_mul(d));
                    total_params = n.and_then(|n| total_params.checked_add(n)).unwrap_or(usize::MAX);
                    if total_params > MAX_ELEMENTS {
                        return Err(bad(i, l, format!("the model would have more than {MAX_ELEMENTS} parameters")));
                    }
                }
                shape = layer.output_shape(&shape).map_err(|e| bad(i, l, e.to_string()))?;
                let per: Option<usize> = shape.dims()[1..].iter().try_fold(1usize, |a, &d| a.checked_mul(d));
                if !matches!(per, Some(p) if p <= MAX_ELEMENTS) {
                    return Err(bad(i, l, format!("its output has more than {MAX_ELEMENTS} values per sample")));
                }
            }
            out.extend(new);
        }
        Ok(out)
    }
}

/// The fields of one layer object, recording which ones were asked for so that the
/// others can be reported as unknown.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    known: Vec<&'static str>,
}

type FieldResult<T> = std::result::Result<T, String>;

impl<'a> Fields<'a> {
    fn get(&mut self, name: &'static str) -> Option<&'a Value> {
        self.known.push(name);
        self.map.get(name).filter(|v| !v.is_null())
    }

    /// A size: an integer in 1..=MAX_DIM.
    fn size(&mut self, name: &'static str, default: Option<usize>) -> FieldResult<usize> {
        match (self.get(name), default) {
            (None, Some(d)) => Ok(d),
            (None, None) => Err(format!("missing field '{name}' (a positive integer)")),
            (Some(v), _) => as_size(v).ok_or_else(|| size_problem(name, v)),
        }
    }

    /// A size or a pair of sizes `[a, b]`.
    fn pair(&mut self, name: &'static str, default: Option<(usize, usize)>) -> FieldResult<(usize, usize)> {
        let msg = |v: &Value| match v {
            Value::Array(a) => match a.iter().find(|x| as_size(x).is_none()) {
                Some(x) if a.len() == 2 => size_problem(name, x),
                _ => format!("field '{name}' must be a positive integer or a list of two (got {v})"),
            },
            _ if v.is_number() => size_problem(name, v),
            _ => format!("field '{name}' must be a positive integer or a list of two (got {v})"),
        };
        match (self.get(name), default) {
            (None, Some(d)) => Ok(d),
            (None, None) => Err(format!("missing field '{name}' (a positive integer or a list of two)")),
            (Some(Value::Array(a)), _) if a.len() == 2 => match (as_size(&a[0]), as_size(&a[1])) {
                (Some(x), Some(y)) => Ok((x, y)),
                _ => Err(msg(&Value::Array(a.clone()))),
            },
            (Some(v), _) => as_size(v).map(|s| (s, s)).ok_or_else(|| msg(v)),
        }
    }

    /// A finite number; `check` says what else it must satisfy.
    fn number(&mut self, name: &'static str, default: Option<f64>, check: (fn(f64) -> bool, &str)) -> FieldResult<f32> {
        let v = match (self.get(name), default) {
            (None, Some(d)) => return Ok(d as f32),
            (None, None) => return Err(format!("missing field '{name}' ({})", check.1)),
            (Some(v), _) => v,
        };
        match v.as_f64() {
            Some(x) if x.is_finite() && (x as f32).is_finite() && check.0(x) => Ok(x as f32),
            _ => Err(format!("field '{name}' must be {} (got {v})", check.1)),
        }
    }

    fn boolean(&mut self, name: &'static str, default: bool) -> FieldResult<bool> {
        match self.get(name) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(format!("field '{name}' must be true or false (got {v})")),
        }
    }

    fn activation(&mut self) -> FieldResult<Activation> {
        match self.get("activation") {
            None => Ok(Activation::Linear),
            Some(Value::String(s)) if s == "linear" => Ok(Activation::Linear),
            Some(Value::String(s)) if s == "relu" => Ok(Activation::Relu),
            Some(v) => Err(format!(
                "field 'activation' must be \"relu\" or \"linear\" (got {v}; a softmax belongs to the loss)"
            )),
        }
    }

    fn padding(&mut self) -> FieldResult<Padding> {
        match self.get("padding") {
            None => Ok(Padding::Valid),
            Some(Value::String(s)) if s == "valid" => Ok(Padding::Valid),
            Some(Value::String(s)) if s == "same" => Ok(Padding::Same),
            Some(v) => Err(format!("field 'padding' must be \"valid\" or \"same\" (got {v})")),
        }
    }

    /// Fails on a field nobody asked for.
    fn finish(self) -> FieldResult<()> {
        let mut keys: Vec<&String> = self.map.keys().filter(|k| *k != "type").collect();
        keys.sort();
        match keys.into_iter().find(|k| !self.known.contains(&k.as_str())) {
            None => Ok(()),
            Some(k) if self.known.is_empty() => Err(format!("unknown field '{k}' (this layer takes none)")),
            Some(k) => Err(format!("unknown field '{k}' (expected one of: type, {})", self.known.join(", "))),
        }
    }
}

fn as_size(v: &Value) -> Option<usize> {
    v.as_u64().filter(|&d| (1..=MAX_DIM).contains(&d)).map(|d| d as usize)
}

/// Why `v` is not a size, saying the limit: `1e9` is a whole number, only too large.
fn size_problem(name: &str, v: &Value) -> String {
    let whole = v.as_f64().filter(|x| x.fract() == 0.0 && x.is_finite());
    match whole {
        Some(x) if x > MAX_DIM as f64 => {
            format!("field '{name}' is {x:.0}, above the limit of {MAX_DIM} (2^20) for a size")
        }
        _ => format!("field '{name}' must be a positive integer, at most {MAX_DIM} (got {v})"),
    }
}

fn parse_layer(i: usize, v: &Value) -> std::result::Result<LayerSpec, String> {
    let Value::Object(map) = v else {
        return Err(format!("layer {i}: expected an object such as {{\"type\": \"dense\", \"units\": 10}} (got {v})"));
    };
    let kind = match map.get("type") {
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(format!("layer {i}: field 'type' must be a string (got {other})")),
        None => return Err(format!("layer {i}: missing field 'type' (one of: {})", type_list())),
    };
    let at = |detail: String| format!("layer {i} ({kind}): {detail}");
    let ty = LAYER_TYPES
        .iter()
        .find(|t| t.name == kind)
        .ok_or_else(|| at(format!("unknown type '{kind}' (one of: {})", type_list())))?;
    let mut f = Fields { map, known: Vec::new() };
    let layer = (ty.parse)(&mut f).map_err(at)?;
    f.finish().map_err(at)?;
    Ok(LayerSpec { type_name: ty.name, kind: layer })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        ModelSpec::parse(text, "m.json").expect_err("expected an error").to_string()
    }

    fn with_layers(layers: &str) -> String {
        format!(r#"{{"input_shape": [1, 8, 8], "layers": [{layers}]}}"#)
    }

    #[test]
    fn every_layer_type_parses_builds_has_a_gpu_form_and_writes_back() {
        let mut names = std::collections::BTreeSet::new();
        for t in LAYER_TYPES {
            assert!(names.insert(t.name), "{} is listed twice", t.name);
            let (input, layer) = t.example;
            let text = format!(r#"{{"input_shape": {input:?}, "layers": [{layer}]}}"#);
            let spec = ModelSpec::parse(&text, t.name).unwrap_or_else(|e| panic!("the example does not parse: {e}"));
            assert_eq!(spec.layers[0].type_name(), t.name, "the example of {} is of another type", t.name);
            let model = spec.build().unwrap();
            // A built-in layer without a LayerOp would be refused by the GPU replica at
            // start-up; here it fails on any machine.
            let ops: Vec<LayerOp> = model
                .layers()
                .iter()
                .zip(model.layer_names())
                .map(|(l, n)| {
                    l.op().unwrap_or_else(|| {
                        panic!("{}: layer {n} ({}) has no LayerOp (no GPU form)", t.name, l.describe())
                    })
                })
                .collect();
            let written = model_to_spec(&model).unwrap().to_string();
            let again = ModelSpec::parse(&written, "written back")
                .and_then(|s| s.build())
                .unwrap_or_else(|e| panic!("{}: {written} does not build: {e}", t.name));
            let ops_again: Vec<LayerOp> = again.layers().iter().map(|l| l.op().unwrap()).collect();
            assert_eq!(ops, ops_again, "{}: written back as {written}", t.name);
            assert_eq!(model.layer_shapes(), again.layer_shapes(), "{}", t.name);
        }
    }

    #[test]
    fn the_docs_and_the_readme_list_every_layer_type() {
        let (docs, readme) = (include_str!("spec.rs"), include_str!("../README.md"));
        for t in LAYER_TYPES {
            let row = format!("| `{}` | {} |", t.name, t.fields);
            assert!(docs.contains(&format!("//! {row}\n")), "the table of src/spec.rs's docs lacks\n{row}");
            assert!(readme.contains(&format!("\n{row}\n")), "README.md's table of layer types lacks\n{row}");
        }
        let rows = docs.lines().filter(|l| l.starts_with("//! | `")).count();
        assert_eq!(rows, LAYER_TYPES.len(), "the docs' table lists a type LAYER_TYPES does not have");
    }

    #[test]
    fn max_pooling2d_defaults_are_keras_and_errors_name_the_field() {
        // Keras MaxPooling2D(): pool_size (2, 2), strides = pool_size, "valid".
        let m = model_from_spec_str(&with_layers(r#"{"type": "max_pooling2d"}"#), "m.json").unwrap();
        let window = crate::nn::Window2d::new((2, 2), (2, 2), Padding::Valid);
        assert_eq!(m.layers()[0].op(), Some(LayerOp::MaxPool2d { window }));
        // 8×8 → ⌊(8 − 2)/2⌋ + 1 = 4.
        assert_eq!(m.output_shape().dims(), &[1, 4, 4]);
        assert_eq!(m.layer_names(), &["maxpool0"]);
        // strides default to a non-square pool size; same padding on 8×8 with (3, 2):
        // ⌈8/3⌉ = 3 rows, ⌈8/2⌉ = 4 columns.
        let m = model_from_spec_str(
            &with_layers(r#"{"type": "max_pooling2d", "pool_size": [3, 2], "padding": "same"}"#),
            "m.json",
        )
        .unwrap();
        let window = crate::nn::Window2d::new((3, 2), (3, 2), Padding::Same);
        assert_eq!(m.layers()[0].op(), Some(LayerOp::MaxPool2d { window }));
        assert_eq!(m.output_shape().dims(), &[1, 3, 4]);
        let pool = |extra: &str| with_layers(&format!(r#"{{"type": "relu"}}, {{"type": "max_pooling2d", {extra}}}"#));
        assert_eq!(
            err(&pool(r#""pool_size": 0"#)),
            "m.json: layer 1 (max_pooling2d): field 'pool_size' must be a positive integer, at most 1048576 (got 0)"
        );
        assert!(err(&pool(r#""strides": [1]"#)).contains("layer 1 (max_pooling2d): field 'strides' must be"));
        assert!(err(&pool(r#""padding": "causal""#)).contains("field 'padding' must be \"valid\" or \"same\""));
        assert_eq!(
            err(&pool(r#""data_format": "channels_first""#)),
            "m.json: layer 1 (max_pooling2d): unknown field 'data_format' (expected one of: type, pool_size, strides, padding)"
        );
        assert_eq!(
            err(&pool(r#""pool_size": 9"#)),
            "m.json: layer 1 (max_pooling2d): MaxPool2d: shape mismatch: input (2, 1, 8, 8) is empty or smaller than the 9x9 pool"
        );
        assert!(err(r#"{"input_shape": [4], "layers": [{"type": "max_pooling2d"}]}"#)
            .contains("layer 0 (max_pooling2d): expects images (C, H, W), got samples of shape (4)"));
    }

    #[test]
    fn a_layer_without_a_layer_op_has_no_spec_form() {
        let model =
            Sequential::new([3], vec![Box::new(Linear::new(3, 2)) as Box<dyn Layer>, Box::new(crate::nn::CpuOnly)])
                .unwrap();
        let e = model_to_spec(&model).unwrap_err().to_string();
        assert!(e.contains("layer cpuonly0 (CpuOnly) has no spec form"), "{e}");
    }

    #[test]
    fn a_small_convnet_builds_with_inferred_sizes() {
        let m = model_from_spec_str(
            &with_layers(
                r#"{"type": "conv2d", "filters": 4, "kernel_size": [3, 2], "activation": "relu"},
                   {"type": "flatten"}, {"type": "dense", "units": 3, "use_bias": false}"#,
            ),
            "m.json",
        )
        .unwrap();
        assert_eq!(m.layer_names(), &["conv0", "relu0", "flatten0", "dense0"]);
        let shapes: Vec<(&str, &[usize])> = m.param_infos().iter().map(|t| (t.name.as_str(), t.shape.dims())).collect();
        // valid 3×2 kernel on 8×8: 6×7 outputs of 4 channels = 168 features.
        assert_eq!(
            shapes,
            vec![("conv0.weight", &[4, 1, 3, 2][..]), ("conv0.bias", &[4][..]), ("dense0.weight", &[3, 168][..])]
        );
        assert_eq!(m.output_shape().dims(), &[3]);
    }

    #[test]
    fn field_errors_name_the_layer_and_the_field() {
        let conv = |extra: &str| with_layers(&format!(r#"{{"type": "relu"}}, {{"type": "conv2d", {extra}}}"#));
        assert_eq!(
            err(&conv(r#""filters": 0, "kernel_size": 3"#)),
            "m.json: layer 1 (conv2d): field 'filters' must be a positive integer, at most 1048576 (got 0)"
        );
        // The issue: "units 1e9" said "must be a positive integer", hiding the limit.
        assert_eq!(
            err(&with_layers(r#"{"type": "flatten"}, {"type": "dense", "units": 1e9}"#)),
            "m.json: layer 1 (dense): field 'units' is 1000000000, above the limit of 1048576 (2^20) for a size"
        );
        assert!(err(&conv(r#""filters": 2, "kernel_size": [3, 2000000]"#))
            .contains("field 'kernel_size' is 2000000, above the limit of 1048576 (2^20) for a size"));
        assert!(err(&conv(r#""filters": -2, "kernel_size": 3"#)).contains("field 'filters' must be a positive integer"));
        assert!(err(&conv(r#""filters": 2.5, "kernel_size": 3"#)).contains("(got 2.5)"));
        assert!(err(&conv(r#""kernel_size": 3"#)).contains("layer 1 (conv2d): missing field 'filters'"));
        assert!(err(&conv(r#""filters": 2, "kernel_size": [3]"#))
            .contains("field 'kernel_size' must be a positive integer or a list of two (got [3])"));
        assert!(err(&conv(r#""filters": 2, "kernel_size": 3, "strides": [1, 2]"#)).contains("only equal strides"));
        assert!(err(&conv(r#""filters": 2, "kernel_size": 3, "padding": "causal""#))
            .contains("field 'padding' must be \"valid\" or \"same\""));
        assert!(err(&conv(r#""filters": 2, "kernel_size": 3, "activation": "softmax""#))
            .contains("field 'activation' must be \"relu\" or \"linear\""));
        assert!(err(&conv(r#""filters": 2, "kernel_size": 3, "use_bias": 1"#))
            .contains("field 'use_bias' must be true or false (got 1)"));
        assert_eq!(
            err(&conv(r#""filters": 2, "kernel_size": 3, "filter": 3"#)),
            "m.json: layer 1 (conv2d): unknown field 'filter' (expected one of: type, filters, kernel_size, strides, padding, use_bias, activation)"
        );
        assert!(err(&with_layers(r#"{"type": "relu", "alpha": 0.1}"#))
            .contains("layer 0 (relu): unknown field 'alpha' (this layer takes none)"));
        assert!(err(&with_layers(r#"{"type": "dropout", "rate": 1}"#))
            .contains("layer 0 (dropout): field 'rate' must be a number in [0, 1) (got 1)"));
        assert!(err(&with_layers(r#"{"type": "batch_normalization", "epsilon": 0}"#))
            .contains("field 'epsilon' must be a positive number"));
        assert!(err(&with_layers(r#"{"type": "rescaling"}"#)).contains("layer 0 (rescaling): missing field 'scale'"));
        assert!(err(&with_layers(r#"{"type": "rescaling", "scale": 1e300}"#))
            .contains("field 'scale' must be a finite number"));
    }

    #[test]
    fn structure_errors_are_named() {
        assert!(err(&with_layers(r#"{"type": "maxpool2d"}"#))
            .contains("layer 0 (maxpool2d): unknown type 'maxpool2d' (one of: rescaling"));
        assert!(err(&with_layers(r#"{"units": 3}"#)).contains("layer 0: missing field 'type'"));
        assert!(err(&with_layers(r#"{"type": 3}"#)).contains("layer 0: field 'type' must be a string"));
        assert!(err(&with_layers("[1]")).contains("layer 0: expected an object"));
        assert!(err(&with_layers("")).contains("field 'layers' is empty"));
        assert!(err(r#"{"input_shape": [1, 0], "layers": [{"type": "relu"}]}"#).contains("field 'input_shape' must be"));
        assert!(err(r#"{"input_shape": [], "layers": [{"type": "relu"}]}"#).contains("field 'input_shape' must be"));
        assert!(err(r#"{"input_shape": [2], "layers": [], "name": "x"}"#).contains("unknown field `name`"));
        assert!(err(r#"{"layers": []}"#).contains("missing field `input_shape`"));
        assert!(err("{").contains("m.json: not a valid model spec: EOF while parsing"));
    }

    #[test]
    fn shape_errors_name_the_layer() {
        assert_eq!(
            err(&with_layers(r#"{"type": "dense", "units": 3}"#)),
            "m.json: layer 0 (dense): expects flat samples (F,), got (1, 8, 8); add a flatten or global_average_pooling2d layer before it"
        );
        assert!(err(r#"{"input_shape": [5], "layers": [{"type": "conv2d", "filters": 1, "kernel_size": 1}]}"#)
            .contains("layer 0 (conv2d): expects images (C, H, W), got samples of shape (5)"));
        assert!(err(&with_layers(r#"{"type": "relu"}, {"type": "conv2d", "filters": 1, "kernel_size": 9}"#)).contains(
            "layer 1 (conv2d): Conv2d: shape mismatch: input (2, 1, 8, 8) is empty or smaller than the 9x9 kernel"
        ));
        assert!(err(&with_layers(r#"{"type": "flatten"}, {"type": "batch_normalization"}"#))
            .contains("layer 1 (batch_normalization): expects images"));
        // 2^20 filters of a 2^20×1 kernel: 2^40 parameters, refused before any product
        // can overflow.
        let huge =
            format!(r#"{{"type": "conv2d", "filters": {MAX_DIM}, "kernel_size": [{MAX_DIM}, 1], "padding": "same"}}"#);
        assert!(err(&with_layers(&huge)).contains("more than 2147483648 parameters"));
        assert!(
            err(r#"{"input_shape": [1048576, 1048576, 1048576], "layers": [{"type": "relu"}]}"#).contains("more than")
        );
    }
}
