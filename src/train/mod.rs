//! Synchronous data-parallel training: [`train_data_parallel`], and [`with_trainer`] for
//! loops written by the user.
//!
//! The rooms of this module, each owning one thing:
//! | file | owns |
//! |---|---|
//! | `config.rs` | [`TrainConfig`]: what a run is asked to do |
//! | `report.rs` | step and epoch reports, the [`Observer`], the [`TrainReport`] |
//! | `batch.rs` | [`Batch`], a global batch gathered on the host |
//! | `scatter.rs` | the sampler (seeded epoch order) and the scatter into logical shards |
//! | `trainer.rs` | [`with_trainer`]: the run's exchange and worker threads; the coordinator's handle, [`Trainer`] |
//! | `worker.rs` | a worker thread: its start (set-up gate), its command loop, its faults |
//! | `flight.rs` | the flight recorder: each device's last collective calls, printed on a fault or SIGUSR1 |
//! | `panics.rs` | a worker's panic reported once, as the run's error (the panic hook) |
//! | `step.rs` | the training step, written once for every device and transport; evaluation, prediction |
//! | `replica.rs` | the `Replica` trait the step runs; the replica check |
//! | `cpu.rs` | the CPU replica |
//! | `gpu.rs` | the GPU replica (its device half is `model::gpu`) |
//! | `fit.rs` | [`train_data_parallel`]: epochs, evaluation, checkpoints |
//! | `processes.rs` | the trainer across the processes of an MPI world: handshake, merged step reports, replica check, rows per process |

mod batch;
mod config;
mod cpu;
mod fit;
pub(crate) mod flight;
#[cfg(feature = "cuda")]
mod gpu;
pub(crate) mod memory;
mod panics;
mod processes;
mod replica;
mod report;
pub(crate) mod scatter;
mod step;
mod trainer;
mod worker;

pub use batch::Batch;
pub use config::{EarlyStopping, NonFinite, StopRequest, TrainConfig, DEFAULT_EVAL_BATCHES, DEFAULT_EVAL_EVERY};
pub use fit::{check_data, train_data_parallel, train_data_parallel_with};
#[cfg(all(test, feature = "cuda"))]
pub(crate) use gpu::kernel_files;
/// What a run will allocate, estimated before it starts (every run checks it first).
pub use memory::fitting as memory_estimate;
pub use report::{
    BestEpoch, EpochReport, EvaluationReport, HeldOut, Observer, ShardReport, Silent, StepEvent, StepReport, Stopped,
    StoppedEvaluation, TrainReport, LOSSES_KEPT,
};
pub use scatter::{LastBatch, Shuffle};
pub use trainer::{with_trainer, Trainer};
