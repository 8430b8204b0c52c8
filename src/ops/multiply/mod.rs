//! Multiply, the elementwise product of two or more inputs of one shape: Keras's
//! `Multiply()` merge layer, ATen's `mul.Tensor` (PyTorch's `x0 * x1`) without
//! broadcasting: a gated MLP's gate (SwiGLU's silu(x·W1) ⊙ x·W3). The layer (its spec entry
//! `multiply`, its spec form, its memory account: it keeps its inputs for the backward),
//! built on its CPU forward and backward ([`cpu`]: each product in input order); its GPU
//! form is [`gpu`] (kernels/multiply.cu).
//!
//! Shapes: every input (N, ...) of one shape, batch included, and so the output; inputs
//! whose shapes differ are refused, every input's shape named (no broadcasting, as `add`).
//!
//! Gradients: dx_i = dy · Π_{j ≠ i} x_j, from the inputs a training forward keeps (shared
//! with whoever else holds them, not copied: a [`Tensor`] clone).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::merge::{one_shape, shapes_of};
use super::spec::{Build, LayerType};
use super::{Arity, Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut, F32};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// The product of its inputs; holds them from the training forward for the backward.
#[derive(Clone, Debug, Default)]
pub struct Multiply {
    kept: Vec<Tensor>,
    /// Which of its two inputs arrives before the SiLU whose output it is, the SiLU run
    /// here on the CPU ([`Layer::take_input_silu`]): SwiGLU's silu(x·W1) ⊙ x·W3 in one
    /// pass each way.
    silu_at: Option<usize>,
}

impl Multiply {
    pub fn new() -> Multiply {
        Multiply::default()
    }

