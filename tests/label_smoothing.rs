//! Label smoothing (`TrainConfig::label_smoothing`, `train --label-smoothing`) against
//! PyTorch's `F.cross_entropy(..., label_smoothing=eps)`.
//!
//! Every expected number is in tests/label_smoothing.json, made by
//! scripts/torch_label_smoothing.py (torch 2.15, CPU, float32): per-sample losses and the
//! gradient of their sum for fixed logits, and two of ../shared/oracle's cases (see its
//! README.md) trained again with label smoothing 0.1 exactly as oracle.py trains them
//! (the script reproduces the oracle's own losses bit for bit with eps = 0). The cases'
//! initial weights and data are read from ../shared/oracle, or `LOCKSTEP_ORACLE_DIR`.
//!
//! Tolerances: the loss of one sample and its gradient, 1e-6 relative plus 1e-6 absolute
//! (f32 rounding of a log-sum-exp of ten terms; measured: losses within 1.6e-7 relative,
//! gradients within 9e-8); training, the oracle README's: the first 5 losses within 1e-5,
//! all within 1e-3, the toy's final parameters within 1e-4 (max |Δ|) (measured on CPU
//! devices: losses within 3.1e-7 for the convnet, 1e-7 for the toy; the toy's parameters
//! within 1.2e-7). Training runs on 1, 2 and 3 CPU devices (R = the
//! device count: only the order of the sums changes) and, where a GPU is present, on
//! `cuda:0` and `cuda:0,0`.

mod common;

use lockstep::data::safetensors_file::load_safetensors_dataset;
use lockstep::devices::Devices;
use lockstep::models::{self, ConvnetOptions, Norm};
use lockstep::nn::loss::CrossEntropy;
use lockstep::nn::{Ctx, Graph};
use lockstep::optim::OptimizerConfig;
use lockstep::train::{train_data_parallel, with_trainer, LastBatch, Shuffle, TrainConfig};
use lockstep::weights;
use lockstep::{Device, Tensor};

use common::oracle::oracle_case;
use common::{assert_close, f64s, gpu_present};

/// The reference values, built into the test (scripts/gpu-check.sh runs it where the
/// source tree is not).
fn reference() -> serde_json::Value {
    serde_json::from_str(include_str!("label_smoothing.json")).unwrap()
}

