//! The device-copy transport between GPUs: where NCCL cannot serve (absent or too old)
//! or may not (one GPU given twice, as in `cuda:0,0`, which NCCL forbids).
//!
//! Owns: [`CopyGroup`] (shared by reference) and [`CopyMember`] (one worker's view). The
//! scheme is the CPU exchange's reduce-scatter / all-gather ([`crate::exchange::shm`]): the
//! buffer is cut into `members` chunks; member r copies chunk r of every member's buffer
//! into a (members, chunk) staging buffer on its own GPU, sums it with kernels/buffers.cu
//! in member order (member 0 + member 1 + ..., left to right) into chunk r of its own
//! buffer, then copies every other chunk from its owner. Each element is summed once, in
//! one order, and copied everywhere: every member ends bitwise equal. The all-gather of
//! 16-bit wires ([`CopyMember::all_gather_bytes`]) is that scheme's second phase alone:
//! member r copies every other member's part of the buffer from its owner.
//!
//! Members publish their buffer (device pointer and context) in the group for the duration
//! of a call and meet at an abortable barrier between the phases; each member synchronises
//! its communication stream before a barrier, so no chunk is read before its owner wrote
//! it, nor overwritten while a peer still reads it. A member whose call failed waits
//! (bounded) until no other member is inside a call before its buffer can be freed.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUdeviceptr, CUresult};
use cudarc::driver::{
    result as driver, sys as driver_sys, CudaContext, CudaSlice, CudaStream, CudaViewMut, DevicePtrMut,
};
use parking_lot::Mutex;

use super::{check_buffer, check_join, check_ordinals, Backoff, DeviceAllReduce, Streams};
use crate::cuda::launch::DevOut;
use crate::cuda::Gpu;
use crate::error::{Error, Result};
use crate::exchange::shm::SpinBarrier;
use crate::exchange::{Abort, WaitPolicy};

/// Chunks are multiples of this many f32 (256 bytes), so every peer copy starts on an
/// aligned address.
pub(super) const CHUNK_GRANULE: usize = 64;

/// How long a member whose call failed waits for the others to leave their calls (so that
/// none still reads its buffer) before it returns anyway. They leave within microseconds
/// of an abort; this bound only keeps a bug from turning into a hang.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Chunk r of a `len`-value buffer cut for `members` members: `members` contiguous ranges
/// in order, covering `0..len`, each a multiple of [`CHUNK_GRANULE`] except the last
/// non-empty one; trailing ones may be empty when `len` is small.
pub(super) fn chunk_ranges(len: usize, members: usize) -> Vec<Range<usize>> {
    let per = len.div_ceil(members.max(1)).div_ceil(CHUNK_GRANULE) * CHUNK_GRANULE;
    (0..members).map(|r| (r * per).min(len)..((r + 1) * per).min(len)).collect()
}

/// A member's buffer as published to the others during a call.
#[derive(Clone)]
struct Peer {
    ptr: CUdeviceptr,
    ctx: Arc<CudaContext>,
}

/// The device-copy collective of one run's GPU workers; created by the coordinator
/// before the worker threads start, shared by reference (Sync).
pub struct CopyGroup {
    /// `ordinals[r]`: the CUDA ordinal of member r (may repeat).
    ordinals: Vec<usize>,
    /// Number of f32 every call moves.
    len: usize,
    /// Member r's buffer while it is in a call.
    buffers: Vec<Mutex<Option<Peer>>>,
    /// Chunk r is reduced by member r.
    chunks: Vec<Range<usize>>,
    /// The phases of a call.
    barrier: SpinBarrier,
    /// Members now inside a call (so possibly reading a peer's buffer).
    inside: AtomicUsize,
    aborted: AtomicBool,
}

impl CopyGroup {
    /// A group of `ordinals.len()` members, member r on GPU `ordinals[r]`, each call moving
    /// `len` f32. No driver, or a GPU that is not there, is [`Error::CudaUnavailable`].
    pub fn new(ordinals: &[usize], len: usize) -> Result<CopyGroup> {
        check_ordinals(ordinals)?;
        let members = ordinals.len();
        Ok(CopyGroup {
            ordinals: ordinals.to_vec(),
            len,
            buffers: (0..members).map(|_| Mutex::new(None)).collect(),
            chunks: chunk_ranges(len, members),
            // One thread per GPU member, each mostly waiting on its GPU: spinning pays.
            barrier: SpinBarrier::new(members, WaitPolicy::Spin),
            inside: AtomicUsize::new(0),
            aborted: AtomicBool::new(false),
        })
    }

