//! Exact resume: a run continued from any of its checkpoints ends with bitwise the
//! weights of the run that was never interrupted, on the same or another number of CPU
//! devices (the logical replicas fixed), BatchNorm and dropout included; and a run
//! stopped on request writes a checkpoint and says where.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use lockstep::checkpoint::{self, CheckpointPolicy, Fallback};
use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::data::Dataset;
use lockstep::devices::Devices;
use lockstep::models::{self, ConvnetOptions};
use lockstep::nn::Graph;
use lockstep::optim::{LrSchedule, Optimizer};
use lockstep::train::{train_data_parallel, train_data_parallel_with, Observer, StepEvent, Stopped, TrainConfig};

/// A checkpoint directory inside a temporary one, removed with the guard.
fn tmp() -> (tempfile::TempDir, PathBuf) {
    let guard = tempfile::tempdir().unwrap();
    let d = guard.path().join("ck");
    (guard, d)
}

fn setup() -> (Graph, Dataset, TrainConfig) {
    let model = models::convnet(ConvnetOptions::default()).unwrap(); // BatchNorm and dropout 0.5
    let data = load_digits(DigitsLayout::Image28).unwrap().train;
    let data = data.subset("digits-100", &(0..100).collect::<Vec<_>>());
    // 100 samples, batch 24: 5 steps per epoch (the last one has 4 samples), 3 epochs.
    let cfg = TrainConfig {
        epochs: 3,
        batch_size: 24,
        replicas: Some(2),
        seed: 9,
        schedule: LrSchedule::Cosine { floor: 0.1 },
        check_replicas_every: Some(1),
        ..TrainConfig::default()
    };
    (model, data, cfg)
}

fn policy(dir: &std::path::Path, every: u64) -> CheckpointPolicy {
    let config = BTreeMap::from([("model".to_string(), "convnet".to_string()), ("replicas".into(), "2".into())]);
    CheckpointPolicy { dir: dir.to_path_buf(), every, keep: 100, config, record: None }
}

#[test]
fn resuming_from_every_checkpoint_gives_bitwise_the_uninterrupted_weights() {
    let (model, data, cfg) = setup();
    let (_guard, dir) = tmp();
    let full = train_data_parallel(
        &model,
        &data,
        None,
        &Devices::cpu(2, 1).unwrap(),
        &TrainConfig { checkpoint: Some(policy(&dir, 1)), ..cfg.clone() },
    )
    .unwrap();
    assert_eq!(full.steps, 15);
    let files = checkpoint::list(&dir).unwrap();
    assert_eq!(files.iter().map(|(s, _)| *s).collect::<Vec<_>>(), (1..=15).collect::<Vec<_>>());
    let fresh = Optimizer::new(cfg.optimizer, model.params_len());
    // Mid-epoch (3, 7), an epoch boundary (5, 10), the step before the end (14); on
    // 1, 2 and 1 devices with 2 threads.
    for (step, devices) in
        [(3, Devices::cpu(1, 1)), (5, Devices::cpu(2, 1)), (7, Devices::cpu(1, 2)), (14, Devices::cpu(2, 1))]
    {
        let path = &files.iter().find(|(s, _)| *s == step).unwrap().1;
        let resume = checkpoint::load(&model, path, &policy(&dir, 1).config, &fresh).unwrap();
        let rest = train_data_parallel(
            &model,
            &data,
            None,
            &devices.unwrap(),
            &TrainConfig { resume: Some(resume), ..cfg.clone() },
        )
        .unwrap();
        assert_eq!(rest.steps, 15);
        assert!(rest.weights == full.weights, "resumed from step {step}: weights differ");
        assert!(rest.optimizer == full.optimizer, "resumed from step {step}: optimiser state differs");
        assert_eq!(rest.losses[..], full.losses[step as usize..], "resumed from step {step}: losses differ");
        // The epoch the run resumed into reports all of its steps (the checkpoint carries
        // the sums of those before the resume), bitwise the uninterrupted run's: the same
        // additions in the same order.
        let first = &rest.epochs[0];
        let reference = &full.epochs[first.epoch];
        assert_eq!(first.train, reference.train, "resumed from step {step}: the epoch's training metrics");
        assert_eq!((first.steps, reference.steps), (5, 5), "resumed from step {step}");
    }
}

