//! The learned positional embedding, nanoGPT's `wpe`: a table of P positions (its
//! `block_size`) by C values, whose first T rows are added to every sequence of the
//! batch, `x + wpe(arange(T))`. The layer (its spec entry `positional_embedding`, its
//! spec form, what it keeps: nothing), built on its CPU forward and backward ([`cpu`]);
//! its GPU form is [`gpu`] (kernels/positional.cu).
//!
//! nanoGPT computes `tok_emb + pos_emb` with the positions as an `nn.Embedding` of the
//! ids 0..T; adding the table's rows in place of looking them up is the same sum, and a
//! layer of its own keeps the token embedding free of the context length.
//!
//! # Gradients
//! `dweight[t] += Σ_n dout[n, t]`, n ascending (each value added into the gradient in turn,
//! so the order is fixed and the GPU's is the same); rows T..P get nothing. dx = dout.
//!
//! A context longer than the table is an error that names both, at build (the spec's
//! running shape, `output_shape`) and at every pass: `a context of 80 positions is above
//! the positional table's 64`.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{Build, LayerType};
use super::{Ctx, Init, InputGrad, Layer, LayerMemory, LayerShapes, ParamSpec, Params, ParamsMut};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// nanoGPT's initialisation of its position table (`_init_weights`, an `nn.Embedding`):
/// N(0, 0.02²).
const INIT_STD: f32 = 0.02;

/// Why a context of `t` positions does not fit a table of `length`.
fn too_long(t: usize, length: usize) -> String {
    format!("a context of {t} positions is above the positional table's {length}")
}

/// A learned vector per position, added to each sequence.
#[derive(Clone, Debug)]
pub struct PositionalEmbedding {
    /// P, the positions of the table: the longest context it serves.
    length: usize,
    /// C, the values per position (the width of the sequence it is added to).
    width: usize,
}

impl PositionalEmbedding {
    /// A table of `length` positions (P) of `width` values (C), initialised N(0, 0.02²)
    /// as nanoGPT does.
    pub fn new(length: usize, width: usize) -> Result<PositionalEmbedding> {
        if length == 0 || width == 0 {
            return Err(Error::config(
                "positional embedding",
                format!("length {length} and width {width} must be positive"),
            ));
        }
        Ok(PositionalEmbedding { length, width })
    }

    /// P, the positions of the table.
    pub fn length(&self) -> usize {
        self.length
    }

    /// C, the values per position.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The spec entry: nanoGPT's `wpe`, `nn.Embedding(length, C)` over the positions,
    /// added; C is the running shape's last dimension.
    pub const SPEC: LayerType = LayerType {
        name: "positional_embedding",
        fields: "`length` (the table's positions, at least the context T); samples (T, C)",
        example: (&[6, 4], r#"{"type": "positional_embedding", "length": 8}"#),
        parse: |f| {
            let length = f.size("length", None)?;
            Ok(Build::layer(move |input| match *input.dims() {
                [_, t, _] if t > length => Err(too_long(t, length)),
                [_, _, c] => PositionalEmbedding::new(length, c).map_err(|e| e.to_string()),
                _ => Err(format!("expects sequences (T, C), got samples of shape {}", Shape::new(&input.dims()[1..]))),
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

    /// (N, T) of a (N, T, C) tensor this layer applies to, or an error of `op` naming why
    /// not.
    fn check(&self, op: &'static str, shape: &Shape) -> Result<(usize, usize)> {
        match *shape.dims() {
            [n, t, c] if c == self.width && t <= self.length => Ok((n, t)),
            [_, t, c] if c == self.width => Err(Error::shape(op, too_long(t, self.length))),
            _ => Err(Error::shape(op, format!("expects sequences (N, T, {}), got {shape}", self.width))),
        }
    }
}

impl Layer for PositionalEmbedding {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "positional"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "positional_embedding", "length": self.length}))
    }

    /// Nothing: the backward needs only dout.
    fn memory(&self, _shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory::NONE)
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        self.check("PositionalEmbedding", input)?;
        Ok(input.clone())
    }

    fn params(&self) -> Vec<ParamSpec> {
        vec![ParamSpec {
            name: "weight".into(),
            shape: Shape::new([self.length, self.width]),
            init: Init::Normal { std: INIT_STD },
        }]
    }

    // x: (N, T, C) → y = x + weight[0..T], broadcast over N
    fn forward(&mut self, mut x: Tensor, params: Params<'_>, _b: ParamsMut<'_>, _ctx: &Ctx) -> Result<Tensor> {
        let (_, t) = self.check("PositionalEmbedding", x.shape())?;
        cpu::positional_forward(x.host_mut(), &params.get(0)[..t * self.width]);
        Ok(x)
    }

    // dout: (N, T, C) → dweight[0..T] (T, C) += Σ_n dout[n], n ascending; dx = dout
    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        mut dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let (_, t) = self.check("PositionalEmbedding backward", dout.shape())?;
        cpu::positional_backward(dout.host(), &mut dparams.get(0)[..t * self.width]);
        Ok((input_grad == InputGrad::Needed).then_some(dout))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }

