//! Keras's two most used callbacks in the library: early stopping on the held-out loss and
//! saving the best epoch's weights, and what a checkpoint keeps of them.
//!
//! The data make the held-out loss turn: 2-D points with RANDOM labels, so that the toy
//! MLP can only memorise its training points, and the validation loss (chance at first,
//! ln 2 ≈ 0.69) rises once it does. No expected epoch is hard-coded: the test reads the
//! best epoch off the run and checks every statement about it.

mod common;

use std::collections::BTreeMap;

use lockstep::checkpoint::{self, CheckpointPolicy, Fallback};
use lockstep::data::{Dataset, Features};
use lockstep::devices::Devices;
use lockstep::models;
use lockstep::optim::{Optimizer, OptimizerConfig};
use lockstep::train::{train_data_parallel, EarlyStopping, HeldOut, Stopped, TrainConfig};

use common::Rng;

/// `n` points uniform in [−1, 1]², labels 0/1 drawn independently of them.
fn noise(name: &str, n: usize, seed: u64) -> Dataset {
    let mut g = Rng(seed);
    let x: Vec<f32> = (0..2 * n).map(|_| g.next_f32() * 2.0 - 1.0).collect();
    let y: Vec<u32> = (0..n).map(|_| (g.next_u64() % 2) as u32).collect();
    Dataset::new(name, [2], Features::F32(x), y, 2).unwrap()
}

fn config(epochs: usize) -> TrainConfig {
    TrainConfig {
        epochs,
        batch_size: 4,
        optimizer: OptimizerConfig::sgd(0.5),
        held_out: HeldOut::Validation,
        check_replicas_every: None,
        ..TrainConfig::default()
    }
}

#[test]
fn the_run_stops_patience_epochs_after_the_best_and_saves_that_epochs_weights() {
    let (train, val) = (noise("train", 48, 1), noise("val", 32, 2));
    let model = models::toy_mlp(2, 2).unwrap();
    let devices = Devices::cpu(2, 1).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let best_file = dir.path().join("best.safetensors");
    let patience = 3;
    let stopping = TrainConfig {
        early_stopping: Some(EarlyStopping::patience(patience)),
        save_best: Some(best_file.clone()),
        ..config(100)
    };
    let r = train_data_parallel(&model, &train, Some(&val), &devices, &stopping).unwrap();
    let Stopped::EarlyStopping { best_epoch } = r.stopped else {
        panic!("no early stop in 100 epochs: {:?}", r.stopped)
    };
    // The loss falls for some epochs before the model memorises (best epoch 6, 0-based,
    // on this data), so the stop is a real one.
    assert!(best_epoch > 0);
    // It ran the best epoch and `patience` more, no further.
    assert_eq!(r.epochs.len(), best_epoch + 1 + patience);
    assert_eq!(r.best.unwrap().epoch, best_epoch);
    // The best epoch's loss is the lowest of the run; those marked best are the running
    // minima, the best epoch the last of them.
    let losses: Vec<f64> = r.epochs.iter().map(|e| e.val.unwrap().mean_loss()).collect();
    let lowest = losses.iter().cloned().fold(f64::INFINITY, f64::min);
    assert_eq!(losses[best_epoch], lowest);
    let mut running = f64::INFINITY;
    for (e, &l) in r.epochs.iter().zip(&losses) {
        assert_eq!(e.best, l < running, "epoch {}", e.epoch);
        running = running.min(l);
        assert!(e.test.is_none(), "a validation set is reported as val");
    }
    assert!(r.epochs.iter().rposition(|e| e.best) == Some(best_epoch));
    // The file holds the weights after the best epoch: those of a run that stops there
    // (the constant learning rate makes epoch b of any longer run the same).
    let shorter = train_data_parallel(&model, &train, Some(&val), &devices, &config(best_epoch + 1)).unwrap();
    assert!(lockstep::weights::load(&model, &best_file).unwrap() == shorter.weights);
}

#[test]
fn a_resumed_early_stopped_run_stops_again_and_a_checkpoint_keeps_the_best_epoch() {
    let (train, val) = (noise("train", 48, 1), noise("val", 32, 2));
    let model = models::toy_mlp(2, 2).unwrap();
    let devices = Devices::cpu(1, 1).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let policy = CheckpointPolicy {
        dir: dir.path().join("ck"),
        every: 1000,
        keep: 2,
        config: BTreeMap::from([("model".to_string(), "toy".to_string())]),
        record: None,
    };
    let stopping = TrainConfig {
        early_stopping: Some(EarlyStopping::patience(2)),
        checkpoint: Some(policy.clone()),
        ..config(100)
    };
    let r = train_data_parallel(&model, &train, Some(&val), &devices, &stopping).unwrap();
    let Stopped::EarlyStopping { best_epoch } = r.stopped else { panic!("{:?}", r.stopped) };
    let fresh = Optimizer::new(stopping.optimizer, model.params_len());
    let (resume, _, _) =
        checkpoint::load_latest(&model, &policy.dir, &policy.config, &fresh, Fallback::Refuse).unwrap().unwrap();
    // The checkpoint of the stop: after the last epoch, with the best epoch's metrics.
    assert_eq!(resume.step, r.steps);
    assert_eq!(resume.best, r.best);
    let again = train_data_parallel(
        &model,
        &train,
        Some(&val),
        &devices,
        &TrainConfig { resume: Some(resume), ..stopping.clone() },
    )
    .unwrap();
    assert_eq!(again.stopped, Stopped::EarlyStopping { best_epoch });
    assert_eq!((again.steps, again.losses.len()), (r.steps, 0));
    assert!(again.weights == r.weights);
}

#[test]
fn early_stopping_without_a_held_out_set_is_refused() {
    let model = models::toy_mlp(2, 2).unwrap();
    let cfg = TrainConfig { early_stopping: Some(EarlyStopping::patience(1)), ..config(3) };
    let e = train_data_parallel(&model, &noise("t", 8, 1), None, &Devices::cpu(1, 1).unwrap(), &cfg).unwrap_err();
    assert_eq!(e.to_string(), "invalid early stopping: monitors the held-out loss, and this run has no held-out set");
}
