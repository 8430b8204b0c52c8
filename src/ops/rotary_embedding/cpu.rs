//! Rotary position embeddings on the CPU: the table of cosines and sines ([`rope_table`],
//! the one both backends read: the GPU form uploads it), the rotation of each pair
//! ([`rope_forward`]) and its inverse, the backward ([`rope_backward`]). The reference
//! kernels/rotary_embedding.cu is held to, bit for bit.
//!
//! Shapes: N batch, T positions, H heads, D the head width (even), D/2 pairs a head;
//! x, y: (N, T, H, D); cos, sin: (T, D/2).
//!
//! # The table
//! As PyTorch computes Llama's in float32: inv_i = 1 / base^(2i/D), the exponent 2i/D one
//! f32 division, the power rounded once to f32 (computed in f64: within half an ulp, where
//! PyTorch's vectorised `pow` is within one); the angle of position p (from `start`) is
//! the f32 product p·inv_i (p exact in f32 below 2^24); its cosine and sine are the f64
//! ones of that f32 angle, rounded once (PyTorch's `torch.polar` takes glibc's `cosf` and
//! `sinf` of the same angle, within an ulp). The op's PyTorch test holds the table to
//! PyTorch's, value for value.
//!
//! # The rotation
//! Pair (x₀, x₁) = (x[2i], x[2i+1]) of a head at position p, as the complex number
//! x₀ + i·x₁ times cos + i·sin (Meta's Llama, `view_as_complex` then a product):
//!   y₀ = x₀·cos − x₁·sin,   y₁ = x₀·sin + x₁·cos,
//! each product rounded, then the sum: PyTorch's scalar complex product. Its vectorised
//! one (AVX2, AVX-512) rounds one of the two products inside a fused multiply-add, so
//! PyTorch's own results move by an ulp with a value's place in its vectors; this op rounds
//! both, everywhere (a loop that vectorises without FMA, and the kernel's `_rn`
//! intrinsics), within 1 ulp of either. The backward multiplies by the conjugate (the
//! inverse rotation, as PyTorch's autograd does):
//!   dx₀ = dy₀·cos + dy₁·sin,   dx₁ = dy₁·cos − dy₀·sin.
//!
//! Each function runs over the positions in pieces of about [`CHUNK`] values, in the pool
//! of the device the calling thread works for (`backend::par`); the values are
//! independent, so the result is the same whatever the thread count.

use rayon::prelude::*;

use crate::backend::par;
use crate::backend::simd::widest;

/// Values per parallel task (whole positions, at least one): a few operations a value.
pub const CHUNK: usize = 1 << 15;

/// The table of positions `start..start + t` for a head width `d` (even): cos and sin,
/// (T, D/2) each (the module's "The table").
pub fn rope_table(t: usize, d: usize, base: f32, start: usize) -> (Vec<f32>, Vec<f32>) {
    let half = d / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| {
            let exponent = (2 * i) as f32 / d as f32;
            1.0 / (base as f64).powf(exponent as f64) as f32
        })
        .collect();
    let (mut cos, mut sin) = (Vec::with_capacity(t * half), Vec::with_capacity(t * half));
    for p in start..start + t {
        for &f in &inv {
            let angle = (p as f32 * f) as f64;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// Checks the lengths of one pass; the positions per parallel task.
fn check(op: &str, x: &[f32], cos: &[f32], sin: &[f32], (t, h, d): (usize, usize, usize)) -> usize {
    let per_position = h * d;
    assert!(d % 2 == 0 && per_position > 0, "{op}: (H, D) = ({h}, {d})");
    assert!(
        x.len().is_multiple_of(t * per_position),
        "{op}: {} values are not samples of (T, H, D) = ({t}, {h}, {d})",
        x.len()
    );
    assert!(cos.len() == t * d / 2 && sin.len() == cos.len(), "{op}: a table of {} for (T, D) = ({t}, {d})", cos.len());
    (CHUNK / per_position).max(1)
}

/// y = the rotation of every pair of x, in place over x: (N, T, H, D); cos, sin: (T, D/2).
pub fn rope_forward(x: &mut [f32], cos: &[f32], sin: &[f32], (t, h, d): (usize, usize, usize)) {
    let per_task = check("rope_forward", x, cos, sin, (t, h, d));
    let (per_position, half) = (h * d, d / 2);
    let tasks = x.par_chunks_mut(per_task * per_position).enumerate();
    par::for_each(tasks, |(k, xs)| {
        for (j, position) in xs.chunks_exact_mut(per_position).enumerate() {
            let p = (k * per_task + j) % t;
            let at = p * half..(p + 1) * half;
            rotate(position, &cos[at.clone()], &sin[at], d);
        }
    });
}

/// dx = the inverse rotation of every pair of dout, in place over dout: (N, T, H, D);
/// cos, sin: (T, D/2), the forward's.
pub fn rope_backward(dout: &mut [f32], cos: &[f32], sin: &[f32], (t, h, d): (usize, usize, usize)) {
    let per_task = check("rope_backward", dout, cos, sin, (t, h, d));
    let (per_position, half) = (h * d, d / 2);
    let tasks = dout.par_chunks_mut(per_task * per_position).enumerate();
    par::for_each(tasks, |(k, ds)| {
        for (j, position) in ds.chunks_exact_mut(per_position).enumerate() {
            let p = (k * per_task + j) % t;
            let at = p * half..(p + 1) * half;
            rotate_back(position, &cos[at.clone()], &sin[at], d);
        }
    });
}

widest! {
    /// One position's heads (H·D values), each pair turned by its angle: cos, sin (D/2).
    fn rotate(xs: &mut [f32], cos: &[f32], sin: &[f32], d: usize) {
        for head in xs.chunks_exact_mut(d) {
            for ((pair, &c), &s) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
                let (x0, x1) = (pair[0], pair[1]);
                pair[0] = x0 * c - x1 * s;
                pair[1] = x0 * s + x1 * c;
            }
        }
    }
}

widest! {
    /// One position's heads (H·D values), each pair turned back by its angle.
    fn rotate_back(ds: &mut [f32], cos: &[f32], sin: &[f32], d: usize) {
        for head in ds.chunks_exact_mut(d) {
            for ((pair, &c), &s) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
                let (d0, d1) = (pair[0], pair[1]);
                pair[0] = d0 * c + d1 * s;
                pair[1] = d1 * c - d0 * s;
            }
        }
    }
}
