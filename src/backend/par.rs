//! Where a device's parallel loops run: in the thread pool of the device the calling
//! thread works for, or on the calling thread alone, never in a pool nobody asked for.
//!
//! A CPU device is a thread pool (`train/trainer.rs`: the worker thread is one of its
//! threads), and the layers' loops are rayon's parallel iterators, which run in "the
//! current pool": the one the calling thread is a worker of, else rayon's global pool,
//! started on first use with a thread per core. In one copy of the library the first is
//! always the case. But a process can hold several copies of it: a Jupyter kernel
//! (evcxr) links the library into each cell's shared object, so a model built in one
//! cell (its layers' code that cell's copy) trains under the trainer of another (its
//! pools the second copy's). Each copy has its own rayon, and rayon knows its pools by a
//! thread-local of its own, so to the layers' copy a worker thread is in no pool: every
//! device's loops went to that copy's global pool, two devices queued on the same
//! threads, and a notebook trained at half the command line's speed.
//!
//! So every loop here first asks whether the calling thread is a worker of one of this
//! copy's pools ([`in_pool`]). If it is, the loop is rayon's, unchanged. If not, the
//! same iterator is run on the calling thread, in order, through rayon's own producer
//! (`with_producer`): no pool is started, and the results are those of any thread count,
//! since every loop's pieces are chosen from the sizes alone (the contract in `cpu.rs`).
//! What such a thread gives up is its device's extra threads (a notebook's
//! `Devices::cpu(n, 1)` has none); the device's own thread does the work.
//!
//! Left to others: the pools themselves (`train/trainer.rs`), what each loop computes
//! (the layers).

use rayon::iter::plumbing::{Producer, ProducerCallback};
use rayon::iter::{IndexedParallelIterator, ParallelIterator};

/// Whether the calling thread is a worker of one of this copy's thread pools.
pub(crate) fn in_pool() -> bool {
    rayon::current_thread_index().is_some()
}

/// The threads the calling thread's work may be split among: its pool's, or 1 outside
/// one (rayon's `current_num_threads` would count the global pool's there).
pub(crate) fn threads() -> usize {
    if in_pool() {
        rayon::current_num_threads()
    } else {
        1
    }
}

/// `iter.for_each(f)`, in the calling thread's pool or on the calling thread alone.
pub(crate) fn for_each<I, F>(iter: I, f: F)
where
    I: IndexedParallelIterator,
    F: Fn(I::Item) + Sync + Send,
{
    if in_pool() {
        iter.for_each(f)
    } else {
        iter.with_producer(Here(|items: &mut dyn Iterator<Item = I::Item>| items.for_each(&f)))
    }
}

/// `iter.for_each_init(init, f)`: outside a pool, one value of `init` for the whole loop.
pub(crate) fn for_each_init<I, T, INIT, F>(iter: I, init: INIT, f: F)
where
    I: IndexedParallelIterator,
    INIT: Fn() -> T + Sync + Send,
    F: Fn(&mut T, I::Item) + Sync + Send,
{
    if in_pool() {
        iter.for_each_init(init, f)
    } else {
        let mut state = init();
        iter.with_producer(Here(|items: &mut dyn Iterator<Item = I::Item>| items.for_each(|x| f(&mut state, x))))
    }
}

/// `iter.map(f).collect()`: the results in the iterator's order either way.
pub(crate) fn map_collect<I, R, F>(iter: I, f: F) -> Vec<R>
where
    I: IndexedParallelIterator,
    R: Send,
    F: Fn(I::Item) -> R + Sync + Send,
{
    if in_pool() {
        iter.map(f).collect()
    } else {
        iter.with_producer(Here(|items: &mut dyn Iterator<Item = I::Item>| items.map(&f).collect()))
    }
}

/// Runs a loop over the items of a rayon producer on the calling thread: the producer's
/// sequential iterator, handed to the closure.
struct Here<G>(G);

impl<T, R, G: FnOnce(&mut dyn Iterator<Item = T>) -> R> ProducerCallback<T> for Here<G> {
    type Output = R;

    fn callback<P: Producer<Item = T>>(self, producer: P) -> R {
        (self.0)(&mut producer.into_iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use rayon::prelude::*;
    use std::sync::Mutex;
    use std::thread::{self, ThreadId};

    /// The threads that ran `loop_` over 64 chunks, and its results.
    fn run(loop_: fn(&mut [u32], &Mutex<Vec<ThreadId>>)) -> (Vec<ThreadId>, Vec<u32>) {
        let seen = Mutex::new(Vec::new());
        let mut xs: Vec<u32> = (0..64 * 1024).collect();
        loop_(&mut xs, &seen);
        (seen.into_inner().unwrap(), xs)
    }

    fn doubled(xs: &mut [u32], seen: &Mutex<Vec<ThreadId>>) {
        for_each(xs.par_chunks_mut(1024), |c| {
            seen.lock().unwrap().push(thread::current().id());
            c.iter_mut().for_each(|x| *x *= 2);
        })
    }

    #[test]
    fn outside_a_pool_a_loop_runs_on_the_calling_thread_in_order() {
        // A plain thread is in none of this copy's pools, as a worker of another copy's is.
        let (seen, xs) = thread::spawn(|| {
            assert!(!in_pool());
            assert_eq!(threads(), 1);
            let (seen, xs) = run(doubled);
            assert!(seen.iter().all(|&t| t == thread::current().id()), "ran on another thread");
            (seen, xs)
        })
        .join()
        .unwrap();
        assert_eq!(seen.len(), 64);
        assert!(xs.iter().enumerate().all(|(i, &x)| x == 2 * i as u32));

        let squares = thread::spawn(|| map_collect((0..5usize).into_par_iter(), |i| i * i)).join().unwrap();
        assert_eq!(squares, [0, 1, 4, 9, 16]);
        let inits = thread::spawn(|| {
            let count = Mutex::new(0);
            let sum = Mutex::new(0);
            for_each_init(
                (0..100u32).into_par_iter(),
                || *count.lock().unwrap() += 1,
                |_, i| *sum.lock().unwrap() += i,
            );
            (count.into_inner().unwrap(), sum.into_inner().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(inits, (1, 4950), "one init for the whole loop, every item once");
    }

    #[test]
    fn inside_a_pool_a_loop_is_the_pools() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let (seen, xs) = pool.install(|| {
            assert!(in_pool());
            assert_eq!(threads(), 3);
            run(doubled)
        });
        assert_eq!(seen.len(), 64);
        assert!(seen.iter().all(|&t| t != thread::current().id()), "ran outside the pool");
        assert!(xs.iter().enumerate().all(|(i, &x)| x == 2 * i as u32));
        assert_eq!(pool.install(|| map_collect((0..5usize).into_par_iter(), |i| i * i)), [0, 1, 4, 9, 16]);
    }
}
