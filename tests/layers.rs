//! Layer forwards against hand-derived numbers, shape and device errors, initialisation,
//! and the documented names of the seed models.
//!
//! Gradients are checked in `tests/gradcheck.rs`; this file owns what a forward computes
//! and what the constructors promise. Every expected value is derived in a comment
//! above its assertion. Tolerances: values that are exact in f32 (small integers,
//! halves) are compared exactly; anything with a square root or a division by 3 within
//! 1e-6 absolute (a few f32 ulps at magnitude ≤ 2).

use lockstep::models::{self, ConvnetOptions, Norm};
use lockstep::nn::{
    BatchNorm2d, Conv2d, Ctx, Dropout, Flatten, GlobalAvgPool2d, Graph, Init, Layer, LayerShapes, Linear, MaxPool2d,
    Padding, ParamStore, Sequential,
};
use lockstep::Shape;
use lockstep::{Device, Error, Tensor};

const CPU: Device = Device::Cpu(0);

/// A one-layer model for per-sample inputs of shape `sample`.
fn one(sample: &[usize], layer: impl Layer + 'static) -> Graph {
    Sequential::new(sample.to_vec(), vec![Box::new(layer) as Box<dyn Layer>]).unwrap()
}

/// Writes `values` into the parameter or buffer called `name`.
fn set(net: &Graph, store: &mut ParamStore, name: &str, values: &[f32]) {
    if let Some(t) = net.param_infos().iter().find(|t| t.name == name) {
        store.params[t.range.clone()].copy_from_slice(values);
    } else {
        let t = net.buffer_infos().iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no tensor {name}"));
        store.buffers[t.range.clone()].copy_from_slice(values);
    }
}

fn get<'a>(net: &Graph, store: &'a ParamStore, name: &str) -> &'a [f32] {
    if let Some(t) = net.param_infos().iter().find(|t| t.name == name) {
        &store.params[t.range.clone()]
    } else {
        &store.buffers[net.buffer_infos().iter().find(|t| t.name == name).unwrap().range.clone()]
    }
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "{what}[{i}]: got {g}, want {w} (± {tol})");
    }
}

// ---------------------------------------------------------------------------------------
// Conv2d

/// x: (1, 1, 3, 3) = [[1, 2, 3], [4, 5, 6], [7, 8, 9]], kernel (1, 1, 2, 2) = [[1, 2], [3, 4]].
fn conv_3x3_input_2x2_kernel(padding: Padding, bias: Option<f32>) -> Tensor {
    let mut net = one(&[1, 3, 3], Conv2d::new(1, 1, (2, 2), 1, padding, bias.is_some()).unwrap());
    let mut store = net.init(0);
    set(&net, &mut store, "conv0.weight", &[1.0, 2.0, 3.0, 4.0]);
    if let Some(b) = bias {
        set(&net, &mut store, "conv0.bias", &[b]);
    }
    let x = Tensor::from_vec((1..=9).map(|v| v as f32).collect(), [1, 1, 3, 3]).unwrap();
    net.forward(x, &store.params, &mut store.buffers, &Ctx::eval(CPU)).unwrap()
}

#[test]
fn conv2d_valid_2x2_kernel_on_3x3() {
    // Cross-correlation (no kernel flip), OH = OW = 3 − 2 + 1 = 2, bias 0.5:
    //   y00 = 1·1 + 2·2 + 4·3 + 5·4 = 37    y01 = 2·1 + 3·2 + 5·3 + 6·4 = 47
    //   y10 = 4·1 + 5·2 + 7·3 + 8·4 = 67    y11 = 5·1 + 6·2 + 8·3 + 9·4 = 77
    let y = conv_3x3_input_2x2_kernel(Padding::Valid, Some(0.5));
    assert_eq!(y.shape().dims(), [1, 1, 2, 2]);
    assert_eq!(y.host(), [37.5, 47.5, 67.5, 77.5]);
}

