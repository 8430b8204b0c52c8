//! Conv2d on the CPU: the forward and backward of a 2-D cross-correlation over NCHW, weight
//! (O, C, KH, KW) as in PyTorch, as plain functions ([`conv2d_forward`],
//! [`conv2d_backward`]) over the backend's products (`backend::cpu`'s GEMM and unfoldings,
//! `backend::winograd`), which stay there; and [`add_bias`] and [`bias_grad`], the bias
//! kernels' CPU twins. The reference kernels/conv2d.cu is checked against
//! (`super::gpu::host_check`).
//!
//! The batch is cut into the fixed chunks of `backend::cpu::batch_chunks`, which run in
//! parallel on the device's pool; within a chunk, a 3×3 convolution at stride 1 from at
//! least 8 input channels to at least 16 output channels runs by Winograd's F(4×4, 3×3)
//! (`backend::winograd::applies`, 4 times fewer multiply-adds), a 1×1 one at stride 1
//! without padding (a DenseNet's bottlenecks and transitions) by GEMM on each sample's own
//! (C, H·W) values, which are its columns already ([`Unfold::Pointwise`]: no copy, no
//! transpose), one at stride 1 that keeps the input's size to under 16 filters (a
//! DenseNet's growth) by one product over the sample's zero-padded planes, each tap
//! reading them where it sees them ([`Unfold::Taps`]: nothing unfolded), and any other
//! by GEMM over unfolded inputs, in one of two layouts:
//! channels-first columns for a small C·KH·KW (the first layer of an image model), and
//! channels-last rows otherwise (every kernel row of a pixel is one contiguous copy of
//! KW·C values, and a whole chunk is one GEMM). The choice (`Unfold`) is a
//! function of the layer's shape alone. Gradients of the weight and bias are summed per
//! chunk and the chunks added in chunk order, so the result is bitwise the same whatever
//! the thread count.
//!
//! A convolution of several groups (`groups` > 1: [`grouped_forward`],
//! [`grouped_backward`]) runs by [`Grouping::path`], a function of the shape alone: a
//! group of a few channels (a depthwise convolution's one) by direct sums over padded
//! copies of its planes ([`Direct`], blocks of values in vector registers, no unfolding),
//! a wider one as a convolution of its own per group and sample, through the unfoldings
//! above.
//!
//! Every unfolding writes each value of the output and of the input gradient (none is
//! read first), and reads a sample whole before writing its gradient, so the layer may
//! hand the forward memory that holds anything and the backward the input's own values
//! to write the gradient over ([`Samples`]); the grouped paths too, a group's channels
//! read whole before the group's gradient is written.

use std::borrow::Cow;
use std::ops::Range;

use rayon::prelude::*;

use crate::backend::chain::{chain_product, RhsRows};
use crate::backend::cpu::{
    add_partials, batch_chunks, chw_to_hwc, col2im, copy_row, gemm_with, hwc_to_chw, im2col, im2row, into_padded,
    row2im, split_by_chunks, sum_partials, Accumulate, Im2colGeom, Mat, Padded, Pieces, Samples, Threads,
};
use crate::backend::par;
use crate::backend::simd::widest;
use crate::backend::winograd;

/// The forward of a batch: x: (N, C, H, W) → y: (N, O, OH, OW), WRITTEN (whatever y held);
/// weight: (O, C, KH, KW); bias: (O), or none; `g` the geometry of one sample. `transformed`
/// is the weight as Winograd multiplies by ([`winograd_weights`]): given exactly where the
/// geometry runs by Winograd.
pub fn conv2d_forward(
    x: &[f32],
    weight: &[f32],
    transformed: Option<&winograd::Weights>,
    bias: Option<&[f32]>,
    y: &mut [f32],
    g: &Im2colGeom,
    o: usize,
) {
    let how = unfold(g, o);
    let per_in = g.c * g.h * g.w;
    let (n, p) = (x.len() / per_in, g.col_cols());
    assert_eq!(y.len(), n * o * p, "conv2d_forward: y for {n} samples of ({o}, {}, {})", g.oh, g.ow);
    let weight = weight_for(weight, g, o, how);
    let job = PassContext { g: *g, o, weight: &weight, unfold: how, winograd: transformed };
    let chunks = batch_chunks(n);
    let mut scratch = borrow_scratch(chunks.len());
    let work = chunks.into_par_iter().zip(split_by_chunks(y, n, o * p)).zip(&mut scratch[..]);
    let xs = |r: Range<usize>| &x[r.start * per_in..r.end * per_in];
    par::for_each(work, |((range, y_chunk), scratch)| job.forward(xs(range), y_chunk, bias, scratch));
    give_back(scratch);
}

/// The backward of a batch: dweight (O, C, KH, KW) and dbias (O, where given) ACCUMULATED
/// (+=), and the input gradient WRITTEN where `xs` asks for it, apart or over the inputs
/// (`backend::cpu::Samples`: the inputs x: (N, C, H, W), the gradient dx: (N, C, H, W)).
/// dout: (N, O, OH, OW); weight: (O, C, KH, KW); `transformed` as in [`conv2d_forward`].
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    xs: Samples<'_>,
    dout: &[f32],
    weight: &[f32],
    transformed: Option<&winograd::Weights>,
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    g: &Im2colGeom,
    o: usize,
) {
    let how = unfold(g, o);
    let per_in = g.c * g.h * g.w;
    let n = xs.len() / per_in;
    assert_eq!(dout.len(), n * o * g.col_cols(), "conv2d_backward: dout for {n} samples of ({o}, {}, {})", g.oh, g.ow);
    let weight = weight_for(weight, g, o, how);
    let job = PassContext { g: *g, o, weight: &weight, unfold: how, winograd: transformed };
    let chunks = batch_chunks(n);
    let xs = samples_by_chunks(xs, &chunks, per_in);
    let mut scratch = borrow_scratch(chunks.len());
    let with_bias = dbias.is_some();
    let work = chunks.into_par_iter().zip(xs).zip(&mut scratch[..]);
    let partials: Vec<(Vec<f32>, Vec<f32>)> =
        par::map_collect(work, |((range, xs), scratch)| job.backward(range, xs, dout, with_bias, scratch));
    give_back(scratch);
    let (dws, dbs): (Vec<_>, Vec<_>) = partials.into_iter().unzip();
    match how {
        Unfold::Columns => add_partials(dweight, dws),
        Unfold::Pointwise => add_pointwise_dweight(dweight, &sum_partials(dws), g.c, o),
        Unfold::Winograd => {
            let dv = winograd::weight_grad(&sum_partials(dws), g.c, o);
            dweight.iter_mut().zip(&dv).for_each(|(d, v)| *d += v);
        }
        Unfold::Rows => {
            add_rows_dweight(dweight, &sum_partials(dws), g, o);
        }
        Unfold::Taps => add_taps_dweight(dweight, &sum_partials(dws), g.c, o, g.kh * g.kw),
    }
    if let Some(dbias) = dbias {
        add_partials(dbias, dbs);
    }
}

/// The weight as [`Unfold::Winograd`] multiplies by, where the geometry `g` with O filters
/// runs by Winograd (None elsewhere). weight: (O, C, KH, KW)
pub fn winograd_weights(weight: &[f32], g: &Im2colGeom, o: usize) -> Option<winograd::Weights> {
    (unfold(g, o) == Unfold::Winograd).then(|| winograd::transform_weights(weight, g.c, o))
}

/// How a convolution unfolds its input.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Unfold {
    /// Channels-first columns (C·KH·KW, OH·OW) per sample, one GEMM per sample with the
    /// weight as (O, C·KH·KW), written straight into NCHW: for a small C·KH·KW, where
    /// stacked rows would make GEMMs with a tiny inner dimension.
    Columns,
    /// Channels-last rows (OH·OW, KH·KW·C) per sample, stacked for the whole chunk, one
    /// GEMM per chunk with the weight as (KH·KW·C, O).
    Rows,
    /// Winograd's F(4×4, 3×3) (`backend::winograd`): a 3×3 kernel at stride 1 between
    /// at least 8 channels, in 4 times fewer multiply-adds than the unfoldings.
    Winograd,
    /// A 1×1 kernel at stride 1 without padding: a sample's columns (C, OH·OW) are its
    /// values x_s (C, H·W) as they lie, so each sample is one GEMM straight on its slice
    /// and the weight as (O, C), as columns multiply but without unfolding anything; the
    /// weight's gradient is summed transposed, (C, O) ([`add_pointwise_dweight`]).
    Pointwise,
    /// A kernel of several taps at stride 1 whose output keeps the input's size, to fewer
    /// filters than Winograd takes ([`taps`]; a DenseNet's 48→12 3×3 convolutions): one
    /// product over every channel and tap ([`TapProduct`]), each tap reading the sample's
    /// zero-padded planes where it sees them ([`Taps`]); the weight's gradient one GEMM a
    /// tap. Nothing is unfolded, where [`Unfold::Rows`] would copy the input KH·KW times
    /// over for products only O wide.
    Taps,
}

/// The unfolding for a geometry and O filters: a function of the layer's shape alone, so
/// that the arithmetic (and its rounding) never depends on the batch or the machine.
pub(super) fn unfold(g: &Im2colGeom, o: usize) -> Unfold {
    if pointwise(g) {
        Unfold::Pointwise
    } else if winograd::applies(g.c, o, (g.kh, g.kw), g.stride) {
        Unfold::Winograd
    } else if g.col_rows() <= 32 {
        Unfold::Columns
    } else if taps(g, o) {
        Unfold::Taps
    } else {
        Unfold::Rows
    }
}

/// Whether a convolution that is not pointwise, Winograd's or columns' runs by
/// [`Unfold::Taps`]: stride 1, the output the input's size ("same" padding), under 16
/// filters. A function of the shape alone.
fn taps(g: &Im2colGeom, o: usize) -> bool {
    g.stride == 1 && (g.oh, g.ow) == (g.h, g.w) && g.kh * g.kw > 1 && o < 16
}

