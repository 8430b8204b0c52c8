//! LayerNorm over the last dimension, PyTorch's `nn.LayerNorm(C, eps=1e-5,
//! elementwise_affine=True, bias=True)` (nanoGPT's `LayerNorm(ndim, bias)` when the bias is
//! off): its forward and backward, its spec entry (`layer_norm`), its spec form, what it
//! keeps for backward and, at the end of the file, its GPU form (kernels/layernorm.cu).
//!
//! The input is (N, ..., C), in the GPT (N, T, C): every run of C values along the last
//! dimension is a ROW, normalised by its own mean and BIASED variance (PyTorch's), then
//! scaled by `weight` (C) and shifted by `bias` (C):
//!   y = (x − mean)·rstd·w + b,   rstd = 1/√(var + eps).
//! Rows are independent, so no statistic crosses samples or replicas (unlike BatchNorm),
//! and nothing here knows of logical replicas. Only the parameter gradients are summed
//! over rows.
//!
//! # Numerics: the reference
//! Every sum is in f64, in an order fixed by C alone (or by the row count alone), never by
//! the threads:
//! - a row's sums (Σ x, Σ (x − mean)², and backward's Σ g, Σ g·x̂) take [`LANES`] = 32
//!   lanes: lane j adds the elements i ≡ j (mod 32) in increasing i, from 0.0; then the
//!   lanes meet in a fixed tree (lane t += lane t + s for s = 16, 8, 4, 2, 1): one warp of
//!   the kernel a row, its lanes reduced as kernels/batchnorm.cu's `block_sum` reduces a
//!   block;
//! - forward: mean = Σx / C and var = Σ(x − mean)² / C (two passes, so no cancellation),
//!   rstd = 1/√(var + eps) in f64; x̂ = (x − mean)·rstd in f64, kept rounded to f32 for the
//!   backward, and y = x̂·w + b in f64 from that f64 x̂, rounded once;
//! - backward, with g = dy·w (exact in f64, a product of two f32):
//!   dx = rstd·((g − Σg/C) − x̂·(Σg·x̂/C)), in f64, rounded once;
//! - dw += Σ_rows dy·x̂ and db += Σ_rows dy (the products exact in f64): rows are taken in
//!   chunks of [`ROW_CHUNK`] (64), each chunk's column sums are taken row by row from 0.0,
//!   then the chunks' sums are added in chunk order, starting from the first's, and the
//!   total is rounded to f32 and added to the gradient. The chunks are what the CPU's
//!   threads and the GPU's threads share out; their size is a constant, so the order is a
//!   function of the row count alone.
//!
//! The kernels compute the same expressions in the same order, in double, without
//! contraction (`__dmul_rn`, `__dadd_rn`, ...; IEEE division and square root), so on the
//! host they equal this file bit for bit (tests/kernels_host.rs), and on a GPU they would
//! too: nothing here depends on a library function. f64 costs little: the 32 lanes are 4
//! AVX-512 registers or 8 AVX2 ones (the row functions are compiled for both, by
//! `backend::simd::widest!`), and the GPT's 768 rows of 128 take some 0.1 ms forward and 0.1 ms backward on one core
//! (`time_forward_and_backward_at_768_rows_of_128`, below, run by hand).

#[cfg(feature = "cuda")]
pub mod gpu;

use rayon::prelude::*;
use serde_json::{json, Value};

use super::spec::{Build, FieldResult, LayerType};
use super::{Ctx, Init, InputGrad, Layer, LayerMemory, LayerShapes, Mode, ParamSpec, Params, ParamsMut, F32};
use crate::backend::par;
use crate::backend::simd::widest;
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// Lanes of a row's sums: one warp of kernels/layernorm.cu (`LN_LANES` there).
pub const LANES: usize = 32;

/// Rows per chunk of the parameter gradients' sums, and per parallel task (module docs):
/// 64 rows of 128 values are some 10 µs of work, which amortises a task, and a GPT shard
/// of 768 rows is 12 of them.
pub const ROW_CHUNK: usize = 64;

