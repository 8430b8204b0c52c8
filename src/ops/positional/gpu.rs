//! The positional embedding on a GPU: the declaration of kernels/positional.cu, its checked
//! launches, and the op's GPU form.

use crate::cuda::launch::{check_len, dim, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer};
use crate::Result;
use cudarc::driver::CudaViewMut;

use super::*;

crate::cuda::declare::kernels! {
    "positional.cu" {
        positional_embedding {
            fwd(x: In, weight: In, y: Out, tc: Size, total: Size);
            bwd(dy: In, dweight: Out, dx: OptOut, n: I32, tc: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// y = x + weight, the table's first T rows broadcast over the batch. `weight` is those
    /// T rows (T*C values). x, y: (n, T, C) with tc = T*C; weight: (T, C)
    pub fn positional_embedding_fwd(
        &self,
        x: &impl DevIn,
        weight: &impl DevIn,
        y: &mut impl DevOut,
        n: usize,
        tc: usize,
    ) -> Result<()> {
        let (x, weight, y) = (&x.view(), &weight.view(), &mut y.view_mut());
        let op = "positional_embedding_fwd";
        let total = n * tc;
        check_len(op, "x", x, total)?;
        check_len(op, "weight", weight, tc)?;
        check_len(op, "y", y, total)?;
        if total == 0 {
            return Ok(());
        }
        // SAFETY: positional_embedding_fwd_f32(const float* x, const float* weight, float* y,
        // size_t tc, size_t total); x and y hold total floats, weight tc (checked), and
        // i % tc < tc.
        unsafe { positional_embedding::fwd(self, elem_cfg(total), x, weight, y, tc, total) }
    }

    /// dweight += `Σ_n dy[n]` (n ascending, into the gradient's value); dx = dy when given.
    /// dy, dx: (n, T, C) with tc = T*C; dweight: (T, C), the table's first T rows
    pub fn positional_embedding_bwd(
        &self,
        dy: &impl DevIn,
        dweight: &mut impl DevOut,
        dx: Option<&mut CudaViewMut<'_, f32>>,
        n: usize,
        tc: usize,
    ) -> Result<()> {
        let (dy, dweight) = (&dy.view(), &mut dweight.view_mut());
        let op = "positional_embedding_bwd";
        check_len(op, "dy", dy, n * tc)?;
        check_len(op, "dweight", dweight, tc)?;
        if let Some(dx) = &dx {
            check_len(op, "dx", &**dx, n * tc)?;
        }
        if tc == 0 {
            return Ok(());
        }
        let ni = dim(op, "N", n)?;
        // SAFETY: positional_embedding_bwd_f32(const float* dy, float* dweight, float* dx, int
        // n, size_t tc); dy holds n*tc floats, dweight tc, dx n*tc when present (checked); an
        // absent dx is a 64-bit 0 the kernel tests for NULL before use.
        unsafe { positional_embedding::bwd(self, elem_cfg(tc), dy, dweight, dx, ni, tc) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &PositionalEmbedding) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(PositionalGpu { width: layer.width }))
}

/// The positional embedding on a GPU: `positional_embedding_fwd` adds the table's first
/// T rows; `positional_embedding_bwd` sums dy over the batch into their gradient and
/// copies dy to dx in the same pass.
pub(super) struct PositionalGpu {
    width: usize,
}

impl PositionalGpu {
    /// T·C, the values of one sequence of `place`'s input (T, C).
    fn tc(&self, place: &crate::ops::gpu::Placement) -> usize {
        place.input.dims().first().copied().unwrap_or(0) * self.width
    }
}

impl GpuLayer for PositionalGpu {
    // x: (N, T, C) → y = x + weight[0..T]
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let tc = self.tc(f.place);
        f.gpu.positional_embedding_fwd(f.x, &f.param(0).slice(0..tc), f.y, f.n, tc)
    }

    // dy: (N, T, C) → dweight[0..T] += Σ_n dy[n]; dx = dy
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let tc = self.tc(b.place);
        let Backward { gpu, place, n, dy, mut dx, grads, .. } = b;
        let start = place.params[0].start;
        gpu.positional_embedding_bwd(&dy, &mut grads.slice_mut(start..start + tc), dx.as_mut(), n, tc)
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/positional.cu run on the host against the CPU's [`super::cpu`],
/// bit for bit (one f32 add a value forward; the same adds in the same order into the
/// gradient's value backward, dx a copy), with and without dx, under the launch shape the
/// launches use and under a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfgs, In, Null, Out, I32, U64};
    use crate::testing::{assert_bits, uniform};
    let (n, t, c) = (3, 5, 4);
    let (tc, total) = (t * c, n * t * c);
    // x, dy: (N, T, C); weight, dweight: the table's first T rows (T, C).
    let (x, dy, weight, dweight0) = (uniform(22, total), uniform(23, total), uniform(24, tc), uniform(25, tc));
    let (mut want_y, mut want_dweight) = (x.clone(), dweight0.clone());
    super::cpu::positional_forward(&mut want_y, &weight);
    super::cpu::positional_backward(&dy, &mut want_dweight);
    for cfg in elem_cfgs(total) {
        let mut y = vec![f32::NAN; total];
        // As Gpu::positional_embedding_fwd pushes them: x, weight (its first T rows), y, tc,
        // total.
        k.launch(
            &positional_embedding::FWD,
            cfg,
            &mut [In(&x), In(&weight), Out(&mut y), U64(tc as u64), U64(total as u64)],
        );
        assert_bits(&format!("positional y {cfg:?}"), &y, &want_y);
    }
    for cfg in elem_cfgs(tc) {
        for with_dx in [true, false] {
            let (mut dweight, mut dx) = (dweight0.clone(), vec![f32::NAN; total]);
            // As Gpu::positional_embedding_bwd pushes them: dy, dweight (its first T rows), dx
            // or NULL, n, tc.
            let dx_arg = if with_dx { Out(&mut dx) } else { Null };
            k.launch(
                &positional_embedding::BWD,
                cfg,
                &mut [In(&dy), Out(&mut dweight), dx_arg, I32(n as i32), U64(tc as u64)],
            );
            assert_bits(&format!("positional dweight {cfg:?} dx {with_dx}"), &dweight, &want_dweight);
            if with_dx {
                assert_bits(&format!("positional dx {cfg:?}"), &dx, &dy);
            } else {
                assert!(dx.iter().all(|v| v.is_nan()), "no dx written without one");
            }
        }
    }
}
