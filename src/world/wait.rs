//! How a thread waits for its peers: the threads of an exchange for each other, a
//! process for its next message from the others.
//!
//! Owns [`WaitPolicy`], the one policy every barrier and every message loop of a run follows
//! (`exchange::shm`'s barrier, the device copies' barrier, `world::mpi`'s progress loop),
//! and its choice from the cores this process may take (`world::launch`). It lives with
//! the world, below the exchanges that wait with it and re-export it
//! (`exchange::WaitPolicy`), because the world's own collectives wait the same way.

/// How a thread waits for its peers (in an exchange) or for its next message.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum WaitPolicy {
    /// Spin for a short while, then sleep: when every thread has a core of its own.
    Spin,
    /// Sleep at once: when the threads outnumber the cores, a spinning thread takes the
    /// core from the very thread it waits for.
    Park,
}

impl WaitPolicy {
    /// [`WaitPolicy::Spin`] when `threads` busy threads fit on the cores this process may
    /// take (`devices::available_cores`), [`WaitPolicy::Park`] otherwise.
    pub fn for_threads(threads: usize) -> WaitPolicy {
        if threads <= super::launch::cores_for_this_process() {
            WaitPolicy::Spin
        } else {
            WaitPolicy::Park
        }
    }
}
