//! Synchronous data-parallel training: [`train_data_parallel`], and [`with_trainer`] for
//! loops written by the user.
//!
//! Threads and ownership: the caller's thread is the coordinator (sampler, metrics,
//! logging, replica checks); a loader thread gathers global batches ahead of time into
//! a bounded channel; one worker thread per device owns a replica and the device's
//! thread pool. Workers are built first, then run under `std::thread::scope`, so no
//! thread outlives the call. Commands reach workers through bounded crossbeam channels;
//! gradients never do: they meet in the exchange — shared memory between CPU devices
//! (`exchange::shm`), NCCL or device copies between GPUs (`exchange::gpu`).
//!
//! Faults: an error or a panic in any worker aborts the exchange, which releases every
//! other worker from its collective with `Error::Aborted`; the coordinator returns the
//! root cause, naming the device and the step, and the scope joins every thread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};

use super::cpu::CpuReplica;
use super::gpu::GpuReplica;
use super::replica::{check_replicas, Replica};
use super::scatter;
use super::step::StepWork;
use super::worker::{self, recv_waiting, Command, Reply, Seat, SetupGate};
use super::{Batch, ShardReport, StepReport, TrainConfig};
use crate::data::Dataset;
use crate::devices::Devices;
use crate::error::{Error, Result};
use crate::exchange::codec::Codec;
use crate::exchange::gpu::{transport_for, CopyGroup, GpuExchange, NcclGroup, Transport};
use crate::exchange::shm::{ShmGroup, ShmStats};
use crate::exchange::{Abort, Aborts, Exchange, Wait};
use crate::nn::loss::Metrics;
use crate::nn::{ParamStore, Sequential};
use crate::optim::{Optimizer, Sharding};
use crate::tensor::Device;

/// The coordinator's handle on running workers: drive training step by step.
///
/// Obtained inside [`with_trainer`]; every call is synchronous (it returns when every
/// worker has answered). After a worker fails, every call returns an error.
pub struct Trainer<'s> {
    commands: Vec<Sender<Command>>,
    replies: Receiver<(usize, Result<Reply>)>,
    exchange: &'s dyn Abort,
    devices: Vec<Device>,
    replicas: usize,
    step: u64,
    failed: Option<String>,
    wait: Wait,
    /// Samples per forward pass of [`Trainer::predict`].
    eval_batch: usize,
    /// Gradient accumulation and optimiser sharding of every step (`TrainConfig`).
    accumulate: usize,
    sharding: Sharding,
}

