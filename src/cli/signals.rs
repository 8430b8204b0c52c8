//! Stopping a run on request: SIGINT (Ctrl-C) and SIGTERM (what schedulers such as
//! Slurm and Kubernetes send before they kill) both raise the library's stop flag, so
//! that the run finishes its step, writes its checkpoint (or `--save`) and exits with
//! the shell's code for the signal, 128 + its number: 130 for SIGINT, 143 for SIGTERM.
//! A second signal ends the process at once, with the same code, even in the middle of a
//! checkpoint: that write is abandoned and its temporary file removed.
//!
//! Under an MPI launcher, Ctrl-C on `mpirun` reaches every process as SIGTERM (mpirun
//! cannot forward SIGINT, and exits at once), and SIGUSR2, which mpirun forwards and then
//! waits for, is caught too (exit 140): the processes stop at a step they agree on.
//!
//! SIGUSR1 stops nothing: it prints the flight recorder of the run in progress (each
//! device's last collective calls, `train::flight`) to stderr, and the run goes on. Under
//! `mpirun`, which forwards it, every process prints its own.
//!
//! Why `signal-hook` and not `ctrlc`: ctrlc runs one handler for every signal it
//! catches without saying which arrived, and the two exit codes differ. The signals are
//! read by one thread from signal-hook's self-pipe, so nothing but a write to that pipe
//! happens inside the signal handler itself.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;

use std::io::Write as _;

use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
use signal_hook::iterator::Signals;

/// Whether this process is one of several started by an MPI launcher.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Launched {
    Alone,
    Together,
}

/// The flag the trainer polls after every step, and the signal that raised it.
pub(crate) struct StopSignals {
    pub(crate) stop: Arc<AtomicBool>,
    received: Arc<AtomicI32>,
}

impl StopSignals {
    /// Catches SIGINT and SIGTERM from now on (and SIGUSR2 for a process launched with
    /// others), and SIGUSR1, which prints the flight recorder. Where the handlers cannot be
    /// installed the run goes on with the default behaviour (the signal kills it), said once.
    pub(crate) fn install(launched: Launched) -> StopSignals {
        let stop = Arc::new(AtomicBool::new(false));
        let received = Arc::new(AtomicI32::new(0));
        let caught: &[i32] = match launched {
            Launched::Alone => &[SIGINT, SIGTERM, SIGUSR1],
            Launched::Together => &[SIGINT, SIGTERM, SIGUSR1, SIGUSR2],
        };
        let watch = Signals::new(caught).and_then(|mut signals| {
            let (stop, received) = (Arc::clone(&stop), Arc::clone(&received));
            std::thread::Builder::new().name("lockstep-signals".into()).spawn(move || {
                for signal in signals.forever() {
                    if signal == SIGUSR1 {
                        crate::train::flight::dump_live("SIGUSR1");
                        continue;
                    }
                    if stop.swap(true, Ordering::SeqCst) {
                        // At once, from this thread (the run's may be inside a long
                        // write): the checkpoint being written is abandoned, its
                        // temporary file removed, and the last one written stays.
                        crate::fsutil::remove_unfinished();
                        std::process::exit(128 + signal);
                    }
                    received.store(signal, Ordering::SeqCst);
                    // Not eprintln!: after Ctrl-C on mpirun, stderr's reader is gone.
                    let _ = writeln!(
                        std::io::stderr(),
                        "lockstep: {}: stopping after this step (again to quit now)",
                        match signal {
                            SIGINT => "interrupt",
                            SIGTERM => "terminate signal",
                            _ => "user signal",
                        }
                    );
                }
            })
        });
        if let Err(e) = watch {
            eprintln!(
                "lockstep: cannot catch SIGINT and SIGTERM ({e}): a signal will end the run without a checkpoint"
            );
        }
        StopSignals { stop, received }
    }

    /// The signal that stopped the run (SIGINT, SIGTERM or SIGUSR2), if one did.
    pub(crate) fn received(&self) -> Option<i32> {
        Some(self.received.load(Ordering::SeqCst)).filter(|&s| s != 0)
    }

    /// The process's exit code after a signal stopped the run: 128 + its number.
    pub(crate) fn exit_code(signal: i32) -> u8 {
        u8::try_from(128 + signal).unwrap_or(1)
    }

    /// The signal's name, for the last line.
    pub(crate) fn name(signal: i32) -> &'static str {
        match signal {
            SIGINT => "SIGINT",
            SIGTERM => "SIGTERM",
            SIGUSR2 => "SIGUSR2",
            _ => "a signal",
        }
    }
}
