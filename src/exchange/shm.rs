//! The shared-memory collective of CPU devices.
//!
//! Every logical replica (shard) owns one send buffer in [`ShmGroup`]; its worker
//! writes the shard's gradient there. The reduction is a reduce-scatter: member d owns
//! chunk d of the flat buffer, sums that chunk over ALL shard buffers in the canonical
//! tree order over shard indices ([`tree_sum`], of [`super::tree`]), and stores it in shared chunk d. After a
//! barrier every member reads the reduced chunks in place. Because the order depends on
//! shard indices only, never on which device computed a shard, R logical replicas give
//! bitwise the same sum on 1, 2 or 4 devices.
//!
//! With a codec (`--grad-compression`, [`super::codec`]) each shard's slot is encoded
//! into its 16-bit wire when its worker hands it over ([`Exchange::with_slot`]), member d
//! decodes chunk d of every wire block by block, sums in the same canonical tree in f32,
//! and encodes the sum into its reduced wire, which every member decodes the same way:
//! half the bytes cross between cores, and the result is still bitwise the same on every
//! member and for every device count. Chunks are then whole codec blocks.
//!
//! Two more collectives share the barrier: the parameters' all-gather of a sharded
//! optimiser ([`Exchange::all_gather`]: member d owns chunk d of the parameters), and the
//! statistics exchange of synchronized BatchNorm ([`ShmStats`]).
//!
//! Synchronisation: a barrier that spins a few µs where every member has a core, and sleeps
//! at once where the members outnumber the cores ([`WaitPolicy`]), and per-buffer
//! read/write locks that are never contended in a correct run (the barriers order the
//! phases) but make the sharing safe without `unsafe`. An abort flag, checked while
//! waiting, turns any wait into `Error::Aborted`.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use super::codec::{Codec, Wire, BLOCK};
use super::tree::tree_sum;
use super::{Abort, Exchange, Host, WaitPolicy};
use crate::error::{Error, Result};
use crate::ops::batchnorm::stats::StatsExchange;

/// A reusable barrier for `n` threads that gives up when the abort flag is raised. With
/// [`WaitPolicy::Spin`] a waiter spins a few µs, then yields, then sleeps in short naps: the
/// hand-offs of a small model's step cost microseconds, less than waking a sleeping core.
/// With [`WaitPolicy::Park`] (more threads than cores) it sleeps at once on a condition
/// variable: a spinning waiter would take the core from the very thread it waits for.
pub struct SpinBarrier {
    n: usize,
    wait: WaitPolicy,
    count: AtomicUsize,
    generation: AtomicUsize,
    /// Where parked waiters sleep; the last arriver wakes them under the lock.
    lock: Mutex<()>,
    woken: Condvar,
}

/// A parked waiter checks the abort flag at least this often, in case an abort came
/// without [`SpinBarrier::wake`].
const PARK_RECHECK: Duration = Duration::from_millis(10);

impl SpinBarrier {
    pub fn new(n: usize, wait: WaitPolicy) -> Self {
        SpinBarrier {
            n,
            wait,
            count: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            lock: Mutex::new(()),
            woken: Condvar::new(),
        }
    }

    /// Waits for all `n` threads, or fails with `Error::Aborted` once `abort` is set.
    pub fn wait(&self, abort: &AtomicBool) -> Result<()> {
        if self.n <= 1 {
            return Ok(());
        }
        let gen = self.generation.load(Ordering::Acquire);
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.count.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            if self.wait == WaitPolicy::Park {
                self.wake();
            }
            return Ok(());
        }
        match self.wait {
            WaitPolicy::Spin => self.spin(gen, abort),
            WaitPolicy::Park => self.park(gen, abort),
        }
    }

    /// Wakes every parked waiter (after the last arrival, or an abort).
    pub fn wake(&self) {
        let _held = self.lock.lock();
        self.woken.notify_all();
    }

    fn spin(&self, gen: usize, abort: &AtomicBool) -> Result<()> {
        let start = Instant::now();
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == gen {
            if abort.load(Ordering::Relaxed) {
                return Err(Error::Aborted);
            }
            spins = spins.saturating_add(1);
            if spins < 4096 {
                std::hint::spin_loop();
            } else if start.elapsed() < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        Ok(())
    }

    fn park(&self, gen: usize, abort: &AtomicBool) -> Result<()> {
        let mut held = self.lock.lock();
        // Checked under the lock: the last arriver takes it to wake us, so its wake-up
        // cannot fall between this check and the sleep.
        while self.generation.load(Ordering::Acquire) == gen {
            if abort.load(Ordering::Relaxed) {
                return Err(Error::Aborted);
            }
            self.woken.wait_for(&mut held, PARK_RECHECK);
        }
        Ok(())
    }
}