    /// The spec entry: Keras's `Multiply()`, no fields.
    pub const SPEC: LayerType = LayerType {
        name: "multiply",
        fields: "none (2 or more inputs of one shape)",
        example: (&[2, 3], r#"{"type": "multiply", "inbound": ["input", "input"]}"#),
        parse: |_| {
            Ok(Build::merge(|inputs| {
                one_shape(inputs)?;
                Ok(Multiply::new())
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

impl Multiply {
    /// The forward with the SiLU of input `at` in it: y = silu(g)·u, g the SiLU's input, u
    /// the other. Training keeps g and u, evaluation nothing (g's storage becomes y where
    /// nobody else holds it).
    fn silu_forward(&mut self, xs: Vec<Tensor>, at: usize, shape: Shape, ctx: &Ctx) -> Result<Tensor> {
        let device = xs[0].device();
        let mut xs = xs.into_iter();
        let (x0, x1) = (xs.next().expect("two inputs"), xs.next().expect("two inputs"));
        let (g, u) = if at == 0 { (x0, x1) } else { (x1, x0) };
        if ctx.mode == Mode::Train {
            let y = cpu::silu_product(g.host(), u.host());
            self.kept = vec![g, u];
            return Tensor::from_vec_on(y, shape, device);
        }
        let y = match g.into_unshared_vec() {
            Ok(mut y) => {
                cpu::silu_product_into(&mut y, u.host());
                y
            }
            Err(g) => cpu::silu_product(g.host(), u.host()),
        };
        Tensor::from_vec_on(y, shape, device)
    }
}

/// The backward of [`Multiply::silu_forward`] from its kept g and u: dg (through the
/// SiLU) and du, each where asked for, in input order. dout's storage becomes dg, or du
/// alone; with both, du is written over g's where nobody else holds it.
fn silu_backward(
    kept: Vec<Tensor>,
    at: usize,
    mut dout: Tensor,
    input_grads: &[InputGrad],
) -> Result<Vec<Option<Tensor>>> {
    let [g, u]: [Tensor; 2] = kept.try_into().expect("the SiLU's product keeps two inputs");
    let (want_g, want_u) = (input_grads[at] == InputGrad::Needed, input_grads[1 - at] == InputGrad::Needed);
    let (dg, du) = match (want_g, want_u) {
        (false, false) => (None, None),
        (true, false) => {
            cpu::silu_product_backward_g(g.host(), u.host(), dout.host_mut());
            (Some(dout), None)
        }
        (false, true) => {
            cpu::silu_product_backward_u(g.host(), dout.host_mut());
            (None, Some(dout))
        }
        (true, true) => {
            let shape = g.shape().clone();
            let mut du = g.into_vec();
            cpu::silu_product_backward_over(&mut du, u.host(), dout.host_mut());
            let du = Tensor::from_vec_on(du, shape, dout.device())?;
            (Some(dout), Some(du))
        }
    };
    Ok(if at == 0 { vec![dg, du] } else { vec![du, dg] })
}

impl Layer for Multiply {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "multiply"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "multiply"}))
    }

    /// Its inputs, every value of each, kept for the backward (their gradients' factors).
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let values: u64 = shapes.inputs().map(|s| s.numel() as u64).sum();
        Some(LayerMemory { kept_per_sample: values.saturating_mul(F32), ..LayerMemory::NONE })
    }

    fn arity(&self) -> Arity {
        Arity::AtLeast(2)
    }

    super::merge::one_input_forms_refused!("Multiply");

    fn output_shape_many(&self, inputs: &[Shape]) -> Result<Shape> {
        one_shape(inputs).map_err(|e| Error::shape("Multiply", e))
    }

    // xs: K tensors of one shape (N, ...) → y: (N, ...), ((x0 · x1) · x2) · ...; training
    // keeps the K inputs
    fn forward_many(&mut self, xs: Vec<Tensor>, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let shape = self.output_shape_many(&shapes_of(&xs))?;
        for x in &xs[1..] {
            xs[0].same_device("Multiply", x)?;
        }
        let device = xs[0].device();
        self.kept.clear();
        if let Some(at) = self.silu_at {
            return self.silu_forward(xs, at, shape, ctx);
        }
        if ctx.mode == Mode::Train {
            let factors: Vec<&[f32]> = xs[1..].iter().map(Tensor::host).collect();
            let mut y = vec![0.0; shape.numel()];
            cpu::product_to(xs[0].host(), &factors, &mut y);
            self.kept = xs;
            return Tensor::from_vec_on(y, shape, device);
        }
        // Evaluation keeps nothing: the first input's values become the product where
        // nobody else holds them.
        let mut xs = xs.into_iter();
        let first = xs.next().expect("two or more inputs");
        let rest: Vec<Tensor> = xs.collect();
        let factors: Vec<&[f32]> = rest.iter().map(Tensor::host).collect();
        let y = match first.into_unshared_vec() {
            Ok(mut y) => {
                cpu::product_into(&mut y, &factors);
                y
            }
            Err(first) => {
                let mut y = vec![0.0; first.numel()];
                cpu::product_to(first.host(), &factors, &mut y);
                y
            }
        };
        Tensor::from_vec_on(y, shape, device)
    }

    // dout: (N, ...) → dx_i = ((dout · x_a) · x_b) · ..., a < b < ... ≠ i: (N, ...) each
    fn backward_many(
        &mut self,
        mut dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grads: &[InputGrad],
        _ctx: &Ctx,
    ) -> Result<Vec<Option<Tensor>>> {
        let kept = std::mem::take(&mut self.kept);
        if kept.is_empty() {
            return Err(Error::config("Multiply backward", "no training forward to differentiate"));
        }
        if dout.shape() != kept[0].shape() || input_grads.len() != kept.len() {
            return Err(Error::shape(
                "Multiply backward",
                format!(
                    "dout {} and {} inputs for a forward of {} from {}",
                    dout.shape(),
                    input_grads.len(),
                    kept[0].shape(),
                    kept.len()
                ),
            ));
        }
        if let Some(at) = self.silu_at {
            return silu_backward(kept, at, dout, input_grads);
        }
        let xs: Vec<&[f32]> = kept.iter().map(Tensor::host).collect();
        let last = input_grads.iter().rposition(|&g| g == InputGrad::Needed);
        let mut grads: Vec<Option<Tensor>> = Vec::with_capacity(kept.len());
        for (i, &g) in input_grads.iter().enumerate() {
            grads.push(match g {
                InputGrad::Skip => None,
                // The last gradient asked for is written over dout, which no other reads
                // after it.
                InputGrad::Needed if Some(i) == last => {
                    cpu::product_into(dout.host_mut(), &cpu::others(&xs, i));
                    Some(dout.clone())
                }
                InputGrad::Needed => {
                    let mut dx = vec![0.0; dout.numel()];
                    cpu::product_to(dout.host(), &cpu::others(&xs, i), &mut dx);
                    Some(Tensor::from_vec_on(dx, dout.shape().clone(), dout.device())?)
                }
            });
        }
        Ok(grads)
    }

    /// Two inputs, one of them a SiLU's output that nothing else reads: the product
    /// applies that SiLU to the value it arrives as (its input), bit for bit the two
    /// layers' results, without a pass over the SiLU's output either way.
    fn take_input_silu(&mut self, input: usize, inputs: usize) -> bool {
        self.silu_at = (inputs == 2 && input < 2).then_some(input);
        self.silu_at.is_some()
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Multiply::new())
    }

    fn describe(&self) -> String {
        "Multiply".into()
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

    /// scripts/torch_multiply.py's case: x0, x1, x2 (2, 3) and dy (2, 3) by its formulas.
    fn case() -> (Vec<Tensor>, Vec<f32>) {
        let xs = (0..3)
            .map(|k| {
                let v: Vec<f32> = (0..6).map(|i| (((i * 37 + k * 11) % 23) as f32 - 11.0) / 7.0).collect();
                t(&v, &[2, 3])
            })
            .collect();
        let dy = (0..6).map(|i| (((i * 13) % 17) as f32 - 8.0) / 16.0).collect();
        (xs, dy)
    }

    /// The output of scripts/torch_multiply.py: per element (y, dx0, dx1, dx2), y = x0 * x1 *
    /// x2 as PyTorch multiplies in float32, left to right, and each input's gradient by
    /// PyTorch's autograd, which forms them in its own order: dx0 = (dy·x2)·x1, dx1 =
    /// (dy·x2)·x0 (the last product's backward first), dx2 = dy·(x0·x1), so not every one
    /// is our ordered product's bits.
    /// // torch 2.15.0+cu132
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)] // the values as the script prints them, f32's in f64 digits
    const TORCH: &[(f32, f32, f32, f32)] = &[
        (-0.0, -0.0, 1.2346937656402588, 0.0),
        (-0.1574344038963318, -0.11479592323303223, 0.03826530650258064, -0.17219386994838715),
        (0.6122449040412903, -0.0446428582072258, 0.0535714291036129, -0.03826530650258064),
        (-0.6530612707138062, 0.1071428656578064, -0.2142857313156128, 0.12244898825883865),
        (0.05830904096364975, 0.1785714328289032, -0.01785714365541935, 0.0892857164144516),
        (0.3206997215747833, -0.08418367803096771, 0.8418367505073547, -0.07653061300516129),
    ];

