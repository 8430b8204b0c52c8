//! CPU kernels: GEMM, the unfoldings (im2col/col2im, im2row/row2im), the transpose the
//! layers move channels and weights with, and the few reductions the layers need.
//!
//! Determinism is a contract here, not a hope: the result of every kernel is bitwise the
//! same whatever the number of threads in the device's pool. GEMM is split by the `gemm`
//! crate over output blocks only (the k loop is never split between threads), and every
//! reduction over the batch runs in a fixed order chosen from the sizes alone. The
//! trainer relies on this to make 1, 2 or 4 devices give bitwise-identical weights.
//!
//! The GEMM crate was chosen by measurement (`benches/gemm.rs`): see the README.

use gemm::Parallelism;

use super::simd::widest;

/// A read-only matrix view: `rows × cols`, element (i, j) at `data[i*rs + j*cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// A row-major `rows × cols` matrix.
    pub fn rows(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Mat { data, rows, cols, rs: cols, cs: 1 }
    }

    /// The transpose, as a view (no copy).
    pub fn t(self) -> Self {
        Mat { data: self.data, rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs }
    }

    fn check(&self, what: &str) {
        if self.rows > 0 && self.cols > 0 {
            let last = (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
            assert!(last < self.data.len(), "gemm: {what} view out of bounds");
        }
    }
}

/// What GEMM does with the destination's previous contents.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Accumulate {
    /// `c = a·b`
    Overwrite,
    /// `c += a·b` (parameter gradients accumulate: see `nn`'s contract)
    Add,
}

/// Below this many multiply-adds a GEMM runs on the calling thread: waking the pool
/// costs more than it saves.
pub(crate) const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// `c (m × n, row-major, row stride c_rs) (+)= a (m × k) · b (k × n)`.
///
/// Runs on the current rayon pool (the device's), splitting only over blocks of `c`.
pub fn gemm(a: Mat<'_>, b: Mat<'_>, c: &mut [f32], c_rs: usize, acc: Accumulate) {
    gemm_with(a, b, c, c_rs, acc, Threads::Pool)
}

/// Bytes of packing buffer that each thread running a GEMM keeps for the rest of its
/// life: the `gemm` crate packs the left-hand side's blocks into a thread-local slab as
/// large as the processor's L2 cache per core, made on a thread's first GEMM and freed
/// when the thread ends. It is a fact of the processor, not of the model or the batch:
/// 512 KiB on an AMD EPYC of Zen 2 or 3, 1 MiB on Zen 4, 2 MiB on a recent Intel Xeon.
/// The training estimate counts it per device thread (`train::memory`).
pub fn gemm_thread_workspace() -> usize {
    gemm_common::cache::CACHE_INFO[1].cache_bytes
}

/// Bytes of the packing buffers one product `(m × k) · (k × n)` takes while it runs, an
/// upper bound on any x86 processor: the `gemm` crate packs the right-hand side's block of
/// `kc × nc` values (`kc` at most 512 here: its rule takes 512 whenever `k` is larger, on
/// every cache size it meets; `nc` at most `n` rounded up to its 8 or 32 columns) and, for a
/// left-hand side of at most twice its `mc` rows (`mc` at most 8 of its `MR` = 48 rows on
/// AVX-512), those rows, rounded up to 48, by `kc`. Beside the thread's slab
/// ([`gemm_thread_workspace`]), which it keeps whatever the product.
pub fn gemm_packing(m: usize, n: usize, k: usize) -> u64 {
    let kc = k.min(512) as u64;
    let lhs = m.next_multiple_of(48).min(2 * 8 * 48) as u64;
    let rhs = n.next_multiple_of(32) as u64;
    kc.saturating_mul(lhs.saturating_add(rhs)).saturating_mul(4)
}

/// Who runs a GEMM.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Threads {
    /// The current rayon pool, when the product is large enough to pay for it.
    Pool,
    /// The calling thread only: for GEMMs issued from inside a parallel loop.
    Caller,
}

/// `gemm` with an explicit choice of threads.
pub fn gemm_with(a: Mat<'_>, b: Mat<'_>, c: &mut [f32], c_rs: usize, acc: Accumulate, threads: Threads) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    check_product(a, b);
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * c_rs + n <= c.len(), "gemm: destination out of bounds");
    if k == 0 {
        if acc == Accumulate::Overwrite {
            for row in c.chunks_mut(c_rs).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: the views were checked by `check_product`, and `c` holds the m rows of n
    // values at stride c_rs just asserted; `c` is borrowed mutably, so it cannot alias `a`
    // or `b`.
    unsafe { product_into(a, b, c.as_mut_ptr(), c_rs, acc, threads) }
}

/// `a (m × k) · b (k × n)` as a new row-major `m × n` matrix, on the current rayon pool
/// as [`gemm`]. Its storage is never zeroed first: the product writes every value and
/// reads none (the `gemm` crate's `read_dst = false`), which saves a pass over the
/// output that a zeroed vector would cost (a dense layer's output and input gradient).
pub fn gemm_new(a: Mat<'_>, b: Mat<'_>) -> Vec<f32> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    check_product(a, b);
    let len = m.checked_mul(n).expect("gemm: the product's size overflows");
    if len == 0 || k == 0 {
        return vec![0.0; len];
    }
    let mut c = Vec::with_capacity(len);
    // SAFETY: `c` has room for m·n values, row stride n (its capacity, just reserved; a
    // new vector aliases nothing); the views were checked by `check_product`. With
    // `Overwrite` the kernel writes each of the m·n values through the pointer and reads
    // none, so after it every value is initialised and the length may cover them.
    unsafe {
        product_into(a, b, c.as_mut_ptr(), n, Accumulate::Overwrite, Threads::Pool);
        c.set_len(len);
    }
    c
}

/// Panics unless `a · b` is a product whose views lie within their slices.
fn check_product(a: Mat<'_>, b: Mat<'_>) {
    assert_eq!(b.rows, a.cols, "gemm: inner dimensions {} and {} differ", a.cols, b.rows);
    a.check("lhs");
    b.check("rhs");
}

/// `c (+)= a · b` through the `gemm` crate, for m, n, k all above zero.
///
/// # Safety
/// `a` and `b` passed [`check_product`]; `c` points to m rows of n writable `f32` at row
/// stride `c_rs`, aliasing neither `a` nor `b`, initialised if `acc` is `Add` (the only
/// case in which the kernel reads them).
unsafe fn product_into(a: Mat<'_>, b: Mat<'_>, c: *mut f32, c_rs: usize, acc: Accumulate, threads: Threads) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let pool = super::par::threads();
    let par = if threads == Threads::Pool && pool > 1 && m * n * k >= PARALLEL_MIN_FLOPS {
        Parallelism::Rayon(pool)
    } else {
        Parallelism::None
    };
    // SAFETY: the caller's contract: the views lie within their slices (the largest index
    // the kernel touches is (rows-1)*rs + (cols-1)*cs), `c` is writable and aliases
    // neither; strides fit in isize because they index existing allocations.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c,
            1,
            c_rs as isize,
            acc == Accumulate::Add,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// Geometry of a 2-D convolution over one sample, as its column matrix (im2col) sees it:
