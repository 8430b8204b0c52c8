//! The geometry of a 2-D window sliding over the (H, W) plane of an NCHW tensor: Keras's
//! `valid` and `same` padding and PyTorch's explicit symmetric padding, the pads on each
//! side and the output size.
//!
//! Owns: [`Window2d`] (kernel, stride, padding: what a layer is given) and [`Geometry2d`]
//! (the same window placed on one H×W plane: pads and output size). It is the one place
//! this arithmetic is written: the CPU convolution (`ops::conv2d`), max pooling
//! (`ops::maxpool2d`) and the GPU's launch geometry ([`Geometry2d::launch_geom`]) are all
//! built from a `Geometry2d`, so that the two backends cannot disagree on where a window
//! starts. What a window computes is left to its layer.

use std::ops::Range;

#[cfg(feature = "cuda")]
use crate::cuda::launch::dim;
#[cfg(feature = "cuda")]
use crate::error::{Error, Result};

/// How the input is padded.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Padding {
    /// No padding: OH = ⌊(H − KH)/s⌋ + 1.
    Valid,
    /// Keras "same": OH = ⌈H/s⌉, pad_total = max((OH − 1)·s + KH − H, 0), pad_top =
    /// ⌊pad_total/2⌋ and the rest at the bottom (asymmetric when pad_total is odd).
    Same,
    /// PyTorch's `padding=(PH, PW)`: PH rows above and below, PW columns on either side;
    /// OH = ⌊(H + 2·PH − KH)/s⌋ + 1. A pad is less than its kernel side (the layers'
    /// constructors check it), so every window overlaps the plane.
    Explicit(usize, usize),
}

impl Padding {
    /// The spec's words for it: `"valid"`, `"same"`, or the pads `[PH, PW]`.
    pub fn to_json(self) -> serde_json::Value {
        match self {
            Padding::Valid => "valid".into(),
            Padding::Same => "same".into(),
            Padding::Explicit(ph, pw) => serde_json::json!([ph, pw]),
        }
    }

    /// For descriptions: `valid`, `same` or `pad 1` / `pad 1x2`.
    pub fn describe(self) -> String {
        match self {
            Padding::Valid => "valid".into(),
            Padding::Same => "same".into(),
            Padding::Explicit(ph, pw) if ph == pw => format!("pad {ph}"),
            Padding::Explicit(ph, pw) => format!("pad {ph}x{pw}"),
        }
    }

    /// Why this padding does not suit a `kernel` window, if it does not: an explicit pad
    /// must be less than its kernel side, so that no window lies wholly in the padding.
    pub fn check(self, kernel: (usize, usize)) -> Result<(), String> {
        match self {
            Padding::Explicit(ph, pw) if ph >= kernel.0 || pw >= kernel.1 => {
                Err(format!("padding {ph}x{pw} must be less than the {}x{} kernel on each side", kernel.0, kernel.1))
            }
            _ => Ok(()),
        }
    }

    /// The pads of one dimension (0: rows, 1: columns) when explicit.
    fn explicit(self, dim: usize) -> Option<usize> {
        match self {
            Padding::Explicit(ph, pw) => Some(if dim == 0 { ph } else { pw }),
            _ => None,
        }
    }
}

/// Pads of one dimension: (before, after, output size), or None if the input is empty or
/// (valid padding) smaller than the kernel. `k` and `s` are positive.
#[cfg(test)]
pub(crate) fn pads(size: usize, k: usize, s: usize, padding: Padding) -> Option<(usize, usize, usize)> {
    pads_of(size, k, s, padding, 0)
}

/// [`pads`] of dimension `dim` (0: rows, 1: columns; it matters for explicit pads only).
fn pads_of(size: usize, k: usize, s: usize, padding: Padding, dim: usize) -> Option<(usize, usize, usize)> {
    if let Some(p) = padding.explicit(dim) {
        // PyTorch: output ⌊(H + 2p − k)/s⌋ + 1; the bottom pad the windows reach is what
        // is left of p below the last one, which the padded extent needs exactly.
        if size == 0 || size + 2 * p < k {
            return None;
        }
        let out = (size + 2 * p - k) / s + 1;
        let bottom = ((out - 1) * s + k).saturating_sub(size + p);
        return Some((p, bottom, out));
    }
    match padding {
        Padding::Valid => (size >= k).then(|| (0, 0, (size - k) / s + 1)),
        Padding::Same => {
            if size == 0 {
                return None;
            }
            let out = size.div_ceil(s);
            let total = ((out - 1) * s + k).saturating_sub(size);
            Some((total / 2, total - total / 2, out))
        }
        Padding::Explicit(..) => unreachable!("explicit pads are placed above"),
    }
}

/// A window of `kernel` (KH, KW) moved by `stride` (SH, SW), with `padding`: what a
/// convolution or a pooling layer is configured with. Kernel and stride are positive
/// (the layers' constructors check it).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Window2d {
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: Padding,
}

