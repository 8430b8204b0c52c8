//! Every layer's backward against central finite differences of its forward.
//!
//! This file owns the gradient checks; forward values against hand-derived numbers live
//! in `tests/layers.rs`, and whole training runs against PyTorch in `tests/oracle.rs`.
//!
//! # How the input gradient is observed
//! `Sequential::backward` returns no input gradient, and `Params` cannot be built outside
//! the crate, so the layer under test runs inside a `Sequential` behind an [`InputProbe`]:
//! a test-only layer (the `Layer` trait is public) whose single parameter IS the input
//! batch, y = x + p, fed with x = 0. Its parameter gradient is exactly the dx that the
//! layer under test returned, and perturbing that parameter perturbs the input. So one
//! loop over the flat parameter vector checks dx and every dparam alike.
//!
//! # Objective and finite differences
//! L = Σ_i w_i·y_i with fixed random w, so dL/dy = w is the `dout` given to backward.
//! Each checked value θ is perturbed to fl32(θ ± h), the f32 forward is run (in f32)
//! and L is summed in f64; the derivative estimate is (L₊ − L₋)/(θ₊ − θ₋) with the
//! step actually taken after rounding θ ± h to f32. Every evaluation gets a fresh copy
//! of the buffers, so BatchNorm's running-stat update in `Mode::Train` cannot leak from
//! one evaluation into the next, and the same `Ctx`, so dropout draws the same mask.
//!
//! # Tolerance
//! A value passes when |analytic − numeric| ≤ atol + rtol·max(|analytic|, |numeric|).
//! Per layer: rtol 1e-2, atol 1e-3 with h = 1e-2. The layers that are linear in the
//! checked value (Linear, Conv2d, Rescaling, GAP, Flatten, Dropout, ReLU away from its
//! kink, MaxPool2d away from a tie) have no truncation error, only the f32 rounding of
//! the forward: about
//! 2^-24·Σ|w·y| ≈ 1e-6 in L, ÷ 2h → ~1e-4, well inside atol. BatchNorm is smooth
//! with truncation error h²/6·|L'''| ≈ 1e-5 for unit-variance inputs. The whole convnet
//! uses h = 1e-2 on inputs in pixel units (0..255, then ×1/255) and h = 1e-4 on
//! weights; with BatchNorm its tolerance is doubled, for the reason given there. The
//! toy MLP (h = 1e-2) skips the few points whose step straddles a ReLU kink, found by
//! one-sided slopes that disagree, and fails if more than 10 of its 760 are skipped.
//!
//! # The accumulation contract
//! Each check also runs backward into a gradient buffer pre-filled with random values
//! and asserts the result is that buffer plus the gradient from a zeroed one (within
//! one f32 rounding), i.e. backward adds (`+=`) and never overwrites.

mod common;

use lockstep::models::{self, ConvnetOptions, Norm};
use lockstep::nn::{
    BatchNorm2d, Conv2d, Ctx, Dropout, Flatten, Gelu, GlobalAvgPool2d, Graph, Init, InputGrad, Layer, LayerNorm,
    Linear, MaxPool2d, Padding, ParamSpec, Params, ParamsMut, Relu, Rescaling, Sequential,
};
use lockstep::{Device, Error, Result, Shape, Tensor};

use common::Rng;

/// y = x + p, p the whole input batch (N·sample values, flattened): its gradient is the
/// gradient of the following layer's input. Fed with x = 0.
struct InputProbe {
    numel: usize,
}

impl Layer for InputProbe {
    fn kind(&self) -> &'static str {
        "probe"
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        Ok(input.clone())
    }

    fn params(&self) -> Vec<ParamSpec> {
        vec![ParamSpec { name: "x".into(), shape: Shape::new([self.numel]), init: Init::Zeros }]
    }

    // x: any shape with `numel` values → y: same shape
    fn forward(&mut self, mut x: Tensor, params: Params<'_>, _b: ParamsMut<'_>, _ctx: &Ctx) -> Result<Tensor> {
        if x.numel() != self.numel {
            return Err(Error::shape("InputProbe", format!("{} for {} probe values", x.shape(), self.numel)));
        }
        for (v, p) in x.host_mut().iter_mut().zip(params.get(0)) {
            *v += p;
        }
        Ok(x)
    }

    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        mut dparams: ParamsMut<'_>,
        _input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        for (g, d) in dparams.get(0).iter_mut().zip(dout.host()) {
            *g += d;
        }
        Ok(None)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(InputProbe { numel: self.numel })
    }

    fn describe(&self) -> String {
        format!("InputProbe({})", self.numel)
    }
}

