//! What a run tells its caller: per-step and per-epoch reports, the [`Observer`] that
//! receives them on the coordinator's thread, and the final [`TrainReport`].

use std::time::Duration;

use crate::nn::loss::Metrics;
use crate::nn::ParamStore;
use crate::optim::Optimizer;
use crate::tensor::Device;

/// One replica's share of a step, as reported to observers.
#[derive(Clone, Debug)]
pub struct ShardReport {
    pub device: Device,
    /// The process whose device trained it, in a run of several processes (MPI).
    pub rank: Option<usize>,
    /// Logical replica index.
    pub replica: usize,
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

/// Summary of one epoch.
#[derive(Clone, Debug)]
pub struct EpochReport {
    /// 0-based.
    pub epoch: usize,
    pub epochs: usize,
    pub train: Metrics,
    pub test: Option<Metrics>,
    pub steps: u64,
    pub seconds: f64,
    pub samples_per_sec: f64,
}

/// Receives progress from the coordinator thread (so output never interleaves).
pub trait Observer {
    fn on_step(&mut self, _event: &StepEvent<'_>) {}
    fn on_epoch(&mut self, _event: &EpochReport) {}
}

/// An observer that ignores everything.
pub struct Silent;
impl Observer for Silent {}

/// What a run returns.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// Final parameters and buffers (identical on every replica).
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
}
