//! Causal self-attention on a GPU: the declaration of kernels/attention.cu (the head split
//! and merge, the causal softmax and its gradient), [`HeadsGeom`], the checked launches, and
//! the op's GPU form, whose products are cuBLAS's and whose dropout is kernels/dropout.cu's.

use crate::cuda::gemm::{gemm as cublas_gemm, RmGemm};
use crate::cuda::launch::{check_len, dim, elem_cfg, DevIn, DevOut, MAX_BLOCKS};
use crate::cuda::Gpu;
use crate::ops::dropout::gpu::DropoutKey;
use crate::ops::gpu::{Backward, Draw, Forward, GpuLayer, Pass, Placement};
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, CudaViewMut, LaunchConfig};

use super::cpu::Mask;
use super::*;

crate::cuda::declare::kernels! {
    "attention.cu" {
        attention_heads {
            fwd(x: In, y: Out, n: I32, t: I32, parts: I32, heads: I32, hd: I32);
            bwd(dy: In, dx: Out, n: I32, t: I32, parts: I32, heads: I32, hd: I32);
        }
        attention_softmax {
            fwd(s: In, p: Out, rows: I32, t: I32, scale: F32, causal: I32);
            bwd(p: In, dp: In, ds: Out, rows: I32, t: I32, scale: F32, causal: I32);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

/// Threads per block of the softmax kernels; must equal `ATTENTION_BLOCK` in
/// kernels/attention.cu.
pub const ATTENTION_BLOCK: u32 = 128;

/// The layout the head kernels move between: N samples of T positions, each row `parts`
/// tensors of `heads` heads of width `hd` side by side ((N, T, P·H·D) against
/// (P, N, H, T, D)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadsGeom {
    pub n: usize,
    pub t: usize,
    pub parts: usize,
    pub heads: usize,
    pub hd: usize,
}

impl HeadsGeom {
    /// Elements of either layout: P·N·H·T·D.
    pub fn len(&self) -> usize {
        self.parts * self.n * self.heads * self.t * self.hd
    }

    /// True when either layout holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// N, T, P, H, D as the kernels' ints.
    fn args(&self, op: &'static str) -> Result<[i32; 5]> {
        Ok([
            dim(op, "N", self.n)?,
            dim(op, "T", self.t)?,
            dim(op, "P", self.parts)?,
            dim(op, "H", self.heads)?,
            dim(op, "D", self.hd)?,
        ])
    }
}

/// One block of [`ATTENTION_BLOCK`] threads per row, at most `MAX_BLOCKS` blocks (the
/// kernels loop over the rest).
fn row_cfg(rows: usize) -> LaunchConfig {
    let blocks = rows.clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (ATTENTION_BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// The softmax kernels' `causal` argument for `mask`.
fn causal(mask: Mask) -> i32 {
    i32::from(mask == Mask::Causal)
}

/// The rows of (rows, T) scores in a buffer of `len` values, checked.
fn rows_of(op: &'static str, len: usize, t: usize) -> Result<i32> {
    if t == 0 || !len.is_multiple_of(t) {
        return Err(Error::shape(op, format!("{len} values are not rows of T = {t}")));
    }
    dim(op, "rows", len / t)
}

impl Gpu {
    /// The head split: x (N, T, P·H·D) → y (P, N, H, T, D).
    pub fn attention_heads_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, g: HeadsGeom) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let op = "attention_heads_fwd";
        check_len(op, "x", x, g.len())?;
        check_len(op, "y", y, g.len())?;
        if g.is_empty() {
            return Ok(());
        }
        let [n, t, parts, heads, hd] = g.args(op)?;
        // SAFETY: attention_heads_fwd_f32(const float*, float*, int, int, int, int, int); x
        // and y hold P·N·H·T·D floats each (checked), which is every index the kernel forms.
        unsafe { attention_heads::fwd(self, elem_cfg(g.len()), x, y, n, t, parts, heads, hd) }
    }

    /// The head merge, the split's adjoint: dy (P, N, H, T, D) → dx (N, T, P·H·D).
    pub fn attention_heads_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, g: HeadsGeom) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let op = "attention_heads_bwd";
        check_len(op, "dy", dy, g.len())?;
        check_len(op, "dx", dx, g.len())?;
        if g.is_empty() {
            return Ok(());
        }
        let [n, t, parts, heads, hd] = g.args(op)?;
        // SAFETY: attention_heads_bwd_f32(const float*, float*, int, int, int, int, int); dy
        // and dx hold P·N·H·T·D floats each (checked).
        unsafe { attention_heads::bwd(self, elem_cfg(g.len()), dy, dx, n, t, parts, heads, hd) }
    }

    /// The softmax of scale·s over each row of T under `mask`, row r at position r mod T.
    /// s, p: (rows, T), rows = N·H·T.
    pub fn attention_softmax_fwd(
        &self,
        s: &impl DevIn,
        p: &mut impl DevOut,
        t: usize,
        scale: f32,
        mask: Mask,
    ) -> Result<()> {
        let s = &s.view();
        let p = &mut p.view_mut();
        let op = "attention_softmax_fwd";
        check_len(op, "p", p, s.len())?;
        if s.is_empty() {
            return Ok(());
        }
        let rows = rows_of(op, s.len(), t)?;
        let ti = dim(op, "T", t)?;
        // SAFETY: attention_softmax_fwd_f32(const float*, float*, int, int, float, int); s
        // and p hold rows·T floats (checked); the launch is ATTENTION_BLOCK threads a block,
        // the size of the kernel's shared array.
        unsafe { attention_softmax::fwd(self, row_cfg(rows as usize), s, p, rows, ti, scale, causal(mask)) }
    }

    /// The softmax's gradient by the scores, scaled, under `mask`. p, dp, ds: (rows, T).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_softmax_bwd(
        &self,
        p: &impl DevIn,
        dp: &impl DevIn,
        ds: &mut impl DevOut,
        t: usize,
        scale: f32,
        mask: Mask,
    ) -> Result<()> {
        let p = &p.view();
        let dp = &dp.view();
        let ds = &mut ds.view_mut();
        let op = "attention_softmax_bwd";
        check_len(op, "dp", dp, p.len())?;
        check_len(op, "ds", ds, p.len())?;
        if p.is_empty() {
            return Ok(());
        }
        let rows = rows_of(op, p.len(), t)?;
        let ti = dim(op, "T", t)?;
        // SAFETY: attention_softmax_bwd_f32(const float*, const float*, float*, int, int,
        // float, int); all three hold rows·T floats (checked); ATTENTION_BLOCK threads a
        // block.
        unsafe { attention_softmax::bwd(self, row_cfg(rows as usize), p, dp, ds, rows, ti, scale, causal(mask)) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &CausalSelfAttention) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(AttentionGpu { heads: layer.heads, dropout: layer.dropout, use_bias: layer.use_bias, kept: None }))
}

