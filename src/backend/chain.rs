//! Products whose every value is one chain of fused multiply-adds over the inner index in
//! order: c(i, j) = fma(a(i, k−1), b(k−1, j), … fma(a(i, 0), b(0, j), c₀)), from 0 or from
//! c's own value. Their bits therefore depend on neither the product's size nor on which
//! values are computed together, nor on the vector width: the AVX-512 and AVX2 kernels and
//! the portable loop agree bit for bit, and a convolution written over them gives a
//! sample the same bits alone or in any batch. Winograd's products run here
//! (`backend::winograd`), and the convolutions that multiply a sample's padded planes tap
//! by tap (`ops::conv2d`'s taps), whose right-hand rows are [`RhsRows::Listed`]: each row k
//! where its own offset says, not k rows apart; and attention's per-head products
//! (`ops::attention::cpu`), block by block over the keys the causal mask leaves.

use std::ops::Range;

use super::cpu::Accumulate;

/// Where row k of a product's right-hand side begins in its slice.
#[derive(Clone, Copy, Debug)]
pub enum RhsRows<'a> {
    /// At k·stride.
    Strided(usize),
    /// At `rows[k]`: one offset for every k (rows gathered from anywhere in the slice).
    Listed(&'a [usize]),
}

impl RhsRows<'_> {
    #[inline(always)]
    fn row(&self, k: usize) -> usize {
        match *self {
            RhsRows::Strided(s) => k * s,
            RhsRows::Listed(rows) => rows[k],
        }
    }
}

/// `c (m × n, row stride crs) (+)= a · b`, with a(i, k) at `a[i·ars + k·aks]` and b(k, j)
/// at `b[k·bks + j]`: every c(i, j) is one chain of fused multiply-adds over k in order,
/// from 0 ([`Accumulate::Overwrite`]) or from its value ([`Accumulate::Add`]).
#[allow(clippy::too_many_arguments)]
pub fn chain_gemm(
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    (ars, aks): (usize, usize),
    b: &[f32],
    bks: usize,
    c: &mut [f32],
    crs: usize,
    acc: Accumulate,
) {
    chain_product((m, n, k), a, (ars, aks), b, RhsRows::Strided(bks), c, crs, acc)
}

/// [`chain_gemm`] with b's rows wherever `rows` says: b(k, j) at `b[rows.row(k) + j]`.
#[allow(clippy::too_many_arguments)]
pub fn chain_product(
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    (ars, aks): (usize, usize),
    b: &[f32],
    rows: RhsRows<'_>,
    c: &mut [f32],
    crs: usize,
    acc: Accumulate,
) {
    let p = Operands { m, n, k, a, ars, aks, b, rows, crs, add: acc == Accumulate::Add };
    // SAFETY: `detect` returns an instruction set this processor has, or none.
    unsafe { chain_gemm_on(vector::Isa::detect(), &p, c) }
}

/// The operands of a [`chain_product`] but its destination: m × n over k, a(i, k) at
/// `a[i·ars + k·aks]`, b(k, j) at `b[rows.row(k) + j]`, c's rows `crs` apart, added to or
/// not.
#[derive(Clone, Copy)]
struct Operands<'a> {
    m: usize,
    n: usize,
    k: usize,
    a: &'a [f32],
    ars: usize,
    aks: usize,
    b: &'a [f32],
    rows: RhsRows<'a>,
    crs: usize,
    add: bool,
}

/// [`chain_gemm`] by `isa`'s kernel (its last n mod 8 columns, or all of them without one,
/// by the portable chain).
///
/// # Safety
/// The processor has `isa`, if any.
unsafe fn chain_gemm_on(isa: Option<vector::Isa>, p: &Operands, c: &mut [f32]) {
    let Operands { m, n, k, a, ars, aks, b, rows, crs, add } = *p;
    if m == 0 || n == 0 {
        return;
    }
    assert!(n <= crs || m == 1, "chain_gemm: rows of {n} values {crs} apart overlap");
    assert!((m - 1) * crs + n <= c.len(), "chain_gemm: destination out of bounds");
    if k > 0 {
        assert!((m - 1) * ars + (k - 1) * aks < a.len(), "chain_gemm: lhs out of bounds");
        let last = match rows {
            RhsRows::Strided(s) => (k - 1) * s,
            RhsRows::Listed(rows) => {
                assert_eq!(rows.len(), k, "chain_gemm: {} rows listed for an inner dimension of {k}", rows.len());
                rows.iter().copied().max().unwrap_or(0)
            }
        };
        assert!(last + n <= b.len(), "chain_gemm: rhs out of bounds");
    }
    let mut done = 0;
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa; // None: no vector kernel off x86-64
    #[cfg(target_arch = "x86_64")]
    if let Some(isa) = isa {
        let (a, b, c) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
        // SAFETY: the processor has `isa` (the contract), the requirement of its kernel's
        // target features; every index it reads or writes was bounds-checked above (the
        // largest of a, b and c; a listed row's offset is read from `rows` itself), and
        // `c` is borrowed mutably, apart from both.
        done = unsafe {
            match rows {
                RhsRows::Strided(s) => {
                    vector::chain(isa, m, n, &vector::Tile { k, a, ars, aks, b, rows: vector::Stride(s), c, crs, add })
                }
                RhsRows::Listed(r) => vector::chain(
                    isa,
                    m,
                    n,
                    &vector::Tile { k, a, ars, aks, b, rows: vector::List(r.as_ptr()), c, crs, add },
                ),
            }
        };
    }
    chain_columns(done..n, p, c);
}

