//! Softmax over the last dimension, Keras's `Softmax(axis=-1)` and PyTorch's
//! `nn.Softmax(dim=-1)`: the layer (its spec entry `softmax`, its spec form, what it keeps
//! for backward: its output), built on its CPU forward and backward ([`cpu`], which states
//! the order of every sum); its GPU form is [`gpu`] (kernels/softmax.cu). Attention weighs
//! its values with it; a classifier's last softmax belongs to the loss instead
//! (`ops::cross_entropy` takes logits).
//!
//! The input is (N, ..., C): every run of C values along the last dimension is a ROW,
//! y = e^(x − max) / Σ e^(x − max); dx = y·(dy − Σ dy·y) per row.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{Build, LayerType};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut, F32};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// Softmax of each row along the last dimension.
#[derive(Clone, Debug, Default)]
pub struct Softmax {
    /// y: (N, ..., C) from the training forward, and its shape.
    y: Vec<f32>,
    cached: Option<Shape>,
}

impl Softmax {
    pub fn new() -> Softmax {
        Softmax::default()
    }

    /// The spec entry: Keras's `Softmax(axis=-1)`.
    pub const SPEC: LayerType = LayerType {
        name: "softmax",
        fields: "`axis` (-1, the last: the only one)",
        example: (&[2, 5], r#"{"type": "softmax"}"#),
        parse: |f| {
            f.last_axis()?;
            Ok(Build::layer(|input| match input.dims() {
                [_, .., _] => Ok(Softmax::new()),
                _ => Err(format!("expects samples with a last dimension, got {input}")),
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

    /// The width C of the last dimension of `shape` (batch included), or why it has none.
    fn width(shape: &Shape, op: &'static str) -> Result<usize> {
        match shape.dims() {
            [_, .., c] => Ok(*c),
            _ => Err(Error::shape(op, format!("expects (N, ..., C), got {shape}"))),
        }
    }
}

impl Layer for Softmax {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "softmax"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "softmax", "axis": -1}))
    }

    /// Its output y, one f32 per value.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory { kept_per_sample: shapes.input.numel() as u64 * F32, ..LayerMemory::NONE })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        Softmax::width(input, "Softmax")?;
        Ok(input.clone())
    }

    // x: (N, ..., C) → y: same shape; training keeps y
    fn forward(&mut self, mut x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let c = Softmax::width(x.shape(), "Softmax")?;
        cpu::softmax_forward(x.host_mut(), c);
        if ctx.mode == Mode::Train {
            self.y.clear();
            self.y.extend_from_slice(x.host());
            self.cached = Some(x.shape().clone());
        }
        Ok(x)
    }

    // dout: (N, ..., C) → dx = y·(dout − Σ dout·y), per row
    fn backward(
        &mut self,
        mut dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let shape = self
            .cached
            .take()
            .ok_or_else(|| Error::config("Softmax backward", "no training forward to differentiate"))?;
        if dout.shape() != &shape {
            return Err(Error::shape("Softmax backward", format!("dout {} for input {shape}", dout.shape())));
        }
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        cpu::softmax_backward(dout.host_mut(), &self.y, Softmax::width(&shape, "Softmax backward")?);
        Ok(Some(dout))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Softmax::new())
    }

