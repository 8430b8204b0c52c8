//! Average pooling on the CPU: the mean of each window of an NCHW tensor, and the gradient
//! spread back evenly over each window. The reference every other backend is checked
//! against (kernels/avgpool2d.cu, bit for bit: its host check is `super::gpu::host_check`).
//! Written per H×W plane ([`avgpool2d_plane_fwd`], [`avgpool2d_plane_bwd`]); the
//! whole-tensor functions run the planes. Where a window sits is `ops::window`'s (shared
//! with the convolution, max pooling and the GPU).
//!
//! # What a window divides by
//! - Valid padding: the window's KH·KW values.
//! - Explicit pads (PyTorch's `padding=`): KH·KW, the padded zeros counted, as PyTorch's
//!   `AvgPool2d` does by default (`count_include_pad=True`; a window never reaches past the
//!   padded extent, since there is no ceil mode).
//! - `same` (Keras's): the values of the window that lie in the plane, the padding not
//!   counted, as Keras's (TensorFlow's) `AveragePooling2D(padding="same")` does.
//!
//! # Order
//! Forward: a window's values are added in row-major order in f32 from 0.0, and the sum is
//! divided by the count (one f32 division). Backward: each output's share g = dy / count
//! (one f32 division) is added to every input of its window, the outputs taken in
//! row-major order from 0.0; so each input's gradient is the sum of its windows' shares in
//! row-major output order, which the kernel computes by gathering them in that order (one
//! thread per input, no atomics). Planes run in parallel on the device's pool
//! (`backend::par`); each plane is computed alone, so nothing depends on the thread count.
//! Where the windows tile the plane ([`tiles`]: a DenseNet's 2×2 at stride 2), a plane
//! runs by loops that clip nothing, the same sums in the same order.

use rayon::prelude::*;

use crate::backend::par;
use crate::ops::window::{Geometry2d, Padding};

/// Input values per parallel task, at least one plane: enough work to be worth a hand-off.
const TASK: usize = 1 << 16;

/// The number output (oy, ox) divides its sum by (module docs).
#[inline]
pub fn window_count(g: &Geometry2d, oy: usize, ox: usize) -> usize {
    match g.window.padding {
        Padding::Same => g.rows(oy).len() * g.cols(ox).len(),
        Padding::Valid | Padding::Explicit(..) => g.window.kernel.0 * g.window.kernel.1,
    }
}

/// Forward of every plane: x: (N, C, H, W) → y: (N, C, OH, OW), written. `g` places the
/// window on one H×W plane.
pub fn avgpool2d_forward(x: &[f32], g: &Geometry2d, y: &mut [f32]) {
    let (hw, ohw) = (g.h * g.w, g.oh * g.ow);
    let planes = x.len() / hw.max(1);
    assert!(
        planes * hw == x.len() && y.len() == planes * ohw,
        "avgpool2d_forward: x of {}, y of {} for planes {}x{} → {}x{}",
        x.len(),
        y.len(),
        g.h,
        g.w,
        g.oh,
        g.ow
    );
    let per_task = (TASK / hw.max(1)).max(1);
    par::for_each(x.par_chunks(per_task * hw).zip(y.par_chunks_mut(per_task * ohw)), |(xs, ys)| {
        for (xp, yp) in xs.chunks_exact(hw).zip(ys.chunks_exact_mut(ohw)) {
            avgpool2d_plane_fwd(xp, g, yp);
        }
    });
}

/// Backward of every plane: dout: (N, C, OH, OW) → dx: (N, C, H, W), written
/// ([`avgpool2d_plane_bwd`] per plane).
pub fn avgpool2d_backward(dout: &[f32], g: &Geometry2d, dx: &mut [f32]) {
    let (hw, ohw) = (g.h * g.w, g.oh * g.ow);
    let planes = dx.len() / hw.max(1);
    assert!(
        planes * hw == dx.len() && dout.len() == planes * ohw,
        "avgpool2d_backward: dout of {}, dx of {} for planes {}x{} → {}x{}",
        dout.len(),
        dx.len(),
        g.h,
        g.w,
        g.oh,
        g.ow
    );
    let per_task = (TASK / hw.max(1)).max(1);
    par::for_each(dx.par_chunks_mut(per_task * hw).zip(dout.par_chunks(per_task * ohw)), |(dxs, ds)| {
        for (dxp, dp) in dxs.chunks_exact_mut(hw).zip(ds.chunks_exact(ohw)) {
            avgpool2d_plane_bwd(dp, g, dxp);
        }
    });
}

