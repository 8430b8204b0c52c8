//! GELU on a GPU: the declaration of kernels/gelu.cu, its checked launches, and the op's GPU
//! form. The kernels follow the CPU's expressions in its order (`super`'s docs say why).

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