/// (T, C) of a place's per-sample input.
fn place_tc(place: &Placement) -> Result<(usize, usize)> {
    match place.input.dims() {
        &[t, c] => Ok((t, c)),
        _ => Err(Error::shape("CausalSelfAttention", format!("{}: input {} is not (T, C)", place.name, place.input))),
    }
}

/// The scratch of one pass, in values: seven areas one after another, each starting on
/// a multiple of 64 values (256 bytes, as `Sequential` aligns every tensor), their order
/// and sizes a function of the shape alone. Backward uses them all:
/// [0] dqkv rows (N, T, 3C), [1] dqkv heads (3, N, H, T, D), [2] dz (N, T, C),
/// [3] dmerged (N, T, C), [4] dy heads (N, H, T, D), [5] and [6] (N, H, T, T) each.
/// Forward reuses [0] for the qkv rows, [2] for c_proj's output before dropout, [4] for
/// the heads' outputs, [5] for the scores and [6] for P'.
struct Areas {
    lens: [usize; 7],
}

impl Areas {
    fn new(n: usize, t: usize, c: usize, heads: usize) -> Areas {
        let (ntc, nhtt) = (n * t * c, n * heads * t * t);
        Areas { lens: [3 * ntc, 3 * ntc, ntc, ntc, ntc, nhtt, nhtt] }
    }

    /// A length rounded up to 64 values.
    fn padded(len: usize) -> usize {
        len.div_ceil(64) * 64
    }

    fn total(&self) -> usize {
        self.lens.iter().map(|&l| Areas::padded(l)).sum()
    }