/// square stride, the padding of the top and left edges (the bottom and right follow from
/// OH, OW). The GPU kernels take a batch's window instead (`cuda::launch::WindowGeom`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Im2colGeom {
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: usize,
    pub pad_top: usize,
    pub pad_left: usize,
    pub oh: usize,
    pub ow: usize,
}

impl Im2colGeom {
    /// Rows of the column matrix: C·KH·KW.
    pub fn col_rows(&self) -> usize {
        self.c * self.kh * self.kw
    }

    /// A 1×1 window with no padding: every column is a value of the input.
    fn pointwise(&self) -> bool {
        (self.kh, self.kw, self.pad_top, self.pad_left) == (1, 1, 0, 0)
    }

    /// Columns of the column matrix: OH·OW.
    pub fn col_cols(&self) -> usize {
        self.oh * self.ow
    }
}

/// Output columns `ox` whose input column `ox·s + j − pad` lies inside `0..w`.
#[inline]
fn valid_cols(j: usize, pad: usize, s: usize, w: usize, ow: usize) -> std::ops::Range<usize> {
    // ox·s + j ≥ pad  ⇔  ox ≥ ⌈(pad − j)/s⌉;  ox·s + j − pad ≤ w − 1  ⇔  ox ≤ ⌊(w − 1 + pad − j)/s⌋
    let lo = pad.saturating_sub(j).div_ceil(s).min(ow);
    let hi = if w + pad > j { ((w - 1 + pad - j) / s + 1).min(ow) } else { 0 };
    lo..hi.max(lo)
}

/// Per kernel column j: the valid output columns and the input column of the first.
fn column_plan(g: &Im2colGeom) -> Vec<(std::ops::Range<usize>, usize)> {
    (0..g.kw)
        .map(|j| {
            let cols = valid_cols(j, g.pad_left, g.stride, g.w, g.ow);
            let first = (cols.start * g.stride + j).saturating_sub(g.pad_left);
            (cols, first)
        })
        .collect()
}

widest! {
    /// Unfolds one sample. x: (C, H, W) → col: (C·KH·KW, OH·OW), row (c·KH + i)·KW + j holds
    /// x[c, oy·s + i − pad_top, ox·s + j − pad_left] (0 outside the image).
    pub fn im2col(x: &[f32], g: &Im2colGeom, col: &mut [f32]) {
        let p = g.col_cols();
        debug_assert_eq!(x.len(), g.c * g.h * g.w);
        debug_assert_eq!(col.len(), g.col_rows() * p);
        let (s, ow) = (g.stride, g.ow);
        if g.pointwise() {
            // Every column a value of x (a strided one): no window, no padding to place.
            for (xc, rows) in x.chunks_exact(g.h * g.w).zip(col.chunks_exact_mut(p)) {
                for (oy, out) in rows.chunks_exact_mut(ow).enumerate() {
                    let xr = &xc[oy * s * g.w..][..(ow - 1) * s + 1];
                    for (ox, d) in out.iter_mut().enumerate() {
                        *d = xr[ox * s];
                    }
                }
            }
            return;
        }
        let plan = column_plan(g);
        for c in 0..g.c {
            let xc = &x[c * g.h * g.w..(c + 1) * g.h * g.w];
            for i in 0..g.kh {
                let rows = &mut col[(c * g.kh + i) * g.kw * p..(c * g.kh + i + 1) * g.kw * p];
                for oy in 0..g.oh {
                    let iy = (oy * s + i) as isize - g.pad_top as isize;
                    let inside = iy >= 0 && iy < g.h as isize;
                    let xr = if inside { &xc[iy as usize * g.w..(iy as usize + 1) * g.w] } else { &xc[..0] };
                    for (j, (cols, first)) in plan.iter().enumerate() {
                        let out = &mut rows[j * p + oy * ow..j * p + (oy + 1) * ow];
                        if !inside || cols.is_empty() {
                            out.fill(0.0);
                            continue;
                        }
                        out[..cols.start].fill(0.0);
                        out[cols.end..].fill(0.0);
                        let dst = &mut out[cols.clone()];
                        let n = dst.len();
                        if s == 1 {
                            dst.copy_from_slice(&xr[*first..first + n]);
                        } else {
                            let src = &xr[*first..first + (n - 1) * s + 1];
                            for k in 0..n {
                                dst[k] = src[k * s];
                            }
                        }
                    }
                }
            }
        }
    }
}

widest! {
    /// Folds a column matrix back, adding overlapping entries: the adjoint of [`im2col`].
    /// dcol: (C·KH·KW, OH·OW) → dx: (C, H, W), every value written: each is 0 plus its
    /// entries in (KH, KW) order (0 where none lands), as the GPU's kernel sums them.
    pub fn col2im(dcol: &[f32], g: &Im2colGeom, dx: &mut [f32]) {
        let p = g.col_cols();
        let (s, ow) = (g.stride, g.ow);
        if g.pointwise() {
            // One entry at most a value, on every s-th row and column: each row written
            // once, in one pass (0 + v keeps the sum's sign of zero, as below).
            for (dxc, rows) in dx.chunks_exact_mut(g.h * g.w).zip(dcol.chunks_exact(p)) {
                for (iy, dr) in dxc.chunks_exact_mut(g.w).enumerate() {
                    dr.fill(0.0);
                    if iy % s == 0 && iy / s < g.oh {
                        for (ox, &v) in rows[iy / s * ow..][..ow].iter().enumerate() {
                            dr[ox * s] = 0.0 + v;
                        }
                    }
                }
            }
            return;
        }
        dx.fill(0.0);
        let plan = column_plan(g);
        for c in 0..g.c {
            let dxc = &mut dx[c * g.h * g.w..(c + 1) * g.h * g.w];
            for i in 0..g.kh {
                let rows = &dcol[(c * g.kh + i) * g.kw * p..(c * g.kh + i + 1) * g.kw * p];
                for oy in 0..g.oh {
                    let iy = (oy * s + i) as isize - g.pad_top as isize;
                    if iy < 0 || iy >= g.h as isize {
                        continue;
                    }
                    let dr = &mut dxc[iy as usize * g.w..(iy as usize + 1) * g.w];
                    for (j, (cols, first)) in plan.iter().enumerate() {
                        if cols.is_empty() {
                            continue;
                        }
                        let src = &rows[j * p + oy * ow + cols.start..j * p + oy * ow + cols.end];
                        let n = src.len();
                        if s == 1 {
                            for (d, v) in dr[*first..first + n].iter_mut().zip(src) {
                                *d += v;
                            }
                        } else {
                            let dst = &mut dr[*first..first + (n - 1) * s + 1];
                            for k in 0..n {
                                dst[k * s] += src[k];
                            }
                        }
                    }
                }
            }
        }
    }
}

/// One sample from channels-first to channels-last. x: (C, P) → xt: (P, C)
pub fn chw_to_hwc(x: &[f32], c: usize, xt: &mut [f32]) {
    transpose(x, c, x.len() / c.max(1), xt);
}

/// One sample from channels-last to channels-first. xt: (P, C) → x: (C, P)
pub fn hwc_to_chw(xt: &[f32], c: usize, x: &mut [f32]) {
    transpose(xt, xt.len() / c.max(1), c, x);
}

/// The side of a transpose's square tile: 16 f32, one AVX-512 vector a row.
const TILE: usize = 16;

