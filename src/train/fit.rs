//! The fit loop: [`train_data_parallel`] runs epochs of steps over a dataset on a
//! [`Trainer`], with the loader thread ahead of it, observers, replica checks, evaluation
//! after every epoch, the best epoch (early stopping, `save_best`), checkpoints that
//! carry the epoch's running metrics, and the stop flag; and [`check_data`], the checks
//! of a dataset against a model. Small pieces, one concern each: [`RunSpan`] (the run's
//! shape), `Fit::step`, `Fit::end_epoch`, `Fit::note_best`, `Fit::checkpoint`.
//!
//! In a run of several processes (MPI) every process runs this loop in step with the
//! others, on the same merged reports (so that they stop, stop early and check alike):
//! its loader gathers only its own shards' rows, and process 0 alone owns the checkpoint
//! directory and writes checkpoints and `save_best`.

use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver};

use super::step::Evaluated;
use super::trainer::{with_trainer_evaluating, ProcessRows};
use super::{
    scatter, Batch, BestEpoch, EpochReport, HeldOut, NonFinite, Observer, Silent, StepEvent, StopRequest, Stopped,
    StoppedEvaluation, TrainConfig, TrainReport, Trainer, DEFAULT_EVAL_BATCHES, DEFAULT_EVAL_EVERY, LOSSES_KEPT,
};
use crate::checkpoint::{self, CheckpointPolicy, Resume};
use crate::data::Dataset;
use crate::devices::Devices;
use crate::error::{Error, Result};
use crate::nn::Graph;
use crate::ops::cross_entropy::Metrics;

/// Trains `model` on `train` (evaluating on `test` after every epoch, if given) on
/// `devices`, synchronously data-parallel. One step on N devices equals one step on one
/// device with the whole global batch (up to float summation order; bitwise with a
/// fixed number of logical replicas on CPU devices, which sum the R shard gradients in
/// one tree whoever computed them). GPUs sum each device's shards in shard order, then
/// across devices (NCCL's order, or member order for device copies): bitwise across device
/// counts only where the additions coincide, e.g. R = 2 on `cuda:0` and on `cuda:0,0`.
///
/// `test` is the held-out set, named by `config.held_out` (the test split by default, or
/// a validation split); early stopping and `save_best` monitor its loss. The run ends
/// when its epochs (or `max_steps`) are done, when early stopping says so, or after the
/// step in which `config.stop` is raised, or in which `config.max_duration` runs out; the
/// report says which (`Stopped`).
///
/// ```
/// use lockstep::{data::toy, devices::Devices, models, train::{train_data_parallel, TrainConfig}};
/// use lockstep::optim::OptimizerConfig;
///
/// let data = toy::toy();
/// let model = models::toy_mlp(2, 2).unwrap();
/// let config = TrainConfig { epochs: 3, batch_size: 2, optimizer: OptimizerConfig::sgd(0.5), ..TrainConfig::default() };
/// let report = train_data_parallel(&model, &data.train, data.test.as_ref(), &Devices::cpu(2, 1).unwrap(), &config).unwrap();
/// assert_eq!(report.steps, 9);
/// ```
pub fn train_data_parallel(
    model: &Graph,
    train: &Dataset,
    test: Option<&Dataset>,
    devices: &Devices,
    config: &TrainConfig,
) -> Result<TrainReport> {
    train_data_parallel_with(model, train, test, devices, config, &mut Silent)
}