    /// Number of members.
    pub fn members(&self) -> usize {
        self.ordinals.len()
    }

    /// Called once by member `member`'s worker thread, on that thread. `compute` is the
    /// member's compute stream, from its own context on `ordinals[member]`.
    pub fn join(&self, member: usize, compute: &Arc<CudaStream>) -> Result<CopyMember<'_>> {
        let ctx = check_join(&self.ordinals, member, compute)?;
        let inner = || -> Result<CopyMember<'_>> {
            if self.is_aborted() {
                return Err(Error::Aborted);
            }
            let streams = Streams::new(ctx.clone(), compute.clone())?;
            let widest = self.chunks.iter().map(|c| c.len()).max().unwrap_or(0);
            Ok(CopyMember {
                group: self,
                index: member,
                staging: streams.comm.alloc_zeros::<f32>((self.members() * widest).max(1))?,
                // The reduce kernel runs on the communication stream.
                gpu: Gpu::on_stream(streams.comm.clone())?,
                peer_tried: vec![false; self.members()],
                streams,
            })
        };
        inner().map_err(|e| self.fail(e))
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

    /// Counts a member into a call, or refuses it after an abort. Incremented before the
    /// flag is read, so a failed member that then sees nobody inside knows that every later
    /// entrant sees the flag and reads no buffer.
    fn enter(&self) -> Result<()> {
        self.inside.fetch_add(1, Ordering::SeqCst);
        if self.is_aborted() {
            self.inside.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Aborted);
        }
        Ok(())
    }

    /// Every member's published buffer. All are published once the first barrier of a call
    /// passed, and stay so until its last one unless the call was aborted.
    fn peers(&self) -> Result<Vec<Peer>> {
        self.buffers.iter().map(|b| b.lock().clone().ok_or(Error::Aborted)).collect()
    }
}

impl Abort for CopyGroup {
    /// Raises the flag every barrier and wait polls.
    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        self.barrier.wake();
    }

    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

/// One member's view of a [`CopyGroup`], with its streams, staging and reduce kernel.
pub struct CopyMember<'g> {
    group: &'g CopyGroup,
    index: usize,
    /// The member's streams: calls start after the compute stream's queued work, and its
    /// later work starts after them.
    streams: Streams,
    /// (members, chunk) staging buffer, chunk being the largest chunk.
    staging: CudaSlice<f32>,
    /// Launches of kernels/buffers.cu on the communication stream.
    gpu: Gpu,
    /// Peer access from this member's context to member q's was tried (once per peer).
    peer_tried: Vec<bool>,
}

