//! What a run tells its caller: per-step and per-epoch reports, the [`Observer`] that
//! receives them on the coordinator's thread, and the final [`TrainReport`] with why the
//! run stopped.

use std::path::PathBuf;
use std::time::Duration;

pub use crate::checkpoint::BestEpoch;
use crate::nn::ParamStore;
use crate::ops::cross_entropy::Metrics;
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
#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
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
    /// Steps of the run done at this epoch's end (1-based, as the metrics files number
    /// them: the step that ended the epoch).
    pub step_at_end: u64,
    pub seconds: f64,
    /// Labels trained per second: samples, or a text's tokens.
    pub samples_per_sec: f64,
    /// For a run over a token stream (a text), whose "epochs" are the periods between
    /// evaluations: (the steps taken at this evaluation, the run's steps). None for
    /// stored samples.
    pub steps_of_run: Option<(u64, u64)>,
}

impl EpochReport {
    /// The held-out metrics, whichever set they are.
    pub fn held_out(&self) -> Option<&Metrics> {
        self.val.as_ref().or(self.test.as_ref())
    }

    /// The epoch line of the CLI:
    /// `epoch  3/15 | train loss 0.1234 acc 0.9612 | test loss 0.0981 acc 0.9722 | 5210 samples/s | 0.66s | best`.
    /// `held_out` names what the per-epoch evaluation ran on: "test" or "validation";
    /// `best` ends the line of an epoch whose held-out loss is the lowest so far.
    pub fn line(&self, held_out: &str) -> String {
        use std::fmt::Write as _;
        if let Some((step, total)) = self.steps_of_run {
            // A text run's eval line: `step  250/2000 | train loss 2.3456 | validation
            // loss 2.4012 | 31250 tokens/s | 6.10s | best`.
            let width = total.to_string().len();
            let mut line = format!("step {step:>width$}/{total} | train loss {:.4}", self.train.mean_loss());
            if let Some(t) = self.held_out() {
                let _ = write!(line, " | {held_out} loss {:.4}", t.mean_loss());
            }
            let _ = write!(line, " | {:.0} tokens/s | {:.2}s", self.samples_per_sec, self.seconds);
            if self.best {
                line.push_str(" | best");
            }
            return line;
        }
        let width = self.epochs.to_string().len();
        let mut line = format!(
            "epoch {:>width$}/{} | train loss {:.4} acc {:.4}",
            self.epoch + 1,
            self.epochs,
            self.train.mean_loss(),
            self.train.accuracy()
        );
        if let Some(t) = self.held_out() {
            let _ = write!(line, " | {held_out} loss {:.4} acc {:.4}", t.mean_loss(), t.accuracy());
        }
        let _ = write!(line, " | {:.0} samples/s | {:.2}s", self.samples_per_sec, self.seconds);
        if self.best {
            line.push_str(" | best");
        }
        line
    }
}

/// The CLI's epoch line, the held-out set named by which one it is.
impl std::fmt::Display for EpochReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held_out = if self.val.is_some() { HeldOut::Validation } else { HeldOut::Test };
        f.write_str(&self.line(held_out.name()))
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

/// Step losses a report keeps at least (8 MiB of them): see [`TrainReport::losses`].
pub const LOSSES_KEPT: usize = 1 << 20;

/// Why a run ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Stopped {
    /// Every epoch (or `max_steps`) trained.
    Completed,
    /// Early stopping: the held-out loss had not improved for `patience` epochs since
    /// the best one, `best_epoch` (0-based).
    EarlyStopping { best_epoch: usize },
    /// The stop flag was raised (a signal): the run ended after the step it was in,
    /// and wrote a checkpoint there if it has a checkpoint policy. `evaluation`: the
    /// held-out evaluation after that step, when the flag cut it short (it is not
    /// reported; a run resumed from the checkpoint does it first, unless that step was
    /// the run's last).
    Interrupted { checkpoint: Option<PathBuf>, evaluation: Option<StoppedEvaluation> },
    /// The run reached `TrainConfig::max_duration`: it ended after the step in which the
    /// time ran out, and wrote a checkpoint there if it has a checkpoint policy.
    TimeLimit { checkpoint: Option<PathBuf> },
}

/// A held-out evaluation given up between chunks once the stop flag was raised: the
/// samples evaluated before it stopped, of the `of` it had to evaluate. Over several
/// devices (and processes), their sums: `evaluated < of` always, since an evaluation
/// that finished every chunk on every device is not given up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoppedEvaluation {
    pub evaluated: u64,
    pub of: u64,
}

