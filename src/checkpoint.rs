//! Checkpoints: everything a run needs to continue exactly where it stopped.
//!
//! A checkpoint is one safetensors file `DIR/checkpoint-<step>.safetensors` holding the
//! parameters and buffers (`param.<name>`, `buffer.<name>`), the optimiser state
//! (`optim.<m|v>.<name>`), and in its metadata the position (global step, epoch, step
//! within the epoch, optimiser step count), the epoch's running training metrics (so
//! that a resumed epoch reports all of its steps), the best held-out epoch so far (for
//! early stopping and `save_best`), the run's configuration (compared on resume), the
//! caller's record of how the run is configured (one JSON value, not compared: the
//! command line's, so that `--resume DIR` alone continues the run), and a checksum of
//! every byte of all that. Nothing else is needed: every random number of a run is a
//! function of (seed, epoch, step, logical replica), so the shuffle order, the dropout masks and
//! the learning-rate schedule follow from the position. A run resumed from a checkpoint
//! therefore ends with bitwise the weights of the run that was never interrupted, also
//! on another number of devices as long as the logical replicas are the same (they are
//! part of the configuration).
//!
//! Files are written atomically (temporary file, fsync, rename, fsync of the directory),
//! with their header in one fixed order (the same state makes the same bytes); the last
//! K are kept. Reading maps the file after checking its header (`safetensors_io`). A
//! file that fails to parse, whose checksum differs, or whose position does not hold
//! together (an optimiser step count other than the step) is corrupt; resuming refuses
//! it unless asked to fall back to the newest good one. One run at a time owns a
//! directory: see `dirlock`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::digest::Fnv1a;
use crate::dirlock::DirLock;
use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
use crate::nn::{Graph, ParamStore};
use crate::ops::cross_entropy::Metrics;
use crate::optim::Optimizer;
use crate::weights::{f32_values, read_file, to_safetensors_bytes};

const PREFIX: &str = "checkpoint-";
const SUFFIX: &str = ".safetensors";

/// The epoch with the lowest held-out loss: what early stopping and `save_best` compare
/// against, kept in a checkpoint so that a resumed run compares against the same.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BestEpoch {
    /// 0-based.
    pub epoch: usize,
    pub metrics: Metrics,
}

/// Where a run stands: what a checkpoint restores.
#[derive(Clone, Debug, PartialEq)]
pub struct Resume {
    pub weights: ParamStore,
    pub optimizer: Optimizer,
    /// Global steps taken.
    pub step: u64,
    /// The epoch the next step belongs to, and the steps of it already taken.
    pub epoch: usize,
    pub step_in_epoch: usize,
    /// Training metrics of those `step_in_epoch` steps (empty at an epoch's start).
    pub epoch_metrics: Metrics,
    /// The best held-out epoch so far, if the run has a held-out set.
    pub best: Option<BestEpoch>,
}

impl Resume {
    /// The state at `step` with nothing of an epoch or a best epoch carried: what a
    /// caller building a `Resume` by hand usually wants.
    pub fn at(weights: ParamStore, optimizer: Optimizer, step: u64, epoch: usize, step_in_epoch: usize) -> Resume {
        Resume { weights, optimizer, step, epoch, step_in_epoch, epoch_metrics: Metrics::default(), best: None }
    }
}

/// When and where checkpoints are written.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointPolicy {
    pub dir: PathBuf,
    /// Write one every this many steps (and at the end, and on interruption).
    pub every: u64,
    /// Keep this many, newest first.
    pub keep: usize,
    /// The run's configuration, compared field by field on resume.
    pub config: BTreeMap<String, String>,
    /// The caller's record of how the run is configured: one JSON value stored with every
    /// checkpoint (under `lockstep.run`) and handed back by [`read_record`], never
    /// compared. The command line keeps its `TrainConfig` and its own choices here, in a
    /// format it versions itself.
    pub record: Option<serde_json::Value>,
}

/// What a checkpoint holds of its run's record ([`CheckpointPolicy::record`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    /// The record, as it was written.
    Json(serde_json::Value),
    /// None: the run kept no record (a caller of the library's).
    Absent,
    /// Flags as text, one `stored.<flag>` entry each: a checkpoint of a lockstep from
    /// before the record, which this one does not read.
    EarlierFlags,
}

/// What to do when the newest checkpoint is corrupt.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fallback {
    /// Refuse, naming the corrupt file.
    Refuse,
    /// Use the newest checkpoint that is intact, saying which was skipped.
    NewestGood,
}

