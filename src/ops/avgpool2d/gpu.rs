//! Average pooling on a GPU: the declaration of kernels/avgpool2d.cu, its checked launches
//! (buffers checked against the window geometry), the op's GPU form, and the check of the
//! kernels on the host against the CPU's. Where a window lies is `ops::window`'s, what it
//! divides by [`super::cpu`]'s.

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{window_geom, Backward, Forward, GpuLayer};
use crate::ops::window::WindowGeom;
use crate::Result;

use super::*;

crate::cuda::declare::kernels! {
    "avgpool2d.cu" {
        avgpool2d {
            fwd(x: In, y: Out, count_pad: I32, geom: Geom);
            bwd(dy: In, dx: Out, count_pad: I32, geom: Geom);
        }
    }
}

/// What a window divides by, as the kernels take it: 1, its KH·KW values (valid, explicit
/// pads); 0, its values in the plane (`same`). [`super::cpu::window_count`]'s rule.
fn count_pad(padding: Padding) -> i32 {
    match padding {
        Padding::Same => 0,
        Padding::Valid | Padding::Explicit(..) => 1,
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// Average pooling: y = the sum of each window over its count (`ops::avgpool2d::cpu`).
    /// x: (N, C, H, W) -> y: (N, C, OH, OW)
    pub fn avgpool2d_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, padding: Padding, g: &WindowGeom) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let op = "avgpool2d_fwd";
        let a = g.launch_args(op)?;
        check_len(op, "x", x, g.x_len())?;
        check_len(op, "y", y, g.pooled_len())?;
        if g.pooled_len() == 0 {
            return Ok(());
        }
        // SAFETY: avgpool2d_fwd_f32(const float*, float*, int, 12 x int); x and y have the
        // lengths the geometry implies (checked), and the kernel reads x only inside the
        // plane (the window clipped to 0..H, 0..W) and writes y below N*C*OH*OW.
        unsafe { avgpool2d::fwd(self, elem_cfg(g.pooled_len()), x, y, count_pad(padding), &a) }
    }

    /// Backward of [`Gpu::avgpool2d_fwd`]: `dx[i]` = the sum of dy / count over the outputs
    /// whose window holds i, in row-major output order; dx is written.
    /// dy: (N, C, OH, OW) -> dx: (N, C, H, W)
    pub fn avgpool2d_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, padding: Padding, g: &WindowGeom) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let op = "avgpool2d_bwd";
        let a = g.launch_args(op)?;
        check_len(op, "dy", dy, g.pooled_len())?;
        check_len(op, "dx", dx, g.x_len())?;
        if g.x_len() == 0 {
            return Ok(());
        }
        // SAFETY: avgpool2d_bwd_f32(const float*, float*, int, 12 x int); lengths checked;
        // the kernel reads dy only at oy < OH, ox < OW of its own plane and writes dx below
        // N*C*H*W, one element per thread.
        unsafe { avgpool2d::bwd(self, elem_cfg(g.x_len()), dy, dx, count_pad(padding), &a) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &AvgPool2d) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(AvgPool2dGpu { window: layer.window }))
}

/// Average pooling on a GPU: `avgpool2d_fwd`, `avgpool2d_bwd`; nothing is kept between
/// them (the geometry decides the backward).
struct AvgPool2dGpu {
    window: Window2d,
}

impl GpuLayer for AvgPool2dGpu {
    // x: (N, C, H, W) → y: (N, C, OH, OW)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let g = window_geom(f.place, self.window, f.n)?;
        f.gpu.avgpool2d_fwd(f.x, f.y, self.window.padding, &g)
    }

    // dy: (N, C, OH, OW) → dx: (N, C, H, W)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Some(mut dx) = b.dx else { return Ok(()) };
        let g = window_geom(b.place, self.window, b.n)?;
        b.gpu.avgpool2d_bwd(&b.dy, &mut dx, self.window.padding, &g)
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/avgpool2d.cu run on the host against the CPU's [`super::cpu`],
/// bit for bit: the same f32 sums in the same order, the same divisions (a window's sum by
/// its count; each share dy / count, added in row-major output order from 0). Under the
/// launch shape the launches use and under a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfg, In, Out, FEW, I32};
    use crate::testing::{assert_bits, uniform};
    let cases = [
        // Overlapping windows (stride < pool): inputs in several windows sum their shares.
        ((2, 3, 7, 7), Window2d::new((3, 3), (2, 2), Padding::Valid)),
        // Same padding with a pad at the bottom (rows 0 / 1) and both sides (columns 1 / 1),
        // unequal strides: windows at the edges count fewer values.
        ((2, 2, 5, 6), Window2d::new((2, 3), (2, 1), Padding::Same)),
        // PyTorch's explicit pads, the padded zeros counted: pool 3, stride 2, pad 1.
        ((1, 2, 7, 6), Window2d::new((3, 3), (2, 2), Padding::Explicit(1, 1))),
        // Pads 1 / 2 on the rows: a window may hold a single row; every input in up to 12.
        ((3, 1, 5, 4), Window2d::new((4, 3), (1, 1), Padding::Same)),
    ];
    for (seed, ((n, c, h, w), window)) in (31..).zip(cases) {
        let placed = window.over(h, w).unwrap();
        let g = placed.launch_geom(n, c);
        let case = format!("{window:?} on ({n}, {c}, {h}, {w})");
        let x = uniform(seed, g.x_len());
        let dy = uniform(seed + 100, g.pooled_len());
        let (mut want_y, mut want_dx) = (vec![0.0; g.pooled_len()], vec![0.0; g.x_len()]);
        super::cpu::avgpool2d_forward(&x, &placed, &mut want_y);
        super::cpu::avgpool2d_backward(&dy, &placed, &mut want_dx);
        let geom = g.launch_args("avgpool2d host check").unwrap();
        let pad = count_pad(window.padding);
        for cfg in [elem_cfg(g.pooled_len()), FEW] {
            let mut y = vec![f32::NAN; g.pooled_len()];
            // As Gpu::avgpool2d_fwd pushes them: x, y, count_pad, then the geometry's 12 ints.
            let mut args = vec![In(&x), Out(&mut y), I32(pad)];
            args.extend(geom.map(I32));
            k.launch(&avgpool2d::FWD, cfg, &mut args);
            assert_bits(&format!("avgpool y {case} {cfg:?}"), &y, &want_y);
        }
        for cfg in [elem_cfg(g.x_len()), FEW] {
            let mut dx = vec![f32::NAN; g.x_len()];
            // As Gpu::avgpool2d_bwd: dy, dx, count_pad, then the geometry's 12 ints.
            let mut args = vec![In(&dy), Out(&mut dx), I32(pad)];
            args.extend(geom.map(I32));
            k.launch(&avgpool2d::BWD, cfg, &mut args);
            assert_bits(&format!("avgpool dx {case} {cfg:?}"), &dx, &want_dx);
        }
    }
}