/// `dst` ← `src`, a short row (a plane's row of a few dozen values) copied eight values
/// at a time in registers, where a call into memmove would cost as much as the copy.
#[inline(always)]
pub fn copy_row(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "copy_row: {} values into {}", src.len(), dst.len());
    let (mut d, mut s) = (dst.chunks_exact_mut(8), src.chunks_exact(8));
    for (d, s) in (&mut d).zip(&mut s) {
        let v: [f32; 8] = s.try_into().expect("chunks of 8");
        d.copy_from_slice(&v);
    }
    // The last 0 to 7 values as 4, 2 and 1, without a loop (which would become a call).
    let (mut d, mut s) = (d.into_remainder(), s.remainder());
    for width in [4, 2, 1] {
        if s.len() >= width {
            let (dh, dt) = d.split_at_mut(width);
            let (sh, st) = s.split_at(width);
            dh.copy_from_slice(sh);
            (d, s) = (dt, st);
        }
    }
}

/// `src` (rows, cols) transposed into `dst` (cols, rows), both row-major. A move of
/// values, so the bits are those of the value-by-value loop; only the order of the
/// memory traffic differs. Value by value, one side is read or written with a stride of
/// a whole row, which for the convolutions' (C, H·W) planes and attention's weights lands
/// in a few of L1's sets and thrashes (the transposes took 13% of a `resnet8` step and 3%
/// of a GPT pass, 3–4 ns a value). Here 16 × 16 tiles are transposed in registers where
/// the processor has AVX-512F (16 loads, 64 shuffles, 16 stores), 8 × 8 tiles where it
/// has AVX2, and the rest (other processors, the edges) value by value, a 16 × 16 block
/// at a time.
pub fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    assert_eq!(src.len(), rows * cols, "transpose: {} values for a {rows}×{cols} source", src.len());
    assert_eq!(dst.len(), rows * cols, "transpose: {} values for a {cols}×{rows} destination", dst.len());
    transpose_by(Registers::widest(), View { rows, cols, src: Rows::Every(cols), dst: Rows::Every(rows) }, src, dst)
}

/// A [`transpose`] of a view inside larger buffers: `rows` × `cols` values of `src`, row i
/// at i·`src_stride`, written as `cols` × `rows` into `dst`, row j at j·`dst_stride`
/// (`dst[j·dst_stride + i] = src[i·src_stride + j]`); what lies between the rows is left
/// as it was. A permutation's two moving axes, the other axes' strides around them
/// (`ops::permute`). Panics unless the view lies inside both buffers, its rows apart.
pub fn transpose_strided(src: &[f32], rows: usize, cols: usize, src_stride: usize, dst: &mut [f32], dst_stride: usize) {
    let v = View { rows, cols, src: Rows::Every(src_stride), dst: Rows::Every(dst_stride) };
    transpose_by(Registers::widest(), v.checked(src.len(), dst.len()), src, dst)
}

/// An image's place in a padded channels-last buffer: pixel (y, x) of an image `w`
/// pixels wide at row `top + y`, column `left + x` of rows `wp` pixels wide, its `c`
/// values together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Padded {
    pub w: usize,
    pub wp: usize,
    pub top: usize,
    pub left: usize,
    pub c: usize,
}

/// A channels-first image x (C, H·W) moved into its place in a padded channels-last
/// buffer: pixel p's C values together at its place, the padding left as it was. It is
/// [`transpose`] with the destination's rows where the image puts them, so its register
/// tiles run across the image's rows: a 7-pixel-wide image moves by whole tiles as a wide
/// one does, not row by row through the edges.
pub fn into_padded(x: &[f32], place: Padded, xp: &mut [f32]) {
    into_padded_by(Registers::widest(), x, place, xp)
}

/// The inverse of [`into_padded`]: the image's pixels out of the padded channels-last
/// buffer `xp` into x (C, H·W); the padding's values are not read.
pub fn out_of_padded(xp: &[f32], place: Padded, x: &mut [f32]) {
    out_of_padded_by(Registers::widest(), xp, place, x)
}

fn into_padded_by(regs: Registers, x: &[f32], place: Padded, xp: &mut [f32]) {
    let pixels = image_pixels(x.len(), place);
    let v = View { rows: place.c, cols: pixels, src: Rows::Every(pixels), dst: Rows::Image(place) };
    transpose_by(regs, v.checked(x.len(), xp.len()), x, xp)
}

fn out_of_padded_by(regs: Registers, xp: &[f32], place: Padded, x: &mut [f32]) {
    let pixels = image_pixels(x.len(), place);
    let v = View { rows: pixels, cols: place.c, src: Rows::Image(place), dst: Rows::Every(pixels) };
    transpose_by(regs, v.checked(xp.len(), x.len()), xp, x)
}

/// H·W of an image of `len` values in `place`, checked to be whole rows of a place that
/// fits its padded rows.
fn image_pixels(len: usize, place: Padded) -> usize {
    let Padded { w, wp, left, c, .. } = place;
    assert!(w > 0 && c > 0 && left + w <= wp, "transpose: an image {w} wide at column {left} of rows {wp} wide");
    assert!(len.is_multiple_of(w * c), "transpose: {len} values are not whole rows of {w} pixels of {c} values");
    len / c
}

/// Where a transpose's rows start in their buffer.
#[derive(Clone, Copy, Debug)]
enum Rows {
    /// Row i at i·stride.
    Every(usize),
    /// Row p at pixel p's place in a padded image.
    Image(Padded),
}

impl Rows {
    /// Where row i starts; increasing in i (an image's place has `left + w ≤ wp`).
    fn at(self, i: usize) -> usize {
        self.starts::<1>(i)[0]
    }

    /// Where rows `first..first + N` start (those past the view's last row are never
    /// used): one division for a whole block of an image's pixels, not one a pixel.
    #[inline(always)]
    fn starts<const N: usize>(self, first: usize) -> [usize; N] {
        Cursor::at(self, first).take()
    }
}

/// Where a view's rows start, block after block: a block inside one row of an image is N
/// starts c values apart, taken at once, and only a block that crosses a row's end walks
/// pixel by pixel. The register tiles take their blocks in order from row 0, with no
/// division. Walking every block (a chain of compares and branches) and dividing for each
/// placed a tile's rows in about the time the tile took to move: an image's padded
/// transposes ran at 0.55–0.65 of a plain transpose's speed, and run at 0.9–1.0 of it now
/// (Zen 1, in cache).
struct Cursor {
    rows: Rows,
    /// The next row, and its pixel (y, x) where the rows are an image's.
    next: usize,
    y: usize,
    x: usize,
}

impl Cursor {
    /// At row `first` (one division where the rows are an image's).
    #[inline(always)]
    fn at(rows: Rows, first: usize) -> Cursor {
        let (y, x) = match rows {
            Rows::Every(_) => (0, 0),
            Rows::Image(place) => (first / place.w, first % place.w),
        };
        Cursor { rows, next: first, y, x }
    }

