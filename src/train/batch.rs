//! The global batch: the samples of one optimiser step, gathered on the host by the
//! loader thread (or by the caller of `Trainer::step`) before the scatter cuts it. The
//! loader augments the training images here (`data::augment`), once per sample on the
//! host, before any device sees them.

use crate::data::augment::{augment_image, Augment};
use crate::data::Dataset;
use crate::tensor::Shape;

/// A global batch gathered on the host: x (B, *sample_shape) as f32, y (B, targets): a
/// label per sample, or per position of a sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub x: Vec<f32>,
    pub y: Vec<u32>,
    pub sample_shape: Shape,
    /// Labels per sample (the dataset's `targets_per_sample`).
    pub targets: usize,
}

impl Batch {
    /// Gathers the samples `indices` of `data`, in that order.
    pub fn gather(data: &Dataset, indices: &[usize]) -> Batch {
        let per = data.sample_shape().numel();
        let mut x = vec![0.0; indices.len() * per];
        let targets = data.targets_per_sample();
        let mut y = vec![0; indices.len() * targets];
        data.gather_into(indices, &mut x, &mut y);
        Batch { x, y, sample_shape: data.sample_shape().clone(), targets }
    }

    /// Gathers the training samples `indices` of `data` in that order, each image
    /// augmented as `augment` draws for it from (`seed`, `epoch`, its index in `data`):
    /// the same pixels whichever device, process or row of the batch it goes to.
    /// `augment` must suit the samples ([`Augment::check`]); [`Augment::NONE`] is
    /// [`Batch::gather`].
    pub fn gather_augmented(data: &Dataset, indices: &[usize], augment: &Augment, seed: u64, epoch: usize) -> Batch {
        let mut batch = Batch::gather(data, indices);
        let &[c, h, w] = batch.sample_shape.dims() else {
            debug_assert!(augment.is_none(), "Augment::check refuses samples that are not (C, H, W)");
            return batch;
        };
        if augment.is_none() {
            return batch;
        }
        // x: (B, C, H, W); one image's scratch copy at a time.
        let mut image = vec![0.0f32; c * h * w];
        for (&i, row) in indices.iter().zip(batch.x.chunks_exact_mut(c * h * w)) {
            image.copy_from_slice(row);
            augment_image(&image, row, (c, h, w), augment.padding(), augment.draw(seed, epoch, i));
        }
        batch
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len() / self.targets
    }

    /// True for a batch without samples.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// The labels of the samples `rows`.
    pub fn labels(&self, rows: &std::ops::Range<usize>) -> &[u32] {
        &self.y[rows.start * self.targets..rows.end * self.targets]
    }
}
