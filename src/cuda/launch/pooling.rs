//! The checked launches of kernels/pooling.cu: global average pooling and max pooling,
//! forward and backward.
//!
//! Owns: one safe method per kernel of that file, each checking its buffers (against the
//! window geometry [`WindowGeom`] for max pooling) before the typed launch of
//! `cuda::kernels::pooling`. Where a window lies, and which maximum wins a tie, is
//! `nn::window`'s and `nn::pool`'s.

use cudarc::driver::CudaSlice;

use super::{check_len, elem_cfg, DevIn, DevOut, Gpu, WindowGeom};
use crate::cuda::kernels::pooling;
use crate::Result;

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
        unsafe { pooling::global_avgpool::fwd(self, elem_cfg(nc), x, y, nc, hw) }
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
        unsafe { pooling::global_avgpool::bwd(self, elem_cfg(nc * hw), dy, dx, nc, hw) }
    }

    /// Max pooling: y = the maximum of each window, argmax = its index h*W + w in the
    /// plane (ties to the first in row-major order, NaN wins: `nn::pool`).
    /// x: (N, C, H, W) -> y, argmax: (N, C, OH, OW)
    pub fn maxpool2d_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        argmax: &mut CudaSlice<u32>,
        g: &WindowGeom,
    ) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let op = "maxpool2d_fwd";
        let a = g.launch_args(op)?;
        check_len(op, "x", x, g.x_len())?;
        check_len(op, "y", y, g.pooled_len())?;
        check_len(op, "argmax", argmax, g.pooled_len())?;
        if g.pooled_len() == 0 {
            return Ok(());
        }
        let argmax = &mut argmax.as_view_mut();
        // SAFETY: maxpool2d_fwd_f32(const float*, float*, unsigned*, 12 x int); x, y and
        // argmax have the lengths the geometry implies (checked), and the kernel reads x
        // only inside the plane (the window clipped to 0..H, 0..W) and writes y and argmax
        // below N*C*OH*OW.
        unsafe { pooling::maxpool2d::fwd(self, elem_cfg(g.pooled_len()), x, y, argmax, &a) }
    }

    /// Backward of [`Gpu::maxpool2d_fwd`]: `dx[i]` = sum of dy over the outputs whose
    /// argmax is i, in row-major output order; dx is written.
    /// dy, argmax: (N, C, OH, OW) -> dx: (N, C, H, W)
    pub fn maxpool2d_bwd(
        &self,
        dy: &impl DevIn,
        argmax: &CudaSlice<u32>,
        dx: &mut impl DevOut,
        g: &WindowGeom,
    ) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let op = "maxpool2d_bwd";
        let a = g.launch_args(op)?;
        check_len(op, "dy", dy, g.pooled_len())?;
        check_len(op, "argmax", argmax, g.pooled_len())?;
        check_len(op, "dx", dx, g.x_len())?;
        if g.x_len() == 0 {
            return Ok(());
        }
        // SAFETY: maxpool2d_bwd_f32(const float*, const unsigned*, float*, 12 x int);
        // lengths checked; the kernel reads dy and argmax only at oy < OH, ox < OW of its
        // own plane and writes dx below N*C*H*W, one element per thread.
        unsafe { pooling::maxpool2d::bwd(self, elem_cfg(g.x_len()), dy, &argmax.as_view(), dx, &a) }
    }
}
