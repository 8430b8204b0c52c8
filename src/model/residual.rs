//! The residual block, `y = act(body(x) + shortcut(x))` (He et al. 2016), as a way of
//! writing a graph: [`residual`] writes the body's nodes, then the shortcut's (none for
//! the identity), then an `add` node reading both and, for `"activation": "relu"`, a ReLU
//! node. Nothing here runs: the graph runs the block's nodes as it runs any (its backward
//! meets the shortcut before the body, so `dx = dshortcut + dbody`, one addition a value;
//! a ReLU after an add whose output nothing else reads runs in the add's passes on the
//! CPU, as after a BatchNorm: `Add::take_following_relu`). Also the spec's `residual`
//! entry, which builds the same nodes from its layer objects ([`Residual::SPEC`]).
//!
//! Owns the block's names and the indices its nodes' contexts carry:
//! - names: the body's and the shortcut's nodes are named by their caller (a spec's block
//!   names them `<block>.<layer>`, its shortcut's layers `<block>.shortcut.<kind><n>`
//!   unless given names, as `short.0`); the add is `<block>.add` and the ReLU
//!   `<block>.relu`, numbered on (`add1`, ...) where an earlier node has the name
//!   (nanoGPT's `Block` is two blocks, both `transformer.h.0`). The tensors are the
//!   nodes' (`blocks.1.conv1.weight`, `blocks.1.short.0.weight`), laid out in node order:
//!   the body's, then the shortcut's.
//! - indices (`Ctx::layer_index`, which dropout's masks derive from): the block takes the
//!   index a node written in its place would take, and its nodes take indices derived
//!   from it, the branch (0 the body, 1 the shortcut) and their position in the branch
//!   ([`branch_index`]); the add and the ReLU take the block's. The model's other nodes
//!   are numbered counting a block as one. These are the indices of the block's layers
//!   when it was a container layer of its own, so that a model trains to the same bits
//!   with dropout as before (a spec written back by `spec::model_to_spec` lists the
//!   nodes one by one, and its nodes take their positions).

pub use super::functional::branch_index;
use super::functional::Value;
use super::spec_objects::{read_layers, LayerObject};
use crate::error::Result;
use crate::ops::spec::{Activation, Build, Built, LayerType, Part, PartInput};
use crate::ops::{Add, Relu, RELU_KIND};
use crate::tensor::Shape;

/// The branch of the body, and of the shortcut, for [`branch_index`].
pub const BODY: u64 = 0;
pub const SHORTCUT: u64 = 1;

/// The identity, a block's shortcut without layers.
pub fn identity(x: &Value) -> Result<Value> {
    Ok(x.clone())
}

/// Writes the block `act(body(x) + shortcut(x))` after `x`: the nodes `body` writes, those
/// `shortcut` writes (in this order: the flat layout and the initial weights follow it),
/// the add, named `<name>.add`, and with [`Activation::Relu`] a ReLU, `<name>.relu`.
/// The output's value. Branches whose outputs differ in shape are refused when the model
/// is built, by the add.
///
/// ```
/// use lockstep::nn::{identity, residual, Activation, Call, Linear, Relu, Value};
/// # fn main() -> lockstep::Result<()> {
/// let x = Value::input([8]);
/// let y = residual(&x, "block", |x| Ok(Linear::new(8, 8).named("block.dense").call(&Relu::new().call(x))), identity, Activation::Linear)?;
/// let model = y.model()?;
/// assert_eq!(model.layer_names(), ["relu0", "block.dense", "block.add"]);
/// # Ok(())
/// # }
/// ```
pub fn residual(
    x: &Value,
    name: &str,
    body: impl FnOnce(&Value) -> Result<Value>,
    shortcut: impl FnOnce(&Value) -> Result<Value>,
    activation: Activation,
) -> Result<Value> {
    let index = x.take_index();
    let y = x.in_branch(index, BODY, || body(x))?;
    let skip = x.in_branch(index, SHORTCUT, || shortcut(x))?;
    let fresh = |base: String| numbered(base, |n| x.name_taken(n));
    let sum = Value::node_at(Some(fresh(format!("{name}.add"))), Box::new(Add::new()), &[&y, &skip], Some(index));
    Ok(match activation {
        Activation::Linear => sum,
        Activation::Relu => {
            Value::node_at(Some(fresh(format!("{name}.{RELU_KIND}"))), Box::new(Relu::new()), &[&sum], Some(index))
        }
    })
}

