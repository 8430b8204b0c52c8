//! Causal multi-head self-attention, exactly nanoGPT's `CausalSelfAttention`
//! (karpathy/nanoGPT, model.py): a fused query-key-value projection `c_attn`, scaled dot
//! product attention under the causal mask (the math of
//! `F.scaled_dot_product_attention(q, k, v, is_causal=True)`, nanoGPT's flash path), its
//! attention dropout, the heads merged back, the output projection `c_proj` and its
//! residual dropout. Owns the layer: its spec entry (`causal_self_attention`), its spec
//! form, its memory account, the buffers its training forward keeps for the backward and
//! the masks' keys, built on its CPU forward and backward ([`cpu`]: one sample's
//! arithmetic, the causal softmax, the projections' gradients). Its GPU form is [`gpu`]
//! (cuBLAS for every product, kernels/attention.cu for the head split and merge and the
//! causal softmax and its gradient, kernels/dropout.cu for the masks).
//! The residual add around it, the LayerNorm before it and the GPT that stacks it are
//! other modules' (`model::residual`, the model).
//!
//! # Shapes
//! N batch, T positions, C width, H heads, D = C/H the head width.
//! - x, y: (N, T, C); `c_attn.weight` (3C, C), `c_attn.bias` (3C), `c_proj.weight` (C, C),
//!   `c_proj.bias` (C), PyTorch's Linear layout: y = x·Wᵀ + b.
//! - qkv = x·W_attnᵀ + b_attn: (N, T, 3C), q, k, v its thirds in that order; head h of q is
//!   columns h·D..(h+1)·D (`view(B, T, H, D).transpose(1, 2)`).
//! - S = q_h·k_hᵀ (T, T) per (sample, head); P = softmax(S/√D) over j ≤ i, 0 for j > i
//!   (the causal mask, −∞ before the softmax); P' = dropout(P); y_h = P'·v_h (T, D),
//!   written to columns h·D.. of `merged` (N, T, C); out = dropout(merged·W_projᵀ + b_proj).
//!
//! # Backward
//! dz = dropout'(dout); dW_proj += dzᵀ·merged, db_proj += Σ dz; dmerged = dz·W_proj; per
//! head dP' = dy_h·v_hᵀ, dv_h = P'ᵀ·dy_h, dP = dropout'(dP'),
//! dS = P ⊙ (dP − rowsum(dP ⊙ P)) / √D, dq_h = dS·k_h, dk_h = dSᵀ·q_h; dqkv is (dq, dk, dv)
//! side by side; dW_attn += dqkvᵀ·x, db_attn += Σ dqkv, dx = dqkv·W_attn.
//!
//! # Determinism
//! Everything a sample's output or input gradient depends on is computed for that sample
//! alone, on the CPU backend's GEMM (`backend::cpu::gemm_with`, the calling thread), in a
//! layout that is a function of (T, C, H) alone: so a sample's result is bitwise the same
//! whatever the thread count and whichever samples share its batch. Samples run in
//! parallel on the device's pool. The parameter gradients are what `Linear`'s are: one
//! GEMM over the N·T rows (split over output blocks only, never over the rows), the bias
//! sums row after row, so their order is a function of the shape alone.
//!
//! # Dropout
//! As `nn::Dropout`'s masks, from `rng::dropout_key(seed, step, logical replica, layer)`
//! and `rng::hash64(key, index)` (so kernels/dropout.cu draws the same ones), in two
//! streams: the attention probabilities' under the layer's own index, element
//! ((offset + n)·H + h)·T² + i·T + j of its logical replica's shard (offset:
//! `Ctx::sample_offset`), and the output's under the index with bit 63 set
//! ([`RESIDUAL_STREAM`]; no layer index has it: a top-level index is small and a
//! container's derived ones are below 2^62), element (offset + n)·T·C + i·C + c. A mask is
//! never stored: the backward draws it again. Rate 0 draws nothing; evaluation never drops.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use rayon::prelude::*;

use serde_json::{json, Value};

use super::spec::{Build, FieldResult, LayerType};
use super::{Ctx, Init, InputGrad, Layer, LayerMemory, LayerShapes, Mode, ParamSpec, Params, ParamsMut, F32};
use crate::backend::cpu::{gemm_packing, transpose};
use crate::backend::par;
use crate::error::{Error, Result};
use crate::rng::dropout_key;
use crate::tensor::{Shape, Tensor};
use cpu::{attention_scale, Drops, PassContext, SampleFwd};

/// Bit 63 of the layer index that keys the residual (output) dropout's stream, setting it
/// apart from the attention dropout's, keyed by the layer's own index (module docs).
pub const RESIDUAL_STREAM: u64 = 1 << 63;

impl Drops {
    /// The masks of a training pass in `ctx`, or None (evaluation, or rate 0).
    fn of(rate: f32, ctx: &Ctx) -> Option<Drops> {
        (ctx.mode == Mode::Train && rate > 0.0).then(|| {
            let (seed, step, shard, layer) = (ctx.seed, ctx.step, ctx.shard as u64, ctx.layer_index as u64);
            Drops {
                rate,
                keep: 1.0 / (1.0 - rate),
                attn: dropout_key(seed, step, shard, layer),
                resid: dropout_key(seed, step, shard, layer | RESIDUAL_STREAM),
                first: ctx.sample_offset,
            }
        })
    }
}

/// Causal multi-head self-attention over (N, T, C).
#[derive(Clone, Debug)]
pub struct CausalSelfAttention {
    width: usize,
    heads: usize,
    dropout: f32,
    proj_std: f32,
    use_bias: bool,
    /// What the training forward keeps for backward, beside `bufs`.
    saved: Option<Saved>,
    /// Buffers kept from step to step (their contents are overwritten in every pass).
    bufs: Buffers,
    wt: Transposed,
}

