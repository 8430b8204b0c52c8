//! Test support shared by the GPU tests (cuda_ops.rs, cuda_train.rs, oracle.rs), the
//! host-run kernel tests (kernels_host.rs) and the 16-bit exchange tests
//! (grad_compression.rs): the skip check for a missing GPU, the input generator, the f64
//! comparison, and the host references that both kernel tests hold the CUDA kernels to
//! (the bias gradient, im2col/col2im, BatchNorm with its inputs, the dropout mask; the
//! 16-bit codec's slots and exchange for the GPU training tests, and the synchronized
//! BatchNorm layer run on the CPU, which the GPU exchange and the synchronized BatchNorm
//! kernels must equal bit for bit).
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

use lockstep::exchange::codec::Codec;
use lockstep::exchange::shm::ShmGroup;
use lockstep::exchange::{Exchange, Wait};
use lockstep::ops::batchnorm::RunningUpdate;
use lockstep::ops::dropout::gpu::DropoutKey;
use lockstep::ops::window::WindowGeom;
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
fn im2col_pairs(g: &WindowGeom) -> Vec<(usize, usize)> {
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
pub fn im2col_ref(x: &[f32], g: &WindowGeom) -> Vec<f32> {
    let mut col = vec![0.0; g.col_len()];
    for (ci, xi) in im2col_pairs(g) {
        col[ci] = x[xi];
    }
    col
}

/// col2im by scatter-add in f64: the transpose of im2col_ref, element by element.
/// dcol: (N, C*KH*KW, OH*OW); dx: (N, C, H, W).
pub fn col2im_ref(dcol: &[f32], g: &WindowGeom) -> Vec<f64> {
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

// ---- dropout.cu ----------------------------------------------------------------------

/// dropout.cu's keep decision for element `idx` of a buffer whose first element is
/// `key.first` of its shard, as the CPU layer (`nn::Dropout`) computes it: the two must
/// agree bit for bit, so the tests ask the library rather than a copy.
pub fn dropout_keep(key: DropoutKey, idx: u64, rate: f32) -> bool {
    use lockstep::rng::{dropout_key, hash64, unit_f32};
    unit_f32(hash64(dropout_key(key.seed, key.step, key.shard, key.layer), key.first + idx)) >= rate
}

// ---- codec.cu and synchronized BatchNorm: the CPU's own code as the reference ----------

/// One slot of a codec check: `encoded` values in blocks of 1,024 of their own
/// magnitude (2^-140, subnormal all through, up to 2^127, near f32's largest), specials in
/// two of them — NaNs of either sign with quiet and signalling payloads, ±∞, ±0, f32
/// subnormals, f32::MAX, exact bf16 ties (low half 0x8000) — then `raw` f32 values (slot
/// s scaled by 2^(8s), so that the order of their sum shows) with a NaN, an ∞ and
/// subnormals among them.
pub fn codec_slot(rng: &mut Rng, s: usize, encoded: usize, raw: usize) -> Vec<f32> {
    let magnitudes = [-140, -60, -10, 0, 20, 100, 126];
    let mut v: Vec<f32> = (0..encoded)
        .map(|i| {
            let e = magnitudes[(i / 1024) % magnitudes.len()];
            rng.uniform() * 2f32.powi(e.max(-126)) * if e < -126 { 2f32.powi(e + 126) } else { 1.0 }
        })
        .collect();
    let specials = [
        f32::from_bits(0x7FC0_1234),
        f32::from_bits(0xFFC0_0001),
        f32::from_bits(0x7F80_0001), // signalling
        f32::from_bits(0xFFA5_5A5A), // signalling, negative
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        f32::from_bits(1),
        -f32::from_bits(0x007F_FFFF),
        f32::MAX,
        -f32::MAX,
    ];
    for (k, x) in specials.iter().enumerate() {
        // Block 2 (magnitude 2^-10) and block 4 (2^20), a few positions per slot.
        v[2 * 1024 + 37 * k + s] = *x;
        v[4 * 1024 + 53 * k + 2 * s] = *x;
    }
    for k in 0..64 {
        // Exact bf16 ties in block 3 (magnitude 1): round to the even code.
        let i = 3 * 1024 + 16 * k + s;
        v[i] = f32::from_bits((v[i].to_bits() & 0xFFFF_0000) | 0x8000);
    }
    let mut tail: Vec<f32> = (0..raw).map(|_| rng.uniform() * 2f32.powi(8 * s as i32)).collect();
    // A sum whose order shows: (1 + 2^-24) + (2^-24 + 2^-24) = 1 + 2^-23 in the tree, 1
    // left to right (each 2^-24 a tie that rounds to even, 1).
    tail[0] = [1.0, 2f32.powi(-24), 2f32.powi(-24), 2f32.powi(-24), 0.0][s % 5];
    tail[3] = f32::NAN;
    tail[5 + s] = f32::INFINITY;
    tail[11] = f32::from_bits(3 + s as u32);
    v.extend(tail);
    v
}

/// Every member's sum of `slots` through the shared-memory exchange with `codec`, on
/// `members` members (each running its share of the logical replicas).
pub fn shm_exchange(members: usize, codec: Codec, slots: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let (shards, len) = (slots.len(), slots[0].len());
    let group = ShmGroup::with_codec(members, shards, len, Wait::Park, Some(codec)).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..members)
            .map(|d| {
                let group = &group;
                s.spawn(move || {
                    let mut me = group.member(d);
                    let per = shards / members;
                    for j in 0..per {
                        me.with_slot(j, |slot| slot.copy_from_slice(&slots[d * per + j]));
                    }
                    me.sum().unwrap();
                    let mut out = vec![f32::NAN; len];
                    me.for_each_sum(|off, piece| {
                        out[off..off + piece.len()].copy_from_slice(piece);
                        Ok(())
                    })
                    .unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A layer that adds its parameter (−0.0, the exact identity of addition) to its input
/// and whose gradient is dout: in front of a BatchNorm it makes the BatchNorm compute
/// its input gradient (a Sequential's first trained layer skips it) and hands it over
/// exactly (−0.0 + d = d).
#[derive(Clone)]
pub struct InputProbe {
    pub numel: usize,
}

impl lockstep::nn::Layer for InputProbe {
    fn kind(&self) -> &'static str {
        "probe"
    }

    fn output_shape(&self, input: &lockstep::Shape) -> lockstep::Result<lockstep::Shape> {
        Ok(input.clone())
    }

    fn params(&self) -> Vec<lockstep::nn::ParamSpec> {
        vec![lockstep::nn::ParamSpec {
            name: "x".into(),
            shape: lockstep::Shape::new([self.numel]),
            init: lockstep::nn::Init::Zeros,
        }]
    }

    fn forward(
        &mut self,
        mut x: lockstep::Tensor,
        params: lockstep::nn::Params<'_>,
        _: lockstep::nn::ParamsMut<'_>,
        _: &lockstep::nn::Ctx,
    ) -> lockstep::Result<lockstep::Tensor> {
        for (v, p) in x.host_mut().iter_mut().zip(params.get(0)) {
            *v += p;
        }
        Ok(x)
    }

    fn backward(
        &mut self,
        dout: lockstep::Tensor,
        _: lockstep::nn::Params<'_>,
        mut dparams: lockstep::nn::ParamsMut<'_>,
        _: lockstep::nn::InputGrad,
        _: &lockstep::nn::Ctx,
    ) -> lockstep::Result<Option<lockstep::Tensor>> {
        for (g, d) in dparams.get(0).iter_mut().zip(dout.host()) {
            *g += d;
        }
        Ok(None)
    }

    fn boxed_clone(&self) -> Box<dyn lockstep::nn::Layer> {
        Box::new(self.clone())
    }

    fn describe(&self) -> String {
        format!("InputProbe({})", self.numel)
    }
}

/// A statistics exchange of two logical replicas, this one being replica 1: it records
/// what it is handed and gathers a fixed payload of replica 0 before it — (37 values per
/// channel of mean 0.3 + ch/10 and M2 11 + ch) in forward, (1.5 − ch/4, −0.7 + ch/8) in
/// backward, told apart by their lengths (1 + 2C is odd).
#[derive(Debug, Default)]
pub struct Recorder {
    pub sent: std::sync::Mutex<Vec<Vec<f64>>>,
}

impl lockstep::ops::batchnorm::stats::StatsExchange for Recorder {
    fn replicas(&self) -> usize {
        2
    }

    fn all_gather(&self, shard: usize, mine: &[f64], all: &mut Vec<f64>) -> lockstep::Result<()> {
        assert_eq!(shard, 1, "the layer under test is logical replica 1");
        self.sent.lock().unwrap().push(mine.to_vec());
        all.clear();
        if mine.len() % 2 == 1 {
            let c = mine.len() / 2;
            all.push(37.0);
            all.extend((0..c).flat_map(|ch| [0.3 + ch as f64 / 10.0, 11.0 + ch as f64]));
        } else {
            let c = mine.len() / 2;
            all.extend((0..c).flat_map(|ch| [1.5 - ch as f64 / 4.0, -0.7 + ch as f64 / 8.0]));
        }
        all.extend_from_slice(mine);
        Ok(())
    }
}

/// What the CPU's synchronized BatchNorm (ops::batchnorm, as `--sync-batchnorm` runs it on
/// CPU devices) does with `inputs` as logical replica 1 of 2 beside [`Recorder`]'s replica
/// 0: the payloads it hands the exchange, its output, running statistics and gradients.
pub struct SyncBnCpu {
    /// Forward: [count, mean₀, M2₀, ...]; backward: [Σ dy₀, Σ dy·x̂₀, ...].
    pub sent_fwd: Vec<f64>,
    pub sent_bwd: Vec<f64>,
    /// y, dx: (N, C, HW).
    pub y: Vec<f32>,
    pub dx: Vec<f32>,
    /// (C) each; dgamma, dbeta: the inputs' earlier gradients plus this step's where the
    /// layer has the parameter, the earlier ones untouched where it has not.
    pub running_mean: Vec<f32>,
    pub running_var: Vec<f32>,
    pub dgamma: Vec<f32>,
    pub dbeta: Vec<f32>,
}

/// Runs the CPU layer ([`SyncBnCpu`]): behind an [`InputProbe`], so that its input
/// gradient is computed and handed over exactly.
pub fn sync_bn_cpu(inputs: &BnInputs, with_gamma: bool, with_beta: bool, momentum: f32, eps: f32) -> SyncBnCpu {
    use lockstep::nn::{BatchNorm2d, Ctx, Layer, Sequential};
    use lockstep::ops::BatchStats;
    let (n, c, hw) = inputs.shape;
    let total = n * c * hw;
    let bn = BatchNorm2d::new(c)
        .scale(with_gamma)
        .center(with_beta)
        .momentum(momentum)
        .eps(eps)
        .batch_stats(BatchStats::Global);
    let layers: Vec<Box<dyn Layer>> = vec![Box::new(InputProbe { numel: total }), Box::new(bn)];
    let mut model = Sequential::new([c, hw, 1], layers).unwrap();
    let infos = model.param_infos().to_vec();
    // The probe's parameter and gradient start at −0.0: −0.0 + v = v for every v.
    let mut params = vec![0.0f32; model.params_len()];
    params[infos[0].range.clone()].fill(-0.0);
    let mut grads = vec![0.0f32; model.params_len()];
    grads[infos[0].range.clone()].fill(-0.0);
    let present: Vec<(&Vec<f32>, &Vec<f32>)> =
        [(with_gamma, (&inputs.gamma, &inputs.dgamma)), (with_beta, (&inputs.beta, &inputs.dbeta))]
            .into_iter()
            .filter(|p| p.0)
            .map(|p| p.1)
            .collect();
    for (t, (p, g)) in infos[1..].iter().zip(&present) {
        params[t.range.clone()].copy_from_slice(p);
        grads[t.range.clone()].copy_from_slice(g);
    }
    let mut buffers = vec![0.0f32; model.buffers_len()];
    let (rm, rv) = (model.buffer_infos()[0].range.clone(), model.buffer_infos()[1].range.clone());
    buffers[rm.clone()].copy_from_slice(&inputs.running_mean);
    buffers[rv.clone()].copy_from_slice(&inputs.running_var);
    let recorder = Recorder::default();
    let ctx = Ctx { stats: Some(&recorder), ..Ctx::train(0, 0, 1, lockstep::Device::Cpu(0)) };
    let x = lockstep::Tensor::from_vec(inputs.x.clone(), [n, c, hw, 1]).unwrap();
    let y = model.forward(x, &params, &mut buffers, &ctx).unwrap().into_vec();
    let dy = lockstep::Tensor::from_vec(inputs.dy.clone(), [n, c, hw, 1]).unwrap();
    model.backward(dy, &params, &mut grads, &ctx).unwrap();
    let sent = recorder.sent.lock().unwrap().clone();
    assert_eq!(sent.len(), 2, "one call of the statistics exchange in forward, one in backward");
    let mut t = infos[1..].iter();
    let mut grad_of =
        |on: bool, before: &Vec<f32>| if on { grads[t.next().unwrap().range.clone()].to_vec() } else { before.clone() };
    let dgamma = grad_of(with_gamma, &inputs.dgamma);
    let dbeta = grad_of(with_beta, &inputs.dbeta);
    SyncBnCpu {
        sent_fwd: sent[0].clone(),
        sent_bwd: sent[1].clone(),
        y,
        dx: grads[infos[0].range.clone()].to_vec(),
        running_mean: buffers[rm].to_vec(),
        running_var: buffers[rv].to_vec(),
        dgamma,
        dbeta,
    }
}

/// What a GPU replica's host makes of its shard's `moments` ((C, 2) from
/// batchnorm_moments_fwd) over `here` values per channel, through a [`Recorder`] as
/// logical replica 1 — the global count, the (C, 4) statistics batchnorm_sync_fwd takes
/// and the running update — by the functions src/cuda/net.rs calls
/// (`Synchronized::moments`, `normaliser`, `RunningUpdate`).
pub fn sync_bn_merge(moments: &[f64], here: usize, momentum: f32, eps: f32) -> (f64, Vec<f64>, RunningUpdate) {
    use lockstep::ops::batchnorm::{normaliser, Synchronized};
    let recorder = Recorder::default();
    let with = Synchronized { stats: &recorder, shard: 1 };
    let local: Vec<(f64, f64)> = moments.chunks_exact(2).map(|p| (p[0], p[1])).collect();
    let (count, merged) = with.moments(here as f64, &local).unwrap();
    let stats = merged
        .iter()
        .flat_map(|&(mean, m2)| {
            let var = m2 / count;
            let (m, is) = normaliser(mean, var, eps);
            [mean, var, m as f64, is as f64]
        })
        .collect();
    (count, stats, RunningUpdate::new(momentum, count as usize))
}

/// The global sums a GPU replica's host makes of its shard's (C, 2) `sums`, through a
/// [`Recorder`] as logical replica 1 (`Synchronized::sums`), flat (C, 2).
pub fn sync_bn_global_sums(sums: &[f64]) -> Vec<f64> {
    let recorder = Recorder::default();
    let with = lockstep::ops::batchnorm::Synchronized { stats: &recorder, shard: 1 };
    let local: Vec<(f64, f64)> = sums.chunks_exact(2).map(|p| (p[0], p[1])).collect();
    with.sums(&local).unwrap().iter().flat_map(|&(a, b)| [a, b]).collect()
}
