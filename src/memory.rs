//! Memory before work: what a run (or a command) will allocate, estimated from the
//! model's shapes and the configuration before anything is allocated, and refused when
//! it exceeds what the machine has available — one error with the estimate and its
//! parts, instead of an abort in the allocator an hour in, or a machine swapping.
//!
//! Owns: an estimate by parts ([`Estimate`]), the activations of a model's training
//! shard and evaluation batch (each layer's own account summed), the machine's available
//! memory ([`available`]: `MemAvailable` of `/proc/meminfo`, lowered to what the cgroup's
//! `memory.max` leaves), and the check ([`Estimate::check`], [`check_bytes`]). The
//! estimate of a whole training run — weights, optimiser state, activations, the gradient
//! exchange, the batches in flight — is the trainer's (`train::memory`), which builds on
//! these: `with_trainer` checks it before it builds anything; the command line adds the
//! data it loaded and checks before loading weights or checkpoints; the data loaders check
//! a header's claimed size before reading a body.
//!
//! The activation estimate follows what the CPU layers keep between forward and backward,
//! as each layer states it in its own module (`nn::Layer::memory`; [`shard_activations`]
//! sums them), at the configured global batch (which the fit loop's batches
//! never exceed; the command line caps it at the training set's size). A device runs its
//! logical replicas' shards one after the other, so it holds one shard's activations at
//! a time. Measured against the peak resident memory of the convnet on the digits
//! (`/usr/bin/time -v`, three runs each): 145 MB estimated for 123–145 MB at batch 256 on
//! 1 device, 476 MB for 381 MB at a batch of all 1,437 samples, 480 MB for 399–412 MB
//! with them on 2 devices —
//! meant to be a little above, never to miss a term that grows with the model, the batch
//! or the replicas.
//!
//! Also here: [`keep_freed_pages`], which asks the system allocator to keep the memory a
//! step frees for the next step, as the command line's allocator is told to.

use crate::error::{Error, Result};
use crate::nn::{Graph, LayerMemory, Source};
use crate::units::human;

/// Asks the C library's allocator to keep the memory each step frees for the next one,
/// instead of handing it back to the kernel and faulting it in again, zeroed, a few
/// milliseconds later: what the command line tells its allocator, mimalloc (never purge:
/// `main.rs`). For a program on the system allocator; in a notebook it is the setup
/// cell's call, as a cell cannot choose the kernel's allocator. Measured in a notebook
/// (docs/notebooks.md, "Speed"): the convnet on `cpu:2` trained at 0.84× the command
/// line's samples/s without it, 0.97× with it.
///
/// On glibc, `mallopt`: freed memory at the top of a heap is kept up to 1 GiB
/// (`M_TRIM_THRESHOLD`, glibc's default 128 KiB) with 64 MiB of slack each time a heap
/// grows (`M_TOP_PAD`), and blocks below 32 MiB, the most glibc allows, come from the
/// heaps rather than each from its own mapping (`M_MMAP_THRESHOLD`). A run's memory then
/// stays at its peak, which the estimate sizes anyway. Process-wide, and never undone.
/// Elsewhere (another C library, another system) nothing changes. Returns whether the
/// allocator took the three settings.
pub fn keep_freed_pages() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::raw::c_int;
        // glibc's malloc.h.
        const M_TRIM_THRESHOLD: c_int = -1;
        const M_TOP_PAD: c_int = -2;
        const M_MMAP_THRESHOLD: c_int = -3;
        extern "C" {
            fn mallopt(param: c_int, value: c_int) -> c_int;
        }
        const MIB: c_int = 1 << 20;
        // SAFETY: int mallopt(int param, int value) sets one of the allocator's
        // process-wide parameters under its own lock; an out-of-range value is refused
        // with 0, and these change only when memory is mapped and returned.
        unsafe {
            mallopt(M_TRIM_THRESHOLD, 1024 * MIB) == 1
                && mallopt(M_TOP_PAD, 64 * MIB) == 1
                && mallopt(M_MMAP_THRESHOLD, 32 * MIB) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// One named part of an estimate.
#[derive(Clone, Debug, PartialEq)]
pub struct Part {
    pub name: &'static str,
    pub bytes: u64,
    /// How it was counted, e.g. "3 copies of 98,442 values".
    pub detail: String,
}

/// An estimate of memory, by part.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Estimate {
    parts: Vec<Part>,
}

