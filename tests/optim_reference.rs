//! The optimisers and recipes of issue 18 against PyTorch, step by step: SGD with
//! momentum and Nesterov momentum, Adam, AdamW, weight decay on the weights only (two
//! parameter groups), linear warm-up before a cosine schedule, and clipping by the
//! global gradient norm.
//!
//! The reference is tests/data/torch_optim.json, written by scripts/torch_optim.py (which
//! says exactly which torch calls made it: `torch.optim.SGD/Adam/AdamW` over the groups
//! [W] and [b], `clip_grad_norm_`, `SequentialLR(LinearLR, CosineAnnealingLR)`); CI needs
//! no PyTorch. Each case trains a weight W (3, 4) and a bias b (4) for 8 steps from the
//! same values on the same gradients; here they are one flat buffer [W | b], the
//! gradients sums over a batch of 1, the decay mask made from the two tensors' dimensions
//! as the trainer makes it, the clip factor from `GradNorm` as every replica computes it,
//! and the learning rate from `LrSchedule::scale_after_warmup`.
//!
//! Tolerances (measured, then stated with margin): every parameter after every step
//! within 2e-6 relative + 2e-7 absolute of PyTorch's (the measured worst is printed; the
//! differences are float32 rounding: PyTorch's lr is a double where ours is a float, its
//! CPU kernels fuse multiply-adds, and its norm is summed in float32 where ours is in
//! float64); the gradient norm within 1e-6 relative; the learning rate within 1e-6
//! relative.

use lockstep::optim::{
    clip_factor, DecayMask, DecayOn, GradNorm, LrSchedule, MomentumKind, Optimizer, OptimizerConfig,
};
use serde_json::Value;

const RTOL: f64 = 2e-6;
const ATOL: f64 = 2e-7;

fn reference() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/torch_optim.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("tests/data/torch_optim.json")).unwrap()
}

/// A JSON array of floats as f32 (each is the double equal to a float32: exact).
fn f32s(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn num(case: &Value, key: &str) -> f64 {
    case[key].as_f64().unwrap_or_else(|| panic!("{key}"))
}

/// The case's optimiser as lockstep configures it (`--optimizer`, `--momentum`,
/// `--nesterov`, `--weight-decay`).
fn config(case: &Value) -> OptimizerConfig {
    let (lr, wd) = (num(case, "lr") as f32, num(case, "weight_decay") as f32);
    match case["optimizer"].as_str().unwrap() {
        "sgd" => OptimizerConfig::Sgd {
            lr,
            momentum: num(case, "momentum") as f32,
            momentum_kind: if case["nesterov"].as_bool().unwrap() {
                MomentumKind::Nesterov
            } else {
                MomentumKind::Classic
            },
            weight_decay: wd,
        },
        "adam" => OptimizerConfig::Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: wd },
        "adamw" => OptimizerConfig::AdamW { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: wd },
        other => panic!("optimizer {other}"),
    }
}

/// |got − want| / (atol/rtol + |want|) as a fraction of the tolerance (≤ 1 passes).
fn worst(got: &[f32], want: &[f32]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w as f64).abs() / (ATOL + RTOL * (w as f64).abs()))
        .fold(0.0, f64::max)
}

#[test]
fn every_optimizer_and_recipe_follows_pytorch_step_by_step() {
    let r = reference();
    let total = r["steps"].as_u64().unwrap();
    let initial = f32s(&r["initial"]);
    let grads: Vec<Vec<f32>> = r["grads"].as_array().unwrap().iter().map(f32s).collect();
    assert_eq!((initial.len(), grads.len() as u64), (16, total));
    let mut clipped_cases = 0;
    for case in r["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let cfg = config(case);
        cfg.validate().unwrap();
        let on = match case["decay_on"].as_str().unwrap() {
            "weights" => DecayOn::Weights,
            _ => DecayOn::All,
        };
        // W: (3, 4) at 0..12, b: (4) at 12..16 — as `train::replica::decay_mask` reads a model.
        let mask = DecayMask::of_tensors([(0..12, 2), (12..16, 1)], on);
        let schedule = match case["cosine_floor"].as_f64() {
            Some(floor) => LrSchedule::Cosine { floor: floor as f32 },
            None => LrSchedule::Constant,
        };
        let warmup = case["warmup_steps"].as_u64().unwrap();
        let max_norm = case["clip_grad_norm"].as_f64().map(|c| c as f32);
        let mut opt = Optimizer::new(cfg, 16);
        let mut p = initial.clone();
        let (mut largest, mut rel): (f64, f64) = (0.0, 0.0);
        let mut clipped_steps = 0;
        for (step, (g, want)) in grads.iter().zip(case["steps"].as_array().unwrap()).enumerate() {
            let scale = schedule.scale_after_warmup(warmup, step as u64, total);
            let lr = cfg.lr() as f64 * scale as f64;
            let torch_lr = num(want, "lr");
            assert!(
                (lr - torch_lr).abs() <= 1e-6 * torch_lr,
                "{name}, step {step}: lr {lr} against torch's {torch_lr}"
            );
            let mut s = opt.begin_step(scale, 1.0);
            if let Some(c) = max_norm {
                let mut norm = GradNorm::default();
                norm.add(0, g, 1.0);
                let norm = norm.norm();
                let torch_norm = num(want, "norm");
                assert!(
                    (norm as f64 - torch_norm).abs() <= 1e-6 * torch_norm,
                    "{name}, step {step}: norm {norm} against torch's {torch_norm}"
                );
                s.clip = clip_factor(norm, c);
                clipped_steps += usize::from(s.clip < 1.0);
            }
            for (run, rs) in mask.split(0..16, &s) {
                opt.update(run.start, &mut p[run.clone()], &g[run], &rs);
            }
            let torch_p = f32s(&want["params"]);
            let w = worst(&p, &torch_p);
            rel = p.iter().zip(&torch_p).map(|(&a, &b)| ((a - b) as f64 / b as f64).abs()).fold(rel, f64::max);
            assert!(w <= 1.0, "{name}, step {step}: {p:?} against torch's {:?}", f32s(&want["params"]));
            largest = largest.max(w);
        }
        if max_norm.is_some() {
            assert!(clipped_steps > 0, "{name}: the case clips");
            clipped_cases += 1;
        }
        eprintln!("{name}: worst difference {largest:.2} of the tolerance ({rel:.1e} relative), {clipped_steps} steps clipped");
    }
    assert_eq!(clipped_cases, 4);
}
