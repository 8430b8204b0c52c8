//! RMSNorm over the last dimension, PyTorch's `nn.RMSNorm(C, eps)` (Llama's RMSNorm) and
//! Keras's `RMSNormalization(axis=-1, epsilon=1e-6)`: the layer, built on its CPU forward
//! and backward ([`cpu`], which states the order of every sum), its spec entry
//! (`rms_normalization`), its spec form and what it keeps for backward. Its GPU form is
//! [`gpu`] (kernels/rmsnorm.cu).
//!
//! The input is (N, ..., C), in a decoder (N, T, C): every run of C values along the last
//! dimension is a ROW, divided by its root mean square (no mean is subtracted) and scaled
//! by `weight` (C); there is no bias:
//!   y = x·rstd·w,   rstd = 1/√(mean(x²) + eps).
//! Rows are independent; only the weight's gradient is summed over rows. The weight is
//! named `weight`, as PyTorch's `state_dict` names it (Keras calls it `scale`), so that a
//! model's weights load into the PyTorch module strictly.

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

/// Keras's default epsilon (`RMSNormalization(epsilon=1e-6)`; Llama's 1e-5 or 1e-6).
pub const DEFAULT_EPSILON: f64 = 1e-6;

/// Root-mean-square normalisation over the last dimension, with a learned scale.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    /// C: the width of the last dimension.
    width: usize,
    eps: f32,
    /// x̂: (N, ..., C) as f32 and rstd: (rows) as f64, from the training forward; the
    /// vectors keep their capacity from step to step.
    xhat: Vec<f32>,
    rstd: Vec<f64>,
    /// Each chunk of rows' column sums Σ dy·x̂ (C each), reused by each backward.
    partials: Vec<f64>,
    cached: Option<Shape>,
}

impl RmsNorm {
    /// RMSNorm over a last dimension of `width`, eps 1e-6 (Keras's default).
    pub fn new(width: usize) -> RmsNorm {
        RmsNorm {
            width,
            eps: DEFAULT_EPSILON as f32,
            xhat: Vec::new(),
            rstd: Vec::new(),
            partials: Vec::new(),
            cached: None,
        }
    }

    /// Sets eps (added to the mean square).
    pub fn eps(mut self, eps: f32) -> Self {
        self.eps = eps;
        self
    }

    /// The width C of the last dimension it normalises.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The spec entry: Keras's `RMSNormalization(axis=-1, epsilon=1e-6)`, C that of the
    /// running shape.
    pub const SPEC: LayerType = LayerType {
        name: "rms_normalization",
        fields: "`epsilon` (1e-6), `axis` (-1, the last: the only one)",
        example: (&[2, 3, 6], r#"{"type": "rms_normalization", "epsilon": 0.001}"#),
        parse: |f| {
            let eps = f.number("epsilon", Some(DEFAULT_EPSILON), (|x| x > 0.0, "a positive number"))?;
            f.last_axis()?;
            Ok(Build::layer(move |input| Ok(RmsNorm::new(expect_last_dim(input)?).eps(eps))))
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

impl Layer for RmsNorm {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "rms"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "rms_normalization", "epsilon": self.eps, "axis": -1}))
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
        self.rows(input, "RMSNorm")?;
        Ok(input.clone())
    }

    fn params(&self) -> Vec<ParamSpec> {
        vec![ParamSpec { name: "weight".into(), shape: Shape::new([self.width]), init: Init::Ones }]
    }

    // x: (N, ..., C) → y: (N, ..., C); training keeps x̂ (N, ..., C) and rstd (rows)
    fn forward(&mut self, mut x: Tensor, params: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let rows = self.rows(x.shape(), "RMSNorm")?;
        let (c, eps, weight) = (self.width, self.eps, params.get(0));
        if ctx.mode == Mode::Train {
            self.xhat.resize(rows * c, 0.0);
            self.rstd.resize(rows, 0.0);
            cpu::rmsnorm_forward(x.host_mut(), Some((&mut self.xhat, &mut self.rstd)), weight, eps);
            self.cached = Some(x.shape().clone());
        } else {
            cpu::rmsnorm_forward(x.host_mut(), None, weight, eps);
        }
        Ok(x)
    }

