//! The trainer across processes: what the coordinators of an MPI world's processes agree
//! on, and how their reports become one.
//!
//! Owns the handshake before the first step (every process started with the same run:
//! the same devices, replicas, model, batch, seed, weights — else the run is refused on
//! every process alike, naming the first difference), the merge of every step's
//! per-shard metrics (each process knows only its own shards'; after the merge every
//! process holds the whole step's report, so every decision taken on it — a non-finite
//! loss, the stop flag — is the same everywhere), the replica check across processes,
//! the evaluation's sum, and the rows of a global batch each process holds. The world's
//! collectives are `world`'s; the exchange of gradients is `exchange::mpi` (CPU) or one
//! NCCL clique (GPU). In a world of one none of this runs.
//!
//! Orders: the merged metrics are added in shard order, the evaluation in global device
//! order, as one process adds them, so the reports of P processes × D devices are those
//! of one process with P·D devices.

use std::ops::Range;

use super::replica::check_replicas;
use super::scatter;
use super::step::Evaluated;
use super::{ShardReport, StepReport, StopRequest, StoppedEvaluation, TrainConfig};
use crate::data::Dataset;
use crate::digest::Fnv1a;
use crate::error::{Error, Result};
#[cfg(feature = "cuda")]
use crate::exchange::gpu::{new_clique_id, Clique};
use crate::nn::{Graph, ParamStore};
use crate::ops::cross_entropy::Metrics;
use crate::optim::Optimizer;
use crate::tensor::Device;
use crate::world::agree::Setting;
use crate::world::World;

/// Which process trains which logical replicas, and which rows of a batch it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowPlan {
    /// Logical replicas in the world.
    pub replicas: usize,
    /// This process's logical replicas: `first..first + count`.
    pub first: usize,
    pub count: usize,
}

impl RowPlan {
    /// The plan of process `process` of `size`, R = `replicas` (a multiple of `size`).
    pub fn new(replicas: usize, process: usize, size: usize) -> RowPlan {
        let count = replicas / size;
        RowPlan { replicas, first: process * count, count }
    }

    /// The rows of a global batch of `len` this process's shards hold (all of them in a
    /// world of one); possibly empty.
    pub fn rows(&self, len: usize) -> Range<usize> {
        let shards = scatter::even_runs(len, self.replicas);
        let mine = &shards[self.first..self.first + self.count];
        mine[0].start..mine[mine.len() - 1].end
    }
}

/// The error a run of several processes ends with, once this process's threads have
/// ended: another process's failure, if one was reported (this process's own error is
/// then only its consequence); otherwise this process's, which the others are told of.
pub(super) fn settle(world: &World, e: Error) -> Error {
    if let Some(theirs) = world.peer_failure() {
        return theirs;
    }
    world.fail(&e);
    e
}

/// The NCCL clique of every process's GPUs (`local` per process, in process order): the id
/// made by process 0, broadcast to the others.
#[cfg(feature = "cuda")]
pub(super) fn clique(world: &World, local: usize) -> Result<Clique> {
    let mut id = match world.is_voice() {
        true => new_clique_id()?,
        false => [0u8; 128],
    };
    world.broadcast(0, &mut id)?;
    Ok(Clique { id, members: local * world.size(), first: world.process() * local })
}

/// What every process of a run must agree on before the first step, in words
/// (`World::agree` compares them): the devices, the whole configuration that changes a
/// number, the model layer by layer, and the initial weights.
pub(super) struct Handshake {
    settings: Vec<Setting>,
}

