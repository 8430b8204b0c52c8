//! BatchNorm on a GPU: the declaration of kernels/batchnorm.cu, the argument structs and
//! checked launches of its kernels, the op's GPU form, per logical replica and
//! synchronized (whose statistics meet the other logical replicas' on the host, merged by
//! [`super::cpu`]'s functions), and the check of the kernels on the host against the CPU's.

use crate::cuda::launch::{channel_cfg, check_len, dim, elem_cfg, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{poll, Backward, Forward, GpuLayer, Pass, Placement, SyncWith};
use crate::{Error, Result};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, PinnedHostSlice};
use std::sync::Arc;

use super::cpu::{normaliser, RunningUpdate};
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

/// BatchNorm on a GPU: the kernels compute [`super::cpu`]'s arithmetic (f64 statistics,
/// the same `normaliser` and `RunningUpdate`); a synchronized layer's statistics meet the
/// other logical replicas' on the host, merged by [`Synchronized`]'s functions.
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
    sync: Option<SyncBuffers>,
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

    fn geom(&self, place: &Placement, n: usize) -> BnGeom {
        BnGeom { n, c: self.channels, hw: place.input.numel() / self.channels, eps: self.eps, momentum: self.momentum }
    }

    /// The synchronized layer's buffers, made on first use.
    fn sync_buffers(&mut self, gpu: &Gpu) -> Result<&mut SyncBuffers> {
        if self.sync.is_none() {
            self.sync = Some(SyncBuffers::new(gpu, self.channels)?);
        }
        Ok(self.sync.as_mut().expect("made above"))
    }
}

impl GpuLayer for BatchNorm2dGpu {
    fn reserve(&mut self, gpu: &Gpu, _place: &Placement, _n: usize) -> Result<()> {
        if self.saved.is_none() {
            let stream = gpu.stream();
            self.saved = Some((stream.alloc_zeros(self.channels.max(1))?, stream.alloc_zeros(self.channels.max(1))?));
        }
        Ok(())
    }