#[test]
fn conv2d_same_2x2_kernel_on_3x3_pads_bottom_and_right() {
    // Keras same: OH = ⌈3/1⌉ = 3, pad_total = (3 − 1)·1 + 2 − 3 = 1 → 0 on top, 1 at the
    // bottom (and 0 left, 1 right). So the first two rows and columns are the valid
    // result, and the last ones see zeros below / to the right:
    //   y02 = 3·1 + 6·3 = 21        y12 = 6·1 + 9·3 = 33
    //   y20 = 7·1 + 8·2 = 23        y21 = 8·1 + 9·2 = 26       y22 = 9·1 = 9
    // (Padding on top/left instead would give y00 = 1·4 = 4.)
    let y = conv_3x3_input_2x2_kernel(Padding::Same, None);
    assert_eq!(y.shape().dims(), [1, 1, 3, 3]);
    assert_eq!(y.host(), [37.0, 47.0, 21.0, 67.0, 77.0, 33.0, 23.0, 26.0, 9.0]);
}

/// All-ones input (1, 1, h, h) and all-ones k×k kernel: each output counts the kernel
/// taps that land inside the image, which shows where the padding went.
fn conv_ones(h: usize, k: usize, stride: usize) -> Vec<f32> {
    let mut net = one(&[1, h, h], Conv2d::new(1, 1, (k, k), stride, Padding::Same, false).unwrap());
    let mut store = net.init(0);
    set(&net, &mut store, "conv0.weight", &vec![1.0; k * k]);
    let x = Tensor::from_vec(vec![1.0; h * h], [1, 1, h, h]).unwrap();
    net.forward(x, &store.params, &mut store.buffers, &Ctx::eval(CPU)).unwrap().into_vec()
}

#[test]
fn conv2d_same_asymmetric_padding_counts() {
    // H = 6, k = 3, s = 2: OH = 3, pad_total = 2·2 + 3 − 6 = 1 → top 0, bottom 1.
    // Output row oy reads rows 2·oy .. 2·oy+2: {0,1,2}, {2,3,4}, {4,5,(6 = pad)} → 3, 3, 2
    // taps per dimension, so y = r(oy)·r(ox) with r = [3, 3, 2].
    // (Padding 1 on top instead would give r = [2, 3, 3].)
    let r = [3.0, 3.0, 2.0];
    let want: Vec<f32> = r.iter().flat_map(|a| r.iter().map(move |b| a * b)).collect();
    assert_eq!(conv_ones(6, 3, 2), want);
    // H = 5, k = 4, s = 1: OH = 5, pad_total = 4 + 4 − 5 = 3 → top 1, bottom 2.
    // Row oy reads rows oy−1 .. oy+2 ∩ [0, 4]: 3, 4, 4, 3, 2 taps.
    let r = [3.0, 4.0, 4.0, 3.0, 2.0];
    let want: Vec<f32> = r.iter().flat_map(|a| r.iter().map(move |b| a * b)).collect();
    assert_eq!(conv_ones(5, 4, 1), want);
}

// ---------------------------------------------------------------------------------------
// BatchNorm2d

#[test]
fn batchnorm_eval_uses_running_stats() {
    // eps 0 so the numbers are exact: y = γ·(x − running_mean)/sqrt(running_var) + β.
    // channel 0: mean 1, var 4 (σ 2), γ 2, β 0.1:  x 3 → 2·2/2 + 0.1 = 2.1;  x 5 → 4.1
    // channel 1: mean −2, var 0.25 (σ 0.5), γ 0.5, β −0.3:
    //            x −1.5 → 0.5·0.5/0.5 − 0.3 = 0.2;  x −2.5 → −0.5 − 0.3 = −0.8
    // (The batch's own statistics, mean 4 and variance 1 in channel 0, would give
    // 2·(3 − 4)/1 + 0.1 = −1.9 for x = 3.)
    let mut net = one(&[2, 1, 2], BatchNorm2d::new(2).eps(0.0));
    let mut store = net.init(0);
    set(&net, &mut store, "bn0.gamma", &[2.0, 0.5]);
    set(&net, &mut store, "bn0.beta", &[0.1, -0.3]);
    set(&net, &mut store, "bn0.running_mean", &[1.0, -2.0]);
    set(&net, &mut store, "bn0.running_var", &[4.0, 0.25]);
    let before = store.buffers.clone();
    let x = Tensor::from_vec(vec![3.0, 5.0, -1.5, -2.5], [1, 2, 1, 2]).unwrap();
    let y = net.forward(x, &store.params, &mut store.buffers, &Ctx::eval(CPU)).unwrap();
    assert_close(y.host(), &[2.1, 4.1, 0.2, -0.8], 1e-6, "BatchNorm eval");
    assert_eq!(store.buffers, before, "evaluation leaves the running statistics alone");
}