/// The inputs' generator (tests/common) is SplitMix64, the stream the library's own
/// generator gives for the same seed: the first outputs of the C reference implementation
/// (Vigna's splitmix64.c) seeded with 0, and with 1234567 from this Python transcription:
///   s = (s + 0x9E3779B97F4A7C15) % 2**64; z = s
///   z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
///   z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64; out = z ^ (z >> 31)
#[test]
fn the_input_generator_is_splitmix64() {
    let mut g = Rng(0);
    assert_eq!([g.next_u64(), g.next_u64()], [0xE220_A839_7B1D_CDAF, 0x6E78_9E6A_A1B9_65F4]);
    let mut g = Rng(1234567);
    assert_eq!(
        [g.next_u64(), g.next_u64(), g.next_u64()],
        [6457827717110365317, 3203168211198807973, 9817491932198370423]
    );
}

/// Uniform in [lo, hi).
fn uniform(g: &mut Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| lo + (hi - lo) * g.next_f32()).collect()
}

/// Values with |v| in [0.1, 1] and a random sign: at least 10·h away from ReLU's kink.
fn away_from_zero(g: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| (0.1 + 0.9 * g.next_f32()) * if g.next_u64() & 1 == 0 { 1.0 } else { -1.0 }).collect()
}

/// Steps and tolerances of one check (see the file docs for the reasoning).
#[derive(Clone, Copy)]
struct Tol {
    /// Finite-difference step for the input (probe) values.
    h_input: f64,
    /// Finite-difference step for the parameters of the model.
    h_param: f64,
    rtol: f64,
    atol: f64,
    /// How many checked points may be skipped because the step straddles a ReLU kink
    /// (0: no kink detection, every point is compared).
    max_kinks: usize,
}

const LAYER_TOL: Tol = Tol { h_input: 1e-2, h_param: 1e-2, rtol: 1e-2, atol: 1e-3, max_kinks: 0 };

struct Model {
    net: Graph,
    /// Flat parameters: the probe's (the input batch) first, then the model's.
    params: Vec<f32>,
    buffers: Vec<f32>,
    /// The zeros fed to the probe: (N, *sample).
    zeros: Tensor,
    /// Weights of the objective, shaped like the output.
    w: Vec<f32>,
    ctx: Ctx<'static>,
}

impl Model {
    /// L = Σ w·y, the forward in f32 and the sum in f64, on fresh buffers.
    fn objective(&mut self, params: &[f32]) -> f64 {
        let mut buffers = self.buffers.clone();
        let y = self.net.forward(self.zeros.clone(), params, &mut buffers, &self.ctx).unwrap();
        assert_eq!(y.numel(), self.w.len());
        y.host().iter().zip(&self.w).map(|(&y, &w)| y as f64 * w as f64).sum()
    }

    /// The analytic gradient of L with respect to every flat parameter, accumulated into
    /// `start` (a copy of it is returned).
    fn analytic(&mut self, start: &[f32]) -> Vec<f32> {
        let mut buffers = self.buffers.clone();
        let y = self.net.forward(self.zeros.clone(), &self.params, &mut buffers, &self.ctx).unwrap();
        let dout = Tensor::from_vec(self.w.clone(), y.shape().clone()).unwrap();
        let mut grads = start.to_vec();
        self.net.backward(dout, &self.params, &mut grads, &self.ctx).unwrap();
        grads
    }
}

