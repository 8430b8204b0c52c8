//! Nearest upsampling on the CPU: every value of an NCHW tensor repeated into an SH×SW
//! block, and the gradient summed back over each block. The reference every other backend
//! is checked against (kernels/upsample.cu, bit for bit: `super::gpu::host_check`).
//!
//! Output (oy, ox) takes input (oy / SH, ox / SW) (integer division: PyTorch's `nearest`
//! at an integer scale, Keras's `UpSampling2D(interpolation="nearest")`). Backward: input
//! (iy, ix) receives the sum of dy over its block, rows a = 0..SH then columns b = 0..SW
//! in that order, in f32 from 0.0; the kernel gathers the same sums in the same order (one
//! thread per input). Planes run in parallel on the device's pool (`backend::par`); each
//! is computed alone, so nothing depends on the thread count.

use rayon::prelude::*;

use crate::backend::par;

/// Input values per parallel task, at least one plane: enough work to be worth a hand-off.
const TASK: usize = 1 << 15;

/// Forward of every plane: x: (N, C, H, W) → y: (N, C, H·SH, W·SW), written.
pub fn upsample_forward(x: &[f32], (h, w): (usize, usize), (sh, sw): (usize, usize), y: &mut [f32]) {
    let (hw, ohw) = (h * w, h * sh * w * sw);
    let planes = x.len() / hw.max(1);
    assert!(
        planes * hw == x.len() && y.len() == planes * ohw,
        "upsample_forward: x of {}, y of {} for planes {h}x{w} at {sh}x{sw}",
        x.len(),
        y.len()
    );
    let per_task = (TASK / hw.max(1)).max(1);
    par::for_each(x.par_chunks(per_task * hw).zip(y.par_chunks_mut(per_task * ohw)), |(xs, ys)| {
        for (xp, yp) in xs.chunks_exact(hw).zip(ys.chunks_exact_mut(ohw)) {
            for (oy, yrow) in yp.chunks_exact_mut(w * sw).enumerate() {
                let xrow = &xp[oy / sh * w..oy / sh * w + w];
                for (ys, &v) in yrow.chunks_exact_mut(sw).zip(xrow) {
                    ys.fill(v);
                }
            }
        }
    });
}

/// Backward of every plane: dout: (N, C, H·SH, W·SW) → dx: (N, C, H, W), written, each
/// input the sum of its block in the module docs' order.
pub fn upsample_backward(dout: &[f32], (h, w): (usize, usize), (sh, sw): (usize, usize), dx: &mut [f32]) {
    let (hw, ohw) = (h * w, h * sh * w * sw);
    let planes = dx.len() / hw.max(1);
    assert!(
        planes * hw == dx.len() && dout.len() == planes * ohw,
        "upsample_backward: dout of {}, dx of {} for planes {h}x{w} at {sh}x{sw}",
        dout.len(),
        dx.len()
    );
    let ow = w * sw;
    let per_task = (TASK / hw.max(1)).max(1);
    par::for_each(dx.par_chunks_mut(per_task * hw).zip(dout.par_chunks(per_task * ohw)), |(dxs, ds)| {
        for (dxp, dp) in dxs.chunks_exact_mut(hw).zip(ds.chunks_exact(ohw)) {
            for (i, d) in dxp.iter_mut().enumerate() {
                let (iy, ix) = (i / w, i % w);
                let mut acc = 0.0f32;
                for a in 0..sh {
                    let row = &dp[(iy * sh + a) * ow + ix * sw..][..sw];
                    for &v in row {
                        acc += v;
                    }
                }
                *d = acc;
            }
        }
    });
}
