//! The memory of a training run, estimated before anything is allocated: weights, the
//! optimiser state ([`crate::optim::OptimizerConfig::state_names`]), activations (each
//! layer's own account, summed by `crate::memory`), the gradient exchange's slots, the
//! batches in flight; and on a GPU, what each replica holds there.
//!
//! Owns [`training`] (a run of `with_trainer`), [`fitting`] (one of `train_data_parallel`)
//! and [`check_training`], which `with_trainer` calls before it builds anything. The
//! estimate's parts and the machine's memory are `crate::memory`'s.

use crate::devices::Devices;
use crate::error::Result;
use crate::memory::{eval_activations, shard_activations, Estimate, PROCESS_BYTES};
use crate::nn::Graph;
use crate::optim::OptimizerConfig;
use crate::tensor::Device;
use crate::train::TrainConfig;
use crate::units::{count, human};

const F32: u64 = 4;

/// Optimiser state values per parameter, and what they are.
fn optimizer_copies(o: &OptimizerConfig) -> (u64, &'static str) {
    (o.state_names().len() as u64, o.state_description())
}

/// What a run of `model` on `devices` under `config` will allocate on the host, with
/// evaluation passes of `config.eval_batch` samples (what a loop of the user's own inside
/// `with_trainer` may run). GPU devices add what their replicas hold on the GPU, checked
/// by `check_training` against each GPU's memory.
#[cfg(any(test, feature = "cli"))]
pub fn training(model: &Graph, devices: &Devices, config: &TrainConfig) -> Estimate {
    estimate(model, devices, config, config.eval_batch)
}

/// What a run of `train_data_parallel` allocates: `training`'s estimate, but its
/// evaluations pass no more than a training pass's rows
/// ([`TrainConfig::epoch_eval_chunk`]), as the fit loop runs them. Counting `eval_batch` there put the Llama's 512-window evaluation in
/// its estimate, 5.3× the run's peak, where the run evaluates 6 windows at a time.
pub fn fitting(model: &Graph, devices: &Devices, config: &TrainConfig) -> Estimate {
    estimate(model, devices, config, fit_eval_rows(devices, config))
}

/// The rows of the fit loop's evaluation passes: the epoch's chunk for the run's logical
/// replicas (with several processes the trainer's R is larger and its chunk smaller, so
/// this is on the safe side).
pub(crate) fn fit_eval_rows(devices: &Devices, config: &TrainConfig) -> usize {
    config.epoch_eval_chunk(config.replicas.unwrap_or(devices.len()))
}

