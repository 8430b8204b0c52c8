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
        let (n, f, o) = (fw.n * fw.place.input.numel() / self.f, self.f, self.o);
        cublas_gemm(fw.blas, &RmGemm::linear_fwd(n, f, o), fw.x, &fw.param(0), fw.y)?;
        if self.use_bias {
            fw.gpu.bias_cols_fwd(fw.y, &fw.param(1), n, o)?;
        }
        Ok(())
    }

    // dy: (N, O) → dweight += dyᵀ·x (O, F), dbias += Σ_n dy (O), dx = dy·W (N, F)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let (n, f, o) = (b.n * b.place.input.numel() / self.f, self.f, self.o);
        let Backward { gpu, blas, place, params, x, dy, dx, grads, .. } = b;
        cublas_gemm(blas, &RmGemm::linear_dw(n, f, o), &dy, x, &mut grads.slice_mut(place.params[0].clone()))?;
        if self.use_bias {
            gpu.bias_cols_bwd(&dy, &mut grads.slice_mut(place.params[1].clone()), n, o)?;
        }
        if let Some(mut dx) = dx {
            cublas_gemm(blas, &RmGemm::linear_dx(n, f, o), &dy, &params.slice(place.params[0].clone()), &mut dx)?;
        }
        Ok(())
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/linear.cu run on the host against the CPU's [`super::cpu`]: the
/// bias added to the product without one against the forward with one, and its gradient
/// against the CPU's ordered sum bit for bit (a column of −0 stays −0), on O = 300 columns,
/// more than one block, so that two blocks share them, under the launch shapes the
/// launches use and under a grid with fewer threads than columns.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfg, In, Out, FEW, I32, U64};
    use crate::testing::{assert_bits, assert_close, uniform};
    let (n, f, o) = (7, 5, 300);
    let (x, weight, bias) = (uniform(3, n * f), uniform(4, o * f), uniform(5, o));
    let (mut dy, mut dbias0) = (uniform(6, n * o), uniform(7, o));
    dbias0[0] = -0.0;
    (0..n).for_each(|s| dy[s * o] = -0.0);
    let total = n * o;
    // The GPU form's order: the product, then the bias; the CPU's: the bias, then the
    // product added to it.
    let product = super::cpu::linear_forward(&x, &weight, None, n, f, o);
    let want_y = super::cpu::linear_forward(&x, &weight, Some(&bias), n, f, o);
    let want_y: Vec<f64> = want_y.iter().map(|&v| v as f64).collect();
    let mut want_dbias = dbias0.clone();
    super::cpu::bias_backward(&dy, &mut want_dbias, o);
    for (cfg_fwd, cfg_bwd) in [(elem_cfg(total), elem_cfg(o)), (FEW, FEW)] {
        let mut y = product.clone();
        // As Gpu::bias_cols_fwd pushes them: y, bias, O (int), total.
        k.launch(&bias_cols::FWD, cfg_fwd, &mut [Out(&mut y), In(&bias), I32(o as i32), U64(total as u64)]);
        // The GEMM may add its product to the bias at any point of its sum over F = 5 terms
        // of magnitude ≤ 1: within a few roundings of values below 6, 1e-6 absolute.
        assert_close(&format!("bias_cols y {cfg_fwd:?}"), &y, &want_y, 0.0, 1e-6);
        let mut dbias = dbias0.clone();
        // As Gpu::bias_cols_bwd pushes them: dy, dbias, N (int), O (int); one thread per column.
        k.launch(&bias_cols::BWD, cfg_bwd, &mut [In(&dy), Out(&mut dbias), I32(n as i32), I32(o as i32)]);
        // The rows added into the gradient's value in the CPU's order: exact.
        assert_bits(&format!("bias_cols dbias (accumulated) {cfg_bwd:?}"), &dbias, &want_dbias);
    }
}

// ---- on a GPU ---------------------------------------------------------------------------

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::ops::linear::cpu;
    use crate::testing::{assert_bits, assert_close, uniform};

    /// The bias kernels on a GPU against the CPU's [`cpu`], as on the host: the bias added to
    /// the product within the GEMM's roundings, its gradient the CPU's ordered sum bit for bit.
    #[test]
    fn the_bias_kernels_on_a_gpu_are_the_cpus() {
        if !crate::ops::conformance::gpu_or_skip("the_bias_kernels_on_a_gpu_are_the_cpus") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let s = gpu.stream();
        let (n, f, o) = (6, 5, 10);
        let (x, weight, bias, dy, dbias0) =
            (uniform(1, n * f), uniform(2, o * f), uniform(3, o), uniform(4, n * o), uniform(5, o));
        let product = cpu::linear_forward(&x, &weight, None, n, f, o);
        let want_y = cpu::linear_forward(&x, &weight, Some(&bias), n, f, o);
        let mut y_d = s.clone_htod(&product).unwrap();
        gpu.bias_cols_fwd(&mut y_d, &s.clone_htod(&bias).unwrap(), n, o).unwrap();
        // As on the host: F = 5 terms of magnitude ≤ 1, 1e-6 absolute.
        let want_y: Vec<f64> = want_y.iter().map(|&v| v as f64).collect();
        assert_close("bias_cols y", &s.clone_dtoh(&y_d).unwrap(), &want_y, 0.0, 1e-6);
        let mut want_dbias = dbias0.clone();
        cpu::bias_backward(&dy, &mut want_dbias, o);
        let mut db_d = s.clone_htod(&dbias0).unwrap();
        gpu.bias_cols_bwd(&s.clone_htod(&dy).unwrap(), &mut db_d, n, o).unwrap();
        assert_bits("bias_cols dbias (accumulated)", &s.clone_dtoh(&db_d).unwrap(), &want_dbias);
    }
}
