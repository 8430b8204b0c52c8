//! LayerNorm on the CPU: its forward and backward over rows, as plain functions
//! ([`layernorm_forward`], [`layernorm_backward`]), and the order of every sum they take.
//! The reference kernels/layernorm.cu is held to, bit for bit (`super::gpu::host_check`).
//!
//! A row is C values along the last dimension, normalised by its own mean and BIASED
//! variance: y = (x − mean)·rstd·w + b, rstd = 1/√(var + eps) (`super`'s docs).
//!
//! # Numerics: the reference
//! Every sum is in f64, in an order fixed by C alone (or by the row count alone), never by
//! the threads:
//! - a row's sums (Σ x, Σ (x − mean)², and backward's Σ g, Σ g·x̂) take [`LANES`] = 32
//!   lanes: lane j adds the elements i ≡ j (mod 32) in increasing i, from 0.0; then the
//!   lanes meet in a fixed tree (lane t += lane t + s for s = 16, 8, 4, 2, 1): one warp of
//!   the kernel a row, its lanes reduced as kernels/batchnorm.cu's `block_sum` reduces a
//!   block;
//! - forward: mean = Σx / C and var = Σ(x − mean)² / C (two passes, so no cancellation),
//!   rstd = 1/√(var + eps) in f64; x̂ = (x − mean)·rstd in f64, kept rounded to f32 for the
//!   backward, and y = x̂·w + b in f64 from that f64 x̂, rounded once;
//! - backward, with g = dy·w (exact in f64, a product of two f32):
//!   dx = rstd·((g − Σg/C) − x̂·(Σg·x̂/C)), in f64, rounded once;
//! - dw += Σ_rows dy·x̂ and db += Σ_rows dy (the products exact in f64): rows are taken in
//!   chunks of [`ROW_CHUNK`] (64), each chunk's column sums are taken row by row from 0.0,
//!   then the chunks' sums are added in chunk order, starting from the first's, and the
//!   total is rounded to f32 and added to the gradient. The chunks are what the CPU's
//!   threads and the GPU's threads share out; their size is a constant, so the order is a
//!   function of the row count alone.
//!
//! The kernels compute the same expressions in the same order, in double, without
//! contraction (`__dmul_rn`, `__dadd_rn`, ...; IEEE division and square root), so on the
//! host they equal this file bit for bit (`super::gpu::host_check`), and on a GPU they would
//! too: nothing here depends on a library function. f64 costs little: the 32 lanes are 4
//! AVX-512 registers or 8 AVX2 ones (the row functions are compiled for both, by
//! `backend::simd::widest!`), and the GPT's 768 rows of 128 take some 0.1 ms forward and
//! 0.1 ms backward on one core (`time_forward_and_backward_at_768_rows_of_128` in
//! `super`'s tests, run by hand).

use rayon::prelude::*;

use crate::backend::par;
use crate::backend::simd::widest;
use crate::ops::InputGrad;

/// Lanes of a row's sums: one warp of kernels/layernorm.cu (`LN_LANES` there).
pub const LANES: usize = 32;

/// Rows per chunk of the parameter gradients' sums, and per parallel task (module docs):
/// 64 rows of 128 values are some 10 µs of work, which amortises a task, and a GPT shard
/// of 768 rows is 12 of them.
pub const ROW_CHUNK: usize = 64;

/// The sum of 32 lane sums, by the fixed tree (module docs).
#[inline(always)]
pub fn lane_tree(mut acc: [f64; LANES]) -> f64 {
    let mut s = LANES / 2;
    while s > 0 {
        for t in 0..s {
            acc[t] += acc[t + s];
        }
        s /= 2;
    }
    acc[0]
}

