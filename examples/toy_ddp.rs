//! The lesson "Training on GPUs", data-parallel: its 2-30-20-2 MLP on its five points,
//! SGD lr 0.5, global batch 2, 3 epochs, on 2 CPU devices (standing in for the lesson's
//! two GPUs under torchrun), printing each replica's shard loss in the lesson's form,
//! then the training and test accuracy — both 1.0, as in the lesson.
//!
//! Run: `cargo run --release --example toy_ddp`

use lockstep::data::toy;
use lockstep::devices::Devices;
use lockstep::models;
use lockstep::optim::OptimizerConfig;
use lockstep::train::{train_data_parallel_with, with_trainer, Observer, StepEvent, TrainConfig};

/// Prints `[cpu:1] Epoch: 001/003 | Batchsize 001 | Train/Val Loss: 0.48` per replica.
struct LessonLines;

impl Observer for LessonLines {
    fn on_step(&mut self, e: &StepEvent<'_>) {
        for s in &e.report.shards {
            // No padding: a shard may get no sample of a short last batch (loss '-').
            let loss = if s.metrics.count == 0 { "-".to_string() } else { format!("{:.2}", s.metrics.mean_loss()) };
            println!(
                "[{}] Epoch: {:03}/{:03} | Batchsize {:03} | Train/Val Loss: {loss}",
                s.device,
                e.epoch + 1,
                e.epochs,
                s.metrics.count
            );
        }
    }
}

fn main() -> lockstep::Result<()> {
    let data = toy::toy();
    let test = data.test.as_ref().expect("the lesson has a test split");
    let model = models::toy_mlp(2, 2)?;
    let devices = Devices::cpu(2, 1)?;
    let config = TrainConfig {
        epochs: 3,
        batch_size: 2,
        optimizer: OptimizerConfig::sgd(0.5),
        check_replicas_every: Some(1),
        ..TrainConfig::default()
    };
    let report = train_data_parallel_with(&model, &data.train, Some(test), &devices, &config, &mut LessonLines)?;

    // The lesson's compute_accuracy on both splits, with the final weights.
    let eval = TrainConfig { initial: Some(report.weights.clone()), ..config.clone() };
    let (train_acc, test_acc) = with_trainer(&model, &devices, &eval, |t| {
        Ok((t.evaluate(&data.train, 512)?.accuracy(), t.evaluate(test, 512)?.accuracy()))
    })?;
    println!("Train Acc {train_acc:.2}");
    println!("Test Acc {test_acc:.2}");
    assert_eq!((train_acc, test_acc), (1.0, 1.0), "the lesson ends with accuracy 1.0 on both splits");
    Ok(())
}
