//! CUDA support: finding the libraries, the kernels of `kernels/`, and launching them.
//!
//! Everything CUDA is loaded at run time (cudarc's dynamic loading), so lockstep builds
//! and runs on machines without a GPU; there, every function here returns
//! [`crate::Error::CudaUnavailable`] and nothing panics. Submodules:
//! - [`probe`]: is the driver / NVRTC / NCCL there, how many GPUs, what to do if not;
//! - [`declare`]: how a kernel is declared (name, file, typed parameters) and what the
//!   declaration expands to (a typed launch, a table entry), the naming helper;
//! - [`kernels`]: every kernel's declaration, the kernel sources, NVRTC compilation and
//!   its cache;
//! - [`launch`]: [`launch::Gpu`], one device's context and stream, one checked method
//!   per kernel, one file per kernel family (the optimiser's step is `optim::gpu`'s);
//! - [`gemm`]: the GPU layers' GEMMs as row-major descriptions, handed to cuBLAS.
//!
//! Nothing here knows of layers, optimisers, steps, batches or exchanges (`declare`,
//! `kernels`, `launch`, `gemm` and `probe` import nothing of `nn`, `optim`, `train` or
//! `exchange`'s step): each op's GPU form (in its own module of `nn`), the network on one
//! GPU (`nn::gpu_net`), the GPU exchanges (`exchange::gpu`, NCCL or device copies) and the
//! trainer's GPU replica (`train::gpu`) build on these.

pub mod declare;
pub mod gemm;
pub mod kernels;
pub mod launch;
pub mod probe;

pub use kernels::{kernel_name, Dir};
pub use launch::{BnParams, DropoutKey, Gpu, WindowGeom};
pub use probe::{driver_available, gpu_count, gpus, nccl_status, nvrtc_available, GpuInfo, NcclStatus};
