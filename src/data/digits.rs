//! The built-in real dataset: UCI optical handwritten digits, embedded in the library.
//!
//! Owns: the embedded file `data/digits/digits.csv.gz` (1797 8×8 images, values 0..16,
//! labels 0..9; provenance, licence and sha256 in `data/digits/README.md`), its parser,
//! the two layouts a model can ask for ([`DigitsLayout`]), the bilinear resize that
//! turns 8×8 into MNIST-sized 28×28 images, and the fixed train/test split.
//! The split draws from the crate's own `crate::rng::SplitMix64`: it must not depend
//! on any other crate's RNG, whose streams may change between versions.
//!
//! It leaves to others: shuffling per epoch and sharding (the trainer's sampler), and
//! scaling u8 pixels to 0..1 (the model's Rescaling layer, as in the Keras convnet).
//!
//! Why embed: the examples and tests train a real convnet on real images on any machine,
//! with no download and no network; the file is 57 KB.

use std::io::Read;
use std::path::Path;

use flate2::read::GzDecoder;

use super::{Dataset, Features, Splits};
use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// The gzip-compressed CSV, as shipped inside scikit-learn (see `data/digits/README.md`).
const DIGITS_CSV_GZ: &[u8] = include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/data/digits/digits.csv.gz"));

/// The name the embedded file goes by in error messages.
const EMBEDDED_PATH: &str = "data/digits/digits.csv.gz (embedded)";

/// Side of one source image.
const SIDE8: usize = 8;
/// Side of one MNIST-sized image, the input size of the Keras convnet.
const SIDE28: usize = 28;
/// Largest pixel value in the file: a count of "on" pixels in a 4×4 block.
const PIXEL_MAX: u8 = 16;
/// Number of classes (digits 0..9).
pub const DIGITS_CLASSES: usize = 10;
/// Number of images in the embedded file.
pub const DIGITS_LEN: usize = 1797;
/// Seed of the fixed train/test split ("lockstep" in ASCII). Changing it changes every
/// result trained on the digits; it is a constant on purpose.
pub const DIGITS_SPLIT_SEED: u64 = 0x6c6f_636b_7374_6570;
/// Training images: ⌊0.8 · 1797⌋.
pub const DIGITS_TRAIN_LEN: usize = 1437;
/// Test images: the rest, ⌈0.2 · 1797⌉ (scikit-learn's `train_test_split(test_size=0.2)`
/// rounds the test set up the same way).
pub const DIGITS_TEST_LEN: usize = 360;

/// How the digits are presented to a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DigitsLayout {
    /// Sample shape (1, 28, 28) (C, H, W), `Features::U8` in 0..255: each 8×8 image
    /// scaled by 255/16 and resized to 28×28 with PyTorch's bilinear interpolation
    /// (`align_corners=False`), rounded half to even. Stands in for MNIST in the convnet.
    Image28,
    /// Sample shape (64,), `Features::F32` in 0..1: the 64 pixels divided by 16.
    Flat8,
}

/// Loads the embedded digits as a fixed, stratified 1437/360 train/test split.
///
/// Both splits keep the file's order (the trainer shuffles); which image goes where is
/// fixed by [`DIGITS_SPLIT_SEED`] and does not depend on the layout.
pub fn load_digits(layout: DigitsLayout) -> Result<Splits> {
    let path = Path::new(EMBEDDED_PATH);
    let raw = parse_digits_csv(&decompress(DIGITS_CSV_GZ, path)?, path)?;
    let (train_idx, test_idx) = split_stratified(&raw.labels, DIGITS_CLASSES, DIGITS_TEST_LEN, DIGITS_SPLIT_SEED);
    let all = raw.into_dataset(layout)?;
    Ok(Splits { train: all.subset("digits/train", &train_idx), test: Some(all.subset("digits/test", &test_idx)) })
}

/// The file as parsed: pixels 0..16 and labels 0..9.
struct RawDigits {
    /// pixels: (N, 8·8), row-major.
    pixels: Vec<u8>,
    /// labels: (N,)
    labels: Vec<u32>,
}

