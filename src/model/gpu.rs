//! A network on one GPU: parameters, BatchNorm buffers and optimiser state in flat
//! device buffers, each layer run by its op's GPU form (`ops::gpu`'s [`GpuLayer`]).
//!
//! Owns: [`GpuNet`], the device half of a GPU replica (DESIGN.md: one thread per device,
//! each with its context, stream and full replica): the buffers — flat parameters and
//! buffers, optimiser state, activations, staging — and the dispatch that walks the layers
//! forward and backward. What a step is — which shards, which slots, when to sum — is the
//! trainer's (`train::gpu` drives this through the one step of `train::step`); what each
//! layer launches is its op's (`ops::conv2d`, `ops::batchnorm`, ...): nothing here names an
//! op. The network is the same [`Graph`] the CPU replica runs. Flat buffers use the
//! CPU layout exactly (`Graph::layer_ranges`), so weights, checkpoints and replica
//! fingerprints move between the backends unchanged. That layout starts every tensor, and
//! sizes every flat buffer, on a multiple of 64 f32 (`model::graph`'s `TENSOR_ALIGN`,
//! which says why): device allocations and the exchange's slots are 256-byte aligned, so
//! every tensor view handed to cuBLAS or a kernel starts on a 256-byte boundary, on
//! `cuda:0` with several slots as on `cuda:0,0`. Two tensors of one layer are therefore
//! not adjacent (BatchNorm's gamma and beta, its running mean and variance).
//!
//! Everything is queued on the one compute stream without waiting: staging a step's rows
//! (one copy from pinned host memory), each shard's forward, fused softmax cross-entropy
//! and backward into a slot it is given, the fused optimiser over pieces of a sum. The
//! host waits in [`GpuNet::wait`] (polling an abort flag, so an abort releases it) and in
//! the reads (losses, evaluation, snapshots) — and, with synchronized BatchNorm, inside
//! the passes, where that op's GPU form meets the other logical replicas' statistics on
//! the host (`ops::batchnorm`).
//!
//! Activations are NCHW as on the CPU: `acts[k]` the model's input k (one for a chain),
//! `acts[I + i]` node i's output, I the model's inputs (a graph's node reads the values
//! of its inputs there); a chain's backward
//! alternates between two gradient buffers sized for the widest layer, a graph's gives
//! each value a gradient buffer and sums a value's several readers' gradients in the
//! CPU's order (`Net::backward_graph`);
//! one scratch buffer, the widest op's request, serves every op inside its passes. Parameter
//! gradients of a shard are written once per step into its zeroed slot.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, PinnedHostSlice};

use super::{Graph, ParamStore};
use crate::cuda::Gpu;
use crate::model::Source;
use crate::ops::batchnorm::Synchronized;
use crate::ops::cross_entropy::{check_labels, CrossEntropy};
use crate::ops::gpu::{poll, Backward, Draw, Forward, GpuLayer, Pass, Placement, SyncWith};
use crate::ops::LayerShapes;
use crate::optim::{OptimizerConfig, StepScalars};
use crate::{Error, Result};

/// One node as the GPU runs it: where it lies, its op's GPU form, where it reads its
/// inputs (a model input or an earlier node's output) and whether it trains (its
/// backward has a gradient to produce: `Graph::trains`).
struct Layer {
    place: Placement,
    op: Box<dyn GpuLayer>,
    reads: Vec<Source>,
    trains: bool,
}

/// The network's device memory of one forward/backward at one batch size (what each op
/// keeps between its passes is the op's own).
struct Activations {
    /// Batch size these buffers are sized for.
    n: usize,
    /// acts[k] = the model's input k (k < I, the model's inputs), acts[I + i] = layer i's
    /// output.
    acts: Vec<CudaSlice<f32>>,
    /// I: the model's inputs.
    inputs: usize,
    /// Two gradient buffers that a chain's backward alternates between; `grads[0]`
    /// holds the loss's gradient, the last node's output gradient, in a graph too.
    grads: [CudaSlice<f32>; 2],
    /// A graph that is not a chain: each node's output gradient (`values[j]`, the last
    /// node's unused: it is `grads[0]`), and, for a value read by several nodes, buffers
    /// its later readers' gradients are written into before they are added to it (as
    /// many as a node has inputs). Empty for a chain.
    values: Vec<CudaSlice<f32>>,
    spare: Vec<CudaSlice<f32>>,
    /// Scratch every op may use inside one of its passes (the widest op's request).
    scratch: CudaSlice<f32>,
    labels: CudaSlice<u32>,
    loss: CudaSlice<f32>,
    correct: CudaSlice<u32>,
}

