//! The codec's wire format: 16-bit gradients on the wire (`--grad-compression bf16|fp16`),
//! what travels and how each value is encoded and decoded. GPUs run it as kernels
//! (kernels/codec.cu, launched from `cuda`) that mirror this file operation for
//! operation; the tests of `exchange::gpu::codec` hold them to it bit for bit, so
//! this file stays the one definition.
//!
//! Owns: [`Compression`] (what travels), [`Codec`] (how a run's slot is encoded) and
//! [`Wire`] (the encoded values of one run of a slot; [`Codec::encode_codes`] and
//! [`Codec::decode_codes`] do the same into and out of a transport's own buffers, which
//! the MPI exchange receives into), and the 16-bit conversions that weights files share.
//! A leaf: it imports nothing of the crate, so that `cuda` and `exchange` both build on
//! it without importing each other. The sum of wires ([`Codec::reduce`], in the
//! exchanges' canonical tree) is `exchange::codec`'s, which re-exports these names: the
//! codec's public path stays `lockstep::exchange::codec`. It knows nothing of members,
//! barriers or messages: an exchange encodes each logical replica's slot once, moves the
//! wires, decodes every contribution to f32, sums in ITS fixed order in f32, encodes the
//! sum, and every member decodes that same encoded sum. Encoding and decoding are pure
//! functions of the values, so every replica reads bitwise the same result.
//!
//! What is encoded: the gradient part of a slot, `0..encoded_len` (the flat parameters).
//! The BatchNorm buffers after it travel as f32: running statistics re-rounded to 8
//! significant bits every step would keep only 8 bits (PyTorch's hooks, likewise, only
//! ever see gradients).
//!
//! The formats, element by element, in blocks of [`BLOCK`] values at absolute offsets of
//! the slot (so any chunking into multiples of [`BLOCK`] sees the same blocks):
//! - **bf16**: the top 16 bits of the f32, rounded to nearest even (what
//!   `tensor.to(torch.bfloat16)` does; NaN becomes the quiet NaN 0x7FC0). bf16 has f32's
//!   exponent range: nothing overflows or flushes that f32 would not. No scale.
//! - **fp16**: IEEE half precision (10 mantissa bits, but a range of only 6e-8..65504),
//!   scaled per block by a power of two 2^e chosen from the block's largest magnitude M
//!   (M in [2^E, 2^(E+1)) ⇒ e = 14 − E, clamped to [−126, 126]): the scaled block's
//!   largest value lies in [2^14, 2^15), below fp16's maximum 65504, so nothing
//!   overflows; a value is lost to zero only if it is below 2^−25 of its block's largest
//!   (fp16's subnormal floor 2^−24 against 2^15), whatever the gradients' absolute size.
//!   The exponent travels with the block (one byte per 1,024 values); scaling by a power
//!   of two is exact. A block holding NaN or ±∞ is sent unscaled (they stay NaN, ±∞).
//!   Sums are decoded (h · 2^−e, exact) before they are added, in f32, so blocks of
//!   different scales add correctly.

use std::ops::Range;

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

/// Values per block: the unit of fp16's scale and of every chunking of an encoded slot.
pub const BLOCK: usize = 1024;

/// How a run's gradients travel between its logical replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Compression {
    /// f32, as computed.
    None,
    /// bfloat16, rounded to nearest even.
    Bf16,
    /// IEEE half precision, scaled by a power of two per block of `BLOCK` values.
    Fp16,
}

impl Compression {
    /// The name the command line uses: `none`, `bf16`, `fp16`.
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Bf16 => "bf16",
            Compression::Fp16 => "fp16",
        }
    }
}

/// The encoding of one run's slots: which format, and how many leading values (the
/// gradient) are encoded; the rest of a slot travels as f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Codec {
    /// Bf16 or Fp16 (a codec for `None` would encode nothing).
    pub(crate) format: Format,
    encoded_len: usize,
}

/// The two 16-bit formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    Bf16,
    Fp16,
}

/// The encoded values of `range` of a slot: 16-bit codes for the part below the codec's
/// `encoded_len`, one fp16 exponent per block of them, and f32 for the rest.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Wire {
    range: Range<usize>,
    pub(crate) half: Vec<u16>,
    /// fp16: the exponent e of each block (values were multiplied by 2^e); bf16: empty.
    exps: Vec<i8>,
    raw: Vec<f32>,
}