/// Shared state of one shared-memory collective.
pub struct ShmGroup {
    members: usize,
    len: usize,
    /// One send buffer per logical replica; member d runs shards d·k..(d+1)·k.
    shards: Vec<RwLock<Vec<f32>>>,
    /// Reduced chunk d, written by member d (without a codec).
    reduced: Vec<RwLock<Vec<f32>>>,
    chunks: Vec<Range<usize>>,
    /// With a codec: each shard's encoded slot, and each chunk's encoded sum.
    codec: Option<Codec>,
    wires: Vec<RwLock<Wire>>,
    reduced_wires: Vec<RwLock<Wire>>,
    /// Member d's updated parameters of chunk d, for the all-gather of a sharded optimiser
    /// (sized on first use).
    gathered: Vec<RwLock<Vec<f32>>>,
    /// The statistics exchange's payloads, one per logical replica, in two generations
    /// (calls alternate, so one barrier per call suffices: see [`ShmStats`]).
    stats: [Vec<RwLock<Vec<f64>>>; 2],
    barrier: SpinBarrier,
    aborted: AtomicBool,
}

/// Values of the reduced sum decoded at a time by [`Exchange::for_each_sum`] with a codec:
/// 64 KiB of f32, which the update then reads from cache.
const DECODED_PIECE: usize = 16 * BLOCK;

impl ShmGroup {
    /// A collective of `members` members, each running `shards / members` logical replicas,
    /// over buffers of `len` values, whose members wait for each other as `wait` says.
    /// (Without a codec: synchronized BatchNorm's statistics exchange of a GPU run.)
    #[cfg(any(test, feature = "cuda"))]
    pub fn new(members: usize, shards: usize, len: usize, wait: WaitPolicy) -> Result<ShmGroup> {
        ShmGroup::with_codec(members, shards, len, wait, None)
    }

    /// [`ShmGroup::new`] whose slots travel encoded by `codec` (f32 when `None`).
    pub fn with_codec(
        members: usize,
        shards: usize,
        len: usize,
        wait: WaitPolicy,
        codec: Option<Codec>,
    ) -> Result<ShmGroup> {
        if members == 0 || shards == 0 || !shards.is_multiple_of(members) {
            return Err(Error::config(
                "replicas",
                format!("{shards} logical replicas cannot be shared evenly by {members} devices"),
            ));
        }
        // Chunks are multiples of 16 values (64 bytes) so no cache line has two writers;
        // with a codec, of whole blocks, so that every chunk's blocks are the slot's.
        let granule = if codec.is_some() { BLOCK } else { 16 };
        let per = len.div_ceil(members).div_ceil(granule) * granule;
        let chunks: Vec<Range<usize>> = (0..members).map(|d| (d * per).min(len)..((d + 1) * per).min(len)).collect();
        let (wires, reduced_wires) = match &codec {
            Some(c) => (
                (0..shards).map(|_| RwLock::new(c.wire(0..len))).collect(),
                chunks.iter().map(|r| RwLock::new(c.wire(r.clone()))).collect(),
            ),
            None => (Vec::new(), Vec::new()),
        };
        let per_shard = || (0..shards).map(|_| RwLock::new(Vec::new())).collect::<Vec<_>>();
        Ok(ShmGroup {
            members,
            len,
            shards: (0..shards).map(|_| RwLock::new(vec![0.0; len])).collect(),
            reduced: match codec {
                Some(_) => Vec::new(),
                None => chunks.iter().map(|c| RwLock::new(vec![0.0; c.len()])).collect(),
            },
            chunks,
            codec,
            wires,
            reduced_wires,
            gathered: (0..members).map(|_| RwLock::new(Vec::new())).collect(),
            stats: [per_shard(), per_shard()],
            barrier: SpinBarrier::new(members, wait),
            aborted: AtomicBool::new(false),
        })
    }