/// Memory the machine can give, and where the figure comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Available {
    pub bytes: u64,
    /// "available (MemAvailable)" or "left under the cgroup's memory.max".
    pub source: &'static str,
}

impl Estimate {
    /// Adds a part (zero-byte parts are kept out of messages).
    pub fn add(&mut self, name: &'static str, bytes: u64, detail: impl Into<String>) -> &mut Self {
        if bytes > 0 {
            self.parts.push(Part { name, bytes, detail: detail.into() });
        }
        self
    }

    /// The parts, in the order added.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// The sum of the parts.
    pub fn total(&self) -> u64 {
        self.parts.iter().fold(0u64, |a, p| a.saturating_add(p.bytes))
    }

    /// "weights 1.2 MB (3 copies of 98,442 values), activations ...": the parts, largest first.
    pub fn describe(&self) -> String {
        let mut parts: Vec<&Part> = self.parts.iter().collect();
        parts.sort_by_key(|p| std::cmp::Reverse(p.bytes));
        parts.iter().map(|p| format!("{} {} ({})", p.name, human(p.bytes), p.detail)).collect::<Vec<_>>().join(", ")
    }

    /// Fails with the estimate and its parts when it exceeds `available`.
    pub fn check_against(&self, what: &str, available: Available) -> Result<()> {
        let needed = self.total();
        if needed <= available.bytes {
            return Ok(());
        }
        Err(Error::OutOfMemory {
            what: what.to_string(),
            needed,
            available: available.bytes,
            available_from: available.source,
            parts: self.describe(),
        })
    }

    /// [`Estimate::check_against`] the machine's available memory; passes where that is
    /// unknown (no `/proc/meminfo`).
    pub fn check(&self, what: &str) -> Result<()> {
        match available() {
            Some(a) => self.check_against(what, a),
            None => Ok(()),
        }
    }
}

/// The memory this process can still allocate: `MemAvailable`, or what the cgroup's
/// `memory.max` leaves above `memory.current` when that is less. `None` off Linux.
pub fn available() -> Option<Available> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    let mut best = Available { bytes: kib.saturating_mul(1024), source: "available (MemAvailable)" };
    let read = |f: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{f}")).ok()?.trim().parse::<u64>().ok();
    if let (Some(max), Some(current)) = (read("memory.max"), read("memory.current")) {
        let left = max.saturating_sub(current);
        if left < best.bytes {
            best = Available { bytes: left, source: "left under the cgroup's memory.max" };
        }
    }
    Some(best)
}

/// Allocations below this are not checked: reading `/proc/meminfo` costs more than
/// they do, and a machine without 64 MiB to spare does not run lockstep.
pub const UNCHECKED_BYTES: u64 = 64 << 20;

/// Refuses one allocation of `bytes` (a file's body, a benchmark's buffers) that the
/// machine cannot give; `what` names it.
pub fn check_bytes(what: &str, bytes: u64, detail: impl Into<String>) -> Result<()> {
    if bytes < UNCHECKED_BYTES {
        return Ok(());
    }
    let mut e = Estimate::default();
    e.add("buffers", bytes, detail);
    e.check(what)
}

const F32: u64 = 4;

/// The part of a run that no shape predicts (see `train::memory::training`).
pub const PROCESS_BYTES: u64 = 64 << 20;

/// The chunks of samples whose workspace a shard of `batch` samples is counted with: the
/// ones `backend::cpu::batch_chunks` makes (at most 16, of at least 8 samples each). One a
/// sample up to 16, as this counted before, put 16 chunks' lent buffers and partials in a
/// shard of 32 samples that has 4: a third of the convnet's activation estimate.
fn chunks(batch: usize) -> u64 {
    crate::backend::cpu::batch_chunks(batch).len().max(1) as u64
}