    /// Runs `f` on the seven areas of `scratch`, each exactly as long as its contents.
    fn with<R>(
        &self,
        scratch: &mut CudaSlice<f32>,
        f: impl for<'b> FnOnce([CudaViewMut<'b, f32>; 7]) -> Result<R>,
    ) -> Result<R> {
        if scratch.len() < self.total() {
            return Err(Error::shape(
                "CausalSelfAttention",
                format!("scratch of {} values for the {} it needs", scratch.len(), self.total()),
            ));
        }
        let [l0, l1, l2, l3, l4, l5, l6] = self.lens;
        let pad = |l: usize| Areas::padded(l) - l;
        // Each split borrows the rest before it, which stays alive (shadowed) in this scope.
        let rest = &mut scratch.slice_mut(..);
        let (a0, mut rest) = rest.split_at_mut(l0);
        let (_, mut rest) = rest.split_at_mut(pad(l0));
        let (a1, mut rest) = rest.split_at_mut(l1);
        let (_, mut rest) = rest.split_at_mut(pad(l1));
        let (a2, mut rest) = rest.split_at_mut(l2);
        let (_, mut rest) = rest.split_at_mut(pad(l2));
        let (a3, mut rest) = rest.split_at_mut(l3);
        let (_, mut rest) = rest.split_at_mut(pad(l3));
        let (a4, mut rest) = rest.split_at_mut(l4);
        let (_, mut rest) = rest.split_at_mut(pad(l4));
        let (a5, mut rest) = rest.split_at_mut(l5);
        let (_, mut rest) = rest.split_at_mut(pad(l5));
        let (a6, _) = rest.split_at_mut(l6);
        f([a0, a1, a2, a3, a4, a5, a6])
    }
}

/// What the forward keeps on the device for the backward, for a batch of N.
struct Kept {
    /// q, k, v by head: (3, N, H, T, D)
    heads: CudaSlice<f32>,
    /// P: (N, H, T, T), before dropout.
    probs: CudaSlice<f32>,
    /// The heads' outputs merged, c_proj's input: (N, T, C)
    merged: CudaSlice<f32>,
}

/// Causal self-attention on a GPU: the CPU layer's products by cuBLAS (the projections
/// as `Linear`'s, the per-head ones as strided batches over the N·H (sample, head)
/// pairs of the head layout), the softmax by kernels/attention.cu, the masks by
/// kernels/dropout.cu's kernels under the CPU layer's keys (so the two backends drop the
/// same values).
pub(super) struct AttentionGpu {
    heads: usize,
    dropout: f32,
    use_bias: bool,
    kept: Option<Kept>,
}

impl AttentionGpu {
    /// The parameter indices of (c_attn.weight, c_attn.bias, c_proj.weight, c_proj.bias).
    fn indices(&self) -> (usize, Option<usize>, usize, Option<usize>) {
        if self.use_bias {
            (0, Some(1), 2, Some(3))
        } else {
            (0, None, 1, None)
        }
    }

    /// The masks' keys of a training pass (module docs): the probabilities' and the output's.
    fn keys(&self, draw: &Draw, place: &Placement, t: usize, c: usize) -> Option<(DropoutKey, DropoutKey)> {
        (self.dropout > 0.0).then(|| {
            let attn = DropoutKey::new(draw, place.index, self.heads * t * t);
            let resid = DropoutKey { layer: attn.layer | RESIDUAL_STREAM, ..DropoutKey::new(draw, place.index, t * c) };
            (attn, resid)
        })
    }
}

impl GpuLayer for AttentionGpu {
    fn reserve(&mut self, gpu: &Gpu, place: &Placement, n: usize) -> Result<()> {
        let (t, c) = place_tc(place)?;
        self.kept = None;
        let alloc = |len: usize| gpu.stream().alloc_zeros::<f32>(len.max(1));
        self.kept = Some(Kept {
            heads: alloc(3 * n * t * c)?,
            probs: alloc(n * self.heads * t * t)?,
            merged: alloc(n * t * c)?,
        });
        Ok(())
    }

    fn scratch(&self, place: &Placement, n: usize) -> Result<usize> {
        let (t, c) = place_tc(place)?;
        Ok(Areas::new(n, t, c, self.heads).total())
    }

