//! The flight recorder: the last collective calls of each device thread, and of the
//! process, kept so that when a run hangs or fails the operator sees which device is
//! stuck, and where.
//!
//! Owns [`FlightRecorder`] (one per run: a [`Ring`] of the last [`KEPT`] calls per device,
//! and one for the coordinator's collectives across processes), the hook that writes a
//! ring ([`Ring::record`]), and the dump ([`FlightRecorder::report`], [`dump_live`]). Who
//! calls the hook: the step (`step.rs`: the gradient sum, a sharded optimiser's
//! all-gather), synchronized BatchNorm's statistics exchange (through [`RecordedStats`]),
//! and the coordinator's collectives across processes (`trainer.rs`). It records around
//! the calls the step makes of every transport, so the transports themselves (`exchange/`)
//! know nothing of it. When it is printed, to stderr: on a fault (`Trainer::failing`:
//! a device's error or panic, another process's failure, an MPI wait past its timeout),
//! and on SIGUSR1 (the command line's signal thread calls [`dump_live`]); the run goes on
//! after a SIGUSR1.
//!
//! Cost: a call takes its ring's lock twice (at its start and end; the owner thread and
//! a dump are the only takers, so it is uncontended but for a dump) and writes one
//! entry in place; nothing is allocated after the rings are made.
//!
//! On GPUs the step's calls queue work on the device's stream: a call's end is when it was
//! queued, and a stuck NCCL kernel shows as a device that never makes its next call.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::error::Result;
use crate::ops::batchnorm::stats::StatsExchange;

/// Calls each ring keeps: enough to see a few steps back (a step makes one to four).
pub(crate) const KEPT: usize = 16;

/// What a collective call was for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The step's gradient sum (`Exchange::sum`).
    Sum,
    /// A sharded optimiser's parameter all-gather (`Exchange::all_gather`).
    Gather,
    /// Synchronized BatchNorm's statistics, inside a forward or backward pass.
    Stats,
    /// The coordinators' merge of a step's report (and of their stop requests).
    StepReport,
    /// The coordinators' merge of an evaluation's sums.
    EvalMetrics,
    /// The replica check across processes.
    ReplicaCheck,
    /// A sharded optimiser's state gathered from every process (checkpoint, end).
    OptimizerState,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Sum => "sum",
            Phase::Gather => "all-gather",
            Phase::Stats => "batchnorm stats",
            Phase::StepReport => "step report",
            Phase::EvalMetrics => "eval metrics",
            Phase::ReplicaCheck => "replica check",
            Phase::OptimizerState => "optimizer state",
        }
    }
}

/// How a recorded call ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    InFlight,
    /// Returned, at this many ns into the run.
    Done(u64),
    /// Returned an error (its own, or the abort of another's failure).
    Failed(u64),
}

/// One collective call. Steps are 0-based here and printed 1-based, as errors print them.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// The call's number in its ring (0, 1, ...): which entry a call's end belongs to.
    seq: u64,
    step: u64,
    phase: Phase,
    bytes: u64,
    /// ns into the run.
    start: u64,
    end: End,
}

struct Calls {
    entries: [Option<Entry>; KEPT],
    /// Calls recorded so far; the next goes to `entries[next % KEPT]`.
    next: u64,
}

/// One thread's last [`KEPT`] calls. Written by its owner thread; read by a dump.
pub(crate) struct Ring {
    name: String,
    started: Instant,
    /// The step the owner is in (set by it before it makes the step's calls).
    step: AtomicU64,
    calls: Mutex<Calls>,
}

impl Ring {
    fn new(name: String, started: Instant) -> Ring {
        Ring { name, started, step: AtomicU64::new(0), calls: Mutex::new(Calls { entries: [None; KEPT], next: 0 }) }
    }

    /// The step (0-based) the calls that follow belong to.
    pub(crate) fn set_step(&self, step: u64) {
        self.step.store(step, Ordering::Relaxed);
    }