    fn describe(&self) -> String {
        format!("PositionalEmbedding({}, {})", self.length, self.width)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::spec::model_from_spec_str;
    use crate::tensor::Device;

    /// The ranges of a layer of one tensor of `len` values, as `Sequential` lays it out.
    fn one_tensor(len: usize) -> Vec<std::ops::Range<usize>> {
        vec![0..len; 1]
    }

    fn ctx() -> Ctx<'static> {
        Ctx::train(0, 0, 0, Device::Cpu(0))
    }

    /// Forward of x (N, T, C) over `weight`, then the backward of `dout` into `dweight`:
    /// (y, dx).
    fn run(
        p: &mut PositionalEmbedding,
        weight: &[f32],
        x: &[f32],
        dims: [usize; 3],
        dout: &[f32],
        dweight: &mut [f32],
    ) -> (Vec<f32>, Vec<f32>) {
        let ranges = one_tensor(weight.len());
        let x = Tensor::from_vec(x.to_vec(), dims).unwrap();
        let y = p.forward(x, Params::new(weight, &ranges), ParamsMut::new(&mut [], &[]), &ctx()).unwrap();
        let d = Tensor::from_vec(dout.to_vec(), dims).unwrap();
        let dx = p
            .backward(d, Params::new(weight, &ranges), ParamsMut::new(dweight, &ranges), InputGrad::Needed, &ctx())
            .unwrap()
            .unwrap();
        (y.into_vec(), dx.into_vec())
    }

    #[test]
    fn forward_adds_the_first_t_rows_and_backward_sums_over_the_batch() {
        // Table (P = 4, C = 2): row p is [p, −p]; x (N = 2, T = 3, C = 2) is 100·(index).
        let weight: Vec<f32> = (0..4).flat_map(|p| [p as f32, -(p as f32)]).collect();
        let x: Vec<f32> = (0..12).map(|i| 100.0 * i as f32).collect();
        let dout: Vec<f32> = (0..12).map(|i| 0.5 * i as f32).collect();
        let mut dweight = vec![1.0; 8];
        let mut p = PositionalEmbedding::new(4, 2).unwrap();
        let (y, dx) = run(&mut p, &weight, &x, [2, 3, 2], &dout, &mut dweight);
        #[rustfmt::skip]
        assert_eq!(y, [
            0.0, 100.0,    201.0, 299.0,   402.0, 498.0,
            600.0, 700.0,  801.0, 899.0,  1002.0, 1098.0,
        ]);
        assert_eq!(dx, dout, "dx = dout");
        // dweight[t, c] = 1 + dout[0, t, c] + dout[1, t, c]; with i = 2t + c that is
        // 1 + 0.5·i + 0.5·(i + 6) = 4 + i. Row 3, beyond T, stays at its 1.
        assert_eq!(dweight, [4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 1.0, 1.0]);
    }

    #[test]
    fn gradients_match_finite_differences() {
        // L = Σ r ⊙ y for a fixed random r: dL/dweight and dL/dx against central
        // differences in f64 of the layer's own f32 forward (step 1e-2 on values ~1: the
        // layer is linear, so the difference is exact up to the f32 rounding of y, some
        // 1e-7·|y|/1e-2 ≈ 1e-5 per term; bound 1e-3).
        let (n, t, c, len) = (3, 4, 5, 6);
        let mut g = crate::rng::SplitMix64::new(11);
        let mut uniform = |k: usize| (0..k).map(|_| g.next_f64() as f32 * 2.0 - 1.0).collect::<Vec<f32>>();
        let (weight, x, r) = (uniform(len * c), uniform(n * t * c), uniform(n * t * c));
        let mut p = PositionalEmbedding::new(len, c).unwrap();
        let mut dweight = vec![0.0; len * c];
        let (_, dx) = run(&mut p, &weight, &x, [n, t, c], &r, &mut dweight);
        let loss = |weight: &[f32], x: &[f32]| {
            let ranges = one_tensor(weight.len());
            let xt = Tensor::from_vec(x.to_vec(), [n, t, c]).unwrap();
            let y = PositionalEmbedding::new(len, c)
                .unwrap()
                .forward(xt, Params::new(weight, &ranges), ParamsMut::new(&mut [], &[]), &ctx())
                .unwrap();
            y.host().iter().zip(&r).map(|(&y, &r)| f64::from(y) * f64::from(r)).sum::<f64>()
        };
        let h = 1e-2f32;
        for i in 0..weight.len() {
            let (mut up, mut down) = (weight.clone(), weight.clone());
            (up[i], down[i]) = (up[i] + h, down[i] - h);
            let fd = (loss(&up, &x) - loss(&down, &x)) / (2.0 * f64::from(h));
            assert!((fd - f64::from(dweight[i])).abs() <= 1e-3, "dweight[{i}]: fd {fd} vs {}", dweight[i]);
        }
        for i in 0..x.len() {
            let (mut up, mut down) = (x.clone(), x.clone());
            (up[i], down[i]) = (up[i] + h, down[i] - h);
            let fd = (loss(&weight, &up) - loss(&weight, &down)) / (2.0 * f64::from(h));
            assert!((fd - f64::from(dx[i])).abs() <= 1e-3, "dx[{i}]: fd {fd} vs {}", dx[i]);
        }
        // Rows t ≥ T of the table are not in the loss: their gradient is exactly 0.
        assert!(dweight[t * c..].iter().all(|&d| d == 0.0));
    }