/// Bytes of the activations of one training shard of `batch` samples on a device of
/// `threads` threads. Per sample, what each layer keeps from forward to backward, as its
/// own [`Layer::memory`](crate::nn::Layer::memory) states (a layer of the user's own,
/// which states nothing, is counted as keeping nothing); and what is alive around the
/// layer running: its input and output (or gradient and input gradient), the widest pair
/// of the network, and the shard's copy of its samples. Per layer and chunk of samples,
/// its workspace (a convolution's weight-gradient partials), and per layer what it holds
/// whatever the batch (a Winograd convolution's transformed weight). A node that runs
/// inside another's passes on the CPU keeps nothing of its own there.
pub fn shard_activations(model: &Graph, batch: usize, threads: usize) -> u64 {
    let _ = threads; // the chunks are a function of the batch alone (`backend::cpu::batch_chunks`)
    activations(model, batch, Runs::Cpu)
}

/// [`shard_activations`] on a GPU replica, which runs every node as it is (a node the CPU
/// runs inside another's passes keeps there what it keeps alone).
pub fn gpu_shard_activations(model: &Graph, batch: usize) -> u64 {
    activations(model, batch, Runs::Gpu)
}

/// Where a shard runs: whether nodes run inside others' passes (the CPU) or each as it is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Runs {
    Cpu,
    Gpu,
}

fn activations(model: &Graph, batch: usize, runs: Runs) -> u64 {
    let mut kept = 0u64;
    let mut widest = widest_input(model);
    let mut workspace = 0u64;
    for (j, (layer, shapes)) in model.layers().iter().zip(model.layer_shapes()).enumerate() {
        // A ReLU run inside the node before it, or a SiLU inside its reader, keeps
        // nothing of its own (that node's account holds what the pair keeps).
        let m = match runs == Runs::Cpu && model.runs_inside_another(j) {
            true => LayerMemory::NONE,
            false => layer.memory(shapes).unwrap_or(LayerMemory::NONE),
        };
        kept = kept.saturating_add(m.kept_per_sample);
        workspace = workspace.saturating_add(m.per_chunk.saturating_mul(chunks(batch))).saturating_add(m.per_layer);
        widest = widest.max(shapes.output.numel() as u64);
    }
    let workspace = workspace.saturating_add(lent(model, batch));
    // Around the running node: its input and output in a chain, every value still to be
    // read in a graph (and, in the backward, their gradients, as many).
    let around = (2 * widest).max(live_peak(model));
    let around = around.saturating_mul(F32).saturating_add(sample_values(model) * F32);
    kept.saturating_add(around).saturating_mul(batch as u64).saturating_add(workspace)
}

/// Values of one sample: every model input's, which a pass's copy of its samples holds
/// (one tensor (N, *shape_k) per input, cut from the batch: `train::Batch::input_rows`).
pub fn sample_values(model: &Graph) -> u64 {
    model.inputs().iter().map(|(_, s)| s.numel() as u64).sum()
}

/// The largest model input's values per sample.
fn widest_input(model: &Graph) -> u64 {
    model.inputs().iter().map(|(_, s)| s.numel() as u64).max().unwrap_or(0)
}

/// The most values a sample has alive at once around a node of `model`: the output of the
/// node running, and every value (the model's inputs, earlier nodes' outputs) that it or a
/// later node still reads — the graph's liveness, as `Graph::forward` frees each value
/// after its last reader. For a chain, the running node's input and output.
pub fn live_peak(model: &Graph) -> u64 {
    let sources = model.sources();
    let n = sources.len();
    // The last node that reads each value (every value is read: `Graph::build` checks).
    let mut last_input = vec![0usize; model.inputs().len()];
    let mut last_node = vec![0usize; n];
    for (j, srcs) in sources.iter().enumerate() {
        for &s in srcs {
            match s {
                Source::Input(k) => last_input[k] = last_input[k].max(j),
                Source::Node(i) => last_node[i] = last_node[i].max(j),
            }
        }
    }
    let shapes = model.layer_shapes();
    let size = |s: Source| match s {
        Source::Input(k) => model.inputs()[k].1.numel() as u64,
        Source::Node(i) => shapes[i].output.numel() as u64,
    };
    (0..n)
        .map(|j| {
            let inputs = (0..last_input.len()).filter(|&k| last_input[k] >= j).map(|k| size(Source::Input(k)));
            let nodes = (0..j).filter(|&i| last_node[i] >= j).map(|i| size(Source::Node(i)));
            inputs.chain(nodes).sum::<u64>() + size(Source::Node(j))
        })
        .max()
        .unwrap_or(0)
}

