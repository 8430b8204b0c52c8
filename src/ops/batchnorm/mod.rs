//! BatchNorm2d with Keras's options: `scale` (a learned γ) and `center` (a learned β).
//!
//! Training normalises with the statistics of the batch the layer sees, over (N, H, W)
//! with the BIASED variance, and updates the running statistics Keras-style,
//! r ← momentum·r + (1 − momentum)·batch, using the UNBIASED variance for `running_var`
//! (PyTorch's convention, which the reference cases follow). Evaluation uses the running
//! statistics. With logical replicas, "the batch the layer sees" is the logical
//! replica's shard, as in DDP without SyncBatchNorm; the trainer then averages the
//! running statistics over the logical replicas so every replica holds the same buffers.
//!
//! Synchronized ([`BatchStats::Global`], Keras's `synchronized=True`, PyTorch's
//! `SyncBatchNorm`, `--sync-batchnorm`): the batch is the global batch of the step, every
//! logical replica's shard together. Forward: each shard's per-channel (count, mean, M2)
//! in f64 (the same Chan et al. merge of planes as the shard statistics), gathered from
//! every logical replica through the context's statistics exchange
//! (`ops::batchnorm::stats`) and merged in logical-replica order with the same pairwise
//! update — as stable as two passes, and the same numbers on every replica, in the same
//! order whoever computed which shard. The running statistics move with the global
//! statistics (the variance unbiased by the global count), so every shard's slot holds
//! the same buffers. Backward: each shard's (Σ dy, Σ dy·x̂) gathered and summed in
//! logical-replica order, in f64; dx uses those global sums over the global count, while
//! dγ, dβ receive the shard's own sums (the gradient exchange adds the shards'). Without
//! an exchange in the context (a lone Sequential, a world of one) a synchronized layer is
//! an ordinary one. Every logical replica makes the same calls: an empty shard sends
//! zeros ([`Synchronized::without_data`], which the training step calls).
//!
//! The arithmetic of both is [`cpu`]'s: plain functions of the pass's buffers, which the
//! layer calls around its statistics exchange. A GPU replica computes its shard's partial
//! statistics on the device, with that arithmetic mirrored operation for operation
//! (kernels/batchnorm.cu, held to it bit for bit by [`gpu`]'s host check), and merges them
//! through [`Synchronized`]: [`cpu`]'s functions, the one implementation of the merges, of
//! the running update ([`cpu::RunningUpdate`]) and of what normalises
//! ([`cpu::normaliser`]).
//!
//! Owns the layer: its spec entry (`batch_normalization`), its spec form, what it keeps for
//! backward, its synchronized twin ([`convert_sync_batchnorm`]) and the list of a model's
//! synchronized layers, found through [`Layer::synchronized_channels`].

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod stats;

use serde_json::{json, Value};

use super::spec::{expect_images, Activation, Build, LayerType};
use super::{Ctx, Init, InputGrad, Layer, LayerMemory, LayerShapes, Mode, ParamSpec, Params, ParamsMut, F32};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};
use cpu::{count_up, global_moments, global_sums};
use stats::StatsExchange;

/// Whose batch statistics normalise in training.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchStats {
    /// The logical replica's shard (DDP's BatchNorm).
    ShardPass,
    /// The step's global batch, across every logical replica (SyncBatchNorm).
    Global,
}

/// Whose names a BatchNorm's tensors carry, with what that brings.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BnNames {
    /// Keras's: `gamma`, `beta`, `running_mean`, `running_var`.
    Keras,
    /// PyTorch's `BatchNorm2d` `state_dict`: `weight`, `bias`, `running_mean`,
    /// `running_var` and `num_batches_tracked`, the count of training forwards (which
    /// every training forward increments; averaged over the logical replicas like the
    /// other buffers, it is rounded back to its integer first).
    PyTorch,
}

impl BnNames {
    /// The spec's name: `keras` or `pytorch`.
    pub fn name(self) -> &'static str {
        match self {
            BnNames::Keras => "keras",
            BnNames::PyTorch => "pytorch",
        }
    }
}

/// Batch normalisation over the channels of NCHW activations.
#[derive(Clone, Debug)]
pub struct BatchNorm2d {
    channels: usize,
    names: BnNames,
    eps: f32,
    momentum: f32,
    scale: bool,
    center: bool,
    stats: BatchStats,
    /// x̂: (N, C, H, W) and 1/sqrt(var + eps): (C), from the training forward. The
    /// vectors keep their capacity from step to step.
    xhat: Vec<f32>,
    invstd: Vec<f32>,
    /// Values per channel the training forward normalised over (the global batch's, for
    /// a synchronized layer).
    count: f64,
    cached: Option<Shape>,
    /// Whether the ReLU after this layer runs in its passes (its Sequential says so:
    /// [`Layer::take_following_relu`]).
    relu: bool,
}