/// [`train_data_parallel`] reporting progress to `observer`.
pub fn train_data_parallel_with(
    model: &Graph,
    train: &Dataset,
    test: Option<&Dataset>,
    devices: &Devices,
    config: &TrainConfig,
    observer: &mut dyn Observer,
) -> Result<TrainReport> {
    config.validate()?;
    check_data(model, train)?;
    if !config.augment.is_none() && train.input_shapes().len() > 1 {
        return Err(Error::config(
            "augment",
            format!(
                "{} augments the images of data of one input; {} has {} input parts: augment the images before \
                 making the dataset",
                config.augment.name(),
                train.name(),
                train.input_shapes().len()
            ),
        ));
    }
    config.augment.check(train.sample_shape())?;
    if let Some(t) = test {
        check_data(model, t)?;
    }
    if train.stream().is_none() && (config.eval_every.is_some() || config.eval_batches.is_some()) {
        let what = if config.eval_every.is_some() { "eval every" } else { "eval batches" };
        return Err(Error::config(
            what,
            format!("applies to text, whose windows are drawn; {} evaluates after every epoch", train.name()),
        ));
    }
    // A held-out token stream is scored on windows drawn once for the run.
    let drawn;
    let test = match test.filter(|t| t.stream().is_some()) {
        Some(t) => {
            let count = config.eval_batches.unwrap_or(DEFAULT_EVAL_BATCHES).saturating_mul(config.batch_size);
            let (windows, bytes) = super::memory::held_out_windows(t, config);
            crate::memory::check_bytes(
                "drawing the held-out windows",
                bytes,
                format!(
                    "{} windows of {} tokens (eval_batches × batch_size)",
                    crate::units::count(windows),
                    t.sample_shape().numel()
                ),
            )?;
            drawn = t.subset(t.name(), &scatter::eval_windows(t.len(), config.seed, count));
            Some(&drawn)
        }
        None => test,
    };
    if test.is_none() && (config.early_stopping.is_some() || config.save_best.is_some()) {
        let what = if config.early_stopping.is_some() { "early stopping" } else { "save best" };
        return Err(Error::config(what, "monitors the held-out loss, and this run has no held-out set"));
    }
    let span = RunSpan::new(train, config)?;
    // Processes that would train on different data, or evaluate on it, refuse at once
    // (the digests read every byte: only where there is another process to compare with).
    let world = crate::world::current()?;
    if world.size() > 1 {
        world.agree(&super::processes::data_settings(train, test))?;
    }
    // One run per checkpoint directory, held until this returns, whatever happens; with
    // several processes, process 0's (the one that writes there).
    let voice = world.is_voice();
    let _owner = match config.checkpoint.as_ref().filter(|_| voice) {
        Some(p) => Some(checkpoint::claim_dir(&p.dir)?.begin_run()?),
        None => None,
    };
    // Its evaluations pass no more than a training pass's rows (`end_epoch`), and the
    // memory check counts no more.
    let eval_rows = super::memory::fit_eval_rows(devices, config);
    with_trainer_evaluating(model, devices, config, eval_rows, |trainer| {
        let fit = Fit { text: train.stream().is_some(), ..Fit::new(model, test, config, span, observer) };
        fit.run(trainer, train)
    })
}

/// Where the next step of a run starts. After a signal stopped an epoch's evaluation,
/// `step_in_epoch` is the epoch's length: the evaluation is what comes next.
#[derive(Clone, Copy, Debug)]
struct Position {
    /// Global steps taken.
    step: u64,
    epoch: usize,
    step_in_epoch: usize,
}

/// The shape of a run: its epochs' length, its end, and where it starts.
#[derive(Clone, Copy, Debug)]
struct RunSpan {
    steps_per_epoch: usize,
    total_steps: u64,
    start: Position,
}

impl RunSpan {
    fn new(train: &Dataset, config: &TrainConfig) -> Result<RunSpan> {
        let steps_per_epoch = match train.stream() {
            Some(_) => config.eval_every.unwrap_or(DEFAULT_EVAL_EVERY),
            None => scatter::steps_per_epoch(train.len(), config.batch_size, config.last_batch),
        };
        if steps_per_epoch == 0 {
            return Err(Error::Data {
                name: train.name().into(),
                detail: format!(
                    "{} samples make no full batch of {} (drop-last is on)",
                    train.len(),
                    config.batch_size
                ),
            });
        }
        let total_steps =
            (steps_per_epoch as u64).saturating_mul(config.epochs as u64).min(config.max_steps.unwrap_or(u64::MAX));
        let start = match &config.resume {
            Some(r) => Position { step: r.step, epoch: r.epoch, step_in_epoch: r.step_in_epoch },
            None => Position { step: 0, epoch: 0, step_in_epoch: 0 },
        };
        // `step_in_epoch` = `steps_per_epoch`: the epoch's steps are taken and its
        // evaluation is not (a signal stopped it), what the resumed run does first.
        if start.step_in_epoch > steps_per_epoch
            || start.step != (start.epoch as u64).saturating_mul(steps_per_epoch as u64) + start.step_in_epoch as u64
        {
            return Err(Error::config(
                "resume position",
                format!(
                    "step {} (epoch {}, step {} in it) is not a position of this run ({steps_per_epoch} steps per epoch)",
                    start.step, start.epoch, start.step_in_epoch
                ),
            ));
        }
        Ok(RunSpan { steps_per_epoch, total_steps, start })
    }

