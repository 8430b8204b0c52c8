//! Sigmoid, y = σ(x) = 1/(1 + e⁻ˣ), PyTorch's `nn.Sigmoid()` and Keras's
//! `activation="sigmoid"`: the layer (its spec entry `sigmoid`, its spec form, what it
//! keeps for backward: each value's slope) on its CPU forward and backward ([`cpu`]); its
//! GPU form is [`gpu`] (kernels/sigmoid.cu). A gate's squashing (an LSTM's, a gated
//! unit's), or a binary output's probability.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::slopes::Slopes;
use super::spec::{Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Params, ParamsMut};
use crate::error::Result;
use crate::tensor::{Shape, Tensor};

/// σ(x) = 1/(1 + e⁻ˣ).
#[derive(Clone, Debug, Default)]
pub struct Sigmoid {
    /// The derivative at each input of the training forward (any shape, flattened).
    slope: Slopes,
}

impl Sigmoid {
    pub fn new() -> Sigmoid {
        Sigmoid::default()
    }

    /// The spec entry: PyTorch's `nn.Sigmoid()`, Keras's `Activation("sigmoid")`; no fields.
    pub const SPEC: LayerType = LayerType {
        name: "sigmoid",
        fields: "none",
        example: (&[5], r#"{"type": "sigmoid"}"#),
        parse: |_| Ok(Build::layer(|_| Ok(Sigmoid::new()))),
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

impl Layer for Sigmoid {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "sigmoid"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "sigmoid"}))
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
        self.slope.forward(x, ctx, cpu::sigmoid_forward)
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
        self.slope.backward("Sigmoid backward", dout, input_grad, cpu::sigmoid_backward)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Sigmoid::new())
    }

    fn describe(&self) -> String {
        "Sigmoid".into()
    }
}

#[cfg(test)]
mod tests {
    use super::cpu::{sigmoid_slope, sigmoid_value};

    /// (x, torch_y, torch_dx, exact_y, exact_dx): torch.sigmoid on float32 and its gradient
    /// at dy = 1, then the same in float64 from the float32 input, rounded once to float32.
    /// Made by scripts/torch_sigmoid.py, whose output this is:
    /// // torch 2.15.0+cu132
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)] // the values as the script prints them, f32's in f64 digits
    const TORCH: &[(f32, f32, f32, f32, f32)] = &[
        (0.0, 0.5, 0.25, 0.5, 0.25),
        (0.0010000000474974513, 0.500249981880188, 0.24999994039535522, 0.500249981880188, 0.24999994039535522),
        (-0.0010000000474974513, 0.499750018119812, 0.24999994039535522, 0.4997499883174896, 0.24999994039535522),
        (0.10000000149011612, 0.5249791741371155, 0.24937604367733002, 0.5249791741371155, 0.24937604367733002),
        (-0.30000001192092896, 0.4255574941635132, 0.24445831775665283, 0.4255574941635132, 0.24445831775665283),
        (0.5, 0.622459352016449, 0.23500370979309082, 0.622459352016449, 0.23500370979309082),
        (-0.5, 0.3775406777858734, 0.23500370979309082, 0.3775406777858734, 0.23500370979309082),
        (0.6000000238418579, 0.6456562876701355, 0.2287842482328415, 0.6456562876701355, 0.2287842333316803),
        (0.6499999761581421, 0.6570104360580444, 0.22534772753715515, 0.6570104360580444, 0.22534771263599396),
        (-0.699999988079071, 0.3318122327327728, 0.2217128723859787, 0.3318122327327728, 0.2217128723859787),
        (1.0, 0.7310585975646973, 0.1966119259595871, 0.7310585975646973, 0.1966119259595871),
        (-1.0, 0.2689414322376251, 0.1966119408607483, 0.2689414322376251, 0.1966119259595871),
        (2.5, 0.9241418242454529, 0.0701037123799324, 0.9241418242454529, 0.070103719830513),
        (-2.5, 0.07585817575454712, 0.0701037123799324, 0.07585818320512772, 0.070103719830513),
        (6.0, 0.9975274205207825, 0.002466465812176466, 0.9975273609161377, 0.0024665093515068293),
        (-6.0, 0.0024726230185478926, 0.0024665091186761856, 0.0024726232513785362, 0.0024665093515068293),
        (9.0, 0.9998766183853149, 0.00012336639338172972, 0.9998766183853149, 0.00012337934458628297),
        (12.0, 0.9999938011169434, 6.1988448578631505e-06, 0.9999938607215881, 6.144136932562105e-06),
        (-12.0, 6.144174221844878e-06, 6.1441364778147545e-06, 6.144174676592229e-06, 6.144136932562105e-06),
        (20.0, 1.0, 0.0, 1.0, 2.06115369216775e-09),
        (-20.0, 2.06115369216775e-09, 2.06115369216775e-09, 2.06115369216775e-09, 2.06115369216775e-09),
        (40.0, 1.0, 0.0, 1.0, 0.0),
        (-40.0, 4.24835413113866e-18, 4.24835413113866e-18, 4.24835413113866e-18, 4.24835413113866e-18),
        (87.0, 1.0, 0.0, 1.0, 0.0),
        (-87.0, 1.6458114537543937e-38, 1.6458114537543937e-38, 1.6458114537543937e-38, 1.6458114537543937e-38),
        (95.0, 1.0, 0.0, 1.0, 0.0),
        (-95.0, 0.0, 0.0, 5.521115949439779e-42, 5.521115949439779e-42),
    ];

    /// y within 4·10⁻⁷ relative of the float64 value (e⁻ˣ within 2 ulp, the add and the
    /// division an ulp each: 4 ulp of 2⁻²⁴ ≈ 2.4·10⁻⁷), plus 10⁻³⁸ where the float64 value
    /// is below f32's normal range (x = −95: PyTorch's own f32 gives 0 there too). The
    /// slope σ·(1 − σ) within the same relative bound plus one ulp of 1 (1.2·10⁻⁷): as σ
    /// nears 1 its rounding is all that is left of 1 − σ (x = 12 gives 6.199·10⁻⁶ where
    /// 6.144·10⁻⁶ is exact, and x = 20 gives 0, as PyTorch's own f32 does). And within the
    /// same bounds of PyTorch's own float32 results.
    #[test]
    fn sigmoid_matches_pytorch() {
        for &(x, ty, tdx, ey, edx) in TORCH {
            let (y, dx) = (sigmoid_value(x), sigmoid_slope(x));
            for (what, got, want, ulps_of_one) in
                [("y", y, ey, 0.0), ("dx", dx, edx, 1.0), ("y vs torch", y, ty, 0.0), ("dx vs torch", dx, tdx, 1.0)]
            {
                let bound = 4e-7 * want.abs() + 1.2e-7 * ulps_of_one + 1e-38;
                assert!((got - want).abs() <= bound, "x = {x}: {what} {got}, want {want} (bound {bound:e})");
            }
        }
        // At ±∞ and NaN, PyTorch's: σ(+∞) = 1, σ(−∞) = 0 with slope 0, a NaN passes.
        assert_eq!((sigmoid_value(f32::INFINITY), sigmoid_value(f32::NEG_INFINITY)), (1.0, 0.0));
        assert_eq!((sigmoid_slope(f32::INFINITY), sigmoid_slope(f32::NEG_INFINITY)), (0.0, 0.0));
        assert!(sigmoid_value(f32::NAN).is_nan());
    }
}
