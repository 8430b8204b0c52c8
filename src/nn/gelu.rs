//! GELU, exact: y = x·Φ(x), Φ the standard normal CDF (PyTorch's `nn.GELU()`, its default
//! `approximate='none'`): its forward and backward, its spec entry (`gelu`), its spec
//! form, what it keeps for backward and, at the end of the file, its GPU form
//! (`gelu_fwd_f32`, `gelu_bwd_f32` of kernels/elementwise.cu).
//!
//! A module of its own rather than a third layer of `activation.rs`: it is the first op
//! of the transformer issue (21), each of which is its own unit, and it shares nothing
//! with ReLU and Rescaling but being elementwise.
//!
//! # Numerics: the reference
//! Each value is computed from the f32 input in f64 and rounded to f32 once:
//! - y = x·Φ(x), Φ(x) = erfc(−x/√2)/2;
//! - dx = dy·(Φ(x) + x·φ(x)), φ(x) = exp(−x²/2)/√(2π).
//!
//! Φ is taken from `erfc` rather than as (1 + erf(x/√2))/2, the same function: for
//! x ≪ 0 the sum 1 + erf cancels (at x = −8 it is 1.2·10⁻¹⁵, 11 f64 ulps of erf's −1 + ε,
//! so one ulp of erf is 9% of it; in f32 it is 0, and PyTorch's f32 GELU returns 0 for
//! −5·10⁻¹⁵), while erfc keeps its relative accuracy there. `erfc` is the `libm` crate's
//! (FreeBSD msun's, < 1 ulp), `exp` Rust's (the C library's, < 1 ulp); so the f64 result
//! is within a few f64 ulps of the exact one, and its f32 rounding is the correctly
//! rounded value except where the exact value lies within ~10⁻¹⁵ relative of a midpoint
//! between two floats: within 1 ulp always, and equal to the correctly rounded value at
//! every input of the PyTorch comparison below (60-digit values from
//! scripts/torch_gelu.py). The kernels compute the same expressions in the same order, in
//! double, without contraction (`__dmul_rn`, `__dadd_rn`), with CUDA's `erfc` and `exp`
//! (tests/kernels_host.rs: equal to these bit for bit on the host).
//!
//! At ±∞ and NaN it is PyTorch's: y(+∞) = +∞, y(−∞) = −∞·0 = NaN, a NaN passes through.

use rayon::prelude::*;

use serde_json::{json, Value};

use super::gpu::{Backward, Forward, GpuLayer};
use super::spec_entry::{Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut, F32};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// Elements per parallel task: an erfc and an exp cost some 30 ns a value, so 2^14 values
/// (about half a millisecond) amortise handing a task to another thread.
const CHUNK: usize = 1 << 14;

/// 1/√2, correctly rounded to f64.
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
/// 1/√(2π), correctly rounded to f64.
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// y = x·Φ(x), in f64 from an f32 input, rounded once.
pub fn gelu_value(x: f32) -> f32 {
    let x = x as f64;
    let cdf = 0.5 * libm::erfc(-x * FRAC_1_SQRT_2);
    (x * cdf) as f32
}

/// dx = dy·(Φ(x) + x·φ(x)), in f64 from f32 inputs, rounded once.
pub fn gelu_grad(x: f32, dy: f32) -> f32 {
    let x = x as f64;
    let cdf = 0.5 * libm::erfc(-x * FRAC_1_SQRT_2);
    let pdf = (-0.5 * x * x).exp() * FRAC_1_SQRT_2PI;
    (dy as f64 * (cdf + x * pdf)) as f32
}

/// x·Φ(x), exact (erf-based) GELU.
#[derive(Clone, Debug, Default)]
pub struct Gelu {
    /// The input of the training forward (any shape, flattened).
    input: Vec<f32>,
}

impl Gelu {
    pub fn new() -> Gelu {
        Gelu::default()
    }

