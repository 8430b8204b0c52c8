//! Gradient exchanges: where the gradients of a step's logical replicas meet.
//!
//! Owns the contract between the step (`train::step`) and every transport: `Exchange`,
//! one device's side of an exchange, and `Abort`, the side every thread of a run shares.
//!
//! The words, used the same way in every file: a **group** is the state of one run's
//! exchange that its threads share (by reference: `shm::ShmGroup`, `gpu::NcclGroup`,
//! `gpu::CopyGroup`; each implements `Abort`); a **member** is one device thread's
//! membership in a group (`shm::ShmMember`, `gpu::NcclMember`, `gpu::CopyMember`); a
//! **slot** holds one logical replica's (shard's) `[gradient | buffers]`; the **exchange**
//! of a device is what the step talks to (`Exchange`: the CPU's `shm::ShmMember`, a
//! GPU's `gpu::GpuExchange` over either GPU transport's member). A *replica* is the
//! model on a device (`train::replica`), never a transport's member.
//! The step writes each of its logical replicas' (shards') gradient into that shard's
//! *slot*, asks for the sum, and reads the sum piece by piece; it never learns how the
//! values travel. A transport is one implementation of these two traits and nothing
//! else in the step:
//!
//! | transport | memory | sum order | file |
//! |---|---|---|---|
//! | shared memory between CPU threads | `Host` | one tree over all R shard indices | `shm` |
//! | NCCL between GPUs | `gpu::DeviceMemory` | device's shards in shard order, then NCCL's | `gpu` |
//! | device copies between GPUs | `gpu::DeviceMemory` | device's shards in shard order, then member order | `gpu` |
//! | either GPU transport, with 16-bit gradients (one process) | `gpu::DeviceMemory` | the codec's: one tree over all R shard indices | `gpu` |
//! | MPI between processes (CPU; the `mpi` feature) | `Host` | the same tree over all R shard indices, cut into per-process subtrees (`tree`) | `mpi` |
//!
//! Which of them a run uses, and which features each carries, is `RunTransport`'s
//! (`transport`): the one table a run is wired by.
//!
//! A slot holds `[gradient sum of the shard | the shard's updated BatchNorm buffers]`
//! (`width` values); the sum of every slot is what the update reads: the gradient part
//! divided by the global batch, the buffer part by the number of shards that saw data.
//!
//! Beside the sum, two things the features of issue 12 ask of an exchange, each with a
//! default that any transport satisfies: a sharded optimiser's parameter all-gather
//! (`Exchange::owned`, `Exchange::all_gather`; by default a member owns everything and
//! there is nothing to gather), and 16-bit values on the wire, which a transport carries
//! with the one codec of [`codec`] (the GPU exchange with kernels that mirror it). Synchronized
//! BatchNorm's small collective inside the passes is a second trait,
//! `ops::batchnorm::stats::StatsExchange`; a GPU run's replicas meet in the shared-memory one, on the
//! host, and `Aborts` makes one abort stop both groups.
//!
//! Faults: `Abort::abort` makes every pending and future call of every member return
//! [`Error::Aborted`](crate::Error::Aborted), from any thread, so that no member waits
//! forever for one that failed; a member whose own call fails aborts before returning.

pub mod codec;
#[cfg(feature = "cuda")]
pub(crate) mod gpu;
#[cfg(feature = "mpi")]
pub(crate) mod mpi;
#[cfg(feature = "cuda")]
mod nccl;
pub(crate) mod shm;
pub(crate) mod transport;
pub(crate) mod tree;

use crate::error::Result;
pub(crate) use crate::world::wait::WaitPolicy;
pub(crate) use transport::RunTransport;

/// Where an exchange's values live, and how the step sees a piece of them.
pub(crate) trait Memory: 'static {
    /// A read-only run of f32.
    type View<'a>;
    /// A writable run of f32.
    type ViewMut<'a>;

    /// `v[range]`, as long-lived as `v`.
    fn slice<'a>(v: &Self::View<'a>, range: std::ops::Range<usize>) -> Self::View<'a>
    where
        Self: 'a;

    /// Number of values in `v`.
    fn len(v: &Self::View<'_>) -> usize;
}

/// Host memory: slices of f32.
pub(crate) enum Host {}

impl Memory for Host {
    type View<'a> = &'a [f32];
    type ViewMut<'a> = &'a mut [f32];

    fn slice<'a>(v: &&'a [f32], range: std::ops::Range<usize>) -> &'a [f32]
    where
        Self: 'a,
    {
        &v[range]
    }

    fn len(v: &&[f32]) -> usize {
        v.len()
    }
}

/// What every thread of a run may do to its exchange: stop it.
pub(crate) trait Abort: Sync {
    /// Makes every pending and future call of every member fail with `Error::Aborted`.
    /// Callable from any thread, any number of times.
    fn abort(&self);

    /// True once [`Abort::abort`] was called. (What reads it: a GPU replica's waits.)
    #[cfg(any(test, feature = "cuda"))]
    fn is_aborted(&self) -> bool;
}

/// The groups of one run that a fault must all stop, as one [`Abort`]: a GPU run's
/// gradient exchange and, with synchronized BatchNorm, the statistics exchange its
/// replicas meet in on the host (`stats`), whose waits would otherwise outlive a peer that
/// failed. (On CPU devices one group is both.)
#[cfg(any(test, feature = "cuda"))]
pub(crate) struct Aborts<'a> {
    first: &'a dyn Abort,
    second: Option<&'a dyn Abort>,
}