/// `base`, or the first of `base1`, `base2`, ... that is not `taken`.
pub(crate) fn numbered(base: String, taken: impl Fn(&str) -> bool) -> String {
    if !taken(&base) {
        return base;
    }
    (1..).map(|k| format!("{base}{k}")).find(|n| !taken(n)).expect("a free number")
}

/// The prefix of a shortcut's layers named by kind.
const SHORTCUT_PREFIX: &str = "shortcut.";

/// The spec's residual block: [`Residual::SPEC`].
pub struct Residual;

impl Residual {
    /// The spec entry: `{"type": "residual", "layers": [...], "shortcut": [...],
    /// "activation": "relu"}`, its branches' input the running shape; it builds the nodes
    /// [`residual`] writes, named under the block's name (given, or `residual<n>`).
    pub const SPEC: LayerType = LayerType {
        name: "residual",
        fields: "`layers` (the body), `shortcut` (none: the identity), `activation` (\"linear\")",
        example: (
            &[2, 6, 6],
            r#"{"type": "residual", "layers": [{"type": "conv2d", "filters": 3, "kernel_size": 3, "strides": 2, "padding": 1, "use_bias": false}, {"type": "batch_normalization"}, {"type": "relu"}, {"type": "conv2d", "filters": 3, "kernel_size": 3, "padding": "same"}], "shortcut": [{"type": "conv2d", "filters": 3, "kernel_size": 1, "strides": 2}], "activation": "relu"}"#,
        ),
        parse: |f| {
            let body = read_layers(f, "layers", true)?;
            let shortcut = read_layers(f, "shortcut", false)?;
            let activation = f.activation()?;
            if body.is_empty() {
                return Err("field 'layers' is empty: the body needs at least one layer".into());
            }
            Ok(Build::parts(move |input| block_parts(input, &body, &shortcut, activation)))
        },
        #[cfg(feature = "cuda")]
        kernels: None,
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Values,
            #[cfg(feature = "cuda")]
            host: None,
        },
    };
}

/// The nodes of a spec's block over inputs of `input` (batch included), its problems
/// named by their place in the block (`layers[1] (conv2d): ...`).
fn block_parts(
    input: &Shape,
    body: &[LayerObject],
    shortcut: &[LayerObject],
    activation: Activation,
) -> Result<Vec<Part>, String> {
    let mut parts = Vec::new();
    let (body_end, body_out) = branch(&mut parts, input, body, "layers", "", BODY)?;
    let (skip_end, skip_out) = branch(&mut parts, input, shortcut, "shortcut", SHORTCUT_PREFIX, SHORTCUT)?;
    let per = |s: &Shape| Shape::new(&s.dims()[1..]);
    let per_sample = per(input);
    if !shortcut.is_empty() && per_sample.dims().len() != 3 {
        return Err(format!("a shortcut of layers needs images (C, H, W) in, got samples of shape {per_sample}"));
    }
    let (skip, what) = match shortcut.is_empty() {
        true => (per_sample, "input (the identity shortcut)"),
        false => (per(&skip_out), "shortcut's output"),
    };
    let body = per(&body_out);
    if body != skip {
        return Err(format!("the body's output {body} differs from the {what} {skip}: they are added"));
    }
    let fresh = |parts: &[Part], base: &str| numbered(base.to_string(), |n| parts.iter().any(|p| p.name == n));
    let add = fresh(&parts, "add");
    parts.push(Part { name: add, layer: Box::new(Add::new()), inputs: vec![body_end, skip_end], path: vec![] });
    if activation == Activation::Relu {
        let relu = fresh(&parts, RELU_KIND);
        let sum = PartInput::Part(parts.len() - 1);
        parts.push(Part { name: relu, layer: Box::new(Relu::new()), inputs: vec![sum], path: vec![] });
    }
    Ok(parts)
}