/// Builds [probe, layers...] for inputs `x` of shape (N, *sample), with the model's
/// parameters set from `model_params` (its tensors' values one after another, as
/// [`packed`] lists them; random in [−1, 1) when `None`) and random w. The flat layout
/// starts each tensor on a multiple of `nn::TENSOR_ALIGN`, so the values are placed
/// tensor by tensor; the gaps stay zero.
fn build(
    sample: &[usize],
    x: Vec<f32>,
    layers: Vec<Box<dyn Layer>>,
    model_params: Option<Vec<f32>>,
    ctx: Ctx<'static>,
    seed: u64,
) -> Model {
    let n_in = x.len();
    let mut all: Vec<Box<dyn Layer>> = vec![Box::new(InputProbe { numel: n_in })];
    all.extend(layers);
    let mut net = Sequential::new(sample.to_vec(), all).unwrap();
    let mut g = Rng(seed);
    let store = net.init(seed);
    let (probe, model) = net.param_infos().split_first().expect("the probe's tensor comes first");
    let n_model: usize = model.iter().map(|t| t.range.len()).sum();
    let values = model_params.unwrap_or_else(|| uniform(&mut g, n_model, -1.0, 1.0));
    assert_eq!(values.len(), n_model, "model parameters do not fit the layout");
    let mut params = vec![0.0f32; store.params.len()];
    params[probe.range.clone()].copy_from_slice(&x);
    let mut rest = values.as_slice();
    for t in model {
        let (v, r) = rest.split_at(t.range.len());
        params[t.range.clone()].copy_from_slice(v);
        rest = r;
    }
    let batch = n_in / sample.iter().product::<usize>();
    let mut dims = vec![batch];
    dims.extend_from_slice(sample);
    let zeros = Tensor::zeros(dims, ctx.device);
    let out = net.forward(zeros.clone(), &params, &mut store.buffers.clone(), &ctx).unwrap();
    let w = uniform(&mut g, out.numel(), -1.0, 1.0);
    Model { net, params, buffers: store.buffers, zeros, w, ctx }
}

/// The values of `net`'s parameter tensors in `flat`, one tensor after another (without
/// the gaps of the flat layout): what [`build`] takes as `model_params`.
fn packed(net: &Graph, flat: &[f32]) -> Vec<f32> {
    net.param_infos().iter().flat_map(|t| flat[t.range.clone()].iter().copied()).collect()
}

/// Checks the listed flat indices (None: every value of every tensor) and the
/// accumulation contract (over the whole flat buffer, gaps included).
/// Returns the analytic gradient (from zero) for further assertions.
fn check(name: &str, m: &mut Model, tol: Tol, indices: Option<Vec<usize>>) -> Vec<f32> {
    let n_input = m.zeros.numel();
    let zero = vec![0.0f32; m.params.len()];
    let analytic = m.analytic(&zero);

    // Accumulation: backward into random g0 gives g0 + analytic (one f32 rounding: the
    // sum of two values ≤ 2^-24 relative, 2e-6 with margin for BatchNorm's f64→f32 sums).
    let g0 = uniform(&mut Rng(99), m.params.len(), -1.0, 1.0);
    let accumulated = m.analytic(&g0);
    for (i, ((&acc, &a), &s)) in accumulated.iter().zip(&analytic).zip(&g0).enumerate() {
        let want = s + a;
        assert!(
            (acc - want).abs() <= 2e-6 * (1.0 + want.abs()),
            "{name}: backward did not accumulate at flat index {i}: got {acc}, want {s} + {a}"
        );
    }

    let indices = indices.unwrap_or_else(|| m.net.param_infos().iter().flat_map(|t| t.range.clone()).collect());
    let infos = m.net.param_infos().to_vec();
    let l0 = if tol.max_kinks > 0 { m.objective(&m.params.clone()) } else { f64::NAN };
    let (mut worst, mut kinks) = ((0.0f64, 0usize), Vec::new());
    let mut params = m.params.clone();
    for &i in &indices {
        let h = if i < n_input { tol.h_input } else { tol.h_param };
        let theta = m.params[i];
        let (plus, minus) = ((theta as f64 + h) as f32, (theta as f64 - h) as f32);
        params[i] = plus;
        let lp = m.objective(&params);
        params[i] = minus;
        let lm = m.objective(&params);
        params[i] = theta;
        let which = infos.iter().find(|t| t.range.contains(&i)).expect("every index is in a tensor");
        let label =
            format!("d{}[{}]", if which.name == "probe0.x" { "x" } else { which.name.as_str() }, i - which.range.start);
        if tol.max_kinks > 0 {
            // One-sided slopes that disagree mean the step straddles a ReLU kink: there
            // the central difference is not the derivative, so the point is not compared.
            let fwd = (lp - l0) / (plus as f64 - theta as f64);
            let bwd = (l0 - lm) / (theta as f64 - minus as f64);
            if (fwd - bwd).abs() > tol.atol + tol.rtol * fwd.abs().max(bwd.abs()) {
                kinks.push(format!("{label} (one-sided slopes {fwd:.4} / {bwd:.4})"));
                continue;
            }
        }
        let numeric = (lp - lm) / (plus as f64 - minus as f64);
        let a = analytic[i] as f64;
        let err = (a - numeric).abs();
        let bound = tol.atol + tol.rtol * a.abs().max(numeric.abs());
        assert!(
            err <= bound,
            "{name}: {label}: analytic {a}, finite difference {numeric} (|Δ| {err:.3e} > {bound:.3e})"
        );
        if err / bound > worst.0 {
            worst = (err / bound, i);
        }
    }
    eprintln!(
        "{name}: {} values compared, worst |Δ|/bound {:.3} at flat index {}; {} skipped at kinks: {kinks:?}",
        indices.len() - kinks.len(),
        worst.0,
        worst.1,
        kinks.len()
    );
    assert!(
        kinks.len() <= tol.max_kinks,
        "{name}: {} of {} points straddle a kink (at most {} allowed): {kinks:?}",
        kinks.len(),
        indices.len(),
        tol.max_kinks
    );
    analytic
}