impl CopyMember<'_> {
    /// This member's index in its group.
    #[cfg(test)]
    pub fn index(&self) -> usize {
        self.index
    }

    /// In place SUM all-reduce of `buf` (this member's GPU, the group's `len` values),
    /// ordered after all work already queued on the compute stream; the compute stream
    /// waits for its end before any later work. The host synchronises the communication
    /// stream between phases. Every member ends with bitwise the same values. Returns at
    /// once on one member or for empty buffers.
    pub fn all_reduce_sum(&mut self, buf: &mut impl DevOut) -> Result<()> {
        let mut buf = buf.view_mut();
        check_buffer("CopyMember::all_reduce_sum", &buf, self.group.len, &self.streams.ctx, self.index)?;
        if self.group.members() == 1 || self.group.len == 0 {
            return Ok(());
        }
        self.call(|me| me.all_reduce(&mut buf))
    }

    /// Copies `root`'s `buf` into every member's `buf` (same ordering rules as
    /// [`CopyMember::all_reduce_sum`]).
    #[cfg(test)]
    pub fn broadcast(&mut self, buf: &mut impl DevOut, root: usize) -> Result<()> {
        let mut buf = buf.view_mut();
        check_buffer("CopyMember::broadcast", &buf, self.group.len, &self.streams.ctx, self.index)?;
        if root >= self.group.members() {
            return Err(Error::config(
                "broadcast root",
                format!("member {root} of a group of {}", self.group.members()),
            ));
        }
        if self.group.members() == 1 || self.group.len == 0 {
            return Ok(());
        }
        self.call(|me| me.broadcast_from(&mut buf, root))
    }

    /// Every member's `part` bytes to every member: `buf` holds members·part bytes on this
    /// member's GPU, this member's part at member·part; afterwards every member's `buf`
    /// holds every part, copied from its owner (same ordering rules as
    /// [`CopyMember::all_reduce_sum`]).
    pub fn all_gather_bytes(&mut self, buf: &mut CudaViewMut<'_, u8>, part: usize) -> Result<()> {
        let members = self.group.members();
        check_buffer("CopyMember::all_gather_bytes", buf, members * part, &self.streams.ctx, self.index)?;
        if members == 1 || part == 0 {
            return Ok(());
        }
        self.call(|me| me.all_gather(buf, part))
    }

    /// One collective `op`, with the bookkeeping that keeps a failed call from freeing
    /// memory a peer still reads.
    fn call(&mut self, op: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        let g = self.group;
        g.enter()?;
        let result = op(self).map_err(|e| g.fail(e));
        if result.is_err() {
            // This member's reads of peer buffers end here; then it waits for the others to
            // end theirs before its buffer can be freed. The abort released every barrier,
            // so they leave at once.
            let _ = self.streams.comm.synchronize();
            g.inside.fetch_sub(1, Ordering::SeqCst);
            let start = Instant::now();
            let mut backoff = Backoff::new();
            while g.inside.load(Ordering::SeqCst) != 0 && start.elapsed() < LEAVE_TIMEOUT {
                backoff.snooze();
            }
        } else {
            g.inside.fetch_sub(1, Ordering::SeqCst);
        }
        *g.buffers[self.index].lock() = None;
        result
    }

    /// Enables peer access from this member's context to member q's GPU when it allows it,
    /// once. Optional: without it the driver stages peer copies through the host, slower
    /// but correct, so a refusal is not an error.
    fn enable_peer_access(&mut self, q: usize, peer: &Peer) {
        if self.peer_tried[q] || peer.ctx.cu_ctx() == self.streams.ctx.cu_ctx() {
            return;
        }
        self.peer_tried[q] = true;
        let mut can = 0;
        // SAFETY: both CUdevice handles come from live contexts; `can` is a valid out
        // pointer. cuCtxEnablePeerAccess acts on the current context, bound first.
        unsafe {
            let asked = driver_sys::cuDeviceCanAccessPeer(&mut can, self.streams.ctx.cu_device(), peer.ctx.cu_device());
            if asked == CUresult::CUDA_SUCCESS && can == 1 && self.streams.ctx.bind_to_thread().is_ok() {
                // CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED (another member on this GPU did
                // it) is as good as success; any other refusal leaves staged copies.
                let _ = driver_sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0);
            }
        }
    }

    fn all_reduce(&mut self, buf: &mut CudaViewMut<'_, f32>) -> Result<()> {
        let g = self.group;
        let (member, members) = (self.index, g.members());
        self.streams.enter()?;
        // The explicit events order every use of `buf` against this call; cudarc's own
        // tracking (where it is on) needs no more than the pointer's borrow.
        let ptr = buf.device_ptr_mut(&self.streams.comm).0;
        // buf is final once the compute stream's queued work has run: publish it.
        self.streams.comm.synchronize()?;
        *g.buffers[member].lock() = Some(Peer { ptr, ctx: self.streams.ctx.clone() });
        g.barrier.wait(&g.aborted)?;

        // Reduce-scatter: chunk `member` of every buffer, staged as (members, n), summed in
        // member order into chunk `member` of this buffer. Peers only read other chunks of
        // it meanwhile.
        let peers = g.peers()?;
        for (q, peer) in peers.iter().enumerate() {
            self.enable_peer_access(q, peer);
        }
        let mine = g.chunks[member].clone();
        let n = mine.len();
        if n > 0 {
            let staging = self.staging.device_ptr_mut(&self.streams.comm).0;
            for (q, peer) in peers.iter().enumerate() {
                // SAFETY: peer q published its buffer of `len` f32 and keeps it until the
                // last barrier of this call, which it reaches only after we synchronised
                // below; chunk `member` lies inside it; staging holds members * widest >=
                // q*n + n.
                unsafe {
                    copy_async(
                        &self.streams.ctx,
                        staging + q as u64 * n as u64 * F32,
                        &peer.ctx,
                        peer.ptr + mine.start as u64 * F32,
                        n * F32 as usize,
                        &self.streams.comm,
                    )?;
                }
            }
            self.gpu.reduce_sum(&self.staging.slice(0..members * n), &mut buf.slice_mut(mine), members, 1.0)?;
        }
        self.streams.comm.synchronize()?;
        g.barrier.wait(&g.aborted)?;

        // All-gather: every other chunk from its owner, reduced by now.
        for (q, peer) in peers.iter().enumerate() {
            let c = &g.chunks[q];
            if q == member || c.is_empty() {
                continue;
            }
            // SAFETY: as above; chunk q of both buffers lies inside them, and its owner
            // wrote it before the barrier we just passed.
            unsafe {
                copy_async(
                    &self.streams.ctx,
                    ptr + c.start as u64 * F32,
                    &peer.ctx,
                    peer.ptr + c.start as u64 * F32,
                    c.len() * F32 as usize,
                    &self.streams.comm,
                )?;
            }
        }
        self.streams.comm.synchronize()?;
        // Past this barrier every member has finished reading this buffer.
        g.barrier.wait(&g.aborted)?;
        self.streams.leave()?;
        Ok(())
    }

    fn all_gather(&mut self, buf: &mut CudaViewMut<'_, u8>, part: usize) -> Result<()> {
        let g = self.group;
        let member = self.index;
        self.streams.enter()?;
        let ptr = buf.device_ptr_mut(&self.streams.comm).0;
        // This member's part is final once the compute stream's queued work has run.
        self.streams.comm.synchronize()?;
        *g.buffers[member].lock() = Some(Peer { ptr, ctx: self.streams.ctx.clone() });
        g.barrier.wait(&g.aborted)?;
        let peers = g.peers()?;
        let at = |q: usize| (q * part) as u64;
        for (q, peer) in peers.iter().enumerate() {
            if q == member {
                continue;
            }
            self.enable_peer_access(q, peer);
            // SAFETY: peer q published its buffer of members·part bytes and keeps it until
            // the barrier below, which it passes only after we synchronised; part q lies
            // inside both buffers (checked lengths), and only its owner wrote it, before
            // the barrier we passed.
            unsafe {
                copy_async(&self.streams.ctx, ptr + at(q), &peer.ctx, peer.ptr + at(q), part, &self.streams.comm)?
            };
        }
        self.streams.comm.synchronize()?;
        // Past this barrier every member has finished reading this buffer.
        g.barrier.wait(&g.aborted)?;
        self.streams.leave()?;
        Ok(())
    }

    #[cfg(test)]
    fn broadcast_from(&mut self, buf: &mut CudaViewMut<'_, f32>, root: usize) -> Result<()> {
        let g = self.group;
        let member = self.index;
        self.streams.enter()?;
        let ptr = buf.device_ptr_mut(&self.streams.comm).0;
        self.streams.comm.synchronize()?;
        if member == root {
            *g.buffers[member].lock() = Some(Peer { ptr, ctx: self.streams.ctx.clone() });
        }
        g.barrier.wait(&g.aborted)?;
        if member != root {
            let src = g.buffers[root].lock().clone().ok_or(Error::Aborted)?;
            self.enable_peer_access(root, &src);
            // SAFETY: the root published `len` f32 and keeps them until the barrier
            // below, which it passes only after we synchronised; ours hold `len` too.
            unsafe { copy_async(&self.streams.ctx, ptr, &src.ctx, src.ptr, g.len * F32 as usize, &self.streams.comm)? };
            self.streams.comm.synchronize()?;
        }
        g.barrier.wait(&g.aborted)?;
        self.streams.leave()?;
        Ok(())
    }
}