    /// The handle of member `member`.
    pub fn member(&self, member: usize) -> ShmMember<'_> {
        assert!(member < self.members, "member {member} of {}", self.members);
        ShmMember { ex: self, index: member }
    }

    /// Member `member`'s side of the statistics exchange (one logical replica per member).
    pub fn stats(&self, member: usize) -> ShmStats<'_> {
        assert!(member < self.members, "member {member} of {}", self.members);
        ShmStats { ex: self, index: member, calls: AtomicUsize::new(0) }
    }

    fn shards_per_member(&self) -> usize {
        self.shards.len() / self.members
    }
}

/// One member's view of a [`ShmGroup`]: its side of the exchange.
pub struct ShmMember<'a> {
    ex: &'a ShmGroup,
    index: usize,
}

impl ShmMember<'_> {
    /// Reduce-scatter: sums this member's chunk over every shard buffer (canonical tree
    /// order) into the shared reduced chunk, then waits until every chunk is reduced.
    /// With a single shard and no codec there is nothing to reduce and it returns at once.
    fn reduce_scatter(&self) -> Result<()> {
        let ex = self.ex;
        if ex.shards.len() == 1 && ex.codec.is_none() {
            return Ok(());
        }
        ex.barrier.wait(&ex.aborted)?;
        let r = ex.chunks[self.index].clone();
        match &ex.codec {
            None => {
                let guards: Vec<_> = ex.shards.iter().map(|s| s.read()).collect();
                let views: Vec<&[f32]> = guards.iter().map(|g| &g[r.clone()]).collect();
                tree_sum(&views, &mut ex.reduced[self.index].write());
            }
            Some(codec) => {
                let guards: Vec<_> = ex.wires.iter().map(|w| w.read()).collect();
                let wires: Vec<&Wire> = guards.iter().map(|g| &**g).collect();
                codec.reduce(&wires, r, &mut ex.reduced_wires[self.index].write());
            }
        }
        ex.barrier.wait(&ex.aborted)
    }

    /// Returns when every member has called it (for benchmarks that time between barriers).
    #[cfg(any(test, feature = "cli"))]
    pub fn barrier(&self) -> Result<()> {
        self.ex.barrier.wait(&self.ex.aborted)
    }
}

