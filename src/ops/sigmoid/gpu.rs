//! Sigmoid on a GPU: the declaration of kernels/sigmoid.cu, its checked launches, the op's
//! GPU form (the backward recomputes the slope from the input), and its host check.

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::Result;

use super::Sigmoid;

crate::cuda::declare::kernels! {
    "sigmoid.cu" {
        sigmoid {
            fwd(x: In, y: Out, n: Size);
            bwd(x: In, dy: In, dx: Out, n: Size);
        }
    }
}

// ---- checked launches -------------------------------------------------------------------

impl Gpu {
    /// y = σ(x). x, y: (n)
    pub fn sigmoid_fwd(&self, x: &impl DevIn, y: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let n = x.len();
        check_len("sigmoid_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: sigmoid_fwd_f32(const float*, float*, size_t); x and y hold n floats each
        // (checked above), and the kernel touches indices < n only.
        unsafe { sigmoid::fwd(self, elem_cfg(n), x, y, n) }
    }

    /// dx = dy·σ(x)·(1 − σ(x)). x, dy, dx: (n)
    pub fn sigmoid_bwd(&self, x: &impl DevIn, dy: &impl DevIn, dx: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let n = x.len();
        check_len("sigmoid_bwd", "dy", dy, n)?;
        check_len("sigmoid_bwd", "dx", dx, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: sigmoid_bwd_f32(const float*, const float*, float*, size_t); all three
        // buffers hold n floats (checked above).
        unsafe { sigmoid::bwd(self, elem_cfg(n), x, dy, dx, n) }
    }
}

// ---- the GPU form -----------------------------------------------------------------------

/// The GPU form of a Sigmoid layer (its `Layer::gpu`).
pub(super) fn form(_layer: &Sigmoid) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(SigmoidGpu))
}

/// Sigmoid on a GPU: `sigmoid_fwd`, `sigmoid_bwd` (the input decides the slope).
struct SigmoidGpu;

impl GpuLayer for SigmoidGpu {
    // x: (N, ...) → y: same shape
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        f.gpu.sigmoid_fwd(f.x, f.y)
    }

    // dy: (N, ...) → dx: same shape
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        match b.dx {
            Some(mut dx) => b.gpu.sigmoid_bwd(b.x, &b.dy, &mut dx),
            None => Ok(()),
        }
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/sigmoid.cu run on the host against the CPU's [`super::cpu`], bit
/// for bit (the same f32 operations in the same order, no contraction on either side; a
/// NaN matches any NaN: `testing::assert_same`): over [−100, 100), both saturated tails
/// and the middle, with ±0, ±∞ and NaN, under the launch shape the launches use and under
/// a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfgs, In, Out, U64};
    use crate::testing::{assert_same, uniform};
    let n = 3000;
    let mut x: Vec<f32> = uniform(5, n).iter().map(|v| 100.0 * v).collect();
    let dy = uniform(6, n);
    x[..7].copy_from_slice(&[0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -87.5, 88.5]);
    let (mut want_y, mut slope) = (x.clone(), vec![0.0; n]);
    super::cpu::sigmoid_forward(&mut want_y, Some(&mut slope));
    let mut want_dx = dy.clone();
    super::cpu::sigmoid_backward(&mut want_dx, &slope);
    for cfg in elem_cfgs(n) {
        let (mut y, mut dx) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        // As Gpu::sigmoid_fwd pushes them: x, y, n; Gpu::sigmoid_bwd: x, dy, dx, n.
        k.launch(&sigmoid::FWD, cfg, &mut [In(&x), Out(&mut y), U64(n as u64)]);
        k.launch(&sigmoid::BWD, cfg, &mut [In(&x), In(&dy), Out(&mut dx), U64(n as u64)]);
        assert_same(&format!("sigmoid y {cfg:?}"), &y, &want_y);
        assert_same(&format!("sigmoid dx {cfg:?}"), &dx, &want_dx);
    }
}