impl RawDigits {
    fn into_dataset(self, layout: DigitsLayout) -> Result<Dataset> {
        let n = self.labels.len();
        match layout {
            DigitsLayout::Flat8 => {
                let x: Vec<f32> = self.pixels.iter().map(|&p| f32::from(p) / f32::from(PIXEL_MAX)).collect();
                // x: (N, 64)
                Dataset::new("digits", [SIDE8 * SIDE8], Features::F32(x), self.labels, DIGITS_CLASSES)
            }
            DigitsLayout::Image28 => {
                let scale = 255.0 / f32::from(PIXEL_MAX);
                let mut x = Vec::with_capacity(n * SIDE28 * SIDE28);
                let mut img8 = [0f32; SIDE8 * SIDE8];
                for src in self.pixels.chunks_exact(SIDE8 * SIDE8) {
                    for (o, &p) in img8.iter_mut().zip(src) {
                        *o = f32::from(p) * scale;
                    }
                    let img28 = resize_bilinear(&img8, (SIDE8, SIDE8), (SIDE28, SIDE28));
                    // Bilinear weights are a convex combination, so the values stay in
                    // 0..255 up to one rounding; the clamp only guards that rounding.
                    x.extend(img28.iter().map(|&v| v.round_ties_even().clamp(0.0, 255.0) as u8));
                }
                // x: (N, 1, 28, 28)
                Dataset::new("digits", [1, SIDE28, SIDE28], Features::U8(x), self.labels, DIGITS_CLASSES)
            }
        }
    }
}

fn decompress(gz: &[u8], path: &Path) -> Result<String> {
    let mut text = String::new();
    GzDecoder::new(gz)
        .read_to_string(&mut text)
        .map_err(|e| Error::format(path, format!("cannot decompress the gzip data: {e}")))?;
    Ok(text)
}

/// Parses the CSV: one image per line, 64 pixels 0..16 then the label 0..9. Every
/// malformed line is an error naming the line (1-based); a final newline is allowed,
/// an empty line elsewhere is not.
fn parse_digits_csv(text: &str, path: &Path) -> Result<RawDigits> {
    const FIELDS: usize = SIDE8 * SIDE8 + 1;
    let mut pixels = Vec::new();
    let mut labels = Vec::new();
    let body = text.strip_suffix('\n').unwrap_or(text);
    if body.is_empty() {
        return Err(Error::format(path, "no rows"));
    }
    for (i, line) in body.split('\n').enumerate() {
        let line_no = i + 1;
        let line = line.strip_suffix('\r').unwrap_or(line);
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != FIELDS {
            return Err(Error::format(
                path,
                format!("line {line_no}: expected {FIELDS} comma-separated values, found {}", fields.len()),
            ));
        }
        for (col, field) in fields.iter().enumerate() {
            let value: u32 = field.trim().parse().map_err(|_| {
                Error::format(
                    path,
                    format!("line {line_no}, value {}: '{field}' is not a non-negative integer", col + 1),
                )
            })?;
            if col < FIELDS - 1 {
                if value > u32::from(PIXEL_MAX) {
                    return Err(Error::format(
                        path,
                        format!("line {line_no}, pixel {col}: {value} is outside 0..={PIXEL_MAX}"),
                    ));
                }
                pixels.push(value as u8);
            } else {
                if value as usize >= DIGITS_CLASSES {
                    return Err(Error::format(
                        path,
                        format!("line {line_no}: label {value} is outside 0..{DIGITS_CLASSES}"),
                    ));
                }
                labels.push(value);
            }
        }
    }
    Ok(RawDigits { pixels, labels })
}