/// 64-bit FNV-1a over a sequence of byte slices.
fn checksum<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    parts.into_iter().fold(Fnv1a::new(), Fnv1a::bytes).finish()
}

/// The checksum of a checkpoint: every metadata entry (position, configuration) and
/// every tensor's name, dtype, shape and bytes, in sorted order.
fn digest<'a>(meta: &'a BTreeMap<String, String>, tensors: impl Iterator<Item = (&'a str, &'a [u8])>) -> u64 {
    let entries = meta.iter().flat_map(|(k, v)| [k.as_bytes(), b"=", v.as_bytes(), b"\n"]);
    checksum(entries.chain(tensors.flat_map(|(d, b)| [d.as_bytes(), b])))
}

fn file_name(step: u64) -> String {
    format!("{PREFIX}{step:012}{SUFFIX}")
}

/// Whether a run with checkpoints in a directory writes, replaces or removes the file of
/// that directory called `name`: a checkpoint (any step's), or the directory's lock.
#[cfg(feature = "cli")]
pub(crate) fn is_run_file(name: &std::ffi::OsStr) -> bool {
    let name = name.to_string_lossy();
    let step = name.strip_prefix(PREFIX).and_then(|s| s.strip_suffix(SUFFIX));
    name == crate::dirlock::LOCK_FILE || step.is_some_and(|s| s.parse::<u64>().is_ok())
}