    fn now(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Runs the collective `f`, recorded as `phase` moving `bytes`: in flight while it
    /// runs, then done or failed as it returned.
    pub(crate) fn record<T>(&self, phase: Phase, bytes: usize, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let seq = {
            let mut c = self.calls.lock();
            let seq = c.next;
            let entry = Entry {
                seq,
                step: self.step.load(Ordering::Relaxed),
                phase,
                bytes: bytes as u64,
                start: self.now(),
                end: End::InFlight,
            };
            c.entries[(seq % KEPT as u64) as usize] = Some(entry);
            c.next += 1;
            seq
        };
        let out = f();
        let end = match out {
            Ok(_) => End::Done(self.now()),
            Err(_) => End::Failed(self.now()),
        };
        let mut c = self.calls.lock();
        if let Some(e) = c.entries[(seq % KEPT as u64) as usize].as_mut().filter(|e| e.seq == seq) {
            e.end = end;
        }
        out
    }

    /// The kept calls, oldest first.
    fn entries(&self) -> Vec<Entry> {
        let c = self.calls.lock();
        let first = c.next.saturating_sub(KEPT as u64);
        (first..c.next).filter_map(|s| c.entries[(s % KEPT as u64) as usize]).collect()
    }

    /// This ring's state at `now` ns into the run: the call it is in, or its last.
    fn state(&self, now: u64) -> String {
        match self.entries().last() {
            None => "no collective call yet".to_string(),
            Some(e) => match e.end {
                End::InFlight => {
                    format!(
                        "in the {} of step {} for {}",
                        e.phase.name(),
                        e.step + 1,
                        span(now.saturating_sub(e.start))
                    )
                }
                End::Done(t) | End::Failed(t) => format!(
                    "in no collective call; its last, the {} of step {}, {} {} ago",
                    e.phase.name(),
                    e.step + 1,
                    if matches!(e.end, End::Done(_)) { "ended" } else { "failed" },
                    span(now.saturating_sub(t))
                ),
            },
        }
    }

    /// This ring's calls, oldest first, a line each.
    fn calls(&self, out: &mut String, prefix: &str) {
        let entries = self.entries();
        if entries.is_empty() {
            return;
        }
        let _ = writeln!(out, "{prefix}{}'s last {} collective calls, oldest first:", self.name, entries.len());
        for e in &entries {
            let how = match e.end {
                End::InFlight => "in flight".to_string(),
                End::Done(t) => format!("took {}", span(t.saturating_sub(e.start))),
                End::Failed(t) => format!("failed after {}", span(t.saturating_sub(e.start))),
            };
            let _ = writeln!(
                out,
                "{prefix}  step {:>6} {:<15} {:>10} at {:>9.3} s, {how}",
                e.step + 1,
                e.phase.name(),
                crate::units::human(e.bytes),
                e.start as f64 * 1e-9
            );
        }
    }
}

/// `ns` nanoseconds for a reader: µs below a millisecond, ms below a second, else s.
fn span(ns: u64) -> String {
    match ns {
        0..1_000_000 => format!("{} µs", ns / 1_000),
        1_000_000..1_000_000_000 => format!("{:.1} ms", ns as f64 * 1e-6),
        _ => format!("{:.3} s", ns as f64 * 1e-9),
    }
}

/// A run's rings: one per device thread, in device order, and the coordinator's.
pub(crate) struct FlightRecorder {
    started: Instant,
    /// This process's number, in a world of several (its lines are prefixed with it).
    process: Option<usize>,
    devices: Vec<Ring>,
    coordinator: Ring,
    /// A fault's dump is printed once.
    dumped: AtomicBool,
}

impl FlightRecorder {
    /// Rings for the devices named `devices` (in device order) and the coordinator;
    /// `process` is this process's number in a world of several, `None` in a world of one.
    pub(crate) fn new(devices: impl IntoIterator<Item = String>, process: Option<usize>) -> FlightRecorder {
        let started = Instant::now();
        FlightRecorder {
            started,
            process,
            devices: devices.into_iter().map(|d| Ring::new(d, started)).collect(),
            coordinator: Ring::new("coordinator".into(), started),
            dumped: AtomicBool::new(false),
        }
    }

