//! ReLU on the CPU: y = max(x, 0), and its gradient, dx = dy where x > 0, else 0 (the
//! subgradient at 0 is 0, as in PyTorch). The reference every other backend is checked
//! against (kernels/relu.cu, bit for bit).
//!
//! `x < 0` is false for NaN, so a NaN passes through, as in PyTorch: a diverging run shows
//! a NaN loss instead of silently training on zeros; −0 passes through too. The mask the
//! backward reads is 1 where the input was positive (so 0 at ±0 and at NaN).
//!
//! Each function runs over the whole tensor in pieces of [`CHUNK`] values, in the pool of
//! the device the calling thread works for (`backend::par`); the values are independent,
//! so the result is the same whatever the thread count.

use rayon::prelude::*;

use crate::backend::par;
use crate::backend::simd::widest;

/// Values per parallel task: large enough that a task costs more than handing it over.
pub const CHUNK: usize = 1 << 16;

/// y = max(x, 0) in place over x: (n); with `mask`: (n), 1 where x > 0, for the backward.
pub fn relu_forward(x: &mut [f32], mask: Option<&mut [u8]>) {
    match mask {
        Some(mask) => {
            assert_eq!(mask.len(), x.len(), "relu_forward: a mask of {} for {} values", mask.len(), x.len());
            par::for_each(x.par_chunks_mut(CHUNK).zip(mask.par_chunks_mut(CHUNK)), |(xs, ms)| relu_keep(xs, ms));
        }
        None => par::for_each(x.par_chunks_mut(CHUNK), relu),
    }
}

/// dx = dout where the forward's input was positive, else 0, in place over dout: (n);
/// mask: (n), the forward's.
pub fn relu_backward(dout: &mut [f32], mask: &[u8]) {
    assert_eq!(mask.len(), dout.len(), "relu_backward: a mask of {} for {} values", mask.len(), dout.len());
    par::for_each(dout.par_chunks_mut(CHUNK).zip(mask.par_chunks(CHUNK)), |(ds, ms)| relu_backward_chunk(ds, ms));
}

/// y = max(a + b, 0) into a: (n), b: (n): a residual block's add and the ReLU after it in
/// one pass over the values, the same two roundings as one after the other; with `mask`:
/// (n), 1 where the sum is positive.
pub fn add_relu_forward(a: &mut [f32], b: &[f32], mask: Option<&mut [u8]>) {
    assert_eq!(a.len(), b.len(), "add_relu_forward: {} + {} values", a.len(), b.len());
    match mask {
        Some(mask) => {
            assert_eq!(mask.len(), a.len(), "add_relu_forward: a mask of {} for {} values", mask.len(), a.len());
            let parts = a.par_chunks_mut(CHUNK).zip(b.par_chunks(CHUNK)).zip(mask.par_chunks_mut(CHUNK));
            par::for_each(parts, |((a, b), ms)| add_relu_keep(a, b, ms));
        }
        None => par::for_each(a.par_chunks_mut(CHUNK).zip(b.par_chunks(CHUNK)), |(a, b)| add_relu(a, b)),
    }
}

widest! {
    /// max(x, 0) in place.
    fn relu(xs: &mut [f32]) {
        for v in xs.iter_mut() {
            *v = if *v < 0.0 { 0.0 } else { *v };
        }
    }
}

widest! {
    /// max(x, 0) in place, and the mask of positive inputs.
    fn relu_keep(xs: &mut [f32], ms: &mut [u8]) {
        for (v, m) in xs.iter_mut().zip(ms.iter_mut()) {
            *m = u8::from(*v > 0.0);
            *v = if *v < 0.0 { 0.0 } else { *v };
        }
    }
}

widest! {
    /// max(a + b, 0) into a.
    fn add_relu(a: &mut [f32], b: &[f32]) {
        for (x, &y) in a.iter_mut().zip(b) {
            let v = *x + y;
            *x = if v < 0.0 { 0.0 } else { v };
        }
    }
}

widest! {
    /// [`add_relu`], and the mask of positive sums.
    fn add_relu_keep(a: &mut [f32], b: &[f32], ms: &mut [u8]) {
        for ((x, &y), m) in a.iter_mut().zip(b).zip(ms.iter_mut()) {
            let v = *x + y;
            *m = u8::from(v > 0.0);
            *x = if v < 0.0 { 0.0 } else { v };
        }
    }
}

widest! {
    /// dout where the mask is set, 0 elsewhere, in place.
    fn relu_backward_chunk(ds: &mut [f32], ms: &[u8]) {
        for (d, &p) in ds.iter_mut().zip(ms) {
            *d = if p != 0 { *d } else { 0.0 };
        }
    }
}