/// A network on one GPU, with its parameters, buffers, optimiser state and the staging
/// of one step's rows.
pub struct GpuNet {
    gpu: Gpu,
    /// Dropped by hand (see `Drop`), before the workspace it uses.
    blas: std::mem::ManuallyDrop<CudaBlas>,
    /// cuBLAS's workspace, set on `blas`.
    _workspace: CudaSlice<u8>,
    model: Graph,
    layers: Vec<Layer>,
    np: usize,
    nb: usize,
    params: CudaSlice<f32>,
    buffers: CudaSlice<f32>,
    /// Optimiser state of the parameters `state_range` (all of them, unless sharded):
    /// SGD's momentum or Adam's m, and Adam's v (one unused value for SGD).
    m: CudaSlice<f32>,
    v: CudaSlice<f32>,
    /// The optimiser: which of `m` and `v` are its state (`OptimizerConfig::state_names`).
    config: OptimizerConfig,
    state_range: Range<usize>,
    /// A later micro-batch's gradient, beside a copy of the slot's (2·np values), when
    /// accumulating: the two are then added in that order by `reduce_sum`.
    accum: Option<CudaSlice<f32>>,
    /// Clipping by the global gradient norm, allocated on first use: the norm's partial
    /// sums (one per chunk of the np parameters) and the factor the update reads.
    clip: Option<(CudaSlice<f64>, CudaSlice<f32>)>,
    /// Activations of the last pass (training or evaluation), kept while the batch size
    /// stays the same: nothing in them outlives a pass.
    acts: Option<Activations>,
    /// Events recorded by [`GpuNet::mark`] (made once: a step records them again).
    marks: Vec<CudaEvent>,
    /// Recorded by [`GpuNet::wait`]: the point the host waits for.
    idle: CudaEvent,
    /// Per-sample losses and hits of the rows staged by [`GpuNet::stage`].
    step_loss: Option<CudaSlice<f32>>,
    step_hits: Option<CudaSlice<u32>>,
    /// Pinned staging for the rows of one step or evaluation chunk, and their labels.
    pinned_x: Option<PinnedHostSlice<f32>>,
    pinned_y: Option<PinnedHostSlice<u32>>,
    x_dev: Option<CudaSlice<f32>>,
    y_dev: Option<CudaSlice<u32>>,
    staged: usize,
    /// The loss trained and reported (its label smoothing reaches the loss kernel).
    loss: CrossEntropy,
}

/// The optimiser a [`GpuNet`] runs and the state it starts from, named as
/// [`OptimizerConfig::state_names`] names it (`Optimizer::state`); a tensor left out
/// starts at zeros.
pub struct OptimizerState<'a> {
    pub config: OptimizerConfig,
    pub state: Vec<(&'a str, &'a [f32])>,
}

/// Optimiser state tensors by name, as `Optimizer::restore` takes them.
pub type NamedState = Vec<(&'static str, Vec<f32>)>;

/// Whether an update scales the gradient by the clipping factor on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clip {
    /// No clipping this step.
    None,
    /// The factor [`GpuNet::clip_grad_norm`] queued for this step.
    Factor,
}

/// How a training pass meets its slot (as `train::replica::Fill`, which the network does
/// not know of).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotUse {
    /// Writes the whole slot: zeros, the buffers, the gradient.
    Write,
    /// Adds its gradient to the slot's and moves the slot's buffers on.
    Add,
}