    /// Device `d`'s ring.
    pub(crate) fn device(&self, d: usize) -> &Ring {
        &self.devices[d]
    }

    /// The ring of the coordinator's collectives across processes.
    pub(crate) fn coordinator(&self) -> &Ring {
        &self.coordinator
    }

    /// The dump: a heading, each device's state (the call it is in, or its last), then
    /// each device's calls, oldest first, and the coordinator's if it made any; every line
    /// prefixed with `lockstep: ` and, in a world of several processes, the process's
    /// number. `why` says what asked for it.
    pub(crate) fn report(&self, why: &str) -> String {
        let prefix = match self.process {
            Some(p) => format!("lockstep: process {p}: "),
            None => "lockstep: ".to_string(),
        };
        let now = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let mut out = String::new();
        let _ = writeln!(out, "{prefix}flight recorder ({why}), {:.3} s into the run", now as f64 * 1e-9);
        let coordinator = Some(&self.coordinator).filter(|c| c.calls.lock().next > 0);
        let rings: Vec<&Ring> = self.devices.iter().chain(coordinator).collect();
        for ring in &rings {
            let _ = writeln!(out, "{prefix}{}: {}", ring.name, ring.state(now));
        }
        for ring in &rings {
            ring.calls(&mut out, &prefix);
        }
        out
    }

    /// Prints [`FlightRecorder::report`] to stderr, in one write (so that processes that
    /// share a terminal under `mpirun` do not interleave their lines).
    pub(crate) fn print(&self, why: &str) {
        use std::io::Write as _;
        let _ = std::io::stderr().lock().write_all(self.report(why).as_bytes());
    }

    /// [`FlightRecorder::print`] for a fault, once per run, and only where a collective
    /// call was made (a run that failed while starting has nothing to show).
    pub(crate) fn print_fault(&self) {
        let called = self.devices.iter().chain([&self.coordinator]).any(|r| r.calls.lock().next > 0);
        if called && !self.dumped.swap(true, Ordering::SeqCst) {
            self.print("the run failed");
        }
    }
}

/// The recorders of the runs in progress, which a signal dumps.
static LIVE: Mutex<Vec<Arc<FlightRecorder>>> = Mutex::new(Vec::new());

/// A recorder listed in [`LIVE`] until this is dropped.
pub(crate) struct Listed(Arc<FlightRecorder>);

/// Lists `recorder` among the runs in progress until the guard is dropped.
pub(crate) fn list(recorder: &Arc<FlightRecorder>) -> Listed {
    LIVE.lock().push(Arc::clone(recorder));
    Listed(Arc::clone(recorder))
}

impl Drop for Listed {
    fn drop(&mut self) {
        LIVE.lock().retain(|r| !Arc::ptr_eq(r, &self.0));
    }
}

/// Prints the recorder of every run in progress (SIGUSR1); says so when there is none.
/// Returns how many were printed.
#[cfg(any(test, feature = "cli"))]
pub(crate) fn dump_live(why: &str) -> usize {
    let live: Vec<Arc<FlightRecorder>> = LIVE.lock().clone();
    if live.is_empty() {
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "lockstep: flight recorder ({why}): no run is in progress");
    }
    for r in &live {
        r.print(why);
    }
    live.len()
}

/// A statistics exchange whose calls are recorded in a device's ring.
pub(crate) struct RecordedStats<'a> {
    pub inner: &'a dyn StatsExchange,
    pub ring: &'a Ring,
}

impl std::fmt::Debug for RecordedStats<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordedStats").field("inner", &self.inner).field("ring", &self.ring.name).finish()
    }
}

