//! The GPU replica: a [`Replica`] whose network runs on one GPU ([`GpuNet`]), every
//! method but the step's end and the reads only queueing work on the GPU's stream.
//!
//! Owns the host side of a GPU replica: the optimiser's configuration and step count,
//! the rows staged for the step, the run's statistics exchange when the model has
//! synchronized BatchNorm layers (`with_stats`: they meet the other replicas' on the host,
//! inside the passes), and the translation between the step's terms (batches, shards,
//! pieces of the sum) and the network's (rows on the device, slots, views). The device
//! side — buffers, kernels, cuBLAS — is `model::gpu`'s.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut};

use super::replica::{fingerprints, Fill, Mark, Replica, ShardPass, Snapshot, StepOutcome, Take};
use super::Batch;
use crate::error::{Error, Result};
use crate::exchange::gpu::DeviceMemory;
use crate::exchange::Abort;
use crate::model::gpu::{Clip, GpuNet, OptimizerState, SlotUse};
use crate::nn::{Graph, ParamStore};
use crate::ops::batchnorm::stats::StatsExchange;
use crate::ops::batchnorm::Synchronized;
use crate::ops::cross_entropy::{softmax_rows, CrossEntropy, Metrics};
use crate::ops::gpu::Draw;
use crate::optim::{DecayMask, Optimizer, StepScalars};
use crate::tensor::Device;

/// Every kernel file a GPU run may load, each once: each layer type's
/// ([`crate::model::LAYER_TYPES`], where it has one), the loss's, the optimiser's, the
/// 16-bit codec's and the runtime's own buffer kernels. The NVRTC test compiles them all,
/// and the host-run test runs every kernel of them.
#[cfg(test)]
pub(crate) fn kernel_files() -> Vec<&'static crate::cuda::KernelFile> {
    let ops = crate::model::LAYER_TYPES.iter().filter_map(|t| t.kernels);
    let others = [
        &crate::ops::cross_entropy::gpu::KERNELS,
        &crate::optim::gpu::KERNELS,
        &crate::exchange::gpu::codec::KERNELS,
        &crate::cuda::buffers::KERNELS,
    ];
    ops.chain(others).collect()
}

/// A device's replica on a GPU; `'s` is the run's statistics exchange, which a model
/// with synchronized BatchNorm meets the other replicas' statistics through.
pub struct GpuReplica<'s> {
    net: GpuNet,
    /// The optimiser's configuration and step count (its state is on the GPU, `net`'s).
    clock: Optimizer,
    seed: u64,
    /// The parameters weight decay applies to.
    decay: DecayMask,
    /// The scalars of the update in progress, and whether it is clipped (the factor is
    /// on the device).
    scalars: Option<StepScalars>,
    clip: Clip,
    /// The staged rows of this step (the batch's rows `staged.start..staged.end`), and
    /// its shards' rows within them.
    staged: Range<usize>,
    shards: Vec<Range<usize>>,
    /// Synchronized BatchNorm's side of the statistics exchange, and the run's abort,
    /// which the host's waits for the device inside a pass poll (None: statistics per
    /// shard).
    stats: Option<(&'s dyn StatsExchange, &'s dyn Abort)>,
}

impl<'s> GpuReplica<'s> {
    /// Builds the replica on `device` (a GPU) from the model, its weights and the
    /// optimiser state to start from.
    pub fn new(device: Device, start: (Graph, ParamStore, Optimizer), seed: u64) -> Result<GpuReplica<'s>> {
        let Device::Cuda(ordinal) = device else {
            return Err(Error::config("devices", format!("{device} is not a GPU")));
        };
        let (model, store, optimizer) = start;
        let state = OptimizerState { config: *optimizer.config(), state: optimizer.state() };
        // The configuration, the step count and whether a part, without the state's host
        // copy (an optimiser of no parameters holds no state).
        let mut clock = Optimizer::new(*optimizer.config(), 0);
        clock.restore(optimizer.steps(), &[])?;
        if optimizer.is_part() {
            clock = clock.part(0..0);
        }
        let net = GpuNet::new(ordinal, model, &store, state, Mark::ALL.len())?;
        Ok(GpuReplica {
            net,
            clock,
            seed,
            decay: DecayMask::all(),
            scalars: None,
            clip: Clip::None,
            staged: 0..0,
            shards: Vec::new(),
            stats: None,
        })
    }

    /// The replica whose weight decay applies to the parameters of `decay` only (without
    /// it, to all of them).
    pub fn with_decay(mut self, decay: DecayMask) -> GpuReplica<'s> {
        self.decay = decay;
        self
    }

    /// The replica whose synchronized BatchNorm layers meet the other replicas' through
    /// `stats`; its waits for the device inside a pass give up once `abort` is raised.
    pub fn with_stats(mut self, stats: &'s dyn StatsExchange, abort: &'s dyn Abort) -> GpuReplica<'s> {
        self.stats = Some((stats, abort));
        self
    }

    /// The replica that trains and reports `loss` (plain cross-entropy by default).
    pub fn with_loss(mut self, loss: CrossEntropy) -> GpuReplica<'s> {
        self.net.set_loss(loss);
        self
    }

    /// The stream every launch of this replica goes to (its exchange orders itself
    /// after it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.net.stream()
    }

    /// Where `shard`'s rows lie among the staged rows, noted for its metrics: a shard's
    /// micro-batches are consecutive rows, and its metrics cover their union.
    fn note_shard(&mut self, shard: &ShardPass) -> Range<usize> {
        let s = &shard.rows;
        // The staged rows span this device's shards, so each shard lies inside them.
        let rows = s.start - self.staged.start..s.end - self.staged.start;
        match (shard.fill, self.shards.last_mut()) {
            (Fill::Add, Some(last)) => last.end = rows.end,
            _ => self.shards.push(rows.clone()),
        }
        rows
    }

    /// The rows `rows` of `batch`, x (input by input: `Batch::inputs_apart`) and y.
    fn rows<'b>(batch: &'b Batch, rows: &Range<usize>) -> (Cow<'b, [f32]>, &'b [u32]) {
        (batch.inputs_apart(rows), batch.labels(rows))
    }

    /// Parameters, buffers and optimiser state (the part it holds, when sharded), copied
    /// to the host.
    fn download(&mut self) -> Result<(ParamStore, Optimizer)> {
        let (store, state) = self.net.download()?;
        let whole = Optimizer::new(*self.clock.config(), store.params.len());
        let mut optimizer = if self.clock.is_part() { whole.part(self.net.state_range()) } else { whole };
        optimizer.restore(self.clock.steps(), &state)?;
        Ok((store, optimizer))
    }
}

