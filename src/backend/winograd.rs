//! Winograd's minimal filtering F(4×4, 3×3) (Lavin and Gray, 2016) for the CPU's 3×3
//! stride-1 convolutions: every 4×4 block of outputs from a 6×6 tile of input in 36
//! multiply-adds a channel pair instead of 144, so the three products of a training step
//! (the output, the input's gradient, the weight's gradient) cost 4 times fewer. It owns
//! the transforms, the products they feed, and the order of every sum; `ops::conv2d`
//! decides where it runs ([`applies`]: the shape alone) and owns the layer.
//!
//! The legend: N samples, C input and O output channels, a sample's T tiles (one per 4×4
//! block of outputs, row-major), ξ the 36 points of a transformed tile (ξ = 6·r + s).
//! With the transforms Bᵀ (6×6), G (6×3) and Aᵀ (4×6) below (the interpolation points
//! 0, ±1, ±2 and ∞), a tile d (6×6, one channel), a kernel g (3×3) and the output y (4×4):
//!
//! ```text
//! forward        U = Bᵀ d B   V = G g Gᵀ        M[ξ] = U[ξ] · V[ξ]   (T, C)·(C, O)     y = Aᵀ M A
//! input grad     dM = A dy Aᵀ                   dU[ξ] = dM[ξ] · V[ξ]ᵀ (T, O)·(O, C)    dd = B dU Bᵀ (added over tiles)
//! weight grad    dV[ξ] += U[ξ]ᵀ · dM[ξ]  (C, T)·(T, O), over every tile    dg = Gᵀ dV G
//! ```
//!
//! The backward is the adjoint of the forward's linear map, so it is the exact gradient of
//! what the forward returns (up to rounding), as PyTorch's is of its direct convolution.
//! The data transforms multiply only by 2, 4 and 8, exactly; the weight's transform and
//! its gradient's run in f64 with 24·G's integers, then scale by 1/576 and round to f32.
//!
//! Determinism: every product value is one chain of fused multiply-adds over its inner
//! index in order ([`chain_gemm`]), the weight gradient one chain over the chunk's tiles
//! in sample-then-tile order, and the input gradient's tiles are added in tile order. No
//! result depends on which rows are computed together, the vector width, the thread
//! count or the batch: a sample's output is bitwise the same alone or in any batch.

use std::ops::Range;

use super::chain::chain_gemm;
use super::cpu::{into_padded, out_of_padded, transpose, Accumulate, Padded, Pieces, Samples};
use super::simd::widest;

/// Outputs along a tile's side (4), and the input it reads (6 = 4 + 3 − 1).
const STEP: usize = 4;
const SIDE: usize = STEP + 2;
/// Points of a transformed tile (6×6).
const XI: usize = SIDE * SIDE;

/// Whether a convolution runs by F(4×4, 3×3) on the CPU: a 3×3 kernel at stride 1 from
/// at least 8 input channels to at least 16 output channels, where the products are wide
/// enough for the transforms to pay (a 1-channel stem stays with im2col). Each of the 36
/// points' products has O columns: at O = 12 (a DenseNet's growth) they are too narrow
/// for the GEMM kernel's register tiles, and im2col's rows ran the DenseNet's 48→12
/// convolutions 4.5× faster (`lockstep bench layers --model densenet`, an AVX-512 Xeon);
/// they now run by a GEMM per tap (`ops::conv2d`'s taps). A function of the shape alone.
pub fn applies(c: usize, o: usize, kernel: (usize, usize), stride: usize) -> bool {
    kernel == (3, 3) && stride == 1 && c >= 8 && o >= 16
}

/// One sample's geometry: C×H×W in, O×OH×OW out, the input's top and left padding (the
/// bottom and right follow from OH, OW). OH = H + pads − 2, as for any 3×3 kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geom {
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub o: usize,
    pub oh: usize,
    pub ow: usize,
    pub pad_top: usize,
    pub pad_left: usize,
}

impl Geom {
    fn tiles_high(&self) -> usize {
        self.oh.div_ceil(STEP)
    }
    fn tiles_wide(&self) -> usize {
        self.ow.div_ceil(STEP)
    }
    /// Where tile t's outputs start, (row, column); its input in the padded sample starts
    /// there too.
    #[inline(always)]
    fn origin(&self, t: usize) -> (usize, usize) {
        (STEP * (t / self.tiles_wide()), STEP * (t % self.tiles_wide()))
    }
    /// T: a sample's tiles.
    pub fn tiles(&self) -> usize {
        self.tiles_high() * self.tiles_wide()
    }
    /// The padded channels-last sample the tiles read: (HP, WP, C), the image at
    /// (pad_top, pad_left), zeros around it; tile (i, j) reads rows 4i..4i+6, columns
    /// 4j..4j+6, all inside.
    fn padded(&self) -> (usize, usize) {
        (STEP * self.tiles_high() + 2, STEP * self.tiles_wide() + 2)
    }
    /// Where the image lies in its padded sample.
    fn place(&self) -> Padded {
        Padded { w: self.w, wp: self.padded().1, top: self.pad_top, left: self.pad_left, c: self.c }
    }
    fn padded_len(&self) -> usize {
        let (hp, wp) = self.padded();
        hp * wp * self.c
    }
}

