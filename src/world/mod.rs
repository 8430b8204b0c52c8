//! The world: every process of one run, and what they do together outside the gradient
//! exchange.
//!
//! lockstep trains in ONE process per machine (or socket); past one machine, an MPI
//! launcher (`mpirun`, `srun`) starts one such process per machine and the processes
//! form a world. This module owns the process level: which process this is
//! ([`World::process`]) among how many ([`World::size`]), the few collectives the
//! coordinator needs (gathering step metrics and fingerprints, broadcasting an NCCL id),
//! how a failure in one process reaches the others (at once, whatever collective they
//! wait in), and the refusal to train as one of P silent copies when MPI is not built in. The gradients themselves
//! cross processes in the exchange (`exchange::mpi`, or one NCCL clique); the trainer's
//! use of the world (handshake, merged step reports, the replica check across processes)
//! is `train::processes`.
//!
//! A process not started by a launcher is a world of one, and nothing here costs it
//! anything. MPI is a cargo feature (`mpi`, off by default): without it a launched
//! process of a world of several is refused with how to build it ([`init`]).

pub(crate) mod agree;
pub(crate) mod launch;
#[cfg(feature = "mpi")]
pub(crate) mod mpi;
pub(crate) mod wait;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

pub(crate) use launch::Launch;

use crate::error::{Error, Result};

/// The processes of one run, as this process sees them.
pub struct World {
    kind: Kind,
    /// What the launcher said, if one started this process.
    launch: Option<Launch>,
}

enum Kind {
    /// One process: every collective is the identity.
    Single,
    #[cfg(feature = "mpi")]
    Mpi(Box<mpi::MpiWorld>),
}

static WORLD: OnceLock<World> = OnceLock::new();
#[cfg(any(test, feature = "cli"))]
static INIT: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
static SINGLE: World = World { kind: Kind::Single, launch: None };

/// The environment variable of the processes' wait timeout, in seconds (0: none).
#[cfg(any(feature = "cli", feature = "mpi"))]
pub(crate) const TIMEOUT_VAR: &str = "LOCKSTEP_MPI_TIMEOUT_S";

/// Whether this process says `e`, an error of [`init`]. A launcher gives every process
/// the same environment, so a bad `LOCKSTEP_MPI_TIMEOUT_S` is met by each of them, and
/// their lines would interleave into one ("error: error: …"): the launch's process 0
/// alone says it. Anything else (an MPI library that cannot serve, a binary without MPI)
/// each process says of itself.
#[cfg(feature = "cli")]
pub(crate) fn init_reports(e: &Error) -> bool {
    let met_by_all = matches!(e, Error::Config { what, .. } if *what == TIMEOUT_VAR);
    !met_by_all || launch::detect().is_none_or(|l| l.process == 0)
}

/// Whether this binary was built with MPI (the `mpi` feature).
pub(crate) const MPI_BUILT_IN: bool = cfg!(feature = "mpi");

/// The refusal of a launched process in a binary without MPI.
fn not_built_in(l: &Launch) -> Error {
    Error::Mpi(format!(
        "this is {l}, but this lockstep was built without MPI, so it would train alone, \
         one of {} copies: build it with `cargo build --release --features mpi` \
         (Debian: apt-get install openmpi-bin libopenmpi-dev clang libclang-dev), or run it without a launcher",
        l.size
    ))
}

/// Starts the world of this process, once (later calls return the same world): MPI when
/// a launcher started it as one of several processes (`MPI_Init_thread`), a world of one
/// otherwise. Call it first, before any thread of your own uses MPI; the binary calls it
/// before any command. Fails, saying how to build with MPI, for a launched process of a
/// binary built without it.
#[cfg(any(test, feature = "cli"))]
pub fn init() -> Result<&'static World> {
    let _held = INIT.lock();
    if let Some(w) = WORLD.get() {
        return Ok(w);
    }
    let launch = launch::detect();
    let kind = match &launch {
        Some(l) if l.size > 1 => start(l)?,
        _ => Kind::Single,
    };
    Ok(WORLD.get_or_init(|| World { kind, launch }))
}

#[cfg(all(feature = "mpi", any(test, feature = "cli")))]
fn start(l: &Launch) -> Result<Kind> {
    Ok(Kind::Mpi(Box::new(mpi::MpiWorld::init(l)?)))
}

#[cfg(all(not(feature = "mpi"), any(test, feature = "cli")))]
fn start(l: &Launch) -> Result<Kind> {
    Err(not_built_in(l))
}