impl Trainer<'_> {
    /// Devices, in rank order.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Logical replicas R.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    fn ask(&mut self, make: impl Fn(usize) -> Command) -> Result<Vec<Reply>> {
        if let Some(cause) = &self.failed {
            return Err(Error::config("trainer", format!("a worker failed earlier ({cause}); start a new run")));
        }
        let (mut sent, mut gone) = (0, None);
        for (d, tx) in self.commands.iter().enumerate() {
            match tx.send(make(d)) {
                Ok(()) => sent += 1,
                Err(_) => {
                    gone.get_or_insert(d);
                }
            }
        }
        if gone.is_some() {
            // The others must not wait for the missing worker in a collective.
            self.exchange.abort();
        }
        let mut replies: Vec<Option<Reply>> = (0..self.commands.len()).map(|_| None).collect();
        let (mut root, mut aborted) = (None, None);
        let mut note = |d: usize, r: Result<Reply>, replies: &mut Vec<Option<Reply>>| match r {
            Ok(reply) => replies[d] = Some(reply),
            // The cause wins over the aborts it triggered in the other workers.
            Err(Error::Aborted) => {
                aborted.get_or_insert(d);
            }
            Err(e) => {
                root.get_or_insert(e);
            }
        };
        for _ in 0..sent {
            let (d, r) = recv_waiting(&self.replies, self.wait).map_err(|_| Error::Worker {
                device: "coordinator".into(),
                step: self.step,
                cause: "every worker has exited".into(),
            })?;
            note(d, r, &mut replies);
        }
        if gone.is_some() {
            // A worker that left said why before it did: read what is already queued.
            while let Ok((d, r)) = self.replies.try_recv() {
                note(d, r, &mut replies);
            }
        }
        let device = |d: usize| self.devices[d].to_string();
        let step = self.step;
        let failure = root
            .or_else(|| {
                gone.map(|d| Error::Worker { device: device(d), step, cause: "worker thread has exited".into() })
            })
            .or_else(|| aborted.map(|d| Error::Worker { device: device(d), step, cause: Error::Aborted.to_string() }));
        if let Some(e) = failure {
            self.exchange.abort();
            self.failed = Some(e.to_string());
            return Err(e);
        }
        Ok(replies.into_iter().map(|r| r.expect("every worker replied")).collect())
    }

    /// Trains one step on a global batch: scatter to R logical replicas, forward,
    /// backward, all-reduce, update (at the configured learning rate).
    pub fn step(&mut self, batch: Batch) -> Result<StepReport> {
        self.step_at(batch, 1.0)
    }

    /// [`Trainer::step`] with the learning rate multiplied by `lr_scale` for this step.
    pub fn step_scaled(&mut self, batch: Batch, lr_scale: f32) -> Result<StepReport> {
        self.step_at(batch, lr_scale)
    }

    pub(super) fn step_at(&mut self, batch: Batch, lr_scale: f32) -> Result<StepReport> {
        if batch.is_empty() {
            return Err(Error::config("batch", "a training step needs at least one sample"));
        }
        let t0 = Instant::now();
        let shards = scatter::shards(batch.len(), self.replicas);
        let work = Arc::new(StepWork {
            step: self.step,
            batch: Arc::new(batch),
            shards,
            lr_scale,
            accumulate: self.accumulate,
            sharding: self.sharding,
        });
        let replies = self.ask(|_| Command::Step(Arc::clone(&work)))?;
        let k = self.replicas / self.devices.len();
        let mut report = StepReport {
            step: self.step,
            metrics: Metrics::default(),
            shards: Vec::with_capacity(self.replicas),
            compute: Duration::ZERO,
            reduce: Duration::ZERO,
            wall: Duration::ZERO,
        };
        for (d, r) in replies.into_iter().enumerate() {
            let Reply::Step(o) = r else { unreachable!("a step command gets a step reply") };
            report.compute = report.compute.max(o.compute);
            report.reduce = report.reduce.max(o.reduce);
            for (j, m) in o.shards.into_iter().enumerate() {
                report.metrics.add(&m);
                report.shards.push(ShardReport { device: self.devices[d], replica: d * k + j, metrics: m });
            }
        }
        self.step += 1;
        report.wall = t0.elapsed();
        Ok(report)
    }

    /// Loss and accuracy on `data` in evaluation mode, the samples split across devices.
    pub fn evaluate(&mut self, data: &Dataset, eval_batch: usize) -> Result<Metrics> {
        let all: Vec<usize> = (0..data.len()).collect();
        let batch = Arc::new(Batch::gather(data, &all));
        let parts = scatter::shards(data.len(), self.devices.len());
        let replies = self.ask(|d| Command::Eval(Arc::clone(&batch), parts[d].clone(), eval_batch))?;
        let mut total = Metrics::default();
        for r in replies {
            let Reply::Eval(m) = r else { unreachable!("an eval command gets an eval reply") };
            total.add(&m);
        }
        Ok(total)
    }

    /// Class probabilities (N, K) for every sample of `batch`, split across devices.
    pub fn predict(&mut self, batch: Batch) -> Result<Vec<f32>> {
        let parts = scatter::shards(batch.len(), self.devices.len());
        let batch = Arc::new(batch);
        let chunk = self.eval_batch;
        let replies = self.ask(|d| Command::Predict(Arc::clone(&batch), parts[d].clone(), chunk))?;
        Ok(replies
            .into_iter()
            .flat_map(|r| {
                let Reply::Predict(p) = r else { unreachable!("a predict command gets a predict reply") };
                p
            })
            .collect())
    }

    /// Hashes every replica's tensors and fails, naming the first tensor that differs,
    /// unless all replicas are bitwise identical.
    pub fn check_replicas(&mut self) -> Result<()> {
        let replies = self.ask(|_| Command::Fingerprints)?;
        let prints: Vec<_> = replies
            .into_iter()
            .map(|r| {
                let Reply::Fingerprints(p) = r else { unreachable!("a fingerprint command gets fingerprints") };
                p
            })
            .collect();
        check_replicas(self.step, &prints)
    }

    /// The weights of replica 0 and the whole optimiser state (with a sharded optimiser,
    /// every device's part put together).
    pub fn weights(&mut self) -> Result<(ParamStore, Optimizer)> {
        let replies = self.ask(|_| Command::Snapshot)?;
        let mut snapshots = replies.into_iter().map(|r| {
            let Reply::Snapshot(s) = r else { unreachable!("a snapshot command gets a snapshot") };
            *s
        });
        let (weights, first) = snapshots.next().expect("a run has a device");
        if first.is_whole() {
            return Ok((weights, first));
        }
        let parts: Vec<Optimizer> = std::iter::once(first).chain(snapshots.map(|(_, o)| o)).collect();
        Ok((weights, Optimizer::merge(&parts)?))
    }

    /// Bytes of optimiser state each device holds, in rank order (÷ N when sharded).
    pub fn optimizer_bytes(&mut self) -> Result<Vec<usize>> {
        let replies = self.ask(|_| Command::Snapshot)?;
        Ok(replies
            .into_iter()
            .map(|r| {
                let Reply::Snapshot(s) = r else { unreachable!("a snapshot command gets a snapshot") };
                s.1.state_bytes()
            })
            .collect())
    }
}

