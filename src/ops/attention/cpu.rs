//! Scaled dot-product attention on the CPU: the arithmetic of one (sample, head) — the
//! scores, the softmax under the mask and the mix of the values, and their gradients
//! ([`head_probs`], [`head_mix`] and the backward's [`head_mix_backward`],
//! [`head_scores_backward`], [`head_query_grad`], [`head_key_grad`]: the products
//! `backend::chain`'s, on the calling thread, in blocks of query rows that skip what the
//! causal mask hides: [`BLOCK_ROWS`]) over (T, D) views of q, k
//! and v wherever they lie — shared by causal self-attention (its heads are columns of
//! the fused qkv rows) and the scaled_dot_product_attention op (`ops::sdpa`, whose heads
//! are (T, D) blocks of separate tensors); the softmax row by row and its gradient (the
//! reference kernels/attention.cu is held to); and causal self-attention's own: one
//! sample's forward and backward ([`attention_forward`], [`attention_backward`]), the
//! dropout factors of both streams, and the projections' parameter gradients over the
//! whole batch ([`projection_backward`]). The layer in `mod.rs` owns the rest: the
//! buffers kept from the forward for the backward, the masks' keys from the context, the
//! samples' parallel loop, shapes and memory.
//!
//! Shapes (the module's legend): T positions, C width, H heads, D = C/H; one sample's x
//! and y are (T, C), its qkv (T, 3C), its probabilities (H, T, T); one head's q, k, v and
//! output (T, D), its scores and probabilities (T, T).

use crate::backend::chain::chain_gemm;
use crate::backend::cpu::{gemm, gemm_with, Accumulate, Accumulate::Overwrite, Mat, Threads};
use crate::backend::simd;
use crate::rng::{hash64, unit_f32};

/// The attention scale 1/√D, rounded once from f64 (PyTorch's `1 / math.sqrt(D)`).
pub fn attention_scale(head_width: usize) -> f32 {
    (1.0 / (head_width as f64).sqrt()) as f32
}

/// Which keys a query sees: every one, or (causal) those at its position or before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask {
    /// Query i sees every key.
    Full,
    /// Query i sees keys j ≤ i; the rest are masked (−∞ before the softmax, as PyTorch's
    /// `is_causal=True`).
    Causal,
}

impl Mask {
    /// The last key row `i` of a (T, T) score matrix sees.
    #[inline]
    pub fn last(self, i: usize, t: usize) -> usize {
        match self {
            Mask::Full => t - 1,
            Mask::Causal => i,
        }
    }
}

/// A row of the softmax, in place, its values past `last` masked: the scores s (T) become
/// p_j = exp(scale·s_j − m) / Σ_{k ≤ last} exp(scale·s_k − m) for j ≤ last,
/// m = max_{j ≤ last} scale·s_j, and p_j = 0 for j > last (the mask's −∞): row i of the
/// causal softmax for last = i, a row of the full one for last = T − 1. The exponentials,
/// the max and the sum are `backend::simd`'s (within 2 ulp; the sum in its fixed order of
/// 16 lanes, a function of `last` alone); the division is a multiplication by 1/Σ. The
/// CPU reference of kernels/attention.cu's forward.
///
/// The passes run over the live values and the masked ones up to the next whole vector
/// of `simd::LANES`, those set to −∞ first (so to 0 after the exponential), instead of
/// ending each pass in a scalar remainder of up to 15 values (causal rows average T/2
/// long): with the backward's like change, the softmax's share of a GPT step (perf) went
/// from 3.7% to 2.8%. The bits are those of the live values alone: −∞ moves no max, and
/// adding +0 to a lane of the sum (value j's lane is j mod LANES either way) leaves it
/// as it was (the tests hold both to the passes over j ≤ last alone).
pub fn softmax_row(row: &mut [f32], last: usize, scale: f32) {
    let end = whole_lanes(last + 1, row.len());
    let passes = &mut row[..end];
    passes[last + 1..].fill(f32::NEG_INFINITY);
    let max = simd::max_scaled(passes, scale);
    let inv = 1.0 / simd::exp_sum(passes, scale, max);
    for v in passes.iter_mut() {
        *v *= inv;
    }
    row[last + 1..].fill(0.0);
}