/// Bytes of an f64, for the memory account (the kept rstd).
const F64: u64 = 8;

/// The sum of 32 lane sums, by the fixed tree (module docs).
#[inline(always)]
fn lane_tree(mut acc: [f64; LANES]) -> f64 {
    let mut s = LANES / 2;
    while s > 0 {
        for t in 0..s {
            acc[t] += acc[t + s];
        }
        s /= 2;
    }
    acc[0]
}

/// Σ f(v) over a row in the lanes' order (module docs).
#[inline(always)]
fn lane_sum(row: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    let mut acc = [0.0f64; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            *a += f(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a += f(v);
    }
    lane_tree(acc)
}

/// (Σ g, Σ g·x̂) over a row, g = dy·w, in the lanes' order (module docs).
#[inline(always)]
fn grad_sums(dy: &[f32], w: &[f32], xhat: &[f32]) -> (f64, f64) {
    let (mut sg, mut sgx) = ([0.0f64; LANES], [0.0f64; LANES]);
    let c = dy.len();
    let full = c - c % LANES;
    let mut at = 0;
    while at < full {
        let (d, w, xh) = (&dy[at..at + LANES], &w[at..at + LANES], &xhat[at..at + LANES]);
        for j in 0..LANES {
            let g = d[j] as f64 * w[j] as f64;
            sg[j] += g;
            sgx[j] += g * xh[j] as f64;
        }
        at += LANES;
    }
    for j in 0..c - full {
        let g = dy[full + j] as f64 * w[full + j] as f64;
        sg[j] += g;
        sgx[j] += g * xhat[full + j] as f64;
    }
    (lane_tree(sg), lane_tree(sgx))
}

/// (mean, rstd) of one row of f32 values, in f64 (module docs).
#[inline(always)]
pub fn row_stats(x: &[f32], eps: f32) -> (f64, f64) {
    let c = x.len() as f64;
    let mean = lane_sum(x, |v| v as f64) / c;
    let var = lane_sum(x, |v| {
        let d = v as f64 - mean;
        d * d
    }) / c;
    (mean, 1.0 / (var + eps as f64).sqrt())
}

/// The weight (C) and the bias (C, or none) of a pass.
#[derive(Clone, Copy)]
struct Affine<'a> {
    w: &'a [f32],
    b: Option<&'a [f32]>,
}

/// What a training forward keeps of a chunk of rows: x̂ (rows, C) and rstd (rows).
type Kept<'a> = Option<(&'a mut [f32], &'a mut [f64])>;

/// A chunk of rows' forward, x: (rows, C) → y in place; in training x̂ and rstd kept.
#[inline(always)]
fn forward_rows_any(xs: &mut [f32], kept: Kept<'_>, a: Affine<'_>, eps: f32) {
    let c = a.w.len();
    let (mut xhat, mut rstd) = match kept {
        Some((xh, rs)) => (Some(xh.chunks_exact_mut(c)), Some(rs.iter_mut())),
        None => (None, None),
    };
    for xs in xs.chunks_exact_mut(c) {
        let (mean, rs) = row_stats(xs, eps);
        let normalised = |v: f32| (v as f64 - mean) * rs;
        match (xhat.as_mut().and_then(|x| x.next()), a.b) {
            (Some(xh), Some(b)) => {
                for (((v, h), &w), &b) in xs.iter_mut().zip(xh).zip(a.w).zip(b) {
                    let n = normalised(*v);
                    *h = n as f32;
                    *v = (n * w as f64 + b as f64) as f32;
                }
            }
            (Some(xh), None) => {
                for ((v, h), &w) in xs.iter_mut().zip(xh).zip(a.w) {
                    let n = normalised(*v);
                    *h = n as f32;
                    *v = (n * w as f64) as f32;
                }
            }
            (None, Some(b)) => {
                for ((v, &w), &b) in xs.iter_mut().zip(a.w).zip(b) {
                    *v = (normalised(*v) * w as f64 + b as f64) as f32;
                }
            }
            (None, None) => {
                for (v, &w) in xs.iter_mut().zip(a.w) {
                    *v = (normalised(*v) * w as f64) as f32;
                }
            }
        }
        if let Some(r) = rstd.as_mut().and_then(|r| r.next()) {
            *r = rs;
        }
    }
}

