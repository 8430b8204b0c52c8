//! RMSNorm on a GPU: the declaration of kernels/rmsnorm.cu, the checked launches of its
//! kernels (one warp a row; the weight's gradient, two kernels in a fixed order, one
//! method), the op's GPU form, and the check of the kernels on the host against the CPU's.
//! The arithmetic and the chunk size of the ordered sums are [`super::cpu`]'s.

use crate::cuda::launch::{check_len, dim, elem_cfg, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{Backward, Forward, GpuLayer, Placement};
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig};

use super::cpu::ROW_CHUNK;
use super::RmsNorm;

crate::cuda::declare::kernels! {
    "rmsnorm.cu" {
        rmsnorm {
            fwd(x: In, y: Out, weight: In, rstd: OutF64, rows: Size, c: I32, eps: F32);
            bwd(x: In, dy: In, dx: Out, weight: In, rstd: InF64, rows: Size, c: I32);
        }
        rmsnorm_partial {
            bwd(x: In, dy: In, rstd: InF64, partials: OutF64, rows: Size, c: I32, chunk: I32);
        }
        rmsnorm_params {
            bwd(partials: InF64, dweight: Out, chunks: Size, c: I32);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

/// Threads per block of the row kernels, and lanes (threads) per row: `RMS_BLOCK` and
/// `RMS_LANES` of kernels/rmsnorm.cu, whose shared arrays are sized for them.
pub const RMS_BLOCK: u32 = 256;

pub const RMS_LANES: u32 = 32;

/// Launch shape of the row kernels: one warp of RMS_LANES threads a row, RMS_BLOCK threads
/// a block, so ceil(rows / 8) blocks (`rows > 0`).
fn rows_cfg(op: &'static str, rows: usize) -> Result<LaunchConfig> {
    let blocks = rows.div_ceil((RMS_BLOCK / RMS_LANES) as usize);
    let blocks = dim(op, "blocks (rows / 8)", blocks)? as u32;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (RMS_BLOCK, 1, 1), shared_mem_bytes: 0 })
}

impl Gpu {
    /// Forward: y = x·rstd·w per row, each row's rstd saved.
    /// x, y: (rows, C); weight: (C); rstd: (rows)
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        weight: &impl DevIn,
        rstd: &mut CudaViewMut<'_, f64>,
        rows: usize,
        c: usize,
        eps: f32,
    ) -> Result<()> {
        let (x, weight) = (&x.view(), &weight.view());
        let y = &mut y.view_mut();
        let op = "rmsnorm_fwd";
        check_len(op, "x", x, rows * c)?;
        check_len(op, "y", y, rows * c)?;
        check_len(op, "weight", weight, c)?;
        check_len(op, "rstd", rstd, rows)?;
        if rows == 0 || c == 0 {
            return Ok(());
        }
        let ci = dim(op, "C", c)?;
        let cfg = rows_cfg(op, rows)?;
        // SAFETY: rmsnorm_fwd_f32(const float* x, float* y, const float* weight, double*
        // rstd, size_t rows, int c, float eps); x and y hold rows·C floats, weight C, rstd
        // rows doubles (checked); the grid covers the rows with one warp each, RMS_BLOCK
        // threads a block as the kernel's shared array is sized.
        unsafe { rmsnorm::fwd(self, cfg, x, y, weight, rstd, rows, ci, eps) }
    }

    /// Backward's input gradient from the forward's input `x` and saved rstd:
    /// dx = rstd·(g − x̂·mean(g·x̂)), g = dy·w, per row.
    /// x, dy, dx: (rows, C); weight: (C); rstd: (rows)
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_bwd(
        &self,
        x: &impl DevIn,
        dy: &impl DevIn,
        dx: &mut impl DevOut,
        weight: &impl DevIn,
        rstd: &CudaView<'_, f64>,
        rows: usize,
        c: usize,
    ) -> Result<()> {
        let (x, dy, weight) = (&x.view(), &dy.view(), &weight.view());
        let dx = &mut dx.view_mut();
        let op = "rmsnorm_bwd";
        for (what, buf) in [("x", x), ("dy", dy)] {
            check_len(op, what, buf, rows * c)?;
        }
        check_len(op, "dx", dx, rows * c)?;
        check_len(op, "weight", weight, c)?;
        check_len(op, "rstd", rstd, rows)?;
        if rows == 0 || c == 0 {
            return Ok(());
        }
        let ci = dim(op, "C", c)?;
        let cfg = rows_cfg(op, rows)?;
        // SAFETY: rmsnorm_bwd_f32(const float* x, const float* dy, float* dx, const float*
        // weight, const double* rstd, size_t rows, int c); x, dy and dx hold rows·C
        // floats, weight C, rstd rows doubles (checked); one warp a row, RMS_BLOCK threads
        // a block as the kernel's shared array is sized.
        unsafe { rmsnorm::bwd(self, cfg, x, dy, dx, weight, rstd, rows, ci) }
    }

    /// Backward's weight gradient: dweight += Σ_rows dy·x̂ (C), the rows summed in chunks
    /// of `chunk` (`ops::rmsnorm::cpu::ROW_CHUNK`), the chunks' sums in chunk order
    /// (`partials`, (ceil(rows / chunk), C) doubles, is their workspace).
    /// x, dy: (rows, C); rstd: (rows); dweight: (C)
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_params_bwd(
        &self,
        x: &impl DevIn,
        dy: &impl DevIn,
        rstd: &CudaView<'_, f64>,
        partials: &mut CudaViewMut<'_, f64>,
        dweight: &mut impl DevOut,
        rows: usize,
        c: usize,
        chunk: usize,
    ) -> Result<()> {
        let (x, dy) = (&x.view(), &dy.view());
        let dweight = &mut dweight.view_mut();
        let op = "rmsnorm_params_bwd";
        if chunk == 0 {
            return Err(Error::shape(op, "the chunk of rows must be positive"));
        }
        let chunks = rows.div_ceil(chunk);
        for (what, buf) in [("x", x), ("dy", dy)] {
            check_len(op, what, buf, rows * c)?;
        }
        check_len(op, "rstd", rstd, rows)?;
        check_len(op, "partials", partials, chunks * c)?;
        check_len(op, "dweight", dweight, c)?;
        if rows == 0 || c == 0 {
            return Ok(());
        }
        let (ci, chunk_i) = (dim(op, "C", c)?, dim(op, "chunk", chunk)?);
        // SAFETY: rmsnorm_partial_bwd_f32(const float* x, const float* dy, const double*
        // rstd, double* partials, size_t rows, int c, int chunk); x and dy hold rows·C
        // floats, rstd rows doubles, partials ceil(rows / chunk)·C doubles (checked); a
        // grid-stride loop over ceil(rows / chunk)·C, any grid.
        unsafe { rmsnorm_partial::bwd(self, elem_cfg(chunks * c), x, dy, rstd, partials, rows, ci, chunk_i) }?;
        // SAFETY: rmsnorm_params_bwd_f32(const double* partials, float* dweight, size_t
        // chunks, int c); partials holds chunks·C doubles (chunks ≥ 1, as rows > 0),
        // dweight C floats (checked); a grid-stride loop over C, any grid.
        let partials = &partials.as_view();
        unsafe { rmsnorm_params::bwd(self, elem_cfg(c), partials, dweight, chunks, ci) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &RmsNorm) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(RmsNormGpu { width: layer.width, eps: layer.eps, saved: None }))
}

