//! The checked launches of kernels/dropout.cu: inverted dropout forward and backward,
//! whose mask is a hash of ([`DropoutKey`], element index), never stored.
//!
//! Owns: [`DropoutKey`] and one safe method per kernel, each checking its buffers and the
//! rate before the typed launch of `cuda::kernels::dropout`. The hash, and so the mask,
//! is the kernel's and the CPU layer's (`nn::dropout`), bit for bit.

use cudarc::driver::CudaViewMut;

use super::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::cuda::kernels::dropout;
use crate::{Error, Result};

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
        unsafe { dropout::dropout::fwd(self, elem_cfg(n), x, y, rate, seed, step, shard, layer, first, n) }
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
        unsafe { dropout::dropout::bwd(self, elem_cfg(n), dy, dx, rate, seed, step, shard, layer, first, n) }
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
