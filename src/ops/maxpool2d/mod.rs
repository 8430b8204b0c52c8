//! MaxPool2d: the maximum of each window of an NCHW tensor, Keras's `MaxPooling2D`
//! (pool size, strides, `valid`/`same` padding) with PyTorch's `MaxPool2d` semantics
//! (ties, NaN and the backward's sums: [`cpu`]'s docs).
//!
//! Owns the layer, built on its CPU forward and backward ([`cpu`]): its spec entry
//! (`max_pooling2d`), its spec form and what it keeps for backward (the winners'
//! indices). Its GPU form is [`gpu`] (kernels/maxpool2d.cu).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use super::window::{Geometry2d, Padding, Window2d};
use serde_json::{json, Value};

use super::spec::{expect_images, Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// Max pooling over the spatial dimensions.
#[derive(Clone, Debug)]
pub struct MaxPool2d {
    window: Window2d,
    /// From the training forward: x's shape (N, C, H, W) and, per output (N, C, OH, OW),
    /// the index in its plane of the input that won.
    cache: Option<(Shape, Vec<u32>)>,
}

impl MaxPool2d {
    /// Windows of `pool_size` (KH, KW) moved by `strides` (SH, SW), with `padding`
    /// (Keras's defaults: `(2, 2)`, strides = pool size, valid).
    pub fn new(pool_size: (usize, usize), strides: (usize, usize), padding: Padding) -> Result<MaxPool2d> {
        if pool_size.0 == 0 || pool_size.1 == 0 || strides.0 == 0 || strides.1 == 0 {
            return Err(Error::config(
                "MaxPool2d",
                format!("pool size and strides must be positive (got {pool_size:?}, {strides:?})"),
            ));
        }
        padding.check(pool_size).map_err(|e| Error::config("MaxPool2d", e))?;
        Ok(MaxPool2d { window: Window2d::new(pool_size, strides, padding), cache: None })
    }

    /// The pooling window.
    pub fn window(&self) -> Window2d {
        self.window
    }

    /// The spec entry: Keras's `MaxPooling2D(pool_size=(2, 2), strides=None,
    /// padding="valid")`, strides defaulting to the pool size.
    pub const SPEC: LayerType = LayerType {
        name: "max_pooling2d",
        fields: "`pool_size` (2; int or [kh, kw]), `strides` (the pool size; int or [sh, sw]), `padding` (\"valid\", \"same\", or pads: int or [ph, pw]; \"valid\")",
        example: (&[2, 7, 6], r#"{"type": "max_pooling2d", "pool_size": [3, 2], "strides": [2, 1], "padding": "same"}"#),
        parse: |f| {
            let pool_size = f.pair("pool_size", Some((2, 2)))?;
            let strides = f.pair("strides", Some(pool_size))?;
            let padding = f.padding()?;
            Ok(Build::layer(move |input| {
                expect_images(input)?;
                MaxPool2d::new(pool_size, strides, padding).map_err(|e| e.to_string())
            }))
        },
        #[cfg(feature = "cuda")]
        kernels: Some(&gpu::KERNELS),
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Distinct,
            #[cfg(feature = "cuda")]
            host: Some(gpu::host_check),
        },
    };

    /// (N, C, the window on the H×W plane) for an input shape.
    fn geometry(&self, input: &Shape) -> Result<(usize, usize, Geometry2d)> {
        let (n, c, h, w) = input.nchw("MaxPool2d")?;
        let (kh, kw) = self.window.kernel;
        let g = self.window.over(h, w).ok_or_else(|| {
            Error::shape("MaxPool2d", format!("input {input} is empty or smaller than the {kh}x{kw} pool"))
        })?;
        if u32::try_from(h * w).is_err() {
            return Err(Error::shape("MaxPool2d", format!("input {input}: a plane's indices must fit in u32")));
        }
        Ok((n, c, g))
    }
}

impl Layer for MaxPool2d {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "maxpool"
    }

    fn spec(&self) -> Option<Value> {
        let w = self.window;
        Some(json!({
            "type": "max_pooling2d",
            "pool_size": [w.kernel.0, w.kernel.1],
            "strides": [w.stride.0, w.stride.1],
            "padding": w.padding.to_json(),
        }))
    }

    /// The winners' indices, a u32 per output.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory { kept_per_sample: (shapes.output.numel() as u64).saturating_mul(4), ..LayerMemory::NONE })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (n, c, g) = self.geometry(input)?;
        Ok(Shape::new([n, c, g.oh, g.ow]))
    }

    // x: (N, C, H, W) → y: (N, C, OH, OW)
    fn forward(&mut self, x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (n, c, g) = self.geometry(x.shape())?;
        let ohw = g.oh * g.ow;
        let mut y = vec![0.0f32; n * c * ohw];
        let mut argmax = vec![0u32; n * c * ohw];
        cpu::maxpool2d_forward(x.host(), &g, &mut y, &mut argmax);
        self.cache = (ctx.mode == Mode::Train).then(|| (x.shape().clone(), argmax));
        Tensor::from_vec_on(y, [n, c, g.oh, g.ow], x.device())
    }

    // dout: (N, C, OH, OW) → dx: (N, C, H, W), dout routed to each window's winner
    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let (shape, argmax) = self
            .cache
            .take()
            .ok_or_else(|| Error::config("MaxPool2d backward", "no training forward to differentiate"))?;
        let (n, c, g) = self.geometry(&shape)?;
        if dout.shape().dims() != [n, c, g.oh, g.ow] {
            return Err(Error::shape(
                "MaxPool2d backward",
                format!("dout {} for output ({n}, {c}, {}, {})", dout.shape(), g.oh, g.ow),
            ));
        }
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        let mut dx = vec![0.0f32; n * c * g.h * g.w];
        cpu::maxpool2d_backward(dout.host(), &argmax, &g, &mut dx);
        Tensor::from_vec_on(dx, shape, dout.device()).map(Some)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(MaxPool2d { window: self.window, cache: None })
    }

    fn describe(&self) -> String {
        format!("MaxPool2d({})", self.window.describe())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tensor::Device;

    /// The layer's forward in training mode, then its backward of `dout`: (y, dx).
    fn run(pool: &mut MaxPool2d, x: Vec<f32>, dims: [usize; 4], dout: Vec<f32>) -> (Tensor, Vec<f32>) {
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let x = Tensor::from_vec(x, dims).unwrap();
        let y = pool.forward(x, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let d = Tensor::from_vec(dout, y.shape().clone()).unwrap();
        let dx = pool.backward(d, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx);
        (y, dx.unwrap().unwrap().into_vec())
    }

    #[test]
    fn overlapping_windows_route_every_dout_to_its_winner_and_add_up() {
        // x: (1, 1, 5, 5); pool 3, stride 2, valid: OH = OW = ⌊(5 − 3)/2⌋ + 1 = 2.
        #[rustfmt::skip]
        let x = vec![
            1.0, 2.0, 3.0, 2.0, 1.0,
            0.0, 9.0, 0.0, 0.0, 4.0,
            5.0, 0.0, 9.0, 0.0, 4.0,
            0.0, 0.0, 0.0, 9.0, 0.0,
            7.0, 0.0, 0.0, 0.0, 8.0,
        ];
        // Windows (rows × columns) and their winners, the first maximum in row-major order:
        //   (0, 0): rows 0..3 × cols 0..3, the 9s at (1, 1) and (2, 2) → (1, 1), index 6;
        //   (0, 1): rows 0..3 × cols 2..5, one 9 at (2, 2) → index 12;
        //   (1, 0): rows 2..5 × cols 0..3, one 9 at (2, 2) → index 12;
        //   (1, 1): rows 2..5 × cols 2..5, the 9s at (2, 2) and (3, 3) → (2, 2), index 12.
        let mut pool = MaxPool2d::new((3, 3), (2, 2), Padding::Valid).unwrap();
        let (y, dx) = run(&mut pool, x, [1, 1, 5, 5], vec![1.0, 2.0, 4.0, 8.0]);
        assert_eq!(y.shape().dims(), [1, 1, 2, 2]);
        assert_eq!(y.host(), [9.0, 9.0, 9.0, 9.0]);
        // dx[6] = dout(0, 0) = 1; dx[12] = 2 + 4 + 8 = 14 (it won three windows); the 9 at
        // (3, 3), index 18, lost its only window's tie: 0. Everything else never won: 0.
        let mut want = vec![0.0; 25];
        (want[6], want[12]) = (1.0, 14.0);
        assert_eq!(dx, want);
    }

    #[test]
    fn same_padding_pads_bottom_and_right_and_a_padded_position_never_wins() {
        // x: (1, 2, 3, 4), every value negative, so a padded 0 would win if it competed.
        // Pool (2, 2), strides (2, 1), same: OH = ⌈3/2⌉ = 2, pad_total = (2 − 1)·2 + 2 − 3 = 1
        // → 0 on top, 1 at the bottom; OW = ⌈4/1⌉ = 4, pad_total = 3 + 2 − 4 = 1 → 0 left,
        // 1 right. So the last output row sees input row 2 only, the last column input
        // column 3 only.
        let x: Vec<f32> = (1..=24).map(|v| -(v as f32)).collect();
        let mut pool = MaxPool2d::new((2, 2), (2, 1), Padding::Same).unwrap();
        let dout: Vec<f32> = (1..=16).map(|v| v as f32).collect();
        let (y, dx) = run(&mut pool, x, [1, 2, 3, 4], dout);
        assert_eq!(y.shape().dims(), [1, 2, 2, 4]);
        // Channel 0 is −[[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]: each window's
        // maximum is its top-left value, −1, −2, −3, −4 on rows 0..2 and −9, −10, −11, −12
        // on row 2 alone. Channel 1 is the same minus 12.
        #[rustfmt::skip]
        let want_y = [
            -1.0, -2.0, -3.0, -4.0, -9.0, -10.0, -11.0, -12.0,
            -13.0, -14.0, -15.0, -16.0, -21.0, -22.0, -23.0, -24.0,
        ];
        assert_eq!(y.host(), want_y);
        // Each output won at a distinct input (its window's top-left), so dx there is that
        // output's dout: row 0 gets dout 1..4, row 2 gets 5..8, row 1 never wins.
        #[rustfmt::skip]
        let want_dx = [
            1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 5.0, 6.0, 7.0, 8.0,
            9.0, 10.0, 11.0, 12.0, 0.0, 0.0, 0.0, 0.0, 13.0, 14.0, 15.0, 16.0,
        ];
        assert_eq!(dx, want_dx);
    }

    #[test]
    fn a_nan_propagates_forward_and_takes_the_gradient() {
        // x: (1, 1, 2, 4), pool 2: windows [1, NaN, 3, 2] and [5, NaN, NaN, 8] (row-major).
        // The first has one NaN (index 1); the second two, at indices 3 and 7: the last
        // wins (PyTorch's `val > max || isnan(val)` replaces a NaN by a later NaN).
        let nan = f32::NAN;
        let x = vec![1.0, nan, 5.0, nan, 3.0, 2.0, nan, 8.0];
        let mut pool = MaxPool2d::new((2, 2), (2, 2), Padding::Valid).unwrap();
        let (y, dx) = run(&mut pool, x, [1, 1, 2, 4], vec![10.0, 20.0]);
        assert!(y.host().iter().all(|v| v.is_nan()), "{:?}", y.host());
        assert_eq!(dx, [0.0, 10.0, 0.0, 0.0, 0.0, 0.0, 20.0, 0.0]);
    }

    #[test]
    fn an_eval_forward_leaves_nothing_to_differentiate() {
        let mut pool = MaxPool2d::new((2, 2), (2, 2), Padding::Valid).unwrap();
        let x = Tensor::from_vec(vec![1.0; 4], [1, 1, 2, 2]).unwrap();
        let ctx = Ctx::eval(Device::Cpu(0));
        let y = pool.forward(x, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let e = pool.backward(y, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx);
        assert!(e.unwrap_err().to_string().contains("no training forward"));
        assert!(MaxPool2d::new((0, 2), (1, 1), Padding::Valid).is_err());
        assert!(MaxPool2d::new((2, 2), (1, 0), Padding::Same).is_err());
    }
}