impl BatchNorm2d {
    /// Keras defaults: eps 1e-3, momentum 0.99, `scale` and `center` on.
    pub fn new(channels: usize) -> BatchNorm2d {
        BatchNorm2d {
            channels,
            names: BnNames::Keras,
            eps: 1e-3,
            momentum: 0.99,
            scale: true,
            center: true,
            stats: BatchStats::ShardPass,
            xhat: Vec::new(),
            invstd: Vec::new(),
            count: 0.0,
            cached: None,
            relu: false,
        }
    }

    /// PyTorch's `nn.BatchNorm2d(channels)`: eps 1e-5, momentum 0.1 (Keras's 0.9), its
    /// tensors named as its `state_dict` names them.
    pub fn pytorch(channels: usize) -> BatchNorm2d {
        BatchNorm2d::new(channels).eps(1e-5).momentum(0.9).names(BnNames::PyTorch)
    }

    /// Whose names the tensors carry.
    pub fn names(mut self, names: BnNames) -> Self {
        self.names = names;
        self
    }

    /// Whose batch statistics normalise in training (Keras's `synchronized`).
    pub fn batch_stats(mut self, stats: BatchStats) -> Self {
        self.stats = stats;
        self
    }

    /// Sets eps (added to the variance).
    pub fn eps(mut self, eps: f32) -> Self {
        self.eps = eps;
        self
    }

    /// Sets the Keras momentum (the weight of the old running value).
    pub fn momentum(mut self, momentum: f32) -> Self {
        self.momentum = momentum;
        self
    }

    /// Keras `scale`: learn γ.
    pub fn scale(mut self, on: bool) -> Self {
        self.scale = on;
        self
    }

    /// Keras `center`: learn β.
    pub fn center(mut self, on: bool) -> Self {
        self.center = on;
        self
    }

    /// The spec entry: Keras's `BatchNormalization(scale=True, center=True, epsilon=1e-3,
    /// momentum=0.99, synchronized=False)`, its channels those of the running shape.
    pub const SPEC: LayerType = LayerType {
        name: "batch_normalization",
        fields: "`scale` (true), `center` (true), `epsilon` (0.001), `momentum` (0.99), `synchronized` (false), `names` (\"keras\": gamma, beta; or \"pytorch\": weight, bias, num_batches_tracked)",
        example: (
            &[3, 4, 4],
            r#"{"type": "batch_normalization", "scale": false, "epsilon": 0.01, "momentum": 0.9, "synchronized": true, "names": "pytorch"}"#,
        ),
        parse: |f| {
            let scale = f.boolean("scale", true)?;
            let center = f.boolean("center", true)?;
            let epsilon = f.number("epsilon", Some(1e-3), (|x| x > 0.0, "a positive number"))?;
            let momentum = f.number("momentum", Some(0.99), (|x| (0.0..=1.0).contains(&x), "a number in [0, 1]"))?;
            let stats = if f.boolean("synchronized", false)? { BatchStats::Global } else { BatchStats::ShardPass };
            let names = f.choice("names", &[BnNames::Keras, BnNames::PyTorch], BnNames::name)?;
            Ok(Build::layer(move |input| {
                let bn = BatchNorm2d::new(expect_images(input)?).scale(scale).center(center).names(names);
                Ok(bn.eps(epsilon).momentum(momentum).batch_stats(stats))
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

    /// What follows the normalisation in the layer's passes: the ReLU after it, where its
    /// Sequential hands it over ([`Layer::take_following_relu`]).
    fn after(&self) -> Activation {
        if self.relu {
            Activation::Relu
        } else {
            Activation::Linear
        }
    }

    fn gamma_beta<'a>(&self, params: &Params<'a>) -> (Option<&'a [f32]>, Option<&'a [f32]>) {
        let gamma = self.scale.then(|| params.get(0));
        let beta = self.center.then(|| params.get(usize::from(self.scale)));
        (gamma, beta)
    }
}

impl Layer for BatchNorm2d {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "bn"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({
            "type": "batch_normalization", "scale": self.scale, "center": self.center, "epsilon": self.eps,
            "momentum": self.momentum, "synchronized": self.stats == BatchStats::Global, "names": self.names.name(),
        }))
    }

    /// Its normalised input x̂, as f32 (the per-channel 1/σ is too small to count).
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory { kept_per_sample: (shapes.output.numel() as u64).saturating_mul(F32), ..LayerMemory::NONE })
    }

