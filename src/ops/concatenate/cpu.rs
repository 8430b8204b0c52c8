//! Concatenate on the CPU: inputs laid side by side along one axis, and the output's
//! gradient split back into theirs. Seen from the axis, every input is a matrix (outer,
//! inner_i): outer the product of the dimensions before the axis (the batch's included),
//! inner_i those from the axis on; the output is (outer, Σ inner_i), each of its rows the
//! inputs' rows one after another, in input order. Copies only: the reference
//! kernels/concatenate.cu is held to, bit for bit.
//!
//! Both run over whole rows in pieces of about [`CHUNK`] values, in the pool of the device
//! the calling thread works for (`backend::par`).

use rayon::prelude::*;

use crate::backend::par;

/// Values per parallel task (whole rows, at least one).
pub const CHUNK: usize = 1 << 14;

/// Rows per parallel task for rows of `width` values.
fn rows_per_task(width: usize) -> usize {
    (CHUNK / width.max(1)).max(1)
}

/// y: (outer, Σ inner_i), row o the rows o of the parts in order; parts[i]: (outer, inner_i),
/// inners[i] = inner_i.
pub fn concat_forward(parts: &[&[f32]], inners: &[usize], y: &mut [f32]) {
    assert_eq!(parts.len(), inners.len(), "concat_forward: {} parts, {} widths", parts.len(), inners.len());
    let total: usize = inners.iter().sum();
    if total == 0 {
        return;
    }
    let outer = y.len() / total;
    assert_eq!(outer * total, y.len(), "concat_forward: y of {} values is no whole rows of {total}", y.len());
    for (i, (p, &w)) in parts.iter().zip(inners).enumerate() {
        assert_eq!(p.len(), outer * w, "concat_forward: part {i} of {} values for ({outer}, {w})", p.len());
    }
    let rows = rows_per_task(total);
    par::for_each(y.par_chunks_mut(rows * total).enumerate(), |(t, ys)| {
        for (r, row) in ys.chunks_exact_mut(total).enumerate() {
            let o = t * rows + r;
            let mut at = 0;
            for (p, &w) in parts.iter().zip(inners) {
                row[at..at + w].copy_from_slice(&p[o * w..(o + 1) * w]);
                at += w;
            }
        }
    });
}

/// Each dx_i asked for: (outer, inner_i), the columns of dy: (outer, Σ inner_i) that part i
/// filled in the forward; inners[i] = inner_i.
pub fn concat_backward(dy: &[f32], inners: &[usize], dxs: &mut [Option<&mut [f32]>]) {
    assert_eq!(dxs.len(), inners.len(), "concat_backward: {} gradients, {} widths", dxs.len(), inners.len());
    let total: usize = inners.iter().sum();
    if total == 0 {
        return;
    }
    let outer = dy.len() / total;
    assert_eq!(outer * total, dy.len(), "concat_backward: dy of {} values is no whole rows of {total}", dy.len());
    let mut at = 0;
    for (i, (dx, &w)) in dxs.iter_mut().zip(inners).enumerate() {
        if let (Some(dx), true) = (dx, w > 0) {
            assert_eq!(dx.len(), outer * w, "concat_backward: dx {i} of {} values for ({outer}, {w})", dx.len());
            let rows = rows_per_task(w);
            par::for_each(dx.par_chunks_mut(rows * w).enumerate(), |(t, ds)| {
                for (r, row) in ds.chunks_exact_mut(w).enumerate() {
                    let o = t * rows + r;
                    row.copy_from_slice(&dy[o * total + at..o * total + at + w]);
                }
            });
        }
        at += w;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two parts of 2 and 3 columns over 3 rows, and back; then rows wider than a task's
    /// values and more rows than one task holds.
    #[test]
    fn rows_are_laid_side_by_side_and_split_back() {
        let (a, b) = ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [10.0, 11.0, 12.0, 20.0, 21.0, 22.0, 30.0, 31.0, 32.0]);
        let mut y = [0.0; 15];
        concat_forward(&[&a, &b], &[2, 3], &mut y);
        assert_eq!(y, [1.0, 2.0, 10.0, 11.0, 12.0, 3.0, 4.0, 20.0, 21.0, 22.0, 5.0, 6.0, 30.0, 31.0, 32.0]);
        let (mut da, mut db) = ([0.0; 6], [0.0; 9]);
        concat_backward(&y, &[2, 3], &mut [Some(&mut da), Some(&mut db)]);
        assert_eq!((da, db), (a, b));
        for (outer, w0, w1) in [(3, CHUNK + 3, 5), (2 * CHUNK + 1, 1, 2)] {
            let p0: Vec<f32> = (0..outer * w0).map(|v| v as f32).collect();
            let p1: Vec<f32> = (0..outer * w1).map(|v| -(v as f32)).collect();
            let mut y = vec![f32::NAN; outer * (w0 + w1)];
            concat_forward(&[&p0, &p1], &[w0, w1], &mut y);
            for o in [0, outer / 2, outer - 1] {
                let row = &y[o * (w0 + w1)..(o + 1) * (w0 + w1)];
                assert_eq!(&row[..w0], &p0[o * w0..(o + 1) * w0]);
                assert_eq!(&row[w0..], &p1[o * w1..(o + 1) * w1]);
            }
            let mut d1 = vec![f32::NAN; outer * w1];
            concat_backward(&y, &[w0, w1], &mut [None, Some(&mut d1)]);
            assert_eq!(d1, p1);
        }
    }
}