    /// The position after the step `i` (0-based) of `epoch`, `step` steps having been taken.
    fn after(&self, step: u64, epoch: usize, i: usize) -> Position {
        if i + 1 == self.steps_per_epoch {
            Position { step, epoch: epoch + 1, step_in_epoch: 0 }
        } else {
            Position { step, epoch, step_in_epoch: i + 1 }
        }
    }
}

/// How an epoch's end went.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum EpochEnd {
    GoOn,
    /// Early stopping ends the run; the best epoch.
    StopEarly {
        best_epoch: usize,
    },
    /// The stop flag was raised during the held-out evaluation, which was given up.
    EvaluationStopped(StoppedEvaluation),
}

/// The running sums of the epoch in progress.
struct EpochSums {
    metrics: Metrics,
    steps: u64,
    started: Instant,
    train_time: Duration,
}

impl EpochSums {
    /// An epoch that starts `steps` steps in, with those steps' `metrics` (a resume).
    fn new(metrics: Metrics, steps: u64) -> EpochSums {
        EpochSums { metrics, steps, started: Instant::now(), train_time: Duration::ZERO }
    }
}

/// A run in progress, on the coordinator's thread.
struct Fit<'a, 'o> {
    model: &'a Graph,
    test: Option<&'a Dataset>,
    config: &'a TrainConfig,
    span: RunSpan,
    observer: &'o mut dyn Observer,
    epochs: Vec<EpochReport>,
    losses: Vec<f64>,
    first_step: u64,
    train_time: Duration,
    trained_samples: u64,
    epoch: EpochSums,
    best: Option<BestEpoch>,
    /// Training on a token stream: the epochs are evaluation periods.
    text: bool,
}

/// Appends a step's loss, bounded: past twice `kept`, the oldest `kept` go, so that a run
/// of millions of steps holds at most 16 MiB of them (issue 19: a 5-million-step run grew
/// by 8 bytes a step).
fn keep_loss(losses: &mut Vec<f64>, loss: f64, kept: usize) {
    if losses.len() >= 2 * kept {
        losses.drain(..losses.len() - kept);
    }
    losses.push(loss);
}

impl<'a, 'o> Fit<'a, 'o> {
    fn new(
        model: &'a Graph,
        test: Option<&'a Dataset>,
        config: &'a TrainConfig,
        span: RunSpan,
        observer: &'o mut dyn Observer,
    ) -> Self {
        let resume = config.resume.as_ref();
        let carried = resume.map_or(Metrics::default(), |r| r.epoch_metrics);
        let to_go = span.total_steps.saturating_sub(span.start.step);
        Fit {
            model,
            test,
            config,
            span,
            observer,
            epochs: Vec::new(),
            losses: Vec::with_capacity(to_go.min(1 << 16) as usize),
            first_step: span.start.step,
            train_time: Duration::ZERO,
            trained_samples: 0,
            epoch: EpochSums::new(carried, span.start.step_in_epoch as u64),
            best: resume.and_then(|r| r.best),
            text: false,
        }
    }