/// The most bytes of transformed tiles (U and M of a piece) held at a time, so that the
/// products read them back from the core's L2 cache.
const PIECE_BUDGET: usize = 256 << 10;

/// How a chunk is cut into [`Pieces`] of tiles: within [`PIECE_BUDGET`], or 16 tiles where
/// a tile's U and M alone exceed a 16th of it. The bits do not depend on it anyway.
fn tiling(g: &Geom) -> Pieces {
    let per_tile = XI * (g.c + g.o) * 4;
    Pieces::fit(g.tiles(), per_tile, PIECE_BUDGET.max(16 * per_tile))
}

/// One chunk's work buffers, resized for each layer (contents overwritten before use).
/// Borrowed: the convolution lends the same buffers its unfoldings use, so that a pool
/// of them serving both kinds of layer holds the larger of each, not both.
#[derive(Debug)]
pub struct Scratch<'a> {
    /// A piece's samples, padded channels-last: samples × (HP, WP, C).
    pub xp: &'a mut Vec<f32>,
    /// Transformed input of a piece's tiles, `[ξ][row][C]`; in the backward, dU after dV.
    pub u: &'a mut Vec<f32>,
    /// The products of a piece's tiles, `[ξ][row][O]`; in the backward, dM.
    pub m: &'a mut Vec<f32>,
    /// A piece's outputs or output gradients channels-last: samples × (OH, OW, O).
    pub yt: &'a mut Vec<f32>,
    /// Backward: a piece's input gradients, padded channels-last: samples × (HP, WP, C).
    pub dxp: &'a mut Vec<f32>,
}

/// The distance between two points' planes of U or M (ξ to ξ + 1) holding `rows` rows of
/// `width` values: at least their values, rounded up to an odd number of 64-byte lines.
/// The transforms write (or read) all 36 planes of a tile at once, and lines 4 KiB apart
/// share one of L1's 8-way sets: at 512 values (2 KiB) apart (`resnet8`'s 32 channels at
/// 14 × 14) the 36 planes fell on 2 places, 18 to a set. An odd number of lines spreads
/// them over all 64 sets. Only where the values lie changes, not one operation.
fn plane_stride(rows: usize, width: usize) -> usize {
    const LINE: usize = 16;
    (rows * width).div_ceil(LINE) / 2 * 2 * LINE + LINE
}

/// The f32s a chunk's [`Scratch`] holds at most (the larger of forward and backward: the
/// backward's, which adds `dxp`).
pub fn scratch_floats(g: &Geom) -> usize {
    let t = tiling(g);
    let rows = t.samples * t.band;
    2 * t.samples * g.padded_len()
        + XI * (plane_stride(rows, g.c) + plane_stride(rows, g.o))
        + t.samples * g.oh * g.ow * g.o
}

/// The f32s of the transformed weight, V and Vᵀ.
pub fn weight_floats(g: &Geom) -> usize {
    2 * XI * g.c * g.o
}

/// The f32s of a chunk's transformed weight gradient dV.
pub fn dv_floats(g: &Geom) -> usize {
    XI * g.c * g.o
}

/// The weight transformed for the products: V as `[ξ][C][O]` (forward) and as `[ξ][O][C]`
/// (the input's gradient), each 4×4 block G g Gᵀ.
#[derive(Clone, Debug)]
pub struct Weights {
    v: Vec<f32>,
    vt: Vec<f32>,
}

/// 24·G applied to a column (a, b, c) of a kernel, in f64, where G = [[¼, 0, 0],
/// [−⅙, −⅙, −⅙], [−⅙, ⅙, −⅙], [1/24, 1/12, ⅙], [1/24, −1/12, ⅙], [0, 0, 1]]: small
/// integer coefficients, so that both passes' f64 sums of a kernel's f32 values are exact
/// unless those values span more than 2¹⁶ in magnitude (and then off by f64's rounding,
/// far below f32's); G's fractions are one scaling at the end ([`SCALE`]).
#[inline(always)]
fn g24_col(a: f64, b: f64, c: f64) -> [f64; SIDE] {
    let (ac, b2) = (a + 4.0 * c, 2.0 * b);
    [6.0 * a, -4.0 * (a + b + c), -4.0 * (a - b + c), ac + b2, ac - b2, 24.0 * c]
}

/// 24·Gᵀ applied to a column of six, in f64 (the adjoint of [`g24_col`]).
#[inline(always)]
fn g24t_col(m: [f64; SIDE]) -> [f64; 3] {
    let (s12, s34) = (m[1] + m[2], m[3] + m[4]);
    [6.0 * m[0] - 4.0 * s12 + s34, 4.0 * (m[2] - m[1]) + 2.0 * (m[3] - m[4]), 4.0 * (s34 - s12) + 24.0 * m[5]]
}

