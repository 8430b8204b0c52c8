//! The NCCL transport between GPUs: one communicator per member, created on the member's
//! thread in non-blocking mode (src/exchange/nccl.rs says why).
//!
//! Owns: [`NcclGroup`], made by the coordinator before the worker threads start and
//! shared by reference, and [`NcclMember`], one worker's view, made by [`NcclGroup::join`]
//! on that worker's thread. The handles live in the group, not in the members, so that
//! [`NcclGroup`]'s abort can call `ncclCommAbort` on every one of them from any thread:
//! whoever takes a handle out of its slot frees it, so none is freed twice. The host
//! never waits for the GPU here: a collective is enqueued on the member's communication
//! stream, ordered after the compute stream by an event, and the compute stream waits
//! for its end by another.
//!
//! A member that is dropped waits (bounded) for the other members to finish their last
//! operations before it frees its communicator, so a peer's kernel never reads freed
//! memory.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, CudaViewMut, DevicePtrMut};
use parking_lot::Mutex;

use super::super::nccl::{self, RawComm, State};
use super::{check_buffer, check_ordinals, Backoff, DeviceAllReduce, Streams};
use crate::cuda::launch::DevOut;
use crate::cuda::probe::{nccl_status, NcclStatus};
use crate::error::{Error, Result};
use crate::exchange::Abort;

/// How long a departing member waits, first for its own last operations, then for the
/// other members to depart too, before it gives up on them and aborts the group. Members
/// that end a run together depart within a step of each other; one that is 10 s late is
/// stuck or has failed.
const DEPART_TIMEOUT: Duration = Duration::from_secs(10);

/// The NCCL library loads and is recent enough for non-blocking communicators.
pub(super) fn nccl_usable() -> bool {
    nccl_status() == NcclStatus::Available && nccl::version().is_ok_and(|v| v >= nccl::MIN_VERSION)
}

/// The NCCL clique a group's members belong to: NCCL's rendezvous id, made once and shared
/// by every member, and where the group's members sit in it. A group of one process is the
/// whole clique; in an MPI world each process's group is its GPUs' slice of one clique of
/// every process's GPUs, the id made by process 0 and broadcast (`train::processes`).
#[derive(Clone, Copy)]
pub struct Clique {
    /// `ncclUniqueId`'s bytes.
    pub id: [u8; 128],
    /// Members of the clique (NCCL's ranks of the communicator).
    pub members: usize,
    /// The clique index (NCCL's rank) of this group's member 0.
    pub first: usize,
}

/// A fresh rendezvous id for a clique (needs only libnccl, no GPU). Fails when NCCL
/// cannot serve (missing, or older than 2.18).
pub fn new_clique_id() -> Result<[u8; 128]> {
    if !nccl_usable() {
        return Err(Error::CudaUnavailable("NCCL 2.18 or later does not load".to_string()));
    }
    Ok(nccl::unique_id()?.internal.map(|c| c as u8))
}

/// The NCCL communicators of one run's GPU workers; created by the coordinator before
/// the worker threads start, shared by reference (Sync).
pub struct NcclGroup {
    /// `ordinals[r]`: the CUDA ordinal of member r.
    ordinals: Vec<usize>,
    /// The clique the members belong to: its size, and member r's index in it is
    /// `first + r`.
    clique_members: usize,
    first: usize,
    /// Number of f32 every call moves.
    len: usize,
    /// NCCL's rendezvous id, made here once, used by every member's `join`.
    id: cudarc::nccl::sys::ncclUniqueId,
    /// Member r's communicator. `None` before it joins, and once the handle was taken out
    /// to be freed (by an abort, or by the member when it departs).
    comms: Vec<Mutex<Option<RawComm>>>,
    /// Members that have departed (dropped their `NcclMember`).
    departed: AtomicUsize,
    aborted: AtomicBool,
}