/// Checkpoint files in `dir`, oldest first.
pub fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut out = Vec::new();
    for e in entries {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(step) = name.strip_prefix(PREFIX).and_then(|s| s.strip_suffix(SUFFIX)).and_then(|s| s.parse().ok())
        {
            out.push((step, e.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// The run a checkpoint's header says it belongs to: its compared configuration (the
/// `config.` entries, `CheckpointPolicy::config`), which every checkpoint of one run
/// carries alike.
fn run_of(meta: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    meta.iter().filter_map(|(k, v)| k.strip_prefix(key::CONFIG).map(|k| (k.to_string(), v.clone()))).collect()
}

fn name_of(path: &Path) -> String {
    path.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned())
}

/// Refuses a directory whose checkpoints belong to more than one run (a checkpoint
/// copied in from another run, say): resuming would continue whichever is newest, and a
/// run's pruning would delete the other's. The error names both runs, by a file of each
/// and the first setting in which they differ. Checkpoints whose header does not read are
/// left to [`load`], which says what is wrong with them.
pub fn check_one_run(dir: &Path) -> Result<()> {
    let mut runs: Vec<(BTreeMap<String, String>, Vec<PathBuf>)> = Vec::new();
    for (_, path) in list(dir)? {
        let Ok(meta) = read_file(&path).and_then(|f| f.metadata()) else { continue };
        let run = run_of(&meta);
        match runs.iter_mut().find(|(r, _)| *r == run) {
            Some((_, files)) => files.push(path),
            None => runs.push((run, vec![path])),
        }
    }
    let [(a, fa), (b, fb), ..] = &runs[..] else { return Ok(()) };
    let keys = a.keys().chain(b.keys());
    let differs = keys.clone().find(|k| a.get(*k) != b.get(*k)).expect("two runs differ somewhere");
    let value = |r: &BTreeMap<String, String>| r.get(differs).cloned().unwrap_or_else(|| "not set".into());
    let files = |f: &[PathBuf]| match f.len() {
        1 => name_of(&f[0]),
        n => format!("{} and {} more", name_of(&f[n - 1]), n - 1),
    };
    Err(Error::format(
        dir,
        format!(
            "holds the checkpoints of {} runs, which differ in {differs}: {} in {}, {} in {}; one directory holds one run (move the other's files out)",
            runs.len(),
            value(a),
            files(fa),
            value(b),
            files(fb)
        ),
    ))
}

/// Makes `dir` this run's checkpoint directory: creates it (a file of that name is an
/// error saying so), takes its lock (see `dirlock`: a directory another run holds is
/// refused naming that run's pid), and only then clears what killed writes left — never
/// a temporary file of a run still writing.
pub fn claim_dir(dir: &Path) -> Result<DirLock> {
    if dir.exists() && !dir.is_dir() {
        return Err(Error::format(dir, "is a file, not a directory"));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let lock = DirLock::acquire(dir)?;
    prepare_dir(dir)?;
    Ok(lock)
}

/// Checks that `dir` exists (creating it) and is writable, before any training.
/// Also removes the temporary files of writes that a killed process never finished.
pub fn prepare_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let probe = dir.join(format!(".write-test-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| Error::io(dir, e))?;
    std::fs::remove_file(&probe).map_err(|e| Error::io(&probe, e))?;
    for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&format!(".{PREFIX}")) && name.contains(".tmp-") {
            std::fs::remove_file(e.path()).map_err(|err| Error::io(e.path(), err))?;
        }
    }
    Ok(())
}

/// The metadata keys of the position and of the carried metrics.
mod key {
    pub const STEP: &str = "lockstep.step";
    pub const EPOCH: &str = "lockstep.epoch";
    pub const STEP_IN_EPOCH: &str = "lockstep.step_in_epoch";
    pub const OPTIMIZER_STEPS: &str = "lockstep.optimizer_steps";
    pub const CHECKSUM: &str = "lockstep.checksum";
    /// `Metrics` of the epoch so far, and of the best epoch: `<prefix>.loss_sum` (the
    /// f64's bits in hex, so that it round-trips exactly), `.correct`, `.count`.
    pub const EPOCH_METRICS: &str = "lockstep.epoch_metrics";
    pub const BEST_METRICS: &str = "lockstep.best_metrics";
    pub const BEST_EPOCH: &str = "lockstep.best_epoch";
    /// The prefix of the compared configuration's entries.
    pub const CONFIG: &str = "config.";
    /// The caller's record, one JSON value.
    pub const RECORD: &str = "lockstep.run";
    /// The prefix under which a lockstep before the record stored its flags, as text.
    pub const EARLIER_FLAGS: &str = "stored.";
}

fn put_metrics(meta: &mut BTreeMap<String, String>, prefix: &str, m: &Metrics) {
    meta.insert(format!("{prefix}.loss_sum"), format!("{:016x}", m.loss_sum.to_bits()));
    meta.insert(format!("{prefix}.correct"), m.correct.to_string());
    meta.insert(format!("{prefix}.count"), m.count.to_string());
}

/// Writes a checkpoint of `state` and removes all but the newest `policy.keep`.
/// Returns the file written.
pub fn save(model: &Graph, state: &Resume, policy: &CheckpointPolicy) -> Result<PathBuf> {
    let mut tensors: Vec<(String, Vec<usize>, &[f32])> = Vec::new();
    for t in model.param_infos() {
        tensors.push((format!("param.{}", t.name), t.shape.dims().to_vec(), &state.weights.params[t.range.clone()]));
    }
    for t in model.buffer_infos() {
        tensors.push((format!("buffer.{}", t.name), t.shape.dims().to_vec(), &state.weights.buffers[t.range.clone()]));
    }
    for (which, flat) in state.optimizer.state() {
        for t in model.param_infos() {
            tensors.push((format!("optim.{which}.{}", t.name), t.shape.dims().to_vec(), &flat[t.range.clone()]));
        }
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut meta: BTreeMap<String, String> =
        policy.config.iter().map(|(k, v)| (format!("{}{k}", key::CONFIG), v.clone())).collect();
    if let Some(record) = &policy.record {
        meta.insert(key::RECORD.into(), record.to_string());
    }
    meta.insert(key::STEP.into(), state.step.to_string());
    meta.insert(key::EPOCH.into(), state.epoch.to_string());
    meta.insert(key::STEP_IN_EPOCH.into(), state.step_in_epoch.to_string());
    meta.insert(key::OPTIMIZER_STEPS.into(), state.optimizer.steps().to_string());
    put_metrics(&mut meta, key::EPOCH_METRICS, &state.epoch_metrics);
    if let Some(best) = &state.best {
        meta.insert(key::BEST_EPOCH.into(), best.epoch.to_string());
        put_metrics(&mut meta, key::BEST_METRICS, &best.metrics);
    }
    // The checksum of `digest`, fed value by value: no copy of the tensors' bytes.
    let entries = meta.iter().flat_map(|(k, v)| [k.as_bytes(), b"=", v.as_bytes(), b"\n"]);
    let mut sum = entries.fold(Fnv1a::new(), Fnv1a::bytes);
    for (name, shape, values) in &tensors {
        sum = sum.bytes(format!("{name} F32 {shape:?}").as_bytes());
        sum = values.iter().fold(sum, |h, v| h.bytes(&v.to_le_bytes()));
    }
    meta.insert(key::CHECKSUM.into(), format!("{:016x}", sum.finish()));
    let bytes = to_safetensors_bytes(&tensors, &meta)?;
    let path = policy.dir.join(file_name(state.step));
    write_atomic(&path, &bytes)?;
    if let Ok(d) = std::fs::File::open(&policy.dir) {
        let _ = d.sync_all(); // the rename itself reaches the disk
    }
    // Checkpoints past this step belong to a future this run abandoned (it resumed from
    // an earlier one); of the rest, the newest `keep` stay, this one always among them.
    // Only this run's are counted or removed: a file of another run is never touched.
    let ours = |p: &Path| read_file(p).and_then(|f| f.metadata()).is_ok_and(|m| run_of(&m) == policy.config);
    let (past, future): (Vec<_>, Vec<_>) =
        list(&policy.dir)?.into_iter().filter(|(_, p)| ours(p)).partition(|(s, _)| *s <= state.step);
    let old = past.len().saturating_sub(policy.keep.max(1));
    for (_, p) in past.iter().take(old).chain(&future) {
        std::fs::remove_file(p).map_err(|e| Error::io(p, e))?;
    }
    Ok(path)
}

/// The record a checkpoint holds of its run (`CheckpointPolicy::record`), read from its
/// header alone, and its step. A record that is not JSON is corrupt.
pub fn read_record(path: &Path) -> Result<(u64, Record)> {
    let meta = read_file(path)?.metadata()?;
    let step = meta
        .get(key::STEP)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| Error::format(path, format!("not a lockstep checkpoint (no '{}')", key::STEP)))?;
    let record = match meta.get(key::RECORD) {
        Some(text) => Record::Json(
            serde_json::from_str(text)
                .map_err(|e| Error::format(path, format!("'{}' is not JSON: {e}", key::RECORD)))?,
        ),
        None if meta.keys().any(|k| k.starts_with(key::EARLIER_FLAGS)) => Record::EarlierFlags,
        None => Record::Absent,
    };
    Ok((step, record))
}

/// Reads and verifies one checkpoint for `model` against the run's `config`.
pub fn load(model: &Graph, path: &Path, config: &BTreeMap<String, String>, optimizer: &Optimizer) -> Result<Resume> {
    let file = read_file(path)?;
    let st = file.parse()?;
    let meta = file.metadata()?;
    let get = |k: &str| meta.get(k).ok_or_else(|| Error::format(path, format!("not a lockstep checkpoint (no '{k}')")));
    let num =
        |k: &str| -> Result<u64> { get(k)?.parse().map_err(|_| Error::format(path, format!("'{k}' is not a number"))) };
    // Integrity first: a corrupt file says nothing trustworthy about its configuration.
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let views: Vec<_> = names
        .iter()
        .map(|n| st.tensor(n).map(|v| (n.clone(), v)))
        .collect::<Result<_, _>>()
        .map_err(|e| Error::format(path, format!("unreadable tensor: {e}")))?;
    let described: Vec<String> = views.iter().map(|(n, v)| format!("{n} {:?} {:?}", v.dtype(), v.shape())).collect();
    let signed: BTreeMap<String, String> =
        meta.iter().filter(|(k, _)| k.as_str() != key::CHECKSUM).map(|(k, v)| (k.clone(), v.clone())).collect();
    let sum = digest(&signed, described.iter().map(String::as_str).zip(views.iter().map(|(_, v)| v.data())));
    if get(key::CHECKSUM)? != &format!("{sum:016x}") {
        return Err(Error::format(path, "checksum mismatch: the checkpoint is corrupt"));
    }
    for (k, want) in config {
        match meta.get(&format!("{}{k}", key::CONFIG)) {
            Some(have) if have == want => {}
            Some(have) => {
                return Err(Error::format(
                    path,
                    format!("written by a different run: {k} is {have} there, {want} here"),
                ))
            }
            None => return Err(Error::format(path, format!("written by a different run: it has no {k}"))),
        }
    }
    // The checksum is no signature (FNV is public): a file forged with a matching one
    // must still describe a position that a run can reach.
    let step = num(key::STEP)?;
    let named = name_of(path).strip_prefix(PREFIX).and_then(|n| n.strip_suffix(SUFFIX)).and_then(|n| n.parse().ok());
    if let Some(named) = named.filter(|n: &u64| *n != step) {
        return Err(Error::format(path, format!("is named for step {named} but holds step {step}")));
    }
    let optimizer_steps = num(key::OPTIMIZER_STEPS)?;
    if optimizer_steps != step {
        return Err(Error::format(
            path,
            format!("'{}' is {optimizer_steps} but the step is {step}: every step takes one", key::OPTIMIZER_STEPS),
        ));
    }
    let small = |k: &str| -> Result<usize> {
        let v = num(k)?;
        usize::try_from(v)
            .ok()
            .filter(|&v| v as u64 <= step.max(1))
            .ok_or_else(|| Error::format(path, format!("'{k}' is {v}, more than the {step} steps taken")))
    };
    let (epoch, step_in_epoch) = (small(key::EPOCH)?, small(key::STEP_IN_EPOCH)?);
    let metrics = |prefix: &str| -> Result<Metrics> {
        let bits = u64::from_str_radix(get(&format!("{prefix}.loss_sum"))?, 16)
            .map_err(|_| Error::format(path, format!("'{prefix}.loss_sum' is not a number")))?;
        Ok(Metrics {
            loss_sum: f64::from_bits(bits),
            correct: num(&format!("{prefix}.correct"))?,
            count: num(&format!("{prefix}.count"))?,
        })
    };
    let epoch_metrics = metrics(key::EPOCH_METRICS)?;
    let best = match meta.contains_key(key::BEST_EPOCH) {
        true => Some(BestEpoch { epoch: small(key::BEST_EPOCH)?, metrics: metrics(key::BEST_METRICS)? }),
        false => None,
    };
    let tensor = |name: &str, len: usize| -> Result<Vec<f32>> {
        let v = st.tensor(name).map_err(|_| Error::format(path, format!("missing tensor '{name}'")))?;
        let values = f32_values(&v);
        if values.len() != len {
            return Err(Error::format(path, format!("tensor '{name}' has {} values, expected {len}", values.len())));
        }
        Ok(values)
    };
    let mut weights = ParamStore { params: vec![0.0; model.params_len()], buffers: vec![0.0; model.buffers_len()] };
    for t in model.param_infos() {
        weights.params[t.range.clone()].copy_from_slice(&tensor(&format!("param.{}", t.name), t.range.len())?);
    }
    for t in model.buffer_infos() {
        weights.buffers[t.range.clone()].copy_from_slice(&tensor(&format!("buffer.{}", t.name), t.range.len())?);
    }
    let mut opt = Optimizer::new(*optimizer.config(), model.params_len());
    let mut state = Vec::new();
    for (which, _) in optimizer.state() {
        let mut flat = vec![0.0f32; model.params_len()];
        for t in model.param_infos() {
            flat[t.range.clone()].copy_from_slice(&tensor(&format!("optim.{which}.{}", t.name), t.range.len())?);
        }
        state.push((which, flat));
    }
    opt.restore(optimizer_steps, &state)?;
    Ok(Resume { weights, optimizer: opt, step, epoch, step_in_epoch, epoch_metrics, best })
}

/// The newest usable checkpoint in `dir`, or `None` if there is none. A corrupt newest
/// one is an error unless `fallback` allows the newest good one; so is a directory whose
/// every checkpoint is corrupt. Returns the checkpoint, its file, and the corrupt files
/// skipped.
pub fn load_latest(
    model: &Graph,
    dir: &Path,
    config: &BTreeMap<String, String>,
    optimizer: &Optimizer,
    fallback: Fallback,
) -> Result<Option<(Resume, PathBuf, Vec<PathBuf>)>> {
    check_one_run(dir)?;
    let mut skipped = Vec::new();
    let mut newest_problem = None;
    for (_, path) in list(dir)?.into_iter().rev() {
        match load(model, &path, config, optimizer) {
            Ok(r) => return Ok(Some((r, path, skipped))),
            Err(e) if fallback == Fallback::NewestGood && is_corruption(&e) => {
                newest_problem.get_or_insert_with(|| strip_path(&e));
                skipped.push(path);
            }
            Err(e) if is_corruption(&e) => {
                return Err(Error::format(
                    &path,
                    format!("{}; pass --resume-fallback to continue from the newest intact checkpoint", strip_path(&e)),
                ))
            }
            Err(e) => return Err(e),
        }
    }
    if let (Some(problem), Some(newest)) = (newest_problem, skipped.first()) {
        return Err(Error::format(
            dir,
            format!(
                "every checkpoint in it is corrupt ({} file{}; the newest, {}: {problem})",
                skipped.len(),
                if skipped.len() == 1 { "" } else { "s" },
                newest.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned())
            ),
        ));
    }
    Ok(None)
}

fn is_corruption(e: &Error) -> bool {
    matches!(e, Error::Format { detail, .. } if !detail.starts_with("written by a different run"))
}

fn strip_path(e: &Error) -> String {
    match e {
        Error::Format { detail, .. } => detail.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models;
    use crate::optim::OptimizerConfig;

    /// A fresh checkpoint directory, removed with the returned guard.
    fn tmp() -> (tempfile::TempDir, PathBuf) {
        let guard = tempfile::tempdir().unwrap();
        let d = guard.path().join("ck");
        prepare_dir(&d).unwrap();
        (guard, d)
    }

    fn state(model: &Graph, step: u64) -> Resume {
        let mut optimizer = Optimizer::new(OptimizerConfig::adam(1e-3), model.params_len());
        let scalars = optimizer.begin_step(1.0, 1.0);
        // A gradient in every tensor, none in the gaps between them (no layer writes there;
        // checkpoints store tensors only).
        let mut g = vec![0.0f32; model.params_len()];
        for i in model.param_infos().iter().flat_map(|t| t.range.clone()) {
            g[i] = i as f32 * 1e-3;
        }
        let mut w = model.init(1);
        optimizer.update(0, &mut w.params, &g, &scalars);
        // One optimiser step per step, as a run takes.
        optimizer.restore(step, &[]).unwrap();
        // 3 steps into epoch 2, of 24 samples: loss sum 12.5, 20 right (values as chosen).
        let epoch_metrics = Metrics { loss_sum: 12.5, correct: 20, count: 24 };
        let best = Some(BestEpoch { epoch: 1, metrics: Metrics { loss_sum: 0.1 + 0.2, correct: 7, count: 8 } });
        Resume { weights: w, optimizer, step, epoch: 2, step_in_epoch: 3, epoch_metrics, best }
    }

    fn policy(dir: &Path, keep: usize) -> CheckpointPolicy {
        let config = BTreeMap::from([("model".to_string(), "toy".to_string()), ("batch_size".into(), "8".into())]);
        let record = Some(serde_json::json!({"format": 1, "lr": 0.5, "model": {"builtin": "toy"}}));
        CheckpointPolicy { dir: dir.to_path_buf(), every: 1, keep, config, record }
    }

    #[test]
    fn a_checkpoint_round_trips_bitwise_and_only_the_last_k_are_kept() {
        let model = models::toy_mlp(2, 2).unwrap();
        let (_guard, dir) = tmp();
        let p = policy(&dir, 2);
        for step in [5, 10, 15] {
            save(&model, &state(&model, step), &p).unwrap();
        }
        let files: Vec<u64> = list(&dir).unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(files, vec![10, 15]);
        let fresh = Optimizer::new(OptimizerConfig::adam(1e-3), model.params_len());
        let (r, path, skipped) = load_latest(&model, &dir, &p.config, &fresh, Fallback::Refuse).unwrap().unwrap();
        assert_eq!(r, state(&model, 15));
        assert!(path.ends_with(file_name(15)));
        assert!(skipped.is_empty());
    }

    #[test]
    fn corruption_is_detected_and_fallback_is_explicit() {
        let model = models::toy_mlp(2, 2).unwrap();
        let (_guard, dir) = tmp();
        let p = policy(&dir, 3);
        save(&model, &state(&model, 11), &p).unwrap();
        let newest = save(&model, &state(&model, 12), &p).unwrap();
        let mut bytes = std::fs::read(&newest).unwrap();
        let n = bytes.len();
        bytes[n - 3] ^= 0x40; // one flipped bit in the last tensor
        std::fs::write(&newest, &bytes).unwrap();
        let fresh = Optimizer::new(OptimizerConfig::adam(1e-3), model.params_len());
        let e = load_latest(&model, &dir, &p.config, &fresh, Fallback::Refuse).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch") && e.contains("--resume-fallback"), "{e}");
        let (r, _, skipped) = load_latest(&model, &dir, &p.config, &fresh, Fallback::NewestGood).unwrap().unwrap();
        assert_eq!(r.step, 11);
        assert_eq!(skipped, vec![newest.clone()]);
        // a truncated file is corrupt too
        std::fs::write(&newest, &bytes[..n / 2]).unwrap();
        let e = load_latest(&model, &dir, &p.config, &fresh, Fallback::Refuse).unwrap_err().to_string();
        assert!(e.contains("--resume-fallback"), "{e}");
    }

    /// Issue 19, defect 3: a checkpoint of another run copied into a directory (seed 7 among
    /// seed 0's) made a resume continue it without a word, and that run's pruning then
    /// deleted every checkpoint of the first; a file renamed to another step was accepted.
    #[test]
    fn a_directory_of_two_runs_is_refused_and_pruning_keeps_to_its_own_run() {
        let model = models::toy_mlp(2, 2).unwrap();
        let (_guard, dir) = tmp();
        let p = policy(&dir, 2);
        for step in [3, 6] {
            save(&model, &state(&model, step), &p).unwrap();
        }
        let mut seven = p.clone();
        seven.config.insert("seed".into(), "7".into());
        let foreign = save(&model, &state(&model, 9), &seven).unwrap();
        // The other run's pruning (keep 2, of 3 files) removed none of the first run's.
        let steps: Vec<u64> = list(&dir).unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, [3, 6, 9]);
        let fresh = Optimizer::new(OptimizerConfig::adam(1e-3), model.params_len());
        for e in [
            load_latest(&model, &dir, &p.config, &fresh, Fallback::NewestGood).unwrap_err().to_string(),
            check_one_run(&dir).unwrap_err().to_string(),
        ] {
            assert!(e.contains("holds the checkpoints of 2 runs, which differ in seed"), "{e}");
            assert!(e.contains("not set in checkpoint-000000000006.safetensors and 1 more"), "{e}");
            assert!(e.contains("7 in checkpoint-000000000009.safetensors"), "{e}");
        }
        std::fs::remove_file(&foreign).unwrap();
        // Saving again prunes this run's own: 3 goes, 6 and 12 stay.
        save(&model, &state(&model, 12), &p).unwrap();
        let steps: Vec<u64> = list(&dir).unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, [6, 12]);
        // A file whose name and content disagree is refused.
        std::fs::copy(dir.join(file_name(6)), dir.join(file_name(99))).unwrap();
        let e = load_latest(&model, &dir, &p.config, &fresh, Fallback::Refuse).unwrap_err().to_string();
        assert!(
            e.contains("checkpoint-000000000099.safetensors") && e.contains("is named for step 99 but holds step 6"),
            "{e}"
        );
    }

    #[test]
    fn another_configuration_is_refused_naming_the_difference() {
        let model = models::toy_mlp(2, 2).unwrap();
        let (_guard, dir) = tmp();
        let p = policy(&dir, 1);
        save(&model, &state(&model, 4), &p).unwrap();
        let mut other = p.config.clone();
        other.insert("batch_size".into(), "16".into());
        let fresh = Optimizer::new(OptimizerConfig::adam(1e-3), model.params_len());
        let e = load_latest(&model, &dir, &other, &fresh, Fallback::NewestGood).unwrap_err().to_string();
        assert!(e.contains("batch_size is 8 there, 16 here"), "{e}");
    }

    #[test]
    fn a_resumed_run_replaces_the_abandoned_future_and_never_deletes_what_it_wrote() {
        let model = models::toy_mlp(2, 2).unwrap();
        let (_guard, dir) = tmp();
        let p = policy(&dir, 1);
        for step in [10, 30] {
            save(&model, &state(&model, step), &CheckpointPolicy { keep: 5, ..p.clone() }).unwrap();
        }
        // Resumed from 10 (30 was, say, corrupt): writing 11 removes 30 and keeps 11 alone.
        let written = save(&model, &state(&model, 11), &p).unwrap();
        assert!(written.exists());
        assert_eq!(list(&dir).unwrap().into_iter().map(|(s, _)| s).collect::<Vec<_>>(), vec![11]);
        // A killed write's temporary file goes when the directory is prepared again.
        let stale = dir.join(".checkpoint-000000000012.safetensors.tmp-99999");
        std::fs::write(&stale, b"half").unwrap();
        prepare_dir(&dir).unwrap();
        assert!(!stale.exists());
    }

    #[test]
    fn the_checksum_covers_the_position_and_the_configuration() {
        let model = models::toy_mlp(2, 2).unwrap();
        let (_guard, dir) = tmp();
        let p = policy(&dir, 1);
        let path = save(&model, &state(&model, 4), &p).unwrap();
        // Same length, another position: "step_in_epoch":"3" → "4" in the JSON header.
        let mut bytes = std::fs::read(&path).unwrap();
        let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = String::from_utf8(bytes[8..header_end].to_vec()).unwrap();
        let at = header.find("\"lockstep.step_in_epoch\":\"3\"").expect("the field is in the header");
        let digit = 8 + at + "\"lockstep.step_in_epoch\":\"".len();
        assert_eq!(bytes[digit], b'3');
        bytes[digit] = b'4';
        std::fs::write(&path, &bytes).unwrap();
        let fresh = Optimizer::new(OptimizerConfig::adam(1e-3), model.params_len());
        let e = load(&model, &path, &p.config, &fresh).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch"), "{e}");
    }

    #[test]
    fn every_checkpoint_corrupt_is_said_so_even_with_fallback() {
        let model = models::toy_mlp(2, 2).unwrap();
        let (_guard, dir) = tmp();
        let p = policy(&dir, 3);
        for step in [11, 12] {
            let path = save(&model, &state(&model, step), &p).unwrap();
            let mut bytes = std::fs::read(&path).unwrap();
            let n = bytes.len();
            bytes[n - 1] ^= 1;
            std::fs::write(&path, &bytes).unwrap();
        }
        let fresh = Optimizer::new(OptimizerConfig::adam(1e-3), model.params_len());
        let e = load_latest(&model, &dir, &p.config, &fresh, Fallback::NewestGood).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "{}: every checkpoint in it is corrupt (2 files; the newest, checkpoint-000000000012.safetensors: checksum mismatch: the checkpoint is corrupt)",
                dir.display()
            )
        );
    }

    #[test]
    fn a_forged_optimizer_step_count_is_refused() {
        // The issue: a checkpoint claiming optimizer_steps = u64::MAX (its checksum
        // recomputed, FNV being public) was accepted. Saved here with a correct checksum.
        let model = models::toy_mlp(2, 2).unwrap();
        let (_guard, dir) = tmp();
        let p = policy(&dir, 1);
        let mut forged = state(&model, 4);
        forged.optimizer.restore(u64::MAX, &[]).unwrap();
        let path = save(&model, &forged, &p).unwrap();
        let fresh = Optimizer::new(OptimizerConfig::adam(1e-3), model.params_len());
        let e = load(&model, &path, &p.config, &fresh).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "{}: 'lockstep.optimizer_steps' is 18446744073709551615 but the step is 4: every step takes one",
                path.display()
            )
        );
    }

    #[test]
    fn the_same_state_makes_the_same_bytes_and_the_record_comes_back() {
        let model = models::toy_mlp(2, 2).unwrap();
        let (_guard, dir) = tmp();
        let p = policy(&dir, 5);
        let first = std::fs::read(save(&model, &state(&model, 4), &p).unwrap()).unwrap();
        let again = std::fs::read(save(&model, &state(&model, 4), &p).unwrap()).unwrap();
        assert_eq!(first, again);
        let path = dir.join(file_name(4));
        let (step, record) = read_record(&path).unwrap();
        assert_eq!((step, record), (4, Record::Json(p.record.clone().unwrap())));
        // One key, the record's JSON text as written (its keys in their order).
        let meta = read_file(&path).unwrap().metadata().unwrap();
        assert_eq!(meta[key::RECORD], r#"{"format":1,"lr":0.5,"model":{"builtin":"toy"}}"#);
        assert!(!meta.keys().any(|k| k.starts_with(key::EARLIER_FLAGS)), "{meta:?}");
        // A run that keeps no record has none.
        save(&model, &state(&model, 5), &CheckpointPolicy { record: None, ..p.clone() }).unwrap();
        assert_eq!(read_record(&dir.join(file_name(5))).unwrap(), (5, Record::Absent));
    }

    /// A checkpoint of a lockstep before the record stored the CLI's flags as text, one
    /// `stored.<flag>` entry each: it is told apart from one with no record.
    #[test]
    fn a_checkpoint_of_flags_as_text_is_an_earlier_format() {
        let (_guard, dir) = tmp();
        let path = dir.join(file_name(3));
        let meta = BTreeMap::from([
            (key::STEP.to_string(), "3".to_string()),
            ("stored.lr".to_string(), "0.5".to_string()),
            ("stored.model".to_string(), "toy".to_string()),
        ]);
        std::fs::write(&path, to_safetensors_bytes(&[], &meta).unwrap()).unwrap();
        assert_eq!(read_record(&path).unwrap(), (3, Record::EarlierFlags));
    }

    #[test]
    fn an_unwritable_directory_is_reported() {
        let e = prepare_dir(Path::new("/proc/lockstep-no-such-dir")).unwrap_err().to_string();
        assert!(e.starts_with("/proc/lockstep-no-such-dir"), "{e}");
    }
}
