//! Scaled dot-product attention of three inputs, PyTorch's
//! `F.scaled_dot_product_attention(q, k, v, is_causal, scale)` (ATen's op, what
//! `torch.export` gives for nanoGPT's and Llama's attention): a merge of q, k and v. Owns
//! the layer: its spec entry (`scaled_dot_product_attention`), its spec form, its memory
//! account, the shapes it takes and refuses, what its training forward keeps for the
//! backward; built on [`cpu`] (one sample's heads, by causal self-attention's own
//! arithmetic: `ops::attention::cpu`'s head functions). Its GPU form is [`gpu`] (cuBLAS's
//! strided batches for the products, kernels/attention.cu's softmax and its gradient).
//! The projections around it, the heads' split and merge, and any dropout are other
//! nodes' (a graph's Linear, Reshape and Transpose).
//!
//! # Shapes
//! N batch, H heads, T positions, D the head width; ATen's layout (B, H, T, D).
//! - q, k, v, y: (N, H, T, D), the three inputs of one shape (anything else is refused,
//!   naming the three shapes).
//! - per (sample, head): S = q·kᵀ (T, T); P = softmax(scale·S) over j ≤ i when causal,
//!   over every j otherwise; y = P·v (T, D). scale is 1/√D unless given (ATen's
//!   `scale=None`).
//!
//! # Backward
//! dv = Pᵀ·dy, dP = dy·vᵀ, dS = scale·P ⊙ (dP − rowsum(dP ⊙ P)), dq = dS·k, dk = dSᵀ·q.
//!
//! # Determinism
//! As causal self-attention's (`ops::attention`): a sample's heads are computed for it
//! alone, each product on the calling thread, so its result is bitwise the same whatever
//! the thread count and whichever samples share its batch; samples run in parallel on the
//! device's pool. There are no parameters.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use rayon::prelude::*;
use serde_json::{json, Value};

use super::attention::cpu::{attention_scale, Mask};
use super::spec::{Build, FieldResult, LayerType};
use super::{
    merge_takes_several, Arity, Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut, F32,
};
use crate::backend::par;
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};
use cpu::{Grads, Heads};

/// The op's name in errors.
const OP: &str = "ScaledDotProductAttention";

/// Attention of queries q over keys k and values v, each (N, H, T, D).
#[derive(Clone, Debug)]
pub struct ScaledDotProductAttention {
    mask: Mask,
    /// The scores' scale; None: 1/√D.
    scale: Option<f32>,
    /// The training forward's inputs, kept for the backward.
    saved: Option<Saved>,
    /// P: (N, H, T, T), from the training forward (its capacity kept from step to step).
    probs: Vec<f32>,
    /// One (T, T) product per sample in the backward: dP, then dS.
    dp: Vec<f32>,
    /// Whether the graph handed it the transposes around it (`take_head_transposes`): q,
    /// k, v arrive, and y leaves, as (N, T, H, D) on the CPU.
    positions_first: bool,
}

#[derive(Clone, Debug)]
struct Saved {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    heads: Heads,
}

impl ScaledDotProductAttention {
    /// Attention under `mask` (ATen's `is_causal`: [`Mask::Causal`]), scale 1/√D.
    pub fn new(mask: Mask) -> ScaledDotProductAttention {
        ScaledDotProductAttention {
            mask,
            scale: None,
            saved: None,
            probs: Vec::new(),
            dp: Vec::new(),
            positions_first: false,
        }
    }

    /// The same attention with the scores scaled by `scale` (ATen's `scale`), which must
    /// be positive and finite.
    pub fn with_scale(mut self, scale: f32) -> Result<ScaledDotProductAttention> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::config(
                "scaled dot-product attention",
                format!("scale {scale} is not a positive number"),
            ));
        }
        self.scale = Some(scale);
        Ok(self)
    }

    /// The spec entry: a merge of three inbound layers, q, k and v in that order.
    pub const SPEC: LayerType = LayerType {
        name: "scaled_dot_product_attention",
        fields: "`causal` (false; ATen's `is_causal`), `scale` (1/√D); three inputs q, k, v of one shape (H, T, D)",
        example: (
            &[2, 5, 4],
            r#"{"type": "scaled_dot_product_attention", "inbound": ["input", "input", "input"], "causal": true, "scale": 0.25}"#,
        ),
        parse: |f| {
            let mask = if f.boolean("causal", false)? { Mask::Causal } else { Mask::Full };
            let scale = f.optional_positive("scale")?;
            Ok(Build::merge(move |inputs| {
                heads_of(inputs)?;
                let layer = ScaledDotProductAttention::new(mask);
                match scale {
                    Some(s) => layer.with_scale(s).map_err(|e| e.to_string()),
                    None => Ok(layer),
                }
            }))
        },
        // Its kernels are kernels/attention.cu's, held to the CPU by that entry's check.
        #[cfg(feature = "cuda")]
        kernels: None,
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Values,
            #[cfg(feature = "cuda")]
            host: None,
        },
    };

    /// The shapes of a pass whose inputs have shapes `inputs` (batch included).
    fn heads(&self, inputs: &[&Shape]) -> Result<(usize, Heads)> {
        let shapes: Vec<Shape> = inputs.iter().map(|s| (*s).clone()).collect();
        let (n, a, b, d) = heads_of(&shapes).map_err(|why| Error::shape(OP, why))?;
        let (h, t) = if self.positions_first { (b, a) } else { (a, b) };
        let scale = self.scale.unwrap_or_else(|| attention_scale(d));
        Ok((n, Heads { h, t, d, mask: self.mask, scale, positions_first: self.positions_first }))
    }
}

