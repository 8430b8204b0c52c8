//! Rotary position embeddings on a GPU: the declaration of kernels/rotary_embedding.cu, its
//! checked launches, the op's GPU form (the CPU's table, [`super::cpu::rope_table`],
//! uploaded once for the layer's shape), and the check of the kernels on the host against
//! the CPU's, bit for bit.

use crate::cuda::launch::{check_len, dim, elem_cfg, DevIn, DevOut};
use crate::cuda::Gpu;
use crate::ops::gpu::{Backward, Forward, GpuLayer, Placement};
use crate::{Error, Result};
use cudarc::driver::CudaSlice;

use super::RotaryEmbedding;

crate::cuda::declare::kernels! {
    "rotary_embedding.cu" {
        rotary_embedding {
            fwd(x: In, y: Out, cos_t: In, sin_t: In, pairs: Size, t: I32, heads: I32, half: I32);
            bwd(dy: In, dx: Out, cos_t: In, sin_t: In, pairs: Size, t: I32, heads: I32, half: I32);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

/// The layout of one launch: N samples of T positions of H heads of width D (even).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeGeom {
    pub n: usize,
    pub t: usize,
    pub heads: usize,
    pub hd: usize,
}

impl RopeGeom {
    /// Values of x (or y): N·T·H·D.
    fn len(&self) -> usize {
        self.n * self.t * self.heads * self.hd
    }

    /// The pairs, the table's length (T·D/2), and T, H, D/2 as the kernels' ints.
    fn args(&self, op: &'static str) -> Result<(usize, usize, [i32; 3])> {
        if !self.hd.is_multiple_of(2) {
            return Err(Error::shape(op, format!("the head width D = {} is odd", self.hd)));
        }
        let half = self.hd / 2;
        Ok((self.len() / 2, self.t * half, [dim(op, "T", self.t)?, dim(op, "H", self.heads)?, dim(op, "D/2", half)?]))
    }
}

impl Gpu {
    /// y = each pair of x turned by its position's angle. x, y: (N, T, H, D); cos, sin:
    /// (T, D/2)
    pub fn rotary_embedding_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        cos: &impl DevIn,
        sin: &impl DevIn,
        g: RopeGeom,
    ) -> Result<()> {
        let (x, cos, sin) = (&x.view(), &cos.view(), &sin.view());
        let y = &mut y.view_mut();
        let op = "rotary_embedding_fwd";
        let (pairs, table, [t, heads, half]) = g.args(op)?;
        check_len(op, "x", x, g.len())?;
        check_len(op, "y", y, g.len())?;
        check_len(op, "cos", cos, table)?;
        check_len(op, "sin", sin, table)?;
        if pairs == 0 {
            return Ok(());
        }
        // SAFETY: rotary_embedding_fwd_f32(const float* x, float* y, const float* cos,
        // const float* sin, size_t pairs, int t, int heads, int half); x and y hold
        // 2·pairs floats, cos and sin T·half (checked), and the kernel reads pair e's two
        // values and table entry ((e / half / H) mod T, e mod half) for e < pairs only.
        unsafe { rotary_embedding::fwd(self, elem_cfg(pairs), x, y, cos, sin, pairs, t, heads, half) }
    }

    /// dx = each pair of dy turned back by its position's angle. dy, dx: (N, T, H, D);
    /// cos, sin: (T, D/2), the forward's.
    pub fn rotary_embedding_bwd(
        &self,
        dy: &impl DevIn,
        dx: &mut impl DevOut,
        cos: &impl DevIn,
        sin: &impl DevIn,
        g: RopeGeom,
    ) -> Result<()> {
        let (dy, cos, sin) = (&dy.view(), &cos.view(), &sin.view());
        let dx = &mut dx.view_mut();
        let op = "rotary_embedding_bwd";
        let (pairs, table, [t, heads, half]) = g.args(op)?;
        check_len(op, "dy", dy, g.len())?;
        check_len(op, "dx", dx, g.len())?;
        check_len(op, "cos", cos, table)?;
        check_len(op, "sin", sin, table)?;
        if pairs == 0 {
            return Ok(());
        }
        // SAFETY: rotary_embedding_bwd_f32, the forward's arguments with dy for x and dx
        // for y; the same lengths (checked), the same indices.
        unsafe { rotary_embedding::bwd(self, elem_cfg(pairs), dy, dx, cos, sin, pairs, t, heads, half) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &RotaryEmbedding) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(RotaryGpu { base: layer.base, start: layer.start, table: None }))
}

/// Rotary embeddings on a GPU: the table made on the host by the CPU's function and
/// uploaded by `reserve`, then one launch a pass.
struct RotaryGpu {
    base: f32,
    start: usize,
    /// cos and sin, (T, D/2) each, for the layer's per-sample input.
    table: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
}

/// (T, H, D) of a place's per-sample input.
fn place_thd(place: &Placement) -> Result<(usize, usize, usize)> {
    match place.input.dims() {
        &[t, h, d] => Ok((t, h, d)),
        _ => Err(Error::shape("RotaryEmbedding", format!("{}: input {} is not (T, H, D)", place.name, place.input))),
    }
}

impl GpuLayer for RotaryGpu {
    fn reserve(&mut self, gpu: &Gpu, place: &Placement, _n: usize) -> Result<()> {
        if self.table.is_none() {
            let (t, _, d) = place_thd(place)?;
            let (cos, sin) = super::cpu::rope_table(t, d, self.base, self.start);
            let stream = gpu.stream();
            let upload = |v: &[f32]| if v.is_empty() { stream.alloc_zeros(1) } else { stream.clone_htod(v) };
            self.table = Some((upload(&cos)?, upload(&sin)?));
        }
        Ok(())
    }

    // x: (N, T, H, D) → y: (N, T, H, D)
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        let (t, heads, hd) = place_thd(f.place)?;
        let Some((cos, sin)) = self.table.as_ref() else { unreachable!("reserved before the pass") };
        let half = t * (hd / 2);
        f.gpu.rotary_embedding_fwd(f.x, f.y, &cos.slice(..half), &sin.slice(..half), RopeGeom { n: f.n, t, heads, hd })
    }

    // dy: (N, T, H, D) → dx: (N, T, H, D)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let (t, heads, hd) = place_thd(b.place)?;
        let Some((cos, sin)) = self.table.as_ref() else { unreachable!("reserved before the pass") };
        let half = t * (hd / 2);
        match b.dx {
            Some(mut dx) => {
                let g = RopeGeom { n: b.n, t, heads, hd };
                b.gpu.rotary_embedding_bwd(&b.dy, &mut dx, &cos.slice(..half), &sin.slice(..half), g)
            }
            None => Ok(()),
        }
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/rotary_embedding.cu run on the host against the CPU's
/// [`super::cpu`], bit for bit (two products and a sum, each rounded, on both sides): a
/// batch of 3 samples of (T, H, D) = (5, 3, 8) from position 2 (positions differ by sample
/// index and pair), with ±0, ±∞ and NaN among the values, under the launch shape the
/// launches use and under a grid too small to cover the pairs.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use super::cpu::{rope_backward, rope_forward, rope_table};
    use crate::cuda::host::{elem_cfgs, In, Out, I32, U64};
    use crate::testing::{assert_same, uniform};
    let (n, t, heads, hd) = (3usize, 5usize, 3usize, 8usize);
    let len = n * t * heads * hd;
    let (cos, sin) = rope_table(t, hd, 10_000.0, 2);
    let mut x: Vec<f32> = uniform(0x707e, len).iter().map(|v| 3.0 * v).collect();
    x[..6].copy_from_slice(&[0.0, -0.0, f32::NAN, 1.0, f32::INFINITY, f32::NEG_INFINITY]);
    let dy = uniform(0x707f, len);
    let (mut want_y, mut want_dx) = (x.clone(), dy.clone());
    rope_forward(&mut want_y, &cos, &sin, (t, heads, hd));
    rope_backward(&mut want_dx, &cos, &sin, (t, heads, hd));
    let pairs = len / 2;
    for cfg in elem_cfgs(pairs) {
        let (mut y, mut dx) = (vec![f32::NAN; len], vec![f32::NAN; len]);
        // As Gpu::rotary_embedding_fwd pushes them: x, y, cos, sin, pairs, t, heads, half;
        // Gpu::rotary_embedding_bwd: dy, dx, cos, sin, pairs, t, heads, half.
        let (p, ti, h, half) = (U64(pairs as u64), I32(t as i32), I32(heads as i32), I32(hd as i32 / 2));
        k.launch(&rotary_embedding::FWD, cfg, &mut [In(&x), Out(&mut y), In(&cos), In(&sin), p, ti, h, half]);
        let (p, ti, h, half) = (U64(pairs as u64), I32(t as i32), I32(heads as i32), I32(hd as i32 / 2));
        k.launch(&rotary_embedding::BWD, cfg, &mut [In(&dy), Out(&mut dx), In(&cos), In(&sin), p, ti, h, half]);
        // A NaN's payload may differ (`assert_same`'s docs); every other value bit for bit.
        assert_same(&format!("rotary_embedding y {cfg:?}"), &y, &want_y);
        assert_same(&format!("rotary_embedding dx {cfg:?}"), &dx, &want_dx);
    }
}