/// Resizes one single-channel image with PyTorch's
/// `F.interpolate(mode="bilinear", align_corners=False)` (its CPU float32 kernel):
/// output pixel `o` samples the source at `s = max(0, (o + 0.5) · in/out − 0.5)`
/// (half-pixel centres, clamped at the top/left edge); `i0 = ⌊s⌋`, `i1 = i0 + 1` except
/// at the last source pixel (clamp at the bottom/right edge), weight `s − i0` on `i1`.
/// Rows and columns are weighted separably; results match PyTorch up to float rounding
/// of the last bit.
///
/// src: (H, W) → returns (OH, OW)
pub(crate) fn resize_bilinear(src: &[f32], (h, w): (usize, usize), (oh, ow): (usize, usize)) -> Vec<f32> {
    debug_assert_eq!(src.len(), h * w);
    let taps_h = linear_taps(h, oh);
    let taps_w = linear_taps(w, ow);
    let mut out = Vec::with_capacity(oh * ow);
    for &(y0, y1, ly) in &taps_h {
        for &(x0, x1, lx) in &taps_w {
            let top = (1.0 - lx) * src[y0 * w + x0] + lx * src[y0 * w + x1];
            let bottom = (1.0 - lx) * src[y1 * w + x0] + lx * src[y1 * w + x1];
            out.push((1.0 - ly) * top + ly * bottom);
        }
    }
    out
}

/// For each of `out_len` output positions: the two source indices and the weight of the
/// second, as PyTorch's `area_pixel_compute_source_index` and
/// `guard_index_and_lambda` compute them (in f32, as for a float32 input).
fn linear_taps(in_len: usize, out_len: usize) -> Vec<(usize, usize, f32)> {
    let scale = in_len as f32 / out_len as f32;
    (0..out_len)
        .map(|o| {
            let s = (scale * (o as f32 + 0.5) - 0.5).max(0.0);
            let i0 = (s.floor() as usize).min(in_len - 1);
            let lambda = (s - i0 as f32).clamp(0.0, 1.0);
            let i1 = if i0 < in_len - 1 { i0 + 1 } else { i0 };
            (i0, i1, lambda)
        })
        .collect()
}