    // x: (N, C, H, W) → y: same shape; training: saved mean, invstd (C), running stats moved
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let Forward { gpu, place, n, params, x, y, pass, sync, .. } = f;
        let geom = self.geom(place, n);
        let bn = self.params(|j| params.slice(place.params[j].clone()));
        let (rm, rv) = (&place.buffers[0], &place.buffers[1]);
        match pass {
            Pass::Train { stats, offset, .. } => {
                if self.stats == BatchStats::Global && sync.is_some() {
                    self.sync_buffers(gpu)?;
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
                        let bufs = self.sync.as_mut().expect("made before the statistics' views");
                        bufs.forward(sync, gpu, &place.name, x, y, bn, out, geom)
                    }
                    _ => {
                        if n * geom.hw < 2 {
                            return Err(Error::shape(
                                "batchnorm",
                                format!(
                                    "{}: training needs more than one value per channel, got {}",
                                    place.name,
                                    n * geom.hw
                                ),
                            ));
                        }
                        let update = RunningUpdate::new(self.momentum, n * geom.hw).into();
                        gpu.batchnorm_train_fwd(x, y, bn, out, geom, update)
                    }
                }?;
                if self.count {
                    let r = &place.buffers[2];
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
        let Backward { gpu, place, n, params, x, dy, dx, grads, sync, .. } = b;
        let mut dx = dx.ok_or_else(|| {
            Error::shape(
                "batchnorm",
                format!("{}: a BatchNorm's backward always computes its input gradient", place.name),
            )
        })?;
        let geom = self.geom(place, n);
        let bn = self.params(|j| params.slice(place.params[j].clone()));
        if self.stats == BatchStats::Global && sync.is_some() {
            self.sync_buffers(gpu)?;
        }
        let (save_mean, save_invstd) = self.saved.as_ref().expect("reserved before the pass");
        let saved = BnSaved { mean: save_mean.as_view(), invstd: save_invstd.as_view() };
        // The last parameter's gradient (beta, or the only one) starts `split` into the
        // slot; gamma's, when there are both, lies below it on its own aligned start, not
        // adjacent.
        let split = place.params.last().map_or(0, |r| r.start);
        let (mut below, mut above) = grads.split_at_mut(split);
        let last = above.slice_mut(0..place.params.last().map_or(0, |r| r.len()));
        let (dgamma, dbeta) = match (self.scale, self.center) {
            (true, true) => (Some(below.slice_mut(place.params[0].clone())), Some(last)),
            (true, false) => (Some(last), None),
            (false, true) => (None, Some(last)),
            (false, false) => (None, None),
        };
        let out = BnGrads { dx: dx.slice_mut(..), dgamma, dbeta };
        match (self.stats, sync) {
            (BatchStats::Global, Some(sync)) => {
                let bufs = self.sync.as_mut().expect("made above");
                bufs.backward(sync, gpu, x, &dy, bn, saved, out, geom)
            }
            _ => gpu.batchnorm_train_bwd(x, &dy, bn, saved, out, geom),
        }
    }
}

/// One synchronized BatchNorm's per-channel statistics (C channels) on their way between
/// the device and the host: f64 on both sides, pinned on the host, each sized exactly for
/// its copy. Each host buffer is rewritten only after the host has waited for a later
/// copy on the same stream, so no copy still reads or writes it then.
struct SyncBuffers {
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

impl SyncBuffers {
    /// The buffers of a synchronized BatchNorm of `c` channels on `gpu`.
    fn new(gpu: &Gpu, c: usize) -> Result<SyncBuffers> {
        let stream = gpu.stream();
        let ctx = gpu.context();
        // SAFETY: pinned memory without write-combining (the host reads what the device
        // wrote); its contents are unset, and every host buffer is written (by the host,
        // or by a copy the host waited for) before it is read.
        let pinned = |len: usize| unsafe { ctx.alloc_pinned_with_flags::<f64>(len, 0) };
        Ok(SyncBuffers {
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
        let bufs = self;
        let stream = gpu.stream();
        gpu.batchnorm_moments_fwd(x, &mut bufs.part.as_view_mut(), g)?;
        let local = bufs.download(stream, aborted)?;
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
        upload_pinned(stream, merged_stats(&moments, count, g.eps), &mut bufs.merged_host, &mut bufs.merged)?;
        bufs.count = count;
        let update = RunningUpdate::new(g.momentum, count as usize).into();
        let merged = BnMerged { stats: bufs.merged.as_view(), update };
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
        let bufs = self;
        let stream = gpu.stream();
        gpu.batchnorm_sums_bwd(x, dy, &saved, &mut bufs.part.as_view_mut(), g)?;
        let local = bufs.download(stream, aborted)?;
        let global = with.sums(&local)?;
        upload_pinned(stream, global.iter().flat_map(|&(a, b)| [a, b]), &mut bufs.sums_host, &mut bufs.sums)?;
        let sums = BnSums { saved, local: bufs.part.as_view(), global: bufs.sums.as_view(), count: bufs.count };
        gpu.batchnorm_sync_bwd(x, dy, params, sums, grads, g)
    }
}

/// What `batchnorm_sync_fwd` normalises with, (C, 4) flat: per channel the global batch's
/// mean and BIASED variance M2 / count, and what normalises ([`normaliser`]: the mean and
/// 1/sqrt(var + eps) rounded to f32), from the merged per-channel (mean, M2) `moments` of
/// `count` values per channel: the CPU layer's statistics, as f64.
fn merged_stats(moments: &[(f64, f64)], count: f64, eps: f32) -> impl Iterator<Item = f64> + '_ {
    moments.iter().flat_map(move |&(mean, m2)| {
        let var = m2 / count;
        let (m, is) = normaliser(mean, var, eps);
        [mean, var, m as f64, is as f64]
    })
}

/// `values` into `dev` through `host`, queued on `stream` (the host does not wait).
fn upload_pinned(
    stream: &Arc<CudaStream>,
    values: impl Iterator<Item = f64>,
    host: &mut PinnedHostSlice<f64>,
    dev: &mut CudaSlice<f64>,
) -> Result<()> {
    // Waits for the buffer's last copy, which has run already (SyncBuffers's docs).
    for (h, v) in host.as_mut_slice()?.iter_mut().zip(values) {
        *h = v;
    }
    stream.memcpy_htod(&*host, dev)?;
    Ok(())
}

// ---- on the host ------------------------------------------------------------------------

/// One BatchNorm training step's inputs, drawn at random: x, dy: (N, C, HW); γ, β, the
/// running statistics before the step and the parameter gradients before it (backward
/// accumulates into them): (C) each. Each check says which of γ and β the layer has.
#[cfg(test)]
struct Step {
    n: usize,
    c: usize,
    hw: usize,
    x: Vec<f32>,
    dy: Vec<f32>,
    gamma: Vec<f32>,
    beta: Vec<f32>,
    running_mean: Vec<f32>,
    running_var: Vec<f32>,
    dgamma: Vec<f32>,
    dbeta: Vec<f32>,
}

/// What the CPU makes of a [`Step`] ([`Step::on_the_cpu`]).
#[cfg(test)]
struct Want {
    /// (N, C, HW) each.
    y: Vec<f32>,
    dx: Vec<f32>,
    /// (C) each: the running statistics after the step, what normalised, and the
    /// gradients accumulated where the layer has γ and β (untouched where it has not).
    running_mean: Vec<f32>,
    running_var: Vec<f32>,
    mean: Vec<f32>,
    invstd: Vec<f32>,
    dgamma: Vec<f32>,
    dbeta: Vec<f32>,
    /// The shard's per-channel (mean, M2) and (Σ dy, Σ dy·x̂), flat (C, 2): what a
    /// synchronized layer hands the exchange; and the global batch's (Σ dy, Σ dy·x̂).
    moments: Vec<f64>,
    sums: Vec<f64>,
    global_sums: Vec<f64>,
    /// The global batch's values per channel (the shard's own, per replica), and the
    /// (C, 4) statistics `batchnorm_sync_fwd` takes ([`merged_stats`]).
    count: f64,
    merged: Vec<f64>,
}

/// A statistics exchange of two logical replicas in which the caller is replica 1 and
/// replica 0's payload is fixed: in forward 37 values per channel of mean 0.3 + ch/10 and
/// M2 11 + ch, in backward (Σ dy, Σ dy·x̂) = (1.5 − ch/4, −0.7 + ch/8), told apart by
/// their lengths (1 + 2C is odd).
#[cfg(test)]
#[derive(Debug)]
struct ReplicaZero;

#[cfg(test)]
impl StatsExchange for ReplicaZero {
    fn replicas(&self) -> usize {
        2
    }