#[test]
fn batchnorm_train_normalises_with_the_batch_and_updates_running_stats() {
    // x: (1, 1, 2, 2) = [1, 2, 3, 4], eps 0, γ 1, β 0 (the initial values).
    // batch mean 2.5, biased variance ((1.5² + 0.5²)·2)/4 = 1.25, σ = sqrt(1.25) = 1.1180340
    // y = (x − 2.5)/σ = [−1.5, −0.5, 0.5, 1.5]/1.1180340 = [−1.3416408, −0.4472136, …]
    // running_mean = 0.99·0 + 0.01·2.5 = 0.025
    // running_var  = 0.99·1 + 0.01·(unbiased 5/4·1.25 = 5/3) = 0.99 + 0.0166667 = 1.0066667
    let mut net = one(&[1, 2, 2], BatchNorm2d::new(1).eps(0.0));
    let mut store = net.init(0);
    let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], [1, 1, 2, 2]).unwrap();
    let y = net.forward(x, &store.params, &mut store.buffers, &Ctx::train(0, 0, 0, CPU)).unwrap();
    assert_close(y.host(), &[-1.3416408, -0.4472136, 0.4472136, 1.3416408], 1e-6, "BatchNorm train");
    assert_close(get(&net, &store, "bn0.running_mean"), &[0.025], 1e-6, "running_mean");
    assert_close(get(&net, &store, "bn0.running_var"), &[1.0066667], 1e-6, "running_var");
    // A second step with the same batch: r ← 0.99·r + 0.01·batch again.
    // mean 0.99·0.025 + 0.025 = 0.04975; var 0.99·1.0066667 + 0.0166667 = 1.0132667
    let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], [1, 1, 2, 2]).unwrap();
    net.forward(x, &store.params, &mut store.buffers, &Ctx::train(0, 1, 0, CPU)).unwrap();
    assert_close(get(&net, &store, "bn0.running_mean"), &[0.04975], 1e-6, "running_mean, step 2");
    assert_close(get(&net, &store, "bn0.running_var"), &[1.0132667], 1e-6, "running_var, step 2");
}

// ---------------------------------------------------------------------------------------
// Dropout

const DROP_N: usize = 10_000;

/// Dropout(0.5) on (1, DROP_N) ones under `ctx`.
fn drop_ones(ctx: &Ctx) -> Vec<f32> {
    let mut net = one(&[DROP_N], Dropout::new(0.5).unwrap());
    let mut store = net.init(0);
    let x = Tensor::from_vec(vec![1.0; DROP_N], [1, DROP_N]).unwrap();
    net.forward(x, &store.params, &mut store.buffers, ctx).unwrap().into_vec()
}

#[test]
fn dropout_eval_is_the_identity() {
    let mut net = one(&[5], Dropout::new(0.5).unwrap());
    let mut store = net.init(0);
    let v = vec![0.5, -1.0, 2.0, 3.5, -0.25];
    let y =
        net.forward(Tensor::from_vec(v.clone(), [1, 5]).unwrap(), &store.params, &mut store.buffers, &Ctx::eval(CPU));
    assert_eq!(y.unwrap().into_vec(), v);
}

#[test]
fn dropout_train_drops_about_half_and_doubles_the_rest() {
    let y = drop_ones(&Ctx::train(1, 0, 0, CPU));
    let dropped = y.iter().filter(|&&v| v == 0.0).count();
    // Dropped count ~ Binomial(10000, 0.5): mean 5000, σ = sqrt(10000·0.25) = 50. The bound
    // is ±5σ = ±250 (a fair mask lands outside with probability < 1e-6).
    assert!((4750..=5250).contains(&dropped), "{dropped} of {DROP_N} dropped");
    // Survivors are scaled by 1/(1 − 0.5) = 2, exactly.
    assert!(y.iter().all(|&v| v == 0.0 || v == 2.0), "values other than 0 and 2");
}