/// The values a pass over the first `live` of a row of `len` covers: `live` rounded up to
/// a whole number of `simd::LANES`, at most `len`.
fn whole_lanes(live: usize, len: usize) -> usize {
    live.next_multiple_of(simd::LANES).min(len)
}

/// The gradient of a row of [`softmax_row`] by its scores, in place: dp (T), the gradient
/// by the probabilities p (T), becomes
/// ds_j = scale·p_j·(dp_j − Σ_{k ≤ last} dp_k·p_k) for j ≤ last, 0 for j > last. The sum
/// is `backend::simd::dot`'s. The CPU reference of kernels/attention.cu's backward.
///
/// As the forward, the passes run to the next whole vector, dp zeroed past `last` first:
/// each such term of the sum is 0·0 = +0, which leaves the live values' bits.
pub fn softmax_row_bwd(p: &[f32], dp: &mut [f32], last: usize, scale: f32) {
    let passes = whole_lanes(last + 1, dp.len());
    dp[last + 1..passes].fill(0.0);
    let dot = simd::dot(&dp[..passes], p);
    for (d, q) in dp[..passes].iter_mut().zip(p) {
        *d = scale * (q * (*d - dot));
    }
    // Past `last` that gave scale·(0·(0 − dot)), a zero of either sign: the mask's is +0.
    dp[last + 1..].fill(0.0);
}

/// Rows of a head's products taken at once: one tile of `backend::chain`'s kernel on
/// AVX-512, two on AVX2. Under the causal mask a block of query rows i0..i1 meets only
/// keys j < i1 (and key j only queries i ≥ j): each product runs block by block over the
/// keys the block meets, about 60% of the full products at T = 64. Every value is one
/// chain of fused multiply-adds over its inner index in order (`chain_gemm`), so its bits
/// are a function of T, D and the mask alone, never of the batch or the device count;
/// the terms a block leaves out are the mask's exact zeros (P's and dS's past the
/// diagonal).
const BLOCK_ROWS: usize = 12;

/// The blocks of rows [i0, i1) of a head's T rows, [`BLOCK_ROWS`] at a time.
fn blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t).step_by(BLOCK_ROWS).map(move |i0| (i0, (i0 + BLOCK_ROWS).min(t)))
}

/// The keys 0..end that query rows up to `i1` (exclusive) see under `mask`.
fn keys_seen(mask: Mask, i1: usize, t: usize) -> usize {
    match mask {
        Mask::Full => t,
        Mask::Causal => i1,
    }
}

/// The first query that sees keys from `j0` on under `mask`: the first term of a key
/// block's sums over the queries.
fn first_query(mask: Mask, j0: usize) -> usize {
    match mask {
        Mask::Full => 0,
        Mask::Causal => j0,
    }
}

/// Columns of a (T, T) product a block computes to reach its keys 0..seen: `seen` rounded
/// up to the chain kernel's narrowest vector (8), at most T. The values past the keys a
/// row sees are the softmax's to mask (it overwrites them).
fn score_cols(seen: usize, t: usize) -> usize {
    seen.next_multiple_of(8).min(t)
}

/// (T, D) view `m` as a row-major (D, T) matrix: the right-hand side of the (T, T)
/// products, whose columns are its rows.
fn transposed(m: Mat<'_>) -> Vec<f32> {
    let (t, d) = (m.rows, m.cols);
    let mut out = vec![0.0; t * d];
    for (c, row) in out.chunks_exact_mut(t).enumerate() {
        for (i, o) in row.iter_mut().enumerate() {
            *o = m.data[i * m.rs + c * m.cs];
        }
    }
    out
}

/// Panics unless view `m`'s columns lie side by side (the products' right-hand sides).
fn check_rows(m: Mat<'_>, what: &str) {
    assert_eq!(m.cs, 1, "attention: {what}'s values must lie side by side in its rows");
}

/// One head's probabilities: S (T, T) = q·kᵀ, then P = softmax(scale·S) row by row under
/// `mask` ([`softmax_row`]), into p (T, T). q, k: (T, D) views.
pub(crate) fn head_probs(q: Mat<'_>, k: Mat<'_>, p: &mut [f32], mask: Mask, scale: f32) {
    let (t, d) = (q.rows, q.cols);
    let kt = transposed(k);
    for (i0, i1) in blocks(t) {
        let n = score_cols(keys_seen(mask, i1, t), t);
        chain_gemm((i1 - i0, n, d), &q.data[i0 * q.rs..], (q.rs, q.cs), &kt, t, &mut p[i0 * t..], t, Overwrite);
    }
    for (i, row) in p.chunks_exact_mut(t).enumerate() {
        softmax_row(row, mask.last(i, t), scale);
    }
}

