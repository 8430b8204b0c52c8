//! The world over MPI (the `mpi` feature): initialisation, the one door through which
//! this process talks to MPI, waits that never hang, and failure notices.
//!
//! Owns every MPI call of the library except the exchange's own messages, which
//! `exchange::mpi` posts through the same door ([`Port`]). The rules, and why:
//!
//! - **One thread at a time.** MPI is initialised at `MPI_THREAD_SERIALIZED`: any
//!   thread may call it, never two at once. Every call goes through [`Port`], which lives
//!   behind this world's mutex: the coordinator holds it for its collectives between
//!   steps, the exchange's leading device thread during a step's sum. (rsmpi's
//!   communicators are not `Send`; the handles here are MPI's own, `MPI_COMM_WORLD` and
//!   requests, which `MPI_THREAD_SERIALIZED` lets any thread use under that mutex.)
//! - **No blocking call.** Every operation is non-blocking and completed by [`MpiWorld::wait`],
//!   which polls it together with a receive posted at start-up for failure notices, the
//!   liveness of the processes on this machine and of the launcher, and a timeout: a
//!   process that fails tells the others ([`MpiWorld::fail`]), and they leave whatever
//!   collective they were in, within milliseconds, with its message. (rsmpi's scoped
//!   requests abort the process when dropped unfinished; a wait that gives up must leave
//!   its buffers to MPI instead, so they are leaked, never freed under it.)
//! - **After a failure, no more MPI.** A process that failed or was told of a failure
//!   makes no further MPI call and skips `MPI_Finalize` (a rendezvous that the failed
//!   process would never join); the launcher ends the job when the processes exit.
//!
//! What Open MPI does on its own, measured on this project's machine (Open MPI 4.1.4):
//! when a process is killed, `mpirun` sends SIGTERM to the others, then SIGKILL one
//! second later (`odls_base_sigkill_timeout`), ending the job about 2.3 s after the kill;
//! the liveness check here makes the survivors on the same machine leave first, naming
//! the dead process. On Ctrl-C `mpirun` sends SIGTERM (it cannot forward SIGINT) and
//! exits at once; [`stop_on_signals`] makes that SIGTERM stop the run as Ctrl-C does.

use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::ffi;
use mpi::traits::Communicator;
use parking_lot::{Mutex, MutexGuard};

use super::launch::Launch;
use super::wait::WaitPolicy;
use super::TIMEOUT_VAR;
use crate::digest::Fnv1a;
use crate::error::{Error, Result};

/// The tag of failure notices.
const TAG_NOTICE: c_int = 0x4c53;
/// Bytes of a notice: the sender's process (u32), the text's length (u32), the text.
const NOTICE_BYTES: usize = 2048;
/// How often a wait looks at the other processes and the launcher.
const LIVENESS_EVERY: Duration = Duration::from_millis(50);
/// How long a wait that found a process gone still polls its requests: a process that
/// did its part of a collective and exited (a refusal every process reached) leaves
/// messages that complete it.
const LOSS_GRACE: Duration = Duration::from_millis(100);
/// The default wait timeout: longer than any step or data load of a sane run, short of
/// forever.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a failing process waits for its notices to leave.
const NOTICE_DEADLINE: Duration = Duration::from_secs(2);

/// A type MPI moves as its own datatype.
pub(crate) trait Scalar: Copy {
    fn datatype() -> ffi::MPI_Datatype;
}

impl Scalar for f32 {
    fn datatype() -> ffi::MPI_Datatype {
        // SAFETY: a constant rsmpi's C shim initialises at load time.
        unsafe { ffi::RSMPI_FLOAT }
    }
}

impl Scalar for u64 {
    fn datatype() -> ffi::MPI_Datatype {
        // SAFETY: as for f32.
        unsafe { ffi::RSMPI_UINT64_T }
    }
}

impl Scalar for u16 {
    fn datatype() -> ffi::MPI_Datatype {
        // SAFETY: as for f32.
        unsafe { ffi::RSMPI_UINT16_T }
    }
}

impl Scalar for i8 {
    fn datatype() -> ffi::MPI_Datatype {
        // SAFETY: as for f32.
        unsafe { ffi::RSMPI_INT8_T }
    }
}

