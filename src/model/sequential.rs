//! [`Sequential`]: a stack of layers, their stable names, the flat layout of their
//! parameters and buffers ([`ParamStore`]), and which layer runs inside the passes of the
//! one before it on the CPU (a ReLU after a BatchNorm, [`Layer::take_following_relu`]: one
//! pass over the activations fewer each way, the same bits).
//!
//! Names are the layer's kind numbered per kind in order (`conv0`, `bn0`, `conv1`, ...,
//! `dense0`), then the tensor (`conv0.weight`, `bn1.running_mean`): the names PyTorch's
//! `state_dict` gives the reference models, so weights move between the two by name.
//!
//! # Aligned tensors
//!
//! Every tensor starts on a multiple of [`TENSOR_ALIGN`] values (64 f32, 256 bytes) of its
//! flat buffer, and each flat buffer's length is a multiple of it; the gaps are zeros. The
//! GPU replica uses this layout as it is (its flat device buffers, and gradient slots of
//! `params_len() + buffers_len()` values one after another), so every tensor view and every
//! slot it hands to cuBLAS starts on a 256-byte boundary (device allocations do), as
//! tensors in separate allocations do: cuBLAS picks kernels, and with them the order of
//! its sums, by pointer alignment, so two replicas on one GPU (`cuda:0`, two slots) and
//! on two contexts (`cuda:0,0`) would otherwise differ for no real reason.
//! The alignment lives here, in the one layout both backends share, rather than in a
//! GPU-only padded copy: weights, checkpoints and fingerprints are per tensor (by
//! [`TensorInfo::range`]) and move between the backends unchanged, the trainer sizes the
//! exchanges from `params_len() + buffers_len()` for CPU and GPU alike, and nothing maps
//! between two layouts. The gaps cost the CPU exchange at most 63 values per tensor; they
//! stay zero, since no layer writes them and every optimiser maps a zero gradient and a
//! zero parameter to zero (checkpoints do not store them).

use std::collections::HashMap;
use std::ops::Range;

use crate::error::{Error, Result};
use crate::ops::{Ctx, Init, InputGrad, Layer, LayerShapes, Mode, ParamSpec, Params, ParamsMut, ProfileRow, RELU_KIND};
use crate::rng::{derive_key, purpose, SplitMix64};
use crate::tensor::{Shape, Tensor};

/// A layer with the name its caller gives it, or None: named by kind (`conv0`).
pub type NamedLayer = (Option<String>, Box<dyn Layer>);

/// Every tensor's start in a flat buffer, and every flat buffer's length, is a multiple
/// of this many values: 64 f32, 256 bytes (see the file's docs).
pub const TENSOR_ALIGN: usize = 64;

/// A named tensor inside a flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Full name, e.g. `conv2.bias`.
    pub name: String,
    pub shape: Shape,
    /// Where it lives in the flat buffer.
    pub range: Range<usize>,
    pub init: Init,
}

/// A replica's state: every parameter in one flat buffer, every buffer in another.
#[derive(Clone, PartialEq)]
pub struct ParamStore {
    pub params: Vec<f32>,
    pub buffers: Vec<f32>,
}

/// The lengths and an FNV-1a digest of each buffer, not their values (a model's are
/// millions: a notebook cell ending with a report would print them all).
impl std::fmt::Debug for ParamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let digest = |v: &[f32]| format!("{} values, fnv1a {:016x}", v.len(), crate::digest::fnv1a_f32(v));
        f.debug_struct("ParamStore")
            .field("params", &format_args!("{}", digest(&self.params)))
            .field("buffers", &format_args!("{}", digest(&self.buffers)))
            .finish()
    }
}

struct Slots {
    /// This layer's slice of the flat parameter buffer.
    param_span: Range<usize>,
    /// Each parameter's range inside that slice.
    param_ranges: Vec<Range<usize>>,
    buffer_span: Range<usize>,
    buffer_ranges: Vec<Range<usize>>,
}

