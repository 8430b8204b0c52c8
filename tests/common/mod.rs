//! Test support shared by the GPU tests (cuda_ops.rs, cuda_train.rs, oracle.rs) and the
//! host-run kernel tests (kernels_host.rs): the skip check for a missing GPU, the input
//! generator, the f64 comparison, and the host references that both kernel tests hold
//! the CUDA kernels to (the bias gradient, im2col/col2im, BatchNorm with its inputs,
//! softmax cross-entropy, the dropout mask).
//!
//! One copy of each, so that the kernels meet the same reference whether they run on a
//! GPU or on the host. What only one test file needs stays in that file: the GPU and
//! host launch harnesses, the bitwise comparison, the optimiser references (cuda_ops.rs
//! writes its own, kernels_host.rs asks the CPU optimiser). References are computed in
//! f64 from the same f32 inputs; tolerances stay with the tests that state them.
//!
//! Each test file uses only part of this module (the training tests just `gpu_present`),
//! hence the `dead_code` allowance, as usual for tests/common.

#![allow(dead_code)]

use std::io::Write;

use lockstep::cuda::launch::{ConvGeom, DropoutKey};
use lockstep::rng::mix64;

// ---- skipping without a GPU ----------------------------------------------------------

/// True where a CUDA GPU can be used; otherwise says loudly that `test` is skipped.
pub fn gpu_present(test: &str) -> bool {
    let why = match lockstep::cuda::probe::gpu_count() {
        Ok(n) if n > 0 => return true,
        Ok(_) => "no CUDA GPU".to_string(),
        Err(e) => format!("no CUDA driver ({e})"),
    };
    // Written to the stderr handle, not eprintln!, so the harness does not swallow it.
    let _ = writeln!(std::io::stderr(), "{test}: skipped: {why}");
    false
}

// ---- inputs and comparisons ----------------------------------------------------------

/// SplitMix64, for test inputs only.
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

/// |got - want| <= atol + rtol * |want| per element, against an f64 reference.
#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= atol + rtol * w.abs(),
            "{what}[{i}]: got {g}, want {w} (|err| {err:e} > {atol:e} + {rtol:e}*|want|)"
        );
    }
}

pub fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

// Elementwise results are one or two float ops: 1e-6 relative covers f32 rounding of
// the reference's f64 result; sums of up to a few hundred terms get 1e-5.
pub const RTOL_ELEM: f64 = 1e-6;
pub const ATOL_ELEM: f64 = 1e-7;
pub const RTOL_SUM: f64 = 1e-5;
pub const ATOL_SUM: f64 = 1e-5;

// ---- elementwise.cu ------------------------------------------------------------------

/// The bias gradient of an (N, C, HW) output in f64, accumulated: dbias0[c] plus the sum
/// of dy over N and HW. dy: (N, C, HW); dbias0: (C).
pub fn bias_nchw_bwd_ref(dy: &[f32], dbias0: &[f32], (n, c, hw): (usize, usize, usize)) -> Vec<f64> {
    (0..c)
        .map(|ch| {
            dbias0[ch] as f64
                + (0..n)
                    .flat_map(|s| (0..hw).map(move |p| (s, p)))
                    .map(|(s, p)| dy[(s * c + ch) * hw + p] as f64)
                    .sum::<f64>()
        })
        .collect()
}

// ---- conv.cu -------------------------------------------------------------------------

/// Every (col index, x index) pair of im2col in the CPU layout, with strides that may
/// differ per axis (the CPU backend has one stride):
///   col[n][(c*KH + kh)*KW + kw][oh*OW + ow] = x[n, c, oh*SH - PT + kh, ow*SW - PL + kw],
/// in the order (n, row, oh, ow); a position in the padding has no pair.
/// x: (N, C, H, W); col: (N, C*KH*KW, OH*OW).
fn im2col_pairs(g: &ConvGeom) -> Vec<(usize, usize)> {
    let (oh, ow) = (g.oh(), g.ow());
    let rows = g.c * g.kh * g.kw;
    let mut pairs = Vec::with_capacity(g.col_len());
    for s in 0..g.n {
        for row in 0..rows {
            let (ch, ky, kx) = (row / (g.kh * g.kw), (row / g.kw) % g.kh, row % g.kw);
            for oy in 0..oh {
                for ox in 0..ow {
                    let y = (oy * g.stride_h + ky) as isize - g.pad_top as isize;
                    let xx = (ox * g.stride_w + kx) as isize - g.pad_left as isize;
                    if y >= 0 && (y as usize) < g.h && xx >= 0 && (xx as usize) < g.w {
                        pairs.push((
                            (s * rows + row) * oh * ow + oy * ow + ox,
                            ((s * g.c + ch) * g.h + y as usize) * g.w + xx as usize,
                        ));
                    }
                }
            }
        }
    }
    pairs
}

