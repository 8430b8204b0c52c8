//! `lockstep train`: its arguments, the checks that come before any work, the run's
//! observers (progress, JSON lines, CSV), checkpoints and resume, signals, and the final
//! report. The training itself is `lockstep::train`'s.
//!
//! Resuming: every checkpoint stores the run's flags (their effective values, defaults
//! resolved), so `--resume DIR` alone continues the run as it was configured. Flags given
//! with it must agree with the stored ones, except the few that may change
//! ([`MAY_CHANGE`]): `--epochs` and `--steps` (a larger count continues a finished run,
//! optimiser state included), the devices, early stopping, checkpointing and logging.
//!
//! Under an MPI launcher every process runs this command with the same arguments; the
//! world's devices are every process's, `--replicas` counts them all, and process 0
//! alone prints, owns the checkpoint directory and writes `--save`, `--save-best`,
//! `--metrics-out` and the checkpoints.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::time::Duration;

use lockstep::checkpoint;
use lockstep::dirlock::DirLock;
use lockstep::nn::loss::Metrics;
use lockstep::train::{EarlyStopping, EvaluationReport, HeldOut, Observer, Stopped, TrainReport};

use signal_hook::consts::SIGINT;

use crate::cmd::features::FeatureArgs;
use crate::cmd::regularize::{self, RegularizeArgs};
use crate::cmd::signals::{Launched, StopSignals};
use crate::cmd::text::{self, TextArgs};
use crate::*;

#[derive(Args, Clone, Debug)]
pub(crate) struct TrainArgs {
    /// toy, convnet, convnet-nobn, resnet8, resnet20, gpt, or a model spec FILE.json (see examples/*.json).
    #[arg(long, default_value = "convnet", value_name = "NAME|FILE.json", value_parser = parse_model_choice)]
    model: ModelChoice,
    /// toy, toy-enlarged, digits, fashion-mnist (Debian's dataset-fashion-mnist), mnist:DIR (IDX files, plain or .gz), fortunes (Debian's fortunes, as text), text:FILE (a file's bytes as tokens), or a FILE.safetensors (tensors x and y, or a token file's tokens) [default: toy for flat models, fortunes for gpt, digits otherwise]
    #[arg(long)]
    data: Option<String>,
    /// The model's number of classes (its outputs) [default: the training data's: 10 for
    /// MNIST-format and the digits, a file's `num_classes` metadata, else its largest label
    /// + 1 up to 65,536]. Every label must be below it.
    #[arg(long, value_name = "K")]
    classes: Option<usize>,
    /// A separate test split for --data FILE (evaluated after every epoch).
    #[arg(long, value_name = "FILE")]
    test_data: Option<PathBuf>,
    /// Hold out this fraction (0 < F < 1) of the training samples as the validation set,
    /// evaluated after every epoch in place of the test split: the LAST F of the samples
    /// after a fixed shuffle drawn from --seed (independent of the epoch shuffles).
    #[arg(long, value_name = "F", conflicts_with_all = ["val_data", "test_data"])]
    validation_split: Option<f64>,
    /// A validation split evaluated after every epoch in place of the test split: a
    /// FILE.safetensors, fashion-mnist or mnist:DIR (their test files).
    #[arg(long, value_name = "FILE|mnist:DIR", conflicts_with = "test_data")]
    val_data: Option<String>,
    /// Passes over the training data [default: toy 3, convnet 15].
    #[arg(long)]
    epochs: Option<usize>,
    /// GLOBAL batch size: samples per step, whatever the number of devices [default: toy 2, convnet 32].
    #[arg(long)]
    batch_size: Option<usize>,
    /// [default: toy sgd, convnet adam]
    #[arg(long, value_enum)]
    optimizer: Option<OptimizerName>,
    /// Learning rate [default: sgd 0.5 for toy, 0.05 for convnet; adam 0.001].
    #[arg(allow_negative_numbers = true, long)]
    lr: Option<f32>,
    /// Learning-rate schedule over the run [default: constant for toy, cosine for convnet].
    #[arg(long, value_enum)]
    lr_schedule: Option<ScheduleName>,
    /// SGD momentum, in [0, 1).
    #[arg(allow_negative_numbers = true, long, default_value_t = 0.0)]
    momentum: f32,
    /// SGD with Nesterov momentum (PyTorch's nesterov=True; needs --momentum above 0).
    #[arg(long)]
    nesterov: bool,
    /// Weight decay (PyTorch's weight_decay): for sgd and adam the L2 penalty added to the
    /// gradient, for adamw the decoupled decay p *= 1 - lr·wd [default: 0.1 for text
    /// (nanoGPT's), else 0].
    #[arg(allow_negative_numbers = true, long)]
    weight_decay: Option<f32>,
    /// Which parameters --weight-decay applies to: weights (tensors of 2 or more
    /// dimensions, not BatchNorm's parameters nor the biases: PyTorch's usual parameter
    /// groups) or all.
    #[arg(long, value_enum, value_name = "WHICH", default_value = "weights")]
    weight_decay_on: DecayOnName,
    /// Linear warm-up over the first N steps: step s runs at (s + 1)/N of the learning
    /// rate, then --lr-schedule runs over the remaining steps [default: 100 for text
    /// (nanoGPT's), else 0].
    #[arg(allow_negative_numbers = true, long, value_name = "N")]
    warmup_steps: Option<u64>,
    /// Clip the gradient to this global L2 norm before every update (PyTorch's
    /// clip_grad_norm_): the norm of the averaged gradient of all replicas, so every
    /// replica scales by the same factor [default: 1 for text (nanoGPT's), else none].
    #[arg(allow_negative_numbers = true, long, value_name = "C")]
    clip_grad_norm: Option<f32>,
    /// Adam's epsilon.
    #[arg(allow_negative_numbers = true, long, default_value_t = 1e-8)]
    adam_eps: f32,
    /// Dropout rate of the built-in convnet and gpt, in [0, 1) (0 removes the convnet's
    /// layer); a spec file sets its own [default: convnet 0.5, gpt 0].
    #[arg(allow_negative_numbers = true, long)]
    dropout: Option<f32>,
    /// Momentum of the convnet's BatchNorm running statistics, in [0, 1). Keras uses 0.99;
    /// 0.9 follows the weights closely enough on small datasets such as the digits.
    #[arg(allow_negative_numbers = true, long, default_value_t = 0.9)]
    bn_momentum: f32,
    /// Seed of the initial weights, the shuffling and dropout.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Start from these weights instead of a seeded initialisation.
    #[arg(long, value_name = "FILE")]
    init: Option<PathBuf>,
    /// Save the final weights here (written atomically).
    #[arg(long, value_name = "FILE")]
    save: Option<PathBuf>,
    /// The dtype --save writes: f32, or bf16 / f16 rounded to nearest even (as PyTorch).
    #[arg(long, value_enum, default_value = "f32", requires = "save")]
    save_dtype: SaveDtypeName,
    /// Visit the samples in file order every epoch.
    #[arg(long)]
    no_shuffle: bool,
    /// Drop the short last batch of each epoch.
    #[arg(long)]
    drop_last: bool,
    /// Stop after this many steps in all.
    #[arg(long, value_name = "K")]
    steps: Option<u64>,
    /// Stop at the first step boundary past this wall time (90s, 45m, 3h50m, 1:30:00),
    /// for a batch scheduler's limit: a checkpoint is written there with --checkpoint-dir
    /// (else the weights go to --save), and the exit status is 75 (EX_TEMPFAIL), so that
    /// a job script knows to go on with --resume. Not stored: each run gets its own.
    #[arg(long, value_name = "DURATION", value_parser = lockstep::units::parse_duration)]
    time_limit: Option<Duration>,
    /// auto, cpu, cpu:N, cpu:NxT, cuda, cuda:I[,J...]
    #[arg(long, default_value = "auto", value_name = "SPEC")]
    devices: String,
    /// Logical replicas R (a multiple of the device count) [default: the device count].
    #[arg(long, value_name = "R")]
    replicas: Option<usize>,
    #[command(flatten)]
    features: FeatureArgs,
    #[command(flatten)]
    regularize: RegularizeArgs,
    #[command(flatten)]
    text: TextArgs,
    /// Check that every replica is bitwise identical every K steps and at the end [default: 100].
    #[arg(long, value_name = "K")]
    check_replicas_every: Option<u64>,
    /// Keep training when the loss becomes NaN or infinite.
    #[arg(long)]
    allow_nonfinite: bool,
    /// Print every replica's shard loss at every step, in the lesson's form.
    #[arg(long)]
    log_every_step: bool,
    /// Write checkpoints (weights, optimiser state, position, configuration) here.
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints [default: one epoch]. One is also written at the end and
    /// when the run is stopped by SIGINT (Ctrl-C) or SIGTERM.
    #[arg(long, value_name = "N")]
    checkpoint_every: Option<u64>,
    /// Checkpoints kept, newest first.
    #[arg(long, value_name = "K", default_value_t = 3)]
    keep_checkpoints: usize,
    /// Continue the run whose checkpoints are in DIR, with the flags it was started with
    /// (stored in its checkpoints); flags given must agree, except --epochs, --steps,
    /// --devices, --early-stopping, --save-best, checkpoint and logging flags.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// With --resume: if the newest checkpoint is corrupt, continue from the newest intact one.
    #[arg(long, requires = "resume")]
    resume_fallback: bool,
    /// text: human lines on stdout (a progress bar on a terminal); json: one JSON object
    /// per step and per epoch on stdout, the human lines on stderr.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Write step and epoch metrics to this CSV (flushed every epoch; `lockstep plot` draws it).
    #[arg(long, value_name = "FILE.csv")]
    metrics_out: Option<PathBuf>,
    /// Stop once the validation loss has not improved for PATIENCE epochs since the best
    /// one (Keras's EarlyStopping on val_loss; needs --validation-split or --val-data).
    #[arg(long, value_name = "PATIENCE")]
    early_stopping: Option<usize>,
    /// Write the weights of every epoch whose validation loss is the best so far here
    /// (atomically; Keras's ModelCheckpoint(save_best_only=True)).
    #[arg(long, value_name = "FILE")]
    save_best: Option<PathBuf>,
}

