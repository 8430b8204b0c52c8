//! The codec's sum: how an exchange adds the 16-bit wires of its logical replicas
//! (`Codec::reduce`), decoded, in f32, in the canonical tree of `super::tree`, the sum
//! encoded again — one piece that any exchange can carry (shared memory, MPI between
//! processes), kept apart from every transport; the GPU exchange runs the same with
//! kernels (kernels/codec.cu's `wire_reduce`).
//!
//! Owns the sum only. The wire format (what travels, how a value is encoded and decoded)
//! is `crate::wire`'s, a leaf that `cuda` builds on too; its names are re-exported here,
//! so that `exchange::codec` stays the one path of the codec for the exchanges, the
//! command line and the tests.

use std::ops::Range;

use super::tree::tree_sum;
pub use crate::wire::Compression;
use crate::wire::Format;
pub(crate) use crate::wire::{bf16_bits, Codec, Wire, BLOCK};

impl Codec {
    /// The sum of `range` over every wire of `wires` (one per logical replica, in replica
    /// order), encoded into `out`: each decoded, added in f32 in the canonical tree of
    /// [`super::tree::tree_sum`] (for 2, 3, 4: a+b, (a+b)+c, (a+b)+(c+d)), the sum encoded.
    /// What a reduce-scatter's owner of `range` computes; every transport that carries
    /// this codec sums this way, so their results agree bitwise.
    pub fn reduce(&self, wires: &[&Wire], range: Range<usize>, out: &mut Wire) {
        let enc = self.encoded(&range);
        if !enc.is_empty() {
            match (self.format, wires.len()) {
                // bf16 decodes with a shift: decode, tree and encode fuse into one pass.
                (Format::Bf16, 1..=4) => {
                    let ins: Vec<&[u16]> = wires
                        .iter()
                        .map(|w| {
                            let start = self.encoded(&w.range()).start;
                            &w.half[enc.start - start..enc.end - start]
                        })
                        .collect();
                    let out_start = self.encoded(&out.range()).start;
                    let dst = &mut out.half[enc.start - out_start..enc.end - out_start];
                    reduce_bf16(&ins, dst);
                }
                _ => self.reduce_blocks(wires, enc.clone(), out),
            }
        }
        let raw = range.start.max(self.encoded_len())..range.end.max(self.encoded_len());
        if !raw.is_empty() {
            let views: Vec<&[f32]> =
                wires.iter().map(|w| self.raw(w, raw.clone()).expect("past the encoded part")).collect();
            let mut sum = vec![0.0f32; raw.len()];
            tree_sum(&views, &mut sum);
            self.encode(&sum, out, raw);
        }
    }

    /// [`Codec::reduce`] of an encoded `range`, block by block: every wire's block decoded
    /// into L1-sized scratch, summed by `tree_sum`, encoded.
    fn reduce_blocks(&self, wires: &[&Wire], range: Range<usize>, out: &mut Wire) {
        let n = wires.len();
        let mut decoded = vec![0.0f32; n * BLOCK];
        let mut sum = vec![0.0f32; BLOCK];
        for start in range.clone().step_by(BLOCK) {
            let block = start..(start + BLOCK).min(range.end);
            let len = block.len();
            for (w, dst) in wires.iter().zip(decoded.chunks_exact_mut(BLOCK)) {
                self.decode(w, block.clone(), &mut dst[..len]);
            }
            let views: Vec<&[f32]> = decoded.chunks_exact(BLOCK).map(|d| &d[..len]).collect();
            tree_sum(&views, &mut sum[..len]);
            self.encode(&sum[..len], out, block);
        }
    }
}

/// `out[i]` = bf16 of the canonical tree sum of the decoded `ins[·][i]` (1 to 4 inputs),
/// compiled for AVX2 where the processor has it (the same arithmetic, wider).
fn reduce_bf16(ins: &[&[u16]], out: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor supports AVX2 (checked just above), the only requirement
        // of a `target_feature(enable = "avx2")` function.
        unsafe { reduce_bf16_avx2(ins, out) };
        return;
    }
    reduce_bf16_any(ins, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn reduce_bf16_avx2(ins: &[&[u16]], out: &mut [u16]) {
    reduce_bf16_any(ins, out)
}

#[inline(always)]
fn reduce_bf16_any(ins: &[&[u16]], out: &mut [u16]) {
    let d = |h: u16| f32::from_bits((h as u32) << 16);
    match *ins {
        [a] => out.iter_mut().zip(a).for_each(|(o, &a)| *o = bf16_bits(d(a))),
        [a, b] => out.iter_mut().zip(a.iter().zip(b)).for_each(|(o, (&a, &b))| *o = bf16_bits(d(a) + d(b))),
        [a, b, c] => out
            .iter_mut()
            .zip(a.iter().zip(b).zip(c))
            .for_each(|(o, ((&a, &b), &c))| *o = bf16_bits((d(a) + d(b)) + d(c))),
        [a, b, c, e] => out
            .iter_mut()
            .zip(a.iter().zip(b).zip(c.iter().zip(e)))
            .for_each(|(o, ((&a, &b), (&c, &e)))| *o = bf16_bits((d(a) + d(b)) + (d(c) + d(e)))),
        _ => unreachable!("reduce_bf16 takes 1 to 4 inputs"),
    }
}
