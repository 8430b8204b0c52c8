//! The collective of one run's GPU workers: SUM all-reduce and broadcast of flat f32
//! buffers that live on the GPUs.
//!
//! Owns: [`GpuGroup`], made by the coordinator before the worker threads start and shared
//! by reference, and [`GpuRank`], one worker's view, made by [`GpuGroup::join`] on that
//! worker's thread. The replica decides what to reduce and when; this file only moves and
//! sums the values, on a communication stream of its own, ordered against the replica's
//! compute stream with events: the communication stream waits for an event recorded on
//! the compute stream, and the compute stream waits for an event recorded after the
//! collective, so the replica keeps queueing work without ever synchronising for it.
//!
//! Two transports, chosen once by [`GpuGroup::new`]:
//! - **NCCL** (distinct GPUs and a loadable NCCL 2.18 or later): one communicator per
//!   rank, created on the rank's thread in non-blocking mode (src/comm/nccl.rs says why).
//!   The handles live in the group, not in the ranks, so that [`GpuGroup::abort`] can call
//!   `ncclCommAbort` on every one of them from any thread: whoever takes a handle out of
//!   its slot frees it, so none is freed twice. The host never waits for the GPU here.
//! - **Device copies** (NCCL absent or too old, one GPU given twice as in `cuda:0,0`,
//!   which NCCL forbids, or asked for): the reduce-scatter / all-gather of the CPU path
//!   ([`super::shm`]). The buffer is cut into `world` chunks; rank r copies chunk r of
//!   every rank's buffer into a (world, chunk) staging buffer on its own GPU, sums it with
//!   kernels/reduce.cu in rank order (rank 0 + rank 1 + ..., left to right) into chunk r
//!   of its own buffer, then copies every other chunk from its owner. Each element is
//!   summed once, in one order, and copied everywhere: every rank ends bitwise equal.
//!   Ranks publish their buffer (device pointer and context) in the group for the
//!   duration of a call and meet at an abortable barrier between the phases; each rank
//!   synchronises its communication stream before a barrier, so no chunk is read before
//!   its owner wrote it, nor overwritten while a peer still reads it.
//!
//! Every rank must make the same calls, with the same root, in the same order, as with
//! NCCL or MPI.
//!
//! Failure: [`GpuGroup::abort`] makes every pending and future call of every rank return
//! [`Error::Aborted`]. A rank whose own call fails also aborts the group before returning
//! its error, since the others would otherwise wait for it forever. An NCCL rank that is
//! dropped waits (bounded) for the other ranks to finish their last operations before it
//! frees its communicator, so a peer's kernel never reads freed memory.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUdeviceptr, CUresult};
use cudarc::driver::{
    result as driver, sys as driver_sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtrMut,
    LaunchConfig, PushKernelArg,
};
use parking_lot::Mutex;

use super::nccl::{self, RawComm, State};
use super::shm::SpinBarrier;
use crate::cuda::kernels::{self, kernel_name, Dir};
use crate::cuda::probe::{driver_available, gpu_count, nccl_status, NcclStatus};
use crate::error::{Error, Result};

/// Chunks of the copy path are multiples of this many f32 (256 bytes), so every peer copy
/// starts on an aligned address.
const CHUNK_GRANULE: usize = 64;

/// How long a departing NCCL rank waits, first for its own last operations, then for the
/// other ranks to depart too, before it gives up on them and aborts the group. Ranks that
/// end a run together depart within a step of each other; one that is 10 s late is stuck
/// or has failed.
const DEPART_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a rank whose copy-path call failed waits for the others to leave their calls
/// (so that none still reads its buffer) before it returns anyway. They leave within
/// microseconds of an abort; this bound only keeps a bug from turning into a hang.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Threads per block of the reduce launch (a grid-stride loop).
const REDUCE_THREADS: u32 = 256;

/// Which transport a group uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Nccl,
    Copies,
}

