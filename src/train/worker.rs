//! One device's worker: its replica, and what it does with each command.
//!
//! A worker owns a full replica (model instance with its caches, parameters, buffers,
//! optimiser state) and the device's thread pool. For a training step it runs each of
//! its logical replicas' shards in turn (forward → loss SUMMED over the shard →
//! backward into that shard's send buffer), joins the reduce-scatter, then applies the
//! optimiser to its own parameters reading the shared reduced gradient, and replaces
//! its BatchNorm running statistics by their mean over the logical replicas that saw
//! data. Every replica does exactly the same arithmetic on the same values, so replicas
//! stay bitwise identical.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::comm::shm::ShmRank;
use crate::error::{Error, Result};
use crate::nn::loss::{score, softmax_cross_entropy, Metrics};
use crate::nn::{Ctx, ParamStore, Sequential};
use crate::optim::Optimizer;
use crate::tensor::{Device, Tensor};

use super::Batch;

/// One step's work, shared by every worker.
pub struct StepWork {
    /// Global step index (0-based).
    pub step: u64,
    pub batch: Arc<Batch>,
    /// Rows of each logical replica (R ranges).
    pub shards: Vec<std::ops::Range<usize>>,
    /// Learning-rate multiplier of this step (the schedule's value).
    pub lr_scale: f32,
}

/// What one step produced on one worker.
#[derive(Clone, Debug, Default)]
pub struct StepOutcome {
    /// Metrics of each of this worker's logical replicas, in shard order.
    pub shards: Vec<Metrics>,
    pub compute: Duration,
    pub reduce: Duration,
}

/// A device's replica.
pub struct Replica {
    pub device: Device,
    pub model: Sequential,
    pub store: ParamStore,
    pub optimizer: Optimizer,
    /// Base seed of the run (dropout streams derive from it).
    pub seed: u64,
}

impl Replica {
    /// Trains one step. `comm` is this rank's view of the exchange, whose buffers hold
    /// [gradient sum | updated BN buffers] per logical replica.
    pub fn step(
        &mut self,
        work: &StepWork,
        comm: &ShmRank<'_>,
        first_shard: usize,
        shards_here: usize,
    ) -> Result<StepOutcome> {
        let t0 = Instant::now();
        let np = self.model.num_params();
        let nb = self.model.num_buffers();
        let per_sample = work.batch.sample_shape.numel();
        let mut outcome = StepOutcome::default();
        for local in 0..shards_here {
            let s = first_shard + local;
            let rows = work.shards[s].clone();
            let mut send = comm.shard_buffer(local);
            send.fill(0.0);
            if rows.is_empty() {
                // An empty shard still joins the collective, with zeros.
                outcome.shards.push(Metrics::default());
                continue;
            }
            let n = rows.len();
            let x = work.batch.x[rows.start * per_sample..rows.end * per_sample].to_vec();
            let mut dims = vec![n];
            dims.extend_from_slice(work.batch.sample_shape.dims());
            let x = Tensor::from_vec_on(x, dims, self.device)?;
            let labels = &work.batch.y[rows];
            let (grads, bufs) = send.split_at_mut(np);
            bufs.copy_from_slice(&self.store.buffers);
            let ctx = Ctx::train(self.seed, work.step, s, self.device);
            let logits = self.model.forward(x, &self.store.params, bufs, &ctx)?;
            let (metrics, dlogits) = softmax_cross_entropy(&logits, labels)?;
            self.model.backward(dlogits, &self.store.params, grads, &ctx)?;
            outcome.shards.push(metrics);
        }
        let t1 = Instant::now();
        comm.reduce_scatter()?;
        let t2 = Instant::now();
        let total = work.batch.len() as f32;
        let with_data = work.shards.iter().filter(|r| !r.is_empty()).count() as f32;
        self.optimizer.begin_step(work.lr_scale);
        let (params, buffers, optimizer) = (&mut self.store.params, &mut self.store.buffers, &mut self.optimizer);
        comm.for_each_reduced(|off, values| {
            let end = off + values.len();
            if off < np {
                let e = end.min(np);
                optimizer.update(off, &mut params[off..e], &values[..e - off], total);
            }
            if end > np && nb > 0 {
                let s = off.max(np);
                for (dst, &v) in buffers[s - np..end - np].iter_mut().zip(&values[s - off..]) {
                    *dst = v / with_data;
                }
            }
        });
        outcome.compute = (t1 - t0) + t2.elapsed();
        outcome.reduce = t2 - t1;
        Ok(outcome)
    }