    /// The starts of the next N rows (as `starts(next)`); moves past them.
    #[inline(always)]
    fn take<const N: usize>(&mut self) -> [usize; N] {
        let mut out = [0; N];
        match self.rows {
            Rows::Every(stride) => {
                for (k, o) in out.iter_mut().enumerate() {
                    *o = (self.next + k) * stride;
                }
            }
            Rows::Image(place) if self.x + N < place.w => {
                // Inside one row of the image: N pixels c values apart.
                let first = ((place.top + self.y) * place.wp + place.left + self.x) * place.c;
                for (k, o) in out.iter_mut().enumerate() {
                    *o = first + k * place.c;
                }
                self.x += N;
            }
            Rows::Image(place) => {
                for o in out.iter_mut() {
                    *o = ((place.top + self.y) * place.wp + place.left + self.x) * place.c;
                    self.x += 1;
                    if self.x == place.w {
                        (self.y, self.x) = (self.y + 1, 0);
                    }
                }
            }
        }
        self.next += N;
        out
    }
}

/// The shape of a transpose: `rows × cols` read from the source's rows, written as
/// `cols × rows` into the destination's.
#[derive(Clone, Copy, Debug)]
struct View {
    rows: usize,
    cols: usize,
    src: Rows,
    dst: Rows,
}

impl View {
    /// The view, checked to lie inside a source of `src_len` values and a destination of
    /// `dst_len`, its rows apart: rows start at increasing places, so the last one bounds
    /// them all.
    fn checked(self, src_len: usize, dst_len: usize) -> View {
        let apart = |r: Rows, len: usize| match r {
            Rows::Every(stride) => len <= stride,
            Rows::Image(place) => len <= place.c,
        };
        if self.rows > 0 && self.cols > 0 {
            assert!(apart(self.src, self.cols) && apart(self.dst, self.rows), "transpose: rows of a view overlap");
            assert!(self.src.at(self.rows - 1) + self.cols <= src_len, "transpose: source view out of bounds");
            assert!(self.dst.at(self.cols - 1) + self.rows <= dst_len, "transpose: destination view out of bounds");
        }
        self
    }
}

/// The register tiles a [`transpose`] moves its values through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Registers {
    /// 16 × 16 in AVX-512 registers.
    Avx512,
    /// 8 × 8 in AVX2 registers.
    Avx2,
    /// None: value by value.
    Local,
}

impl Registers {
    fn widest() -> Registers {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Registers::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Registers::Avx2;
            }
        }
        Registers::Local
    }

    /// The side of the register tile (the rest goes value by value).
    fn side(self) -> usize {
        match self {
            Registers::Avx512 => 16,
            Registers::Avx2 => 8,
            Registers::Local => 0,
        }
    }
}

/// A transpose of a view checked against these buffers ([`View::checked`], or the
/// lengths [`transpose`] asserts), through the given registers, which the processor must
/// have.
fn transpose_by(regs: Registers, v: View, src: &[f32], dst: &mut [f32]) {
    let View { rows, cols, .. } = v;
    let side = regs.side();
    let (full_r, full_c) = if side == 0 { (0, 0) } else { (rows - rows % side, cols - cols % side) };
    #[cfg(target_arch = "x86_64")]
    {
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        match regs {
            // SAFETY: every tile of rows 0..full_r and columns 0..full_c is inside the
            // view, which lies inside both buffers (checked by the caller); `dst` is
            // borrowed mutably, so the two cannot overlap; the caller's choice of registers
            // is one the processor has (`Registers::widest`, or the test's).
            Registers::Avx512 => unsafe { register_tiles_avx512(v, s, d, full_r, full_c) },
            // SAFETY: as above, for AVX2.
            Registers::Avx2 => unsafe { register_tiles_avx2(v, s, d, full_r, full_c) },
            Registers::Local => {}
        }
    }
    // What the registers did not: everything, or the right strip and the bottom strip.
    transpose_values(v, src, dst, 0..full_r, full_c..cols);
    transpose_values(v, src, dst, full_r..rows, 0..cols);
}

/// The register tiles of a transpose: `$name` moves the tiles of rows 0..full_r and
/// columns 0..full_c (multiples of `$side`) through `$tile`, compiled with `$feature` so
/// that the tile is inlined and its row addresses stay in registers.
macro_rules! register_tiles {
    ($name:ident, $feature:literal, $side:literal, $tile:ident) => {
        /// # Safety
        /// The processor has the feature; every tile of rows 0..full_r and columns
        /// 0..full_c of `v` is inside the buffers at `src` and `dst`, which do not overlap.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feature)]
        unsafe fn $name(v: View, src: *const f32, dst: *mut f32, full_r: usize, full_c: usize) {
            let mut rows = Cursor::at(v.src, 0);
            for r0 in (0..full_r).step_by($side) {
                let from: [usize; $side] = rows.take();
                let mut cols = Cursor::at(v.dst, 0);
                for c0 in (0..full_c).step_by($side) {
                    let to: [usize; $side] = cols.take();
                    let (mut src_rows, mut dst_rows) = ([src; $side], [dst; $side]);
                    for k in 0..$side {
                        src_rows[k] = src.wrapping_add(from[k] + c0);
                        dst_rows[k] = dst.wrapping_add(to[k] + r0);
                    }
                    // SAFETY: source row i of the tile starts at `from[i] + c0` and
                    // destination row j at `to[j] + r0`, for i, j < side, inside the
                    // buffers (the contract).
                    unsafe { $tile(src_rows, dst_rows) };
                }
            }
        }
    };
}

register_tiles!(register_tiles_avx2, "avx2", 8, transpose_tile_avx2);
register_tiles!(register_tiles_avx512, "avx512f", 16, transpose_tile_avx512);

