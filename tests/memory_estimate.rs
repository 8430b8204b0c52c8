//! The memory estimate holds what a run really allocates (issue 19, defect 4: a spec of
//! 3,000 convolutions was estimated at 2.5 GB and reached 22 GB in its first evaluation;
//! a checkpoint was built whole in memory, uncounted). A global allocator of this test
//! binary counts the live heap bytes; each run's peak above what was live before it
//! (the data) is compared with the estimate the run was checked against, less the part
//! for the process itself (its code and stacks, which no allocator sees). The tests run
//! one at a time (a lock), so that nothing else allocates meanwhile.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use lockstep::checkpoint::CheckpointPolicy;
use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::data::Dataset;
use lockstep::devices::Devices;
use lockstep::models::{self, ConvnetOptions};
use lockstep::nn::Graph;
use lockstep::optim::Sharding;
use lockstep::train::{memory_estimate, train_data_parallel, with_trainer, Batch, TrainConfig};

#[path = "common/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::{LIVE, PEAK};

static ONE_AT_A_TIME: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// The run's peak heap bytes above those live before it, and its estimate without the
/// process's own part.
fn measured(model: &Graph, train: &Dataset, test: &Dataset, devices: &Devices, config: &TrainConfig) -> (f64, f64) {
    let estimate = memory_estimate(model, devices, config);
    let counted: u64 = estimate.parts().iter().filter(|p| p.name != "process").map(|p| p.bytes).sum();
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    train_data_parallel(model, train, Some(test), devices, config).unwrap();
    let peak = PEAK.load(Ordering::Relaxed) - base;
    (peak as f64, counted as f64)
}

fn check(what: &str, (peak, estimate): (f64, f64)) {
    let mb = |b: f64| b / 1e6;
    eprintln!("{what}: peak {:.1} MB, estimated {:.1} MB ({:.2}×)", mb(peak), mb(estimate), peak / estimate);
    assert!(
        peak <= 1.5 * estimate,
        "{what}: peak {:.1} MB is over 1.5 × the estimate {:.1} MB",
        mb(peak),
        mb(estimate)
    );
    // Nor so far over the truth that it would refuse runs that fit.
    assert!(
        2.5 * peak >= estimate,
        "{what}: the estimate {:.1} MB is over 2.5 × the peak {:.1} MB",
        mb(estimate),
        mb(peak)
    );
}

/// [`check`], and the graph families' closer bound (issue 42): the estimate within 1.5×
/// of the peak.
fn check_close(what: &str, (peak, estimate): (f64, f64)) {
    check(what, (peak, estimate));
    assert!(estimate <= 1.5 * peak, "{what}: the estimate {estimate:.0} B is over 1.5 × the peak {peak:.0} B");
}

fn digits(n: usize) -> (Dataset, Dataset) {
    let splits = load_digits(DigitsLayout::Image28).unwrap();
    let test = splits.test.unwrap();
    let (rows, held): (Vec<usize>, Vec<usize>) = ((0..n).collect(), (0..n.min(test.len())).collect());
    (splits.train.subset("train", &rows), test.subset("test", &held))
}

fn config(batch: usize) -> TrainConfig {
    TrainConfig { epochs: 1, batch_size: batch, eval_batch: 128, ..TrainConfig::default() }
}

#[test]
fn a_deep_narrow_spec_holds_its_estimate_in_training_and_evaluation() {
    let _one = ONE_AT_A_TIME.lock();
    let conv = r#"{"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same"}"#;
    let layers = vec![conv; 200].join(", ");
    let spec = format!(
        r#"{{"input_shape": [1, 28, 28], "layers": [{layers}, {{"type": "flatten"}}, {{"type": "dense", "units": 10}}]}}"#
    );
    let model = lockstep::spec::model_from_spec_str(&spec, "deep.json").unwrap();
    let (train, test) = digits(128);
    check("200 convolutions", measured(&model, &train, &test, &Devices::cpu(2, 1).unwrap(), &config(32)));
}

/// A spec's MLP on the digits: two hidden layers of `units`, ReLU, 10 classes.
fn wide_mlp(units: usize) -> Graph {
    let spec = format!(
        r#"{{"input_shape": [1, 28, 28], "layers": [{{"type": "flatten"}}, {{"type": "dense", "units": {units}}},
        {{"type": "relu"}}, {{"type": "dense", "units": {units}}}, {{"type": "relu"}}, {{"type": "dense", "units": 10}}]}}"#
    );
    lockstep::spec::model_from_spec_str(&spec, "wide.json").unwrap()
}

#[test]
fn a_wide_spec_holds_its_estimate() {
    let _one = ONE_AT_A_TIME.lock();
    let model = wide_mlp(4096);
    let (train, test) = digits(128);
    let devices = Devices::cpu(2, 1).unwrap();
    check("a wide MLP", measured(&model, &train, &test, &devices, &config(64)));
    // 20 M parameters and Adam's two moments: a checkpoint of 240 MB of tensors.
    let dir = tempfile::tempdir().unwrap();
    let with = TrainConfig { checkpoint: Some(policy(dir.path(), "wide")), ..config(64) };
    check("a wide MLP with checkpoints", measured(&model, &train, &test, &devices, &with));
}