/// NCCL when there is something to exchange (two ranks or more), nobody forces the
/// fallback, no GPU is given twice (NCCL forbids two ranks on one device), and the
/// library is usable; `nccl_usable` is asked last, so it loads nothing otherwise.
fn choose_transport(ordinals: &[usize], force_copies: bool, nccl_usable: impl FnOnce() -> bool) -> Transport {
    let repeats = ordinals.iter().enumerate().any(|(i, o)| ordinals[..i].contains(o));
    if ordinals.len() < 2 || force_copies || repeats || !nccl_usable() {
        Transport::Copies
    } else {
        Transport::Nccl
    }
}

/// The NCCL library loads and is recent enough for non-blocking communicators.
fn nccl_usable() -> bool {
    nccl_status() == NcclStatus::Available && nccl::version().is_ok_and(|v| v >= nccl::MIN_VERSION)
}

/// Chunk r of a `len`-value buffer cut for `world` ranks: `world` contiguous ranges in
/// order, covering `0..len`, each a multiple of [`CHUNK_GRANULE`] except the last
/// non-empty one; trailing ones may be empty when `len` is small.
fn chunk_ranges(len: usize, world: usize) -> Vec<Range<usize>> {
    let per = len.div_ceil(world.max(1)).div_ceil(CHUNK_GRANULE) * CHUNK_GRANULE;
    (0..world).map(|r| (r * per).min(len)..((r + 1) * per).min(len)).collect()
}