fn train_ctx() -> Ctx<'static> {
    Ctx::train(7, 3, 1, Device::Cpu(0))
}

/// A one-layer check on random inputs in [−1, 1) and random parameters.
fn check_layer(name: &str, dims: &[usize], layer: Box<dyn Layer>, seed: u64) -> Vec<f32> {
    let mut g = Rng(seed);
    let x = uniform(&mut g, dims.iter().product(), -1.0, 1.0);
    let mut m = build(&dims[1..], x, vec![layer], None, train_ctx(), seed + 1);
    check(name, &mut m, LAYER_TOL, None)
}

#[test]
fn linear_with_and_without_bias() {
    // x: (3, 4) → y: (3, 5)
    let with = check_layer("Linear(4→5)", &[3, 4], Box::new(Linear::new(4, 5)), 1);
    // probe 12 at 0, weight 20 at 64, bias 5 at 128 (each tensor starts on a multiple of
    // nn::TENSOR_ALIGN = 64): the flat buffer ends at 133, padded to 192 = 3 · 64.
    assert_eq!(with.len(), 192);
    let without = check_layer("Linear(4→5, no bias)", &[3, 4], Box::new(Linear::new(4, 5).without_bias()), 2);
    // probe at 0, weight at 64..84: padded to 128.
    assert_eq!(without.len(), 128);
}

#[test]
fn conv2d_valid_stride_1_non_square_kernel_with_bias() {
    // x: (2, 2, 5, 6), kernel 3×2 → y: (2, 3, 3, 5)
    let conv = Conv2d::new(2, 3, (3, 2), 1, Padding::Valid, true).unwrap();
    check_layer("Conv2d valid s1 3x2 bias", &[2, 2, 5, 6], Box::new(conv), 3);
}

#[test]
fn conv2d_valid_stride_2_leaves_unused_rows_without_gradient() {
    // x: (1, 1, 8, 8), k 3, s 2: OH = ⌊(8 − 3)/2⌋ + 1 = 3 reads rows 0..=6 only, so row 7
    // and column 7 of dx are exactly 0. y: (1, 2, 3, 3)
    let conv = Conv2d::new(1, 2, (3, 3), 2, Padding::Valid, false).unwrap();
    let g = check_layer("Conv2d valid s2 no bias", &[1, 1, 8, 8], Box::new(conv), 4);
    let dx = &g[..64];
    for i in 0..8 {
        assert_eq!(dx[7 * 8 + i], 0.0, "row 7 is never read");
        assert_eq!(dx[i * 8 + 7], 0.0, "column 7 is never read");
    }
    assert!(dx[..7].iter().any(|&v| v != 0.0), "the read rows do get a gradient");
}