/// Appends the nodes of one branch's layer objects to `parts`, reading the block's input:
/// each named as given or by kind (after `auto_prefix`) among the branch's unnamed, at
/// position `i` of branch `branch`; a nested block's nodes under its name, at its one
/// position. The branch's last node (the block's input for an empty one) and its output
/// shape.
fn branch(
    parts: &mut Vec<Part>,
    input: &Shape,
    objects: &[LayerObject],
    what: &str,
    auto_prefix: &str,
    branch: u64,
) -> Result<(PartInput, Shape), String> {
    let (mut at, mut shape) = (PartInput::Input, input.clone());
    let mut counts = std::collections::HashMap::new();
    let mut auto = |given: Option<&str>, kind: &'static str| match given {
        Some(n) => n.to_string(),
        None => {
            let n = counts.entry(kind).or_insert(0);
            *n += 1;
            format!("{auto_prefix}{kind}{}", *n - 1)
        }
    };
    let mut position = 0;
    for (j, o) in objects.iter().enumerate() {
        let err = |e: String| format!("{what}[{j}] ({}): {e}", o.type_name());
        match o.built(std::slice::from_ref(&shape)).map_err(err)? {
            Built::Layers(layers) => {
                for (k, layer) in layers.into_iter().enumerate() {
                    let name = auto(if k == 0 { o.name() } else { None }, layer.kind());
                    shape = layer.output_shape(&shape).map_err(|e| err(e.to_string()))?;
                    parts.push(Part { name, layer, inputs: vec![at], path: vec![(branch, position)] });
                    at = PartInput::Part(parts.len() - 1);
                    position += 1;
                }
            }
            Built::Parts(inner) => {
                let name = auto(o.name(), o.type_name());
                let base = parts.len();
                let mut shapes: Vec<Shape> = Vec::with_capacity(inner.len());
                for p in inner {
                    let ins: Vec<Shape> = p
                        .inputs
                        .iter()
                        .map(|i| match i {
                            PartInput::Input => shape.clone(),
                            PartInput::Part(k) => shapes[*k].clone(),
                        })
                        .collect();
                    shapes.push(p.layer.output_shape_many(&ins).map_err(|e| err(e.to_string()))?);
                    let inputs = p
                        .inputs
                        .iter()
                        .map(|i| match i {
                            PartInput::Input => at,
                            PartInput::Part(k) => PartInput::Part(base + k),
                        })
                        .collect();
                    let path = std::iter::once((branch, position)).chain(p.path).collect();
                    parts.push(Part { name: format!("{name}.{}", p.name), layer: p.layer, inputs, path });
                }
                shape = shapes.pop().expect("a block has nodes");
                at = PartInput::Part(parts.len() - 1);
                position += 1;
            }
        }
    }
    Ok((at, shape))
}

