//! What a program that runs lockstep under mimalloc tells it: the `lockstep` binary
//! (src/main.rs) and the Python package's native module (python/src/lib.rs) each choose
//! mimalloc as their global allocator, which a library must not do for its users, and
//! call [`keep_freed_pages`] before anything else.

/// mimalloc's `mi_option_purge_delay`: 15 in its `mimalloc.h` enum, in v3 (which
/// libmimalloc-sys builds by default; a test below reads the option's default there) as in
/// v2. By default freed pages go back to the kernel after a delay (1 s in v3, 10 ms in
/// v2), and a buffer a step frees and allocates again later than that is faulted back in
/// zeroed (measured under v2: 5% of the GPT's step in the kernel's `clear_page`). -1:
/// never purge; a run's memory stays at its peak, which the estimate sizes anyway.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed pages for the next step (mimalloc's purge delay set to never): mimalloc's own
/// setting, whichever allocator the program chose.
pub fn keep_freed_pages() {
    // SAFETY: mi_option_set(mi_option_t, long) sets a process-wide option; any value is
    // valid for the purge delay, and it only changes when freed memory is returned.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Option 15 of the linked mimalloc is the purge delay: its default there, 1000 ms
    /// (v3's, and no other option's), reads back, and then the value that keeps pages.
    #[test]
    fn the_option_set_is_mimallocs_purge_delay() {
        // SAFETY: mi_option_get(mi_option_t) reads a process-wide option.
        let get = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(get(), 1000, "option {MI_OPTION_PURGE_DELAY} is not mimalloc's purge delay");
        }
        keep_freed_pages();
        assert_eq!(get(), -1);
    }
}
