//! Deterministic randomness.
//!
//! Every random number in lockstep is a pure function of a key built from
//! (seed, purpose, epoch or step, logical replica, layer, element): shuffles, initial
//! weights and dropout masks come out the same whatever the number of devices or
//! threads, and a resumed run continues exactly as the uninterrupted one. Two tools:
//! [`SplitMix64`], a sequential generator for things made once on one thread (initial
//! weights, a permutation), and [`hash64`], a counter-based hash for things made in
//! parallel (dropout masks), where element `i` must not depend on who computed it.

/// The SplitMix64 finaliser: a bijective mix of 64 bits (Steele, Lea, Flood 2014).
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Counter-based hash: the `idx`-th value of the stream named by `key`.
/// The CUDA dropout kernel computes the same function.
#[inline]
pub fn hash64(key: u64, idx: u64) -> u64 {
    mix64(key.wrapping_add(idx.wrapping_mul(GOLDEN)))
}

/// Key of the dropout stream of one layer of one logical replica (its `shard`) at one step. The CUDA
/// kernel (`kernels/dropout.cu`) computes the same function, so masks agree bit for bit:
/// key = mix64(mix64(mix64(seed + step·G) + shard·G) + layer·G), G the golden ratio.
pub fn dropout_key(seed: u64, step: u64, shard: u64, layer: u64) -> u64 {
    let k = mix64(seed.wrapping_add(step.wrapping_mul(GOLDEN)));
    let k = mix64(k.wrapping_add(shard.wrapping_mul(GOLDEN)));
    mix64(k.wrapping_add(layer.wrapping_mul(GOLDEN)))
}

/// Derives a stream key from a seed and a path of integers (purpose, step, replica, ...).
pub fn derive_key(seed: u64, path: &[u64]) -> u64 {
    path.iter().fold(mix64(seed ^ 0x6C6F_636B_7374_6570), |k, &p| mix64(k ^ mix64(p.wrapping_add(GOLDEN))))
}

/// Uniform f32 in [0, 1) from 64 random bits (24 significant bits, exactly representable).
#[inline]
pub fn unit_f32(bits: u64) -> f32 {
    (bits >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// Purposes, so that streams for different uses never coincide.
pub mod purpose {
    /// The index of a residual block's node (`model::functional::branch_index`).
    pub const LAYER: u64 = 64;
    pub const INIT: u64 = 1;
    pub const SHUFFLE: u64 = 2;
    pub const SPLIT: u64 = 4;
    /// Training images' random crops and flips (`data::augment`), keyed by (epoch,
    /// sample index).
    pub const AUGMENT: u64 = 5;
    /// A token stream's training windows, keyed by (step, row) (`train::scatter`).
    pub const WINDOWS: u64 = 6;
    /// The held-out windows of a token stream, drawn once per run.
    pub const EVAL_WINDOWS: u64 = 7;
    /// The tokens `generate` draws, keyed by their index.
    #[cfg(feature = "cli")]
    pub const GENERATE: u64 = 8;
}

/// A small sequential generator (SplitMix64).
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose stream is fixed by `key`.
    pub fn new(key: u64) -> Self {
        SplitMix64 { state: key }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix64(self.state)
    }

    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        unit_f32(self.next_u64())
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal, by Box–Muller from two uniforms (the cosine branch only, so each
    /// value costs two draws and depends on nothing before them but the stream).
    pub fn next_normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]: ln is finite
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Uniform integer in `0..n` (Lemire's multiply-shift; the bias is below 2^-32 for
    /// the sizes used here, and the result is deterministic, which is what matters).
    pub fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }

    /// Fisher–Yates shuffle, last position first.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = if items.len() <= u32::MAX as usize {
                self.below(i + 1)
            } else {
                (self.next_u64() % (i as u64 + 1)) as usize
            };
            items.swap(i, j);
        }
    }

    /// A uniformly shuffled `0..n`.
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        self.shuffle(&mut p);
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_reference_values() {
        // Reference: the SplitMix64 paper's generator seeded with 0; first outputs as
        // printed by the C reference implementation (Vigna, splitmix64.c).
        let mut g = SplitMix64::new(0);
        assert_eq!(g.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(g.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        // Seed 1234567, also from this Python transcription of splitmix64.c:
        //   s = (s + 0x9E3779B97F4A7C15) % 2**64; z = s
        //   z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        //   z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64; out = z ^ (z >> 31)
        let mut g = SplitMix64::new(1234567);
        assert_eq!(
            [g.next_u64(), g.next_u64(), g.next_u64()],
            [6457827717110365317, 3203168211198807973, 9817491932198370423]
        );
    }

    #[test]
    fn permutation_is_a_permutation_and_reproducible() {
        let a = SplitMix64::new(7).permutation(1000);
        let b = SplitMix64::new(7).permutation(1000);
        assert_eq!(a, b);
        let mut s = a.clone();
        s.sort_unstable();
        assert_eq!(s, (0..1000).collect::<Vec<_>>());
        assert_ne!(a, SplitMix64::new(8).permutation(1000));
    }

    #[test]
    fn unit_f32_stays_below_one() {
        assert_eq!(unit_f32(u64::MAX), 16_777_215.0 / 16_777_216.0);
        assert_eq!(unit_f32(0), 0.0);
    }
}
