//! Concatenate on a GPU: the declaration of kernels/concatenate.cu, its checked launches,
//! and the op's GPU form (one copy kernel per input each way, the axis resolved as the
//! CPU layer resolves it).

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Forward, GpuLayer, Placement};
use crate::{Error, Result};

use super::*;

crate::cuda::declare::kernels! {
    "concatenate.cu" {
        concatenate {
            fwd(x: In, y: Out, outer: Size, inner: Size, total: Size, offset: Size);
            bwd(dy: In, dx: Out, outer: Size, inner: Size, total: Size, offset: Size);
        }
    }
}

/// Where one input lies in the output, seen from the axis: rows of `inner` values at
/// columns `offset..offset + inner` of the output's `outer` rows of `total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    pub outer: usize,
    pub inner: usize,
    pub total: usize,
    pub offset: usize,
}

impl Part {
    /// Errors unless the part fits its rows.
    fn check(&self, op: &'static str) -> Result<()> {
        match self.offset.checked_add(self.inner) {
            Some(end) if end <= self.total => Ok(()),
            _ => Err(Error::shape(
                op,
                format!("columns {}..+{} outside rows of {}", self.offset, self.inner, self.total),
            )),
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// y[o, offset + j] = x[o, j]. x: (outer, inner), y: (outer, total)
    pub fn concatenate_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, p: Part) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let op = "concatenate_fwd";
        p.check(op)?;
        check_len(op, "x", x, p.outer * p.inner)?;
        check_len(op, "y", y, p.outer * p.total)?;
        if p.outer * p.inner == 0 {
            return Ok(());
        }
        // SAFETY: concatenate_fwd_f32(const float*, float*, size_t outer, size_t inner,
        // size_t total, size_t offset); x holds outer·inner floats, y outer·total, and
        // offset + inner ≤ total (checked above), so every index written is < outer·total;
        // y, borrowed mutably, does not alias x; a grid-stride loop, any grid.
        unsafe { concatenate::fwd(self, elem_cfg(p.outer * p.inner), x, y, p.outer, p.inner, p.total, p.offset) }
    }

    /// dx[o, j] = dy[o, offset + j]. dy: (outer, total), dx: (outer, inner)
    pub fn concatenate_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, p: Part) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let op = "concatenate_bwd";
        p.check(op)?;
        check_len(op, "dy", dy, p.outer * p.total)?;
        check_len(op, "dx", dx, p.outer * p.inner)?;
        if p.outer * p.inner == 0 {
            return Ok(());
        }
        // SAFETY: concatenate_bwd_f32(const float*, float*, size_t outer, size_t inner,
        // size_t total, size_t offset); dy holds outer·total floats, dx outer·inner, and
        // offset + inner ≤ total (checked above), so every index read is < outer·total; dx,
        // borrowed mutably, does not alias dy; a grid-stride loop, any grid.
        unsafe { concatenate::bwd(self, elem_cfg(p.outer * p.inner), dy, dx, p.outer, p.inner, p.total, p.offset) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &Concatenate) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(ConcatenateGpu { axis: layer.axis }))
}

/// Concatenate on a GPU: each input copied to its columns of the output
/// (`concatenate_fwd`), each gradient asked for copied back out (`concatenate_bwd`).
pub(super) struct ConcatenateGpu {
    axis: i64,
}

impl ConcatenateGpu {
    /// Each input's place in the output for a batch of `n`, in input order.
    fn parts(&self, place: &Placement, n: usize) -> Result<Vec<Part>> {
        let with_batch = |s: &Shape| Shape::new([&[n][..], s.dims()].concat());
        let shapes: Vec<Shape> = std::iter::once(&place.input).chain(&place.other_inputs).map(with_batch).collect();
        let (_, at) =
            meet(self.axis, &shapes).map_err(|e| Error::shape("Concatenate", format!("{}: {e}", place.name)))?;
        let widths = inners(&shapes, at);
        let outer: usize = shapes[0].dims()[..at].iter().product();
        let total = widths.iter().sum();
        let offsets = widths.iter().scan(0, |at, &w| {
            *at += w;
            Some(*at - w)
        });
        Ok(widths.iter().zip(offsets).map(|(&inner, offset)| Part { outer, inner, total, offset }).collect())
    }
}

impl GpuLayer for ConcatenateGpu {
    // x, others: K tensors (N, ..., A_i, ...) → y: (N, ..., Σ A_i, ...)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let parts = self.parts(f.place, f.n)?;
        for (x, p) in std::iter::once(f.x).chain(f.others.iter().copied()).zip(parts) {
            f.gpu.concatenate_fwd(x, f.y, p)?;
        }
        Ok(())
    }

    // dy: (N, ..., Σ A_i, ...) → each dx_i asked for: (N, ..., A_i, ...)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let parts = self.parts(b.place, b.n)?;
        let Backward { gpu, dy, dx, d_others, .. } = b;
        for (d, p) in std::iter::once(dx).chain(d_others).zip(parts) {
            if let Some(mut d) = d {
                gpu.concatenate_bwd(&dy, &mut d, p)?;
            }
        }
        Ok(())
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/concatenate.cu run on the host against the CPU's [`super::cpu`],
/// bit for bit (copies), three inputs as the GPU form places them, under the launch shape
/// the launches use and under a grid too small to cover the data: rows of several widths
/// (one a single value) over 37 rows, and two inputs of one row each (a join along the
/// first sample axis of a single sample).
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfgs, In, Out, U64};
    use crate::testing::{assert_bits, uniform};
    for (outer, widths) in [(37usize, vec![5usize, 1, 12]), (1, vec![300, 7])] {
        let parts: Vec<Vec<f32>> = widths.iter().enumerate().map(|(i, &w)| uniform(40 + i as u64, outer * w)).collect();
        let total: usize = widths.iter().sum();
        let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
        let want = super::cpu::concat(&refs, &widths);
        for cfg in elem_cfgs(outer * widths[0]) {
            let mut y = vec![f32::NAN; outer * total];
            let mut offset = 0;
            for (x, &inner) in parts.iter().zip(&widths) {
                // As Gpu::concatenate_fwd pushes them: x, y, outer, inner, total, offset.
                let sizes = [outer, inner, total, offset].map(|v| U64(v as u64));
                let mut args = vec![In(x), Out(&mut y)];
                args.extend(sizes);
                k.launch(&concatenate::FWD, cfg, &mut args);
                offset += inner;
            }
            assert_bits(&format!("concatenate y ({outer}, {widths:?}) {cfg:?}"), &y, &want);
            let mut offset = 0;
            for (x, &inner) in parts.iter().zip(&widths) {
                let mut dx = vec![f32::NAN; outer * inner];
                // As Gpu::concatenate_bwd: dy, dx, outer, inner, total, offset.
                let sizes = [outer, inner, total, offset].map(|v| U64(v as u64));
                let mut args = vec![In(&want), Out(&mut dx)];
                args.extend(sizes);
                k.launch(&concatenate::BWD, cfg, &mut args);
                assert_bits(&format!("concatenate dx ({outer}, {inner}) {cfg:?}"), &dx, x);
                offset += inner;
            }
        }
    }
}
