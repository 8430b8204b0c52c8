//! Conv2d: 2-D cross-correlation over NCHW, weight (O, C/G, KH, KW) as in PyTorch, with
//! Keras's `valid` and `same` padding (where the window sits is `ops::window`'s, shared
//! with pooling and the GPU), and PyTorch's and Keras's `groups` G: group k maps input
//! channels k·C/G.. to filters k·O/G.. (G = C: a depthwise convolution, MobileNet's and
//! ConvNeXt's). One group keeps the ungrouped arithmetic and layout exactly; several run
//! by [`cpu::grouped_forward`] and [`cpu::grouped_backward`].
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
use cpu::{rows_tiling, unfold, winograd_geom, Direct, Grouped, Grouping, Taps, Unfold};

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
    /// G: C/G input channels to O/G filters a group.
    groups: usize,
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
        let (x, transformed, spare) = (None, None, None);
        Ok(Conv2d { in_channels, filters, kernel, stride, padding, use_bias, groups: 1, x, transformed, spare })
    }

    /// The same layer in `groups` groups (PyTorch's and Keras's `groups`): the input
    /// channels and the filters must both be multiples of it.
    pub fn with_groups(self, groups: usize) -> Result<Conv2d> {
        let (c, o) = (self.in_channels, self.filters);
        if groups == 0 || c % groups != 0 || o % groups != 0 {
            return Err(Error::config(
                "Conv2d",
                format!(
                    "{c} input channels and {o} filters must both be divisible by groups {groups} (each group maps C/G channels to O/G filters)"
                ),
            ));
        }
        Ok(Conv2d { groups, ..self })
    }

    /// G, the groups its channels and filters are cut into.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// The sliding window: kernel, stride (the same along H and W), padding.
    pub fn window(&self) -> Window2d {
        Window2d::new(self.kernel, (self.stride, self.stride), self.padding)
    }

    /// The spec entry: Keras's `Conv2D(filters, kernel_size, strides=1, padding="valid",
    /// use_bias=True, activation=None)`, its input channels those of the running shape.
    pub const SPEC: LayerType = LayerType {
        name: "conv2d",
        fields: "`filters`, `kernel_size` (int or [kh, kw]), `strides` (1; int or [s, s]), `padding` (\"valid\", \"same\", or pads: int or [ph, pw]; \"valid\"), `use_bias` (true), `activation` (\"linear\"), `groups` (1; divides the input channels and `filters`: the input channels for depthwise)",
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
            let groups = f.size("groups", Some(1))?;
            Ok(Build::layers(move |input| {
                let conv = Conv2d::new(expect_images(input)?, filters, kernel, sh, padding, use_bias)
                    .and_then(|conv| conv.with_groups(groups))
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

    /// The grouping of one sample's geometry `g`.
    fn grouping(&self, g: &Im2colGeom) -> Grouping {
        Grouping { g: *g, o: self.filters, groups: self.groups }
    }
}

/// The workspace of an ungrouped convolution of one sample's geometry `g` (its C the
/// channels) to `o` filters, in f32 values: (per chunk, per layer, lent per chunk), and
/// the GEMM's packing in bytes.
fn unfold_memory(g: &Im2colGeom, o: usize) -> (u64, u64, u64, u64) {
    let weights = (g.c as u64 * o as u64).saturating_mul((g.kh * g.kw) as u64);
    // The lent buffers (`cpu::Scratch`), the larger of the forward's and the backward's:
    // Rows: a sample channels-last (and in the backward its gradient), a piece's rows
    // and its chunk's outputs ([`rows_tiling`]);
    // Columns: one sample's columns and (backward) their gradient;
    // Pointwise: none (its GEMMs read and write the samples' own values);
    // Taps: a sample's padded planes (or pixels), in the backward its output gradient's
    // too, one sample's output (or input gradient) over the padded width, and the
    // product's weights and rows' offsets (`cpu::TapProduct`, an offset two floats).
    let (kkc, p, o64) = (g.col_rows() as u64, g.col_cols() as u64, o as u64);
    let wg = winograd_geom(g, o);
    let how = unfold(g, o);
    // Winograd: each chunk's partial is its transformed dV (36/9 of the weight), and
    // the transformed weight (V and Vᵀ) is held once from the forward to the backward.
    let (per_chunk, per_layer) = match how {
        Unfold::Winograd => (winograd::dv_floats(&wg) as u64, winograd::weight_floats(&wg) as u64),
        _ => (weights, 0),
    };
    let lent = match how {
        Unfold::Winograd => winograd::scratch_floats(&wg) as u64,
        Unfold::Rows => {
            let t = rows_tiling(g);
            2 * (g.c * g.h * g.w) as u64 + t.samples as u64 * (t.band as u64 * kkc + p * o64)
        }
        Unfold::Columns => 2 * kkc * p,
        Unfold::Pointwise => 0,
        Unfold::Taps => {
            let (t, kk) = (Taps::of(g), g.kh * g.kw);
            (g.c + o) as u64 * t.plane as u64 + g.c.max(o) as u64 * (t.m + 2 * kk) as u64 + (g.c * o * kk) as u64
        }
    };
    // The products' packing, whichever unfolding runs: columns and pointwise (O × KKC by
    // KKC × P, and the backward's two), rows and Winograd (any number of rows or tiles by KKC or C,
    // to O, and back; `gemm_packing` bounds the count), the taps' weight gradient (O × C a
    // tap, over any number of pixels; their forward and input gradient pack nothing).
    let (kkc, p, c, any) = (kkc as usize, p as usize, g.c, usize::MAX);
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
        (o, c, any),
    ];
    let gemm = products.into_iter().map(|(m, n, k)| gemm_packing(m, n, k)).max().unwrap_or(0);
    (per_chunk, per_layer, lent, gemm)
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
        let mut spec = json!({
            "type": "conv2d",
            "filters": self.filters,
            "kernel_size": [w.kernel.0, w.kernel.1],
            "strides": [w.stride.0, w.stride.1],
            "padding": w.padding.to_json(),
            "use_bias": self.use_bias,
        });
        // One group, the default, is left out: an ungrouped layer's spec reads as it did.
        if self.groups > 1 {
            spec["groups"] = json!(self.groups);
        }
        Some(spec)
    }

    /// Per sample the larger of its input and its output: the input is held from the
    /// training forward to the backward (for dweight), the `spare` output gradient from
    /// the backward to the next forward, and never both (the forward takes the spare for
    /// its output, the backward frees the input); counting both made a DenseNet's
    /// estimate 1.75× its peak, its 1×1 and 3×3 convolutions' outputs counted a second
    /// time as the next layer's input. Per chunk of samples the partial weight gradient (O, C/G, KH, KW) that the chunks' sum adds
    /// in chunk order (the bias partials are too small to count). Several groups: the
    /// direct path's padded planes per chunk, or each group's unfolding's workspace, the
    /// partials of every group per chunk and each group's weight in its layout.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let (input, output) = (shapes.input.numel() as u64, shapes.output.numel() as u64);
        let one: Vec<usize> = std::iter::once(1).chain(shapes.input.dims().iter().copied()).collect();
        let (_, g) = self.geometry(&Shape::new(one)).ok()?;
        let (per_chunk, per_layer, lent, gemm) = match (self.groups, self.grouping(&g).path()) {
            (1, _) => unfold_memory(&g, self.filters),
            (_, Grouped::Direct) => {
                let (gr, (kh, kw)) = (self.grouping(&g), self.kernel);
                let d = Direct::new(&gr);
                let weights = (gr.o * gr.cpg() * kh * kw) as u64;
                (weights + (d.x_len() + d.dout_len()) as u64, 0, 0, 0)
            }
            (groups, Grouped::PerGroup) => {
                let gr = self.grouping(&g);
                let (sub, og) = (gr.sub(), gr.opg());
                let (per_chunk, per_layer, lent, gemm) = unfold_memory(&sub, og);
                let in_layout = if unfold(&sub, og) == Unfold::Rows { (og * sub.col_rows()) as u64 } else { 0 };
                let g64 = groups as u64;
                ((g64 + 1) * per_chunk, g64 * (per_layer + in_layout), lent, gemm)
            }
        };
        Some(LayerMemory {
            kept_per_sample: input.max(output).saturating_mul(F32),
            per_chunk: per_chunk.saturating_mul(F32),
            per_layer: per_layer.saturating_mul(F32),
            lent_per_chunk: lent.saturating_mul(F32),
            gemm,
        })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (n, g) = self.geometry(input)?;
        Ok(Shape::new([n, self.filters, g.oh, g.ow]))
    }

    fn params(&self) -> Vec<ParamSpec> {
        // Each filter sees C/G channels: (O, C/G, KH, KW), fans as PyTorch and Keras count
        // them (fan-in C/G·KH·KW, fan-out O·KH·KW).
        let (o, c, (kh, kw)) = (self.filters, self.in_channels / self.groups, self.kernel);
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
        let grouped = self.groups > 1;
        let transformed = if grouped { None } else { cpu::winograd_weights(params.get(0), &g, o) };
        let bias = self.use_bias.then(|| params.get(1));
        let mut y = self.spare.take().filter(|v| v.len() == n * o * p).unwrap_or_else(|| vec![0.0f32; n * o * p]);
        if grouped {
            cpu::grouped_forward(x.host(), params.get(0), bias, &mut y, &self.grouping(&g));
        } else {
            cpu::conv2d_forward(x.host(), params.get(0), transformed.as_ref(), bias, &mut y, &g, o);
        }
        let y = Tensor::from_vec_on(y, [n, o, g.oh, g.ow], x.device())?;
        let train = ctx.mode == Mode::Train;
        self.transformed = transformed.filter(|_| train);
        self.x = train.then_some(x);
        Ok(y)
    }

    // dout: (N, O, OH, OW) → dx: (N, C, H, W)
    // dweight (O, C/G, KH, KW) += Σ_n dout_n ⋆ x_n;  dbias (O) += Σ_n Σ_p dout_n[o, p]
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
        let grouped = self.groups > 1;
        let transformed = match grouped {
            true => None,
            false => self.transformed.take().or_else(|| cpu::winograd_weights(params.get(0), &g, o)),
        };
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
        if grouped {
            cpu::grouped_backward(xs, dout.host(), params.get(0), dweight, dbias, &self.grouping(&g));
        } else {
            cpu::conv2d_backward(xs, dout.host(), params.get(0), transformed.as_ref(), dweight, dbias, &g, o);
        }
        self.spare = dout.into_unshared_vec().ok();
        need_dx.then(|| Tensor::from_vec_on(dx, x_shape, device)).transpose()
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Conv2d { x: None, transformed: None, spare: None, ..self.clone() })
    }

    fn describe(&self) -> String {
        format!(
            "Conv2d({}, {}x{}, stride {}, {}{}{})",
            self.filters,
            self.kernel.0,
            self.kernel.1,
            self.stride,
            self.padding.describe(),
            if self.groups > 1 { format!(", groups {}", self.groups) } else { String::new() },
            if self.use_bias { "" } else { ", no bias" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::batch_chunks;
    use crate::tensor::Device;

    /// The output of scripts/torch_conv2d_groups.py: per case y, dx, dweight and dbias of
    /// torch.nn.functional.conv2d with `groups` (every value exact in f32, float64 and
    /// PyTorch's float32 equal to the bit, as the script checks).
    /// // torch 2.15.0+cu132
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision, clippy::approx_constant)]
    mod torch {
        // G2: y (2, 4, 2, 2)
        pub const G2_Y: &[f32] = &[
            -0.34375, 0.8515625, -0.546875, 0.1953125, -0.09375, 0.0703125, -0.796875, -1.5390625,
            0.2421875, 0.9609375, -0.0546875, 0.6640625, 1.359375, 0.59375, 0.109375, -0.203125,
            0.84375, -0.2265625, 0.1875, -1.7890625, 0.078125, 0.015625, -1.53125, 0.4453125,
            -0.1484375, -0.109375, 0.9140625, -0.1796875, -0.046875, 1.0, 0.515625, 0.8828125,
        ];
        pub const G2_DX: &[f32] = &[
            0.05078125, 0.06640625, -0.19921875, 0.12109375, -0.078125, -0.1953125, 0.25, 0.0703125,
            0.171875, -0.125, -0.125, -0.0625, 0.046875, 0.046875, 0.0859375, 0.0546875,
            -0.296875, 0.0390625, -0.17578125, 0.1171875, 0.109375, 0.28125, -0.125, -0.1015625,
            -0.0859375, 0.0, 0.015625, -0.0703125, 0.16796875, 0.015625, -0.04296875, 0.0703125,
            -0.00390625, -0.25390625, 0.23046875, -0.0234375, -0.1171875, -0.0078125, 0.0078125, -0.046875,
            0.1484375, 0.0703125, 0.01171875, 0.09375, 0.0078125, -0.0390625, -0.265625, 0.12890625,
            -0.0390625, -0.00390625, 0.19140625, -0.23828125, 0.0234375, -0.0390625, -0.04296875, 0.1875,
            -0.1015625, 0.1015625, 0.0546875, 0.015625, -0.03125, 0.0, -0.0078125, 0.0625,
            0.1171875, -0.265625, -0.06640625, -0.18359375, 0.13671875, 0.0234375, 0.078125, 0.0546875,
            0.00390625, -0.04296875, 0.05859375, 0.0390625, 0.14453125, -0.1015625, 0.03125, -0.16015625,
            -0.1171875, 0.13671875, -0.13671875, 0.1015625, -0.015625, -0.09375, 0.0078125, 0.0078125,
            0.1484375, 0.2890625, -0.0859375, 0.17578125, -0.09375, -0.1328125, 0.1015625, -0.2421875,
        ];
        pub const G2_DW: &[f32] = &[
            -0.078125, 0.421875, 0.46875, 0.109375, -1.203125, 0.8828125, 0.484375, 0.53125,
            0.125, -1.140625, 0.9453125, -1.5, 0.0703125, -0.3046875, -2.265625, -0.0703125,
            -0.8984375, 0.5390625, -0.3515625, -2.3125, 1.84375, -0.9453125, 0.4921875, 1.25,
            0.25, 0.0625, 0.1015625, -2.5390625, 0.21875, 0.03125, 0.0390625, 0.078125,
            1.0234375, 0.1953125, 0.0078125, 0.953125, 0.9140625, -1.3515625, 0.234375, 0.9140625,
            0.234375, 0.234375, -1.3515625, 0.234375, 0.234375, 0.234375, 0.234375, 0.234375,
        ];
        pub const G2_DB: &[f32] = &[
            0.5, -0.375, -0.1875, 0.0,
        ];
        // SAME2: y (1, 3, 3, 3)
        pub const SAME2_Y: &[f32] = &[
            0.171875, -1.28125, -0.046875, -0.390625, -0.2578125, -0.609375, -1.359375, 0.5,
            0.1015625, 0.3671875, 0.0546875, -0.2734375, 0.3046875, -0.0078125, 0.9375, -0.0234375,
            -0.0234375, 0.5, 0.2109375, 1.375, 0.5546875, -0.734375, 1.109375, -0.7890625,
            1.03125, -0.828125, 0.421875,
        ];
        pub const SAME2_DX: &[f32] = &[
            0.0703125, 0.1171875, -0.15234375, -0.01953125, -0.0703125, -0.15625, -0.09375, -0.046875,
            0.015625, 0.0078125, 0.125, 0.0625, 0.0703125, 0.1328125, 0.02734375, -0.11328125,
            0.08984375, -0.02734375, -0.03125, -0.015625, 0.078125, 0.0390625, -0.078125, -0.0390625,
            -0.0078125, -0.0078125, 0.1484375, 0.078125, -0.25390625, 0.09765625, 0.03125, 0.015625,
            -0.125, -0.0625, -0.015625, -0.0078125, 0.1171875, 0.0703125, -0.0546875, -0.046875,
            0.04296875, 0.03515625, -0.0234375, -0.0703125, -0.1015625, 0.046875, 0.06640625, -0.03515625,
            0.00390625, 0.01171875, -0.07421875, -0.0625, 0.17578125, 0.12890625, 0.02734375, 0.08203125,
            0.13671875, 0.0, -0.02734375, -0.08203125, -0.22265625, -0.14453125, 0.01171875, 0.046875,
            0.0625, 0.0390625, 0.01171875, 0.03515625, 0.04296875, -0.046875, -0.0546875, 0.0703125,
            0.0, -0.0078125, -0.015625, -0.0625, -0.125, 0.015625, -0.0234375, 0.01953125,
            -0.17578125, 0.15625, 0.140625, -0.0390625, 0.00390625, -0.04296875, -0.05859375, 0.0078125,
            -0.0234375, -0.0078125, -0.1171875, 0.09765625, 0.17578125, -0.09765625, -0.10546875, 0.0390625,
            0.01953125, 0.04296875, 0.046875, 0.02734375, 0.08203125, -0.0546875, 0.1875, -0.15625,
            -0.0703125, -0.01953125, -0.15234375, 0.1171875,
        ];
        pub const SAME2_DW: &[f32] = &[
            1.09375, -0.1875, -1.0703125, 0.203125, -0.171875, 0.234375, -0.484375, 0.484375,
            -0.1328125, -0.15625, -1.515625, 0.296875, -0.15625, -0.15625, -0.9765625, -0.5,
            0.71875, 1.109375, -0.234375, 1.046875, 0.34375, 0.203125, -0.78125, -0.7890625,
            1.0859375, -0.1640625, -0.875,
        ];
        pub const SAME2_DB: &[f32] = &[
            -0.375, 0.0, 0.375,
        ];
        // PAD2: y (2, 2, 3, 3)
        pub const PAD2_Y: &[f32] = &[
            -0.484375, 0.546875, 0.265625, 0.7734375, 0.0703125, 0.78125, 0.359375, -0.734375,
            0.53125, -0.1171875, 0.1015625, -0.2421875, -0.0703125, 0.7578125, -0.265625, -0.59375,
            0.5390625, 0.2890625, 0.34375, -0.078125, 0.71875, 1.1015625, -1.140625, 0.703125,
            0.21875, 0.890625, -0.0546875, -0.0234375, 0.4140625, 0.15625, -0.390625, 0.1953125,
            0.2109375, 0.2734375, -0.140625, 0.1015625,
        ];
        pub const PAD2_DX: &[f32] = &[
            -0.046875, 0.015625, 0.0078125, 0.125, 0.0625, 0.1328125, 0.02734375, -0.11328125,
            0.08984375, -0.02734375, -0.015625, 0.078125, 0.0390625, -0.078125, -0.0390625, -0.0078125,
            0.1484375, 0.078125, -0.25390625, 0.09765625, 0.015625, -0.125, -0.0625, -0.015625,
            -0.0078125, -0.0703125, -0.1015625, 0.046875, 0.06640625, -0.03515625, 0.01171875, -0.07421875,
            -0.0625, 0.17578125, 0.12890625, 0.08203125, 0.13671875, 0.0, -0.02734375, -0.08203125,
            -0.14453125, 0.01171875, 0.046875, 0.0625, 0.0390625, 0.03515625, 0.04296875, -0.046875,
            -0.0546875, 0.0703125, 0.0078125, 0.125, 0.0625, -0.03125, -0.015625, -0.11328125,
            0.08984375, -0.02734375, -0.3125, -0.0078125, 0.0390625, -0.078125, -0.0390625, 0.03125,
            0.015625, 0.078125, -0.25390625, 0.09765625, 0.0078125, -0.1484375, -0.0625, -0.015625,
            -0.0078125, 0.09375, 0.046875, 0.046875, 0.06640625, -0.03515625, -0.03125, 0.08203125,
            -0.0625, 0.17578125, 0.12890625, -0.171875, -0.14453125, 0.0, -0.02734375, -0.08203125,
            -0.125, 0.03515625, 0.046875, 0.0625, 0.0390625, -0.01953125, -0.03515625, -0.046875,
            -0.0546875, 0.0703125, 0.11328125, -0.01171875,
        ];
        pub const PAD2_DW: &[f32] = &[
            0.8984375, -1.5390625, 1.2734375, -2.1953125, 0.3203125, 1.5, 0.828125, 0.46875,
            -2.25, -1.15625, 1.7578125, 0.4140625, 0.9609375, -2.4375, 0.6484375, -1.09375,
            0.6875, 1.40625,
        ];
        // MULT: y (1, 4, 4, 5)
        pub const MULT_Y: &[f32] = &[
            -0.796875, -0.28125, 0.25, 0.328125, 0.015625, 0.1640625, 0.71875, 0.21875,
            -2.546875, -0.8828125, 0.46875, -1.328125, -0.2421875, 0.84375, 0.46875, -1.2578125,
            -0.4140625, 0.515625, 0.3125, -1.375, 0.5, 0.0078125, -0.7109375, -0.75,
            -0.0546875, -0.40625, 0.03125, 0.1015625, 0.8515625, 1.0078125, -0.0078125, 0.15625,
            0.0, -1.2890625, -1.1875, 0.3046875, -0.140625, -0.140625, 0.5390625, 0.75,
            0.9375, 0.2109375, -0.984375, 0.9921875, 0.734375, -0.96875, 0.4453125, 1.140625,
            0.25, -0.8203125, 0.8984375, 1.203125, -0.140625, -0.8046875, 0.734375, 0.1484375,
            -1.234375, 0.78125, 0.984375, 0.5390625, 0.734375, 1.5, 1.1875, -0.7109375,
            0.6875, 1.4921875, 0.7421875, -1.75, 1.1953125, 1.2734375, -1.3046875, 0.7421875,
            2.1015625, 1.1953125, -1.140625, 0.71875, 1.4609375, 0.4140625, -0.6328125, 0.859375,
        ];
        pub const MULT_DX: &[f32] = &[
            0.15234375, 0.05859375, 0.234375, -0.1875, -0.1171875, 0.33203125, -0.18359375, -0.0078125,
            -0.5625, -0.26171875, 0.35546875, -0.03515625, 0.2734375, -0.1484375, -0.28125, 0.19921875,
            -0.02734375, -0.04296875, 0.140625, -0.1484375, 0.39453125, -0.1640625, -0.00390625, 0.0234375,
            -0.109375, 0.27734375, 0.0078125, 0.08203125, 0.22265625, -0.26171875, -0.16015625, -0.28515625,
            0.0546875, 0.328125, 0.0234375, 0.01171875, 0.12890625, 0.1640625, 0.0, -0.3125,
        ];
        pub const MULT_DW: &[f32] = &[
            1.046875, 1.1015625, -0.8359375, -0.2890625, 1.1328125, 1.6171875, 0.7265625, -0.875,
            -0.125, -0.84375, 0.15625, -0.5859375, -0.46875, -0.3515625, -0.046875, 0.6875,
            -0.90625, 0.3828125, -0.6640625, 0.265625, -0.171875, 0.796875, -0.3359375, -1.234375,
            0.9296875, 1.0078125, -0.8671875, 0.421875, -0.5, 0.1328125, -0.0625, -1.375,
            1.3359375, -0.6484375, 0.09375, -0.8359375,
        ];
        pub const MULT_DB: &[f32] = &[
            0.1875, -0.125, -0.4375, 0.3125,
        ];
        // WIDE: y (1, 4, 2, 2)
        pub const WIDE_Y: &[f32] = &[
            0.78125, 0.453125, -0.4296875, -1.2109375, -0.1875, 0.40625, 1.140625, -1.4375,
            1.6875, -0.7421875, 0.515625, 1.7109375, 0.984375, -0.75, 2.125, 0.84375,
        ];
        pub const WIDE_DX: &[f32] = &[
            -0.0078125, 0.06640625, 0.09765625, -0.16796875, -0.1640625, 0.18359375, 0.2265625, -0.0546875,
            -0.125, -0.02734375, -0.03125, 0.01953125, 0.05859375, -0.0078125, 0.11328125, -0.0859375,
            -0.0546875, 0.1875, 0.2578125, -0.1796875, -0.05859375, -0.171875, -0.00390625, -0.16015625,
            0.109375, -0.0546875, -0.0078125, -0.015625, 0.02734375, 0.06640625, -0.046875, 0.0,
            0.07421875, -0.203125, 0.453125, -0.203125, -0.03515625, -0.0703125, -0.01171875, 0.12890625,
            -0.046875, 0.00390625, -0.0078125, -0.0546875, 0.109375, 0.18359375, -0.27734375, 0.140625,
            -0.18359375, 0.11328125, 0.05859375, 0.01953125, 0.0078125, 0.01171875, 0.02734375, 0.08984375,
            -0.046875, 0.125, -0.2734375, -0.12890625, -0.07421875, 0.26953125, -0.140625, -0.12890625,
            0.05078125, 0.0703125, 0.02734375, 0.1015625, -0.01171875, -0.015625, -0.02734375, 0.01171875,
            0.12109375, 0.11328125, -0.1171875, -0.22265625, -0.03125, 0.10546875, 0.04296875, 0.03125,
            0.01171875, -0.03515625, 0.07421875, 0.0, 0.0859375, 0.08984375, -0.08203125, -0.05078125,
            -0.0625, 0.01171875,
        ];
        pub const WIDE_DW: &[f32] = &[
            1.4375, -0.3125, 0.0390625, -0.3515625, -0.265625, 0.0234375, -0.3046875, -0.46875,
            1.4296875, -0.3203125, 0.03125, -0.359375, -0.2734375, -0.4375, -0.3125, -0.25,
            1.421875, -0.328125, 0.0234375, -0.3671875, 0.34375, -0.484375, 1.7109375, -0.25,
            -0.765625, 1.8046875, -0.53125, 0.2265625, 0.390625, -0.4375, 1.7578125, -0.203125,
            -0.71875, 0.0390625, -0.484375, -0.859375, 0.4375, -0.390625, 1.8046875, -0.15625,
            0.6640625, -0.4453125, 0.5078125, 0.7578125, -0.7109375, 0.4453125, -0.4140625, -0.6171875,
            0.6328125, -0.4765625, 0.4765625, 0.7265625, -0.7421875, 0.4140625, -0.4453125, -0.6484375,
            0.6015625, -0.5078125, 0.4453125, 0.6953125, -0.390625, -0.578125, -0.2734375, -0.4609375,
            1.546875, -0.2265625, -0.6015625, 1.4765625, -0.3671875, -0.5546875, -0.25, -0.4375,
            1.5703125, -0.203125, -0.578125, 1.5, -0.34375, -0.53125, -0.2265625, -0.4140625,
        ];
        pub const WIDE_DB: &[f32] = &[
            0.0625, -0.375, 0.25, -0.1875,
        ];
    }

    /// Values `len` of the script's formula `((i·a + b) mod m − h) / d` (exact in f32).
    fn formula(len: usize, (a, b, m, h, d): (usize, usize, usize, f32, f32)) -> Vec<f32> {
        (0..len).map(|i| ((i * a + b) % m) as f32 - h).map(|v| v / d).collect()
    }

    /// The layer's training pass on x: (y, dx, dweight, dbias) for the output gradient
    /// `dout` (by `dout_of(len)`), parameters `w` (weight, then bias where it has one).
    fn pass(
        conv: &Conv2d,
        x: &[f32],
        dims: [usize; 4],
        w: &[f32],
        dout_of: impl Fn(usize) -> Vec<f32>,
    ) -> [Vec<f32>; 4] {
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let sizes: Vec<usize> = conv.params().iter().map(|p| p.shape.numel()).collect();
        let mut at = 0;
        let ranges: Vec<_> = sizes
            .iter()
            .map(|&len| {
                at += len;
                at - len..at
            })
            .collect();
        let mut layer = conv.clone();
        let x = Tensor::from_vec(x.to_vec(), dims).unwrap();
        let y = layer.forward(x, Params::new(w, &ranges), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let dout = Tensor::from_vec(dout_of(y.numel()), y.shape().clone()).unwrap();
        let mut grads = vec![0.0; w.len()];
        let dparams = ParamsMut::new(&mut grads, &ranges);
        let dx = layer.backward(dout, Params::new(w, &ranges), dparams, InputGrad::Needed, &ctx).unwrap();
        let db = grads.split_off(sizes[0]);
        [y.into_vec(), dx.unwrap().into_vec(), grads, db]
    }

    #[test]
    fn grouped_and_depthwise_convolutions_match_pytorch() {
        // The script's cases: (case, x dims, filters, groups, kernel, stride, padding, bias,
        // the path it takes, y, dx, dweight, dbias). Every value is exact in f32 and every
        // sum of products of them too, so the layer must give each to the bit.
        use torch::*;
        #[allow(clippy::type_complexity)]
        let cases: [(
            usize,
            [usize; 4],
            usize,
            usize,
            (usize, usize),
            usize,
            Padding,
            bool,
            Grouped,
            [&[f32]; 4],
        ); 5] = [
            (0, [2, 4, 3, 4], 4, 2, (2, 3), 1, Padding::Valid, true, Grouped::Direct, [G2_Y, G2_DX, G2_DW, G2_DB]),
            (
                1,
                [1, 3, 6, 6],
                3,
                3,
                (3, 3),
                2,
                Padding::Same,
                true,
                Grouped::Direct,
                [SAME2_Y, SAME2_DX, SAME2_DW, SAME2_DB],
            ),
            (
                2,
                [2, 2, 5, 5],
                2,
                2,
                (3, 3),
                2,
                Padding::Explicit(1, 1),
                false,
                Grouped::Direct,
                [PAD2_Y, PAD2_DX, PAD2_DW, &[]],
            ),
            (
                3,
                [1, 2, 4, 5],
                4,
                2,
                (3, 3),
                1,
                Padding::Same,
                true,
                Grouped::Direct,
                [MULT_Y, MULT_DX, MULT_DW, MULT_DB],
            ),
            (
                4,
                [1, 10, 3, 3],
                4,
                2,
                (2, 2),
                1,
                Padding::Valid,
                true,
                Grouped::PerGroup,
                [WIDE_Y, WIDE_DX, WIDE_DW, WIDE_DB],
            ),
        ];
        for (case, dims, o, groups, kernel, stride, padding, bias, path, want) in cases {
            let conv = Conv2d::new(dims[1], o, kernel, stride, padding, bias).unwrap().with_groups(groups).unwrap();
            let (_, g) = conv.geometry(&Shape::new(dims)).unwrap();
            assert_eq!(conv.grouping(&g).path(), path, "case {case}");
            let x = formula(dims.iter().product(), (37, case, 29, 14.0, 8.0));
            let per_weight = o * dims[1] / groups * kernel.0 * kernel.1;
            let mut w = formula(per_weight, (11, 3, 13, 6.0, 16.0));
            if bias {
                w.extend((0..o).map(|f| (f as f32 - 1.0) / 4.0));
            }
            let got = pass(&conv, &x, dims, &w, |len| formula(len, (7, 2, 17, 8.0, 16.0)));
            for ((what, got), want) in ["y", "dx", "dweight", "dbias"].iter().zip(&got).zip(want) {
                assert_eq!(got, want, "case {case}: {what}");
            }
        }
    }

    /// y, dx, dweight and dbias of a grouped convolution by its definition, in f64: the
    /// reference the paths are held to. x: (N, C, H, W), w: (O, C/G, KH, KW), b: (O),
    /// dout: (N, O, OH, OW); padding top and left of the geometry.
    fn reference(gr: &Grouping, n: usize, x: &[f32], w: &[f32], b: &[f32], dout: &[f32]) -> [Vec<f64>; 4] {
        let (g, o) = (&gr.g, gr.o);
        let (cpg, opg, p) = (gr.cpg(), gr.opg(), g.col_cols());
        let (mut y, mut dx) = (vec![0.0; n * o * p], vec![0.0; n * g.c * g.h * g.w]);
        let (mut dw, mut db) = (vec![0.0; w.len()], vec![0.0; o]);
        for s in 0..n {
            for f in 0..o {
                for oy in 0..g.oh {
                    for ox in 0..g.ow {
                        let at = (s * o + f) * p + oy * g.ow + ox;
                        db[f] += dout[at] as f64;
                        y[at] += b[f] as f64;
                        for ci in 0..cpg {
                            let c = f / opg * cpg + ci;
                            for i in 0..g.kh {
                                for j in 0..g.kw {
                                    let yy = (oy * g.stride + i).checked_sub(g.pad_top).filter(|&v| v < g.h);
                                    let xx = (ox * g.stride + j).checked_sub(g.pad_left).filter(|&v| v < g.w);
                                    let (Some(yy), Some(xx)) = (yy, xx) else { continue };
                                    let xi = ((s * g.c + c) * g.h + yy) * g.w + xx;
                                    let wi = ((f * cpg + ci) * g.kh + i) * g.kw + j;
                                    y[at] += w[wi] as f64 * x[xi] as f64;
                                    dx[xi] += w[wi] as f64 * dout[at] as f64;
                                    dw[wi] += dout[at] as f64 * x[xi] as f64;
                                }
                            }
                        }
                    }
                }
            }
        }
        [y, dx, dw, db]
    }

    #[test]
    fn every_grouped_path_computes_the_convolution_and_the_same_bits_on_any_thread_count() {
        // Each path against the f64 definition, within 1e-5 of the largest magnitude of each
        // result (at least 1), as Winograd's own test holds it (sums of up to 20·64 = 1280
        // products of values below 1/2 in f32, some through Winograd's transforms): the direct path at
        // strides 1 and 2 with Keras's "same" (asymmetric at stride 2) and explicit pads,
        // two filters a channel and 4-channel groups; a convolution a group by columns,
        // rows, Winograd, pointwise and taps. 20 samples make two chunks of samples; 1, 2 and 3 threads and
        // an input gradient over the input or apart must give the same bits, and the
        // parameters' gradients accumulate.
        let cases = [
            // (C, O, G, kernel, stride, padding, H, W, the path, the groups' unfolding)
            (6, 6, 6, 3, 1, Padding::Same, 9, 8, Grouped::Direct, None),
            (4, 8, 4, 3, 2, Padding::Same, 8, 10, Grouped::Direct, None),
            (8, 8, 2, 5, 2, Padding::Explicit(2, 1), 9, 7, Grouped::Direct, None),
            (3, 3, 3, 7, 1, Padding::Explicit(3, 3), 7, 6, Grouped::Direct, None),
            (10, 4, 2, 2, 1, Padding::Valid, 6, 5, Grouped::PerGroup, Some(Unfold::Columns)),
            (12, 6, 2, 3, 2, Padding::Same, 9, 9, Grouped::PerGroup, Some(Unfold::Rows)),
            (32, 32, 2, 3, 1, Padding::Same, 8, 8, Grouped::PerGroup, Some(Unfold::Winograd)),
            (12, 6, 2, 1, 1, Padding::Valid, 6, 5, Grouped::PerGroup, Some(Unfold::Pointwise)),
            (24, 12, 2, 3, 1, Padding::Same, 9, 8, Grouped::PerGroup, Some(Unfold::Taps)),
        ];
        for (c, o, groups, k, stride, padding, h, w, path, how) in cases {
            let what = format!("C {c}, O {o}, G {groups}, {k}x{k} stride {stride}, {padding:?}");
            let conv = Conv2d::new(c, o, (k, k), stride, padding, true).unwrap().with_groups(groups).unwrap();
            let n = 20;
            let dims = [n, c, h, w];
            let (_, g) = conv.geometry(&Shape::new(dims)).unwrap();
            let gr = conv.grouping(&g);
            assert_eq!(gr.path(), path, "{what}");
            assert_eq!(how.map(|_| unfold(&gr.sub(), gr.opg())), how, "{what}");
            assert!(batch_chunks(n).len() > 1);
            let mut r = crate::rng::SplitMix64::new(c as u64 * 31 + k as u64);
            let mut rand = |len: usize| (0..len).map(|_| r.next_f32() - 0.5).collect::<Vec<f32>>();
            let weights = o * c / groups * k * k;
            let (x, params) = (rand(n * c * h * w), rand(weights + o));
            let dout = rand(n * o * g.col_cols());
            let on = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| pass(&conv, &x, dims, &params, |_| dout.clone()))
            };
            let one = on(1);
            let want = reference(&gr, n, &x, &params[..weights], &params[weights..], &dout);
            for ((part, got), want) in ["y", "dx", "dweight", "dbias"].iter().zip(&one).zip(&want) {
                let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
                let worst = got.iter().zip(want).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
                assert!(
                    worst <= 1e-5 * scale,
                    "{what}: {part} differs from the definition by {worst:e} (scale {scale})"
                );
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for threads in [2, 3] {
                let many = on(threads);
                for (part, (a, b)) in ["y", "dx", "dweight", "dbias"].iter().zip(one.iter().zip(&many)) {
                    assert_eq!(bits(a), bits(b), "{what}: {part} on {threads} threads");
                }
            }
            // The input gradient apart (x shared) is the one written over x.
            let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
            let ranges = [0..weights, weights..weights + o];
            let mut layer = conv.clone();
            let xt = Tensor::from_vec(x.clone(), dims).unwrap();
            let held = xt.clone();
            layer.forward(xt, Params::new(&params, &ranges), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
            let d = Tensor::from_vec(dout.clone(), [n, o, g.oh, g.ow]).unwrap();
            let mut grads: Vec<f32> = (0..params.len()).map(|i| i as f32 / 64.0).collect();
            let dparams = ParamsMut::new(&mut grads, &ranges);
            let dx = layer.backward(d, Params::new(&params, &ranges), dparams, InputGrad::Needed, &ctx).unwrap();
            assert_eq!(bits(&dx.unwrap().into_vec()), bits(&one[1]), "{what}: dx apart");
            assert_eq!(held.into_vec(), x, "{what}: the shared input was written");
            let sums = one[2].iter().chain(&one[3]).enumerate().map(|(i, v)| i as f32 / 64.0 + v);
            assert_eq!(bits(&grads), bits(&sums.collect::<Vec<_>>()), "{what}: the gradients accumulate");
        }
    }

    #[test]
    fn a_grouped_backward_is_the_gradient_of_its_forward() {
        // Central differences of L = Σ dout·y (f64) against the backward, as the
        // conformance test checks every layer type's example (step 1e-2; a convolution is
        // linear in x and in the weight, so only the forward's f32 rounding separates the
        // two: |Δ| ≤ 1e-3 + 1e-2 of the larger), for a depthwise layer with two filters a
        // channel at stride 2 and one of two groups run as a convolution a group.
        const H: f32 = 1e-2;
        for (c, o, groups, k, stride, padding) in
            [(3, 6, 3, 3, 2, Padding::Same), (10, 4, 2, 3, 1, Padding::Explicit(1, 0))]
        {
            let conv = Conv2d::new(c, o, (k, k), stride, padding, true).unwrap().with_groups(groups).unwrap();
            let dims = [2, c, 5, 6];
            let mut r = crate::rng::SplitMix64::new(17);
            let mut rand = |len: usize| (0..len).map(|_| 2.0 * r.next_f32() - 1.0).collect::<Vec<f32>>();
            let weights = o * c / groups * k * k;
            let (x, params) = (rand(dims.iter().product()), rand(weights + o));
            let oshape = conv.output_shape(&Shape::new(dims)).unwrap();
            let dout = rand(oshape.numel());
            let [_, dx, dw, db] = pass(&conv, &x, dims, &params, |_| dout.clone());
            let objective = |x: &[f32], p: &[f32]| -> f64 {
                let [y, ..] = pass(&conv, x, dims, p, |len| vec![0.0; len]);
                y.iter().zip(&dout).map(|(&y, &d)| y as f64 * d as f64).sum()
            };
            let check = |what: &str, i: usize, analytic: f32, plus: f64, minus: f64| {
                let numeric = (plus - minus) / (2.0 * H as f64);
                let bound = 1e-3 + 1e-2 * numeric.abs().max(analytic.abs() as f64);
                assert!((analytic as f64 - numeric).abs() <= bound, "G {groups}: {what}[{i}]: {analytic} vs {numeric}");
            };
            for i in 0..x.len() {
                let at = |v: f32| {
                    let mut x = x.clone();
                    x[i] += v;
                    objective(&x, &params)
                };
                check("dx", i, dx[i], at(H), at(-H));
            }
            let dparams: Vec<f32> = dw.iter().chain(&db).copied().collect();
            for i in 0..params.len() {
                let at = |v: f32| {
                    let mut p = params.clone();
                    p[i] += v;
                    objective(&x, &p)
                };
                check("dparams", i, dparams[i], at(H), at(-H));
            }
        }
    }

    /// Milliseconds of a training pass (forward and backward with the input gradient) of
    /// the depthwise shapes that scripts/torch_conv2d_groups.py --bench times for PyTorch:
    /// the best of 10 after 2 warm-ups, on a pool of `LOCKSTEP_BENCH_THREADS` threads (2).
    /// Run: cargo test --release --lib depthwise_speed -- --ignored --nocapture
    #[test]
    #[ignore]
    fn depthwise_speed() {
        let threads = std::env::var("LOCKSTEP_BENCH_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(2);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        for (n, c, hw, k, stride) in [(32, 64, 32, 3, 1), (32, 64, 32, 3, 2), (32, 96, 28, 7, 1), (32, 256, 14, 3, 1)] {
            let pad = Padding::Explicit(k / 2, k / 2);
            let conv = Conv2d::new(c, c, (k, k), stride, pad, true).unwrap().with_groups(c).unwrap();
            let dims = [n, c, hw, hw];
            let mut r = crate::rng::SplitMix64::new(1);
            let mut rand = |len: usize| (0..len).map(|_| r.next_f32() - 0.5).collect::<Vec<f32>>();
            let (x, params) = (rand(dims.iter().product()), rand(c * k * k + c));
            let ranges = [0..c * k * k, c * k * k..params.len()];
            let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
            let mut layer = conv.clone();
            let mut grads = vec![0.0; params.len()];
            let best = pool.install(|| {
                (0..12)
                    .map(|_| {
                        let xt = Tensor::from_vec(x.clone(), dims).unwrap();
                        let start = std::time::Instant::now();
                        let no_buffers = ParamsMut::new(&mut [], &[]);
                        let y = layer.forward(xt, Params::new(&params, &ranges), no_buffers, &ctx).unwrap();
                        let dparams = ParamsMut::new(&mut grads, &ranges);
                        let dx = layer.backward(y, Params::new(&params, &ranges), dparams, InputGrad::Needed, &ctx);
                        let took = start.elapsed().as_secs_f64() * 1e3;
                        drop(dx.unwrap());
                        took
                    })
                    .skip(2)
                    .fold(f64::INFINITY, f64::min)
            });
            eprintln!("depthwise N {n} C {c} {hw}x{hw} {k}x{k} stride {stride}: {best:.2} ms forward+backward ({threads} threads)");
        }
    }

    #[test]
    fn groups_must_divide_the_channels_and_the_filters() {
        use crate::spec::model_from_spec_str;
        for (c, o, groups) in [(4, 6, 0), (6, 4, 4), (4, 6, 4), (3, 3, 2)] {
            let e = Conv2d::new(c, o, (3, 3), 1, Padding::Same, true).unwrap().with_groups(groups).unwrap_err();
            let e = e.to_string();
            assert!(
                e.contains(&format!("{c} input channels and {o} filters must both be divisible by groups {groups}")),
                "{e}"
            );
        }
        let spec = |fields: &str| {
            format!(
                r#"{{"input_shape": [4, 6, 6], "layers": [{{"type": "conv2d", "filters": 6, "kernel_size": 3, {fields}}}]}}"#
            )
        };
        let e = model_from_spec_str(&spec(r#""groups": 4"#), "m.json").unwrap_err().to_string();
        assert!(e.contains("4 input channels and 6 filters must both be divisible by groups 4"), "{e}");
        let e = model_from_spec_str(&spec(r#""groups": 0"#), "m.json").unwrap_err().to_string();
        assert!(e.contains("field 'groups'"), "{e}");
        // A grouped layer: its weight (O, C/G, KH, KW), its description, and its spec form
        // written back with the groups (one group, the default, is not written).
        let m = model_from_spec_str(&spec(r#""groups": 2, "use_bias": false"#), "m.json").unwrap();
        let shapes: Vec<_> = m.param_infos().iter().map(|t| (t.name.clone(), t.shape.clone())).collect();
        assert_eq!(shapes, [("conv0.weight".to_string(), Shape::new([6, 2, 3, 3]))]);
        assert_eq!(m.layers()[0].describe(), "Conv2d(6, 3x3, stride 1, valid, groups 2, no bias)");
        assert_eq!(m.layers()[0].spec().unwrap()["groups"], 2);
        let ungrouped = model_from_spec_str(&spec(r#""groups": 1"#), "m.json").unwrap();
        assert!(ungrouped.layers()[0].spec().unwrap().get("groups").is_none());
    }

    #[test]
    fn a_forward_into_the_last_backwards_gradient_is_a_fresh_layers() {
        // The output gradient of a backward is kept as the next forward's output. Given one
        // of NaNs, a second forward must still equal a fresh layer's bit for bit, through
        // each unfolding: every output value is written, none read.
        use crate::tensor::Device;
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let cases = [
            (1, 4, 3, 1, Unfold::Columns),
            (8, 8, 3, 2, Unfold::Rows),
            (8, 16, 3, 1, Unfold::Winograd),
            (12, 7, 1, 1, Unfold::Pointwise),
            (16, 12, 3, 1, Unfold::Taps),
        ];
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
        let cases = [
            (1, 4, 3, 1, 9, Unfold::Columns),
            (24, 8, 3, 2, 28, Unfold::Rows),
            (8, 16, 3, 1, 9, Unfold::Winograd),
            (36, 20, 1, 1, 9, Unfold::Pointwise),
            (48, 12, 3, 1, 28, Unfold::Taps),
        ];
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