/// The index a part at `path` inside an object of index `index` carries.
pub(crate) fn part_index(index: usize, path: &[(u64, usize)]) -> usize {
    path.iter().fold(index, |block, &(branch, i)| branch_index(block, branch, i))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Graph;
    use crate::nn::{BatchNorm2d, Call, Conv2d, Dropout, Padding};
    use crate::ops::{Ctx, Mode};
    use crate::tensor::{Device, Tensor};

    fn conv(c: usize, o: usize, k: usize, s: usize, p: usize) -> Conv2d {
        Conv2d::new(c, o, (k, k), s, Padding::Explicit(p, p), false).unwrap()
    }

    /// A model of `blocks` copies of the spec's example block (input (2, 6, 6)).
    fn spec_example(blocks: usize) -> Graph {
        let (input, layer) = Residual::SPEC.example;
        let layers = vec![layer; blocks].join(", ");
        let text = format!(r#"{{"input_shape": {input:?}, "layers": [{layers}]}}"#);
        crate::spec::model_from_spec_str(&text, "example").unwrap()
    }

    #[test]
    fn a_spec_block_is_its_nodes_named_under_it() {
        let model = spec_example(2);
        let names: Vec<&str> = model.layer_names().iter().map(String::as_str).collect();
        let block =
            |b: &str| ["conv0", "bn0", "relu0", "conv1", "shortcut.conv0", "add", "relu"].map(|n| format!("{b}.{n}"));
        let want: Vec<String> = block("residual0").into_iter().chain(block("residual1")).collect();
        assert_eq!(names, want);
        let tensors: Vec<&str> = model.param_infos().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            &tensors[..5],
            [
                "residual0.conv0.weight",
                "residual0.bn0.gamma",
                "residual0.bn0.beta",
                "residual0.conv1.weight",
                "residual0.conv1.bias"
            ]
        );
        assert_eq!(tensors[5], "residual0.shortcut.conv0.weight");
        // The indices of the block's layers as a container: block 0 and block 1, the
        // body's positions 0..4 and the shortcut's 0; the add and the ReLU the block's.
        let want: Vec<usize> = [0, 1]
            .into_iter()
            .flat_map(|b| {
                let body = (0..4).map(move |i| branch_index(b, BODY, i));
                body.chain([branch_index(b, SHORTCUT, 0), b, b])
            })
            .collect();
        assert_eq!((0..model.layers().len()).map(|j| model.layer_index(j)).collect::<Vec<_>>(), want);
    }

    #[test]
    fn the_builder_writes_what_the_spec_builds() {
        // The same block written with the builder: the same nodes, names, wiring, indices
        // and tensors as the spec's.
        let spec = spec_example(1);
        let x = Value::input([2, 6, 6]);
        let y = residual(
            &x,
            "residual0",
            |x| {
                let y = conv(2, 3, 3, 2, 1).named("residual0.conv0").call(x);
                let y = BatchNorm2d::new(3).named("residual0.bn0").call(&y);
                let y = Relu::new().named("residual0.relu0").call(&y);
                let c = Conv2d::new(3, 3, (3, 3), 1, Padding::Same, true)?;
                Ok(c.named("residual0.conv1").call(&y))
            },
            |x| Ok(Conv2d::new(2, 3, (1, 1), 2, Padding::Valid, true)?.named("residual0.shortcut.conv0").call(x)),
            Activation::Relu,
        )
        .unwrap();
        let built = y.model().unwrap();
        assert_eq!(built.layer_names(), spec.layer_names());
        assert_eq!(built.sources(), spec.sources());
        assert_eq!(built.param_infos(), spec.param_infos());
        let indices = |m: &Graph| (0..m.layers().len()).map(|j| m.layer_index(j)).collect::<Vec<_>>();
        assert_eq!(indices(&built), indices(&spec));
    }

    #[test]
    fn a_nested_blocks_nodes_take_the_indices_of_its_place() {
        // A dropout inside a block inside a block, as the containers numbered it: the
        // outer block at 1 (after a ReLU), the inner at the body's position 1, the
        // dropout at the inner body's position 0; the dense after the blocks at 2.
        let text = r#"{"input_shape": [4], "layers": [{"type": "relu"},
            {"type": "residual", "name": "outer", "layers": [{"type": "dense", "units": 4},
                {"type": "residual", "layers": [{"type": "dropout", "rate": 0.5}]}]},
            {"type": "dense", "units": 2}]}"#;
        let model = crate::spec::model_from_spec_str(text, "nested").unwrap();
        let names: Vec<&str> = model.layer_names().iter().map(String::as_str).collect();
        assert_eq!(
            names,
            ["relu0", "outer.dense0", "outer.residual0.dropout0", "outer.residual0.add", "outer.add", "dense0"]
        );
        let inner = branch_index(1, BODY, 1);
        let want = [0, branch_index(1, BODY, 0), branch_index(inner, BODY, 0), inner, 1, 2];
        assert_eq!((0..names.len()).map(|j| model.layer_index(j)).collect::<Vec<_>>(), want);
        // The builder numbers alike.
        let x = Value::input([4]);
        let x = Relu::new().call(&x);
        let y = residual(
            &x,
            "outer",
            |x| {
                let d = crate::nn::Linear::new(4, 4).named("outer.dense0").call(x);
                let drop = |x: &Value| Ok(Dropout::new(0.5)?.named("outer.residual0.dropout0").call(x));
                residual(&d, "outer.residual0", drop, identity, Activation::Linear)
            },
            identity,
            Activation::Linear,
        )
        .unwrap();
        let model = crate::nn::Linear::new(4, 2).call(&y).model().unwrap();
        assert_eq!((0..names.len()).map(|j| model.layer_index(j)).collect::<Vec<_>>(), want);
    }

    #[test]
    fn the_spec_example_runs_forward_and_backward() {
        let mut model = spec_example(1);
        let mut store = model.init(1);
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let x = Tensor::from_vec((0..2 * 72).map(|i| (i % 7) as f32 - 3.0).collect(), [2, 2, 6, 6]).unwrap();
        let y = model.forward(x, &store.params, &mut store.buffers, &ctx).unwrap();
        assert_eq!(y.shape().dims(), &[2, 3, 3, 3]);
        assert!(y.host().iter().all(|&v| v >= 0.0), "the block's ReLU");
        let mut grads = vec![0.0; model.params_len()];
        let dy = Tensor::from_vec(vec![1.0; y.numel()], y.shape().clone()).unwrap();
        let dx = model.backward_input(dy, &store.params, &mut grads, &ctx).unwrap();
        assert_eq!(dx.shape().dims(), &[2, 2, 6, 6]);
        assert!(grads.iter().any(|&g| g != 0.0) && dx.host().iter().all(|v| v.is_finite()));
        assert_eq!(ctx.mode, Mode::Train);
    }

    #[test]
    fn mismatched_branches_and_a_shortcut_without_images_are_refused() {
        let build = |text: &str| crate::spec::model_from_spec_str(text, "m").err().unwrap().to_string();
        let e = build(
            r#"{"input_shape": [3, 8, 8], "layers": [{"type": "residual", "layers": [{"type": "conv2d", "filters": 4, "kernel_size": 3, "strides": 2, "padding": 1}]}]}"#,
        );
        assert!(
            e.contains(
                "the body's output (4, 4, 4) differs from the input (the identity shortcut) (3, 8, 8): they are added"
            ),
            "{e}"
        );
        let e = build(
            r#"{"input_shape": [4], "layers": [{"type": "residual", "layers": [{"type": "dense", "units": 4}], "shortcut": [{"type": "dense", "units": 4}]}]}"#,
        );
        assert!(e.contains("a shortcut of layers needs images (C, H, W) in, got samples of shape (4)"), "{e}");
        // The identity needs no images: a block over flat samples (a transformer's).
        crate::spec::model_from_spec_str(
            r#"{"input_shape": [4], "layers": [{"type": "residual", "layers": [{"type": "dense", "units": 4}]}]}"#,
            "m",
        )
        .unwrap();
        // The builder's branches that do not meet are refused by the add, naming both.
        let x = Value::input([3, 8, 8]);
        let y = residual(&x, "b", |x| Ok(conv(3, 4, 3, 2, 1).call(x)), identity, Activation::Relu).unwrap();
        let e = y.model().err().unwrap().to_string();
        assert!(e.contains("layer b.add") && e.contains("(4, 4, 4)") && e.contains("(3, 8, 8)"), "{e}");
    }
}
