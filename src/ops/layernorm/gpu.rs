//! LayerNorm on a GPU: the declaration of kernels/layernorm.cu, the argument structs and
//! checked launches of its kernels (one warp a row; the parameter gradients, two kernels in
//! a fixed order, one method), the op's GPU form, and the check of the kernels on the host
//! against the CPU's. The arithmetic and the chunk size of the ordered sums are
//! [`super::cpu`]'s.

use crate::cuda::launch::{check_len, dim, elem_cfg, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{Backward, Forward, GpuLayer, Placement};
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig};

use super::cpu::ROW_CHUNK;
use super::*;

crate::cuda::declare::kernels! {
    "layernorm.cu" {
        layernorm {
            fwd(x: In, y: Out, weight: In, bias: OptIn, mean: OutF64, rstd: OutF64, rows: Size, c: I32, eps: F32);
            bwd(x: In, dy: In, dx: Out, weight: In, mean: InF64, rstd: InF64, rows: Size, c: I32);
        }
        layernorm_partial {
            bwd(x: In, dy: In, mean: InF64, rstd: InF64, partials: OutF64, rows: Size, c: I32, chunk: I32);
        }
        layernorm_params {
            bwd(partials: InF64, dweight: Out, dbias: OptOut, chunks: Size, c: I32);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

/// Threads per block of the row kernels, and lanes (threads) per row: `LN_BLOCK` and
/// `LN_LANES` of kernels/layernorm.cu, whose shared arrays are sized for them.
pub const LN_BLOCK: u32 = 256;

pub const LN_LANES: u32 = 32;

/// The weight (C) and the bias (C), None without one.
#[derive(Debug)]
pub struct LnParams<'a> {
    pub weight: CudaView<'a, f32>,
    pub bias: Option<CudaView<'a, f32>>,
}

/// What a forward saves for its backward, (rows) each, in f64: each row's mean and rstd.
#[derive(Debug)]
pub struct LnSaved<'a> {
    pub mean: CudaViewMut<'a, f64>,
    pub rstd: CudaViewMut<'a, f64>,
}

/// What a backward accumulates into: dweight (C) and dbias (C), present exactly when the
/// bias is.
#[derive(Debug)]
pub struct LnGrads<'a> {
    pub dweight: CudaViewMut<'a, f32>,
    pub dbias: Option<CudaViewMut<'a, f32>>,
}

/// Launch shape of the row kernels: one warp of LN_LANES threads a row, LN_BLOCK threads
/// a block, so ceil(rows / 8) blocks (`rows > 0`).
fn rows_cfg(op: &'static str, rows: usize) -> Result<LaunchConfig> {
    let blocks = rows.div_ceil((LN_BLOCK / LN_LANES) as usize);
    let blocks = dim(op, "blocks (rows / 8)", blocks)? as u32;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (LN_BLOCK, 1, 1), shared_mem_bytes: 0 })
}

