//! Gradient accumulation (`TrainConfig::accumulate`, `--accumulate K`; the rules are in
//! src/train/step.rs): on 1–4 CPU devices, the weights against the unaccumulated run
//! within a stated tolerance, bitwise where the docs promise it (device counts with R
//! fixed; whole logical shards), BatchNorm per micro-batch, and dropout drawing the
//! unaccumulated step's masks. The activation memory is measured in
//! tests/accumulate_memory.rs (a binary of its own: it counts every allocation).

use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::data::{toy, Dataset};
use lockstep::devices::Devices;
use lockstep::models::{self, ConvnetOptions, Norm};
use lockstep::nn::loss::{softmax_cross_entropy, Metrics};
use lockstep::nn::{Ctx, Graph};
use lockstep::optim::{MomentumKind, OptimizerConfig};
use lockstep::train::{train_data_parallel, with_trainer, Batch, Shuffle, TrainConfig, TrainReport};
use lockstep::{Device, Tensor};

fn cpu(n: usize) -> Devices {
    Devices::cpu(n, 1).unwrap()
}

fn digits(n: usize) -> Dataset {
    let d = load_digits(DigitsLayout::Image28).unwrap().train;
    d.subset("digits-subset", &(0..n).collect::<Vec<_>>())
}

fn run(model: &Graph, data: &Dataset, devices: &Devices, cfg: &TrainConfig) -> TrainReport {
    train_data_parallel(model, data, None, devices, cfg).unwrap()
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Without BatchNorm, K micro-batches give the unaccumulated weights up to the order of
/// the sums: each shard's gradient is the sum of K partial sums instead of one. Dropout
/// (0.5) is on: the micro-batches draw the unaccumulated step's masks, or the runs would
/// part by far more than rounding. Tolerance: the same 1e-4 the N-devices-vs-one test
/// (tests/data_parallel.rs) states for another summation order over these horizons;
/// observed here up to 1.2e-7 (toy, SGD) and 1.2e-6 (convnet, Adam), where a lost or
/// doubled micro-batch would change a step's gradient by a K-th. Losses: 1e-5.
#[test]
fn accumulated_weights_equal_the_unaccumulated_ones_within_rounding() {
    let conv = models::convnet(ConvnetOptions { norm: Norm::None, dropout: 0.5, ..Default::default() }).unwrap();
    let toy_model = models::toy_mlp(2, 2).unwrap();
    let (images, points) = (digits(96), toy::toy_enlarged(40, 3).unwrap().train);
    let sgd = OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, momentum_kind: MomentumKind::Classic, weight_decay: 1e-4 };
    for (model, data, optimizer, batch, steps) in
        [(&toy_model, &points, sgd, 16, 20), (&conv, &images, OptimizerConfig::adam(1e-3), 32, 6)]
    {
        for n in 1..=3 {
            let cfg = TrainConfig {
                epochs: 10,
                max_steps: Some(steps),
                batch_size: batch,
                optimizer,
                seed: 5,
                check_replicas_every: Some(1),
                ..Default::default()
            };
            let plain = run(model, data, &cpu(n), &cfg);
            for k in [2, 4] {
                let acc = run(model, data, &cpu(n), &TrainConfig { accumulate: k, ..cfg.clone() });
                let d = max_abs(&plain.weights.params, &acc.weights.params);
                assert!(d <= 1e-4, "cpu:{n}, K = {k}: weights differ by {d:e}");
                for (a, b) in plain.losses.iter().zip(&acc.losses) {
                    assert!((a - b).abs() <= 1e-5, "cpu:{n}, K = {k}: loss {b} vs {a}");
                }
            }
        }
    }
}

/// The cut into micro-batches is a function of B, R and K alone: with R fixed, 1, 2 and
/// 4 devices give bitwise the same weights, buffers and losses, BatchNorm and dropout
/// included, as without accumulation.
#[test]
fn with_r_fixed_accumulation_keeps_device_counts_bitwise_alike() {
    let model = models::convnet(ConvnetOptions { norm: Norm::BatchNorm, dropout: 0.5, ..Default::default() }).unwrap();
    let data = digits(96);
    // 30 per step cut into 4 shards of 8, 8, 7, 7, each into 3 micro-batches (3+3+2, 3+2+2).
    let cfg =
        TrainConfig { epochs: 2, batch_size: 30, replicas: Some(4), seed: 11, accumulate: 3, ..Default::default() };
    let reference = run(&model, &data, &cpu(1), &cfg);
    assert_eq!(reference.steps, 8);
    for devices in [cpu(2), cpu(4), Devices::cpu(2, 2).unwrap()] {
        let other = run(&model, &data, &devices, &cfg);
        assert!(reference.weights == other.weights, "weights differ on {devices}");
        assert_eq!(reference.losses, other.losses, "losses differ on {devices}");
    }
    // And the accumulated run is another run: BatchNorm normalises each micro-batch alone.
    let plain = run(&model, &data, &cpu(1), &TrainConfig { accumulate: 1, ..cfg });
    assert!(plain.weights != reference.weights);
}

