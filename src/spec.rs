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
//! | `batch_normalization` | `scale` (true), `center` (true), `epsilon` (0.001), `momentum` (0.99) |
//! | `dense` | `units`, `use_bias` (true), `activation` ("linear") |
//! | `dropout` | `rate` in [0, 1) |
//! | `relu`, `flatten`, `global_average_pooling2d` | none |
//!
//! The defaults are Keras's. Input channels and features are inferred from the running
//! shape; `"activation": "relu"` appends a ReLU layer (softmax belongs to the loss, so
//! the last layer stays linear). Unknown types and fields are errors, so a typo never
//! silently becomes a default. Integer fields are at most 2^20 and a model at most 2^31
//! values per sample and parameters, so that no size arithmetic can overflow.

use std::path::Path;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::nn::{
    BatchNorm2d, Conv2d, Dropout, Flatten, GlobalAvgPool2d, Layer, Linear, Padding, Relu, Rescaling, Sequential,
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

/// One entry of `layers`, validated.
#[derive(Clone, PartialEq, Debug)]
pub enum LayerSpec {
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
}

impl LayerSpec {
    /// The spec's name of the layer type.
    pub fn type_name(&self) -> &'static str {
        match self {
            LayerSpec::Rescaling { .. } => "rescaling",
            LayerSpec::Conv2d { .. } => "conv2d",
            LayerSpec::BatchNormalization { .. } => "batch_normalization",
            LayerSpec::Dense { .. } => "dense",
            LayerSpec::Dropout { .. } => "dropout",
            LayerSpec::Relu => "relu",
            LayerSpec::Flatten => "flatten",
            LayerSpec::GlobalAveragePooling2d => "global_average_pooling2d",
        }
    }
}

const TYPES: &str = "rescaling, conv2d, batch_normalization, relu, dense, dropout, flatten, global_average_pooling2d";

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
            match *l {
                LayerSpec::Rescaling { scale, offset } => new.push(Box::new(Rescaling::new(scale, offset))),
                LayerSpec::Conv2d { filters, kernel, stride, padding, use_bias, activation } => {
                    let c = images().map_err(|e| bad(i, l, e))?;
                    let conv = Conv2d::new(c, filters, kernel, stride, padding, use_bias)
                        .map_err(|e| bad(i, l, e.to_string()))?;
                    new.push(Box::new(conv));
                    act(activation, &mut new);
                }
                LayerSpec::BatchNormalization { scale, center, epsilon, momentum } => {
                    let c = images().map_err(|e| bad(i, l, e))?;
                    new.push(Box::new(BatchNorm2d::new(c).scale(scale).center(center).eps(epsilon).momentum(momentum)));
                }
                LayerSpec::Dense { units, use_bias, activation } => {
                    let f = flat().map_err(|e| bad(i, l, e))?;
                    let dense = Linear::new(f, units);
                    new.push(Box::new(if use_bias { dense } else { dense.without_bias() }));
                    act(activation, &mut new);
                }
                LayerSpec::Dropout { rate } => {
                    new.push(Box::new(Dropout::new(rate).map_err(|e| bad(i, l, e.to_string()))?))
                }
                LayerSpec::Relu => new.push(Box::new(Relu::new())),
                LayerSpec::Flatten => new.push(Box::new(Flatten::new())),
                LayerSpec::GlobalAveragePooling2d => {
                    images().map_err(|e| bad(i, l, e))?;
                    new.push(Box::new(GlobalAvgPool2d::new()));
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
    fn pair(&mut self, name: &'static str, default: Option<usize>) -> FieldResult<(usize, usize)> {
        let msg = |v: &Value| match v {
            Value::Array(a) => match a.iter().find(|x| as_size(x).is_none()) {
                Some(x) if a.len() == 2 => size_problem(name, x),
                _ => format!("field '{name}' must be a positive integer or a list of two (got {v})"),
            },
            _ if v.is_number() => size_problem(name, v),
            _ => format!("field '{name}' must be a positive integer or a list of two (got {v})"),
        };
        match (self.get(name), default) {
            (None, Some(d)) => Ok((d, d)),
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
        None => return Err(format!("layer {i}: missing field 'type' (one of: {TYPES})")),
    };
    let mut f = Fields { map, known: Vec::new() };
    let at = |detail: String| format!("layer {i} ({kind}): {detail}");
    let spec = (|| -> FieldResult<LayerSpec> {
        Ok(match kind {
            "rescaling" => LayerSpec::Rescaling {
                scale: f.number("scale", None, (|_| true, "a finite number"))?,
                offset: f.number("offset", Some(0.0), (|_| true, "a finite number"))?,
            },
            "conv2d" => {
                let filters = f.size("filters", None)?;
                let kernel = f.pair("kernel_size", None)?;
                let (sh, sw) = f.pair("strides", Some(1))?;
                if sh != sw {
                    return Err(format!("field 'strides' [{sh}, {sw}]: only equal strides are supported"));
                }
                LayerSpec::Conv2d {
                    filters,
                    kernel,
                    stride: sh,
                    padding: f.padding()?,
                    use_bias: f.boolean("use_bias", true)?,
                    activation: f.activation()?,
                }
            }
            "batch_normalization" => LayerSpec::BatchNormalization {
                scale: f.boolean("scale", true)?,
                center: f.boolean("center", true)?,
                epsilon: f.number("epsilon", Some(1e-3), (|x| x > 0.0, "a positive number"))?,
                momentum: f.number("momentum", Some(0.99), (|x| (0.0..=1.0).contains(&x), "a number in [0, 1]"))?,
            },
            "dense" => LayerSpec::Dense {
                units: f.size("units", None)?,
                use_bias: f.boolean("use_bias", true)?,
                activation: f.activation()?,
            },
            "dropout" => LayerSpec::Dropout {
                rate: f.number("rate", None, (|x| (0.0..1.0).contains(&x), "a number in [0, 1)"))?,
            },
            "relu" => LayerSpec::Relu,
            "flatten" => LayerSpec::Flatten,
            "global_average_pooling2d" => LayerSpec::GlobalAveragePooling2d,
            other => return Err(format!("unknown type '{other}' (one of: {TYPES})")),
        })
    })()
    .map_err(at)?;
    f.finish().map_err(at)?;
    Ok(spec)
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
