//! Faults across processes, in real processes: copies of this test executable under
//! `mpirun` (`testing::mpirun`) train a small model whose one layer fails on one device of
//! process 1 at step 5 (an error or a panic), or train until process 1 is killed; every
//! process must end within seconds, naming the process, the device, the step and the
//! cause — the failure notices and the liveness watch of this file's world, carried by the
//! library (`train_data_parallel_with`), not by the command line.
//!
//! Needs `mpirun` on PATH (`.ci/run` installs Open MPI and runs `cargo test --release
//! --features mpi --lib mpi`); without it the one skip helper says so. The command line
//! under `mpirun` (Ctrl-C, disagreeing arguments, a bad timeout) is tests/mpi.rs's.

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::data::toy;
use crate::devices::Devices;
use crate::error::{Error, Result};
use crate::nn::{Ctx, InputGrad, Layer, Linear, Params, ParamsMut, Relu, Sequential};
use crate::optim::OptimizerConfig;
use crate::testing::mpirun::{self, Scratch};
use crate::testing::test_path;
use crate::train::{train_data_parallel_with, Observer, StepEvent, TrainConfig};
use crate::{Device, Shape, Tensor};

/// Starts 2 copies of this executable's [`child`] under mpirun (with `extra` arguments),
/// doing `what` with `dir` for their files.
fn spawn_pair(extra: &[&str], what: &str, dir: &Path) -> std::process::Child {
    mpirun::spawn(2, extra, &test_path(module_path!(), "child"), what, dir)
}

/// An error or a panic on process 1's device at step 5 ends both processes, non-zero,
/// within the bound, naming process, device, step and cause.
fn fault(what: &str, cause: &str) {
    let dir = Scratch::new();
    let t0 = Instant::now();
    // mpirun is told not to end the job when a process exits non-zero (it would SIGTERM
    // the others, then SIGKILL them a second later): what ends process 0 is lockstep's
    // notice. mpirun then exits 0; each process wrote its exit code.
    let child = spawn_pair(&["--mca", "orte_abort_on_non_zero_status", "0"], what, dir.dir());
    let pids = mpirun::pids(dir.dir(), 2);
    let (o, took) = mpirun::finish(child, t0);
    let out = mpirun::text(&o);
    for r in 0..2 {
        assert_eq!(
            std::fs::read_to_string(dir.path(&format!("exit-{r}"))).ok().as_deref(),
            Some("1"),
            "process {r}: {out}"
        );
    }
    // Process 1 names itself; process 0, told by process 1's notice (mpirun is not let
    // end the job for it here), names the same.
    assert!(out.contains(&format!("process 1: error: process 1, cpu:0, step 6: {cause}")), "{out}");
    assert!(out.contains(&format!("process 0: error: process 1, cpu:0, step 6: {cause}")), "{out}");
    assert!(pids.iter().all(|&p| mpirun::gone(p)), "a process outlived mpirun: {pids:?}");
    // A panic is said once per process, as its error, never by the standard hook.
    assert!(!out.contains("thread '"), "{out}");
    assert!(out.matches("injected").count() <= 2, "{out}");
    // Start-up (MPI, two processes) and five steps of a tiny model, then the fault.
    assert!(took < Duration::from_secs(10), "took {took:?}: {out}");
    let _ =
        writeln!(std::io::stderr(), "{what} on process 1 at step 5: every process ended {took:?} after mpirun started");
}

#[test]
fn an_error_on_process_1_at_step_5_ends_every_process() {
    if mpirun::ready("an_error_on_process_1_at_step_5_ends_every_process") {
        fault("error", "invalid test layer: injected failure");
    }
}

#[test]
fn a_panic_on_process_1_at_step_5_ends_every_process() {
    if mpirun::ready("a_panic_on_process_1_at_step_5_ends_every_process") {
        fault("panic", "panicked at ");
    }
}

