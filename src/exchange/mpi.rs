//! The exchange between processes (the `mpi` feature): CPU devices of several processes,
//! summed bitwise as one process sums them.
//!
//! Owns [`MpiGroup`], the shared state of one run's exchange in one process, and
//! [`MpiMember`], one device thread's side of it. The step sees an exchange like every
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
//! the weights are bitwise the same on any number of processes. What crosses between
//! processes is 16-bit wherever the values are a codec's, since a codec's values are
//! exactly what its codes say:
//! - a leaf that is ONE slot (one logical replica per device, or a process's odd shard)
//!   sends the codes the slot was rounded through (`with_slot` keeps them): 2 bytes a
//!   value of the gradient, plus for fp16 one exponent byte per block of 1,024 values
//!   (one message per leaf and process);
//! - a leaf of SEVERAL slots is this process's f32 partial sum, which no 16-bit code
//!   holds (its rounding would change the sum): it still travels as f32, 4 bytes a value
//!   (e.g. the reduce-scatter of 2 × cpu:2 with R = 4; 2 × cpu:1 with R = 2 has none);
//! - the all-gather sends each process's summed chunk as the codes it is rounded to
//!   (2 bytes a value, fp16 + 1 byte a block), which every process decodes: bitwise the
//!   sum rounded as a whole, since with a codec every chunk, piece and block begins on a
//!   codec block (fp16 exponents are per block at absolute offsets);
//! - the slot's tail past the codec's encoded part (BatchNorm buffers) travels as f32
//!   in every phase, as in the codec.
//!
//! So between 2 processes of one slot each a sum hands MPI 2 bytes per gradient value in
//! each phase, against 4 (the test `sixteen_bit_gradients_cross_between_processes_as_16_bit_values`,
//! in `under_mpirun.rs`, checks the bytes counted, [`MpiGroup::bytes_sent`], against the
//! buffers' sizes).
//! Device 0 decodes what came as codes, sums and re-encodes codec block by codec block,
//! in the cache; what it costs against the bytes saved is `bench allreduce
//! --grad-compression`'s (README, "Several machines").
//!
//! Synchronized BatchNorm (`--sync-batchnorm`): [`MpiStats`], the statistics exchange,
//! gathers every logical replica's payload in replica order: the process's devices
//! through shared memory, then device 0 through `MPI_Iallgather`, waited on as the sum is.
//!
//! A sharded optimiser (`--shard-optimizer`): each device of the world owns one of P·D
//! parts of the slot ([`Exchange::owned`]) and keeps the optimiser state of its
//! parameters only; after the update the parts are all-gathered, within the process
//! through its buffer, between processes by device 0, as the sum's all-gather. The
//! weights are those of the unsharded run (the update is element by element); the
//! trainer gathers the state's parts from every process for a checkpoint.
//!
//! Faults: every wait polls the world's failure notices, the processes on this machine,
//! the launcher and this group's abort flag (`MpiWorld::wait`). A failed wait leaves
//! MPI requests pending on this group's buffers, so the group is then *abandoned*: its
//! buffers are leaked, never freed under MPI, and the process is on its way out.

use std::ops::Range;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use mpi::ffi::MPI_Request;
use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use super::codec::{Codec, Compression, BLOCK};
use super::shm::SpinBarrier;
use super::tree::{self, tree_sum};
use super::{Abort, Exchange, Host, WaitPolicy};
use crate::error::{Error, Result};
use crate::ops::batchnorm::stats::StatsExchange;
use crate::world::mpi::{MpiWorld, Port, Scalar};
use crate::world::World;

/// A sum in which each process would receive at most this many bytes in one round
/// (every other process's leaves whole; it then sums all of them itself) goes in one
/// round; a larger one in two (reduce-scatter, all-gather), which moves half as much
/// between 2 processes. Chosen by `bench allreduce` on 2 processes here: one round is the
/// faster up to 256 KiB on shared memory (26 µs against 28) and TCP (85 µs against 127).
/// The bytes are those that would travel: 16-bit codes for leaves of one slot with a
/// codec, several leaves of a process each counted.
pub const GATHER_BELOW: usize = 256 << 10;

/// The most values one message carries between processes of one machine over shared
/// memory (256 KiB: each message is copied once, and fewer are cheaper), and over a
/// network (64,000 bytes, under Open MPI's TCP eager limit of 64 KiB, so that no message
/// waits for a rendezvous). Measured at 4 MiB on 2 processes here, busbw against
/// `MPI_Allreduce`'s: shared memory 1.2-1.4× with 64 Ki values, 0.9-1.3× with 16,000;
/// TCP 1.1-1.3× with 16,000, 0.7-1.1× with 64 Ki. Summing one block overlaps the
/// arrival of the next. With a codec a block keeps its number of values, rounded down
/// to whole codec blocks (at least one): 64 Ki, 15,360 (30 KiB of codes, or 60 KiB of an
/// f32 partial sum), 1,024 (2 KiB of codes; 4 KiB of f32, just over the eager limit).
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

/// Tag of the all-gather's messages, and of its fp16 exponents; a leaf's messages carry
/// `TAG_LEAF + its index`, its fp16 exponents `TAG_LEAF_EXPS + its index`.
const TAG_SUM: c_int = 90;
const TAG_SUM_EXPS: c_int = 91;
/// Tag of a sharded optimiser's parameter all-gather.
const TAG_PARAMS: c_int = 92;
const TAG_LEAF: c_int = 100;
const TAG_LEAF_EXPS: c_int = TAG_LEAF + MAX_LEAVES as c_int;
/// MPI guarantees tags up to 32767; the notices of `world::mpi` use 19539, above both
/// ranges of leaf tags (100..9100, 9100..18100).
const MAX_LEAVES: usize = 9_000;

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
    travel: Travel,
}