/// Whether the windows tile the plane: stride = kernel, no padding, every window whole
/// inside the plane (rows or columns past the last window are read by none). Then each
/// window divides by KH·KW whatever the padding's kind, and each input lies in one window
/// at most: [`avgpool2d_plane_fwd`] and [`avgpool2d_plane_bwd`] take a path without
/// clipping, for the same bits (a DenseNet's transitions: 2×2 at stride 2).
fn tiles(g: &Geometry2d) -> bool {
    let ((kh, kw), (sh, sw)) = (g.window.kernel, g.window.stride);
    (kh, kw) == (sh, sw) && (g.pad_top, g.pad_left) == (0, 0) && g.oh * kh <= g.h && g.ow * kw <= g.w
}

/// Forward of one plane. x: (H, W) → y: (OH, OW): each window's sum in row-major order
/// from 0.0, divided by [`window_count`].
pub fn avgpool2d_plane_fwd(x: &[f32], g: &Geometry2d, y: &mut [f32]) {
    match tiles(g) {
        true => plane_fwd_tiled(x, g, y),
        false => plane_fwd_any(x, g, y),
    }
}

/// [`avgpool2d_plane_fwd`] for any placement: each window clipped to the plane.
fn plane_fwd_any(x: &[f32], g: &Geometry2d, y: &mut [f32]) {
    for oy in 0..g.oh {
        let rows = g.rows(oy);
        for ox in 0..g.ow {
            let cols = g.cols(ox);
            let mut sum = 0.0f32;
            for iy in rows.clone() {
                for &v in &x[iy * g.w + cols.start..iy * g.w + cols.end] {
                    sum += v;
                }
            }
            y[oy * g.ow + ox] = sum / window_count(g, oy, ox) as f32;
        }
    }
}

/// [`avgpool2d_plane_fwd`] where the windows tile the plane ([`tiles`]): the same sums in
/// the same order, from 0.0, and the same division by KH·KW.
fn plane_fwd_tiled(x: &[f32], g: &Geometry2d, y: &mut [f32]) {
    let (kh, kw) = g.window.kernel;
    let count = (kh * kw) as f32;
    if (kh, kw) == (2, 2) {
        // The same four additions in the same order, written out so that they run in
        // vectors across the outputs of a row.
        for (oy, yrow) in y.chunks_exact_mut(g.ow).enumerate() {
            let (r0, r1) = x[2 * oy * g.w..(2 * oy + 2) * g.w].split_at(g.w);
            for ((out, a), b) in yrow.iter_mut().zip(r0.chunks_exact(2)).zip(r1.chunks_exact(2)) {
                *out = (((0.0 + a[0]) + a[1]) + b[0]) + b[1];
                *out /= count;
            }
        }
        return;
    }
    for (oy, yrow) in y.chunks_exact_mut(g.ow).enumerate() {
        let band = &x[oy * kh * g.w..(oy + 1) * kh * g.w];
        for (ox, out) in yrow.iter_mut().enumerate() {
            let mut sum = 0.0f32;
            for row in band.chunks_exact(g.w) {
                for &v in &row[ox * kw..(ox + 1) * kw] {
                    sum += v;
                }
            }
            *out = sum / count;
        }
    }
}

/// Backward of one plane: each output's share dout / [`window_count`] added to every input
/// of its window, outputs in row-major order, from 0.0. dout: (OH, OW) → dx: (H, W),
/// written.
pub fn avgpool2d_plane_bwd(dout: &[f32], g: &Geometry2d, dx: &mut [f32]) {
    match tiles(g) {
        true => plane_bwd_tiled(dout, g, dx),
        false => plane_bwd_any(dout, g, dx),
    }
}