impl Gpu {
    /// Forward: y = (x − mean)·rstd·w + b per row, each row's mean and rstd saved.
    /// x, y: (rows, C); weight, bias: (C); saved mean, rstd: (rows)
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        params: LnParams<'_>,
        saved: LnSaved<'_>,
        rows: usize,
        c: usize,
        eps: f32,
    ) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let LnSaved { mut mean, mut rstd } = saved;
        let op = "layernorm_fwd";
        check_len(op, "x", x, rows * c)?;
        check_len(op, "y", y, rows * c)?;
        check_len(op, "weight", &params.weight, c)?;
        if let Some(b) = &params.bias {
            check_len(op, "bias", b, c)?;
        }
        check_len(op, "mean", &mean, rows)?;
        check_len(op, "rstd", &rstd, rows)?;
        if rows == 0 || c == 0 {
            return Ok(());
        }
        let ci = dim(op, "C", c)?;
        let cfg = rows_cfg(op, rows)?;
        // SAFETY: layernorm_fwd_f32(const float* x, float* y, const float* weight, const
        // float* bias, double* mean, double* rstd, size_t rows, int c, float eps); x and y
        // hold rows·C floats, weight and bias C, mean and rstd rows doubles (checked); an
        // absent bias is a 64-bit 0 the kernel tests for NULL; the grid covers the rows with
        // one warp each, LN_BLOCK threads a block as the kernel's shared array is sized.
        unsafe {
            layernorm::fwd(self, cfg, x, y, &params.weight, params.bias.as_ref(), &mut mean, &mut rstd, rows, ci, eps)
        }
    }

    /// Backward's input gradient from the forward's input `x` and saved `(mean, rstd)`:
    /// dx = rstd·((g − mean(g)) − x̂·mean(g·x̂)), g = dy·w, per row.
    /// x, dy, dx: (rows, C); weight: (C); mean, rstd: (rows)
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_bwd(
        &self,
        x: &impl DevIn,
        dy: &impl DevIn,
        dx: &mut impl DevOut,
        weight: &impl DevIn,
        (mean, rstd): (&CudaView<'_, f64>, &CudaView<'_, f64>),
        rows: usize,
        c: usize,
    ) -> Result<()> {
        let (x, dy, weight) = (&x.view(), &dy.view(), &weight.view());
        let dx = &mut dx.view_mut();
        let op = "layernorm_bwd";
        for (what, buf) in [("x", x), ("dy", dy)] {
            check_len(op, what, buf, rows * c)?;
        }
        check_len(op, "dx", dx, rows * c)?;
        check_len(op, "weight", weight, c)?;
        check_len(op, "mean", mean, rows)?;
        check_len(op, "rstd", rstd, rows)?;
        if rows == 0 || c == 0 {
            return Ok(());
        }
        let ci = dim(op, "C", c)?;
        let cfg = rows_cfg(op, rows)?;
        // SAFETY: layernorm_bwd_f32(const float* x, const float* dy, float* dx, const float*
        // weight, const double* mean, const double* rstd, size_t rows, int c); x, dy and dx
        // hold rows·C floats, weight C, mean and rstd rows doubles (checked); one warp a
        // row, LN_BLOCK threads a block as the kernel's shared array is sized.
        unsafe { layernorm::bwd(self, cfg, x, dy, dx, weight, mean, rstd, rows, ci) }
    }

    /// Backward's parameter gradients: dweight += Σ_rows dy·x̂ and dbias += Σ_rows dy
    /// (C each), the rows summed in chunks of `chunk` (`ops::layernorm::cpu::ROW_CHUNK`), the
    /// chunks' sums in chunk order (`partials`, (ceil(rows / chunk), 2, C) doubles, is
    /// their workspace). x, dy: (rows, C); mean, rstd: (rows)
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_params_bwd(
        &self,
        x: &impl DevIn,
        dy: &impl DevIn,
        (mean, rstd): (&CudaView<'_, f64>, &CudaView<'_, f64>),
        partials: &mut CudaViewMut<'_, f64>,
        grads: LnGrads<'_>,
        rows: usize,
        c: usize,
        chunk: usize,
    ) -> Result<()> {
        let (x, dy) = (&x.view(), &dy.view());
        let LnGrads { mut dweight, mut dbias } = grads;
        let op = "layernorm_params_bwd";
        if chunk == 0 {
            return Err(Error::shape(op, "the chunk of rows must be positive"));
        }
        let chunks = rows.div_ceil(chunk);
        for (what, buf) in [("x", x), ("dy", dy)] {
            check_len(op, what, buf, rows * c)?;
        }
        check_len(op, "mean", mean, rows)?;
        check_len(op, "rstd", rstd, rows)?;
        check_len(op, "partials", partials, chunks * 2 * c)?;
        check_len(op, "dweight", &dweight, c)?;
        if let Some(db) = &dbias {
            check_len(op, "dbias", db, c)?;
        }
        if rows == 0 || c == 0 {
            return Ok(());
        }
        let (ci, chunk_i) = (dim(op, "C", c)?, dim(op, "chunk", chunk)?);
        // SAFETY: layernorm_partial_bwd_f32(const float* x, const float* dy, const double*
        // mean, const double* rstd, double* partials, size_t rows, int c, int chunk); x and
        // dy hold rows·C floats, mean and rstd rows doubles, partials ceil(rows / chunk)·2·C
        // doubles (checked); a grid-stride loop over ceil(rows / chunk)·C, any grid.
        unsafe { layernorm_partial::bwd(self, elem_cfg(chunks * c), x, dy, mean, rstd, partials, rows, ci, chunk_i) }?;
        // SAFETY: layernorm_params_bwd_f32(const double* partials, float* dweight, float*
        // dbias, size_t chunks, int c); partials holds chunks·2·C doubles (chunks ≥ 1, as
        // rows > 0), dweight and dbias C floats (checked); an absent dbias is a 64-bit 0 the
        // kernel tests for NULL; a grid-stride loop over C, any grid.
        let partials = &partials.as_view();
        unsafe { layernorm_params::bwd(self, elem_cfg(c), partials, &mut dweight, dbias.as_mut(), chunks, ci) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &LayerNorm) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(LayerNormGpu { width: layer.width, eps: layer.eps, use_bias: layer.use_bias, saved: None }))
}