impl Codec {
    /// The codec of `compression` for slots whose first `encoded_len` values (the
    /// gradient) are encoded; `None` for [`Compression::None`].
    pub fn new(compression: Compression, encoded_len: usize) -> Option<Codec> {
        let format = match compression {
            Compression::None => return None,
            Compression::Bf16 => Format::Bf16,
            Compression::Fp16 => Format::Fp16,
        };
        Some(Codec { format, encoded_len })
    }

    /// The format.
    #[cfg(any(feature = "cuda", feature = "mpi"))]
    pub fn compression(&self) -> Compression {
        match self.format {
            Format::Bf16 => Compression::Bf16,
            Format::Fp16 => Compression::Fp16,
        }
    }

    /// Leading values of a slot that are encoded.
    pub fn encoded_len(&self) -> usize {
        self.encoded_len
    }

    /// An empty wire for `range` of a slot; `range.start` must be a multiple of
    /// [`BLOCK`] (or lie past the encoded part), so that its blocks are the slot's.
    pub fn wire(&self, range: Range<usize>) -> Wire {
        assert!(
            range.start.is_multiple_of(BLOCK) || range.start >= self.encoded_len,
            "a wire starts on a block: {range:?}"
        );
        let enc = self.encoded(&range);
        let blocks = if self.format == Format::Fp16 { enc.len().div_ceil(BLOCK) } else { 0 };
        Wire { half: vec![0; enc.len()], exps: vec![0; blocks], raw: vec![0.0; range.len() - enc.len()], range }
    }

    /// The encoded part of `range`.
    pub(crate) fn encoded(&self, range: &Range<usize>) -> Range<usize> {
        range.start.min(self.encoded_len)..range.end.min(self.encoded_len)
    }

    /// Encodes `src`, the values of `range` of a slot, into `wire` (whose range holds
    /// `range`; `range.start` on a block, or past the encoded part).
    pub fn encode(&self, src: &[f32], wire: &mut Wire, range: Range<usize>) {
        assert!(
            range.start >= wire.range.start && range.end <= wire.range.end && src.len() == range.len(),
            "encode {} values as {range:?} of a wire of {:?}",
            src.len(),
            wire.range
        );
        assert!(range.start.is_multiple_of(BLOCK) || range.start >= self.encoded_len, "encode from a block: {range:?}");
        let enc = self.encoded(&range);
        let (src_enc, src_raw) = src.split_at(enc.len());
        // Offsets within the wire's codes, which begin at its encoded part's start.
        let codes_start = self.encoded(&wire.range).start;
        let local = enc.start - codes_start..enc.end - codes_start;
        let first = (local.start / BLOCK).min(wire.exps.len());
        self.encode_codes(src_enc, &mut wire.half[local], &mut wire.exps[first..]);
        let raw_start = wire.range.start.max(self.encoded_len);
        let raw = range.start.max(self.encoded_len) - raw_start..range.end.max(self.encoded_len) - raw_start;
        wire.raw[raw].copy_from_slice(src_raw);
    }

    /// Decodes the values of `range` (inside the wire's range) into `out`.
    pub fn decode(&self, wire: &Wire, range: Range<usize>, out: &mut [f32]) {
        assert!(
            range.start >= wire.range.start && range.end <= wire.range.end && out.len() == range.len(),
            "decode {range:?} of a wire of {:?} into {} values",
            wire.range,
            out.len()
        );
        let local = range.start - wire.range.start..range.end - wire.range.start;
        let n = wire.half.len();
        let enc = local.start.min(n)..local.end.min(n);
        let (out_enc, out_raw) = out.split_at_mut(enc.len());
        let exps = &wire.exps[(enc.start / BLOCK).min(wire.exps.len())..];
        self.decode_codes(&wire.half[enc.clone()], exps, enc.start % BLOCK, out_enc);
        let raw = local.start.max(n) - n..local.end.max(n) - n;
        out_raw.copy_from_slice(&wire.raw[raw]);
    }

