//! A model replica on one GPU: parameters, gradients, BatchNorm buffers and optimiser
//! state in flat device buffers, the layers run by kernels of `kernels/` and cuBLAS.
//!
//! Owns: [`GpuReplica`], what a CUDA worker thread holds (DESIGN.md: one thread per
//! device, each with its context, streams and full replica). The network is the same
//! [`Sequential`] the CPU replica runs: each layer describes its computation as a
//! [`LayerOp`], and this file launches it. Flat buffers use the CPU layout exactly
//! (`Sequential::layer_ranges`), so weights, checkpoints and replica fingerprints move
//! between the two backends unchanged.
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

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PinnedHostSlice};

use super::launch::{AdamHyper, BnParams, ConvGeom, DropoutKey, Gpu};
use crate::comm::gpu::GpuRank;
use crate::nn::conv2d::pads;
use crate::nn::loss::Metrics;
use crate::nn::{LayerOp, Mode, ParamStore, Sequential};
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
        let marked = self.gpu.stream().clone();
        let mark = || -> Result<cudarc::driver::CudaEvent> {
            Ok(marked.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?)
        };
        let t0 = mark()?;
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
            let slot = local * width;
            // The shard's BatchNorm buffers start from this replica's and are updated in
            // its slot by the training forward.
            if nb > 0 {
                stream.memcpy_dtod(&self.buffers.slice(0..nb), &mut self.slots.slice_mut(slot + np..slot + width))?;
            }
            let ctx = StepCtx { mode: Mode::Train, seed: self.seed, step: work.step, replica: first_shard + local };
            forward(
                &self.gpu,
                &self.blas,
                &self.nodes,
                acts,
                &self.params,
                Some((&mut self.slots, slot + np)),
                None,
                &ctx,
            )?;
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
            let first = self.model.first_trained_layer();
            backward(&self.gpu, &self.blas, &self.nodes, acts, &self.params, &mut self.slots, slot, &ctx, first)?;
        }
        // Sum this device's shards in shard order, then across devices.
        let t1 = mark()?;
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
        let t2 = mark()?;
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
        let t3 = mark()?;
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
        outcome.compute = ms(&t0, &t1)? + ms(&t2, &t3)?;
        outcome.reduce = ms(&t1, &t2)?;
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
        let ctx = StepCtx { mode: Mode::Eval, seed: self.seed, step: 0, replica: 0 };
        forward(&self.gpu, &self.blas, &self.nodes, acts, &self.params, None, Some(&self.buffers), &ctx)?;
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

/// Bytes of each replica's cuBLAS workspace (NVIDIA's recommendation for Hopper).
const CUBLAS_WORKSPACE: usize = 32 << 20;

/// What a layer may know about the pass it runs in.
struct StepCtx {
    mode: Mode,
    seed: u64,
    step: u64,
    replica: usize,
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

/// The forward pass of every layer on `a.acts[0]`. In training, BatchNorm updates the
/// running statistics held at `train_bufs` (the shard's slot, at the offset where the
/// buffers start); in evaluation it reads them from `eval_bufs`.
#[allow(clippy::too_many_arguments)]
fn forward(
    gpu: &Gpu,
    blas: &CudaBlas,
    nodes: &[Node],
    a: &mut Activations,
    params: &CudaSlice<f32>,
    mut train_bufs: Option<(&mut CudaSlice<f32>, usize)>,
    eval_bufs: Option<&CudaSlice<f32>>,
    ctx: &StepCtx,
) -> Result<()> {
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
                if ctx.mode == Mode::Train {
                    if n * hw < 2 {
                        return Err(Error::shape(
                            "batchnorm",
                            format!("{}: training needs more than one value per channel, got {}", node.name, n * hw),
                        ));
                    }
                    let (bufs, off) = train_bufs.as_mut().expect("a training forward has buffers");
                    let mut stats = bufs.slice_mut(*off + rm.start..*off + rv.end);
                    let (mut mean, mut var) = stats.split_at_mut(c);
                    let (save_mean, save_invstd) = a.saved[i].as_mut().expect("a BatchNorm has saved statistics");
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
                } else {
                    let bufs = eval_bufs.expect("an evaluation forward reads the running statistics");
                    gpu.batchnorm_eval_fwd(
                        x,
                        y,
                        params,
                        &bufs.slice(rm.clone()),
                        &bufs.slice(rv.clone()),
                        (n, c, hw),
                        eps,
                    )?;
                }
            }
            LayerOp::Relu => gpu.relu_fwd(x, y)?,
            LayerOp::Rescaling { scale, offset } => gpu.rescale_fwd(x, y, scale, offset)?,
            LayerOp::Dropout { rate } if ctx.mode == Mode::Train && rate > 0.0 => {
                gpu.dropout_fwd(x, y, rate, dropout_key(ctx, i))?
            }
            LayerOp::Dropout { .. } | LayerOp::Flatten => stream.memcpy_dtod(x, y)?,
            LayerOp::GlobalAvgPool2d => {
                let c = node.output.numel();
                gpu.global_avgpool_fwd(x, y, n * c, node.input.numel() / c)?
            }
        }
    }
    Ok(())
}

