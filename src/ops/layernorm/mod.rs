//! LayerNorm over the last dimension, PyTorch's `nn.LayerNorm(C, eps=1e-5,
//! elementwise_affine=True, bias=True)` (nanoGPT's `LayerNorm(ndim, bias)` when the bias is
//! off): the layer, built on its CPU forward and backward ([`cpu`], which states the order
//! of every sum), its spec entry (`layer_norm`), its spec form and what it keeps for
//! backward. Its GPU form is [`gpu`] (kernels/layernorm.cu).
//!
//! The input is (N, ..., C), in the GPT (N, T, C): every run of C values along the last
//! dimension is a ROW, normalised by its own mean and BIASED variance (PyTorch's), then
//! scaled by `weight` (C) and shifted by `bias` (C):
//!   y = (x − mean)·rstd·w + b,   rstd = 1/√(var + eps).
//! Rows are independent, so no statistic crosses samples or replicas (unlike BatchNorm),
//! and nothing here knows of logical replicas. Only the parameter gradients are summed
//! over rows.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{Build, FieldResult, LayerType};
use super::{Ctx, Init, InputGrad, Layer, LayerMemory, LayerShapes, Mode, ParamSpec, Params, ParamsMut, F32};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// Bytes of an f64, for the memory account (the kept rstd).
const F64: u64 = 8;

/// Normalisation over the last dimension, with a learned scale and (optionally) shift.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    /// C: the width of the last dimension.
    width: usize,
    eps: f32,
    use_bias: bool,
    /// x̂: (N, ..., C) as f32 and rstd: (rows) as f64, from the training forward; the
    /// vectors keep their capacity from step to step.
    xhat: Vec<f32>,
    rstd: Vec<f64>,
    /// Each chunk of rows' column sums (Σ dy·x̂ then Σ dy, C each), reused by each backward.
    partials: Vec<f64>,
    cached: Option<Shape>,
}

impl LayerNorm {
    /// PyTorch's `nn.LayerNorm(width)`: eps 1e-5, weight and bias.
    pub fn new(width: usize) -> LayerNorm {
        LayerNorm {
            width,
            eps: 1e-5,
            use_bias: true,
            xhat: Vec::new(),
            rstd: Vec::new(),
            partials: Vec::new(),
            cached: None,
        }
    }

    /// Sets eps (added to the variance).
    pub fn eps(mut self, eps: f32) -> Self {
        self.eps = eps;
        self
    }

    /// The same layer without a bias (PyTorch's `bias=False`, nanoGPT's `bias=False`).
    pub fn without_bias(mut self) -> Self {
        self.use_bias = false;
        self
    }