/// The portable chain for columns `cols` (the vector kernel's tail too): f32::mul_add is
/// one fused multiply-add, as the vector FMA is.
fn chain_columns(cols: Range<usize>, p: &Operands, c: &mut [f32]) {
    let Operands { m, k, a, ars, aks, b, rows, crs, add, .. } = *p;
    for i in 0..m {
        for j in cols.clone() {
            let mut s = if add { c[i * crs + j] } else { 0.0 };
            for kk in 0..k {
                s = a[i * ars + kk * aks].mul_add(b[rows.row(kk) + j], s);
            }
            c[i * crs + j] = s;
        }
    }
}

/// The products' register kernel: one body over a [`vector::Register`] type, compiled
/// for AVX-512F (zmm) and for AVX2 (ymm), each with FMA, the widest the processor has
/// taken. A tile of R rows × NV registers of c stays in registers while k runs, and
/// every value is one fused multiply-add per k, in order: the same chain as the portable
/// loop's, so every width gives the same bits.
#[cfg(target_arch = "x86_64")]
mod vector {
    use std::arch::x86_64::*;

    /// The vector instruction sets the kernel is compiled for.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) enum Isa {
        /// 32 zmm registers: tiles of up to 12 rows × 2 zmm (24 accumulators, two for b's
        /// row and one for a's broadcast value: a 12-filter convolution is one tile), then
        /// narrower columns.
        Avx512,
        /// 16 ymm registers: tiles of up to 6 rows × 2 ymm (12 accumulators, two for b's
        /// row and one for a's broadcast value).
        Avx2,
    }

    impl Isa {
        /// The widest this processor has, with FMA; None on an older one.
        pub(super) fn detect() -> Option<Isa> {
            use std::arch::is_x86_feature_detected as has;
            if !has!("fma") {
                None
            } else if has!("avx512f") {
                Some(Isa::Avx512)
            } else if has!("avx2") {
                Some(Isa::Avx2)
            } else {
                None
            }
        }

        /// Every instruction set of the kernel this processor has (the tests run each).
        #[cfg(test)]
        pub(super) fn all_here() -> Vec<Isa> {
            use std::arch::is_x86_feature_detected as has;
            let fma = has!("fma");
            [(Isa::Avx512, fma && has!("avx512f")), (Isa::Avx2, fma && has!("avx2"))]
                .into_iter()
                .filter_map(|(isa, here)| here.then_some(isa))
                .collect()
        }
    }

    /// [`super::chain_gemm`] over the product `whole` (its corner at (0, 0)) on `isa`;
    /// returns the first column it left to the portable loop (the last n mod 8).
    ///
    /// # Safety
    /// The processor has `isa` and FMA; `whole`'s a, b and c cover every index of the
    /// m × n product over its k (as `chain_gemm` checks), and c does not overlap a or b.
    pub(super) unsafe fn chain<R: Rows>(isa: Isa, m: usize, n: usize, whole: &Tile<R>) -> usize {
        // SAFETY: the contract, passed on.
        unsafe {
            match isa {
                Isa::Avx512 => avx512(m, n, whole),
                Isa::Avx2 => avx2(m, n, whole),
            }
        }
    }

    /// # Safety
    /// As [`chain`], on a processor with AVX-512F and FMA.
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn avx512<R: Rows>(m: usize, n: usize, whole: &Tile<R>) -> usize {
        // SAFETY: the contract, passed on.
        unsafe {
            let j = whole.sweep::<__m512, 2, 12>(m, n, 0);
            let j = whole.sweep::<__m512, 1, 12>(m, n, j);
            whole.sweep::<__m256, 1, 8>(m, n, j)
        }
    }

    /// # Safety
    /// As [`chain`], on a processor with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2<R: Rows>(m: usize, n: usize, whole: &Tile<R>) -> usize {
        // SAFETY: the contract, passed on.
        unsafe {
            let j = whole.sweep::<__m256, 2, 6>(m, n, 0);
            whole.sweep::<__m256, 1, 6>(m, n, j)
        }
    }

    /// A vector register of f32 lanes, and the operations the kernel needs of it.
    ///
    /// # Safety
    /// Each method requires its type's instruction set (and FMA), and the pointers it
    /// reads or writes to cover `LANES` values (one for `broadcast`).
    trait Register: Copy {
        const LANES: usize;
        unsafe fn zero() -> Self;
        unsafe fn load(p: *const f32) -> Self;
        unsafe fn broadcast(p: *const f32) -> Self;
        /// a·b + c, rounded once.
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
        unsafe fn store(self, p: *mut f32);
    }

    /// `impl Register` for a register type from its intrinsics, under its target features.
    macro_rules! register {
        ($t:ty, $lanes:expr, $features:literal, $zero:ident, $load:ident, $set1:ident, $fma:ident, $store:ident) => {
            impl Register for $t {
                const LANES: usize = $lanes;
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn zero() -> Self {
                    $zero()
                }
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn load(p: *const f32) -> Self {
                    // SAFETY: p covers LANES values (the trait's contract).
                    unsafe { $load(p) }
                }
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn broadcast(p: *const f32) -> Self {
                    // SAFETY: p points at a value (the trait's contract).
                    $set1(unsafe { *p })
                }
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
                    $fma(a, b, c)
                }
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn store(self, p: *mut f32) {
                    // SAFETY: p covers LANES values (the trait's contract).
                    unsafe { $store(p, self) }
                }
            }
        };
    }

    register!(
        __m256,
        8,
        "avx2,fma",
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_storeu_ps
    );
    register!(
        __m512,
        16,
        "avx512f,fma",
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_storeu_ps
    );

    /// Where b's row k begins, from the tile's b: k·stride ([`Stride`]) or a listed offset
    /// ([`List`]).
    pub(super) trait Rows: Copy {
        /// # Safety
        /// k is below the tile's inner dimension.
        unsafe fn at(self, k: usize) -> usize;
    }

    /// b's rows `.0` apart.
    #[derive(Clone, Copy)]
    pub(super) struct Stride(pub(super) usize);

    /// b's row k at the offset `.0[k]` (a list of one offset for every k).
    #[derive(Clone, Copy)]
    pub(super) struct List(pub(super) *const usize);

    impl Rows for Stride {
        #[inline(always)]
        unsafe fn at(self, k: usize) -> usize {
            k * self.0
        }
    }

    impl Rows for List {
        #[inline(always)]
        unsafe fn at(self, k: usize) -> usize {
            // SAFETY: the list holds an offset for every k of the tile (the contract).
            unsafe { *self.0.add(k) }
        }
    }

    /// A product's operands from one corner on: a(i, k) at `a + i·ars + k·aks`, b(k, j) at
    /// `b + rows.at(k) + j`, c(i, j) at `c + i·crs + j`, over k values of the inner index.
    pub(super) struct Tile<R> {
        pub(super) k: usize,
        pub(super) a: *const f32,
        pub(super) ars: usize,
        pub(super) aks: usize,
        pub(super) b: *const f32,
        pub(super) rows: R,
        pub(super) c: *mut f32,
        pub(super) crs: usize,
        pub(super) add: bool,
    }

    impl<R: Rows> Tile<R> {
        /// The same operands from the corner (i, j) on.
        ///
        /// # Safety
        /// Row i of a and c, and column j of b and c, are inside the product.
        #[inline(always)]
        unsafe fn at(&self, i: usize, j: usize) -> Tile<R> {
            // SAFETY: the offsets stay inside the product (the contract).
            let (a, b, c) = unsafe { (self.a.add(i * self.ars), self.b.add(j), self.c.add(i * self.crs + j)) };
            Tile { a, b, c, ..*self }
        }

        /// The columns from j on, NV·LANES at a time while they fit; returns the first
        /// column left.
        ///
        /// # Safety
        /// The processor has V's instruction set; the product is m × n (the contract of
        /// [`chain`]).
        #[inline(always)]
        unsafe fn sweep<V: Register, const NV: usize, const MR: usize>(
            &self,
            m: usize,
            n: usize,
            mut j: usize,
        ) -> usize {
            while j + NV * V::LANES <= n {
                // SAFETY: columns j..j + NV·LANES are inside the product.
                unsafe { self.columns::<V, NV, MR>(m, j) };
                j += NV * V::LANES;
            }
            j
        }

        /// Columns j..j + NV·LANES of all m rows: MR rows a register tile, then the rows
        /// left (MR ≤ 12).
        ///
        /// # Safety
        /// The processor has V's instruction set; those columns are inside the product.
        #[inline(always)]
        unsafe fn columns<V: Register, const NV: usize, const MR: usize>(&self, m: usize, j: usize) {
            let mut i = 0;
            while i + MR <= m {
                // SAFETY: rows i..i+MR and the columns lie inside the product.
                unsafe { self.at(i, j).run::<V, MR, NV>() };
                i += MR;
            }
            if i == m {
                return;
            }
            // SAFETY: as above, for the 1 to MR − 1 rows left.
            unsafe {
                let t = self.at(i, j);
                // (At most MR − 1 rows are left: saying so lets the compiler drop the
                // arms a kernel with fewer rows never takes.)
                match (m - i).min(MR - 1) {
                    1 => t.run::<V, 1, NV>(),
                    2 => t.run::<V, 2, NV>(),
                    3 => t.run::<V, 3, NV>(),
                    4 => t.run::<V, 4, NV>(),
                    5 => t.run::<V, 5, NV>(),
                    6 => t.run::<V, 6, NV>(),
                    7 => t.run::<V, 7, NV>(),
                    8 => t.run::<V, 8, NV>(),
                    9 => t.run::<V, 9, NV>(),
                    10 => t.run::<V, 10, NV>(),
                    _ => t.run::<V, 11, NV>(),
                }
            }
        }

        /// RN rows × NV registers of c, each value one FMA chain over k in order.
        ///
        /// # Safety
        /// The processor has V's instruction set; the RN rows and NV·LANES columns from the
        /// corner, and a's and b's values for them over k, are inside the product.
        #[inline(always)]
        unsafe fn run<V: Register, const RN: usize, const NV: usize>(&self) {
            // SAFETY (the block): every pointer below stays in the tile (the contract), and
            // the processor has V's instruction set.
            unsafe {
                let mut acc = [[V::zero(); NV]; RN];
                if self.add {
                    for (r, row) in acc.iter_mut().enumerate() {
                        for (v, x) in row.iter_mut().enumerate() {
                            *x = V::load(self.c.add(r * self.crs + v * V::LANES));
                        }
                    }
                }
                let mut b = [V::zero(); NV];
                for kk in 0..self.k {
                    for (v, x) in b.iter_mut().enumerate() {
                        *x = V::load(self.b.add(self.rows.at(kk) + v * V::LANES));
                    }
                    for (r, row) in acc.iter_mut().enumerate() {
                        let ar = V::broadcast(self.a.add(r * self.ars + kk * self.aks));
                        for (x, &bb) in row.iter_mut().zip(&b) {
                            *x = V::fma(ar, bb, *x);
                        }
                    }
                }
                for (r, row) in acc.iter().enumerate() {
                    for (v, x) in row.iter().enumerate() {
                        x.store(self.c.add(r * self.crs + v * V::LANES));
                    }
                }
            }
        }
    }
}