/// The world [`init`] started; a world of one if it was never called — unless a launcher
/// started this process as one of several, which is refused: P processes must never
/// train P independent copies silently.
pub fn current() -> Result<&'static World> {
    if let Some(w) = WORLD.get() {
        return Ok(w);
    }
    match launch::detect() {
        Some(l) if l.size > 1 && MPI_BUILT_IN => Err(Error::Mpi(format!(
            "this is {l}, but its world was not started: call lockstep::world::init() before training"
        ))),
        Some(l) if l.size > 1 => Err(not_built_in(&l)),
        _ => Ok(&SINGLE),
    }
}

/// Errors every process of a run reaches by the same decision on the same gathered
/// values (a non-finite loss, a replica check, disagreeing arguments):
/// nobody is left waiting, so no process needs telling, and only process 0 reports them.
#[cfg_attr(not(any(feature = "cli", feature = "cuda")), allow(dead_code))] // the command line's, the GPU clique's
pub(crate) fn agreed(e: &Error) -> bool {
    matches!(
        e,
        Error::NonFiniteLoss { .. }
            | Error::ReplicaMismatch { .. }
            | Error::ReplicaMismatchAcross { .. }
            | Error::Processes { .. }
    )
}

impl World {
    /// This process's index, 0..size.
    pub fn process(&self) -> usize {
        match &self.kind {
            Kind::Single => 0,
            #[cfg(feature = "mpi")]
            Kind::Mpi(m) => m.process(),
        }
    }

    /// Number of processes.
    pub fn size(&self) -> usize {
        match &self.kind {
            Kind::Single => 1,
            #[cfg(feature = "mpi")]
            Kind::Mpi(m) => m.size(),
        }
    }

    /// True for process 0, the one voice of a run: it prints, writes metrics, weights
    /// and checkpoints.
    pub fn is_voice(&self) -> bool {
        self.process() == 0
    }

    /// Lines for `lockstep devices`: whether MPI is built in, and the world it sees.
    pub fn summary(&self) -> Vec<String> {
        let built = if MPI_BUILT_IN { "built in" } else { "not built in (build with --features mpi)" };
        let mut lines = Vec::new();
        match &self.kind {
            Kind::Single => {
                lines.push(format!("mpi: {built}"));
                lines.push(match &self.launch {
                    Some(l) => format!("world: 1 process ({l})"),
                    None => "world: 1 process (not started by an MPI launcher)".to_string(),
                });
            }
            #[cfg(feature = "mpi")]
            Kind::Mpi(m) => {
                lines.push(format!("mpi: {built}: {}", m.library()));
                lines.push(format!(
                    "world: {} processes; this is process {} on {} ({} of them on this machine, {} core(s) for this one)",
                    m.size(),
                    m.process(),
                    m.host(),
                    m.on_this_host(),
                    launch::cores_for_this_process()
                ));
            }
        }
        lines
    }

    /// Every process's `mine` (all of the same length), in process order. The identity in
    /// a world of one.
    pub(crate) fn all_gather(&self, mine: &[u64]) -> Result<Vec<u64>> {
        match &self.kind {
            Kind::Single => Ok(mine.to_vec()),
            #[cfg(feature = "mpi")]
            Kind::Mpi(m) => m.all_gather(mine),
        }
    }

    /// Copies process `root`'s `buf` into every process's `buf`.
    #[cfg_attr(not(any(feature = "cli", feature = "cuda")), allow(dead_code))] // the command line's, the GPU clique's
    pub(crate) fn broadcast(&self, root: usize, buf: &mut [u8]) -> Result<()> {
        match &self.kind {
            // Process 0's buffer is already everyone's.
            Kind::Single => {
                let _ = (root, buf);
                Ok(())
            }
            #[cfg(feature = "mpi")]
            Kind::Mpi(m) => m.broadcast(root, buf),
        }
    }

    /// Returns when every process has called it (benchmarks).
    #[cfg(all(feature = "mpi", feature = "cli"))]
    pub(crate) fn barrier(&self) -> Result<()> {
        match &self.kind {
            Kind::Single => Ok(()),
            #[cfg(feature = "mpi")]
            Kind::Mpi(m) => m.barrier(),
        }
    }

    /// This process failed with `e`: tells every other process (at once, whatever
    /// collective it waits in; it then fails with `e`'s text) unless `e` is [`agreed`] or
    /// is itself another process's failure, and stops this process's use of MPI. Called
    /// once the run's threads have ended.
    pub(crate) fn fail(&self, e: &Error) {
        match &self.kind {
            // Nobody to tell.
            Kind::Single => {
                let _ = e;
            }
            #[cfg(feature = "mpi")]
            Kind::Mpi(m) => m.fail(self.process(), e),
        }
    }