/// One 8 × 8 tile: row i of the source (8 values at `src[i]`) becomes column i of the
/// destination (rows at `dst[j]`). Each register is loaded as two 4-value halves, rows i
/// and i + 4 (the lane crossing done by the loads, which cost AMD's Zen 1 nothing, where
/// `vperm2f128` costs 8 µops), then each 128-bit lane is transposed as 4 × 4 (unpack,
/// shuffle).
///
/// # Safety
/// The processor has AVX2; `src[i] .. + 8` is readable and `dst[j] .. + 8` writable for
/// i, j < 8, and the two do not overlap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn transpose_tile_avx2(src: [*const f32; 8], dst: [*mut f32; 8]) {
    use std::arch::x86_64::*;
    // r[h·4 + i]: lane 0 the half h of row i, lane 1 the half h of row i + 4.
    let mut r = [_mm256_setzero_ps(); 8];
    for h in 0..2 {
        for i in 0..4 {
            // SAFETY: rows i and i + 4, values 4h..4h+4, are readable (the contract).
            r[4 * h + i] = unsafe {
                let lo = _mm_loadu_ps(src[i].add(4 * h));
                let hi = _mm_loadu_ps(src[i + 4].add(4 * h));
                _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(lo), hi)
            };
        }
    }
    // Each 128-bit lane of r[4h..4h+4] is a 4 × 4 block: transposed, its row j is
    // column 4h + j of the source, rows 0–3 in lane 0 and 4–7 in lane 1.
    for h in 0..2 {
        let (a, b, c, d) = (r[4 * h], r[4 * h + 1], r[4 * h + 2], r[4 * h + 3]);
        let (ab_lo, ab_hi) = (_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
        let (cd_lo, cd_hi) = (_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
        let out = [
            _mm256_shuffle_ps::<0x44>(ab_lo, cd_lo),
            _mm256_shuffle_ps::<0xEE>(ab_lo, cd_lo),
            _mm256_shuffle_ps::<0x44>(ab_hi, cd_hi),
            _mm256_shuffle_ps::<0xEE>(ab_hi, cd_hi),
        ];
        for (j, v) in out.into_iter().enumerate() {
            // SAFETY: row 4h + j of the destination tile is writable (the contract).
            unsafe { _mm256_storeu_ps(dst[4 * h + j], v) };
        }
    }
}

/// The part `r_range` × `c_range` of a transpose, value by value, a [`TILE`] × [`TILE`]
/// block at a time so that a block's source and destination lines stay in L1 together.
fn transpose_values(
    v: View,
    src: &[f32],
    dst: &mut [f32],
    r_range: std::ops::Range<usize>,
    c_range: std::ops::Range<usize>,
) {
    if c_range.is_empty() {
        // Nothing to move, but each block's starts would still be placed: for an image's
        // rows, a third of `out_of_padded`'s time.
        return;
    }
    for r0 in r_range.clone().step_by(TILE) {
        let block = r0..(r0 + TILE).min(r_range.end);
        let from: [usize; TILE] = v.src.starts(r0);
        for c0 in c_range.clone().step_by(TILE) {
            let to: [usize; TILE] = v.dst.starts(c0);
            for j in c0..(c0 + TILE).min(c_range.end) {
                let out = &mut dst[to[j - c0] + r0..][..block.len()];
                for (d, &row) in out.iter_mut().zip(&from) {
                    *d = src[row + j];
                }
            }
        }
    }
}

/// One 16 × 16 tile: row i of the source (16 values at `src[i]`) becomes column i of the
/// destination (rows at `dst[j]`). Four rounds of shuffles: pairs of rows interleaved
/// (unpack), 4 × 4 blocks within each 128-bit lane (shuffle), then the lanes themselves
/// twice (shuffle_f32x4), the classic in-register transpose.
///
/// # Safety
/// The processor has AVX-512F; `src[i] .. + 16` is readable and `dst[j] .. + 16`
/// writable for i, j < 16, and the two do not overlap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn transpose_tile_avx512(src: [*const f32; TILE], dst: [*mut f32; TILE]) {
    use std::arch::x86_64::*;
    let mut r = [_mm512_setzero_ps(); TILE];
    for (i, v) in r.iter_mut().enumerate() {
        // SAFETY: row i of the tile is readable (the function's contract).
        *v = unsafe { _mm512_loadu_ps(src[i]) };
    }
    // t[2i], t[2i+1]: rows 2i and 2i+1 interleaved, low and high halves of each lane.
    let mut t = [_mm512_setzero_ps(); TILE];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // r[4g + j], lane l: column 4l + j of rows 4g .. 4g + 3.
    for g in 0..4 {
        let (a, b, c, d) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
        r[4 * g] = _mm512_shuffle_ps::<0x44>(a, c);
        r[4 * g + 1] = _mm512_shuffle_ps::<0xEE>(a, c);
        r[4 * g + 2] = _mm512_shuffle_ps::<0x44>(b, d);
        r[4 * g + 3] = _mm512_shuffle_ps::<0xEE>(b, d);
    }
    // Lanes gathered: first pairs of row groups (0, 1) and (2, 3), then the pairs.
    for j in 0..4 {
        t[j] = _mm512_shuffle_f32x4::<0x88>(r[j], r[j + 4]);
        t[j + 4] = _mm512_shuffle_f32x4::<0xDD>(r[j], r[j + 4]);
        t[j + 8] = _mm512_shuffle_f32x4::<0x88>(r[j + 8], r[j + 12]);
        t[j + 12] = _mm512_shuffle_f32x4::<0xDD>(r[j + 8], r[j + 12]);
    }
    for i in 0..8 {
        r[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[i + 8]);
        r[i + 8] = _mm512_shuffle_f32x4::<0xDD>(t[i], t[i + 8]);
    }
    for (j, v) in r.iter().enumerate() {
        // SAFETY: row j of the destination tile is writable (the function's contract).
        unsafe { _mm512_storeu_ps(dst[j], *v) };
    }
}

/// Where output pixel p's window lies in a channels-last input, for [`im2row`] and
/// [`row2im`]: its output row, the input column of its kernel column 0 (negative in the
/// left padding), and its kernel columns j_lo..j_hi that fall inside the image.
struct PixelWindow {
    oy: usize,
    ix0: isize,
    j_lo: usize,
    j_hi: usize,
}

impl PixelWindow {
    #[inline(always)]
    fn of(g: &Im2colGeom, p: usize) -> PixelWindow {
        let (oy, ox) = (p / g.ow, p % g.ow);
        let ix0 = (ox * g.stride) as isize - g.pad_left as isize;
        let j_lo = (-ix0).clamp(0, g.kw as isize) as usize;
        let j_hi = (g.w as isize - ix0).clamp(j_lo as isize, g.kw as isize) as usize;
        PixelWindow { oy, ix0, j_lo, j_hi }
    }

    /// The offset in the input of kernel row i's first value inside the image, or None
    /// where the row lies in the padding (or no column is inside).
    #[inline(always)]
    fn row_start(&self, g: &Im2colGeom, i: usize) -> Option<usize> {
        let iy = (self.oy * g.stride + i) as isize - g.pad_top as isize;
        let inside = iy >= 0 && iy < g.h as isize && self.j_lo < self.j_hi;
        inside.then(|| (iy as usize * g.w + (self.ix0 + self.j_lo as isize) as usize) * g.c)
    }
}

/// Unfolds the output pixels `pixels` (of OH·OW, in row-major order) of one channels-last
/// sample into rows, one a pixel. xt: (H, W, C) → rows: (pixels, KH·KW·C), row (oy, ox)
/// holding, for i, j, c in that order, xt[oy·s + i − pad_top, ox·s + j − pad_left, c]
/// (0 outside the image). Each kernel row i is one contiguous copy of up to KW·C values:
/// the reason for this layout.
pub fn im2row(xt: &[f32], g: &Im2colGeom, pixels: std::ops::Range<usize>, rows: &mut [f32]) {
    let (c, kwc) = (g.c, g.kw * g.c);
    let kkc = g.kh * kwc;
    assert!(pixels.end <= g.oh * g.ow, "im2row: pixels {pixels:?} of {}", g.oh * g.ow);
    assert_eq!(rows.len(), pixels.len() * kkc, "im2row: rows for another range");
    for (p, row) in pixels.zip(rows.chunks_exact_mut(kkc)) {
        let win = PixelWindow::of(g, p);
        for (i, seg) in row.chunks_exact_mut(kwc).enumerate() {
            let Some(start) = win.row_start(g, i) else {
                seg.fill(0.0);
                continue;
            };
            seg[..win.j_lo * c].fill(0.0);
            seg[win.j_hi * c..].fill(0.0);
            seg[win.j_lo * c..win.j_hi * c].copy_from_slice(&xt[start..start + (win.j_hi - win.j_lo) * c]);
        }
    }
}