/// What a run returns. Its `Display` is the CLI's summary (an epoch line each, then the
/// steps, time and samples/s, and why it stopped); its `Debug` names the weights and the
/// optimiser state by length and digest, and the losses by count, first and last.
#[derive(Clone)]
pub struct TrainReport {
    /// Final parameters and buffers (identical on every replica): those of the last
    /// step taken, also when the run stopped early or was interrupted.
    pub weights: ParamStore,
    /// Final optimiser state (identical on every replica).
    pub optimizer: Optimizer,
    pub epochs: Vec<EpochReport>,
    /// Mean loss of each step, computed before its update: every step this call trained,
    /// in a run of up to [`LOSSES_KEPT`] of them; of a longer one, the last `LOSSES_KEPT`
    /// at least (and fewer than twice that), so that a run's memory stays flat however
    /// long it is. The first one kept is that of step `steps - losses.len()` (0-based).
    pub losses: Vec<f64>,
    /// Steps of the run done when it ended, resumed ones included.
    pub steps: u64,
    /// Steps of the run done when this call started (0, or the step it resumed from).
    pub first_step: u64,
    pub seconds: f64,
    /// Training samples per second over the whole run (evaluation excluded).
    pub samples_per_sec: f64,
    pub stopped: Stopped,
    /// The best held-out epoch of the run, resumed epochs included (none without a
    /// held-out set).
    pub best: Option<BestEpoch>,
}

impl std::fmt::Display for TrainReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for e in &self.epochs {
            writeln!(f, "{e}")?;
        }
        write!(f, "trained {} steps in {:.2}s ({:.0} samples/s)", self.steps, self.seconds, self.samples_per_sec)?;
        match &self.stopped {
            Stopped::Completed => Ok(()),
            Stopped::EarlyStopping { best_epoch } => write!(f, "; stopped early, best epoch {}", best_epoch + 1),
            Stopped::Interrupted { checkpoint: Some(p), .. } => write!(f, "; interrupted, checkpoint {}", p.display()),
            Stopped::Interrupted { checkpoint: None, .. } => write!(f, "; interrupted"),
            Stopped::TimeLimit { checkpoint: Some(p) } => {
                write!(f, "; stopped at the time limit, checkpoint {}", p.display())
            }
            Stopped::TimeLimit { checkpoint: None } => write!(f, "; stopped at the time limit"),
        }
    }
}

impl std::fmt::Debug for TrainReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let losses = match (self.losses.first(), self.losses.last()) {
            (Some(a), Some(b)) => format!("{} steps, first {a:.4}, last {b:.4}", self.losses.len()),
            _ => "none".to_string(),
        };
        f.debug_struct("TrainReport")
            .field("weights", &self.weights)
            .field("optimizer", &self.optimizer)
            .field("epochs", &self.epochs)
            .field("losses", &format_args!("{losses}"))
            .field("steps", &self.steps)
            .field("first_step", &self.first_step)
            .field("seconds", &self.seconds)
            .field("samples_per_sec", &self.samples_per_sec)
            .field("stopped", &self.stopped)
            .field("best", &self.best)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::OptimizerConfig;

    fn report(values: usize, steps: usize) -> TrainReport {
        let m = |loss_sum, correct, count| Metrics { loss_sum, correct, count };
        let epoch = EpochReport {
            epoch: 0,
            epochs: 1,
            train: m(40.0, 90, 100),
            test: Some(m(30.0, 95, 100)),
            val: None,
            best: true,
            steps: steps as u64,
            step_at_end: steps as u64,
            seconds: 0.5,
            samples_per_sec: 200.0,
            steps_of_run: None,
        };
        TrainReport {
            weights: ParamStore { params: vec![0.5; values], buffers: vec![1.0; 64] },
            optimizer: Optimizer::new(OptimizerConfig::adam(1e-3), values),
            epochs: vec![epoch],
            losses: (0..steps).map(|k| 1.0 / (k + 1) as f64).collect(),
            steps: steps as u64,
            first_step: 0,
            seconds: 0.5,
            samples_per_sec: 200.0,
            stopped: Stopped::Completed,
            best: None,
        }
    }

    #[test]
    fn a_reports_debug_is_short_whatever_the_model_and_its_display_is_the_clis() {
        // A million parameters with Adam's two moments: 3 million values, none printed.
        let r = report(1_000_000, 5_000);
        let debug = format!("{r:?}");
        assert!(debug.len() < 1_500, "{} characters: {debug}", debug.len());
        assert!(debug.contains("params: 1000000 values, fnv1a "), "{debug}");
        assert!(debug.contains("m: 1000000 values") && debug.contains("losses: 5000 steps, first 1.0000, last 0.0002"));
        assert_eq!(
            r.to_string(),
            "epoch 1/1 | train loss 0.4000 acc 0.9000 | test loss 0.3000 acc 0.9500 | 200 samples/s | 0.50s | best\n\
             trained 5000 steps in 0.50s (200 samples/s)"
        );
        assert_eq!(r.epochs[0].train.to_string(), "loss 0.4000 accuracy 0.9000 (90/100)");
        // Two stores of other values have other digests.
        let other = ParamStore { params: vec![0.25; 1_000_000], buffers: vec![1.0; 64] };
        assert_ne!(format!("{:?}", r.weights), format!("{other:?}"));
    }
}
