//! Gradient exchanges between GPUs: [`GpuExchange`], one GPU worker's side of the
//! exchange, over either transport.
//!
//! Owns: where a GPU worker's slots live and how they are summed. A worker running k
//! logical replicas holds k slots in one device buffer, each starting on a 256-byte
//! boundary ([`SLOT_ALIGN`]: cuBLAS picks its kernels, and so its summation order, by
//! pointer alignment, so a slot must look the same whichever replica's it is). The sum is
//! the device's slots added in shard order by kernels/buffers.cu, then the transport's
//! all-reduce across GPUs, in place. Everything is queued on the GPU (the compute stream,
//! then the transport's stream, ordered by events): the replica's one wait per step sees
//! it done.
//!
//! Two transports, one file each, chosen once per run by [`transport_for`]:
//! - [`NcclGroup`] / [`NcclMember`] (nccl_group.rs): distinct GPUs and a loadable NCCL
//!   2.18 or later, one communicator per member in non-blocking mode;
//! - [`CopyGroup`] / [`CopyMember`] (copies.rs): device-to-device copies in the CPU
//!   exchange's reduce-scatter / all-gather scheme, summed in member order.
//!
//! With a codec (`--grad-compression bf16|fp16`, [`GpuExchange::with_codec`]) the sum is
//! the codec's instead, the CPU exchange's: each of the worker's k slots is encoded on the
//! device into its 16-bit wire (kernels/codec.cu, which mirrors `exchange::codec` bit for
//! bit), the transport all-gathers every member's wires, so that every GPU holds all R
//! logical replicas' wires in replica order, and every GPU runs the same reduce kernel on
//! those same bytes — each wire decoded, the R values added in f32 in the canonical tree
//! over replica indices (`tree::tree_sum`'s), the sum encoded — then decodes the encoded
//! sum, which the update reads. Equal bytes through one kernel give equal bits: every
//! replica reads the same sum; and the sum is a function of the R wires alone, so it is
//! bitwise the CPU exchange's on the same slots (but for which NaN a sum holding a NaN
//! gives: CUDA returns its canonical NaN), on any device count with R fixed. (The f32
//! path's order is the device's pre-sum then the transport's. NCCL's own 16-bit sum,
//! `ncclBfloat16`, would add in an order of its choosing and round every partial sum to 16
//! bits, without fp16's block scales: not the codec.) What crosses: each member receives
//! the other members' wires, (R − k)·(2 bytes per gradient value + 4 per buffer value):
//! against an NCCL ring all-reduce's 2·(w − 1)/w·4 bytes per value on w GPUs, half on two
//! GPUs (2 against 4 bytes per gradient value), equal on four, more past four, and k
//! times that with k logical replicas a GPU, which the f32 path pre-sums on the device —
//! a reduce-scatter of 16-bit codes that decodes before it adds is no NCCL collective.
//!
//! Every member must make the same calls, in the same order, as with NCCL or MPI. A group
//! is shared by reference by the run's threads; [`super::Abort::abort`] on it makes every
//! pending and future call of every member return [`Error::Aborted`].

pub mod codec;
mod copies;
mod nccl_group;

use crate::exchange::gpu::codec::WireGeom;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceSlice};

pub use copies::{CopyGroup, CopyMember};
pub use nccl_group::{new_clique_id, Clique, NcclGroup, NcclMember};

use super::codec::Codec;
use super::{Abort, Exchange, Memory};

use crate::cuda::probe::{driver_available, gpu_count};
use crate::cuda::Gpu;
use crate::error::{Error, Result};

/// Every slot of a [`GpuExchange`] starts on a multiple of this many f32 (256 bytes).
pub const SLOT_ALIGN: usize = 64;

/// Device memory: views of f32 on one GPU.
pub enum DeviceMemory {}

impl Memory for DeviceMemory {
    type View<'a> = CudaView<'a, f32>;
    type ViewMut<'a> = CudaViewMut<'a, f32>;

