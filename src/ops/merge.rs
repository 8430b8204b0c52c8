//! What the merges (`add`, `multiply`, `concatenate`, `matmul`: the ops of several inputs)
//! share: how an error names their inputs' shapes, the check of how many inputs a node
//! gave one, and, for their tests, a finite-difference check of every input's gradient
//! through `forward_many` / `backward_many`.
//!
//! Each merge's arithmetic, shapes rule and memory account are its own folder's; the graph
//! that calls them (which node feeds which input) is `crate::model`'s.

use super::Arity;
use crate::tensor::{Shape, Tensor};

/// The inputs' shapes as an error names them, in input order: per sample, as a spec's
/// `input_shape` writes them (`samples of shapes (3, 4), (3, 5)`), when every input has
/// the same batch; else whole, batch first.
pub(crate) fn listed(inputs: &[Shape]) -> String {
    let batch = |s: &Shape| s.dims().first().copied();
    let one_batch = inputs.iter().all(|s| s.ndim() > 0 && batch(s) == inputs.first().and_then(batch));
    let shapes: Vec<String> = if one_batch {
        inputs.iter().map(|s| Shape::new(&s.dims()[1..]).to_string()).collect()
    } else {
        inputs.iter().map(Shape::to_string).collect()
    };
    if one_batch {
        format!("samples of shapes {}", shapes.join(", "))
    } else {
        format!("inputs of shapes {} (batch first: the batches differ)", shapes.join(", "))
    }
}

/// Errors unless `n` inputs are what a merge of `arity` takes.
pub(crate) fn check_arity(arity: Arity, n: usize) -> Result<(), String> {
    if arity.admits(n) {
        Ok(())
    } else {
        Err(format!("takes {arity}, given {n}"))
    }
}

/// The tensors' shapes, in order.
pub(crate) fn shapes_of(xs: &[Tensor]) -> Vec<Shape> {
    xs.iter().map(|x| x.shape().clone()).collect()
}

#[cfg(test)]
pub(crate) mod testing {
    //! A merge alone, run through its `_many` forms as a graph's node runs it, and its
    //! gradient checked against central differences of its forward.

    use crate::ops::{Ctx, InputGrad, Layer, LayerShapes, Params, ParamsMut};
    use crate::rng::SplitMix64;
    use crate::tensor::{Device, Shape, Tensor};
    use crate::testing::Counting;

