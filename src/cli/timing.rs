//! What the benches report of their samples: the median.
//!
//! Owns the one summary every `lockstep bench` table prints (`bench.rs` for shared
//! memory, GPUs and steps; `bench_mpi.rs` between processes). A leaf, so that the two
//! benches share it without importing each other.

use std::time::Duration;

/// The median of `samples` (the upper one of an even count); at least one sample.
pub(crate) fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_the_middle_sample_or_the_upper_of_two() {
        let ms = |v: &[u64]| v.iter().map(|&m| Duration::from_millis(m)).collect::<Vec<_>>();
        assert_eq!(median(ms(&[5, 1, 3])), Duration::from_millis(3));
        assert_eq!(median(ms(&[4, 1, 3, 2])), Duration::from_millis(3));
        assert_eq!(median(ms(&[7])), Duration::from_millis(7));
    }
}
