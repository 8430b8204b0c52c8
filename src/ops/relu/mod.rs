//! ReLU, max(x, 0), PyTorch's `nn.ReLU()`: the layer (its spec entry `relu`, its spec
//! form, what it keeps for backward: a byte per value), built on its CPU forward and
//! backward ([`cpu`]); its GPU form is [`gpu`] (kernels/relu.cu). Also the
//! `"activation": "relu"` a conv2d or dense layer appends ([`Activation::after`]), and the
//! residual block's add fused with its ReLU ([`Relu::forward_sum`]).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{Activation, Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut, RELU_KIND};

use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

impl Activation {
    /// `layer`, followed by its activation layer: a ReLU for `"activation": "relu"`.
    pub fn after(self, layer: Box<dyn Layer>) -> Vec<Box<dyn Layer>> {
        match self {
            Activation::Linear => vec![layer],
            Activation::Relu => vec![layer, Box::new(Relu::new())],
        }
    }
}

/// max(x, 0). The gradient at exactly 0 is 0, as in PyTorch.
#[derive(Clone, Debug, Default)]
pub struct Relu {
    /// 1 where the input was positive, from the training forward (any shape, flattened).
    positive: Vec<u8>,
}

impl Relu {
    pub fn new() -> Relu {
        Relu::default()
    }

    /// The spec entry: Keras's `ReLU()`, no fields.
    pub const SPEC: LayerType = LayerType {
        name: "relu",
        fields: "none",
        example: (&[5], r#"{"type": "relu"}"#),
        parse: |_| Ok(Build::layer(|_| Ok(Relu::new()))),
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

impl Relu {
    /// This layer's forward of `y + skip`, in one pass over the values instead of two: a
    /// residual block's add and the ReLU after it, bit for bit what they compute one after
    /// the other, the mask kept for [`Layer::backward`] as the forward keeps it.
    pub fn forward_sum(&mut self, mut y: Tensor, skip: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        if y.shape() != skip.shape() {
            return Err(Error::shape("ReLU of a sum", format!("{} + {}", y.shape(), skip.shape())));
        }
        let ys = y.host_mut();
        let mask = (ctx.mode == Mode::Train).then(|| {
            self.positive.resize(ys.len(), 0);
            self.positive.as_mut_slice()
        });
        cpu::add_relu_forward(ys, skip.host(), mask);
        Ok(y)
    }
}

impl Layer for Relu {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        RELU_KIND
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "relu"}))
    }

    /// A byte per value: the mask of positive inputs.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory { kept_per_sample: shapes.output.numel() as u64, ..LayerMemory::NONE })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        Ok(input.clone())
    }

    // x: any shape → y: same shape
    fn forward(&mut self, mut x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let xs = x.host_mut();
        let mask = (ctx.mode == Mode::Train).then(|| {
            self.positive.resize(xs.len(), 0);
            self.positive.as_mut_slice()
        });
        cpu::relu_forward(xs, mask);
        Ok(x)
    }

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
        if dout.numel() != self.positive.len() {
            return Err(Error::shape(
                "ReLU backward",
                format!("dout {} for {} cached inputs", dout.shape(), self.positive.len()),
            ));
        }
        cpu::relu_backward(dout.host_mut(), &self.positive);
        Ok(Some(dout))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Relu::new())
    }

    fn describe(&self) -> String {
        "ReLU".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Device;

    /// `forward_sum` is the add and then the layer's forward, bit for bit, in training
    /// (with the same mask for the backward) and in evaluation: sums that land on +0, −0,
    /// either side of it, and a NaN that passes. Shapes that differ are refused, naming both.
    #[test]
    fn the_relu_of_a_sum_is_the_add_then_the_relu() {
        let y = [1.5, -2.0, 0.5, -0.0, f32::NAN, 3.0, -1.0, 2.0];
        let skip = [-1.5, 1.0, 0.25, 0.0, 1.0, -4.0, 1.0, -0.0];
        let t = |v: &[f32]| Tensor::from_vec(v.to_vec(), [2, 4]).unwrap();
        let added = t(&y.iter().zip(&skip).map(|(a, b)| a + b).collect::<Vec<_>>());
        let dy = t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        for ctx in [Ctx::train(0, 0, 0, Device::Cpu(0)), Ctx::eval(Device::Cpu(0))] {
            let (mut fused, mut alone) = (Relu::new(), Relu::new());
            let got = fused.forward_sum(t(&y), &t(&skip), &ctx).unwrap();
            let want = alone.forward(added.clone(), Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
            let bits = |x: &Tensor| x.host().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{:?}", ctx.mode);
            assert!(got.host()[4].is_nan() && got.host()[0] == 0.0 && got.host()[5] == 0.0);
            if ctx.mode == Mode::Train {
                let back = |r: &mut Relu| {
                    let none = ParamsMut::new(&mut [], &[]);
                    r.backward(dy.clone(), Params::new(&[], &[]), none, InputGrad::Needed, &ctx).unwrap().unwrap()
                };
                let (d_fused, d_alone) = (back(&mut fused), back(&mut alone));
                assert_eq!(d_fused.host(), d_alone.host());
                assert_eq!(d_fused.host(), &[0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 8.0]);
            }
        }
        let e =
            Relu::new().forward_sum(t(&y), &Tensor::from_vec(vec![0.0; 8], [8]).unwrap(), &Ctx::eval(Device::Cpu(0)));
        let e = e.unwrap_err().to_string();
        assert!(e.contains("(2, 4)") && e.contains("(8)"), "{e}");
    }
}