/// The flags that may differ from the stored ones on `--resume` (clap ids).
pub(crate) const MAY_CHANGE: [&str; 19] = [
    "epochs",
    "time_limit",
    // A sharded optimiser changes no number (its weights are bitwise the unsharded ones).
    "shard_optimizer",
    "save_dtype",
    "steps",
    "devices",
    "early_stopping",
    "save_best",
    "checkpoint_every",
    "keep_checkpoints",
    "check_replicas_every",
    "allow_nonfinite",
    "log_every_step",
    "log_format",
    "metrics_out",
    "save",
    "resume",
    "resume_fallback",
    "checkpoint_dir",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

// ---------------------------------------------------------------------------------------
// stored flags

/// The canonical text of a value, as stored in checkpoints and compared on resume.
fn enum_name<T: ValueEnum>(v: &T) -> String {
    v.to_possible_value().map_or(String::new(), |p| p.get_name().to_string())
}

/// The run's flags as stored in a checkpoint: clap id → canonical value, for every flag
/// that says what the run is or where its weights go (`--save`, `--save-best`: a resumed
/// run writes them where the run was started to), absent options and unset switches left
/// out. Flags that only say how it logs or how it started (`--init`) are not stored.
fn flag_values(a: &TrainArgs) -> BTreeMap<&'static str, String> {
    let model = match &a.model {
        ModelChoice::Builtin(n) => n.as_str().to_string(),
        ModelChoice::Spec(p) => p.display().to_string(),
    };
    let mut m = BTreeMap::from([
        ("model", model),
        ("momentum", a.momentum.to_string()),
        ("weight_decay_on", enum_name(&a.weight_decay_on)),
        ("adam_eps", a.adam_eps.to_string()),
        ("bn_momentum", a.bn_momentum.to_string()),
        ("seed", a.seed.to_string()),
        ("devices", a.devices.clone()),
        ("keep_checkpoints", a.keep_checkpoints.to_string()),
        ("accumulate", a.features.accumulate.to_string()),
        ("grad_compression", enum_name(&a.features.grad_compression)),
    ]);
    let optional = [
        ("data", a.data.clone()),
        ("test_data", a.test_data.as_ref().map(|p| p.display().to_string())),
        ("val_data", a.val_data.clone()),
        ("validation_split", a.validation_split.map(|f| f.to_string())),
        ("classes", a.classes.map(|k| k.to_string())),
        ("epochs", a.epochs.map(|e| e.to_string())),
        ("batch_size", a.batch_size.map(|b| b.to_string())),
        ("optimizer", a.optimizer.as_ref().map(enum_name)),
        ("lr", a.lr.map(|l| l.to_string())),
        ("lr_schedule", a.lr_schedule.as_ref().map(enum_name)),
        ("clip_grad_norm", a.clip_grad_norm.map(|c| c.to_string())),
        ("weight_decay", a.weight_decay.map(|w| w.to_string())),
        ("warmup_steps", a.warmup_steps.map(|w| w.to_string())),
        ("dropout", a.dropout.map(|d| d.to_string())),
        ("nesterov", a.nesterov.then(|| "true".to_string())),
        ("steps", a.steps.map(|k| k.to_string())),
        ("replicas", a.replicas.map(|r| r.to_string())),
        ("check_replicas_every", a.check_replicas_every.map(|k| k.to_string())),
        ("checkpoint_every", a.checkpoint_every.map(|k| k.to_string())),
        ("early_stopping", a.early_stopping.map(|p| p.to_string())),
        ("save_best", a.save_best.as_ref().map(|p| p.display().to_string())),
        ("save", a.save.as_ref().map(|p| p.display().to_string())),
        ("save_dtype", a.save.as_ref().map(|_| enum_name(&a.save_dtype))),
        ("no_shuffle", a.no_shuffle.then(|| "true".to_string())),
        ("drop_last", a.drop_last.then(|| "true".to_string())),
        ("allow_nonfinite", a.allow_nonfinite.then(|| "true".to_string())),
        ("sync_batchnorm", a.features.sync_batchnorm.then(|| "true".to_string())),
        ("shard_optimizer", a.features.shard_optimizer.then(|| "true".to_string())),
    ];
    m.extend(optional.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))));
    m.extend(a.regularize.stored());
    m.extend(a.text.stored());
    m
}

/// `--batch-size` for the clap id `batch_size`.
fn flag(id: &str) -> String {
    format!("--{}", id.replace('_', "-"))
}