/// Bytes of an evaluation forward of `batch` samples: no caches, only the widest input
/// and output pair, the chunk's copy of its samples, the lent work buffers, and the
/// largest of what a layer holds during its own pass (`per_layer`, dropped after it).
pub fn eval_activations(model: &Graph, batch: usize) -> u64 {
    let widest = model.layer_shapes().iter().map(|s| s.output.numel() as u64).max().unwrap_or(0);
    let widest = widest.max(widest_input(model));
    let per_sample = (2 * widest).max(live_peak(model)).saturating_mul(F32).saturating_add(sample_values(model) * F32);
    let memories = model.layers().iter().zip(model.layer_shapes()).filter_map(|(l, s)| l.memory(s));
    let per_layer = memories.map(|m| m.per_layer).max().unwrap_or(0);
    per_sample.saturating_mul(batch as u64).saturating_add(lent(model, batch)).saturating_add(per_layer)
}

/// The work buffers the layers borrow from a shared pool for a pass of `batch` samples:
/// a set per chunk of samples, as large as the largest layer needs; and the packing of
/// the largest product, which a device runs one at a time.
fn lent(model: &Graph, batch: usize) -> u64 {
    let memories = || model.layers().iter().zip(model.layer_shapes()).filter_map(|(l, s)| l.memory(s));
    let largest = memories().map(|m| m.lent_per_chunk).max().unwrap_or(0);
    let gemm = memories().map(|m| m.gemm).max().unwrap_or(0);
    largest.saturating_mul(chunks(batch)).saturating_add(gemm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models;

    #[test]
    fn keep_freed_pages_is_taken_by_glibc_and_nothing_elsewhere() {
        // glibc refuses a value out of its range with 0, so `true` means all three were set.
        assert_eq!(keep_freed_pages(), cfg!(all(target_os = "linux", target_env = "gnu")));
        // The allocator still works after the change: a block above the old thresholds.
        let block = vec![1u8; 8 << 20];
        assert_eq!(block.iter().map(|&b| b as usize).sum::<usize>(), 8 << 20);
    }

    #[test]
    fn the_activation_figures_of_three_models_are_pinned() {
        // Computed by this module before each op stated its own memory (issue 17), and
        // held since: the sum over the ops must give the central match's numbers.
        // convnet: 225,984 B a sample kept and around the running layer, plus partials of
        // 38,124 weights per chunk of samples (at most 16), as train::memory's test derives.
        // maxpool spec: kept conv0 max(784, 21,632)·4, relu 21,632, pool 5,408·4, conv1
        // max(5,408, 7,744)·4, relu 7,744, pool 1,600·4, flatten 0, dropout 1,600·4, dense
        // 1,600·4 = 187,712 (a convolution counts the larger of its input and output since
        // issue 42's DenseNet: conv2d's memory account says why); around, 2·21,632·4 + 784·4 = 176,192 (the eval figure);
        // partials 32·9 (conv0) + 36·32·64 (conv1, 3×3 at stride 1 between 32 and 64
        // channels: Winograd's transformed dV, 6·6 points) = 74,016 f32 a chunk; conv1's
        // transformed weight 2·36·32·64 f32 = 589,824 B once (in evaluation too):
        // 1,249,792 B for one sample, 766,016 B to evaluate one. toy: 506 and 248 B (the
        // toy test).
        let maxpool = crate::spec::model_from_spec_str(
            include_str!("../examples/mnist_convnet_maxpool.json"),
            "mnist_convnet_maxpool.json",
        )
        .unwrap();
        let models = [
            ("convnet", models::convnet(models::ConvnetOptions::default()).unwrap()),
            ("maxpool", maxpool),
            ("toy", models::toy_mlp(2, 2).unwrap()),
        ];
        // (model, batch, shard_activations, eval_activations)
        // The partials counted once a chunk of samples (`backend::cpu::batch_chunks`: 1
        // chunk for up to 15 samples, 2 for 16 and 17, 16 for 256): convnet's 38,124 f32
        // and maxpool's 74,016.
        let pinned: [(&str, usize, u64, u64); 15] = [
            ("convnet", 1, 378_480, 78_400),
            ("convnet", 7, 1_734_384, 548_800),
            ("convnet", 16, 3_920_736, 1_254_400),
            ("convnet", 17, 4_146_720, 1_332_800),
            ("convnet", 256, 60_291_840, 20_070_400),
            ("maxpool", 1, 1_249_792, 766_016),
            ("maxpool", 7, 3_433_216, 1_823_168),
            ("maxpool", 16, 7_004_416, 3_408_896),
            ("maxpool", 17, 7_368_320, 3_585_088),
            ("maxpool", 256, 98_486_272, 45_694_976),
            ("toy", 1, 506, 248),
            ("toy", 7, 3_542, 1_736),
            ("toy", 16, 8_096, 3_968),
            ("toy", 17, 8_602, 4_216),
            ("toy", 256, 129_536, 63_488),
        ];
        // Beside them, both in training and in evaluation, the convolutions' lent work
        // buffers (issue 19, defect 4), the largest layer's per chunk of samples (1, 1, 2, 2
        // and 16 chunks for the batches above), in f32s. convnet: conv0 unfolds columns (C·KH·KW = 9 ≤ 32), 2·9·784;
        // conv1 rows, a sample and its gradient 2·12·28·28, a band of rows 72·432 (a
        // sample's 144·432 exceed 128 KiB: two bands of 72 pixels) and a sample's outputs
        // 144·24; conv2 rows, 2·24·12·12 + 36·864 + 36·32 (one sample fits): conv1's 53,376
        // the largest, 213,504 B. maxpool: conv0 columns 2·9·676; conv1 Winograd (3·3 = 9
        // tiles a sample of 13,824 B each, two samples a 256 KiB piece, padded 14·14·32):
        // twice two padded samples, 36·(592 + 1,168) transformed tiles (a point's 18 rows of
        // 32 and of 64 values, each plane an odd number of 64-byte lines) and two samples'
        // 11·11·64 outputs, 103,936 f32, 415,744 B.
        let lent = |name: &str| match name {
            "convnet" => 213_504,
            "maxpool" => 415_744,
            _ => 0,
        };
        // And once, the packing of the largest product (`backend::cpu::gemm_packing`:
        // 512·(rows rounded to 48, at most 768, + columns rounded to 32)·4 B). convnet: conv2's
        // weight gradient, 32 filters by 24·6·6 = 864 columns, 512·(48 + 864)·4 = 1,867,776 B;
        // maxpool: the Dense 1600→10's, 512·(48 + 1,600)·4 = 3,375,104 B; toy: any of its
        // Dense layers', 512·(48 + 32)·4 = 163,840 B.
        let gemm = |name: &str| match name {
            "convnet" => 1_867_776,
            "maxpool" => 3_375_104,
            _ => 163_840,
        };
        for (name, batch, shard, eval) in pinned {
            let m = &models.iter().find(|(n, _)| *n == name).unwrap().1;
            let chunks = match batch {
                1 | 7 => 1,
                16 | 17 => 2,
                _ => 16,
            };
            let lent = lent(name) * chunks + gemm(name);
            assert_eq!(shard_activations(m, batch, 2), shard + lent, "{name}, a shard of {batch}");
            assert_eq!(eval_activations(m, batch), eval + lent, "{name}, an evaluation batch of {batch}");
        }
    }

    #[test]
    fn this_machine_reports_its_available_memory() {
        // Linux (the project's machines) has /proc/meminfo; the figure is positive.
        let a = available().expect("MemAvailable");
        assert!(a.bytes > 0);
    }

    /// A GPU replica runs the Llama's SiLUs as themselves, each keeping its slope (T·F
    /// values a sample), where the CPU runs them inside their products; the transposes
    /// around its attentions keep nothing either way.
    #[test]
    fn a_gpu_shard_counts_the_nodes_the_cpu_runs_inside_others() {
        let config = crate::models::LlamaConfig::new(16, 32, 2, 2, 16);
        let model = crate::models::llama(config).unwrap();
        let (t, f) = (config.context as u64, config.hidden as u64);
        let slopes = config.layers as u64 * t * f * 4;
        assert_eq!(gpu_shard_activations(&model, 3), shard_activations(&model, 3, 1) + 3 * slopes);
    }
}
