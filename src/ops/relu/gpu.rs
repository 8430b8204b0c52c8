//! ReLU on a GPU: the declaration of kernels/relu.cu, its checked launches, and the op's
//! GPU form (the input decides the gradient's mask, as on the CPU).

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::Result;

use super::*;

crate::cuda::declare::kernels! {
    "relu.cu" {
        relu {
            fwd(x: In, y: Out, n: Size);
            bwd(x: In, dy: In, dx: Out, n: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// y = max(x, 0). x, y: (n)
    pub fn relu_fwd(&self, x: &impl DevIn, y: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let n = x.len();
        check_len("relu_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: relu_fwd_f32(const float*, float*, size_t); x and y hold n floats each
        // (checked above), and the kernel touches indices < n only.
        unsafe { relu::fwd(self, elem_cfg(n), x, y, n) }
    }

    /// dx = dy where x > 0, else 0. x, dy, dx: (n)
    pub fn relu_bwd(&self, x: &impl DevIn, dy: &impl DevIn, dx: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let n = x.len();
        check_len("relu_bwd", "dy", dy, n)?;
        check_len("relu_bwd", "dx", dx, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: relu_bwd_f32(const float*, const float*, float*, size_t); all three
        // buffers hold n floats (checked above).
        unsafe { relu::bwd(self, elem_cfg(n), x, dy, dx, n) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(_layer: &Relu) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(ReluGpu))
}

/// ReLU on a GPU: `relu_fwd`, `relu_bwd` (the input decides the gradient's mask).
pub(super) struct ReluGpu;

impl GpuLayer for ReluGpu {
    // x: (N, ...) → y: same shape
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        f.gpu.relu_fwd(f.x, f.y)
    }

    // dy: (N, ...) → dx: same shape
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        match b.dx {
            Some(mut dx) => b.gpu.relu_bwd(b.x, &b.dy, &mut dx),
            None => Ok(()),
        }
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/relu.cu run on the host against the CPU's [`super::cpu`], bit for
/// bit: a comparison and a copy, with the values where the two could part (±0, NaN, ±∞),
/// under the launch shape the launches use and under a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfgs, In, Out, U64};
    use crate::testing::{assert_bits, uniform};
    let n = 3000;
    let (mut x, dy) = (uniform(1, n), uniform(2, n));
    x[..6].copy_from_slice(&[0.0, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -1e-30]);
    let (mut want_y, mut mask) = (x.clone(), vec![0u8; n]);
    super::cpu::relu_forward(&mut want_y, Some(&mut mask));
    let mut want_dx = dy.clone();
    super::cpu::relu_backward(&mut want_dx, &mask);
    for cfg in elem_cfgs(n) {
        let (mut y, mut dx) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        // As Gpu::relu_fwd pushes them: x, y, n; Gpu::relu_bwd: x, dy, dx, n.
        k.launch(&relu::FWD, cfg, &mut [In(&x), Out(&mut y), U64(n as u64)]);
        k.launch(&relu::BWD, cfg, &mut [In(&x), In(&dy), Out(&mut dx), U64(n as u64)]);
        assert_bits(&format!("relu y {cfg:?}"), &y, &want_y);
        assert_bits(&format!("relu dx {cfg:?}"), &dx, &want_dx);
    }
}
