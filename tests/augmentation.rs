//! Data augmentation (`TrainConfig::augment`, `train --augment crop=P,flip`): the pixels a
//! crop and a flip make of a known image (derived by hand below), the draw as a function
//! of (seed, epoch, sample index) alone — whatever the row, the batch or the process that
//! gathers the sample — and training with augmentation (and label smoothing) bitwise
//! identical on 1, 2 and 3 CPU devices with the logical replicas fixed, and through a
//! resume from a checkpoint.

use std::collections::BTreeMap;

use lockstep::checkpoint::{self, CheckpointPolicy};
use lockstep::data::augment::{augment_image, Augment, Draw, Flip};
use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::data::{Dataset, Features};
use lockstep::devices::Devices;
use lockstep::models::{self, ConvnetOptions};
use lockstep::nn::Graph;
use lockstep::optim::{LrSchedule, Optimizer};
use lockstep::train::{train_data_parallel, Batch, TrainConfig, TrainReport};

/// A 2 × 3 × 4 image (C, H, W): channel 0 holds 1..=12 row by row, channel 1 101..=112.
fn image() -> Vec<f32> {
    (1..=12).chain(101..=112).map(|v| v as f32).collect()
}

fn augmented(x: &[f32], padding: usize, draw: Draw) -> Vec<f32> {
    let mut out = vec![f32::NAN; x.len()];
    augment_image(x, &mut out, (2, 3, 4), padding, draw);
    out
}

#[test]
fn a_crop_and_a_flip_of_a_known_image_give_the_expected_pixels() {
    let x = image();
    let draw = |dy, dx, flip| Draw { dy, dx, flip };
    // Padding 1: the padded image is 5 × 6; the window at (dy, dx) = (1, 1) is the image.
    assert_eq!(augmented(&x, 1, draw(1, 1, Flip::None)), x);
    // Window at row 0, column 2: out[i][j] = x[i − 1][j + 1], 0 outside the image.
    #[rustfmt::skip]
    let want = [
        0., 0., 0., 0.,      2., 3., 4., 0.,      6., 7., 8., 0.,
        0., 0., 0., 0.,      102., 103., 104., 0., 106., 107., 108., 0.,
    ];
    assert_eq!(augmented(&x, 1, draw(0, 2, Flip::None)), want);
    // The same window, then mirrored: each row of it reversed.
    #[rustfmt::skip]
    let want = [
        0., 0., 0., 0.,      0., 4., 3., 2.,      0., 8., 7., 6.,
        0., 0., 0., 0.,      0., 104., 103., 102., 0., 108., 107., 106.,
    ];
    assert_eq!(augmented(&x, 1, draw(0, 2, Flip::Horizontal)), want);
    // Window at row 2, column 0: out[i][j] = x[i + 1][j − 1].
    #[rustfmt::skip]
    let want = [
        0., 5., 6., 7.,      0., 9., 10., 11.,    0., 0., 0., 0.,
        0., 105., 106., 107., 0., 109., 110., 111., 0., 0., 0., 0.,
    ];
    assert_eq!(augmented(&x, 1, draw(2, 0, Flip::None)), want);
    // A flip without a crop mirrors each row.
    #[rustfmt::skip]
    let want = [
        4., 3., 2., 1.,      8., 7., 6., 5.,      12., 11., 10., 9.,
        104., 103., 102., 101., 108., 107., 106., 105., 112., 111., 110., 109.,
    ];
    assert_eq!(augmented(&x, 0, draw(0, 0, Flip::Horizontal)), want);
    // Padding 4 around a 3 × 4 image: the corner window (0, 0) lies wholly in the padding.
    assert_eq!(augmented(&x, 4, draw(0, 0, Flip::None)), vec![0.0; 24]);
}

/// Ten 1 × 4 × 4 u8 images: image s holds 16·s + 1 ..= 16·s + 16 (raw 0..255 values).
fn tiny_images() -> Dataset {
    let pixels: Vec<u8> = (0..160).map(|v| (v + 1) as u8).collect();
    Dataset::new("tiny", [1, 4, 4], Features::U8(pixels), (0..10).map(|i| i % 3).collect(), 3).unwrap()
}