/// The newest checkpoint of `dir` whose header reads, and the flags it stores; older ones
/// are tried only with `--resume-fallback` (the checksum is checked when it is loaded).
fn stored_flags(dir: &Path, fallback: bool) -> CliResult<BTreeMap<String, String>> {
    // The flags of one run: a directory holding two would resume whichever is newest.
    checkpoint::check_one_run(dir).map_err(Failure::usage)?;
    let files = checkpoint::list(dir).map_err(Failure::usage)?;
    let mut first_error = None;
    for (_, path) in files.iter().rev() {
        match checkpoint::read_stored(path) {
            Ok((_, stored)) => return Ok(stored),
            Err(e) if fallback => {
                first_error.get_or_insert(e);
            }
            Err(e) => {
                return Err(Failure::usage(anyhow!(
                    "{e}; pass --resume-fallback to continue from the newest intact checkpoint"
                )))
            }
        }
    }
    match first_error {
        Some(e) => Err(Failure::usage(anyhow!("--resume '{}': every checkpoint in it is corrupt (the newest: {e})", dir.display()))),
        None => Err(Failure::usage(anyhow!(
            "--resume '{}': no checkpoint in it (a directory that --checkpoint-dir wrote holds checkpoint-*.safetensors)",
            dir.display()
        ))),
    }
}

/// `a` completed with the flags the run in `dir` stored: a stored flag not given is
/// taken; a given one must agree unless it may change; a flag the run did not have may
/// not be added (unless it may change).
fn with_stored_flags(a: TrainArgs, given: &BTreeSet<String>, dir: &Path) -> CliResult<TrainArgs> {
    check_resume_dir(dir)?;
    let stored = stored_flags(dir, a.resume_fallback)?;
    // A checkpoint of a run that stored no flags (an older lockstep): the flags given
    // decide, and the configuration check on loading compares what it can.
    if stored.is_empty() {
        return Ok(a);
    }
    let here = flag_values(&a);
    let mut problems = Vec::new();
    if given.contains("init") {
        problems.push("--init starts a run; a resumed run continues from its checkpoint's weights".to_string());
    }
    for id in given.iter().filter(|id| !MAY_CHANGE.contains(&id.as_str())) {
        let Some(mine) = here.get(id.as_str()) else { continue };
        match stored.get(id.as_str()) {
            Some(theirs) if theirs == mine => {}
            Some(theirs) => problems.push(format!("{} {mine} differs from the run's {} {theirs}", flag(id), flag(id))),
            None => problems.push(format!("the run had no {}", flag(id))),
        }
    }
    if !problems.is_empty() {
        return Err(Failure::usage(anyhow!(
            "--resume '{}': {} (only {} may change when resuming)",
            dir.display(),
            problems.join("; "),
            [
                "--epochs",
                "--steps",
                "--devices",
                "--early-stopping",
                "--save",
                "--save-dtype",
                "--save-best",
                "checkpoint and logging flags"
            ]
            .join(", ")
        )));
    }
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    for (id, value) in &stored {
        if given.contains(id.as_str()) || !here_known(id) {
            continue;
        }
        match value.as_str() {
            "true" if SWITCHES.contains(&id.as_str()) => argv.push(flag(id).into()),
            v => argv.push(format!("{}={v}", flag(id)).into()),
        }
    }
    match Cli::parse_args(argv) {
        Ok((Cli { command: Command::Train(merged) }, _)) => Ok(*merged),
        Ok(_) => unreachable!("the arguments are those of `train`"),
        Err(e) => Err(Failure::usage(anyhow!(
            "--resume '{}': the run's stored flags no longer parse: {}",
            dir.display(),
            e.render().to_string().lines().next().unwrap_or("").trim_start_matches("error: ")
        ))),
    }
}

/// Processes started with different flags refuse at once, every one of them, naming the
/// first flag that differs: `process 1 has --dropout 0.1, process 0 has 0.5`. The flags
/// compared are those a checkpoint stores (what the run is), once resolved, except those
/// that name files or devices, which may differ from machine to machine: the trainer then
/// compares what they hold (the data's bytes, the model's layers, the devices' number and
/// kind).
fn agree_flags(world: &lockstep::world::World, a: &TrainArgs) -> CliResult {
    // What names a file or the devices, and what only process 0 writes.
    const PER_MACHINE: [&str; 7] = ["data", "test_data", "val_data", "save_best", "save", "save_dtype", "devices"];
    let given = flag_values(a);
    let spec_model = matches!(a.model, ModelChoice::Spec(_));
    let ids = STORED_IDS.iter().chain(&regularize::STORED).chain(&text::STORED);
    let settings: Vec<(String, String)> = ids
        .filter(|id| !(PER_MACHINE.contains(id) || spec_model && **id == "model"))
        .map(|id| (flag(id), given.get(id).cloned().unwrap_or_else(|| "(not given)".into())))
        .collect();
    world.agree(&settings).map_err(Failure::usage)
}

/// The stored flags that are switches (stored as "true" when set).
const SWITCHES: [&str; 6] =
    ["no_shuffle", "drop_last", "allow_nonfinite", "sync_batchnorm", "shard_optimizer", "nesterov"];

/// Whether `id` is a flag this version stores (a newer lockstep's extra entries are left).
fn here_known(id: &str) -> bool {
    STORED_IDS.contains(&id) || regularize::STORED.contains(&id) || text::STORED.contains(&id)
}

/// The flags a checkpoint stores, by clap id (with `regularize::STORED`, `text::STORED`).
const STORED_IDS: [&str; 38] = [
    "model",
    "momentum",
    "nesterov",
    "weight_decay",
    "weight_decay_on",
    "warmup_steps",
    "clip_grad_norm",
    "adam_eps",
    "dropout",
    "bn_momentum",
    "seed",
    "devices",
    "keep_checkpoints",
    "data",
    "test_data",
    "val_data",
    "validation_split",
    "classes",
    "epochs",
    "batch_size",
    "optimizer",
    "lr",
    "lr_schedule",
    "steps",
    "replicas",
    "check_replicas_every",
    "checkpoint_every",
    "early_stopping",
    "save_best",
    "save",
    "save_dtype",
    "no_shuffle",
    "drop_last",
    "allow_nonfinite",
    "accumulate",
    "grad_compression",
    "sync_batchnorm",
    "shard_optimizer",
];

/// `--resume DIR` names a directory, not a checkpoint file or nothing.
fn check_resume_dir(dir: &Path) -> CliResult {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) if dir.file_name().is_some_and(|n| n.to_string_lossy().starts_with("checkpoint-")) => {
            Err(Failure::usage(anyhow!(
                "--resume '{}': is a checkpoint file; give its directory ({}), which --checkpoint-dir wrote",
                dir.display(),
                dir.parent().map_or(".".into(), |p| p.display().to_string())
            )))
        }
        Ok(_) => Err(Failure::usage(anyhow!(
            "--resume '{}': is a file, not a checkpoint directory (give the directory --checkpoint-dir wrote)",
            dir.display()
        ))),
        Err(_) => Err(Failure::usage(anyhow!("--resume '{}': no such directory", dir.display()))),
    }
}

// ---------------------------------------------------------------------------------------
// outputs

/// `path` as it will be written, for comparing two flags' files: its directory resolved,
/// its name kept.
fn resolved(path: &Path) -> PathBuf {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    path.file_name().map_or(dir.clone(), |n| dir.join(n))
}

/// Every output file can be written, and no two flags name the same one (the second
/// writer would destroy the first's file: `--save X --metrics-out X`).
fn check_outputs(a: &TrainArgs) -> CliResult {
    let outputs = [("--save", &a.save), ("--save-best", &a.save_best), ("--metrics-out", &a.metrics_out)];
    let mut seen: Vec<(&str, PathBuf)> = Vec::new();
    for (name, path) in outputs.iter().filter_map(|(n, p)| p.as_ref().map(|p| (*n, p))) {
        check_writable(name, path)?;
        let at = resolved(path);
        if let Some((other, _)) = seen.iter().find(|(_, p)| *p == at) {
            return Err(Failure::usage(anyhow!(
                "{name} '{}' is the file {other} writes too: give each output its own file",
                path.display()
            )));
        }
        seen.push((name, at));
    }
    Ok(())
}

