//! Permute, a sample's axes put in another order: Keras's `Permute(dims)` and PyTorch's
//! `x.permute(0, *dims)` (ATen's `permute`, `transpose`, `t` and `swapaxes` are permutations
//! too: `x.transpose(1, 2)` of (N, A, B) is `dims` [2, 1]), followed by `.contiguous()`:
//! the values really move, into a fresh row-major tensor. The layer (its spec entry
//! `permute`, its spec form, what it keeps for backward: the input's shape), built on its
//! CPU move ([`cpu`]); its GPU form is [`gpu`] (kernels/permute.cu).
//!
//! `dims` are per sample and count from 1, as Keras writes them: output axis j of a sample
//! is its input axis `dims[j]`, the batch staying first. The backward moves the gradient by
//! the inverse permutation. A permutation that leaves every value where it was (it moves
//! only axes of size 1) moves nothing: the output is the input seen with the new shape.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{Build, FieldResult, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Params, ParamsMut};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};
use cpu::Plan;

/// A sample's axes permuted: output axis j is input axis `dims[j]` (1-based, per sample).
#[derive(Clone, Debug)]
pub struct Permute {
    /// A permutation of 1..=rank, Keras's `dims`.
    dims: Vec<usize>,
    /// From the forward: the input's shape (N, ...), for the backward's plan.
    cached: Option<Shape>,
}

impl Permute {
    /// The permutation `dims` of a sample's axes, counted from 1 as Keras counts them: a
    /// permutation of 1..=rank. PyTorch's `x.permute(0, p1, ..., pk)` is `dims` [p1, ..., pk].
    pub fn new(dims: &[usize]) -> Result<Permute> {
        check_dims(dims).map_err(|e| Error::config("Permute", e))?;
        Ok(Permute { dims: dims.to_vec(), cached: None })
    }

    /// The permutation, 1-based.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The permutation of a sample's axes, 0-based (the GPU form's).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn sample_perm(&self) -> Vec<usize> {
        self.dims.iter().map(|d| d - 1).collect()
    }

    /// The permutation of a batch's axes (the batch stays first), 0-based.
    fn batch_perm(&self) -> Vec<usize> {
        std::iter::once(0).chain(self.dims.iter().copied()).collect()
    }

    /// The spec entry: Keras's `Permute(dims)`.
    pub const SPEC: LayerType = LayerType {
        name: "permute",
        fields: "`dims` (per sample, counted from 1: a permutation of 1..=rank)",
        example: (&[2, 3, 4], r#"{"type": "permute", "dims": [3, 1, 2]}"#),
        parse: |f| {
            let dims = f.custom("dims", read_dims, |d| json!(d))?;
            Ok(Build::layer(move |input| {
                let layer = Permute::new(&dims).map_err(|e| e.to_string())?;
                layer.check_rank(input).map(|_| layer)
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

    /// Whether `input` (batch included) has samples of as many axes as `dims` permutes, in
    /// the spec's words.
    fn check_rank(&self, input: &Shape) -> FieldResult<()> {
        let rank = input.ndim().saturating_sub(1);
        if rank == self.dims.len() {
            return Ok(());
        }
        let sample = Shape::new(input.dims().get(1..).unwrap_or_default());
        Err(format!("dims {:?} permute {} axes, but samples of shape {sample} have {rank}", self.dims, self.dims.len()))
    }
}

/// Why `dims` is not a permutation of 1..=dims.len(), or nothing.
fn check_dims(dims: &[usize]) -> FieldResult<()> {
    let k = dims.len();
    let mut sorted = dims.to_vec();
    sorted.sort_unstable();
    if k == 0 || sorted.iter().enumerate().any(|(i, &d)| d != i + 1) {
        return Err(format!(
            "dims {dims:?} is not a permutation of 1..={k} (a sample's axes, counted from 1 as Keras's Permute counts them)"
        ));
    }
    Ok(())
}

/// `dims`: a list of integers that [`check_dims`] accepts.
fn read_dims(v: Option<&Value>) -> FieldResult<Vec<usize>> {
    let what = "a list of a sample's axes, counted from 1";
    let v = v.ok_or_else(|| format!("missing field 'dims' ({what})"))?;
    let dims = match v {
        Value::Array(a) => a.iter().map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok())).collect(),
        _ => None,
    };
    let dims: Vec<usize> = dims.ok_or_else(|| format!("field 'dims' must be {what} (got {v})"))?;
    check_dims(&dims).map_err(|e| format!("field 'dims': {e}"))?;
    Ok(dims)
}

impl Layer for Permute {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "permute"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "permute", "dims": self.dims}))
    }

    fn permutation(&self) -> Option<&[usize]> {
        Some(&self.dims)
    }

    /// Nothing kept: the backward needs only the shapes.
    fn memory(&self, _shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory::NONE)
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        self.check_rank(input).map_err(|e| Error::shape("Permute", e))?;
        let d = input.dims();
        Ok(Shape::new(self.batch_perm().iter().map(|&p| d[p]).collect::<Vec<_>>()))
    }

    // x: (N, ...) → y: (N, ...) with the sample's axes in the order of `dims`
    fn forward(&mut self, x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, _ctx: &Ctx) -> Result<Tensor> {
        let out = self.output_shape(x.shape())?;
        self.cached = Some(x.shape().clone());
        move_by(x, &self.batch_perm(), out)
    }

    // dout: (N, ...) permuted → dx: (N, ...), by the inverse permutation
    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let shape =
            self.cached.take().ok_or_else(|| Error::config("Permute backward", "no forward to differentiate"))?;
        let want = self.output_shape(&shape)?;
        if dout.shape() != &want {
            return Err(Error::shape("Permute backward", format!("dout {} for output {want}", dout.shape())));
        }
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        let mut inverse = vec![0; self.dims.len() + 1];
        for (j, p) in self.batch_perm().into_iter().enumerate() {
            inverse[p] = j;
        }
        move_by(dout, &inverse, shape).map(Some)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Permute { dims: self.dims.clone(), cached: None })
    }

    fn describe(&self) -> String {
        let dims: Vec<String> = self.dims.iter().map(|d| d.to_string()).collect();
        format!("Permute({})", dims.join(", "))
    }
}