/// One head's output: y (T, D) = P·v, written into `y` with row stride `ys`. p: (T, T)
/// (the probabilities, or their dropped form: zero wherever `mask` masks); v: (T, D) view.
pub(crate) fn head_mix(p: &[f32], v: Mat<'_>, (y, ys): Out<'_>, mask: Mask) {
    let (t, d) = (v.rows, v.cols);
    check_rows(v, "v");
    for (i0, i1) in blocks(t) {
        let seen = keys_seen(mask, i1, t);
        chain_gemm((i1 - i0, d, seen), &p[i0 * t..], (t, 1), v.data, v.rs, &mut y[i0 * ys..], ys, Overwrite);
    }
}

/// A (T, D) destination: the values and their row stride.
pub(crate) type Out<'a> = (&'a mut [f32], usize);

/// The backward of [`head_mix`]: dv (T, D) = Pᵀ·dy, written into `dv` when given, and
/// dP (T, T) = dy·vᵀ into `dp` (its values past the keys a row sees left to the softmax's
/// backward, which overwrites them). p: (T, T) as the mix read it; v, dy: (T, D) views.
pub(crate) fn head_mix_backward(p: &[f32], v: Mat<'_>, dy: Mat<'_>, dv: Option<Out<'_>>, dp: &mut [f32], mask: Mask) {
    let (t, d) = (v.rows, v.cols);
    check_rows(dy, "dy");
    if let Some((dv, rs)) = dv {
        for (j0, j1) in blocks(t) {
            let i0 = first_query(mask, j0);
            let a = &p[i0 * t + j0..];
            chain_gemm(
                (j1 - j0, d, t - i0),
                a,
                (1, t),
                &dy.data[i0 * dy.rs..],
                dy.rs,
                &mut dv[j0 * rs..],
                rs,
                Overwrite,
            );
        }
    }
    let vt = transposed(v);
    for (i0, i1) in blocks(t) {
        let n = score_cols(keys_seen(mask, i1, t), t);
        chain_gemm((i1 - i0, n, d), &dy.data[i0 * dy.rs..], (dy.rs, dy.cs), &vt, t, &mut dp[i0 * t..], t, Overwrite);
    }
}

/// The backward of [`head_probs`]'s softmax: dp (T, T), the gradient by P, becomes dS, the
/// gradient by the scores S, in place, row by row ([`softmax_row_bwd`], the scale
/// included; zero wherever `mask` masks). p: (T, T), the forward's P.
pub(crate) fn head_scores_backward(p: &[f32], dp: &mut [f32], t: usize, mask: Mask, scale: f32) {
    for (i, (drow, prow)) in dp.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
        softmax_row_bwd(prow, drow, mask.last(i, t), scale);
    }
}

/// The query's gradient from the scores': dq (T, D) = dS·k, written into `dq`. ds: (T, T),
/// from [`head_scores_backward`] under the same `mask`; k: (T, D) view.
pub(crate) fn head_query_grad(ds: &[f32], k: Mat<'_>, (dq, rs): Out<'_>, mask: Mask) {
    let (t, d) = (k.rows, k.cols);
    check_rows(k, "k");
    for (i0, i1) in blocks(t) {
        let seen = keys_seen(mask, i1, t);
        chain_gemm((i1 - i0, d, seen), &ds[i0 * t..], (t, 1), k.data, k.rs, &mut dq[i0 * rs..], rs, Overwrite);
    }
}

/// The key's gradient from the scores': dk (T, D) = dSᵀ·q, written into `dk`. ds: (T, T),
/// from [`head_scores_backward`] under the same `mask`; q: (T, D) view.
pub(crate) fn head_key_grad(ds: &[f32], q: Mat<'_>, (dk, rs): Out<'_>, mask: Mask) {
    let (t, d) = (q.rows, q.cols);
    check_rows(q, "q");
    for (j0, j1) in blocks(t) {
        let i0 = first_query(mask, j0);
        let a = &ds[i0 * t + j0..];
        chain_gemm((j1 - j0, d, t - i0), a, (1, t), &q.data[i0 * q.rs..], q.rs, &mut dk[j0 * rs..], rs, Overwrite);
    }
}