/// Claims the checkpoint directory for this run before anything is loaded: a file of that
/// name, a directory another run holds (named by its pid), or another run's checkpoints in
/// a directory that is not being resumed are refused.
fn claim_checkpoint_dir(dir: &Path, resuming: bool) -> CliResult<DirLock> {
    let flag = if resuming { "--resume" } else { "--checkpoint-dir" };
    if dir.exists() && !dir.is_dir() {
        return Err(Failure::usage(anyhow!("{flag} '{}': is a file, not a directory", dir.display())));
    }
    let lock = checkpoint::claim_dir(dir).map_err(|e| Failure::usage(anyhow!("{flag}: {e}")))?;
    if let Some(pid) = lock.stale_owner() {
        eprintln!("lockstep: {}: taking over the lock of pid {pid}, which is no longer running", dir.display());
    }
    if !resuming {
        if let Some((step, _)) = checkpoint::list(dir).map_err(Failure::usage)?.last() {
            return Err(Failure::usage(anyhow!(
                "--checkpoint-dir '{}' already holds checkpoints of a run (newest: step {step}); continue it with --resume, or choose another directory",
                dir.display()
            )));
        }
    }
    Ok(lock)
}

// ---------------------------------------------------------------------------------------
// train

/// The settings of a run once its flags and the model's defaults are resolved.
struct Settings {
    epochs: usize,
    batch_size: usize,
    optimizer: OptimizerConfig,
    schedule: LrSchedule,
    devices: Devices,
    replicas: usize,
}

/// Resolves the model's defaults and checks every flag that needs no file. A text run
/// (`text`) takes nanoGPT's CPU recipe: batch 12, 2,000 steps, AdamW at 1e-3 with betas
/// (0.9, 0.99) and weight decay 0.1 on the weights, 100 warm-up steps, cosine to a tenth,
/// clipping at norm 1, no dropout; it is counted in steps, an epoch being --eval-every.
fn settings(a: &mut TrainArgs, toy: bool, text: bool) -> CliResult<Settings> {
    a.text.check()?;
    let epochs = match text {
        true => {
            if a.epochs.is_some() {
                return Err(Failure::usage(anyhow!(
                    "--epochs: a text run is counted in steps (--steps, evaluated every --eval-every)"
                )));
            }
            let steps = *a.steps.get_or_insert(2000);
            let every = a.text.eval_every.unwrap_or(lockstep::train::DEFAULT_EVAL_EVERY) as u64;
            steps.div_ceil(every).max(1) as usize
        }
        false => *a.epochs.get_or_insert(if toy { 3 } else { 15 }),
    };
    let batch_size = *a.batch_size.get_or_insert(if toy {
        2
    } else if text {
        12
    } else {
        32
    });
    let optimizer = *a.optimizer.get_or_insert(match (toy, text) {
        (true, _) => OptimizerName::Sgd,
        (_, true) => OptimizerName::Adamw,
        _ => OptimizerName::Adam,
    });
    let lr = *a.lr.get_or_insert(match (optimizer, toy) {
        (OptimizerName::Sgd, true) => 0.5,
        (OptimizerName::Sgd, false) => 0.05,
        (OptimizerName::Adam | OptimizerName::Adamw, _) => 1e-3,
    });
    let schedule = *a.lr_schedule.get_or_insert(if toy { ScheduleName::Constant } else { ScheduleName::Cosine });
    a.weight_decay.get_or_insert(if text { 0.1 } else { 0.0 });
    a.warmup_steps.get_or_insert(if text { 100 } else { 0 });
    a.dropout.get_or_insert(if text { 0.0 } else { 0.5 });
    a.text.adam_beta2.get_or_insert(if text { 0.99 } else { 0.999 });
    if text && a.clip_grad_norm.is_none() {
        a.clip_grad_norm = Some(1.0);
    }
    if epochs == 0 {
        return Err(Failure::usage(anyhow!("--epochs must be at least 1")));
    }
    if batch_size == 0 {
        return Err(Failure::usage(anyhow!("--batch-size must be at least 1")));
    }
    if !(lr > 0.0 && lr.is_finite()) {
        return Err(Failure::usage(anyhow!("--lr must be a positive number, got {lr}")));
    }
    if !(0.0..1.0).contains(&a.bn_momentum) {
        return Err(Failure::usage(anyhow!("--bn-momentum must be in [0, 1), got {}", a.bn_momentum)));
    }
    let dropout = a.dropout.expect("resolved above");
    if !(0.0..1.0).contains(&dropout) {
        return Err(Failure::usage(anyhow!("--dropout must be in [0, 1), got {dropout}")));
    }
    for (name, zero) in [
        ("--steps", a.steps == Some(0)),
        ("--replicas", a.replicas == Some(0)),
        ("--check-replicas-every", a.check_replicas_every == Some(0)),
        ("--checkpoint-every", a.checkpoint_every == Some(0)),
        ("--keep-checkpoints", a.keep_checkpoints == 0),
    ] {
        if zero {
            return Err(Failure::usage(anyhow!("{name} must be at least 1")));
        }
    }
    check_classes(a.classes)?;
    a.regularize.check()?;
    if a.features.accumulate == 0 {
        return Err(Failure::usage(anyhow!("--accumulate must be at least 1 (micro-batches per step)")));
    }
    if optimizer != OptimizerName::Sgd && a.momentum != 0.0 {
        return Err(Failure::usage(anyhow!("--momentum is an SGD setting; Adam uses its betas")));
    }
    if a.nesterov && optimizer != OptimizerName::Sgd {
        return Err(Failure::usage(anyhow!("--nesterov is an SGD setting (Nesterov momentum); Adam uses its betas")));
    }
    if a.nesterov && a.momentum == 0.0 {
        return Err(Failure::usage(anyhow!("--nesterov needs --momentum above 0 (Nesterov momentum)")));
    }
    let wd = a.weight_decay.expect("resolved above");
    if !(wd >= 0.0 && wd.is_finite()) {
        return Err(Failure::usage(anyhow!("--weight-decay must be a number >= 0, got {wd}")));
    }
    if let Some(c) = a.clip_grad_norm {
        if !(c > 0.0 && c.is_finite()) {
            return Err(Failure::usage(anyhow!(
                "--clip-grad-norm must be a positive number (the largest gradient norm), got {c}"
            )));
        }
    }
    let (momentum_kind, eps) = (if a.nesterov { MomentumKind::Nesterov } else { MomentumKind::Classic }, a.adam_eps);
    let (beta1, beta2) = (a.text.adam_beta1, a.text.adam_beta2.expect("resolved above"));
    let optimizer = match optimizer {
        OptimizerName::Sgd => OptimizerConfig::Sgd { lr, momentum: a.momentum, momentum_kind, weight_decay: wd },
        OptimizerName::Adam => OptimizerConfig::Adam { lr, beta1, beta2, eps, weight_decay: wd },
        OptimizerName::Adamw => OptimizerConfig::AdamW { lr, beta1, beta2, eps, weight_decay: wd },
    };
    optimizer.validate().map_err(Failure::usage)?;
    let devices = resolve_devices(&a.devices)?;
    // The world's devices: every process's.
    let world = lockstep::world::current().map_err(Failure::usage)?;
    let in_world = devices.len() * world.size();
    let replicas = a.replicas.unwrap_or(in_world);
    if !replicas.is_multiple_of(in_world) {
        let among = match world.size() {
            1 => String::new(),
            p => format!(" ({p} processes × {})", devices.len()),
        };
        return Err(Failure::usage(anyhow!(
            "--replicas {replicas} cannot be shared evenly by {in_world} devices{among} (use a multiple of {in_world})"
        )));
    }
    if replicas > batch_size {
        return Err(Failure::usage(anyhow!(
            "--replicas {replicas} is more than the global batch of {batch_size}: each logical replica needs a sample of every batch (at most {batch_size}, or a larger --batch-size)"
        )));
    }
    a.replicas = Some(replicas);
    if a.checkpoint_every.is_some() && a.checkpoint_dir.is_none() && a.resume.is_none() {
        return Err(Failure::usage(anyhow!("--checkpoint-every needs --checkpoint-dir (or --resume)")));
    }
    let schedule = match schedule {
        ScheduleName::Constant => LrSchedule::Constant,
        ScheduleName::Cosine => LrSchedule::Cosine { floor: 0.1 },
    };
    Ok(Settings { epochs, batch_size, optimizer, schedule, devices, replicas })
}