widest! {
    /// The adjoint of [`im2row`]: adds every row entry back to the input value it came from.
    /// drows: (pixels, KH·KW·C) → dxt: (H, W, C), accumulated (zero it first).
    ///
    /// At the processor's widest vectors (`backend::simd`): its adds are short runs of
    /// KW·C values.
    pub fn row2im(drows: &[f32], g: &Im2colGeom, pixels: std::ops::Range<usize>, dxt: &mut [f32]) {
        let (c, kwc) = (g.c, g.kw * g.c);
        let kkc = g.kh * kwc;
        assert!(pixels.end <= g.oh * g.ow, "row2im: pixels {pixels:?} of {}", g.oh * g.ow);
        assert_eq!(drows.len(), pixels.len() * kkc, "row2im: rows for another range");
        for (p, row) in pixels.zip(drows.chunks_exact(kkc)) {
            let win = PixelWindow::of(g, p);
            for (i, seg) in row.chunks_exact(kwc).enumerate() {
                let Some(start) = win.row_start(g, i) else { continue };
                let n = (win.j_hi - win.j_lo) * c;
                for (d, v) in dxt[start..start + n].iter_mut().zip(&seg[win.j_lo * c..win.j_hi * c]) {
                    *d += v;
                }
            }
        }
    }
}

/// The fixed partition of `n` batch rows into chunks for reductions over the batch.
/// It depends on `n` alone, never on the thread count, so partial sums are formed and
/// combined in the same order on every machine. At most 16 chunks (work for 16 threads),
/// of at least 8 rows each: a chunk's weight-gradient GEMM and its partial sum cost about
/// as much for 1 row as for 8, so the small passes of an accumulated step (micro-batches
/// of 32 rows or fewer) would otherwise pay 16 of them (measured: conv2's pass 19% slower
/// per sample at 32 rows than at 128 with chunks of 2; at most 5% with chunks of 8).
pub fn batch_chunks(n: usize) -> Vec<std::ops::Range<usize>> {
    const CHUNKS: usize = 16;
    const MIN_ROWS: usize = 8;
    let g = CHUNKS.min(n / MIN_ROWS).max(1);
    (0..g).map(|i| (i * n / g)..((i + 1) * n / g)).filter(|r| !r.is_empty()).collect()
}

/// How a chunk's samples are cut into pieces of at most `budget` bytes of work buffer, so
/// that what a piece writes is still in the core's L2 cache when the next stage reads it:
/// `samples` whole samples at a time, or, where one sample is larger than the budget, one
/// sample in bands of `band` units (output pixels, tiles; the last band shorter). A
/// function of the shapes alone, like everything that orders a sum here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pieces {
    pub samples: usize,
    pub band: usize,
}

impl Pieces {
    /// For samples of `units` units of `unit_bytes` each, within `budget` bytes.
    pub fn fit(units: usize, unit_bytes: usize, budget: usize) -> Pieces {
        let per_sample = units * unit_bytes;
        if per_sample <= budget {
            Pieces { samples: budget / per_sample.max(1), band: units }
        } else {
            Pieces { samples: 1, band: units.div_ceil(per_sample.div_ceil(budget)) }
        }
    }

    /// A sample's bands of its `units`: 0..band, band..2·band, …, up to `units`.
    pub fn bands(self, units: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
        (0..units).step_by(self.band.max(1)).map(move |b| b..(b + self.band).min(units))
    }
}

/// Splits `buf` ((n·per) values, sample after sample) into the slices of the
/// [`batch_chunks`] of `n`, so that each chunk can be written by its own task.
pub fn split_by_chunks(buf: &mut [f32], n: usize, per: usize) -> Vec<&mut [f32]> {
    let mut parts = Vec::new();
    let mut rest = buf;
    for r in batch_chunks(n) {
        let (head, tail) = rest.split_at_mut(r.len() * per);
        parts.push(head);
        rest = tail;
    }
    parts
}

/// A chunk's input samples for a backward, and where their gradients go: apart, or over
/// the inputs themselves, when the layer holds the only reference to them (no new buffer,
/// none to zero). Over the inputs, a layer must read all of a sample before it writes the
/// sample's gradient: each sample is a slot that holds its input and then its gradient.
pub enum Samples<'a> {
    /// The inputs, and the gradients' own buffer if they are asked for.
    Apart { x: &'a [f32], dx: Option<&'a mut [f32]> },
    /// The inputs, each overwritten by its gradient.
    Overwritten(&'a mut [f32]),
}

impl Samples<'_> {
    /// Sample k's input (k counted within the chunk), of `per` values. Once its
    /// gradient was written over it, this is the gradient.
    pub fn input(&self, k: usize, per: usize) -> &[f32] {
        let all = match self {
            Samples::Apart { x, .. } => &x[..],
            Samples::Overwritten(both) => &both[..],
        };
        &all[k * per..(k + 1) * per]
    }

    /// Where sample k's gradient goes, if the gradients are asked for.
    pub fn grad(&mut self, k: usize, per: usize) -> Option<&mut [f32]> {
        match self {
            Samples::Apart { dx, .. } => dx.as_deref_mut().map(|d| &mut d[k * per..(k + 1) * per]),
            Samples::Overwritten(both) => Some(&mut both[k * per..(k + 1) * per]),
        }
    }

    /// Whether the gradients are asked for.
    pub fn wants_grad(&self) -> bool {
        matches!(self, Samples::Apart { dx: Some(_), .. } | Samples::Overwritten(_))
    }

    /// How many values the inputs hold.
    pub fn len(&self) -> usize {
        match self {
            Samples::Apart { x, .. } => x.len(),
            Samples::Overwritten(both) => both.len(),
        }
    }
}

/// `((p0 + p1) + p2) + ...`, element-wise, in index order, summed into the first part
/// (no copy of it; empty for no part).
pub fn sum_partials(parts: Vec<Vec<f32>>) -> Vec<f32> {
    let mut parts = parts.into_iter();
    let Some(mut total) = parts.next() else { return Vec::new() };
    for p in parts {
        for (t, v) in total.iter_mut().zip(&p) {
            *t += v;
        }
    }
    total
}