impl GpuNet {
    /// Builds the network on GPU `ordinal`: checks that every layer has a CUDA form,
    /// uploads `store` and the optimiser `state`, and makes `marks` timing events.
    pub fn new(
        ordinal: usize,
        model: Graph,
        store: &ParamStore,
        state: OptimizerState<'_>,
        marks: usize,
    ) -> Result<GpuNet> {
        let layers = plan(&model)?;
        crate::cuda::probe::cublas_available()?;
        let gpu = Gpu::new(ordinal)?;
        // SAFETY: cudarc's per-buffer event tracking (an event recorded or waited on for
        // every buffer of every launch once a context has a second stream) is not needed:
        // every buffer of a network is used by its compute stream alone, pinned staging is
        // rewritten only after the step's closing wait, and the exchange orders its own
        // stream against the compute stream with explicit events (`exchange::gpu`). Replicas
        // sharing a GPU share its primary context, and the same holds for each of them.
        unsafe { gpu.context().disable_event_tracking() };
        let stream = gpu.stream().clone();
        let blas = CudaBlas::new(stream.clone())?;
        // A workspace of the network's own: cuBLAS is reproducible bit for bit only when
        // streams that run at once (replicas sharing a GPU) do not share its default one.
        let workspace = stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE)?;
        {
            let (ptr, _sync) = workspace.device_ptr(&stream);
            // SAFETY: the workspace lives as long as the handle (both fields of the
            // network, the handle dropped first) and is used on the handle's stream only.
            unsafe { cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, CUBLAS_WORKSPACE) }
                .result()?;
        }
        let (np, nb) = (model.params_len(), model.buffers_len());
        if store.params.len() != np || store.buffers.len() != nb {
            return Err(Error::config("initial weights", "they do not match the model's tensors"));
        }
        for (name, _) in &state.state {
            if !state.config.state_names().contains(name) {
                return Err(Error::config("optimizer state", format!("unknown tensor '{name}'")));
            }
        }
        // The update kernel's m is SGD's momentum buffer, which plain SGD writes and does
        // not keep; v is Adam's alone (one unused value otherwise).
        let state_of = |name: &str| -> Result<Vec<f32>> {
            match state.state.iter().find(|(n, _)| *n == name).map_or(0, |(_, v)| v.len()) {
                0 => Ok(vec![0.0; np]),
                n if n == np => Ok(state.state.iter().find(|(n, _)| *n == name).expect("found").1.to_vec()),
                n => Err(Error::config("optimizer state", format!("'{name}' has {n} values, expected {np}"))),
            }
        };
        let config = state.config;
        let m = state_of("m")?;
        let v = if config.state_names().contains(&"v") { state_of("v")? } else { Vec::new() };
        let timed = || gpu.context().new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
        let marks = (0..marks).map(|_| timed()).collect::<std::result::Result<Vec<_>, _>>()?;
        let idle = gpu.context().new_event(None)?;
        Ok(GpuNet {
            params: upload(&stream, &store.params)?,
            buffers: upload(&stream, &store.buffers)?,
            m: upload(&stream, &m)?,
            v: upload(&stream, &v)?,
            config,
            state_range: 0..np,
            accum: None,
            clip: None,
            np,
            nb,
            layers,
            model,
            gpu,
            blas: std::mem::ManuallyDrop::new(blas),
            _workspace: workspace,
            acts: None,
            marks,
            idle,
            step_loss: None,
            step_hits: None,
            pinned_x: None,
            pinned_y: None,
            x_dev: None,
            y_dev: None,
            staged: 0,
            loss: CrossEntropy::default(),
        })
    }

    /// Trains and reports `loss` (plain cross-entropy by default).
    pub fn set_loss(&mut self, loss: CrossEntropy) {
        self.loss = loss;
    }

    /// The stream every launch of this network goes to (the exchange orders itself
    /// after it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.gpu.stream()
    }

    /// The model this network runs.
    pub fn model(&self) -> &Graph {
        &self.model
    }

    /// Records timing event `i` on the stream.
    pub fn mark(&mut self, i: usize) -> Result<()> {
        self.marks[i].record(self.gpu.stream())?;
        Ok(())
    }

    /// GPU time of every mark since mark 0 (waits for the last one).
    pub fn mark_times(&self) -> Result<Vec<Duration>> {
        let first = &self.marks[0];
        self.marks.iter().map(|e| Ok(Duration::from_secs_f64(f64::from(first.elapsed_ms(e)?.max(0.0)) / 1e3))).collect()
    }

    /// Waits until everything queued so far has run, or until `aborted()` turns true
    /// ([`Error::Aborted`]): the host's waits for a step go through here, so that a
    /// replica whose peer failed is never stuck behind a collective that cannot complete.
    pub fn wait(&self, aborted: &dyn Fn() -> bool) -> Result<()> {
        self.idle.record(self.gpu.stream())?;
        poll(&self.idle, aborted)
    }

    /// Copies rows (x: the rows of every model input, input by input, as
    /// `train::Batch::inputs_apart` lays them; y: (rows)) to the GPU through pinned
    /// memory, asynchronously, for the shards of a step or an evaluation chunk to read,
    /// after checking the labels against the model's classes and each input as the nodes
    /// that read it first check it (`Layer::check_input`: an embedding's token ids, which
    /// its kernels could not name).
    pub fn stage(&mut self, xs: &[f32], ys: &[u32]) -> Result<()> {
        let (t, k) = self.targets_and_classes();
        check_labels(ys, k)?;
        let per = self.input_sizes();
        let rows = xs.len() / per.iter().sum::<usize>().max(1);
        let ctx = self.gpu.context().clone();
        let stream = self.gpu.stream().clone();
        if self.pinned_x.as_ref().map(|p| p.len()) != Some(xs.len().max(1)) {
            // SAFETY: the memory is written below before any read.
            self.pinned_x = Some(unsafe { ctx.alloc_pinned::<f32>(xs.len().max(1)) }?);
            self.pinned_y = Some(unsafe { ctx.alloc_pinned::<u32>(ys.len().max(1)) }?);
            self.x_dev = Some(stream.alloc_zeros(xs.len().max(1))?);
            self.y_dev = Some(stream.alloc_zeros(ys.len().max(1))?);
        }
        let (px, py) = (self.pinned_x.as_mut().expect("set"), self.pinned_y.as_mut().expect("set"));
        // No copy reads the staging any more: every step and evaluation ends with a wait
        // for the GPU, and a network that failed mid-step is dropped (which waits too).
        let staged = &mut px.as_mut_slice()?[..xs.len()];
        staged.copy_from_slice(xs);
        // Each node that reads a model input checks it (`Layer::check_input`).
        for (j, (layer, shapes)) in self.model.layers().iter().zip(self.model.layer_shapes()).enumerate() {
            if let Some(&Source::Input(i)) = self.model.sources()[j].first() {
                layer.check_input(&staged[input_span(&per, rows, i, 0..rows)], &shapes.input)?;
            }
        }
        py.as_mut_slice()?[..ys.len()].copy_from_slice(ys);
        stream.memcpy_htod(&*px, self.x_dev.as_mut().expect("set"))?;
        stream.memcpy_htod(&*py, self.y_dev.as_mut().expect("set"))?;
        self.staged = ys.len() / t;
        if self.step_loss.as_ref().map(|l| l.len()) != Some(ys.len().max(1)) {
            self.step_loss = Some(stream.alloc_zeros(ys.len().max(1))?);
            self.step_hits = Some(stream.alloc_zeros(ys.len().max(1))?);
        }
        Ok(())
    }

    /// Labels per sample and classes per label: (1, K) for a classifier's output (K),
    /// (T, K) for a sequence model's (T, K), a row of the loss per position.
    pub fn targets_and_classes(&self) -> (usize, usize) {
        let out = self.model.output_shape();
        let k = out.dims().last().copied().unwrap_or(1).max(1);
        (out.numel() / k, k)
    }

    /// Queues the start of a shard's slot ([gradient | BatchNorm buffers], params +
    /// buffers values): zeros, then the network's buffers in the buffer part.
    pub fn start_slot(&mut self, slot: &mut CudaViewMut<'_, f32>) -> Result<()> {
        let (np, nb) = (self.np, self.nb);
        if slot.len() != np + nb {
            return Err(Error::shape("start_slot", format!("slot of {} values, expected {}", slot.len(), np + nb)));
        }
        let stream = self.gpu.stream().clone();
        stream.memset_zeros(slot)?;
        if nb > 0 {
            stream.memcpy_dtod(&self.buffers.slice(0..nb), &mut slot.slice_mut(np..np + nb))?;
        }
        Ok(())
    }

    /// Queues one training pass of a shard (or a micro-batch of one), the staged rows
    /// `rows` (at least one), into a slot [`GpuNet::start_slot`] started: its forward moves
    /// the slot's buffers on; [`SlotUse::Write`] (the first pass) writes the gradient of
    /// the loss summed over the rows into the slot, [`SlotUse::Add`] adds it to the
    /// slot's (computed beside a copy of it and summed by `reduce_sum`, old + new).
    /// Per-sample losses and hits go to the step's buffers. With `sync`, the synchronized
    /// BatchNorm layers meet the other logical replicas' statistics there, the host's
    /// waits polling `aborted`; without it they normalise with the shard's own, as a world
    /// of one does.
    pub fn train_shard(
        &mut self,
        rows: Range<usize>,
        draw: Draw,
        slot: &mut CudaViewMut<'_, f32>,
        fill: SlotUse,
        sync: Option<Synchronized<'_>>,
        aborted: &dyn Fn() -> bool,
    ) -> Result<()> {
        let (np, nb) = (self.np, self.nb);
        let width = np + nb;
        if slot.len() != width {
            return Err(Error::shape("train_shard", format!("slot of {} values, expected {width}", slot.len())));
        }
        if rows.is_empty() || rows.end > self.staged {
            return Err(Error::shape("train_shard", format!("rows {rows:?} of {} staged", self.staged)));
        }
        // A label per sample, or per position: the loss's rows are the labels.
        let (t, k) = self.targets_and_classes();
        let stream = self.gpu.stream().clone();
        let n = rows.len();
        self.ensure_acts(n)?;
        let per = self.input_sizes();
        let acts = self.acts.as_mut().expect("sized above");
        let x = self.x_dev.as_ref().expect("staged");
        for (i, act) in acts.acts[..per.len()].iter_mut().enumerate() {
            stream.memcpy_dtod(&x.slice(input_span(&per, self.staged, i, rows.clone())), act)?;
        }
        let y = self.y_dev.as_ref().expect("staged");
        let labels = rows.start * t..rows.end * t;
        stream.memcpy_dtod(&y.slice(labels.clone()), &mut acts.labels)?;
        let mut net = Net { gpu: &self.gpu, blas: &self.blas, layers: &mut self.layers, params: &self.params };
        let sync = sync.map(|with| SyncWith { stats: with.stats, shard: with.shard, aborted });
        net.forward(acts, Pass::Train { draw, stats: slot, offset: np }, sync)?;
        let last = acts.acts.len() - 1;
        let step_loss = self.step_loss.as_mut().expect("staged");
        self.gpu.softmax_xent_fwd(
            &acts.acts[last],
            &acts.labels,
            &mut step_loss.slice_mut(labels.clone()),
            &mut acts.grads[0].slice_mut(0..n * t * k),
            &mut acts.correct,
            k,
            self.loss.label_smoothing,
        )?;
        stream.memcpy_dtod(&acts.correct, &mut self.step_hits.as_mut().expect("staged").slice_mut(labels))?;
        let first = self.model.first_trained_layer();
        if fill == SlotUse::Write || np == 0 {
            return net.backward(acts, slot, draw, first, sync);
        }
        if self.accum.is_none() {
            self.accum = Some(stream.alloc_zeros::<f32>(2 * np)?);
        }
        let accum = self.accum.as_mut().expect("allocated above");
        // [old gradient | new gradient]: np is a multiple of 64, so the new one's views
        // start on 256 bytes as a slot's do.
        stream.memcpy_dtod(&slot.slice(0..np), &mut accum.slice_mut(0..np))?;
        let mut new = accum.slice_mut(np..2 * np);
        stream.memset_zeros(&mut new)?;
        net.backward(acts, &mut new, draw, first, sync)?;
        self.gpu.reduce_sum(&accum.slice(0..2 * np), &mut slot.slice_mut(0..np), 2, 1.0)
    }

    /// The flat parameters (np values), for a sharded optimiser's all-gather.
    pub fn params_mut(&mut self) -> CudaViewMut<'_, f32> {
        self.params.slice_mut(0..self.np)
    }

    /// Keeps the optimiser state of the parameters `range` only (ZeRO stage 1): its m
    /// and v move to buffers of that length; [`GpuNet::update_params`] then takes
    /// pieces inside it.
    pub fn keep_part(&mut self, range: Range<usize>) -> Result<()> {
        if range.start < self.state_range.start || range.end > self.state_range.end {
            return Err(Error::shape("keep_part", format!("{range:?} of {:?}", self.state_range)));
        }
        let stream = self.gpu.stream().clone();
        let local = range.start - self.state_range.start..range.end - self.state_range.start;
        let part = |v: &CudaSlice<f32>| -> Result<CudaSlice<f32>> {
            let mut out = stream.alloc_zeros::<f32>(local.len().max(1))?;
            if !local.is_empty() {
                stream.memcpy_dtod(&v.slice(local.clone()), &mut out.slice_mut(0..local.len()))?;
            }
            Ok(out)
        };
        self.m = part(&self.m)?;
        if self.keeps_v() {
            self.v = part(&self.v)?;
        }
        self.state_range = range;
        Ok(())
    }

    /// The parameters whose optimiser state this network holds.
    pub fn state_range(&self) -> Range<usize> {
        self.state_range.clone()
    }

    /// Queues the optimiser step of parameters `offset..offset + len` from that piece
    /// of the gradient sum, with the scalars of its run (`scalars.without_decay()` where
    /// the parameters do not decay), scaled by the factor [`GpuNet::clip_grad_norm`] left
    /// on the device when `clip` is [`Clip::Factor`].
    pub fn update_params(
        &mut self,
        scalars: &StepScalars,
        offset: usize,
        grad_sum: &CudaView<'_, f32>,
        clip: Clip,
    ) -> Result<()> {
        let r = offset..offset + grad_sum.len();
        if r.start < self.state_range.start || r.end > self.state_range.end {
            return Err(Error::shape(
                "update_params",
                format!("range {r:?} outside the optimiser state's {:?}", self.state_range),
            ));
        }
        let factor = match (clip, &self.clip) {
            (Clip::None, _) => None,
            (Clip::Factor, Some((_, factor))) => Some(factor.slice(0..1)),
            (Clip::Factor, None) => {
                return Err(Error::config("update_params", "clipping asked for before any gradient norm"))
            }
        };
        let local = r.start - self.state_range.start..r.end - self.state_range.start;
        let v = &mut self.v.slice_mut(if self.keeps_v() { local.clone() } else { 0..1 });
        self.gpu.optimizer_step(
            &self.config,
            scalars,
            &mut self.params.slice_mut(r.clone()),
            grad_sum,
            &mut self.m.slice_mut(local),
            v,
            factor.as_ref(),
        )
    }

    /// Queues the partial sums of the gradient norm over the piece `offset..offset + len`
    /// of the gradient sum (÷ `grad_divisor`); `offset` is a multiple of
    /// `optim::NORM_CHUNK` (a GPU exchange hands the sum over in one piece).
    pub fn add_grad_norm(&mut self, offset: usize, grad_sum: &CudaView<'_, f32>, grad_divisor: f32) -> Result<()> {
        let r = offset..offset + grad_sum.len();
        if !offset.is_multiple_of(crate::optim::NORM_CHUNK) || r.end > self.np {
            return Err(Error::shape(
                "add_grad_norm",
                format!(
                    "piece {r:?} of {} parameters (pieces start on chunks of {})",
                    self.np,
                    crate::optim::NORM_CHUNK
                ),
            ));
        }
        self.alloc_clip()?;
        let (partials, _) = self.clip.as_mut().expect("allocated");
        let first = offset / crate::optim::NORM_CHUNK;
        let mut mine = partials.slice_mut(first..first + crate::optim::norm_partials(grad_sum.len()));
        self.gpu.grad_norm(grad_sum, &mut mine, grad_divisor)
    }

    /// Queues `clip_grad_norm_`'s factor from the norm [`GpuNet::add_grad_norm`] summed
    /// over every piece, for the updates of this step to read on the device.
    pub fn clip_grad_norm(&mut self, max_norm: f32) -> Result<()> {
        self.alloc_clip()?;
        let (partials, factor) = self.clip.as_mut().expect("allocated");
        self.gpu.clip_factor(&partials.slice(..), factor, max_norm)
    }

    /// The norm's partial sums and the factor, allocated once.
    fn alloc_clip(&mut self) -> Result<()> {
        if self.clip.is_none() {
            let stream = self.gpu.stream();
            let parts = crate::optim::norm_partials(self.np).max(1);
            self.clip = Some((stream.alloc_zeros::<f64>(parts)?, stream.alloc_zeros::<f32>(1)?));
        }
        Ok(())
    }

    /// Queues buffers `offset..offset + len` = `scale` times that piece of a sum.
    pub fn set_buffers(&mut self, offset: usize, sum: &CudaView<'_, f32>, scale: f32) -> Result<()> {
        let r = offset..offset + sum.len();
        if r.end > self.nb {
            return Err(Error::shape("set_buffers", format!("range {r:?} of {} buffers", self.nb)));
        }
        self.gpu.reduce_sum(sum, &mut self.buffers.slice_mut(r), 1, scale)
    }

    /// Per-sample losses and hits of the staged rows' training shards (waits for them).
    pub fn step_losses(&self) -> Result<(Vec<f32>, Vec<u32>)> {
        let stream = self.gpu.stream();
        let n = self.staged * self.targets_and_classes().0;
        let loss = stream.clone_dtoh(&self.step_loss.as_ref().expect("staged").slice(0..n))?;
        let hits = stream.clone_dtoh(&self.step_hits.as_ref().expect("staged").slice(0..n))?;
        Ok((loss, hits))
    }

    /// Evaluation-mode forward of rows (x, y): per-sample losses, hits and the logits.
    pub fn infer(&mut self, xs: &[f32], ys: &[u32]) -> Result<(Vec<f32>, Vec<u32>, Vec<f32>)> {
        let (t, k) = self.targets_and_classes();
        let n = ys.len() / t;
        if n == 0 {
            return Ok((Vec::new(), Vec::new(), Vec::new()));
        }
        self.stage(xs, ys)?;
        self.ensure_acts(n)?;
        let per = self.input_sizes();
        let acts = self.acts.as_mut().expect("sized above");
        let stream = self.gpu.stream().clone();
        let x = self.x_dev.as_ref().expect("staged");
        for (i, act) in acts.acts[..per.len()].iter_mut().enumerate() {
            stream.memcpy_dtod(&x.slice(input_span(&per, n, i, 0..n)), act)?;
        }
        stream.memcpy_dtod(self.y_dev.as_ref().expect("staged"), &mut acts.labels)?;
        let mut net = Net { gpu: &self.gpu, blas: &self.blas, layers: &mut self.layers, params: &self.params };
        net.forward(acts, Pass::Eval { stats: &self.buffers }, None)?;
        let last = acts.acts.len() - 1;
        self.gpu.softmax_xent_fwd(
            &acts.acts[last],
            &acts.labels,
            &mut acts.loss,
            &mut acts.grads[0].slice_mut(0..n * t * k),
            &mut acts.correct,
            k,
            self.loss.label_smoothing,
        )?;
        let logits = stream.clone_dtoh(&acts.acts[last].slice(0..n * t * k))?;
        Ok((stream.clone_dtoh(&acts.loss)?, stream.clone_dtoh(&acts.correct)?, logits))
    }

    /// Parameters, buffers, and the optimiser's state of [`GpuNet::state_range`], named
    /// as [`OptimizerConfig::state_names`] names it, copied to the host (waits for the
    /// GPU).
    pub fn download(&self) -> Result<(ParamStore, NamedState)> {
        let stream = self.gpu.stream();
        let (np, nb, ns) = (self.np, self.nb, self.state_range.len());
        let store = ParamStore {
            params: stream.clone_dtoh(&self.params.slice(0..np))?,
            buffers: stream.clone_dtoh(&self.buffers.slice(0..nb))?,
        };
        let state = self
            .config
            .state_names()
            .iter()
            .map(|&name| {
                let values = if name == "v" { &self.v } else { &self.m };
                Ok((name, stream.clone_dtoh(&values.slice(0..ns))?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((store, state))
    }

    /// Whether the optimiser keeps a second moment (Adam's v).
    fn keeps_v(&self) -> bool {
        self.config.state_names().contains(&"v")
    }

    /// Values per sample of each model input.
    fn input_sizes(&self) -> Vec<usize> {
        self.model.inputs().iter().map(|(_, shape)| shape.numel()).collect()
    }

    fn ensure_acts(&mut self, n: usize) -> Result<()> {
        if self.acts.as_ref().map(|a| a.n) != Some(n) {
            // Free the old ones first: both at once may not fit.
            self.acts = None;
            for l in &mut self.layers {
                l.op.reserve(&self.gpu, &l.place, n)?;
            }
            let targets = self.targets_and_classes().0;
            self.acts = Some(Activations::new(&self.gpu, &self.layers, &self.input_sizes(), n, targets)?);
        }
        Ok(())
    }
}

impl Drop for GpuNet {
    fn drop(&mut self) {
        // With cudarc's event tracking off, nothing else keeps the pinned staging (or any
        // buffer) alive until the copies and kernels queued on it have run: after an error
        // mid-step they may still be in flight.
        if self.gpu.synchronize().is_err() {
            // A sticky error (a faulting kernel) has broken the context: cuBLAS may then
            // refuse to destroy its handle, which cudarc's drop turns into a panic, in the
            // middle of reporting the error. The handle goes with the broken context.
            // SAFETY: `blas` is not used again; the field is left for the leak only.
            let blas = unsafe { std::mem::ManuallyDrop::take(&mut self.blas) };
            std::mem::forget(blas);
        } else {
            // SAFETY: as above; dropped normally.
            drop(unsafe { std::mem::ManuallyDrop::take(&mut self.blas) });
        }
    }
}

/// Bytes of each replica's cuBLAS workspace (NVIDIA's recommendation for Hopper).
const CUBLAS_WORKSPACE: usize = 32 << 20;

/// The network as one pass sees it: the launches, the layers and their parameters.
struct Net<'a> {
    gpu: &'a Gpu,
    blas: &'a CudaBlas,
    layers: &'a mut [Layer],
    params: &'a CudaSlice<f32>,
}

fn upload<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    host: &[T],
) -> Result<CudaSlice<T>> {
    if host.is_empty() {
        // A zero-length allocation is refused by the driver: keep one unused element.
        return Ok(stream.alloc_zeros(1)?);
    }
    Ok(stream.clone_htod(host)?)
}

/// The network as the GPU runs it, or an error naming the first layer without a GPU form.
fn plan(model: &Graph) -> Result<Vec<Layer>> {
    let mut layers = Vec::with_capacity(model.layers().len());
    for (index, (layer, shapes)) in model.layers().iter().zip(model.layer_shapes()).enumerate() {
        let name = model.layer_names()[index].clone();
        let op = layer.gpu().ok_or_else(|| {
            Error::config("model", format!("layer {name} ({}) has no CUDA implementation", layer.describe()))
        })?;
        let LayerShapes { input, output, other_inputs } = shapes.clone();
        let (params, buffers) = model.layer_ranges(index);
        let reads = model.sources()[index].clone();
        let trains = model.trains(index);
        let index = model.layer_index(index);
        let place = Placement { name, index, input, output, other_inputs, params, buffers };
        layers.push(Layer { place, op, reads, trains });
    }
    Ok(layers)
}

/// Where a value lies in `Activations::acts`, of a model of `inputs` inputs.
fn act_of(r: Source, inputs: usize) -> usize {
    match r {
        Source::Input(k) => k,
        Source::Node(i) => inputs + i,
    }
}

/// Whether the nodes are a chain: each reads the one before it (the first the model's
/// one input).
fn is_chain(layers: &[Layer]) -> bool {
    let before = |j: usize| j.checked_sub(1).map_or(Source::Input(0), Source::Node);
    layers.iter().enumerate().all(|(j, l)| l.reads == [before(j)])
}

/// Where rows `rows` of input i lie among `staged` rows laid out input by input
/// (`train::Batch::inputs_apart`: every row's input 0, then every row's input 1, ...).
fn input_span(per: &[usize], staged: usize, i: usize, rows: Range<usize>) -> Range<usize> {
    let start = staged * per[..i].iter().sum::<usize>();
    start + rows.start * per[i]..start + rows.end * per[i]
}

/// Where a node's backward writes the gradient of one of its inputs, in a graph: the
/// value's own gradient buffer (its first writer, in the backward's order), a spare
/// buffer to be added to it afterwards (a later writer), or nowhere (a value that needs
/// no gradient).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum GradTarget {
    Own(usize),
    Spare(usize),
    Nowhere,
}

