//! MatMul on a GPU: the op's GPU form, three strided-batched GEMMs of cuBLAS
//! (`cuda::gemm`'s `matmul`, `matmul_da`, `matmul_db`), as linear and attention run theirs;
//! no kernel of its own. cuBLAS sums in its own order, so the GPU agrees with the CPU to
//! rounding, not bit for bit (the conformance test's tolerance).

use crate::cuda::gemm::{gemm as cublas_gemm, RmGemm};
use crate::ops::gpu::{Backward, Forward, GpuLayer, Placement};
use crate::{Error, Result};

use super::*;

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(_layer: &MatMul) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(MatMulGpu))
}

/// MatMul on a GPU: y = a·b per product; da = dy·bᵀ and db = aᵀ·dy where asked for, from
/// the network's activations (the forward's inputs, which it keeps for the backward).
pub(super) struct MatMulGpu;

/// The products of a batch of `n` at `place`: (batch of products, M, K, N).
fn dims(place: &Placement, n: usize) -> Result<Dims> {
    let with_batch = |s: &Shape| Shape::new([&[n][..], s.dims()].concat());
    let inputs: Vec<Shape> = std::iter::once(&place.input).chain(&place.other_inputs).map(with_batch).collect();
    let (_, d) = meet(&inputs).map_err(|e| Error::shape("MatMul", format!("{}: {e}", place.name)))?;
    Ok(Dims { items: d.items * n, ..d })
}

impl GpuLayer for MatMulGpu {
    // a: (N, ..., M, K), b: (N, ..., K, P) → y: (N, ..., M, P)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let Dims { items, m, k, n } = dims(f.place, f.n)?;
        cublas_gemm(f.blas, &RmGemm::matmul(items, m, k, n), f.x, f.others[0], f.y)
    }

    // dy: (N, ..., M, P) → da = dy·bᵀ: (N, ..., M, K), db = aᵀ·dy: (N, ..., K, P), each
    // where asked for (written)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Dims { items, m, k, n } = dims(b.place, b.n)?;
        let Backward { blas, x, others, dy, dx, d_others, .. } = b;
        if let Some(mut da) = dx {
            cublas_gemm(blas, &RmGemm::matmul_da(items, m, k, n), &dy, others[0], &mut da)?;
        }
        if let Some(Some(mut db)) = d_others.into_iter().next() {
            cublas_gemm(blas, &RmGemm::matmul_db(items, m, k, n), x, &dy, &mut db)?;
        }
        Ok(())
    }
}