/// The recipes of issue 18 (SGD with Nesterov momentum, weight decay on the weights only,
/// a warm-up of 4 steps before the cosine, clipping by the global norm, the sharded
/// optimiser) resume exactly: from inside the warm-up (step 2), at its end (4) and past
/// it (9), on other device counts, sharded or not.
#[test]
fn the_recipes_of_issue_18_resume_bitwise() {
    let (model, data, cfg) = setup();
    let optimizer = lockstep::optim::OptimizerConfig::Sgd {
        lr: 0.05,
        momentum: 0.9,
        momentum_kind: lockstep::optim::MomentumKind::Nesterov,
        weight_decay: 5e-4,
    };
    let cfg = TrainConfig {
        optimizer,
        warmup_steps: 4,
        clip_grad_norm: Some(0.3),
        optimizer_sharding: lockstep::optim::Sharding::Sharded,
        ..cfg
    };
    let (_guard, dir) = tmp();
    let full = train_data_parallel(
        &model,
        &data,
        None,
        &Devices::cpu(2, 1).unwrap(),
        &TrainConfig { checkpoint: Some(policy(&dir, 1)), ..cfg.clone() },
    )
    .unwrap();
    let unclipped = train_data_parallel(
        &model,
        &data,
        None,
        &Devices::cpu(2, 1).unwrap(),
        &TrainConfig { clip_grad_norm: None, ..cfg.clone() },
    )
    .unwrap();
    assert!(unclipped.weights != full.weights, "the clip is in force");
    let files = checkpoint::list(&dir).unwrap();
    let fresh = Optimizer::new(cfg.optimizer, model.params_len());
    for (step, devices, sharding) in [
        (2, Devices::cpu(1, 1), lockstep::optim::Sharding::Replicated),
        (4, Devices::cpu(2, 1), lockstep::optim::Sharding::Sharded),
        (9, Devices::cpu(1, 2), lockstep::optim::Sharding::Sharded),
    ] {
        let path = &files.iter().find(|(s, _)| *s == step).unwrap().1;
        let resume = checkpoint::load(&model, path, &policy(&dir, 1).config, &fresh).unwrap();
        let rest = train_data_parallel(
            &model,
            &data,
            None,
            &devices.unwrap(),
            &TrainConfig { resume: Some(resume), optimizer_sharding: sharding, ..cfg.clone() },
        )
        .unwrap();
        assert!(rest.weights == full.weights, "resumed from step {step}: weights differ");
        assert!(rest.optimizer == full.optimizer, "resumed from step {step}: optimiser state differs");
        assert_eq!(rest.losses[..], full.losses[step as usize..], "resumed from step {step}: losses differ");
    }
}

/// Raises the stop flag after a given step, as the SIGINT handler does.
struct StopAfter(u64, Arc<AtomicBool>);
impl Observer for StopAfter {
    fn on_step(&mut self, e: &StepEvent<'_>) {
        if e.report.step + 1 == self.0 {
            self.1.store(true, Ordering::SeqCst);
        }
    }
}

