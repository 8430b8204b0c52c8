//! Model specs: a model's [`Graph`] described in JSON with Keras's layer names (a stack,
//! or layers naming their `inbound` ones), so a user can train their own network from the
//! command line (`--model FILE.json`).
//!
//! Owns: the file format — `input_shape`, the `layers` list, the shapes followed through
//! the stack, every problem an error naming the spec, the layer's index (0-based, its
//! position in `layers`) and type, and the field — and writing a model back as a spec.
//! Each layer type's own fields (their defaults, their errors) and how they build are
//! the layer's module's (its `SPEC` entry, listed in [`LAYER_TYPES`]), beside its
//! arithmetic. The shapes are checked here layer by layer, so that an incompatibility is
//! reported against the spec's own numbering rather than the built stack's (`conv1`,
//! `relu3`).
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
//! Every layer type, with its fields and their defaults, is the table of the guide's
//! command-line chapter (docs/command-line.md, "Models without Rust"), which a test keeps
//! equal to [`LAYER_TYPES`].
//!
//! The defaults are Keras's. Input channels and features are inferred from the running
//! shape; `"activation": "relu"` appends a ReLU layer (softmax belongs to the loss, so
//! the last layer stays linear). Unknown types and fields are errors, so a typo never
//! silently becomes a default. Integer fields are at most 2^20 and a model at most 2^31
//! values per sample and parameters, so that no size arithmetic can overflow.
//!
//! # Adding a layer type
//! A type's entry is the [`LayerType`] of its op's folder (`Conv2d::SPEC` in
//! `ops/conv2d/`): its `type` name, its fields as the guide's table lists them, an example,
//! and a function that reads the fields with `ops::spec::Fields` (each default and each
//! error there) and builds the layers against the running shape; the layer writes itself
//! back ([`Layer::spec`](crate::nn::Layer::spec)). [`LAYER_TYPES`] is the one list of types:
//! the parse dispatch, the names in errors and [`LayerSpec::type_name`] all read it. What a
//! new op owes is the architecture chapter's (docs/architecture.md, "Ops: one folder
//! each"), and the conformance test holds it to all of it; a row missing from the guide's
//! table fails the test below.

use std::path::Path;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::model::spec_objects::{layers_to_spec, read_layer};
use crate::model::{Graph, GraphNode, Source, INPUT_NAME};
use crate::tensor::Shape;

pub use crate::model::LAYER_TYPES;
pub use crate::ops::spec::{Activation, LayerType, MAX_DIM};
/// The most values a sample may have at any layer, and the most parameters in all.
pub const MAX_ELEMENTS: usize = 1 << 31;
/// The largest spec file read (a spec of a thousand layers is some 100 kB).
pub const MAX_SPEC_BYTES: u64 = 16 << 20;

/// One entry of `layers`, validated: its type (an entry of [`LAYER_TYPES`]), its name if
/// it gives one, what each of its fields resolved to (its default where absent), and how
/// it builds.
pub use crate::model::spec_objects::LayerObject as LayerSpec;

/// A spec (`{"input_shape": ..., "layers": [...]}`) that builds `model` again, each layer
/// written by its own [`Layer::spec`](crate::nn::Layer::spec), or an error naming the
/// first layer that has no spec form (a layer of the user's own). A graph that is not a
/// chain names every layer and writes each one's `inbound`.
pub fn model_to_spec(model: &Graph) -> Result<Value> {
    if model.inputs().len() != 1 {
        return Err(Error::config(
            "model spec",
            format!("the model has {} inputs; a spec describes a model of one input", model.inputs().len()),
        ));
    }
    let mut layers = layers_to_spec(model.layers(), model.layer_names(), "").map_err(|(name, describe)| {
        Error::config("model spec", format!("layer {name} ({describe}) has no spec form"))
    })?;
    if !model.is_chain() {
        let names = model.layer_names();
        for (j, (v, sources)) in layers.iter_mut().zip(model.sources()).enumerate() {
            let inbound: Vec<&str> = sources
                .iter()
                .map(|&s| match s {
                    Source::Input(_) => INPUT_NAME,
                    Source::Node(i) => names[i].as_str(),
                })
                .collect();
            if let Value::Object(map) = v {
                map.insert("name".into(), json!(names[j]));
                map.insert("inbound".into(), json!(inbound));
            }
        }
    }
    Ok(json!({"input_shape": model.input_shape().dims(), "layers": layers}))
}

