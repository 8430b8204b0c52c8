//! Residual networks against PyTorch: the reference cases of tests/data/resnet/, made by
//! scripts/torch_resnet.py (PyTorch 2.15, CPU, float32, deterministic; see its docs for
//! what each file holds and how W replicas are simulated).
//!
//! Tolerances (issue 18):
//! - a block's output, input gradient and parameter gradients, and step-0 gradients of
//!   resnet8: max |Δ| ≤ 1e-5 · max(1, max |want|) per tensor;
//! - the 20 losses: |Δ| ≤ 1e-5;
//! - the final weights and buffers: max |Δ| ≤ 2e-3 (the convnet cases' tolerance).
//!
//! Every case runs on W CPU devices with R = W logical replicas (per-replica BatchNorm:
//! W = 1, 2, 3), and with synchronized BatchNorm on 2 and 3 devices against W = 1 (the
//! global batch's statistics are the single device's).

use std::path::{Path, PathBuf};

use lockstep::data::safetensors_file::load_safetensors_dataset;
use lockstep::devices::Devices;
use lockstep::models::{resnet, ResnetDepth};
use lockstep::nn::{identity, residual, Activation, BatchNorm2d, Call, Conv2d, Ctx, Graph, Padding, Relu, Value};
use lockstep::optim::{MomentumKind, OptimizerConfig};
use lockstep::train::{train_data_parallel, TrainConfig};
use lockstep::weights;
use lockstep::{Device, Tensor};

#[path = "common/reference_case.rs"]
mod reference_case;
use reference_case::{get, image_config as config, image_step0, max_abs, tensors};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/resnet")
}

fn assert_within(what: &str, got: &[f32], want: &[f32]) {
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let d = max_abs(got, want);
    assert!(d <= 1e-5 * scale, "{what} differs by {d:e} (allowed {:e})", 1e-5 * scale);
}

/// The issue's `Basic(cin, cout, stride)` as a model of one lockstep block, `b`, its nodes
/// named as PyTorch names the module's (`b.conv1`, `b.short.0`).
fn basic(cin: usize, cout: usize, stride: usize, hw: usize) -> Graph {
    let conv = |c, o, k, s, p| Conv2d::new(c, o, (k, k), s, Padding::Explicit(p, p), false).unwrap();
    let x = Value::input([cin, hw, hw]);
    let body = |x: &Value| {
        let y = conv(cin, cout, 3, stride, 1).named("b.conv1").call(x);
        let y = BatchNorm2d::pytorch(cout).named("b.bn1").call(&y);
        let y = Relu::new().call(&y);
        let y = conv(cout, cout, 3, 1, 1).named("b.conv2").call(&y);
        Ok(BatchNorm2d::pytorch(cout).named("b.bn2").call(&y))
    };
    let y = if stride != 1 || cin != cout {
        let short = |x: &Value| {
            let s = conv(cin, cout, 1, stride, 0).named("b.short.0").call(x);
            Ok(BatchNorm2d::pytorch(cout).named("b.short.1").call(&s))
        };
        residual(&x, "b", body, short, Activation::Relu)
    } else {
        residual(&x, "b", body, identity, Activation::Relu)
    };
    y.unwrap().model().unwrap()
}

#[test]
fn residual_blocks_match_pytorch_forward_and_backward() {
    let all = tensors(&dir().join("blocks.safetensors"));
    for (case, mut model) in [("identity", basic(16, 16, 1, 8)), ("projection", basic(16, 32, 2, 8))] {
        let mut store = model.init(0);
        for t in model.param_infos().iter() {
            let name = t.name.strip_prefix("b.").unwrap();
            store.params[t.range.clone()].copy_from_slice(get(&all, &format!("{case}.p.{name}")));
        }
        for t in model.buffer_infos().iter() {
            let name = t.name.strip_prefix("b.").unwrap();
            store.buffers[t.range.clone()].copy_from_slice(get(&all, &format!("{case}.p.{name}")));
        }
        let x = Tensor::from_vec(get(&all, &format!("{case}.x")).to_vec(), [4, 16, 8, 8]).unwrap();
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let y = model.forward(x, &store.params, &mut store.buffers, &ctx).unwrap();
        assert_within(&format!("{case}: y"), y.host(), get(&all, &format!("{case}.y")));
        let dy_values = get(&all, &format!("{case}.dy")).to_vec();
        let dy = Tensor::from_vec(dy_values, y.shape().clone()).unwrap();
        let mut grads = vec![0.0; model.params_len()];
        let dx = model.backward_input(dy, &store.params, &mut grads, &ctx).unwrap();
        assert_within(&format!("{case}: dx"), dx.host(), get(&all, &format!("{case}.dx")));
        for t in model.param_infos() {
            let name = t.name.strip_prefix("b.").unwrap();
            assert_within(
                &format!("{case}: gradient of {name}"),
                &grads[t.range.clone()],
                get(&all, &format!("{case}.g.{name}")),
            );
        }
        for t in model.buffer_infos() {
            let name = t.name.strip_prefix("b.").unwrap();
            assert_within(
                &format!("{case}: buffer {name}"),
                &store.buffers[t.range.clone()],
                get(&all, &format!("{case}.b.{name}")),
            );
        }
    }
}