#[test]
fn a_stopped_run_writes_a_checkpoint_and_resumes_exactly() {
    let (model, data, cfg) = setup();
    let reference = train_data_parallel(&model, &data, None, &Devices::cpu(2, 1).unwrap(), &cfg).unwrap();
    let (_guard, dir) = tmp();
    let flag = Arc::new(AtomicBool::new(false));
    let stopping = TrainConfig { checkpoint: Some(policy(&dir, 1000)), stop: Some(flag.clone()), ..cfg.clone() };
    let stopped =
        train_data_parallel_with(&model, &data, None, &Devices::cpu(2, 1).unwrap(), &stopping, &mut StopAfter(6, flag))
            .unwrap();
    // The report of a stopped run: its weights at step 6, and where its checkpoint went.
    assert_eq!(stopped.steps, 6);
    let Stopped::Interrupted { checkpoint: Some(path), .. } = &stopped.stopped else { panic!("{:?}", stopped.stopped) };
    assert!(path.ends_with("checkpoint-000000000006.safetensors"), "{}", path.display());
    let fresh = Optimizer::new(cfg.optimizer, model.params_len());
    let (resume, found, _) =
        checkpoint::load_latest(&model, &dir, &policy(&dir, 1000).config, &fresh, Fallback::Refuse).unwrap().unwrap();
    assert_eq!(&found, path);
    let rest = train_data_parallel(
        &model,
        &data,
        None,
        &Devices::cpu(1, 1).unwrap(),
        &TrainConfig { resume: Some(resume), ..cfg },
    )
    .unwrap();
    assert!(rest.weights == reference.weights);
}

/// `max_duration`: a run past its time stops at the step boundary with a checkpoint and
/// says so; a limit of zero stops after every step, so a run of 15 steps is trained here
/// as 15 runs, on 1 and 2 devices in turn, each resumed from the last one's checkpoint,
/// and ends with bitwise the weights of the run never stopped.
#[test]
fn a_run_stopped_at_its_time_limit_after_every_step_resumes_to_the_same_weights() {
    let (model, data, cfg) = setup();
    let reference = train_data_parallel(&model, &data, None, &Devices::cpu(2, 1).unwrap(), &cfg).unwrap();
    let (_guard, dir) = tmp();
    let fresh = Optimizer::new(cfg.optimizer, model.params_len());
    let mut resume = None;
    for run in 1..=15u64 {
        let devices = Devices::cpu(1 + (run as usize % 2), 1).unwrap();
        let limited = TrainConfig {
            checkpoint: Some(policy(&dir, 1000)),
            max_duration: Some(std::time::Duration::ZERO),
            resume: resume.take(),
            ..cfg.clone()
        };
        let r = train_data_parallel(&model, &data, None, &devices, &limited).unwrap();
        assert_eq!(r.steps, run);
        if run == 15 {
            // The last step ends the run, time or not: it is complete.
            assert_eq!(r.stopped, Stopped::Completed);
            assert!(r.weights == reference.weights, "the weights differ from the run never stopped");
            assert!(r.optimizer == reference.optimizer);
            break;
        }
        let Stopped::TimeLimit { checkpoint: Some(path) } = &r.stopped else { panic!("run {run}: {:?}", r.stopped) };
        assert!(path.ends_with(format!("checkpoint-{run:012}.safetensors")), "{}", path.display());
        assert!(r.to_string().ends_with(&format!("; stopped at the time limit, checkpoint {}", path.display())));
        let (state, found, _) =
            checkpoint::load_latest(&model, &dir, &policy(&dir, 1000).config, &fresh, Fallback::Refuse)
                .unwrap()
                .unwrap();
        assert_eq!(&found, path);
        resume = Some(state);
    }
    // A limit not reached changes nothing.
    let roomy = TrainConfig { max_duration: Some(std::time::Duration::from_secs(3600)), ..cfg.clone() };
    let r = train_data_parallel(&model, &data, None, &Devices::cpu(2, 1).unwrap(), &roomy).unwrap();
    assert_eq!(r.stopped, Stopped::Completed);
    assert!(r.weights == reference.weights);
}

#[test]
fn a_position_that_is_not_one_of_this_run_is_refused() {
    let (model, data, cfg) = setup();
    let optimizer = Optimizer::new(cfg.optimizer, model.params_len());
    // 5 steps per epoch: step 7 is epoch 1, step 2 in it — not epoch 1, step 3.
    let resume = lockstep::checkpoint::Resume::at(model.init(9), optimizer, 7, 1, 3);
    let err = match train_data_parallel(
        &model,
        &data,
        None,
        &Devices::cpu(1, 1).unwrap(),
        &TrainConfig { resume: Some(resume), ..cfg },
    ) {
        Ok(_) => panic!("an inconsistent position must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("is not a position of this run (5 steps per epoch)"), "{err}");
}
