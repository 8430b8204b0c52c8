//! The GEMMs of the GPU layers, in row-major terms, handed to cuBLAS.
//!
//! Owns: `RmGemm`, one row-major GEMM (or a strided batch) described as plain data,
//! with a named constructor per product a layer needs (linear forward, weight and input
//! gradients; convolution forward, weight and column gradients; attention's per-head
//! products; the matmul op's batch of products and their two gradients), the bounds check
//! of its operands, and its translation to cuBLAS's column-major call. Being plain data,
//! each product is tested on the host against a model of cuBLAS's contract; `gemm` is the
//! one place that calls cuBLAS.

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{DevicePtr, DevicePtrMut};

use crate::{Error, Result};

/// A GEMM dimension as cuBLAS's `int`.
fn int(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::shape("gemm", format!("dimension {v} does not fit in i32")))
}

/// Elements a row-major matrix of `rows` × `cols` with leading dimension `ld` spans.
fn span(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

fn op(t: bool) -> cublasOperation_t {
    if t {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

/// One row-major GEMM, or a strided batch of them: C (m×n) = op(A)·op(B) with A (m×k,
/// or k×m stored when `ta`) and B (k×n, or n×k stored when `tb`) stored row-major with
/// leading dimensions lda, ldb, ldc, item i at offsets i·sa, i·sb, i·sc (a stride of 0
/// shares the operand across the batch). C is overwritten. Each layer's GEMMs are
/// named constructors, so their shapes are tested apart from the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RmGemm {
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
    sa: usize,
    sb: usize,
    sc: usize,
    batch: usize,
}

impl RmGemm {
    fn single(ta: bool, tb: bool, (m, n, k): (usize, usize, usize), (lda, ldb, ldc): (usize, usize, usize)) -> Self {
        RmGemm { ta, tb, m, n, k, lda, ldb, ldc, sa: 0, sb: 0, sc: 0, batch: 1 }
    }

    /// Linear forward: y (N, O) = x (N, F) · Wᵀ, W: (O, F).
    pub(crate) fn linear_fwd(n: usize, f: usize, o: usize) -> Self {
        RmGemm::single(false, true, (n, o, f), (f, f, o))
    }

    /// Linear weight gradient: dW (O, F) = dyᵀ (O, N) · x (N, F).
    pub(crate) fn linear_dw(n: usize, f: usize, o: usize) -> Self {
        RmGemm::single(true, false, (o, f, n), (o, f, f))
    }

    /// Linear input gradient: dx (N, F) = dy (N, O) · W (O, F).
    pub(crate) fn linear_dx(n: usize, f: usize, o: usize) -> Self {
        RmGemm::single(false, false, (n, f, o), (o, f, f))
    }

    /// Convolution forward, per sample: y_n (O, P) = W (O, CKK) · col_n (CKK, P).
    pub(crate) fn conv_fwd(batch: usize, o: usize, ckk: usize, p: usize) -> Self {
        RmGemm { sa: 0, sb: ckk * p, sc: o * p, batch, ..RmGemm::single(false, false, (o, p, ckk), (ckk, p, p)) }
    }

    /// Convolution weight gradient, per sample: dW_n (O, CKK) = dy_n (O, P) · col_nᵀ.
    pub(crate) fn conv_dw(batch: usize, o: usize, ckk: usize, p: usize) -> Self {
        RmGemm { sa: o * p, sb: ckk * p, sc: o * ckk, batch, ..RmGemm::single(false, true, (o, ckk, p), (p, p, ckk)) }
    }

    /// Convolution column gradient, per sample: dcol_n (CKK, P) = Wᵀ (CKK, O) · dy_n (O, P).
    pub(crate) fn conv_dcol(batch: usize, o: usize, ckk: usize, p: usize) -> Self {
        RmGemm { sa: 0, sb: o * p, sc: ckk * p, batch, ..RmGemm::single(true, false, (ckk, p, o), (ckk, p, p)) }
    }

    /// A grouped convolution's forward, one group k of G a call, per sample:
    /// y_n[k] (O/G, P) = W_k (O/G, CKK/G) · col_n[k] (CKK/G, P), where the operands are
    /// views from group k's first value on (W's rows k·O/G.., col_n's rows k·CKK/G..,
    /// y_n's rows k·O/G..), the samples a whole col_n (CKK·P) and y_n (O·P) apart.
    pub(crate) fn grouped_conv_fwd(batch: usize, groups: usize, o: usize, ckk: usize, p: usize) -> Self {
        let (og, kg) = (o / groups, ckk / groups);
        RmGemm { sa: 0, sb: ckk * p, sc: o * p, batch, ..RmGemm::single(false, false, (og, p, kg), (kg, p, p)) }
    }

    /// A grouped convolution's weight gradient, group k, per sample: dW_n,k (O/G, CKK/G) =
    /// dy_n[k] (O/G, P) · col_n[k]ᵀ, dy and col viewed from group k's rows on as in
    /// [`RmGemm::grouped_conv_fwd`], the products one after another (N, O/G, CKK/G).
    pub(crate) fn grouped_conv_dw(batch: usize, groups: usize, o: usize, ckk: usize, p: usize) -> Self {
        let (og, kg) = (o / groups, ckk / groups);
        RmGemm { sa: o * p, sb: ckk * p, sc: og * kg, batch, ..RmGemm::single(false, true, (og, kg, p), (p, p, kg)) }
    }

    /// A grouped convolution's column gradient, group k, per sample: dcol_n[k] (CKK/G, P)
    /// = W_kᵀ (CKK/G, O/G) · dy_n[k] (O/G, P), views as in [`RmGemm::grouped_conv_fwd`].
    pub(crate) fn grouped_conv_dcol(batch: usize, groups: usize, o: usize, ckk: usize, p: usize) -> Self {
        let (og, kg) = (o / groups, ckk / groups);
        RmGemm { sa: 0, sb: o * p, sc: ckk * p, batch, ..RmGemm::single(true, false, (kg, p, og), (kg, p, p)) }
    }

    /// Attention scores, per (sample, head) b: S_b (T, T) = A_b (T, D) · B_bᵀ, the items
    /// (T, D) blocks one after another: S = q·kᵀ, and the gradient dP = dy·vᵀ.
    pub(crate) fn attention_scores(batch: usize, t: usize, d: usize) -> Self {
        RmGemm { sa: t * d, sb: t * d, sc: t * t, batch, ..RmGemm::single(false, true, (t, t, d), (d, d, t)) }
    }

    /// Attention's mix, per (sample, head) b: Y_b (T, D) = A_b (T, T) · B_b (T, D): y = P'·v,
    /// and the gradient dq = dS·k.
    pub(crate) fn attention_mix(batch: usize, t: usize, d: usize) -> Self {
        RmGemm { sa: t * t, sb: t * d, sc: t * d, batch, ..RmGemm::single(false, false, (t, d, t), (t, d, d)) }
    }

    /// The mix's other gradient, per (sample, head) b: Y_b (T, D) = A_bᵀ (T, T) · B_b (T, D):
    /// dv = P'ᵀ·dy and dk = dSᵀ·q.
    pub(crate) fn attention_mix_t(batch: usize, t: usize, d: usize) -> Self {
        RmGemm { sa: t * t, sb: t * d, sc: t * d, batch, ..RmGemm::single(true, false, (t, d, t), (t, d, d)) }
    }

    /// A batch of matrix products (the `matmul` op), per item b:
    /// Y_b (M, N) = A_b (M, K) · B_b (K, N), the items (M, K), (K, N), (M, N) blocks one
    /// after another.
    pub(crate) fn matmul(batch: usize, m: usize, k: usize, n: usize) -> Self {
        RmGemm { sa: m * k, sb: k * n, sc: m * n, batch, ..RmGemm::single(false, false, (m, n, k), (k, n, n)) }
    }

    /// The matmul's first gradient, per item b: dA_b (M, K) = dY_b (M, N) · B_bᵀ.
    pub(crate) fn matmul_da(batch: usize, m: usize, k: usize, n: usize) -> Self {
        RmGemm { sa: m * n, sb: k * n, sc: m * k, batch, ..RmGemm::single(false, true, (m, k, n), (n, n, k)) }
    }

    /// The matmul's second gradient, per item b: dB_b (K, N) = A_bᵀ · dY_b (M, N).
    pub(crate) fn matmul_db(batch: usize, m: usize, k: usize, n: usize) -> Self {
        RmGemm { sa: m * k, sb: m * n, sc: k * n, batch, ..RmGemm::single(true, false, (k, n, m), (k, n, n)) }
    }

    /// Errors unless each operand holds what the GEMM reads or writes.
    fn check(&self, a_len: usize, b_len: usize, c_len: usize) -> Result<()> {
        let last = self.batch.saturating_sub(1);
        let (ar, ac) = if self.ta { (self.k, self.m) } else { (self.m, self.k) };
        let (br, bc) = if self.tb { (self.n, self.k) } else { (self.k, self.n) };
        for (what, len, rows, cols, ld, stride) in [
            ("A", a_len, ar, ac, self.lda, self.sa),
            ("B", b_len, br, bc, self.ldb, self.sb),
            ("C", c_len, self.m, self.n, self.ldc, self.sc),
        ] {
            if ld < cols || len < last * stride + span(rows, cols, ld) {
                return Err(Error::shape(
                    "gemm",
                    format!(
                        "{what} ({rows}x{cols}, ld {ld}, {} x stride {stride}) does not fit in {len} elements",
                        self.batch
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The same product as cuBLAS (column-major) computes it. A row-major matrix read
    /// column-major is its transpose, so cuBLAS computes Cᵀ = op(B)ᵀ·op(A)ᵀ: the operands
    /// swap (B becomes cuBLAS's A) and keep their transpose flags, and m and n swap.
    fn cublas(&self) -> Result<StridedBatchedConfig<f32>> {
        let stride = |s: usize| i64::try_from(s).map_err(|_| Error::shape("gemm", format!("stride {s} too large")));
        Ok(StridedBatchedConfig {
            gemm: GemmConfig {
                transa: op(self.tb),
                transb: op(self.ta),
                m: int(self.n)?,
                n: int(self.m)?,
                k: int(self.k)?,
                alpha: 1.0f32,
                lda: int(self.ldb)?,
                ldb: int(self.lda)?,
                beta: 0.0,
                ldc: int(self.ldc)?,
            },
            batch_size: int(self.batch)?,
            stride_a: stride(self.sb)?,
            stride_b: stride(self.sa)?,
            stride_c: stride(self.sc)?,
        })
    }
}

/// Runs `g` on the replica's stream: C = op(A)·op(B), overwritten.
pub(crate) fn gemm<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
    blas: &CudaBlas,
    g: &RmGemm,
    a: &A,
    b: &B,
    c: &mut C,
) -> Result<()> {
    g.check(a.len(), b.len(), c.len())?;
    if g.m == 0 || g.n == 0 || g.batch == 0 {
        return Ok(());
    }
    let cfg = g.cublas()?;
    // SAFETY: every operand holds the elements the GEMM addresses for every item of the
    // batch (checked above), and all three live on the stream the handle was created on.
    unsafe {
        if g.batch == 1 {
            blas.gemm(cfg.gemm, b, a, c)
        } else {
            blas.gemm_strided_batched(cfg, b, a, c)
        }
    }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuBLAS's sgemm / sgemmStridedBatched on the host: column-major, as documented.
    fn cublas_reference(cfg: &StridedBatchedConfig<f32>, a: &[f32], b: &[f32], c: &mut [f32]) {
        let g = &cfg.gemm;
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let (lda, ldb, ldc) = (g.lda as usize, g.ldb as usize, g.ldc as usize);
        let t = |o: cublasOperation_t| o == cublasOperation_t::CUBLAS_OP_T;
        for item in 0..cfg.batch_size as usize {
            let (a, b) = (&a[item * cfg.stride_a as usize..], &b[item * cfg.stride_b as usize..]);
            let c = &mut c[item * cfg.stride_c as usize..];
            for j in 0..n {
                for i in 0..m {
                    let mut acc = 0.0f64;
                    for l in 0..k {
                        let av = if t(g.transa) { a[l + i * lda] } else { a[i + l * lda] };
                        let bv = if t(g.transb) { b[j + l * ldb] } else { b[l + j * ldb] };
                        acc += av as f64 * bv as f64;
                    }
                    c[i + j * ldc] = g.alpha * acc as f32 + g.beta * c[i + j * ldc];
                }
            }
        }
    }

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut g = crate::rng::SplitMix64::new(seed);
        (0..len).map(|_| g.next_f64() as f32 - 0.5).collect()
    }

    /// Row-major `rows x inner` times `inner x cols` on the host.
    fn matmul(a: &[f32], b: &[f32], rows: usize, inner: usize, cols: usize) -> Vec<f32> {
        let mut c = vec![0.0; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                c[i * cols + j] =
                    (0..inner).map(|l| a[i * inner + l] as f64 * b[l * cols + j] as f64).sum::<f64>() as f32;
            }
        }
        c
    }

    fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..cols * rows).map(|i| a[(i % rows) * cols + i / rows]).collect()
    }

    /// Runs `g` through the cuBLAS reference exactly as `gemm` hands it to cuBLAS.
    fn through_cublas(g: &RmGemm, a: &[f32], b: &[f32], c_len: usize) -> Vec<f32> {
        g.check(a.len(), b.len(), c_len).unwrap();
        let mut c = vec![0.0; c_len];
        // Operands in the order `gemm` passes them: cuBLAS's A is our B.
        cublas_reference(&g.cublas().unwrap(), b, a, &mut c);
        c
    }

    fn assert_close(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-5, "{what}: element {i}: {g} vs {w}");
        }
    }

    #[test]
    fn the_linear_gemms_compute_the_layer_products() {
        let (n, f, o) = (5, 7, 3);
        let (x, w, dy) = (values(n * f, 1), values(o * f, 2), values(n * o, 3));
        let y = through_cublas(&RmGemm::linear_fwd(n, f, o), &x, &w, n * o);
        assert_close("linear y = x·Wᵀ", &y, &matmul(&x, &transpose(&w, o, f), n, f, o));
        let dw = through_cublas(&RmGemm::linear_dw(n, f, o), &dy, &x, o * f);
        assert_close("linear dW = dyᵀ·x", &dw, &matmul(&transpose(&dy, n, o), &x, o, n, f));
        let dx = through_cublas(&RmGemm::linear_dx(n, f, o), &dy, &w, n * f);
        assert_close("linear dx = dy·W", &dx, &matmul(&dy, &w, n, o, f));
    }

    #[test]
    fn the_convolution_gemms_compute_the_per_sample_products() {
        let (batch, o, ckk, p) = (3, 4, 6, 5);
        let (w, col, dy) = (values(o * ckk, 4), values(batch * ckk * p, 5), values(batch * o * p, 6));
        let y = through_cublas(&RmGemm::conv_fwd(batch, o, ckk, p), &w, &col, batch * o * p);
        let dw = through_cublas(&RmGemm::conv_dw(batch, o, ckk, p), &dy, &col, batch * o * ckk);
        let dcol = through_cublas(&RmGemm::conv_dcol(batch, o, ckk, p), &w, &dy, batch * ckk * p);
        for s in 0..batch {
            let (col_s, dy_s) = (&col[s * ckk * p..][..ckk * p], &dy[s * o * p..][..o * p]);
            assert_close("conv y_n = W·col_n", &y[s * o * p..][..o * p], &matmul(&w, col_s, o, ckk, p));
            let want = matmul(dy_s, &transpose(col_s, ckk, p), o, p, ckk);
            assert_close("conv dW_n = dy_n·col_nᵀ", &dw[s * o * ckk..][..o * ckk], &want);
            let want = matmul(&transpose(&w, o, ckk), dy_s, ckk, o, p);
            assert_close("conv dcol_n = Wᵀ·dy_n", &dcol[s * ckk * p..][..ckk * p], &want);
        }
    }

    #[test]
    fn the_grouped_convolution_gemms_compute_each_groups_per_sample_products() {
        // Two groups of O/G = 2 filters over CKK/G = 3 rows of columns; each group's call
        // on views from its first value on writes its rows of every sample and no other.
        let (batch, groups, o, ckk, p) = (3, 2, 4, 6, 5);
        let (og, kg) = (o / groups, ckk / groups);
        let (w, col, dy) = (values(o * kg, 10), values(batch * ckk * p, 11), values(batch * o * p, 12));
        // As `gemm` hands the operands to cuBLAS, C written in place (beta 0).
        let into = |g: &RmGemm, a: &[f32], b: &[f32], c: &mut [f32]| {
            g.check(a.len(), b.len(), c.len()).unwrap();
            cublas_reference(&g.cublas().unwrap(), b, a, c);
        };
        let (mut y, mut dcol) = (vec![0.0; batch * o * p], vec![0.0; batch * ckk * p]);
        for k in 0..groups {
            let w_k = &w[k * og * kg..(k + 1) * og * kg];
            into(&RmGemm::grouped_conv_fwd(batch, groups, o, ckk, p), w_k, &col[k * kg * p..], &mut y[k * og * p..]);
            let dw = RmGemm::grouped_conv_dw(batch, groups, o, ckk, p);
            let dw = through_cublas(&dw, &dy[k * og * p..], &col[k * kg * p..], batch * og * kg);
            let dc = RmGemm::grouped_conv_dcol(batch, groups, o, ckk, p);
            into(&dc, w_k, &dy[k * og * p..], &mut dcol[k * kg * p..]);
            for s in 0..batch {
                let col_k = &col[s * ckk * p + k * kg * p..][..kg * p];
                let dy_k = &dy[s * o * p + k * og * p..][..og * p];
                let want = matmul(dy_k, &transpose(col_k, kg, p), og, p, kg);
                assert_close("grouped dW_n,k = dy_n[k]·col_n[k]ᵀ", &dw[s * og * kg..][..og * kg], &want);
            }
        }
        for s in 0..batch {
            for k in 0..groups {
                let w_k = &w[k * og * kg..(k + 1) * og * kg];
                let col_k = &col[s * ckk * p + k * kg * p..][..kg * p];
                let dy_k = &dy[s * o * p + k * og * p..][..og * p];
                let y_k = &y[s * o * p + k * og * p..][..og * p];
                assert_close("grouped y_n[k] = W_k·col_n[k]", y_k, &matmul(w_k, col_k, og, kg, p));
                let dcol_k = &dcol[s * ckk * p + k * kg * p..][..kg * p];
                let want = matmul(&transpose(w_k, og, kg), dy_k, kg, og, p);
                assert_close("grouped dcol_n[k] = W_kᵀ·dy_n[k]", dcol_k, &want);
            }
        }
    }

    #[test]
    fn the_attention_gemms_compute_the_per_head_products() {
        let (batch, t, d) = (3, 5, 4);
        let (a, b, p) = (values(batch * t * d, 7), values(batch * t * d, 8), values(batch * t * t, 9));
        let s = through_cublas(&RmGemm::attention_scores(batch, t, d), &a, &b, batch * t * t);
        let y = through_cublas(&RmGemm::attention_mix(batch, t, d), &p, &b, batch * t * d);
        let yt = through_cublas(&RmGemm::attention_mix_t(batch, t, d), &p, &b, batch * t * d);
        for i in 0..batch {
            let (a_i, b_i, p_i) = (&a[i * t * d..][..t * d], &b[i * t * d..][..t * d], &p[i * t * t..][..t * t]);
            assert_close("S_b = A_b·B_bᵀ", &s[i * t * t..][..t * t], &matmul(a_i, &transpose(b_i, t, d), t, d, t));
            assert_close("Y_b = P_b·B_b", &y[i * t * d..][..t * d], &matmul(p_i, b_i, t, t, d));
            assert_close("Y_b = P_bᵀ·B_b", &yt[i * t * d..][..t * d], &matmul(&transpose(p_i, t, t), b_i, t, t, d));
        }
    }

    #[test]
    fn the_matmul_gemms_compute_the_per_item_products() {
        let (batch, m, k, n) = (3, 2, 5, 4);
        let (a, b, dy) = (values(batch * m * k, 10), values(batch * k * n, 11), values(batch * m * n, 12));
        let y = through_cublas(&RmGemm::matmul(batch, m, k, n), &a, &b, batch * m * n);
        let da = through_cublas(&RmGemm::matmul_da(batch, m, k, n), &dy, &b, batch * m * k);
        let db = through_cublas(&RmGemm::matmul_db(batch, m, k, n), &a, &dy, batch * k * n);
        for i in 0..batch {
            let (a_i, b_i, dy_i) = (&a[i * m * k..][..m * k], &b[i * k * n..][..k * n], &dy[i * m * n..][..m * n]);
            assert_close("Y_b = A_b·B_b", &y[i * m * n..][..m * n], &matmul(a_i, b_i, m, k, n));
            let want = matmul(dy_i, &transpose(b_i, k, n), m, n, k);
            assert_close("dA_b = dY_b·B_bᵀ", &da[i * m * k..][..m * k], &want);
            let want = matmul(&transpose(a_i, m, k), dy_i, k, m, n);
            assert_close("dB_b = A_bᵀ·dY_b", &db[i * k * n..][..k * n], &want);
        }
    }

    #[test]
    fn gemm_bounds_are_checked_for_every_operand_and_batch_item() {
        let g = RmGemm::linear_fwd(2, 3, 4); // (2x3)·(4x3)ᵀ
        assert!(g.check(6, 12, 8).is_ok());
        let e = g.check(6, 11, 8).unwrap_err();
        assert!(e.to_string().contains("B (4x3"), "{e}");
        assert!(g.check(6, 12, 7).is_err());
        // W shared by the batch (stride 0), columns and outputs strided.
        let g = RmGemm::conv_fwd(3, 2, 3, 4);
        assert!(g.check(6, 36, 24).is_ok());
        assert!(g.check(6, 36, 23).is_err());
        assert!(g.check(6, 35, 24).is_err());
        // A leading dimension below the row length is refused.
        assert!(RmGemm { lda: 2, ..RmGemm::linear_fwd(2, 3, 4) }.check(6, 12, 8).is_err());
    }
}
