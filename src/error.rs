//! The one error type of the library.
//!
//! Every fallible function in lockstep returns [`Result<T>`]. Variants carry what a user
//! needs to act on the failure: the op and the shapes involved, the path of a file, the
//! name of a tensor, the device and step of a worker. `anyhow` appears only in `main.rs`,
//! which maps these errors to exit codes.

use std::path::PathBuf;

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in lockstep.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Two shapes that an op needs to agree do not.
    #[error("{op}: shape mismatch: {detail}")]
    Shape { op: &'static str, detail: String },

    /// An op was given tensors that live on different devices.
    #[error("{op}: expected all tensors to be on the same device, found {lhs} and {rhs}")]
    DeviceMismatch { op: &'static str, lhs: String, rhs: String },

    /// A configuration value is out of range or inconsistent with another.
    #[error("invalid {what}: {detail}")]
    Config { what: &'static str, detail: String },

    /// A device specification (`--devices`) could not be parsed or satisfied.
    #[error("invalid device spec '{spec}': {detail}")]
    DeviceSpec { spec: String, detail: String },

    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A file was read but its contents are not what lockstep expects.
    #[error("{path}: {detail}")]
    Format { path: PathBuf, detail: String },

    /// A weights file cannot be loaded into the model (a tensor missing, unexpected,
    /// mis-shaped, or holding NaN or an infinity); every problem is listed.
    #[error("{path}: these weights cannot be loaded into the model:\n  {}", problems.join("\n  "))]
    WeightsMismatch { path: PathBuf, problems: Vec<String> },

    /// A dataset is unusable (empty, labels out of range, inconsistent sizes).
    #[error("dataset {name}: {detail}")]
    Data { name: String, detail: String },

    /// A worker failed; names the device and the step. `step` is the 0-based index of
    /// the step it was working on (or setting up for), printed 1-based as every line the
    /// run prints numbers steps: the first step is "step 1".
    #[error("{device}, step {}: {cause}", .step + 1)]
    Worker { device: String, step: u64, cause: String },

    /// The loss became NaN or infinite. `step` (of the run) and `epoch` are 0-based, and
    /// printed 1-based as the progress and epoch lines number them.
    #[error("non-finite loss {loss} at step {} (epoch {})", .step + 1, .epoch + 1)]
    NonFiniteLoss { step: u64, epoch: usize, loss: f64 },

    /// Replicas that must be bitwise identical are not. `step` is the steps taken when
    /// the check ran: the check follows a step, so it is that step's number.
    #[error("replica check failed at step {step}: replica {replica} differs from replica 0 in tensor '{tensor}'")]
    ReplicaMismatch { step: u64, replica: usize, tensor: String },

    /// Replicas in different processes differ: the first (process, device) whose tensor
    /// differs from process 0's first device, and the tensor.
    #[error(
        "replica check failed at step {step}: process {process}, {device} differs from process 0, {first} in tensor '{tensor}'"
    )]
    ReplicaMismatchAcross { step: u64, process: usize, device: String, first: String, tensor: String },

    /// MPI cannot serve the run: a process launched by an MPI launcher in a binary built
    /// without MPI, or the MPI library's own refusal.
    #[error("MPI: {0}")]
    Mpi(String),

    /// Another process of the run failed; `cause` is its own error, naming its process (and
    /// its device and step when a worker failed).
    #[error("{cause}")]
    Peer { process: usize, cause: String },

    /// A process of the run is gone without a word (killed), or the launcher is, or none
    /// answered within the timeout.
    #[error("{detail}")]
    PeerLost { detail: String },

    /// The processes of one run were started with arguments that disagree.
    #[error("the processes of this run disagree: {detail}")]
    Processes { detail: String },

    /// A collective was aborted because another worker failed.
    #[error("collective aborted: another worker failed")]
    Aborted,

    /// A CUDA library is missing, or asked-for GPUs are not there.
    #[error("{0}")]
    CudaUnavailable(String),

    /// An error reported by the CUDA driver.
    #[cfg(feature = "cuda")]
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),

    /// An NVRTC compile failure, with the kernel file's name and the compiler log.
    #[error("NVRTC compiling {file}: {log}")]
    Nvrtc { file: String, log: String },

    /// An error reported by cuBLAS.
    #[cfg(feature = "cuda")]
    #[error("cuBLAS: {0}")]
    Cublas(#[from] cudarc::cublas::result::CublasError),

    /// A kernel module the CUDA driver refused: the kernel file, what NVRTC made of it
    /// (cubin or PTX, for which architecture), the NVRTC version that made it and the CUDA
    /// version the driver reports (`cuDriverGetVersion`), the two that have to agree.
    #[cfg(feature = "cuda")]
    #[error("loading {file} ({image}, made by NVRTC {nvrtc}) into a driver of CUDA {driver}: {source}")]
    KernelLoad {
        file: String,
        image: String,
        nvrtc: String,
        driver: String,
        #[source]
        source: cudarc::driver::DriverError,
    },

    /// An NCCL call failed: the call, its `ncclResult_t` by number with its name (codes
    /// newer than the bindings included, e.g. NCCL 2.30's `ncclTimeout`), and NCCL's own
    /// message for it (`ncclGetLastError`; empty when NCCL gave none).
    #[error("NCCL {call}: {name} (ncclResult_t {code}){}", if message.is_empty() { String::new() } else { format!(": {message}") })]
    Nccl { call: &'static str, code: i32, name: &'static str, message: String },

    /// A checkpoint directory is held by another run (see `dirlock`).
    #[error("{}: in use by another lockstep run{}; wait for it to end, or choose another directory", dir.display(), match pid {
        Some(p) => format!(" (pid {p})"),
        None => String::new(),
    })]
    Locked { dir: PathBuf, pid: Option<u32> },

    /// What a run or a command would allocate exceeds the memory available: the estimate,
    /// its parts, and what the machine has.
    #[error("{what} needs an estimated {} but {} {}: {parts}", crate::units::human(*needed), crate::units::human(*available), available_from)]
    OutOfMemory { what: String, needed: u64, available: u64, available_from: &'static str, parts: String },
}

impl Error {
    /// Wraps an `io::Error` with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    /// A [`Error::Config`] in one call.
    pub fn config(what: &'static str, detail: impl Into<String>) -> Self {
        Error::Config { what, detail: detail.into() }
    }

    /// A [`Error::Format`] in one call.
    pub fn format(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        Error::Format { path: path.into(), detail: detail.into() }
    }

    /// A [`Error::Shape`] in one call.
    pub fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Shape { op, detail: detail.into() }
    }
}
