//! What a run tells its caller: per-step and per-epoch reports, the [`Observer`] that
//! receives them on the coordinator's thread, and the final [`TrainReport`] with why the
//! run stopped.

use std::path::PathBuf;
use std::time::Duration;

pub use crate::checkpoint::BestEpoch;
use crate::nn::loss::Metrics;
use crate::nn::ParamStore;
use crate::optim::Optimizer;
use crate::tensor::Device;

/// One shard's share of a step, as reported to observers.
#[derive(Clone, Debug)]
pub struct ShardReport {
    pub device: Device,
    /// The process whose device trained it, in a run of several processes (MPI).
    pub process: Option<usize>,
    /// The shard: its logical replica's index.
    pub shard: usize,
    pub metrics: Metrics,
}

/// What happened in one step.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Global step index (0-based).
    pub step: u64,
    /// Metrics of the whole global batch (loss computed before the update).
    pub metrics: Metrics,
    pub shards: Vec<ShardReport>,
    /// Slowest worker's compute (forward, backward, update) and reduce-scatter time.
    pub compute: Duration,
    pub reduce: Duration,
    /// Wall time of the step, as seen by the coordinator.
    pub wall: Duration,
}

/// A step event for observers.
#[derive(Clone, Debug)]
pub struct StepEvent<'a> {
    pub report: &'a StepReport,
    /// 0-based epoch and its number of steps.
    pub epoch: usize,
    pub epochs: usize,
    pub step_in_epoch: usize,
    pub steps_in_epoch: usize,
    /// Steps the whole run will have taken at its end (resumed steps included).
    pub total_steps: u64,
    /// Time the coordinator waited for the loader.
    pub data_wait: Duration,
}

/// What the held-out set given to the fit loop is: it is evaluated after every epoch
/// either way, and named by this in reports, logs and files (`test_*` or `val_*`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum HeldOut {
    /// The test split: a measure, never a choice (early stopping refuses it on the
    /// command line, as Keras monitors `val_loss`).
    Test,
    /// A validation split, held out of the training data to choose epochs by.
    Validation,
}

impl HeldOut {
    /// "test" or "validation", as the epoch lines say.
    pub fn name(self) -> &'static str {
        match self {
            HeldOut::Test => "test",
            HeldOut::Validation => "validation",
        }
    }
}

/// Summary of one epoch.
#[derive(Clone, Debug)]
pub struct EpochReport {
    /// 0-based.
    pub epoch: usize,
    pub epochs: usize,
    /// The whole epoch's training loss and accuracy (computed before each step's
    /// update), steps taken before a resume included.
    pub train: Metrics,
    /// The held-out set after this epoch, when it is the test split.
    pub test: Option<Metrics>,
    /// The held-out set after this epoch, when it is a validation split.
    pub val: Option<Metrics>,
    /// True when the held-out loss is the lowest of the run so far (Keras's "val_loss
    /// improved"): the epoch `save_best` writes.
    pub best: bool,
    /// Steps of this epoch, resumed ones included.
    pub steps: u64,
    pub seconds: f64,
    pub samples_per_sec: f64,
}

impl EpochReport {
    /// The held-out metrics, whichever set they are.
    pub fn held_out(&self) -> Option<&Metrics> {
        self.val.as_ref().or(self.test.as_ref())
    }
}

/// A held-out evaluation outside the epochs: the test split evaluated once at the end of
/// a run that chose its epochs on a validation split.
#[derive(Clone, Debug)]
pub struct EvaluationReport {
    pub set: HeldOut,
    /// Steps taken when the weights were evaluated.
    pub step: u64,
    pub metrics: Metrics,
}

/// Receives progress from the coordinator thread (so output never interleaves).
pub trait Observer {
    fn on_step(&mut self, _event: &StepEvent<'_>) {}
    fn on_epoch(&mut self, _event: &EpochReport) {}
    /// A final evaluation (see [`EvaluationReport`]).
    fn on_evaluation(&mut self, _event: &EvaluationReport) {}
}

/// An observer that ignores everything.
pub struct Silent;
impl Observer for Silent {}

/// Why a run ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Stopped {
    /// Every epoch (or `max_steps`) trained.
    Completed,
    /// Early stopping: the held-out loss had not improved for `patience` epochs since
    /// the best one, `best_epoch` (0-based).
    EarlyStopping { best_epoch: usize },
    /// The stop flag was raised (a signal): the run ended after the step it was in,
    /// and wrote a checkpoint there if it has a checkpoint policy.
    Interrupted { checkpoint: Option<PathBuf> },
}

/// What a run returns.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// Final parameters and buffers (identical on every replica): those of the last
    /// step taken, also when the run stopped early or was interrupted.
    pub weights: ParamStore,
    /// Final optimiser state (identical on every replica).
    pub optimizer: Optimizer,
    pub epochs: Vec<EpochReport>,
    /// Mean loss of every step, computed before its update.
    pub losses: Vec<f64>,
    pub steps: u64,
    pub seconds: f64,
    /// Training samples per second over the whole run (evaluation excluded).
    pub samples_per_sec: f64,
    pub stopped: Stopped,
    /// The best held-out epoch of the run, resumed epochs included (none without a
    /// held-out set).
    pub best: Option<BestEpoch>,
}