/// Launch shape of the reduce kernel's grid-stride loop over `n > 0` values.
fn reduce_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(REDUCE_THREADS as usize).clamp(1, 65_535) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (REDUCE_THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// Spins, then yields, then sleeps briefly: waits of a few µs stay fast, long ones cost
/// no core (several ranks may share few cores).
struct Backoff {
    spins: u32,
    start: Instant,
}

impl Backoff {
    fn new() -> Self {
        Backoff { spins: 0, start: Instant::now() }
    }

    fn snooze(&mut self) {
        self.spins = self.spins.saturating_add(1);
        if self.spins < 1024 {
            std::hint::spin_loop();
        } else if self.start.elapsed() < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}

/// A rank's buffer as published to the others during a copy-path call.
#[derive(Clone)]
struct Peer {
    ptr: CUdeviceptr,
    ctx: Arc<CudaContext>,
}

/// The collective of one run's GPU workers; created by the coordinator before the worker
/// threads start, shared by reference (Sync).
pub struct GpuGroup {
    /// `ordinals[r]`: the CUDA ordinal of rank r.
    ordinals: Vec<usize>,
    /// Number of f32 every call moves.
    len: usize,
    transport: Transport,
    /// NCCL's rendezvous id, made here once, used by every rank's `join`.
    nccl_id: Option<cudarc::nccl::sys::ncclUniqueId>,
    /// Rank r's communicator. `None` before it joins, and once the handle was taken out to
    /// be freed (by an abort, or by the rank when it departs).
    comms: Vec<Mutex<Option<RawComm>>>,
    /// NCCL ranks that have departed (dropped their `GpuRank`).
    departed: AtomicUsize,
    /// Copy path: rank r's buffer while it is in a call.
    buffers: Vec<Mutex<Option<Peer>>>,
    /// Copy path: chunk r is reduced by rank r.
    chunks: Vec<Range<usize>>,
    /// Copy path: the phases of a call.
    barrier: SpinBarrier,
    /// Copy path: ranks now inside a call (so possibly reading a peer's buffer).
    inside: AtomicUsize,
    aborted: AtomicBool,
}

impl GpuGroup {
    /// `ordinals[r]` is the CUDA ordinal of rank r; `len` the number of f32 every
    /// all-reduce moves. Uses NCCL when its library loads (`cuda::probe::nccl_status()`,
    /// version 2.18 or later) and no ordinal repeats (NCCL forbids two ranks on one GPU);
    /// otherwise in-process device-to-device copies. `force_copies` forces the fallback
    /// (for tests and benchmarks). No driver, or an ordinal that is not there, is
    /// [`Error::CudaUnavailable`].
    pub fn new(ordinals: &[usize], len: usize, force_copies: bool) -> Result<GpuGroup> {
        if ordinals.is_empty() {
            return Err(Error::config("GPU group", "no GPU given"));
        }
        driver_available()?;
        let count = gpu_count()?;
        if let Some(&missing) = ordinals.iter().find(|&&o| o >= count) {
            return Err(Error::CudaUnavailable(format!("cuda:{missing} asked for, but {count} GPU(s) are visible")));
        }
        let world = ordinals.len();
        let transport = choose_transport(ordinals, force_copies, nccl_usable);
        let nccl_id = match transport {
            Transport::Nccl => Some(nccl::unique_id()?),
            Transport::Copies => None,
        };
        Ok(GpuGroup {
            ordinals: ordinals.to_vec(),
            len,
            transport,
            nccl_id,
            comms: (0..world).map(|_| Mutex::new(None)).collect(),
            departed: AtomicUsize::new(0),
            buffers: (0..world).map(|_| Mutex::new(None)).collect(),
            chunks: chunk_ranges(len, world),
            barrier: SpinBarrier::new(world),
            inside: AtomicUsize::new(0),
            aborted: AtomicBool::new(false),
        })
    }

    /// "nccl" or "device copies", for logs and benchmark output.
    pub fn transport(&self) -> &'static str {
        match self.transport {
            Transport::Nccl => "nccl",
            Transport::Copies => "device copies",
        }
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.ordinals.len()
    }

    /// Number of f32 every call moves.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when calls move nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Called once by rank `rank`'s worker thread, on that thread, concurrently with every
    /// other rank (NCCL's init completes only when all ranks have joined; the wait polls
    /// and ends with [`Error::Aborted`] on an abort). `compute` is the rank's compute
    /// stream, from its own context on `ordinals[rank]`. A rank that cannot join aborts
    /// the group: the others could never complete a call without it.
    pub fn join(&self, rank: usize, compute: &Arc<CudaStream>) -> Result<GpuRank<'_>> {
        let world = self.world();
        if rank >= world {
            return Err(Error::config("rank", format!("rank {rank} joined a group of {world}")));
        }
        let ctx = compute.context().clone();
        if ctx.ordinal() != self.ordinals[rank] {
            return Err(Error::DeviceMismatch {
                op: "GpuGroup::join",
                lhs: format!("cuda:{} (rank {rank})", self.ordinals[rank]),
                rhs: format!("cuda:{} (its compute stream)", ctx.ordinal()),
            });
        }
        self.join_inner(rank, ctx, compute.clone()).map_err(|e| self.fail(e))
    }

    fn join_inner(&self, rank: usize, ctx: Arc<CudaContext>, compute: Arc<CudaStream>) -> Result<GpuRank<'_>> {
        if self.is_aborted() {
            return Err(Error::Aborted);
        }
        ctx.bind_to_thread()?;
        let comm = ctx.new_stream()?;
        let ready = ctx.new_event(None)?;
        let done = ctx.new_event(None)?;
        let idle = ctx.new_event(None)?;
        let path = match self.transport {
            Transport::Nccl => {
                self.init_comm(rank)?;
                Path::Nccl
            }
            Transport::Copies => Path::Copies(CopyState::new(&ctx, &comm, self)?),
        };
        Ok(GpuRank {
            group: self,
            rank,
            ctx,
            compute,
            comm,
            ready,
            done,
            idle,
            path,
            _not_send: std::marker::PhantomData,
        })
    }

    /// Makes every pending and future call of every rank fail with [`Error::Aborted`]:
    /// raises the flag the waits poll, and calls `ncclCommAbort` on every communicator
    /// still in the group (which also stops their kernels, so a compute stream waiting on
    /// one is released). Callable from any thread, any number of times.
    pub fn abort(&self) {
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

    // ---- NCCL ---------------------------------------------------------------------------

    /// Creates rank `rank`'s communicator, publishes it in its slot (where `abort` can
    /// reach it), and polls until every rank has joined.
    fn init_comm(&self, rank: usize) -> Result<()> {
        let id = self.nccl_id.ok_or_else(|| Error::CudaUnavailable("NCCL group without an id".to_string()))?;
        let (comm, state) = RawComm::init(self.world(), rank, id)?;
        {
            let mut slot = self.comms[rank].lock();
            // Checked under the lock: an abort that raised the flag before we got here
            // has already swept this slot, so the handle would never be freed.
            if self.is_aborted() {
                drop(slot);
                comm.abort();
                return Err(Error::Aborted);
            }
            *slot = Some(comm);
        }
        self.nccl_settle(rank, state)
    }

    /// Runs `op` on rank `rank`'s communicator under its lock, then polls until the
    /// operation is enqueued.
    fn nccl_call(&self, rank: usize, op: impl FnOnce(&RawComm) -> Result<State>) -> Result<()> {
        let state = {
            let slot = self.comms[rank].lock();
            let comm = slot.as_ref().ok_or(Error::Aborted)?;
            op(comm)?
        };
        self.nccl_settle(rank, state)
    }

    /// Polls rank `rank`'s communicator until its last call is done, the lock released
    /// between polls so that `abort` can get in.
    fn nccl_settle(&self, rank: usize, mut state: State) -> Result<()> {
        let mut backoff = Backoff::new();
        while state == State::Pending {
            if self.is_aborted() {
                return Err(Error::Aborted);
            }
            backoff.snooze();
            let slot = self.comms[rank].lock();
            state = slot.as_ref().ok_or(Error::Aborted)?.state()?;
        }
        Ok(())
    }

    /// Rank `rank` leaves for good (its `GpuRank` is dropped): once its own operations
    /// have run and every rank has departed, no kernel of any rank still reads its
    /// buffers, and it frees its communicator alone. A rank that waits longer than
    /// [`DEPART_TIMEOUT`] for either aborts the group instead, releasing whoever waits for
    /// it; that also frees its communicator.
    fn depart_nccl(&self, rank: usize, comm: &CudaStream, done: &CudaEvent) {
        let drained = done.record(comm).is_ok() && self.poll_until(|| done.try_is_complete().unwrap_or(true));
        self.departed.fetch_add(1, Ordering::SeqCst);
        let all_departed = drained && self.poll_until(|| self.departed.load(Ordering::SeqCst) == self.world());
        if all_departed {
            if let Some(c) = self.comms[rank].lock().take() {
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

    // ---- device copies ------------------------------------------------------------------

    /// Counts a rank into a copy-path call, or refuses it after an abort. Incremented
    /// before the flag is read, so a failed rank that then sees nobody inside knows that
    /// every later entrant sees the flag and reads no buffer.
    fn enter(&self) -> Result<()> {
        self.inside.fetch_add(1, Ordering::SeqCst);
        if self.is_aborted() {
            self.inside.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Aborted);
        }
        Ok(())
    }

    /// Every rank's published buffer. All are published once the first barrier of a call
    /// passed, and stay so until its last one unless the call was aborted.
    fn peers(&self) -> Result<Vec<Peer>> {
        self.buffers.iter().map(|b| b.lock().clone().ok_or(Error::Aborted)).collect()
    }
}

impl Drop for GpuGroup {
    fn drop(&mut self) {
        // Only a leaked GpuRank (mem::forget) leaves a handle here; nobody can use it now.
        for slot in &self.comms {
            if let Some(comm) = slot.lock().take() {
                comm.abort();
            }
        }
    }
}

/// The copy path's per-rank resources.
struct CopyState {
    /// (world, chunk) staging buffer, chunk being the largest chunk.
    staging: CudaSlice<f32>,
    /// reduce_sum_f32 of kernels/reduce.cu, loaded in this rank's context; None when there
    /// is nothing to reduce (one rank, or empty buffers).
    reduce: Option<CudaFunction>,
    /// Peer access from this rank's context to rank q's was tried (once per peer).
    peer_tried: Vec<bool>,
}

impl CopyState {
    fn new(ctx: &Arc<CudaContext>, comm: &Arc<CudaStream>, g: &GpuGroup) -> Result<CopyState> {
        let world = g.world();
        let widest = g.chunks.iter().map(|c| c.len()).max().unwrap_or(0);
        let reduce = if world > 1 && g.len > 0 {
            let module = kernels::load_module(ctx, "reduce.cu")?;
            Some(module.load_function(&kernel_name("reduce_sum", Dir::Plain, "f32"))?)
        } else {
            None
        };
        Ok(CopyState {
            staging: comm.alloc_zeros::<f32>((world * widest).max(1))?,
            reduce,
            peer_tried: vec![false; world],
        })
    }

    /// Enables peer access from `ctx` to rank q's GPU when it allows it, once. Optional:
    /// without it the driver stages peer copies through the host, slower but correct, so
    /// a refusal is not an error.
    fn enable_peer_access(&mut self, ctx: &CudaContext, q: usize, peer: &Peer) {
        if self.peer_tried[q] || peer.ctx.cu_ctx() == ctx.cu_ctx() {
            return;
        }
        self.peer_tried[q] = true;
        let mut can = 0;
        // SAFETY: both CUdevice handles come from live contexts; `can` is a valid out
        // pointer. cuCtxEnablePeerAccess acts on the current context, bound first.
        unsafe {
            let asked = driver_sys::cuDeviceCanAccessPeer(&mut can, ctx.cu_device(), peer.ctx.cu_device());
            if asked == CUresult::CUDA_SUCCESS && can == 1 && ctx.bind_to_thread().is_ok() {
                // CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED (another rank on this GPU did it)
                // is as good as success; any other refusal leaves staged copies.
                let _ = driver_sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0);
            }
        }
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

/// What a rank owns besides its streams and events, per transport.
enum Path {
    /// The communicator lives in the group's slot for this rank.
    Nccl,
    Copies(CopyState),
}

/// One rank's view of a [`GpuGroup`]; lives on its worker thread (not Send: an NCCL
/// communicator is used from the one thread that created it).
pub struct GpuRank<'g> {
    group: &'g GpuGroup,
    rank: usize,
    ctx: Arc<CudaContext>,
    /// The replica's compute stream: collectives start after its queued work, and its
    /// later work starts after them.
    compute: Arc<CudaStream>,
    /// This rank's communication stream.
    comm: Arc<CudaStream>,
    /// Recorded on `compute`, waited on by `comm`.
    ready: CudaEvent,
    /// Recorded on `comm`, waited on by `compute`.
    done: CudaEvent,
    /// Recorded by `wait_for`: the point the host waits for.
    idle: CudaEvent,
    path: Path,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl GpuRank<'_> {
    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.group.world()
    }

    /// Waits until everything queued so far on `stream` (a stream of this rank's GPU) has
    /// run, or until the group is aborted ([`Error::Aborted`]): the host's waits for the
    /// GPU go through here, so that a rank whose peer failed is never stuck behind a
    /// collective that cannot complete.
    pub fn wait_for(&self, stream: &CudaStream) -> Result<()> {
        let event = &self.idle;
        event.record(stream)?;
        let mut backoff = Backoff::new();
        loop {
            if event.try_is_complete()? {
                return Ok(());
            }
            if self.group.is_aborted() {
                return Err(Error::Aborted);
            }
            backoff.snooze();
        }
    }

    /// In place SUM all-reduce of `buf` (this rank's GPU, `len` values): ordered after all
    /// work already queued on the compute stream, and the compute stream waits for its end
    /// before any later work. Every rank ends with bitwise the same values. NCCL path: the
    /// host does not wait for the GPU. Copy path: the host synchronises the communication
    /// stream between phases. Returns at once on one rank or for empty buffers.
    pub fn all_reduce_sum(&mut self, buf: &mut CudaSlice<f32>) -> Result<()> {
        self.check("GpuRank::all_reduce_sum", buf)?;
        if self.world() == 1 || self.group.len == 0 {
            return Ok(());
        }
        match self.path {
            Path::Nccl => self.nccl_op(buf, None),
            Path::Copies(_) => self.copy_op(buf, None),
        }
    }

    /// Copies `root`'s `buf` into every rank's `buf` (same ordering rules as
    /// [`GpuRank::all_reduce_sum`]).
    pub fn broadcast(&mut self, buf: &mut CudaSlice<f32>, root: usize) -> Result<()> {
        self.check("GpuRank::broadcast", buf)?;
        if root >= self.world() {
            return Err(Error::config("broadcast root", format!("rank {root} of a group of {}", self.world())));
        }
        if self.world() == 1 || self.group.len == 0 {
            return Ok(());
        }
        match self.path {
            Path::Nccl => self.nccl_op(buf, Some(root)),
            Path::Copies(_) => self.copy_op(buf, Some(root)),
        }
    }

    fn check(&self, op: &'static str, buf: &CudaSlice<f32>) -> Result<()> {
        if buf.len() != self.group.len {
            return Err(Error::shape(op, format!("buffer of {} values for a group of {}", buf.len(), self.group.len)));
        }
        if buf.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::DeviceMismatch {
                op,
                lhs: format!("cuda:{} (rank {})", self.ctx.ordinal(), self.rank),
                rhs: format!("cuda:{} (the buffer)", buf.context().ordinal()),
            });
        }
        Ok(())
    }

    /// The NCCL all-reduce (`root` None) or broadcast.
    fn nccl_op(&mut self, buf: &mut CudaSlice<f32>, root: Option<usize>) -> Result<()> {
        if self.group.is_aborted() {
            return Err(Error::Aborted);
        }
        self.nccl_enqueue(buf, root).map_err(|e| self.group.fail(e))
    }

    fn nccl_enqueue(&mut self, buf: &mut CudaSlice<f32>, root: Option<usize>) -> Result<()> {
        let g = self.group;
        let (rank, len) = (self.rank, g.len);
        self.ctx.bind_to_thread()?;
        self.ready.record(&self.compute)?;
        self.comm.wait(&self.ready)?;
        // Also orders the call after cudarc's own read/write tracking of `buf`, and marks
        // `buf` as written on the communication stream when dropped.
        let (ptr, written) = buf.device_ptr_mut(&self.comm);
        let stream = self.comm.cu_stream();
        g.nccl_call(rank, |c| match root {
            // SAFETY: `buf` holds `len` f32 on this rank's device (checked), stays borrowed
            // until this call returns, and every later use of it is ordered after the
            // collective (the `done` event, cudarc's write event); `stream` belongs to
            // this rank's context.
            None => unsafe { c.all_reduce_sum_f32(ptr, len, stream) },
            Some(root) => unsafe { c.broadcast_f32(ptr, len, root, stream) },
        })?;
        drop(written);
        self.done.record(&self.comm)?;
        self.compute.wait(&self.done)?;
        Ok(())
    }

    /// The copy-path all-reduce (`root` None) or broadcast, with the bookkeeping that
    /// keeps a failed call from freeing memory a peer still reads.
    fn copy_op(&mut self, buf: &mut CudaSlice<f32>, root: Option<usize>) -> Result<()> {
        let g = self.group;
        g.enter()?;
        let result = match root {
            None => self.copy_all_reduce(buf),
            Some(root) => self.copy_broadcast(buf, root),
        };
        let result = result.map_err(|e| g.fail(e));
        if result.is_err() {
            // This rank's reads of peer buffers end here; then it waits for the others to
            // end theirs before its buffer can be freed. The abort released every barrier,
            // so they leave at once.
            let _ = self.comm.synchronize();
            g.inside.fetch_sub(1, Ordering::SeqCst);
            let start = Instant::now();
            let mut backoff = Backoff::new();
            while g.inside.load(Ordering::SeqCst) != 0 && start.elapsed() < LEAVE_TIMEOUT {
                backoff.snooze();
            }
        } else {
            g.inside.fetch_sub(1, Ordering::SeqCst);
        }
        *g.buffers[self.rank].lock() = None;
        result
    }

    fn copy_all_reduce(&mut self, buf: &mut CudaSlice<f32>) -> Result<()> {
        let g = self.group;
        let (rank, world) = (self.rank, g.world());
        let Path::Copies(cs) = &mut self.path else {
            return Err(Error::config("GPU transport", "copy call on an NCCL rank"));
        };
        self.ctx.bind_to_thread()?;
        self.ready.record(&self.compute)?;
        self.comm.wait(&self.ready)?;
        let (ptr, written) = buf.device_ptr_mut(&self.comm);
        // buf is final once the compute stream's queued work has run: publish it.
        self.comm.synchronize()?;
        *g.buffers[rank].lock() = Some(Peer { ptr, ctx: self.ctx.clone() });
        g.barrier.wait(&g.aborted)?;

        // Reduce-scatter: chunk `rank` of every buffer, staged as (world, n), summed in
        // rank order into chunk `rank` of this buffer. Peers only read other chunks of
        // it meanwhile.
        let peers = g.peers()?;
        for (q, peer) in peers.iter().enumerate() {
            cs.enable_peer_access(&self.ctx, q, peer);
        }
        let mine = g.chunks[rank].clone();
        let n = mine.len();
        if n > 0 {
            let (staging, staged) = cs.staging.device_ptr_mut(&self.comm);
            for (q, peer) in peers.iter().enumerate() {
                // SAFETY: peer q published its buffer of `len` f32 and keeps it until the
                // last barrier of this call, which it reaches only after we synchronised
                // below; chunk `rank` lies inside it; staging holds world * widest >= q*n + n.
                unsafe {
                    copy_async(
                        &self.ctx,
                        staging + q as u64 * n as u64 * F32,
                        &peer.ctx,
                        peer.ptr + mine.start as u64 * F32,
                        n * F32 as usize,
                        &self.comm,
                    )?;
                }
            }
            let f = cs.reduce.as_ref().ok_or_else(|| Error::config("GPU transport", "reduce kernel not loaded"))?;
            let dst = ptr + mine.start as u64 * F32;
            let (k, scale) = (world as i32, 1.0f32);
            let mut launch = self.comm.launch_builder(f);
            launch.arg(&staging).arg(&dst).arg(&k).arg(&scale).arg(&n);
            // SAFETY: arguments match reduce_sum_f32(const float* src, float* dst, int k,
            // float scale, size_t n): src is the staging buffer holding k*n staged values,
            // dst is chunk `rank` of this rank's buffer (n values, no overlap with src).
            unsafe { launch.launch(reduce_cfg(n)) }?;
            drop(staged);
        }
        self.comm.synchronize()?;
        g.barrier.wait(&g.aborted)?;

        // All-gather: every other chunk from its owner, reduced by now.
        for (q, peer) in peers.iter().enumerate() {
            let c = &g.chunks[q];
            if q == rank || c.is_empty() {
                continue;
            }
            // SAFETY: as above; chunk q of both buffers lies inside them, and its owner
            // wrote it before the barrier we just passed.
            unsafe {
                copy_async(
                    &self.ctx,
                    ptr + c.start as u64 * F32,
                    &peer.ctx,
                    peer.ptr + c.start as u64 * F32,
                    c.len() * F32 as usize,
                    &self.comm,
                )?;
            }
        }
        self.comm.synchronize()?;
        // Past this barrier every rank has finished reading this buffer.
        g.barrier.wait(&g.aborted)?;
        drop(written);
        self.done.record(&self.comm)?;
        self.compute.wait(&self.done)?;
        Ok(())
    }

    fn copy_broadcast(&mut self, buf: &mut CudaSlice<f32>, root: usize) -> Result<()> {
        let g = self.group;
        let rank = self.rank;
        self.ctx.bind_to_thread()?;
        self.ready.record(&self.compute)?;
        self.comm.wait(&self.ready)?;
        let (ptr, written) = buf.device_ptr_mut(&self.comm);
        self.comm.synchronize()?;
        if rank == root {
            *g.buffers[rank].lock() = Some(Peer { ptr, ctx: self.ctx.clone() });
        }
        g.barrier.wait(&g.aborted)?;
        if rank != root {
            let src = g.buffers[root].lock().clone().ok_or(Error::Aborted)?;
            if let Path::Copies(cs) = &mut self.path {
                cs.enable_peer_access(&self.ctx, root, &src);
            }
            // SAFETY: the root published `len` f32 and keeps them until the barrier
            // below, which it passes only after we synchronised; ours hold `len` too.
            unsafe { copy_async(&self.ctx, ptr, &src.ctx, src.ptr, g.len * F32 as usize, &self.comm)? };
            self.comm.synchronize()?;
        }
        g.barrier.wait(&g.aborted)?;
        drop(written);
        self.done.record(&self.comm)?;
        self.compute.wait(&self.done)?;
        Ok(())
    }
}

