//! Max pooling on the CPU: the maximum of each window of an NCHW tensor and the index of
//! the value that won, and the gradient routed back to the winners. The reference every
//! other backend is checked against (kernels/maxpool2d.cu, bit for bit: its host check is
//! `super::gpu::host_check`). Written per H×W plane ([`maxpool2d_plane_fwd`],
//! [`maxpool2d_plane_bwd`]); the whole-tensor functions run the planes. Where a window sits
//! is `ops::window`'s (shared with the convolution and the GPU); padded positions are not
//! candidates at all, so they never win (TensorFlow's `SAME` max pooling, and PyTorch's
//! −∞ padding, behave alike).
//!
//! # Ties and NaN, as PyTorch's CPU kernel
//! Each window is scanned in row-major order and a value replaces the running maximum when
//! `v > max || isnan(v)`: among equal maxima the first wins, a NaN beats every number (so
//! it propagates), and of several NaNs the last wins. The winner's index in its plane
//! (`h·W + w`) is kept, as PyTorch's `return_indices` gives it.
//!
//! # Backward
//! `dout` is routed to each window's winner; where windows overlap (stride < pool size)
//! one input may win several, and its gradient is the sum of their `dout`, added in
//! row-major order of the outputs, starting from 0. The kernel sums in that same order
//! (one thread per input element, no atomics), so the two backends agree bit for bit.
//! Planes run in parallel on the device's pool (`backend::par`); each plane is computed
//! alone, so nothing depends on the thread count.

use rayon::prelude::*;

use crate::backend::par;
use crate::ops::window::Geometry2d;

/// Input values per parallel task, at least one plane: enough work to be worth a hand-off.
const TASK: usize = 1 << 16;

/// Forward of every plane: x: (N, C, H, W) → y: (N, C, OH, OW) and argmax: (N, C, OH, OW),
/// both written, each the index `h·W + w` in its plane of the value y took. `g` places
/// the window on one H×W plane.
pub fn maxpool2d_forward(x: &[f32], g: &Geometry2d, y: &mut [f32], argmax: &mut [u32]) {
    let (hw, ohw) = (g.h * g.w, g.oh * g.ow);
    let planes = x.len() / hw;
    assert!(
        planes * hw == x.len() && y.len() == planes * ohw && argmax.len() == planes * ohw,
        "maxpool2d_forward: x of {}, y of {}, argmax of {} for planes {}x{} → {}x{}",
        x.len(),
        y.len(),
        argmax.len(),
        g.h,
        g.w,
        g.oh,
        g.ow
    );
    let per_task = (TASK / hw).max(1);
    let work = x.par_chunks(per_task * hw).zip(y.par_chunks_mut(per_task * ohw));
    par::for_each(work.zip(argmax.par_chunks_mut(per_task * ohw)), |((xs, ys), is)| {
        for ((xp, yp), ip) in xs.chunks_exact(hw).zip(ys.chunks_exact_mut(ohw)).zip(is.chunks_exact_mut(ohw)) {
            maxpool2d_plane_fwd(xp, g, yp, ip);
        }
    });
}

/// Backward of every plane: dout, argmax: (N, C, OH, OW) → dx: (N, C, H, W), written
/// ([`maxpool2d_plane_bwd`] per plane).
pub fn maxpool2d_backward(dout: &[f32], argmax: &[u32], g: &Geometry2d, dx: &mut [f32]) {
    let (hw, ohw) = (g.h * g.w, g.oh * g.ow);
    let planes = dx.len() / hw;
    assert!(
        planes * hw == dx.len() && dout.len() == planes * ohw && argmax.len() == planes * ohw,
        "maxpool2d_backward: dout of {}, argmax of {}, dx of {} for planes {}x{} → {}x{}",
        dout.len(),
        argmax.len(),
        dx.len(),
        g.h,
        g.w,
        g.oh,
        g.ow
    );
    let per_task = (TASK / hw).max(1);
    let work = dx.par_chunks_mut(per_task * hw).zip(dout.par_chunks(per_task * ohw));
    par::for_each(work.zip(argmax.par_chunks(per_task * ohw)), |((dxs, ds), is)| {
        for ((dxp, dp), ip) in dxs.chunks_exact_mut(hw).zip(ds.chunks_exact(ohw)).zip(is.chunks_exact(ohw)) {
            maxpool2d_plane_bwd(dp, ip, dxp);
        }
    });
}

/// Forward of one plane. x: (H, W) → y: (OH, OW), argmax: (OH, OW), each the index
/// `h·W + w` of the value y took.
pub fn maxpool2d_plane_fwd(x: &[f32], g: &Geometry2d, y: &mut [f32], argmax: &mut [u32]) {
    for oy in 0..g.oh {
        let rows = g.rows(oy);
        for ox in 0..g.ow {
            let cols = g.cols(ox);
            // Starting from the first candidate gives what PyTorch's start from −∞ does:
            // a first −∞ stays the winner of an all −∞ window, a first NaN wins at once.
            let first = rows.start * g.w + cols.start;
            let (mut best, mut at) = (x[first], first);
            for iy in rows.clone() {
                for ix in cols.clone() {
                    let i = iy * g.w + ix;
                    let v = x[i];
                    if v > best || v.is_nan() {
                        (best, at) = (v, i);
                    }
                }
            }
            y[oy * g.ow + ox] = best;
            argmax[oy * g.ow + ox] = at as u32;
        }
    }
}

/// Backward of one plane: `dx[i] = Σ dout[o]` over the outputs o whose winner is i, in
/// ascending o from 0. dout, argmax: (OH, OW) → dx: (H, W), written.
pub fn maxpool2d_plane_bwd(dout: &[f32], argmax: &[u32], dx: &mut [f32]) {
    dx.fill(0.0);
    for (&d, &i) in dout.iter().zip(argmax) {
        dx[i as usize] += d;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::window::{Padding, Window2d};

    #[test]
    fn the_first_maximum_wins_a_tie_and_a_nan_wins_everything() {
        // One 2×3 window (valid, the whole plane): values in row-major order
        // [1, 3, 3, 0, 3, 2]: the maximum 3 first appears at index 1.
        let g = Window2d::new((2, 3), (1, 1), Padding::Valid).over(2, 3).unwrap();
        let (mut y, mut at) = ([0.0f32], [0u32]);
        maxpool2d_plane_fwd(&[1.0, 3.0, 3.0, 0.0, 3.0, 2.0], &g, &mut y, &mut at);
        assert_eq!((y[0], at[0]), (3.0, 1));
        // NaNs at 2 and 4: the last NaN wins (`isnan(v)` replaces an earlier NaN too).
        maxpool2d_plane_fwd(&[1.0, 3.0, f32::NAN, 0.0, f32::NAN, 2.0], &g, &mut y, &mut at);
        assert!(y[0].is_nan() && at[0] == 4, "{y:?} {at:?}");
        // All −∞: the first candidate keeps it.
        maxpool2d_plane_fwd(&[f32::NEG_INFINITY; 6], &g, &mut y, &mut at);
        assert_eq!((y[0], at[0]), (f32::NEG_INFINITY, 0));
    }
}