/// [`training`] with evaluation passes of `eval_rows` samples.
fn estimate(model: &Graph, devices: &Devices, config: &TrainConfig, eval_rows: usize) -> Estimate {
    let n = devices.len().max(1) as u64;
    let r = config.replicas.unwrap_or(devices.len()).max(1) as u64;
    let (p, b) = (model.params_len() as u64, model.buffers_len() as u64);
    let width = p.saturating_add(b);
    let gpus = devices.list().iter().filter(|d| matches!(d, Device::Cuda(_))).count() as u64;
    let cpus = n - gpus;
    let mut e = Estimate::default();
    // The initial weights made once, and each replica's copy of them (GPU replicas keep
    // their host copy until they have uploaded it).
    e.add(
        "weights",
        n.saturating_add(1).saturating_mul(width).saturating_mul(F32),
        format!("{} copies of {} values", n + 1, count(width)),
    );
    let (copies, what) = optimizer_copies(&config.optimizer);
    e.add(
        "optimiser state",
        cpus.saturating_mul(copies).saturating_mul(p).saturating_mul(F32),
        format!("{what}, {cpus} replica(s)"),
    );
    if cpus > 0 {
        let shard = config.batch_size.div_ceil(r as usize);
        let train = shard_activations(model, shard, devices.threads_per_device());
        let eval = eval_activations(model, eval_rows);
        let (bytes, detail) = if train >= eval {
            (train, format!("{cpus} device(s) × a shard of {shard} samples"))
        } else {
            (eval, format!("{cpus} device(s) × an evaluation batch of {eval_rows}"))
        };
        e.add("activations", cpus.saturating_mul(bytes), detail);
        // One [params | buffers] slot per logical replica, plus the reduced chunks.
        e.add(
            "gradient exchange",
            r.saturating_add(1).saturating_mul(width).saturating_mul(F32),
            format!("{r} logical replica slots and the reduced chunks, {} values each", count(width)),
        );
    }
    // At the end, and at every checkpoint, the weights and the optimiser's state are
    // gathered once more: the report returns them; a checkpoint also lays them out as
    // its file's bytes (once to encode them, once as the file), so three copies.
    let state = width.saturating_add(copies.saturating_mul(p)).saturating_mul(F32);
    match config.checkpoint {
        Some(_) => e.add(
            "final state",
            state.saturating_mul(3),
            "the weights and optimiser state gathered, and a checkpoint's bytes (2 copies)",
        ),
        None => e.add("final state", state, "the weights and optimiser state the report returns"),
    };
    // Each CPU device thread that runs a GEMM keeps the GEMM's packing slab for its life,
    // as large as this processor's L2 cache per core (backend::cpu::gemm_thread_workspace).
    let threads = cpus.saturating_mul(devices.threads_per_device() as u64);
    if threads > 0 {
        let slab = crate::backend::cpu::gemm_thread_workspace() as u64;
        e.add(
            "GEMM packing",
            threads.saturating_mul(slab),
            format!("{threads} CPU thread(s) × {} (this processor's L2 cache per core)", human(slab)),
        );
    }
    // What every run has whatever its model: measured as the peak of the toy lesson's run
    // (14 MB) and what the convnet on the digits keeps beyond its counted parts (~60 MB).
    e.add("process", PROCESS_BYTES, "the program, its threads' stacks, the allocator's caches");
    // A sample's row holds every model input's values (`data::Dataset::from_inputs`).
    let per_sample = crate::memory::sample_values(model);
    let in_flight = config.prefetch as u64 + 2;
    e.add(
        "batches",
        in_flight.saturating_mul(config.batch_size as u64).saturating_mul(per_sample).saturating_mul(F32),
        format!("{in_flight} global batches of {} samples in flight", config.batch_size),
    );
    e
}

/// The windows a text run evaluates, drawn once from its held-out token stream `held`
/// (`fit`: `eval_batches` × `batch_size` of them, each of `held`'s T tokens): their count
/// and the bytes they take at the most. Drawn, each token is a stored id (one byte for a
/// vocabulary up to 256, else an f32: `data::token_features`) and a u32 label
/// (`Dataset::subset` copies them straight from the stream); at every evaluation the
/// trainer gathers them all once more, as f32 inputs and u32 labels: 13 bytes a token for
/// bytes, 16 past 256 ids. And each window's index, when it is drawn and when it is
/// gathered, 8 bytes each time.
pub(crate) fn held_out_windows(held: &crate::data::Dataset, config: &TrainConfig) -> (u64, u64) {
    let windows = (config.eval_batches.unwrap_or(crate::train::DEFAULT_EVAL_BATCHES) as u64)
        .saturating_mul(config.batch_size as u64);
    let tokens = windows.saturating_mul(held.sample_shape().numel() as u64);
    let stored = if held.num_classes() <= 256 { 1 } else { F32 };
    let per_token = stored + 4 + (F32 + 4);
    (windows, tokens.saturating_mul(per_token).saturating_add(windows.saturating_mul(16)))
}

