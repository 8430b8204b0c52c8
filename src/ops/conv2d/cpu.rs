//! Conv2d on the CPU: the forward and backward of a 2-D cross-correlation over NCHW, weight
//! (O, C, KH, KW) as in PyTorch, as plain functions ([`conv2d_forward`],
//! [`conv2d_backward`]) over the backend's products (`backend::cpu`'s GEMM and unfoldings,
//! `backend::winograd`), which stay there; and [`add_bias`] and [`bias_grad`], the bias
//! kernels' CPU twins. The reference kernels/conv2d.cu is checked against
//! (`super::gpu::host_check`).
//!
//! The batch is cut into the fixed chunks of `backend::cpu::batch_chunks`, which run in
//! parallel on the device's pool; within a chunk, a 3×3 convolution at stride 1 between
//! at least 8 channels runs by Winograd's F(4×4, 3×3) (`backend::winograd`, 4 times
//! fewer multiply-adds), and any other is GEMM over unfolded inputs, in one of two
//! layouts: channels-first columns for a small C·KH·KW (the first layer of an image
//! model), and channels-last rows otherwise (every kernel row of a pixel is one contiguous
//! copy of KW·C values, and a whole chunk is one GEMM). The choice (`Unfold`) is a
//! function of the layer's shape alone. Gradients of the weight and bias are summed per
//! chunk and the chunks added in chunk order, so the result is bitwise the same whatever
//! the thread count.
//!
//! Every unfolding writes each value of the output and of the input gradient (none is
//! read first), and reads a sample whole before writing its gradient, so the layer may
//! hand the forward memory that holds anything and the backward the input's own values
//! to write the gradient over ([`Samples`]).

use std::borrow::Cow;
use std::ops::Range;

use rayon::prelude::*;

use crate::backend::cpu::{
    add_partials, batch_chunks, chw_to_hwc, col2im, gemm_with, hwc_to_chw, im2col, im2row, row2im, split_by_chunks,
    sum_partials, Accumulate, Im2colGeom, Mat, Pieces, Samples, Threads,
};
use crate::backend::par;
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
    let xs: Vec<Samples<'_>> = match xs {
        Samples::Overwritten(both) => split_by_chunks(both, n, per_in).into_iter().map(Samples::Overwritten).collect(),
        Samples::Apart { x, dx } => {
            let dxs: Vec<Option<&mut [f32]>> = match dx {
                Some(dx) => split_by_chunks(dx, n, per_in).into_iter().map(Some).collect(),
                None => chunks.iter().map(|_| None).collect(),
            };
            let xs = chunks.iter().map(|r| &x[r.start * per_in..r.end * per_in]);
            xs.zip(dxs).map(|(x, dx)| Samples::Apart { x, dx }).collect()
        }
    };
    let mut scratch = borrow_scratch(chunks.len());
    let with_bias = dbias.is_some();
    let work = chunks.into_par_iter().zip(xs).zip(&mut scratch[..]);
    let partials: Vec<(Vec<f32>, Vec<f32>)> =
        par::map_collect(work, |((range, xs), scratch)| job.backward(range, xs, dout, with_bias, scratch));
    give_back(scratch);
    let (dws, dbs): (Vec<_>, Vec<_>) = partials.into_iter().unzip();
    match how {
        Unfold::Columns => add_partials(dweight, dws),
        Unfold::Winograd => {
            let dv = winograd::weight_grad(&sum_partials(dws), g.c, o);
            dweight.iter_mut().zip(&dv).for_each(|(d, v)| *d += v);
        }
        Unfold::Rows => {
            add_rows_dweight(dweight, &sum_partials(dws), g, o);
        }
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
}

/// The unfolding for a geometry and O filters: a function of the layer's shape alone, so
/// that the arithmetic (and its rounding) never depends on the batch or the machine.
pub(super) fn unfold(g: &Im2colGeom, o: usize) -> Unfold {
    if winograd::applies(g.c, o, (g.kh, g.kw), g.stride) {
        Unfold::Winograd
    } else if g.col_rows() <= 32 {
        Unfold::Columns
    } else {
        Unfold::Rows
    }
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
    /// The weight in the layout of `unfold`: (O, C·KH·KW) for columns, (KH·KW·C, O) for rows.
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
    /// transpose where [`dweight_transposed`], and for Winograd the transformed dV (the
    /// chunks' sum is transformed back once). dout: (N, O, OH·OW); the chunk's samples
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

/// The weight in the layout `unfold` multiplies by: (O, C·KH·KW) for columns and Winograd,
/// (KH·KW·C, O) for rows. w: (O, C, KH, KW)
fn weight_for<'a>(w: &'a [f32], g: &Im2colGeom, o: usize, unfold: Unfold) -> Cow<'a, [f32]> {
    match unfold {
        Unfold::Columns | Unfold::Winograd => Cow::Borrowed(w),
        Unfold::Rows => Cow::Owned(oihw_to_hwio(w, o, g.c, g.kh * g.kw)),
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
