//! Softmax cross-entropy from logits, fused with its gradient, and accuracy; with
//! PyTorch's label smoothing ([`CrossEntropy`]).
//!
//! The trainer back-propagates the SUM of the per-sample losses of a shard (the all-reduce
//! sums, and the optimiser divides by the real global batch size), so the gradient
//! returned here is softmax − target per sample, with no 1/N: the target is the one-hot
//! label, or with label smoothing ε the mixture (1 − ε)·onehot + ε/K. A sequence model's
//! logits (N, T, K) carry a label per position: each position is a row, so the loss is
//! summed over every token of the shard and the trainer divides by the global batch's
//! token count (`train::step`), the mean over tokens PyTorch's `cross_entropy` takes.
//! The arithmetic is [`cpu`]'s (each row's loss, gradient and hit, in one pass);
//! kernels/cross_entropy.cu computes the same expressions with the GPU's `expf` ([`gpu`]'s
//! host check holds the two within 1e-5). Here: the metrics, the labels' check, the
//! shapes.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// What a batch contributed: summed, so that shards add up exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Metrics {
    /// Sum over samples of the loss: `−log softmax(logits)[label]`, or with label
    /// smoothing ε, `(1 − ε)·(−log p[label]) + ε·mean over classes of (−log p)`.
    pub loss_sum: f64,
    /// Samples whose arg-max logit is the label (ties: the first maximum).
    pub correct: u64,
    /// Samples seen.
    pub count: u64,
}

/// `loss 0.1819 accuracy 0.9363 (9363/10000)`: the mean loss, the accuracy, and the
/// samples it counts.
impl std::fmt::Display for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "loss {:.4} accuracy {:.4} ({}/{})", self.mean_loss(), self.accuracy(), self.correct, self.count)
    }
}

impl Metrics {
    /// Adds another batch's metrics.
    pub fn add(&mut self, other: &Metrics) {
        self.loss_sum += other.loss_sum;
        self.correct += other.correct;
        self.count += other.count;
    }

    /// Mean loss (NaN for no sample).
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.count as f64
    }

    /// Accuracy in [0, 1] (NaN for no sample).
    pub fn accuracy(&self) -> f64 {
        self.correct as f64 / self.count as f64
    }
}

/// (rows, classes) of logits (N, K), or (N, T, K) with a label per position (a sequence
/// model's, every position a row), and the labels' count checked against the rows.
fn check(logits: &Tensor, labels: &[u32]) -> Result<(usize, usize)> {
    let (n, k) = match *logits.shape().dims() {
        [n, k] => (n, k),
        [n, t, k] => (n * t, k),
        _ => {
            return Err(Error::shape(
                "softmax_cross_entropy",
                format!("expected (N, K) or (N, T, K), got {}", logits.shape()),
            ))
        }
    };
    if labels.len() != n {
        return Err(Error::shape(
            "softmax_cross_entropy",
            format!("{} labels for logits {}", labels.len(), logits.shape()),
        ));
    }
    check_labels(labels, k)?;
    Ok((n, k))
}

/// Every label must name one of the model's `classes` outputs. The one check of labels
/// for every backend: the GPU's loss kernel never indexes with a bad label, but would
/// give NaN for it, so the GPU replica checks its rows here before copying them.
pub fn check_labels(labels: &[u32], classes: usize) -> Result<()> {
    match labels.iter().find(|&&l| l as usize >= classes) {
        Some(&l) => Err(Error::shape("softmax_cross_entropy", format!("label {l} out of range for {classes} classes"))),
        None => Ok(()),
    }
}

/// Softmax cross-entropy with PyTorch's label smoothing:
/// `F.cross_entropy(logits, labels, label_smoothing=ε, reduction="sum")`, per sample
/// `(1 − ε)·(lse − z[label]) + (ε/K)·Σ_c (lse − z[c])`, whose gradient by the logits is
/// `softmax − ((1 − ε)·onehot + ε/K)`. ε = 0 ([`CrossEntropy::default`]) is plain
/// cross-entropy, bit for bit. Accuracy counts the arg-max against the label whatever ε.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CrossEntropy {
    /// ε, in [0, 1).
    pub label_smoothing: f32,
}

