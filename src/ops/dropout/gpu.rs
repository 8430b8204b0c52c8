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
                f.gpu.dropout_fwd(f.x, f.y, self.rate, DropoutKey::new(draw, f.place.index, f.place.input.numel()))
            }
            _ => Ok(f.gpu.stream().memcpy_dtod(f.x, f.y)?),
        }
    }

    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let Some(mut dx) = b.dx else { return Ok(()) };
        if self.rate > 0.0 {
            b.gpu.dropout_bwd(&b.dy, &mut dx, self.rate, DropoutKey::new(&b.draw, b.place.index, b.place.input.numel()))
        } else {
            Ok(b.gpu.stream().memcpy_dtod(&b.dy, &mut dx)?)
        }
    }
}

// ---- on the host ------------------------------------------------------------------------

/// The kernels of kernels/dropout.cu run on the host against the CPU's [`super::cpu`], bit
/// for bit (one mask from the same integer hash, one f32 multiply by the same f32 factor),
/// under the launch shape the launches use and under a grid too small to cover the data:
/// a mask of its own for another step, logical replica or layer; rates 0 and 1, which the
/// launches accept; and a later micro-batch of an accumulated step, whose masks are the
/// whole shard's rows, as the layer draws them at its sample offset.
#[cfg(test)]
pub(crate) fn host_check(k: &crate::cuda::host::Checker) {
    use crate::cuda::host::{elem_cfg, elem_cfgs, Arg, In, Out, F32, U64};
    use crate::ops::{Ctx, Layer, Params, ParamsMut};
    use crate::rng::dropout_key;
    use crate::tensor::{Device, Tensor};
    use crate::testing::{assert_bits, uniform};
    let (n, f) = (4000, 100);
    let x: Vec<f32> = uniform(10, n).iter().map(|v| v + 2.0).collect(); // never 0, so drops are visible
    let dy = uniform(11, n);
    let (seed, step, shard, layer) = (42u64, 7u64, 1u64, 3u64);
    let rate = 0.3f32;
    // The CPU's mask of a buffer of `len` values from element `first` of the shard, at
    // `rate`, for (step, shard, layer); and `v` times it.
    let mask = |len: usize, rate: f32, (step, shard, layer): (u64, u64, u64), first: u64| {
        let mut m = vec![f32::NAN; len];
        super::cpu::dropout_mask(&mut m, rate, dropout_key(seed, step, shard, layer), first);
        m
    };
    let times = |v: &[f32], m: &[f32]| {
        let mut v = v.to_vec();
        super::cpu::dropout_forward(&mut v, m);
        v
    };
    // As Gpu::dropout_fwd and dropout_bwd push them: src, dst, rate, seed, step, shard,
    // layer, first, n.
    fn args<'a>(
        src: &'a [f32],
        dst: &'a mut [f32],
        rate: f32,
        seed: u64,
        at: (u64, u64, u64),
        first: u64,
    ) -> Vec<Arg<'a>> {
        let (n, (step, shard, layer)) = (src.len() as u64, at);
        let key = [U64(seed), U64(step), U64(shard), U64(layer), U64(first), U64(n)];
        [In(src), Out(dst), F32(rate)].into_iter().chain(key).collect()
    }
    let at = (step, shard, layer);
    let m = mask(n, rate, at, 0);
    let want_y = times(&x, &m);
    let mut want_dx = dy.clone();
    super::cpu::dropout_backward(&mut want_dx, &m);
    for cfg in elem_cfgs(n) {
        let (mut y, mut dx) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        k.launch(&dropout::FWD, cfg, &mut args(&x, &mut y, rate, seed, at, 0));
        k.launch(&dropout::BWD, cfg, &mut args(&dy, &mut dx, rate, seed, at, 0));
        assert_bits(&format!("dropout y {cfg:?}"), &y, &want_y);
        assert_bits(&format!("dropout dx {cfg:?}"), &dx, &want_dx);
    }
    // A mask, not a copy: Binomial(4000, 0.7) kept, sd 29, so ±4 sd is 0.7 ± 0.029.
    let kept = m.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
    assert!((kept - 0.7).abs() < 0.029, "kept fraction {kept}");

    // Another step, logical replica or layer: another mask.
    for other in [(step + 1, shard, layer), (step, shard + 1, layer), (step, shard, layer + 1)] {
        let mut y = vec![f32::NAN; n];
        k.launch(&dropout::FWD, elem_cfg(n), &mut args(&x, &mut y, rate, seed, other, 0));
        assert_bits(&format!("dropout y at {other:?}"), &y, &times(&x, &mask(n, rate, other, 0)));
        assert_ne!(y, want_y, "{other:?}");
    }
    // Rates 0 and 1: all kept, unscaled; all dropped, to dy·0 (so −0 for a negative dy),
    // never NaN although 1/(1 − rate) is infinite.
    for (r, want) in [(0.0f32, dy.clone()), (1.0, dy.iter().map(|v| v * 0.0).collect())] {
        let mut dx = vec![f32::NAN; n];
        k.launch(&dropout::BWD, elem_cfg(n), &mut args(&dy, &mut dx, r, seed, at, 0));
        assert_bits(&format!("dropout dx at rate {r}"), &dx, &want);
        assert_bits(&format!("the CPU's dx at rate {r}"), &times(&dy, &mask(n, r, at, 0)), &want);
    }
    // A later micro-batch of an accumulated step: rows 25..40 of the shard (first = 25·F)
    // get the whole shard's masks of those rows, which the layer draws at sample offset 25.
    let (from, rows) = (25usize, 15usize);
    let part = &x[from * f..(from + rows) * f];
    let first = (from * f) as u64;
    let mut y = vec![f32::NAN; rows * f];
    k.launch(&dropout::FWD, elem_cfg(rows * f), &mut args(part, &mut y, rate, seed, at, first));
    assert_bits("dropout of a later micro-batch vs the whole shard's rows", &y, &want_y[from * f..(from + rows) * f]);
    let ctx = Ctx {
        layer_index: layer as usize,
        sample_offset: from,
        ..Ctx::train(seed, step, shard as usize, Device::Cpu(0))
    };
    let layer_y = Dropout::new(rate)
        .unwrap()
        .forward(
            Tensor::from_vec(part.to_vec(), [rows, f]).unwrap(),
            Params::new(&[], &[]),
            ParamsMut::new(&mut [], &[]),
            &ctx,
        )
        .unwrap();
    assert_bits("dropout of a later micro-batch vs the layer at its offset", &y, layer_y.host());
}