/// A chunk of rows' backward from the forward's x̂ (rows, C) and rstd (rows): `part`
/// (2, C) takes the chunk's column sums (Σ dy·x̂, then Σ dy) from 0.0, row by row, and
/// dy: (rows, C) becomes dx in place when `input_grad` asks for it.
#[inline(always)]
fn backward_rows_any(ds: &mut [f32], xhat: &[f32], rstd: &[f64], w: &[f32], part: &mut [f64], input_grad: InputGrad) {
    let c = w.len();
    let (pw, pb) = part.split_at_mut(c);
    pw.fill(0.0);
    pb.fill(0.0);
    for ((d, xh), &rs) in ds.chunks_exact_mut(c).zip(xhat.chunks_exact(c)).zip(rstd) {
        for (((pw, pb), &d), &xh) in pw.iter_mut().zip(pb.iter_mut()).zip(d.iter()).zip(xh) {
            *pw += d as f64 * xh as f64;
            *pb += d as f64;
        }
        if input_grad == InputGrad::Needed {
            let (sg, sgx) = grad_sums(d, w, xh);
            let (mg, mgx) = (sg / c as f64, sgx / c as f64);
            for ((d, &xh), &w) in d.iter_mut().zip(xh).zip(w) {
                let g = *d as f64 * w as f64;
                *d = (rs * ((g - mg) - xh as f64 * mgx)) as f32;
            }
        }
    }
}

widest! {
    /// [`forward_rows_any`] at the processor's widest vectors (`backend::simd`: 8 f64 a
    /// vector with AVX-512, 4 with AVX2, 2 without; the same bits at every width).
    fn forward_rows(xs: &mut [f32], kept: Kept<'_>, a: Affine<'_>, eps: f32) {
        forward_rows_any(xs, kept, a, eps)
    }
}

widest! {
    /// [`backward_rows_any`] at the processor's widest vectors.
    fn backward_rows(ds: &mut [f32], xhat: &[f32], rstd: &[f64], w: &[f32], part: &mut [f64], input_grad: InputGrad) {
        backward_rows_any(ds, xhat, rstd, w, part, input_grad)
    }
}

/// Normalisation over the last dimension, with a learned scale and (optionally) shift.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    /// C: the width of the last dimension.
    width: usize,
    eps: f32,
    use_bias: bool,
    /// x̂: (N, ..., C) as f32 and rstd: (rows) as f64, from the training forward; the
    /// vectors keep their capacity from step to step.
    xhat: Vec<f32>,
    rstd: Vec<f64>,
    /// Each chunk of rows' column sums (Σ dy·x̂ then Σ dy, C each), reused by each backward.
    partials: Vec<f64>,
    cached: Option<Shape>,
}

impl LayerNorm {
    /// PyTorch's `nn.LayerNorm(width)`: eps 1e-5, weight and bias.
    pub fn new(width: usize) -> LayerNorm {
        LayerNorm {
            width,
            eps: 1e-5,
            use_bias: true,
            xhat: Vec::new(),
            rstd: Vec::new(),
            partials: Vec::new(),
            cached: None,
        }
    }

    /// Sets eps (added to the variance).
    pub fn eps(mut self, eps: f32) -> Self {
        self.eps = eps;
        self
    }

    /// The same layer without a bias (PyTorch's `bias=False`, nanoGPT's `bias=False`).
    pub fn without_bias(mut self) -> Self {
        self.use_bias = false;
        self
    }