#[test]
fn a_samples_augmentation_is_a_function_of_seed_epoch_and_its_index_alone() {
    let data = tiny_images();
    let a = Augment::parse("crop=2,flip").unwrap();
    let plain = Batch::gather(&data, &(0..10).collect::<Vec<_>>());
    let expected = |seed: u64, epoch: usize, i: usize| {
        let mut out = vec![f32::NAN; 16];
        augment_image(&plain.x[i * 16..(i + 1) * 16], &mut out, (1, 4, 4), 2, a.draw(seed, epoch, i));
        out
    };
    // Sample 7 twice, sample 2 between: each row is its sample's own augmentation, the
    // pixels raw (the u8 values as f32) and the padding a raw 0.
    let b = Batch::gather_augmented(&data, &[7, 2, 7], &a, 5, 1);
    assert_eq!(b.y, vec![1, 2, 1]);
    for (row, &i) in [7, 2, 7].iter().enumerate() {
        assert_eq!(b.x[row * 16..(row + 1) * 16], expected(5, 1, i)[..], "row {row} (sample {i})");
    }
    assert!(b.x.iter().all(|&v| v == 0.0 || (1.0..=160.0).contains(&v) && v.fract() == 0.0));
    // Gathered alone, or as the rows one process of several holds, a sample is augmented
    // alike: the rows of an epoch's batch are the same whoever gathers them. A batch of 6
    // over 6 logical replicas, one row each: each of 3 processes holds 2 of them (rows
    // 0..2, 2..4, 4..6), the second of 2 processes holds 3 (rows 3..6); which process
    // holds which rows is the crate's (train::processes' own tests).
    let order = [3, 9, 0, 4, 8, 1];
    let whole = Batch::gather_augmented(&data, &order, &a, 5, 1);
    for rows in [0..2, 2..4, 4..6, 3..6] {
        let part = Batch::gather_augmented(&data, &order[rows.clone()], &a, 5, 1);
        assert_eq!(part.x, whole.x[rows.start * 16..rows.end * 16], "rows {rows:?}");
    }
    for (row, &i) in order.iter().enumerate() {
        let alone = Batch::gather_augmented(&data, &[i], &a, 5, 1);
        assert_eq!(alone.x, whole.x[row * 16..(row + 1) * 16]);
    }
    // Another epoch, another seed: other draws (of 10 samples, some differ); none: the
    // plain batch.
    let all: Vec<usize> = (0..10).collect();
    let e1 = Batch::gather_augmented(&data, &all, &a, 5, 1);
    assert_ne!(e1.x, Batch::gather_augmented(&data, &all, &a, 5, 2).x);
    assert_ne!(e1.x, Batch::gather_augmented(&data, &all, &a, 6, 1).x);
    assert_eq!(e1.x, Batch::gather_augmented(&data, &all, &a, 5, 1).x);
    assert_eq!(Batch::gather_augmented(&data, &all, &Augment::NONE, 5, 1), plain);
    // The draws are spread over every offset and both flips, not stuck.
    let draws: Vec<Draw> = (0..10).map(|i| a.draw(5, 1, i)).collect();
    assert!(draws.iter().any(|d| d.flip == Flip::Horizontal) && draws.iter().any(|d| d.flip == Flip::None));
    assert!(draws.iter().any(|d| d.dy != draws[0].dy) && draws.iter().any(|d| d.dx != draws[0].dx));
}

fn digits(n: usize) -> Dataset {
    let d = load_digits(DigitsLayout::Image28).unwrap().train;
    d.subset("digits-subset", &(0..n).collect::<Vec<_>>())
}

/// The convnet with BatchNorm and dropout 0.5, with crops, flips and label smoothing.
fn recipe() -> (Graph, TrainConfig) {
    let model = models::convnet(ConvnetOptions::default()).unwrap();
    let cfg = TrainConfig {
        epochs: 2,
        batch_size: 24,
        replicas: Some(6),
        seed: 13,
        augment: Augment::parse("crop=4,flip").unwrap(),
        label_smoothing: 0.1,
        check_replicas_every: Some(1),
        ..TrainConfig::default()
    };
    (model, cfg)
}

