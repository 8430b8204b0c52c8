//! Linear (Keras Dense): y = x·Wᵀ + b, weight (O, F) as in PyTorch: its forward and
//! backward, its spec entry (`dense`), its spec form and what it keeps for backward.

use serde_json::{json, Value};

use super::gpu::{Backward, Forward, GpuLayer};
use super::spec_entry::{expect_flat, Build, LayerType};
use super::{InputGrad, Layer, LayerMemory, LayerShapes, ParamSpec, Params, ParamsMut, F32};
use crate::backend::cpu::{gemm, Accumulate, Mat};
use crate::cuda::gemm::{gemm as cublas_gemm, RmGemm};
use crate::error::{Error, Result};
use crate::nn::{Ctx, Init, Mode};
use crate::tensor::{Shape, Tensor};

/// A fully connected layer.
#[derive(Clone, Debug)]
pub struct Linear {
    in_features: usize,
    out_features: usize,
    use_bias: bool,
    /// x: (N, F), kept from the training forward for dweight.
    x: Option<Tensor>,
}

impl Linear {
    /// `in_features → out_features`, with a bias.
    pub fn new(in_features: usize, out_features: usize) -> Linear {
        Linear { in_features, out_features, use_bias: true, x: None }
    }

    /// The same layer without a bias.
    pub fn without_bias(mut self) -> Linear {
        self.use_bias = false;
        self
    }

    /// The spec entry: Keras's `Dense(units, use_bias=True, activation=None)`, its input
    /// features those of the running shape.
    pub const SPEC: LayerType = LayerType {
        name: "dense",
        fields: "`units`, `use_bias` (true), `activation` (\"linear\")",
        example: (&[5], r#"{"type": "dense", "units": 4, "use_bias": false, "activation": "relu"}"#),
        parse: |f| {
            let units = f.size("units", None)?;
            let use_bias = f.boolean("use_bias", true)?;
            let activation = f.activation()?;
            Ok(Build::layers(move |input| {
                let dense = Linear::new(expect_flat(input)?, units);
                Ok(activation.after(Box::new(if use_bias { dense } else { dense.without_bias() })))
            }))
        },
    };
}

impl Layer for Linear {
    fn gpu(&self) -> Option<Box<dyn GpuLayer>> {
        Some(Box::new(LinearGpu { f: self.in_features, o: self.out_features, use_bias: self.use_bias }))
    }

    fn kind(&self) -> &'static str {
        "dense"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "dense", "units": self.out_features, "use_bias": self.use_bias}))
    }

    /// Its input, for dweight.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory { kept_per_sample: (shapes.input.numel() as u64).saturating_mul(F32), ..LayerMemory::NONE })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (n, f) = input.nf("Linear")?;
        if f != self.in_features {
            return Err(Error::shape("Linear", format!("expected {} input features, got {input}", self.in_features)));
        }
        Ok(Shape::new([n, self.out_features]))
    }

    fn params(&self) -> Vec<ParamSpec> {
        let (f, o) = (self.in_features, self.out_features);
        let mut p = vec![ParamSpec {
            name: "weight".into(),
            shape: Shape::new([o, f]),
            init: Init::GlorotUniform { fan_in: f, fan_out: o },
        }];
        if self.use_bias {
            p.push(ParamSpec { name: "bias".into(), shape: Shape::new([o]), init: Init::Zeros });
        }
        p
    }

    // x: (N, F) → y: (N, O)
    fn forward(&mut self, x: Tensor, params: Params<'_>, _buffers: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let out_shape = self.output_shape(x.shape())?;
        let (n, f, o) = (x.shape().batch(), self.in_features, self.out_features);
        let w = params.get(0);
        let mut y = vec![0.0f32; n * o];
        if self.use_bias {
            let b = params.get(1);
            for row in y.chunks_exact_mut(o) {
                row.copy_from_slice(b);
            }
        }
        let acc = if self.use_bias { Accumulate::Add } else { Accumulate::Overwrite };
        gemm(Mat::rows(x.host(), n, f), Mat::rows(w, o, f).t(), &mut y, o, acc);
        let y = Tensor::from_vec_on(y, out_shape, x.device())?;
        self.x = (ctx.mode == Mode::Train).then_some(x);
        Ok(y)
    }

    // dout: (N, O) → dx: (N, F); dweight (O, F) += doutᵀ·x; dbias (O) += Σ_n dout
    fn backward(
        &mut self,
        dout: Tensor,
        params: Params<'_>,
        mut dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let x =
            self.x.take().ok_or_else(|| Error::config("Linear backward", "no training forward to differentiate"))?;
        x.same_device("Linear backward", &dout)?;
        let (n, f, o) = (x.shape().batch(), self.in_features, self.out_features);
        if dout.shape().dims() != [n, o] {
            return Err(Error::shape("Linear backward", format!("dout {} for output ({n}, {o})", dout.shape())));
        }
        let d = dout.host();
        gemm(Mat::rows(d, n, o).t(), Mat::rows(x.host(), n, f), dparams.get(0), f, Accumulate::Add);
        if self.use_bias {
            let db = dparams.get(1);
            for row in d.chunks_exact(o) {
                for (g, v) in db.iter_mut().zip(row) {
                    *g += v;
                }
            }
        }
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        let mut dx = vec![0.0f32; n * f];
        gemm(Mat::rows(d, n, o), Mat::rows(params.get(0), o, f), &mut dx, f, Accumulate::Overwrite);
        Ok(Some(Tensor::from_vec_on(dx, x.shape().clone(), x.device())?))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Linear { x: None, ..self.clone() })
    }

    fn describe(&self) -> String {
        format!("Dense({}→{}{})", self.in_features, self.out_features, if self.use_bias { "" } else { ", no bias" })
    }
}

// ---- on a GPU: cuBLAS and kernels/elementwise.cu's bias ------------------------------

/// Linear on a GPU: the three GEMMs of the CPU layer, by cuBLAS, and the bias kernels.
struct LinearGpu {
    f: usize,
    o: usize,
    use_bias: bool,
}

impl GpuLayer for LinearGpu {
    // x: (N, F), weight: (O, F) → y: (N, O)
    fn forward(&mut self, fw: Forward<'_, '_, '_>) -> Result<()> {
        let (n, f, o) = (fw.n, self.f, self.o);
        cublas_gemm(fw.blas, &RmGemm::linear_fwd(n, f, o), fw.x, &fw.param(0), fw.y)?;
        if self.use_bias {
            fw.gpu.bias_cols_fwd(fw.y, &fw.param(1), n, o)?;
        }
        Ok(())
    }

    // dy: (N, O) → dweight += dyᵀ·x (O, F), dbias += Σ_n dy (O), dx = dy·W (N, F)
    fn backward(&mut self, b: Backward<'_, '_>) -> Result<()> {
        let (n, f, o) = (b.n, self.f, self.o);
        let Backward { gpu, blas, node, params, x, dy, dx, grads, .. } = b;
        cublas_gemm(blas, &RmGemm::linear_dw(n, f, o), &dy, x, &mut grads.slice_mut(node.params[0].clone()))?;
        if self.use_bias {
            gpu.bias_cols_bwd(&dy, &mut grads.slice_mut(node.params[1].clone()), n, o)?;
        }
        if let Some(mut dx) = dx {
            cublas_gemm(blas, &RmGemm::linear_dx(n, f, o), &dy, &params.slice(node.params[0].clone()), &mut dx)?;
        }
        Ok(())
    }
}