#[test]
fn dropout_mask_is_a_function_of_seed_step_and_replica() {
    let base = drop_ones(&Ctx::train(1, 4, 2, CPU));
    assert_eq!(base, drop_ones(&Ctx::train(1, 4, 2, CPU)), "same ctx, same mask");
    // Two independent masks agree on each element with probability 1/2, so they differ in
    // about 5000 of 10000 places; "differ somewhere" is the claim, and 1000 is far below.
    let differ = |other: Vec<f32>| base.iter().zip(&other).filter(|(a, b)| a != b).count();
    assert!(differ(drop_ones(&Ctx::train(1, 5, 2, CPU))) > 1000, "another step must draw another mask");
    assert!(differ(drop_ones(&Ctx::train(1, 4, 3, CPU))) > 1000, "another replica must draw another mask");
    assert!(differ(drop_ones(&Ctx::train(2, 4, 2, CPU))) > 1000, "another seed must draw another mask");
}

// ---------------------------------------------------------------------------------------
// Flatten and GlobalAvgPool2d

#[test]
fn flatten_and_global_avg_pool_shapes_and_values() {
    // x: (2, 3, 2, 2) with x[i] = i.
    let x = Tensor::from_vec((0..24).map(|v| v as f32).collect(), [2, 3, 2, 2]).unwrap();
    let mut flat = one(&[3, 2, 2], Flatten::new());
    assert_eq!(flat.output_shape().dims(), [12]);
    let mut store = flat.init(0);
    let y = flat.forward(x.clone(), &store.params, &mut store.buffers, &Ctx::eval(CPU)).unwrap();
    // (2, 12), values in the same (row-major) order.
    assert_eq!(y.shape().dims(), [2, 12]);
    assert_eq!(y.host(), x.host());

    let mut gap = one(&[3, 2, 2], GlobalAvgPool2d::new());
    assert_eq!(gap.output_shape().dims(), [3]);
    let y = gap.forward(x, &store.params, &mut store.buffers, &Ctx::eval(CPU)).unwrap();
    // Plane p holds 4p .. 4p+3, whose mean is 4p + 1.5.
    assert_eq!(y.shape().dims(), [2, 3]);
    assert_eq!(y.host(), [1.5, 5.5, 9.5, 13.5, 17.5, 21.5]);
}

// ---------------------------------------------------------------------------------------
// MaxPool2d (its backward and NaN cases: src/ops/maxpool2d/'s tests and tests/gradcheck.rs)

#[test]
fn maxpool2d_keeps_each_window_maximum_and_leaves_the_ragged_edge_out() {
    // x: (2, 1, 5, 5) with x[i] = (i · 7) mod 25 + offset: distinct values, no two alike,
    // sample 1 the same plus 100. Pool 2, stride 2, valid: OH = OW = ⌊(5 − 2)/2⌋ + 1 = 2,
    // so row 4 and column 4 are never read (Keras's and PyTorch's floor).
    let x: Vec<f32> = (0..50).map(|i| ((i % 25) * 7 % 25) as f32 + 100.0 * (i / 25) as f32).collect();
    let mut net = one(&[1, 5, 5], MaxPool2d::new((2, 2), (2, 2), Padding::Valid).unwrap());
    assert_eq!(net.output_shape().dims(), [1, 2, 2]);
    assert_eq!(net.layer_names(), ["maxpool0"]);
    assert_eq!(net.layers()[0].describe(), "MaxPool2d(2x2, stride 2, valid)");
    let mut store = net.init(0);
    let y = net.forward(Tensor::from_vec(x, [2, 1, 5, 5]).unwrap(), &store.params, &mut store.buffers, &Ctx::eval(CPU));
    // Plane (row-major, (i · 7) mod 25):
    //    0  7 14 21  3
    //   10 17 24  6 13
    //   20  2  9 16 23
    //    5 12 19  1  8
    //   15 22  4 11 18
    // Windows rows 0..2 × cols 0..2: max(0, 7, 10, 17) = 17; cols 2..4: max(14, 21, 24, 6)
    // = 24; rows 2..4: max(20, 2, 5, 12) = 20, max(9, 16, 19, 1) = 19. (23 in column 4 and
    // 22 in row 4 would win windows that do not exist.)
    assert_eq!(y.unwrap().host(), [17.0, 24.0, 20.0, 19.0, 117.0, 124.0, 120.0, 119.0]);
}

