//! The transformer against PyTorch and against itself: the reference cases of
//! tests/data/gpt/, made by scripts/torch_gpt.py with this project's PyTorch GPT
//! (scripts/torch_gpt_model.py, nanoGPT's architecture) and its `configure_optimizers`
//! (see the script's docs for what each file holds).
//!
//! Tolerances (issue 21):
//! - every new layer's output, input gradient and parameter gradients at step 0:
//!   max |Δ| ≤ 1e-5 · max(1, max |want|) per tensor (the reference is float64 of the
//!   same float32 inputs);
//! - the GPT's 20 losses on W = 1, 2, 3 replicas: |Δ| ≤ 1e-5 · max(1, |want|);
//! - its final weights: max |Δ| ≤ 2e-3 (the convnet and ResNet cases' tolerance; AdamW
//!   divides by √v, so an ulp of a small gradient moves a weight by up to lr).
//!
//! And bitwise identity with the logical replicas fixed (R = 3 on 1 and 3 CPU devices),
//! plain and through accumulation, bf16 gradients and the sharded optimiser.

use std::path::{Path, PathBuf};

use lockstep::devices::Devices;
use lockstep::models::{gpt, GptConfig};
use lockstep::nn::{Ctx, Graph};
use lockstep::optim::Sharding;
use lockstep::spec::ModelSpec;
use lockstep::train::{train_data_parallel, Shuffle, TrainConfig};
use lockstep::weights;
use lockstep::{Device, Tensor};

#[path = "common/reference_case.rs"]
mod reference_case;
use reference_case::{get, reference_config, reference_rows, state_dict, tensors};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gpt")
}

fn assert_within(what: &str, got: &[f32], want: &[f32], rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let d = got.iter().zip(want).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
    assert!(d <= rtol * scale, "{what} differs by {d:e} (allowed {:e})", rtol * scale);
}

