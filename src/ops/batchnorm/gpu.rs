//! BatchNorm on a GPU: the declaration of kernels/batchnorm.cu, the argument structs and
//! checked launches of its kernels, and the op's GPU form, per logical replica and
//! synchronized (whose statistics meet the other logical replicas' on the host, merged by
//! `super`'s functions).

use crate::cuda::launch::{channel_cfg, check_len, dim, elem_cfg, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{poll, Backward, Forward, GpuLayer, Node, Pass, SyncWith};
use crate::{Error, Result};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, PinnedHostSlice};
use std::sync::Arc;

use super::*;

crate::cuda::declare::kernels! {
    "batchnorm.cu" {
        batchnorm_train {
            fwd(
                x: In, y: Out, gamma: OptIn, beta: OptIn, running_mean: Out, running_var: Out, save_mean: Out,
                save_invstd: Out, n: I32, c: I32, hw: Size, keep: F32, take: F32, unbias: F32, eps: F32,
            );
            bwd(
                x: In, dy: In, dx: Out, gamma: OptIn, save_mean: In, save_invstd: In, dgamma: OptOut, dbeta: OptOut,
                n: I32, c: I32, hw: Size,
            );
        }
        batchnorm_eval {
            fwd(
                x: In, y: Out, gamma: OptIn, beta: OptIn, running_mean: In, running_var: In, c: I32, hw: Size,
                total: Size, eps: F32,
            );
        }
        batchnorm_moments {
            fwd(x: In, moments: OutF64, n: I32, c: I32, hw: Size);
        }
        batchnorm_sync {
            fwd(
                x: In, y: Out, gamma: OptIn, beta: OptIn, stats: InF64, running_mean: Out, running_var: Out,
                save_mean: Out, save_invstd: Out, c: I32, hw: Size, total: Size, keep: F64, take: F64, unbias: F64,
            );
            bwd(
                x: In, dy: In, dx: Out, gamma: OptIn, save_mean: In, save_invstd: In, local: InF64, global: InF64,
                dgamma: OptOut, dbeta: OptOut, c: I32, hw: Size, total: Size, count: F64,
            );
        }
        batchnorm_count {
            fwd(count: Out, n: Size);
        }
        batchnorm_sums {
            bwd(x: In, dy: In, save_mean: In, save_invstd: In, sums: OutF64, n: I32, c: I32, hw: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

/// Which of the optional BatchNorm parameters exist (Keras `scale` and `center`).
#[derive(Debug)]
pub struct BnParams<'a> {
    /// gamma: (C), None for `scale=False`.
    pub gamma: Option<CudaView<'a, f32>>,
    /// beta: (C), None for `center=False`.
    pub beta: Option<CudaView<'a, f32>>,
}

/// The geometry and constants of a BatchNorm pass over x: (N, C, H, W), hw = H·W.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BnGeom {
    pub n: usize,
    pub c: usize,
    pub hw: usize,
    pub eps: f32,
    /// Keras momentum (the weight of the old running value), from which the caller makes
    /// the training forward's [`BnUpdate`].
    pub momentum: f32,
}

/// How a training forward moves the running statistics: running = keep·running +
/// take·batch, the batch variance unbiased by `unbias` = m / (m − 1) for m values per
/// channel. The scalars of `ops::batchnorm::RunningUpdate`, the one place they are made
/// (the caller converts: nothing in `cuda` imports `nn`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BnUpdate {
    pub keep: f64,
    pub take: f64,
    pub unbias: f64,
}

impl BnUpdate {
    pub fn new(keep: f64, take: f64, unbias: f64) -> BnUpdate {
        BnUpdate { keep, take, unbias }
    }
}

/// The per-channel buffers a training forward writes, (C) each: the running statistics
/// (updated in place) and the batch's mean and 1/sqrt(var + eps) (saved for backward).
#[derive(Debug)]
pub struct BnStats<'a> {
    pub running_mean: CudaViewMut<'a, f32>,
    pub running_var: CudaViewMut<'a, f32>,
    pub save_mean: CudaViewMut<'a, f32>,
    pub save_invstd: CudaViewMut<'a, f32>,
}

/// The statistics a training forward saved for its backward, (C) each.
#[derive(Debug)]
pub struct BnSaved<'a> {
    pub mean: CudaView<'a, f32>,
    pub invstd: CudaView<'a, f32>,
}

