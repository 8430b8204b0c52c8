//! The training step, written once for every device and every transport; evaluation and
//! prediction likewise.
//!
//! A device runs the shards (logical replicas) `mine` of a step over two traits: its
//! [`Replica`] computes, its [`Exchange`] sums. In order:
//!
//! ```text
//! stage this device's rows
//! for each of its shards s:   slot s = [zeros | the replica's BatchNorm buffers]
//!                             for each of its K micro-batches (K = 1 unless accumulating):
//!                               forward ─▶ loss SUMMED ─▶ backward into slot s (+=)
//!                               (a pass without rows: only its calls to synchronized
//!                               BatchNorm's statistics exchange, with nothing)
//!                             (slot = [gradient of s | BatchNorm buffers updated by s])
//! exchange: every shard's slot summed, each element once, in the transport's fixed order
//! update:   parameters from (gradient sum ÷ the global batch's labels), clipped by the
//!           norm of the whole of it when asked — all of them,
//!           or, with a sharded optimiser, the exchange's owned part, then all-gathered
//!           buffers = (buffer sum ÷ the shards that saw data): the running statistics'
//!           mean over the logical replicas
//! finish:   the device's one wait, the shards' metrics
//! ```
//!
//! Every device makes the same calls on the same sums, so every replica stays bitwise
//! identical. The divisors are computed here, once, for every backend.
//!
//! # Gradient accumulation (`TrainConfig::accumulate` = K, PyTorch's `no_sync`)
//! The global batch of a step is processed as K micro-batches one after another:
//! micro-batch m is the m-th part of every logical shard (each shard's rows cut into K
//! contiguous runs whose sizes differ by at most one, `scatter::even_runs`), each backward
//! adding into its shard's one slot; then ONE exchange and one update. So every forward
//! pass holds about a K-th of a shard's rows (activation memory ÷ K), and no gradient
//! memory is added. The cut is a function of B, R and K alone, so with R fixed, 1, 2 or 4
//! devices still give bitwise-equal weights. Dropout masks are indexed by the row's place
//! in its shard ([`ShardPass::offset`]): the unaccumulated step's masks. BatchNorm normalises
//! each micro-batch with its own statistics and moves the running statistics once per
//! micro-batch, as PyTorch does under `no_sync`.
//!
//! When the weights are bitwise those of the unaccumulated run: exactly when every
//! micro-batch is made of whole logical shards, each shard's gradient then being the same
//! sum in the same order in its own slot, summed by the same canonical tree. A micro-batch
//! of `accumulate` is never that for K > 1 (it cuts every shard), and its shard's
//! gradient is the sum of K partial sums, the same terms associated otherwise: equal to
//! the unaccumulated run within rounding (tests/accumulate.rs states the tolerance).
//! Accumulation over whole logical shards is what logical replicas already are: with
//! `replicas` = N·K on N devices, each device runs its K shards one after another, each
//! its own forward, backward and slot, and the weights are bitwise those of N·K devices
//! (K slots per device instead of one: the bitwise form costs gradient memory).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::flight::{Phase, Ring};
use super::replica::{Fill, Mark, Replica, ShardPass, StepOutcome};
use super::{scatter, Batch, StoppedEvaluation};
use crate::error::Result;
use crate::exchange::Exchange;
use crate::ops::batchnorm::Synchronized;
use crate::ops::cross_entropy::Metrics;
use crate::optim::Sharding;

/// One step's work, shared by every device.
#[derive(Debug)]
pub struct StepWork {
    /// Global step index (0-based).
    pub step: u64,
    /// The rows of the global batch this process holds: all of them, but in a process
    /// of several (MPI), which holds its own shards' rows only.
    pub batch: Arc<Batch>,
    /// The row of the global batch that is `batch`'s row 0.
    pub first_row: usize,
    /// Rows of each logical replica in the global batch (R ranges, from `scatter::even_runs`).
    pub shards: Vec<Range<usize>>,
    /// Learning-rate multiplier of this step (the schedule's value).
    pub lr_scale: f32,
    /// Gradient accumulation K (1: none; see the file's docs).
    pub accumulate: usize,
    /// Whether each device updates every parameter or its owned part.
    pub sharding: Sharding,
    /// Clip the gradient to this global norm (`TrainConfig::clip_grad_norm`).
    pub clip_grad_norm: Option<f32>,
}