/// `x` with its axes permuted by `perm` (0-based, the batch's included) into a tensor of
/// shape `out`: a fresh tensor, or `x` itself seen as `out` where no value moves.
fn move_by(x: Tensor, perm: &[usize], out: Shape) -> Result<Tensor> {
    let plan = Plan::new(x.shape().dims(), perm);
    if plan.is_identity() {
        return x.reshape(out);
    }
    let mut y = vec![0.0f32; x.numel()];
    cpu::permute(x.host(), &plan, &mut y);
    Tensor::from_vec_on(y, out, x.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::model_from_spec_str;
    use crate::tensor::Device;

    fn ctx() -> Ctx<'static> {
        Ctx::train(0, 0, 0, Device::Cpu(0))
    }

    /// (y, dx) of a training pass of `Permute(dims)` on x of `shape`, with upstream
    /// gradient `dy`.
    fn pass(dims: &[usize], shape: &[usize], x: &[f32], dy: &[f32]) -> (Tensor, Tensor) {
        let mut p = Permute::new(dims).unwrap();
        let y = p.forward(
            Tensor::from_vec(x.to_vec(), shape).unwrap(),
            Params::new(&[], &[]),
            ParamsMut::new(&mut [], &[]),
            &ctx(),
        );
        let y = y.unwrap();
        let d = Tensor::from_vec(dy.to_vec(), y.shape().clone()).unwrap();
        let dx = p.backward(d, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx());
        (y, dx.unwrap().unwrap())
    }

    /// The output of scripts/torch_permute.py: x: (2, 2, 3, 4) by the script's formula,
    /// `x.permute(0, 3, 1, 2).contiguous()` (Keras's `dims` [3, 1, 2]) and the gradient of
    /// dy (2, 4, 2, 3) by its formula; then `x.transpose(2, 3)` ([1, 3, 2]). Moves, so exact.
    #[rustfmt::skip]
    mod torch {
        // made by torch 2.15.0+cu132
        pub const Y: &[f32] = &[
            -2.75, -1.5, -0.25, 1.0, 2.25, -2.25, -1.0, 0.25, 1.5, 2.75, -1.75, -0.5,
            0.75, 2.0, -2.5, -1.25, 0.0, 1.25, 2.5, -2.0, -0.75, 0.5, 1.75, -2.75,
            -1.0, 0.25, 1.5, 2.75, -1.75, -0.5, 0.75, 2.0, -2.5, -1.25, 0.0, 1.25,
            2.5, -2.0, -0.75, 0.5, 1.75, -2.75, -1.5, -0.25, 1.0, 2.25, -2.25, -1.0,
        ];
        pub const DX: &[f32] = &[
            -1.0, 0.625, 0.125, -0.375, -0.375, -0.875, 0.75, 0.25, 0.25, -0.25, -0.75, 0.875,
            0.875, 0.375, -0.125, -0.625, -0.625, 1.0, 0.5, 0.0, 0.0, -0.5, -1.0, 0.625,
            -0.875, 0.75, 0.25, -0.25, -0.25, -0.75, 0.875, 0.375, 0.375, -0.125, -0.625, 1.0,
            1.0, 0.5, 0.0, -0.5, -0.5, -1.0, 0.625, 0.125, 0.125, -0.375, -0.875, 0.75,
        ];
        pub const Y_T: &[f32] = &[
            -2.75, -1.5, -0.25, -1.0, 0.25, 1.5, 0.75, 2.0, -2.5, 2.5, -2.0, -0.75,
            1.0, 2.25, -2.25, 2.75, -1.75, -0.5, -1.25, 0.0, 1.25, 0.5, 1.75, -2.75,
            -1.0, 0.25, 1.5, 0.75, 2.0, -2.5, 2.5, -2.0, -0.75, -1.5, -0.25, 1.0,
            2.75, -1.75, -0.5, -1.25, 0.0, 1.25, 0.5, 1.75, -2.75, 2.25, -2.25, -1.0,
        ];
        pub const DX_T: &[f32] = &[
            -1.0, 0.875, 0.625, 0.375, -0.375, -0.625, -0.875, 1.0, 0.25, 0.0, -0.25, -0.5,
            0.125, -0.125, -0.375, -0.625, 0.75, 0.5, 0.25, 0.0, -0.75, -1.0, 0.875, 0.625,
            -0.875, 1.0, 0.75, 0.5, -0.25, -0.5, -0.75, -1.0, 0.375, 0.125, -0.125, -0.375,
            0.25, 0.0, -0.25, -0.5, 0.875, 0.625, 0.375, 0.125, -0.625, -0.875, 1.0, 0.75,
        ];
    }

    #[test]
    fn permute_matches_pytorch() {
        let x: Vec<f32> = (0..48).map(|i| ((i * 7 % 23) as f32 - 11.0) / 4.0).collect();
        let dy: Vec<f32> = (0..48).map(|j| ((j * 5 % 17) as f32 - 8.0) / 8.0).collect();
        let (y, dx) = pass(&[3, 1, 2], &[2, 2, 3, 4], &x, &dy);
        assert_eq!(y.shape().dims(), [2, 4, 2, 3]);
        assert_eq!(y.host(), torch::Y);
        assert_eq!(dx.shape().dims(), [2, 2, 3, 4]);
        assert_eq!(dx.host(), torch::DX);
        let (y, dx) = pass(&[1, 3, 2], &[2, 2, 3, 4], &x, &dy);
        assert_eq!(y.shape().dims(), [2, 2, 4, 3]);
        assert_eq!(y.host(), torch::Y_T);
        assert_eq!(dx.host(), torch::DX_T);
    }

    /// A permutation that moves only axes of size 1 moves no value: the output is the
    /// input's values, not a copy, and so is the gradient.
    #[test]
    fn moving_only_single_axes_copies_nothing() {
        let x: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let mut p = Permute::new(&[2, 1, 3]).unwrap();
        let xt = Tensor::from_vec(x.clone(), [2, 1, 2, 3]).unwrap();
        let at = xt.host().as_ptr();
        let y = p.forward(xt, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx()).unwrap();
        assert_eq!((y.shape().dims(), y.host().as_ptr()), (&[2, 2, 1, 3][..], at));
        let dx = p.backward(y, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx());
        let dx = dx.unwrap().unwrap();
        assert_eq!((dx.shape().dims(), dx.host()), (&[2, 1, 2, 3][..], &x[..]));
    }

    /// The shapes of scripts/torch_permute_bench.py, timed alike: a forward and a backward
    /// of the layer, the minimum and the median over 200 repetitions after 20, on a pool of
    /// LOCKSTEP_BENCH_THREADS threads (2 by default). `cargo test --release --lib
    /// ops::permute -- --ignored --nocapture`.
    #[test]
    #[ignore = "a timing, not a check: run by hand"]
    fn time_forward_and_backward_against_the_torch_script() {
        let cases: [(&str, &[usize], &[usize]); 5] = [
            ("attention heads (T, H, D) -> (H, T, D)", &[12, 64, 4, 32], &[2, 1, 3]),
            ("attention heads, larger", &[12, 256, 8, 64], &[2, 1, 3]),
            ("last two axes (T, C) -> (C, T)", &[12, 64, 128], &[2, 1]),
            ("last two axes of (H, T, D)", &[12, 8, 256, 64], &[1, 3, 2]),
            ("channels last (C, H, W) -> (H, W, C)", &[64, 32, 28, 28], &[2, 3, 1]),
        ];
        let threads = std::env::var("LOCKSTEP_BENCH_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(2);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        eprintln!("{threads} rayon threads");
        for (what, shape, dims) in cases {
            let n = shape.iter().product::<usize>();
            let x = Tensor::from_vec(crate::testing::uniform(1, n), shape).unwrap();
            let mut p = Permute::new(dims).unwrap();
            let out = p.output_shape(x.shape()).unwrap();
            let dy = Tensor::from_vec(crate::testing::uniform(2, n), out).unwrap();
            let mut times: Vec<f64> = pool.install(|| {
                (0..220)
                    .map(|_| {
                        let t = std::time::Instant::now();
                        let none = || (Params::new(&[], &[]), ParamsMut::new(&mut [], &[]));
                        let (a, b) = none();
                        let y = p.forward(x.clone(), a, b, &ctx()).unwrap();
                        let (a, b) = none();
                        let dx = p.backward(dy.clone(), a, b, InputGrad::Needed, &ctx()).unwrap();
                        let t = t.elapsed().as_secs_f64() * 1e6;
                        drop((y, dx));
                        t
                    })
                    .skip(20)
                    .collect()
            });
            times.sort_by(f64::total_cmp);
            let shape = format!("{shape:?}");
            eprintln!("{what:<40} {shape:<20} min {:9.1} µs, median {:9.1} µs", times[0], times[times.len() / 2]);
        }
    }

    #[test]
    fn the_spec_entry_reads_keras_dims() {
        let m = model_from_spec_str(
            r#"{"input_shape": [2, 3, 4], "layers": [{"type": "permute", "dims": [2, 3, 1]}]}"#,
            "m.json",
        )
        .unwrap();
        assert_eq!(m.layer_names(), ["permute0"]);
        assert_eq!(m.layers()[0].describe(), "Permute(2, 3, 1)");
        assert_eq!(m.output_shape().dims(), [3, 4, 2]);
        assert_eq!(m.layers()[0].spec(), Some(json!({"type": "permute", "dims": [2, 3, 1]})));
    }

    /// Each bad `dims` is refused by name, in the spec as in the layer.
    #[test]
    fn bad_dims_are_refused_naming_the_axes() {
        for (dims, want) in [
            (
                "[0, 1, 2]",
                "field 'dims': dims [0, 1, 2] is not a permutation of 1..=3 (a sample's axes, counted from 1",
            ),
            ("[1, 1, 2]", "dims [1, 1, 2] is not a permutation of 1..=3"),
            ("[2, 4, 1]", "dims [2, 4, 1] is not a permutation of 1..=3"),
            ("[]", "dims [] is not a permutation of 1..=0"),
            ("[2, 1]", "layer 0 (permute): dims [2, 1] permute 2 axes, but samples of shape (2, 3, 4) have 3"),
            ("[-1, 1, 2]", "field 'dims' must be a list of a sample's axes, counted from 1 (got [-1,1,2])"),
            ("\"21\"", "field 'dims' must be a list of a sample's axes"),
        ] {
            let spec = format!(r#"{{"input_shape": [2, 3, 4], "layers": [{{"type": "permute", "dims": {dims}}}]}}"#);
            let e = model_from_spec_str(&spec, "m.json").unwrap_err().to_string();
            assert!(e.contains(want), "{dims}: {e}");
        }
        let e = model_from_spec_str(r#"{"input_shape": [4], "layers": [{"type": "permute"}]}"#, "m.json");
        assert!(e.unwrap_err().to_string().contains("missing field 'dims'"));
        let e = Permute::new(&[3, 1]).unwrap_err().to_string();
        assert!(e.contains("dims [3, 1] is not a permutation of 1..=2"), "{e}");
        let e = Permute::new(&[2, 1]).unwrap().output_shape(&Shape::new([5, 6])).unwrap_err().to_string();
        assert!(e.contains("dims [2, 1] permute 2 axes, but samples of shape (6) have 1"), "{e}");
    }
}
