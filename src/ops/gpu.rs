//! What an op sees when it runs on a GPU: the [`GpuLayer`] trait and the two passes'
//! views of the network ([`Forward`], [`Backward`]).
//!
//! Owns the contract between the GPU network (`model::gpu`, which holds the buffers and
//! walks the layers) and each op's GPU form, written beside the op's CPU forward and
//! backward in the op's own module (`ops::relu`, `ops::conv2d`, ...): a layer that
//! runs on GPUs returns its form from `Layer::gpu`, and the network dispatches through it.
//! Nothing here is per op: the network never names an op, and an op never learns how the
//! network lays out its activations beyond the views it is handed.
//!
//! An op's GPU form owns what it keeps between its forward and its backward (a
//! convolution's unfolded columns, BatchNorm's saved statistics, max pooling's winners),
//! sized by [`GpuLayer::reserve`] for each batch size; it asks the network for scratch
//! (values alive only inside one of its passes, shared by every layer) with
//! [`GpuLayer::scratch`]. Everything is queued on the network's one compute stream.
//!
//! The gradient contract is the CPU layers' (`nn`'s opening): a backward ACCUMULATES
//! into its parameter gradients in `grads` (the shard's slot, zeroed by the network before
//! the first pass) and writes its input gradient `dx`, when one is asked for.

use crate::ops::window::WindowGeom;
use std::ops::Range;
use std::time::Duration;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaEvent, CudaSlice, CudaView, CudaViewMut};

use super::batchnorm::stats::StatsExchange;
use super::window::Window2d;
use crate::cuda::Gpu;
use crate::error::{Error, Result};
use crate::tensor::Shape;

/// One layer of a GPU network, as its op sees it: its place, its per-sample shapes and
/// where its tensors lie in the flat parameter and buffer arrays.
#[derive(Clone, Debug)]
pub struct Placement {
    /// The layer's name in the model (`conv0`, `bn1`), for errors.
    pub name: String,
    /// The index its node's context carries (`Graph::layer_index`): dropout's masks
    /// derive from it.
    pub index: usize,
    /// Per-sample input and output shapes.
    pub input: Shape,
    pub output: Shape,
    /// A merge's per-sample inputs after the first, in its node's order; empty for an op
    /// of one input.
    pub other_inputs: Vec<Shape>,
    /// Its parameters' ranges in the flat parameters (and in a slot's gradient part).
    pub params: Vec<Range<usize>>,
    /// Its buffers' ranges in the flat buffers (and in a slot's buffer part).
    pub buffers: Vec<Range<usize>>,
}

/// The GPU form of one op: its launches, and the device buffers it keeps.
pub trait GpuLayer: Send {
    /// Makes what this op keeps from a forward to its backward fit a batch of `n`
    /// samples (called before the first pass at each new batch size).
    fn reserve(&mut self, _gpu: &Gpu, _place: &Placement, _n: usize) -> Result<()> {
        Ok(())
    }

    /// f32 values of scratch this op needs inside one pass at a batch of `n`: the network
    /// allocates the widest request once and hands it to every op.
    fn scratch(&self, _place: &Placement, _n: usize) -> Result<usize> {
        Ok(0)
    }

    /// Queues the forward of `f.x` into `f.y`.
    fn forward(&mut self, f: Forward<'_, '_, '_>) -> Result<()>;

    /// Queues the backward: accumulates parameter gradients into `b.grads`, writes
    /// `b.dx` when given.
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()>;
}

/// What a training shard's dropout masks derive from, with the layer's index
/// (DESIGN.md: randomness derives from the seed, the step and the logical replica), and
/// where in its logical replica's shard this pass's first sample lies (a later
/// micro-batch of an accumulated step: its masks continue the shard's).
#[derive(Clone, Copy, Debug)]
pub struct Draw {
    pub seed: u64,
    pub step: u64,
    /// The logical replica whose shard this is.
    pub shard: usize,
    pub sample_offset: usize,
}

/// What a forward pass is for, with what that needs.
pub enum Pass<'b, 'v> {
    /// A training shard: dropout draws from `draw`; BatchNorm normalises with the batch's
    /// statistics and updates the running ones held in `stats` from `offset` on (the
    /// shard's slot, `[gradient | buffers]`).
    Train { draw: Draw, stats: &'b mut CudaViewMut<'v, f32>, offset: usize },
    /// Evaluation: BatchNorm normalises with the running statistics `stats` (the flat
    /// buffers); no dropout.
    Eval { stats: &'b CudaSlice<f32> },
}

/// Where a training pass's synchronized BatchNorm layers meet the other logical
/// replicas' statistics (the statistics exchange, and the shard, this logical replica's
/// index), and the abort flag the host's waits for them poll.
#[derive(Clone, Copy)]
pub struct SyncWith<'p> {
    pub stats: &'p dyn StatsExchange,
    pub shard: usize,
    pub aborted: &'p dyn Fn() -> bool,
}

/// One op's forward, as the network hands it over.
pub struct Forward<'a, 'b, 'v> {
    pub gpu: &'a Gpu,
    pub blas: &'a CudaBlas,
    pub place: &'a Placement,
    /// Samples in the batch.
    pub n: usize,
    /// The flat parameters (the op's lie at `place.params`).
    pub params: &'a CudaSlice<f32>,
    /// x: (n, *place.input)
    pub x: &'a CudaSlice<f32>,
    /// A merge's inputs after the first, each (n, *place.other_inputs[j]); empty for an
    /// op of one input.
    pub others: &'a [&'a CudaSlice<f32>],
    /// y: (n, *place.output)
    pub y: &'a mut CudaSlice<f32>,
    pub scratch: &'a mut CudaSlice<f32>,
    pub pass: &'a mut Pass<'b, 'v>,
    /// Synchronized BatchNorm's meeting place in a training pass of several logical
    /// replicas; None: statistics of the shard alone.
    pub sync: Option<SyncWith<'a>>,
}

