//! Softmax on a GPU: the declaration of kernels/softmax.cu, its checked launches (one warp
//! a row), the op's GPU form (the backward recomputes y from the input), and the check of
//! the kernels on the host against the CPU's. The arithmetic is [`super::cpu`]'s.

use crate::cuda::launch::{check_len, dim, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{Backward, Forward, GpuLayer, Placement};
use crate::Result;
use cudarc::driver::LaunchConfig;

use super::Softmax;

crate::cuda::declare::kernels! {
    "softmax.cu" {
        softmax {
            fwd(x: In, y: Out, rows: Size, c: I32);
            bwd(x: In, dy: In, dx: Out, rows: Size, c: I32);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

/// Threads per block, and lanes (threads) per row: `SM_BLOCK` and `SM_LANES` of
/// kernels/softmax.cu, whose shared arrays are sized for them.
pub const SM_BLOCK: u32 = 256;

pub const SM_LANES: u32 = 32;

/// Launch shape: one warp of SM_LANES threads a row, SM_BLOCK threads a block, so
/// ceil(rows / 8) blocks (`rows > 0`).
fn rows_cfg(op: &'static str, rows: usize) -> Result<LaunchConfig> {
    let blocks = rows.div_ceil((SM_BLOCK / SM_LANES) as usize);
    let blocks = dim(op, "blocks (rows / 8)", blocks)? as u32;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (SM_BLOCK, 1, 1), shared_mem_bytes: 0 })
}

impl Gpu {
    /// y = softmax of each row. x, y: (rows, C)
    pub fn softmax_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, rows: usize, c: usize) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let op = "softmax_fwd";
        check_len(op, "x", x, rows * c)?;
        check_len(op, "y", y, rows * c)?;
        if rows == 0 || c == 0 {
            return Ok(());
        }
        let (ci, cfg) = (dim(op, "C", c)?, rows_cfg(op, rows)?);
        // SAFETY: softmax_fwd_f32(const float* x, float* y, size_t rows, int c); x and y
        // hold rows·C floats (checked); one warp a row, SM_BLOCK threads a block as the
        // kernel's shared arrays are sized.
        unsafe { softmax::fwd(self, cfg, x, y, rows, ci) }
    }

    /// dx = y·(dy − Σ dy·y) per row, y recomputed from x. x, dy, dx: (rows, C)
    pub fn softmax_bwd(
        &self,
        x: &impl DevIn,
        dy: &impl DevIn,
        dx: &mut impl DevOut,
        rows: usize,
        c: usize,
    ) -> Result<()> {
        let (x, dy) = (&x.view(), &dy.view());
        let dx = &mut dx.view_mut();
        let op = "softmax_bwd";
        check_len(op, "x", x, rows * c)?;
        check_len(op, "dy", dy, rows * c)?;
        check_len(op, "dx", dx, rows * c)?;
        if rows == 0 || c == 0 {
            return Ok(());
        }
        let (ci, cfg) = (dim(op, "C", c)?, rows_cfg(op, rows)?);
        // SAFETY: softmax_bwd_f32(const float* x, const float* dy, float* dx, size_t rows,
        // int c); all three hold rows·C floats (checked); one warp a row, SM_BLOCK threads
        // a block as the kernel's shared arrays are sized.
        unsafe { softmax::bwd(self, cfg, x, dy, dx, rows, ci) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of a Softmax layer (its `Layer::gpu`).
pub(super) fn form(_layer: &Softmax) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(SoftmaxGpu))
}

/// Softmax on a GPU: `softmax_fwd`, `softmax_bwd` (which recomputes y from x: nothing is
/// kept).
struct SoftmaxGpu;

/// (rows, C) of a batch of `n` inputs of `place`: C its last dimension.
fn rows(place: &Placement, n: usize) -> (usize, usize) {
    let c = place.input.dims().last().copied().unwrap_or(1);
    (n * place.input.numel() / c.max(1), c)
}

impl GpuLayer for SoftmaxGpu {
    // x: (N, ..., C) → y: same shape
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let (r, c) = rows(f.place, f.n);
        f.gpu.softmax_fwd(f.x, f.y, r, c)
    }

    // dy: (N, ..., C) → dx: same shape
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Some(mut dx) = b.dx else { return Ok(()) };
        let (r, c) = rows(b.place, b.n);
        b.gpu.softmax_bwd(b.x, &b.dy, &mut dx, r, c)
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/softmax.cu run on the host against the CPU's [`super::cpu`], bit
/// for bit (the same f32 and f64 operations in the same order, no contraction, IEEE
/// division; a NaN matches any NaN). (rows, C): 20 rows of 5 (shorter than the 32 lanes), 9
/// rows of 77 (a lane tail of 13), 3 rows of 128, values up to ±30 (e spans 26 decades), a
/// row holding a NaN and one holding −∞; under the kernels' own launch shape.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{Cfg, In, Out, I32, U64};
    use crate::testing::{assert_same, uniform};
    for (rows, c) in [(20usize, 5usize), (9, 77), (3, 128)] {
        let seed = 0x50f + c as u64;
        let mut x: Vec<f32> = uniform(seed, rows * c).iter().map(|v| 30.0 * v).collect();
        let dy = uniform(seed + 1, rows * c);
        (x[c + 1], x[2 * c + 2]) = (f32::NAN, f32::NEG_INFINITY);
        let mut want_y = x.clone();
        super::cpu::softmax_forward(&mut want_y, c);
        let mut want_dx = dy.clone();
        super::cpu::softmax_backward(&mut want_dx, &want_y, c);
        let cfg: Cfg = rows_cfg("softmax host check", rows).unwrap().into();
        let case = format!("softmax ({rows}, {c})");
        let (mut y, mut dx) = (vec![f32::NAN; rows * c], vec![f32::NAN; rows * c]);
        // As Gpu::softmax_fwd pushes them: x, y, rows, c; Gpu::softmax_bwd: x, dy, dx, rows, c.
        k.launch(&softmax::FWD, cfg, &mut [In(&x), Out(&mut y), U64(rows as u64), I32(c as i32)]);
        k.launch(&softmax::BWD, cfg, &mut [In(&x), In(&dy), Out(&mut dx), U64(rows as u64), I32(c as i32)]);
        assert_same(&format!("{case} y"), &y, &want_y);
        assert_same(&format!("{case} dx"), &dx, &want_dx);
    }
}