/// [`Unfold::Taps`]'s layout of one sample: each channel a plane of `plane` values, the
/// H×W image at its padding offset in rows `wp` = W + KW − 1 wide, zeros around it. Output
/// pixel (oh, ow) is row q = oh·wp + ow of an `m`-row product; tap (i, j) reads the plane
/// at q + i·wp + j, so a tap's operand is the plane itself from that offset on, and each
/// row's last KW − 1 values of q (past OW) are products of padding that nobody reads.
/// `m` is rounded up to 16, so that the product's columns are whole AVX-512 registers
/// (`backend::chain`); `plane` holds the image and every row a tap reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Taps {
    pub(super) wp: usize,
    pub(super) m: usize,
    pub(super) plane: usize,
}

impl Taps {
    pub(super) fn of(g: &Im2colGeom) -> Taps {
        let wp = g.w + g.kw - 1;
        let m = ((g.oh - 1) * wp + g.ow).next_multiple_of(16);
        Taps { wp, m, plane: m + (g.kh - 1) * wp + g.kw - 1 }
    }

    /// Where tap t = i·KW + j reads a plane: i·wp + j.
    fn offset(&self, g: &Im2colGeom, t: usize) -> usize {
        (t / g.kw) * self.wp + t % g.kw
    }

    /// Writes the (ch, H, W) image `src` into `ch` planes (`dst`, zero outside every image,
    /// as the chunk's first sample found it) at rows from `top` and columns from `left`.
    fn pad_planes(&self, src: &[f32], (h, w): (usize, usize), (top, left): (usize, usize), dst: &mut [f32]) {
        for (image, plane) in src.chunks_exact(h * w).zip(dst.chunks_exact_mut(self.plane)) {
            for (row, image_row) in image.chunks_exact(w).enumerate() {
                let at = (top + row) * self.wp + left;
                copy_row(&mut plane[at..at + w], image_row);
            }
        }
    }

    /// As [`Taps::pad_planes`], channels last (`backend::cpu::into_padded`): the pixel at
    /// plane position r holds its `ch` values at dst[r·ch..]. Zero elsewhere as there.
    fn pad_pixels(&self, src: &[f32], ch: usize, w: usize, (top, left): (usize, usize), dst: &mut [f32]) {
        into_padded(src, Padded { w, wp: self.wp, top, left, c: ch }, dst);
    }

    /// The product over `ci` planes of `plane` values to `co` rows of `m`, by `weights`
    /// (co, ci, KH·KW): a forward's ([`Taps::forward`]) or an input gradient's
    /// ([`Taps::input_grad`]).
    fn product<'w>(&self, g: &Im2colGeom, ci: usize, co: usize, weights: Cow<'w, [f32]>) -> TapProduct<'w> {
        let kk = g.kh * g.kw;
        let rows = (0..ci).flat_map(|c| (0..kk).map(move |t| c * self.plane + self.offset(g, t))).collect();
        TapProduct { weights, rows, co, m: self.m }
    }

    /// The forward's product: y (O, m) from the C planes of x, by the weight (O, C, KH·KW)
    /// as it lies.
    fn forward<'w>(&self, g: &Im2colGeom, weight: &'w [f32], o: usize) -> TapProduct<'w> {
        self.product(g, g.c, o, Cow::Borrowed(weight))
    }

    /// The input gradient's product: dx (C, m) from the O planes of the output gradient
    /// (padded for the flipped kernel), by the flipped taps transposed, weight[:, :,
    /// KH·KW − 1 − t]ᵀ laid (C, O, KH·KW): the input gradient of a stride-1 convolution is
    /// the convolution of the padded output gradient by the flipped kernel.
    fn input_grad(&self, g: &Im2colGeom, weight: &[f32], o: usize) -> TapProduct<'static> {
        let (c, kk) = (g.c, g.kh * g.kw);
        let flipped = (0..c * o * kk).map(|i| {
            let (ch, f, t) = (i / (o * kk), i / kk % o, i % kk);
            weight[(f * c + ch) * kk + kk - 1 - t]
        });
        self.product(g, o, c, Cow::Owned(flipped.collect()))
    }

    /// The valid rows of `m`-row planes `src` (ch, m) as images (ch, OH, OW) in `dst`.
    fn crop(&self, src: &[f32], (oh, ow): (usize, usize), dst: &mut [f32]) {
        for (plane, image) in src.chunks_exact(self.m).zip(dst.chunks_exact_mut(oh * ow)) {
            for (row, image_row) in image.chunks_exact_mut(ow).enumerate() {
                copy_row(image_row, &plane[row * self.wp..row * self.wp + ow]);
            }
        }
    }
}

/// One of [`Taps`]'s products, its operands laid out for [`chain_product`]: out(r, q) =
/// Σ over the source's channels c and, within each, the taps t, of W_t(r, c) · plane c at
/// q + tap t's offset, each value one chain of fused multiply-adds from 0 in that order.
/// So a value's bits are its own pixel's, whatever the batch, the thread count or the
/// vector width; no plane is copied per tap, the product's right-hand rows being listed
/// where they lie ([`RhsRows::Listed`]).
struct TapProduct<'w> {
    /// a(r, k): row r's weights (co, ci·KH·KW), k = c·KH·KW + t.
    weights: Cow<'w, [f32]>,
    /// Where b's row k = c·KH·KW + t begins in the source: plane c at tap t's offset.
    rows: Vec<usize>,
    co: usize,
    m: usize,
}

impl TapProduct<'_> {
    /// out (co, m), WRITTEN, from `src`'s padded planes.
    fn run(&self, src: &[f32], out: &mut [f32]) {
        let (k, rows) = (self.rows.len(), RhsRows::Listed(&self.rows));
        chain_product((self.co, self.m, k), &self.weights, (k, 1), src, rows, out, self.m, Accumulate::Overwrite);
    }
}

/// Adds taps' weight gradient, summed as (KH·KW, O, C), into `dweight` (O, C, KH·KW).
fn add_taps_dweight(dweight: &mut [f32], grad: &[f32], c: usize, o: usize, kk: usize) {
    for (t, tap) in grad.chunks_exact(o * c).enumerate() {
        for (i, &v) in tap.iter().enumerate() {
            dweight[i * kk + t] += v;
        }
    }
}

/// Whether a sample's columns are its own values: a 1×1 kernel at stride 1 that reads
/// no padding, so that output pixel p is input pixel p.
fn pointwise(g: &Im2colGeom) -> bool {
    (g.kh, g.kw, g.stride, g.pad_top, g.pad_left) == (1, 1, 1, 0, 0) && (g.oh, g.ow) == (g.h, g.w)
}

/// Whether [`Unfold::Rows`] takes the weight's gradient transposed, (O, KH·KW·C), a
/// GEMM a sample, instead of (KH·KW·C, O), a GEMM a chunk: a function of the shape alone.
/// The GEMM kernel lays its output's rows across its registers, 64 values at most, so the
/// wider of the two orientations runs faster while O is below 64: for `resnet8`'s first
/// stages (O 16 and 32 against KH·KW·C 144 and 288) 1.3–1.6× on one AVX-512 core
/// (206 against 129 GFLOP/s at O 16), and no gain from O = 64 on.
fn dweight_transposed(g: &Im2colGeom, o: usize) -> bool {
    o < 64 && g.col_rows() > o
}

/// Adds rows' weight gradient (channels-last, (KH·KW·C, O) or its transpose where
/// [`dweight_transposed`]) into `dweight` (O, C, KH·KW).
fn add_rows_dweight(dweight: &mut [f32], grad: &[f32], g: &Im2colGeom, o: usize) {
    let (kk, kkc) = (g.kh * g.kw, g.col_rows());
    let transposed = dweight_transposed(g, o);
    for r in 0..kkc {
        // r = (i·KW + j)·C + c
        let (k, c) = (r / g.c, r % g.c);
        for oo in 0..o {
            let v = if transposed { grad[oo * kkc + r] } else { grad[r * o + oo] };
            dweight[(oo * g.c + c) * kk + k] += v;
        }
    }
}

/// Adds pointwise's weight gradient, summed transposed as (C, O), into `dweight` (O, C, 1, 1).
/// Its GEMM a sample, x_s (C, P) · dout_sᵀ (P, O), ran 1.1× the speed of the other
/// orientation in a DenseNet's backward (one Intel Xeon AVX-512 core, `lockstep bench
/// layers --model densenet --threads 1 --batch-size 64`: its dense layers' 1×1
/// convolutions' backward 24.0 against 26.4 ms).
fn add_pointwise_dweight(dweight: &mut [f32], grad: &[f32], c: usize, o: usize) {
    for (ch, row) in grad.chunks_exact(o).enumerate().take(c) {
        for (oo, &v) in row.iter().enumerate() {
            dweight[oo * c + ch] += v;
        }
    }
}

/// The most bytes of rows [`Unfold::Rows`] unfolds at a time, so that they are still in
/// the core's L2 cache when GEMM reads them; smaller pieces are also written faster (on
/// one Zen 5 core, im2row wrote a 441 KB sample at 38 GB/s and a 110 KB one at 86).
const ROWS_BUDGET: usize = 128 << 10;

/// How [`Unfold::Rows`] cuts a chunk ([`Pieces`] of [`ROWS_BUDGET`]): several samples'
/// rows stacked into one GEMM, or one sample in bands of output pixels. The bands order
/// the weight gradient's sums, so this is a function of the geometry alone.
pub(super) fn rows_tiling(g: &Im2colGeom) -> Pieces {
    Pieces::fit(g.col_cols(), g.col_rows() * 4, ROWS_BUDGET)
}

/// The weight from (O, C, KH·KW) to channels-last (KH·KW, C, O), i.e. a
/// (KH·KW·C, O) matrix whose row order matches `im2row`.
fn oihw_to_hwio(w: &[f32], o: usize, c: usize, kk: usize) -> Vec<f32> {
    let mut wt = vec![0.0f32; w.len()];
    for oo in 0..o {
        for ch in 0..c {
            for k in 0..kk {
                wt[(k * c + ch) * o + oo] = w[(oo * c + ch) * kk + k];
            }
        }
    }
    wt
}

