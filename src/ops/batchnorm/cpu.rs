//! BatchNorm on the CPU: the arithmetic of a BatchNorm2d's passes over (N, C, H·W) values,
//! as plain functions in the order a training step calls them (the statistics exchange of
//! a synchronized layer, in `super`, sits between them): [`batchnorm_moments`] (a shard's
//! per-channel mean and M2), [`global_moments`] (every logical replica's, merged),
//! [`batchnorm_train_stats`] / [`batchnorm_eval_stats`] (what normalises, the running
//! statistics moved), [`batchnorm_forward`]; [`batchnorm_backward_sums`] (a shard's
//! per-channel Σ dy and Σ dy·x̂), [`global_sums`], [`batchnorm_param_grads`] and
//! [`batchnorm_input_grad`]. The reference kernels/batchnorm.cu is held to
//! (`super::gpu::host_check`: the synchronized kernels bit for bit, the per-replica ones
//! within the tolerance [`RunningUpdate`] states).
//!
//! Statistics are f64: a plane's sums take eight accumulators in an order fixed by its
//! length alone (`sum_f64`), planes are merged in sample order with Chan et al.'s
//! pairwise update (as stable as two passes), each channel's fold whatever the threads
//! (`per_channel`). The variance that normalises is the BIASED one; `running_var` takes
//! the unbiased one ([`RunningUpdate`]). A ReLU after the layer may run in its passes
//! ([`Activation::Relu`]), with the same bits as the two layers one after the other.
//! Backward ACCUMULATES into dγ and dβ and WRITES dx.

use rayon::prelude::*;

use crate::backend::par;
use crate::backend::simd::widest;
use crate::error::Result;
use crate::ops::spec::Activation;

use super::stats::StatsExchange;

/// Each channel's (mean, M2) of x: (N, C, HW), in f64, M2 the sum of squared deviations:
/// each plane is read from memory once, its mean and squared deviations taken while it is
/// in L1, and the planes merged in sample order (`Moments::merge`). A channel of no
/// sample is (0, 0). What a synchronized layer hands the exchange.
pub fn batchnorm_moments(x: &[f32], n: usize, c: usize, hw: usize) -> Vec<(f64, f64)> {
    let moments = per_channel(n, c, |acc: &mut Moments, s, ch| {
        let p = &x[(s * c + ch) * hw..(s * c + ch + 1) * hw];
        let (k, pm) = (p.len() as f64, sum_f64(p) / p.len() as f64);
        acc.merge(&Moments { count: k, mean: pm, m2: sum_sq_dev_f64(p, pm) });
    });
    moments.iter().map(|m| (m.mean, m.m2)).collect()
}

/// A training forward's statistics from its batch's `count` values per channel and
/// per-channel (mean, M2) `moments` (C): what normalises each channel, (mean, invstd)
/// (C each, [`normaliser`] of the BIASED variance M2 / count), and the running statistics
/// moved in place, running_mean and running_var: (C) ([`RunningUpdate`] at Keras momentum
/// `momentum` for `count` values).
pub fn batchnorm_train_stats(
    count: f64,
    moments: &[(f64, f64)],
    eps: f32,
    momentum: f32,
    running_mean: &mut [f32],
    running_var: &mut [f32],
) -> (Vec<f32>, Vec<f32>) {
    let stats: Vec<(f64, f64)> = moments.iter().map(|&(mean, m2)| (mean, m2 / count)).collect();
    let update = RunningUpdate::new(momentum, count as usize);
    for ((&(mean, var), r_mean), r_var) in stats.iter().zip(running_mean.iter_mut()).zip(running_var.iter_mut()) {
        *r_mean = update.mean(*r_mean, mean);
        *r_var = update.var(*r_var, var);
    }
    stats.iter().map(|&(mean, var)| normaliser(mean, var, eps)).unzip()
}