/// (N, H, T, D) of three inputs q, k, v of that one shape, or the words for others.
fn heads_of(inputs: &[Shape]) -> FieldResult<(usize, usize, usize, usize)> {
    let [q, k, v] = inputs else {
        return Err(format!("takes three inputs, q, k and v, given {}", inputs.len()));
    };
    if q != k || q != v {
        return Err(format!("q, k and v must have one shape (N, H, T, D); got q {q}, k {k}, v {v}"));
    }
    match q.dims() {
        &[n, h, t, d] if t > 0 && d > 0 => Ok((n, h, t, d)),
        _ => Err(format!("expects q, k and v of heads (H, T, D), T and D at least 1; got {q}")),
    }
}

/// `v` resized to `len` (new values 0; the old ones are about to be overwritten) as `n`
/// pieces of `len / n`.
fn pieces(v: &mut Vec<f32>, n: usize, per: usize) -> Vec<&mut [f32]> {
    v.resize(n * per, 0.0);
    if per == 0 {
        return (0..n).map(|_| &mut [][..]).collect();
    }
    v.chunks_exact_mut(per).collect()
}

/// A gradient `x` of `n` samples of `per` values as its samples, or `n` Nones where
/// nobody asked for it.
fn samples_of(x: &mut Option<Vec<f32>>, n: usize, per: usize) -> Vec<Option<&mut [f32]>> {
    match x.as_mut() {
        Some(x) if per > 0 => x.chunks_exact_mut(per).map(Some).collect(),
        _ => (0..n).map(|_| None).collect(),
    }
}

