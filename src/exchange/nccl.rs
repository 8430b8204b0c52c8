//! One rank's NCCL communicator, as a raw handle in non-blocking mode.
//!
//! Owns: the few NCCL calls [`super::gpu`] makes (create, query, all-reduce, broadcast,
//! abort) and the `unsafe` they need. What to call when, the streams, the events and the
//! locking are [`super::gpu`]'s job.
//!
//! Why not cudarc's safe `Comm`: its handle is private, so no other thread could ever
//! call `ncclCommAbort` on it, and its `Drop` aborts unconditionally and panics when
//! that fails, so a communicator aborted by someone else would be aborted twice (a
//! use after free). The group needs the opposite: the handle lives in the group, any
//! thread may abort it, and whoever takes it out of the group's slot frees it, once.
//!
//! Why non-blocking (`config.blocking = 0`): a blocking `ncclCommInitRank` waits inside
//! NCCL, with no handle to abort, for ranks that may never come; a blocking collective
//! may wait inside NCCL while it connects to its peers. In non-blocking mode every call
//! but `ncclCommAbort` returns at once, possibly with `ncclInProgress`, and the caller
//! polls `ncclCommGetAsyncError`, checking its own abort flag between polls.

use std::ffi::c_void;

use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::sys;

/// The oldest NCCL this module accepts: 2.18, the first whose `ncclConfig_t` has every
/// field of the bindings' struct (splitShare came last). Encoded as NCCL_VERSION does
/// for 2.9 and later: major * 10000 + minor * 100 + patch.
pub(super) const MIN_VERSION: i32 = 21_800;

/// The `version` field of the config we pass: the NCCL headers the bindings were made
/// from (cudarc's `nccl-02022` feature, NCCL 2.22.3), which tells a newer library which
/// fields our struct has.
const CONFIG_VERSION: u32 = 22_203;

/// `NCCL_CONFIG_UNDEF_INT`: "let NCCL choose".
const UNDEF_INT: i32 = i32::MIN;

/// The version of the NCCL library that loads (e.g. 22_703 for 2.27.3).
/// Call only when `cuda::probe::nccl_status()` says NCCL is available: cudarc's loader
/// panics when the library is missing.
pub(super) fn version() -> Result<i32, NcclError> {
    cudarc::nccl::result::get_nccl_version()
}

/// A fresh rendezvous id for one communicator of several ranks.
pub(super) fn unique_id() -> Result<sys::ncclUniqueId, NcclError> {
    cudarc::nccl::result::get_uniqueid()
}

/// Where a non-blocking call stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    /// Done (an init), or enqueued on the stream (a collective).
    Ready,
    /// Still in progress: poll [`RawComm::state`] until it is `Ready`, and make no other
    /// call on this communicator nor launch on its stream before.
    Pending,
}

fn state_of(r: sys::ncclResult_t) -> Result<State, NcclError> {
    match r {
        sys::ncclResult_t::ncclSuccess => Ok(State::Ready),
        sys::ncclResult_t::ncclInProgress => Ok(State::Pending),
        other => Err(NcclError(other)),
    }
}

/// A communicator handle. It is freed only by [`RawComm::abort`], which consumes it, so
/// the owner of the value decides when; the group keeps it in a mutex-guarded slot.
#[derive(Debug)]
pub(super) struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator is a heap object of the library, not tied to the thread
// that made it. The group moves the handle into a mutex and every use (enqueue, query,
// abort) happens under that mutex, so two threads never call NCCL on it at once; NCCL
// documents ncclCommAbort as the way to release, from another thread, a communicator
// whose operations hang.
unsafe impl Send for RawComm {}

impl RawComm {
    /// Starts creating rank `rank` of a `world`-rank communicator on the device of the
    /// CUDA context current on this thread. Returns at once; the handle can be queried
    /// (and aborted) while the other ranks join.
    pub(super) fn init(world: usize, rank: usize, id: sys::ncclUniqueId) -> Result<(RawComm, State), NcclError> {
        let (Ok(nranks), Ok(rank)) = (i32::try_from(world), i32::try_from(rank)) else {
            return Err(NcclError(sys::ncclResult_t::ncclInvalidArgument));
        };
        let mut config = sys::ncclConfig_t {
            size: std::mem::size_of::<sys::ncclConfig_t>(),
            magic: 0xcafe_beef,
            version: CONFIG_VERSION,
            blocking: 0,
            cgaClusterSize: UNDEF_INT,
            minCTAs: UNDEF_INT,
            maxCTAs: UNDEF_INT,
            netName: std::ptr::null(),
            splitShare: UNDEF_INT,
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are valid for writes/reads for the call; NCCL copies
        // the config. In non-blocking mode the call returns at once and sets `comm`.
        let r = unsafe { sys::ncclCommInitRankConfig(&mut comm, nranks, id, rank, &mut config) };
        match state_of(r) {
            Ok(s) if !comm.is_null() => Ok((RawComm(comm), s)),
            Ok(_) => Err(NcclError(sys::ncclResult_t::ncclInternalError)),
            Err(e) => {
                if !comm.is_null() {
                    RawComm(comm).abort();
                }
                Err(e)
            }
        }
    }

    /// The state of the last non-blocking call (`ncclCommGetAsyncError`); an error means
    /// the communicator is dead and must be aborted.
    pub(super) fn state(&self) -> Result<State, NcclError> {
        let mut async_state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: self.0 is a live communicator (only `abort`, which consumes self, frees it).
        state_of(unsafe { sys::ncclCommGetAsyncError(self.0, &mut async_state) })?;
        state_of(async_state)
    }

    /// Enqueues an in-place SUM all-reduce of `count` f32 at `buf` on `stream`.
    ///
    /// # Safety
    /// `buf` must hold `count` f32 on this communicator's device, stay allocated until the
    /// operation has run on `stream`, and `stream` must belong to that device.
    pub(super) unsafe fn all_reduce_sum_f32(
        &self,
        buf: CUdeviceptr,
        count: usize,
        stream: CUstream,
    ) -> Result<State, NcclError> {
        // SAFETY: the caller's contract; in place (send = receive) is allowed by NCCL.
        state_of(unsafe {
            sys::ncclAllReduce(
                buf as *const c_void,
                buf as *mut c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.0,
                stream as sys::cudaStream_t,
            )
        })
    }

    /// Enqueues an in-place broadcast of `count` f32 at `buf` from rank `root`.
    ///
    /// # Safety
    /// As for [`RawComm::all_reduce_sum_f32`].
    pub(super) unsafe fn broadcast_f32(
        &self,
        buf: CUdeviceptr,
        count: usize,
        root: usize,
        stream: CUstream,
    ) -> Result<State, NcclError> {
        let root = i32::try_from(root).map_err(|_| NcclError(sys::ncclResult_t::ncclInvalidArgument))?;
        // SAFETY: the caller's contract; in place (send = receive) is allowed by NCCL.
        state_of(unsafe {
            sys::ncclBroadcast(
                buf as *const c_void,
                buf as *mut c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                root,
                self.0,
                stream as sys::cudaStream_t,
            )
        })
    }

    /// Frees the communicator without waiting for its peers; kernels of its pending
    /// operations stop early. Errors are ignored: there is nothing left to do with the
    /// handle, and this runs on error and teardown paths.
    pub(super) fn abort(self) {
        // SAFETY: self.0 is live and, `self` being consumed, never used again.
        let _ = unsafe { sys::ncclCommAbort(self.0) };
    }
}
