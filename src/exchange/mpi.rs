//! The exchange between processes (the `mpi` feature): CPU devices of several processes,
//! summed bitwise as one process sums them.
//!
//! Owns [`MpiGroup`], the shared state of one run's exchange in one process, and
//! [`MpiRank`], one device thread's side of it. The step sees an exchange like every
//! other (`Exchange`); underneath it is hierarchical:
//!
//! ```text
//! every device:   writes its shards' slots (this process owns shards p·L .. (p+1)·L)
//! every device:   sums its piece of the elements of each of this process's LEAVES — the
//!                 maximal nodes of the canonical tree over all R shards that lie inside
//!                 this process (exchange::tree) — with tree_sum over their slots
//! device 0 only:  (the one thread talking to MPI, through the world's door)
//!                 reduce-scatter: sends chunk q of each of its leaves to process q,
//!                 receives chunk p of every other process's leaves, and sums its chunk
//!                 over all the world's leaves in the tree's top part (tree::sum_leaves);
//!                 all-gather: sends its summed chunk to every process, receives theirs
//! every device:   reads the whole sum in place, in its update
//! ```
//!
//! Exactness: every element is `tree_sum` over the R shards in shard order — the leaves
//! are subtrees of that tree, the top is its remaining nodes, each evaluated as
//! `tree_sum` would — so P processes × D devices give bitwise the sum of one process,
//! for any P·D dividing R. MPI moves values and never adds them: `MPI_Allreduce`'s order
//! is not specified, and is not used.
//!
//! Speed: for small buffers ([`GATHER_BELOW`]) one round instead of two — every process
//! sends its leaves whole to every other and sums the whole buffer itself (what a
//! recursive-doubling all-reduce costs, one message latency). Values move in blocks of
//! at most [`BLOCK_SHARED`] or [`BLOCK_NETWORK`] values (and, for the smallest buffers,
//! of [`EAGER_BLOCK`]), all
//! posted at once; device 0 sums each block of its chunk as soon as it has arrived and
//! sends it on while the next arrives. Blocks never straddle a device's piece, so that
//! each device's partial sums are its own buffers (no lock contended, no unsafe sharing).
//!
//! 16-bit gradients (`--grad-compression`, `exchange::codec`): every slot's values are
//! rounded as the codec encodes and decodes them, the sum is taken of those in the same
//! tree, and rounded again — what the shared-memory exchange computes from its wires, so
//! the weights are bitwise the same on any number of processes. Between processes the
//! rounded values still travel as f32: the codec's halving of the bytes on the wire is
//! the shared memory's only, so far.
//!
//! Synchronized BatchNorm (`--sync-batchnorm`): [`MpiStats`], the statistics exchange,
//! gathers every logical replica's payload in replica order: the process's devices
//! through shared memory, then device 0 through `MPI_Iallgather`, waited on as the sum is.
//!
//! A sharded optimiser (`--shard-optimizer`) keeps its whole state on every device here
//! (the `Exchange` defaults: every device owns every parameter); the weights are the same.
//!
//! Faults: every wait polls the world's failure notices, the processes on this machine,
//! the launcher and this group's abort flag ([`MpiWorld::wait`]). A failed wait leaves
//! MPI requests pending on this group's buffers, so the group is then *abandoned*: its
//! buffers are leaked, never freed under MPI, and the process is on its way out.

use std::ops::Range;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};

use mpi::ffi::MPI_Request;
use parking_lot::{Mutex, RwLock};

use super::codec::Codec;
use super::shm::{tree_sum, SpinBarrier};
use super::stats::StatsExchange;
use super::tree;
use super::{Abort, Exchange, Host, Wait};
use crate::error::{Error, Result};
use crate::world::mpi::{MpiWorld, Port};
use crate::world::World;

/// A sum in which each process would receive at most this many bytes in one round
/// (every other process's leaves whole; it then sums all of them itself) goes in one
/// round; a larger one in two (reduce-scatter, all-gather), which moves half as much
/// between 2 processes. Chosen by `bench allreduce` on 2 processes here: one round is the
/// faster up to 256 KiB on shared memory (26 µs against 28) and TCP (85 µs against 127).
pub const GATHER_BELOW: usize = 256 << 10;

