//! Synchronous data-parallel training: [`train_data_parallel`], and [`with_trainer`] for
//! loops written by the user.
//!
//! Threads and ownership: the caller's thread is the coordinator (sampler, metrics,
//! logging, replica checks); a loader thread gathers global batches ahead of time into
//! a bounded channel; one worker thread per device owns a replica and the device's
//! thread pool. Workers are built first, then run under `std::thread::scope`, so no
//! thread outlives the call. Commands reach workers through bounded crossbeam channels;
//! gradients never do: they meet in the exchange — shared memory between CPU devices
//! (`comm::shm`), NCCL or device copies between GPUs (`comm::gpu`).
//!
//! Faults: an error or a panic in any worker aborts the exchange, which releases every
//! other worker from its collective with `Error::Aborted`; the coordinator returns the
//! root cause, naming the device and the step, and the scope joins every thread.

pub mod scatter;
pub mod worker;

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};

pub use scatter::{LastBatch, Shuffle};
use worker::{Replica, StepOutcome, StepWork};

use crate::checkpoint::{self, CheckpointPolicy, Resume};
use crate::comm::gpu::{GpuGroup, GpuRank};
use crate::comm::shm::{ShmExchange, ShmRank};
use crate::cuda::replica::GpuReplica;
use crate::data::Dataset;
use crate::devices::Devices;
use crate::error::{Error, Result};
use crate::nn::loss::Metrics;
use crate::nn::{ParamStore, Sequential};
use crate::optim::{LrSchedule, Optimizer, OptimizerConfig};
use crate::tensor::{Device, Shape};

/// A global batch gathered on the host: x (B, *sample_shape) as f32, y (B).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub x: Vec<f32>,
    pub y: Vec<u32>,
    pub sample_shape: Shape,
}

impl Batch {
    /// Gathers the samples `indices` of `data`, in that order.
    pub fn gather(data: &Dataset, indices: &[usize]) -> Batch {
        let per = data.sample_shape().numel();
        let mut x = vec![0.0; indices.len() * per];
        let mut y = vec![0; indices.len()];
        data.gather_into(indices, &mut x, &mut y);
        Batch { x, y, sample_shape: data.sample_shape().clone() }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// True for a batch without samples.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }
}

/// What to do when the loss is NaN or infinite.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum NonFinite {
    /// Stop with `Error::NonFiniteLoss`, naming the step.
    Error,
    /// Keep training.
    Allow,
}

/// Everything about a run but the model, the data and the devices.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub epochs: usize,
    /// Stop after this many steps in all, if fewer than the epochs hold.
    pub max_steps: Option<u64>,
    /// The GLOBAL batch size: samples per step whatever the number of devices.
    pub batch_size: usize,
    pub optimizer: OptimizerConfig,
    /// How the learning rate changes over the run's steps.
    pub schedule: LrSchedule,
    pub seed: u64,
    pub shuffle: Shuffle,
    pub last_batch: LastBatch,
    /// Logical replicas R (default: the number of devices); must be a multiple of it.
    pub replicas: Option<usize>,
    /// Compare every replica's tensors every K steps (and at the end). Default: every
    /// step in debug builds, every 100 steps otherwise (hashing the tensors costs about
    /// a microsecond per 1,000 values); `None` turns it off.
    pub check_replicas_every: Option<u64>,
    pub non_finite: NonFinite,
    /// Weights to start from instead of a seeded initialisation.
    pub initial: Option<ParamStore>,
    /// Continue a run from this state (weights, optimiser, position) instead of starting.
    pub resume: Option<Resume>,
    /// Write checkpoints as this says.
    pub checkpoint: Option<CheckpointPolicy>,
    /// Raised (e.g. by a SIGINT handler) to stop after the current step; a checkpoint
    /// is written if a policy is set, and the run returns `Error::Interrupted`.
    pub stop: Option<Arc<AtomicBool>>,
    /// Samples per forward pass in evaluation.
    pub eval_batch: usize,
    /// Global batches the loader may gather ahead of the step being trained.
    pub prefetch: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 1,
            max_steps: None,
            batch_size: 64,
            optimizer: OptimizerConfig::adam(1e-3),
            schedule: LrSchedule::Constant,
            seed: 0,
            shuffle: Shuffle::Seeded,
            last_batch: LastBatch::Keep,
            replicas: None,
            check_replicas_every: Some(if cfg!(debug_assertions) { 1 } else { 100 }),
            non_finite: NonFinite::Error,
            initial: None,
            resume: None,
            checkpoint: None,
            stop: None,
            eval_batch: 512,
            prefetch: 4,
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
        if self.replicas == Some(0) {
            return Err(Error::config("replicas", "must be at least 1"));
        }
        if self.check_replicas_every == Some(0) {
            return Err(Error::config("check-replicas-every", "must be at least 1"));
        }
        self.optimizer.validate()
    }
}

