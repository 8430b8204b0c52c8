//! The `lockstep` binary: the library's command line (`lockstep::cli`), under mimalloc.
//!
//! Everything the program does is the library's; the binary owns only its allocator, which
//! a library must not choose for its users.

use std::process::ExitCode;

/// mimalloc keeps freed pages for reuse: each step allocates activations of megabytes,
/// which the system allocator would return to the kernel and fault back in every step
/// (measured: ~20% of a convnet step).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    lockstep::cli::allocator::keep_freed_pages();
    lockstep::cli::main()
}