/// The Winograd geometry of a layer's sample with O filters.
pub(super) fn winograd_geom(g: &Im2colGeom, o: usize) -> winograd::Geom {
    let (c, h, w, oh, ow, pad_top, pad_left) = (g.c, g.h, g.w, g.oh, g.ow, g.pad_top, g.pad_left);
    winograd::Geom { c, h, w, o, oh, ow, pad_top, pad_left }
}

/// Work buffers lent to the convolution that runs, one per chunk of samples, and given
/// back when it ends: whatever the model's depth, the process holds as many as run at
/// once (a chunk per core of each device), sized by the largest layer, not a set per
/// layer (a spec of 3,000 convolutions kept 3,000 sets, ten times what was estimated).
/// A run gives them back to the allocator when it ends ([`release_scratch`]).
static SCRATCH: parking_lot::Mutex<Vec<Scratch>> = parking_lot::Mutex::new(Vec::new());

fn borrow_scratch(n: usize) -> Vec<Scratch> {
    let mut pool = SCRATCH.lock();
    let keep = pool.len().saturating_sub(n);
    let mut lent = pool.split_off(keep);
    lent.resize_with(n, Scratch::default);
    lent
}

fn give_back(lent: Vec<Scratch>) {
    SCRATCH.lock().extend(lent);
}

/// Frees the convolutions' idle work buffers (those lent out stay with their borrower).
pub fn release_scratch() {
    drop(std::mem::take(&mut *SCRATCH.lock()));
}

/// One chunk's work buffers (contents are overwritten before every use).
#[derive(Clone, Debug, Default)]
struct Scratch {
    /// Rows: one sample, channels-last (H, W, C).
    xt: Vec<f32>,
    /// Rows: a piece's rows ([`rows_tiling`]: samples × band pixels, KH·KW·C). Columns: one
    /// sample's columns.
    unfolded: Vec<f32>,
    /// Rows: the chunk's output or output gradient, channels-last (samples·OH·OW, O).
    /// Columns: one sample's column gradient.
    out: Vec<f32>,
    /// Rows, backward: one sample's input gradient, channels-last (H, W, C).
    dxt: Vec<f32>,
    /// Winograd: a piece's outputs (or their gradients) channels-last; its other
    /// buffers are the four above ([`Scratch::winograd`]).
    yt: Vec<f32>,
}

/// The four buffers of a [`Scratch`], sized.
type Sized<'a> = (&'a mut [f32], &'a mut [f32], &'a mut [f32], &'a mut [f32]);

impl Scratch {
    fn sized(&mut self, xt: usize, unfolded: usize, out: usize, dxt: usize) -> Sized<'_> {
        self.xt.resize(xt, 0.0);
        self.unfolded.resize(unfolded, 0.0);
        self.out.resize(out, 0.0);
        self.dxt.resize(dxt, 0.0);
        (&mut self.xt, &mut self.unfolded, &mut self.out, &mut self.dxt)
    }

    /// The buffers lent to a Winograd chunk: the padded samples in `xt`, the transformed
    /// tiles in `unfolded` and `out`, the padded input gradients in `dxt`.
    fn winograd(&mut self) -> winograd::Scratch<'_> {
        let Scratch { xt, unfolded, out, dxt, yt } = self;
        winograd::Scratch { xp: xt, u: unfolded, m: out, yt, dxp: dxt }
    }
}

/// What every chunk of one forward or backward shares.
struct PassContext<'a> {
    g: Im2colGeom,
    o: usize,
    /// The weight in the layout of `unfold`: (O, C·KH·KW) for columns and pointwise,
    /// (KH·KW·C, O) for rows.
    weight: &'a [f32],
    unfold: Unfold,
    /// The weight transformed, for [`Unfold::Winograd`].
    winograd: Option<&'a winograd::Weights>,
}

impl PassContext<'_> {
    fn per_in(&self) -> usize {
        self.g.c * self.g.h * self.g.w
    }

    fn winograd(&self) -> (winograd::Geom, &winograd::Weights) {
        (winograd_geom(&self.g, self.o), self.winograd.expect("the weight transformed for Winograd"))
    }

    // xs: (G, C, H, W), a chunk's samples → y_chunk: (G, O, OH·OW)
    fn forward(&self, xs: &[f32], y_chunk: &mut [f32], bias: Option<&[f32]>, scratch: &mut Scratch) {
        let (g, o, per_in) = (&self.g, self.o, self.per_in());
        let (kkc, p) = (g.col_rows(), g.col_cols());
        let x = |k: usize| &xs[k * per_in..(k + 1) * per_in];
        match self.unfold {
            Unfold::Winograd => {
                let (wg, wt) = self.winograd();
                winograd::forward_chunk(&wg, wt, xs, y_chunk, scratch.winograd());
                if let Some(b) = bias {
                    y_chunk.chunks_exact_mut(o * p).for_each(|yn| add_bias(yn, b, p));
                }
            }
            Unfold::Pointwise => {
                // y_s (O, P) = W (O, C) · x_s (C, P), x_s its own columns (kkc = C)
                for (k, yn) in y_chunk.chunks_exact_mut(o * p).enumerate() {
                    let acc = fill_bias(yn, bias, p);
                    gemm_with(Mat::rows(self.weight, o, kkc), Mat::rows(x(k), kkc, p), yn, p, acc, Threads::Caller);
                }
            }
            Unfold::Taps => {
                // y_s (O, m) = Σ_t W_t (O, C) · x_s's planes from tap t's offset (C, m)
                let t = Taps::of(g);
                let product = t.forward(g, self.weight, o);
                let (planes, _, out, _) = scratch.sized(g.c * t.plane, 0, o * t.m, 0);
                planes.fill(0.0);
                for (k, yn) in y_chunk.chunks_exact_mut(o * p).enumerate() {
                    t.pad_planes(x(k), (g.h, g.w), (g.pad_top, g.pad_left), planes);
                    product.run(planes, out);
                    t.crop(out, (g.oh, g.ow), yn);
                    if let Some(b) = bias {
                        add_bias(yn, b, p);
                    }
                }
            }
            Unfold::Columns => {
                let (_, col, _, _) = scratch.sized(0, kkc * p, 0, 0);
                for (k, yn) in y_chunk.chunks_exact_mut(o * p).enumerate() {
                    im2col(x(k), g, col);
                    let acc = fill_bias(yn, bias, p);
                    gemm_with(Mat::rows(self.weight, o, kkc), Mat::rows(col, kkc, p), yn, p, acc, Threads::Caller);
                }
            }
            Unfold::Rows => {
                let t = rows_tiling(g);
                let (xt, rows, out, _) = scratch.sized(per_in, t.samples * t.band * kkc, t.samples * p * o, 0);
                let samples: Vec<usize> = (0..xs.len() / per_in).collect();
                for (chunk, y_chunk) in samples.chunks(t.samples).zip(y_chunk.chunks_mut(t.samples * o * p)) {
                    let cs = chunk.len();
                    // Several samples: one band, all their pixels; one sample: its bands.
                    for band in t.bands(p) {
                        let bp = band.len();
                        for (k, &s) in chunk.iter().enumerate() {
                            if band.start == 0 {
                                chw_to_hwc(x(s), g.c, xt);
                            }
                            im2row(xt, g, band.clone(), &mut rows[k * bp * kkc..(k + 1) * bp * kkc]);
                        }
                        let (rows, weight) =
                            (Mat::rows(&rows[..cs * bp * kkc], cs * bp, kkc), Mat::rows(self.weight, kkc, o));
                        let dst = &mut out[band.start * o..(band.start + cs * bp) * o];
                        gemm_with(rows, weight, dst, o, Accumulate::Overwrite, Threads::Caller);
                    }
                    for (yn, on) in y_chunk.chunks_exact_mut(o * p).zip(out.chunks_exact(p * o)) {
                        hwc_to_chw(on, o, yn);
                        if let Some(b) = bias {
                            add_bias(yn, b, p);
                        }
                    }
                }
            }
        }
    }

    /// The chunk's (dweight, dbias): dweight in the layout of `weight`, or for rows its
    /// transpose where [`dweight_transposed`], for pointwise its transpose (C, O), and for
    /// Winograd the transformed dV (the chunks' sum is transformed back once). dout: (N, O, OH·OW); the chunk's samples
    /// (G, C, H, W) are read from `xs`, not from the job, and their gradients where asked
    /// written (not accumulated) apart or over them, each sample after its last read.
    fn backward(
        &self,
        range: Range<usize>,
        mut xs: Samples<'_>,
        ds: &[f32],
        with_bias: bool,
        scratch: &mut Scratch,
    ) -> (Vec<f32>, Vec<f32>) {
        let (g, o, per_in) = (&self.g, self.o, self.per_in());
        let (kkc, p) = (g.col_rows(), g.col_cols());
        let mut db = vec![0.0f32; if with_bias { o } else { 0 }];
        let dout = |s: usize| &ds[s * o * p..(s + 1) * o * p];
        bias_grad(&ds[range.start * o * p..range.end * o * p], p, &mut db);
        let mut dw = vec![0.0f32; if self.unfold == Unfold::Winograd { 0 } else { o * kkc }];
        match self.unfold {
            Unfold::Winograd => {
                let (wg, wt) = self.winograd();
                let dys = &ds[range.start * o * p..range.end * o * p];
                dw = winograd::backward_chunk(&wg, wt, xs, dys, scratch.winograd());
            }
            Unfold::Pointwise => {
                let wt = Mat::rows(self.weight, o, kkc).t();
                for (k, s) in range.enumerate() {
                    // dweightᵀ (C, O) += x_s (C, P) · dout_sᵀ (P, O) ([`add_pointwise_dweight`]):
                    // the last read of x_s, whole before its gradient may be written over it
                    let dn = Mat::rows(dout(s), o, p);
                    let xn = Mat::rows(xs.input(k, per_in), kkc, p);
                    gemm_with(xn, dn.t(), &mut dw, o, Accumulate::Add, Threads::Caller);
                    if let Some(dx) = xs.grad(k, per_in) {
                        // dx_s (C, P) = Wᵀ (C, O) · dout_s (O, P), WRITTEN (none of it read)
                        gemm_with(wt, dn, dx, p, Accumulate::Overwrite, Threads::Caller);
                    }
                }
            }
            Unfold::Taps => {
                let (t, c) = (Taps::of(g), g.c);
                let need_dx = xs.wants_grad();
                let product = need_dx.then(|| t.input_grad(g, self.weight, o));
                let (pixels, dplanes, dx_rows, _) =
                    scratch.sized(t.plane * c, o * t.plane, if need_dx { c * t.m } else { 0 }, 0);
                pixels.fill(0.0);
                dplanes.fill(0.0);
                // dout_s padded for the flipped kernel: its pixel (oh, ow) at row oh + KH − 1 −
                // pad_top, column ow + KW − 1 − pad_left. From `d0` on, row q of its planes is
                // output pixel q, and each row's columns past OW are zeros (padding).
                let (top, left) = (g.kh - 1 - g.pad_top, g.kw - 1 - g.pad_left);
                let d0 = top * t.wp + left;
                for (k, s) in range.enumerate() {
                    t.pad_pixels(xs.input(k, per_in), c, g.w, (g.pad_top, g.pad_left), pixels);
                    t.pad_planes(dout(s), (g.oh, g.ow), (top, left), dplanes);
                    let dn = Mat { data: &dplanes[d0..], rows: o, cols: t.m, rs: t.plane, cs: 1 };
                    for (tap, dw_t) in dw.chunks_exact_mut(o * c).enumerate() {
                        // dW_t (O, C) += dout_s (O, m) · x_s's pixels from tap t's offset (m, C)
                        let at = t.offset(g, tap) * c;
                        let xn = Mat { data: &pixels[at..], rows: t.m, cols: c, rs: c, cs: 1 };
                        gemm_with(dn, xn, dw_t, c, Accumulate::Add, Threads::Caller);
                    }
                    if let (Some(dx), Some(product)) = (xs.grad(k, per_in), &product) {
                        // dx_s (C, m) = Σ_t flipped W_tᵀ (C, O) · dout_s's planes from tap t's offset
                        product.run(dplanes, dx_rows);
                        t.crop(dx_rows, (g.h, g.w), dx);
                    }
                }
            }
            Unfold::Columns => {
                let need_dx = xs.wants_grad();
                let (_, col, dcol, _) = scratch.sized(0, kkc * p, if need_dx { kkc * p } else { 0 }, 0);
                for (k, s) in range.enumerate() {
                    // dweight (O, C·KH·KW) += dout_n (O, P) · col_nᵀ (P, C·KH·KW)
                    im2col(xs.input(k, per_in), g, col);
                    let dn = Mat::rows(dout(s), o, p);
                    gemm_with(dn, Mat::rows(col, kkc, p).t(), &mut dw, kkc, Accumulate::Add, Threads::Caller);
                    if let Some(dx) = xs.grad(k, per_in) {
                        // dcol (C·KH·KW, P) = Wᵀ · dout_n, folded back into dx_n
                        let wt = Mat::rows(self.weight, o, kkc).t();
                        gemm_with(wt, dn, dcol, p, Accumulate::Overwrite, Threads::Caller);
                        col2im(dcol, g, dx);
                    }
                }
            }
            Unfold::Rows => {
                let t = rows_tiling(g);
                let need_dx = xs.wants_grad();
                let (xt, rows, dout_t, dxt) = scratch.sized(
                    per_in,
                    t.samples * t.band * kkc,
                    t.samples * p * o,
                    if need_dx { per_in } else { 0 },
                );
                let first = range.start;
                let samples: Vec<usize> = range.collect();
                let transposed = dweight_transposed(g, o);
                let wt = Mat::rows(self.weight, kkc, o).t();
                for chunk in samples.chunks(t.samples) {
                    let cs = chunk.len();
                    for (k, &s) in chunk.iter().enumerate() {
                        chw_to_hwc(dout(s), o, &mut dout_t[k * p * o..(k + 1) * p * o]);
                    }
                    // As the forward: several samples in one band, or one sample in bands.
                    for band in t.bands(p) {
                        let bp = band.len();
                        for (k, &s) in chunk.iter().enumerate() {
                            let rows_k = &mut rows[k * bp * kkc..(k + 1) * bp * kkc];
                            if band.start == 0 {
                                chw_to_hwc(xs.input(s - first, per_in), g.c, xt);
                            }
                            im2row(xt, g, band.clone(), rows_k);
                            if transposed {
                                // dweightᵀ (O, KH·KW·C) += dout_n[:, band] (O, bp) · rows_n (bp, KH·KW·C)
                                let dn = Mat { data: &dout(s)[band.start..], rows: o, cols: bp, rs: p, cs: 1 };
                                let rows_k = Mat::rows(rows_k, bp, kkc);
                                gemm_with(dn, rows_k, &mut dw, kkc, Accumulate::Add, Threads::Caller);
                            }
                        }
                        let piece = &dout_t[band.start * o..(band.start + cs * bp) * o];
                        let dout_mat = Mat::rows(piece, cs * bp, o);
                        if !transposed {
                            // dweight (KH·KW·C, O) += rowsᵀ (KH·KW·C, cs·bp) · doutᵀ (cs·bp, O)
                            let rows_t = Mat::rows(&rows[..cs * bp * kkc], cs * bp, kkc).t();
                            gemm_with(rows_t, dout_mat, &mut dw, o, Accumulate::Add, Threads::Caller);
                        }
                        if need_dx {
                            // drows (cs·bp, KH·KW·C) = doutᵀ · weightᵀ, into the no longer needed rows
                            let drows = &mut rows[..cs * bp * kkc];
                            gemm_with(dout_mat, wt, drows, kkc, Accumulate::Overwrite, Threads::Caller);
                            for (k, &s) in chunk.iter().enumerate() {
                                if band.start == 0 {
                                    dxt.fill(0.0);
                                }
                                row2im(&drows[k * bp * kkc..(k + 1) * bp * kkc], g, band.clone(), dxt);
                                if let Some(dxn) = xs.grad(s - first, per_in).filter(|_| band.end == p) {
                                    hwc_to_chw(dxt, g.c, dxn);
                                }
                            }
                        }
                    }
                }
            }
        }
        (dw, db)
    }
}

