//! The statistics exchange: the contract of the small collective that synchronized BatchNorm makes in the
//! middle of a forward and of a backward pass (`--sync-batchnorm`).
//!
//! Owns the contract, [`StatsExchange`], here below the layer that calls it so that `nn`
//! needs nothing of `exchange`, whose transports implement it; and nothing of the arithmetic: a layer hands its
//! logical replica's payload (a few f64 per channel) and gets every logical replica's
//! back, in logical-replica order, the same on every device; the layer then merges them in
//! that order itself (`ops::batchnorm`), so every replica computes bitwise the same
//! statistics whoever computed which shard. Gathering rather than summing is what lets
//! the merge be Chan's pairwise update of (count, mean, M2) in a fixed order instead of a
//! transport's sum in an unspecified one, and it is one call any transport has
//! (`MPI_Allgather`, shared memory): the shared-memory exchange implements it
//! (`shm::ShmStats`, on the gradient exchange's own barrier, so an abort releases it too);
//! an MPI exchange implements the same trait. GPU replicas meet in the shared-memory one
//! too, on the host (a group of their own, aborted with the GPU exchange: `Aborts`): each
//! synchronized layer waits for its device's partial statistics, gathers, merges with the
//! CPU layer's functions, and hands the result back to the device (`model::gpu`).
//!
//! Every device makes the same calls in the same order (2 per synchronized layer per
//! forward and backward pass, a device whose shard is empty included: it sends a payload
//! of zeros, `model::sync_batchnorm::join_without_rows`, from `train::step`). One logical replica per device: a device
//! that ran two shards one after another could never hand both payloads to one call.

use crate::error::Result;

/// One device's side of the statistics exchange (see the file's docs). `Sync`, since a
/// layer holds it through its context; calls come from the device's own thread.
pub trait StatsExchange: Sync + std::fmt::Debug {
    /// Number of logical replicas R: payloads per call.
    fn replicas(&self) -> usize;

    /// Contributes `mine`, the payload of logical replica `shard` (this device's), and
    /// fills `all` with every logical replica's payload in replica order (R·len values;
    /// every payload of a call has the same length). Fails with `Error::Aborted` once the
    /// run's exchange is aborted.
    fn all_gather(&self, shard: usize, mine: &[f64], all: &mut Vec<f64>) -> Result<()>;
}
