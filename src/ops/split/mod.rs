//! Split, one part of a sample along an axis: PyTorch's `torch.split(x, sizes, dim)[index]`
//! (ATen's `split_with_sizes` followed by the getitem of one part; `chunk` and `unbind` are
//! splits too). The layer (its spec entry `split`, its spec form, what it keeps for
//! backward: the input's shape), built on its CPU forward and backward ([`cpu`]); its GPU
//! form is [`gpu`] (kernels/split.cu).
//!
//! A split of a tensor into k parts is k of these layers reading the same tensor, one a
//! part (`index`); each one's backward writes its part's gradient into its place and zeros
//! elsewhere, and the graph sums the gradients of a tensor's readers, which puts every
//! part's gradient in its place.
//!
//! `axis` is per sample (0 the first axis after the batch), negative counting from the end
//! (-1 the last); `sizes` are the parts' lengths along it, which must sum to its length.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use std::ops::Range;

use serde_json::{json, Value};

use super::spec::{Build, FieldResult, LayerType, MAX_DIM};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Params, ParamsMut};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};
use cpu::Around;

/// Part `index` of a sample split along `axis` into parts of `sizes`.
#[derive(Clone, Debug)]
pub struct Split {
    /// Per sample; negative counts from the end.
    axis: i64,
    /// The parts' lengths along the axis, each positive.
    sizes: Vec<usize>,
    /// The part this layer gives, below `sizes.len()`.
    index: usize,
    /// From the forward: the input's shape (N, ...), for the backward.
    cached: Option<Shape>,
}

impl Split {
    /// Part `index` (from 0) of each sample split along `axis` (per sample, negative from
    /// the end) into parts of lengths `sizes`: `torch.split(x, sizes, dim)[index]`.
    pub fn new(axis: i64, sizes: &[usize], index: usize) -> Result<Split> {
        check_sizes(sizes).and_then(|_| check_index(index, sizes)).map_err(|e| Error::config("Split", e))?;
        Ok(Split { axis, sizes: sizes.to_vec(), index, cached: None })
    }

