//! Conv2d: 2-D cross-correlation over NCHW, weight (O, C, KH, KW) as in PyTorch, with
//! Keras's `valid` and `same` padding.
//!
//! Each sample is transposed to channels-last and unfolded into one row per output
//! pixel (`im2row`: every kernel row is one contiguous copy of KW·C values), then
//! multiplied by the weight seen as (KH·KW·C, O); samples run in parallel on the
//! device's pool. The weight gradient sums over the
//! batch in the fixed groups of `backend::cpu::batch_groups`, so it is bitwise the same
//! whatever the thread count.

use rayon::prelude::*;

use super::{Ctx, Init, InputGrad, Layer, Mode, ParamSpec, Params, ParamsMut};
use crate::backend::cpu::{
    add_partials, batch_groups, chw_to_hwc, col2im, gemm_with, hwc_to_chw, im2col, im2row, row2im, split_by_groups,
    sum_partials, Accumulate, ConvGeom, Mat, Threads,
};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// How the input is padded.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Padding {
    /// No padding: OH = ⌊(H − KH)/s⌋ + 1.
    Valid,
    /// Keras "same": OH = ⌈H/s⌉, pad_total = max((OH − 1)·s + KH − H, 0), pad_top =
    /// ⌊pad_total/2⌋ and the rest at the bottom (asymmetric when pad_total is odd).
    Same,
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
    /// Work buffers, one per group of samples, kept from step to step.
    scratch: Vec<Scratch>,
}

/// One group's work buffers (contents are overwritten before every use).
#[derive(Clone, Debug, Default)]
struct Scratch {
    /// One sample, channels-last: (H, W, C).
    xt: Vec<f32>,
    /// The group's stacked rows: (G·OH·OW, KH·KW·C).
    rows: Vec<f32>,
    /// The group's output or output gradient, channels-last: (G·OH·OW, O).
    out: Vec<f32>,
}

impl Scratch {
    fn sized(&mut self, xt: usize, rows: usize, out: usize) -> (&mut [f32], &mut [f32], &mut [f32]) {
        self.xt.resize(xt, 0.0);
        self.rows.resize(rows, 0.0);
        self.out.resize(out, 0.0);
        (&mut self.xt, &mut self.rows, &mut self.out)
    }
}

/// Pads of one dimension: (before, after, output size), or None if the input is too small.
fn pads(size: usize, k: usize, s: usize, padding: Padding) -> Option<(usize, usize, usize)> {
    match padding {
        Padding::Valid => (size >= k).then(|| (0, 0, (size - k) / s + 1)),
        Padding::Same => {
            let out = size.div_ceil(s);
            let total = ((out - 1) * s + k).saturating_sub(size);
            Some((total / 2, total - total / 2, out))
        }
    }
}

/// How a convolution unfolds its input.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Unfold {
    /// Channels-first columns (C·KH·KW, OH·OW) per sample, one GEMM per sample: for a
    /// small C·KH·KW (the first layer of an image model), where stacking rows would make
    /// a GEMM with a tiny inner dimension.
    Columns,
    /// Channels-last rows (OH·OW, KH·KW·C), one GEMM per group of samples.
    Rows,
}

/// The unfolding for a geometry: a function of the layer's shape alone, so that the
/// arithmetic (and its rounding) never depends on the batch or the machine.
fn unfold(g: &ConvGeom) -> Unfold {
    if g.col_rows() <= 32 {
        Unfold::Columns
    } else {
        Unfold::Rows
    }
}