impl Replica for GpuReplica<'_> {
    type Mem = DeviceMemory;

    fn params_len(&self) -> usize {
        self.net.model().params_len()
    }

    fn mark(&mut self, mark: Mark) -> Result<()> {
        self.net.mark(mark.index())
    }

    fn stage(&mut self, batch: &Batch, rows: Range<usize>) -> Result<()> {
        let (x, y) = Self::rows(batch, &rows);
        self.net.stage(&x, y)?;
        self.staged = rows;
        self.shards.clear();
        Ok(())
    }

    fn start_slot(&mut self, slot: &mut CudaViewMut<'_, f32>) -> Result<()> {
        self.net.start_slot(slot)
    }

    fn train_shard(&mut self, _batch: &Batch, shard: &ShardPass, slot: &mut CudaViewMut<'_, f32>) -> Result<()> {
        let rows = self.note_shard(shard);
        let draw = Draw { seed: self.seed, step: shard.step, shard: shard.index, sample_offset: shard.offset };
        let fill = match shard.fill {
            Fill::Write => SlotUse::Write,
            Fill::Add => SlotUse::Add,
        };
        let sync = self.stats.map(|(stats, _)| Synchronized { stats, shard: shard.index });
        let abort = self.stats.map(|(_, abort)| abort);
        let aborted = || abort.is_some_and(|a| a.is_aborted());
        self.net.train_shard(rows, draw, slot, fill, sync, &aborted)
    }

    fn skip_shard(&mut self, shard: &ShardPass) {
        self.note_shard(shard);
    }

    fn synchronized(&self) -> (&Graph, Option<&dyn StatsExchange>) {
        (self.net.model(), self.stats.map(|(stats, _)| stats))
    }

    fn begin_update(&mut self, lr_scale: f32, grad_divisor: f32) {
        self.clip = Clip::None;
        self.scalars = Some(self.clock.begin_step(lr_scale, grad_divisor));
    }

    fn add_grad_norm(&mut self, offset: usize, grad_sum: CudaView<'_, f32>) -> Result<()> {
        let divisor = self.scalars.expect("begin_update comes before add_grad_norm").grad_divisor;
        self.net.add_grad_norm(offset, &grad_sum, divisor)
    }

    fn clip_grad_norm(&mut self, max_norm: f32) -> Result<()> {
        self.net.clip_grad_norm(max_norm)?;
        self.clip = Clip::Factor;
        Ok(())
    }

    fn update_params(&mut self, offset: usize, grad_sum: CudaView<'_, f32>) -> Result<()> {
        let scalars = self.scalars.expect("begin_update comes before update_params");
        for (run, s) in self.decay.split(offset..offset + grad_sum.len(), &scalars) {
            let piece = grad_sum.slice(run.start - offset..run.end - offset);
            self.net.update_params(&s, run.start, &piece, self.clip)?;
        }
        Ok(())
    }

    fn set_buffers(&mut self, offset: usize, sum: CudaView<'_, f32>, scale: f32) -> Result<()> {
        self.net.set_buffers(offset, &sum, scale)
    }

    fn params_mut(&mut self) -> CudaViewMut<'_, f32> {
        self.net.params_mut()
    }

    fn keep_part(&mut self, range: Range<usize>) -> Result<()> {
        self.net.keep_part(range.clone())?;
        self.clock = self.clock.part(range);
        Ok(())
    }

    /// The step's one wait (released by an abort), then its losses.
    fn finish_step(&mut self, aborted: &dyn Fn() -> bool) -> Result<StepOutcome> {
        self.scalars = None;
        self.clip = Clip::None;
        self.net.wait(aborted)?;
        let (loss, hits) = self.net.step_losses()?;
        // A row's labels: one, or one per position of a sequence.
        let t = self.net.targets_and_classes().0;
        let labels = |r: &Range<usize>| r.start * t..r.end * t;
        let shards = self.shards.iter().map(|r| metrics(&loss[labels(r)], &hits[labels(r)])).collect();
        let t = self.net.mark_times()?;
        Ok(StepOutcome::from_marks(shards, [t[0], t[1], t[2], t[3]]))
    }

    fn evaluate_chunk(&mut self, batch: &Batch, rows: Range<usize>) -> Result<Metrics> {
        let (x, y) = Self::rows(batch, &rows);
        let (loss, correct, _) = self.net.infer(&x, y)?;
        Ok(metrics(&loss, &correct))
    }

    fn predict_chunk(&mut self, batch: &Batch, rows: Range<usize>) -> Result<Vec<f32>> {
        let (x, y) = Self::rows(batch, &rows);
        let (_, _, logits) = self.net.infer(&x, y)?;
        Ok(softmax_rows(logits, self.net.targets_and_classes().1))
    }

    fn snapshot(&mut self, take: Take) -> Result<Snapshot> {
        if take == (Take { weights: false, optimizer: false }) {
            return Ok(Snapshot { weights: None, optimizer: None });
        }
        let (store, optimizer) = self.download()?;
        Ok(Snapshot { weights: take.weights.then_some(store), optimizer: take.optimizer.then_some(optimizer) })
    }

    fn optimizer_bytes(&self) -> usize {
        self.clock.config().state_bytes(self.net.state_range().len())
    }

    fn fingerprints(&mut self) -> Result<Vec<(String, u64)>> {
        let (store, optimizer) = self.download()?;
        Ok(fingerprints(self.net.model(), &store, &optimizer))
    }
}