fn losses(world: usize) -> Vec<f64> {
    let text = std::fs::read_to_string(dir().join("losses.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["losses"][world.to_string()].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// The reference's optimiser: PyTorch's SGD, momentum 0.9, lr 1e-4.
fn sgd() -> OptimizerConfig {
    OptimizerConfig::Sgd { lr: 1e-4, momentum: 0.9, momentum_kind: MomentumKind::Classic, weight_decay: 0.0 }
}

/// Step 0's gradient, the 20 losses and the final tensors of the case of `world`
/// replicas, run as `model` on `devices`.
fn check_case(model: &Graph, devices: Devices, world: usize, replicas: usize) {
    let want = tensors(&dir().join(format!("w{world}.safetensors")));
    let grads = image_step0(
        model,
        &devices,
        replicas,
        &dir(),
        &load_safetensors_dataset(&dir().join("data.safetensors")).unwrap(),
    );
    for t in model.param_infos() {
        assert_within(
            &format!("{devices}: step-0 gradient of {}", t.name),
            &grads[t.range.clone()],
            get(&want, &format!("grads_step0.{}", t.name)),
        );
    }
    let want_losses = losses(world);
    let init = weights::load(model, &dir().join("init.safetensors")).unwrap();
    let data = load_safetensors_dataset(&dir().join("data.safetensors")).unwrap();
    let cfg = TrainConfig { initial: Some(init), ..config(want_losses.len() as u64, replicas, sgd()) };
    let report = train_data_parallel(model, &data, None, &devices, &cfg).unwrap();
    assert_eq!(report.losses.len(), want_losses.len());
    for (k, (got, want)) in report.losses.iter().zip(&want_losses).enumerate() {
        assert!((got - want).abs() <= 1e-5, "{devices}, W = {world}: loss of step {k}: {got} vs {want}");
    }
    for (infos, flat) in
        [(model.param_infos(), &report.weights.params), (model.buffer_infos(), &report.weights.buffers)]
    {
        for t in infos {
            let d = max_abs(&flat[t.range.clone()], get(&want, &format!("final.{}", t.name)));
            assert!(d <= 2e-3, "{devices}, W = {world}: final {} differs by {d:e}", t.name);
        }
    }
}

#[test]
fn resnet8_on_1_2_3_replicas_matches_pytorch() {
    let model = resnet(ResnetDepth::Resnet8, 10).unwrap();
    for w in 1..=3 {
        check_case(&model, Devices::cpu(w, 1).unwrap(), w, w);
    }
}

#[test]
fn resnet8_with_sync_batchnorm_on_2_and_3_devices_matches_one_device() {
    let model = lockstep::nn::convert_sync_batchnorm(&resnet(ResnetDepth::Resnet8, 10).unwrap()).unwrap();
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

/// resnet8 on the digits (1×28×28): 8 steps of 12 samples, R = 6 logical replicas, the
/// run's weights, buffers and losses.
fn r6(devices: usize, cfg: &TrainConfig) -> lockstep::train::TrainReport {
    let model = resnet(ResnetDepth::Resnet8, 10).unwrap();
    let cfg = TrainConfig { replicas: Some(6), ..cfg.clone() };
    train_data_parallel(&model, &digits(48), None, &Devices::cpu(devices, 1).unwrap(), &cfg).unwrap()
}

/// Bitwise across 1, 2 and 3 CPU devices with R = 6, for each DDP feature: plain, with
/// accumulation (each shard in 2 micro-batches), 16-bit gradients (bf16, fp16) and the
/// sharded optimiser (Adam and SGD with momentum).
#[test]
fn resnet8_is_bitwise_alike_on_1_2_3_devices_with_every_ddp_feature() {
    use lockstep::exchange::codec::Compression;
    use lockstep::optim::Sharding;
    let base = TrainConfig {
        epochs: 2,
        batch_size: 12,
        seed: 4,
        optimizer: OptimizerConfig::Sgd {
            lr: 0.05,
            momentum: 0.9,
            momentum_kind: MomentumKind::Classic,
            weight_decay: 0.0,
        },
        ..TrainConfig::default()
    };
    let features: [(&str, TrainConfig); 5] = [
        ("plain", base.clone()),
        ("accumulate 2", TrainConfig { accumulate: 2, ..base.clone() }),
        ("bf16 gradients", TrainConfig { grad_compression: Compression::Bf16, ..base.clone() }),
        ("fp16 gradients", TrainConfig { grad_compression: Compression::Fp16, ..base.clone() }),
        (
            "sharded Adam",
            TrainConfig {
                optimizer_sharding: Sharding::Sharded,
                optimizer: OptimizerConfig::adam(1e-3),
                ..base.clone()
            },
        ),
    ];
    for (name, cfg) in features {
        let one = r6(1, &cfg);
        assert_eq!(one.losses.len(), 8, "{name}");
        for n in [2, 3] {
            let got = r6(n, &cfg);
            assert!(got.weights == one.weights, "{name}: cpu:{n} weights or buffers differ from cpu:1's");
            assert_eq!(got.losses, one.losses, "{name}: cpu:{n}");
        }
    }
}

/// num_batches_tracked counts the training forwards exactly, averaged over R = 6 or 7
/// logical replicas (1/7 is one of the scales the f32 average is off an ulp by), and
/// saves as PyTorch's int64.
#[test]
fn num_batches_tracked_counts_steps_and_saves_as_int64() {
    let model = resnet(ResnetDepth::Resnet8, 10).unwrap();
    for r in [6, 7] {
        let cfg = TrainConfig { epochs: 1, batch_size: 14, replicas: Some(r), ..TrainConfig::default() };
        let report = train_data_parallel(&model, &digits(14 * 5), None, &Devices::cpu(1, 1).unwrap(), &cfg).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        weights::save(&model, &report.weights, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor("blocks.1.short.1.num_batches_tracked").unwrap();
        assert_eq!((t.dtype(), t.shape()), (safetensors::Dtype::I64, &[][..]));
        assert_eq!(i64::from_le_bytes(t.data().try_into().unwrap()), 5, "R = {r}");
        // And it loads back.
        let again = weights::load(&model, &path).unwrap();
        let info = model.buffer_infos().iter().find(|t| t.name == "stem.1.num_batches_tracked").unwrap();
        assert_eq!(again.buffers[info.range.clone()], [5.0]);
    }
}

/// A residual block the spec cannot build is one `error:` line naming the block (its
/// place in `layers`, and inside the block the branch's own) and both shapes, exit 2.
#[test]
fn bad_residual_specs_are_one_error_line_with_exit_2() {
    let cases = [
        (
            r#"{"input_shape": [1, 28, 28], "layers": [{"type": "conv2d", "filters": 8, "kernel_size": 3, "padding": 1},
              {"type": "residual", "layers": [{"type": "conv2d", "filters": 16, "kernel_size": 3, "strides": 2, "padding": 1}]},
              {"type": "flatten"}, {"type": "dense", "units": 10}]}"#,
            "layer 1 (residual): the body's output (16, 14, 14) differs from the input (the identity shortcut) (8, 28, 28): they are added",
        ),
        (
            r#"{"input_shape": [1, 8, 8], "layers": [{"type": "residual",
              "layers": [{"type": "conv2d", "filters": 4, "kernel_size": 3, "strides": 2, "padding": 1}],
              "shortcut": [{"type": "conv2d", "filters": 4, "kernel_size": 1}]}, {"type": "flatten"}, {"type": "dense", "units": 2}]}"#,
            "layer 0 (residual): the body's output (4, 4, 4) differs from the shortcut's output (4, 8, 8): they are added",
        ),
        (
            r#"{"input_shape": [4], "layers": [{"type": "residual", "layers": [{"type": "dense", "units": 4}],
              "shortcut": [{"type": "dense", "units": 4}]}, {"type": "dense", "units": 2}]}"#,
            "layer 0 (residual): a shortcut of layers needs images (C, H, W) in, got samples of shape (4)",
        ),
        (
            r#"{"input_shape": [1, 8, 8], "layers": [{"type": "residual", "layers": [{"type": "relu"},
              {"type": "residual", "layers": [{"type": "conv2d", "filters": 1, "kernel_size": 3, "padding": 3}]}]}]}"#,
            "layer 0 (residual): layers[1] (residual): layers[0] (conv2d): invalid Conv2d: padding 3x3 must be less than the 3x3 kernel on each side",
        ),
        (
            r#"{"input_shape": [1, 8, 8], "layers": [{"type": "residual", "layers": []}]}"#,
            "layer 0 (residual): field 'layers' is empty: the body needs at least one layer",
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (i, (spec, want)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("bad{i}.json"));
        std::fs::write(&path, spec).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
            .args(["train", "--model", path.to_str().unwrap()])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert_eq!(stderr.trim_end(), format!("error: {}: {want}", path.display()));
    }
}
