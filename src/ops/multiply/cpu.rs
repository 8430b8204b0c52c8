//! Multiply on the CPU: the elementwise product of several inputs of one shape, each value
//! multiplied in input order, y = ((x0 · x1) · x2) · ... (PyTorch's `x0 * x1 * x2` rounds
//! the same way), and its gradient, dx_i = dy · Π_{j ≠ i} x_j, the factors likewise in
//! input order, ((dy · x_a) · x_b) · ... for a < b < ... ≠ i. The reference kernels/multiply.cu
//! is held to, bit for bit.
//!
//! Each function runs over the values in pieces of [`CHUNK`], in the pool of the device
//! the calling thread works for (`backend::par`); within a piece every factor is applied
//! before the next piece, so the piece stays in the core's cache across the factors. The
//! values are independent, so the result is the same whatever the thread count.

use rayon::prelude::*;

use crate::backend::par;
use crate::backend::simd::widest;
use crate::ops::silu::cpu::{silu_slope, silu_value};

/// Values per parallel task: 64 KiB per operand, so that a piece and its factors stay in
/// L2 while each factor is applied.
pub const CHUNK: usize = 1 << 14;

/// y = ((first · factors[0]) · factors[1]) · ... into y. first, each factor, y: (n)
pub fn product_to(first: &[f32], factors: &[&[f32]], y: &mut [f32]) {
    let n = y.len();
    assert_eq!(first.len(), n, "product_to: a first factor of {} for {n} values", first.len());
    for f in factors {
        assert_eq!(f.len(), n, "product_to: a factor of {} for {n} values", f.len());
    }
    par::for_each(y.par_chunks_mut(CHUNK).enumerate(), |(c, ys)| {
        let at = c * CHUNK..c * CHUNK + ys.len();
        match factors.split_first() {
            Some((second, rest)) => {
                mul2(&first[at.clone()], &second[at.clone()], ys);
                for f in rest {
                    mul_piece(&f[at.clone()], ys);
                }
            }
            None => ys.copy_from_slice(&first[at]),
        }
    });
}

/// y = ((y · factors[0]) · factors[1]) · ..., in place. y, each factor: (n)
pub fn product_into(y: &mut [f32], factors: &[&[f32]]) {
    let n = y.len();
    for f in factors {
        assert_eq!(f.len(), n, "product_into: a factor of {} for {n} values", f.len());
    }
    par::for_each(y.par_chunks_mut(CHUNK).enumerate(), |(c, ys)| {
        let at = c * CHUNK..c * CHUNK + ys.len();
        for f in factors {
            mul_piece(&f[at.clone()], ys);
        }
    });
}

/// The factors of input `i`'s gradient: every input but the `i`-th, in input order.
pub fn others<'a>(xs: &[&'a [f32]], i: usize) -> Vec<&'a [f32]> {
    xs.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, &x)| x).collect()
}

widest! {
    /// y = a · b.
    fn mul2(a: &[f32], b: &[f32], y: &mut [f32]) {
        for ((o, &u), &v) in y.iter_mut().zip(a).zip(b) {
            *o = u * v;
        }
    }
}

widest! {
    /// y ·= x.
    fn mul_piece(x: &[f32], y: &mut [f32]) {
        for (o, &v) in y.iter_mut().zip(x) {
            *o *= v;
        }
    }
}

/// y = silu(g) · u: the product of two inputs one of which is a SiLU's input g
/// (`Multiply` computing that SiLU in its own passes), bit for bit what the SiLU and the
/// product give one after the other (`silu::cpu::silu_value`, then one multiplication,
/// which rounds the same in either order). g, u: (n) → y: (n), a new vector never zeroed
/// first (each value is written once).
pub fn silu_product(g: &[f32], u: &[f32]) -> Vec<f32> {
    let n = g.len();
    assert_eq!(u.len(), n, "silu_product: inputs of {n} and {} values", u.len());
    let mut y = Vec::with_capacity(n);
    par::for_each(y.spare_capacity_mut()[..n].par_chunks_mut(CHUNK).enumerate(), |(c, ys)| {
        let at = c * CHUNK..c * CHUNK + ys.len();
        silu_mul(&g[at.clone()], &u[at], ys)
    });
    // SAFETY: the pieces cover the first n values of the capacity, and `silu_mul` writes
    // every value of its piece (it zips the piece with g's and u's values of the same
    // range, as many); so all n are initialised.
    unsafe { y.set_len(n) };
    y
}

/// y = silu(y) · u in place over y, which holds g: (n); u: (n).
pub fn silu_product_into(y: &mut [f32], u: &[f32]) {
    assert_eq!(u.len(), y.len(), "silu_product_into: a factor of {} for {} values", u.len(), y.len());
    par::for_each(y.par_chunks_mut(CHUNK).enumerate(), |(c, ys)| {
        let at = c * CHUNK..c * CHUNK + ys.len();
        silu_mul_in_place(ys, &u[at])
    });
}