/// One replica's share of a step, as reported to observers.
#[derive(Clone, Debug)]
pub struct ShardReport {
    pub device: Device,
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

enum Command {
    Step(Arc<StepWork>),
    Eval(Arc<Batch>, Range<usize>, usize),
    Predict(Arc<Batch>, Range<usize>),
    Fingerprints,
    Snapshot,
}

enum Reply {
    Step(StepOutcome),
    Eval(Metrics),
    Predict(Vec<f32>),
    Fingerprints(Vec<(String, u64)>),
    Snapshot(Box<(ParamStore, Optimizer)>),
}

/// The coordinator's handle on running workers: drive training step by step.
///
/// Obtained inside [`with_trainer`]; every call is synchronous (it returns when every
/// worker has answered). After a worker fails, every call returns an error.
pub struct Trainer<'s> {
    commands: Vec<Sender<Command>>,
    replies: Receiver<(usize, Result<Reply>)>,
    exchange: &'s Exchange,
    devices: Vec<Device>,
    replicas: usize,
    step: u64,
    failed: Option<String>,
    wait: Wait,
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
            let (d, r) = recv_spinning(&self.replies, self.wait).map_err(|_| Error::Worker {
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

    fn step_at(&mut self, batch: Batch, lr_scale: f32) -> Result<StepReport> {
        if batch.is_empty() {
            return Err(Error::config("batch", "a training step needs at least one sample"));
        }
        let t0 = Instant::now();
        let shards = scatter::shards(batch.len(), self.replicas);
        let work = Arc::new(StepWork { step: self.step, batch: Arc::new(batch), shards, lr_scale });
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
        let replies = self.ask(|d| Command::Predict(Arc::clone(&batch), parts[d].clone()))?;
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
        worker::check_replicas(self.step, &prints)
    }

    /// The weights and optimiser state of replica 0.
    pub fn weights(&mut self) -> Result<(ParamStore, Optimizer)> {
        let replies = self.ask(|_| Command::Snapshot)?;
        let Some(Reply::Snapshot(s)) = replies.into_iter().next() else {
            unreachable!("a snapshot command gets a snapshot")
        };
        Ok(*s)
    }
}

/// Where the gradients of a run meet.
enum Exchange {
    Shm(ShmExchange),
    Gpu(GpuGroup),
}

impl Exchange {
    /// Releases every worker waiting in (or later entering) a collective.
    fn abort(&self) {
        match self {
            Exchange::Shm(x) => x.abort(),
            Exchange::Gpu(g) => g.abort(),
        }
    }
}

/// What a worker thread does with each command, whatever its device.
trait Worker {
    fn device(&self) -> Device;
    fn step(&mut self, work: &StepWork) -> Result<StepOutcome>;
    fn evaluate(&mut self, batch: &Batch, rows: Range<usize>, chunk: usize) -> Result<Metrics>;
    fn predict(&mut self, batch: &Batch, rows: Range<usize>) -> Result<Vec<f32>>;
    fn fingerprints(&mut self) -> Result<Vec<(String, u64)>>;
    fn snapshot(&mut self) -> Result<(ParamStore, Optimizer)>;
}

/// A CPU device: its replica and its rank in the shared-memory exchange.
struct CpuWorker<'e> {
    replica: Replica,
    comm: ShmRank<'e>,
    first_shard: usize,
    shards_here: usize,
}

impl Worker for CpuWorker<'_> {
    fn device(&self) -> Device {
        self.replica.device
    }
    fn step(&mut self, work: &StepWork) -> Result<StepOutcome> {
        self.replica.step(work, &self.comm, self.first_shard, self.shards_here)
    }
    fn evaluate(&mut self, batch: &Batch, rows: Range<usize>, chunk: usize) -> Result<Metrics> {
        self.replica.evaluate(batch, rows, chunk)
    }
    fn predict(&mut self, batch: &Batch, rows: Range<usize>) -> Result<Vec<f32>> {
        self.replica.predict(batch, rows)
    }
    fn fingerprints(&mut self) -> Result<Vec<(String, u64)>> {
        Ok(self.replica.fingerprints())
    }
    fn snapshot(&mut self) -> Result<(ParamStore, Optimizer)> {
        Ok((self.replica.store.clone(), self.replica.optimizer.clone()))
    }
}

