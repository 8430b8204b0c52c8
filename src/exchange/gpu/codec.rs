//! The 16-bit gradient codec on a GPU: the declaration of kernels/codec.cu (encode, the sum
//! of wires, decode), [`WireGeom`] (where a wire's parts lie) and the checked launches. The
//! codec's arithmetic is `exchange::codec`'s, mirrored bit for bit.

use crate::cuda::launch::{check_len, dim, elem_cfg, DevIn, DevOut, Gpu};
use crate::wire::{Codec, Compression, BLOCK};
use crate::{Error, Result};
use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

crate::cuda::declare::kernels! {
    "codec.cu" {
        wire_encode {
            plain(
                src: In, wires: OutU8, format: I32, encoded: Size, raw: Size, src_stride: Size, wire_bytes: Size,
                exps_at: Size, raw_at: Size,
            );
        }
        wire_reduce {
            plain(
                wires: InU8, out: OutU8, r: I32, format: I32, encoded: Size, raw: Size, wire_bytes: Size,
                exps_at: Size, raw_at: Size,
            );
        }
        wire_decode {
            plain(wire: InU8, dst: Out, format: I32, encoded: Size, raw: Size, exps_at: Size, raw_at: Size);
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

/// Threads per block of kernels/codec.cu (`CODEC_THREADS`), one block per codec block of
/// 1,024 values.
pub const CODEC_THREADS: u32 = 256;

/// Where the parts of one slot's 16-bit wire lie in device memory, in bytes from the
/// wire's start (kernels/codec.cu): the 16-bit codes of the first `encoded` values at 0,
/// fp16's block exponents (one signed byte per 1,024 values) right after them, then, on a
/// 256-byte boundary, the `raw` f32 values past the encoded part. Wires of one buffer lie
/// [`WireGeom::bytes`] apart, a multiple of 256, so that every wire, code and float starts
/// aligned. What is encoded, and how, is the codec's (`wire`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireGeom {
    /// Bf16 or Fp16 (a codec exists for those alone).
    pub compression: Compression,
    /// Leading values of a slot that are encoded (the gradient).
    pub encoded: usize,
    /// Values after them that travel as f32 (the BatchNorm buffers).
    pub raw: usize,
}

impl WireGeom {
    /// The wire of a slot of `width` values under `codec`.
    pub fn new(codec: &Codec, width: usize) -> WireGeom {
        let encoded = codec.encoded_len().min(width);
        WireGeom { compression: codec.compression(), encoded, raw: width - encoded }
    }

    /// Values of a slot: `encoded + raw`.
    pub fn width(&self) -> usize {
        self.encoded + self.raw
    }

    /// fp16's block exponents (none for bf16).
    pub fn exponents(&self) -> usize {
        match self.compression {
            Compression::Fp16 => self.encoded.div_ceil(BLOCK),
            _ => 0,
        }
    }

    /// Byte offset of the block exponents.
    pub fn exps_at(&self) -> usize {
        2 * self.encoded
    }

    /// Byte offset of the raw f32 part.
    pub fn raw_at(&self) -> usize {
        (self.exps_at() + self.exponents()).div_ceil(256) * 256
    }

    /// Bytes from one wire's start to the next's (at least 256).
    pub fn bytes(&self) -> usize {
        (self.raw_at() + 4 * self.raw).div_ceil(256).max(1) * 256
    }

    /// Bytes a wire carries (codes, exponents, raw values; no padding): what crosses
    /// between members for one slot, as the codec's `Wire::bytes` counts it.
    pub fn payload(&self) -> usize {
        2 * self.encoded + self.exponents() + 4 * self.raw
    }

    /// The kernels' `format`: FORMAT_BF16 (1) or FORMAT_FP16 (2).
    pub fn format(&self) -> i32 {
        match self.compression {
            Compression::Fp16 => 2,
            _ => 1,
        }
    }

    /// CUDA blocks per wire: one per 1,024 values, the encoded part's then the raw part's.
    pub fn blocks(&self) -> usize {
        self.encoded.div_ceil(BLOCK) + self.raw.div_ceil(BLOCK)
    }
}

impl Gpu {
    /// Encodes slots `0..k` of `src` (slot j at `j·stride`, `g.width()` values each) into
    /// wires `0..k` of `wires` (wire j at `j·g.bytes()`), as `wire` encodes.
    /// src: (k, stride) f32 (the last slot may end at its width) -> wires: (k, bytes)
    pub fn wire_encode(
        &self,
        src: &impl DevIn,
        stride: usize,
        k: usize,
        wires: &mut CudaViewMut<'_, u8>,
        g: &WireGeom,
    ) -> Result<()> {
        let src = &src.view();
        let op = "wire_encode";
        if k == 0 || g.width() == 0 {
            return Ok(());
        }
        if stride < g.width() || src.len() < (k - 1) * stride + g.width() {
            return Err(Error::shape(
                op,
                format!("src has {} values for {k} slots of {} every {stride}", src.len(), g.width()),
            ));
        }
        check_len(op, "wires", wires, k * g.bytes())?;
        let grid_y = u32::try_from(k)
            .ok()
            .filter(|&y| y <= 65_535)
            .ok_or_else(|| Error::shape(op, format!("{k} slots: a launch's grid holds at most 65535 in y")))?;
        let blocks = u32::try_from(g.blocks()).map_err(|_| Error::shape(op, "too many blocks of 1024 values"))?;
        let (format, bytes, exps_at, raw_at) = (g.format(), g.bytes(), g.exps_at(), g.raw_at());
        let cfg = LaunchConfig { grid_dim: (blocks, grid_y, 1), block_dim: (CODEC_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: wire_encode_f32(const float* src, unsigned char* wires, int format,
        // size_t encoded, size_t raw, size_t src_stride, size_t wire_bytes, size_t exps_at,
        // size_t raw_at); slot j (j < k = grid.y) reads src[j·stride .. j·stride + encoded
        // + raw], inside src (checked), and writes wire j's codes, exponents and raw
        // values, all below (j + 1)·bytes (WireGeom's layout); CODEC_THREADS threads a
        // block as the kernel's shared array needs.
        unsafe { wire_encode::plain(self, cfg, src, wires, format, g.encoded, g.raw, stride, bytes, exps_at, raw_at) }
    }

    /// The codec's sum of wires `0..r` of `wires` (in logical-replica order) into `out`:
    /// each decoded, added in the canonical tree in f32, encoded (`Codec::reduce`).
    /// wires: (r, bytes) -> out: (bytes)
    pub fn wire_reduce(
        &self,
        wires: &CudaView<'_, u8>,
        r: usize,
        out: &mut CudaViewMut<'_, u8>,
        g: &WireGeom,
    ) -> Result<()> {
        let op = "wire_reduce";
        check_len(op, "wires", wires, r * g.bytes())?;
        check_len(op, "out", out, g.bytes())?;
        if g.width() == 0 {
            return Ok(());
        }
        if r == 0 {
            return Err(Error::shape(op, "a sum of no wire"));
        }
        let ri = dim(op, "R", r)?;
        let blocks = u32::try_from(g.blocks()).map_err(|_| Error::shape(op, "too many blocks of 1024 values"))?;
        let (format, bytes, exps_at, raw_at) = (g.format(), g.bytes(), g.exps_at(), g.raw_at());
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (CODEC_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: wire_reduce_f32(const unsigned char* wires, unsigned char* out, int r, int
        // format, size_t encoded, size_t raw, size_t wire_bytes, size_t exps_at, size_t
        // raw_at); wires holds r wires and out one (checked), and the kernel touches each
        // only inside WireGeom's layout.
        unsafe { wire_reduce::plain(self, cfg, wires, out, ri, format, g.encoded, g.raw, bytes, exps_at, raw_at) }
    }

    /// A wire decoded to f32 (`Codec::decode`). wire: (bytes) -> dst: (encoded + raw)
    pub fn wire_decode(&self, wire: &CudaView<'_, u8>, dst: &mut impl DevOut, g: &WireGeom) -> Result<()> {
        let dst = &mut dst.view_mut();
        let op = "wire_decode";
        check_len(op, "wire", wire, g.bytes())?;
        check_len(op, "dst", dst, g.width())?;
        if g.width() == 0 {
            return Ok(());
        }
        let (format, exps_at, raw_at) = (g.format(), g.exps_at(), g.raw_at());
        // SAFETY: wire_decode_f32(const unsigned char* wire, float* dst, int format, size_t
        // encoded, size_t raw, size_t exps_at, size_t raw_at); dst holds encoded + raw
        // floats and wire one wire (checked).
        unsafe { wire_decode::plain(self, elem_cfg(g.width()), wire, dst, format, g.encoded, g.raw, exps_at, raw_at) }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    #[test]
    fn a_wire_lays_out_codes_exponents_and_floats_on_aligned_starts() {
        // The convnet's slot: its gradient encoded, its BatchNorm buffers raw.
        let model = crate::models::convnet(crate::models::ConvnetOptions::default()).unwrap();
        let (p, b) = (model.params_len(), model.buffers_len());
        for compression in [Compression::Bf16, Compression::Fp16] {
            let codec = Codec::new(compression, p).unwrap();
            let g = WireGeom::new(&codec, p + b);
            assert_eq!((g.encoded, g.raw, g.width()), (p, b, p + b));
            // What crosses is the codec's count, padding aside.
            assert_eq!(g.payload(), codec.wire(0..p + b).bytes(), "{compression:?}");
            let exps = if compression == Compression::Fp16 { p.div_ceil(BLOCK) } else { 0 };
            assert_eq!((g.exps_at(), g.exponents()), (2 * p, exps));
            assert!(
                g.raw_at() >= g.exps_at() + exps && g.raw_at().is_multiple_of(256) && g.raw_at() - (2 * p + exps) < 256
            );
            assert!(
                g.bytes() >= g.raw_at() + 4 * b
                    && g.bytes().is_multiple_of(256)
                    && g.bytes() - (g.raw_at() + 4 * b) < 256
            );
            assert_eq!(g.blocks(), p.div_ceil(BLOCK) + b.div_ceil(BLOCK));
        }
        // A slot shorter than the encoded length is all codes; an empty one still spaces
        // wires 256 bytes apart.
        let codec = Codec::new(Compression::Fp16, 3000).unwrap();
        let g = WireGeom::new(&codec, 1000);
        assert_eq!((g.encoded, g.raw, g.exponents(), g.raw_at(), g.bytes()), (1000, 0, 1, 2048, 2048));
        assert_eq!(WireGeom::new(&codec, 0).bytes(), 256);
    }

    // ---- the kernels, on the host and on a GPU ----------------------------------------------

    use crate::cuda::host::{checker_or_skip, elem_cfg, elem_cfgs, Arg, Cfg, In, InU8, Out, OutU8, I32, U64};
    use crate::exchange::shm::tests::shm_exchange;
    use crate::rng::SplitMix64;
    use crate::testing::assert_bits;
    use crate::wire::Wire;

    /// A wire of the codec in the device layout of `g` (codes at 0, the fp16 exponents
    /// after them, the raw floats on 256 bytes; padding zero).
    fn device_wire(g: &WireGeom, w: &Wire) -> Vec<u8> {
        let (half, exps, raw) = w.parts();
        let mut b = vec![0u8; g.bytes()];
        for (i, h) in half.iter().enumerate() {
            b[2 * i..2 * i + 2].copy_from_slice(&h.to_ne_bytes());
        }
        for (i, &e) in exps.iter().enumerate() {
            b[g.exps_at() + i] = e as u8;
        }
        for (i, r) in raw.iter().enumerate() {
            b[g.raw_at() + 4 * i..g.raw_at() + 4 * i + 4].copy_from_slice(&r.to_ne_bytes());
        }
        b
    }

    /// The three parts of a device wire: codes, exponents, raw values.
    fn wire_parts(g: &WireGeom, b: &[u8]) -> (Vec<u16>, Vec<i8>, Vec<f32>) {
        let codes = (0..g.encoded).map(|i| u16::from_ne_bytes([b[2 * i], b[2 * i + 1]])).collect();
        let exps = (0..g.exponents()).map(|i| b[g.exps_at() + i] as i8).collect();
        let at = |i: usize| g.raw_at() + 4 * i;
        let raw = (0..g.raw).map(|i| f32::from_ne_bytes(b[at(i)..at(i) + 4].try_into().unwrap())).collect();
        (codes, exps, raw)
    }

    /// Whether a 16-bit code of `c` is a NaN.
    fn code_is_nan(c: Compression, h: u16) -> bool {
        match c {
            Compression::Fp16 => h & 0x7C00 == 0x7C00 && h & 0x03FF != 0,
            _ => h & 0x7F80 == 0x7F80 && h & 0x007F != 0,
        }
    }

    /// One slot of the codec checks: `encoded` values in blocks of 1,024 of their own
    /// magnitude (2^-140, subnormal all through, up to 2^127, near f32's largest),
    /// specials in two of them — NaNs of either sign with quiet and signalling payloads,
    /// ±∞, ±0, f32 subnormals, f32::MAX, exact bf16 ties (low half 0x8000) — then `raw` f32
    /// values (slot s scaled by 2^(8s), so that the order of their sum shows) with a NaN,
    /// an ∞ and subnormals among them. (The GPU exchange's test of 16-bit gradients,
    /// `super::super::tests`, draws its slots here too.)
    pub(in crate::exchange::gpu) fn codec_slot(g: &mut SplitMix64, s: usize, encoded: usize, raw: usize) -> Vec<f32> {
        let mut uniform = || g.next_f32() * 2.0 - 1.0;
        let magnitudes = [-140, -60, -10, 0, 20, 100, 126];
        let mut v: Vec<f32> = (0..encoded)
            .map(|i| {
                let e = magnitudes[(i / 1024) % magnitudes.len()];
                uniform() * 2f32.powi(e.max(-126)) * if e < -126 { 2f32.powi(e + 126) } else { 1.0 }
            })
            .collect();
        let specials = [
            f32::from_bits(0x7FC0_1234),
            f32::from_bits(0xFFC0_0001),
            f32::from_bits(0x7F80_0001), // signalling
            f32::from_bits(0xFFA5_5A5A), // signalling, negative
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::from_bits(1),
            -f32::from_bits(0x007F_FFFF),
            f32::MAX,
            -f32::MAX,
        ];
        for (k, x) in specials.iter().enumerate() {
            // Block 2 (magnitude 2^-10) and block 4 (2^20), a few positions per slot.
            v[2 * 1024 + 37 * k + s] = *x;
            v[4 * 1024 + 53 * k + 2 * s] = *x;
        }
        for k in 0..64 {
            // Exact bf16 ties in block 3 (magnitude 1): round to the even code.
            let i = 3 * 1024 + 16 * k + s;
            v[i] = f32::from_bits((v[i].to_bits() & 0xFFFF_0000) | 0x8000);
        }
        let mut tail: Vec<f32> = (0..raw).map(|_| uniform() * 2f32.powi(8 * s as i32)).collect();
        // A sum whose order shows: (1 + 2^-24) + (2^-24 + 2^-24) = 1 + 2^-23 in the tree, 1
        // left to right (each 2^-24 a tie that rounds to even, 1).
        tail[0] = [1.0, 2f32.powi(-24), 2f32.powi(-24), 2f32.powi(-24), 0.0][s % 5];
        tail[3] = f32::NAN;
        tail[5 + s] = f32::INFINITY;
        tail[11] = f32::from_bits(3 + s as u32);
        v.extend(tail);
        v
    }

    /// The inputs of a codec check: `r` slots made by [`codec_slot`], the codec's own wire
    /// of each, and the slots packed as the GPU exchange lays them out (`src`: slot j at
    /// j·`stride`, a whole number of 64-value rows apart).
    struct CodecInputs {
        slots: Vec<Vec<f32>>,
        wires: Vec<Wire>,
        stride: usize,
        src: Vec<f32>,
    }

    fn codec_inputs(codec: &Codec, g: &mut SplitMix64, r: usize, encoded: usize, raw: usize) -> CodecInputs {
        let len = encoded + raw;
        let slots: Vec<Vec<f32>> = (0..r).map(|s| codec_slot(g, s, encoded, raw)).collect();
        let wires = slots
            .iter()
            .map(|v| {
                let mut w = codec.wire(0..len);
                codec.encode(v, &mut w, 0..len);
                w
            })
            .collect();
        let stride = len.div_ceil(64) * 64;
        let mut src = vec![0.0f32; r * stride];
        for (j, v) in slots.iter().enumerate() {
            src[j * stride..j * stride + len].copy_from_slice(v);
        }
        CodecInputs { slots, wires, stride, src }
    }

    /// As `Gpu::wire_reduce` pushes them: wires, out, R, format, encoded, raw, wire bytes,
    /// exps_at, raw_at.
    fn reduce_args<'a>(g: &WireGeom, r: usize, wires: &'a [u8], out: &'a mut [u8]) -> [Arg<'a>; 9] {
        [
            InU8(wires),
            OutU8(out),
            I32(r as i32),
            I32(g.format()),
            U64(g.encoded as u64),
            U64(g.raw as u64),
            U64(g.bytes() as u64),
            U64(g.exps_at() as u64),
            U64(g.raw_at() as u64),
        ]
    }

    /// As `Gpu::wire_decode` pushes them: wire, dst, format, encoded, raw, exps_at, raw_at.
    fn decode_args<'a>(g: &WireGeom, wire: &'a [u8], dst: &'a mut [f32]) -> [Arg<'a>; 7] {
        [
            InU8(wire),
            Out(dst),
            I32(g.format()),
            U64(g.encoded as u64),
            U64(g.raw as u64),
            U64(g.exps_at() as u64),
            U64(g.raw_at() as u64),
        ]
    }

    /// Encoded values of the checks' slots (six blocks of 1,024 and part of a seventh)
    /// and raw values after them.
    const ENCODED: usize = 6 * 1024 + 300;
    const RAW: usize = 700;

    /// kernels/codec.cu run on the host against `exchange::codec`, each kernel bit for bit
    /// on the same wires. The encode kernel's wire is the codec's; the decode kernel's
    /// values are the codec's (NaN payloads included: a block holding a NaN is unscaled,
    /// and the kernel skips the scale of 2^0 there); the reduce kernel's sum is
    /// `Codec::reduce`'s, the canonical tree over the wires — except which NaN a sum
    /// holding a NaN gives: CUDA returns its canonical NaN for arithmetic on a NaN, x86 one
    /// of the operands' (which one depending on the order a compiler gave the operands:
    /// some fp16 sums' NaN codes differ in sign or payload), so there a NaN must match a
    /// NaN (bf16 turns every NaN into 0x7FC0, so it matches bit for bit anyway). Then the
    /// whole GPU exchange (encode each slot, the wires side by side, reduce, decode)
    /// against the shared-memory exchange on the same slots, on 1 and r members.
    #[test]
    fn the_kernels_run_on_the_host_as_the_codec() {
        const TEST: &str = "the_kernels_run_on_the_host_as_the_codec";
        let Some(k) = checker_or_skip(TEST, crate::train::kernel_files) else { return };
        let len = ENCODED + RAW;
        for compression in [Compression::Bf16, Compression::Fp16] {
            let codec = Codec::new(compression, ENCODED).unwrap();
            let g = WireGeom::new(&codec, len);
            assert_eq!(g.payload(), codec.wire(0..len).bytes(), "{compression:?}: the bytes a wire carries");
            let mut rng = SplitMix64::new(40 + compression as u64);
            for r in [1usize, 2, 3, 5] {
                let case = format!("{compression:?}, {r} wires");
                let CodecInputs { slots, wires: cpu_wires, stride, src } =
                    codec_inputs(&codec, &mut rng, r, ENCODED, RAW);
                // Encode: all r slots in one launch (grid.y = r), slot j at j·stride, as
                // Gpu::wire_encode pushes it: src, wires, format, encoded, raw, stride,
                // wire bytes, exps_at, raw_at.
                let mut wires = vec![0u8; r * g.bytes()];
                let cfg = Cfg { grid: (g.blocks() as u32, r as u32, 1), block: (CODEC_THREADS, 1, 1) };
                k.launch(
                    &wire_encode::PLAIN,
                    cfg,
                    &mut [
                        In(&src),
                        OutU8(&mut wires),
                        I32(g.format()),
                        U64(ENCODED as u64),
                        U64(RAW as u64),
                        U64(stride as u64),
                        U64(g.bytes() as u64),
                        U64(g.exps_at() as u64),
                        U64(g.raw_at() as u64),
                    ],
                );
                for (j, w) in cpu_wires.iter().enumerate() {
                    let got = &wires[j * g.bytes()..(j + 1) * g.bytes()];
                    let bad = got.iter().zip(device_wire(&g, w)).position(|(a, b)| *a != b);
                    assert_eq!(bad, None, "{case}: wire {j}, first byte off the codec's");
                }

                // Reduce: the codec's own wires, side by side.
                let side_by_side: Vec<u8> = cpu_wires.iter().flat_map(|w| device_wire(&g, w)).collect();
                let mut out = vec![0u8; g.bytes()];
                let cfg = Cfg { grid: (g.blocks() as u32, 1, 1), block: (CODEC_THREADS, 1, 1) };
                k.launch(&wire_reduce::PLAIN, cfg, &mut reduce_args(&g, r, &side_by_side, &mut out));
                let mut cpu_sum = codec.wire(0..len);
                codec.reduce(&cpu_wires.iter().collect::<Vec<_>>(), 0..len, &mut cpu_sum);
                let (codes, exps, raw_sum) = wire_parts(&g, &out);
                let (want_codes, want_exps, want_raw) = cpu_sum.parts();
                assert_eq!(exps, want_exps, "{case}: the sum's block exponents");
                let mut nans = 0;
                for (i, (&a, &b)) in codes.iter().zip(want_codes).enumerate() {
                    if code_is_nan(compression, b) {
                        assert!(
                            code_is_nan(compression, a),
                            "{case}: sum code {i} is {a:#06x}, the codec's NaN {b:#06x}"
                        );
                        nans += 1;
                    } else {
                        assert_eq!(a, b, "{case}: sum code {i}");
                    }
                }
                assert!(nans > 0, "{case}: the specials reach the sum");
                for (i, (a, b)) in raw_sum.iter().zip(want_raw).enumerate() {
                    assert!(
                        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                        "{case}: raw sum {i}: {a} vs {b}"
                    );
                }
                if r == 5 {
                    // The order the kernel must follow shows: left to right, raw value 0
                    // sums to 1, in the canonical tree to 1 + 2^-23 (codec_slot).
                    let sequential = (0..r).fold(0.0f32, |acc, s| acc + slots[s][ENCODED]);
                    assert_eq!((sequential, want_raw[0]), (1.0, 1.0 + 2f32.powi(-23)), "{case}");
                }

                // Decode: the codec's sum.
                let mut want = vec![0.0f32; len];
                codec.decode(&cpu_sum, 0..len, &mut want);
                let cpu_sum_wire = device_wire(&g, &cpu_sum);
                for cfg in elem_cfgs(len) {
                    let mut dst = vec![f32::NAN; len];
                    k.launch(&wire_decode::PLAIN, cfg, &mut decode_args(&g, &cpu_sum_wire, &mut dst));
                    assert_bits(&format!("{case}: decoded sum {cfg:?}"), &dst, &want);
                }

                // The GPU exchange's chain on the kernels' own wires, against the
                // shared-memory exchange on the same slots (r logical replicas on 1 member,
                // and on r members: any device count with R fixed reads the same sum).
                let mut reduced = vec![0u8; g.bytes()];
                k.launch(&wire_reduce::PLAIN, cfg, &mut reduce_args(&g, r, &wires, &mut reduced));
                let mut gpu_sum = vec![f32::NAN; len];
                k.launch(&wire_decode::PLAIN, elem_cfg(len), &mut decode_args(&g, &reduced, &mut gpu_sum));
                for members in [1, r] {
                    for (member, cpu) in shm_exchange(members, codec, &slots).iter().enumerate() {
                        for (i, (a, b)) in gpu_sum.iter().zip(cpu).enumerate() {
                            assert!(
                                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                                "{case}: value {i} of the GPU chain {a} vs the CPU exchange's {b} \
                                 ({members} members, member {member})"
                            );
                        }
                    }
                }
            }
        }
        let file: std::collections::BTreeSet<String> = KERNELS.kernels.iter().map(|k| k.name()).collect();
        assert_eq!(k.ran(), file, "the kernels run here vs those of {}", KERNELS.name);
    }

    /// The codec kernels on a GPU against `exchange::codec`, through the launches the GPU
    /// exchange makes, as the host check holds them: encode and decode bit for bit (NaN
    /// payloads included), the sum bit for bit but for which NaN a sum holding a NaN gives
    /// (CUDA's arithmetic returns its canonical NaN; x86 keeps an operand's).
    #[test]
    fn the_kernels_run_on_a_gpu_as_the_codec() {
        if !crate::ops::conformance::gpu_or_skip("the_kernels_run_on_a_gpu_as_the_codec") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let s = gpu.stream();
        let len = ENCODED + RAW;
        for compression in [Compression::Bf16, Compression::Fp16] {
            let codec = Codec::new(compression, ENCODED).unwrap();
            let g = WireGeom::new(&codec, len);
            let mut rng = SplitMix64::new(40 + compression as u64);
            for r in [1usize, 2, 3, 5] {
                let case = format!("{compression:?}, {r} wires");
                let CodecInputs { wires: cpu_wires, stride, src, .. } = codec_inputs(&codec, &mut rng, r, ENCODED, RAW);
                let mut wires_d = s.alloc_zeros::<u8>(r * g.bytes()).unwrap();
                gpu.wire_encode(&s.clone_htod(&src).unwrap(), stride, r, &mut wires_d.as_view_mut(), &g).unwrap();
                let wires = s.clone_dtoh(&wires_d).unwrap();
                for (j, w) in cpu_wires.iter().enumerate() {
                    let got = &wires[j * g.bytes()..(j + 1) * g.bytes()];
                    let bad = got.iter().zip(device_wire(&g, w)).position(|(a, b)| *a != b);
                    assert_eq!(bad, None, "{case}: wire {j}, first byte off the codec's");
                }

                let side_by_side: Vec<u8> = cpu_wires.iter().flat_map(|w| device_wire(&g, w)).collect();
                let mut out_d = s.alloc_zeros::<u8>(g.bytes()).unwrap();
                gpu.wire_reduce(&s.clone_htod(&side_by_side).unwrap().as_view(), r, &mut out_d.as_view_mut(), &g)
                    .unwrap();
                let mut cpu_sum = codec.wire(0..len);
                codec.reduce(&cpu_wires.iter().collect::<Vec<_>>(), 0..len, &mut cpu_sum);
                let (codes, exps, raw_sum) = wire_parts(&g, &s.clone_dtoh(&out_d).unwrap());
                let (want_codes, want_exps, want_raw) = cpu_sum.parts();
                assert_eq!(exps, want_exps, "{case}: the sum's block exponents");
                for (i, (&a, &b)) in codes.iter().zip(want_codes).enumerate() {
                    let same = a == b || (code_is_nan(compression, a) && code_is_nan(compression, b));
                    assert!(same, "{case}: sum code {i}: {a:#06x} vs the codec's {b:#06x}");
                }
                for (i, (a, b)) in raw_sum.iter().zip(want_raw).enumerate() {
                    assert!(
                        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                        "{case}: raw sum {i}: {a} vs {b}"
                    );
                }

                let mut want = vec![0.0f32; len];
                codec.decode(&cpu_sum, 0..len, &mut want);
                let mut dst_d = s.clone_htod(&vec![f32::NAN; len]).unwrap();
                gpu.wire_decode(&s.clone_htod(&device_wire(&g, &cpu_sum)).unwrap().as_view(), &mut dst_d, &g).unwrap();
                assert_bits(&format!("{case}: decoded sum"), &s.clone_dtoh(&dst_d).unwrap(), &want);
            }
        }
    }
}
