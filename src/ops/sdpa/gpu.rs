//! Scaled dot-product attention on a GPU: the op's GPU form, whose products are cuBLAS's
//! strided batches over the N·H (sample, head) pairs (ATen's (N, H, T, D) layout is
//! already the per-head one: no split or merge) and whose softmax and its gradient are
//! kernels/attention.cu's, launched through causal self-attention's checked launches
//! (`ops::attention::gpu`, which holds them to the CPU on the host). q is the node's
//! first input (`Forward::x`), k and v its others; their gradients `dx` and `d_others`.

use crate::cuda::gemm::{gemm as cublas_gemm, RmGemm};
use crate::cuda::Gpu;
use crate::ops::attention::cpu::{attention_scale, Mask};
use crate::ops::gpu::{Backward, Forward, GpuLayer, Placement};
use crate::{Error, Result};
use cudarc::driver::CudaSlice;

use super::{ScaledDotProductAttention, OP};

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &ScaledDotProductAttention) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(SdpaGpu { mask: layer.mask, scale: layer.scale, probs: None }))
}

/// (H, T, D) of a place's per-sample inputs, which must be three of one shape.
fn place_htd(place: &Placement) -> Result<(usize, usize, usize)> {
    let same = place.other_inputs.len() == 2 && place.other_inputs.iter().all(|s| *s == place.input);
    match place.input.dims() {
        &[h, t, d] if same => Ok((h, t, d)),
        _ => Err(Error::shape(
            OP,
            format!(
                "{}: inputs {} and {:?} are not three of one shape (H, T, D)",
                place.name, place.input, place.other_inputs
            ),
        )),
    }
}

/// Scaled dot-product attention on a GPU: S = q·kᵀ and y = P·v by cuBLAS, the softmax by
/// kernels/attention.cu; P kept for the backward.
struct SdpaGpu {
    mask: Mask,
    scale: Option<f32>,
    /// P: (N, H, T, T), sized by `reserve` for the batch.
    probs: Option<CudaSlice<f32>>,
}

impl GpuLayer for SdpaGpu {
    fn reserve(&mut self, gpu: &Gpu, place: &Placement, n: usize) -> Result<()> {
        let (h, t, _) = place_htd(place)?;
        self.probs = None;
        self.probs = Some(gpu.stream().alloc_zeros::<f32>((n * h * t * t).max(1))?);
        Ok(())
    }

    /// Two (N, H, T, T) areas: the scores in the forward; dP and dS in the backward.
    fn scratch(&self, place: &Placement, n: usize) -> Result<usize> {
        let (h, t, _) = place_htd(place)?;
        Ok(2 * n * h * t * t)
    }

    // q: (N, H, T, D), others k, v: (N, H, T, D) → y: (N, H, T, D)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let (h, t, d) = place_htd(f.place)?;
        let (nh, nhtt) = (f.n * h, f.n * h * t * t);
        let &[k, v] = f.others else { unreachable!("place_htd checked the three inputs") };
        let Some(probs) = self.probs.as_mut() else { unreachable!("reserved before the pass") };
        let scale = self.scale.unwrap_or_else(|| attention_scale(d));
        let mut s = f.scratch.slice_mut(..nhtt);
        // S = q·kᵀ, P = softmax(scale·S) under the mask, y = P·v
        cublas_gemm(f.blas, &RmGemm::attention_scores(nh, t, d), f.x, k, &mut s)?;
        f.gpu.attention_softmax_fwd(&s, &mut probs.slice_mut(..nhtt), t, scale, self.mask)?;
        cublas_gemm(f.blas, &RmGemm::attention_mix(nh, t, d), &probs.slice(..nhtt), v, f.y)
    }

    // dy: (N, H, T, D) → dq (dx), dk, dv (d_others): (N, H, T, D), each where asked for
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let (h, t, d) = place_htd(b.place)?;
        let (nh, nhtt) = (b.n * h, b.n * h * t * t);
        let &[k, v] = b.others else { unreachable!("place_htd checked the three inputs") };
        let Some(probs) = self.probs.as_ref() else { unreachable!("reserved before the pass") };
        let p = probs.slice(..nhtt);
        let scale = self.scale.unwrap_or_else(|| attention_scale(d));
        let Backward { gpu, blas, x: q, dy, dx: dq, mut d_others, scratch, .. } = b;
        let (dk, dv) = match d_others.as_mut_slice() {
            [dk, dv] => (dk.take(), dv.take()),
            _ => return Err(Error::shape(OP, format!("{} input gradients for its 3 inputs", d_others.len() + 1))),
        };
        // dv = Pᵀ·dy
        if let Some(mut dv) = dv {
            cublas_gemm(blas, &RmGemm::attention_mix_t(nh, t, d), &p, &dy, &mut dv)?;
        }
        if dq.is_none() && dk.is_none() {
            return Ok(());
        }
        // dP = dy·vᵀ (area a), dS = softmax'(dP) (area b), dq = dS·k, dk = dSᵀ·q
        let mut areas = scratch.slice_mut(..2 * nhtt);
        let (mut da, mut db) = areas.split_at_mut(nhtt);
        cublas_gemm(blas, &RmGemm::attention_scores(nh, t, d), &dy, v, &mut da)?;
        gpu.attention_softmax_bwd(&p, &da, &mut db, t, scale, self.mask)?;
        if let Some(mut dq) = dq {
            cublas_gemm(blas, &RmGemm::attention_mix(nh, t, d), &db, k, &mut dq)?;
        }
        if let Some(mut dk) = dk {
            cublas_gemm(blas, &RmGemm::attention_mix_t(nh, t, d), &db, q, &mut dk)?;
        }
        Ok(())
    }
}