    fn describe(&self) -> String {
        "Softmax(last axis)".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tensor::Device;

    /// (y, torch_y, dx, torch_dx) per element of scripts/torch_softmax.py's case (x and dy
    /// (3, 5) by its formulas): float64 evaluation rounded once to f32, then PyTorch's own
    /// float32. Made by the script, whose output this is:
    /// // torch 2.15.0+cu132
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)] // the values as the script prints them, f32's in f64 digits
    const TORCH: &[(f32, f32, f32, f32)] = &[
        (0.00029522512340918183, 0.0002952251525130123, -0.0002115563111146912, -0.00021155632566660643),
        (0.07223920524120331, 0.0722392126917839, -0.006616618018597364, -0.006616618949919939),
        (0.0035965782590210438, 0.003596578724682331, -0.002127711195498705, -0.0021277114283293486),
        (0.880053699016571, 0.8800537586212158, 0.029399802908301353, 0.029399801045656204),
        (0.04381529241800308, 0.04381529614329338, -0.02044391632080078, -0.02044391818344593),
        (0.002457641763612628, 0.0024576419964432716, 0.0015155100263655186, 0.0015155101427808404),
        (0.6013651490211487, 0.6013651490211487, 0.07015051692724228, 0.07015052437782288),
        (0.029940206557512283, 0.029940206557512283, 0.02220521681010723, 0.02220521867275238),
        (0.00149063509888947, 0.001490635215304792, 0.00036021514097228646, 0.0003602151700761169),
        (0.3647463917732239, 0.3647463917732239, -0.09423145651817322, -0.09423145651817322),
        (0.07210320234298706, 0.07210320979356766, -0.006644255015999079, -0.006644256412982941),
        (0.003589807078242302, 0.0035898075439035892, -0.0021257016342133284, -0.002125701867043972),
        (0.8783968687057495, 0.8783969283103943, 0.028856009244918823, 0.028856003656983376),
        (0.04373280331492424, 0.04373280704021454, -0.020429745316505432, -0.02042974904179573),
        (0.0021773281041532755, 0.002177328336983919, 0.0003436929255258292, 0.0003436929255258292),
    ];

    /// y within 6·10⁻⁷ relative of the float64 value (each e within 2 ulp, x − max exact
    /// here, the f64 sum and the division a rounding each: 5 ulp of 2⁻²⁴ ≈ 3·10⁻⁷, doubled
    /// for the sum's weighted errors); dx within 10⁻⁶ relative plus 3·10⁻⁷ (y's error times
    /// |dy − dot|, at most |y|·(|dy| + |dot|) ≤ 0.5 here, where dy − dot cancels). And
    /// within the same bounds of PyTorch's float32, whose own e and sums are as close.
    #[test]
    fn softmax_matches_pytorch() {
        let mut x: Vec<f32> = (0..15).map(|i| ((i * 11 % 17) as f32 - 8.0) / 2.0).collect();
        let mut dx: Vec<f32> = (0..15).map(|i| ((i * 5 % 9) as f32 - 4.0) / 8.0).collect();
        cpu::softmax_forward(&mut x, 5);
        cpu::softmax_backward(&mut dx, &x, 5);
        for (i, &(ey, ty, edx, tdx)) in TORCH.iter().enumerate() {
            for (what, got, want, (rel, abs)) in [
                ("y", x[i], ey, (6e-7, 0.0)),
                ("y vs torch", x[i], ty, (6e-7, 0.0)),
                ("dx", dx[i], edx, (1e-6, 3e-7)),
                ("dx vs torch", dx[i], tdx, (1e-6, 3e-7)),
            ] {
                let bound = rel * want.abs() + abs;
                assert!((got - want).abs() <= bound, "{what}[{i}]: {got}, want {want} (bound {bound:e})");
            }
        }
    }

    #[test]
    fn rows_sum_to_one_large_logits_do_not_overflow_and_a_nan_spoils_only_its_row() {
        // Rows of 40: a lane tail of 8; logits up to ±1000, where e^x alone would overflow.
        let mut x: Vec<f32> = crate::testing::uniform(9, 3 * 40).iter().map(|v| 1000.0 * v).collect();
        x[45] = f32::NAN;
        cpu::softmax_forward(&mut x, 40);
        for (r, row) in x.chunks(40).enumerate() {
            if r == 1 {
                assert!(row.iter().all(|v| v.is_nan()), "the row holding a NaN is NaN");
            } else {
                let sum: f64 = row.iter().map(|&v| v as f64).sum();
                assert!((sum - 1.0).abs() < 1e-6 && row.iter().all(|&v| (0.0..=1.0).contains(&v)), "row {r}: {sum}");
            }
        }
    }

    #[test]
    fn the_spec_entry_reads_keras_fields_and_backward_needs_a_training_forward() {
        use crate::spec::model_from_spec_str;
        let m =
            model_from_spec_str(r#"{"input_shape": [4, 6], "layers": [{"type": "softmax", "axis": -1}]}"#, "m.json")
                .unwrap();
        assert_eq!(m.layer_names(), ["softmax0"]);
        let e = model_from_spec_str(r#"{"input_shape": [6], "layers": [{"type": "softmax", "axis": 0}]}"#, "m.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("field 'axis' must be -1, the last axis"), "{e}");
        let mut s = Softmax::new();
        let ctx = Ctx::eval(Device::Cpu(0));
        let x = Tensor::from_vec(vec![1.0, 2.0], [1, 2]).unwrap();
        let y = s.forward(x, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let e = s.backward(y, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), InputGrad::Needed, &ctx);
        assert!(e.unwrap_err().to_string().contains("no training forward"));
    }
}