/// LayerNorm on a GPU: `layernorm_fwd` normalises each row (one warp a row) and saves its
/// mean and rstd in f64; `layernorm_bwd` writes dx from them and the forward's input, and
/// `layernorm_partial_bwd` then `layernorm_params_bwd` sum dweight and dbias over the rows
/// in the CPU's chunk order: [`super::cpu`]'s arithmetic, operation for operation.
pub(super) struct LayerNormGpu {
    width: usize,
    eps: f32,
    use_bias: bool,
    /// Each row's mean and rstd (rows each) from the last forward, and the chunks' column
    /// sums (chunks, 2, C) of the backward, sized by `reserve` for the batch.
    saved: Option<Saved>,
}

/// What a GPU LayerNorm keeps on the device, in f64: mean and rstd (rows), partials
/// (ceil(rows / ROW_CHUNK), 2, C).
struct Saved {
    mean: CudaSlice<f64>,
    rstd: CudaSlice<f64>,
    partials: CudaSlice<f64>,
}

impl LayerNormGpu {
    fn rows(&self, place: &Placement, n: usize) -> usize {
        n * place.input.numel() / self.width.max(1)
    }
}

impl GpuLayer for LayerNormGpu {
    fn reserve(&mut self, gpu: &Gpu, place: &Placement, n: usize) -> Result<()> {
        let rows = self.rows(place, n);
        let stream = gpu.stream();
        self.saved = None;
        self.saved = Some(Saved {
            mean: stream.alloc_zeros(rows.max(1))?,
            rstd: stream.alloc_zeros(rows.max(1))?,
            partials: stream.alloc_zeros((rows.div_ceil(ROW_CHUNK) * 2 * self.width).max(1))?,
        });
        Ok(())
    }

