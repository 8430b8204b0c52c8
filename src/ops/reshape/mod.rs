//! Reshape, (N, ...) → (N, *target): Keras's `Reshape(target_shape)` and PyTorch's
//! `x.view(N, ...)` / `x.reshape(N, ...)` (ATen's `view`, `reshape`, `_unsafe_view`). The
//! layer (its spec entry `reshape`, its spec form, what it keeps for backward: the input's
//! shape), and, in [`gpu`], its GPU form (device copies, as Flatten's: it has no kernel).
//!
//! The values are row-major and do not move: on the CPU the output is the input's values
//! seen with another shape (no copy, no arithmetic, [`Tensor::reshape`]); the backward
//! sees the gradient with the input's shape again. Flatten is the special case of a
//! target `(-1)`, kept as its own layer (`ops::flatten`) since specs and weights name it.
//!
//! The target is per sample, as Keras writes it: the batch stays first. One entry may be
//! -1, inferred from the sample's size; the layer keeps the -1, so that one layer takes any
//! input whose size fits, and writes itself back as it was written.

#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{Build, FieldResult, LayerType, MAX_DIM};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Params, ParamsMut};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// The one entry of a target that may be inferred, as Keras and PyTorch write it.
const INFERRED: i64 = -1;

/// (N, ...) → (N, *target), the values in the same row-major order.
#[derive(Clone, Debug)]
pub struct Reshape {
    /// The per-sample target: positive sizes, and at most one [`INFERRED`].
    target: Vec<i64>,
    /// Input shape of the last forward, to restore in backward.
    input: Option<Shape>,
}

impl Reshape {
    /// A reshape of each sample to `target`: positive sizes (at most 2^20 each, as every
    /// size of a spec), one of which may be -1 (inferred from the sample's size).
    pub fn new(target: &[i64]) -> Result<Reshape> {
        check_target(target).map_err(|e| Error::config("Reshape", e))?;
        Ok(Reshape { target: target.to_vec(), input: None })
    }

    /// The per-sample target, -1 where inferred.
    pub fn target(&self) -> &[i64] {
        &self.target
    }