    /// The same layer, its statistics the global batch's (a fresh one: no cache).
    fn synchronized(&self) -> Option<Box<dyn Layer>> {
        let bn = BatchNorm2d::new(self.channels).eps(self.eps).momentum(self.momentum).names(self.names);
        Some(Box::new(bn.scale(self.scale).center(self.center).batch_stats(BatchStats::Global)))
    }

    fn synchronized_channels(&self) -> Vec<usize> {
        if self.stats == BatchStats::Global {
            vec![self.channels]
        } else {
            Vec::new()
        }
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        let (_, c, _, _) = input.nchw("BatchNorm2d")?;
        if c != self.channels {
            return Err(Error::shape("BatchNorm2d", format!("expected {} channels, got {input}", self.channels)));
        }
        Ok(input.clone())
    }

    fn params(&self) -> Vec<ParamSpec> {
        let shape = Shape::new([self.channels]);
        let mut p = Vec::new();
        let (gamma, beta) = match self.names {
            BnNames::Keras => ("gamma", "beta"),
            BnNames::PyTorch => ("weight", "bias"),
        };
        if self.scale {
            p.push(ParamSpec { name: gamma.into(), shape: shape.clone(), init: Init::Ones });
        }
        if self.center {
            p.push(ParamSpec { name: beta.into(), shape, init: Init::Zeros });
        }
        p
    }

    fn buffers(&self) -> Vec<ParamSpec> {
        let shape = Shape::new([self.channels]);
        let mut b = vec![
            ParamSpec { name: "running_mean".into(), shape: shape.clone(), init: Init::Zeros },
            ParamSpec { name: "running_var".into(), shape, init: Init::Ones },
        ];
        if self.names == BnNames::PyTorch {
            b.push(ParamSpec { name: "num_batches_tracked".into(), shape: Shape::new([0usize; 0]), init: Init::Count });
        }
        b
    }

    // x: (N, C, H, W) → y: (N, C, H, W)
    fn forward(&mut self, mut x: Tensor, params: Params<'_>, mut buffers: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (n, c, h, w) = x.shape().nchw("BatchNorm2d")?;
        self.output_shape(x.shape())?;
        let hw = h * w;
        let m = n * hw;
        let (gamma, beta) = self.gamma_beta(&params);
        let (mean, invstd): (Vec<f32>, Vec<f32>) = match ctx.mode {
            Mode::Train => {
                let sync = self.stats == BatchStats::Global;
                if m < 2 && !sync {
                    // As PyTorch: one value per channel has no variance to normalise by.
                    return Err(Error::shape(
                        "BatchNorm2d",
                        format!("training needs more than one value per channel, got {}", x.shape()),
                    ));
                }
                let local = cpu::batchnorm_moments(x.host(), n, c, hw);
                let (count, moments) = match (sync, ctx.stats) {
                    (true, Some(ex)) => global_moments(ex, ctx.shard, m as f64, &local)?,
                    _ => (m as f64, local),
                };
                if count < 2.0 {
                    return Err(Error::shape(
                        "BatchNorm2d",
                        format!(
                            "training needs more than one value per channel, got {count} in the global batch ({} here)",
                            x.shape()
                        ),
                    ));
                }
                self.count = count;
                let (rm, rv) = buffers.pair(0, 1);
                let normalisers = cpu::batchnorm_train_stats(count, &moments, self.eps, self.momentum, rm, rv);
                if self.names == BnNames::PyTorch {
                    let tracked = &mut buffers.get(2)[0];
                    *tracked = count_up(*tracked);
                }
                normalisers
            }
            Mode::Eval => {
                let (rm, rv) = buffers.pair(0, 1);
                cpu::batchnorm_eval_stats(rm, rv, self.eps)
            }
        };
        // One pass: x̂ = (x − mean)·invstd (kept for backward in training), y = γ·x̂ + β.
        let after = self.after();
        if ctx.mode == Mode::Train {
            self.xhat.resize(x.numel(), 0.0);
            let xhat = Some(&mut self.xhat[..]);
            cpu::batchnorm_forward(x.host_mut(), xhat, &mean, &invstd, gamma, beta, after, c, hw);
            self.invstd = invstd;
            self.cached = Some(x.shape().clone());
        } else {
            cpu::batchnorm_forward(x.host_mut(), None, &mean, &invstd, gamma, beta, after, c, hw);
        }
        Ok(x)
    }

