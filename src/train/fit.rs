//! The fit loop: [`train_data_parallel`] runs epochs of steps over a dataset on a
//! [`Trainer`], with the loader thread ahead of it, observers, replica checks, evaluation
//! after every epoch and checkpoints; and [`check_data`], the checks of a dataset against
//! a model. In a run of several processes (MPI) every process runs this loop in step with
//! the others: its loader gathers only its own shards' rows, and process 0 alone writes
//! checkpoints.

use std::time::{Duration, Instant};

use crossbeam_channel::bounded;

use super::trainer::HeldBatch;
use super::{
    scatter, with_trainer, Batch, EpochReport, NonFinite, Observer, Silent, StepEvent, TrainConfig, TrainReport,
    Trainer,
};
use crate::checkpoint::{self, CheckpointPolicy, Resume};
use crate::data::Dataset;
use crate::devices::Devices;
use crate::error::{Error, Result};
use crate::nn::loss::Metrics;
use crate::nn::Sequential;

/// Trains `model` on `train` (evaluating on `test` after every epoch, if given) on
/// `devices`, synchronously data-parallel. One step on N devices equals one step on one
/// device with the whole global batch (up to float summation order; bitwise with a
/// fixed number of logical replicas on CPU devices, which sum the R shard gradients in
/// one tree whoever computed them). GPUs sum each device's shards in shard order, then
/// across devices (NCCL's order, or rank order for device copies): bitwise across device
/// counts only where the additions coincide, e.g. R = 2 on `cuda:0` and on `cuda:0,0`.
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
    model: &Sequential,
    train: &Dataset,
    test: Option<&Dataset>,
    devices: &Devices,
    config: &TrainConfig,
) -> Result<TrainReport> {
    train_data_parallel_with(model, train, test, devices, config, &mut Silent)
}