    /// The 16-bit codes of `src` into `half` (as long), and for fp16 the exponent of each
    /// block into `exps` (one per [`BLOCK`] values of `src`; bf16 leaves it alone): the
    /// encoding of [`Codec::encode`], for a transport that keeps codes in buffers of its
    /// own (the MPI exchange receives into them). `src` must begin on a block of the slot
    /// and lie inside the encoded part.
    pub fn encode_codes(&self, src: &[f32], half: &mut [u16], exps: &mut [i8]) {
        assert_eq!(src.len(), half.len(), "encode {} values into {} codes", src.len(), half.len());
        match self.format {
            Format::Bf16 => encode_bf16(src, half),
            Format::Fp16 => {
                assert!(exps.len() >= src.len().div_ceil(BLOCK), "{} exponents for {} values", exps.len(), src.len());
                let mut scaled = [0.0f32; BLOCK];
                for ((block, codes), e) in src.chunks(BLOCK).zip(half.chunks_mut(BLOCK)).zip(exps) {
                    *e = fp16_exponent(block);
                    encode_fp16_scaled(block, pow2(*e as i32), codes, &mut scaled[..block.len()]);
                }
            }
        }
    }

    /// The f32 values of the codes `half` into `out` (as long): `half[0]` lies `skip`
    /// values into the block whose fp16 exponent is `exps[0]`, and each later block has
    /// the next exponent (bf16 ignores `exps`). The inverse of [`Codec::encode_codes`]
    /// (with `skip` 0), exact.
    pub fn decode_codes(&self, half: &[u16], exps: &[i8], skip: usize, out: &mut [f32]) {
        assert_eq!(half.len(), out.len(), "decode {} codes into {} values", half.len(), out.len());
        match self.format {
            Format::Bf16 => decode_bf16(half, out),
            Format::Fp16 => {
                assert!(skip < BLOCK, "{skip} values into a block of {BLOCK}");
                let mut at = 0;
                let mut block = 0;
                while at < half.len() {
                    let end = (at + BLOCK - if block == 0 { skip } else { 0 }).min(half.len());
                    decode_fp16_scaled(&half[at..end], pow2(-(exps[block] as i32)), &mut out[at..end]);
                    block += 1;
                    at = end;
                }
            }
        }
    }

    /// The f32 values of `range` of a wire as stored, when that range is past the encoded
    /// part (they are read in place, not decoded).
    pub fn raw<'w>(&self, wire: &'w Wire, range: Range<usize>) -> Option<&'w [f32]> {
        let start = wire.range.start.max(self.encoded_len);
        (range.start >= start && range.end <= wire.range.end).then(|| &wire.raw[range.start - start..range.end - start])
    }
}

impl Wire {
    /// The slot values this wire holds.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Bytes the wire carries: 2 per encoded value, 1 per fp16 block, 4 per raw value.
    #[cfg(any(test, feature = "cli"))]
    pub fn bytes(&self) -> usize {
        2 * self.half.len() + self.exps.len() + 4 * self.raw.len()
    }

    /// What a transport moves: the 16-bit codes, the fp16 block exponents (empty for
    /// bf16) and the f32 tail, as they lie.
    #[cfg(test)]
    pub fn parts(&self) -> (&[u16], &[i8], &[f32]) {
        (&self.half, &self.exps, &self.raw)
    }

    /// The three buffers of [`Wire::parts`], to receive a peer's wire of the same range
    /// into (made by [`Codec::wire`] for that range, so the lengths agree).
    #[cfg(test)]
    pub fn parts_mut(&mut self) -> (&mut [u16], &mut [i8], &mut [f32]) {
        (&mut self.half, &mut self.exps, &mut self.raw)
    }
}

/// bf16 codes of `src`, rounded to nearest even; NaN becomes 0x7FC0 (as PyTorch's
/// `c10::BFloat16`). Branch-free, so the loop vectorises (AVX2 where the processor has it).
pub fn encode_bf16(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor supports AVX2 (checked just above), the only requirement
        // of a `target_feature(enable = "avx2")` function.
        unsafe { encode_bf16_avx2(src, dst) };
        return;
    }
    encode_bf16_any(src, dst);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn encode_bf16_avx2(src: &[f32], dst: &mut [u16]) {
    encode_bf16_any(src, dst)
}

#[inline(always)]
fn encode_bf16_any(src: &[f32], dst: &mut [u16]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = bf16_bits(x);
    }
}

/// f32 values of bf16 codes (exact: a shift), vectorised as [`encode_bf16`].
fn decode_bf16(src: &[u16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: as in `encode_bf16`.
        unsafe { decode_bf16_avx2(src, dst) };
        return;
    }
    decode_bf16_any(src, dst);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn decode_bf16_avx2(src: &[u16], dst: &mut [f32]) {
    decode_bf16_any(src, dst)
}

#[inline(always)]
fn decode_bf16_any(src: &[u16], dst: &mut [f32]) {
    for (o, &h) in dst.iter_mut().zip(src) {
        *o = f32::from_bits((h as u32) << 16);
    }
}

/// The bf16 code of `x`, rounded to nearest even (NaN: 0x7FC0).
#[inline]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    if (b & 0x7FFF_FFFF) > 0x7F80_0000 {
        0x7FC0
    } else {
        rounded
    }
}

