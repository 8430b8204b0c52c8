//! Rescaling, Keras's `Rescaling(scale, offset)`: y = x·scale + offset. The layer (its
//! spec entry `rescaling`, its spec form, what it keeps for backward: nothing), built on
//! its CPU forward and backward ([`cpu`]); its GPU form is [`gpu`] (kernels/rescaling.cu).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Params, ParamsMut};
use crate::error::Result;
use crate::tensor::{Shape, Tensor};

/// y = x·scale + offset (Keras `Rescaling`; the convnet divides pixels by 255).
#[derive(Clone, Debug)]
pub struct Rescaling {
    scale: f32,
    offset: f32,
}

impl Rescaling {
    pub fn new(scale: f32, offset: f32) -> Rescaling {
        Rescaling { scale, offset }
    }

    /// The spec entry: Keras's `Rescaling(scale, offset=0)`.
    pub const SPEC: LayerType = LayerType {
        name: "rescaling",
        fields: "`scale` (required), `offset` (0)",
        example: (&[1, 4, 4], r#"{"type": "rescaling", "scale": 0.00392156862745098, "offset": -0.5}"#),
        parse: |f| {
            let scale = f.number("scale", None, (|_| true, "a finite number"))?;
            let offset = f.number("offset", Some(0.0), (|_| true, "a finite number"))?;
            Ok(Build::layer(move |_| Ok(Rescaling::new(scale, offset))))
        },
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

impl Layer for Rescaling {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "rescaling"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "rescaling", "scale": self.scale, "offset": self.offset}))
    }

    /// Nothing: its gradient is a constant factor.
    fn memory(&self, _shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory::NONE)
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        Ok(input.clone())
    }

    // x: any shape → y: same shape
    fn forward(&mut self, mut x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, _ctx: &Ctx) -> Result<Tensor> {
        cpu::rescaling_forward(x.host_mut(), self.scale, self.offset);
        Ok(x)
    }

    // dout: any shape → dx: same shape
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
        cpu::rescaling_backward(dout.host_mut(), self.scale);
        Ok(Some(dout))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }

    fn describe(&self) -> String {
        format!("Rescaling(×{}, +{})", self.scale, self.offset)
    }
}