/// What a BatchNorm backward writes: dx (N, C, H, W), and accumulates into: dgamma and
/// dbeta (C), present exactly when gamma and beta are.
#[derive(Debug)]
pub struct BnGrads<'a> {
    pub dx: CudaViewMut<'a, f32>,
    pub dgamma: Option<CudaViewMut<'a, f32>>,
    pub dbeta: Option<CudaViewMut<'a, f32>>,
}

/// What a synchronized BatchNorm's training forward normalises with.
#[derive(Debug)]
pub struct BnMerged<'a> {
    /// (C, 4) per channel, in f64: the global batch's mean and BIASED variance, and what
    /// normalises (`ops::batchnorm::normaliser`: the mean and 1/sqrt(var + eps) as f32).
    pub stats: CudaView<'a, f64>,
    /// The running statistics' update for the global batch's count.
    pub update: BnUpdate,
}

/// What a synchronized BatchNorm's training backward takes: the forward's saved
/// statistics and the per-channel sums.
#[derive(Debug)]
pub struct BnSums<'a> {
    /// From the forward (`batchnorm_sync_fwd`).
    pub saved: BnSaved<'a>,
    /// This shard's per-channel (Σ dy, Σ dy·x̂): (C, 2), f64.
    pub local: CudaView<'a, f64>,
    /// The global batch's: (C, 2), f64.
    pub global: CudaView<'a, f64>,
    /// Values per channel in the global batch.
    pub count: f64,
}

impl Gpu {
    fn check_bn_params(op: &'static str, p: &BnParams<'_>, c: usize) -> Result<()> {
        if let Some(g) = &p.gamma {
            check_len(op, "gamma", g, c)?;
        }
        if let Some(b) = &p.beta {
            check_len(op, "beta", b, c)?;
        }
        Ok(())
    }

