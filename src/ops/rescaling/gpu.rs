//! Rescaling on a GPU: the declaration of kernels/rescaling.cu, its checked launches, and
//! the op's GPU form.

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::Result;

use super::*;

crate::cuda::declare::kernels! {
    "rescaling.cu" {
        rescale {
            fwd(x: In, y: Out, scale: F32, offset: F32, n: Size);
            bwd(dy: In, dx: Out, scale: F32, n: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// y = x * scale + offset. x, y: (n)
    pub fn rescale_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, scale: f32, offset: f32) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let n = x.len();
        check_len("rescale_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: rescale_fwd_f32(const float*, float*, float, float, size_t); x and y
        // hold n floats (checked above).
        unsafe { rescale::fwd(self, elem_cfg(n), x, y, scale, offset, n) }
    }

    /// dx = dy * scale. dy, dx: (n)
    pub fn rescale_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, scale: f32) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let n = dy.len();
        check_len("rescale_bwd", "dx", dx, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: rescale_bwd_f32(const float*, float*, float, size_t); dy and dx hold n
        // floats (checked above).
        unsafe { rescale::bwd(self, elem_cfg(n), dy, dx, scale, n) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &Rescaling) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(RescalingGpu { scale: layer.scale, offset: layer.offset }))
}

/// Rescaling on a GPU: `rescale_fwd`, `rescale_bwd`.
pub(super) struct RescalingGpu {
    scale: f32,
    offset: f32,
}

impl GpuLayer for RescalingGpu {
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        f.gpu.rescale_fwd(f.x, f.y, self.scale, self.offset)
    }

    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        match b.dx {
            Some(mut dx) => b.gpu.rescale_bwd(&b.dy, &mut dx, self.scale),
            None => Ok(()),
        }
    }
}
