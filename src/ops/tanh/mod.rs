//! Tanh, y = tanh(x), PyTorch's `nn.Tanh()` and Keras's `activation="tanh"`: the layer
//! (its spec entry `tanh`, its spec form, what it keeps for backward: each value's slope)
//! on its CPU forward and backward ([`cpu`]); its GPU form is [`gpu`] (kernels/tanh.cu).
//! GELU's tanh form and the recurrent cells squash with it.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::slopes::Slopes;
use super::spec::{Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Params, ParamsMut};
use crate::error::Result;
use crate::tensor::{Shape, Tensor};

/// tanh(x).
#[derive(Clone, Debug, Default)]
pub struct Tanh {
    /// The derivative at each input of the training forward (any shape, flattened).
    slope: Slopes,
}

impl Tanh {
    pub fn new() -> Tanh {
        Tanh::default()
    }

    /// The spec entry: PyTorch's `nn.Tanh()`, Keras's `Activation("tanh")`; no fields.
    pub const SPEC: LayerType = LayerType {
        name: "tanh",
        fields: "none",
        example: (&[5], r#"{"type": "tanh"}"#),
        parse: |_| Ok(Build::layer(|_| Ok(Tanh::new()))),
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

impl Layer for Tanh {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "tanh"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "tanh"}))
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
        self.slope.forward(x, ctx, cpu::tanh_forward)
    }

    // dout: any shape → dx: same shape
    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        self.slope.backward("Tanh backward", dout, input_grad, cpu::tanh_backward)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Tanh::new())
    }

    fn describe(&self) -> String {
        "Tanh".into()
    }
}

#[cfg(test)]
mod tests {
    use super::cpu::{tanh_slope, tanh_value};