/// How a leaf's values cross between processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Travel {
    /// As f32: without a codec, or a partial sum of several slots (not a codec's values).
    F32,
    /// One slot, rounded to the codec: its 16-bit codes (and fp16 exponents), which hold
    /// those values exactly, then its f32 tail.
    Codes,
}

/// The 16-bit codes of a run of the encoded part of a slot (or of the sum) that begins on
/// a codec block, and for fp16 one exponent per [`BLOCK`] of them (bf16: none): buffers
/// of this group that MPI sends from and receives into, encoded and decoded in place by
/// `Codec::encode_codes` and `Codec::decode_codes`.
#[derive(Default)]
struct Codes {
    half: Vec<u16>,
    exps: Vec<i8>,
}

impl Codes {
    fn new(codec: &Codec, values: usize) -> Codes {
        let exps = if codec.compression() == Compression::Fp16 { values.div_ceil(BLOCK) } else { 0 };
        Codes { half: vec![0; values], exps: vec![0; exps] }
    }
}

/// Device 0's receive buffers (and the sum's codes, which it also sends from).
struct Inbox {
    /// `values[j]` holds another process's leaf j, for this process's chunk (two rounds)
    /// or whole (one round), as received: all of it for a leaf that travels as f32, only
    /// its f32 tail for one that travels as codes (those are decoded codec block by codec
    /// block into scratch as they are summed; the rest of its buffer is never written);
    /// empty for this process's leaves.
    values: Vec<Vec<f32>>,
    /// `codes[j]`: the codes of another process's leaf j that travels as codes, over the
    /// same elements' encoded part; empty otherwise.
    codes: Vec<Codes>,
    /// With a codec, two rounds: the codes of the whole sum's encoded part: this
    /// process's chunk encoded as it is summed, the others' received.
    sum: Codes,
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
    /// Device 0's receive buffers.
    inbox: Mutex<Inbox>,
    /// The whole sum, which every device reads.
    sum: RwLock<Vec<f32>>,
    /// With 16-bit gradients: how slots and the sum are rounded and encoded, and the
    /// number of leading values it encodes (0 without).
    codec: Option<Codec>,
    encoded: usize,
    /// With a codec, for each slot of this process that is a leaf by itself: its codes,
    /// written with the slot (`with_slot`), sent in its stead.
    slot_codes: Vec<Option<RwLock<Codes>>>,
    /// Bytes of the sum's messages this process has handed MPI to send.
    bytes_sent: AtomicU64,
    /// A sharded optimiser's parts of the slot: one per device of the world, in world
    /// order (process by process), and the parameters gathered from every device.
    owned: Vec<Range<usize>>,
    gathered: RwLock<Vec<f32>>,
    /// Synchronized BatchNorm's payloads, in two generations (a fast device writes the
    /// next call's while a slow one still reads this one's): each local device's, and
    /// every logical replica's of the world, gathered by device 0.
    stats_mine: [Vec<RwLock<Vec<f64>>>; 2],
    stats_all: [RwLock<Vec<f64>>; 2],
    barrier: SpinBarrier,
    wait: WaitPolicy,
    aborted: AtomicBool,
    /// A wait gave up with requests pending on the buffers: they are never freed.
    abandoned: AtomicBool,
}