/// The backward of [`silu_product`]: dg = (dy · u) · silu′(g) over `d`, which holds dy
/// and receives dg: the multiplication's gradient, then the SiLU's, each rounded as the
/// two layers round them. g, u, d: (n)
pub fn silu_product_backward_g(g: &[f32], u: &[f32], d: &mut [f32]) {
    let n = d.len();
    assert!(g.len() == n && u.len() == n, "silu_product_backward_g: inputs of {} and {} for {n}", g.len(), u.len());
    par::for_each(d.par_chunks_mut(CHUNK).enumerate(), |(c, ds)| {
        let at = c * CHUNK..c * CHUNK + ds.len();
        silu_mul_backward_g(&g[at.clone()], &u[at], ds)
    });
}

/// Both gradients of [`silu_product`] in one pass, each over its own input's values: `d`
/// holds dy and receives dg = (dy · u) · silu′(g); `g` holds g and receives du = dy ·
/// silu(g) (the kept g is read for the last time here). g, u, d: (n)
pub fn silu_product_backward_over(g: &mut [f32], u: &[f32], d: &mut [f32]) {
    let n = d.len();
    assert!(g.len() == n && u.len() == n, "silu_product_backward_over: inputs of {} and {} for {n}", g.len(), u.len());
    par::for_each(d.par_chunks_mut(CHUNK).zip(g.par_chunks_mut(CHUNK)).enumerate(), |(c, (ds, gs))| {
        let at = c * CHUNK..c * CHUNK + ds.len();
        silu_mul_backward(gs, &u[at], ds)
    });
}

/// The gradient of u alone: du = dy · silu(g) over `d`, which holds dy. g, d: (n)
pub fn silu_product_backward_u(g: &[f32], d: &mut [f32]) {
    assert_eq!(g.len(), d.len(), "silu_product_backward_u: g of {} for {} values", g.len(), d.len());
    par::for_each(d.par_chunks_mut(CHUNK).enumerate(), |(c, ds)| {
        let at = c * CHUNK..c * CHUNK + ds.len();
        silu_mul_backward_u(&g[at], ds)
    });
}

widest! {
    /// y = silu(g)·u, each value of y written.
    fn silu_mul(g: &[f32], u: &[f32], y: &mut [std::mem::MaybeUninit<f32>]) {
        for ((o, &a), &b) in y.iter_mut().zip(g).zip(u) {
            o.write(silu_value(a) * b);
        }
    }
}

widest! {
    /// y ← silu(y)·u.
    fn silu_mul_in_place(y: &mut [f32], u: &[f32]) {
        for (o, &b) in y.iter_mut().zip(u) {
            *o = silu_value(*o) * b;
        }
    }
}

widest! {
    /// d ← (d·u)·silu′(g) and g ← d·silu(g) (the incoming d and g).
    fn silu_mul_backward(g: &mut [f32], u: &[f32], d: &mut [f32]) {
        for ((dg, gu), &b) in d.iter_mut().zip(g).zip(u) {
            let (dy, a) = (*dg, *gu);
            *gu = dy * silu_value(a);
            *dg = (dy * b) * silu_slope(a);
        }
    }
}

widest! {
    /// d ← (d·u)·silu′(g).
    fn silu_mul_backward_g(g: &[f32], u: &[f32], d: &mut [f32]) {
        for ((dg, &a), &b) in d.iter_mut().zip(g).zip(u) {
            *dg = (*dg * b) * silu_slope(a);
        }
    }
}

widest! {
    /// d ← d·silu(g).
    fn silu_mul_backward_u(g: &[f32], d: &mut [f32]) {
        for (du, &a) in d.iter_mut().zip(g) {
            *du *= silu_value(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Factors whose order shows: 1e30 · 1e30 overflows to ∞ first, left to right, while
    /// 1e30 · (1e-30 · 1e30) does not; on several pieces. The gradient's factors skip the
    /// input's own and keep the order.
    #[test]
    fn factors_are_applied_in_input_order_on_every_piece() {
        let n = 2 * CHUNK + 5;
        let (a, b, c) = (vec![1e30f32; n], vec![1e30f32; n], vec![1e-30f32; n]);
        let mut y = vec![f32::NAN; n];
        product_to(&a, &[&b, &c], &mut y);
        assert!(y.iter().all(|&v| v == f32::INFINITY), "(1e30 · 1e30) · 1e-30 = ∞");
        let mut y = vec![f32::NAN; n];
        product_to(&a, &[&c, &b], &mut y);
        assert!(y.iter().all(|&v| v.is_finite() && v > 1e29), "(1e30 · 1e-30) · 1e30 is finite");
        let mut y = c.clone();
        product_into(&mut y, &others(&[&a, &b, &c], 2));
        assert!(y.iter().all(|&v| v.is_finite() && v > 1e29), "(dy · a) · b, dy = 1e-30 first: finite");
        assert_eq!(others(&[&a, &b, &c], 1), vec![&a[..], &c[..]]);
        let mut y = vec![0.0; n];
        product_to(&c, &[], &mut y);
        assert_eq!(y, c);
    }
}
