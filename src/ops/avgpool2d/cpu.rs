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

/// Forward of one plane. x: (H, W) → y: (OH, OW): each window's sum in row-major order
/// from 0.0, divided by [`window_count`].
pub fn avgpool2d_plane_fwd(x: &[f32], g: &Geometry2d, y: &mut [f32]) {
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

/// Backward of one plane: each output's share dout / [`window_count`] added to every input
/// of its window, outputs in row-major order, from 0.0. dout: (OH, OW) → dx: (H, W),
/// written.
pub fn avgpool2d_plane_bwd(dout: &[f32], g: &Geometry2d, dx: &mut [f32]) {
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