/// One layer case: the layers of `spec_layers` (a spec's layer list, its layers named so
/// that their tensors are `<name>.<suffix>` as the case's `param.<name>.<suffix>`)
/// forward `x` and backward `dy`, against PyTorch's `y`, `dx` and `grad.*`. A layer
/// named `m` is the case's module itself: its tensors are the case's without the prefix.
fn layer_case(case: &str, input_shape: &str, spec_layers: &str, ids: bool) {
    let all = tensors(&dir().join(format!("layer_{case}.safetensors")));
    let spec = format!(r#"{{"input_shape": {input_shape}, "layers": {spec_layers}}}"#);
    let mut model = ModelSpec::parse(&spec, case).unwrap().build().unwrap();
    let mut store = model.init(0);
    for t in model.param_infos() {
        let want = get(&all, &format!("param.{}", t.name.strip_prefix("m.").unwrap_or(&t.name)));
        store.params[t.range.clone()].copy_from_slice(want);
    }
    let (_, xshape, x) = all.iter().find(|(n, ..)| n == "x").unwrap().clone();
    let x = Tensor::from_vec(x, xshape).unwrap();
    let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
    let y = model.forward(x, &store.params, &mut store.buffers, &ctx).unwrap();
    assert_within(&format!("{case}: y"), y.host(), get(&all, "y"), 1e-5);
    let dy = get(&all, "dy").to_vec();
    let dy = Tensor::from_vec(dy, y.shape().clone()).unwrap();
    let mut grads = vec![0.0f32; model.params_len()];
    if ids {
        model.backward(dy, &store.params, &mut grads, &ctx).unwrap();
    } else {
        let dx = model.backward_input(dy, &store.params, &mut grads, &ctx).unwrap();
        assert_within(&format!("{case}: dx"), dx.host(), get(&all, "dx"), 1e-5);
    }
    for t in model.param_infos() {
        let want = get(&all, &format!("grad.{}", t.name.strip_prefix("m.").unwrap_or(&t.name)));
        assert_within(&format!("{case}: grad {}", t.name), &grads[t.range.clone()], want, 1e-5);
    }
}

#[test]
fn layer_norm_matches_pytorch() {
    layer_case("layer_norm", "[5, 8]", r#"[{"type": "layer_norm", "name": "m"}]"#, false);
}

#[test]
fn embedding_matches_pytorch_and_sums_repeated_ids() {
    layer_case("embedding", "[5]", r#"[{"type": "embedding", "vocab": 11, "width": 8, "name": "m"}]"#, true);
}

#[test]
fn positional_embedding_matches_pytorch() {
    layer_case("positional", "[5, 8]", r#"[{"type": "positional_embedding", "length": 7, "name": "m"}]"#, false);
}

#[test]
fn causal_self_attention_matches_nanogpt() {
    layer_case("attention", "[5, 8]", r#"[{"type": "causal_self_attention", "heads": 2, "name": "m"}]"#, false);
}

#[test]
fn dense_over_the_last_dimension_matches_pytorch() {
    layer_case("dense", "[5, 8]", r#"[{"type": "dense", "units": 6, "name": "m"}]"#, false);
}

#[test]
fn a_tied_head_sums_both_uses_of_its_table() {
    let layers = r#"[{"type": "embedding", "vocab": 11, "width": 8, "name": "wte"},
        {"type": "dense", "units": 11, "use_bias": false, "tied_to": "wte.weight", "name": "head"}]"#;
    layer_case("tied_head", "[5]", layers, true);
}

/// The reference GPT: block 16, vocab 256, 2 layers, 2 heads, 32 wide, no dropout.
fn small_gpt() -> Graph {
    gpt(GptConfig { context: 16, vocab: 256, layers: 2, heads: 2, width: 32, dropout: 0.0 }).unwrap()
}

struct Tmp(PathBuf);
impl Tmp {
    fn new(tag: &str) -> Tmp {
        let p = std::env::temp_dir().join(format!("lockstep-gpt-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Tmp(p)
    }
}
impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn the_gpt_trains_as_nanogpt_on_one_two_and_three_replicas() {
    let tmp = Tmp::new("ref");
    let all = tensors(&dir().join("gpt.safetensors"));
    let model = small_gpt();
    let data = reference_rows(&all, &tmp.0);
    // The state_dict loads by name, `lm_head.weight` as the alias of the tied table.
    let initial = weights::load(&model, &state_dict(&all, "init.", &tmp.0.join("init.safetensors"))).unwrap();
    let want_losses = get(&all, "losses");
    for w in [1, 2, 3] {
        let report = train_data_parallel(
            &model,
            &data,
            None,
            &Devices::cpu(w, 1).unwrap(),
            &reference_config(initial.clone(), w),
        )
        .unwrap();
        assert_eq!(report.losses.len(), 20);
        for (step, (&got, &want)) in report.losses.iter().zip(want_losses).enumerate() {
            let d = (got - want as f64).abs();
            assert!(d <= 1e-5 * (want as f64).abs().max(1.0), "W = {w}, step {step}: loss {got} vs nanoGPT's {want}");
        }
        let path = tmp.0.join(format!("final-{w}.safetensors"));
        weights::save(&model, &report.weights, &path).unwrap();
        let ours = tensors(&path);
        for (name, _, want) in all.iter().filter_map(|(n, s, v)| n.strip_prefix("final.").map(|k| (k, s, v))) {
            let d = get(&ours, name).iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(d <= 2e-3, "W = {w}: {name} differs from nanoGPT's by {d:e}");
        }
    }
}

#[test]
fn the_gpt_is_bitwise_the_same_on_one_and_three_devices_with_the_replicas_fixed() {
    let tmp = Tmp::new("bitwise");
    let all = tensors(&dir().join("gpt.safetensors"));
    let model = small_gpt();
    let data = reference_rows(&all, &tmp.0);
    let initial = model.init(3);
    type Variant = fn(TrainConfig) -> TrainConfig;
    let variants: [(&str, Variant); 4] = [
        ("plain", |c| c),
        ("accumulate 2", |c| TrainConfig { accumulate: 2, ..c }),
        ("bf16 gradients", |c| TrainConfig { grad_compression: lockstep::exchange::codec::Compression::Bf16, ..c }),
        ("sharded optimiser", |c| TrainConfig { optimizer_sharding: Sharding::Sharded, ..c }),
    ];
    for (what, variant) in variants {
        let config = variant(TrainConfig { shuffle: Shuffle::Seeded, ..reference_config(initial.clone(), 3) });
        let run = |devices: usize| {
            train_data_parallel(&model, &data, None, &Devices::cpu(devices, 1).unwrap(), &config).unwrap()
        };
        let (one, three) = (run(1), run(3));
        assert_eq!(one.losses, three.losses, "{what}: losses");
        assert!(one.weights == three.weights, "{what}: the weights differ between cpu:1 and cpu:3 with R = 3");
    }
}

#[test]
fn the_built_in_gpt_has_nanogpts_parameters_and_names() {
    let model = gpt(GptConfig::default()).unwrap();
    // sum(p.numel() for p in GPT(...).parameters()) for the CPU recipe, the tied table
    // once: 4·(2·256 + 128·384 + 384 + 128·128 + 128 + 128·512 + 512 + 512·128 + 128)
    // + 256·128 + 64·128 + 256 = 834,304.
    assert_eq!(model.num_params(), 834_304);
    let names: Vec<&str> = model.param_infos().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(&names[..2], ["transformer.wte.weight", "transformer.wpe.weight"]);
    for n in ["transformer.h.3.ln_1.weight", "transformer.h.0.attn.c_attn.bias", "transformer.h.2.mlp.c_proj.weight"] {
        assert!(names.contains(&n), "{n} in {names:?}");
    }
    assert_eq!(names.last(), Some(&"transformer.ln_f.bias"));
    assert_eq!(model.aliases(), &[("lm_head.weight".to_string(), 0)]);
    assert_eq!(model.output_shape().dims(), &[64, 256]);
}

#[test]
fn examples_gpt_json_builds_the_built_in_gpt() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/gpt.json");
    let spec = ModelSpec::from_file(&path).unwrap().build().unwrap();
    let builtin = gpt(GptConfig::default()).unwrap();
    let infos =
        |m: &Graph| m.param_infos().iter().map(|t| (t.name.clone(), t.shape.clone(), t.init)).collect::<Vec<_>>();
    assert_eq!(infos(&spec), infos(&builtin));
    assert_eq!(spec.aliases(), builtin.aliases());
    assert_eq!(spec.init(5), builtin.init(5), "the same initial weights from one seed");
}
