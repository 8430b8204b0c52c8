//! A model defined in user code: a graph of library layers and two layers written here,
//! forward and backward side by side — a LeakyReLU (one input) and a gated skip
//! connection (a merge of two inputs with a trained gate, `y = a + g·b`) — written node by
//! node and trained data-parallel on 2 CPU devices on the embedded digits as flat 8×8
//! vectors.
//!
//! What a custom layer must honour (see `lockstep::nn::Layer`): shapes include the
//! batch; a `Mode::Train` forward may cache what backward needs; backward ACCUMULATES
//! into parameter gradients and returns the input gradient unless told to skip it;
//! `boxed_clone` gives a fresh copy for each replica. A merge says how many inputs it
//! takes (`arity`) and implements the `_many` forms; its one-input forms refuse.
//!
//! Run: `cargo run --release --example custom_model`

use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::devices::Devices;
use lockstep::nn::{
    merge_takes_several, Arity, Call, Ctx, Init, InputGrad, Layer, Linear, Mode, ParamSpec, Params, ParamsMut, Relu,
    Value,
};
use lockstep::optim::OptimizerConfig;
use lockstep::train::{train_data_parallel, TrainConfig};
use lockstep::{Error, Result, Shape, Tensor};

/// y = x for x > 0, slope·x otherwise.
#[derive(Clone, Debug)]
struct LeakyRelu {
    slope: f32,
    /// Which inputs were positive, from the training forward. (any shape, flattened)
    positive: Vec<bool>,
}

impl LeakyRelu {
    fn new(slope: f32) -> LeakyRelu {
        LeakyRelu { slope, positive: Vec::new() }
    }
}

impl Layer for LeakyRelu {
    fn kind(&self) -> &'static str {
        "leaky_relu"
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        Ok(input.clone())
    }

    // x: any shape → y: same shape
    fn forward(&mut self, mut x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        if ctx.mode == Mode::Train {
            self.positive.clear();
            self.positive.extend(x.host().iter().map(|&v| v > 0.0));
        }
        for v in x.host_mut() {
            if *v <= 0.0 {
                *v *= self.slope;
            }
        }
        Ok(x)
    }

    // dout: same shape as forward's output → dx = dout · (1 or slope)
    fn backward(
        &mut self,
        mut dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        if dout.numel() != self.positive.len() {
            return Err(Error::shape(
                "LeakyRelu backward",
                format!("dout {} for {} cached inputs", dout.shape(), self.positive.len()),
            ));
        }
        for (d, &p) in dout.host_mut().iter_mut().zip(&self.positive) {
            if !p {
                *d *= self.slope;
            }
        }
        Ok(Some(dout))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(LeakyRelu::new(self.slope))
    }

    fn describe(&self) -> String {
        format!("LeakyReLU({})", self.slope)
    }
}

/// y = a + g·b for two inputs of one shape, the gate g a trained scalar starting at 0
/// (the skip path alone at first).
#[derive(Clone, Debug, Default)]
struct GatedSum {
    /// b from the training forward, for the gate's gradient. (any shape, flattened)
    b: Vec<f32>,
}

impl Layer for GatedSum {
    fn kind(&self) -> &'static str {
        "gated_sum"
    }

    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }

    fn params(&self) -> Vec<ParamSpec> {
        vec![ParamSpec { name: "gate".into(), shape: Shape::new([1]), init: Init::Zeros }]
    }

    fn output_shape_many(&self, inputs: &[Shape]) -> Result<Shape> {
        match inputs {
            [a, b] if a == b => Ok(a.clone()),
            _ => Err(Error::shape("GatedSum", format!("its two inputs must agree, got {inputs:?}"))),
        }
    }

    // a, b: same shape → y = a + g·b
    fn forward_many(&mut self, xs: Vec<Tensor>, p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let [mut a, b]: [Tensor; 2] = xs.try_into().map_err(|_| Error::shape("GatedSum", "two inputs"))?;
        let g = p.get(0)[0];
        for (y, &b) in a.host_mut().iter_mut().zip(b.host()) {
            *y += g * b;
        }
        if ctx.mode == Mode::Train {
            self.b = b.host().to_vec();
        }
        Ok(a)
    }

    // dout → da = dout, db = g·dout; dg += Σ dout·b
    fn backward_many(
        &mut self,
        dout: Tensor,
        p: Params<'_>,
        mut dp: ParamsMut<'_>,
        input_grads: &[InputGrad],
        _ctx: &Ctx,
    ) -> Result<Vec<Option<Tensor>>> {
        if dout.numel() != self.b.len() {
            return Err(Error::shape(
                "GatedSum backward",
                format!("dout {} for {} cached", dout.shape(), self.b.len()),
            ));
        }
        let g = p.get(0)[0];
        dp.get(0)[0] += dout.host().iter().zip(&self.b).map(|(d, b)| d * b).sum::<f32>();
        let mut db = dout.clone();
        db.host_mut().iter_mut().for_each(|d| *d *= g);
        let keep = |t: Tensor, need: InputGrad| (need == InputGrad::Needed).then_some(t);
        Ok(vec![keep(dout, input_grads[0]), keep(db, input_grads[1])])
    }

    fn output_shape(&self, _: &Shape) -> Result<Shape> {
        merge_takes_several("GatedSum", self.arity())
    }

    fn forward(&mut self, _: Tensor, _: Params<'_>, _: ParamsMut<'_>, _: &Ctx) -> Result<Tensor> {
        merge_takes_several("GatedSum", self.arity())
    }

    fn backward(
        &mut self,
        _: Tensor,
        _: Params<'_>,
        _: ParamsMut<'_>,
        _: InputGrad,
        _: &Ctx,
    ) -> Result<Option<Tensor>> {
        merge_takes_several("GatedSum", self.arity())
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(GatedSum::default())
    }

    fn describe(&self) -> String {
        "GatedSum".into()
    }
}

fn main() -> Result<()> {
    let data = load_digits(DigitsLayout::Flat8)?;
    // x: (N, 64) → dense 64, LeakyReLU → h; y = h + g·relu(dense(h)) → dense 10
    let x = Value::input([64]);
    let h = LeakyRelu::new(0.1).call(&Linear::new(64, 64).call(&x));
    let branch = Relu::new().call(&Linear::new(64, 64).call(&h));
    let y = GatedSum::default().call_many(&[&h, &branch]);
    let model = Linear::new(64, 10).call(&y).model()?;
    print!("{}", model.summary());
    let devices = Devices::cpu(2, 1)?;
    let config = TrainConfig {
        epochs: 15,
        batch_size: 32,
        optimizer: OptimizerConfig::adam(3e-3),
        check_replicas_every: Some(10),
        ..TrainConfig::default()
    };
    let report = train_data_parallel(&model, &data.train, data.test.as_ref(), &devices, &config)?;
    let last = report.epochs.last().expect("at least one epoch");
    println!(
        "{} steps on {devices}: train accuracy {:.4}, test accuracy {:.4}",
        report.steps,
        last.train.accuracy(),
        last.test.map_or(f64::NAN, |t| t.accuracy())
    );
    Ok(())
}