/// A parsed and checked spec: building it cannot fail on shapes.
#[derive(Clone, PartialEq, Debug)]
pub struct ModelSpec {
    /// Shape of one input sample, e.g. `[1, 28, 28]` or `[2]`.
    pub input_shape: Vec<usize>,
    pub layers: Vec<LayerSpec>,
    /// Each layer's `inbound`: the names of the layers (or `input`, the model's input)
    /// whose outputs it reads, in the order it takes them; None: the layer before it in
    /// `layers` (the input for the first).
    pub inbound: Vec<Option<Vec<String>>>,
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
pub fn model_from_spec_str(text: &str, origin: &str) -> Result<Graph> {
    ModelSpec::parse(text, origin)?.build()
}

/// Reads and builds a spec file.
pub fn model_from_spec_file(path: &Path) -> Result<Graph> {
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
        let value: Value = serde_json::from_str(text).map_err(|e| bad(format!("not a valid model spec: {e}")))?;
        if let Some(dup) = crate::json_keys::first_duplicate(text) {
            return Err(bad(duplicate_words(&dup, &value)));
        }
        let file: SpecFile = serde_json::from_value(value).map_err(|e| bad(format!("not a valid model spec: {e}")))?;
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
        let (layers, inbound) = file
            .layers
            .iter()
            .enumerate()
            .map(|(i, v)| parse_layer(i, v).map_err(bad))
            .collect::<Result<(Vec<_>, Vec<_>)>>()?;
        let spec = ModelSpec { input_shape, layers, inbound, origin: origin.to_string() };
        spec.nodes_checked()?;
        Ok(spec)
    }

    /// The network, with fresh layers.
    pub fn build(&self) -> Result<Graph> {
        let nodes = self.nodes_checked()?;
        Graph::build(vec![(INPUT_NAME.to_string(), Shape::new(self.input_shape.clone()))], nodes)
            .map_err(|e| Error::format(&self.origin, format!("cannot build the model: {e}")))
    }