/// Σ f(v) over a row in the lanes' order (module docs).
#[inline(always)]
pub fn lane_sum(row: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    let mut acc = [0.0f64; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            *a += f(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a += f(v);
    }
    lane_tree(acc)
}

/// (Σ g, Σ g·x̂) over a row, g = dy·w, in the lanes' order (module docs).
#[inline(always)]
fn grad_sums(dy: &[f32], w: &[f32], xhat: &[f32]) -> (f64, f64) {
    let (mut sg, mut sgx) = ([0.0f64; LANES], [0.0f64; LANES]);
    let c = dy.len();
    let full = c - c % LANES;
    let mut at = 0;
    while at < full {
        let (d, w, xh) = (&dy[at..at + LANES], &w[at..at + LANES], &xhat[at..at + LANES]);
        for j in 0..LANES {
            let g = d[j] as f64 * w[j] as f64;
            sg[j] += g;
            sgx[j] += g * xh[j] as f64;
        }
        at += LANES;
    }
    for j in 0..c - full {
        let g = dy[full + j] as f64 * w[full + j] as f64;
        sg[j] += g;
        sgx[j] += g * xhat[full + j] as f64;
    }
    (lane_tree(sg), lane_tree(sgx))
}

/// (mean, rstd) of one row of f32 values, in f64 (module docs).
#[inline(always)]
pub fn row_stats(x: &[f32], eps: f32) -> (f64, f64) {
    let c = x.len() as f64;
    let mean = lane_sum(x, |v| v as f64) / c;
    let var = lane_sum(x, |v| {
        let d = v as f64 - mean;
        d * d
    }) / c;
    (mean, 1.0 / (var + eps as f64).sqrt())
}

/// The weight (C) and the bias (C, or none) of a pass.
#[derive(Clone, Copy)]
struct Affine<'a> {
    w: &'a [f32],
    b: Option<&'a [f32]>,
}

/// What a training forward keeps of a chunk of rows: x̂ (rows, C) and rstd (rows).
type Kept<'a> = Option<(&'a mut [f32], &'a mut [f64])>;

/// A chunk of rows' forward, x: (rows, C) → y in place; in training x̂ and rstd kept.
#[inline(always)]
fn forward_rows_any(xs: &mut [f32], kept: Kept<'_>, a: Affine<'_>, eps: f32) {
    let c = a.w.len();
    let (mut xhat, mut rstd) = match kept {
        Some((xh, rs)) => (Some(xh.chunks_exact_mut(c)), Some(rs.iter_mut())),
        None => (None, None),
    };
    for xs in xs.chunks_exact_mut(c) {
        let (mean, rs) = row_stats(xs, eps);
        let normalised = |v: f32| (v as f64 - mean) * rs;
        match (xhat.as_mut().and_then(|x| x.next()), a.b) {
            (Some(xh), Some(b)) => {
                for (((v, h), &w), &b) in xs.iter_mut().zip(xh).zip(a.w).zip(b) {
                    let n = normalised(*v);
                    *h = n as f32;
                    *v = (n * w as f64 + b as f64) as f32;
                }
            }
            (Some(xh), None) => {
                for ((v, h), &w) in xs.iter_mut().zip(xh).zip(a.w) {
                    let n = normalised(*v);
                    *h = n as f32;
                    *v = (n * w as f64) as f32;
                }
            }
            (None, Some(b)) => {
                for ((v, &w), &b) in xs.iter_mut().zip(a.w).zip(b) {
                    *v = (normalised(*v) * w as f64 + b as f64) as f32;
                }
            }
            (None, None) => {
                for (v, &w) in xs.iter_mut().zip(a.w) {
                    *v = (normalised(*v) * w as f64) as f32;
                }
            }
        }
        if let Some(r) = rstd.as_mut().and_then(|r| r.next()) {
            *r = rs;
        }
    }
}

/// A chunk of rows' backward from the forward's x̂ (rows, C) and rstd (rows): `part`
/// (2, C) takes the chunk's column sums (Σ dy·x̂, then Σ dy) from 0.0, row by row, and
/// dy: (rows, C) becomes dx in place when `input_grad` asks for it.
#[inline(always)]
fn backward_rows_any(ds: &mut [f32], xhat: &[f32], rstd: &[f64], w: &[f32], part: &mut [f64], input_grad: InputGrad) {
    let c = w.len();
    let (pw, pb) = part.split_at_mut(c);
    pw.fill(0.0);
    pb.fill(0.0);
    for ((d, xh), &rs) in ds.chunks_exact_mut(c).zip(xhat.chunks_exact(c)).zip(rstd) {
        for (((pw, pb), &d), &xh) in pw.iter_mut().zip(pb.iter_mut()).zip(d.iter()).zip(xh) {
            *pw += d as f64 * xh as f64;
            *pb += d as f64;
        }
        if input_grad == InputGrad::Needed {
            let (sg, sgx) = grad_sums(d, w, xh);
            let (mg, mgx) = (sg / c as f64, sgx / c as f64);
            for ((d, &xh), &w) in d.iter_mut().zip(xh).zip(w) {
                let g = *d as f64 * w as f64;
                *d = (rs * ((g - mg) - xh as f64 * mgx)) as f32;
            }
        }
    }
}