/// Adds each output channel's bias to its plane of P values (kernels/conv2d.cu's
/// `bias_nchw_fwd` does the same add). yn: (O, P); bias: (O)
pub fn add_bias(yn: &mut [f32], bias: &[f32], p: usize) {
    for (plane, &bo) in yn.chunks_exact_mut(p).zip(bias) {
        plane.iter_mut().for_each(|v| *v += bo);
    }
}

/// Fills each output plane with its bias; says how GEMM must then treat the output.
fn fill_bias(yn: &mut [f32], bias: Option<&[f32]>, p: usize) -> Accumulate {
    match bias {
        Some(b) => {
            for (plane, &bo) in yn.chunks_exact_mut(p).zip(b) {
                plane.fill(bo);
            }
            Accumulate::Add
        }
        None => Accumulate::Overwrite,
    }
}

/// dbias (O) += Σ_n Σ_p dout[n, o, p], ACCUMULATED: sample by sample, each plane of P
/// values summed alone (in f32, in order) and added to its channel's total. dout: (N, O, P)
pub fn bias_grad(dout: &[f32], p: usize, dbias: &mut [f32]) {
    let o = dbias.len();
    if o == 0 {
        return;
    }
    for sample in dout.chunks_exact(o * p) {
        for (b, plane) in dbias.iter_mut().zip(sample.chunks_exact(p)) {
            *b += plane.iter().sum::<f32>();
        }
    }
}

/// The weight in the layout `unfold` multiplies by: (O, C·KH·KW) for columns, pointwise
/// and Winograd, (KH·KW·C, O) for rows. w: (O, C, KH, KW)
fn weight_for<'a>(w: &'a [f32], g: &Im2colGeom, o: usize, unfold: Unfold) -> Cow<'a, [f32]> {
    match unfold {
        Unfold::Columns | Unfold::Pointwise | Unfold::Winograd | Unfold::Taps => Cow::Borrowed(w),
        Unfold::Rows => Cow::Owned(oihw_to_hwio(w, o, g.c, g.kh * g.kw)),
    }
}

// ---- several groups ---------------------------------------------------------------------

/// A convolution of `groups` groups (PyTorch's `groups`, Keras's): group k maps input
/// channels k·C/G.. (C/G of them) to filters k·O/G.. (O/G), through those filters' rows of
/// the weight (O, C/G, KH, KW). `g` is one sample's whole geometry (its C all the input's
/// channels); G divides C and O (the layer checks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grouping {
    pub g: Im2colGeom,
    pub o: usize,
    pub groups: usize,
}

impl Grouping {
    /// Input channels of a group: C/G.
    pub fn cpg(&self) -> usize {
        self.g.c / self.groups
    }

    /// Filters of a group: O/G.
    pub fn opg(&self) -> usize {
        self.o / self.groups
    }

    /// The geometry of one group's convolution: the sample's, with C/G channels.
    pub fn sub(&self) -> Im2colGeom {
        Im2colGeom { c: self.cpg(), ..self.g }
    }

    /// How it runs ([`grouped_path`]).
    pub(super) fn path(&self) -> Grouped {
        grouped_path(self.cpg())
    }
}

/// How a convolution of groups of `cpg` input channels runs: a function of the shape
/// alone, as [`unfold`] is (and the GPU's choice too).
pub(super) fn grouped_path(cpg: usize) -> Grouped {
    if cpg <= DIRECT_CHANNELS {
        Grouped::Direct
    } else {
        Grouped::PerGroup
    }
}

/// How a convolution of several groups runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Grouped {
    /// Each value summed where it lies, over its group's few channels and the window
    /// ([`Direct`]): depthwise convolutions (one channel a group), where a group's GEMM
    /// would multiply by a matrix of O/G rows and KH·KW columns.
    Direct,
    /// Each group a convolution of its own (C/G channels to O/G filters), sample by
    /// sample, through the unfoldings above (columns, rows or Winograd, [`unfold`]'s
    /// choice for the group's shape).
    PerGroup,
}