    /// The spec entry: Keras's `Reshape(target_shape)`.
    pub const SPEC: LayerType = LayerType {
        name: "reshape",
        fields: "`target_shape` (per sample, the batch stays first; one entry may be -1, inferred)",
        example: (&[2, 3, 4], r#"{"type": "reshape", "target_shape": [4, -1]}"#),
        parse: |f| {
            let target = f.custom("target_shape", read_target, |t| json!(t))?;
            Ok(Build::layer(move |input| {
                let layer = Reshape::new(&target).map_err(|e| e.to_string())?;
                layer.per_sample(input).map(|_| layer)
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

    /// The per-sample output shape for an input of `input` (batch included), or the
    /// spec's words for why the sizes differ, naming both shapes.
    fn per_sample(&self, input: &Shape) -> FieldResult<Vec<usize>> {
        let sample = Shape::new(input.dims().get(1..).unwrap_or_default());
        let size = sample.numel();
        let known: usize = self.target.iter().filter(|&&d| d != INFERRED).map(|&d| d as usize).product();
        let differ = || {
            format!(
                "cannot reshape samples of shape {sample} ({size} values) to {} ({})",
                self.target_text(),
                if self.target.contains(&INFERRED) {
                    format!("a multiple of {known} values")
                } else {
                    format!("{known} values")
                }
            )
        };
        if self.target.contains(&INFERRED) {
            if !size.is_multiple_of(known) {
                return Err(differ());
            }
            Ok(self.target.iter().map(|&d| if d == INFERRED { size / known } else { d as usize }).collect())
        } else if known == size {
            Ok(self.target.iter().map(|&d| d as usize).collect())
        } else {
            Err(differ())
        }
    }

    /// The target as written, `(4, -1)`.
    fn target_text(&self) -> String {
        let dims: Vec<String> = self.target.iter().map(|d| d.to_string()).collect();
        format!("({})", dims.join(", "))
    }
}

/// Why `target` is not a reshape's target, or nothing: a non-empty list of sizes in
/// 1..=MAX_DIM, one of which may be -1.
fn check_target(target: &[i64]) -> FieldResult<()> {
    let text = || format!("{target:?}");
    if target.is_empty() {
        return Err(format!("the target shape is empty (got {}): a sample keeps at least one dimension", text()));
    }
    if let Some(d) = target.iter().find(|&&d| d != INFERRED && !(1..=MAX_DIM as i64).contains(&d)) {
        return Err(format!(
            "the target shape {} has {d}: each entry must be a size in 1..={MAX_DIM}, or -1 (inferred)",
            text()
        ));
    }
    let inferred = target.iter().filter(|&&d| d == INFERRED).count();
    if inferred > 1 {
        return Err(format!("the target shape {} has {inferred} entries of -1: at most one is inferred", text()));
    }
    Ok(())
}

/// `target_shape`: a list of integers that [`check_target`] accepts.
fn read_target(v: Option<&Value>) -> FieldResult<Vec<i64>> {
    let what = "a list of positive integers, one of which may be -1";
    let v = v.ok_or_else(|| format!("missing field 'target_shape' ({what})"))?;
    let dims = match v {
        Value::Array(a) => a.iter().map(Value::as_i64).collect::<Option<Vec<i64>>>(),
        _ => None,
    };
    let dims = dims.ok_or_else(|| format!("field 'target_shape' must be {what} (got {v})"))?;
    check_target(&dims).map_err(|e| format!("field 'target_shape': {e}"))?;
    Ok(dims)
}

impl Layer for Reshape {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "reshape"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "reshape", "target_shape": self.target}))
    }

    /// Nothing per sample: the output is the input's values.
    fn memory(&self, _shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory::NONE)
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        if input.ndim() == 0 {
            return Err(Error::shape("Reshape", format!("expects (N, ...), got {input}")));
        }
        let dims = self.per_sample(input).map_err(|e| Error::shape("Reshape", e))?;
        Ok(Shape::new([&[input.batch()][..], &dims].concat()))
    }

    // x: (N, ...) → y: (N, *target), the same values
    fn forward(&mut self, x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, _ctx: &Ctx) -> Result<Tensor> {
        let out = self.output_shape(x.shape())?;
        self.input = Some(x.shape().clone());
        x.reshape(out)
    }

    // dout: (N, *target) → dx: (N, ...), the same values
    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let shape =
            self.input.take().ok_or_else(|| Error::config("Reshape backward", "no forward to differentiate"))?;
        let want = self.output_shape(&shape)?;
        if dout.shape() != &want {
            return Err(Error::shape("Reshape backward", format!("dout {} for output {want}", dout.shape())));
        }
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        dout.reshape(shape).map(Some)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Reshape { target: self.target.clone(), input: None })
    }

    fn describe(&self) -> String {
        format!("Reshape{}", self.target_text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::model_from_spec_str;
    use crate::tensor::Device;

    /// The output of scripts/torch_reshape.py: x (2, 3, 4) of the script's formula seen as
    /// (2, 4, 3) (`x.view(2, 4, -1)`), and dx of dy (2, 4, 3) by its formula. Copies, so
    /// exact.
    #[rustfmt::skip]
    mod torch {
        // made by torch 2.15.0+cu132
        pub const Y: &[f32] = &[
            -2.25, -0.5, 1.25, -1.75, 0.0, 1.75, -1.25, 0.5, 2.25, -0.75, 1.0, -2.0,
            -0.25, 1.5, -1.5, 0.25, 2.0, -1.0, 0.75, -2.25, -0.5, 1.25, -1.75, 0.0,
        ];
        pub const DX: &[f32] = &[
            -0.5, 0.125, -0.375, 0.25, -0.25, 0.375, -0.125, 0.5, 0.0, -0.5, 0.125, -0.375,
            0.25, -0.25, 0.375, -0.125, 0.5, 0.0, -0.5, 0.125, -0.375, 0.25, -0.25, 0.375,
        ];
    }

    fn ctx() -> Ctx<'static> {
        Ctx::train(0, 0, 0, Device::Cpu(0))
    }

    /// The forward and backward of PyTorch's `view`, value for value, and no copy: the
    /// output holds the input's very values, the gradient the upstream gradient's.
    #[test]
    fn reshape_matches_pytorch_and_copies_nothing() {
        let x: Vec<f32> = (0..24).map(|i| ((i * 7 % 19) as f32 - 9.0) / 4.0).collect();
        let dy: Vec<f32> = (0..24).map(|j| ((j * 5 % 9) as f32 - 4.0) / 8.0).collect();
        let mut r = Reshape::new(&[4, -1]).unwrap();
        let xt = Tensor::from_vec(x, [2, 3, 4]).unwrap();
        let at = xt.host().as_ptr();
        let y = r.forward(xt, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx()).unwrap();
        assert_eq!(y.shape().dims(), [2, 4, 3]);
        assert_eq!(y.host(), torch::Y);
        assert_eq!(y.host().as_ptr(), at, "the forward copied the values");
        let d = Tensor::from_vec(dy, [2, 4, 3]).unwrap();
        let at = d.host().as_ptr();
        let dx = r.backward(d, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx());
        let dx = dx.unwrap().unwrap();
        assert_eq!(dx.shape().dims(), [2, 3, 4]);
        assert_eq!(dx.host(), torch::DX);
        assert_eq!(dx.host().as_ptr(), at, "the backward copied the values");
    }

    #[test]
    fn the_spec_entry_reads_the_target_and_keeps_its_minus_one() {
        let m = model_from_spec_str(
            r#"{"input_shape": [2, 3, 4], "layers": [{"type": "reshape", "target_shape": [-1, 2]}]}"#,
            "m.json",
        )
        .unwrap();
        assert_eq!(m.layer_names(), ["reshape0"]);
        assert_eq!(m.layers()[0].describe(), "Reshape(-1, 2)");
        assert_eq!(m.output_shape().dims(), [12, 2]);
        assert_eq!(m.layers()[0].spec(), Some(json!({"type": "reshape", "target_shape": [-1, 2]})));
        let m = model_from_spec_str(
            r#"{"input_shape": [6], "layers": [{"type": "reshape", "target_shape": [1, 2, 3]}]}"#,
            "m.json",
        )
        .unwrap();
        assert_eq!(m.output_shape().dims(), [1, 2, 3]);
    }

    /// Each bad target is refused by name, the element count that differs naming both
    /// shapes, in the spec as in the layer.
    #[test]
    fn bad_targets_are_refused_naming_the_shapes() {
        for (input, target, want) in [
            (
                "[2, 3, 4]",
                "[5, 5]",
                "layer 0 (reshape): cannot reshape samples of shape (2, 3, 4) (24 values) to (5, 5) (25 values)",
            ),
            (
                "[2, 3, 4]",
                "[5, -1]",
                "cannot reshape samples of shape (2, 3, 4) (24 values) to (5, -1) (a multiple of 5 values)",
            ),
            ("[2, 3, 4]", "[-1, -1]", "the target shape [-1, -1] has 2 entries of -1: at most one is inferred"),
            ("[2, 3, 4]", "[0, 24]", "the target shape [0, 24] has 0: each entry must be a size in 1..=1048576"),
            ("[2, 3, 4]", "[-2, 12]", "has -2: each entry must be a size"),
            ("[2, 3, 4]", "[]", "the target shape is empty"),
            ("[2, 3, 4]", "[2.5, 2]", "field 'target_shape' must be a list of positive integers"),
            ("[2, 3, 4]", "24", "field 'target_shape' must be a list of positive integers"),
        ] {
            let spec =
                format!(r#"{{"input_shape": {input}, "layers": [{{"type": "reshape", "target_shape": {target}}}]}}"#);
            let e = model_from_spec_str(&spec, "m.json").unwrap_err().to_string();
            assert!(e.contains(want), "{target}: {e}");
        }
        let e = model_from_spec_str(r#"{"input_shape": [4], "layers": [{"type": "reshape"}]}"#, "m.json");
        assert!(e.unwrap_err().to_string().contains("missing field 'target_shape'"));
        // The layer itself, built in Rust.
        let e = Reshape::new(&[-1, 0]).unwrap_err().to_string();
        assert!(e.contains("has 0"), "{e}");
        let e = Reshape::new(&[7]).unwrap().output_shape(&Shape::new([3, 2, 3])).unwrap_err().to_string();
        assert!(e.contains("cannot reshape samples of shape (2, 3) (6 values) to (7) (7 values)"), "{e}");
    }
}
