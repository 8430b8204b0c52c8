//! The optimiser-side training recipes of issue 18 through the trainer: SGD with Nesterov
//! momentum, AdamW, weight decay on the weights only, linear warm-up and clipping by the
//! global gradient norm.
//!
//! - Each recipe is applied as `optim` says (tests/optim_reference.rs holds `optim` to
//!   PyTorch): weight decay moves the weights (tensors of 2 or more dimensions) and
//!   nothing else, bitwise; the clipped step is the unclipped one times the factor of the
//!   averaged gradient's norm; the first warm-up step is 1/N of the full one.
//! - With R logical replicas fixed, every recipe together gives bitwise the same weights,
//!   losses and optimiser state on 1, 2, 3 and 6 CPU devices, with the sharded optimiser
//!   (each device updates its part, but reads the whole sum for the norm) and with 16-bit
//!   gradients (the decoded sum is the same on every device).

use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::data::Dataset;
use lockstep::devices::Devices;
use lockstep::exchange::codec::Compression;
use lockstep::models::{self, ConvnetOptions};
use lockstep::nn::Graph;
use lockstep::optim::{DecayOn, LrSchedule, MomentumKind, OptimizerConfig, Sharding};
use lockstep::train::{train_data_parallel, TrainConfig, TrainReport};

fn cpu(n: usize) -> Devices {
    Devices::cpu(n, 1).unwrap()
}

fn digits(n: usize) -> Dataset {
    let d = load_digits(DigitsLayout::Image28).unwrap().train;
    d.subset("digits-subset", &(0..n).collect::<Vec<_>>())
}

/// The convnet: convolutions without bias, BatchNorm's shift, a convolution and two
/// linear layers with biases, dropout 0.5.
fn convnet() -> Graph {
    models::convnet(ConvnetOptions::default()).unwrap()
}

fn run(model: &Graph, data: &Dataset, devices: &Devices, cfg: &TrainConfig) -> TrainReport {
    train_data_parallel(model, data, None, devices, cfg).unwrap()
}

/// One step of plain SGD at lr 0.5 on 32 digits, from the seed's weights, with `cfg`'s
/// changes: the weights before and after.
fn one_step(model: &Graph, data: &Dataset, change: impl FnOnce(TrainConfig) -> TrainConfig) -> Vec<f32> {
    let cfg = TrainConfig {
        epochs: 1,
        max_steps: Some(1),
        batch_size: 32,
        optimizer: OptimizerConfig::sgd(0.5),
        seed: 4,
        ..Default::default()
    };
    run(model, data, &cpu(1), &change(cfg)).weights.params
}

#[test]
fn the_trainer_applies_each_recipe_as_the_optimizer_defines_it() {
    let model = convnet();
    let data = digits(32);
    let p0 = model.init(4).params;
    let lr = 0.5f32;
    let plain = one_step(&model, &data, |c| c);
    // The step: p0 − lr·g. (Gaps between tensors stay 0.)
    let step: Vec<f32> = p0.iter().zip(&plain).map(|(a, b)| a - b).collect();
    assert!(step.iter().any(|&d| d != 0.0));
    let decays = |ndim: usize| ndim >= 2;

    // Weight decay 0.1 on the weights: they move by a further lr·wd·p0 (within the
    // rounding of p0 − lr·(g + wd·p0) against p0 − lr·g: 2 ulp of the weights, ≤ 3e-7
    // here); BatchNorm's shift and the biases take bitwise the step without decay.
    let sgd_wd = OptimizerConfig::Sgd { lr, momentum: 0.0, momentum_kind: MomentumKind::Classic, weight_decay: 0.1 };
    let decayed = one_step(&model, &data, |c| TrainConfig { optimizer: sgd_wd, ..c });
    let everywhere = one_step(&model, &data, |c| TrainConfig { optimizer: sgd_wd, weight_decay_on: DecayOn::All, ..c });
    let (mut weights, mut others) = (0, 0);
    for t in model.param_infos() {
        let r = t.range.clone();
        for i in r {
            let extra = plain[i] - decayed[i];
            let want = lr * 0.1 * p0[i];
            if decays(t.shape.dims().len()) {
                assert!((extra - want).abs() <= 3e-7, "{}[{i}]: decayed by {extra}, want {want}", t.name);
                weights += 1;
            } else {
                assert_eq!(decayed[i].to_bits(), plain[i].to_bits(), "{}[{i}] decayed", t.name);
                assert!((plain[i] - everywhere[i] - want).abs() <= 3e-7, "{}[{i}] with --weight-decay-on all", t.name);
                others += 1;
            }
        }
    }
    assert!(weights > 1000 && others > 100, "{weights} weights, {others} others");

    // AdamW, decay 0.5: the weights shrink by p0·lr·wd on top of Adam's step; the rest
    // take Adam's step bitwise.
    let adamw = |wd: f32| OptimizerConfig::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: wd };
    let adam_step = one_step(&model, &data, |c| TrainConfig { optimizer: adamw(0.0), ..c });
    let adamw_step = one_step(&model, &data, |c| TrainConfig { optimizer: adamw(0.5), ..c });
    for t in model.param_infos() {
        for i in t.range.clone() {
            if decays(t.shape.dims().len()) {
                let (extra, want) = (adam_step[i] - adamw_step[i], p0[i] * 1e-2 * 0.5);
                assert!((extra - want).abs() <= 3e-7, "{}[{i}]: AdamW decayed by {extra}, want {want}", t.name);
            } else {
                assert_eq!(adamw_step[i].to_bits(), adam_step[i].to_bits(), "{}[{i}] decayed by AdamW", t.name);
            }
        }
    }

    // Clipping to a tenth of the norm: the step times C/(‖g‖ + 1e-6), ‖g‖ = ‖step‖/lr (the
    // recovered g is within 1e-4 relative of the true one: p0 − (p0 − lr·g) rounds).
    let norm = (step.iter().map(|&d| (d as f64 / lr as f64).powi(2)).sum::<f64>()).sqrt();
    let max_norm = (norm / 10.0) as f32;
    let clipped = one_step(&model, &data, |c| TrainConfig { clip_grad_norm: Some(max_norm), ..c });
    let factor = max_norm as f64 / (norm + 1e-6);
    for (i, (&a, &c)) in p0.iter().zip(&clipped).enumerate() {
        let (got, want) = ((a - c) as f64, step[i] as f64 * factor);
        assert!((got - want).abs() <= 1e-4 * step[i].abs() as f64 + 2e-8, "[{i}]: clipped step {got}, want {want}");
    }
    // A norm above the gradient's clips nothing: bitwise the plain step.
    let loose = one_step(&model, &data, |c| TrainConfig { clip_grad_norm: Some((norm * 2.0) as f32), ..c });
    assert!(loose == plain, "a clip above the norm changed the step");

    // Warm-up over 4 steps: the first runs at a quarter of the rate.
    let warm = one_step(&model, &data, |c| TrainConfig { warmup_steps: 4, ..c });
    for (i, (&a, &w)) in p0.iter().zip(&warm).enumerate() {
        let (got, want) = (a - w, step[i] / 4.0);
        assert!((got - want).abs() <= 1e-4 * step[i].abs() + 2e-8, "[{i}]: warm-up step {got}, want {want}");
    }
}

