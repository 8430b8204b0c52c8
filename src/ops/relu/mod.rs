//! ReLU, max(x, 0): its forward and backward, its spec entry (`relu`), its spec form,
//! what it keeps for backward and, at the end of the file, its GPU form (kernels/relu.cu).
//! Also the `"activation": "relu"` a conv2d or dense layer appends ([`Activation::after`]),
//! and the residual block's add fused with its ReLU ([`Relu::forward_sum`]).

#[cfg(feature = "cuda")]
pub mod gpu;

use rayon::prelude::*;

use serde_json::{json, Value};

use super::spec::{Activation, Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut, RELU_KIND};

/// Elements per parallel task of the elementwise layers: large enough that a task costs
/// more than handing it to another thread.
const CHUNK: usize = 1 << 16;
use crate::backend::par;
use crate::backend::simd::widest;
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
    };
}

widest! {
    /// max(x, 0) in place (NaN stays NaN).
    fn relu(xs: &mut [f32]) {
        for v in xs.iter_mut() {
            *v = if *v < 0.0 { 0.0 } else { *v };
        }
    }
}

widest! {
    /// max(x, 0) in place, and the mask of positive inputs for the backward.
    fn relu_keep(xs: &mut [f32], ms: &mut [u8]) {
        for (v, m) in xs.iter_mut().zip(ms.iter_mut()) {
            *m = u8::from(*v > 0.0);
            *v = if *v < 0.0 { 0.0 } else { *v };
        }
    }
}

widest! {
    /// max(a + b, 0) into a: a residual block's add and ReLU in one pass, the same two
    /// roundings as one after the other.
    fn add_relu(a: &mut [f32], b: &[f32]) {
        for (x, &y) in a.iter_mut().zip(b) {
            let v = *x + y;
            *x = if v < 0.0 { 0.0 } else { v };
        }
    }
}

widest! {
    /// [`add_relu`], and the mask of positive sums for the backward.
    fn add_relu_keep(a: &mut [f32], b: &[f32], ms: &mut [u8]) {
        for ((x, &y), m) in a.iter_mut().zip(b).zip(ms.iter_mut()) {
            let v = *x + y;
            *m = u8::from(v > 0.0);
            *x = if v < 0.0 { 0.0 } else { v };
        }
    }
}

widest! {
    /// dout where the input was positive, 0 elsewhere, in place.
    fn relu_backward(ds: &mut [f32], ms: &[u8]) {
        for (d, &p) in ds.iter_mut().zip(ms) {
            *d = if p != 0 { *d } else { 0.0 };
        }
    }
}

impl Relu {
    /// This layer's forward of `y + skip`, in one pass over the values instead of two: a
    /// residual block's add and the ReLU after it, bit for bit what they compute one after
    /// the other, the mask kept for [`Layer::backward`] as the forward keeps it.
    pub fn forward_sum(&mut self, mut y: Tensor, skip: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        if y.shape() != skip.shape() {
            return Err(Error::shape("ReLU of a sum", format!("{} + {}", y.shape(), skip.shape())));
        }
        let (ys, ss) = (y.host_mut(), skip.host());
        if ctx.mode == Mode::Train {
            self.positive.resize(ys.len(), 0);
            let parts = ys.par_chunks_mut(CHUNK).zip(ss.par_chunks(CHUNK)).zip(self.positive.par_chunks_mut(CHUNK));
            par::for_each(parts, |((ys, ss), ms)| add_relu_keep(ys, ss, ms));
        } else {
            par::for_each(ys.par_chunks_mut(CHUNK).zip(ss.par_chunks(CHUNK)), |(ys, ss)| add_relu(ys, ss));
        }
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
        // `v < 0` is false for NaN: a NaN passes through, as in PyTorch, so that a
        // diverging run shows a NaN loss instead of silently training on zeros.
        let xs = x.host_mut();
        if ctx.mode == Mode::Train {
            self.positive.resize(xs.len(), 0);
            par::for_each(xs.par_chunks_mut(CHUNK).zip(self.positive.par_chunks_mut(CHUNK)), |(xs, ms)| {
                relu_keep(xs, ms)
            });
        } else {
            par::for_each(xs.par_chunks_mut(CHUNK), relu);
        }
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
        par::for_each(dout.host_mut().par_chunks_mut(CHUNK).zip(self.positive.par_chunks(CHUNK)), |(ds, ms)| {
            relu_backward(ds, ms)
        });
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