/// The most channels a group may have for [`Grouped::Direct`]: the direct sums cost a
/// multiply-add a tap like GEMM's, but at a quarter of GEMM's rate or less once the group
/// is wide enough for GEMM's tiles (measured in the module's tests' timing).
pub(super) const DIRECT_CHANNELS: usize = 4;

/// The forward of a batch of a grouped convolution: x: (N, C, H, W) → y: (N, O, OH, OW),
/// WRITTEN; weight: (O, C/G, KH, KW); bias: (O), or none.
pub fn grouped_forward(x: &[f32], weight: &[f32], bias: Option<&[f32]>, y: &mut [f32], gr: &Grouping) {
    let (g, o) = (&gr.g, gr.o);
    let (per_in, p) = (g.c * g.h * g.w, g.col_cols());
    let n = x.len() / per_in;
    assert_eq!(y.len(), n * o * p, "grouped_forward: y for {n} samples of ({o}, {}, {})", g.oh, g.ow);
    match gr.path() {
        Grouped::Direct => {
            // Samples are independent and each value's sum is the same wherever it runs:
            // any split of the batch gives the same bits.
            let d = Direct::new(gr);
            let work = x.par_chunks(per_in).zip(y.par_chunks_mut(o * p));
            par::for_each_init(
                work,
                || vec![0.0f32; d.x_len()],
                |xp, (xn, yn)| direct_forward_sample(&d, xn, weight, bias, yn, xp),
            );
        }
        Grouped::PerGroup => {
            let jobs = PerGroup::new(gr, weight);
            let chunks = batch_chunks(n);
            let mut scratch = borrow_scratch(chunks.len());
            let work = chunks.into_par_iter().zip(split_by_chunks(y, n, o * p)).zip(&mut scratch[..]);
            par::for_each(work, |((range, y_chunk), scratch)| {
                for (s, yn) in range.zip(y_chunk.chunks_exact_mut(o * p)) {
                    jobs.forward(&x[s * per_in..(s + 1) * per_in], bias, yn, scratch);
                }
            });
            give_back(scratch);
        }
    }
}

/// The backward of a batch of a grouped convolution: dweight (O, C/G, KH, KW) and dbias
/// (O, where given) ACCUMULATED, the input gradient WRITTEN where `xs` asks for it, as
/// [`conv2d_backward`]'s: summed per chunk of samples ([`batch_chunks`]) and the chunks
/// added in chunk order, so bitwise the same on any thread count. dout: (N, O, OH, OW).
pub fn grouped_backward(
    xs: Samples<'_>,
    dout: &[f32],
    weight: &[f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    gr: &Grouping,
) {
    let (g, o) = (&gr.g, gr.o);
    let (per_in, p) = (g.c * g.h * g.w, g.col_cols());
    let n = xs.len() / per_in;
    assert_eq!(dout.len(), n * o * p, "grouped_backward: dout for {n} samples of ({o}, {}, {})", g.oh, g.ow);
    let chunks = batch_chunks(n);
    let xs = samples_by_chunks(xs, &chunks, per_in);
    let with_bias = dbias.is_some();
    let dn = |s: usize| &dout[s * o * p..(s + 1) * o * p];
    let partials: Vec<(Vec<f32>, Vec<f32>)> = match gr.path() {
        Grouped::Direct => {
            let d = Direct::new(gr);
            let work = chunks.into_par_iter().zip(xs);
            par::map_collect(work, |(range, mut xs)| {
                let mut db = vec![0.0f32; if with_bias { o } else { 0 }];
                bias_grad(&dout[range.start * o * p..range.end * o * p], p, &mut db);
                let mut dw = vec![0.0f32; weight.len()];
                let (mut xp, mut dp) = (vec![0.0f32; d.x_len()], vec![0.0f32; d.dout_len()]);
                for (k, s) in range.enumerate() {
                    direct_backward_sample(&d, &mut xs, k, dn(s), weight, &mut dw, &mut xp, &mut dp);
                }
                (dw, db)
            })
        }
        Grouped::PerGroup => {
            let jobs = PerGroup::new(gr, weight);
            let mut scratch = borrow_scratch(chunks.len());
            let work = chunks.into_par_iter().zip(xs).zip(&mut scratch[..]);
            let partials = par::map_collect(work, |((range, mut xs), scratch)| {
                let mut db = vec![0.0f32; if with_bias { o } else { 0 }];
                bias_grad(&dout[range.start * o * p..range.end * o * p], p, &mut db);
                let mut dw = vec![0.0f32; jobs.partial_len()];
                for (k, s) in range.enumerate() {
                    jobs.backward(&mut xs, k, dn(s), &mut dw, scratch);
                }
                (dw, db)
            });
            give_back(scratch);
            partials
        }
    };
    let (dws, dbs): (Vec<_>, Vec<_>) = partials.into_iter().unzip();
    match gr.path() {
        Grouped::Direct => add_partials(dweight, dws),
        Grouped::PerGroup => PerGroup::add_dweight(gr, dweight, &sum_partials(dws)),
    }
    if let Some(dbias) = dbias {
        add_partials(dbias, dbs);
    }
}

/// A backward's samples cut at the chunks `chunks` of samples of `per` values each: the
/// inputs, and their gradients apart or over them ([`Samples`]).
fn samples_by_chunks<'a>(xs: Samples<'a>, chunks: &[Range<usize>], per: usize) -> Vec<Samples<'a>> {
    let n = chunks.last().map_or(0, |r| r.end);
    match xs {
        Samples::Overwritten(both) => split_by_chunks(both, n, per).into_iter().map(Samples::Overwritten).collect(),
        Samples::Apart { x, dx } => {
            let dxs: Vec<Option<&mut [f32]>> = match dx {
                Some(dx) => split_by_chunks(dx, n, per).into_iter().map(Some).collect(),
                None => chunks.iter().map(|_| None).collect(),
            };
            let xs = chunks.iter().map(|r| &x[r.start * per..r.end * per]);
            xs.zip(dxs).map(|(x, dx)| Samples::Apart { x, dx }).collect()
        }
    }
}

/// Values `range` of sample k of `xs` (k counted within the chunk, `per` values a
/// sample), as samples of their own: one group's channels of one sample.
fn sample_part<'b>(xs: &'b mut Samples<'_>, k: usize, per: usize, range: Range<usize>) -> Samples<'b> {
    let at = k * per + range.start..k * per + range.end;
    match xs {
        Samples::Apart { x, dx } => Samples::Apart { x: &x[at.clone()], dx: dx.as_deref_mut().map(|d| &mut d[at]) },
        Samples::Overwritten(both) => Samples::Overwritten(&mut both[at]),
    }
}

/// [`Grouped::PerGroup`]: each group's convolution, whose weight is its filters' rows of
/// the layer's (O/G, C/G, KH, KW), contiguous.
struct PerGroup<'w> {
    gr: Grouping,
    /// Each group's weight in the layout of the group's unfolding ([`weight_for`]).
    weights: Vec<Cow<'w, [f32]>>,
    /// Each group's weight transformed, where the group's shape runs by Winograd.
    transformed: Vec<Option<winograd::Weights>>,
}

impl<'w> PerGroup<'w> {
    fn new(gr: &Grouping, weight: &'w [f32]) -> PerGroup<'w> {
        let (sub, og) = (gr.sub(), gr.opg());
        let per_group = og * sub.col_rows();
        let how = unfold(&sub, og);
        let groups = weight.chunks_exact(per_group);
        let weights = groups.clone().map(|w| weight_for(w, &sub, og, how)).collect();
        let transformed = groups.map(|w| winograd_weights(w, &sub, og)).collect();
        PerGroup { gr: *gr, weights, transformed }
    }

    fn job(&self, k: usize) -> PassContext<'_> {
        let (sub, og) = (self.gr.sub(), self.gr.opg());
        PassContext {
            g: sub,
            o: og,
            weight: &self.weights[k],
            unfold: unfold(&sub, og),
            winograd: self.transformed[k].as_ref(),
        }
    }

    /// Floats of one group's weight gradient as its unfolding sums it (the transformed
    /// dV for Winograd).
    fn group_partial_len(&self) -> usize {
        let (sub, og) = (self.gr.sub(), self.gr.opg());
        match unfold(&sub, og) {
            Unfold::Winograd => winograd::dv_floats(&winograd_geom(&sub, og)),
            _ => og * sub.col_rows(),
        }
    }

    /// Floats of a chunk's partial weight gradient: every group's, one after another.
    fn partial_len(&self) -> usize {
        self.gr.groups * self.group_partial_len()
    }

    // xn: (C, H, W), one sample → yn: (O, OH·OW), WRITTEN
    fn forward(&self, xn: &[f32], bias: Option<&[f32]>, yn: &mut [f32], scratch: &mut Scratch) {
        let (sub, og) = (self.gr.sub(), self.gr.opg());
        let (per_in, per_out) = (sub.c * sub.h * sub.w, og * sub.col_cols());
        for k in 0..self.gr.groups {
            let b = bias.map(|b| &b[k * og..(k + 1) * og]);
            let (xk, yk) = (&xn[k * per_in..(k + 1) * per_in], &mut yn[k * per_out..(k + 1) * per_out]);
            self.job(k).forward(xk, yk, b, scratch);
        }
    }

    /// Sample k of the chunk's `xs`: each group's weight gradient added into its part of
    /// `dw` ([`PerGroup::partial_len`]), its input gradient written where asked, each
    /// group's channels read before they are written. dn: (O, OH·OW)
    fn backward(&self, xs: &mut Samples<'_>, k: usize, dn: &[f32], dw: &mut [f32], scratch: &mut Scratch) {
        let (sub, og) = (self.gr.sub(), self.gr.opg());
        let (per_in, per_out, len) = (sub.c * sub.h * sub.w, og * sub.col_cols(), self.group_partial_len());
        let per_sample = self.gr.groups * per_in;
        for (grp, dwk) in dw.chunks_exact_mut(len).enumerate() {
            let part = sample_part(xs, k, per_sample, grp * per_in..(grp + 1) * per_in);
            let dk = &dn[grp * per_out..(grp + 1) * per_out];
            let (sample_dw, _) = self.job(grp).backward(0..1, part, dk, false, scratch);
            dwk.iter_mut().zip(&sample_dw).for_each(|(a, v)| *a += v);
        }
    }

