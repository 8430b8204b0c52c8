//! The flags of `train` that act on the data and the loss rather than on the step —
//! `--augment` (random crop after zero padding, horizontal flip) and `--label-smoothing` —
//! their checks, and what they add to a configuration (which a checkpoint stores) and to
//! the run's fingerprint. The arithmetic is the library's (`data::augment`,
//! `ops::cross_entropy::CrossEntropy`); one file, so that `train.rs` names them in one line each.

use crate::data::augment::Augment;

use super::*;

#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Augmentation and label smoothing")]
pub(crate) struct RegularizeArgs {
    /// Augment the training images: crop=P pads P zero pixels on each side and takes a
    /// random window of the image's size (torchvision's RandomCrop(size, padding=P)), flip
    /// mirrors left to right with probability 1/2 (RandomHorizontalFlip), e.g. crop=4,flip.
    /// Drawn from (--seed, epoch, sample index): the same on any devices and through a
    /// resume. Held-out data is never augmented.
    #[arg(long, value_name = "crop=P,flip", value_parser = parse_augment)]
    pub(crate) augment: Option<Augment>,
    /// Label smoothing EPS, 0 <= EPS < 1, as PyTorch's cross_entropy(label_smoothing=EPS):
    /// the loss trained and reported (training and held-out) is (1 - EPS)·CE(label) +
    /// EPS·mean over the classes of -log p. Accuracy is unchanged (arg-max vs label).
    #[arg(allow_negative_numbers = true, long, value_name = "EPS", default_value_t = 0.0)]
    pub(crate) label_smoothing: f32,
}

/// `--augment`'s parser: the library's words, its message without the library's prefix.
fn parse_augment(text: &str) -> Result<Augment, String> {
    Augment::parse(text).map_err(|e| match e {
        crate::Error::Config { detail, .. } => detail,
        other => other.to_string(),
    })
}

impl RegularizeArgs {
    /// The checks that need no data.
    pub(crate) fn check(&self) -> CliResult {
        if !(0.0..1.0).contains(&self.label_smoothing) {
            return Err(Failure::usage(anyhow!("--label-smoothing must be in [0, 1), got {}", self.label_smoothing)));
        }
        Ok(())
    }

    /// The augmentation asked for (none without `--augment`).
    fn augment(&self) -> Augment {
        self.augment.unwrap_or(Augment::NONE)
    }

    /// `--augment` suits the training samples: images (C, H, W).
    pub(crate) fn check_data(&self, train: &Dataset) -> CliResult {
        let shape = train.sample_shape();
        match (self.augment, shape.dims()) {
            (None, _) | (Some(_), [_, _, _]) => Ok(()),
            (Some(a), _) => Err(Failure::usage(anyhow!(
                "--augment {} needs image data (samples of shape (C, H, W)); the samples of {} are {shape}",
                a.name(),
                train.name()
            ))),
        }
    }

    /// `config` with these settings.
    pub(crate) fn config(&self, config: TrainConfig) -> TrainConfig {
        TrainConfig { augment: self.augment(), label_smoothing: self.label_smoothing, ..config }
    }

    /// Their part of the run's fingerprint: both change the arithmetic, so both are named
    /// always (a run resumes only a checkpoint that agrees, none included).
    pub(crate) fn fingerprint(&self) -> [(String, String); 2] {
        [
            ("augment".to_string(), self.augment().name()),
            ("label_smoothing".to_string(), self.label_smoothing.to_string()),
        ]
    }

    /// The settings in use, in words (none: empty).
    pub(crate) fn described(&self) -> Vec<String> {
        let mut parts = Vec::new();
        if let Some(a) = self.augment {
            parts.push(format!("augment {}", a.name()));
        }
        if self.label_smoothing != 0.0 {
            parts.push(format!("label smoothing {}", self.label_smoothing));
        }
        parts
    }
}
