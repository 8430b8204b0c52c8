//! Conv2d: 2-D cross-correlation over NCHW, weight (O, C, KH, KW) as in PyTorch, with
//! Keras's `valid` and `same` padding (where the window sits is `ops::window`'s, shared
//! with pooling and the GPU).
//!
//! The batch is cut into the fixed groups of `backend::cpu::batch_groups`, which run in
//! parallel on the device's pool; within a group, a 3×3 convolution at stride 1 between
//! at least 8 channels runs by Winograd's F(4×4, 3×3) (`backend::winograd`, 4 times
//! fewer multiply-adds), and any other is GEMM over unfolded inputs, in one of two
//! layouts: channels-first columns for a small C·KH·KW (the first layer of an image
//! model), and channels-last rows otherwise (every kernel row of a pixel is one contiguous
//! copy of KW·C values, and a whole group is one GEMM). The choice (`Unfold`) is a
//! function of the layer's shape alone. Gradients of the weight and bias are summed per
//! group and the groups added in group order, so the result is bitwise the same whatever
//! the thread count.
//!
//! A training step allocates no zeroed memory for a convolution's two big results: the
//! forward writes its output into the values of the last backward's output gradient (the
//! same shape), and the backward writes the input gradient over the input it kept, where
//! nothing else holds it ([`Samples`]); every unfolding writes each value of both, and
//! reads a sample whole before writing its gradient. The zeroing they replace took
//! 1.6–1.8% of a `resnet8` step (`perf`: `memset` from 4.96–5.18% to 3.40%).
//!
//! Owns also its spec entry (`conv2d`), its spec form and its memory account: what it
//! keeps for backward and the weight-gradient partials of its groups.

#[cfg(feature = "cuda")]
pub mod gpu;

use std::borrow::Cow;
use std::ops::Range;

use rayon::prelude::*;

use super::window::{Geometry2d, Padding, Window2d};
use serde_json::{json, Value};

use super::spec::{expect_images, Build, LayerType};
use super::{Ctx, Init, InputGrad, Layer, LayerMemory, LayerShapes, Mode, ParamSpec, Params, ParamsMut, F32};
use crate::backend::cpu::{
    add_partials, batch_groups, chw_to_hwc, col2im, gemm_packing, gemm_with, hwc_to_chw, im2col, im2row, row2im,
    split_by_groups, sum_partials, Accumulate, Im2colGeom, Mat, Pieces, Samples, Threads,
};
use crate::backend::par;
use crate::backend::winograd;
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// How a convolution unfolds its input.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Unfold {
    /// Channels-first columns (C·KH·KW, OH·OW) per sample, one GEMM per sample with the
    /// weight as (O, C·KH·KW), written straight into NCHW: for a small C·KH·KW, where
    /// stacked rows would make GEMMs with a tiny inner dimension.
    Columns,
    /// Channels-last rows (OH·OW, KH·KW·C) per sample, stacked for the whole group, one
    /// GEMM per group with the weight as (KH·KW·C, O).
    Rows,
    /// Winograd's F(4×4, 3×3) (`backend::winograd`): a 3×3 kernel at stride 1 between
    /// at least 8 channels, in 4 times fewer multiply-adds than the unfoldings.
    Winograd,
}