    /// The spec entry: PyTorch's `nn.GELU()` (exact, not the tanh approximation), no fields.
    pub const SPEC: LayerType = LayerType {
        name: "gelu",
        fields: "none",
        example: (&[5], r#"{"type": "gelu"}"#),
        parse: |_| Ok(Build::layer(|_| Ok(Gelu::new()))),
    };
}

impl Layer for Gelu {
    fn gpu(&self) -> Option<Box<dyn GpuLayer>> {
        Some(Box::new(GeluGpu))
    }

    fn kind(&self) -> &'static str {
        "gelu"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "gelu"}))
    }

    /// Its input, an f32 per value.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory { kept_per_sample: shapes.input.numel() as u64 * F32, ..LayerMemory::NONE })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        Ok(input.clone())
    }

    // x: any shape → y: same shape
    fn forward(&mut self, mut x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let xs = x.host_mut();
        if ctx.mode == Mode::Train {
            self.input.clear();
            self.input.extend_from_slice(xs);
        }
        xs.par_chunks_mut(CHUNK).for_each(|xs| {
            for v in xs.iter_mut() {
                *v = gelu_value(*v);
            }
        });
        Ok(x)
    }

    // dout: (N, ...) → dx: same shape
    fn backward(
        &mut self,
        mut dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        if dout.numel() != self.input.len() {
            return Err(Error::shape(
                "GELU backward",
                format!("dout {} for {} cached inputs", dout.shape(), self.input.len()),
            ));
        }
        dout.host_mut().par_chunks_mut(CHUNK).zip(self.input.par_chunks(CHUNK)).for_each(|(ds, xs)| {
            for (d, &x) in ds.iter_mut().zip(xs) {
                *d = gelu_grad(x, *d);
            }
        });
        Ok(Some(dout))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Gelu::new())
    }

    fn describe(&self) -> String {
        "GELU".into()
    }
}

// ---- on a GPU: kernels/elementwise.cu ------------------------------------------------

/// GELU on a GPU: `gelu_fwd`, `gelu_bwd` (the network keeps the forward's input, which
/// the gradient is computed from).
struct GeluGpu;

impl GpuLayer for GeluGpu {
    // x: (N, ...) → y: same shape
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()> {
        f.gpu.gelu_fwd(f.x, f.y)
    }