/// One op's backward, as the network hands it over.
pub struct Backward<'a, 'v> {
    pub gpu: &'a Gpu,
    pub blas: &'a CudaBlas,
    pub place: &'a Placement,
    pub n: usize,
    pub params: &'a CudaSlice<f32>,
    /// The forward's input, x: (n, *place.input)
    pub x: &'a CudaSlice<f32>,
    /// A merge's inputs after the first, as in [`Forward::others`].
    pub others: &'a [&'a CudaSlice<f32>],
    /// dy: (n, *place.output), the gradient of the summed loss by the op's output.
    pub dy: CudaView<'a, f32>,
    /// dx: (n, *place.input); None where nobody reads it (the first trained layer).
    pub dx: Option<CudaViewMut<'a, f32>>,
    /// The gradients of a merge's other inputs, written like `dx`, each None where nobody
    /// reads it; empty for an op of one input.
    pub d_others: Vec<Option<CudaViewMut<'a, f32>>>,
    /// The slot's gradient part, laid out as the flat parameters: the op accumulates into
    /// `place.params` of it.
    pub grads: &'a mut CudaViewMut<'v, f32>,
    pub draw: Draw,
    pub scratch: &'a mut CudaSlice<f32>,
    pub sync: Option<SyncWith<'a>>,
}

impl<'a> Forward<'a, '_, '_> {
    /// The op's `j`-th parameter tensor.
    pub fn param(&self, j: usize) -> CudaView<'a, f32> {
        let params: &'a CudaSlice<f32> = self.params;
        params.slice(self.place.params[j].clone())
    }
}

impl<'a> Backward<'a, '_> {
    /// The op's `j`-th parameter tensor.
    pub fn param(&self, j: usize) -> CudaView<'a, f32> {
        let params: &'a CudaSlice<f32> = self.params;
        params.slice(self.place.params[j].clone())
    }

    /// The gradient of the op's `j`-th parameter, inside the slot.
    pub fn grad(&mut self, j: usize) -> CudaViewMut<'_, f32> {
        let r = self.place.params[j].clone();
        self.grads.slice_mut(r)
    }
}

/// The launch geometry of `window` over `place`'s per-sample input (C, H, W), for a batch
/// of `n`: the placement the CPU layers use (`ops::window`), so the backends share every pad.
pub fn window_geom(place: &Placement, window: Window2d, n: usize) -> Result<WindowGeom> {
    let (c, h, w) = match place.input.dims() {
        &[c, h, w] => (c, h, w),
        _ => return Err(Error::shape("window", format!("{}: input {} is not (C, H, W)", place.name, place.input))),
    };
    let g = window.over(h, w).ok_or_else(|| {
        Error::shape("window", format!("{}: input {h}x{w} is smaller than the {:?} window", place.name, window.kernel))
    })?;
    Ok(g.launch_geom(n, c))
}

/// Waits until `event` has completed, or until `aborted()` turns true ([`Error::Aborted`]):
/// spins, then yields, then sleeps briefly, so a wait of a few µs stays fast and a long
/// one costs no core.
pub fn poll(event: &CudaEvent, aborted: &dyn Fn() -> bool) -> Result<()> {
    let mut spins = 0u32;
    let start = std::time::Instant::now();
    loop {
        if event.try_is_complete()? {
            return Ok(());
        }
        if aborted() {
            return Err(Error::Aborted);
        }
        spins = spins.saturating_add(1);
        if spins < 1024 {
            std::hint::spin_loop();
        } else if start.elapsed() < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}
