//! `lockstep train`: its arguments (in groups by topic, as `train -h` shows them), the
//! checks that come before any work, the run's observers (progress, JSON lines, CSV),
//! checkpoints, signals, and the final report. The training itself is `crate::train`'s;
//! what a checkpoint records of the run, and how `--resume DIR` continues the run from
//! that record, is `record.rs`'s.
//!
//! [`cmd_train`] reads as the run goes: its settings (a resumed run's completed from its
//! record), the outputs checked against the inputs, the data loaded, the model built, the
//! configuration and its memory, the checkpoints and the position resumed, the first
//! lines, the training with its observers, and how it ended. Each step is a function of
//! its own below it, in that order.
//!
//! Under an MPI launcher every process runs this command with the same arguments; the
//! world's devices are every process's, `--replicas` counts them all, and process 0
//! alone prints, owns the checkpoint directory and writes `--save`, `--save-best`,
//! `--metrics-out` and the checkpoints.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use crate::checkpoint;
use crate::dirlock::DirLock;
use crate::nn::loss::Metrics;
use crate::train::{EarlyStopping, EvaluationReport, HeldOut, Observer, Stopped, StoppedEvaluation, TrainReport};
use crate::world::World;

use signal_hook::consts::SIGINT;

use super::features::FeatureArgs;
mod record;

use super::regularize::RegularizeArgs;
use super::signals::{Launched, StopSignals};
use super::text::{self, GptArgs};
use super::*;
use record::RunRecord;

// ---------------------------------------------------------------------------------------
// arguments

/// `lockstep train`'s flags, one group per topic (each a heading of `train -h`). The clap
/// id of a flag is its field's name, whatever its group: `--resume` and the processes of
/// one run compare flags by it (`record.rs`).
#[derive(Args, Clone, Debug)]
pub(crate) struct TrainArgs {
    #[command(flatten)]
    pub(crate) model_data: ModelDataArgs,
    #[command(flatten)]
    pub(crate) optim: OptimArgs,
    #[command(flatten)]
    pub(crate) length: LengthArgs,
    #[command(flatten)]
    pub(crate) regularize: RegularizeArgs,
    #[command(flatten)]
    pub(crate) ddp: DeviceArgs,
    #[command(flatten)]
    pub(crate) checkpoints: CheckpointArgs,
    #[command(flatten)]
    pub(crate) outputs: OutputArgs,
}

/// What is trained, on which data.
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Model and data")]
pub(crate) struct ModelDataArgs {
    /// toy, convnet, convnet-nobn, resnet8, resnet20, densenet, gpt, llama, or a model spec FILE.json (see examples/*.json).
    #[arg(long, default_value = "convnet", value_name = "NAME|FILE.json", value_parser = parse_model_choice)]
    pub(crate) model: ModelChoice,
    /// toy, toy-enlarged, digits, fashion-mnist (Debian's dataset-fashion-mnist), mnist:DIR (IDX files, plain or .gz), fortunes (Debian's fortunes, as text), text:FILE (a file's bytes as tokens), or a FILE.safetensors (tensors x and y, or a token file's tokens) [default: toy for flat models, fortunes for gpt and llama, digits otherwise]
    #[arg(long)]
    pub(crate) data: Option<String>,
    /// The model's number of classes (its outputs) [default: the training data's: 10 for
    /// MNIST-format and the digits, a file's `num_classes` metadata, else its largest label
    /// + 1 up to 65,536]. Every label must be below it.
    #[arg(long, value_name = "K")]
    pub(crate) classes: Option<usize>,
    /// A separate test split for --data FILE (evaluated after every epoch).
    #[arg(long, value_name = "FILE")]
    pub(crate) test_data: Option<PathBuf>,
    /// Hold out this fraction (0 < F < 1) of the training samples as the validation set,
    /// evaluated after every epoch in place of the test split: the LAST F of the samples
    /// after a fixed shuffle drawn from --seed (independent of the epoch shuffles).
    #[arg(long, value_name = "F", conflicts_with_all = ["val_data", "test_data"])]
    pub(crate) validation_split: Option<f64>,
    /// A validation split evaluated after every epoch in place of the test split: a
    /// FILE.safetensors, fashion-mnist or mnist:DIR (their test files).
    #[arg(long, value_name = "FILE|mnist:DIR", conflicts_with = "test_data")]
    pub(crate) val_data: Option<String>,
    /// Dropout rate of the built-in convnet and gpt, in [0, 1) (0 removes the convnet's
    /// layer); a spec file sets its own [default: convnet 0.5, gpt 0; the llama has none].
    #[arg(allow_negative_numbers = true, long)]
    pub(crate) dropout: Option<f32>,
    /// Momentum of the convnet's BatchNorm running statistics, in [0, 1): the library's
    /// `ConvnetOptions` default. Keras uses 0.99; 0.9 follows the weights closely enough on
    /// small datasets such as the digits.
    #[arg(allow_negative_numbers = true, long, default_value_t = ConvnetOptions::default().bn_momentum)]
    pub(crate) bn_momentum: f32,
    /// Start from these weights instead of a seeded initialisation.
    #[arg(long, value_name = "FILE")]
    pub(crate) init: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) gpt: GptArgs,
}

/// How the weights are updated.
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Optimiser and schedule")]
pub(crate) struct OptimArgs {
    /// [default: sgd on the lesson's data (toy, toy-enlarged) with a flat model, adamw for
    /// text, adam otherwise]
    #[arg(long, value_enum)]
    pub(crate) optimizer: Option<OptimizerName>,
    /// Learning rate [default: sgd 0.5 on the lesson's data, else 0.05; adam and adamw 0.001].
    #[arg(allow_negative_numbers = true, long)]
    pub(crate) lr: Option<f32>,
    /// Learning-rate schedule over the run [default: constant on the lesson's data, else cosine].
    #[arg(long, value_enum)]
    pub(crate) lr_schedule: Option<ScheduleName>,
    /// SGD momentum, in [0, 1); an SGD setting, refused with adam and adamw [default: 0].
    #[arg(allow_negative_numbers = true, long)]
    pub(crate) momentum: Option<f32>,
    /// SGD with Nesterov momentum (PyTorch's nesterov=True; needs --momentum above 0).
    #[arg(long)]
    pub(crate) nesterov: bool,
    /// Weight decay (PyTorch's weight_decay): for sgd and adam the L2 penalty added to the
    /// gradient, for adamw the decoupled decay p *= 1 - lr·wd [default: 0.1 for text
    /// (nanoGPT's), else 0].
    #[arg(allow_negative_numbers = true, long)]
    pub(crate) weight_decay: Option<f32>,
    /// Which parameters --weight-decay applies to: weights (tensors of 2 or more
    /// dimensions, not BatchNorm's parameters nor the biases: PyTorch's usual parameter
    /// groups) or all.
    #[arg(long, value_enum, value_name = "WHICH", default_value = "weights")]
    pub(crate) weight_decay_on: DecayOnName,
    /// Linear warm-up over the first N steps: step s runs at (s + 1)/N of the learning
    /// rate, then --lr-schedule runs over the remaining steps [default: 100 for text
    /// (nanoGPT's), else 0].
    #[arg(allow_negative_numbers = true, long, value_name = "N")]
    pub(crate) warmup_steps: Option<u64>,
    /// Clip the gradient to this global L2 norm before every update (PyTorch's
    /// clip_grad_norm_): the norm of the averaged gradient of all replicas, so every
    /// replica scales by the same factor [default: 1 for text (nanoGPT's), else none].
    #[arg(allow_negative_numbers = true, long, value_name = "C")]
    pub(crate) clip_grad_norm: Option<f32>,
    /// Adam's and AdamW's epsilon; the --adam-* flags are refused with sgd [default: 1e-8].
    #[arg(allow_negative_numbers = true, long, value_name = "EPS")]
    pub(crate) adam_eps: Option<f32>,
    /// Adam's and AdamW's beta1 [default: 0.9].
    #[arg(allow_negative_numbers = true, long, value_name = "B1")]
    pub(crate) adam_beta1: Option<f32>,
    /// Adam's and AdamW's beta2 [default: 0.99 for text (nanoGPT's), else 0.999 (PyTorch's)].
    #[arg(allow_negative_numbers = true, long, value_name = "B2")]
    pub(crate) adam_beta2: Option<f32>,
}