impl Scalar for u8 {
    fn datatype() -> ffi::MPI_Datatype {
        // SAFETY: as for f32.
        unsafe { ffi::RSMPI_UINT8_T }
    }
}

fn comm_world() -> ffi::MPI_Comm {
    // SAFETY: a constant rsmpi's C shim initialises at load time.
    unsafe { ffi::RSMPI_COMM_WORLD }
}

/// A request that has not been posted (or has completed).
pub(crate) fn null_request() -> ffi::MPI_Request {
    // SAFETY: a constant rsmpi's C shim initialises at load time.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

fn count(n: usize, what: &str) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| Error::Mpi(format!("{what}: {n} values is more than one MPI call moves")))
}

fn check(code: c_int, call: &str) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error::Mpi(format!("{call} failed with error code {code}")))
    }
}

/// The door to MPI: whoever holds it (under [`MpiWorld::port`]'s mutex) is the one
/// thread calling MPI. It holds the receive posted for failure notices.
pub(crate) struct Port {
    notice: ffi::MPI_Request,
    notice_buf: Box<[u8]>,
    /// The notices this process sent; never freed (a send may be in flight at exit).
    sent: Vec<Box<[u8]>>,
}

// SAFETY: a Port holds MPI request handles (pointers into the MPI library) and buffers
// MPI may write. MPI was initialised at MPI_THREAD_SERIALIZED, which allows any thread to
// make MPI calls provided no two do so at once; a Port is only ever reached through the
// world's mutex (`MpiWorld::port`), so whichever thread holds it is the only one calling.
unsafe impl Send for Port {}

impl Port {
    /// Posts `isend` of `buf` to `peer` with `tag`.
    ///
    /// # Safety
    /// `buf` must stay allocated and unwritten until the request completes in
    /// [`MpiWorld::wait`], or be leaked if that wait fails.
    pub(crate) unsafe fn isend<T: Scalar>(&mut self, buf: &[T], peer: usize, tag: c_int) -> Result<ffi::MPI_Request> {
        let mut req = null_request();
        let n = count(buf.len(), "MPI_Isend")?;
        // SAFETY: `buf` holds `n` values of the datatype; the caller keeps it alive.
        let code = unsafe {
            ffi::MPI_Isend(buf.as_ptr() as *const c_void, n, T::datatype(), peer as c_int, tag, comm_world(), &mut req)
        };
        check(code, "MPI_Isend").map(|()| req)
    }

    /// Posts `irecv` into `buf` from `peer` with `tag`.
    ///
    /// # Safety
    /// `buf` must stay allocated, and be neither read nor written, until the request
    /// completes in [`MpiWorld::wait`], or be leaked if that wait fails.
    pub(crate) unsafe fn irecv<T: Scalar>(
        &mut self,
        buf: &mut [T],
        peer: usize,
        tag: c_int,
    ) -> Result<ffi::MPI_Request> {
        let mut req = null_request();
        let n = count(buf.len(), "MPI_Irecv")?;
        // SAFETY: `buf` holds room for `n` values; the caller keeps it alive and untouched.
        let code = unsafe {
            ffi::MPI_Irecv(
                buf.as_mut_ptr() as *mut c_void,
                n,
                T::datatype(),
                peer as c_int,
                tag,
                comm_world(),
                &mut req,
            )
        };
        check(code, "MPI_Irecv").map(|()| req)
    }

    /// Posts `MPI_Iallgather` of `send` into `recv` (`size` times as long).
    ///
    /// # Safety
    /// As [`Port::isend`] for `send` and [`Port::irecv`] for `recv`.
    unsafe fn iallgather<T: Scalar>(&mut self, send: &[T], recv: &mut [T]) -> Result<ffi::MPI_Request> {
        let mut req = null_request();
        let n = count(send.len(), "MPI_Iallgather")?;
        // SAFETY: `send` holds `n` values, `recv` room for `n` per process; both live on.
        let code = unsafe {
            ffi::MPI_Iallgather(
                send.as_ptr() as *const c_void,
                n,
                T::datatype(),
                recv.as_mut_ptr() as *mut c_void,
                n,
                T::datatype(),
                comm_world(),
                &mut req,
            )
        };
        check(code, "MPI_Iallgather").map(|()| req)
    }

