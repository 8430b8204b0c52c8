//! Nearest upsampling by integer factors, Keras's `UpSampling2D(size, interpolation=
//! "nearest")` and PyTorch's `nn.Upsample(scale_factor, mode="nearest")`: every value of an
//! NCHW tensor repeated into an SH×SW block. The layer (its spec entry `up_sampling2d`, its
//! spec form, its memory account: nothing kept), built on its CPU forward and backward
//! ([`cpu`]); its GPU form is [`gpu`] (kernels/upsample.cu). A U-Net's decoder grows its
//! maps back with it.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{expect_images, Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// Nearest upsampling of the spatial dimensions by (SH, SW).
#[derive(Clone, Debug)]
pub struct Upsample2d {
    size: (usize, usize),
    /// From the training forward: x's shape (N, C, H, W).
    cached: Option<Shape>,
}

impl Upsample2d {
    /// Blocks of `size` (SH, SW), both positive (Keras's default `(2, 2)`).
    pub fn new(size: (usize, usize)) -> Result<Upsample2d> {
        if size.0 == 0 || size.1 == 0 {
            return Err(Error::config("Upsample2d", format!("the size must be positive (got {size:?})")));
        }
        Ok(Upsample2d { size, cached: None })
    }

    /// The factors (SH, SW).
    pub fn size(&self) -> (usize, usize) {
        self.size
    }

    /// The spec entry: Keras's `UpSampling2D(size=(2, 2), interpolation="nearest")`.
    pub const SPEC: LayerType = LayerType {
        name: "up_sampling2d",
        fields: "`size` (2; int or [sh, sw]), `interpolation` (\"nearest\", the only one)",
        example: (&[2, 3, 4], r#"{"type": "up_sampling2d", "size": [2, 3]}"#),
        parse: |f| {
            let size = f.pair("size", Some((2, 2)))?;
            f.choice("interpolation", &["nearest"], |s| s)?;
            Ok(Build::layer(move |input| {
                expect_images(input)?;
                Upsample2d::new(size).map_err(|e| e.to_string())
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
}

impl Layer for Upsample2d {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "upsample"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "up_sampling2d", "size": [self.size.0, self.size.1], "interpolation": "nearest"}))
    }

    /// Nothing kept: the backward needs only the shapes.
    fn memory(&self, _shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory::NONE)
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (n, c, h, w) = input.nchw("Upsample2d")?;
        Ok(Shape::new([n, c, h * self.size.0, w * self.size.1]))
    }

    // x: (N, C, H, W) → y: (N, C, H·SH, W·SW)
    fn forward(&mut self, x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (n, c, h, w) = x.shape().nchw("Upsample2d")?;
        let (sh, sw) = self.size;
        let mut y = vec![0.0f32; x.numel() * sh * sw];
        cpu::upsample_forward(x.host(), (h, w), self.size, &mut y);
        self.cached = (ctx.mode == Mode::Train).then(|| x.shape().clone());
        Tensor::from_vec_on(y, [n, c, h * sh, w * sw], x.device())
    }

    // dout: (N, C, H·SH, W·SW) → dx: (N, C, H, W), each block of dout summed
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
            .ok_or_else(|| Error::config("Upsample2d backward", "no training forward to differentiate"))?;
        let want = self.output_shape(&shape)?;
        if dout.shape() != &want {
            return Err(Error::shape("Upsample2d backward", format!("dout {} for output {want}", dout.shape())));
        }
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        let (_, _, h, w) = shape.nchw("Upsample2d")?;
        let mut dx = vec![0.0f32; shape.numel()];
        cpu::upsample_backward(dout.host(), (h, w), self.size, &mut dx);
        Tensor::from_vec_on(dx, shape, dout.device()).map(Some)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Upsample2d { size: self.size, cached: None })
    }

    fn describe(&self) -> String {
        format!("Upsample2d({}x{}, nearest)", self.size.0, self.size.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tensor::Device;

    /// The output of scripts/torch_upsample.py (x: (1, 1, 2, 3), scale (2, 3), dy by the
    /// script's formula): y and dx in float32, exact (copies, and sums of eighths).
    #[rustfmt::skip]
    mod torch {
        // made by torch 2.15.0+cu132
        pub const Y: &[f32] = &[
            -0.75, -0.75, -0.75, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0,
            -0.75, -0.75, -0.75, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0,
            -0.5, -0.5, -0.5, 0.75, 0.75, 0.75, 0.25, 0.25, 0.25,
            -0.5, -0.5, -0.5, 0.75, 0.75, 0.75, 0.25, 0.25, 0.25,
        ];
        pub const DX: &[f32] = &[
            0.0, -0.5, -1.0, 0.25, -0.25, 0.875,
        ];
    }

    #[test]
    fn upsample_matches_pytorch_exactly() {
        let x: Vec<f32> = (0..6).map(|i| ((i * 5 % 7) as f32 - 3.0) / 4.0).collect();
        let dy: Vec<f32> = (0..36).map(|j| ((j * 7 % 13) as f32 - 6.0) / 8.0).collect();
        let mut up = Upsample2d::new((2, 3)).unwrap();
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let y = up.forward(
            Tensor::from_vec(x, [1, 1, 2, 3]).unwrap(),
            Params::new(&[], &[]),
            ParamsMut::new(&mut [], &[]),
            &ctx,
        );
        let y = y.unwrap();
        assert_eq!(y.shape().dims(), [1, 1, 4, 9]);
        assert_eq!(y.host(), torch::Y);
        let d = Tensor::from_vec(dy, [1, 1, 4, 9]).unwrap();
        let dx = up.backward(d, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx);
        assert_eq!(dx.unwrap().unwrap().host(), torch::DX);
    }

    #[test]
    fn the_spec_entry_reads_keras_fields_and_refuses_other_interpolations() {
        use crate::spec::model_from_spec_str;
        let m = model_from_spec_str(r#"{"input_shape": [3, 4, 5], "layers": [{"type": "up_sampling2d"}]}"#, "m.json")
            .unwrap();
        assert_eq!(m.layer_names(), ["upsample0"]);
        assert_eq!(m.layers()[0].describe(), "Upsample2d(2x2, nearest)");
        assert_eq!(m.output_shape().dims(), [3, 8, 10]);
        for (input, fields, want) in [
            (
                "[3, 4, 5]",
                r#", "interpolation": "bilinear""#,
                r#"field 'interpolation' must be "nearest" (got "bilinear")"#,
            ),
            ("[3, 4, 5]", r#", "size": [2, 0]"#, "field 'size' must be a positive integer"),
            ("[12]", "", "expects images (C, H, W)"),
        ] {
            let spec = format!(r#"{{"input_shape": {input}, "layers": [{{"type": "up_sampling2d"{fields}}}]}}"#);
            let e = model_from_spec_str(&spec, "m.json").unwrap_err().to_string();
            assert!(e.contains(want), "{fields}: {e}");
        }
    }
}
