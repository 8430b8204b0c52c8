//! The sampler and the scatter stage.
//!
//! The sampler orders an epoch's samples: a permutation seeded by (seed, epoch), so
//! there is no `set_epoch` to forget and a resumed run sees the same order. The scatter
//! cuts each global batch into R logical shards of contiguous rows whose sizes differ
//! by at most one (the first B mod R shards get the extra row); device d runs shards
//! d·R/N .. (d+1)·R/N. Nothing is padded, duplicated or dropped.
//!
//! Gradient accumulation (`TrainConfig::accumulate` = K) cuts each logical shard further
//! into K micro-batches by the same rule ([`even_runs`] of the shard's rows): micro-batch m of
//! the global batch is the m-th part of every shard, a function of B, R and K alone.

use std::ops::Range;

use crate::rng::{derive_key, purpose, SplitMix64};

/// Whether each epoch visits the samples in a fresh seeded order.
#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Shuffle {
    /// A permutation seeded by (seed, epoch).
    Seeded,
    /// File order, every epoch.
    None,
}

/// Whether a short last batch of an epoch is trained on or dropped.
#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LastBatch {
    Keep,
    Drop,
}

/// The sample indices of one epoch, in visiting order.
pub fn epoch_order(len: usize, seed: u64, epoch: usize, shuffle: Shuffle) -> Vec<usize> {
    match shuffle {
        Shuffle::None => (0..len).collect(),
        Shuffle::Seeded => SplitMix64::new(derive_key(seed, &[purpose::SHUFFLE, epoch as u64])).permutation(len),
    }
}

/// The windows of step `step` of a token stream of `len` windows (`Dataset::windows`):
/// row r's is drawn from (seed, step, r) alone, uniformly with replacement (nanoGPT's
/// `torch.randint`), so whoever trains the row, and whether the run resumed, it is the
/// same window. Without shuffling, the stream is read in order: row r of step s starts
/// `(s·batch + r)·context` tokens in, wrapping round.
pub fn window_draws(len: usize, context: usize, seed: u64, step: u64, batch: usize, shuffle: Shuffle) -> Vec<usize> {
    (0..batch)
        .map(|r| match shuffle {
            Shuffle::Seeded => {
                let key = derive_key(seed, &[purpose::WINDOWS, step, r as u64]);
                (SplitMix64::new(key).next_u64() % len as u64) as usize
            }
            Shuffle::None => ((step as u128 * batch as u128 + r as u128) * context as u128 % len as u128) as usize,
        })
        .collect()
}

/// `count` windows of a held-out token stream of `len` windows, drawn once from `seed`
/// (the same every evaluation of the run, so the evaluations compare).
pub fn eval_windows(len: usize, seed: u64, count: usize) -> Vec<usize> {
    let mut g = SplitMix64::new(derive_key(seed, &[purpose::EVAL_WINDOWS]));
    (0..count).map(|_| (g.next_u64() % len as u64) as usize).collect()
}

/// Number of steps in an epoch of `len` samples.
pub fn steps_per_epoch(len: usize, batch: usize, last: LastBatch) -> usize {
    match last {
        LastBatch::Keep => len.div_ceil(batch),
        LastBatch::Drop => len / batch,
    }
}

/// `b` rows cut into `r` contiguous runs whose sizes differ by at most one, in order: a
/// global batch's R shards, a shard's K micro-batches, a process's share of the devices.
pub fn even_runs(b: usize, r: usize) -> Vec<Range<usize>> {
    let (base, extra) = (b / r, b % r);
    let mut start = 0;
    (0..r)
        .map(|j| {
            let len = base + usize::from(j < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_differ_by_at_most_one_and_cover_the_batch() {
        assert_eq!(even_runs(7, 3), vec![0..3, 3..5, 5..7]);
        assert_eq!(even_runs(3, 3), vec![0..1, 1..2, 2..3]);
        assert_eq!(even_runs(1, 3), vec![0..1, 1..1, 1..1]);
        for b in 0..40 {
            for r in 1..9 {
                let s = even_runs(b, r);
                assert_eq!(s.len(), r);
                assert_eq!(s.iter().map(|x| x.len()).sum::<usize>(), b);
                let (mn, mx) = (s.iter().map(|x| x.len()).min().unwrap(), s.iter().map(|x| x.len()).max().unwrap());
                assert!(mx - mn <= 1);
                assert!(s.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }

    #[test]
    fn epochs_are_seeded_by_seed_and_epoch() {
        assert_eq!(epoch_order(50, 3, 1, Shuffle::Seeded), epoch_order(50, 3, 1, Shuffle::Seeded));
        assert_ne!(epoch_order(50, 3, 1, Shuffle::Seeded), epoch_order(50, 3, 2, Shuffle::Seeded));
        assert_ne!(epoch_order(50, 3, 1, Shuffle::Seeded), epoch_order(50, 4, 1, Shuffle::Seeded));
        assert_eq!(epoch_order(5, 3, 1, Shuffle::None), vec![0, 1, 2, 3, 4]);
        assert_eq!(steps_per_epoch(7, 4, LastBatch::Keep), 2);
        assert_eq!(steps_per_epoch(7, 4, LastBatch::Drop), 1);
    }
}
