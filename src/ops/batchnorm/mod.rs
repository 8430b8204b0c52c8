//! BatchNorm2d with Keras's options: `scale` (a learned γ) and `center` (a learned β).
//!
//! Training normalises with the statistics of the batch the layer sees, over (N, H, W)
//! with the BIASED variance, and updates the running statistics Keras-style,
//! r ← momentum·r + (1 − momentum)·batch, using the UNBIASED variance for `running_var`
//! (PyTorch's convention, which the reference cases follow). Evaluation uses the running
//! statistics. With logical replicas, "the batch the layer sees" is the logical
//! replica's shard, as in DDP without SyncBatchNorm; the trainer then averages the
//! running statistics over the logical replicas so every replica holds the same buffers.
//!
//! Synchronized ([`BatchStats::Global`], Keras's `synchronized=True`, PyTorch's
//! `SyncBatchNorm`, `--sync-batchnorm`): the batch is the global batch of the step, every
//! logical replica's shard together. Forward: each shard's per-channel (count, mean, M2)
//! in f64 (the same Chan et al. merge of planes as the shard statistics), gathered from
//! every logical replica through the context's statistics exchange
//! (`ops::batchnorm::stats`) and merged in logical-replica order with the same pairwise
//! update — as stable as two passes, and the same numbers on every replica, in the same
//! order whoever computed which shard. The running statistics move with the global
//! statistics (the variance unbiased by the global count), so every shard's slot holds
//! the same buffers. Backward: each shard's (Σ dy, Σ dy·x̂) gathered and summed in
//! logical-replica order, in f64; dx uses those global sums over the global count, while
//! dγ, dβ receive the shard's own sums (the gradient exchange adds the shards'). Without
//! an exchange in the context (a lone Sequential, a world of one) a synchronized layer is
//! an ordinary one. Every logical replica makes the same calls: an empty shard sends
//! zeros ([`Synchronized::without_data`], which the training step calls).
//!
//! A GPU replica computes its shard's partial statistics on the device, with this
//! layer's arithmetic mirrored operation for operation (kernels/batchnorm.cu, held to
//! this file bit for bit by tests/kernels_host.rs), and merges them through
//! [`Synchronized`]: the functions below, the one implementation of the merges, of the
//! running update ([`RunningUpdate`]) and of what normalises ([`normaliser`]).
//!
//! Owns also its spec entry (`batch_normalization`), its spec form, what it keeps for
//! backward, its synchronized twin ([`convert_sync_batchnorm`]) and the list of a model's
//! synchronized layers, found through [`Layer::synchronized_channels`].

#[cfg(feature = "cuda")]
pub mod gpu;

use rayon::prelude::*;

use serde_json::{json, Value};

use super::spec::{expect_images, Build, LayerType};
pub mod stats;

use super::{Ctx, Init, InputGrad, Layer, LayerMemory, LayerShapes, Mode, ParamSpec, Params, ParamsMut, F32};
use crate::backend::par;
use crate::backend::simd::widest;
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};
use stats::StatsExchange;

/// Whose batch statistics normalise in training.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchStats {
    /// The logical replica's shard (DDP's BatchNorm).
    Shard,
    /// The step's global batch, across every logical replica (SyncBatchNorm).
    Global,
}

/// How a training forward moves the running statistics, the one definition for every
/// backend: `running ← keep·running + take·batch` (Keras's momentum: `keep = momentum`,
/// `take = 1 − momentum`), the batch variance unbiased by `unbias = M/(M − 1)` for
/// `running_var` (PyTorch's convention; the biased one when M = 1), M = N·H·W values per
/// channel. The CPU layer blends its f64 batch moments with these in f64; the CUDA kernel
/// (`batchnorm_train_fwd_f32`) is handed the same three numbers rounded to f32 and blends
/// its f32 block sums: that accumulation width is the one place the two differ (an f64
/// block reduction would run at a 64th of the speed on most GPUs), and
/// tests/kernels_host.rs holds the kernel to this layer within 1e-5 relative.
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
/// for the CPU layer and a GPU replica's synchronized layer.
pub fn normaliser(mean: f64, var: f64, eps: f32) -> (f32, f32) {
    (mean as f32, (1.0 / (var + eps as f64).sqrt()) as f32)
}

/// Whose names a BatchNorm's tensors carry, with what that brings.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BnNames {
    /// Keras's: `gamma`, `beta`, `running_mean`, `running_var`.
    Keras,
    /// PyTorch's `BatchNorm2d` `state_dict`: `weight`, `bias`, `running_mean`,
    /// `running_var` and `num_batches_tracked`, the count of training forwards (which
    /// every training forward increments; averaged over the logical replicas like the
    /// other buffers, it is rounded back to its integer first).
    PyTorch,
}