impl CrossEntropy {
    /// The loss with label smoothing `label_smoothing`, which must lie in [0, 1) (PyTorch
    /// refuses outside [0, 1]; ε = 1 would ignore the labels altogether).
    pub fn new(label_smoothing: f32) -> Result<CrossEntropy> {
        if !(0.0..1.0).contains(&label_smoothing) {
            return Err(Error::config("label smoothing", format!("must be in [0, 1), got {label_smoothing}")));
        }
        Ok(CrossEntropy { label_smoothing })
    }

    /// Metrics and the gradient of the SUMMED loss. logits: (N, K) → dlogits: (N, K)
    pub fn with_grad(&self, logits: &Tensor, labels: &[u32]) -> Result<(Metrics, Tensor)> {
        let mut d = vec![0.0f32; logits.numel()];
        let m = self.run(logits, labels, Some(&mut d))?;
        Ok((m, Tensor::from_vec_on(d, logits.shape().clone(), logits.device())?))
    }

    /// Metrics only (evaluation). logits: (N, K)
    pub fn score(&self, logits: &Tensor, labels: &[u32]) -> Result<Metrics> {
        self.run(logits, labels, None)
    }

    /// Loss, accuracy and, when `dlogits` is given, softmax − target written into it.
    /// logits: (N, K); labels: (N) with values < K; dlogits: (N·K)
    fn run(&self, logits: &Tensor, labels: &[u32], dlogits: Option<&mut [f32]>) -> Result<Metrics> {
        let (n, k) = check(logits, labels)?;
        let (mut loss, mut correct) = (vec![0.0f32; n], vec![0u32; n]);
        cpu::softmax_xent_forward(logits.host(), labels, k, self.label_smoothing, &mut loss, &mut correct, dlogits);
        // The losses summed in f64 row after row, from +0.
        Ok(Metrics {
            loss_sum: loss.iter().fold(0.0, |sum, &l| sum + l as f64),
            correct: correct.iter().map(|&c| u64::from(c)).sum(),
            count: n as u64,
        })
    }
}

/// Metrics and the gradient of the SUMMED plain cross-entropy. logits: (N, K) → dlogits: (N, K)
pub fn softmax_cross_entropy(logits: &Tensor, labels: &[u32]) -> Result<(Metrics, Tensor)> {
    CrossEntropy::default().with_grad(logits, labels)
}

/// Metrics of the plain cross-entropy only (evaluation). logits: (N, K)
pub fn score(logits: &Tensor, labels: &[u32]) -> Result<Metrics> {
    CrossEntropy::default().score(logits, labels)
}

/// Softmax of each row of `logits` (rows of `k` values), in place: class probabilities.
pub fn softmax_rows(mut logits: Vec<f32>, k: usize) -> Vec<f32> {
    for row in logits.chunks_exact_mut(k.max(1)) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = row
            .iter_mut()
            .map(|v| {
                *v = (*v - max).exp();
                *v
            })
            .sum();
        row.iter_mut().for_each(|v| *v /= sum);
    }
    logits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_and_gradient_match_hand_values() {
        // logits (1, 3) = [1, 2, 3], label 0:
        // softmax = e^[1,2,3] / (e + e² + e³) = [0.09003057, 0.24472847, 0.66524096]
        // loss = −ln 0.09003057 = 2.40760596; d = softmax − [1, 0, 0].
        let x = Tensor::from_vec(vec![1.0, 2.0, 3.0], [1, 3]).unwrap();
        let (m, d) = softmax_cross_entropy(&x, &[0]).unwrap();
        assert!((m.loss_sum - 2.407_605_96).abs() < 1e-6);
        assert_eq!(m.correct, 0);
        let want = [0.090_030_57 - 1.0, 0.244_728_47, 0.665_240_96];
        for (a, b) in d.host().iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        let m2 = score(&x, &[2]).unwrap();
        assert_eq!(m2.correct, 1);
    }

    #[test]
    fn large_logits_do_not_overflow() {
        let x = Tensor::from_vec(vec![1000.0, 0.0], [1, 2]).unwrap();
        let (m, d) = softmax_cross_entropy(&x, &[1]).unwrap();
        assert!((m.loss_sum - 1000.0).abs() < 1e-3);
        assert!(d.host().iter().all(|v| v.is_finite()));
    }

    #[test]
    fn label_out_of_range_is_an_error() {
        let x = Tensor::from_vec(vec![0.0; 4], [2, 2]).unwrap();
        let e = score(&x, &[0, 2]).unwrap_err().to_string();
        assert!(e.contains("label 2 out of range for 2 classes"), "{e}");
    }
}
