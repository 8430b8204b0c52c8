//! Inverted dropout: in training, each value is zeroed with probability `rate` and the
//! survivors are scaled by 1/(1 − rate); in evaluation the layer is the identity.
//!
//! The mask is a pure function of (seed, step, logical replica, layer, element index
//! within the logical replica's shard — a later micro-batch of an accumulated step starts
//! at `Ctx::sample_offset`) through `rng::hash64`, so it does not depend on the device count, the thread count or
//! the order in which elements are visited (the CUDA kernel computes the same function:
//! kernels/dropout.cu, launched by the GPU form, [`gpu`]).
//!
//! The layer (its spec entry `dropout`, its spec form, what it keeps for backward: the
//! mask's factors, and where in the shard a pass starts) is built on its CPU mask, forward
//! and backward ([`cpu`]).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut, F32};
use crate::error::{Error, Result};
use crate::rng::dropout_key;
use crate::tensor::{Shape, Tensor};

#[derive(Clone, Debug)]
pub struct Dropout {
    rate: f32,
    /// Per-element multiplier of the training forward: 0 or 1/(1 − rate). Empty when the
    /// forward dropped nothing (eval, or rate 0).
    scale: Vec<f32>,
}

impl Dropout {
    /// Dropout with probability `rate` in [0, 1).
    pub fn new(rate: f32) -> Result<Dropout> {
        if !(0.0..1.0).contains(&rate) {
            return Err(Error::config("dropout rate", format!("{rate} is not in [0, 1)")));
        }
        Ok(Dropout { rate, scale: Vec::new() })
    }

    /// The drop probability.
    pub fn rate(&self) -> f32 {
        self.rate
    }

    /// The spec entry: Keras's `Dropout(rate)`.
    pub const SPEC: LayerType = LayerType {
        name: "dropout",
        fields: "`rate` in [0, 1)",
        example: (&[5], r#"{"type": "dropout", "rate": 0.25}"#),
        parse: |f| {
            let rate = f.number("rate", None, (|x| (0.0..1.0).contains(&x), "a number in [0, 1)"))?;
            Ok(Build::layer(move |_| Dropout::new(rate).map_err(|e| e.to_string())))
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

impl Layer for Dropout {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "dropout"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "dropout", "rate": self.rate}))
    }

    /// Its f32 mask (0 or 1/(1 − rate) per value).
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory { kept_per_sample: (shapes.output.numel() as u64).saturating_mul(F32), ..LayerMemory::NONE })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        Ok(input.clone())
    }

    // x: any shape → y: same shape
    fn forward(&mut self, mut x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        self.scale.clear();
        if ctx.mode == Mode::Eval || self.rate == 0.0 {
            return Ok(x);
        }
        let key = dropout_key(ctx.seed, ctx.step, ctx.shard as u64, ctx.layer_index as u64);
        // Element i of this pass is element first + i of the logical replica's shard.
        let per_sample = x.numel() / x.shape().batch().max(1);
        let first = (ctx.sample_offset * per_sample) as u64;
        self.scale.resize(x.numel(), 0.0);
        cpu::dropout_mask(&mut self.scale, self.rate, key, first);
        cpu::dropout_forward(x.host_mut(), &self.scale);
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
        if !self.scale.is_empty() {
            cpu::dropout_backward(dout.host_mut(), &self.scale);
        }
        Ok(Some(dout))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Dropout { rate: self.rate, scale: Vec::new() })
    }

    fn describe(&self) -> String {
        format!("Dropout({})", self.rate)
    }
}