/// The most values one message carries between processes of one machine over shared
/// memory (256 KiB: each message is copied once, and fewer are cheaper), and over a
/// network (64,000 bytes, under Open MPI's TCP eager limit of 64 KiB, so that no message
/// waits for a rendezvous). Measured at 4 MiB on 2 processes here, busbw against
/// `MPI_Allreduce`'s: shared memory 1.2-1.4× with 64 Ki values, 0.9-1.3× with 16,000;
/// TCP 1.1-1.3× with 16,000, 0.7-1.1× with 64 Ki. Summing one block overlaps the
/// arrival of the next.
pub const BLOCK_SHARED: usize = 64 << 10;
pub const BLOCK_NETWORK: usize = 16_000;

/// Slots of at most this many values (8 KiB) move in messages of at most
/// [`EAGER_BLOCK`] values: a message under the transport's eager limit (Open MPI's shared
/// memory: 4 KiB with its header) is copied out at once, one over it waits for a
/// rendezvous round trip — which costs a 4 KiB exchange twice its time (measured: 3.0 µs
/// in one message, 1.5 µs in two, MPI_Allreduce 1.1-1.3 µs). Past that size one message
/// is faster than several (16 KiB: 3.9 µs in one, 4.8 µs in four).
pub const EAGER_BELOW: usize = 2048;
pub const EAGER_BLOCK: usize = 1000;

/// Tag of the all-gather's messages; a leaf's messages carry `TAG_LEAF + its index`.
const TAG_SUM: c_int = 90;
const TAG_LEAF: c_int = 100;
/// MPI guarantees tags up to 32767; the notices of `world::mpi` use one below it.
const MAX_LEAVES: usize = 19_000;

/// How the processes split the work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rounds {
    /// Every process receives every leaf whole and sums the whole buffer.
    One,
    /// Reduce-scatter by chunks, then all-gather.
    Two,
}

/// A node of the canonical tree whose shards one process owns (see `exchange::tree`).
#[derive(Clone, Debug)]
struct Leaf {
    shards: Range<usize>,
    owner: usize,
}

/// A run of elements moved and summed as one.
#[derive(Clone, Debug)]
struct Block {
    elems: Range<usize>,
    /// The process whose chunk holds it (every process's, in one round).
    chunk: usize,
    /// The local device whose piece holds it.
    piece: usize,
}

/// Shared state of the exchange of one run, in one process of an MPI world.
pub struct MpiGroup<'w> {
    world: &'w MpiWorld,
    /// This process, and the number of processes.
    process: usize,
    processes: usize,
    /// Device threads in this process, logical replicas each.
    devices: usize,
    per_device: usize,
    len: usize,
    /// Logical replicas in the world.
    total: usize,
    /// One slot per logical replica of this process, in shard order.
    slots: Vec<RwLock<Vec<f32>>>,
    /// Every leaf of the world, in shard order.
    leaves: Vec<Leaf>,
    /// `partial[j][d]`: device d's piece of leaf j's sum, for this process's leaves of
    /// more than one shard (empty otherwise).
    partial: Vec<Vec<RwLock<Vec<f32>>>>,
    /// Element ranges each device sums locally.
    pieces: Vec<Range<usize>>,
    /// Element ranges each process reduces in two rounds.
    chunks: Vec<Range<usize>>,
    rounds: Rounds,
    blocks: Vec<Block>,
    /// Device 0's receive buffers: `inbox[j]` holds another process's leaf j, for this
    /// process's chunk (two rounds) or whole (one round); empty for this process's leaves.
    inbox: Mutex<Vec<Vec<f32>>>,
    /// The whole sum, which every device reads.
    sum: RwLock<Vec<f32>>,
    /// With 16-bit gradients: how slots and the sum are rounded.
    codec: Option<Codec>,
    /// Synchronized BatchNorm's payloads, in two generations (a fast device writes the
    /// next call's while a slow one still reads this one's): each local device's, and
    /// every logical replica's of the world, gathered by device 0.
    stats_mine: [Vec<RwLock<Vec<f64>>>; 2],
    stats_all: [RwLock<Vec<f64>>; 2],
    barrier: SpinBarrier,
    wait: Wait,
    aborted: AtomicBool,
    /// A wait gave up with requests pending on the buffers: they are never freed.
    abandoned: AtomicBool,
}

