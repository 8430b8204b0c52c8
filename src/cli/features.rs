//! The flags of the step's features — gradient accumulation, synchronized BatchNorm,
//! 16-bit gradients, the sharded optimiser — which `train` and `bench step` share, and
//! what they make of a model and a configuration. One definition, so that a benchmark
//! runs exactly the step a training run with the same flags would.

use super::*;

#[derive(Args, Clone, Debug)]
pub(crate) struct FeatureArgs {
    /// Gradient accumulation (PyTorch's no_sync): the global batch of a step is processed
    /// as K micro-batches one after another (each logical shard cut into K), gradients
    /// summed in place; one exchange and one update per step. Activation memory about ÷ K.
    #[arg(long, value_name = "K", default_value_t = 1)]
    pub(crate) accumulate: usize,
    /// Normalise with the statistics of the whole global batch, across every replica
    /// (PyTorch's SyncBatchNorm.convert_sync_batchnorm); one logical replica per device.
    #[arg(long)]
    pub(crate) sync_batchnorm: bool,
    /// How gradients travel between the replicas: f32, or 16-bit values summed in f32.
    #[arg(long, value_enum, default_value = "none")]
    pub(crate) grad_compression: CompressionName,
    /// ZeRO stage 1: each device keeps the optimiser state (Adam's m and v, SGD's
    /// momentum) of its part of the parameters only; the same weights, bitwise.
    #[arg(long)]
    pub(crate) shard_optimizer: bool,
}

impl FeatureArgs {
    /// `model`, its BatchNorm layers synchronized when `--sync-batchnorm` asks.
    pub(crate) fn model(&self, model: Graph) -> crate::Result<Graph> {
        if self.sync_batchnorm {
            crate::nn::convert_sync_batchnorm(&model)
        } else {
            Ok(model)
        }
    }

    /// `config` with these features.
    pub(crate) fn config(&self, config: TrainConfig) -> TrainConfig {
        TrainConfig {
            accumulate: self.accumulate,
            grad_compression: self.grad_compression.compression(),
            optimizer_sharding: if self.shard_optimizer { Sharding::Sharded } else { Sharding::Replicated },
            ..config
        }
    }

    /// The features in use, in words (none: empty).
    pub(crate) fn described(&self) -> Vec<String> {
        let mut parts = Vec::new();
        if self.accumulate > 1 {
            parts.push(format!("accumulate {} micro-batches per step", self.accumulate));
        }
        if self.sync_batchnorm {
            parts.push("synchronized BatchNorm".to_string());
        }
        if self.grad_compression != CompressionName::None {
            parts.push(format!("gradients travel as {}", self.grad_compression.compression().name()));
        }
        if self.shard_optimizer {
            parts.push("optimiser state sharded across devices (ZeRO-1)".to_string());
        }
        parts
    }
}
