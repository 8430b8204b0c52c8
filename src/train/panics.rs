//! A panic on a worker's threads, reported once: as the run's error, never also as the
//! standard hook's message on stderr.
//!
//! Rust's default hook prints every panic where it happens, with a backtrace when
//! `RUST_BACKTRACE` is set. A worker catches its panics and sends them back as
//! `Error::Worker` (`worker.rs`), so a panic in a layer would otherwise be printed twice or
//! more: by the hook on each thread that panicked (the worker's, its pool's), then as the
//! error. Here, once per process, a hook is installed in front of the one already there:
//! on a thread marked as a worker's ([`mark_this_thread`]) it keeps the panic's location,
//! and its backtrace when `RUST_BACKTRACE` asks for one, for [`describe`] to put into the
//! error; on any other thread it hands the panic to the previous hook, untouched.
//!
//! Left to others: catching the unwind (`worker.rs`), marking the threads (`trainer.rs`).

use std::backtrace::{Backtrace, BacktraceStatus};
use std::cell::Cell;
use std::panic::Location;
use std::sync::{Mutex, Once};

thread_local! {
    static WORKER_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Panics of worker threads caught by the hook, not yet described: (message, where and
/// how). A panic on a pool thread is resumed on the worker's with the same payload, so
/// the worker finds its record by the message.
static CAUGHT: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());
/// Records kept at most: a run that panics stops, so a handful is plenty.
const KEPT: usize = 64;

/// Marks the calling thread as a worker's (the worker thread and its pool's threads), and
/// installs the hook once.
pub(crate) fn mark_this_thread() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| match WORKER_THREAD.with(Cell::get) {
            true => keep(info.payload(), info.location()),
            false => previous(info),
        }));
    });
    WORKER_THREAD.with(|w| w.set(true));
}

fn keep(payload: &(dyn std::any::Any + Send), location: Option<&Location<'_>>) {
    let mut detail = match location {
        Some(l) => format!(" at {}:{}:{}", l.file(), l.line(), l.column()),
        None => String::new(),
    };
    // `capture` is what `RUST_BACKTRACE` (or `RUST_LIB_BACKTRACE`) asks for: nothing unset.
    let trace = Backtrace::capture();
    if trace.status() == BacktraceStatus::Captured {
        detail.push_str(&format!("\nbacktrace of the panic:\n{trace}"));
    }
    let mut caught = CAUGHT.lock().unwrap_or_else(|p| p.into_inner());
    if caught.len() == KEPT {
        caught.remove(0);
    }
    caught.push((message(payload), detail));
}

/// The text of a panic's payload (a `&str` or a `String`, as `panic!` makes).
pub(crate) fn message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// "panicked at FILE:LINE:COL: MESSAGE" for a panic a worker caught, with the backtrace
/// after it when one was asked for; the record is consumed.
pub(crate) fn describe(payload: &(dyn std::any::Any + Send)) -> String {
    let text = message(payload);
    let mut caught = CAUGHT.lock().unwrap_or_else(|p| p.into_inner());
    let detail = match caught.iter().position(|(m, _)| *m == text) {
        Some(i) => caught.remove(i).1,
        None => String::new(),
    };
    match detail.split_once('\n') {
        Some((at, trace)) => format!("panicked{at}: {text}\n{trace}"),
        None => format!("panicked{detail}: {text}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marked_threads_panic_is_described_with_its_place_and_not_printed() {
        let payload = std::thread::spawn(|| {
            mark_this_thread();
            std::panic::catch_unwind(|| panic!("layer {} failed", 3)).unwrap_err()
        })
        .join()
        .unwrap();
        let text = describe(payload.as_ref());
        assert!(text.starts_with("panicked at src/train/panics.rs:"), "{text}");
        assert!(text.lines().next().unwrap().ends_with(": layer 3 failed"), "{text}");
        // The record was consumed: a second description has no place.
        assert_eq!(describe(payload.as_ref()), "panicked: layer 3 failed");
    }
}