/// The dropout factor of element `idx` of stream `key`: 0, or `keep` = 1/(1 − rate), as
/// `nn::Dropout` and kernels/dropout.cu draw it.
#[inline]
fn drop_factor(key: u64, idx: u64, rate: f32, keep: f32) -> f32 {
    if unit_f32(hash64(key, idx)) >= rate {
        keep
    } else {
        0.0
    }
}

/// The dropout of one training pass: its rate, the survivors' factor, both streams' keys
/// and the pass's first sample within its logical replica's shard.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Drops {
    pub(super) rate: f32,
    pub(super) keep: f32,
    pub(super) attn: u64,
    pub(super) resid: u64,
    pub(super) first: usize,
}

/// What every sample of one pass shares: the shapes, the parameters, the masks.
pub(crate) struct PassContext<'a> {
    pub(super) t: usize,
    pub(super) c: usize,
    pub(super) heads: usize,
    pub(super) hd: usize,
    pub(super) scale: f32,
    /// c_attn.weight (3C, C) and c_proj.weight (C, C), as the backward multiplies by them.
    pub(super) w_attn: &'a [f32],
    pub(super) w_proj: &'a [f32],
    /// Their transposes, (C, 3C) and (C, C), as the forward multiplies by them (empty in
    /// a backward): the CPU GEMM runs a per-sample product some 1.5 times faster with its
    /// right-hand side stored by rows than as the transposed view of the weight.
    pub(super) wt_attn: &'a [f32],
    pub(super) wt_proj: &'a [f32],
    pub(super) b_attn: Option<&'a [f32]>,
    pub(super) b_proj: Option<&'a [f32]>,
    pub(super) drops: Option<Drops>,
}

/// One sample's forward buffers: qkv (T, 3C), P (H, T, T), merged (T, C), and P' (T, T)
/// when dropping.
pub(crate) struct SampleFwd<'s> {
    pub(super) qkv: &'s mut [f32],
    pub(super) probs: &'s mut [f32],
    pub(super) merged: &'s mut [f32],
    pub(super) dropped: &'s mut [f32],
}

impl PassContext<'_> {
    /// Head `h`'s probabilities as `y_h = P'·v_h` reads them: P itself without dropout,
    /// else P' = P ⊙ mask written to `dropped` (T, T). Only j ≤ i is drawn: the rest of
    /// P is 0, and 0 times either factor is 0.
    pub(super) fn dropped_probs<'p>(&self, s: usize, h: usize, p: &'p [f32], dropped: &'p mut [f32]) -> &'p [f32] {
        let Some(d) = self.drops else { return p };
        let t = self.t;
        let first = (((d.first + s) * self.heads + h) * t * t) as u64;
        for (i, (out, row)) in dropped.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
            for j in 0..=i {
                let idx = first + (i * t + j) as u64;
                out[j] = row[j] * drop_factor(d.attn, idx, d.rate, d.keep);
            }
            out[i + 1..].fill(0.0);
        }
        dropped
    }
}