/// G g Gᵀ = (24·G) g (24·G)ᵀ / 576, and likewise Gᵀ dV G.
const SCALE: f64 = 1.0 / 576.0;

/// G g Gᵀ for every (o, c) of weight (O, C, 3, 3), computed in f64, then rounded to f32.
pub fn transform_weights(weight: &[f32], c: usize, o: usize) -> Weights {
    assert_eq!(weight.len(), o * c * 9, "winograd: weight of {} values for ({o}, {c}, 3, 3)", weight.len());
    // Each kernel's 36 values together, in the weight's order (in `v`, for now); then the
    // transposes move them into their planes: Vᵀ `[ξ][O][C]` at once, V plane by plane.
    // (Writing each value straight into its plane took 2–3 times as long from 32 × 32
    // channels on: 36 streams whose planes lie a multiple of 4 KiB apart share one set of
    // L1 lines.)
    let (mut v, mut vt) = (vec![0.0f32; XI * c * o], vec![0.0f32; XI * c * o]);
    for (k, out) in weight.chunks_exact(9).zip(v.chunks_exact_mut(XI)) {
        let g = |i: usize| k[i] as f64;
        // t = G g (6×3) by columns, then each row of t through G: v = t Gᵀ (6×6)
        let [c0, c1, c2] = [g24_col(g(0), g(3), g(6)), g24_col(g(1), g(4), g(7)), g24_col(g(2), g(5), g(8))];
        for (row, ((&a, &b), &d)) in out.chunks_exact_mut(SIDE).zip(c0.iter().zip(&c1).zip(&c2)) {
            for (x, val) in row.iter_mut().zip(g24_col(a, b, d)) {
                *x = (val * SCALE) as f32;
            }
        }
    }
    transpose(&v, o * c, XI, &mut vt);
    for (plane, plane_t) in v.chunks_exact_mut(c * o).zip(vt.chunks_exact(c * o)) {
        transpose(plane_t, o, c, plane);
    }
    Weights { v, vt }
}

/// The weight's gradient (O, C, 3, 3) from dV `[ξ][C][O]`: Gᵀ dV G for every (o, c), the
/// adjoint of [`transform_weights`], computed in f64, then rounded to f32.
pub fn weight_grad(dv: &[f32], c: usize, o: usize) -> Vec<f32> {
    assert_eq!(dv.len(), XI * c * o, "winograd: dV of {} values for ({c}, {o}) channels", dv.len());
    let mut dw = Vec::with_capacity(o * c * 9);
    for oo in 0..o {
        for ch in 0..c {
            let m = |xi: usize| dv[(xi * c + ch) * o + oo] as f64;
            // t = Gᵀ dV (3×6) by columns s, then each row of t through Gᵀ: dg = t G (3×3)
            let cols: [[f64; 3]; SIDE] = std::array::from_fn(|s| g24t_col(std::array::from_fn(|r| m(SIDE * r + s))));
            for a in 0..3 {
                dw.extend(g24t_col(cols.map(|col| col[a])).map(|val| (val * SCALE) as f32));
            }
        }
    }
    dw
}

// ---- the transforms, channels innermost --------------------------------------------

/// L lanes of f32 at once: the transforms' values, a channel per lane.
type Lanes<const L: usize> = [f32; L];

#[inline(always)]
fn load<const L: usize>(s: &[f32], at: usize) -> Lanes<L> {
    let mut v = [0.0; L];
    v.copy_from_slice(&s[at..at + L]);
    v
}
#[inline(always)]
fn add<const L: usize>(mut a: Lanes<L>, b: Lanes<L>) -> Lanes<L> {
    for l in 0..L {
        a[l] += b[l];
    }
    a
}
#[inline(always)]
fn sub<const L: usize>(mut a: Lanes<L>, b: Lanes<L>) -> Lanes<L> {
    for l in 0..L {
        a[l] -= b[l];
    }
    a
}
/// k·a for k a power of two: exact.
#[inline(always)]
fn times<const L: usize>(k: f32, mut a: Lanes<L>) -> Lanes<L> {
    for x in &mut a {
        *x *= k;
    }
    a
}
#[inline(always)]
fn neg<const L: usize>(a: Lanes<L>) -> Lanes<L> {
    times(-1.0, a)
}

// Every multiplication in the transforms below is by a power of two, so each value is
// rounded only by its additions.

/// Bᵀ applied to a column of six: Bᵀ = [[4, 0, −5, 0, 1, 0], [0, −4, −4, 1, 1, 0],
/// [0, 4, −4, −1, 1, 0], [0, −2, −1, 2, 1, 0], [0, 2, −1, −2, 1, 0], [0, 4, 0, −5, 0, 1]].
#[inline(always)]
fn bt_col<const L: usize>(d: [Lanes<L>; SIDE]) -> [Lanes<L>; SIDE] {
    let [d0, d1, d2, d3, d4, d5] = d;
    let (d42, d31) = (sub(d4, d2), sub(d3, d1));
    [
        add(times(4.0, sub(d0, d2)), d42),
        sub(add(d3, d4), times(4.0, add(d1, d2))),
        add(sub(d4, d3), times(4.0, sub(d1, d2))),
        add(d42, times(2.0, d31)),
        sub(d42, times(2.0, d31)),
        sub(sub(d5, d3), times(4.0, d31)),
    ]
}

