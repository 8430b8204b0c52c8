//! Add, the sum of two or more inputs of one shape: Keras's `Add()` merge layer, ATen's
//! `add.Tensor` (PyTorch's `x0 + x1`) without broadcasting. The layer (its spec entry
//! `add`, its spec form, its memory account: it keeps nothing), built on its CPU forward
//! ([`cpu`]: each value summed in input order, ((x0 + x1) + x2) + ...); its GPU form is
//! [`gpu`] (kernels/add.cu), which also holds `Gpu::add_into` (y += x), the accumulation a
//! graph sums the gradients of a value read by several nodes with.
//!
//! Shapes: every input (N, ...) of one shape, batch included, and so the output. Inputs
//! whose shapes differ are refused, every input's shape named: no broadcasting, since a
//! graph's shapes are known before it runs and a sum that broadcasts would hide a wiring
//! mistake (a bias of a layer's own is a parameter, not a merge).
//!
//! The backward is free: every input's gradient is the output's, handed on as the same
//! values (a [`Tensor`] clone shares them until someone writes; the last input asked for
//! gets `dout` itself).
//!
//! A ReLU after the add (a residual block's, `model::residual`) runs in its passes on the
//! CPU where the graph hands it over ([`Layer::take_following_relu`]): the sum of two
//! inputs and the clamp in one pass over the values (`Relu::forward_sum`), the ReLU's mask
//! applied to the gradient before it is handed on; bit for bit what the two nodes compute
//! one after the other.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::merge::{one_shape, shapes_of};
use super::spec::{Build, LayerType};
use super::{Arity, Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut, Relu};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// The sum of its inputs; holds the output's shape and the number of inputs from the
/// training forward, for the backward's checks, and the ReLU after it when it runs in
/// its passes.
#[derive(Clone, Debug, Default)]
pub struct Add {
    cached: Option<(Shape, usize)>,
    relu: Option<Relu>,
}

impl Add {
    pub fn new() -> Add {
        Add::default()
    }

    /// The spec entry: Keras's `Add()`, no fields.
    pub const SPEC: LayerType = LayerType {
        name: "add",
        fields: "none (2 or more inputs of one shape)",
        example: (&[2, 3], r#"{"type": "add", "inbound": ["input", "input"]}"#),
        parse: |_| {
            Ok(Build::merge(|inputs| {
                one_shape(inputs)?;
                Ok(Add::new())
            }))
        },
        #[cfg(feature = "cuda")]
        kernels: Some(&gpu::KERNELS),
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Values,
            #[cfg(feature = "cuda")]
            host: Some(gpu::host_check),
        },
    };
}

