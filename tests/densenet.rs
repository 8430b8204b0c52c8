//! The built-in DenseNet (`models::densenet`, a graph of concatenations) against PyTorch:
//! the reference cases of tests/data/densenet/, made by scripts/torch_densenet.py
//! (PyTorch 2.15, CPU, float32, one thread, deterministic; its docs say what each file
//! holds and how W replicas are simulated), the module scripts/torch_densenet_model.py's.
//!
//! Tolerances, per tensor, and what this machine measured (an Intel Xeon with AVX-512):
//! - a dense block of two layers and a transition (BatchNorm inside, training mode): output,
//!   input gradient, parameter gradients, running statistics: max |Δ| ≤ 1e-5 ·
//!   max(1, max |want|) (as tests/resnet.rs's blocks);
//! - the whole model, the step-0 gradients: max |Δ| ≤ 2e-3 · max(1, max |g|) (measured
//!   4.7e-6, 2.9e-6 and 3.9e-4 for W = 1, 2, 3 on an Intel Xeon with AVX-512, 2026-12-07);
//!   the 2 losses: |Δ| ≤ 2e-4 (1.5e-7, 6.5e-8, 3.0e-8); the final weights and buffers
//!   after two SGD steps of lr 0.05, momentum 0.9: max |Δ| ≤ 2e-3 (1.4e-5, 7.1e-6, 1.5e-4).
//!
//! Why the whole model's are wider than the block's: float32 itself. The script reruns
//! each case in float64; PyTorch's float32 run lies 1.1e-4, 2.9e-6 and 4.4e-4 from it in
//! the step-0 gradients (W = 1, 2, 3), 1.3e-5, 6e-8 and 3.6e-5 in the losses, 2.2e-4,
//! 5.3e-6 and 3.7e-4 in the final tensors. Most of that is a few ReLU inputs within ~1e-6
//! of zero that float32 rounds to the other side (one at step 0 for W = 1: its 1/24 share
//! of the loss then flows back, or not, through every layer before it), and lockstep's
//! float32, whose sums run in other orders, rounds other such inputs across: the two float32
//! runs then differ by up to the sum of their distances from float64. The tolerances are
//! about five times the largest measured, for other processors' orders of sums.
//!
//! Every case runs on W CPU devices with R = W logical replicas (per-replica BatchNorm:
//! W = 1, 2, 3), and with synchronized BatchNorm on 2 and 3 devices against W = 1. Then
//! the weights are bitwise alike on 1, 2 and 3 devices with R fixed.

use std::path::{Path, PathBuf};

use lockstep::data::safetensors_file::load_safetensors_dataset;
use lockstep::devices::Devices;
use lockstep::models::{dense_layer, densenet, transition, DensenetConfig};
use lockstep::nn::{Ctx, Graph, Value};
use lockstep::optim::{MomentumKind, OptimizerConfig};
use lockstep::train::{train_data_parallel, TrainConfig};
use lockstep::weights;
use lockstep::{Device, Tensor};

#[path = "common/reference_case.rs"]
mod reference_case;
use reference_case::{get, image_config as config, image_step0, max_abs, tensors};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/densenet")
}

/// max |got − want| ≤ `tol` · max(1, max |want|).
fn assert_within(what: &str, got: &[f32], want: &[f32], tol: f32) -> f32 {
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let d = max_abs(got, want);
    assert!(d <= tol * scale, "{what} differs by {d:e} (allowed {:e})", tol * scale);
    d / scale
}

/// The script's block: two dense layers of growth 4 on 8 channels, then a transition to 8,
/// named as the PyTorch module's `state_dict` names them. x: (N, 8, 8, 8) → (N, 8, 4, 4).
fn block() -> Graph {
    let x = Value::input([8, 8, 8]);
    let x = dense_layer(&x, 8, 4, "layers.denselayer1").unwrap();
    let x = dense_layer(&x, 12, 4, "layers.denselayer2").unwrap();
    transition(&x, 16, "transition").unwrap().model().unwrap()
}

#[test]
fn a_dense_block_and_its_transition_match_pytorch_forward_and_backward() {
    let all = tensors(&dir().join("block.safetensors"));
    let mut model = block();
    let mut store = model.init(0);
    for (infos, flat) in [(model.param_infos(), &mut store.params), (model.buffer_infos(), &mut store.buffers)] {
        for t in infos {
            flat[t.range.clone()].copy_from_slice(get(&all, &format!("p.{}", t.name)));
        }
    }
    let x = Tensor::from_vec(get(&all, "x").to_vec(), [4, 8, 8, 8]).unwrap();
    let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
    let y = model.forward(x, &store.params, &mut store.buffers, &ctx).unwrap();
    assert_eq!(y.shape().dims(), &[4, 8, 4, 4]);
    assert_within("y", y.host(), get(&all, "y"), BLOCK_TOL);
    let dy = Tensor::from_vec(get(&all, "dy").to_vec(), y.shape().clone()).unwrap();
    let mut grads = vec![0.0; model.params_len()];
    let dx = model.backward_input(dy, &store.params, &mut grads, &ctx).unwrap();
    // The input is read twice (by the first layer's BatchNorm and by its concatenation):
    // its gradient is the sum of the two.
    assert_within("dx", dx.host(), get(&all, "dx"), BLOCK_TOL);
    for t in model.param_infos() {
        let want = get(&all, &format!("g.{}", t.name));
        assert_within(&format!("gradient of {}", t.name), &grads[t.range.clone()], want, BLOCK_TOL);
    }
    for t in model.buffer_infos() {
        assert_within(
            &format!("buffer {}", t.name),
            &store.buffers[t.range.clone()],
            get(&all, &format!("b.{}", t.name)),
            BLOCK_TOL,
        );
    }
}