/// Trains one step on the logical replicas `mine` of `work`, with this device's
/// `replica` and its side of the `exchange`; the collective calls are recorded in `ring`
/// (the device's ring of the run's flight recorder).
pub fn train<R, X>(
    replica: &mut R,
    exchange: &mut X,
    work: &StepWork,
    mine: Range<usize>,
    ring: &Ring,
) -> Result<StepOutcome>
where
    R: Replica,
    X: Exchange<Mem = R::Mem>,
{
    ring.set_step(work.step);
    replica.mark(Mark::Start)?;
    let shards = &work.shards[mine.clone()];
    let held = |r: &Range<usize>| r.start - work.first_row..r.end - work.first_row;
    let rows = shards.first().map_or(0, |r| r.start)..shards.last().map_or(0, |r| r.end);
    replica.stage(&work.batch, held(&rows))?;
    let micro = work.accumulate.max(1);
    for (local, rows) in shards.iter().map(held).enumerate() {
        exchange.with_slot(local, |mut slot| -> Result<()> {
            // Every slot is written whole, a shard without rows too: it joins the sum.
            replica.start_slot(&mut slot)?;
            for (m, part) in scatter::even_runs(rows.len(), micro).into_iter().enumerate() {
                let shard = ShardPass {
                    index: mine.start + local,
                    rows: rows.start + part.start..rows.start + part.end,
                    offset: part.start,
                    step: work.step,
                    fill: if m == 0 { Fill::Write } else { Fill::Add },
                };
                if shard.rows.is_empty() {
                    replica.skip_shard(&shard);
                    join_without_data(replica, &shard)?;
                } else {
                    replica.train_shard(&work.batch, &shard, &mut slot)?;
                }
            }
            Ok(())
        })?;
    }
    replica.mark(Mark::Computed)?;
    // What this device puts in: its shards' slots.
    ring.record(Phase::Sum, mine.len() * exchange.width() * 4, || exchange.sum())?;
    replica.mark(Mark::Summed)?;

    // The gradient part of the sum is over the whole global batch, every label of it (a
    // sequence's every position: the global token count); the buffer part over the
    // shards that saw data (an empty shard's slot holds zeros).
    let grad_divisor = (work.shards.last().map_or(0, |r| r.end) * work.batch.targets) as f32;
    let with_data = work.shards.iter().filter(|r| !r.is_empty()).count();
    let buffer_scale = 1.0 / with_data as f32;
    let params = replica.params_len();
    let updated = match work.sharding {
        Sharding::Replicated => 0..params,
        Sharding::Sharded => clip(exchange.owned(), params),
    };
    replica.begin_update(work.lr_scale, grad_divisor);
    if let Some(max_norm) = work.clip_grad_norm {
        // The whole gradient's norm, a sharded optimiser's too: every device reads every
        // piece of the same sum in the same association (`optim::GradNorm`), so every
        // replica scales by the same factor on any device count.
        exchange.for_each_sum_in(0..params, |offset, piece| replica.add_grad_norm(offset, piece))?;
        replica.clip_grad_norm(max_norm)?;
    }
    exchange.for_each_sum_in(updated, |offset, piece| replica.update_params(offset, piece))?;
    exchange.for_each_sum_in(params..exchange.width(), |offset, piece| {
        replica.set_buffers(offset - params, piece, buffer_scale)
    })?;
    if work.sharding == Sharding::Sharded {
        let bytes = replica.params_len() * 4;
        let params = replica.params_mut();
        ring.record(Phase::Gather, bytes, || exchange.all_gather(params))?;
    }
    replica.mark(Mark::Updated)?;
    replica.finish_step(&|| exchange.is_aborted())
}

/// A pass without rows still makes its calls to synchronized BatchNorm's statistics
/// exchange, with nothing in them, so that the other logical replicas' calls meet theirs
/// (`model::sync_batchnorm::join_without_rows`); without that exchange, nothing.
fn join_without_data<R: Replica>(replica: &R, shard: &ShardPass) -> Result<()> {
    match replica.synchronized() {
        (model, Some(stats)) => {
            crate::model::sync_batchnorm::join_without_rows(&Synchronized { stats, shard: shard.index }, model)
        }
        (_, None) => Ok(()),
    }
}

/// `range` cut to the first `params` values (the parameters' part of a slot).
fn clip(range: Range<usize>, params: usize) -> Range<usize> {
    range.start.min(params)..range.end.min(params)
}

/// How a device's part of an evaluation ended.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Evaluated {
    /// Every chunk evaluated: the part's summed metrics.
    Whole(Metrics),
    /// Given up between chunks once the stop flag was raised.
    Stopped(StoppedEvaluation),
}

/// Loss and accuracy of `rows` of `batch` in evaluation mode, in chunks of at most
/// `chunk` samples (so the activations of a chunk, not of the whole set, are held).
/// Given up when `stop` is raised before the last chunk: a long evaluation (thousands of
/// a GPT's windows) gives way to a signal within one chunk, not at its end.
pub(crate) fn evaluate<R: Replica>(
    replica: &mut R,
    batch: &Batch,
    rows: Range<usize>,
    chunk: usize,
    stop: Option<&AtomicBool>,
) -> Result<Evaluated> {
    evaluate_chunks(rows, chunk, stop, |c| replica.evaluate_chunk(batch, c))
}