    fn all_gather(&self, shard: usize, mine: &[f64], all: &mut Vec<f64>) -> Result<()> {
        assert_eq!(shard, 1, "the layer under test is logical replica 1");
        all.clear();
        let c = mine.len() / 2;
        if mine.len() % 2 == 1 {
            all.push(37.0);
            all.extend((0..c).flat_map(|ch| [0.3 + ch as f64 / 10.0, 11.0 + ch as f64]));
        } else {
            all.extend((0..c).flat_map(|ch| [1.5 - ch as f64 / 4.0, -0.7 + ch as f64 / 8.0]));
        }
        all.extend_from_slice(mine);
        Ok(())
    }
}

#[cfg(test)]
impl Step {
    /// x in [−1.5, 2.5), γ and the running variance in [0.5, 1.5), the rest in [−1, 1).
    fn random(seed: u64, (n, c, hw): (usize, usize, usize)) -> Step {
        use crate::testing::uniform;
        let around = |s: u64, len: usize, mid: f32, half: f32| -> Vec<f32> {
            uniform(s, len).iter().map(|v| mid + half * v).collect()
        };
        Step {
            n,
            c,
            hw,
            x: around(seed, n * c * hw, 0.5, 2.0),
            dy: uniform(seed + 1, n * c * hw),
            gamma: around(seed + 2, c, 1.0, 0.5),
            beta: uniform(seed + 3, c),
            running_mean: uniform(seed + 4, c),
            running_var: around(seed + 5, c, 1.0, 0.5),
            dgamma: uniform(seed + 6, c),
            dbeta: uniform(seed + 7, c),
        }
    }

    /// The training step on the CPU ([`super::cpu`], the functions the layer calls), the
    /// layer having γ and β where `with` says: per logical replica, or synchronized as
    /// logical replica 1 beside [`ReplicaZero`] (`BatchStats::Global`).
    fn on_the_cpu(&self, (with_gamma, with_beta): (bool, bool), stats: BatchStats, momentum: f32, eps: f32) -> Want {
        use super::cpu::*;
        let (n, c, hw) = (self.n, self.c, self.hw);
        let (gamma, beta) = (with_gamma.then_some(&self.gamma[..]), with_beta.then_some(&self.beta[..]));
        let after = Activation::Linear;
        let local = batchnorm_moments(&self.x, n, c, hw);
        let (count, moments) = match stats {
            BatchStats::Global => global_moments(&ReplicaZero, 1, (n * hw) as f64, &local).unwrap(),
            BatchStats::ShardPass => ((n * hw) as f64, local.clone()),
        };
        let merged: Vec<f64> = merged_stats(&moments, count, eps).collect();
        let (mut running_mean, mut running_var) = (self.running_mean.clone(), self.running_var.clone());
        let (mean, invstd) = batchnorm_train_stats(count, &moments, eps, momentum, &mut running_mean, &mut running_var);
        let (mut y, mut xhat) = (self.x.clone(), vec![0.0; self.x.len()]);
        batchnorm_forward(&mut y, Some(&mut xhat), &mean, &invstd, gamma, beta, after, c, hw);
        let sums = batchnorm_backward_sums(&self.dy, &xhat, gamma, beta, after, n, c, hw);
        let (mut dgamma, mut dbeta) = (self.dgamma.clone(), self.dbeta.clone());
        batchnorm_param_grads(&sums, with_gamma.then_some(&mut dgamma[..]), with_beta.then_some(&mut dbeta[..]));
        let global = match stats {
            BatchStats::Global => global_sums(&ReplicaZero, 1, &sums).unwrap(),
            BatchStats::ShardPass => sums.clone(),
        };
        let mut dx = self.dy.clone();
        batchnorm_input_grad(&mut dx, &xhat, &global, &invstd, count, gamma, beta, after, c, hw);
        let flat = |v: &[(f64, f64)]| v.iter().flat_map(|&(a, b)| [a, b]).collect::<Vec<f64>>();
        Want {
            y,
            dx,
            running_mean,
            running_var,
            mean,
            invstd,
            dgamma,
            dbeta,
            moments: flat(&local),
            sums: flat(&sums),
            global_sums: flat(&global),
            count,
            merged,
        }
    }

