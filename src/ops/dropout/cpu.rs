//! Inverted dropout on the CPU: the mask, a factor per element (1/(1 − rate) where kept,
//! 0 where dropped), and its application to the forward's values and to the backward's
//! gradient. The reference kernels/dropout.cu is held to, bit for bit: the same integer
//! hash decides each element, and each value is one f32 multiply by its factor.
//!
//! Element i of a buffer is element `first + i` of its logical replica's shard; its fate
//! is `unit_f32(hash64(key, first + i)) >= rate`, `key` the layer's stream
//! (`rng::dropout_key` of the seed, the step, the logical replica and the layer's index),
//! so the mask depends on none of the device count, the thread count or the order of the
//! visit. A dropped value is x·0, not a literal 0: −0 for a negative x and NaN for a NaN,
//! so a non-finite value is not hidden on one backend and seen on the other.

use crate::rng::{hash64, unit_f32};

/// The factors of a buffer whose first element is element `first` of its logical
/// replica's shard, written into mask: (n): 1/(1 − rate) (in f32) where kept, 0 where
/// dropped; `key` is the layer's stream (`rng::dropout_key`).
pub fn dropout_mask(mask: &mut [f32], rate: f32, key: u64, first: u64) {
    let keep = 1.0 / (1.0 - rate);
    for (m, i) in mask.iter_mut().zip(first..) {
        *m = if unit_f32(hash64(key, i)) >= rate { keep } else { 0.0 };
    }
}

/// y = x·mask in place over x: (n); mask: (n), [`dropout_mask`]'s.
pub fn dropout_forward(x: &mut [f32], mask: &[f32]) {
    assert_eq!(x.len(), mask.len(), "dropout_forward: a mask of {} for {} values", mask.len(), x.len());
    for (v, s) in x.iter_mut().zip(mask) {
        *v *= s;
    }
}

/// dx = dout·mask in place over dout: (n); mask: (n), the forward's.
pub fn dropout_backward(dout: &mut [f32], mask: &[f32]) {
    assert_eq!(dout.len(), mask.len(), "dropout_backward: a mask of {} for {} values", mask.len(), dout.len());
    for (d, s) in dout.iter_mut().zip(mask) {
        *d *= s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{dropout_key, mix64};

    /// The hash is SplitMix64's finaliser: mix64(0x9E3779B97F4A7C15) = 0xE220A8397B1DCDAF is
    /// the first output of SplitMix64 seeded with 0 (Vigna's reference splitmix64.c). Rate 0
    /// keeps everything, unscaled; rate 1 (which the layer refuses, the GPU's launch does
    /// not) drops everything, although 1/(1 − rate) is infinite.
    #[test]
    fn the_mask_hashes_by_splitmix64_and_rates_0_and_1_keep_and_drop_all() {
        assert_eq!(mix64(0x9E37_79B9_7F4A_7C15), 0xE220_A839_7B1D_CDAF);
        let key = dropout_key(0, 0, 0, 0);
        let mut mask = vec![f32::NAN; 1000];
        dropout_mask(&mut mask, 0.0, key, 0);
        assert!(mask.iter().all(|&m| m == 1.0), "rate 0");
        dropout_mask(&mut mask, 1.0, key, 0);
        assert!(mask.iter().all(|&m| m == 0.0), "rate 1");
    }
}