    fn run(mut self, trainer: &mut Trainer<'_>, train: &Dataset) -> Result<TrainReport> {
        let started = Instant::now();
        let stopped = std::thread::scope(|s| -> Result<Stopped> {
            let (batch_tx, batch_rx) = bounded::<(usize, usize, ProcessRows)>(self.config.prefetch.max(1));
            let (span, config, rows) = (self.span, self.config, trainer.row_plan());
            s.spawn(move || {
                let mut step = span.start.step;
                for epoch in span.start.epoch..config.epochs {
                    let order = match train.stream() {
                        // A token stream's windows: drawn by (seed, step, row).
                        Some(_) => (0..span.steps_per_epoch)
                            .flat_map(|i| {
                                let step = (epoch * span.steps_per_epoch + i) as u64;
                                let context = train.sample_shape().numel();
                                scatter::window_draws(
                                    train.len(),
                                    context,
                                    config.seed,
                                    step,
                                    config.batch_size,
                                    config.shuffle,
                                )
                            })
                            .collect(),
                        None => scatter::epoch_order(train.len(), config.seed, epoch, config.shuffle),
                    };
                    let skip = if epoch == span.start.epoch { span.start.step_in_epoch } else { 0 };
                    let batches = order.chunks(config.batch_size).take(span.steps_per_epoch).enumerate().skip(skip);
                    for (i, idx) in batches {
                        // This process's shards' rows only (all of them in a world of one).
                        let mine = rows.rows(idx.len());
                        // Augmented by (seed, epoch, sample index): whoever trains the row.
                        let batch =
                            Batch::gather_augmented(train, &idx[mine.clone()], &config.augment, config.seed, epoch);
                        let held = ProcessRows { batch, first_row: mine.start, global_len: idx.len() };
                        if step >= span.total_steps || batch_tx.send((epoch, i, held)).is_err() {
                            return;
                        }
                        step += 1;
                    }
                }
            });
            // Dropping the receiver on any return releases a loader blocked on a full channel.
            let stopped = self.steps(trainer, &batch_rx)?;
            if stopped == Stopped::Completed && trainer.steps() < self.span.total_steps {
                return Err(Error::Data {
                    name: train.name().into(),
                    detail: format!("ran out of batches after step {} of {}", trainer.steps(), self.span.total_steps),
                });
            }
            Ok(stopped)
        })?;
        if self.config.check_replicas_every.is_some() {
            trainer.check_replicas()?;
        }
        let (weights, optimizer) = trainer.weights()?;
        Ok(TrainReport {
            weights,
            optimizer,
            epochs: self.epochs,
            losses: self.losses,
            first_step: self.first_step,
            steps: trainer.steps(),
            seconds: started.elapsed().as_secs_f64(),
            samples_per_sec: self.trained_samples as f64 / self.train_time.as_secs_f64().max(1e-12),
            stopped,
            best: self.best,
        })
    }

    /// Every step up to the end of the run, or until it stops.
    fn steps(&mut self, trainer: &mut Trainer<'_>, batches: &Receiver<(usize, usize, ProcessRows)>) -> Result<Stopped> {
        if let Some(best_epoch) = self.stopped_early_before(self.span.start) {
            return Ok(Stopped::EarlyStopping { best_epoch });
        }
        let start = self.span.start;
        if start.step_in_epoch == self.span.steps_per_epoch {
            // Stopped during this epoch's evaluation: it is done first, as it would have been.
            if let Some(stopped) = self.after_step(trainer, start.epoch, start.step_in_epoch - 1)? {
                return Ok(stopped);
            }
        }
        while trainer.steps() < self.span.total_steps {
            let t_wait = Instant::now();
            let Ok((epoch, i, batch)) = batches.recv() else { break };
            self.step(trainer, epoch, i, batch, t_wait.elapsed())?;
            if let Some(stopped) = self.after_step(trainer, epoch, i)? {
                return Ok(stopped);
            }
        }
        Ok(Stopped::Completed)
    }