/// B applied to a column of six (the adjoint of [`bt_col`]).
#[inline(always)]
fn b_col<const L: usize>(u: [Lanes<L>; SIDE]) -> [Lanes<L>; SIDE] {
    let [u0, u1, u2, u3, u4, u5] = u;
    let (r, s) = (sub(u1, u2), sub(u3, u4));
    [
        times(4.0, u0),
        sub(times(4.0, sub(u5, r)), times(2.0, s)),
        neg(add(times(4.0, add(add(u0, u1), u2)), add(add(u0, u3), u4))),
        add(sub(r, u5), times(2.0, sub(s, times(2.0, u5)))),
        add(add(u0, add(u1, u2)), add(u3, u4)),
        u5,
    ]
}

/// Aᵀ applied to a column of six: Aᵀ = [[1, 1, 1, 1, 1, 0], [0, 1, −1, 2, −2, 0],
/// [0, 1, 1, 4, 4, 0], [0, 1, −1, 8, −8, 1]].
#[inline(always)]
fn at_col<const L: usize>(m: [Lanes<L>; SIDE]) -> [Lanes<L>; STEP] {
    let [m0, m1, m2, m3, m4, m5] = m;
    let (s12, d12, s34, d34) = (add(m1, m2), sub(m1, m2), add(m3, m4), sub(m3, m4));
    [add(add(m0, s12), s34), add(d12, times(2.0, d34)), add(s12, times(4.0, s34)), add(add(d12, times(8.0, d34)), m5)]
}

/// A applied to a column of four (the adjoint of [`at_col`]).
#[inline(always)]
fn a_col<const L: usize>(y: [Lanes<L>; STEP]) -> [Lanes<L>; SIDE] {
    let [y0, y1, y2, y3] = y;
    let (e, o) = (add(y0, y2), add(y1, y3));
    let (e4, o4) = (add(y0, times(4.0, y2)), times(2.0, add(y1, times(4.0, y3))));
    [y0, add(e, o), sub(e, o), add(e4, o4), sub(e4, o4), y3]
}

/// `[e(0), e(1), …]` for 4 or 6 indices, each a constant: the transforms' small arrays
/// built in place, with no zeroed array to fill (LLVM emitted a `memset` call for each
/// of those) and no closure (`std::array::from_fn`'s does not inherit the caller's vector
/// features, so it was not inlined into the AVX2 loops).
macro_rules! each {
    (4, |$i:ident| $e:expr) => {
        [{ const $i: usize = 0; $e }, { const $i: usize = 1; $e }, { const $i: usize = 2; $e }, { const $i: usize = 3; $e }]
    };
    (6, |$i:ident| $e:expr) => {
        [
            { const $i: usize = 0; $e },
            { const $i: usize = 1; $e },
            { const $i: usize = 2; $e },
            { const $i: usize = 3; $e },
            { const $i: usize = 4; $e },
            { const $i: usize = 5; $e },
        ]
    };
}

/// Bᵀ d B of one tile for channels ch..ch+L: d(i, j) at `d[at + i·rs + j·cs + ch]`,
/// point ξ written at `u[ξ·us + ch]`.
#[inline(always)]
fn input_lanes<const L: usize>(d: &[f32], at: usize, rs: usize, cs: usize, u: &mut [f32], us: usize) {
    // t[j][r] is (Bᵀ d)(r, j): the columns first, then the rows of t
    let t: [[Lanes<L>; SIDE]; SIDE] = each!(6, |J| bt_col(each!(6, |I| load::<L>(d, at + I * rs + J * cs))));
    for r in 0..SIDE {
        for (s, val) in bt_col(each!(6, |J| t[J][r])).into_iter().enumerate() {
            u[(SIDE * r + s) * us..][..L].copy_from_slice(&val);
        }
    }
}

/// Aᵀ m A of one tile for channels ch..ch+L: m(ξ) at `m[ξ·ms]`, the 4×4 outputs by rows.
#[inline(always)]
fn output_lanes<const L: usize>(m: &[f32], ms: usize) -> [[Lanes<L>; STEP]; STEP] {
    // s[j][p] is (Aᵀ m)(p, j)
    let s: [[Lanes<L>; STEP]; SIDE] = each!(6, |J| at_col(each!(6, |R| load::<L>(m, (SIDE * R + J) * ms))));
    each!(4, |P| at_col(each!(6, |J| s[J][P])))
}

