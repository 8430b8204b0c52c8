//! Loops compiled for the processor's widest vectors, with the same bits on every
//! processor: the `widest!` macro, and the branch-free math those loops call
//! ([`exp_f32`]).
//!
//! The library is built for x86-64's baseline (SSE2: 4 f32 a vector), so that one binary
//! runs everywhere. A loop written with `widest!` is compiled three times, for AVX-512F
//! (16 f32), AVX2 (8) and the baseline, and each call takes the widest the processor
//! has (`is_x86_feature_detected!`, a cached load after the first call). The three
//! compile the same Rust, and Rust never contracts a multiply and an add into an FMA
//! (none of the three enables FMA either), so each lane computes the same IEEE
//! operations in the same order: add, multiply, divide, square root, compare and select
//! round the same at any width. A loop is therefore free to be vectorised, but not to
//! reassociate: a reduction written in order stays in order (LLVM does not reorder
//! floating-point sums), and a reduction meant to vectorise says its lanes itself (as
//! `optim::GradNorm` does).
//!
//! Left to others: what each loop computes (its layer or the optimiser), the GEMM (the
//! `gemm` crate picks its own kernels: `cpu.rs`).

/// Defines a function compiled for AVX-512F, AVX2 and the baseline, the widest the
/// processor has taken at each call (the module's docs). The body must be plain code
/// over its arguments (it becomes a nested function: no `self`, no generics), and the
/// function must be called where dispatching per call is cheap next to its work (a
/// loop over a row or more, not one value).
///
/// ```ignore
/// widest! {
///     /// x ← a·x
///     fn scale(xs: &mut [f32], a: f32) {
///         for x in xs { *x *= a; }
///     }
/// }
/// ```
macro_rules! widest {
    ($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn plain($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    plain($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    plain($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the processor has AVX-512F (checked just above), the only
                    // requirement of a `target_feature(enable = "avx512f")` function.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: as above, for AVX2.
                    return unsafe { avx2($($arg),*) };
                }
            }
            plain($($arg),*)
        }
    };
}
pub(crate) use widest;

/// 1.5·2²³: adding and subtracting it rounds an f32 below 2²² to an integer (to even).
const ROUND: f32 = 12_582_912.0;

/// e^x in f32, Cephes' `expf`: n = round(x·log₂e), r = x − n·ln 2 (ln 2 in two parts, so
/// that r is exact), e^r by a degree-6 polynomial, then 2ⁿ by the exponent's bits. Within
/// 2 ulp for x in [−87, 88]; 0 below −87 (e⁻⁸⁷ ≈ 1.6·10⁻³⁸), +∞ above 88; NaN stays NaN.
/// Branch-free (selects), so a loop of it vectorises: a `widest!` loop of it runs 16
/// values at a time where libm's `expf` runs one. kernels/relu.cu's `gelu_exp`
/// computes the same operations in the same order.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    let c = x.clamp(-87.0, 88.0);
    // n = round(c·log₂e) by the 1.5·2²³ trick (exact for |c·log₂e| < 2²²): no call to
    // floorf, which x86-64's baseline cannot inline, so the loop vectorises.
    // The integer n is then the low bits of the sum, read without a float-to-int cast
    // (whose saturation Rust's `as` would check value by value).
    let k = c * std::f32::consts::LOG2_E + ROUND;
    let n = k - ROUND;
    let r = (c - n * 0.693_359_4) - n * -2.121_944_4e-4;
    let p = (((((1.987_569_1e-4 * r + 0.001_398_199_9) * r + 0.008_333_452) * r + 0.041_665_796) * r + 0.166_666_66)
        * r
        + 0.5)
        * (r * r)
        + r
        + 1.0;
    let scale = f32::from_bits(k.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127) << 23);
    let e = p * scale;
    if x < -87.0 {
        0.0
    } else if x > 88.0 {
        f32::INFINITY
    } else {
        e
    }
}

/// The lanes of the sums here ([`dot`], [`exp_sum`]): one AVX-512 vector of f32. Their
/// one fixed order, a function of the length alone: value i goes to lane i mod 16, each
/// lane adds in index order, the lanes close pairwise ([`close_lanes`]). Vectorised at
/// every width, where an in-order sum waits on each add.
pub const LANES: usize = 16;

/// Lane l of `acc` added with lane l + w for w = 8, 4, 2, 1: the fixed pairwise order in
/// which the sums close their lanes ([`LANES`]).
#[inline(always)]
fn close_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

widest! {
    /// Σ a·b over the shorter of the two, in the lanes' order ([`LANES`]).
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (a, b) = (&a[..n], &b[..n]);
        let mut acc = [0.0f32; LANES];
        let (mut ra, mut rb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
        for (x, y) in (&mut ra).zip(&mut rb) {
            for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
                *s += x * y;
            }
        }
        for ((s, &x), &y) in acc.iter_mut().zip(ra.remainder()).zip(rb.remainder()) {
            *s += x * y;
        }
        close_lanes(acc)
    }
}

