//! Checkpoints: everything a run needs to continue exactly where it stopped.
//!
//! A checkpoint is one safetensors file `DIR/checkpoint-<step>.safetensors` holding the
//! parameters and buffers (`param.<name>`, `buffer.<name>`), the optimiser state
//! (`optim.<m|v>.<name>`), and in its metadata the position (global step, epoch, step
//! within the epoch, optimiser step count), the run's configuration, and a checksum of
//! every tensor byte. Nothing else is needed: every random number of a run is a function
//! of (seed, epoch, step, logical replica), so the shuffle order, the dropout masks and
//! the learning-rate schedule follow from the position. A run resumed from a checkpoint
//! therefore ends with bitwise the weights of the run that was never interrupted, also
//! on another number of devices as long as the logical replicas are the same (they are
//! part of the configuration).
//!
//! Files are written atomically (temporary file, fsync, rename, fsync of the directory);
//! the last K are kept. A file that fails to parse or whose checksum differs is corrupt;
//! resuming refuses it unless asked to fall back to the newest good one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
use crate::nn::{ParamStore, Sequential};
use crate::optim::Optimizer;
use crate::weights::{f32_values, parse, read_file, to_safetensors_bytes};

const PREFIX: &str = "checkpoint-";
const SUFFIX: &str = ".safetensors";

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
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for &b in p {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
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

/// Writes a checkpoint of `state` and removes all but the newest `policy.keep`.
/// Returns the file written.
pub fn save(model: &Sequential, state: &Resume, policy: &CheckpointPolicy) -> Result<PathBuf> {
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
    let le: Vec<Vec<u8>> = tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let mut meta: BTreeMap<String, String> =
        policy.config.iter().map(|(k, v)| (format!("config.{k}"), v.clone())).collect();
    meta.insert("lockstep.step".into(), state.step.to_string());
    meta.insert("lockstep.epoch".into(), state.epoch.to_string());
    meta.insert("lockstep.step_in_epoch".into(), state.step_in_epoch.to_string());
    meta.insert("lockstep.optimizer_steps".into(), state.optimizer.steps().to_string());
    let described: Vec<String> = tensors.iter().map(|(n, shape, _)| format!("{n} F32 {shape:?}")).collect();
    let sum = digest(&meta, described.iter().map(String::as_str).zip(le.iter().map(Vec::as_slice)));
    let mut meta: std::collections::HashMap<String, String> = meta.into_iter().collect();
    meta.insert("lockstep.checksum".into(), format!("{sum:016x}"));
    let bytes = to_safetensors_bytes(&tensors, Some(meta))?;
    let path = policy.dir.join(file_name(state.step));
    write_atomic(&path, &bytes)?;
    if let Ok(d) = std::fs::File::open(&policy.dir) {
        let _ = d.sync_all(); // the rename itself reaches the disk
    }
    // Checkpoints past this step belong to a future this run abandoned (it resumed from
    // an earlier one); of the rest, the newest `keep` stay, this one always among them.
    let (past, future): (Vec<_>, Vec<_>) = list(&policy.dir)?.into_iter().partition(|(s, _)| *s <= state.step);
    let old = past.len().saturating_sub(policy.keep.max(1));
    for (_, p) in past.iter().take(old).chain(&future) {
        std::fs::remove_file(p).map_err(|e| Error::io(p, e))?;
    }
    Ok(path)
}

/// Reads and verifies one checkpoint for `model` against the run's `config`.
pub fn load(
    model: &Sequential,
    path: &Path,
    config: &BTreeMap<String, String>,
    optimizer: &Optimizer,
) -> Result<Resume> {
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| Error::format(path, format!("unreadable header: {e}")))?;
    let meta = header.metadata().clone().unwrap_or_default();
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
        meta.iter().filter(|(k, _)| k.as_str() != "lockstep.checksum").map(|(k, v)| (k.clone(), v.clone())).collect();
    let sum = digest(&signed, described.iter().map(String::as_str).zip(views.iter().map(|(_, v)| v.data())));
    if get("lockstep.checksum")? != &format!("{sum:016x}") {
        return Err(Error::format(path, "checksum mismatch: the checkpoint is corrupt"));
    }
    for (k, want) in config {
        match meta.get(&format!("config.{k}")) {
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
    opt.restore(num("lockstep.optimizer_steps")?, &state)?;
    Ok(Resume {
        weights,
        optimizer: opt,
        step: num("lockstep.step")?,
        epoch: num("lockstep.epoch")? as usize,
        step_in_epoch: num("lockstep.step_in_epoch")? as usize,
    })
}

/// The newest usable checkpoint in `dir`, or `None` if there is none. A corrupt newest
/// one is an error unless `fallback` allows the newest good one. Returns the checkpoint,
/// its file, and the corrupt files skipped.
pub fn load_latest(
    model: &Sequential,
    dir: &Path,
    config: &BTreeMap<String, String>,
    optimizer: &Optimizer,
    fallback: Fallback,
) -> Result<Option<(Resume, PathBuf, Vec<PathBuf>)>> {
    let mut skipped = Vec::new();
    for (_, path) in list(dir)?.into_iter().rev() {
        match load(model, &path, config, optimizer) {
            Ok(r) => return Ok(Some((r, path, skipped))),
            Err(e) if fallback == Fallback::NewestGood && is_corruption(&e) => skipped.push(path),
            Err(e) if is_corruption(&e) => {
                return Err(Error::format(
                    &path,
                    format!("{}; pass --resume-fallback to continue from the newest intact checkpoint", strip_path(&e)),
                ))
            }
            Err(e) => return Err(e),
        }
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

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lockstep-ckpt-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        prepare_dir(&d).unwrap();
        d
    }

    fn state(model: &Sequential, step: u64) -> Resume {
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
        Resume { weights: w, optimizer, step, epoch: 2, step_in_epoch: 3 }
    }

    fn policy(dir: &Path, keep: usize) -> CheckpointPolicy {
        let config = BTreeMap::from([("model".to_string(), "toy".to_string()), ("batch_size".into(), "8".into())]);
        CheckpointPolicy { dir: dir.to_path_buf(), every: 1, keep, config }
    }

    #[test]
    fn a_checkpoint_round_trips_bitwise_and_only_the_last_k_are_kept() {
        let model = models::toy_mlp(2, 2).unwrap();
        let dir = tmp("roundtrip");
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
        let dir = tmp("corrupt");
        let p = policy(&dir, 3);
        save(&model, &state(&model, 1), &p).unwrap();
        let newest = save(&model, &state(&model, 2), &p).unwrap();
        let mut bytes = std::fs::read(&newest).unwrap();
        let n = bytes.len();
        bytes[n - 3] ^= 0x40; // one flipped bit in the last tensor
        std::fs::write(&newest, &bytes).unwrap();
        let fresh = Optimizer::new(OptimizerConfig::adam(1e-3), model.params_len());
        let e = load_latest(&model, &dir, &p.config, &fresh, Fallback::Refuse).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch") && e.contains("--resume-fallback"), "{e}");
        let (r, _, skipped) = load_latest(&model, &dir, &p.config, &fresh, Fallback::NewestGood).unwrap().unwrap();
        assert_eq!(r.step, 1);
        assert_eq!(skipped, vec![newest.clone()]);
        // a truncated file is corrupt too
        std::fs::write(&newest, &bytes[..n / 2]).unwrap();
        let e = load_latest(&model, &dir, &p.config, &fresh, Fallback::Refuse).unwrap_err().to_string();
        assert!(e.contains("--resume-fallback"), "{e}");
    }

    #[test]
    fn another_configuration_is_refused_naming_the_difference() {
        let model = models::toy_mlp(2, 2).unwrap();
        let dir = tmp("config");
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
        let dir = tmp("future");
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
        let dir = tmp("meta");
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
    fn an_unwritable_directory_is_reported() {
        let e = prepare_dir(Path::new("/proc/lockstep-no-such-dir")).unwrap_err().to_string();
        assert!(e.starts_with("/proc/lockstep-no-such-dir"), "{e}");
    }
}
