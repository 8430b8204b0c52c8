//! Test support shared by the GPU tests (cuda_ops.rs, cuda_train.rs, oracle.rs), the
//! host-run kernel tests (kernels_host.rs) and the 16-bit exchange tests
//! (grad_compression.rs): the skip check for a missing GPU, the input generator, the f64
//! comparison, and the host references that both kernel tests hold the CUDA kernels to
//! (softmax cross-entropy; the 16-bit codec's inputs, wires and exchange, which the codec
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

use lockstep::exchange::codec::{Codec, Compression, Wire};
use lockstep::exchange::gpu::codec::WireGeom;
use lockstep::exchange::shm::ShmGroup;
use lockstep::exchange::{Exchange, Wait};
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

// ---- softmax_xent.cu -----------------------------------------------------------------

/// Softmax cross-entropy per sample with label smoothing `eps` (0: none), in f64: the
/// loss (1 - eps)·(lse(z) - z[label]) + (eps/K)·Σ_c (lse(z) - z[c]) and dlogits
/// softmax(z) - ((1 - eps)·onehot(label) + eps/K), the row maximum subtracted before exp
/// (PyTorch's `cross_entropy(label_smoothing=eps)`, written out).
/// logits: (N, K); labels: (N); returns loss: (N) and dlogits: (N, K).
pub fn softmax_xent_ref(logits: &[f32], labels: &[u32], k: usize, eps: f32) -> (Vec<f64>, Vec<f64>) {
    let n = labels.len();
    let eps = eps as f64;
    let (mut want_loss, mut want_dl) = (vec![0.0; n], vec![0.0; n * k]);
    for s in 0..n {
        let z = f64s(&logits[s * k..(s + 1) * k]);
        let mx = z.iter().cloned().fold(f64::MIN, f64::max);
        let lse = z.iter().map(|v| (v - mx).exp()).sum::<f64>().ln() + mx;
        let smooth: f64 = z.iter().map(|v| lse - v).sum();
        want_loss[s] = (1.0 - eps) * (lse - z[labels[s] as usize]) + eps / k as f64 * smooth;
        for j in 0..k {
            let target = if j == labels[s] as usize { 1.0 - eps } else { 0.0 } + eps / k as f64;
            want_dl[s * k + j] = (z[j] - lse).exp() - target;
        }
    }
    (want_loss, want_dl)
}

// ---- codec.cu: the CPU's own code as the reference -----------------------------------

/// A wire of the codec in the device layout of `g` (launch.rs's WireGeom: codes at 0, the
/// fp16 exponents after them, the raw floats on 256 bytes; padding zero).
pub fn device_wire(g: &WireGeom, w: &Wire) -> Vec<u8> {
    let (half, exps, raw) = w.parts();
    let mut b = vec![0u8; g.bytes()];
    for (i, h) in half.iter().enumerate() {
        b[2 * i..2 * i + 2].copy_from_slice(&h.to_ne_bytes());
    }
    for (i, &e) in exps.iter().enumerate() {
        b[g.exps_at() + i] = e as u8;
    }
    for (i, r) in raw.iter().enumerate() {
        b[g.raw_at() + 4 * i..g.raw_at() + 4 * i + 4].copy_from_slice(&r.to_ne_bytes());
    }
    b
}

/// The three parts of a device wire: codes, exponents, raw values.
pub fn wire_parts(g: &WireGeom, b: &[u8]) -> (Vec<u16>, Vec<i8>, Vec<f32>) {
    let codes = (0..g.encoded).map(|i| u16::from_ne_bytes([b[2 * i], b[2 * i + 1]])).collect();
    let exps = (0..g.exponents()).map(|i| b[g.exps_at() + i] as i8).collect();
    let at = |i: usize| g.raw_at() + 4 * i;
    let raw = (0..g.raw).map(|i| f32::from_ne_bytes(b[at(i)..at(i) + 4].try_into().unwrap())).collect();
    (codes, exps, raw)
}

/// Whether a 16-bit code of `c` is a NaN.
pub fn code_is_nan(c: Compression, h: u16) -> bool {
    match c {
        Compression::Fp16 => h & 0x7C00 == 0x7C00 && h & 0x03FF != 0,
        _ => h & 0x7F80 == 0x7F80 && h & 0x007F != 0,
    }
}

/// One slot of the codec test: `encoded` values in blocks of 1,024 of their own
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

/// The inputs of a codec kernel check: `r` slots made by [`codec_slot`], the codec's own
/// wire of each, and the slots packed as the GPU exchange lays them out (`src`: slot j at
/// j·`stride`, a whole number of 64-value rows apart).
pub struct CodecInputs {
    pub slots: Vec<Vec<f32>>,
    pub wires: Vec<Wire>,
    pub stride: usize,
    pub src: Vec<f32>,
}

pub fn codec_inputs(codec: &Codec, rng: &mut Rng, r: usize, encoded: usize, raw: usize) -> CodecInputs {
    let len = encoded + raw;
    let slots: Vec<Vec<f32>> = (0..r).map(|s| codec_slot(rng, s, encoded, raw)).collect();
    let wires = slots
        .iter()
        .map(|v| {
            let mut w = codec.wire(0..len);
            codec.encode(v, &mut w, 0..len);
            w
        })
        .collect();
    let stride = len.div_ceil(64) * 64;
    let mut src = vec![0.0f32; r * stride];
    for (j, v) in slots.iter().enumerate() {
        src[j * stride..j * stride + len].copy_from_slice(v);
    }
    CodecInputs { slots, wires, stride, src }
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