    // dout: (N, ..., C) → dx = rstd·(g − x̂·mean(g·x̂)), g = dout·w, per row;
    // dweight += Σ_rows dout·x̂ (C)
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
            .ok_or_else(|| Error::config("RMSNorm backward", "no training forward to differentiate"))?;
        if dout.shape() != &shape {
            return Err(Error::shape("RMSNorm backward", format!("dout {} for input {shape}", dout.shape())));
        }
        let (xhat, rstd) = (&self.xhat, &self.rstd);
        let dweight = dparams.get(0);
        cpu::rmsnorm_backward(dout.host_mut(), xhat, rstd, params.get(0), dweight, &mut self.partials, input_grad);
        Ok((input_grad == InputGrad::Needed).then_some(dout))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(RmsNorm::new(self.width).eps(self.eps))
    }

    fn describe(&self) -> String {
        format!("RMSNorm({}, eps {})", self.width, self.eps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::nn::Sequential;
    use crate::tensor::Device;

    /// scripts/torch_rmsnorm.py's case, x: (2, 2, 5), weight: (5), dy: (2, 2, 5), eps 1e-5,
    /// by the script's formulas (every value exact in f32).
    fn case() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let x = (0..20).map(|i| ((i * 37 % 23) as f32 - 11.0) / 8.0).collect();
        let w = (0..5).map(|j| 0.5 + j as f32 / 4.0).collect();
        let dy = (0..20).map(|i| ((i * 13 % 17) as f32 - 8.0) / 16.0).collect();
        (x, w, dy)
    }

    /// The output of scripts/torch_rmsnorm.py: per element (y, torch_y, dx, torch_dx), the
    /// first of each pair float64 evaluation rounded once to f32, the second PyTorch's own
    /// float32; then per weight (dweight, torch_dweight).
    /// // torch 2.15.0+cu132
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)] // the values as the script prints them, f32's in f64 digits
    const TORCH: &[(f32, f32, f32, f32)] = &[
        (-0.8091679811477661, -0.8091679215431213, -0.19003331661224365, -0.19003331661224365),
        (0.33102327585220337, 0.33102327585220337, 0.2474319338798523, 0.2474319189786911),
        (-0.8827286958694458, -0.8827286958694458, 0.1304023116827011, 0.1304023116827011),
        (1.4712145328521729, 1.4712144136428833, -0.3516415059566498, -0.3516414761543274),
        (-0.22068217396736145, -0.22068217396736145, -0.7629140019416809, -0.7629139423370361),
        (-0.7503698468208313, -0.7503699064254761, -0.050358690321445465, -0.05035869777202606),
        (0.4502219259738922, 0.4502219259738922, 0.22274334728717804, 0.22274334728717804),
        (-0.7503698468208313, -0.7503699064254761, -0.2878088057041168, -0.2878088057041168),
        (1.688332200050354, 1.6883323192596436, -0.3148547112941742, -0.3148546814918518),
        (0.0, 0.0, 0.7878883481025696, 0.7878883481025696),
        (-0.673816978931427, -0.6738170385360718, 0.44089722633361816, 0.44089728593826294),
        (0.5615141987800598, 0.5615141987800598, -0.23870384693145752, -0.2387038916349411),
        (-0.5989484786987305, -0.5989484786987305, -0.22830083966255188, -0.22830082476139069),
        (1.8717138767242432, 1.8717139959335327, 0.38358068466186523, 0.38358065485954285),
        (0.22460566461086273, 0.22460567951202393, 0.4127008616924286, 0.4127008616924286),
        (-0.5847013592720032, -0.5847013592720032, 0.19427311420440674, 0.19427312910556793),
        (0.6577889919281006, 0.6577890515327454, -0.36496785283088684, -0.36496788263320923),
        (-0.4385260045528412, -0.4385260343551636, -0.5118489265441895, -0.5118489265441895),
        (2.009910821914673, 2.009911060333252, 0.18967239558696747, 0.18967238068580627),
        (0.4385260045528412, 0.4385260343551636, 0.06106322631239891, 0.06106322631239891),
    ];
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)]
    const TORCH_DWEIGHT: &[(f32, f32)] = &[
        (-0.006290793884545565, -0.006290853023529053),
        (-0.053092505782842636, -0.05309252440929413),
        (0.4450600743293762, 0.4450601041316986),
        (0.5239814519882202, 0.5239815711975098),
        (0.12007182836532593, 0.12007182836532593),
    ];

    /// The layer alone in a model of (2, 5)-shaped samples, weight `w`: (y, dx, dweight) of
    /// a training pass with upstream gradient `dy`, dweight accumulated onto `g0`.
    fn run(eps: f32, x: &[f32], w: &[f32], dy: &[f32], g0: f32) -> [Vec<f32>; 3] {
        let c = w.len();
        let dims = [x.len() / (2 * c), 2, c];
        let mut m = Sequential::new(&dims[1..], vec![Box::new(RmsNorm::new(c).eps(eps))]).unwrap();
        let range = m.param_infos()[0].range.clone();
        let mut params = vec![0.0; m.params_len()];
        params[range.clone()].copy_from_slice(w);
        let mut grads = vec![g0; m.params_len()];
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let y = m.forward(Tensor::from_vec(x.to_vec(), dims).unwrap(), &params, &mut [], &ctx).unwrap();
        let dx = m.backward_input(Tensor::from_vec(dy.to_vec(), dims).unwrap(), &params, &mut grads, &ctx).unwrap();
        [y.into_vec(), dx.into_vec(), grads[range].to_vec()]
    }

    /// Against the float64 values: within 2·10⁻⁷ relative plus 10⁻⁷ (the layer computes in
    /// f64 and rounds each result once: half an ulp, 6·10⁻⁸ relative; the absolute term
    /// covers results near 0 whose f64 sums cancelled). Against PyTorch's own float32, which
    /// rounds every step: within 10⁻⁶ relative plus 2·10⁻⁷ (its dweight[0] sums four terms
    /// of up to 0.3 to 0.0063 and is 6·10⁻⁸ off the float64 value).
    #[test]
    fn rmsnorm_matches_pytorch() {
        let (x, w, dy) = case();
        let [y, dx, dw] = run(1e-5, &x, &w, &dy, 0.0);
        let near = |what: &str, i: usize, got: f32, want: f32, (rel, abs): (f32, f32)| {
            let bound = rel * want.abs() + abs;
            assert!((got - want).abs() <= bound, "{what}[{i}]: {got}, want {want} (bound {bound:e})");
        };
        let (exact, torch) = ((2e-7, 1e-7), (1e-6, 2e-7));
        for (i, &(ey, ty, edx, tdx)) in TORCH.iter().enumerate() {
            near("y", i, y[i], ey, exact);
            near("dx", i, dx[i], edx, exact);
            near("y vs torch", i, y[i], ty, torch);
            near("dx vs torch", i, dx[i], tdx, torch);
        }
        for (i, &(edw, tdw)) in TORCH_DWEIGHT.iter().enumerate() {
            near("dweight", i, dw[i], edw, exact);
            near("dweight vs torch", i, dw[i], tdw, torch);
        }
        // The gradient contract: dweight accumulates onto what the buffer held.
        let [_, _, dw_onto] = run(1e-5, &x, &w, &dy, 0.25);
        for (i, (&a, &b)) in dw_onto.iter().zip(&dw).enumerate() {
            assert_eq!(a, 0.25 + b, "dweight[{i}] accumulated");
        }
    }

    #[test]
    fn results_are_bitwise_independent_of_the_thread_count_and_of_the_mode() {
        // 150 rows of 40: three chunks of rows (64, 64, 22) and a lane tail of 8.
        let (c, rows) = (40, 150);
        let x: Vec<f32> = crate::testing::uniform(1, rows * c).iter().map(|v| 3.0 * v).collect();
        let dy = crate::testing::uniform(2, rows * c);
        let w: Vec<f32> = crate::testing::uniform(3, c).iter().map(|v| 1.0 + 0.5 * v).collect();
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| run(1e-6, &x, &w, &dy, 0.0))
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let one = on(1);
        for threads in [2, 3] {
            let many = on(threads);
            for k in 0..3 {
                assert_eq!(bits(&one[k]), bits(&many[k]), "output {k} on {threads} threads");
            }
        }
        // Evaluation computes the training output.
        let mut y = x.clone();
        cpu::rmsnorm_forward(&mut y, None, &w, 1e-6);
        assert_eq!(bits(&y), bits(&one[0]));
    }

    #[test]
    fn the_spec_entry_reads_keras_fields_and_infers_the_width() {
        use crate::spec::model_from_spec_str;
        let m = model_from_spec_str(r#"{"input_shape": [4, 8], "layers": [{"type": "rms_normalization"}]}"#, "m.json")
            .unwrap();
        assert_eq!(m.layer_names(), ["rms0"]);
        assert_eq!(m.layers()[0].describe(), "RMSNorm(8, eps 0.000001)");
        let names: Vec<_> = m.param_infos().iter().map(|t| (t.name.clone(), t.init)).collect();
        assert_eq!(names, [("rms0.weight".to_string(), Init::Ones)]);
        // The memory account: x̂ (32 f32) and 4 rows' rstd (f64) per sample.
        assert_eq!(m.layers()[0].memory(&m.layer_shapes()[0]).unwrap().kept_per_sample, 32 * 4 + 4 * 8);
        for (fields, want) in [
            (r#""epsilon": 0"#, "field 'epsilon' must be a positive number"),
            (r#""axis": 1"#, "field 'axis' must be -1, the last axis"),
            (r#""eps": 0.1"#, "unknown field 'eps'"),
        ] {
            let spec = format!(r#"{{"input_shape": [8], "layers": [{{"type": "rms_normalization", {fields}}}]}}"#);
            let e = model_from_spec_str(&spec, "m.json").unwrap_err().to_string();
            assert!(e.contains(want), "{fields}: {e}");
        }
        let e = RmsNorm::new(8).output_shape(&Shape::new([2, 3, 7])).unwrap_err().to_string();
        assert!(e.contains("RMSNorm") && e.contains("last dimension of 8") && e.contains("(2, 3, 7)"), "{e}");
    }

    #[test]
    fn a_row_of_zeros_stays_zero_and_backward_needs_a_training_forward() {
        // mean(x²) = 0: rstd = 1/√eps, x̂ = 0, y = 0; dx = rstd·g, dweight += 0.
        let [y, dx, dw] = run(1e-6, &[0.0; 4], &[2.0, 2.0], &[1.0, -1.0, 0.5, 0.0], 0.0);
        assert_eq!(y, [0.0; 4]);
        assert_eq!(dw, [0.0; 2]);
        let rstd = (1.0 / (1e-6f32 as f64).sqrt()) as f32;
        assert_eq!(dx, [2.0 * rstd, -2.0 * rstd, rstd, 0.0]);
        let mut norm = RmsNorm::new(2);
        let (w, mut g) = ([1.0f32, 1.0], [0.0f32; 2]);
        #[allow(clippy::single_range_in_vec_init)] // the one tensor's place, not a range of values
        let ranges = [0..2];
        let d = Tensor::from_vec(vec![1.0; 4], [2, 2]).unwrap();
        let ctx = Ctx::eval(Device::Cpu(0));
        let e = norm.backward(d, Params::new(&w, &ranges), ParamsMut::new(&mut g, &ranges), InputGrad::Needed, &ctx);
        assert!(e.unwrap_err().to_string().contains("no training forward"));
    }
}
