//! 16-bit gradients on the wire (`TrainConfig::grad_compression`, `--grad-compression
//! bf16|fp16`) in whole training runs on CPU devices: the replica check passes every step,
//! device counts with R fixed agree bitwise, and the losses stay near the f32 run's. The
//! codec's sum itself (exactly the codec's on every member and device count, fp16's block
//! scales, the bytes on the wire, one step applying the decoded sum) is checked beside it,
//! in src/exchange/codec.rs; through the GPU exchange, in src/exchange/gpu/tests.rs.

use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::devices::Devices;
use lockstep::exchange::codec::Compression;
use lockstep::models::{self, ConvnetOptions};
use lockstep::train::{train_data_parallel, TrainConfig};

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
