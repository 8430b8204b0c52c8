//! Global average pooling on a GPU: the declaration of kernels/global_avg_pool.cu, its
//! checked launches, and the op's GPU form.

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::Result;

use super::*;

crate::cuda::declare::kernels! {
    "global_avg_pool.cu" {
        global_avgpool {
            fwd(x: In, y: Out, nc: Size, hw: Size);
            bwd(dy: In, dx: Out, nc: Size, hw: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// x: (N, C, H, W) with nc = N*C, hw = H*W -> y: (N, C), the spatial mean.
    pub fn global_avgpool_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, nc: usize, hw: usize) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        check_len("global_avgpool_fwd", "x", x, nc * hw)?;
        check_len("global_avgpool_fwd", "y", y, nc)?;
        if nc == 0 {
            return Ok(());
        }
        // SAFETY: global_avgpool_fwd_f32(const float*, float*, size_t, size_t); x holds
        // nc*hw floats and y nc (checked).
        unsafe { global_avgpool::fwd(self, elem_cfg(nc), x, y, nc, hw) }
    }

    /// dy: (N, C) -> dx: (N, C, H, W) = dy / (H*W), written.
    pub fn global_avgpool_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, nc: usize, hw: usize) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        check_len("global_avgpool_bwd", "dy", dy, nc)?;
        check_len("global_avgpool_bwd", "dx", dx, nc * hw)?;
        if nc * hw == 0 {
            return Ok(());
        }
        // SAFETY: global_avgpool_bwd_f32(const float*, float*, size_t, size_t); lengths
        // checked.
        unsafe { global_avgpool::bwd(self, elem_cfg(nc * hw), dy, dx, nc, hw) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(_layer: &GlobalAvgPool2d) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(GlobalAvgPool2dGpu))
}

/// The spatial mean on a GPU: `global_avgpool_fwd`, `global_avgpool_bwd`.
pub(super) struct GlobalAvgPool2dGpu;

impl GpuLayer for GlobalAvgPool2dGpu {
    // x: (N, C, H, W) → y: (N, C)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let c = f.node.output.numel();
        f.gpu.global_avgpool_fwd(f.x, f.y, f.n * c, f.node.input.numel() / c)
    }

    // dy: (N, C) → dx: (N, C, H, W)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let c = b.node.output.numel();
        match b.dx {
            Some(mut dx) => b.gpu.global_avgpool_bwd(&b.dy, &mut dx, b.n * c, b.node.input.numel() / c),
            None => Ok(()),
        }
    }
}
