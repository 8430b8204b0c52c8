//! [`Graph`]: a model as a directed acyclic graph of named nodes, each a layer applied to
//! the model's inputs or to earlier nodes' outputs; its engine (the forward in node order,
//! the backward in the reverse order, the gradient of a value read by several nodes summed
//! in that fixed order), the stable names of its tensors, their flat layout
//! ([`ParamStore`]), and which node runs inside the passes of another on the CPU (a ReLU
//! after a BatchNorm, [`Layer::take_following_relu`]; a SiLU before the multiplication
//! that reads it, [`Layer::take_input_silu`]; the transposes around an attention,
//! [`Layer::take_head_transposes`]: a pass over the activations fewer each way, the same
//! bits).
//!
//! How a graph is written is its builders': a chain of layers (`model::Sequential`), a
//! graph node by node (`model::functional`), a spec's layer objects with their `inbound`
//! names (`crate::spec`). Every one of them ends here, so a model is run one way.
//!
//! # Values and their gradients
//! A value is a model input or a node's output. The forward hands each value to its
//! readers in node order, moving it into its last reader and copying it for the others,
//! and drops it there: a value lives until its last reader's forward (what a node keeps
//! for its backward is its own, and its memory account says so). The backward walks the
//! nodes in reverse; a node's output gradient is complete when its turn comes, since every
//! reader comes after it. A value read by several nodes gets the sum of their input
//! gradients, added in the order the backward meets them (the readers' reverse node
//! order): one order on every device and every device count, so the sum is bitwise the
//! same everywhere. A node runs its backward only where a gradient is wanted: where it or
//! a node before it has parameters (or where the caller asks for the inputs' gradients).
//!
//! Names are the node's own where given, else its kind numbered per kind in order
//! (`conv0`, `bn0`, `conv1`, ..., `dense0`), then the tensor (`conv0.weight`,
//! `bn1.running_mean`): the names PyTorch's `state_dict` gives the reference models, so
//! weights move between the two by name.
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
use crate::ops::{
    Arity, Ctx, Init, InputGrad, Layer, LayerShapes, Mode, ParamSpec, Params, ParamsMut, ProfileRow, RELU_KIND,
    SILU_KIND,
};
use crate::rng::{derive_key, purpose, SplitMix64};
use crate::tensor::{Shape, Tensor};

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

/// Where a node reads one of its inputs: a model input, or an earlier node's output.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Source {
    /// The model's `k`-th input.
    Input(usize),
    /// The output of node `j` (an earlier node: nodes are in an order that reads only
    /// what is already computed).
    Node(usize),
}

/// One node of a graph to build: its layer, the name it is given (None: named by kind),
/// where it reads its inputs, in the order its layer takes them, and the index its
/// context carries (`Ctx::layer_index`, which dropout's masks derive from; None: its
/// position among the nodes).
pub struct GraphNode {
    pub name: Option<String>,
    pub layer: Box<dyn Layer>,
    pub inputs: Vec<Source>,
    pub layer_index: Option<usize>,
}

impl GraphNode {
    /// A node of `layer` named `name` (None: by kind) reading `inputs`, its context's
    /// index its position.
    pub fn new(name: Option<String>, layer: Box<dyn Layer>, inputs: Vec<Source>) -> GraphNode {
        GraphNode { name, layer, inputs, layer_index: None }
    }
}

/// A model: named nodes applied in an order that reads only what is computed (see the
/// file's docs); the last node's output is the model's.
pub struct Graph {
    /// The model inputs' names and per-sample shapes (no batch dimension).
    inputs: Vec<(String, Shape)>,
    layers: Vec<Box<dyn Layer>>,
    names: Vec<String>,
    /// Where each node reads its inputs.
    sources: Vec<Vec<Source>>,
    /// The index each node's context carries (`Ctx::layer_index`: dropout's masks derive
    /// from it): its position, unless its builder gave another (a residual block's nodes:
    /// `model::residual`).
    indices: Vec<usize>,
    /// How many times each node's output is read (by nodes; the last node's is also the
    /// model's output).
    readers: Vec<usize>,
    /// How many times each model input is read.
    input_readers: Vec<usize>,
    /// Per node: whether it or a node it reads from has parameters, so that its backward
    /// has a gradient to produce.
    trains: Vec<bool>,
    /// Per-sample input and output shapes of each node.
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
    /// Per-node (forward, backward) time, when profiling is on.
    profile: Option<Vec<(std::time::Duration, std::time::Duration)>>,
    /// Per node: the node that computes it in its own passes on the CPU (a ReLU after a
    /// BatchNorm or an add whose output nothing else reads, [`Layer::take_following_relu`];
    /// a SiLU whose one reader is a multiplication, [`Layer::take_input_silu`]; the Permutes
    /// that swap an attention's heads and positions before and after it,
    /// [`Layer::take_head_transposes`]). Such a node hands its input on unchanged in the
    /// forward, and its output's gradient in the backward.
    inside: Vec<Option<usize>>,
}

