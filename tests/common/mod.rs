//! Test support shared by the integration tests: the skip check for a missing GPU (through
//! the one skip helper, src/testing/skip.rs), the input generator and the f64 comparison,
//! the 16-bit codec's slots and its shared-memory exchange (the CPU's own code, which the
//! GPU training tests hold the GPU exchange to), and a layer that hands a BatchNorm's
//! input gradient over exactly. Each test file uses only part of it, hence the
//! `dead_code` allowance, as usual for tests/common.

#![allow(dead_code)]

use lockstep::exchange::codec::Codec;
use lockstep::exchange::shm::ShmGroup;
use lockstep::exchange::{Exchange, Wait};
use lockstep::rng::mix64;

#[path = "../../src/testing/skip.rs"]
pub mod skip;

// ---- skipping without a GPU ----------------------------------------------------------

/// True where a CUDA GPU can be used; otherwise the one skip helper says that `test` did
/// not run (a failure under LOCKSTEP_REQUIRE_GPU=1).
pub fn gpu_present(test: &str) -> bool {
    let why = match lockstep::cuda::probe::gpu_count() {
        Ok(n) if n > 0 => return true,
        Ok(_) => "no CUDA GPU".to_string(),
        Err(e) => format!("no CUDA driver ({e})"),
    };
    skip::skip(test, skip::Need::Gpu, &why);
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

// ---- the 16-bit codec: the CPU's own code as the reference ------------------------

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
