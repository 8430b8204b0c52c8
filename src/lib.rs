//! lockstep: synchronous data-parallel training inside one process.
#![forbid(unsafe_op_in_unsafe_fn)]

pub mod backend;
pub mod comm;
pub mod cuda;
pub mod data;
pub mod devices;
pub mod error;
pub mod fsutil;
pub mod models;
pub mod nn;
pub mod optim;
pub mod rng;
pub mod spec;
pub mod tensor;
pub mod train;
pub mod weights;

pub use error::{Error, Result};
pub use tensor::{Device, Shape, Tensor};