fn run(model: &Graph, data: &Dataset, devices: Devices, cfg: &TrainConfig) -> TrainReport {
    train_data_parallel(model, data, None, &devices, cfg).unwrap()
}

#[test]
fn augmented_training_is_bitwise_the_same_on_1_2_3_devices() {
    let (model, cfg) = recipe();
    let data = digits(84); // 4 steps of 24 per epoch, the last of 12
    let one = run(&model, &data, Devices::cpu(1, 1).unwrap(), &cfg);
    assert_eq!(one.steps, 8);
    for devices in [Devices::cpu(2, 1).unwrap(), Devices::cpu(3, 1).unwrap(), Devices::cpu(1, 2).unwrap()] {
        let other = run(&model, &data, devices.clone(), &cfg);
        assert!(one.weights == other.weights, "weights differ on {devices}");
        assert_eq!(one.losses, other.losses, "losses differ on {devices}");
    }
    // The augmentation and the smoothing each change the run.
    let plain = run(&model, &data, Devices::cpu(1, 1).unwrap(), &TrainConfig { augment: Augment::NONE, ..cfg.clone() });
    assert!(plain.weights != one.weights);
    let unsmoothed = run(&model, &data, Devices::cpu(1, 1).unwrap(), &TrainConfig { label_smoothing: 0.0, ..cfg });
    assert!(unsmoothed.weights != one.weights);
}

#[test]
fn an_augmented_run_resumed_from_a_checkpoint_ends_bitwise_where_the_uninterrupted_one_does() {
    let (model, cfg) = recipe();
    let cfg = TrainConfig { schedule: LrSchedule::Cosine { floor: 0.1 }, ..cfg };
    let data = digits(84);
    let guard = tempfile::tempdir().unwrap();
    let dir = guard.path().join("ck");
    let config = BTreeMap::from([("augment".to_string(), "crop=4,flip".to_string())]);
    let policy = CheckpointPolicy { dir: dir.clone(), every: 1, keep: 100, config, record: None };
    let full = run(
        &model,
        &data,
        Devices::cpu(2, 1).unwrap(),
        &TrainConfig { checkpoint: Some(policy.clone()), ..cfg.clone() },
    );
    let fresh = Optimizer::new(cfg.optimizer, model.params_len());
    let files = checkpoint::list(&dir).unwrap();
    // Mid-epoch (2 and 6: the augmentation of the rest of an epoch follows from the
    // position) and at the epoch boundary (4), on other device counts.
    for (step, devices) in [(2, Devices::cpu(3, 1)), (4, Devices::cpu(1, 1)), (6, Devices::cpu(6, 1))] {
        let path = &files.iter().find(|(s, _)| *s == step).unwrap().1;
        let resume = checkpoint::load(&model, path, &policy.config, &fresh).unwrap();
        let rest = run(&model, &data, devices.unwrap(), &TrainConfig { resume: Some(resume), ..cfg.clone() });
        assert_eq!(rest.steps, 8);
        assert!(rest.weights == full.weights, "resumed from step {step}: weights differ");
        assert_eq!(rest.losses[..], full.losses[step as usize..], "resumed from step {step}: losses differ");
    }
}

#[test]
fn augmenting_what_is_not_an_image_is_refused() {
    let data = lockstep::data::toy::toy().train;
    let model = models::toy_mlp(2, 2).unwrap();
    let cfg = TrainConfig { augment: Augment::parse("flip").unwrap(), ..TrainConfig::default() };
    let e = match train_data_parallel(&model, &data, None, &Devices::cpu(1, 1).unwrap(), &cfg) {
        Ok(_) => panic!("flat samples augmented"),
        Err(e) => e.to_string(),
    };
    assert_eq!(e, "invalid augment: flip needs image samples (C, H, W); these samples are (2)");
}
