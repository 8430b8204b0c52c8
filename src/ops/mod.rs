//! The ops, one folder each, and the contract every op keeps: the [`Layer`] trait (a
//! layer's forward and backward, its shape, its tensors, its memory account, its spec and
//! GPU forms), the context it runs in ([`Ctx`]), the views of its tensors ([`Params`],
//! [`ParamsMut`]), its spec entry ([`spec::LayerType`]) and its GPU form's contract
//! ([`gpu`]).
//!
//! A layer owns its hyper-parameters and what it keeps between forward and backward, and
//! nothing else: its parameters, their gradients and its buffers (BatchNorm's running
//! statistics) live in flat `Vec<f32>`s owned by the replica (`model::ParamStore`), laid
//! out by the model. Flat storage is what makes the rest cheap: the all-reduce moves one
//! buffer, the optimiser is one elementwise loop, the replica check hashes one slice, and
//! safetensors I/O maps names to ranges.
//!
//! # The gradient contract
//! `backward` ACCUMULATES (`+=`) into parameter gradients; it never overwrites them, and
//! WRITES its input gradient. The trainer zeroes a gradient buffer once per logical
//! replica and step, so a shard's gradient is the sum over its samples of the per-sample
//! loss gradients.
//!
//! # One op, one folder
//! `<op>/mod.rs` is the layer, `<op>/cpu.rs` its forward and backward as plain functions
//! (the reference), `<op>/gpu.rs` its kernels' declaration, checked launches, GPU form and
//! host check; its CUDA source is `kernels/<op>.cu`. What an op owes, and how adding one
//! goes, is the architecture chapter's (docs/architecture.md, "Ops: one folder each"); the
//! conformance test ([`conformance`], test builds only) holds every entry of
//! `model::LAYER_TYPES` to all of it.

pub mod add;
pub mod attention;
pub mod avgpool2d;
pub mod batchnorm;
pub mod concatenate;
#[cfg(test)]
pub(crate) mod conformance;
pub mod conv2d;
pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
pub mod flatten;
pub mod gelu;
pub mod global_avg_pool;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod layernorm;
pub mod linear;
pub mod matmul;
pub mod maxpool2d;
pub(crate) mod merge;
pub mod multiply;
pub mod permute;
pub mod positional;
pub mod relu;
pub mod rescaling;
pub mod reshape;
pub mod rmsnorm;
pub mod rotary_embedding;
pub mod sdpa;
pub mod sigmoid;
pub mod silu;
pub(crate) mod slopes;
pub mod softmax;
pub mod spec;
pub mod split;
pub mod tanh;
pub mod upsample;
pub mod window;

use std::ops::Range;

pub use add::Add;
pub use attention::cpu::Mask as AttentionMask;
pub use attention::CausalSelfAttention;
pub use avgpool2d::AvgPool2d;
pub use batchnorm::BatchNorm2d;
pub use concatenate::Concatenate;
pub use conv2d::Conv2d;
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use flatten::Flatten;
pub use gelu::Gelu;
pub use global_avg_pool::GlobalAvgPool2d;
pub use layernorm::LayerNorm;
pub use linear::Linear;
pub use matmul::MatMul;
pub use maxpool2d::MaxPool2d;
pub use multiply::Multiply;
pub use permute::Permute;
pub use positional::PositionalEmbedding;
pub use relu::Relu;
pub use rescaling::Rescaling;
pub use reshape::Reshape;
pub use rmsnorm::RmsNorm;
pub use rotary_embedding::RotaryEmbedding;
pub use sdpa::ScaledDotProductAttention;
pub use sigmoid::Sigmoid;
pub use silu::Silu;
pub use softmax::Softmax;
pub use spec::{Activation, LayerType};
pub use split::Split;
pub use tanh::Tanh;
pub use upsample::Upsample2d;
pub use window::{Padding, Window2d};

use crate::error::{Error, Result};
use crate::tensor::{Device, Shape, Tensor};

/// What a merge's one-input forms return: a graph calls only the `_many` forms of a layer
/// whose [`Layer::arity`] is not [`Arity::One`], so reaching one of these is a caller's
/// mistake, named.
pub fn merge_takes_several<T>(layer: &str, arity: Arity) -> Result<T> {
    Err(Error::config("model", format!("{layer} takes {arity}: it is a merge, called through a graph's node")))
}

/// Bytes of an f32, for the layers' memory accounts.
pub(crate) const F32: u64 = 4;

