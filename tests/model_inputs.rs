//! A model of two inputs (tokens and their positions) trained, evaluated and used to
//! predict through the trainer, its data given as one part per input
//! (`Dataset::from_inputs`, Keras's `fit([x1, x2], y)`).
//!
//! Exactness without a second framework: the same decoder written with ONE input that two
//! Split nodes cut into the tokens and the positions (the same nodes with parameters, in
//! the same order and of the same names, so the same initial weights) is trained on the
//! same samples, each the two parts concatenated. The two must agree bitwise: the trainer
//! cuts a batch row into the inputs' tensors exactly as the Split nodes cut it, and every
//! other node computes the same thing on the same values. The two-input model is then
//! bitwise the same on 1, 2, 3 and 4 CPU devices with the logical replicas fixed (R = 12),
//! as every model is. No tolerance anywhere: every comparison is `==`.
//!
//! On a GPU (`scripts/gpu-check.sh` runs this file where one is lent; elsewhere the test
//! says it is skipped): the two-input model trains as its Split form does there, bitwise,
//! and as on the CPU within rounding.
//!
//! And bad input, each a clear `Error::Data` naming the input and the shapes: one part for
//! two inputs, a part of the wrong shape, parts of different lengths, a token stream for a
//! model of two inputs, augmentation of data of several parts.

mod common;

use lockstep::data::augment::Augment;
use lockstep::data::{Dataset, Features};
use lockstep::devices::Devices;
use lockstep::nn::{Call, Embedding, Graph, Linear, Relu, RmsNorm, Split, Value};
use lockstep::optim::OptimizerConfig;
use lockstep::train::{train_data_parallel, with_trainer, Batch, Shuffle, TrainConfig};
use lockstep::{Error, Shape};

/// Tokens per sample, the vocabulary, the embedding width, the samples.
const T: usize = 6;
const VOCAB: usize = 11;
const WIDTH: usize = 8;
const N: usize = 36;

/// The decoder's nodes after its inputs: the token and position embeddings added, then
/// RMSNorm, a ReLU MLP and a head giving each position's next-token logits. (T, V).
fn decoder(tokens: &Value, positions: &Value) -> lockstep::Result<Graph> {
    let tok = Embedding::new(VOCAB, WIDTH)?.named("wte").call(tokens); // (T, C)
    let pos = Embedding::new(T, WIDTH)?.named("wpe").call(positions); // (T, C)
    let x = &tok + &pos;
    let x = RmsNorm::new(WIDTH).named("norm").call(&x);
    let x = Linear::new(WIDTH, 16).named("fc").call(&x); // (T, 16)
    let x = Relu::new().named("act").call(&x);
    Linear::new(16, VOCAB).named("head").call(&x).model() // (T, V)
}

/// The decoder of two inputs: `input` (the tokens, (T,)) and `positions` ((T,)).
fn two_inputs() -> Graph {
    let tokens = Value::input([T]);
    let positions = tokens.another_input("positions", [T]);
    decoder(&tokens, &positions).unwrap()
}

/// The same decoder of one input (2T,): the tokens then the positions, cut by Split.
fn one_input() -> Graph {
    let x = Value::input([2 * T]);
    let tokens = Split::new(-1, &[T, T], 0).unwrap().named("tokens").call(&x);
    let positions = Split::new(-1, &[T, T], 1).unwrap().named("positions").call(&x);
    decoder(&tokens, &positions).unwrap()
}

/// N samples' tokens (ids below VOCAB from a fixed xorshift stream), their positions
/// 0..T, and each position's label (the next token of a made-up rule: (id · 3 + 1) mod V).
fn samples() -> (Vec<u8>, Vec<u8>, Vec<u32>) {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut tokens = Vec::with_capacity(N * T);
    for _ in 0..N * T {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        tokens.push((s % VOCAB as u64) as u8);
    }
    let positions = (0..N * T).map(|i| (i % T) as u8).collect();
    let labels = tokens.iter().map(|&t| (u32::from(t) * 3 + 1) % VOCAB as u32).collect();
    (tokens, positions, labels)
}

/// The samples as two parts, one per input of [`two_inputs`].
fn two_part_data() -> Dataset {
    let (tokens, positions, labels) = samples();
    let parts = vec![(Shape::new([T]), Features::U8(tokens)), (Shape::new([T]), Features::U8(positions))];
    Dataset::from_inputs("two parts", parts, labels, T, VOCAB).unwrap()
}