/// How long the run is, and how its batches are drawn.
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "The run's length and batching")]
pub(crate) struct LengthArgs {
    /// Passes over the training data [default: 3 on the lesson's data, else 15].
    #[arg(long)]
    pub(crate) epochs: Option<usize>,
    /// Stop after this many steps in all.
    #[arg(long, value_name = "K")]
    pub(crate) steps: Option<u64>,
    /// Stop at the first step boundary past this wall time (90s, 45m, 3h50m, 1:30:00),
    /// for a batch scheduler's limit: a checkpoint is written there with --checkpoint-dir
    /// (else the weights go to --save), and the exit status is 75 (EX_TEMPFAIL), so that
    /// a job script knows to go on with --resume. Not stored: each run gets its own.
    #[arg(long, value_name = "DURATION", value_parser = crate::units::parse_duration)]
    pub(crate) time_limit: Option<Duration>,
    /// Stop once the validation loss has not improved for PATIENCE epochs since the best
    /// one (Keras's EarlyStopping on val_loss; needs --validation-split or --val-data).
    #[arg(long, value_name = "PATIENCE")]
    pub(crate) early_stopping: Option<usize>,
    /// Keep training when the loss becomes NaN or infinite.
    #[arg(long)]
    pub(crate) allow_nonfinite: bool,
    /// GLOBAL batch size: samples per step, whatever the number of devices [default: 2 on
    /// the lesson's data, 12 for text, else 32].
    #[arg(long)]
    pub(crate) batch_size: Option<usize>,
    /// Visit the samples in file order every epoch.
    #[arg(long)]
    pub(crate) no_shuffle: bool,
    /// Drop the short last batch of each epoch.
    #[arg(long)]
    pub(crate) drop_last: bool,
    /// Seed of the initial weights, the shuffling and dropout.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// A text run: steps between evaluations on the validation part (each one an eval
    /// line, and where checkpoints fall by default) [default: 250].
    #[arg(long, value_name = "N")]
    pub(crate) eval_every: Option<usize>,
    /// A text run: batches of --batch-size validation windows each evaluation scores,
    /// drawn once from --seed [default: 20].
    #[arg(long, value_name = "K")]
    pub(crate) eval_batches: Option<usize>,
}

/// Where the run trains, and the data-parallel step's features.
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Devices and DDP features")]
pub(crate) struct DeviceArgs {
    /// auto, cpu, cpu:N, cpu:NxT, cuda, cuda:I[,J...]
    #[arg(long, default_value = "auto", value_name = "SPEC")]
    pub(crate) devices: String,
    /// Logical replicas R (a multiple of the device count) [default: the device count].
    #[arg(long, value_name = "R")]
    pub(crate) replicas: Option<usize>,
    /// Check that every replica is bitwise identical every K steps and at the end [default: 100].
    #[arg(long, value_name = "K")]
    pub(crate) check_replicas_every: Option<u64>,
    #[command(flatten)]
    pub(crate) features: FeatureArgs,
}

/// Where the run's state goes, and where a run continues from.
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Checkpoints and resume")]
pub(crate) struct CheckpointArgs {
    /// Write checkpoints (weights, optimiser state, position, configuration) here.
    #[arg(long, value_name = "DIR")]
    pub(crate) checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints [default: one epoch]. One is also written at the end and
    /// when the run is stopped by SIGINT (Ctrl-C) or SIGTERM.
    #[arg(long, value_name = "N")]
    pub(crate) checkpoint_every: Option<u64>,
    /// Checkpoints kept, newest first.
    #[arg(long, value_name = "K", default_value_t = 3)]
    pub(crate) keep_checkpoints: usize,
    /// Continue the run whose checkpoints are in DIR, configured as it was (its
    /// checkpoints record how); flags given must agree, except --epochs, --steps,
    /// --devices, --early-stopping, --save, --save-best, checkpoint and logging flags.
    #[arg(long, value_name = "DIR")]
    pub(crate) resume: Option<PathBuf>,
    /// With --resume: if the newest checkpoint is corrupt, continue from the newest intact one.
    #[arg(long, requires = "resume")]
    pub(crate) resume_fallback: bool,
}

