//! A network on one GPU: parameters, BatchNorm buffers and optimiser state in flat
//! device buffers, the layers run by the kernels of `kernels/` and cuBLAS.
//!
//! Owns: [`GpuNet`], the device half of a GPU replica (DESIGN.md: one thread per device,
//! each with its context, stream and full replica): what it holds on the device and the
//! work it queues. What a step is — which shards, which slots, when to sum — is the
//! trainer's (`train::gpu` drives this through the one step of `train::step`); nothing
//! here knows of batches, exchanges or steps. The network is the same [`Sequential`] the
//! CPU replica runs: each layer describes its computation as a [`LayerOp`], and this
//! file launches it. Flat buffers use the CPU layout exactly (`Sequential::layer_ranges`),
//! so weights, checkpoints and replica fingerprints move between the backends unchanged.
//! That layout starts every tensor, and sizes every flat buffer, on a multiple of 64 f32
//! (`nn::TENSOR_ALIGN`; nn/sequential.rs says why there): device allocations and the
//! exchange's slots are 256-byte aligned, so every tensor view handed to cuBLAS or a
//! kernel starts on a 256-byte boundary, on `cuda:0` with several slots as on `cuda:0,0`.
//! Two tensors of one layer are therefore not adjacent (BatchNorm's gamma and beta, its
//! running mean and variance).
//!
//! Everything is queued on the one compute stream without waiting: staging a step's rows
//! (one copy from pinned host memory), each shard's forward, fused softmax cross-entropy
//! and backward into a slot it is given, the fused optimiser over pieces of a sum. The
//! host waits in [`GpuNet::wait`] (polling an abort flag, so an abort releases it) and in
//! the reads (losses, evaluation, snapshots) — and, with synchronized BatchNorm, inside
//! the passes: each synchronized layer's per-channel partial statistics are computed on
//! the device, copied to the host (the host waits for them, polling the abort flag), merged
//! with every logical replica's by the CPU layer's own functions (`nn::batchnorm`'s
//! [`Synchronized`]), and copied back for the device to normalise with; its backward does
//! the same with (Σ dy, Σ dy·x̂). Two host waits per synchronized layer and step, as
//! PyTorch's SyncBatchNorm synchronises too: the exchange is latency-bound.
//!
//! Layouts: activations NCHW as on the CPU; convolution unfolds to columns
//! (N, C·KH·KW, OH·OW) and runs one strided-batched GEMM per pass; its weight gradient
//! is summed over the samples' per-sample products by the `reduce_sum` kernel, in sample
//! order. Parameter gradients of a shard are written once per step into its zeroed slot.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, PinnedHostSlice};

use super::gemm::{gemm, RmGemm};
use super::launch::{
    BnGeom, BnGrads, BnMerged, BnParams, BnSaved, BnStats, BnSums, BnUpdate, ConvGeom, DropoutKey, Gpu,
};
use crate::nn::batchnorm::{normaliser, RunningUpdate, Synchronized};
use crate::nn::loss::check_labels;
use crate::nn::{BatchStats, LayerOp, LayerShapes, ParamStore, Sequential, Window2d};
use crate::optim::{OptimizerConfig, StepScalars};
use crate::tensor::Shape;
use crate::{Error, Result};

/// One layer as the GPU runs it.
struct Node {
    op: LayerOp,
    name: String,
    /// Per-sample input and output element counts and shapes.
    input: Shape,
    output: Shape,
    params: Vec<Range<usize>>,
    buffers: Vec<Range<usize>>,
}

/// Per-layer device memory of one forward/backward at one batch size.
struct Activations {
    /// Batch size these buffers are sized for.
    n: usize,
    /// acts[0] = the input, acts[i + 1] = layer i's output.
    acts: Vec<CudaSlice<f32>>,
    /// Unfolded input of each convolution (None for other layers).
    cols: Vec<Option<CudaSlice<f32>>>,
    /// BatchNorm batch mean and 1/sqrt(var + eps) of each BatchNorm (None for others).
    saved: Vec<Option<(CudaSlice<f32>, CudaSlice<f32>)>>,
    /// The winner's index of each max pooling's outputs (N, C, OH, OW) (None for others).
    argmax: Vec<Option<CudaSlice<u32>>>,
    /// Two gradient buffers that backward alternates between.
    grads: [CudaSlice<f32>; 2],
    /// Per-sample products of a convolution's weight gradient (N, O, C·KH·KW).
    partial: CudaSlice<f32>,
    /// Column gradient of a convolution (N, C·KH·KW, OH·OW).
    dcol: CudaSlice<f32>,
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
    model: Sequential,
    nodes: Vec<Node>,
    np: usize,
    nb: usize,
    params: CudaSlice<f32>,
    buffers: CudaSlice<f32>,
    /// Optimiser state of the parameters `state_range` (all of them, unless sharded):
    /// SGD's momentum or Adam's m, and Adam's v (one unused value for SGD).
    m: CudaSlice<f32>,
    v: CudaSlice<f32>,
    adam: bool,
    state_range: Range<usize>,
    /// A later micro-batch's gradient, beside a copy of the slot's (2·np values), when
    /// accumulating: the two are then added in that order by `reduce_sum`.
    accum: Option<CudaSlice<f32>>,
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
    /// Synchronized BatchNorm's buffers, one set per BatchNorm node (None until its first
    /// synchronized pass).
    sync: Vec<Option<SyncNode>>,
}