/// [`train_data_parallel`] reporting progress to `observer`.
pub fn train_data_parallel_with(
    model: &Sequential,
    train: &Dataset,
    test: Option<&Dataset>,
    devices: &Devices,
    config: &TrainConfig,
    observer: &mut dyn Observer,
) -> Result<TrainReport> {
    config.validate()?;
    check_data(model, train)?;
    if let Some(t) = test {
        check_data(model, t)?;
    }
    let steps_per_epoch = scatter::steps_per_epoch(train.len(), config.batch_size, config.last_batch);
    if steps_per_epoch == 0 {
        return Err(Error::Data {
            name: train.name().into(),
            detail: format!("{} samples make no full batch of {} (drop-last is on)", train.len(), config.batch_size),
        });
    }
    let total_steps =
        (steps_per_epoch as u64).saturating_mul(config.epochs as u64).min(config.max_steps.unwrap_or(u64::MAX));
    let start = match &config.resume {
        Some(r) => Position { step: r.step, epoch: r.epoch, step_in_epoch: r.step_in_epoch },
        None => Position { step: 0, epoch: 0, step_in_epoch: 0 },
    };
    if start.step_in_epoch >= steps_per_epoch
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
    let voice = crate::world::current()?.is_voice();
    if let Some(p) = config.checkpoint.as_ref().filter(|_| voice) {
        checkpoint::prepare_dir(&p.dir)?;
    }
    with_trainer(model, devices, config, |trainer| {
        let started = Instant::now();
        let mut losses = Vec::with_capacity(total_steps.saturating_sub(start.step).min(1 << 16) as usize);
        let mut epochs = Vec::new();
        let mut train_time = Duration::ZERO;
        let mut trained_samples = 0u64;
        std::thread::scope(|s| -> Result<()> {
            let (batch_tx, batch_rx) = bounded::<(usize, usize, HeldBatch)>(config.prefetch.max(1));
            let plan = trainer.row_plan();
            s.spawn(move || {
                let mut step = start.step;
                for epoch in start.epoch..config.epochs {
                    let order = scatter::epoch_order(train.len(), config.seed, epoch, config.shuffle);
                    let skip = if epoch == start.epoch { start.step_in_epoch } else { 0 };
                    let batches = order.chunks(config.batch_size).take(steps_per_epoch).enumerate().skip(skip);
                    for (i, idx) in batches {
                        // This process's shards' rows only (all of them in a world of one).
                        let rows = plan.rows(idx.len());
                        let batch = Batch::gather(train, &idx[rows.clone()]);
                        let held = HeldBatch { batch, first_row: rows.start, global_len: idx.len() };
                        if step >= total_steps || batch_tx.send((epoch, i, held)).is_err() {
                            return;
                        }
                        step += 1;
                    }
                }
            });
            let mut epoch_metrics = Metrics::default();
            let mut epoch_start = Instant::now();
            let mut epoch_steps = 0u64;
            let mut epoch_train_time = Duration::ZERO;
            while trainer.steps() < total_steps {
                let t_wait = Instant::now();
                let Ok((epoch, i, batch)) = batch_rx.recv() else { break };
                let data_wait = t_wait.elapsed();
                let t_step = Instant::now();
                let lr_scale = config.schedule.scale(trainer.steps(), total_steps);
                let report = trainer.step_held(batch, lr_scale)?;
                let dt = t_step.elapsed();
                train_time += dt;
                epoch_train_time += dt;
                trained_samples += report.metrics.count;
                let loss = report.metrics.mean_loss();
                if !loss.is_finite() && config.non_finite == NonFinite::Error {
                    return Err(Error::NonFiniteLoss { step: report.step, epoch, loss });
                }
                losses.push(loss);
                epoch_metrics.add(&report.metrics);
                epoch_steps += 1;
                observer.on_step(&StepEvent {
                    report: &report,
                    epoch,
                    epochs: config.epochs,
                    step_in_epoch: i,
                    steps_in_epoch: steps_per_epoch,
                    total_steps,
                    data_wait,
                });
                if let Some(k) = config.check_replicas_every {
                    if trainer.steps() % k == 0 {
                        trainer.check_replicas()?;
                    }
                }
                let last_of_epoch = i + 1 == steps_per_epoch || trainer.steps() == total_steps;
                if last_of_epoch {
                    let test_metrics = test.map(|t| trainer.evaluate(t, config.eval_batch)).transpose()?;
                    let e = EpochReport {
                        epoch,
                        epochs: config.epochs,
                        train: epoch_metrics,
                        test: test_metrics,
                        steps: epoch_steps,
                        seconds: epoch_start.elapsed().as_secs_f64(),
                        samples_per_sec: epoch_metrics.count as f64 / epoch_train_time.as_secs_f64().max(1e-12),
                    };
                    observer.on_epoch(&e);
                    epochs.push(e);
                    epoch_metrics = Metrics::default();
                    epoch_start = Instant::now();
                    epoch_steps = 0;
                    epoch_train_time = Duration::ZERO;
                }
                let next = if i + 1 == steps_per_epoch {
                    Position { step: trainer.steps(), epoch: epoch + 1, step_in_epoch: 0 }
                } else {
                    Position { step: trainer.steps(), epoch, step_in_epoch: i + 1 }
                };
                let interrupted = trainer.stop_requested();
                let done = trainer.steps() == total_steps;
                let mut written = None;
                if let Some(policy) = config.checkpoint.as_ref().filter(|_| voice) {
                    if interrupted || done || trainer.steps() % policy.every.max(1) == 0 {
                        written = Some(save_checkpoint(trainer, model, policy, next)?);
                    }
                }
                if interrupted && !done {
                    return Err(Error::Interrupted { step: trainer.steps(), checkpoint: written });
                }
            }
            if trainer.steps() < total_steps {
                return Err(Error::Data {
                    name: train.name().into(),
                    detail: format!("ran out of batches after step {} of {total_steps}", trainer.steps()),
                });
            }
            Ok(())
        })?;
        if config.check_replicas_every.is_some() {
            trainer.check_replicas()?;
        }
        let (weights, optimizer) = trainer.weights()?;
        Ok(TrainReport {
            weights,
            optimizer,
            epochs,
            losses,
            steps: trainer.steps(),
            seconds: started.elapsed().as_secs_f64(),
            samples_per_sec: trained_samples as f64 / train_time.as_secs_f64().max(1e-12),
        })
    })
}

/// Where the next step of a run starts.
#[derive(Clone, Copy, Debug)]
struct Position {
    /// Global steps taken.
    step: u64,
    epoch: usize,
    step_in_epoch: usize,
}

fn save_checkpoint(
    trainer: &mut Trainer<'_>,
    model: &Sequential,
    policy: &CheckpointPolicy,
    at: Position,
) -> Result<std::path::PathBuf> {
    let (weights, optimizer) = trainer.weights()?;
    let state = Resume { weights, optimizer, step: at.step, epoch: at.epoch, step_in_epoch: at.step_in_epoch };
    checkpoint::save(model, &state, policy)
}

/// The dataset must be non-empty and shaped like the model's input, with labels the
/// model can output.
pub fn check_data(model: &Sequential, data: &Dataset) -> Result<()> {
    let err = |detail: String| Error::Data { name: data.name().into(), detail };
    if data.is_empty() {
        return Err(err("has no samples".into()));
    }
    if data.sample_shape() != model.input_shape() {
        return Err(err(format!(
            "samples of shape {} do not fit the model's input {}",
            data.sample_shape(),
            model.input_shape()
        )));
    }
    let classes = model.output_shape().numel();
    if data.num_classes() > classes {
        return Err(err(format!("has {} classes but the model outputs {classes}", data.num_classes())));
    }
    Ok(())
}
