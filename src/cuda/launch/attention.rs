//! The checked launches of kernels/attention.cu: causal self-attention's head split and
//! merge, and its causal softmax with the softmax's gradient.
//!
//! Owns: [`HeadsGeom`], [`ATTENTION_BLOCK`] and one safe method per kernel, each checking
//! its buffers against the shapes before the typed launch of `cuda::kernels::attention`.
//! What to launch when (and the products around these, cuBLAS's) is `nn::attention`'s GPU
//! form; the arithmetic is the `.cu` file's, held to `nn::attention`'s CPU rows.

use cudarc::driver::LaunchConfig;

use super::{check_len, dim, elem_cfg, DevIn, DevOut, Gpu, MAX_BLOCKS};
use crate::cuda::kernels::attention;
use crate::{Error, Result};

/// Threads per block of the softmax kernels; must equal `ATTENTION_BLOCK` in
/// kernels/attention.cu.
pub const ATTENTION_BLOCK: u32 = 128;

/// The layout the head kernels move between: N samples of T positions, each row `parts`
/// tensors of `heads` heads of width `hd` side by side ((N, T, P·H·D) against
/// (P, N, H, T, D)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadsGeom {
    pub n: usize,
    pub t: usize,
    pub parts: usize,
    pub heads: usize,
    pub hd: usize,
}

impl HeadsGeom {
    /// Elements of either layout: P·N·H·T·D.
    pub fn len(&self) -> usize {
        self.parts * self.n * self.heads * self.t * self.hd
    }

    /// True when either layout holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// N, T, P, H, D as the kernels' ints.
    fn args(&self, op: &'static str) -> Result<[i32; 5]> {
        Ok([
            dim(op, "N", self.n)?,
            dim(op, "T", self.t)?,
            dim(op, "P", self.parts)?,
            dim(op, "H", self.heads)?,
            dim(op, "D", self.hd)?,
        ])
    }
}

/// One block of [`ATTENTION_BLOCK`] threads per row, at most `MAX_BLOCKS` blocks (the
/// kernels loop over the rest).
fn row_cfg(rows: usize) -> LaunchConfig {
    let blocks = rows.clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (ATTENTION_BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// The rows of (rows, T) scores in a buffer of `len` values, checked.
fn rows_of(op: &'static str, len: usize, t: usize) -> Result<i32> {
    if t == 0 || !len.is_multiple_of(t) {
        return Err(Error::shape(op, format!("{len} values are not rows of T = {t}")));
    }
    dim(op, "rows", len / t)
}

impl Gpu {
    /// The head split: x (N, T, P·H·D) → y (P, N, H, T, D).
    pub fn attention_heads_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, g: HeadsGeom) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let op = "attention_heads_fwd";
        check_len(op, "x", x, g.len())?;
        check_len(op, "y", y, g.len())?;
        if g.is_empty() {
            return Ok(());
        }
        let [n, t, parts, heads, hd] = g.args(op)?;
        // SAFETY: attention_heads_fwd_f32(const float*, float*, int, int, int, int, int); x
        // and y hold P·N·H·T·D floats each (checked), which is every index the kernel forms.
        unsafe { attention::attention_heads::fwd(self, elem_cfg(g.len()), x, y, n, t, parts, heads, hd) }
    }

    /// The head merge, the split's adjoint: dy (P, N, H, T, D) → dx (N, T, P·H·D).
    pub fn attention_heads_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, g: HeadsGeom) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let op = "attention_heads_bwd";
        check_len(op, "dy", dy, g.len())?;
        check_len(op, "dx", dx, g.len())?;
        if g.is_empty() {
            return Ok(());
        }
        let [n, t, parts, heads, hd] = g.args(op)?;
        // SAFETY: attention_heads_bwd_f32(const float*, float*, int, int, int, int, int); dy
        // and dx hold P·N·H·T·D floats each (checked).
        unsafe { attention::attention_heads::bwd(self, elem_cfg(g.len()), dy, dx, n, t, parts, heads, hd) }
    }

    /// The causal softmax of scale·s over each row of T, row r at position r mod T.
    /// s, p: (rows, T), rows = N·H·T.
    pub fn attention_softmax_fwd(&self, s: &impl DevIn, p: &mut impl DevOut, t: usize, scale: f32) -> Result<()> {
        let s = &s.view();
        let p = &mut p.view_mut();
        let op = "attention_softmax_fwd";
        check_len(op, "p", p, s.len())?;
        if s.is_empty() {
            return Ok(());
        }
        let rows = rows_of(op, s.len(), t)?;
        let ti = dim(op, "T", t)?;
        // SAFETY: attention_softmax_fwd_f32(const float*, float*, int, int, float); s and p
        // hold rows·T floats (checked); the launch is ATTENTION_BLOCK threads a block, the
        // size of the kernel's shared array.
        unsafe { attention::attention_softmax::fwd(self, row_cfg(rows as usize), s, p, rows, ti, scale) }
    }

    /// The softmax's gradient by the scores, scaled. p, dp, ds: (rows, T).
    pub fn attention_softmax_bwd(
        &self,
        p: &impl DevIn,
        dp: &impl DevIn,
        ds: &mut impl DevOut,
        t: usize,
        scale: f32,
    ) -> Result<()> {
        let p = &p.view();
        let dp = &dp.view();
        let ds = &mut ds.view_mut();
        let op = "attention_softmax_bwd";
        check_len(op, "dp", dp, p.len())?;
        check_len(op, "ds", ds, p.len())?;
        if p.is_empty() {
            return Ok(());
        }
        let rows = rows_of(op, p.len(), t)?;
        let ti = dim(op, "T", t)?;
        // SAFETY: attention_softmax_bwd_f32(const float*, const float*, float*, int, int,
        // float); all three hold rows·T floats (checked); ATTENTION_BLOCK threads a block.
        unsafe { attention::attention_softmax::bwd(self, row_cfg(rows as usize), p, dp, ds, rows, ti, scale) }
    }
}
