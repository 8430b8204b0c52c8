//! MatMul, a batch of matrix products of two inputs: ATen's `matmul` (`bmm` for 3-D) and
//! Keras's `ops.matmul`, as `torch.export` gives a hand-written attention's `q @ k.T`. The
//! layer (its spec entry `matmul`, its spec form, its memory account: it keeps both inputs
//! for the backward), built on its CPU forward and backward ([`cpu`]: the CPU backend's
//! GEMM); its GPU form is [`gpu`], cuBLAS's strided-batched GEMM (`cuda::gemm`), as linear
//! and attention use it: no kernel file.
//!
//! Shapes: a (N, ..., M, K) and b (N, ..., K, P) → y (N, ..., M, P): every sample's leading
//! dimensions (heads, say) must be the same in both (ATen broadcasts them; a graph's shapes
//! are known before it runs, so a mismatch here is refused, both shapes named, rather than
//! broadcast), and the samples have at least two dimensions (a vector is a (1, K) or (K, 1)
//! matrix, reshaped first). K must agree; an error names both shapes when it does not.
//!
//! Gradients: da = dy·bᵀ, db = aᵀ·dy, per product, from the inputs a training forward
//! keeps (shared with whoever else holds them, not copied: a [`Tensor`] clone).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::merge::{check_arity, listed, shapes_of};
use super::spec::{Build, FieldResult, LayerType};
use super::{
    merge_takes_several, Arity, Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut, F32,
};
use crate::backend::cpu::gemm_packing;
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};
use cpu::Dims;

/// The products of its two inputs' matrices; holds both inputs from the training forward
/// for the backward.
#[derive(Clone, Debug, Default)]
pub struct MatMul {
    kept: Option<(Tensor, Tensor)>,
}

impl MatMul {
    pub fn new() -> MatMul {
        MatMul::default()
    }

    /// The spec entry: ATen's `matmul` (Keras's `ops.matmul`), no fields.
    pub const SPEC: LayerType = LayerType {
        name: "matmul",
        fields: "none (2 inputs, (..., M, K) and (..., K, N))",
        example: (&[2, 3, 3], r#"{"type": "matmul", "inbound": ["input", "input"]}"#),
        parse: |_| {
            Ok(Build::merge(|inputs| {
                meet(inputs)?;
                Ok(MatMul::new())
            }))
        },
        #[cfg(feature = "cuda")]
        kernels: None,
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Values,
            #[cfg(feature = "cuda")]
            host: None,
        },
    };
}

/// The output shape of inputs of shapes `inputs` (batch included) and the products' shapes
/// per batch of one sample (`items` the product of the leading dimensions), or why they do
/// not meet.
fn meet(inputs: &[Shape]) -> FieldResult<(Shape, Dims)> {
    check_arity(Arity::Exactly(2), inputs.len())?;
    let (a, b) = (inputs[0].dims(), inputs[1].dims());
    let why = |what: String| format!("{what}, got {}", listed(inputs));
    if a.len() < 3 || b.len() < 3 {
        return Err(why("multiplies matrices: samples of at least two dimensions, (..., M, K) and (..., K, N)".into()));
    }
    let (ra, rb) = (a.len(), b.len());
    if ra != rb || a[..ra - 2] != b[..rb - 2] {
        return Err(why(
            "multiplies (..., M, K) by (..., K, N) with the same leading dimensions (none broadcast)".into()
        ));
    }
    let (m, k, kb, n) = (a[ra - 2], a[ra - 1], b[rb - 2], b[rb - 1]);
    if k != kb {
        return Err(why(format!(
            "multiplies (..., M, K) by (..., K, N): the first's K ({k}) is not the second's ({kb})"
        )));
    }
    let mut out = a.to_vec();
    out[ra - 1] = n;
    let items = a[1..ra - 2].iter().product();
    Ok((Shape::new(out), Dims { items, m, k, n }))
}