    /// [`World::fail`] for a failure that is not the library's (the binary's own input
    /// checks): tells the others `process N: text`, once, unless a failure was told or heard
    /// of already. So that no process waits in a collective for one that never comes.
    #[cfg_attr(not(any(feature = "cli", feature = "cuda")), allow(dead_code))] // the command line's, the GPU clique's
    pub(crate) fn fail_with(&self, text: &str) {
        match &self.kind {
            Kind::Single => {
                let _ = text;
            }
            #[cfg(feature = "mpi")]
            Kind::Mpi(m) => m.fail_with(self.process(), &format!("process {}: {text}", self.process())),
        }
    }

    /// The failure another process reported, or the loss of one, if any.
    pub(crate) fn peer_failure(&self) -> Option<Error> {
        match &self.kind {
            Kind::Single => None,
            #[cfg(feature = "mpi")]
            Kind::Mpi(m) => m.peer_failure(),
        }
    }

    /// Fails, with the cause, once another process reported a failure or a process on
    /// this machine (or the launcher) is gone; for a thread that waits on something other
    /// than MPI (the coordinator, while GPUs sum through NCCL) to look every so often.
    pub(crate) fn watch(&self) -> Result<()> {
        match &self.kind {
            Kind::Single => Ok(()),
            #[cfg(feature = "mpi")]
            Kind::Mpi(m) => m.watch(),
        }
    }

    /// Whether this process should print `e`: process 0 prints every failure; the others
    /// only their own (the root cause, which process 0 may not live to print once the
    /// launcher takes the job down), never one they were told of or one every process met.
    #[cfg_attr(not(any(feature = "cli", feature = "cuda")), allow(dead_code))] // the command line's, the GPU clique's
    pub(crate) fn reports(&self, e: &Error) -> bool {
        self.is_voice() || !(agreed(e) || matches!(e, Error::Peer { .. } | Error::PeerLost { .. }))
    }

    /// Ends MPI after a run that succeeded everywhere (`MPI_Finalize`, a rendezvous of
    /// every process). Not called after a failure: the processes then leave without it,
    /// and the launcher ends the job.
    pub fn finalize(&self) {
        #[cfg(feature = "mpi")]
        if let Kind::Mpi(m) = &self.kind {
            m.finalize();
        }
    }

    /// Makes the signals by which a launcher stops a job set `flag`, as Ctrl-C does in a
    /// world of one: `mpirun` answers Ctrl-C with SIGTERM to every process (SIGKILL a
    /// second later, `--mca odls_base_sigkill_timeout`) and forwards SIGUSR2; `srun`
    /// sends SIGTERM. Nothing in a world of one.
    pub fn stop_on_signals(&self, flag: &Arc<AtomicBool>) -> Result<()> {
        match &self.kind {
            // Ctrl-C is the caller's to handle.
            Kind::Single => {
                let _ = flag;
                Ok(())
            }
            #[cfg(feature = "mpi")]
            Kind::Mpi(_) => mpi::stop_on_signals(flag),
        }
    }

    /// The MPI world, where there is one.
    #[cfg(feature = "mpi")]
    pub(crate) fn mpi(&self) -> Option<&mpi::MpiWorld> {
        match &self.kind {
            Kind::Mpi(m) => Some(m),
            Kind::Single => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_nobody_launched_is_a_world_of_one() {
        let w = current().unwrap();
        assert_eq!((w.process(), w.size(), w.is_voice()), (0, 1, true));
        assert_eq!(w.all_gather(&[3, 4]).unwrap(), vec![3, 4]);
        assert!(w.peer_failure().is_none());
        let lines = w.summary();
        assert!(lines[0].starts_with("mpi: "), "{lines:?}");
        assert_eq!(lines[1], "world: 1 process (not started by an MPI launcher)");
    }

    #[test]
    fn the_refusal_says_how_to_build_with_mpi() {
        let l = Launch { launcher: "Open MPI", process: 1, size: 2, local_size: 2, variable: "OMPI_COMM_WORLD_SIZE" };
        assert_eq!(
            not_built_in(&l).to_string(),
            "MPI: this is process 1 of 2, launched by Open MPI (OMPI_COMM_WORLD_SIZE=2), \
             but this lockstep was built without MPI, so it would train alone, one of 2 copies: \
             build it with `cargo build --release --features mpi` \
             (Debian: apt-get install openmpi-bin libopenmpi-dev clang libclang-dev), or run it without a launcher"
        );
    }

    #[test]
    fn only_process_0_reports_what_every_process_met() {
        let shared = Error::NonFiniteLoss { step: 3, epoch: 0, loss: f64::NAN };
        let own = Error::Worker { device: "process 1, cpu:0".into(), step: 5, cause: "injected failure".into() };
        let told = Error::Peer { process: 1, cause: own.to_string() };
        assert!(agreed(&shared) && !agreed(&own) && !agreed(&told));
        // SINGLE is process 0: it reports everything.
        assert!(SINGLE.reports(&shared) && SINGLE.reports(&own) && SINGLE.reports(&told));
    }
}