/// RMSNorm on a GPU: `rmsnorm_fwd` normalises each row (one warp a row) and saves its rstd
/// in f64; `rmsnorm_bwd` writes dx from it and the forward's input, and
/// `rmsnorm_partial_bwd` then `rmsnorm_params_bwd` sum dweight over the rows in the CPU's
/// chunk order: [`super::cpu`]'s arithmetic, operation for operation.
struct RmsNormGpu {
    width: usize,
    eps: f32,
    /// Each row's rstd (rows) from the last forward, and the chunks' column sums
    /// (chunks, C) of the backward, sized by `reserve` for the batch.
    saved: Option<(CudaSlice<f64>, CudaSlice<f64>)>,
}

impl RmsNormGpu {
    fn rows(&self, place: &Placement, n: usize) -> usize {
        n * place.input.numel() / self.width.max(1)
    }
}

impl GpuLayer for RmsNormGpu {
    fn reserve(&mut self, gpu: &Gpu, place: &Placement, n: usize) -> Result<()> {
        let rows = self.rows(place, n);
        let stream = gpu.stream();
        self.saved = None;
        let rstd = stream.alloc_zeros(rows.max(1))?;
        let partials = stream.alloc_zeros((rows.div_ceil(ROW_CHUNK) * self.width).max(1))?;
        self.saved = Some((rstd, partials));
        Ok(())
    }