/// `len` cut into `n` ranges, each a multiple of `align` values but the last: 16 (64
/// bytes: no cache line with two writers), or with a codec its [`BLOCK`] (see
/// [`MpiGroup::new`]).
fn cut(len: usize, n: usize, align: usize) -> Vec<Range<usize>> {
    let per = len.div_ceil(n).div_ceil(align) * align;
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

impl Rounds {
    /// One round when what it would bring each process — every other process's leaves
    /// whole, `leaf_bytes` each — stays within [`GATHER_BELOW`], else two.
    fn choose(leaves: &[Leaf], processes: usize, leaf_bytes: impl Fn(&Leaf) -> usize) -> Rounds {
        let one_round = (0..processes)
            .map(|p| leaves.iter().filter(|l| l.owner != p).map(&leaf_bytes).fold(0usize, usize::saturating_add))
            .max()
            .unwrap_or(0);
        match one_round <= GATHER_BELOW {
            true => Rounds::One,
            false => Rounds::Two,
        }
    }
}

/// The leaves of the world's tree over `shards` logical replicas, `processes` owning
/// consecutive equal runs of them; with a codec a leaf of one slot travels as its codes.
fn world_leaves(shards: usize, processes: usize, coded: bool) -> Result<Vec<Leaf>> {
    let per_process = shards / processes;
    let owners: Vec<Range<usize>> = (0..processes).map(|q| q * per_process..(q + 1) * per_process).collect();
    let leaves: Vec<Leaf> = tree::leaves(shards, &owners)
        .into_iter()
        .map(|r| Leaf {
            owner: r.start / per_process,
            travel: match coded && r.len() == 1 {
                true => Travel::Codes,
                false => Travel::F32,
            },
            shards: r,
        })
        .collect();
    if leaves.len() > MAX_LEAVES {
        return Err(Error::config(
            "replicas",
            format!("{shards} logical replicas make more partial sums than MPI tags"),
        ));
    }
    Ok(leaves)
}

/// The most values a block carries for a slot of `len` values: [`EAGER_BLOCK`] for the
/// smallest slots, else by transport; with a codec, whole codec blocks (at least one).
fn block_len(len: usize, shared_memory: bool, coded: bool) -> usize {
    let block = match (len <= EAGER_BELOW, shared_memory) {
        (true, _) => EAGER_BLOCK,
        (false, true) => BLOCK_SHARED,
        (false, false) => BLOCK_NETWORK,
    };
    if coded {
        (block / BLOCK).max(1) * BLOCK
    } else {
        block
    }
}

impl Inbox {
    /// Process `process`'s receive buffers over `range` of the slot (its chunk in two
    /// rounds, all of it in one), of which the first `encoded` values are a codec's.
    fn new(
        leaves: &[Leaf],
        process: usize,
        range: Range<usize>,
        codec: Option<Codec>,
        encoded: usize,
        rounds: Rounds,
    ) -> Inbox {
        let theirs = |l: &Leaf| l.owner != process;
        Inbox {
            values: leaves.iter().map(|l| if theirs(l) { vec![0.0; range.len()] } else { Vec::new() }).collect(),
            codes: leaves
                .iter()
                .map(|l| match (codec, theirs(l) && l.travel == Travel::Codes) {
                    (Some(c), true) => Codes::new(&c, clip(&range, encoded).len()),
                    _ => Codes::default(),
                })
                .collect(),
            sum: match (codec, rounds) {
                (Some(c), Rounds::Two) => Codes::new(&c, encoded),
                _ => Codes::default(),
            },
        }
    }
}

/// Device 0's view of one sum's buffers while it runs the rounds: what it sends (read
/// under their guards) and what it receives into and writes (cut block by block), each
/// indexed by leaf `j` or block `i`; block `k` of `held` is the k-th this process sums.
struct Views<'a> {
    /// This process's slots, its leaves' partial sums (`MpiGroup::partial`), and the
    /// codes of its slots that travel as codes.
    slots: Vec<&'a [f32]>,
    partial: Vec<Vec<&'a [f32]>>,
    slot_codes: Vec<Option<&'a Codes>>,
    /// The blocks this process sums, and the first element of the inbox's range.
    held: Vec<usize>,
    base: usize,
    /// `inboxes[j][k]`: other process's leaf j over held block k (its f32 values).
    inboxes: Vec<Vec<&'a mut [f32]>>,
    /// `codes_in[j]`: for another process's leaf j that travels as codes, its codes
    /// held block by held block, and its exponents.
    codes_in: Vec<(Vec<&'a mut [u16]>, &'a mut [i8])>,
    /// The whole sum block by block; with a codec in two rounds, its codes block by
    /// block and (fp16) its exponents chunk by chunk.
    sum_blocks: Vec<&'a mut [f32]>,
    sum_codes: Vec<&'a mut [u16]>,
    sum_exps: Vec<&'a mut [i8]>,
    /// This process's leaves, the others', the others' that travel as codes, the other
    /// processes.
    mine: Vec<usize>,
    theirs: Vec<usize>,
    coded_theirs: Vec<usize>,
    peers: Vec<usize>,
    /// One codec block of each of `coded_theirs`, decoded.
    scratch: Vec<Vec<f32>>,
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
        wait: WaitPolicy,
        codec: Option<Codec>,
    ) -> Result<MpiGroup<'w>> {
        let mpi = world.mpi().ok_or_else(|| Error::Mpi("the exchange between processes needs an MPI world".into()))?;
        let (process, processes) = (world.process(), world.size());
        let in_world = processes * devices;
        if devices == 0 || shards == 0 || !shards.is_multiple_of(in_world) {
            return Err(Error::config(
                "replicas",
                format!(
                    "{shards} logical replicas cannot be shared evenly by {in_world} devices \
                     ({processes} processes × {devices})"
                ),
            ));
        }
        let encoded = codec.map_or(0, |c| c.encoded_len().min(len));
        let leaves = world_leaves(shards, processes, codec.is_some())?;
        let rounds = Rounds::choose(&leaves, processes, |l| match (l.travel, codec) {
            (Travel::Codes, Some(c)) => coded_bytes(&c, encoded, 0..len),
            _ => 4 * len,
        });
        // With a codec, every chunk, piece and block begins on a codec block, so that a
        // chunk's or a block's sum is encoded as the whole sum's elements are (fp16's
        // exponents are per block) and each message's exponents are whole.
        let align = if codec.is_some() { BLOCK } else { 16 };
        let pieces = cut(len, devices, align);
        let chunks = match rounds {
            Rounds::One => std::iter::once(0..len).collect(),
            Rounds::Two => cut(len, processes, align),
        };
        let blocks = blocks(len, &chunks, &pieces, block_len(len, mpi.shared_memory(), codec.is_some()));
        let partial = leaves
            .iter()
            .map(|l| match l.owner == process && l.shards.len() > 1 {
                true => pieces.iter().map(|p| RwLock::new(vec![0.0; p.len()])).collect(),
                false => Vec::new(),
            })
            .collect();
        let inbox_range = match rounds {
            Rounds::One => 0..len,
            Rounds::Two => chunks[process].clone(),
        };
        let inbox = Inbox::new(&leaves, process, inbox_range, codec, encoded, rounds);
        let mine = process * (shards / processes)..(process + 1) * (shards / processes);
        let slot_codes = mine
            .clone()
            .map(|s| match (codec, leaves.iter().any(|l| l.shards == (s..s + 1))) {
                (Some(c), true) => Some(RwLock::new(Codes::new(&c, encoded))),
                _ => None,
            })
            .collect();
        Ok(MpiGroup {
            world: mpi,
            process,
            processes,
            devices,
            per_device: shards / in_world,
            len,
            total: shards,
            slots: mine.map(|_| RwLock::new(vec![0.0; len])).collect(),
            leaves,
            partial,
            pieces,
            chunks,
            rounds,
            blocks,
            inbox: Mutex::new(inbox),
            sum: RwLock::new(vec![0.0; len]),
            codec,
            encoded,
            slot_codes,
            bytes_sent: AtomicU64::new(0),
            owned: cut(len, in_world, 16),
            gathered: RwLock::new(vec![0.0; len]),
            stats_mine: [0, 1].map(|_| (0..devices).map(|_| RwLock::new(Vec::new())).collect()),
            stats_all: [0, 1].map(|_| RwLock::new(Vec::new())),
            barrier: SpinBarrier::new(devices, wait),
            wait,
            aborted: AtomicBool::new(false),
            abandoned: AtomicBool::new(false),
        })
    }

    /// The handle of local device thread `device`.
    pub fn member(&self, device: usize) -> MpiMember<'_, 'w> {
        assert!(device < self.devices, "device {device} of {}", self.devices);
        MpiMember { group: self, device }
    }

    /// Local device thread `device`'s side of the statistics exchange.
    pub fn stats(&self, device: usize) -> MpiStats<'_, 'w> {
        assert!(device < self.devices, "device {device} of {}", self.devices);
        MpiStats { group: self, device, calls: std::sync::atomic::AtomicUsize::new(0) }
    }

    /// Bytes of the sum's messages this process has handed MPI to send so far (the
    /// statistics exchange's aside): what `bench allreduce` reports and the tests check
    /// against the buffers' sizes.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
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

    /// The sum's rounds between processes, device 0's part (the order below is the
    /// order both sides post their messages in, which MPI matches in order for one
    /// source and tag): every other process's leaves received, this process's sent,
    /// the other chunks of the sum received (two rounds); then each block of this
    /// process's chunk summed as soon as it is there and sent on; then every request
    /// waited for and the others' chunks decoded.
    ///
    /// The buffers MPI is handed are this group's, held under the guards taken here
    /// until every request has completed in a wait; if a wait gives up, the group is
    /// abandoned and its buffers leaked (Drop), never freed under MPI. A buffer being
    /// sent is not written until its send completes; a buffer being received into is
    /// neither read nor written by anyone until its receive does.
    fn rounds_with(&self, port: &mut Port) -> Result<()> {
        let slot_guards: Vec<_> = self.slots.iter().map(|s| s.read()).collect();
        let partial_guards: Vec<Vec<_>> = self.partial.iter().map(|p| p.iter().map(|b| b.read()).collect()).collect();
        let code_guards: Vec<_> = self.slot_codes.iter().map(|c| c.as_ref().map(|c| c.read())).collect();
        let mut inbox = self.inbox.lock();
        let mut sum = self.sum.write();
        let mut v = self.views(&slot_guards, &partial_guards, &code_guards, &mut inbox, &mut sum);
        let mut arriving = self.receive_leaves(port, &mut v)?;
        let mut rest = self.send_leaves(port, &v)?;
        self.receive_sum(port, &mut v, &mut rest)?;
        let aborted = || self.aborted.load(Ordering::Relaxed);
        for (k, arriving) in arriving.iter_mut().enumerate() {
            self.world.wait(port, arriving, self.wait, &aborted)?;
            match &self.codec {
                None => self.sum_block(port, &mut v, k, &mut rest)?,
                Some(codec) => self.sum_block_coded(port, codec, &mut v, k, &mut rest)?,
            }
        }
        if self.two_coded() && self.fp16() && !v.sum_exps[self.process].is_empty() {
            for &q in &v.peers {
                // SAFETY: this chunk's exponents are all written above, not again this step.
                rest.push(unsafe { self.isend(port, &*v.sum_exps[self.process], q, TAG_SUM_EXPS)? });
            }
        }
        self.world.wait(port, &mut rest, self.wait, &aborted)?;
        self.decode_sum(&mut v);
        Ok(())
    }

    /// True with a codec in two rounds: the sum's chunks travel as codes.
    fn two_coded(&self) -> bool {
        self.rounds == Rounds::Two && self.codec.is_some()
    }

    /// True with the fp16 codec, whose codes come with exponents.
    fn fp16(&self) -> bool {
        self.codec.is_some_and(|c| c.compression() == Compression::Fp16)
    }

    /// Device 0's views of the buffers under the guards of [`MpiGroup::rounds_with`].
    fn views<'a>(
        &self,
        slot_guards: &'a [RwLockReadGuard<'_, Vec<f32>>],
        partial_guards: &'a [Vec<RwLockReadGuard<'_, Vec<f32>>>],
        code_guards: &'a [Option<RwLockReadGuard<'_, Codes>>],
        inbox: &'a mut Inbox,
        sum: &'a mut [f32],
    ) -> Views<'a> {
        let e = self.encoded;
        let base = match self.rounds {
            Rounds::One => 0,
            Rounds::Two => self.chunks[self.process].start,
        };
        let held: Vec<usize> = (0..self.blocks.len()).filter(|&i| self.chunk_holds(&self.blocks[i])).collect();
        let inboxes = (inbox.values.iter_mut().zip(&self.leaves))
            .map(|(v, leaf)| match leaf.owner == self.process {
                true => Vec::new(),
                false => split_from(v, base, &self.blocks, |b| self.chunk_holds(b)),
            })
            .collect();
        let codes_in = (inbox.codes.iter_mut().zip(&self.leaves))
            .map(|(c, leaf)| {
                let coded = leaf.owner != self.process && leaf.travel == Travel::Codes;
                let lens = held.iter().map(|&i| clip(&self.blocks[i].elems, e).len());
                (split_lens(&mut c.half, coded.then_some(lens)), &mut c.exps[..])
            })
            .collect();
        let (sum_codes, sum_exps) = {
            let Codes { half, exps } = &mut inbox.sum;
            let lens = self.blocks.iter().map(|b| clip(&b.elems, e).len());
            let exp_lens = self.chunks.iter().map(|c| self.exps_of(c).len());
            let two_coded = self.two_coded();
            (
                split_lens(half, two_coded.then_some(lens)),
                split_lens(exps, (two_coded && self.fp16()).then_some(exp_lens)),
            )
        };
        let all = 0..self.leaves.len();
        let theirs: Vec<usize> = all.clone().filter(|&j| self.leaves[j].owner != self.process).collect();
        let coded_theirs: Vec<usize> =
            theirs.iter().copied().filter(|&j| self.leaves[j].travel == Travel::Codes).collect();
        Views {
            slots: slot_guards.iter().map(|g| g.as_slice()).collect(),
            partial: partial_guards.iter().map(|p| p.iter().map(|g| g.as_slice()).collect()).collect(),
            slot_codes: code_guards.iter().map(|g| g.as_deref()).collect(),
            held,
            base,
            inboxes,
            codes_in,
            sum_blocks: split_blocks(sum, &self.blocks),
            sum_codes,
            sum_exps,
            mine: all.filter(|&j| self.leaves[j].owner == self.process).collect(),
            scratch: coded_theirs.iter().map(|_| vec![0.0; BLOCK]).collect(),
            theirs,
            coded_theirs,
            peers: (0..self.processes).filter(|&q| q != self.process).collect(),
        }
    }

    /// Posts the receives of every other process's leaves, block by block of this
    /// process's chunk (a block's codes, if any, before its f32 values, if any): the
    /// requests of each held block, in `held` order (a leaf's fp16 exponents with the
    /// first block, before any block is decoded).
    fn receive_leaves(&self, port: &mut Port, v: &mut Views<'_>) -> Result<Vec<Vec<MPI_Request>>> {
        let e = self.encoded;
        let mut arriving: Vec<Vec<MPI_Request>> =
            (0..v.held.len()).map(|_| Vec::with_capacity(v.theirs.len())).collect();
        for &j in &v.theirs {
            let owner = self.leaves[j].owner;
            let (codes, exps) = &mut v.codes_in[j];
            if self.leaves[j].travel == Travel::Codes && !exps.is_empty() {
                // SAFETY: an inbox buffer, untouched until this receive completes (or leaked);
                // waited for with the first block, before any block is decoded.
                arriving[0].push(unsafe { port.irecv(exps, owner, TAG_LEAF_EXPS + j as c_int)? });
            }
            for (k, (here, block)) in arriving.iter_mut().zip(v.inboxes[j].iter_mut()).enumerate() {
                let values = match self.leaves[j].travel {
                    Travel::F32 => &mut **block,
                    Travel::Codes => {
                        if !codes[k].is_empty() {
                            // SAFETY: as for the exponents.
                            here.push(unsafe { port.irecv(&mut *codes[k], owner, TAG_LEAF + j as c_int)? });
                        }
                        &mut block[clip(&self.blocks[v.held[k]].elems, e).len()..]
                    }
                };
                if !values.is_empty() {
                    // SAFETY: an inbox block, untouched until this receive completes (or leaked).
                    here.push(unsafe { port.irecv(values, owner, TAG_LEAF + j as c_int)? });
                }
            }
        }
        Ok(arriving)
    }

    /// Posts the sends of this process's leaves to every process that sums their
    /// blocks (for each peer: its fp16 exponents, then block by block each leaf's codes
    /// and f32 values); their requests.
    fn send_leaves(&self, port: &mut Port, v: &Views<'_>) -> Result<Vec<MPI_Request>> {
        let e = self.encoded;
        let mut sent = Vec::new();
        for &q in &v.peers {
            let sent_to_q = match self.rounds {
                Rounds::One => 0..self.len,
                Rounds::Two => self.chunks[q].clone(),
            };
            for &j in v.mine.iter().filter(|&&j| self.fp16() && self.leaves[j].travel == Travel::Codes) {
                let exps = &self.codes_of(j, &v.slot_codes).exps[self.exps_of(&sent_to_q)];
                if !exps.is_empty() {
                    // SAFETY: a slot's codes, only read (under its guard) this step.
                    sent.push(unsafe { self.isend(port, exps, q, TAG_LEAF_EXPS + j as c_int)? });
                }
            }
            for b in self.blocks.iter().filter(|b| self.rounds == Rounds::One || b.chunk == q) {
                for &j in &v.mine {
                    let values = match self.leaves[j].travel {
                        Travel::F32 => self.own(j, b, &v.slots, &v.partial),
                        Travel::Codes => {
                            let half = &self.codes_of(j, &v.slot_codes).half[clip(&b.elems, e)];
                            if !half.is_empty() {
                                // SAFETY: a slot's codes, only read (under its guard) this step.
                                sent.push(unsafe { self.isend(port, half, q, TAG_LEAF + j as c_int)? });
                            }
                            &self.own(j, b, &v.slots, &v.partial)[half.len()..]
                        }
                    };
                    if !values.is_empty() {
                        // SAFETY: a slot or partial sum, only read (under its guard) this step.
                        sent.push(unsafe { self.isend(port, values, q, TAG_LEAF + j as c_int)? });
                    }
                }
            }
        }
        Ok(sent)
    }

    /// In two rounds, posts the receives of the other processes' summed chunks (each
    /// peer's fp16 exponents, then block by block its codes and f32 values) into `rest`.
    fn receive_sum(&self, port: &mut Port, v: &mut Views<'_>, rest: &mut Vec<MPI_Request>) -> Result<()> {
        if self.rounds != Rounds::Two {
            return Ok(());
        }
        for &q in &v.peers {
            if self.two_coded() && self.fp16() && !v.sum_exps[q].is_empty() {
                // SAFETY: process q's exponents, untouched until the receive completes.
                rest.push(unsafe { port.irecv(&mut *v.sum_exps[q], q, TAG_SUM_EXPS)? });
            }
            for i in (0..self.blocks.len()).filter(|&i| self.blocks[i].chunk == q) {
                let n = if self.two_coded() { v.sum_codes[i].len() } else { 0 };
                if n > 0 {
                    // SAFETY: as for the exponents.
                    rest.push(unsafe { port.irecv(&mut *v.sum_codes[i], q, TAG_SUM)? });
                }
                if n < v.sum_blocks[i].len() {
                    // SAFETY: a block of process q's chunk, which this process neither
                    // reads nor writes until the receive completes (or leaks it).
                    rest.push(unsafe { port.irecv(&mut v.sum_blocks[i][n..], q, TAG_SUM)? });
                }
            }
        }
        Ok(())
    }

    /// Held block `k`, every leaf of it there, summed in the tree's top and (two rounds)
    /// sent on to every peer: without a codec.
    fn sum_block(&self, port: &mut Port, v: &mut Views<'_>, k: usize, rest: &mut Vec<MPI_Request>) -> Result<()> {
        let i = v.held[k];
        let b = &self.blocks[i];
        let values: Vec<(Range<usize>, &[f32])> = (0..self.leaves.len())
            .map(|j| {
                let x: &[f32] = match self.leaves[j].owner == self.process {
                    true => self.own(j, b, &v.slots, &v.partial),
                    false => &*v.inboxes[j][k],
                };
                (self.leaves[j].shards.clone(), x)
            })
            .collect();
        tree::sum_leaves(self.total, &values, v.sum_blocks[i]);
        if self.rounds == Rounds::Two {
            for &q in &v.peers {
                // SAFETY: this block is summed above and not written again this step.
                rest.push(unsafe { self.isend(port, &*v.sum_blocks[i], q, TAG_SUM)? });
            }
        }
        Ok(())
    }

    /// Held block `k` with a codec: codec block by codec block, so that what is decoded,
    /// summed, encoded and decoded again stays in the cache — each leaf that came as
    /// codes decoded into scratch, the tree's top summed, the sum rounded to the codec
    /// (its codes kept, in two rounds, and sent on with its f32 tail).
    fn sum_block_coded(
        &self,
        port: &mut Port,
        codec: &Codec,
        v: &mut Views<'_>,
        k: usize,
        rest: &mut Vec<MPI_Request>,
    ) -> Result<()> {
        let (e, i) = (self.encoded, v.held[k]);
        let b = &self.blocks[i];
        let n = clip(&b.elems, e).len();
        let (mut one_half, mut one_exps) = ([0u16; BLOCK], [0i8; 1]);
        for x in b.elems.clone().step_by(BLOCK) {
            let sub = x..(x + BLOCK).min(b.elems.end);
            let (at, enc) = (sub.start - b.elems.start, clip(&sub, e).len());
            for (&j, scratch) in v.coded_theirs.iter().zip(v.scratch.iter_mut()) {
                let (codes, exps) = &v.codes_in[j];
                let exps = &exps[((sub.start - v.base) / BLOCK).min(exps.len())..];
                codec.decode_codes(&codes[k][at.min(n)..at.min(n) + enc], exps, 0, &mut scratch[..enc]);
                scratch[enc..sub.len()].copy_from_slice(&v.inboxes[j][k][at + enc..at + sub.len()]);
            }
            let values: Vec<(Range<usize>, &[f32])> = (0..self.leaves.len())
                .map(|j| {
                    let x: &[f32] = match (self.leaves[j].owner == self.process, self.leaves[j].travel) {
                        (true, _) => &self.own(j, b, &v.slots, &v.partial)[at..at + sub.len()],
                        (false, Travel::F32) => &v.inboxes[j][k][at..at + sub.len()],
                        (false, Travel::Codes) => {
                            let slot = v.coded_theirs.iter().position(|&c| c == j).expect("a coded leaf");
                            &v.scratch[slot][..sub.len()]
                        }
                    };
                    (self.leaves[j].shards.clone(), x)
                })
                .collect();
            let out = &mut v.sum_blocks[i][at..at + sub.len()];
            tree::sum_leaves(self.total, &values, out);
            if enc > 0 {
                let (half, exps): (&mut [u16], &mut [i8]) = match self.rounds {
                    Rounds::Two => {
                        let exps = match v.sum_exps.get_mut(self.process) {
                            Some(exps) => {
                                let from = (self.block_exps(b) + at / BLOCK).min(exps.len());
                                &mut exps[from..]
                            }
                            None => &mut [][..], // bf16: no exponents
                        };
                        (&mut v.sum_codes[i][at..at + enc], exps)
                    }
                    Rounds::One => (&mut one_half[..enc], &mut one_exps[..]),
                };
                codec.encode_codes(&out[..enc], half, exps);
                codec.decode_codes(half, exps, 0, &mut out[..enc]);
            }
        }
        if self.rounds == Rounds::Two {
            for &q in &v.peers {
                if n > 0 {
                    // SAFETY: this block's codes are written above and not again this step.
                    rest.push(unsafe { self.isend(port, &*v.sum_codes[i], q, TAG_SUM)? });
                }
                if n < v.sum_blocks[i].len() {
                    // SAFETY: this block is summed above and not written again this step.
                    rest.push(unsafe { self.isend(port, &v.sum_blocks[i][n..], q, TAG_SUM)? });
                }
            }
        }
        Ok(())
    }

    /// With a codec in two rounds, the other processes' chunks of the sum decoded (this
    /// process's own was rounded as it was summed, as was all of it in one round).
    fn decode_sum(&self, v: &mut Views<'_>) {
        let (Some(codec), Rounds::Two) = (&self.codec, self.rounds) else { return };
        for (i, b) in self.blocks.iter().enumerate().filter(|(_, b)| b.chunk != self.process) {
            let exps = v.sum_exps.get(b.chunk).map_or(&[][..], |x| &x[self.block_exps(b).min(x.len())..]);
            let n = v.sum_codes[i].len();
            codec.decode_codes(v.sum_codes[i], exps, 0, &mut v.sum_blocks[i][..n]);
        }
    }

    /// The parameters (`0..np` of the slot) that process `q`'s devices own: their parts,
    /// which are consecutive.
    fn process_owned(&self, q: usize, np: usize) -> Range<usize> {
        let (first, last) = (&self.owned[q * self.devices], &self.owned[(q + 1) * self.devices - 1]);
        first.start.min(np)..last.end.min(np)
    }

    /// Device 0's part of a sharded optimiser's all-gather: this process's devices' parts
    /// of `gathered` to every other process, theirs into it. On failure the group is
    /// aborted and, with requests pending on `gathered`, abandoned.
    fn gather_params_across(&self, np: usize) -> Result<()> {
        let result = self.world.port().and_then(|mut port| {
            let mut gathered = self.gathered.write();
            let lens = (0..self.processes).map(|q| self.process_owned(q, np).len());
            let mut parts = split_lens(&mut gathered, Some(lens));
            let mut reqs = Vec::with_capacity(2 * self.processes);
            let posted = (|| -> Result<()> {
                for q in (0..self.processes).filter(|&q| q != self.process) {
                    if !parts[self.process].is_empty() {
                        // SAFETY: this process's part, written before the barrier and not
                        // again until the wait below completes (or the group is abandoned).
                        reqs.push(unsafe { port.isend(&*parts[self.process], q, TAG_PARAMS)? });
                    }
                    if !parts[q].is_empty() {
                        // SAFETY: process q's part, untouched until the receive completes.
                        reqs.push(unsafe { port.irecv(&mut *parts[q], q, TAG_PARAMS)? });
                    }
                }
                Ok(())
            })();
            let r = posted.and_then(|()| {
                self.world.wait(&mut port, &mut reqs, self.wait, &|| self.aborted.load(Ordering::Relaxed))
            });
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

    /// Posts the send of `buf` to `peer` through `port`, counting its bytes.
    ///
    /// # Safety
    /// As `Port::isend`.
    unsafe fn isend<T: Scalar>(&self, port: &mut Port, buf: &[T], peer: usize, tag: c_int) -> Result<MPI_Request> {
        // SAFETY: the caller's promise, passed on.
        let req = unsafe { port.isend(buf, peer, tag)? };
        self.bytes_sent.fetch_add(std::mem::size_of_val(buf) as u64, Ordering::Relaxed);
        Ok(req)
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

    /// The codes of this process's leaf `j`, one slot that travels as codes.
    fn codes_of<'a>(&self, j: usize, slot_codes: &[Option<&'a Codes>]) -> &'a Codes {
        slot_codes[self.leaves[j].shards.start - self.first_shard()].expect("a leaf that travels as codes has them")
    }

    /// The fp16 exponents of the encoded part of `elems` (which begins on a codec block):
    /// indices into a whole slot's exponents.
    fn exps_of(&self, elems: &Range<usize>) -> Range<usize> {
        let enc = clip(elems, self.encoded);
        match enc.is_empty() {
            true => 0..0,
            false => enc.start / BLOCK..enc.end.div_ceil(BLOCK),
        }
    }

    /// Where block `b`'s fp16 exponents begin among those of its chunk.
    fn block_exps(&self, b: &Block) -> usize {
        (b.elems.start - self.chunks[b.chunk].start) / BLOCK
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

/// The encoded part of `elems`, when the first `encoded` values of a slot are encoded.
fn clip(elems: &Range<usize>, encoded: usize) -> Range<usize> {
    elems.start.min(encoded)..elems.end.min(encoded)
}

/// Bytes that `elems` of a slot (beginning on a codec block) take as codes: 2 a value
/// of the encoded part, 1 an fp16 block, 4 a value past it.
fn coded_bytes(codec: &Codec, encoded: usize, elems: Range<usize>) -> usize {
    let enc = clip(&elems, encoded).len();
    let exps = if codec.compression() == Compression::Fp16 { enc.div_ceil(BLOCK) } else { 0 };
    2 * enc + exps + 4 * (elems.len() - enc)
}

/// `v` cut into consecutive slices of `lens` (from its start; the rest is left out), or
/// none at all for `None`.
fn split_lens<T>(v: &mut [T], lens: Option<impl Iterator<Item = usize>>) -> Vec<&mut [T]> {
    let mut out = Vec::new();
    let mut rest = v;
    for n in lens.into_iter().flatten() {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
        out.push(head);
        rest = tail;
    }
    out
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
        let inbox = self.inbox.get_mut();
        for v in &mut inbox.values {
            std::mem::forget(std::mem::take(v));
        }
        for c in inbox.codes.iter_mut().chain([&mut inbox.sum]) {
            std::mem::forget(std::mem::take(c));
        }
        for c in self.slot_codes.iter_mut().flatten() {
            std::mem::forget(std::mem::take(c.get_mut()));
        }
        std::mem::forget(std::mem::take(self.sum.get_mut()));
        std::mem::forget(std::mem::take(self.gathered.get_mut()));
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

    #[cfg(any(test, feature = "cuda"))]
    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

/// One local device thread's side of an [`MpiGroup`].
pub struct MpiMember<'g, 'w> {
    group: &'g MpiGroup<'w>,
    device: usize,
}

impl MpiMember<'_, '_> {
    /// Returns when every local device thread has called it (benchmarks).
    #[cfg(feature = "cli")]
    pub fn barrier(&self) -> Result<()> {
        self.group.barrier.wait(&self.group.aborted)
    }
}

impl Exchange for MpiMember<'_, '_> {
    type Mem = Host;

    fn width(&self) -> usize {
        self.group.len
    }

    /// This device's `local`-th slot; with a codec, rounded to its values once written
    /// (through the slot's own codes, which then travel in its stead, where it is a leaf
    /// by itself).
    fn with_slot<T>(&mut self, local: usize, f: impl FnOnce(&mut [f32]) -> T) -> T {
        let g = self.group;
        let k = g.per_device;
        assert!(local < k, "slot {local} of a device with {k} logical replicas");
        let index = self.device * k + local;
        let mut slot = g.slots[index].write();
        let out = f(&mut slot);
        if let Some(codec) = &g.codec {
            match &g.slot_codes[index] {
                Some(codes) => {
                    let Codes { half, exps } = &mut *codes.write();
                    let encoded = &mut slot[..g.encoded];
                    codec.encode_codes(encoded, half, exps);
                    codec.decode_codes(half, exps, 0, encoded);
                }
                None => round(codec, &mut slot),
            }
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
        }
        g.barrier.wait(&g.aborted)
    }

    fn for_each_sum(&self, mut f: impl FnMut(usize, &[f32]) -> Result<()>) -> Result<()> {
        f(0, &self.group.sum.read())
    }

    /// This device's part of the world's slot, one of P·D (cut as the pieces are): a
    /// sharded optimiser keeps the state of its parameters only.
    fn owned(&self) -> Range<usize> {
        self.group.owned[self.group.process * self.group.devices + self.device].clone()
    }

    /// Every device's owned parameters to every device of the world: each device puts
    /// its part into the process's buffer, device 0 exchanges the process's parts with
    /// every other process's (point to point, as the sum's messages, waited on as they
    /// are), and each device copies the whole back.
    fn all_gather(&mut self, params: &mut [f32]) -> Result<()> {
        let g = self.group;
        let np = params.len();
        if np > g.len {
            return Err(Error::shape("parameter all-gather", format!("{np} parameters in slots of {} values", g.len)));
        }
        let mine = self.owned();
        let mine = mine.start.min(np)..mine.end.min(np);
        g.gathered.write()[mine.clone()].copy_from_slice(&params[mine]);
        g.barrier.wait(&g.aborted)?;
        if self.device == 0 && g.processes > 1 {
            g.gather_params_across(np)?;
        }
        g.barrier.wait(&g.aborted)?;
        params.copy_from_slice(&g.gathered.read()[..np]);
        Ok(())
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

    fn all_gather(&self, shard: usize, mine: &[f64], all: &mut Vec<f64>) -> Result<()> {
        let g = self.group;
        if g.per_device != 1 || shard != g.first_shard() + self.device {
            return Err(Error::config(
                "statistics exchange",
                format!(
                    "device {} of process {} was handed logical replica {shard} of {}: synchronized BatchNorm needs one \
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
#[cfg(feature = "cli")]
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
mod under_mpirun;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cut_at_chunks_pieces_and_their_size() {
        // 100 values, chunks at 64 (2 processes), pieces at 64 too (2 devices): 2 blocks.
        let b = blocks(100, &cut(100, 2, 16), &cut(100, 2, 16), 1000);
        let r: Vec<_> = b.iter().map(|b| (b.elems.clone(), b.chunk, b.piece)).collect();
        assert_eq!(r, vec![(0..64, 0, 0), (64..100, 1, 1)]);
        // 3 pieces (48, 96) and 2 chunks (64), at most 40 values.
        let b = blocks(100, &cut(100, 2, 16), &cut(100, 3, 16), 40);
        let r: Vec<_> = b.iter().map(|b| (b.elems.clone(), b.chunk, b.piece)).collect();
        assert_eq!(r, vec![(0..40, 0, 0), (40..48, 0, 0), (48..64, 0, 1), (64..96, 1, 1), (96..100, 1, 2)]);
    }
}
