//! The CUDA runtime: finding the libraries, compiling and loading kernel files, the
//! mechanics of a checked launch, cuBLAS, and the kernels of whole buffers. It knows no op.
//!
//! Everything CUDA is loaded at run time (cudarc's dynamic loading), so lockstep builds
//! and runs on machines without a GPU; there, every function here returns
//! [`crate::Error::CudaUnavailable`] and nothing panics. Submodules:
//! - [`probe`]: is the driver / NVRTC / NCCL there, how many GPUs, what to do if not;
//! - `declare`: how a kernel is declared (name, file, typed parameters) and what the
//!   declaration expands to (a typed launch, the file's table entry), the naming helper;
//! - `kernels`: NVRTC compilation, its cache, and loading a file into a context;
//! - `launch`: `launch::Gpu`, one device's context and stream, and what every checked
//!   launch shares (buffer traits, length checks, launch shapes);
//! - `buffers`: kernels on whole buffers (the ordered sum of K buffers, scale, fill);
//! - `gemm`: GEMMs as row-major descriptions, handed to cuBLAS.
//!
//! Nothing here imports an op, the optimiser, the step or an exchange: each op's GPU form
//! and its kernels' declarations and launches live in the op's folder (`ops::<op>::gpu`),
//! the optimiser's in `optim::gpu`, the codec's in `exchange::gpu::codec`; the network on
//! one GPU (`model::gpu`), the GPU exchanges (`exchange::gpu`) and the trainer's GPU
//! replica (`train::gpu`) build on these.

pub(crate) mod buffers;
pub(crate) mod declare;
pub(crate) mod gemm;
#[cfg(test)]
pub(crate) mod host;
pub(crate) mod kernels;
pub(crate) mod launch;
#[cfg(test)]
mod nvrtc_tests;
pub mod probe;

pub(crate) use declare::KernelFile;
pub(crate) use launch::Gpu;
pub use probe::{driver_available, gpu_count, gpus, nccl_status, nvrtc_available, GpuInfo, NcclStatus};