/// The unfolding for a geometry and O filters: a function of the layer's shape alone, so
/// that the arithmetic (and its rounding) never depends on the batch or the machine.
fn unfold(g: &Im2colGeom, o: usize) -> Unfold {
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

/// How [`Unfold::Rows`] cuts a group ([`Pieces`] of [`ROWS_BUDGET`]): several samples'
/// rows stacked into one GEMM, or one sample in bands of output pixels. The bands order
/// the weight gradient's sums, so this is a function of the geometry alone.
fn rows_tiling(g: &Im2colGeom) -> Pieces {
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

/// The CPU backend's geometry of one sample of C channels, from the shared window
/// placement (the backend takes one stride: Conv2d's are equal).
fn cpu_geom(c: usize, g: &Geometry2d) -> Im2colGeom {
    let ((kh, kw), (stride, _)) = (g.window.kernel, g.window.stride);
    Im2colGeom { c, h: g.h, w: g.w, kh, kw, stride, pad_top: g.pad_top, pad_left: g.pad_left, oh: g.oh, ow: g.ow }
}

/// The Winograd geometry of a layer's sample with O filters.
fn winograd_geom(g: &Im2colGeom, o: usize) -> winograd::Geom {
    let (c, h, w, oh, ow, pad_top, pad_left) = (g.c, g.h, g.w, g.oh, g.ow, g.pad_top, g.pad_left);
    winograd::Geom { c, h, w, o, oh, ow, pad_top, pad_left }
}

/// A 2-D convolution layer.
#[derive(Clone, Debug)]
pub struct Conv2d {
    in_channels: usize,
    filters: usize,
    kernel: (usize, usize),
    stride: usize,
    padding: Padding,
    use_bias: bool,
    /// x: (N, C, H, W) of the training forward.
    x: Option<Tensor>,
    /// The weight as [`Unfold::Winograd`] multiplies by, from the training forward.
    transformed: Option<winograd::Weights>,
    /// The values of the last backward's output gradient, which has the output's shape:
    /// the next forward writes its output there instead of into fresh zeroed memory
    /// (every unfolding writes each output value). Held from the backward to the next
    /// forward, in place of the output that the backward has freed by then, so the peak
    /// (the end of a forward) never holds it.
    spare: Option<Vec<f32>>,
}

/// Work buffers lent to the convolution that runs, one per group of samples, and given
/// back when it ends: whatever the model's depth, the process holds as many as run at
/// once (a group per core of each device), sized by the largest layer, not a set per
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

/// One group's work buffers (contents are overwritten before every use).
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

    /// The buffers lent to a Winograd group: the padded samples in `xt`, the transformed
    /// tiles in `unfolded` and `out`, the padded input gradients in `dxt`.
    fn winograd(&mut self) -> winograd::Scratch<'_> {
        let Scratch { xt, unfolded, out, dxt, yt } = self;
        winograd::Scratch { xp: xt, u: unfolded, m: out, yt, dxp: dxt }
    }
}

/// What every group of one forward or backward shares.
struct Job<'a> {
    g: Im2colGeom,
    o: usize,
    /// The weight in the layout of `unfold`: (O, C·KH·KW) for columns, (KH·KW·C, O) for rows.
    weight: &'a [f32],
    unfold: Unfold,
    /// The weight transformed, for [`Unfold::Winograd`].
    winograd: Option<&'a winograd::Weights>,
}