    /// Training forward: batch statistics over (N, H, W), running stats moved by `update`
    /// (`ops::batchnorm::RunningUpdate` of g's momentum and N·H·W values, in f32 here).
    /// x, y: (N, C, H, W) with hw = H*W; every buffer of `stats`: (C)
    pub fn batchnorm_train_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        params: BnParams<'_>,
        stats: BnStats<'_>,
        g: BnGeom,
        update: BnUpdate,
    ) -> Result<()> {
        let BnGeom { n, c, hw, eps, .. } = g;
        let x = &x.view();
        let y = &mut y.view_mut();
        let BnStats { mut running_mean, mut running_var, mut save_mean, mut save_invstd } = stats;
        let op = "batchnorm_train_fwd";
        check_len(op, "x", x, n * c * hw)?;
        check_len(op, "y", y, n * c * hw)?;
        Self::check_bn_params(op, &params, c)?;
        for (what, buf) in [
            ("running_mean", &running_mean),
            ("running_var", &running_var),
            ("save_mean", &save_mean),
            ("save_invstd", &save_invstd),
        ] {
            check_len(op, what, buf, c)?;
        }
        if c == 0 {
            return Ok(());
        }
        let (ni, ci) = (dim(op, "N", n)?, dim(op, "C", c)?);
        let (keep, take, unbias) = (update.keep as f32, update.take as f32, update.unbias as f32);
        let (gamma, beta) = (params.gamma.as_ref(), params.beta.as_ref());
        // SAFETY: batchnorm_train_fwd_f32(const float* x, float* y, const float* gamma,
        // const float* beta, float* running_mean, float* running_var, float* save_mean,
        // float* save_invstd, int n, int c, size_t hw, float keep, float take, float
        // unbias, float eps); absent parameters are a 64-bit 0 the kernel tests for NULL;
        // every buffer length checked; grid = (C), REDUCE_BLOCK threads.
        unsafe {
            batchnorm_train::fwd(
                self,
                channel_cfg(ci),
                x,
                y,
                gamma,
                beta,
                &mut running_mean,
                &mut running_var,
                &mut save_mean,
                &mut save_invstd,
                ni,
                ci,
                hw,
                keep,
                take,
                unbias,
                eps,
            )
        }
    }

    /// num_batches_tracked of a training forward: rounded to its integer, plus one.
    /// count: (1)
    pub fn batchnorm_count(&self, count: &mut impl DevOut) -> Result<()> {
        let count = &mut count.view_mut();
        let n = count.len();
        check_len("batchnorm_count_fwd", "count", count, 1)?;
        // SAFETY: batchnorm_count_fwd_f32(float* count, size_t n); count holds n = 1
        // float (checked above), and the kernel touches indices < n only.
        unsafe { batchnorm_count::fwd(self, elem_cfg(n), count, n) }
    }

    /// Eval forward with the running statistics `running` = (mean, var).
    /// x, y: (N, C, H, W), hw = H*W; running mean and var: (C)
    pub fn batchnorm_eval_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        params: BnParams<'_>,
        running: (&impl DevIn, &impl DevIn),
        g: BnGeom,
    ) -> Result<()> {
        let BnGeom { n, c, hw, eps, .. } = g;
        let x = &x.view();
        let y = &mut y.view_mut();
        let running_mean = &running.0.view();
        let running_var = &running.1.view();
        let op = "batchnorm_eval_fwd";
        let total = n * c * hw;
        check_len(op, "x", x, total)?;
        check_len(op, "y", y, total)?;
        Self::check_bn_params(op, &params, c)?;
        check_len(op, "running_mean", running_mean, c)?;
        check_len(op, "running_var", running_var, c)?;
        if total == 0 {
            return Ok(());
        }
        let ci = dim(op, "C", c)?;
        let (gamma, beta) = (params.gamma.as_ref(), params.beta.as_ref());
        // SAFETY: batchnorm_eval_fwd_f32(const float* x, float* y, const float* gamma,
        // const float* beta, const float* running_mean, const float* running_var, int c,
        // size_t hw, size_t total, float eps); absent parameters are a 64-bit 0 the kernel
        // tests for NULL; lengths checked; the channel index (i / hw) % C is below C.
        unsafe {
            batchnorm_eval::fwd(self, elem_cfg(total), x, y, gamma, beta, running_mean, running_var, ci, hw, total, eps)
        }
    }

    /// Training backward from the forward's `saved` statistics: `grads.dx` written;
    /// dgamma, dbeta accumulated (given exactly when gamma, beta exist in `params`).
    /// x, dy, dx: (N, C, H, W), hw = H*W; saved, dgamma, dbeta: (C)
    pub fn batchnorm_train_bwd(
        &self,
        x: &impl DevIn,
        dy: &impl DevIn,
        params: BnParams<'_>,
        saved: BnSaved<'_>,
        grads: BnGrads<'_>,
        g: BnGeom,
    ) -> Result<()> {
        let BnGeom { n, c, hw, .. } = g;
        let x = &x.view();
        let dy = &dy.view();
        let BnGrads { mut dx, mut dgamma, mut dbeta } = grads;
        let (gamma, save_mean, save_invstd) = (params.gamma, saved.mean, saved.invstd);
        let op = "batchnorm_train_bwd";
        for (what, buf) in [("x", x), ("dy", dy)] {
            check_len(op, what, buf, n * c * hw)?;
        }
        check_len(op, "dx", &dx, n * c * hw)?;
        for (what, buf) in [("save_mean", &save_mean), ("save_invstd", &save_invstd)] {
            check_len(op, what, buf, c)?;
        }
        if gamma.is_some() != dgamma.is_some() {
            return Err(Error::shape(op, "dgamma must be given exactly when gamma is"));
        }
        if params.beta.is_some() != dbeta.is_some() {
            return Err(Error::shape(op, "dbeta must be given exactly when beta is"));
        }
        if let Some(g) = &gamma {
            check_len(op, "gamma", g, c)?;
        }
        for (what, g) in [("dgamma", &dgamma), ("dbeta", &dbeta)] {
            if let Some(g) = g {
                check_len(op, what, g, c)?;
            }
        }
        if c == 0 {
            return Ok(());
        }
        let (ni, ci) = (dim(op, "N", n)?, dim(op, "C", c)?);
        // SAFETY: batchnorm_train_bwd_f32(const float* x, const float* dy, float* dx,
        // const float* gamma, const float* save_mean, const float* save_invstd, float*
        // dgamma, float* dbeta, int n, int c, size_t hw); lengths checked; absent optional
        // buffers are a 64-bit 0 the kernel tests for NULL before use; grid = (C),
        // REDUCE_BLOCK threads as the kernel requires.
        unsafe {
            batchnorm_train::bwd(
                self,
                channel_cfg(ci),
                x,
                dy,
                &mut dx,
                gamma.as_ref(),
                &save_mean,
                &save_invstd,
                dgamma.as_mut(),
                dbeta.as_mut(),
                ni,
                ci,
                hw,
            )
        }
    }

    // ---- batchnorm.cu: synchronized BatchNorm ----------------------------------------
    /// Each channel's (mean, M2) of this shard in f64, the CPU layer's arithmetic (planes
    /// merged in sample order). x: (N, C, H, W), hw = H*W -> moments: (C, 2)
    pub fn batchnorm_moments_fwd(&self, x: &impl DevIn, moments: &mut CudaViewMut<'_, f64>, g: BnGeom) -> Result<()> {
        let BnGeom { n, c, hw, .. } = g;
        let x = &x.view();
        let op = "batchnorm_moments_fwd";
        check_len(op, "x", x, n * c * hw)?;
        check_len(op, "moments", moments, 2 * c)?;
        if c == 0 {
            return Ok(());
        }
        let (ni, ci) = (dim(op, "N", n)?, dim(op, "C", c)?);
        // SAFETY: batchnorm_moments_fwd_f32(const float* x, double* moments, int n, int c,
        // size_t hw); x holds N*C*HW floats and moments 2C doubles (checked); grid = (C),
        // REDUCE_BLOCK threads, as the kernel's shared arrays need.
        unsafe { batchnorm_moments::fwd(self, channel_cfg(ci), x, moments, ni, ci, hw) }
    }

    /// Training forward with the global batch's statistics (`merged`): the running
    /// statistics move as its update says (for the global count), the saved ones are set.
    /// x, y: (N, C, H, W) with hw = H*W; every buffer of `out`: (C)
    pub fn batchnorm_sync_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        params: BnParams<'_>,
        merged: BnMerged<'_>,
        out: BnStats<'_>,
        g: BnGeom,
    ) -> Result<()> {
        let BnGeom { n, c, hw, .. } = g;
        let BnMerged { stats, update } = merged;
        let stats = &stats;
        let x = &x.view();
        let y = &mut y.view_mut();
        let BnStats { mut running_mean, mut running_var, mut save_mean, mut save_invstd } = out;
        let op = "batchnorm_sync_fwd";
        let total = n * c * hw;
        check_len(op, "x", x, total)?;
        check_len(op, "y", y, total)?;
        Self::check_bn_params(op, &params, c)?;
        check_len(op, "stats", stats, 4 * c)?;
        for (what, buf) in [
            ("running_mean", &running_mean),
            ("running_var", &running_var),
            ("save_mean", &save_mean),
            ("save_invstd", &save_invstd),
        ] {
            check_len(op, what, buf, c)?;
        }
        if c == 0 {
            return Ok(());
        }
        let ci = dim(op, "C", c)?;
        let (gamma, beta) = (params.gamma.as_ref(), params.beta.as_ref());
        // SAFETY: batchnorm_sync_fwd_f32(const float* x, float* y, const float* gamma,
        // const float* beta, const double* stats, float* running_mean, float* running_var,
        // float* save_mean, float* save_invstd, int c, size_t hw, size_t total, double
        // keep, double take, double unbias); absent parameters are a 64-bit 0 the kernel
        // tests for NULL; every length checked; the channel index (i / hw) % C is below C.
        unsafe {
            batchnorm_sync::fwd(
                self,
                elem_cfg(total.max(c)),
                x,
                y,
                gamma,
                beta,
                stats,
                &mut running_mean,
                &mut running_var,
                &mut save_mean,
                &mut save_invstd,
                ci,
                hw,
                total,
                update.keep,
                update.take,
                update.unbias,
            )
        }
    }

    /// Each channel's (Σ dy, Σ dy·x̂) of this shard in f64, x̂ recomputed from x and the
    /// forward's saved statistics as the CPU layer's cached one.
    /// x, dy: (N, C, H, W), hw = H*W; saved: (C) -> sums: (C, 2)
    pub fn batchnorm_sums_bwd(
        &self,
        x: &impl DevIn,
        dy: &impl DevIn,
        saved: &BnSaved<'_>,
        sums: &mut CudaViewMut<'_, f64>,
        g: BnGeom,
    ) -> Result<()> {
        let BnGeom { n, c, hw, .. } = g;
        let x = &x.view();
        let dy = &dy.view();
        let op = "batchnorm_sums_bwd";
        check_len(op, "x", x, n * c * hw)?;
        check_len(op, "dy", dy, n * c * hw)?;
        check_len(op, "save_mean", &saved.mean, c)?;
        check_len(op, "save_invstd", &saved.invstd, c)?;
        check_len(op, "sums", sums, 2 * c)?;
        if c == 0 {
            return Ok(());
        }
        let (ni, ci) = (dim(op, "N", n)?, dim(op, "C", c)?);
        // SAFETY: batchnorm_sums_bwd_f32(const float* x, const float* dy, const float*
        // save_mean, const float* save_invstd, double* sums, int n, int c, size_t hw);
        // lengths checked; grid = (C), REDUCE_BLOCK threads.
        unsafe { batchnorm_sums::bwd(self, channel_cfg(ci), x, dy, &saved.mean, &saved.invstd, sums, ni, ci, hw) }
    }

    /// Training backward with the forward's statistics and the global batch's sums
    /// (`sums`): `grads.dx` written;
    /// dgamma, dbeta accumulated from this shard's own sums (given exactly when gamma,
    /// beta exist in `params`). x, dy, dx: (N, C, H, W), hw = H*W; saved, dgamma, dbeta: (C)
    pub fn batchnorm_sync_bwd(
        &self,
        x: &impl DevIn,
        dy: &impl DevIn,
        params: BnParams<'_>,
        sums: BnSums<'_>,
        grads: BnGrads<'_>,
        g: BnGeom,
    ) -> Result<()> {
        let BnGeom { n, c, hw, .. } = g;
        let BnSums { saved, local, global, count } = sums;
        let (local, global) = (&local, &global);
        let x = &x.view();
        let dy = &dy.view();
        let BnGrads { mut dx, mut dgamma, mut dbeta } = grads;
        let op = "batchnorm_sync_bwd";
        let total = n * c * hw;
        for (what, buf) in [("x", x), ("dy", dy)] {
            check_len(op, what, buf, total)?;
        }
        check_len(op, "dx", &dx, total)?;
        check_len(op, "save_mean", &saved.mean, c)?;
        check_len(op, "save_invstd", &saved.invstd, c)?;
        check_len(op, "local", local, 2 * c)?;
        check_len(op, "global", global, 2 * c)?;
        if params.gamma.is_some() != dgamma.is_some() {
            return Err(Error::shape(op, "dgamma must be given exactly when gamma is"));
        }
        if params.beta.is_some() != dbeta.is_some() {
            return Err(Error::shape(op, "dbeta must be given exactly when beta is"));
        }
        if let Some(g) = &params.gamma {
            check_len(op, "gamma", g, c)?;
        }
        for (what, g) in [("dgamma", &dgamma), ("dbeta", &dbeta)] {
            if let Some(g) = g {
                check_len(op, what, g, c)?;
            }
        }
        if c == 0 {
            return Ok(());
        }
        let ci = dim(op, "C", c)?;
        // SAFETY: batchnorm_sync_bwd_f32(const float* x, const float* dy, float* dx, const
        // float* gamma, const float* save_mean, const float* save_invstd, const double*
        // local, const double* global, float* dgamma, float* dbeta, int c, size_t hw,
        // size_t total, double count); lengths checked; absent optional buffers are a
        // 64-bit 0 the kernel tests for NULL before use.
        unsafe {
            batchnorm_sync::bwd(
                self,
                elem_cfg(total.max(c)),
                x,
                dy,
                &mut dx,
                params.gamma.as_ref(),
                &saved.mean,
                &saved.invstd,
                local,
                global,
                dgamma.as_mut(),
                dbeta.as_mut(),
                ci,
                hw,
                total,
                count,
            )
        }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &BatchNorm2d) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(BatchNorm2dGpu {
        channels: layer.channels,
        count: layer.names == BnNames::PyTorch,
        eps: layer.eps,
        momentum: layer.momentum,
        scale: layer.scale,
        center: layer.center,
        stats: layer.stats,
        saved: None,
        sync: None,
    }))
}

