//! Softmax over the last dimension on the CPU: its forward and backward over rows, as plain
//! functions ([`softmax_forward`], [`softmax_backward`]), and the order of every sum they
//! take. The reference kernels/softmax.cu is held to, bit for bit (`super::gpu::host_check`).
//!
//! A row is C values along the last dimension: y = e^(x − max) / Σ e^(x − max).
//!
//! # Numerics
//! - max: the row's largest value (a NaN is passed over, as `f32::max` and `fmaxf` do; it
//!   still makes its own e, and so the sum and the whole row, NaN, as PyTorch's softmax);
//! - e = e^(x − max) in f32, the difference rounded once and e^ by
//!   `backend::simd::exp_f32` (within 2 ulp; `kernels/common.cuh`'s on the GPU);
//! - the sum Σ e in f64 over LayerNorm's 32 lanes and fixed tree (`ops::layernorm::cpu`),
//!   so its order is fixed by C alone; y = e / sum in f64, rounded once;
//! - backward: dot = Σ dy·y in f64 over the same lanes (the products exact), and
//!   dx = y·(dy − dot) in f64, rounded once.
//!
//! Rows run in chunks of [`ROW_CHUNK`] in parallel on the device's pool (`backend::par`);
//! each row is computed alone, so nothing depends on the thread count.

use rayon::prelude::*;

use crate::backend::par;
use crate::backend::simd::{exp_f32, widest};
use crate::ops::layernorm::cpu::{lane_sum, lane_tree, LANES};

/// Rows per parallel task.
pub const ROW_CHUNK: usize = 64;

/// One row's forward, in place: x: (C) → y: (C).
#[inline(always)]
fn forward_row(xs: &mut [f32]) {
    let max = xs.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for v in xs.iter_mut() {
        *v = exp_f32(*v - max);
    }
    let sum = lane_sum(xs, |e| e as f64);
    for v in xs.iter_mut() {
        *v = (*v as f64 / sum) as f32;
    }
}

/// One row's backward, in place: dy: (C) → dx: (C), y: (C) the forward's output.
#[inline(always)]
fn backward_row(ds: &mut [f32], y: &[f32]) {
    let mut acc = [0.0f64; LANES];
    for (chunk, ys) in ds.chunks(LANES).zip(y.chunks(LANES)) {
        for ((a, &d), &y) in acc.iter_mut().zip(chunk).zip(ys) {
            *a += d as f64 * y as f64;
        }
    }
    let dot = lane_tree(acc);
    for (d, &y) in ds.iter_mut().zip(y) {
        *d = (y as f64 * (*d as f64 - dot)) as f32;
    }
}

widest! {
    /// A chunk of rows' forward (rows of `c`), at the processor's widest vectors.
    fn forward_rows(xs: &mut [f32], c: usize) {
        for row in xs.chunks_exact_mut(c) {
            forward_row(row);
        }
    }
}

widest! {
    /// A chunk of rows' backward (rows of `c`), at the processor's widest vectors.
    fn backward_rows(ds: &mut [f32], ys: &[f32], c: usize) {
        for (row, y) in ds.chunks_exact_mut(c).zip(ys.chunks_exact(c)) {
            backward_row(row, y);
        }
    }
}

/// Forward over rows of `c` values, in place: x: (rows, C) → y: (rows, C).
pub fn softmax_forward(x: &mut [f32], c: usize) {
    if c == 0 {
        return;
    }
    assert!(x.len().is_multiple_of(c), "softmax_forward: {} values in rows of {c}", x.len());
    par::for_each(x.par_chunks_mut(ROW_CHUNK * c), |xs| forward_rows(xs, c));
}

/// Backward over rows of `c` values from the forward's output y: (rows, C): dout: (rows, C)
/// becomes dx = y·(dout − Σ dout·y) in place (WRITTEN).
pub fn softmax_backward(dout: &mut [f32], y: &[f32], c: usize) {
    if c == 0 {
        return;
    }
    assert!(
        dout.len() == y.len() && y.len().is_multiple_of(c),
        "softmax_backward: dout of {}, y of {} in rows of {c}",
        dout.len(),
        y.len()
    );
    par::for_each(dout.par_chunks_mut(ROW_CHUNK * c).zip(y.par_chunks(ROW_CHUNK * c)), |(ds, ys)| {
        backward_rows(ds, ys, c)
    });
}
