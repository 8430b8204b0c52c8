//! Data augmentation of training images: torchvision's `RandomCrop(size, padding=P)` and
//! `RandomHorizontalFlip()`, drawn from (seed, epoch, sample index).
//!
//! Owns: what an augmentation is ([`Augment`], parsed from and written as `crop=4,flip`,
//! in a serialized `TrainConfig` too),
//! the draw of one sample's crop offsets and flip ([`Augment::draw`]), and the pixels that
//! draw makes of an image ([`augment_image`]). Where it runs is the loader's: the fit loop
//! gathers each global batch with `train::Batch::gather_augmented`, on the host, once per
//! sample whatever the devices, so no GPU kernel is involved. Evaluation never augments.
//!
//! Randomness: a sample's draw is a function of (seed, epoch, the sample's index in the
//! training set) alone — `derive_key(seed, [purpose::AUGMENT, epoch, index])` — never of
//! the device, the process, the logical replica or the row of the batch it lands in. So a
//! run augments bitwise alike on any number of devices or processes, and a resumed run
//! draws what the uninterrupted one drew (the position gives the epoch; the order gives
//! the indices).
//!
//! Padding: the image is padded with 0 in the units it is stored in, before the model
//! sees it. For u8 images (MNIST, Fashion-MNIST, the digits) that is a raw black pixel of
//! 0 before the model's `rescaling` layer (÷255, or (x/255 − mean)/std), as torchvision
//! pads the uint8 image (or the `ToTensor` image, before `Normalize`) with 0; for f32
//! features it is 0.0 in the file's units.

use crate::error::{Error, Result};
use crate::rng::{derive_key, purpose, SplitMix64};
use crate::tensor::Shape;

/// The largest crop padding accepted: far past any image lockstep trains on, and small
/// enough that `2P + 1` window offsets are drawn without bias worth the name.
pub const MAX_CROP_PADDING: usize = 1 << 16;

/// Whether a training image is mirrored left to right with probability 1/2.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Flip {
    None,
    Horizontal,
}

/// The augmentation of the training images: a random crop after zero padding, a random
/// horizontal flip, both or neither ([`Augment::NONE`]). Serialized as its canonical text
/// and read back through [`Augment::parse`], whose checks a stored one passes too.
#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct Augment {
    /// The zero padding P on each side before a random H×W window is taken (offsets
    /// uniform in 0..=2P in each direction); None: no crop.
    pub crop: Option<usize>,
    pub flip: Flip,
}

impl Default for Augment {
    fn default() -> Self {
        Augment::NONE
    }
}

impl From<Augment> for String {
    fn from(a: Augment) -> String {
        a.name()
    }
}

impl TryFrom<String> for Augment {
    type Error = Error;

    fn try_from(text: String) -> Result<Augment> {
        Augment::parse(&text)
    }
}

/// One sample's draw: where its window starts in the padded image, and whether it is
/// mirrored. (dy, dx) = (P, P) with no flip leaves the image as it is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Draw {
    /// The window's top row and left column in the padded image, in 0..=2P.
    pub dy: usize,
    pub dx: usize,
    pub flip: Flip,
}

impl Augment {
    /// No augmentation.
    pub const NONE: Augment = Augment { crop: None, flip: Flip::None };

    /// Whether this augments nothing.
    pub fn is_none(&self) -> bool {
        *self == Augment::NONE
    }

    /// Parses `crop=P`, `flip`, both comma-separated (`crop=4,flip`), or `none`.
    pub fn parse(text: &str) -> Result<Augment> {
        let err = |detail: String| Error::config("augment", detail);
        const EXPECTED: &str = "expected crop=P and/or flip, e.g. crop=4,flip";
        if text.trim() == "none" {
            return Ok(Augment::NONE);
        }
        let mut out = Augment::NONE;
        for word in text.split(',').map(str::trim) {
            match word.split_once('=') {
                Some(("crop", p)) => {
                    if out.crop.is_some() {
                        return Err(err("crop is given twice".into()));
                    }
                    let padding = p.parse::<usize>().ok().filter(|&p| (1..=MAX_CROP_PADDING).contains(&p));
                    let Some(padding) = padding else {
                        return Err(err(format!(
                            "crop={p}: the padding P must be a whole number of pixels from 1 to {MAX_CROP_PADDING}"
                        )));
                    };
                    out.crop = Some(padding);
                }
                None if word == "crop" => {
                    return Err(err(format!("crop needs its padding in pixels: crop=P ({EXPECTED})")))
                }
                None if word == "flip" => {
                    if out.flip == Flip::Horizontal {
                        return Err(err("flip is given twice".into()));
                    }
                    out.flip = Flip::Horizontal;
                }
                None if word.is_empty() => return Err(err(format!("an empty item in '{text}' ({EXPECTED})"))),
                _ => return Err(err(format!("unknown augmentation '{word}' ({EXPECTED})"))),
            }
        }
        Ok(out)
    }

    /// The canonical text, which [`Augment::parse`] reads back: `crop=4,flip`, `flip`,
    /// `none`.
    pub fn name(&self) -> String {
        let mut parts = Vec::new();
        if let Some(p) = self.crop {
            parts.push(format!("crop={p}"));
        }
        if self.flip == Flip::Horizontal {
            parts.push("flip".to_string());
        }
        match parts.is_empty() {
            true => "none".to_string(),
            false => parts.join(","),
        }
    }

    /// Samples of `shape` can be augmented: images (C, H, W). Nothing to check for
    /// [`Augment::NONE`].
    pub fn check(&self, shape: &Shape) -> Result<()> {
        match (self.is_none(), shape.dims()) {
            (true, _) | (false, [_, _, _]) => Ok(()),
            _ => Err(Error::config(
                "augment",
                format!("{} needs image samples (C, H, W); these samples are {shape}", self.name()),
            )),
        }
    }

