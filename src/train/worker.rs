//! A device's worker thread: how it starts, and what it does with each command.
//!
//! A worker owns one [`Replica`] and its side of the [`Exchange`]; it is started by
//! [`start`] on its own thread (built first, then past the set-up gate, then joined to
//! the exchange), and serves the coordinator's commands until the channel closes. Every
//! device runs this same loop: the step, evaluation and prediction are `step.rs`'s, the
//! arithmetic the replica's, the summing the exchange's.
//!
//! Faults: an error or a panic while serving is sent back naming the device and the step,
//! and aborts the exchange, which releases every other worker from its collective with
//! `Error::Aborted`; the worker then leaves its loop. A panic is described by `panics.rs`
//! (where it happened, and a backtrace if `RUST_BACKTRACE` asks), and printed only there. A worker released that way says only
//! that, so the coordinator reports the root cause.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::flight::Ring;
use super::panics;
use super::replica::{Replica, Snapshot, StepOutcome, Take};
use super::step::{self, Evaluated, StepWork};
use super::Batch;
use crate::error::{Error, Result};
use crate::exchange::{Abort, Exchange, WaitPolicy};
use crate::optim::Sharding;
use crate::tensor::Device;

/// What the coordinator asks of every worker.
pub(crate) enum Command {
    Step(Arc<StepWork>),
    /// Evaluate these rows of the batch, in chunks of this many samples, giving up
    /// between chunks once the flag is raised.
    Eval(Arc<Batch>, Range<usize>, usize, Option<Arc<AtomicBool>>),
    /// Predict these rows of the batch, in chunks of this many samples.
    Predict(Arc<Batch>, Range<usize>, usize),
    Fingerprints,
    Snapshot(Take),
    OptimizerBytes,
}

/// A worker's answer to a [`Command`].
pub(crate) enum Reply {
    Step(StepOutcome),
    Eval(Evaluated),
    Predict(Vec<f32>),
    Fingerprints(Vec<(String, u64)>),
    Snapshot(Box<Snapshot>),
    OptimizerBytes(usize),
}

/// A device's replica with its side of the exchange. The exchange is declared first so
/// that it is dropped first: a GPU member that departs aborts a collective its peers can no
/// longer complete, which releases the stream the replica's drop then waits for.
struct Worker<R, X> {
    exchange: X,
    replica: R,
    /// The logical replicas (shards) this device trains.
    shards: Range<usize>,
}

impl<R: Replica, X: Exchange<Mem = R::Mem>> Worker<R, X> {
    /// Serves `cmd`; the step's collective calls are recorded in `ring`.
    fn handle(&mut self, cmd: &Command, ring: &Ring) -> Result<Reply> {
        let r = &mut self.replica;
        Ok(match cmd {
            Command::Step(work) => Reply::Step(step::train(r, &mut self.exchange, work, self.shards.clone(), ring)?),
            Command::Eval(batch, rows, chunk, stop) => {
                Reply::Eval(step::evaluate(r, batch, rows.clone(), *chunk, stop.as_deref())?)
            }
            Command::Predict(batch, rows, chunk) => Reply::Predict(step::predict(r, batch, rows.clone(), *chunk)?),
            Command::Fingerprints => Reply::Fingerprints(r.fingerprints()?),
            Command::Snapshot(take) => Reply::Snapshot(Box::new(r.snapshot(*take)?)),
            Command::OptimizerBytes => Reply::OptimizerBytes(r.optimizer_bytes()),
        })
    }
}

/// Where a worker starts: its device (and that device's index in the process), its
/// shards, and its channels.
pub(crate) struct WorkerStart<'a> {
    /// The device's index among the process's devices; its replies carry it.
    pub index: usize,
    pub device: Device,
    pub shards: Range<usize>,
    pub wait: WaitPolicy,
    /// With [`Sharding::Sharded`], the replica keeps the optimiser state of its
    /// exchange's owned parameters only, once joined.
    pub sharding: Sharding,
    pub abort: &'a dyn Abort,
    pub gate: &'a SetupGate,
    /// This device's ring of the run's flight recorder.
    pub ring: &'a Ring,
    pub commands: Receiver<Command>,
    pub replies: Sender<(usize, Result<Reply>)>,
}