impl Drop for GpuRank<'_> {
    fn drop(&mut self) {
        if let Path::Nccl = self.path {
            self.group.depart_nccl(self.rank, &self.comm, &self.done);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_in_order() {
        for world in 1..=5 {
            for len in [0, 1, 2, 3, 63, 64, 65, 127, 128, 1000, 4097, 100_003] {
                let c = chunk_ranges(len, world);
                assert_eq!(c.len(), world);
                let mut next = 0;
                for r in &c {
                    assert_eq!(r.start, next.min(len), "world {world} len {len}: {c:?}");
                    assert!(r.start <= r.end);
                    next = r.end;
                }
                assert_eq!(next, len, "world {world} len {len}: {c:?}");
                // Every chunk but the last non-empty one is a whole number of granules.
                let last = c.iter().rposition(|r| !r.is_empty());
                for (i, r) in c.iter().enumerate() {
                    if Some(i) != last && !r.is_empty() {
                        assert_eq!(r.len() % CHUNK_GRANULE, 0, "world {world} len {len}: {c:?}");
                    }
                }
            }
        }
        // Small buffers: rank 0 reduces everything, the others have nothing to do.
        assert_eq!(chunk_ranges(3, 4), vec![0..3, 3..3, 3..3, 3..3]);
        assert_eq!(chunk_ranges(1000, 2), vec![0..512, 512..1000]);
    }

    #[test]
    fn nccl_only_for_distinct_gpus_that_it_can_serve() {
        let yes = || true;
        assert_eq!(choose_transport(&[0, 1], false, yes), Transport::Nccl);
        assert_eq!(choose_transport(&[3, 1, 2], false, yes), Transport::Nccl);
        assert_eq!(choose_transport(&[0, 1], true, yes), Transport::Copies, "forced");
        assert_eq!(choose_transport(&[0, 0], false, yes), Transport::Copies, "one GPU twice");
        assert_eq!(choose_transport(&[0, 1, 0], false, yes), Transport::Copies, "one GPU twice");
        assert_eq!(choose_transport(&[0], false, yes), Transport::Copies, "nothing to exchange");
        assert_eq!(choose_transport(&[0, 1], false, || false), Transport::Copies, "no usable NCCL");
        // The library is not even probed when the answer is already known.
        let probed = std::cell::Cell::new(false);
        choose_transport(&[0, 0], false, || {
            probed.set(true);
            true
        });
        assert!(!probed.get());
    }

    #[test]
    fn a_group_without_gpus_is_an_error() {
        let e = GpuGroup::new(&[], 10, false).err().expect("no ordinals");
        assert!(matches!(e, Error::Config { .. }), "{e}");
        if driver_available().is_err() {
            let e = GpuGroup::new(&[0, 0], 10, false).err().expect("no driver");
            assert!(matches!(e, Error::CudaUnavailable(_)), "{e}");
        }
    }
}