    /// What follows the step `i` (0-based) of `epoch`: the epoch's end where it is one,
    /// the checkpoint, and the stop if the run stops here.
    fn after_step(&mut self, trainer: &mut Trainer<'_>, epoch: usize, i: usize) -> Result<Option<Stopped>> {
        let last = trainer.steps() == self.span.total_steps;
        let end_of_epoch = i + 1 == self.span.steps_per_epoch || last;
        let ended = match end_of_epoch {
            true => self.end_epoch(trainer, epoch)?,
            false => EpochEnd::GoOn,
        };
        let next = match ended {
            // The evaluation is redone on resuming, unless the run's steps are all taken.
            EpochEnd::EvaluationStopped(_) if !last => Position { step: trainer.steps(), epoch, step_in_epoch: i + 1 },
            _ => self.span.after(trainer.steps(), epoch, i),
        };
        // With several processes, the stop they all agreed on at this step.
        let request = match ended {
            EpochEnd::EvaluationStopped(_) => Some(StopRequest::Interrupt),
            _ => trainer.stop_request(),
        };
        let (early, evaluation) = match ended {
            EpochEnd::StopEarly { best_epoch } => (Some(best_epoch), None),
            EpochEnd::EvaluationStopped(stopped) => (None, Some(stopped)),
            EpochEnd::GoOn => (None, None),
        };
        let done = last || early.is_some();
        let written = self.checkpoint(trainer, next, request.is_some() || done)?;
        if let Some(best_epoch) = early {
            return Ok(Some(Stopped::EarlyStopping { best_epoch }));
        }
        Ok(match request {
            // An evaluation stopped at the run's last step still stops it: its report is lost.
            _ if done && evaluation.is_none() => None,
            Some(StopRequest::Interrupt) => Some(Stopped::Interrupted { checkpoint: written, evaluation }),
            Some(StopRequest::TimeLimit) => Some(Stopped::TimeLimit { checkpoint: written }),
            None => None,
        })
    }

    /// One training step of `batch`, the `i`-th (0-based) of `epoch`, reported.
    fn step(
        &mut self,
        trainer: &mut Trainer<'_>,
        epoch: usize,
        i: usize,
        batch: ProcessRows,
        data_wait: Duration,
    ) -> Result<()> {
        let t_step = Instant::now();
        let lr_scale =
            self.config.schedule.scale_after_warmup(self.config.warmup_steps, trainer.steps(), self.span.total_steps);
        let report = trainer.step_held(batch, lr_scale)?;
        let dt = t_step.elapsed();
        self.train_time += dt;
        self.epoch.train_time += dt;
        self.trained_samples += report.metrics.count;
        let loss = report.metrics.mean_loss();
        if !loss.is_finite() && self.config.non_finite == NonFinite::Error {
            return Err(Error::NonFiniteLoss { step: report.step, epoch, loss });
        }
        keep_loss(&mut self.losses, loss, LOSSES_KEPT);
        self.epoch.metrics.add(&report.metrics);
        self.epoch.steps += 1;
        self.observer.on_step(&StepEvent {
            report: &report,
            epoch,
            epochs: self.config.epochs,
            step_in_epoch: i,
            steps_in_epoch: self.span.steps_per_epoch,
            total_steps: self.span.total_steps,
            data_wait,
        });
        if let Some(k) = self.config.check_replicas_every {
            if trainer.steps().is_multiple_of(k) {
                trainer.check_replicas()?;
            }
        }
        Ok(())
    }