#[cfg(any(test, feature = "cuda"))]
impl<'a> Aborts<'a> {
    /// `first`, and `second` when there is one.
    pub fn new(first: &'a dyn Abort, second: Option<&'a dyn Abort>) -> Aborts<'a> {
        Aborts { first, second }
    }
}

#[cfg(any(test, feature = "cuda"))]
impl Abort for Aborts<'_> {
    fn abort(&self) {
        self.first.abort();
        if let Some(s) = self.second {
            s.abort();
        }
    }

    /// True once any of the groups was aborted (by this or by one of its own members).
    fn is_aborted(&self) -> bool {
        self.first.is_aborted() || self.second.is_some_and(|s| s.is_aborted())
    }
}

/// One device's side of a gradient exchange: its local slots, the sum, and the pieces of
/// the sum. Every member makes the same calls in the same order (as with NCCL or MPI):
/// each step, the slots are written, then [`Exchange::sum`], then the pieces are read.
pub(crate) trait Exchange {
    type Mem: Memory;

    /// Values per slot: `[gradient | buffers]` of one logical replica.
    fn width(&self) -> usize;

    /// Runs `f` on this device's `local`-th slot (`width` values, to be overwritten).
    fn with_slot<T>(&mut self, local: usize, f: impl FnOnce(<Self::Mem as Memory>::ViewMut<'_>) -> T) -> T;

    /// Sums every logical replica's slot across the run (every process's too), each
    /// element once, in the transport's fixed order, so that every member reads bitwise
    /// the same sum.
    fn sum(&mut self) -> Result<()>;

    /// Calls `f(offset, piece)` on consecutive pieces of the sum covering `0..width`, in
    /// order (the shared chunks of a reduce-scatter, or one piece).
    fn for_each_sum(&self, f: impl FnMut(usize, <Self::Mem as Memory>::View<'_>) -> Result<()>) -> Result<()>;

    /// [`Exchange::for_each_sum`] restricted to `range` of the slot: `f` sees the pieces
    /// that overlap it, cut to it (none when it is empty).
    fn for_each_sum_in(
        &self,
        range: std::ops::Range<usize>,
        mut f: impl FnMut(usize, <Self::Mem as Memory>::View<'_>) -> Result<()>,
    ) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        self.for_each_sum(|offset, piece| {
            let end = offset + <Self::Mem as Memory>::len(&piece);
            let (lo, hi) = (range.start.max(offset), range.end.min(end));
            if lo < hi {
                f(lo, <Self::Mem as Memory>::slice(&piece, lo - offset..hi - offset))
            } else {
                Ok(())
            }
        })
    }

    /// The part of the slot this member owns under a sharded optimiser (ZeRO stage 1): it
    /// updates only the parameters there, then [`Exchange::all_gather`] hands them to every
    /// member. The parts of all members cover the slot. Default: everything (a transport
    /// without an all-gather keeps the whole optimiser state on every member).
    fn owned(&self) -> std::ops::Range<usize> {
        0..self.width()
    }

    /// Every member calls it with its whole flat parameter buffer, its owned part updated;
    /// afterwards every member's buffer holds every member's owned part, bitwise. Default
    /// (every member owning everything): nothing to do.
    fn all_gather(&mut self, params: <Self::Mem as Memory>::ViewMut<'_>) -> Result<()> {
        let _ = params;
        Ok(())
    }

    /// True once the run's exchange was aborted (the device's waits poll it).
    fn is_aborted(&self) -> bool;
}

/// The classic in-place all-reduce over any host exchange with one slot per member: copy
/// `buf` into the slot, sum, copy the sum back. (The trainer skips both copies: it writes
/// gradients into the slot and its update reads the pieces in place; `bench allreduce`
/// times it.)
#[cfg(any(test, feature = "cli"))]
pub(crate) fn all_reduce_in_place<X: Exchange<Mem = Host>>(x: &mut X, buf: &mut [f32]) -> Result<()> {
    if buf.len() != x.width() {
        return Err(crate::Error::shape(
            "all_reduce_in_place",
            format!("buffer of {} values for an exchange of {}", buf.len(), x.width()),
        ));
    }
    x.with_slot(0, |slot| slot.copy_from_slice(buf));
    x.sum()?;
    x.for_each_sum(|off, piece| {
        buf[off..off + piece.len()].copy_from_slice(piece);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::shm::ShmGroup;
    use super::*;

    #[test]
    fn aborting_a_pair_of_groups_aborts_both_and_either_shows() {
        let (a, b) =
            (ShmGroup::new(1, 1, 4, WaitPolicy::Spin).unwrap(), ShmGroup::new(1, 1, 0, WaitPolicy::Spin).unwrap());
        let both = Aborts::new(&a, Some(&b));
        assert!(!both.is_aborted());
        // One of its own members aborted the second group: the pair shows it.
        b.abort();
        assert!(both.is_aborted() && !a.is_aborted());
        let (a, b) =
            (ShmGroup::new(1, 1, 4, WaitPolicy::Spin).unwrap(), ShmGroup::new(1, 1, 0, WaitPolicy::Spin).unwrap());
        let both = Aborts::new(&a, Some(&b));
        both.abort();
        assert!(a.is_aborted() && b.is_aborted());
        let alone = ShmGroup::new(1, 1, 4, WaitPolicy::Spin).unwrap();
        Aborts::new(&alone, None).abort();
        assert!(alone.is_aborted());
    }
}