/// An evaluation's statistics: (mean, invstd) (C each) from the running statistics, the
/// mean as it is and invstd = 1/sqrt(running_var + eps) in f32.
pub fn batchnorm_eval_stats(running_mean: &[f32], running_var: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    (running_mean.to_vec(), running_var.iter().map(|&v| 1.0 / (v + eps).sqrt()).collect())
}

/// The forward, in one pass, in place over x: (N, C, HW): y = γ·x̂ + β with
/// x̂ = (x − mean)·invstd, clamped at 0 when `after` is [`Activation::Relu`]; with `xhat`
/// (training), x̂: (N, C, HW) written there for the backward. mean, invstd: (C); gamma,
/// beta: (C), or none (γ = 1, β = 0). Samples run in parallel on the device's pool.
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_forward(
    x: &mut [f32],
    xhat: Option<&mut [f32]>,
    mean: &[f32],
    invstd: &[f32],
    gamma: Option<&[f32]>,
    beta: Option<&[f32]>,
    after: Activation,
    c: usize,
    hw: usize,
) {
    let relu = after == Activation::Relu;
    let per = c * hw;
    let write = |sample: &mut [f32], cache: &mut [f32]| {
        for ch in 0..c {
            let (mu, is) = (mean[ch], invstd[ch]);
            let g = gamma.map_or(1.0, |g| g[ch]);
            let b = beta.map_or(0.0, |b| b[ch]);
            let plane = &mut sample[ch * hw..(ch + 1) * hw];
            match (cache.is_empty(), relu) {
                (true, false) => normalize(plane, mu, is, g, b),
                (true, true) => normalize_relu(plane, mu, is, g, b),
                (false, false) => normalize_keep(plane, &mut cache[ch * hw..(ch + 1) * hw], mu, is, g, b),
                (false, true) => normalize_keep_relu(plane, &mut cache[ch * hw..(ch + 1) * hw], mu, is, g, b),
            }
        }
    };
    match xhat {
        Some(xhat) => par::for_each(x.par_chunks_mut(per).zip(xhat.par_chunks_mut(per)), |(s, xh)| write(s, xh)),
        None => par::for_each(x.par_chunks_mut(per), |s| write(s, &mut [])),
    }
}

/// Each channel's (Σ dout, Σ dout·x̂) over dout, xhat: (N, C, HW), in f64, the planes'
/// sums added in sample order from 0: of the gradient the ReLU passes back when `after`
/// is [`Activation::Relu`] (its mask recomputed from x̂, gamma and beta: (C) or none).
/// What a synchronized layer hands the exchange in backward.
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_backward_sums(
    dout: &[f32],
    xhat: &[f32],
    gamma: Option<&[f32]>,
    beta: Option<&[f32]>,
    after: Activation,
    n: usize,
    c: usize,
    hw: usize,
) -> Vec<(f64, f64)> {
    let affine = |ch: usize| (gamma.map_or(1.0, |g| g[ch]), beta.map_or(0.0, |b| b[ch]));
    per_channel(n, c, |(sd, sdx): &mut (f64, f64), s, ch| {
        let r = (s * c + ch) * hw..(s * c + ch + 1) * hw;
        let (a, b) = match after {
            Activation::Linear => sums_dy_dyx(&dout[r.clone()], &xhat[r]),
            Activation::Relu => {
                let (g, b) = affine(ch);
                sums_dy_dyx_relu(&dout[r.clone()], &xhat[r], g, b)
            }
        };
        *sd += a;
        *sdx += b;
    })
}

/// dγ += Σ dout·x̂ and dβ += Σ dout, per channel (C each, ACCUMULATED, each sum rounded to
/// f32 once), from the per-channel `sums` of [`batchnorm_backward_sums`]; dgamma and
/// dbeta where the layer has γ and β.
pub fn batchnorm_param_grads(sums: &[(f64, f64)], dgamma: Option<&mut [f32]>, dbeta: Option<&mut [f32]>) {
    if let Some(dgamma) = dgamma {
        for (g, &(_, sdx)) in dgamma.iter_mut().zip(sums) {
            *g += sdx as f32;
        }
    }
    if let Some(dbeta) = dbeta {
        for (g, &(sd, _)) in dbeta.iter_mut().zip(sums) {
            *g += sd as f32;
        }
    }
}