    /// The evaluation forward on the CPU with the running statistics `rm`, `rv`: (C).
    fn eval_on_the_cpu(&self, (with_gamma, with_beta): (bool, bool), rm: &[f32], rv: &[f32], eps: f32) -> Vec<f32> {
        let (gamma, beta) = (with_gamma.then_some(&self.gamma[..]), with_beta.then_some(&self.beta[..]));
        let (mean, invstd) = super::cpu::batchnorm_eval_stats(rm, rv, eps);
        let mut y = self.x.clone();
        super::cpu::batchnorm_forward(&mut y, None, &mean, &invstd, gamma, beta, Activation::Linear, self.c, self.hw);
        y
    }
}

/// (N, C, HW, with γ, with β) of the per-replica checks on the host: every combination of
/// the optional parameters at M = N·HW = 100 (< REDUCE_BLOCK: idle threads add 0), then
/// M = 400 (threads sum strided terms before the tree), M = 1 (the running variance takes
/// the biased one; the layer refuses to train on it, the kernel's edge alone) and M = 0
/// (nothing is written).
#[cfg(test)]
const SHARD_CASES: [(usize, usize, usize, bool, bool); 7] = [
    (4, 3, 25, true, true),
    (4, 3, 25, false, true),
    (4, 3, 25, true, false),
    (4, 3, 25, false, false),
    (4, 2, 100, true, true),
    (1, 2, 1, true, true),
    (0, 2, 9, true, true),
];

/// (N, C, HW, with γ, with β) of the synchronized checks: HW 37 (four chunks of eight and
/// a tail), 64 (no tail), 5 (only a tail); N = 300, more samples than a block's 256
/// threads (two rounds of planes merged in order); N = 1.
#[cfg(test)]
const SYNC_CASES: [(usize, usize, usize, bool, bool); 5] = [
    (5, 3, 37, true, true),
    (3, 2, 64, false, true),
    (2, 2, 5, true, false),
    (300, 2, 9, false, false),
    (1, 3, 16, true, true),
];

/// The per-replica kernel's results against the CPU's: the kernel sums in f32 blocks and
/// blends the running statistics in f32 where the CPU works in f64 ([`RunningUpdate`]'s
/// docs), so within 1e-4 relative and 1e-5 absolute through the statistics (up to 400
/// terms per channel through mean and variance), and 1e-5 and 1e-6 for the running
/// statistics (one blend of those) and the saved mean; invstd = 1/sqrt(var + eps) is up
/// to 1/sqrt(eps) ≈ 32 (at M = 1, var = 0), within 1e-4 and 1e-5.
#[cfg(test)]
#[track_caller]
#[allow(clippy::too_many_arguments)]
fn assert_shard_step(case: &str, want: &Want, y: &[f32], rm: &[f32], rv: &[f32], dx: &[f32], dg: &[f32], db: &[f32]) {
    use crate::testing::assert_close;
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    assert_close(&format!("bn y ({case})"), y, &f64s(&want.y), 1e-4, 1e-5);
    assert_close(&format!("bn running_mean ({case})"), rm, &f64s(&want.running_mean), 1e-5, 1e-6);
    assert_close(&format!("bn running_var ({case})"), rv, &f64s(&want.running_var), 1e-5, 1e-6);
    assert_close(&format!("bn dx ({case})"), dx, &f64s(&want.dx), 1e-4, 1e-5);
    // Absent parameters leave their gradient buffers untouched.
    assert_close(&format!("bn dgamma ({case})"), dg, &f64s(&want.dgamma), 1e-4, 1e-5);
    assert_close(&format!("bn dbeta ({case})"), db, &f64s(&want.dbeta), 1e-4, 1e-5);
}

/// The kernels of kernels/batchnorm.cu run on the host against the CPU's [`super::cpu`]:
/// the per-replica training forward and backward within the tolerances of
/// [`assert_shard_step`] (and, at M = 0, nothing written), the evaluation forward within
/// 1e-5 relative and 1e-6 absolute (four f32 operations, the device's 1/sqrt); the
/// synchronized kernels and the count bit for bit, every one of them making the CPU's f32
/// and f64 operations in its order (the host contracts nothing; on a GPU the _rn
/// intrinsics keep NVRTC from it): the shard's (mean, M2) a GPU replica hands the
/// exchange is the CPU's very payload, the statistics merged by the same functions
/// normalise into the CPU's y and move the running statistics to its values, the
/// backward's (Σ dy, Σ dy·x̂) is its payload again, and dx, dγ, dβ are its own. The
/// grid-stride kernels under the launch shape the launches use and under a grid too small
/// to cover the data; the reductions under their one block a channel.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{channel_cfg, elem_cfg, elem_cfgs, Arg, In, InF64, Null, Out, OutF64, F32, F64, FEW};
    use crate::cuda::host::{I32, U64};
    use crate::testing::{assert_bits, assert_close};
    /// An optional parameter: the buffer, or the 64-bit 0 a launch passes for None.
    fn opt(on: bool, v: &[f32]) -> Arg<'_> {
        if on {
            In(v)
        } else {
            Null
        }
    }
    /// An optional gradient, likewise.
    fn opt_mut(on: bool, v: &mut [f32]) -> Arg<'_> {
        if on {
            Out(v)
        } else {
            Null
        }
    }
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();

