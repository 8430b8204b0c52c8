//! A 2-D convolution on a GPU: the declaration of kernels/conv2d.cu (im2col and its adjoint,
//! the bias over channels and its reduction, the direct sums of a convolution of several
//! groups of few channels and the sum of its samples' weight gradients), their checked
//! launches, the op's GPU form, whose products are cuBLAS's (`cuda::gemm`), and the check
//! of the kernels on the host against the CPU's ([`super::cpu`], `backend::cpu`'s
//! unfolding). The unfolding's layout is the CPU's, so the two backends share one weight
//! layout; the groups run by the CPU's choice ([`super::cpu::grouped_path`]).

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
        conv2d_direct {
            fwd(x: In, weight: In, y: Out, geom: Geom, o: I32, groups: I32);
            bwd(dy: In, weight: In, dx: Out, geom: Geom, o: I32, groups: I32);
        }
        conv2d_direct_params {
            bwd(x: In, dy: In, part: Out, geom: Geom, o: I32, groups: I32);
        }
        conv2d_params_sum {
            bwd(part: In, dweight: Out, n: I32, len: Size);
        }
    }
}

/// The lengths of a grouped convolution's tensors at `g` with `o` filters in `groups`
/// groups, (x, weight, y), or why the groups do not divide the channels and filters.
fn grouped_lens(op: &'static str, g: &WindowGeom, o: usize, groups: usize) -> Result<(usize, usize, usize)> {
    if groups == 0 || !g.c.is_multiple_of(groups) || !o.is_multiple_of(groups) {
        return Err(crate::Error::shape(op, format!("{} channels and {o} filters in {groups} groups", g.c)));
    }
    Ok((g.x_len(), o * (g.c / groups) * g.kh * g.kw, g.n * o * g.oh() * g.ow()))
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

    /// The direct forward of a grouped convolution (`super::cpu::Direct`'s sums), y
    /// written, no bias. x: (N, C, H, W), weight: (O, C/G, KH, KW) → y: (N, O, OH, OW)
    #[allow(clippy::too_many_arguments)]
    pub fn conv2d_direct_fwd(
        &self,
        x: &impl DevIn,
        weight: &impl DevIn,
        y: &mut impl DevOut,
        g: &WindowGeom,
        o: usize,
        groups: usize,
    ) -> Result<()> {
        let op = "conv2d_direct_fwd";
        let (x, weight, y) = (&x.view(), &weight.view(), &mut y.view_mut());
        let (x_len, w_len, y_len) = grouped_lens(op, g, o, groups)?;
        check_len(op, "x", x, x_len)?;
        check_len(op, "weight", weight, w_len)?;
        check_len(op, "y", y, y_len)?;
        if y_len == 0 {
            return Ok(());
        }
        let (a, oi, gi) = (g.launch_args(op)?, dim(op, "O", o)?, dim(op, "groups", groups)?);
        // SAFETY: conv2d_direct_fwd_f32(const float*, const float*, float*, 12 x int, int,
        // int); x, weight and y have the lengths the geometry, O and G imply (checked, G
        // dividing C and O), and the kernel reads x only at in-bounds (y, x) of its
        // sample's group and writes y below N*O*OH*OW.
        unsafe { conv2d_direct::fwd(self, elem_cfg(y_len), x, weight, y, &a, oi, gi) }
    }

    /// The direct input gradient of a grouped convolution, dx written.
    /// dy: (N, O, OH, OW), weight: (O, C/G, KH, KW) → dx: (N, C, H, W)
    #[allow(clippy::too_many_arguments)]
    pub fn conv2d_direct_bwd(
        &self,
        dy: &impl DevIn,
        weight: &impl DevIn,
        dx: &mut impl DevOut,
        g: &WindowGeom,
        o: usize,
        groups: usize,
    ) -> Result<()> {
        let op = "conv2d_direct_bwd";
        let (dy, weight, dx) = (&dy.view(), &weight.view(), &mut dx.view_mut());
        let (x_len, w_len, y_len) = grouped_lens(op, g, o, groups)?;
        check_len(op, "dy", dy, y_len)?;
        check_len(op, "weight", weight, w_len)?;
        check_len(op, "dx", dx, x_len)?;
        if x_len == 0 {
            return Ok(());
        }
        let (a, oi, gi) = (g.launch_args(op)?, dim(op, "O", o)?, dim(op, "groups", groups)?);
        // SAFETY: conv2d_direct_bwd_f32(const float*, const float*, float*, 12 x int, int,
        // int); lengths checked as above; the kernel reads dy only at oy < OH, ox < OW of
        // the group's filters, and writes dx below N*C*H*W.
        unsafe { conv2d_direct::bwd(self, elem_cfg(x_len), dy, weight, dx, &a, oi, gi) }
    }

    /// Each sample's weight gradient of a grouped convolution by direct sums, written.
    /// x: (N, C, H, W), dy: (N, O, OH, OW) → part: (N, O, C/G, KH, KW)
    #[allow(clippy::too_many_arguments)]
    pub fn conv2d_direct_params_bwd(
        &self,
        x: &impl DevIn,
        dy: &impl DevIn,
        part: &mut impl DevOut,
        g: &WindowGeom,
        o: usize,
        groups: usize,
    ) -> Result<()> {
        let op = "conv2d_direct_params_bwd";
        let (x, dy, part) = (&x.view(), &dy.view(), &mut part.view_mut());
        let (x_len, w_len, y_len) = grouped_lens(op, g, o, groups)?;
        check_len(op, "x", x, x_len)?;
        check_len(op, "dy", dy, y_len)?;
        check_len(op, "part", part, g.n * w_len)?;
        if g.n * w_len == 0 {
            return Ok(());
        }
        let (a, oi, gi) = (g.launch_args(op)?, dim(op, "O", o)?, dim(op, "groups", groups)?);
        // SAFETY: conv2d_direct_params_bwd_f32(const float*, const float*, float*, 12 x
        // int, int, int); x, dy and part (N weights) have the lengths checked above; the
        // kernel reads x only at in-bounds (y, x) and writes part below N*O*(C/G)*KH*KW.
        unsafe { conv2d_direct_params::bwd(self, elem_cfg(g.n * w_len), x, dy, part, &a, oi, gi) }
    }

    /// `dweight += part[0] + ... + part[N-1]`, the samples summed in order first.
    /// part: (N, len) → dweight: (len)
    pub fn conv2d_params_sum_bwd(&self, part: &impl DevIn, dweight: &mut impl DevOut, n: usize) -> Result<()> {
        let op = "conv2d_params_sum_bwd";
        let (part, dweight) = (&part.view(), &mut dweight.view_mut());
        let len = dweight.len();
        check_len(op, "part", part, n * len)?;
        if len == 0 {
            return Ok(());
        }
        let ni = dim(op, "N", n)?;
        // SAFETY: conv2d_params_sum_bwd_f32(const float*, float*, int, size_t); part holds
        // N*len floats (checked) and dweight len; a grid-stride loop over len.
        unsafe { conv2d_params_sum::bwd(self, elem_cfg(len), part, dweight, ni, len) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &Conv2d) -> Option<Box<dyn GpuLayer>> {
    let (filters, window, use_bias, groups) = (layer.filters, layer.window(), layer.use_bias, layer.groups);
    Some(Box::new(Conv2dGpu { filters, window, use_bias, groups, cols: None }))
}

/// A convolution on a GPU. Its input unfolds to columns (N, C·KH·KW, OH·OW) and runs one
/// strided-batched GEMM per pass; its weight gradient is summed over the samples'
/// per-sample products by `reduce_sum`, in sample order, so the sum's order is a function
/// of the batch alone. In several groups, the groups of a few channels run by the direct
/// kernels, wider ones by the same columns and a strided-batched GEMM a group; their
/// samples' weight gradients are added by `conv2d_params_sum`, in sample order.
pub(super) struct Conv2dGpu {
    filters: usize,
    window: Window2d,
    use_bias: bool,
    groups: usize,
    /// The unfolded input of the last forward, col: (N, C·KH·KW, OH·OW) (a placeholder
    /// where the direct kernels run).
    cols: Option<CudaSlice<f32>>,
}

impl Conv2dGpu {
    /// How the convolution runs at `g`: None for one group.
    fn grouped(&self, g: &WindowGeom) -> Option<Grouped> {
        (self.groups > 1).then(|| super::cpu::grouped_path(g.c / self.groups))
    }
}

impl GpuLayer for Conv2dGpu {
    fn reserve(&mut self, gpu: &Gpu, place: &Placement, n: usize) -> Result<()> {
        let g = window_geom(place, self.window, n)?;
        let len = if self.grouped(&g) == Some(Grouped::Direct) { 1 } else { g.col_len().max(1) };
        self.cols = None;
        self.cols = Some(gpu.stream().alloc_zeros::<f32>(len)?);
        Ok(())
    }

    /// The per-sample products of the weight gradient (N, O, C·KH·KW), then the column
    /// gradient (N, C·KH·KW, OH·OW), side by side. In groups: the direct path's
    /// per-sample weight gradients (N, O, C/G·KH·KW); or one group's products
    /// (N, O/G, C/G·KH·KW) and the column gradient.
    fn scratch(&self, place: &Placement, n: usize) -> Result<usize> {
        let g = window_geom(place, self.window, n)?;
        let (o, kk, groups) = (self.filters, g.kh * g.kw, self.groups);
        Ok(match self.grouped(&g) {
            None => n * self.filters * g.c * g.kh * g.kw + g.col_len(),
            Some(Grouped::Direct) => n * o * (g.c / groups) * kk,
            Some(Grouped::PerGroup) => n * (o / groups) * (g.c / groups) * kk + g.col_len(),
        })
    }

    // x: (N, C, H, W), weight: (O, C/G, KH, KW) → y: (N, O, OH, OW)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let (n, o) = (f.n, self.filters);
        let g = window_geom(f.place, self.window, n)?;
        if let Some(how) = self.grouped(&g) {
            return self.grouped_forward(f, &g, how);
        }
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
        if let Some(how) = self.grouped(&g) {
            return self.grouped_backward(b, &g, how);
        }
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

impl Conv2dGpu {
    // x: (N, C, H, W), weight: (O, C/G, KH, KW) → y: (N, O, OH, OW), in G groups
    fn grouped_forward(&mut self, f: Forward<'_, '_, '_>, g: &WindowGeom, how: Grouped) -> Result<()> {
        let (n, o, groups) = (f.n, self.filters, self.groups);
        let pp = g.oh() * g.ow();
        match how {
            Grouped::Direct => f.gpu.conv2d_direct_fwd(f.x, &f.param(0), f.y, g, o, groups)?,
            Grouped::PerGroup => {
                let (og, kg, ckk) = (o / groups, g.c / groups * g.kh * g.kw, g.c * g.kh * g.kw);
                let col = self.cols.as_mut().expect("reserved before the pass");
                f.gpu.im2col_fwd(f.x, col, g)?;
                let weight = f.param(0);
                for k in 0..groups {
                    // y_n[k] (O/G, P) = W_k (O/G, C/G·KH·KW) · col_n[k] (C/G·KH·KW, P)
                    let w_k = weight.slice(k * og * kg..(k + 1) * og * kg);
                    let col_k = col.slice(k * kg * pp..);
                    let mut y_k = f.y.slice_mut(k * og * pp..);
                    cublas_gemm(f.blas, &RmGemm::grouped_conv_fwd(n, groups, o, ckk, pp), &w_k, &col_k, &mut y_k)?;
                }
            }
        }
        if self.use_bias {
            f.gpu.bias_nchw_fwd(f.y, &f.param(1), n, o, pp)?;
        }
        Ok(())
    }

    // dy: (N, O, OH, OW) → dweight (O, C/G, KH, KW) += Σ_n of the samples', dbias += Σ dy,
    // dx: (N, C, H, W) written, in G groups
    fn grouped_backward(&mut self, b: Backward<'_, '_>, g: &WindowGeom, how: Grouped) -> Result<()> {
        let (n, o, groups) = (b.n, self.filters, self.groups);
        let (pp, kk) = (g.oh() * g.ow(), g.kh * g.kw);
        let (og, kg, ckk) = (o / groups, g.c / groups * kk, g.c * kk);
        let Backward { gpu, blas, place, params, x, dy, dx, grads, scratch, .. } = b;
        let weight = params.slice(place.params[0].clone());
        let mut dweight = grads.slice_mut(place.params[0].clone());
        match how {
            Grouped::Direct => {
                let mut part = scratch.slice_mut(0..n * o * kg);
                gpu.conv2d_direct_params_bwd(x, &dy, &mut part, g, o, groups)?;
                gpu.conv2d_params_sum_bwd(&part, &mut dweight, n)?;
                if let Some(mut dx) = dx {
                    gpu.conv2d_direct_bwd(&dy, &weight, &mut dx, g, o, groups)?;
                }
            }
            Grouped::PerGroup => {
                let col = self.cols.as_ref().expect("reserved before the pass");
                let (mut parts, mut dcol) = scratch.split_at_mut(n * og * kg);
                for k in 0..groups {
                    // dW_k += Σ_n dy_n[k] (O/G, P) · col_n[k]ᵀ (P, C/G·KH·KW)
                    let mut part = parts.slice_mut(0..n * og * kg);
                    let (dy_k, col_k) = (dy.slice(k * og * pp..), col.slice(k * kg * pp..));
                    cublas_gemm(blas, &RmGemm::grouped_conv_dw(n, groups, o, ckk, pp), &dy_k, &col_k, &mut part)?;
                    let mut dw_k = dweight.slice_mut(k * og * kg..(k + 1) * og * kg);
                    gpu.conv2d_params_sum_bwd(&part, &mut dw_k, n)?;
                }
                if let Some(mut dx) = dx {
                    let mut dcol = dcol.slice_mut(0..g.col_len());
                    for k in 0..groups {
                        // dcol_n[k] (C/G·KH·KW, P) = W_kᵀ · dy_n[k] (O/G, P)
                        let w_k = weight.slice(k * og * kg..(k + 1) * og * kg);
                        let (dy_k, mut dcol_k) = (dy.slice(k * og * pp..), dcol.slice_mut(k * kg * pp..));
                        cublas_gemm(blas, &RmGemm::grouped_conv_dcol(n, groups, o, ckk, pp), &w_k, &dy_k, &mut dcol_k)?;
                    }
                    gpu.im2col_bwd(&dcol, &mut dx, g)?;
                }
            }
        }
        if self.use_bias {
            gpu.bias_nchw_bwd(&dy, &mut grads.slice_mut(place.params[1].clone()), n, o, pp)?;
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

/// The geometries of the grouped checks, (window, O, G), host and GPU: depthwise 3x3 at
/// stride 1, "same" (1 each side); depthwise at stride 2 with Keras's "same" on an even
/// size (0 top/left, 1 bottom/right); two filters a channel (O = 2C), a 3x2 kernel at
/// stride 2 with every pad different (1/2/0/1); groups of 2 channels to 3 filters, 2x4
/// at stride 1, valid; ConvNeXt's depthwise 7x7, padding 3, on one sample.
#[cfg(test)]
fn grouped_geoms() -> [(WindowGeom, usize, usize); 5] {
    let geom = |(n, c, h, w), k, s, pads| WindowGeom::new(n, c, (h, w), k, (s, s), pads);
    [
        (geom((2, 3, 7, 9), (3, 3), 1, [1, 1, 1, 1]), 3, 3),
        (geom((2, 4, 8, 6), (3, 3), 2, [0, 0, 1, 1]), 4, 4),
        (geom((2, 2, 7, 9), (3, 2), 2, [1, 2, 0, 1]), 4, 2),
        (geom((2, 4, 5, 6), (2, 4), 1, [0, 0, 0, 0]), 6, 2),
        (geom((1, 2, 10, 12), (7, 7), 1, [3, 3, 3, 3]), 2, 2),
    ]
}

/// What the direct kernels must give at `g` with `o` filters in `groups` groups, by the
/// CPU's [`super::cpu::Direct`] sample by sample: y (no bias), each sample's weight
/// gradient (N, O, C/G, KH, KW) and dx, for x, weight and dy.
#[cfg(test)]
fn direct_want(g: &WindowGeom, o: usize, groups: usize, x: &[f32], w: &[f32], dy: &[f32]) -> [Vec<f32>; 3] {
    use super::cpu::{direct_backward_sample, direct_forward_sample, Direct, Grouping};
    let gr = Grouping { g: cpu_twin(g).expect("equal strides"), o, groups };
    assert_eq!(gr.path(), Grouped::Direct, "{g:?}: a geometry of the direct path");
    let d = Direct::new(&gr);
    let (per_x, per_y, per_w) = (g.c * g.h * g.w, o * g.oh() * g.ow(), w.len());
    let (mut y, mut part, mut dx) = (vec![0.0; g.n * per_y], vec![0.0; g.n * per_w], vec![0.0; g.n * per_x]);
    let (mut xp, mut dp) = (vec![0.0; d.x_len()], vec![0.0; d.dout_len()]);
    for s in 0..g.n {
        let xn = &x[s * per_x..(s + 1) * per_x];
        direct_forward_sample(&d, xn, w, None, &mut y[s * per_y..(s + 1) * per_y], &mut xp);
        let mut xs = Samples::Apart { x: xn, dx: Some(&mut dx[s * per_x..(s + 1) * per_x]) };
        let (dy_n, part_n) = (&dy[s * per_y..(s + 1) * per_y], &mut part[s * per_w..(s + 1) * per_w]);
        direct_backward_sample(&d, &mut xs, 0, dy_n, w, part_n, &mut xp, &mut dp);
    }
    [y, part, dx]
}

/// The kernels of kernels/conv2d.cu run on the host against the CPU: im2col and col2im
/// against `backend::cpu`'s unfolding, which the layer's columns run ([`unfold_want`]),
/// with stride and asymmetric padding; the bias add against [`super::cpu::add_bias`], bit
/// for bit (one f32 add); its reduction against [`super::cpu::bias_grad`], within 1e-5
/// relative and absolute (up to 400 terms of magnitude ≤ 1, summed in f32 in two orders:
/// the kernel's strided partial sums and tree, the CPU's plane by plane); the direct
/// kernels of several groups against the CPU's direct path ([`direct_want`]), bit for bit
/// (the same sums in the same order, uncontracted), at [`grouped_geoms`]; the sum of the
/// samples' weight gradients against its definition, bit for bit. The grid-stride
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

    for (seed, (g, o, groups)) in (80..).zip(grouped_geoms()) {
        let (y_len, w_len) = (g.n * o * g.oh() * g.ow(), o * g.c / groups * g.kh * g.kw);
        let (x, w, dy) = (uniform(seed, g.x_len()), uniform(seed + 1, w_len), uniform(seed + 2, y_len));
        let [want_y, want_part, want_dx] = direct_want(&g, o, groups, &x, &w, &dy);
        let geom = g.launch_args("direct host check").unwrap();
        let og = || [I32(o as i32), I32(groups as i32)];
        let what = |part: &str, cfg: &crate::cuda::host::Cfg| format!("{part}, {g:?}, O {o}, G {groups}, {cfg:?}");
        for cfg in [elem_cfg(y_len), FEW] {
            let mut y = vec![f32::NAN; y_len];
            // As Gpu::conv2d_direct_fwd pushes them: x, weight, y, the 12 ints, O, G.
            let mut args = vec![In(&x), In(&w), Out(&mut y)];
            args.extend(geom.map(I32));
            args.extend(og());
            k.launch(&conv2d_direct::FWD, cfg, &mut args);
            assert_bits(&what("direct y", &cfg), &y, &want_y);
        }
        for cfg in [elem_cfg(g.x_len()), FEW] {
            let mut dx = vec![f32::NAN; g.x_len()];
            // As Gpu::conv2d_direct_bwd: dy, weight, dx, the 12 ints, O, G.
            let mut args = vec![In(&dy), In(&w), Out(&mut dx)];
            args.extend(geom.map(I32));
            args.extend(og());
            k.launch(&conv2d_direct::BWD, cfg, &mut args);
            assert_bits(&what("direct dx", &cfg), &dx, &want_dx);
        }
        for cfg in [elem_cfg(g.n * w_len), FEW] {
            let mut part = vec![f32::NAN; g.n * w_len];
            // As Gpu::conv2d_direct_params_bwd: x, dy, part, the 12 ints, O, G.
            let mut args = vec![In(&x), In(&dy), Out(&mut part)];
            args.extend(geom.map(I32));
            args.extend(og());
            k.launch(&conv2d_direct_params::BWD, cfg, &mut args);
            assert_bits(&what("direct per-sample dweight", &cfg), &part, &want_part);
        }
    }

    // The samples' sum, accumulated: 5 samples of 1001 values onto a gradient that holds
    // values already, each sample added from 0 in order and the sum then added (f32).
    let (n, len) = (5, 1001);
    let (part, dw0) = (uniform(90, n * len), uniform(91, len));
    let want: Vec<f32> = (0..len).map(|i| dw0[i] + (0..n).fold(0.0f32, |acc, s| acc + part[s * len + i])).collect();
    for cfg in elem_cfgs(len) {
        let mut dw = dw0.clone();
        // As Gpu::conv2d_params_sum_bwd: part, dweight, N (int), len.
        k.launch(&conv2d_params_sum::BWD, cfg, &mut [In(&part), Out(&mut dw), I32(n as i32), U64(len as u64)]);
        assert_bits(&format!("conv2d_params_sum {cfg:?}"), &dw, &want);
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

    /// The direct kernels of several groups on a GPU against the CPU's direct path: y, dx
    /// and the per-sample weight gradients within 1e-5 relative and absolute (the same
    /// sums in the same order, but NVRTC may contract them into FMAs).
    #[test]
    fn the_direct_kernels_match_the_cpu_on_a_gpu() {
        if !gpu_or_skip("the_direct_kernels_match_the_cpu_on_a_gpu") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        for (seed, (g, o, groups)) in (100..).zip(grouped_geoms()) {
            let (y_len, w_len) = (g.n * o * g.oh() * g.ow(), o * g.c / groups * g.kh * g.kw);
            let (x, w, dy) = (uniform(seed, g.x_len()), uniform(seed + 1, w_len), uniform(seed + 2, y_len));
            let [want_y, want_part, want_dx] = direct_want(&g, o, groups, &x, &w, &dy);
            let (x_d, w_d, dy_d) = (up(&gpu, &x), up(&gpu, &w), up(&gpu, &dy));
            let mut y_d = up(&gpu, &vec![f32::NAN; y_len]);
            gpu.conv2d_direct_fwd(&x_d, &w_d, &mut y_d, &g, o, groups).unwrap();
            assert_close(&format!("direct y {g:?}"), &down(&gpu, &y_d), &f64s(&want_y), 1e-5, 1e-5);
            let mut dx_d = up(&gpu, &vec![f32::NAN; g.x_len()]);
            gpu.conv2d_direct_bwd(&dy_d, &w_d, &mut dx_d, &g, o, groups).unwrap();
            assert_close(&format!("direct dx {g:?}"), &down(&gpu, &dx_d), &f64s(&want_dx), 1e-5, 1e-5);
            let mut part_d = up(&gpu, &vec![f32::NAN; g.n * w_len]);
            gpu.conv2d_direct_params_bwd(&x_d, &dy_d, &mut part_d, &g, o, groups).unwrap();
            assert_close(&format!("direct part {g:?}"), &down(&gpu, &part_d), &f64s(&want_part), 1e-5, 1e-5);
        }
    }

    /// A network of grouped convolutions on a GPU against the CPU: one depthwise (the
    /// direct kernels, two filters a channel), one of two groups of 8 channels (a GEMM a
    /// group), each with bias, trained one pass; the parameters' gradients and an
    /// evaluation's logits within 1e-4 relative and 1e-5 absolute (cuBLAS and the CPU sum
    /// in other orders), as the conformance test holds every layer type's.
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