impl DeviceAllReduce for CopyMember<'_> {
    fn all_reduce_sum(&mut self, buf: &mut CudaViewMut<'_, f32>) -> Result<()> {
        CopyMember::all_reduce_sum(self, buf)
    }

    fn all_gather_bytes(&mut self, buf: &mut CudaViewMut<'_, u8>, part: usize) -> Result<()> {
        CopyMember::all_gather_bytes(self, buf, part)
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

/// Copies `bytes` from `src` (in `src_ctx`) to `dst` (in `dst_ctx`) on `stream`.
///
/// # Safety
/// Both ranges must be live device memory of their contexts until the copy has run on
/// `stream`, which must belong to `dst_ctx`'s device.
unsafe fn copy_async(
    dst_ctx: &CudaContext,
    dst: CUdeviceptr,
    src_ctx: &CudaContext,
    src: CUdeviceptr,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller guarantees both ranges; one context means one device, where a
    // plain device copy serves, two need the peer copy, staged by the driver if needed.
    unsafe {
        if dst_ctx.cu_ctx() == src_ctx.cu_ctx() {
            driver::memcpy_dtod_async(dst, src, bytes, stream.cu_stream())?;
        } else {
            driver::memcpy_peer_async(dst_ctx.cu_ctx(), dst, src_ctx.cu_ctx(), src, bytes, stream.cu_stream())?;
        }
    }
    Ok(())
}

const F32: u64 = std::mem::size_of::<f32>() as u64;
