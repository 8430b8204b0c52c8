//! AvgPool2d: the mean of each window of an NCHW tensor, Keras's `AveragePooling2D` (pool
//! size, strides, `valid`/`same` padding) and PyTorch's `AvgPool2d` (explicit pads, the
//! padded zeros counted: `count_include_pad=True`, its default). What each window divides
//! by, and the order of every sum, are [`cpu`]'s docs.
//!
//! Owns the layer, built on its CPU forward and backward ([`cpu`]): its spec entry
//! (`average_pooling2d`), its spec form and its memory account (nothing is kept for the
//! backward: the geometry decides it). Its GPU form is [`gpu`] (kernels/avgpool2d.cu).
//! A DenseNet's transition layers pool with it.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use super::window::{Geometry2d, Padding, Window2d};
use serde_json::{json, Value};

use super::spec::{expect_images, Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// Average pooling over the spatial dimensions.
#[derive(Clone, Debug)]
pub struct AvgPool2d {
    window: Window2d,
    /// From the training forward: x's shape (N, C, H, W).
    cached: Option<Shape>,
}

impl AvgPool2d {
    /// Windows of `pool_size` (KH, KW) moved by `strides` (SH, SW), with `padding`
    /// (Keras's defaults: `(2, 2)`, strides = pool size, valid).
    pub fn new(pool_size: (usize, usize), strides: (usize, usize), padding: Padding) -> Result<AvgPool2d> {
        if pool_size.0 == 0 || pool_size.1 == 0 || strides.0 == 0 || strides.1 == 0 {
            return Err(Error::config(
                "AvgPool2d",
                format!("pool size and strides must be positive (got {pool_size:?}, {strides:?})"),
            ));
        }
        padding.check(pool_size).map_err(|e| Error::config("AvgPool2d", e))?;
        Ok(AvgPool2d { window: Window2d::new(pool_size, strides, padding), cached: None })
    }

    /// The pooling window.
    pub fn window(&self) -> Window2d {
        self.window
    }

    /// The spec entry: Keras's `AveragePooling2D(pool_size=(2, 2), strides=None,
    /// padding="valid")`, strides defaulting to the pool size; explicit pads are PyTorch's.
    pub const SPEC: LayerType = LayerType {
        name: "average_pooling2d",
        fields: "`pool_size` (2; int or [kh, kw]), `strides` (the pool size; int or [sh, sw]), `padding` (\"valid\", \"same\": Keras's, padding not counted, or pads: int or [ph, pw], counted as PyTorch's; \"valid\")",
        example: (&[2, 7, 6], r#"{"type": "average_pooling2d", "pool_size": [3, 2], "strides": [2, 1], "padding": "same"}"#),
        parse: |f| {
            let pool_size = f.pair("pool_size", Some((2, 2)))?;
            let strides = f.pair("strides", Some(pool_size))?;
            let padding = f.padding()?;
            Ok(Build::layer(move |input| {
                expect_images(input)?;
                AvgPool2d::new(pool_size, strides, padding).map_err(|e| e.to_string())
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

    /// (N, C, the window on the H×W plane) for an input shape.
    fn geometry(&self, input: &Shape) -> Result<(usize, usize, Geometry2d)> {
        let (n, c, h, w) = input.nchw("AvgPool2d")?;
        let (kh, kw) = self.window.kernel;
        let g = self.window.over(h, w).ok_or_else(|| {
            Error::shape("AvgPool2d", format!("input {input} is empty or smaller than the {kh}x{kw} pool"))
        })?;
        Ok((n, c, g))
    }
}

impl Layer for AvgPool2d {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "avgpool"
    }

    fn spec(&self) -> Option<Value> {
        let w = self.window;
        Some(json!({
            "type": "average_pooling2d",
            "pool_size": [w.kernel.0, w.kernel.1],
            "strides": [w.stride.0, w.stride.1],
            "padding": w.padding.to_json(),
        }))
    }

    /// Nothing kept: the backward needs only the geometry.
    fn memory(&self, _shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory::NONE)
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (n, c, g) = self.geometry(input)?;
        Ok(Shape::new([n, c, g.oh, g.ow]))
    }

    // x: (N, C, H, W) → y: (N, C, OH, OW)
    fn forward(&mut self, x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (n, c, g) = self.geometry(x.shape())?;
        let mut y = vec![0.0f32; n * c * g.oh * g.ow];
        cpu::avgpool2d_forward(x.host(), &g, &mut y);
        self.cached = (ctx.mode == Mode::Train).then(|| x.shape().clone());
        Tensor::from_vec_on(y, [n, c, g.oh, g.ow], x.device())
    }

    // dout: (N, C, OH, OW) → dx: (N, C, H, W), each dout spread evenly over its window
    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let shape = self
            .cached
            .take()
            .ok_or_else(|| Error::config("AvgPool2d backward", "no training forward to differentiate"))?;
        let (n, c, g) = self.geometry(&shape)?;
        if dout.shape().dims() != [n, c, g.oh, g.ow] {
            return Err(Error::shape(
                "AvgPool2d backward",
                format!("dout {} for output ({n}, {c}, {}, {})", dout.shape(), g.oh, g.ow),
            ));
        }
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        let mut dx = vec![0.0f32; n * c * g.h * g.w];
        cpu::avgpool2d_backward(dout.host(), &g, &mut dx);
        Tensor::from_vec_on(dx, shape, dout.device()).map(Some)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(AvgPool2d { window: self.window, cached: None })
    }

    fn describe(&self) -> String {
        format!("AvgPool2d({})", self.window.describe())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tensor::Device;

    /// The output of scripts/torch_avgpool2d.py: per case, (y, torch_y) per output and
    /// (dx, torch_dx) per input, the first of each pair float64 evaluation rounded once to
    /// f32, the second PyTorch's own float32.
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)] // the values as the script prints them, f32's in f64 digits
    mod torch {
        // made by torch 2.15.0+cu132
        pub const PAD_Y: &[(f32, f32)] = &[
            (-0.1388888955116272, -0.1388888955116272), (0.1666666716337204, 0.1666666716337204),
            (-0.0833333358168602, -0.0833333358168602), (0.0555555559694767, 0.0555555559694767),
            (0.02777777798473835, 0.02777777798473835), (0.1111111119389534, 0.1111111119389534),
        ];
        pub const PAD_DX: &[(f32, f32)] = &[
            (-0.0416666679084301, -0.0416666679084301), (-0.013888888992369175, -0.01388888992369175),
            (0.02777777798473835, 0.02777777798473835), (0.02777777798473835, 0.02777777798473835),
            (-0.0416666679084301, -0.0416666679084301), (-0.0416666679084301, -0.0416666679084301),
            (0.0, 0.0), (0.0, 0.0),
            (0.0, 0.0), (-0.02777777798473835, -0.02777777798473835),
            (-0.02777777798473835, -0.02777777798473835), (-0.02777777798473835, -0.02777777798473835),
            (0.0416666679084301, 0.0416666679084301), (0.02777777798473835, 0.0277777798473835),
            (-0.013888888992369175, -0.013888888992369175), (-0.013888888992369175, -0.013888888992369175),
            (0.0416666679084301, 0.0416666679084301), (0.0555555559694767, 0.0555555559694767),
            (0.013888888992369175, 0.013888888992369175), (0.013888888992369175, 0.013888888992369175),
        ];
        pub const VALID_Y: &[(f32, f32)] = &[
            (-0.125, -0.125), (0.25, 0.25),
            (0.125, 0.125), (0.0416666679084301, 0.0416666679084301),
        ];
        pub const VALID_DX: &[(f32, f32)] = &[
            (-0.0625, -0.0625), (-0.02083333395421505, -0.0208333320915699),
            (-0.02083333395421505, -0.0208333320915699), (0.0416666679084301, 0.0416666679084301),
            (-0.0625, -0.0625), (-0.02083333395421505, -0.0208333320915699),
            (-0.02083333395421505, -0.0208333320915699), (0.0416666679084301, 0.0416666679084301),
            (0.0, 0.0), (-0.0416666679084301, -0.0416666679084301),
            (-0.0416666679084301, -0.0416666679084301), (-0.0416666679084301, -0.0416666679084301),
            (0.0, 0.0), (-0.0416666679084301, -0.0416666679084301),
            (-0.0416666679084301, -0.0416666679084301), (-0.0416666679084301, -0.0416666679084301),
            (0.0, 0.0), (0.0, 0.0),
            (0.0, 0.0), (0.0, 0.0),
        ];
        pub const SAME_Y: &[(f32, f32)] = &[
            (-0.3125, -0.3125), (-0.125, -0.125),
            (0.25, 0.25), (0.4375, 0.4375),
            (-0.125, -0.125), (0.1388888955116272, 0.1388888955116272),
            (0.0555555559694767, 0.0555555559694767), (0.1666666716337204, 0.1666666716337204),
            (0.0625, 0.0625), (0.25, 0.25),
            (0.1666666716337204, 0.1666666716337204), (0.125, 0.125),
        ];
        pub const SAME_DX: &[(f32, f32)] = &[
            (-0.0520833320915699, -0.0520833320915699), (-0.0520833320915699, -0.0520833320915699),
            (-0.02083333395421505, -0.0208333320915699), (-0.0625, -0.0625),
            (0.0243055559694767, 0.0243055559694767), (0.010416666977107525, 0.010416666977107525),
            (-0.0833333358168602, -0.0833333283662796), (-0.1388888955116272, -0.1388888955116272),
            (0.0763888880610466, 0.0763888880610466), (0.0625, 0.0625),
            (-0.0625, -0.0625), (-0.0763888880610466, -0.0763888880610466),
            (0.1388888955116272, 0.1388888955116272), (0.0833333358168602, 0.0833333283662796),
            (-0.010416666977107525, -0.010416671633720398), (-0.0243055559694767, -0.0243055522441864),
            (0.0625, 0.0625), (0.02083333395421505, 0.0208333320915699),
            (0.0520833320915699, 0.0520833320915699), (0.0520833320915699, 0.0520833320915699),
        ];
    }

    /// The layer's forward in training mode, then its backward of `dout`: (y, dx).
    fn run(pool: &mut AvgPool2d, x: Vec<f32>, dims: [usize; 4], dout: Vec<f32>) -> (Tensor, Vec<f32>) {
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let x = Tensor::from_vec(x, dims).unwrap();
        let y = pool.forward(x, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let d = Tensor::from_vec(dout, y.shape().clone()).unwrap();
        let dx = pool.backward(d, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx);
        (y, dx.unwrap().unwrap().into_vec())
    }

    /// The script's three cases on its x (1, 1, 5, 4) and dy. y equals the float64 value
    /// rounded once: a window's values are multiples of 1/4 whose f32 sum is exact, then one
    /// division. dx, up to four shares dy / count each rounded once and their sum, within
    /// 2.4·10⁻⁷ relative plus 10⁻⁷ of the float64 value; both within the same bound of
    /// PyTorch's float32, which sums the shares in its own order.
    #[test]
    fn avgpool2d_matches_pytorch() {
        let x: Vec<f32> = (0..20).map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0).collect();
        let cases = [
            (AvgPool2d::new((3, 3), (2, 2), Padding::Explicit(1, 1)), torch::PAD_Y, torch::PAD_DX),
            (AvgPool2d::new((2, 3), (2, 1), Padding::Valid), torch::VALID_Y, torch::VALID_DX),
            (AvgPool2d::new((3, 3), (2, 1), Padding::Same), torch::SAME_Y, torch::SAME_DX),
        ];
        for (pool, want_y, want_dx) in cases {
            let mut pool = pool.unwrap();
            let dy: Vec<f32> = (0..want_y.len()).map(|j| ((j * 5 % 7) as f32 - 3.0) / 8.0).collect();
            let (y, dx) = run(&mut pool, x.clone(), [1, 1, 5, 4], dy);
            let what = pool.describe();
            assert_eq!(y.numel(), want_y.len(), "{what}: outputs");
            for (i, (&got, &(exact, torch))) in y.host().iter().zip(want_y).enumerate() {
                assert_eq!(got, exact, "{what}: y[{i}]");
                assert!((got - torch).abs() <= 2.4e-7 * torch.abs() + 1e-7, "{what}: y[{i}] {got} vs torch {torch}");
            }
            for (i, (&got, &(exact, torch))) in dx.iter().zip(want_dx).enumerate() {
                for want in [exact, torch] {
                    let bound = 2.4e-7 * want.abs() + 1e-7;
                    assert!((got - want).abs() <= bound, "{what}: dx[{i}] {got}, want {want} (bound {bound:e})");
                }
            }
        }
    }

    #[test]
    fn the_spec_entry_reads_keras_fields_and_refuses_what_does_not_fit() {
        use crate::spec::model_from_spec_str;
        let m =
            model_from_spec_str(r#"{"input_shape": [3, 8, 8], "layers": [{"type": "average_pooling2d"}]}"#, "m.json")
                .unwrap();
        assert_eq!(m.layer_names(), ["avgpool0"]);
        assert_eq!(m.layers()[0].describe(), "AvgPool2d(2x2, stride 2, valid)");
        assert_eq!(m.output_shape().dims(), [3, 4, 4]);
        for (input, fields, want) in [
            ("[8]", "", "expects images (C, H, W)"),
            ("[3, 8, 8]", r#", "padding": [2, 0]"#, "padding 2x0 must be less than the 2x2 kernel"),
            ("[3, 8, 8]", r#", "pool_size": 0"#, "field 'pool_size' must be a positive integer"),
            ("[3, 1, 8]", "", "smaller than the 2x2 pool"),
        ] {
            let spec = format!(r#"{{"input_shape": {input}, "layers": [{{"type": "average_pooling2d"{fields}}}]}}"#);
            let e = model_from_spec_str(&spec, "m.json").unwrap_err().to_string();
            assert!(e.contains(want), "{input} {fields}: {e}");
        }
        // An evaluation forward leaves nothing to differentiate.
        let mut pool = AvgPool2d::new((2, 2), (2, 2), Padding::Valid).unwrap();
        let x = Tensor::from_vec(vec![1.0; 4], [1, 1, 2, 2]).unwrap();
        let ctx = Ctx::eval(Device::Cpu(0));
        let y = pool.forward(x, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        assert_eq!(y.host(), [1.0]);
        let e = pool.backward(y, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx);
        assert!(e.unwrap_err().to_string().contains("no training forward"));
    }
}