/// Runs one worker on the calling thread: builds its replica with `build`, waits at the
/// set-up gate until every worker has built its own (so that nobody enters a collective
/// join — NCCL's waits for every member — while another has failed), joins the exchange
/// with `join`, then serves commands. A failure (or panic) before serving is sent as the
/// reply to the first command, as a worker's failure always is.
pub(crate) fn start<R, X>(seat: WorkerStart<'_>, build: impl FnOnce() -> Result<R>, join: impl FnOnce(&R) -> Result<X>)
where
    R: Replica,
    X: Exchange<Mem = R::Mem>,
{
    let caught = |p: Box<dyn std::any::Any + Send>| Error::config("worker", panics::describe(p.as_ref()));
    let built = catch_unwind(AssertUnwindSafe(build)).unwrap_or_else(|p| Err(caught(p)));
    let joined = match (seat.gate.arrive(built.is_ok()), built) {
        (true, Ok(mut replica)) => catch_unwind(AssertUnwindSafe(|| {
            let exchange = join(&replica)?;
            if seat.sharding == Sharding::Sharded {
                let owned = exchange.owned();
                let np = replica.params_len();
                replica.keep_part(owned.start.min(np)..owned.end.min(np))?;
            }
            Ok(exchange)
        }))
        .unwrap_or_else(|p| Err(caught(p)))
        .map(|exchange| Worker { exchange, replica, shards: seat.shards.clone() }),
        (_, Err(e)) => Err(e),
        (false, Ok(_)) => Err(Error::Aborted),
    };
    match joined {
        Ok(worker) => serve(worker, seat),
        Err(e) => {
            seat.abort.abort();
            let e = match e {
                Error::Aborted => Error::Aborted,
                e => Error::Worker { device: seat.device.to_string(), step: 0, cause: e.to_string() },
            };
            let _ = seat.replies.send((seat.index, Err(e)));
        }
    }
}

fn serve<R, X>(mut worker: Worker<R, X>, seat: WorkerStart<'_>)
where
    R: Replica,
    X: Exchange<Mem = R::Mem>,
{
    let mut step = 0u64;
    while let Ok(cmd) = recv_waiting(&seat.commands, seat.wait) {
        if let Command::Step(work) = &cmd {
            step = work.step;
        }
        let result = catch_unwind(AssertUnwindSafe(|| worker.handle(&cmd, seat.ring)));
        // A worker released from a collective by another's failure says only that
        // (`Error::Aborted`); the one that failed names itself, the step and the cause.
        let failure = |cause: String| Error::Worker { device: seat.device.to_string(), step, cause };
        let result = match result {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(Error::Aborted)) => Err(Error::Aborted),
            Ok(Err(e)) => Err(failure(e.to_string())),
            Err(panic) => Err(failure(panics::describe(panic.as_ref()))),
        };
        let failed = result.is_err();
        if failed {
            seat.abort.abort();
        }
        if seat.replies.send((seat.index, result)).is_err() || failed {
            return;
        }
    }
}

/// Lets workers join the exchange only once every one of them has built its replica:
/// NCCL's communicator set-up waits for every member, so a worker that failed before joining
/// would leave the others waiting forever.
pub(crate) struct SetupGate {
    state: parking_lot::Mutex<(usize, bool)>,
    all: parking_lot::Condvar,
    n: usize,
}

impl SetupGate {
    pub fn new(n: usize) -> SetupGate {
        SetupGate { state: parking_lot::Mutex::new((0, false)), all: parking_lot::Condvar::new(), n }
    }

    /// Releases every waiting worker with a failure (a worker thread could not start).
    pub fn abandon(&self) {
        let mut s = self.state.lock();
        *s = (self.n, true);
        self.all.notify_all();
    }

    /// Reports this worker's set-up (`ok`) and waits for every other's; true when all
    /// succeeded.
    pub fn arrive(&self, ok: bool) -> bool {
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

/// Receives, spinning for a short while before sleeping when `wait` allows. Steps of a
/// small model last tens of microseconds; a thread that parks between them pays the
/// wake-up of a sleeping core every step (measured: ~40 µs on a virtual machine, more
/// than the step itself). Past `SPIN`, it sleeps like `recv`.
pub(crate) fn recv_waiting<T>(rx: &Receiver<T>, wait: WaitPolicy) -> Result<T, crossbeam_channel::RecvError> {
    const SPIN: Duration = Duration::from_micros(100);
    if wait == WaitPolicy::Park {
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