impl Layer for ScaledDotProductAttention {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "sdpa"
    }

    fn arity(&self) -> Arity {
        Arity::Exactly(3)
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({
            "type": "scaled_dot_product_attention",
            "causal": self.mask == Mask::Causal,
            "scale": self.scale,
        }))
    }

    /// Per sample: kept for backward q, k and v (3·H·T·D: a graph's node hands them over,
    /// and they stay until this backward) and the probabilities (H·T·T); held from step to
    /// step for the backward one (T, T) product. Per sample in flight, one head's k or v
    /// transposed (T·D) for its products (`backend::chain`'s, which pack nothing).
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let (h, t, d) = match shapes.input.dims() {
            &[h, t, d] => (h as u64, t as u64, d as u64),
            _ => return None,
        };
        let htd = h.saturating_mul(t).saturating_mul(d);
        let htt = h.saturating_mul(t).saturating_mul(t);
        let values = htd.saturating_mul(3).saturating_add(htt).saturating_add(t.saturating_mul(t));
        Some(LayerMemory {
            kept_per_sample: values.saturating_mul(F32),
            per_chunk: t.saturating_mul(d).saturating_mul(F32),
            ..LayerMemory::NONE
        })
    }

    fn output_shape(&self, _input: &Shape) -> Result<Shape> {
        merge_takes_several(OP, self.arity())
    }

    fn output_shape_many(&self, inputs: &[Shape]) -> Result<Shape> {
        heads_of(inputs).map_err(|why| Error::shape(OP, why))?;
        Ok(inputs[0].clone())
    }

    fn forward(&mut self, _x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, _ctx: &Ctx) -> Result<Tensor> {
        merge_takes_several(OP, self.arity())
    }

    // q, k, v: (N, H, T, D) → y: (N, H, T, D), or each (N, T, H, D) where it took the
    // transposes around it; training keeps q, k, v and P (N, H, T, T)
    fn forward_many(&mut self, xs: Vec<Tensor>, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let shapes: Vec<&Shape> = xs.iter().map(|x| x.shape()).collect();
        let (n, g) = self.heads(&shapes)?;
        let [q, k, v]: [Tensor; 3] = xs.try_into().expect("three inputs, checked by heads");
        q.same_device(OP, &k)?;
        q.same_device(OP, &v)?;
        let (per, tt) = (g.h * g.t * g.d, g.t * g.t);
        let mut y = vec![0.0f32; n * per];
        let inputs = q.host().par_chunks(per).zip(k.host().par_chunks(per)).zip(v.host().par_chunks(per));
        let samples = y.par_chunks_mut(per).zip(inputs);
        if ctx.mode == Mode::Train {
            let probs = pieces(&mut self.probs, n, g.h * tt);
            par::for_each(samples.zip(probs), |((y, ((q, k), v)), p)| cpu::sdpa_forward(&g, q, k, v, y, p));
        } else {
            // Nothing is kept: each task's samples share one head's probabilities.
            par::for_each_init(
                samples,
                || vec![0.0f32; tt],
                |p, (y, ((q, k), v))| cpu::sdpa_forward(&g, q, k, v, y, p),
            );
        }
        let y = Tensor::from_vec_on(y, q.shape().clone(), q.device())?;
        self.saved = (ctx.mode == Mode::Train).then_some(Saved { q, k, v, heads: g });
        Ok(y)
    }

    fn backward(
        &mut self,
        _dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        _input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        merge_takes_several(OP, self.arity())
    }

    // dout: (N, H, T, D) → dq, dk, dv: (N, H, T, D), each where asked for
    fn backward_many(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dparams: ParamsMut<'_>,
        input_grads: &[InputGrad],
        _ctx: &Ctx,
    ) -> Result<Vec<Option<Tensor>>> {
        let Saved { q, k, v, heads: g } = self.saved.take().ok_or_else(|| {
            Error::config("ScaledDotProductAttention backward", "no training forward to differentiate")
        })?;
        q.same_device("ScaledDotProductAttention backward", &dout)?;
        if dout.shape() != q.shape() {
            return Err(Error::shape(
                "ScaledDotProductAttention backward",
                format!("dout {} for output {}", dout.shape(), q.shape()),
            ));
        }
        let &[gq, gk, gv] = input_grads else {
            return Err(Error::config(
                "ScaledDotProductAttention backward",
                format!("{} input gradients asked of its 3 inputs", input_grads.len()),
            ));
        };
        let (n, per) = (q.shape().batch(), g.h * g.t * g.d);
        let wanted = |want: InputGrad| (want == InputGrad::Needed).then(|| vec![0.0f32; n * per]);
        let (mut dq, mut dk, mut dv) = (wanted(gq), wanted(gk), wanted(gv));
        let grads: Vec<Grads<'_>> = samples_of(&mut dq, n, per)
            .into_iter()
            .zip(samples_of(&mut dk, n, per))
            .zip(samples_of(&mut dv, n, per))
            .map(|((dq, dk), dv)| Grads { dq, dk, dv })
            .collect();
        let dp = pieces(&mut self.dp, n, g.t * g.t);
        let saved = (q.host(), k.host(), v.host());
        let (probs, dy) = (&self.probs[..], dout.host());
        let work: Vec<_> = grads.into_iter().zip(dp).enumerate().collect();
        let htt = g.h * g.t * g.t;
        par::for_each(work.into_par_iter(), |(s, (grads, dp))| {
            let at = s * per..(s + 1) * per;
            let sample = (&saved.0[at.clone()], &saved.1[at.clone()], &saved.2[at.clone()]);
            cpu::sdpa_backward(&g, sample, &probs[s * htt..(s + 1) * htt], &dy[at], grads, dp);
        });
        let tensor = |x: Option<Vec<f32>>| x.map(|x| Tensor::from_vec_on(x, q.shape().clone(), q.device())).transpose();
        Ok(vec![tensor(dq)?, tensor(dk)?, tensor(dv)?])
    }

    /// All of q, k and v through transposes (H, T, D) ← (T, H, D) and y through one back,
    /// as a decoder's attention is written (`.transpose(1, 2)` on each side): the heads are
    /// then read and written where they lie, (T, H, D), a row of D every H·D values.
    fn take_head_transposes(&mut self, inputs: &[bool], output: bool) -> bool {
        self.positions_first = output && inputs == [true; 3];
        self.positions_first
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(ScaledDotProductAttention {
            mask: self.mask,
            scale: self.scale,
            ..ScaledDotProductAttention::new(self.mask)
        })
    }

    fn describe(&self) -> String {
        let mask = match self.mask {
            Mask::Causal => "causal",
            Mask::Full => "full",
        };
        match self.scale {
            Some(s) => format!("ScaledDotProductAttention({mask}, scale {s})"),
            None => format!("ScaledDotProductAttention({mask}, scale 1/√D)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::rng::SplitMix64;
    use crate::tensor::Device;

    fn uniform(len: usize, a: f32, seed: u64) -> Vec<f32> {
        let mut g = SplitMix64::new(seed);
        (0..len).map(|_| (g.next_f32() * 2.0 - 1.0) * a).collect()
    }

    fn train_ctx() -> Ctx<'static> {
        Ctx::train(11, 7, 1, Device::Cpu(0))
    }

    fn none() -> (Params<'static>, ParamsMut<'static>) {
        (Params::new(&[], &[]), ParamsMut::new(&mut [], &[]))
    }

    /// The forward of q, k, v (each `dims`) under `ctx`.
    fn forward(layer: &mut ScaledDotProductAttention, qkv: [&[f32]; 3], dims: [usize; 4], ctx: &Ctx) -> Vec<f32> {
        let xs = qkv.iter().map(|x| Tensor::from_vec(x.to_vec(), dims).unwrap()).collect();
        let (p, b) = none();
        layer.forward_many(xs, p, b, ctx).unwrap().into_vec()
    }

    /// A training forward, then the backward of dout with `wants` of the three inputs:
    /// (y, [dq, dk, dv]).
    fn forward_backward(
        layer: &mut ScaledDotProductAttention,
        qkv: [&[f32]; 3],
        dims: [usize; 4],
        dout: &[f32],
        wants: [InputGrad; 3],
    ) -> (Vec<f32>, [Option<Vec<f32>>; 3]) {
        let ctx = train_ctx();
        let y = forward(layer, qkv, dims, &ctx);
        let (p, dp) = none();
        let grads = layer.backward_many(Tensor::from_vec(dout.to_vec(), dims).unwrap(), p, dp, &wants, &ctx).unwrap();
        let [dq, dk, dv]: [Option<Tensor>; 3] = grads.try_into().unwrap();
        (y, [dq.map(Tensor::into_vec), dk.map(Tensor::into_vec), dv.map(Tensor::into_vec)])
    }

    const ALL: [InputGrad; 3] = [InputGrad::Needed; 3];

    /// scripts/torch_sdpa.py's inputs, (1, H 2, T 4, D 3) each, by the script's formulas
    /// (every value exact in f32): q, k, v, dy.
    fn case() -> [Vec<f32>; 4] {
        let n = 2 * 4 * 3;
        let f = |m: usize, r: usize, c: f32, s: f32| (0..n).map(|i| ((i * m % r) as f32 - c) / s).collect::<Vec<f32>>();
        [f(37, 23, 11.0, 8.0), f(29, 19, 9.0, 8.0), f(13, 17, 8.0, 4.0), f(11, 13, 6.0, 8.0)]
    }

    /// The output of scripts/torch_sdpa.py: per element (y, dq, dk, dv), each as float64
    /// evaluation rounded once to f32, then PyTorch's own float32.
    /// // torch 2.15.0+cu132
    // causal False, scale None: (y, torch_y, dq, torch_dq, dk, torch_dk, dv, torch_dv)
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)]
    const TORCH_FULL: &[[f32; 8]] = &[
        [-0.8218631744384766, -0.8218631148338318, -0.28463855385780334, -0.28463852405548096, -0.6937838196754456, -0.6937838196754456, -0.36597806215286255, -0.36597806215286255],
        [0.3736998438835144, 0.3736998438835144, -0.08893390744924545, -0.08893392235040665, 0.16643382608890533, 0.16643384099006653, 0.34217047691345215, 0.34217044711112976],
        [-0.2990443706512451, -0.2990443706512451, -0.28463855385780334, -0.28463852405548096, -0.17161479592323303, -0.17161478102207184, 0.09413769841194153, 0.09413770586252213],
        [-0.2151307463645935, -0.21513071656227112, 0.012698668986558914, 0.012698659673333168, 0.007023017853498459, 0.007023013662546873, -0.16123263537883759, -0.16123263537883759],
        [-0.03979833796620369, -0.0397983193397522, 0.07837361842393875, 0.07837362587451935, 0.09792468696832657, 0.09792470186948776, 0.29835939407348633, 0.29835939407348633],
        [-0.0039138528518378735, -0.003913843538612127, 0.012698668986558914, 0.012698664329946041, 0.07507926970720291, 0.07507925480604172, 0.02463928982615471, 0.024639278650283813],
        [0.43354958295822144, 0.43354958295822144, -0.12624071538448334, -0.12624070048332214, 0.6331140398979187, 0.6331139802932739, -0.2605923116207123, -0.2605922818183899],
        [-0.26123154163360596, -0.26123151183128357, -0.0075845313258469105, -0.007584524340927601, -0.17021498084068298, -0.17021499574184418, 0.25605857372283936, 0.25605857372283936],
        [0.3294059634208679, 0.3294059932231903, -0.12624071538448334, -0.12624070048332214, 0.13145311176776886, 0.13145314157009125, 0.053069986402988434, 0.05306997895240784],
        [0.13080884516239166, 0.13080887496471405, 0.05734134465456009, 0.05734134837985039, 0.05364680662751198, 0.053646814078092575, -0.2121969759464264, -0.2121969759464264],
        [-0.3287483751773834, -0.3287484049797058, 0.05734134465456009, 0.05734134465456009, -0.09414353221654892, -0.09414353966712952, 0.35341158509254456, 0.35341158509254456],
        [0.3707156479358673, 0.3707156777381897, 0.05734134465456009, 0.05734134837985039, -0.03491760045289993, -0.03491760417819023, 0.07815302908420563, 0.07815302163362503],
        [-0.9767137169837952, -0.9767137169837952, -0.08657751977443695, -0.08657751232385635, 0.09951886534690857, 0.09951884299516678, -0.0617554597556591, -0.06175544857978821],
        [1.207863688468933, 1.2078635692596436, 0.08748682588338852, 0.08748681098222733, 0.024553608149290085, 0.024553608149290085, -0.38260117173194885, -0.38260114192962646],
        [0.20786364376544952, 0.20786359906196594, -0.08657751977443695, -0.08657751232385635, -0.04320146143436432, -0.04320145398378372, 0.4189491868019104, 0.418949156999588],
        [-1.0967646837234497, -1.0967646837234497, 0.08672162890434265, 0.08672162890434265, -0.118152916431427, -0.1181529238820076, -0.08246075361967087, -0.08246073126792908],
        [1.3438060283660889, 1.3438060283660889, -0.0928189679980278, -0.0928189679980278, -0.020685404539108276, -0.020685402676463127, -0.26925989985466003, -0.26925987005233765],
        [0.3438059985637665, 0.3438059985637665, 0.08672162890434265, 0.08672162890434265, 0.07849057763814926, 0.07849058508872986, 0.3364521861076355, 0.3364521861076355],
        [-0.39674487709999084, -0.3967449367046356, -0.1644023060798645, -0.1644023060798645, -0.039263952523469925, -0.039263978600502014, 0.054074887186288834, 0.05407489091157913],
        [0.5316929817199707, 0.5316929817199707, 0.18253006041049957, 0.18253006041049957, -0.074289470911026, -0.0742894634604454, -0.12116456776857376, -0.12116456031799316],
        [-0.4683070480823517, -0.4683069884777069, -0.1644023060798645, -0.1644023060798645, -0.11765260249376297, -0.11765258014202118, 0.20610830187797546, 0.20610830187797546],
        [-0.47761765122413635, -0.47761765122413635, 0.06413205713033676, 0.06413204222917557, 0.05789799988269806, 0.05789799988269806, 0.09014132618904114, 0.09014133363962173],
        [0.8141399621963501, 0.8141399621963501, -0.15949693322181702, -0.15949691832065582, 0.0704212635755539, 0.0704212561249733, -0.22697435319423676, -0.22697433829307556],
        [-0.1858600527048111, -0.18586008250713348, 0.06413205713033676, 0.06413204222917557, 0.08236348628997803, 0.08236347883939743, 0.28849032521247864, 0.28849029541015625],
    ];
    // causal True, scale 0.3: (y, torch_y, dq, torch_dq, dk, torch_dk, dv, torch_dv)
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)]
    const TORCH_CAUSAL: &[[f32; 8]] = &[
        [-2.0, -2.0, 0.0, 0.0, 0.0691828727722168, 0.06918288767337799, -0.7793739438056946, -0.7793739438056946],
        [1.25, 1.25, 0.0, 0.0, -0.05990898236632347, -0.05990898609161377, 0.7279702425003052, 0.7279702425003052],
        [0.25, 0.25, 0.0, 0.0, 0.15436263382434845, 0.15436263382434845, 0.24735377728939056, 0.24735376238822937],
        [-1.3955004215240479, -1.3955005407333374, 0.006438378244638443, 0.006438374985009432, -0.011243021115660667, -0.011243018321692944, -0.1858886033296585, -0.18588858842849731],
        [-0.200798898935318, -0.200798898935318, -0.004682456608861685, -0.004682460334151983, 0.077061727643013, 0.077061727643013, 0.33456242084503174, 0.33456242084503174],
        [0.8544995188713074, 0.8544995784759521, 0.006438378244638443, 0.0064383759163320065, -0.07376328110694885, -0.07376328855752945, -0.0008466941653750837, -0.0008467063307762146],
        [-0.7167549729347229, -0.7167549133300781, -0.08724995702505112, -0.08724997192621231, -0.05793985351920128, -0.05793985724449158, -0.1130448505282402, -0.1130448430776596],
        [-0.7674732208251953, -0.7674732208251953, -0.011603932827711105, -0.01160393375903368, 0.04058744013309479, 0.040587447583675385, 0.1874673217535019, 0.1874673217535019],
        [0.47093018889427185, 0.4709302484989166, -0.08724995702505112, -0.08724996447563171, -0.11267723888158798, -0.11267725378274918, 0.08180029690265656, 0.08180029690265656],
        [0.02058195322751999, 0.02058195322751999, 0.029859187081456184, 0.02985919453203678, 0.0, 0.0, 0.0783073753118515, 0.0783073827624321],
        [-0.20292112231254578, -0.20292112231254578, 0.029859187081456184, 0.029859190806746483, -0.05774018540978432, -0.057740189135074615, 0.0, 0.0],
        [0.20533183217048645, 0.20533184707164764, 0.029859187081456184, 0.029859192669391632, 0.03207788243889809, 0.03207788243889809, -0.0783073753118515, -0.0783073827624321],
        [-1.25, -1.25, 0.0, 0.0, 0.11405720561742783, 0.11405722051858902, -0.24363262951374054, -0.24363262951374054],
        [2.0, 2.0, 0.0, 0.0, -0.004844502080231905, -0.004844501614570618, -0.8082418441772461, -0.8082418441772461],
        [1.0, 1.0, 0.0, 0.0, -0.037007227540016174, -0.03700723871588707, 0.7848024964332581, 0.7848024964332581],
        [-0.8603760600090027, -0.8603760600090027, 0.041483860462903976, 0.041483860462903976, -0.0701524168252945, -0.0701524093747139, 0.08299720287322998, 0.08299718797206879],
        [1.0649025440216064, 1.0649025440216064, -0.030170081183314323, -0.030170083045959473, 0.02083815634250641, 0.020838158205151558, -0.1415025293827057, -0.14150254428386688],
        [0.06490250676870346, 0.06490252166986465, 0.041483860462903976, 0.041483860462903976, 0.025089744478464127, 0.02508973889052868, 0.24135750532150269, 0.24135750532150269],
        [-0.036666907370090485, -0.03666691854596138, -0.044908083975315094, -0.044908083975315094, -0.010215840302407742, -0.010215835645794868, 0.021164294332265854, 0.02116428315639496],
        [0.3564271330833435, 0.3564271330833435, 0.1093379557132721, 0.10933796316385269, -0.02561906725168228, -0.02561906725168228, -0.11999117583036423, -0.11999119073152542],
        [-0.6435728669166565, -0.6435729265213013, -0.044908083975315094, -0.044908080250024796, -0.04102229326963425, -0.041022296994924545, 0.22383998334407806, 0.22383999824523926],
        [-0.4583747982978821, -0.4583747982978821, 0.02742578275501728, 0.02742578275501728, -0.033688951283693314, -0.033688951283693314, 0.1394711285829544, 0.1394711285829544],
        [0.7571141123771667, 0.7571141123771667, -0.07870866358280182, -0.07870866358280182, 0.00962541438639164, 0.00962541438639164, 0.0697355642914772, 0.0697355642914772],
        [-0.24288588762283325, -0.24288585782051086, 0.02742578275501728, 0.02742578275501728, 0.05293978005647659, 0.05293978005647659, 0.0, 0.0],
    ];
    /// Against both columns of each pair: within 1e-6 + 4e-6·|want| (a softmax of 4 terms
    /// of size ≤ 2, exponentials within 2 ulp, sums of 3 to 4 products: a few ulp of values
    /// of size ≤ 2, so about 1e-6 absolute where the gradients cancel to 0.01 and 4e-6
    /// relative elsewhere; PyTorch's own float32 rounds its steps in another order, its
    /// scale into q and k apart, and sits within the same bound).
    #[test]
    fn sdpa_matches_pytorch_causal_and_not() {
        let [q, k, v, dy] = case();
        let dims = [1, 2, 4, 3];
        let cases = [
            ("full, scale 1/√D", ScaledDotProductAttention::new(Mask::Full), TORCH_FULL),
            ("causal, scale 0.3", ScaledDotProductAttention::new(Mask::Causal).with_scale(0.3).unwrap(), TORCH_CAUSAL),
        ];
        for (name, mut layer, torch) in cases {
            let (y, [dq, dk, dv]) = forward_backward(&mut layer, [&q, &k, &v], dims, &dy, ALL);
            let got = [y, dq.unwrap(), dk.unwrap(), dv.unwrap()];
            for (i, row) in torch.iter().enumerate() {
                for (j, what) in ["y", "dq", "dk", "dv"].iter().enumerate() {
                    for (want, of) in [(row[2 * j], "float64"), (row[2 * j + 1], "PyTorch's float32")] {
                        let g = got[j][i];
                        let bound = 1e-6 + 4e-6 * want.abs();
                        assert!((g - want).abs() <= bound, "{name}: {what}[{i}] = {g}, {of} {want} (bound {bound:e})");
                    }
                }
            }
        }
    }

    /// Central differences of L = Σ w·y in every value of q, k and v against the backward,
    /// by forward_many and backward_many. L in f64 from the f32 forward; the step h = 1e-2 on
    /// values of size ≤ 1 leaves a truncation error h²/6·|L'''| ≈ 1e-5 and a rounding error
    /// of about 2^-24·Σ|w·y|/2h ≈ 1e-5 (causal self-attention's check's reasoning), inside
    /// |Δ| ≤ 1e-3 + 1e-2·max(|analytic|, |numeric|).
    fn gradcheck(mut layer: ScaledDotProductAttention, seed: u64) {
        let dims = [2, 2, 5, 3];
        let len = dims.iter().product();
        let inputs = [uniform(len, 1.0, seed), uniform(len, 1.0, seed + 1), uniform(len, 1.0, seed + 2)];
        let w = uniform(len, 1.0, seed + 3);
        let (_, grads) = forward_backward(&mut layer, [&inputs[0], &inputs[1], &inputs[2]], dims, &w, ALL);
        let ctx = train_ctx();
        let name = layer.describe();
        let mut loss = |xs: &[Vec<f32>; 3]| -> f64 {
            let y = forward(&mut layer, [&xs[0], &xs[1], &xs[2]], dims, &ctx);
            y.iter().zip(&w).map(|(y, w)| *y as f64 * *w as f64).sum()
        };
        let h = 1e-2f32;
        for (which, grad) in grads.iter().enumerate() {
            let grad = grad.as_ref().unwrap();
            for i in 0..len {
                let (mut plus, mut minus) = (inputs.clone(), inputs.clone());
                plus[which][i] += h;
                minus[which][i] -= h;
                let step = (plus[which][i] - minus[which][i]) as f64;
                let numeric = (loss(&plus) - loss(&minus)) / step;
                let analytic = grad[i] as f64;
                let bound = 1e-3 + 1e-2 * analytic.abs().max(numeric.abs());
                let d = ["dq", "dk", "dv"][which];
                assert!((analytic - numeric).abs() <= bound, "{name} {d}[{i}]: backward {analytic}, numeric {numeric}");
            }
        }
    }

    #[test]
    fn every_input_gradient_matches_central_differences() {
        gradcheck(ScaledDotProductAttention::new(Mask::Full), 1);
        gradcheck(ScaledDotProductAttention::new(Mask::Causal), 5);
        gradcheck(ScaledDotProductAttention::new(Mask::Causal).with_scale(1.5).unwrap(), 9);
    }

    #[test]
    fn a_gradient_nobody_asks_for_is_not_made_and_the_others_do_not_move() {
        let dims = [2, 3, 6, 4];
        let len = dims.iter().product();
        let (q, k, v, dy) =
            (uniform(len, 1.0, 20), uniform(len, 1.0, 21), uniform(len, 1.0, 22), uniform(len, 1.0, 23));
        let mut layer = ScaledDotProductAttention::new(Mask::Causal);
        let (_, all) = forward_backward(&mut layer, [&q, &k, &v], dims, &dy, ALL);
        let (n, s) = (InputGrad::Needed, InputGrad::Skip);
        for wants in [[s, n, n], [n, s, n], [n, n, s], [s, s, n], [n, s, s], [s, s, s]] {
            let (_, some) = forward_backward(&mut layer, [&q, &k, &v], dims, &dy, wants);
            for j in 0..3 {
                match wants[j] {
                    InputGrad::Skip => assert!(some[j].is_none(), "{wants:?}: gradient {j} made"),
                    InputGrad::Needed => assert_eq!(some[j], all[j], "{wants:?}: gradient {j}"),
                }
            }
        }
    }

    #[test]
    fn a_sample_is_bitwise_the_same_alone_in_a_batch_of_three_and_on_any_thread_count() {
        let (h, t, d) = (3, 9, 8);
        let per = h * t * d;
        let (q, k, v) = (uniform(3 * per, 1.0, 30), uniform(3 * per, 1.0, 31), uniform(3 * per, 1.0, 32));
        let dy = uniform(3 * per, 1.0, 33);
        let run = |threads: usize, range: std::ops::Range<usize>, mask: Mask| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let (a, b) = (range.start * per, range.end * per);
            let mut layer = ScaledDotProductAttention::new(mask);
            let dims = [range.len(), h, t, d];
            pool.install(|| forward_backward(&mut layer, [&q[a..b], &k[a..b], &v[a..b]], dims, &dy[a..b], ALL))
        };
        for mask in [Mask::Full, Mask::Causal] {
            let (y1, g1) = run(1, 1..2, mask);
            let (y3, g3) = run(1, 0..3, mask);
            assert_eq!(y1, y3[per..2 * per], "{mask:?}: the output of sample 1 alone vs in the batch");
            for j in 0..3 {
                assert_eq!(g1[j].as_deref(), g3[j].as_ref().map(|g| &g[per..2 * per]), "{mask:?}: gradient {j}");
            }
            assert_eq!(run(2, 0..3, mask), (y3.clone(), g3), "{mask:?}: 1 thread vs 2");
            // Evaluation computes the training output.
            let mut layer = ScaledDotProductAttention::new(mask);
            let eval = forward(&mut layer, [&q, &k, &v], [3, h, t, d], &Ctx::eval(Device::Cpu(0)));
            assert_eq!(eval, y3, "{mask:?}: evaluation");
        }
    }

    /// (N, A, B, D) → (N, B, A, D): the transpose of a sample's first two axes.
    fn swap(x: &[f32], [n, a, b, d]: [usize; 4]) -> Vec<f32> {
        let mut y = vec![0.0; x.len()];
        for s in 0..n {
            for i in 0..a {
                for j in 0..b {
                    let (from, to) = (((s * a + i) * b + j) * d, ((s * b + j) * a + i) * d);
                    y[to..to + d].copy_from_slice(&x[from..from + d]);
                }
            }
        }
        y
    }

    /// With the transposes around it taken over, the layer reads (N, T, H, D) and writes
    /// y and every gradient so: the values the transposes and the plain layer give, bit for
    /// bit, in training (every choice of gradients) and evaluation; only all four
    /// transposes are taken.
    #[test]
    fn the_transposes_taken_over_give_the_transposed_values_bit_for_bit() {
        let (n, h, t, d) = (3, 4, 7, 6);
        let per = n * h * t * d;
        let (q, k, v, dy) =
            (uniform(per, 1.0, 40), uniform(per, 1.0, 41), uniform(per, 1.0, 42), uniform(per, 1.0, 43));
        let (heads, positions) = ([n, h, t, d], [n, t, h, d]);
        for mask in [Mask::Full, Mask::Causal] {
            let mut taking = ScaledDotProductAttention::new(mask);
            assert!(!taking.take_head_transposes(&[true, true, false], true), "only all four");
            assert!(!taking.take_head_transposes(&[true; 3], false), "only all four");
            assert!(taking.take_head_transposes(&[true; 3], true));
            for wants in [
                ALL,
                [InputGrad::Skip, InputGrad::Needed, InputGrad::Skip],
                [InputGrad::Skip, InputGrad::Skip, InputGrad::Needed],
            ] {
                // The plain layer on (N, H, T, D) values, its results moved to (N, T, H, D).
                let mut plain = ScaledDotProductAttention::new(mask);
                let (y, grads) = forward_backward(&mut plain, [&q, &k, &v], heads, &dy, wants);
                let (q_, k_, v_, dy_) = (swap(&q, heads), swap(&k, heads), swap(&v, heads), swap(&dy, heads));
                let (y_, grads_) = forward_backward(&mut taking, [&q_, &k_, &v_], positions, &dy_, wants);
                assert_eq!(y_, swap(&y, heads), "{mask:?}: y");
                for j in 0..3 {
                    assert_eq!(
                        grads_[j],
                        grads[j].as_ref().map(|g| swap(g, heads)),
                        "{mask:?}: gradient {j}, {wants:?}"
                    );
                }
            }
            let eval = forward(
                &mut taking,
                [&swap(&q, heads), &swap(&k, heads), &swap(&v, heads)],
                positions,
                &Ctx::eval(Device::Cpu(0)),
            );
            let plain =
                forward(&mut ScaledDotProductAttention::new(mask), [&q, &k, &v], heads, &Ctx::eval(Device::Cpu(0)));
            assert_eq!(eval, swap(&plain, heads), "{mask:?}: evaluation");
        }
    }

    #[test]
    fn an_output_depends_on_no_later_key_when_causal_and_on_every_key_when_not() {
        let dims = [1, 2, 6, 4];
        let len = dims.iter().product();
        let (q, k, v) = (uniform(len, 1.0, 40), uniform(len, 1.0, 41), uniform(len, 1.0, 42));
        let ctx = train_ctx();
        for (mask, sees_later) in [(Mask::Causal, false), (Mask::Full, true)] {
            let mut layer = ScaledDotProductAttention::new(mask);
            let y = forward(&mut layer, [&q, &k, &v], dims, &ctx);
            // The last position's key and value changed in both heads.
            let (mut k2, mut v2) = (k.clone(), v.clone());
            for head in 0..2 {
                for at in (head * 24 + 20)..(head * 24 + 24) {
                    k2[at] = 3.0 - k2[at];
                    v2[at] = 2.0 * v2[at] + 1.0;
                }
            }
            let y2 = forward(&mut layer, [&q, &k2, &v2], dims, &ctx);
            for head in 0..2 {
                let rows = |y: &[f32]| y[head * 24..head * 24 + 20].to_vec();
                assert_eq!(rows(&y) != rows(&y2), sees_later, "{mask:?}: head {head}'s first five positions");
            }
        }
    }

    #[test]
    fn shapes_that_do_not_meet_are_refused_naming_the_three() {
        let mut layer = ScaledDotProductAttention::new(Mask::Full);
        let s = |d: &[usize]| Shape::new(d);
        let ok = s(&[2, 4, 8, 16]);
        let e = layer.output_shape_many(&[ok.clone(), ok.clone(), s(&[2, 4, 9, 16])]).unwrap_err().to_string();
        assert!(e.contains(OP) && e.contains("q (2, 4, 8, 16), k (2, 4, 8, 16), v (2, 4, 9, 16)"), "{e}");
        let e = layer.output_shape_many(&[ok.clone(), ok.clone()]).unwrap_err().to_string();
        assert!(e.contains("takes three inputs, q, k and v, given 2"), "{e}");
        let flat = s(&[2, 8, 16]);
        let e = layer.output_shape_many(&[flat.clone(), flat.clone(), flat]).unwrap_err().to_string();
        assert!(e.contains("expects q, k and v of heads (H, T, D)") && e.contains("(2, 8, 16)"), "{e}");
        assert_eq!(layer.output_shape_many(&[ok.clone(), ok.clone(), ok.clone()]).unwrap(), ok);
        // The forward refuses them too, and the one-input forms are a merge's refusal.
        let t = |d: [usize; 4]| Tensor::from_vec(vec![0.0; d.iter().product()], d).unwrap();
        let (p, b) = none();
        let e = layer.forward_many(vec![t([1, 2, 3, 4]), t([1, 2, 3, 4]), t([1, 2, 3, 5])], p, b, &train_ctx());
        assert!(e.unwrap_err().to_string().contains("v (1, 2, 3, 5)"));
        let (p, b) = none();
        let e = layer.forward(t([1, 2, 3, 4]), p, b, &train_ctx()).unwrap_err().to_string();
        assert!(e.contains("takes 3 inputs"), "{e}");
        assert!(ScaledDotProductAttention::new(Mask::Full).with_scale(0.0).is_err());
    }

    #[test]
    fn the_spec_entry_reads_its_fields_and_builds_a_merge() {
        use crate::spec::model_from_spec_str;
        let spec = |fields: &str| {
            format!(
                r#"{{"input_shape": [4, 8, 16], "layers": [{{"type": "scaled_dot_product_attention",
                    "inbound": ["input", "input", "input"]{fields}}}]}}"#
            )
        };
        let m = model_from_spec_str(&spec(""), "m.json").unwrap();
        let layer = &m.layers()[0];
        assert_eq!(layer.describe(), "ScaledDotProductAttention(full, scale 1/√D)");
        assert_eq!(layer.arity(), Arity::Exactly(3));
        let want = json!({"type": "scaled_dot_product_attention", "causal": false, "scale": null});
        assert_eq!(layer.spec().unwrap(), want);
        let m = model_from_spec_str(&spec(r#", "causal": true, "scale": 0.25"#), "m.json").unwrap();
        assert_eq!(m.layers()[0].describe(), "ScaledDotProductAttention(causal, scale 0.25)");
        // The memory account: q, k, v (3·H·T·D), P (H·T·T) and one (T, T), 4 bytes each.
        let mem = m.layers()[0].memory(&m.layer_shapes()[0]).unwrap();
        assert_eq!(mem.kept_per_sample, (3 * 4 * 8 * 16 + 4 * 8 * 8 + 8 * 8) * 4);
        for (fields, want) in [
            (r#", "scale": 0"#, "field 'scale' must be a positive number"),
            (r#", "causal": 1"#, "field 'causal' must be true or false"),
            (r#", "is_causal": true"#, "unknown field 'is_causal'"),
        ] {
            let e = model_from_spec_str(&spec(fields), "m.json").unwrap_err().to_string();
            assert!(e.contains(want), "{fields}: {e}");
        }
        // Two inputs, and three that do not meet: the keys transposed to (4, 16, 8).
        let two = r#"{"input_shape": [4, 8, 16], "layers": [
            {"type": "scaled_dot_product_attention", "inbound": ["input", "input"]}]}"#;
        let e = model_from_spec_str(two, "m.json").unwrap_err().to_string();
        assert!(e.contains("takes three inputs, q, k and v, given 2"), "{e}");
        let apart = r#"{"input_shape": [4, 8, 16], "layers": [
            {"type": "permute", "name": "kt", "dims": [1, 3, 2]},
            {"type": "scaled_dot_product_attention", "inbound": ["input", "kt", "input"]}]}"#;
        let e = model_from_spec_str(apart, "m.json").unwrap_err().to_string();
        assert!(e.contains("q (2, 4, 8, 16), k (2, 4, 16, 8), v (2, 4, 8, 16)"), "{e}");
    }

    /// Tokens per second of a forward and backward, on a pool of 2 threads, of: this op
    /// (q, k, v given, causal); the fused `CausalSelfAttention` of width C = H·D (its two
    /// projections and its heads' split and merge included); and this op with the fused
    /// op's two projections beside it (`Linear` C → 3C and C → C, forward and backward:
    /// what a graph of Linear, SDPA and Linear runs, less the heads' reshapes). N·T = 2048
    /// tokens a pass; the fastest of 20 passes after 3 (on a loaded machine the fastest is
    /// the least disturbed). `cargo test --release --lib sdpa_timing -- --ignored
    /// --nocapture`; scripts/torch_sdpa_bench.py times PyTorch's on the same shapes. A
    /// measurement, not a test: nothing is asserted.
    #[test]
    #[ignore]
    fn sdpa_timing() {
        use crate::ops::{CausalSelfAttention, Linear};
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let ctx = train_ctx();
        let best = |f: &mut dyn FnMut()| {
            let mut best = f64::INFINITY;
            for rep in 0..23 {
                let t0 = std::time::Instant::now();
                f();
                if rep >= 3 {
                    best = best.min(t0.elapsed().as_secs_f64());
                }
            }
            best
        };
        // A layer's parameters, U(−0.1, 0.1), and their ranges.
        let flat = |layer: &dyn Layer, seed: u64| {
            let (mut ranges, mut at) = (Vec::new(), 0);
            for s in layer.params() {
                ranges.push(at..at + s.shape.numel());
                at += s.shape.numel();
            }
            (uniform(at, 0.1, seed), ranges)
        };
        eprintln!("   T  H   D   N | sdpa tok/s | fused tok/s | sdpa+proj tok/s | sdpa/fused | (sdpa+proj)/fused");
        for t in [64, 128, 256] {
            for (h, d) in [(4, 32), (4, 64), (6, 32), (6, 64)] {
                let (n, c) = (2048 / t, h * d);
                let len = n * t * c;
                pool.install(|| {
                    let (q, k, v) = (uniform(len, 1.0, 1), uniform(len, 1.0, 2), uniform(len, 1.0, 3));
                    let dy = uniform(len, 1.0, 4);
                    let mut sdpa = ScaledDotProductAttention::new(Mask::Causal);
                    let t_sdpa = best(&mut || {
                        std::hint::black_box(forward_backward(&mut sdpa, [&q, &k, &v], [n, h, t, d], &dy, ALL));
                    });
                    let x = Tensor::from_vec(q.clone(), [n, t, c]).unwrap();
                    let pass = |layer: &mut dyn Layer, (w, ranges): &(Vec<f32>, Vec<std::ops::Range<usize>>)| {
                        let mut grads = vec![0.0f32; w.len()];
                        let p = Params::new(w, ranges);
                        let y = layer.forward(x.clone(), p, ParamsMut::new(&mut [], &[]), &ctx).unwrap();
                        let dout = Tensor::from_vec(vec![0.5; y.numel()], y.shape().clone()).unwrap();
                        let g = ParamsMut::new(&mut grads, ranges);
                        std::hint::black_box((y, layer.backward(dout, p, g, InputGrad::Needed, &ctx).unwrap()));
                    };
                    let mut fused = CausalSelfAttention::new(c, h).unwrap();
                    let fused_params = flat(&fused, 5);
                    let t_fused = best(&mut || pass(&mut fused, &fused_params));
                    let (mut qkv_proj, mut out_proj) = (Linear::new(c, 3 * c), Linear::new(c, c));
                    let (qkv_params, out_params) = (flat(&qkv_proj, 6), flat(&out_proj, 7));
                    let t_proj = best(&mut || {
                        pass(&mut qkv_proj, &qkv_params);
                        pass(&mut out_proj, &out_params);
                    });
                    let tok = (n * t) as f64;
                    eprintln!(
                        "{t:4} {h:2} {d:3} {n:3} | {:10.0} | {:11.0} | {:15.0} | {:10.2} | {:17.2}",
                        tok / t_sdpa,
                        tok / t_fused,
                        tok / (t_sdpa + t_proj),
                        t_fused / t_sdpa,
                        t_fused / (t_sdpa + t_proj)
                    );
                });
            }
        }
    }
}