/// The input gradient, in place of dout: (N, C, HW) (WRITTEN):
/// dx = γ·invstd·(dout − mean(dout) − x̂·mean(dout·x̂)), the means the per-channel `sums`
/// (C) over `count` values per channel (a synchronized layer's: the global batch's), of
/// the gradient the ReLU passes back when `after` is [`Activation::Relu`]. xhat:
/// (N, C, HW); invstd: (C); gamma, beta: (C) or none.
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_input_grad(
    dout: &mut [f32],
    xhat: &[f32],
    sums: &[(f64, f64)],
    invstd: &[f32],
    count: f64,
    gamma: Option<&[f32]>,
    beta: Option<&[f32]>,
    after: Activation,
    c: usize,
    hw: usize,
) {
    let m = count;
    let affine = |ch: usize| (gamma.map_or(1.0, |g| g[ch]), beta.map_or(0.0, |b| b[ch]));
    let coef: Vec<(f32, f32, f32)> = sums
        .iter()
        .enumerate()
        .map(|(ch, &(sd, sdx))| (gamma.map_or(1.0, |g| g[ch]) * invstd[ch], (sd / m) as f32, (sdx / m) as f32))
        .collect();
    par::for_each(dout.par_chunks_mut(c * hw).zip(xhat.par_chunks(c * hw)), |(dsample, xsample)| {
        for (ch, (dplane, xplane)) in dsample.chunks_exact_mut(hw).zip(xsample.chunks_exact(hw)).enumerate() {
            let (k, md, mdx) = coef[ch];
            match after {
                Activation::Linear => input_grad_plane(dplane, xplane, k, md, mdx),
                Activation::Relu => {
                    let (g, b) = affine(ch);
                    input_grad_plane_relu(dplane, xplane, k, md, mdx, g, b)
                }
            }
        }
    });
}

/// How a training forward moves the running statistics, the one definition for every
/// backend: `running ← keep·running + take·batch` (Keras's momentum: `keep = momentum`,
/// `take = 1 − momentum`), the batch variance unbiased by `unbias = M/(M − 1)` for
/// `running_var` (PyTorch's convention; the biased one when M = 1), M = N·H·W values per
/// channel. The CPU blends its f64 batch moments with these in f64; the CUDA kernel
/// (`batchnorm_train_fwd_f32`) is handed the same three numbers rounded to f32 and blends
/// its f32 block sums: that accumulation width is the one place the two differ (an f64
/// block reduction would run at a 64th of the speed on most GPUs), and the kernel's host
/// check (`super::gpu::host_check`) holds it to this file within 1e-5 relative.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunningUpdate {
    pub keep: f64,
    pub take: f64,
    pub unbias: f64,
}

impl RunningUpdate {
    /// The update of a batch of `m` values per channel at Keras momentum `momentum`.
    pub fn new(momentum: f32, m: usize) -> RunningUpdate {
        let keep = momentum as f64;
        RunningUpdate { keep, take: 1.0 - keep, unbias: if m > 1 { m as f64 / (m as f64 - 1.0) } else { 1.0 } }
    }

    /// The new running mean from the batch mean.
    pub fn mean(&self, running: f32, batch_mean: f64) -> f32 {
        (self.keep * running as f64 + self.take * batch_mean) as f32
    }

    /// The new running variance from the BIASED batch variance.
    pub fn var(&self, running: f32, batch_var: f64) -> f32 {
        (self.keep * running as f64 + self.take * batch_var * self.unbias) as f32
    }
}

/// What normalises a channel whose batch has mean `mean` and BIASED variance `var`
/// (both in f64): (mean, 1/sqrt(var + eps)), each rounded to f32 once. The one definition
/// for the CPU and a GPU replica's synchronized layer.
pub fn normaliser(mean: f64, var: f64, eps: f32) -> (f32, f32) {
    (mean as f32, (1.0 / (var + eps as f64).sqrt()) as f32)
}