/// One sample's forward (the module docs of `ops::attention`, p = 0 or not): sample `s`
/// of the pass (its index in the batch, which places its dropout masks).
/// x: (T, C) → y: (T, C), WRITTEN, y holding b_proj in every row on entry when there is
/// one; `b`'s qkv (T, 3C), P (H, T, T) and merged (T, C) written (the backward reads
/// them), P' (T, T) too when dropping.
pub(crate) fn attention_forward(job: &PassContext<'_>, s: usize, x: &[f32], y: &mut [f32], b: SampleFwd<'_>) {
    let (t, c, hd) = (job.t, job.c, job.hd);
    let SampleFwd { qkv, probs, merged, dropped } = b;
    // qkv (T, 3C) = x·W_attnᵀ + b_attn
    let acc = fill_rows(qkv, job.b_attn, 3 * c);
    gemm_with(Mat::rows(x, t, c), Mat::rows(job.wt_attn, c, 3 * c), qkv, 3 * c, acc, Threads::Caller);
    for (h, p) in probs.chunks_exact_mut(t * t).enumerate() {
        let q = cols(qkv, t, 3 * c, h * hd, hd);
        let k = cols(qkv, t, 3 * c, c + h * hd, hd);
        let v = cols(qkv, t, 3 * c, 2 * c + h * hd, hd);
        // S (T, T) = q_h·k_hᵀ, then P = causal softmax(S/√D) row by row
        head_probs(q, k, p, Mask::Causal, job.scale);
        // y_h (T, D) = P'·v_h, into columns h·D.. of merged (T, C)
        let pd = job.dropped_probs(s, h, p, dropped);
        head_mix(pd, v, (&mut merged[h * hd..], c), Mask::Causal);
    }
    // y (T, C) = dropout(merged·W_projᵀ + b_proj), y holding b_proj already
    let acc = if job.b_proj.is_some() { Accumulate::Add } else { Accumulate::Overwrite };
    gemm_with(Mat::rows(merged, t, c), Mat::rows(job.wt_proj, c, c), y, c, acc, Threads::Caller);
    if let Some(d) = job.drops {
        let first = ((d.first + s) * t * c) as u64;
        for (i, v) in y.iter_mut().enumerate() {
            *v *= drop_factor(d.resid, first + i as u64, d.rate, d.keep);
        }
    }
}

/// One sample's backward, sample `s` of the pass. dz: (T, C), the gradient by c_proj's
/// output, dropout's adjoint applied to it here in place (the parameter gradients read it
/// after: [`projection_backward`]); saved: its forward's qkv (T, 3C) and P (H, T, T).
/// WRITES dqkv (T, 3C), dmerged (T, C) and, when given, dx (T, C); dp (T, T) and dropped
/// (T, T, with dropout) are scratch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward(
    job: &PassContext<'_>,
    s: usize,
    dz: &mut [f32],
    saved: (&[f32], &[f32]),
    dqkv: &mut [f32],
    dmerged: &mut [f32],
    dp: &mut [f32],
    dropped: &mut [f32],
    dx: Option<&mut [f32]>,
) {
    let (t, c, hd) = (job.t, job.c, job.hd);
    let (qkv, probs) = saved;
    if let Some(d) = job.drops {
        let first = ((d.first + s) * t * c) as u64;
        for (i, v) in dz.iter_mut().enumerate() {
            *v *= drop_factor(d.resid, first + i as u64, d.rate, d.keep);
        }
    }
    // dmerged (T, C) = dz·W_proj
    gemm_with(Mat::rows(dz, t, c), Mat::rows(job.w_proj, c, c), dmerged, c, Accumulate::Overwrite, Threads::Caller);
    for (h, p) in probs.chunks_exact(t * t).enumerate() {
        let q = cols(qkv, t, 3 * c, h * hd, hd);
        let k = cols(qkv, t, 3 * c, c + h * hd, hd);
        let v = cols(qkv, t, 3 * c, 2 * c + h * hd, hd);
        let dy = cols(dmerged, t, c, h * hd, hd);
        // dv_h (T, D) = P'ᵀ·dy_h, dP' (T, T) = dy_h·v_hᵀ
        let pd = job.dropped_probs(s, h, p, dropped);
        head_mix_backward(pd, v, dy, Some((&mut dqkv[2 * c + h * hd..], 3 * c)), dp, Mask::Causal);
        // dP = dropout'(dP')
        if let Some(d) = job.drops {
            let first = (((d.first + s) * job.heads + h) * t * t) as u64;
            for (i, row) in dp.chunks_exact_mut(t).enumerate() {
                for (j, g) in row[..=i].iter_mut().enumerate() {
                    *g *= drop_factor(d.attn, first + (i * t + j) as u64, d.rate, d.keep);
                }
            }
        }
        // dS = softmax'(dP); dq_h (T, D) = dS·k_h, dk_h (T, D) = dSᵀ·q_h
        head_scores_backward(p, dp, t, Mask::Causal, job.scale);
        head_query_grad(dp, k, (&mut dqkv[h * hd..], 3 * c), Mask::Causal);
        head_key_grad(dp, q, (&mut dqkv[c + h * hd..], 3 * c), Mask::Causal);
    }
    if let Some(dx) = dx {
        // dx (T, C) = dqkv·W_attn
        let w = Mat::rows(job.w_attn, 3 * c, c);
        gemm_with(Mat::rows(dqkv, t, 3 * c), w, dx, c, Accumulate::Overwrite, Threads::Caller);
    }
}

