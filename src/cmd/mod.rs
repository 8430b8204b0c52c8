//! The subcommands, one file each; `main.rs` holds what they share (argument types
//! used by several, data and model loading, failures and exit codes).

pub mod bench;
pub mod eval;
pub mod files;
pub mod signals;
pub mod train;