/// Adds `parts` into `out` in index order: `out += ((p0 + p1) + p2) + ...`.
pub fn add_partials(out: &mut [f32], parts: Vec<Vec<f32>>) {
    for (o, t) in out.iter_mut().zip(&sum_partials(parts)) {
        *o += t;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape the layers transpose (the convolutions' (C, H·W) planes both ways,
    /// attention's weights) and ragged ones, through every register tile this processor
    /// has and value by value alone (the path of other processors, and of the
    /// edges), each written between guard bands that must come out untouched.
    #[test]
    fn transpose_moves_every_value_and_nothing_else() {
        const GUARD: usize = 37;
        let shapes = [(16, 784), (784, 16), (32, 196), (196, 32), (64, 49), (49, 64), (1, 784), (784, 1)];
        let more = [(384, 128), (128, 512), (17, 33), (33, 17), (1, 5), (40, 16), (16, 16), (31, 47), (0, 5)];
        for (rows, cols) in shapes.into_iter().chain(more) {
            let src: Vec<f32> = (0..rows * cols).map(|i| i as f32 + 0.5).collect();
            for regs in register_paths() {
                let mut buf = vec![f32::NAN; rows * cols + 2 * GUARD];
                let dst = &mut buf[GUARD..GUARD + rows * cols];
                transpose_by(regs, View { rows, cols, src: Rows::Every(cols), dst: Rows::Every(rows) }, &src, dst);
                for r in 0..rows {
                    for c in 0..cols {
                        let got = buf[GUARD + c * rows + r];
                        assert_eq!(got, src[r * cols + c], "{rows}×{cols} ({regs:?}) at ({r}, {c})");
                    }
                }
                let guards = buf[..GUARD].iter().chain(&buf[GUARD + rows * cols..]);
                assert!(guards.into_iter().all(|v| v.is_nan()), "{rows}×{cols}: a write outside the destination");
            }
        }
    }

    /// A strided view (rows apart by more than a row's length on both sides, as a
    /// permutation's moving axes are) moves every value of the view and leaves the gaps
    /// between its rows as they were, through every register path.
    #[test]
    fn a_strided_transpose_moves_the_view_and_leaves_the_gaps() {
        for (rows, cols, src_stride, dst_stride) in [(17, 33, 40, 20), (16, 16, 16, 16), (40, 24, 96, 43), (3, 5, 7, 3)]
        {
            let src: Vec<f32> = (0..(rows - 1) * src_stride + cols).map(|i| i as f32 + 0.5).collect();
            let len = (cols - 1) * dst_stride + rows;
            for regs in register_paths() {
                let mut dst = vec![f32::NAN; len];
                let v = View { rows, cols, src: Rows::Every(src_stride), dst: Rows::Every(dst_stride) };
                transpose_by(regs, v.checked(src.len(), dst.len()), &src, &mut dst);
                for (at, &got) in dst.iter().enumerate() {
                    let (j, i) = (at / dst_stride, at % dst_stride);
                    if i < rows {
                        assert_eq!(got, src[i * src_stride + j], "{rows}×{cols} ({regs:?}) at ({i}, {j})");
                    } else {
                        assert!(got.is_nan(), "{rows}×{cols} ({regs:?}): a write at {at}, between rows");
                    }
                }
            }
            let mut dst = vec![f32::NAN; len];
            transpose_strided(&src, rows, cols, src_stride, &mut dst, dst_stride);
            assert_eq!(dst[(cols - 1) * dst_stride + rows - 1], src[(rows - 1) * src_stride + cols - 1]);
        }
    }

    /// The register paths this processor has, and the value-by-value one.
    fn register_paths() -> Vec<Registers> {
        let mut paths = vec![Registers::Local];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                paths.push(Registers::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                paths.push(Registers::Avx512);
            }
        }
        paths
    }

    /// An image into its padded channels-last place and back, as the Winograd convolution
    /// moves its samples, for the three image sizes of the residual networks and ragged
    /// ones, through every register path: each pixel's channels land at its place, the
    /// padding (and the guard past the buffer) is untouched, and out_of_padded brings back
    /// exactly the image without reading the padding.
    #[test]
    fn an_image_moves_into_its_padded_place_and_back() {
        for (c, h, w, top, left, wp, hp) in [
            (16, 28, 28, 1, 1, 30, 30),
            (32, 14, 14, 1, 1, 16, 16),
            (64, 7, 7, 1, 1, 10, 10),
            (8, 5, 3, 0, 2, 6, 7),
            (17, 9, 11, 2, 0, 12, 12),
            (1, 1, 1, 0, 0, 1, 1),
        ] {
            let place = Padded { w, wp, top, left, c };
            let x: Vec<f32> = (0..c * h * w).map(|i| i as f32 + 0.25).collect();
            let len = hp * wp * c;
            for regs in register_paths() {
                let mut xp = vec![f32::NAN; len + 3];
                into_padded_by(regs, &x, place, &mut xp[..len]);
                for (at, v) in xp.iter().enumerate() {
                    let (pix, ch) = (at / c, at % c);
                    let (yy, xx) = (pix / wp, pix % wp);
                    let inside = at < len && (top..top + h).contains(&yy) && (left..left + w).contains(&xx);
                    if inside {
                        let p = (yy - top) * w + xx - left;
                        assert_eq!(*v, x[ch * h * w + p], "{c}×{h}×{w} ({regs:?}): channel {ch} of pixel {p}");
                    } else {
                        assert!(v.is_nan(), "{c}×{h}×{w} ({regs:?}): a write at {at}, outside the image");
                    }
                }
                let mut back = vec![f32::INFINITY; x.len()];
                out_of_padded_by(regs, &xp[..len], place, &mut back);
                assert_eq!(back, x, "{c}×{h}×{w} ({regs:?}): the image did not come back");
            }
        }
    }

    /// A buffer too short for the image's place (4 rows from row 1, in 4 padded rows) is
    /// refused before any value moves.
    #[test]
    #[should_panic(expected = "destination view out of bounds")]
    fn a_padded_buffer_too_short_is_refused() {
        let place = Padded { w: 4, wp: 6, top: 1, left: 1, c: 8 };
        into_padded(&[0.0; 8 * 4 * 4], place, &mut vec![0.0; 6 * 4 * 8]);
    }

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    s += a[i * k + p] as f64 * b[p * n + j] as f64;
                }
                c[i * n + j] = s as f32;
            }
        }
        c
    }

    fn data(len: usize, seed: u64) -> Vec<f32> {
        let mut g = crate::rng::SplitMix64::new(seed);
        (0..len).map(|_| g.next_f32() * 2.0 - 1.0).collect()
    }

    #[test]
    fn gemm_matches_naive_with_transposes_and_accumulation() {
        let (m, k, n) = (37, 53, 29);
        let a = data(m * k, 1);
        let b = data(k * n, 2);
        let want = naive(&a, &b, m, k, n);
        let mut c = vec![0.0; m * n];
        gemm(Mat::rows(&a, m, k), Mat::rows(&b, k, n), &mut c, n, Accumulate::Overwrite);
        // Tolerance: k = 53 products of values in [-1, 1]; f32 rounding ≤ 53·2^-24 ≈ 3e-6.
        for (x, y) in c.iter().zip(&want) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
        // a stored transposed (k × m) and viewed back with .t()
        let mut at = vec![0.0; k * m];
        for i in 0..m {
            for p in 0..k {
                at[p * m + i] = a[i * k + p];
            }
        }
        let mut c2 = vec![1.0; m * n];
        gemm(Mat::rows(&at, k, m).t(), Mat::rows(&b, k, n), &mut c2, n, Accumulate::Add);
        for (x, y) in c2.iter().zip(&want) {
            assert!((x - (y + 1.0)).abs() < 1e-5);
        }
    }

    #[test]
    fn gemm_is_bitwise_identical_across_thread_counts() {
        let (m, k, n) = (96, 700, 300);
        let a = data(m * k, 3);
        let b = data(k * n, 4);
        let run = |threads| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut c = vec![0.0; m * n];
            pool.install(|| gemm(Mat::rows(&a, m, k), Mat::rows(&b, k, n), &mut c, n, Accumulate::Overwrite));
            c
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }

    /// The reference: the definition, element by element.
    fn im2col_naive(x: &[f32], g: &Im2colGeom) -> Vec<f32> {
        let mut col = Vec::new();
        for c in 0..g.c {
            for i in 0..g.kh {
                for j in 0..g.kw {
                    for oy in 0..g.oh {
                        for ox in 0..g.ow {
                            let iy = (oy * g.stride + i) as isize - g.pad_top as isize;
                            let ix = (ox * g.stride + j) as isize - g.pad_left as isize;
                            let inside = (0..g.h as isize).contains(&iy) && (0..g.w as isize).contains(&ix);
                            col.push(if inside { x[(c * g.h + iy as usize) * g.w + ix as usize] } else { 0.0 });
                        }
                    }
                }
            }
        }
        col
    }

    #[test]
    fn im2col_matches_its_definition() {
        let geoms = [
            Im2colGeom { c: 2, h: 7, w: 6, kh: 3, kw: 2, stride: 2, pad_top: 1, pad_left: 0, oh: 4, ow: 3 },
            Im2colGeom { c: 1, h: 5, w: 5, kh: 4, kw: 4, stride: 1, pad_top: 1, pad_left: 1, oh: 5, ow: 5 },
            Im2colGeom { c: 3, h: 12, w: 12, kh: 6, kw: 6, stride: 2, pad_top: 2, pad_left: 2, oh: 6, ow: 6 },
            Im2colGeom { c: 2, h: 3, w: 3, kh: 3, kw: 3, stride: 3, pad_top: 2, pad_left: 2, oh: 2, ow: 2 },
        ];
        for g in geoms.into_iter().chain(POINTWISE) {
            let x = data(g.c * g.h * g.w, 9);
            let mut col = vec![f32::NAN; g.col_rows() * g.col_cols()];
            im2col(&x, &g, &mut col);
            assert_eq!(col, im2col_naive(&x, &g), "{g:?}");
        }
    }

    /// 1×1 windows with no padding, which unfold and fold by their own path: strides 2
    /// (`resnet8`'s projection shortcuts) on odd and even sizes, 1 and 3.
    const POINTWISE: [Im2colGeom; 4] = [
        Im2colGeom { c: 3, h: 7, w: 6, kh: 1, kw: 1, stride: 2, pad_top: 0, pad_left: 0, oh: 4, ow: 3 },
        Im2colGeom { c: 2, h: 8, w: 8, kh: 1, kw: 1, stride: 2, pad_top: 0, pad_left: 0, oh: 4, ow: 4 },
        Im2colGeom { c: 2, h: 5, w: 4, kh: 1, kw: 1, stride: 1, pad_top: 0, pad_left: 0, oh: 5, ow: 4 },
        Im2colGeom { c: 1, h: 7, w: 8, kh: 1, kw: 1, stride: 3, pad_top: 0, pad_left: 0, oh: 3, ow: 3 },
    ];

    #[test]
    fn col2im_writes_every_value_as_0_plus_its_entries_in_kernel_order() {
        let geoms = [
            Im2colGeom { c: 2, h: 7, w: 6, kh: 3, kw: 2, stride: 2, pad_top: 1, pad_left: 0, oh: 4, ow: 3 },
            Im2colGeom { c: 3, h: 12, w: 12, kh: 6, kw: 6, stride: 2, pad_top: 2, pad_left: 2, oh: 6, ow: 6 },
        ];
        for g in geoms.into_iter().chain(POINTWISE) {
            let p = g.col_cols();
            // Every third entry −0: a value with only −0 entries is +0 (0 + −0).
            let dcol: Vec<f32> = data(g.col_rows() * p, 12)
                .into_iter()
                .enumerate()
                .map(|(i, v)| if i % 3 == 0 { -0.0 } else { v })
                .collect();
            let mut want = vec![0.0f32; g.c * g.h * g.w];
            for c in 0..g.c {
                for (iy, ix) in (0..g.h).flat_map(|iy| (0..g.w).map(move |ix| (iy, ix))) {
                    let mut sum = 0.0f32;
                    for (i, j) in (0..g.kh).flat_map(|i| (0..g.kw).map(move |j| (i, j))) {
                        let (ty, tx) = (iy + g.pad_top, ix + g.pad_left);
                        let (Some(ty), Some(tx)) = (ty.checked_sub(i), tx.checked_sub(j)) else { continue };
                        if ty % g.stride == 0 && tx % g.stride == 0 && ty / g.stride < g.oh && tx / g.stride < g.ow {
                            sum += dcol[((c * g.kh + i) * g.kw + j) * p + ty / g.stride * g.ow + tx / g.stride];
                        }
                    }
                    want[(c * g.h + iy) * g.w + ix] = sum;
                }
            }
            let mut dx = vec![f32::NAN; want.len()];
            col2im(&dcol, &g, &mut dx);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&dx), bits(&want), "{g:?}");
        }
    }

    #[test]
    fn im2row_is_im2col_in_channels_last_order() {
        let g = Im2colGeom { c: 3, h: 7, w: 6, kh: 3, kw: 2, stride: 2, pad_top: 1, pad_left: 1, oh: 4, ow: 3 };
        let x = data(g.c * g.h * g.w, 10);
        let mut xt = vec![0.0; x.len()];
        chw_to_hwc(&x, g.c, &mut xt);
        let mut rows = vec![f32::NAN; g.col_rows() * g.col_cols()];
        im2row(&xt, &g, 0..g.col_cols(), &mut rows);
        let col = im2col_naive(&x, &g);
        let p = g.col_cols();
        for pix in 0..p {
            for c in 0..g.c {
                for i in 0..g.kh {
                    for j in 0..g.kw {
                        let r = rows[pix * g.col_rows() + (i * g.kw + j) * g.c + c];
                        assert_eq!(r, col[((c * g.kh + i) * g.kw + j) * p + pix]);
                    }
                }
            }
        }
        let mut back = vec![0.0; x.len()];
        hwc_to_chw(&xt, g.c, &mut back);
        assert_eq!(back, x);
        // adjoint: <im2row(xt), y> == <xt, row2im(y)>
        let y = data(rows.len(), 11);
        let mut dxt = vec![0.0; xt.len()];
        row2im(&y, &g, 0..g.col_cols(), &mut dxt);
        let lhs: f64 = rows.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum();
        let rhs: f64 = xt.iter().zip(&dxt).map(|(a, b)| *a as f64 * *b as f64).sum();
        assert!((lhs - rhs).abs() < 1e-5, "{lhs} vs {rhs}");
    }

    #[test]
    fn col2im_is_the_adjoint_of_im2col() {
        // <im2col(x), y> == <x, col2im(y)> for any x, y: the defining property of the
        // backward pass of an unfold.
        let g = Im2colGeom { c: 2, h: 7, w: 6, kh: 3, kw: 2, stride: 2, pad_top: 1, pad_left: 0, oh: 4, ow: 3 };
        let x = data(g.c * g.h * g.w, 5);
        let y = data(g.col_rows() * g.col_cols(), 6);
        let mut col = vec![0.0; y.len()];
        im2col(&x, &g, &mut col);
        let mut dx = vec![0.0; x.len()];
        col2im(&y, &g, &mut dx);
        let lhs: f64 = col.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum();
        let rhs: f64 = x.iter().zip(&dx).map(|(a, b)| *a as f64 * *b as f64).sum();
        assert!((lhs - rhs).abs() < 1e-5, "{lhs} vs {rhs}");
    }

    #[test]
    fn batch_chunks_cover_the_batch_in_order() {
        for n in [0, 1, 5, 16, 17, 256] {
            let g = batch_chunks(n);
            let flat: Vec<usize> = g.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(flat, (0..n).collect::<Vec<_>>());
        }
        // At most 16 chunks of at least 8 rows (one chunk below 16 rows).
        let counts: Vec<usize> = [5, 16, 32, 64, 127, 128, 256].iter().map(|&n| batch_chunks(n).len()).collect();
        assert_eq!(counts, vec![1, 2, 4, 8, 15, 16, 16]);
    }
}
