//! Tanh on a GPU: the declaration of kernels/tanh.cu, its checked launches, the op's
//! GPU form (the backward recomputes the slope from the input), and its host check.

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::Result;

use super::Tanh;

crate::cuda::declare::kernels! {
    "tanh.cu" {
        tanh {
            fwd(x: In, y: Out, n: Size);
            bwd(x: In, dy: In, dx: Out, n: Size);
        }
    }
}

// ---- checked launches -------------------------------------------------------------------

impl Gpu {
    /// y = tanh(x). x, y: (n)
    pub fn tanh_fwd(&self, x: &impl DevIn, y: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let n = x.len();
        check_len("tanh_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: tanh_fwd_f32(const float*, float*, size_t); x and y hold n floats each
        // (checked above), and the kernel touches indices < n only.
        unsafe { tanh::fwd(self, elem_cfg(n), x, y, n) }
    }

    /// dx = dy·(1 − tanh(x)²). x, dy, dx: (n)
    pub fn tanh_bwd(&self, x: &impl DevIn, dy: &impl DevIn, dx: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let n = x.len();
        check_len("tanh_bwd", "dy", dy, n)?;
        check_len("tanh_bwd", "dx", dx, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: tanh_bwd_f32(const float*, const float*, float*, size_t); all three
        // buffers hold n floats (checked above).
        unsafe { tanh::bwd(self, elem_cfg(n), x, dy, dx, n) }
    }
}

// ---- the GPU form -----------------------------------------------------------------------

/// The GPU form of a Tanh layer (its `Layer::gpu`).
pub(super) fn form(_layer: &Tanh) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(TanhGpu))
}

/// Tanh on a GPU: `tanh_fwd`, `tanh_bwd` (the input decides the slope).
struct TanhGpu;

impl GpuLayer for TanhGpu {
    // x: (N, ...) → y: same shape
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        f.gpu.tanh_fwd(f.x, f.y)
    }

    // dy: (N, ...) → dx: same shape
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        match b.dx {
            Some(mut dx) => b.gpu.tanh_bwd(b.x, &b.dy, &mut dx),
            None => Ok(()),
        }
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/tanh.cu run on the host against the CPU's [`super::cpu`], bit
/// for bit (the same f32 operations in the same order, no contraction on either side; a
/// NaN matches any NaN: `testing::assert_same`): over [−5, 5), both sides of the switch
/// at 0.625 and the saturated tails, with ±0, ±∞, NaN and ±44.5 (e²ᶻ past f32's range),
/// under the launch shape the launches use and under a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfgs, In, Out, U64};
    use crate::testing::{assert_same, uniform};
    let n = 3000;
    let mut x: Vec<f32> = uniform(7, n).iter().map(|v| 5.0 * v).collect();
    let dy = uniform(8, n);
    x[..9].copy_from_slice(&[0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -44.5, 44.5, 0.625, -0.624_999_94]);
    let (mut want_y, mut slope) = (x.clone(), vec![0.0; n]);
    super::cpu::tanh_forward(&mut want_y, Some(&mut slope));
    let mut want_dx = dy.clone();
    super::cpu::tanh_backward(&mut want_dx, &slope);
    for cfg in elem_cfgs(n) {
        let (mut y, mut dx) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        // As Gpu::tanh_fwd pushes them: x, y, n; Gpu::tanh_bwd: x, dy, dx, n.
        k.launch(&tanh::FWD, cfg, &mut [In(&x), Out(&mut y), U64(n as u64)]);
        k.launch(&tanh::BWD, cfg, &mut [In(&x), In(&dy), Out(&mut dx), U64(n as u64)]);
        assert_same(&format!("tanh y {cfg:?}"), &y, &want_y);
        assert_same(&format!("tanh dx {cfg:?}"), &dx, &want_dx);
    }
}