    /// Adds the groups' summed weight gradients (each in its unfolding's layout, one
    /// after another) into dweight (O, C/G, KH, KW), each group into its filters' rows.
    fn add_dweight(gr: &Grouping, dweight: &mut [f32], sums: &[f32]) {
        let (sub, og) = (gr.sub(), gr.opg());
        let per_group = og * sub.col_rows();
        let len = sums.len() / gr.groups;
        for (dwk, sum) in dweight.chunks_exact_mut(per_group).zip(sums.chunks_exact(len)) {
            match unfold(&sub, og) {
                Unfold::Columns => dwk.iter_mut().zip(sum).for_each(|(d, v)| *d += v),
                Unfold::Pointwise => add_pointwise_dweight(dwk, sum, sub.c, og),
                Unfold::Winograd => {
                    let dv = winograd::weight_grad(sum, sub.c, og);
                    dwk.iter_mut().zip(&dv).for_each(|(d, v)| *d += v);
                }
                Unfold::Rows => add_rows_dweight(dwk, sum, &sub, og),
                Unfold::Taps => add_taps_dweight(dwk, sum, sub.c, og, sub.kh * sub.kw),
            }
        }
    }
}

/// Rows and columns of the block of outputs (or input gradients) that [`Grouped::Direct`]
/// sums at once: 4 × 16 values, four AVX-512 registers (eight AVX2 ones) of independent
/// sums, so that each tap's multiply-add does not wait on the last one's.
const ROWS: usize = 4;
const COLS: usize = 16;
/// Taps whose weight gradients one pass over a plane sums side by side.
const TAPS: usize = 3;
/// Floats past the last plane of a padded buffer, so that a block's 16 columns may be
/// read whole at the right edge (the values past the plane's width are never kept).
const SLACK: usize = 2 * COLS + TAPS;

/// [`Grouped::Direct`]: every value of a group's output, input gradient and weight
/// gradient summed where it lies, over zero-padded copies of one sample's planes laid out
/// so that a block's columns are contiguous at any stride.
///
/// x's plane of a channel is padded to the rows and columns the windows read and split
/// into its S column phases: `xp[ph][r][q] = x[r − PT][q·S + ph − PL]` (0 outside x),
/// S × XROWS × XCOLS, so that the input of output column ox at tap j is column
/// ox + j/S of phase j mod S. dout's plane of a filter lies at (A0, B0) in a plane of
/// zeros, DROWS × DCOLS, so that the input gradient's gather reads whole columns too.
///
/// The order of every sum (the GPU kernels' too: kernels/conv2d.cu's `conv2d_direct_*`):
/// - y[f, oy, ox] = (Σ_ci Σ_i Σ_j w[f, ci, i, j]·x[...]) + b[f], the taps in that order,
///   from 0;
/// - dx[c, y, x] = Σ_f Σ_i Σ_j w[f, c − kC/G, i, j]·dout[f, oy, ox], over c's group's
///   filters and the taps that reach (y, x), in that order, from 0;
/// - a sample's dweight[f, ci, i, j] = Σ_ox (Σ_oy dout[f, oy, ox]·x[...]), each column's
///   sum over the rows first, from 0; the samples are then added as [`grouped_backward`]
///   says.
///
/// A padded position adds w·0 (or dout·0) where the GPU skips it: the same sum, since a
/// sum from +0 is never −0 and adding ±0 to anything else leaves it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Direct {
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    s: usize,
    pt: usize,
    pl: usize,
    oh: usize,
    ow: usize,
    cpg: usize,
    opg: usize,
    groups: usize,
    xrows: usize,
    xcols: usize,
    a0: usize,
    b0: usize,
    drows: usize,
    dcols: usize,
}

impl Direct {
    pub(super) fn new(gr: &Grouping) -> Direct {
        let g = &gr.g;
        let (s, kh, kw) = (g.stride, g.kh, g.kw);
        // The rows and columns the windows read: HP = (OH − 1)·S + KH, and WP alike.
        let (hp, wp) = ((g.oh - 1) * s + kh, (g.ow - 1) * s + kw);
        // A block's last row reads (ROWS − 1)·S rows below its first.
        let (xrows, xcols) = (hp + (ROWS - 1) * s, wp.div_ceil(s));
        // dx's gather reads dout's row (y + PT − i)/S and column (x + PL − j)/S: from
        // −(KH − 1)/S and −(KW − 1)/S up to past the last row (column) of x by a block.
        let (a0, b0) = ((kh - 1) / s, (kw - 1) / s);
        let drows = a0 + g.oh.max(g.h.div_ceil(s) + g.pad_top.div_ceil(s)) + ROWS;
        let dcols = b0 + g.ow.max(g.w.div_ceil(s) + g.pad_left.div_ceil(s)) + COLS;
        let (h, w, pt, pl, oh, ow) = (g.h, g.w, g.pad_top, g.pad_left, g.oh, g.ow);
        let (cpg, opg, groups) = (gr.cpg(), gr.opg(), gr.groups);
        Direct { h, w, kh, kw, s, pt, pl, oh, ow, cpg, opg, groups, xrows, xcols, a0, b0, drows, dcols }
    }

    /// Floats of one channel's padded, phase-split plane.
    fn x_plane(&self) -> usize {
        self.s * self.xrows * self.xcols
    }

    /// Floats of the buffer of a group's padded x planes.
    pub(super) fn x_len(&self) -> usize {
        self.cpg * self.x_plane() + SLACK
    }

    fn dout_plane(&self) -> usize {
        self.drows * self.dcols
    }

    /// Floats of the buffer of a group's padded dout planes.
    pub(super) fn dout_len(&self) -> usize {
        self.opg * self.dout_plane() + SLACK
    }

    /// x's plane of a channel, xc: (H, W), into its padded, phase-split form (every value
    /// of `out` written).
    fn pad_x(&self, xc: &[f32], out: &mut [f32]) {
        let (s, h, w, pt, pl) = (self.s, self.h, self.w, self.pt, self.pl);
        for (ph, phase) in out.chunks_exact_mut(self.xrows * self.xcols).enumerate() {
            for (r, row) in phase.chunks_exact_mut(self.xcols).enumerate() {
                let Some(src) = r.checked_sub(pt).filter(|&y| y < h).map(|y| &xc[y * w..(y + 1) * w]) else {
                    row.fill(0.0);
                    continue;
                };
                if s == 1 {
                    // Columns q = x + PL: zeros, the row, zeros.
                    let (left, rest) = row.split_at_mut(pl.min(self.xcols));
                    left.fill(0.0);
                    let n = w.min(rest.len());
                    rest[..n].copy_from_slice(&src[..n]);
                    rest[n..].fill(0.0);
                } else {
                    for (q, v) in row.iter_mut().enumerate() {
                        *v = (q * s + ph).checked_sub(pl).filter(|&x| x < w).map_or(0.0, |x| src[x]);
                    }
                }
            }
        }
    }

    /// dout's plane of a filter, dc: (OH, OW), at (A0, B0) in a plane of zeros.
    fn pad_dout(&self, dc: &[f32], out: &mut [f32]) {
        for (a, row) in out.chunks_exact_mut(self.dcols).enumerate() {
            match a.checked_sub(self.a0).filter(|&oy| oy < self.oh) {
                Some(oy) => {
                    let (left, rest) = row.split_at_mut(self.b0);
                    left.fill(0.0);
                    rest[..self.ow].copy_from_slice(&dc[oy * self.ow..(oy + 1) * self.ow]);
                    rest[self.ow..].fill(0.0);
                }
                None => row.fill(0.0),
            }
        }
    }
}

/// One sample of [`Grouped::Direct`]'s forward: xn: (C, H, W) → yn: (O, OH·OW), WRITTEN;
/// weight: (O, C/G, KH, KW); bias: (O) or none; `xp` of [`Direct::x_len`] floats.
pub(super) fn direct_forward_sample(
    d: &Direct,
    xn: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    yn: &mut [f32],
    xp: &mut [f32],
) {
    let (plane, kk, p) = (d.h * d.w, d.kh * d.kw, d.oh * d.ow);
    let xplane = d.x_plane();
    for k in 0..d.groups {
        for ci in 0..d.cpg {
            let c = k * d.cpg + ci;
            d.pad_x(&xn[c * plane..(c + 1) * plane], &mut xp[ci * xplane..(ci + 1) * xplane]);
        }
        for f in k * d.opg..(k + 1) * d.opg {
            let wf = &weight[f * d.cpg * kk..(f + 1) * d.cpg * kk];
            // No bias adds 0, which leaves every sum as it is (a sum from +0 is never −0).
            let b = bias.map_or(0.0, |b| b[f]);
            direct_forward_plane(d, xp, wf, b, &mut yn[f * p..(f + 1) * p]);
        }
    }
}

/// Sample k of a chunk's `xs` through [`Grouped::Direct`]'s backward: its weight gradient
/// added into `dw` (O, C/G, KH, KW), its input gradient written where asked, each
/// group's channels copied out before they are written. dn: (O, OH·OW); `xp` and `dp` of
/// [`Direct::x_len`] and [`Direct::dout_len`] floats.
#[allow(clippy::too_many_arguments)]
pub(super) fn direct_backward_sample(
    d: &Direct,
    xs: &mut Samples<'_>,
    k: usize,
    dn: &[f32],
    weight: &[f32],
    dw: &mut [f32],
    xp: &mut [f32],
    dp: &mut [f32],
) {
    let (plane, kk, p) = (d.h * d.w, d.kh * d.kw, d.oh * d.ow);
    let (xplane, dplane) = (d.x_plane(), d.dout_plane());
    let per_in = d.groups * d.cpg * plane;
    for grp in 0..d.groups {
        let channels = grp * d.cpg..(grp + 1) * d.cpg;
        let xn = xs.input(k, per_in);
        for (ci, c) in channels.clone().enumerate() {
            d.pad_x(&xn[c * plane..(c + 1) * plane], &mut xp[ci * xplane..(ci + 1) * xplane]);
        }
        for (fl, f) in (grp * d.opg..(grp + 1) * d.opg).enumerate() {
            d.pad_dout(&dn[f * p..(f + 1) * p], &mut dp[fl * dplane..(fl + 1) * dplane]);
            for ci in 0..d.cpg {
                let dwt = &mut dw[(f * d.cpg + ci) * kk..(f * d.cpg + ci + 1) * kk];
                direct_dweight_plane(d, &xp[ci * xplane..], &dp[fl * dplane..], dwt);
            }
        }
        if let Some(dxn) = xs.grad(k, per_in) {
            let wg = &weight[grp * d.opg * d.cpg * kk..(grp + 1) * d.opg * d.cpg * kk];
            for (ci, c) in channels.enumerate() {
                direct_dx_plane(d, dp, wg, ci, &mut dxn[c * plane..(c + 1) * plane]);
            }
        }
    }
}