/// Layers applied in order.
pub struct Sequential {
    /// Shape of one input sample (no batch dimension).
    input_shape: Shape,
    layers: Vec<Box<dyn Layer>>,
    names: Vec<String>,
    /// Per-sample input and output shape of each layer.
    shapes: Vec<LayerShapes>,
    slots: Vec<Slots>,
    params: Vec<TensorInfo>,
    buffers: Vec<TensorInfo>,
    /// Other names of parameters (a tied layer's own name of the tensor it shares), each
    /// with the index in `params` of the tensor it names.
    aliases: Vec<(String, usize)>,
    /// Lengths of the flat buffers, gaps included (multiples of [`TENSOR_ALIGN`]).
    params_len: usize,
    buffers_len: usize,
    /// Shape of one output sample.
    output_shape: Shape,
    /// Per-layer (forward, backward) time, when profiling is on.
    profile: Option<Vec<(std::time::Duration, std::time::Duration)>>,
    /// Per layer: whether the layer before it computes it in its own passes (a ReLU after
    /// a BatchNorm: [`Layer::take_following_relu`]), so that it is skipped here.
    taken: Vec<bool>,
}

impl Clone for Sequential {
    fn clone(&self) -> Self {
        let layers = self.layers.iter().zip(&self.names).map(|(l, n)| (Some(n.clone()), l.boxed_clone())).collect();
        Sequential::named(self.input_shape.clone(), layers).expect("a Sequential that was valid once stays valid")
    }
}

/// The names of layers of these (given name, kind)s: a given name as it is, the others
/// their kind numbered per kind among the unnamed (`conv0`, `bn0`, `conv1`).
pub fn auto_names<'a>(layers: impl Iterator<Item = (Option<&'a str>, &'static str)>) -> Vec<String> {
    let mut counts: HashMap<&'static str, usize> = HashMap::new();
    layers
        .map(|(given, kind)| match given {
            Some(name) => name.to_string(),
            None => {
                let n = counts.entry(kind).or_insert(0);
                *n += 1;
                format!("{kind}{}", *n - 1)
            }
        })
        .collect()
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequential").field("layers", &self.names).finish()
    }
}

impl Sequential {
    /// Builds the stack for inputs of per-sample shape `input_shape` (e.g. `[1, 28, 28]`),
    /// checking that every layer accepts the previous layer's output. Layers are named by
    /// kind, numbered per kind in order (`conv0`, `bn0`, `conv1`).
    pub fn new(input_shape: impl Into<Shape>, layers: Vec<Box<dyn Layer>>) -> Result<Sequential> {
        let layers = layers.into_iter().map(|l| (None, l)).collect();
        Sequential::named(input_shape, layers)
    }