/// The weight from (O, C, KH·KW) to channels-last (KH·KW, C, O), i.e. a
/// (KH·KW·C, O) matrix whose row order matches [`im2row`].
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
        Ok(Conv2d { in_channels, filters, kernel, stride, padding, use_bias, x: None, scratch: Vec::new() })
    }

    /// Forward for [`Unfold::Columns`]: per sample, y_n (O, OH·OW) = W (O, C·KH·KW) ·
    /// im2col(x_n) (C·KH·KW, OH·OW), written straight into NCHW.
    fn forward_columns(&mut self, x: &Tensor, n: usize, g: &ConvGeom, params: &Params<'_>) -> Result<Tensor> {
        let (o, ckk, p) = (self.filters, g.col_rows(), g.col_cols());
        let (w, bias) = (params.get(0), self.use_bias.then(|| params.get(1)));
        let per_in = g.c * g.h * g.w;
        let mut y = vec![0.0f32; n * o * p];
        let groups = batch_groups(n);
        self.scratch.resize_with(groups.len().max(self.scratch.len()), Scratch::default);
        let xs = x.host();
        let work = groups.into_par_iter().zip(split_by_groups(&mut y, n, o * p)).zip(&mut self.scratch[..]);
        work.for_each(|((range, y_group), scratch)| {
            let (_, col, _) = scratch.sized(0, ckk * p, 0);
            for (s, yn) in range.zip(y_group.chunks_exact_mut(o * p)) {
                im2col(&xs[s * per_in..(s + 1) * per_in], g, col);
                let acc = match bias {
                    Some(b) => {
                        for (plane, &bo) in yn.chunks_exact_mut(p).zip(b) {
                            plane.fill(bo);
                        }
                        Accumulate::Add
                    }
                    None => Accumulate::Overwrite,
                };
                gemm_with(Mat::rows(w, o, ckk), Mat::rows(col, ckk, p), yn, p, acc, Threads::Caller);
            }
        });
        Tensor::from_vec_on(y, [n, o, g.oh, g.ow], x.device())
    }

    /// Backward for [`Unfold::Columns`]: per sample, dweight (O, C·KH·KW) += dout_n ·
    /// im2col(x_n)ᵀ and dcol = Wᵀ · dout_n folded back with col2im.
    #[allow(clippy::too_many_arguments)]
    fn backward_columns(
        &mut self,
        x: &Tensor,
        dout: &Tensor,
        n: usize,
        g: &ConvGeom,
        params: &Params<'_>,
        dparams: &mut ParamsMut<'_>,
        input_grad: InputGrad,
    ) -> Result<Option<Tensor>> {
        let (o, ckk, p) = (self.filters, g.col_rows(), g.col_cols());
        let per_in = g.c * g.h * g.w;
        let w = params.get(0);
        let (xs, ds) = (x.host(), dout.host());
        let (use_bias, need_dx) = (self.use_bias, input_grad == InputGrad::Needed);
        let mut dx = vec![0.0f32; if need_dx { n * per_in } else { 0 }];
        let groups = batch_groups(n);
        let dx_parts = split_by_groups(&mut dx, n, if need_dx { per_in } else { 0 });
        self.scratch.resize_with(groups.len().max(self.scratch.len()), Scratch::default);
        let partials: Vec<(Vec<f32>, Vec<f32>)> = groups
            .into_par_iter()
            .zip(dx_parts)
            .zip(&mut self.scratch[..])
            .map(|((range, dx_group), scratch)| {
                let (_, col, dcol) = scratch.sized(0, ckk * p, if need_dx { ckk * p } else { 0 });
                let mut dw = vec![0.0f32; o * ckk];
                let mut db = vec![0.0f32; if use_bias { o } else { 0 }];
                for (k, s) in range.enumerate() {
                    let dn = &ds[s * o * p..(s + 1) * o * p];
                    im2col(&xs[s * per_in..(s + 1) * per_in], g, col);
                    let dn_mat = Mat::rows(dn, o, p);
                    gemm_with(dn_mat, Mat::rows(col, ckk, p).t(), &mut dw, ckk, Accumulate::Add, Threads::Caller);
                    for (b, plane) in db.iter_mut().zip(dn.chunks_exact(p)) {
                        *b += plane.iter().sum::<f32>();
                    }
                    if need_dx {
                        gemm_with(Mat::rows(w, o, ckk).t(), dn_mat, dcol, p, Accumulate::Overwrite, Threads::Caller);
                        col2im(dcol, g, &mut dx_group[k * per_in..(k + 1) * per_in]);
                    }
                }
                (dw, db)
            })
            .collect();
        let (dws, dbs): (Vec<_>, Vec<_>) = partials.into_iter().unzip();
        add_partials(dparams.get(0), &dws);
        if use_bias {
            add_partials(dparams.get(1), &dbs);
        }
        if !need_dx {
            return Ok(None);
        }
        Ok(Some(Tensor::from_vec_on(dx, x.shape().clone(), x.device())?))
    }

    fn geometry(&self, input: &Shape) -> Result<(usize, ConvGeom)> {
        let (n, c, h, w) = input.nchw("Conv2d")?;
        if c != self.in_channels {
            return Err(Error::shape("Conv2d", format!("expected {} input channels, got {input}", self.in_channels)));
        }
        let (kh, kw) = self.kernel;
        let too_small =
            || Error::shape("Conv2d", format!("input {input} is smaller than the {kh}x{kw} kernel with valid padding"));
        let (pad_top, _, oh) = pads(h, kh, self.stride, self.padding).ok_or_else(too_small)?;
        let (pad_left, _, ow) = pads(w, kw, self.stride, self.padding).ok_or_else(too_small)?;
        Ok((n, ConvGeom { c, h, w, kh, kw, stride: self.stride, pad_top, pad_left, oh, ow }))
    }
}