/// A GPU: its replica and its rank in the GPU collective. The rank is declared first so
/// that it is dropped first: the collective's last use of the replica's buffers ends
/// before they are freed.
struct GpuWorker<'g> {
    comm: GpuRank<'g>,
    replica: GpuReplica,
    first_shard: usize,
    shards_here: usize,
}

impl Worker for GpuWorker<'_> {
    fn device(&self) -> Device {
        self.replica.device
    }
    fn step(&mut self, work: &StepWork) -> Result<StepOutcome> {
        self.replica.step(work, &mut self.comm, self.first_shard, self.shards_here)
    }
    fn evaluate(&mut self, batch: &Batch, rows: Range<usize>, chunk: usize) -> Result<Metrics> {
        self.replica.evaluate(batch, rows, chunk)
    }
    fn predict(&mut self, batch: &Batch, rows: Range<usize>) -> Result<Vec<f32>> {
        self.replica.predict(batch, rows)
    }
    fn fingerprints(&mut self) -> Result<Vec<(String, u64)>> {
        self.replica.fingerprints()
    }
    fn snapshot(&mut self) -> Result<(ParamStore, Optimizer)> {
        self.replica.snapshot()
    }
}

fn worker_loop(
    mut worker: impl Worker,
    rank: usize,
    exchange: &Exchange,
    wait: Wait,
    commands: Receiver<Command>,
    replies: Sender<(usize, Result<Reply>)>,
) {
    let device = worker.device();
    let mut step = 0u64;
    while let Ok(cmd) = recv_spinning(&commands, wait) {
        let result = catch_unwind(AssertUnwindSafe(|| -> Result<Reply> {
            Ok(match &cmd {
                Command::Step(work) => {
                    step = work.step;
                    Reply::Step(worker.step(work)?)
                }
                Command::Eval(batch, rows, chunk) => Reply::Eval(worker.evaluate(batch, rows.clone(), *chunk)?),
                Command::Predict(batch, rows) => Reply::Predict(worker.predict(batch, rows.clone())?),
                Command::Fingerprints => Reply::Fingerprints(worker.fingerprints()?),
                Command::Snapshot => Reply::Snapshot(Box::new(worker.snapshot()?)),
            })
        }));
        // A worker released from a collective by another's failure says only that
        // (`Error::Aborted`); the one that failed names itself, the step and the cause.
        let failure = |cause: String| Error::Worker { device: device.to_string(), step, cause };
        let result = match result {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(Error::Aborted)) => Err(Error::Aborted),
            Ok(Err(e)) => Err(failure(e.to_string())),
            Err(panic) => Err(failure(format!("panicked: {}", panic_message(&panic)))),
        };
        if result.is_err() {
            exchange.abort();
        }
        let failed = result.is_err();
        if replies.send((rank, result)).is_err() || failed {
            return;
        }
    }
}

/// Lets GPU workers join the collective only once every one of them has built its
/// replica: NCCL's communicator set-up waits for every rank, so a rank that failed
/// before joining would leave the others waiting forever.
struct SetupGate {
    state: parking_lot::Mutex<(usize, bool)>,
    all: parking_lot::Condvar,
    n: usize,
}

impl SetupGate {
    fn new(n: usize) -> SetupGate {
        SetupGate { state: parking_lot::Mutex::new((0, false)), all: parking_lot::Condvar::new(), n }
    }

    /// Releases every waiting worker with a failure (a worker thread could not start).
    fn abandon(&self) {
        let mut s = self.state.lock();
        *s = (self.n, true);
        self.all.notify_all();
    }

    /// Reports this worker's set-up (`ok`) and waits for every other's; true when all
    /// succeeded.
    fn arrive(&self, ok: bool) -> bool {
        let mut s = self.state.lock();
        s.0 += 1;
        s.1 |= !ok;
        if s.0 == self.n {
            self.all.notify_all();
        }
        while s.0 < self.n {
            self.all.wait(&mut s);
        }
        !s.1
    }
}