    /// [`Sequential::new`] with names of the caller's where given (`stem.0`,
    /// `blocks.3`: the names of a PyTorch module's `state_dict`), the others named by
    /// kind as `new` names them, numbered per kind among themselves. Two tensors of one
    /// name are refused (two layers may share a name that prefixes different tensors).
    pub fn named(input_shape: impl Into<Shape>, layers: Vec<NamedLayer>) -> Result<Sequential> {
        let input_shape = input_shape.into();
        if layers.is_empty() {
            return Err(Error::config("model", "a Sequential needs at least one layer"));
        }
        let names = auto_names(layers.iter().map(|(name, l)| (name.as_deref(), l.kind())));
        let mut layers: Vec<Box<dyn Layer>> = layers.into_iter().map(|(_, l)| l).collect();
        let mut taken = vec![false; layers.len()];
        for i in 0..layers.len() {
            let follows = layers.get(i + 1).is_some_and(|next| next.kind() == RELU_KIND);
            if layers[i].take_following_relu(follows) && follows {
                taken[i + 1] = true;
            }
        }
        // One name may be given to several layers whose tensors it prefixes differently:
        // nanoGPT's `Block` is two residual blocks, both `transformer.h.0` (`ln_1`,
        // `attn`; `ln_2`, `mlp.*`). The tensors' names must be unique, checked below.
        let mut shapes = Vec::with_capacity(layers.len());
        let mut slots = Vec::with_capacity(layers.len());
        let (mut params, mut buffers) = (Vec::new(), Vec::new());
        let mut aliases = Vec::new();
        // Shapes are checked with a batch of 2: BatchNorm needs more than one value.
        let mut shape = batched(2, &input_shape);
        let (mut p_off, mut b_off) = (0, 0);
        for (layer, name) in layers.iter().zip(&names) {
            let input = Shape::new(&shape.dims()[1..]);
            shape = layer.output_shape(&shape).map_err(|e| Error::config("model", format!("layer {name}: {e}")))?;
            shapes.push(LayerShapes::one(input, Shape::new(&shape.dims()[1..])));
            let lay = |specs: Vec<ParamSpec>, off: &mut usize, infos: &mut Vec<TensorInfo>| {
                if specs.is_empty() {
                    // No tensors: an empty span, which indexes a container's shorter
                    // slice (`model::residual`) as well as the whole buffer.
                    return (0..0, Vec::new());
                }
                *off = off.next_multiple_of(TENSOR_ALIGN);
                let start = *off;
                let ranges = specs
                    .into_iter()
                    .map(|s| {
                        *off = off.next_multiple_of(TENSOR_ALIGN);
                        let len = s.shape.numel();
                        let r = (*off - start)..(*off - start + len);
                        infos.push(TensorInfo {
                            name: format!("{name}.{}", s.name),
                            shape: s.shape,
                            range: *off..*off + len,
                            init: s.init,
                        });
                        *off += len;
                        r
                    })
                    .collect::<Vec<_>>();
                (start..*off, ranges)
            };
            let tied = layer.tied();
            let (param_span, param_ranges) = if tied.is_empty() {
                lay(layer.params(), &mut p_off, &mut params)
            } else {
                // A layer with a tied tensor: its span starts at 0, so that its ranges
                // (absolute) reach the earlier tensor as well as its own new ones.
                let mut ranges = Vec::new();
                for (j, spec) in layer.params().into_iter().enumerate() {
                    let own = format!("{name}.{}", spec.name);
                    match tied.iter().find(|(k, _)| *k == j) {
                        Some((_, target)) => {
                            let Some(t) = params.iter().position(|t: &TensorInfo| &t.name == target) else {
                                return Err(Error::config(
                                    "model",
                                    format!(
                                        "layer {name}: its {} is tied to {target}, which no earlier layer has",
                                        spec.name
                                    ),
                                ));
                            };
                            if params[t].shape != spec.shape {
                                return Err(Error::config(
                                    "model",
                                    format!(
                                        "layer {name}: its {} {} does not match {target} {} it is tied to",
                                        spec.name, spec.shape, params[t].shape
                                    ),
                                ));
                            }
                            ranges.push(params[t].range.clone());
                            aliases.push((own, t));
                        }
                        None => {
                            p_off = p_off.next_multiple_of(TENSOR_ALIGN);
                            let range = p_off..p_off + spec.shape.numel();
                            params.push(TensorInfo {
                                name: own,
                                shape: spec.shape,
                                range: range.clone(),
                                init: spec.init,
                            });
                            p_off = range.end;
                            ranges.push(range);
                        }
                    }
                }
                (0..p_off, ranges)
            };
            let (buffer_span, buffer_ranges) = lay(layer.buffers(), &mut b_off, &mut buffers);
            slots.push(Slots { param_span, param_ranges, buffer_span, buffer_ranges });
        }
        let mut seen = std::collections::HashSet::new();
        let alias_names = aliases.iter().map(|(a, _): &(String, usize)| a);
        if let Some(dup) =
            params.iter().chain(&buffers).map(|t| &t.name).chain(alias_names).find(|n| !seen.insert(n.as_str()))
        {
            return Err(Error::config("model", format!("two tensors are named {dup}")));
        }
        let output_shape = Shape::new(&shape.dims()[1..]);
        let (params_len, buffers_len) = (p_off.next_multiple_of(TENSOR_ALIGN), b_off.next_multiple_of(TENSOR_ALIGN));
        Ok(Sequential {
            input_shape,
            layers,
            names,
            shapes,
            slots,
            params,
            buffers,
            aliases,
            params_len,
            buffers_len,
            output_shape,
            profile: None,
            taken,
        })
    }

