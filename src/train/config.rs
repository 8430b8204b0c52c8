//! What a run is asked to do: [`TrainConfig`] (everything but the model, the data and the
//! devices) and its checks that need neither data nor devices. A configuration is data
//! (serde): the command line stores the one a run trains with in its checkpoints.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::report::HeldOut;
use super::scatter::{LastBatch, Shuffle};
use crate::checkpoint::{CheckpointPolicy, Resume};
use crate::data::augment::Augment;
use crate::error::{Error, Result};
use crate::exchange::codec::Compression;
use crate::nn::ParamStore;
use crate::ops::cross_entropy::CrossEntropy;
use crate::optim::{DecayOn, LrSchedule, OptimizerConfig, Sharding};

/// What to do when the loss is NaN or infinite.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NonFinite {
    /// Stop with `Error::NonFiniteLoss`, naming the step.
    Error,
    /// Keep training.
    Allow,
}

/// Why a run is asked to stop at the next step boundary (`Trainer::stop_request`):
/// `TrainConfig::stop` raised, or `TrainConfig::max_duration` passed.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum StopRequest {
    /// `TrainConfig::max_duration` has passed.
    TimeLimit,
    /// `TrainConfig::stop` was raised (a signal): it wins over the time limit.
    Interrupt,
}

impl StopRequest {
    /// The word a step record carries between processes (0: no request).
    pub(super) fn word(request: Option<StopRequest>) -> u64 {
        match request {
            None => 0,
            Some(StopRequest::TimeLimit) => 1,
            Some(StopRequest::Interrupt) => 2,
        }
    }

    pub(super) fn from_word(word: u64) -> Option<StopRequest> {
        match word {
            0 => None,
            1 => Some(StopRequest::TimeLimit),
            _ => Some(StopRequest::Interrupt),
        }
    }
}

/// Keras's `EarlyStopping(monitor="val_loss")`: stop once the held-out loss has not
/// improved on the best epoch's by more than `min_delta` for `patience` epochs.
#[derive(Clone, Copy, PartialEq, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopping {
    /// Epochs without improvement tolerated after the best one (Keras's `patience`).
    pub patience: usize,
    /// The least decrease of the loss that counts as an improvement (Keras's
    /// `min_delta`, default 0).
    pub min_delta: f64,
}

impl EarlyStopping {
    /// Stop after `patience` epochs without improvement, any decrease counting.
    pub fn patience(patience: usize) -> EarlyStopping {
        EarlyStopping { patience, min_delta: 0.0 }
    }
}