/// A training forward's `num_batches_tracked`: its old value rounded back to an integer
/// (the average over logical replicas multiplies by 1/R, off by an ulp for some R and
/// counts), plus one; `batchnorm_count_fwd_f32` computes the same.
pub fn count_up(tracked: f32) -> f32 {
    tracked.round_ties_even() + 1.0
}

widest! {
    /// Σ v in f64, with eight independent accumulators (vectorised at the processor's
    /// widest vectors, `backend::simd`; the order is fixed by the length alone).
    fn sum_f64(v: &[f32]) -> f64 {
        let mut acc = [0.0f64; 8];
        let chunks = v.chunks_exact(8);
        let tail: f64 = chunks.remainder().iter().map(|&x| x as f64).sum();
        for c in chunks {
            for (a, &x) in acc.iter_mut().zip(c) {
                *a += x as f64;
            }
        }
        acc.iter().sum::<f64>() + tail
    }
}

widest! {
    /// Σ (v − m)² in f64, as [`sum_f64`].
    fn sum_sq_dev_f64(v: &[f32], m: f64) -> f64 {
        let mut acc = [0.0f64; 8];
        let chunks = v.chunks_exact(8);
        let tail: f64 = chunks.remainder().iter().map(|&x| (x as f64 - m) * (x as f64 - m)).sum();
        for c in chunks {
            for (a, &x) in acc.iter_mut().zip(c) {
                let d = x as f64 - m;
                *a += d * d;
            }
        }
        acc.iter().sum::<f64>() + tail
    }
}

/// Σ term(dᵢ, x̂ᵢ) in f64 in [`sum_f64`]'s order (eight accumulators, i mod 8, added in
/// order, then the tail): the backward's sums, each its own loop over a plane, not one loop
/// for two sums, so that each runs in vectors across its accumulators (the plane is in L1
/// for the second). Inlined into `widest!` kernels, which compile it for their vectors.
#[inline(always)]
fn sum_pairs_f64(d: &[f32], xh: &[f32], term: impl Fn(f32, f32) -> f64) -> f64 {
    let mut acc = [0.0f64; 8];
    let (dc, xc) = (d.chunks_exact(8), xh.chunks_exact(8));
    let tail: f64 = dc.remainder().iter().zip(xc.remainder()).map(|(&v, &x)| term(v, x)).sum();
    for (dd, xx) in dc.zip(xc) {
        for k in 0..8 {
            acc[k] += term(dd[k], xx[k]);
        }
    }
    acc.iter().sum::<f64>() + tail
}

widest! {
    /// Σ d·x̂ in f64.
    fn sum_prod_f64(d: &[f32], xh: &[f32]) -> f64 {
        sum_pairs_f64(d, xh, |v, x| v as f64 * x as f64)
    }
}

/// (Σ d, Σ d·x̂) in f64.
fn sums_dy_dyx(d: &[f32], xh: &[f32]) -> (f64, f64) {
    (sum_f64(d), sum_prod_f64(d, xh))
}

widest! {
    /// One plane of the evaluation forward: y = (x − mean)·invstd·γ + β, in place.
    fn normalize(plane: &mut [f32], mu: f32, is: f32, g: f32, b: f32) {
        for v in plane {
            *v = (*v - mu) * is * g + b;
        }
    }
}

widest! {
    /// One plane of the training forward: x̂ = (x − mean)·invstd into `cache`, y = γ·x̂ + β
    /// in place.
    fn normalize_keep(plane: &mut [f32], cache: &mut [f32], mu: f32, is: f32, g: f32, b: f32) {
        for (v, xh) in plane.iter_mut().zip(cache) {
            *xh = (*v - mu) * is;
            *v = *xh * g + b;
        }
    }
}