    /// Each layer's inputs, by index into `layers` (None: the model's input), from its
    /// `inbound` or the layer before it; every problem named by the spec's index.
    fn wiring(&self) -> Result<Vec<Vec<Option<usize>>>> {
        let bad = |i: usize, detail: String| {
            Error::format(&self.origin, format!("layer {i} ({}): {detail}", self.layers[i].type_name()))
        };
        let mut named: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        let mut shared: Vec<(&str, usize, usize)> = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            if let Some(name) = l.name() {
                if name == INPUT_NAME {
                    return Err(bad(
                        i,
                        format!("the name '{INPUT_NAME}' is the model input's: give the layer another"),
                    ));
                }
                // Two layers may share a name that prefixes different tensors (nanoGPT's
                // block is two residual blocks, both `transformer.h.0`); an inbound that
                // names it is refused below, as it could mean either.
                if let Some(j) = named.insert(name, i) {
                    shared.push((name, j, i));
                }
            }
        }
        self.inbound
            .iter()
            .enumerate()
            .map(|(i, inbound)| match inbound {
                None => Ok(vec![i.checked_sub(1)]),
                Some(names) => names
                    .iter()
                    .map(|n| match (n.as_str(), named.get(n.as_str())) {
                        (INPUT_NAME, _) => Ok(None),
                        (_, Some(_)) if shared.iter().any(|(s, _, _)| s == n) => {
                            let (_, j, k) = shared.iter().find(|(s, _, _)| s == n).expect("found");
                            Err(bad(i, format!("inbound names '{n}', which layers {j} and {k} are both named: give each its own name")))
                        }
                        (_, Some(&j)) => Ok(Some(j)),
                        (_, None) => Err(bad(
                            i,
                            format!(
                                "inbound names '{n}', which no layer of the spec is named (the named layers: {}; the model's input: '{INPUT_NAME}')",
                                if named.is_empty() {
                                    "none".to_string()
                                } else {
                                    let mut all: Vec<_> = named.keys().copied().collect();
                                    all.sort_unstable();
                                    all.join(", ")
                                }
                            ),
                        )),
                    })
                    .collect(),
            })
            .collect()
    }

    /// The order the layers run in: the spec's own, but that a layer runs after every
    /// layer it reads (an `inbound` may name a later layer); a cycle is refused, naming its
    /// layers.
    fn order(&self, wiring: &[Vec<Option<usize>>]) -> Result<Vec<usize>> {
        let n = self.layers.len();
        let mut waiting: Vec<usize> = wiring.iter().map(|w| w.iter().flatten().count()).collect();
        let mut readers: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, w) in wiring.iter().enumerate() {
            for &j in w.iter().flatten() {
                readers[j].push(i);
            }
        }
        // The ready layer of the lowest index first: a spec in order runs in its order.
        let mut ready: std::collections::BTreeSet<usize> = (0..n).filter(|&i| waiting[i] == 0).collect();
        let mut order = Vec::with_capacity(n);
        while let Some(i) = ready.pop_first() {
            order.push(i);
            for &r in &readers[i] {
                waiting[r] -= 1;
                if waiting[r] == 0 {
                    ready.insert(r);
                }
            }
        }
        if order.len() < n {
            // Follow inbound links among the layers left until one repeats: a cycle.
            let left: Vec<bool> = (0..n).map(|i| waiting[i] > 0).collect();
            let mut at = (0..n).find(|&i| left[i]).expect("a layer is left");
            let mut path = Vec::new();
            while !path.contains(&at) {
                path.push(at);
                at = wiring[at].iter().flatten().copied().find(|&j| left[j]).expect("a left layer reads a left layer");
            }
            let start = path.iter().position(|&p| p == at).expect("the repeat is on the path");
            let name = |i: usize| match self.layers[i].name() {
                Some(n) => format!("layer {i} ('{n}')"),
                None => format!("layer {i}"),
            };
            let mut cycle: Vec<String> = path[start..].iter().map(|&i| name(i)).collect();
            cycle.push(name(at));
            return Err(Error::format(
                &self.origin,
                format!(
                    "the layers' inbound names make a cycle: {} (a layer may only read layers that do not read it back)",
                    cycle.join(", which reads ")
                ),
            ));
        }
        Ok(order)
    }

    /// The graph's nodes, built one layer object at a time against its inputs' shapes
    /// (batch of 2, as `Graph` checks them), in the order they run, each problem named by
    /// its spec index.
    fn nodes_checked(&self) -> Result<Vec<GraphNode>> {
        let bad = |i: usize, detail: String| {
            Error::format(&self.origin, format!("layer {i} ({}): {detail}", self.layers[i].type_name()))
        };
        let per_sample: usize =
            self.input_shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).unwrap_or(usize::MAX);
        if per_sample > MAX_ELEMENTS {
            return Err(Error::format(
                &self.origin,
                format!("field 'input_shape' {:?} has more than {MAX_ELEMENTS} values", self.input_shape),
            ));
        }
        let wiring = self.wiring()?;
        let order = self.order(&wiring)?;
        let mut read = vec![false; self.layers.len()];
        for &j in wiring.iter().flatten().flatten() {
            read[j] = true;
        }
        let last = self.layers.len() - 1;
        if let Some(i) = (0..last).find(|&i| !read[i]) {
            return Err(bad(
                i,
                format!(
                    "its output is read by no layer, and only the last layer's (layer {last}) is the model's: remove it, or name it in a later layer's inbound"
                ),
            ));
        }
        if order.last() != Some(&last) {
            return Err(bad(last, "the last layer is the model's output, so no layer may read it".into()));
        }
        let mut dims = vec![2];
        dims.extend_from_slice(&self.input_shape);
        let input = Shape::new(dims);
        let mut total_params = 0usize;
        // Per layer object: its last node (what a reader of it reads) and that node's
        // output shape (batch of 2).
        let mut ends: Vec<Option<(usize, Shape)>> = vec![None; self.layers.len()];
        let mut nodes: Vec<GraphNode> = Vec::new();
        for &i in &order {
            let l = &self.layers[i];
            // An embedding looks its input up as token ids, which only the model's input
            // is: after any layer (a layer_norm, a dropout) they would be floats, and the
            // first step would fail on them.
            if l.type_name() == "embedding" && wiring[i] != [None] {
                return Err(bad(
                    i,
                    "an embedding reads token ids, which only the model's input holds: it must read the input (be layer 0, or name 'input' as its inbound)".into(),
                ));
            }
            let (mut sources, mut shapes) = (Vec::new(), Vec::new());
            for w in &wiring[i] {
                match w {
                    None => {
                        sources.push(Source::Input(0));
                        shapes.push(input.clone());
                    }
                    Some(j) => {
                        let (node, shape) = ends[*j].clone().expect("the order runs a layer after those it reads");
                        sources.push(Source::Node(node));
                        shapes.push(shape);
                    }
                }
            }
            let built = l.build_many(&shapes).map_err(|e| {
                let ins = match wiring[i].as_slice() {
                    [_] => String::new(),
                    w => format!(
                        " (its inputs: {})",
                        w.iter()
                            .zip(&shapes)
                            .map(|(w, s)| {
                                let from = match w {
                                    None => INPUT_NAME.to_string(),
                                    Some(j) => match self.layers[*j].name() {
                                        Some(n) => format!("'{n}'"),
                                        None => format!("layer {j}"),
                                    },
                                };
                                format!("{from} {}", Shape::new(&s.dims()[1..]))
                            })
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                };
                bad(i, format!("{e}{ins}"))
            })?;
            let mut shape = shapes;
            for (name, layer) in built {
                // Parameter counts first, with checked arithmetic: `Shape::numel` of an
                // absurd kernel would overflow.
                for p in layer.params().iter().chain(&layer.buffers()) {
                    let n = p.shape.dims().iter().try_fold(1usize, |a, &d| a.checked_mul(d));
                    total_params = n.and_then(|n| total_params.checked_add(n)).unwrap_or(usize::MAX);
                    if total_params > MAX_ELEMENTS {
                        return Err(bad(i, format!("the model would have more than {MAX_ELEMENTS} parameters")));
                    }
                }
                let out = layer.output_shape_many(&shape).map_err(|e| bad(i, e.to_string()))?;
                let per: Option<usize> = out.dims()[1..].iter().try_fold(1usize, |a, &d| a.checked_mul(d));
                if !matches!(per, Some(p) if p <= MAX_ELEMENTS) {
                    return Err(bad(i, format!("its output has more than {MAX_ELEMENTS} values per sample")));
                }
                nodes.push(GraphNode { name, layer, inputs: sources });
                sources = vec![Source::Node(nodes.len() - 1)];
                shape = vec![out];
            }
            ends[i] = Some((nodes.len() - 1, shape.pop().expect("one output")));
        }
        Ok(nodes)
    }
}