impl NcclGroup {
    /// A group of `ordinals.len()` members, member r on GPU `ordinals[r]` (distinct: NCCL
    /// forbids two members on one GPU), each call moving `len` f32. Fails when NCCL cannot
    /// serve (missing, or older than 2.18), or a GPU is not there.
    pub fn new(ordinals: &[usize], len: usize) -> Result<NcclGroup> {
        let id = new_clique_id()?;
        NcclGroup::in_clique(ordinals, len, Clique { id, members: ordinals.len(), first: 0 })
    }

    /// [`NcclGroup::new`] for members `clique.first..clique.first + ordinals.len()` of
    /// `clique`: the GPUs of one process of several.
    pub fn in_clique(ordinals: &[usize], len: usize, clique: Clique) -> Result<NcclGroup> {
        check_ordinals(ordinals)?;
        if let Some(o) = ordinals.iter().enumerate().find_map(|(i, o)| ordinals[..i].contains(o).then_some(o)) {
            return Err(Error::config(
                "GPU group",
                format!("NCCL forbids two members (NCCL ranks) on one GPU, and cuda:{o} repeats"),
            ));
        }
        if !nccl_usable() {
            return Err(Error::CudaUnavailable("NCCL 2.18 or later does not load".to_string()));
        }
        if clique.first + ordinals.len() > clique.members {
            return Err(Error::config(
                "NCCL clique",
                format!(
                    "members {}..{} of a clique of {}",
                    clique.first,
                    clique.first + ordinals.len(),
                    clique.members
                ),
            ));
        }
        Ok(NcclGroup {
            ordinals: ordinals.to_vec(),
            clique_members: clique.members,
            first: clique.first,
            len,
            id: cudarc::nccl::sys::ncclUniqueId { internal: clique.id.map(|b| b as _) },
            comms: ordinals.iter().map(|_| Mutex::new(None)).collect(),
            departed: AtomicUsize::new(0),
            aborted: AtomicBool::new(false),
        })
    }

    /// Number of members of the clique (every process's GPUs).
    pub fn members(&self) -> usize {
        self.clique_members
    }

    /// Number of this group's members (this process's GPUs).
    fn local(&self) -> usize {
        self.ordinals.len()
    }