impl Exchange for ShmMember<'_> {
    type Mem = Host;

    fn width(&self) -> usize {
        self.ex.len
    }

    /// The send buffer of this member's `local`-th logical replica; with a codec, encoded
    /// into the shard's wire when `f` returns (the worker hands over 16-bit values).
    fn with_slot<T>(&mut self, local: usize, f: impl FnOnce(&mut [f32]) -> T) -> T {
        let k = self.ex.shards_per_member();
        assert!(local < k, "slot {local} of a member with {k} logical replicas");
        let shard = self.index * k + local;
        let mut slot = self.ex.shards[shard].write();
        let out = f(&mut slot);
        if let Some(codec) = &self.ex.codec {
            codec.encode(&slot, &mut self.ex.wires[shard].write(), 0..self.ex.len);
        }
        out
    }

    fn sum(&mut self) -> Result<()> {
        self.reduce_scatter()
    }

    /// The shared chunks after the reduce-scatter, or the single shard's buffer when
    /// there is one shard; with a codec, the reduced wires decoded piece by piece.
    fn for_each_sum(&self, f: impl FnMut(usize, &[f32]) -> Result<()>) -> Result<()> {
        self.for_each_sum_in(0..self.ex.len, f)
    }

    fn for_each_sum_in(&self, range: Range<usize>, mut f: impl FnMut(usize, &[f32]) -> Result<()>) -> Result<()> {
        let ex = self.ex;
        let clip = |c: &Range<usize>| range.start.max(c.start)..range.end.min(c.end);
        if ex.shards.len() == 1 && ex.codec.is_none() {
            let r = clip(&(0..ex.len));
            return if r.is_empty() { Ok(()) } else { f(r.start, &ex.shards[0].read()[r]) };
        }
        let Some(codec) = &ex.codec else {
            for (c, chunk) in ex.reduced.iter().zip(&ex.chunks) {
                let r = clip(chunk);
                if !r.is_empty() {
                    f(r.start, &c.read()[r.start - chunk.start..r.end - chunk.start])?;
                }
            }
            return Ok(());
        };
        let mut decoded = Vec::new();
        for (w, chunk) in ex.reduced_wires.iter().zip(&ex.chunks) {
            let r = clip(chunk);
            if r.is_empty() {
                continue;
            }
            let w = w.read();
            let encoded_end = r.end.min(codec.encoded_len()).max(r.start);
            let mut at = r.start;
            while at < encoded_end {
                // Pieces end on blocks, so that the next one starts on one.
                let end = ((at / BLOCK + DECODED_PIECE / BLOCK) * BLOCK).min(encoded_end);
                decoded.resize(end - at, 0.0);
                codec.decode(&w, at..end, &mut decoded);
                f(at, &decoded)?;
                at = end;
            }
            if encoded_end < r.end {
                f(encoded_end, codec.raw(&w, encoded_end..r.end).expect("past the encoded part"))?;
            }
        }
        Ok(())
    }

    fn owned(&self) -> Range<usize> {
        self.ex.chunks[self.index].clone()
    }

    /// Member d publishes its chunk of `params` (the part below `params.len()`), and after
    /// the barrier copies every other member's chunk in. A member writes its chunk again
    /// only in the next step's all-gather, after that step's reduce-scatter barriers,
    /// which no member passes before it has copied this step's chunks.
    fn all_gather(&mut self, params: &mut [f32]) -> Result<()> {
        let ex = self.ex;
        if ex.members == 1 {
            return Ok(());
        }
        let np = params.len();
        let clip = |c: &Range<usize>| c.start.min(np)..c.end.min(np);
        {
            let mine = clip(&ex.chunks[self.index]);
            let mut g = ex.gathered[self.index].write();
            g.clear();
            g.extend_from_slice(&params[mine]);
        }
        ex.barrier.wait(&ex.aborted)?;
        for (r, chunk) in ex.chunks.iter().enumerate() {
            if r != self.index {
                let c = clip(chunk);
                params[c].copy_from_slice(&ex.gathered[r].read());
            }
        }
        Ok(())
    }

    fn is_aborted(&self) -> bool {
        self.ex.aborted.load(Ordering::SeqCst)
    }
}

/// One member's side of a [`ShmGroup`]'s statistics exchange. Payloads alternate between
/// two generations of buffers: call c writes generation c mod 2 and waits at the barrier,
/// then reads it; a member writes that generation again at call c + 2, after the barrier of
/// call c + 1, which no member reaches before it has read call c's payloads.
pub struct ShmStats<'a> {
    ex: &'a ShmGroup,
    index: usize,
    calls: AtomicUsize,
}

impl std::fmt::Debug for ShmStats<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmStats").field("index", &self.index).field("replicas", &self.ex.shards.len()).finish()
    }
}

impl StatsExchange for ShmStats<'_> {
    fn replicas(&self) -> usize {
        self.ex.shards.len()
    }

    fn all_gather(&self, shard: usize, mine: &[f64], all: &mut Vec<f64>) -> Result<()> {
        let ex = self.ex;
        if ex.shards_per_member() != 1 || shard != self.index {
            return Err(Error::config(
                "statistics exchange",
                format!(
                    "device {} was handed logical replica {shard} of {} on {} devices: synchronized BatchNorm needs one logical replica per device",
                    self.index,
                    ex.shards.len(),
                    ex.members
                ),
            ));
        }
        let generation = &ex.stats[self.calls.fetch_add(1, Ordering::Relaxed) % 2];
        {
            let mut w = generation[shard].write();
            w.clear();
            w.extend_from_slice(mine);
        }
        ex.barrier.wait(&ex.aborted)?;
        all.clear();
        for (r, payload) in generation.iter().enumerate() {
            let p = payload.read();
            if p.len() != mine.len() {
                return Err(Error::shape(
                    "statistics exchange",
                    format!("logical replica {r} sent {} values, {shard} sent {}", p.len(), mine.len()),
                ));
            }
            all.extend_from_slice(&p);
        }
        Ok(())
    }
}

