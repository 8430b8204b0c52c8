//! A 2-D convolution on a GPU: the declaration of kernels/conv2d.cu (im2col and its adjoint,
//! the bias over channels and its reduction), their checked launches, the op's GPU form,
//! whose products are cuBLAS's (`cuda::gemm`), and the check of the kernels on the host
//! against the CPU's ([`super::cpu`], `backend::cpu`'s unfolding). The unfolding's layout is
//! the CPU's, so the two backends share one weight layout.

use crate::cuda::gemm::{gemm as cublas_gemm, RmGemm};
use crate::cuda::launch::{channel_cfg, check_len, dim, elem_cfg, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{window_geom, Backward, Forward, GpuLayer, Placement};
use crate::ops::window::WindowGeom;
use crate::Result;
use cudarc::driver::CudaSlice;

use super::*;

crate::cuda::declare::kernels! {
    "conv2d.cu" {
        im2col {
            fwd(x: In, col: Out, geom: Geom);
            bwd(dcol: In, dx: Out, geom: Geom);
        }
        bias_nchw {
            fwd(y: Out, bias: In, c: I32, hw: Size, total: Size);
            bwd(dy: In, dbias: Out, n: I32, c: I32, hw: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
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
        unsafe { bias_nchw::fwd(self, elem_cfg(total), y, bias, ci, hw, total) }
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
        unsafe { bias_nchw::bwd(self, channel_cfg(ci), dy, dbias, ni, ci, hw) }
    }

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
        unsafe { im2col::fwd(self, elem_cfg(g.col_len()), x, col, &a) }
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
        unsafe { im2col::bwd(self, elem_cfg(g.x_len()), dcol, dx, &a) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &Conv2d) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(Conv2dGpu { filters: layer.filters, window: layer.window(), use_bias: layer.use_bias, cols: None }))
}

/// A convolution on a GPU. Its input unfolds to columns (N, C·KH·KW, OH·OW) and runs one
/// strided-batched GEMM per pass; its weight gradient is summed over the samples'
/// per-sample products by `reduce_sum`, in sample order, so the sum's order is a function
/// of the batch alone.
pub(super) struct Conv2dGpu {
    filters: usize,
    window: Window2d,
    use_bias: bool,
    /// The unfolded input of the last forward, col: (N, C·KH·KW, OH·OW).
    cols: Option<CudaSlice<f32>>,
}

impl GpuLayer for Conv2dGpu {
    fn reserve(&mut self, gpu: &Gpu, place: &Placement, n: usize) -> Result<()> {
        let g = window_geom(place, self.window, n)?;
        self.cols = None;
        self.cols = Some(gpu.stream().alloc_zeros::<f32>(g.col_len().max(1))?);
        Ok(())
    }

    /// The per-sample products of the weight gradient (N, O, C·KH·KW), then the column
    /// gradient (N, C·KH·KW, OH·OW), side by side.
    fn scratch(&self, place: &Placement, n: usize) -> Result<usize> {
        let g = window_geom(place, self.window, n)?;
        Ok(n * self.filters * g.c * g.kh * g.kw + g.col_len())
    }

    // x: (N, C, H, W), weight: (O, C, KH, KW) → y: (N, O, OH, OW)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let (n, o) = (f.n, self.filters);
        let g = window_geom(f.place, self.window, n)?;
        let (ckk, pp) = (g.c * g.kh * g.kw, g.oh() * g.ow());
        let col = self.cols.as_mut().expect("reserved before the pass");
        f.gpu.im2col_fwd(f.x, col, &g)?;
        cublas_gemm(f.blas, &RmGemm::conv_fwd(n, o, ckk, pp), &f.param(0), &*col, f.y)?;
        if self.use_bias {
            f.gpu.bias_nchw_fwd(f.y, &f.param(1), n, o, pp)?;
        }
        Ok(())
    }

    // dy: (N, O, OH, OW) → dweight += Σ_n dy_n·col_nᵀ, dbias += Σ dy, dx = col2im(Wᵀ·dy)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let (n, o) = (b.n, self.filters);
        let g = window_geom(b.place, self.window, n)?;
        let (ckk, pp) = (g.c * g.kh * g.kw, g.oh() * g.ow());
        let Backward { gpu, blas, place, params, dy, dx, grads, scratch, .. } = b;
        let col = self.cols.as_ref().expect("reserved before the pass");
        // dW = Σ_n dW_n in sample order
        let mut part = scratch.slice_mut(0..n * o * ckk);
        cublas_gemm(blas, &RmGemm::conv_dw(n, o, ckk, pp), &dy, col, &mut part)?;
        gpu.reduce_sum(&part, &mut grads.slice_mut(place.params[0].clone()), n, 1.0)?;
        if self.use_bias {
            gpu.bias_nchw_bwd(&dy, &mut grads.slice_mut(place.params[1].clone()), n, o, pp)?;
        }
        if let Some(mut dx) = dx {
            let mut dcol = scratch.slice_mut(n * o * ckk..n * o * ckk + g.col_len());
            cublas_gemm(
                blas,
                &RmGemm::conv_dcol(n, o, ckk, pp),
                &params.slice(place.params[0].clone()),
                &dy,
                &mut dcol,
            )?;
            gpu.im2col_bwd(&dcol, &mut dx, &g)?;
        }
        Ok(())
    }
}