/// What one GPU replica holds on its GPU: weights, gradients, optimiser state and one
/// shard's activations (the CPU layers' count, every node counted as itself: the GPU's
/// kernels keep the same tensors, and run no node inside another's passes),
/// and with 16-bit gradients its exchange's wires: every one of the `r` logical
/// replicas' (2 bytes per gradient value, 4 per buffer value), their encoded sum, and
/// that sum decoded.
#[cfg(feature = "cuda")]
fn gpu_replica(model: &Graph, config: &TrainConfig, shard: usize, r: usize) -> Estimate {
    let (p, b) = (model.params_len() as u64, model.buffers_len() as u64);
    let (copies, what) = optimizer_copies(&config.optimizer);
    let mut e = Estimate::default();
    e.add(
        "weights and gradients",
        p.saturating_mul(2).saturating_add(b).saturating_mul(F32),
        "parameters, their gradients, buffers",
    );
    e.add("optimiser state", copies.saturating_mul(p).saturating_mul(F32), what);
    e.add("activations", crate::memory::gpu_shard_activations(model, shard), format!("a shard of {shard} samples"));
    if config.clip_grad_norm.is_some() {
        let partials = crate::optim::norm_partials(model.params_len()).max(1) as u64;
        e.add("gradient norm", partials.saturating_mul(8).saturating_add(F32), "clipping's partial sums and factor");
    }
    if config.grad_compression != crate::exchange::codec::Compression::None {
        let wire = p.saturating_mul(2).saturating_add(b.saturating_mul(4));
        let decoded = p.saturating_add(b).saturating_mul(F32);
        e.add(
            "16-bit wires",
            wire.saturating_mul(r as u64 + 1).saturating_add(decoded),
            format!("{r} logical replicas' wires, their sum, decoded"),
        );
    }
    e
}

/// The check `with_trainer` makes before it allocates anything: the host estimate, with
/// evaluation passes of `eval_rows` samples, against the available memory, and each GPU's
/// replicas against that GPU's memory.
pub fn check_training(model: &Graph, devices: &Devices, config: &TrainConfig, eval_rows: usize) -> Result<()> {
    estimate(model, devices, config, eval_rows).check("training")?;
    #[cfg(feature = "cuda")]
    check_gpus(model, devices, config)?;
    Ok(())
}