    /// y bit for bit (the same products in the same order); each gradient within one
    /// rounding of each of its two products, 2.5·10⁻⁷ relative (PyTorch orders a
    /// gradient's factors its own way).
    #[test]
    fn multiply_matches_pytorch() {
        let (xs, dy) = case();
        let (y, grads) = run(&mut Multiply::new(), &xs, &dy);
        for (e, &(ty, d0, d1, d2)) in TORCH.iter().enumerate() {
            assert_eq!(y.host()[e].to_bits(), ty.to_bits(), "y[{e}]: {} vs torch {ty}", y.host()[e]);
            for (k, want) in [d0, d1, d2].into_iter().enumerate() {
                let got = grads[k].host()[e];
                assert!((got - want).abs() <= 2.5e-7 * want.abs(), "dx{k}[{e}]: {got} vs torch {want}");
            }
        }
    }

    #[test]
    fn every_inputs_gradient_is_the_gradient_of_the_forward() {
        let xs: Vec<Tensor> = (0..3).map(|s| t(&values(s, 24), &[2, 3, 4])).collect();
        assert_eq!(gradient_check(&mut Multiply::new(), &xs), 72);
        let xs: Vec<Tensor> = (5..7).map(|s| t(&values(s, 10), &[5, 2])).collect();
        assert_eq!(gradient_check(&mut Multiply::new(), &xs), 20);
    }

