//! One member's NCCL communicator (NCCL calls a member a rank), as a raw handle in
//! non-blocking mode.
//!
//! Owns: the few NCCL calls [`super::gpu`] makes (create, query, all-reduce, broadcast,
//! all-gather, abort) and the `unsafe` they need. What to call when, the streams, the events and the
//! locking are [`super::gpu`]'s job.
//!
//! Why not cudarc's safe `Comm`: its handle is private, so no other thread could ever
//! call `ncclCommAbort` on it, and its `Drop` aborts unconditionally and panics when
//! that fails, so a communicator aborted by someone else would be aborted twice (a
//! use after free). The group needs the opposite: the handle lives in the group, any
//! thread may abort it, and whoever takes it out of the group's slot frees it, once.
//!
//! Why non-blocking (`config.blocking = 0`): a blocking `ncclCommInitRank` waits inside
//! NCCL, with no handle to abort, for members that may never come; a blocking collective
//! may wait inside NCCL while it connects to its peers. In non-blocking mode every call
//! but `ncclCommAbort` returns at once, possibly with `ncclInProgress`, and the caller
//! polls `ncclCommGetAsyncError`, checking its own abort flag between polls.
//!
//! Why our own function table (loaded from the library cudarc opened) instead of cudarc's
//! `sys` functions: those return cudarc's `ncclResult_t`, a Rust enum generated from the
//! NCCL 2.22 headers, whose last value 8 is `ncclNumResults`. NCCL 2.30 added
//! `ncclTimeout = 8` (its nccl.h.in: `ncclTimeout = 8, ncclNumResults = 9`), so a newer
//! library's timeout would read as `ncclNumResults`, and any later code would be an
//! invalid enum value, undefined behaviour in Rust. Here every result is a plain C `int`,
//! named by number in [`result_name`], and a failure carries NCCL's own text
//! (`ncclGetLastError`) in [`Error::Nccl`].

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::nccl::sys;

use crate::error::{Error, Result};

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

/// `ncclSuccess` and `ncclInProgress`, the two results that are not failures.
const SUCCESS: c_int = 0;
const IN_PROGRESS: c_int = 7;

/// The name of `ncclResult_t` value `code`, by number, from NCCL 2.30's nccl.h.in
/// (0..=8; `ncclNumResults` = 9 is a count, not a result). A code past the table comes
/// from a newer NCCL and is named as such, never shown as some other value.
pub(crate) fn result_name(code: i32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "unknown result (not in NCCL 2.30's ncclResult_t)",
    }
}

/// The error of NCCL call `call` that returned `code`, with NCCL's message for it.
pub(super) fn failure(call: &'static str, code: i32, message: String) -> Error {
    Error::Nccl { call, code, name: result_name(code), message }
}

/// NCCL's entry points as C declares them (nccl.h), every `ncclResult_t` a plain `int`.
struct Api {
    // ncclResult_t ncclGetVersion(int* version)
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    // ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId)
    get_unique_id: unsafe extern "C" fn(*mut sys::ncclUniqueId) -> c_int,
    // ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId,
    //                                     int rank, ncclConfig_t* config)
    init_rank_config:
        unsafe extern "C" fn(*mut sys::ncclComm_t, c_int, sys::ncclUniqueId, c_int, *mut sys::ncclConfig_t) -> c_int,
    // ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError)
    get_async_error: unsafe extern "C" fn(sys::ncclComm_t, *mut c_int) -> c_int,
    // ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
    //                            ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
    //                            cudaStream_t stream)
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        sys::ncclDataType_t,
        sys::ncclRedOp_t,
        sys::ncclComm_t,
        sys::cudaStream_t,
    ) -> c_int,
    // ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
    //                            ncclDataType_t datatype, int root, ncclComm_t comm,
    //                            cudaStream_t stream)
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        sys::ncclDataType_t,
        c_int,
        sys::ncclComm_t,
        sys::cudaStream_t,
    ) -> c_int,
    // ncclResult_t ncclCommAbort(ncclComm_t comm)
    abort: unsafe extern "C" fn(sys::ncclComm_t) -> c_int,
    // ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
    //                            ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        sys::ncclDataType_t,
        sys::ncclComm_t,
        sys::cudaStream_t,
    ) -> c_int,
    // const char* ncclGetLastError(ncclComm_t comm) (NCCL 2.13 and later)
    get_last_error: Option<unsafe extern "C" fn(sys::ncclComm_t) -> *const c_char>,
    // const char* ncclGetErrorString(ncclResult_t result)
    get_error_string: Option<unsafe extern "C" fn(c_int) -> *const c_char>,
}