impl BnNames {
    /// The spec's name: `keras` or `pytorch`.
    pub fn name(self) -> &'static str {
        match self {
            BnNames::Keras => "keras",
            BnNames::PyTorch => "pytorch",
        }
    }
}

/// A training forward's `num_batches_tracked`: its old value rounded back to an integer
/// (the average over logical replicas multiplies by 1/R, off by an ulp for some R and
/// counts), plus one; `batchnorm_count_fwd_f32` computes the same.
pub fn count_up(tracked: f32) -> f32 {
    tracked.round_ties_even() + 1.0
}

/// Batch normalisation over the channels of NCHW activations.
#[derive(Clone, Debug)]
pub struct BatchNorm2d {
    channels: usize,
    names: BnNames,
    eps: f32,
    momentum: f32,
    scale: bool,
    center: bool,
    stats: BatchStats,
    /// x̂: (N, C, H, W) and 1/sqrt(var + eps): (C), from the training forward. The
    /// vectors keep their capacity from step to step.
    xhat: Vec<f32>,
    invstd: Vec<f32>,
    /// Values per channel the training forward normalised over (the global batch's, for
    /// a synchronized layer).
    count: f64,
    cached: Option<Shape>,
    /// Whether the ReLU after this layer runs in its passes (its Sequential says so:
    /// [`Layer::take_following_relu`]).
    relu: bool,
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

// The ReLU after the layer, in its passes ([`Layer::take_following_relu`]): the forward
// clamps y = γ·x̂ + β as the ReLU would (`y < 0` is false for NaN, which passes), and the
// backward reads dout where y > 0 and 0 elsewhere, the ReLU's mask recomputed from x̂ by
// the forward's own two roundings: the same bits as the two layers one after the other.

/// y = γ·x̂ + β, clamped at 0 as the ReLU clamps.
#[inline(always)]
fn relu_of(y: f32) -> f32 {
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

impl BatchNorm2d {
    /// Keras defaults: eps 1e-3, momentum 0.99, `scale` and `center` on.
    pub fn new(channels: usize) -> BatchNorm2d {
        BatchNorm2d {
            channels,
            names: BnNames::Keras,
            eps: 1e-3,
            momentum: 0.99,
            scale: true,
            center: true,
            stats: BatchStats::Shard,
            xhat: Vec::new(),
            invstd: Vec::new(),
            count: 0.0,
            cached: None,
            relu: false,
        }
    }

    /// PyTorch's `nn.BatchNorm2d(channels)`: eps 1e-5, momentum 0.1 (Keras's 0.9), its
    /// tensors named as its `state_dict` names them.
    pub fn pytorch(channels: usize) -> BatchNorm2d {
        BatchNorm2d::new(channels).eps(1e-5).momentum(0.9).names(BnNames::PyTorch)
    }

    /// Whose names the tensors carry.
    pub fn names(mut self, names: BnNames) -> Self {
        self.names = names;
        self
    }

    /// Whose batch statistics normalise in training (Keras's `synchronized`).
    pub fn batch_stats(mut self, stats: BatchStats) -> Self {
        self.stats = stats;
        self
    }

    /// Sets eps (added to the variance).
    pub fn eps(mut self, eps: f32) -> Self {
        self.eps = eps;
        self
    }

    /// Sets the Keras momentum (the weight of the old running value).
    pub fn momentum(mut self, momentum: f32) -> Self {
        self.momentum = momentum;
        self
    }

    /// Keras `scale`: learn γ.
    pub fn scale(mut self, on: bool) -> Self {
        self.scale = on;
        self
    }

    /// Keras `center`: learn β.
    pub fn center(mut self, on: bool) -> Self {
        self.center = on;
        self
    }

    /// The spec entry: Keras's `BatchNormalization(scale=True, center=True, epsilon=1e-3,
    /// momentum=0.99, synchronized=False)`, its channels those of the running shape.
    pub const SPEC: LayerType = LayerType {
        name: "batch_normalization",
        fields: "`scale` (true), `center` (true), `epsilon` (0.001), `momentum` (0.99), `synchronized` (false), `names` (\"keras\": gamma, beta; or \"pytorch\": weight, bias, num_batches_tracked)",
        example: (
            &[3, 4, 4],
            r#"{"type": "batch_normalization", "scale": false, "epsilon": 0.01, "momentum": 0.9, "synchronized": true, "names": "pytorch"}"#,
        ),
        parse: |f| {
            let scale = f.boolean("scale", true)?;
            let center = f.boolean("center", true)?;
            let epsilon = f.number("epsilon", Some(1e-3), (|x| x > 0.0, "a positive number"))?;
            let momentum = f.number("momentum", Some(0.99), (|x| (0.0..=1.0).contains(&x), "a number in [0, 1]"))?;
            let stats = if f.boolean("synchronized", false)? { BatchStats::Global } else { BatchStats::Shard };
            let names = f.choice("names", &[BnNames::Keras, BnNames::PyTorch], BnNames::name)?;
            Ok(Build::layer(move |input| {
                let bn = BatchNorm2d::new(expect_images(input)?).scale(scale).center(center).names(names);
                Ok(bn.eps(epsilon).momentum(momentum).batch_stats(stats))
            }))
        },
        #[cfg(feature = "cuda")]
        kernels: Some(&gpu::KERNELS),
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Values,
            #[cfg(feature = "cuda")]
            host: None,
        },
    };

    fn gamma_beta<'a>(&self, params: &Params<'a>) -> (Option<&'a [f32]>, Option<&'a [f32]>) {
        let gamma = self.scale.then(|| params.get(0));
        let beta = self.center.then(|| params.get(usize::from(self.scale)));
        (gamma, beta)
    }
}

