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
//! What a step guarantees (the global batch, exact averaging, bitwise-identical replicas,
//! logical replicas, randomness, faults) is stated once, in the guide's architecture
//! chapter (docs/architecture.md, "What a step guarantees"); the guide is `docs/`.
//!
//! # What a program imports
//! | module | what it gives |
//! |---|---|
//! | [`nn`] | the layers a model is built from, [`nn::Sequential`], the [`nn::Layer`] trait for layers of one's own, the loss |
//! | [`models`] | the built-in models (the lesson's MLP, the Keras convnet, ResNets, nanoGPT's GPT) and their tensor names |
//! | [`spec`] | models written as JSON (`--model FILE.json`) |
//! | [`data`] | datasets: the embedded digits, the lesson's toy set, MNIST-format directories, Fashion-MNIST, safetensors files, text; augmentation |
//! | [`devices`] | the devices a run trains on (`--devices`) |
//! | [`optim`] | SGD, Adam and AdamW, schedules, weight decay groups, clipping, the sharded optimiser |
//! | [`train`] | [`train::train_data_parallel`], [`train::with_trainer`] (your own loop), configurations, reports, observers' events, the memory estimate |
//! | [`observe`] | ready observers: progress, JSON lines, the metrics CSV |
//! | [`checkpoint`] | checkpoints and exact resume |
//! | [`weights`] | weights files in PyTorch's names and layouts |
//! | [`memory`] | estimates by parts; keeping freed pages for the next step |
//! | [`exchange`] | the 16-bit gradients' formats ([`exchange::codec::Compression`]) |
//! | `cuda` | what the machine's CUDA offers ([`cuda::probe`]; the `cuda` feature) |
//! | `plot`, `notebook` | training curves as PNG; a report in a Jupyter cell (their features) |
//! | [`world`] | the processes of a run under an MPI launcher: start it ([`world::init`]), this process's index, their number |
//! | `cli` | the `lockstep` program itself (the `cli` feature) |
//! | [`prelude`] | the names a notebook or a small program needs, at once |
//!
//! Everything else is the library's own: the map of the source, folder by folder, is the
//! architecture chapter's ("Layout"), which a test holds to the tree.
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
pub mod world;

pub use error::{Error, Result};
pub use tensor::{Device, Shape, Tensor};

/// The names a notebook or a small program needs, in one `use lockstep::prelude::*;`:
/// devices, the built-in models, the data loaders, the configurations, the two entry
/// points, the observers and the curves.
pub mod prelude {
    pub use crate::data::digits::{load_digits, DigitsLayout};
    pub use crate::data::fashion_mnist::load_fashion_mnist;
    pub use crate::data::{Dataset, Features, Splits};
    pub use crate::devices::Devices;
    pub use crate::models::{self, convnet, resnet, toy_mlp, ConvnetOptions, Norm, ResnetDepth};
    pub use crate::nn::{Call, Graph, Layer, Sequential, Value};
    pub use crate::observe::{CsvMetrics, Every, JsonLines, Progress, StepLines, Stream};
    pub use crate::optim::{LrSchedule, OptimizerConfig};
    #[cfg(feature = "plot")]
    pub use crate::plot::{MetricsTable, XAxis};
    pub use crate::train::{
        train_data_parallel, train_data_parallel_with, with_trainer, Batch, EpochReport, HeldOut, Observer, Silent,
        Stopped, StoppedEvaluation, TrainConfig, TrainReport, Trainer,
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
    #[doc = include_str!("../docs/python.md")]
    pub struct Python;
}
