//! Test support shared by the integration tests, on the public API alone: the skip check
//! for a missing GPU (through the one skip helper, src/testing/skip.rs), the input
//! generator and the f64 comparison. What checks the crate's insides (the 16-bit codec,
//! the shared-memory exchange) lives in the crate beside the code it checks. Each test
//! file uses only part of this, hence the `dead_code` allowance, as usual for
//! tests/common.

#![allow(dead_code)]

#[path = "../../src/testing/skip.rs"]
pub mod skip;

#[path = "../../src/testing/oracle.rs"]
pub mod oracle;

// ---- skipping without a GPU ----------------------------------------------------------

/// True where a CUDA GPU can be used; otherwise the one skip helper says that `test` did
/// not run (a failure under LOCKSTEP_REQUIRE_GPU=1).
pub fn gpu_present(test: &str) -> bool {
    #[cfg(feature = "cuda")]
    let why = match lockstep::cuda::probe::gpu_count() {
        Ok(n) if n > 0 => return true,
        Ok(_) => "no CUDA GPU".to_string(),
        Err(e) => format!("no CUDA driver ({e})"),
    };
    // The tests that share this file but no GPU build with `--no-default-features`.
    #[cfg(not(feature = "cuda"))]
    let why = "built without the cuda feature".to_string();
    skip::skip(test, skip::Need::Gpu, &why);
    false
}

// ---- inputs and comparisons ----------------------------------------------------------

/// SplitMix64 (Steele, Lea, Flood 2014), for test inputs only: the library's generator
/// is crate-private, so its few lines are copied here, and the stream is the library's
/// bit for bit (`Rng(seed)` gives what `SplitMix64::new(seed)` gives inside the crate),
/// so that no expected number of a test changed when the tests moved to the public API.
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1): the top 24 bits, exactly representable.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        self.next_f32() * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
    /// Uniform integer in `0..n` (Lemire's multiply-shift, as the library's).
    pub fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }
}

// Elementwise results are one or two float ops: 1e-6 relative covers f32 rounding of
// the reference's f64 result; sums of up to a few hundred terms get 1e-5.

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