impl Activations {
    /// For `n` samples of `targets` labels each, of the model's inputs of `per` values.
    fn new(gpu: &Gpu, layers: &[Layer], per: &[usize], n: usize, targets: usize) -> Result<Activations> {
        let stream = gpu.stream();
        let alloc = |len: usize| -> Result<CudaSlice<f32>> { Ok(stream.alloc_zeros::<f32>(len.max(1))?) };
        let mut acts = per.iter().map(|&p| alloc(n * p)).collect::<Result<Vec<_>>>()?;
        let (mut widest, mut scratch) = (n * per.iter().copied().max().unwrap_or(0), 0);
        for Layer { place, op, .. } in layers {
            acts.push(alloc(n * place.output.numel())?);
            widest = widest.max(n * place.output.numel());
            scratch = scratch.max(op.scratch(place, n)?);
        }
        let (mut values, mut spare) = (Vec::new(), Vec::new());
        if !is_chain(layers) {
            for Layer { place, .. } in &layers[..layers.len() - 1] {
                values.push(alloc(n * place.output.numel())?);
            }
            let most = layers.iter().map(|l| l.reads.len()).max().unwrap_or(1);
            for _ in 0..most {
                spare.push(alloc(widest)?);
            }
        }
        Ok(Activations {
            n,
            acts,
            inputs: per.len(),
            values,
            spare,
            grads: [alloc(widest)?, alloc(widest)?],
            scratch: alloc(scratch)?,
            labels: stream.alloc_zeros::<u32>(n * targets)?,
            loss: alloc(n * targets)?,
            correct: stream.alloc_zeros::<u32>(n * targets)?,
        })
    }
}

