//! The toy dataset of the lesson "Training on GPUs", and its noisy enlarged variant.
//!
//! Owns: the lesson's five training and two test points in the plane (two classes,
//! one cluster up-left, one down-right), and the enlarged variant that the lesson keeps
//! in commented-out lines to give DDP something to split:
//!
//! ```python
//! factor = 4
//! X_train = torch.cat([X_train + torch.randn_like(X_train) * 0.1 for _ in range(factor)])
//! y_train = y_train.repeat(factor)
//! # and the same for X_test, y_test
//! ```
//!
//! The Gaussian noise is drawn from the data module's seeded SplitMix64 through
//! Box–Muller, not from PyTorch's generator, so the enlarged points are reproducible
//! from (factor, seed) but are not the lesson's exact numbers (those depend on the
//! PyTorch RNG state of the run). The lesson's MLP (2-30-20-2) lives in `nn`/examples.

use super::{Dataset, Features, Splits};
use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// The lesson's training points: x (5, 2).
const X_TRAIN: [[f32; 2]; 5] = [[-1.2, 3.1], [-0.9, 2.9], [-0.5, 2.6], [2.3, -1.1], [2.7, -1.5]];
/// The lesson's training labels: y (5,).
const Y_TRAIN: [u32; 5] = [0, 0, 0, 1, 1];
/// The lesson's test points: x (2, 2).
const X_TEST: [[f32; 2]; 2] = [[-0.8, 2.8], [2.6, -1.6]];
/// The lesson's test labels: y (2,).
const Y_TEST: [u32; 2] = [0, 1];
/// Standard deviation of the noise added by the enlarged variant (`randn_like(X) * 0.1`).
pub const TOY_NOISE_STD: f64 = 0.1;

/// The lesson's dataset as it is: 5 training and 2 test points, sample shape (2,), f32,
/// 2 classes.
pub fn toy() -> Splits {
    let build = |name: &str, x: &[[f32; 2]], y: &[u32]| {
        // x: (N, 2)
        let flat: Vec<f32> = x.iter().flatten().copied().collect();
        Dataset::new(name, [2], Features::F32(flat), y.to_vec(), 2).expect("the lesson's constants are consistent")
    };
    Splits { train: build("toy/train", &X_TRAIN, &Y_TRAIN), test: Some(build("toy/test", &X_TEST, &Y_TEST)) }
}

/// The lesson's enlarged dataset: `factor` noisy copies of the training points (5·factor
/// samples) and of the test points (2·factor), each coordinate plus N(0, 0.1²) noise,
/// copies concatenated in order (copy 0's points first) and labels repeated to match.
///
/// The noise comes from one SplitMix64 stream seeded with `seed`: standard normals by
/// Box–Muller in pairs, consumed coordinate by coordinate, training set first, then the
/// test set. `factor` 0 is an error (the lesson's `range(0)` would give empty sets).
pub fn toy_enlarged(factor: usize, seed: u64) -> Result<Splits> {
    if factor == 0 {
        return Err(Error::Data {
            name: "toy_enlarged".into(),
            detail: "factor must be at least 1 (factor 0 gives no samples)".into(),
        });
    }
    let mut normal = Normal::new(seed);
    let mut build = |name: &str, x: &[[f32; 2]], y: &[u32]| {
        let mut flat = Vec::with_capacity(factor * x.len() * 2);
        for _ in 0..factor {
            for &v in x.iter().flatten() {
                flat.push((f64::from(v) + TOY_NOISE_STD * normal.sample()) as f32);
            }
        }
        let labels: Vec<u32> = (0..factor).flat_map(|_| y.iter().copied()).collect();
        // x: (factor·N, 2), y: (factor·N,)
        Dataset::new(name, [2], Features::F32(flat), labels, 2)
    };
    let train = build("toy/train", &X_TRAIN, &Y_TRAIN)?;
    let test = build("toy/test", &X_TEST, &Y_TEST)?;
    Ok(Splits { train, test: Some(test) })
}

/// Standard normal samples by the Box–Muller transform, two per pair of uniforms:
/// z₀ = √(−2 ln u₁)·cos(2π u₂), z₁ = √(−2 ln u₁)·sin(2π u₂), with u₁ ∈ (0, 1] (so the
/// logarithm is finite) and u₂ ∈ [0, 1).
struct Normal {
    rng: SplitMix64,
    spare: Option<f64>,
}

impl Normal {
    fn new(seed: u64) -> Self {
        Normal { rng: SplitMix64::new(seed), spare: None }
    }

