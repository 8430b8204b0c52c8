//! GELU on the CPU, exact: y = x·Φ(x), Φ the standard normal CDF, and its gradient
//! dx = dy·(Φ(x) + x·φ(x)). The reference kernels/gelu.cu is held to, bit for bit.
//!
//! # Numerics: f32, within PyTorch's own error, ten times faster than erfc
//! Each value is computed in f32 by branch-free code (so the loops vectorise), the same
//! expressions in the same order as the kernels:
//! - erfc(z) for z = |x|/√2 by Numerical Recipes' `erfcc` (Press et al., §6.2): with
//!   t = 1/(1 + z/2), erfc(z) = t·exp(−z² + q(t)), q a degree-9 polynomial (evaluated by
//!   Estrin's scheme); its relative error is below 1.2·10⁻⁷ for every z ≥ 0;
//! - Φ(x) = 1 − erfc(z)/2 for x ≥ 0, erfc(z)/2 below: the tail from erfc, never from a
//!   cancelling 1 + erf;
//! - y = x·Φ(x), dx = dy·(Φ(x) + x·φ(x)), φ(x) = exp(−x²/2)/√(2π);
//! - exp by [`exp_f32`] (Cephes' `expf`: a degree-6 polynomial after reduction by ln 2,
//!   within 2 ulp), 0 below e⁻⁸⁷.
//!
//! Against 60-digit values (scripts/torch_gelu.py) the result is within 10⁻⁶
//! relative plus 10⁻³⁷ (the rounding of x²/2 in the exponent: 6·10⁻⁷ at x = −8); PyTorch's own f32 GELU, whose 1 + erf(x/√2) cancels for x < 0, is
//! 4·10⁻⁵ off at x = −3 and 0 at x = −8. The exact f64 evaluation this replaced (libm's
//! erfc and exp per value, about 30 ns) was most of a transformer's MLP time on a CPU.
//! The kernels compute the same f32 operations without contraction (`__fmul_rn`,
//! `__fadd_rn`): their host check (`gpu::host_check`) holds them to these bit for bit.
//!
//! At ±∞ and NaN it is PyTorch's: y(+∞) = +∞, y(−∞) = −∞·0 = NaN, a NaN passes through.
//!
//! The forward and backward run over the whole tensor in pieces of [`CHUNK`] values, in
//! the pool of the device the calling thread works for (`backend::par`); the values are
//! independent, so the result is the same whatever the thread count.

use rayon::prelude::*;

use crate::backend::par;
use crate::backend::simd::{exp_f32, widest};

/// Elements per parallel task: about 3 ns a value, so 2^15 values (0.1 ms) amortise
/// handing a task to another thread.
pub const CHUNK: usize = 1 << 15;

/// 1/√2.
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/√(2π).
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// The coefficients c0, …, c9 of `erfcc`'s polynomial q(t) (Press et al., §6.2).
const ERFC_Q: [f32; 10] = [
    -1.265_512_2,
    1.000_023_7,
    0.374_091_95,
    0.096_784_18,
    -0.186_288_06,
    0.278_868_08,
    -1.135_204,
    1.488_515_9,
    -0.822_152_26,
    0.170_872_76,
];

/// y = x·Φ(x) in place over x: (n); with `slope`: (n), the derivative Φ(x) + x·φ(x) at
/// each input, written for the backward (what a training forward keeps).
pub fn gelu_forward(x: &mut [f32], slope: Option<&mut [f32]>) {
    match slope {
        Some(slope) => {
            assert_eq!(slope.len(), x.len(), "gelu_forward: {} slopes for {} values", slope.len(), x.len());
            let kept = slope.par_chunks_mut(CHUNK);
            par::for_each(x.par_chunks_mut(CHUNK).zip(kept), |(xs, ks)| forward_kept(xs, ks));
        }
        None => par::for_each(x.par_chunks_mut(CHUNK), forward_values),
    }
}

/// dx = dout·(Φ(x) + x·φ(x)) in place over dout: (n); slope: (n), the forward's.
pub fn gelu_backward(dout: &mut [f32], slope: &[f32]) {
    assert_eq!(slope.len(), dout.len(), "gelu_backward: {} slopes for {} values", slope.len(), dout.len());
    let kept = slope.par_chunks(CHUNK);
    par::for_each(dout.par_chunks_mut(CHUNK).zip(kept), |(ds, ss)| backward_values(ds, ss));
}