    // ---- per logical replica
    let (momentum, eps) = (0.99f32, 1e-3f32);
    for (seed, (n, c, hw, with_gamma, with_beta)) in (0..).map(|i| 500 + 10 * i).zip(SHARD_CASES) {
        let case = format!("N={n} C={c} HW={hw}, gamma {with_gamma}, beta {with_beta}");
        let total = n * c * hw;
        let step = Step::random(seed, (n, c, hw));
        let Step { x, dy, gamma, beta, running_mean: rm0, running_var: rv0, dgamma: dg0, dbeta: db0, .. } = &step;
        let (sm0, si0) = (vec![-7.0f32; c], vec![-7.0f32; c]);
        let mut y = vec![f32::NAN; total];
        let (mut rm, mut rv, mut sm, mut si) = (rm0.clone(), rv0.clone(), sm0.clone(), si0.clone());
        // As Gpu::batchnorm_train_fwd pushes them: x, y, gamma or 0, beta or 0,
        // running_mean, running_var, save_mean, save_invstd, N (int), C (int), hw, keep,
        // take, unbias (RunningUpdate's, rounded to f32), eps.
        let u = RunningUpdate::new(momentum, n * hw);
        k.launch(
            &batchnorm_train::FWD,
            channel_cfg(c as i32),
            &mut [
                In(x),
                Out(&mut y),
                opt(with_gamma, gamma),
                opt(with_beta, beta),
                Out(&mut rm),
                Out(&mut rv),
                Out(&mut sm),
                Out(&mut si),
                I32(n as i32),
                I32(c as i32),
                U64(hw as u64),
                F32(u.keep as f32),
                F32(u.take as f32),
                F32(u.unbias as f32),
                F32(eps),
            ],
        );
        let mut dx = vec![f32::NAN; total];
        let (mut dgamma, mut dbeta) = (dg0.clone(), db0.clone());
        // As Gpu::batchnorm_train_bwd: x, dy, dx, gamma or 0, save_mean, save_invstd,
        // dgamma or 0, dbeta or 0, N (int), C (int), hw; dgamma is given exactly when
        // gamma is.
        k.launch(
            &batchnorm_train::BWD,
            channel_cfg(c as i32),
            &mut [
                In(x),
                In(dy),
                Out(&mut dx),
                opt(with_gamma, gamma),
                In(&sm),
                In(&si),
                opt_mut(with_gamma, &mut dgamma),
                opt_mut(with_beta, &mut dbeta),
                I32(n as i32),
                I32(c as i32),
                U64(hw as u64),
            ],
        );
        if n == 0 {
            // M = 0: every statistic and parameter gradient is left as it was.
            for (what, got, before) in [("running_mean", &rm, rm0), ("running_var", &rv, rv0), ("save_mean", &sm, &sm0)]
                .into_iter()
                .chain([("save_invstd", &si, &si0), ("dgamma", &dgamma, dg0), ("dbeta", &dbeta, db0)])
            {
                assert_bits(&format!("bn {what} ({case})"), got, before);
            }
            continue;
        }
        let want = step.on_the_cpu((with_gamma, with_beta), BatchStats::ShardPass, momentum, eps);
        assert_shard_step(&case, &want, &y, &rm, &rv, &dx, &dgamma, &dbeta);
        let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        assert_close(&format!("bn save_mean ({case})"), &sm, &f64s(&want.mean), 1e-5, 1e-6);
        assert_close(&format!("bn save_invstd ({case})"), &si, &f64s(&want.invstd), 1e-4, 1e-5);

        // Evaluation with the running statistics just moved.
        let want = f64s(&step.eval_on_the_cpu((with_gamma, with_beta), &rm, &rv, eps));
        for cfg in elem_cfgs(total) {
            let mut y = vec![f32::NAN; total];
            // As Gpu::batchnorm_eval_fwd: x, y, gamma or 0, beta or 0, running_mean,
            // running_var, C (int), hw, total, eps.
            k.launch(
                &batchnorm_eval::FWD,
                cfg,
                &mut [
                    In(x),
                    Out(&mut y),
                    opt(with_gamma, gamma),
                    opt(with_beta, beta),
                    In(&rm),
                    In(&rv),
                    I32(c as i32),
                    U64(hw as u64),
                    U64(total as u64),
                    F32(eps),
                ],
            );
            assert_close(&format!("bn eval y ({case}) {cfg:?}"), &y, &want, 1e-5, 1e-6);
        }
    }

