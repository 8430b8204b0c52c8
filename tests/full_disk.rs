//! A full disk during a checkpoint write: the write fails with an error naming the file,
//! no temporary file is left behind, and the previous checkpoint survives intact.
//!
//! The disk is a 128 KiB tmpfs mounted by the test (it needs root, as CI has); where the
//! mount is refused, the test says so loudly and checks nothing.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

#[path = "../src/testing/skip.rs"]
mod skip;

use lockstep::checkpoint::{self, CheckpointPolicy, Fallback, Resume};
use lockstep::models;
use lockstep::optim::{Optimizer, OptimizerConfig};

struct Mount(std::path::PathBuf);
impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn mount_small_tmpfs(dir: &Path) -> Option<Mount> {
    std::fs::create_dir_all(dir).ok()?;
    let ok = Command::new("mount").args(["-t", "tmpfs", "-o", "size=128k", "tmpfs"]).arg(dir).status().ok()?;
    ok.success().then(|| Mount(dir.to_path_buf()))
}

#[test]
fn a_full_disk_fails_the_write_and_keeps_the_previous_checkpoint() {
    let dir = std::env::temp_dir().join(format!("lockstep-full-disk-{}", std::process::id()));
    let Some(_mount) = mount_small_tmpfs(&dir) else {
        let test = "a_full_disk_fails_the_write_and_keeps_the_previous_checkpoint";
        skip::skip(test, skip::Need::Tool, "cannot mount a tmpfs (not root?)");
        return;
    };
    let model = models::toy_mlp(2, 2).unwrap();
    let optimizer = Optimizer::new(OptimizerConfig::adam(1e-3), model.params_len());
    let config = BTreeMap::from([("model".to_string(), "toy".to_string())]);
    let policy = CheckpointPolicy { dir: dir.clone(), every: 1, keep: 5, config: config.clone(), record: None };
    let state = |step| {
        // A run has taken one optimiser step per step: a checkpoint that says otherwise is refused.
        let mut stepped = optimizer.clone();
        stepped.restore(step, &[]).unwrap();
        Resume::at(model.init(step), stepped, step, 0, 0)
    };
    let first = checkpoint::save(&model, &state(1), &policy).unwrap();
    let size = std::fs::metadata(&first).unwrap().len() as usize;
    // Fill the disk but for less than one checkpoint.
    let free = 128 * 1024 - size;
    let mut filler = vec![0u8; free.saturating_sub(size / 2)];
    while std::fs::write(dir.join("filler"), &filler).is_err() {
        filler.truncate(filler.len() - 1024);
    }
    let err = checkpoint::save(&model, &state(2), &policy).unwrap_err().to_string();
    assert!(err.contains("checkpoint-000000000002") && err.to_lowercase().contains("space"), "{err}");
    let names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.contains(".tmp")), "a temporary file was left: {names:?}");
    let (r, path, _) = checkpoint::load_latest(&model, &dir, &config, &optimizer, Fallback::Refuse).unwrap().unwrap();
    assert_eq!(path, first);
    assert_eq!(r.step, 1);
    assert!(r.weights == model.init(1));
}