    /// Posts `MPI_Ibcast` of `buf` from `root`.
    ///
    /// # Safety
    /// As [`Port::irecv`] for `buf`.
    unsafe fn ibcast(&mut self, buf: &mut [u8], root: usize) -> Result<ffi::MPI_Request> {
        let mut req = null_request();
        let n = count(buf.len(), "MPI_Ibcast")?;
        // SAFETY: `buf` holds `n` bytes and lives on.
        let code = unsafe {
            ffi::MPI_Ibcast(buf.as_mut_ptr() as *mut c_void, n, u8::datatype(), root as c_int, comm_world(), &mut req)
        };
        check(code, "MPI_Ibcast").map(|()| req)
    }

    #[cfg(feature = "cli")]
    fn ibarrier(&mut self) -> Result<ffi::MPI_Request> {
        let mut req = null_request();
        // SAFETY: no buffer; `req` is ours.
        let code = unsafe { ffi::MPI_Ibarrier(comm_world(), &mut req) };
        check(code, "MPI_Ibarrier").map(|()| req)
    }

    /// Posts the receive of failure notices, from any process.
    fn listen(&mut self) -> Result<()> {
        let n = count(self.notice_buf.len(), "notice")?;
        // SAFETY: the buffer is owned by the Port, which lives in the world for the rest
        // of the process (a static), so it outlives the request.
        let code = unsafe {
            ffi::MPI_Irecv(
                self.notice_buf.as_mut_ptr() as *mut c_void,
                n,
                u8::datatype(),
                ffi::RSMPI_ANY_SOURCE,
                TAG_NOTICE,
                comm_world(),
                &mut self.notice,
            )
        };
        check(code, "MPI_Irecv")
    }

    /// The notice received, if one has arrived: (sender, text).
    fn notice(&mut self) -> Result<Option<(usize, String)>> {
        if self.notice == null_request() {
            return Ok(None);
        }
        let mut flag: c_int = 0;
        // SAFETY: `notice` is a live request of ours; the status is ignored.
        check(unsafe { ffi::MPI_Test(&mut self.notice, &mut flag, ffi::RSMPI_STATUS_IGNORE) }, "MPI_Test")?;
        if flag == 0 {
            return Ok(None);
        }
        Ok(Some(decode_notice(&self.notice_buf)))
    }
}

/// `[sender process u32 | text length u32 | text]`, the text cut to fit.
fn encode_notice(process: usize, text: &str) -> Box<[u8]> {
    let mut cut = text.len().min(NOTICE_BYTES - 8);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut buf = vec![0u8; NOTICE_BYTES];
    buf[..4].copy_from_slice(&(process as u32).to_le_bytes());
    buf[4..8].copy_from_slice(&(cut as u32).to_le_bytes());
    buf[8..8 + cut].copy_from_slice(&text.as_bytes()[..cut]);
    buf.into_boxed_slice()
}

fn decode_notice(buf: &[u8]) -> (usize, String) {
    let word = |at: usize| u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
    let len = word(4).min(buf.len() - 8);
    (word(0), String::from_utf8_lossy(&buf[8..8 + len]).into_owned())
}

/// True once every request of `reqs` has completed (completed ones become null).
fn test_all(reqs: &mut [ffi::MPI_Request]) -> Result<bool> {
    if reqs.is_empty() {
        return Ok(true);
    }
    let mut flag: c_int = 0;
    let n = count(reqs.len(), "MPI_Testall")?;
    // SAFETY: `reqs` are live or null requests of ours; statuses are ignored.
    check(unsafe { ffi::MPI_Testall(n, reqs.as_mut_ptr(), &mut flag, ffi::RSMPI_STATUSES_IGNORE) }, "MPI_Testall")?;
    Ok(flag != 0)
}

/// Another process, as this one knows it.
struct Peer {
    process: usize,
    pid: u32,
    same_host: bool,
}