impl Job<'_> {
    fn per_in(&self) -> usize {
        self.g.c * self.g.h * self.g.w
    }

    fn winograd(&self) -> (winograd::Geom, &winograd::Weights) {
        (winograd_geom(&self.g, self.o), self.winograd.expect("the weight transformed for Winograd"))
    }

    // xs: (G, C, H, W), a group's samples → y_group: (G, O, OH·OW)
    fn forward(&self, xs: &[f32], y_group: &mut [f32], bias: Option<&[f32]>, scratch: &mut Scratch) {
        let (g, o, per_in) = (&self.g, self.o, self.per_in());
        let (kkc, p) = (g.col_rows(), g.col_cols());
        let x = |k: usize| &xs[k * per_in..(k + 1) * per_in];
        match self.unfold {
            Unfold::Winograd => {
                let (wg, wt) = self.winograd();
                winograd::forward_group(&wg, wt, xs, y_group, scratch.winograd());
                if let Some(b) = bias {
                    y_group.chunks_exact_mut(o * p).for_each(|yn| add_bias(yn, b, p));
                }
            }
            Unfold::Columns => {
                let (_, col, _, _) = scratch.sized(0, kkc * p, 0, 0);
                for (k, yn) in y_group.chunks_exact_mut(o * p).enumerate() {
                    im2col(x(k), g, col);
                    let acc = fill_bias(yn, bias, p);
                    gemm_with(Mat::rows(self.weight, o, kkc), Mat::rows(col, kkc, p), yn, p, acc, Threads::Caller);
                }
            }
            Unfold::Rows => {
                let t = rows_tiling(g);
                let (xt, rows, out, _) = scratch.sized(per_in, t.samples * t.band * kkc, t.samples * p * o, 0);
                let samples: Vec<usize> = (0..xs.len() / per_in).collect();
                for (chunk, y_chunk) in samples.chunks(t.samples).zip(y_group.chunks_mut(t.samples * o * p)) {
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

    /// The group's (dweight, dbias): dweight in the layout of `weight`, or for rows its
    /// transpose where [`dweight_transposed`], and for Winograd the transformed dV (the
    /// groups' sum is transformed back once). dout: (N, O, OH·OW); the group's samples
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
        for s in range.clone() {
            for (b, plane) in db.iter_mut().zip(dout(s).chunks_exact(p)) {
                *b += plane.iter().sum::<f32>();
            }
        }
        let mut dw = vec![0.0f32; if self.unfold == Unfold::Winograd { 0 } else { o * kkc }];
        match self.unfold {
            Unfold::Winograd => {
                let (wg, wt) = self.winograd();
                let dys = &ds[range.start * o * p..range.end * o * p];
                dw = winograd::backward_group(&wg, wt, xs, dys, scratch.winograd());
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

/// Adds each output channel's bias to its plane of P values. yn: (O, P)
fn add_bias(yn: &mut [f32], bias: &[f32], p: usize) {
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

impl Conv2d {
    /// `filters` output channels from `in_channels`, kernel KH×KW, stride, padding, bias.
    pub fn new(
        in_channels: usize,
        filters: usize,
        kernel: (usize, usize),
        stride: usize,
        padding: Padding,
        use_bias: bool,
    ) -> Result<Conv2d> {
        if in_channels == 0 || filters == 0 || kernel.0 == 0 || kernel.1 == 0 || stride == 0 {
            return Err(Error::config(
                "Conv2d",
                format!("channels, filters, kernel and stride must be positive (got {in_channels}, {filters}, {kernel:?}, {stride})"),
            ));
        }
        padding.check(kernel).map_err(|e| Error::config("Conv2d", e))?;
        Ok(Conv2d { in_channels, filters, kernel, stride, padding, use_bias, x: None, transformed: None, spare: None })
    }

    /// The sliding window: kernel, stride (the same along H and W), padding.
    pub fn window(&self) -> Window2d {
        Window2d::new(self.kernel, (self.stride, self.stride), self.padding)
    }

    /// The spec entry: Keras's `Conv2D(filters, kernel_size, strides=1, padding="valid",
    /// use_bias=True, activation=None)`, its input channels those of the running shape.
    pub const SPEC: LayerType = LayerType {
        name: "conv2d",
        fields: "`filters`, `kernel_size` (int or [kh, kw]), `strides` (1; int or [s, s]), `padding` (\"valid\", \"same\", or pads: int or [ph, pw]; \"valid\"), `use_bias` (true), `activation` (\"linear\")",
        example: (
            &[2, 7, 6],
            r#"{"type": "conv2d", "filters": 3, "kernel_size": [3, 2], "strides": 2, "padding": "same", "use_bias": false, "activation": "relu"}"#,
        ),
        parse: |f| {
            let filters = f.size("filters", None)?;
            let kernel = f.pair("kernel_size", None)?;
            let (sh, sw) = f.pair("strides", Some((1, 1)))?;
            if sh != sw {
                return Err(format!("field 'strides' [{sh}, {sw}]: only equal strides are supported"));
            }
            let padding = f.padding()?;
            let use_bias = f.boolean("use_bias", true)?;
            let activation = f.activation()?;
            Ok(Build::layers(move |input| {
                let conv = Conv2d::new(expect_images(input)?, filters, kernel, sh, padding, use_bias)
                    .map_err(|e| e.to_string())?;
                Ok(activation.after(Box::new(conv)))
            }))
        },
        #[cfg(feature = "cuda")]
        kernels: Some(&gpu::KERNELS),
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Values,
            #[cfg(feature = "cuda")]
            host: None,
        },
    };

    fn geometry(&self, input: &Shape) -> Result<(usize, Im2colGeom)> {
        let (n, c, h, w) = input.nchw("Conv2d")?;
        if c != self.in_channels {
            return Err(Error::shape("Conv2d", format!("expected {} input channels, got {input}", self.in_channels)));
        }
        let (kh, kw) = self.kernel;
        let g = self.window().over(h, w).ok_or_else(|| {
            Error::shape("Conv2d", format!("input {input} is empty or smaller than the {kh}x{kw} kernel"))
        })?;
        Ok((n, cpu_geom(c, &g)))
    }

    /// The weight in the layout `unfold` multiplies by.
    fn weight_for<'a>(&self, w: &'a [f32], g: &Im2colGeom, unfold: Unfold) -> Cow<'a, [f32]> {
        match unfold {
            Unfold::Columns | Unfold::Winograd => Cow::Borrowed(w),
            Unfold::Rows => Cow::Owned(oihw_to_hwio(w, self.filters, g.c, g.kh * g.kw)),
        }
    }
}

impl Layer for Conv2d {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "conv"
    }

    fn spec(&self) -> Option<Value> {
        let w = self.window();
        Some(json!({
            "type": "conv2d",
            "filters": self.filters,
            "kernel_size": [w.kernel.0, w.kernel.1],
            "strides": [w.stride.0, w.stride.1],
            "padding": w.padding.to_json(),
            "use_bias": self.use_bias,
        }))
    }

    /// Per sample its input (for dweight) and its channels-last output scratch; per group
    /// of samples the partial weight gradient (O, C, KH, KW) that the groups' sum adds in
    /// group order (the bias partials are too small to count).
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let (kh, kw) = self.kernel;
        let weights = (self.in_channels as u64 * self.filters as u64).saturating_mul((kh * kw) as u64);
        let (input, output) = (shapes.input.numel() as u64, shapes.output.numel() as u64);
        // The lent buffers (`Scratch`), the larger of the forward's and the backward's:
        // Rows: a sample channels-last (and in the backward its gradient), a piece's rows
        // and its chunk's outputs ([`rows_tiling`]);
        // Columns: one sample's columns and (backward) their gradient.
        let one: Vec<usize> = std::iter::once(1).chain(shapes.input.dims().iter().copied()).collect();
        let (_, g) = self.geometry(&Shape::new(one)).ok()?;
        let (kkc, p, o) = (g.col_rows() as u64, g.col_cols() as u64, self.filters as u64);
        let wg = winograd_geom(&g, self.filters);
        let how = unfold(&g, self.filters);
        // Winograd: each group's partial is its transformed dV (36/9 of the weight), and
        // the transformed weight (V and Vᵀ) is held once from the forward to the backward.
        let (per_group, per_layer) = match how {
            Unfold::Winograd => (winograd::dv_floats(&wg) as u64, winograd::weight_floats(&wg) as u64),
            _ => (weights, 0),
        };
        let lent = match how {
            Unfold::Winograd => winograd::scratch_floats(&wg) as u64,
            Unfold::Rows => {
                let t = rows_tiling(&g);
                2 * (self.in_channels * g.h * g.w) as u64 + t.samples as u64 * (t.band as u64 * kkc + p * o)
            }
            Unfold::Columns => 2 * kkc * p,
        };
        // The products' packing, whichever unfolding runs: columns (O × KKC by KKC × P, and
        // the backward's two), rows and Winograd (any number of rows or tiles by KKC or C,
        // to O, and back; `gemm_packing` bounds the count).
        let (kkc, p, o, c, any) = (kkc as usize, p as usize, self.filters, self.in_channels, usize::MAX);
        let products = [
            (o, p, kkc),
            (o, kkc, p),
            (kkc, p, o),
            (any, o, kkc),
            (kkc, o, any),
            (o, kkc, any),
            (any, kkc, o),
            (any, o, c),
            (c, o, any),
            (any, c, o),
        ];
        Some(LayerMemory {
            kept_per_sample: input.saturating_add(output).saturating_mul(F32),
            per_group: per_group.saturating_mul(F32),
            per_layer: per_layer.saturating_mul(F32),
            lent_per_group: lent.saturating_mul(F32),
            gemm: products.into_iter().map(|(m, n, k)| gemm_packing(m, n, k)).max().unwrap_or(0),
        })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (n, g) = self.geometry(input)?;
        Ok(Shape::new([n, self.filters, g.oh, g.ow]))
    }

    fn params(&self) -> Vec<ParamSpec> {
        let (o, c, (kh, kw)) = (self.filters, self.in_channels, self.kernel);
        let mut p = vec![ParamSpec {
            name: "weight".into(),
            shape: Shape::new([o, c, kh, kw]),
            init: Init::GlorotUniform { fan_in: c * kh * kw, fan_out: o * kh * kw },
        }];
        if self.use_bias {
            p.push(ParamSpec { name: "bias".into(), shape: Shape::new([o]), init: Init::Zeros });
        }
        p
    }

    // x: (N, C, H, W) → y: (N, O, OH, OW)
    fn forward(&mut self, x: Tensor, params: Params<'_>, _buffers: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (n, g) = self.geometry(x.shape())?;
        let (o, p) = (self.filters, g.col_cols());
        let how = unfold(&g, o);
        let weight = self.weight_for(params.get(0), &g, how);
        let transformed = (how == Unfold::Winograd).then(|| winograd::transform_weights(params.get(0), g.c, o));
        let job = Job { g, o, weight: &weight, unfold: how, winograd: transformed.as_ref() };
        let bias = self.use_bias.then(|| params.get(1));
        let mut y = self.spare.take().filter(|v| v.len() == n * o * p).unwrap_or_else(|| vec![0.0f32; n * o * p]);
        let groups = batch_groups(n);
        let mut scratch = borrow_scratch(groups.len());
        let work = groups.into_par_iter().zip(split_by_groups(&mut y, n, o * p)).zip(&mut scratch[..]);
        let xs = |r: Range<usize>| &x.host()[r.start * job.per_in()..r.end * job.per_in()];
        par::for_each(work, |((range, y_group), scratch)| job.forward(xs(range), y_group, bias, scratch));
        give_back(scratch);
        let y = Tensor::from_vec_on(y, [n, o, g.oh, g.ow], x.device())?;
        let train = ctx.mode == Mode::Train;
        self.transformed = transformed.filter(|_| train);
        self.x = train.then_some(x);
        Ok(y)
    }

    // dout: (N, O, OH, OW) → dx: (N, C, H, W)
    // dweight (O, C, KH, KW) += Σ_n dout_n ⋆ x_n;  dbias (O) += Σ_n Σ_p dout_n[o, p]
    fn backward(
        &mut self,
        dout: Tensor,
        params: Params<'_>,
        mut dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let x =
            self.x.take().ok_or_else(|| Error::config("Conv2d backward", "no training forward to differentiate"))?;
        x.same_device("Conv2d backward", &dout)?;
        let (n, g) = self.geometry(x.shape())?;
        let o = self.filters;
        if dout.shape().dims() != [n, o, g.oh, g.ow] {
            return Err(Error::shape(
                "Conv2d backward",
                format!("dout {} for output ({n}, {o}, {}, {})", dout.shape(), g.oh, g.ow),
            ));
        }
        let how = unfold(&g, o);
        let weight = self.weight_for(params.get(0), &g, how);
        let kept = self.transformed.take();
        let transformed = (how == Unfold::Winograd)
            .then(|| kept.unwrap_or_else(|| winograd::transform_weights(params.get(0), g.c, o)));
        let job = Job { g, o, weight: &weight, unfold: how, winograd: transformed.as_ref() };
        let need_dx = input_grad == InputGrad::Needed;
        let (per_in, x_shape, device) = (job.per_in(), x.shape().clone(), x.device());
        // dx over x's own values where nothing else holds them (no new memory, none to
        // zero); else into fresh memory, x shared.
        let (mut dx, shared) = match if need_dx { x.into_unshared_vec() } else { Err(x) } {
            Ok(values) => (values, None),
            Err(x) => (vec![0.0f32; if need_dx { n * per_in } else { 0 }], Some(x)),
        };
        let groups = batch_groups(n);
        let xs: Vec<Samples<'_>> = match &shared {
            None => split_by_groups(&mut dx, n, per_in).into_iter().map(Samples::Overwritten).collect(),
            Some(x) => {
                let dxs = split_by_groups(&mut dx, n, if need_dx { per_in } else { 0 });
                let xs = groups.iter().map(|r| &x.host()[r.start * per_in..r.end * per_in]);
                xs.zip(dxs).map(|(x, dx)| Samples::Apart { x, dx: need_dx.then_some(dx) }).collect()
            }
        };
        let mut scratch = borrow_scratch(groups.len());
        let (ds, with_bias) = (dout.host(), self.use_bias);
        let work = groups.into_par_iter().zip(xs).zip(&mut scratch[..]);
        let partials: Vec<(Vec<f32>, Vec<f32>)> =
            par::map_collect(work, |((range, xs), scratch)| job.backward(range, xs, ds, with_bias, scratch));
        give_back(scratch);
        let (dws, dbs): (Vec<_>, Vec<_>) = partials.into_iter().unzip();
        match how {
            Unfold::Columns => add_partials(dparams.get(0), dws),
            Unfold::Winograd => {
                let dweight = winograd::weight_grad(&sum_partials(dws), g.c, o);
                dparams.get(0).iter_mut().zip(&dweight).for_each(|(d, v)| *d += v);
            }
            Unfold::Rows => {
                add_rows_dweight(dparams.get(0), &sum_partials(dws), &g, o);
            }
        }
        if with_bias {
            add_partials(dparams.get(1), dbs);
        }
        self.spare = dout.into_unshared_vec().ok();
        need_dx.then(|| Tensor::from_vec_on(dx, x_shape, device)).transpose()
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Conv2d { x: None, transformed: None, spare: None, ..self.clone() })
    }

    fn describe(&self) -> String {
        format!(
            "Conv2d({}, {}x{}, stride {}, {}{})",
            self.filters,
            self.kernel.0,
            self.kernel.1,
            self.stride,
            self.padding.describe(),
            if self.use_bias { "" } else { ", no bias" }
        )
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
            let job = Job { g, o, weight, unfold, winograd: None };
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
    fn a_forward_into_the_last_backwards_gradient_is_a_fresh_layers() {
        // The output gradient of a backward is kept as the next forward's output. Given one
        // of NaNs, a second forward must still equal a fresh layer's bit for bit, through
        // each unfolding: every output value is written, none read.
        use crate::tensor::Device;
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let cases = [(1, 4, 3, 1, Unfold::Columns), (8, 8, 3, 2, Unfold::Rows), (8, 8, 3, 1, Unfold::Winograd)];
        for (c, o, k, stride, how) in cases {
            let mut r = crate::rng::SplitMix64::new(3);
            let mut rand = |len: usize| (0..len).map(|_| r.next_f32() - 0.5).collect::<Vec<f32>>();
            let (n, h) = (3, 9);
            let conv = Conv2d::new(c, o, (k, k), stride, Padding::Same, true).unwrap();
            assert_eq!(unfold(&conv.geometry(&Shape::new([n, c, h, h])).unwrap().1, o), how);
            let sizes: Vec<usize> = conv.params().iter().map(|p| p.shape.numel()).collect();
            let ranges = vec![0..sizes[0], sizes[0]..sizes[0] + sizes[1]];
            let w = rand(sizes.iter().sum());
            let (x1, x2) = (rand(n * c * h * h), rand(n * c * h * h));
            let input = |x: &[f32]| Tensor::from_vec(x.to_vec(), [n, c, h, h]).unwrap();
            let forward = |layer: &mut Conv2d, x: &[f32]| {
                let no_buffers = ParamsMut::new(&mut [], &[]);
                layer.forward(input(x), Params::new(&w, &ranges), no_buffers, &ctx).unwrap()
            };
            let mut used = conv.clone();
            let y1 = forward(&mut used, &x1);
            let nans = Tensor::from_vec(vec![f32::NAN; y1.numel()], y1.shape().clone()).unwrap();
            let mut grads = vec![0.0; w.len()];
            let dparams = ParamsMut::new(&mut grads, &ranges);
            used.backward(nans, Params::new(&w, &ranges), dparams, InputGrad::Needed, &ctx).unwrap();
            assert_eq!(used.spare.as_ref().map(Vec::len), Some(y1.numel()), "C {c} stride {stride}: kept");
            let again = forward(&mut used, &x2).into_vec();
            let fresh = forward(&mut conv.clone(), &x2).into_vec();
            assert!(used.spare.is_none(), "C {c} stride {stride}: the kept gradient became the output");
            assert!(again.iter().zip(&fresh).all(|(a, b)| a.to_bits() == b.to_bits()), "C {c} stride {stride}");
        }
    }

    #[test]
    fn the_input_gradient_over_the_input_is_the_one_apart() {
        // A backward writes dx over the input it kept when nothing else holds the input,
        // else into memory of its own: the same bits, and a shared input left untouched.
        // 20 samples make two groups of samples; rows at C = 24 and 28×28 run in bands.
        use crate::tensor::Device;
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let cases =
            [(1, 4, 3, 1, 9, Unfold::Columns), (24, 8, 3, 2, 28, Unfold::Rows), (8, 8, 3, 1, 9, Unfold::Winograd)];
        for (c, o, k, stride, h, how) in cases {
            let mut r = crate::rng::SplitMix64::new(5);
            let mut rand = |len: usize| (0..len).map(|_| r.next_f32() - 0.5).collect::<Vec<f32>>();
            let n = 20;
            let conv = Conv2d::new(c, o, (k, k), stride, Padding::Same, false).unwrap();
            let (_, g) = conv.geometry(&Shape::new([n, c, h, h])).unwrap();
            assert_eq!(unfold(&g, o), how);
            assert!(batch_groups(n).len() > 1);
            assert!(how != Unfold::Rows || rows_tiling(&g).band < g.col_cols(), "{how:?}: in bands");
            let w = rand(o * c * k * k);
            let ranges = vec![0..w.len(); 1];
            let (x, dout) = (rand(n * c * h * h), rand(n * o * g.oh * g.ow));
            let run = |share: bool| {
                let mut layer = conv.clone();
                let x = Tensor::from_vec(x.clone(), [n, c, h, h]).unwrap();
                let held = share.then(|| x.clone());
                layer.forward(x, Params::new(&w, &ranges), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
                let d = Tensor::from_vec(dout.clone(), [n, o, g.oh, g.ow]).unwrap();
                let mut dw = vec![0.0; w.len()];
                let grads = ParamsMut::new(&mut dw, &ranges);
                let dx = layer.backward(d, Params::new(&w, &ranges), grads, InputGrad::Needed, &ctx).unwrap();
                (dx.unwrap().into_vec(), dw, held.map(Tensor::into_vec))
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            let ((dx_over, dw_over, _), (dx_apart, dw_apart, held)) = (run(false), run(true));
            assert_eq!(bits(&dx_over), bits(&dx_apart), "{how:?}: dx");
            assert_eq!(bits(&dw_over), bits(&dw_apart), "{how:?}: dweight");
            assert_eq!(held.as_deref(), Some(&x[..]), "{how:?}: the shared input was written");
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