    /// Loss and accuracy of the model in evaluation mode on `rows` of `batch`, in
    /// chunks of at most `chunk` samples.
    pub fn evaluate(&mut self, batch: &Batch, rows: std::ops::Range<usize>, chunk: usize) -> Result<Metrics> {
        let per_sample = batch.sample_shape.numel();
        let mut total = Metrics::default();
        let mut start = rows.start;
        let mut scratch = self.store.buffers.clone();
        while start < rows.end {
            let end = (start + chunk).min(rows.end);
            let mut dims = vec![end - start];
            dims.extend_from_slice(batch.sample_shape.dims());
            let x = Tensor::from_vec_on(batch.x[start * per_sample..end * per_sample].to_vec(), dims, self.device)?;
            let logits = self.model.forward(x, &self.store.params, &mut scratch, &Ctx::eval(self.device))?;
            total.add(&score(&logits, &batch.y[start..end])?);
            start = end;
        }
        Ok(total)
    }

    /// Class probabilities (softmax of the logits) for `rows` of `batch`: (rows, K).
    pub fn predict(&mut self, batch: &Batch, rows: std::ops::Range<usize>) -> Result<Vec<f32>> {
        let per_sample = batch.sample_shape.numel();
        let mut dims = vec![rows.len()];
        dims.extend_from_slice(batch.sample_shape.dims());
        let x =
            Tensor::from_vec_on(batch.x[rows.start * per_sample..rows.end * per_sample].to_vec(), dims, self.device)?;
        let mut scratch = self.store.buffers.clone();
        let logits = self.model.forward(x, &self.store.params, &mut scratch, &Ctx::eval(self.device))?;
        let k = logits.shape().per_sample();
        Ok(crate::nn::loss::softmax_rows(logits.into_vec(), k))
    }

    /// Per-tensor fingerprints of parameters, buffers and optimiser state, for the
    /// replica check (FNV-1a over the bit patterns: equal bits, equal hash).
    pub fn fingerprints(&self) -> Vec<(String, u64)> {
        fingerprints(&self.model, &self.store, &self.optimizer)
    }
}

/// Per-tensor fingerprints of a replica's parameters, buffers and optimiser state (FNV-1a
/// over the bit patterns: equal bits, equal hash), named as the checkpoints name them.
pub fn fingerprints(model: &Sequential, store: &ParamStore, optimizer: &Optimizer) -> Vec<(String, u64)> {
    let fnv = |v: &[f32]| {
        v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| (h ^ x.to_bits() as u64).wrapping_mul(0x100_0000_01b3))
    };
    let mut out = Vec::new();
    for t in model.param_infos() {
        out.push((t.name.clone(), fnv(&store.params[t.range.clone()])));
    }
    for t in model.buffer_infos() {
        out.push((t.name.clone(), fnv(&store.buffers[t.range.clone()])));
    }
    for (name, v) in optimizer.state() {
        out.push((format!("optimizer.{name}"), fnv(v)));
    }
    out
}

/// Compares every replica's fingerprints with replica 0's; names the first difference.
pub fn check_replicas(step: u64, prints: &[Vec<(String, u64)>]) -> Result<()> {
    let Some(first) = prints.first() else { return Ok(()) };
    for (r, p) in prints.iter().enumerate().skip(1) {
        if let Some(((name, _), _)) = first.iter().zip(p).find(|(a, b)| a.1 != b.1) {
            return Err(Error::ReplicaMismatch { step, replica: r, tensor: name.clone() });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_that_differs_is_named_with_the_first_tensor_that_differs() {
        let a = vec![
            ("dense0.weight".to_string(), 1u64),
            ("dense0.bias".to_string(), 2),
            ("bn0.running_mean".to_string(), 3),
        ];
        let mut b = a.clone();
        b[1].1 = 20;
        b[2].1 = 30;
        assert!(check_replicas(7, &[a.clone(), a.clone(), a.clone()]).is_ok());
        let e = check_replicas(7, &[a.clone(), a.clone(), b]).unwrap_err();
        assert!(matches!(&e, Error::ReplicaMismatch { step: 7, replica: 2, tensor } if tensor == "dense0.bias"), "{e}");
        assert_eq!(
            e.to_string(),
            "replica check failed at step 7: replica 2 differs from replica 0 in tensor 'dense0.bias'"
        );
    }

    #[test]
    fn fingerprints_change_with_any_bit() {
        let model = crate::models::toy_mlp(2, 2).unwrap();
        let store = model.init(0);
        let optimizer = Optimizer::new(crate::optim::OptimizerConfig::sgd(0.1), model.num_params());
        let mut r = Replica { device: Device::Cpu(0), model, store, optimizer, seed: 0 };
        let before = r.fingerprints();
        r.store.params[5] = f32::from_bits(r.store.params[5].to_bits() ^ 1); // one ulp
        let after = r.fingerprints();
        assert_eq!(before.len(), after.len());
        let changed: Vec<&str> =
            before.iter().zip(&after).filter(|(x, y)| x.1 != y.1).map(|(x, _)| x.0.as_str()).collect();
        assert_eq!(changed, vec!["dense0.weight"]);
    }
}
