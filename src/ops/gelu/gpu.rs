//! GELU on a GPU: the declaration of kernels/gelu.cu, its checked launches, and the op's GPU
//! form. The kernels follow the CPU's expressions in its order (`super::cpu`'s docs say why).

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::Result;

use super::*;

crate::cuda::declare::kernels! {
    "gelu.cu" {
        gelu {
            fwd(x: In, y: Out, n: Size);
            bwd(x: In, dy: In, dx: Out, n: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// y = x * Phi(x) (exact GELU). x, y: (n)
    pub fn gelu_fwd(&self, x: &impl DevIn, y: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let n = x.len();
        check_len("gelu_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: gelu_fwd_f32(const float*, float*, size_t); x and y hold n floats each
        // (checked above), and the kernel touches indices < n only.
        unsafe { gelu::fwd(self, elem_cfg(n), x, y, n) }
    }

    /// dx = dy * (Phi(x) + x * phi(x)). x, dy, dx: (n)
    pub fn gelu_bwd(&self, x: &impl DevIn, dy: &impl DevIn, dx: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let n = x.len();
        check_len("gelu_bwd", "dy", dy, n)?;
        check_len("gelu_bwd", "dx", dx, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: gelu_bwd_f32(const float*, const float*, float*, size_t); all three
        // buffers hold n floats (checked above).
        unsafe { gelu::bwd(self, elem_cfg(n), x, dy, dx, n) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(_layer: &Gelu) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(GeluGpu))
}

/// GELU on a GPU: `gelu_fwd`, `gelu_bwd` (the network keeps the forward's input, which
/// the gradient is computed from).
pub(super) struct GeluGpu;

impl GpuLayer for GeluGpu {
    // x: (N, ...) → y: same shape
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        f.gpu.gelu_fwd(f.x, f.y)
    }

    // dy: (N, ...) → dx: same shape
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        match b.dx {
            Some(mut dx) => b.gpu.gelu_bwd(b.x, &b.dy, &mut dx),
            None => Ok(()),
        }
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/gelu.cu run on the host against the CPU's [`super::cpu`], value by
/// value: over [−10, 10) (both tails and the middle), then the signed zeros, the far tail
/// (y and dx round to −0), the infinities and a NaN, under the launch shape the launches
/// use and under a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfgs, In, Out, U64};
    use crate::testing::{assert_bits, uniform};
    let n = 3000;
    let mut x: Vec<f32> = uniform(21, n).iter().map(|v| 10.0 * v).collect();
    let dy = uniform(22, n);
    x[..8].copy_from_slice(&[0.0, -0.0, -20.0, 1e-3, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -8.0]);
    // The CPU's forward as a training step runs it (keeping the slopes), then its backward.
    let (mut want_y, mut slope) = (x.clone(), vec![0.0; n]);
    super::cpu::gelu_forward(&mut want_y, Some(&mut slope));
    let mut want_dx = dy.clone();
    super::cpu::gelu_backward(&mut want_dx, &slope);
    // Both sides evaluate the same f32 operations in the same order, uncontracted (erfcc's
    // polynomial by Estrin's scheme, exp by Cephes' polynomial, no library function), so
    // the results are equal bit for bit, here and on a GPU. A NaN's sign and payload are
    // the compiler's choice of operand order (and the GPU's NaN is canonical), so NaNs
    // compare as NaNs.
    let canonical = |v: &[f32]| v.iter().map(|&x| if x.is_nan() { f32::NAN } else { x }).collect::<Vec<_>>();
    for cfg in elem_cfgs(n) {
        let (mut y, mut dx) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        // As Gpu::gelu_fwd pushes them: x, y, n; Gpu::gelu_bwd: x, dy, dx, n.
        k.launch(&gelu::FWD, cfg, &mut [In(&x), Out(&mut y), U64(n as u64)]);
        k.launch(&gelu::BWD, cfg, &mut [In(&x), In(&dy), Out(&mut dx), U64(n as u64)]);
        assert_bits(&format!("gelu y {cfg:?}"), &canonical(&y), &canonical(&want_y));
        assert_bits(&format!("gelu dx {cfg:?}"), &canonical(&dx), &canonical(&want_dx));
    }
}
