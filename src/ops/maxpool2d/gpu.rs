//! Max pooling on a GPU: the declaration of kernels/maxpool2d.cu, its checked launches
//! (buffers checked against the window geometry), the op's GPU form, and the check of the
//! kernels on the host against the CPU's. Where a window lies is `ops::window`'s, which
//! maximum wins a tie [`super::cpu`]'s.

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{window_geom, Backward, Forward, GpuLayer, Placement};
use crate::ops::window::WindowGeom;
use crate::Result;
use cudarc::driver::CudaSlice;

use super::*;

crate::cuda::declare::kernels! {
    "maxpool2d.cu" {
        maxpool2d {
            fwd(x: In, y: Out, argmax: OutU32, geom: Geom);
            bwd(dy: In, argmax: InU32, dx: Out, geom: Geom);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// Max pooling: y = the maximum of each window, argmax = its index h*W + w in the
    /// plane (ties to the first in row-major order, NaN wins: `ops::maxpool2d::cpu`).
    /// x: (N, C, H, W) -> y, argmax: (N, C, OH, OW)
    pub fn maxpool2d_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        argmax: &mut CudaSlice<u32>,
        g: &WindowGeom,
    ) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let op = "maxpool2d_fwd";
        let a = g.launch_args(op)?;
        check_len(op, "x", x, g.x_len())?;
        check_len(op, "y", y, g.pooled_len())?;
        check_len(op, "argmax", argmax, g.pooled_len())?;
        if g.pooled_len() == 0 {
            return Ok(());
        }
        let argmax = &mut argmax.as_view_mut();
        // SAFETY: maxpool2d_fwd_f32(const float*, float*, unsigned*, 12 x int); x, y and
        // argmax have the lengths the geometry implies (checked), and the kernel reads x
        // only inside the plane (the window clipped to 0..H, 0..W) and writes y and argmax
        // below N*C*OH*OW.
        unsafe { maxpool2d::fwd(self, elem_cfg(g.pooled_len()), x, y, argmax, &a) }
    }

    /// Backward of [`Gpu::maxpool2d_fwd`]: `dx[i]` = sum of dy over the outputs whose
    /// argmax is i, in row-major output order; dx is written.
    /// dy, argmax: (N, C, OH, OW) -> dx: (N, C, H, W)
    pub fn maxpool2d_bwd(
        &self,
        dy: &impl DevIn,
        argmax: &CudaSlice<u32>,
        dx: &mut impl DevOut,
        g: &WindowGeom,
    ) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let op = "maxpool2d_bwd";
        let a = g.launch_args(op)?;
        check_len(op, "dy", dy, g.pooled_len())?;
        check_len(op, "argmax", argmax, g.pooled_len())?;
        check_len(op, "dx", dx, g.x_len())?;
        if g.x_len() == 0 {
            return Ok(());
        }
        // SAFETY: maxpool2d_bwd_f32(const float*, const unsigned*, float*, 12 x int);
        // lengths checked; the kernel reads dy and argmax only at oy < OH, ox < OW of its
        // own plane and writes dx below N*C*H*W, one element per thread.
        unsafe { maxpool2d::bwd(self, elem_cfg(g.x_len()), dy, &argmax.as_view(), dx, &a) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &MaxPool2d) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(MaxPool2dGpu { window: layer.window, argmax: None }))
}

/// Max pooling on a GPU: `maxpool2d_fwd` writes the winners' indices, which
/// `maxpool2d_bwd` routes the gradient back through (ties and NaN as on the CPU, above).
pub(super) struct MaxPool2dGpu {
    window: Window2d,
    /// The winner's index of each output, argmax: (N, C, OH, OW), from the last forward.
    argmax: Option<CudaSlice<u32>>,
}

impl GpuLayer for MaxPool2dGpu {
    fn reserve(&mut self, gpu: &Gpu, place: &Placement, n: usize) -> Result<()> {
        self.argmax = None;
        self.argmax = Some(gpu.stream().alloc_zeros::<u32>((n * place.output.numel()).max(1))?);
        Ok(())
    }

