//! The numerical kernels behind the layers.
//!
//! `cpu` is the reference implementation: every other backend (the CUDA kernels in
//! `kernels/`) is checked against it. The kernels here work on plain slices with the
//! layouts written beside each one; layers own the bookkeeping (caches, shapes, names)
//! and call these for the arithmetic.

pub mod cpu;