pub(crate) fn cmd_train(a: TrainArgs, given: &BTreeSet<String>) -> CliResult {
    // One voice: with several processes, process 0 prints, owns the checkpoint directory
    // and writes every output file; every process reads what it resumes from.
    let world = lockstep::world::current().map_err(Failure::usage)?;
    let voice = world.is_voice();
    // Every check comes before any work. A directory being resumed is this run's before
    // its stored flags are read: another run may be writing it.
    let _resumed_lock = match a.resume.clone() {
        Some(dir) => {
            check_resume_dir(&dir)?;
            voice.then(|| claim_checkpoint_dir(&dir, true)).transpose()?
        }
        None => None,
    };
    let mut a = match a.resume.clone() {
        Some(dir) => with_stored_flags(a, given, &dir)?,
        None => a,
    };
    let source = a.model.resolve()?;
    let data_spec = a.data.get_or_insert_with(|| source.default_data().to_string()).clone();
    // A run over text: the GPT's data, or text data whoever's model.
    let is_text = text::is_text(&data_spec) || source.is_gpt();
    let toy = source.flat() && !is_text;
    let s = settings(&mut a, toy, is_text)?;
    agree_flags(world, &a)?;
    if voice {
        check_outputs(&a)?;
    }
    check_monitors(&a)?;
    // Checkpoints go to --checkpoint-dir, or back into the directory being resumed; the
    // directory is this run's from here to the end of the process.
    let checkpoint_dir = a.checkpoint_dir.clone().or_else(|| a.resume.clone());
    let _lock = checkpoint_dir
        .as_deref()
        .filter(|_| voice)
        .map(|d| claim_checkpoint_dir(d, a.resume.as_deref() == Some(d)))
        .transpose()?;
    let (splits, final_test, held_out) = match text::is_text(&data_spec) {
        true => {
            if a.validation_split.is_some() || a.val_data.is_some() || a.test_data.is_some() {
                return Err(Failure::usage(anyhow!(
                    "--data {data_spec}: a text's validation part is its last tenth by position (no --validation-split, --val-data or --test-data)"
                )));
            }
            (a.text.load(&data_spec)?, None, HeldOut::Validation)
        }
        false => {
            let splits = load_data(&data_spec, toy, a.seed, a.test_data.as_deref(), a.classes)?;
            with_validation(splits, a.validation_split, a.val_data.as_deref(), a.seed, a.classes)?
        }
    };
    let stream = splits.train.stream().is_some();
    // The training data sizes a built-in model, never the test data: a label only the
    // test split has is one the model was never trained to output.
    // The built-in GPT's vocabulary is nanoGPT's bytes, 256, unless --classes says more.
    let stated_classes = a.classes;
    let classes = *a.classes.get_or_insert(match source.is_gpt() && matches!(source, ModelSource::Builtin(_)) {
        true => lockstep::data::text::BYTE_VOCAB,
        false => splits.train.num_classes(),
    });
    let dropout = a.dropout.expect("settings resolves it");
    let model = match &source {
        ModelSource::Builtin(ModelName::Gpt) => {
            lockstep::models::gpt(a.text.gpt(classes, dropout)).map_err(Failure::usage)?
        }
        _ => build_model(&source, splits.train.sample_shape().dims(), classes, dropout, a.bn_momentum)?,
    };
    let model = a.features.model(model)?;
    let named: Vec<&Dataset> = std::iter::once(&splits.train).chain(&splits.test).chain(&final_test).collect();
    check_model_classes(&model, stated_classes, &named)?;
    // Every process's devices, under mpirun.
    let in_world = s.devices.len() * world.size();
    if a.features.sync_batchnorm && s.replicas != in_world {
        return Err(Failure::usage(anyhow!(
            "--sync-batchnorm needs one logical replica per device: --replicas {} on {in_world} devices",
            s.replicas
        )));
    }
    for d in std::iter::once(&splits.train).chain(&splits.test).chain(&final_test) {
        lockstep::train::check_data(&model, d).map_err(Failure::usage)?;
    }
    a.regularize.check_data(&splits.train)?;
    let last_batch = if a.drop_last { LastBatch::Drop } else { LastBatch::Keep };
    let steps_per_epoch = match stream {
        true => a.text.eval_every.unwrap_or(lockstep::train::DEFAULT_EVAL_EVERY),
        false => lockstep::train::scatter::steps_per_epoch(splits.train.len(), s.batch_size, last_batch),
    };
    if steps_per_epoch == 0 {
        return Err(Failure::usage(anyhow!(
            "{} training samples make no full batch of {} with --drop-last",
            splits.train.len(),
            s.batch_size
        )));
    }
    // A batch larger than the training set is the whole set at every step (Keras and
    // PyTorch's loaders do the same); memory is estimated for what a step really takes.
    let batch_size = match last_batch {
        LastBatch::Keep if !stream => s.batch_size.min(splits.train.len()),
        _ => s.batch_size,
    };
    let mut config = TrainConfig {
        epochs: s.epochs,
        max_steps: a.steps,
        max_duration: a.time_limit,
        batch_size,
        optimizer: s.optimizer,
        schedule: s.schedule,
        warmup_steps: a.warmup_steps.expect("settings resolves it"),
        weight_decay_on: a.weight_decay_on.decay_on(),
        clip_grad_norm: a.clip_grad_norm,
        seed: a.seed,
        shuffle: if a.no_shuffle { Shuffle::None } else { Shuffle::Seeded },
        last_batch,
        replicas: Some(s.replicas),
        check_replicas_every: a.check_replicas_every.or(TrainConfig::default().check_replicas_every),
        non_finite: if a.allow_nonfinite { NonFinite::Allow } else { NonFinite::Error },
        held_out,
        early_stopping: a.early_stopping.map(EarlyStopping::patience),
        save_best: a.save_best.clone(),
        ..TrainConfig::default()
    };
    config = a.text.config(a.regularize.config(a.features.config(config)), stream);
    config.validate().map_err(Failure::usage)?;
    // Memory before the weights, the checkpoint or any replica is allocated.
    let largest_held_out = splits.test.iter().chain(&final_test).map(Dataset::len).max().unwrap_or(0);
    let sized = TrainConfig { eval_batch: config.eval_batch.min(largest_held_out.max(1)), ..config.clone() };
    let mut estimate = lockstep::train::memory::training(&model, &s.devices, &sized);
    let held: u64 = splits.test.iter().chain(&final_test).map(|d| dataset_bytes(d, Evaluated::Yes)).sum();
    let data_bytes = dataset_bytes(&splits.train, Evaluated::No).saturating_add(held);
    estimate.add("data", data_bytes, "the datasets as loaded, and the held-out sets gathered as f32 for evaluation");
    estimate.check("training").map_err(Failure::usage)?;
    config.initial = a
        .init
        .as_ref()
        .map(|p| {
            check_input_file("--init", p)?;
            weights::load(&model, p).map_err(Failure::usage).map_err(|f| f.with_context("--init"))
        })
        .transpose()?;
    let run_config = run_fingerprint(&a, &source.name(), &model, &data_spec, &splits.train, &config);
    let stored: BTreeMap<String, String> = flag_values(&a).into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    config.checkpoint = checkpoint_dir.map(|dir| CheckpointPolicy {
        dir,
        every: a.checkpoint_every.unwrap_or(steps_per_epoch as u64),
        keep: a.keep_checkpoints,
        config: run_config.clone(),
        stored,
    });
    let total_steps = (steps_per_epoch as u64).saturating_mul(s.epochs as u64).min(a.steps.unwrap_or(u64::MAX));
    let mut resuming = None;
    if let Some(dir) = &a.resume {
        let fallback = if a.resume_fallback { Fallback::NewestGood } else { Fallback::Refuse };
        let fresh = Optimizer::new(config.optimizer, model.params_len());
        let Some((r, path, skipped)) =
            lockstep::checkpoint::load_latest(&model, dir, &run_config, &fresh, fallback).map_err(Failure::usage)?
        else {
            return Err(Failure::usage(anyhow!("--resume '{}': no checkpoint in it", dir.display())));
        };
        for s in skipped.iter().filter(|_| voice) {
            eprintln!("lockstep: skipping corrupt checkpoint {}", s.display());
        }
        if r.step >= total_steps {
            return match voice {
                true => finished_already(&a, &model, dir, &r, total_steps),
                false => Ok(()),
            };
        }
        resuming = Some(format!("lockstep: resuming {} at step {} (epoch {})", path.display(), r.step, r.epoch + 1));
        config.resume = Some(r);
    }
    // SIGINT or SIGTERM: finish the step, write a checkpoint (or --save), exit 128 + N.
    // Under mpirun, Ctrl-C reaches the processes as SIGTERM (and SIGUSR1, which mpirun
    // forwards, is caught too): they stop at a step they all agree on.
    let signals = StopSignals::install(match world.size() {
        1 => Launched::Alone,
        _ => Launched::Together,
    });
    config.stop = Some(Arc::clone(&signals.stop));

    // With --log-format json, stdout carries only JSON; the human lines go to stderr.
    let human = if a.log_format == LogFormat::Json { Stream::Stderr } else { Stream::Stdout };
    let say = |text: String| {
        if voice {
            human.line(&text)
        }
    };
    let shown = match world.size() {
        1 => s.devices.to_string(),
        p => format!("{p} processes × {}", s.devices),
    };
    // A text's samples are its windows, its classes the vocabulary.
    let (unit, outputs) = if stream {
        ("windows", format!("a vocabulary of {classes}"))
    } else {
        ("samples", format!("{classes} classes"))
    };
    let test_text = |t: &Dataset| format!(", {} {} {unit}", t.name(), t.len());
    say(format!(
        "lockstep: {} ({} parameters, {outputs}) | devices: {} | replicas: {} | data: {} {} {unit}{}{}",
        source.name(),
        model.num_params(),
        shown,
        s.replicas,
        splits.train.name(),
        splits.train.len(),
        splits.test.as_ref().map_or(String::new(), test_text),
        final_test.as_ref().map_or(String::new(), test_text),
    ));
    if let Some(note) = s.devices.oversubscription_note(s.replicas) {
        say(format!("lockstep: note: {note}"));
    }
    if let Some(features) = features_text(&a) {
        say(format!("lockstep: {features}"));
    }
    say(format!(
        "lockstep: {}{} | global batch {} | {} | seed {}{}{}",
        optimizer_text(&s.optimizer),
        recipe_text(&config),
        match batch_size < s.batch_size {
            true => format!("{batch_size} (every training sample; --batch-size {})", s.batch_size),
            false => batch_size.to_string(),
        },
        match stream {
            true => format!("{} steps, evaluated every {steps_per_epoch}", a.steps.unwrap_or(0)),
            false =>
                format!("epochs {}{}", s.epochs, a.steps.map_or(String::new(), |k| format!(" (at most {k} steps)"))),
        },
        a.seed,
        a.init.as_ref().map_or(String::new(), |p| format!(" | initial weights {}", p.display())),
        a.early_stopping.map_or(String::new(), |p| format!(" | early stopping after {p} epochs without improvement")),
    ));
    let available = lockstep::memory::available();
    say(format!(
        "lockstep: memory: an estimated {} of the {} {}",
        lockstep::units::human(estimate.total()),
        available.map_or("unknown".to_string(), |m| lockstep::units::human(m.bytes)),
        available.map_or("", |m| m.source),
    ));

    if let Some(line) = resuming {
        say(line);
    }
    let step_lines = if a.log_every_step { StepLines::Lesson } else { StepLines::Off };
    // mpirun gives process 0 a pseudo-terminal whatever its own output is: plain lines.
    let mut progress = match world.size() {
        1 => Progress::new(human, step_lines),
        _ => Progress::with_drawing(human, step_lines, Drawing::Lines),
    }
    .held_out(held_out.name());
    let mut json = (voice && a.log_format == LogFormat::Json).then(|| JsonLines::new(std::io::stdout()));
    let mut csv =
        a.metrics_out.as_deref().filter(|_| voice).map(CsvMetrics::create).transpose().map_err(Failure::usage)?;
    let mut observers = Fanout::new();
    if voice {
        observers.push(&mut progress);
    }
    if let Some(j) = &mut json {
        observers.push(j);
    }
    if let Some(c) = &mut csv {
        observers.push(c);
    }
    let trained =
        train_data_parallel_with(&model, &splits.train, splits.test.as_ref(), &s.devices, &config, &mut observers);
    let tested = match (&trained, &final_test) {
        (Ok(r), Some(t)) if !matches!(r.stopped, Stopped::Interrupted { .. } | Stopped::TimeLimit { .. }) => {
            let m = evaluate(&model, &r.weights, t, &s.devices, config.label_smoothing).map_err(Failure::runtime)?;
            observers.on_evaluation(&EvaluationReport { set: HeldOut::Test, step: r.steps, metrics: m });
            Some(m)
        }
        _ => None,
    };
    drop(observers);
    progress.finish();
    // The rows of a failed run are kept too; a closed stdout does not fail the run.
    let csv_done = csv.map(CsvMetrics::finish).transpose();
    // Processes started with disagreeing arguments were given bad input, as one is.
    let report = trained.map_err(|e| match e {
        lockstep::Error::Processes { .. } => Failure::usage(e),
        e => Failure::runtime(e),
    })?;
    csv_done.map_err(Failure::runtime)?;
    if let Some(p) = &a.metrics_out {
        say(format!("metrics written to {}", p.display()));
    }
    final_lines(&say, &report, held_out, tested.as_ref(), &a);
    if let Stopped::Interrupted { checkpoint } = &report.stopped {
        return match voice {
            true => interrupted(&model, &report, checkpoint.as_deref(), a.save.as_deref(), &signals),
            false => Err(Failure::silent(StopSignals::exit_code(signals.received().unwrap_or(SIGINT)))),
        };
    }
    if let Stopped::TimeLimit { checkpoint } = &report.stopped {
        return match voice {
            true => timed_out(&model, &report, checkpoint.as_deref(), &a),
            false => Err(Failure::silent(EX_TEMPFAIL)),
        };
    }
    if let Some(p) = a.save.as_ref().filter(|_| voice) {
        weights::save_as(&model, &report.weights, p, a.save_dtype.dtype()).map_err(Failure::runtime)?;
        say(format!("weights saved to {} ({})", p.display(), enum_name(&a.save_dtype)));
    }
    Ok(())
}