    fn slice<'a>(v: &CudaView<'a, f32>, range: std::ops::Range<usize>) -> CudaView<'a, f32>
    where
        Self: 'a,
    {
        v.slice(range)
    }

    fn len(v: &CudaView<'_, f32>) -> usize {
        v.len()
    }
}

/// Which transport carries a run's GPU exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Nccl,
    Copies,
}

/// NCCL when there is something to exchange (two members or more), no GPU is given twice
/// (NCCL forbids two members on one device), and the library is usable; device copies
/// otherwise.
pub fn transport_for(ordinals: &[usize]) -> Transport {
    choose_transport(ordinals, nccl_group::nccl_usable)
}

/// [`transport_for`] with the library probe given; `nccl_usable` is asked last, so it
/// loads nothing when the answer is already known.
fn choose_transport(ordinals: &[usize], nccl_usable: impl FnOnce() -> bool) -> Transport {
    let repeats = ordinals.iter().enumerate().any(|(i, o)| ordinals[..i].contains(o));
    if ordinals.len() < 2 || repeats || !nccl_usable() {
        Transport::Copies
    } else {
        Transport::Nccl
    }
}

/// A group of GPUs, over whichever transport was chosen: what a run (`with_trainer`)
/// and `bench allreduce` build, so that they are written once for both transports.
pub enum GpuGroup {
    Nccl(NcclGroup),
    Copies(CopyGroup),
}

impl GpuGroup {
    /// A group of one process's GPUs `ordinals` over `transport`, for buffers of `len`
    /// values.
    pub fn new(transport: Transport, ordinals: &[usize], len: usize) -> Result<GpuGroup> {
        Ok(match transport {
            Transport::Nccl => GpuGroup::Nccl(NcclGroup::new(ordinals, len)?),
            Transport::Copies => GpuGroup::Copies(CopyGroup::new(ordinals, len)?),
        })
    }

    /// Member `member`'s side of the group, ordered after `compute` (see the transports'
    /// `join`).
    pub fn join(&self, member: usize, compute: &Arc<CudaStream>) -> Result<GpuMember<'_>> {
        Ok(match self {
            GpuGroup::Nccl(g) => GpuMember::Nccl(g.join(member, compute)?),
            GpuGroup::Copies(g) => GpuMember::Copies(g.join(member, compute)?),
        })
    }
}

impl Abort for GpuGroup {
    fn abort(&self) {
        match self {
            GpuGroup::Nccl(g) => g.abort(),
            GpuGroup::Copies(g) => g.abort(),
        }
    }

    fn is_aborted(&self) -> bool {
        match self {
            GpuGroup::Nccl(g) => g.is_aborted(),
            GpuGroup::Copies(g) => g.is_aborted(),
        }
    }
}

/// One member of a [`GpuGroup`].
// One per device thread, held for the whole run: its size does not matter, and a box
// would put an indirection on every collective call.
#[allow(clippy::large_enum_variant)]
pub enum GpuMember<'g> {
    Nccl(NcclMember<'g>),
    Copies(CopyMember<'g>),
}

impl DeviceAllReduce for GpuMember<'_> {
    fn all_reduce_sum(&mut self, buf: &mut CudaViewMut<'_, f32>) -> Result<()> {
        match self {
            GpuMember::Nccl(m) => m.all_reduce_sum(buf),
            GpuMember::Copies(m) => m.all_reduce_sum(buf),
        }
    }

    fn all_gather_bytes(&mut self, buf: &mut CudaViewMut<'_, u8>, part: usize) -> Result<()> {
        match self {
            GpuMember::Nccl(m) => m.all_gather_bytes(buf, part),
            GpuMember::Copies(m) => m.all_gather_bytes(buf, part),
        }
    }

    fn compute_stream(&self) -> &Arc<CudaStream> {
        match self {
            GpuMember::Nccl(m) => m.compute_stream(),
            GpuMember::Copies(m) => m.compute_stream(),
        }
    }

    fn is_aborted(&self) -> bool {
        match self {
            GpuMember::Nccl(m) => m.is_aborted(),
            GpuMember::Copies(m) => m.is_aborted(),
        }
    }

    fn index_and_members(&self) -> (usize, usize) {
        match self {
            GpuMember::Nccl(m) => m.index_and_members(),
            GpuMember::Copies(m) => m.index_and_members(),
        }
    }
}

