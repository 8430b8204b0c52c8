//! The checked launches of kernels/batchnorm.cu: BatchNorm2d's training and eval
//! forward and its backward, and the synchronized BatchNorm's four kernels (this shard's
//! moments, the forward with the global batch's statistics, this shard's sums for the
//! backward, the backward with the global sums).
//!
//! Owns: the argument structs of those launches (parameters, saved statistics, gradients,
//! the merged statistics and sums of a synchronized pass, the running update's scalars)
//! and one safe method per kernel, each checking every buffer's length against the
//! (N, C, H·W) it is given before the typed launch of `cuda::kernels::batchnorm`. The
//! arithmetic of the running update and of what normalises is `nn::batchnorm`'s; the
//! exchange of a synchronized pass's statistics is `cuda::net`'s and `nn::stats`'.

use cudarc::driver::{CudaView, CudaViewMut};

use super::{channel_cfg, check_len, dim, elem_cfg, DevIn, DevOut, Gpu};
use crate::cuda::kernels::batchnorm;
use crate::{Error, Result};

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
/// channel. The scalars of `nn::batchnorm::RunningUpdate`, the one place they are made
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
    /// normalises (`nn::batchnorm::normaliser`: the mean and 1/sqrt(var + eps) as f32).
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
    /// (`nn::batchnorm::RunningUpdate` of g's momentum and N·H·W values, in f32 here).
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
            batchnorm::batchnorm_train::fwd(
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
        unsafe { batchnorm::batchnorm_count::fwd(self, elem_cfg(n), count, n) }
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
            batchnorm::batchnorm_eval::fwd(
                self,
                elem_cfg(total),
                x,
                y,
                gamma,
                beta,
                running_mean,
                running_var,
                ci,
                hw,
                total,
                eps,
            )
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
            batchnorm::batchnorm_train::bwd(
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
        unsafe { batchnorm::batchnorm_moments::fwd(self, channel_cfg(ci), x, moments, ni, ci, hw) }
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
            batchnorm::batchnorm_sync::fwd(
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
        unsafe {
            batchnorm::batchnorm_sums::bwd(self, channel_cfg(ci), x, dy, &saved.mean, &saved.invstd, sums, ni, ci, hw)
        }
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
            batchnorm::batchnorm_sync::bwd(
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