/// Runs a GPU worker on its own thread: builds the replica, waits at `gate`, joins the
/// collective, then serves commands. A failure before serving is sent as the reply to
/// the first command, as a worker's failure always is.
#[allow(clippy::too_many_arguments)]
fn gpu_worker(
    (rank, ordinal): (usize, usize),
    start: (Sequential, ParamStore, Optimizer, u64),
    (first_shard, shards_here): (usize, usize),
    exchange: &Exchange,
    gate: &SetupGate,
    wait: Wait,
    commands: Receiver<Command>,
    replies: Sender<(usize, Result<Reply>)>,
) {
    let Exchange::Gpu(group) = exchange else { unreachable!("GPU workers share a GPU exchange") };
    let (model, store, optimizer, seed) = start;
    // A panic (cudarc panics where a library lacks a symbol) is an error like any other:
    // the gate must hear from every worker, or the others would wait for ever.
    let caught =
        |p: Box<dyn std::any::Any + Send>| Error::config("GPU worker", format!("panicked: {}", panic_message(&p)));
    let built =
        catch_unwind(AssertUnwindSafe(|| GpuReplica::new(ordinal, model, &store, &optimizer, seed, shards_here)))
            .unwrap_or_else(|p| Err(caught(p)));
    let joined = match (gate.arrive(built.is_ok()), built) {
        (true, Ok(replica)) => catch_unwind(AssertUnwindSafe(|| group.join(rank, replica.stream())))
            .unwrap_or_else(|p| Err(caught(p)))
            .map(|comm| (replica, comm)),
        (_, Err(e)) => Err(e),
        (false, Ok(_)) => Err(Error::Aborted),
    };
    match joined {
        Ok((replica, comm)) => {
            worker_loop(GpuWorker { replica, comm, first_shard, shards_here }, rank, exchange, wait, commands, replies)
        }
        Err(e) => {
            exchange.abort();
            let e = match e {
                Error::Aborted => Error::Aborted,
                e => Error::Worker { device: Device::Cuda(ordinal).to_string(), step: 0, cause: e.to_string() },
            };
            let _ = replies.send((rank, Err(e)));
        }
    }
}

/// How a thread waits for the next message.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Wait {
    /// Spin for up to 100 µs, then sleep: when a core is left for the coordinator.
    Spin,
    /// Sleep at once: when the threads outnumber the cores.
    Park,
}