/// What a GPU exchange needs of a transport's member.
pub trait DeviceAllReduce {
    /// In place SUM all-reduce of `buf`, ordered after the work queued on the compute
    /// stream, which waits for its end; every member ends bitwise equal.
    fn all_reduce_sum(&mut self, buf: &mut CudaViewMut<'_, f32>) -> Result<()>;

    /// Every member's `part` bytes to every member: `buf` holds members·part bytes, this
    /// member's part at member·part (written by work queued on the compute stream);
    /// afterwards every member's `buf` holds every member's part, bitwise (bytes are
    /// copied, never added). Ordered after the compute stream's queued work, which waits
    /// for its end.
    fn all_gather_bytes(&mut self, buf: &mut CudaViewMut<'_, u8>, part: usize) -> Result<()>;

    /// The replica's compute stream the member was joined with.
    fn compute_stream(&self) -> &Arc<CudaStream>;

    /// True once the group was aborted.
    fn is_aborted(&self) -> bool;

    /// This member's index and the group's number of members.
    fn index_and_members(&self) -> (usize, usize);
}

/// One GPU worker's side of the gradient exchange: its slots, and a transport's member.
pub struct GpuExchange<C> {
    /// Declared first, so dropped first: a departing member finishes (or aborts) its
    /// last collective before the slots it reads are freed.
    member: C,
    /// Launches of kernels/buffers.cu on the compute stream.
    gpu: Gpu,
    /// k slots of `stride` values: slot j is `j·stride .. j·stride + width`.
    slots: CudaSlice<f32>,
    /// The sum of the k slots (`stride` values) when k > 1.
    summed: Option<CudaSlice<f32>>,
    k: usize,
    width: usize,
    stride: usize,
    /// With a codec: the wires the sum goes through.
    wires: Option<Wires>,
}

/// A GPU exchange's 16-bit wires (see the file's docs).
struct Wires {
    geom: WireGeom,
    /// Every logical replica's wire, in replica order: R = members·k wires of
    /// `geom.bytes()`, this member's k from member·k on.
    all: CudaSlice<u8>,
    /// The codec's sum of the R wires, encoded.
    reduced: CudaSlice<u8>,
    /// That sum decoded (`width` values): what the update reads.
    decoded: CudaSlice<f32>,
}

impl<C: DeviceAllReduce> GpuExchange<C> {
    /// The exchange of a worker running `k` logical replicas over slots of the member's
    /// group length, allocated on the member's compute stream.
    pub fn new(member: C, width: usize, k: usize) -> Result<GpuExchange<C>> {
        if k == 0 {
            return Err(Error::config("replicas", "a GPU worker runs at least one logical replica"));
        }
        let stream = member.compute_stream().clone();
        let stride = slot_stride(width);
        Ok(GpuExchange {
            slots: stream.alloc_zeros((k * stride).max(1))?,
            summed: if k > 1 { Some(stream.alloc_zeros(stride.max(1))?) } else { None },
            gpu: Gpu::on_stream(stream)?,
            member,
            k,
            width,
            stride,
            wires: None,
        })
    }

    /// The exchange whose slots travel encoded by `codec` (as f32 when `None`): the wires
    /// of all R logical replicas, their encoded sum and its decoding, allocated here.
    pub fn with_codec(mut self, codec: Option<Codec>) -> Result<GpuExchange<C>> {
        let Some(codec) = codec else { return Ok(self) };
        let geom = WireGeom::new(&codec, self.width);
        let (_, members) = self.member.index_and_members();
        let stream = self.member.compute_stream().clone();
        // The codec's reduce sums the device's slots with every other replica's: no f32
        // pre-sum.
        self.summed = None;
        self.wires = Some(Wires {
            all: stream.alloc_zeros(members * self.k * geom.bytes())?,
            reduced: stream.alloc_zeros(geom.bytes())?,
            decoded: stream.alloc_zeros(self.width.max(1))?,
            geom,
        });
        Ok(self)
    }
}

/// Values from one slot's start to the next's: `width` rounded up to [`SLOT_ALIGN`].
pub fn slot_stride(width: usize) -> usize {
    width.div_ceil(SLOT_ALIGN) * SLOT_ALIGN
}

impl<C: DeviceAllReduce> Exchange for GpuExchange<C> {
    type Mem = DeviceMemory;

    fn width(&self) -> usize {
        self.width
    }

    fn with_slot<T>(&mut self, local: usize, f: impl FnOnce(CudaViewMut<'_, f32>) -> T) -> T {
        assert!(local < self.k, "slot {local} of a worker with {} logical replicas", self.k);
        let start = local * self.stride;
        f(self.slots.slice_mut(start..start + self.width))
    }

    /// The device's slots in shard order (padding included: it holds zeros), then the
    /// transport's all-reduce of the first `width` values; with a codec, the wires'
    /// all-gather and the codec's sum on every member (the file's docs).
    fn sum(&mut self) -> Result<()> {
        if let Some(w) = &mut self.wires {
            let (index, members) = self.member.index_and_members();
            let part = self.k * w.geom.bytes();
            let mut mine = w.all.slice_mut(index * part..(index + 1) * part);
            self.gpu.wire_encode(&self.slots, self.stride, self.k, &mut mine, &w.geom)?;
            self.member.all_gather_bytes(&mut w.all.slice_mut(..), part)?;
            self.gpu.wire_reduce(&w.all.slice(..), members * self.k, &mut w.reduced.slice_mut(..), &w.geom)?;
            return self.gpu.wire_decode(&w.reduced.slice(..), &mut w.decoded.slice_mut(0..self.width), &w.geom);
        }
        match &mut self.summed {
            None => self.member.all_reduce_sum(&mut self.slots.slice_mut(0..self.width)),
            Some(summed) => {
                let all = self.slots.slice(0..self.k * self.stride);
                self.gpu.reduce_sum(&all, &mut summed.slice_mut(0..self.stride), self.k, 1.0)?;
                self.member.all_reduce_sum(&mut summed.slice_mut(0..self.width))
            }
        }
    }

    fn for_each_sum(&self, mut f: impl FnMut(usize, CudaView<'_, f32>) -> Result<()>) -> Result<()> {
        if let Some(w) = &self.wires {
            return f(0, w.decoded.slice(0..self.width));
        }
        let sum = self.summed.as_ref().unwrap_or(&self.slots);
        f(0, sum.slice(0..self.width))
    }

    /// This member's chunk of the slot, cut as the device copies cut a buffer
    /// (`chunk_ranges`): whole 256-byte granules.
    fn owned(&self) -> std::ops::Range<usize> {
        let (index, members) = self.member.index_and_members();
        copies::chunk_ranges(self.width, members)[index].clone()
    }

    /// The all-gather as an all-reduce of disjoint parts: the first slot (its sum was
    /// read by the update, queued before on the same stream) is filled with −0.0, this
    /// member's owned parameters are copied in, the transport sums, and the parameters are
    /// copied back. −0.0 is the exact identity of IEEE addition (x + −0 = x for every x,
    /// +0 and −0 included), so in any order of the transport's sum every element is its
    /// owner's value, bitwise. Twice the bytes of an all-gather; one call every transport
    /// has.
    fn all_gather(&mut self, mut params: CudaViewMut<'_, f32>) -> Result<()> {
        let np = params.len();
        let owned = self.owned();
        let owned = owned.start.min(np)..owned.end.min(np);
        let stream = self.member.compute_stream().clone();
        let mut buf = self.slots.slice_mut(0..self.width);
        self.gpu.fill(&mut buf, -0.0)?;
        if !owned.is_empty() {
            stream.memcpy_dtod(&params.slice(owned.clone()), &mut buf.slice_mut(owned))?;
        }
        self.member.all_reduce_sum(&mut buf)?;
        if np > 0 {
            stream.memcpy_dtod(&buf.slice(0..np), &mut params.slice_mut(0..np))?;
        }
        Ok(())
    }

    fn is_aborted(&self) -> bool {
        self.member.is_aborted()
    }
}

/// Spins, then yields, then sleeps briefly: waits of a few µs stay fast, long ones cost
/// no core (several members may share few cores).
pub(crate) struct Backoff {
    spins: u32,
    start: Instant,
}

impl Backoff {
    pub fn new() -> Self {
        Backoff { spins: 0, start: Instant::now() }
    }

    pub fn snooze(&mut self) {
        self.spins = self.spins.saturating_add(1);
        if self.spins < 1024 {
            std::hint::spin_loop();
        } else if self.start.elapsed() < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}

/// A group needs GPUs, a driver, and every ordinal to exist.
fn check_ordinals(ordinals: &[usize]) -> Result<()> {
    if ordinals.is_empty() {
        return Err(Error::config("GPU group", "no GPU given"));
    }
    driver_available()?;
    let count = gpu_count()?;
    match ordinals.iter().find(|&&o| o >= count) {
        Some(missing) => {
            Err(Error::CudaUnavailable(format!("cuda:{missing} asked for, but {count} GPU(s) are visible")))
        }
        None => Ok(()),
    }
}

/// One member's stream ordering, the same for every transport: each call runs on the
/// member's communication stream after the work queued on the replica's compute stream
/// ([`Streams::enter`]), and the compute stream's later work runs after the call
/// ([`Streams::leave`]).
struct Streams {
    ctx: Arc<CudaContext>,
    /// The replica's compute stream.
    compute: Arc<CudaStream>,
    /// This member's communication stream.
    comm: Arc<CudaStream>,
    /// Recorded on `compute`, waited on by `comm`.
    ready: CudaEvent,
    /// Recorded on `comm`, waited on by `compute`.
    done: CudaEvent,
}

impl Streams {
    /// A communication stream and its two events in `ctx` (bound to this thread), beside
    /// the replica's `compute` stream.
    fn new(ctx: Arc<CudaContext>, compute: Arc<CudaStream>) -> Result<Streams> {
        ctx.bind_to_thread()?;
        let comm = ctx.new_stream()?;
        Ok(Streams { ready: ctx.new_event(None)?, done: ctx.new_event(None)?, ctx, compute, comm })
    }

    /// Binds the context to this thread and orders the communication stream after the
    /// work queued on the compute stream.
    fn enter(&self) -> Result<()> {
        self.ctx.bind_to_thread()?;
        self.ready.record(&self.compute)?;
        self.comm.wait(&self.ready)?;
        Ok(())
    }

    /// Orders the compute stream's later work after what is queued on the communication
    /// stream.
    fn leave(&self) -> Result<()> {
        self.done.record(&self.comm)?;
        self.compute.wait(&self.done)?;
        Ok(())
    }
}

/// Member `member` joins with a compute stream of its own GPU: the stream's context.
fn check_join(ordinals: &[usize], member: usize, compute: &Arc<CudaStream>) -> Result<Arc<CudaContext>> {
    let members = ordinals.len();
    if member >= members {
        return Err(Error::config("member", format!("member {member} joined a group of {members}")));
    }
    let ctx = compute.context().clone();
    if ctx.ordinal() != ordinals[member] {
        return Err(Error::DeviceMismatch {
            op: "GPU group join",
            lhs: format!("cuda:{} (member {member})", ordinals[member]),
            rhs: format!("cuda:{} (its compute stream)", ctx.ordinal()),
        });
    }
    Ok(ctx)
}

/// A call's buffer holds the group's `len` values on the member's own GPU.
fn check_buffer<T>(
    op: &'static str,
    buf: &CudaViewMut<'_, T>,
    len: usize,
    ctx: &Arc<CudaContext>,
    member: usize,
) -> Result<()> {
    if buf.len() != len {
        return Err(Error::shape(op, format!("buffer of {} values for a group of {len}", buf.len())));
    }
    let theirs = buf.stream().context();
    if theirs.cu_ctx() != ctx.cu_ctx() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: format!("cuda:{} (member {member})", ctx.ordinal()),
            rhs: format!("cuda:{} (the buffer)", theirs.ordinal()),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