    /// (x, torch_y, torch_dx, exact_y, exact_dx): torch.tanh on float32 and its gradient at
    /// dy = 1, then the same in float64 from the float32 input, rounded once to float32.
    /// Made by scripts/torch_tanh.py, whose output this is:
    /// // torch 2.15.0+cu132
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)] // the values as the script prints them, f32's in f64 digits
    const TORCH: &[(f32, f32, f32, f32, f32)] = &[
        (0.0, 0.0, 1.0, 0.0, 1.0),
        (0.0010000000474974513, 0.0009999996982514858, 0.9999989867210388, 0.0009999996982514858, 0.9999989867210388),
        (-0.0010000000474974513, -0.0009999996982514858, 0.9999989867210388, -0.0009999996982514858, 0.9999989867210388),
        (0.10000000149011612, 0.0996679961681366, 0.9900662899017334, 0.0996679961681366, 0.9900662899017334),
        (-0.30000001192092896, -0.29131263494491577, 0.9151369333267212, -0.29131263494491577, 0.9151369333267212),
        (0.5, 0.46211716532707214, 0.7864477038383484, 0.46211716532707214, 0.7864477038383484),
        (-0.5, -0.46211716532707214, 0.7864477038383484, -0.46211716532707214, 0.7864477038383484),
        (0.6000000238418579, 0.5370495915412903, 0.7115777134895325, 0.5370495915412903, 0.7115777730941772),
        (0.6499999761581421, 0.5716699361801147, 0.6731934547424316, 0.5716699361801147, 0.6731934547424316),
        (-0.699999988079071, -0.6043677926063538, 0.6347395777702332, -0.6043677926063538, 0.6347395777702332),
        (1.0, 0.7615941762924194, 0.41997429728507996, 0.7615941762924194, 0.41997432708740234),
        (-1.0, -0.7615941762924194, 0.41997429728507996, -0.7615941762924194, 0.41997432708740234),
        (2.5, 0.9866142868995667, 0.026592249050736427, 0.9866142868995667, 0.026592226698994637),
        (-2.5, -0.9866142868995667, 0.026592249050736427, -0.9866142868995667, 0.026592226698994637),
        (6.0, 0.9999877214431763, 2.4556962671340443e-05, 0.9999877214431763, 2.457654773024842e-05),
        (-6.0, -0.9999877214431763, 2.4556962671340443e-05, -0.9999877214431763, 2.457654773024842e-05),
        (9.0, 0.9999999403953552, 1.1920928955078125e-07, 0.9999999403953552, 6.091991622270143e-08),
        (12.0, 1.0, 0.0, 1.0, 1.510054303821562e-10),
        (-12.0, -1.0, 0.0, -1.0, 1.510054303821562e-10),
        (20.0, 1.0, 0.0, 1.0, 0.0),
        (-20.0, -1.0, 0.0, -1.0, 0.0),
        (40.0, 1.0, 0.0, 1.0, 0.0),
        (-40.0, -1.0, 0.0, -1.0, 0.0),
        (87.0, 1.0, 0.0, 1.0, 0.0),
        (-87.0, -1.0, 0.0, -1.0, 0.0),
        (95.0, 1.0, 0.0, 1.0, 0.0),
        (-95.0, -1.0, 0.0, -1.0, 0.0),
    ];

    /// y within 3 ulp of the float64 value (2·10⁻⁷ relative: the polynomial's own error
    /// and its roundings below 0.625; e²ᶻ within 2 ulp, the add, the division and the
    /// subtraction above it, whose result is at least 0.55). The slope 1 − y² within the
    /// same relative bound plus two ulps of 1 (2.4·10⁻⁷): as y nears ±1 the rounding of y²
    /// is all that is left of 1 − y² (x = 9 gives 1.19·10⁻⁷ where 6.1·10⁻⁸ is exact, as
    /// PyTorch's own f32 does). And within the same bounds of PyTorch's own float32 results.
    #[test]
    fn tanh_matches_pytorch() {
        for &(x, ty, tdx, ey, edx) in TORCH {
            let (y, dx) = (tanh_value(x), tanh_slope(x));
            for (what, got, want, ulps_of_one) in
                [("y", y, ey, 0.0), ("dx", dx, edx, 2.0), ("y vs torch", y, ty, 0.0), ("dx vs torch", dx, tdx, 2.0)]
            {
                let bound = 2e-7 * want.abs() + 1.2e-7 * ulps_of_one;
                assert!((got - want).abs() <= bound, "x = {x}: {what} {got}, want {want} (bound {bound:e})");
            }
        }
        // Odd exactly, −0 kept; at ±∞ and NaN, PyTorch's: ±1 with slope 0, a NaN passes.
        for x in [1e-3f32, 0.3, 0.625, 0.7, 2.0, 9.5] {
            assert_eq!(tanh_value(-x).to_bits(), (-tanh_value(x)).to_bits(), "tanh(−{x})");
        }
        assert_eq!(tanh_value(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!((tanh_value(f32::INFINITY), tanh_value(f32::NEG_INFINITY)), (1.0, -1.0));
        assert_eq!((tanh_slope(f32::INFINITY), tanh_slope(f32::NEG_INFINITY)), (0.0, 0.0));
        assert!(tanh_value(f32::NAN).is_nan());
    }

    /// Over every 2⁻¹⁴ step of [−10, 10] (the switch at 0.625 included), within 3 ulp of
    /// the float64 tanh of the same f32 input (Rust's f64 tanh, within an ulp of f64).
    #[test]
    fn tanh_is_within_three_ulp_everywhere_that_matters() {
        let mut worst = 0.0f64;
        for i in -(10 << 14)..=(10 << 14) {
            let x = i as f32 / (1 << 14) as f32;
            let (got, want) = (tanh_value(x) as f64, (x as f64).tanh());
            let at = (want.abs() as f32).max(f32::MIN_POSITIVE);
            let ulp = (f32::from_bits(at.to_bits() + 1) - at) as f64;
            worst = worst.max((got - want).abs() / ulp);
        }
        assert!(worst <= 3.0, "worst {worst} ulp");
    }
}