/// The training forward's input and shape, and its masks.
#[derive(Clone, Debug)]
struct Saved {
    /// x: (N, T, C), for dW_attn.
    x: Tensor,
    n: usize,
    t: usize,
    drops: Option<Drops>,
}

/// The training pass's buffers: the forward's (kept for backward) and the backward's.
#[derive(Clone, Debug, Default)]
struct Buffers {
    /// qkv: (N, T, 3C)
    qkv: Vec<f32>,
    /// P: (N, H, T, T), after the softmax, before dropout.
    probs: Vec<f32>,
    /// The heads' outputs side by side, c_proj's input: (N, T, C)
    merged: Vec<f32>,
    /// dqkv: (N, T, 3C)
    dqkv: Vec<f32>,
    /// dmerged: (N, T, C)
    dmerged: Vec<f32>,
    /// Per sample one (T, T) product at a time: dP then dS in backward.
    dp: Vec<f32>,
    /// Per sample one head's dropped probabilities P' (T, T), with dropout only.
    dropped: Vec<f32>,
}

/// Resizes `v` to `len` values (new ones 0; the old ones are about to be overwritten).
fn sized(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    v.resize(len, 0.0);
    &mut v[..]
}

/// `buf` as `n` consecutive pieces of `len` values (`n` empty pieces for `len` 0).
fn split(buf: &mut [f32], n: usize, len: usize) -> Vec<&mut [f32]> {
    if len == 0 {
        return (0..n).map(|_| &mut [][..]).collect();
    }
    buf.chunks_exact_mut(len).collect()
}

/// The transposes of the two weights, for the forward (`PassContext::wt_attn`), kept from step to
/// step.
#[derive(Clone, Debug, Default)]
struct Transposed {
    attn: Vec<f32>,
    proj: Vec<f32>,
}

/// `w` (rows, cols) transposed into `out` (cols, rows), which keeps its capacity from
/// step to step.
fn transpose_into(w: &[f32], rows: usize, cols: usize, out: &mut Vec<f32>) {
    out.resize(rows * cols, 0.0);
    transpose(w, rows, cols, out);
}

/// The width of an input of sequences, (N, T, C), or the spec's words for another.
fn expect_sequences(input: &Shape) -> FieldResult<usize> {
    match input.dims() {
        [_, _, c] => Ok(*c),
        _ => Err(format!(
            "expects sequences (T, C), got samples of shape {}",
            Shape::new(&input.dims()[1.min(input.ndim())..])
        )),
    }
}

/// The layer's tensors: the QKV weight, its bias, the output projection's weight, its bias.
type Tensors<'a> = (&'a [f32], Option<&'a [f32]>, &'a [f32], Option<&'a [f32]>);

impl CausalSelfAttention {
    /// Attention over a width of `width` split into `heads` heads, nanoGPT's defaults:
    /// biases, no dropout, the output projection initialised with std 0.02.
    pub fn new(width: usize, heads: usize) -> Result<CausalSelfAttention> {
        if width == 0 || heads == 0 {
            return Err(Error::config(
                "causal self-attention",
                format!("the width and the heads must be positive (got {width} and {heads})"),
            ));
        }
        if !width.is_multiple_of(heads) {
            return Err(Error::config(
                "causal self-attention",
                format!("{heads} heads do not divide the width {width}"),
            ));
        }
        Ok(CausalSelfAttention {
            width,
            heads,
            dropout: 0.0,
            proj_std: 0.02,
            use_bias: true,
            saved: None,
            bufs: Buffers::default(),
            wt: Transposed::default(),
        })
    }

    /// The same layer with attention and residual dropout `rate` in [0, 1) (nanoGPT's
    /// `config.dropout`, both).
    pub fn with_dropout(mut self, rate: f32) -> Result<CausalSelfAttention> {
        if !(0.0..1.0).contains(&rate) {
            return Err(Error::config("dropout rate", format!("{rate} is not in [0, 1)")));
        }
        self.dropout = rate;
        Ok(self)
    }

    /// The same layer with the output projection's weight initialised N(0, std²) (the GPT
    /// sets 0.02/√(2·layers)); std must be positive and finite.
    pub fn with_proj_std(mut self, std: f32) -> Result<CausalSelfAttention> {
        if !(std.is_finite() && std > 0.0) {
            return Err(Error::config("causal self-attention", format!("proj_std {std} is not a positive number")));
        }
        self.proj_std = std;
        Ok(self)
    }

    /// The same layer without the two biases (nanoGPT's `bias=False`).
    pub fn without_bias(mut self) -> CausalSelfAttention {
        self.use_bias = false;
        self
    }

