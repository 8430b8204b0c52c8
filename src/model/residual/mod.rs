//! The residual block, `y = act(body(x) + shortcut(x))` (He et al. 2016): a container of
//! two branches, each a [`Sequential`], the shortcut the identity when it has no layers,
//! and an optional ReLU after the add. Its forward and backward side by side, its output
//! shape (both branches must agree), its memory, its spec entry (`residual`) and its spec
//! form; its own arithmetic, the add and the backward's fan-in, is [`cpu`]'s, and its GPU
//! form is [`gpu`] (kernels/residual.cu's `residual_add_fwd_f32`, and its branches' own
//! GPU forms).
//!
//! Owns how its branches see the model: the block's tensors are the body's, then the
//! shortcut's, each branch laid out inside the block's slice of the flat buffers exactly
//! as the outer [`Sequential`] lays any layer's tensors (every tensor on a multiple of
//! `TENSOR_ALIGN`, so a branch's own layout is the block's at an offset; a test holds the
//! two to each other). Names are the branches' layer names, the
//! shortcut's layers named `shortcut.<kind><n>` unless given names (`short.0`, as a
//! PyTorch module's `state_dict` names them). What each inner layer computes is its own.
//!
//! # The order of everything, on every backend
//! - forward: the body, then the shortcut, then the add (`body + shortcut`) and the ReLU
//!   (on the CPU in one pass, `Relu::forward_sum`);
//! - backward: the ReLU's mask, then the shortcut's backward, then the body's (the
//!   reverse of the forward, which synchronized BatchNorm's exchanges follow:
//!   `Layer::synchronized_channels` lists them in forward order), then
//!   `dx = dbody + dshortcut` (one addition a value: its order cannot differ).
//!
//! Inner layers' indices (dropout's masks derive from them) are derived from the block's
//! and the branch's (`nn::Place::Branch`: 0 the body, 1 the shortcut).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::graph::batched;
use super::spec_objects::{layers_to_spec, read_layers, LayerObject};
use super::{Graph, NamedLayer, Place, Sequential};
use crate::error::{Error, Result};
use crate::ops::spec::{Activation, Build, LayerType};
use crate::ops::{
    Ctx, InputGrad, Layer, LayerMemory, LayerShapes, ParamSpec, Params, ParamsMut, ProfileRow, Relu, F32,
};
use crate::tensor::{Shape, Tensor};

/// The branch index of the body and of the shortcut, for [`Place::Branch`].
const BODY: u64 = 0;
const SHORTCUT: u64 = 1;

/// `y = act(body(x) + shortcut(x))`.
pub struct Residual {
    body: Graph,
    /// None: the identity.
    shortcut: Option<Graph>,
    activation: Activation,
    /// The ReLU after the add, when `activation` says so: the ReLU layer itself (its
    /// forward, its mask, its backward), so that the block's is no other ReLU.
    relu: Option<Relu>,
}

impl Clone for Residual {
    fn clone(&self) -> Self {
        let relu = self.relu.as_ref().map(|_| Relu::new());
        Residual { body: self.body.clone(), shortcut: self.shortcut.clone(), activation: self.activation, relu }
    }
}

impl std::fmt::Debug for Residual {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Residual")
            .field("body", &self.body)
            .field("shortcut", &self.shortcut)
            .field("activation", &self.activation)
            .finish()
    }
}

/// The prefix of a shortcut's layers named by kind.
const SHORTCUT_PREFIX: &str = "shortcut.";