    /// Called once by member `member`'s worker thread, on that thread, concurrently with
    /// every other member (NCCL's init completes only when all members have joined; the
    /// wait polls and ends with [`Error::Aborted`] on an abort). `compute` is the
    /// member's compute stream, from its own context on `ordinals[member]`. A member that
    /// cannot join aborts the group: the others could never complete a call without it.
    pub fn join(&self, member: usize, compute: &Arc<CudaStream>) -> Result<NcclMember<'_>> {
        let ctx = super::check_join(&self.ordinals, member, compute)?;
        self.join_inner(member, ctx, compute.clone()).map_err(|e| self.fail(e))
    }

    fn join_inner(&self, member: usize, ctx: Arc<CudaContext>, compute: Arc<CudaStream>) -> Result<NcclMember<'_>> {
        if self.is_aborted() {
            return Err(Error::Aborted);
        }
        let streams = Streams::new(ctx, compute)?;
        self.init_comm(member)?;
        Ok(NcclMember { group: self, index: member, streams, _not_send: std::marker::PhantomData })
    }

    /// The error a failed call returns, after aborting the group: [`Error::Aborted`] when
    /// the group was already aborted (the failure is a consequence), `e` otherwise.
    fn fail(&self, e: Error) -> Error {
        let already = self.is_aborted();
        self.abort();
        if already {
            Error::Aborted
        } else {
            e
        }
    }

    /// Creates member `member`'s communicator, publishes it in its slot (where `abort` can
    /// reach it), and polls until every member has joined.
    fn init_comm(&self, member: usize) -> Result<()> {
        let (comm, state) = RawComm::init(self.members(), self.first + member, self.id)?;
        {
            let mut slot = self.comms[member].lock();
            // Checked under the lock: an abort that raised the flag before we got here
            // has already swept this slot, so the handle would never be freed.
            if self.is_aborted() {
                drop(slot);
                comm.abort();
                return Err(Error::Aborted);
            }
            *slot = Some(comm);
        }
        self.settle(member, state)
    }

    /// Runs `op` on member `member`'s communicator under its lock, then polls until the
    /// operation is enqueued.
    fn call(&self, member: usize, op: impl FnOnce(&RawComm) -> Result<State>) -> Result<()> {
        let state = {
            let slot = self.comms[member].lock();
            let comm = slot.as_ref().ok_or(Error::Aborted)?;
            op(comm)?
        };
        self.settle(member, state)
    }

    /// Polls member `member`'s communicator until its last call is done, the lock released
    /// between polls so that `abort` can get in.
    fn settle(&self, member: usize, mut state: State) -> Result<()> {
        let mut backoff = Backoff::new();
        while state == State::Pending {
            if self.is_aborted() {
                return Err(Error::Aborted);
            }
            backoff.snooze();
            let slot = self.comms[member].lock();
            state = slot.as_ref().ok_or(Error::Aborted)?.state()?;
        }
        Ok(())
    }

    /// Member `member` leaves for good (its `NcclMember` is dropped): once its own
    /// operations have run and every member has departed, no kernel of any member still
    /// reads its buffers, and it frees its communicator alone. A member that waits longer
    /// than [`DEPART_TIMEOUT`] for either aborts the group instead, releasing whoever
    /// waits for it; that also frees its communicator.
    fn depart(&self, member: usize, comm: &CudaStream, done: &CudaEvent) {
        let drained = done.record(comm).is_ok() && self.poll_until(|| done.try_is_complete().unwrap_or(true));
        self.departed.fetch_add(1, Ordering::SeqCst);
        let all_departed = drained && self.poll_until(|| self.departed.load(Ordering::SeqCst) == self.local());
        if all_departed {
            if let Some(c) = self.comms[member].lock().take() {
                c.abort();
            }
        } else {
            self.abort();
        }
    }

    /// True once `cond` holds; false on an abort or after [`DEPART_TIMEOUT`].
    fn poll_until(&self, mut cond: impl FnMut() -> bool) -> bool {
        let mut backoff = Backoff::new();
        loop {
            if cond() {
                return true;
            }
            if self.is_aborted() || backoff.elapsed() > DEPART_TIMEOUT {
                return false;
            }
            backoff.snooze();
        }
    }
}

impl Abort for NcclGroup {
    /// Raises the flag the waits poll, and calls `ncclCommAbort` on every communicator
    /// still in the group (which also stops their kernels, so a compute stream waiting on
    /// one is released).
    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        for slot in &self.comms {
            if let Some(comm) = slot.lock().take() {
                comm.abort();
            }
        }
    }

    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        // Only a leaked NcclMember (mem::forget) leaves a handle here; nobody can use it now.
        for slot in &self.comms {
            if let Some(comm) = slot.lock().take() {
                comm.abort();
            }
        }
    }
}