/// A key given twice, named as the spec's other errors name its place: `layer 1
/// (dense): field 'units' is given twice`, `layer 0 (residual): layers[1] (dense): ...`.
/// `value` is the spec as serde_json read it (the last of the two values kept), which
/// gives each layer object on the path its type.
fn duplicate_words(dup: &crate::json_keys::Duplicate, value: &Value) -> String {
    use crate::json_keys::Step;
    let mut words = Vec::new();
    let mut here = value;
    let mut steps = dup.path.as_slice();
    // Layer lists: the top level's `layers` (layer i), a container's (layers[j]).
    let mut list: Option<String> = None;
    loop {
        match (steps, list.as_deref()) {
            ([Step::Key(k), Step::Index(i), rest @ ..], at) if k == "layers" || (at.is_some() && k == "shortcut") => {
                let object = &here[k.as_str()][*i];
                let at = if at.is_none() { format!("layer {i}") } else { format!("{k}[{i}]") };
                // The last step's object holds the duplicate: name its type unless the
                // duplicate is the type itself.
                let kind =
                    object.get("type").and_then(Value::as_str).filter(|_| !(rest.is_empty() && dup.key == "type"));
                words.push(match kind {
                    Some(kind) => format!("{at} ({kind})"),
                    None => at.clone(),
                });
                list = Some(at);
                here = object;
                steps = rest;
            }
            _ => break,
        }
    }
    let key = match steps {
        [] => format!("field '{}' is given twice", dup.key),
        [Step::Key(field), ..] => format!("field '{field}': key '{}' is given twice", dup.key),
        [Step::Index(_), ..] => format!("key '{}' is given twice", dup.key),
    };
    words.push(key);
    words.join(": ")
}