/// Builds one replica per device from `model` (the initial weights made once on the
/// host, from `config.initial` or the seed, and copied to every replica), runs the
/// workers, and calls `f` with the coordinator's handle. Every thread has ended when it
/// returns. For loops written by the user, notebook-style:
///
/// ```
/// use lockstep::{data::toy, devices::Devices, models, optim::OptimizerConfig};
/// use lockstep::train::{with_trainer, Batch, TrainConfig};
///
/// let data = toy::toy();
/// let model = models::toy_mlp(2, 2).unwrap();
/// let config = TrainConfig { optimizer: OptimizerConfig::sgd(0.5), ..TrainConfig::default() };
/// let accuracy = with_trainer(&model, &Devices::cpu(2, 1).unwrap(), &config, |t| {
///     for step in 0..30 {
///         let rows = [(2 * step) % 5, (2 * step + 1) % 5];
///         let report = t.step(Batch::gather(&data.train, &rows))?; // one global batch of 2
///         assert!(report.metrics.mean_loss().is_finite());
///     }
///     t.check_replicas()?; // every replica bitwise identical
///     Ok(t.evaluate(data.test.as_ref().unwrap(), 64)?.accuracy())
/// })
/// .unwrap();
/// assert_eq!(accuracy, 1.0);
/// ```
pub fn with_trainer<T>(
    model: &Sequential,
    devices: &Devices,
    config: &TrainConfig,
    f: impl FnOnce(&mut Trainer<'_>) -> Result<T>,
) -> Result<T> {
    config.validate()?;
    crate::memory::check_training(model, devices, config)?;
    let n = devices.len();
    let replicas = config.replicas.unwrap_or(n);
    if replicas % n != 0 {
        return Err(Error::config(
            "replicas",
            format!("{replicas} logical replicas cannot be shared evenly by {n} devices"),
        ));
    }
    let initial = match config.resume.as_ref().map(|r| &r.weights).or(config.initial.as_ref()) {
        Some(w) => {
            if w.params.len() != model.params_len() || w.buffers.len() != model.buffers_len() {
                return Err(Error::config("initial weights", "they do not match the model's tensors"));
            }
            w.clone()
        }
        None => model.init(config.seed),
    };
    let width = model.params_len() + model.buffers_len();
    let k = replicas / n;
    let synchronized = crate::nn::batchnorm::has_synchronized_layers(model);
    check_features(devices, replicas, synchronized)?;
    let plan = Plan {
        devices,
        replicas,
        model,
        initial: &initial,
        config,
        // Between steps the pools' helper threads are idle; the workers spin in the
        // exchange where each has a core, and on messages where the coordinator has one
        // too.
        collective: Wait::for_threads(n),
        messages: Wait::for_threads(n + 1),
    };
    let seed = config.seed;
    match devices.list()[0] {
        Device::Cpu(_) => {
            let codec = Codec::new(config.grad_compression, model.params_len());
            let shm = ShmGroup::with_codec(n, replicas, width, plan.collective, codec)?;
            let stats: Vec<ShmStats<'_>> = (0..n).map(|r| shm.stats(r)).collect();
            plan.run(
                &shm,
                f,
                |rank, device, (model, store, optimizer)| {
                    let replica = CpuReplica::new(device, model, store, optimizer, seed);
                    Ok(if synchronized { replica.with_stats(&stats[rank]) } else { replica })
                },
                |rank, _| Ok(shm.rank(rank)),
            )
        }
        Device::Cuda(_) => {
            let ordinals = devices.cuda_ordinals();
            let codec = Codec::new(config.grad_compression, model.params_len());
            // Synchronized BatchNorm's statistics meet on the host, in the shared-memory
            // statistics exchange CPU devices use (a group of no gradient values).
            let stats_group = if synchronized { Some(ShmGroup::new(n, replicas, 0, plan.collective)?) } else { None };
            let stats: Vec<ShmStats<'_>> = stats_group.iter().flat_map(|g| (0..n).map(|r| g.stats(r))).collect();
            match transport_for(&ordinals) {
                Transport::Nccl => {
                    let group = NcclGroup::new(&ordinals, width)?;
                    let abort = Aborts::new(&group, stats_group.as_ref().map(|g| g as &dyn Abort));
                    plan.run(
                        &abort,
                        f,
                        |rank, device, start| gpu_replica(device, start, seed, stats.get(rank), &abort),
                        |rank, replica| {
                            GpuExchange::new(group.join(rank, replica.stream())?, width, k)?.with_codec(codec)
                        },
                    )
                }
                Transport::Copies => {
                    let group = CopyGroup::new(&ordinals, width)?;
                    let abort = Aborts::new(&group, stats_group.as_ref().map(|g| g as &dyn Abort));
                    plan.run(
                        &abort,
                        f,
                        |rank, device, start| gpu_replica(device, start, seed, stats.get(rank), &abort),
                        |rank, replica| {
                            GpuExchange::new(group.join(rank, replica.stream())?, width, k)?.with_codec(codec)
                        },
                    )
                }
            }
        }
    }
}

/// A GPU replica from `start`, meeting the other replicas' statistics through `stats`
/// when its model has synchronized BatchNorm layers (waits released by `abort`).
fn gpu_replica<'s>(
    device: Device,
    start: (Sequential, ParamStore, Optimizer),
    seed: u64,
    stats: Option<&'s ShmStats<'_>>,
    abort: &'s dyn Abort,
) -> Result<GpuReplica<'s>> {
    let replica = GpuReplica::new(device, start, seed)?;
    Ok(match stats {
        Some(s) => replica.with_stats(s, abort),
        None => replica,
    })
}

