//! Text from a language model: nanoGPT's `generate` (its `model.py`), one token at a
//! time, each drawn from the softmax of the last position's logits divided by the
//! temperature, kept to the top k; the window the model sees is the last `context` tokens
//! (nanoGPT crops so). Runs on the host, in evaluation mode (no dropout).
//!
//! Owns: the sampling loop and its randomness: token i is drawn by one uniform of the
//! stream keyed by (seed, `purpose::GENERATE`, i), so a seed gives the same text on any
//! machine.

use crate::error::{Error, Result};
use crate::nn::{Ctx, ParamStore, Sequential};
use crate::rng::{derive_key, purpose, SplitMix64};
use crate::tensor::{Device, Tensor};

/// How the tokens are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Tokens to draw.
    pub tokens: usize,
    /// The logits are divided by it: below 1 sharpens, above 1 flattens; must be > 0.
    pub temperature: f32,
    /// Only the k most likely tokens are drawn from (None: all).
    pub top_k: Option<usize>,
    pub seed: u64,
}

/// The `sampling.tokens` tokens `model` (input (T) ids, output (T, V) logits) continues
/// `prompt` with, `context` the longest window it takes. `prompt` must not be empty and
/// every id must be below the vocabulary V.
pub fn generate(
    model: &mut Sequential,
    weights: &ParamStore,
    prompt: &[u32],
    context: usize,
    sampling: &Sampling,
) -> Result<Vec<u32>> {
    let vocab = *model.output_shape().dims().last().unwrap_or(&0);
    if prompt.is_empty() {
        return Err(Error::config("prompt", "needs at least one token"));
    }
    if let Some(&t) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::config("prompt", format!("token id {t} is at or above the vocabulary of {vocab}")));
    }
    if !(sampling.temperature > 0.0 && sampling.temperature.is_finite()) {
        return Err(Error::config("temperature", format!("must be a positive number, got {}", sampling.temperature)));
    }
    if let Some(k) = sampling.top_k {
        if k == 0 || k > vocab {
            return Err(Error::config("top-k", format!("must be in 1..={vocab} (the vocabulary), got {k}")));
        }
    }
    let mut ids: Vec<u32> = prompt.to_vec();
    let mut out = Vec::with_capacity(sampling.tokens);
    let mut scratch = weights.buffers.clone();
    for i in 0..sampling.tokens {
        let window = &ids[ids.len().saturating_sub(context)..];
        let x = Tensor::from_vec(window.iter().map(|&t| t as f32).collect(), [1, window.len()])?;
        let logits = model.forward(x, &weights.params, &mut scratch, &Ctx::eval(Device::Cpu(0)))?;
        let last = &logits.host()[(window.len() - 1) * vocab..window.len() * vocab];
        let key = derive_key(sampling.seed, &[purpose::GENERATE, i as u64]);
        let token = draw(last, sampling.temperature, sampling.top_k, SplitMix64::new(key).next_f64());
        ids.push(token);
        out.push(token);
    }
    Ok(out)
}

/// The token that `u` (uniform in [0, 1)) picks from softmax(logits / temperature) over
/// the `top_k` largest logits (ties: the lower id first), in f64.
fn draw(logits: &[f32], temperature: f32, top_k: Option<usize>, u: f64) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    order.truncate(top_k.unwrap_or(logits.len()));
    let max = f64::from(logits[order[0]]) / f64::from(temperature);
    let weights: Vec<f64> =
        order.iter().map(|&j| (f64::from(logits[j]) / f64::from(temperature) - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    for (&j, w) in order.iter().zip(&weights) {
        acc += w / total;
        if u < acc {
            return j as u32;
        }
    }
    *order.last().expect("at least one token") as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_draw_follows_the_tempered_top_k_softmax() {
        let logits = [0.0f32, 2.0, 1.0, -5.0];
        // Top 1: always the arg-max.
        assert!((0..10).all(|i| draw(&logits, 1.0, Some(1), i as f64 / 10.0) == 1));
        // Top 2 at temperature 1: p(1) = e²/(e² + e) = 0.731.
        assert_eq!(draw(&logits, 1.0, Some(2), 0.73), 1);
        assert_eq!(draw(&logits, 1.0, Some(2), 0.74), 2);
        // A low temperature is nearly the arg-max; every id is reachable without top-k.
        assert_eq!(draw(&logits, 0.01, None, 0.999_999), 1);
        assert_eq!(draw(&logits, 1.0, None, 0.999_999_9), 3);
    }
}