/// What a layer holds for a training pass beyond its parameters and buffers (which
/// `Sequential` lays out), as [`Layer::memory`] states it; `crate::memory` sums these
/// over a network.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerMemory {
    /// Bytes kept per sample from the training forward to the backward.
    pub kept_per_sample: u64,
    /// Bytes of workspace per chunk of samples that the CPU backend computes together
    /// (`backend::cpu::batch_chunks`: at most 16 a batch).
    pub per_chunk: u64,
    /// Bytes of work buffers per chunk of samples lent by a pool shared by the layers
    /// (`conv2d`'s): a model needs its largest layer's, not their sum, in training and in
    /// evaluation alike.
    pub lent_per_chunk: u64,
    /// Bytes the layer holds once a pass whatever the batch, kept from the training
    /// forward to the backward (a Winograd convolution's transformed weight).
    pub per_layer: u64,
    /// Bytes the GEMM packs the operands of the layer's largest product into, for the
    /// length of one product (`backend::cpu::gemm_packing`): a model needs its largest
    /// layer's, once a device, since a device runs one product at a time.
    pub gemm: u64,
}

impl LayerMemory {
    /// Nothing kept, no workspace.
    pub const NONE: LayerMemory =
        LayerMemory { kept_per_sample: 0, per_chunk: 0, lent_per_chunk: 0, per_layer: 0, gemm: 0 };
}

/// The per-sample shapes at one layer's boundaries (no batch dimension), as
/// `model::Sequential` inferred them: what a backend that runs the layers its own way
/// (the GPU replica) sizes its buffers from, instead of inferring them again.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerShapes {
    /// The (first) input's.
    pub input: Shape,
    pub output: Shape,
    /// A merge's inputs after the first, in the order its node names them; empty for a
    /// layer of one input.
    pub other_inputs: Vec<Shape>,
}

impl LayerShapes {
    /// The shapes of a layer of one input.
    pub fn one(input: Shape, output: Shape) -> LayerShapes {
        LayerShapes { input, output, other_inputs: Vec::new() }
    }

    /// Every input's shape, the first one first.
    pub fn inputs(&self) -> impl Iterator<Item = &Shape> {
        std::iter::once(&self.input).chain(&self.other_inputs)
    }
}

/// How many inputs a layer takes: one for most; a merge (add, concatenate, matmul,
/// attention of q, k and v) several, in the order its node names them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Arity {
    One,
    Exactly(usize),
    AtLeast(usize),
}

impl Arity {
    /// Whether `n` inputs are what this arity takes.
    pub fn admits(self, n: usize) -> bool {
        match self {
            Arity::One => n == 1,
            Arity::Exactly(k) => n == k,
            Arity::AtLeast(k) => n >= k,
        }
    }
}

impl std::fmt::Display for Arity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Arity::One => write!(f, "one input"),
            Arity::Exactly(k) => write!(f, "{k} inputs"),
            Arity::AtLeast(k) => write!(f, "{k} or more inputs"),
        }
    }
}

/// Training or evaluation: decides BatchNorm's statistics and whether dropout drops.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mode {
    Train,
    Eval,
}

/// Whether a layer's backward must produce the gradient of its input. The first layer
/// of a network skips it: nobody reads the gradient of the data.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum InputGrad {
    Needed,
    Skip,
}

/// How a parameter or buffer starts.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Init {
    /// Glorot (Xavier) uniform, Keras's default kernel initialiser:
    /// U(−a, a), a = sqrt(6 / (fan_in + fan_out)).
    GlorotUniform {
        fan_in: usize,
        fan_out: usize,
    },
    /// N(0, std²), nanoGPT's initialiser of Linear and Embedding weights (std 0.02,
    /// its residual projections 0.02/√(2·layers)); drawn by Box–Muller from the
    /// tensor's own stream.
    Normal {
        std: f32,
    },
    Zeros,
    Ones,
    /// A count, from 0 (BatchNorm's `num_batches_tracked`): held as f32 like every
    /// buffer, written to weight files as PyTorch's int64, rounded.
    Count,
}

/// One named tensor a layer needs stored for it.
#[derive(Clone, PartialEq, Debug)]
pub struct ParamSpec {
    /// The suffix after the layer's name: `weight`, `bias`, `beta`, `running_mean`, ...;
    /// a container's names its inner layers' tensors (`conv1.weight`).
    pub name: std::borrow::Cow<'static, str>,
    pub shape: Shape,
    pub init: Init,
}