/// The tolerances of the file's docs.
const BLOCK_TOL: f32 = 1e-5;
const GRAD_TOL: f32 = 2e-3;
const LOSS_TOL: f64 = 2e-4;
const FINAL_TOL: f32 = 2e-3;

fn losses(world: usize) -> Vec<f64> {
    let text = std::fs::read_to_string(dir().join("losses.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["losses"][world.to_string()].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// The reference's images: tests/data/resnet/'s first Fashion-MNIST images.
fn data() -> lockstep::data::Dataset {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/resnet/data.safetensors");
    load_safetensors_dataset(&path).unwrap()
}

/// The reference's optimiser: PyTorch's SGD, momentum 0.9, lr 0.05.
fn sgd() -> OptimizerConfig {
    OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, momentum_kind: MomentumKind::Classic, weight_decay: 0.0 }
}

/// Step 0's gradient, the losses and the final tensors of the case of `world` replicas,
/// run as `model` on `devices`.
fn check_case(model: &Graph, devices: Devices, world: usize, replicas: usize) {
    let want = tensors(&dir().join(format!("w{world}.safetensors")));
    let grads = image_step0(model, &devices, replicas, &dir(), &data());
    let mut worst_grad = 0.0f32;
    for t in model.param_infos() {
        let d = assert_within(
            &format!("{devices}: step-0 gradient of {}", t.name),
            &grads[t.range.clone()],
            get(&want, &format!("grads_step0.{}", t.name)),
            GRAD_TOL,
        );
        worst_grad = worst_grad.max(d);
    }
    let want_losses = losses(world);
    let init = weights::load(model, &dir().join("init.safetensors")).unwrap();
    let cfg = TrainConfig { initial: Some(init), ..config(want_losses.len() as u64, replicas, sgd()) };
    let report = train_data_parallel(model, &data(), None, &devices, &cfg).unwrap();
    assert_eq!(report.losses.len(), want_losses.len());
    for (k, (got, want)) in report.losses.iter().zip(&want_losses).enumerate() {
        assert!((got - want).abs() <= LOSS_TOL, "{devices}, W = {world}: loss of step {k}: {got} vs {want}");
    }
    let worst_loss = report.losses.iter().zip(&want_losses).map(|(g, w)| (g - w).abs()).fold(0.0, f64::max);
    let mut worst = 0.0f32;
    for (infos, flat) in
        [(model.param_infos(), &report.weights.params), (model.buffer_infos(), &report.weights.buffers)]
    {
        for t in infos {
            let d = max_abs(&flat[t.range.clone()], get(&want, &format!("final.{}", t.name)));
            assert!(d <= FINAL_TOL, "{devices}, W = {world}: final {} differs by {d:e}", t.name);
            worst = worst.max(d);
        }
    }
    eprintln!(
        "{devices}, W = {world}: step-0 gradients within {worst_grad:e}, losses {worst_loss:e}, final tensors {worst:e} of PyTorch's"
    );
}

#[test]
fn densenet_on_1_2_3_replicas_matches_pytorch() {
    let model = densenet(&DensenetConfig::default()).unwrap();
    for w in 1..=3 {
        check_case(&model, Devices::cpu(w, 1).unwrap(), w, w);
    }
}

#[test]
fn densenet_with_sync_batchnorm_on_2_and_3_devices_matches_one_device() {
    let model = lockstep::nn::convert_sync_batchnorm(&densenet(&DensenetConfig::default()).unwrap()).unwrap();
    for n in 2..=3 {
        check_case(&model, Devices::cpu(n, 1).unwrap(), 1, n);
    }
}

// ---- bitwise identity with the logical replicas fixed ---------------------------------

fn digits(n: usize) -> lockstep::data::Dataset {
    use lockstep::data::digits::{load_digits, DigitsLayout};
    let d = load_digits(DigitsLayout::Image28).unwrap().train;
    d.subset("digits-subset", &(0..n).collect::<Vec<_>>())
}

/// Bitwise across 1, 2 and 3 CPU devices with R = 6: the DenseNet on the digits
/// (1×28×28), 4 steps of 12 samples, plainly and accumulating (each shard in 2
/// micro-batches): every weight, buffer and loss the same bits.
#[test]
fn densenet_is_bitwise_alike_on_1_2_3_devices() {
    let model = densenet(&DensenetConfig::default()).unwrap();
    let base = TrainConfig {
        epochs: 1,
        batch_size: 12,
        seed: 4,
        replicas: Some(6),
        optimizer: OptimizerConfig::Sgd {
            lr: 0.05,
            momentum: 0.9,
            momentum_kind: MomentumKind::Classic,
            weight_decay: 0.0,
        },
        ..TrainConfig::default()
    };
    let data = digits(48);
    for (name, cfg) in [("plain", base.clone()), ("accumulate 2", TrainConfig { accumulate: 2, ..base.clone() })] {
        let run = |n| train_data_parallel(&model, &data, None, &Devices::cpu(n, 1).unwrap(), &cfg).unwrap();
        let one = run(1);
        assert_eq!(one.losses.len(), 4, "{name}");
        assert!(one.losses.iter().all(|l| l.is_finite()), "{name}: {:?}", one.losses);
        for n in [2, 3] {
            let got = run(n);
            assert!(got.weights == one.weights, "{name}: cpu:{n} weights or buffers differ from cpu:1's");
            assert_eq!(got.losses, one.losses, "{name}: cpu:{n}");
        }
    }
}