/// The function table, from the NCCL library cudarc's loader opens (the same handle, so
/// the same library as `cuda::probe::nccl_status()` found). A missing library or entry
/// point is [`Error::CudaUnavailable`], never a panic.
fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    let api = API.get_or_init(|| {
        // SAFETY: a dlopen probe of the candidate names cudarc's loader tries, nothing more.
        if !unsafe { sys::is_culib_present() } {
            return Err("NCCL not found (cuda::probe::nccl_status says what to do)".to_string());
        }
        // SAFETY: the library is present (checked above), so cudarc's loader opens it
        // instead of panicking; the handle lives for the process ('static).
        let lib = unsafe { sys::culib() };
        /// One entry point, copied out of its `Symbol` (valid while `lib` lives: always).
        fn get<F: Copy>(lib: &'static libloading::Library, name: &str) -> std::result::Result<F, String> {
            // SAFETY: F is the C signature of `name` written beside each field of `Api`.
            unsafe { lib.get::<F>(name.as_bytes()) }.map(|s| *s).map_err(|e| format!("NCCL lacks {name}: {e}"))
        }
        Ok(Api {
            get_version: get(lib, "ncclGetVersion")?,
            get_unique_id: get(lib, "ncclGetUniqueId")?,
            init_rank_config: get(lib, "ncclCommInitRankConfig")?,
            get_async_error: get(lib, "ncclCommGetAsyncError")?,
            all_reduce: get(lib, "ncclAllReduce")?,
            broadcast: get(lib, "ncclBroadcast")?,
            abort: get(lib, "ncclCommAbort")?,
            all_gather: get(lib, "ncclAllGather")?,
            get_last_error: get(lib, "ncclGetLastError").ok(),
            get_error_string: get(lib, "ncclGetErrorString").ok(),
        })
    });
    api.as_ref().map_err(|e| Error::CudaUnavailable(e.clone()))
}

/// A C string NCCL owns, copied; empty for NULL.
fn c_text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: NCCL returns NUL-terminated strings that stay valid at least until its next
    // call on this thread; the text is copied at once.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().trim().to_string()
}

/// Checks the result of NCCL call `call`: Ok for success and in-progress, otherwise the
/// error with NCCL's last message (about `comm`, or the process's when `comm` is NULL),
/// or, when NCCL gave none, its description of the code.
fn check(api: &Api, call: &'static str, code: c_int, comm: sys::ncclComm_t) -> Result<State> {
    match code {
        SUCCESS => Ok(State::Ready),
        IN_PROGRESS => Ok(State::Pending),
        _ => {
            // SAFETY: const char* ncclGetLastError(ncclComm_t) accepts NULL or a live
            // communicator (the callers pass one they hold); it only reads NCCL's state.
            let mut message = api.get_last_error.map(|f| c_text(unsafe { f(comm) })).unwrap_or_default();
            if message.is_empty() {
                // SAFETY: const char* ncclGetErrorString(ncclResult_t) takes any value and
                // returns a static string (NCCL's "unknown result code" for one it lacks).
                message = api.get_error_string.map(|f| c_text(unsafe { f(code) })).unwrap_or_default();
            }
            Err(failure(call, code, message))
        }
    }
}

