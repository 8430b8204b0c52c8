//! The subcommands, one file each; `main.rs` holds what they share (argument types
//! used by several, data and model loading, failures and exit codes).

pub mod bench;
#[cfg(feature = "mpi")]
pub mod bench_mpi;
pub mod eval;
pub mod features;
pub mod files;
pub mod record;
pub mod regularize;
pub mod signals;
pub mod text;
pub mod timing;
pub mod train;
