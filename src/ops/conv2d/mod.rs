//! Conv2d: 2-D cross-correlation over NCHW, weight (O, C, KH, KW) as in PyTorch, with
//! Keras's `valid` and `same` padding (where the window sits is `ops::window`'s, shared
//! with pooling and the GPU).
//!
//! The layer, built on its CPU forward and backward ([`cpu`]: the unfoldings, Winograd,
//! the chunks of samples and the order of every sum); its GPU form is [`gpu`]
//! (kernels/conv2d.cu and cuBLAS).
//!
//! A training step allocates no zeroed memory for a convolution's two big results: the
//! forward writes its output into the values of the last backward's output gradient (the
//! same shape), and the backward writes the input gradient over the input it kept, where
//! nothing else holds it (`backend::cpu::Samples`); the CPU functions write each value of
//! both, and read a sample whole before writing its gradient. The zeroing they replace
//! took 1.6–1.8% of a `resnet8` step (`perf`: `memset` from 4.96–5.18% to 3.40%).
//!
//! Owns also its spec entry (`conv2d`), its spec form and its memory account: what it
//! keeps for backward and the weight-gradient partials of its chunks.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use super::window::{Geometry2d, Padding, Window2d};
use serde_json::{json, Value};

use super::spec::{expect_images, Build, LayerType};
use super::{Ctx, Init, InputGrad, Layer, LayerMemory, LayerShapes, Mode, ParamSpec, Params, ParamsMut, F32};
use crate::backend::cpu::{gemm_packing, Im2colGeom, Samples};
use crate::backend::winograd;
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};
pub use cpu::release_scratch;
use cpu::{rows_tiling, unfold, winograd_geom, Unfold};

/// The CPU backend's geometry of one sample of C channels, from the shared window
/// placement (the backend takes one stride: Conv2d's are equal).
fn cpu_geom(c: usize, g: &Geometry2d) -> Im2colGeom {
    let ((kh, kw), (stride, _)) = (g.window.kernel, g.window.stride);
    Im2colGeom { c, h: g.h, w: g.w, kh, kw, stride, pad_top: g.pad_top, pad_left: g.pad_left, oh: g.oh, ow: g.ow }
}

/// A 2-D convolution layer.
#[derive(Clone, Debug)]
pub struct Conv2d {
    in_channels: usize,
    filters: usize,
    kernel: (usize, usize),
    stride: usize,
    padding: Padding,
    use_bias: bool,
    /// x: (N, C, H, W) of the training forward.
    x: Option<Tensor>,
    /// The weight as Winograd multiplies by ([`cpu::winograd_weights`]), from the training
    /// forward.
    transformed: Option<winograd::Weights>,
    /// The values of the last backward's output gradient, which has the output's shape:
    /// the next forward writes its output there instead of into fresh zeroed memory
    /// (every unfolding writes each output value). Held from the backward to the next
    /// forward, in place of the output that the backward has freed by then, so the peak
    /// (the end of a forward) never holds it.
    spare: Option<Vec<f32>>,
}

impl Conv2d {
    /// `filters` output channels from `in_channels`, kernel KH×KW, stride, padding, bias.
    pub fn new(
        in_channels: usize,
        filters: usize,
        kernel: (usize, usize),
        stride: usize,
        padding: Padding,
        use_bias: bool,
    ) -> Result<Conv2d> {
        if in_channels == 0 || filters == 0 || kernel.0 == 0 || kernel.1 == 0 || stride == 0 {
            return Err(Error::config(
                "Conv2d",
                format!("channels, filters, kernel and stride must be positive (got {in_channels}, {filters}, {kernel:?}, {stride})"),
            ));
        }
        padding.check(kernel).map_err(|e| Error::config("Conv2d", e))?;
        Ok(Conv2d { in_channels, filters, kernel, stride, padding, use_bias, x: None, transformed: None, spare: None })
    }

    /// The sliding window: kernel, stride (the same along H and W), padding.
    pub fn window(&self) -> Window2d {
        Window2d::new(self.kernel, (self.stride, self.stride), self.padding)
    }