/// The files the run writes, and what it says.
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Outputs and logs")]
pub(crate) struct OutputArgs {
    /// Save the final weights here (written atomically).
    #[arg(long, value_name = "FILE")]
    pub(crate) save: Option<PathBuf>,
    /// The dtype --save writes: f32, or bf16 / f16 rounded to nearest even (as PyTorch).
    #[arg(long, value_enum, default_value = "f32", requires = "save")]
    pub(crate) save_dtype: SaveDtypeName,
    /// Write the weights of every epoch whose validation loss is the best so far here
    /// (atomically; Keras's ModelCheckpoint(save_best_only=True)).
    #[arg(long, value_name = "FILE")]
    pub(crate) save_best: Option<PathBuf>,
    /// Write step and epoch metrics to this CSV (flushed every epoch; `lockstep plot` draws it).
    #[arg(long, value_name = "FILE.csv")]
    pub(crate) metrics_out: Option<PathBuf>,
    /// text: human lines on stdout (a progress bar on a terminal); json: one JSON object
    /// per step and per epoch on stdout, the human lines on stderr.
    #[arg(long, value_enum, default_value = "text")]
    pub(crate) log_format: LogFormat,
    /// Print every replica's shard loss at every step, in the lesson's form.
    #[arg(long)]
    pub(crate) log_every_step: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

impl LengthArgs {
    /// A text run's evaluation flags, when given, are at least 1.
    fn check_evaluations(&self) -> CliResult {
        for (name, v) in [("--eval-every", self.eval_every), ("--eval-batches", self.eval_batches)] {
            if v == Some(0) {
                return Err(Failure::usage(anyhow!("{name} must be at least 1")));
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// the run, step by step

/// The settings of a run once its flags and the model's defaults are resolved.
struct Settings {
    epochs: usize,
    batch_size: usize,
    optimizer: OptimizerConfig,
    schedule: LrSchedule,
    devices: Devices,
    replicas: usize,
}

/// What the flags resolve to before any file but the model's spec is read.
struct Run {
    source: ModelSource,
    /// What the run calls its model: the source's name, or what a host calls it (a
    /// model it converted, whose spec file is its own temporary one).
    model_name: String,
    /// `--data`, the model's default when not given.
    data_spec: String,
    /// A flat model on data other than text: the digits' flat layout.
    flat: bool,
    settings: Settings,
}

/// The data of a run.
struct RunData {
    /// The training data, and the set evaluated after every epoch (its `test`).
    splits: Splits,
    /// The test split of a run that chooses its epochs on a validation set: evaluated
    /// once, at the end.
    final_test: Option<Dataset>,
    /// What the per-epoch set is.
    held_out: HeldOut,
}

impl RunData {
    /// Whether the training data is a token stream (a text), whose windows are drawn.
    fn stream(&self) -> bool {
        self.splits.train.stream().is_some()
    }

    /// The held-out sets: the per-epoch one, then the final test split.
    fn held(&self) -> impl Iterator<Item = &Dataset> + Clone {
        self.splits.test.iter().chain(&self.final_test)
    }

    /// Every dataset of the run, the training data first.
    fn all(&self) -> impl Iterator<Item = &Dataset> + Clone {
        std::iter::once(&self.splits.train).chain(self.held())
    }
}

/// Where a run starts.
enum Start {
    Fresh,
    /// At a checkpoint of `--resume DIR`, as the line says.
    Resumed(String),
    /// A resumed run that has already taken every step asked for (and said so).
    Finished,
}

pub(crate) fn cmd_train(args: TrainArgs, given: &BTreeSet<String>) -> CliResult {
    run(args, given, None).map(drop)
}

/// A run hosted by another program in its own process (`cli::hosted`, the Python
/// package), instead of the `lockstep` program's: its data given in memory, its lines and
/// its events handed to the host, its stop raised by the host (no signal is caught), and
/// its end returned instead of turned into an exit status.
pub(crate) struct Hosting<'a> {
    /// The data, in place of `--data`.
    pub(crate) data: InMemory<'a>,
    /// Where the run's lines go, one at a time.
    pub(crate) say: &'a dyn Fn(String),
    /// The host's observer, in place of the progress lines.
    pub(crate) observer: &'a mut dyn Observer,
    /// Raised by the host: the run stops after the step it is in.
    pub(crate) stop: Arc<AtomicBool>,
    /// What the run's lines call the model, in place of its `--model`.
    pub(crate) model_name: Option<String>,
}

/// A hosted run's data. (One value a run: its variants' sizes do not matter.)
#[allow(clippy::large_enum_variant)]
pub(crate) enum InMemory<'a> {
    /// Samples: the training set and the per-epoch held-out set (a classifier's).
    Samples(Dataset, Option<Dataset>),
    /// A text's bytes, which a language model reads as `--data text:FILE` reads a file's.
    Text(&'a [u8]),
    /// A text as token ids, split as a text's bytes are.
    Tokens(Vec<u32>),
}

/// How a hosted run ended: its report (the weights of its last step), the model, and the
/// final test split's metrics where it had one.
pub(crate) struct Ended {
    pub(crate) report: TrainReport,
    pub(crate) model: Graph,
    pub(crate) held_out: HeldOut,
}

/// The run, as [`cmd_train`]'s doc says, for the command line (`host` none: its lines on
/// stdout, SIGINT and SIGTERM caught, how it ended an exit status) or for a host
/// ([`Hosting`]: everything in memory, the end returned). A resumed run that had already
/// finished returns none.
pub(crate) fn run(args: TrainArgs, given: &BTreeSet<String>, host: Option<Hosting<'_>>) -> CliResult<Option<Ended>> {
    // One voice: with several processes, process 0 prints, owns the checkpoint directory
    // and writes every output file; every process reads what it resumes from.
    let world = crate::world::current().map_err(Failure::usage)?;
    let voice = world.is_voice();
    let (mut host_data, host) = match host {
        Some(Hosting { data, say, observer, stop, model_name }) => {
            (Some(data), Some((say, observer, stop, model_name)))
        }
        None => (None, None),
    };
    // Every check comes before any work.
    let (mut args, _resumed_lock) = with_the_runs_record(args, given, voice)?;
    let in_memory = host_data.as_ref().map(|d| matches!(d, InMemory::Text(_) | InMemory::Tokens(_)));
    let mut run = resolve(&mut args, world, in_memory)?;
    if let Some(name) = host.as_ref().and_then(|h| h.3.clone()) {
        run.model_name = name;
    }
    let (checkpoint_dir, _lock) = claim_outputs(&args, voice)?;
    let data = match host_data.take() {
        Some(InMemory::Samples(train, held)) => hosted_data(&args, train, held)?,
        Some(InMemory::Text(bytes)) => hosted_text(&args, TextIn::Bytes(bytes))?,
        Some(InMemory::Tokens(ids)) => hosted_text(&args, TextIn::Tokens(ids))?,
        None => load(&args, &run)?,
    };
    let model = build(&mut args, &run, &data, world)?;
    let (mut config, steps_per_epoch) = configure(&args, &run, &data)?;
    let memory = estimate_memory(&model, &run.settings, &data, &config)?;
    let fingerprint = run_fingerprint(&args, &run, &model, &data.splits.train, &config);
    config.checkpoint = checkpoint_policy(&args, &config, &fingerprint, checkpoint_dir, steps_per_epoch)?;
    config.initial = initial_weights(&args, &run, &model)?;
    let total_steps =
        (steps_per_epoch as u64).saturating_mul(run.settings.epochs as u64).min(args.length.steps.unwrap_or(u64::MAX));
    let resuming = match start(&args, &model, &mut config, &fingerprint, total_steps, voice)? {
        Start::Finished => return Ok(None),
        Start::Fresh => None,
        Start::Resumed(line) => Some(line),
    };
    // SIGINT or SIGTERM: finish the step, write a checkpoint (or --save), exit 128 + N.
    // Under mpirun, Ctrl-C reaches the processes as SIGTERM (and SIGUSR2, which mpirun
    // forwards, is caught too): they stop at a step they all agree on. SIGUSR1 prints
    // the flight recorder and the run goes on. A host raises the stop itself.
    let (signals, host_say, observer) = match host {
        None => {
            let signals = StopSignals::install(match world.size() {
                1 => Launched::Alone,
                _ => Launched::Together,
            });
            config.stop = Some(Arc::clone(&signals.stop));
            (Some(signals), None, None)
        }
        Some((say, observer, stop, _)) => {
            config.stop = Some(stop);
            (None, Some(say), Some(observer))
        }
    };
    // With --log-format json, stdout carries only JSON; the human lines go to stderr.
    let human = if args.outputs.log_format == LogFormat::Json { Stream::Stderr } else { Stream::Stdout };
    let say = |text: String| match (voice, host_say) {
        (false, _) => {}
        (true, Some(host)) => host(text),
        (true, None) => human.line(&text),
    };
    announce(&say, &args, &run, &model, &data, &config, memory, steps_per_epoch, world.size());
    if let Some(line) = resuming {
        say(line);
    }
    let (report, tested) = train_observed(&args, &model, &data, &run.settings, &config, human, world, observer)?;
    match signals {
        Some(signals) => {
            ended(&say, &args, &model, &report, data.held_out, tested.as_ref(), &signals, voice).map(|()| None)
        }
        None => {
            hosted_end(&say, &args, &model, &report, data.held_out, tested.as_ref())?;
            Ok(Some(Ended { report, model, held_out: data.held_out }))
        }
    }
}

/// `--resume DIR`: the directory claimed before its record is read (another run may be
/// writing it), and `args` completed with the run's record ([`record::restore`]).
/// Without it, `args` as given.
fn with_the_runs_record(
    mut args: TrainArgs,
    given: &BTreeSet<String>,
    voice: bool,
) -> CliResult<(TrainArgs, Option<DirLock>)> {
    let Some(dir) = args.checkpoints.resume.clone() else { return Ok((args, None)) };
    check_resume_dir(&dir)?;
    let lock = voice.then(|| claim_checkpoint_dir(&dir, true)).transpose()?;
    record::restore(&mut args, given, &dir, voice)?;
    Ok((args, lock))
}

/// The run's settings before any data is read: `--model` resolved (a spec file read and
/// checked), `--data` defaulted, the model's defaults taken, every flag checked that needs
/// no file, and the processes of the run agreed on them.
fn resolve(args: &mut TrainArgs, world: &World, in_memory: Option<bool>) -> CliResult<Run> {
    let source = args.model_data.model.resolve()?;
    if let Some(text) = in_memory {
        if let Some(spec) = &args.model_data.data {
            return Err(Failure::usage(anyhow!("--data {spec}: the data is given in memory; give no --data")));
        }
        match (source.is_language_model(), text) {
            (true, false) => {
                return Err(Failure::usage(anyhow!(
                    "{}: a language model trains on a text; samples and labels are for classifiers",
                    source.name()
                )))
            }
            (false, true) => {
                return Err(Failure::usage(anyhow!(
                    "a text is what a language model reads (gpt, llama, or a spec that starts with an embedding); the {} model reads samples and labels",
                    source.name()
                )))
            }
            _ => {}
        }
    }
    let in_memory = in_memory.is_some();
    let data_spec = match in_memory {
        true => IN_MEMORY.to_string(),
        false => args.model_data.data.get_or_insert_with(|| source.default_data().to_string()).clone(),
    };
    // Each model its kind of data, said by what the model reads rather than by the
    // shapes that would not fit.
    if source.is_language_model() && text::is_builtin_data(&data_spec) {
        return Err(text::not_text(&source.name(), &data_spec));
    }
    if !in_memory && !source.is_language_model() && text::is_text(&data_spec) {
        return Err(text::not_a_language_model(&source.name(), &data_spec));
    }
    // A run over text (or a token file): a language model's, whose data that is.
    let text = source.is_language_model();
    let flat = source.flat() && !text;
    // The lesson's recipe (SGD 0.5, batch 2) is for the lesson's few points: a flat model
    // on data of its own (a file, the digits) trains as the convnet does.
    let toy = flat && LESSON_DATA.contains(&data_spec.as_str());
    let settings = settings(args, toy, text)?;
    agree_flags(world, args, &settings.devices)?;
    Ok(Run { model_name: source.name(), source, data_spec, flat, settings })
}

/// The outputs checked before anything is loaded — process 0's files against each other
/// (every one writable, no two the same), the monitors against the held-out data they
/// need — and the checkpoint directory claimed: `--checkpoint-dir`, or back into the
/// directory being resumed, this run's from here to the end of the process.
fn claim_outputs(args: &TrainArgs, voice: bool) -> CliResult<(Option<PathBuf>, Option<DirLock>)> {
    if voice {
        check_output_files(args)?;
    }
    check_monitors(args)?;
    let resume = args.checkpoints.resume.as_deref();
    let dir = args.checkpoints.checkpoint_dir.clone().or_else(|| resume.map(Path::to_path_buf));
    let lock = dir.as_deref().filter(|_| voice).map(|d| claim_checkpoint_dir(d, resume == Some(d))).transpose()?;
    Ok((dir, lock))
}

/// The data: a text as windows of `--context` tokens (its validation part its last tenth
/// by position), else `--data` with its test split and the validation set chosen.
fn load(args: &TrainArgs, run: &Run) -> CliResult<RunData> {
    let (m, spec, seed) = (&args.model_data, &run.data_spec, args.length.seed);
    let (splits, final_test, held_out) = match text::is_text(spec) {
        true => {
            if m.validation_split.is_some() || m.val_data.is_some() || m.test_data.is_some() {
                return Err(Failure::usage(anyhow!(
                    "--data {spec}: a text's validation part is its last tenth by position (no --validation-split, --val-data or --test-data)"
                )));
            }
            (m.gpt.load(spec)?, None, HeldOut::Validation)
        }
        false => {
            let splits = load_data(spec, run.flat, seed, m.test_data.as_deref(), m.classes)?;
            with_validation(splits, m.validation_split, m.val_data.as_deref(), seed, m.classes)?
        }
    };
    Ok(RunData { splits, final_test, held_out })
}

/// What a run whose data is given in memory ([`Hosting`]) names its data.
pub(crate) const IN_MEMORY: &str = "data in memory";

/// A hosted run's data: the training set, and the held-out set evaluated after every
/// epoch (Keras's `validation_data`), or `--validation-split`'s part of the training set.
fn hosted_data(args: &TrainArgs, train: Dataset, held: Option<Dataset>) -> CliResult<RunData> {
    let m = &args.model_data;
    for (flag, given) in [("--val-data", m.val_data.is_some()), ("--test-data", m.test_data.is_some())] {
        if given {
            return Err(Failure::usage(anyhow!(
                "{flag}: the data is given in memory; give its held-out set in memory too"
            )));
        }
    }
    if held.is_some() && m.validation_split.is_some() {
        return Err(Failure::usage(anyhow!(
            "--validation-split and a held-out set given in memory: choose one of the two"
        )));
    }
    let splits = Splits { train, test: held };
    let (splits, final_test, held_out) = match splits.test {
        Some(_) => (splits, None, HeldOut::Validation),
        None => with_validation(splits, m.validation_split, None, args.length.seed, m.classes)?,
    };
    Ok(RunData { splits, final_test, held_out })
}

/// A hosted text: bytes, or token ids.
enum TextIn<'a> {
    Bytes(&'a [u8]),
    Tokens(Vec<u32>),
}

/// A hosted run's text, as `--data text:FILE` reads a file of these bytes: windows of
/// `--context` bytes, its last tenth by position the validation part.
fn hosted_text(args: &TrainArgs, text: TextIn<'_>) -> CliResult<RunData> {
    let m = &args.model_data;
    if m.validation_split.is_some() || m.val_data.is_some() || m.test_data.is_some() {
        return Err(Failure::usage(anyhow!(
            "a text's validation part is its last tenth by position (no --validation-split, --val-data or --test-data)"
        )));
    }
    let splits = match text {
        TextIn::Bytes(bytes) => crate::data::text::split_text("the text", bytes, m.gpt.context),
        TextIn::Tokens(ids) => {
            // The vocabulary the ids need; the model's must hold it (checked with the model).
            let vocab = ids.iter().max().map_or(1, |&m| m as usize + 1);
            crate::data::text::split_tokens("the tokens", ids, m.gpt.context, vocab, "tokens")
        }
    }
    .map_err(Failure::usage)?;
    Ok(RunData { splits, final_test: None, held_out: HeldOut::Validation })
}

/// The model for the data: its classes (`--classes`, else the training data's — never the
/// test data's: a label only the test split has is one the model was never trained to
/// output — or the built-in GPT's vocabulary, nanoGPT's bytes), its features
/// (synchronized BatchNorm), checked against every dataset.
fn build(args: &mut TrainArgs, run: &Run, data: &RunData, world: &World) -> CliResult<Graph> {
    let (m, train, source) = (&mut args.model_data, &data.splits.train, &run.source);
    let stated_classes = m.classes;
    let classes =
        *m.classes.get_or_insert(match source.is_language_model() && matches!(source, ModelSource::Builtin(_)) {
            true => crate::data::text::BYTE_VOCAB,
            false => train.num_classes(),
        });
    let dropout = m.dropout.expect("settings resolves it");
    let model = match source {
        ModelSource::Builtin(ModelName::Gpt) => {
            crate::models::gpt(m.gpt.gpt(classes, dropout)).map_err(Failure::usage)?
        }
        ModelSource::Builtin(ModelName::Llama) => {
            if dropout != 0.0 {
                return Err(Failure::usage(anyhow!("--dropout {dropout}: the llama has no dropout (Meta's has none)")));
            }
            crate::models::llama(m.gpt.llama(classes)).map_err(Failure::usage)?
        }
        _ => build_model(source, train.sample_shape().dims(), classes, dropout, m.bn_momentum)?,
    };
    let model = args.ddp.features.model(model)?;
    check_model_classes(&model, stated_classes, &data.all().collect::<Vec<_>>())?;
    // Every process's devices, under mpirun.
    let (replicas, in_world) = (run.settings.replicas, run.settings.devices.len() * world.size());
    if args.ddp.features.sync_batchnorm && replicas != in_world {
        return Err(Failure::usage(anyhow!(
            "--sync-batchnorm needs one logical replica per device: --replicas {replicas} on {in_world} devices"
        )));
    }
    for d in data.all() {
        crate::train::check_data(&model, d).map_err(Failure::usage)?;
    }
    args.regularize.check_data(train)?;
    Ok(model)
}

/// The library's configuration of the run, and the steps of one of its epochs (a text
/// run's: between two evaluations).
fn configure(args: &TrainArgs, run: &Run, data: &RunData) -> CliResult<(TrainConfig, usize)> {
    let (s, l, o, train, stream) = (&run.settings, &args.length, &args.optim, &data.splits.train, data.stream());
    let last_batch = if l.drop_last { LastBatch::Drop } else { LastBatch::Keep };
    let steps_per_epoch = match stream {
        true => l.eval_every.unwrap_or(crate::train::DEFAULT_EVAL_EVERY),
        false => crate::train::scatter::steps_per_epoch(train.len(), s.batch_size, last_batch),
    };
    if steps_per_epoch == 0 {
        return Err(Failure::usage(anyhow!(
            "{} training samples make no full batch of {} with --drop-last",
            train.len(),
            s.batch_size
        )));
    }
    // A batch larger than the training set is the whole set at every step (Keras and
    // PyTorch's loaders do the same); memory is estimated for what a step really takes.
    let batch_size = match last_batch {
        LastBatch::Keep if !stream => s.batch_size.min(train.len()),
        _ => s.batch_size,
    };
    // A text run's evaluations; stored samples evaluate after every real epoch.
    let (eval_every, eval_batches) = if stream { (l.eval_every, l.eval_batches) } else { (None, None) };
    let config = TrainConfig {
        epochs: s.epochs,
        max_steps: l.steps,
        max_duration: l.time_limit,
        batch_size,
        optimizer: s.optimizer,
        schedule: s.schedule,
        warmup_steps: o.warmup_steps.expect("settings resolves it"),
        weight_decay_on: o.weight_decay_on.decay_on(),
        clip_grad_norm: o.clip_grad_norm,
        seed: l.seed,
        shuffle: if l.no_shuffle { Shuffle::None } else { Shuffle::Seeded },
        last_batch,
        replicas: Some(s.replicas),
        check_replicas_every: args.ddp.check_replicas_every,
        non_finite: if l.allow_nonfinite { NonFinite::Allow } else { NonFinite::Error },
        held_out: data.held_out,
        early_stopping: l.early_stopping.map(EarlyStopping::patience),
        save_best: args.outputs.save_best.clone(),
        eval_every,
        eval_batches,
        ..TrainConfig::default()
    };
    let config = args.regularize.config(args.ddp.features.config(config));
    config.validate().map_err(Failure::usage)?;
    Ok((config, steps_per_epoch))
}

/// The memory the run takes, estimated before the weights, the checkpoint or any replica
/// is allocated (the datasets as loaded included), refused if it does not fit; its total.
fn estimate_memory(model: &Graph, s: &Settings, data: &RunData, config: &TrainConfig) -> CliResult<u64> {
    let largest_held_out = data.held().map(Dataset::len).max().unwrap_or(0);
    let sized = TrainConfig { eval_batch: config.eval_batch.min(largest_held_out.max(1)), ..config.clone() };
    let mut estimate = crate::train::memory::fitting(model, &s.devices, &sized);
    let held: u64 = data.held().map(|d| dataset_bytes(d, Evaluated::Yes)).sum();
    let data_bytes = dataset_bytes(&data.splits.train, Evaluated::No).saturating_add(held);
    estimate.add("data", data_bytes, "the datasets as loaded, and the held-out sets gathered as f32 for evaluation");
    // A text's held-out part is scored on windows drawn from it: as many as asked for.
    for held in data.held().filter(|d| d.stream().is_some()) {
        let (windows, bytes) = crate::train::memory::held_out_windows(held, config);
        let (k, b) = (config.eval_batches.unwrap_or(crate::train::DEFAULT_EVAL_BATCHES), config.batch_size);
        estimate.add(
            "held-out windows",
            bytes,
            format!(
                "{} windows of {} tokens, --eval-batches {k} × --batch-size {b}, drawn once and gathered at each evaluation",
                crate::units::count(windows),
                held.sample_shape().numel()
            ),
        );
    }
    estimate.check("training").map_err(Failure::usage)?;
    Ok(estimate.total())
}

/// Where checkpoints go (none without `--checkpoint-dir` or `--resume`), how often, how
/// many are kept, and what each one carries besides the state: the run's fingerprint
/// (compared on loading) and its record (what `--resume DIR` reads back).
fn checkpoint_policy(
    args: &TrainArgs,
    config: &TrainConfig,
    fingerprint: &BTreeMap<String, String>,
    dir: Option<PathBuf>,
    steps_per_epoch: usize,
) -> CliResult<Option<CheckpointPolicy>> {
    let Some(dir) = dir else { return Ok(None) };
    let record = RunRecord::new(args, config).written_in(&dir).to_json()?;
    Ok(Some(CheckpointPolicy {
        dir,
        every: args.checkpoints.checkpoint_every.unwrap_or(steps_per_epoch as u64),
        keep: args.checkpoints.keep_checkpoints,
        config: fingerprint.clone(),
        record: Some(record),
    }))
}

/// `--init`'s weights, for the model.
fn initial_weights(args: &TrainArgs, run: &Run, model: &Graph) -> CliResult<Option<ParamStore>> {
    let Some(p) = &args.model_data.init else { return Ok(None) };
    check_input_file("--init", p)?;
    let weights = super::identify::load_weights(model, &run.source, "--init", p, super::identify::WeightsFor::Train)?;
    Ok(Some(weights))
}

/// Where the run starts: fresh, or at the newest checkpoint of `--resume DIR` (into
/// `config.resume`), the corrupt ones skipped said so. A resumed run that has already
/// taken every step asked for trains nothing: process 0 says so (and writes `--save`).
fn start(
    args: &TrainArgs,
    model: &Graph,
    config: &mut TrainConfig,
    fingerprint: &BTreeMap<String, String>,
    total_steps: u64,
    voice: bool,
) -> CliResult<Start> {
    let Some(dir) = &args.checkpoints.resume else { return Ok(Start::Fresh) };
    let fallback = if args.checkpoints.resume_fallback { Fallback::NewestGood } else { Fallback::Refuse };
    let fresh = Optimizer::new(config.optimizer, model.params_len());
    let Some((r, path, skipped)) =
        checkpoint::load_latest(model, dir, fingerprint, &fresh, fallback).map_err(Failure::usage)?
    else {
        return Err(Failure::usage(anyhow!("--resume '{}': no checkpoint in it", dir.display())));
    };
    for s in skipped.iter().filter(|_| voice) {
        eprintln!("lockstep: skipping corrupt checkpoint {}", s.display());
    }
    if r.step >= total_steps {
        if voice {
            finished_already(args, model, dir, &r, total_steps)?;
        }
        return Ok(Start::Finished);
    }
    let line = format!("lockstep: resuming {} at step {} (epoch {})", path.display(), r.step, r.epoch + 1);
    config.resume = Some(r);
    Ok(Start::Resumed(line))
}

/// The run's first lines: the model, the devices and the data; a note when the devices
/// are oversubscribed; the features; the optimiser, the batch, the length and the seed;
/// the memory.
#[allow(clippy::too_many_arguments)]
fn announce(
    say: &dyn Fn(String),
    args: &TrainArgs,
    run: &Run,
    model: &Graph,
    data: &RunData,
    config: &TrainConfig,
    memory: u64,
    steps_per_epoch: usize,
    processes: usize,
) {
    let (s, splits) = (&run.settings, &data.splits);
    let shown = match processes {
        1 => s.devices.to_string(),
        p => format!("{p} processes × {}", s.devices),
    };
    // A text's samples are its windows, its classes the vocabulary.
    let classes = args.model_data.classes.expect("build resolves it");
    let (unit, outputs) = match data.stream() {
        true => ("windows", format!("a vocabulary of {classes}")),
        false => ("samples", format!("{classes} classes")),
    };
    let test_text = |t: &Dataset| format!(", {} {} {unit}", t.name(), t.len());
    say(format!(
        "lockstep: {} ({} parameters, {outputs}) | devices: {} | replicas: {} | data: {} {} {unit}{}{}",
        run.model_name,
        model.num_params(),
        shown,
        s.replicas,
        splits.train.name(),
        splits.train.len(),
        splits.test.as_ref().map_or(String::new(), test_text),
        data.final_test.as_ref().map_or(String::new(), test_text),
    ));
    if let Some(note) = s.devices.oversubscription_note(s.replicas) {
        say(format!("lockstep: note: {note}"));
    }
    if let Some(features) = features_text(args) {
        say(format!("lockstep: {features}"));
    }
    say(training_line(args, s, config, data.stream(), steps_per_epoch));
    let available = crate::memory::available();
    say(format!(
        "lockstep: memory: an estimated {} of the {} {}",
        crate::units::human(memory),
        available.map_or("unknown".to_string(), |m| crate::units::human(m.bytes)),
        available.map_or("", |m| m.source),
    ));
}

/// The line of how the run trains: the optimiser and its recipe, the global batch, the
/// length (a text run's in steps), the seed, the initial weights and early stopping.
fn training_line(args: &TrainArgs, s: &Settings, config: &TrainConfig, stream: bool, steps_per_epoch: usize) -> String {
    let (l, batch_size) = (&args.length, config.batch_size);
    format!(
        "lockstep: {}{} | global batch {} | {} | seed {}{}{}",
        optimizer_text(&s.optimizer),
        recipe_text(config),
        match batch_size < s.batch_size {
            true => format!("{batch_size} (every training sample; --batch-size {})", s.batch_size),
            false => batch_size.to_string(),
        },
        match stream {
            true => format!("{} steps, evaluated every {steps_per_epoch}", l.steps.unwrap_or(0)),
            false =>
                format!("epochs {}{}", s.epochs, l.steps.map_or(String::new(), |k| format!(" (at most {k} steps)"))),
        },
        l.seed,
        args.model_data.init.as_ref().map_or(String::new(), |p| format!(" | initial weights {}", p.display())),
        l.early_stopping.map_or(String::new(), |p| format!(" | early stopping after {p} epochs without improvement")),
    )
}

/// Trains under the observers (process 0's progress lines or bar, JSON lines and CSV),
/// then evaluates the final test split of a run that ran to its end. The rows of a failed
/// run are kept too; a closed stdout does not fail the run. A hosted run's observer
/// (`host`) takes the progress lines' place.
#[allow(clippy::too_many_arguments)]
fn train_observed(
    args: &TrainArgs,
    model: &Graph,
    data: &RunData,
    s: &Settings,
    config: &TrainConfig,
    human: Stream,
    world: &World,
    host: Option<&mut dyn Observer>,
) -> CliResult<(TrainReport, Option<Metrics>)> {
    let (o, voice) = (&args.outputs, world.is_voice());
    let step_lines = if o.log_every_step { StepLines::Lesson } else { StepLines::Off };
    // mpirun gives process 0 a pseudo-terminal whatever its own output is: plain lines.
    let mut progress = match world.size() {
        1 => Progress::new(human, step_lines),
        _ => Progress::with_drawing(human, step_lines, Drawing::Lines),
    }
    .held_out(data.held_out.name());
    let mut json = (voice && o.log_format == LogFormat::Json).then(|| JsonLines::new(std::io::stdout()));
    let mut csv =
        o.metrics_out.as_deref().filter(|_| voice).map(CsvMetrics::create).transpose().map_err(Failure::usage)?;
    let mut observers = Fanout::new();
    let hosted = host.is_some();
    match host {
        Some(host) => {
            observers.push(host);
        }
        None if voice => {
            observers.push(&mut progress);
        }
        None => {}
    }
    if let Some(j) = &mut json {
        observers.push(j);
    }
    if let Some(c) = &mut csv {
        observers.push(c);
    }
    let trained = train_data_parallel_with(
        model,
        &data.splits.train,
        data.splits.test.as_ref(),
        &s.devices,
        config,
        &mut observers,
    );
    let tested = match (&trained, &data.final_test) {
        (Ok(r), Some(t)) if !matches!(r.stopped, Stopped::Interrupted { .. } | Stopped::TimeLimit { .. }) => {
            let m = evaluate(model, &r.weights, t, &s.devices, config.label_smoothing).map_err(Failure::runtime)?;
            observers.on_evaluation(&EvaluationReport { set: HeldOut::Test, step: r.steps, metrics: m });
            Some(m)
        }
        _ => None,
    };
    drop(observers);
    if !hosted {
        progress.finish();
    }
    let csv_done = csv.map(CsvMetrics::finish).transpose();
    // Processes started with disagreeing arguments were given bad input, as one is.
    let report = trained.map_err(|e| match e {
        crate::Error::Processes { .. } => Failure::usage(e),
        e => Failure::runtime(e),
    })?;
    csv_done.map_err(Failure::runtime)?;
    Ok((report, tested))
}

/// How the run ended, said: the metrics file, the final lines; a run stopped by a signal
/// or by its time limit says where its state went and exits 128 + N or 75; one that ran
/// to its end writes `--save`.
#[allow(clippy::too_many_arguments)]
fn ended(
    say: &dyn Fn(String),
    args: &TrainArgs,
    model: &Graph,
    report: &TrainReport,
    held_out: HeldOut,
    tested: Option<&Metrics>,
    signals: &StopSignals,
    voice: bool,
) -> CliResult {
    let o = &args.outputs;
    said_at_the_end(say, args, report, held_out, tested);
    if let Stopped::Interrupted { checkpoint, evaluation } = &report.stopped {
        return match voice {
            true => interrupted(model, report, checkpoint.as_deref(), *evaluation, o.save.as_deref(), signals),
            false => Err(Failure::silent(StopSignals::exit_code(signals.received().unwrap_or(SIGINT)))),
        };
    }
    if let Stopped::TimeLimit { checkpoint } = &report.stopped {
        return match voice {
            true => timed_out(model, report, checkpoint.as_deref(), args),
            false => Err(Failure::silent(EX_TEMPFAIL)),
        };
    }
    match voice {
        true => saved(say, args, model, report),
        false => Ok(()),
    }
}

/// The lines every run ends with: the metrics file, the final metrics.
fn said_at_the_end(
    say: &dyn Fn(String),
    args: &TrainArgs,
    report: &TrainReport,
    held_out: HeldOut,
    tested: Option<&Metrics>,
) {
    if let Some(p) = &args.outputs.metrics_out {
        say(format!("metrics written to {}", p.display()));
    }
    final_lines(say, report, held_out, tested, args);
}

/// `--save` of a run that ended its training, said.
fn saved(say: &dyn Fn(String), args: &TrainArgs, model: &Graph, report: &TrainReport) -> CliResult {
    let o = &args.outputs;
    if let Some(p) = &o.save {
        weights::save_as(model, &report.weights, p, o.save_dtype.dtype()).map_err(Failure::runtime)?;
        say(format!("weights saved to {} ({})", p.display(), record::enum_name(&o.save_dtype)));
    }
    Ok(())
}

/// How a hosted run ended, said: the metrics file and the final lines, as the command
/// line says them; `--save` written by one that ran to its end (or stopped early by its
/// held-out loss). One the host stopped, or its time limit, says where it stopped and what
/// its checkpoint holds; its weights are the report's, returned to the host.
fn hosted_end(
    say: &dyn Fn(String),
    args: &TrainArgs,
    model: &Graph,
    report: &TrainReport,
    held_out: HeldOut,
    tested: Option<&Metrics>,
) -> CliResult {
    said_at_the_end(say, args, report, held_out, tested);
    let checkpoint = match &report.stopped {
        Stopped::Interrupted { checkpoint, .. } => Some(("interrupted", checkpoint)),
        Stopped::TimeLimit { checkpoint } => Some(("stopped at the time limit", checkpoint)),
        _ => None,
    };
    if let Some((how, checkpoint)) = checkpoint {
        let mut line = format!("lockstep: {how} after step {}", report.steps);
        if let Some(p) = checkpoint {
            line.push_str(&format!("; checkpoint written to {}", p.display()));
        }
        say(line);
        return Ok(());
    }
    saved(say, args, model, report)
}

// ---------------------------------------------------------------------------------------
// settings

/// Resolves the model's defaults and checks every flag that needs no file. A text run
/// (`text`) takes nanoGPT's CPU recipe: batch 12, 2,000 steps, AdamW at 1e-3 with betas
/// (0.9, 0.99) and weight decay 0.1 on the weights, 100 warm-up steps, cosine to a tenth,
/// clipping at norm 1, no dropout; it is counted in steps, an epoch being --eval-every.
fn settings(args: &mut TrainArgs, toy: bool, text: bool) -> CliResult<Settings> {
    args.model_data.gpt.check()?;
    args.length.check_evaluations()?;
    let epochs = take_defaults(args, toy, text)?;
    check_values(args, epochs)?;
    let optimizer = optimizer(&args.optim)?;
    let batch_size = args.length.batch_size.expect("take_defaults resolves it");
    let (devices, replicas) = devices_and_replicas(args, batch_size)?;
    let c = &args.checkpoints;
    if c.checkpoint_every.is_some() && c.checkpoint_dir.is_none() && c.resume.is_none() {
        return Err(Failure::usage(anyhow!("--checkpoint-every needs --checkpoint-dir (or --resume)")));
    }
    let schedule = args.optim.lr_schedule.expect("take_defaults resolves it").schedule();
    Ok(Settings { epochs, batch_size, optimizer, schedule, devices, replicas })
}

/// The data the lesson's recipe (`toy`'s defaults) is for: its points, and their noisy
/// copies.
const LESSON_DATA: [&str; 2] = ["toy", "toy-enlarged"];

/// Fills in the defaults of the flags not given: the lesson's for a flat model on its data
/// (`toy`), nanoGPT's for a text run, the convnet's otherwise. Returns the epochs; a text
/// run's are its evaluations.
fn take_defaults(args: &mut TrainArgs, toy: bool, text: bool) -> CliResult<usize> {
    let (l, o) = (&mut args.length, &mut args.optim);
    let epochs = match text {
        true => {
            if l.epochs.is_some() {
                return Err(Failure::usage(anyhow!(
                    "--epochs: a text run is counted in steps (--steps, evaluated every --eval-every)"
                )));
            }
            let steps = *l.steps.get_or_insert(2000);
            let every = l.eval_every.unwrap_or(crate::train::DEFAULT_EVAL_EVERY) as u64;
            steps.div_ceil(every).max(1) as usize
        }
        false => *l.epochs.get_or_insert(if toy { 3 } else { 15 }),
    };
    l.batch_size.get_or_insert(if toy {
        2
    } else if text {
        12
    } else {
        32
    });
    let optimizer = *o.optimizer.get_or_insert(match (toy, text) {
        (true, _) => OptimizerName::Sgd,
        (_, true) => OptimizerName::Adamw,
        _ => OptimizerName::Adam,
    });
    o.lr.get_or_insert(match (optimizer, toy) {
        (OptimizerName::Sgd, true) => 0.5,
        (OptimizerName::Sgd, false) => 0.05,
        (OptimizerName::Adam | OptimizerName::Adamw, _) => 1e-3,
    });
    o.lr_schedule.get_or_insert(if toy { ScheduleName::Constant } else { ScheduleName::Cosine });
    o.weight_decay.get_or_insert(if text { 0.1 } else { 0.0 });
    o.warmup_steps.get_or_insert(if text { 100 } else { 0 });
    args.model_data.dropout.get_or_insert(match text {
        true => models::GptConfig::default().dropout,
        false => ConvnetOptions::default().dropout,
    });
    // Each optimiser's own settings, and none of the other's: a flag given for the other
    // is refused by `check_optimizer_flags`.
    match optimizer {
        OptimizerName::Sgd => {
            o.momentum.get_or_insert(0.0);
        }
        OptimizerName::Adam | OptimizerName::Adamw => {
            // PyTorch's, as the library's constructor has them; nanoGPT's beta2 for text.
            let OptimizerConfig::Adam { beta1, beta2, eps, .. } = OptimizerConfig::adam(1e-3) else {
                unreachable!("OptimizerConfig::adam is an Adam")
            };
            o.adam_eps.get_or_insert(eps);
            o.adam_beta1.get_or_insert(beta1);
            o.adam_beta2.get_or_insert(if text { 0.99 } else { beta2 });
        }
    }
    if text && o.clip_grad_norm.is_none() {
        o.clip_grad_norm = Some(1.0);
    }
    if args.ddp.check_replicas_every.is_none() {
        args.ddp.check_replicas_every = TrainConfig::default().check_replicas_every;
    }
    Ok(epochs)
}

/// Checks the values of the flags, defaults resolved, that need no file.
fn check_values(args: &TrainArgs, epochs: usize) -> CliResult {
    let (m, o, l) = (&args.model_data, &args.optim, &args.length);
    let lr = o.lr.expect("take_defaults resolves it");
    if epochs == 0 {
        return Err(Failure::usage(anyhow!("--epochs must be at least 1")));
    }
    if l.batch_size == Some(0) {
        return Err(Failure::usage(anyhow!("--batch-size must be at least 1")));
    }
    if !(lr > 0.0 && lr.is_finite()) {
        return Err(Failure::usage(anyhow!("--lr must be a positive number, got {lr}")));
    }
    if !(0.0..1.0).contains(&m.bn_momentum) {
        return Err(Failure::usage(anyhow!("--bn-momentum must be in [0, 1), got {}", m.bn_momentum)));
    }
    let dropout = m.dropout.expect("take_defaults resolves it");
    if !(0.0..1.0).contains(&dropout) {
        return Err(Failure::usage(anyhow!("--dropout must be in [0, 1), got {dropout}")));
    }
    for (name, zero) in [
        ("--steps", l.steps == Some(0)),
        ("--replicas", args.ddp.replicas == Some(0)),
        ("--check-replicas-every", args.ddp.check_replicas_every == Some(0)),
        ("--checkpoint-every", args.checkpoints.checkpoint_every == Some(0)),
        ("--keep-checkpoints", args.checkpoints.keep_checkpoints == 0),
    ] {
        if zero {
            return Err(Failure::usage(anyhow!("{name} must be at least 1")));
        }
    }
    check_classes(m.classes)?;
    args.regularize.check()?;
    if args.ddp.features.accumulate == 0 {
        return Err(Failure::usage(anyhow!("--accumulate must be at least 1 (micro-batches per step)")));
    }
    check_optimizer_flags(o)
}

/// The optimiser's flags suit the optimiser, and their values are in range.
fn check_optimizer_flags(o: &OptimArgs) -> CliResult {
    let optimizer = o.optimizer.expect("take_defaults resolves it");
    let name = record::enum_name(&optimizer);
    match optimizer {
        OptimizerName::Sgd => {
            let adam = [("--adam-eps", o.adam_eps), ("--adam-beta1", o.adam_beta1), ("--adam-beta2", o.adam_beta2)];
            if let Some((flag, _)) = adam.iter().find(|(_, v)| v.is_some()) {
                return Err(Failure::usage(anyhow!(
                    "{flag} is an Adam and AdamW setting; --optimizer {name} has none (its own are --momentum and --nesterov)"
                )));
            }
        }
        OptimizerName::Adam | OptimizerName::Adamw => {
            if o.momentum.is_some() || o.nesterov {
                let flag = if o.momentum.is_some() { "--momentum" } else { "--nesterov" };
                return Err(Failure::usage(anyhow!(
                    "{flag} is an SGD setting; --optimizer {name} has none (its own are --adam-beta1, --adam-beta2 and --adam-eps)"
                )));
            }
        }
    }
    if o.nesterov && o.momentum.unwrap_or(0.0) == 0.0 {
        return Err(Failure::usage(anyhow!("--nesterov needs --momentum above 0 (Nesterov momentum)")));
    }
    let wd = o.weight_decay.expect("take_defaults resolves it");
    if !(wd >= 0.0 && wd.is_finite()) {
        return Err(Failure::usage(anyhow!("--weight-decay must be a number >= 0, got {wd}")));
    }
    if let Some(c) = o.clip_grad_norm {
        if !(c > 0.0 && c.is_finite()) {
            return Err(Failure::usage(anyhow!(
                "--clip-grad-norm must be a positive number (the largest gradient norm), got {c}"
            )));
        }
    }
    Ok(())
}

/// The optimiser of the flags, defaults resolved.
fn optimizer(o: &OptimArgs) -> CliResult<OptimizerConfig> {
    let (lr, wd) = (o.lr.expect("take_defaults resolves it"), o.weight_decay.expect("take_defaults resolves it"));
    let momentum_kind = if o.nesterov { MomentumKind::Nesterov } else { MomentumKind::Classic };
    // Each optimiser's settings are resolved for it alone (`take_defaults`).
    let adam = || {
        let resolved = |v: Option<f32>| v.expect("take_defaults resolves it");
        (resolved(o.adam_beta1), resolved(o.adam_beta2), resolved(o.adam_eps))
    };
    let optimizer = match o.optimizer.expect("take_defaults resolves it") {
        OptimizerName::Sgd => {
            let momentum = o.momentum.expect("take_defaults resolves it");
            OptimizerConfig::Sgd { lr, momentum, momentum_kind, weight_decay: wd }
        }
        OptimizerName::Adam => {
            let (beta1, beta2, eps) = adam();
            OptimizerConfig::Adam { lr, beta1, beta2, eps, weight_decay: wd }
        }
        OptimizerName::Adamw => {
            let (beta1, beta2, eps) = adam();
            OptimizerConfig::AdamW { lr, beta1, beta2, eps, weight_decay: wd }
        }
    };
    optimizer.validate().map_err(Failure::usage)?;
    Ok(optimizer)
}

/// `--devices` resolved, and the logical replicas (`--replicas`, else the world's device
/// count: every process's), which the world's devices share evenly and every one of which
/// gets a sample of the global batch of `batch_size`.
fn devices_and_replicas(args: &mut TrainArgs, batch_size: usize) -> CliResult<(Devices, usize)> {
    let devices = resolve_devices(&args.ddp.devices)?;
    let world = crate::world::current().map_err(Failure::usage)?;
    let in_world = devices.len() * world.size();
    let replicas = args.ddp.replicas.unwrap_or(in_world);
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
    args.ddp.replicas = Some(replicas);
    Ok((devices, replicas))
}

/// Processes started with different flags refuse at once, every one of them, naming the
/// first flag that differs: `process 1 has --dropout 0.1, process 0 has 0.5`. The flags
/// compared are those a checkpoint records (what the run is), once resolved, except those
/// that name files or devices, which may differ from machine to machine: the trainer then
/// compares what they hold (the data's bytes, the model's layers, the devices' number and
/// kind). The number and kind of `devices` come first: `--replicas`, when not given, is
/// counted from them, and a process of other devices would otherwise be told that its
/// replicas differ.
fn agree_flags(world: &World, args: &TrainArgs, devices: &Devices) -> CliResult {
    // What names a file or the devices, and what only process 0 writes.
    const PER_MACHINE: [&str; 7] = ["data", "test_data", "val_data", "save_best", "save", "save_dtype", "devices"];
    let spec_model = matches!(args.model_data.model, ModelChoice::Spec(_));
    let mut settings: Vec<(String, String)> = vec![("--devices".into(), devices_per_process(devices))];
    settings.extend(
        record::flag_words(args)
            .into_iter()
            .filter(|(id, _)| !(PER_MACHINE.contains(id) || spec_model && *id == "model"))
            .map(|(id, words)| (record::flag(id), words.unwrap_or_else(|| "(not given)".into()))),
    );
    world.agree(&settings).map_err(Failure::usage)
}

/// What the processes of a run compare of their `--devices`, which may name different
/// devices on different machines: how many, of which kind (`2 CPU devices per process`).
fn devices_per_process(devices: &Devices) -> String {
    let kind = match devices.list().first() {
        Some(crate::Device::Cuda(_)) => "CUDA",
        _ => "CPU",
    };
    let n = devices.len();
    format!("{n} {kind} device{} per process", if n == 1 { "" } else { "s" })
}

// ---------------------------------------------------------------------------------------
// inputs and outputs

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

/// Every output file can be written, and none is a file the run reads or another output
/// writes (the second writer would destroy the first's file: `--save X --metrics-out X`;
/// an output over an input destroys the data: `--data text:t.txt --save t.txt`), through
/// symbolic and hard links alike; nor a file of the checkpoint directory that the
/// checkpoints write. One pair is allowed: `--init W --save W` continues the weights in
/// place (read at the start, written at the end).
fn check_output_files(args: &TrainArgs) -> CliResult {
    let o = &args.outputs;
    let outputs = [("--save", &o.save), ("--save-best", &o.save_best), ("--metrics-out", &o.metrics_out)];
    let inputs = input_files(args);
    let checkpoints = args.checkpoints.checkpoint_dir.as_deref().or(args.checkpoints.resume.as_deref());
    let mut seen: Vec<(&str, &Path, PathBuf)> = Vec::new();
    for (name, path) in outputs.iter().filter_map(|(n, p)| p.as_ref().map(|p| (*n, p.as_path()))) {
        check_writable(name, path)?;
        let at = resolved(path);
        if let Some((other, _, _)) = seen.iter().find(|(_, p, r)| *r == at || crate::fsutil::same_file(p, path)) {
            return Err(Failure::usage(anyhow!(
                "{name} '{}' is the file {other} writes too: give each output its own file",
                path.display()
            )));
        }
        let read = inputs.iter().filter(|(flag, _)| !(name == "--save" && flag == "--init"));
        if let Some((flag, input)) = read.into_iter().find(|(_, input)| crate::fsutil::same_file(input, path)) {
            let link = if resolved(input) == at { "" } else { ", through a link" };
            return Err(Failure::usage(anyhow!(
                "{name} '{}' is the file {flag} reads ({}{link}): writing it would destroy the run's input; give {name} a file of its own",
                path.display(),
                input.display()
            )));
        }
        seen.push((name, path, at));
    }
    // A checkpoint, or the directory's lock, under another flag's name: written over or
    // pruned by the run's checkpoints.
    let Some(dir) = checkpoints else { return Ok(()) };
    let named = seen.iter().map(|(n, p, _)| (n.to_string(), p.to_path_buf())).chain(inputs);
    for (flag, path) in named {
        let parent = resolved(&path).parent().map(Path::to_path_buf).unwrap_or_default();
        let in_dir = crate::fsutil::same_file(&parent, dir) || parent == resolved(dir);
        if in_dir && path.file_name().is_some_and(crate::checkpoint::is_run_file) {
            return Err(Failure::usage(anyhow!(
                "{flag} '{}' is a file of the checkpoint directory '{}', which the run's checkpoints write and remove: give {flag} a file outside it, or another name",
                path.display(),
                dir.display()
            )));
        }
    }
    Ok(())
}

/// The files the run reads, each with the flag that names it: `--data` (a file,
/// `text:FILE`, or every file of the directory of `mnist:DIR`, `fashion-mnist` or
/// `fortunes`), `--test-data`, `--val-data`, `--init`, and the `--model` spec. A name
/// that is no file is left out (nothing there to destroy; loading it says what is wrong).
fn input_files(args: &TrainArgs) -> Vec<(String, PathBuf)> {
    let m = &args.model_data;
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    let mut data = |flag: &str, spec: &str| {
        let dir = match spec {
            // Made in memory: no file.
            "toy" | "toy-enlarged" | "digits" => return,
            "fashion-mnist" => crate::data::fashion_mnist::fashion_mnist_dir().ok(),
            "fortunes" => Some(
                std::env::var_os(crate::data::text::FORTUNES_DIR_VAR)
                    .map_or_else(|| PathBuf::from(crate::data::text::FORTUNES_DIR), PathBuf::from),
            ),
            _ => spec.strip_prefix("mnist:").map(PathBuf::from),
        };
        match dir {
            Some(dir) => {
                let entries = std::fs::read_dir(dir).into_iter().flatten().flatten();
                files.extend(entries.map(|e| (flag.to_string(), e.path())).filter(|(_, p)| p.is_file()));
            }
            None => files.push((flag.to_string(), PathBuf::from(spec.strip_prefix("text:").unwrap_or(spec)))),
        }
    };
    if let Some(spec) = &m.data {
        data("--data", spec);
    }
    if let Some(spec) = &m.val_data {
        data("--val-data", spec);
    }
    if let Some(p) = &m.test_data {
        files.push(("--test-data".into(), p.clone()));
    }
    if let Some(p) = &m.init {
        files.push(("--init".into(), p.clone()));
    }
    if let ModelChoice::Spec(p) = &m.model {
        files.push(("--model".into(), p.clone()));
    }
    files.retain(|(_, p)| p.is_file());
    files
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

/// `--early-stopping` and `--save-best` choose epochs by a validation set, never by the
/// test split (which would then measure nothing): Keras monitors `val_loss`.
fn check_monitors(args: &TrainArgs) -> CliResult {
    let (early_stopping, m) = (args.length.early_stopping, &args.model_data);
    let monitors = early_stopping.is_some() || args.outputs.save_best.is_some();
    if monitors && m.validation_split.is_none() && m.val_data.is_none() {
        let name = if early_stopping.is_some() { "--early-stopping" } else { "--save-best" };
        return Err(Failure::usage(anyhow!(
            "{name} monitors the validation loss: give --validation-split F or --val-data (the test split only measures)"
        )));
    }
    Ok(())
}

/// The end of a run a signal stopped: the held-out evaluation it gave up, if it gave one
/// up (how far it got: the user sees that the signal did not wait for its end), where
/// its state went (the checkpoint, else the weights of its last step to `--save`), said
/// on stderr, and the exit code 128 + N.
fn interrupted(
    model: &Graph,
    report: &TrainReport,
    checkpoint: Option<&Path>,
    evaluation: Option<StoppedEvaluation>,
    save: Option<&Path>,
    signals: &StopSignals,
) -> CliResult {
    let signal = signals.received().unwrap_or(SIGINT);
    let mut line = format!("lockstep: interrupted by {} after step {}", StopSignals::name(signal), report.steps);
    if let Some(e) = evaluation {
        line.push_str(&format!("; its evaluation given up after {} of {} samples, unreported", e.evaluated, e.of));
    }
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
fn timed_out(model: &Graph, report: &TrainReport, checkpoint: Option<&Path>, args: &TrainArgs) -> CliResult {
    let limit = args.length.time_limit.map_or_else(String::new, |d| format!(" ({})", crate::units::duration(d)));
    let mut line = format!("lockstep: stopped at the time limit{limit} after step {}", report.steps);
    match (checkpoint, args.outputs.save.as_deref()) {
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
    model: &Graph,
    weights: &ParamStore,
    data: &Dataset,
    devices: &Devices,
    label_smoothing: f32,
) -> crate::Result<Metrics> {
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
fn final_lines(
    say: &dyn Fn(String),
    report: &TrainReport,
    held_out: HeldOut,
    tested: Option<&Metrics>,
    args: &TrainArgs,
) {
    let taken = report.steps - report.first_step;
    let resumed = if taken < report.steps { format!(" (to step {})", report.steps) } else { String::new() };
    // Labels per second: a text run's are its tokens.
    let unit = if report.epochs.first().is_some_and(|e| e.steps_of_run.is_some()) { "tokens" } else { "samples" };
    say(format!("trained {taken} steps{resumed} in {:.2}s ({:.0} {unit}/s)", report.seconds, report.samples_per_sec));
    if let Stopped::EarlyStopping { best_epoch } = report.stopped {
        say(format!(
            "early stopping: no improvement of the validation loss in {} epochs since epoch {}",
            args.length.early_stopping.unwrap_or(0),
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
            args.outputs.save_best.as_ref().map_or(String::new(), |p| format!(" (weights in {})", p.display()))
        ));
    }
    if let Some(t) = tested {
        say(format!("final test accuracy: {:.4} ({}/{})", t.accuracy(), t.correct, t.count));
    }
}

/// `--resume` of a run that has already taken every step asked for: nothing to train.
fn finished_already(args: &TrainArgs, model: &Graph, dir: &Path, r: &checkpoint::Resume, total: u64) -> CliResult {
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
    if let Some(p) = &args.outputs.save {
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
            crate::optim::DecayOn::Weights => " (on the weights)",
            crate::optim::DecayOn::All => " (on every parameter)",
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
fn features_text(args: &TrainArgs) -> Option<String> {
    let mut parts = args.ddp.features.described();
    parts.extend(args.regularize.described());
    (!parts.is_empty()).then(|| parts.join(" | "))
}

/// The settings that decide a run's arithmetic, in words: a checkpoint is only resumed
/// by a run that agrees on every one (the device count is free: the logical replicas are
/// here; the epochs and steps are free: a finished run may be extended).
fn run_fingerprint(
    args: &TrainArgs,
    run: &Run,
    model: &Graph,
    train: &Dataset,
    c: &TrainConfig,
) -> BTreeMap<String, String> {
    let m = &args.model_data;
    let layers: Vec<String> = model.layers().iter().map(|l| l.describe()).collect();
    let schedule = match c.schedule {
        LrSchedule::Constant => "constant".to_string(),
        LrSchedule::Cosine { floor } => format!("cosine decay to {floor} of the rate"),
    };
    let entries = [
        ("model", run.model_name.clone()),
        ("layers", layers.join(" → ")),
        ("data", run.data_spec.clone()),
        ("train_samples", train.len().to_string()),
        ("train_digest", format!("{:016x}", train.digest())),
        ("validation_split", m.validation_split.map_or("none".to_string(), |f| f.to_string())),
        ("batch_size", c.batch_size.to_string()),
        ("optimizer", optimizer_text(&c.optimizer)),
        ("schedule", schedule),
        ("seed", c.seed.to_string()),
        ("shuffle", if c.shuffle == Shuffle::Seeded { "seeded" } else { "none" }.to_string()),
        ("last_batch", if c.last_batch == LastBatch::Keep { "kept" } else { "dropped" }.to_string()),
        ("replicas", c.replicas.map_or(String::new(), |r| r.to_string())),
        ("dropout", m.dropout.map_or(String::new(), |d| d.to_string())),
        ("bn_momentum", m.bn_momentum.to_string()),
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
    out.extend(args.regularize.fingerprint());
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
pub(crate) mod tests {
    use super::*;

    /// `argv` after `lockstep train`, parsed as the binary parses it, and the flags typed.
    pub(crate) fn parsed_given(argv: &[&str]) -> (TrainArgs, BTreeSet<String>) {
        let full = ["lockstep", "train"].iter().chain(argv).copied();
        let (cli, matches) = Cli::parse_args(full.map(Into::into)).expect("valid flags");
        let given = typed(&matches, "train");
        match cli.command {
            Command::Train(args) => (*args, given),
            _ => unreachable!("a train command"),
        }
    }

    /// `argv` after `lockstep train`, parsed as the binary parses it.
    pub(crate) fn parsed(argv: &[&str]) -> TrainArgs {
        parsed_given(argv).0
    }

    /// The lesson's recipe (SGD 0.5, batch 2, 3 epochs, constant) goes with the lesson's
    /// data alone: a flat model on other data — the digits, a file of one's own — takes
    /// the convnet's (Adam 1e-3, batch 32, 15 epochs, cosine), on which the flat digits
    /// reach 0.89 test accuracy where the lesson's stays at chance (0.10, measured).
    #[test]
    fn a_flat_model_takes_the_lessons_recipe_on_the_lessons_data_alone() {
        let files = tempfile::tempdir().unwrap();
        let mine = files.path().join("mine.safetensors");
        crate::data::safetensors_file::save_safetensors_dataset(&crate::data::toy::toy().train, &mine).unwrap();
        let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/toy_mlp.json");
        let recipe = |argv: &[&str]| {
            let (a, _) = resolved(parsed(&[argv, &["--devices=cpu:1"]].concat()));
            let (o, l) = (&a.optim, &a.length);
            (o.optimizer.unwrap(), o.lr.unwrap(), l.batch_size.unwrap(), l.epochs.unwrap(), o.lr_schedule.unwrap())
        };
        let lesson = (OptimizerName::Sgd, 0.5, 2, 3, ScheduleName::Constant);
        let convnet = (OptimizerName::Adam, 1e-3, 32, 15, ScheduleName::Cosine);
        assert_eq!(recipe(&["--model=toy"]), lesson);
        assert_eq!(recipe(&["--model=toy", "--data=toy-enlarged"]), lesson);
        assert_eq!(recipe(&["--model", spec]), lesson);
        assert_eq!(recipe(&["--model=toy", "--data=digits"]), convnet);
        assert_eq!(recipe(&["--model", spec, "--data", mine.to_str().unwrap()]), convnet);
        assert_eq!(recipe(&[]), convnet);
    }

    /// The library's convnet and `train`'s are built from one set of defaults.
    #[test]
    fn the_convnets_defaults_are_the_librarys() {
        let (a, _) = resolved(parsed(&["--devices=cpu:1", "--steps=1"]));
        let library = ConvnetOptions::default();
        assert_eq!((a.model_data.bn_momentum, a.model_data.dropout), (library.bn_momentum, Some(library.dropout)));
        // `train`'s default before the two were one: its runs' weights and checkpoints'
        // fingerprints stay what they were.
        assert_eq!(library.bn_momentum, 0.9);
    }

    /// Processes are compared on their devices by number and kind, not by name.
    #[test]
    fn devices_are_compared_by_count_and_kind() {
        assert_eq!(devices_per_process(&Devices::cpu(1, 1).unwrap()), "1 CPU device per process");
        assert_eq!(devices_per_process(&Devices::cpu(2, 1).unwrap()), "2 CPU devices per process");
    }

    /// `args` resolved as `cmd_train` resolves them before it trains (the settings, the
    /// data, the model, the configuration), and the record its checkpoints would carry.
    pub(crate) fn resolved(mut args: TrainArgs) -> (TrainArgs, RunRecord) {
        let world = crate::world::current().unwrap();
        let run = resolve(&mut args, world, None).map_err(|f| f.error).unwrap();
        let data = load(&args, &run).map_err(|f| f.error).unwrap();
        build(&mut args, &run, &data, world).map_err(|f| f.error).unwrap();
        let (config, _) = configure(&args, &run, &data).map_err(|f| f.error).unwrap();
        let record = RunRecord::new(&args, &config);
        (args, record)
    }
}
