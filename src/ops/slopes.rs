//! What a pointwise activation keeps for its backward: the slope at each input of its last
//! training forward. GELU, SiLU, Sigmoid and Tanh compute y and dy/dx in one pass over x
//! (their `cpu::<op>_forward`) and scale dy by the kept slope (`cpu::<op>_backward`); this
//! file owns what the four layers share around those functions: the buffer, its memory
//! account, and the check that a backward's gradient is the forward's size. What each
//! computes stays in its own folder.

use super::{Ctx, InputGrad, LayerMemory, LayerShapes, Mode, F32};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// An activation's forward over x in place, writing each value's slope where given.
pub(crate) type SlopeForward = fn(&mut [f32], Option<&mut [f32]>);
/// An activation's backward: dout scaled in place by the kept slopes.
pub(crate) type SlopeBackward = fn(&mut [f32], &[f32]);

/// The slope at each input of the last training forward (any shape, flattened).
#[derive(Clone, Debug, Default)]
pub struct Slopes(Vec<f32>);

impl Slopes {
    /// x: any shape → y: same shape, by `forward`; a training forward keeps the slopes.
    pub(crate) fn forward(&mut self, mut x: Tensor, ctx: &Ctx, forward: SlopeForward) -> Result<Tensor> {
        let xs = x.host_mut();
        let slope = (ctx.mode == Mode::Train).then(|| {
            self.0.resize(xs.len(), 0.0);
            self.0.as_mut_slice()
        });
        forward(xs, slope);
        Ok(x)
    }

    /// dout: the forward's shape → dx: same shape, by `backward` over the kept slopes;
    /// none when `input_grad` skips it. `op` names the layer in a size error.
    pub(crate) fn backward(
        &self,
        op: &'static str,
        mut dout: Tensor,
        input_grad: InputGrad,
        backward: SlopeBackward,
    ) -> Result<Option<Tensor>> {
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        if dout.numel() != self.0.len() {
            return Err(Error::shape(
                op,
                format!("dout {} for {} values kept by the forward", dout.shape(), self.0.len()),
            ));
        }
        backward(dout.host_mut(), &self.0);
        Ok(Some(dout))
    }

    /// The memory account: one f32 slope per input value.
    pub(crate) fn memory(shapes: &LayerShapes) -> LayerMemory {
        LayerMemory { kept_per_sample: shapes.input.numel() as u64 * F32, ..LayerMemory::NONE }
    }

    /// How many slopes are kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}