    /// Where layer `i`'s tensors live: the absolute ranges of its parameters inside the
    /// flat parameter buffer and of its buffers inside the flat buffer, in the order of
    /// [`Layer::params`] and [`Layer::buffers`].
    pub fn layer_ranges(&self, i: usize) -> (Vec<Range<usize>>, Vec<Range<usize>>) {
        let s = &self.slots[i];
        let abs = |span: &Range<usize>, rs: &[Range<usize>]| {
            rs.iter().map(|r| span.start + r.start..span.start + r.end).collect::<Vec<_>>()
        };
        (abs(&s.param_span, &s.param_ranges), abs(&s.buffer_span, &s.buffer_ranges))
    }

    /// Index of the first layer that has parameters: backward stops there (the layers
    /// before it need no gradient, and it needs none of its input).
    pub fn first_trained_layer(&self) -> usize {
        self.slots.iter().position(|s| !s.param_span.is_empty()).unwrap_or(0)
    }

    /// Per-sample input shape.
    pub fn input_shape(&self) -> &Shape {
        &self.input_shape
    }

    /// Per-sample output shape (the number of classes for a classifier).
    pub fn output_shape(&self) -> &Shape {
        &self.output_shape
    }

    /// Layer names, in order.
    pub fn layer_names(&self) -> &[String] {
        &self.names
    }

    /// The layers, in order.
    pub fn layers(&self) -> &[Box<dyn Layer>] {
        &self.layers
    }

    /// Each layer's per-sample input and output shape, in order.
    pub fn layer_shapes(&self) -> &[LayerShapes] {
        &self.shapes
    }

    /// Trainable tensors, in the optimiser's order.
    pub fn param_infos(&self) -> &[TensorInfo] {
        &self.params
    }

    /// The other names of trainable tensors, each with the index in
    /// [`Sequential::param_infos`] of the tensor it names: a tied layer's own name of the
    /// tensor it shares (`lm_head.weight`, the same values as `transformer.wte.weight`).
    /// Weight files carry both names, as PyTorch's `state_dict` does.
    pub fn aliases(&self) -> &[(String, usize)] {
        &self.aliases
    }

    /// Buffers (running statistics), in order.
    pub fn buffer_infos(&self) -> &[TensorInfo] {
        &self.buffers
    }

    /// Length of the flat parameter buffer (of a [`ParamStore`], a gradient, an optimiser
    /// state): every trainable value plus the zero gaps that align each tensor (see the
    /// file's docs). How many values are trained is [`Sequential::num_params`].
    pub fn params_len(&self) -> usize {
        self.params_len
    }

    /// Length of the flat buffer of running statistics, gaps included.
    pub fn buffers_len(&self) -> usize {
        self.buffers_len
    }

    /// Number of trainable values (what PyTorch's `numel` sum over parameters counts):
    /// [`Sequential::params_len`] without the gaps.
    pub fn num_params(&self) -> usize {
        self.params.iter().map(|t| t.range.len()).sum()
    }