/// BatchNorm on a GPU: the kernels compute this file's arithmetic (f64 statistics, the
/// same `normaliser` and `RunningUpdate`); a synchronized layer's statistics meet the
/// other logical replicas' on the host, merged by [`Synchronized`]'s functions above.
pub(super) struct BatchNorm2dGpu {
    channels: usize,
    /// Whether it counts its training forwards (`num_batches_tracked`, its third buffer).
    count: bool,
    eps: f32,
    momentum: f32,
    scale: bool,
    center: bool,
    stats: BatchStats,
    /// The last training forward's batch mean and 1/sqrt(var + eps), (C) each.
    saved: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// A synchronized layer's statistics on their way to and from the host (made at its
    /// first synchronized pass).
    sync: Option<SyncNode>,
}

/// The running update as the kernels take it: its three scalars.
impl From<RunningUpdate> for BnUpdate {
    fn from(u: RunningUpdate) -> BnUpdate {
        BnUpdate::new(u.keep, u.take, u.unbias)
    }
}

impl BatchNorm2dGpu {
    /// gamma and beta among the layer's parameters, as present.
    fn params<'p>(&self, p: impl Fn(usize) -> CudaView<'p, f32>) -> BnParams<'p> {
        BnParams { gamma: self.scale.then(|| p(0)), beta: self.center.then(|| p(usize::from(self.scale))) }
    }

    fn geom(&self, node: &Node, n: usize) -> BnGeom {
        BnGeom { n, c: self.channels, hw: node.input.numel() / self.channels, eps: self.eps, momentum: self.momentum }
    }

    /// The synchronized layer's buffers, made on first use.
    fn sync_node(&mut self, gpu: &Gpu) -> Result<&mut SyncNode> {
        if self.sync.is_none() {
            self.sync = Some(SyncNode::new(gpu, self.channels)?);
        }
        Ok(self.sync.as_mut().expect("made above"))
    }
}

