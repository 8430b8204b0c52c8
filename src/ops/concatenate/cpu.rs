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
/// inners[i] = inner_i. Each value of y is a copy, written into storage no pass zeroed.
pub fn concat(parts: &[&[f32]], inners: &[usize]) -> Vec<f32> {
    assert_eq!(parts.len(), inners.len(), "concat: {} parts, {} widths", parts.len(), inners.len());
    let total: usize = inners.iter().sum();
    let Some(outer) = parts.iter().zip(inners).find(|(_, &w)| w > 0).map(|(p, &w)| p.len() / w) else {
        return Vec::new(); // no values in any part
    };
    for (i, (p, &w)) in parts.iter().zip(inners).enumerate() {
        assert_eq!(p.len(), outer * w, "concat: part {i} of {} values for ({outer}, {w})", p.len());
    }
    let len = outer * total;
    let mut y = Vec::with_capacity(len);
    let rows = rows_per_task(total);
    par::for_each(y.spare_capacity_mut()[..len].par_chunks_mut(rows * total).enumerate(), |(t, ys)| {
        for (r, row) in ys.chunks_exact_mut(total).enumerate() {
            let o = t * rows + r;
            let mut at = 0;
            for (p, &w) in parts.iter().zip(inners) {
                write_copy(&mut row[at..at + w], &p[o * w..(o + 1) * w]);
                at += w;
            }
        }
    });
    // SAFETY: the tasks' pieces cover the first `len` values of the capacity in whole rows
    // of `total`, and each row is written whole: its parts' widths, side by side, sum to
    // `total`. So all `len` values are initialised.
    unsafe { y.set_len(len) };
    y
}

/// The gradient dx_i of each part whose `wanted[i]` holds: (outer, inner_i), the columns of
/// dy: (outer, Σ inner_i) that part i filled in the forward; inners[i] = inner_i. Each a
/// copy, written into storage no pass zeroed.
pub fn split(dy: &[f32], inners: &[usize], wanted: &[bool]) -> Vec<Option<Vec<f32>>> {
    assert_eq!(wanted.len(), inners.len(), "split: {} gradients asked of {} widths", wanted.len(), inners.len());
    let total: usize = inners.iter().sum();
    let outer = dy.len() / total.max(1);
    assert_eq!(outer * total, dy.len(), "split: dy of {} values is no whole rows of {total}", dy.len());
    let mut at = 0;
    let mut dxs = Vec::with_capacity(inners.len());
    for (&w, &want) in inners.iter().zip(wanted) {
        dxs.push(want.then(|| {
            let len = outer * w;
            let mut dx = Vec::with_capacity(len);
            let rows = rows_per_task(w);
            if w > 0 {
                par::for_each(dx.spare_capacity_mut()[..len].par_chunks_mut(rows * w).enumerate(), |(t, ds)| {
                    for (r, row) in ds.chunks_exact_mut(w).enumerate() {
                        let o = t * rows + r;
                        write_copy(row, &dy[o * total + at..o * total + at + w]);
                    }
                });
            }
            // SAFETY: the tasks' pieces cover the first `len` = outer·w values of the
            // capacity in whole rows of w, each row written whole (none where w is 0).
            unsafe { dx.set_len(len) };
            dx
        }));
        at += w;
    }
    dxs
}

/// dst ← src, into storage that may hold no value yet.
fn write_copy(dst: &mut [std::mem::MaybeUninit<f32>], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "write_copy: {} values into {}", src.len(), dst.len());
    // SAFETY: both slices hold src.len() values (just asserted); a mutable slice cannot
    // overlap a shared one; MaybeUninit<f32> has f32's size and alignment.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<f32>(), src.len()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two parts of 2 and 3 columns over 3 rows, and back; then rows wider than a task's
    /// values and more rows than one task holds.
    #[test]
    fn rows_are_laid_side_by_side_and_split_back() {
        let (a, b) = ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [10.0, 11.0, 12.0, 20.0, 21.0, 22.0, 30.0, 31.0, 32.0]);
        let y = concat(&[&a, &b], &[2, 3]);
        assert_eq!(y, [1.0, 2.0, 10.0, 11.0, 12.0, 3.0, 4.0, 20.0, 21.0, 22.0, 5.0, 6.0, 30.0, 31.0, 32.0]);
        assert_eq!(split(&y, &[2, 3], &[true, true]), [Some(a.to_vec()), Some(b.to_vec())]);
        assert_eq!(split(&y, &[2, 0, 3], &[false, true, true]), [None, Some(vec![]), Some(b.to_vec())]);
        for (outer, w0, w1) in [(3, CHUNK + 3, 5), (2 * CHUNK + 1, 1, 2)] {
            let p0: Vec<f32> = (0..outer * w0).map(|v| v as f32).collect();
            let p1: Vec<f32> = (0..outer * w1).map(|v| -(v as f32)).collect();
            let y = concat(&[&p0, &p1], &[w0, w1]);
            assert_eq!(y.len(), outer * (w0 + w1));
            for o in [0, outer / 2, outer - 1] {
                let row = &y[o * (w0 + w1)..(o + 1) * (w0 + w1)];
                assert_eq!(&row[..w0], &p0[o * w0..(o + 1) * w0]);
                assert_eq!(&row[w0..], &p1[o * w1..(o + 1) * w1]);
            }
            assert_eq!(split(&y, &[w0, w1], &[false, true]), [None, Some(p1)]);
        }
    }
}
