//! Collectives between the replicas of one process.
//!
//! [`Collective`] is the small contract the trainer needs from any transport: rank and
//! world, a SUM all-reduce, a broadcast, a barrier, and `abort`, which makes every
//! pending and future call of every rank return [`Error::Aborted`](crate::Error::Aborted) so that no rank
//! waits forever for one that failed. It returns at once on one rank.
//!
//! [`shm`] implements it for CPU devices in shared memory, and also offers the trainer a
//! cheaper path than the classic all-reduce: the reduce-scatter leaves the reduced
//! gradient in shared chunks that every replica's optimiser reads in place (no
//! all-gather copy back into each replica's buffer).
//!
//! [`gpu`] is the GPU workers' collective: buffers on the devices, ordered against each
//! replica's compute stream with events, over NCCL (nccl.rs wraps its handle) or, where
//! NCCL cannot serve, device-to-device copies in the same reduce-scatter / all-gather
//! scheme as [`shm`].

pub mod gpu;
mod nccl;
pub mod shm;

use crate::error::Result;

/// The collective operations of one rank. Every rank must make the same calls in the
/// same order, as with NCCL or MPI.
pub trait Collective {
    /// This rank's index, `0..world`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world(&self) -> usize;

    /// In place: `buf` ends holding the element-wise SUM of every rank's `buf`, each
    /// element reduced once in one fixed order, so every rank gets bitwise the same
    /// result. Returns at once on one rank.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;

    /// Copies `root`'s `buf` into every other rank's `buf`.
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()>;

    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// Makes every pending and future call of every rank fail with `Error::Aborted`.
    fn abort(&self);
}