/// Everything about a run but the model, the data and the devices.
///
/// Serialized (serde), it is what the run is configured by: the parts that are the run's
/// state or its caller's handles — the initial weights, the state resumed, the checkpoint
/// policy, the stop flag — are left out, and read back as `None`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub epochs: usize,
    /// Stop after this many steps in all, if fewer than the epochs hold.
    pub max_steps: Option<u64>,
    /// Stop at the first step boundary past this much time since the run started
    /// (`with_trainer` or `train_data_parallel` called; a resumed run's clock starts
    /// again): a checkpoint is written if a policy is set, and the report says
    /// `Stopped::TimeLimit`. With several processes, they stop at the same step, the
    /// first at which any of them is past its limit. A batch scheduler's wall time, or a
    /// notebook's cell, is the use.
    pub max_duration: Option<Duration>,
    /// The GLOBAL batch size: samples per step whatever the number of devices.
    pub batch_size: usize,
    pub optimizer: OptimizerConfig,
    /// How the learning rate changes over the run's steps, after the warm-up.
    pub schedule: LrSchedule,
    /// Linear warm-up: step s < N runs at (s + 1)/N of the rate, then `schedule` runs over
    /// the remaining steps (`LrSchedule::scale_after_warmup`). 0: none.
    pub warmup_steps: u64,
    /// Which parameters the optimiser's weight decay applies to (PyTorch's parameter
    /// groups): by default the weights (tensors of 2 or more dimensions), not BatchNorm's
    /// parameters nor the biases.
    pub weight_decay_on: DecayOn,
    /// Clip the gradient to this global L2 norm (`torch.nn.utils.clip_grad_norm_`), the
    /// norm of the exchange's sum ÷ the batch (the mean's gradient), before the update.
    pub clip_grad_norm: Option<f32>,
    pub seed: u64,
    pub shuffle: Shuffle,
    pub last_batch: LastBatch,
    /// Logical replicas R (default: the number of devices); must be a multiple of it.
    pub replicas: Option<usize>,
    /// Compare every replica's tensors every K steps (and at the end). Default: every 100
    /// steps, in every build profile (hashing the tensors costs about a microsecond per
    /// 1,000 values); `None` turns it off.
    pub check_replicas_every: Option<u64>,
    pub non_finite: NonFinite,
    /// Weights to start from instead of a seeded initialisation.
    #[serde(skip)]
    pub initial: Option<ParamStore>,
    /// Continue a run from this state (weights, optimiser, position) instead of starting.
    #[serde(skip)]
    pub resume: Option<Resume>,
    /// Write checkpoints as this says.
    #[serde(skip)]
    pub checkpoint: Option<CheckpointPolicy>,
    /// Raised (e.g. by a SIGINT handler) to stop after the current step; a checkpoint
    /// is written if a policy is set, and the run returns its report with
    /// `Stopped::Interrupted` (the weights of the last step taken).
    #[serde(skip)]
    pub stop: Option<Arc<AtomicBool>>,
    /// What the held-out set given to the fit loop is (how reports name it).
    pub held_out: HeldOut,
    /// Stop when the held-out loss stops improving (needs a held-out set).
    pub early_stopping: Option<EarlyStopping>,
    /// Write the weights of every epoch whose held-out loss is the best so far here
    /// (atomically; Keras's `ModelCheckpoint(save_best_only=True)`). Needs a held-out set.
    pub save_best: Option<PathBuf>,
    /// Samples per forward pass in evaluation, at most (the memory estimate counts a pass
    /// of this many). The evaluation after each epoch of
    /// [`train_data_parallel`](crate::train::train_data_parallel) takes no more than the
    /// rows of one training forward pass ([`TrainConfig::epoch_eval_chunk`]), so that it
    /// reuses the memory the steps allocate and adds none of its own.
    pub eval_batch: usize,
    /// Global batches the loader may gather ahead of the step being trained.
    pub prefetch: usize,
    /// Gradient accumulation (PyTorch's `no_sync`): the global batch of a step is processed
    /// as K micro-batches one after another, ONE exchange and one update per step
    /// (train/step.rs says how the rows are cut, and where the weights are bitwise those
    /// of K = 1). 1: none.
    pub accumulate: usize,
    /// How gradients travel between the logical replicas (`exchange::codec`).
    pub grad_compression: Compression,
    /// Where the optimiser state lives: on every device, or sharded (ZeRO stage 1).
    pub optimizer_sharding: Sharding,
    /// How the training images are augmented (random crop after zero padding, random
    /// horizontal flip), drawn from (seed, epoch, sample index): applied by the fit
    /// loop's loader, never to a held-out set. A loop of the caller's own gathers with
    /// `Batch::gather_augmented`.
    pub augment: Augment,
    /// Label smoothing ε, 0 ≤ ε < 1 (PyTorch's `cross_entropy(label_smoothing=ε)`): the
    /// loss trained, and the loss every report gives, training and held-out alike, is
    /// (1 − ε)·CE(label) + ε·mean over the classes of −log p. 0: plain cross-entropy.
    pub label_smoothing: f32,
    /// For training data that is a token stream (`Dataset::windows`, a text), whose
    /// windows are drawn rather than visited once: the steps between two evaluations of
    /// the held-out set, each an "epoch" of the reports, the checkpoints' positions and
    /// early stopping. None: [`DEFAULT_EVAL_EVERY`]. Stored samples (images) evaluate
    /// after every real epoch, and refuse it.
    pub eval_every: Option<usize>,
    /// For a held-out token stream: how many batches of `batch_size` windows each
    /// evaluation scores, drawn once for the run. None: [`DEFAULT_EVAL_BATCHES`].
    pub eval_batches: Option<usize>,
}