/// [`evaluate`]'s loop, over any chunk's evaluation: the flag is read before each chunk,
/// so once it is raised at most the chunk in progress is finished.
fn evaluate_chunks(
    rows: Range<usize>,
    chunk: usize,
    stop: Option<&AtomicBool>,
    mut evaluate_chunk: impl FnMut(Range<usize>) -> Result<Metrics>,
) -> Result<Evaluated> {
    let of = rows.len() as u64;
    let (mut total, mut evaluated) = (Metrics::default(), 0);
    for c in chunks(rows, chunk) {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return Ok(Evaluated::Stopped(StoppedEvaluation { evaluated, of }));
        }
        evaluated += c.len() as u64;
        total.add(&evaluate_chunk(c)?);
    }
    Ok(Evaluated::Whole(total))
}

/// Class probabilities (rows, K) of `rows` of `batch`, in chunks of at most `chunk`.
pub fn predict<R: Replica>(replica: &mut R, batch: &Batch, rows: Range<usize>, chunk: usize) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for c in chunks(rows, chunk) {
        out.extend(replica.predict_chunk(batch, c)?);
    }
    Ok(out)
}

/// `rows` cut into consecutive ranges of at most `chunk` (at least 1).
fn chunks(rows: Range<usize>, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    let chunk = chunk.max(1);
    rows.clone().step_by(chunk).map(move |s| s..(s + chunk).min(rows.end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owned_part_is_cut_to_the_parameters() {
        // A slot of 10 parameters then 4 buffers, owned in chunks as a reduce-scatter cuts it.
        assert_eq!(clip(0..8, 10), 0..8);
        assert_eq!(clip(8..14, 10), 8..10);
        assert_eq!(clip(10..14, 10), 10..10);
        assert_eq!(clip(12..14, 10), 10..10);
    }

    #[test]
    fn chunks_cover_the_rows_in_order() {
        let c: Vec<_> = chunks(3..11, 3).collect();
        assert_eq!(c, vec![3..6, 6..9, 9..11]);
        assert_eq!(chunks(4..4, 3).count(), 0);
        assert_eq!(chunks(0..2, 0).collect::<Vec<_>>(), vec![0..1, 1..2]);
    }

    /// The evaluation of rows 0..100 in chunks of 10, the stop flag raised while chunk
    /// `raise_in` (0-based) is being evaluated, as a signal's handler raises it at some
    /// point of a chunk: what was evaluated, and the chunks asked for.
    fn stopped_in_chunk(raise_in: usize) -> (Evaluated, Vec<Range<usize>>) {
        let stop = AtomicBool::new(false);
        let mut asked = Vec::new();
        let evaluated = evaluate_chunks(0..100, 10, Some(&stop), |c| {
            if asked.len() == raise_in {
                stop.store(true, Ordering::Relaxed);
            }
            asked.push(c.clone());
            // One label a row, right when its row is even: the sums say which rows came.
            let correct = c.clone().filter(|r| r % 2 == 0).count() as u64;
            Ok(Metrics { loss_sum: c.len() as f64, correct, count: c.len() as u64 })
        })
        .unwrap();
        (evaluated, asked)
    }

    #[test]
    fn a_stop_raised_during_a_chunk_gives_the_evaluation_up_after_that_chunk() {
        // Raised in the 3rd chunk of 10: 30 rows evaluated, the other 7 chunks never asked.
        let (evaluated, asked) = stopped_in_chunk(2);
        assert_eq!(evaluated, Evaluated::Stopped(StoppedEvaluation { evaluated: 30, of: 100 }));
        assert_eq!(asked, vec![0..10, 10..20, 20..30]);
        // Raised in the first: one chunk.
        let (evaluated, asked) = stopped_in_chunk(0);
        assert_eq!(evaluated, Evaluated::Stopped(StoppedEvaluation { evaluated: 10, of: 100 }));
        assert_eq!(asked.len(), 1);
        // Raised in the last: nothing is left to give up, the evaluation is whole.
        let (evaluated, asked) = stopped_in_chunk(9);
        assert_eq!(evaluated, Evaluated::Whole(Metrics { loss_sum: 100.0, correct: 50, count: 100 }));
        assert_eq!(asked.len(), 10);
    }

    #[test]
    fn a_stop_raised_before_the_evaluation_evaluates_nothing_and_none_evaluates_all() {
        let raised = AtomicBool::new(true);
        let never = |_: Range<usize>| -> Result<Metrics> { panic!("no chunk is evaluated once the flag is up") };
        let stopped = evaluate_chunks(0..100, 10, Some(&raised), never).unwrap();
        assert_eq!(stopped, Evaluated::Stopped(StoppedEvaluation { evaluated: 0, of: 100 }));
        let one = |c: Range<usize>| Ok(Metrics { loss_sum: 1.0, correct: 1, count: c.len() as u64 });
        let whole = evaluate_chunks(0..95, 10, None, one).unwrap();
        assert_eq!(whole, Evaluated::Whole(Metrics { loss_sum: 10.0, correct: 10, count: 95 }));
    }
}