    // x: (N, C, H, W) → y, argmax: (N, C, OH, OW)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let g = window_geom(f.place, self.window, f.n)?;
        let argmax = self.argmax.as_mut().expect("reserved before the pass");
        f.gpu.maxpool2d_fwd(f.x, f.y, argmax, &g)
    }

    // dy, argmax: (N, C, OH, OW) → dx: (N, C, H, W)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Some(mut dx) = b.dx else { return Ok(()) };
        let g = window_geom(b.place, self.window, b.n)?;
        let argmax = self.argmax.as_ref().expect("reserved before the pass");
        b.gpu.maxpool2d_bwd(&b.dy, argmax, &mut dx, &g)
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/maxpool2d.cu run on the host against the CPU's [`super::cpu`], bit
/// for bit: a maximum is one of its inputs and the scan order is the CPU's (NaN payloads
/// and the sign of a winning zero included), and each input adds the dout of the windows
/// it won in row-major output order from 0, the same f32 additions. Inputs on nine levels
/// in [−1, 1] (so windows hold ties, and −0 beside 0), two NaNs and a −∞; under the launch
/// shape the launches use and under a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfg, In, InU32, Out, OutU32, FEW, I32};
    use crate::testing::{assert_bits, uniform};
    let cases = [
        // Overlapping windows (stride < pool): inputs that win several windows sum them.
        ((2, 3, 7, 7), Window2d::new((3, 3), (2, 2), Padding::Valid)),
        // Same padding with a pad at the bottom (rows 0 / 1) and both sides (columns 1 / 1),
        // unequal strides.
        ((2, 2, 5, 6), Window2d::new((2, 3), (2, 1), Padding::Same)),
        // The common 2×2 pool, with a ragged edge (row and column 6 unread).
        ((1, 2, 7, 7), Window2d::new((2, 2), (2, 2), Padding::Valid)),
        // Pads 1 / 2 on the rows: a window may hold a single row; every input in up to 12.
        ((3, 1, 5, 4), Window2d::new((4, 3), (1, 1), Padding::Same)),
    ];
    for (seed, ((n, c, h, w), window)) in (11..).zip(cases) {
        let placed = window.over(h, w).unwrap();
        let g = placed.launch_geom(n, c);
        let case = format!("{window:?} on ({n}, {c}, {h}, {w})");
        let mut x: Vec<f32> = uniform(seed, g.x_len()).iter().map(|v| (v * 4.0).round() / 4.0).collect();
        let len = x.len();
        (x[5], x[len - 3], x[7]) = (f32::NAN, f32::NAN, f32::NEG_INFINITY);
        let dy = uniform(seed + 100, g.pooled_len());
        let (mut want_y, mut want_argmax, mut want_dx) =
            (vec![0.0; g.pooled_len()], vec![0u32; g.pooled_len()], vec![0.0; len]);
        super::cpu::maxpool2d_forward(&x, &placed, &mut want_y, &mut want_argmax);
        super::cpu::maxpool2d_backward(&dy, &want_argmax, &placed, &mut want_dx);
        assert!(want_y.iter().any(|v| v.is_nan()) && want_dx.iter().any(|&v| v != 0.0), "{case}: the cases bite");
        let geom = g.launch_args("maxpool2d host check").unwrap();

        for cfg in [elem_cfg(g.pooled_len()), FEW] {
            let (mut y, mut argmax) = (vec![f32::NAN; g.pooled_len()], vec![u32::MAX; g.pooled_len()]);
            // As Gpu::maxpool2d_fwd pushes them: x, y, argmax, then the geometry's 12 ints.
            let mut args = vec![In(&x), Out(&mut y), OutU32(&mut argmax)];
            args.extend(geom.map(I32));
            k.launch(&maxpool2d::FWD, cfg, &mut args);
            assert_bits(&format!("maxpool y {case} {cfg:?}"), &y, &want_y);
            assert_eq!(argmax, want_argmax, "maxpool argmax {case} {cfg:?}");
        }
        for cfg in [elem_cfg(g.x_len()), FEW] {
            let mut dx = vec![f32::NAN; len];
            // As Gpu::maxpool2d_bwd: dy, argmax, dx, then the geometry's 12 ints.
            let mut args = vec![In(&dy), InU32(&want_argmax), Out(&mut dx)];
            args.extend(geom.map(I32));
            k.launch(&maxpool2d::BWD, cfg, &mut args);
            assert_bits(&format!("maxpool dx {case} {cfg:?}"), &dx, &want_dx);
        }
    }
}
