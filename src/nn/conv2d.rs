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
    add_partials, batch_groups, chw_to_hwc, gemm_strided, hwc_to_chw, im2row, row2im, sum_partials, Accumulate, ConvGeom, Mat,
    Threads,
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
        Ok(Conv2d { in_channels, filters, kernel, stride, padding, use_bias, x: None })
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

    // x: (N, C, H, W) → y: (N, O, OH, OW). Per sample, channels-last: the input is
    // transposed to (H, W, C), unfolded into rows (OH·OW, KH·KW·C) and multiplied by the
    // weight as (KH·KW·C, O); the product is written transposed, straight into NCHW.
    fn forward(&mut self, x: Tensor, params: Params<'_>, _buffers: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (n, g) = self.geometry(x.shape())?;
        let (o, kkc, p) = (self.filters, g.col_rows(), g.col_cols());
        let wt = oihw_to_hwio(params.get(0), o, g.c, g.kh * g.kw);
        let bias = self.use_bias.then(|| params.get(1));
        let mut y = vec![0.0f32; n * o * p];
        let per_in = g.c * g.h * g.w;
        y.par_chunks_mut(o * p).zip(x.host().par_chunks(per_in)).for_each_init(
            || (vec![0.0f32; per_in], vec![0.0f32; p * kkc]),
            |(xt, rows), (yn, xn)| {
                chw_to_hwc(xn, g.c, xt);
                im2row(xt, &g, rows);
                let acc = match bias {
                    Some(b) => {
                        for (plane, &bo) in yn.chunks_exact_mut(p).zip(b) {
                            plane.fill(bo);
                        }
                        Accumulate::Add
                    }
                    None => Accumulate::Overwrite,
                };
                gemm_strided(Mat::rows(rows, p, kkc), Mat::rows(&wt, kkc, o), yn, (1, p), acc, Threads::Caller);
            },
        );
        let y = Tensor::from_vec_on(y, [n, o, g.oh, g.ow], x.device())?;
        self.x = (ctx.mode == Mode::Train).then_some(x);
        Ok(y)
    }

    // dout: (N, O, OH, OW) → dx: (N, C, H, W). Per sample, with rows as in forward:
    // dweight (KH·KW·C, O) += rowsᵀ · doutᵀ; drows (OH·OW, KH·KW·C) = doutᵀ · weightᵀ,
    // folded back with row2im; dbias (O) += Σ_p dout[o, p].
    fn backward(
        &mut self,
        dout: Tensor,
        params: Params<'_>,
        mut dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let x = self.x.take().ok_or_else(|| Error::config("Conv2d backward", "no training forward to differentiate"))?;
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
        let wt = oihw_to_hwio(params.get(0), o, g.c, g.kh * g.kw);
        let (xs, ds) = (x.host(), dout.host());
        let (use_bias, need_dx) = (self.use_bias, input_grad == InputGrad::Needed);
        let mut dx = vec![0.0f32; if need_dx { n * per_in } else { 0 }];
        // Each group of samples gets its own slice of dx and its own partial sums.
        let groups = batch_groups(n);
        let mut dx_parts = Vec::with_capacity(groups.len());
        let mut rest = dx.as_mut_slice();
        for r in &groups {
            let (head, tail) = rest.split_at_mut(if need_dx { r.len() * per_in } else { 0 });
            dx_parts.push(head);
            rest = tail;
        }
        let partials: Vec<(Vec<f32>, Vec<f32>)> = groups
            .into_par_iter()
            .zip(dx_parts)
            .map(|(range, dx_group)| {
                let mut dwt = vec![0.0f32; kkc * o];
                let mut db = vec![0.0f32; if use_bias { o } else { 0 }];
                let (mut xt, mut rows) = (vec![0.0f32; per_in], vec![0.0f32; p * kkc]);
                let mut drows = vec![0.0f32; if need_dx { p * kkc } else { 0 }];
                for (k, s) in range.enumerate() {
                    let dn = &ds[s * o * p..(s + 1) * o * p];
                    let dn_t = Mat { data: dn, rows: p, cols: o, rs: 1, cs: p };
                    chw_to_hwc(&xs[s * per_in..(s + 1) * per_in], g.c, &mut xt);
                    im2row(&xt, &g, &mut rows);
                    gemm_strided(Mat::rows(&rows, p, kkc).t(), dn_t, &mut dwt, (o, 1), Accumulate::Add, Threads::Caller);
                    for (b, plane) in db.iter_mut().zip(dn.chunks_exact(p)) {
                        *b += plane.iter().sum::<f32>();
                    }
                    if need_dx {
                        let wt_t = Mat::rows(&wt, kkc, o).t();
                        gemm_strided(dn_t, wt_t, &mut drows, (kkc, 1), Accumulate::Overwrite, Threads::Caller);
                        xt.fill(0.0);
                        row2im(&drows, &g, &mut xt);
                        hwc_to_chw(&xt, g.c, &mut dx_group[k * per_in..(k + 1) * per_in]);
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
        Box::new(Conv2d { x: None, ..self.clone() })
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
