//! Dropout on a GPU: the declaration of kernels/dropout.cu, [`DropoutKey`] (what a mask is a
//! function of) and the checked launches, and the op's GPU form. The mask is a hash of the
//! key and the element's index, never stored: the kernel's and the CPU's, bit for bit.

use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::ops::gpu::{Backward, Draw, Forward, GpuLayer, Pass};
use crate::{Error, Result};
use cudarc::driver::CudaViewMut;

use super::*;

crate::cuda::declare::kernels! {
    "dropout.cu" {
        dropout {
            fwd(x: In, y: Out, rate: F32, seed: U64, step: U64, shard: U64, layer: U64, first: U64, n: Size);
            bwd(dy: In, dx: Out, rate: F32, seed: U64, step: U64, shard: U64, layer: U64, first: U64, n: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

/// What a dropout mask is a function of (DESIGN.md: randomness derives from the seed,
/// the step and the logical replica), plus the layer's index in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropoutKey {
    pub seed: u64,
    pub step: u64,
    /// The shard: the index of the logical replica whose rows the mask covers.
    pub shard: u64,
    pub layer: u64,
    /// Mask index of the buffer's first element (within its logical replica's shard: a
    /// later micro-batch of an accumulated step starts past 0).
    pub first: u64,
}

impl DropoutKey {
    /// The key of layer `layer`'s masks in the pass `draw` describes, whose input has
    /// `per_sample` values per sample.
    pub fn new(draw: &Draw, layer: usize, per_sample: usize) -> DropoutKey {
        DropoutKey {
            seed: draw.seed,
            step: draw.step,
            shard: draw.shard as u64,
            layer: layer as u64,
            first: (draw.sample_offset * per_sample) as u64,
        }
    }
}

/// Checks a dropout launch of `n` elements (its output's length, the rate in [0, 1]);
/// false when there is nothing to launch.
// dst: (n)
fn check_dropout(dst: &CudaViewMut<'_, f32>, n: usize, rate: f32) -> Result<bool> {
    check_len("dropout", "output", dst, n)?;
    if !(0.0..=1.0).contains(&rate) {
        return Err(Error::config("dropout rate", format!("{rate} is outside [0, 1]")));
    }
    Ok(n > 0)
}

impl Gpu {
    /// Inverted dropout; the mask of element i is the hash of (key, key.first + i). x, y: (n)
    pub fn dropout_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, rate: f32, key: DropoutKey) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let n = x.len();
        if !check_dropout(y, n, rate)? {
            return Ok(());
        }
        let DropoutKey { seed, step, shard, layer, first } = key;
        // SAFETY: dropout_fwd_f32(const float*, float*, float, 5 x unsigned long long,
        // size_t); both buffers hold n floats (checked).
        unsafe { dropout::fwd(self, elem_cfg(n), x, y, rate, seed, step, shard, layer, first, n) }
    }

    /// Backward of [`Gpu::dropout_fwd`] with the same `rate` and `key`. dy, dx: (n)
    pub fn dropout_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, rate: f32, key: DropoutKey) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let n = dy.len();
        if !check_dropout(dx, n, rate)? {
            return Ok(());
        }
        let DropoutKey { seed, step, shard, layer, first } = key;
        // SAFETY: dropout_bwd_f32(const float*, float*, float, 5 x unsigned long long,
        // size_t); both buffers hold n floats (checked).
        unsafe { dropout::bwd(self, elem_cfg(n), dy, dx, rate, seed, step, shard, layer, first, n) }
    }
}

// ---- the GPU form -------------------------------------------------------------------

/// The GPU form of `layer` (its `Layer::gpu`).
pub(super) fn form(layer: &Dropout) -> Option<Box<dyn GpuLayer>> {
    Some(Box::new(DropoutGpu { rate: layer.rate }))
}

/// Dropout on a GPU: `dropout_fwd` draws the masks from the pass's [`super::gpu::Draw`]
/// and the layer's index, `dropout_bwd` replays them; evaluation (or rate 0) copies.
pub(super) struct DropoutGpu {
    rate: f32,
}

impl GpuLayer for DropoutGpu {
    // x: (N, ...) → y: same shape
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        match &*f.pass {
            Pass::Train { draw, .. } if self.rate > 0.0 => {
                f.gpu.dropout_fwd(f.x, f.y, self.rate, DropoutKey::new(draw, f.node.index, f.node.input.numel()))
            }
            _ => Ok(f.gpu.stream().memcpy_dtod(f.x, f.y)?),
        }
    }

    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Some(mut dx) = b.dx else { return Ok(()) };
        if self.rate > 0.0 {
            b.gpu.dropout_bwd(&b.dy, &mut dx, self.rate, DropoutKey::new(&b.draw, b.node.index, b.node.input.numel()))
        } else {
            Ok(b.gpu.stream().memcpy_dtod(&b.dy, &mut dx)?)
        }
    }
}
