//! The loss on the CPU: each row's softmax cross-entropy with PyTorch's label smoothing,
//! its gradient by the logits and whether the row's arg-max is its label, in one pass over
//! the row, as kernels/cross_entropy.cu computes them sample by sample (the reference it
//! is held to). The bookkeeping around it (the shapes, the labels' check, the metrics of a
//! batch) is `mod.rs`'s.
//!
//! The exponentials and each row's sum are `backend::simd`'s (within 2 ulp, 16 at a
//! time; the sum in its fixed order of 16 lanes).

use crate::backend::simd;

/// The target probability of the label's class and of every other class, for K classes
/// and label smoothing ε: ((1 − ε) + ε/K, ε/K); (1, 0) exactly for ε = 0.
pub fn targets(label_smoothing: f32, k: usize) -> (f32, f32) {
    let off = label_smoothing / k as f32;
    ((1.0 - label_smoothing) + off, off)
}

/// Softmax cross-entropy of each row with label smoothing ε:
/// `(1 − ε)·(lse − z[label]) + (ε/K)·Σ_c (lse − z[c])` (the row maximum subtracted before
/// the exponentials), ε = 0 the plain `lse − z[label]` bit for bit; the arg-max's first
/// maximum against the label; and, with `dlogits`, the gradient of the row's loss by its
/// logits, `softmax − ((1 − ε)·onehot + ε/K)`.
/// logits: (N, K), labels: (N) each below K → loss: (N), correct: (N) in {0, 1} and
/// dlogits: (N, K), all WRITTEN.
pub fn softmax_xent_forward(
    logits: &[f32],
    labels: &[u32],
    k: usize,
    label_smoothing: f32,
    loss: &mut [f32],
    correct: &mut [u32],
    mut dlogits: Option<&mut [f32]>,
) {
    let n = labels.len();
    assert!(logits.len() == n * k && loss.len() == n && correct.len() == n, "softmax_xent_forward: shapes");
    let eps = label_smoothing;
    let (on, off) = targets(eps, k);
    // Each row's e^(z − max): in its gradient's row when there is one, else here.
    let mut scratch = if dlogits.is_some() { Vec::new() } else { vec![0.0f32; k] };
    let outs = loss.iter_mut().zip(correct.iter_mut());
    for (i, ((row, &y), (l, ok))) in logits.chunks_exact(k).zip(labels).zip(outs).enumerate() {
        let (arg, max) = row.iter().enumerate().fold(
            (0, f32::NEG_INFINITY),
            |(a, mx), (j, &v)| {
                if v > mx {
                    (j, v)
                } else {
                    (a, mx)
                }
            },
        );
        let exps = match dlogits.as_deref_mut() {
            Some(d) => &mut d[i * k..(i + 1) * k],
            None => &mut scratch[..],
        };
        exps.copy_from_slice(row);
        let sum = simd::exp_sum(exps, 1.0, max);
        let lse = max + sum.ln();
        let nll = lse - row[y as usize];
        *l = match eps == 0.0 {
            true => nll,
            false => {
                // Σ_c −log p_c, class by class.
                let smooth: f32 = row.iter().map(|&v| lse - v).sum();
                (1.0 - eps) * nll + smooth * off
            }
        };
        *ok = u32::from(arg == y as usize);
        if let Some(d) = dlogits.as_deref_mut() {
            let inv = 1.0 / sum;
            for (j, dv) in d[i * k..(i + 1) * k].iter_mut().enumerate() {
                *dv = *dv * inv - if j == y as usize { on } else { off };
            }
        }
    }
}