impl GpuLayer for BatchNorm2dGpu {
    fn reserve(&mut self, gpu: &Gpu, _node: &Node, _n: usize) -> Result<()> {
        if self.saved.is_none() {
            let stream = gpu.stream();
            self.saved = Some((stream.alloc_zeros(self.channels.max(1))?, stream.alloc_zeros(self.channels.max(1))?));
        }
        Ok(())
    }

    // x: (N, C, H, W) → y: same shape; training: saved mean, invstd (C), running stats moved
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let Forward { gpu, node, n, params, x, y, pass, sync, .. } = f;
        let geom = self.geom(node, n);
        let bn = self.params(|j| params.slice(node.params[j].clone()));
        let (rm, rv) = (&node.buffers[0], &node.buffers[1]);
        match pass {
            Pass::Train { stats, offset, .. } => {
                if self.stats == BatchStats::Global && sync.is_some() {
                    self.sync_node(gpu)?;
                }
                // Each statistic on its own aligned start: split below the variance.
                let (mut below, mut above) = stats.split_at_mut(*offset + rv.start);
                let running_mean = below.slice_mut(*offset + rm.start..*offset + rm.end);
                let running_var = above.slice_mut(0..rv.len());
                let (save_mean, save_invstd) = self.saved.as_mut().expect("reserved before the pass");
                let out = BnStats {
                    running_mean,
                    running_var,
                    save_mean: save_mean.as_view_mut(),
                    save_invstd: save_invstd.as_view_mut(),
                };
                match (self.stats, sync) {
                    (BatchStats::Global, Some(sync)) => {
                        let node_sync = self.sync.as_mut().expect("made before the statistics' views");
                        node_sync.forward(sync, gpu, &node.name, x, y, bn, out, geom)
                    }
                    _ => {
                        if n * geom.hw < 2 {
                            return Err(Error::shape(
                                "batchnorm",
                                format!(
                                    "{}: training needs more than one value per channel, got {}",
                                    node.name,
                                    n * geom.hw
                                ),
                            ));
                        }
                        let update = RunningUpdate::new(self.momentum, n * geom.hw).into();
                        gpu.batchnorm_train_fwd(x, y, bn, out, geom, update)
                    }
                }?;
                if self.count {
                    let r = &node.buffers[2];
                    gpu.batchnorm_count(&mut stats.slice_mut(*offset + r.start..*offset + r.end))?;
                }
                Ok(())
            }
            Pass::Eval { stats } => {
                gpu.batchnorm_eval_fwd(x, y, bn, (&stats.slice(rm.clone()), &stats.slice(rv.clone())), geom)
            }
        }
    }

    // dy: (N, C, H, W) → dx: same shape (written), dgamma, dbeta: (C) (accumulated)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Backward { gpu, node, n, params, x, dy, dx, grads, sync, .. } = b;
        let mut dx = dx.ok_or_else(|| {
            Error::shape(
                "batchnorm",
                format!("{}: a BatchNorm's backward always computes its input gradient", node.name),
            )
        })?;
        let geom = self.geom(node, n);
        let bn = self.params(|j| params.slice(node.params[j].clone()));
        if self.stats == BatchStats::Global && sync.is_some() {
            self.sync_node(gpu)?;
        }
        let (save_mean, save_invstd) = self.saved.as_ref().expect("reserved before the pass");
        let saved = BnSaved { mean: save_mean.as_view(), invstd: save_invstd.as_view() };
        // The last parameter's gradient (beta, or the only one) starts `split` into the
        // slot; gamma's, when there are both, lies below it on its own aligned start, not
        // adjacent.
        let split = node.params.last().map_or(0, |r| r.start);
        let (mut below, mut above) = grads.split_at_mut(split);
        let last = above.slice_mut(0..node.params.last().map_or(0, |r| r.len()));
        let (dgamma, dbeta) = match (self.scale, self.center) {
            (true, true) => (Some(below.slice_mut(node.params[0].clone())), Some(last)),
            (true, false) => (Some(last), None),
            (false, true) => (None, Some(last)),
            (false, false) => (None, None),
        };
        let out = BnGrads { dx: dx.slice_mut(..), dgamma, dbeta };
        match (self.stats, sync) {
            (BatchStats::Global, Some(sync)) => {
                let node = self.sync.as_mut().expect("made above");
                node.backward(sync, gpu, x, &dy, bn, saved, out, geom)
            }
            _ => gpu.batchnorm_train_bwd(x, &dy, bn, saved, out, geom),
        }
    }
}