#[test]
fn sigkill_of_one_process_ends_the_others() {
    if !mpirun::ready("sigkill_of_one_process_ends_the_others") {
        return;
    }
    let dir = Scratch::new();
    // Process 0 takes mpirun's SIGTERM as a stop request, as the binary does, so that
    // mpirun's SIGKILL a second later is all that mpirun would do: ending it before is
    // lockstep's doing. (Open MPI 4.1's mpirun hangs after a killed process when told
    // not to abort the job, so it is left its default here.)
    let child = spawn_pair(&[], "long", dir.dir());
    let pids = mpirun::pids(dir.dir(), 2);
    // Kill process 1 in the middle of training: once it has taken a few steps.
    let t0 = Instant::now();
    while std::fs::read_to_string(dir.path("steps-1")).map_or(true, |s| s.trim().parse::<u64>().unwrap_or(0) < 20) {
        assert!(t0.elapsed() < Duration::from_secs(30), "process 1 did not train");
        std::thread::sleep(Duration::from_millis(2));
    }
    let (killed, killed_at) = (Instant::now(), std::time::SystemTime::now());
    Command::new("kill").args(["-KILL", &pids[1].to_string()]).status().unwrap();
    let (o, took) = mpirun::finish(child, killed);
    let out = mpirun::text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(mpirun::gone(pids[0]), "process 0 outlived mpirun");
    assert!(took < Duration::from_secs(5), "process 0 ended {took:?} after the kill: {out}");
    // mpirun is not let end the job: process 0 saw the death itself (its waits watch the
    // processes on its machine) and names it.
    let want =
        format!("process 0: error: process 1 (pid {}, on this machine) has exited without a word (killed?)", pids[1]);
    assert!(out.contains(&want), "{out}");
    assert_eq!(std::fs::read_to_string(dir.path("exit-0")).ok().as_deref(), Some("1"), "{out}");
    let left = std::fs::metadata(dir.path("exit-0")).unwrap().modified().unwrap();
    let _ = writeln!(
        std::io::stderr(),
        "SIGKILL of process 1: process 0 left {:?} later, mpirun ended {took:?} later",
        left.duration_since(killed_at).unwrap_or_default()
    );
}

// ---- the processes ---------------------------------------------------------------------

/// A process of the tests above, started by them under mpirun (does nothing otherwise).
#[test]
#[ignore = "a process of the MPI fault tests, started by them under mpirun"]
fn child() {
    let Some((what, dir)) = mpirun::child_case() else { return };
    train_with_a_fault(&what, &dir);
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum How {
    Error,
    Panic,
    Never,
}

/// The identity, except on `device` of process `process`, at `step`, where it fails as
/// told (in forward).
#[derive(Clone, Debug)]
struct Faulty {
    process: usize,
    here: usize,
    device: Device,
    step: u64,
    how: How,
}

impl Layer for Faulty {
    fn kind(&self) -> &'static str {
        "faulty"
    }
    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        Ok(input.clone())
    }
    fn forward(&mut self, x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        if self.here == self.process && ctx.device == self.device && ctx.step == self.step {
            match self.how {
                How::Error => return Err(Error::config("test layer", "injected failure")),
                How::Panic => panic!("injected panic"),
                How::Never => {}
            }
        }
        Ok(x)
    }
    fn backward(
        &mut self,
        d: Tensor,
        _p: Params<'_>,
        _g: ParamsMut<'_>,
        _i: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        Ok(Some(d))
    }
    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }
    fn describe(&self) -> String {
        "Faulty".into()
    }
}

/// Writes the steps taken to `steps-<process>`.
struct Steps(std::path::PathBuf);

impl Observer for Steps {
    fn on_step(&mut self, e: &StepEvent<'_>) {
        let _ = std::fs::write(&self.0, (e.report.step + 1).to_string());
    }
}

/// The toy set on a small MLP with a [`Faulty`] layer that fails on process 1's cpu:0 at
/// step 5 as `what` says ("error", "panic"; anything else: never, and 100,000 epochs).
fn train_with_a_fault(what: &str, dir: &Path) {
    let world = crate::world::init().expect("the world starts");
    let process = world.process();
    std::fs::write(dir.join(format!("pid-{process}")), std::process::id().to_string()).unwrap();
    let how = match what {
        "error" => How::Error,
        "panic" => How::Panic,
        _ => How::Never,
    };
    let faulty = Faulty { process: 1, here: process, device: Device::Cpu(0), step: 5, how };
    let model = Sequential::new(
        [2],
        vec![Box::new(Linear::new(2, 8)), Box::new(Relu::new()), Box::new(faulty), Box::new(Linear::new(8, 2))],
    )
    .unwrap();
    let data = toy::toy_enlarged(20, 1).unwrap().train;
    let epochs = if how == How::Never { 100_000 } else { 5 };
    let cfg = TrainConfig { epochs, batch_size: 8, optimizer: OptimizerConfig::sgd(0.1), ..Default::default() };
    let mut steps = Steps(dir.join(format!("steps-{process}")));
    // As the binary does under mpirun: SIGTERM asks the run to stop (at a step every
    // process agrees on).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    world.stop_on_signals(&stop).unwrap();
    let cfg = TrainConfig { stop: Some(stop), ..cfg };
    let r = train_data_parallel_with(&model, &data, None, &Devices::cpu(1, 1).unwrap(), &cfg, &mut steps);
    match r {
        Ok(_) => world.finalize(),
        Err(e) => {
            // Every process says how it ended, named, so that the test sees each.
            // One write, so that mpirun does not interleave it with another's.
            let line = format!("process {process}: error: {e}\n");
            let _ = std::io::stderr().write_all(line.as_bytes());
            std::fs::write(dir.join(format!("exit-{process}")), "1").unwrap();
            std::process::exit(1);
        }
    }
}