    /// Evaluates the held-out set, keeps the best epoch (writing `save_best`), reports
    /// the epoch and starts the next; says whether early stopping ends the run here. An
    /// evaluation the stop flag cut short leaves the epoch unreported, its sums kept for
    /// the checkpoint.
    fn end_epoch(&mut self, trainer: &mut Trainer<'_>, epoch: usize) -> Result<EpochEnd> {
        let held = match self.test {
            Some(t) => match trainer.evaluate_or_stop(t, self.config.epoch_eval_chunk(trainer.replicas()))? {
                Evaluated::Whole(m) => Some(m),
                Evaluated::Stopped(stopped) => return Ok(EpochEnd::EvaluationStopped(stopped)),
            },
            None => None,
        };
        let best = match held {
            Some(m) => self.note_best(trainer, epoch, m)?,
            None => false,
        };
        let sums = std::mem::replace(&mut self.epoch, EpochSums::new(Metrics::default(), 0));
        let (test, val) = match self.config.held_out {
            HeldOut::Test => (held, None),
            HeldOut::Validation => (None, held),
        };
        let e = EpochReport {
            epoch,
            epochs: self.config.epochs,
            train: sums.metrics,
            test,
            val,
            best,
            steps: sums.steps,
            step_at_end: trainer.steps(),
            seconds: sums.started.elapsed().as_secs_f64(),
            // None of its steps timed here (a run resumed at its evaluation): no rate.
            samples_per_sec: match sums.train_time.is_zero() {
                true => 0.0,
                false => sums.metrics.count as f64 / sums.train_time.as_secs_f64(),
            },
            steps_of_run: self.text.then(|| (trainer.steps(), self.span.total_steps)),
        };
        self.observer.on_epoch(&e);
        self.epochs.push(e);
        Ok(match self.stopped_early_after(epoch) {
            Some(best_epoch) => EpochEnd::StopEarly { best_epoch },
            None => EpochEnd::GoOn,
        })
    }

    /// Keeps `metrics` as the best epoch's when its loss improves on the best so far by
    /// more than early stopping's `min_delta` (any decrease without early stopping); a
    /// NaN loss never improves. Writes `save_best` then.
    fn note_best(&mut self, trainer: &mut Trainer<'_>, epoch: usize, metrics: Metrics) -> Result<bool> {
        let delta = self.config.early_stopping.map_or(0.0, |e| e.min_delta);
        let loss = metrics.mean_loss();
        let improved = match &self.best {
            None => !loss.is_nan(),
            Some(b) => loss < b.metrics.mean_loss() - delta,
        };
        if improved {
            self.best = Some(BestEpoch { epoch, metrics });
            if let Some(path) = self.config.save_best.as_ref().filter(|_| trainer.world().is_voice()) {
                let weights = trainer.params()?;
                crate::weights::save(self.model, &weights, path)?;
            }
        }
        Ok(improved)
    }

    /// The best epoch, when early stopping ends the run after `epoch` (0-based): its
    /// patience of epochs has passed since the best one (Keras's `wait >= patience`).
    fn stopped_early_after(&self, epoch: usize) -> Option<usize> {
        let (stopping, best) = (self.config.early_stopping?, self.best?);
        (epoch > best.epoch && epoch - best.epoch >= stopping.patience).then_some(best.epoch)
    }

    /// The best epoch, when the run resumed at `start` had already stopped early.
    fn stopped_early_before(&self, start: Position) -> Option<usize> {
        match (start.step_in_epoch, start.epoch) {
            (0, e) if e > 0 => self.stopped_early_after(e - 1),
            _ => None,
        }
    }

    /// Writes a checkpoint at `at` when the policy's period says so, or when `now`.
    fn checkpoint(&self, trainer: &mut Trainer<'_>, at: Position, now: bool) -> Result<Option<std::path::PathBuf>> {
        let Some(policy) = self.config.checkpoint.as_ref() else {
            return Ok(None);
        };
        if !now && !trainer.steps().is_multiple_of(policy.every.max(1)) {
            return Ok(None);
        }
        if !trainer.world().is_voice() {
            // A sharded optimiser's state is gathered from every process (a collective
            // every process joins at the same step: the period and `now` agree); process
            // 0 alone writes it.
            if self.config.optimizer_sharding == crate::optim::Sharding::Sharded && trainer.world().size() > 1 {
                trainer.weights()?;
            }
            return Ok(None);
        }
        // At an epoch boundary the new epoch has no steps yet; mid-epoch it carries its sums.
        let epoch_metrics = if at.step_in_epoch == 0 { Metrics::default() } else { self.epoch.metrics };
        save_checkpoint(trainer, self.model, policy, at, epoch_metrics, self.best).map(Some)
    }
}