/// Accumulation over whole logical shards is bitwise: a device running K logical shards
/// one after another (R = N·K) gives the weights of N·K devices with one shard each,
/// BatchNorm and dropout included, and `accumulate` = 1 is the step as it always was.
#[test]
fn whole_logical_shards_accumulate_bitwise() {
    let model = models::convnet(ConvnetOptions { norm: Norm::BatchNorm, dropout: 0.5, ..Default::default() }).unwrap();
    let data = digits(64);
    let cfg = TrainConfig { epochs: 1, batch_size: 32, seed: 3, ..Default::default() };
    let four_devices = run(&model, &data, &cpu(4), &cfg);
    for (devices, k) in [(cpu(1), 4), (cpu(2), 2)] {
        // N devices, each accumulating K whole shards: R = N·K = 4.
        let whole = run(&model, &data, &devices, &TrainConfig { replicas: Some(4), ..cfg.clone() });
        assert!(whole.weights == four_devices.weights, "{devices} accumulating {k} whole shards each");
    }
    let explicit_one = run(&model, &data, &cpu(4), &TrainConfig { accumulate: 1, ..cfg });
    assert!(explicit_one.weights == four_devices.weights);
}

/// BatchNorm under accumulation, as PyTorch under `no_sync`: each micro-batch is
/// normalised with its own statistics and moves the running statistics once, in order.
/// One device, one step of 12 samples in K = 2 micro-batches of 6: the loss is the sum of
/// the two micro-batches' losses, each taken alone, and the running statistics are those
/// of the two forwards in a row, bitwise.
#[test]
fn batchnorm_statistics_are_per_micro_batch() {
    let model = models::convnet(ConvnetOptions { norm: Norm::BatchNorm, dropout: 0.0, ..Default::default() }).unwrap();
    let data = digits(12);
    let cfg = TrainConfig { optimizer: OptimizerConfig::sgd(0.1), seed: 4, accumulate: 2, ..Default::default() };
    let rows: Vec<usize> = (0..12).collect();
    let (report, weights) = with_trainer(&model, &Devices::cpu(1, 2).unwrap(), &cfg, |t| {
        let r = t.step(Batch::gather(&data, &rows))?;
        Ok((r, t.weights()?.0))
    })
    .unwrap();
    let mut by_hand = model.clone();
    let mut store = model.init(4);
    let mut total = Metrics::default();
    for part in [0..6, 6..12] {
        let batch = Batch::gather(&data, &rows[part]);
        let x = Tensor::from_vec(batch.x.clone(), [6, 1, 28, 28]).unwrap();
        let logits =
            by_hand.forward(x, &store.params, &mut store.buffers, &Ctx::train(4, 0, 0, Device::Cpu(0))).unwrap();
        total.add(&softmax_cross_entropy(&logits, &batch.y).unwrap().0);
    }
    assert_eq!(report.metrics.loss_sum, total.loss_sum, "the loss of two micro-batches, each normalised alone");
    assert_eq!(weights.buffers, store.buffers, "running statistics moved by each micro-batch in turn");
}

/// A shard with fewer rows than micro-batches: the empty micro-batches add nothing; the
/// step still equals the unaccumulated one within rounding (4 samples on 2 devices, K = 4:
/// micro-batches of 1, 1, 0, 0 rows). And K = 0 is refused, naming the setting.
#[test]
fn empty_micro_batches_add_nothing() {
    let model = models::toy_mlp(2, 2).unwrap();
    let data = toy::toy_enlarged(1, 3).unwrap().train.subset("four", &[0, 1, 2, 3]);
    let cfg = TrainConfig {
        epochs: 3,
        batch_size: 4,
        optimizer: OptimizerConfig::sgd(0.3),
        shuffle: Shuffle::None,
        ..Default::default()
    };
    let plain = run(&model, &data, &cpu(2), &cfg);
    let acc = run(&model, &data, &cpu(2), &TrainConfig { accumulate: 4, ..cfg.clone() });
    assert_eq!(acc.epochs.iter().map(|e| e.train.count).collect::<Vec<_>>(), vec![4, 4, 4]);
    assert!(max_abs(&plain.weights.params, &acc.weights.params) <= 1e-6);
    let e = train_data_parallel(&model, &data, None, &cpu(1), &TrainConfig { accumulate: 0, ..cfg }).unwrap_err();
    assert!(e.to_string().contains("accumulate"), "{e}");
}