    // dout: (N, C, H, W) → dx = γ·invstd·(dout − mean(dout) − x̂·mean(dout·x̂));
    // dγ += Σ dout·x̂, dβ += Σ dout (sums over N, H, W)
    fn backward(
        &mut self,
        mut dout: Tensor,
        params: Params<'_>,
        mut dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let shape = self
            .cached
            .take()
            .ok_or_else(|| Error::config("BatchNorm2d backward", "no training forward to differentiate"))?;
        if dout.shape() != &shape {
            return Err(Error::shape("BatchNorm2d backward", format!("dout {} for input {shape}", dout.shape())));
        }
        let (n, c, h, w) = shape.nchw("BatchNorm2d backward")?;
        let hw = h * w;
        let (xhat, ds) = (self.xhat.as_slice(), dout.host());
        let (gamma, beta) = self.gamma_beta(&params);
        let after = self.after();
        let sums = cpu::batchnorm_backward_sums(ds, xhat, gamma, beta, after, n, c, hw);
        let (dgamma, dbeta) = match (self.scale, self.center) {
            (true, true) => {
                let (dg, db) = dparams.pair(0, 1);
                (Some(dg), Some(db))
            }
            (true, false) => (Some(dparams.get(0)), None),
            (false, true) => (None, Some(dparams.get(0))),
            (false, false) => (None, None),
        };
        cpu::batchnorm_param_grads(&sums, dgamma, dbeta);
        // dγ, dβ take the shard's own sums (above); dx needs the global batch's. The
        // exchange is made even when dx is not needed, so every replica calls alike.
        let sums = match (self.stats, ctx.stats) {
            (BatchStats::Global, Some(ex)) => global_sums(ex, ctx.shard, &sums)?,
            _ => sums,
        };
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        let (invstd, count) = (&self.invstd, self.count);
        cpu::batchnorm_input_grad(dout.host_mut(), xhat, &sums, invstd, count, gamma, beta, after, c, hw);
        Ok(Some(dout))
    }

    /// The ReLU after a BatchNorm runs in its passes: one pass of the training forward and
    /// one of the backward fewer over the activations.
    fn take_following_relu(&mut self, follows: bool) -> bool {
        self.relu = follows;
        follows
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(BatchNorm2d { xhat: Vec::new(), invstd: Vec::new(), count: 0.0, cached: None, ..self.clone() })
    }

    fn describe(&self) -> String {
        format!(
            "BatchNorm2d({}, eps {}, momentum {}{}{}{})",
            self.channels,
            self.eps,
            self.momentum,
            if self.scale { ", scale" } else { "" },
            if self.center { ", center" } else { "" },
            if self.stats == BatchStats::Global { ", synchronized" } else { "" }
        )
    }
}

/// Where a logical replica's synchronized BatchNorm layers meet the others', for a
/// backend that computes its shard's partial statistics itself (a GPU replica): the
/// statistics exchange and the logical replica. Its methods are the CPU's own merges
/// ([`cpu::global_moments`], [`cpu::global_sums`]).
#[derive(Clone, Copy, Debug)]
pub struct Synchronized<'a> {
    pub stats: &'a dyn StatsExchange,
    /// The shard: this logical replica's index.
    pub shard: usize,
}