fn save_checkpoint(
    trainer: &mut Trainer<'_>,
    model: &Graph,
    policy: &CheckpointPolicy,
    at: Position,
    epoch_metrics: Metrics,
    best: Option<BestEpoch>,
) -> Result<std::path::PathBuf> {
    let (weights, optimizer) = trainer.weights()?;
    let state = Resume {
        weights,
        optimizer,
        step: at.step,
        epoch: at.epoch,
        step_in_epoch: at.step_in_epoch,
        epoch_metrics,
        best,
    };
    checkpoint::save(model, &state, policy)
}

/// The data's parts must be the model's inputs (`Dataset::from_inputs`): as many, in its
/// order, each of the shape of the model's input it feeds. Errors name each input (its
/// name and shape) and the part that does not fit it.
fn check_inputs(model: &Graph, data: &Dataset) -> Result<()> {
    let err = |detail: String| Error::Data { name: data.name().into(), detail };
    let (inputs, parts) = (model.inputs(), data.input_shapes());
    let listed = inputs.iter().map(|(n, s)| format!("{n} {s}")).collect::<Vec<_>>().join(", ");
    if inputs.len() > 1 && data.stream().is_some() {
        return Err(err(format!(
            "a token stream's windows feed a model of one input, and this model takes {} ({listed}): \
             give the inputs as parts (Dataset::from_inputs), one per input",
            inputs.len()
        )));
    }
    if let ([(_, shape)], [part]) = (inputs, parts) {
        if part != shape {
            return Err(err(format!("samples of shape {part} do not fit the model's input {shape}")));
        }
        return Ok(());
    }
    if inputs.len() != parts.len() {
        let given = parts.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", ");
        return Err(err(format!(
            "{} input part(s) ({given}) for a model of {} inputs ({listed}): give one part per model input, \
             in the model's order (Dataset::from_inputs)",
            parts.len(),
            inputs.len()
        )));
    }
    for (k, ((name, shape), part)) in inputs.iter().zip(parts).enumerate() {
        if part != shape {
            return Err(err(format!(
                "input part {k} has samples of shape {part}, which do not fit the model's input {k} ({name}) of shape \
                 {shape} (the model's inputs: {listed})"
            )));
        }
    }
    Ok(())
}

/// The dataset must be non-empty and shaped like the model's inputs, with labels the
/// model can output (the first that it cannot is named, with its sample).
pub fn check_data(model: &Graph, data: &Dataset) -> Result<()> {
    let err = |detail: String| Error::Data { name: data.name().into(), detail };
    if data.is_empty() {
        return Err(err("has no samples".into()));
    }
    check_inputs(model, data)?;
    // A classifier's output is its K classes; a sequence model's (T, K), a label per
    // position.
    let out = model.output_shape().dims();
    let classes = out.last().copied().unwrap_or(1);
    let positions: usize = out[..out.len().saturating_sub(1)].iter().product();
    if positions != data.targets_per_sample() {
        return Err(err(format!(
            "samples with {} label(s) each do not fit the model's output {}",
            data.targets_per_sample(),
            model.output_shape()
        )));
    }
    if let Some((i, t, id)) = data.first_token_outside(classes) {
        return Err(err(format!(
            "token id {id} of sample {i}, position {t} is at or above the model's vocabulary of {classes}"
        )));
    }
    if let Some((i, label)) = data.first_label_outside(classes) {
        return Err(err(crate::data::label_outside(label.into(), i, classes, "model's ")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::keep_loss;

    #[test]
    fn a_long_runs_losses_stay_bounded_and_the_last_ones_are_kept() {
        let mut losses = Vec::new();
        for step in 0..1_000 {
            keep_loss(&mut losses, step as f64, 4);
            assert!(losses.len() < 2 * 4 + 1, "{} losses kept", losses.len());
            assert!(losses.len() >= 4.min(step + 1));
            // The newest last, in order, with no gap.
            assert_eq!(*losses.last().unwrap(), step as f64);
            assert!(losses.windows(2).all(|w| w[1] == w[0] + 1.0));
        }
    }
}