/// im2col: copies and zeros, so in f32 and exact.
/// x: (N, C, H, W); col: (N, C*KH*KW, OH*OW).
pub fn im2col_ref(x: &[f32], g: &ConvGeom) -> Vec<f32> {
    let mut col = vec![0.0; g.col_len()];
    for (ci, xi) in im2col_pairs(g) {
        col[ci] = x[xi];
    }
    col
}

/// col2im by scatter-add in f64: the transpose of im2col_ref, element by element.
/// dcol: (N, C*KH*KW, OH*OW); dx: (N, C, H, W).
pub fn col2im_ref(dcol: &[f32], g: &ConvGeom) -> Vec<f64> {
    let mut dx = vec![0.0; g.x_len()];
    for (ci, xi) in im2col_pairs(g) {
        dx[xi] += dcol[ci] as f64;
    }
    dx
}

// ---- batchnorm.cu --------------------------------------------------------------------

/// One BatchNorm training step's inputs, drawn at random; both the layer's parameters
/// are drawn, and each test says which of them the layer has.
pub struct BnInputs {
    /// (N, C, HW), as the `Gpu` methods take it.
    pub shape: (usize, usize, usize),
    /// x, dy: (N, C, HW).
    pub x: Vec<f32>,
    pub dy: Vec<f32>,
    /// gamma, beta: (C).
    pub gamma: Vec<f32>,
    pub beta: Vec<f32>,
    /// The running statistics before the step: (C) each.
    pub running_mean: Vec<f32>,
    pub running_var: Vec<f32>,
    /// The parameter gradients before the step, (C) each: backward accumulates into them.
    pub dgamma: Vec<f32>,
    pub dbeta: Vec<f32>,
}

/// What one training step must produce, in f64.
pub struct BnWant {
    /// y, dx: (N, C, HW).
    pub y: Vec<f64>,
    pub dx: Vec<f64>,
    /// The rest: (C) each.
    pub running_mean: Vec<f64>,
    pub running_var: Vec<f64>,
    pub save_mean: Vec<f64>,
    pub save_invstd: Vec<f64>,
    /// The old gradient plus this step's where the layer has the parameter; the old one,
    /// untouched, where it has not.
    pub dgamma: Vec<f64>,
    pub dbeta: Vec<f64>,
}

impl BnInputs {
    /// x in [-1.5, 2.5), gamma and the running variance in [0.5, 1.5), the rest in
    /// [-1, 1), drawn in the order of the fields (the tests' inputs depend on it).
    pub fn random(rng: &mut Rng, shape: (usize, usize, usize)) -> BnInputs {
        let (n, c, hw) = shape;
        let x: Vec<f32> = rng.vec(n * c * hw).iter().map(|v| 2.0 * v + 0.5).collect();
        let dy = rng.vec(n * c * hw);
        let gamma: Vec<f32> = rng.vec(c).iter().map(|v| 1.0 + 0.5 * v).collect();
        let beta = rng.vec(c);
        let (rm0, rv0): (Vec<f32>, Vec<f32>) = (rng.vec(c), rng.vec(c).iter().map(|v| 1.0 + 0.5 * v).collect());
        let (dgamma0, dbeta0) = (rng.vec(c), rng.vec(c));
        BnInputs { shape, x, dy, gamma, beta, running_mean: rm0, running_var: rv0, dgamma: dgamma0, dbeta: dbeta0 }
    }