impl Net<'_> {
    /// The forward pass of every layer on `a.acts[0]`, as `pass` says; synchronized
    /// BatchNorm layers of a training pass meet the other replicas' through `sync`.
    fn forward(&mut self, a: &mut Activations, mut pass: Pass<'_, '_>, sync: Option<SyncWith<'_>>) -> Result<()> {
        let (gpu, blas, params, n, inputs) = (self.gpu, self.blas, self.params, a.n, a.inputs);
        for (i, Layer { place, op, reads, .. }) in self.layers.iter_mut().enumerate() {
            // acts[..I] are the model's inputs, acts[I + i] node i's output: every value a
            // node reads lies before its own output.
            let (before, after) = a.acts.split_at_mut(inputs + i);
            let value = |r: &Source| &before[act_of(*r, inputs)];
            let (x, y) = (value(&reads[0]), &mut after[0]);
            let others: Vec<&CudaSlice<f32>> = reads[1..].iter().map(value).collect();
            op.forward(Forward {
                gpu,
                blas,
                place,
                n,
                params,
                x,
                others: &others,
                y,
                scratch: &mut a.scratch,
                pass: &mut pass,
                sync,
            })?;
        }
        Ok(())
    }

    /// The backward pass from the gradient of the summed loss in `a.grads[0]` down to
    /// layer `first`, writing the parameter gradients into `slot` (laid out as the flat
    /// parameters); dropout replays the masks of `draw`; synchronized BatchNorm layers
    /// meet the other replicas' sums through `sync`. Layer `first` is asked for no input
    /// gradient: nobody reads it.
    fn backward(
        &mut self,
        a: &mut Activations,
        grads: &mut CudaViewMut<'_, f32>,
        draw: Draw,
        first: usize,
        sync: Option<SyncWith<'_>>,
    ) -> Result<()> {
        if !a.values.is_empty() {
            return self.backward_graph(a, grads, draw, sync);
        }
        let (gpu, blas, params, n) = (self.gpu, self.blas, self.params, a.n);
        let mut cur = 0;
        for i in (first..self.layers.len()).rev() {
            let Layer { place, op, .. } = &mut self.layers[i];
            let [g0, g1] = &mut a.grads;
            let (dy_buf, dx_buf) = if cur == 0 { (&*g0, g1) } else { (&*g1, g0) };
            let dy = dy_buf.slice(0..n * place.output.numel());
            let dx = (i > first).then(|| dx_buf.slice_mut(0..n * place.input.numel()));
            let x = &a.acts[i];
            op.backward(Backward {
                gpu,
                blas,
                place,
                n,
                params,
                x,
                others: &[],
                dy,
                dx,
                d_others: Vec::new(),
                grads,
                draw,
                scratch: &mut a.scratch,
                sync,
            })?;
            cur = 1 - cur;
        }
        Ok(())
    }
}