    /// The draw of the sample `index` of the training set in `epoch` of a run seeded by
    /// `seed`: the crop's row offset, then its column offset (each uniform in 0..=2P, as
    /// torchvision's `RandomCrop.get_params` draws the top then the left), then the flip
    /// (probability 1/2), from one SplitMix64 stream.
    pub fn draw(&self, seed: u64, epoch: usize, index: usize) -> Draw {
        let mut g = SplitMix64::new(derive_key(seed, &[purpose::AUGMENT, epoch as u64, index as u64]));
        let (dy, dx) = match self.crop {
            Some(p) => (g.below(2 * p + 1), g.below(2 * p + 1)),
            None => (0, 0),
        };
        let flip = match self.flip {
            Flip::Horizontal if g.next_f32() < 0.5 => Flip::Horizontal,
            _ => Flip::None,
        };
        Draw { dy, dx, flip }
    }

    /// The padding P of the crop (0 without one): `draw`'s offsets are in 0..=2P.
    pub fn padding(&self) -> usize {
        self.crop.unwrap_or(0)
    }
}

/// `out` = the image `x` augmented as `draw` says, with padding `padding` (0: no crop):
/// `out[c][i][j] = x[c][i + dy − P][j' + dx − P]`, 0 outside the image, where j' = W − 1 − j
/// when mirrored and j otherwise (the crop first, then the flip, as torchvision's
/// `Compose([RandomCrop, RandomHorizontalFlip])`).
/// x: (C, H, W), out: (C, H, W)
pub fn augment_image(x: &[f32], out: &mut [f32], (c, h, w): (usize, usize, usize), padding: usize, draw: Draw) {
    debug_assert_eq!((x.len(), out.len()), (c * h * w, c * h * w));
    for (xp, op) in x.chunks_exact(h * w).zip(out.chunks_exact_mut(h * w)) {
        for (i, orow) in op.chunks_exact_mut(w).enumerate() {
            // The source row, or none in the padding.
            let row = (i + draw.dy).checked_sub(padding).filter(|&r| r < h);
            for (j, o) in orow.iter_mut().enumerate() {
                let jj = match draw.flip {
                    Flip::Horizontal => w - 1 - j,
                    Flip::None => j,
                };
                let col = (jj + draw.dx).checked_sub(padding).filter(|&s| s < w);
                *o = match (row, col) {
                    (Some(r), Some(s)) => xp[r * w + s],
                    _ => 0.0,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_canonical_text_parses_back() {
        for text in ["crop=4,flip", "flip", "crop=1", "none", "flip,crop=2"] {
            let a = Augment::parse(text).unwrap();
            assert_eq!(Augment::parse(&a.name()).unwrap(), a, "{text}");
        }
        assert_eq!(Augment::parse("flip,crop=2").unwrap().name(), "crop=2,flip");
        assert_eq!(Augment::parse("none").unwrap(), Augment::NONE);
    }

    #[test]
    fn bad_text_is_refused_naming_the_item() {
        let e = |t: &str| Augment::parse(t).unwrap_err().to_string();
        assert_eq!(
            e("crop=0"),
            "invalid augment: crop=0: the padding P must be a whole number of pixels from 1 to 65536"
        );
        assert!(e("crop=-1").contains("crop=-1: the padding P"), "{}", e("crop=-1"));
        assert!(e("crop=x").contains("crop=x: the padding P"), "{}", e("crop=x"));
        assert!(e("crop=").contains("crop=: the padding P"), "{}", e("crop="));
        assert!(e("crop").contains("crop needs its padding"), "{}", e("crop"));
        assert!(e("rotate").contains("unknown augmentation 'rotate'"), "{}", e("rotate"));
        assert!(e("flip,flip").contains("flip is given twice"), "{}", e("flip,flip"));
        assert!(e("crop=1,crop=2").contains("crop is given twice"));
        assert!(e("").contains("an empty item"), "{}", e(""));
        assert!(e("flip,").contains("an empty item"), "{}", e("flip,"));
    }

    #[test]
    fn only_images_are_augmented() {
        let a = Augment::parse("crop=4,flip").unwrap();
        assert!(a.check(&Shape::new([1, 28, 28])).is_ok());
        assert_eq!(
            a.check(&Shape::new([2])).unwrap_err().to_string(),
            "invalid augment: crop=4,flip needs image samples (C, H, W); these samples are (2)"
        );
        assert!(Augment::NONE.check(&Shape::new([2])).is_ok());
    }

    #[test]
    fn draws_cover_every_offset_and_flip_about_half_the_time() {
        let a = Augment::parse("crop=2,flip").unwrap();
        let draws: Vec<Draw> = (0..4000).map(|i| a.draw(3, 1, i)).collect();
        for d in 0..=4 {
            // 4000 / 5 = 800 expected per offset; 5 standard deviations is about 130.
            let n = draws.iter().filter(|x| x.dy == d).count();
            assert!((670..=930).contains(&n), "dy = {d}: {n} of 4000");
            let n = draws.iter().filter(|x| x.dx == d).count();
            assert!((670..=930).contains(&n), "dx = {d}: {n} of 4000");
        }
        let flips = draws.iter().filter(|x| x.flip == Flip::Horizontal).count();
        assert!((1840..=2160).contains(&flips), "{flips} flips of 4000");
        // Flip alone never crops.
        let f = Augment { crop: None, flip: Flip::Horizontal };
        assert!((0..100).all(|i| {
            let d = f.draw(3, 1, i);
            (d.dy, d.dx) == (0, 0)
        }));
    }
}
