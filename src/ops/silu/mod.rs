//! SiLU (swish), y = x·σ(x), PyTorch's `nn.SiLU()` and Keras's `activation="silu"`: the
//! layer (its spec entry `silu`, its spec form, what it keeps for backward: each value's
//! slope) on its CPU forward and backward ([`cpu`]); its GPU form is [`gpu`]
//! (kernels/silu.cu). Llama's gated MLP multiplies it by a second projection.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::slopes::Slopes;
use super::spec::{Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Params, ParamsMut, SILU_KIND};
use crate::error::Result;
use crate::tensor::{Shape, Tensor};

/// x·σ(x).
#[derive(Clone, Debug, Default)]
pub struct Silu {
    /// The derivative at each input of the training forward (any shape, flattened).
    slope: Slopes,
}

impl Silu {
    pub fn new() -> Silu {
        Silu::default()
    }

    /// The spec entry: PyTorch's `nn.SiLU()`, no fields.
    pub const SPEC: LayerType = LayerType {
        name: "silu",
        fields: "none",
        example: (&[5], r#"{"type": "silu"}"#),
        parse: |_| Ok(Build::layer(|_| Ok(Silu::new()))),
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

impl Layer for Silu {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        SILU_KIND
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "silu"}))
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
        self.slope.forward(x, ctx, cpu::silu_forward)
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
        self.slope.backward("SiLU backward", dout, input_grad, cpu::silu_backward)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Silu::new())
    }

    fn describe(&self) -> String {
        "SiLU".into()
    }
}

#[cfg(test)]
mod tests {
    use super::cpu::{silu_slope, silu_value};

    /// (x, torch_y, torch_dx, exact_y, exact_dx): torch.nn.functional.silu on float32 and
    /// its gradient at dy = 1, then the same in float64 from the float32 input, rounded
    /// once to float32. Made by scripts/torch_silu.py, whose output this is:
    /// // torch 2.15.0+cu132
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)] // the values as the script prints them, f32's in f64 digits
    const TORCH: &[(f32, f32, f32, f32, f32)] = &[
        (0.0, 0.0, 0.5, 0.0, 0.5),
        (0.0010000000474974513, 0.000500250025652349, 0.500499963760376, 0.000500250025652349, 0.5005000233650208),
        (-0.0010000000474974513, -0.0004997500218451023, 0.49950000643730164, -0.0004997500218451023, 0.49950000643730164),
        (0.5, 0.3112296760082245, 0.7399612069129944, 0.3112296760082245, 0.7399612069129944),
        (-0.5, -0.1887703388929367, 0.260038822889328, -0.1887703388929367, 0.260038822889328),
        (1.0, 0.7310585975646973, 0.9276705384254456, 0.7310585975646973, 0.9276705384254456),
        (-1.0, -0.2689414322376251, 0.07232948392629623, -0.2689414322376251, 0.07232949137687683),
        (2.5, 2.310354471206665, 1.0994011163711548, 2.310354471206665, 1.0994011163711548),
        (-2.5, -0.189645454287529, -0.09940110892057419, -0.189645454287529, -0.09940110892057419),
        (6.0, 5.985164642333984, 1.0123262405395508, 5.985164165496826, 1.0123264789581299),
        (-6.0, -0.014835738576948643, -0.012326431460678577, -0.014835738576948643, -0.012326432392001152),
        (12.0, 11.99992561340332, 1.000068187713623, 11.999926567077637, 1.0000675916671753),
        (-12.0, -7.373009430011734e-05, -6.758546805940568e-05, -7.373009430011734e-05, -6.758546805940568e-05),
        (20.0, 20.0, 1.0, 20.0, 1.0),
        (-20.0, -4.1223074731533416e-08, -3.916192170549948e-08, -4.122307117881974e-08, -3.91619181527858e-08),
        (40.0, 40.0, 1.0, 40.0, 1.0),
        (-40.0, -1.699341718629913e-16, -1.6568581194158834e-16, -1.699341718629913e-16, -1.6568581194158834e-16),
        (87.0, 87.0, 1.0, 87.0, 1.0),
        (-87.0, -1.4318559185234732e-36, -1.4153978137950185e-36, -1.4318559185234732e-36, -1.4153978137950185e-36),
        (95.0, 95.0, 1.0, 95.0, 1.0),
        (-95.0, -0.0, -0.0, -5.245032125998504e-40, -5.189820966504106e-40),
    ];

    /// Within 4·10⁻⁷ relative of the float64 values (e⁻ˣ within 2 ulp, the division and the
    /// two products an ulp each: 5 ulp of 2⁻²⁴ ≈ 6·10⁻⁸), plus two ulps of 1 times |x| (the
    /// slope's 1 − σ cancels as σ nears 1: x = 12 gives 1.0000682 where 1.0000676 is exact,
    /// as PyTorch's own f32 does), plus 10⁻³⁸ where the float64 value is below f32's normal
    /// range (x = −95: PyTorch's own f32 gives −0 there too); and within the same bound of
    /// PyTorch's own float32 results.
    #[test]
    fn silu_matches_pytorch() {
        for &(x, ty, tdx, ey, edx) in TORCH {
            let (y, dx) = (silu_value(x), silu_slope(x));
            for (what, got, want) in [("y", y, ey), ("dx", dx, edx), ("y vs torch", y, ty), ("dx vs torch", dx, tdx)] {
                let bound = 4e-7 * want.abs() + 1.2e-7 * x.abs() + 1e-38;
                assert!((got - want).abs() <= bound, "x = {x}: {what} {got}, want {want} (bound {bound:e})");
            }
        }
        // At ±∞ and NaN: PyTorch's y(+∞) = +∞, y(−∞) = NaN, NaN passes.
        assert_eq!(silu_value(f32::INFINITY), f32::INFINITY);
        assert!(silu_value(f32::NEG_INFINITY).is_nan() && silu_value(f32::NAN).is_nan());
    }
}