/// `len` cut into `n` ranges, each a multiple of 16 values (64 bytes: no cache line with
/// two writers) but the last.
fn cut(len: usize, n: usize) -> Vec<Range<usize>> {
    let per = len.div_ceil(n).div_ceil(16) * 16;
    (0..n).map(|i| (i * per).min(len)..((i + 1) * per).min(len)).collect()
}

/// The blocks of `0..len`: cut at every chunk and piece boundary, and every `max` values.
fn blocks(len: usize, chunks: &[Range<usize>], pieces: &[Range<usize>], max: usize) -> Vec<Block> {
    let mut bounds: Vec<usize> = chunks.iter().chain(pieces).flat_map(|r| [r.start, r.end]).collect();
    bounds.extend([0, len]);
    bounds.sort_unstable();
    bounds.dedup();
    let find = |ranges: &[Range<usize>], at: usize| ranges.iter().position(|r| r.contains(&at)).expect("covered");
    let mut out = Vec::new();
    for w in bounds.windows(2) {
        let (chunk, piece) = (find(chunks, w[0]), find(pieces, w[0]));
        let mut at = w[0];
        while at < w[1] {
            let end = (at + max).min(w[1]);
            out.push(Block { elems: at..end, chunk, piece });
            at = end;
        }
    }
    out
}

