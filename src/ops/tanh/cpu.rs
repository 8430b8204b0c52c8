//! Tanh on the CPU: y = tanh(x), and its gradient, dx = dy·(1 − y²). The reference every
//! other backend is checked against (kernels/tanh.cu, bit for bit).
//!
//! Each value is computed in f32 by branch-free code (so the loops vectorise), on z = |x|,
//! the sign put back at the end (so tanh is odd exactly, and −0 stays −0):
//! - below z = 0.625, the odd polynomial of Cephes' tanhf, z + z·z²·P(z²) (no
//!   cancellation near 0, where 1 − 2/(e²ᶻ + 1) would lose the low bits);
//! - from 0.625 on, 1 − 2/(e²ᶻ + 1), e²ᶻ by `backend::simd::exp_f32` (within 2 ulp; +∞
//!   above e⁸⁸, where the result is 1).
//!
//! Both are computed and one is selected. Against the float64 value both are within 3 ulp
//! (`tests` of `super`). At ±∞ and NaN it is PyTorch's: ±1, and a NaN passes through. The
//! slope 1 − y², as PyTorch's backward computes it from the output, is 0 where y rounds to
//! ±1 (|x| above 9); the training forward keeps it, so the backward is one multiplication.
//!
//! Each function runs over the whole tensor in pieces of [`CHUNK`] values, in the pool of
//! the device the calling thread works for (`backend::par`); the values are independent,
//! so the result is the same whatever the thread count.

use rayon::prelude::*;

use crate::backend::par;
use crate::backend::simd::{exp_f32, widest};

/// Values per parallel task: a few ns a value, so 2^15 values amortise handing a task over.
pub const CHUNK: usize = 1 << 15;

/// Where the polynomial gives way to the exponential form.
const SMALL: f32 = 0.625;

/// y = tanh(x), in f32.
#[inline(always)]
pub fn tanh_value(x: f32) -> f32 {
    let z = x.abs();
    let s = z * z;
    let p = (((-5.704_988_7e-3 * s + 2.063_909e-2) * s - 5.373_971_6e-2) * s + 1.333_144_2e-1) * s - 3.333_328e-1;
    let small = p * s * z + z;
    let large = 1.0 - 2.0 / (exp_f32(z + z) + 1.0);
    let t = if z < SMALL { small } else { large };
    t.copysign(x)
}

/// The derivative 1 − tanh(x)², in f32.
#[inline(always)]
pub fn tanh_slope(x: f32) -> f32 {
    let y = tanh_value(x);
    1.0 - y * y
}

/// y = tanh(x) in place over x: (n); with `slope`: (n), each value's derivative, kept for
/// the backward.
pub fn tanh_forward(x: &mut [f32], slope: Option<&mut [f32]>) {
    match slope {
        Some(slope) => {
            assert_eq!(slope.len(), x.len(), "tanh_forward: {} slopes for {} values", slope.len(), x.len());
            par::for_each(x.par_chunks_mut(CHUNK).zip(slope.par_chunks_mut(CHUNK)), |(xs, ss)| forward_kept(xs, ss));
        }
        None => par::for_each(x.par_chunks_mut(CHUNK), forward_values),
    }
}

/// dx = dout·slope in place over dout: (n); slope: (n), the forward's.
pub fn tanh_backward(dout: &mut [f32], slope: &[f32]) {
    assert_eq!(slope.len(), dout.len(), "tanh_backward: {} slopes for {} values", slope.len(), dout.len());
    par::for_each(dout.par_chunks_mut(CHUNK).zip(slope.par_chunks(CHUNK)), |(ds, ss)| backward_values(ds, ss));
}

widest! {
    /// y = tanh(x) of every value, in place.
    fn forward_values(xs: &mut [f32]) {
        for v in xs.iter_mut() {
            *v = tanh_value(*v);
        }
    }
}

widest! {
    /// y = tanh(x) in place, each value's slope kept.
    fn forward_kept(xs: &mut [f32], slopes: &mut [f32]) {
        for (v, s) in xs.iter_mut().zip(slopes) {
            *s = tanh_slope(*v);
            *v = tanh_value(*v);
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