    /// Evaluation keeps nothing and computes the training output; only the gradients
    /// asked for are made; a backward without a training forward is refused.
    #[test]
    fn evaluation_keeps_nothing_and_skipped_gradients_are_not_made() {
        let (xs, dy) = case();
        let (y, _) = run(&mut Multiply::new(), &xs, &dy);
        let mut m = Multiply::new();
        let none = || ParamsMut::new(&mut [], &[]);
        let eval = m.forward_many(xs.clone(), Params::new(&[], &[]), none(), &Ctx::eval(Device::Cpu(0))).unwrap();
        assert_eq!(eval, y);
        assert!(m.kept.is_empty());
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        m.forward_many(xs.clone(), Params::new(&[], &[]), none(), &ctx).unwrap();
        let grads = [InputGrad::Skip, InputGrad::Needed, InputGrad::Skip];
        let d = m.backward_many(t(&dy, &[2, 3]), Params::new(&[], &[]), none(), &grads, &ctx).unwrap();
        let (_, all) = run(&mut Multiply::new(), &xs, &dy);
        assert_eq!(d, vec![None, Some(all[1].clone()), None]);
        let e = m.backward_many(t(&dy, &[2, 3]), Params::new(&[], &[]), none(), &grads, &ctx).unwrap_err();
        assert!(e.to_string().contains("no training forward"), "{e}");
    }

    #[test]
    fn inputs_that_do_not_meet_are_refused_naming_every_shape() {
        let s = |d: &[usize]| Shape::new(d.to_vec());
        let e = Multiply::new().output_shape_many(&[s(&[4, 2, 3]), s(&[4, 3, 2])]).unwrap_err().to_string();
        assert!(e.contains("samples of shapes (2, 3), (3, 2)") && e.contains("one shape"), "{e}");
        let e = Multiply::new().output_shape_many(&[s(&[4, 2])]).unwrap_err().to_string();
        assert!(e.contains("takes 2 or more inputs, given 1"), "{e}");
        let e = Multiply::new().forward(
            t(&[1.0], &[1, 1]),
            Params::new(&[], &[]),
            ParamsMut::new(&mut [], &[]),
            &Ctx::eval(Device::Cpu(0)),
        );
        assert!(e.unwrap_err().to_string().contains("Multiply takes 2 or more inputs"));
    }

    #[test]
    fn the_spec_form_and_memory_account() {
        let s = |d: &[usize]| Shape::new(d.to_vec());
        assert_eq!(Multiply::new().spec().unwrap(), json!({"type": "multiply"}));
        let shapes = LayerShapes { input: s(&[3, 4]), output: s(&[3, 4]), other_inputs: vec![s(&[3, 4]); 2] };
        assert_eq!(Multiply::new().memory(&shapes).unwrap().kept_per_sample, 3 * 12 * 4);
    }

    /// What a training forward keeps for its backward is what its account states, to the
    /// small vectors of its shapes (under 256 bytes).
    #[test]
    fn the_memory_account_is_what_a_forward_keeps() {
        let xs: Vec<Tensor> = (0..3).map(|s| t(&values(s, 16 * 50), &[16, 5, 10])).collect();
        let (kept, stated) = crate::ops::merge::testing::kept_bytes(&mut Multiply::new(), xs);
        assert!((kept - stated).abs() < 256, "kept {kept} B, stated {stated} B");
    }

