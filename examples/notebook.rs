//! `examples/notebook.ipynb` as a program: the same cells, in the same order, so that
//! `cargo test` compiles and runs what the notebook runs (`tests/notebook.rs` checks that
//! the notebook's cells are these, and executes the notebook where Jupyter and the evcxr
//! kernel are installed).
//!
//! Each `// %%` line below starts a code cell, each `// %% md` a markdown cell (its text
//! the comment lines after it), `// %% kernel` the cell of the kernel's set-up commands
//! (commented out here, as they are no Rust), and `// %% end` closes the last. A line `show(&x);` is the cell's last expression, `x`,
//! in the notebook, where the kernel displays it: a report as its table of epochs and its
//! curves, a metrics table as its figure. Here `show` prints what a terminal can.
//!
//! Run: `cargo run --release --example notebook`

use lockstep::prelude::*;

/// What a notebook shows of a cell's last value, as text.
trait Shown {
    fn show(&self);
}

impl Shown for TrainReport {
    fn show(&self) {
        println!("{self}");
    }
}

impl Shown for MetricsTable {
    fn show(&self) {
        let png = lockstep::plot::png(self, "Training curves", XAxis::Step).expect("the curves draw");
        println!("(the curves: a {}-byte PNG, {} steps, {} epochs)", png.len(), self.steps.len(), self.epochs.len());
    }
}

fn show(x: &dyn Shown) {
    x.show();
}

fn main() -> Result<()> {
    // %% md
    // # Data-parallel training in a notebook
    //
    // One process, one thread per device: here two CPU devices stand in for two GPUs.
    // The convnet of Keras's MNIST example trains on the embedded 8×8 digits, scaled to
    // 28×28, with a global batch of 32 split across the devices: the run `lockstep train
    // --epochs 3 --devices cpu:2` makes, number for number: the command line's BatchNorm
    // momentum, 0.9 (Keras's 0.99 is too slow for a dataset this small), and its cosine
    // decay of the learning rate to a tenth.
    //
    // The next cell sets the kernel up. It builds the library without the command
    // line's parts (`default-features = false`) but with what a notebook shows
    // (`notebook`), optimised, and without debug assertions: a notebook's code is a
    // debug build, which would otherwise run several times slower. It compiles for a
    // minute or two the first time, and shows nothing meanwhile.
    // %% kernel
    // :dep lockstep = { path = "..", default-features = false, features = ["notebook"] }
    // :opt 3
    // :build_env CARGO_PROFILE_DEV_DEBUG_ASSERTIONS=false
    // :build_env CARGO_PROFILE_DEV_OVERFLOW_CHECKS=false
    // :build_env CARGO_INCREMENTAL=0
    // use lockstep::prelude::*;
    // %%
    // What each step frees stays for the next (the command line's allocator does the same).
    lockstep::memory::keep_freed_pages();
    let splits = load_digits(DigitsLayout::Image28)?;
    let model = convnet(ConvnetOptions { bn_momentum: 0.9, ..ConvnetOptions::default() })?;
    let devices = Devices::cpu(2, 1)?;
    println!(
        "{} training and {} test images on {devices}",
        splits.train.len(),
        splits.test.as_ref().map_or(0, |t| t.len())
    );
    // %% md
    // `train_data_parallel_with` runs the epochs; `Progress` prints a line every 10
    // seconds inside an epoch (a notebook is no terminal) and one per epoch.
    // `max_duration` stops the run at a step boundary once its time is up
    // (`Stopped::TimeLimit`): the way to stop a run in a notebook, where an interrupt
    // ends the kernel's process and every variable with it.
    // %%
    let config = TrainConfig {
        epochs: 3,
        batch_size: 32,
        schedule: LrSchedule::Cosine { floor: 0.1 },
        max_duration: Some(std::time::Duration::from_secs(600)),
        ..TrainConfig::default()
    };
    let mut progress = Progress::new(Stream::Stdout, StepLines::Off);
    let report =
        train_data_parallel_with(&model, &splits.train, splits.test.as_ref(), &devices, &config, &mut progress)?;
    show(&report);
    // %% md
    // The curves, drawn in memory: each step's loss, each epoch's mean and the test split.
    // %%
    let curves = MetricsTable::from(&report);
    show(&curves);
    // %% md
    // Your own loop: `with_trainer` hands over the coordinator's handle. Each `step` is one
    // global batch: scatter, forward, backward, the gradients summed in a fixed order, the
    // same update on every replica, which stay bitwise identical.
    // %%
    let start = TrainConfig { initial: Some(report.weights.clone()), ..config.clone() };
    let accuracy = with_trainer(&model, &devices, &start, |t| {
        for step in 0..5 {
            let rows: Vec<usize> = (0..32).map(|i| (32 * step + i) % splits.train.len()).collect();
            let r = t.step(Batch::gather(&splits.train, &rows))?;
            println!("step {} loss {:.4}", r.step + 1, r.metrics.mean_loss());
        }
        t.check_replicas()?;
        let test = splits.test.as_ref().expect("the digits have a test split");
        Ok(t.evaluate(test, 512)?.accuracy())
    })?;
    println!("test accuracy after 5 more steps: {accuracy:.4}");
    // %% end
    Ok(())
}