/// A [`Window2d`] placed on an H×W plane. Padded positions lie outside `0..H` × `0..W`;
/// output (oy, ox) covers input rows `oy·SH − pad_top ..` + KH and columns
/// `ox·SW − pad_left ..` + KW.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Geometry2d {
    pub window: Window2d,
    pub h: usize,
    pub w: usize,
    pub pad_top: usize,
    pub pad_bottom: usize,
    pub pad_left: usize,
    pub pad_right: usize,
    pub oh: usize,
    pub ow: usize,
}

impl Window2d {
    pub fn new(kernel: (usize, usize), stride: (usize, usize), padding: Padding) -> Window2d {
        Window2d { kernel, stride, padding }
    }

    /// The window on an H×W plane, or None when the plane is empty or (valid padding)
    /// smaller than the kernel.
    pub fn over(&self, h: usize, w: usize) -> Option<Geometry2d> {
        let ((kh, kw), (sh, sw)) = (self.kernel, self.stride);
        let (pad_top, pad_bottom, oh) = pads_of(h, kh, sh, self.padding, 0)?;
        let (pad_left, pad_right, ow) = pads_of(w, kw, sw, self.padding, 1)?;
        Some(Geometry2d { window: *self, h, w, pad_top, pad_bottom, pad_left, pad_right, oh, ow })
    }

    /// `KHxKW` or `KHxKW, stride SH` / `stride SHxSW`, and the padding, for descriptions.
    pub fn describe(&self) -> String {
        let ((kh, kw), (sh, sw)) = (self.kernel, self.stride);
        let stride = if sh == sw { format!("{sh}") } else { format!("{sh}x{sw}") };
        format!("{kh}x{kw}, stride {stride}, {}", self.padding.describe())
    }
}

impl Geometry2d {
    /// The input rows output row `oy` covers, clipped to the plane (padded rows left
    /// out). Never empty: a `same` window overlaps the plane by at least one row, since
    /// pad_top < KH and (OH − 1)·SH < H.
    pub fn rows(&self, oy: usize) -> Range<usize> {
        clipped(oy, self.window.stride.0, self.pad_top, self.window.kernel.0, self.h)
    }

    /// The input columns output column `ox` covers, clipped to the plane.
    pub fn cols(&self, ox: usize) -> Range<usize> {
        clipped(ox, self.window.stride.1, self.pad_left, self.window.kernel.1, self.w)
    }

    /// The GPU's launch geometry of this placement for a batch of `n` samples of `c`
    /// channels, with every pad of this one, so the two backends share them.
    #[cfg(feature = "cuda")]
    pub fn launch_geom(&self, n: usize, c: usize) -> WindowGeom {
        let pads = [self.pad_top, self.pad_left, self.pad_bottom, self.pad_right];
        let geom = WindowGeom::new(n, c, (self.h, self.w), self.window.kernel, self.window.stride, pads);
        debug_assert_eq!((geom.oh(), geom.ow()), (self.oh, self.ow), "the padded extent gives the placement's output");
        geom
    }
}

/// `o·s − pad .. o·s − pad + k`, clipped to `0..size`.
fn clipped(o: usize, s: usize, pad: usize, k: usize, size: usize) -> Range<usize> {
    let start = o * s;
    start.saturating_sub(pad).min(size)..(start + k).saturating_sub(pad).min(size)
}

/// Geometry of a 2-D window (a convolution's or a pooling's) on NCHW input, padding
/// asymmetric, no dilation. The layers build it from their own placement
/// ([`Geometry2d::launch_geom`], so the two backends share every pad); the fields stay
/// public for tests that state a geometry outright.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowGeom {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride_h: usize,
    pub stride_w: usize,
    pub pad_top: usize,
    pub pad_left: usize,
    pub pad_bottom: usize,
    pub pad_right: usize,
}

#[cfg(feature = "cuda")]
impl WindowGeom {
    /// A batch of `n` samples of `c` channels of (H, W) = `hw` under a window of `kernel`
    /// (KH, KW) moved by `stride` (SH, SW), with the plane padded by
    /// `pads` = [top, left, bottom, right].
    pub fn new(
        n: usize,
        c: usize,
        (h, w): (usize, usize),
        (kh, kw): (usize, usize),
        (stride_h, stride_w): (usize, usize),
        [pad_top, pad_left, pad_bottom, pad_right]: [usize; 4],
    ) -> WindowGeom {
        WindowGeom { n, c, h, w, kh, kw, stride_h, stride_w, pad_top, pad_left, pad_bottom, pad_right }
    }

    /// Output height: (H + PT + PB - KH) / SH + 1 (0 when the kernel does not fit).
    pub fn oh(&self) -> usize {
        (self.h + self.pad_top + self.pad_bottom).checked_sub(self.kh).map_or(0, |v| v / self.stride_h + 1)
    }
    /// Output width: (W + PL + PR - KW) / SW + 1 (0 when the kernel does not fit).
    pub fn ow(&self) -> usize {
        (self.w + self.pad_left + self.pad_right).checked_sub(self.kw).map_or(0, |v| v / self.stride_w + 1)
    }
    /// Elements of x: N*C*H*W.
    pub fn x_len(&self) -> usize {
        self.n * self.c * self.h * self.w
    }
    /// Elements of col: N * (C*KH*KW) * (OH*OW).
    pub fn col_len(&self) -> usize {
        self.n * self.c * self.kh * self.kw * self.oh() * self.ow()
    }
    /// Elements of a pooling's output (and its argmax): N*C*OH*OW.
    pub fn pooled_len(&self) -> usize {
        self.n * self.c * self.oh() * self.ow()
    }

