//! lockstep: synchronous data-parallel training inside one process.
#![forbid(unsafe_op_in_unsafe_fn)]

pub mod cuda;
pub mod data;
pub mod error;
pub mod tensor;

pub use error::{Error, Result};
pub use tensor::{Device, Shape, Tensor};
