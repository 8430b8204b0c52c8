//! The global batch: the samples of one optimiser step, gathered on the host by the
//! loader thread (or by the caller of `Trainer::step`) before the scatter cuts it.

use crate::data::Dataset;
use crate::tensor::Shape;

/// A global batch gathered on the host: x (B, *sample_shape) as f32, y (B).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub x: Vec<f32>,
    pub y: Vec<u32>,
    pub sample_shape: Shape,
}

impl Batch {
    /// Gathers the samples `indices` of `data`, in that order.
    pub fn gather(data: &Dataset, indices: &[usize]) -> Batch {
        let per = data.sample_shape().numel();
        let mut x = vec![0.0; indices.len() * per];
        let mut y = vec![0; indices.len()];
        data.gather_into(indices, &mut x, &mut y);
        Batch { x, y, sample_shape: data.sample_shape().clone() }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// True for a batch without samples.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }
}