// The ReLU after the layer, in its passes (`Layer::take_following_relu`): the forward
// clamps y = γ·x̂ + β as the ReLU would (`y < 0` is false for NaN, which passes), and the
// backward reads dout where y > 0 and 0 elsewhere, the ReLU's mask recomputed from x̂ by
// the forward's own two roundings: the same bits as the two layers one after the other.

/// y = γ·x̂ + β, clamped at 0 as the ReLU clamps.
#[inline(always)]
pub(super) fn relu_of(y: f32) -> f32 {
    if y < 0.0 {
        0.0
    } else {
        y
    }
}

/// dout where the ReLU's input y = γ·x̂ + β was positive, +0 elsewhere (the ReLU's
/// backward), selected by a mask of bits so that the loops stay vectors.
#[inline(always)]
fn relu_masked(d: f32, xh: f32, g: f32, b: f32) -> f32 {
    let keep = if xh * g + b > 0.0 { u32::MAX } else { 0 };
    f32::from_bits(d.to_bits() & keep)
}

widest! {
    /// [`normalize`], then the ReLU.
    fn normalize_relu(plane: &mut [f32], mu: f32, is: f32, g: f32, b: f32) {
        for v in plane {
            *v = relu_of((*v - mu) * is * g + b);
        }
    }
}

widest! {
    /// [`normalize_keep`], then the ReLU.
    fn normalize_keep_relu(plane: &mut [f32], cache: &mut [f32], mu: f32, is: f32, g: f32, b: f32) {
        for (v, xh) in plane.iter_mut().zip(cache) {
            *xh = (*v - mu) * is;
            *v = relu_of(*xh * g + b);
        }
    }
}

widest! {
    /// Σ d in f64 of the gradient the ReLU passes back.
    fn sum_f64_relu(d: &[f32], xh: &[f32], g: f32, b: f32) -> f64 {
        sum_pairs_f64(d, xh, |v, x| relu_masked(v, x, g, b) as f64)
    }
}

widest! {
    /// Σ d·x̂ in f64 of the gradient the ReLU passes back.
    fn sum_prod_f64_relu(d: &[f32], xh: &[f32], g: f32, b: f32) -> f64 {
        sum_pairs_f64(d, xh, |v, x| relu_masked(v, x, g, b) as f64 * x as f64)
    }
}

/// [`sums_dy_dyx`] of the gradient the ReLU passes back.
fn sums_dy_dyx_relu(d: &[f32], xh: &[f32], g: f32, b: f32) -> (f64, f64) {
    (sum_f64_relu(d, xh, g, b), sum_prod_f64_relu(d, xh, g, b))
}

widest! {
    /// [`input_grad_plane`] of the gradient the ReLU passes back.
    fn input_grad_plane_relu(dplane: &mut [f32], xplane: &[f32], k: f32, md: f32, mdx: f32, g: f32, b: f32) {
        for (d, &xh) in dplane.iter_mut().zip(xplane) {
            *d = k * (relu_masked(*d, xh, g, b) - md - xh * mdx);
        }
    }
}

widest! {
    /// One plane of the input gradient: dx = k·(dout − mean(dout) − x̂·mean(dout·x̂)), in
    /// place of dout.
    fn input_grad_plane(dplane: &mut [f32], xplane: &[f32], k: f32, md: f32, mdx: f32) {
        for (d, &xh) in dplane.iter_mut().zip(xplane) {
            *d = k * (*d - md - xh * mdx);
        }
    }
}