impl Abort for ShmGroup {
    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        self.barrier.wake();
    }

    #[cfg(any(test, feature = "cuda"))]
    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Every member's sum of `slots` through the shared-memory exchange with `codec`, on
    /// `members` members (each running its share of the logical replicas): the CPU's own
    /// code, the reference the codec's and the GPU exchange's tests hold their sums to.
    pub(crate) fn shm_exchange(members: usize, codec: Codec, slots: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let (shards, len) = (slots.len(), slots[0].len());
        let group = ShmGroup::with_codec(members, shards, len, WaitPolicy::Park, Some(codec)).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..members)
                .map(|d| {
                    let group = &group;
                    s.spawn(move || {
                        let mut me = group.member(d);
                        let per = shards / members;
                        for j in 0..per {
                            me.with_slot(j, |slot| slot.copy_from_slice(&slots[d * per + j]));
                        }
                        me.sum().unwrap();
                        gathered(&me)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Every member's copy of the sum, gathered from its pieces.
    fn gathered(me: &ShmMember<'_>) -> Vec<f32> {
        let mut out = vec![f32::NAN; me.width()];
        me.for_each_sum(|off, v| {
            out[off..off + v.len()].copy_from_slice(v);
            Ok(())
        })
        .unwrap();
        out
    }

    #[test]
    fn reduce_scatter_sums_every_shard_on_every_member() {
        let cases = [(1, 1), (1, 4), (2, 2), (2, 4), (3, 3), (4, 4)];
        for ((members, shards), wait) in cases.into_iter().flat_map(|c| [(c, WaitPolicy::Spin), (c, WaitPolicy::Park)])
        {
            let len = 1000;
            let ex = ShmGroup::new(members, shards, len, wait).unwrap();
            let results: Vec<Vec<f32>> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..members)
                    .map(|d| {
                        let ex = &ex;
                        s.spawn(move || {
                            let mut me = ex.member(d);
                            for j in 0..shards / members {
                                let shard = d * (shards / members) + j;
                                me.with_slot(j, |slot| {
                                    slot.iter_mut().enumerate().for_each(|(i, v)| *v = (shard * len + i) as f32)
                                });
                            }
                            me.sum().unwrap();
                            gathered(&me)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for out in &results {
                for (i, &v) in out.iter().enumerate() {
                    let want: f32 = (0..shards).map(|s| (s * len + i) as f32).sum();
                    assert_eq!(v, want, "members {members} shards {shards} ({wait:?}) element {i}");
                }
            }
        }
    }

    #[test]
    fn classic_all_reduce_gives_every_member_the_same_values() {
        let (members, len) = (3, 100);
        let ex = ShmGroup::new(members, members, len, WaitPolicy::Park).unwrap();
        let out: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..members)
                .map(|r| {
                    let ex = &ex;
                    s.spawn(move || {
                        let mut me = ex.member(r);
                        let mut sum: Vec<f32> = (0..len).map(|i| (r * 1000 + i) as f32).collect();
                        crate::exchange::all_reduce_in_place(&mut me, &mut sum).unwrap();
                        sum
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for sum in &out {
            // ((0·1000 + i) + (1000 + i)) + (2000 + i) = 3000 + 3i, exact in f32
            assert!(sum.iter().enumerate().all(|(i, &v)| v == (3000 + 3 * i) as f32));
        }
        // One member: nothing to do, nothing changes.
        let one = ShmGroup::new(1, 1, 4, WaitPolicy::Spin).unwrap();
        let mut v = vec![1.0, 2.0, 3.0, 4.0];
        crate::exchange::all_reduce_in_place(&mut one.member(0), &mut v).unwrap();
        assert_eq!(v, vec![1.0, 2.0, 3.0, 4.0]);
        // A buffer of another length is refused, naming both lengths.
        let e = crate::exchange::all_reduce_in_place(&mut one.member(0), &mut [0.0; 3]).unwrap_err().to_string();
        assert!(e.contains("buffer of 3 values for an exchange of 4"), "{e}");
    }

    #[test]
    fn abort_releases_a_waiting_member() {
        for wait in [WaitPolicy::Spin, WaitPolicy::Park] {
            let ex = ShmGroup::new(2, 2, 4, wait).unwrap();
            std::thread::scope(|s| {
                let h = s.spawn(|| ex.member(0).barrier());
                std::thread::sleep(Duration::from_millis(20));
                ex.abort();
                assert!(matches!(h.join().unwrap(), Err(Error::Aborted)), "{wait:?}");
            });
        }
    }

    #[test]
    fn the_statistics_exchange_gathers_every_payload_in_replica_order() {
        // Three members, five calls in a row (both generations of buffers, reused): every
        // member gets [member 0's, member 1's, member 2's] payloads of each call.
        let ex = ShmGroup::new(3, 3, 8, WaitPolicy::Park).unwrap();
        let got: Vec<Vec<Vec<f64>>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let ex = &ex;
                    s.spawn(move || {
                        let me = ex.stats(r);
                        (0..5)
                            .map(|call| {
                                let mut all = Vec::new();
                                let mine = vec![(10 * call + r) as f64; call + 1];
                                me.all_gather(r, &mine, &mut all).unwrap();
                                all
                            })
                            .collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for calls in &got {
            for (call, all) in calls.iter().enumerate() {
                let want: Vec<f64> = (0..3).flat_map(|r| vec![(10 * call + r) as f64; call + 1]).collect();
                assert_eq!(all, &want, "call {call}");
            }
        }
        // Another replica than the member's, or two shards a member, is refused by name.
        let e = ex.stats(1).all_gather(0, &[1.0], &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("one logical replica per device"), "{e}");
        let two = ShmGroup::new(1, 2, 8, WaitPolicy::Spin).unwrap();
        assert!(two.stats(0).all_gather(0, &[1.0], &mut Vec::new()).is_err());
    }

    #[test]
    fn an_abort_releases_a_member_waiting_in_the_statistics_exchange() {
        let ex = ShmGroup::new(2, 2, 4, WaitPolicy::Park).unwrap();
        std::thread::scope(|s| {
            let h = s.spawn(|| ex.stats(0).all_gather(0, &[1.0], &mut Vec::new()));
            std::thread::sleep(Duration::from_millis(20));
            ex.abort();
            assert!(matches!(h.join().unwrap(), Err(Error::Aborted)));
        });
    }

    #[test]
    fn the_all_gather_hands_every_member_every_owned_chunk() {
        // 3 members over a slot of 100 parameters and 20 buffers: member d writes 1000·d
        // + i into its owned chunk of the parameters only; afterwards every member holds
        // them all.
        let (members, np, nb) = (3, 100, 20);
        let ex = ShmGroup::new(members, members, np + nb, WaitPolicy::Park).unwrap();
        let owned: Vec<Range<usize>> = (0..members).map(|d| ex.member(d).owned()).collect();
        assert_eq!(owned, vec![0..48, 48..96, 96..120], "chunks of 16-value multiples");
        let got: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..members)
                .map(|d| {
                    let (ex, owned) = (&ex, &owned);
                    s.spawn(move || {
                        let mut params = vec![f32::NAN; np];
                        let mine = owned[d].start.min(np)..owned[d].end.min(np);
                        for (i, p) in params.iter_mut().enumerate().take(mine.end).skip(mine.start) {
                            *p = (1000 * d + i) as f32;
                        }
                        ex.member(d).all_gather(&mut params).unwrap();
                        params
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let owner = |i: usize| owned.iter().position(|r| r.contains(&i)).unwrap();
        for params in &got {
            assert!(params.iter().enumerate().all(|(i, &v)| v == (1000 * owner(i) + i) as f32), "{params:?}");
        }
    }

    #[test]
    fn uneven_replicas_are_refused() {
        let e = ShmGroup::new(2, 3, 10, WaitPolicy::Spin).err().unwrap().to_string();
        assert!(e.contains("3 logical replicas cannot be shared evenly by 2 devices"), "{e}");
    }
}
