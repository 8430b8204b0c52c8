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
//!
//! Several processes (an MPI world, `crate::world`): each process runs this same
//! trainer on its own devices and logical replicas; the exchange spans the processes
//! (`exchange::mpi` between CPU devices, one NCCL clique between GPUs), and what the
//! coordinators agree on — the handshake, every step's merged report, the replica check
//! — is `processes.rs`'s. A failure in one process reaches the others through the
//! world's notice (`World::fail`), sent once this process's threads have ended.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};

use super::cpu::CpuReplica;
use super::flight::{self, FlightRecorder, Phase, RecordedStats};
#[cfg(feature = "cuda")]
use super::gpu::GpuReplica;
use super::panics;
use super::processes::{self, Handshake, RowPlan};
use super::replica::{check_replicas, decay_mask, Replica, Snapshot, Take};
use super::scatter;
use super::step::{Evaluated, StepWork};
use super::worker::{self, recv_waiting, Command, Reply, SetupGate, WorkerStart};
use super::{Batch, ShardReport, StepReport, StopRequest, TrainConfig};
use crate::data::Dataset;
use crate::devices::Devices;
use crate::error::{Error, Result};
use crate::exchange::codec::{Codec, Compression};
#[cfg(feature = "cuda")]
use crate::exchange::gpu::{transport_for, GpuExchange, GpuGroup, NcclGroup, Transport};
use crate::exchange::shm::{ShmGroup, ShmStats};
#[cfg(feature = "cuda")]
use crate::exchange::Aborts;
use crate::exchange::{Abort, Exchange, RunTransport, WaitPolicy};
use crate::nn::{Graph, ParamStore};
use crate::ops::batchnorm::stats::StatsExchange;
use crate::ops::cross_entropy::Metrics;
use crate::optim::{Optimizer, Sharding};
use crate::tensor::Device;
use crate::world::World;

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
    wait: WaitPolicy,
    /// Samples per forward pass of [`Trainer::predict`].
    eval_batch: usize,
    /// Gradient accumulation, optimiser sharding and clipping of every step (`TrainConfig`).
    accumulate: usize,
    sharding: Sharding,
    clip_grad_norm: Option<f32>,
    /// The processes of the run: a world of one without MPI.
    world: &'static World,
    /// This process's logical replicas, and the rows of a batch they hold.
    rows: RowPlan,
    /// Raised to stop the run (Ctrl-C); with several processes, the stop every process
    /// agreed on at the last step is `stop_agreed`.
    stop: Option<Arc<AtomicBool>>,
    /// When `TrainConfig::max_duration` runs out (none: never).
    deadline: Option<Instant>,
    stop_agreed: Option<StopRequest>,
    /// Every device's and the coordinator's last collective calls, printed on a fault.
    recorder: &'s FlightRecorder,
}

/// The rows of one global batch that this process holds (all of them in a world of one):
/// what the fit loop's loader gathers, each process only its own shards' rows.
pub(super) struct ProcessRows {
    pub batch: Batch,
    /// The global batch's row at `batch`'s row 0.
    pub first_row: usize,
    /// Rows of the whole global batch.
    pub global_len: usize,
}