impl Handshake {
    /// The run this process was started with.
    pub fn of(devices: &[Device], replicas: usize, model: &Graph, config: &TrainConfig, initial: &ParamStore) -> Self {
        let kind = match devices.first() {
            Some(Device::Cuda(_)) => "cuda",
            _ => "cpu",
        };
        let bits = initial.params.iter().chain(&initial.buffers).map(|v| v.to_bits());
        let weights = bits.fold(Fnv1a::new(), |h, b| h.bytes(&b.to_le_bytes())).finish();
        let or_none = |v: Option<String>| v.unwrap_or_else(|| "none".into());
        let c = config;
        let named: Vec<(&str, String)> = vec![
            ("devices", devices.len().to_string()),
            ("device kind", kind.into()),
            ("logical replicas", replicas.to_string()),
            ("batch size", c.batch_size.to_string()),
            ("seed", c.seed.to_string()),
            ("epochs", c.epochs.to_string()),
            ("step limit", or_none(c.max_steps.map(|k| k.to_string()))),
            ("resumed step", or_none(c.resume.as_ref().map(|r| r.step.to_string()))),
            ("optimizer", format!("{:?}", c.optimizer)),
            ("learning-rate schedule", format!("{:?}", c.schedule)),
            ("warm-up steps", c.warmup_steps.to_string()),
            ("weight decay on", format!("{:?}", c.weight_decay_on)),
            ("gradient clipping", or_none(c.clip_grad_norm.map(|n| n.to_string()))),
            ("shuffling", format!("{:?}", c.shuffle)),
            ("last batch", format!("{:?}", c.last_batch)),
            ("accumulation", c.accumulate.to_string()),
            ("gradient compression", format!("{:?}", c.grad_compression)),
            ("optimizer sharding", format!("{:?}", c.optimizer_sharding)),
            // A sharded optimiser's checkpoints gather every process's state: all must
            // checkpoint at the same steps.
            ("checkpoint period", or_none(c.checkpoint.as_ref().map(|p| p.every.max(1).to_string()))),
            ("augmentation", c.augment.name()),
            ("label smoothing", c.label_smoothing.to_string()),
            ("held-out set", c.held_out.name().into()),
            ("early stopping", format!("{:?}", c.early_stopping)),
            ("evaluation batch", c.eval_batch.to_string()),
            ("evaluation period", or_none(c.eval_every.map(|k| k.to_string()))),
            ("evaluation batches", or_none(c.eval_batches.map(|k| k.to_string()))),
            ("non-finite losses", format!("{:?}", c.non_finite)),
            ("model", format!("{} layers, {} values", model.layers().len(), model.params_len() + model.buffers_len())),
        ];
        // Each node with the values it reads: processes agree on the graph, not only on
        // its layers.
        let reads = |i: usize| {
            let names: Vec<String> = model.sources()[i]
                .iter()
                .map(|&s| match s {
                    crate::model::Source::Input(k) => model.inputs()[k].0.clone(),
                    crate::model::Source::Node(j) => model.layer_names()[j].clone(),
                })
                .collect();
            names.join(", ")
        };
        let layers = model
            .layers()
            .iter()
            .enumerate()
            .map(move |(i, l)| (format!("layer {i}"), format!("{} reading {}", l.describe(), reads(i))));
        let mut settings: Vec<Setting> = named.into_iter().map(|(k, v)| (k.to_string(), v)).chain(layers).collect();
        settings.push(("initial weights".into(), format!("digest {weights:016x}")));
        Handshake { settings }
    }

    /// Every process's handshake compared with process 0's: the first difference, on
    /// every process alike.
    pub fn agree(&self, world: &World) -> Result<()> {
        world.agree(&self.settings)
    }
}

/// The data a run trains and evaluates on, in words for `World::agree`: each set's
/// samples, their shape, and a digest of every value and label (a set that differs by
/// one byte or one label differs here).
pub(super) fn data_settings(train: &Dataset, held_out: Option<&Dataset>) -> Vec<Setting> {
    let words =
        |d: &Dataset| format!("{} samples of {:?}, digest {:016x}", d.len(), d.sample_shape().dims(), d.digest());
    vec![
        ("training data".into(), words(train)),
        ("held-out data".into(), held_out.map_or_else(|| "none".into(), words)),
    ]
}

/// Every process's parts of a sharded optimiser (`parts`: this process's, one per
/// device), on every process: each part as `Optimizer::to_words`, a process's parts one
/// after the other, each preceded by its length; padded to the longest process's.
pub(super) fn gather_optimizer_parts(world: &World, parts: &[Optimizer]) -> Result<Vec<Optimizer>> {
    let first = parts.first().ok_or_else(|| Error::config("optimizer state", "no part to gather"))?;
    let (config, len) = (*first.config(), first.params_len());
    let mut mine = Vec::new();
    for p in parts {
        let w = p.to_words();
        mine.push(w.len() as u64);
        mine.extend(w);
    }
    let longest = world.all_gather(&[mine.len() as u64])?.into_iter().max().unwrap_or(0) as usize;
    mine.resize(longest, u64::MAX);
    let all = world.all_gather(&mine)?;
    let mut out = Vec::new();
    for (q, words) in all.chunks(longest.max(1)).enumerate() {
        let mut at = 0;
        while at < words.len() && words[at] != u64::MAX {
            let n = words[at] as usize;
            let part =
                words.get(at + 1..at + 1 + n).and_then(|w| Optimizer::from_words(config, len, w)).ok_or_else(|| {
                    Error::Processes { detail: format!("process {q} sent optimizer state that is not one") }
                })?;
            out.push(part);
            at += 1 + n;
        }
    }
    Ok(out)
}

/// Words per shard in a step record: loss sum (f64 bits), correct, count.
const SHARD_WORDS: usize = 3;
/// Words after the shards: compute ns, reduce ns, the stop request (`StopRequest::word`).
const TAIL_WORDS: usize = 3;