/// What this process knows of failures.
#[derive(Default)]
struct Failures {
    /// The first failure reported by another process, or the loss of one.
    peer: Option<Error>,
    /// This process's own failure was announced.
    told: bool,
}

/// The MPI world of this process; lives in `world::WORLD` for the rest of the process.
pub(crate) struct MpiWorld {
    /// Finalised by [`MpiWorld::finalize`], never after a failure.
    universe: Mutex<Option<mpi::environment::Universe>>,
    process: usize,
    size: usize,
    port: Mutex<Port>,
    peers: Vec<Peer>,
    /// The launcher's process (this one's parent) at start.
    parent: u32,
    timeout: Option<Duration>,
    failures: Mutex<Failures>,
    /// No MPI call may be made any more.
    broken: AtomicBool,
    library: String,
    host: String,
}

impl MpiWorld {
    /// `MPI_Init_thread` at `MPI_THREAD_SERIALIZED`, the notice receive, and who runs
    /// where (every process's pid and machine, to watch the ones on this machine).
    pub(crate) fn init(launch: &Launch) -> Result<MpiWorld> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| Error::Mpi("MPI was already initialised by someone else in this process".into()))?;
        if threading < mpi::Threading::Serialized {
            return Err(Error::Mpi(format!(
                "the MPI library offers thread level {threading:?}; lockstep needs MPI_THREAD_SERIALIZED \
                 (any thread may call MPI, one at a time)"
            )));
        }
        let comm = universe.world();
        let (process, size) = (comm.rank() as usize, comm.size() as usize);
        if (process, size) != (launch.process, launch.size) {
            return Err(Error::Mpi(format!(
                "MPI says this is process {process} of {size}, the launcher's environment says process {} of {}",
                launch.process, launch.size
            )));
        }
        let timeout = match std::env::var(TIMEOUT_VAR) {
            Err(_) => Some(DEFAULT_TIMEOUT),
            Ok(v) => match v.trim().parse::<u64>() {
                Ok(0) => None,
                Ok(s) => Some(Duration::from_secs(s)),
                Err(_) => return Err(Error::config(TIMEOUT_VAR, format!("'{v}' is not a number of seconds"))),
            },
        };
        let mut port =
            Port { notice: null_request(), notice_buf: vec![0u8; NOTICE_BYTES].into_boxed_slice(), sent: Vec::new() };
        port.listen()?;
        let host = mpi::environment::processor_name().unwrap_or_else(|_| "an unnamed machine".into());
        let library = mpi::environment::library_version()
            .map(|v| v.trim_end_matches('\0').split(',').next().unwrap_or("").trim().to_string())
            .unwrap_or_else(|_| "an MPI library".into());
        let mut world = MpiWorld {
            universe: Mutex::new(Some(universe)),
            process,
            size,
            port: Mutex::new(port),
            peers: Vec::new(),
            parent: std::os::unix::process::parent_id(),
            timeout,
            failures: Mutex::new(Failures::default()),
            broken: AtomicBool::new(false),
            library,
            host,
        };
        let me = [std::process::id() as u64, Fnv1a::new().bytes(world.host.as_bytes()).finish()];
        let all = world.all_gather(&me)?;
        world.peers = (0..size)
            .filter(|&q| q != process)
            .map(|q| Peer { process: q, pid: all[2 * q] as u32, same_host: all[2 * q + 1] == me[1] })
            .collect();
        Ok(world)
    }

    pub(crate) fn process(&self) -> usize {
        self.process
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn library(&self) -> &str {
        &self.library
    }

    pub(crate) fn host(&self) -> &str {
        &self.host
    }

    /// Processes of the world on this machine, this one included.
    pub(crate) fn on_this_host(&self) -> usize {
        1 + self.peers.iter().filter(|p| p.same_host).count()
    }

    /// Whether every other process is on this machine and Open MPI may carry their
    /// messages through shared memory: not when `OMPI_MCA_btl` (which `mpirun --mca btl
    /// ...` sets) leaves out its shared-memory transport (`vader`, or `sm`).
    pub(crate) fn shared_memory(&self) -> bool {
        self.peers.iter().all(|p| p.same_host)
            && btl_allows_shared_memory(std::env::var("OMPI_MCA_btl").ok().as_deref())
    }

    /// The door to MPI, or the failure that closed it.
    pub(crate) fn port(&self) -> Result<MutexGuard<'_, Port>> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(self
                .peer_failure()
                .unwrap_or_else(|| Error::Mpi("this process failed; it makes no more MPI calls".into())));
        }
        Ok(self.port.lock())
    }

    /// Polls `reqs` until all have completed. Leaves early with an error — the requests
    /// then still pending, their buffers the caller's to leak — when another process
    /// reported a failure ([`Error::Peer`]), a process on this machine or the launcher is
    /// gone, nothing completed within the timeout ([`Error::PeerLost`]), or `aborted`
    /// says this process stopped ([`Error::Aborted`]). `how` says whether to spin between
    /// polls (a core each) or to nap at once (more threads than cores).
    pub(crate) fn wait(
        &self,
        port: &mut Port,
        reqs: &mut [ffi::MPI_Request],
        how: WaitPolicy,
        aborted: &dyn Fn() -> bool,
    ) -> Result<()> {
        let start = Instant::now();
        let mut next_look = start + LIVENESS_EVERY;
        let mut polls = 0u32;
        loop {
            if test_all(reqs)? {
                return Ok(());
            }
            if let Some((process, cause)) = port.notice()? {
                return Err(self.record(Error::Peer { process, cause }));
            }
            if aborted() {
                return Err(Error::Aborted);
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(32) {
                let now = Instant::now();
                if now >= next_look {
                    if let Some(lost) = self.loss(now - start) {
                        // What the lost process sent before it went may still complete
                        // these requests: poll a moment longer before giving up.
                        let grace = Instant::now();
                        while grace.elapsed() < LOSS_GRACE {
                            if test_all(reqs)? {
                                return Ok(());
                            }
                            std::thread::yield_now();
                        }
                        return Err(self.record(lost));
                    }
                    next_look = now + LIVENESS_EVERY;
                }
                let waited = now - start;
                // Spin while the answer may be microseconds away (a core each), then
                // yield, then nap: longer once the wait is long (another process is still
                // computing its step), so that a waiting thread costs its core nothing.
                match how {
                    WaitPolicy::Spin if waited < Duration::from_micros(200) => std::hint::spin_loop(),
                    WaitPolicy::Spin if waited < Duration::from_millis(2) => std::thread::yield_now(),
                    WaitPolicy::Park if waited < Duration::from_micros(50) => std::thread::yield_now(),
                    _ if waited < Duration::from_millis(100) => std::thread::sleep(Duration::from_micros(20)),
                    _ => std::thread::sleep(Duration::from_micros(200)),
                }
            }
        }
    }

    /// Between waits (see `World::watch`): a failure notice, or a process on this
    /// machine or the launcher gone. Takes the door only if it is free: device 0 holds it
    /// during a CPU exchange, whose waits watch the same things.
    pub(crate) fn watch(&self) -> Result<()> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(self
                .peer_failure()
                .unwrap_or_else(|| Error::Mpi("this process makes no more MPI calls".into())));
        }
        if let Some(mut port) = self.port.try_lock() {
            if let Some((process, cause)) = port.notice()? {
                return Err(self.record(Error::Peer { process, cause }));
            }
        }
        match self.loss(Duration::ZERO) {
            Some(lost) => Err(self.record(lost)),
            None => Ok(()),
        }
    }

    /// The loss that ends a wait: a process of the world on this machine, or the
    /// launcher, gone, or the wait past the timeout. Not yet recorded: a process that
    /// finished its part of the last collective and exited may still have left what this
    /// one needs to complete it ([`MpiWorld::wait`] gives it [`LOSS_GRACE`]).
    fn loss(&self, waited: Duration) -> Option<Error> {
        for p in self.peers.iter().filter(|p| p.same_host) {
            if !alive(p.pid) {
                return Some(Error::PeerLost {
                    detail: format!(
                        "process {} (pid {}, on this machine) has exited without a word (killed?); \
                         process {} cannot go on without it",
                        p.process, p.pid, self.process
                    ),
                });
            }
        }
        if std::os::unix::process::parent_id() != self.parent {
            return Some(Error::PeerLost {
                detail: format!(
                    "the launcher of this job (pid {}) has exited; process {} stops",
                    self.parent, self.process
                ),
            });
        }
        if let Some(t) = self.timeout.filter(|t| waited > *t) {
            return Some(Error::PeerLost {
                detail: format!(
                    "process {} waited {} s for the other processes ({TIMEOUT_VAR} sets the limit; 0 for none)",
                    self.process,
                    t.as_secs()
                ),
            });
        }
        None
    }

    /// Keeps the first failure heard of, closes the door to MPI, returns `e`.
    fn record(&self, e: Error) -> Error {
        self.broken.store(true, Ordering::SeqCst);
        let mut f = self.failures.lock();
        match &f.peer {
            Some(first) => clone_failure(first),
            None => {
                f.peer = Some(clone_failure(&e));
                e
            }
        }
    }

    pub(crate) fn peer_failure(&self) -> Option<Error> {
        self.failures.lock().peer.as_ref().map(clone_failure)
    }

    /// See `World::fail`. Notices are sent to every other process; their sends are given
    /// [`NOTICE_DEADLINE`] to leave (a dead peer never takes its own).
    pub(crate) fn fail(&self, process: usize, e: &Error) {
        let quiet = super::agreed(e) || matches!(e, Error::Peer { .. } | Error::PeerLost { .. });
        if quiet {
            self.broken.store(true, Ordering::SeqCst);
            return;
        }
        // A worker's failure already names the process ("process 1, cpu:0, step 5: ...").
        match e {
            Error::Worker { .. } => self.fail_with(process, &e.to_string()),
            other => self.fail_with(process, &format!("process {process}: {other}")),
        }
    }

    /// Tells every other process that this one failed, in `text`, once (nothing after a
    /// failure was already told or heard of), and closes the door to MPI.
    pub(crate) fn fail_with(&self, process: usize, text: &str) {
        {
            let mut f = self.failures.lock();
            if f.told || f.peer.is_some() || self.broken.load(Ordering::SeqCst) {
                self.broken.store(true, Ordering::SeqCst);
                return;
            }
            f.told = true;
        }
        let mut port = self.port.lock();
        let mut reqs = Vec::with_capacity(self.peers.len());
        for p in &self.peers {
            let buf = encode_notice(process, text);
            // SAFETY: the buffer is kept in `port.sent` for the rest of the process.
            if let Ok(r) = unsafe { port.isend(&buf[..], p.process, TAG_NOTICE) } {
                reqs.push(r);
            }
            port.sent.push(buf);
        }
        let start = Instant::now();
        while !test_all(&mut reqs).unwrap_or(true) && start.elapsed() < NOTICE_DEADLINE {
            std::thread::sleep(Duration::from_micros(100));
        }
        self.broken.store(true, Ordering::SeqCst);
    }

    /// Every process's `mine`, in process order.
    pub(crate) fn all_gather(&self, mine: &[u64]) -> Result<Vec<u64>> {
        self.all_gather_waiting(mine, WaitPolicy::Spin, &|| false)
    }

    /// [`MpiWorld::all_gather`] waiting as `how` says, and leaving early once `aborted`.
    pub(crate) fn all_gather_waiting(
        &self,
        mine: &[u64],
        how: WaitPolicy,
        aborted: &dyn Fn() -> bool,
    ) -> Result<Vec<u64>> {
        let mut port = self.port()?;
        let send = mine.to_vec();
        let mut recv = vec![0u64; mine.len() * self.size];
        // SAFETY: both buffers are owned here and leaked below if the wait gives up.
        let mut req = unsafe { port.iallgather(&send, &mut recv)? };
        match self.wait(&mut port, std::slice::from_mut(&mut req), how, aborted) {
            Ok(()) => Ok(recv),
            Err(e) => {
                std::mem::forget((send, recv));
                Err(e)
            }
        }
    }

    pub(crate) fn broadcast(&self, root: usize, buf: &mut [u8]) -> Result<()> {
        let mut port = self.port()?;
        let mut own = buf.to_vec();
        // SAFETY: `own` is owned here and leaked below if the wait gives up.
        let mut req = unsafe { port.ibcast(&mut own, root)? };
        match self.wait(&mut port, std::slice::from_mut(&mut req), WaitPolicy::Spin, &|| false) {
            Ok(()) => {
                buf.copy_from_slice(&own);
                Ok(())
            }
            Err(e) => {
                std::mem::forget(own);
                Err(e)
            }
        }
    }

    #[cfg(feature = "cli")]
    pub(crate) fn barrier(&self) -> Result<()> {
        let mut port = self.port()?;
        let mut req = port.ibarrier()?;
        self.wait(&mut port, std::slice::from_mut(&mut req), WaitPolicy::Spin, &|| false)
    }

    /// `MPI_Finalize`, unless this process failed or heard of a failure.
    pub(crate) fn finalize(&self) {
        if self.broken.load(Ordering::SeqCst) {
            return;
        }
        {
            let mut port = self.port.lock();
            if port.notice != null_request() {
                // SAFETY: a live receive of ours: cancelled, then completed (a notice that
                // arrived meanwhile completes it normally).
                unsafe {
                    ffi::MPI_Cancel(&mut port.notice);
                    ffi::MPI_Wait(&mut port.notice, ffi::RSMPI_STATUS_IGNORE);
                }
            }
        }
        drop(self.universe.lock().take());
    }
}