/// One synchronized BatchNorm's per-channel statistics (C channels) on their way between
/// the device and the host: f64 on both sides, pinned on the host, each sized exactly for
/// its copy. Each host buffer is rewritten only after the host has waited for a later
/// copy on the same stream, so no copy still reads or writes it then.
struct SyncNode {
    /// The shard's partial statistics (C, 2): forward (mean, M2), backward (Σ dy, Σ dy·x̂).
    part: CudaSlice<f64>,
    part_host: PinnedHostSlice<f64>,
    /// The forward's merged statistics (C, 4): (mean, var, mean as f32, invstd as f32).
    merged: CudaSlice<f64>,
    merged_host: PinnedHostSlice<f64>,
    /// The backward's global sums (C, 2).
    sums: CudaSlice<f64>,
    sums_host: PinnedHostSlice<f64>,
    /// Recorded after the download of `part`: what the host waits for.
    arrived: CudaEvent,
    /// Values per channel in the global batch of the last forward (its backward's count).
    count: f64,
}

/// A training pass's synchronized BatchNorm: where its statistics meet the other logical
/// replicas' (the host's merge), the buffers they travel through, and the abort flag the
/// host's waits poll.
struct SyncPass<'p> {
    with: Synchronized<'p>,
    aborted: &'p dyn Fn() -> bool,
    nodes: &'p mut Vec<Option<SyncNode>>,
}

/// The optimiser a [`GpuNet`] runs and the state it starts from: SGD's momentum or
/// Adam's m, and Adam's v, each empty where the optimiser keeps none (zeros then).
pub struct OptimizerState<'a> {
    pub config: OptimizerConfig,
    pub m: &'a [f32],
    pub v: &'a [f32],
}

