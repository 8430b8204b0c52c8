//! Flatten, (N, ...) → (N, F): its forward and backward, its spec entry (`flatten`), its
//! spec form, what it keeps for backward (only the input's shape) and, at the end of the
//! file, its GPU form (device copies: the values do not move, so it has no kernel).

#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Params, ParamsMut};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// (N, ...) → (N, F): the values are already in that order, so it is a view.
#[derive(Clone, Debug, Default)]
pub struct Flatten {
    /// Input shape of the last forward, to restore in backward.
    input: Option<Shape>,
}

impl Flatten {
    pub fn new() -> Flatten {
        Flatten::default()
    }

    /// The spec entry: Keras's `Flatten()`, no fields.
    pub const SPEC: LayerType = LayerType {
        name: "flatten",
        fields: "none",
        example: (&[2, 3, 3], r#"{"type": "flatten"}"#),
        parse: |_| Ok(Build::layer(|_| Ok(Flatten::new()))),
        #[cfg(feature = "cuda")]
        kernels: None,
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Values,
            #[cfg(feature = "cuda")]
            host: None,
        },
    };
}

impl Layer for Flatten {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "flatten"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "flatten"}))
    }

    /// Nothing per sample: a view.
    fn memory(&self, _shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory::NONE)
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        Ok(Shape::new([input.batch(), input.per_sample()]))
    }

    fn forward(&mut self, x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, _ctx: &Ctx) -> Result<Tensor> {
        let out = self.output_shape(x.shape())?;
        self.input = Some(x.shape().clone());
        x.reshape(out)
    }

    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let shape =
            self.input.take().ok_or_else(|| Error::config("Flatten backward", "no forward to differentiate"))?;
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        dout.reshape(shape).map(Some)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Flatten::new())
    }

    fn describe(&self) -> String {
        "Flatten".into()
    }
}