/// One synchronized BatchNorm's per-channel statistics (C channels) on their way between
/// the device and the host: f64 on both sides, pinned on the host, each sized exactly for
/// its copy. Each host buffer is rewritten only after the host has waited for a later
/// copy on the same stream, so no copy still reads or writes it then.
struct SyncNode {
    /// The shard's partial statistics (C, 2): forward (mean, M2), backward (Σ dy, Σ dy·x̂).
    part: CudaSlice<f64>,
    part_host: PinnedHostSlice<f64>,
    /// The forward's merged statistics (C, 4): (mean, var, mean as f32, invstd as f32).
    merged: CudaSlice<f64>,
    merged_host: PinnedHostSlice<f64>,
    /// The backward's global sums (C, 2).
    sums: CudaSlice<f64>,
    sums_host: PinnedHostSlice<f64>,
    /// Recorded after the download of `part`: what the host waits for.
    arrived: CudaEvent,
    /// Values per channel in the global batch of the last forward (its backward's count).
    count: f64,
}

impl SyncNode {
    /// The buffers of a synchronized BatchNorm of `c` channels on `gpu`.
    fn new(gpu: &Gpu, c: usize) -> Result<SyncNode> {
        let stream = gpu.stream();
        let ctx = gpu.context();
        // SAFETY: pinned memory without write-combining (the host reads what the device
        // wrote); its contents are unset, and every host buffer is written (by the host,
        // or by a copy the host waited for) before it is read.
        let pinned = |len: usize| unsafe { ctx.alloc_pinned_with_flags::<f64>(len, 0) };
        Ok(SyncNode {
            part: stream.alloc_zeros(2 * c)?,
            part_host: pinned(2 * c)?,
            merged: stream.alloc_zeros(4 * c)?,
            merged_host: pinned(4 * c)?,
            sums: stream.alloc_zeros(2 * c)?,
            sums_host: pinned(2 * c)?,
            arrived: ctx.new_event(None)?,
            count: 0.0,
        })
    }

