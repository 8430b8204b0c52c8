//! The conformance test: every layer type of `model::LAYER_TYPES`, whatever it is, is held
//! to the same checks, so that an op missing any piece fails here, on a machine without a
//! GPU as on one with it:
//!
//! 1. its spec entry: the example parses and builds, every layer it builds states its
//!    memory, has a spec form and a GPU form, and is written back as a spec that builds the
//!    same layers;
//! 2. its backward against central differences of its forward, the input gradient and
//!    every parameter's, and the gradient contract (backward accumulates);
//! 3. its memory account against what its passes really allocate, counted on the thread
//!    that runs them (`testing::Counting`);
//! 4. its kernels, run on the host, against its CPU code: the op's own check, held to
//!    every kernel of its file;
//! 5. its GPU form against its CPU form, where a GPU is present (skipped, through the one
//!    skip helper, elsewhere; a failure under `LOCKSTEP_REQUIRE_GPU=1`).
//!
//! Each check walks the whole list, and names the layer type in every failure. The op's
//! own tests, in its folder, check what only it has (its numbers against PyTorch, its
//! edge cases); these check what every op owes.

use std::collections::BTreeSet;

use crate::model::{Graph, LAYER_TYPES};
use crate::ops::spec::{LayerType, TestInput};
use crate::ops::{Ctx, LayerMemory};
use crate::rng::SplitMix64;
use crate::spec::{model_to_spec, ModelSpec};
use crate::tensor::{Device, Shape, Tensor};
use crate::testing::Counting;

/// The example model of a layer type: its example object alone, on its example's input.
fn example(t: &LayerType) -> Graph {
    let (input, layer) = t.example;
    let text = format!(r#"{{"input_shape": {input:?}, "layers": [{layer}]}}"#);
    let spec =
        ModelSpec::parse(&text, t.name).unwrap_or_else(|e| panic!("{}: the example does not parse: {e}", t.name));
    assert_eq!(spec.layers[0].type_name(), t.name, "the example of {} is of another type", t.name);
    spec.build().unwrap_or_else(|e| panic!("{}: the example does not build: {e}", t.name))
}

/// A batch of `n` inputs of `model` as the op's conformance entry asks: values in
/// [−1, 1), or token ids.
fn inputs(t: &LayerType, model: &Graph, n: usize, seed: u64) -> Tensor {
    let mut g = SplitMix64::new(seed);
    let per = model.input_shape().numel();
    let values: Vec<f32> = match t.conformance.input {
        TestInput::Values => (0..n * per).map(|_| g.next_f32() * 2.0 - 1.0).collect(),
        TestInput::Distinct => {
            // The grid −(len−1)·s/2, ..., (len−1)·s/2, s = 4·H, in a random order.
            let len = n * per;
            let mut v: Vec<f32> = (0..len).map(|i| ((i as f64 - (len - 1) as f64 / 2.0) * 4.0 * H) as f32).collect();
            for i in (1..len).rev() {
                v.swap(i, (g.next_u64() % (i as u64 + 1)) as usize);
            }
            v
        }
        TestInput::Ids { vocab } => (0..n * per).map(|_| (g.next_u64() % vocab as u64) as f32).collect(),
    };
    let mut dims = vec![n];
    dims.extend_from_slice(model.input_shape().dims());
    Tensor::from_vec(values, dims).unwrap()
}

/// The context every check runs the layers in: training, so that dropout draws (one fixed
/// mask: the context is the same for every evaluation) and BatchNorm uses its batch.
fn train_ctx() -> Ctx<'static> {
    Ctx::train(7, 3, 1, Device::Cpu(0))
}

// ---- 1. the spec entry --------------------------------------------------------------------