impl Net<'_> {
    /// The backward of a graph that is not a chain, from the loss's gradient in
    /// `a.grads[0]`: nodes in reverse order, each that trains writing its inputs'
    /// gradients (those that need one) into the values' buffers; a value read by several
    /// nodes gets its first writer's gradient in its own buffer and each later one's added
    /// to it (`Gpu::add_into`), in the order the backward meets them, as on the CPU.
    fn backward_graph(
        &mut self,
        a: &mut Activations,
        grads: &mut CudaViewMut<'_, f32>,
        draw: Draw,
        sync: Option<SyncWith<'_>>,
    ) -> Result<()> {
        let (gpu, blas, params, n) = (self.gpu, self.blas, self.params, a.n);
        let last = self.layers.len() - 1;
        let trains: Vec<bool> = self.layers.iter().map(|l| l.trains).collect();
        let outputs: Vec<usize> = self.layers.iter().map(|l| n * l.place.output.numel()).collect();
        let mut written = vec![false; last];
        let model_inputs = a.inputs;
        let Activations { acts, grads: loss_grads, values, spare, scratch, .. } = a;
        for j in (0..=last).rev() {
            if !trains[j] {
                continue;
            }
            let Layer { place, op, reads, .. } = &mut self.layers[j];
            // Where each input's gradient goes.
            let mut spares = 0;
            let targets: Vec<GradTarget> = reads
                .iter()
                .map(|r| match *r {
                    Source::Node(i) if trains[i] && !written[i] => {
                        written[i] = true;
                        GradTarget::Own(i)
                    }
                    Source::Node(i) if trains[i] => {
                        spares += 1;
                        GradTarget::Spare(spares - 1)
                    }
                    _ => GradTarget::Nowhere,
                })
                .collect();
            // Lend each target's buffer once: distinct values, distinct spares.
            let at = j.min(values.len());
            let (own, rest) = values.split_at_mut(at);
            let (dy_buf, _) = rest.split_first_mut().map_or((None, ()), |(d, _)| (Some(d), ()));
            let dy = match dy_buf {
                Some(d) if j < last => d.slice(0..n * place.output.numel()),
                _ => loss_grads[0].slice(0..n * place.output.numel()),
            };
            let mut own: Vec<Option<&mut CudaSlice<f32>>> = own.iter_mut().map(Some).collect();
            let mut spare_bufs: Vec<Option<&mut CudaSlice<f32>>> = spare.iter_mut().map(Some).collect();
            let inputs = std::iter::once(&place.input).chain(&place.other_inputs);
            let mut views: Vec<Option<CudaViewMut<'_, f32>>> = targets
                .iter()
                .zip(inputs)
                .map(|(t, shape)| {
                    let len = n * shape.numel();
                    match *t {
                        GradTarget::Own(i) => Some(own[i].take().expect("one writer a value").slice_mut(0..len)),
                        GradTarget::Spare(k) => {
                            Some(spare_bufs[k].take().expect("one spare a writer").slice_mut(0..len))
                        }
                        GradTarget::Nowhere => None,
                    }
                })
                .collect();
            let dx = views.remove(0);
            let value = |r: &Source| &acts[act_of(*r, model_inputs)];
            let others: Vec<&CudaSlice<f32>> = reads[1..].iter().map(value).collect();
            op.backward(Backward {
                gpu,
                blas,
                place,
                n,
                params,
                x: value(&reads[0]),
                others: &others,
                dy,
                dx,
                d_others: views,
                grads,
                draw,
                scratch: &mut *scratch,
                sync,
            })?;
            // The later writers' gradients, added to their values' in input order.
            for (t, r) in targets.iter().zip(reads.iter()) {
                if let (GradTarget::Spare(k), Source::Node(i)) = (*t, *r) {
                    let len = outputs[i];
                    gpu.add_into(&spare[k].slice(0..len), &mut values[i].slice_mut(0..len))?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Sequential;

    #[test]
    fn a_layer_without_a_cuda_form_is_refused_by_name() {
        let layers: Vec<Box<dyn crate::nn::Layer>> =
            vec![Box::new(crate::nn::Linear::new(2, 3)), Box::new(crate::ops::CpuOnly)];
        let model = Sequential::new([2], layers).unwrap();
        let e = plan(&model).err().expect("a layer without a GPU form cannot run on a GPU").to_string();
        assert!(e.contains("cpuonly0") && e.contains("CpuOnly") && e.contains("no CUDA implementation"), "{e}");
    }

    /// A model of two inputs is planned reading each where the staging puts it: its
    /// embeddings read inputs 0 and 1, the add both embeddings; not a chain.
    #[test]
    fn a_model_of_several_inputs_reads_each_input_where_it_is_staged() {
        let model = crate::testing::tokens_and_positions(4, 8, 2);
        let layers = plan(&model).unwrap();
        let reads: Vec<Vec<Source>> = layers.iter().map(|l| l.reads.clone()).collect();
        assert_eq!(reads, vec![vec![Source::Input(0)], vec![Source::Input(1)], vec![Source::Node(0), Source::Node(1)]]);
        assert!(!is_chain(&layers));
        assert_eq!(act_of(Source::Input(1), 2), 1);
        assert_eq!(act_of(Source::Node(0), 2), 2, "node 0's output follows the two inputs");
        assert!(is_chain(&plan(&crate::models::toy_mlp(2, 2).unwrap()).unwrap()));
    }

    /// Rows of two parts (2 and 3 values) laid out input by input as a GPU replica stages
    /// them (`Batch::inputs_apart`): `input_span` finds any run of rows of either input;
    /// one input's rows stay as they lie.
    #[test]
    fn each_inputs_rows_are_found_where_the_staging_lays_them() {
        let (per, n) = ([2, 3], 4);
        let batch = crate::train::Batch {
            x: (0..n * 5).map(|v| v as f32).collect(),
            y: vec![0; n],
            sample_shape: crate::Shape::new([5]),
            inputs: vec![crate::Shape::new([2]), crate::Shape::new([3])],
            targets: 1,
        };
        let staged = batch.inputs_apart(&(0..n));
        for (i, (whole, _)) in batch.input_rows(&(0..n)).into_iter().enumerate() {
            for rows in [0..4, 1..3, 2..2] {
                let want = &whole[rows.start * per[i]..rows.end * per[i]];
                assert_eq!(&staged[input_span(&per, n, i, rows.clone())], want, "input {i}, rows {rows:?}");
            }
        }
        let one = crate::train::Batch { inputs: vec![crate::Shape::new([5])], ..batch.clone() };
        assert!(matches!(one.inputs_apart(&(1..3)), std::borrow::Cow::Borrowed(r) if r == &one.x[5..15]));
        assert_eq!(input_span(&[5], n, 0, 1..3), 5..15);
    }

    #[test]
    fn every_built_in_layer_has_a_cuda_form() {
        use crate::models::{convnet, ConvnetOptions};
        let convnet = convnet(ConvnetOptions { dropout: 0.25, ..ConvnetOptions::default() }).unwrap();
        let layers = plan(&convnet).unwrap();
        assert_eq!(layers.len(), convnet.layers().len());
        let names: Vec<&str> = layers.iter().map(|l| l.place.name.as_str()).collect();
        assert_eq!(names, convnet.layer_names().iter().map(String::as_str).collect::<Vec<_>>());
        let toy = plan(&crate::models::toy_mlp(2, 2).unwrap()).unwrap();
        assert_eq!(toy.last().unwrap().place.output.numel(), 2);
    }
}