    // ---- synchronized
    let (momentum, eps) = (0.9f32, 1e-3f32);
    for (seed, (n, c, hw, with_gamma, with_beta)) in (0..).map(|i| 600 + 10 * i).zip(SYNC_CASES) {
        let case = format!("N={n} C={c} HW={hw}, gamma {with_gamma}, beta {with_beta}");
        let total = n * c * hw;
        let step = Step::random(seed, (n, c, hw));
        let Step { x, dy, gamma, beta, running_mean: rm0, running_var: rv0, dgamma: dg0, dbeta: db0, .. } = &step;
        let want = step.on_the_cpu((with_gamma, with_beta), BatchStats::Global, momentum, eps);
        assert_eq!(want.count, (37 + n * hw) as f64, "{case}: the global count");

        // As Gpu::batchnorm_moments_fwd: x, moments, N (int), C (int), hw.
        let mut moments = vec![f64::NAN; 2 * c];
        k.launch(
            &batchnorm_moments::FWD,
            channel_cfg(c as i32),
            &mut [In(x), OutF64(&mut moments), I32(n as i32), I32(c as i32), U64(hw as u64)],
        );
        assert_eq!(bits(&moments), bits(&want.moments), "{case}: the shard's moments vs the CPU's payload");
        let u = RunningUpdate::new(momentum, want.count as usize);
        for cfg in [elem_cfg(total.max(c)), FEW] {
            let (mut y, mut rm, mut rv) = (vec![f32::NAN; total], rm0.clone(), rv0.clone());
            let (mut sm, mut si) = (vec![f32::NAN; c], vec![f32::NAN; c]);
            // As Gpu::batchnorm_sync_fwd: x, y, gamma or 0, beta or 0, stats, running_mean,
            // running_var, save_mean, save_invstd, C (int), hw, total, keep, take, unbias.
            k.launch(
                &batchnorm_sync::FWD,
                cfg,
                &mut [
                    In(x),
                    Out(&mut y),
                    opt(with_gamma, gamma),
                    opt(with_beta, beta),
                    InF64(&want.merged),
                    Out(&mut rm),
                    Out(&mut rv),
                    Out(&mut sm),
                    Out(&mut si),
                    I32(c as i32),
                    U64(hw as u64),
                    U64(total as u64),
                    F64(u.keep),
                    F64(u.take),
                    F64(u.unbias),
                ],
            );
            assert_bits(&format!("sync bn y ({case}) {cfg:?}"), &y, &want.y);
            assert_bits(&format!("sync bn running_mean ({case})"), &rm, &want.running_mean);
            assert_bits(&format!("sync bn running_var ({case})"), &rv, &want.running_var);
            assert_bits(&format!("sync bn save_mean ({case})"), &sm, &want.mean);
            assert_bits(&format!("sync bn save_invstd ({case})"), &si, &want.invstd);

            // As Gpu::batchnorm_sums_bwd: x, dy, save_mean, save_invstd, sums, N (int),
            // C (int), hw.
            let mut sums = vec![f64::NAN; 2 * c];
            k.launch(
                &batchnorm_sums::BWD,
                channel_cfg(c as i32),
                &mut [In(x), In(dy), In(&sm), In(&si), OutF64(&mut sums), I32(n as i32), I32(c as i32), U64(hw as u64)],
            );
            assert_eq!(bits(&sums), bits(&want.sums), "{case}: the shard's sums vs the CPU's payload");
            let (mut dx, mut dgamma, mut dbeta) = (vec![f32::NAN; total], dg0.clone(), db0.clone());
            // As Gpu::batchnorm_sync_bwd: x, dy, dx, gamma or 0, save_mean, save_invstd,
            // local, global, dgamma or 0, dbeta or 0, C (int), hw, total, count.
            k.launch(
                &batchnorm_sync::BWD,
                cfg,
                &mut [
                    In(x),
                    In(dy),
                    Out(&mut dx),
                    opt(with_gamma, gamma),
                    In(&sm),
                    In(&si),
                    InF64(&sums),
                    InF64(&want.global_sums),
                    opt_mut(with_gamma, &mut dgamma),
                    opt_mut(with_beta, &mut dbeta),
                    I32(c as i32),
                    U64(hw as u64),
                    U64(total as u64),
                    F64(want.count),
                ],
            );
            assert_bits(&format!("sync bn dx ({case}) {cfg:?}"), &dx, &want.dx);
            assert_bits(&format!("sync bn dgamma ({case})"), &dgamma, &want.dgamma);
            assert_bits(&format!("sync bn dbeta ({case})"), &dbeta, &want.dbeta);
        }
    }