impl Clone for Graph {
    fn clone(&self) -> Self {
        let nodes = self
            .layers
            .iter()
            .zip(&self.names)
            .zip(&self.sources)
            .zip(&self.indices)
            .map(|(((l, n), s), &k)| GraphNode {
                name: Some(n.clone()),
                layer: l.boxed_clone(),
                inputs: s.clone(),
                layer_index: Some(k),
            })
            .collect();
        Graph::build(self.inputs.clone(), nodes).expect("a graph that was valid once stays valid")
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

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph").field("nodes", &self.names).finish()
    }
}

/// The name a graph gives its one model input when its builder names none: what a spec's
/// `inbound` calls it.
pub const INPUT_NAME: &str = "input";

impl Graph {
    /// The graph of `nodes` over model inputs `inputs` (each a name and a per-sample
    /// shape), the last node's output the model's. Checks, each refused by name: nodes
    /// that read a later node or no value at all, a layer given a number of inputs it does
    /// not take, shapes that do not meet, a value nobody reads (a node's output, other
    /// than the last, or a model input), and two tensors of one name (two nodes may share
    /// a name that prefixes different tensors).
    pub fn build(inputs: Vec<(String, Shape)>, nodes: Vec<GraphNode>) -> Result<Graph> {
        if inputs.is_empty() {
            return Err(Error::config("model", "a model needs at least one input"));
        }
        if nodes.is_empty() {
            return Err(Error::config("model", "a model needs at least one layer"));
        }
        let names = auto_names(nodes.iter().map(|n| (n.name.as_deref(), n.layer.kind())));
        let mut layers = Vec::with_capacity(nodes.len());
        let mut sources = Vec::with_capacity(nodes.len());
        let mut indices = Vec::with_capacity(nodes.len());
        for (j, n) in nodes.into_iter().enumerate() {
            layers.push(n.layer);
            sources.push(n.inputs);
            indices.push(n.layer_index.unwrap_or(j));
        }
        let value_name = |s: Source| match s {
            Source::Input(k) if inputs.len() == 1 => format!("the model's input {}", inputs[k].0),
            Source::Input(k) => format!("model input {}", inputs[k].0),
            Source::Node(j) => format!("node {}", names[j]),
        };
        let mut readers = vec![0usize; layers.len()];
        let mut input_readers = vec![0usize; inputs.len()];
        for (j, (srcs, layer)) in sources.iter().zip(&layers).enumerate() {
            if !layer.arity().admits(srcs.len()) {
                return Err(Error::config(
                    "model",
                    format!("node {}: {} takes {}, given {}", names[j], layer.describe(), layer.arity(), srcs.len()),
                ));
            }
            for &s in srcs {
                match s {
                    Source::Input(k) if k < inputs.len() => input_readers[k] += 1,
                    Source::Node(i) if i < j => readers[i] += 1,
                    Source::Input(k) => {
                        return Err(Error::config(
                            "model",
                            format!("node {} reads model input {k}, and the model has {}", names[j], inputs.len()),
                        ))
                    }
                    Source::Node(i) if i == j => {
                        return Err(Error::config("model", format!("node {} reads its own output", names[j])))
                    }
                    Source::Node(i) => {
                        return Err(Error::config(
                            "model",
                            format!(
                                "node {} reads node {}, which comes after it: nodes must be in an order that reads only what is computed",
                                names[j],
                                names.get(i).map_or_else(|| format!("#{i} (there are {})", names.len()), String::clone),
                            ),
                        ))
                    }
                }
            }
        }
        let last = layers.len() - 1;
        if let Some(j) = (0..last).find(|&j| readers[j] == 0) {
            return Err(Error::config(
                "model",
                format!(
                    "node {}'s output is read by no node and is not the model's output (the last node's, {}): remove it, or give it to a later node",
                    names[j], names[last]
                ),
            ));
        }
        if let Some(k) = input_readers.iter().position(|&r| r == 0) {
            return Err(Error::config("model", format!("model input {} is read by no node", inputs[k].0)));
        }
        let mut inside = vec![None; layers.len()];
        for i in 0..layers.len() {
            let follows = layers.get(i + 1).is_some_and(|next| next.kind() == RELU_KIND)
                && sources[i + 1] == [Source::Node(i)]
                && readers[i] == 1;
            if layers[i].take_following_relu(follows) && follows {
                inside[i + 1] = Some(i);
            }
        }
        for s in 0..layers.len() {
            if layers[s].kind() != SILU_KIND || readers[s] != 1 || inside[s].is_some() {
                continue;
            }
            let Some(m) = (s + 1..layers.len()).find(|&m| sources[m].contains(&Source::Node(s))) else { continue };
            let input = sources[m].iter().position(|&src| src == Source::Node(s)).expect("found just above");
            if layers[m].take_input_silu(input, sources[m].len()) {
                inside[s] = Some(m);
            }
        }
        // Permutes that swap a sample's first two axes around a node that reads and writes
        // that layout itself (an attention's heads): `take_head_transposes`.
        let swap: Vec<bool> = layers.iter().map(|l| l.permutation() == Some(&[2, 1, 3][..])).collect();
        let swaps = |i: usize, inside: &[Option<usize>]| swap[i] && inside[i].is_none();
        for m in 0..layers.len() {
            if inside[m].is_some() || layers[m].permutation().is_some() {
                continue;
            }
            let through: Vec<Option<usize>> = sources[m]
                .iter()
                .map(|&src| match src {
                    Source::Node(p) if readers[p] == 1 && swaps(p, &inside) => Some(p),
                    _ => None,
                })
                .collect();
            let reader = match readers[m] {
                1 => (m + 1..layers.len()).find(|&r| sources[r].contains(&Source::Node(m))),
                _ => None,
            };
            let output = reader.filter(|&r| swaps(r, &inside));
            if through.iter().all(Option::is_none) && output.is_none() {
                continue;
            }
            let inputs: Vec<bool> = through.iter().map(Option::is_some).collect();
            if layers[m].take_head_transposes(&inputs, output.is_some()) {
                for p in through.into_iter().flatten().chain(output) {
                    inside[p] = Some(m);
                }
            }
        }
        // Shapes are checked with a batch of 2: BatchNorm needs more than one value.
        let mut out_shapes: Vec<Shape> = Vec::with_capacity(layers.len());
        let mut shapes = Vec::with_capacity(layers.len());
        for (j, layer) in layers.iter().enumerate() {
            let ins: Vec<Shape> = sources[j]
                .iter()
                .map(|&s| match s {
                    Source::Input(k) => batched(2, &inputs[k].1),
                    Source::Node(i) => out_shapes[i].clone(),
                })
                .collect();
            let out = layer.output_shape_many(&ins).map_err(|e| {
                let what = match sources[j].as_slice() {
                    [_] => String::new(),
                    srcs => format!(
                        " (its inputs: {})",
                        srcs.iter()
                            .zip(&ins)
                            .map(|(&s, sh)| format!("{} {}", value_name(s), Shape::new(&sh.dims()[1..])))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                };
                Error::config("model", format!("layer {}{what}: {e}", names[j]))
            })?;
            let per_sample = |sh: &Shape| Shape::new(&sh.dims()[1..]);
            shapes.push(LayerShapes {
                input: per_sample(&ins[0]),
                output: per_sample(&out),
                other_inputs: ins[1..].iter().map(per_sample).collect(),
            });
            out_shapes.push(out);
        }
        let mut trains = vec![false; layers.len()];
        for j in 0..layers.len() {
            trains[j] =
                !layers[j].params().is_empty() || sources[j].iter().any(|&s| matches!(s, Source::Node(i) if trains[i]));
        }
        let (slots, params, buffers, aliases, p_off, b_off) = lay_out(&layers, &names)?;
        let (params_len, buffers_len) = (p_off.next_multiple_of(TENSOR_ALIGN), b_off.next_multiple_of(TENSOR_ALIGN));
        Ok(Graph {
            inputs,
            layers,
            names,
            sources,
            indices,
            readers,
            input_readers,
            trains,
            shapes,
            slots,
            params,
            buffers,
            aliases,
            params_len,
            buffers_len,
            profile: None,
            inside,
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

    /// Index of the first node that has parameters: in a chain, backward stops there (the
    /// nodes before it need no gradient, and it needs none of its input).
    pub fn first_trained_layer(&self) -> usize {
        self.slots.iter().position(|s| !s.param_span.is_empty()).unwrap_or(0)
    }

    /// Whether node `j` or a node it reads from has parameters: its backward has a
    /// gradient to produce.
    pub fn trains(&self, j: usize) -> bool {
        self.trains[j]
    }

    /// Per-sample shape of the (first) model input.
    pub fn input_shape(&self) -> &Shape {
        &self.inputs[0].1
    }

    /// The model inputs' names and per-sample shapes.
    pub fn inputs(&self) -> &[(String, Shape)] {
        &self.inputs
    }

    /// Per-sample output shape (the number of classes for a classifier): the last node's.
    pub fn output_shape(&self) -> &Shape {
        &self.shapes.last().expect("a graph has a node").output
    }

    /// Where each node reads its inputs, in node order.
    pub fn sources(&self) -> &[Vec<Source>] {
        &self.sources
    }

    /// Whether the graph is a chain: one model input, each node reading only the one
    /// before it (the first the input).
    pub fn is_chain(&self) -> bool {
        self.inputs.len() == 1
            && self.sources.iter().enumerate().all(|(j, s)| match j {
                0 => s == &[Source::Input(0)],
                _ => s == &[Source::Node(j - 1)],
            })
    }

    /// The index node `j`'s context carries (`Ctx::layer_index`; a GPU replica's
    /// `Placement::index`): dropout's masks derive from it.
    pub fn layer_index(&self, j: usize) -> usize {
        self.indices[j]
    }

    /// Whether node `j` runs inside another node's passes (a ReLU taken over by the
    /// BatchNorm or the add before it, [`Layer::take_following_relu`]; a SiLU taken over
    /// by the multiplication that reads it, [`Layer::take_input_silu`]; a transpose taken
    /// over by the attention it feeds or follows, [`Layer::take_head_transposes`]), so
    /// that what it keeps is that node's to count, not its own.
    pub fn runs_inside_another(&self, j: usize) -> bool {
        self.inside[j].is_some()
    }

    /// How many nodes read node `j`'s output.
    pub fn readers(&self, j: usize) -> usize {
        self.readers[j]
    }

    /// Node names, in order.
    pub fn layer_names(&self) -> &[String] {
        &self.names
    }

    /// The nodes' layers, in order.
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
    /// [`Graph::param_infos`] of the tensor it names: a tied layer's own name of the
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
    /// file's docs). How many values are trained is [`Graph::num_params`].
    pub fn params_len(&self) -> usize {
        self.params_len
    }

    /// Length of the flat buffer of running statistics, gaps included.
    pub fn buffers_len(&self) -> usize {
        self.buffers_len
    }

    /// Number of trainable values (what PyTorch's `numel` sum over parameters counts):
    /// [`Graph::params_len`] without the gaps.
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

    /// Runs every node on `x`, the model's one input. x: (N, *input_shape) →
    /// (N, *output_shape). `ctx.layer_index` is set per node.
    pub fn forward(&mut self, x: Tensor, params: &[f32], buffers: &mut [f32], ctx: &Ctx) -> Result<Tensor> {
        self.forward_many(vec![x], params, buffers, ctx)
    }

    /// Runs every node on the model's inputs `xs`, in the order of [`Graph::inputs`].
    pub fn forward_many(&mut self, xs: Vec<Tensor>, params: &[f32], buffers: &mut [f32], ctx: &Ctx) -> Result<Tensor> {
        if matches!(ctx.device, crate::tensor::Device::Cuda(_)) {
            return Err(Error::config(
                "device",
                format!("Graph::forward runs the CPU layers; on {} a model runs as a GPU replica", ctx.device),
            ));
        }
        if xs.len() != self.inputs.len() {
            return Err(Error::config(
                "model",
                format!("the model takes {} inputs ({}), given {}", self.inputs.len(), self.input_list(), xs.len()),
            ));
        }
        if let Some(x) = xs.iter().find(|x| x.device() != ctx.device) {
            return Err(Error::DeviceMismatch {
                op: "Graph forward",
                lhs: x.device().to_string(),
                rhs: format!("{} (the model's)", ctx.device),
            });
        }
        self.forward_nodes(xs, params, buffers, ctx)
    }

    fn input_list(&self) -> String {
        self.inputs.iter().map(|(n, s)| format!("{n} {s}")).collect::<Vec<_>>().join(", ")
    }

    /// The forward of every node, in node order.
    fn forward_nodes(&mut self, xs: Vec<Tensor>, params: &[f32], buffers: &mut [f32], ctx: &Ctx) -> Result<Tensor> {
        let mut inputs: Vec<Option<Tensor>> = xs.into_iter().map(Some).collect();
        let mut input_left = self.input_readers.clone();
        let mut values: Vec<Option<Tensor>> = (0..self.layers.len()).map(|_| None).collect();
        let mut left = self.readers.clone();
        for (j, (layer, s)) in self.layers.iter_mut().zip(&self.slots).enumerate() {
            // Each value moves into its last reader and is copied for the others.
            let mut args = Vec::with_capacity(self.sources[j].len());
            for &src in &self.sources[j] {
                let (slot, left) = match src {
                    Source::Input(k) => (&mut inputs[k], &mut input_left[k]),
                    Source::Node(i) => (&mut values[i], &mut left[i]),
                };
                *left -= 1;
                let v = if *left == 0 { slot.take() } else { slot.clone() };
                args.push(v.expect("a value is kept until its last reader"));
            }
            if self.inside[j].is_some() {
                // Another node applies it: the value goes on as it came.
                values[j] = args.pop();
                continue;
            }
            let ctx = Ctx { layer_index: self.indices[j], ..*ctx };
            let p = Params::new(&params[s.param_span.clone()], &s.param_ranges);
            let b = ParamsMut::new(&mut buffers[s.buffer_span.clone()], &s.buffer_ranges);
            let t = self.profile.is_some().then(std::time::Instant::now);
            let y = match layer.arity() {
                Arity::One => layer.forward(args.pop().expect("one input"), p, b, &ctx)?,
                _ => layer.forward_many(args, p, b, &ctx)?,
            };
            if let (Some(prof), Some(t)) = (self.profile.as_mut(), t) {
                prof[j].0 += t.elapsed();
            }
            values[j] = Some(y);
        }
        Ok(values.pop().flatten().expect("the last node's output is the model's"))
    }

    /// Back-propagates `dout` (the gradient of the loss with respect to the output of the
    /// last forward, which must have run in `Mode::Train`), accumulating into `grads`.
    pub fn backward(&mut self, dout: Tensor, params: &[f32], grads: &mut [f32], ctx: &Ctx) -> Result<()> {
        self.backward_nodes(dout, params, grads, ctx, InputGrad::Skip).map(drop)
    }

    /// [`Graph::backward`] that also returns the gradient of the model's one input, dx:
    /// (N, *input_shape) (every node runs its backward).
    pub fn backward_input(&mut self, dout: Tensor, params: &[f32], grads: &mut [f32], ctx: &Ctx) -> Result<Tensor> {
        let mut dx = self.backward_inputs(dout, params, grads, ctx)?;
        if dx.len() != 1 {
            return Err(Error::config("model", format!("the model has {} inputs ({})", dx.len(), self.input_list())));
        }
        Ok(dx.pop().expect("one input"))
    }

    /// [`Graph::backward`] that also returns the gradient of every model input, in the
    /// order of [`Graph::inputs`].
    pub fn backward_inputs(
        &mut self,
        dout: Tensor,
        params: &[f32],
        grads: &mut [f32],
        ctx: &Ctx,
    ) -> Result<Vec<Tensor>> {
        let d = self.backward_nodes(dout, params, grads, ctx, InputGrad::Needed)?;
        Ok(d.into_iter().map(|d| d.expect("a backward asked for its inputs' gradients returns them")).collect())
    }

    /// The backward of every node, in reverse node order, returning the gradient of each
    /// model input when `input_grad` asks for them (None otherwise). Without them, a node
    /// runs its backward only where it or a node before it has parameters, and is asked
    /// for the gradient of no value that needs none.
    fn backward_nodes(
        &mut self,
        dout: Tensor,
        params: &[f32],
        grads: &mut [f32],
        ctx: &Ctx,
        input_grad: InputGrad,
    ) -> Result<Vec<Option<Tensor>>> {
        let all = input_grad == InputGrad::Needed;
        let n = self.layers.len();
        let mut d: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
        let mut d_inputs: Vec<Option<Tensor>> = (0..self.inputs.len()).map(|_| None).collect();
        d[n - 1] = Some(dout);
        for j in (0..n).rev() {
            if !(all || self.trains[j]) {
                continue;
            }
            let (layer, s) = (&mut self.layers[j], &self.slots[j]);
            let needs: Vec<InputGrad> = self.sources[j]
                .iter()
                .map(|&src| match src {
                    Source::Input(_) => input_grad,
                    Source::Node(i) if all || self.trains[i] => InputGrad::Needed,
                    Source::Node(_) => InputGrad::Skip,
                })
                .collect();
            let ctx = Ctx { mode: Mode::Train, layer_index: self.indices[j], ..*ctx };
            let p = Params::new(&params[s.param_span.clone()], &s.param_ranges);
            let g = ParamsMut::new(&mut grads[s.param_span.clone()], &s.param_ranges);
            let dy = d[j].take().expect("every reader of a node that trains comes after it and trains");
            // A node inside another's passes has no time of its own to profile.
            let t = (self.profile.is_some() && self.inside[j].is_none()).then(std::time::Instant::now);
            let dxs = match layer.arity() {
                // Another node's backward went through it: the gradient goes on as it came.
                _ if self.inside[j].is_some() => vec![Some(dy)],
                Arity::One => vec![layer.backward(dy, p, g, needs[0], &ctx)?],
                _ => layer.backward_many(dy, p, g, &needs, &ctx)?,
            };
            if let (Some(prof), Some(t)) = (self.profile.as_mut(), t) {
                prof[j].1 += t.elapsed();
            }
            for ((&src, dx), need) in self.sources[j].iter().zip(dxs).zip(needs) {
                let Some(dx) = dx.filter(|_| need == InputGrad::Needed) else { continue };
                let slot = match src {
                    Source::Input(k) => &mut d_inputs[k],
                    Source::Node(i) => &mut d[i],
                };
                accumulate(slot, dx)?;
            }
        }
        Ok(d_inputs)
    }

    /// Starts (or restarts) timing every layer's forward and backward, inside containers
    /// too.
    pub fn start_profile(&mut self) {
        self.profile = Some(vec![Default::default(); self.layers.len()]);
        self.layers.iter_mut().for_each(|l| l.start_profile());
    }

    /// The time of every layer since [`Graph::start_profile`], in forward order, each
    /// container's layers after its own row (a level deeper, named below it); empty when
    /// profiling is off.
    pub fn profile(&self) -> Vec<ProfileRow> {
        let mut rows = Vec::new();
        let layers = self.layers.iter().zip(&self.names);
        for (i, (&(forward, backward), (layer, name))) in self.profile.iter().flatten().zip(layers).enumerate() {
            let description = match self.inside[i] {
                Some(m) if m + 1 == i => format!("{} (in the previous layer's passes)", layer.describe()),
                Some(m) => format!("{} (in {}'s passes)", layer.describe(), self.names[m]),
                None => layer.describe(),
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

    /// A one-line-per-node summary under a header: name, description, output shape,
    /// parameter count; for a graph that is not a chain, each node's inputs too (the values
    /// it reads, by node name, or the model input's).
    pub fn summary(&self) -> String {
        let chain = self.is_chain();
        let inputs_head = if chain { String::new() } else { format!("{:<24} ", "inputs") };
        let mut out = format!("{:<12} {:<36} {inputs_head}{:<16} {:>8}\n", "node", "op", "output", "params");
        for (j, (layer, name)) in self.layers.iter().zip(&self.names).enumerate() {
            let inputs = match chain {
                true => String::new(),
                false => {
                    let names: Vec<&str> = self.sources[j]
                        .iter()
                        .map(|&s| match s {
                            Source::Input(k) => self.inputs[k].0.as_str(),
                            Source::Node(i) => self.names[i].as_str(),
                        })
                        .collect();
                    format!("{:<24} ", names.join(", "))
                }
            };
            out.push_str(&format!(
                "{name:<12} {:<36} {inputs}{:<16} {:>8}\n",
                layer.describe(),
                self.shapes[j].output.to_string(),
                self.slots[j].param_ranges.iter().map(|r| r.len()).sum::<usize>()
            ));
        }
        out.push_str(&format!("total trainable parameters: {}\n", self.num_params()));
        out
    }
}

/// What [`lay_out`] returns: each node's slots, the parameters', buffers' and aliases'
/// records, and the flat buffers' ends.
type Layout = (Vec<Slots>, Vec<TensorInfo>, Vec<TensorInfo>, Vec<(String, usize)>, usize, usize);

/// Lays every node's tensors out in the flat buffers, in node order (see the file's
/// docs), a tied parameter at its earlier tensor's place; refuses two tensors of one name.
fn lay_out(layers: &[Box<dyn Layer>], names: &[String]) -> Result<Layout> {
    let mut slots = Vec::with_capacity(layers.len());
    let (mut params, mut buffers) = (Vec::new(), Vec::new());
    let mut aliases = Vec::new();
    let (mut p_off, mut b_off) = (0, 0);
    for (layer, name) in layers.iter().zip(names) {
        let lay = |specs: Vec<ParamSpec>, off: &mut usize, infos: &mut Vec<TensorInfo>| {
            if specs.is_empty() {
                // No tensors: an empty span.
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
                        params.push(TensorInfo { name: own, shape: spec.shape, range: range.clone(), init: spec.init });
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
    Ok((slots, params, buffers, aliases, p_off, b_off))
}

/// Adds the gradient `dx` of a value into what its later readers gave it (`slot`): the
/// first gradient moves in, the others are added one value at a time, in the order the
/// backward meets them.
fn accumulate(slot: &mut Option<Tensor>, dx: Tensor) -> Result<()> {
    match slot {
        None => *slot = Some(dx),
        Some(sum) => {
            if sum.shape() != dx.shape() {
                return Err(Error::shape("a value's gradient", format!("{} + {}", sum.shape(), dx.shape())));
            }
            for (s, d) in sum.host_mut().iter_mut().zip(dx.host()) {
                *s += d;
            }
        }
    }
    Ok(())
}

/// `(n, *sample)`.
pub(crate) fn batched(n: usize, sample: &Shape) -> Shape {
    let mut d = Vec::with_capacity(sample.ndim() + 1);
    d.push(n);
    d.extend_from_slice(sample.dims());
    Shape::new(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{merge_takes_several, Arity, Linear, Relu};
    use crate::tensor::Device;

    /// A merge for these tests alone: y = a + 2·b, so that the two inputs' gradients
    /// differ (dout and 2·dout).
    #[derive(Clone)]
    struct Sum2;

    impl Layer for Sum2 {
        fn kind(&self) -> &'static str {
            "sum"
        }
        fn arity(&self) -> Arity {
            Arity::Exactly(2)
        }
        fn output_shape(&self, _: &Shape) -> Result<Shape> {
            merge_takes_several("Sum2", self.arity())
        }
        fn output_shape_many(&self, inputs: &[Shape]) -> Result<Shape> {
            match inputs {
                [a, b] if a == b => Ok(a.clone()),
                _ => Err(Error::shape("Sum2", format!("{inputs:?} do not meet"))),
            }
        }
        fn forward(&mut self, _: Tensor, _: Params<'_>, _: ParamsMut<'_>, _: &Ctx) -> Result<Tensor> {
            merge_takes_several("Sum2", self.arity())
        }
        fn forward_many(&mut self, xs: Vec<Tensor>, _: Params<'_>, _: ParamsMut<'_>, _: &Ctx) -> Result<Tensor> {
            let [mut a, b]: [Tensor; 2] = xs.try_into().expect("two inputs");
            for (a, b) in a.host_mut().iter_mut().zip(b.host()) {
                *a += 2.0 * b;
            }
            Ok(a)
        }
        fn backward(
            &mut self,
            _: Tensor,
            _: Params<'_>,
            _: ParamsMut<'_>,
            _: InputGrad,
            _: &Ctx,
        ) -> Result<Option<Tensor>> {
            merge_takes_several("Sum2", self.arity())
        }
        fn backward_many(
            &mut self,
            dout: Tensor,
            _: Params<'_>,
            _: ParamsMut<'_>,
            needs: &[InputGrad],
            _: &Ctx,
        ) -> Result<Vec<Option<Tensor>>> {
            let mut db = dout.clone();
            db.host_mut().iter_mut().for_each(|v| *v *= 2.0);
            let keep = |t: Tensor, g: InputGrad| (g == InputGrad::Needed).then_some(t);
            Ok(vec![keep(dout, needs[0]), keep(db, needs[1])])
        }
        fn boxed_clone(&self) -> Box<dyn Layer> {
            Box::new(Sum2)
        }
        fn describe(&self) -> String {
            "Sum2".into()
        }
    }

    fn node(layer: impl Layer + 'static, inputs: &[Source]) -> GraphNode {
        GraphNode::new(None, Box::new(layer), inputs.to_vec())
    }

    /// x → dense0 → relu0 ─┬─ dense1 ─┐
    ///                     └──────────┴─ sum(dense1, relu0) → dense2
    /// relu0's output is read twice: its gradient is the sum of dense1's and the merge's.
    fn diamond() -> Graph {
        let input = vec![(INPUT_NAME.to_string(), Shape::new([3]))];
        let nodes = vec![
            node(Linear::new(3, 4), &[Source::Input(0)]),
            node(Relu::new(), &[Source::Node(0)]),
            node(Linear::new(4, 4), &[Source::Node(1)]),
            node(Sum2, &[Source::Node(2), Source::Node(1)]),
            node(Linear::new(4, 2), &[Source::Node(3)]),
        ];
        Graph::build(input, nodes).unwrap()
    }

    /// The loss L = Σ w·y of the diamond at `params`, in f64.
    fn loss(g: &mut Graph, x: &Tensor, params: &[f32], w: &[f32]) -> f64 {
        let y = g.forward(x.clone(), params, &mut [], &Ctx::train(1, 0, 0, Device::Cpu(0))).unwrap();
        y.host().iter().zip(w).map(|(&y, &w)| y as f64 * w as f64).sum()
    }

    #[test]
    fn a_value_read_twice_gets_the_sum_of_its_readers_gradients() {
        let mut g = diamond();
        assert!(!g.is_chain());
        assert_eq!(g.readers(1), 2);
        let params = g.init(3).params;
        let x = Tensor::from_vec(crate::testing::uniform(4, 2 * 3), [2, 3]).unwrap();
        let w = crate::testing::uniform(5, 2 * 2);
        let ctx = Ctx::train(1, 0, 0, Device::Cpu(0));
        let y = g.forward(x.clone(), &params, &mut [], &ctx).unwrap();
        let mut grads = vec![0.0; params.len()];
        let dx = g.backward_input(Tensor::from_vec(w.clone(), y.shape().clone()).unwrap(), &params, &mut grads, &ctx);
        let dx = dx.unwrap();
        // Central differences in f64 of an f32 forward: h = 1e-2 on values of unit
        // scale; the forward's rounding (~1e-7 relative) over 2h leaves ~1e-5, and the
        // ReLU's kink is met by no value here (checked: none within h of 0).
        let h = 1e-2f32;
        for info in g.param_infos().to_vec() {
            for i in info.range.clone() {
                let (mut p, mut m) = (params.clone(), params.clone());
                p[i] += h;
                m[i] -= h;
                let numeric = (loss(&mut g, &x, &p, &w) - loss(&mut g, &x, &m, &w)) / (2.0 * h as f64);
                let a = grads[i] as f64;
                assert!((a - numeric).abs() <= 1e-3 + 1e-2 * a.abs(), "{}[{i}]: {a} vs {numeric}", info.name);
            }
        }
        for i in 0..x.numel() {
            let at = |d: f32| {
                let mut v = x.host().to_vec();
                v[i] += d;
                Tensor::from_vec(v, [2, 3]).unwrap()
            };
            let numeric = (loss(&mut g, &at(h), &params, &w) - loss(&mut g, &at(-h), &params, &w)) / (2.0 * h as f64);
            let a = dx.host()[i] as f64;
            assert!((a - numeric).abs() <= 1e-3 + 1e-2 * a.abs(), "dx[{i}]: {a} vs {numeric}");
        }
        // The same step again gives the same bits: one order of every sum.
        let mut again = vec![0.0; params.len()];
        let y = g.forward(x.clone(), &params, &mut [], &ctx).unwrap();
        g.backward(Tensor::from_vec(w, y.shape().clone()).unwrap(), &params, &mut again, &ctx).unwrap();
        crate::testing::assert_bits("the gradient of a second step", &again, &grads);
    }

    #[test]
    fn a_chain_is_a_graph_of_one_reader_a_value() {
        let chain =
            crate::model::Sequential::new([3], vec![Box::new(Linear::new(3, 4)), Box::new(Relu::new())]).unwrap();
        assert!(chain.is_chain());
        assert_eq!(chain.sources(), &[vec![Source::Input(0)], vec![Source::Node(0)]]);
        assert!(chain.summary().lines().nth(1).unwrap().starts_with("dense0"));
        assert!(!chain.summary().contains("inputs"));
        // The diamond's summary names each node's inputs.
        let summary = diamond().summary();
        assert!(summary.starts_with("node") && summary.lines().next().unwrap().contains("inputs"), "{summary}");
        let line = summary.lines().find(|l| l.starts_with("sum0")).unwrap();
        assert!(line.contains("dense1, relu0"), "{summary}");
    }

    #[test]
    fn bad_graphs_are_refused_naming_the_node() {
        let input = || vec![(INPUT_NAME.to_string(), Shape::new([3]))];
        let err = |nodes: Vec<GraphNode>| Graph::build(input(), nodes).expect_err("refused").to_string();
        // A node whose output nothing reads.
        let e = err(vec![node(Linear::new(3, 4), &[Source::Input(0)]), node(Linear::new(3, 2), &[Source::Input(0)])]);
        assert!(e.contains("node dense0's output is read by no node") && e.contains("dense1"), "{e}");
        // A node that reads a later one (a cycle, written in order).
        let e = err(vec![node(Sum2, &[Source::Input(0), Source::Node(1)]), node(Relu::new(), &[Source::Node(0)])]);
        assert!(e.contains("node sum0 reads node relu0, which comes after it"), "{e}");
        // A merge given one input; a layer of one input given two.
        let e = err(vec![node(Sum2, &[Source::Input(0)])]);
        assert!(e.contains("node sum0: Sum2 takes 2 inputs, given 1"), "{e}");
        let e = err(vec![node(Relu::new(), &[Source::Input(0), Source::Input(0)])]);
        assert!(e.contains("takes one input, given 2"), "{e}");
        // Shapes that do not meet at a merge: both inputs and their shapes named.
        let e =
            err(vec![node(Linear::new(3, 4), &[Source::Input(0)]), node(Sum2, &[Source::Node(0), Source::Input(0)])]);
        assert!(e.contains("layer sum0 (its inputs: node dense0 (4), the model's input input (3))"), "{e}");
        // A model input nobody reads.
        let two = vec![(INPUT_NAME.to_string(), Shape::new([3])), ("positions".to_string(), Shape::new([3]))];
        let e = Graph::build(two, vec![node(Relu::new(), &[Source::Input(0)])]).err().unwrap().to_string();
        assert!(e.contains("model input positions is read by no node"), "{e}");
    }

    #[test]
    fn two_model_inputs_each_get_their_gradient() {
        let inputs = vec![("a".to_string(), Shape::new([2])), ("b".to_string(), Shape::new([2]))];
        let mut g = Graph::build(
            inputs,
            vec![node(Sum2, &[Source::Input(0), Source::Input(1)]), node(Linear::new(2, 1), &[Source::Node(0)])],
        )
        .unwrap();
        let params = g.init(1).params;
        let ctx = Ctx::train(1, 0, 0, Device::Cpu(0));
        let a = Tensor::from_vec(vec![1.0, 2.0], [1, 2]).unwrap();
        let b = Tensor::from_vec(vec![3.0, 4.0], [1, 2]).unwrap();
        let e = g.forward(a.clone(), &params, &mut [], &ctx).err().unwrap().to_string();
        assert!(e.contains("the model takes 2 inputs (a (2), b (2)), given 1"), "{e}");
        let y = g.forward_many(vec![a, b], &params, &mut [], &ctx).unwrap();
        let mut grads = vec![0.0; params.len()];
        let d = g.backward_inputs(Tensor::from_vec(vec![1.0], y.shape().clone()).unwrap(), &params, &mut grads, &ctx);
        let d = d.unwrap();
        // y = w·(a + 2b) + c: dy/da = w, dy/db = 2w.
        let w = &params[g.param_infos()[0].range.clone()];
        assert_eq!(d[0].host(), w);
        assert_eq!(d[1].host(), &[2.0 * w[0], 2.0 * w[1]]);
    }

    /// The Llama's SwiGLU SiLUs run in their products, its attentions' transposes in the
    /// attentions; a SiLU or a transpose that a second node reads runs as itself.
    #[test]
    fn nodes_run_inside_their_reader_or_attention_only_where_nothing_else_reads_them() {
        use crate::model::functional::{Call, Value};
        use crate::ops::{AttentionMask, Multiply, Permute, ScaledDotProductAttention, Silu};
        let llama = crate::models::llama(crate::models::LlamaConfig::new(8, 16, 2, 2, 8)).unwrap();
        let inside: Vec<&str> = (0..llama.layers().len())
            .filter(|&j| llama.runs_inside_another(j))
            .map(|j| llama.layer_names()[j].as_str())
            .collect();
        let per_layer = ["attention.q_t", "attention.k_t", "attention.v_t", "attention.y_t", "feed_forward.silu"];
        let want: Vec<String> = (0..2).flat_map(|i| per_layer.map(|n| format!("layers.{i}.{n}"))).collect();
        assert_eq!(inside, want);

        // A SiLU also read by the product's other side, a transpose also read by the output.
        let x = Value::input([4, 2, 3]);
        let s = Silu::new().named("s").call(&x);
        let gated = Multiply::new().named("gate").call_many(&[&s, &s]);
        let swapped = Permute::new(&[2, 1, 3]).unwrap().named("t").call(&gated);
        let y = ScaledDotProductAttention::new(AttentionMask::Causal)
            .named("sdpa")
            .call_many(&[&swapped, &swapped, &swapped]);
        let y = Permute::new(&[2, 1, 3]).unwrap().named("back").call(&y);
        let g = Multiply::new().named("out").call_many(&[&y, &x]).model().unwrap();
        assert!((0..g.layers().len()).all(|j| !g.runs_inside_another(j)), "nothing runs inside another");
    }
}