/// Reads layer `i`'s object: the layer, and its `inbound` (the names it reads) if given.
fn parse_layer(i: usize, v: &Value) -> std::result::Result<(LayerSpec, Option<Vec<String>>), String> {
    let mut v = v.clone();
    let inbound = match v.as_object_mut().and_then(|m| m.remove("inbound")) {
        None | Some(Value::Null) => None,
        Some(Value::Array(names)) if !names.is_empty() && names.len() <= 64 => Some(
            names
                .iter()
                .map(|n| n.as_str().map(str::to_string))
                .collect::<Option<Vec<String>>>()
                .ok_or_else(|| format!("layer {i}: field 'inbound' must be a list of layer names (got {names:?})"))?,
        ),
        Some(other) => {
            return Err(format!(
                "layer {i}: field 'inbound' must be a non-empty list of at most 64 layer names, e.g. [\"conv0\", \"input\"] (got {other})"
            ))
        }
    };
    Ok((read_layer(&v, &format!("layer {i}"))?, inbound))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Sequential;

    fn err(text: &str) -> String {
        ModelSpec::parse(text, "m.json").expect_err("expected an error").to_string()
    }

    fn with_layers(layers: &str) -> String {
        format!(r#"{{"input_shape": [1, 8, 8], "layers": [{layers}]}}"#)
    }

    #[test]
    fn the_docs_and_the_guide_list_every_layer_type_and_no_page_lists_a_part() {
        // The guide's command-line chapter holds the table; any other page (the README
        // included) that lists a layer type must list them all, so that no copy goes stale.
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut pages = vec![root.join("README.md")];
        for entry in std::fs::read_dir(root.join("docs")).unwrap().map(|e| e.unwrap().path()) {
            if entry.extension().is_some_and(|x| x == "md") {
                pages.push(entry);
            }
        }
        let rows: Vec<String> = LAYER_TYPES.iter().map(|t| format!("| `{}` | {} |", t.name, t.fields)).collect();
        let listed = |text: &str| {
            LAYER_TYPES.iter().filter(|t| text.lines().any(|l| l.starts_with(&format!("| `{}` |", t.name)))).count()
        };
        for page in &pages {
            let text = std::fs::read_to_string(page).unwrap();
            let guide = page.ends_with("docs/command-line.md");
            if listed(&text) == 0 && !guide {
                continue;
            }
            for row in &rows {
                assert!(
                    text.contains(&format!("\n{row}\n")),
                    "{} lists layer types but not this row (or not as model::LAYER_TYPES states it):\n{row}",
                    page.display()
                );
            }
        }
        let guide = std::fs::read_to_string(root.join("docs/command-line.md")).unwrap();
        let rows_after = guide.split("| type | fields (default) |\n|---|---|\n").nth(1).expect("the guide's table");
        let table = rows_after.lines().take_while(|l| l.starts_with("| `")).count();
        assert_eq!(table, LAYER_TYPES.len(), "the guide's table lists a type LAYER_TYPES does not have");
    }

    #[test]
    fn a_spec_is_a_graph_when_its_layers_name_their_inbound() {
        // Layer 0 reads layer 1, which comes after it in the list: they run 1, 0, 2.
        let text = r#"{"input_shape": [3], "layers": [
            {"type": "dense", "units": 4, "name": "a", "inbound": ["c"]},
            {"type": "relu", "name": "c", "inbound": ["input"]},
            {"type": "dense", "units": 2, "inbound": ["a"]}]}"#;
        let m = model_from_spec_str(text, "g.json").unwrap();
        assert_eq!(m.layer_names(), ["c", "a", "dense0"]);
        assert_eq!(m.output_shape().dims(), &[2]);
        // Written back, it builds the same model (a chain now, so no inbound is written).
        let again = model_from_spec_str(&model_to_spec(&m).unwrap().to_string(), "again").unwrap();
        assert_eq!(again.layer_names(), m.layer_names());
        assert_eq!(again.param_infos(), m.param_infos());
    }

    #[test]
    fn bad_graph_specs_are_refused_naming_the_layers() {
        let graph = |layers: &str| format!(r#"{{"input_shape": [3], "layers": [{layers}]}}"#);
        // An inbound name that no layer has.
        let e = err(&graph(r#"{"type": "relu", "name": "a"}, {"type": "dense", "units": 2, "inbound": ["b"]}"#));
        assert!(e.contains("layer 1 (dense): inbound names 'b', which no layer of the spec is named (the named layers: a; the model's input: 'input')"), "{e}");
        // A cycle, through a name that refers forward.
        let e = err(&graph(
            r#"{"type": "relu", "name": "a", "inbound": ["b"]}, {"type": "relu", "name": "b", "inbound": ["a"]},
               {"type": "dense", "units": 2, "inbound": ["b"]}"#,
        ));
        assert!(e.contains("make a cycle: layer 0 ('a'), which reads layer 1 ('b'), which reads layer 0 ('a')"), "{e}");
        // Two layers of one name that an inbound names; the input's name taken.
        let e = err(&graph(
            r#"{"type": "relu", "name": "a"}, {"type": "relu", "name": "a"}, {"type": "dense", "units": 2, "inbound": ["a"]}"#,
        ));
        assert!(e.contains("layer 2 (dense): inbound names 'a', which layers 0 and 1 are both named"), "{e}");
        let e = err(&graph(r#"{"type": "relu", "name": "input"}"#));
        assert!(e.contains("the name 'input' is the model input's"), "{e}");
        // A layer whose output nothing reads.
        let e = err(&graph(
            r#"{"type": "relu", "name": "a"}, {"type": "dense", "units": 4}, {"type": "dense", "units": 2, "inbound": ["a"]}"#,
        ));
        assert!(
            e.contains(
                "layer 1 (dense): its output is read by no layer, and only the last layer's (layer 2) is the model's"
            ),
            "{e}"
        );
        // An inbound that is not a list of names.
        let e = err(&graph(r#"{"type": "relu", "inbound": "input"}"#));
        assert!(e.contains("layer 0: field 'inbound' must be a non-empty list of at most 64 layer names"), "{e}");
    }

    #[test]
    fn max_pooling2d_defaults_are_keras_and_errors_name_the_field() {
        // Keras MaxPooling2D(): pool_size (2, 2), strides = pool_size, "valid".
        let m = model_from_spec_str(&with_layers(r#"{"type": "max_pooling2d"}"#), "m.json").unwrap();
        let pool = json!({"type": "max_pooling2d", "pool_size": [2, 2], "strides": [2, 2], "padding": "valid"});
        assert_eq!(m.layers()[0].spec(), Some(pool));
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
        let pool = json!({"type": "max_pooling2d", "pool_size": [3, 2], "strides": [3, 2], "padding": "same"});
        assert_eq!(m.layers()[0].spec(), Some(pool));
        assert_eq!(m.output_shape().dims(), &[1, 3, 4]);
        let pool = |extra: &str| with_layers(&format!(r#"{{"type": "relu"}}, {{"type": "max_pooling2d", {extra}}}"#));
        assert_eq!(
            err(&pool(r#""pool_size": 0"#)),
            "m.json: layer 1 (max_pooling2d): field 'pool_size' must be a positive integer, at most 1048576 (got 0)"
        );
        assert!(err(&pool(r#""strides": [1]"#)).contains("layer 1 (max_pooling2d): field 'strides' must be"));
        assert!(err(&pool(r#""padding": "causal""#)).contains("field 'padding' must be \"valid\", \"same\", or pads"));
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
    fn a_layer_of_the_users_own_has_no_spec_form() {
        let model = Sequential::new(
            [3],
            vec![Box::new(crate::nn::Linear::new(3, 2)) as Box<dyn crate::nn::Layer>, Box::new(crate::ops::CpuOnly)],
        )
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
        // Quoted as written: 2^64 − 1 went through f64 and printed as …616.
        assert!(err(&conv(r#""filters": 18446744073709551615, "kernel_size": 3"#))
            .contains("field 'filters' is 18446744073709551615, above the limit"));
        // Past u64 serde reads an f64: its shortest form as JSON writes it, not
        // 99999999999999991611392.
        assert!(err(&conv(r#""filters": 99999999999999999999999, "kernel_size": 3"#))
            .contains("field 'filters' is 1e+23, above the limit"));
        assert!(err(&conv(r#""filters": -2, "kernel_size": 3"#)).contains("field 'filters' must be a positive integer"));
        assert!(err(&conv(r#""filters": 2.5, "kernel_size": 3"#)).contains("(got 2.5)"));
        assert!(err(&conv(r#""kernel_size": 3"#)).contains("layer 1 (conv2d): missing field 'filters'"));
        assert!(err(&conv(r#""filters": 2, "kernel_size": [3]"#))
            .contains("field 'kernel_size' must be a positive integer or a list of two (got [3])"));
        assert!(err(&conv(r#""filters": 2, "kernel_size": 3, "strides": [1, 2]"#)).contains("only equal strides"));
        assert!(err(&conv(r#""filters": 2, "kernel_size": 3, "padding": "causal""#))
            .contains("field 'padding' must be \"valid\", \"same\", or pads"));
        assert!(err(&conv(r#""filters": 2, "kernel_size": 3, "activation": "softmax""#))
            .contains("field 'activation' must be \"relu\" or \"linear\""));
        assert!(err(&conv(r#""filters": 2, "kernel_size": 3, "use_bias": 1"#))
            .contains("field 'use_bias' must be true or false (got 1)"));
        assert_eq!(
            err(&conv(r#""filters": 2, "kernel_size": 3, "filter": 3"#)),
            "m.json: layer 1 (conv2d): unknown field 'filter' (expected one of: type, filters, kernel_size, strides, padding, use_bias, activation, groups)"
        );
        assert!(err(&with_layers(r#"{"type": "relu", "alpha": 0.1}"#))
            .contains("layer 0 (relu): unknown field 'alpha' (this layer takes none)"));
        assert!(err(&with_layers(r#"{"type": "dropout", "rate": 1}"#))
            .contains("layer 0 (dropout): field 'rate' must be a number in [0, 1) (got 1)"));
        assert!(err(&with_layers(r#"{"type": "batch_normalization", "epsilon": 0}"#))
            .contains("field 'epsilon' must be a positive number"));
        assert!(err(&with_layers(r#"{"type": "rescaling"}"#)).contains("layer 0 (rescaling): missing field 'scale'"));
        // 1e300 is a finite f64 that no f32 holds: out of range, not "not finite".
        assert!(err(&with_layers(r#"{"type": "rescaling", "scale": 1e300}"#)).contains(
            "field 'scale' is out of range (got 1e+300): it overflows f32, whose largest magnitude is 3.4028235e38"
        ));
        assert!(err(&with_layers(r#"{"type": "dense", "units": 2, "init_std": 1e39}"#))
            .contains("field 'init_std' is out of range (got 1e+39): it overflows f32"));
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

    /// Issue 41: a layer_norm before the embedding passed validation and failed at the
    /// first step, on ids it had turned into floats.
    #[test]
    fn an_embedding_after_another_layer_is_refused_at_validation() {
        let spec = |layers: &str| format!(r#"{{"input_shape": [16], "layers": [{layers}]}}"#);
        let embedding = r#"{"type": "embedding", "vocab": 256, "width": 8}"#;
        assert_eq!(
            err(&spec(&format!(r#"{{"type": "layer_norm"}}, {embedding}, {{"type": "dense", "units": 256}}"#))),
            "m.json: layer 1 (embedding): an embedding reads token ids, which only the model's input holds: it must read the input (be layer 0, or name 'input' as its inbound)"
        );
        // First, it builds.
        assert!(
            ModelSpec::parse(&spec(&format!(r#"{embedding}, {{"type": "dense", "units": 256}}"#)), "m.json").is_ok()
        );
    }

    #[test]
    fn a_key_given_twice_is_refused_naming_the_key_and_the_layer() {
        // Issue 19: `"units":10,"units":5` silently kept the last value.
        assert_eq!(
            err(&with_layers(r#"{"type": "flatten"}, {"type": "dense","units":10,"units":5}"#)),
            "m.json: layer 1 (dense): field 'units' is given twice"
        );
        // Inside a container, the nested object is named as its other errors name it.
        assert_eq!(
            err(
                r#"{"input_shape": [4], "layers": [{"type": "residual", "layers": [{"type": "relu"}, {"type": "dense", "units": 4, "use_bias": true, "use_bias": false}]}]}"#
            ),
            "m.json: layer 0 (residual): layers[1] (dense): field 'use_bias' is given twice"
        );
        // Two types: neither is the layer's.
        assert_eq!(
            err(&with_layers(r#"{"type": "relu"}, {"type": "dense", "type": "relu"}"#)),
            "m.json: layer 1: field 'type' is given twice"
        );
        // A key of a field's own object, and the top level's.
        assert_eq!(
            err(&with_layers(r#"{"type": "conv2d", "filters": 1, "kernel_size": 1, "padding": {"a": 1, "a": 2}}"#)),
            "m.json: layer 0 (conv2d): field 'padding': key 'a' is given twice"
        );
        assert_eq!(
            err(r#"{"input_shape": [2], "layers": [{"type": "relu"}], "input_shape": [3]}"#),
            "m.json: field 'input_shape' is given twice"
        );
        // A syntax error after a duplicate is the syntax error.
        assert!(err(r#"{"input_shape": [2], "input_shape": [3], "layers": ["#).contains("not a valid model spec: EOF"));
    }

    #[test]
    fn shape_errors_name_the_layer() {
        assert_eq!(
            err(&with_layers(r#"{"type": "dense", "units": 3}"#)),
            "m.json: layer 0 (dense): expects flat samples (F,) or sequences (T, F), got (1, 8, 8); add a flatten or global_average_pooling2d layer before it"
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