    /// `n` values uniform in [−1, 1), from the stream of `seed`.
    pub(crate) fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut g = SplitMix64::new(seed);
        (0..n).map(|_| g.next_f32() * 2.0 - 1.0).collect()
    }

    /// A training forward of `layer` on `xs`, then its backward of `dout` with every
    /// input's gradient asked for: (y, each input's gradient).
    pub(crate) fn run(layer: &mut dyn Layer, xs: &[Tensor], dout: &[f32]) -> (Tensor, Vec<Tensor>) {
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let none = || ParamsMut::new(&mut [], &[]);
        let y = layer.forward_many(xs.to_vec(), Params::new(&[], &[]), none(), &ctx).unwrap();
        let dy = Tensor::from_vec(dout.to_vec(), y.shape().clone()).unwrap();
        let needed = vec![InputGrad::Needed; xs.len()];
        let grads = layer.backward_many(dy, Params::new(&[], &[]), none(), &needed, &ctx).unwrap();
        (y, grads.into_iter().map(|g| g.expect("asked for")).collect())
    }

    /// Bytes a training forward of `layer` on `xs` (handed over, as a graph hands them)
    /// leaves allocated beside its output, counted on this thread (`testing::Counting`),
    /// against what its memory account states for the batch: (measured, stated).
    pub(crate) fn kept_bytes(layer: &mut dyn Layer, xs: Vec<Tensor>) -> (i64, i64) {
        let shapes: Vec<Shape> = xs.iter().map(|x| x.shape().clone()).collect();
        let out = layer.output_shape_many(&shapes).unwrap();
        let per_sample = |s: &Shape| Shape::new(&s.dims()[1..]);
        let account = LayerShapes {
            input: per_sample(&shapes[0]),
            output: per_sample(&out),
            other_inputs: shapes[1..].iter().map(per_sample).collect(),
        };
        let stated = layer.memory(&account).expect("a memory account").kept_per_sample * shapes[0].batch() as u64;
        let inputs: usize = xs.iter().map(|x| x.numel() * 4).sum();
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let before = Counting::live() - inputs as isize;
        let y = layer.forward_many(xs, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let kept = Counting::live() - before - (y.numel() * 4) as isize;
        (kept as i64, stated as i64)
    }

    /// Finite-difference step, and the tolerance |analytic − numeric| ≤ ATOL + RTOL·max,
    /// the conformance test's (`ops::conformance`): the merges are linear in each input
    /// (add, concatenate, and multiply and matmul with the others held), so a central
    /// difference is exact up to the f32 rounding of the forward, about 2^-24·Σ|w·y| in
    /// L = Σ w·y, ÷ 2h: ~1e-5 here, well inside ATOL.
    const H: f64 = 1e-2;
    const RTOL: f64 = 1e-2;
    const ATOL: f64 = 1e-3;

    /// Checks every input's gradient of L = Σ w·y (w random in [−1, 1)) from
    /// `backward_many` against central differences of `forward_many`, value by value;
    /// returns how many values were compared.
    pub(crate) fn gradient_check(layer: &mut dyn Layer, xs: &[Tensor]) -> usize {
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let y = layer.forward_many(xs.to_vec(), Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let mut g = SplitMix64::new(0x6d65_7267);
        let w: Vec<f32> = (0..y.numel()).map(|_| g.next_f32() * 2.0 - 1.0).collect();
        let objective = |y: &Tensor| y.host().iter().zip(&w).map(|(&y, &w)| y as f64 * w as f64).sum::<f64>();
        let (_, grads) = run(layer, xs, &w);
        let mut compared = 0;
        for (i, (x, dx)) in xs.iter().zip(&grads).enumerate() {
            assert_eq!(dx.shape(), x.shape(), "{}: input {i}'s gradient", layer.describe());
            for e in 0..x.numel() {
                let mut at = |v: f64| {
                    let mut moved = xs.to_vec();
                    moved[i].host_mut()[e] = v as f32;
                    let step = moved[i].host()[e] as f64 - x.host()[e] as f64;
                    let none = ParamsMut::new(&mut [], &[]);
                    let y = layer.forward_many(moved, Params::new(&[], &[]), none, &ctx).unwrap();
                    (objective(&y), step)
                };
                let v = x.host()[e] as f64;
                let ((lp, sp), (lm, sm)) = (at(v + H), at(v - H));
                let numeric = (lp - lm) / (sp - sm);
                let analytic = dx.host()[e] as f64;
                let bound = ATOL + RTOL * analytic.abs().max(numeric.abs());
                assert!(
                    (analytic - numeric).abs() <= bound,
                    "{}: d input {i}[{e}]: analytic {analytic}, finite difference {numeric} (bound {bound:e})",
                    layer.describe()
                );
                compared += 1;
            }
        }
        compared
    }
}

#[cfg(all(test, feature = "cuda"))]
pub(crate) mod on_gpu {
    //! A merge's GPU form run on GPU 0 as a graph's node runs it, for the ops' own GPU tests
    //! (skipped, through the one skip helper, where no GPU is present).

    use cudarc::cublas::CudaBlas;

    use crate::cuda::Gpu;
    use crate::ops::gpu::{Backward, Draw, Forward, Pass, Placement};
    use crate::ops::Layer;
    use crate::tensor::{Shape, Tensor};

    /// The GPU form of `layer` on `xs` (each (N, ...)): its forward, then its backward of
    /// `dout` with every input's gradient asked for: (y, each input's gradient); None
    /// without a GPU.
    pub(crate) fn run(test: &str, layer: &dyn Layer, xs: &[Tensor], dout: &[f32]) -> Option<(Vec<f32>, Vec<Vec<f32>>)> {
        if !crate::ops::conformance::gpu_or_skip(test) {
            return None;
        }
        let n = xs[0].shape().batch();
        let per_sample = |s: &Shape| Shape::new(&s.dims()[1..]);
        let shapes: Vec<Shape> = xs.iter().map(|x| x.shape().clone()).collect();
        let out = layer.output_shape_many(&shapes).unwrap();
        let place = Placement {
            name: layer.describe(),
            index: 0,
            input: per_sample(&shapes[0]),
            output: per_sample(&out),
            other_inputs: shapes[1..].iter().map(per_sample).collect(),
            params: Vec::new(),
            buffers: Vec::new(),
        };
        let gpu = Gpu::new(0).unwrap();
        let stream = gpu.stream().clone();
        let blas = CudaBlas::new(stream.clone()).unwrap();
        let mut form = layer.gpu().expect("a GPU form");
        form.reserve(&gpu, &place, n).unwrap();
        let mut scratch = stream.alloc_zeros::<f32>(form.scratch(&place, n).unwrap().max(1)).unwrap();
        let params = stream.alloc_zeros::<f32>(1).unwrap();
        let inputs: Vec<_> = xs.iter().map(|x| stream.clone_htod(x.host()).unwrap()).collect();
        let others: Vec<_> = inputs[1..].iter().collect();
        let mut y = stream.alloc_zeros::<f32>(out.numel()).unwrap();
        let stats = stream.alloc_zeros::<f32>(1).unwrap();
        let mut pass = Pass::Eval { stats: &stats };
        let f = Forward {
            gpu: &gpu,
            blas: &blas,
            place: &place,
            n,
            params: &params,
            x: &inputs[0],
            others: &others,
            y: &mut y,
            scratch: &mut scratch,
            pass: &mut pass,
            sync: None,
        };
        form.forward(f).unwrap();
        let dy = stream.clone_htod(dout).unwrap();
        // Gradients start as NaN: the backward must write every value.
        let mut grads: Vec<_> = xs.iter().map(|x| stream.clone_htod(&vec![f32::NAN; x.numel()]).unwrap()).collect();
        let mut none = stream.alloc_zeros::<f32>(1).unwrap();
        let (first, rest) = grads.split_first_mut().unwrap();
        let b = Backward {
            gpu: &gpu,
            blas: &blas,
            place: &place,
            n,
            params: &params,
            x: &inputs[0],
            others: &others,
            dy: dy.as_view(),
            dx: Some(first.as_view_mut()),
            d_others: rest.iter_mut().map(|g| Some(g.as_view_mut())).collect(),
            grads: &mut none.as_view_mut(),
            draw: Draw { seed: 0, step: 0, shard: 0, sample_offset: 0 },
            scratch: &mut scratch,
            sync: None,
        };
        form.backward(b).unwrap();
        gpu.synchronize().unwrap();
        let y = stream.clone_dtoh(&y).unwrap();
        Some((y, grads.iter().map(|g| stream.clone_dtoh(g).unwrap()).collect()))
    }
}