#[test]
fn conv2d_same_stride_1_asymmetric_padding() {
    // H = 5, KH = 4, s = 1: pad_total = 4 + 4 − 5 = 3 → 1 above, 2 below.
    // W = 6, KW = 3: pad_total = 5 + 3 − 6 = 2 → 1 / 1. x: (2, 2, 5, 6) → y: (2, 2, 5, 6)
    let conv = Conv2d::new(2, 2, (4, 3), 1, Padding::Same, false).unwrap();
    check_layer("Conv2d same s1 4x3 asymmetric", &[2, 2, 5, 6], Box::new(conv), 5);
}

#[test]
fn conv2d_same_stride_2_asymmetric_padding_with_bias() {
    // H = 6, K = 3, s = 2: OH = 3, pad_total = 4 + 3 − 6 = 1 → 0 above, 1 below.
    // W = 7: OW = 4, pad_total = 6 + 3 − 7 = 2 → 1 / 1. x: (2, 3, 6, 7) → y: (2, 2, 3, 4)
    let conv = Conv2d::new(3, 2, (3, 3), 2, Padding::Same, true).unwrap();
    check_layer("Conv2d same s2 asymmetric bias", &[2, 3, 6, 7], Box::new(conv), 6);
}

#[test]
fn batchnorm_train_every_scale_center_combination() {
    // x: (3, 2, 3, 2): 18 values per channel. Inputs get a per-channel offset and spread
    // so the statistics are not those of U(−1, 1) in both channels.
    for (k, (scale, center)) in [(true, true), (true, false), (false, true), (false, false)].into_iter().enumerate() {
        let mut g = Rng(10 + k as u64);
        let mut x = uniform(&mut g, 3 * 2 * 3 * 2, -1.0, 1.0);
        for (i, v) in x.iter_mut().enumerate() {
            let ch = (i / 6) % 2;
            *v = *v * [1.0, 2.5][ch] + [0.3, -1.2][ch];
        }
        let bn = BatchNorm2d::new(2).scale(scale).center(center);
        // γ random in [0.5, 1.5) so it is far from 0; β in [−1, 1).
        let mut params = Vec::new();
        if scale {
            params.extend(uniform(&mut g, 2, 0.5, 1.5));
        }
        if center {
            params.extend(uniform(&mut g, 2, -1.0, 1.0));
        }
        let mut m = build(&[2, 3, 2], x, vec![Box::new(bn)], Some(params), train_ctx(), 20 + k as u64);
        let name = format!("BatchNorm2d(scale {scale}, center {center})");
        let grad = check(&name, &mut m, LAYER_TOL, None);
        // dx of a batch-normalised channel sums to 0 over (N, H, W): the mean is removed.
        for ch in 0..2 {
            let s: f32 = (0..3).flat_map(|n| (0..6).map(move |j| (n * 2 + ch) * 6 + j)).map(|i| grad[i]).sum();
            assert!(s.abs() < 1e-5, "{name}: Σ dx over channel {ch} is {s}, want 0 (± 1e-5, f32 rounding)");
        }
    }
}

#[test]
fn relu_away_from_the_kink() {
    for (k, dims) in [vec![3usize, 7], vec![2, 2, 3, 2]].into_iter().enumerate() {
        let mut g = Rng(30 + k as u64);
        let x = away_from_zero(&mut g, dims.iter().product());
        let mut m = build(&dims[1..], x.clone(), vec![Box::new(Relu::new())], None, train_ctx(), 40 + k as u64);
        let grad = check(&format!("ReLU {dims:?}"), &mut m, LAYER_TOL, None);
        // The gradient is w where x > 0 and exactly 0 elsewhere.
        for ((&d, &v), &w) in grad.iter().zip(&x).zip(&m.w) {
            assert_eq!(d, if v > 0.0 { w } else { 0.0 });
        }
    }
}