#[test]
fn every_layer_type_builds_states_its_pieces_and_writes_itself_back() {
    let mut names = BTreeSet::new();
    for t in LAYER_TYPES {
        assert!(names.insert(t.name), "{} is listed twice", t.name);
        let model = example(t);
        for ((l, n), shapes) in model.layers().iter().zip(model.layer_names()).zip(model.layer_shapes()) {
            let what = format!("{}: layer {n} ({})", t.name, l.describe());
            // A built-in layer without a spec form could not be written back; one without
            // a memory account would be counted as keeping nothing; one without a GPU form
            // would be refused by a GPU replica at start-up. Here each fails on any machine.
            assert!(l.spec().is_some(), "{what} has no spec form (Layer::spec)");
            assert!(l.memory(shapes).is_some(), "{what} does not state its memory (Layer::memory)");
            #[cfg(feature = "cuda")]
            assert!(l.gpu().is_some(), "{what} has no GPU form (Layer::gpu)");
        }
        let written = model_to_spec(&model).unwrap();
        let again = ModelSpec::parse(&written.to_string(), "written back")
            .and_then(|s| s.build())
            .unwrap_or_else(|e| panic!("{}: {written} does not build: {e}", t.name));
        assert_eq!(model_to_spec(&again).unwrap(), written, "{}: written back as {written}", t.name);
        let describe = |m: &Graph| m.layers().iter().map(|l| l.describe()).collect::<Vec<_>>();
        assert_eq!(describe(&model), describe(&again), "{}: written back as {written}", t.name);
        assert_eq!(model.param_infos(), again.param_infos(), "{}", t.name);
        assert_eq!(model.layer_shapes(), again.layer_shapes(), "{}", t.name);
        // The written spec's fields resolve as the example's did (an example with
        // "activation": "relu" is written back as two objects, the layer and a relu).
        let (input, layer) = t.example;
        let spec = ModelSpec::parse(&format!(r#"{{"input_shape": {input:?}, "layers": [{layer}]}}"#), t.name).unwrap();
        let reparsed = ModelSpec::parse(&written.to_string(), "written back").unwrap();
        if spec.layers.len() == reparsed.layers.len() {
            // A merge's example is a graph, written back with every layer named.
            let unnamed = |l: &crate::spec::LayerSpec| {
                let mut v = l.resolved();
                v.as_object_mut().map(|m| m.remove("name"));
                v
            };
            let (a, b): (Vec<_>, Vec<_>) =
                (spec.layers.iter().map(unnamed).collect(), reparsed.layers.iter().map(unnamed).collect());
            assert_eq!(a, b, "{}", t.name);
            assert_eq!(
                spec.inbound.iter().map(Option::is_some).collect::<Vec<_>>(),
                reparsed.inbound.iter().map(Option::is_some).collect::<Vec<_>>(),
                "{}",
                t.name
            );
        }
    }
}

#[test]
fn every_entry_written_under_src_is_registered() {
    // An op's entry that is written but missing from the one list would never be parsed,
    // nor held to these checks: count the entries written under src/ against the list.
    fn walk(dir: &std::path::Path, written: &mut Vec<String>) {
        for path in std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()) {
            if path.is_dir() {
                walk(&path, written);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                let n = text.matches(concat!("pub const SPEC: ", "LayerType = LayerType {")).count();
                written.extend(std::iter::repeat_n(path.display().to_string(), n));
            }
        }
    }
    let mut written = Vec::new();
    walk(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut written);
    let listed: Vec<&str> = LAYER_TYPES.iter().map(|t| t.name).collect();
    assert_eq!(written.len(), LAYER_TYPES.len(), "entries written in {written:?}; model::LAYER_TYPES lists {listed:?}");
}

// ---- 2. the gradient ----------------------------------------------------------------------

/// Finite-difference step, and the tolerance |analytic − numeric| ≤ ATOL + RTOL·max(|a|, |n|).
/// The forward runs in f32 and the objective L = Σ w·y is summed in f64: for an op linear
/// in the checked value the only error is the f32 rounding of the forward, about
/// 2^-24·Σ|w·y| ≈ 1e-6 in L, ÷ 2h → ~1e-4, inside ATOL; a smooth op (BatchNorm, LayerNorm,
/// GELU, attention's softmax) adds the truncation h²/6·|L'''| ≈ 1e-5 on inputs of unit scale.
const H: f64 = 1e-2;
const RTOL: f64 = 1e-2;
const ATOL: f64 = 1e-3;
/// At most this share of the checked values may be left out for straddling a kink (ReLU's
/// 0, a max-pooling tie), found by one-sided slopes that disagree by more than KINK of
/// their size (a smooth op's curvature moves them by h·|L''|, a few percent at most here;
/// a kink by the size of the slope itself).
const MAX_KINK_SHARE: f64 = 0.05;
const KINK: f64 = 0.1;

/// The gradient check of one layer type's example at a batch of 3.
struct GradCheck {
    t: &'static LayerType,
    model: Graph,
    params: Vec<f32>,
    buffers: Vec<f32>,
    x: Tensor,
    /// The objective's weights, shaped like the output.
    w: Vec<f32>,
}

impl GradCheck {
    fn new(t: &'static LayerType) -> GradCheck {
        let mut model = example(t);
        let store = model.init(11);
        let mut g = SplitMix64::new(12);
        // Random parameters in [−1, 1) (not the initialisation: BatchNorm's ones and zeros,
        // or zero biases, would hide a wrong gradient); the flat layout's gaps stay zero.
        let mut params = store.params.clone();
        for info in model.param_infos() {
            for v in &mut params[info.range.clone()] {
                *v = g.next_f32() * 2.0 - 1.0;
            }
        }
        let x = inputs(t, &model, 3, 13);
        let y = model.forward(x.clone(), &params, &mut store.buffers.clone(), &train_ctx()).unwrap();
        let w = (0..y.numel()).map(|_| g.next_f32() * 2.0 - 1.0).collect();
        GradCheck { t, model, params, buffers: store.buffers, x, w }
    }

    /// L = Σ w·y on fresh buffers (BatchNorm's running statistics must not carry over).
    fn objective(&mut self, x: &Tensor, params: &[f32]) -> f64 {
        let mut buffers = self.buffers.clone();
        let y = self.model.forward(x.clone(), params, &mut buffers, &train_ctx()).unwrap();
        y.host().iter().zip(&self.w).map(|(&y, &w)| y as f64 * w as f64).sum()
    }

    /// (dL/dx, dL/dparams accumulated into `start`).
    fn analytic(&mut self, start: &[f32]) -> (Option<Vec<f32>>, Vec<f32>) {
        let mut buffers = self.buffers.clone();
        let ctx = train_ctx();
        let y = self.model.forward(self.x.clone(), &self.params, &mut buffers, &ctx).unwrap();
        let dout = Tensor::from_vec(self.w.clone(), y.shape().clone()).unwrap();
        let mut grads = start.to_vec();
        let dx = match self.t.conformance.input {
            TestInput::Values | TestInput::Distinct => {
                Some(self.model.backward_input(dout, &self.params, &mut grads, &ctx).unwrap().host().to_vec())
            }
            TestInput::Ids { .. } => {
                self.model.backward(dout, &self.params, &mut grads, &ctx).unwrap();
                None
            }
        };
        (dx, grads)
    }
}

/// Compares analytic derivatives with central differences of `objective` at the values
/// `theta` (perturbed one at a time through `set`); returns (compared, kinks).
fn compare(
    name: &str,
    what: &str,
    theta: &[f32],
    analytic: &[f32],
    mut objective: impl FnMut(usize, f32) -> f64,
) -> (usize, Vec<String>) {
    let l0 = objective(usize::MAX, 0.0);
    let mut kinks = Vec::new();
    for (i, (&v, &a)) in theta.iter().zip(analytic).enumerate() {
        let (plus, minus) = ((v as f64 + H) as f32, (v as f64 - H) as f32);
        let (lp, lm) = (objective(i, plus), objective(i, minus));
        let fwd = (lp - l0) / (plus as f64 - v as f64);
        let bwd = (l0 - lm) / (v as f64 - minus as f64);
        if (fwd - bwd).abs() > 10.0 * ATOL + KINK * fwd.abs().max(bwd.abs()) {
            kinks.push(format!("{what}[{i}] (one-sided slopes {fwd:.4} / {bwd:.4})"));
            continue;
        }
        let numeric = (lp - lm) / (plus as f64 - minus as f64);
        let a = a as f64;
        let bound = ATOL + RTOL * a.abs().max(numeric.abs());
        assert!(
            (a - numeric).abs() <= bound,
            "{name}: {what}[{i}]: analytic {a}, finite difference {numeric} (|Δ| {:.3e} > {bound:.3e})",
            (a - numeric).abs()
        );
    }
    (theta.len() - kinks.len(), kinks)
}

#[test]
fn every_layer_types_backward_is_the_gradient_of_its_forward() {
    for t in LAYER_TYPES {
        let mut c = GradCheck::new(t);
        let zero = vec![0.0f32; c.params.len()];
        let (dx, dparams) = c.analytic(&zero);
        // The gradient contract: backward into a buffer of random values adds to them.
        let g0: Vec<f32> = {
            let mut g = SplitMix64::new(99);
            (0..c.params.len()).map(|_| g.next_f32() * 2.0 - 1.0).collect()
        };
        let (_, accumulated) = c.analytic(&g0);
        for (i, ((&acc, &d), &s)) in accumulated.iter().zip(&dparams).zip(&g0).enumerate() {
            assert!(
                (acc - (s + d)).abs() <= 2e-6 * (1.0 + (s + d).abs()),
                "{}: backward did not accumulate at flat index {i}: got {acc}, want {s} + {d}",
                t.name
            );
        }
        let (mut compared, mut kinks) = (0, Vec::new());
        if let Some(dx) = dx {
            let x0 = c.x.host().to_vec();
            let shape = c.x.shape().clone();
            let params = c.params.clone();
            let (n, k) = compare(t.name, "dx", &x0, &dx, |i, v| {
                let mut x = x0.clone();
                if i < x.len() {
                    x[i] = v;
                }
                c.objective(&Tensor::from_vec(x, shape.clone()).unwrap(), &params)
            });
            compared += n;
            kinks.extend(k);
        }
        let infos = c.model.param_infos().to_vec();
        for info in &infos {
            let p0 = c.params.clone();
            let x = c.x.clone();
            let range = info.range.clone();
            let (n, k) =
                compare(t.name, &format!("d{}", info.name), &p0[range.clone()], &dparams[range.clone()], |i, v| {
                    let mut p = p0.clone();
                    if i < range.len() {
                        p[range.start + i] = v;
                    }
                    c.objective(&x, &p)
                });
            compared += n;
            kinks.extend(k);
        }
        let total = compared + kinks.len();
        assert!(total > 0, "{}: nothing to check", t.name);
        assert!(
            kinks.len() as f64 <= MAX_KINK_SHARE * total as f64,
            "{}: {} of {total} values straddle a kink: {kinks:?}",
            t.name,
            kinks.len()
        );
    }
}

// ---- 3. the memory account --------------------------------------------------------------

/// The batch the memory check runs at, and how far the measured bytes may be from the
/// stated ones: what a pass holds from its forward to its backward may exceed the stated
/// `kept` by at most KEPT_FACTOR (plus SLACK bytes of small vectors: shapes, a mask's
/// header), and the pass's peak may exceed what the account states for its input, output,
/// kept values and workspace by at most PEAK_FACTOR. The other way round, the account may
/// overstate (it is meant to be a little above, never below), but not by more than
/// OVER_FACTOR, so that a run that fits is not refused.
const BATCH: usize = 64;
const KEPT_FACTOR: f64 = 1.25;
const PEAK_FACTOR: f64 = 1.25;
const OVER_FACTOR: f64 = 4.0;
const SLACK: f64 = 2048.0;

#[test]
fn every_layer_types_memory_account_holds_what_its_passes_take() {
    for t in LAYER_TYPES {
        let mut model = example(t);
        let store = model.init(5);
        let ctx = train_ctx();
        let (params, mut buffers) = (store.params.clone(), store.buffers.clone());
        let stated: LayerMemory = model
            .layers()
            .iter()
            .zip(model.layer_shapes())
            .map(|(l, s)| l.memory(s).unwrap_or_else(|| panic!("{}: {} states no memory", t.name, l.describe())))
            .fold(LayerMemory::NONE, |a, m| LayerMemory {
                kept_per_sample: a.kept_per_sample + m.kept_per_sample,
                per_chunk: a.per_chunk + m.per_chunk,
                lent_per_chunk: a.lent_per_chunk.max(m.lent_per_chunk),
                per_layer: a.per_layer + m.per_layer,
                gemm: a.gemm.max(m.gemm),
            });
        let chunks = crate::backend::cpu::batch_chunks(BATCH).len() as u64;
        let f32s = |s: &Shape| (s.numel() * BATCH * 4) as f64;
        let (x_bytes, y_bytes) = (f32s(model.input_shape()), f32s(model.output_shape()));
        let pass = |model: &mut Graph, buffers: &mut Vec<f32>| {
            let x = inputs(t, model, BATCH, 6);
            let mut grads = vec![0.0f32; params.len()];
            Counting::reset_peak();
            let before = Counting::live() - x_bytes as isize;
            let y = model.forward(x, &params, buffers, &ctx).unwrap();
            let after_forward = Counting::live();
            let forward_peak = Counting::peak() - before;
            let dout = Tensor::from_vec(vec![0.5; y.numel()], y.shape().clone()).unwrap();
            drop(y);
            let dx = match t.conformance.input {
                TestInput::Values | TestInput::Distinct => {
                    Some(model.backward_input(dout, &params, &mut grads, &ctx).unwrap())
                }
                TestInput::Ids { .. } => {
                    model.backward(dout, &params, &mut grads, &ctx).unwrap();
                    None
                }
            };
            drop(dx);
            // What the forward left beside its output (the input was handed over).
            let kept = (after_forward - before) as f64 - y_bytes;
            (kept, (Counting::peak() - before).max(forward_peak) as f64)
        };
        // A first instance's pass makes what this thread keeps for any layer (the GEMM's
        // packing slab, the convolutions' lent pool); a fresh instance's first pass, which
        // makes its own caches, is measured.
        pass(&mut model.clone(), &mut buffers.clone());
        let (kept, peak) = pass(&mut model, &mut buffers);
        let stated_kept = (stated.kept_per_sample * BATCH as u64 + stated.per_layer) as f64;
        let workspace = ((stated.per_chunk + stated.lent_per_chunk) * chunks + stated.gemm) as f64;
        let account = x_bytes + 2.0 * y_bytes + x_bytes + stated_kept + workspace;
        eprintln!("{}: kept {kept:.0} B (stated {stated_kept:.0}), peak {peak:.0} B (account {account:.0})", t.name);
        assert!(
            kept <= KEPT_FACTOR * stated_kept + SLACK,
            "{}: a training forward of {BATCH} keeps {kept:.0} B for its backward, its account states {stated_kept:.0} B",
            t.name
        );
        assert!(
            peak <= PEAK_FACTOR * account + SLACK,
            "{}: a pass of {BATCH} peaks at {peak:.0} B, its account (input, output, their gradients, kept, \
             workspace) states {account:.0} B",
            t.name
        );
        assert!(
            stated_kept <= OVER_FACTOR * kept.max(0.0) + SLACK,
            "{}: its account states {stated_kept:.0} B kept, a forward of {BATCH} keeps only {kept:.0} B",
            t.name
        );
    }
}

// ---- 4. the kernels on the host -----------------------------------------------------------

#[cfg(feature = "cuda")]
#[test]
fn every_layer_types_kernels_run_on_the_host_as_its_cpu_code() {
    use crate::cuda::host::checker_or_skip;
    const TEST: &str = "every_layer_types_kernels_run_on_the_host_as_its_cpu_code";
    // Every type is looked at before any failure, so that one run names every op that
    // lacks its check.
    let mut missing = Vec::new();
    for t in LAYER_TYPES {
        match (t.kernels, t.conformance.host) {
            (None, None) => {}
            (Some(file), None) => {
                missing.push(format!("{}: {} has no host check (its Conformance::host)", t.name, file.name))
            }
            (None, Some(_)) => missing.push(format!("{}: a host check without a kernel file", t.name)),
            (Some(file), Some(check)) => {
                let Some(k) = checker_or_skip(TEST, crate::train::kernel_files) else { return };
                check(&k);
                let declared: BTreeSet<String> = file.kernels.iter().map(|k| k.name()).collect();
                assert_eq!(k.ran(), declared, "{}: the kernels its host check ran vs those of {}", t.name, file.name);
            }
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

// ---- 5. on a GPU --------------------------------------------------------------------------

/// Where a CUDA GPU can be used; otherwise the one skip helper says that `test` did not run.
#[cfg(feature = "cuda")]
pub(crate) fn gpu_or_skip(test: &str) -> bool {
    use crate::testing::skip::{skip, Need};
    match crate::cuda::gpu_count() {
        Ok(n) if n > 0 => true,
        Ok(_) => {
            skip(test, Need::Gpu, "the CUDA driver sees no GPU");
            false
        }
        Err(e) => {
            skip(test, Need::Gpu, &format!("no CUDA driver ({e})"));
            false
        }
    }
}

/// |gpu − cpu| ≤ GPU_ATOL + GPU_RTOL·|cpu| on every value. cuBLAS and the kernels sum in
/// other orders than the CPU's GEMM and loops (and contract into FMAs), so the two agree to
/// a few ulp of the values' scale, not bitwise; 1e-4 relative holds a hundred-fold margin
/// over f32's 6e-8 at these sizes (a few dozen terms per sum), and the absolute floor
/// covers values that cancel to near zero.
#[cfg(feature = "cuda")]
const GPU_RTOL: f64 = 1e-4;
#[cfg(feature = "cuda")]
const GPU_ATOL: f64 = 1e-5;

/// The network that runs a layer type's example on a GPU and on the CPU: the example
/// between a shape-keeping layer with parameters (so that the example's input gradient is
/// checked through that layer's parameter gradient; none before an op over token ids,
/// which comes first) and a Flatten where the output is not flat (the loss takes (N, K)).
#[cfg(feature = "cuda")]
fn gpu_network(t: &LayerType) -> Graph {
    let (input, example) = t.example;
    let before = match (t.conformance.input, input) {
        (TestInput::Ids { .. }, _) => String::new(),
        (_, [c, _, _]) => format!(r#"{{"type": "conv2d", "filters": {c}, "kernel_size": 1}}, "#),
        (_, [t, _]) => format!(r#"{{"type": "positional_embedding", "length": {t}}}, "#),
        (_, [f]) => format!(r#"{{"type": "dense", "units": {f}}}, "#),
        (_, other) => panic!("an example of input shape {other:?}: neither (C, H, W), (T, C) nor (F)"),
    };
    // A merge's example reads the model input by name: it reads the layer before instead.
    let (before, example) = match example.contains(r#""inbound""#) && !before.is_empty() {
        true => (before.replacen('{', r#"{"name": "before", "#, 1), example.replace(r#""input""#, r#""before""#)),
        false => (before, example.to_string()),
    };
    let build = |after: &str| {
        let spec = format!(r#"{{"input_shape": {input:?}, "layers": [{before}{example}{after}]}}"#);
        crate::spec::model_from_spec_str(&spec, t.name).unwrap()
    };
    let model = build("");
    if model.output_shape().ndim() == 1 {
        model
    } else {
        build(r#", {"type": "flatten"}"#)
    }
}

#[cfg(feature = "cuda")]
#[test]
fn every_layer_type_runs_on_a_gpu_as_on_the_cpu() {
    use crate::model::gpu::{GpuNet, OptimizerState, SlotUse};
    use crate::ops::cross_entropy::{score, softmax_cross_entropy};
    use crate::ops::gpu::Draw;
    use crate::optim::OptimizerConfig;
    const TEST: &str = "every_layer_type_runs_on_a_gpu_as_on_the_cpu";
    const N: usize = 6;
    // Without a GPU the CPU half still runs: every network builds and its reference is
    // finite, so that a layer type the GPU check could not take fails here too.
    let gpu = gpu_or_skip(TEST);
    for t in LAYER_TYPES {
        let model = gpu_network(t);
        let store = model.init(7);
        let mut g = SplitMix64::new(0x5eed ^ t.name.len() as u64);
        let xs = inputs(t, &model, N, 0x5eed ^ t.name.len() as u64).into_vec();
        let k = model.output_shape().numel() as u64;
        let ys: Vec<u32> = (0..N).map(|_| (g.next_u64() % k) as u32).collect();
        let draw = Draw { seed: 11, step: 3, shard: 1, sample_offset: 0 };
        let dims = |n: usize| [&[n][..], model.input_shape().dims()].concat();
        // The CPU: the per-sample losses, the gradients of their sum, the trained buffers,
        // and an evaluation's logits.
        let mut net = model.clone();
        let ctx = Ctx::train(draw.seed, draw.step, draw.shard, Device::Cpu(0));
        let mut trained = store.buffers.clone();
        let logits =
            net.forward(Tensor::from_vec(xs.clone(), dims(N)).unwrap(), &store.params, &mut trained, &ctx).unwrap();
        let kk = k as usize;
        let losses: Vec<f32> = (0..N)
            .map(|r| {
                let row = Tensor::from_vec(logits.host()[r * kk..(r + 1) * kk].to_vec(), [1, kk]).unwrap();
                score(&row, &ys[r..r + 1]).unwrap().loss_sum as f32
            })
            .collect();
        let (_, dlogits) = softmax_cross_entropy(&logits, &ys).unwrap();
        let mut grads = vec![0.0; model.params_len()];
        net.backward(dlogits, &store.params, &mut grads, &ctx).unwrap();
        let mut eval_buffers = store.buffers.clone();
        let x = Tensor::from_vec(xs.clone(), dims(N)).unwrap();
        let eval = net.forward(x, &store.params, &mut eval_buffers, &Ctx::eval(Device::Cpu(0))).unwrap().into_vec();
        assert!(
            losses.iter().chain(&grads).chain(&eval).all(|v| v.is_finite()),
            "{}: the CPU reference is not finite",
            t.name
        );
        if !gpu {
            continue;
        }
        let state = OptimizerState { config: OptimizerConfig::sgd(0.1), state: Vec::new() };
        let mut gnet = GpuNet::new(0, model.clone(), &store, state, 0).unwrap_or_else(|e| panic!("{}: {e}", t.name));
        gnet.stage(&xs, &ys).unwrap();
        let (np, nb) = (model.params_len(), model.buffers_len());
        let mut slot = gnet.stream().alloc_zeros::<f32>(np + nb).unwrap();
        gnet.train_shard(0..N, draw, &mut slot.as_view_mut(), SlotUse::Write, None, &|| false)
            .unwrap_or_else(|e| panic!("{}: training pass: {e}", t.name));
        gnet.wait(&|| false).unwrap();
        let (gpu_losses, _) = gnet.step_losses().unwrap();
        let slot = gnet.stream().clone_dtoh(&slot).unwrap();
        let (_, _, gpu_logits) = gnet.infer(&xs, &ys).unwrap();
        let near = |part: &str, got: &[f32], want: &[f32]| {
            assert_eq!(got.len(), want.len(), "{}: {part}: length", t.name);
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                let bound = GPU_ATOL + GPU_RTOL * (w as f64).abs();
                assert!(
                    ((g as f64) - (w as f64)).abs() <= bound || (g.is_nan() && w.is_nan()),
                    "{}: {part}[{i}]: gpu {g} vs cpu {w} (bound {bound:e})",
                    t.name
                );
            }
        };
        near("per-sample losses", &gpu_losses, &losses);
        near("parameter gradients", &slot[..np], &grads);
        near("updated buffers", &slot[np..], &trained);
        near("evaluation logits", &gpu_logits, &eval);
    }
}