    // ---- num_batches_tracked: counts as the average over R logical replicas leaves them:
    // whole, an ulp off either side (5 · 7 · (1/7) in f32), and large.
    for v in [0.0f32, 1.0, 4.999_999_5, 5.000_000_5, 123_456.0, 16_777_215.0] {
        let mut count = vec![v];
        // As Gpu::batchnorm_count pushes them: count, n = 1.
        k.launch(&batchnorm_count::FWD, elem_cfg(1), &mut [Out(&mut count), U64(1)]);
        assert_bits(&format!("count of {v}"), &count, &[super::cpu::count_up(v)]);
    }
}

// ---- on a GPU -----------------------------------------------------------------------------

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::ops::conformance::gpu_or_skip;

    fn up<T: cudarc::driver::DeviceRepr>(gpu: &Gpu, v: &[T]) -> CudaSlice<T> {
        gpu.stream().clone_htod(v).expect("host to device copy")
    }

    fn down<T: cudarc::driver::DeviceRepr + Default + Clone>(gpu: &Gpu, d: &CudaSlice<T>) -> Vec<T> {
        gpu.stream().clone_dtoh(d).expect("device to host copy")
    }

    /// The per-replica kernels on a GPU against the CPU, within the host check's
    /// tolerances ([`assert_shard_step`]; the evaluation within 1e-5 relative, 1e-6
    /// absolute), for every combination of γ and β.
    #[test]
    fn batchnorm_train_eval_and_backward_match_the_cpu() {
        if !gpu_or_skip("batchnorm_train_eval_and_backward_match_the_cpu") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let (n, c, hw) = (4, 3, 25);
        let (momentum, eps) = (0.99f32, 1e-3f32);
        for (seed, with) in (700..).zip([(true, true), (false, true), (true, false), (false, false)]) {
            let (with_gamma, with_beta) = with;
            let step = Step::random(seed, (n, c, hw));
            let want = step.on_the_cpu(with, BatchStats::ShardPass, momentum, eps);
            let (g_d, b_d) = (up(&gpu, &step.gamma), up(&gpu, &step.beta));
            let params =
                || BnParams { gamma: with_gamma.then(|| g_d.as_view()), beta: with_beta.then(|| b_d.as_view()) };
            let x_d = up(&gpu, &step.x);
            let mut y_d = up(&gpu, &vec![0.0f32; step.x.len()]);
            let (mut rm_d, mut rv_d) = (up(&gpu, &step.running_mean), up(&gpu, &step.running_var));
            let (mut sm_d, mut si_d) = (up(&gpu, &vec![0.0f32; c]), up(&gpu, &vec![0.0f32; c]));
            let geom = BnGeom { n, c, hw, eps, momentum };
            let stats = BnStats {
                running_mean: rm_d.as_view_mut(),
                running_var: rv_d.as_view_mut(),
                save_mean: sm_d.as_view_mut(),
                save_invstd: si_d.as_view_mut(),
            };
            let update = RunningUpdate::new(momentum, n * hw).into();
            gpu.batchnorm_train_fwd(&x_d, &mut y_d, params(), stats, geom, update).unwrap();
            let mut dx_d = up(&gpu, &vec![0.0f32; step.x.len()]);
            let (mut dg_d, mut db_d) = (up(&gpu, &step.dgamma), up(&gpu, &step.dbeta));
            let saved = BnSaved { mean: sm_d.as_view(), invstd: si_d.as_view() };
            let grads = BnGrads {
                dx: dx_d.as_view_mut(),
                dgamma: with_gamma.then(|| dg_d.as_view_mut()),
                dbeta: with_beta.then(|| db_d.as_view_mut()),
            };
            gpu.batchnorm_train_bwd(&x_d, &up(&gpu, &step.dy), params(), saved, grads, geom).unwrap();
            let case = format!("gamma {with_gamma}, beta {with_beta}");
            let (rm, rv) = (down(&gpu, &rm_d), down(&gpu, &rv_d));
            let (y, dx, dg, db) = (down(&gpu, &y_d), down(&gpu, &dx_d), down(&gpu, &dg_d), down(&gpu, &db_d));
            assert_shard_step(&case, &want, &y, &rm, &rv, &dx, &dg, &db);

            // Evaluation with the running statistics just moved.
            gpu.batchnorm_eval_fwd(&x_d, &mut y_d, params(), (&rm_d, &rv_d), geom).unwrap();
            let want: Vec<f64> = step.eval_on_the_cpu(with, &rm, &rv, eps).iter().map(|&v| v as f64).collect();
            crate::testing::assert_close(&format!("bn eval y ({case})"), &down(&gpu, &y_d), &want, 1e-5, 1e-6);
        }
    }

    /// The synchronized kernels on a GPU against the CPU, through the launches a GPU
    /// replica makes, bit for bit as on the host: the kernels' f64 and f32 arithmetic is
    /// the CPU's, operation for operation, with the _rn intrinsics where NVRTC would fuse
    /// a multiply and an add, and CUDA's f64 division, conversions and additions are
    /// IEEE's, as the CPU's.
    #[test]
    fn synchronized_batchnorm_kernels_equal_the_cpu_bit_for_bit() {
        if !gpu_or_skip("synchronized_batchnorm_kernels_equal_the_cpu_bit_for_bit") {
            return;
        }
        use crate::testing::assert_bits;
        let gpu = Gpu::new(0).unwrap();
        let (momentum, eps) = (0.9f32, 1e-3f32);
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (seed, (n, c, hw, with_gamma, with_beta)) in (800..).zip(SYNC_CASES) {
            let case = format!("N={n} C={c} HW={hw}, gamma {with_gamma}, beta {with_beta}");
            let step = Step::random(seed, (n, c, hw));
            let want = step.on_the_cpu((with_gamma, with_beta), BatchStats::Global, momentum, eps);
            let geom = BnGeom { n, c, hw, eps, momentum };
            let (x_d, dy_d) = (up(&gpu, &step.x), up(&gpu, &step.dy));
            let (g_d, b_d) = (up(&gpu, &step.gamma), up(&gpu, &step.beta));
            let params =
                || BnParams { gamma: with_gamma.then(|| g_d.as_view()), beta: with_beta.then(|| b_d.as_view()) };

            let mut moments_d = up(&gpu, &vec![f64::NAN; 2 * c]);
            gpu.batchnorm_moments_fwd(&x_d, &mut moments_d.as_view_mut(), geom).unwrap();
            assert_eq!(bits(&down(&gpu, &moments_d)), bits(&want.moments), "{case}: the shard's moments");
            let stats_d = up(&gpu, &want.merged);
            let mut y_d = up(&gpu, &vec![f32::NAN; step.x.len()]);
            let (mut rm_d, mut rv_d) = (up(&gpu, &step.running_mean), up(&gpu, &step.running_var));
            let (mut sm_d, mut si_d) = (up(&gpu, &vec![f32::NAN; c]), up(&gpu, &vec![f32::NAN; c]));
            let out = BnStats {
                running_mean: rm_d.as_view_mut(),
                running_var: rv_d.as_view_mut(),
                save_mean: sm_d.as_view_mut(),
                save_invstd: si_d.as_view_mut(),
            };
            let update = RunningUpdate::new(momentum, want.count as usize).into();
            let merged = BnMerged { stats: stats_d.as_view(), update };
            gpu.batchnorm_sync_fwd(&x_d, &mut y_d, params(), merged, out, geom).unwrap();
            assert_bits(&format!("{case}: y"), &down(&gpu, &y_d), &want.y);
            assert_bits(&format!("{case}: running_mean"), &down(&gpu, &rm_d), &want.running_mean);
            assert_bits(&format!("{case}: running_var"), &down(&gpu, &rv_d), &want.running_var);

            let mut sums_d = up(&gpu, &vec![f64::NAN; 2 * c]);
            let saved = || BnSaved { mean: sm_d.as_view(), invstd: si_d.as_view() };
            gpu.batchnorm_sums_bwd(&x_d, &dy_d, &saved(), &mut sums_d.as_view_mut(), geom).unwrap();
            assert_eq!(bits(&down(&gpu, &sums_d)), bits(&want.sums), "{case}: the shard's sums");
            let global_d = up(&gpu, &want.global_sums);
            let mut dx_d = up(&gpu, &vec![f32::NAN; step.x.len()]);
            let (mut dg_d, mut db_d) = (up(&gpu, &step.dgamma), up(&gpu, &step.dbeta));
            let grads = BnGrads {
                dx: dx_d.as_view_mut(),
                dgamma: with_gamma.then(|| dg_d.as_view_mut()),
                dbeta: with_beta.then(|| db_d.as_view_mut()),
            };
            let sums =
                BnSums { saved: saved(), local: sums_d.as_view(), global: global_d.as_view(), count: want.count };
            gpu.batchnorm_sync_bwd(&x_d, &dy_d, params(), sums, grads, geom).unwrap();
            assert_bits(&format!("{case}: dx"), &down(&gpu, &dx_d), &want.dx);
            assert_bits(&format!("{case}: dgamma"), &down(&gpu, &dg_d), &want.dgamma);
            assert_bits(&format!("{case}: dbeta"), &down(&gpu, &db_d), &want.dbeta);
        }
    }
}
