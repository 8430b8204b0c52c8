//! Scaled dot-product attention on the CPU: one sample's forward and backward over its
//! heads ([`sdpa_forward`], [`sdpa_backward`]), each head by the arithmetic causal
//! self-attention runs (`ops::attention::cpu`'s head functions: the same products on the
//! calling thread, the same softmax rows), here on (T, D) blocks of separate q, k and v
//! tensors instead of columns of fused qkv rows. The layer in `mod.rs` owns the rest: the
//! buffers kept from the forward, the samples' parallel loop, shapes and memory.
//!
//! Shapes: H heads, T positions, D the head width; one sample's q, k, v and y are
//! (H, T, D), head h the (T, D) block at h·T·D, or (T, H, D) where the layer took over the
//! transposes around it ([`Heads::positions_first`]), head h the T rows of D at h·D, H·D
//! apart: the same values, read and written where the transposes would have put them.
//! Its probabilities are (H, T, T).

use crate::backend::cpu::Mat;
use crate::ops::attention::cpu::{
    head_key_grad, head_mix, head_mix_backward, head_probs, head_query_grad, head_scores_backward, Mask, Out,
};

/// What every sample of a pass shares: the shape, the mask, the scale of the scores.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    pub h: usize,
    pub t: usize,
    pub d: usize,
    pub mask: Mask,
    pub scale: f32,
    /// Whether a sample's q, k, v, y and their gradients lie as (T, H, D) instead of
    /// (H, T, D).
    pub positions_first: bool,
}

impl Heads {
    /// Head `i`'s (T, D) rows of a sample's values.
    fn of<'a>(&self, x: &'a [f32], i: usize) -> Mat<'a> {
        let (t, d, h) = (self.t, self.d, self.h);
        match self.positions_first {
            false => Mat::rows(&x[i * t * d..(i + 1) * t * d], t, d),
            true => Mat { data: &x[i * d..], rows: t, cols: d, rs: h * d, cs: 1 },
        }
    }

    /// Head `i`'s (T, D) rows of a sample's output or gradient, and their row stride.
    fn out<'a>(&self, x: &'a mut [f32], i: usize) -> Out<'a> {
        let (t, d, h) = (self.t, self.d, self.h);
        match self.positions_first {
            false => (&mut x[i * t * d..(i + 1) * t * d], d),
            true => (&mut x[i * d..], h * d),
        }
    }
}

/// One sample's forward: q, k, v (H, T, D) → y (H, T, D), WRITTEN (each (T, H, D) where
/// `g.positions_first`); the probabilities
/// P = softmax(scale·q·kᵀ) under the mask written to `probs`: (H, T, T), kept for the
/// backward, or (T, T), one head's at a time, overwritten by the next (evaluation).
pub(crate) fn sdpa_forward(g: &Heads, q: &[f32], k: &[f32], v: &[f32], y: &mut [f32], probs: &mut [f32]) {
    let t = g.t;
    let one = probs.len() == t * t;
    for i in 0..g.h {
        let p = if one { &mut probs[..] } else { &mut probs[i * t * t..(i + 1) * t * t] };
        // P (T, T) = softmax(scale·q_h·k_hᵀ), y_h (T, D) = P·v_h
        head_probs(g.of(q, i), g.of(k, i), p, g.mask, g.scale);
        let (yh, rs) = g.out(y, i);
        head_mix(p, g.of(v, i), (yh, rs), g.mask);
    }
}

/// The gradients a backward writes, each laid out as the inputs, None where nobody reads
/// it.
pub(crate) struct Grads<'s> {
    pub dq: Option<&'s mut [f32]>,
    pub dk: Option<&'s mut [f32]>,
    pub dv: Option<&'s mut [f32]>,
}

/// One sample's backward from dy (H, T, D): its forward's q, k, v (H, T, D) and P
/// (H, T, T); WRITES dq, dk and dv where given; dp (T, T) is scratch. Each (T, H, D)
/// where `g.positions_first`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sdpa_backward(
    g: &Heads,
    (q, k, v): (&[f32], &[f32], &[f32]),
    probs: &[f32],
    dy: &[f32],
    grads: Grads<'_>,
    dp: &mut [f32],
) {
    let t = g.t;
    let Grads { mut dq, mut dk, mut dv } = grads;
    for (i, p) in probs.chunks_exact(t * t).enumerate() {
        // dv_h (T, D) = Pᵀ·dy_h, dP (T, T) = dy_h·v_hᵀ
        head_mix_backward(p, g.of(v, i), g.of(dy, i), head_out(g, &mut dv, i), dp, g.mask);
        if dq.is_none() && dk.is_none() {
            continue;
        }
        // dS = softmax'(dP); dq_h (T, D) = dS·k_h, dk_h (T, D) = dSᵀ·q_h
        head_scores_backward(p, dp, t, g.mask, g.scale);
        if let Some(out) = head_out(g, &mut dq, i) {
            head_query_grad(dp, g.of(k, i), out, g.mask);
        }
        if let Some(out) = head_out(g, &mut dk, i) {
            head_key_grad(dp, g.of(q, i), out, g.mask);
        }
    }
}

/// Head `i`'s rows of a gradient, and their row stride, where there is one.
fn head_out<'a>(g: &Heads, x: &'a mut Option<&mut [f32]>, i: usize) -> Option<Out<'a>> {
    x.as_deref_mut().map(|x| g.out(x, i))
}
