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
//! | `trainer.rs` | [`with_trainer`] and the coordinator's handle, [`Trainer`] |
//! | `worker.rs` | a device's replica and what it does with each command |
//! | `fit.rs` | [`train_data_parallel`]: epochs, evaluation, checkpoints |

mod batch;
mod config;
mod fit;
mod report;
pub mod scatter;
mod trainer;
pub mod worker;

pub use batch::Batch;
pub use config::{EarlyStopping, NonFinite, TrainConfig};
pub use fit::{check_data, train_data_parallel, train_data_parallel_with};
pub use report::{
    BestEpoch, EpochReport, EvaluationReport, HeldOut, Observer, ShardReport, Silent, StepEvent, StepReport, Stopped,
    TrainReport,
};
pub use scatter::{LastBatch, Shuffle};
pub use trainer::{with_trainer, Trainer};