    /// Fresh parameters and buffers from `seed`, Keras's defaults: glorot-uniform
    /// weights, zero biases and beta, running mean 0 and variance 1. Each tensor draws
    /// from its own stream keyed by (seed, its index), so adding a layer at the end
    /// leaves the others' initial values unchanged.
    pub fn init(&self, seed: u64) -> ParamStore {
        let fill = |infos: &[TensorInfo], len: usize, base: u64| {
            let mut flat = vec![0.0f32; len];
            for (i, t) in infos.iter().enumerate() {
                let dst = &mut flat[t.range.clone()];
                match t.init {
                    Init::Zeros | Init::Count => dst.fill(0.0),
                    Init::Ones => dst.fill(1.0),
                    Init::Normal { std } => {
                        let mut g = SplitMix64::new(derive_key(seed, &[purpose::INIT, base, i as u64]));
                        for v in dst {
                            *v = (g.next_normal() * f64::from(std)) as f32;
                        }
                    }
                    Init::GlorotUniform { fan_in, fan_out } => {
                        let a = (6.0 / (fan_in + fan_out) as f64).sqrt();
                        let mut g = SplitMix64::new(derive_key(seed, &[purpose::INIT, base, i as u64]));
                        for v in dst {
                            *v = ((g.next_f64() * 2.0 - 1.0) * a) as f32;
                        }
                    }
                }
            }
            flat
        };
        ParamStore { params: fill(&self.params, self.params_len, 0), buffers: fill(&self.buffers, self.buffers_len, 1) }
    }

    /// Runs every layer. x: (N, *input_shape) → (N, *output_shape). `ctx.layer_index` is
    /// set per layer.
    pub fn forward(&mut self, x: Tensor, params: &[f32], buffers: &mut [f32], ctx: &Ctx) -> Result<Tensor> {
        if matches!(ctx.device, crate::tensor::Device::Cuda(_)) {
            return Err(Error::config(
                "device",
                format!("Sequential::forward runs the CPU layers; on {} a model runs as a GPU replica", ctx.device),
            ));
        }
        if x.device() != ctx.device {
            return Err(Error::DeviceMismatch {
                op: "Sequential forward",
                lhs: x.device().to_string(),
                rhs: format!("{} (the model's)", ctx.device),
            });
        }
        self.forward_at(x, params, buffers, ctx, Place::Top)
    }

    /// The forward of the layers at `place`: a model's own, or a container's branch.
    pub(crate) fn forward_at(
        &mut self,
        x: Tensor,
        params: &[f32],
        buffers: &mut [f32],
        ctx: &Ctx,
        place: Place,
    ) -> Result<Tensor> {
        let mut x = x;
        for (i, (layer, s)) in self.layers.iter_mut().zip(&self.slots).enumerate() {
            if self.taken[i] {
                continue;
            }
            let ctx = Ctx { layer_index: place.index(ctx.layer_index, i), ..*ctx };
            let p = Params::new(&params[s.param_span.clone()], &s.param_ranges);
            let b = ParamsMut::new(&mut buffers[s.buffer_span.clone()], &s.buffer_ranges);
            let t = self.profile.is_some().then(std::time::Instant::now);
            x = layer.forward(x, p, b, &ctx)?;
            if let (Some(prof), Some(t)) = (self.profile.as_mut(), t) {
                prof[i].0 += t.elapsed();
            }
        }
        Ok(x)
    }

    /// Back-propagates `dout` (the gradient of the loss with respect to the output of the
    /// last forward, which must have run in `Mode::Train`), accumulating into `grads`.
    pub fn backward(&mut self, dout: Tensor, params: &[f32], grads: &mut [f32], ctx: &Ctx) -> Result<()> {
        self.backward_at(dout, params, grads, ctx, Place::Top, InputGrad::Skip).map(drop)
    }

    /// [`Sequential::backward`] that also returns the gradient of the input, dx:
    /// (N, *input_shape) (every layer runs its backward, the first included).
    pub fn backward_input(&mut self, dout: Tensor, params: &[f32], grads: &mut [f32], ctx: &Ctx) -> Result<Tensor> {
        let dx = self.backward_at(dout, params, grads, ctx, Place::Top, InputGrad::Needed)?;
        Ok(dx.expect("a backward asked for its input gradient returns it"))
    }

