//! A model replica on one GPU: parameters, gradients, BatchNorm buffers and optimiser
//! state in flat device buffers, the layers run by kernels of `kernels/` and cuBLAS.
//!
//! Owns: [`GpuReplica`], what a CUDA worker thread holds (DESIGN.md: one thread per
//! device, each with its context, streams and full replica). The network is the same
//! [`Sequential`] the CPU replica runs: each layer describes its computation as a
//! [`LayerOp`], and this file launches it. Flat buffers use the CPU layout exactly
//! (`Sequential::layer_ranges`), so weights, checkpoints and replica fingerprints move
//! between the two backends unchanged. That layout starts every tensor, and sizes every
//! flat buffer, on a multiple of 64 f32 (`nn::TENSOR_ALIGN`; nn/sequential.rs says why
//! there): device allocations are 256-byte aligned, so every slot ([`slot_start`]) and
//! every tensor view handed to cuBLAS or a kernel starts on a 256-byte boundary, on
//! `cuda:0` with several slots as on `cuda:0,0`. Two tensors of one layer are therefore
//! not adjacent (BatchNorm's gamma and beta, its running mean and variance).
//!
//! A training step queues everything on the compute stream without waiting: one copy of
//! this worker's rows from pinned host memory, then per logical replica (shard) forward,
//! fused softmax cross-entropy and backward into that shard's gradient slot; the slots
//! are summed in shard order, the collective sums across GPUs, and the fused optimiser
//! updates the parameters. The host waits once, at the end, to read the losses it
//! reports.
//!
//! Layouts: activations NCHW as on the CPU; convolution unfolds to columns
//! (N, C·KH·KW, OH·OW) and runs one strided-batched GEMM per pass; its weight gradient
//! is summed over the samples' per-sample products by the `reduce_sum` kernel, in sample
//! order. Parameter gradients of a shard are written once per step into a zeroed slot.

use std::ops::Range;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, DevicePtr, PinnedHostSlice};

use super::gemm::{gemm, RmGemm};
use super::launch::{AdamHyper, BnParams, ConvGeom, DropoutKey, Gpu};
use crate::comm::gpu::GpuRank;
use crate::nn::conv2d::pads;
use crate::nn::loss::Metrics;
use crate::nn::{LayerOp, ParamStore, Sequential};
use crate::optim::{Optimizer, OptimizerConfig};
use crate::tensor::{Device, Shape};
use crate::train::worker::{StepOutcome, StepWork};
use crate::train::Batch;
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

/// A device's replica on a GPU.
pub struct GpuReplica {
    pub device: Device,
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
    /// One slot of [gradient sum | updated BatchNorm buffers] per local logical replica.
    slots: CudaSlice<f32>,
    /// The slots' sum, all-reduced (used when a device runs more than one shard).
    reduced: CudaSlice<f32>,
    config: OptimizerConfig,
    /// Optimiser state: SGD momentum or Adam's m, and Adam's v (empty for SGD).
    m: CudaSlice<f32>,
    v: CudaSlice<f32>,
    t: u64,
    seed: u64,
    /// Activations of the last pass (training or evaluation), kept while the batch size
    /// stays the same: nothing in them outlives a pass.
    acts: Option<Activations>,
    /// Timing events of a step: its start, the end of backward, of the collective, of
    /// the update (made once: a step records them again).
    marks: [cudarc::driver::CudaEvent; 4],
    /// Per-sample losses and hits of this worker's rows in the current step.
    step_loss: Option<CudaSlice<f32>>,
    step_hits: Option<CudaSlice<u32>>,
    /// Pinned staging for the rows of one step or evaluation chunk, and their labels.
    pinned_x: Option<PinnedHostSlice<f32>>,
    pinned_y: Option<PinnedHostSlice<u32>>,
    x_dev: Option<CudaSlice<f32>>,
    y_dev: Option<CudaSlice<u32>>,
}

