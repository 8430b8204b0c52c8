//! Global average pooling, Keras's `GlobalAveragePooling2D()`: the mean over H and W,
//! (N, C, H, W) → (N, C). The layer (its spec entry `global_average_pooling2d`, its spec
//! form, what it keeps for backward: only the input's shape), built on its CPU forward and
//! backward ([`cpu`]); its GPU form is [`gpu`] (kernels/global_avg_pool.cu).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{expect_images, Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Params, ParamsMut};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// Mean over H and W: (N, C, H, W) → (N, C).
#[derive(Clone, Debug, Default)]
pub struct GlobalAvgPool2d {
    input: Option<Shape>,
}

impl GlobalAvgPool2d {
    pub fn new() -> GlobalAvgPool2d {
        GlobalAvgPool2d::default()
    }

    /// The spec entry: Keras's `GlobalAveragePooling2D()`, no fields.
    pub const SPEC: LayerType = LayerType {
        name: "global_average_pooling2d",
        fields: "none",
        example: (&[2, 3, 3], r#"{"type": "global_average_pooling2d"}"#),
        parse: |_| {
            Ok(Build::layer(|input| {
                expect_images(input)?;
                Ok(GlobalAvgPool2d::new())
            }))
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

impl Layer for GlobalAvgPool2d {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "gap"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "global_average_pooling2d"}))
    }

    /// Nothing per sample: its gradient is dout spread evenly.
    fn memory(&self, _shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory::NONE)
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (n, c, _, _) = input.nchw("GlobalAvgPool2d")?;
        Ok(Shape::new([n, c]))
    }

    // x: (N, C, H, W) → y: (N, C)
    fn forward(&mut self, x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, _ctx: &Ctx) -> Result<Tensor> {
        let (n, c, h, w) = x.shape().nchw("GlobalAvgPool2d")?;
        let mut y = vec![0.0f32; n * c];
        cpu::global_avg_pool_forward(x.host(), &mut y, h * w);
        self.input = Some(x.shape().clone());
        Tensor::from_vec_on(y, [n, c], x.device())
    }

    // dout: (N, C) → dx: (N, C, H, W), each plane filled with dout/(H·W)
    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let shape = self
            .input
            .take()
            .ok_or_else(|| Error::config("GlobalAvgPool2d backward", "no forward to differentiate"))?;
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        let (_, _, h, w) = shape.nchw("GlobalAvgPool2d backward")?;
        let mut dx = vec![0.0f32; shape.numel()];
        cpu::global_avg_pool_backward(dout.host(), &mut dx, h * w);
        Tensor::from_vec_on(dx, shape, dout.device()).map(Some)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(GlobalAvgPool2d::new())
    }

    fn describe(&self) -> String {
        "GlobalAvgPool2d".into()
    }
}
