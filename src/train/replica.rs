//! What a device replica does: the [`Replica`] trait that the one step (`step.rs`) runs,
//! and the replica check every device shares.
//!
//! A replica is a full copy of the model on one device — parameters, BatchNorm buffers,
//! optimiser state — with the device's way of computing. The CPU replica (`cpu.rs`)
//! computes as it is called; the GPU replica (`gpu.rs`) only queues work on its stream
//! and waits once per step, in [`Replica::finish_step`], so every method but that one and
//! the reads (evaluation, prediction, snapshots) may return before the work is done.
//! Values the step hands over (slots to write, pieces of the sum to read) live in the
//! exchange's memory ([`Memory`]), which the replica and its exchange agree on.

use std::ops::Range;
use std::time::Duration;

use super::Batch;
use crate::digest::Fnv1a;
use crate::error::{Error, Result};
use crate::exchange::Memory;
use crate::nn::{Graph, ParamStore};
use crate::ops::batchnorm::stats::StatsExchange;
use crate::ops::cross_entropy::Metrics;
use crate::optim::{DecayMask, DecayOn, Optimizer};

/// How one pass over a shard's rows meets the shard's slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// The shard's first (or only) pass: writes the whole slot.
    Write,
    /// A later micro-batch of the same shard: adds its gradient into the slot and moves
    /// the slot's running statistics on from where the previous micro-batch left them.
    Add,
}

/// One logical replica's share of a step, or one micro-batch of it.
#[derive(Clone, Debug)]
pub struct ShardPass {
    /// The shard's index, its logical replica's: BatchNorm statistics and dropout
    /// streams belong to it.
    pub index: usize,
    /// The rows of the global batch this pass trains (possibly none): the shard's, or one
    /// micro-batch of them.
    pub rows: Range<usize>,
    /// Position of `rows.start` within the logical replica's shard (0 but for later
    /// micro-batches): dropout masks are indexed from it, so that an accumulated step
    /// draws the masks of the unaccumulated one.
    pub offset: usize,
    /// The global step (0-based).
    pub step: u64,
    pub fill: Fill,
}

/// Points of a step whose times a replica records (on the GPU, as events on its stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    Start,
    /// Every shard's backward is done (queued, on a GPU).
    Computed,
    /// The exchange's sum is done.
    Summed,
    /// The update is done.
    Updated,
}

impl Mark {
    #[cfg(feature = "cuda")]
    pub const ALL: [Mark; 4] = [Mark::Start, Mark::Computed, Mark::Summed, Mark::Updated];

    /// Index of the mark in [`Mark::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// What one step produced on one device.
#[derive(Clone, Debug, Default)]
pub struct StepOutcome {
    /// Metrics of each of this device's logical replicas, in shard order.
    pub shards: Vec<Metrics>,
    /// Forward, backward and update time (`Start..Computed` + `Summed..Updated`).
    pub compute: Duration,
    /// The exchange's time (`Computed..Summed`).
    pub reduce: Duration,
}

impl StepOutcome {
    /// The outcome of `shards` with times taken from the four marks.
    pub fn from_marks(shards: Vec<Metrics>, at: [Duration; 4]) -> StepOutcome {
        let span = |a: Mark, b: Mark| at[b.index()].saturating_sub(at[a.index()]);
        StepOutcome {
            shards,
            compute: span(Mark::Start, Mark::Computed) + span(Mark::Summed, Mark::Updated),
            reduce: span(Mark::Computed, Mark::Summed),
        }
    }
}

/// What a [`Replica::snapshot`] copies to the host. The coordinator asks each replica
/// for what it keeps, never more: replica 0's weights (every replica holds the same),
/// and replica 0's optimiser state or, when sharded, every device's part. A snapshot of
/// N replicas therefore holds one copy of the model and of its optimiser state, as the
/// memory estimate's "final state" counts, not N.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Take {
    pub weights: bool,
    pub optimizer: bool,
}

/// A replica's state on the host, as much of it as its [`Take`] asked for.
pub(crate) struct Snapshot {
    pub weights: Option<ParamStore>,
    pub optimizer: Option<Optimizer>,
}

/// A model replica on one device, as the step drives it. Every replica of a run makes
/// the same calls with the same values, so they stay bitwise identical.
pub(crate) trait Replica {
    /// Where the slots it writes and the sums it reads live.
    type Mem: Memory;