impl GpuReplica {
    /// Builds the replica on GPU `ordinal`: checks that every layer has a CUDA form,
    /// uploads `store` and the optimiser state of `optimizer`, and makes room for
    /// `shards_here` gradient slots.
    pub fn new(
        ordinal: usize,
        model: Sequential,
        store: &ParamStore,
        optimizer: &Optimizer,
        seed: u64,
        shards_here: usize,
    ) -> Result<GpuReplica> {
        let nodes = plan(&model)?;
        super::probe::cublas_available()?;
        let gpu = Gpu::new(ordinal)?;
        // SAFETY: cudarc's per-buffer event tracking (an event recorded or waited on for
        // every buffer of every launch once a context has a second stream) is not needed:
        // every buffer of a replica is used by its compute stream alone, pinned staging is
        // rewritten only after the step's closing wait, and the collective orders its own
        // stream against the compute stream with explicit events (`comm::gpu`). Replicas
        // sharing a GPU share its primary context, and the same holds for each of them.
        unsafe { gpu.context().disable_event_tracking() };
        let stream = gpu.stream().clone();
        let blas = CudaBlas::new(stream.clone())?;
        // A workspace of the replica's own: cuBLAS is reproducible bit for bit only when
        // streams that run at once (replicas sharing a GPU) do not share its default one.
        let workspace = stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE)?;
        {
            let (ptr, _sync) = workspace.device_ptr(&stream);
            // SAFETY: the workspace lives as long as the handle (both fields of the
            // replica, the handle dropped first) and is used on the handle's stream only.
            unsafe { cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, CUBLAS_WORKSPACE) }
                .result()?;
        }
        let (np, nb) = (model.num_params(), model.num_buffers());
        if store.params.len() != np || store.buffers.len() != nb {
            return Err(Error::config("initial weights", "they do not match the model's tensors"));
        }
        let config = *optimizer.config();
        let state = optimizer.state();
        let pick = |name: &str| state.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_vec());
        let m = pick("m").unwrap_or_else(|| vec![0.0; np]);
        let v = match config {
            OptimizerConfig::Adam { .. } => pick("v").unwrap_or_else(|| vec![0.0; np]),
            OptimizerConfig::Sgd { .. } => Vec::new(),
        };
        let width = np + nb;
        let timed = || gpu.context().new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
        let marks = [timed()?, timed()?, timed()?, timed()?];
        Ok(GpuReplica {
            device: Device::Cuda(ordinal),
            params: upload(&stream, &store.params)?,
            buffers: upload(&stream, &store.buffers)?,
            slots: stream.alloc_zeros(width * shards_here.max(1))?,
            reduced: stream.alloc_zeros(width.max(1))?,
            m: upload(&stream, &m)?,
            v: upload(&stream, &v)?,
            t: optimizer.steps(),
            config,
            seed,
            np,
            nb,
            nodes,
            model,
            gpu,
            blas: std::mem::ManuallyDrop::new(blas),
            _workspace: workspace,
            acts: None,
            marks,
            step_loss: None,
            step_hits: None,
            pinned_x: None,
            pinned_y: None,
            x_dev: None,
            y_dev: None,
        })
    }

    /// The stream every launch of this replica goes to (the collective orders itself
    /// after it).
    pub fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
        self.gpu.stream()
    }

    /// Trains one step: this worker's shards `first_shard..first_shard + shards_here`
    /// of `work`, the collective `comm` over every GPU, then the update.
    pub fn step(
        &mut self,
        work: &StepWork,
        comm: &mut GpuRank<'_>,
        first_shard: usize,
        shards_here: usize,
    ) -> Result<StepOutcome> {
        // GPU time, not the host's: the host only queues work until the step's one wait.
        self.marks[0].record(self.gpu.stream())?;
        let (np, nb, width) = (self.np, self.nb, self.np + self.nb);
        let mine = &work.shards[first_shard..first_shard + shards_here];
        let rows = mine.first().map_or(0, |r| r.start)..mine.last().map_or(0, |r| r.end);
        self.stage(&work.batch, rows.clone())?;
        let stream = self.gpu.stream().clone();
        stream.memset_zeros(&mut self.slots)?;
        if self.step_loss.as_ref().map(|l| l.len()) != Some(rows.len().max(1)) {
            self.step_loss = Some(stream.alloc_zeros(rows.len().max(1))?);
            self.step_hits = Some(stream.alloc_zeros(rows.len().max(1))?);
        }
        for (local, shard) in mine.iter().enumerate() {
            if shard.is_empty() {
                // An empty shard still joins the collective, with zeros.
                continue;
            }
            let n = shard.len();
            self.ensure_acts(n)?;
            let acts = self.acts.as_mut().expect("sized above");
            let per = self.model.input_shape().numel();
            let off = shard.start - rows.start;
            let x = self.x_dev.as_ref().expect("staged");
            let y = self.y_dev.as_ref().expect("staged");
            stream.memcpy_dtod(&x.slice(off * per..(off + n) * per), &mut acts.acts[0])?;
            stream.memcpy_dtod(&y.slice(off..off + n), &mut acts.labels)?;
            let slot = slot_start(local, np, nb);
            // The shard's BatchNorm buffers start from this replica's and are updated in
            // its slot by the training forward.
            if nb > 0 {
                stream.memcpy_dtod(&self.buffers.slice(0..nb), &mut self.slots.slice_mut(slot + np..slot + width))?;
            }
            let net = Net { gpu: &self.gpu, blas: &self.blas, nodes: &self.nodes, params: &self.params };
            let draw = Draw { seed: self.seed, step: work.step, replica: first_shard + local };
            net.forward(acts, Pass::Train { draw, stats: &mut self.slots, offset: slot + np })?;
            let k = self.model.output_shape().numel();
            let last = acts.acts.len() - 1;
            let step_loss = self.step_loss.as_mut().expect("sized above");
            self.gpu.softmax_xent_fwd(
                &acts.acts[last],
                &acts.labels,
                &mut step_loss.slice_mut(off..off + n),
                &mut acts.grads[0].slice_mut(0..n * k),
                &mut acts.correct,
                k,
            )?;
            stream.memcpy_dtod(
                &acts.correct,
                &mut self.step_hits.as_mut().expect("sized above").slice_mut(off..off + n),
            )?;
            net.backward(acts, &mut self.slots, slot, draw, self.model.first_trained_layer())?;
        }
        // Sum this device's shards in shard order, then across devices.
        self.marks[1].record(self.gpu.stream())?;
        let total = work.batch.len() as f32;
        let with_data = work.shards.iter().filter(|r| !r.is_empty()).count() as f32;
        let summed = if shards_here == 1 {
            &mut self.slots
        } else {
            self.gpu.reduce_sum(&self.slots, &mut self.reduced, shards_here, 1.0)?;
            &mut self.reduced
        };
        comm.all_reduce_sum(summed)?;
        let summed: &CudaSlice<f32> = summed;
        self.marks[2].record(self.gpu.stream())?;
        self.t += 1;
        let lr = self.config.lr() * work.lr_scale;
        let grad = summed.slice(0..np);
        match self.config {
            _ if np == 0 => {}
            OptimizerConfig::Sgd { momentum, weight_decay, .. } => {
                self.gpu.sgd_step(&mut self.params, &grad, &mut self.m, lr, momentum, weight_decay, 1.0 / total)?
            }
            OptimizerConfig::Adam { beta1, beta2, eps, weight_decay, .. } => self.gpu.adam_step(
                &mut self.params,
                &grad,
                &mut self.m,
                &mut self.v,
                AdamHyper { lr, beta1, beta2, eps, weight_decay },
                self.t,
                1.0 / total,
            )?,
        }
        if nb > 0 {
            // Running statistics: the mean over the logical replicas that saw data.
            let bufs = summed.slice(np..width);
            self.gpu.reduce_sum(&bufs, &mut self.buffers, 1, 1.0 / with_data)?;
        }
        self.marks[3].record(self.gpu.stream())?;
        // The one wait of the step: the losses it reports (released by an abort).
        comm.wait_for(&stream)?;
        let loss = stream.clone_dtoh(self.step_loss.as_ref().expect("sized above"))?;
        let hits = stream.clone_dtoh(self.step_hits.as_ref().expect("sized above"))?;
        let mut outcome = StepOutcome::default();
        for shard in mine {
            let r = shard.start - rows.start..shard.end - rows.start;
            outcome.shards.push(metrics(&loss[r.clone()], &hits[r]));
        }
        let ms = |a: &cudarc::driver::CudaEvent, b: &cudarc::driver::CudaEvent| -> Result<std::time::Duration> {
            Ok(std::time::Duration::from_secs_f64(f64::from(a.elapsed_ms(b)?.max(0.0)) / 1e3))
        };
        let [t0, t1, t2, t3] = &self.marks;
        outcome.compute = ms(t0, t1)? + ms(t2, t3)?;
        outcome.reduce = ms(t1, t2)?;
        Ok(outcome)
    }

    /// Loss and accuracy in evaluation mode on `rows` of `batch`, in chunks of at most
    /// `chunk` samples.
    pub fn evaluate(&mut self, batch: &Batch, rows: Range<usize>, chunk: usize) -> Result<Metrics> {
        let mut total = Metrics::default();
        let mut start = rows.start;
        while start < rows.end {
            let end = (start + chunk.max(1)).min(rows.end);
            let (loss, correct, _) = self.infer(batch, start..end)?;
            total.add(&metrics(&loss, &correct));
            start = end;
        }
        Ok(total)
    }

    /// Class probabilities (softmax of the logits) for `rows` of `batch`: (rows, K).
    pub fn predict(&mut self, batch: &Batch, rows: Range<usize>) -> Result<Vec<f32>> {
        let (_, _, logits) = self.infer(batch, rows)?;
        Ok(crate::nn::loss::softmax_rows(logits, self.model.output_shape().numel()))
    }

    /// Evaluation-mode forward of `rows`: per-sample losses, hits and the logits.
    fn infer(&mut self, batch: &Batch, rows: Range<usize>) -> Result<(Vec<f32>, Vec<u32>, Vec<f32>)> {
        let n = rows.len();
        if n == 0 {
            return Ok((Vec::new(), Vec::new(), Vec::new()));
        }
        self.stage(batch, rows)?;
        self.ensure_acts(n)?;
        let acts = self.acts.as_mut().expect("sized above");
        let stream = self.gpu.stream().clone();
        stream.memcpy_dtod(self.x_dev.as_ref().expect("staged"), &mut acts.acts[0])?;
        stream.memcpy_dtod(self.y_dev.as_ref().expect("staged"), &mut acts.labels)?;
        let net = Net { gpu: &self.gpu, blas: &self.blas, nodes: &self.nodes, params: &self.params };
        net.forward(acts, Pass::Eval { stats: &self.buffers })?;
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

    /// Parameters, buffers and optimiser state, copied to the host (waits for the GPU).
    pub fn snapshot(&self) -> Result<(ParamStore, Optimizer)> {
        let stream = self.gpu.stream();
        // Exact lengths: an empty tensor is held as one unused element on the device.
        let (np, nb) = (self.np, self.nb);
        let store = ParamStore {
            params: stream.clone_dtoh(&self.params.slice(0..np))?,
            buffers: stream.clone_dtoh(&self.buffers.slice(0..nb))?,
        };
        let mut optimizer = Optimizer::new(self.config, self.np);
        let mut state = Vec::new();
        match self.config {
            OptimizerConfig::Sgd { momentum, .. } if momentum > 0.0 => {
                state.push(("m", stream.clone_dtoh(&self.m.slice(0..np))?))
            }
            OptimizerConfig::Sgd { .. } => {}
            OptimizerConfig::Adam { .. } => {
                state.push(("m", stream.clone_dtoh(&self.m.slice(0..np))?));
                state.push(("v", stream.clone_dtoh(&self.v.slice(0..np))?));
            }
        }
        optimizer.restore(self.t, &state)?;
        Ok((store, optimizer))
    }

    /// Per-tensor fingerprints, as [`crate::train::worker::fingerprints`] computes them
    /// on the CPU.
    pub fn fingerprints(&self) -> Result<Vec<(String, u64)>> {
        let (store, optimizer) = self.snapshot()?;
        Ok(crate::train::worker::fingerprints(&self.model, &store, &optimizer))
    }

    /// Copies `rows` of `batch` to the GPU through pinned memory (asynchronously).
    fn stage(&mut self, batch: &Batch, rows: Range<usize>) -> Result<()> {
        let per = batch.sample_shape.numel();
        let (xs, ys) = (&batch.x[rows.start * per..rows.end * per], &batch.y[rows.clone()]);
        // The loss kernel never indexes with a bad label, but would give NaN for it: say
        // what is wrong instead, as the CPU loss does.
        let k = self.model.output_shape().numel();
        if let Some(&l) = ys.iter().find(|&&l| l as usize >= k) {
            return Err(Error::shape("softmax_cross_entropy", format!("label {l} out of range for {k} classes")));
        }
        let ctx = self.gpu.context().clone();
        let stream = self.gpu.stream().clone();
        if self.pinned_x.as_ref().map(|p| p.len()) != Some(xs.len()) {
            // SAFETY: the memory is written below before any read.
            self.pinned_x = Some(unsafe { ctx.alloc_pinned::<f32>(xs.len().max(1)) }?);
            self.pinned_y = Some(unsafe { ctx.alloc_pinned::<u32>(ys.len().max(1)) }?);
            self.x_dev = Some(stream.alloc_zeros(xs.len().max(1))?);
            self.y_dev = Some(stream.alloc_zeros(ys.len().max(1))?);
        }
        let (px, py) = (self.pinned_x.as_mut().expect("set"), self.pinned_y.as_mut().expect("set"));
        // No copy reads the staging any more: every step and evaluation ends with a wait
        // for the GPU, and a replica that failed mid-step is dropped (which waits too).
        px.as_mut_slice()?[..xs.len()].copy_from_slice(xs);
        py.as_mut_slice()?[..ys.len()].copy_from_slice(ys);
        stream.memcpy_htod(&*px, self.x_dev.as_mut().expect("set"))?;
        stream.memcpy_htod(&*py, self.y_dev.as_mut().expect("set"))?;
        Ok(())
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

impl Drop for GpuReplica {
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

/// Where shard slot `local` starts in a replica's slots: one [gradient sum (`np`) |
/// BatchNorm buffers (`nb`)] after another. `np` and `nb` are multiples of
/// `nn::TENSOR_ALIGN`, so every slot starts 256-byte aligned.
fn slot_start(local: usize, np: usize, nb: usize) -> usize {
    local * (np + nb)
}

/// Bytes of each replica's cuBLAS workspace (NVIDIA's recommendation for Hopper).
const CUBLAS_WORKSPACE: usize = 32 << 20;

/// What a training shard's dropout masks derive from, with the layer's index
/// (DESIGN.md: randomness derives from the seed, the step and the logical replica).
#[derive(Clone, Copy, Debug)]
struct Draw {
    seed: u64,
    step: u64,
    replica: usize,
}

impl Draw {
    fn dropout_key(&self, layer: usize) -> DropoutKey {
        DropoutKey { seed: self.seed, step: self.step, replica: self.replica as u64, layer: layer as u64 }
    }
}

/// What a forward pass is for, with what that needs.
enum Pass<'b> {
    /// A training shard: dropout draws from `draw`; BatchNorm normalises with the batch's
    /// statistics and updates the running ones held in `stats` from `offset` on (the
    /// shard's slot).
    Train { draw: Draw, stats: &'b mut CudaSlice<f32>, offset: usize },
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

fn metrics(loss: &[f32], correct: &[u32]) -> Metrics {
    Metrics {
        loss_sum: loss.iter().map(|&l| l as f64).sum(),
        correct: correct.iter().map(|&c| c as u64).sum(),
        count: loss.len() as u64,
    }
}

/// The network as the GPU runs it, or an error naming the first layer without a CUDA form.
fn plan(model: &Sequential) -> Result<Vec<Node>> {
    let mut shape = model.input_shape().clone();
    let mut nodes = Vec::with_capacity(model.layers().len());
    for (i, layer) in model.layers().iter().enumerate() {
        let name = model.layer_names()[i].clone();
        let op = layer.op().ok_or_else(|| {
            Error::config("model", format!("layer {name} ({}) has no CUDA implementation", layer.describe()))
        })?;
        let mut batched = vec![2];
        batched.extend_from_slice(shape.dims());
        let out = layer.output_shape(&Shape::new(batched))?;
        let output = Shape::new(&out.dims()[1..]);
        let (params, buffers) = model.layer_ranges(i);
        nodes.push(Node { op, name, input: shape, output: output.clone(), params, buffers });
        shape = output;
    }
    Ok(nodes)
}

/// Convolution geometry of `node` for a batch of `n`.
fn conv_geom(node: &Node, n: usize) -> Result<ConvGeom> {
    let LayerOp::Conv2d { in_channels, kernel: (kh, kw), stride, padding, .. } = node.op else {
        unreachable!("conv_geom of a convolution")
    };
    let d = node.input.dims();
    let (h, w) = (d[1], d[2]);
    let too_small = || Error::shape("conv2d", format!("{}: input {h}x{w} is smaller than the kernel", node.name));
    let (pt, pb, _) = pads(h, kh, stride, padding).ok_or_else(too_small)?;
    let (pl, pr, _) = pads(w, kw, stride, padding).ok_or_else(too_small)?;
    Ok(ConvGeom {
        n,
        c: in_channels,
        h,
        w,
        kh,
        kw,
        stride_h: stride,
        stride_w: stride,
        pad_top: pt,
        pad_left: pl,
        pad_bottom: pb,
        pad_right: pr,
    })
}

impl Activations {
    fn new(gpu: &Gpu, nodes: &[Node], n: usize) -> Result<Activations> {
        let stream = gpu.stream();
        let alloc = |len: usize| -> Result<CudaSlice<f32>> { Ok(stream.alloc_zeros::<f32>(len.max(1))?) };
        let mut acts = vec![alloc(n * nodes[0].input.numel())?];
        let (mut cols, mut saved) = (Vec::new(), Vec::new());
        let (mut widest, mut partial, mut dcol) = (n * nodes[0].input.numel(), 1, 1);
        for node in nodes {
            acts.push(alloc(n * node.output.numel())?);
            widest = widest.max(n * node.output.numel());
            match node.op {
                LayerOp::Conv2d { filters, .. } => {
                    let g = conv_geom(node, n)?;
                    cols.push(Some(alloc(g.col_len())?));
                    dcol = dcol.max(g.col_len());
                    partial = partial.max(n * filters * g.c * g.kh * g.kw);
                    saved.push(None);
                }
                LayerOp::BatchNorm2d { channels, .. } => {
                    cols.push(None);
                    saved.push(Some((alloc(channels)?, alloc(channels)?)));
                }
                _ => {
                    cols.push(None);
                    saved.push(None);
                }
            }
        }
        let k = nodes.last().expect("a model has a layer").output.numel();
        widest = widest.max(n * k);
        Ok(Activations {
            n,
            acts,
            cols,
            saved,
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
    /// The forward pass of every layer on `a.acts[0]`, as `pass` says.
    fn forward(&self, a: &mut Activations, mut pass: Pass<'_>) -> Result<()> {
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
                LayerOp::Conv2d { filters: o, bias, .. } => {
                    let g = conv_geom(node, n)?;
                    let (ckk, pp) = (g.c * g.kh * g.kw, g.oh() * g.ow());
                    let col = a.cols[i].as_mut().expect("a convolution has columns");
                    gpu.im2col_fwd(x, col, &g)?;
                    gemm(blas, &RmGemm::conv_fwd(n, o, ckk, pp), &p(0), &*col, y)?;
                    if bias {
                        gpu.bias_nchw_fwd(y, &p(1), n, o, pp)?;
                    }
                }
                LayerOp::BatchNorm2d { channels: c, eps, momentum, scale, center } => {
                    let hw = node.input.numel() / c;
                    let params = BnParams { gamma: scale.then(|| p(0)), beta: center.then(|| p(usize::from(scale))) };
                    let (rm, rv) = (&node.buffers[0], &node.buffers[1]);
                    match &mut pass {
                        Pass::Train { stats, offset, .. } => {
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
                            // Each statistic on its own aligned start: split below the variance.
                            let (mut below, mut above) = stats.split_at_mut(*offset + rv.start);
                            let mut mean = below.slice_mut(*offset + rm.start..*offset + rm.end);
                            let mut var = above.slice_mut(0..rv.len());
                            let (save_mean, save_invstd) =
                                a.saved[i].as_mut().expect("a BatchNorm has saved statistics");
                            gpu.batchnorm_train_fwd(
                                x,
                                y,
                                params,
                                &mut mean,
                                &mut var,
                                save_mean,
                                save_invstd,
                                (n, c, hw),
                                momentum,
                                eps,
                            )?;
                        }
                        Pass::Eval { stats } => gpu.batchnorm_eval_fwd(
                            x,
                            y,
                            params,
                            &stats.slice(rm.clone()),
                            &stats.slice(rv.clone()),
                            (n, c, hw),
                            eps,
                        )?,
                    }
                }
                LayerOp::Relu => gpu.relu_fwd(x, y)?,
                LayerOp::Rescaling { scale, offset } => gpu.rescale_fwd(x, y, scale, offset)?,
                LayerOp::Dropout { rate } => match &pass {
                    Pass::Train { draw, .. } if rate > 0.0 => gpu.dropout_fwd(x, y, rate, draw.dropout_key(i))?,
                    _ => stream.memcpy_dtod(x, y)?,
                },
                LayerOp::Flatten => stream.memcpy_dtod(x, y)?,
                LayerOp::GlobalAvgPool2d => {
                    let c = node.output.numel();
                    gpu.global_avgpool_fwd(x, y, n * c, node.input.numel() / c)?
                }
            }
        }
        Ok(())
    }

    /// The backward pass from the gradient of the summed loss in `a.grads[0]` down to
    /// layer `first`, writing the parameter gradients into the slot of `slots` at `slot`;
    /// dropout replays the masks of `draw`.
    fn backward(
        &self,
        a: &mut Activations,
        slots: &mut CudaSlice<f32>,
        slot: usize,
        draw: Draw,
        first: usize,
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
            let at = |j: usize| slot + node.params[j].start..slot + node.params[j].end;
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
                LayerOp::Conv2d { filters: o, bias, .. } => {
                    let g = conv_geom(node, n)?;
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
                LayerOp::BatchNorm2d { channels: c, scale, center, .. } => {
                    let hw = node.input.numel() / c;
                    let (save_mean, save_invstd) = a.saved[i].as_ref().expect("a BatchNorm has saved statistics");
                    let gamma = scale.then(|| p(0));
                    // The last parameter's gradient (beta, or the only one) starts `split`
                    // into the slots; gamma's, when there are both, lies below it on its
                    // own aligned start, not adjacent.
                    let split = node.params.last().map_or(0, |r| slot + r.start);
                    let (mut below, mut above) = slots.split_at_mut(split);
                    let last = above.slice_mut(0..node.params.last().map_or(0, |r| r.len()));
                    let (mut dgamma, mut dbeta) = match (scale, center) {
                        (true, true) => (Some(below.slice_mut(at(0))), Some(last)),
                        (true, false) => (Some(last), None),
                        (false, true) => (None, Some(last)),
                        (false, false) => (None, None),
                    };
                    gpu.batchnorm_train_bwd(
                        x,
                        &dy,
                        &mut dx,
                        gamma.as_ref(),
                        save_mean,
                        save_invstd,
                        dgamma.as_mut(),
                        dbeta.as_mut(),
                        (n, c, hw),
                    )?;
                }
                LayerOp::Relu => gpu.relu_bwd(x, &dy, &mut dx)?,
                LayerOp::Rescaling { scale, .. } => gpu.rescale_bwd(&dy, &mut dx, scale)?,
                LayerOp::Dropout { rate } if rate > 0.0 => gpu.dropout_bwd(&dy, &mut dx, rate, draw.dropout_key(i))?,
                LayerOp::Dropout { .. } | LayerOp::Flatten => stream.memcpy_dtod(&dy, &mut dx)?,
                LayerOp::GlobalAvgPool2d => {
                    let c = node.output.numel();
                    gpu.global_avgpool_bwd(&dy, &mut dx, n * c, node.input.numel() / c)?
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

    /// A layer with a CPU implementation only (no `LayerOp`).
    #[derive(Clone)]
    struct CpuOnly;

    impl crate::nn::Layer for CpuOnly {
        fn kind(&self) -> &'static str {
            "cpuonly"
        }
        fn output_shape(&self, input: &Shape) -> Result<Shape> {
            Ok(input.clone())
        }
        fn forward(
            &mut self,
            x: crate::Tensor,
            _: crate::nn::Params<'_>,
            _: crate::nn::ParamsMut<'_>,
            _: &crate::nn::Ctx,
        ) -> Result<crate::Tensor> {
            Ok(x)
        }
        fn backward(
            &mut self,
            d: crate::Tensor,
            _: crate::nn::Params<'_>,
            _: crate::nn::ParamsMut<'_>,
            _: crate::nn::InputGrad,
            _: &crate::nn::Ctx,
        ) -> Result<Option<crate::Tensor>> {
            Ok(Some(d))
        }
        fn boxed_clone(&self) -> Box<dyn crate::nn::Layer> {
            Box::new(self.clone())
        }
        fn describe(&self) -> String {
            "CpuOnly".into()
        }
    }

    #[test]
    fn a_layer_without_a_cuda_form_is_refused_by_name() {
        let layers: Vec<Box<dyn crate::nn::Layer>> = vec![Box::new(crate::nn::Linear::new(2, 3)), Box::new(CpuOnly)];
        let model = Sequential::new([2], layers).unwrap();
        let e = plan(&model).err().expect("a layer without a LayerOp cannot run on a GPU").to_string();
        assert!(e.contains("cpuonly0") && e.contains("CpuOnly") && e.contains("no CUDA implementation"), "{e}");
    }

    #[test]
    fn every_slot_and_tensor_view_starts_on_256_bytes() {
        use crate::models::{convnet, toy_mlp, ConvnetOptions, Norm};
        // Device allocations start 256-byte aligned (cuMemAlloc), so offsets of a
        // multiple of 64 f32 are what every view the replica hands out needs.
        let aligned = |floats: usize| (floats * std::mem::size_of::<f32>()) % 256 == 0;
        let models = [
            ("convnet", convnet(ConvnetOptions::default()).unwrap()),
            ("convnet without BN", convnet(ConvnetOptions { norm: Norm::None, ..ConvnetOptions::default() }).unwrap()),
            ("toy", toy_mlp(2, 2).unwrap()),
        ];
        for (name, model) in &models {
            let nodes = plan(model).unwrap();
            let (np, nb) = (model.num_params(), model.num_buffers());
            // The summed slot's buffer part, `summed.slice(np..width)`.
            assert!(aligned(np), "{name}: np {np}");
            let mut views = 0;
            for slots in 1..=3 {
                for local in 0..slots {
                    let slot = slot_start(local, np, nb);
                    assert!(aligned(slot), "{name}: slot {local} of {slots} at {slot}");
                    for node in &nodes {
                        for r in &node.params {
                            // The parameter's view in `params` and its gradient's in the slot.
                            assert!(aligned(r.start) && aligned(slot + r.start), "{name}: {} at {r:?}", node.name);
                            views += 1;
                        }
                        for r in &node.buffers {
                            // Running statistics in `buffers` (evaluation) and in the slot.
                            assert!(aligned(r.start) && aligned(slot + np + r.start), "{name}: {} at {r:?}", node.name);
                            views += 1;
                        }
                    }
                }
            }
            // Every tensor was seen in each of the 1 + 2 + 3 slots.
            let tensors = model.param_infos().len() + model.buffer_infos().len();
            assert_eq!(views, 6 * tensors, "{name}");
        }
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