widest! {
    /// [`forward_rows_any`] at the processor's widest vectors (`backend::simd`: 8 f64 a
    /// vector with AVX-512, 4 with AVX2, 2 without; the same bits at every width).
    fn forward_rows(xs: &mut [f32], kept: Kept<'_>, a: Affine<'_>, eps: f32) {
        forward_rows_any(xs, kept, a, eps)
    }
}

widest! {
    /// [`backward_rows_any`] at the processor's widest vectors.
    fn backward_rows(ds: &mut [f32], xhat: &[f32], rstd: &[f64], w: &[f32], part: &mut [f64], input_grad: InputGrad) {
        backward_rows_any(ds, xhat, rstd, w, part, input_grad)
    }
}

/// Forward over rows of C values, in place: x: (rows, C) → y = x̂·w + b (no b without a
/// bias); weight, bias: (C); with `kept` (training), x̂: (rows, C) and rstd: (rows) written
/// for the backward. Chunks of [`ROW_CHUNK`] rows run in parallel on the device's pool.
pub fn layernorm_forward(
    x: &mut [f32],
    kept: Option<(&mut [f32], &mut [f64])>,
    weight: &[f32],
    bias: Option<&[f32]>,
    eps: f32,
) {
    let c = weight.len();
    let affine = Affine { w: weight, b: bias };
    // (A width of 0 has no rows: the spans only keep rayon's chunks non-empty.)
    let span = (ROW_CHUNK * c).max(1);
    match kept {
        Some((xhat, rstd)) => {
            let chunks = x.par_chunks_mut(span).zip(xhat.par_chunks_mut(span));
            par::for_each(chunks.zip(rstd.par_chunks_mut(ROW_CHUNK)), |((xs, xh), rs)| {
                forward_rows(xs, Some((xh, rs)), affine, eps);
            });
        }
        None => par::for_each(x.par_chunks_mut(span), |xs| forward_rows(xs, None, affine, eps)),
    }
}

/// Backward over rows of C values from the forward's x̂: (rows, C) and rstd: (rows):
/// dweight (C) += Σ_rows dout·x̂ and dbias (C) += Σ_rows dout (ACCUMULATED, in the chunk
/// order of the module docs), and dout: (rows, C) becomes dx in place (WRITTEN) when
/// `input_grad` asks for it. weight: (C); `partials`, the chunks' column sums
/// (ceil(rows / ROW_CHUNK), 2, C), is the caller's workspace, kept from call to call.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dout: &mut [f32],
    xhat: &[f32],
    rstd: &[f64],
    weight: &[f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    partials: &mut Vec<f64>,
    input_grad: InputGrad,
) {
    let c = weight.len();
    let chunks = rstd.len().div_ceil(ROW_CHUNK);
    partials.resize(chunks * 2 * c, 0.0);
    let span = (ROW_CHUNK * c).max(1);
    let parts = dout.par_chunks_mut(span).zip(xhat.par_chunks(span));
    let parts = parts.zip(rstd.par_chunks(ROW_CHUNK)).zip(partials.par_chunks_mut((2 * c).max(1)));
    par::for_each(parts, |(((ds, xh), rs), part)| backward_rows(ds, xh, rs, weight, part, input_grad));
    // The chunks' sums, in chunk order, into the first chunk's.
    if c > 0 && !partials.is_empty() {
        let (first, rest) = partials.split_at_mut(2 * c);
        for later in rest.chunks_exact(2 * c) {
            for (a, &b) in first.iter_mut().zip(later) {
                *a += b;
            }
        }
        let (sw, sb) = first.split_at(c);
        for (g, &s) in dweight.iter_mut().zip(sw) {
            *g += s as f32;
        }
        if let Some(dbias) = dbias {
            for (g, &s) in dbias.iter_mut().zip(sb) {
                *g += s as f32;
            }
        }
    }
}