widest! {
    /// The largest a·x over `xs` (−∞ for none; NaNs are passed over, as `f32::max` does,
    /// so the order of the comparisons cannot matter but for the sign of a zero
    /// maximum), `xs` untouched: a softmax row's shift. Each comparison is x > m ? x : m,
    /// one vector instruction a lane (`f32::max`'s own NaN test takes three), over the
    /// [`LANES`], closed pairwise: on a row of a few vectors, the compiler's code
    /// for `f32::max` and a written-back scale took a third of the softmax's time.
    pub fn max_scaled(xs: &[f32], a: f32) -> f32 {
        #[inline(always)]
        fn larger(m: f32, x: f32) -> f32 {
            if x > m {
                x
            } else {
                m
            }
        }
        let mut acc = [f32::NEG_INFINITY; LANES];
        let mut rows = xs.chunks_exact(LANES);
        for row in &mut rows {
            for (m, &x) in acc.iter_mut().zip(row) {
                *m = larger(*m, x * a);
            }
        }
        for (m, &x) in acc.iter_mut().zip(rows.remainder()) {
            *m = larger(*m, x * a);
        }
        let mut w = LANES / 2;
        while w > 0 {
            for l in 0..w {
                acc[l] = larger(acc[l], acc[l + w]);
            }
            w /= 2;
        }
        acc[0]
    }
}

widest! {
    /// x ← e^(a·x − m) for every x of `xs`, by [`exp_f32`], a·x rounded first; returns
    /// their sum in the lanes' order ([`LANES`]): a softmax's exponentials and their total
    /// in one pass (a = 1 where the values are scaled already: 1·x is x).
    pub fn exp_sum(xs: &mut [f32], a: f32, m: f32) -> f32 {
        let mut acc = [0.0f32; LANES];
        let mut rows = xs.chunks_exact_mut(LANES);
        for row in &mut rows {
            for (s, x) in acc.iter_mut().zip(row) {
                *x = exp_f32(*x * a - m);
                *s += *x;
            }
        }
        for (s, x) in acc.iter_mut().zip(rows.into_remainder()) {
            *x = exp_f32(*x * a - m);
            *s += *x;
        }
        close_lanes(acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    widest! {
        fn sum_of_quotients(a: &[f32], b: &[f32]) -> f32 {
            let mut s = 0.0f32;
            for (x, y) in a.iter().zip(b) {
                s += (x / y).sqrt();
            }
            s
        }
    }

    #[test]
    fn every_width_gives_the_baseline_bits() {
        // The dispatched function against the same body called plainly: the sum is in
        // order whatever the width, and each quotient and root rounds once.
        let a: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin().abs() + 0.1).collect();
        let b: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.11).cos().abs() + 0.3).collect();
        let mut want = 0.0f32;
        for (x, y) in a.iter().zip(&b) {
            want += (x / y).sqrt();
        }
        assert_eq!(sum_of_quotients(&a, &b).to_bits(), want.to_bits());
        for a in [1.0, 0.5] {
            let mut xs: Vec<f32> = (0..777).map(|i| i as f32 * 0.25 - 120.0).collect();
            let exps: Vec<f32> = xs.iter().map(|&x| exp_f32(x * a - 3.0)).collect();
            let total = exp_sum(&mut xs, a, 3.0);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&xs), bits(&exps), "a = {a}");
            assert_eq!(total.to_bits(), sum_by_hand(&exps).to_bits(), "a = {a}");
        }
    }

    /// The sums' order written out ([`LANES`]): lane by lane in index order, then pairwise.
    fn sum_by_hand(xs: &[f32]) -> f32 {
        let mut lanes = [0.0f32; LANES];
        for (i, &x) in xs.iter().enumerate() {
            lanes[i % LANES] += x;
        }
        let mut w = LANES / 2;
        while w > 0 {
            for l in 0..w {
                lanes[l] += lanes[l + w];
            }
            w /= 2;
        }
        lanes[0]
    }

    #[test]
    fn dot_exp_sum_and_max_follow_their_documented_order() {
        let xs: Vec<f32> = (0..203).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.4).collect();
        let ys: Vec<f32> = (0..203).map(|i| ((i * 104_729) % 997) as f32 * 1e-2).collect();
        for n in [0, 1, 15, 16, 17, 64, 203] {
            let (x, y) = (&xs[..n], &ys[..n]);
            let mut exps = x.to_vec();
            let total = exp_sum(&mut exps, 1.0, 0.5);
            assert_eq!(total.to_bits(), sum_by_hand(&exps).to_bits(), "exp_sum of {n}");
            let prods: Vec<f32> = x.iter().zip(y).map(|(a, b)| a * b).collect();
            assert_eq!(dot(x, y).to_bits(), sum_by_hand(&prods).to_bits(), "dot of {n}");
            let scaled: Vec<f32> = x.iter().map(|v| v * 0.5).collect();
            assert_eq!(max_scaled(x, 0.5), scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max), "max of {n}");
        }
        assert_eq!(max_scaled(&[1.0, f32::NAN, 3.0, -2.0], 1.0), 3.0);
        assert_eq!(max_scaled(&[f32::NAN; 20], 1.0), f32::NEG_INFINITY);
    }
}