/// Each GPU's replicas against that GPU's memory (only with the `cuda` feature: without
/// it `Devices` names no GPU).
#[cfg(feature = "cuda")]
fn check_gpus(model: &Graph, devices: &Devices, config: &TrainConfig) -> Result<()> {
    use crate::memory::Available;
    let ordinals: Vec<usize> =
        devices.list().iter().filter_map(|d| if let Device::Cuda(o) = d { Some(*o) } else { None }).collect();
    if ordinals.is_empty() {
        return Ok(());
    }
    let Ok(gpus) = crate::cuda::probe::gpus() else { return Ok(()) };
    let r = config.replicas.unwrap_or(devices.len()).max(1);
    let shard = config.batch_size.div_ceil(r);
    for g in &gpus {
        let here = ordinals.iter().filter(|&&o| o == g.ordinal).count() as u64;
        if here == 0 {
            continue;
        }
        let one = gpu_replica(model, config, shard, r);
        let mut all = Estimate::default();
        for part in one.parts() {
            all.add(part.name, part.bytes.saturating_mul(here), format!("{} × {here} replica(s)", part.detail));
        }
        let available = Available { bytes: g.total_memory_bytes as u64, source: "on the GPU" };
        all.check_against(&format!("training on cuda:{}", g.ordinal), available)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Available;
    use crate::models;

    #[test]
    #[cfg(feature = "cuda")]
    fn a_gpu_replica_with_16_bit_gradients_counts_its_wires() {
        // Every one of the R = 4 logical replicas' wires (2 bytes per parameter, 4 per
        // buffer value), their sum's, and that sum decoded to f32.
        let model = models::convnet(models::ConvnetOptions::default()).unwrap();
        let (p, b) = (model.params_len() as u64, model.buffers_len() as u64);
        let plain = gpu_replica(&model, &TrainConfig::default(), 8, 4);
        assert!(plain.parts().iter().all(|part| part.name != "16-bit wires"));
        let config =
            TrainConfig { grad_compression: crate::exchange::codec::Compression::Bf16, ..TrainConfig::default() };
        let e = gpu_replica(&model, &config, 8, 4);
        let wires = e.parts().iter().find(|part| part.name == "16-bit wires").expect("counted");
        assert_eq!(wires.bytes, 5 * (2 * p + 4 * b) + 4 * (p + b));
    }

    #[test]
    fn the_toy_run_is_counted_part_by_part() {
        // toy MLP 2-30-20-2: 90 + 620 + 42 = 752 parameters, no buffers, in a flat buffer
        // of 960 values (each of the 6 tensors starts on a multiple of 64: nn::TENSOR_ALIGN).
        let model = models::toy_mlp(2, 2).unwrap();
        let devices = Devices::cpu(2, 1).unwrap();
        let config = TrainConfig { batch_size: 2, ..TrainConfig::default() };
        let e = training(&model, &devices, &config);
        let bytes: Vec<(&str, u64)> = e.parts().iter().map(|p| (p.name, p.bytes)).collect();
        // And each of the 2 device threads' GEMM packing slab, this processor's L2 per core.
        let slab = crate::backend::cpu::gemm_thread_workspace() as u64;
        // weights: 3 copies × 960 × 4; Adam: 2 replicas × 2 × 960 × 4; exchange: (2 + 1) × 960 × 4;
        // the final state the report returns: the 960 values and Adam's 2 × 960, × 4;
        // batches: 6 × 2 samples × 2 values × 4; the process: PROCESS_BYTES.
        // Activations per sample: kept, the Dense inputs 2, 30, 20 as f32 (208 B) and the
        // ReLU masks 30, 20 (50 B); around the running layer, the widest pair 2·30·4 and
        // the sample's copy 2·4 (248 B). A training shard of 1 sample: 506 B; an
        // evaluation batch of 512 needs only the 248: 126,976 B, the larger, on 2 devices;
        // and once a device the packing of its largest product, 512·(48 + 32)·4 = 163,840 B
        // (`backend::cpu::gemm_packing`).
        assert_eq!(
            bytes,
            vec![
                ("weights", 11_520),
                ("optimiser state", 15_360),
                ("activations", 253_952 + 2 * 163_840),
                ("gradient exchange", 11_520),
                ("final state", 11_520),
                ("GEMM packing", 2 * slab),
                ("process", 67_108_864),
                ("batches", 96)
            ]
        );
        assert_eq!(e.total(), 292_448 + 2 * 163_840 + 11_520 + 2 * slab + 67_108_864);
    }

    #[test]
    fn the_batches_and_a_passs_samples_count_every_model_input() {
        // Tokens (6,) and positions (6,): a sample's row is 12 values, as its data's
        // (`Dataset::from_inputs`); its one-input form, the same row as (12,).
        let two = crate::testing::tokens_and_positions(6, 11, 8);
        assert_eq!(crate::memory::sample_values(&two), 12);
        let config = TrainConfig { batch_size: 4, ..TrainConfig::default() };
        let e = training(&two, &Devices::cpu(1, 1).unwrap(), &config);
        let batches = e.parts().iter().find(|p| p.name == "batches").unwrap().bytes;
        // 6 global batches in flight (prefetch 4 + 2) × 4 samples × 12 values × 4 B.
        assert_eq!(batches, 6 * 4 * 12 * 4);
        // A training shard holds its copy of both inputs: the same nodes reading one input
        // of 6 values (the same values alive around each node: 144 at the add) count 6 × 4
        // B a sample fewer, what counting the first input only would have counted.
        use crate::nn::{Call, Embedding, Value};
        let one = Value::input([6]);
        let (tok, pos) = (Embedding::new(11, 8).unwrap().call(&one), Embedding::new(6, 8).unwrap().call(&one));
        let only_tokens = (&tok + &pos).model().unwrap();
        let shard = |m| crate::memory::shard_activations(m, 4, 1);
        assert_eq!(shard(&two) - shard(&only_tokens), 4 * 6 * 4);
    }

    #[test]
    fn a_run_that_does_not_fit_is_refused_with_its_parts() {
        // The issue: a spec Dense 10⁶ → 2000 (2·10⁹ parameters) aborted in the allocator.
        let text = r#"{"input_shape": [1000000], "layers": [{"type": "dense", "units": 2000}, {"type": "dense", "units": 10}]}"#;
        let model = crate::spec::model_from_spec_str(text, "big.json").unwrap();
        let devices = Devices::cpu(1, 1).unwrap();
        let config = TrainConfig { batch_size: 32, ..TrainConfig::default() };
        let available = Available { bytes: 24_000_000_000, source: "available (MemAvailable)" };
        let e = training(&model, &devices, &config).check_against("training", available).unwrap_err().to_string();
        // 1e6·2000 + 2000 + 2000·10 + 10 = 2,000,022,010 parameters, no buffers, whose four
        // tensors start on multiples of 64 in a flat buffer of 2,000,022,144 values
        // (2,000,000,000 + 2,048 + 20,032 + 64): weights (2 copies), Adam (m, v) and the
        // exchange (1 slot + the reduced chunks) are each 2 × 4 B × that = 16,000,177,152 B. Activations: the widest tensor is the input,
        // 10⁶ values, so an evaluation batch of 512 (512 × (2·10⁶·4 + 10⁶·4) =
        // 6,144,000,000 B) outweighs a training shard of 32. Batches: 6 × 32 × 10⁶ × 4 =
        // 768,000,000; the process's 64 MiB; the report's final state, the values and Adam's
        // two moments of the parameters, 24,000,265,728 B. Total 78,979,906,048 B; with the
        // packing of the largest product (the weight gradient's 2,000 rows by 10⁶ columns:
        // 512·(768 + 10⁶)·4 = 2,049,572,864 B, in the activations, 8.2 GB) 81,029,478,912 B,
        // and the one device thread's GEMM slab (this processor's L2 per core, a few MB,
        // which rounds to the same 81.0 GB).
        let slab = human(crate::backend::cpu::gemm_thread_workspace() as u64);
        assert_eq!(
            e,
            format!(
                "training needs an estimated 81.0 GB but 24.0 GB available (MemAvailable): \
                 final state 24.0 GB (the weights and optimiser state the report returns), \
                 weights 16.0 GB (2 copies of 2,000,022,144 values), \
                 optimiser state 16.0 GB (Adam's m and v, 1 replica(s)), \
                 gradient exchange 16.0 GB (1 logical replica slots and the reduced chunks, 2,000,022,144 values each), \
                 activations 8.2 GB (1 device(s) × an evaluation batch of 512), \
                 batches 768.0 MB (6 global batches of 32 samples in flight), \
                 process 67.1 MB (the program, its threads' stacks, the allocator's caches), \
                 GEMM packing {slab} (1 CPU thread(s) × {slab} (this processor's L2 cache per core))"
            )
        );
    }

    #[test]
    fn a_batch_of_a_hundred_thousand_convnet_samples_is_counted() {
        // The issue: --batch-size 100000 exhausted memory. The convnet keeps per sample
        // (f32 unless said): conv0 the larger of its input 784 and output 9,408; bn0 x̂
        // 9,408 (the ReLU after it runs in its passes, its mask x̂'s sign: nothing of its
        // own); conv1 the larger of 9,408 and 3,456; bn1 3,456; conv2 the larger of 3,456
        // and 1,152; bn2 1,152; dense0 its input 32; relu 256 bytes; dropout 256; dense1
        // its input 256: 147,584 B. Around the running layer: the widest pair 2·9,408·4
        // and the sample 784·4: 78,400 B. 225,984 B a sample.
        let model = models::convnet(models::ConvnetOptions::default()).unwrap();
        let devices = Devices::cpu(1, 1).unwrap();
        // And the convolutions' lent work buffers, 213,504 B per chunk (memory.rs's pinned test).
        // And once, conv2's weight-gradient packing, 1,867,776 B (memory.rs's pinned test).
        assert_eq!(shard_activations(&model, 1, 1), 225_984 + 4 * (108 + 10_368 + 27_648) + 213_504 + 1_867_776);
        let config = TrainConfig { batch_size: 100_000, ..TrainConfig::default() };
        let e = training(&model, &devices, &config);
        let acts = e.parts().iter().find(|p| p.name == "activations").unwrap();
        // 100,000 × 225,984 + the conv weight-gradient partials of 16 chunks: 16 × 38,124 × 4,
        // and their lent buffers, 16 × 213,504.
        assert_eq!(acts.bytes, 22_598_400_000 + 16 * 38_124 * 4 + 16 * 213_504 + 1_867_776);
        assert_eq!(acts.detail, "1 device(s) × a shard of 100000 samples");
    }
}
