//! Text from a language model: nanoGPT's `generate` (its `model.py`), one token at a
//! time, each drawn from the softmax of the last position's logits divided by the
//! temperature, kept to the top k; the window the model sees is the last `context` tokens
//! (nanoGPT crops so). Runs on the host, in evaluation mode (no dropout).
//!
//! Owns: the sampling loop and its randomness: token i is drawn by one uniform of the
//! stream keyed by (seed, `purpose::GENERATE`, i), so a seed gives the same text on any
//! machine. Each token is handed to the caller as it is drawn ([`generate`]: the
//! command line prints it at once), and only the window the model sees is kept, so a
//! long generation holds what a short one holds; a run is at most [`MAX_TOKENS`].

use crate::error::{Error, Result};
use crate::nn::{Ctx, Graph, ParamStore};
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

/// The most tokens one call draws: at each a forward pass over the whole window (no
/// cache of keys and values), so a million is hours of a small GPT on a CPU, and a
/// count past it is a mistake (a `--tokens` of 10^11 would run for years).
pub const MAX_TOKENS: usize = 1_000_000;

/// Draws the `sampling.tokens` tokens `model` (input (T) ids, output (T, V) logits)
/// continues `prompt` with, `context` the longest window it takes, handing each to `each`
/// as soon as it is drawn (an error from `each` stops the generation and is returned).
/// `prompt` must not be empty and every id must be below the vocabulary V.
pub fn generate(
    model: &mut Graph,
    weights: &ParamStore,
    prompt: &[u32],
    context: usize,
    sampling: &Sampling,
    mut each: impl FnMut(u32) -> Result<()>,
) -> Result<()> {
    if sampling.tokens > MAX_TOKENS {
        return Err(Error::config(
            "tokens",
            format!("{} is more than {MAX_TOKENS}, the most one generation draws", sampling.tokens),
        ));
    }
    if context == 0 {
        return Err(Error::config("context", "a window needs at least one token"));
    }
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
    // The window the model sees: the last `context` ids (the prompt's, then the drawn),
    // cut back to them whenever it reaches twice as many, so memory stays O(context).
    let mut ids: Vec<u32> = prompt[prompt.len().saturating_sub(context)..].to_vec();
    let mut scratch = weights.buffers.clone();
    for i in 0..sampling.tokens {
        let window = &ids[ids.len().saturating_sub(context)..];
        let x = Tensor::from_vec(window.iter().map(|&t| t as f32).collect(), [1, window.len()])?;
        let logits = model.forward(x, &weights.params, &mut scratch, &Ctx::eval(Device::Cpu(0)))?;
        let last = &logits.host()[(window.len() - 1) * vocab..window.len() * vocab];
        let key = derive_key(sampling.seed, &[purpose::GENERATE, i as u64]);
        let token = draw(last, sampling.temperature, sampling.top_k, SplitMix64::new(key).next_f64());
        if ids.len() >= 2 * context {
            ids.drain(..ids.len() - context);
        }
        ids.push(token);
        each(token)?;
    }
    Ok(())
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

    fn tiny_gpt() -> (Graph, ParamStore) {
        let config = crate::models::GptConfig { context: 4, vocab: 16, layers: 1, heads: 2, width: 8, dropout: 0.0 };
        let model = crate::models::gpt(config).unwrap();
        let weights = model.init(7);
        (model, weights)
    }

    /// Issue 41: the generation kept every token (and reserved room for `--tokens` of them
    /// at once, a capacity overflow at 2^64 − 1). It keeps the window, cut back at twice
    /// the context, and draws what keeping every id draws: the reference is the loop as it
    /// was, over the whole history. 40 tokens of a context of 4 cut the window ten times.
    #[test]
    fn a_long_generation_keeps_only_its_window_and_draws_what_the_whole_history_draws() {
        let (mut model, weights) = tiny_gpt();
        let sampling = Sampling { tokens: 40, temperature: 1.0, top_k: None, seed: 3 };
        let prompt = [1, 2, 3, 4, 5, 6];
        let mut got = Vec::new();
        generate(&mut model, &weights, &prompt, 4, &sampling, |t| {
            got.push(t);
            Ok(())
        })
        .unwrap();
        let (mut ids, mut want, mut scratch) = (prompt.to_vec(), Vec::new(), weights.buffers.clone());
        for i in 0..40 {
            let window = &ids[ids.len() - 4..];
            let x = Tensor::from_vec(window.iter().map(|&t| t as f32).collect(), [1, 4]).unwrap();
            let logits = model.forward(x, &weights.params, &mut scratch, &Ctx::eval(Device::Cpu(0))).unwrap();
            let key = derive_key(3, &[purpose::GENERATE, i as u64]);
            let token = draw(&logits.host()[3 * 16..4 * 16], 1.0, None, SplitMix64::new(key).next_f64());
            ids.push(token);
            want.push(token);
        }
        assert_eq!(got, want);
        // Temperature 1 over a random model's logits: not one token over and over.
        assert!(got.iter().collect::<std::collections::BTreeSet<_>>().len() > 3, "{got:?}");
    }

    #[test]
    fn more_tokens_than_the_bound_are_refused_and_a_callers_error_stops_the_drawing() {
        let (mut model, weights) = tiny_gpt();
        let mut calls = 0;
        let too_many = Sampling { tokens: MAX_TOKENS + 1, temperature: 1.0, top_k: None, seed: 0 };
        let e = generate(&mut model, &weights, &[1], 4, &too_many, |_| {
            calls += 1;
            Ok(())
        })
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            Error::config("tokens", "1000001 is more than 1000000, the most one generation draws").to_string()
        );
        assert_eq!(calls, 0);
        let three = Sampling { tokens: 10, ..too_many };
        let e = generate(&mut model, &weights, &[1], 4, &three, |_| {
            calls += 1;
            if calls == 3 {
                return Err(Error::config("stdout", "closed"));
            }
            Ok(())
        });
        assert!(e.is_err());
        assert_eq!(calls, 3, "the third token's error stops the drawing");
    }
}