/// fp16 codes of `src`·`scale` (a power of two: exact), rounded to nearest even, through
/// `scratch` (as long as `src`). With F16C (x86-64 processors since 2012) 8 at a time by
/// `vcvtps2ph`, an IEEE round-to-nearest-even conversion giving the bits of the software
/// one (`half`), which runs elsewhere.
fn encode_fp16_scaled(src: &[f32], scale: f32, dst: &mut [u16], scratch: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the processor supports F16C and AVX (checked just above), what the
        // function's `target_feature` asks.
        unsafe { encode_fp16_scaled_f16c(src, scale, dst) };
        return;
    }
    for (d, &x) in scratch.iter_mut().zip(src) {
        *d = x * scale;
    }
    dst.reinterpret_cast_mut::<f16>().convert_from_f32_slice(scratch);
}

/// f32 values `scale`·(fp16 codes `src`): exact (a power of two), F16C where present.
fn decode_fp16_scaled(src: &[u16], scale: f32, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: as in `encode_fp16_scaled`.
        unsafe { decode_fp16_scaled_f16c(src, scale, dst) };
        return;
    }
    src.reinterpret_cast::<f16>().convert_to_f32_slice(dst);
    for v in dst.iter_mut() {
        *v *= scale;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn encode_fp16_scaled_f16c(src: &[f32], scale: f32, dst: &mut [u16]) {
    use std::arch::x86_64::{__m128i, _MM_FROUND_TO_NEAREST_INT};
    use std::arch::x86_64::{_mm256_cvtps_ph, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps, _mm_storeu_si128};
    let n = src.len().min(dst.len());
    let s = _mm256_set1_ps(scale);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 ≤ n ≤ both lengths: 8 f32 are read from src[i..], 8 u16 written
        // to dst[i..]; both intrinsics take unaligned pointers.
        unsafe {
            let x = _mm256_mul_ps(_mm256_loadu_ps(src.as_ptr().add(i)), s);
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
        }
        i += 8;
    }
    for j in i..n {
        dst[j] = fp16_bits(src[j] * scale);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn decode_fp16_scaled_f16c(src: &[u16], scale: f32, dst: &mut [f32]) {
    use std::arch::x86_64::{
        __m128i, _mm256_cvtph_ps, _mm256_mul_ps, _mm256_set1_ps, _mm256_storeu_ps, _mm_loadu_si128,
    };
    let n = src.len().min(dst.len());
    let s = _mm256_set1_ps(scale);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 ≤ n ≤ both lengths: 8 u16 are read from src[i..], 8 f32 written
        // to dst[i..]; both intrinsics take unaligned pointers.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_mul_ps(_mm256_cvtph_ps(h), s));
        }
        i += 8;
    }
    for j in i..n {
        dst[j] = fp16_value(src[j]) * scale;
    }
}

