//! Rescaling on a GPU: the declaration of kernels/rescaling.cu, its checked launches, and
//! the op's GPU form.

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::Result;

use super::*;

crate::cuda::declare::kernels! {
    "rescaling.cu" {
        rescale {
            fwd(x: In, y: Out, scale: F32, offset: F32, n: Size);
            bwd(dy: In, dx: Out, scale: F32, n: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// y = x * scale + offset. x, y: (n)
    pub fn rescale_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, scale: f32, offset: f32) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let n = x.len();
        check_len("rescale_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: rescale_fwd_f32(const float*, float*, float, float, size_t); x and y
        // hold n floats (checked above).
        unsafe { rescale::fwd(self, elem_cfg(n), x, y, scale, offset, n) }
    }

    /// dx = dy * scale. dy, dx: (n)
    pub fn rescale_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, scale: f32) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let n = dy.len();
        check_len("rescale_bwd", "dx", dx, n)?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: rescale_bwd_f32(const float*, float*, float, size_t); dy and dx hold n
        // floats (checked above).
        unsafe { rescale::bwd(self, elem_cfg(n), dy, dx, scale, n) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &Rescaling) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(RescalingGpu { scale: layer.scale, offset: layer.offset }))
}

/// Rescaling on a GPU: `rescale_fwd`, `rescale_bwd`.
pub(super) struct RescalingGpu {
    scale: f32,
    offset: f32,
}

impl GpuLayer for RescalingGpu {
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        f.gpu.rescale_fwd(f.x, f.y, self.scale, self.offset)
    }

    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        match b.dx {
            Some(mut dx) => b.gpu.rescale_bwd(&b.dy, &mut dx, self.scale),
            None => Ok(()),
        }
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/rescaling.cu run on the host against the CPU's [`super::cpu`], bit
/// for bit (a multiply and an add, each rounded once, on both sides): pixel-like values and
/// those where the two could part (±0, ±∞, NaN, the largest finite value), under the launch
/// shape the launches use and under a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfgs, In, Out, F32, U64};
    use crate::testing::{assert_bits, uniform};
    let n = 2500;
    let mut x: Vec<f32> = uniform(2, n).iter().map(|v| 255.0 * v).collect();
    let mut dy = uniform(3, n);
    let edges = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX];
    x[..6].copy_from_slice(&edges);
    dy[..6].copy_from_slice(&edges);
    // The convnet's: pixels in [0, 255] to [−0.5, 0.5].
    let (scale, offset) = (1.0f32 / 255.0, -0.5f32);
    let (mut want_y, mut want_dx) = (x.clone(), dy.clone());
    super::cpu::rescaling_forward(&mut want_y, scale, offset);
    super::cpu::rescaling_backward(&mut want_dx, scale);
    for cfg in elem_cfgs(n) {
        let (mut y, mut dx) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        // As Gpu::rescale_fwd pushes them: x, y, scale, offset, n; Gpu::rescale_bwd: dy,
        // dx, scale, n.
        k.launch(&rescale::FWD, cfg, &mut [In(&x), Out(&mut y), F32(scale), F32(offset), U64(n as u64)]);
        k.launch(&rescale::BWD, cfg, &mut [In(&dy), Out(&mut dx), F32(scale), U64(n as u64)]);
        assert_bits(&format!("rescale y {cfg:?}"), &y, &want_y);
        assert_bits(&format!("rescale dx {cfg:?}"), &dx, &want_dx);
    }
}

// ---- on a GPU ---------------------------------------------------------------------------

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::ops::rescaling::cpu;
    use crate::testing::{assert_bits, uniform};

    /// The kernels on a GPU against the CPU's [`cpu`]: bit for bit, the multiply and the add
    /// rounded apart there too (no FMA: the kernel's `_rn` intrinsics). A wrong length is a
    /// shape error, not a launch.
    #[test]
    fn rescaling_on_a_gpu_is_the_cpus_bit_for_bit() {
        if !crate::ops::conformance::gpu_or_skip("rescaling_on_a_gpu_is_the_cpus_bit_for_bit") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let n = 1000;
        let x: Vec<f32> = uniform(1, n).iter().map(|v| 255.0 * v).collect();
        let dy = uniform(2, n);
        let (scale, offset) = (1.0f32 / 255.0, -0.5f32);
        let (mut want_y, mut want_dx) = (x.clone(), dy.clone());
        cpu::rescaling_forward(&mut want_y, scale, offset);
        cpu::rescaling_backward(&mut want_dx, scale);
        let s = gpu.stream();
        let (x_d, dy_d) = (s.clone_htod(&x).unwrap(), s.clone_htod(&dy).unwrap());
        let (mut y_d, mut dx_d) = (s.alloc_zeros::<f32>(n).unwrap(), s.alloc_zeros::<f32>(n).unwrap());
        gpu.rescale_fwd(&x_d, &mut y_d, scale, offset).unwrap();
        gpu.rescale_bwd(&dy_d, &mut dx_d, scale).unwrap();
        assert_bits("rescale y", &s.clone_dtoh(&y_d).unwrap(), &want_y);
        assert_bits("rescale dx", &s.clone_dtoh(&dx_d).unwrap(), &want_dx);
        let mut short = s.alloc_zeros::<f32>(n - 1).unwrap();
        assert!(matches!(
            gpu.rescale_fwd(&x_d, &mut short, scale, offset),
            Err(crate::Error::Shape { op: "rescale_fwd", .. })
        ));
    }
}