#[test]
fn sequential_records_each_layer_s_per_sample_shapes() {
    // (1, 6, 6) → conv 3×3 valid (2, 4, 4) → pool 2 same with strides (1, 2): rows ⌈4/1⌉ = 4,
    // columns ⌈4/2⌉ = 2 → (2, 4, 2) → flatten (16,) → dense (3,).
    let layers: Vec<Box<dyn Layer>> = vec![
        Box::new(Conv2d::new(1, 2, (3, 3), 1, Padding::Valid, true).unwrap()),
        Box::new(MaxPool2d::new((2, 2), (1, 2), Padding::Same).unwrap()),
        Box::new(Flatten::new()),
        Box::new(Linear::new(16, 3)),
    ];
    let net = Sequential::new([1, 6, 6], layers).unwrap();
    let io = |i: &[usize], o: &[usize]| LayerShapes::one(Shape::new(i), Shape::new(o));
    assert_eq!(
        net.layer_shapes(),
        [io(&[1, 6, 6], &[2, 4, 4]), io(&[2, 4, 4], &[2, 4, 2]), io(&[2, 4, 2], &[16]), io(&[16], &[3])]
    );
    // A pool larger than a valid input is refused by name.
    let pool = MaxPool2d::new((3, 3), (1, 1), Padding::Valid).unwrap();
    let err = Sequential::new([1, 2, 2], vec![Box::new(pool) as Box<dyn Layer>]).unwrap_err().to_string();
    for part in ["maxpool0", "MaxPool2d", "(2, 1, 2, 2)", "3x3 pool"] {
        assert!(err.contains(part), "'{err}' does not mention '{part}'");
    }
}

// ---------------------------------------------------------------------------------------
// Shape errors

#[test]
fn sequential_new_names_the_layer_that_does_not_fit() {
    // Linear(4, 2) after 3 features: the error names dense0, the op and the shape
    // (checked with a batch of 2: "(2, 3)").
    let err = Sequential::new([3], vec![Box::new(Linear::new(4, 2)) as Box<dyn Layer>]).unwrap_err().to_string();
    for part in ["dense0", "Linear", "expected 4 input features", "(2, 3)"] {
        assert!(err.contains(part), "'{err}' does not mention '{part}'");
    }
    // The second dense layer gets 5 features but wants 6: named dense1, not dense0.
    let layers: Vec<Box<dyn Layer>> = vec![Box::new(Linear::new(3, 5)), Box::new(Linear::new(6, 2))];
    let err = Sequential::new([3], layers).unwrap_err().to_string();
    assert!(err.contains("dense1") && err.contains("(2, 5)"), "{err}");
    // Conv2d with valid padding on an input smaller than its kernel.
    let conv = Conv2d::new(1, 4, (3, 3), 1, Padding::Valid, true).unwrap();
    let err = Sequential::new([1, 2, 2], vec![Box::new(conv) as Box<dyn Layer>]).unwrap_err().to_string();
    for part in ["conv0", "Conv2d", "(2, 1, 2, 2)", "3x3", "valid"] {
        assert!(err.contains(part), "'{err}' does not mention '{part}'");
    }
    // BatchNorm2d(3) after 2 channels.
    let err = Sequential::new([2, 4, 4], vec![Box::new(BatchNorm2d::new(3)) as Box<dyn Layer>]).unwrap_err();
    assert!(err.to_string().contains("bn0") && err.to_string().contains("expected 3 channels"), "{err}");
}