    /// The 12 ints a window kernel takes (`cuda::declare::Kind::Geom`):
    /// N, C, H, W, KH, KW, SH, SW, PT, PL, OH, OW; a zero stride or a dimension past i32
    /// is [`Error::Shape`] of `op`.
    pub(crate) fn launch_args(&self, op: &'static str) -> Result<[i32; 12]> {
        let g = self;
        if g.stride_h == 0 || g.stride_w == 0 {
            return Err(Error::shape(op, format!("stride must be positive, got {g:?}")));
        }
        Ok([
            dim(op, "N", g.n)?,
            dim(op, "C", g.c)?,
            dim(op, "H", g.h)?,
            dim(op, "W", g.w)?,
            dim(op, "KH", g.kh)?,
            dim(op, "KW", g.kw)?,
            dim(op, "SH", g.stride_h)?,
            dim(op, "SW", g.stride_w)?,
            dim(op, "PT", g.pad_top)?,
            dim(op, "PL", g.pad_left)?,
            dim(op, "OH", g.oh())?,
            dim(op, "OW", g.ow())?,
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keras_same_padding_is_asymmetric_when_the_total_is_odd() {
        // H = 12, k = 6, s = 2: OH = 6, pad_total = (6-1)*2 + 6 - 12 = 4 → 2 / 2 (the
        // reference convnet's conv2, symmetric).
        assert_eq!(pads(12, 6, 2, Padding::Same), Some((2, 2, 6)));
        // H = 28, k = 3, s = 1: pad_total = 27 + 3 - 28 = 2 → 1 / 1.
        assert_eq!(pads(28, 3, 1, Padding::Same), Some((1, 1, 28)));
        // H = 5, k = 4, s = 1: pad_total = 4 + 4 - 5 = 3 → 1 on top, 2 at the bottom.
        assert_eq!(pads(5, 4, 1, Padding::Same), Some((1, 2, 5)));
        // H = 7, k = 3, s = 2: OH = 4, pad_total = 6 + 3 - 7 = 2 → 1 / 1.
        assert_eq!(pads(7, 3, 2, Padding::Same), Some((1, 1, 4)));
        // H = 6, k = 3, s = 2: OH = 3, pad_total = 4 + 3 - 6 = 1 → 0 on top, 1 at the bottom.
        assert_eq!(pads(6, 3, 2, Padding::Same), Some((0, 1, 3)));
        // H = 5, k = 2, s = 2: OH = 3, pad_total = 4 + 2 - 5 = 1 → 0 / 1 (a pooling case).
        assert_eq!(pads(5, 2, 2, Padding::Same), Some((0, 1, 3)));
        assert_eq!(pads(2, 3, 1, Padding::Valid), None);
        assert_eq!(pads(0, 1, 1, Padding::Valid), None);
        assert_eq!(pads(0, 1, 1, Padding::Same), None);
        assert_eq!(pads(28, 6, 2, Padding::Valid), Some((0, 0, 12)));
    }

    #[test]
    fn windows_are_clipped_to_the_plane_and_never_empty() {
        // H = 5, k = 4, s = 1, same: pads 1 / 2, OH = 5. Row windows: −1..3, 0..4, 1..5,
        // 2..6, 3..7, clipped to 0..5.
        let g = Window2d::new((4, 3), (1, 2), Padding::Same).over(5, 6).unwrap();
        assert_eq!((g.pad_top, g.pad_bottom, g.oh), (1, 2, 5));
        let rows: Vec<_> = (0..g.oh).map(|oy| g.rows(oy)).collect();
        assert_eq!(rows, vec![0..3, 0..4, 1..5, 2..5, 3..5]);
        // W = 6, k = 3, s = 2, same: OW = 3, pad_total = 4 + 3 − 6 = 1 → 0 / 1. Column
        // windows 0..3, 2..5, 4..7 → 4..6.
        assert_eq!((g.pad_left, g.pad_right, g.ow), (0, 1, 3));
        let cols: Vec<_> = (0..g.ow).map(|ox| g.cols(ox)).collect();
        assert_eq!(cols, vec![0..3, 2..5, 4..6]);
        // Every same window of every small case overlaps the plane.
        for size in 1..12 {
            for k in 1..6 {
                for s in 1..5 {
                    let g = Window2d::new((k, k), (s, s), Padding::Same).over(size, size).unwrap();
                    assert!((0..g.oh).all(|o| !g.rows(o).is_empty()), "size {size} k {k} s {s}");
                    if let Some(g) = Window2d::new((k, k), (s, s), Padding::Valid).over(size, size) {
                        assert!((0..g.oh).all(|o| g.rows(o).len() == k), "valid: whole windows");
                    }
                }
            }
        }
    }
}