impl Synchronized<'_> {
    /// [`global_moments`] of this shard's `count` values per channel and per-channel
    /// (mean, M2) `local`. (The GPU layer's: the CPU layer calls the exchange itself.)
    #[cfg(feature = "cuda")]
    pub fn moments(&self, count: f64, local: &[(f64, f64)]) -> Result<(f64, Vec<(f64, f64)>)> {
        global_moments(self.stats, self.shard, count, local)
    }

    /// [`global_sums`] of this shard's per-channel (Σ dy, Σ dy·x̂) `local`.
    #[cfg(feature = "cuda")]
    pub fn sums(&self, local: &[(f64, f64)]) -> Result<Vec<(f64, f64)>> {
        global_sums(self.stats, self.shard, local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::Sequential;
    use crate::tensor::Device;

    #[test]
    fn one_value_per_channel_cannot_be_normalised_in_training() {
        let mut m = Sequential::new([2, 1, 1], vec![Box::new(BatchNorm2d::new(2))]).unwrap();
        let mut st = m.init(0);
        let x = Tensor::from_vec(vec![1.0, 2.0], [1, 2, 1, 1]).unwrap();
        let e = m.forward(x.clone(), &st.params, &mut st.buffers, &Ctx::train(0, 0, 0, Device::Cpu(0))).unwrap_err();
        assert!(e.to_string().contains("more than one value per channel"), "{e}");
        // Evaluation uses the running statistics: fine with one value.
        assert!(m.forward(x, &st.params, &mut st.buffers, &Ctx::eval(Device::Cpu(0))).is_ok());
    }

    /// A BatchNorm followed by a ReLU in one Sequential runs the ReLU in its own passes
    /// (the ReLU layer is skipped): the output, the input gradient, the parameters'
    /// gradients and the running statistics are bit for bit those of the two layers one
    /// after the other, in training and in evaluation, with and without γ and β; a NaN
    /// passes the fused ReLU as it passes the layer.
    #[test]
    fn a_relu_after_a_batchnorm_runs_in_its_passes_with_the_same_bits() {
        use crate::nn::Relu;
        let (c, h, w) = (4, 5, 3);
        for (affine, n) in [(true, 3), (false, 3), (true, 1)] {
            let bn = || Box::new(BatchNorm2d::pytorch(c).scale(affine).center(affine)) as Box<dyn Layer>;
            let mut fused = Sequential::new([c, h, w], vec![bn(), Box::new(Relu::new())]).unwrap();
            let mut alone = Sequential::new([c, h, w], vec![bn()]).unwrap();
            let mut relu = Sequential::new([c, h, w], vec![Box::new(Relu::new())]).unwrap();
            let mut g = crate::rng::SplitMix64::new(7);
            let mut st = fused.init(0);
            // γ and β drawn around 0, so that about half of each channel's outputs clamp.
            st.params.iter_mut().for_each(|v| *v = g.next_f32() * 2.0 - 1.0);
            let mut st_alone = st.clone();
            let mut values = |len: usize| (0..len).map(|_| g.next_f32() * 4.0 - 2.0).collect::<Vec<f32>>();
            let x = Tensor::from_vec(values(n * c * h * w), [n, c, h, w]).unwrap();
            let dy = Tensor::from_vec(values(n * c * h * w), [n, c, h, w]).unwrap();
            let train = Ctx::train(0, 0, 0, Device::Cpu(0));
            fused.start_profile();

            let y = fused.forward(x.clone(), &st.params, &mut st.buffers, &train).unwrap();
            let y_alone = alone.forward(x.clone(), &st_alone.params, &mut st_alone.buffers, &train).unwrap();
            let y_alone = relu.forward(y_alone, &[], &mut [], &train).unwrap();
            assert_eq!(y.host(), y_alone.host(), "forward, affine {affine}, n {n}");
            assert!(y.host().contains(&0.0) && y.host().iter().any(|&v| v > 0.0), "some outputs clamp");
            assert_eq!(st.buffers, st_alone.buffers, "running statistics");

            let mut grads = vec![0.0; fused.params_len()];
            let dx = fused.backward_input(dy.clone(), &st.params, &mut grads, &train).unwrap();
            let mut grads_alone = vec![0.0; alone.params_len()];
            let d = relu.backward_input(dy, &[], &mut [], &train).unwrap();
            let dx_alone = alone.backward_input(d, &st_alone.params, &mut grads_alone, &train).unwrap();
            assert_eq!(dx.host(), dx_alone.host(), "input gradient, affine {affine}, n {n}");
            assert_eq!(grads, grads_alone, "parameter gradients, affine {affine}, n {n}");

            let eval = Ctx::eval(Device::Cpu(0));
            let y = fused.forward(x.clone(), &st.params, &mut st.buffers, &eval).unwrap();
            let y_alone = alone.forward(x, &st_alone.params, &mut st_alone.buffers, &eval).unwrap();
            assert_eq!(y.host(), relu.forward(y_alone, &[], &mut [], &eval).unwrap().host(), "evaluation");
            let rows = fused.profile();
            assert!(rows[1].description.ends_with("(in the previous layer's passes)"), "{:?}", rows[1]);
            assert_eq!(rows[1].forward + rows[1].backward, std::time::Duration::ZERO, "the ReLU layer itself ran");
        }
        assert!(cpu::relu_of(f32::NAN).is_nan() && cpu::relu_of(-0.5) == 0.0 && cpu::relu_of(0.5) == 0.5);
    }
}
