//! The optimiser step on a GPU: the launches of kernels/optim.cu — the update of one run
//! of the flat parameters, from the same scalars the CPU optimiser uses, and the global
//! gradient norm that clipping scales it by.
//!
//! Owns: [`Gpu::optimizer_step`], which checks its buffers and picks SGD's or Adam's
//! kernel by the configuration (AdamW is Adam's kernel with the decoupled `shrink`), then
//! queues its typed launch (declared below, beside them);
//! [`Gpu::grad_norm`] and [`Gpu::clip_factor`], the norm in [`super::GradNorm`]'s
//! association and `clip_grad_norm_`'s factor, left on the device for the update to read
//! (no wait on the host). It lives here rather than in `cuda::launch` because it reads
//! [`OptimizerConfig`] and [`StepScalars`]: `cuda` imports nothing of the optimiser, the
//! optimiser builds on `cuda`. The formulas are optim.cu's, held to
//! [`super::Optimizer::update`] and [`super::GradNorm`] by tests/kernels_host.rs.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use super::{norm_partials, MomentumKind, OptimizerConfig, StepScalars, NORM_LANES};
use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::{Error, Result};

crate::cuda::declare::kernels! {
    "optim.cu" {
        sgd_step {
            plain(
                p: Out, grad: In, buf: Out, clip: OptIn, step_size: F32, momentum: F32, weight_decay: F32,
                grad_divisor: F32, first: I32, nesterov: I32, n: Size,
            );
        }
        adam_step {
            plain(
                p: Out, grad: In, m: Out, v: Out, clip: OptIn, step_size: F32, beta1: F32, beta2: F32, eps: F32,
                weight_decay: F32, shrink: F32, grad_divisor: F32, bc2_sqrt: F32, n: Size,
            );
        }
        grad_norm { plain(grad: In, partials: OutF64, grad_divisor: F32, n: Size); }
        clip_factor { plain(partials: InF64, factor: Out, max_norm: F32, parts: Size); }
    }
}

/// Cap on the blocks of the norm's grid-stride loop over chunks.
const MAX_NORM_BLOCKS: usize = 65_535;

impl Gpu {
    /// One optimiser step on one run of the flat parameters, as the CPU optimiser
    /// (`optim::Optimizer::update`) computes it, from the step's scalars made on the host
    /// by `OptimizerConfig::scalars` (with the run's weight decay) and, when clipping,
    /// the factor [`Gpu::clip_factor`] left in `clip` (None: no clipping; the scalars'
    /// host-side `clip` is not read here). SGD uses `m` as its momentum buffer (written
    /// even without momentum) and ignores `v`. p, grad, m, v: (n); clip: (1)
    #[allow(clippy::too_many_arguments)]
    pub fn optimizer_step(
        &self,
        config: &OptimizerConfig,
        s: &StepScalars,
        p: &mut impl DevOut,
        grad: &impl DevIn,
        m: &mut impl DevOut,
        v: &mut impl DevOut,
        clip: Option<&CudaView<'_, f32>>,
    ) -> Result<()> {
        let p = &mut p.view_mut();
        let grad = &grad.view();
        let m = &mut m.view_mut();
        let n = p.len();
        check_len("optimizer_step", "grad", grad, n)?;
        check_len("optimizer_step", "m", m, n)?;
        if let Some(c) = clip {
            check_len("optimizer_step", "clip", c, 1)?;
        }
        if s.t == 0 {
            return Err(Error::config("optimizer step", "t is 1-based; got 0"));
        }
        if n == 0 {
            return Ok(());
        }
        match *config {
            OptimizerConfig::Sgd { momentum, momentum_kind, .. } => {
                let first = i32::from(s.t == 1);
                let nesterov = i32::from(momentum_kind == MomentumKind::Nesterov);
                // SAFETY: sgd_step_f32(float* p, const float* grad, float* buf, const float*
                // clip, float step_size, float momentum, float weight_decay, float
                // grad_divisor, int first, int nesterov, size_t n); p, grad and buf hold n
                // floats and clip, when given, one (checked); NULL clip is tested before use.
                unsafe {
                    sgd_step::plain(
                        self,
                        elem_cfg(n),
                        p,
                        grad,
                        m,
                        clip,
                        s.step_size,
                        momentum,
                        s.weight_decay,
                        s.grad_divisor,
                        first,
                        nesterov,
                        n,
                    )
                }
            }
            OptimizerConfig::Adam { beta1, beta2, eps, .. } | OptimizerConfig::AdamW { beta1, beta2, eps, .. } => {
                let v = &mut v.view_mut();
                check_len("optimizer_step", "v", v, n)?;
                // SAFETY: adam_step_f32(float* p, const float* grad, float* m, float* v,
                // const float* clip, float step_size, float beta1, float beta2, float eps,
                // float weight_decay, float shrink, float grad_divisor, float bc2_sqrt,
                // size_t n); the four buffers hold n floats and clip, when given, one
                // (checked); NULL clip is tested before use.
                unsafe {
                    adam_step::plain(
                        self,
                        elem_cfg(n),
                        p,
                        grad,
                        m,
                        v,
                        clip,
                        s.step_size,
                        beta1,
                        beta2,
                        eps,
                        s.weight_decay,
                        s.shrink,
                        s.grad_divisor,
                        s.bc2_sqrt,
                        n,
                    )
                }
            }
        }
    }

    /// The partial sums of squares of `grad / grad_divisor`, one per chunk of
    /// [`super::NORM_CHUNK`] values, in [`super::GradNorm`]'s association. A piece of the sum
    /// that starts at chunk k writes `partials` from k: its offset must be a multiple of
    /// NORM_CHUNK. grad: (n) -> partials: (ceil(n / NORM_CHUNK))
    pub fn grad_norm(&self, grad: &impl DevIn, partials: &mut CudaViewMut<'_, f64>, grad_divisor: f32) -> Result<()> {
        let grad = &grad.view();
        let n = grad.len();
        let chunks = norm_partials(n);
        check_len("grad_norm", "partials", partials, chunks)?;
        if n == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (chunks.min(MAX_NORM_BLOCKS) as u32, 1, 1),
            block_dim: (NORM_LANES as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: grad_norm_f32(const float* grad, double* partials, float grad_divisor,
        // size_t n); grad holds n floats and partials ceil(n / NORM_CHUNK) doubles
        // (checked); blocks of NORM_LANES = the kernel's NORM_THREADS threads, its shared
        // array's size.
        unsafe { grad_norm::plain(self, cfg, grad, partials, grad_divisor, n) }
    }

    /// `clip_grad_norm_`'s factor min(1, max_norm / (norm + 1e-6)) from the chunks' sums
    /// [`Gpu::grad_norm`] wrote, added in order, into `factor`, on the device.
    /// partials: (parts) -> factor: (1)
    pub fn clip_factor(&self, partials: &CudaView<'_, f64>, factor: &mut impl DevOut, max_norm: f32) -> Result<()> {
        let factor = &mut factor.view_mut();
        check_len("clip_factor", "factor", factor, 1)?;
        let parts = partials.len();
        // SAFETY: clip_factor_f32(const double* partials, float* factor, float max_norm,
        // size_t parts); partials holds `parts` doubles, factor one float (checked); one
        // thread does the work.
        unsafe { clip_factor::plain(self, elem_cfg(1), partials, factor, max_norm, parts) }
    }
}