    // x: (N, T, C) → y: (N, T, C)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let (t, c) = place_tc(f.place)?;
        let (n, h, d) = (f.n, self.heads, c / self.heads);
        let (nt, ntc, nh) = (n * t, n * t * c, n * h);
        let keys = match &*f.pass {
            Pass::Train { draw, .. } => self.keys(draw, f.place, t, c),
            Pass::Eval { .. } => None,
        };
        let (wa, ba, wp, bp) = self.indices();
        let Some(kept) = self.kept.as_mut() else { unreachable!("reserved before the pass") };
        let Forward { gpu, blas, y, scratch, .. } = f;
        let (rate, x) = (self.dropout, f.x);
        let param = |j: usize| f.params.slice(f.place.params[j].clone());
        Areas::new(n, t, c, h).with(scratch, |[mut rows, _, mut z, _, mut yh, mut s, mut pd]| {
            // qkv rows (N·T, 3C) = x·W_attnᵀ + b_attn, then by head (3, N, H, T, D)
            cublas_gemm(blas, &RmGemm::linear_fwd(nt, c, 3 * c), x, &param(wa), &mut rows)?;
            if let Some(ba) = ba {
                gpu.bias_cols_fwd(&mut rows, &param(ba), nt, 3 * c)?;
            }
            gpu.attention_heads_fwd(&rows, &mut kept.heads, HeadsGeom { n, t, parts: 3, heads: h, hd: d })?;
            let (q, k, v) = (kept.heads.slice(..ntc), kept.heads.slice(ntc..2 * ntc), kept.heads.slice(2 * ntc..));
            // S = q·kᵀ, P = causal softmax(S/√D), P' = dropout(P), y_h = P'·v
            cublas_gemm(blas, &RmGemm::attention_scores(nh, t, d), &q, &k, &mut s)?;
            gpu.attention_softmax_fwd(&s, &mut kept.probs, t, attention_scale(d), Mask::Causal)?;
            let p = match keys {
                Some((attn, _)) => {
                    gpu.dropout_fwd(&kept.probs, &mut pd, rate, attn)?;
                    pd.slice(..)
                }
                None => kept.probs.slice(..),
            };
            cublas_gemm(blas, &RmGemm::attention_mix(nh, t, d), &p, &v, &mut yh)?;
            gpu.attention_heads_bwd(&yh, &mut kept.merged, HeadsGeom { n, t, parts: 1, heads: h, hd: d })?;
            // y = dropout(merged·W_projᵀ + b_proj)
            let proj = RmGemm::linear_fwd(nt, c, c);
            match keys {
                Some((_, resid)) => {
                    cublas_gemm(blas, &proj, &kept.merged, &param(wp), &mut z)?;
                    if let Some(bp) = bp {
                        gpu.bias_cols_fwd(&mut z, &param(bp), nt, c)?;
                    }
                    gpu.dropout_fwd(&z, y, rate, resid)
                }
                None => {
                    cublas_gemm(blas, &proj, &kept.merged, &param(wp), y)?;
                    match bp {
                        Some(bp) => gpu.bias_cols_fwd(y, &param(bp), nt, c),
                        None => Ok(()),
                    }
                }
            }
        })
    }

    // dy: (N, T, C) → dx: (N, T, C), the parameter gradients written into the slot
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let (t, c) = place_tc(b.place)?;
        let (n, h, d) = (b.n, self.heads, c / self.heads);
        let (nt, ntc, nh) = (n * t, n * t * c, n * h);
        let keys = self.keys(&b.draw, b.place, t, c);
        let (wa, ba, wp, bp) = self.indices();
        let Some(kept) = self.kept.as_ref() else { unreachable!("reserved before the pass") };
        let Backward { gpu, blas, place, params, x, dy, dx, grads, scratch, .. } = b;
        let rate = self.dropout;
        let param = |j: usize| params.slice(place.params[j].clone());
        let scale = attention_scale(d);
        Areas::new(n, t, c, h).with(scratch, |[mut rows, mut dheads, mut dz, mut dm, mut dyh, mut sa, mut sb]| {
            // dz = dropout'(dy); dW_proj = dzᵀ·merged, db_proj += Σ dz; dmerged = dz·W_proj
            let dz = match keys {
                Some((_, resid)) => {
                    gpu.dropout_bwd(&dy, &mut dz, rate, resid)?;
                    dz.slice(..)
                }
                None => dy.slice(..),
            };
            cublas_gemm(
                blas,
                &RmGemm::linear_dw(nt, c, c),
                &dz,
                &kept.merged,
                &mut grads.slice_mut(place.params[wp].clone()),
            )?;
            if let Some(bp) = bp {
                gpu.bias_cols_bwd(&dz, &mut grads.slice_mut(place.params[bp].clone()), nt, c)?;
            }
            cublas_gemm(blas, &RmGemm::linear_dx(nt, c, c), &dz, &param(wp), &mut dm)?;
            gpu.attention_heads_fwd(&dm, &mut dyh, HeadsGeom { n, t, parts: 1, heads: h, hd: d })?;
            let (q, k, v) = (kept.heads.slice(..ntc), kept.heads.slice(ntc..2 * ntc), kept.heads.slice(2 * ntc..));
            // dv = P'ᵀ·dy_h (P' drawn again into sb), dP' = dy_h·vᵀ (into sa)
            let p = match keys {
                Some((attn, _)) => {
                    gpu.dropout_fwd(&kept.probs, &mut sb, rate, attn)?;
                    sb.slice(..)
                }
                None => kept.probs.slice(..),
            };
            cublas_gemm(blas, &RmGemm::attention_mix_t(nh, t, d), &p, &dyh, &mut dheads.slice_mut(2 * ntc..))?;
            cublas_gemm(blas, &RmGemm::attention_scores(nh, t, d), &dyh, &v, &mut sa)?;
            // dP = dropout'(dP'), dS = softmax'(dP)·scale: into sa with dropout (dP in sb),
            // into sb without
            let ds = match keys {
                Some((attn, _)) => {
                    gpu.dropout_bwd(&sa, &mut sb, rate, attn)?;
                    gpu.attention_softmax_bwd(&kept.probs, &sb, &mut sa, t, scale, Mask::Causal)?;
                    sa.slice(..)
                }
                None => {
                    gpu.attention_softmax_bwd(&kept.probs, &sa, &mut sb, t, scale, Mask::Causal)?;
                    sb.slice(..)
                }
            };
            // dq = dS·k, dk = dSᵀ·q; dqkv rows (N·T, 3C) merged from the heads
            cublas_gemm(blas, &RmGemm::attention_mix(nh, t, d), &ds, &k, &mut dheads.slice_mut(..ntc))?;
            cublas_gemm(blas, &RmGemm::attention_mix_t(nh, t, d), &ds, &q, &mut dheads.slice_mut(ntc..2 * ntc))?;
            gpu.attention_heads_bwd(&dheads, &mut rows, HeadsGeom { n, t, parts: 3, heads: h, hd: d })?;
            // dW_attn = dqkvᵀ·x, db_attn += Σ dqkv, dx = dqkv·W_attn
            cublas_gemm(
                blas,
                &RmGemm::linear_dw(nt, c, 3 * c),
                &rows,
                x,
                &mut grads.slice_mut(place.params[wa].clone()),
            )?;
            if let Some(ba) = ba {
                gpu.bias_cols_bwd(&rows, &mut grads.slice_mut(place.params[ba].clone()), nt, 3 * c)?;
            }
            match dx {
                Some(mut dx) => cublas_gemm(blas, &RmGemm::linear_dx(nt, c, 3 * c), &rows, &param(wa), &mut dx),
                None => Ok(()),
            }
        })
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/attention.cu run on the host against the CPU's [`super::cpu`]:
/// the head split and merge are permutations (PyTorch's split, `view(N, T, H, D)` and
/// `transpose(1, 2)`, written out below: the CPU reads the heads in place, through strided
/// views, and has no split of its own), equal bit for bit and each other's inverse; the
/// softmax and its gradient, causal and full, against `softmax_row` and `softmax_row_bwd`
/// within 2e-6 relative to the row's largest value (the kernel sums in a tree of 128
/// partial sums, the CPU in 16 lanes (`backend::simd::exp_sum`), and the host's expf is the C
/// library's, the CPU's `simd::exp_f32`), their masked columns exactly +0. T = 5 (one
/// partial sum a column) and T = 200 (two columns a thread), under the one-block-a-row
/// launch and a grid too small to cover the rows once; and a row whose live scores are all
/// −∞, NaN on both (the CPU's max is −∞, and −∞ − (−∞) is NaN).
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfgs, Cfg, In, Out, F32, I32};
    use crate::testing::{assert_bits, uniform};
    let (n, t, parts, heads, hd) = (2usize, 5usize, 3usize, 2usize, 4usize);
    let len = parts * n * heads * t * hd;
    let x = uniform(1, len);
    let mut want = vec![0.0f32; len];
    for p in 0..parts {
        for s in 0..n {
            for h in 0..heads {
                for i in 0..t {
                    for d in 0..hd {
                        want[(((p * n + s) * heads + h) * t + i) * hd + d] =
                            x[((s * t + i) * parts + p) * heads * hd + h * hd + d];
                    }
                }
            }
        }
    }
    let geom = |v: usize| I32(v as i32);
    for cfg in elem_cfgs(len) {
        let mut y = vec![f32::NAN; len];
        // As Gpu::attention_heads_fwd pushes them: x, y, n, t, parts, heads, hd.
        k.launch(
            &attention_heads::FWD,
            cfg,
            &mut [In(&x), Out(&mut y), geom(n), geom(t), geom(parts), geom(heads), geom(hd)],
        );
        assert_bits("attention heads split", &y, &want);
        let mut back = vec![f32::NAN; len];
        // As Gpu::attention_heads_bwd: dy, dx, n, t, parts, heads, hd.
        k.launch(
            &attention_heads::BWD,
            cfg,
            &mut [In(&y), Out(&mut back), geom(n), geom(t), geom(parts), geom(heads), geom(hd)],
        );
        assert_bits("attention heads merge of the split", &back, &x);
    }

    let row_cfgs = |rows: usize| [Cfg::from(row_cfg(rows)), Cfg { grid: (3, 1, 1), block: (ATTENTION_BLOCK, 1, 1) }];
    for (t, mask) in [(5usize, Mask::Causal), (200, Mask::Causal), (5, Mask::Full), (200, Mask::Full)] {
        let rows = 2 * t; // two (sample, head) pairs of T positions
        let scale = attention_scale(hd);
        let mut s: Vec<f32> = uniform(2 + t as u64, rows * t).iter().map(|v| 4.0 * v).collect();
        // Row t + 2 (position 2 of the second pair): every live score −∞.
        let live = mask.last(2, t) + 1;
        s[(t + 2) * t..(t + 2) * t + live].fill(f32::NEG_INFINITY);
        let dp = uniform(3 + t as u64, rows * t);
        let mut want_p = s.clone();
        for (r, row) in want_p.chunks_exact_mut(t).enumerate() {
            super::cpu::softmax_row(row, mask.last(r % t, t), scale);
        }
        let mut want_ds = dp.clone();
        for (r, (row, p)) in want_ds.chunks_exact_mut(t).zip(want_p.chunks_exact(t)).enumerate() {
            super::cpu::softmax_row_bwd(p, row, mask.last(r % t, t), scale);
        }
        let close = |what: &str, got: &[f32], want: &[f32]| {
            for (r, (g, w)) in got.chunks_exact(t).zip(want.chunks_exact(t)).enumerate() {
                let scale = w.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
                for (j, (a, b)) in g.iter().zip(w).enumerate() {
                    if j > mask.last(r % t, t) {
                        assert_eq!(a.to_bits(), 0, "{what} {mask:?} T = {t}: row {r}, masked column {j} is {a}");
                    } else if b.is_nan() {
                        assert!(a.is_nan(), "{what} {mask:?} T = {t}: row {r}, column {j}: {a} where the CPU has NaN");
                    } else {
                        assert!(
                            (a - b).abs() <= 2e-6 * scale,
                            "{what} {mask:?} T = {t}: row {r}, column {j}: {a} vs {b}"
                        );
                    }
                }
            }
        };
        assert!(want_p[(t + 2) * t].is_nan(), "the CPU's row of −∞ scores");
        let flag = causal(mask);
        for cfg in row_cfgs(rows) {
            let mut p = vec![f32::NAN; rows * t];
            // As Gpu::attention_softmax_fwd: s, p, rows, t, scale, causal.
            k.launch(
                &attention_softmax::FWD,
                cfg,
                &mut [In(&s), Out(&mut p), geom(rows), geom(t), F32(scale), I32(flag)],
            );
            close("softmax", &p, &want_p);
            let mut ds = vec![f32::NAN; rows * t];
            // As Gpu::attention_softmax_bwd: p, dp, ds, rows, t, scale, causal (from the
            // CPU's p, so that the gradient is checked alone).
            k.launch(
                &attention_softmax::BWD,
                cfg,
                &mut [In(&want_p), In(&dp), Out(&mut ds), geom(rows), geom(t), F32(scale), I32(flag)],
            );
            close("softmax gradient", &ds, &want_ds);
        }
    }
}