/// The same samples as one part: each sample's tokens then its positions.
fn one_part_data() -> Dataset {
    let (tokens, positions, labels) = samples();
    let joined = tokens.chunks_exact(T).zip(positions.chunks_exact(T)).flat_map(|(a, b)| a.iter().chain(b)).copied();
    let parts = vec![(Shape::new([2 * T]), Features::U8(joined.collect()))];
    Dataset::from_inputs("one part", parts, labels, T, VOCAB).unwrap()
}

/// Two epochs of batches of 12 on R = 12 logical replicas (one sample each), AdamW,
/// gradients clipped, the replicas checked equal every step.
fn config() -> TrainConfig {
    TrainConfig {
        epochs: 2,
        batch_size: 12,
        optimizer: OptimizerConfig::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 },
        clip_grad_norm: Some(1.0),
        shuffle: Shuffle::Seeded,
        seed: 5,
        replicas: Some(12),
        check_replicas_every: Some(1),
        ..TrainConfig::default()
    }
}

#[test]
fn the_split_form_has_the_same_tensors_and_initial_weights() {
    let (a, b) = (two_inputs(), one_input());
    let names = |g: &Graph| g.param_infos().iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&a), names(&b));
    assert!(a.init(3) == b.init(3), "the same tensors draw the same initial values");
    assert_eq!(a.inputs().len(), 2);
    assert_eq!(a.inputs()[1], ("positions".to_string(), Shape::new([T])));
}

#[test]
fn two_inputs_train_bitwise_as_the_split_form_and_alike_on_one_to_four_devices() {
    let (two, one) = (two_inputs(), one_input());
    let (two_data, one_data) = (two_part_data(), one_part_data());
    let cfg = TrainConfig { initial: Some(two.init(7)), ..config() };
    let run = |m: &Graph, d: &Dataset, n: usize| train_data_parallel(m, d, None, &Devices::cpu(n, 1).unwrap(), &cfg);
    let base = run(&one, &one_data, 1).unwrap();
    // 36 samples, batches of 12: 3 steps an epoch, 2 epochs.
    assert_eq!(base.losses.len(), 6);
    assert!(base.losses[5] < base.losses[0], "the loss falls: {:?}", base.losses);
    for n in [1, 2, 3, 4] {
        let got = run(&two, &two_data, n).unwrap();
        assert_eq!(got.losses, base.losses, "losses of two inputs on cpu:{n} against the Split form on cpu:1");
        assert!(got.weights == base.weights, "weights of two inputs on cpu:{n} differ from the Split form's");
    }
}

#[test]
fn evaluation_and_predict_of_two_inputs_are_the_split_forms() {
    let (two, one) = (two_inputs(), one_input());
    let (two_data, one_data) = (two_part_data(), one_part_data());
    // Weights after a little training, so that predictions are not the initial ones.
    let trained = train_data_parallel(&two, &two_data, None, &Devices::cpu(1, 1).unwrap(), &config()).unwrap();
    let cfg = TrainConfig { initial: Some(trained.weights), ..config() };
    let all: Vec<usize> = (0..N).collect();
    let score = |m: &Graph, d: &Dataset, n: usize| {
        with_trainer(m, &Devices::cpu(n, 1).unwrap(), &cfg, |t| {
            Ok((t.evaluate(d, 5)?, t.predict(Batch::gather(d, &all))?))
        })
        .unwrap()
    };
    // An evaluation's loss is summed per device, then across devices: the same device
    // count on both sides. The probabilities are per sample: the same on any count.
    let (_, want_probs) = score(&one, &one_data, 1);
    assert_eq!(want_probs.len(), N * T * VOCAB);
    for n in [1, 2, 3] {
        let (want_metrics, _) = score(&one, &one_data, n);
        assert_eq!(want_metrics.count, (N * T) as u64, "every position of every sample is scored");
        let (metrics, probs) = score(&two, &two_data, n);
        assert_eq!(metrics, want_metrics, "evaluation of two inputs on cpu:{n}");
        assert!(probs == want_probs, "predictions of two inputs on cpu:{n} differ from the Split form's on cpu:1");
    }
    // And the held-out set of a fit is scored through the same cut.
    let fit = |m: &Graph, d: &Dataset| {
        let cfg = TrainConfig { epochs: 1, ..cfg.clone() };
        train_data_parallel(m, d, Some(d), &Devices::cpu(2, 1).unwrap(), &cfg).unwrap().epochs[0].test
    };
    let held = fit(&two, &two_data);
    assert!(held.is_some());
    assert_eq!(held, fit(&one, &one_data));
}