    /// The training forward and backward, per channel in f64, for a layer with gamma
    /// and beta where `with_gamma` and `with_beta` say so (else gamma = 1, beta = 0):
    /// the biased variance normalises, the unbiased one (the biased one when M = N*HW is
    /// 1) feeds running_var. M must be at least 1.
    pub fn train_ref(&self, with_gamma: bool, with_beta: bool, momentum: f32, eps: f32) -> BnWant {
        let (n, c, hw) = self.shape;
        let (x, dy, gamma, beta) = (&self.x, &self.dy, &self.gamma, &self.beta);
        let total = n * c * hw;
        let m = (n * hw) as f64;
        let at = |s: usize, ch: usize, p: usize| (s * c + ch) * hw + p;
        let (mut want_y, mut want_dx) = (vec![0.0; total], vec![0.0; total]);
        let (mut want_rm, mut want_rv, mut want_sm, mut want_si) =
            (vec![0.0; c], vec![0.0; c], vec![0.0; c], vec![0.0; c]);
        let (mut want_dg, mut want_db) = (f64s(&self.dgamma), f64s(&self.dbeta));
        for ch in 0..c {
            let idx: Vec<usize> = (0..n).flat_map(|s| (0..hw).map(move |p| at(s, ch, p))).collect();
            let mean = idx.iter().map(|&i| x[i] as f64).sum::<f64>() / m;
            let var = idx.iter().map(|&i| (x[i] as f64 - mean).powi(2)).sum::<f64>() / m;
            let invstd = 1.0 / (var + eps as f64).sqrt();
            let g = if with_gamma { gamma[ch] as f64 } else { 1.0 };
            let b = if with_beta { beta[ch] as f64 } else { 0.0 };
            for &i in &idx {
                want_y[i] = (x[i] as f64 - mean) * invstd * g + b;
            }
            let mo = momentum as f64;
            let unbiased = if m > 1.0 { var * m / (m - 1.0) } else { var };
            want_rm[ch] = mo * self.running_mean[ch] as f64 + (1.0 - mo) * mean;
            want_rv[ch] = mo * self.running_var[ch] as f64 + (1.0 - mo) * unbiased;
            (want_sm[ch], want_si[ch]) = (mean, invstd);
            let sum_dy: f64 = idx.iter().map(|&i| dy[i] as f64).sum();
            let sum_dyx: f64 = idx.iter().map(|&i| dy[i] as f64 * (x[i] as f64 - mean) * invstd).sum();
            for &i in &idx {
                let xhat = (x[i] as f64 - mean) * invstd;
                want_dx[i] = g * invstd / m * (m * dy[i] as f64 - sum_dy - xhat * sum_dyx);
            }
            if with_gamma {
                want_dg[ch] += sum_dyx;
            }
            if with_beta {
                want_db[ch] += sum_dy;
            }
        }
        BnWant {
            y: want_y,
            dx: want_dx,
            running_mean: want_rm,
            running_var: want_rv,
            save_mean: want_sm,
            save_invstd: want_si,
            dgamma: want_dg,
            dbeta: want_db,
        }
    }

    /// The eval forward in f64 with the given running statistics, (C) each, for a layer
    /// with gamma and beta as in [`BnInputs::train_ref`]. y: (N, C, HW).
    pub fn eval_ref(&self, with_gamma: bool, with_beta: bool, rm: &[f32], rv: &[f32], eps: f32) -> Vec<f64> {
        let (_, c, hw) = self.shape;
        let (x, gamma, beta) = (&self.x, &self.gamma, &self.beta);
        (0..x.len())
            .map(|i| {
                let ch = (i / hw) % c;
                let g = if with_gamma { gamma[ch] as f64 } else { 1.0 };
                let b = if with_beta { beta[ch] as f64 } else { 0.0 };
                (x[i] as f64 - rm[ch] as f64) / (rv[ch] as f64 + eps as f64).sqrt() * g + b
            })
            .collect()
    }
}

// ---- softmax_xent.cu -----------------------------------------------------------------

/// Softmax cross-entropy per sample, in f64: the loss lse(z) - z[label] and dlogits
/// softmax(z) - onehot(label), the row maximum subtracted before exp.
/// logits: (N, K); labels: (N); returns loss: (N) and dlogits: (N, K).
pub fn softmax_xent_ref(logits: &[f32], labels: &[u32], k: usize) -> (Vec<f64>, Vec<f64>) {
    let n = labels.len();
    let (mut want_loss, mut want_dl) = (vec![0.0; n], vec![0.0; n * k]);
    for s in 0..n {
        let z = f64s(&logits[s * k..(s + 1) * k]);
        let mx = z.iter().cloned().fold(f64::MIN, f64::max);
        let lse = z.iter().map(|v| (v - mx).exp()).sum::<f64>().ln() + mx;
        want_loss[s] = lse - z[labels[s] as usize];
        for j in 0..k {
            want_dl[s * k + j] = (z[j] - lse).exp() - if j == labels[s] as usize { 1.0 } else { 0.0 };
        }
    }
    (want_loss, want_dl)
}

// ---- dropout.cu ----------------------------------------------------------------------

/// dropout.cu's keep decision for element `idx` of a buffer whose first element is
/// `key.first` of its shard, as the CPU layer (`nn::Dropout`) computes it: the two must
/// agree bit for bit, so the tests ask the library rather than a copy.
pub fn dropout_keep(key: DropoutKey, idx: u64, rate: f32) -> bool {
    use lockstep::rng::{dropout_key, hash64, unit_f32};
    unit_f32(hash64(dropout_key(key.seed, key.step, key.replica, key.layer), key.first + idx)) >= rate
}
