//! The training step, written once for every device and every transport; evaluation and
//! prediction likewise.
//!
//! A device runs the shards (logical replicas) `mine` of a step over two traits: its
//! [`Replica`] computes, its [`Exchange`] sums. In order:
//!
//! ```text
//! stage this device's rows
//! for each of its shards s:   forward ─▶ loss SUMMED over s ─▶ backward into slot s
//!                             (slot = [gradient of s | BatchNorm buffers updated by s])
//! exchange: every shard's slot summed, each element once, in the transport's fixed order
//! update:   parameters from (gradient sum ÷ the global batch's real size)
//!           buffers = (buffer sum ÷ the shards that saw data): the running statistics'
//!           mean over the logical replicas
//! finish:   the device's one wait, the shards' metrics
//! ```
//!
//! Every device makes the same calls on the same sums, so every replica stays bitwise
//! identical. The divisors are computed here, once, for every backend.

use std::ops::Range;
use std::sync::Arc;

use super::replica::{Mark, Replica, Shard, StepOutcome};
use super::Batch;
use crate::error::Result;
use crate::exchange::{Exchange, Memory};
use crate::nn::loss::Metrics;

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
    /// Rows of each logical replica in the global batch (R ranges, from `scatter::shards`).
    pub shards: Vec<Range<usize>>,
    /// Learning-rate multiplier of this step (the schedule's value).
    pub lr_scale: f32,
}

/// Trains one step on the logical replicas `mine` of `work`, with this device's
/// `replica` and its side of the `exchange`.
pub fn train<R, X>(replica: &mut R, exchange: &mut X, work: &StepWork, mine: Range<usize>) -> Result<StepOutcome>
where
    R: Replica,
    X: Exchange<Mem = R::Mem>,
{
    replica.mark(Mark::Start)?;
    let shards = &work.shards[mine.clone()];
    let held = |r: &Range<usize>| r.start - work.first_row..r.end - work.first_row;
    let rows = shards.first().map_or(0, |r| r.start)..shards.last().map_or(0, |r| r.end);
    replica.stage(&work.batch, held(&rows))?;
    for (local, rows) in shards.iter().enumerate() {
        let shard = Shard { replica: mine.start + local, rows: held(rows), step: work.step };
        exchange.with_slot(local, |slot| replica.train_shard(&work.batch, &shard, slot))?;
    }
    replica.mark(Mark::Computed)?;
    exchange.sum()?;
    replica.mark(Mark::Summed)?;

    // The gradient part of the sum is over the whole global batch; the buffer part over
    // the shards that saw data (an empty shard's slot holds zeros).
    let grad_divisor = work.shards.last().map_or(0, |r| r.end) as f32;
    let with_data = work.shards.iter().filter(|r| !r.is_empty()).count();
    let buffer_scale = 1.0 / with_data as f32;
    let params = replica.params_len();
    replica.begin_update(work.lr_scale, grad_divisor);
    exchange.for_each_sum(|offset, piece| {
        let (p, b) = split(offset, <X::Mem as Memory>::len(&piece), params);
        if !p.is_empty() {
            replica.update_params(offset, <X::Mem as Memory>::slice(&piece, p))?;
        }
        if !b.is_empty() {
            let at = offset + b.start - params;
            replica.set_buffers(at, <X::Mem as Memory>::slice(&piece, b), buffer_scale)?;
        }
        Ok(())
    })?;
    replica.mark(Mark::Updated)?;
    replica.finish_step(&|| exchange.is_aborted())
}

/// The parts of a piece `offset..offset + len` of a slot that hold parameters' and
/// buffers' values, as ranges within the piece, for a slot of `params` parameters first.
fn split(offset: usize, len: usize, params: usize) -> (Range<usize>, Range<usize>) {
    let cut = params.saturating_sub(offset).min(len);
    (0..cut, cut..len)
}

/// Loss and accuracy of `rows` of `batch` in evaluation mode, in chunks of at most
/// `chunk` samples (so the activations of a chunk, not of the whole set, are held).
pub fn evaluate<R: Replica>(replica: &mut R, batch: &Batch, rows: Range<usize>, chunk: usize) -> Result<Metrics> {
    let mut total = Metrics::default();
    for c in chunks(rows, chunk) {
        total.add(&replica.evaluate_chunk(batch, c)?);
    }
    Ok(total)
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
    fn a_piece_splits_at_the_end_of_the_parameters() {
        // A slot of 10 parameters then 4 buffers, cut into pieces as a reduce-scatter does.
        assert_eq!(split(0, 14, 10), (0..10, 10..14));
        assert_eq!(split(0, 8, 10), (0..8, 8..8));
        assert_eq!(split(8, 6, 10), (0..2, 2..6));
        assert_eq!(split(10, 4, 10), (0..0, 0..4));
        assert_eq!(split(12, 2, 10), (0..0, 0..2));
        assert_eq!(split(0, 5, 0), (0..0, 0..5));
    }

    #[test]
    fn chunks_cover_the_rows_in_order() {
        let c: Vec<_> = chunks(3..11, 3).collect();
        assert_eq!(c, vec![3..6, 6..9, 9..11]);
        assert_eq!(chunks(4..4, 3).count(), 0);
        assert_eq!(chunks(0..2, 0).collect::<Vec<_>>(), vec![0..1, 1..2]);
    }
}