/// Per-channel folds over the planes of (N, C, H·W) values: for every channel ch,
/// `visit(acc_ch, s, ch)` for s = 0, 1, …, N − 1, in that order, which fixes each
/// channel's sums whatever the threads. The channels are cut into one block per thread of
/// the device's pool, and a block visits its planes in memory order (sample by sample, its
/// channels within each): a thread streams through the tensor instead of hopping C·H·W
/// values from plane to plane, which left the hardware's prefetchers cold at every plane
/// (the sums are memory-bound: `resnet8`'s stage-one tensors are 3.2 MB a device).
fn per_channel<A, F>(n: usize, c: usize, visit: F) -> Vec<A>
where
    A: Default + Send,
    F: Fn(&mut A, usize, usize) + Sync + Send,
{
    let per = c.div_ceil(par::threads().clamp(1, c.max(1)));
    let blocks = par::map_collect((0..c.div_ceil(per.max(1))).into_par_iter(), |b| {
        let channels = b * per..((b + 1) * per).min(c);
        let mut acc: Vec<A> = channels.clone().map(|_| A::default()).collect();
        for s in 0..n {
            for (a, ch) in acc.iter_mut().zip(channels.clone()) {
                visit(a, s, ch);
            }
        }
        acc
    });
    blocks.into_iter().flatten().collect()
}

/// Count, mean and sum of squared deviations of some values, merged pairwise (Chan,
/// Golub, LeVeque 1979): merging in a fixed order gives fixed numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Moments {
    count: f64,
    mean: f64,
    m2: f64,
}

impl Moments {
    /// Adds `b`'s values to these. Merging into nothing takes `b` as it is (so that one
    /// shard's moments are exactly its own).
    fn merge(&mut self, b: &Moments) {
        if b.count == 0.0 {
            return;
        }
        if self.count == 0.0 {
            *self = *b;
            return;
        }
        let (delta, total) = (b.mean - self.mean, self.count + b.count);
        self.mean += delta * b.count / total;
        self.m2 += b.m2 + delta * delta * self.count * b.count / total;
        self.count = total;
    }
}

/// The global batch's count and per-channel (mean, M2), from this shard's `count` values
/// per channel and per-channel (mean, M2) `local`: every logical replica's payload
/// `[count, mean₀, M2₀, mean₁, M2₁, ...]` gathered, and merged in replica order.
pub fn global_moments(
    ex: &dyn StatsExchange,
    shard: usize,
    count: f64,
    local: &[(f64, f64)],
) -> Result<(f64, Vec<(f64, f64)>)> {
    let mut mine = Vec::with_capacity(1 + 2 * local.len());
    mine.push(count);
    mine.extend(local.iter().flat_map(|&(mean, m2)| [mean, m2]));
    let mut all = Vec::new();
    ex.all_gather(shard, &mine, &mut all)?;
    let mut merged = vec![Moments::default(); local.len()];
    for payload in all.chunks_exact(mine.len()) {
        for (acc, mm) in merged.iter_mut().zip(payload[1..].chunks_exact(2)) {
            acc.merge(&Moments { count: payload[0], mean: mm[0], m2: mm[1] });
        }
    }
    let total = merged.first().map_or(0.0, |m| m.count);
    Ok((total, merged.into_iter().map(|m| (m.mean, m.m2)).collect()))
}

/// The global batch's per-channel (Σ dy, Σ dy·x̂): every logical replica's `[Σ dy₀,
/// Σ dy·x̂₀, ...]` gathered and summed in replica order, in f64.
pub fn global_sums(ex: &dyn StatsExchange, shard: usize, local: &[(f64, f64)]) -> Result<Vec<(f64, f64)>> {
    let mine: Vec<f64> = local.iter().flat_map(|&(a, b)| [a, b]).collect();
    let mut all = Vec::new();
    ex.all_gather(shard, &mine, &mut all)?;
    // Summed from the first payload on (not from 0.0), so that one replica's sums are
    // exactly its own, −0.0 included.
    let mut payloads = all.chunks_exact(mine.len().max(1));
    let first = payloads.next().unwrap_or(&[]);
    let mut sums: Vec<(f64, f64)> = first.chunks_exact(2).map(|ab| (ab[0], ab[1])).collect();
    for payload in payloads {
        for (acc, ab) in sums.iter_mut().zip(payload.chunks_exact(2)) {
            acc.0 += ab[0];
            acc.1 += ab[1];
        }
    }
    sums.resize(local.len(), (0.0, 0.0));
    Ok(sums)
}
