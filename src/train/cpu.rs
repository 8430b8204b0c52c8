//! The CPU replica: a [`Replica`] whose model runs the layers' own forward and backward
//! (`crate::nn`, the reference every other backend is checked against) on host memory,
//! inside its device's thread pool.
//!
//! Owns a full replica (the model with its caches, parameters, buffers, optimiser state)
//! and nothing of the exchange: it writes each shard's gradient into the slot it is given
//! and reads the sum it is shown, in place.

use std::ops::Range;
use std::time::{Duration, Instant};

use super::replica::{fingerprints, Fill, Mark, Replica, ShardPass, Snapshot, StepOutcome, Take};
use super::Batch;
use crate::error::Result;
use crate::exchange::Host;
use crate::nn::{Ctx, Graph, ParamStore};
use crate::ops::batchnorm::stats::StatsExchange;
use crate::ops::cross_entropy::{softmax_rows, CrossEntropy, Metrics};
use crate::optim::{clip_factor, DecayMask, GradNorm, Optimizer, StepScalars};
use crate::tensor::{Device, Tensor};

/// A device's replica on the CPU; `'s` is the run's statistics exchange, which a model
/// with synchronized BatchNorm reaches through its layers' context.
pub struct CpuReplica<'s> {
    device: Device,
    model: Graph,
    store: ParamStore,
    optimizer: Optimizer,
    /// Base seed of the run (dropout streams derive from it).
    seed: u64,
    /// The parameters weight decay applies to.
    decay: DecayMask,
    /// The scalars of the update in progress, and its gradient norm while it is read.
    scalars: Option<StepScalars>,
    norm: Option<GradNorm>,
    /// Metrics of this step's shards, in shard order.
    shards: Vec<Metrics>,
    /// When each mark of this step was passed, from `origin`.
    origin: Instant,
    marks: [Duration; 4],
    /// Synchronized BatchNorm's side of the exchange (None: statistics per shard).
    stats: Option<&'s dyn StatsExchange>,
    /// The loss trained and reported (label smoothing).
    loss: CrossEntropy,
}

impl<'s> CpuReplica<'s> {
    pub fn new(device: Device, model: Graph, store: ParamStore, optimizer: Optimizer, seed: u64) -> CpuReplica<'s> {
        CpuReplica {
            device,
            model,
            store,
            optimizer,
            seed,
            decay: DecayMask::all(),
            scalars: None,
            norm: None,
            shards: Vec::new(),
            origin: Instant::now(),
            marks: [Duration::ZERO; 4],
            stats: None,
            loss: CrossEntropy::default(),
        }
    }

    /// The replica that trains and reports `loss` (plain cross-entropy by default).
    pub fn with_loss(mut self, loss: CrossEntropy) -> CpuReplica<'s> {
        self.loss = loss;
        self
    }

    /// The replica whose synchronized BatchNorm layers meet the other replicas' through
    /// `stats`.
    pub fn with_stats(mut self, stats: &'s dyn StatsExchange) -> CpuReplica<'s> {
        self.stats = Some(stats);
        self
    }

    /// The replica whose weight decay applies to the parameters of `decay` only (without
    /// it, to all of them).
    pub fn with_decay(mut self, decay: DecayMask) -> CpuReplica<'s> {
        self.decay = decay;
        self
    }

    /// `rows` of `batch` as the model's inputs on this device: one tensor (rows, *shape_k)
    /// per input, in the model's order ([`Batch::input_rows`]).
    fn rows(&self, batch: &Batch, rows: Range<usize>) -> Result<Vec<Tensor>> {
        batch.input_rows(&rows).into_iter().map(|(v, dims)| Tensor::from_vec_on(v, dims, self.device)).collect()
    }

    /// The logits of `rows` in evaluation mode (the running statistics are read, not
    /// updated: the forward writes into a scratch copy).
    fn eval_logits(&mut self, batch: &Batch, rows: Range<usize>) -> Result<Tensor> {
        let x = self.rows(batch, rows)?;
        let mut scratch = self.store.buffers.clone();
        self.model.forward_many(x, &self.store.params, &mut scratch, &Ctx::eval(self.device))
    }
}