/// Receives, spinning for a short while before sleeping. Steps of a small model last tens
/// of microseconds; a thread that parks between them pays the wake-up of a sleeping
/// core every step (measured: ~40 µs on a virtual machine, more than the step itself).
/// Past `SPIN`, it sleeps like `recv`.
/// Spinning only pays when a core is free for it: otherwise it takes the core from the
/// very thread it waits for.
fn recv_spinning<T>(rx: &Receiver<T>, wait: Wait) -> Result<T, crossbeam_channel::RecvError> {
    const SPIN: Duration = Duration::from_micros(100);
    if wait == Wait::Park {
        return rx.recv();
    }
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return Err(crossbeam_channel::RecvError),
            Err(crossbeam_channel::TryRecvError::Empty) if start.elapsed() < SPIN => std::hint::spin_loop(),
            Err(crossbeam_channel::TryRecvError::Empty) => return rx.recv(),
        }
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
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
            if w.params.len() != model.num_params() || w.buffers.len() != model.num_buffers() {
                return Err(Error::config("initial weights", "they do not match the model's tensors"));
            }
            w.clone()
        }
        None => model.init(config.seed),
    };
    let width = model.num_params() + model.num_buffers();
    let gpus: Vec<usize> =
        devices.list().iter().filter_map(|d| if let Device::Cuda(o) = d { Some(*o) } else { None }).collect();
    let exchange = match gpus.len() {
        0 => Exchange::Shm(ShmExchange::new(n, replicas, width)?),
        g if g == n => Exchange::Gpu(GpuGroup::new(&gpus, width, false)?),
        _ => return Err(Error::config("devices", "a run trains on CPU devices or on GPUs, not on both")),
    };
    // Build every worker's start first: replicas' state, channels, pools' sizes.
    let mut starts = Vec::with_capacity(n);
    let mut commands = Vec::with_capacity(n);
    let (reply_tx, reply_rx) = bounded(n * 2);
    for &device in devices.list() {
        let optimizer = match &config.resume {
            Some(r) => r.optimizer.clone(),
            None => Optimizer::new(config.optimizer, model.num_params()),
        };
        let (tx, rx) = bounded::<Command>(2);
        commands.push(tx);
        starts.push((device, (model.clone(), initial.clone(), optimizer), rx));
    }
    let threads = devices.threads_per_device();
    let k = replicas / n;
    // Between steps the pools' helper threads are idle; the coordinator may spin if a
    // core is left over once every worker thread has one.
    let wait = if n < crate::devices::available_cores() { Wait::Spin } else { Wait::Park };
    let gate = SetupGate::new(n);
    std::thread::scope(|s| {
        for (rank, (device, (model, store, optimizer), rx)) in starts.into_iter().enumerate() {
            let (exchange, gate, replies) = (&exchange, &gate, reply_tx.clone());
            let seed = config.seed;
            let run = move || match (device, exchange) {
                (Device::Cuda(ordinal), _) => gpu_worker(
                    (rank, ordinal),
                    (model, store, optimizer, seed),
                    (rank * k, k),
                    exchange,
                    gate,
                    wait,
                    rx,
                    replies,
                ),
                (Device::Cpu(_), Exchange::Shm(shm)) => {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .use_current_thread()
                        .thread_name(move |i| format!("lockstep-cpu{rank}-{i}"))
                        .build();
                    match pool {
                        Ok(pool) => pool.install(|| {
                            let replica = Replica { device, model, store, optimizer, seed };
                            let worker =
                                CpuWorker { replica, comm: shm.rank(rank), first_shard: rank * k, shards_here: k };
                            worker_loop(worker, rank, exchange, wait, rx, replies)
                        }),
                        Err(e) => {
                            exchange.abort();
                            let _ = replies.send((
                                rank,
                                Err(Error::Worker {
                                    device: device.to_string(),
                                    step: 0,
                                    cause: format!("cannot start its thread pool: {e}"),
                                }),
                            ));
                        }
                    }
                }
                (Device::Cpu(_), Exchange::Gpu(_)) => unreachable!("CPU devices share the shared-memory exchange"),
            };
            std::thread::Builder::new().name(format!("lockstep-{device}")).spawn_scoped(s, run).map_err(|e| {
                // The workers already started must not wait for this one.
                gate.abandon();
                exchange.abort();
                Error::config("threads", format!("cannot spawn a worker thread: {e}"))
            })?;
        }
        drop(reply_tx);
        let mut trainer = Trainer {
            commands,
            replies: reply_rx,
            exchange: &exchange,
            devices: devices.list().to_vec(),
            replicas,
            step: config.resume.as_ref().map_or(0, |r| r.step),
            failed: None,
            wait,
        };
        let out = f(&mut trainer);
        if out.is_err() {
            exchange.abort();
        }
        drop(trainer); // closes the command channels: workers leave their loops
        out
    })
}

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
    if let Some(p) = &config.checkpoint {
        checkpoint::prepare_dir(&p.dir)?;
    }
    with_trainer(model, devices, config, |trainer| {
        let started = Instant::now();
        let mut losses = Vec::with_capacity(total_steps.saturating_sub(start.step).min(1 << 16) as usize);
        let mut epochs = Vec::new();
        let mut train_time = Duration::ZERO;
        let mut trained_samples = 0u64;
        std::thread::scope(|s| -> Result<()> {
            let (batch_tx, batch_rx) = bounded::<(usize, usize, Batch)>(config.prefetch.max(1));
            s.spawn(move || {
                let mut step = start.step;
                for epoch in start.epoch..config.epochs {
                    let order = scatter::epoch_order(train.len(), config.seed, epoch, config.shuffle);
                    let skip = if epoch == start.epoch { start.step_in_epoch } else { 0 };
                    let batches = order.chunks(config.batch_size).take(steps_per_epoch).enumerate().skip(skip);
                    for (i, idx) in batches {
                        if step >= total_steps || batch_tx.send((epoch, i, Batch::gather(train, idx))).is_err() {
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
                let report = trainer.step_at(batch, lr_scale)?;
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
                let interrupted = config.stop.as_ref().is_some_and(|f| f.load(Ordering::SeqCst));
                let done = trainer.steps() == total_steps;
                let mut written = None;
                if let Some(policy) = &config.checkpoint {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setup_gate_opens_only_when_every_worker_succeeded() {
        for failing in [None, Some(0), Some(2)] {
            let gate = SetupGate::new(3);
            let verdicts: Vec<bool> = std::thread::scope(|s| {
                let hs: Vec<_> =
                    (0..3).map(|w| (w, &gate)).map(|(w, g)| s.spawn(move || g.arrive(Some(w) != failing))).collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(verdicts, vec![failing.is_none(); 3], "failing worker {failing:?}");
        }
    }

    #[test]
    fn an_abandoned_gate_releases_the_workers_already_waiting() {
        let gate = SetupGate::new(3);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| gate.arrive(true));
            std::thread::sleep(Duration::from_millis(20));
            gate.abandon(); // the third worker never started
            assert!(!waiting.join().unwrap());
        });
    }
}