impl Residual {
    /// The block over inputs of per-sample shape `input`: `body`'s layers, `shortcut`'s
    /// (none: the identity), each with a name of the caller's or None (named by kind; a
    /// shortcut's as `shortcut.conv0`), then `activation`. The branches' output shapes
    /// must agree, and a shortcut of layers needs images (C, H, W) in.
    pub fn new(
        input: impl Into<Shape>,
        body: Vec<NamedLayer>,
        shortcut: Vec<NamedLayer>,
        activation: Activation,
    ) -> Result<Residual> {
        let input = input.into();
        if body.is_empty() {
            return Err(Error::config("residual", "the body needs at least one layer"));
        }
        let body = Sequential::named(input.clone(), body)?;
        let shortcut = if shortcut.is_empty() {
            None
        } else {
            if let Some(problem) = shortcut_without_images(&input) {
                return Err(Error::config("residual", problem));
            }
            let kinds: Vec<_> = shortcut.iter().map(|(n, l)| (n.clone(), l.kind())).collect();
            let auto = super::auto_names(kinds.iter().map(|(n, k)| (n.as_deref(), *k)));
            let named = shortcut
                .into_iter()
                .zip(auto)
                .map(|((given, l), auto)| (Some(given.unwrap_or_else(|| format!("{SHORTCUT_PREFIX}{auto}"))), l))
                .collect();
            Some(Sequential::named(input.clone(), named)?)
        };
        if let Some(problem) =
            branches_disagree(&input, body.output_shape(), shortcut.as_ref().map(|s| s.output_shape()))
        {
            return Err(Error::config("residual", problem));
        }
        let relu = (activation == Activation::Relu).then(Relu::new);
        let block = Residual { body, shortcut, activation, relu };
        let mut seen = std::collections::HashSet::new();
        if let Some(t) = block
            .branches()
            .flat_map(|(_, s)| s.param_infos().iter().chain(s.buffer_infos()))
            .find(|t| !seen.insert(t.name.clone()))
        {
            return Err(Error::config("residual", format!("two tensors of the block are named {}", t.name)));
        }
        Ok(block)
    }

    /// The spec entry: `{"type": "residual", "layers": [...], "shortcut": [...],
    /// "activation": "relu"}`, its branches' input the running shape.
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
            Ok(Build::layer(move |input| {
                // Each branch built against the running shape, its problems named by its
                // place in the block (`layers[1] (conv2d): ...`).
                let branch = |objects: &[LayerObject], what: &str| {
                    let mut shape = input.clone();
                    let mut out = Vec::new();
                    for (j, o) in objects.iter().enumerate() {
                        let at = |e: String| format!("{what}[{j}] ({}): {e}", o.type_name());
                        for (name, layer) in o.build(&shape).map_err(at)? {
                            shape = layer.output_shape(&shape).map_err(|e| at(e.to_string()))?;
                            out.push((name, layer));
                        }
                    }
                    Ok::<_, String>((out, shape))
                };
                let (body, body_out) = branch(&body, "layers")?;
                let (shortcut, skip_out) = branch(&shortcut, "shortcut")?;
                // The block's own checks, in the spec's words (without `invalid residual`).
                let per = |s: &Shape| Shape::new(&s.dims()[1..]);
                let per_sample = per(input);
                if !shortcut.is_empty() {
                    shortcut_without_images(&per_sample).map_or(Ok(()), Err)?;
                }
                let skip = (!shortcut.is_empty()).then(|| per(&skip_out));
                branches_disagree(&per_sample, &per(&body_out), skip.as_ref()).map_or(Ok(()), Err)?;
                Residual::new(per_sample, body, shortcut, activation).map_err(|e| e.to_string())
            }))
        },
        #[cfg(feature = "cuda")]
        kernels: Some(&gpu::KERNELS),
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Values,
            #[cfg(feature = "cuda")]
            host: Some(gpu::host_check),
        },
    };

    /// The body.
    pub fn body(&self) -> &Graph {
        &self.body
    }

    /// The shortcut's layers; None: the identity.
    pub fn shortcut(&self) -> Option<&Graph> {
        self.shortcut.as_ref()
    }

    /// (branch index, branch) of the body, then of the shortcut when it has layers.
    fn branches(&self) -> impl Iterator<Item = (u64, &Graph)> {
        std::iter::once((BODY, &self.body)).chain(self.shortcut.iter().map(|s| (SHORTCUT, s)))
    }

    /// The block's slice of a flat buffer cut at `at` (the body's length): the body's
    /// part and the shortcut's.
    fn split(flat: &[f32], at: usize) -> (&[f32], &[f32]) {
        flat.split_at(at.min(flat.len()))
    }

    fn split_mut(flat: &mut [f32], at: usize) -> (&mut [f32], &mut [f32]) {
        let at = at.min(flat.len());
        flat.split_at_mut(at)
    }
}