impl<'w> MpiGroup<'w> {
    /// The exchange of this process of `world` for `devices` device threads, among
    /// `shards` logical replicas in the world, over slots of `len` values; its threads
    /// wait for each other as `wait` says. Every process must make the same call with
    /// the same `devices`, `shards` and `len` (the trainer's handshake checks them). With a
    /// `codec`, slots and the sum are rounded to its 16-bit values (see the file's docs).
    pub fn new(
        world: &'w World,
        devices: usize,
        shards: usize,
        len: usize,
        wait: Wait,
        codec: Option<Codec>,
    ) -> Result<MpiGroup<'w>> {
        let mpi = world.mpi().ok_or_else(|| Error::Mpi("the exchange between processes needs an MPI world".into()))?;
        let (process, processes) = (world.rank(), world.size());
        let in_world = processes * devices;
        if devices == 0 || shards == 0 || shards % in_world != 0 {
            return Err(Error::config(
                "replicas",
                format!(
                    "{shards} logical replicas cannot be shared evenly by {in_world} devices \
                     ({processes} processes × {devices})"
                ),
            ));
        }
        let per_process = shards / processes;
        let owners: Vec<Range<usize>> = (0..processes).map(|q| q * per_process..(q + 1) * per_process).collect();
        let leaves: Vec<Leaf> = tree::leaves(shards, &owners)
            .into_iter()
            .map(|r| Leaf { owner: r.start / per_process, shards: r })
            .collect();
        if leaves.len() > MAX_LEAVES {
            return Err(Error::config(
                "replicas",
                format!("{shards} logical replicas make more partial sums than MPI tags"),
            ));
        }
        let rounds = match (len * 4).saturating_mul(processes - 1) <= GATHER_BELOW {
            true => Rounds::One,
            false => Rounds::Two,
        };
        let pieces = cut(len, devices);
        let chunks = match rounds {
            Rounds::One => std::iter::once(0..len).collect(),
            Rounds::Two => cut(len, processes),
        };
        let block = match (len <= EAGER_BELOW, mpi.shared_memory()) {
            (true, _) => EAGER_BLOCK,
            (false, true) => BLOCK_SHARED,
            (false, false) => BLOCK_NETWORK,
        };
        let blocks = blocks(len, &chunks, &pieces, block);
        let mine = &owners[process];
        let partial = leaves
            .iter()
            .map(|l| match l.owner == process && l.shards.len() > 1 {
                true => pieces.iter().map(|p| RwLock::new(vec![0.0; p.len()])).collect(),
                false => Vec::new(),
            })
            .collect();
        let inbox_len = match rounds {
            Rounds::One => len,
            Rounds::Two => chunks[process].len(),
        };
        let inbox = leaves.iter().map(|l| if l.owner == process { Vec::new() } else { vec![0.0; inbox_len] }).collect();
        Ok(MpiGroup {
            world: mpi,
            process,
            processes,
            devices,
            per_device: shards / in_world,
            len,
            total: shards,
            slots: mine.clone().map(|_| RwLock::new(vec![0.0; len])).collect(),
            leaves,
            partial,
            pieces,
            chunks,
            rounds,
            blocks,
            inbox: Mutex::new(inbox),
            sum: RwLock::new(vec![0.0; len]),
            codec,
            stats_mine: [0, 1].map(|_| (0..devices).map(|_| RwLock::new(Vec::new())).collect()),
            stats_all: [0, 1].map(|_| RwLock::new(Vec::new())),
            barrier: SpinBarrier::new(devices, wait),
            wait,
            aborted: AtomicBool::new(false),
            abandoned: AtomicBool::new(false),
        })
    }

    /// The handle of local device thread `device`.
    pub fn rank(&self, device: usize) -> MpiRank<'_, 'w> {
        assert!(device < self.devices, "device {device} of {}", self.devices);
        MpiRank { group: self, device }
    }

    /// Local device thread `device`'s side of the statistics exchange.
    pub fn stats(&self, device: usize) -> MpiStats<'_, 'w> {
        assert!(device < self.devices, "device {device} of {}", self.devices);
        MpiStats { group: self, device, calls: std::sync::atomic::AtomicUsize::new(0) }
    }

    /// Number of values per slot.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for empty slots.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first logical replica of this process.
    fn first_shard(&self) -> usize {
        self.process * self.devices * self.per_device
    }

    /// True when some leaf of this process sums several of its slots.
    fn sums_locally(&self) -> bool {
        self.partial.iter().any(|p| !p.is_empty())
    }

    /// Device `device`'s part of the local sums: its piece of every leaf of this process
    /// that has several shards.
    fn sum_leaves_locally(&self, device: usize) {
        let piece = self.pieces[device].clone();
        let first = self.first_shard();
        for (leaf, partial) in self.leaves.iter().zip(&self.partial) {
            if partial.is_empty() {
                continue;
            }
            let guards: Vec<_> = leaf.shards.clone().map(|s| self.slots[s - first].read()).collect();
            let views: Vec<&[f32]> = guards.iter().map(|g| &g[piece.clone()]).collect();
            tree_sum(&views, &mut partial[device].write());
        }
    }

    /// Device 0's part: the rounds between processes, through the world's door to MPI.
    /// On failure the group is aborted (releasing this process's other devices) and,
    /// where requests may be left pending, abandoned.
    fn across_processes(&self) -> Result<()> {
        let result = self.world.port().and_then(|mut port| {
            let r = self.rounds_with(&mut port);
            if r.is_err() {
                self.abandoned.store(true, Ordering::SeqCst);
            }
            r
        });
        if result.is_err() {
            self.abort();
        }
        result
    }

    fn rounds_with(&self, port: &mut Port) -> Result<()> {
        let slot_guards: Vec<_> = self.slots.iter().map(|s| s.read()).collect();
        let partial_guards: Vec<Vec<_>> = self.partial.iter().map(|p| p.iter().map(|b| b.read()).collect()).collect();
        let slots: Vec<&[f32]> = slot_guards.iter().map(|g| g.as_slice()).collect();
        let partial: Vec<Vec<&[f32]>> =
            partial_guards.iter().map(|p| p.iter().map(|g| g.as_slice()).collect()).collect();
        let mut inbox = self.inbox.lock();
        let mut sum = self.sum.write();
        let mut sum_blocks = split_blocks(&mut sum, &self.blocks);
        let base = match self.rounds {
            Rounds::One => 0,
            Rounds::Two => self.chunks[self.process].start,
        };
        let mut inboxes: Vec<Vec<&mut [f32]>> = (inbox.iter_mut().zip(&self.leaves))
            .map(|(v, leaf)| match leaf.owner == self.process {
                true => Vec::new(),
                false => split_from(v, base, &self.blocks, |b| self.chunk_holds(b)),
            })
            .collect();
        let held: Vec<usize> = (0..self.blocks.len()).filter(|&i| self.chunk_holds(&self.blocks[i])).collect();
        let mine: Vec<usize> = (0..self.leaves.len()).filter(|&j| self.leaves[j].owner == self.process).collect();
        let theirs: Vec<usize> = (0..self.leaves.len()).filter(|&j| self.leaves[j].owner != self.process).collect();
        let peers: Vec<usize> = (0..self.processes).filter(|&q| q != self.process).collect();
        let tag = |j: usize| TAG_LEAF + j as c_int;

        // The buffers MPI is handed below are this group's, held under the guards
        // above until every request has completed in a wait; if a wait gives up, the
        // group is abandoned and its buffers leaked (Drop), never freed under MPI. A
        // buffer being sent is not written until its send completes; a buffer being
        // received into is neither read nor written by anyone until its receive does.
        // Every other process's leaves, block by block of this process's chunk.
        let mut arriving: Vec<Vec<MPI_Request>> = (0..held.len()).map(|_| Vec::with_capacity(theirs.len())).collect();
        for &j in &theirs {
            for (here, block) in arriving.iter_mut().zip(inboxes[j].iter_mut()) {
                // SAFETY: an inbox block, untouched until this receive completes (or leaked).
                here.push(unsafe { port.irecv(block, self.leaves[j].owner, tag(j))? });
            }
        }
        // This process's leaves, to every process that sums their blocks.
        let mut rest = Vec::new();
        for &q in &peers {
            for b in self.blocks.iter().filter(|b| self.rounds == Rounds::One || b.chunk == q) {
                for &j in &mine {
                    // SAFETY: a slot or partial sum, only read (under its guard) this step.
                    rest.push(unsafe { port.isend(self.own(j, b, &slots, &partial), q, tag(j))? });
                }
            }
        }
        // The other processes' summed chunks (two rounds).
        if self.rounds == Rounds::Two {
            for &q in &peers {
                for i in (0..self.blocks.len()).filter(|&i| self.blocks[i].chunk == q) {
                    // SAFETY: a block of process q's chunk, which this process neither reads
                    // nor writes until the receive completes (or leaks it).
                    rest.push(unsafe { port.irecv(&mut *sum_blocks[i], q, TAG_SUM)? });
                }
            }
        }
        // Each block of this process's chunk as soon as it is there: summed, sent on.
        let aborted = || self.aborted.load(Ordering::Relaxed);
        for (k, &i) in held.iter().enumerate() {
            self.world.wait(port, &mut arriving[k], self.wait, &aborted)?;
            let b = &self.blocks[i];
            let values: Vec<(Range<usize>, &[f32])> = (0..self.leaves.len())
                .map(|j| {
                    let v: &[f32] = match self.leaves[j].owner == self.process {
                        true => self.own(j, b, &slots, &partial),
                        false => &*inboxes[j][k],
                    };
                    (self.leaves[j].shards.clone(), v)
                })
                .collect();
            tree::sum_leaves(self.total, &values, sum_blocks[i]);
            if self.rounds == Rounds::Two {
                for &q in &peers {
                    // SAFETY: this block is summed above and not written again this step.
                    rest.push(unsafe { port.isend(&*sum_blocks[i], q, TAG_SUM)? });
                }
            }
        }
        self.world.wait(port, &mut rest, self.wait, &aborted)
    }

    /// The values over `block` of this process's leaf `j`: its one slot, or this
    /// process's partial sum of its slots.
    fn own<'a>(&self, j: usize, block: &Block, slots: &[&'a [f32]], partial: &[Vec<&'a [f32]>]) -> &'a [f32] {
        match partial[j].is_empty() {
            true => &slots[self.leaves[j].shards.start - self.first_shard()][block.elems.clone()],
            false => {
                let piece = &self.pieces[block.piece];
                &partial[j][block.piece][block.elems.start - piece.start..block.elems.end - piece.start]
            }
        }
    }

    /// Whether block `b` is summed by this process.
    fn chunk_holds(&self, b: &Block) -> bool {
        self.rounds == Rounds::One || b.chunk == self.process
    }
}

