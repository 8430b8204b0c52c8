//! The optimiser step on a GPU: the launch of kernels/optim.cu for one run of the flat
//! parameters, from the same scalars the CPU optimiser uses.
//!
//! Owns: [`Gpu::optimizer_step`], which checks its buffers and picks SGD's or Adam's
//! kernel by the configuration, then queues its typed launch (`cuda::kernels::optim`,
//! declared with every other kernel). It lives here rather than in `cuda::launch`
//! because it reads [`OptimizerConfig`] and [`StepScalars`]: `cuda` imports nothing of
//! the optimiser, the optimiser builds on `cuda`. The formulas are optim.cu's, held to
//! [`super::Optimizer::update`] by tests/kernels_host.rs.

use super::{OptimizerConfig, StepScalars};
use crate::cuda::kernels::optim;
use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::{Error, Result};

impl Gpu {
    /// One optimiser step on one run of the flat parameters, as the CPU optimiser
    /// (`optim::Optimizer::update`) computes it, from the step's scalars made on the host
    /// by `OptimizerConfig::scalars`. SGD uses `m` as its momentum buffer (written even
    /// without momentum) and ignores `v`. p, grad, m, v: (n)
    pub fn optimizer_step(
        &self,
        config: &OptimizerConfig,
        s: &StepScalars,
        p: &mut impl DevOut,
        grad: &impl DevIn,
        m: &mut impl DevOut,
        v: &mut impl DevOut,
    ) -> Result<()> {
        let p = &mut p.view_mut();
        let grad = &grad.view();
        let m = &mut m.view_mut();
        let n = p.len();
        check_len("optimizer_step", "grad", grad, n)?;
        check_len("optimizer_step", "m", m, n)?;
        if s.t == 0 {
            return Err(Error::config("optimizer step", "t is 1-based; got 0"));
        }
        if n == 0 {
            return Ok(());
        }
        match *config {
            OptimizerConfig::Sgd { momentum, weight_decay, .. } => {
                let first = i32::from(s.t == 1);
                // SAFETY: sgd_step_f32(float* p, const float* grad, float* buf, float
                // step_size, float momentum, float weight_decay, float grad_divisor, int
                // first, size_t n); p, grad and buf hold n floats (checked).
                unsafe {
                    optim::sgd_step::plain(
                        self,
                        elem_cfg(n),
                        p,
                        grad,
                        m,
                        s.step_size,
                        momentum,
                        weight_decay,
                        s.grad_divisor,
                        first,
                        n,
                    )
                }
            }
            OptimizerConfig::Adam { beta1, beta2, eps, weight_decay, .. } => {
                let v = &mut v.view_mut();
                check_len("optimizer_step", "v", v, n)?;
                // SAFETY: adam_step_f32(float* p, const float* grad, float* m, float* v,
                // float step_size, float beta1, float beta2, float eps, float weight_decay,
                // float grad_divisor, float bc2_sqrt, size_t n); the four buffers hold n
                // floats (checked).
                unsafe {
                    optim::adam_step::plain(
                        self,
                        elem_cfg(n),
                        p,
                        grad,
                        m,
                        v,
                        s.step_size,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        s.grad_divisor,
                        s.bc2_sqrt,
                        n,
                    )
                }
            }
        }
    }
}
