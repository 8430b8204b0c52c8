//! Nearest upsampling on a GPU: the declaration of kernels/upsample.cu, its checked
//! launches, the op's GPU form (nothing kept), and the check of the kernels on the host
//! against the CPU's.

use crate::cuda::launch::{check_len, dim, elem_cfg, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{Backward, Forward, GpuLayer, Placement};
use crate::{Error, Result};

use super::Upsample2d;

crate::cuda::declare::kernels! {
    "upsample.cu" {
        upsample {
            fwd(x: In, y: Out, planes: Size, h: I32, w: I32, sh: I32, sw: I32);
            bwd(dy: In, dx: Out, planes: Size, h: I32, w: I32, sh: I32, sw: I32);
        }
    }
}

/// The launch's (H, W, SH, SW) as the kernels' ints.
fn ints(op: &'static str, (h, w): (usize, usize), (sh, sw): (usize, usize)) -> Result<[i32; 4]> {
    Ok([dim(op, "H", h)?, dim(op, "W", w)?, dim(op, "SH", sh)?, dim(op, "SW", sw)?])
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// y = x repeated into SH×SW blocks. x: (planes, H, W) → y: (planes, H·SH, W·SW)
    pub fn upsample_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        planes: usize,
        hw: (usize, usize),
        size: (usize, usize),
    ) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let op = "upsample_fwd";
        let [h, w, sh, sw] = ints(op, hw, size)?;
        let n_in = planes * hw.0 * hw.1;
        check_len(op, "x", x, n_in)?;
        check_len(op, "y", y, n_in * size.0 * size.1)?;
        if n_in == 0 {
            return Ok(());
        }
        // SAFETY: upsample_fwd_f32(const float*, float*, size_t, int, int, int, int); x holds
        // planes·H·W floats and y planes·H·SH·W·SW (checked); the kernel writes y below that
        // and reads x at (oy / SH, ox / SW) of its own plane, inside it.
        unsafe { upsample::fwd(self, elem_cfg(y.len()), x, y, planes, h, w, sh, sw) }
    }

    /// dx = the sum of dy over each SH×SW block. dy: (planes, H·SH, W·SW) → dx: (planes, H, W)
    pub fn upsample_bwd(
        &self,
        dy: &impl DevIn,
        dx: &mut impl DevOut,
        planes: usize,
        hw: (usize, usize),
        size: (usize, usize),
    ) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let op = "upsample_bwd";
        let [h, w, sh, sw] = ints(op, hw, size)?;
        let n_in = planes * hw.0 * hw.1;
        check_len(op, "dy", dy, n_in * size.0 * size.1)?;
        check_len(op, "dx", dx, n_in)?;
        if n_in == 0 {
            return Ok(());
        }
        // SAFETY: upsample_bwd_f32(const float*, float*, size_t, int, int, int, int); lengths
        // checked; one thread per input writes dx below planes·H·W and reads its own SH×SW
        // block of dy, inside the plane.
        unsafe { upsample::bwd(self, elem_cfg(n_in), dy, dx, planes, h, w, sh, sw) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &Upsample2d) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(UpsampleGpu { size: layer.size }))
}

/// Nearest upsampling on a GPU: `upsample_fwd`, `upsample_bwd`.
struct UpsampleGpu {
    size: (usize, usize),
}

/// (planes, (H, W)) of a batch of `n` inputs of `place`.
fn planes(place: &Placement, n: usize) -> Result<(usize, (usize, usize))> {
    match place.input.dims() {
        &[c, h, w] => Ok((n * c, (h, w))),
        _ => Err(Error::shape("upsample", format!("{}: input {} is not (C, H, W)", place.name, place.input))),
    }
}

impl GpuLayer for UpsampleGpu {
    // x: (N, C, H, W) → y: (N, C, H·SH, W·SW)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let (p, hw) = planes(f.place, f.n)?;
        f.gpu.upsample_fwd(f.x, f.y, p, hw, self.size)
    }

    // dy: (N, C, H·SH, W·SW) → dx: (N, C, H, W)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Some(mut dx) = b.dx else { return Ok(()) };
        let (p, hw) = planes(b.place, b.n)?;
        b.gpu.upsample_bwd(&b.dy, &mut dx, p, hw, self.size)
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/upsample.cu run on the host against the CPU's [`super::cpu`], bit
/// for bit (copies, and the same f32 sums in the same order), at (2, 2), (1, 3) and (3, 2)
/// on ragged planes, under the launch shape the launches use and under a grid too small to
/// cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfg, In, Out, FEW, I32, U64};
    use crate::testing::{assert_bits, uniform};
    for (seed, (planes, (h, w), (sh, sw))) in
        (51..).zip([(6, (5, 7), (2, 2)), (2, (3, 4), (1, 3)), (3, (4, 3), (3, 2))])
    {
        let (n_in, n_out) = (planes * h * w, planes * h * w * sh * sw);
        let (x, dy) = (uniform(seed, n_in), uniform(seed + 100, n_out));
        let (mut want_y, mut want_dx) = (vec![0.0; n_out], vec![0.0; n_in]);
        super::cpu::upsample_forward(&x, (h, w), (sh, sw), &mut want_y);
        super::cpu::upsample_backward(&dy, (h, w), (sh, sw), &mut want_dx);
        let case = format!("{planes} planes {h}x{w} at {sh}x{sw}");
        let geom = |v: &mut Vec<crate::cuda::host::Arg<'_>>| {
            v.extend([U64(planes as u64), I32(h as i32), I32(w as i32), I32(sh as i32), I32(sw as i32)])
        };
        for cfg in [elem_cfg(n_out), FEW] {
            let mut y = vec![f32::NAN; n_out];
            // As Gpu::upsample_fwd pushes them: x, y, planes, h, w, sh, sw.
            let mut args = vec![In(&x), Out(&mut y)];
            geom(&mut args);
            k.launch(&upsample::FWD, cfg, &mut args);
            assert_bits(&format!("upsample y {case} {cfg:?}"), &y, &want_y);
        }
        for cfg in [elem_cfg(n_in), FEW] {
            let mut dx = vec![f32::NAN; n_in];
            // As Gpu::upsample_bwd: dy, dx, planes, h, w, sh, sw.
            let mut args = vec![In(&dy), Out(&mut dx)];
            geom(&mut args);
            k.launch(&upsample::BWD, cfg, &mut args);
            assert_bits(&format!("upsample dx {case} {cfg:?}"), &dx, &want_dx);
        }
    }
}