impl Layer for Add {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "add"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "add"}))
    }

    /// Nothing kept of its own: the backward hands the output's gradient on. With the
    /// following ReLU taken over, that ReLU's mask (a byte a value), which the graph then
    /// does not count for the ReLU's node.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let mask = if self.relu.is_some() { shapes.output.numel() as u64 } else { 0 };
        Some(LayerMemory { kept_per_sample: mask, ..LayerMemory::NONE })
    }

    fn arity(&self) -> Arity {
        Arity::AtLeast(2)
    }

    super::merge::one_input_forms_refused!("Add");

    fn output_shape_many(&self, inputs: &[Shape]) -> Result<Shape> {
        one_shape(inputs).map_err(|e| Error::shape("Add", e))
    }

    // xs: K tensors of one shape (N, ...) → y: (N, ...), ((x0 + x1) + x2) + ...
    fn forward_many(&mut self, xs: Vec<Tensor>, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let shape = self.output_shape_many(&shapes_of(&xs))?;
        for x in &xs[1..] {
            xs[0].same_device("Add", x)?;
        }
        let k = xs.len();
        let device = xs[0].device();
        let mut xs = xs.into_iter();
        let first = xs.next().expect("two or more inputs");
        let rest: Vec<Tensor> = xs.collect();
        self.cached = (ctx.mode == Mode::Train).then_some((shape.clone(), k));
        if let (Some(relu), [second]) = (&mut self.relu, rest.as_slice()) {
            // x0 + x1 and the ReLU in one pass, over x0's values (copied first only where
            // someone else holds them).
            return relu.forward_sum(first, second, ctx);
        }
        let terms: Vec<&[f32]> = rest.iter().map(Tensor::host).collect();
        // The first input's values become the sum where nobody else holds them; else the
        // sum goes to a buffer of its own, in the same one pass over the values.
        let y = match first.into_unshared_vec() {
            Ok(mut y) => {
                cpu::sum_into(&mut y, &terms);
                y
            }
            Err(first) => {
                let mut y = vec![0.0; first.numel()];
                cpu::sum_to(first.host(), &terms, &mut y);
                y
            }
        };
        let y = Tensor::from_vec_on(y, shape, device)?;
        match &mut self.relu {
            Some(relu) => relu.forward(y, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), ctx),
            None => Ok(y),
        }
    }

    // dout: (N, ...) → each input's gradient: dout itself (shared, not copied)
    fn backward_many(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grads: &[InputGrad],
        ctx: &Ctx,
    ) -> Result<Vec<Option<Tensor>>> {
        let (shape, k) =
            self.cached.take().ok_or_else(|| Error::config("Add backward", "no training forward to differentiate"))?;
        if dout.shape() != &shape || input_grads.len() != k {
            return Err(Error::shape(
                "Add backward",
                format!("dout {} and {} inputs for a forward of {shape} from {k}", dout.shape(), input_grads.len()),
            ));
        }
        let last = input_grads.iter().rposition(|&g| g == InputGrad::Needed);
        let dout = match (&mut self.relu, last) {
            (Some(relu), Some(_)) => {
                let none = ParamsMut::new(&mut [], &[]);
                relu.backward(dout, Params::new(&[], &[]), none, InputGrad::Needed, ctx)?.expect("asked for")
            }
            _ => dout,
        };
        let mut dout = Some(dout);
        Ok(input_grads
            .iter()
            .enumerate()
            .map(|(i, &g)| match (g, Some(i) == last) {
                (InputGrad::Skip, _) => None,
                (InputGrad::Needed, false) => dout.clone(),
                (InputGrad::Needed, true) => dout.take(),
            })
            .collect())
    }

    /// The ReLU after an add runs in its passes: one pass of the training forward and one
    /// of the backward fewer over the activations.
    fn take_following_relu(&mut self, follows: bool) -> bool {
        self.relu = follows.then(Relu::new);
        follows
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Add { cached: None, relu: self.relu.as_ref().map(|_| Relu::new()) })
    }

    fn describe(&self) -> String {
        "Add".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::merge::testing::{gradient_check, run, values};

    fn t(v: &[f32], dims: &[usize]) -> Tensor {
        Tensor::from_vec(v.to_vec(), dims.to_vec()).unwrap()
    }

    /// scripts/torch_add.py's case: x0, x1, x2 (2, 3) and dy (2, 3) by its formulas (x0[0] =
    /// 1e8 and x1[0] = −1e8, so that the order of the sum shows).
    fn case() -> (Vec<Tensor>, Vec<f32>) {
        let xs = (0..3)
            .map(|k| {
                let mut v: Vec<f32> = (0..6).map(|i| (((i * 37 + k * 11) % 23) as f64 - 11.0) as f32 / 7.0).collect();
                v[0] = [1e8, -1e8, 0.375][k];
                t(&v, &[2, 3])
            })
            .collect();
        let dy = (0..6).map(|i| (((i * 13) % 17) as f32 - 8.0) / 16.0).collect();
        (xs, dy)
    }

    /// The output of scripts/torch_add.py: per element (y, dx0, dx1, dx2), y = x0 + x1 + x2
    /// as PyTorch sums it in float32, left to right, and each input's gradient.
    /// // torch 2.15.0+cu132
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)] // the values as the script prints them, f32's in f64 digits
    const TORCH: &[(f32, f32, f32, f32)] = &[
        (0.375, -0.5, -0.5, -0.5),
        (-0.5714285373687744, 0.3125, 0.3125, 0.3125),
        (-1.1428570747375488, 0.0625, 0.0625, 0.0625),
        (1.5714285373687744, -0.1875, -0.1875, -0.1875),
        (1.0, -0.4375, -0.4375, -0.4375),
        (-2.857142925262451, 0.375, 0.375, 0.375),
    ];

    /// Bit for bit: the same additions in the same order, each rounded once in f32.
    #[test]
    fn add_matches_pytorch_bit_for_bit() {
        let (xs, dy) = case();
        let (y, grads) = run(&mut Add::new(), &xs, &dy);
        assert_eq!(y.shape(), &Shape::new([2, 3]));
        for (e, &(ty, d0, d1, d2)) in TORCH.iter().enumerate() {
            assert_eq!(y.host()[e].to_bits(), ty.to_bits(), "y[{e}]: {} vs torch {ty}", y.host()[e]);
            for (k, want) in [d0, d1, d2].into_iter().enumerate() {
                assert_eq!(grads[k].host()[e], want, "dx{k}[{e}]");
            }
        }
        // In another order x2[0] is lost: (1e8 + 0.375) rounds back to 1e8.
        let (y, _) = run(&mut Add::new(), &[xs[0].clone(), xs[2].clone(), xs[1].clone()], &dy);
        assert_eq!(y.host()[0], 0.0);
    }

    #[test]
    fn every_inputs_gradient_is_the_gradient_of_the_forward() {
        let xs: Vec<Tensor> = (0..3).map(|s| t(&values(s, 24), &[2, 3, 4])).collect();
        assert_eq!(gradient_check(&mut Add::new(), &xs), 72);
    }

    /// A shared first input is left as it was; an unshared one becomes the sum (no new
    /// buffer); the backward hands out dout's own values, once per input asked for.
    #[test]
    fn the_forward_and_backward_copy_nothing_they_need_not() {
        let (a, b) = (t(&[1.0, 2.0], &[1, 2]), t(&[10.0, 20.0], &[1, 2]));
        let mut add = Add::new();
        let ctx = Ctx::train(0, 0, 0, crate::tensor::Device::Cpu(0));
        let none = || ParamsMut::new(&mut [], &[]);
        let y = add.forward_many(vec![a.clone(), b.clone()], Params::new(&[], &[]), none(), &ctx).unwrap();
        assert_eq!((y.host(), a.host()), (&[11.0, 22.0][..], &[1.0, 2.0][..]));
        let dy = t(&[0.5, 0.25], &[1, 2]);
        let grads = [InputGrad::Needed, InputGrad::Skip];
        let d = add.backward_many(dy.clone(), Params::new(&[], &[]), none(), &grads, &ctx).unwrap();
        assert_eq!(d, vec![Some(dy.clone()), None]);
        assert!(std::ptr::eq(d[0].as_ref().unwrap().host().as_ptr(), dy.host().as_ptr()), "dout's own values");
        // A second backward without a forward is refused.
        let e = add.backward_many(dy, Params::new(&[], &[]), none(), &grads, &ctx).unwrap_err().to_string();
        assert!(e.contains("no training forward"), "{e}");
    }

    #[test]
    fn inputs_that_do_not_meet_are_refused_naming_every_shape() {
        let s = |d: &[usize]| Shape::new(d.to_vec());
        let e = Add::new().output_shape_many(&[s(&[2, 3]), s(&[2, 3]), s(&[2, 4])]).unwrap_err().to_string();
        assert!(e.contains("(3), (3), (4)") && e.contains("one shape"), "{e}");
        let e = Add::new().output_shape_many(&[s(&[2, 3])]).unwrap_err().to_string();
        assert!(e.contains("takes 2 or more inputs, given 1"), "{e}");
        let e = Add::new().output_shape_many(&[s(&[2, 3]), s(&[5, 3])]).unwrap_err().to_string();
        assert!(e.contains("(2, 3), (5, 3)") && e.contains("batches differ"), "{e}");
        // The one-input forms say it is a merge.
        let e = Add::new().output_shape(&s(&[2, 3])).unwrap_err().to_string();
        assert!(e.contains("Add takes 2 or more inputs"), "{e}");
        // And the forward checks as the shapes do.
        let ctx = Ctx::eval(crate::tensor::Device::Cpu(0));
        let xs = vec![t(&[1.0; 6], &[2, 3]), t(&[1.0; 6], &[3, 2])];
        let e = Add::new().forward_many(xs, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx);
        assert!(e.unwrap_err().to_string().contains("(2, 3), (3, 2)"));
    }

    #[test]
    fn the_spec_entry_builds_an_add_of_inputs_that_meet() {
        let parse = |inputs: &[Shape]| {
            let map = serde_json::Map::new();
            let build = (Add::SPEC.parse)(&mut super::super::spec::Fields::new(&map)).unwrap();
            build.build_many(inputs).map(|ls| ls.iter().map(|l| l.describe()).collect::<Vec<_>>())
        };
        let s = |d: &[usize]| Shape::new(d.to_vec());
        assert_eq!(parse(&[s(&[2, 3]), s(&[2, 3])]).unwrap(), ["Add"]);
        let e = parse(&[s(&[2, 3]), s(&[2, 4])]).err().unwrap();
        assert_eq!(e, "takes inputs of one shape, got samples of shapes (3), (4)");
        assert_eq!(Add::new().spec().unwrap(), json!({"type": "add"}));
        assert_eq!(Add::new().memory(&LayerShapes::one(s(&[3]), s(&[3]))), Some(LayerMemory::NONE));
    }

    /// What a training forward keeps for its backward is what its account states, to the
    /// small vectors of its shapes (under 256 bytes).
    #[test]
    fn the_memory_account_is_what_a_forward_keeps() {
        let xs: Vec<Tensor> = (0..3).map(|s| t(&values(s, 16 * 50), &[16, 5, 10])).collect();
        let (kept, stated) = crate::ops::merge::testing::kept_bytes(&mut Add::new(), xs);
        assert!((kept - stated).abs() < 256, "kept {kept} B, stated {stated} B");
    }

    /// The GPU form against the CPU's, bit for bit (the same roundings in the same order).
    #[cfg(feature = "cuda")]
    #[test]
    fn runs_on_a_gpu_as_on_the_cpu() {
        const TEST: &str = "runs_on_a_gpu_as_on_the_cpu";
        let xs: Vec<Tensor> = (0..3).map(|s| t(&values(s, 2 * 300), &[2, 3, 100])).collect();
        let dy = values(9, 600);
        let (want_y, want) = run(&mut Add::new(), &xs, &dy);
        let Some((y, grads)) = crate::ops::merge::on_gpu::run(TEST, &Add::new(), &xs, &dy) else { return };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&y), bits(want_y.host()), "y");
        for (i, (g, w)) in grads.iter().zip(&want).enumerate() {
            assert_eq!(bits(g), bits(w.host()), "input {i}'s gradient");
        }
    }
}