    /// The GPU form against the CPU's, bit for bit (the same roundings in the same order).
    #[cfg(feature = "cuda")]
    #[test]
    fn runs_on_a_gpu_as_on_the_cpu() {
        const TEST: &str = "runs_on_a_gpu_as_on_the_cpu";
        let xs: Vec<Tensor> = (0..3).map(|s| t(&values(s, 2 * 300), &[2, 3, 100])).collect();
        let dy = values(9, 600);
        let (want_y, want) = run(&mut Multiply::new(), &xs, &dy);
        let Some((y, grads)) = crate::ops::merge::on_gpu::run(TEST, &Multiply::new(), &xs, &dy) else { return };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&y), bits(want_y.host()), "y");
        for (i, (g, w)) in grads.iter().zip(&want).enumerate() {
            assert_eq!(bits(g), bits(w.host()), "input {i}'s gradient");
        }
    }

    /// With the SiLU of either input taken over (SwiGLU's gate), the forward in training
    /// and evaluation and every choice of gradients are the SiLU layer then the product,
    /// bit for bit; values past ±88 included, on more values than one piece.
    #[test]
    fn a_silu_taken_over_gives_the_two_layers_bits() {
        use crate::ops::silu::Silu;
        let n = 2 * cpu::CHUNK + 7;
        let mut g = values(11, n);
        g.iter_mut().step_by(97).for_each(|v| *v *= 120.0);
        let (g, u, dy) = (t(&g, &[n]), t(&values(12, n), &[n]), values(13, n));
        let none = || ParamsMut::new(&mut [], &[]);
        let p = || Params::new(&[], &[]);
        let train = Ctx::train(0, 0, 0, Device::Cpu(0));
        for at in 0..2 {
            let mut fused = Multiply::new();
            assert!(fused.take_input_silu(at, 2));
            assert!(!Multiply::new().take_input_silu(at, 3), "only a product of two takes a SiLU");
            let inputs = |first: Tensor| if at == 0 { vec![first, u.clone()] } else { vec![u.clone(), first] };
            for needs in
                [[InputGrad::Needed; 2], [InputGrad::Needed, InputGrad::Skip], [InputGrad::Skip, InputGrad::Needed]]
            {
                // The two layers one after the other.
                let mut silu = Silu::new();
                let z = silu.forward(g.clone(), p(), none(), &train).unwrap();
                let mut product = Multiply::new();
                let want_y = product.forward_many(inputs(z), p(), none(), &train).unwrap();
                let mut want = product.backward_many(t(&dy, &[n]), p(), none(), &needs, &train).unwrap();
                if let Some(dz) = want[at].take() {
                    want[at] = silu.backward(dz, p(), none(), InputGrad::Needed, &train).unwrap();
                }
                // The product with the SiLU in it.
                let y = fused.forward_many(inputs(g.clone()), p(), none(), &train).unwrap();
                let got = fused.backward_many(t(&dy, &[n]), p(), none(), &needs, &train).unwrap();
                assert_eq!(
                    y.host().iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want_y.host().iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "y, SiLU at {at}"
                );
                for (k, (got, want)) in got.iter().zip(&want).enumerate() {
                    let bits = |d: &Option<Tensor>| {
                        d.as_ref().map(|d| d.host().iter().map(|v| v.to_bits()).collect::<Vec<_>>())
                    };
                    assert_eq!(bits(got), bits(want), "dx{k}, SiLU at {at}, {needs:?}");
                }
                let eval = fused.forward_many(inputs(g.clone()), p(), none(), &Ctx::eval(Device::Cpu(0))).unwrap();
                assert_eq!(
                    eval.host().iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want_y.host().iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "evaluation, SiLU at {at}"
                );
            }
        }
    }
}