impl Layer for BatchNorm2d {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "bn"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({
            "type": "batch_normalization", "scale": self.scale, "center": self.center, "epsilon": self.eps,
            "momentum": self.momentum, "synchronized": self.stats == BatchStats::Global, "names": self.names.name(),
        }))
    }

    /// Its normalised input x̂, as f32 (the per-channel 1/σ is too small to count).
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory { kept_per_sample: (shapes.output.numel() as u64).saturating_mul(F32), ..LayerMemory::NONE })
    }

    /// The same layer, its statistics the global batch's (a fresh one: no cache).
    fn synchronized(&self) -> Option<Box<dyn Layer>> {
        let bn = BatchNorm2d::new(self.channels).eps(self.eps).momentum(self.momentum).names(self.names);
        Some(Box::new(bn.scale(self.scale).center(self.center).batch_stats(BatchStats::Global)))
    }

    fn synchronized_channels(&self) -> Vec<usize> {
        if self.stats == BatchStats::Global {
            vec![self.channels]
        } else {
            Vec::new()
        }
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (_, c, _, _) = input.nchw("BatchNorm2d")?;
        if c != self.channels {
            return Err(Error::shape("BatchNorm2d", format!("expected {} channels, got {input}", self.channels)));
        }
        Ok(input.clone())
    }

    fn params(&self) -> Vec<ParamSpec> {
        let shape = Shape::new([self.channels]);
        let mut p = Vec::new();
        let (gamma, beta) = match self.names {
            BnNames::Keras => ("gamma", "beta"),
            BnNames::PyTorch => ("weight", "bias"),
        };
        if self.scale {
            p.push(ParamSpec { name: gamma.into(), shape: shape.clone(), init: Init::Ones });
        }
        if self.center {
            p.push(ParamSpec { name: beta.into(), shape, init: Init::Zeros });
        }
        p
    }

    fn buffers(&self) -> Vec<ParamSpec> {
        let shape = Shape::new([self.channels]);
        let mut b = vec![
            ParamSpec { name: "running_mean".into(), shape: shape.clone(), init: Init::Zeros },
            ParamSpec { name: "running_var".into(), shape, init: Init::Ones },
        ];
        if self.names == BnNames::PyTorch {
            b.push(ParamSpec { name: "num_batches_tracked".into(), shape: Shape::new([0usize; 0]), init: Init::Count });
        }
        b
    }

    // x: (N, C, H, W) → y: (N, C, H, W)
    fn forward(&mut self, mut x: Tensor, params: Params<'_>, mut buffers: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (n, c, h, w) = x.shape().nchw("BatchNorm2d")?;
        self.output_shape(x.shape())?;
        let hw = h * w;
        let m = n * hw;
        let (gamma, beta) = self.gamma_beta(&params);
        let (mean, invstd): (Vec<f32>, Vec<f32>) = match ctx.mode {
            Mode::Train => {
                let sync = self.stats == BatchStats::Global;
                if m < 2 && !sync {
                    // As PyTorch: one value per channel has no variance to normalise by.
                    return Err(Error::shape(
                        "BatchNorm2d",
                        format!("training needs more than one value per channel, got {}", x.shape()),
                    ));
                }
                let xs = x.host();
                // Each plane is read from memory once: its mean and squared deviations are
                // taken while it is in L1, and planes are merged in sample order with Chan
                // et al.'s pairwise update (as stable as two passes).
                let moments = per_channel(n, c, |acc: &mut Moments, s, ch| {
                    let p = &xs[(s * c + ch) * hw..(s * c + ch + 1) * hw];
                    let (k, pm) = (p.len() as f64, sum_f64(p) / p.len() as f64);
                    acc.merge(&Moments { count: k, mean: pm, m2: sum_sq_dev_f64(p, pm) });
                });
                let local: Vec<(f64, f64)> = moments.iter().map(|m| (m.mean, m.m2)).collect();
                let (count, moments) = match (sync, ctx.stats) {
                    (true, Some(ex)) => global_moments(ex, ctx.shard, m as f64, &local)?,
                    _ => (m as f64, local),
                };
                if count < 2.0 {
                    return Err(Error::shape(
                        "BatchNorm2d",
                        format!(
                            "training needs more than one value per channel, got {count} in the global batch ({} here)",
                            x.shape()
                        ),
                    ));
                }
                self.count = count;
                let stats: Vec<(f64, f64)> = moments.iter().map(|&(mean, m2)| (mean, m2 / count)).collect();
                let update = RunningUpdate::new(self.momentum, count as usize);
                let (rm, rv) = buffers.pair(0, 1);
                for ((&(mean, var), r_mean), r_var) in stats.iter().zip(rm.iter_mut()).zip(rv.iter_mut()) {
                    *r_mean = update.mean(*r_mean, mean);
                    *r_var = update.var(*r_var, var);
                }
                if self.names == BnNames::PyTorch {
                    let tracked = &mut buffers.get(2)[0];
                    *tracked = count_up(*tracked);
                }
                stats.iter().map(|&(mean, var)| normaliser(mean, var, self.eps)).unzip()
            }
            Mode::Eval => {
                let (rm, rv) = buffers.pair(0, 1);
                (rm.to_vec(), rv.iter().map(|&v| 1.0 / (v + self.eps).sqrt()).collect())
            }
        };
        // One pass: x̂ = (x − mean)·invstd (kept for backward in training), y = γ·x̂ + β.
        let train = ctx.mode == Mode::Train;
        if train {
            self.xhat.resize(x.numel(), 0.0);
        }
        let xhat: &mut [f32] = if train { &mut self.xhat } else { &mut [] };
        let per = c * hw;
        let write = |sample: &mut [f32], cache: &mut [f32]| {
            for ch in 0..c {
                let (mu, is) = (mean[ch], invstd[ch]);
                let g = gamma.map_or(1.0, |g| g[ch]);
                let b = beta.map_or(0.0, |b| b[ch]);
                let plane = &mut sample[ch * hw..(ch + 1) * hw];
                match (cache.is_empty(), self.relu) {
                    (true, false) => normalize(plane, mu, is, g, b),
                    (true, true) => normalize_relu(plane, mu, is, g, b),
                    (false, false) => normalize_keep(plane, &mut cache[ch * hw..(ch + 1) * hw], mu, is, g, b),
                    (false, true) => normalize_keep_relu(plane, &mut cache[ch * hw..(ch + 1) * hw], mu, is, g, b),
                }
            }
        };
        if train {
            par::for_each(x.host_mut().par_chunks_mut(per).zip(xhat.par_chunks_mut(per)), |(s, xh)| write(s, xh));
            self.invstd = invstd;
            self.cached = Some(x.shape().clone());
        } else {
            par::for_each(x.host_mut().par_chunks_mut(per), |s| write(s, &mut []));
        }
        Ok(x)
    }

    // dout: (N, C, H, W) → dx = γ·invstd·(dout − mean(dout) − x̂·mean(dout·x̂));
    // dγ += Σ dout·x̂, dβ += Σ dout (sums over N, H, W)
    fn backward(
        &mut self,
        mut dout: Tensor,
        params: Params<'_>,
        mut dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let shape = self
            .cached
            .take()
            .ok_or_else(|| Error::config("BatchNorm2d backward", "no training forward to differentiate"))?;
        if dout.shape() != &shape {
            return Err(Error::shape("BatchNorm2d backward", format!("dout {} for input {shape}", dout.shape())));
        }
        let (n, c, h, w) = shape.nchw("BatchNorm2d backward")?;
        let invstd = &self.invstd;
        let hw = h * w;
        let m = self.count;
        let (xs, ds) = (self.xhat.as_slice(), dout.host());
        let (gamma, beta) = self.gamma_beta(&params);
        let affine = |ch: usize| (gamma.map_or(1.0, |g| g[ch]), beta.map_or(0.0, |b| b[ch]));
        let relu = self.relu;
        let sums = per_channel(n, c, |(sd, sdx): &mut (f64, f64), s, ch| {
            let r = (s * c + ch) * hw..(s * c + ch + 1) * hw;
            let (a, b) = match relu {
                false => sums_dy_dyx(&ds[r.clone()], &xs[r]),
                true => {
                    let (g, b) = affine(ch);
                    sums_dy_dyx_relu(&ds[r.clone()], &xs[r], g, b)
                }
            };
            *sd += a;
            *sdx += b;
        });
        let mut i = 0;
        if self.scale {
            for (g, &(_, sdx)) in dparams.get(0).iter_mut().zip(&sums) {
                *g += sdx as f32;
            }
            i = 1;
        }
        if self.center {
            for (g, &(sd, _)) in dparams.get(i).iter_mut().zip(&sums) {
                *g += sd as f32;
            }
        }
        // dγ, dβ take the shard's own sums (above); dx needs the global batch's. The
        // exchange is made even when dx is not needed, so every replica calls alike.
        let sums = match (self.stats, ctx.stats) {
            (BatchStats::Global, Some(ex)) => global_sums(ex, ctx.shard, &sums)?,
            _ => sums,
        };
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        let coef: Vec<(f32, f32, f32)> = sums
            .iter()
            .enumerate()
            .map(|(ch, &(sd, sdx))| (gamma.map_or(1.0, |g| g[ch]) * invstd[ch], (sd / m) as f32, (sdx / m) as f32))
            .collect();
        par::for_each(dout.host_mut().par_chunks_mut(c * hw).zip(xs.par_chunks(c * hw)), |(dsample, xsample)| {
            for (ch, (dplane, xplane)) in dsample.chunks_exact_mut(hw).zip(xsample.chunks_exact(hw)).enumerate() {
                let (k, md, mdx) = coef[ch];
                match relu {
                    false => input_grad_plane(dplane, xplane, k, md, mdx),
                    true => {
                        let (g, b) = affine(ch);
                        input_grad_plane_relu(dplane, xplane, k, md, mdx, g, b)
                    }
                }
            }
        });
        Ok(Some(dout))
    }

    /// The ReLU after a BatchNorm runs in its passes: one pass of the training forward and
    /// one of the backward fewer over the activations.
    fn take_following_relu(&mut self, follows: bool) -> bool {
        self.relu = follows;
        follows
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(BatchNorm2d { xhat: Vec::new(), invstd: Vec::new(), count: 0.0, cached: None, ..self.clone() })
    }

    fn describe(&self) -> String {
        format!(
            "BatchNorm2d({}, eps {}, momentum {}{}{}{})",
            self.channels,
            self.eps,
            self.momentum,
            if self.scale { ", scale" } else { "" },
            if self.center { ", center" } else { "" },
            if self.stats == BatchStats::Global { ", synchronized" } else { "" }
        )
    }
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