    /// The width C of the last dimension it normalises.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The spec entry: PyTorch's `nn.LayerNorm(C, eps=1e-5, bias=True)` over the last
    /// dimension, C that of the running shape.
    pub const SPEC: LayerType = LayerType {
        name: "layer_norm",
        fields: "`eps` (1e-5), `use_bias` (true)",
        example: (&[2, 3, 6], r#"{"type": "layer_norm", "eps": 0.001, "use_bias": true}"#),
        parse: |f| {
            let eps = f.number("eps", Some(1e-5), (|x| x > 0.0, "a positive number"))?;
            let use_bias = f.boolean("use_bias", true)?;
            Ok(Build::layer(move |input| {
                let ln = LayerNorm::new(expect_last_dim(input)?).eps(eps);
                Ok(if use_bias { ln } else { ln.without_bias() })
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

    /// The rows of an input of shape `shape` (batch included), or why it is not one.
    fn rows(&self, shape: &Shape, op: &'static str) -> Result<usize> {
        match shape.dims() {
            [_, .., c] if *c == self.width => Ok(shape.numel() / self.width.max(1)),
            [_, .., c] => Err(Error::shape(
                op,
                format!("normalises a last dimension of {}, got {shape} (last dimension {c})", self.width),
            )),
            _ => Err(Error::shape(op, format!("expects (N, ..., {}), got {shape}", self.width))),
        }
    }
}

/// The width of the last dimension of the running shape (N, ..., C), or the spec's words
/// for an input without one.
fn expect_last_dim(input: &Shape) -> FieldResult<usize> {
    match input.dims() {
        [_, .., c] => Ok(*c),
        _ => Err(format!("expects samples with a last dimension to normalise, got {input}")),
    }
}

impl Layer for LayerNorm {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "ln"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "layer_norm", "eps": self.eps, "use_bias": self.use_bias}))
    }

    /// Its normalised input x̂ as f32, and each row's rstd as f64.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let values = shapes.input.numel() as u64;
        let rows = values / self.width.max(1) as u64;
        Some(LayerMemory {
            kept_per_sample: values.saturating_mul(F32).saturating_add(rows * F64),
            ..LayerMemory::NONE
        })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        self.rows(input, "LayerNorm")?;
        Ok(input.clone())
    }

    fn params(&self) -> Vec<ParamSpec> {
        let shape = Shape::new([self.width]);
        let mut p = vec![ParamSpec { name: "weight".into(), shape: shape.clone(), init: Init::Ones }];
        if self.use_bias {
            p.push(ParamSpec { name: "bias".into(), shape, init: Init::Zeros });
        }
        p
    }

    // x: (N, ..., C) → y: (N, ..., C); training keeps x̂ (N, ..., C) and rstd (rows)
    fn forward(&mut self, mut x: Tensor, params: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let rows = self.rows(x.shape(), "LayerNorm")?;
        let (c, eps) = (self.width, self.eps);
        let (weight, bias) = (params.get(0), self.use_bias.then(|| params.get(1)));
        if ctx.mode == Mode::Train {
            self.xhat.resize(rows * c, 0.0);
            self.rstd.resize(rows, 0.0);
            cpu::layernorm_forward(x.host_mut(), Some((&mut self.xhat, &mut self.rstd)), weight, bias, eps);
            self.cached = Some(x.shape().clone());
        } else {
            cpu::layernorm_forward(x.host_mut(), None, weight, bias, eps);
        }
        Ok(x)
    }

    // dout: (N, ..., C) → dx = rstd·((g − mean(g)) − x̂·mean(g·x̂)), g = dout·w, per row;
    // dweight += Σ_rows dout·x̂, dbias += Σ_rows dout (C)
    fn backward(
        &mut self,
        mut dout: Tensor,
        params: Params<'_>,
        mut dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let shape = self
            .cached
            .take()
            .ok_or_else(|| Error::config("LayerNorm backward", "no training forward to differentiate"))?;
        if dout.shape() != &shape {
            return Err(Error::shape("LayerNorm backward", format!("dout {} for input {shape}", dout.shape())));
        }
        let (dweight, dbias) = match self.use_bias {
            true => {
                let (dw, db) = dparams.pair(0, 1);
                (dw, Some(db))
            }
            false => (dparams.get(0), None),
        };
        let (xhat, rstd) = (&self.xhat, &self.rstd);
        cpu::layernorm_backward(
            dout.host_mut(),
            xhat,
            rstd,
            params.get(0),
            dweight,
            dbias,
            &mut self.partials,
            input_grad,
        );
        Ok((input_grad == InputGrad::Needed).then_some(dout))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        let ln = LayerNorm::new(self.width).eps(self.eps);
        Box::new(if self.use_bias { ln } else { ln.without_bias() })
    }

    fn describe(&self) -> String {
        format!("LayerNorm({}, eps {}{})", self.width, self.eps, if self.use_bias { "" } else { ", no bias" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::nn::Sequential;
    use crate::rng::SplitMix64;
    use crate::tensor::Device;

    fn uniform(rng: &mut SplitMix64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| lo + (hi - lo) * rng.next_f32()).collect()
    }

    /// The layer alone in a model of per-sample shape `dims[1..]`, with `w`, `b` as its
    /// parameters: (y, dx, dweight, dbias) of a training pass with upstream gradient `dy`,
    /// the parameter gradients accumulated onto `g0`.
    fn run(ln: LayerNorm, dims: &[usize], x: &[f32], wb: (&[f32], &[f32]), dy: &[f32], g0: f32) -> [Vec<f32>; 4] {
        let use_bias = ln.use_bias;
        let mut m = Sequential::new(&dims[1..], vec![Box::new(ln)]).unwrap();
        let infos = m.param_infos().to_vec();
        let mut params = vec![0.0; m.params_len()];
        params[infos[0].range.clone()].copy_from_slice(wb.0);
        if use_bias {
            params[infos[1].range.clone()].copy_from_slice(wb.1);
        }
        let mut grads = vec![g0; m.params_len()];
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let y = m.forward(Tensor::from_vec(x.to_vec(), dims).unwrap(), &params, &mut [], &ctx).unwrap();
        let dx = m.backward_input(Tensor::from_vec(dy.to_vec(), dims).unwrap(), &params, &mut grads, &ctx).unwrap();
        let db = if use_bias { grads[infos[1].range.clone()].to_vec() } else { Vec::new() };
        [y.into_vec(), dx.into_vec(), grads[infos[0].range.clone()].to_vec(), db]
    }

    /// PyTorch's LayerNorm written plainly in f64 (the textbook formula, no lanes): the
    /// function whose finite differences check the layer's gradients.
    fn reference(x: &[f64], w: &[f64], b: &[f64], c: usize, eps: f64) -> Vec<f64> {
        let mut y = Vec::with_capacity(x.len());
        for row in x.chunks_exact(c) {
            let mean = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / c as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            y.extend(row.iter().enumerate().map(|(i, v)| (v - mean) * rstd * w[i] + b[i]));
        }
        y
    }

    #[test]
    fn forward_and_gradients_match_finite_differences_of_the_f64_formula() {
        // (N, T, C) = (2, 3, 5): rows of 5 (below one lane round) and (1, 2, 37): a row
        // longer than the 32 lanes, so the tail lanes are exercised too.
        for (dims, seed) in [([2usize, 3, 5], 1u64), ([1, 2, 37], 2)] {
            let c = dims[2];
            let n = dims.iter().product::<usize>();
            let mut rng = SplitMix64::new(seed);
            let x = uniform(&mut rng, n, -2.0, 3.0);
            let w = uniform(&mut rng, c, 0.5, 1.5);
            let b = uniform(&mut rng, c, -0.5, 0.5);
            let dy = uniform(&mut rng, n, -1.0, 1.0);
            let eps = 1e-5;
            let [y, dx, dw, db] = run(LayerNorm::new(c), &dims, &x, (&w, &b), &dy, 0.25);
            let f64s = |v: &[f32]| v.iter().map(|&v| v as f64).collect::<Vec<f64>>();
            let (x64, w64, b64, dy64) = (f64s(&x), f64s(&w), f64s(&b), f64s(&dy));
            // The forward: within a few f32 ulps of the f64 formula (one rounding at the end).
            for (i, (&got, want)) in y.iter().zip(reference(&x64, &w64, &b64, c, eps)).enumerate() {
                assert!((got as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()), "y[{i}]: {got} vs {want}");
            }
            // The loss L = Σ dy·y; central differences of the f64 formula, h = 1e-5: their
            // truncation error is O(h²·|f'''|) ≈ 1e-10 and their rounding 1e-16/h ≈ 1e-11,
            // so a gradient within 2e-6·(1 + |g|) is the formula's gradient to f32 accuracy
            // (the layer rounds each value to f32 once: 6e-8 relative, plus the sums').
            let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
                reference(x, w, b, c, eps).iter().zip(&dy64).map(|(y, d)| y * d).sum()
            };
            let h = 1e-5;
            let numeric = |which: usize, i: usize| {
                let mut args = [x64.clone(), w64.clone(), b64.clone()];
                args[which][i] += h;
                let up = loss(&args[0], &args[1], &args[2]);
                args[which][i] -= 2.0 * h;
                let down = loss(&args[0], &args[1], &args[2]);
                (up - down) / (2.0 * h)
            };
            let check = |what: &str, which: usize, got: &[f32], offset: f32| {
                for (i, &g) in got.iter().enumerate() {
                    let (g, want) = ((g - offset) as f64, numeric(which, i));
                    assert!((g - want).abs() <= 2e-6 * (1.0 + want.abs()), "{what}[{i}] of {dims:?}: {g} vs {want}");
                }
            };
            check("dx", 0, &dx, 0.0);
            // The parameter gradients were accumulated onto 0.25 (the gradient contract).
            check("dweight", 1, &dw, 0.25);
            check("dbias", 2, &db, 0.25);
        }
    }

    #[test]
    fn without_bias_it_is_the_layer_with_a_zero_bias_and_has_one_tensor() {
        let dims = [3usize, 4, 8];
        let n = 96;
        let mut rng = SplitMix64::new(3);
        let (x, w, dy) =
            (uniform(&mut rng, n, -1.0, 1.0), uniform(&mut rng, 8, 0.5, 1.5), uniform(&mut rng, n, -1.0, 1.0));
        let with = run(LayerNorm::new(8), &dims, &x, (&w, &[0.0; 8]), &dy, 0.0);
        let without = run(LayerNorm::new(8).without_bias(), &dims, &x, (&w, &[]), &dy, 0.0);
        // x̂·w + 0 and x̂·w differ only in the sign of a zero.
        for k in 0..3 {
            assert_eq!(with[k], without[k], "output {k}");
        }
        assert!(without[3].is_empty());
        let names: Vec<_> = LayerNorm::new(8).without_bias().params().iter().map(|p| p.name.to_string()).collect();
        assert_eq!(names, ["weight"]);
    }

    #[test]
    fn results_are_bitwise_independent_of_the_thread_count() {
        // 150 rows of 40: three chunks (64, 64, 22) and a lane tail of 8.
        let dims = [5usize, 30, 40];
        let n = dims.iter().product::<usize>();
        let mut rng = SplitMix64::new(4);
        let (x, dy) = (uniform(&mut rng, n, -3.0, 3.0), uniform(&mut rng, n, -1.0, 1.0));
        let (w, b) = (uniform(&mut rng, 40, 0.5, 1.5), uniform(&mut rng, 40, -0.5, 0.5));
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| run(LayerNorm::new(40), &dims, &x, (&w, &b), &dy, 0.0))
        };
        let one = on(1);
        for threads in [2, 3] {
            let many = on(threads);
            for k in 0..4 {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&one[k]), bits(&many[k]), "output {k} on {threads} threads");
            }
        }
    }

    #[test]
    fn a_row_of_equal_values_normalises_to_zero_and_passes_no_gradient() {
        // var = 0: rstd = 1/√eps, x̂ = 0, y = b; dx = rstd·(g − mean(g)), dweight += 0.
        let [y, dx, dw, db] = run(LayerNorm::new(4), &[1, 4], &[2.5; 4], (&[1.0; 4], &[0.5; 4]), &[1.0; 4], 0.0);
        assert_eq!(y, [0.5; 4]);
        assert_eq!(dx, [0.0; 4]);
        assert_eq!(dw, [0.0; 4]);
        assert_eq!(db, [1.0; 4]);
    }

    #[test]
    fn shapes_are_checked_and_errors_name_the_width() {
        let ln = LayerNorm::new(8);
        assert_eq!(ln.output_shape(&Shape::new([2, 3, 8])).unwrap(), Shape::new([2, 3, 8]));
        assert_eq!(ln.output_shape(&Shape::new([2, 8])).unwrap(), Shape::new([2, 8]));
        let e = ln.output_shape(&Shape::new([2, 3, 7])).unwrap_err().to_string();
        assert!(e.contains("LayerNorm") && e.contains("last dimension of 8") && e.contains("(2, 3, 7)"), "{e}");
        let e = ln.output_shape(&Shape::new([8])).unwrap_err().to_string();
        assert!(e.contains("expects (N, ..., 8)"), "{e}");
        // Backward without a training forward, and with a gradient of another shape.
        let mut ln = LayerNorm::new(2);
        let (w, mut g) = ([1.0f32, 1.0, 0.0, 0.0], [0.0f32; 4]);
        let ranges = [0..2, 2..4];
        let d = || Tensor::from_vec(vec![1.0; 4], [2, 2]).unwrap();
        let ctx = Ctx::eval(Device::Cpu(0));
        let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 5.0], [2, 2]).unwrap();
        ln.forward(x, Params::new(&w, &ranges), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let e = ln.backward(d(), Params::new(&w, &ranges), ParamsMut::new(&mut g, &ranges), InputGrad::Needed, &ctx);
        assert!(e.unwrap_err().to_string().contains("no training forward"), "evaluation keeps nothing");
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 5.0], [2, 2]).unwrap();
        ln.forward(x, Params::new(&w, &ranges), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let wrong = Tensor::from_vec(vec![1.0; 4], [1, 4]).unwrap();
        let e = ln.backward(wrong, Params::new(&w, &ranges), ParamsMut::new(&mut g, &ranges), InputGrad::Needed, &ctx);
        assert!(e.unwrap_err().to_string().contains("dout (1, 4) for input (2, 2)"));
    }

    #[test]
    fn an_empty_batch_passes_through_and_adds_nothing() {
        let [y, dx, dw, db] = run(LayerNorm::new(4), &[0, 3, 4], &[], (&[1.0; 4], &[0.0; 4]), &[], 0.5);
        assert!(y.is_empty() && dx.is_empty());
        assert_eq!((dw, db), (vec![0.5; 4], vec![0.5; 4]));
    }

    #[test]
    fn evaluation_computes_the_training_output() {
        let dims = [2usize, 70, 16];
        let n = dims.iter().product::<usize>();
        let mut rng = SplitMix64::new(5);
        let (x, w, b) =
            (uniform(&mut rng, n, -2.0, 2.0), uniform(&mut rng, 16, 0.5, 1.5), uniform(&mut rng, 16, -1.0, 1.0));
        let mut params = w.clone();
        params.extend(&b);
        let ranges = [0..16, 16..32];
        let mut ln = LayerNorm::new(16);
        let mut y = |ctx: &Ctx| {
            let t = Tensor::from_vec(x.clone(), dims).unwrap();
            ln.forward(t, Params::new(&params, &ranges), ParamsMut::new(&mut [], &[]), ctx).unwrap().into_vec()
        };
        let train = y(&Ctx::train(0, 0, 0, Device::Cpu(0)));
        assert_eq!(train, y(&Ctx::eval(Device::Cpu(0))));
    }

    #[test]
    fn the_spec_entry_reads_its_fields_and_infers_the_width() {
        use crate::spec::model_from_spec_str;
        let m =
            model_from_spec_str(r#"{"input_shape": [4, 8], "layers": [{"type": "layer_norm"}]}"#, "m.json").unwrap();
        assert_eq!(m.layer_names(), ["ln0"]);
        assert_eq!(m.layers()[0].describe(), "LayerNorm(8, eps 0.00001)");
        let names: Vec<_> = m.param_infos().iter().map(|t| (t.name.clone(), t.init)).collect();
        assert_eq!(names, [("ln0.weight".to_string(), Init::Ones), ("ln0.bias".to_string(), Init::Zeros)]);
        let e = model_from_spec_str(r#"{"input_shape": [8], "layers": [{"type": "layer_norm", "eps": 0}]}"#, "m.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("field 'eps' must be a positive number"), "{e}");
        // The memory account: x̂ (32 f32) and 4 rows' rstd (f64) per sample.
        let shapes = &m.layer_shapes()[0];
        assert_eq!(m.layers()[0].memory(shapes).unwrap().kept_per_sample, 32 * 4 + 4 * 8);
    }

    /// The benchmark's shape, nanoGPT's CPU recipe at B = 12, T = 64, C = 128: 768 rows
    /// of 128. `cargo test --release --lib ops::layernorm -- --ignored --nocapture`.
    #[test]
    #[ignore = "a timing, not a check: run by hand"]
    fn time_forward_and_backward_at_768_rows_of_128() {
        let dims = [12usize, 64, 128];
        let n = dims.iter().product::<usize>();
        let mut rng = SplitMix64::new(6);
        let (x, dy) = (uniform(&mut rng, n, -2.0, 2.0), uniform(&mut rng, n, -1.0, 1.0));
        let mut m = Sequential::new(&dims[1..], vec![Box::new(LayerNorm::new(128))]).unwrap();
        let store = m.init(0);
        let mut grads = vec![0.0; m.params_len()];
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        // The minimum and the median over the repetitions: the machine may be shared.
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for rep in 0..220 {
            let xt = Tensor::from_vec(x.clone(), dims).unwrap();
            let dt = Tensor::from_vec(dy.clone(), dims).unwrap();
            let t = std::time::Instant::now();
            m.forward(xt, &store.params, &mut [], &ctx).unwrap();
            let t1 = std::time::Instant::now();
            m.backward_input(dt, &store.params, &mut grads, &ctx).unwrap();
            let t2 = std::time::Instant::now();
            if rep >= 20 {
                fwd.push((t1 - t).as_secs_f64() * 1e6);
                bwd.push((t2 - t1).as_secs_f64() * 1e6);
            }
        }
        let both: Vec<f64> = fwd.iter().zip(&bwd).map(|(a, b)| a + b).collect();
        let stats = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            format!("min {:.1} µs, median {:.1} µs", v[0], v[v.len() / 2])
        };
        eprintln!(
            "LayerNorm(128) on (12, 64, 128), {} rayon threads: forward {}; backward {}; both {}",
            rayon::current_num_threads(),
            stats(&fwd),
            stats(&bwd),
            stats(&both)
        );
    }
}