fn policy(dir: &std::path::Path, model: &str) -> CheckpointPolicy {
    CheckpointPolicy {
        dir: dir.join("ck"),
        every: 1,
        keep: 2,
        config: BTreeMap::from([("model".to_string(), model.to_string())]),
        record: None,
    }
}

#[test]
fn the_convnet_holds_its_estimate_with_and_without_checkpoints() {
    let _one = ONE_AT_A_TIME.lock();
    let model = models::convnet(ConvnetOptions::default()).unwrap();
    let (train, test) = digits(512);
    let devices = Devices::cpu(2, 1).unwrap();
    check("the convnet", measured(&model, &train, &test, &devices, &config(64)));
    let dir = tempfile::tempdir().unwrap();
    let with = TrainConfig { checkpoint: Some(policy(dir.path(), "convnet")), ..config(64) };
    check("the convnet with checkpoints", measured(&model, &train, &test, &devices, &with));
}

/// `lines` lines of one sentence, about 55 bytes each: text for the language models.
fn text(lines: usize) -> String {
    (0..lines).map(|i| format!("line {i}: the quick brown fox jumps over {} lazy dogs.\n", i % 7)).collect()
}

#[test]
fn the_llama_holds_its_estimate() {
    let _one = ONE_AT_A_TIME.lock();
    // The built-in Llama at nanoGPT's CPU recipe's sizes (4 layers, 4 heads, 128 wide, a
    // window of 64) and batch (12), two evaluations of two batches each.
    let splits = lockstep::data::text::split_text("text", text(700).as_bytes(), 64).unwrap();
    let model = models::llama(models::LlamaConfig::default()).unwrap();
    let config = TrainConfig {
        max_steps: Some(4),
        batch_size: 12,
        eval_every: Some(2),
        eval_batches: Some(2),
        ..TrainConfig::default()
    };
    let test = splits.test.as_ref().unwrap();
    // Measured on an AVX-512 Xeon (2026-12-07): 111.2 MB estimated for an 87.8 MB peak, 1.27×.
    check_close("the llama", measured(&model, &splits.train, test, &Devices::cpu(2, 1).unwrap(), &config));
}

#[test]
fn the_densenet_holds_its_estimate() {
    // A graph whose concatenations keep every feature map of a block alive until the
    // block's last layer has read it (issue 42: within 1.5× of the peak).
    let _one = ONE_AT_A_TIME.lock();
    let model = models::densenet(&models::DensenetConfig::default()).unwrap();
    let (train, test) = digits(128);
    // Measured on an AVX-512 Xeon (2026-12-07): 304.1 MB estimated for a 255.7 MB peak, 1.19×.
    check_close("the densenet", measured(&model, &train, &test, &Devices::cpu(2, 1).unwrap(), &config(64)));
}

#[test]
fn the_final_state_is_one_copy_of_the_model_whatever_the_device_count() {
    // `Trainer::weights` (the report's final state, a checkpoint's) and `Trainer::params`
    // (the best weights) copy to the host what they keep and nothing more: replica 0's
    // weights, its optimiser state or every device's part. Each used to copy every
    // replica's weights and state and keep one: on 2 devices the wide MLP above peaked at
    // 1.2× its estimate. The heap's growth while each runs is measured on 1 and 3
    // devices, replicated and sharded: the same to 5%. Replicated it is what the
    // estimate's "final state" counts, the weights and Adam's two moments (3 models);
    // sharded, 5: the parts and the whole they are put together into.
    let _one = ONE_AT_A_TIME.lock();
    let model = wide_mlp(2048);
    let model_bytes = (model.params_len() + model.buffers_len()) as f64 * 4.0;
    let grown = |f: &mut dyn FnMut()| {
        let base = LIVE.load(Ordering::Relaxed);
        PEAK.store(base, Ordering::Relaxed);
        f();
        (PEAK.load(Ordering::Relaxed) - base) as f64
    };
    for sharding in [Sharding::Replicated, Sharding::Sharded] {
        let mut seen = Vec::new();
        for n in [1, 3] {
            let config = TrainConfig { optimizer_sharding: sharding, replicas: Some(3), ..config(6) };
            let (weights, params) = with_trainer(&model, &Devices::cpu(n, 1).unwrap(), &config, |t| {
                t.step(Batch::gather(&digits(6).0, &[0, 1, 2, 3, 4, 5]))?;
                let weights = grown(&mut || drop(t.weights().unwrap()));
                let params = grown(&mut || drop(t.params().unwrap()));
                Ok((weights, params))
            })
            .unwrap();
            let copies = (weights / model_bytes, params / model_bytes);
            eprintln!("{sharding:?} on {n} device(s): weights() grew {:.2} models, params() {:.2}", copies.0, copies.1);
            seen.push(copies);
        }
        let (one, three) = (seen[0], seen[1]);
        assert!((three.0 / one.0 - 1.0).abs() < 0.05, "{sharding:?}: weights() on 3 devices {three:?}, on 1 {one:?}");
        assert!((three.1 / one.1 - 1.0).abs() < 0.05, "{sharding:?}: params() on 3 devices {three:?}, on 1 {one:?}");
        assert!(one.1 < 1.1, "{sharding:?}: params() grew {:.2} models", one.1);
    }
}
