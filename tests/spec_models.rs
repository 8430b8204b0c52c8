//! The shipped model specs (`examples/*.json`) build exactly the built-in models: the
//! same layers with the same hyper-parameters, the same tensor names and shapes, the
//! same initial weights for a seed and the same forward output, bit for bit (the two
//! networks run the same code on the same numbers, so the tolerance is 0).

use std::path::Path;

use lockstep::models::{self, ConvnetOptions, Norm};
use lockstep::nn::{Ctx, Mode, Sequential};
use lockstep::rng::SplitMix64;
use lockstep::spec::model_from_spec_file;
use lockstep::{Device, Tensor};

fn example(name: &str) -> Sequential {
    model_from_spec_file(&Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(name)).unwrap()
}

/// Asserts that `a` and `b` are the same network, down to the bits of a forward pass in
/// both modes on a random input of `n` samples.
fn assert_same(a: &mut Sequential, b: &mut Sequential, n: usize) {
    assert_eq!(a.layer_names(), b.layer_names());
    let describe = |m: &Sequential| m.layers().iter().map(|l| l.describe()).collect::<Vec<_>>();
    assert_eq!(describe(a), describe(b), "hyper-parameters");
    assert_eq!(a.input_shape(), b.input_shape());
    assert_eq!(a.output_shape(), b.output_shape());
    assert_eq!(a.param_infos(), b.param_infos(), "names, shapes, ranges and initialisers");
    assert_eq!(a.buffer_infos(), b.buffer_infos());
    for seed in [0, 7] {
        let (sa, sb) = (a.init(seed), b.init(seed));
        assert_eq!(sa, sb, "initial weights for seed {seed}");
        let mut g = SplitMix64::new(seed + 100);
        let x: Vec<f32> = (0..n * a.input_shape().numel()).map(|_| g.next_f32() * 255.0).collect();
        // x: (N, *input_shape)
        let shape: Vec<usize> = std::iter::once(n).chain(a.input_shape().dims().iter().copied()).collect();
        for ctx in [Ctx::eval(Device::Cpu(0)), Ctx::train(seed, 3, 1, Device::Cpu(0))] {
            let (mut ba, mut bb) = (sa.buffers.clone(), sb.buffers.clone());
            let ya = a.forward(Tensor::from_vec(x.clone(), shape.clone()).unwrap(), &sa.params, &mut ba, &ctx).unwrap();
            let yb = b.forward(Tensor::from_vec(x.clone(), shape.clone()).unwrap(), &sb.params, &mut bb, &ctx).unwrap();
            assert_eq!(ya.shape(), yb.shape());
            let bits = |t: &Tensor| t.host().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ya), bits(&yb), "forward output ({:?})", ctx.mode);
            assert_eq!(ba, bb, "running statistics after a {:?} forward", ctx.mode);
            if ctx.mode == Mode::Train {
                assert!(ya.host().iter().all(|v| v.is_finite()));
            }
        }
    }
}

#[test]
fn toy_mlp_json_is_the_lesson_mlp() {
    assert_same(&mut example("toy_mlp.json"), &mut models::toy_mlp(2, 2).unwrap(), 5);
}

#[test]
fn mnist_convnet_json_is_the_keras_guide_convnet() {
    let mut built = models::convnet(ConvnetOptions::default()).unwrap();
    assert_same(&mut example("mnist_convnet.json"), &mut built, 4);
}

#[test]
fn mnist_convnet_nobn_json_is_the_convnet_without_batchnorm_or_dropout() {
    let mut built =
        models::convnet(ConvnetOptions { norm: Norm::None, dropout: 0.0, ..ConvnetOptions::default() }).unwrap();
    assert_same(&mut example("mnist_convnet_nobn.json"), &mut built, 4);
}
