//! RMSNorm on the CPU: its forward and backward over rows, as plain functions
//! ([`rmsnorm_forward`], [`rmsnorm_backward`]), and the order of every sum they take. The
//! reference kernels/rmsnorm.cu is held to, bit for bit (`super::gpu::host_check`).
//!
//! A row is C values along the last dimension, divided by their root mean square:
//! y = x·rstd·w, rstd = 1/√(mean(x²) + eps) (`super`'s docs).
//!
//! # Numerics: the reference
//! LayerNorm's, less the mean (`ops::layernorm::cpu`, whose lanes this shares): every sum
//! is in f64, in an order fixed by C alone (or by the row count alone), never by the
//! threads:
//! - a row's sums (Σ x², and backward's Σ g·x̂) take `LANES` = 32 lanes, lane j adding
//!   the elements i ≡ j (mod 32) in increasing i from 0.0, the lanes meeting in
//!   LayerNorm's fixed tree;
//! - forward: rstd = 1/√(Σx²/C + eps) in f64; x̂ = x·rstd in f64, kept rounded to f32 for
//!   the backward, and y = x̂·w in f64 from that f64 x̂, rounded once;
//! - backward, with g = dy·w (exact in f64): dx = rstd·(g − x̂·(Σg·x̂/C)), in f64, rounded
//!   once;
//! - dw += Σ_rows dy·x̂ (the products exact in f64): rows in chunks of [`ROW_CHUNK`] (64),
//!   each chunk's column sums taken row by row from 0.0, then the chunks' sums added in
//!   chunk order, starting from the first's; the total is rounded to f32 and added to the
//!   gradient. The order is a function of the row count alone.
//!
//! The kernels compute the same expressions in the same order, in double, without
//! contraction, with IEEE division and square root, so they equal this file bit for bit.

use rayon::prelude::*;

use crate::backend::par;
use crate::backend::simd::widest;
use crate::ops::layernorm::cpu::{lane_sum, lane_tree, LANES};
use crate::ops::InputGrad;

/// Rows per chunk of the weight gradient's sums, and per parallel task: LayerNorm's.
pub use crate::ops::layernorm::cpu::ROW_CHUNK;

/// rstd = 1/√(mean(x²) + eps) of one row of f32 values, in f64 (module docs).
#[inline(always)]
pub fn row_rstd(x: &[f32], eps: f32) -> f64 {
    let ms = lane_sum(x, |v| v as f64 * v as f64) / x.len() as f64;
    1.0 / (ms + eps as f64).sqrt()
}

/// Σ g·x̂ over a row, g = dy·w, in the lanes' order (module docs).
#[inline(always)]
fn grad_sum(dy: &[f32], w: &[f32], xhat: &[f32]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let c = dy.len();
    let full = c - c % LANES;
    let mut at = 0;
    while at < full {
        let (d, w, xh) = (&dy[at..at + LANES], &w[at..at + LANES], &xhat[at..at + LANES]);
        for j in 0..LANES {
            acc[j] += d[j] as f64 * w[j] as f64 * xh[j] as f64;
        }
        at += LANES;
    }
    for j in 0..c - full {
        acc[j] += dy[full + j] as f64 * w[full + j] as f64 * xhat[full + j] as f64;
    }
    lane_tree(acc)
}

/// What a training forward keeps of a chunk of rows: x̂ (rows, C) and rstd (rows).
type Kept<'a> = Option<(&'a mut [f32], &'a mut [f64])>;

/// A chunk of rows' forward, x: (rows, C) → y in place; in training x̂ and rstd kept.
#[inline(always)]
fn forward_rows_any(xs: &mut [f32], kept: Kept<'_>, w: &[f32], eps: f32) {
    let c = w.len();
    let (mut xhat, mut rstd) = match kept {
        Some((xh, rs)) => (Some(xh.chunks_exact_mut(c)), Some(rs.iter_mut())),
        None => (None, None),
    };
    for xs in xs.chunks_exact_mut(c) {
        let rs = row_rstd(xs, eps);
        match xhat.as_mut().and_then(|x| x.next()) {
            Some(xh) => {
                for ((v, h), &w) in xs.iter_mut().zip(xh).zip(w) {
                    let n = *v as f64 * rs;
                    *h = n as f32;
                    *v = (n * w as f64) as f32;
                }
            }
            None => {
                for (v, &w) in xs.iter_mut().zip(w) {
                    *v = (*v as f64 * rs * w as f64) as f32;
                }
            }
        }
        if let Some(r) = rstd.as_mut().and_then(|r| r.next()) {
            *r = rs;
        }
    }
}