/// The recipes of a residual network's run, all at once.
fn recipes() -> [TrainConfig; 2] {
    let base = TrainConfig {
        epochs: 2,
        batch_size: 24,
        replicas: Some(6),
        seed: 7,
        schedule: LrSchedule::Cosine { floor: 0.1 },
        warmup_steps: 3,
        check_replicas_every: Some(1),
        ..Default::default()
    };
    let nesterov =
        OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, momentum_kind: MomentumKind::Nesterov, weight_decay: 5e-4 };
    let adamw = OptimizerConfig::AdamW { lr: 3e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.05 };
    [
        TrainConfig { optimizer: nesterov, clip_grad_norm: Some(0.5), ..base.clone() },
        TrainConfig { optimizer: adamw, clip_grad_norm: Some(0.2), ..base },
    ]
}

fn assert_same(what: &str, a: &TrainReport, b: &TrainReport) {
    assert!(a.weights == b.weights, "{what}: weights");
    assert_eq!(a.losses, b.losses, "{what}: losses");
    assert!(a.optimizer == b.optimizer, "{what}: optimiser state");
}

#[test]
fn the_recipes_are_bitwise_equal_on_1_2_3_6_devices_sharded_and_with_16_bit_gradients() {
    let model = convnet();
    let data = digits(96); // 4 steps of 24 an epoch, 8 in all: 3 of warm-up, 5 of cosine
    for cfg in recipes() {
        let name = format!("{:?}", cfg.optimizer);
        let reference = run(&model, &data, &cpu(1), &cfg);
        assert_eq!(reference.steps, 8);
        // The clip is in force: without it, other weights.
        let unclipped = run(&model, &data, &cpu(1), &TrainConfig { clip_grad_norm: None, ..cfg.clone() });
        assert!(unclipped.weights != reference.weights, "{name}: the clip changes nothing");
        for n in [2, 3, 6] {
            assert_same(&format!("{name} on cpu:{n}"), &run(&model, &data, &cpu(n), &cfg), &reference);
            let sharded = TrainConfig { optimizer_sharding: Sharding::Sharded, ..cfg.clone() };
            assert_same(&format!("{name} sharded on cpu:{n}"), &run(&model, &data, &cpu(n), &sharded), &reference);
        }
        let bf16 = TrainConfig { grad_compression: Compression::Bf16, ..cfg.clone() };
        let bf16_reference = run(&model, &data, &cpu(1), &bf16);
        assert!(bf16_reference.weights != reference.weights, "{name}: bf16 gradients change nothing");
        assert_same(&format!("{name} bf16 on cpu:2"), &run(&model, &data, &cpu(2), &bf16), &bf16_reference);
        let both = TrainConfig { optimizer_sharding: Sharding::Sharded, ..bf16 };
        assert_same(&format!("{name} bf16 sharded on cpu:3"), &run(&model, &data, &cpu(3), &both), &bf16_reference);
    }
}