/// `--early-stopping` and `--save-best` choose epochs by a validation set, never by the
/// test split (which would then measure nothing): Keras monitors `val_loss`.
fn check_monitors(a: &TrainArgs) -> CliResult {
    let monitors = a.early_stopping.is_some() || a.save_best.is_some();
    if monitors && a.validation_split.is_none() && a.val_data.is_none() {
        let name = if a.early_stopping.is_some() { "--early-stopping" } else { "--save-best" };
        return Err(Failure::usage(anyhow!(
            "{name} monitors the validation loss: give --validation-split F or --val-data (the test split only measures)"
        )));
    }
    Ok(())
}

/// The end of a run a signal stopped: where its state went (the checkpoint, else the
/// weights of its last step to `--save`), said on stderr, and the exit code 128 + N.
fn interrupted(
    model: &Sequential,
    report: &TrainReport,
    checkpoint: Option<&Path>,
    save: Option<&Path>,
    signals: &StopSignals,
) -> CliResult {
    let signal = signals.received().unwrap_or(SIGINT);
    let mut line = format!("lockstep: interrupted by {} after step {}", StopSignals::name(signal), report.steps);
    match (checkpoint, save) {
        (Some(p), _) => line.push_str(&format!("; checkpoint written to {}", p.display())),
        (None, Some(p)) => {
            weights::save(model, &report.weights, p).map_err(Failure::runtime)?;
            line.push_str(&format!("; the weights at that step saved to {}", p.display()));
        }
        (None, None) => line.push_str("; nothing saved (no --checkpoint-dir or --save)"),
    }
    // Not eprintln!: after Ctrl-C on mpirun, stderr's reader may be gone.
    let _ = writeln!(std::io::stderr(), "{line}");
    Err(Failure::silent(StopSignals::exit_code(signal)))
}