#[test]
fn gelu_over_both_tails_and_the_middle() {
    // Inputs in [−4, 4), where the curve bends: max |GELU‴| = 0.78 (near x = ±0.79, by mpmath), so
    // the central difference's truncation error h²/6·|w·GELU‴| ≤ 1.3e-5, inside LAYER_TOL's
    // atol of 1e-3; on a flat (3, 7) and an image-shaped (2, 2, 3, 2) input.
    for (k, dims) in [vec![3usize, 7], vec![2, 2, 3, 2]].into_iter().enumerate() {
        let mut g = Rng(60 + k as u64);
        let x = uniform(&mut g, dims.iter().product(), -4.0, 4.0);
        let mut m = build(&dims[1..], x, vec![Box::new(Gelu::new())], None, train_ctx(), 70 + k as u64);
        check(&format!("GELU {dims:?}"), &mut m, LAYER_TOL, None);
    }
}

#[test]
fn layer_norm_over_the_last_dimension() {
    // nn.LayerNorm(C) over the last dimension of a (N, T, C) = (2, 3, 8) input, and of a
    // flat (4, 12) one without a bias. Smooth: the truncation error h²/6·|L‴| grows as
    // rstd³, about 5 for rows of 8 or more values of U(−1, 1) (variance near 1/3): some
    // 1e-4, inside LAYER_TOL's atol of 1e-3.
    check_layer("LayerNorm (2, 3, 8)", &[2, 3, 8], Box::new(LayerNorm::new(8)), 80);
    check_layer("LayerNorm (4, 12), no bias", &[4, 12], Box::new(LayerNorm::new(12).without_bias()), 81);
}

#[test]
fn rescaling() {
    // y = 2.5·x − 0.5 on (2, 3, 2, 2) and on (4, 3).
    check_layer("Rescaling 4-D", &[2, 3, 2, 2], Box::new(Rescaling::new(2.5, -0.5)), 50);
    check_layer("Rescaling 2-D", &[4, 3], Box::new(Rescaling::new(1.0 / 255.0, 0.0)), 51);
}

#[test]
fn global_avg_pool() {
    // x: (2, 3, 2, 3) → y: (2, 3)
    check_layer("GlobalAvgPool2d", &[2, 3, 2, 3], Box::new(GlobalAvgPool2d::new()), 52);
}

/// `n` distinct values 0.1 apart, in a random order, centred on 0: no ±h step (h = 1e-2)
/// can make two of them change places, so every window of a max pooling keeps its winner
/// while its finite differences are taken.
fn distinct(g: &mut Rng, n: usize) -> Vec<f32> {
    let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - n as f32 / 2.0) * 0.1).collect();
    for i in (1..n).rev() {
        v.swap(i, g.below(i + 1));
    }
    v
}

#[test]
fn max_pool_overlapping_windows_and_same_padding() {
    // Pool 3, stride 2, valid on (2, 2, 7, 7) → (2, 2, 3, 3): windows overlap by a row and a
    // column, so an input can win up to four windows and its gradient is their sum.
    // Pool (2, 3), strides (2, 1), same on (2, 2, 5, 6) → (2, 2, 3, 6): pad_total rows
    // (3 − 1)·2 + 2 − 5 = 1 → 0 / 1, columns 5 + 3 − 6 = 2 → 1 / 1; the windows at the
    // border are clipped.
    let cases = [
        ("MaxPool2d 3x3 s2 valid", [2, 2, 7, 7], MaxPool2d::new((3, 3), (2, 2), Padding::Valid).unwrap()),
        ("MaxPool2d 2x3 s2x1 same", [2, 2, 5, 6], MaxPool2d::new((2, 3), (2, 1), Padding::Same).unwrap()),
    ];
    for (k, (name, dims, pool)) in cases.into_iter().enumerate() {
        let mut g = Rng(90 + k as u64);
        let x = distinct(&mut g, dims.iter().product());
        let mut m = build(&dims[1..], x, vec![Box::new(pool)], None, train_ctx(), 92 + k as u64);
        let grad = check(name, &mut m, LAYER_TOL, None);
        // Σ dx = Σ dout: every output's gradient lands on exactly one input.
        let (sum_dx, sum_w) = (grad.iter().map(|&v| v as f64).sum::<f64>(), m.w.iter().map(|&v| v as f64).sum::<f64>());
        assert!((sum_dx - sum_w).abs() < 1e-5, "{name}: Σ dx = {sum_dx}, Σ dout = {sum_w} (± 1e-5, f32 sums)");
    }
}

