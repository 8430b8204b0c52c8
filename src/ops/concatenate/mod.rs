//! Concatenate, two or more inputs joined along one axis: Keras's `Concatenate(axis=-1)`
//! merge layer, ATen's `cat`; a U-Net's skip connections, a DenseNet's growing feature maps.
//! The layer (its spec entry `concatenate`, its spec form, its memory account: it keeps
//! nothing but the inputs' shapes), built on its CPU forward and backward ([`cpu`]: copies);
//! its GPU form is [`gpu`] (kernels/concatenate.cu).
//!
//! # The axis
//! `axis` counts as Keras counts it: the batch is axis 0, the samples' axes 1, 2, ...; a
//! negative axis counts from the last (-1, Keras's default, the last). So images (N, C, H, W)
//! join along their channels with `axis` 1 (or -3): a DenseNet's concatenation (PyTorch's
//! `torch.cat(xs, dim=1)`, the same number). Axis 0, the batch, is refused: a merge joins
//! samples, not batches.
//!
//! Shapes: inputs of one rank that agree on every axis but `axis`, whose sizes add up;
//! otherwise an error naming every input's shape and the axis.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::merge::{check_arity, listed, shapes_of};
use super::spec::{Build, FieldResult, LayerType, MAX_DIM};
use super::{Arity, Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// Keras's default axis: the last.
pub const DEFAULT_AXIS: i64 = -1;

/// Its inputs joined along `axis`; holds their shapes from the training forward, for the
/// backward's split.
#[derive(Clone, Debug)]
pub struct Concatenate {
    /// As written: counting the batch as axis 0, negative from the last.
    axis: i64,
    cached: Option<Vec<Shape>>,
}

impl Concatenate {
    /// A concatenation along `axis`, counted as Keras counts it (the batch is 0, -1 the last).
    pub fn new(axis: i64) -> Concatenate {
        Concatenate { axis, cached: None }
    }

    /// The axis, as written (the batch is 0, negative from the last).
    pub fn axis(&self) -> i64 {
        self.axis
    }

    /// The spec entry: Keras's `Concatenate(axis=-1)`.
    pub const SPEC: LayerType = LayerType {
        name: "concatenate",
        fields: "`axis` (-1; counting the batch as axis 0, as Keras does; negative from the last)",
        example: (&[2, 3], r#"{"type": "concatenate", "axis": -1, "inbound": ["input", "input"]}"#),
        parse: |f| {
            let axis = f.custom("axis", read_axis, |&a| json!(a))?;
            Ok(Build::merge(move |inputs| {
                meet(axis, inputs)?;
                Ok(Concatenate::new(axis))
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

/// The spec's `axis`: an integer, -1 when absent; 0, the batch, refused.
fn read_axis(v: Option<&Value>) -> FieldResult<i64> {
    let Some(v) = v else { return Ok(DEFAULT_AXIS) };
    match v.as_i64() {
        Some(0) => Err("field 'axis' is 0, the batch: concatenate joins samples along one of their axes, \
                        counted as Keras counts them (the batch 0, the samples' axes from 1; negative from the last)"
            .into()),
        Some(a) if a.unsigned_abs() <= MAX_DIM => Ok(a),
        _ => Err(format!("field 'axis' must be an integer, negative counting from the last (got {v})")),
    }
}

/// The axis of `axis` (as written) in shapes of `rank` dimensions (the batch's included):
/// 1..rank, or why not.
fn resolve(axis: i64, rank: usize) -> FieldResult<usize> {
    let at = if axis < 0 { rank as i64 + axis } else { axis };
    match at {
        0 => Err(format!(
            "axis {axis} is the batch's (axis 0, as Keras counts them) in inputs of rank {rank}: a merge joins samples"
        )),
        a if a > 0 && (a as usize) < rank => Ok(a as usize),
        _ => Err(format!(
            "axis {axis} is outside inputs of rank {rank} (batch included: axes 1..{} or -1..-{})",
            rank - 1,
            rank - 1
        )),
    }
}

/// The output shape of inputs of shapes `inputs` (batch included) joined along `axis`, and
/// the axis resolved, or why they do not meet.
fn meet(axis: i64, inputs: &[Shape]) -> FieldResult<(Shape, usize)> {
    check_arity(Arity::AtLeast(2), inputs.len())?;
    let rank = inputs[0].ndim();
    let mismatch = |why: &str| format!("joins along axis {axis} inputs that {why}, got {}", listed(inputs));
    if inputs.iter().any(|s| s.ndim() != rank) {
        return Err(mismatch("have one rank"));
    }
    let at = resolve(axis, rank).map_err(|e| format!("{e}; got {}", listed(inputs)))?;
    let others = |s: &Shape| [&s.dims()[..at], &s.dims()[at + 1..]].concat();
    if inputs.iter().any(|s| others(s) != others(&inputs[0])) {
        return Err(mismatch("agree on every other axis"));
    }
    let mut dims = inputs[0].dims().to_vec();
    dims[at] = inputs.iter().map(|s| s.dims()[at]).sum();
    Ok((Shape::new(dims), at))
}

/// The width of each input's rows seen from axis `at` (the product of its dimensions from
/// `at` on): what [`cpu`] and the kernels copy by.
fn inners(inputs: &[Shape], at: usize) -> Vec<usize> {
    inputs.iter().map(|s| s.dims()[at..].iter().product()).collect()
}

impl Layer for Concatenate {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "concatenate"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "concatenate", "axis": self.axis}))
    }

    /// Nothing kept but the shapes: the backward splits the output's gradient.
    fn memory(&self, _shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory::NONE)
    }

    fn arity(&self) -> Arity {
        Arity::AtLeast(2)
    }

    super::merge::one_input_forms_refused!("Concatenate");

    fn output_shape_many(&self, inputs: &[Shape]) -> Result<Shape> {
        meet(self.axis, inputs).map(|(s, _)| s).map_err(|e| Error::shape("Concatenate", e))
    }

    // xs: K tensors (N, ..., A_i, ...) → y: (N, ..., Σ A_i, ...), A the axis
    fn forward_many(&mut self, xs: Vec<Tensor>, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let shapes = shapes_of(&xs);
        let (shape, at) = meet(self.axis, &shapes).map_err(|e| Error::shape("Concatenate", e))?;
        for x in &xs[1..] {
            xs[0].same_device("Concatenate", x)?;
        }
        let parts: Vec<&[f32]> = xs.iter().map(Tensor::host).collect();
        let y = cpu::concat(&parts, &inners(&shapes, at));
        self.cached = (ctx.mode == Mode::Train).then_some(shapes);
        Tensor::from_vec_on(y, shape, xs[0].device())
    }

    // dout: (N, ..., Σ A_i, ...) → dx_i: (N, ..., A_i, ...), the part input i filled
    fn backward_many(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grads: &[InputGrad],
        _ctx: &Ctx,
    ) -> Result<Vec<Option<Tensor>>> {
        let shapes = self
            .cached
            .take()
            .ok_or_else(|| Error::config("Concatenate backward", "no training forward to differentiate"))?;
        let (shape, at) = meet(self.axis, &shapes).map_err(|e| Error::shape("Concatenate backward", e))?;
        if dout.shape() != &shape || input_grads.len() != shapes.len() {
            return Err(Error::shape(
                "Concatenate backward",
                format!(
                    "dout {} and {} inputs for a forward of {shape} from {}",
                    dout.shape(),
                    input_grads.len(),
                    shapes.len()
                ),
            ));
        }
        let wanted: Vec<bool> = input_grads.iter().map(|&g| g == InputGrad::Needed).collect();
        cpu::split(dout.host(), &inners(&shapes, at), &wanted)
            .into_iter()
            .zip(shapes)
            .map(|(b, s)| b.map(|v| Tensor::from_vec_on(v, s, dout.device())).transpose())
            .collect()
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Concatenate::new(self.axis))
    }

    fn describe(&self) -> String {
        format!("Concatenate(axis {})", self.axis)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::merge::testing::{gradient_check, run, values};
    use crate::ops::spec::Fields;
    use crate::tensor::Device;

    fn t(v: &[f32], dims: &[usize]) -> Tensor {
        Tensor::from_vec(v.to_vec(), dims.to_vec()).unwrap()
    }

    fn s(d: &[usize]) -> Shape {
        Shape::new(d.to_vec())
    }

    /// scripts/torch_concatenate.py's case: images a (2, 1, 2, 2) and b (2, 2, 2, 2) and dy
    /// (2, 3, 2, 2) by its formulas, joined along the channels (dim 1, Keras's axis 1).
    fn case() -> (Vec<Tensor>, Vec<f32>) {
        let a: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..16).map(|i| 100.0 + i as f32).collect();
        let dy = (0..24).map(|i| (((i * 13) % 17) as f32 - 8.0) / 16.0).collect();
        (vec![t(&a, &[2, 1, 2, 2]), t(&b, &[2, 2, 2, 2])], dy)
    }

    /// The output of scripts/torch_concatenate.py: `torch.cat([a, b], dim=1)` flattened, then
    /// the gradients of a and of b (copies: exact).
    /// // torch 2.15.0+cu132
    #[rustfmt::skip]
    const TORCH_Y: &[f32] = &[
        0.0, 1.0, 2.0, 3.0, 100.0, 101.0, 102.0, 103.0, 104.0, 105.0, 106.0, 107.0, 4.0, 5.0, 6.0, 7.0, 108.0, 109.0, 110.0, 111.0, 112.0, 113.0, 114.0, 115.0,
    ];
    #[rustfmt::skip]
    const TORCH_DA: &[f32] = &[
        -0.5, 0.3125, 0.0625, -0.1875, -0.3125, 0.5, 0.25, 0.0,
    ];
    #[rustfmt::skip]
    const TORCH_DB: &[f32] = &[
        -0.4375, 0.375, 0.125, -0.125, -0.375, 0.4375, 0.1875, -0.0625, -0.25, -0.5, 0.3125, 0.0625, -0.1875, -0.4375, 0.375, 0.125,
    ];

    #[test]
    fn concatenate_matches_pytorch() {
        let (xs, dy) = case();
        for axis in [1, -3] {
            let (y, grads) = run(&mut Concatenate::new(axis), &xs, &dy);
            assert_eq!(y.shape(), &s(&[2, 3, 2, 2]));
            assert_eq!((y.host(), grads[0].host(), grads[1].host()), (TORCH_Y, TORCH_DA, TORCH_DB), "axis {axis}");
        }
    }

    #[test]
    fn every_inputs_gradient_is_the_gradient_of_the_forward() {
        // Along every axis of (N, 2, 3, 4) samples, three inputs of different widths there.
        for (axis, widths) in [(1, [2, 1, 3]), (2, [3, 1, 2]), (-1, [4, 2, 1]), (-2, [1, 3, 1])] {
            let xs: Vec<Tensor> = widths
                .iter()
                .enumerate()
                .map(|(i, &w)| {
                    let mut dims = vec![2, 2, 3, 4];
                    dims[resolve(axis, 4).unwrap()] = w;
                    let n = dims.iter().product();
                    t(&values(i as u64, n), &dims)
                })
                .collect();
            let want: usize = xs.iter().map(Tensor::numel).sum();
            assert_eq!(gradient_check(&mut Concatenate::new(axis), &xs), want, "axis {axis}");
        }
    }

    #[test]
    fn only_the_gradients_asked_for_are_made() {
        let (xs, dy) = case();
        let mut c = Concatenate::new(1);
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let none = || ParamsMut::new(&mut [], &[]);
        c.forward_many(xs, Params::new(&[], &[]), none(), &ctx).unwrap();
        let grads = [InputGrad::Skip, InputGrad::Needed];
        let d = c.backward_many(t(&dy, &[2, 3, 2, 2]), Params::new(&[], &[]), none(), &grads, &ctx).unwrap();
        assert_eq!(d[0], None);
        assert_eq!(d[1].as_ref().unwrap().host(), TORCH_DB);
        let e = c.backward_many(t(&dy, &[2, 3, 2, 2]), Params::new(&[], &[]), none(), &grads, &ctx).unwrap_err();
        assert!(e.to_string().contains("no training forward"), "{e}");
    }

    #[test]
    fn inputs_that_do_not_meet_are_refused_naming_the_shapes_and_the_axis() {
        let c = |axis: i64, inputs: &[Shape]| Concatenate::new(axis).output_shape_many(inputs);
        assert_eq!(c(1, &[s(&[4, 2, 5, 5]), s(&[4, 3, 5, 5])]).unwrap(), s(&[4, 5, 5, 5]));
        assert_eq!(c(-1, &[s(&[4, 2, 5]), s(&[4, 2, 1])]).unwrap(), s(&[4, 2, 6]));
        let e = c(1, &[s(&[4, 2, 5, 5]), s(&[4, 3, 4, 5])]).unwrap_err().to_string();
        assert!(
            e.contains("along axis 1") && e.contains("agree on every other axis") && e.contains("(2, 5, 5), (3, 4, 5)"),
            "{e}"
        );
        let e = c(-1, &[s(&[4, 2, 5]), s(&[4, 5])]).unwrap_err().to_string();
        assert!(e.contains("one rank") && e.contains("(2, 5), (5)"), "{e}");
        let e = c(3, &[s(&[4, 2, 5]), s(&[4, 2, 5])]).unwrap_err().to_string();
        assert!(e.contains("axis 3 is outside inputs of rank 3") && e.contains("(2, 5), (2, 5)"), "{e}");
        let e = c(-3, &[s(&[4, 2, 5]), s(&[4, 2, 5])]).unwrap_err().to_string();
        assert!(e.contains("axis -3 is the batch's"), "{e}");
        let e = c(1, &[s(&[4, 2, 5])]).unwrap_err().to_string();
        assert!(e.contains("takes 2 or more inputs, given 1"), "{e}");
    }

    #[test]
    fn the_spec_entry_reads_keras_axis() {
        let parse = |text: &str| {
            let v: Value = serde_json::from_str(text).unwrap();
            let map = v.as_object().unwrap().clone();
            let mut fields = Fields::new(&map);
            let build = (Concatenate::SPEC.parse)(&mut fields)?;
            fields.finish()?;
            build.build_many(&[s(&[2, 3, 4]), s(&[2, 3, 4])]).map(|ls| ls[0].describe())
        };
        assert_eq!(parse(r#"{}"#).unwrap(), "Concatenate(axis -1)");
        assert_eq!(parse(r#"{"axis": 1}"#).unwrap(), "Concatenate(axis 1)");
        assert_eq!(parse(r#"{"axis": -2}"#).unwrap(), "Concatenate(axis -2)");
        let e = parse(r#"{"axis": 0}"#).unwrap_err();
        assert!(e.contains("field 'axis' is 0, the batch"), "{e}");
        let e = parse(r#"{"axis": 1.5}"#).unwrap_err();
        assert!(e.contains("field 'axis' must be an integer"), "{e}");
        let e = parse(r#"{"axis": 3}"#).unwrap_err();
        assert!(e.contains("axis 3 is outside inputs of rank 3") && e.contains("(3, 4), (3, 4)"), "{e}");
        assert_eq!(Concatenate::new(-1).spec().unwrap(), json!({"type": "concatenate", "axis": -1}));
    }

    /// What a training forward keeps for its backward is what its account states, to the
    /// small vectors of its shapes (under 256 bytes).
    #[test]
    fn the_memory_account_is_what_a_forward_keeps() {
        let xs: Vec<Tensor> = vec![t(&values(1, 16 * 50), &[16, 5, 10]), t(&values(2, 16 * 20), &[16, 5, 4])];
        let (kept, stated) = crate::ops::merge::testing::kept_bytes(&mut Concatenate::new(-1), xs);
        assert!((kept - stated).abs() < 256, "kept {kept} B, stated {stated} B");
    }

    /// The GPU form against the CPU's, bit for bit (the same roundings in the same order).
    #[cfg(feature = "cuda")]
    #[test]
    fn runs_on_a_gpu_as_on_the_cpu() {
        const TEST: &str = "runs_on_a_gpu_as_on_the_cpu";
        let xs = vec![t(&values(1, 2 * 3 * 20), &[2, 3, 4, 5]), t(&values(2, 2 * 7 * 20), &[2, 7, 4, 5])];
        let dy = values(9, 2 * 10 * 20);
        let (want_y, want) = run(&mut Concatenate::new(1), &xs, &dy);
        let Some((y, grads)) = crate::ops::merge::on_gpu::run(TEST, &Concatenate::new(1), &xs, &dy) else { return };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&y), bits(want_y.host()), "y");
        for (i, (g, w)) in grads.iter().zip(&want).enumerate() {
            assert_eq!(bits(g), bits(w.host()), "input {i}'s gradient");
        }
    }
}
