//! lockstep: synchronous data-parallel training of neural networks inside ONE process.
//!
//! One OS thread per device (a CUDA GPU, or a CPU "device" that stands in for one), each
//! owning a full replica of the model; a scatter stage splits every global batch across
//! the replicas; the gradients are all-reduced; every replica applies the same update,
//! so the replicas stay bitwise identical. What PyTorch's DistributedDataParallel does,
//! without one process per device, launchers, ports or rendezvous:
//!
//! ```
//! use lockstep::{data::toy, devices::Devices, models, optim::OptimizerConfig};
//! use lockstep::train::{train_data_parallel, TrainConfig};
//!
//! let data = toy::toy(); // the lesson's 5 training and 2 test points
//! let model = models::toy_mlp(2, 2).unwrap();
//! let config = TrainConfig { epochs: 3, batch_size: 2, optimizer: OptimizerConfig::sgd(0.5), ..TrainConfig::default() };
//! let report = train_data_parallel(&model, &data.train, data.test.as_ref(), &Devices::cpu(2, 1).unwrap(), &config).unwrap();
//! assert_eq!(report.epochs.last().unwrap().test.unwrap().accuracy(), 1.0);
//! ```
//!
//! # The contract
//! - The batch size is GLOBAL: B samples per step whatever the number of devices.
//! - Replicas back-propagate the SUM of their samples' losses, the all-reduce sums, and
//!   the optimiser divides by the real size of the global batch: one step on N devices
//!   is one step on one device with the whole batch, up to float summation order.
//! - With a fixed number of logical replicas R (`TrainConfig::replicas`), the summation
//!   order is fixed too: 1, 2 or 4 devices give bitwise the same weights.
//! - Every random number is a function of (seed, epoch, step, logical replica), so a run
//!   resumed from a checkpoint ends exactly where the uninterrupted run would.
//!
//! # Where things are
//! | module | owns |
//! |---|---|
//! | [`tensor`] | shapes, devices, tensors |
//! | [`backend`] | the CPU kernels (GEMM, unfolding), the reference for every other backend |
//! | [`nn`] | layers (forward and backward side by side), `Sequential`, the loss |
//! | [`optim`] | SGD (momentum, Nesterov), Adam and AdamW over flat buffers; learning-rate schedules and warm-up, weight decay groups, clipping by the global norm |
//! | [`models`] | the seed models and their tensor names |
//! | [`data`] | datasets: the embedded digits, the lesson's toy set, safetensors files |
//! | [`exchange`] | where gradients meet: the `Exchange` trait, shared memory between CPU threads, NCCL and device copies between GPUs, MPI between processes; the 16-bit gradient codec; synchronized BatchNorm's statistics exchange |
//! | [`train`] | `train_data_parallel`, `with_trainer`, the workers, scatter and sampler |
//! | [`checkpoint`] | checkpoints and exact resume |
//! | [`dirlock`] | one run per checkpoint directory (an advisory lock) |
//! | [`memory`] | memory estimated before any work, refused when it does not fit |
//! | [`units`] | bytes, counts and spans of time as people read and write them (a leaf) |
//! | [`digest`] | FNV-1a, the hash of every digest compared: checkpoints, datasets, processes, replicas (a leaf) |
//! | [`json_keys`] | keys given twice in a JSON text, and where (a leaf) |
//! | [`wire`] | the 16-bit gradient codec's wire format, below both `exchange` and `cuda` (a leaf) |
//! | [`weights`] | safetensors weights in PyTorch's names and layouts |
//! | [`safetensors_io`] | the container: headers checked before mapping, reproducible bytes |
//! | [`devices`] | `--devices` specifications |
//! | [`world`] | the processes of a run under an MPI launcher: this one's index, their number, their collectives, failure notices |
//! | `cuda` | run-time probing of the CUDA driver, NVRTC and NCCL; the CUDA kernels; the GPU replica (the `cuda` feature) |
//! | [`observe`] | observers of a run: progress (a bar, or lines), JSON lines, the metrics CSV |
//! | `plot` | training curves as a PNG, in memory or to a file (the `plot` feature) |
//! | `notebook` | what a Jupyter (evcxr) cell shows of a report (the `notebook` feature) |
//!
//! # Features
//! `cli` (the binary), `cuda` (GPUs) and `plot` (charts) are on by default; with
//! `default-features = false` this is the CPU library alone, and naming a GPU is an
//! error that names the missing feature; `notebook` adds a report's display in Jupyter
//! (docs/library.md, "Features").
#![forbid(unsafe_op_in_unsafe_fn)]

