//! The global batch: the samples of one optimiser step, gathered on the host by the
//! loader thread (or by the caller of `Trainer::step`) before the scatter cuts it. The
//! loader augments the training images here (`data::augment`), once per sample on the
//! host, before any device sees them. A sample of several model inputs is their values
//! one after another (`Dataset::from_inputs`); [`Batch::input_rows`] is the one place
//! that cuts rows of the batch back into each input's tensor, for training, evaluation
//! and prediction alike.

use std::borrow::Cow;
use std::ops::Range;

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
    /// Each model input's part of a sample, in the model's input order
    /// (`Dataset::input_shapes`): `[sample_shape]` for a model of one input; for several,
    /// their values lie one after another in each sample's row of `x`.
    pub inputs: Vec<Shape>,
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
        Batch { x, y, sample_shape: data.sample_shape().clone(), inputs: data.input_shapes().to_vec(), targets }
    }

    /// The samples `rows` cut into the model's inputs: for each input k, in the model's
    /// order, its values (rows, *shape_k) and those dims. The one cut of a batch into
    /// inputs: every replica's training, evaluation and prediction take it.
    pub fn input_rows(&self, rows: &Range<usize>) -> Vec<(Vec<f32>, Vec<usize>)> {
        let per = self.sample_shape.numel();
        // x: (B, per); the rows' part is (rows, per).
        let x = &self.x[rows.start * per..rows.end * per];
        let dims = |s: &Shape| [&[rows.len()][..], s.dims()].concat();
        if let [one] = self.inputs.as_slice() {
            return vec![(x.to_vec(), dims(one))];
        }
        let mut at = 0;
        self.inputs
            .iter()
            .map(|s| {
                // input k: (rows, *shape_k), its values at [at, at + numel_k) of each row.
                let part = at..at + s.numel();
                at = part.end;
                let mut v = Vec::with_capacity(rows.len() * s.numel());
                for row in x.chunks_exact(per) {
                    v.extend_from_slice(&row[part.clone()]);
                }
                (v, dims(s))
            })
            .collect()
    }

    /// The samples `rows` laid out input by input: every row's values of input 0, then of
    /// input 1, and so on ([`Batch::input_rows`] one after another), so that any run of
    /// rows of one input is contiguous: what a GPU replica stages. For a model of one
    /// input, the rows as they lie, not copied.
    pub fn inputs_apart(&self, rows: &Range<usize>) -> Cow<'_, [f32]> {
        let per = self.sample_shape.numel();
        match self.inputs.len() {
            0 | 1 => Cow::Borrowed(&self.x[rows.start * per..rows.end * per]),
            _ => Cow::Owned(self.input_rows(rows).into_iter().flat_map(|(values, _)| values).collect()),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Features;

    #[test]
    fn rows_are_cut_into_each_inputs_tensor() {
        // Three samples of (2,) then (1, 2): sample i holds 10i + 0..4.
        let part = |k: usize, w: usize| {
            Features::F32((0..3).flat_map(|i| (0..w).map(move |j| (10 * i + k + j) as f32)).collect())
        };
        let parts = vec![(Shape::new([2]), part(0, 2)), (Shape::new([1, 2]), part(2, 2))];
        let data = Dataset::from_inputs("d", parts, vec![0, 1, 0], 1, 2).unwrap();
        let batch = Batch::gather(&data, &[2, 0, 1]);
        assert_eq!(batch.x, [20., 21., 22., 23., 0., 1., 2., 3., 10., 11., 12., 13.]);
        let cut = batch.input_rows(&(1..3));
        assert_eq!(cut[0], (vec![0., 1., 10., 11.], vec![2, 2]));
        assert_eq!(cut[1], (vec![2., 3., 12., 13.], vec![2, 1, 2]));
        // One input: the rows as they are.
        let one = Dataset::new("o", [1, 2], Features::F32(vec![1., 2., 3., 4.]), vec![0, 1], 2).unwrap();
        assert_eq!(Batch::gather(&one, &[1, 0]).input_rows(&(0..1)), [(vec![3., 4.], vec![1, 1, 2])]);
    }
}
