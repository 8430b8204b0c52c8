//! The PyTorch reference cases, read the one way every test reads them: a case is a
//! safetensors file of named tensors, floats or int64 (`tensors`, `get`, `max_abs`). For
//! the language models (tests/data/gpt, tests/data/llama) a case holds the module's weights
//! before (`init.*`) and after (`final.*`) its training, its token rows (`tokens`) and its
//! losses, and both ran one training recipe (`reference_rows`, `state_dict`,
//! `reference_config`); the image models' cases one run (`image_config`, `image_step0`).
//! Included with `#[path]` by tests/gpt.rs and tests/llama.rs (all of it) and by
//! tests/resnet.rs and tests/densenet.rs (the reading and the image run), hence the
//! `dead_code` allowance.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use lockstep::data::safetensors_file::load_safetensors_dataset;
use lockstep::data::Dataset;
use lockstep::devices::Devices;
use lockstep::nn::{Graph, ParamStore};
use lockstep::optim::{LrSchedule, OptimizerConfig};
use lockstep::train::{Batch, LastBatch, Shuffle, TrainConfig};
use lockstep::weights;

/// Every tensor of a case: (name, shape, values).
pub type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// name → (shape, values) of every tensor of a safetensors file (floats; int64 and
/// float64 as f32).
pub fn tensors(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            let values = match v.dtype() {
                safetensors::Dtype::I64 => {
                    v.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f32).collect()
                }
                safetensors::Dtype::F64 => {
                    v.data().chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap()) as f32).collect()
                }
                _ => weights::f32_values(&v),
            };
            (n, v.shape().to_vec(), values)
        })
        .collect()
}

/// The values of the tensor `name`.
pub fn get<'a>(all: &'a Tensors, name: &str) -> &'a [f32] {
    &all.iter().find(|(n, ..)| n == name).unwrap_or_else(|| panic!("no tensor {name}")).2
}

/// The largest |a − b| over two tensors of one length.
pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The case's token rows as a token-file dataset, written under `tmp` and read back as a
/// user's would be.
pub fn reference_rows(all: &Tensors, tmp: &Path) -> Dataset {
    let (_, shape, rows) = all.iter().find(|(n, ..)| n == "tokens").unwrap();
    let ids: Vec<u8> = rows.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I64, shape.clone(), &ids).unwrap();
    let path = tmp.join("tokens.safetensors");
    safetensors::serialize_to_file([("tokens", view)], None, &path).unwrap();
    load_safetensors_dataset(&path).unwrap()
}

/// The weights under `prefix` (`init.`, `final.`), written to `path` without it: the
/// PyTorch module's state_dict saved as safetensors (a tied tensor under both its names).
pub fn state_dict(all: &Tensors, prefix: &str, path: &Path) -> PathBuf {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = all
        .iter()
        .filter_map(|(n, s, v)| {
            n.strip_prefix(prefix).map(|k| (k.to_string(), s.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
    path.to_path_buf()
}

/// The cases' recipe on `replicas` logical replicas from `initial`: nanoGPT's
/// `configure_optimizers` (AdamW, lr 1e-3, betas (0.9, 0.99), weight decay 0.1), 5 steps
/// of warm-up, a cosine to a tenth, clipping at 1, batches of 6 rows in file order.
pub fn reference_config(initial: ParamStore, replicas: usize) -> TrainConfig {
    TrainConfig {
        epochs: 1,
        batch_size: 6,
        optimizer: OptimizerConfig::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 },
        schedule: LrSchedule::Cosine { floor: 0.1 },
        warmup_steps: 5,
        clip_grad_norm: Some(1.0),
        shuffle: Shuffle::None,
        replicas: Some(replicas),
        check_replicas_every: Some(1),
        initial: Some(initial),
        ..TrainConfig::default()
    }
}

/// The image cases' global batch (tests/data/resnet's and tests/data/densenet's scripts).
pub const IMAGE_BATCH: usize = 24;

/// The image cases' run: `steps` steps of `optimizer` on `replicas` logical replicas,
/// batches of [`IMAGE_BATCH`] in file order from seed 0, the replicas checked every step.
pub fn image_config(steps: u64, replicas: usize, optimizer: OptimizerConfig) -> TrainConfig {
    TrainConfig {
        epochs: 1,
        max_steps: Some(steps),
        batch_size: IMAGE_BATCH,
        optimizer,
        seed: 0,
        shuffle: Shuffle::None,
        last_batch: LastBatch::Keep,
        replicas: Some(replicas),
        check_replicas_every: Some(1),
        ..TrainConfig::default()
    }
}

/// The gradient of an image case's step 0 as a run of `model` on `devices` applies it: one
/// SGD step of lr 1 from the case's initial weights (`dir`/init.safetensors) on the first
/// [`IMAGE_BATCH`] samples of `data` moves each parameter by −g, up to the rounding of
/// p − g.
pub fn image_step0(model: &Graph, devices: &Devices, replicas: usize, dir: &Path, data: &Dataset) -> Vec<f32> {
    let init = weights::load(model, &dir.join("init.safetensors")).unwrap();
    let batch = Batch::gather(data, &(0..IMAGE_BATCH).collect::<Vec<_>>());
    let cfg = TrainConfig { initial: Some(init.clone()), ..image_config(1, replicas, OptimizerConfig::sgd(1.0)) };
    let after = lockstep::train::with_trainer(model, devices, &cfg, |t| {
        t.step(batch)?;
        t.check_replicas()?;
        Ok(t.weights()?.0)
    })
    .unwrap();
    init.params.iter().zip(&after.params).map(|(p0, p1)| p0 - p1).collect()
}
