//! SiLU on the CPU: y = x·σ(x), σ(x) = 1/(1 + e⁻ˣ), and its gradient, dx = dy·σ(x)·(1 +
//! x·(1 − σ(x))). The reference every other backend is checked against (kernels/silu.cu,
//! bit for bit).
//!
//! Each value is computed in f32 by branch-free code (so the loops vectorise), e⁻ˣ by
//! `backend::simd::exp_f32` (within 2 ulp; 0 below e⁻⁸⁷, +∞ above e⁸⁸): σ is 0 for x below
//! −88 (so y is −0, as PyTorch's f32 SiLU gives there) and 1 above 87. At ±∞ and NaN it is
//! PyTorch's: y(+∞) = +∞, y(−∞) = −∞·0 = NaN, a NaN passes through. The training forward
//! keeps the slope σ·(1 + x·(1 − σ)) of each value, so the backward is one multiplication.
//!
//! Each function runs over the whole tensor in pieces of [`CHUNK`] values, in the pool of
//! the device the calling thread works for (`backend::par`); the values are independent,
//! so the result is the same whatever the thread count.

use rayon::prelude::*;

use crate::backend::par;
use crate::backend::simd::{exp_f32, widest};

/// Values per parallel task: a few ns a value, so 2^15 values amortise handing a task over.
pub const CHUNK: usize = 1 << 15;

/// σ(x) = 1/(1 + e⁻ˣ), in f32.
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// y = x·σ(x), in f32.
#[inline(always)]
pub fn silu_value(x: f32) -> f32 {
    x * sigmoid(x)
}

/// The derivative σ(x)·(1 + x·(1 − σ(x))), in f32.
#[inline(always)]
pub fn silu_slope(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// y = x·σ(x) in place over x: (n); with `slope`: (n), each value's derivative, kept for
/// the backward.
pub fn silu_forward(x: &mut [f32], slope: Option<&mut [f32]>) {
    match slope {
        Some(slope) => {
            assert_eq!(slope.len(), x.len(), "silu_forward: {} slopes for {} values", slope.len(), x.len());
            par::for_each(x.par_chunks_mut(CHUNK).zip(slope.par_chunks_mut(CHUNK)), |(xs, ss)| forward_kept(xs, ss));
        }
        None => par::for_each(x.par_chunks_mut(CHUNK), forward_values),
    }
}

/// dx = dout·slope in place over dout: (n); slope: (n), the forward's.
pub fn silu_backward(dout: &mut [f32], slope: &[f32]) {
    assert_eq!(slope.len(), dout.len(), "silu_backward: {} slopes for {} values", slope.len(), dout.len());
    par::for_each(dout.par_chunks_mut(CHUNK).zip(slope.par_chunks(CHUNK)), |(ds, ss)| backward_values(ds, ss));
}

widest! {
    /// y = x·σ(x) of every value, in place.
    fn forward_values(xs: &mut [f32]) {
        for v in xs.iter_mut() {
            *v = silu_value(*v);
        }
    }
}

widest! {
    /// y = x·σ(x) in place, each value's slope kept.
    fn forward_kept(xs: &mut [f32], slopes: &mut [f32]) {
        for (v, s) in xs.iter_mut().zip(slopes) {
            *s = silu_slope(*v);
            *v = silu_value(*v);
        }
    }
}

widest! {
    /// dx = dy·slope, `ds` holding dy and receiving dx.
    fn backward_values(ds: &mut [f32], slopes: &[f32]) {
        for (d, &s) in ds.iter_mut().zip(slopes) {
            *d *= s;
        }
    }
}
