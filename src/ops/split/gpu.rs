//! Split on a GPU: the declaration of kernels/split.cu, its checked launches, the op's GPU
//! form (nothing kept), and the check of the kernels on the host against the CPU's.

use std::ops::Range;

use super::cpu::Around;
use super::Split;
use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{Backward, Forward, GpuLayer, Placement};
use crate::Result;

crate::cuda::declare::kernels! {
    "split.cu" {
        split {
            fwd(x: In, y: Out, outer: Size, axis: Size, start: Size, len: Size, inner: Size);
            bwd(dy: In, dx: Out, outer: Size, axis: Size, start: Size, len: Size, inner: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// y = the part's rows of each block. x: (outer, axis, inner) → y: (outer, len, inner)
    pub fn split_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, at: Around, part: Range<usize>) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let Around { outer, axis, inner } = at;
        let op = "split_fwd";
        check_part(op, axis, &part)?;
        check_len(op, "x", x, outer * axis * inner)?;
        check_len(op, "y", y, outer * part.len() * inner)?;
        if y.is_empty() {
            return Ok(());
        }
        // SAFETY: split_fwd_f32(const float*, float*, 5 × size_t); x holds outer·axis·inner
        // floats and y outer·len·inner (checked), and start + len ≤ axis (checked): the
        // kernel writes y below its length and reads x at (o, start + r, i) inside it.
        unsafe { split::fwd(self, elem_cfg(y.len()), x, y, outer, axis, part.start, part.len(), inner) }
    }

    /// dx = dy in the part's place of each block, 0 elsewhere. dy: (outer, len, inner) →
    /// dx: (outer, axis, inner)
    pub fn split_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, at: Around, part: Range<usize>) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let Around { outer, axis, inner } = at;
        let op = "split_bwd";
        check_part(op, axis, &part)?;
        check_len(op, "dy", dy, outer * part.len() * inner)?;
        check_len(op, "dx", dx, outer * axis * inner)?;
        if dx.is_empty() {
            return Ok(());
        }
        // SAFETY: split_bwd_f32(const float*, float*, 5 × size_t); lengths and the part
        // checked as above: the kernel writes dx below outer·axis·inner and reads dy only at
        // rows start..start + len, below outer·len·inner.
        unsafe { split::bwd(self, elem_cfg(dx.len()), dy, dx, outer, axis, part.start, part.len(), inner) }
    }
}

/// Errors unless `part` lies in an axis of `axis`.
fn check_part(op: &'static str, axis: usize, part: &Range<usize>) -> Result<()> {
    if part.start <= part.end && part.end <= axis {
        Ok(())
    } else {
        Err(crate::Error::shape(op, format!("part {part:?} of an axis of {axis}")))
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &Split) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(SplitGpu { layer: layer.clone() }))
}

/// Split on a GPU: `split_fwd`, `split_bwd`.
struct SplitGpu {
    /// The layer's axis, sizes and index.
    layer: Split,
}

impl SplitGpu {
    /// The batch of `n` samples of `place` around the axis, and the part.
    fn around(&self, place: &Placement, n: usize) -> Result<(Around, Range<usize>)> {
        let (_, at, part) = self.layer.around(place.input.dims()).map_err(|e| crate::Error::shape("split", e))?;
        Ok((Around { outer: n * at.outer, ..at }, part))
    }
}

impl GpuLayer for SplitGpu {
    // x: (N, ..., L, ...) → y: (N, ..., len, ...)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let (at, part) = self.around(f.place, f.n)?;
        f.gpu.split_fwd(f.x, f.y, at, part)
    }

    // dy: (N, ..., len, ...) → dx: (N, ..., L, ...), 0 outside the part
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Some(mut dx) = b.dx else { return Ok(()) };
        let (at, part) = self.around(b.place, b.n)?;
        b.gpu.split_bwd(&b.dy, &mut dx, at, part)
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/split.cu run on the host against the CPU's [`super::cpu`], bit for
/// bit (moves, and zeros), for a first, a middle and a last part, a part of rows of one
/// value and a part that is the whole axis, under the launch shape the launches use and
/// under a grid too small to cover the data.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use super::cpu::{split_backward, split_forward};
    use crate::cuda::host::{elem_cfgs, In, Out, U64};
    use crate::testing::{assert_bits, uniform};
    for (seed, (at, part)) in (81..).zip([
        (Around { outer: 6, axis: 7, inner: 5 }, 0..2),
        (Around { outer: 6, axis: 7, inner: 5 }, 2..6),
        (Around { outer: 6, axis: 7, inner: 5 }, 6..7),
        (Around { outer: 9, axis: 10, inner: 1 }, 3..8),
        (Around { outer: 2, axis: 4, inner: 33 }, 0..4),
    ]) {
        let Around { outer, axis, inner } = at;
        let (whole, len) = (outer * axis * inner, outer * part.len() * inner);
        let (x, dy) = (uniform(seed, whole), uniform(seed + 100, len));
        let (mut want_y, mut want_dx) = (vec![0.0; len], vec![0.0; whole]);
        split_forward(&x, at, part.clone(), &mut want_y);
        split_backward(&dy, at, part.clone(), &mut want_dx);
        let case = format!("{at:?} part {part:?}");
        let sizes =
            || [U64(outer as u64), U64(axis as u64), U64(part.start as u64), U64(part.len() as u64), U64(inner as u64)];
        for cfg in elem_cfgs(len) {
            let mut y = vec![f32::NAN; len];
            // As Gpu::split_fwd pushes them: x, y, outer, axis, start, len, inner.
            let mut args = vec![In(&x), Out(&mut y)];
            args.extend(sizes());
            k.launch(&split::FWD, cfg, &mut args);
            assert_bits(&format!("split y {case} {cfg:?}"), &y, &want_y);
        }
        for cfg in elem_cfgs(whole) {
            let mut dx = vec![f32::NAN; whole];
            // As Gpu::split_bwd: dy, dx, outer, axis, start, len, inner.
            let mut args = vec![In(&dy), Out(&mut dx)];
            args.extend(sizes());
            k.launch(&split::BWD, cfg, &mut args);
            assert_bits(&format!("split dx {case} {cfg:?}"), &dx, &want_dx);
        }
    }
}
