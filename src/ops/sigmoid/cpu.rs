//! Sigmoid on the CPU: y = σ(x) = 1/(1 + e⁻ˣ), and its gradient, dx = dy·σ(x)·(1 − σ(x)).
//! The reference every other backend is checked against (kernels/sigmoid.cu, bit for bit).
//!
//! Each value is computed in f32 by branch-free code (so the loops vectorise), e⁻ˣ by
//! `backend::simd::exp_f32` (within 2 ulp; 0 below e⁻⁸⁷, +∞ above e⁸⁸): σ is 0 below
//! x = −88 (PyTorch's f32 gives 0 below −88.7 too) and 1 above 17. At ±∞ and NaN it is
//! PyTorch's: σ(+∞) = 1, σ(−∞) = 0, a NaN passes through. The slope is σ·(1 − σ), as
//! PyTorch's backward computes it from the output, so it is 0 where σ rounds to 1 (x
//! above 17), where the exact slope is below e⁻¹⁷; the training forward keeps it, so the
//! backward is one multiplication.
//!
//! Each function runs over the whole tensor in pieces of [`CHUNK`] values, in the pool of
//! the device the calling thread works for (`backend::par`); the values are independent,
//! so the result is the same whatever the thread count.

use rayon::prelude::*;

use crate::backend::par;
use crate::backend::simd::{exp_f32, widest};

/// Values per parallel task: a few ns a value, so 2^15 values amortise handing a task over.
pub const CHUNK: usize = 1 << 15;

/// y = σ(x) = 1/(1 + e⁻ˣ), in f32.
#[inline(always)]
pub fn sigmoid_value(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// The derivative σ(x)·(1 − σ(x)), in f32.
#[inline(always)]
pub fn sigmoid_slope(x: f32) -> f32 {
    let s = sigmoid_value(x);
    s * (1.0 - s)
}

/// y = σ(x) in place over x: (n); with `slope`: (n), each value's derivative, kept for the
/// backward.
pub fn sigmoid_forward(x: &mut [f32], slope: Option<&mut [f32]>) {
    match slope {
        Some(slope) => {
            assert_eq!(slope.len(), x.len(), "sigmoid_forward: {} slopes for {} values", slope.len(), x.len());
            par::for_each(x.par_chunks_mut(CHUNK).zip(slope.par_chunks_mut(CHUNK)), |(xs, ss)| forward_kept(xs, ss));
        }
        None => par::for_each(x.par_chunks_mut(CHUNK), forward_values),
    }
}

/// dx = dout·slope in place over dout: (n); slope: (n), the forward's.
pub fn sigmoid_backward(dout: &mut [f32], slope: &[f32]) {
    assert_eq!(slope.len(), dout.len(), "sigmoid_backward: {} slopes for {} values", slope.len(), dout.len());
    par::for_each(dout.par_chunks_mut(CHUNK).zip(slope.par_chunks(CHUNK)), |(ds, ss)| backward_values(ds, ss));
}

widest! {
    /// y = σ(x) of every value, in place.
    fn forward_values(xs: &mut [f32]) {
        for v in xs.iter_mut() {
            *v = sigmoid_value(*v);
        }
    }
}

widest! {
    /// y = σ(x) in place, each value's slope kept.
    fn forward_kept(xs: &mut [f32], slopes: &mut [f32]) {
        for (v, s) in xs.iter_mut().zip(slopes) {
            *s = sigmoid_slope(*v);
            *v = sigmoid_value(*v);
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