/// Merges this process's part of a step (`local`: its shards' reports, in shard order)
/// with every other process's: the whole step's report, the same on every process, and
/// the strongest stop request any process made (an interrupt over a time limit).
pub(super) fn merge_step(
    world: &World,
    local: StepReport,
    stop: Option<StopRequest>,
    devices: &[Device],
) -> Result<(StepReport, Option<StopRequest>)> {
    let mut mine = Vec::with_capacity(local.shards.len() * SHARD_WORDS + TAIL_WORDS);
    for s in &local.shards {
        mine.extend([s.metrics.loss_sum.to_bits(), s.metrics.correct, s.metrics.count]);
    }
    mine.extend([local.compute.as_nanos() as u64, local.reduce.as_nanos() as u64, StopRequest::word(stop)]);
    let all = world.all_gather(&mine)?;
    let per = mine.len();
    let shards_per_process = local.shards.len();
    let k = shards_per_process / devices.len().max(1);
    let mut report = StepReport {
        step: local.step,
        metrics: Metrics::default(),
        shards: Vec::with_capacity(shards_per_process * world.size()),
        compute: local.compute,
        reduce: local.reduce,
        wall: local.wall,
    };
    let mut any_stop = None;
    for q in 0..world.size() {
        let rec = &all[q * per..(q + 1) * per];
        for j in 0..shards_per_process {
            let w = &rec[j * SHARD_WORDS..(j + 1) * SHARD_WORDS];
            let metrics = Metrics { loss_sum: f64::from_bits(w[0]), correct: w[1], count: w[2] };
            report.metrics.add(&metrics);
            let device = devices[j / k.max(1)];
            report.shards.push(ShardReport { device, process: Some(q), shard: q * shards_per_process + j, metrics });
        }
        let tail = &rec[shards_per_process * SHARD_WORDS..];
        report.compute = report.compute.max(std::time::Duration::from_nanos(tail[0]));
        report.reduce = report.reduce.max(std::time::Duration::from_nanos(tail[1]));
        any_stop = any_stop.max(StopRequest::from_word(tail[2]));
    }
    Ok((report, any_stop))
}

/// The evaluation of every device of the world (`local`: this process's, in device order)
/// of the `of` samples of the whole: their metrics summed in global device order, or,
/// on every process, given up when any device of any process gave its part up (a flag
/// word travels with each device's sums, and the samples it left unevaluated).
pub(super) fn merge_evaluations(world: &World, local: &[Evaluated], of: usize) -> Result<Evaluated> {
    const STOPPED: u64 = u64::MAX;
    let words = |e: &Evaluated| match e {
        Evaluated::Whole(m) => [0, m.loss_sum.to_bits(), m.correct, m.count],
        Evaluated::Stopped(s) => [STOPPED, s.of - s.evaluated, 0, 0],
    };
    let mine: Vec<u64> = local.iter().flat_map(words).collect();
    let all = world.all_gather(&mine)?;
    let (mut total, mut skipped, mut stopped) = (Metrics::default(), 0, false);
    for w in all.chunks(4) {
        match w[0] {
            STOPPED => (stopped, skipped) = (true, skipped + w[1]),
            _ => total.add(&Metrics { loss_sum: f64::from_bits(w[1]), correct: w[2], count: w[3] }),
        }
    }
    let of = of as u64;
    Ok(match stopped {
        true => Evaluated::Stopped(StoppedEvaluation { evaluated: of - skipped, of }),
        false => Evaluated::Whole(total),
    })
}

