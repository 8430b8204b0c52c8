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

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};

use super::scatter;
use super::worker::{Replica, StepOutcome, StepWork};
use super::{Batch, ShardReport, StepReport, TrainConfig};
use crate::comm::gpu::{GpuGroup, GpuRank};
use crate::comm::shm::{ShmExchange, ShmRank};
use crate::cuda::replica::GpuReplica;
use crate::data::Dataset;
use crate::devices::Devices;
use crate::error::{Error, Result};
use crate::nn::loss::Metrics;
use crate::nn::{ParamStore, Sequential};
use crate::optim::Optimizer;
use crate::tensor::Device;

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

    pub(super) fn step_at(&mut self, batch: Batch, lr_scale: f32) -> Result<StepReport> {
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
        super::worker::check_replicas(self.step, &prints)
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