/// Φ(x), for the forward and the backward: from Numerical Recipes' `erfcc` (the module's
/// docs), in f32.
#[inline(always)]
fn cdf(x: f32) -> f32 {
    let z = x.abs() * FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    // q(t) = c0 + c1·t + … + c9·t⁹ by Estrin's scheme: pairs c_2i + c_2i+1·t, then
    // combined by t², t⁴, t⁸, so that the chain of dependent operations is 8 long instead
    // of Horner's 18 (the loop waited on it).
    let (t2, c) = (t * t, &ERFC_Q);
    let t4 = t2 * t2;
    let t8 = t4 * t4;
    let p01 = c[0] + c[1] * t;
    let p23 = c[2] + c[3] * t;
    let p45 = c[4] + c[5] * t;
    let p67 = c[6] + c[7] * t;
    let p89 = c[8] + c[9] * t;
    let q = ((p01 + p23 * t2) + (p45 + p67 * t2) * t4) + p89 * t8;
    let erfc = t * exp_f32(q - 0.5 * x * x);
    if x >= 0.0 {
        1.0 - 0.5 * erfc
    } else {
        0.5 * erfc
    }
}

/// y = x·Φ(x) of one value, in f32 (the module's docs).
#[inline(always)]
pub fn gelu_value(x: f32) -> f32 {
    x * cdf(x)
}

/// dx = dy·(Φ(x) + x·φ(x)) of one value, in f32 (the module's docs): what
/// [`gelu_backward`] gives from [`gelu_forward`]'s slope, bit for bit.
#[cfg(test)]
#[inline(always)]
pub fn gelu_grad(x: f32, dy: f32) -> f32 {
    dy * slope(x, cdf(x))
}

/// The derivative Φ(x) + x·φ(x) from Φ(x): what the training forward keeps, so that the
/// backward is one multiplication, with the bits of [`gelu_grad`].
#[inline(always)]
fn slope(x: f32, cdf: f32) -> f32 {
    let pdf = exp_f32(-0.5 * x * x) * FRAC_1_SQRT_2PI;
    cdf + x * pdf
}

widest! {
    /// y = x·Φ(x) of every value of `xs`, in place, at the processor's widest vectors
    /// (`backend::simd`: the same bits at every width).
    fn forward_values(xs: &mut [f32]) {
        for v in xs.iter_mut() {
            *v = gelu_value(*v);
        }
    }
}

widest! {
    /// The training forward: y = x·Φ(x) in place, the slope Φ(x) + x·φ(x) kept for the
    /// backward.
    fn forward_kept(xs: &mut [f32], kept_slope: &mut [f32]) {
        for (v, ks) in xs.iter_mut().zip(kept_slope) {
            let (x, c) = (*v, cdf(*v));
            *ks = slope(x, c);
            *v = x * c;
        }
    }
}

widest! {
    /// dx = dy·(Φ(x) + x·φ(x)) of every value from the forward's slopes, `ds` holding dy
    /// and receiving dx.
    fn backward_values(ds: &mut [f32], slopes: &[f32]) {
        for (d, &s) in ds.iter_mut().zip(slopes) {
            *d *= s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_f32_is_within_2_ulp_over_its_range_and_clamps_outside() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let (got, want) = (exp_f32(x) as f64, (x as f64).exp());
            let ulp = (want as f32).abs().max(f32::MIN_POSITIVE) as f64 * f32::EPSILON as f64;
            worst = worst.max((got - want).abs() / ulp);
            x += 0.0137;
        }
        assert!(worst <= 2.0, "exp_f32 is {worst} ulp off");
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
        assert_eq!(exp_f32(0.0), 1.0);
    }

    #[test]
    fn the_gradient_is_the_derivative_of_the_value() {
        // Central differences in f64 of the f32 function are within its own rounding.
        for &x in &[-4.0f32, -1.5, -0.3, 0.0, 0.2, 1.0, 2.5, 6.0] {
            let h = 1e-2f32;
            let fd = (gelu_value(x + h) as f64 - gelu_value(x - h) as f64) / (2.0 * h as f64);
            let g = gelu_grad(x, 1.0) as f64;
            assert!((fd - g).abs() <= 2e-4 * g.abs().max(1.0), "x {x}: {g} vs {fd}");
        }
    }
}
