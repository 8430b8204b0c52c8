//! The Keras guide "Multi-GPU distributed training with PyTorch": its MNIST convnet
//! (Conv–BN–ReLU ×3, global average pooling, Dense 256, Dropout 0.5, Dense 10), Adam
//! lr 1e-3, trained data-parallel on every device lockstep finds (`DeviceSpec::Auto`:
//! the GPUs, else the CPU), on the embedded handwritten digits resized to 28×28 (no
//! download; see data/digits/README.md).
//!
//! Run: `cargo run --release --example mnist_convnet [EPOCHS]`

use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::devices::DeviceSpec;
use lockstep::models::{self, ConvnetOptions};
use lockstep::optim::OptimizerConfig;
use lockstep::train::{train_data_parallel_with, EpochReport, Observer, TrainConfig};

struct EpochLines;

impl Observer for EpochLines {
    fn on_epoch(&mut self, e: &EpochReport) {
        let test =
            e.test.map_or(String::new(), |t| format!(" | test loss {:.4} acc {:.4}", t.mean_loss(), t.accuracy()));
        println!(
            "epoch {}/{} | train loss {:.4} acc {:.4}{test} | {:.0} samples/s",
            e.epoch + 1,
            e.epochs,
            e.train.mean_loss(),
            e.train.accuracy(),
            e.samples_per_sec
        );
    }
}

fn main() -> lockstep::Result<()> {
    let epochs = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(20);
    let data = load_digits(DigitsLayout::Image28)?;
    let model = models::convnet(ConvnetOptions::default())?;
    let devices = DeviceSpec::Auto.resolve()?;
    println!("convnet, {} parameters, on {devices}", model.param_count());
    let config =
        TrainConfig { epochs, batch_size: 16, optimizer: OptimizerConfig::adam(1e-3), ..TrainConfig::default() };
    let report = train_data_parallel_with(&model, &data.train, data.test.as_ref(), &devices, &config, &mut EpochLines)?;
    if let Some(test) = report.epochs.last().and_then(|e| e.test) {
        println!("test accuracy {:.4} ({}/{})", test.accuracy(), test.correct, test.count);
    }
    Ok(())
}
