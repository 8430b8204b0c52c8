//! SiLU on a GPU: the declaration of kernels/silu.cu, its checked launches, the op's GPU
//! form (the backward recomputes the slope from the input), and its host check.

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::Result;

use super::Silu;

crate::cuda::declare::kernels! {
    "silu.cu" {
        silu {
            fwd(x: In, y: Out, n: Size);
            bwd(x: In, dy: In, dx: Out, n: Size);
        }
    }
}

// ---- checked launches -------------------------------------------------------------------

impl Gpu {
    /// y = x·σ(x). x, y: (n)
    pub fn silu_fwd(&self, x: &impl DevIn, y: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let n = x.len();
        check_len("silu_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: silu_fwd_f32(const float*, float*, size_t); x and y hold n floats each
        // (checked above), and the kernel touches indices < n only.
        unsafe { silu::fwd(self, elem_cfg(n), x, y, n) }
    }

    /// dx = dy·σ(x)·(1 + x·(1 − σ(x))). x, dy, dx: (n)
    pub fn silu_bwd(&self, x: &impl DevIn, dy: &impl DevIn, dx: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let n = x.len();
        check_len("silu_bwd", "dy", dy, n)?;
        check_len("silu_bwd", "dx", dx, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: silu_bwd_f32(const float*, const float*, float*, size_t); all three
        // buffers hold n floats (checked above).
        unsafe { silu::bwd(self, elem_cfg(n), x, dy, dx, n) }
    }
}

// ---- the GPU form -----------------------------------------------------------------------

/// The GPU form of a SiLU layer (its `Layer::gpu`).
pub(super) fn form(_layer: &Silu) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(SiluGpu))
}

/// SiLU on a GPU: `silu_fwd`, `silu_bwd` (the input decides the slope).
struct SiluGpu;

impl GpuLayer for SiluGpu {
    // x: (N, ...) → y: same shape
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        f.gpu.silu_fwd(f.x, f.y)
    }

    // dy: (N, ...) → dx: same shape
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        match b.dx {
            Some(mut dx) => b.gpu.silu_bwd(b.x, &b.dy, &mut dx),
            None => Ok(()),
        }
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/silu.cu run on the host against the CPU's [`super::cpu`], bit for
/// bit (the same f32 operations in the same order, no contraction on either side; a NaN
/// matches any NaN, whose sign the operands' order decides: `testing::assert_same`): over
/// [−100, 100), both saturated tails and the middle, with ±0, ±∞ and NaN, under the launch
/// shape the launches use and under a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfgs, In, Out, U64};
    use crate::testing::{assert_same, uniform};
    let n = 3000;
    let mut x: Vec<f32> = uniform(3, n).iter().map(|v| 100.0 * v).collect();
    let dy = uniform(4, n);
    x[..7].copy_from_slice(&[0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -87.5, 88.5]);
    let (mut want_y, mut slope) = (x.clone(), vec![0.0; n]);
    super::cpu::silu_forward(&mut want_y, Some(&mut slope));
    let mut want_dx = dy.clone();
    super::cpu::silu_backward(&mut want_dx, &slope);
    for cfg in elem_cfgs(n) {
        let (mut y, mut dx) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        // As Gpu::silu_fwd pushes them: x, y, n; Gpu::silu_bwd: x, dy, dx, n.
        k.launch(&silu::FWD, cfg, &mut [In(&x), Out(&mut y), U64(n as u64)]);
        k.launch(&silu::BWD, cfg, &mut [In(&x), In(&dy), Out(&mut dx), U64(n as u64)]);
        assert_same(&format!("silu y {cfg:?}"), &y, &want_y);
        assert_same(&format!("silu dx {cfg:?}"), &dx, &want_dx);
    }
}