/// `slot` (a whole slot) replaced by what `codec` makes of it: encoded, decoded.
fn round(codec: &Codec, slot: &mut [f32]) {
    let mut wire = codec.wire(0..slot.len());
    codec.encode(slot, &mut wire, 0..slot.len());
    codec.decode(&wire, 0..slot.len(), slot);
}

/// `v` (all of `0..len`) cut into one slice per block.
fn split_blocks<'a>(v: &'a mut [f32], blocks: &[Block]) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(blocks.len());
    let mut rest = v;
    for b in blocks {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(b.elems.len());
        out.push(head);
        rest = tail;
    }
    out
}

/// `v`, which holds elements `base..base + v.len()`, cut into one slice per block that
/// `keep` keeps (consecutive, from `base`).
fn split_from<'a>(
    v: &'a mut [f32],
    base: usize,
    blocks: &[Block],
    keep: impl Fn(&Block) -> bool,
) -> Vec<&'a mut [f32]> {
    let mut out = Vec::new();
    let mut rest = v;
    let mut at = base;
    for b in blocks.iter().filter(|b| keep(b)) {
        debug_assert_eq!(b.elems.start, at, "kept blocks are consecutive");
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(b.elems.len());
        out.push(head);
        rest = tail;
        at = b.elems.end;
    }
    out
}