    /// The width C.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The number of heads H.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// The spec entry: nanoGPT's `CausalSelfAttention(config)`, its width the running
    /// shape's last dimension.
    pub const SPEC: LayerType = LayerType {
        name: "causal_self_attention",
        fields:
            "`heads` (dividing the width), `dropout` (0; attention and residual), `proj_std` (0.02), `use_bias` (true)",
        example: (
            &[5, 8],
            r#"{"type": "causal_self_attention", "heads": 2, "dropout": 0.25, "proj_std": 0.01, "use_bias": false}"#,
        ),
        parse: |f| {
            let heads = f.size("heads", None)?;
            let dropout = f.number("dropout", Some(0.0), (|x| (0.0..1.0).contains(&x), "a number in [0, 1)"))?;
            let proj_std = f.number("proj_std", Some(0.02), (|x| x > 0.0, "a positive number"))?;
            let use_bias = f.boolean("use_bias", true)?;
            Ok(Build::layer(move |input| {
                let width = expect_sequences(input)?;
                let layer = CausalSelfAttention::new(width, heads)
                    .and_then(|l| l.with_dropout(dropout))
                    .and_then(|l| l.with_proj_std(proj_std))
                    .map_err(|e| e.to_string())?;
                Ok(if use_bias { layer } else { layer.without_bias() })
            }))
        },
        #[cfg(feature = "cuda")]
        kernels: Some(&gpu::KERNELS),
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Values,
            #[cfg(feature = "cuda")]
            host: Some(gpu::host_check),
        },
    };

    /// (N, T) of an input (N, T, C) of this layer's width.
    fn geometry(&self, input: &Shape, op: &'static str) -> Result<(usize, usize)> {
        match input.dims() {
            &[n, t, c] if c == self.width && t > 0 => Ok((n, t)),
            _ => Err(Error::shape(op, format!("expected (N, T, {}) with T ≥ 1, got {input}", self.width))),
        }
    }

    /// What the samples of a backward share (no transposed weights: the backward
    /// multiplies by the weights as stored).
    fn backward_job<'a>(&self, t: usize, params: &Params<'a>, drops: Option<Drops>) -> PassContext<'a> {
        let (w_attn, b_attn, w_proj, b_proj) = self.tensors(params);
        let (c, heads) = (self.width, self.heads);
        let (hd, scale) = (c / heads, attention_scale(c / heads));
        PassContext { t, c, heads, hd, scale, w_attn, w_proj, wt_attn: &[], wt_proj: &[], b_attn, b_proj, drops }
    }

    /// The parameters (c_attn.weight, c_attn.bias, c_proj.weight, c_proj.bias) of `params`.
    fn tensors<'a>(&self, params: &Params<'a>) -> Tensors<'a> {
        if self.use_bias {
            (params.get(0), Some(params.get(1)), params.get(2), Some(params.get(3)))
        } else {
            (params.get(0), None, params.get(1), None)
        }
    }
}

