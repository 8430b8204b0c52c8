//! What the crate's own tests share: the one skip helper ([`skip`]), the count of the
//! heap bytes a thread allocates ([`Counting`], the test build's global allocator), by
//! which the conformance test holds each op's memory account to what it really takes, and
//! (the `mpi` feature) processes of this test executable under `mpirun` ([`mpirun`]), and
//! where the PyTorch reference cases are ([`oracle`]).

#[cfg(feature = "mpi")]
pub(crate) mod mpirun;
pub(crate) mod oracle;
pub(crate) mod skip;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    /// This thread's live heap bytes (what it allocated less what it freed) and their
    /// highest since [`Counting::reset_peak`].
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

/// The system allocator, counting each thread's own allocations: a test measures the
/// bytes an op takes on the thread that runs it, whatever other tests run beside it. A
/// block freed on another thread than the one that made it is counted there (no op here
/// hands its memory across threads while it is measured).
pub(crate) struct Counting;

impl Counting {
    /// This thread's live bytes now.
    pub(crate) fn live() -> isize {
        LIVE.with(Cell::get)
    }

    /// Starts a new peak from the live bytes now.
    pub(crate) fn reset_peak() {
        PEAK.with(|p| p.set(Counting::live()));
    }

    /// The highest live bytes since the last [`Counting::reset_peak`].
    pub(crate) fn peak() -> isize {
        PEAK.with(Cell::get)
    }

    fn add(delta: isize) {
        // `try_with`: a thread's allocations while its thread-locals are torn down are
        // not counted.
        let _ = LIVE.try_with(|l| {
            let now = l.get() + delta;
            l.set(now);
            let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
        });
    }
}

// SAFETY: every call is forwarded to the system allocator with the same layout; the
// counters are plain thread-locals of const initialisers (no allocation, no destructor).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Counting::add(layout.size() as isize);
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Counting::add(layout.size() as isize);
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        Counting::add(-(layout.size() as isize));
        // SAFETY: `ptr` came from this allocator with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Counting::add(new_size as isize - layout.size() as isize);
        // SAFETY: as `alloc` and `dealloc`: the caller's contract is System's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// The path by which the test harness names test `name` of the module `module` (a
/// `module_path!()`): the module path without the crate's name, as `--exact` wants it when
/// a test runs its own executable again.
#[cfg(any(feature = "cuda", feature = "mpi"))]
pub(crate) fn test_path(module: &str, name: &str) -> String {
    let inside = module.split_once("::").map_or("", |(_, rest)| rest);
    if inside.is_empty() {
        name.to_string()
    } else {
        format!("{inside}::{name}")
    }
}

/// `n` values uniform in [−1, 1), from the stream of `seed` (`rng::SplitMix64`).
#[cfg(feature = "cuda")]
pub(crate) fn uniform(seed: u64, n: usize) -> Vec<f32> {
    let mut g = crate::rng::SplitMix64::new(seed);
    (0..n).map(|_| g.next_f32() * 2.0 - 1.0).collect()
}

/// `got` and `want` equal bit for bit (so −0 is not 0, and a NaN matches only its own bits).
#[track_caller]
#[cfg(feature = "cuda")]
pub(crate) fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}]: got {g}, want {w}");
    }
}

/// `got` and `want` equal bit for bit, but that a NaN matches any NaN: IEEE 754 leaves a
/// NaN's sign and payload to the order of the operands, which a compiler may swap in a
/// commutative product (so the CPU's vector loop and a kernel's scalar code may differ
/// there, and only there).
#[track_caller]
#[cfg(feature = "cuda")]
pub(crate) fn assert_same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()), "{what}[{i}]: got {g}, want {w}");
    }
}

/// |got − want| ≤ atol + rtol·|want| for every value (`want` in f64, a reference computed
/// from the same f32 inputs).
#[track_caller]
#[cfg(feature = "cuda")]
pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= atol + rtol * w.abs(),
            "{what}[{i}]: got {g}, want {w} (|err| {err:e} > {atol:e} + {rtol:e}·|want|)"
        );
    }
}

/// A model of two inputs: tokens (t) embedded from `vocab` and positions (t) embedded from
/// t, each `width` wide, added. What the tests of several model inputs share.
pub(crate) fn tokens_and_positions(t: usize, vocab: usize, width: usize) -> crate::nn::Graph {
    use crate::nn::{Call, Embedding, Value};
    let tokens = Value::input([t]);
    let positions = tokens.another_input("positions", [t]);
    let tok = Embedding::new(vocab, width).unwrap().call(&tokens);
    let pos = Embedding::new(t, width).unwrap().call(&positions);
    (&tok + &pos).model().unwrap()
}
