//! GELU, exact: y = x·Φ(x), Φ the standard normal CDF (PyTorch's `nn.GELU()`, its default
//! `approximate='none'`): the layer (its spec entry `gelu`, its spec form, what it keeps
//! for backward: the slope at each input), built on its CPU forward and backward ([`cpu`],
//! whose docs say how it is computed, in f32, and how closely); its GPU form is [`gpu`]
//! (kernels/gelu.cu, the CPU's expressions in its order).
//!
//! A module of its own rather than a third layer of `activation.rs`: it is the first op
//! of the transformer issue (21), each of which is its own unit, and it shares nothing
//! with ReLU and Rescaling but being elementwise.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::slopes::Slopes;
use super::spec::{Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Params, ParamsMut};
use crate::error::Result;
use crate::tensor::{Shape, Tensor};

/// x·Φ(x), exact (erf-based) GELU.
#[derive(Clone, Debug, Default)]
pub struct Gelu {
    /// The derivative at each input of the training forward (any shape, flattened):
    /// all the backward needs of it, so neither the input nor Φ is kept.
    slope: Slopes,
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
        #[cfg(feature = "cuda")]
        kernels: Some(&gpu::KERNELS),
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Values,
            #[cfg(feature = "cuda")]
            host: Some(gpu::host_check),
        },
    };
}

impl Layer for Gelu {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "gelu"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "gelu"}))
    }

    /// The slope at each input, one f32 per value.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(Slopes::memory(shapes))
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        Ok(input.clone())
    }

    // x: any shape → y: same shape
    fn forward(&mut self, x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        self.slope.forward(x, ctx, cpu::gelu_forward)
    }

    // dout: (N, ...) → dx: same shape
    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        self.slope.backward("GELU backward", dout, input_grad, cpu::gelu_backward)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Gelu::new())
    }

    fn describe(&self) -> String {
        "GELU".into()
    }
}

#[cfg(test)]
mod tests {
    use super::cpu::{gelu_grad, gelu_value};
    use super::*;
    use crate::ops::F32;

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
    fn forward_and_gradient_are_within_1e_6_of_the_exact_values_and_torchs_within_its_f32_error() {
        let xs: Vec<f32> = TORCH.iter().map(|t| t.0).collect();
        let (y, dx) = run(&xs, &vec![1.0; xs.len()]);
        let (mut worst_abs, mut worst_rel) = (0.0f64, 0.0f64);
        for (i, &(x, ty, tdx, ey, edx)) in TORCH.iter().enumerate() {
            // Against the 60-digit values: within 1e-6 relative plus 1e-37 (`cpu`'s docs).
            for (what, got, exact) in [("y", y[i], ey), ("dx", dx[i], edx)] {
                let err = (got as f64 - exact as f64).abs();
                assert!(
                    err <= 1e-6 * (exact as f64).abs() + 1e-37,
                    "{what}({x}): got {got}, exact {exact} (|Δ| {err:e})"
                );
            }
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
    fn the_memory_account_is_what_a_training_forward_keeps_and_the_kept_slope_gives_the_gradient() {
        // One f32 a value, as the account says, and the backward's dy·slope is
        // `gelu_grad`'s value bit for bit (the kernels are held to `gelu_grad`).
        let shapes = LayerShapes::one(Shape::new([3, 4]), Shape::new([3, 4]));
        let kept = Gelu::new().memory(&shapes).unwrap().kept_per_sample;
        assert_eq!(kept, 12 * F32);
        let xs: Vec<f32> = (0..24).map(|i| i as f32 * 0.37 - 4.0).collect();
        let dys: Vec<f32> = (0..24).map(|i| 1.5 - i as f32 * 0.11).collect();
        let mut gelu = Gelu::new();
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let x = Tensor::from_vec(xs.clone(), [2, 3, 4]).unwrap();
        let y = gelu.forward(x, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        assert_eq!(gelu.slope.len() as u64 * F32, 2 * kept);
        for (&x, &y) in xs.iter().zip(y.host()) {
            assert_eq!(y.to_bits(), gelu_value(x).to_bits(), "GELU({x})");
        }
        let d = Tensor::from_vec(dys.clone(), [2, 3, 4]).unwrap();
        let dx = gelu.backward(d, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx);
        for ((&x, &dy), &dx) in xs.iter().zip(&dys).zip(dx.unwrap().unwrap().host()) {
            assert_eq!(dx.to_bits(), gelu_grad(x, dy).to_bits(), "GELU'({x})·{dy}");
        }
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