/// The backward pass from the gradient of the summed loss in `a.grads[0]` down to layer
/// `first`, writing the parameter gradients into the slot of `slots` at `slot`.
#[allow(clippy::too_many_arguments)]
fn backward(
    gpu: &Gpu,
    blas: &CudaBlas,
    nodes: &[Node],
    a: &mut Activations,
    params: &CudaSlice<f32>,
    slots: &mut CudaSlice<f32>,
    slot: usize,
    ctx: &StepCtx,
    first: usize,
) -> Result<()> {
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
                // gamma's and beta's gradients are adjacent in the slot.
                let count = usize::from(scale) + usize::from(center);
                let start = node.params.first().map_or(0, |r| slot + r.start);
                let mut region = slots.slice_mut(start..start + count * c);
                let (mut dgamma, mut dbeta) = match (scale, center) {
                    (true, true) => {
                        let (g, b) = region.split_at_mut(c);
                        (Some(g), Some(b))
                    }
                    (true, false) => (Some(region.slice_mut(..)), None),
                    (false, true) => (None, Some(region.slice_mut(..))),
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
            LayerOp::Dropout { rate } if rate > 0.0 => gpu.dropout_bwd(&dy, &mut dx, rate, dropout_key(ctx, i))?,
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

fn dropout_key(ctx: &StepCtx, layer: usize) -> DropoutKey {
    DropoutKey { seed: ctx.seed, step: ctx.step, replica: ctx.replica as u64, layer: layer as u64 }
}

/// A GEMM dimension as cuBLAS's `int`.
fn int(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::shape("gemm", format!("dimension {v} does not fit in i32")))
}

/// Elements a row-major matrix of `rows` × `cols` with leading dimension `ld` spans.
fn span(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

fn op(t: bool) -> cublasOperation_t {
    if t {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

/// One row-major GEMM, or a strided batch of them: C (m×n) = op(A)·op(B) with A (m×k,
/// or k×m stored when `ta`) and B (k×n, or n×k stored when `tb`) stored row-major with
/// leading dimensions lda, ldb, ldc, item i at offsets i·sa, i·sb, i·sc (a stride of 0
/// shares the operand across the batch). C is overwritten. Each layer's GEMMs are
/// named constructors, so their shapes are tested apart from the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RmGemm {
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
    sa: usize,
    sb: usize,
    sc: usize,
    batch: usize,
}

impl RmGemm {
    fn single(ta: bool, tb: bool, (m, n, k): (usize, usize, usize), (lda, ldb, ldc): (usize, usize, usize)) -> Self {
        RmGemm { ta, tb, m, n, k, lda, ldb, ldc, sa: 0, sb: 0, sc: 0, batch: 1 }
    }

    /// Linear forward: y (N, O) = x (N, F) · Wᵀ, W: (O, F).
    fn linear_fwd(n: usize, f: usize, o: usize) -> Self {
        RmGemm::single(false, true, (n, o, f), (f, f, o))
    }

    /// Linear weight gradient: dW (O, F) = dyᵀ (O, N) · x (N, F).
    fn linear_dw(n: usize, f: usize, o: usize) -> Self {
        RmGemm::single(true, false, (o, f, n), (o, f, f))
    }

    /// Linear input gradient: dx (N, F) = dy (N, O) · W (O, F).
    fn linear_dx(n: usize, f: usize, o: usize) -> Self {
        RmGemm::single(false, false, (n, f, o), (o, f, f))
    }

    /// Convolution forward, per sample: y_n (O, P) = W (O, CKK) · col_n (CKK, P).
    fn conv_fwd(batch: usize, o: usize, ckk: usize, p: usize) -> Self {
        RmGemm { sa: 0, sb: ckk * p, sc: o * p, batch, ..RmGemm::single(false, false, (o, p, ckk), (ckk, p, p)) }
    }

    /// Convolution weight gradient, per sample: dW_n (O, CKK) = dy_n (O, P) · col_nᵀ.
    fn conv_dw(batch: usize, o: usize, ckk: usize, p: usize) -> Self {
        RmGemm { sa: o * p, sb: ckk * p, sc: o * ckk, batch, ..RmGemm::single(false, true, (o, ckk, p), (p, p, ckk)) }
    }

    /// Convolution column gradient, per sample: dcol_n (CKK, P) = Wᵀ (CKK, O) · dy_n (O, P).
    fn conv_dcol(batch: usize, o: usize, ckk: usize, p: usize) -> Self {
        RmGemm { sa: 0, sb: o * p, sc: ckk * p, batch, ..RmGemm::single(true, false, (ckk, p, o), (ckk, p, p)) }
    }

    /// Errors unless each operand holds what the GEMM reads or writes.
    fn check(&self, a_len: usize, b_len: usize, c_len: usize) -> Result<()> {
        let last = self.batch.saturating_sub(1);
        let (ar, ac) = if self.ta { (self.k, self.m) } else { (self.m, self.k) };
        let (br, bc) = if self.tb { (self.n, self.k) } else { (self.k, self.n) };
        for (what, len, rows, cols, ld, stride) in [
            ("A", a_len, ar, ac, self.lda, self.sa),
            ("B", b_len, br, bc, self.ldb, self.sb),
            ("C", c_len, self.m, self.n, self.ldc, self.sc),
        ] {
            if ld < cols || len < last * stride + span(rows, cols, ld) {
                return Err(Error::shape(
                    "gemm",
                    format!(
                        "{what} ({rows}x{cols}, ld {ld}, {} x stride {stride}) does not fit in {len} elements",
                        self.batch
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The same product as cuBLAS (column-major) computes it. A row-major matrix read
    /// column-major is its transpose, so cuBLAS computes Cᵀ = op(B)ᵀ·op(A)ᵀ: the operands
    /// swap (B becomes cuBLAS's A) and keep their transpose flags, and m and n swap.
    fn cublas(&self) -> Result<StridedBatchedConfig<f32>> {
        let stride = |s: usize| i64::try_from(s).map_err(|_| Error::shape("gemm", format!("stride {s} too large")));
        Ok(StridedBatchedConfig {
            gemm: GemmConfig {
                transa: op(self.tb),
                transb: op(self.ta),
                m: int(self.n)?,
                n: int(self.m)?,
                k: int(self.k)?,
                alpha: 1.0f32,
                lda: int(self.ldb)?,
                ldb: int(self.lda)?,
                beta: 0.0,
                ldc: int(self.ldc)?,
            },
            batch_size: int(self.batch)?,
            stride_a: stride(self.sb)?,
            stride_b: stride(self.sa)?,
            stride_c: stride(self.sc)?,
        })
    }
}

/// Runs `g` on the replica's stream: C = op(A)·op(B), overwritten.
fn gemm<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
    blas: &CudaBlas,
    g: &RmGemm,
    a: &A,
    b: &B,
    c: &mut C,
) -> Result<()> {
    g.check(a.len(), b.len(), c.len())?;
    if g.m == 0 || g.n == 0 || g.batch == 0 {
        return Ok(());
    }
    let cfg = g.cublas()?;
    // SAFETY: every operand holds the elements the GEMM addresses for every item of the
    // batch (checked above), and all three live on the stream the handle was created on.
    unsafe {
        if g.batch == 1 {
            blas.gemm(cfg.gemm, b, a, c)
        } else {
            blas.gemm_strided_batched(cfg, b, a, c)
        }
    }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuBLAS's sgemm / sgemmStridedBatched on the host: column-major, as documented.
    fn cublas_reference(cfg: &StridedBatchedConfig<f32>, a: &[f32], b: &[f32], c: &mut [f32]) {
        let g = &cfg.gemm;
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let (lda, ldb, ldc) = (g.lda as usize, g.ldb as usize, g.ldc as usize);
        let t = |o: cublasOperation_t| o == cublasOperation_t::CUBLAS_OP_T;
        for item in 0..cfg.batch_size as usize {
            let (a, b) = (&a[item * cfg.stride_a as usize..], &b[item * cfg.stride_b as usize..]);
            let c = &mut c[item * cfg.stride_c as usize..];
            for j in 0..n {
                for i in 0..m {
                    let mut acc = 0.0f64;
                    for l in 0..k {
                        let av = if t(g.transa) { a[l + i * lda] } else { a[i + l * lda] };
                        let bv = if t(g.transb) { b[j + l * ldb] } else { b[l + j * ldb] };
                        acc += av as f64 * bv as f64;
                    }
                    c[i + j * ldc] = g.alpha * acc as f32 + g.beta * c[i + j * ldc];
                }
            }
        }
    }

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut g = crate::rng::SplitMix64::new(seed);
        (0..len).map(|_| g.next_f64() as f32 - 0.5).collect()
    }

    /// Row-major `rows x inner` times `inner x cols` on the host.
    fn matmul(a: &[f32], b: &[f32], rows: usize, inner: usize, cols: usize) -> Vec<f32> {
        let mut c = vec![0.0; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                c[i * cols + j] =
                    (0..inner).map(|l| a[i * inner + l] as f64 * b[l * cols + j] as f64).sum::<f64>() as f32;
            }
        }
        c
    }

    fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..cols * rows).map(|i| a[(i % rows) * cols + i / rows]).collect()
    }

    /// Runs `g` through the cuBLAS reference exactly as `gemm` hands it to cuBLAS.
    fn through_cublas(g: &RmGemm, a: &[f32], b: &[f32], c_len: usize) -> Vec<f32> {
        g.check(a.len(), b.len(), c_len).unwrap();
        let mut c = vec![0.0; c_len];
        // Operands in the order `gemm` passes them: cuBLAS's A is our B.
        cublas_reference(&g.cublas().unwrap(), b, a, &mut c);
        c
    }

    fn assert_close(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-5, "{what}: element {i}: {g} vs {w}");
        }
    }

    #[test]
    fn the_linear_gemms_compute_the_layer_products() {
        let (n, f, o) = (5, 7, 3);
        let (x, w, dy) = (values(n * f, 1), values(o * f, 2), values(n * o, 3));
        let y = through_cublas(&RmGemm::linear_fwd(n, f, o), &x, &w, n * o);
        assert_close("linear y = x·Wᵀ", &y, &matmul(&x, &transpose(&w, o, f), n, f, o));
        let dw = through_cublas(&RmGemm::linear_dw(n, f, o), &dy, &x, o * f);
        assert_close("linear dW = dyᵀ·x", &dw, &matmul(&transpose(&dy, n, o), &x, o, n, f));
        let dx = through_cublas(&RmGemm::linear_dx(n, f, o), &dy, &w, n * f);
        assert_close("linear dx = dy·W", &dx, &matmul(&dy, &w, n, o, f));
    }

    #[test]
    fn the_convolution_gemms_compute_the_per_sample_products() {
        let (batch, o, ckk, p) = (3, 4, 6, 5);
        let (w, col, dy) = (values(o * ckk, 4), values(batch * ckk * p, 5), values(batch * o * p, 6));
        let y = through_cublas(&RmGemm::conv_fwd(batch, o, ckk, p), &w, &col, batch * o * p);
        let dw = through_cublas(&RmGemm::conv_dw(batch, o, ckk, p), &dy, &col, batch * o * ckk);
        let dcol = through_cublas(&RmGemm::conv_dcol(batch, o, ckk, p), &w, &dy, batch * ckk * p);
        for s in 0..batch {
            let (col_s, dy_s) = (&col[s * ckk * p..][..ckk * p], &dy[s * o * p..][..o * p]);
            assert_close("conv y_n = W·col_n", &y[s * o * p..][..o * p], &matmul(&w, col_s, o, ckk, p));
            let want = matmul(dy_s, &transpose(col_s, ckk, p), o, p, ckk);
            assert_close("conv dW_n = dy_n·col_nᵀ", &dw[s * o * ckk..][..o * ckk], &want);
            let want = matmul(&transpose(&w, o, ckk), dy_s, ckk, o, p);
            assert_close("conv dcol_n = Wᵀ·dy_n", &dcol[s * ckk * p..][..ckk * p], &want);
        }
    }

    #[test]
    fn gemm_bounds_are_checked_for_every_operand_and_batch_item() {
        let g = RmGemm::linear_fwd(2, 3, 4); // (2x3)·(4x3)ᵀ
        assert!(g.check(6, 12, 8).is_ok());
        let e = g.check(6, 11, 8).unwrap_err();
        assert!(e.to_string().contains("B (4x3"), "{e}");
        assert!(g.check(6, 12, 7).is_err());
        // W shared by the batch (stride 0), columns and outputs strided.
        let g = RmGemm::conv_fwd(3, 2, 3, 4);
        assert!(g.check(6, 36, 24).is_ok());
        assert!(g.check(6, 36, 23).is_err());
        assert!(g.check(6, 35, 24).is_err());
        // A leading dimension below the row length is refused.
        assert!(RmGemm { lda: 2, ..RmGemm::linear_fwd(2, 3, 4) }.check(6, 12, 8).is_err());
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