/// The fp16 code of `x`, rounded to nearest even (IEEE; as `tensor.to(torch.float16)`).
pub fn fp16_bits(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

/// f32 of a bf16 code (exact).
pub fn bf16_value(h: u16) -> f32 {
    bf16::from_bits(h).to_f32()
}

/// f32 of an fp16 code (exact).
pub fn fp16_value(h: u16) -> f32 {
    f16::from_bits(h).to_f32()
}

/// The exponent e of fp16's scale 2^e for a block: its largest magnitude M in
/// [2^E, 2^(E+1)) gives e = 14 − E (M·2^e in [2^14, 2^15)), clamped to [−126, 126] so
/// that 2^e and 2^−e are normal f32; 0 for a block of zeros or with a NaN or ±∞.
pub fn fp16_exponent(block: &[f32]) -> i8 {
    // The largest bit pattern of |x| is the largest magnitude (NaN's patterns are above ∞'s).
    let top = largest_magnitude_bits(block);
    if top == 0 || top >= 0x7F80_0000 {
        return 0;
    }
    // An f32 subnormal has biased exponent 0: E < −126 and the clamp applies.
    let e = 14 - ((top >> 23) as i32 - 127);
    e.clamp(-126, 126) as i8
}

/// The largest `bits & 0x7FFF_FFFF` of `block` (an unsigned maximum: AVX2 has it as one
/// instruction, SSE2 does not).
fn largest_magnitude_bits(block: &[f32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor supports AVX2 (checked just above), the only requirement
        // of a `target_feature(enable = "avx2")` function.
        return unsafe { largest_magnitude_bits_avx2(block) };
    }
    largest_magnitude_bits_any(block)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn largest_magnitude_bits_avx2(block: &[f32]) -> u32 {
    largest_magnitude_bits_any(block)
}

#[inline(always)]
fn largest_magnitude_bits_any(block: &[f32]) -> u32 {
    block.iter().fold(0u32, |m, x| m.max(x.to_bits() & 0x7FFF_FFFF))
}

/// 2^e as f32, for e in [−126, 127].
fn pow2(e: i32) -> f32 {
    f32::from_bits(((127 + e) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 lies exactly between bf16's 1 (0x3F80) and 1 + 2^-7 (0x3F81): ties go
        // to the even code, 0x3F80; 1 + 3·2^-8 between 0x3F81 and 0x3F82 goes to 0x3F82.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3F80);
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3F82);
        // Past the tie, up: 1 + 2^-8 + 2^-20 → 0x3F81.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0 + 1.0 / 1048576.0), 0x3F81);
        assert_eq!(bf16_bits(-2.0), 0xC000);
        assert_eq!(bf16_bits(f32::INFINITY), 0x7F80);
        assert_eq!(bf16_bits(f32::NAN), 0x7FC0);
        // f32::MAX rounds past bf16's largest finite value: ∞, as in PyTorch.
        assert_eq!(bf16_bits(f32::MAX), 0x7F80);
        // half's conversion agrees on ordinary values.
        for x in [0.1f32, -3.3e-5, 7.0e20, 1.0e-40] {
            assert_eq!(bf16_bits(x), bf16::from_f32(x).to_bits(), "{x}");
        }
    }

    #[test]
    fn fp16_scales_keep_small_and_large_blocks() {
        // Block maxima of 3e-9 (far below fp16's subnormal floor 6e-8) and 3e6 (far above
        // its maximum 65504): both come back within fp16's relative precision 2^-11.
        let codec = Codec::new(Compression::Fp16, 2 * BLOCK).unwrap();
        let mut src: Vec<f32> = (0..BLOCK).map(|i| 3e-9 * (1.0 + i as f32 / BLOCK as f32)).collect();
        src.extend((0..BLOCK).map(|i| -3e6 * (1.0 + i as f32 / BLOCK as f32)));
        let mut wire = codec.wire(0..2 * BLOCK);
        codec.encode(&src, &mut wire, 0..2 * BLOCK);
        let mut back = vec![0.0; 2 * BLOCK];
        codec.decode(&wire, 0..2 * BLOCK, &mut back);
        for (x, y) in src.iter().zip(&back) {
            assert!(((x - y) / x).abs() <= 1.0 / 2048.0, "{x} came back as {y}");
        }
        // The first block's largest, 3e-9·(1 + 1023/1024) ≈ 6.0e-9, lies in [2^-28, 2^-27):
        // E = -28, e = 14 + 28 = 42; the second's, 6.0e6, in [2^22, 2^23): e = 14 - 22 = -8.
        assert_eq!(wire.exps, vec![42, -8]);
        // A block of zeros, and one holding ∞, are sent unscaled.
        assert_eq!(fp16_exponent(&[0.0; 4]), 0);
        assert_eq!(fp16_exponent(&[1.0, f32::INFINITY]), 0);
        assert_eq!(fp16_exponent(&[1.0, f32::NAN]), 0);
        assert_eq!(fp16_exponent(&[1.0e-45]), 126);
    }

    #[test]
    fn the_fast_fp16_conversions_give_the_software_ones_bits() {
        // Ties, subnormals, the edge of the range, ∞ and NaN, scaled by 2^3 and by 1: the
        // conversions F16C does (where present) and half's, bit for bit.
        let mut src = vec![1.0 + 1.0 / 2048.0, 1.0 + 3.0 / 2048.0, 6.0e-8, 2.9e-8, 65519.0, 65520.0, -0.0, 1e-3];
        src.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 3.3e-5, -7.7, 0.1, 12.5, -1e-7]);
        src.extend((0..37).map(|i| (i as f32 - 18.0) * 0.013));
        for scale in [1.0f32, 8.0] {
            let (mut fast, mut scratch) = (vec![0u16; src.len()], vec![0.0f32; src.len()]);
            encode_fp16_scaled(&src, scale, &mut fast, &mut scratch);
            let slow: Vec<u16> = src.iter().map(|&x| fp16_bits(x * scale)).collect();
            assert_eq!(fast, slow, "encode at scale {scale}");
            let mut back = vec![0.0f32; src.len()];
            decode_fp16_scaled(&fast, 1.0 / scale, &mut back);
            let want: Vec<u32> = slow.iter().map(|&h| (fp16_value(h) * (1.0 / scale)).to_bits()).collect();
            assert_eq!(back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "decode at scale {scale}");
        }
    }

    #[test]
    fn the_tail_past_the_gradient_travels_as_f32() {
        // Slot of 2,500 values, the first 2,100 encoded: a wire over 1024..2500 holds 1,076
        // codes (one partial block) then 400 raw values.
        let codec = Codec::new(Compression::Bf16, 2100).unwrap();
        let src: Vec<f32> = (0..1476).map(|i| 1.0 + i as f32 * 1e-4).collect();
        let mut wire = codec.wire(1024..2500);
        codec.encode(&src, &mut wire, 1024..2500);
        assert_eq!(wire.bytes(), 2 * 1076 + 4 * 400);
        let mut out = vec![0.0; 20];
        codec.decode(&wire, 2090..2110, &mut out);
        // 2090..2100 rounded to bf16, 2100..2110 exactly the f32 values.
        for (k, &v) in out.iter().enumerate() {
            let x = src[2090 - 1024 + k];
            let want = if k < 10 { bf16_value(bf16_bits(x)) } else { x };
            assert_eq!(v, want, "value {}", 2090 + k);
        }
        assert_eq!(codec.raw(&wire, 2200..2210).unwrap(), &src[2200 - 1024..2210 - 1024]);
        assert!(codec.raw(&wire, 2000..2210).is_none());
        // A wire wholly past the encoded part (a chunk of buffers) holds f32 only.
        let mut tail = codec.wire(2200..2500);
        codec.encode(&src[2200 - 1024..], &mut tail, 2200..2500);
        assert_eq!(tail.bytes(), 4 * 300);
        assert_eq!(codec.raw(&tail, 2200..2500).unwrap(), &src[2200 - 1024..]);
        // A wire moved buffer by buffer (as a transport sends it) decodes alike.
        let mut received = codec.wire(1024..2500);
        let (h, e, r) = wire.parts();
        let (hm, em, rm) = received.parts_mut();
        hm.copy_from_slice(h);
        em.copy_from_slice(e);
        rm.copy_from_slice(r);
        assert_eq!(received, wire);
    }

    #[test]
    fn codes_in_a_transports_own_buffers_are_the_wires() {
        // 3,000 values, 2,600 encoded, of block maxima far apart (fp16 scales 2^40, 2^-4,
        // 2^14): the codes and exponents that `encode_codes` writes for the encoded part
        // are the wire's, and `decode_codes` gives `decode`'s values, from a block's start
        // and from 100 values into one.
        let src: Vec<f32> =
            (0..3000).map(|i| [1e-8f32, 3e5, 1.5][(i / BLOCK) % 3] * (1.0 + (i % 97) as f32 * 0.013)).collect();
        for compression in [Compression::Bf16, Compression::Fp16] {
            let codec = Codec::new(compression, 2600).unwrap();
            let mut wire = codec.wire(0..3000);
            codec.encode(&src, &mut wire, 0..3000);
            let (mut half, mut exps) = (vec![0u16; 2600], vec![0i8; 3]);
            codec.encode_codes(&src[..2600], &mut half, &mut exps);
            let (h, e, _) = wire.parts();
            assert_eq!((&half[..], &exps[..]), (h, if e.is_empty() { &[0i8; 3][..] } else { e }), "{compression:?}");
            let mut want = vec![0.0; 2600];
            codec.decode(&wire, 0..2600, &mut want);
            let mut got = vec![f32::NAN; 2600];
            codec.decode_codes(&half, &exps, 0, &mut got);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
            let mut part = vec![f32::NAN; 2000];
            codec.decode_codes(&half[100..2100], &exps, 100, &mut part);
            assert!(part.iter().zip(&want[100..2100]).all(|(a, b)| a.to_bits() == b.to_bits()), "{compression:?}");
        }
    }
}