impl Layer for MatMul {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "matmul"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "matmul"}))
    }

    /// Both inputs kept for the backward; the GEMM's packing of its largest product (the
    /// forward's and the two gradients').
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let with_batch = |s: &Shape| Shape::new([&[1][..], s.dims()].concat());
        let inputs: Vec<Shape> = shapes.inputs().map(with_batch).collect();
        let (_, Dims { m, k, n, .. }) = meet(&inputs).ok()?;
        let values: u64 = shapes.inputs().map(|s| s.numel() as u64).sum();
        let products = [(m, n, k), (m, k, n), (k, n, m)];
        Some(LayerMemory {
            kept_per_sample: values.saturating_mul(F32),
            gemm: products.into_iter().map(|(m, n, k)| gemm_packing(m, n, k)).max().unwrap_or(0),
            ..LayerMemory::NONE
        })
    }

    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }

    fn output_shape(&self, _input: &Shape) -> Result<Shape> {
        merge_takes_several("MatMul", self.arity())
    }

    fn output_shape_many(&self, inputs: &[Shape]) -> Result<Shape> {
        meet(inputs).map(|(s, _)| s).map_err(|e| Error::shape("MatMul", e))
    }

    fn forward(&mut self, _x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, _ctx: &Ctx) -> Result<Tensor> {
        merge_takes_several("MatMul", self.arity())
    }

    // a: (N, ..., M, K), b: (N, ..., K, P) → y: (N, ..., M, P); training keeps a and b
    fn forward_many(&mut self, xs: Vec<Tensor>, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (shape, d) = meet(&shapes_of(&xs)).map_err(|e| Error::shape("MatMul", e))?;
        let [a, b]: [Tensor; 2] = xs.try_into().expect("two inputs, checked");
        a.same_device("MatMul", &b)?;
        let d = Dims { items: d.items * a.shape().batch(), ..d };
        let mut y = vec![0.0; shape.numel()];
        cpu::matmul_forward(a.host(), b.host(), &mut y, d);
        let device = a.device();
        self.kept = (ctx.mode == Mode::Train).then_some((a, b));
        Tensor::from_vec_on(y, shape, device)
    }

    fn backward(
        &mut self,
        _dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        _input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        merge_takes_several("MatMul", self.arity())
    }

    // dout: (N, ..., M, P) → da = dout·bᵀ: (N, ..., M, K), db = aᵀ·dout: (N, ..., K, P)
    fn backward_many(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grads: &[InputGrad],
        _ctx: &Ctx,
    ) -> Result<Vec<Option<Tensor>>> {
        let (a, b) =
            self.kept.take().ok_or_else(|| Error::config("MatMul backward", "no training forward to differentiate"))?;
        let (shape, d) = meet(&[a.shape().clone(), b.shape().clone()]).map_err(|e| Error::shape("MatMul", e))?;
        let &[ga, gb] = input_grads else {
            return Err(Error::shape(
                "MatMul backward",
                format!("{} inputs' gradients asked for, of 2", input_grads.len()),
            ));
        };
        if dout.shape() != &shape {
            return Err(Error::shape("MatMul backward", format!("dout {} for an output {shape}", dout.shape())));
        }
        let d = Dims { items: d.items * a.shape().batch(), ..d };
        let mut da = (ga == InputGrad::Needed).then(|| vec![0.0; a.numel()]);
        let mut db = (gb == InputGrad::Needed).then(|| vec![0.0; b.numel()]);
        cpu::matmul_backward(a.host(), b.host(), dout.host(), da.as_deref_mut(), db.as_deref_mut(), d);
        let device = dout.device();
        Ok(vec![
            da.map(|v| Tensor::from_vec_on(v, a.shape().clone(), device)).transpose()?,
            db.map(|v| Tensor::from_vec_on(v, b.shape().clone(), device)).transpose()?,
        ])
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(MatMul::new())
    }

    fn describe(&self) -> String {
        "MatMul".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::merge::testing::{gradient_check, run, values};
    use crate::tensor::Device;

    fn t(v: &[f32], dims: &[usize]) -> Tensor {
        Tensor::from_vec(v.to_vec(), dims.to_vec()).unwrap()
    }

    fn s(d: &[usize]) -> Shape {
        Shape::new(d.to_vec())
    }

    /// scripts/torch_matmul.py's case: a (2, 2, 3, 4), b (2, 2, 4, 5) and dy (2, 2, 3, 5) by
    /// its formulas (a batch of 2 samples of 2 heads).
    fn case() -> [Vec<f32>; 3] {
        let a = (0..48).map(|i| (((i * 37) % 23) as f32 - 11.0) / 8.0).collect();
        let b = (0..80).map(|i| (((i * 29) % 19) as f32 - 9.0) / 4.0).collect();
        let dy = (0..60).map(|i| (((i * 13) % 17) as f32 - 8.0) / 16.0).collect();
        [a, b, dy]
    }

    /// The output of scripts/torch_matmul.py: `a @ b` and both gradients by autograd, in
    /// float32, which the script checks equal to float64's: the exact values.
    /// // torch 2.15.0+cu132
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)]
    const TORCH_Y: &[f32] = &[
        6.125, -2.28125, 5.9375, -2.46875, 1.0, -2.40625, 2.75, -2.78125, 2.375, -0.1875, -0.15625, -1.5625, 0.0, -1.40625, -2.8125, -1.5625, -0.09375, -1.59375, 4.625, -1.625, 2.75, -2.34375, 3.25, -3.03125, 3.75, -1.5625, -0.28125, -1.96875, 5.84375, -2.375, -2.53125, 2.875, -1.8125, 3.0, -1.6875, 6.0, -2.34375, 0.59375, -2.40625, 0.53125, -2.71875, 2.5, -0.59375, 2.25, -0.84375, -1.28125, -3.21875, -1.0, -2.9375, -0.71875, -1.46875, 4.21875, -1.375, 4.3125, -1.28125, -1.65625, -2.0, -1.75, -2.09375, -1.84375,
    ];
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)]
    const TORCH_DA: &[f32] = &[
        1.75, -1.09375, 0.8125, 0.046875, -1.515625, 0.984375, -0.96875, -0.546875, 0.0, -0.390625, 0.703125, -0.875, -0.25, 0.703125, -0.71875, -1.25, 0.703125, -0.34375, 0.390625, -1.25, -1.0, 1.0, -1.15625, 1.140625, -0.3125, -0.3125, -0.3125, 2.0625, -1.15625, 1.0, -1.0, 0.265625, 0.390625, -0.34375, 0.703125, 0.859375, 0.515625, -0.4375, 0.984375, 0.328125, 0.703125, -0.390625, 0.0, 0.984375, -0.96875, 0.984375, -1.515625, -0.75,
    ];
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)]
    const TORCH_DB: &[f32] = &[
        0.8515625, -0.515625, -0.421875, 0.8671875, 0.828125, -0.65625, -0.0390625, 0.1796875, 0.3984375, -0.7109375, 0.3515625, -0.1015625, 0.2421875, -0.609375, 0.265625, -0.6171875, 0.1953125, -0.0546875, 0.359375, -0.5546875, 0.1875, -0.5859375, 0.3671875, -0.0078125, 0.1484375, -0.2578125, 0.234375, -0.6015625, 0.2890625, -0.1484375, -0.1640625, -0.7421875, 0.40625, 0.2265625, -0.0859375, 0.46875, -0.4609375, 0.3359375, -0.1953125, 0.3359375, -0.203125, 0.015625, 0.234375, 0.453125, -0.65625, -0.359375, -0.015625, 0.328125, -0.5234375, 0.3515625, 0.3828125, 0.1328125, -0.1171875, 0.296875, -0.6171875, 0.2265625, 0.1015625, -0.0234375, -0.6796875, 0.390625, -0.3671875, 0.125, 0.6171875, 0.1796875, -0.2578125, -0.2421875, -0.8203125, 0.4609375, 0.1484375, -0.1640625, 0.6015625, -0.328125, -0.59375, -0.0625, 0.46875, 0.0078125, 0.34375, 0.1484375, 0.0859375, 0.0234375,
    ];

    /// Bit for bit: every product of the inputs is exact in f32 (multiples of 2^-5, 2^-6 or
    /// 2^-7 with numerators below 100), and so is every partial sum (below 2^6 in size: 13
    /// bits at most), whatever order the GEMM sums in.
    #[test]
    fn matmul_matches_pytorch_exactly() {
        let [a, b, dy] = case();
        let (y, grads) = run(&mut MatMul::new(), &[t(&a, &[2, 2, 3, 4]), t(&b, &[2, 2, 4, 5])], &dy);
        assert_eq!(y.shape(), &s(&[2, 2, 3, 5]));
        assert_eq!(y.host(), TORCH_Y);
        assert_eq!(grads[0].host(), TORCH_DA);
        assert_eq!(grads[1].host(), TORCH_DB);
    }

    #[test]
    fn both_inputs_gradients_are_the_gradient_of_the_forward() {
        // Plain matrices, and heads of non-square ones.
        let xs = [t(&values(1, 2 * 3 * 4), &[2, 3, 4]), t(&values(2, 2 * 4 * 2), &[2, 4, 2])];
        assert_eq!(gradient_check(&mut MatMul::new(), &xs), 24 + 16);
        let xs = [t(&values(3, 2 * 3 * 2 * 5), &[2, 3, 2, 5]), t(&values(4, 2 * 3 * 5 * 3), &[2, 3, 5, 3])];
        assert_eq!(gradient_check(&mut MatMul::new(), &xs), 60 + 90);
    }

    #[test]
    fn only_the_gradients_asked_for_are_made() {
        let [a, b, dy] = case();
        let xs = vec![t(&a, &[2, 2, 3, 4]), t(&b, &[2, 2, 4, 5])];
        let mut mm = MatMul::new();
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let none = || ParamsMut::new(&mut [], &[]);
        mm.forward_many(xs.clone(), Params::new(&[], &[]), none(), &ctx).unwrap();
        let grads = [InputGrad::Skip, InputGrad::Needed];
        let d = mm.backward_many(t(&dy, &[2, 2, 3, 5]), Params::new(&[], &[]), none(), &grads, &ctx).unwrap();
        assert_eq!(d[0], None);
        assert_eq!(d[1].as_ref().unwrap().host(), TORCH_DB);
        let e = mm.backward_many(t(&dy, &[2, 2, 3, 5]), Params::new(&[], &[]), none(), &grads, &ctx).unwrap_err();
        assert!(e.to_string().contains("no training forward"), "{e}");
        // Evaluation keeps nothing.
        mm.forward_many(xs, Params::new(&[], &[]), none(), &Ctx::eval(Device::Cpu(0))).unwrap();
        assert!(mm.kept.is_none());
    }

    #[test]
    fn shapes_that_do_not_meet_are_refused_naming_both() {
        let m = |inputs: &[Shape]| MatMul::new().output_shape_many(inputs);
        assert_eq!(m(&[s(&[4, 2, 3, 5]), s(&[4, 2, 5, 7])]).unwrap(), s(&[4, 2, 3, 7]));
        let e = m(&[s(&[4, 3, 5]), s(&[4, 4, 7])]).unwrap_err().to_string();
        assert!(e.contains("the first's K (5) is not the second's (4)") && e.contains("(3, 5), (4, 7)"), "{e}");
        let e = m(&[s(&[4, 2, 3, 5]), s(&[4, 3, 5, 7])]).unwrap_err().to_string();
        assert!(e.contains("same leading dimensions") && e.contains("(2, 3, 5), (3, 5, 7)"), "{e}");
        let e = m(&[s(&[4, 3, 5]), s(&[4, 2, 5, 7])]).unwrap_err().to_string();
        assert!(e.contains("same leading dimensions"), "{e}");
        let e = m(&[s(&[4, 5]), s(&[4, 5, 7])]).unwrap_err().to_string();
        assert!(e.contains("at least two dimensions") && e.contains("(5), (5, 7)"), "{e}");
        let e = m(&[s(&[4, 5, 5]), s(&[4, 5, 5]), s(&[4, 5, 5])]).unwrap_err().to_string();
        assert!(e.contains("takes 2 inputs, given 3"), "{e}");
        let e = MatMul::new().output_shape(&s(&[4, 5, 5])).unwrap_err().to_string();
        assert!(e.contains("MatMul takes 2 inputs"), "{e}");
    }

    #[test]
    fn the_spec_form_and_memory_account() {
        assert_eq!(MatMul::new().spec().unwrap(), json!({"type": "matmul"}));
        let shapes = LayerShapes { input: s(&[2, 3, 5]), output: s(&[2, 3, 7]), other_inputs: vec![s(&[2, 5, 7])] };
        let mem = MatMul::new().memory(&shapes).unwrap();
        assert_eq!(mem.kept_per_sample, (30 + 70) * 4);
        assert_eq!(
            mem.gemm,
            [(3, 7, 5), (3, 5, 7), (5, 7, 3)].map(|(m, n, k)| gemm_packing(m, n, k)).into_iter().max().unwrap()
        );
        let parse = |inputs: &[Shape]| {
            let map = serde_json::Map::new();
            let build = (MatMul::SPEC.parse)(&mut crate::ops::spec::Fields::new(&map)).unwrap();
            build.build_many(inputs).map(|ls| ls[0].describe())
        };
        assert_eq!(parse(&[s(&[2, 3, 5]), s(&[2, 5, 1])]).unwrap(), "MatMul");
        let e = parse(&[s(&[2, 3, 5]), s(&[2, 4, 1])]).unwrap_err();
        assert!(e.contains("samples of shapes (3, 5), (4, 1)"), "{e}");
    }

    /// What a training forward keeps for its backward is what its account states, to the
    /// small vectors of its shapes (under 256 bytes).
    #[test]
    fn the_memory_account_is_what_a_forward_keeps() {
        let xs: Vec<Tensor> = vec![t(&values(1, 16 * 50), &[16, 5, 10]), t(&values(2, 16 * 40), &[16, 10, 4])];
        let (kept, stated) = crate::ops::merge::testing::kept_bytes(&mut MatMul::new(), xs);
        assert!((kept - stated).abs() < 256, "kept {kept} B, stated {stated} B");
    }

    /// The GPU form (cuBLAS's products) against the CPU's.
    #[cfg(feature = "cuda")]
    #[test]
    fn runs_on_a_gpu_as_on_the_cpu() {
        const TEST: &str = "runs_on_a_gpu_as_on_the_cpu";
        let xs = vec![t(&values(1, 2 * 3 * 5 * 8), &[2, 3, 5, 8]), t(&values(2, 2 * 3 * 8 * 6), &[2, 3, 8, 6])];
        let dy = values(9, 2 * 3 * 5 * 6);
        let (want_y, want) = run(&mut MatMul::new(), &xs, &dy);
        let Some((y, grads)) = crate::ops::merge::on_gpu::run(TEST, &MatMul::new(), &xs, &dy) else { return };
        // cuBLAS sums in its own order: within 1e-5 of sums of 8 terms below 1 (f32's
        // rounding is some 1e-7 of each).
        let close = |what: &str, got: &[f32], want: &[f32]| {
            for (e, (g, w)) in got.iter().zip(want).enumerate() {
                assert!((g - w).abs() <= 1e-5, "{what}[{e}]: gpu {g} vs cpu {w}");
            }
        };
        close("y", &y, want_y.host());
        for (i, (g, w)) in grads.iter().zip(&want).enumerate() {
            close(&format!("input {i}'s gradient"), g, w.host());
        }
    }
}
