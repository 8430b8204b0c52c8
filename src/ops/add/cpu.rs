//! Add on the CPU: the sum of several inputs of one shape, y = ((x0 + x1) + x2) + ...,
//! each value summed in input order (PyTorch's `x0 + x1 + x2` rounds the same way), and
//! with one term `y += x`, the accumulation a graph sums a value's gradients with. The
//! reference kernels/add.cu is held to, bit for bit.
//!
//! The backward needs no function: every input's gradient is the output's (`mod.rs`).
//!
//! Each function runs over the values in pieces of [`CHUNK`], in the pool of the device
//! the calling thread works for (`backend::par`); within a piece every term is added
//! before the next piece, so the piece stays in the core's cache across the terms. The
//! values are independent, so the result is the same whatever the thread count.

use rayon::prelude::*;

use crate::backend::par;
use crate::backend::simd::widest;

/// Values per parallel task: 64 KiB per operand, so that a piece and its terms stay in L2
/// while each term is added.
pub const CHUNK: usize = 1 << 14;

/// y = ((first + terms[0]) + terms[1]) + ... into y. first, each term, y: (n)
pub fn sum_to(first: &[f32], terms: &[&[f32]], y: &mut [f32]) {
    let n = y.len();
    assert_eq!(first.len(), n, "sum_to: a first term of {} for {n} values", first.len());
    for t in terms {
        assert_eq!(t.len(), n, "sum_to: a term of {} for {n} values", t.len());
    }
    par::for_each(y.par_chunks_mut(CHUNK).enumerate(), |(c, ys)| {
        let at = c * CHUNK..c * CHUNK + ys.len();
        match terms.split_first() {
            Some((second, rest)) => {
                add2(&first[at.clone()], &second[at.clone()], ys);
                for t in rest {
                    add_piece(&t[at.clone()], ys);
                }
            }
            None => ys.copy_from_slice(&first[at]),
        }
    });
}

/// y = ((y + terms[0]) + terms[1]) + ..., in place; with one term, y += x, the accumulation
/// a graph sums a value's gradients with. y, each term: (n)
pub fn sum_into(y: &mut [f32], terms: &[&[f32]]) {
    let n = y.len();
    for t in terms {
        assert_eq!(t.len(), n, "sum_into: a term of {} for {n} values", t.len());
    }
    par::for_each(y.par_chunks_mut(CHUNK).enumerate(), |(c, ys)| {
        let at = c * CHUNK..c * CHUNK + ys.len();
        for t in terms {
            add_piece(&t[at.clone()], ys);
        }
    });
}

widest! {
    /// y = a + b.
    fn add2(a: &[f32], b: &[f32], y: &mut [f32]) {
        for ((o, &u), &v) in y.iter_mut().zip(a).zip(b) {
            *o = u + v;
        }
    }
}

widest! {
    /// y += x.
    fn add_piece(x: &[f32], y: &mut [f32]) {
        for (o, &v) in y.iter_mut().zip(x) {
            *o += v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Terms whose order shows: 1e8 − 1e8 + 1 is 1 left to right, but 0 as 1e8 + (−1e8 + 1)
    /// (1e8 − 1 rounds back to 1e8 in f32, whose spacing there is 8); on several pieces.
    #[test]
    fn terms_are_summed_in_input_order_on_every_piece() {
        let n = 2 * CHUNK + 5;
        let (a, b, c) = (vec![1e8f32; n], vec![-1e8f32; n], vec![1.0f32; n]);
        let mut y = vec![f32::NAN; n];
        sum_to(&a, &[&b, &c], &mut y);
        assert!(y.iter().all(|&v| v == 1.0), "left to right: 1e8 − 1e8 + 1 = 1");
        let mut y = vec![f32::NAN; n];
        sum_to(&b, &[&c, &a], &mut y);
        assert!(y.iter().all(|&v| v == 0.0), "(−1e8 + 1) + 1e8 = 0 in f32");
        let mut y = a.clone();
        sum_into(&mut y, &[&b, &c]);
        assert!(y.iter().all(|&v| v == 1.0));
        sum_into(&mut y, &[&c]);
        assert!(y.iter().all(|&v| v == 2.0));
        // One term alone is a copy.
        let mut y = vec![0.0; n];
        sum_to(&c, &[], &mut y);
        assert_eq!(y, c);
    }
}