/// The exit status of a run stopped by `--time-limit`: sysexits' EX_TEMPFAIL, "try
/// again later" — with `--resume`.
pub(crate) const EX_TEMPFAIL: u8 = 75;

/// The end of a run `--time-limit` stopped: where its state went (the checkpoint, else the
/// weights of its last step to `--save`), how to go on, and the exit status 75.
fn timed_out(model: &Sequential, report: &TrainReport, checkpoint: Option<&Path>, a: &TrainArgs) -> CliResult {
    let limit = a.time_limit.map_or_else(String::new, |d| format!(" ({})", lockstep::units::duration(d)));
    let mut line = format!("lockstep: stopped at the time limit{limit} after step {}", report.steps);
    match (checkpoint, a.save.as_deref()) {
        (Some(p), _) => {
            let dir = p.parent().unwrap_or(Path::new("."));
            line.push_str(&format!("; checkpoint written to {}; go on with --resume {}", p.display(), dir.display()));
        }
        (None, Some(p)) => {
            weights::save(model, &report.weights, p).map_err(Failure::runtime)?;
            line.push_str(&format!(
                "; the weights at that step saved to {} (no --checkpoint-dir: no resume)",
                p.display()
            ));
        }
        (None, None) => line.push_str("; nothing saved (no --checkpoint-dir or --save)"),
    }
    let _ = writeln!(std::io::stderr(), "{line}");
    Err(Failure::silent(EX_TEMPFAIL))
}

/// Whether a dataset is evaluated whole (gathered into one f32 batch) as well as held.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Evaluated {
    Yes,
    No,
}

/// The bytes a dataset holds, and its f32 copy when it is evaluated whole.
fn dataset_bytes(d: &Dataset, evaluated: Evaluated) -> u64 {
    // A token stream: its u32 ids (its held-out windows are drawn, a few batches).
    if let Some(t) = d.stream() {
        return (t.len() as u64).saturating_mul(4);
    }
    let values = (d.len() as u64).saturating_mul(d.sample_shape().numel() as u64);
    let stored = match d.features() {
        Features::F32(_) => values.saturating_mul(4),
        Features::U8(_) => values,
    };
    match evaluated {
        Evaluated::Yes => stored.saturating_add(values.saturating_mul(4)),
        Evaluated::No => stored,
    }
}

/// Loss (the run's, label smoothing included) and accuracy of `weights` on `data`: the
/// test split of a run that chose its epochs on a validation split, evaluated once at the
/// end.
fn evaluate(
    model: &Sequential,
    weights: &ParamStore,
    data: &Dataset,
    devices: &Devices,
    label_smoothing: f32,
) -> lockstep::Result<Metrics> {
    let devices = devices.first(data.len());
    let config = TrainConfig {
        initial: Some(weights.clone()),
        check_replicas_every: None,
        label_smoothing,
        ..TrainConfig::default()
    };
    with_trainer(model, &devices, &config, |t| t.evaluate(data, config.eval_batch))
}

/// The lines after the epochs: steps and rate, the last epoch, the best one, the test.
fn final_lines(say: &dyn Fn(String), report: &TrainReport, held_out: HeldOut, tested: Option<&Metrics>, a: &TrainArgs) {
    let taken = report.steps - report.first_step;
    let resumed = if taken < report.steps { format!(" (to step {})", report.steps) } else { String::new() };
    // Labels per second: a text run's are its tokens.
    let unit = if report.epochs.first().is_some_and(|e| e.steps_of_run.is_some()) { "tokens" } else { "samples" };
    say(format!("trained {taken} steps{resumed} in {:.2}s ({:.0} {unit}/s)", report.seconds, report.samples_per_sec));
    if let Stopped::EarlyStopping { best_epoch } = report.stopped {
        say(format!(
            "early stopping: no improvement of the validation loss in {} epochs since epoch {}",
            a.early_stopping.unwrap_or(0),
            best_epoch + 1
        ));
    }
    if let Some(last) = report.epochs.last() {
        say(format!("final train loss {:.4} accuracy {:.4}", last.train.mean_loss(), last.train.accuracy()));
        if let Some(t) = last.held_out() {
            say(format!("final {} accuracy: {:.4} ({}/{})", held_out.name(), t.accuracy(), t.correct, t.count));
        }
    }
    if let (Some(b), HeldOut::Validation) = (&report.best, held_out) {
        say(format!(
            "best epoch {}: validation loss {:.4} accuracy {:.4}{}",
            b.epoch + 1,
            b.metrics.mean_loss(),
            b.metrics.accuracy(),
            a.save_best.as_ref().map_or(String::new(), |p| format!(" (weights in {})", p.display()))
        ));
    }
    if let Some(t) = tested {
        say(format!("final test accuracy: {:.4} ({}/{})", t.accuracy(), t.correct, t.count));
    }
}

/// `--resume` of a run that has already taken every step asked for: nothing to train.
fn finished_already(a: &TrainArgs, model: &Sequential, dir: &Path, r: &checkpoint::Resume, total: u64) -> CliResult {
    let at = match (r.epoch, r.step_in_epoch) {
        (1, 0) => "1 epoch".to_string(),
        (e, 0) => format!("{e} epochs"),
        (e, 1) => format!("1 step into epoch {}", e + 1),
        (e, s) => format!("{s} steps into epoch {}", e + 1),
    };
    // A run resumed with fewer steps than it has taken is past them, not "step 10 of 5".
    let state = match r.step > total {
        true => format!("is already past step {total}: it is at step {} ({at})", r.step),
        false => format!("is complete: step {} of {total} ({at})", r.step),
    };
    outln!(
        "lockstep: the run in {} {state}; nothing to train. Give a larger --epochs or --steps to continue it.",
        dir.display()
    );
    if let Some(p) = &a.save {
        weights::save(model, &r.weights, p).map_err(Failure::runtime)?;
        outln!("weights saved to {}", p.display());
    }
    Ok(())
}