/// Splits sample indices into (train, test), stratified: class `c` with `n_c` samples
/// gives `test_len · n_c / N` of them to the test set, the fractional parts apportioned
/// by largest remainder (ties to the lower class), so the test set has exactly
/// `test_len` samples and every class within one of its share. Inside a class the
/// samples are shuffled with [`crate::rng::SplitMix64`] seeded by `seed` (classes in order 0, 1, ...),
/// the first ones go to test. Both lists are returned in ascending order.
fn split_stratified(labels: &[u32], num_classes: usize, test_len: usize, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let n = labels.len();
    let mut by_class: Vec<Vec<usize>> = vec![Vec::new(); num_classes];
    for (i, &l) in labels.iter().enumerate() {
        by_class[l as usize].push(i);
    }
    // Hamilton apportionment in integers: quota_c = test_len·n_c / n exactly.
    let mut quota: Vec<usize> = by_class.iter().map(|c| c.len() * test_len / n.max(1)).collect();
    let mut order: Vec<usize> = (0..num_classes).collect();
    order.sort_by_key(|&c| (std::cmp::Reverse(by_class[c].len() * test_len % n.max(1)), c));
    let missing = test_len.saturating_sub(quota.iter().sum());
    for &c in order.iter().take(missing) {
        quota[c] += 1;
    }

    let mut rng = SplitMix64::new(seed);
    let mut train = Vec::with_capacity(n.saturating_sub(test_len));
    let mut test = Vec::with_capacity(test_len);
    for (members, &q) in by_class.iter_mut().zip(&quota) {
        rng.shuffle(members);
        let q = q.min(members.len());
        test.extend_from_slice(&members[..q]);
        train.extend_from_slice(&members[q..]);
    }
    train.sort_unstable();
    test.sort_unstable();
    (train, test)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn embedded() -> RawDigits {
        let path = Path::new(EMBEDDED_PATH);
        parse_digits_csv(&decompress(DIGITS_CSV_GZ, path).unwrap(), path).unwrap()
    }

    fn parse_err(text: &str) -> String {
        match parse_digits_csv(text, Path::new("t.csv")) {
            Ok(_) => panic!("expected an error for {text:?}"),
            Err(e) => e.to_string(),
        }
    }

    /// A valid row: 64 pixels then the label.
    fn row(pixel: &str, label: &str) -> String {
        let mut fields = vec![pixel; 64];
        fields.push(label);
        fields.join(",")
    }

    // Class counts of the file, from
    // `zcat data/digits/digits.csv.gz | awk -F, '{print $65}' | sort | uniq -c`.
    const CLASS_COUNTS: [usize; 10] = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180];

    #[test]
    fn embedded_file_has_1797_rows_with_the_known_class_counts() {
        let raw = embedded();
        assert_eq!(raw.labels.len(), DIGITS_LEN);
        assert_eq!(raw.pixels.len(), DIGITS_LEN * 64);
        let mut counts = [0usize; 10];
        for &l in &raw.labels {
            counts[l as usize] += 1;
        }
        assert_eq!(counts, CLASS_COUNTS);
        // First row, from `zcat data/digits/digits.csv.gz | head -1`: label 0.
        assert_eq!(&raw.pixels[..8], &[0, 0, 5, 13, 9, 1, 0, 0]);
        assert_eq!(raw.labels[..3], [0, 1, 2]);
    }

    #[test]
    fn embedded_pixels_span_0_to_16() {
        let raw = embedded();
        assert_eq!(raw.pixels.iter().min(), Some(&0));
        assert_eq!(raw.pixels.iter().max(), Some(&16));
    }

    #[test]
    fn malformed_rows_are_errors_naming_the_line() {
        let good = row("1", "3");
        assert_eq!(parse_digits_csv(&format!("{good}\n{good}\n"), Path::new("t.csv")).unwrap().labels, [3, 3]);
        assert_eq!(parse_digits_csv(&format!("{good}\r\n{good}"), Path::new("t.csv")).unwrap().labels, [3, 3]);

        let e = parse_err(&format!("{good}\n1,2,3\n"));
        assert!(e.contains("t.csv") && e.contains("line 2: expected 65 comma-separated values, found 3"), "{e}");
        let e = parse_err(&format!("{good}\n\n{good}\n"));
        assert!(e.contains("line 2: expected 65"), "{e}");
        let e = parse_err(&format!("{good}\n{good}\n{}\n", row("x", "1")));
        assert!(e.contains("line 3, value 1: 'x' is not a non-negative integer"), "{e}");
        let e = parse_err(&row("-1", "1"));
        assert!(e.contains("line 1, value 1: '-1'"), "{e}");
        let e = parse_err(&row("17", "1"));
        assert!(e.contains("line 1, pixel 0: 17 is outside 0..=16"), "{e}");
        let e = parse_err(&row("0", "10"));
        assert!(e.contains("line 1: label 10 is outside 0..10"), "{e}");
        assert!(parse_err("").contains("no rows"));
        assert!(parse_err("\n").contains("no rows"));
    }

    #[test]
    fn corrupt_gzip_is_an_error() {
        let e = decompress(&DIGITS_CSV_GZ[..100], Path::new("x.gz")).unwrap_err().to_string();
        assert!(e.starts_with("x.gz: cannot decompress"), "{e}");
    }

    #[test]
    fn bilinear_2x2_to_4x4_matches_the_hand_derivation() {
        // Derivation (in = 2, out = 4, scale = 1/2): s(o) = max(0, (o + 0.5)/2 − 0.5)
        //   o = 0: s = −0.25 → 0    → i0 = 0, λ = 0    → a
        //   o = 1: s = 0.25         → i0 = 0, λ = 0.25 → 0.75a + 0.25b
        //   o = 2: s = 0.75         → i0 = 0, λ = 0.75 → 0.25a + 0.75b
        //   o = 3: s = 1.25         → i0 = 1 = last, i1 = 1 → b
        // So a row [a, b] becomes [a, .75a+.25b, .25a+.75b, b]. On [[0, 4], [8, 12]]:
        //   rows → [0, 1, 3, 4] and [8, 9, 11, 12]; the same weights down the columns give
        //   the four rows below. PyTorch agrees:
        //   F.interpolate(torch.tensor([[[[0., 4], [8, 12]]]]), size=(4, 4),
        //                 mode="bilinear", align_corners=False)
        // All values are exact in f32 (dyadic weights), so the comparison is exact.
        let out = resize_bilinear(&[0.0, 4.0, 8.0, 12.0], (2, 2), (4, 4));
        #[rustfmt::skip]
        let expected = [
            0.0, 1.0, 3.0, 4.0,
            2.0, 3.0, 5.0, 6.0,
            6.0, 7.0, 9.0, 10.0,
            8.0, 9.0, 11.0, 12.0,
        ];
        assert_eq!(out, expected);
    }

    #[test]
    fn bilinear_8_to_28_maps_corners_and_half_pixel_centres() {
        // src: (8, 8), value 10·row + col, distinct everywhere.
        let src: Vec<f32> = (0..64).map(|i| (10 * (i / 8) + i % 8) as f32).collect();
        let out = resize_bilinear(&src, (8, 8), (28, 28));
        let at = |y: usize, x: usize| out[y * 28 + x];
        // scale = 8/28 = 2/7. o = 0: s = 0.5·2/7 − 0.5 < 0 → 0; o = 1: s = 1.5·2/7 − 0.5
        // = −1/14 → 0; o = 27: s = 27.5·2/7 − 0.5 = 7.357 → i0 = 7 = last. So the
        // corners (and the first two rows/columns) copy the source corners exactly.
        assert_eq!(at(0, 0), 0.0);
        assert_eq!(at(1, 1), 0.0);
        assert_eq!(at(0, 27), 7.0);
        assert_eq!(at(27, 0), 70.0);
        assert_eq!(at(27, 27), 77.0);
        // o = 3: s = 3.5·2/7 − 0.5 = 0.5, half-way between source 0 and 1 (the f32
        // product 3.5·(2/7) may miss 1 by an ulp: tolerance 1e-5).
        // o = 10: s = 10.5·2/7 − 0.5 = 2.5, half-way between source 2 and 3.
        assert!((at(3, 3) - 5.5).abs() < 1e-5, "{}", at(3, 3)); // (0 + 1 + 10 + 11) / 4
        assert!((at(10, 3) - 25.5).abs() < 1e-5, "{}", at(10, 3)); // rows 2,3; cols 0,1
    }

    #[test]
    fn image28_resize_keeps_the_mean_and_the_corners() {
        let raw = embedded();
        let splits = load_digits(DigitsLayout::Image28).unwrap();
        let ds = splits.train;
        assert_eq!(ds.sample_shape().dims(), &[1, 28, 28]);
        let Features::U8(x) = ds.features() else { panic!("Image28 must be u8") };
        assert_eq!(x.len(), DIGITS_TRAIN_LEN * 28 * 28);
        // Mean brightness of the whole train split, before (scaled by 255/16) and after
        // the resize. Bilinear interpolation preserves the mean of the interior; the edge
        // clamp over-weights the border rows/columns (mostly blank in these digits) and
        // rounding to u8 adds ±0.5 per pixel, so the means need not agree exactly.
        // Measured when this test was written: 77.98246 and 77.98168 (relative 1e-5);
        // tolerance 0.1%, a hundred times that.
        let (train_idx, _) = split_stratified(&raw.labels, 10, DIGITS_TEST_LEN, DIGITS_SPLIT_SEED);
        let mean8: f64 = train_idx
            .iter()
            .flat_map(|&i| &raw.pixels[i * 64..(i + 1) * 64])
            .map(|&p| f64::from(p) * 255.0 / 16.0)
            .sum::<f64>()
            / (train_idx.len() * 64) as f64;
        let mean28: f64 = x.iter().map(|&p| f64::from(p)).sum::<f64>() / x.len() as f64;
        assert!((mean28 - mean8).abs() / mean8 < 1e-3, "mean 8x8 {mean8}, 28x28 {mean28}");
        // Corners of the first train image copy the source corners, scaled and rounded
        // half to even (see bilinear_8_to_28_maps_corners_and_half_pixel_centres).
        let i = train_idx[0];
        let p = |k: usize| (f32::from(raw.pixels[i * 64 + k]) * 255.0 / 16.0).round_ties_even() as u8;
        assert_eq!([x[0], x[27], x[27 * 28], x[28 * 28 - 1]], [p(0), p(7), p(56), p(63)]);
        assert_eq!(x.iter().max(), Some(&255), "a 16 pixel in a flat region must reach 255");
    }

    #[test]
    fn flat8_is_pixels_over_16() {
        let raw = embedded();
        let splits = load_digits(DigitsLayout::Flat8).unwrap();
        let test = splits.test.unwrap();
        assert_eq!(test.sample_shape().dims(), &[64]);
        let Features::F32(x) = test.features() else { panic!("Flat8 must be f32") };
        let (_, test_idx) = split_stratified(&raw.labels, 10, DIGITS_TEST_LEN, DIGITS_SPLIT_SEED);
        for (k, &i) in test_idx.iter().enumerate() {
            for j in 0..64 {
                assert_eq!(x[k * 64 + j], f32::from(raw.pixels[i * 64 + j]) / 16.0);
            }
            assert_eq!(test.labels()[k], raw.labels[i]);
        }
        assert!(x.iter().all(|&v| (0.0..=1.0).contains(&v)));
    }

    #[test]
    fn split_is_1437_360_stratified_disjoint_and_complete() {
        let raw = embedded();
        let (train, test) = split_stratified(&raw.labels, 10, DIGITS_TEST_LEN, DIGITS_SPLIT_SEED);
        assert_eq!((train.len(), test.len()), (1437, 360));
        let mut all: Vec<usize> = train.iter().chain(&test).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..DIGITS_LEN).collect::<Vec<_>>(), "every sample exactly once");
        // Test counts per class, by hand: quota_c = 360·n_c/1797. Floors (35, 36, 35, 36,
        // 36, 36, 36, 35, 34, 36) sum to 355; the 5 left go to the largest remainders
        // 360·n_c mod 1797: classes 7 and 8 (1548), 0 and 3 (1185), then 1 and 5 tie at
        // 828 and the lower class, 1, wins.
        let mut per_class = [0usize; 10];
        for &i in &test {
            per_class[raw.labels[i] as usize] += 1;
        }
        assert_eq!(per_class, [36, 37, 35, 37, 36, 36, 36, 36, 35, 36]);
    }

    #[test]
    fn split_is_deterministic_and_follows_the_seed() {
        let raw = embedded();
        let a = split_stratified(&raw.labels, 10, DIGITS_TEST_LEN, DIGITS_SPLIT_SEED);
        let b = split_stratified(&raw.labels, 10, DIGITS_TEST_LEN, DIGITS_SPLIT_SEED);
        let c = split_stratified(&raw.labels, 10, DIGITS_TEST_LEN, DIGITS_SPLIT_SEED + 1);
        assert_eq!(a, b);
        assert_ne!(a.1, c.1);
        let x = load_digits(DigitsLayout::Image28).unwrap();
        let y = load_digits(DigitsLayout::Image28).unwrap();
        assert_eq!(x.train, y.train);
        assert_eq!(x.test, y.test);
        assert_eq!(x.train.name(), "digits/train");
        assert_eq!(x.test.as_ref().map(|t| t.len()), Some(DIGITS_TEST_LEN));
        // The layouts share one split: same labels in the same order.
        let f = load_digits(DigitsLayout::Flat8).unwrap();
        assert_eq!(x.train.labels(), f.train.labels());
        assert!(x.train.labels().iter().all(|&l| l < 10));
    }
}