#[test]
fn conv_then_max_pool_gradients_reach_the_weights() {
    // x: (2, 1, 6, 6) → conv 2 filters 3×3 same → (2, 2, 6, 6) → pool 2 → (2, 2, 3, 3).
    // The conv's outputs are not spaced apart, so a step can swap a window's winner, a
    // kink as ReLU's: found by one-sided slopes that disagree and skipped, at most 8 of
    // the 92 points (72 inputs, 18 weights, 2 biases).
    let mut g = Rng(95);
    let x = uniform(&mut g, 72, -1.0, 1.0);
    let layers: Vec<Box<dyn Layer>> = vec![
        Box::new(Conv2d::new(1, 2, (3, 3), 1, Padding::Same, true).unwrap()),
        Box::new(MaxPool2d::new((2, 2), (2, 2), Padding::Valid).unwrap()),
    ];
    let mut m = build(&[1, 6, 6], x, layers, None, train_ctx(), 96);
    check("Conv2d → MaxPool2d", &mut m, Tol { max_kinks: 8, ..LAYER_TOL }, None);
}

#[test]
fn flatten() {
    // x: (2, 2, 3, 2) → y: (2, 12)
    check_layer("Flatten", &[2, 2, 3, 2], Box::new(Flatten::new()), 53);
}

#[test]
fn dropout_train_mode_with_a_fixed_mask() {
    // x: (4, 10), rate 0.3: with a fixed ctx the mask is the same in every evaluation.
    let g = check_layer("Dropout(0.3)", &[4, 10], Box::new(Dropout::new(0.3).unwrap()), 54);
    let dropped = g.iter().filter(|&&v| v == 0.0).count();
    // Not a statistical claim, only that the check saw both kinds of element: with this
    // seed some of the 40 are dropped and some kept.
    assert!(dropped > 0 && dropped < 40, "{dropped} of 40 dropped");
}

#[test]
fn toy_mlp_gradients_match_finite_differences() {
    // The lesson's MLP 2-30-20-2, x: (4, 2). Glorot weights, biases set to random values.
    let net = models::toy_mlp(2, 2).unwrap();
    let store = net.init(60);
    let mut g = Rng(61);
    let mut params = store.params.clone();
    for t in net.param_infos().iter().filter(|t| t.name.ends_with("bias")) {
        params[t.range.clone()].copy_from_slice(&uniform(&mut g, t.range.len(), -0.2, 0.2));
    }
    let x = uniform(&mut g, 4 * 2, -2.0, 2.0);
    let layers = net.layers().iter().map(|l| l.boxed_clone()).collect();
    let mut m = build(&[2], x, layers, Some(packed(&net, &params)), train_ctx(), 62);
    check("toy MLP", &mut m, Tol { max_kinks: 10, ..LAYER_TOL }, None);
}