/// Steps between evaluations of a text run: nanoGPT's `eval_interval`.
pub const DEFAULT_EVAL_EVERY: usize = 250;
/// Batches of held-out windows per evaluation: nanoGPT's CPU recipe's `eval_iters`.
pub const DEFAULT_EVAL_BATCHES: usize = 20;

impl TrainConfig {
    /// Samples per forward pass of the evaluation after each epoch, with `replicas` logical
    /// replicas: `eval_batch`, but no more than one training forward pass's rows (a
    /// logical replica's shard of the batch, ÷ `accumulate`). Tensors of the sizes the
    /// steps allocate are what the allocator holds for them already; passes of 512 windows
    /// made the GPT's resident memory grow at each of the first evaluations (the
    /// allocator keeping each pass's attention scores and MLP), to 1.7× the run's
    /// estimate with 600 windows a device (issue 41).
    pub fn epoch_eval_chunk(&self, replicas: usize) -> usize {
        let shard = self.batch_size.div_ceil(replicas.max(1));
        self.eval_batch.min(shard.div_ceil(self.accumulate.max(1))).max(1)
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 1,
            max_steps: None,
            max_duration: None,
            batch_size: 64,
            optimizer: OptimizerConfig::adam(1e-3),
            schedule: LrSchedule::Constant,
            warmup_steps: 0,
            weight_decay_on: DecayOn::Weights,
            clip_grad_norm: None,
            seed: 0,
            shuffle: Shuffle::Seeded,
            last_batch: LastBatch::Keep,
            replicas: None,
            // The same in every build profile: a debug build (a notebook's) trains with the
            // configuration of a release build.
            check_replicas_every: Some(100),
            non_finite: NonFinite::Error,
            initial: None,
            resume: None,
            checkpoint: None,
            stop: None,
            held_out: HeldOut::Test,
            early_stopping: None,
            save_best: None,
            eval_batch: 512,
            prefetch: 4,
            accumulate: 1,
            grad_compression: Compression::None,
            optimizer_sharding: Sharding::Replicated,
            augment: Augment::NONE,
            label_smoothing: 0.0,
            eval_every: None,
            eval_batches: None,
        }
    }
}

impl TrainConfig {
    /// Checks the values that do not depend on the data.
    pub fn validate(&self) -> Result<()> {
        if self.batch_size == 0 {
            return Err(Error::config("batch size", "must be at least 1"));
        }
        if self.eval_batch == 0 {
            return Err(Error::config("evaluation batch size", "must be at least 1"));
        }
        match self.replicas {
            Some(0) => return Err(Error::config("replicas", "must be at least 1")),
            // A logical replica owns a shard of every global batch: past the batch size
            // some would never see a sample, and each still costs a gradient slot.
            Some(r) if r > self.batch_size => {
                return Err(Error::config(
                    "replicas",
                    format!(
                        "{r} logical replicas for a global batch of {}: at most one per sample of the batch",
                        self.batch_size
                    ),
                ))
            }
            _ => {}
        }
        if self.accumulate == 0 {
            return Err(Error::config("accumulate", "must be at least 1 (micro-batches per step)"));
        }
        if let Some(c) = self.clip_grad_norm {
            if !(c > 0.0 && c.is_finite()) {
                return Err(Error::config("clip-grad-norm", format!("must be a positive number, got {c}")));
            }
        }
        if self.eval_every == Some(0) {
            return Err(Error::config("eval-every", "must be at least 1 step"));
        }
        if self.eval_batches == Some(0) {
            return Err(Error::config("eval-batches", "must be at least 1"));
        }
        if self.check_replicas_every == Some(0) {
            return Err(Error::config("check-replicas-every", "must be at least 1"));
        }
        CrossEntropy::new(self.label_smoothing)?;
        self.optimizer.validate()
    }

    /// The loss this run trains and reports.
    pub fn loss(&self) -> CrossEntropy {
        CrossEntropy { label_smoothing: self.label_smoothing }
    }
}