    fn sample(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let u1 = 1.0 - self.rng.next_f64();
        let u2 = self.rng.next_f64();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = std::f64::consts::TAU * u2;
        self.spare = Some(r * theta.sin());
        r * theta.cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(ds: &Dataset) -> &[f32] {
        match ds.features() {
            Features::F32(v) => v,
            Features::U8(_) => panic!("toy features are f32"),
        }
    }

    #[test]
    fn toy_is_the_lessons_data() {
        // Numbers copied from the lesson "Training on GPUs".
        let s = toy();
        assert_eq!(s.train.sample_shape().dims(), &[2]);
        assert_eq!(s.train.num_classes(), 2);
        assert_eq!(f32s(&s.train), &[-1.2, 3.1, -0.9, 2.9, -0.5, 2.6, 2.3, -1.1, 2.7, -1.5]);
        assert_eq!(s.train.labels(), &[0, 0, 0, 1, 1]);
        let test = s.test.unwrap();
        assert_eq!(f32s(&test), &[-0.8, 2.8, 2.6, -1.6]);
        assert_eq!(test.labels(), &[0, 1]);
        assert_eq!((s.train.name(), test.name()), ("toy/train", "toy/test"));
    }

    #[test]
    fn factor_zero_is_an_error() {
        let e = toy_enlarged(0, 0).unwrap_err().to_string();
        assert_eq!(e, "dataset toy_enlarged: factor must be at least 1 (factor 0 gives no samples)");
    }

    #[test]
    fn enlarged_sizes_labels_and_first_values() {
        let s = toy_enlarged(4, 0).unwrap();
        let test = s.test.as_ref().unwrap();
        assert_eq!((s.train.len(), test.len()), (20, 8));
        assert_eq!(s.train.labels(), &[0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1]);
        assert_eq!(test.labels(), &[0, 1, 0, 1, 0, 1, 0, 1]);
        // The first four normals of seed 0 and the noisy points, from this Python
        // transcription of SplitMix64 + Box–Muller (f64 throughout):
        //   u1 = 1 - next_f64(); u2 = next_f64()   # next_f64 = (next_u64 >> 11) / 2**53
        //   r = sqrt(-2 log u1); z0, z1 = r cos(2 pi u2), r sin(2 pi u2)
        //   -> z = [-1.8839083, 0.8645069, 0.2276079, -0.0421127]
        //   -1.2 + 0.1 z0 = -1.3883908, 3.1 + 0.1 z1 = 3.1864507,
        //   -0.9 + 0.1 z2 = -0.8772392, 2.9 + 0.1 z3 = 2.8957887
        // Tolerance 1e-6: the f32 rounding of the result (ulp ≈ 2.4e-7 near 3).
        let x = f32s(&s.train);
        let expected = [-1.3883908, 3.1864507, -0.8772392, 2.8957887];
        for (got, want) in x[..4].iter().zip(expected) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
    }

    #[test]
    fn enlarged_noise_is_gaussian_with_std_0_1() {
        let factor = 2000;
        let s = toy_enlarged(factor, 42).unwrap();
        let base = toy();
        let mut noise = Vec::new();
        for (big, small) in [(&s.train, &base.train), (s.test.as_ref().unwrap(), base.test.as_ref().unwrap())] {
            let clean = f32s(small);
            for copy in f32s(big).chunks_exact(clean.len()) {
                noise.extend(copy.iter().zip(clean).map(|(a, b)| f64::from(a - b)));
            }
        }
        assert_eq!(noise.len(), factor * (5 + 2) * 2);
        let n = noise.len() as f64;
        let mean = noise.iter().sum::<f64>() / n;
        let std = (noise.iter().map(|z| (z - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
        // 28000 draws: the standard error of the mean is 0.1/√28000 ≈ 6e-4 and that of
        // the standard deviation 0.1/√56000 ≈ 4.2e-4; tolerances are about 5 of each.
        assert!(mean.abs() < 3e-3, "mean {mean}");
        assert!((std - 0.1).abs() < 2e-3, "std {std}");
        // A Gaussian puts 68.3% of draws within one sigma; binomial standard error
        // √(0.683·0.317/28000) ≈ 2.8e-3, tolerance 1.5e-2.
        let within = noise.iter().filter(|z| z.abs() < 0.1).count() as f64 / n;
        assert!((within - 0.6827).abs() < 1.5e-2, "within one sigma {within}");
    }

    #[test]
    fn enlarged_is_reproducible_from_the_seed() {
        let a = toy_enlarged(3, 7).unwrap();
        let b = toy_enlarged(3, 7).unwrap();
        let c = toy_enlarged(3, 8).unwrap();
        assert_eq!(a.train, b.train);
        assert_eq!(a.test, b.test);
        assert_ne!(f32s(&a.train), f32s(&c.train));
        // factor 1 is the lesson's points plus one draw of noise, nothing more.
        let one = toy_enlarged(1, 7).unwrap();
        assert_eq!((one.train.len(), one.test.unwrap().len()), (5, 2));
    }
}