    /// The width C of the last dimension it normalises.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The spec entry: PyTorch's `nn.LayerNorm(C, eps=1e-5, bias=True)` over the last
    /// dimension, C that of the running shape.
    pub const SPEC: LayerType = LayerType {
        name: "layer_norm",
        fields: "`eps` (1e-5), `use_bias` (true)",
        example: (&[2, 3, 6], r#"{"type": "layer_norm", "eps": 0.001, "use_bias": true}"#),
        parse: |f| {
            let eps = f.number("eps", Some(1e-5), (|x| x > 0.0, "a positive number"))?;
            let use_bias = f.boolean("use_bias", true)?;
            Ok(Build::layer(move |input| {
                let ln = LayerNorm::new(expect_last_dim(input)?).eps(eps);
                Ok(if use_bias { ln } else { ln.without_bias() })
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

    /// The rows of an input of shape `shape` (batch included), or why it is not one.
    fn rows(&self, shape: &Shape, op: &'static str) -> Result<usize> {
        match shape.dims() {
            [_, .., c] if *c == self.width => Ok(shape.numel() / self.width.max(1)),
            [_, .., c] => Err(Error::shape(
                op,
                format!("normalises a last dimension of {}, got {shape} (last dimension {c})", self.width),
            )),
            _ => Err(Error::shape(op, format!("expects (N, ..., {}), got {shape}", self.width))),
        }
    }
}

/// The width of the last dimension of the running shape (N, ..., C), or the spec's words
/// for an input without one.
fn expect_last_dim(input: &Shape) -> FieldResult<usize> {
    match input.dims() {
        [_, .., c] => Ok(*c),
        _ => Err(format!("expects samples with a last dimension to normalise, got {input}")),
    }
}

impl Layer for LayerNorm {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "ln"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "layer_norm", "eps": self.eps, "use_bias": self.use_bias}))
    }

    /// Its normalised input x̂ as f32, and each row's rstd as f64.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let values = shapes.input.numel() as u64;
        let rows = values / self.width.max(1) as u64;
        Some(LayerMemory {
            kept_per_sample: values.saturating_mul(F32).saturating_add(rows * F64),
            ..LayerMemory::NONE
        })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        self.rows(input, "LayerNorm")?;
        Ok(input.clone())
    }

    fn params(&self) -> Vec<ParamSpec> {
        let shape = Shape::new([self.width]);
        let mut p = vec![ParamSpec { name: "weight".into(), shape: shape.clone(), init: Init::Ones }];
        if self.use_bias {
            p.push(ParamSpec { name: "bias".into(), shape, init: Init::Zeros });
        }
        p
    }

    // x: (N, ..., C) → y: (N, ..., C); training keeps x̂ (N, ..., C) and rstd (rows)
    fn forward(&mut self, mut x: Tensor, params: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let rows = self.rows(x.shape(), "LayerNorm")?;
        let (c, eps) = (self.width, self.eps);
        let affine = Affine { w: params.get(0), b: self.use_bias.then(|| params.get(1)) };
        // (A width of 0 has no rows: the spans only keep rayon's chunks non-empty.)
        let span = (ROW_CHUNK * c).max(1);
        if ctx.mode == Mode::Train {
            self.xhat.resize(rows * c, 0.0);
            self.rstd.resize(rows, 0.0);
            let chunks = x.host_mut().par_chunks_mut(span).zip(self.xhat.par_chunks_mut(span));
            par::for_each(chunks.zip(self.rstd.par_chunks_mut(ROW_CHUNK)), |((xs, xh), rs)| {
                forward_rows(xs, Some((xh, rs)), affine, eps);
            });
            self.cached = Some(x.shape().clone());
        } else {
            par::for_each(x.host_mut().par_chunks_mut(span), |xs| forward_rows(xs, None, affine, eps));
        }
        Ok(x)
    }

    // dout: (N, ..., C) → dx = rstd·((g − mean(g)) − x̂·mean(g·x̂)), g = dout·w, per row;
    // dweight += Σ_rows dout·x̂, dbias += Σ_rows dout (C)
    fn backward(
        &mut self,
        mut dout: Tensor,
        params: Params<'_>,
        mut dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let shape = self
            .cached
            .take()
            .ok_or_else(|| Error::config("LayerNorm backward", "no training forward to differentiate"))?;
        if dout.shape() != &shape {
            return Err(Error::shape("LayerNorm backward", format!("dout {} for input {shape}", dout.shape())));
        }
        let c = self.width;
        let w = params.get(0);
        let chunks = self.rstd.len().div_ceil(ROW_CHUNK);
        self.partials.resize(chunks * 2 * c, 0.0);
        let span = (ROW_CHUNK * c).max(1);
        let parts = dout.host_mut().par_chunks_mut(span).zip(self.xhat.par_chunks(span));
        let parts = parts.zip(self.rstd.par_chunks(ROW_CHUNK)).zip(self.partials.par_chunks_mut((2 * c).max(1)));
        par::for_each(parts, |(((ds, xh), rs), part)| backward_rows(ds, xh, rs, w, part, input_grad));
        // The chunks' sums, in chunk order, into the first chunk's.
        if c > 0 && !self.partials.is_empty() {
            let (first, rest) = self.partials.split_at_mut(2 * c);
            for later in rest.chunks_exact(2 * c) {
                for (a, &b) in first.iter_mut().zip(later) {
                    *a += b;
                }
            }
            let (sw, sb) = first.split_at(c);
            for (g, &s) in dparams.get(0).iter_mut().zip(sw) {
                *g += s as f32;
            }
            if self.use_bias {
                for (g, &s) in dparams.get(1).iter_mut().zip(sb) {
                    *g += s as f32;
                }
            }
        }
        Ok((input_grad == InputGrad::Needed).then_some(dout))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        let ln = LayerNorm::new(self.width).eps(self.eps);
        Box::new(if self.use_bias { ln } else { ln.without_bias() })
    }

    fn describe(&self) -> String {
        format!("LayerNorm({}, eps {}{})", self.width, self.eps, if self.use_bias { "" } else { ", no bias" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::nn::Sequential;
    use crate::rng::SplitMix64;
    use crate::tensor::Device;

    fn uniform(rng: &mut SplitMix64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| lo + (hi - lo) * rng.next_f32()).collect()
    }

    /// The layer alone in a model of per-sample shape `dims[1..]`, with `w`, `b` as its
    /// parameters: (y, dx, dweight, dbias) of a training pass with upstream gradient `dy`,
    /// the parameter gradients accumulated onto `g0`.
    fn run(ln: LayerNorm, dims: &[usize], x: &[f32], wb: (&[f32], &[f32]), dy: &[f32], g0: f32) -> [Vec<f32>; 4] {
        let use_bias = ln.use_bias;
        let mut m = Sequential::new(&dims[1..], vec![Box::new(ln)]).unwrap();
        let infos = m.param_infos().to_vec();
        let mut params = vec![0.0; m.params_len()];
        params[infos[0].range.clone()].copy_from_slice(wb.0);
        if use_bias {
            params[infos[1].range.clone()].copy_from_slice(wb.1);
        }
        let mut grads = vec![g0; m.params_len()];
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let y = m.forward(Tensor::from_vec(x.to_vec(), dims).unwrap(), &params, &mut [], &ctx).unwrap();
        let dx = m.backward_input(Tensor::from_vec(dy.to_vec(), dims).unwrap(), &params, &mut grads, &ctx).unwrap();
        let db = if use_bias { grads[infos[1].range.clone()].to_vec() } else { Vec::new() };
        [y.into_vec(), dx.into_vec(), grads[infos[0].range.clone()].to_vec(), db]
    }

    /// PyTorch's LayerNorm written plainly in f64 (the textbook formula, no lanes): the
    /// function whose finite differences check the layer's gradients.
    fn reference(x: &[f64], w: &[f64], b: &[f64], c: usize, eps: f64) -> Vec<f64> {
        let mut y = Vec::with_capacity(x.len());
        for row in x.chunks_exact(c) {
            let mean = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / c as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            y.extend(row.iter().enumerate().map(|(i, v)| (v - mean) * rstd * w[i] + b[i]));
        }
        y
    }

    #[test]
    fn forward_and_gradients_match_finite_differences_of_the_f64_formula() {
        // (N, T, C) = (2, 3, 5): rows of 5 (below one lane round) and (1, 2, 37): a row
        // longer than the 32 lanes, so the tail lanes are exercised too.
        for (dims, seed) in [([2usize, 3, 5], 1u64), ([1, 2, 37], 2)] {
            let c = dims[2];
            let n = dims.iter().product::<usize>();
            let mut rng = SplitMix64::new(seed);
            let x = uniform(&mut rng, n, -2.0, 3.0);
            let w = uniform(&mut rng, c, 0.5, 1.5);
            let b = uniform(&mut rng, c, -0.5, 0.5);
            let dy = uniform(&mut rng, n, -1.0, 1.0);
            let eps = 1e-5;
            let [y, dx, dw, db] = run(LayerNorm::new(c), &dims, &x, (&w, &b), &dy, 0.25);
            let f64s = |v: &[f32]| v.iter().map(|&v| v as f64).collect::<Vec<f64>>();
            let (x64, w64, b64, dy64) = (f64s(&x), f64s(&w), f64s(&b), f64s(&dy));
            // The forward: within a few f32 ulps of the f64 formula (one rounding at the end).
            for (i, (&got, want)) in y.iter().zip(reference(&x64, &w64, &b64, c, eps)).enumerate() {
                assert!((got as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()), "y[{i}]: {got} vs {want}");
            }
            // The loss L = Σ dy·y; central differences of the f64 formula, h = 1e-5: their
            // truncation error is O(h²·|f'''|) ≈ 1e-10 and their rounding 1e-16/h ≈ 1e-11,
            // so a gradient within 2e-6·(1 + |g|) is the formula's gradient to f32 accuracy
            // (the layer rounds each value to f32 once: 6e-8 relative, plus the sums').
            let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
                reference(x, w, b, c, eps).iter().zip(&dy64).map(|(y, d)| y * d).sum()
            };
            let h = 1e-5;
            let numeric = |which: usize, i: usize| {
                let mut args = [x64.clone(), w64.clone(), b64.clone()];
                args[which][i] += h;
                let up = loss(&args[0], &args[1], &args[2]);
                args[which][i] -= 2.0 * h;
                let down = loss(&args[0], &args[1], &args[2]);
                (up - down) / (2.0 * h)
            };
            let check = |what: &str, which: usize, got: &[f32], offset: f32| {
                for (i, &g) in got.iter().enumerate() {
                    let (g, want) = ((g - offset) as f64, numeric(which, i));
                    assert!((g - want).abs() <= 2e-6 * (1.0 + want.abs()), "{what}[{i}] of {dims:?}: {g} vs {want}");
                }
            };
            check("dx", 0, &dx, 0.0);
            // The parameter gradients were accumulated onto 0.25 (the gradient contract).
            check("dweight", 1, &dw, 0.25);
            check("dbias", 2, &db, 0.25);
        }
    }

    #[test]
    fn without_bias_it_is_the_layer_with_a_zero_bias_and_has_one_tensor() {
        let dims = [3usize, 4, 8];
        let n = 96;
        let mut rng = SplitMix64::new(3);
        let (x, w, dy) =
            (uniform(&mut rng, n, -1.0, 1.0), uniform(&mut rng, 8, 0.5, 1.5), uniform(&mut rng, n, -1.0, 1.0));
        let with = run(LayerNorm::new(8), &dims, &x, (&w, &[0.0; 8]), &dy, 0.0);
        let without = run(LayerNorm::new(8).without_bias(), &dims, &x, (&w, &[]), &dy, 0.0);
        // x̂·w + 0 and x̂·w differ only in the sign of a zero.
        for k in 0..3 {
            assert_eq!(with[k], without[k], "output {k}");
        }
        assert!(without[3].is_empty());
        let names: Vec<_> = LayerNorm::new(8).without_bias().params().iter().map(|p| p.name.to_string()).collect();
        assert_eq!(names, ["weight"]);
    }

    #[test]
    fn results_are_bitwise_independent_of_the_thread_count() {
        // 150 rows of 40: three chunks (64, 64, 22) and a lane tail of 8.
        let dims = [5usize, 30, 40];
        let n = dims.iter().product::<usize>();
        let mut rng = SplitMix64::new(4);
        let (x, dy) = (uniform(&mut rng, n, -3.0, 3.0), uniform(&mut rng, n, -1.0, 1.0));
        let (w, b) = (uniform(&mut rng, 40, 0.5, 1.5), uniform(&mut rng, 40, -0.5, 0.5));
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| run(LayerNorm::new(40), &dims, &x, (&w, &b), &dy, 0.0))
        };
        let one = on(1);
        for threads in [2, 3] {
            let many = on(threads);
            for k in 0..4 {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&one[k]), bits(&many[k]), "output {k} on {threads} threads");
            }
        }
    }

    #[test]
    fn a_row_of_equal_values_normalises_to_zero_and_passes_no_gradient() {
        // var = 0: rstd = 1/√eps, x̂ = 0, y = b; dx = rstd·(g − mean(g)), dweight += 0.
        let [y, dx, dw, db] = run(LayerNorm::new(4), &[1, 4], &[2.5; 4], (&[1.0; 4], &[0.5; 4]), &[1.0; 4], 0.0);
        assert_eq!(y, [0.5; 4]);
        assert_eq!(dx, [0.0; 4]);
        assert_eq!(dw, [0.0; 4]);
        assert_eq!(db, [1.0; 4]);
    }

    #[test]
    fn shapes_are_checked_and_errors_name_the_width() {
        let ln = LayerNorm::new(8);
        assert_eq!(ln.output_shape(&Shape::new([2, 3, 8])).unwrap(), Shape::new([2, 3, 8]));
        assert_eq!(ln.output_shape(&Shape::new([2, 8])).unwrap(), Shape::new([2, 8]));
        let e = ln.output_shape(&Shape::new([2, 3, 7])).unwrap_err().to_string();
        assert!(e.contains("LayerNorm") && e.contains("last dimension of 8") && e.contains("(2, 3, 7)"), "{e}");
        let e = ln.output_shape(&Shape::new([8])).unwrap_err().to_string();
        assert!(e.contains("expects (N, ..., 8)"), "{e}");
        // Backward without a training forward, and with a gradient of another shape.
        let mut ln = LayerNorm::new(2);
        let (w, mut g) = ([1.0f32, 1.0, 0.0, 0.0], [0.0f32; 4]);
        let ranges = [0..2, 2..4];
        let d = || Tensor::from_vec(vec![1.0; 4], [2, 2]).unwrap();
        let ctx = Ctx::eval(Device::Cpu(0));
        let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 5.0], [2, 2]).unwrap();
        ln.forward(x, Params::new(&w, &ranges), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let e = ln.backward(d(), Params::new(&w, &ranges), ParamsMut::new(&mut g, &ranges), InputGrad::Needed, &ctx);
        assert!(e.unwrap_err().to_string().contains("no training forward"), "evaluation keeps nothing");
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 5.0], [2, 2]).unwrap();
        ln.forward(x, Params::new(&w, &ranges), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let wrong = Tensor::from_vec(vec![1.0; 4], [1, 4]).unwrap();
        let e = ln.backward(wrong, Params::new(&w, &ranges), ParamsMut::new(&mut g, &ranges), InputGrad::Needed, &ctx);
        assert!(e.unwrap_err().to_string().contains("dout (1, 4) for input (2, 2)"));
    }

    #[test]
    fn an_empty_batch_passes_through_and_adds_nothing() {
        let [y, dx, dw, db] = run(LayerNorm::new(4), &[0, 3, 4], &[], (&[1.0; 4], &[0.0; 4]), &[], 0.5);
        assert!(y.is_empty() && dx.is_empty());
        assert_eq!((dw, db), (vec![0.5; 4], vec![0.5; 4]));
    }

    #[test]
    fn evaluation_computes_the_training_output() {
        let dims = [2usize, 70, 16];
        let n = dims.iter().product::<usize>();
        let mut rng = SplitMix64::new(5);
        let (x, w, b) =
            (uniform(&mut rng, n, -2.0, 2.0), uniform(&mut rng, 16, 0.5, 1.5), uniform(&mut rng, 16, -1.0, 1.0));
        let mut params = w.clone();
        params.extend(&b);
        let ranges = [0..16, 16..32];
        let mut ln = LayerNorm::new(16);
        let mut y = |ctx: &Ctx| {
            let t = Tensor::from_vec(x.clone(), dims).unwrap();
            ln.forward(t, Params::new(&params, &ranges), ParamsMut::new(&mut [], &[]), ctx).unwrap().into_vec()
        };
        let train = y(&Ctx::train(0, 0, 0, Device::Cpu(0)));
        assert_eq!(train, y(&Ctx::eval(Device::Cpu(0))));
    }

    #[test]
    fn the_spec_entry_reads_its_fields_and_infers_the_width() {
        use crate::spec::model_from_spec_str;
        let m =
            model_from_spec_str(r#"{"input_shape": [4, 8], "layers": [{"type": "layer_norm"}]}"#, "m.json").unwrap();
        assert_eq!(m.layer_names(), ["ln0"]);
        assert_eq!(m.layers()[0].describe(), "LayerNorm(8, eps 0.00001)");
        let names: Vec<_> = m.param_infos().iter().map(|t| (t.name.clone(), t.init)).collect();
        assert_eq!(names, [("ln0.weight".to_string(), Init::Ones), ("ln0.bias".to_string(), Init::Zeros)]);
        let e = model_from_spec_str(r#"{"input_shape": [8], "layers": [{"type": "layer_norm", "eps": 0}]}"#, "m.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("field 'eps' must be a positive number"), "{e}");
        // The memory account: x̂ (32 f32) and 4 rows' rstd (f64) per sample.
        let shapes = &m.layer_shapes()[0];
        assert_eq!(m.layers()[0].memory(shapes).unwrap().kept_per_sample, 32 * 4 + 4 * 8);
    }

    /// The benchmark's shape, nanoGPT's CPU recipe at B = 12, T = 64, C = 128: 768 rows
    /// of 128. `cargo test --release --lib ops::layernorm -- --ignored --nocapture`.
    #[test]
    #[ignore = "a timing, not a check: run by hand"]
    fn time_forward_and_backward_at_768_rows_of_128() {
        let dims = [12usize, 64, 128];
        let n = dims.iter().product::<usize>();
        let mut rng = SplitMix64::new(6);
        let (x, dy) = (uniform(&mut rng, n, -2.0, 2.0), uniform(&mut rng, n, -1.0, 1.0));
        let mut m = Sequential::new(&dims[1..], vec![Box::new(LayerNorm::new(128))]).unwrap();
        let store = m.init(0);
        let mut grads = vec![0.0; m.params_len()];
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        // The minimum and the median over the repetitions: the machine may be shared.
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for rep in 0..220 {
            let xt = Tensor::from_vec(x.clone(), dims).unwrap();
            let dt = Tensor::from_vec(dy.clone(), dims).unwrap();
            let t = std::time::Instant::now();
            m.forward(xt, &store.params, &mut [], &ctx).unwrap();
            let t1 = std::time::Instant::now();
            m.backward_input(dt, &store.params, &mut grads, &ctx).unwrap();
            let t2 = std::time::Instant::now();
            if rep >= 20 {
                fwd.push((t1 - t).as_secs_f64() * 1e6);
                bwd.push((t2 - t1).as_secs_f64() * 1e6);
            }
        }
        let both: Vec<f64> = fwd.iter().zip(&bwd).map(|(a, b)| a + b).collect();
        let stats = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            format!("min {:.1} µs, median {:.1} µs", v[0], v[v.len() / 2])
        };
        eprintln!(
            "LayerNorm(128) on (12, 64, 128), {} rayon threads: forward {}; backward {}; both {}",
            rayon::current_num_threads(),
            stats(&fwd),
            stats(&bwd),
            stats(&both)
        );
    }
}