    /// The backward of the layers at `place`, returning the gradient of their input when
    /// `input_grad` asks for it. Without it, the layers before the first one with
    /// parameters are not run at all, and that one is asked for no input gradient.
    pub(crate) fn backward_at(
        &mut self,
        dout: Tensor,
        params: &[f32],
        grads: &mut [f32],
        ctx: &Ctx,
        place: Place,
        input_grad: InputGrad,
    ) -> Result<Option<Tensor>> {
        let first = if input_grad == InputGrad::Skip { self.first_trained_layer() } else { 0 };
        let mut d = Some(dout);
        for (i, (layer, s)) in self.layers.iter_mut().zip(&self.slots).enumerate().skip(first).rev() {
            if self.taken[i] {
                continue;
            }
            let ctx = Ctx { mode: Mode::Train, layer_index: place.index(ctx.layer_index, i), ..*ctx };
            let p = Params::new(&params[s.param_span.clone()], &s.param_ranges);
            let g = ParamsMut::new(&mut grads[s.param_span.clone()], &s.param_ranges);
            let need = if i == first { input_grad } else { InputGrad::Needed };
            let dout = d.take().expect("every layer but the first returns an input gradient");
            let t = self.profile.is_some().then(std::time::Instant::now);
            d = layer.backward(dout, p, g, need, &ctx)?;
            if let (Some(prof), Some(t)) = (self.profile.as_mut(), t) {
                prof[i].1 += t.elapsed();
            }
        }
        Ok(d)
    }

    /// Starts (or restarts) timing every layer's forward and backward, inside containers
    /// too.
    pub fn start_profile(&mut self) {
        self.profile = Some(vec![Default::default(); self.layers.len()]);
        self.layers.iter_mut().for_each(|l| l.start_profile());
    }

    /// The time of every layer since [`Sequential::start_profile`], in forward order, each
    /// container's layers after its own row (a level deeper, named below it); empty when
    /// profiling is off.
    pub fn profile(&self) -> Vec<ProfileRow> {
        let mut rows = Vec::new();
        let layers = self.layers.iter().zip(&self.names);
        for (i, (&(forward, backward), (layer, name))) in self.profile.iter().flatten().zip(layers).enumerate() {
            let description = match self.taken[i] {
                true => format!("{} (in the previous layer's passes)", layer.describe()),
                false => layer.describe(),
            };
            rows.push(ProfileRow { name: name.clone(), description, depth: 0, forward, backward });
            rows.extend(layer.profile().into_iter().map(|r| ProfileRow {
                name: format!("{name}.{}", r.name),
                depth: r.depth + 1,
                ..r
            }));
        }
        rows
    }

    /// A one-line-per-layer summary: name, description, output shape, parameter count.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        for (((layer, name), s), shapes) in self.layers.iter().zip(&self.names).zip(&self.slots).zip(&self.shapes) {
            out.push_str(&format!(
                "{name:<12} {:<36} {:<16} {:>8}\n",
                layer.describe(),
                shapes.output.to_string(),
                s.param_ranges.iter().map(|r| r.len()).sum::<usize>()
            ));
        }
        out.push_str(&format!("total trainable parameters: {}\n", self.num_params()));
        out
    }
}

/// Where a Sequential's layers sit, which decides the index each layer's context carries
/// (dropout's masks derive from it): a model's own layers are numbered 0, 1, ...; the
/// layers of a container's branch take indices derived from the container's index, the
/// branch and their position, so that no two layers of a model share one.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Place {
    Top,
    /// Branch `b` of the container whose context is being run (its `layer_index`).
    Branch(u64),
}

impl Place {
    /// The index of layer `i` at this place, inside a container of index `parent`.
    pub fn index(self, parent: usize, i: usize) -> usize {
        match self {
            Place::Top => i,
            // 62 bits: far from any index a model's own layers reach, and a usize on
            // every 64-bit target.
            Place::Branch(b) => (derive_key(parent as u64, &[purpose::LAYER, b, i as u64]) >> 2) as usize,
        }
    }
}

/// `(n, *sample)`.
pub(crate) fn batched(n: usize, sample: &Shape) -> Shape {
    let mut d = Vec::with_capacity(sample.ndim() + 1);
    d.push(n);
    d.extend_from_slice(sample.dims());
    Shape::new(d)
}
