//! Synchronized BatchNorm (`BatchStats::Global`, `--sync-batchnorm`; src/ops/batchnorm/,
//! src/exchange/stats.rs) beyond the PyTorch cases of tests/oracle.rs: on one device it is
//! the plain layer, bitwise; on several it equals one device with the whole batch within
//! rounding, for ragged batches and shards without a sample too; the running statistics
//! are bitwise alike on every replica; what it cannot do is refused before any work.

use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::data::Dataset;
use lockstep::devices::Devices;
use lockstep::models::{self, ConvnetOptions, Norm};
use lockstep::nn::{convert_sync_batchnorm, Graph};
use lockstep::optim::{MomentumKind, OptimizerConfig};
use lockstep::spec::ModelSpec;
use lockstep::train::{train_data_parallel, TrainConfig, TrainReport};

fn cpu(n: usize) -> Devices {
    Devices::cpu(n, 1).unwrap()
}

fn digits(n: usize) -> Dataset {
    let d = load_digits(DigitsLayout::Image28).unwrap().train;
    d.subset("digits-subset", &(0..n).collect::<Vec<_>>())
}

fn convnet(dropout: f32) -> Graph {
    models::convnet(ConvnetOptions { norm: Norm::BatchNorm, dropout, ..Default::default() }).unwrap()
}

fn run(model: &Graph, data: &Dataset, devices: &Devices, cfg: &TrainConfig) -> TrainReport {
    train_data_parallel(model, data, None, devices, cfg).unwrap()
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// A world of one: the statistics exchange hands back the replica's own payload, merged
/// from nothing (so taken as it is), and the sums likewise: bitwise the plain layer's run.
#[test]
fn on_one_device_it_is_the_plain_layer_bitwise() {
    let plain = convnet(0.5);
    let sync = convert_sync_batchnorm(&plain).unwrap();
    let data = digits(64);
    let cfg = TrainConfig { epochs: 1, batch_size: 16, seed: 6, ..Default::default() };
    let a = run(&plain, &data, &Devices::cpu(1, 2).unwrap(), &cfg);
    let b = run(&sync, &data, &Devices::cpu(1, 2).unwrap(), &cfg);
    assert!(a.weights == b.weights);
    assert_eq!(a.losses, b.losses);
}

/// SGD with momentum: Adam would turn the rounding noise of conv2.bias, whose gradient is
/// exactly zero in front of a BatchNorm, into steps of ±lr (tests/oracle.rs), hiding what
/// is compared under noise of its own making.
fn sgd() -> OptimizerConfig {
    OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, momentum_kind: MomentumKind::Classic, weight_decay: 0.0 }
}

/// N devices with synchronized statistics against one device with the whole batch (the
/// same statistics, summed in another order): weights, running statistics and losses
/// within 1e-4 after 6 steps (observed ≤ 4e-8 for the weights, 3e-7 for the statistics);
/// unsynchronized BatchNorm, whose statistics are each shard's, ends 1e-3 away or more
/// (asserted, so that the comparison could not pass without the exchange). 30 samples a
/// step on 4 devices: shards of 8, 8, 7, 7; the last step's 16 on 3: 6, 5, 5. The
/// replica check runs every step.
#[test]
fn n_devices_equal_one_device_with_the_whole_batch() {
    let model = convert_sync_batchnorm(&convnet(0.0)).unwrap();
    let data = digits(76);
    let cfg = TrainConfig {
        epochs: 3,
        max_steps: Some(6),
        batch_size: 30,
        seed: 8,
        optimizer: sgd(),
        check_replicas_every: Some(1),
        ..Default::default()
    };
    let one = run(&model, &data, &Devices::cpu(1, 2).unwrap(), &cfg);
    for n in 2..=4 {
        let many = run(&model, &data, &cpu(n), &cfg);
        let (dw, db) =
            (max_abs(&one.weights.params, &many.weights.params), max_abs(&one.weights.buffers, &many.weights.buffers));
        assert!(dw <= 1e-4 && db <= 1e-4, "cpu:{n}: weights {dw:e}, running statistics {db:e}");
        for (a, b) in one.losses.iter().zip(&many.losses) {
            assert!((a - b).abs() <= 1e-5, "cpu:{n}: loss {b} vs {a}");
        }
    }
    let unsynced = run(&convnet(0.0), &data, &cpu(4), &cfg);
    let apart = max_abs(&one.weights.params, &unsynced.weights.params);
    eprintln!("unsynchronized BatchNorm on 4 devices: weights {apart:e} from one device's");
    assert!(apart > 1e-3, "{apart:e}");
}

/// Fewer samples than devices: a device without a sample still makes every call of the
/// statistics exchange (with a count of 0), nobody waits forever, and the step equals one
/// device with the same 3 samples within rounding (1e-5; SGD moves by ~1e-2). With
/// accumulation (K = 2) the global micro-batch m is the m-th part of every shard: shards
/// of 1, 1, 1, 0 rows put all 3 rows in micro-batch 0 and none in micro-batch 1, which
/// every device sees empty and skips alike — so the step is again the one-device,
/// unaccumulated one.
#[test]
fn shards_without_a_sample_take_part() {
    let model = convert_sync_batchnorm(&convnet(0.0)).unwrap();
    let data = digits(6);
    let cfg = TrainConfig {
        epochs: 2,
        batch_size: 3,
        seed: 1,
        optimizer: sgd(),
        check_replicas_every: Some(1),
        ..Default::default()
    };
    let one = run(&model, &data, &Devices::cpu(1, 2).unwrap(), &cfg);
    assert!(max_abs(&one.weights.params, &model.init(1).params) > 1e-3, "the steps moved the weights");
    for accumulate in [1, 2] {
        let four = run(&model, &data, &cpu(4), &TrainConfig { accumulate, ..cfg.clone() });
        assert_eq!(four.steps, 4);
        let d = max_abs(&one.weights.params, &four.weights.params);
        assert!(d <= 1e-5, "accumulate {accumulate}: weights differ by {d:e}");
    }
}

/// The exchange needs one logical replica per device (a device that ran two shards one
/// after another could never hand both to one call): anything else is refused before any
/// work, naming the setting. The spec field turns it on per layer, and a spec writes it.
#[test]
fn what_it_cannot_do_is_refused_and_the_spec_field_turns_it_on() {
    let model = convert_sync_batchnorm(&convnet(0.0)).unwrap();
    let cfg = TrainConfig { replicas: Some(4), ..Default::default() };
    let e = train_data_parallel(&model, &digits(8), None, &cpu(2), &cfg).unwrap_err().to_string();
    assert!(e.contains("sync-batchnorm") && e.contains("one logical replica per device"), "{e}");

    let spec = ModelSpec::parse(
        r#"{"input_shape": [1, 8, 8], "layers": [
            {"type": "conv2d", "filters": 4, "kernel_size": 3, "use_bias": false},
            {"type": "batch_normalization", "synchronized": true},
            {"type": "flatten"}, {"type": "dense", "units": 3}]}"#,
        "test",
    )
    .unwrap();
    let built = spec.build().unwrap();
    let bn = &built.layers()[1];
    assert_eq!(bn.synchronized_channels(), vec![4], "{}", bn.describe());
    assert_eq!(bn.spec().unwrap()["synchronized"], serde_json::json!(true));
    assert!(built.layers()[1].describe().contains("synchronized"));
}
