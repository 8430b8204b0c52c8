//! The checked launches of kernels/conv.cu: im2col and its adjoint col2im, which turn a
//! convolution into the GEMMs of `cuda::gemm`.
//!
//! Owns: one safe method per kernel of that file, each checking its buffers against the
//! window geometry ([`WindowGeom`], shared with pooling) before the typed launch of
//! `cuda::kernels::conv`.

use super::{check_len, elem_cfg, DevIn, DevOut, Gpu, WindowGeom};
use crate::cuda::kernels::conv;
use crate::Result;

impl Gpu {
    /// x: (N, C, H, W) -> col: (N, C*KH*KW, OH*OW), the CPU backend's layout.
    pub fn im2col_fwd(&self, x: &impl DevIn, col: &mut impl DevOut, g: &WindowGeom) -> Result<()> {
        let x = &x.view();
        let col = &mut col.view_mut();
        let a = g.launch_args("im2col_fwd")?;
        check_len("im2col_fwd", "x", x, g.x_len())?;
        check_len("im2col_fwd", "col", col, g.col_len())?;
        if g.col_len() == 0 {
            return Ok(());
        }
        // SAFETY: im2col_fwd_f32(const float*, float*, 12 x int); x and col have the
        // lengths the geometry implies (checked), and the kernel reads x only at in-bounds
        // (y, x) and writes col below N*C*KH*KW*OH*OW.
        unsafe { conv::im2col::fwd(self, elem_cfg(g.col_len()), x, col, &a) }
    }

    /// col2im: dcol: (N, C*KH*KW, OH*OW) -> dx: (N, C, H, W), dx written.
    pub fn im2col_bwd(&self, dcol: &impl DevIn, dx: &mut impl DevOut, g: &WindowGeom) -> Result<()> {
        let dcol = &dcol.view();
        let dx = &mut dx.view_mut();
        let a = g.launch_args("im2col_bwd")?;
        check_len("im2col_bwd", "dcol", dcol, g.col_len())?;
        check_len("im2col_bwd", "dx", dx, g.x_len())?;
        if g.x_len() == 0 {
            return Ok(());
        }
        // SAFETY: im2col_bwd_f32(const float*, float*, 12 x int); lengths checked; the
        // kernel reads dcol only at oy < OH, ox < OW, and writes dx below N*C*H*W.
        unsafe { conv::im2col::bwd(self, elem_cfg(g.x_len()), dcol, dx, &a) }
    }
}
