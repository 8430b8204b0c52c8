//! Linear (Keras Dense): y = x·Wᵀ + b, weight (O, F) as in PyTorch, over the last
//! dimension of flat samples (F) or of sequences (T, F) (every position one row of the
//! same GEMM). The layer (its spec entry `dense`, its spec form, what it keeps for
//! backward: its input), built on its CPU forward and backward ([`cpu`]); its GPU form is
//! [`gpu`] (cuBLAS's products and kernels/linear.cu's bias). Its weight may be another
//! layer's tensor (`tied_to`: a language model's head reusing the token embedding, as
//! nanoGPT's `lm_head`), laid out once by `Sequential`, whose gradient both uses add to in
//! the backward's order.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{expect_features, Build, LayerType};
use super::{InputGrad, Layer, LayerMemory, LayerShapes, ParamSpec, Params, ParamsMut, F32};
use crate::backend::cpu::gemm_packing;
use crate::error::{Error, Result};
use crate::nn::{Ctx, Init, Mode};
use crate::tensor::{Shape, Tensor};

/// A fully connected layer.
#[derive(Clone, Debug)]
pub struct Linear {
    in_features: usize,
    out_features: usize,
    use_bias: bool,
    /// How the weight starts (Glorot-uniform, Keras's default, unless set).
    init: Init,
    /// The full name of an earlier tensor this layer's weight is (`Sequential` lays the
    /// two out as one), or None: a weight of its own.
    tied_to: Option<String>,
    /// x: (N, [T,] F), kept from the training forward for dweight.
    x: Option<Tensor>,
}

impl Linear {
    /// `in_features → out_features`, with a bias.
    pub fn new(in_features: usize, out_features: usize) -> Linear {
        let init = Init::GlorotUniform { fan_in: in_features, fan_out: out_features };
        Linear { in_features, out_features, use_bias: true, init, tied_to: None, x: None }
    }

    /// The same layer with its weight started by `init` (nanoGPT's `Init::Normal`).
    pub fn with_init(mut self, init: Init) -> Linear {
        self.init = init;
        self
    }

    /// The same layer whose weight is the earlier tensor `tensor` (its full name,
    /// `transformer.wte.weight`), of the same (O, F) shape: PyTorch's
    /// `lm_head.weight = wte.weight`.
    pub fn tied_to(mut self, tensor: impl Into<String>) -> Linear {
        self.tied_to = Some(tensor.into());
        self
    }

    /// The (rows, features) of an input (N, [T,] F): every position is a row.
    fn rows(&self, x: &Shape) -> usize {
        x.numel() / self.in_features
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
        fields: "`units`, `use_bias` (true), `activation` (\"linear\"), `init_std` (none: Glorot-uniform; else normal(0, std²)), `tied_to` (none; an earlier tensor's name: the weight is that tensor)",
        example: (&[3, 5], r#"{"type": "dense", "units": 4, "use_bias": false, "activation": "relu", "init_std": 0.02}"#),
        parse: |f| {
            let units = f.size("units", None)?;
            let use_bias = f.boolean("use_bias", true)?;
            let activation = f.activation()?;
            let init_std = f.optional_positive("init_std")?;
            let tied_to = f.optional_text("tied_to")?;
            Ok(Build::layers(move |input| {
                let mut dense = Linear::new(expect_features(input)?, units);
                if let Some(std) = init_std {
                    dense = dense.with_init(Init::Normal { std });
                }
                if let Some(t) = &tied_to {
                    dense = dense.tied_to(t.clone());
                }
                Ok(activation.after(Box::new(if use_bias { dense } else { dense.without_bias() })))
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

impl Layer for Linear {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn tied(&self) -> Vec<(usize, String)> {
        self.tied_to.iter().map(|t| (0, t.clone())).collect()
    }

    fn kind(&self) -> &'static str {
        "dense"
    }

    fn spec(&self) -> Option<Value> {
        let mut v = json!({"type": "dense", "units": self.out_features, "use_bias": self.use_bias});
        if let Init::Normal { std } = self.init {
            v["init_std"] = json!(std);
        }
        if let Some(t) = &self.tied_to {
            v["tied_to"] = json!(t);
        }
        Some(v)
    }

    /// Its input, for dweight; and its products' packing: y = x·Wᵀ (rows × F by F × O),
    /// dW = dyᵀ·x (O × rows by rows × F) and dx = dy·W (rows × O by O × F), the rows any
    /// number (`gemm_packing` bounds them).
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let (f, o, rows) = (self.in_features, self.out_features, usize::MAX);
        let gemm = [(rows, o, f), (o, f, rows), (rows, f, o)].map(|(m, n, k)| gemm_packing(m, n, k));
        Some(LayerMemory {
            kept_per_sample: (shapes.input.numel() as u64).saturating_mul(F32),
            gemm: gemm.into_iter().max().unwrap_or(0),
            ..LayerMemory::NONE
        })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let f = match input.dims() {
            [_, f] | [_, _, f] => *f,
            _ => return Err(Error::shape("Linear", format!("expected (N, F) or (N, T, F), got {input}"))),
        };
        if f != self.in_features {
            return Err(Error::shape("Linear", format!("expected {} input features, got {input}", self.in_features)));
        }
        let mut out = input.dims().to_vec();
        *out.last_mut().expect("two or three dimensions") = self.out_features;
        Ok(Shape::new(out))
    }

    fn params(&self) -> Vec<ParamSpec> {
        let (f, o) = (self.in_features, self.out_features);
        let mut p = vec![ParamSpec { name: "weight".into(), shape: Shape::new([o, f]), init: self.init }];
        if self.use_bias {
            p.push(ParamSpec { name: "bias".into(), shape: Shape::new([o]), init: Init::Zeros });
        }
        p
    }

    // x: (N, [T,] F) → y: (N, [T,] O), n the rows (every position)
    fn forward(&mut self, x: Tensor, params: Params<'_>, _buffers: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let out_shape = self.output_shape(x.shape())?;
        let (n, f, o) = (self.rows(x.shape()), self.in_features, self.out_features);
        let bias = self.use_bias.then(|| params.get(1));
        let y = cpu::linear_forward(x.host(), params.get(0), bias, n, f, o);
        let y = Tensor::from_vec_on(y, out_shape, x.device())?;
        self.x = (ctx.mode == Mode::Train).then_some(x);
        Ok(y)
    }

    // dout: (n, O) rows → dx: (n, F); dweight (O, F) += doutᵀ·x; dbias (O) += Σ_n dout
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
        let (n, f, o) = (self.rows(x.shape()), self.in_features, self.out_features);
        if dout.shape() != &self.output_shape(x.shape())? {
            return Err(Error::shape("Linear backward", format!("dout {} for input {}", dout.shape(), x.shape())));
        }
        let (dweight, dbias) = match self.use_bias {
            true => {
                let (dw, db) = dparams.pair(0, 1);
                (dw, Some(db))
            }
            false => (dparams.get(0), None),
        };
        let want_dx = input_grad == InputGrad::Needed;
        match cpu::linear_backward(dout.host(), x.host(), params.get(0), dweight, dbias, want_dx, n, f, o) {
            Some(dx) => Ok(Some(Tensor::from_vec_on(dx, x.shape().clone(), x.device())?)),
            None => Ok(None),
        }
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Linear { x: None, ..self.clone() })
    }

    fn describe(&self) -> String {
        let tied = self.tied_to.as_ref().map_or(String::new(), |t| format!(", tied to {t}"));
        format!(
            "Dense({}→{}{}{tied})",
            self.in_features,
            self.out_features,
            if self.use_bias { "" } else { ", no bias" }
        )
    }
}