fn f32s(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

#[test]
fn the_loss_and_its_gradient_are_pytorchs() {
    let r = reference();
    let cases = r["losses"].as_array().unwrap();
    assert_eq!(cases.len(), 7, "every case of the script");
    for case in cases {
        let (k, eps) = (case["k"].as_u64().unwrap() as usize, case["eps"].as_f64().unwrap() as f32);
        let logits = f32s(&case["logits"]);
        let labels: Vec<u32> = case["labels"].as_array().unwrap().iter().map(|l| l.as_u64().unwrap() as u32).collect();
        let n = labels.len();
        let what = format!("{} eps {eps}", case["name"].as_str().unwrap());
        let ce = CrossEntropy::new(eps).unwrap();
        // Sample by sample (Metrics sums them), then the batch's gradient at once.
        let per: Vec<f32> = (0..n)
            .map(|s| {
                let row = Tensor::from_vec(logits[s * k..(s + 1) * k].to_vec(), [1, k]).unwrap();
                ce.score(&row, &labels[s..s + 1]).unwrap().loss_sum as f32
            })
            .collect();
        assert_close(&format!("{what}: loss"), &per, &f64s(&f32s(&case["loss"])), 1e-6, 1e-6);
        let x = Tensor::from_vec(logits.clone(), [n, k]).unwrap();
        let (m, dlogits) = ce.with_grad(&x, &labels).unwrap();
        let want_sum: f64 = f32s(&case["loss"]).iter().map(|&v| v as f64).sum();
        assert!((m.loss_sum - want_sum).abs() <= 1e-6 * (1.0 + want_sum.abs()), "{what}: sum {}", m.loss_sum);
        assert_close(&format!("{what}: dlogits"), dlogits.host(), &f64s(&f32s(&case["dlogits"])), 1e-6, 1e-6);
    }
    // The hand case, derived: logits [1, 2, 3], label 0, eps 0.1, p = [0.0900306,
    // 0.2447285, 0.6652410]: loss = 0.9·2.4076059 + 0.1·mean(2.4076059, 1.4076059,
    // 0.4076059) = 2.3076059; the gradient p − (0.9·onehot + 0.1/3).
    let x = Tensor::from_vec(vec![1.0, 2.0, 3.0], [1, 3]).unwrap();
    let (m, d) = CrossEntropy::new(0.1).unwrap().with_grad(&x, &[0]).unwrap();
    assert!((m.loss_sum - 2.307_605_9).abs() < 1e-6, "{}", m.loss_sum);
    let want = [0.090_030_57 - 0.9 - 0.1 / 3.0, 0.244_728_47 - 0.1 / 3.0, 0.665_240_96 - 0.1 / 3.0];
    assert_close("hand dlogits", d.host(), &want, 1e-6, 1e-6);
}

#[test]
fn no_smoothing_is_the_plain_loss_bit_for_bit_and_the_range_is_checked() {
    let mut rng = common::Rng(3);
    let x = Tensor::from_vec(rng.vec(40).iter().map(|v| 3.0 * v).collect(), [4, 10]).unwrap();
    let labels = [0, 3, 9, 5];
    let (plain, dplain) = lockstep::nn::loss::softmax_cross_entropy(&x, &labels).unwrap();
    let (zero, dzero) = CrossEntropy::new(0.0).unwrap().with_grad(&x, &labels).unwrap();
    assert_eq!(plain, zero);
    assert!(dplain.host().iter().zip(dzero.host()).all(|(a, b)| a.to_bits() == b.to_bits()));
    // Smoothing changes the loss, never the accuracy.
    let smoothed = CrossEntropy::new(0.3).unwrap().score(&x, &labels).unwrap();
    assert_ne!(smoothed.loss_sum, plain.loss_sum);
    assert_eq!((smoothed.correct, smoothed.count), (plain.correct, plain.count));
    for bad in [-0.1, 1.0, 1.5, f32::NAN, f32::INFINITY] {
        let e = CrossEntropy::new(bad).unwrap_err().to_string();
        assert!(e.contains("label smoothing") && e.contains("must be in [0, 1)"), "{bad}: {e}");
        let config = TrainConfig { label_smoothing: bad, ..TrainConfig::default() };
        assert!(config.validate().is_err(), "{bad} accepted by TrainConfig::validate");
    }
}

fn model_for(case: &str) -> Graph {
    match case.starts_with("toy") {
        true => models::toy_mlp(2, 2).unwrap(),
        false => {
            models::convnet(ConvnetOptions { norm: Norm::None, dropout: 0.0, ..ConvnetOptions::default() }).unwrap()
        }
    }
}

/// The case trained again with its label smoothing on `devices` (R = their count),
/// against PyTorch's losses and (the toy) final parameters.
fn check_training(case: &serde_json::Value, devices: &Devices) {
    let name = case["case"].as_str().unwrap();
    let model = model_for(name);
    let dir = oracle_case(name);
    let init = weights::load(&model, &dir.join("init.safetensors")).unwrap();
    let data = load_safetensors_dataset(&dir.join("data.safetensors")).unwrap();
    let want_losses = f32s(&case["losses"]);
    let optimizer = match name.starts_with("toy") {
        true => OptimizerConfig::sgd(0.5),
        false => OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
    };
    let cfg = TrainConfig {
        epochs: 1,
        max_steps: Some(want_losses.len() as u64),
        batch_size: 64,
        optimizer,
        seed: 0,
        shuffle: Shuffle::None,
        last_batch: LastBatch::Keep,
        replicas: Some(devices.len()),
        check_replicas_every: Some(1),
        initial: Some(init),
        label_smoothing: case["eps"].as_f64().unwrap() as f32,
        ..TrainConfig::default()
    };
    let report = train_data_parallel(&model, &data, None, devices, &cfg).unwrap();
    assert_eq!(report.losses.len(), want_losses.len());
    for (k, (got, &want)) in report.losses.iter().zip(&want_losses).enumerate() {
        let tol = if k < 5 { 1e-5 } else { 1e-3 };
        let d = (got - want as f64).abs();
        assert!(d <= tol, "{name} on {devices}: loss of step {k}: {got} vs PyTorch's {want} (tolerance {tol})");
    }
    if let Some(finals) = case.get("final") {
        for t in model.param_infos() {
            let want = f32s(&finals[&t.name]);
            let got = &report.weights.params[t.range.clone()];
            let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(d <= 1e-4, "{name} on {devices}: final {} differs by {d:e} (tolerance 1e-4)", t.name);
        }
    }
}

/// CPU devices 1, 2, 3, then `cuda:0` and `cuda:0,0` where a GPU is present.
fn device_sets(test: &str) -> Vec<Devices> {
    let mut sets: Vec<Devices> = (1..=3).map(|n| Devices::cpu(n, 1).unwrap()).collect();
    if gpu_present(&format!("{test} (GPU variants)")) {
        sets.extend([&[0][..], &[0, 0]].map(|o| Devices::cuda(o).unwrap()));
    }
    sets
}

#[test]
fn toy_50_steps_with_label_smoothing_match_pytorch() {
    let r = reference();
    let case = &r["training"][0];
    assert_eq!(case["case"], "toy_s0_k50_b64_w1");
    for devices in device_sets("toy_50_steps_with_label_smoothing_match_pytorch") {
        check_training(case, &devices);
    }
}

#[test]
fn convnet_nobn_20_steps_with_label_smoothing_match_pytorch() {
    let r = reference();
    let case = &r["training"][1];
    assert_eq!(case["case"], "convnet_nobn_s0_k20_b64_w1");
    for devices in device_sets("convnet_nobn_20_steps_with_label_smoothing_match_pytorch") {
        check_training(case, &devices);
    }
}

/// The held-out loss a run reports is the smoothed loss too (as PyTorch's criterion, used
/// for validation, gives it): the mean of `CrossEntropy::score` of the model's logits.
#[test]
fn evaluation_reports_the_smoothed_loss() {
    let mut model = model_for("toy");
    let data = load_safetensors_dataset(&oracle_case("toy_s0_k50_b64_w1").join("data.safetensors")).unwrap();
    let held = data.subset("held", &(0..100).collect::<Vec<_>>());
    let store = model.init(4);
    let x = Tensor::from_vec(lockstep::train::Batch::gather(&held, &(0..100).collect::<Vec<_>>()).x, [100, 2]).unwrap();
    let logits = model.forward(x, &store.params, &mut store.buffers.clone(), &Ctx::eval(Device::Cpu(0))).unwrap();
    for eps in [0.0, 0.2] {
        let want = CrossEntropy::new(eps).unwrap().score(&logits, held.labels()).unwrap();
        let config = TrainConfig { initial: Some(store.clone()), label_smoothing: eps, ..TrainConfig::default() };
        for n in [1, 3] {
            let got = with_trainer(&model, &Devices::cpu(n, 1).unwrap(), &config, |t| t.evaluate(&held, 32)).unwrap();
            assert_eq!((got.correct, got.count), (want.correct, want.count), "eps {eps} on cpu:{n}");
            let d = (got.mean_loss() - want.mean_loss()).abs();
            assert!(d <= 1e-6, "eps {eps} on cpu:{n}: held-out loss {} vs {}", got.mean_loss(), want.mean_loss());
        }
    }
}