/// Our errors are not `Clone` (they may hold an io::Error); the failures kept here are
/// the two variants that carry text only.
fn clone_failure(e: &Error) -> Error {
    match e {
        Error::Peer { process, cause } => Error::Peer { process: *process, cause: cause.clone() },
        Error::PeerLost { detail } => Error::PeerLost { detail: detail.clone() },
        other => Error::Mpi(other.to_string()),
    }
}

/// Whether an Open MPI `btl` selection (`self,tcp`, `^tcp`, none) keeps shared memory.
fn btl_allows_shared_memory(btl: Option<&str>) -> bool {
    let shm = |name: &str| matches!(name.trim(), "vader" | "sm");
    match btl.map(str::trim) {
        None | Some("") => true,
        Some(v) => match v.strip_prefix('^') {
            Some(excluded) => !excluded.split(',').any(shm),
            None => v.split(',').any(shm),
        },
    }
}

/// True while process `pid` runs (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // `pid (comm) S ...`: the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|s| s != 'Z' && s != 'X'),
        Err(_) => false,
    }
}

/// SIGTERM and SIGUSR2 raise `flag` (see `World::stop_on_signals`).
pub(crate) fn stop_on_signals(flag: &Arc<AtomicBool>) -> Result<()> {
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGUSR2] {
        signal_hook::flag::register(sig, Arc::clone(flag))
            .map_err(|e| Error::config("signals", format!("cannot handle signal {sig}: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod under_mpirun;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip_and_are_cut_on_a_character() {
        let (process, text) = decode_notice(&encode_notice(3, "process 3, cpu:1, step 5: injected failure"));
        assert_eq!((process, text.as_str()), (3, "process 3, cpu:1, step 5: injected failure"));
        let long = "é".repeat(NOTICE_BYTES);
        let (_, cut) = decode_notice(&encode_notice(0, &long));
        assert_eq!(cut.len(), NOTICE_BYTES - 8);
        assert!(cut.chars().all(|c| c == 'é'));
    }

    #[test]
    fn a_btl_selection_keeps_or_drops_shared_memory() {
        assert!(btl_allows_shared_memory(None));
        assert!(btl_allows_shared_memory(Some("self,vader,tcp")));
        assert!(btl_allows_shared_memory(Some("^tcp")));
        assert!(!btl_allows_shared_memory(Some("self,tcp")));
        assert!(!btl_allows_shared_memory(Some("^vader")));
    }

    #[test]
    fn this_process_is_alive_and_a_pid_past_the_kernels_is_not() {
        assert!(alive(std::process::id()));
        assert!(!alive(u32::MAX));
    }
}
