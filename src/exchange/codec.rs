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

/// 16-bit gradients through the shared-memory exchange, on 1–4 members: the sum is exactly
/// the codec's (each contribution encoded, decoded, summed in f32 in the canonical tree,
/// the sum encoded, decoded alike by every member), so every member and every device count
/// (R fixed) reads bitwise the same values; fp16's block scales keep gradients far outside
/// fp16's range; the bytes that cross halve; and a step applies exactly the decoded sum.
/// (Training with them, replicas and device counts alike, is tests/grad_compression.rs's.)
#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::digits::{load_digits, DigitsLayout};
    use crate::devices::Devices;
    use crate::exchange::shm::tests::shm_exchange;
    use crate::models::{self, ConvnetOptions, Norm};
    use crate::train::TrainConfig;

    /// Every member's copy of the sum of `shards` slots (slot s filled by `fill(s, i)`) over
    /// `members` members, with `codec`.
    fn exchanged(
        members: usize,
        shards: usize,
        len: usize,
        codec: Codec,
        fill: impl Fn(usize, usize) -> f32,
    ) -> Vec<Vec<f32>> {
        let slots: Vec<Vec<f32>> = (0..shards).map(|s| (0..len).map(|i| fill(s, i)).collect()).collect();
        shm_exchange(members, codec, &slots)
    }

    /// `v` through a wire of `codec` and back.
    fn round_trip(codec: &Codec, v: &[f32]) -> Vec<f32> {
        let len = v.len();
        let mut w = codec.wire(0..len);
        codec.encode(v, &mut w, 0..len);
        let mut out = vec![0.0; len];
        codec.decode(&w, 0..len, &mut out);
        out
    }

    /// The codec's sum written out: each slot through a wire and back, the canonical tree in
    /// f32, the sum through a wire and back.
    fn by_hand(shards: usize, len: usize, codec: Codec, fill: impl Fn(usize, usize) -> f32) -> Vec<f32> {
        let decoded: Vec<Vec<f32>> =
            (0..shards).map(|s| round_trip(&codec, &(0..len).map(|i| fill(s, i)).collect::<Vec<_>>())).collect();
        let views: Vec<&[f32]> = decoded.iter().map(|v| v.as_slice()).collect();
        let mut sum = vec![0.0; len];
        tree_sum(&views, &mut sum);
        round_trip(&codec, &sum)
    }

    /// Slots of 5,000 values, 3,000 of them encoded (a gradient), the rest f32 (buffers);
    /// magnitudes spread over 2^-20..2^20 so that every fp16 block has its own scale.
    fn fill(s: usize, i: usize) -> f32 {
        let x = ((s * 7919 + i * 104_729) % 1000) as f32 / 1000.0 - 0.5;
        x * 2f32.powi((i / BLOCK) as i32 * 10 - 20) + s as f32 * 1e-3
    }

    #[test]
    fn every_member_and_device_count_reads_exactly_the_codecs_sum() {
        let (len, encoded) = (5000, 3000);
        for compression in [Compression::Bf16, Compression::Fp16] {
            let codec = Codec::new(compression, encoded).unwrap();
            let want = by_hand(4, len, codec, fill);
            for members in [1, 2, 4] {
                for (r, got) in exchanged(members, 4, len, codec, fill).iter().enumerate() {
                    let bad = got.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits());
                    assert_eq!(bad, None, "{compression:?}, {members} members, member {r}: first difference");
                }
            }
            // Every count of logical replicas: bf16 sums 1 to 4 in one fused pass and more
            // block by block, fp16 always block by block; all are the codec's sum.
            for shards in [1, 2, 3, 5] {
                let want = by_hand(shards, len, codec, fill);
                let got = &exchanged(1, shards, len, codec, fill)[0];
                let bad = got.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(bad, None, "{compression:?}, {shards} logical replicas: first difference");
            }
            // The f32 tail is the f32 exchange's: the same tree, no rounding to 16 bits.
            let plain: Vec<f32> = {
                let v: Vec<Vec<f32>> = (0..4).map(|s| (encoded..len).map(|i| fill(s, i)).collect()).collect();
                let views: Vec<&[f32]> = v.iter().map(|x| x.as_slice()).collect();
                let mut out = vec![0.0; len - encoded];
                tree_sum(&views, &mut out);
                out
            };
            assert_eq!(&want[encoded..], &plain[..]);
            // And one shard alone still goes through the codec (cpu:1 trains as it would share).
            let one = exchanged(1, 1, len, codec, fill);
            assert_eq!(one[0], by_hand(1, len, codec, fill));
        }
    }

    /// fp16 alone holds 6e-8..65504; the block scales carry sums of 1e-9 and of 1e6 (each
    /// block of one magnitude) to within fp16's 2^-11 relative precision, twice rounded (the
    /// contributions and the sum): |Δ| ≤ 2·2^-11 relative, where unscaled fp16 would flush
    /// the first to 0 and overflow the second to ∞.
    #[test]
    fn fp16_block_scales_neither_overflow_nor_flush() {
        let len = 2 * BLOCK;
        let codec = Codec::new(Compression::Fp16, len).unwrap();
        let value = |s: usize, i: usize| {
            let base = if i < BLOCK { 1e-9 } else { 1e6 };
            base * (1.0 + ((s * 31 + i) % 97) as f32 / 97.0)
        };
        for got in exchanged(2, 2, len, codec, value) {
            for (i, &g) in got.iter().enumerate() {
                let want = value(0, i) as f64 + value(1, i) as f64;
                assert!(((g as f64 - want) / want).abs() <= 2.0 / 2048.0, "value {i}: {g} for {want}");
            }
        }
    }

    /// What crosses between members: 2 bytes per gradient value (plus one exponent byte per
    /// 1,024 for fp16) where f32 takes 4; the buffers' tail stays 4.
    #[test]
    fn the_bytes_on_the_wire_halve() {
        let model = models::convnet(ConvnetOptions::default()).unwrap();
        let (p, q) = (model.params_len(), model.buffers_len());
        for (compression, exps) in [(Compression::Bf16, 0), (Compression::Fp16, p.div_ceil(BLOCK))] {
            let codec = Codec::new(compression, p).unwrap();
            let wire = codec.wire(0..p + q);
            assert_eq!(wire.bytes(), 2 * p + exps + 4 * q, "{compression:?}");
            let ratio = wire.bytes() as f64 / (4 * (p + q)) as f64;
            assert!(ratio < 0.51, "{compression:?}: {ratio}");
        }
    }

    /// One SGD step of lr 1 with 16-bit gradients on 2 devices applies exactly the codec's
    /// sum: each shard's gradient computed by the layers on the host (rows 0..8 and 8..16),
    /// each rounded through a wire, added in f32, the sum rounded through a wire, ÷ 16, and
    /// p₁ = p₀ − 1·(that ÷ 16 + 0·p₀) as the optimiser computes it: bitwise.
    #[test]
    fn a_step_applies_exactly_the_decoded_sum() {
        use crate::nn::loss::softmax_cross_entropy;
        use crate::nn::Ctx;
        use crate::optim::OptimizerConfig;
        use crate::train::{with_trainer, Batch};
        use crate::{Device, Tensor};
        let model = models::convnet(ConvnetOptions { norm: Norm::None, dropout: 0.0, ..Default::default() }).unwrap();
        let data = load_digits(DigitsLayout::Image28).unwrap().train;
        let rows: Vec<usize> = (0..16).collect();
        let np = model.params_len();
        for compression in [Compression::Bf16, Compression::Fp16] {
            let cfg = TrainConfig {
                optimizer: OptimizerConfig::sgd(1.0),
                seed: 3,
                grad_compression: compression,
                ..Default::default()
            };
            let after = with_trainer(&model, &Devices::cpu(2, 1).unwrap(), &cfg, |t| {
                t.step(Batch::gather(&data, &rows))?;
                Ok(t.weights()?.0)
            })
            .unwrap();
            let init = model.init(3);
            let codec = Codec::new(compression, np).unwrap();
            let shard_grads: Vec<Vec<f32>> = [0..8, 8..16]
                .into_iter()
                .enumerate()
                .map(|(s, r)| {
                    let mut net = model.clone();
                    let batch = Batch::gather(&data, &rows[r]);
                    let x = Tensor::from_vec(batch.x.clone(), [8, 1, 28, 28]).unwrap();
                    let ctx = Ctx::train(3, 0, s, Device::Cpu(0));
                    let logits = net.forward(x, &init.params, &mut [], &ctx).unwrap();
                    let (_, d) = softmax_cross_entropy(&logits, &batch.y).unwrap();
                    let mut g = vec![0.0f32; np];
                    net.backward(d, &init.params, &mut g, &ctx).unwrap();
                    round_trip(&codec, &g)
                })
                .collect();
            let sum: Vec<f32> = shard_grads[0].iter().zip(&shard_grads[1]).map(|(a, b)| a + b).collect();
            let sum = round_trip(&codec, &sum);
            let want: Vec<f32> = init.params.iter().zip(&sum).map(|(&p, &g)| p - 1.0 * (g / 16.0 + 0.0 * p)).collect();
            let bad = want.iter().zip(&after.params).position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(bad, None, "{compression:?}: first parameter off the codec's sum");
        }
    }
}