// ---- on the host ------------------------------------------------------------------------

/// Every (col index, x index) pair of im2col in the CPU's layout, with strides that may
/// differ per axis (the CPU backend has one stride):
///   col[n][(c*KH + kh)*KW + kw][oh*OW + ow] = x[n, c, oh*SH - PT + kh, ow*SW - PL + kw],
/// in the order (n, row, oh, ow); a position in the padding has no pair.
/// x: (N, C, H, W); col: (N, C*KH*KW, OH*OW).
#[cfg(test)]
fn im2col_pairs(g: &WindowGeom) -> Vec<(usize, usize)> {
    let (oh, ow) = (g.oh(), g.ow());
    let rows = g.c * g.kh * g.kw;
    let mut pairs = Vec::with_capacity(g.col_len());
    for s in 0..g.n {
        for row in 0..rows {
            let (ch, ky, kx) = (row / (g.kh * g.kw), (row / g.kw) % g.kh, row % g.kw);
            for oy in 0..oh {
                for ox in 0..ow {
                    let y = (oy * g.stride_h + ky) as isize - g.pad_top as isize;
                    let xx = (ox * g.stride_w + kx) as isize - g.pad_left as isize;
                    if y >= 0 && (y as usize) < g.h && xx >= 0 && (xx as usize) < g.w {
                        pairs.push((
                            (s * rows + row) * oh * ow + oy * ow + ox,
                            ((s * g.c + ch) * g.h + y as usize) * g.w + xx as usize,
                        ));
                    }
                }
            }
        }
    }
    pairs
}

/// im2col of a geometry the CPU backend has no twin of (unequal strides): copies and
/// zeros, so in f32 and exact. x: (N, C, H, W) → col: (N, C*KH*KW, OH*OW).
#[cfg(test)]
fn im2col_ref(x: &[f32], g: &WindowGeom) -> Vec<f32> {
    let mut col = vec![0.0; g.col_len()];
    for (ci, xi) in im2col_pairs(g) {
        col[ci] = x[xi];
    }
    col
}

/// col2im by scatter-add in f64: the transpose of [`im2col_ref`], element by element.
/// dcol: (N, C*KH*KW, OH*OW) → dx: (N, C, H, W).
#[cfg(test)]
fn col2im_ref(dcol: &[f32], g: &WindowGeom) -> Vec<f64> {
    let mut dx = vec![0.0; g.x_len()];
    for (ci, xi) in im2col_pairs(g) {
        dx[xi] += dcol[ci] as f64;
    }
    dx
}

/// The CPU backend's geometry of one sample of `g`, where it has one (equal strides).
#[cfg(test)]
fn cpu_twin(g: &WindowGeom) -> Option<Im2colGeom> {
    let (c, h, w, kh, kw, pad_top, pad_left, oh, ow) =
        (g.c, g.h, g.w, g.kh, g.kw, g.pad_top, g.pad_left, g.oh(), g.ow());
    (g.stride_h == g.stride_w).then_some(Im2colGeom { c, h, w, kh, kw, stride: g.stride_h, pad_top, pad_left, oh, ow })
}

/// The geometries of the unfolding's checks, host and GPU: the Keras convnet's first
/// layer, smaller (3x3, stride 1, no padding); TF "same" padding with stride 2 on an even
/// size (0 top/left, 1 bottom/right); stride 2 with every pad different (1/2/0/1) and a
/// 3x2 kernel; and everything different, a 2x4 kernel at strides 2/3 (no CPU twin).
#[cfg(test)]
fn unfold_geoms() -> [WindowGeom; 4] {
    let geom = |(n, c, h, w), (kh, kw), (stride_h, stride_w), (pad_top, pad_left, pad_bottom, pad_right)| WindowGeom {
        n,
        c,
        h,
        w,
        kh,
        kw,
        stride_h,
        stride_w,
        pad_top,
        pad_left,
        pad_bottom,
        pad_right,
    };
    [
        geom((2, 1, 12, 12), (3, 3), (1, 1), (0, 0, 0, 0)),
        geom((2, 3, 8, 6), (3, 3), (2, 2), (0, 0, 1, 1)),
        geom((2, 2, 7, 9), (3, 2), (2, 2), (1, 2, 0, 1)),
        geom((3, 2, 7, 9), (2, 4), (2, 3), (1, 2, 0, 1)),
    ]
}