/// A chunk of rows' backward from the forward's x̂ (rows, C) and rstd (rows): `part` (C)
/// takes the chunk's column sums Σ dy·x̂ from 0.0, row by row, and dy: (rows, C) becomes
/// dx in place when `input_grad` asks for it.
#[inline(always)]
fn backward_rows_any(ds: &mut [f32], xhat: &[f32], rstd: &[f64], w: &[f32], part: &mut [f64], input_grad: InputGrad) {
    let c = w.len();
    part.fill(0.0);
    for ((d, xh), &rs) in ds.chunks_exact_mut(c).zip(xhat.chunks_exact(c)).zip(rstd) {
        for ((p, &d), &xh) in part.iter_mut().zip(d.iter()).zip(xh) {
            *p += d as f64 * xh as f64;
        }
        if input_grad == InputGrad::Needed {
            let mgx = grad_sum(d, w, xh) / c as f64;
            for ((d, &xh), &w) in d.iter_mut().zip(xh).zip(w) {
                let g = *d as f64 * w as f64;
                *d = (rs * (g - xh as f64 * mgx)) as f32;
            }
        }
    }
}

widest! {
    /// [`forward_rows_any`] at the processor's widest vectors (the same bits at every width).
    fn forward_rows(xs: &mut [f32], kept: Kept<'_>, w: &[f32], eps: f32) {
        forward_rows_any(xs, kept, w, eps)
    }
}

widest! {
    /// [`backward_rows_any`] at the processor's widest vectors.
    fn backward_rows(ds: &mut [f32], xhat: &[f32], rstd: &[f64], w: &[f32], part: &mut [f64], input_grad: InputGrad) {
        backward_rows_any(ds, xhat, rstd, w, part, input_grad)
    }
}

/// Forward over rows of C values, in place: x: (rows, C) → y = x·rstd·w; weight: (C);
/// with `kept` (training), x̂: (rows, C) and rstd: (rows) written for the backward.
/// Chunks of [`ROW_CHUNK`] rows run in parallel on the device's pool.
pub fn rmsnorm_forward(x: &mut [f32], kept: Option<(&mut [f32], &mut [f64])>, weight: &[f32], eps: f32) {
    let c = weight.len();
    // (A width of 0 has no rows: the spans only keep rayon's chunks non-empty.)
    let span = (ROW_CHUNK * c).max(1);
    match kept {
        Some((xhat, rstd)) => {
            let chunks = x.par_chunks_mut(span).zip(xhat.par_chunks_mut(span));
            par::for_each(chunks.zip(rstd.par_chunks_mut(ROW_CHUNK)), |((xs, xh), rs)| {
                forward_rows(xs, Some((xh, rs)), weight, eps);
            });
        }
        None => par::for_each(x.par_chunks_mut(span), |xs| forward_rows(xs, None, weight, eps)),
    }
}

/// Backward over rows of C values from the forward's x̂: (rows, C) and rstd: (rows):
/// dweight (C) += Σ_rows dout·x̂ (ACCUMULATED, in the chunk order of the module docs), and
/// dout: (rows, C) becomes dx in place (WRITTEN) when `input_grad` asks for it. weight:
/// (C); `partials`, the chunks' column sums (ceil(rows / ROW_CHUNK), C), is the caller's
/// workspace, kept from call to call.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dout: &mut [f32],
    xhat: &[f32],
    rstd: &[f64],
    weight: &[f32],
    dweight: &mut [f32],
    partials: &mut Vec<f64>,
    input_grad: InputGrad,
) {
    let c = weight.len();
    let chunks = rstd.len().div_ceil(ROW_CHUNK);
    partials.resize(chunks * c, 0.0);
    let span = (ROW_CHUNK * c).max(1);
    let parts = dout.par_chunks_mut(span).zip(xhat.par_chunks(span));
    let parts = parts.zip(rstd.par_chunks(ROW_CHUNK)).zip(partials.par_chunks_mut(c.max(1)));
    par::for_each(parts, |(((ds, xh), rs), part)| backward_rows(ds, xh, rs, weight, part, input_grad));
    // The chunks' sums, in chunk order, into the first chunk's.
    if c > 0 && !partials.is_empty() {
        let (first, rest) = partials.split_at_mut(c);
        for later in rest.chunks_exact(c) {
            for (a, &b) in first.iter_mut().zip(later) {
                *a += b;
            }
        }
        for (g, &s) in dweight.iter_mut().zip(first.iter()) {
            *g += s as f32;
        }
    }
}