/// The recipes of issue 18 around the optimiser that a run uses, as the optimiser line's
/// continuation (empty for none): where weight decay applies, the warm-up, the clip.
fn recipe_text(c: &TrainConfig) -> String {
    let mut parts = String::new();
    if c.optimizer.weight_decay() > 0.0 {
        parts.push_str(match c.weight_decay_on {
            lockstep::optim::DecayOn::Weights => " (on the weights)",
            lockstep::optim::DecayOn::All => " (on every parameter)",
        });
    }
    if c.warmup_steps > 0 {
        parts.push_str(&format!(" | warm-up {} steps", c.warmup_steps));
    }
    if let Some(n) = c.clip_grad_norm {
        parts.push_str(&format!(" | gradient clipped to norm {n}"));
    }
    parts
}

/// The features of issue 12 and the data and loss settings of issue 18 a run uses, in one
/// line, or None for none of them.
fn features_text(a: &TrainArgs) -> Option<String> {
    let mut parts = a.features.described();
    parts.extend(a.regularize.described());
    (!parts.is_empty()).then(|| parts.join(" | "))
}

/// The settings that decide a run's arithmetic, in words: a checkpoint is only resumed
/// by a run that agrees on every one (the device count is free: the logical replicas are
/// here; the epochs and steps are free: a finished run may be extended).
fn run_fingerprint(
    a: &TrainArgs,
    model_name: &str,
    model: &Sequential,
    data_spec: &str,
    train: &Dataset,
    c: &TrainConfig,
) -> BTreeMap<String, String> {
    let layers: Vec<String> = model.layers().iter().map(|l| l.describe()).collect();
    let schedule = match c.schedule {
        LrSchedule::Constant => "constant".to_string(),
        LrSchedule::Cosine { floor } => format!("cosine decay to {floor} of the rate"),
    };
    let entries = [
        ("model", model_name.to_string()),
        ("layers", layers.join(" → ")),
        ("data", data_spec.to_string()),
        ("train_samples", train.len().to_string()),
        ("train_digest", format!("{:016x}", train.digest())),
        ("validation_split", a.validation_split.map_or("none".to_string(), |f| f.to_string())),
        ("batch_size", c.batch_size.to_string()),
        ("optimizer", optimizer_text(&c.optimizer)),
        ("schedule", schedule),
        ("seed", c.seed.to_string()),
        ("shuffle", if c.shuffle == Shuffle::Seeded { "seeded" } else { "none" }.to_string()),
        ("last_batch", if c.last_batch == LastBatch::Keep { "kept" } else { "dropped" }.to_string()),
        ("replicas", c.replicas.map_or(String::new(), |r| r.to_string())),
        ("dropout", a.dropout.map_or(String::new(), |d| d.to_string())),
        ("bn_momentum", a.bn_momentum.to_string()),
    ];
    // Accumulation and 16-bit gradients change the arithmetic, so they are named always (a
    // checkpoint of a run that set neither still differs from one that did, both ways; one
    // written before they existed is refused for lacking them). A sharded optimiser
    // changes no number: its run resumes unsharded, and the other way round.
    let mut out: BTreeMap<String, String> = entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    out.insert("accumulate".into(), c.accumulate.to_string());
    out.insert("grad_compression".into(), c.grad_compression.name().into());
    // So do the recipes of issue 18, named always for the same reason.
    out.insert("warmup_steps".into(), c.warmup_steps.to_string());
    out.insert("weight_decay_on".into(), c.weight_decay_on.name().into());
    out.insert("clip_grad_norm".into(), c.clip_grad_norm.map_or("none".to_string(), |v| v.to_string()));
    out.extend(a.regularize.fingerprint());
    out
}

// ---------------------------------------------------------------------------------------
// validation sets

/// Applies `--validation-split` or `--val-data`: the validation set becomes the held-out
/// set evaluated after every epoch, and the test split (if any) is evaluated once at the
/// end. Returns the splits (test = the per-epoch set), the final test set, and what the
/// per-epoch set is.
fn with_validation(
    splits: Splits,
    fraction: Option<f64>,
    val_data: Option<&str>,
    seed: u64,
    classes: Option<usize>,
) -> CliResult<(Splits, Option<Dataset>, HeldOut)> {
    if let Some(f) = fraction {
        if !(f > 0.0 && f < 1.0) {
            return Err(Failure::usage(anyhow!("--validation-split must be strictly between 0 and 1, got {f}")));
        }
        let (train, val) = splits.train.split_validation(f, seed).map_err(Failure::usage)?;
        return Ok((Splits { train, test: Some(val) }, splits.test, HeldOut::Validation));
    }
    let Some(spec) = val_data else { return Ok((splits, None, HeldOut::Test)) };
    let val = match spec.strip_prefix("mnist:") {
        Some(dir) => load_mnist(Path::new(dir), classes)?
            .test
            .ok_or_else(|| Failure::usage(anyhow!("--val-data '{spec}': no test split")))?,
        None if spec == "fashion-mnist" => load_data(spec, false, seed, None, classes)?
            .test
            .ok_or_else(|| Failure::usage(anyhow!("--val-data '{spec}': no test split")))?,
        None => {
            let path = Path::new(spec);
            check_input_file("--val-data", path).map_err(|f| match path.exists() {
                true => f,
                false => Failure::usage(anyhow!(
                    "--val-data '{spec}': no such file (expected a FILE.safetensors, fashion-mnist or mnist:DIR)"
                )),
            })?;
            load_dataset_file(path, classes)?
        }
    };
    Ok((Splits { train: splits.train, test: Some(val) }, splits.test, HeldOut::Validation))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `argv` after `lockstep train`, parsed as the binary parses it.
    fn parsed(argv: &[&str]) -> TrainArgs {
        let full = ["lockstep", "train"].iter().chain(argv).copied();
        match Cli::parse_args(full.map(Into::into)).expect("valid flags").0.command {
            Command::Train(a) => *a,
            _ => unreachable!("a train command"),
        }
    }

    #[test]
    fn every_flag_a_checkpoint_stores_is_one_a_resume_restores() {
        // Every stored option and switch set, in the two sets the conflicts allow.
        let runs = [
            parsed(&[
                "--data=toy",
                "--test-data=t",
                "--classes=2",
                "--epochs=2",
                "--batch-size=4",
                "--optimizer=sgd",
                "--lr=0.1",
                "--lr-schedule=cosine",
                "--momentum=0.9",
                "--nesterov",
                "--weight-decay=0.1",
                "--weight-decay-on=all",
                "--warmup-steps=3",
                "--clip-grad-norm=0.5",
                "--steps=9",
                "--replicas=2",
                "--check-replicas-every=3",
                "--checkpoint-every=4",
                "--no-shuffle",
                "--drop-last",
                "--allow-nonfinite",
                "--accumulate=2",
                "--grad-compression=bf16",
                "--sync-batchnorm",
                "--shard-optimizer",
                "--augment=crop=4,flip",
                "--label-smoothing=0.1",
            ]),
            parsed(&["--val-data=v", "--early-stopping=2", "--save-best=b", "--save=w", "--save-dtype=bf16"]),
            parsed(&["--validation-split=0.2"]),
        ];
        for a in &runs {
            for (id, value) in flag_values(a) {
                assert!(here_known(id), "{id} is stored but not restored");
                if value == "true" {
                    assert!(SWITCHES.contains(&id), "{id} is stored as a switch but not restored as one");
                }
            }
        }
    }
}