impl Drop for MpiGroup<'_> {
    fn drop(&mut self) {
        if !*self.abandoned.get_mut() {
            return;
        }
        // MPI may still read or write any of these: they must outlive the process.
        for s in &mut self.slots {
            std::mem::forget(std::mem::take(s.get_mut()));
        }
        for p in self.partial.iter_mut().flatten() {
            std::mem::forget(std::mem::take(p.get_mut()));
        }
        for v in self.inbox.get_mut().iter_mut() {
            std::mem::forget(std::mem::take(v));
        }
        std::mem::forget(std::mem::take(self.sum.get_mut()));
    }
}

impl Abort for MpiGroup<'_> {
    /// Releases this process's devices from the exchange; the other processes learn of
    /// the failure from the world's notice (`World::fail`), sent once the run's threads
    /// have ended.
    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        self.barrier.wake();
    }

    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

/// One local device thread's side of an [`MpiGroup`].
pub struct MpiRank<'g, 'w> {
    group: &'g MpiGroup<'w>,
    device: usize,
}

impl MpiRank<'_, '_> {
    /// Returns when every local device thread has called it (benchmarks).
    pub fn barrier(&self) -> Result<()> {
        self.group.barrier.wait(&self.group.aborted)
    }
}

impl Exchange for MpiRank<'_, '_> {
    type Mem = Host;

    fn width(&self) -> usize {
        self.group.len
    }

    /// This device's `local`-th slot; with a codec, rounded to its values once written.
    fn with_slot<T>(&mut self, local: usize, f: impl FnOnce(&mut [f32]) -> T) -> T {
        let k = self.group.per_device;
        assert!(local < k, "slot {local} of a device with {k} logical replicas");
        let mut slot = self.group.slots[self.device * k + local].write();
        let out = f(&mut slot);
        if let Some(codec) = &self.group.codec {
            round(codec, &mut slot);
        }
        out
    }

    /// Local sums of this process's leaves, then (device 0) the rounds between
    /// processes; every device returns once the whole sum is there.
    fn sum(&mut self) -> Result<()> {
        let g = self.group;
        g.barrier.wait(&g.aborted)?;
        if g.sums_locally() {
            g.sum_leaves_locally(self.device);
            g.barrier.wait(&g.aborted)?;
        }
        if self.device == 0 {
            g.across_processes()?;
            if let Some(codec) = &g.codec {
                round(codec, &mut g.sum.write());
            }
        }
        g.barrier.wait(&g.aborted)
    }

    fn for_each_sum(&self, mut f: impl FnMut(usize, &[f32]) -> Result<()>) -> Result<()> {
        f(0, &self.group.sum.read())
    }

    fn is_aborted(&self) -> bool {
        self.group.aborted.load(Ordering::SeqCst)
    }
}

/// One local device thread's side of synchronized BatchNorm's statistics exchange, in an
/// MPI world (see the file's docs). One logical replica per device, as everywhere.
pub struct MpiStats<'g, 'w> {
    group: &'g MpiGroup<'w>,
    device: usize,
    calls: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for MpiStats<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiStats").field("device", &self.device).field("replicas", &self.group.total).finish()
    }
}