/// Why a shortcut of layers cannot take samples of per-sample shape `input`, if it cannot.
fn shortcut_without_images(input: &Shape) -> Option<String> {
    (input.dims().len() != 3)
        .then(|| format!("a shortcut of layers needs images (C, H, W) in, got samples of shape {input}"))
}

/// Why a block's branches cannot be added, if they cannot: the body's per-sample output
/// against the shortcut's (None: the identity, whose output is the input).
fn branches_disagree(input: &Shape, body: &Shape, shortcut: Option<&Shape>) -> Option<String> {
    let (skip, what) = match shortcut {
        Some(s) => (s, "shortcut's output"),
        None => (input, "input (the identity shortcut)"),
    };
    (body != skip).then(|| format!("the body's output {body} differs from the {what} {skip}: they are added"))
}

impl Layer for Residual {
    fn kind(&self) -> &'static str {
        "residual"
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let per_sample = Shape::new(&input.dims()[1..]);
        if &per_sample != self.body.input_shape() {
            return Err(Error::shape(
                "Residual",
                format!("built for samples of {}, got {input}", self.body.input_shape()),
            ));
        }
        Ok(batched(input.dims()[0], self.body.output_shape()))
    }

    /// The body's tensors, then the shortcut's, named as their branches name them.
    fn params(&self) -> Vec<ParamSpec> {
        let infos = self.branches().flat_map(|(_, s)| s.param_infos().to_vec());
        infos.map(|t| ParamSpec { name: t.name.into(), shape: t.shape, init: t.init }).collect()
    }

    fn buffers(&self) -> Vec<ParamSpec> {
        let infos = self.branches().flat_map(|(_, s)| s.buffer_infos().to_vec());
        infos.map(|t| ParamSpec { name: t.name.into(), shape: t.shape, init: t.init }).collect()
    }

    // x: (N, *input) → y: (N, *output), y = act(body(x) + shortcut(x))
    fn forward(&mut self, x: Tensor, params: Params<'_>, mut buffers: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (p_body, p_short) = Residual::split(params.flat(), self.body.params_len());
        let (b_body, b_short) = Residual::split_mut(buffers.flat_mut(), self.body.buffers_len());
        // The body's first layer keeps its input for the backward: the identity reads the
        // same values (a clone shares them).
        let mut y = self.body.forward_at(vec![x.clone()], p_body, b_body, ctx, Place::Branch(BODY))?;
        let skip = match &mut self.shortcut {
            Some(s) => s.forward_at(vec![x], p_short, b_short, ctx, Place::Branch(SHORTCUT))?,
            None => x,
        };
        match &mut self.relu {
            Some(relu) => relu.forward_sum(y, &skip, ctx),
            None => {
                cpu::residual_forward(y.host_mut(), skip.host());
                Ok(y)
            }
        }
    }

    // dout: (N, *output) → dx: (N, *input) = dbody + dshortcut
    fn backward(
        &mut self,
        mut dout: Tensor,
        params: Params<'_>,
        mut dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        if let Some(relu) = &mut self.relu {
            let none = ParamsMut::new(&mut [], &[]);
            dout = relu.backward(dout, Params::new(&[], &[]), none, InputGrad::Needed, ctx)?.expect("asked for");
        }
        let (p_body, p_short) = Residual::split(params.flat(), self.body.params_len());
        let (g_body, g_short) = Residual::split_mut(dparams.flat_mut(), self.body.params_len());
        let d_short = match &mut self.shortcut {
            Some(s) => {
                s.backward_at(dout.clone(), p_short, g_short, ctx, Place::Branch(SHORTCUT), input_grad)?.pop().flatten()
            }
            None => (input_grad == InputGrad::Needed).then(|| dout.clone()),
        };
        let d_body = self.body.backward_at(dout, p_body, g_body, ctx, Place::Branch(BODY), input_grad)?.pop().flatten();
        Ok(match (d_body, d_short) {
            (Some(mut dx), Some(ds)) => {
                cpu::residual_backward(dx.host_mut(), ds.host());
                Some(dx)
            }
            _ => None,
        })
    }

    fn start_profile(&mut self) {
        self.body.start_profile();
        self.shortcut.iter_mut().for_each(Graph::start_profile);
    }

    fn profile(&self) -> Vec<ProfileRow> {
        self.branches().flat_map(|(_, s)| s.profile()).collect()
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }

    fn describe(&self) -> String {
        let body: Vec<String> = self.body.layers().iter().map(|l| l.describe()).collect();
        let short = match &self.shortcut {
            Some(s) => s.layers().iter().map(|l| l.describe()).collect::<Vec<_>>().join(", "),
            None => "identity".into(),
        };
        let act = if self.relu.is_some() { ", relu" } else { "" };
        format!("Residual([{}] + [{short}]{act})", body.join(", "))
    }

    fn spec(&self) -> Option<Value> {
        let body = layers_to_spec(self.body.layers(), self.body.layer_names(), "").ok()?;
        let mut v = json!({"type": "residual", "layers": body, "activation": self.activation.name()});
        if let Some(s) = &self.shortcut {
            v["shortcut"] = Value::Array(layers_to_spec(s.layers(), s.layer_names(), SHORTCUT_PREFIX).ok()?);
        }
        Some(v)
    }

    /// Its branches' layers' own accounts, and the block's: in forward the input a
    /// shortcut reads after the body has run and the branches' outputs meeting in the add;
    /// in backward the gradient handed to both branches and their two input gradients
    /// meeting in the fan-in (twice (input + output), as f32); and the ReLU's own account
    /// (its mask). Measured for resnet20 at a global batch of 128 (6 steps) against the
    /// peak RSS: see docs/residual-networks.md.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let mut m = LayerMemory::NONE;
        for (_, s) in self.branches() {
            for (l, sh) in s.layers().iter().zip(s.layer_shapes()) {
                let inner = l.memory(sh)?;
                m.kept_per_sample = m.kept_per_sample.saturating_add(inner.kept_per_sample);
                m.per_chunk = m.per_chunk.saturating_add(inner.per_chunk);
                m.per_layer = m.per_layer.saturating_add(inner.per_layer);
                m.lent_per_chunk = m.lent_per_chunk.max(inner.lent_per_chunk);
                m.gemm = m.gemm.max(inner.gemm);
            }
        }
        let (i, o) = (shapes.input.numel() as u64, shapes.output.numel() as u64);
        let relu = match &self.relu {
            Some(r) => r.memory(shapes)?.kept_per_sample,
            None => 0,
        };
        let block = i.saturating_add(o).saturating_mul(2 * F32);
        m.kept_per_sample = m.kept_per_sample.saturating_add(block).saturating_add(relu);
        Some(m)
    }

    /// The block with every BatchNorm of its branches synchronized; None when it has none.
    fn synchronized(&self) -> Option<Box<dyn Layer>> {
        let any = self.branches().any(|(_, s)| s.layers().iter().any(|l| l.synchronized().is_some()));
        if !any {
            return None;
        }
        let convert = |s: &Graph| {
            let layers = s.layers().iter().zip(s.layer_names());
            layers.map(|(l, n)| (Some(n.clone()), l.synchronized().unwrap_or_else(|| l.boxed_clone()))).collect()
        };
        let shortcut = self.shortcut.as_ref().map_or_else(Vec::new, convert);
        Residual::new(self.body.input_shape().clone(), convert(&self.body), shortcut, self.activation)
            .ok()
            .map(|b| Box::new(b) as Box<dyn Layer>)
    }

    fn synchronized_channels(&self) -> Vec<usize> {
        self.branches().flat_map(|(_, s)| s.layers().iter().flat_map(|l| l.synchronized_channels())).collect()
    }

    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::{BatchNorm2d, Conv2d, Padding, Relu};

    fn conv(c: usize, o: usize, k: usize, s: usize, p: usize) -> Box<dyn Layer> {
        Box::new(Conv2d::new(c, o, (k, k), s, Padding::Explicit(p, p), false).unwrap())
    }

    #[test]
    fn a_branch_lays_its_tensors_out_as_the_block_does() {
        // The block hands each branch its part of the block's slice; the outer Sequential
        // lays the block's tensors out: the two layouts must coincide.
        let body = vec![
            (None, conv(3, 5, 3, 2, 1)),
            (None, Box::new(BatchNorm2d::new(5)) as Box<dyn Layer>),
            (None, Box::new(Relu::new()) as Box<dyn Layer>),
            (None, conv(5, 5, 3, 1, 1)),
        ];
        let short = vec![(None, conv(3, 5, 1, 2, 0)), (None, Box::new(BatchNorm2d::new(5)) as Box<dyn Layer>)];
        let block = Residual::new([3, 7, 7], body, short, Activation::Relu).unwrap();
        let model = Sequential::new([3, 7, 7], vec![conv(3, 3, 1, 1, 0), Box::new(block.clone())]).unwrap();
        let (params, buffers) = model.layer_ranges(1);
        let start = params[0].start;
        let inner: Vec<_> = block.body.param_infos().iter().map(|t| t.range.clone()).collect();
        let short: Vec<_> = block.shortcut.as_ref().unwrap().param_infos().iter().map(|t| t.range.clone()).collect();
        let at = block.body.params_len();
        let want: Vec<_> = inner.into_iter().chain(short.into_iter().map(|r| r.start + at..r.end + at)).collect();
        let got: Vec<_> = params.iter().map(|r| r.start - start..r.end - start).collect();
        assert_eq!(got, want);
        let b0 = buffers[0].start;
        assert_eq!(buffers.iter().map(|r| r.start - b0).collect::<Vec<_>>(), vec![0, 64, 128, 192]);
        let names: Vec<_> = model.param_infos().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "conv0.weight",
                "residual0.conv0.weight",
                "residual0.bn0.gamma",
                "residual0.bn0.beta",
                "residual0.conv1.weight",
                "residual0.shortcut.conv0.weight",
                "residual0.shortcut.bn0.gamma",
                "residual0.shortcut.bn0.beta",
            ]
        );
    }

    /// A model of `blocks` copies of the spec's example block (input (2, 6, 6)), its
    /// initial tensors and a training context.
    fn spec_example(blocks: usize) -> (Graph, crate::nn::ParamStore, Ctx<'static>) {
        let (input, layer) = Residual::SPEC.example;
        let layers = vec![layer; blocks].join(", ");
        let text = format!(r#"{{"input_shape": {input:?}, "layers": [{layers}]}}"#);
        let model = crate::spec::model_from_spec_str(&text, "example").unwrap();
        let store = model.init(1);
        (model, store, Ctx::train(0, 0, 0, crate::tensor::Device::Cpu(0)))
    }

    #[test]
    fn the_spec_example_runs_forward_and_backward() {
        // Its body's BatchNorm is followed by layers without tensors and its shortcut has
        // no buffers: their spans must index the block's shorter slices.
        let (mut model, mut store, ctx) = spec_example(1);
        let x = Tensor::from_vec((0..2 * 72).map(|i| (i % 7) as f32 - 3.0).collect(), [2, 2, 6, 6]).unwrap();
        let y = model.forward(x, &store.params, &mut store.buffers, &ctx).unwrap();
        assert_eq!(y.shape().dims(), &[2, 3, 3, 3]);
        let mut grads = vec![0.0; model.params_len()];
        let dy = Tensor::from_vec(vec![1.0; y.numel()], y.shape().clone()).unwrap();
        let dx = model.backward_input(dy, &store.params, &mut grads, &ctx).unwrap();
        assert_eq!(dx.shape().dims(), &[2, 2, 6, 6]);
        assert!(grads.iter().any(|&g| g != 0.0) && dx.host().iter().all(|v| v.is_finite()));
    }

    #[test]
    fn a_profile_lists_the_blocks_layers_under_it() {
        let (mut model, mut store, ctx) = spec_example(2);
        assert!(model.profile().is_empty(), "profiling is off until started");
        model.start_profile();
        for _ in 0..2 {
            let x = Tensor::from_vec((0..2 * 72).map(|i| (i % 5) as f32).collect(), [2, 2, 6, 6]).unwrap();
            let y = model.forward(x, &store.params, &mut store.buffers, &ctx).unwrap();
            let dy = Tensor::from_vec(vec![1.0; y.numel()], y.shape().clone()).unwrap();
            model.backward_input(dy, &store.params, &mut vec![0.0; model.params_len()], &ctx).unwrap();
        }
        let rows = model.profile();
        let block = &model.layers()[0];
        let inner: Vec<String> = block.profile().iter().map(|r| format!("residual0.{}", r.name)).collect();
        let names: Vec<(&str, usize)> = rows.iter().map(|r| (r.name.as_str(), r.depth)).collect();
        let mut want = vec![("residual0", 0)];
        want.extend(inner.iter().map(|n| (n.as_str(), 1)));
        assert_eq!(&names[..want.len()], &want[..]);
        assert!(inner.iter().any(|n| n.contains(".shortcut.")), "the shortcut's layers too: {inner:?}");
        assert_eq!(rows.iter().filter(|r| r.depth == 0).count(), 2, "{names:?}");
        // A block's time encloses its layers' (nested intervals of one clock), and each
        // layer ran in both passes, but a ReLU that the BatchNorm before it runs.
        let (top, below) = (&rows[0], &rows[1..want.len()]);
        let taken = |r: &&ProfileRow| r.description.ends_with("(in the previous layer's passes)");
        assert!(below.iter().any(|r| taken(&r)), "the body's ReLU runs in its BatchNorm's passes: {below:?}");
        let zero = std::time::Duration::ZERO;
        assert!(below.iter().filter(taken).all(|r| r.forward == zero && r.backward == zero));
        assert!(below.iter().filter(|r| !taken(r)).all(|r| r.forward > zero && r.backward > zero));
        assert!(top.forward >= below.iter().map(|r| r.forward).sum());
        assert!(top.backward >= below.iter().map(|r| r.backward).sum());
        assert_eq!(top.description, block.describe());
    }

    #[test]
    fn mismatched_branches_and_a_shortcut_without_images_are_refused() {
        let e = Residual::new([3, 8, 8], vec![(None, conv(3, 4, 3, 2, 1))], vec![], Activation::Relu).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid residual: the body's output (4, 4, 4) differs from the input (the identity shortcut) (3, 8, 8): they are added"
        );
        let dense = || Box::new(crate::nn::Linear::new(4, 4)) as Box<dyn Layer>;
        let e = Residual::new([4], vec![(None, dense())], vec![(None, dense())], Activation::Linear).unwrap_err();
        assert!(
            e.to_string().contains("a shortcut of layers needs images (C, H, W) in, got samples of shape (4)"),
            "{e}"
        );
        // The identity needs no images: a block over flat samples (a transformer's).
        Residual::new([4], vec![(None, dense())], vec![], Activation::Linear).unwrap();
    }
}