/// What a layer may know about the step it runs in; `'a` is the statistics exchange's.
#[derive(Clone, Copy, Debug)]
pub struct Ctx<'a> {
    pub mode: Mode,
    /// Seed of the run: random streams derive from (seed, step, shard, layer).
    pub seed: u64,
    /// Index of the layer in its Sequential (set by Sequential).
    pub layer_index: usize,
    /// The global step (0-based) of a training forward.
    pub step: u64,
    /// The shard: the index of the logical replica whose rows these are.
    pub shard: usize,
    /// The device running it.
    pub device: Device,
    /// Position, within its logical replica's shard, of this pass's first sample (0 but
    /// for a later micro-batch of an accumulated step): dropout indexes its masks from
    /// it, so that accumulation draws the masks of the unaccumulated step.
    pub sample_offset: usize,
    /// Where synchronized BatchNorm layers meet the other logical replicas' statistics
    /// (`ops::batchnorm::stats`); None: a world of one, statistics of the shard alone.
    pub stats: Option<&'a dyn batchnorm::stats::StatsExchange>,
}

impl<'a> Ctx<'a> {
    /// A context for evaluation on `device` (no randomness is drawn in eval mode).
    pub fn eval(device: Device) -> Ctx<'a> {
        Ctx { mode: Mode::Eval, seed: 0, layer_index: 0, step: 0, shard: 0, device, sample_offset: 0, stats: None }
    }

    /// A context for training step `step` of logical replica `shard`, whose random
    /// streams derive from `seed`.
    pub fn train(seed: u64, step: u64, shard: usize, device: Device) -> Ctx<'a> {
        Ctx { mode: Mode::Train, seed, layer_index: 0, step, shard, device, sample_offset: 0, stats: None }
    }
}

/// Read-only view of one layer's tensors inside a flat buffer.
#[derive(Clone, Copy)]
pub struct Params<'a> {
    flat: &'a [f32],
    ranges: &'a [Range<usize>],
}

impl<'a> Params<'a> {
    pub(crate) fn new(flat: &'a [f32], ranges: &'a [Range<usize>]) -> Self {
        Params { flat, ranges }
    }

    /// The `i`-th tensor, in the order of [`Layer::params`] (or `buffers`).
    pub fn get(&self, i: usize) -> &'a [f32] {
        &self.flat[self.ranges[i].clone()]
    }
}

/// Mutable view of one layer's tensors inside a flat buffer.
pub struct ParamsMut<'a> {
    flat: &'a mut [f32],
    ranges: &'a [Range<usize>],
}

impl<'a> ParamsMut<'a> {
    pub(crate) fn new(flat: &'a mut [f32], ranges: &'a [Range<usize>]) -> Self {
        ParamsMut { flat, ranges }
    }

    /// The `i`-th tensor, mutably.
    pub fn get(&mut self, i: usize) -> &mut [f32] {
        &mut self.flat[self.ranges[i].clone()]
    }

    /// Two different tensors at once (`i < j`), e.g. a weight and a bias gradient.
    pub fn pair(&mut self, i: usize, j: usize) -> (&mut [f32], &mut [f32]) {
        assert!(i < j, "ParamsMut::pair needs i < j");
        let (ri, rj) = (self.ranges[i].clone(), self.ranges[j].clone());
        let (lo, hi) = self.flat.split_at_mut(rj.start);
        (&mut lo[ri], &mut hi[..rj.len()])
    }

    /// The number of tensors.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// True for a layer without tensors.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

/// The kind of the ReLU layer ([`Relu`]): what a [`Sequential`] looks for after a layer
/// that may take the ReLU into its own passes ([`Layer::take_following_relu`]), so a
/// layer of one's own must not call itself this.
pub const RELU_KIND: &str = "relu";

/// The kind of the SiLU layer ([`silu::Silu`]): what a graph looks for before a node that
/// may take the SiLU into its own passes ([`Layer::take_input_silu`]), so a layer of
/// one's own must not call itself this.
pub const SILU_KIND: &str = "silu";

/// One layer: forward and backward side by side.
///
/// Shapes include the batch: `forward` takes `(N, ...)` and returns `(N, ...)`. A layer
/// may cache what its backward needs during a `Mode::Train` forward; backward is called
/// at most once per forward, with `dout` shaped like forward's output.
pub trait Layer: Send {
    /// The kind, used to name the layer: layers are numbered per kind (`conv0`, `bn1`).
    fn kind(&self) -> &'static str;

    /// The output shape for an input shape (batch included), or an error naming the
    /// layer's expectation.
    fn output_shape(&self, input: &Shape) -> Result<Shape>;

    /// Trainable parameters, in a fixed order. Default: none.
    fn params(&self) -> Vec<ParamSpec> {
        Vec::new()
    }

    /// Non-trainable state saved with the weights (running statistics). Default: none.
    fn buffers(&self) -> Vec<ParamSpec> {
        Vec::new()
    }