impl Replica for CpuReplica<'_> {
    type Mem = Host;

    fn params_len(&self) -> usize {
        self.store.params.len()
    }

    fn mark(&mut self, mark: Mark) -> Result<()> {
        if mark == Mark::Start {
            self.origin = Instant::now();
            self.shards.clear();
        }
        self.marks[mark.index()] = self.origin.elapsed();
        Ok(())
    }

    /// Nothing to do: the shards read their rows from the host batch.
    fn stage(&mut self, _batch: &Batch, _rows: Range<usize>) -> Result<()> {
        Ok(())
    }

    fn start_slot(&mut self, slot: &mut &mut [f32]) -> Result<()> {
        let (grads, bufs) = slot.split_at_mut(self.store.params.len());
        grads.fill(0.0);
        bufs.copy_from_slice(&self.store.buffers);
        Ok(())
    }

    fn train_shard(&mut self, batch: &Batch, shard: &ShardPass, slot: &mut &mut [f32]) -> Result<()> {
        let ctx = Ctx {
            sample_offset: shard.offset,
            stats: self.stats,
            ..Ctx::train(self.seed, shard.step, shard.index, self.device)
        };
        let np = self.store.params.len();
        let x = self.rows(batch, shard.rows.clone())?;
        let (grads, bufs) = slot.split_at_mut(np);
        let logits = self.model.forward_many(x, &self.store.params, bufs, &ctx)?;
        let (metrics, dlogits) = self.loss.with_grad(&logits, batch.labels(&shard.rows))?;
        self.model.backward(dlogits, &self.store.params, grads, &ctx)?;
        match (shard.fill, self.shards.last_mut()) {
            (Fill::Add, Some(m)) => m.add(&metrics),
            _ => self.shards.push(metrics),
        }
        Ok(())
    }

    fn skip_shard(&mut self, shard: &ShardPass) {
        if shard.fill == Fill::Write {
            self.shards.push(Metrics::default());
        }
    }

    fn synchronized(&self) -> (&Graph, Option<&dyn StatsExchange>) {
        (&self.model, self.stats)
    }

    fn begin_update(&mut self, lr_scale: f32, grad_divisor: f32) {
        self.norm = None;
        self.scalars = Some(self.optimizer.begin_step(lr_scale, grad_divisor));
    }

    fn add_grad_norm(&mut self, offset: usize, grad_sum: &[f32]) -> Result<()> {
        let divisor = self.scalars.expect("begin_update comes before add_grad_norm").grad_divisor;
        self.norm.get_or_insert_with(GradNorm::default).add(offset, grad_sum, divisor);
        Ok(())
    }

    fn clip_grad_norm(&mut self, max_norm: f32) -> Result<()> {
        let norm = self.norm.take().unwrap_or_default().norm();
        self.scalars.as_mut().expect("begin_update comes before clip_grad_norm").clip = clip_factor(norm, max_norm);
        Ok(())
    }

    fn update_params(&mut self, offset: usize, grad_sum: &[f32]) -> Result<()> {
        let scalars = self.scalars.expect("begin_update comes before update_params");
        for (run, s) in self.decay.split(offset..offset + grad_sum.len(), &scalars) {
            let grad = &grad_sum[run.start - offset..run.end - offset];
            self.optimizer.update(run.start, &mut self.store.params[run], grad, &s);
        }
        Ok(())
    }

    fn set_buffers(&mut self, offset: usize, sum: &[f32], scale: f32) -> Result<()> {
        for (dst, &v) in self.store.buffers[offset..offset + sum.len()].iter_mut().zip(sum) {
            *dst = v * scale;
        }
        Ok(())
    }

    fn params_mut(&mut self) -> &mut [f32] {
        &mut self.store.params
    }

    fn keep_part(&mut self, range: Range<usize>) -> Result<()> {
        self.optimizer = self.optimizer.part(range);
        Ok(())
    }

    fn finish_step(&mut self, _aborted: &dyn Fn() -> bool) -> Result<StepOutcome> {
        self.scalars = None;
        self.norm = None;
        Ok(StepOutcome::from_marks(std::mem::take(&mut self.shards), self.marks))
    }

    fn evaluate_chunk(&mut self, batch: &Batch, rows: Range<usize>) -> Result<Metrics> {
        let logits = self.eval_logits(batch, rows.clone())?;
        self.loss.score(&logits, batch.labels(&rows))
    }

    fn predict_chunk(&mut self, batch: &Batch, rows: Range<usize>) -> Result<Vec<f32>> {
        let logits = self.eval_logits(batch, rows)?;
        let k = logits.shape().per_sample();
        Ok(softmax_rows(logits.into_vec(), k))
    }

    fn snapshot(&mut self, take: Take) -> Result<Snapshot> {
        Ok(Snapshot {
            weights: take.weights.then(|| self.store.clone()),
            optimizer: take.optimizer.then(|| self.optimizer.clone()),
        })
    }

    fn optimizer_bytes(&self) -> usize {
        self.optimizer.state_bytes()
    }

    fn fingerprints(&mut self) -> Result<Vec<(String, u64)>> {
        Ok(fingerprints(&self.model, &self.store, &self.optimizer))
    }
}