#[test]
fn forward_shape_errors_name_the_op_and_the_shapes() {
    // A model built for 4 features, given 3.
    let mut net = one(&[4], Linear::new(4, 2));
    let mut store = net.init(0);
    let x = Tensor::zeros([2, 3], CPU);
    let err = net.forward(x, &store.params, &mut store.buffers, &Ctx::eval(CPU)).unwrap_err();
    assert!(matches!(err, Error::Shape { op: "Linear", .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("expected 4 input features") && msg.contains("(2, 3)"), "{msg}");

    // A 3×3 valid conv built for 4×4 images, given 2×2 ones.
    let mut net = one(&[1, 4, 4], Conv2d::new(1, 2, (3, 3), 1, Padding::Valid, false).unwrap());
    let mut store = net.init(0);
    let x = Tensor::zeros([1, 1, 2, 2], CPU);
    let err = net.forward(x, &store.params, &mut store.buffers, &Ctx::eval(CPU)).unwrap_err();
    assert!(matches!(err, Error::Shape { op: "Conv2d", .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("(1, 1, 2, 2)") && msg.contains("3x3"), "{msg}");

    // A conv given a 2-dimensional tensor.
    let x = Tensor::zeros([1, 16], CPU);
    let err = net.forward(x, &store.params, &mut store.buffers, &Ctx::eval(CPU)).unwrap_err().to_string();
    assert!(err.contains("Conv2d") && err.contains("(N, C, H, W)") && err.contains("(1, 16)"), "{err}");
}

// ---------------------------------------------------------------------------------------
// The device rule

#[test]
fn tensors_on_different_cpu_devices_are_an_error_naming_both() {
    let a = Tensor::zeros([2, 2], Device::Cpu(0));
    let b = Tensor::zeros([2, 2], Device::Cpu(1));
    assert!(a.same_device("add", &a.clone()).is_ok());
    let err = a.same_device("add", &b).unwrap_err();
    assert!(
        matches!(&err, Error::DeviceMismatch { op: "add", lhs, rhs } if lhs == "cpu:0" && rhs == "cpu:1"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("add") && msg.contains("cpu:0") && msg.contains("cpu:1"), "{msg}");
}

#[test]
fn a_model_given_an_input_from_another_device_names_both() {
    let mut net = one(&[3], Linear::new(3, 2));
    let mut store = net.init(0);
    let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
    let err = net.forward(Tensor::zeros([2, 3], Device::Cpu(1)), &store.params, &mut store.buffers, &ctx).unwrap_err();
    assert!(
        matches!(&err, Error::DeviceMismatch { op: "Graph forward", lhs, rhs } if lhs == "cpu:1" && rhs.starts_with("cpu:0")),
        "{err}"
    );
}

#[test]
fn backward_with_dout_on_another_device_is_an_error_naming_both() {
    // Linear: forward on cpu:1, then dout arrives from cpu:0.
    let mut net = one(&[3], Linear::new(3, 2));
    let mut store = net.init(0);
    let ctx = Ctx::train(0, 0, 0, Device::Cpu(1));
    let x = Tensor::zeros([2, 3], Device::Cpu(1));
    let y = net.forward(x, &store.params, &mut store.buffers, &ctx).unwrap();
    assert_eq!(y.device(), Device::Cpu(1), "the output lives where the input did");
    let mut grads = vec![0.0; store.params.len()];
    let err = net.backward(Tensor::zeros([2, 2], Device::Cpu(0)), &store.params, &mut grads, &ctx).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("Linear backward") && msg.contains("cpu:1") && msg.contains("cpu:0"),
        "'{msg}' should name the op and both devices"
    );
    assert!(grads.iter().all(|&g| g == 0.0), "no gradient is written before the check");

    // Conv2d: the same rule.
    let mut net = one(&[1, 3, 3], Conv2d::new(1, 1, (2, 2), 1, Padding::Valid, true).unwrap());
    let mut store = net.init(0);
    let x = Tensor::zeros([1, 1, 3, 3], Device::Cpu(1));
    net.forward(x, &store.params, &mut store.buffers, &ctx).unwrap();
    let mut grads = vec![0.0; store.params.len()];
    let err = net.backward(Tensor::zeros([1, 1, 2, 2], Device::Cpu(0)), &store.params, &mut grads, &ctx).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("Conv2d backward") && msg.contains("cpu:1") && msg.contains("cpu:0"), "{msg}");
}

// ---------------------------------------------------------------------------------------
// Initialisation

fn seed_models() -> Vec<(&'static str, Graph)> {
    vec![
        ("toy", models::toy_mlp(2, 2).unwrap()),
        ("convnet", models::convnet(ConvnetOptions::default()).unwrap()),
        ("convnet-nobn", models::convnet(ConvnetOptions { norm: Norm::None, ..ConvnetOptions::default() }).unwrap()),
    ]
}

#[test]
fn init_follows_keras_defaults() {
    for (model, net) in seed_models() {
        let store = net.init(42);
        for t in net.param_infos().iter().chain(net.buffer_infos()) {
            let v = get(&net, &store, &t.name);
            assert_eq!(v.len(), t.shape.numel(), "{model} {}", t.name);
            match t.init {
                Init::GlorotUniform { fan_in, fan_out } => {
                    // U(−a, a), a = sqrt(6/(fan_in + fan_out)); the f64 draw is rounded to
                    // f32, which can land one ulp beyond a, hence the 1e-6 relative slack.
                    let a = (6.0 / (fan_in + fan_out) as f64).sqrt() as f32;
                    let max = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                    assert!(max <= a * (1.0 + 1e-6), "{model} {}: |{max}| > {a}", t.name);
                    // Not a degenerate fill: the smallest glorot tensor (toy dense2.weight) has 40
                    // values, P(max < 0.8a) = 0.8^40 ≈ 1.3e-4 for a fair draw (and the seed is fixed).
                    assert!(max >= 0.8 * a, "{model} {}: max |v| {max} for bound {a}", t.name);
                    // The mean of U(−a, a) over n values has σ = a/sqrt(3n): within 5σ.
                    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
                    let sigma = a as f64 / (3.0 * v.len() as f64).sqrt();
                    assert!(mean.abs() <= 5.0 * sigma, "{model} {}: mean {mean}", t.name);
                }
                Init::Zeros => assert!(v.iter().all(|&x| x == 0.0), "{model} {} must start at 0", t.name),
                Init::Ones => assert!(v.iter().all(|&x| x == 1.0), "{model} {} must start at 1", t.name),
                Init::Count => assert!(v.iter().all(|&x| x == 0.0), "{model} {} must count from 0", t.name),
                Init::Normal { std } => {
                    // N(0, std²) over n values: the mean within 5σ/√n, the sample std
                    // within 10% (the smallest normal tensor has thousands of values).
                    let n = v.len() as f64;
                    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
                    let sd = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
                    assert!(mean.abs() <= 5.0 * std as f64 / n.sqrt(), "{model} {}: mean {mean}", t.name);
                    assert!((sd / std as f64 - 1.0).abs() < 0.1, "{model} {}: std {sd} for {std}", t.name);
                }
            }
            // Which tensors get which initialiser, by name.
            let want_init = match t.name.rsplit('.').next().unwrap() {
                "weight" => "random",
                "bias" | "beta" | "running_mean" => "zeros",
                "num_batches_tracked" => "count",
                "gamma" | "running_var" => "ones",
                other => panic!("unexpected tensor kind {other}"),
            };
            let got_init = match t.init {
                Init::GlorotUniform { .. } | Init::Normal { .. } => "random",
                Init::Zeros => "zeros",
                Init::Ones => "ones",
                Init::Count => "count",
            };
            assert_eq!(got_init, want_init, "{model} {}", t.name);
        }
    }
}

#[test]
fn glorot_fans_are_keras_fans() {
    // Keras: Dense fan_in = F, fan_out = O; Conv2D fan_in = C·KH·KW, fan_out = O·KH·KW.
    let net = models::convnet(ConvnetOptions::default()).unwrap();
    let init = |name: &str| net.param_infos().iter().find(|t| t.name == name).unwrap().init;
    assert_eq!(init("conv1.weight"), Init::GlorotUniform { fan_in: 12 * 36, fan_out: 24 * 36 });
    assert_eq!(init("dense0.weight"), Init::GlorotUniform { fan_in: 32, fan_out: 256 });
    // A BatchNorm with scale (the convnet's has none) starts with γ = 1.
    let bn = one(&[2, 3, 3], BatchNorm2d::new(2));
    assert_eq!(get(&bn, &bn.init(1), "bn0.gamma"), [1.0, 1.0]);
}

#[test]
fn init_is_a_function_of_the_seed() {
    for (model, net) in seed_models() {
        assert_eq!(net.init(7), net.init(7), "{model}: same seed, same values");
        let (a, b) = (net.init(7), net.init(8));
        for t in net.param_infos().iter().filter(|t| matches!(t.init, Init::GlorotUniform { .. })) {
            let (va, vb) = (&a.params[t.range.clone()], &b.params[t.range.clone()]);
            let same = va.iter().zip(vb).filter(|(x, y)| x == y).count();
            assert_eq!(same, 0, "{model} {}: {same} values equal under another seed", t.name);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Names of the seed models (the table in src/models.rs)

fn names_and_shapes(infos: &[lockstep::nn::TensorInfo]) -> Vec<(String, Vec<usize>)> {
    infos.iter().map(|t| (t.name.clone(), t.shape.dims().to_vec())).collect()
}

fn owned(list: &[(&str, &[usize])]) -> Vec<(String, Vec<usize>)> {
    list.iter().map(|(n, s)| (n.to_string(), s.to_vec())).collect()
}

#[test]
fn toy_names_match_the_documented_table() {
    let net = models::toy_mlp(2, 2).unwrap();
    assert_eq!(net.layer_names(), ["dense0", "relu0", "dense1", "relu1", "dense2"]);
    let want: &[(&str, &[usize])] = &[
        ("dense0.weight", &[30, 2]),
        ("dense0.bias", &[30]),
        ("dense1.weight", &[20, 30]),
        ("dense1.bias", &[20]),
        ("dense2.weight", &[2, 20]),
        ("dense2.bias", &[2]),
    ];
    assert_eq!(names_and_shapes(net.param_infos()), owned(want));
    assert!(net.buffer_infos().is_empty());
    // 2·30 + 30 + 30·20 + 20 + 20·2 + 2 = 752
    assert_eq!(net.num_params(), 752);
    // Each tensor starts on a multiple of 64 values (nn::TENSOR_ALIGN): 0, 64, 128, 768,
    // 832, 896; the last ends at 898, and the flat buffer is padded to 960 = 15 · 64.
    let starts: Vec<usize> = net.param_infos().iter().map(|t| t.range.start).collect();
    assert_eq!(starts, [0, 64, 128, 768, 832, 896]);
    assert_eq!(net.params_len(), 960);
}

#[test]
fn convnet_names_match_the_documented_table() {
    let net = models::convnet(ConvnetOptions::default()).unwrap();
    let layers = [
        "rescaling0",
        "conv0",
        "bn0",
        "relu0",
        "conv1",
        "bn1",
        "relu1",
        "conv2",
        "bn2",
        "relu2",
        "gap0",
        "dense0",
        "relu3",
        "dropout0",
        "dense1",
    ];
    assert_eq!(net.layer_names(), layers);
    let params: &[(&str, &[usize])] = &[
        ("conv0.weight", &[12, 1, 3, 3]),
        ("bn0.beta", &[12]),
        ("conv1.weight", &[24, 12, 6, 6]),
        ("bn1.beta", &[24]),
        ("conv2.weight", &[32, 24, 6, 6]),
        ("conv2.bias", &[32]),
        ("bn2.beta", &[32]),
        ("dense0.weight", &[256, 32]),
        ("dense0.bias", &[256]),
        ("dense1.weight", &[10, 256]),
        ("dense1.bias", &[10]),
    ];
    assert_eq!(names_and_shapes(net.param_infos()), owned(params));
    let buffers: &[(&str, &[usize])] = &[
        ("bn0.running_mean", &[12]),
        ("bn0.running_var", &[12]),
        ("bn1.running_mean", &[24]),
        ("bn1.running_var", &[24]),
        ("bn2.running_mean", &[32]),
        ("bn2.running_var", &[32]),
    ];
    assert_eq!(names_and_shapes(net.buffer_infos()), owned(buffers));
    assert_eq!(net.output_shape().dims(), [10]);

    // convnet-nobn: the same without the bn* layers and tensors (and, with dropout 0, no
    // dropout layer).
    let net = models::convnet(ConvnetOptions { norm: Norm::None, dropout: 0.0, ..ConvnetOptions::default() }).unwrap();
    let want: Vec<&str> = layers.iter().copied().filter(|l| !l.starts_with("bn") && *l != "dropout0").collect();
    assert_eq!(net.layer_names(), want);
    let want: Vec<_> = owned(params).into_iter().filter(|(n, _)| !n.starts_with("bn")).collect();
    assert_eq!(names_and_shapes(net.param_infos()), want);
    assert!(net.buffer_infos().is_empty());
}