/// A dy Aᵀ of one tile (the adjoint of [`output_lanes`]): dy's 4×4 by rows, point ξ
/// written at `dm[ξ·ms]`.
#[inline(always)]
fn output_grad_lanes<const L: usize>(dy: [[Lanes<L>; STEP]; STEP], dm: &mut [f32], ms: usize) {
    // c[q][r] is (A dy)(r, q)
    let c: [[Lanes<L>; SIDE]; STEP] = each!(4, |Q| a_col(each!(4, |P| dy[P][Q])));
    for r in 0..SIDE {
        for (s, val) in a_col(each!(4, |Q| c[Q][r])).into_iter().enumerate() {
            dm[(SIDE * r + s) * ms..][..L].copy_from_slice(&val);
        }
    }
}

/// B du Bᵀ of one tile (the adjoint of [`input_lanes`]), added into the 6×6 window of
/// `dx` at `at` (rows `rs`, columns `cs` apart): du(ξ) at `du[ξ·us]`.
#[inline(always)]
fn input_grad_lanes<const L: usize>(du: &[f32], us: usize, dx: &mut [f32], at: usize, rs: usize, cs: usize) {
    // t[s][i] is (B du)(i, s)
    let t: [[Lanes<L>; SIDE]; SIDE] = each!(6, |S| b_col(each!(6, |R| load::<L>(du, (SIDE * R + S) * us))));
    for i in 0..SIDE {
        for (j, val) in b_col(each!(6, |S| t[S][i])).into_iter().enumerate() {
            let dst = &mut dx[at + i * rs + j * cs..][..L];
            let sum = add(load::<L>(dst, 0), val);
            dst.copy_from_slice(&sum);
        }
    }
}

/// Calls `f::<8>` over the channels 8 at a time, then `f::<1>` over the rest.
macro_rules! by_lanes {
    ($c:expr, |$ch:ident, $l:ident| $body:expr) => {{
        let mut $ch = 0;
        while $ch + 8 <= $c {
            {
                const $l: usize = 8;
                $body;
            }
            $ch += 8;
        }
        while $ch < $c {
            {
                const $l: usize = 1;
                $body;
            }
            $ch += 1;
        }
    }};
}

widest! {
    /// U's rows `row0..` for tiles `tiles` of one padded channels-last sample `xp`
    /// (HP, WP, C): u [ξ][row][C], ξ `us` apart.
    fn input_transform(xp: &[f32], g: Geom, tiles: Range<usize>, u: &mut [f32], us: usize, row0: usize) {
        let (c, wp) = (g.c, g.padded().1);
        for (row, t) in (row0..).zip(tiles) {
            let (y0, x0) = g.origin(t);
            let at = (y0 * wp + x0) * c;
            by_lanes!(c, |ch, L| input_lanes::<L>(xp, at + ch, wp * c, c, &mut u[row * c + ch..], us));
        }
    }
}

widest! {
    /// Outputs of tiles `tiles` of one sample into yt (OH, OW, O) from M's rows `row0..`
    /// ([ξ][row][O], ξ `ms` apart); the outputs past OH or OW (odd sizes) are dropped.
    fn output_transform(m: &[f32], ms: usize, row0: usize, g: Geom, tiles: Range<usize>, yt: &mut [f32]) {
        let (o, oh, ow) = (g.o, g.oh, g.ow);
        for (row, t) in (row0..).zip(tiles) {
            let (y0, x0) = g.origin(t);
            by_lanes!(o, |ch, L| {
                let y = output_lanes::<L>(&m[row * o + ch..], ms);
                for (p, y_p) in y.iter().enumerate() {
                    for (q, val) in y_p.iter().enumerate() {
                        let (yy, xx) = (y0 + p, x0 + q);
                        if yy < oh && xx < ow {
                            yt[(yy * ow + xx) * o + ch..][..L].copy_from_slice(val);
                        }
                    }
                }
            });
        }
    }
}

widest! {
    /// dM's rows `row0..` ([ξ][row][O], ξ `ms` apart) for tiles `tiles` of one sample's
    /// output gradient dyt (OH, OW, O), zero past OH or OW.
    fn output_grad_transform(dyt: &[f32], g: Geom, tiles: Range<usize>, dm: &mut [f32], ms: usize, row0: usize) {
        let (o, oh, ow) = (g.o, g.oh, g.ow);
        for (row, t) in (row0..).zip(tiles) {
            let (y0, x0) = g.origin(t);
            by_lanes!(o, |ch, L| {
                let dy = each!(4, |P| each!(4, |Q| {
                    let (yy, xx) = (y0 + P, x0 + Q);
                    if yy < oh && xx < ow { load::<L>(dyt, (yy * ow + xx) * o + ch) } else { [0.0; L] }
                }));
                output_grad_lanes::<L>(dy, &mut dm[row * o + ch..], ms);
            });
        }
    }
}

widest! {
    /// Adds the input gradients of tiles `tiles` of one sample, in tile order, into its
    /// padded channels-last dxp (HP, WP, C), from dU's rows `row0..` ([ξ][row][C]).
    fn input_grad_transform(du: &[f32], us: usize, row0: usize, g: Geom, tiles: Range<usize>, dxp: &mut [f32]) {
        let (c, wp) = (g.c, g.padded().1);
        for (row, t) in (row0..).zip(tiles) {
            let (y0, x0) = g.origin(t);
            let at = (y0 * wp + x0) * c;
            by_lanes!(c, |ch, L| input_grad_lanes::<L>(&du[row * c + ch..], us, dxp, at + ch, wp * c, c));
        }
    }
}