    // x: (N, ..., C) → y: same shape; mean, rstd: (rows) saved (in evaluation too, where
    // no backward reads them)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let rows = self.rows(f.place, f.n);
        let p = LnParams { weight: f.param(0), bias: self.use_bias.then(|| f.param(1)) };
        let saved = self.saved.as_mut().expect("reserved before the pass");
        let out = LnSaved { mean: saved.mean.slice_mut(0..rows), rstd: saved.rstd.slice_mut(0..rows) };
        f.gpu.layernorm_fwd(f.x, f.y, p, out, rows, self.width, self.eps)
    }

    // dy: (N, ..., C) → dx: same shape (written); dweight, dbias: (C) (accumulated)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let rows = self.rows(b.place, b.n);
        let Backward { gpu, place, params, x, dy, dx, grads, .. } = b;
        let saved = self.saved.as_mut().expect("reserved before the pass");
        let (mean, rstd) = (saved.mean.slice(0..rows), saved.rstd.slice(0..rows));
        let weight = params.slice(place.params[0].clone());
        if let Some(mut dx) = dx {
            gpu.layernorm_bwd(x, &dy, &mut dx, &weight, (&mean, &rstd), rows, self.width)?;
        }
        // The last parameter's gradient (the bias, or the weight alone) starts `last.start`
        // into the slot; the weight's, when there is a bias, lies below it on its own
        // aligned start.
        let last = place.params.last().cloned().unwrap_or_default();
        let (mut below, mut above) = grads.split_at_mut(last.start);
        let last = above.slice_mut(0..last.len());
        let (dweight, dbias) =
            if self.use_bias { (below.slice_mut(place.params[0].clone()), Some(last)) } else { (last, None) };
        let out = LnGrads { dweight, dbias };
        let partials = &mut saved.partials.slice_mut(0..rows.div_ceil(ROW_CHUNK) * 2 * self.width);
        gpu.layernorm_params_bwd(x, &dy, (&mean, &rstd), partials, out, rows, self.width, ROW_CHUNK)
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/layernorm.cu run on the host against the CPU's [`super::cpu`], bit
/// for bit: every operation is the CPU's, in its order, uncontracted, with IEEE division
/// and square root. The row kernels under their own launch shape (one warp a row), the
/// column kernels under the launch's and under a grid too small to cover the columns.
/// (N, T, C, bias): 150 rows of 40 (three chunks of rows, 64, 64 and 22, and a lane tail
/// of 8); 6 rows of 5 without a bias (rows shorter than the 32 lanes, one short chunk);
/// 70 rows of the GPT's 128 (four whole lane rounds, two chunks).
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use super::cpu::{layernorm_backward, layernorm_forward, row_stats};
    use crate::cuda::host::{elem_cfgs, Cfg, In, InF64, Null, Out, OutF64, F32, I32, U64};
    use crate::testing::{assert_bits, uniform};
    for (n, t, c, use_bias) in [(3usize, 50usize, 40usize, true), (2, 3, 5, false), (1, 70, 128, true)] {
        let rows = n * t;
        let eps = 1e-5f32;
        let seed = 0x1a7e + c as u64;
        // Rows off centre (mean 3, spread 2), so that the mean and the deviations matter.
        let x: Vec<f32> = uniform(seed, rows * c).iter().map(|v| 3.0 + 2.0 * v).collect();
        let dy = uniform(seed + 1, rows * c);
        let w: Vec<f32> = uniform(seed + 2, c).iter().map(|v| 1.0 + 0.5 * v).collect();
        let b = uniform(seed + 3, c);
        // The gradients start non-zero: the kernels, as the CPU, accumulate into them.
        let (dw0, db0) = (uniform(seed + 4, c), uniform(seed + 5, c));

        // The CPU: its output and kept x̂ and rstd, each row's mean, its input's gradient
        // and its parameters' gradients accumulated onto dw0, db0.
        let bias = use_bias.then_some(&b[..]);
        let (mut want_y, mut xhat, mut want_rstd) = (x.clone(), vec![0.0; rows * c], vec![0.0; rows]);
        layernorm_forward(&mut want_y, Some((&mut xhat, &mut want_rstd)), &w, bias, eps);
        let want_mean: Vec<f64> = x.chunks_exact(c).map(|r| row_stats(r, eps).0).collect();
        let (mut want_dx, mut want_dw, mut want_db) = (dy.clone(), dw0.clone(), db0.clone());
        let dbias = use_bias.then_some(&mut want_db[..]);
        let needed = crate::ops::InputGrad::Needed;
        layernorm_backward(&mut want_dx, &xhat, &want_rstd, &w, &mut want_dw, dbias, &mut Vec::new(), needed);

        let what = |part: &str| format!("layernorm ({n}, {t}, {c}), bias {use_bias}: {part}");
        let row_launch: Cfg = rows_cfg("layernorm host check", rows).unwrap().into();
        let (mut y, mut mean, mut rstd) = (vec![f32::NAN; rows * c], vec![f64::NAN; rows], vec![f64::NAN; rows]);
        let bias = if use_bias { In(&b) } else { Null };
        // As Gpu::layernorm_fwd pushes them: x, y, weight, bias, mean, rstd, rows, c, eps.
        let (rows_u, ci) = (U64(rows as u64), I32(c as i32));
        let mut args = [In(&x), Out(&mut y), In(&w), bias, OutF64(&mut mean), OutF64(&mut rstd), rows_u, ci, F32(eps)];
        k.launch(&layernorm::FWD, row_launch, &mut args);
        assert_bits(&what("y"), &y, &want_y);
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&mean), bits(&want_mean), "{}", what("saved mean"));
        assert_eq!(bits(&rstd), bits(&want_rstd), "{}", what("saved rstd"));

        let mut dx = vec![f32::NAN; rows * c];
        // As Gpu::layernorm_bwd: x, dy, dx, weight, mean, rstd, rows, c.
        k.launch(
            &layernorm::BWD,
            row_launch,
            &mut [In(&x), In(&dy), Out(&mut dx), In(&w), InF64(&mean), InF64(&rstd), U64(rows as u64), I32(c as i32)],
        );
        assert_bits(&what("dx"), &dx, &want_dx);

        let chunks = rows.div_ceil(ROW_CHUNK);
        for (cfg_partial, cfg_params) in elem_cfgs(chunks * c).into_iter().zip(elem_cfgs(c)) {
            let mut partials = vec![f64::NAN; chunks * 2 * c];
            let (mut dw, mut db) = (dw0.clone(), db0.clone());
            // As Gpu::layernorm_params_bwd: first x, dy, mean, rstd, partials, rows, c,
            // chunk; then partials, dweight, dbias, chunks, c.
            k.launch(
                &layernorm_partial::BWD,
                cfg_partial,
                &mut [
                    In(&x),
                    In(&dy),
                    InF64(&mean),
                    InF64(&rstd),
                    OutF64(&mut partials),
                    U64(rows as u64),
                    I32(c as i32),
                    I32(ROW_CHUNK as i32),
                ],
            );
            let dbias = if use_bias { Out(&mut db) } else { Null };
            k.launch(
                &layernorm_params::BWD,
                cfg_params,
                &mut [InF64(&partials), Out(&mut dw), dbias, U64(chunks as u64), I32(c as i32)],
            );
            assert_bits(&what(&format!("dweight {cfg_partial:?}")), &dw, &want_dw);
            assert_bits(&what(&format!("dbias {cfg_partial:?}")), &db, &want_db);
        }
    }
}
