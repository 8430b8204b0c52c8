//! MatMul on the CPU: a batch of matrix products, Y_b = A_b·B_b, and their gradients,
//! dA_b = dY_b·B_bᵀ and dB_b = A_bᵀ·dY_b, each product the CPU backend's GEMM
//! (`backend::cpu::gemm_with`, as linear and attention call it): its blocks split over
//! threads, never its sums, so the result is the same whatever the thread count.
//!
//! Shapes (the module's legend): `items` products, each A_b (M, K), B_b (K, N), Y_b (M, N),
//! the items one after another in each buffer.
//!
//! Many small products run side by side, one a thread (the GEMM on the calling thread);
//! few large ones one after another, each split over the device's pool.

use rayon::prelude::*;

use crate::backend::cpu::{gemm_with, Accumulate, Mat, Threads, PARALLEL_MIN_FLOPS};
use crate::backend::par;

/// The shapes of one batch of products: `items` of (M × K)·(K × N).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub items: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

impl Dims {
    /// Whether the products run side by side, one a thread: when there are enough of them
    /// to fill the pool, or each is too small for the GEMM to split (below its own
    /// threshold, `backend::cpu::PARALLEL_MIN_FLOPS`, it runs on the calling thread anyway).
    /// Either way gives the same bits: the GEMM never splits a sum.
    fn across_items(&self) -> bool {
        self.items >= par::threads() || self.m * self.k * self.n < PARALLEL_MIN_FLOPS
    }

    /// Runs `f(b, out_b, threads)` for every item b, `out_b` its `per` values of `out`:
    /// side by side, each on the calling thread, or one after another on the pool.
    fn each(&self, out: &mut [f32], per: usize, f: impl Fn(usize, &mut [f32], Threads) + Sync + Send) {
        if per == 0 {
            return;
        }
        if self.across_items() {
            par::for_each(out.par_chunks_mut(per).enumerate(), |(b, o)| f(b, o, Threads::Caller));
        } else {
            out.chunks_mut(per).enumerate().for_each(|(b, o)| f(b, o, Threads::Pool));
        }
    }
}

/// y = a·b per item. a: (items, M, K), b: (items, K, N), y: (items, M, N)
pub fn matmul_forward(a: &[f32], b: &[f32], y: &mut [f32], d: Dims) {
    let Dims { items, m, k, n } = d;
    assert_eq!((a.len(), b.len(), y.len()), (items * m * k, items * k * n, items * m * n), "matmul_forward: {d:?}");
    d.each(y, m * n, |i, yi, threads| {
        let (ai, bi) = (&a[i * m * k..(i + 1) * m * k], &b[i * k * n..(i + 1) * k * n]);
        gemm_with(Mat::rows(ai, m, k), Mat::rows(bi, k, n), yi, n, Accumulate::Overwrite, threads);
    });
}

/// da = dy·bᵀ and db = aᵀ·dy per item, each where asked for (written).
/// a, da: (items, M, K); b, db: (items, K, N); dy: (items, M, N)
pub fn matmul_backward(a: &[f32], b: &[f32], dy: &[f32], da: Option<&mut [f32]>, db: Option<&mut [f32]>, d: Dims) {
    let Dims { items, m, k, n } = d;
    assert_eq!((a.len(), b.len(), dy.len()), (items * m * k, items * k * n, items * m * n), "matmul_backward: {d:?}");
    let a_of = |i: usize| Mat::rows(&a[i * m * k..(i + 1) * m * k], m, k);
    let b_of = |i: usize| Mat::rows(&b[i * k * n..(i + 1) * k * n], k, n);
    let dy_of = |i: usize| Mat::rows(&dy[i * m * n..(i + 1) * m * n], m, n);
    if let Some(da) = da {
        assert_eq!(da.len(), items * m * k, "matmul_backward: da");
        d.each(da, m * k, |i, dai, threads| gemm_with(dy_of(i), b_of(i).t(), dai, k, Accumulate::Overwrite, threads));
    }
    if let Some(db) = db {
        assert_eq!(db.len(), items * k * n, "matmul_backward: db");
        d.each(db, k * n, |i, dbi, threads| gemm_with(a_of(i).t(), dy_of(i), dbi, n, Accumulate::Overwrite, threads));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row-major (rows × inner)·(inner × cols) in f64, rounded once.
    fn product(a: &[f32], b: &[f32], rows: usize, inner: usize, cols: usize) -> Vec<f64> {
        let mut c = vec![0.0; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                c[i * cols + j] = (0..inner).map(|l| a[i * inner + l] as f64 * b[l * cols + j] as f64).sum();
            }
        }
        c
    }

    fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols).map(|i| a[(i % rows) * cols + i / rows]).collect()
    }

    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut g = crate::rng::SplitMix64::new(seed);
        (0..n).map(|_| g.next_f32() * 2.0 - 1.0).collect()
    }

    /// Every item's product and both gradients against f64 products, within 1e-5 (sums of
    /// at most 70 terms of size below 1: f32's rounding is some 1e-6), both ways of
    /// running the items (many small products side by side; two large ones on the pool),
    /// on 1 and 3 threads, bit for bit alike.
    #[test]
    fn the_products_and_gradients_are_the_items_own() {
        for d in [Dims { items: 5, m: 3, k: 4, n: 2 }, Dims { items: 2, m: 70, k: 65, n: 66 }] {
            let Dims { items, m, k, n } = d;
            let (a, b, dy) = (values(1, items * m * k), values(2, items * k * n), values(3, items * m * n));
            let on = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| {
                    let (mut y, mut da, mut db) =
                        (vec![0.0; items * m * n], vec![0.0; items * m * k], vec![0.0; items * k * n]);
                    matmul_forward(&a, &b, &mut y, d);
                    matmul_backward(&a, &b, &dy, Some(&mut da), Some(&mut db), d);
                    (y, da, db, d.across_items())
                })
            };
            let (y, da, db, side_by_side) = on(3);
            assert_eq!(side_by_side, items >= 3, "{d:?}");
            let one = on(1);
            assert_eq!((&one.0, &one.1, &one.2), (&y, &da, &db), "{d:?}: on 1 thread as on 3");
            for i in 0..items {
                let (ai, bi, dyi) = (&a[i * m * k..][..m * k], &b[i * k * n..][..k * n], &dy[i * m * n..][..m * n]);
                let close = |what: &str, got: &[f32], want: Vec<f64>| {
                    for (e, (&g, w)) in got.iter().zip(want).enumerate() {
                        assert!((g as f64 - w).abs() <= 1e-5, "{d:?} item {i}: {what}[{e}]: {g} vs {w}");
                    }
                };
                close("y", &y[i * m * n..][..m * n], product(ai, bi, m, k, n));
                close("da", &da[i * m * k..][..m * k], product(dyi, &transpose(bi, k, n), m, n, k));
                close("db", &db[i * k * n..][..k * n], product(&transpose(ai, m, k), dyi, k, m, n));
            }
        }
    }
}
