//! A 2-D convolution on a GPU: the declaration of kernels/conv2d.cu (im2col and its adjoint,
//! the bias over channels and its reduction), their checked launches, and the op's GPU form,
//! whose products are cuBLAS's (`cuda::gemm`). The unfolding's layout is the CPU's, so the
//! two backends share one weight layout.

use crate::cuda::gemm::{gemm as cublas_gemm, RmGemm};
use crate::cuda::launch::{channel_cfg, check_len, dim, elem_cfg, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{window_geom, Backward, Forward, GpuLayer, Node};
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
    fn reserve(&mut self, gpu: &Gpu, node: &Node, n: usize) -> Result<()> {
        let g = window_geom(node, self.window, n)?;
        self.cols = None;
        self.cols = Some(gpu.stream().alloc_zeros::<f32>(g.col_len().max(1))?);
        Ok(())
    }

    /// The per-sample products of the weight gradient (N, O, C·KH·KW), then the column
    /// gradient (N, C·KH·KW, OH·OW), side by side.
    fn scratch(&self, node: &Node, n: usize) -> Result<usize> {
        let g = window_geom(node, self.window, n)?;
        Ok(n * self.filters * g.c * g.kh * g.kw + g.col_len())
    }

    // x: (N, C, H, W), weight: (O, C, KH, KW) → y: (N, O, OH, OW)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let (n, o) = (f.n, self.filters);
        let g = window_geom(f.node, self.window, n)?;
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
        let g = window_geom(b.node, self.window, n)?;
        let (ckk, pp) = (g.c * g.kh * g.kw, g.oh() * g.ow());
        let Backward { gpu, blas, node, params, dy, dx, grads, scratch, .. } = b;
        let col = self.cols.as_ref().expect("reserved before the pass");
        // dW = Σ_n dW_n in sample order
        let mut part = scratch.slice_mut(0..n * o * ckk);
        cublas_gemm(blas, &RmGemm::conv_dw(n, o, ckk, pp), &dy, col, &mut part)?;
        gpu.reduce_sum(&part, &mut grads.slice_mut(node.params[0].clone()), n, 1.0)?;
        if self.use_bias {
            gpu.bias_nchw_bwd(&dy, &mut grads.slice_mut(node.params[1].clone()), n, o, pp)?;
        }
        if let Some(mut dx) = dx {
            let mut dcol = scratch.slice_mut(n * o * ckk..n * o * ckk + g.col_len());
            cublas_gemm(
                blas,
                &RmGemm::conv_dcol(n, o, ckk, pp),
                &params.slice(node.params[0].clone()),
                &dy,
                &mut dcol,
            )?;
            gpu.im2col_bwd(&dcol, &mut dx, &g)?;
        }
        Ok(())
    }
}