    /// Length of the flat parameters: a slot is `[params_len gradient values | buffers]`.
    fn params_len(&self) -> usize;

    /// Records the time of `mark` (queued on a GPU).
    fn mark(&mut self, mark: Mark) -> Result<()>;

    /// Takes `rows` of `batch`, the rows of every shard this device trains in this step
    /// (a GPU copies them to the device, asynchronously).
    fn stage(&mut self, batch: &Batch, rows: Range<usize>) -> Result<()>;

    /// The start of a shard's slot, before its first pass: zeros in the gradient part, the
    /// replica's BatchNorm buffers in the buffer part (the shard's running statistics start
    /// from the replica's and move on in the slot). The step calls it; a backend only
    /// writes the values.
    fn start_slot(&mut self, slot: &mut <Self::Mem as Memory>::ViewMut<'_>) -> Result<()>;

    /// Forward, the loss SUMMED over the shard's rows (at least one), backward, into the
    /// slot [`Replica::start_slot`] started: [`Fill::Write`] (the first pass) writes the
    /// gradient and starts the shard's metrics; [`Fill::Add`] (a later micro-batch of the
    /// same shard) adds its gradient to the slot's and adds to the shard's metrics, kept
    /// for [`Replica::finish_step`]. Either moves the slot's buffers on by its forward.
    fn train_shard(
        &mut self,
        batch: &Batch,
        shard: &ShardPass,
        slot: &mut <Self::Mem as Memory>::ViewMut<'_>,
    ) -> Result<()>;

    /// A pass without rows: on [`Fill::Write`], the shard's metrics start empty. (Its slot
    /// keeps what [`Replica::start_slot`] wrote; the step makes its calls to synchronized
    /// BatchNorm's statistics exchange.)
    fn skip_shard(&mut self, shard: &ShardPass);

    /// The model, and where its synchronized BatchNorm layers meet the other logical
    /// replicas' (None: statistics per shard, nothing to meet).
    fn synchronized(&self) -> (&Graph, Option<&dyn StatsExchange>);

    /// Starts the update of a step at `lr_scale` times the learning rate, for gradients
    /// summed over `grad_divisor` samples.
    fn begin_update(&mut self, lr_scale: f32, grad_divisor: f32);

    /// Adds the piece `offset..offset + len` of the gradient sum to this step's gradient
    /// norm (after [`Replica::begin_update`]; the pieces come in order and cover every
    /// parameter: `optim::GradNorm`'s association, on the GPU too).
    fn add_grad_norm(&mut self, offset: usize, grad_sum: <Self::Mem as Memory>::View<'_>) -> Result<()>;

    /// Clips this step's update by the global norm: every gradient value is scaled by
    /// `clip_grad_norm_`'s factor for `max_norm` (`optim::clip_factor`) of the norm the
    /// pieces [`Replica::add_grad_norm`] was given make.
    fn clip_grad_norm(&mut self, max_norm: f32) -> Result<()>;

    /// Updates the parameters `offset..offset + len` from that piece of the gradient sum
    /// (weight decay on the parameters of the replica's `DecayMask` only).
    fn update_params(&mut self, offset: usize, grad_sum: <Self::Mem as Memory>::View<'_>) -> Result<()>;

    /// Sets the buffers `offset..offset + len` to `scale` times that piece of the sum of
    /// every shard's buffers.
    fn set_buffers(&mut self, offset: usize, sum: <Self::Mem as Memory>::View<'_>, scale: f32) -> Result<()>;

    /// The flat parameters, for a sharded optimiser's all-gather.
    fn params_mut(&mut self) -> <Self::Mem as Memory>::ViewMut<'_>;

    /// Keeps the optimiser state of the parameters `range` only (ZeRO stage 1: the
    /// exchange's owned part); [`Replica::update_params`] is then called there only.
    fn keep_part(&mut self, range: Range<usize>) -> Result<()>;

    /// Ends the step: waits for the device (polling `aborted`, so that an abort releases
    /// the wait) and returns the metrics of its shards and its times.
    fn finish_step(&mut self, aborted: &dyn Fn() -> bool) -> Result<StepOutcome>;

    /// Loss and accuracy in evaluation mode on `rows` of `batch` (one chunk).
    fn evaluate_chunk(&mut self, batch: &Batch, rows: Range<usize>) -> Result<Metrics>;

    /// Class probabilities (rows, K) in evaluation mode on `rows` of `batch` (one chunk).
    fn predict_chunk(&mut self, batch: &Batch, rows: Range<usize>) -> Result<Vec<f32>>;

    /// What `take` asks of its state, on the host: parameters and buffers, optimiser state
    /// (the part it holds, when sharded).
    fn snapshot(&mut self, take: Take) -> Result<Snapshot>;

    /// Bytes of optimiser state it holds (its part, when sharded), nothing copied.
    fn optimizer_bytes(&self) -> usize;

    /// Per-tensor fingerprints for the replica check ([`fingerprints`]).
    fn fingerprints(&mut self) -> Result<Vec<(String, u64)>>;
}

/// The parameters of `model` that weight decay applies to under `on`, by their tensors'
/// dimensions (`optim::DecayOn::decays`).
pub fn decay_mask(model: &Graph, on: DecayOn) -> DecayMask {
    DecayMask::of_tensors(model.param_infos().iter().map(|t| (t.range.clone(), t.shape.dims().len())), on)
}

/// Per-tensor fingerprints of a replica's parameters, buffers and optimiser state (FNV-1a
/// over the bit patterns: equal bits, equal hash), named as the checkpoints name them. A
/// sharded optimiser's state differs from device to device by design: only its step
/// count is compared.
pub fn fingerprints(model: &Graph, store: &ParamStore, optimizer: &Optimizer) -> Vec<(String, u64)> {
    let fnv = |v: &[f32]| v.iter().fold(Fnv1a::new(), |h, x| h.word(x.to_bits() as u64)).finish();
    let mut out = Vec::new();
    for t in model.param_infos() {
        out.push((t.name.clone(), fnv(&store.params[t.range.clone()])));
    }
    for t in model.buffer_infos() {
        out.push((t.name.clone(), fnv(&store.buffers[t.range.clone()])));
    }
    if !optimizer.is_part() {
        for (name, v) in optimizer.state() {
            out.push((format!("optimizer.{name}"), fnv(v)));
        }
    }
    out.push(("optimizer.steps".to_string(), optimizer.steps()));
    out
}

/// Compares every replica's fingerprints with replica 0's; names the first difference.
pub fn check_replicas(step: u64, prints: &[Vec<(String, u64)>]) -> Result<()> {
    let Some(first) = prints.first() else { return Ok(()) };
    for (r, p) in prints.iter().enumerate().skip(1) {
        if let Some(((name, _), _)) = first.iter().zip(p).find(|(a, b)| a.1 != b.1) {
            return Err(Error::ReplicaMismatch { step, replica: r, tensor: name.clone() });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_that_differs_is_named_with_the_first_tensor_that_differs() {
        let a = vec![
            ("dense0.weight".to_string(), 1u64),
            ("dense0.bias".to_string(), 2),
            ("bn0.running_mean".to_string(), 3),
        ];
        let mut b = a.clone();
        b[1].1 = 20;
        b[2].1 = 30;
        assert!(check_replicas(7, &[a.clone(), a.clone(), a.clone()]).is_ok());
        let e = check_replicas(7, &[a.clone(), a.clone(), b]).unwrap_err();
        assert!(matches!(&e, Error::ReplicaMismatch { step: 7, replica: 2, tensor } if tensor == "dense0.bias"), "{e}");
        assert_eq!(
            e.to_string(),
            "replica check failed at step 7: replica 2 differs from replica 0 in tensor 'dense0.bias'"
        );
    }

    #[test]
    fn fingerprints_change_with_any_bit() {
        let model = crate::models::toy_mlp(2, 2).unwrap();
        let mut store = model.init(0);
        let optimizer = Optimizer::new(crate::optim::OptimizerConfig::sgd(0.1), model.params_len());
        let before = fingerprints(&model, &store, &optimizer);
        store.params[5] = f32::from_bits(store.params[5].to_bits() ^ 1); // one ulp
        let after = fingerprints(&model, &store, &optimizer);
        assert_eq!(before.len(), after.len());
        let changed: Vec<&str> =
            before.iter().zip(&after).filter(|(x, y)| x.1 != y.1).map(|(x, _)| x.0.as_str()).collect();
        assert_eq!(changed, vec!["dense0.weight"]);
    }

    #[test]
    fn step_times_come_from_the_marks() {
        let ms = Duration::from_millis;
        let o = StepOutcome::from_marks(Vec::new(), [ms(10), ms(13), ms(20), ms(21)]);
        assert_eq!((o.compute, o.reduce), (ms(4), ms(7)));
    }
}