impl Layer for CausalSelfAttention {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "attn"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({
            "type": "causal_self_attention",
            "heads": self.heads,
            "dropout": self.dropout,
            "proj_std": self.proj_std,
            "use_bias": self.use_bias,
        }))
    }

    /// Per sample: kept for backward its input x (T·C), qkv (3·T·C), the probabilities
    /// (H·T·T: the (N, H, T, T) scores, after the softmax) and the merged heads (T·C);
    /// held from step to step for the backward dqkv (3·T·C), dmerged (T·C) and one head's
    /// dP (T·T), and with dropout one head's P' (T·T). The masks are drawn again, never
    /// kept. Per sample in flight, one head's k or v transposed (T·D) for its products.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let (t, c) = match shapes.input.dims() {
            &[t, c] => (t as u64, c as u64),
            _ => return None,
        };
        let tt = t.saturating_mul(t);
        let tc = t.saturating_mul(c);
        let dropped = if self.dropout > 0.0 { tt } else { 0 };
        let values =
            tc.saturating_mul(9).saturating_add(tt.saturating_mul(self.heads as u64 + 1)).saturating_add(dropped);
        let transposed = tc / (self.heads.max(1) as u64);
        // The projections' packing (any number of rows by C to 3C or C, and back); the
        // heads' products are `backend::chain`'s, which packs nothing.
        let (c, any) = (c as usize, usize::MAX);
        let products = [(any, 3 * c, c), (3 * c, c, any), (any, c, 3 * c), (any, c, c), (c, c, any)];
        Some(LayerMemory {
            kept_per_sample: values.saturating_mul(F32),
            per_chunk: transposed.saturating_mul(F32),
            gemm: products.into_iter().map(|(m, n, k)| gemm_packing(m, n, k)).max().unwrap_or(0),
            ..LayerMemory::NONE
        })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        self.geometry(input, "CausalSelfAttention")?;
        Ok(input.clone())
    }

    fn params(&self) -> Vec<ParamSpec> {
        let c = self.width;
        let weight = |name: &'static str, rows: usize, std: f32| ParamSpec {
            name: name.into(),
            shape: Shape::new([rows, c]),
            init: Init::Normal { std },
        };
        let bias = |name: &'static str, len: usize| ParamSpec {
            name: name.into(),
            shape: Shape::new([len]),
            init: Init::Zeros,
        };
        if self.use_bias {
            vec![
                weight("c_attn.weight", 3 * c, 0.02),
                bias("c_attn.bias", 3 * c),
                weight("c_proj.weight", c, self.proj_std),
                bias("c_proj.bias", c),
            ]
        } else {
            vec![weight("c_attn.weight", 3 * c, 0.02), weight("c_proj.weight", c, self.proj_std)]
        }
    }

    // x: (N, T, C) → y: (N, T, C)
    fn forward(&mut self, x: Tensor, params: Params<'_>, _buffers: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (n, t) = self.geometry(x.shape(), "CausalSelfAttention")?;
        let (c, heads) = (self.width, self.heads);
        let drops = Drops::of(self.dropout, ctx);
        let (w_attn, b_attn, w_proj, b_proj) = self.tensors(&params);
        transpose_into(w_attn, 3 * c, c, &mut self.wt.attn);
        transpose_into(w_proj, c, c, &mut self.wt.proj);
        let (wt_attn, wt_proj) = (&self.wt.attn[..], &self.wt.proj[..]);
        let (hd, scale) = (c / heads, attention_scale(c / heads));
        let job = PassContext { t, c, heads, hd, scale, w_attn, w_proj, wt_attn, wt_proj, b_attn, b_proj, drops };
        // Each row of y starts as b_proj, which PassContext::forward's last GEMM adds to.
        let mut y = match b_proj {
            Some(b) => b.repeat(n * t),
            None => vec![0.0f32; n * t * c],
        };
        let pairs = y.par_chunks_mut(t * c).zip(x.host().par_chunks(t * c)).enumerate();
        if ctx.mode == Mode::Train {
            let b = &mut self.bufs;
            let dropped_len = if drops.is_some() { t * t } else { 0 };
            let qkv = split(sized(&mut b.qkv, n * t * 3 * c), n, t * 3 * c);
            let probs = split(sized(&mut b.probs, n * heads * t * t), n, heads * t * t);
            let merged = split(sized(&mut b.merged, n * t * c), n, t * c);
            let dropped = split(sized(&mut b.dropped, n * dropped_len), n, dropped_len);
            let samples = qkv.into_iter().zip(probs).zip(merged).zip(dropped);
            let bufs: Vec<SampleFwd<'_>> =
                samples.map(|(((qkv, probs), merged), dropped)| SampleFwd { qkv, probs, merged, dropped }).collect();
            par::for_each(pairs.zip(bufs), |((s, (yn, xn)), b)| cpu::attention_forward(&job, s, xn, yn, b));
        } else {
            // Nothing is kept: each task's samples share one sample's buffers.
            let alloc = || [vec![0.0f32; t * 3 * c], vec![0.0; heads * t * t], vec![0.0; t * c]];
            par::for_each_init(pairs, alloc, |[qkv, probs, merged], (s, (yn, xn))| {
                cpu::attention_forward(&job, s, xn, yn, SampleFwd { qkv, probs, merged, dropped: &mut [] })
            });
        }
        let y = Tensor::from_vec_on(y, x.shape().clone(), x.device())?;
        self.saved = (ctx.mode == Mode::Train).then_some(Saved { x, n, t, drops });
        Ok(y)
    }

    // dout: (N, T, C) → dx: (N, T, C); dW_proj += dzᵀ·merged, db_proj += Σ dz,
    // dW_attn += dqkvᵀ·x, db_attn += Σ dqkv (the module's Backward)
    fn backward(
        &mut self,
        mut dout: Tensor,
        params: Params<'_>,
        mut dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let Saved { x, n, t, drops } = self
            .saved
            .take()
            .ok_or_else(|| Error::config("CausalSelfAttention backward", "no training forward to differentiate"))?;
        x.same_device("CausalSelfAttention backward", &dout)?;
        if dout.shape() != x.shape() {
            return Err(Error::shape(
                "CausalSelfAttention backward",
                format!("dout {} for output {}", dout.shape(), x.shape()),
            ));
        }
        let (c, heads) = (self.width, self.heads);
        let job = self.backward_job(t, &params, drops);
        let b = &mut self.bufs;
        let dropped_len = if drops.is_some() { t * t } else { 0 };
        let dqkv = split(sized(&mut b.dqkv, n * t * 3 * c), n, t * 3 * c);
        let dmerged = split(sized(&mut b.dmerged, n * t * c), n, t * c);
        let dp = split(sized(&mut b.dp, n * t * t), n, t * t);
        let dropped = split(sized(&mut b.dropped, n * dropped_len), n, dropped_len);
        let mut dx = match input_grad {
            InputGrad::Needed => Some(vec![0.0f32; n * t * c]),
            InputGrad::Skip => None,
        };
        let dxs = match dx.as_mut() {
            Some(dx) => dx.chunks_exact_mut(t * c).map(Some).collect(),
            None => (0..n).map(|_| None).collect::<Vec<_>>(),
        };
        let saved = b.qkv.chunks_exact(t * 3 * c).zip(b.probs.chunks_exact(heads * t * t));
        let work: Vec<_> = dout
            .host_mut()
            .chunks_exact_mut(t * c)
            .zip(saved)
            .zip(dqkv.into_iter().zip(dmerged))
            .zip(dp.into_iter().zip(dropped))
            .zip(dxs)
            .collect();
        let work = work.into_par_iter().enumerate();
        par::for_each(work, |(s, ((((dz, saved), (dqkv, dmerged)), (dp, dropped)), dx))| {
            cpu::attention_backward(&job, s, dz, saved, dqkv, dmerged, dp, dropped, dx)
        });
        // The parameter gradients over the N·T rows, as Linear's: dz is c_proj's output
        // gradient (its dropout undone above), dqkv c_attn's.
        let (nt, dz) = (n * t, dout.host());
        let (proj, attn) = ((nt, c, c), (nt, c, 3 * c));
        if self.use_bias {
            let (dw, db) = dparams.pair(2, 3);
            cpu::projection_backward(dz, &b.merged, proj, dw, Some(db));
            let (dw, db) = dparams.pair(0, 1);
            cpu::projection_backward(&b.dqkv, x.host(), attn, dw, Some(db));
        } else {
            cpu::projection_backward(dz, &b.merged, proj, dparams.get(1), None);
            cpu::projection_backward(&b.dqkv, x.host(), attn, dparams.get(0), None);
        }
        dx.map(|dx| Tensor::from_vec_on(dx, x.shape().clone(), x.device())).transpose()
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(CausalSelfAttention {
            saved: None,
            bufs: Buffers::default(),
            wt: Transposed::default(),
            ..self.clone()
        })
    }

    fn describe(&self) -> String {
        let mut d = format!("Attention({}, {} heads", self.width, self.heads);
        if self.dropout > 0.0 {
            d += &format!(", dropout {}", self.dropout);
        }
        if !self.use_bias {
            d += ", no bias";
        }
        d + ")"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::nn::Dropout;
    use crate::rng::SplitMix64;
    use crate::tensor::Device;

    /// A layer's parameters in one flat buffer, as `Sequential` would lay them out (without
    /// its alignment gaps), drawn U(−a, a).
    struct Flat {
        values: Vec<f32>,
        ranges: Vec<std::ops::Range<usize>>,
    }

    impl Flat {
        fn random(layer: &CausalSelfAttention, a: f32, seed: u64) -> Flat {
            let mut g = SplitMix64::new(seed);
            let (mut values, mut ranges) = (Vec::new(), Vec::new());
            for p in layer.params() {
                let start = values.len();
                values.extend((0..p.shape.numel()).map(|_| (g.next_f32() * 2.0 - 1.0) * a));
                ranges.push(start..values.len());
            }
            Flat { values, ranges }
        }

        fn zeros_like(&self) -> Vec<f32> {
            vec![0.0; self.values.len()]
        }
    }

    fn uniform(len: usize, a: f32, seed: u64) -> Vec<f32> {
        let mut g = SplitMix64::new(seed);
        (0..len).map(|_| (g.next_f32() * 2.0 - 1.0) * a).collect()
    }

    fn train_ctx() -> Ctx<'static> {
        Ctx { layer_index: 3, ..Ctx::train(11, 7, 1, Device::Cpu(0)) }
    }

    /// The layer's forward of x (N, T, C) under `ctx`.
    fn forward(layer: &mut CausalSelfAttention, p: &Flat, x: &[f32], n: usize, ctx: &Ctx) -> Vec<f32> {
        let (t, c) = (x.len() / n / layer.width, layer.width);
        let x = Tensor::from_vec(x.to_vec(), [n, t, c]).unwrap();
        let y = layer.forward(x, Params::new(&p.values, &p.ranges), ParamsMut::new(&mut [], &[]), ctx).unwrap();
        y.into_vec()
    }

    /// A training forward of x, then the backward of dout: (y, dx, the parameter
    /// gradients accumulated into `grads`).
    fn forward_backward(
        layer: &mut CausalSelfAttention,
        p: &Flat,
        x: &[f32],
        n: usize,
        dout: &[f32],
        grads: &mut [f32],
        ctx: &Ctx,
    ) -> (Vec<f32>, Vec<f32>) {
        let y = forward(layer, p, x, n, ctx);
        let shape = Shape::new([n, x.len() / n / layer.width, layer.width]);
        let d = Tensor::from_vec(dout.to_vec(), shape).unwrap();
        let dx = layer
            .backward(d, Params::new(&p.values, &p.ranges), ParamsMut::new(grads, &p.ranges), InputGrad::Needed, ctx)
            .unwrap()
            .unwrap();
        (y, dx.into_vec())
    }

    /// nanoGPT's forward (p = 0) in f64, straight from model.py: qkv = x·Wᵀ + b, split in
    /// q, k, v, heads as view(B, T, H, D).transpose(1, 2), softmax(q·kᵀ/√D) under the causal
    /// mask, y = att·v, heads merged, c_proj.
    fn reference(layer: &CausalSelfAttention, p: &Flat, x: &[f32], n: usize) -> Vec<f64> {
        let (c, h) = (layer.width, layer.heads);
        let (t, d) = (x.len() / n / c, c / h);
        let get = |i: usize| &p.values[p.ranges[i].clone()];
        let (wa, ba, wp, bp) = (get(0), get(1), get(2), get(3));
        let mut out = vec![0.0f64; x.len()];
        for s in 0..n {
            let xs = &x[s * t * c..(s + 1) * t * c];
            let qkv: Vec<f64> = (0..t * 3 * c)
                .map(|e| {
                    let (i, o) = (e / (3 * c), e % (3 * c));
                    ba[o] as f64 + (0..c).map(|k| xs[i * c + k] as f64 * wa[o * c + k] as f64).sum::<f64>()
                })
                .collect();
            let mut merged = vec![0.0f64; t * c];
            for hh in 0..h {
                let at = |part: usize, i: usize, dd: usize| qkv[i * 3 * c + part * c + hh * d + dd];
                for i in 0..t {
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| (0..d).map(|dd| at(0, i, dd) * at(1, j, dd)).sum::<f64>() / (d as f64).sqrt())
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for dd in 0..d {
                        merged[i * c + hh * d + dd] = (0..=i).map(|j| e[j] / z * at(2, j, dd)).sum();
                    }
                }
            }
            for i in 0..t {
                for o in 0..c {
                    out[s * t * c + i * c + o] =
                        bp[o] as f64 + (0..c).map(|k| merged[i * c + k] * wp[o * c + k] as f64).sum::<f64>();
                }
            }
        }
        out
    }

    #[test]
    fn forward_is_nanogpts_attention() {
        // Against the f64 restatement above; the f32 layer's error is a few ulp of sums of
        // C = 12 and T = 6 terms of size ≤ 1: |Δ| ≤ 1e-5.
        let (n, t, c, h) = (2, 6, 12, 3);
        let mut layer = CausalSelfAttention::new(c, h).unwrap();
        let p = Flat::random(&layer, 0.5, 1);
        let x = uniform(n * t * c, 1.0, 2);
        for ctx in [train_ctx(), Ctx::eval(Device::Cpu(0))] {
            let y = forward(&mut layer, &p, &x, n, &ctx);
            for (i, (got, want)) in y.iter().zip(reference(&layer, &p, &x, n)).enumerate() {
                assert!((*got as f64 - want).abs() <= 1e-5, "y[{i}]: {got} vs {want} ({:?})", ctx.mode);
            }
        }
    }

    /// Central differences of L = Σ w·y(θ) in every input and parameter value against the
    /// backward. L in f64 from the f32 forward; the step h = 1e-2 on values of size ≤ 1
    /// leaves a truncation error h²/6·|L'''| ≈ 1e-5 and a rounding error of the forward of
    /// about 2^-24·Σ|w·y|/2h ≈ 1e-5 (tests/gradcheck.rs's reasoning), inside
    /// |Δ| ≤ 1e-3 + 1e-2·max(|analytic|, |numeric|). The backward also adds into
    /// gradients that already hold values (the gradient contract).
    fn gradcheck(mut layer: CausalSelfAttention, ctx: &Ctx) {
        let (n, t, c) = (2, 5, layer.width);
        let p = Flat::random(&layer, 0.5, 3);
        let x = uniform(n * t * c, 1.0, 4);
        let w = uniform(n * t * c, 1.0, 5);
        let prior = uniform(p.values.len(), 1.0, 6);
        let mut grads = prior.clone();
        let (_, dx) = forward_backward(&mut layer, &p, &x, n, &w, &mut grads, ctx);
        let loss = |layer: &mut CausalSelfAttention, p: &Flat, x: &[f32]| -> f64 {
            forward(layer, p, x, n, ctx).iter().zip(&w).map(|(y, w)| *y as f64 * *w as f64).sum()
        };
        let h = 1e-2f32;
        let check = |what: String, analytic: f32, plus: f64, minus: f64, step: f64| {
            let numeric = (plus - minus) / step;
            let bound = 1e-3 + 1e-2 * (analytic as f64).abs().max(numeric.abs());
            assert!((analytic as f64 - numeric).abs() <= bound, "{what}: backward {analytic}, numeric {numeric}");
        };
        for i in 0..x.len() {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[i] += h;
            xm[i] -= h;
            let step = (xp[i] - xm[i]) as f64;
            check(format!("dx[{i}]"), dx[i], loss(&mut layer, &p, &xp), loss(&mut layer, &p, &xm), step);
        }
        let names: Vec<String> = layer.params().iter().map(|s| s.name.to_string()).collect();
        for (k, range) in p.ranges.iter().enumerate() {
            for i in range.clone() {
                let (mut pp, mut pm) = (Flat { values: p.values.clone(), ranges: p.ranges.clone() }, p.values.clone());
                pp.values[i] += h;
                pm[i] -= h;
                let step = (pp.values[i] - pm[i]) as f64;
                let plus = loss(&mut layer, &pp, &x);
                let minus = loss(&mut layer, &Flat { values: pm, ranges: p.ranges.clone() }, &x);
                let g = grads[i] - prior[i];
                check(format!("d{}[{}]", names[k], i - range.start), g, plus, minus, step);
            }
        }
        // Accumulation: into zeros, the same gradient, but for the roundings of adding to
        // what the buffer held (the bias sums add row after row into it: N·T = 10
        // roundings of values of size ≤ 10, so |Δ| ≤ 1e-5).
        let mut fresh = p.zeros_like();
        forward_backward(&mut layer, &p, &x, n, &w, &mut fresh, ctx);
        for (i, ((g, f), p0)) in grads.iter().zip(&fresh).zip(&prior).enumerate() {
            assert!((g - (p0 + f)).abs() <= 1e-5, "gradient {i}: {g} is not {p0} + {f}: not added to the buffer");
        }
    }

    /// The fused layer's heads are the scaled_dot_product_attention op's (`ops::sdpa`) on
    /// the same q, k and v, bit for bit: both call the head functions of [`cpu`], here on
    /// columns of the qkv rows, there on (T, D) blocks. The heads of the layer's qkv
    /// (N, T, 3C) rearranged to (N, H, T, D), through the op causal at 1/√D, give the
    /// layer's merged heads; the layer's dmerged rearranged likewise gives its dqkv.
    #[test]
    fn the_fused_heads_are_scaled_dot_product_attention_on_the_split_heads() {
        use crate::ops::sdpa::ScaledDotProductAttention;
        let (n, t, c, h) = (2, 7, 12, 3);
        let d = c / h;
        let mut layer = CausalSelfAttention::new(c, h).unwrap();
        let p = Flat::random(&layer, 0.5, 21);
        let (x, dout) = (uniform(n * t * c, 1.0, 22), uniform(n * t * c, 1.0, 23));
        let mut grads = p.zeros_like();
        forward_backward(&mut layer, &p, &x, n, &dout, &mut grads, &train_ctx());
        // Element (s, hh, i, dd) of (N, H, T, D) from rows of `width` at column offset `at`.
        let heads = |rows: &[f32], width: usize, at: usize| -> Vec<f32> {
            let mut out = vec![0.0; n * h * t * d];
            for (e, o) in out.iter_mut().enumerate() {
                let (s, hh, i, dd) = (e / (h * t * d), e / (t * d) % h, e / d % t, e % d);
                *o = rows[(s * t + i) * width + at + hh * d + dd];
            }
            out
        };
        let b = &layer.bufs;
        let (q, k, v) = (heads(&b.qkv, 3 * c, 0), heads(&b.qkv, 3 * c, c), heads(&b.qkv, 3 * c, 2 * c));
        let dims = [n, h, t, d];
        let tensor = |v: &[f32]| Tensor::from_vec(v.to_vec(), dims).unwrap();
        let mut sdpa = ScaledDotProductAttention::new(cpu::Mask::Causal);
        let ctx = train_ctx();
        let none = || (Params::new(&[], &[]), ParamsMut::new(&mut [], &[]));
        let (pa, bu) = none();
        let y = sdpa.forward_many(vec![tensor(&q), tensor(&k), tensor(&v)], pa, bu, &ctx).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(y.host()), bits(&heads(&b.merged, c, 0)), "the heads' outputs");
        let (pa, dp) = none();
        let dy = tensor(&heads(&b.dmerged, c, 0));
        let g = sdpa.backward_many(dy, pa, dp, &[InputGrad::Needed; 3], &ctx).unwrap();
        for (j, g) in g.into_iter().enumerate() {
            let want = heads(&b.dqkv, 3 * c, j * c);
            assert_eq!(bits(g.unwrap().host()), bits(&want), "the gradient of {}", ["q", "k", "v"][j]);
        }
    }

    #[test]
    fn every_gradient_matches_central_differences() {
        gradcheck(CausalSelfAttention::new(8, 2).unwrap(), &train_ctx());
    }

    #[test]
    fn every_gradient_matches_central_differences_without_bias_and_with_one_head() {
        gradcheck(CausalSelfAttention::new(6, 1).unwrap().without_bias(), &train_ctx());
    }

    #[test]
    fn every_gradient_matches_central_differences_with_dropout() {
        // The masks are a function of the context alone, so each evaluation of the loss
        // draws the same ones: the layer is a smooth function of its inputs for the check.
        gradcheck(CausalSelfAttention::new(8, 2).unwrap().with_dropout(0.3).unwrap(), &train_ctx());
    }

    #[test]
    fn an_output_depends_on_no_later_position() {
        let (n, t, c) = (2, 7, 8);
        let mut layer = CausalSelfAttention::new(c, 2).unwrap();
        let p = Flat::random(&layer, 0.5, 7);
        let x = uniform(n * t * c, 1.0, 8);
        let y = forward(&mut layer, &p, &x, n, &train_ctx());
        for pos in 0..t {
            let mut x2 = x.clone();
            for s in 0..n {
                x2[(s * t + pos) * c..(s * t + pos + 1) * c].iter_mut().for_each(|v| *v = *v * -3.0 + 1.0);
            }
            let y2 = forward(&mut layer, &p, &x2, n, &train_ctx());
            for s in 0..n {
                let row = |y: &[f32], i: usize| y[(s * t + i) * c..(s * t + i + 1) * c].to_vec();
                for i in 0..pos {
                    assert_eq!(row(&y, i), row(&y2, i), "sample {s}: position {i} moved with position {pos}");
                }
                assert_ne!(row(&y, pos), row(&y2, pos), "sample {s}: position {pos} ignores itself");
            }
        }
    }

    #[test]
    fn a_sample_is_bitwise_the_same_alone_in_a_batch_of_three_and_on_any_thread_count() {
        let (t, c) = (9, 16);
        let layer = CausalSelfAttention::new(c, 4).unwrap();
        let p = Flat::random(&layer, 0.5, 9);
        let (x, dout) = (uniform(3 * t * c, 1.0, 10), uniform(3 * t * c, 1.0, 11));
        let run = |threads: usize, range: std::ops::Range<usize>| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let (a, b) = (range.start * t * c, range.end * t * c);
            let mut grads = p.zeros_like();
            let mut layer = layer.clone();
            let ctx = train_ctx();
            let (y, dx) =
                pool.install(|| forward_backward(&mut layer, &p, &x[a..b], range.len(), &dout[a..b], &mut grads, &ctx));
            (y, dx, grads)
        };
        let (y1, dx1, _) = run(1, 1..2);
        let (y3, dx3, g3) = run(1, 0..3);
        assert_eq!(y1, y3[t * c..2 * t * c], "the output of sample 1 alone vs in the batch");
        assert_eq!(dx1, dx3[t * c..2 * t * c], "the input gradient of sample 1 alone vs in the batch");
        let (y3b, dx3b, g3b) = run(2, 0..3);
        assert_eq!((y3, dx3, g3), (y3b, dx3b, g3b), "1 thread vs 2");
    }

    #[test]
    fn dropout_draws_nn_dropouts_masks_in_two_streams_and_evaluation_never_drops() {
        let (n, t, c, h) = (3, 6, 8, 2);
        let rate = 0.4;
        let mut plain = CausalSelfAttention::new(c, h).unwrap();
        let mut dropping = plain.clone().with_dropout(rate).unwrap();
        let p = Flat::random(&plain, 0.5, 12);
        let x = uniform(n * t * c, 1.0, 13);
        let ctx = train_ctx();
        // Evaluation is the layer without dropout, bit for bit.
        let eval = Ctx::eval(Device::Cpu(0));
        assert_eq!(forward(&mut dropping, &p, &x, n, &eval), forward(&mut plain, &p, &x, n, &train_ctx()));
        // The same context draws the same masks; another step others.
        let y = forward(&mut dropping, &p, &x, n, &ctx);
        assert_eq!(y, forward(&mut dropping, &p, &x, n, &ctx));
        assert_ne!(y, forward(&mut dropping, &p, &x, n, &Ctx { step: 8, ..ctx }));
        // The output's zeros are where nn::Dropout, at the layer's index with bit 63 set,
        // drops a tensor of ones (the attention's own stream never zeroes a whole row).
        let mut resid = Dropout::new(rate).unwrap();
        let rctx = Ctx { layer_index: (ctx.layer_index as u64 | RESIDUAL_STREAM) as usize, ..ctx };
        let ones = Tensor::from_vec(vec![1.0; n * t * c], [n, t, c]).unwrap();
        let mask = resid.forward(ones, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &rctx).unwrap();
        let dropped: Vec<bool> = mask.host().iter().map(|&m| m == 0.0).collect();
        assert_eq!(y.iter().map(|&v| v == 0.0).collect::<Vec<_>>(), dropped);
        assert!(dropped.iter().any(|&d| d) && !dropped.iter().all(|&d| d));
        // The probabilities' mask is nn::Dropout's at the layer's own index over the
        // (N, H, T, T) probabilities, where j ≤ i (the rest is 0 either way).
        let params = Params::new(&p.values, &p.ranges);
        let job = dropping.backward_job(t, &params, Drops::of(rate, &ctx));
        let probs = uniform(n * h * t * t, 1.0, 14);
        let mut attn = Dropout::new(rate).unwrap();
        let pt = Tensor::from_vec(probs.clone(), [n, h, t, t]).unwrap();
        let want = attn.forward(pt, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let mut out = vec![0.0; t * t];
        for (s, h_) in (0..n).flat_map(|s| (0..h).map(move |h_| (s, h_))) {
            let at = (s * h + h_) * t * t;
            let got = job.dropped_probs(s, h_, &probs[at..at + t * t], &mut out);
            for i in 0..t {
                for j in 0..=i {
                    assert_eq!(
                        got[i * t + j].to_bits(),
                        want.host()[at + i * t + j].to_bits(),
                        "({s}, {h_}, {i}, {j})"
                    );
                }
            }
        }
        // A later micro-batch (sample offset 1) draws what sample 1 of the whole pass drew.
        let later = forward(&mut dropping, &p, &x[t * c..], n - 1, &Ctx { sample_offset: 1, ..ctx });
        assert_eq!(later, y[t * c..]);
    }

    #[test]
    fn heads_that_do_not_divide_the_width_are_refused_by_name() {
        let e = CausalSelfAttention::new(130, 4).unwrap_err().to_string();
        assert!(e.contains("4 heads do not divide the width 130"), "{e}");
        let spec = r#"{"input_shape": [4, 130], "layers": [{"type": "causal_self_attention", "heads": 4}]}"#;
        let e = crate::spec::model_from_spec_str(spec, "m.json").unwrap_err().to_string();
        assert!(e.contains("4 heads do not divide the width 130"), "{e}");
        let spec = r#"{"input_shape": [130], "layers": [{"type": "causal_self_attention", "heads": 2}]}"#;
        let e = crate::spec::model_from_spec_str(spec, "m.json").unwrap_err().to_string();
        assert!(e.contains("expects sequences (T, C), got samples of shape (130)"), "{e}");
        assert!(CausalSelfAttention::new(8, 2).unwrap().with_dropout(1.0).is_err());
        assert!(CausalSelfAttention::new(8, 2).unwrap().with_proj_std(0.0).is_err());
    }

    #[test]
    fn the_parameters_are_nanogpts_and_the_memory_counts_the_scores() {
        let layer = CausalSelfAttention::new(128, 4).unwrap().with_proj_std(0.01).unwrap();
        let specs = layer.params();
        let got: Vec<(String, Vec<usize>, Init)> =
            specs.iter().map(|s| (s.name.to_string(), s.shape.dims().to_vec(), s.init)).collect();
        let want = vec![
            ("c_attn.weight".to_string(), vec![384, 128], Init::Normal { std: 0.02 }),
            ("c_attn.bias".to_string(), vec![384], Init::Zeros),
            ("c_proj.weight".to_string(), vec![128, 128], Init::Normal { std: 0.01 }),
            ("c_proj.bias".to_string(), vec![128], Init::Zeros),
        ];
        assert_eq!(got, want);
        assert_eq!(layer.describe(), "Attention(128, 4 heads)");
        // (T, C) = (64, 128), H = 4: 9·T·C + (H + 1)·T² values a sample, 4 bytes each.
        let shapes = LayerShapes::one(Shape::new([64, 128]), Shape::new([64, 128]));
        let m = layer.memory(&shapes).unwrap();
        assert_eq!(m.kept_per_sample, (9 * 64 * 128 + 5 * 64 * 64) * 4);
        assert!(m.kept_per_sample > 4 * 64 * 64 * 4, "the (H, T, T) scores are counted");
    }

    /// Times the forward and backward of nanoGPT's CPU recipe's attention (N = 12, T = 64,
    /// C = 128, H = 4) on pools of 1 and 2 threads: the mean and the fastest of 100 passes
    /// (on a loaded machine the mean measures the neighbours too; the fastest pass is the
    /// one least disturbed). `cargo test --release --lib attention_timing -- --ignored
    /// --nocapture`. A measurement, not a test: nothing is asserted.
    #[test]
    #[ignore]
    fn attention_timing() {
        let (n, t, c, h) = (12, 64, 128, 4);
        let mut layer = CausalSelfAttention::new(c, h).unwrap();
        let p = Flat::random(&layer, 0.1, 15);
        let x = Tensor::from_vec(uniform(n * t * c, 1.0, 16), [n, t, c]).unwrap();
        let dout = Tensor::from_vec(uniform(n * t * c, 1.0, 17), [n, t, c]).unwrap();
        let mut grads = p.zeros_like();
        let ctx = train_ctx();
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                // [forward, backward, both] × [sum, min], in seconds
                let mut stats = [[0.0f64, f64::INFINITY]; 3];
                let reps = 100;
                for rep in 0..reps + 5 {
                    let (x, d) = (x.clone(), dout.clone());
                    let params = Params::new(&p.values, &p.ranges);
                    let t0 = std::time::Instant::now();
                    let y = layer.forward(x, params, ParamsMut::new(&mut [], &[]), &ctx).unwrap();
                    let t1 = std::time::Instant::now();
                    let g = ParamsMut::new(&mut grads, &p.ranges);
                    let dx = layer.backward(d, params, g, InputGrad::Needed, &ctx).unwrap();
                    let t2 = std::time::Instant::now();
                    std::hint::black_box((y, dx));
                    if rep >= 5 {
                        for (st, dt) in stats.iter_mut().zip([t1 - t0, t2 - t1, t2 - t0]) {
                            st[0] += dt.as_secs_f64();
                            st[1] = st[1].min(dt.as_secs_f64());
                        }
                    }
                }
                let ms = |st: [f64; 2]| format!("{:.3} ms (fastest {:.3})", st[0] / reps as f64 * 1e3, st[1] * 1e3);
                let [f, b, both] = stats;
                eprintln!(
                    "attention (N {n}, T {t}, C {c}, H {h}), {threads} thread(s): forward {}, backward {}, both {}",
                    ms(f),
                    ms(b),
                    ms(both)
                );
            });
        }
    }
}