    /// `part` on the host, as (a, b) per channel: copied, then waited for (polling
    /// `aborted`).
    fn download(&mut self, stream: &Arc<CudaStream>, aborted: &dyn Fn() -> bool) -> Result<Vec<(f64, f64)>> {
        stream.memcpy_dtoh(&self.part, &mut self.part_host)?;
        self.arrived.record(stream)?;
        poll(&self.arrived, aborted)?;
        Ok(self.part_host.as_slice()?.chunks_exact(2).map(|p| (p[0], p[1])).collect())
    }

    /// A synchronized BatchNorm's training forward (layer `name`): this shard's
    /// per-channel (mean, M2) on the device, merged with every logical replica's on the
    /// host (the CPU layer's `global_moments`), the statistics the CPU layer derives from
    /// them (biased variance, `normaliser`, `RunningUpdate` of the global count) back to
    /// the device, which normalises and moves the running statistics.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &mut self,
        sync: SyncWith<'_>,
        gpu: &Gpu,
        name: &str,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        params: BnParams<'_>,
        out: BnStats<'_>,
        g: BnGeom,
    ) -> Result<()> {
        let SyncWith { stats, shard, aborted } = sync;
        let with = Synchronized { stats, shard };
        let node = self;
        let stream = gpu.stream();
        gpu.batchnorm_moments_fwd(x, &mut node.part.as_view_mut(), g)?;
        let local = node.download(stream, aborted)?;
        let here = g.n * g.hw;
        let (count, moments) = with.moments(here as f64, &local)?;
        if count < 2.0 {
            return Err(Error::shape(
                "batchnorm",
                format!(
                    "{name}: training needs more than one value per channel, got {count} in the global batch ({here} here)"
                ),
            ));
        }
        let merged = moments.iter().flat_map(|&(mean, m2)| {
            let var = m2 / count;
            let (m, is) = normaliser(mean, var, g.eps);
            [mean, var, m as f64, is as f64]
        });
        upload_pinned(stream, merged, &mut node.merged_host, &mut node.merged)?;
        node.count = count;
        let update = RunningUpdate::new(g.momentum, count as usize).into();
        let merged = BnMerged { stats: node.merged.as_view(), update };
        gpu.batchnorm_sync_fwd(x, y, params, merged, out, g)
    }

    /// A synchronized BatchNorm's training backward: this shard's per-channel
    /// (Σ dy, Σ dy·x̂) on the device, summed over every logical replica on the host (the
    /// CPU layer's `global_sums`), back to the device for dx; dγ and dβ take the shard's
    /// own sums (the gradient exchange adds the shards').
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &mut self,
        sync: SyncWith<'_>,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        dy: &CudaView<'_, f32>,
        params: BnParams<'_>,
        saved: BnSaved<'_>,
        grads: BnGrads<'_>,
        g: BnGeom,
    ) -> Result<()> {
        let SyncWith { stats, shard, aborted } = sync;
        let with = Synchronized { stats, shard };
        let node = self;
        let stream = gpu.stream();
        gpu.batchnorm_sums_bwd(x, dy, &saved, &mut node.part.as_view_mut(), g)?;
        let local = node.download(stream, aborted)?;
        let global = with.sums(&local)?;
        upload_pinned(stream, global.iter().flat_map(|&(a, b)| [a, b]), &mut node.sums_host, &mut node.sums)?;
        let sums = BnSums { saved, local: node.part.as_view(), global: node.sums.as_view(), count: node.count };
        gpu.batchnorm_sync_bwd(x, dy, params, sums, grads, g)
    }
}

/// `values` into `dev` through `host`, queued on `stream` (the host does not wait).
fn upload_pinned(
    stream: &Arc<CudaStream>,
    values: impl Iterator<Item = f64>,
    host: &mut PinnedHostSlice<f64>,
    dev: &mut CudaSlice<f64>,
) -> Result<()> {
    // Waits for the buffer's last copy, which has run already (SyncNode's docs).
    for (h, v) in host.as_mut_slice()?.iter_mut().zip(values) {
        *h = v;
    }
    stream.memcpy_htod(&*host, dev)?;
    Ok(())
}