// ---- a chunk of samples ------------------------------------------------------------

/// One sample x (C, H, W) into its padded channels-last place xp (HP, WP, C): the
/// padding zeroed, the image moved in by one transpose ([`into_padded`]).
fn pad_sample(x: &[f32], g: &Geom, xp: &mut [f32]) {
    let (hp, wp) = g.padded();
    let (c, row) = (g.c, wp * g.c);
    xp[..g.pad_top * row].fill(0.0);
    xp[(g.pad_top + g.h) * row..hp * row].fill(0.0);
    for yy in g.pad_top..g.pad_top + g.h {
        let line = &mut xp[yy * row..][..row];
        line[..g.pad_left * c].fill(0.0);
        line[(g.pad_left + g.w) * c..].fill(0.0);
    }
    into_padded(x, g.place(), xp);
}

/// The image of a padded channels-last dxp (HP, WP, C) into dx (C, H, W) by one
/// transpose ([`out_of_padded`]; the padding's values dropped).
fn crop_sample(dxp: &[f32], g: &Geom, dx: &mut [f32]) {
    out_of_padded(dxp, g.place(), dx);
}

/// y for a chunk: x (G, C, H, W) → y (G, O, OH, OW), by pieces of `tiling`'s.
pub fn forward_chunk(g: &Geom, wt: &Weights, x: &[f32], y: &mut [f32], s: Scratch<'_>) {
    let (per_in, per_out, tiles) = (g.c * g.h * g.w, g.o * g.oh * g.ow, g.tiles());
    let n = x.len() / per_in;
    assert_eq!(y.len(), n * per_out, "winograd: output of {} values for {n} samples", y.len());
    let t = tiling(g);
    let (pl, rows) = (g.padded_len(), t.samples * t.band);
    s.xp.resize(t.samples * pl, 0.0);
    s.u.resize(XI * plane_stride(rows, g.c), 0.0);
    s.m.resize(XI * plane_stride(rows, g.o), 0.0);
    s.yt.resize(t.samples * per_out, 0.0);
    for first in (0..n).step_by(t.samples) {
        let chunk = first..(first + t.samples).min(n);
        for band in t.bands(tiles) {
            let r = chunk.len() * band.len();
            let (us, ms) = (plane_stride(r, g.c), plane_stride(r, g.o));
            for (k, sample) in chunk.clone().enumerate() {
                let xp = &mut s.xp[k * pl..(k + 1) * pl];
                if band.start == 0 {
                    pad_sample(&x[sample * per_in..][..per_in], g, xp);
                }
                input_transform(xp, *g, band.clone(), s.u, us, k * band.len());
            }
            for xi in 0..XI {
                let (u, v) = (&s.u[xi * us..], &wt.v[xi * g.c * g.o..]);
                chain_gemm((r, g.o, g.c), u, (g.c, 1), v, g.o, &mut s.m[xi * ms..], g.o, Accumulate::Overwrite);
            }
            for k in 0..chunk.len() {
                let yt = &mut s.yt[k * per_out..(k + 1) * per_out];
                output_transform(s.m, ms, k * band.len(), *g, band.clone(), yt);
            }
        }
        for (k, sample) in chunk.enumerate() {
            transpose(&s.yt[k * per_out..(k + 1) * per_out], g.oh * g.ow, g.o, &mut y[sample * per_out..][..per_out]);
        }
    }
}

