//! Split on the CPU: one part of a tensor along an axis, and its gradient. Seen around the
//! axis, the tensor is (outer, L, inner) (outer the product of the dimensions before the
//! axis, the batch's included, inner of those after it) and the part is the rows
//! start..start + len of each of the outer blocks: `outer` copies of len·inner contiguous
//! values. Values move, none is computed; kernels/split.cu is checked against these bit
//! for bit.
//!
//! Work is split among the pool's threads by whole blocks, [`CHUNK`] values or more a task.

use std::ops::Range;

use rayon::prelude::*;

use crate::backend::par;

/// Values a parallel task moves at least.
pub const CHUNK: usize = 1 << 15;

/// A tensor seen around the split axis: (outer, axis, inner).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Around {
    pub outer: usize,
    pub axis: usize,
    pub inner: usize,
}

/// y = the part's rows of each block. x: (outer, axis, inner) → y: (outer, part.len(),
/// inner).
pub fn split_forward(x: &[f32], at: Around, part: Range<usize>, y: &mut [f32]) {
    let Around { outer, axis, inner } = at;
    assert!(part.end <= axis, "split_forward: part {part:?} of an axis of {axis}");
    assert_eq!(x.len(), outer * axis * inner, "split_forward: x of {} for {at:?}", x.len());
    let block = part.len() * inner;
    assert_eq!(y.len(), outer * block, "split_forward: y of {} for {at:?} and part {part:?}", y.len());
    if block == 0 {
        return;
    }
    let per_task = (CHUNK / block).max(1);
    par::for_each(y.par_chunks_mut(per_task * block).enumerate(), |(t, ys)| {
        for (i, out) in ys.chunks_exact_mut(block).enumerate() {
            let from = ((t * per_task + i) * axis + part.start) * inner;
            out.copy_from_slice(&x[from..from + block]);
        }
    });
}

/// dx = dy in the part's place of each block, 0 elsewhere; every value of dx is written.
/// dy: (outer, part.len(), inner) → dx: (outer, axis, inner).
pub fn split_backward(dy: &[f32], at: Around, part: Range<usize>, dx: &mut [f32]) {
    let Around { outer, axis, inner } = at;
    assert!(part.end <= axis, "split_backward: part {part:?} of an axis of {axis}");
    assert_eq!(dx.len(), outer * axis * inner, "split_backward: dx of {} for {at:?}", dx.len());
    let (block, whole) = (part.len() * inner, axis * inner);
    assert_eq!(dy.len(), outer * block, "split_backward: dy of {} for {at:?} and part {part:?}", dy.len());
    if whole == 0 {
        return;
    }
    let per_task = (CHUNK / whole).max(1);
    par::for_each(dx.par_chunks_mut(per_task * whole).enumerate(), |(t, dxs)| {
        for (i, d) in dxs.chunks_exact_mut(whole).enumerate() {
            let from = (t * per_task + i) * block;
            let (before, rest) = d.split_at_mut(part.start * inner);
            let (mine, after) = rest.split_at_mut(block);
            before.fill(0.0);
            mine.copy_from_slice(&dy[from..from + block]);
            after.fill(0.0);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts of a split, each forward by its definition (x[o, start + r, i]), and the
    /// sum of their backwards is the gradient of the whole: each place of dx is the one
    /// part's gradient that covers it. Sizes that make several tasks and ragged ones.
    #[test]
    fn the_parts_cover_the_axis_and_their_gradients_sum_to_the_whole() {
        for (at, sizes) in [
            (Around { outer: 3, axis: 6, inner: 5 }, vec![1, 3, 2]),
            (Around { outer: 40, axis: 9, inner: 300 }, vec![4, 5]),
            (Around { outer: 7, axis: 4, inner: 1 }, vec![4]),
        ] {
            let Around { outer, axis, inner } = at;
            let x: Vec<f32> = (0..outer * axis * inner).map(|i| i as f32).collect();
            let mut sum = vec![0.0f32; x.len()];
            let mut start = 0;
            for &len in &sizes {
                let part = start..start + len;
                let mut y = vec![f32::NAN; outer * len * inner];
                split_forward(&x, at, part.clone(), &mut y);
                for o in 0..outer {
                    for r in 0..len {
                        for i in 0..inner {
                            assert_eq!(y[(o * len + r) * inner + i], x[(o * axis + start + r) * inner + i]);
                        }
                    }
                }
                // The gradient of this part is its output's values: their sum over the
                // parts is x itself.
                let mut dx = vec![f32::NAN; x.len()];
                split_backward(&y, at, part, &mut dx);
                for (s, d) in sum.iter_mut().zip(&dx) {
                    *s += d;
                }
                start += len;
            }
            assert_eq!(sum, x, "{at:?} split {sizes:?}");
        }
    }
}