widest! {
    /// One output plane of [`Direct`]: y (OH, OW) WRITTEN, in blocks of ROWS × COLS.
    /// xp: the group's padded x planes; wf: the filter's (C/G, KH, KW).
    fn direct_forward_plane(d: &Direct, xp: &[f32], wf: &[f32], bias: f32, y: &mut [f32]) {
        let (s, xplane, xcols) = (d.s, d.x_plane(), d.xcols);
        for oy0 in (0..d.oh).step_by(ROWS) {
            for ox0 in (0..d.ow).step_by(COLS) {
                let mut acc = [[0.0f32; COLS]; ROWS];
                for ci in 0..d.cpg {
                    for i in 0..d.kh {
                        for j in 0..d.kw {
                            let wv = wf[(ci * d.kh + i) * d.kw + j];
                            let base = ci * xplane + ((j % s) * d.xrows + oy0 * s + i) * xcols + ox0 + j / s;
                            for (t, acc) in acc.iter_mut().enumerate() {
                                let src = &xp[base + t * s * xcols..][..COLS];
                                for (a, &v) in acc.iter_mut().zip(src) {
                                    *a += wv * v;
                                }
                            }
                        }
                    }
                }
                let cols = COLS.min(d.ow - ox0);
                for (t, acc) in acc.iter().enumerate().take(d.oh - oy0) {
                    let out = &mut y[(oy0 + t) * d.ow + ox0..][..cols];
                    for (o, &a) in out.iter_mut().zip(acc) {
                        *o = a + bias;
                    }
                }
            }
        }
    }
}

widest! {
    /// One (filter, channel) pair's weight gradient of one sample, added into dwt
    /// (KH, KW): per tap Σ_ox (Σ_oy dout·x), TAPS taps a pass over the planes (the last
    /// pass's spare taps read inside the slack and are dropped). xc: the channel's padded
    /// planes; dp: the filter's padded dout plane.
    fn direct_dweight_plane(d: &Direct, xc: &[f32], dp: &[f32], dwt: &mut [f32]) {
        let (s, xcols, kk) = (d.s, d.xcols, d.kh * d.kw);
        for t0 in (0..kk).step_by(TAPS) {
            // Where tap t's first input lies in xc: row i, column phase j mod S, j/S on.
            let mut at = [0usize; TAPS];
            for (u, at) in at.iter_mut().enumerate() {
                let t = (t0 + u).min(kk - 1);
                let (i, j) = (t / d.kw, t % d.kw);
                *at = ((j % s) * d.xrows + i) * xcols + j / s;
            }
            let mut tot = [0.0f32; TAPS];
            for ox0 in (0..d.ow).step_by(COLS) {
                let mut acc = [[0.0f32; COLS]; TAPS];
                for oy in 0..d.oh {
                    let drow = &dp[(oy + d.a0) * d.dcols + d.b0 + ox0..][..COLS];
                    for (acc, &at) in acc.iter_mut().zip(&at) {
                        let xrow = &xc[at + oy * s * xcols + ox0..][..COLS];
                        for ((a, &dv), &xv) in acc.iter_mut().zip(drow).zip(xrow) {
                            *a += dv * xv;
                        }
                    }
                }
                for (tot, acc) in tot.iter_mut().zip(&acc) {
                    for &a in &acc[..COLS.min(d.ow - ox0)] {
                        *tot += a;
                    }
                }
            }
            for (u, &v) in tot.iter().enumerate().take(kk - t0) {
                dwt[t0 + u] += v;
            }
        }
    }
}

