//! The checked launches of kernels/elementwise.cu: the residual add, ReLU, GELU, rescaling, the bias adds of
//! convolutions (NCHW) and linear layers (columns) with their reductions, scale and fill.
//!
//! Owns: one safe method per kernel of that file, each checking its buffers' lengths
//! before the typed launch of `cuda::kernels::elementwise`. What the kernels compute is
//! the `.cu` file's; when to call them is the network's (`cuda::net`) and the exchanges'.

use super::{channel_cfg, check_len, dim, elem_cfg, DevIn, DevOut, Gpu};
use crate::cuda::kernels::elementwise;
use crate::Result;

impl Gpu {
    /// y = a + b: a residual block's add, and its backward's fan-in (dx = dbody +
    /// dshortcut). a, b, y: (n)
    pub fn residual_add(&self, a: &impl DevIn, b: &impl DevIn, y: &mut impl DevOut) -> Result<()> {
        let a = &a.view();
        let b = &b.view();
        let y = &mut y.view_mut();
        let n = a.len();
        check_len("residual_add_fwd", "b", b, n)?;
        check_len("residual_add_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: residual_add_fwd_f32(const float*, const float*, float*, size_t); a, b
        // and y hold n floats each (checked above), and the kernel touches indices < n only.
        unsafe { elementwise::residual_add::fwd(self, elem_cfg(n), a, b, y, n) }
    }

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
        unsafe { elementwise::relu::fwd(self, elem_cfg(n), x, y, n) }
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
        unsafe { elementwise::relu::bwd(self, elem_cfg(n), x, dy, dx, n) }
    }

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
        unsafe { elementwise::gelu::fwd(self, elem_cfg(n), x, y, n) }
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
        unsafe { elementwise::gelu::bwd(self, elem_cfg(n), x, dy, dx, n) }
    }

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
        unsafe { elementwise::rescale::fwd(self, elem_cfg(n), x, y, scale, offset, n) }
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
        unsafe { elementwise::rescale::bwd(self, elem_cfg(n), dy, dx, scale, n) }
    }

    /// `y += bias[c]`, in place. y: (N, C, H, W) with hw = H*W; bias: (C)
    pub fn bias_nchw_fwd(&self, y: &mut impl DevOut, bias: &impl DevIn, n: usize, c: usize, hw: usize) -> Result<()> {
        let y = &mut y.view_mut();
        let bias = &bias.view();
        let total = n * c * hw;
        check_len("bias_nchw_fwd", "y", y, total)?;
        check_len("bias_nchw_fwd", "bias", bias, c)?;
        if total == 0 {
            return Ok(());
        }
        let ci = dim("bias_nchw_fwd", "C", c)?;
        // SAFETY: bias_nchw_fwd_f32(float*, const float*, int, size_t, size_t); y holds
        // N*C*HW floats and bias C (checked), and (i / hw) % C < C.
        unsafe { elementwise::bias_nchw::fwd(self, elem_cfg(total), y, bias, ci, hw, total) }
    }

    /// `dbias[c] += Σ_(n,h,w) dy`. dy: (N, C, H, W) with hw = H*W; dbias: (C)
    pub fn bias_nchw_bwd(&self, dy: &impl DevIn, dbias: &mut impl DevOut, n: usize, c: usize, hw: usize) -> Result<()> {
        let dy = &dy.view();
        let dbias = &mut dbias.view_mut();
        check_len("bias_nchw_bwd", "dy", dy, n * c * hw)?;
        check_len("bias_nchw_bwd", "dbias", dbias, c)?;
        if c == 0 {
            return Ok(());
        }
        let (ni, ci) = (dim("bias_nchw_bwd", "N", n)?, dim("bias_nchw_bwd", "C", c)?);
        // SAFETY: bias_nchw_bwd_f32(const float*, float*, int, int, size_t); one block of
        // REDUCE_BLOCK threads per channel as the kernel requires; dy holds N*C*HW floats
        // and dbias C (checked).
        unsafe { elementwise::bias_nchw::bwd(self, channel_cfg(ci), dy, dbias, ni, ci, hw) }
    }

    /// `y += bias[o]`, in place. y: (N, O); bias: (O)
    pub fn bias_cols_fwd(&self, y: &mut impl DevOut, bias: &impl DevIn, n: usize, o: usize) -> Result<()> {
        let y = &mut y.view_mut();
        let bias = &bias.view();
        let total = n * o;
        check_len("bias_cols_fwd", "y", y, total)?;
        check_len("bias_cols_fwd", "bias", bias, o)?;
        if total == 0 {
            return Ok(());
        }
        let oi = dim("bias_cols_fwd", "O", o)?;
        // SAFETY: bias_cols_fwd_f32(float*, const float*, int, size_t); y holds N*O
        // floats, bias O (checked), and i % O < O.
        unsafe { elementwise::bias_cols::fwd(self, elem_cfg(total), y, bias, oi, total) }
    }

    /// `dbias[o] += Σ_n dy[n, o]`. dy: (N, O); dbias: (O)
    pub fn bias_cols_bwd(&self, dy: &impl DevIn, dbias: &mut impl DevOut, n: usize, o: usize) -> Result<()> {
        let dy = &dy.view();
        let dbias = &mut dbias.view_mut();
        check_len("bias_cols_bwd", "dy", dy, n * o)?;
        check_len("bias_cols_bwd", "dbias", dbias, o)?;
        if o == 0 {
            return Ok(());
        }
        let (ni, oi) = (dim("bias_cols_bwd", "N", n)?, dim("bias_cols_bwd", "O", o)?);
        // SAFETY: bias_cols_bwd_f32(const float*, float*, int, int); dy holds N*O floats
        // and dbias O (checked).
        unsafe { elementwise::bias_cols::bwd(self, elem_cfg(o), dy, dbias, ni, oi) }
    }

    /// x *= s, in place. x: (n)
    pub fn scale(&self, x: &mut impl DevOut, s: f32) -> Result<()> {
        let x = &mut x.view_mut();
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        // SAFETY: scale_f32(float*, float, size_t); n is x's length.
        unsafe { elementwise::scale::plain(self, elem_cfg(n), x, s, n) }
    }

    /// x = v everywhere. x: (n)
    pub fn fill(&self, x: &mut impl DevOut, v: f32) -> Result<()> {
        let x = &mut x.view_mut();
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        // SAFETY: fill_f32(float*, float, size_t); n is x's length.
        unsafe { elementwise::fill::plain(self, elem_cfg(n), x, v, n) }
    }
}