/// Off x86-64 there is no vector kernel: the portable chain computes every product.
#[cfg(not(target_arch = "x86_64"))]
mod vector {
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) enum Isa {}

    impl Isa {
        pub(super) fn detect() -> Option<Isa> {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "chain_gemm: destination out of bounds")]
    fn a_product_past_its_destination_is_refused() {
        // 3 rows of 8, 8 apart, need 24 values: 23 are refused before any is written.
        chain_gemm((3, 8, 2), &[0.0; 6], (2, 1), &[0.0; 16], 8, &mut [0.0; 23], 8, Accumulate::Overwrite);
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn every_vector_width_gives_the_portable_chains_bits() {
        // Each kernel this processor has (AVX-512's 12-row tiles of 32, 16 and 8 columns,
        // AVX2's 6-row tiles of 16 and 8), not only the widest that chain_gemm takes:
        // row counts that leave every remainder of a tile (1 to 11 rows after whole tiles
        // of 12, 1 to 5 after tiles of 6), column counts around each tile width, both
        // accumulations, strided operands; the values between c's rows untouched.
        let shapes = [
            (17, 56, 9),
            (9, 40, 37),
            (8, 32, 3),
            (7, 24, 64),
            (6, 8, 1),
            (1, 15, 5),
            (12, 25, 16),
            (5, 3, 0),
            (23, 48, 7),
            (22, 24, 5),
            (4, 16, 3),
            (3, 8, 2),
            (2, 40, 6),
        ];
        for isa in vector::Isa::all_here() {
            for (m, n, k) in shapes {
                for add in [false, true] {
                    let a = rand(m as u64, m * k * 2 + 1);
                    let b = rand(n as u64 + 50, k * (n + 3) + 1);
                    let c0 = rand(7, m * (n + 2));
                    let mut fast = c0.clone();
                    let p = Operands {
                        m,
                        n,
                        k,
                        a: &a,
                        ars: 1,
                        aks: 2 * m,
                        b: &b,
                        rows: RhsRows::Strided(n + 3),
                        crs: n + 2,
                        add,
                    };
                    // SAFETY: `all_here` lists the instruction sets this processor has.
                    unsafe { chain_gemm_on(Some(isa), &p, &mut fast) };
                    let mut slow = c0.clone();
                    chain_columns(0..n, &p, &mut slow);
                    for (at, ((f, s), c)) in fast.iter().zip(&slow).zip(&c0).enumerate() {
                        let want = if at % (n + 2) >= n { c } else { s };
                        assert_eq!(f.to_bits(), want.to_bits(), "{isa:?} {m}×{n}×{k} add {add}: value {at}");
                    }
                }
            }
        }
    }
    /// Rows listed anywhere in b, repeated and out of order (a convolution's taps read
    /// overlapping rows of one plane): every kernel gives the portable chain's bits, and a
    /// listed stride gives the strided product's.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn listed_rows_give_the_portable_chains_bits_on_every_width() {
        for isa in vector::Isa::all_here() {
            for (m, n, k) in [(12, 48, 27), (13, 64, 9), (4, 16, 5), (1, 40, 3), (9, 8, 12)] {
                let a = rand(m as u64 + 9, m * k);
                let b = rand(n as u64 + 70, 5 * n + 40);
                let listed: Vec<usize> = (0..k).map(|kk| (kk * 37 + kk / 3) % (4 * n + 40)).collect();
                let p = Operands {
                    m,
                    n,
                    k,
                    a: &a,
                    ars: k,
                    aks: 1,
                    b: &b,
                    rows: RhsRows::Listed(&listed),
                    crs: n,
                    add: false,
                };
                let mut fast = vec![f32::NAN; m * n];
                // SAFETY: `all_here` lists the instruction sets this processor has.
                unsafe { chain_gemm_on(Some(isa), &p, &mut fast) };
                let mut slow = vec![f32::NAN; m * n];
                chain_columns(0..n, &p, &mut slow);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&fast), bits(&slow), "{isa:?} {m}×{n}×{k}");
            }
        }
        let (m, n, k) = (5, 24, 7);
        let (a, b) = (rand(1, m * k), rand(2, k * 30));
        let (mut strided, mut listed) = (vec![0.0; m * n], vec![0.0; m * n]);
        chain_gemm((m, n, k), &a, (k, 1), &b, 30, &mut strided, n, Accumulate::Overwrite);
        let rows: Vec<usize> = (0..k).map(|kk| kk * 30).collect();
        chain_product((m, n, k), &a, (k, 1), &b, RhsRows::Listed(&rows), &mut listed, n, Accumulate::Overwrite);
        assert_eq!(strided, listed);
    }

    #[test]
    #[should_panic(expected = "chain_gemm: 3 rows listed for an inner dimension of 2")]
    fn a_list_of_rows_not_one_for_each_k_is_refused() {
        let mut c = [0.0; 8];
        let rows = RhsRows::Listed(&[0, 1, 2]);
        chain_product((1, 8, 2), &[1.0; 2], (2, 1), &[0.0; 16], rows, &mut c, 8, Accumulate::Overwrite);
    }

    #[test]
    #[should_panic(expected = "chain_gemm: rhs out of bounds")]
    fn a_listed_row_past_the_rhs_is_refused() {
        // A row at 10 of 16 values needs 6 more for n = 8.
        let mut c = [0.0; 8];
        chain_product(
            (1, 8, 2),
            &[1.0; 2],
            (2, 1),
            &[0.0; 16],
            RhsRows::Listed(&[0, 10]),
            &mut c,
            8,
            Accumulate::Overwrite,
        );
    }

    fn rand(seed: u64, len: usize) -> Vec<f32> {
        let mut r = crate::rng::SplitMix64::new(seed);
        (0..len).map(|_| r.next_f32() - 0.5).collect()
    }
}