widest! {
    /// One channel's input gradient, dx (H, W) WRITTEN, gathered from the group's padded
    /// dout planes `dp` through the group's weight wg (O/G, C/G, KH, KW) at channel ci.
    /// Rows y of one phase mod S meet the same taps i (those with S | y + PT − i), and
    /// columns x of one phase the same taps j: dx is summed a row phase and a column phase
    /// at a time, ROWS rows S apart and COLS columns S apart in a block.
    fn direct_dx_plane(d: &Direct, dp: &[f32], wg: &[f32], ci: usize, dx: &mut [f32]) {
        let (s, kh, kw, dcols, dplane) = (d.s, d.kh, d.kw, d.dcols, d.dout_plane());
        // Tap i reaches row y = ρ + kS from dout's row k + (ρ + PT − i)/S: its padded row
        // k + that + A0 (the division exact, A0 keeping it at 0 or more). Columns alike.
        // (S·size added before the division and size taken after keep it in usize.)
        let taps = |phase: usize, pad: usize, size: usize, zero: usize| -> Vec<(usize, usize)> {
            (0..size)
                .filter(|&i| (phase + pad + s * size - i).is_multiple_of(s))
                .map(|i| (i, (phase + pad + s * size - i) / s + zero - size))
                .collect()
        };
        for rho in 0..s.min(d.h) {
            let rows = (d.h - rho).div_ceil(s);
            let row_taps = taps(rho, d.pt, kh, d.a0);
            for r in 0..s.min(d.w) {
                let cols = (d.w - r).div_ceil(s);
                let col_taps = taps(r, d.pl, kw, d.b0);
                for k0 in (0..rows).step_by(ROWS) {
                    for q0 in (0..cols).step_by(COLS) {
                        let mut acc = [[0.0f32; COLS]; ROWS];
                        for fl in 0..d.opg {
                            let wf = &wg[(fl * d.cpg + ci) * kh * kw..][..kh * kw];
                            for &(i, ai) in &row_taps {
                                for &(j, bj) in &col_taps {
                                    let wv = wf[i * kw + j];
                                    let base = fl * dplane + (k0 + ai) * dcols + q0 + bj;
                                    for (t, acc) in acc.iter_mut().enumerate() {
                                        let src = &dp[base + t * dcols..][..COLS];
                                        for (a, &v) in acc.iter_mut().zip(src) {
                                            *a += wv * v;
                                        }
                                    }
                                }
                            }
                        }
                        let n = COLS.min(cols - q0);
                        for (t, acc) in acc.iter().enumerate().take(rows - k0) {
                            let y = rho + (k0 + t) * s;
                            let row = &mut dx[y * d.w..(y + 1) * d.w];
                            for (l, &a) in acc[..n].iter().enumerate() {
                                row[(q0 + l) * s + r] = a;
                            }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layer at geometry `g` with `o` filters on `n` samples drawn U(−0.5, 0.5) from
    /// `seed`, run through columns and through rows: (y, dx, dweight) of each, dweight as
    /// (O, C, KH·KW) (rows' through [`add_rows_dweight`], the conversion the layer uses).
    #[allow(clippy::type_complexity)]
    fn both_ways(g: Im2colGeom, n: usize, o: usize, seed: u64) -> [(&'static str, Vec<f32>, Vec<f32>); 3] {
        let (kk, p) = (g.kh * g.kw, g.col_cols());
        let mut r = crate::rng::SplitMix64::new(seed);
        let mut rand = |len: usize| (0..len).map(|_| r.next_f32() - 0.5).collect::<Vec<f32>>();
        let (x, w, dout) = (rand(n * g.c * g.h * g.w), rand(o * g.c * kk), rand(n * o * p));
        let wt = oihw_to_hwio(&w, o, g.c, kk);
        let run = |unfold, weight: &[f32]| {
            let job = PassContext { g, o, weight, unfold, winograd: None };
            let mut y = vec![0.0; n * o * p];
            let mut dx = vec![0.0; x.len()];
            job.forward(&x, &mut y, None, &mut Scratch::default());
            let xs = Samples::Apart { x: &x, dx: Some(&mut dx) };
            let (dw, _) = job.backward(0..n, xs, &dout, false, &mut Scratch::default());
            (y, dx, dw)
        };
        let (y1, dx1, dw1) = run(Unfold::Columns, &w);
        let (y2, dx2, dw2) = run(Unfold::Rows, &wt);
        let mut dw2_oihw = vec![0.0; dw1.len()];
        add_rows_dweight(&mut dw2_oihw, &dw2, &g, o);
        [("y", y1, y2), ("dx", dx1, dx2), ("dweight", dw1, dw2_oihw)]
    }

    #[test]
    fn rows_in_bands_compute_the_convolution_of_columns() {
        // resnet8's first stage: a sample's rows (784 × 144 f32, 441 KB) exceed the budget,
        // so rows run in bands of pixels, with the weight's gradient transposed at O = 16
        // and not at O = 64. Against columns, which unfold whole samples: equal up to
        // summation order (sums of 144 products, and of 2·784 for the weight's gradient),
        // within 1e-5 relative (absolute below 1).
        let g = Im2colGeom { c: 16, h: 28, w: 28, kh: 3, kw: 3, stride: 1, pad_top: 1, pad_left: 1, oh: 28, ow: 28 };
        let (t, p) = (rows_tiling(&g), g.col_cols());
        assert!(t.samples == 1 && t.band < p && t.bands(p).count() == 4, "{t:?}");
        assert_eq!(t.bands(p).map(|b| b.len()).sum::<usize>(), p);
        for o in [16, 64] {
            assert_eq!(dweight_transposed(&g, o), o == 16);
            for (what, cols, rows) in both_ways(g, 2, o, 7) {
                assert_eq!(cols.len(), rows.len(), "O {o}: {what}");
                let worst =
                    cols.iter().zip(&rows).map(|(p, q)| (p - q).abs() / q.abs().max(1.0)).fold(0.0f32, f32::max);
                assert!(worst <= 1e-5, "O {o}: {what} differs by {worst:e}");
            }
        }
    }

    /// A convolution's batch: the geometry of a sample, O filters, and x: (N, C, H, W),
    /// w: (O, C, KH, KW), b: (O), dout: (N, O, OH, OW), drawn U(−0.5, 0.5) from `seed`.
    struct Batch {
        g: Im2colGeom,
        o: usize,
        x: Vec<f32>,
        w: Vec<f32>,
        b: Vec<f32>,
        dout: Vec<f32>,
    }

    impl Batch {
        fn draw(g: Im2colGeom, o: usize, n: usize, seed: u64) -> Batch {
            let mut r = crate::rng::SplitMix64::new(seed);
            let mut rand = |len: usize| (0..len).map(|_| r.next_f32() - 0.5).collect::<Vec<f32>>();
            let (x, w) = (rand(n * g.c * g.h * g.w), rand(o * g.c * g.kh * g.kw));
            let (b, dout) = (rand(o), rand(n * o * g.oh * g.ow));
            Batch { g, o, x, w, b, dout }
        }

        /// Sample s alone.
        fn sample(&self, s: usize) -> Batch {
            let (per_in, per_out) = (self.g.c * self.g.h * self.g.w, self.o * self.g.oh * self.g.ow);
            let x = self.x[s * per_in..(s + 1) * per_in].to_vec();
            let dout = self.dout[s * per_out..(s + 1) * per_out].to_vec();
            Batch { x, dout, w: self.w.clone(), b: self.b.clone(), ..*self }
        }

        /// What the public functions give in a pool of `threads` threads: (y, dweight,
        /// dbias, dx), the gradients from dweight and dbias at 0, the output and input
        /// gradient from NaN (each value must be written).
        fn run(&self, threads: usize) -> [Vec<f32>; 4] {
            let Batch { g, o, x, w, b, dout } = self;
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut y = vec![f32::NAN; dout.len()];
                conv2d_forward(x, w, None, Some(b), &mut y, g, *o);
                let (mut dw, mut db, mut dx) = (vec![0.0; w.len()], vec![0.0; *o], vec![f32::NAN; x.len()]);
                let xs = Samples::Apart { x, dx: Some(&mut dx) };
                conv2d_backward(xs, dout, w, None, &mut dw, Some(&mut db), g, *o);
                [y, dw, db, dx]
            })
        }

        /// The f64 reference of [`Batch::run`]'s four results, from the definition of the
        /// cross-correlation, each value with the count and the sum of magnitudes of the
        /// terms it adds: (value, terms, Σ|term|).
        fn reference(&self) -> [Vec<(f64, usize, f64)>; 4] {
            let Batch { g, o, x, w, b, dout } = self;
            let (c, kk, p, o) = (g.c, g.kh * g.kw, g.oh * g.ow, *o);
            let n = x.len() / (c * g.h * g.w);
            let add = |acc: &mut (f64, usize, f64), t: f64| *acc = (acc.0 + t, acc.1 + 1, acc.2 + t.abs());
            let mut y = vec![(0.0, 0, 0.0); n * o * p];
            let (mut dw, mut db, mut dx) =
                (vec![(0.0, 0, 0.0); w.len()], vec![(0.0, 0, 0.0); o], vec![(0.0, 0, 0.0); x.len()]);
            for s in 0..n {
                for (f, (&bf, dbf)) in b.iter().zip(db.iter_mut()).enumerate() {
                    for q in 0..p {
                        let out = (s * o + f) * p + q;
                        add(&mut y[out], bf as f64);
                        add(dbf, dout[out] as f64);
                        let (oy, ox) = ((q / g.ow * g.stride) as isize, (q % g.ow * g.stride) as isize);
                        for t in 0..kk {
                            let iy = oy + (t / g.kw) as isize - g.pad_top as isize;
                            let ix = ox + (t % g.kw) as isize - g.pad_left as isize;
                            if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                                continue;
                            }
                            for ch in 0..c {
                                let xi = ((s * c + ch) * g.h + iy as usize) * g.w + ix as usize;
                                let wi = (f * c + ch) * kk + t;
                                add(&mut y[out], w[wi] as f64 * x[xi] as f64);
                                add(&mut dw[wi], dout[out] as f64 * x[xi] as f64);
                                add(&mut dx[xi], w[wi] as f64 * dout[out] as f64);
                            }
                        }
                    }
                }
            }
            [y, dw, db, dx]
        }

        /// [`Batch::run`] on one thread against [`Batch::reference`], each value a sum of k
        /// terms in f32 in some order, whose error is at most k·2⁻²⁴·Σ|term| (a sum's
        /// classical bound, fused multiply-adds or not); then the same bits on 2 threads,
        /// and sample s's output and input gradient alone the bits they have in the batch.
        fn holds(&self, what: &str) {
            let got = self.run(1);
            for ((part, got), want) in ["y", "dweight", "dbias", "dx"].iter().zip(&got).zip(&self.reference()) {
                assert_eq!(got.len(), want.len(), "{what}: {part}");
                for (i, (&v, &(exact, k, mag))) in got.iter().zip(want).enumerate() {
                    let bound = k as f64 * 2f64.powi(-24) * mag;
                    let off = (v as f64 - exact).abs();
                    assert!(off <= bound, "{what}: {part}[{i}] {v} against {exact} (bound {bound:e})");
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            for ((part, one), two) in ["y", "dweight", "dbias", "dx"].iter().zip(&got).zip(&self.run(2)) {
                assert_eq!(bits(one), bits(two), "{what}: {part} on 1 and 2 threads");
            }
            let (per_in, per_out) = (self.g.c * self.g.h * self.g.w, self.o * self.g.oh * self.g.ow);
            let s = self.x.len() / per_in / 2;
            let [y1, _, _, dx1] = self.sample(s).run(2);
            assert_eq!(bits(&y1), bits(&got[0][s * per_out..(s + 1) * per_out]), "{what}: y of sample {s} alone");
            assert_eq!(bits(&dx1), bits(&got[3][s * per_in..(s + 1) * per_in]), "{what}: dx of sample {s} alone");
        }
    }

    #[test]
    fn pointwise_computes_the_convolution_alike_on_any_threads_and_batch() {
        // 1×1 at stride 1 without padding (C and O not multiples of 16; C = 3 where columns
        // ran before, C = 20 and 37 where rows did), batches of 3 to 5 chunks
        // ([`Batch::holds`]).
        let shapes = [(3, 5, 4, 4, 24), (20, 36, 7, 7, 33), (37, 12, 5, 9, 40)]; // (C, O, H, W, N)
        for (c, o, h, w, n) in shapes {
            let g = Im2colGeom { c, h, w, kh: 1, kw: 1, stride: 1, pad_top: 0, pad_left: 0, oh: h, ow: w };
            assert_eq!(unfold(&g, o), Unfold::Pointwise);
            assert!(batch_chunks(n).len() >= 3, "N {n}: {:?}", batch_chunks(n));
            Batch::draw(g, o, n, (c * o) as u64).holds(&format!("C {c} O {o}"));
        }
    }

    #[test]
    fn taps_compute_the_convolution_alike_on_any_threads_and_batch() {
        // Stride 1, the input's size, under 16 filters: a DenseNet's 48→12 3×3 (one 12-row
        // tile of the product on AVX-512), 5×5 at C = 5, 2×3 (Keras's "same" for an even
        // kernel: the extra row of padding at the bottom), 3×3 with one filter; batches of
        // several chunks ([`Batch::holds`]).
        // (C, O, KH, KW, pad top, pad left, H, W, N)
        let shapes = [
            (48, 12, 3, 3, 1, 1, 9, 11, 24),
            (5, 7, 5, 5, 2, 2, 6, 7, 17),
            (9, 4, 2, 3, 0, 1, 5, 8, 20),
            (16, 1, 3, 3, 1, 1, 4, 4, 16),
        ];
        for (c, o, kh, kw, pad_top, pad_left, h, w, n) in shapes {
            let g = Im2colGeom { c, h, w, kh, kw, stride: 1, pad_top, pad_left, oh: h, ow: w };
            assert_eq!(unfold(&g, o), Unfold::Taps, "C {c} O {o} {kh}x{kw}");
            assert!(batch_chunks(n).len() >= 2, "N {n}: {:?}", batch_chunks(n));
            Batch::draw(g, o, n, (c * o + kh) as u64).holds(&format!("C {c} O {o} {kh}x{kw}"));
        }
        // Where the output is not the input's size, or at stride 2, rows run.
        let valid = Im2colGeom { c: 48, h: 9, w: 9, kh: 3, kw: 3, stride: 1, pad_top: 0, pad_left: 0, oh: 7, ow: 7 };
        assert_eq!(unfold(&valid, 12), Unfold::Rows);
        assert_eq!(unfold(&Im2colGeom { stride: 2, oh: 5, ow: 5, pad_top: 1, pad_left: 1, ..valid }, 12), Unfold::Rows);
    }

    #[test]
    fn both_unfoldings_compute_the_same_convolution() {
        // The same layer run through columns and rows: equal up to summation order
        // (|Δ| ≤ 1e-5 on values of order 1, sums of 2·3·3 = 18 products). O = 4 takes rows'
        // weight gradient transposed, O = 20 not.
        let g = Im2colGeom { c: 2, h: 7, w: 6, kh: 3, kw: 3, stride: 2, pad_top: 1, pad_left: 1, oh: 4, ow: 3 };
        assert!(dweight_transposed(&g, 4) && !dweight_transposed(&g, 20));
        for o in [4, 20] {
            for (what, cols, rows) in both_ways(g, 3, o, 5) {
                assert_eq!(cols.len(), rows.len(), "O {o}: {what}");
                assert!(cols.iter().zip(&rows).all(|(p, q)| (p - q).abs() <= 1e-5), "O {o}: {what}");
            }
        }
    }
}