impl StatsExchange for MpiStats<'_, '_> {
    fn replicas(&self) -> usize {
        self.group.total
    }

    fn all_gather(&self, replica: usize, mine: &[f64], all: &mut Vec<f64>) -> Result<()> {
        let g = self.group;
        if g.per_device != 1 || replica != g.first_shard() + self.device {
            return Err(Error::config(
                "statistics exchange",
                format!(
                    "device {} of rank {} was handed logical replica {replica} of {}: synchronized BatchNorm needs one \
                     logical replica per device",
                    self.device, g.process, g.total
                ),
            ));
        }
        let generation = self.calls.fetch_add(1, Ordering::Relaxed) % 2;
        {
            let mut w = g.stats_mine[generation][self.device].write();
            w.clear();
            w.extend_from_slice(mine);
        }
        g.barrier.wait(&g.aborted)?;
        if self.device == 0 {
            let gathered = self.across_processes(generation, mine.len());
            if gathered.is_err() {
                g.abort();
            }
            gathered?;
        }
        g.barrier.wait(&g.aborted)?;
        all.clear();
        all.extend_from_slice(&g.stats_all[generation].read());
        Ok(())
    }
}

impl MpiStats<'_, '_> {
    /// Device 0's part: this process's payloads (its devices' logical replicas, in order),
    /// gathered with every other process's into every logical replica's, in order.
    fn across_processes(&self, generation: usize, len: usize) -> Result<()> {
        let g = self.group;
        let mut mine: Vec<u64> = Vec::with_capacity(len * g.devices);
        for (d, payload) in g.stats_mine[generation].iter().enumerate() {
            let p = payload.read();
            if p.len() != len {
                return Err(Error::shape(
                    "statistics exchange",
                    format!("device {d} sent {} values, device 0 sent {len}", p.len()),
                ));
            }
            mine.extend(p.iter().map(|v| v.to_bits()));
        }
        let all = g.world.all_gather_waiting(&mine, g.wait, &|| g.aborted.load(Ordering::Relaxed))?;
        let mut out = g.stats_all[generation].write();
        out.clear();
        out.extend(all.into_iter().map(f64::from_bits));
        Ok(())
    }
}

/// A plain, blocking `MPI_Allreduce` (sum) of `send` into `recv` over every process of
/// `world`: the reference `bench allreduce` times beside the exchange, in the same run,
/// with MPI's own algorithms for it (its non-blocking `MPI_Iallreduce` is a slower, other
/// code path). Never used to train: the order of its additions is MPI's, and it blocks
/// (a benchmark is ended by the launcher if a process dies).
pub fn plain_all_reduce(world: &World, send: &[f32], recv: &mut [f32]) -> Result<()> {
    use mpi::collective::{CommunicatorCollectives, SystemOperation};
    let mpi = world.mpi().ok_or_else(|| Error::Mpi("MPI_Allreduce needs an MPI world".into()))?;
    if recv.len() != send.len() {
        return Err(Error::shape("MPI_Allreduce", format!("{} values into {}", send.len(), recv.len())));
    }
    let _door = mpi.port()?;
    mpi::topology::SimpleCommunicator::world().all_reduce_into(send, recv, SystemOperation::sum());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cut_at_chunks_pieces_and_their_size() {
        // 100 values, chunks at 64 (2 processes), pieces at 64 too (2 devices): 2 blocks.
        let b = blocks(100, &cut(100, 2), &cut(100, 2), 1000);
        let r: Vec<_> = b.iter().map(|b| (b.elems.clone(), b.chunk, b.piece)).collect();
        assert_eq!(r, vec![(0..64, 0, 0), (64..100, 1, 1)]);
        // 3 pieces (48, 96) and 2 chunks (64), at most 40 values.
        let b = blocks(100, &cut(100, 2), &cut(100, 3), 40);
        let r: Vec<_> = b.iter().map(|b| (b.elems.clone(), b.chunk, b.piece)).collect();
        assert_eq!(r, vec![(0..40, 0, 0), (40..48, 0, 0), (48..64, 0, 1), (64..96, 1, 1), (96..100, 1, 2)]);
    }
}