impl Layer for Conv2d {
    fn kind(&self) -> &'static str {
        "conv"
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (n, g) = self.geometry(input)?;
        Ok(Shape::new([n, self.filters, g.oh, g.ow]))
    }

    fn params(&self) -> Vec<ParamSpec> {
        let (o, c, (kh, kw)) = (self.filters, self.in_channels, self.kernel);
        let mut p = vec![ParamSpec {
            name: "weight",
            shape: Shape::new([o, c, kh, kw]),
            init: Init::GlorotUniform { fan_in: c * kh * kw, fan_out: o * kh * kw },
        }];
        if self.use_bias {
            p.push(ParamSpec { name: "bias", shape: Shape::new([o]), init: Init::Zeros });
        }
        p
    }

    // x: (N, C, H, W) → y: (N, O, OH, OW). In groups of samples (`batch_groups`), each
    // sample transposed to channels-last (H, W, C) and unfolded into rows (OH·OW,
    // KH·KW·C); one GEMM per group multiplies the stacked rows (G·OH·OW, KH·KW·C) by the
    // weight seen as (KH·KW·C, O), and each sample's (OH·OW, O) block is transposed
    // back into NCHW.
    fn forward(&mut self, x: Tensor, params: Params<'_>, _buffers: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (n, g) = self.geometry(x.shape())?;
        if unfold(&g) == Unfold::Columns {
            let y = self.forward_columns(&x, n, &g, &params)?;
            self.x = (ctx.mode == Mode::Train).then_some(x);
            return Ok(y);
        }
        let (o, kkc, p) = (self.filters, g.col_rows(), g.col_cols());
        let wt = oihw_to_hwio(params.get(0), o, g.c, g.kh * g.kw);
        let bias = self.use_bias.then(|| params.get(1));
        let per_in = g.c * g.h * g.w;
        let mut y = vec![0.0f32; n * o * p];
        let groups = batch_groups(n);
        self.scratch.resize_with(groups.len().max(self.scratch.len()), Scratch::default);
        let xs = x.host();
        let work = groups.into_par_iter().zip(split_by_groups(&mut y, n, o * p)).zip(&mut self.scratch[..]);
        work.for_each(|((range, y_group), scratch)| {
            let gs = range.len();
            let (xt, rows, out) = scratch.sized(per_in, gs * p * kkc, gs * p * o);
            for (k, s) in range.enumerate() {
                chw_to_hwc(&xs[s * per_in..(s + 1) * per_in], g.c, xt);
                im2row(xt, &g, &mut rows[k * p * kkc..(k + 1) * p * kkc]);
            }
            gemm_with(
                Mat::rows(rows, gs * p, kkc),
                Mat::rows(&wt, kkc, o),
                out,
                o,
                Accumulate::Overwrite,
                Threads::Caller,
            );
            for (yn, on) in y_group.chunks_exact_mut(o * p).zip(out.chunks_exact(p * o)) {
                hwc_to_chw(on, o, yn);
                if let Some(b) = bias {
                    for (plane, &bo) in yn.chunks_exact_mut(p).zip(b) {
                        plane.iter_mut().for_each(|v| *v += bo);
                    }
                }
            }
        });
        let y = Tensor::from_vec_on(y, [n, o, g.oh, g.ow], x.device())?;
        self.x = (ctx.mode == Mode::Train).then_some(x);
        Ok(y)
    }

    // dout: (N, O, OH, OW) → dx: (N, C, H, W). Per group, with the stacked rows of
    // forward and doutᵀ stacked as (G·OH·OW, O): dweight (KH·KW·C, O) += rowsᵀ · doutᵀ;
    // drows = doutᵀ · weightᵀ, folded back per sample with row2im; dbias (O) += Σ dout.
    // Group partial sums are added in group order.
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
        let (o, kkc, p) = (self.filters, g.col_rows(), g.col_cols());
        if dout.shape().dims() != [n, o, g.oh, g.ow] {
            return Err(Error::shape(
                "Conv2d backward",
                format!("dout {} for output ({n}, {o}, {}, {})", dout.shape(), g.oh, g.ow),
            ));
        }
        let per_in = g.c * g.h * g.w;
        if unfold(&g) == Unfold::Columns {
            return self.backward_columns(&x, &dout, n, &g, &params, &mut dparams, input_grad);
        }
        let wt = oihw_to_hwio(params.get(0), o, g.c, g.kh * g.kw);
        let (xs, ds) = (x.host(), dout.host());
        let (use_bias, need_dx) = (self.use_bias, input_grad == InputGrad::Needed);
        let mut dx = vec![0.0f32; if need_dx { n * per_in } else { 0 }];
        let groups = batch_groups(n);
        let dx_parts = split_by_groups(&mut dx, n, if need_dx { per_in } else { 0 });
        self.scratch.resize_with(groups.len().max(self.scratch.len()), Scratch::default);
        let partials: Vec<(Vec<f32>, Vec<f32>)> = groups
            .into_par_iter()
            .zip(dx_parts)
            .zip(&mut self.scratch[..])
            .map(|((range, dx_group), scratch)| {
                let gs = range.len();
                let (xt, rows, dout_t) = scratch.sized(per_in, gs * p * kkc, gs * p * o);
                let mut db = vec![0.0f32; if use_bias { o } else { 0 }];
                for (k, s) in range.enumerate() {
                    let dn = &ds[s * o * p..(s + 1) * o * p];
                    chw_to_hwc(&xs[s * per_in..(s + 1) * per_in], g.c, xt);
                    im2row(xt, &g, &mut rows[k * p * kkc..(k + 1) * p * kkc]);
                    chw_to_hwc(dn, o, &mut dout_t[k * p * o..(k + 1) * p * o]);
                    for (b, plane) in db.iter_mut().zip(dn.chunks_exact(p)) {
                        *b += plane.iter().sum::<f32>();
                    }
                }
                let mut dwt = vec![0.0f32; kkc * o];
                let dout_mat = Mat::rows(dout_t, gs * p, o);
                gemm_with(
                    Mat::rows(rows, gs * p, kkc).t(),
                    dout_mat,
                    &mut dwt,
                    o,
                    Accumulate::Overwrite,
                    Threads::Caller,
                );
                if need_dx {
                    // rows is no longer needed: reuse it for drows.
                    gemm_with(dout_mat, Mat::rows(&wt, kkc, o).t(), rows, kkc, Accumulate::Overwrite, Threads::Caller);
                    for (k, dxn) in dx_group.chunks_exact_mut(per_in).enumerate() {
                        xt.fill(0.0);
                        row2im(&rows[k * p * kkc..(k + 1) * p * kkc], &g, xt);
                        hwc_to_chw(xt, g.c, dxn);
                    }
                }
                (dwt, db)
            })
            .collect();
        let (dwts, dbs): (Vec<_>, Vec<_>) = partials.into_iter().unzip();
        let dwt = sum_partials(&dwts);
        let dweight = dparams.get(0);
        for (r, row) in dwt.chunks_exact(o).enumerate() {
            // row r = (i·KW + j)·C + c of the channels-last weight; dweight is (O, C, KH·KW).
            let (kk, c) = (r / g.c, r % g.c);
            for (oo, &v) in row.iter().enumerate() {
                dweight[(oo * g.c + c) * g.kh * g.kw + kk] += v;
            }
        }
        if use_bias {
            add_partials(dparams.get(1), &dbs);
        }
        if !need_dx {
            return Ok(None);
        }
        Ok(Some(Tensor::from_vec_on(dx, x.shape().clone(), x.device())?))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Conv2d { x: None, scratch: Vec::new(), ..self.clone() })
    }

    fn describe(&self) -> String {
        format!(
            "Conv2d({}, {}x{}, stride {}, {}{})",
            self.filters,
            self.kernel.0,
            self.kernel.1,
            self.stride,
            match self.padding {
                Padding::Valid => "valid",
                Padding::Same => "same",
            },
            if self.use_bias { "" } else { ", no bias" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keras_same_padding_is_asymmetric_when_the_total_is_odd() {
        // H = 12, k = 6, s = 2: OH = 6, pad_total = (6-1)*2 + 6 - 12 = 4 → 2 / 2 (the
        // reference convnet's conv2, symmetric).
        assert_eq!(pads(12, 6, 2, Padding::Same), Some((2, 2, 6)));
        // H = 28, k = 3, s = 1: pad_total = 27 + 3 - 28 = 2 → 1 / 1.
        assert_eq!(pads(28, 3, 1, Padding::Same), Some((1, 1, 28)));
        // H = 5, k = 4, s = 1: pad_total = 4 + 4 - 5 = 3 → 1 on top, 2 at the bottom.
        assert_eq!(pads(5, 4, 1, Padding::Same), Some((1, 2, 5)));
        // H = 7, k = 3, s = 2: OH = 4, pad_total = 6 + 3 - 7 = 2 → 1 / 1.
        assert_eq!(pads(7, 3, 2, Padding::Same), Some((1, 1, 4)));
        // H = 6, k = 3, s = 2: OH = 3, pad_total = 4 + 3 - 6 = 1 → 0 on top, 1 at the bottom.
        assert_eq!(pads(6, 3, 2, Padding::Same), Some((0, 1, 3)));
        assert_eq!(pads(2, 3, 1, Padding::Valid), None);
        assert_eq!(pads(28, 6, 2, Padding::Valid), Some((0, 0, 12)));
    }
}
