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
mod tests {
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
}
