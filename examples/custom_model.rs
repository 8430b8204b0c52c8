//! A model defined in user code: a Sequential of library layers plus a layer written
//! here (LeakyReLU, forward and backward side by side), trained data-parallel on 2 CPU
//! devices on the embedded digits as flat 8×8 vectors.
//!
//! What a custom layer must honour (see `lockstep::nn::Layer`): shapes include the
//! batch; a `Mode::Train` forward may cache what backward needs; backward ACCUMULATES
//! into parameter gradients (this layer has none) and returns the input gradient unless
//! told to skip it; `boxed_clone` gives a fresh copy for each replica.
//!
//! Run: `cargo run --release --example custom_model`

use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::devices::Devices;
use lockstep::nn::{Ctx, InputGrad, Layer, Linear, Mode, Params, ParamsMut, Relu, Sequential};
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

fn main() -> Result<()> {
    let data = load_digits(DigitsLayout::Flat8)?;
    // x: (N, 64) → 64 → 32 → 10
    let model = Sequential::new(
        [64],
        vec![
            Box::new(Linear::new(64, 64)),
            Box::new(LeakyRelu::new(0.1)),
            Box::new(Linear::new(64, 32)),
            Box::new(Relu::new()),
            Box::new(Linear::new(32, 10)),
        ],
    )?;
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