/// A GPU replica stages each input's rows apart (`model::gpu`'s `inputs_apart`) where the
/// Split form's nodes cut them from one: the same values reach the same kernels, so the
/// two train the same bits on cuda:0 and on two replicas sharing it, and the CPU's within
/// rounding (its products sum in other orders).
#[test]
fn two_inputs_on_a_gpu_train_as_the_split_form_there() {
    if !common::gpu_present("two_inputs_on_a_gpu_train_as_the_split_form_there") {
        return;
    }
    let (two, one) = (two_inputs(), one_input());
    let (two_data, one_data) = (two_part_data(), one_part_data());
    let cfg = TrainConfig { initial: Some(two.init(7)), ..config() };
    let on = |m: &Graph, d: &Dataset, devices: Devices| train_data_parallel(m, d, None, &devices, &cfg).unwrap();
    let cpu = on(&two, &two_data, Devices::cpu(1, 1).unwrap());
    for gpus in [&[0][..], &[0, 0]] {
        let got = on(&two, &two_data, Devices::cuda(gpus).unwrap());
        let want = on(&one, &one_data, Devices::cuda(gpus).unwrap());
        assert_eq!(got.losses, want.losses, "losses of two inputs on cuda {gpus:?} against the Split form's");
        assert!(got.weights == want.weights, "weights of two inputs on cuda {gpus:?} differ from the Split form's");
        for (k, (g, c)) in got.losses.iter().zip(&cpu.losses).enumerate() {
            assert!((g - c).abs() <= 1e-5 * c.abs().max(1.0), "loss of step {k}: cuda {g} against cpu {c}");
        }
    }
}

/// The message of a run of `model` on `data` refused as bad data.
fn data_error(model: &Graph, data: &Dataset) -> String {
    match train_data_parallel(model, data, None, &Devices::cpu(1, 1).unwrap(), &config()) {
        Err(e @ Error::Data { .. }) => e.to_string(),
        other => panic!("expected a data error, got {other:?}"),
    }
}

#[test]
fn one_part_for_two_inputs_is_refused_naming_both() {
    let e = data_error(&two_inputs(), &one_part_data());
    assert!(
        e.contains("1 input part(s) ((12))") && e.contains("2 inputs (input (6), positions (6))"),
        "the error names the part and both inputs: {e}"
    );
}

#[test]
fn a_part_of_the_wrong_shape_is_refused_naming_the_input() {
    let (tokens, positions, labels) = samples();
    let short: Vec<u8> = positions.chunks_exact(T).flat_map(|p| &p[..T - 1]).copied().collect();
    let parts = vec![(Shape::new([T]), Features::U8(tokens)), (Shape::new([T - 1]), Features::U8(short))];
    let data = Dataset::from_inputs("short positions", parts, labels, T, VOCAB).unwrap();
    let e = data_error(&two_inputs(), &data);
    assert!(
        e.contains("input part 1 has samples of shape (5)") && e.contains("input 1 (positions) of shape (6)"),
        "the error names the input and both shapes: {e}"
    );
}

#[test]
fn parts_of_different_lengths_are_refused_naming_the_part() {
    let (tokens, positions, labels) = samples();
    let parts = vec![
        (Shape::new([T]), Features::U8(tokens)),
        (Shape::new([T]), Features::U8(positions[..(N - 1) * T].to_vec())),
    ];
    let e = Dataset::from_inputs("ragged", parts, labels, T, VOCAB).unwrap_err();
    assert!(matches!(e, Error::Data { .. }), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("input part 1 of shape (6) holds 210 values (35 samples)") && e.contains("make 36 samples"),
        "the error names the part, its size and the samples expected: {e}"
    );
    let e = Dataset::from_inputs("none", vec![], vec![0], 1, 2).unwrap_err().to_string();
    assert!(e.contains("no input parts"), "{e}");
}

#[test]
fn a_token_stream_and_augmentation_stay_one_input() {
    let stream = Dataset::windows("text", (0..40).map(|i| i % VOCAB as u32).collect(), T, VOCAB).unwrap();
    let e = data_error(&two_inputs(), &stream);
    assert!(e.contains("token stream") && e.contains("positions (6)"), "{e}");
    let cfg = TrainConfig { augment: Augment::parse("flip").unwrap(), ..config() };
    let e = train_data_parallel(&two_inputs(), &two_part_data(), None, &Devices::cpu(1, 1).unwrap(), &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 input parts"), "{e}");
}