/// What a training shard's dropout masks derive from, with the layer's index
/// (DESIGN.md: randomness derives from the seed, the step and the logical replica), and
/// where in its logical replica's shard this pass's first sample lies (a later
/// micro-batch of an accumulated step: its masks continue the shard's).
#[derive(Clone, Copy, Debug)]
pub struct Draw {
    pub seed: u64,
    pub step: u64,
    pub replica: usize,
    pub sample_offset: usize,
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
        model: Sequential,
        store: &ParamStore,
        state: OptimizerState<'_>,
        marks: usize,
    ) -> Result<GpuNet> {
        let nodes = plan(&model)?;
        super::probe::cublas_available()?;
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
        let state_of = |name: &str, v: &[f32]| -> Result<Vec<f32>> {
            match v.len() {
                0 => Ok(vec![0.0; np]),
                n if n == np => Ok(v.to_vec()),
                n => Err(Error::config("optimizer state", format!("'{name}' has {n} values, expected {np}"))),
            }
        };
        let adam = matches!(state.config, OptimizerConfig::Adam { .. });
        let m = state_of("m", state.m)?;
        let v = if adam { state_of("v", state.v)? } else { Vec::new() };
        let timed = || gpu.context().new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
        let marks = (0..marks).map(|_| timed()).collect::<std::result::Result<Vec<_>, _>>()?;
        let idle = gpu.context().new_event(None)?;
        Ok(GpuNet {
            params: upload(&stream, &store.params)?,
            buffers: upload(&stream, &store.buffers)?,
            m: upload(&stream, &m)?,
            v: upload(&stream, &v)?,
            adam,
            state_range: 0..np,
            accum: None,
            np,
            nb,
            nodes,
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
            sync: Vec::new(),
        })
    }

    /// The stream every launch of this network goes to (the exchange orders itself
    /// after it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.gpu.stream()
    }

    /// The model this network runs.
    pub fn model(&self) -> &Sequential {
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

    /// Copies rows (x: (rows, *input), y: (rows)) to the GPU through pinned memory,
    /// asynchronously, for the shards of a step or an evaluation chunk to read, after
    /// checking the labels against the model's classes.
    pub fn stage(&mut self, xs: &[f32], ys: &[u32]) -> Result<()> {
        check_labels(ys, self.model.output_shape().numel())?;
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
        px.as_mut_slice()?[..xs.len()].copy_from_slice(xs);
        py.as_mut_slice()?[..ys.len()].copy_from_slice(ys);
        stream.memcpy_htod(&*px, self.x_dev.as_mut().expect("set"))?;
        stream.memcpy_htod(&*py, self.y_dev.as_mut().expect("set"))?;
        self.staged = ys.len();
        if self.step_loss.as_ref().map(|l| l.len()) != Some(ys.len().max(1)) {
            self.step_loss = Some(stream.alloc_zeros(ys.len().max(1))?);
            self.step_hits = Some(stream.alloc_zeros(ys.len().max(1))?);
        }
        Ok(())
    }

    /// Queues one training shard (or micro-batch of one), the staged rows `rows`.
    /// [`SlotUse::Write`] writes the whole of `slot` ([gradient | BatchNorm buffers],
    /// params + buffers values): zeros, then the replica's buffers updated by the
    /// shard's forward, and the gradient of the loss summed over the rows;
    /// [`SlotUse::Add`] moves the slot's buffers on by this forward and adds this
    /// gradient to the slot's (computed beside a copy of it and summed by `reduce_sum`,
    /// old + new). Per-sample losses and hits go to the step's buffers. With `sync`, the
    /// synchronized BatchNorm layers meet the other logical replicas' statistics there
    /// (a pass without rows still makes its calls), the host's waits polling `aborted`;
    /// without it they normalise with the shard's own, as a world of one does.
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
        if rows.end > self.staged {
            return Err(Error::shape("train_shard", format!("rows {rows:?} of {} staged", self.staged)));
        }
        let stream = self.gpu.stream().clone();
        if fill == SlotUse::Write {
            stream.memset_zeros(slot)?;
        }
        let n = rows.len();
        if n == 0 {
            // An empty shard still joins the exchange, with zeros, and the statistics
            // exchange with nothing.
            return sync.map_or(Ok(()), |with| with.without_data(&self.model));
        }
        self.ensure_acts(n)?;
        let acts = self.acts.as_mut().expect("sized above");
        let per = self.model.input_shape().numel();
        let x = self.x_dev.as_ref().expect("staged");
        let y = self.y_dev.as_ref().expect("staged");
        stream.memcpy_dtod(&x.slice(rows.start * per..rows.end * per), &mut acts.acts[0])?;
        stream.memcpy_dtod(&y.slice(rows.clone()), &mut acts.labels)?;
        // The shard's BatchNorm buffers start from the network's and are updated in its
        // slot by each training forward.
        if nb > 0 && fill == SlotUse::Write {
            stream.memcpy_dtod(&self.buffers.slice(0..nb), &mut slot.slice_mut(np..width))?;
        }
        let net = Net { gpu: &self.gpu, blas: &self.blas, nodes: &self.nodes, params: &self.params };
        let mut sync = sync.map(|with| SyncPass { with, aborted, nodes: &mut self.sync });
        net.forward(acts, Pass::Train { draw, stats: slot, offset: np }, sync.as_mut())?;
        let k = self.model.output_shape().numel();
        let last = acts.acts.len() - 1;
        let step_loss = self.step_loss.as_mut().expect("staged");
        self.gpu.softmax_xent_fwd(
            &acts.acts[last],
            &acts.labels,
            &mut step_loss.slice_mut(rows.clone()),
            &mut acts.grads[0].slice_mut(0..n * k),
            &mut acts.correct,
            k,
        )?;
        stream.memcpy_dtod(&acts.correct, &mut self.step_hits.as_mut().expect("staged").slice_mut(rows))?;
        let first = self.model.first_trained_layer();
        if fill == SlotUse::Write || np == 0 {
            return net.backward(acts, slot, draw, first, sync.as_mut());
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
        net.backward(acts, &mut new, draw, first, sync.as_mut())?;
        self.gpu.reduce_sum(&accum.slice(0..2 * np), &mut slot.slice_mut(0..np), 2, 1.0)
    }

    /// The flat parameters (np values), for a sharded optimiser's all-gather.
    pub fn params_mut(&mut self) -> CudaViewMut<'_, f32> {
        self.params.slice_mut(0..self.np)
    }

    /// Keeps the optimiser state of the parameters `range` only (ZeRO stage 1): its m
    /// and v move to buffers of that length; [`GpuNet::update_params`] then takes
    /// pieces inside it.
    pub fn shard_optimizer(&mut self, range: Range<usize>) -> Result<()> {
        if range.start < self.state_range.start || range.end > self.state_range.end {
            return Err(Error::shape("shard_optimizer", format!("{range:?} of {:?}", self.state_range)));
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
        if self.adam {
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
    /// of the gradient sum.
    pub fn update_params(
        &mut self,
        config: &OptimizerConfig,
        scalars: &StepScalars,
        offset: usize,
        grad_sum: &CudaView<'_, f32>,
    ) -> Result<()> {
        let r = offset..offset + grad_sum.len();
        if r.start < self.state_range.start || r.end > self.state_range.end {
            return Err(Error::shape(
                "update_params",
                format!("range {r:?} outside the optimiser state's {:?}", self.state_range),
            ));
        }
        let local = r.start - self.state_range.start..r.end - self.state_range.start;
        let v = &mut self.v.slice_mut(if self.adam { local.clone() } else { 0..1 });
        self.gpu.optimizer_step(
            config,
            scalars,
            &mut self.params.slice_mut(r.clone()),
            grad_sum,
            &mut self.m.slice_mut(local),
            v,
        )
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
        let n = self.staged;
        let loss = stream.clone_dtoh(&self.step_loss.as_ref().expect("staged").slice(0..n))?;
        let hits = stream.clone_dtoh(&self.step_hits.as_ref().expect("staged").slice(0..n))?;
        Ok((loss, hits))
    }

    /// Evaluation-mode forward of rows (x, y): per-sample losses, hits and the logits.
    pub fn infer(&mut self, xs: &[f32], ys: &[u32]) -> Result<(Vec<f32>, Vec<u32>, Vec<f32>)> {
        let n = ys.len();
        if n == 0 {
            return Ok((Vec::new(), Vec::new(), Vec::new()));
        }
        self.stage(xs, ys)?;
        self.ensure_acts(n)?;
        let acts = self.acts.as_mut().expect("sized above");
        let stream = self.gpu.stream().clone();
        stream.memcpy_dtod(self.x_dev.as_ref().expect("staged"), &mut acts.acts[0])?;
        stream.memcpy_dtod(self.y_dev.as_ref().expect("staged"), &mut acts.labels)?;
        let net = Net { gpu: &self.gpu, blas: &self.blas, nodes: &self.nodes, params: &self.params };
        net.forward(acts, Pass::Eval { stats: &self.buffers }, None)?;
        let last = acts.acts.len() - 1;
        let k = self.model.output_shape().numel();
        self.gpu.softmax_xent_fwd(
            &acts.acts[last],
            &acts.labels,
            &mut acts.loss,
            &mut acts.grads[0].slice_mut(0..n * k),
            &mut acts.correct,
            k,
        )?;
        let logits = stream.clone_dtoh(&acts.acts[last].slice(0..n * k))?;
        Ok((stream.clone_dtoh(&acts.loss)?, stream.clone_dtoh(&acts.correct)?, logits))
    }

    /// Parameters, buffers, and the optimiser's m and v (of [`GpuNet::state_range`]),
    /// copied to the host (waits for the GPU). Exact lengths: an empty tensor is held as
    /// one unused element.
    pub fn download(&self) -> Result<(ParamStore, Vec<f32>, Vec<f32>)> {
        let stream = self.gpu.stream();
        let (np, nb, ns) = (self.np, self.nb, self.state_range.len());
        let store = ParamStore {
            params: stream.clone_dtoh(&self.params.slice(0..np))?,
            buffers: stream.clone_dtoh(&self.buffers.slice(0..nb))?,
        };
        let v = if self.adam { stream.clone_dtoh(&self.v.slice(0..ns))? } else { Vec::new() };
        Ok((store, stream.clone_dtoh(&self.m.slice(0..ns))?, v))
    }

    fn ensure_acts(&mut self, n: usize) -> Result<()> {
        if self.acts.as_ref().map(|a| a.n) != Some(n) {
            // Free the old ones first: both at once may not fit.
            self.acts = None;
            self.acts = Some(Activations::new(&self.gpu, &self.nodes, n)?);
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

/// Waits until `event` has completed, or until `aborted()` turns true ([`Error::Aborted`]):
/// spins, then yields, then sleeps briefly, so a wait of a few µs stays fast and a long
/// one costs no core.
fn poll(event: &CudaEvent, aborted: &dyn Fn() -> bool) -> Result<()> {
    let mut spins = 0u32;
    let start = std::time::Instant::now();
    loop {
        if event.try_is_complete()? {
            return Ok(());
        }
        if aborted() {
            return Err(Error::Aborted);
        }
        spins = spins.saturating_add(1);
        if spins < 1024 {
            std::hint::spin_loop();
        } else if start.elapsed() < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl SyncNode {
    /// The buffers of a synchronized BatchNorm of `c` channels on `gpu`.
    fn new(gpu: &Gpu, c: usize) -> Result<SyncNode> {
        let stream = gpu.stream();
        let ctx = gpu.context();
        // SAFETY: pinned memory without write-combining (the host reads what the device
        // wrote); its contents are unset, and every host buffer is written (by the host,
        // or by a copy the host waited for) before it is read.
        let pinned = |len: usize| unsafe { ctx.alloc_pinned_with_flags::<f64>(len, 0) };
        Ok(SyncNode {
            part: stream.alloc_zeros(2 * c)?,
            part_host: pinned(2 * c)?,
            merged: stream.alloc_zeros(4 * c)?,
            merged_host: pinned(4 * c)?,
            sums: stream.alloc_zeros(2 * c)?,
            sums_host: pinned(2 * c)?,
            arrived: ctx.new_event(None)?,
            count: 0.0,
        })
    }

    /// `part` on the host, as (a, b) per channel: copied, then waited for (polling
    /// `aborted`).
    fn download(&mut self, stream: &Arc<CudaStream>, aborted: &dyn Fn() -> bool) -> Result<Vec<(f64, f64)>> {
        stream.memcpy_dtoh(&self.part, &mut self.part_host)?;
        self.arrived.record(stream)?;
        poll(&self.arrived, aborted)?;
        Ok(self.part_host.as_slice()?.chunks_exact(2).map(|p| (p[0], p[1])).collect())
    }
}

/// `values` into `dev` through `host`, queued on `stream` (the host does not wait).
fn upload_pinned(
    stream: &Arc<CudaStream>,
    values: impl Iterator<Item = f64>,
    host: &mut PinnedHostSlice<f64>,
    dev: &mut CudaSlice<f64>,
) -> Result<()> {
    // Waits for the buffer's last copy, which has run already (SyncNode's docs).
    for (h, v) in host.as_mut_slice()?.iter_mut().zip(values) {
        *h = v;
    }
    stream.memcpy_htod(&*host, dev)?;
    Ok(())
}

impl SyncPass<'_> {
    /// Node `i`'s buffers for `c` channels, made on first use.
    fn node(&mut self, gpu: &Gpu, i: usize, c: usize) -> Result<&mut SyncNode> {
        if self.nodes.len() <= i {
            self.nodes.resize_with(i + 1, || None);
        }
        if self.nodes[i].is_none() {
            self.nodes[i] = Some(SyncNode::new(gpu, c)?);
        }
        Ok(self.nodes[i].as_mut().expect("made above"))
    }

    /// A synchronized BatchNorm's training forward, node `i` (`name`): this shard's
    /// per-channel (mean, M2) on the device, merged with every logical replica's on the
    /// host (the CPU layer's `global_moments`), the statistics the CPU layer derives from
    /// them (biased variance, `normaliser`, `RunningUpdate` of the global count) back to
    /// the device, which normalises and moves the running statistics.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &mut self,
        gpu: &Gpu,
        i: usize,
        name: &str,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        params: BnParams<'_>,
        out: BnStats<'_>,
        g: BnGeom,
    ) -> Result<()> {
        let (with, aborted) = (self.with, self.aborted);
        let node = self.node(gpu, i, g.c)?;
        let stream = gpu.stream();
        gpu.batchnorm_moments_fwd(x, &mut node.part.as_view_mut(), g)?;
        let local = node.download(stream, aborted)?;
        let here = g.n * g.hw;
        let (count, moments) = with.moments(here as f64, &local)?;
        if count < 2.0 {
            return Err(Error::shape(
                "batchnorm",
                format!(
                    "{name}: training needs more than one value per channel, got {count} in the global batch ({here} here)"
                ),
            ));
        }
        let merged = moments.iter().flat_map(|&(mean, m2)| {
            let var = m2 / count;
            let (m, is) = normaliser(mean, var, g.eps);
            [mean, var, m as f64, is as f64]
        });
        upload_pinned(stream, merged, &mut node.merged_host, &mut node.merged)?;
        node.count = count;
        let u = RunningUpdate::new(g.momentum, count as usize);
        let merged = BnMerged { stats: node.merged.as_view(), update: BnUpdate::new(u.keep, u.take, u.unbias) };
        gpu.batchnorm_sync_fwd(x, y, params, merged, out, g)
    }

    /// A synchronized BatchNorm's training backward, node `i`: this shard's per-channel
    /// (Σ dy, Σ dy·x̂) on the device, summed over every logical replica on the host (the
    /// CPU layer's `global_sums`), back to the device for dx; dγ and dβ take the shard's
    /// own sums (the gradient exchange adds the shards').
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &mut self,
        gpu: &Gpu,
        i: usize,
        x: &CudaSlice<f32>,
        dy: &CudaView<'_, f32>,
        params: BnParams<'_>,
        saved: BnSaved<'_>,
        grads: BnGrads<'_>,
        g: BnGeom,
    ) -> Result<()> {
        let (with, aborted) = (self.with, self.aborted);
        let node = self.node(gpu, i, g.c)?;
        let stream = gpu.stream();
        gpu.batchnorm_sums_bwd(x, dy, &saved, &mut node.part.as_view_mut(), g)?;
        let local = node.download(stream, aborted)?;
        let global = with.sums(&local)?;
        upload_pinned(stream, global.iter().flat_map(|&(a, b)| [a, b]), &mut node.sums_host, &mut node.sums)?;
        let sums = BnSums { saved, local: node.part.as_view(), global: node.sums.as_view(), count: node.count };
        gpu.batchnorm_sync_bwd(x, dy, params, sums, grads, g)
    }
}

/// Bytes of each replica's cuBLAS workspace (NVIDIA's recommendation for Hopper).
const CUBLAS_WORKSPACE: usize = 32 << 20;

impl Draw {
    /// The key of layer `layer`'s masks, whose input has `per_sample` values per sample.
    fn dropout_key(&self, layer: usize, per_sample: usize) -> DropoutKey {
        DropoutKey {
            seed: self.seed,
            step: self.step,
            replica: self.replica as u64,
            layer: layer as u64,
            first: (self.sample_offset * per_sample) as u64,
        }
    }
}

/// What a forward pass is for, with what that needs.
enum Pass<'b, 'v> {
    /// A training shard: dropout draws from `draw`; BatchNorm normalises with the batch's
    /// statistics and updates the running ones held in `stats` from `offset` on (the
    /// shard's slot).
    Train { draw: Draw, stats: &'b mut CudaViewMut<'v, f32>, offset: usize },
    /// Evaluation: BatchNorm normalises with the running statistics `stats`; no dropout.
    Eval { stats: &'b CudaSlice<f32> },
}

/// The network as one pass sees it: the launches, the layers and their parameters.
struct Net<'a> {
    gpu: &'a Gpu,
    blas: &'a CudaBlas,
    nodes: &'a [Node],
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

/// The network as the GPU runs it, or an error naming the first layer without a CUDA form.
fn plan(model: &Sequential) -> Result<Vec<Node>> {
    let mut nodes = Vec::with_capacity(model.layers().len());
    for (i, (layer, shapes)) in model.layers().iter().zip(model.layer_shapes()).enumerate() {
        let name = model.layer_names()[i].clone();
        let op = layer.op().ok_or_else(|| {
            Error::config("model", format!("layer {name} ({}) has no CUDA implementation", layer.describe()))
        })?;
        let LayerShapes { input, output } = shapes.clone();
        let (params, buffers) = model.layer_ranges(i);
        nodes.push(Node { op, name, input, output, params, buffers });
    }
    Ok(nodes)
}

/// The launch geometry of `window` over `node`'s input (C, H, W), for a batch of `n`.
fn window_geom(node: &Node, window: Window2d, n: usize) -> Result<ConvGeom> {
    let (c, h, w) = match node.input.dims() {
        &[c, h, w] => (c, h, w),
        _ => return Err(Error::shape("window", format!("{}: input {} is not (C, H, W)", node.name, node.input))),
    };
    let g = window.over(h, w).ok_or_else(|| {
        Error::shape("window", format!("{}: input {h}x{w} is smaller than the {:?} window", node.name, window.kernel))
    })?;
    Ok(g.launch_geom(n, c))
}

impl Activations {
    fn new(gpu: &Gpu, nodes: &[Node], n: usize) -> Result<Activations> {
        let stream = gpu.stream();
        let alloc = |len: usize| -> Result<CudaSlice<f32>> { Ok(stream.alloc_zeros::<f32>(len.max(1))?) };
        let mut acts = vec![alloc(n * nodes[0].input.numel())?];
        let (mut cols, mut saved, mut argmax) = (Vec::new(), Vec::new(), Vec::new());
        let (mut widest, mut partial, mut dcol) = (n * nodes[0].input.numel(), 1, 1);
        for node in nodes {
            acts.push(alloc(n * node.output.numel())?);
            widest = widest.max(n * node.output.numel());
            let (mut col, mut stats, mut winners) = (None, None, None);
            match node.op {
                LayerOp::Conv2d { filters, window, .. } => {
                    let g = window_geom(node, window, n)?;
                    col = Some(alloc(g.col_len())?);
                    dcol = dcol.max(g.col_len());
                    partial = partial.max(n * filters * g.c * g.kh * g.kw);
                }
                LayerOp::BatchNorm2d { channels, .. } => stats = Some((alloc(channels)?, alloc(channels)?)),
                LayerOp::MaxPool2d { .. } => {
                    winners = Some(stream.alloc_zeros::<u32>((n * node.output.numel()).max(1))?);
                }
                LayerOp::Linear { .. }
                | LayerOp::Relu
                | LayerOp::Rescaling { .. }
                | LayerOp::Dropout { .. }
                | LayerOp::Flatten
                | LayerOp::GlobalAvgPool2d => {}
            }
            cols.push(col);
            saved.push(stats);
            argmax.push(winners);
        }
        let k = nodes.last().expect("a model has a layer").output.numel();
        widest = widest.max(n * k);
        Ok(Activations {
            n,
            acts,
            cols,
            saved,
            argmax,
            grads: [alloc(widest)?, alloc(widest)?],
            partial: alloc(partial)?,
            dcol: alloc(dcol)?,
            labels: stream.alloc_zeros::<u32>(n)?,
            loss: alloc(n)?,
            correct: stream.alloc_zeros::<u32>(n)?,
        })
    }
}

impl Net<'_> {
    /// The forward pass of every layer on `a.acts[0]`, as `pass` says; synchronized
    /// BatchNorm layers of a training pass meet the other replicas' through `sync`.
    fn forward(&self, a: &mut Activations, mut pass: Pass<'_, '_>, mut sync: Option<&mut SyncPass<'_>>) -> Result<()> {
        let Net { gpu, blas, nodes, params } = *self;
        let n = a.n;
        let stream = gpu.stream();
        for (i, node) in nodes.iter().enumerate() {
            let (before, after) = a.acts.split_at_mut(i + 1);
            let (x, y) = (&before[i], &mut after[0]);
            let p = |j: usize| params.slice(node.params[j].clone());
            match node.op {
                LayerOp::Linear { in_features: f, out_features: o, bias } => {
                    gemm(blas, &RmGemm::linear_fwd(n, f, o), x, &p(0), y)?;
                    if bias {
                        gpu.bias_cols_fwd(y, &p(1), n, o)?;
                    }
                }
                LayerOp::Conv2d { filters: o, window, bias, .. } => {
                    let g = window_geom(node, window, n)?;
                    let (ckk, pp) = (g.c * g.kh * g.kw, g.oh() * g.ow());
                    let col = a.cols[i].as_mut().expect("a convolution has columns");
                    gpu.im2col_fwd(x, col, &g)?;
                    gemm(blas, &RmGemm::conv_fwd(n, o, ckk, pp), &p(0), &*col, y)?;
                    if bias {
                        gpu.bias_nchw_fwd(y, &p(1), n, o, pp)?;
                    }
                }
                LayerOp::BatchNorm2d { channels: c, eps, momentum, scale, center, stats: which } => {
                    let hw = node.input.numel() / c;
                    let geom = BnGeom { n, c, hw, eps, momentum };
                    let params = BnParams { gamma: scale.then(|| p(0)), beta: center.then(|| p(usize::from(scale))) };
                    let (rm, rv) = (&node.buffers[0], &node.buffers[1]);
                    match &mut pass {
                        Pass::Train { stats, offset, .. } => {
                            // Each statistic on its own aligned start: split below the variance.
                            let (mut below, mut above) = stats.split_at_mut(*offset + rv.start);
                            let running_mean = below.slice_mut(*offset + rm.start..*offset + rm.end);
                            let running_var = above.slice_mut(0..rv.len());
                            let (save_mean, save_invstd) =
                                a.saved[i].as_mut().expect("a BatchNorm has saved statistics");
                            let stats = BnStats {
                                running_mean,
                                running_var,
                                save_mean: save_mean.as_view_mut(),
                                save_invstd: save_invstd.as_view_mut(),
                            };
                            match (which, sync.as_deref_mut()) {
                                (BatchStats::Global, Some(sync)) => {
                                    sync.forward(gpu, i, &node.name, x, y, params, stats, geom)?
                                }
                                _ => {
                                    if n * hw < 2 {
                                        return Err(Error::shape(
                                            "batchnorm",
                                            format!(
                                                "{}: training needs more than one value per channel, got {}",
                                                node.name,
                                                n * hw
                                            ),
                                        ));
                                    }
                                    let u = RunningUpdate::new(momentum, n * hw);
                                    let update = BnUpdate::new(u.keep, u.take, u.unbias);
                                    gpu.batchnorm_train_fwd(x, y, params, stats, geom, update)?
                                }
                            }
                        }
                        Pass::Eval { stats } => gpu.batchnorm_eval_fwd(
                            x,
                            y,
                            params,
                            (&stats.slice(rm.clone()), &stats.slice(rv.clone())),
                            geom,
                        )?,
                    }
                }
                LayerOp::Relu => gpu.relu_fwd(x, y)?,
                LayerOp::Rescaling { scale, offset } => gpu.rescale_fwd(x, y, scale, offset)?,
                LayerOp::Dropout { rate } => match &pass {
                    Pass::Train { draw, .. } if rate > 0.0 => {
                        gpu.dropout_fwd(x, y, rate, draw.dropout_key(i, node.input.numel()))?
                    }
                    _ => stream.memcpy_dtod(x, y)?,
                },
                LayerOp::Flatten => stream.memcpy_dtod(x, y)?,
                LayerOp::GlobalAvgPool2d => {
                    let c = node.output.numel();
                    gpu.global_avgpool_fwd(x, y, n * c, node.input.numel() / c)?
                }
                LayerOp::MaxPool2d { window } => {
                    let g = window_geom(node, window, n)?;
                    let argmax = a.argmax[i].as_mut().expect("a max pooling has argmax indices");
                    gpu.maxpool2d_fwd(x, y, argmax, &g)?;
                }
            }
        }
        Ok(())
    }

    /// The backward pass from the gradient of the summed loss in `a.grads[0]` down to
    /// layer `first`, writing the parameter gradients into `slot` (laid out as the flat
    /// parameters); dropout replays the masks of `draw`; synchronized BatchNorm layers
    /// meet the other replicas' sums through `sync`.
    fn backward(
        &self,
        a: &mut Activations,
        slots: &mut CudaViewMut<'_, f32>,
        draw: Draw,
        first: usize,
        mut sync: Option<&mut SyncPass<'_>>,
    ) -> Result<()> {
        let Net { gpu, blas, nodes, params } = *self;
        let n = a.n;
        let stream = gpu.stream();
        let mut cur = 0;
        for i in (first..nodes.len()).rev() {
            let node = &nodes[i];
            let need = i > first;
            let [g0, g1] = &mut a.grads;
            let (dy_buf, dx_buf) = if cur == 0 { (&*g0, g1) } else { (&*g1, g0) };
            let dy = dy_buf.slice(0..n * node.output.numel());
            let mut dx = dx_buf.slice_mut(0..n * node.input.numel());
            let x = &a.acts[i];
            let p = |j: usize| params.slice(node.params[j].clone());
            let at = |j: usize| node.params[j].clone();
            match node.op {
                LayerOp::Linear { in_features: f, out_features: o, bias } => {
                    gemm(blas, &RmGemm::linear_dw(n, f, o), &dy, x, &mut slots.slice_mut(at(0)))?;
                    if bias {
                        gpu.bias_cols_bwd(&dy, &mut slots.slice_mut(at(1)), n, o)?;
                    }
                    if need {
                        gemm(blas, &RmGemm::linear_dx(n, f, o), &dy, &p(0), &mut dx)?;
                    }
                }
                LayerOp::Conv2d { filters: o, window, bias, .. } => {
                    let g = window_geom(node, window, n)?;
                    let (ckk, pp) = (g.c * g.kh * g.kw, g.oh() * g.ow());
                    let col = a.cols[i].as_ref().expect("a convolution has columns");
                    // dW = Σ_n dW_n in sample order
                    let mut part = a.partial.slice_mut(0..n * o * ckk);
                    gemm(blas, &RmGemm::conv_dw(n, o, ckk, pp), &dy, col, &mut part)?;
                    gpu.reduce_sum(&part, &mut slots.slice_mut(at(0)), n, 1.0)?;
                    if bias {
                        gpu.bias_nchw_bwd(&dy, &mut slots.slice_mut(at(1)), n, o, pp)?;
                    }
                    if need {
                        let mut dcol = a.dcol.slice_mut(0..g.col_len());
                        gemm(blas, &RmGemm::conv_dcol(n, o, ckk, pp), &p(0), &dy, &mut dcol)?;
                        gpu.im2col_bwd(&dcol, &mut dx, &g)?;
                    }
                }
                LayerOp::BatchNorm2d { channels: c, scale, center, eps, momentum, stats: which } => {
                    let hw = node.input.numel() / c;
                    let (save_mean, save_invstd) = a.saved[i].as_ref().expect("a BatchNorm has saved statistics");
                    let saved = BnSaved { mean: save_mean.as_view(), invstd: save_invstd.as_view() };
                    let params = BnParams { gamma: scale.then(|| p(0)), beta: center.then(|| p(usize::from(scale))) };
                    // The last parameter's gradient (beta, or the only one) starts `split`
                    // into the slot; gamma's, when there are both, lies below it on its own
                    // aligned start, not adjacent.
                    let split = node.params.last().map_or(0, |r| r.start);
                    let (mut below, mut above) = slots.split_at_mut(split);
                    let last = above.slice_mut(0..node.params.last().map_or(0, |r| r.len()));
                    let (dgamma, dbeta) = match (scale, center) {
                        (true, true) => (Some(below.slice_mut(at(0))), Some(last)),
                        (true, false) => (Some(last), None),
                        (false, true) => (None, Some(last)),
                        (false, false) => (None, None),
                    };
                    let grads = BnGrads { dx: dx.slice_mut(..), dgamma, dbeta };
                    let geom = BnGeom { n, c, hw, eps, momentum };
                    match (which, sync.as_deref_mut()) {
                        (BatchStats::Global, Some(sync)) => {
                            sync.backward(gpu, i, x, &dy, params, saved, grads, geom)?
                        }
                        _ => gpu.batchnorm_train_bwd(x, &dy, params, saved, grads, geom)?,
                    }
                }
                LayerOp::Relu => gpu.relu_bwd(x, &dy, &mut dx)?,
                LayerOp::Rescaling { scale, .. } => gpu.rescale_bwd(&dy, &mut dx, scale)?,
                LayerOp::Dropout { rate } if rate > 0.0 => {
                    gpu.dropout_bwd(&dy, &mut dx, rate, draw.dropout_key(i, node.input.numel()))?
                }
                LayerOp::Dropout { .. } | LayerOp::Flatten => stream.memcpy_dtod(&dy, &mut dx)?,
                LayerOp::GlobalAvgPool2d => {
                    let c = node.output.numel();
                    gpu.global_avgpool_bwd(&dy, &mut dx, n * c, node.input.numel() / c)?
                }
                LayerOp::MaxPool2d { window } => {
                    let g = window_geom(node, window, n)?;
                    let argmax = a.argmax[i].as_ref().expect("a max pooling has argmax indices");
                    gpu.maxpool2d_bwd(&dy, argmax, &mut dx, &g)?;
                }
            }
            cur = 1 - cur;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_without_a_cuda_form_is_refused_by_name() {
        let layers: Vec<Box<dyn crate::nn::Layer>> =
            vec![Box::new(crate::nn::Linear::new(2, 3)), Box::new(crate::nn::CpuOnly)];
        let model = Sequential::new([2], layers).unwrap();
        let e = plan(&model).err().expect("a layer without a LayerOp cannot run on a GPU").to_string();
        assert!(e.contains("cpuonly0") && e.contains("CpuOnly") && e.contains("no CUDA implementation"), "{e}");
    }

    #[test]
    fn a_synchronized_batchnorm_keeps_its_global_statistics_on_the_gpu() {
        use crate::models::{convnet, ConvnetOptions};
        let model = crate::nn::convert_sync_batchnorm(&convnet(ConvnetOptions::default()).unwrap()).unwrap();
        let nodes = plan(&model).unwrap();
        let which: Vec<BatchStats> = nodes
            .iter()
            .filter_map(|n| match n.op {
                LayerOp::BatchNorm2d { stats, .. } => Some(stats),
                _ => None,
            })
            .collect();
        // The convnet's three BatchNorms, each normalising with the global batch's.
        assert_eq!(which, vec![BatchStats::Global; 3]);
    }

    #[test]
    fn every_built_in_layer_has_a_cuda_form() {
        use crate::models::{convnet, ConvnetOptions};
        let nodes = plan(&convnet(ConvnetOptions { dropout: 0.25, ..ConvnetOptions::default() }).unwrap()).unwrap();
        assert!(nodes.iter().any(|n| matches!(n.op, LayerOp::Conv2d { .. })));
        assert!(nodes.iter().any(|n| matches!(n.op, LayerOp::BatchNorm2d { .. })));
        assert!(nodes.iter().any(|n| matches!(n.op, LayerOp::Dropout { .. })));
        let toy = plan(&crate::models::toy_mlp(2, 2).unwrap()).unwrap();
        assert_eq!(toy.last().unwrap().output.numel(), 2);
    }
}
