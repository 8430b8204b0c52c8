//! 16-bit gradients on the wire (`TrainConfig::grad_compression`, `--grad-compression
//! bf16|fp16`; the codec is src/exchange/codec.rs) through the shared-memory exchange, on
//! 1–4 members: the sum is exactly the codec's (each contribution encoded, decoded, summed
//! in f32 in the canonical tree, the sum encoded, decoded alike by every member), so every
//! member and every device count (R fixed) reads bitwise the same values; fp16's block
//! scales keep gradients far outside fp16's range; the bytes that cross halve; and
//! training keeps its replicas bitwise identical (the replica check runs every step).

mod common;

use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::devices::Devices;
use lockstep::exchange::codec::{Codec, Compression, BLOCK};
use lockstep::exchange::tree::tree_sum;
use lockstep::models::{self, ConvnetOptions, Norm};
use lockstep::train::{train_data_parallel, TrainConfig};

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
    common::shm_exchange(members, codec, &slots)
}

/// The codec's sum written out: each slot through a wire and back, the canonical tree in
/// f32, the sum through a wire and back.
fn by_hand(shards: usize, len: usize, codec: Codec, fill: impl Fn(usize, usize) -> f32) -> Vec<f32> {
    let round_trip = |v: &[f32]| {
        let mut w = codec.wire(0..len);
        codec.encode(v, &mut w, 0..len);
        let mut out = vec![0.0; len];
        codec.decode(&w, 0..len, &mut out);
        out
    };
    let decoded: Vec<Vec<f32>> =
        (0..shards).map(|s| round_trip(&(0..len).map(|i| fill(s, i)).collect::<Vec<_>>())).collect();
    let views: Vec<&[f32]> = decoded.iter().map(|v| v.as_slice()).collect();
    let mut sum = vec![0.0; len];
    tree_sum(&views, &mut sum);
    round_trip(&sum)
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
    use lockstep::nn::loss::softmax_cross_entropy;
    use lockstep::nn::Ctx;
    use lockstep::optim::OptimizerConfig;
    use lockstep::tensor::{Device, Tensor};
    use lockstep::train::{with_trainer, Batch};
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
        let round_trip = |v: &[f32]| {
            let mut w = codec.wire(0..np);
            codec.encode(v, &mut w, 0..np);
            let mut out = vec![0.0; np];
            codec.decode(&w, 0..np, &mut out);
            out
        };
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
                round_trip(&g)
            })
            .collect();
        let sum: Vec<f32> = shard_grads[0].iter().zip(&shard_grads[1]).map(|(a, b)| a + b).collect();
        let sum = round_trip(&sum);
        let want: Vec<f32> = init.params.iter().zip(&sum).map(|(&p, &g)| p - 1.0 * (g / 16.0 + 0.0 * p)).collect();
        let bad = want.iter().zip(&after.params).position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(bad, None, "{compression:?}: first parameter off the codec's sum");
    }
}

/// Training with 16-bit gradients on 2 and 3 devices: the replica check (every step)
/// passes, so every replica decoded the same sums; with R fixed, 1 and 2 devices give
/// bitwise the same weights; and the run differs from the f32 one (the gradients were
/// rounded), its losses staying within 0.02 of the f32 run's over 10 steps (observed
/// ≤ 2e-3: Adam turns the rounding of a gradient whose shards nearly cancel into a step
/// of ±lr either way, so the weights part by up to a few lr while the loss does not move).
#[test]
fn training_keeps_replicas_identical_and_device_counts_alike() {
    let data = load_digits(DigitsLayout::Image28).unwrap().train;
    let data = data.subset("digits-160", &(0..160).collect::<Vec<_>>());
    let base = TrainConfig { epochs: 1, batch_size: 16, seed: 1, check_replicas_every: Some(1), ..Default::default() };
    let model = models::convnet(ConvnetOptions::default()).unwrap();
    let cpu = |n: usize| Devices::cpu(n, 1).unwrap();
    let plain = train_data_parallel(&model, &data, None, &cpu(2), &base).unwrap();
    for compression in [Compression::Bf16, Compression::Fp16] {
        let cfg = TrainConfig { grad_compression: compression, ..base.clone() };
        let three = train_data_parallel(&model, &data, None, &cpu(3), &cfg).unwrap();
        assert_eq!(three.steps, 10);
        let fixed = TrainConfig { replicas: Some(2), ..cfg.clone() };
        let two = train_data_parallel(&model, &data, None, &cpu(2), &fixed).unwrap();
        let one = train_data_parallel(&model, &data, None, &Devices::cpu(1, 2).unwrap(), &fixed).unwrap();
        assert!(one.weights == two.weights, "{compression:?}: R = 2 on 1 and 2 devices");
        assert!(two.weights != plain.weights, "{compression:?}: the gradients were rounded");
        let d = plain.losses.iter().zip(&two.losses).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        eprintln!("{compression:?}: losses within {d:e} of the f32 run's");
        assert!(d <= 0.02, "{compression:?}: losses {d:e} from the f32 run's");
    }
}