/// The parameter gradients of a projection y = x·Wᵀ + b over `rows` rows of `inputs`
/// values to `outputs`, as `Linear`'s: one GEMM over all the rows (split over output
/// blocks only, never over the rows) and the bias summed row after row, so their order is
/// a function of the shape alone. dy: (rows, outputs), x: (rows, inputs); dweight:
/// (outputs, inputs) and dbias: (outputs) ACCUMULATED (+=).
pub(crate) fn projection_backward(
    dy: &[f32],
    x: &[f32],
    (rows, inputs, outputs): (usize, usize, usize),
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
) {
    gemm(Mat::rows(dy, rows, outputs).t(), Mat::rows(x, rows, inputs), dweight, inputs, Accumulate::Add);
    if let Some(db) = dbias {
        add_rows(db, dy, outputs);
    }
}

/// Columns `col..col + width` of a row-major matrix of `rows` rows, row stride `rs`.
fn cols(data: &[f32], rows: usize, rs: usize, col: usize, width: usize) -> Mat<'_> {
    Mat { data: &data[col..], rows, cols: width, rs, cs: 1 }
}

/// Fills each row of `y` (rows of `width`) with the bias; says how GEMM must then treat `y`.
fn fill_rows(y: &mut [f32], bias: Option<&[f32]>, width: usize) -> Accumulate {
    match bias {
        Some(b) => {
            for row in y.chunks_exact_mut(width) {
                row.copy_from_slice(b);
            }
            Accumulate::Add
        }
        None => Accumulate::Overwrite,
    }
}