/// The replica check across processes: this process's devices against each other, then
/// every device of the world against process 0's first; names the first that differs
/// (process, device, tensor). The same verdict on every process.
pub(super) fn check_across(world: &World, step: u64, devices: &[Device], prints: &[Vec<(String, u64)>]) -> Result<()> {
    let local = check_replicas(step, prints);
    let tensors = prints.first().map_or(0, Vec::len);
    // A local mismatch travels as a flag so that every process fails alike.
    let mut mine: Vec<u64> = vec![u64::from(local.is_err())];
    mine.extend(prints.iter().flat_map(|p| p.iter().map(|t| t.1)));
    let all = world.all_gather(&mine)?;
    let per = mine.len();
    let names = |t: usize| prints[0][t].0.clone();
    let first = &all[1..1 + tensors];
    for q in 0..world.size() {
        let rec = &all[q * per..(q + 1) * per];
        for (d, device) in devices.iter().enumerate() {
            let theirs = &rec[1 + d * tensors..1 + (d + 1) * tensors];
            if let Some(t) = (0..tensors).find(|&t| theirs[t] != first[t]) {
                return Err(Error::ReplicaMismatchAcross {
                    step,
                    process: q,
                    device: device.to_string(),
                    first: devices[0].to_string(),
                    tensor: names(t),
                });
            }
        }
    }
    local
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_process_holds_the_rows_of_its_shards() {
        // B = 10, R = 4: shards 0..3, 3..6, 6..8, 8..10.
        assert_eq!(RowPlan::new(4, 0, 2).rows(10), 0..6);
        assert_eq!(RowPlan::new(4, 1, 2).rows(10), 6..10);
        assert_eq!(RowPlan::new(4, 0, 1).rows(10), 0..10);
        // A batch of 1: the second process's shards are empty, at the batch's end.
        assert_eq!(RowPlan::new(4, 1, 2).rows(1), 1..1);
        assert_eq!(RowPlan::new(4, 3, 4).rows(3), 3..3);
    }

    #[test]
    fn an_evaluation_one_device_gave_up_is_given_up_counting_every_device_s_samples() {
        let world = crate::world::current().unwrap();
        let whole = Evaluated::Whole(Metrics { loss_sum: 0.5, correct: 3, count: 4 });
        let given_up = Evaluated::Stopped(StoppedEvaluation { evaluated: 2, of: 6 });
        // 4 + 6 samples: the first device's 4 all evaluated, the second's 2 of 6.
        let merged = merge_evaluations(world, &[whole, given_up], 10).unwrap();
        assert_eq!(merged, Evaluated::Stopped(StoppedEvaluation { evaluated: 6, of: 10 }));
        let both = Evaluated::Whole(Metrics { loss_sum: 0.25, correct: 1, count: 6 });
        let merged = merge_evaluations(world, &[whole, both], 10).unwrap();
        assert_eq!(merged, Evaluated::Whole(Metrics { loss_sum: 0.75, correct: 4, count: 10 }));
    }

    #[test]
    fn a_world_of_one_merges_to_its_own_report() {
        let world = crate::world::current().unwrap();
        let m = |l: f64, c: u64| Metrics { loss_sum: l, correct: c, count: 2 };
        let local = StepReport {
            step: 3,
            metrics: Metrics::default(),
            shards: vec![
                ShardReport { device: Device::Cpu(0), process: None, shard: 0, metrics: m(0.5, 1) },
                ShardReport { device: Device::Cpu(1), process: None, shard: 1, metrics: m(0.25, 2) },
            ],
            compute: std::time::Duration::from_millis(2),
            reduce: std::time::Duration::from_millis(1),
            wall: std::time::Duration::from_millis(4),
        };
        let (r, stop) =
            merge_step(world, local, Some(StopRequest::TimeLimit), &[Device::Cpu(0), Device::Cpu(1)]).unwrap();
        assert_eq!(stop, Some(StopRequest::TimeLimit));
        assert_eq!((r.metrics.loss_sum, r.metrics.correct, r.metrics.count), (0.75, 3, 4));
        let who: Vec<_> = r.shards.iter().map(|s| (s.device, s.process, s.shard)).collect();
        assert_eq!(who, vec![(Device::Cpu(0), Some(0), 0), (Device::Cpu(1), Some(0), 1)]);
    }

    #[test]
    fn the_check_names_the_device_that_differs() {
        let world = crate::world::current().unwrap();
        let a = vec![("dense0.weight".to_string(), 1u64), ("dense0.bias".to_string(), 2)];
        let mut b = a.clone();
        b[1].1 = 7;
        let devices = [Device::Cpu(0), Device::Cpu(1)];
        assert!(check_across(world, 4, &devices, &[a.clone(), a.clone()]).is_ok());
        let e = check_across(world, 4, &devices, &[a, b]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "replica check failed at step 4: process 0, cpu:1 differs from process 0, cpu:0 in tensor 'dense0.bias'"
        );
    }

    #[test]
    fn the_handshake_names_the_first_difference() {
        let h = |batch: usize, dropout: f32| {
            let config = TrainConfig { batch_size: batch, ..TrainConfig::default() };
            let model =
                crate::models::convnet(crate::models::ConvnetOptions { dropout, ..Default::default() }).unwrap();
            Handshake::of(&[Device::Cpu(0)], 2, &model, &config, &model.init(0))
        };
        // In a world of one there is nobody to disagree with.
        assert!(h(8, 0.5).agree(crate::world::current().unwrap()).is_ok());
        let first = |a: Handshake, b: Handshake| {
            a.settings.iter().zip(&b.settings).find(|(x, y)| x.1 != y.1).map(|(x, y)| (x.clone(), y.1.clone()))
        };
        let batch = first(h(8, 0.5), h(16, 0.5)).unwrap();
        assert_eq!(batch, (("batch size".to_string(), "8".to_string()), "16".to_string()));
        // Two models of one size that differ in a layer's setting: the layer is named.
        let ((name, a), b) = first(h(8, 0.5), h(8, 0.1)).unwrap();
        assert!(
            name.starts_with("layer ") && a == "Dropout(0.5) reading relu3" && b == "Dropout(0.1) reading relu3",
            "{name}: {a} vs {b}"
        );
    }
}