/// Where a logical replica's synchronized BatchNorm layers meet the others', for a
/// backend that computes its shard's partial statistics itself (a GPU replica): the
/// statistics exchange and the logical replica. Its methods are this layer's own merges.
#[derive(Clone, Copy, Debug)]
pub struct Synchronized<'a> {
    pub stats: &'a dyn StatsExchange,
    /// The shard: this logical replica's index.
    pub shard: usize,
}

impl Synchronized<'_> {
    /// [`global_moments`] of this shard's `count` values per channel and per-channel
    /// (mean, M2) `local`.
    pub fn moments(&self, count: f64, local: &[(f64, f64)]) -> Result<(f64, Vec<(f64, f64)>)> {
        global_moments(self.stats, self.shard, count, local)
    }

    /// [`global_sums`] of this shard's per-channel (Σ dy, Σ dy·x̂) `local`.
    pub fn sums(&self, local: &[(f64, f64)]) -> Result<Vec<(f64, f64)>> {
        global_sums(self.stats, self.shard, local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::Sequential;
    use crate::tensor::Device;

    #[test]
    fn one_value_per_channel_cannot_be_normalised_in_training() {
        let mut m = Sequential::new([2, 1, 1], vec![Box::new(BatchNorm2d::new(2))]).unwrap();
        let mut st = m.init(0);
        let x = Tensor::from_vec(vec![1.0, 2.0], [1, 2, 1, 1]).unwrap();
        let e = m.forward(x.clone(), &st.params, &mut st.buffers, &Ctx::train(0, 0, 0, Device::Cpu(0))).unwrap_err();
        assert!(e.to_string().contains("more than one value per channel"), "{e}");
        // Evaluation uses the running statistics: fine with one value.
        assert!(m.forward(x, &st.params, &mut st.buffers, &Ctx::eval(Device::Cpu(0))).is_ok());
    }

    /// A BatchNorm followed by a ReLU in one Sequential runs the ReLU in its own passes
    /// (the ReLU layer is skipped): the output, the input gradient, the parameters'
    /// gradients and the running statistics are bit for bit those of the two layers one
    /// after the other, in training and in evaluation, with and without γ and β; a NaN
    /// passes the fused ReLU as it passes the layer.
    #[test]
    fn a_relu_after_a_batchnorm_runs_in_its_passes_with_the_same_bits() {
        use crate::nn::Relu;
        let (c, h, w) = (4, 5, 3);
        for (affine, n) in [(true, 3), (false, 3), (true, 1)] {
            let bn = || Box::new(BatchNorm2d::pytorch(c).scale(affine).center(affine)) as Box<dyn Layer>;
            let mut fused = Sequential::new([c, h, w], vec![bn(), Box::new(Relu::new())]).unwrap();
            let mut alone = Sequential::new([c, h, w], vec![bn()]).unwrap();
            let mut relu = Sequential::new([c, h, w], vec![Box::new(Relu::new())]).unwrap();
            let mut g = crate::rng::SplitMix64::new(7);
            let mut st = fused.init(0);
            // γ and β drawn around 0, so that about half of each channel's outputs clamp.
            st.params.iter_mut().for_each(|v| *v = g.next_f32() * 2.0 - 1.0);
            let mut st_alone = st.clone();
            let mut values = |len: usize| (0..len).map(|_| g.next_f32() * 4.0 - 2.0).collect::<Vec<f32>>();
            let x = Tensor::from_vec(values(n * c * h * w), [n, c, h, w]).unwrap();
            let dy = Tensor::from_vec(values(n * c * h * w), [n, c, h, w]).unwrap();
            let train = Ctx::train(0, 0, 0, Device::Cpu(0));
            fused.start_profile();

            let y = fused.forward(x.clone(), &st.params, &mut st.buffers, &train).unwrap();
            let y_alone = alone.forward(x.clone(), &st_alone.params, &mut st_alone.buffers, &train).unwrap();
            let y_alone = relu.forward(y_alone, &[], &mut [], &train).unwrap();
            assert_eq!(y.host(), y_alone.host(), "forward, affine {affine}, n {n}");
            assert!(y.host().contains(&0.0) && y.host().iter().any(|&v| v > 0.0), "some outputs clamp");
            assert_eq!(st.buffers, st_alone.buffers, "running statistics");

            let mut grads = vec![0.0; fused.params_len()];
            let dx = fused.backward_input(dy.clone(), &st.params, &mut grads, &train).unwrap();
            let mut grads_alone = vec![0.0; alone.params_len()];
            let d = relu.backward_input(dy, &[], &mut [], &train).unwrap();
            let dx_alone = alone.backward_input(d, &st_alone.params, &mut grads_alone, &train).unwrap();
            assert_eq!(dx.host(), dx_alone.host(), "input gradient, affine {affine}, n {n}");
            assert_eq!(grads, grads_alone, "parameter gradients, affine {affine}, n {n}");

            let eval = Ctx::eval(Device::Cpu(0));
            let y = fused.forward(x.clone(), &st.params, &mut st.buffers, &eval).unwrap();
            let y_alone = alone.forward(x, &st_alone.params, &mut st_alone.buffers, &eval).unwrap();
            assert_eq!(y.host(), relu.forward(y_alone, &[], &mut [], &eval).unwrap().host(), "evaluation");
            let rows = fused.profile();
            assert!(rows[1].description.ends_with("(in the previous layer's passes)"), "{:?}", rows[1]);
            assert_eq!(rows[1].forward + rows[1].backward, std::time::Duration::ZERO, "the ReLU layer itself ran");
        }
        assert!(relu_of(f32::NAN).is_nan() && relu_of(-0.5) == 0.0 && relu_of(0.5) == 0.5);
    }
}
