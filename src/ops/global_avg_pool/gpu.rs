//! Global average pooling on a GPU: the declaration of kernels/global_avg_pool.cu, its
//! checked launches, and the op's GPU form.

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::Result;

use super::*;

crate::cuda::declare::kernels! {
    "global_avg_pool.cu" {
        global_avgpool {
            fwd(x: In, y: Out, nc: Size, hw: Size);
            bwd(dy: In, dx: Out, nc: Size, hw: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// x: (N, C, H, W) with nc = N*C, hw = H*W -> y: (N, C), the spatial mean.
    pub fn global_avgpool_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, nc: usize, hw: usize) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        check_len("global_avgpool_fwd", "x", x, nc * hw)?;
        check_len("global_avgpool_fwd", "y", y, nc)?;
        if nc == 0 {
            return Ok(());
        }
        // SAFETY: global_avgpool_fwd_f32(const float*, float*, size_t, size_t); x holds
        // nc*hw floats and y nc (checked).
        unsafe { global_avgpool::fwd(self, elem_cfg(nc), x, y, nc, hw) }
    }

    /// dy: (N, C) -> dx: (N, C, H, W) = dy / (H*W), written.
    pub fn global_avgpool_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, nc: usize, hw: usize) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        check_len("global_avgpool_bwd", "dy", dy, nc)?;
        check_len("global_avgpool_bwd", "dx", dx, nc * hw)?;
        if nc * hw == 0 {
            return Ok(());
        }
        // SAFETY: global_avgpool_bwd_f32(const float*, float*, size_t, size_t); lengths
        // checked.
        unsafe { global_avgpool::bwd(self, elem_cfg(nc * hw), dy, dx, nc, hw) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(_layer: &GlobalAvgPool2d) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(GlobalAvgPool2dGpu))
}

/// The spatial mean on a GPU: `global_avgpool_fwd`, `global_avgpool_bwd`.
pub(super) struct GlobalAvgPool2dGpu;

impl GpuLayer for GlobalAvgPool2dGpu {
    // x: (N, C, H, W) → y: (N, C)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let c = f.place.output.numel();
        f.gpu.global_avgpool_fwd(f.x, f.y, f.n * c, f.place.input.numel() / c)
    }

    // dy: (N, C) → dx: (N, C, H, W)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let c = b.place.output.numel();
        match b.dx {
            Some(mut dx) => b.gpu.global_avgpool_bwd(&b.dy, &mut dx, b.n * c, b.place.input.numel() / c),
            None => Ok(()),
        }
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/global_avg_pool.cu run on the host against the CPU's
/// [`super::cpu`], bit for bit (the same ordered sum, multiplied by the same f32 1/(H·W)):
/// N·C = 128 planes of 5 × 5, among them a plane of −0 (whose mean is −0), one holding +∞
/// and −∞ (NaN) and gradients of −0 and ∞, under the launch shapes the launches use and
/// under a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfg, In, Out, FEW, U64};
    use crate::testing::{assert_bits, uniform};
    let (nc, hw) = (2 * 64, 5 * 5);
    let (mut x, mut dy) = (uniform(6, nc * hw), uniform(7, nc));
    x[..hw].fill(-0.0);
    (x[hw], x[hw + 3]) = (f32::INFINITY, f32::NEG_INFINITY);
    (dy[0], dy[1]) = (-0.0, f32::INFINITY);
    let (mut want_y, mut want_dx) = (vec![f32::NAN; nc], vec![f32::NAN; nc * hw]);
    super::cpu::global_avg_pool_forward(&x, &mut want_y, hw);
    super::cpu::global_avg_pool_backward(&dy, &mut want_dx, hw);
    assert!(want_y[0].to_bits() == (-0.0f32).to_bits() && want_y[1].is_nan());
    for (cfg_fwd, cfg_bwd) in [(elem_cfg(nc), elem_cfg(nc * hw)), (FEW, FEW)] {
        let (mut y, mut dx) = (vec![f32::NAN; nc], vec![f32::NAN; nc * hw]);
        // As Gpu::global_avgpool_fwd pushes them: x, y, nc, hw; Gpu::global_avgpool_bwd:
        // dy, dx, nc, hw.
        k.launch(&global_avgpool::FWD, cfg_fwd, &mut [In(&x), Out(&mut y), U64(nc as u64), U64(hw as u64)]);
        k.launch(&global_avgpool::BWD, cfg_bwd, &mut [In(&dy), Out(&mut dx), U64(nc as u64), U64(hw as u64)]);
        assert_bits(&format!("avgpool y {cfg_fwd:?}"), &y, &want_y);
        assert_bits(&format!("avgpool dx {cfg_bwd:?}"), &dx, &want_dx);
    }
}

// ---- on a GPU ---------------------------------------------------------------------------

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::ops::global_avg_pool::cpu;
    use crate::testing::{assert_bits, uniform};

    /// The kernels on a GPU against the CPU's [`cpu`], bit for bit, as on the host.
    #[test]
    fn global_average_pooling_on_a_gpu_is_the_cpus_bit_for_bit() {
        if !crate::ops::conformance::gpu_or_skip("global_average_pooling_on_a_gpu_is_the_cpus_bit_for_bit") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let s = gpu.stream();
        let (nc, hw) = (2 * 64, 5 * 5);
        let (x, dy) = (uniform(5, nc * hw), uniform(6, nc));
        let (mut want_y, mut want_dx) = (vec![0.0; nc], vec![0.0; nc * hw]);
        cpu::global_avg_pool_forward(&x, &mut want_y, hw);
        cpu::global_avg_pool_backward(&dy, &mut want_dx, hw);
        let mut y_d = s.alloc_zeros::<f32>(nc).unwrap();
        gpu.global_avgpool_fwd(&s.clone_htod(&x).unwrap(), &mut y_d, nc, hw).unwrap();
        assert_bits("avgpool y", &s.clone_dtoh(&y_d).unwrap(), &want_y);
        let mut dx_d = s.alloc_zeros::<f32>(nc * hw).unwrap();
        gpu.global_avgpool_bwd(&s.clone_htod(&dy).unwrap(), &mut dx_d, nc, hw).unwrap();
        assert_bits("avgpool dx", &s.clone_dtoh(&dx_d).unwrap(), &want_dx);
    }
}