    #[test]
    fn backward_is_the_ordered_sum_bit_for_bit() {
        // Sums over n in order, into the gradient's value: with dout 1e8, 1, −1e8 over n
        // (and the start 0), f32 gives (1e8 + 1) − 1e8 = 0; the same every run.
        let mut p = PositionalEmbedding::new(2, 1).unwrap();
        let weight = [0.0, 0.0];
        let mut runs = Vec::new();
        for _ in 0..3 {
            let mut dweight = [0.0f32, 0.5];
            run(&mut p, &weight, &[0.0; 6], [3, 2, 1], &[1e8, 1.0, 1.0, 1.0, -1e8, 1.0], &mut dweight);
            runs.push(dweight);
        }
        assert_eq!(runs[0], [0.0, 3.5]);
        assert!(runs.iter().all(|r| r.map(f32::to_bits) == runs[0].map(f32::to_bits)));
    }

    #[test]
    fn a_context_above_the_table_and_a_wrong_shape_are_named() {
        let p = PositionalEmbedding::new(64, 8).unwrap();
        let err = p.output_shape(&Shape::new([2, 80, 8])).unwrap_err().to_string();
        assert!(err.contains("a context of 80 positions is above the positional table's 64"), "{err}");
        assert_eq!(p.output_shape(&Shape::new([2, 64, 8])).unwrap().dims(), [2, 64, 8]);
        assert_eq!(p.output_shape(&Shape::new([2, 1, 8])).unwrap().dims(), [2, 1, 8]);
        let err = p.output_shape(&Shape::new([2, 16, 4])).unwrap_err().to_string();
        assert!(err.contains("expects sequences (N, T, 8), got (2, 16, 4)"), "{err}");
        let err = p.output_shape(&Shape::new([2, 16])).unwrap_err().to_string();
        assert!(err.contains("expects sequences"), "{err}");
        // At the forward too (a layer built for one shape, handed another).
        let weight = vec![0.0; 64 * 8];
        let x = Tensor::from_vec(vec![0.0; 80 * 8], [1, 80, 8]).unwrap();
        let ranges = one_tensor(weight.len());
        let err = p
            .clone()
            .forward(x, Params::new(&weight, &ranges), ParamsMut::new(&mut [], &[]), &ctx())
            .unwrap_err()
            .to_string();
        assert!(err.contains("a context of 80 positions is above the positional table's 64"), "{err}");
        assert!(PositionalEmbedding::new(0, 8).is_err() && PositionalEmbedding::new(8, 0).is_err());
    }

    #[test]
    fn the_spec_builds_it_after_an_embedding_and_refuses_a_long_context() {
        let spec = |t: usize| {
            format!(
                r#"{{"input_shape": [{t}], "layers": [{{"type": "embedding", "vocab": 256, "width": 128}},
                    {{"type": "positional_embedding", "length": 64}}]}}"#
            )
        };
        let model = model_from_spec_str(&spec(64), "gpt.json").unwrap();
        assert_eq!(model.layer_names(), ["embedding0", "positional0"]);
        assert_eq!(model.output_shape().dims(), [64, 128]);
        assert_eq!(model.layers()[1].describe(), "PositionalEmbedding(64, 128)");
        let weight = &model.param_infos()[1];
        assert_eq!((weight.name.as_str(), weight.shape.dims()), ("positional0.weight", &[64, 128][..]));
        assert_eq!(weight.init, Init::Normal { std: 0.02 });
        assert_eq!(model.layers()[1].memory(&model.layer_shapes()[1]), Some(LayerMemory::NONE));
        let err = model_from_spec_str(&spec(80), "gpt.json").unwrap_err().to_string();
        assert!(err.contains("a context of 80 positions is above the positional table's 64"), "{err}");
        let err = model_from_spec_str(
            r#"{"input_shape": [8], "layers": [{"type": "positional_embedding", "length": 8}]}"#,
            "m.json",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("expects sequences (T, C), got samples of shape (8)"), "{err}");
    }
}