impl Trainer<'_> {
    /// The devices, device d at `[d]`.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Logical replicas R (of every process of the run).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The processes of the run.
    pub fn world(&self) -> &'static World {
        self.world
    }

    /// This process's logical replicas and the rows of a batch they hold.
    pub fn row_plan(&self) -> RowPlan {
        self.rows
    }

    /// Whether the run was asked to stop (`TrainConfig::stop`), or is past its
    /// `TrainConfig::max_duration`: see [`Trainer::stop_request`].
    pub fn stop_requested(&self) -> bool {
        self.stop_request().is_some()
    }

    /// Why the run should stop at this step boundary, if it should: the stop flag was
    /// raised, or `TrainConfig::max_duration` has passed since the trainer started. With
    /// several processes, the request they all agreed on at the last step (the strongest
    /// any of them made), so that they stop at the same step.
    pub fn stop_request(&self) -> Option<StopRequest> {
        match self.world.size() {
            1 => self.local_stop_request(),
            _ => self.stop_agreed,
        }
    }

    /// This process's own request, before any agreement.
    fn local_stop_request(&self) -> Option<StopRequest> {
        if self.stop.as_ref().is_some_and(|f| f.load(Ordering::SeqCst)) {
            return Some(StopRequest::Interrupt);
        }
        self.deadline.filter(|d| Instant::now() >= *d).map(|_| StopRequest::TimeLimit)
    }

    /// The next worker reply. With several processes the coordinator looks at the world
    /// while it waits: a failure elsewhere aborts this process's exchange (the GPUs' NCCL
    /// clique, whose waits know nothing of MPI; a CPU exchange's waits watch it too), which
    /// releases the workers, so that no process waits forever for one that is gone.
    fn next_reply(&self) -> Result<(usize, Result<Reply>), crossbeam_channel::RecvError> {
        const WATCH_EVERY: Duration = Duration::from_millis(50);
        if self.world.size() == 1 {
            return recv_waiting(&self.replies, self.wait);
        }
        // A short step's reply comes within microseconds: spin for it as `recv_waiting`
        // does where a core is free, before sleeping between looks at the world.
        let start = Instant::now();
        while self.wait == WaitPolicy::Spin && start.elapsed() < Duration::from_micros(100) {
            match self.replies.try_recv() {
                Ok(reply) => return Ok(reply),
                Err(crossbeam_channel::TryRecvError::Disconnected) => return Err(crossbeam_channel::RecvError),
                Err(crossbeam_channel::TryRecvError::Empty) => std::hint::spin_loop(),
            }
        }
        loop {
            match self.replies.recv_timeout(WATCH_EVERY) {
                Ok(reply) => return Ok(reply),
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return Err(crossbeam_channel::RecvError),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    if self.world.watch().is_err() {
                        self.exchange.abort();
                    }
                }
            }
        }
    }

    /// A worker's failure named with its process, in a run of several.
    fn qualified(&self, e: Error) -> Error {
        match e {
            Error::Worker { device, step, cause } if self.world.size() > 1 => {
                Error::Worker { device: format!("process {}, {device}", self.world.process()), step, cause }
            }
            other => other,
        }
    }

    /// Keeps `e` as the run's failure (later calls refuse) and returns it.
    fn failing(&mut self, e: Error) -> Error {
        self.exchange.abort();
        self.failed = Some(e.to_string());
        self.recorder.print_fault();
        e
    }

    /// Runs the coordinators' collective `f` across processes, recorded as `phase` in the
    /// coordinator's ring (in a world of one there is nothing to record: `f` is local).
    fn across<T>(&self, phase: Phase, bytes: usize, f: impl FnOnce() -> Result<T>) -> Result<T> {
        match self.world.size() {
            1 => f(),
            _ => {
                let ring = self.recorder.coordinator();
                ring.set_step(self.step);
                ring.record(phase, bytes, f)
            }
        }
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
            let (d, r) = self.next_reply().map_err(|_| Error::Worker {
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
            let e = self.qualified(e);
            return Err(self.failing(e));
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
        let global_len = batch.len();
        let rows = self.rows.rows(global_len);
        // This process's rows: all of them in a world of one.
        let batch = match rows == (0..global_len) {
            true => batch,
            false => {
                let per = batch.sample_shape.numel();
                Batch {
                    x: batch.x[rows.start * per..rows.end * per].to_vec(),
                    y: batch.labels(&rows).to_vec(),
                    sample_shape: batch.sample_shape,
                    inputs: batch.inputs,
                    targets: batch.targets,
                }
            }
        };
        self.step_held(ProcessRows { batch, first_row: rows.start, global_len }, lr_scale)
    }

    /// [`Trainer::step_scaled`] on the rows of the global batch this process holds.
    pub(super) fn step_held(&mut self, held: ProcessRows, lr_scale: f32) -> Result<StepReport> {
        if held.global_len == 0 {
            return Err(Error::config("batch", "a training step needs at least one sample"));
        }
        let t0 = Instant::now();
        let shards = scatter::even_runs(held.global_len, self.replicas);
        let work = Arc::new(StepWork {
            step: self.step,
            batch: Arc::new(held.batch),
            first_row: held.first_row,
            shards,
            lr_scale,
            accumulate: self.accumulate,
            sharding: self.sharding,
            clip_grad_norm: self.clip_grad_norm,
        });
        let replies = self.ask(|_| Command::Step(Arc::clone(&work)))?;
        let k = self.rows.count / self.devices.len();
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
                let shard = self.rows.first + d * k + j;
                report.shards.push(ShardReport { device: self.devices[d], process: None, shard, metrics: m });
            }
        }
        if self.world.size() > 1 {
            let stop = self.local_stop_request();
            let bytes = report.shards.len() * 24 + 24;
            let merged = self
                .across(Phase::StepReport, bytes, || processes::merge_step(self.world, report, stop, &self.devices));
            match merged {
                Ok((merged, agreed)) => (report, self.stop_agreed) = (merged, agreed),
                Err(e) => return Err(self.failing(e)),
            }
        }
        self.step += 1;
        report.wall = t0.elapsed();
        Ok(report)
    }

    /// Loss and accuracy on `data` in evaluation mode, the samples split across devices
    /// (every process's: each gathers and evaluates its devices' parts only).
    pub fn evaluate(&mut self, data: &Dataset, eval_batch: usize) -> Result<Metrics> {
        match self.evaluate_until(data, eval_batch, None)? {
            Evaluated::Whole(m) => Ok(m),
            Evaluated::Stopped(_) => unreachable!("an evaluation without a stop flag ends"),
        }
    }

    /// [`Trainer::evaluate`], given up between chunks once the run's stop flag is raised
    /// (on every process then: a process stopped early stops all of them, at the same
    /// point of the run), saying how far it got. A signal during a long evaluation is
    /// answered within a chunk, well inside the grace a scheduler gives between SIGTERM
    /// and SIGKILL.
    pub(super) fn evaluate_or_stop(&mut self, data: &Dataset, eval_batch: usize) -> Result<Evaluated> {
        let stop = self.stop.clone();
        self.evaluate_until(data, eval_batch, stop)
    }

    fn evaluate_until(
        &mut self,
        data: &Dataset,
        eval_batch: usize,
        stop: Option<Arc<AtomicBool>>,
    ) -> Result<Evaluated> {
        let n = self.devices.len();
        let parts = scatter::even_runs(data.len(), n * self.world.size());
        let mine = &parts[self.world.process() * n..(self.world.process() + 1) * n];
        let first = mine[0].start;
        let held: Vec<usize> = (first..mine[n - 1].end).collect();
        let batch = Arc::new(Batch::gather(data, &held));
        let replies = self.ask(|d| {
            Command::Eval(Arc::clone(&batch), mine[d].start - first..mine[d].end - first, eval_batch, stop.clone())
        })?;
        let local: Vec<Evaluated> = replies
            .into_iter()
            .map(|r| {
                let Reply::Eval(e) = r else { unreachable!("an eval command gets an eval reply") };
                e
            })
            .collect();
        // Summed in global device order (in a world of one, this process's).
        let merged = self.across(Phase::EvalMetrics, local.len() * 32, || {
            processes::merge_evaluations(self.world, &local, data.len())
        });
        merged.map_err(|e| self.failing(e))
    }

    /// Class probabilities (N, K) for every sample of `batch`, split across this
    /// process's devices (every process's replicas are the same: no process needs
    /// another's answers).
    pub fn predict(&mut self, batch: Batch) -> Result<Vec<f32>> {
        let parts = scatter::even_runs(batch.len(), self.devices.len());
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
    /// unless all replicas are bitwise identical (every process's, in a run of several;
    /// the replica that differs is then named with its process).
    pub fn check_replicas(&mut self) -> Result<()> {
        let replies = self.ask(|_| Command::Fingerprints)?;
        let prints: Vec<_> = replies
            .into_iter()
            .map(|r| {
                let Reply::Fingerprints(p) = r else { unreachable!("a fingerprint command gets fingerprints") };
                p
            })
            .collect();
        if self.world.size() > 1 {
            let bytes = prints.iter().map(|p| p.len() * 8).sum();
            return self.across(Phase::ReplicaCheck, bytes, || {
                processes::check_across(self.world, self.step, &self.devices, &prints)
            });
        }
        check_replicas(self.step, &prints)
    }

    /// The weights of replica 0 and the whole optimiser state (with a sharded optimiser,
    /// every device's part put together). Sharded across processes, the parts are
    /// gathered from every process: every process must call it at the same point of the
    /// run (as `fit` does at each checkpoint and at the end); [`Trainer::params`] is the
    /// weights alone, on any one process. Each device copies only what is kept: one copy
    /// of the weights and of the optimiser state, whatever the number of devices.
    pub fn weights(&mut self) -> Result<(ParamStore, Optimizer)> {
        let sharded = self.sharding == Sharding::Sharded;
        let mut snapshots = self.snapshots(|d| Take { weights: d == 0, optimizer: d == 0 || sharded })?.into_iter();
        let first = snapshots.next().expect("a run has a device");
        let (weights, first) = (first.weights.expect("replica 0's weights"), first.optimizer.expect("its optimiser"));
        if !first.is_part() {
            return Ok((weights, first));
        }
        let mut parts: Vec<Optimizer> =
            std::iter::once(first).chain(snapshots.map(|s| s.optimizer.expect("a sharded device's part"))).collect();
        if self.world.size() > 1 {
            // Sharded across processes: every process's parts, gathered by every process
            // (each calls this at the same points of the run). Decided by the world, which
            // every process sees alike, never by the parts a process holds: with a small
            // model one process's parts may hold every parameter and another's none.
            let bytes = parts.iter().map(Optimizer::state_bytes).sum();
            let gathered =
                self.across(Phase::OptimizerState, bytes, || processes::gather_optimizer_parts(self.world, &parts));
            parts = gathered.map_err(|e| self.failing(e))?;
        }
        Ok((weights, Optimizer::merge(&parts)?))
    }

    /// The weights of replica 0 alone: no optimiser state, nothing gathered (what
    /// `save_best` writes, on process 0 only).
    pub fn params(&mut self) -> Result<ParamStore> {
        let first = self.snapshots(|d| Take { weights: d == 0, optimizer: false })?.into_iter().next();
        Ok(first.and_then(|s| s.weights).expect("replica 0's weights"))
    }

    /// Bytes of optimiser state each device holds, in device order (÷ N when sharded).
    pub fn optimizer_bytes(&mut self) -> Result<Vec<usize>> {
        let replies = self.ask(|_| Command::OptimizerBytes)?;
        Ok(replies
            .into_iter()
            .map(|r| {
                let Reply::OptimizerBytes(b) = r else { unreachable!("an optimiser-bytes command gets its bytes") };
                b
            })
            .collect())
    }

    /// Each device's snapshot of what `take` asks of device d, in device order.
    fn snapshots(&mut self, take: impl Fn(usize) -> Take) -> Result<Vec<Snapshot>> {
        let replies = self.ask(|d| Command::Snapshot(take(d)))?;
        Ok(replies
            .into_iter()
            .map(|r| {
                let Reply::Snapshot(s) = r else { unreachable!("a snapshot command gets a snapshot") };
                *s
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
    model: &Graph,
    devices: &Devices,
    config: &TrainConfig,
    f: impl FnOnce(&mut Trainer<'_>) -> Result<T>,
) -> Result<T> {
    with_trainer_evaluating(model, devices, config, config.eval_batch, f)
}

/// [`with_trainer`] for a loop whose evaluations pass at most `eval_rows` samples (the fit
/// loop's, `train::memory::fit_eval_rows`): the memory check counts passes of that many.
pub(super) fn with_trainer_evaluating<T>(
    model: &Graph,
    devices: &Devices,
    config: &TrainConfig,
    eval_rows: usize,
    f: impl FnOnce(&mut Trainer<'_>) -> Result<T>,
) -> Result<T> {
    config.validate()?;
    let world = crate::world::current()?;
    // With several processes R counts them all, which overstates a process's slots: a
    // bound on the safe side.
    super::memory::check_training(model, devices, config, eval_rows)?;
    let replicas = logical_replicas(world, devices, config)?;
    let initial = initial_weights(model, config)?;
    // A world of one agrees with itself.
    Handshake::of(devices.list(), replicas, model, config, &initial).agree(world)?;
    let synchronized = crate::model::sync_batchnorm::has_synchronized_layers(model);
    let transport = RunTransport::of(devices.list(), world.size());
    check_features(transport, config, replicas, devices.len() * world.size(), synchronized)?;
    let n = devices.len();
    let process = (world.size() > 1).then(|| world.process());
    let recorder = Arc::new(FlightRecorder::new(devices.list().iter().map(Device::to_string), process));
    // Listed while the run lasts, for SIGUSR1.
    let _listed = flight::list(&recorder);
    let setup = WorkerSetup {
        world,
        rows: RowPlan::new(replicas, world.process(), world.size()),
        devices,
        replicas,
        model,
        initial: &initial,
        config,
        synchronized,
        // Between steps the pools' helper threads are idle; the workers spin in the
        // exchange where each has a core, and on messages where the coordinator has one
        // too.
        collective: WaitPolicy::for_threads(n),
        messages: WaitPolicy::for_threads(n + 1),
        recorder: &recorder,
    };
    let out = match transport {
        RunTransport::SharedMemory => setup.on_shared_memory(f),
        #[cfg(feature = "mpi")]
        RunTransport::Mpi => setup.across_processes(f),
        #[cfg(not(feature = "mpi"))]
        RunTransport::Mpi => {
            unreachable!("a world of several processes needs the mpi feature (world::init refuses it)")
        }
        #[cfg(feature = "cuda")]
        RunTransport::Nccl | RunTransport::NcclClique | RunTransport::DeviceCopies => setup.on_gpus(transport, f),
        #[cfg(not(feature = "cuda"))]
        RunTransport::Nccl | RunTransport::NcclClique | RunTransport::DeviceCopies => {
            Err(crate::devices::without_cuda(devices))
        }
    };
    // In a world of one there is no other process to hear from or tell.
    out.map_err(|e| processes::settle(world, e))
}

/// The run's logical replicas R (`TrainConfig::replicas`, else one per device of the
/// world), refused unless every device of the world gets as many.
fn logical_replicas(world: &World, devices: &Devices, config: &TrainConfig) -> Result<usize> {
    let n = devices.len();
    let in_world = n * world.size();
    let replicas = config.replicas.unwrap_or(in_world);
    if !replicas.is_multiple_of(in_world) {
        let among = match world.size() {
            1 => format!("{n} devices"),
            p => format!("{in_world} devices ({p} processes × {n})"),
        };
        return Err(Error::config(
            "replicas",
            format!("{replicas} logical replicas cannot be shared evenly by {among}"),
        ));
    }
    Ok(replicas)
}

/// The weights every replica starts from: a resumed run's, the caller's, or the model's
/// initialisation from the seed, made once on the host.
fn initial_weights(model: &Graph, config: &TrainConfig) -> Result<ParamStore> {
    match config.resume.as_ref().map(|r| &r.weights).or(config.initial.as_ref()) {
        Some(w) => {
            if w.params.len() != model.params_len() || w.buffers.len() != model.buffers_len() {
                return Err(Error::config("initial weights", "they do not match the model's tensors"));
            }
            Ok(w.clone())
        }
        None => Ok(model.init(config.seed)),
    }
}

/// A CPU replica from `start`, meeting the other replicas' statistics through `stats`
/// when its model has synchronized BatchNorm layers.
fn cpu_replica<'s>(
    device: Device,
    (model, store, optimizer): (Graph, ParamStore, Optimizer),
    seed: u64,
    stats: Option<&'s dyn StatsExchange>,
) -> CpuReplica<'s> {
    let replica = CpuReplica::new(device, model, store, optimizer, seed);
    match stats {
        Some(s) => replica.with_stats(s),
        None => replica,
    }
}

/// A GPU replica from `start`, meeting the other replicas' statistics through `stats`
/// when its model has synchronized BatchNorm layers (waits released by `abort`).
#[cfg(feature = "cuda")]
fn gpu_replica<'s>(
    device: Device,
    start: (Graph, ParamStore, Optimizer),
    seed: u64,
    stats: Option<&'s RecordedStats<'_>>,
    abort: &'s dyn Abort,
) -> Result<GpuReplica<'s>> {
    let replica = GpuReplica::new(device, start, seed)?;
    Ok(match stats {
        Some(s) => replica.with_stats(s, abort),
        None => replica,
    })
}

/// The features of issue 12 a run asks for, against what its transport carries
/// ([`RunTransport`]'s capabilities); checked before any worker starts. `in_world` counts
/// every process's devices. What every transport needs: synchronized BatchNorm's one
/// logical replica per device.
fn check_features(
    transport: RunTransport,
    config: &TrainConfig,
    replicas: usize,
    in_world: usize,
    synchronized: bool,
) -> Result<()> {
    if synchronized && replicas != in_world {
        return Err(Error::config(
            "sync-batchnorm",
            format!(
                "synchronized BatchNorm needs one logical replica per device, not {replicas} on {in_world} (its statistics \
                 meet inside the forward pass, which a device running its shards one after another cannot wait for)"
            ),
        ));
    }
    if synchronized && !transport.gathers_batchnorm_statistics() {
        return Err(Error::config(
            "sync-batchnorm",
            "synchronized BatchNorm on GPUs runs within one process so far (their statistics meet in this \
             process's shared memory; across processes only CPU devices gather them through MPI)",
        ));
    }
    if config.grad_compression != Compression::None && !transport.carries_16_bit_gradients() {
        return Err(Error::config(
            "grad-compression",
            format!(
                "{} gradients on GPUs run within one process so far (the 16-bit wires are all-gathered among \
                 this process's GPUs; across processes only CPU devices send them as 16-bit codes)",
                config.grad_compression.name()
            ),
        ));
    }
    Ok(())
}

/// How a run's workers are set up: what every one of them starts from, and how they
/// wait; [`WorkerSetup::run`] starts them.
struct WorkerSetup<'a> {
    world: &'static World,
    /// This process's logical replicas.
    rows: RowPlan,
    devices: &'a Devices,
    replicas: usize,
    model: &'a Graph,
    initial: &'a ParamStore,
    config: &'a TrainConfig,
    /// Whether the model has synchronized BatchNorm layers (its replicas then meet each
    /// other's statistics).
    synchronized: bool,
    /// How workers wait for each other in the exchange.
    collective: WaitPolicy,
    /// How the coordinator and the workers wait for messages.
    messages: WaitPolicy,
    /// The run's flight recorder: a ring per device, and the coordinator's.
    recorder: &'a FlightRecorder,
}

impl WorkerSetup<'_> {
    /// Each device's statistics exchange (`stats[d]`), its calls recorded in the device's ring.
    fn recorded<'s, S: StatsExchange>(&'s self, stats: &'s [S]) -> Vec<RecordedStats<'s>> {
        stats.iter().enumerate().map(|(d, s)| RecordedStats { inner: s, ring: self.recorder.device(d) }).collect()
    }

    /// The gradients' width: every parameter and buffer value, as a slot holds them.
    fn width(&self) -> usize {
        self.model.params_len() + self.model.buffers_len()
    }

    /// CPU devices of one process, meeting in shared memory.
    fn on_shared_memory<T>(&self, f: impl FnOnce(&mut Trainer<'_>) -> Result<T>) -> Result<T> {
        let (n, model, config) = (self.devices.len(), self.model, self.config);
        let codec = Codec::new(config.grad_compression, model.params_len());
        let shm = ShmGroup::with_codec(n, self.replicas, self.width(), self.collective, codec)?;
        let stats: Vec<ShmStats<'_>> = (0..n).map(|r| shm.stats(r)).collect();
        let stats = self.recorded(&stats);
        let synchronized = self.synchronized;
        let stats = |d| synchronized.then(|| &stats[d] as &dyn StatsExchange);
        let (seed, loss, decay) = (config.seed, config.loss(), &decay_mask(model, config.weight_decay_on));
        self.run(
            &shm,
            f,
            |d, device, start| Ok(cpu_replica(device, start, seed, stats(d)).with_decay(decay.clone()).with_loss(loss)),
            |d, _| Ok(shm.member(d)),
        )
    }

    /// CPU devices of several processes, meeting through MPI.
    #[cfg(feature = "mpi")]
    fn across_processes<T>(&self, f: impl FnOnce(&mut Trainer<'_>) -> Result<T>) -> Result<T> {
        let (n, model, config) = (self.devices.len(), self.model, self.config);
        let codec = Codec::new(config.grad_compression, model.params_len());
        let group =
            crate::exchange::mpi::MpiGroup::new(self.world, n, self.replicas, self.width(), self.collective, codec)?;
        let stats: Vec<_> = (0..n).map(|r| group.stats(r)).collect();
        let stats = self.recorded(&stats);
        let synchronized = self.synchronized;
        let stats = |d| synchronized.then(|| &stats[d] as &dyn StatsExchange);
        let (seed, loss, decay) = (config.seed, config.loss(), &decay_mask(model, config.weight_decay_on));
        self.run(
            &group,
            f,
            |d, device, start| Ok(cpu_replica(device, start, seed, stats(d)).with_decay(decay.clone()).with_loss(loss)),
            |d, _| Ok(group.member(d)),
        )
    }

    /// GPUs, meeting through NCCL (in one process, or as one clique across processes) or
    /// device copies; synchronized BatchNorm's statistics meet on the host, in the
    /// shared-memory statistics exchange CPU devices use (a group of no gradient values).
    #[cfg(feature = "cuda")]
    fn on_gpus<T>(&self, transport: RunTransport, f: impl FnOnce(&mut Trainer<'_>) -> Result<T>) -> Result<T> {
        let (n, model, config, devices) = (self.devices.len(), self.model, self.config, self.devices);
        let k = self.replicas / (n * self.world.size());
        let width = self.width();
        let ordinals = devices.cuda_ordinals();
        let codec = Codec::new(config.grad_compression, model.params_len());
        let stats_group =
            if self.synchronized { Some(ShmGroup::new(n, self.replicas, 0, self.collective)?) } else { None };
        let stats: Vec<ShmStats<'_>> = stats_group.iter().flat_map(|g| (0..n).map(|r| g.stats(r))).collect();
        let stats = self.recorded(&stats);
        let group = match transport {
            RunTransport::NcclClique if transport_for(&ordinals) == Transport::Copies => {
                return Err(Error::CudaUnavailable(format!(
                    "the GPUs of several processes meet through NCCL only, and it cannot serve here \
                     (it must load, 2.18 or later, and each process must name distinct GPUs; this one names {devices})"
                )))
            }
            RunTransport::NcclClique => {
                GpuGroup::Nccl(NcclGroup::in_clique(&ordinals, width, processes::clique(self.world, n)?)?)
            }
            RunTransport::Nccl => GpuGroup::new(Transport::Nccl, &ordinals, width)?,
            _ => GpuGroup::new(Transport::Copies, &ordinals, width)?,
        };
        let abort = Aborts::new(&group, stats_group.as_ref().map(|g| g as &dyn Abort));
        let (seed, loss, decay) = (config.seed, config.loss(), &decay_mask(model, config.weight_decay_on));
        self.run(
            &abort,
            f,
            |d, device, start| {
                Ok(gpu_replica(device, start, seed, stats.get(d), &abort)?.with_decay(decay.clone()).with_loss(loss))
            },
            |d, replica| GpuExchange::new(group.join(d, replica.stream())?, width, k)?.with_codec(codec),
        )
    }

    /// Starts one worker thread per device under a scope — each builds its replica with
    /// `build`, then joins the exchange with `join` — calls `f` with the coordinator's
    /// handle, and returns when every thread has ended. `group` is the run's exchange,
    /// aborted on any failure.
    fn run<T, G, R, X>(
        &self,
        group: &G,
        f: impl FnOnce(&mut Trainer<'_>) -> Result<T>,
        build: impl Fn(usize, Device, (Graph, ParamStore, Optimizer)) -> Result<R> + Sync,
        join: impl Fn(usize, &R) -> Result<X> + Sync,
    ) -> Result<T>
    where
        G: Abort,
        R: Replica,
        X: Exchange<Mem = R::Mem>,
    {
        let started = Instant::now();
        let n = self.devices.len();
        let k = self.rows.count / n;
        let threads = self.devices.threads_per_device();
        let (reply_tx, reply_rx) = bounded(n * 2);
        let gate = SetupGate::new(n);
        let result = std::thread::scope(|s| {
            let mut commands = Vec::with_capacity(n);
            for (d, &device) in self.devices.list().iter().enumerate() {
                let (tx, rx) = bounded::<Command>(2);
                commands.push(tx);
                let optimizer = match &self.config.resume {
                    Some(r) => r.optimizer.clone(),
                    None => Optimizer::new(self.config.optimizer, self.model.params_len()),
                };
                let start = (self.model.clone(), self.initial.clone(), optimizer);
                let seat = WorkerStart {
                    index: d,
                    device,
                    shards: self.rows.first + d * k..self.rows.first + (d + 1) * k,
                    wait: self.messages,
                    sharding: self.config.optimizer_sharding,
                    abort: group,
                    gate: &gate,
                    ring: self.recorder.device(d),
                    commands: rx,
                    replies: reply_tx.clone(),
                };
                let (build, join) = (&build, &join);
                let body = move || {
                    panics::mark_this_thread();
                    on_device_thread(device, threads, seat, |seat| {
                        worker::start(seat, || build(d, device, start), |r| join(d, r))
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
                clip_grad_norm: self.config.clip_grad_norm,
                world: self.world,
                rows: self.rows,
                stop: self.config.stop.clone(),
                // A limit too far to be an instant is no limit.
                deadline: self.config.max_duration.and_then(|d| started.checked_add(d)),
                stop_agreed: None,
                recorder: self.recorder,
            };
            let out = f(&mut trainer);
            if out.is_err() {
                group.abort();
            }
            drop(trainer); // closes the command channels: workers leave their loops
            out
        });
        // Every worker has ended: the convolutions' idle work buffers go back too.
        crate::ops::conv2d::release_scratch();
        result
    }
}

/// Runs `body` on a device's worker thread: a CPU device inside its own thread pool of
/// `threads` (the worker thread is one of them), a GPU directly. A pool that cannot start
/// is reported as the worker's failure.
fn on_device_thread(device: Device, threads: usize, seat: WorkerStart<'_>, body: impl FnOnce(WorkerStart<'_>) + Send) {
    match device {
        Device::Cpu(_) => {
            let d = seat.index;
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .use_current_thread()
                .thread_name(move |i| format!("lockstep-cpu{d}-{i}"))
                .start_handler(|_| panics::mark_this_thread())
                .build();
            match pool {
                Ok(pool) => pool.install(|| body(seat)),
                Err(e) => {
                    seat.abort.abort();
                    seat.gate.arrive(false);
                    let cause = format!("cannot start its thread pool: {e}");
                    let _ = seat.replies.send((d, Err(Error::Worker { device: device.to_string(), step: 0, cause })));
                }
            }
        }
        Device::Cuda(_) => body(seat),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What each device kind and world refuses, and says why, before any worker starts.
    #[test]
    fn features_are_checked_against_the_devices_and_the_world() {
        let (cpu, gpu) = ([Device::Cpu(0), Device::Cpu(1)], [Device::Cuda(0), Device::Cuda(1)]);
        let plain = TrainConfig::default();
        let bf16 = TrainConfig { grad_compression: Compression::Bf16, ..TrainConfig::default() };
        let refusal = |r: Result<()>| r.expect_err("refused").to_string();
        // The transport of `devices` among `in_world` devices (one process's GPUs: NCCL,
        // whose features device copies share; asked without loading NCCL here).
        let on = |devices: &[Device], in_world: usize| match (devices[0], in_world / devices.len()) {
            (Device::Cpu(_), processes) => RunTransport::of(devices, processes),
            (Device::Cuda(_), 1) => RunTransport::Nccl,
            (Device::Cuda(_), _) => RunTransport::NcclClique,
        };

        // In one process both kinds run both features (one logical replica per device).
        for devices in [&cpu[..], &gpu[..]] {
            assert!(check_features(on(devices, 2), &bf16, 2, 2, true).is_ok(), "{devices:?}");
        }
        // Synchronized BatchNorm needs R = the world's devices, on any kind.
        for devices in [&cpu[..], &gpu[..]] {
            let e = refusal(check_features(on(devices, 2), &plain, 4, 2, true));
            assert!(e.contains("sync-batchnorm") && e.contains("one logical replica per device, not 4 on 2"), "{e}");
        }
        // Across processes (4 devices in the world, 2 here): CPU devices run both ...
        assert!(check_features(on(&cpu, 4), &bf16, 4, 4, true).is_ok());
        // ... GPUs neither, each refusal naming its flag.
        let e = refusal(check_features(on(&gpu, 4), &plain, 4, 4, true));
        assert!(e.contains("sync-batchnorm") && e.contains("within one process"), "{e}");
        let e = refusal(check_features(on(&gpu, 4), &bf16, 4, 4, false));
        assert!(e.contains("grad-compression") && e.contains("bf16 gradients on GPUs run within one process"), "{e}");
        assert!(check_features(on(&gpu, 4), &plain, 4, 4, false).is_ok());
    }
}