pub(crate) mod backend;
pub mod checkpoint;
#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod devices;
pub(crate) mod digest;
pub(crate) mod dirlock;
pub(crate) mod error;
pub mod exchange;
pub(crate) mod fsutil;
#[cfg(feature = "cli")]
pub(crate) mod generate;
pub(crate) mod json_keys;
pub mod memory;
pub(crate) mod model;
pub mod models;
pub mod nn;
#[cfg(feature = "notebook")]
pub mod notebook;
pub mod observe;
pub(crate) mod ops;
pub mod optim;
#[cfg(feature = "plot")]
pub mod plot;
pub(crate) mod rng;
pub(crate) mod safetensors_io;
pub mod spec;
pub(crate) mod tensor;
#[cfg(test)]
mod testing;
pub mod train;
pub(crate) mod units;
pub mod weights;
pub(crate) mod wire;
pub(crate) mod world;

pub use error::{Error, Result};
pub use tensor::{Device, Shape, Tensor};

/// The names a notebook or a small program needs, in one `use lockstep::prelude::*;`:
/// devices, the built-in models, the data loaders, the configurations, the two entry
/// points, the observers and the curves.
pub mod prelude {
    pub use crate::data::digits::{load_digits, DigitsLayout};
    pub use crate::data::fashion_mnist::load_fashion_mnist;
    pub use crate::data::{Dataset, Splits};
    pub use crate::devices::Devices;
    pub use crate::models::{self, convnet, resnet, toy_mlp, ConvnetOptions, Norm, ResnetDepth};
    pub use crate::nn::{Layer, Sequential};
    pub use crate::observe::{CsvMetrics, Every, JsonLines, Progress, StepLines, Stream};
    pub use crate::optim::{LrSchedule, OptimizerConfig};
    #[cfg(feature = "plot")]
    pub use crate::plot::{MetricsTable, XAxis};
    pub use crate::train::{
        train_data_parallel, train_data_parallel_with, with_trainer, Batch, EpochReport, HeldOut, Observer, Silent,
        Stopped, TrainConfig, TrainReport, Trainer,
    };
    pub use crate::{Device, Error, Result, Shape, Tensor};
}

/// The README and the guide's chapters, compiled and run as doctests so that no stale
/// example lands: every Rust block of them is compiled, and run unless it is `no_run`
/// (tests/guide.rs runs their command lines).
#[cfg(doctest)]
pub mod guide {
    #[doc = include_str!("../README.md")]
    pub struct Readme;
    #[doc = include_str!("../docs/README.md")]
    pub struct Index;
    #[doc = include_str!("../docs/library.md")]
    pub struct Library;
    #[doc = include_str!("../docs/command-line.md")]
    pub struct CommandLine;
    #[doc = include_str!("../docs/data.md")]
    pub struct Data;
    #[doc = include_str!("../docs/checkpoints.md")]
    pub struct Checkpoints;
    #[doc = include_str!("../docs/devices.md")]
    pub struct Devices;
    #[doc = include_str!("../docs/several-machines.md")]
    pub struct SeveralMachines;
    #[doc = include_str!("../docs/ddp-features.md")]
    pub struct DdpFeatures;
    #[doc = include_str!("../docs/residual-networks.md")]
    pub struct ResidualNetworks;
    #[doc = include_str!("../docs/transformers.md")]
    pub struct Transformers;
    #[doc = include_str!("../docs/notebooks.md")]
    pub struct Notebooks;
    #[doc = include_str!("../docs/limits.md")]
    pub struct Limits;
    #[doc = include_str!("../docs/performance.md")]
    pub struct Performance;
    #[doc = include_str!("../docs/architecture.md")]
    pub struct Architecture;
}