    /// The spec entry: Keras's `Conv2D(filters, kernel_size, strides=1, padding="valid",
    /// use_bias=True, activation=None)`, its input channels those of the running shape.
    pub const SPEC: LayerType = LayerType {
        name: "conv2d",
        fields: "`filters`, `kernel_size` (int or [kh, kw]), `strides` (1; int or [s, s]), `padding` (\"valid\", \"same\", or pads: int or [ph, pw]; \"valid\"), `use_bias` (true), `activation` (\"linear\")",
        example: (
            &[2, 7, 6],
            r#"{"type": "conv2d", "filters": 3, "kernel_size": [3, 2], "strides": 2, "padding": "same", "use_bias": false, "activation": "relu"}"#,
        ),
        parse: |f| {
            let filters = f.size("filters", None)?;
            let kernel = f.pair("kernel_size", None)?;
            let (sh, sw) = f.pair("strides", Some((1, 1)))?;
            if sh != sw {
                return Err(format!("field 'strides' [{sh}, {sw}]: only equal strides are supported"));
            }
            let padding = f.padding()?;
            let use_bias = f.boolean("use_bias", true)?;
            let activation = f.activation()?;
            Ok(Build::layers(move |input| {
                let conv = Conv2d::new(expect_images(input)?, filters, kernel, sh, padding, use_bias)
                    .map_err(|e| e.to_string())?;
                Ok(activation.after(Box::new(conv)))
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

    fn geometry(&self, input: &Shape) -> Result<(usize, Im2colGeom)> {
        let (n, c, h, w) = input.nchw("Conv2d")?;
        if c != self.in_channels {
            return Err(Error::shape("Conv2d", format!("expected {} input channels, got {input}", self.in_channels)));
        }
        let (kh, kw) = self.kernel;
        let g = self.window().over(h, w).ok_or_else(|| {
            Error::shape("Conv2d", format!("input {input} is empty or smaller than the {kh}x{kw} kernel"))
        })?;
        Ok((n, cpu_geom(c, &g)))
    }
}

impl Layer for Conv2d {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "conv"
    }

    fn spec(&self) -> Option<Value> {
        let w = self.window();
        Some(json!({
            "type": "conv2d",
            "filters": self.filters,
            "kernel_size": [w.kernel.0, w.kernel.1],
            "strides": [w.stride.0, w.stride.1],
            "padding": w.padding.to_json(),
            "use_bias": self.use_bias,
        }))
    }

    /// Per sample its input (for dweight) and its channels-last output scratch; per chunk
    /// of samples the partial weight gradient (O, C, KH, KW) that the chunks' sum adds in
    /// chunk order (the bias partials are too small to count).
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let (kh, kw) = self.kernel;
        let weights = (self.in_channels as u64 * self.filters as u64).saturating_mul((kh * kw) as u64);
        let (input, output) = (shapes.input.numel() as u64, shapes.output.numel() as u64);
        // The lent buffers (`cpu::Scratch`), the larger of the forward's and the backward's:
        // Rows: a sample channels-last (and in the backward its gradient), a piece's rows
        // and its chunk's outputs ([`rows_tiling`]);
        // Columns: one sample's columns and (backward) their gradient.
        let one: Vec<usize> = std::iter::once(1).chain(shapes.input.dims().iter().copied()).collect();
        let (_, g) = self.geometry(&Shape::new(one)).ok()?;
        let (kkc, p, o) = (g.col_rows() as u64, g.col_cols() as u64, self.filters as u64);
        let wg = winograd_geom(&g, self.filters);
        let how = unfold(&g, self.filters);
        // Winograd: each chunk's partial is its transformed dV (36/9 of the weight), and
        // the transformed weight (V and Vᵀ) is held once from the forward to the backward.
        let (per_chunk, per_layer) = match how {
            Unfold::Winograd => (winograd::dv_floats(&wg) as u64, winograd::weight_floats(&wg) as u64),
            _ => (weights, 0),
        };
        let lent = match how {
            Unfold::Winograd => winograd::scratch_floats(&wg) as u64,
            Unfold::Rows => {
                let t = rows_tiling(&g);
                2 * (self.in_channels * g.h * g.w) as u64 + t.samples as u64 * (t.band as u64 * kkc + p * o)
            }
            Unfold::Columns => 2 * kkc * p,
        };
        // The products' packing, whichever unfolding runs: columns (O × KKC by KKC × P, and
        // the backward's two), rows and Winograd (any number of rows or tiles by KKC or C,
        // to O, and back; `gemm_packing` bounds the count).
        let (kkc, p, o, c, any) = (kkc as usize, p as usize, self.filters, self.in_channels, usize::MAX);
        let products = [
            (o, p, kkc),
            (o, kkc, p),
            (kkc, p, o),
            (any, o, kkc),
            (kkc, o, any),
            (o, kkc, any),
            (any, kkc, o),
            (any, o, c),
            (c, o, any),
            (any, c, o),
        ];
        Some(LayerMemory {
            kept_per_sample: input.saturating_add(output).saturating_mul(F32),
            per_chunk: per_chunk.saturating_mul(F32),
            per_layer: per_layer.saturating_mul(F32),
            lent_per_chunk: lent.saturating_mul(F32),
            gemm: products.into_iter().map(|(m, n, k)| gemm_packing(m, n, k)).max().unwrap_or(0),
        })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (n, g) = self.geometry(input)?;
        Ok(Shape::new([n, self.filters, g.oh, g.ow]))
    }

    fn params(&self) -> Vec<ParamSpec> {
        let (o, c, (kh, kw)) = (self.filters, self.in_channels, self.kernel);
        let mut p = vec![ParamSpec {
            name: "weight".into(),
            shape: Shape::new([o, c, kh, kw]),
            init: Init::GlorotUniform { fan_in: c * kh * kw, fan_out: o * kh * kw },
        }];
        if self.use_bias {
            p.push(ParamSpec { name: "bias".into(), shape: Shape::new([o]), init: Init::Zeros });
        }
        p
    }

    // x: (N, C, H, W) → y: (N, O, OH, OW)
    fn forward(&mut self, x: Tensor, params: Params<'_>, _buffers: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (n, g) = self.geometry(x.shape())?;
        let (o, p) = (self.filters, g.col_cols());
        let transformed = cpu::winograd_weights(params.get(0), &g, o);
        let bias = self.use_bias.then(|| params.get(1));
        let mut y = self.spare.take().filter(|v| v.len() == n * o * p).unwrap_or_else(|| vec![0.0f32; n * o * p]);
        cpu::conv2d_forward(x.host(), params.get(0), transformed.as_ref(), bias, &mut y, &g, o);
        let y = Tensor::from_vec_on(y, [n, o, g.oh, g.ow], x.device())?;
        let train = ctx.mode == Mode::Train;
        self.transformed = transformed.filter(|_| train);
        self.x = train.then_some(x);
        Ok(y)
    }

    // dout: (N, O, OH, OW) → dx: (N, C, H, W)
    // dweight (O, C, KH, KW) += Σ_n dout_n ⋆ x_n;  dbias (O) += Σ_n Σ_p dout_n[o, p]
    fn backward(
        &mut self,
        dout: Tensor,
        params: Params<'_>,
        mut dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let x =
            self.x.take().ok_or_else(|| Error::config("Conv2d backward", "no training forward to differentiate"))?;
        x.same_device("Conv2d backward", &dout)?;
        let (n, g) = self.geometry(x.shape())?;
        let o = self.filters;
        if dout.shape().dims() != [n, o, g.oh, g.ow] {
            return Err(Error::shape(
                "Conv2d backward",
                format!("dout {} for output ({n}, {o}, {}, {})", dout.shape(), g.oh, g.ow),
            ));
        }
        let transformed = self.transformed.take().or_else(|| cpu::winograd_weights(params.get(0), &g, o));
        let need_dx = input_grad == InputGrad::Needed;
        let (per_in, x_shape, device) = (g.c * g.h * g.w, x.shape().clone(), x.device());
        // dx over x's own values where nothing else holds them (no new memory, none to
        // zero); else into fresh memory, x shared.
        let (mut dx, shared) = match if need_dx { x.into_unshared_vec() } else { Err(x) } {
            Ok(values) => (values, None),
            Err(x) => (vec![0.0f32; if need_dx { n * per_in } else { 0 }], Some(x)),
        };
        let xs = match &shared {
            None => Samples::Overwritten(&mut dx),
            Some(x) => Samples::Apart { x: x.host(), dx: need_dx.then_some(&mut dx[..]) },
        };
        let (dweight, dbias) = match self.use_bias {
            true => {
                let (dw, db) = dparams.pair(0, 1);
                (dw, Some(db))
            }
            false => (dparams.get(0), None),
        };
        cpu::conv2d_backward(xs, dout.host(), params.get(0), transformed.as_ref(), dweight, dbias, &g, o);
        self.spare = dout.into_unshared_vec().ok();
        need_dx.then(|| Tensor::from_vec_on(dx, x_shape, device)).transpose()
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Conv2d { x: None, transformed: None, spare: None, ..self.clone() })
    }

    fn describe(&self) -> String {
        format!(
            "Conv2d({}, {}x{}, stride {}, {}{})",
            self.filters,
            self.kernel.0,
            self.kernel.1,
            self.stride,
            self.padding.describe(),
            if self.use_bias { "" } else { ", no bias" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::batch_chunks;

    #[test]
    fn a_forward_into_the_last_backwards_gradient_is_a_fresh_layers() {
        // The output gradient of a backward is kept as the next forward's output. Given one
        // of NaNs, a second forward must still equal a fresh layer's bit for bit, through
        // each unfolding: every output value is written, none read.
        use crate::tensor::Device;
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let cases = [(1, 4, 3, 1, Unfold::Columns), (8, 8, 3, 2, Unfold::Rows), (8, 8, 3, 1, Unfold::Winograd)];
        for (c, o, k, stride, how) in cases {
            let mut r = crate::rng::SplitMix64::new(3);
            let mut rand = |len: usize| (0..len).map(|_| r.next_f32() - 0.5).collect::<Vec<f32>>();
            let (n, h) = (3, 9);
            let conv = Conv2d::new(c, o, (k, k), stride, Padding::Same, true).unwrap();
            assert_eq!(unfold(&conv.geometry(&Shape::new([n, c, h, h])).unwrap().1, o), how);
            let sizes: Vec<usize> = conv.params().iter().map(|p| p.shape.numel()).collect();
            let ranges = vec![0..sizes[0], sizes[0]..sizes[0] + sizes[1]];
            let w = rand(sizes.iter().sum());
            let (x1, x2) = (rand(n * c * h * h), rand(n * c * h * h));
            let input = |x: &[f32]| Tensor::from_vec(x.to_vec(), [n, c, h, h]).unwrap();
            let forward = |layer: &mut Conv2d, x: &[f32]| {
                let no_buffers = ParamsMut::new(&mut [], &[]);
                layer.forward(input(x), Params::new(&w, &ranges), no_buffers, &ctx).unwrap()
            };
            let mut used = conv.clone();
            let y1 = forward(&mut used, &x1);
            let nans = Tensor::from_vec(vec![f32::NAN; y1.numel()], y1.shape().clone()).unwrap();
            let mut grads = vec![0.0; w.len()];
            let dparams = ParamsMut::new(&mut grads, &ranges);
            used.backward(nans, Params::new(&w, &ranges), dparams, InputGrad::Needed, &ctx).unwrap();
            assert_eq!(used.spare.as_ref().map(Vec::len), Some(y1.numel()), "C {c} stride {stride}: kept");
            let again = forward(&mut used, &x2).into_vec();
            let fresh = forward(&mut conv.clone(), &x2).into_vec();
            assert!(used.spare.is_none(), "C {c} stride {stride}: the kept gradient became the output");
            assert!(again.iter().zip(&fresh).all(|(a, b)| a.to_bits() == b.to_bits()), "C {c} stride {stride}");
        }
    }

    #[test]
    fn the_input_gradient_over_the_input_is_the_one_apart() {
        // A backward writes dx over the input it kept when nothing else holds the input,
        // else into memory of its own: the same bits, and a shared input left untouched.
        // 20 samples make two chunks of samples; rows at C = 24 and 28×28 run in bands.
        use crate::tensor::Device;
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let cases =
            [(1, 4, 3, 1, 9, Unfold::Columns), (24, 8, 3, 2, 28, Unfold::Rows), (8, 8, 3, 1, 9, Unfold::Winograd)];
        for (c, o, k, stride, h, how) in cases {
            let mut r = crate::rng::SplitMix64::new(5);
            let mut rand = |len: usize| (0..len).map(|_| r.next_f32() - 0.5).collect::<Vec<f32>>();
            let n = 20;
            let conv = Conv2d::new(c, o, (k, k), stride, Padding::Same, false).unwrap();
            let (_, g) = conv.geometry(&Shape::new([n, c, h, h])).unwrap();
            assert_eq!(unfold(&g, o), how);
            assert!(batch_chunks(n).len() > 1);
            assert!(how != Unfold::Rows || rows_tiling(&g).band < g.col_cols(), "{how:?}: in bands");
            let w = rand(o * c * k * k);
            let ranges = vec![0..w.len(); 1];
            let (x, dout) = (rand(n * c * h * h), rand(n * o * g.oh * g.ow));
            let run = |share: bool| {
                let mut layer = conv.clone();
                let x = Tensor::from_vec(x.clone(), [n, c, h, h]).unwrap();
                let held = share.then(|| x.clone());
                layer.forward(x, Params::new(&w, &ranges), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
                let d = Tensor::from_vec(dout.clone(), [n, o, g.oh, g.ow]).unwrap();
                let mut dw = vec![0.0; w.len()];
                let grads = ParamsMut::new(&mut dw, &ranges);
                let dx = layer.backward(d, Params::new(&w, &ranges), grads, InputGrad::Needed, &ctx).unwrap();
                (dx.unwrap().into_vec(), dw, held.map(Tensor::into_vec))
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            let ((dx_over, dw_over, _), (dx_apart, dw_apart, held)) = (run(false), run(true));
            assert_eq!(bits(&dx_over), bits(&dx_apart), "{how:?}: dx");
            assert_eq!(bits(&dw_over), bits(&dw_apart), "{how:?}: dweight");
            assert_eq!(held.as_deref(), Some(&x[..]), "{how:?}: the shared input was written");
        }
    }
}