impl StatsExchange for RecordedStats<'_> {
    fn replicas(&self) -> usize {
        self.inner.replicas()
    }

    fn all_gather(&self, shard: usize, mine: &[f64], all: &mut Vec<f64>) -> Result<()> {
        self.ring.record(Phase::Stats, std::mem::size_of_val(mine), || self.inner.all_gather(shard, mine, all))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn a_ring_keeps_the_last_calls_in_order_and_says_how_each_ended() {
        let recorder = FlightRecorder::new(["cpu:0".to_string(), "cpu:1".to_string()], None);
        let ring = recorder.device(0);
        // 20 calls, steps 0..20: the ring keeps the last 16, steps 4..20, oldest first.
        for step in 0..20u64 {
            ring.set_step(step);
            ring.record(Phase::Sum, 4096, || Ok(())).unwrap();
        }
        let kept = ring.entries();
        assert_eq!(kept.len(), KEPT);
        assert_eq!(kept.iter().map(|e| e.step).collect::<Vec<_>>(), (4..20).collect::<Vec<_>>());
        assert!(kept.iter().all(|e| matches!(e.end, End::Done(t) if t >= e.start) && e.bytes == 4096));
        // A failed call, then one seen from inside (in flight while it runs).
        ring.set_step(20);
        let failed: Result<()> = ring.record(Phase::Gather, 8, || Err(Error::Aborted));
        assert!(failed.is_err());
        assert!(matches!(ring.entries().last().unwrap().end, End::Failed(_)));
        ring.set_step(21);
        ring.record(Phase::Sum, 8, || {
            let last = *ring.entries().last().unwrap();
            assert_eq!((last.step, last.phase, last.end), (21, Phase::Sum, End::InFlight));
            // The dump meanwhile: device 0 in the sum of step 22 (1-based), device 1
            // in none yet; the coordinator, which made no call, is not listed.
            let text = recorder.report("asked");
            assert!(text.starts_with("lockstep: flight recorder (asked), "), "{text}");
            assert!(text.contains("\nlockstep: cpu:0: in the sum of step 22 for "), "{text}");
            assert!(text.contains("\nlockstep: cpu:1: no collective call yet\n"), "{text}");
            assert!(text.contains("\nlockstep: cpu:0's last 16 collective calls, oldest first:\n"), "{text}");
            assert!(text.contains("step     21 all-gather             8 B at"), "{text}");
            assert!(text.contains(", failed after "), "{text}");
            assert!(text.contains("step     22 sum                    8 B at") && text.ends_with(", in flight\n"));
            assert!(!text.contains("coordinator"), "{text}");
            // Heading, 2 state lines, device 0's heading and 16 calls; none of device 1.
            assert_eq!(text.lines().count(), 1 + 2 + 1 + KEPT, "{text}");
            Ok(())
        })
        .unwrap();
        let text = recorder.report("asked");
        assert!(text.contains("cpu:0: in no collective call; its last, the sum of step 22, ended "), "{text}");
    }

    #[test]
    fn a_process_of_several_prefixes_its_lines_and_shows_its_coordinator() {
        let recorder = FlightRecorder::new(["cpu:0".to_string()], Some(3));
        recorder.coordinator().set_step(6);
        recorder.coordinator().record(Phase::StepReport, 48, || Ok(())).unwrap();
        let text = recorder.report("SIGUSR1");
        assert!(text.lines().all(|l| l.starts_with("lockstep: process 3: ")), "{text}");
        assert!(text.contains("process 3: coordinator: in no collective call; its last, the step report of step 7"));
        assert!(text.contains("process 3: coordinator's last 1 collective calls, oldest first:"), "{text}");
    }

    #[test]
    fn spans_read_in_the_unit_that_suits_them() {
        assert_eq!(span(22_000), "22 µs");
        assert_eq!(span(16_275_000), "16.3 ms");
        assert_eq!(span(3_204_000_000), "3.204 s");
    }

    #[test]
    fn a_recorder_is_live_while_listed() {
        let recorder = Arc::new(FlightRecorder::new(["cpu:0".to_string()], None));
        let listed = list(&recorder);
        assert!(LIVE.lock().iter().any(|r| Arc::ptr_eq(r, &recorder)));
        drop(listed);
        assert!(!LIVE.lock().iter().any(|r| Arc::ptr_eq(r, &recorder)));
    }
}