    /// The spec entry: `torch.split(x, sizes, dim)[index]`, as ATen writes it.
    pub const SPEC: LayerType = LayerType {
        name: "split",
        fields: "`axis` (-1; per sample, negative from the end), `sizes` (the parts' lengths, summing to the axis's), \
                 `index` (the part this layer gives, from 0)",
        example: (&[4, 6], r#"{"type": "split", "axis": -1, "sizes": [1, 3, 2], "index": 1}"#),
        parse: |f| {
            let axis = f.custom("axis", read_axis, |a| json!(a))?;
            let sizes = f.custom("sizes", read_sizes, |s| json!(s))?;
            let index = f.custom("index", read_index, |i| json!(i))?;
            check_index(index, &sizes).map_err(|e| format!("field 'index': {e}"))?;
            Ok(Build::layer(move |input| {
                let layer = Split::new(axis, &sizes, index).map_err(|e| e.to_string())?;
                layer.around(input.dims().get(1..).unwrap_or_default()).map(|_| layer)
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

    /// The axis of a sample of shape `sample` (from 0), the sample seen around it (its
    /// outer without the batch), and the part's rows along it; or, in the spec's words, why
    /// the axis or the sizes do not fit the sample.
    fn around(&self, sample: &[usize]) -> FieldResult<(usize, Around, Range<usize>)> {
        let rank = sample.len() as i64;
        let shape = Shape::new(sample);
        let a = if self.axis < 0 { rank + self.axis } else { self.axis };
        if !(0..rank).contains(&a) {
            return Err(format!(
                "axis {} is outside samples of shape {shape}: their axes are 0..={}, or {}..=-1 from the end",
                self.axis,
                rank - 1,
                -rank
            ));
        }
        let a = a as usize;
        let sum: usize = self.sizes.iter().sum();
        if sum != sample[a] {
            return Err(format!(
                "the sizes {:?} sum to {sum}, but axis {} of samples of shape {shape} has length {}",
                self.sizes, self.axis, sample[a]
            ));
        }
        let at =
            Around { outer: sample[..a].iter().product(), axis: sample[a], inner: sample[a + 1..].iter().product() };
        let start: usize = self.sizes[..self.index].iter().sum();
        Ok((a, at, start..start + self.sizes[self.index]))
    }

    /// The axis of `input` (N, ...) (from 0, the batch's axis 0), the batch around it, and
    /// the part; or an error naming the layer's fields and the shape.
    fn around_batch(&self, input: &Shape, op: &'static str) -> Result<(usize, Around, Range<usize>)> {
        let sample = input.dims().get(1..).ok_or_else(|| Error::shape(op, format!("expects (N, ...), got {input}")))?;
        let (a, at, part) = self.around(sample).map_err(|e| Error::shape(op, e))?;
        Ok((a + 1, Around { outer: input.batch() * at.outer, ..at }, part))
    }
}

/// Why `sizes` are not a split's parts: none, or one not in 1..=MAX_DIM.
fn check_sizes(sizes: &[usize]) -> FieldResult<()> {
    if sizes.is_empty() || sizes.iter().any(|&s| !(1..=MAX_DIM as usize).contains(&s)) {
        return Err(format!("the sizes {sizes:?} are not parts' lengths: one or more, each in 1..={MAX_DIM}"));
    }
    Ok(())
}

/// Why `index` is not one of the parts of `sizes`.
fn check_index(index: usize, sizes: &[usize]) -> FieldResult<()> {
    if index < sizes.len() {
        return Ok(());
    }
    Err(format!("the part {index} of a split into {} parts {sizes:?} (parts 0..={})", sizes.len(), sizes.len() - 1))
}

/// `axis`: an integer, -1 when absent.
fn read_axis(v: Option<&Value>) -> FieldResult<i64> {
    match v {
        None => Ok(-1),
        Some(v) => v
            .as_i64()
            .filter(|a| a.unsigned_abs() <= MAX_DIM)
            .ok_or_else(|| format!("field 'axis' must be an integer, a sample's axis (got {v})")),
    }
}

/// `sizes`: a list that [`check_sizes`] accepts.
fn read_sizes(v: Option<&Value>) -> FieldResult<Vec<usize>> {
    let what = "a list of the parts' lengths, positive integers";
    let v = v.ok_or_else(|| format!("missing field 'sizes' ({what})"))?;
    let sizes = match v {
        Value::Array(a) => a.iter().map(|s| s.as_u64().and_then(|s| usize::try_from(s).ok())).collect(),
        _ => None,
    };
    let sizes: Vec<usize> = sizes.ok_or_else(|| format!("field 'sizes' must be {what} (got {v})"))?;
    check_sizes(&sizes).map_err(|e| format!("field 'sizes': {e}"))?;
    Ok(sizes)
}

/// `index`: a part, from 0.
fn read_index(v: Option<&Value>) -> FieldResult<usize> {
    let v = v.ok_or("missing field 'index' (the part this layer gives, from 0)")?;
    v.as_u64()
        .and_then(|i| usize::try_from(i).ok())
        .ok_or_else(|| format!("field 'index' must be a part, an integer from 0 (got {v})"))
}

impl Layer for Split {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "split"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "split", "axis": self.axis, "sizes": self.sizes, "index": self.index}))
    }

    /// Nothing kept: the backward needs only the shapes.
    fn memory(&self, _shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory::NONE)
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (a, _, part) = self.around_batch(input, "Split")?;
        let mut dims = input.dims().to_vec();
        dims[a] = part.len();
        Ok(Shape::new(dims))
    }

    // x: (N, ..., L, ...) → y: (N, ..., len, ...), the part's rows along the axis
    fn forward(&mut self, x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, _ctx: &Ctx) -> Result<Tensor> {
        let out = self.output_shape(x.shape())?;
        let (_, at, part) = self.around_batch(x.shape(), "Split")?;
        let mut y = vec![0.0f32; out.numel()];
        cpu::split_forward(x.host(), at, part, &mut y);
        self.cached = Some(x.shape().clone());
        Tensor::from_vec_on(y, out, x.device())
    }

    // dout: (N, ..., len, ...) → dx: (N, ..., L, ...), dout in the part's place, 0 elsewhere
    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let shape = self.cached.take().ok_or_else(|| Error::config("Split backward", "no forward to differentiate"))?;
        let want = self.output_shape(&shape)?;
        if dout.shape() != &want {
            return Err(Error::shape("Split backward", format!("dout {} for output {want}", dout.shape())));
        }
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        let (_, at, part) = self.around_batch(&shape, "Split backward")?;
        let mut dx = vec![0.0f32; shape.numel()];
        cpu::split_backward(dout.host(), at, part, &mut dx);
        Tensor::from_vec_on(dx, shape, dout.device()).map(Some)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Split { cached: None, ..self.clone() })
    }

    fn describe(&self) -> String {
        format!("Split(axis {}, sizes {:?}, part {})", self.axis, self.sizes, self.index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::model_from_spec_str;
    use crate::tensor::Device;

    fn ctx() -> Ctx<'static> {
        Ctx::train(0, 0, 0, Device::Cpu(0))
    }

    /// The output of scripts/torch_split.py: x (2, 3, 6) by the script's formula, each
    /// part of `torch.split(x, [1, 3, 2], dim=-1)` and of `torch.split(x, [2, 1], dim=1)`
    /// (axis 0 of a sample), with the gradient of each part's dy (by its formula) alone.
    /// Moves and zeros, so exact.
    #[rustfmt::skip]
    mod torch {
        // made by torch 2.15.0+cu132
        pub const LAST_Y: &[&[f32]] = &[
            &[
                -2.25, -1.25, -0.25, 0.75, 1.75, -2.0,
            ],
            &[
                -0.5, 1.25, -1.75, 0.5, 2.25, -0.75, 1.5, -1.5, 0.25, -2.25, -0.5, 1.25,
                -1.25, 0.5, 2.25, -0.25, 1.5, -1.5,
            ],
            &[
                0.0, 1.75, 1.0, -2.0, 2.0, -1.0, -1.75, 0.0, -0.75, 1.0, 0.25, 2.0,
            ],
        ];
        pub const LAST_DX: &[&[f32]] = &[
            &[
                -0.625, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.625, 0.0, 0.0, 0.0, 0.0, 0.0, -0.125, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.5, 0.0, 0.0, 0.0, 0.0, 0.0, -0.25, 0.0, 0.0, 0.0, 0.0, 0.0,
            ],
            &[
                0.0, -0.625, 0.0, 0.625, 0.0, 0.0, 0.0, -0.125, 0.5, -0.25, 0.0, 0.0,
                0.0, 0.375, -0.375, 0.25, 0.0, 0.0, 0.0, -0.5, 0.125, -0.625, 0.0, 0.0,
                0.0, 0.0, 0.625, -0.125, 0.0, 0.0, 0.0, 0.5, -0.25, 0.375, 0.0, 0.0,
            ],
            &[
                0.0, 0.0, 0.0, 0.0, -0.625, 0.0, 0.0, 0.0, 0.0, 0.0, 0.625, -0.125,
                0.0, 0.0, 0.0, 0.0, 0.5, -0.25, 0.0, 0.0, 0.0, 0.0, 0.375, -0.375,
                0.0, 0.0, 0.0, 0.0, 0.25, -0.5, 0.0, 0.0, 0.0, 0.0, 0.125, -0.625,
            ],
        ];
        pub const FIRST_Y: &[&[f32]] = &[
            &[
                -2.25, -0.5, 1.25, -1.75, 0.0, 1.75, -1.25, 0.5, 2.25, -0.75, 1.0, -2.0,
                0.75, -2.25, -0.5, 1.25, -1.75, 0.0, 1.75, -1.25, 0.5, 2.25, -0.75, 1.0,
            ],
            &[
                -0.25, 1.5, -1.5, 0.25, 2.0, -1.0, -2.0, -0.25, 1.5, -1.5, 0.25, 2.0,
            ],
        ];
        pub const FIRST_DX: &[&[f32]] = &[
            &[
                -0.625, 0.0, 0.625, -0.125, 0.5, -0.25, 0.375, -0.375, 0.25, -0.5, 0.125, -0.625,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.625, -0.125, 0.5, -0.25, 0.375,
                -0.375, 0.25, -0.5, 0.125, -0.625, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
            ],
            &[
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                -0.625, 0.0, 0.625, -0.125, 0.5, -0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.375, -0.375, 0.25, -0.5, 0.125, -0.625,
            ],
        ];
    }

    #[test]
    fn split_matches_pytorch() {
        let x: Vec<f32> = (0..36).map(|i| ((i * 7 % 19) as f32 - 9.0) / 4.0).collect();
        // (axis, sizes, each part's y, each part's dx), as PyTorch printed them.
        type Case<'a> = (i64, &'a [usize], &'a [&'a [f32]], &'a [&'a [f32]]);
        let cases: [Case; 2] =
            [(-1, &[1, 3, 2], torch::LAST_Y, torch::LAST_DX), (0, &[2, 1], torch::FIRST_Y, torch::FIRST_DX)];
        for (axis, sizes, ys, dxs) in cases {
            for index in 0..sizes.len() {
                let mut s = Split::new(axis, sizes, index).unwrap();
                let none = || (Params::new(&[], &[]), ParamsMut::new(&mut [], &[]));
                let (p, b) = none();
                let y = s.forward(Tensor::from_vec(x.clone(), [2, 3, 6]).unwrap(), p, b, &ctx()).unwrap();
                assert_eq!(y.host(), ys[index], "axis {axis} part {index}");
                let dy: Vec<f32> = (0..y.numel()).map(|j| ((j * 5 % 11) as f32 - 5.0) / 8.0).collect();
                let (p, dp) = none();
                let dx = s.backward(Tensor::from_vec(dy, y.shape().clone()).unwrap(), p, dp, InputGrad::Needed, &ctx());
                let dx = dx.unwrap().unwrap();
                assert_eq!(dx.shape().dims(), [2, 3, 6]);
                assert_eq!(dx.host(), dxs[index], "axis {axis} part {index}: dx");
            }
        }
    }

    #[test]
    fn the_spec_entry_reads_the_fields_and_counts_the_axis_per_sample() {
        let m = model_from_spec_str(
            r#"{"input_shape": [4, 6], "layers": [{"type": "split", "sizes": [3, 1], "index": 1, "axis": 0}]}"#,
            "m.json",
        )
        .unwrap();
        assert_eq!(m.layer_names(), ["split0"]);
        assert_eq!(m.layers()[0].describe(), "Split(axis 0, sizes [3, 1], part 1)");
        assert_eq!(m.output_shape().dims(), [1, 6]);
        let m = model_from_spec_str(
            r#"{"input_shape": [4, 6], "layers": [{"type": "split", "sizes": [2, 4], "index": 1}]}"#,
            "m.json",
        )
        .unwrap();
        assert_eq!(m.output_shape().dims(), [4, 4]);
        let written = json!({"type": "split", "axis": -1, "sizes": [2, 4], "index": 1});
        assert_eq!(m.layers()[0].spec(), Some(written));
    }

    /// Each bad field is refused by name: sizes that do not sum to the axis's length name
    /// both, an axis outside the sample names the sample's axes.
    #[test]
    fn bad_fields_are_refused_naming_the_axis_and_the_sizes() {
        for (fields, want) in [
            (
                r#""sizes": [1, 3, 3], "index": 0"#,
                "layer 0 (split): the sizes [1, 3, 3] sum to 7, but axis -1 of samples of shape (4, 6) has length 6",
            ),
            (
                r#""axis": 0, "sizes": [2, 3], "index": 0"#,
                "the sizes [2, 3] sum to 5, but axis 0 of samples of shape (4, 6) has length 4",
            ),
            (
                r#""axis": 2, "sizes": [6], "index": 0"#,
                "axis 2 is outside samples of shape (4, 6): their axes are 0..=1, or -2..=-1 from the end",
            ),
            (r#""axis": -3, "sizes": [6], "index": 0"#, "axis -3 is outside samples of shape (4, 6)"),
            (
                r#""sizes": [2, 4], "index": 2"#,
                "field 'index': the part 2 of a split into 2 parts [2, 4] (parts 0..=1)",
            ),
            (r#""sizes": [2, 4], "index": -1"#, "field 'index' must be a part, an integer from 0 (got -1)"),
            (r#""sizes": [2, 4]"#, "missing field 'index'"),
            (r#""index": 0"#, "missing field 'sizes'"),
            (r#""sizes": [], "index": 0"#, "field 'sizes': the sizes [] are not parts' lengths"),
            (r#""sizes": [0, 6], "index": 0"#, "field 'sizes': the sizes [0, 6] are not parts' lengths"),
            (r#""sizes": 6, "index": 0"#, "field 'sizes' must be a list of the parts' lengths"),
            (r#""axis": "last", "sizes": [6], "index": 0"#, "field 'axis' must be an integer"),
        ] {
            let spec = format!(r#"{{"input_shape": [4, 6], "layers": [{{"type": "split", {fields}}}]}}"#);
            let e = model_from_spec_str(&spec, "m.json").unwrap_err().to_string();
            assert!(e.contains(want), "{fields}: {e}");
        }
        let e = Split::new(-1, &[2, 2], 5).unwrap_err().to_string();
        assert!(e.contains("the part 5 of a split into 2 parts"), "{e}");
        let e = Split::new(-1, &[2, 2], 0).unwrap().output_shape(&Shape::new([3, 5])).unwrap_err().to_string();
        assert!(e.contains("the sizes [2, 2] sum to 4, but axis -1 of samples of shape (5) has length 5"), "{e}");
    }
}