/// Metrics of samples from their losses and hits (the loss summed in f64, as the CPU's).
fn metrics(loss: &[f32], correct: &[u32]) -> Metrics {
    Metrics {
        loss_sum: loss.iter().map(|&l| l as f64).sum(),
        correct: correct.iter().map(|&c| c as u64).sum(),
        count: loss.len() as u64,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;

    use super::kernel_files;
    use crate::model::LAYER_TYPES;

    /// The kernel files of [`kernel_files`] that belong to no layer type, in its order,
    /// each with the test, in the file that declares it, that runs every kernel of it on
    /// the host against its CPU code (a layer type's file is held to its host check by the
    /// conformance test, `ops::conformance`).
    const OTHER_FILES: [(&str, &str); 4] = [
        ("cross_entropy.cu", "ops::cross_entropy::gpu::tests::the_kernel_runs_on_the_host_as_the_cpu_loss"),
        ("optim.cu", "optim::gpu::tests::the_kernels_run_on_the_host_as_the_cpu_optimizer"),
        ("codec.cu", "exchange::gpu::codec::tests::the_kernels_run_on_the_host_as_the_codec"),
        ("buffers.cu", "cuda::buffers::tests::the_kernels_run_on_the_host_as_their_definitions"),
    ];

    #[test]
    fn every_kernel_file_is_a_layer_types_or_names_its_host_check() {
        let files: Vec<&str> = kernel_files().iter().map(|f| f.name).collect();
        let unique: BTreeSet<&str> = files.iter().copied().collect();
        assert_eq!(unique.len(), files.len(), "a kernel file listed twice: {files:?}");
        let of_layers: BTreeSet<&str> = LAYER_TYPES.iter().filter_map(|t| t.kernels).map(|f| f.name).collect();
        let others: Vec<&str> = files.iter().copied().filter(|f| !of_layers.contains(f)).collect();
        assert_eq!(others, OTHER_FILES.map(|(file, _)| file), "the kernel files of no layer type");
        // Each named test is where its path says: in the module that declares the file, a
        // test function of that name running on the host kernels under that name.
        for (file, test) in OTHER_FILES {
            let (module, name) = test.rsplit_once("::tests::").expect("a path to a test of a `tests` module");
            let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(module.replace("::", "/"));
            let source = std::fs::read_to_string(base.with_extension("rs"))
                .or_else(|_| std::fs::read_to_string(base.join("mod.rs")))
                .unwrap_or_else(|e| panic!("{test}: no source for {module}: {e}"));
            for needle in [
                format!("\"{file}\" {{"),
                format!("fn {name}() {{"),
                format!("const TEST: &str = \"{name}\";"),
                "checker_or_skip(TEST, crate::train::kernel_files)".to_string(),
            ] {
                assert!(source.contains(&needle), "{file}: {module} has no `{needle}`");
            }
        }
    }
}