/// What the unfolding's kernels must give for x and dcol at `g`: col (exact) and dx, as
/// the CPU backend computes them per sample where it has a twin of `g` (its col2im adds
/// each dx element's terms in the kernel's order, (kh, kw) ascending from 0, so the two
/// agree bit for bit: `Exact`), else the f64 reference (`Near`: at most KH·KW terms per
/// element in f32, within 1e-5 relative and absolute).
#[cfg(test)]
fn unfold_want(x: &[f32], dcol: &[f32], g: &WindowGeom) -> (Vec<f32>, UnfoldDx) {
    let Some(cg) = cpu_twin(g) else { return (im2col_ref(x, g), UnfoldDx::Near(col2im_ref(dcol, g))) };
    let (per_x, per_col) = (g.c * g.h * g.w, cg.col_rows() * cg.col_cols());
    let (mut col, mut dx) = (vec![0.0; g.col_len()], vec![0.0; g.x_len()]);
    for s in 0..g.n {
        crate::backend::cpu::im2col(&x[s * per_x..(s + 1) * per_x], &cg, &mut col[s * per_col..(s + 1) * per_col]);
        crate::backend::cpu::col2im(&dcol[s * per_col..(s + 1) * per_col], &cg, &mut dx[s * per_x..(s + 1) * per_x]);
    }
    (col, UnfoldDx::Exact(dx))
}

/// The dx an unfolding check expects ([`unfold_want`]).
#[cfg(test)]
enum UnfoldDx {
    Exact(Vec<f32>),
    Near(Vec<f64>),
}

#[cfg(test)]
impl UnfoldDx {
    #[track_caller]
    fn check(&self, what: &str, got: &[f32]) {
        match self {
            UnfoldDx::Exact(want) => crate::testing::assert_bits(what, got, want),
            UnfoldDx::Near(want) => crate::testing::assert_close(what, got, want, 1e-5, 1e-5),
        }
    }
}

/// The kernels of kernels/conv2d.cu run on the host against the CPU: im2col and col2im
/// against `backend::cpu`'s unfolding, which the layer's columns run ([`unfold_want`]),
/// with stride and asymmetric padding; the bias add against [`super::cpu::add_bias`], bit
/// for bit (one f32 add); its reduction against [`super::cpu::bias_grad`], within 1e-5
/// relative and absolute (up to 400 terms of magnitude ≤ 1, summed in f32 in two orders:
/// the kernel's strided partial sums and tree, the CPU's plane by plane). The grid-stride
/// kernels under the launch shape the launches use and under a grid too small to cover
/// the data; the reduction under its one block a channel.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{channel_cfg, elem_cfg, elem_cfgs, In, Out, FEW, I32, U64};
    use crate::testing::{assert_bits, assert_close, uniform};
    for (seed, g) in (40..).zip(unfold_geoms()) {
        let (x, dcol) = (uniform(seed, g.x_len()), uniform(seed + 100, g.col_len()));
        let (want_col, want_dx) = unfold_want(&x, &dcol, &g);
        let geom = g.launch_args("im2col host check").unwrap();
        for cfg in [elem_cfg(g.col_len()), FEW] {
            let mut col = vec![f32::NAN; g.col_len()];
            // As Gpu::im2col_fwd pushes them: x, col, then the geometry's 12 ints.
            let mut args = vec![In(&x), Out(&mut col)];
            args.extend(geom.map(I32));
            k.launch(&im2col::FWD, cfg, &mut args);
            assert_bits(&format!("im2col {g:?} {cfg:?}"), &col, &want_col);
        }
        for cfg in [elem_cfg(g.x_len()), FEW] {
            let mut dx = vec![f32::NAN; g.x_len()];
            // As Gpu::im2col_bwd: dcol, dx, then the geometry's 12 ints.
            let mut args = vec![In(&dcol), Out(&mut dx)];
            args.extend(geom.map(I32));
            k.launch(&im2col::BWD, cfg, &mut args);
            want_dx.check(&format!("col2im {g:?} {cfg:?}"), &dx);
        }
    }

    // NCHW with M = N*H*W below one block (3*49 = 147 of 256 threads busy) and above it
    // (4*100 = 400: threads 0..143 sum two terms each before the tree).
    for (seed, (n, c, hw)) in (50..).zip([(3, 5, 49), (4, 3, 100)]) {
        let total = n * c * hw;
        let (y0, bias, dy, dbias0) =
            (uniform(seed, total), uniform(seed + 1, c), uniform(seed + 2, total), uniform(seed + 3, c));
        let mut want_y = y0.clone();
        want_y.chunks_exact_mut(c * hw).for_each(|yn| super::cpu::add_bias(yn, &bias, hw));
        for cfg in elem_cfgs(total) {
            let mut y = y0.clone();
            // As Gpu::bias_nchw_fwd: y, bias, C (int), hw, total.
            let mut args = [Out(&mut y), In(&bias), I32(c as i32), U64(hw as u64), U64(total as u64)];
            k.launch(&bias_nchw::FWD, cfg, &mut args);
            assert_bits(&format!("bias_nchw y {cfg:?}"), &y, &want_y);
        }
        let mut want_dbias = dbias0.clone();
        super::cpu::bias_grad(&dy, hw, &mut want_dbias);
        let mut dbias = dbias0.clone();
        // As Gpu::bias_nchw_bwd: dy, dbias, N (int), C (int), hw; grid = (C).
        let mut args = [In(&dy), Out(&mut dbias), I32(n as i32), I32(c as i32), U64(hw as u64)];
        k.launch(&bias_nchw::BWD, channel_cfg(c as i32), &mut args);
        let want: Vec<f64> = want_dbias.iter().map(|&v| v as f64).collect();
        assert_close(&format!("bias_nchw dbias (accumulated), N={n} C={c} HW={hw}"), &dbias, &want, 1e-5, 1e-5);
    }
}

