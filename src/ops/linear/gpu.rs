//! A dense layer on a GPU: the declaration of kernels/linear.cu (the bias over the columns,
//! and its reduction over the rows), its checked launches, and the op's GPU form, whose
//! products are cuBLAS's (`cuda::gemm`).

use crate::cuda::gemm::{gemm as cublas_gemm, RmGemm};
use crate::cuda::launch::{check_len, dim, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::Result;

use super::*;

crate::cuda::declare::kernels! {
    "linear.cu" {
        bias_cols {
            fwd(y: Out, bias: In, o: I32, total: Size);
            bwd(dy: In, dbias: Out, n: I32, o: I32);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
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
        unsafe { bias_cols::fwd(self, elem_cfg(total), y, bias, oi, total) }
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
        unsafe { bias_cols::bwd(self, elem_cfg(o), dy, dbias, ni, oi) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &Linear) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(LinearGpu { f: layer.in_features, o: layer.out_features, use_bias: layer.use_bias }))
}

/// Linear on a GPU: the three GEMMs of the CPU layer, by cuBLAS, and the bias kernels.
pub(super) struct LinearGpu {
    f: usize,
    o: usize,
    use_bias: bool,
}

impl GpuLayer for LinearGpu {
    // x: (n, F) rows (every position of every sample), weight: (O, F) → y: (n, O)
    fn forward(&mut self, fw: Forward<'_, '_, '_>) -> Result<()> {
        let (n, f, o) = (fw.n * fw.node.input.numel() / self.f, self.f, self.o);
        cublas_gemm(fw.blas, &RmGemm::linear_fwd(n, f, o), fw.x, &fw.param(0), fw.y)?;
        if self.use_bias {
            fw.gpu.bias_cols_fwd(fw.y, &fw.param(1), n, o)?;
        }
        Ok(())
    }

    // dy: (N, O) → dweight += dyᵀ·x (O, F), dbias += Σ_n dy (O), dx = dy·W (N, F)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let (n, f, o) = (b.n * b.node.input.numel() / self.f, self.f, self.o);
        let Backward { gpu, blas, node, params, x, dy, dx, grads, .. } = b;
        cublas_gemm(blas, &RmGemm::linear_dw(n, f, o), &dy, x, &mut grads.slice_mut(node.params[0].clone()))?;
        if self.use_bias {
            gpu.bias_cols_bwd(&dy, &mut grads.slice_mut(node.params[1].clone()), n, o)?;
        }
        if let Some(mut dx) = dx {
            cublas_gemm(blas, &RmGemm::linear_dx(n, f, o), &dy, &params.slice(node.params[0].clone()), &mut dx)?;
        }
        Ok(())
    }
}