/// One member's view of an [`NcclGroup`]; lives on its worker thread (not Send: an NCCL
/// communicator is used from the one thread that created it).
pub struct NcclMember<'g> {
    group: &'g NcclGroup,
    index: usize,
    /// The member's streams: calls start after the compute stream's queued work, and its
    /// later work starts after them.
    streams: Streams,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl NcclMember<'_> {
    /// This member's index in its group.
    #[cfg(test)]
    pub fn index(&self) -> usize {
        self.index
    }

    /// In place SUM all-reduce of `buf` (this member's GPU, the group's `len` values):
    /// ordered after all work already queued on the compute stream, and the compute
    /// stream waits for its end before any later work; the host does not wait. Every
    /// member ends with bitwise the same values. Returns at once on one member.
    pub fn all_reduce_sum(&mut self, buf: &mut impl DevOut) -> Result<()> {
        self.op(&mut buf.view_mut(), None)
    }

    /// Copies `root`'s `buf` into every member's `buf` (same ordering rules as
    /// [`NcclMember::all_reduce_sum`]).
    #[cfg(test)]
    pub fn broadcast(&mut self, buf: &mut impl DevOut, root: usize) -> Result<()> {
        if root >= self.group.members() {
            return Err(Error::config(
                "broadcast root",
                format!("member {root} of a group of {}", self.group.members()),
            ));
        }
        self.op(&mut buf.view_mut(), Some(root))
    }

    fn op(&mut self, buf: &mut CudaViewMut<'_, f32>, root: Option<usize>) -> Result<()> {
        check_buffer("NcclMember", buf, self.group.len, &self.streams.ctx, self.index)?;
        if self.group.members() == 1 || self.group.len == 0 {
            return Ok(());
        }
        if self.group.is_aborted() {
            return Err(Error::Aborted);
        }
        self.enqueue(buf, root).map_err(|e| self.group.fail(e))
    }

    fn enqueue(&mut self, buf: &mut CudaViewMut<'_, f32>, root: Option<usize>) -> Result<()> {
        let g = self.group;
        let (member, len) = (self.index, g.len);
        self.streams.enter()?;
        let (ptr, written) = buf.device_ptr_mut(&self.streams.comm);
        let stream = self.streams.comm.cu_stream();
        g.call(member, |c| match root {
            // SAFETY: `buf` holds `len` f32 on this member's device (checked), stays
            // borrowed until this call returns, and every later use of it is ordered
            // after the collective (the `done` event); `stream` belongs to this member's
            // context.
            None => unsafe { c.all_reduce_sum_f32(ptr, len, stream) },
            Some(root) => unsafe { c.broadcast_f32(ptr, len, root, stream) },
        })?;
        drop(written);
        self.streams.leave()?;
        Ok(())
    }
}

impl NcclMember<'_> {
    /// Every member's `part` bytes to every member (`ncclAllGather`, in place): `buf` holds
    /// members·part bytes on this member's GPU, this member's part at member·part.
    /// Ordered as [`NcclMember::all_reduce_sum`]; returns at once on one member.
    pub fn all_gather_bytes(&mut self, buf: &mut CudaViewMut<'_, u8>, part: usize) -> Result<()> {
        let members = self.group.members();
        check_buffer("NcclMember::all_gather_bytes", buf, members * part, &self.streams.ctx, self.index)?;
        if members == 1 || part == 0 {
            return Ok(());
        }
        if self.group.is_aborted() {
            return Err(Error::Aborted);
        }
        self.enqueue_gather(buf, part).map_err(|e| self.group.fail(e))
    }

    fn enqueue_gather(&mut self, buf: &mut CudaViewMut<'_, u8>, part: usize) -> Result<()> {
        let member = self.index;
        self.streams.enter()?;
        let (ptr, written) = buf.device_ptr_mut(&self.streams.comm);
        let stream = self.streams.comm.cu_stream();
        // SAFETY: `buf` holds members·part bytes on this member's device (checked), stays
        // borrowed until this call returns, and every later use of it is ordered after the
        // collective (the `done` event); `stream` belongs to this member's context.
        self.group.call(member, |c| unsafe { c.all_gather_u8(ptr, member, part, stream) })?;
        drop(written);
        self.streams.leave()?;
        Ok(())
    }
}

impl DeviceAllReduce for NcclMember<'_> {
    fn all_reduce_sum(&mut self, buf: &mut CudaViewMut<'_, f32>) -> Result<()> {
        NcclMember::all_reduce_sum(self, buf)
    }

    fn all_gather_bytes(&mut self, buf: &mut CudaViewMut<'_, u8>, part: usize) -> Result<()> {
        NcclMember::all_gather_bytes(self, buf, part)
    }

    fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.streams.compute
    }

    fn is_aborted(&self) -> bool {
        self.group.is_aborted()
    }

    fn index_and_members(&self) -> (usize, usize) {
        (self.index, self.group.members())
    }
}

impl Drop for NcclMember<'_> {
    fn drop(&mut self) {
        self.group.depart(self.index, &self.streams.comm, &self.streams.done);
    }
}