// ---- on a GPU -----------------------------------------------------------------------------

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::ops::conformance::gpu_or_skip;
    use crate::testing::{assert_bits, assert_close, uniform};

    fn up<T: cudarc::driver::DeviceRepr>(gpu: &Gpu, v: &[T]) -> CudaSlice<T> {
        gpu.stream().clone_htod(v).expect("host to device copy")
    }

    fn down<T: cudarc::driver::DeviceRepr + Default + Clone>(gpu: &Gpu, d: &CudaSlice<T>) -> Vec<T> {
        gpu.stream().clone_dtoh(d).expect("device to host copy")
    }

    /// The unfolding's kernels on a GPU, against the CPU's unfolding where it has a twin
    /// of the geometry (bit for bit: copies, and the same additions in the same order),
    /// else the f64 reference ([`unfold_want`]).
    #[test]
    fn im2col_and_col2im_match_the_cpu_with_stride_and_asymmetric_padding() {
        if !gpu_or_skip("im2col_and_col2im_match_the_cpu_with_stride_and_asymmetric_padding") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        for (seed, g) in (60..).zip(unfold_geoms()) {
            let (x, dcol) = (uniform(seed, g.x_len()), uniform(seed + 100, g.col_len()));
            let (want_col, want_dx) = unfold_want(&x, &dcol, &g);
            let mut col_d = up(&gpu, &vec![f32::NAN; g.col_len()]);
            gpu.im2col_fwd(&up(&gpu, &x), &mut col_d, &g).unwrap();
            assert_bits(&format!("im2col {g:?}"), &down(&gpu, &col_d), &want_col);
            let mut dx_d = up(&gpu, &vec![f32::NAN; g.x_len()]);
            gpu.im2col_bwd(&up(&gpu, &dcol), &mut dx_d, &g).unwrap();
            want_dx.check(&format!("col2im {g:?}"), &down(&gpu, &dx_d));
        }
    }

    /// The bias add and its reduction on a GPU against the CPU's: the add bit for bit,
    /// the reduction (147 terms a channel, in two orders) within 1e-5 relative and
    /// absolute.
    #[test]
    fn the_bias_add_and_its_reduction_match_the_cpu() {
        if !gpu_or_skip("the_bias_add_and_its_reduction_match_the_cpu") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        // N=3, C=5, H=W=7 (hw = 49, so a block of 256 threads covers 147 terms).
        let (n, c, hw) = (3, 5, 49);
        let (y0, bias, dy, dbias0) = (uniform(70, n * c * hw), uniform(71, c), uniform(72, n * c * hw), uniform(73, c));
        let mut y_d = up(&gpu, &y0);
        gpu.bias_nchw_fwd(&mut y_d, &up(&gpu, &bias), n, c, hw).unwrap();
        let mut want_y = y0.clone();
        want_y.chunks_exact_mut(c * hw).for_each(|yn| super::super::cpu::add_bias(yn, &bias, hw));
        assert_bits("bias_nchw y", &down(&gpu, &y_d), &want_y);
        let mut db_d = up(&gpu, &dbias0);
        gpu.bias_nchw_bwd(&up(&gpu, &dy), &mut db_d, n, c, hw).unwrap();
        let mut want = dbias0.clone();
        super::super::cpu::bias_grad(&dy, hw, &mut want);
        let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        assert_close("bias_nchw dbias (accumulated)", &down(&gpu, &db_d), &want, 1e-5, 1e-5);
    }
}