    // x: (N, ..., C) → y: same shape; rstd: (rows) saved (in evaluation too, where no
    // backward reads it)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let rows = self.rows(f.place, f.n);
        let weight = f.param(0);
        let (rstd, _) = self.saved.as_mut().expect("reserved before the pass");
        f.gpu.rmsnorm_fwd(f.x, f.y, &weight, &mut rstd.slice_mut(0..rows), rows, self.width, self.eps)
    }

    // dy: (N, ..., C) → dx: same shape (written); dweight: (C) (accumulated)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let (rows, c) = (self.rows(b.place, b.n), self.width);
        let Backward { gpu, place, params, x, dy, dx, grads, .. } = b;
        let weight = params.slice(place.params[0].clone());
        let (rstd, partials) = self.saved.as_mut().expect("reserved before the pass");
        let rstd = rstd.slice(0..rows);
        if let Some(mut dx) = dx {
            gpu.rmsnorm_bwd(x, &dy, &mut dx, &weight, &rstd, rows, c)?;
        }
        let partials = &mut partials.slice_mut(0..rows.div_ceil(ROW_CHUNK) * c);
        let mut dweight = grads.slice_mut(place.params[0].clone());
        gpu.rmsnorm_params_bwd(x, &dy, &rstd, partials, &mut dweight, rows, c, ROW_CHUNK)
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/rmsnorm.cu run on the host against the CPU's [`super::cpu`], bit
/// for bit: every operation is the CPU's, in its order, uncontracted, with IEEE division
/// and square root. The row kernels under their own launch shape (one warp a row), the
/// column kernels under the launch's and under a grid too small to cover the columns.
/// (rows, C): 150 rows of 40 (three chunks of rows, 64, 64 and 22, and a lane tail of 8);
/// 6 rows of 5 (rows shorter than the 32 lanes, one short chunk); 70 rows of 128 (four
/// whole lane rounds, two chunks).
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use super::cpu::{rmsnorm_backward, rmsnorm_forward};
    use crate::cuda::host::{elem_cfgs, Cfg, In, InF64, Out, OutF64, F32, I32, U64};
    use crate::testing::{assert_bits, uniform};
    for (rows, c) in [(150usize, 40usize), (6, 5), (70, 128)] {
        let eps = 1e-6f32;
        let seed = 0x2a5 + c as u64;
        // Rows off centre (mean 1, spread 2), so that no row's mean square is tiny.
        let x: Vec<f32> = uniform(seed, rows * c).iter().map(|v| 1.0 + 2.0 * v).collect();
        let dy = uniform(seed + 1, rows * c);
        let w: Vec<f32> = uniform(seed + 2, c).iter().map(|v| 1.0 + 0.5 * v).collect();
        // The gradient starts non-zero: the kernels, as the CPU, accumulate into it.
        let dw0 = uniform(seed + 3, c);

        let (mut want_y, mut xhat, mut want_rstd) = (x.clone(), vec![0.0; rows * c], vec![0.0; rows]);
        rmsnorm_forward(&mut want_y, Some((&mut xhat, &mut want_rstd)), &w, eps);
        let (mut want_dx, mut want_dw) = (dy.clone(), dw0.clone());
        let needed = crate::ops::InputGrad::Needed;
        rmsnorm_backward(&mut want_dx, &xhat, &want_rstd, &w, &mut want_dw, &mut Vec::new(), needed);

        let what = |part: &str| format!("rmsnorm ({rows}, {c}): {part}");
        let row_launch: Cfg = rows_cfg("rmsnorm host check", rows).unwrap().into();
        let (mut y, mut rstd) = (vec![f32::NAN; rows * c], vec![f64::NAN; rows]);
        let (rows_u, ci) = (U64(rows as u64), I32(c as i32));
        // As Gpu::rmsnorm_fwd pushes them: x, y, weight, rstd, rows, c, eps.
        k.launch(
            &rmsnorm::FWD,
            row_launch,
            &mut [In(&x), Out(&mut y), In(&w), OutF64(&mut rstd), rows_u, ci, F32(eps)],
        );
        assert_bits(&what("y"), &y, &want_y);
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&rstd), bits(&want_rstd), "{}", what("saved rstd"));

        let mut dx = vec![f32::NAN; rows * c];
        // As Gpu::rmsnorm_bwd: x, dy, dx, weight, rstd, rows, c.
        k.launch(
            &rmsnorm::BWD,
            row_launch,
            &mut [In(&x), In(&dy), Out(&mut dx), In(&w), InF64(&rstd), U64(rows as u64), I32(c as i32)],
        );
        assert_bits(&what("dx"), &dx, &want_dx);

        let chunks = rows.div_ceil(ROW_CHUNK);
        for (cfg_partial, cfg_params) in elem_cfgs(chunks * c).into_iter().zip(elem_cfgs(c)) {
            let (mut partials, mut dw) = (vec![f64::NAN; chunks * c], dw0.clone());
            // As Gpu::rmsnorm_params_bwd: first x, dy, rstd, partials, rows, c, chunk; then
            // partials, dweight, chunks, c.
            k.launch(
                &rmsnorm_partial::BWD,
                cfg_partial,
                &mut [
                    In(&x),
                    In(&dy),
                    InF64(&rstd),
                    OutF64(&mut partials),
                    U64(rows as u64),
                    I32(c as i32),
                    I32(ROW_CHUNK as i32),
                ],
            );
            k.launch(
                &rmsnorm_params::BWD,
                cfg_params,
                &mut [InF64(&partials), Out(&mut dw), U64(chunks as u64), I32(c as i32)],
            );
            assert_bits(&what(&format!("dweight {cfg_partial:?}")), &dw, &want_dw);
        }
    }
}
