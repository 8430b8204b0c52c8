//! The numerical kernels behind the layers.
//!
//! `cpu` is the reference implementation: every other backend (the CUDA kernels in
//! `kernels/`) is checked against it. The kernels here work on plain slices with the
//! layouts written beside each one; layers own the bookkeeping (caches, shapes, names)
//! and call these for the arithmetic. `par` runs the layers' parallel loops: in the pool
//! of the device the calling thread works for, or on that thread alone. `simd` compiles
//! the elementwise loops for the processor's widest vectors, with the same bits on each.

pub mod chain;
pub mod cpu;
pub(crate) mod par;
pub mod simd;
pub mod winograd;