/// The version of the NCCL library that loads (e.g. 22_703 for 2.27.3).
/// Call only when `cuda::probe::nccl_status()` says NCCL is available.
pub(super) fn version() -> Result<i32> {
    let api = api()?;
    let mut v: c_int = 0;
    // SAFETY: ncclGetVersion(int*): `v` is a valid out-pointer.
    let r = unsafe { (api.get_version)(&mut v) };
    check(api, "ncclGetVersion", r, std::ptr::null_mut())?;
    Ok(v)
}

/// A fresh rendezvous id for one communicator of several members.
pub(super) fn unique_id() -> Result<sys::ncclUniqueId> {
    let api = api()?;
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: ncclGetUniqueId(ncclUniqueId*): `id` is a valid, writable ncclUniqueId.
    let r = unsafe { (api.get_unique_id)(&mut id) };
    check(api, "ncclGetUniqueId", r, std::ptr::null_mut())?;
    Ok(id)
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
    /// Starts creating member `member` of a communicator of `members` on the device of
    /// the CUDA context current on this thread. Returns at once; the handle can be
    /// queried (and aborted) while the other members join.
    pub(super) fn init(members: usize, member: usize, id: sys::ncclUniqueId) -> Result<(RawComm, State)> {
        const CALL: &str = "ncclCommInitRankConfig";
        let api = api()?;
        // NCCL's own names for them: nranks, rank.
        let (Ok(nranks), Ok(rank)) = (i32::try_from(members), i32::try_from(member)) else {
            return Err(failure(CALL, 4, format!("member {member} of {members} does not fit an int")));
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
        // SAFETY: ncclCommInitRankConfig(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*):
        // `comm` and `config` are valid for writes/reads for the call; NCCL copies the
        // config. In non-blocking mode the call returns at once and sets `comm`.
        let r = unsafe { (api.init_rank_config)(&mut comm, nranks, id, rank, &mut config) };
        match check(api, CALL, r, comm) {
            Ok(s) if !comm.is_null() => Ok((RawComm(comm), s)),
            Ok(_) => Err(failure(CALL, 3, "returned success without a communicator".to_string())),
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
    pub(super) fn state(&self) -> Result<State> {
        const CALL: &str = "ncclCommGetAsyncError";
        let api = api()?;
        let mut async_state: c_int = SUCCESS;
        // SAFETY: ncclCommGetAsyncError(ncclComm_t, ncclResult_t*): self.0 is a live
        // communicator (only `abort`, which consumes self, frees it); the out-value is a
        // C int, read as such whatever code a newer NCCL writes.
        let r = unsafe { (api.get_async_error)(self.0, &mut async_state) };
        check(api, CALL, r, self.0)?;
        check(api, CALL, async_state, self.0)
    }

    /// Enqueues an in-place SUM all-reduce of `count` f32 at `buf` on `stream`.
    ///
    /// # Safety
    /// `buf` must hold `count` f32 on this communicator's device, stay allocated until the
    /// operation has run on `stream`, and `stream` must belong to that device.
    pub(super) unsafe fn all_reduce_sum_f32(&self, buf: CUdeviceptr, count: usize, stream: CUstream) -> Result<State> {
        let api = api()?;
        // SAFETY: the caller's contract; in place (send = receive) is allowed by NCCL.
        let r = unsafe {
            (api.all_reduce)(
                buf as *const c_void,
                buf as *mut c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.0,
                stream as sys::cudaStream_t,
            )
        };
        check(api, "ncclAllReduce", r, self.0)
    }

    /// Enqueues an in-place broadcast of `count` f32 at `buf` from member `root`.
    ///
    /// # Safety
    /// As for [`RawComm::all_reduce_sum_f32`].
    pub(super) unsafe fn broadcast_f32(
        &self,
        buf: CUdeviceptr,
        count: usize,
        root: usize,
        stream: CUstream,
    ) -> Result<State> {
        const CALL: &str = "ncclBroadcast";
        let api = api()?;
        let root = i32::try_from(root).map_err(|_| failure(CALL, 4, format!("root {root} does not fit an int")))?;
        // SAFETY: the caller's contract; in place (send = receive) is allowed by NCCL.
        let r = unsafe {
            (api.broadcast)(
                buf as *const c_void,
                buf as *mut c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                root,
                self.0,
                stream as sys::cudaStream_t,
            )
        };
        check(api, CALL, r, self.0)
    }

    /// Enqueues an in-place all-gather of `count` bytes per member: `buf` holds
    /// members·count bytes, this member's at `member·count` (NCCL's in-place form: the
    /// send buffer is the receive buffer's part of this member), every part to every
    /// member.
    ///
    /// # Safety
    /// `buf` must hold members·count bytes on this communicator's device, stay allocated
    /// until the operation has run on `stream`, and `stream` must belong to that device.
    pub(super) unsafe fn all_gather_u8(
        &self,
        buf: CUdeviceptr,
        member: usize,
        count: usize,
        stream: CUstream,
    ) -> Result<State> {
        let api = api()?;
        let send = buf + (member * count) as CUdeviceptr;
        // SAFETY: the caller's contract; send = recv + member·count is NCCL's in-place
        // form.
        let r = unsafe {
            (api.all_gather)(
                send as *const c_void,
                buf as *mut c_void,
                count,
                sys::ncclDataType_t::ncclUint8,
                self.0,
                stream as sys::cudaStream_t,
            )
        };
        check(api, "ncclAllGather", r, self.0)
    }

    /// Frees the communicator without waiting for its peers; kernels of its pending
    /// operations stop early. Errors are ignored: there is nothing left to do with the
    /// handle, and this runs on error and teardown paths.
    pub(super) fn abort(self) {
        if let Ok(api) = api() {
            // SAFETY: ncclCommAbort(ncclComm_t): self.0 is live and, `self` being
            // consumed, never used again.
            let _ = unsafe { (api.abort)(self.0) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_result_of_nccl_2_30_is_named_by_number() {
        // nccl.h.in of NCCL 2.30: ncclSuccess = 0 ... ncclInProgress = 7, ncclTimeout = 8.
        let want = [
            "ncclSuccess",
            "ncclUnhandledCudaError",
            "ncclSystemError",
            "ncclInternalError",
            "ncclInvalidArgument",
            "ncclInvalidUsage",
            "ncclRemoteError",
            "ncclInProgress",
            "ncclTimeout",
        ];
        for (code, name) in want.iter().enumerate() {
            assert_eq!(result_name(code as i32), *name, "code {code}");
        }
    }

    #[test]
    fn a_code_newer_than_the_table_is_named_unknown_with_its_number() {
        // 9 is ncclNumResults in 2.30 (a count, never returned); 42 and -1 stand for
        // whatever a later NCCL may add.
        for code in [9, 42, -1] {
            let e = failure("ncclAllReduce", code, String::new()).to_string();
            assert_eq!(
                e,
                format!("NCCL ncclAllReduce: unknown result (not in NCCL 2.30's ncclResult_t) (ncclResult_t {code})")
            );
        }
    }

    #[test]
    fn the_error_carries_the_call_the_name_and_nccls_message() {
        let e = failure("ncclCommGetAsyncError", 8, "NET/IB : peer rank 1 timed out".to_string()).to_string();
        assert_eq!(e, "NCCL ncclCommGetAsyncError: ncclTimeout (ncclResult_t 8): NET/IB : peer rank 1 timed out");
        let e = failure("ncclCommInitRankConfig", 2, String::new()).to_string();
        assert_eq!(e, "NCCL ncclCommInitRankConfig: ncclSystemError (ncclResult_t 2)");
    }
}