/// [`avgpool2d_plane_bwd`] for any placement: each window clipped to the plane.
fn plane_bwd_any(dout: &[f32], g: &Geometry2d, dx: &mut [f32]) {
    dx.fill(0.0);
    for oy in 0..g.oh {
        let rows = g.rows(oy);
        for ox in 0..g.ow {
            let cols = g.cols(ox);
            let share = dout[oy * g.ow + ox] / window_count(g, oy, ox) as f32;
            for iy in rows.clone() {
                for d in &mut dx[iy * g.w + cols.start..iy * g.w + cols.end] {
                    *d += share;
                }
            }
        }
    }
}

/// [`avgpool2d_plane_bwd`] where the windows tile the plane ([`tiles`]): each input in one
/// window receives 0.0 + its share (the sum from 0.0 of one share, −0 made +0 as there),
/// each input in none 0, every value written once.
fn plane_bwd_tiled(dout: &[f32], g: &Geometry2d, dx: &mut [f32]) {
    let (kh, kw) = g.window.kernel;
    let count = (kh * kw) as f32;
    let (covered, rest) = dx.split_at_mut(g.oh * kh * g.w);
    rest.fill(0.0);
    if (kh, kw) == (2, 2) {
        // Written out, so that the shares run in vectors across a row.
        for (band, drow) in covered.chunks_exact_mut(2 * g.w).zip(dout.chunks_exact(g.ow)) {
            let (r0, r1) = band.split_at_mut(g.w);
            r0[2 * g.ow..].fill(0.0);
            r1[2 * g.ow..].fill(0.0);
            for ((a, b), &d) in r0.chunks_exact_mut(2).zip(r1.chunks_exact_mut(2)).zip(drow) {
                let share = 0.0 + d / count;
                (a[0], a[1], b[0], b[1]) = (share, share, share, share);
            }
        }
        return;
    }
    for (band, drow) in covered.chunks_exact_mut(kh * g.w).zip(dout.chunks_exact(g.ow)) {
        for row in band.chunks_exact_mut(g.w) {
            let (windows, past) = row.split_at_mut(g.ow * kw);
            for (cells, &d) in windows.chunks_exact_mut(kw).zip(drow) {
                cells.fill(0.0 + d / count);
            }
            past.fill(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::window::Window2d;

    #[test]
    fn tiled_windows_give_the_bits_of_the_clipped_loops() {
        // Kernels 2×2, 3×2 and 1×1 at their own strides, each on a plane whose last rows and
        // columns no window reads (7×9 and 8×7) and on one they tile exactly, under each
        // padding kind that places no pad; values U(−1, 1) with −0 and +0 among them (the
        // sum from 0.0 turns a lone −0 into +0 on both paths). Forward and backward
        // from NaN-filled outputs: the tiled path writes every value, with the same bits.
        let mut r = crate::rng::SplitMix64::new(11);
        for (kernel, padding) in
            [((2, 2), Padding::Valid), ((3, 2), Padding::Valid), ((1, 1), Padding::Valid), ((2, 2), Padding::Same)]
        {
            for (h, w) in [(7, 9), (8, 7), (6, 4)] {
                let Some(g) = Window2d::new(kernel, kernel, padding).over(h, w) else { continue };
                if !tiles(&g) {
                    assert_eq!(
                        padding,
                        Padding::Same,
                        "{kernel:?} on {h}×{w}: a valid placement at its own stride tiles"
                    );
                    continue;
                }
                let mut x: Vec<f32> = (0..h * w).map(|_| 2.0 * r.next_f32() - 1.0).collect();
                let mut dout: Vec<f32> = (0..g.oh * g.ow).map(|_| 2.0 * r.next_f32() - 1.0).collect();
                (x[0], x[1], dout[0]) = (-0.0, 0.0, -0.0);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                let (mut y1, mut y2) = (vec![f32::NAN; g.oh * g.ow], vec![f32::NAN; g.oh * g.ow]);
                plane_fwd_tiled(&x, &g, &mut y1);
                plane_fwd_any(&x, &g, &mut y2);
                assert_eq!(bits(&y1), bits(&y2), "{kernel:?} {padding:?} on {h}×{w}: forward");
                let (mut d1, mut d2) = (vec![f32::NAN; h * w], vec![f32::NAN; h * w]);
                plane_bwd_tiled(&dout, &g, &mut d1);
                plane_bwd_any(&dout, &g, &mut d2);
                assert_eq!(bits(&d1), bits(&d2), "{kernel:?} {padding:?} on {h}×{w}: backward");
            }
        }
    }
}