    // dy: (N, ...) → dx: same shape
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        match b.dx {
            Some(mut dx) => b.gpu.gelu_bwd(b.x, &b.dy, &mut dx),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tensor::Device;

    /// (x, torch_y, torch_dx, exact_y, exact_dx): torch.nn.GELU() on float32 and its
    /// gradient with dy = 1, then x·Φ(x) and Φ(x) + x·φ(x) in 60 digits rounded once to
    /// f32. Made by scripts/torch_gelu.py, whose output this is:
    /// # torch 2.15.0+cu132, mpmath 1.3.0
    #[rustfmt::skip]
    const TORCH: &[(f32, f32, f32, f32, f32)] = &[
        (0.0, 0.0, 0.5, 0.0, 0.5),
        (0.001, 0.0005003989, 0.5007978, 0.000500399, 0.50079787),
        (-0.001, -0.0004996011, 0.4992022, -0.00049960107, 0.4992021),
        (0.5, 0.3457312, 0.86749506, 0.34573123, 0.8674951),
        (-0.5, -0.15426879, 0.13250491, -0.15426877, 0.13250488),
        (1.0, 0.8413447, 1.0833154, 0.8413448, 1.0833155),
        (-1.0, -0.15865529, -0.08331543, -0.15865526, -0.08331547),
        (3.0, 2.9959502, 1.0119456, 2.9959502, 1.0119456),
        (-3.0, -0.0040498674, -0.011945605, -0.004049694, -0.011945647),
        (8.0, 8.0, 1.0, 8.0, 1.0),
        (-8.0, 0.0, 0.0, -4.9767683e-15, -3.979607e-14),
        (-20.0, 0.0, 0.0, -0.0, -0.0),
    ];

    /// The layer's training forward of `x` (as (1, len)), then its backward of `dout`.
    fn run(x: &[f32], dout: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let mut gelu = Gelu::new();
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let x = Tensor::from_vec(x.to_vec(), [1, x.len()]).unwrap();
        let y = gelu.forward(x, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let d = Tensor::from_vec(dout.to_vec(), y.shape().clone()).unwrap();
        let dx = gelu.backward(d, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx);
        (y.into_vec(), dx.unwrap().unwrap().into_vec())
    }

    #[test]
    fn forward_and_gradient_are_the_correctly_rounded_values_and_torchs_within_its_f32_error() {
        let xs: Vec<f32> = TORCH.iter().map(|t| t.0).collect();
        let (y, dx) = run(&xs, &vec![1.0; xs.len()]);
        let (mut worst_abs, mut worst_rel) = (0.0f64, 0.0f64);
        for (i, &(x, ty, tdx, ey, edx)) in TORCH.iter().enumerate() {
            // Against the 60-digit values: bit for bit (signed zeros included), as the f64
            // evaluation with erfc promises away from rounding midpoints (module docs).
            assert_eq!(y[i].to_bits(), ey.to_bits(), "y({x}): got {}, exact {ey}", y[i]);
            assert_eq!(dx[i].to_bits(), edx.to_bits(), "dx({x}): got {}, exact {edx}", dx[i]);
            // Against PyTorch's f32 GELU, whose 1 + erf(x/√2) in f32 loses up to ~1.2e-7
            // absolutely (2 ulp of erf near ±1) and so relatively all of a small Φ
            // (x = −3: 4e-5 relative; x = −8: y = 0, dx = 0): |Δ| ≤ 2.5e-7 + 2^-22·|torch|.
            for (what, got, want) in [("y", y[i], ty), ("dx", dx[i], tdx)] {
                let err = (got as f64 - want as f64).abs();
                let bound = 2.5e-7 + (want as f64).abs() / (1u64 << 22) as f64;
                assert!(err <= bound, "{what}({x}): got {got}, torch {want} (|Δ| {err:e} > {bound:e})");
                worst_abs = worst_abs.max(err);
                if want != 0.0 {
                    worst_rel = worst_rel.max(err / (want as f64).abs());
                }
            }
        }
        eprintln!("GELU against torch f32: max |Δ| {worst_abs:e}, max relative {worst_rel:e} (where torch ≠ 0)");
    }

    #[test]
    fn infinities_and_nan_are_torchs() {
        // torch.nn.GELU() of [inf, -inf, nan] (f32, torch 2.15) is [inf, nan, nan]: −∞·Φ(−∞)
        // is −∞·0; its gradient is [nan, nan, nan]: ±∞·φ(±∞) is ±∞·0.
        let (y, dx) = run(&[f32::INFINITY, f32::NEG_INFINITY, f32::NAN], &[1.0; 3]);
        assert_eq!(y[0], f32::INFINITY);
        assert!(y[1].is_nan() && y[2].is_nan(), "{y:?}");
        assert!(dx.iter().all(|d| d.is_nan()), "{dx:?}");
    }

    #[test]
    fn eval_keeps_nothing_and_backward_without_a_training_forward_is_a_shape_error() {
        let mut gelu = Gelu::new();
        let ctx = Ctx::eval(Device::Cpu(0));
        let x = Tensor::from_vec(vec![1.0, -1.0], [1, 2]).unwrap();
        let y = gelu.forward(x, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        assert_eq!(y.into_vec(), vec![gelu_value(1.0), gelu_value(-1.0)]);
        let d = Tensor::from_vec(vec![1.0, 1.0], [1, 2]).unwrap();
        let e = gelu.backward(d, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx);
        assert!(e.unwrap_err().to_string().contains("GELU backward"));
    }
}