#[test]
fn convnet_gradients_match_finite_differences() {
    // The Keras guide's convnet (BatchNorm, dropout 0.5) on (2, 1, 12, 12):
    // conv0 same 3×3 → 12×12; conv1 valid 6×6 s2 → 4×4; conv2 same 6×6 s2 → 2×2
    // (pad_total = 2 + 6 − 4 = 4 → 2 / 2); GAP → 32; dense 256; dense 10.
    // Inputs are pixels in [0, 255) (Rescaling ×1/255 follows the probe), so the input
    // step is h = 1e-2 pixel units; weights take h = 1e-4 (why: see the tolerance below).
    let opts =
        ConvnetOptions { norm: Norm::BatchNorm, dropout: 0.5, input: (1, 12, 12), classes: 10, bn_momentum: 0.99 };
    let net = models::convnet(opts).unwrap();
    let store = net.init(70);
    let mut g = Rng(71);
    let mut params = store.params.clone();
    // Non-zero biases and betas, so their paths are exercised with realistic values.
    for t in net.param_infos().iter().filter(|t| t.name.ends_with("bias") || t.name.ends_with("beta")) {
        params[t.range.clone()].copy_from_slice(&uniform(&mut g, t.range.len(), -0.1, 0.1));
    }
    let x = uniform(&mut g, 2 * 144, 0.0, 255.0);
    let layers = net.layers().iter().map(|l| l.boxed_clone()).collect();
    let mut m = build(&[1, 12, 12], x, layers, Some(packed(&net, &params)), train_ctx(), 72);
    // A sample of every tensor: 24 input values and up to 16 values per parameter tensor.
    let mut pick = Rng(73);
    let mut indices = Vec::new();
    for t in m.net.param_infos() {
        let k = if t.name == "probe0.x" { 24 } else { 16 };
        for _ in 0..k.min(t.range.len()) {
            indices.push(t.range.start + pick.below(t.range.len()));
        }
    }
    // Looser than LAYER_TOL, measured: a channel-wide parameter (conv0's weights, a BN
    // beta) moves hundreds of ReLU inputs at once, so even at h = 1e-4 a few cross their
    // kinks, each bending the difference quotient a little; smaller steps drown in the
    // f32 rounding of the forward (~1e-7·|L| ÷ 2h). With (1e-2, 1e-3) the worst point
    // (bn0.beta[7]) used 0.99 of the bound; the difference quotient converges to the
    // analytic value as h shrinks (conv0.weight[61]: −0.4389, −0.4118, −0.4237 at
    // h = 1e-2, 1e-3, 1e-4 against −0.4234), which a wrong backward would not do.
    let tol = Tol { h_input: 1e-2, h_param: 1e-4, rtol: 2e-2, atol: 2e-3, max_kinks: 0 };
    let grad = check("convnet", &mut m, tol, Some(indices));
    // conv2's bias is followed by BatchNorm, which subtracts it again: its exact gradient
    // is 0, and the analytic one must be 0 up to f32 rounding of the BN sums.
    let b = m.net.param_infos().iter().find(|t| t.name == "conv2.bias").unwrap().range.clone();
    assert!(grad[b].iter().all(|v| v.abs() < 1e-4), "conv2.bias gradient should vanish under BatchNorm");
}

#[test]
fn convnet_without_batchnorm_gradients_match_finite_differences() {
    // As above with Norm::None and no dropout: (2, 1, 12, 12).
    let opts = ConvnetOptions { norm: Norm::None, dropout: 0.0, input: (1, 12, 12), classes: 10, bn_momentum: 0.99 };
    let net = models::convnet(opts).unwrap();
    let store = net.init(80);
    let mut g = Rng(81);
    let mut params = store.params.clone();
    for t in net.param_infos().iter().filter(|t| t.name.ends_with("bias")) {
        params[t.range.clone()].copy_from_slice(&uniform(&mut g, t.range.len(), -0.1, 0.1));
    }
    let x = uniform(&mut g, 2 * 144, 0.0, 255.0);
    let layers = net.layers().iter().map(|l| l.boxed_clone()).collect();
    let mut m = build(&[1, 12, 12], x, layers, Some(packed(&net, &params)), train_ctx(), 82);
    let mut pick = Rng(83);
    let mut indices = Vec::new();
    for t in m.net.param_infos() {
        let k = if t.name == "probe0.x" { 24 } else { 16 };
        for _ in 0..k.min(t.range.len()) {
            indices.push(t.range.start + pick.below(t.range.len()));
        }
    }
    // Without BatchNorm, fewer ReLU inputs move per step: LAYER_TOL's bounds hold.
    let tol = Tol { h_input: 1e-2, h_param: 1e-4, rtol: 1e-2, atol: 1e-3, max_kinks: 0 };
    check("convnet without BN", &mut m, tol, Some(indices));
}