    /// The parameters of [`Layer::params`] that are an earlier tensor of the model, by
    /// index and that tensor's full name (a language model's head whose weight is the
    /// token embedding's): `Sequential` lays each out once, at the earlier tensor's
    /// place, after checking that the shapes agree, and names the layer's own name of it
    /// an alias (`Sequential::aliases`). Default: none.
    fn tied(&self) -> Vec<(usize, String)> {
        Vec::new()
    }

    /// Checks the values of a batch this layer takes as the network's first layer, before
    /// a backend that reads them unchecked copies them (a GPU replica's staging, which
    /// calls it): an embedding's token ids. x: (N, *input) flattened, `input` the
    /// per-sample shape. Default: every value is fine.
    fn check_input(&self, _x: &[f32], _input: &Shape) -> Result<()> {
        Ok(())
    }

    /// Computes the output. `buffers` may be updated in `Mode::Train` (running stats).
    fn forward(&mut self, x: Tensor, params: Params<'_>, buffers: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor>;

    /// Accumulates parameter gradients into `dparams` and returns the input gradient
    /// (or `None` when `input_grad` is `Skip`).
    fn backward(
        &mut self,
        dout: Tensor,
        params: Params<'_>,
        dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        ctx: &Ctx,
    ) -> Result<Option<Tensor>>;

    /// A fresh copy of the layer (hyper-parameters only, no cache): one per replica.
    fn boxed_clone(&self) -> Box<dyn Layer>;

    /// A short description for summaries, e.g. `Conv2d(12, 3x3, same)`.
    fn describe(&self) -> String;

    /// How many inputs the layer takes. Default: one. A merge returns its arity and
    /// implements the `_many` forms below; its one-input forms then refuse
    /// ([`merge_takes_several`]), since a graph only ever calls the `_many` forms of a
    /// layer whose arity is not [`Arity::One`].
    fn arity(&self) -> Arity {
        Arity::One
    }

    /// The output shape for the shapes of its inputs (batch included), in the order its
    /// node names them. Default: the one-input form.
    fn output_shape_many(&self, inputs: &[Shape]) -> Result<Shape> {
        match inputs {
            [x] => self.output_shape(x),
            _ => Err(Error::config("model", format!("{} takes one input, given {}", self.describe(), inputs.len()))),
        }
    }

    /// The forward of several inputs (each `(N, ...)`), in the order of
    /// [`Layer::output_shape_many`]. Default: the one-input form.
    fn forward_many(
        &mut self,
        mut xs: Vec<Tensor>,
        params: Params<'_>,
        buffers: ParamsMut<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor> {
        match xs.len() {
            1 => self.forward(xs.pop().expect("one input"), params, buffers, ctx),
            n => Err(Error::config("model", format!("{} takes one input, given {n}", self.describe()))),
        }
    }

    /// The backward of several inputs: accumulates parameter gradients into `dparams` and
    /// returns each input's gradient, in the forward's order (None where `input_grads`
    /// says `Skip`). Default: the one-input form.
    fn backward_many(
        &mut self,
        dout: Tensor,
        params: Params<'_>,
        dparams: ParamsMut<'_>,
        input_grads: &[InputGrad],
        ctx: &Ctx,
    ) -> Result<Vec<Option<Tensor>>> {
        match input_grads {
            [g] => Ok(vec![self.backward(dout, params, dparams, *g, ctx)?]),
            _ => {
                Err(Error::config("model", format!("{} takes one input, given {}", self.describe(), input_grads.len())))
            }
        }
    }

    /// The computation as plain data, for backends other than the CPU's. Default: none
    /// (the layer runs on CPU devices only).
    /// The spec layer object that builds this layer again, its input channels and
    /// features inferred from the running shape as when parsing (`crate::spec`'s
    /// `model_to_spec`). Default: none, a layer of the user's own has no spec form.
    fn spec(&self) -> Option<serde_json::Value> {
        None
    }

    /// What a training pass of this layer holds, for per-sample shapes `shapes`: the
    /// memory estimate's term (`crate::memory`). Default: not stated, a layer of the
    /// user's own, counted as keeping nothing; every built-in layer states its own, which
    /// the spec's table test requires.
    fn memory(&self, _shapes: &LayerShapes) -> Option<LayerMemory> {
        None
    }

    /// This layer with its training statistics the global batch's, every logical
    /// replica's shard together (PyTorch's `SyncBatchNorm`), for a layer that normalises
    /// by batch statistics: what `convert_sync_batchnorm` puts in its place. Default:
    /// none, the layer has no statistics to synchronize.
    fn synchronized(&self) -> Option<Box<dyn Layer>> {
        None
    }

    /// For a layer whose training statistics are the global batch's: its channels, the
    /// width of what it exchanges with the other logical replicas in each forward and
    /// backward (`batchnorm::Synchronized`); for a container, its layers' in forward
    /// order (their backward exchanges run in the reverse order). Default: none.
    fn synchronized_channels(&self) -> Vec<usize> {
        Vec::new()
    }

    /// Told by its `Sequential` whether a ReLU layer follows this one; returns whether
    /// this layer then computes that ReLU in its own passes on the CPU (its forward clamps
    /// the values it writes, its backward masks the gradient it reads: bit for bit what
    /// the two layers compute one after the other), and the Sequential skips the ReLU
    /// layer. A GPU replica runs every layer as it is. Default: it does not.
    fn take_following_relu(&mut self, _follows: bool) -> bool {
        false
    }

    /// Told by its graph that its input `input` (of `inputs`) is the output of a SiLU
    /// that no other node reads; returns whether this layer then computes that SiLU in its
    /// own passes on the CPU (it receives the SiLU's input in its place, and returns the
    /// gradient of that input: bit for bit what the two layers compute one after the
    /// other), and the graph passes the SiLU node's value through unchanged. A GPU
    /// replica runs every layer as it is. Default: it does not.
    fn take_input_silu(&mut self, _input: usize, _inputs: usize) -> bool {
        false
    }

    /// For a Permute, its permutation of a sample's axes, counted from 1 (Keras's `dims`);
    /// None for every other layer. What a graph reads to find the transposes an attention
    /// may take over ([`Layer::take_head_transposes`]).
    fn permutation(&self) -> Option<&[usize]> {
        None
    }

    /// Told by its graph which of its inputs arrive through a Permute that swaps a
    /// sample's first two axes (`dims` [2, 1, 3]) and that no other node reads, and
    /// whether its output's one reader is such a Permute; returns whether this layer then
    /// reads those inputs, and writes its output, in the swapped layout on the CPU (bit
    /// for bit what the Permutes and the layer give one after the other), and the graph
    /// passes the Permutes' values and gradients through unchanged. A GPU replica runs
    /// every layer as it is. Default: it does not.
    fn take_head_transposes(&mut self, _inputs: &[bool], _output: bool) -> bool {
        false
    }

    /// For a container: starts (or restarts) timing the layers inside it, as
    /// `Sequential::start_profile` does its own. Default: nothing inside.
    fn start_profile(&mut self) {}

    /// For a container: the timings of the layers inside it since [`Layer::start_profile`],
    /// named within the container (a residual block's `conv1`, `short.0`), each row's own
    /// inner rows after it. Default: none.
    fn profile(&self) -> Vec<ProfileRow> {
        Vec::new()
    }

    /// The layer's GPU form (its launches and what it keeps on the device), built for
    /// each GPU replica; the GPU network dispatches through it. Default: none (the layer
    /// runs on CPU devices only, and a GPU run names it). Only with the `cuda` feature.
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn gpu::GpuLayer>> {
        None
    }
}

/// One layer's time in the passes since profiling started (`Sequential::profile`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileRow {
    /// Its name in the network, dotted below a container (`blocks.0.conv1`).
    pub name: String,
    /// [`Layer::describe`].
    pub description: String,
    /// 0 for the network's own layers, 1 for a container's, and so on.
    pub depth: usize,
    /// Its forward's time, summed over the passes (a container's includes its layers').
    pub forward: std::time::Duration,
    /// Its backward's time, likewise.
    pub backward: std::time::Duration,
}

/// For the crate's tests: a layer of a user's own, with a CPU implementation (the
/// identity) and no spec form, memory account or GPU form — what the spec format and the
/// GPU must refuse by name.
#[cfg(test)]
#[derive(Clone)]
pub(crate) struct CpuOnly;

#[cfg(test)]
impl Layer for CpuOnly {
    fn kind(&self) -> &'static str {
        "cpuonly"
    }
    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        Ok(input.clone())
    }
    fn forward(&mut self, x: Tensor, _: Params<'_>, _: ParamsMut<'_>, _: &Ctx) -> Result<Tensor> {
        Ok(x)
    }
    fn backward(
        &mut self,
        d: Tensor,
        _: Params<'_>,
        _: ParamsMut<'_>,
        _: InputGrad,
        _: &Ctx,
    ) -> Result<Option<Tensor>> {
        Ok(Some(d))
    }
    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }
    fn describe(&self) -> String {
        "CpuOnly".into()
    }
}