/// The backward of a chunk: dy (G, O, OH, OW) with the forward's x (G, C, H, W) →
/// the chunk's transformed weight gradient dV `[ξ][C][O]` (its sum over the chunks goes
/// through [`weight_grad`] once), and dx (G, C, H, W) where asked (written, apart or over
/// x: a sample's input is padded into the scratch before its gradient is written).
pub fn backward_chunk(g: &Geom, wt: &Weights, mut x: Samples<'_>, dy: &[f32], s: Scratch<'_>) -> Vec<f32> {
    let (per_in, per_out, tiles) = (g.c * g.h * g.w, g.o * g.oh * g.ow, g.tiles());
    let n = x.len() / per_in;
    let wants_dx = x.wants_grad();
    assert_eq!(dy.len(), n * per_out, "winograd: output gradient of {} values for {n} samples", dy.len());
    let t = tiling(g);
    let (pl, rows) = (g.padded_len(), t.samples * t.band);
    s.xp.resize(t.samples * pl, 0.0);
    s.dxp.resize(if wants_dx { t.samples * pl } else { 0 }, 0.0);
    s.u.resize(XI * plane_stride(rows, g.c), 0.0);
    s.m.resize(XI * plane_stride(rows, g.o), 0.0);
    s.yt.resize(t.samples * per_out, 0.0);
    let mut dv = vec![0.0f32; XI * g.c * g.o];
    for first in (0..n).step_by(t.samples) {
        let chunk = first..(first + t.samples).min(n);
        for band in t.bands(tiles) {
            let r = chunk.len() * band.len();
            let (us, ms) = (plane_stride(r, g.c), plane_stride(r, g.o));
            for (k, sample) in chunk.clone().enumerate() {
                let (xp, yt) = (&mut s.xp[k * pl..(k + 1) * pl], &mut s.yt[k * per_out..(k + 1) * per_out]);
                if band.start == 0 {
                    pad_sample(x.input(sample, per_in), g, xp);
                    transpose(&dy[sample * per_out..][..per_out], g.o, g.oh * g.ow, yt);
                    if wants_dx {
                        s.dxp[k * pl..(k + 1) * pl].fill(0.0);
                    }
                }
                let row0 = k * band.len();
                input_transform(xp, *g, band.clone(), s.u, us, row0);
                output_grad_transform(yt, *g, band.clone(), s.m, ms, row0);
            }
            for xi in 0..XI {
                // dV[ξ] (C, O) += U[ξ]ᵀ (C, r) · dM[ξ] (r, O)
                let (u, dm) = (&s.u[xi * us..], &s.m[xi * ms..]);
                let dvx = &mut dv[xi * g.c * g.o..][..g.c * g.o];
                chain_gemm((g.c, g.o, r), u, (1, g.c), dm, g.o, dvx, g.o, Accumulate::Add);
            }
            if !wants_dx {
                continue;
            }
            for xi in 0..XI {
                // dU[ξ] (r, C) = dM[ξ] (r, O) · V[ξ]ᵀ (O, C), over U (no longer needed)
                let (dm, vt) = (&s.m[xi * ms..], &wt.vt[xi * g.c * g.o..]);
                chain_gemm((r, g.c, g.o), dm, (g.o, 1), vt, g.c, &mut s.u[xi * us..], g.c, Accumulate::Overwrite);
            }
            for k in 0..chunk.len() {
                let dxp = &mut s.dxp[k * pl..(k + 1) * pl];
                input_grad_transform(s.u, us, k * band.len(), *g, band.clone(), dxp);
            }
        }
        for (k, sample) in chunk.enumerate() {
            if let Some(dx) = x.grad(sample, per_in) {
                crop_sample(&s.dxp[k * pl..(k + 1) * pl], g, dx);
            }
        }
    }
    dv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planes_hold_their_rows_and_lie_an_odd_number_of_lines_apart() {
        for (rows, width) in [(0, 16), (1, 1), (16, 32), (12, 64), (49, 16), (63, 16), (18, 64), (7, 9)] {
            let stride = plane_stride(rows, width);
            assert!(stride >= rows * width, "{rows} × {width}: {stride}");
            assert!(stride < rows * width + 32, "{rows} × {width}: {stride}, more than two lines over");
            assert_eq!(stride % 16, 0, "{rows} × {width}: {stride} is not whole 64-byte lines");
            assert_eq!(stride / 16 % 2, 1, "{rows} × {width}: {stride} is an even number of lines");
            // 36 planes of a tile fall on 36 different places in L1's 64 sets.
            let places: std::collections::HashSet<usize> = (0..XI).map(|xi| xi * stride / 16 % 64).collect();
            assert_eq!(places.len(), XI, "{rows} × {width}");
        }
    }

    fn rand(seed: u64, len: usize) -> Vec<f32> {
        let mut r = crate::rng::SplitMix64::new(seed);
        (0..len).map(|_| r.next_f32() - 0.5).collect()
    }

    /// The direct convolution in f64: y, dx and dweight of (x, w, dy), the reference.
    fn direct(g: &Geom, n: usize, x: &[f32], w: &[f32], dy: &[f32]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (c, o) = (g.c, g.o);
        let mut y = vec![0.0f64; n * o * g.oh * g.ow];
        let mut dx = vec![0.0f64; x.len()];
        let mut dw = vec![0.0f64; w.len()];
        for s in 0..n {
            for oo in 0..o {
                for yy in 0..g.oh {
                    for xx in 0..g.ow {
                        let yi = ((s * o + oo) * g.oh + yy) * g.ow + xx;
                        for ch in 0..c {
                            for i in 0..3 {
                                for j in 0..3 {
                                    let (iy, ix) = (
                                        (yy + i) as isize - g.pad_top as isize,
                                        (xx + j) as isize - g.pad_left as isize,
                                    );
                                    if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                                        continue;
                                    }
                                    let xi = ((s * c + ch) * g.h + iy as usize) * g.w + ix as usize;
                                    let wi = ((oo * c + ch) * 3 + i) * 3 + j;
                                    y[yi] += x[xi] as f64 * w[wi] as f64;
                                    dx[xi] += dy[yi] as f64 * w[wi] as f64;
                                    dw[wi] += dy[yi] as f64 * x[xi] as f64;
                                }
                            }
                        }
                    }
                }
            }
        }
        (y, dx, dw)
    }

    fn run(g: &Geom, n: usize, x: &[f32], w: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let wt = transform_weights(w, g.c, g.o);
        let mut y = vec![f32::NAN; n * g.o * g.oh * g.ow];
        let mut b: [Vec<f32>; 5] = Default::default();
        let [xp, u, m, yt, dxp] = &mut b;
        forward_chunk(g, &wt, x, &mut y, Scratch { xp, u, m, yt, dxp });
        let mut dx = vec![f32::NAN; x.len()];
        let [xp, u, m, yt, dxp] = &mut b;
        let dv = backward_chunk(g, &wt, Samples::Apart { x, dx: Some(&mut dx) }, dy, Scratch { xp, u, m, yt, dxp });
        // The gradient written over the input instead: the same bits.
        let mut both = x.to_vec();
        let [xp, u, m, yt, dxp] = &mut b;
        let dv_over = backward_chunk(g, &wt, Samples::Overwritten(&mut both), dy, Scratch { xp, u, m, yt, dxp });
        assert!(same_bits(&both, &dx) && same_bits(&dv_over, &dv), "{g:?}: dx written over x differs");
        (y, dx, weight_grad(&dv, g.c, g.o))
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
    }

    fn geom(c: usize, hw: (usize, usize), o: usize, pad: usize) -> Geom {
        let (oh, ow) = (hw.0 + 2 * pad - 2, hw.1 + 2 * pad - 2);
        Geom { c, h: hw.0, w: hw.1, o, oh, ow, pad_top: pad, pad_left: pad }
    }

    #[test]
    fn the_three_products_are_the_direct_convolutions() {
        // resnet8's three stride-1 shapes (a sample's tiles in bands at 28×28, several
        // samples a piece at 7×7), odd and ragged sizes with "valid" and wider padding,
        // channel counts off the 8 lanes. Against the direct convolution in f64: within
        // 1e-5 of the largest magnitude of each result (sums of C·9 products of values
        // in ±0.5, and of N·OH·OW for the weight's gradient). Measured: at most 6.8·10⁻⁶
        // (the output at 28×28), against 3·10⁻⁷ by F(2×2, 3×3): F(4×4)'s transforms
        // weigh points by up to 8 and 5 before the sums cancel, the price of its 4 times
        // fewer products.
        let cases = [
            (geom(16, (28, 28), 16, 1), 2),
            (geom(32, (14, 14), 32, 1), 3),
            (geom(64, (7, 7), 64, 1), 5),
            (geom(8, (9, 6), 12, 0), 2),
            (geom(11, (5, 7), 9, 2), 3),
        ];
        for (seed, (g, n)) in cases.into_iter().enumerate() {
            let (x, w) = (rand(seed as u64, n * g.c * g.h * g.w), rand(100 + seed as u64, g.o * g.c * 9));
            let dy = rand(200 + seed as u64, n * g.o * g.oh * g.ow);
            let (y, dx, dw) = run(&g, n, &x, &w, &dy);
            let (y0, dx0, dw0) = direct(&g, n, &x, &w, &dy);
            for (what, got, want) in [("y", &y, &y0), ("dx", &dx, &dx0), ("dweight", &dw, &dw0)] {
                let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
                let worst = got.iter().zip(want.iter()).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
                assert!(worst <= 1e-5 * scale, "{g:?}: {what} off by {worst:e} (scale {scale})");
            }
        }
    }

    #[test]
    fn a_sample_is_bitwise_the_same_alone_or_in_a_batch() {
        // Each output and input gradient is a function of its own sample alone, whichever
        // piece its tiles land in (7×7: two samples a piece; 28×28: bands of a sample).
        for (g, n) in [(geom(64, (7, 7), 64, 1), 3), (geom(16, (28, 28), 16, 1), 2)] {
            let (x, w) = (rand(1, n * g.c * g.h * g.w), rand(2, g.o * g.c * 9));
            let dy = rand(3, n * g.o * g.oh * g.ow);
            let (y, dx, _) = run(&g, n, &x, &w, &dy);
            let (pi, po) = (g.c * g.h * g.w, g.o * g.oh * g.ow);
            for s in 0..n {
                let (y1, dx1, _) = run(&g, 1, &x[s * pi..][..pi], &w, &dy[s * po..][..po]);
                assert!(y1.iter().zip(&y[s * po..]).all(|(a, b)| a.to_bits() == b.to_bits()), "{g:?} y of {s}");
                assert!(dx1.iter().zip(&dx[s * pi..]).all(|(a, b)| a.to_bits() == b.to_bits()), "{g:?} dx of {s}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "winograd: weight of 17 values for (2, 1, 3, 3)")]
    fn a_weight_of_the_wrong_length_is_refused() {
        transform_weights(&[0.0; 17], 1, 2);
    }

    #[test]
    #[should_panic(expected = "winograd: dV of 35 values for (1, 1) channels")]
    fn a_weight_gradient_of_the_wrong_length_is_refused() {
        weight_grad(&[0.0; 35], 1, 1);
    }
}