// ---- on a GPU ---------------------------------------------------------------------------

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::ops::dropout::cpu;
    use crate::rng::dropout_key;
    use crate::testing::{assert_bits, uniform};

    /// The kernels on a GPU against the CPU's [`cpu`], bit for bit: the mask is the
    /// documented hash, the backward replays the forward's, and another logical replica gets
    /// another mask.
    #[test]
    fn dropout_on_a_gpu_is_the_cpus_bit_for_bit() {
        if !crate::ops::conformance::gpu_or_skip("dropout_on_a_gpu_is_the_cpus_bit_for_bit") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let s = gpu.stream();
        let n = 10_000;
        let rate = 0.3f32;
        let key = DropoutKey { seed: 42, step: 7, shard: 1, layer: 3, first: 0 };
        let x: Vec<f32> = uniform(9, n).iter().map(|v| v + 2.0).collect(); // never 0, so drops are visible
        let dy = uniform(10, n);
        let mut mask = vec![0.0; n];
        cpu::dropout_mask(&mut mask, rate, dropout_key(key.seed, key.step, key.shard, key.layer), key.first);
        let (mut want_y, mut want_dx) = (x.clone(), dy.clone());
        cpu::dropout_forward(&mut want_y, &mask);
        cpu::dropout_backward(&mut want_dx, &mask);
        let (x_d, dy_d) = (s.clone_htod(&x).unwrap(), s.clone_htod(&dy).unwrap());
        let (mut y_d, mut dx_d) = (s.alloc_zeros::<f32>(n).unwrap(), s.alloc_zeros::<f32>(n).unwrap());
        gpu.dropout_fwd(&x_d, &mut y_d, rate, key).unwrap();
        gpu.dropout_bwd(&dy_d, &mut dx_d, rate, key).unwrap();
        let y = s.clone_dtoh(&y_d).unwrap();
        assert_bits("dropout y", &y, &want_y);
        assert_bits("dropout dx", &s.clone_dtoh(&dx_d).unwrap(), &want_dx);
        // Binomial(10000, 0.7) kept: sd 46, so ±4 sd is 0.7 ± 0.0184.
        let kept = mask.iter().filter(|&&m| m != 0.0).count() as f64 / n as f64;
        assert!((kept - 0.7).abs() < 0.0184, "kept fraction {kept}");
        gpu.dropout_fwd(&x_d, &mut y_d, rate, DropoutKey { shard: 2, ..key }).unwrap();
        assert_ne!(s.clone_dtoh(&y_d).unwrap(), y, "another logical replica, another mask");
    }
}