/// The features of issue 12 a run asks for, against what its devices can do; checked
/// before any worker starts. Every feature runs on CPU and GPU devices alike (16-bit
/// gradients through every transport, synchronized BatchNorm through the host's
/// statistics exchange); what remains is synchronized BatchNorm's one logical replica per
/// device.
fn check_features(devices: &Devices, replicas: usize, synchronized: bool) -> Result<()> {
    if synchronized && replicas != devices.len() {
        return Err(Error::config(
            "sync-batchnorm",
            format!(
                "synchronized BatchNorm needs one logical replica per device, not {replicas} on {} (its statistics \
                 meet inside the forward pass, which a device running its shards one after another cannot wait for)",
                devices.len()
            ),
        ));
    }
    Ok(())
}

/// What every worker of a run starts from.
struct Plan<'a> {
    devices: &'a Devices,
    replicas: usize,
    model: &'a Sequential,
    initial: &'a ParamStore,
    config: &'a TrainConfig,
    /// How workers wait for each other in the exchange.
    collective: Wait,
    /// How the coordinator and the workers wait for messages.
    messages: Wait,
}

impl Plan<'_> {
    /// Starts one worker thread per device under a scope — each builds its replica with
    /// `build`, then joins the exchange with `join` — calls `f` with the coordinator's
    /// handle, and returns when every thread has ended. `group` is the run's exchange,
    /// aborted on any failure.
    fn run<T, G, R, X>(
        &self,
        group: &G,
        f: impl FnOnce(&mut Trainer<'_>) -> Result<T>,
        build: impl Fn(usize, Device, (Sequential, ParamStore, Optimizer)) -> Result<R> + Sync,
        join: impl Fn(usize, &R) -> Result<X> + Sync,
    ) -> Result<T>
    where
        G: Abort,
        R: Replica,
        X: Exchange<Mem = R::Mem>,
    {
        let n = self.devices.len();
        let k = self.replicas / n;
        let threads = self.devices.threads_per_device();
        let (reply_tx, reply_rx) = bounded(n * 2);
        let gate = SetupGate::new(n);
        std::thread::scope(|s| {
            let mut commands = Vec::with_capacity(n);
            for (rank, &device) in self.devices.list().iter().enumerate() {
                let (tx, rx) = bounded::<Command>(2);
                commands.push(tx);
                let optimizer = match &self.config.resume {
                    Some(r) => r.optimizer.clone(),
                    None => Optimizer::new(self.config.optimizer, self.model.params_len()),
                };
                let start = (self.model.clone(), self.initial.clone(), optimizer);
                let seat = Seat {
                    rank,
                    device,
                    shards: rank * k..(rank + 1) * k,
                    wait: self.messages,
                    sharding: self.config.optimizer_sharding,
                    abort: group,
                    gate: &gate,
                    commands: rx,
                    replies: reply_tx.clone(),
                };
                let (build, join) = (&build, &join);
                let body = move || {
                    on_device_thread(device, threads, seat, |seat| {
                        worker::start(seat, || build(rank, device, start), |r| join(rank, r))
                    })
                };
                std::thread::Builder::new().name(format!("lockstep-{device}")).spawn_scoped(s, body).map_err(|e| {
                    // The workers already started must not wait for this one.
                    gate.abandon();
                    group.abort();
                    Error::config("threads", format!("cannot spawn a worker thread: {e}"))
                })?;
            }
            drop(reply_tx);
            let mut trainer = Trainer {
                commands,
                replies: reply_rx,
                exchange: group,
                devices: self.devices.list().to_vec(),
                replicas: self.replicas,
                step: self.config.resume.as_ref().map_or(0, |r| r.step),
                failed: None,
                wait: self.messages,
                eval_batch: self.config.eval_batch,
                accumulate: self.config.accumulate,
                sharding: self.config.optimizer_sharding,
            };
            let out = f(&mut trainer);
            if out.is_err() {
                group.abort();
            }
            drop(trainer); // closes the command channels: workers leave their loops
            out
        })
    }
}

/// Runs `body` on a device's worker thread: a CPU device inside its own thread pool of
/// `threads` (the worker thread is one of them), a GPU directly. A pool that cannot start
/// is reported as the worker's failure.
fn on_device_thread(device: Device, threads: usize, seat: Seat<'_>, body: impl FnOnce(Seat<'_>) + Send) {
    match device {
        Device::Cpu(_) => {
            let rank = seat.rank;
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .use_current_thread()
                .thread_name(move |i| format!("lockstep-cpu{rank}-{i}"))
                .build();
            match pool {
                Ok(pool) => pool.install(|| body(seat)),
                Err(e) => {
                    seat.abort.abort();
                    seat.gate.arrive(false);
                    let cause = format!("cannot start its thread pool: {e}");
                    let _ =
                        seat.replies.send((rank, Err(Error::Worker { device: device.to_string(), step: 0, cause })));
                }
            }
        }
        Device::Cuda(_) => body(seat),
    }
}