/// Adds the rows of `d` (rows of `width`) into `db`, row after row.
fn add_rows(db: &mut [f32], d: &[f32], width: usize) {
    for row in d.chunks_exact(width) {
        for (g, v) in db.iter_mut().zip(row) {
            *g += v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::rng::SplitMix64;

    #[test]
    fn the_softmaxes_whole_vector_passes_give_the_bits_of_passes_over_the_live_values() {
        // The reference: the same `simd` passes over j ≤ i alone, the masked values never
        // read. Rows shorter than a vector, of one, across two and four; every i; scores
        // and gradients below, at and above the masked values' magnitudes.
        let mut g = SplitMix64::new(11);
        let scale = attention_scale(32);
        for t in [5, 16, 20, 40, 64] {
            for i in 0..t {
                let scores: Vec<f32> = (0..t).map(|_| (g.next_f32() - 0.5) * 40.0).collect();
                let mut want = scores.clone();
                let live = &mut want[..=i];
                let max = simd::max_scaled(live, scale);
                let inv = 1.0 / simd::exp_sum(live, scale, max);
                live.iter_mut().for_each(|v| *v *= inv);
                want[i + 1..].fill(0.0);
                let mut got = scores;
                softmax_row(&mut got, i, scale);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "forward, T {t}, row {i}");

                let dp: Vec<f32> = (0..t).map(|_| (g.next_f32() - 0.5) * 3.0).collect();
                let mut want_d = dp.clone();
                let dot = simd::dot(&want_d[..=i], &want);
                for (d, q) in want_d[..=i].iter_mut().zip(&want) {
                    *d = scale * (q * (*d - dot));
                }
                want_d[i + 1..].fill(0.0);
                let mut got_d = dp;
                softmax_row_bwd(&want, &mut got_d, i, scale);
                assert_eq!(bits(&got_d), bits(&want_d), "backward, T {t}, row {i}");
            }
        }
    }

    #[test]
    fn a_heads_products_are_chains_over_what_the_mask_leaves_on_any_shape() {
        // The reference computes every value alone: one f32 fused multiply-add chain over
        // the full inner index in order (the masked terms exact zeros), the softmax rows
        // as the layer's. The blocks of 12 query rows, the columns rounded to 8 and the
        // skipped keys must change no value (compared as numbers: a skipped zero term may
        // only turn a −0 into +0). T below a block, at 8, across blocks and their
        // rounding, D odd and even; both masks; q, k, v, dy as columns of wider rows (a
        // GPT's qkv) and as (T, D) blocks; outputs into wider rows, the values between them
        // untouched.
        let mut g = SplitMix64::new(5);
        let scale = 0.3;
        let chain = |m: usize, n: usize, k: usize, a: &dyn Fn(usize, usize) -> f32, b: &dyn Fn(usize, usize) -> f32| {
            let mut c = vec![0.0f32; m * n];
            for i in 0..m {
                for j in 0..n {
                    c[i * n + j] = (0..k).fold(0.0f32, |s, kk| a(i, kk).mul_add(b(kk, j), s));
                }
            }
            c
        };
        fn view(x: &[f32], (t, d, rs): (usize, usize, usize)) -> Mat<'_> {
            Mat { data: x, rows: t, cols: d, rs, cs: 1 }
        }
        for (t, d) in [(5, 3), (8, 4), (13, 8), (24, 5), (40, 16), (64, 32)] {
            for mask in [Mask::Causal, Mask::Full] {
                for rs in [d, 3 * d + 1] {
                    let rand = |g: &mut SplitMix64| -> Vec<f32> { (0..t * rs).map(|_| g.next_f32() - 0.5).collect() };
                    let (q, k, v, dy) = (rand(&mut g), rand(&mut g), rand(&mut g), rand(&mut g));
                    let at = |x: &[f32], i: usize, c: usize| x[i * rs + c];
                    let shape = (t, d, rs);
                    let what = format!("T {t}, D {d}, {mask:?}, rows {rs} apart");

                    // P = softmax(scale·q·kᵀ), y = P·v
                    let mut want_p = chain(t, t, d, &|i, c| at(&q, i, c), &|c, j| at(&k, j, c));
                    for (i, row) in want_p.chunks_exact_mut(t).enumerate() {
                        softmax_row(row, mask.last(i, t), scale);
                    }
                    let mut p = vec![f32::NAN; t * t];
                    head_probs(view(&q, shape), view(&k, shape), &mut p, mask, scale);
                    assert_eq!(p, want_p, "P, {what}");
                    let want_y = chain(t, d, t, &|i, j| p[i * t + j], &|j, c| at(&v, j, c));
                    let mut y = vec![f32::NAN; t * rs];
                    head_mix(&p, view(&v, shape), (&mut y, rs), mask);
                    for i in 0..t {
                        assert_eq!(y[i * rs..i * rs + d], want_y[i * d..(i + 1) * d], "y, {what}");
                    }

                    // dv = Pᵀ·dy, dP = dy·vᵀ, dS = softmax'(dP), dq = dS·k, dk = dSᵀ·q
                    let want_dv = chain(t, d, t, &|j, i| p[i * t + j], &|i, c| at(&dy, i, c));
                    let mut want_ds = chain(t, t, d, &|i, c| at(&dy, i, c), &|c, j| at(&v, j, c));
                    head_scores_backward(&p, &mut want_ds, t, mask, scale);
                    let want_dq = chain(t, d, t, &|i, j| want_ds[i * t + j], &|j, c| at(&k, j, c));
                    let want_dk = chain(t, d, t, &|j, i| want_ds[i * t + j], &|i, c| at(&q, i, c));
                    let (mut dv, mut dp) = (vec![f32::NAN; t * rs], vec![f32::NAN; t * t]);
                    head_mix_backward(&p, view(&v, shape), view(&dy, shape), Some((&mut dv, rs)), &mut dp, mask);
                    head_scores_backward(&p, &mut dp, t, mask, scale);
                    assert_eq!(dp, want_ds, "dS, {what}");
                    let (mut dq, mut dk) = (vec![f32::NAN; t * rs], vec![f32::NAN; t * rs]);
                    head_query_grad(&dp, view(&k, shape), (&mut dq, rs), mask);
                    head_key_grad(&dp, view(&q, shape), (&mut dk, rs), mask);
                    for i in 0..t {
                        let row = i * rs..i * rs + d;
                        let want = i * d..(i + 1) * d;
                        assert_eq!(dv[row.clone()], want_dv[want.clone()], "dv, {what}");
                        assert_eq!(dq[row.clone()], want_dq[want.clone()], "dq, {what}");
                        assert_eq!(dk[row], want_dk[want], "dk, {what}");
                    }
                    let between = |x: &[f32]| (0..t * rs).filter(|i| i % rs >= d).all(|i| x[i].is_nan());
                    assert!([&y, &dv, &dq, &dk].into_iter().all(|x| between(x)), "values between rows written, {what}");
                }
            }
        }
    }
}
