//! The `lockstep` command line: parse → validate → call the library.
//!
//! Owns: the subcommands (`train`, `eval`, `predict`, `inspect`, `devices`, `plot`,
//! `bench allreduce`, `bench step`, `bench layers`), their defaults, the checks of every
//! input BEFORE any work starts, the
//! progress lines, and the mapping of failures to exit codes: 2 for a usage or input
//! error (a bad flag, a missing or malformed file, a device that is not there), 1 for a
//! failure while running (a worker error, a non-finite loss, a replica mismatch). Every
//! failure is one line `error: ...` on stderr.
//!
//! It leaves everything numerical to the library: models (`lockstep::models`), data
//! (`lockstep::data`), the trainer (`lockstep::train`), weights files
//! (`lockstep::weights`). This is the only file of the crate that uses `anyhow`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use clap::{Args, Parser, Subcommand, ValueEnum};

use lockstep::checkpoint::{CheckpointPolicy, Fallback};
use lockstep::comm::shm::ShmExchange;
use lockstep::comm::Collective;
use lockstep::data::digits::{load_digits, DigitsLayout};
use lockstep::data::idx::{load_idx_images, load_mnist_dir};
use lockstep::data::safetensors_file::load_safetensors_dataset;
use lockstep::data::{toy, Dataset, Features, Splits};
use lockstep::devices::{available_cores, DeviceSpec, Devices};
use lockstep::models::{self, ConvnetOptions, Norm};
use lockstep::nn::{ParamStore, Sequential};
use lockstep::observe::{CsvMetrics, Fanout, JsonLines, Progress, StepLines, Stream};
use lockstep::optim::{LrSchedule, Optimizer, OptimizerConfig};
use lockstep::spec::ModelSpec;
use lockstep::train::{train_data_parallel_with, with_trainer, Batch, LastBatch, NonFinite, Shuffle, TrainConfig};
use lockstep::weights;

/// mimalloc keeps freed pages for reuse: each step allocates activations of megabytes,
/// which the system allocator would return to the kernel and fault back in every step
/// (measured: ~20% of a convnet step).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `println!` that ignores a closed stdout (`lockstep ... | head`) instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// Exit code of a usage or input error (clap's own code for bad arguments).
const EXIT_USAGE: u8 = 2;
/// Exit code of a failure while running.
const EXIT_RUNTIME: u8 = 1;

/// Noisy copies of the lesson's points in `--data toy-enlarged`.
const TOY_ENLARGE_FACTOR: usize = 4;

#[derive(Parser, Debug)]
#[command(
    name = "lockstep",
    version,
    about = "Synchronous data-parallel training in one process: one thread per device"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a model data-parallel on every device given (default: the convnet on the embedded digits).
    Train(Box<TrainArgs>),
    /// Loss, accuracy and confusion matrix of saved weights on a dataset.
    Eval(EvalArgs),
    /// The top class and its probability for every input, one line each: `index  class  probability`.
    Predict(PredictArgs),
    /// List the tensors of a safetensors file: name, dtype, shape.
    Inspect {
        /// The safetensors file (weights or a dataset).
        file: PathBuf,
    },
    /// The CPU cores and GPUs this machine offers.
    Devices,
    /// Measure the collective or the training step.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Draw the loss and accuracy curves of a `train --metrics-out` CSV into a PNG.
    Plot(PlotArgs),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// The shared-memory all-reduce of CPU devices, nccl-tests style.
    Allreduce(BenchAllreduceArgs),
    /// Samples per second of training steps.
    Step(BenchStepArgs),
    /// Where a training step's time goes: forward and backward of every layer.
    Layers(BenchLayersArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModelName {
    /// The lesson's 2-30-20-2 MLP.
    Toy,
    /// The Keras guide's MNIST convnet, with BatchNorm.
    Convnet,
    /// The convnet without BatchNorm.
    ConvnetNobn,
}

impl ModelName {
    fn as_str(self) -> &'static str {
        match self {
            ModelName::Toy => "toy",
            ModelName::Convnet => "convnet",
            ModelName::ConvnetNobn => "convnet-nobn",
        }
    }
}

/// `--model`: a built-in name, or a model spec file (anything ending in `.json`, or an
/// existing file; see `lockstep::spec`).
#[derive(Clone, Debug, PartialEq, Eq)]
enum ModelChoice {
    Builtin(ModelName),
    Spec(PathBuf),
}

fn parse_model_choice(text: &str) -> Result<ModelChoice, String> {
    if let Ok(name) = ModelName::from_str(text, false) {
        return Ok(ModelChoice::Builtin(name));
    }
    let path = Path::new(text);
    if text.ends_with(".json") || path.is_file() {
        return Ok(ModelChoice::Spec(path.to_path_buf()));
    }
    Err("expected toy, convnet, convnet-nobn or a model spec FILE.json".into())
}

/// `--model` once its spec file, if any, has been read and checked.
enum ModelSource {
    Builtin(ModelName),
    Spec(PathBuf, ModelSpec),
}

impl ModelChoice {
    fn resolve(&self) -> CliResult<ModelSource> {
        match self {
            ModelChoice::Builtin(name) => Ok(ModelSource::Builtin(*name)),
            ModelChoice::Spec(path) => {
                if !path.is_file() {
                    return Err(Failure::usage(anyhow!("--model '{}': no such file", path.display())));
                }
                let spec = ModelSpec::from_file(path).map_err(Failure::usage)?;
                Ok(ModelSource::Spec(path.clone(), spec))
            }
        }
    }
}

impl ModelSource {
    /// Whether the model takes flat samples (F,): the toy MLP, or a spec whose input
    /// shape has one dimension. Flat models get the toy's defaults (data, optimizer,
    /// batch size, epochs), image models the convnet's.
    fn flat(&self) -> bool {
        match self {
            ModelSource::Builtin(name) => *name == ModelName::Toy,
            ModelSource::Spec(_, spec) => spec.input_shape.len() == 1,
        }
    }

    fn name(&self) -> String {
        match self {
            ModelSource::Builtin(name) => name.as_str().to_string(),
            ModelSource::Spec(path, _) => path.display().to_string(),
        }
    }

    fn default_data(&self) -> &'static str {
        if self.flat() {
            "toy"
        } else {
            "digits"
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ScheduleName {
    /// The same learning rate at every step.
    Constant,
    /// Cosine decay to a tenth of the learning rate by the last step.
    Cosine,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OptimizerName {
    Sgd,
    Adam,
}

#[derive(Args, Debug)]
struct TrainArgs {
    /// toy, convnet, convnet-nobn, or a model spec FILE.json (see examples/*.json).
    #[arg(long, default_value = "convnet", value_name = "NAME|FILE.json", value_parser = parse_model_choice)]
    model: ModelChoice,
    /// toy, toy-enlarged, digits, mnist:DIR (IDX files, plain or .gz), or a FILE.safetensors (tensors x and y) [default: toy for flat models, digits otherwise]
    #[arg(long)]
    data: Option<String>,
    /// A separate test split for --data FILE (evaluated after every epoch).
    #[arg(long, value_name = "FILE")]
    test_data: Option<PathBuf>,
    /// Hold out this fraction (0 < F < 1) of the training samples as the validation set,
    /// evaluated after every epoch in place of the test split: the LAST F of the samples
    /// after a fixed shuffle drawn from --seed (independent of the epoch shuffles).
    #[arg(long, value_name = "F", conflicts_with_all = ["val_data", "test_data"])]
    validation_split: Option<f64>,
    /// A validation split evaluated after every epoch in place of the test split: a
    /// FILE.safetensors or mnist:DIR (its t10k files).
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
    /// L2 penalty added to the gradient (PyTorch's weight_decay).
    #[arg(allow_negative_numbers = true, long, default_value_t = 0.0)]
    weight_decay: f32,
    /// Adam's epsilon.
    #[arg(allow_negative_numbers = true, long, default_value_t = 1e-8)]
    adam_eps: f32,
    /// Dropout rate of the built-in convnet, in [0, 1) (0 removes the layer); a spec file sets its own.
    #[arg(allow_negative_numbers = true, long, default_value_t = 0.5)]
    dropout: f32,
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
    /// Visit the samples in file order every epoch.
    #[arg(long)]
    no_shuffle: bool,
    /// Drop the short last batch of each epoch.
    #[arg(long)]
    drop_last: bool,
    /// Stop after this many steps in all.
    #[arg(long, value_name = "K")]
    steps: Option<u64>,
    /// auto, cpu, cpu:N, cpu:NxT, cuda, cuda:I[,J...]
    #[arg(long, default_value = "auto", value_name = "SPEC")]
    devices: String,
    /// Logical replicas R (a multiple of the device count) [default: the device count].
    #[arg(long, value_name = "R")]
    replicas: Option<usize>,
    /// Check that every replica is bitwise identical every K steps (and at the end).
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
    /// Steps between checkpoints [default: one epoch]. One is also written at the end and on Ctrl-C.
    #[arg(long, value_name = "N")]
    checkpoint_every: Option<u64>,
    /// Checkpoints kept, newest first.
    #[arg(long, value_name = "K", default_value_t = 3)]
    keep_checkpoints: usize,
    /// Continue the run whose checkpoints are in DIR (give the same arguments as the run).
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PlotX {
    Step,
    Epoch,
}

#[derive(Args, Debug)]
struct PlotArgs {
    /// A metrics CSV written by `train --metrics-out`.
    csv: PathBuf,
    /// The PNG to write (atomically).
    #[arg(short, long, value_name = "FILE.png")]
    out: PathBuf,
    /// What the horizontal axis counts.
    #[arg(long = "x", value_enum, default_value = "step")]
    x: PlotX,
}

#[derive(Args, Debug)]
struct EvalArgs {
    /// The weights to evaluate.
    #[arg(long, value_name = "FILE")]
    weights: PathBuf,
    /// toy, convnet, convnet-nobn, or a model spec FILE.json.
    #[arg(long, default_value = "convnet", value_name = "NAME|FILE.json", value_parser = parse_model_choice)]
    model: ModelChoice,
    /// toy, toy-enlarged, digits, mnist:DIR (their test split), or a FILE.safetensors [default: the model's data]
    #[arg(long)]
    data: Option<String>,
    #[arg(long, default_value = "auto", value_name = "SPEC")]
    devices: String,
    /// Seed of toy-enlarged's noise.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args, Debug)]
struct PredictArgs {
    /// The trained weights.
    #[arg(long, value_name = "FILE")]
    weights: PathBuf,
    /// toy, convnet, convnet-nobn, or a model spec FILE.json.
    #[arg(long, default_value = "convnet", value_name = "NAME|FILE.json", value_parser = parse_model_choice)]
    model: ModelChoice,
    /// The inputs: a FILE.safetensors (its x), an IDX images file (idx3, plain or .gz; no
    /// labels needed), mnist:DIR (its t10k images), or toy, toy-enlarged, digits (their test split).
    #[arg(long, value_name = "FILE|mnist:DIR")]
    data: String,
    /// Only the first N inputs.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    #[arg(long, default_value = "auto", value_name = "SPEC")]
    devices: String,
}

#[derive(Args, Debug)]
struct BenchAllreduceArgs {
    /// CPU devices, one rank each: cpu:N.
    #[arg(long, default_value = "cpu:2", value_name = "SPEC")]
    devices: String,
    /// Buffer sizes in bytes, comma-separated, with K/M/G suffixes (powers of 1024).
    #[arg(long, default_value = "4K,256K,4M,64M")]
    sizes: String,
    /// Timed iterations per size (after warm-up); the median is reported.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Untimed iterations before the timed ones.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
}

#[derive(Args, Debug)]
struct BenchStepArgs {
    #[arg(long, value_enum, default_value = "convnet")]
    model: ModelName,
    /// GLOBAL batch size [default: toy 64, convnet 128].
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long, default_value = "auto", value_name = "SPEC")]
    devices: String,
    /// Timed steps (after warm-up).
    #[arg(long, default_value_t = 20, value_name = "K")]
    steps: u64,
    /// Untimed steps before the timed ones.
    #[arg(long, default_value_t = 3)]
    warmup: u64,
}

#[derive(Args, Debug)]
struct BenchLayersArgs {
    #[arg(long, value_enum, default_value = "convnet")]
    model: ModelName,
    /// Samples per forward/backward (one device's share of a step) [default: toy 64, convnet 256].
    #[arg(long)]
    batch_size: Option<usize>,
    /// Threads of the device's pool [default: every core].
    #[arg(long)]
    threads: Option<usize>,
    /// Timed passes (after one untimed).
    #[arg(long, default_value_t = 10)]
    steps: u32,
}

// ---------------------------------------------------------------------------------------
// Failures and exit codes

/// A failure and the exit code it maps to.
#[derive(Debug)]
struct Failure {
    code: u8,
    error: anyhow::Error,
}

impl Failure {
    /// A usage or input error: exit 2.
    fn usage(e: impl Into<anyhow::Error>) -> Failure {
        Failure { code: EXIT_USAGE, error: e.into() }
    }

    /// A failure while running: exit 1.
    fn runtime(e: impl Into<anyhow::Error>) -> Failure {
        Failure { code: EXIT_RUNTIME, error: e.into() }
    }
}

/// Library errors met after validation: input-shaped ones still exit 2.
impl From<lockstep::Error> for Failure {
    fn from(e: lockstep::Error) -> Failure {
        use lockstep::Error as E;
        let code = match &e {
            E::Config { .. }
            | E::DeviceSpec { .. }
            | E::Format { .. }
            | E::WeightsMismatch { .. }
            | E::Data { .. }
            | E::CudaUnavailable(_) => EXIT_USAGE,
            _ => EXIT_RUNTIME,
        };
        Failure { code, error: e.into() }
    }
}

type CliResult<T = ()> = Result<T, Failure>;

/// One line: the error chain joined by ": ", a multi-line cause joined by "; ".
fn one_line(e: &anyhow::Error) -> String {
    // A cause that its parent's message already ends with (an io::Error that both
    // displays and sources) is said once.
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let t = cause.to_string();
        if !parts.last().is_some_and(|p| p.ends_with(&t)) {
            parts.push(t);
        }
    }
    let text = parts.join(": ");
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    lines.join("; ").replace(":; ", ": ")
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                let _ = e.print();
                return ExitCode::from(EXIT_USAGE);
            }
            // clap's message up to its first blank line ("Usage:", "For more information"),
            // as one line.
            let text = e.render().to_string();
            let msg: Vec<&str> =
                text.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).filter(|l| !l.is_empty()).collect();
            let msg = msg.join(" ");
            let msg = msg.strip_prefix("error: ").unwrap_or(&msg);
            eprintln!("error: {msg}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let result = match cli.command {
        Command::Train(a) => cmd_train(*a),
        Command::Eval(a) => cmd_eval(a),
        Command::Predict(a) => cmd_predict(a),
        Command::Inspect { file } => cmd_inspect(&file),
        Command::Devices => cmd_devices(),
        Command::Bench(BenchCommand::Allreduce(a)) => cmd_bench_allreduce(a),
        Command::Bench(BenchCommand::Step(a)) => cmd_bench_step(a),
        Command::Bench(BenchCommand::Layers(a)) => cmd_bench_layers(a),
        Command::Plot(a) => cmd_plot(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {}", one_line(&f.error));
            ExitCode::from(f.code)
        }
    }
}

// ---------------------------------------------------------------------------------------
// Inputs shared by the subcommands

/// Builds `name` for samples of `sample_shape` and `classes` classes.
fn build_model(
    source: &ModelSource,
    sample: &[usize],
    classes: usize,
    dropout: f32,
    bn_momentum: f32,
) -> CliResult<Sequential> {
    let name = match source {
        ModelSource::Builtin(name) => *name,
        // A spec fixes its own shapes; check_data compares them with the data's.
        ModelSource::Spec(_, spec) => return spec.build().map_err(Failure::usage),
    };
    match name {
        ModelName::Toy => match sample {
            [features] => Ok(models::toy_mlp(*features, classes)?),
            _ => Err(Failure::usage(anyhow!(
                "the toy model takes flat samples (F,), the data has samples of shape {sample:?}"
            ))),
        },
        ModelName::Convnet | ModelName::ConvnetNobn => match sample {
            [c, h, w] => Ok(models::convnet(ConvnetOptions {
                norm: if name == ModelName::Convnet { Norm::BatchNorm } else { Norm::None },
                dropout,
                input: (*c, *h, *w),
                classes,
                bn_momentum,
            })?),
            _ => Err(Failure::usage(anyhow!(
                "the {} model takes images (C, H, W), the data has samples of shape {sample:?}",
                name.as_str()
            ))),
        },
    }
}

/// Loads `--data`: a built-in name, or a safetensors file (plus an optional test file).
/// Built-in data takes the layout of a flat model (`flat`) or of an image model.
fn load_data(spec: &str, flat: bool, seed: u64, test_file: Option<&Path>) -> CliResult<Splits> {
    let builtin = match spec {
        "toy" => Some(toy::toy()),
        "toy-enlarged" => Some(toy::toy_enlarged(TOY_ENLARGE_FACTOR, seed).map_err(Failure::usage)?),
        "digits" => {
            Some(load_digits(if flat { DigitsLayout::Flat8 } else { DigitsLayout::Image28 }).map_err(Failure::usage)?)
        }
        _ => match spec.strip_prefix("mnist:") {
            Some(dir) => Some(load_mnist_dir(Path::new(dir)).map_err(Failure::usage)?),
            None => None,
        },
    };
    if let Some(splits) = builtin {
        if test_file.is_some() {
            return Err(Failure::usage(anyhow!("--test-data goes with --data FILE, not the built-in '{spec}'")));
        }
        return Ok(splits);
    }
    let path = Path::new(spec);
    if !path.is_file() {
        return Err(Failure::usage(anyhow!(
            "--data '{spec}': no such file (expected toy, toy-enlarged, digits, mnist:DIR or a FILE.safetensors)"
        )));
    }
    let train = load_safetensors_dataset(path).map_err(Failure::usage)?;
    let test = test_file
        .map(|p| {
            if !p.is_file() {
                return Err(Failure::usage(anyhow!("--test-data '{}': no such file", p.display())));
            }
            load_safetensors_dataset(p).map_err(Failure::usage)
        })
        .transpose()?;
    Ok(Splits { train, test })
}

/// Parses and resolves `--devices`.
fn resolve_devices(spec: &str) -> CliResult<Devices> {
    let parsed: DeviceSpec = spec.parse().map_err(Failure::usage)?;
    parsed.resolve().map_err(Failure::usage)
}

/// Fails unless `path` can be created: its directory exists and accepts a new file, and
/// the path itself is not a directory. Leaves nothing behind.
fn check_writable(flag: &str, path: &Path) -> CliResult {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if path.file_name().is_none() || path.is_dir() {
        return Err(Failure::usage(anyhow!("{flag} '{}': is a directory, not a file path", path.display())));
    }
    if !dir.is_dir() {
        return Err(Failure::usage(anyhow!(
            "{flag} '{}': directory '{}' does not exist",
            path.display(),
            dir.display()
        )));
    }
    let probe = dir.join(format!(".lockstep-write-probe-{}", std::process::id()));
    match std::fs::File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(Failure::usage(anyhow!(
            "{flag} '{}': directory '{}' is not writable: {e}",
            path.display(),
            dir.display()
        ))),
    }
}

fn optimizer_text(o: &OptimizerConfig) -> String {
    match *o {
        OptimizerConfig::Sgd { lr, momentum, weight_decay } => {
            format!("sgd lr {lr} momentum {momentum} weight decay {weight_decay}")
        }
        OptimizerConfig::Adam { lr, beta1, beta2, eps, weight_decay } => {
            format!("adam lr {lr} betas ({beta1}, {beta2}) eps {eps} weight decay {weight_decay}")
        }
    }
}

// ---------------------------------------------------------------------------------------
// train

fn cmd_train(a: TrainArgs) -> CliResult {
    // Every check comes before any work.
    let source = a.model.resolve()?;
    let toy = source.flat();
    let epochs = a.epochs.unwrap_or(if toy { 3 } else { 15 });
    let batch_size = a.batch_size.unwrap_or(if toy { 2 } else { 32 });
    let optimizer = a.optimizer.unwrap_or(if toy { OptimizerName::Sgd } else { OptimizerName::Adam });
    let lr = a.lr.unwrap_or(match (optimizer, toy) {
        (OptimizerName::Sgd, true) => 0.5,
        (OptimizerName::Sgd, false) => 0.05,
        (OptimizerName::Adam, _) => 1e-3,
    });
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
    if !(0.0..1.0).contains(&a.dropout) {
        return Err(Failure::usage(anyhow!("--dropout must be in [0, 1), got {}", a.dropout)));
    }
    if a.steps == Some(0) {
        return Err(Failure::usage(anyhow!("--steps must be at least 1")));
    }
    if a.replicas == Some(0) {
        return Err(Failure::usage(anyhow!("--replicas must be at least 1")));
    }
    if a.check_replicas_every == Some(0) {
        return Err(Failure::usage(anyhow!("--check-replicas-every must be at least 1")));
    }
    if optimizer == OptimizerName::Adam && a.momentum != 0.0 {
        return Err(Failure::usage(anyhow!("--momentum is an SGD setting; Adam uses its betas")));
    }
    let optimizer = match optimizer {
        OptimizerName::Sgd => OptimizerConfig::Sgd { lr, momentum: a.momentum, weight_decay: a.weight_decay },
        OptimizerName::Adam => {
            OptimizerConfig::Adam { lr, beta1: 0.9, beta2: 0.999, eps: a.adam_eps, weight_decay: a.weight_decay }
        }
    };
    optimizer.validate().map_err(Failure::usage)?;
    let devices = resolve_devices(&a.devices)?;
    if let Some(r) = a.replicas {
        if r % devices.len() != 0 {
            return Err(Failure::usage(anyhow!(
                "--replicas {r} cannot be shared evenly by {} devices (use a multiple of {})",
                devices.len(),
                devices.len()
            )));
        }
    }
    if let Some(p) = &a.save {
        check_writable("--save", p)?;
    }
    if let Some(p) = &a.metrics_out {
        check_writable("--metrics-out", p)?;
    }
    if a.checkpoint_every == Some(0) {
        return Err(Failure::usage(anyhow!("--checkpoint-every must be at least 1")));
    }
    if a.keep_checkpoints == 0 {
        return Err(Failure::usage(anyhow!("--keep-checkpoints must be at least 1")));
    }
    if a.checkpoint_every.is_some() && a.checkpoint_dir.is_none() && a.resume.is_none() {
        return Err(Failure::usage(anyhow!("--checkpoint-every needs --checkpoint-dir (or --resume)")));
    }
    if let Some(d) = a.resume.as_ref() {
        if !d.is_dir() {
            return Err(Failure::usage(anyhow!("--resume '{}': no such directory", d.display())));
        }
    }
    // Checkpoints go to --checkpoint-dir, or back into the directory being resumed.
    let checkpoint_dir = a.checkpoint_dir.clone().or_else(|| a.resume.clone());
    if let Some(d) = &checkpoint_dir {
        lockstep::checkpoint::prepare_dir(d).map_err(Failure::usage).map_err(|f| f.with_context("--checkpoint-dir"))?;
    }
    let data_spec = a.data.clone().unwrap_or_else(|| source.default_data().to_string());
    let splits = load_data(&data_spec, toy, a.seed, a.test_data.as_deref())?;
    let (splits, eval_name) = with_validation(splits, a.validation_split, a.val_data.as_deref(), a.seed)?;
    let classes = splits.train.num_classes().max(splits.test.as_ref().map_or(0, Dataset::num_classes));
    let model = build_model(&source, splits.train.sample_shape().dims(), classes, a.dropout, a.bn_momentum)?;
    lockstep::train::check_data(&model, &splits.train).map_err(Failure::usage)?;
    if let Some(t) = &splits.test {
        lockstep::train::check_data(&model, t).map_err(Failure::usage)?;
    }
    let initial = a
        .init
        .as_ref()
        .map(|p| weights::load(&model, p).map_err(Failure::usage).map_err(|f| f.with_context("--init")))
        .transpose()?;
    let last_batch = if a.drop_last { LastBatch::Drop } else { LastBatch::Keep };
    if lockstep::train::scatter::steps_per_epoch(splits.train.len(), batch_size, last_batch) == 0 {
        return Err(Failure::usage(anyhow!(
            "{} training samples make no full batch of {batch_size} with --drop-last",
            splits.train.len()
        )));
    }
    let config = TrainConfig {
        epochs,
        max_steps: a.steps,
        batch_size,
        optimizer,
        schedule: match a.lr_schedule.unwrap_or(if toy { ScheduleName::Constant } else { ScheduleName::Cosine }) {
            ScheduleName::Constant => LrSchedule::Constant,
            ScheduleName::Cosine => LrSchedule::Cosine { floor: 0.1 },
        },
        seed: a.seed,
        shuffle: if a.no_shuffle { Shuffle::None } else { Shuffle::Seeded },
        last_batch,
        replicas: a.replicas,
        check_replicas_every: a.check_replicas_every.or(TrainConfig::default().check_replicas_every),
        non_finite: if a.allow_nonfinite { NonFinite::Allow } else { NonFinite::Error },
        initial,
        ..TrainConfig::default()
    };
    config.validate().map_err(Failure::usage)?;
    let run_config =
        run_fingerprint(&a, &source.name(), &model, &data_spec, &config, a.replicas.unwrap_or(devices.len()));
    let steps_per_epoch = lockstep::train::scatter::steps_per_epoch(splits.train.len(), batch_size, last_batch) as u64;
    let policy = checkpoint_dir.map(|dir| CheckpointPolicy {
        dir,
        every: a.checkpoint_every.unwrap_or(steps_per_epoch),
        keep: a.keep_checkpoints,
        config: run_config.clone(),
    });
    let resume = match &a.resume {
        None => None,
        Some(dir) => {
            let fallback = if a.resume_fallback { Fallback::NewestGood } else { Fallback::Refuse };
            let fresh = Optimizer::new(config.optimizer, model.num_params());
            match lockstep::checkpoint::load_latest(&model, dir, &run_config, &fresh, fallback)
                .map_err(Failure::usage)?
            {
                None => return Err(Failure::usage(anyhow!("--resume '{}': no checkpoint in it", dir.display()))),
                Some((r, path, skipped)) => {
                    for s in skipped {
                        eprintln!("lockstep: skipping corrupt checkpoint {}", s.display());
                    }
                    outln!("lockstep: resuming {} at step {} (epoch {})", path.display(), r.step, r.epoch + 1);
                    Some(r)
                }
            }
        }
    };
    // Ctrl-C: finish the step, write a checkpoint if there is a directory, exit non-zero.
    // A second Ctrl-C ends the process at once.
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        let _ = ctrlc::set_handler(move || {
            if stop.swap(true, Ordering::SeqCst) {
                std::process::exit(130);
            }
            eprintln!("lockstep: interrupt: stopping after this step (Ctrl-C again to quit now)");
        });
    }
    let config = TrainConfig { resume, checkpoint: policy, stop: Some(stop), ..config };

    let replicas = a.replicas.unwrap_or(devices.len());
    // With --log-format json, stdout carries only JSON; the human lines go to stderr.
    let human = if a.log_format == LogFormat::Json { Stream::Stderr } else { Stream::Stdout };
    macro_rules! say {
        ($($arg:tt)*) => { human.line(&format!($($arg)*)) };
    }
    say!(
        "lockstep: {} ({} parameters) | devices: {} | replicas: {replicas} | data: {} {} samples{}",
        source.name(),
        model.num_params(),
        devices,
        splits.train.name(),
        splits.train.len(),
        splits.test.as_ref().map_or(String::new(), |t| format!(", {} {} samples", t.name(), t.len()))
    );
    say!(
        "lockstep: {} | global batch {batch_size} | epochs {epochs}{} | seed {}{}",
        optimizer_text(&optimizer),
        a.steps.map_or(String::new(), |k| format!(" (at most {k} steps)")),
        a.seed,
        a.init.as_ref().map_or(String::new(), |p| format!(" | initial weights {}", p.display()))
    );

    let step_lines = if a.log_every_step { StepLines::Lesson } else { StepLines::Off };
    let mut progress = Progress::new(human, step_lines);
    let mut json = (a.log_format == LogFormat::Json).then(|| JsonLines::new(std::io::stdout()));
    let mut csv = a.metrics_out.as_deref().map(CsvMetrics::create).transpose().map_err(Failure::usage)?;
    let mut observers = Fanout::new();
    observers.push(&mut progress);
    if let Some(j) = &mut json {
        observers.push(j);
    }
    if let Some(c) = &mut csv {
        observers.push(c);
    }
    let trained =
        train_data_parallel_with(&model, &splits.train, splits.test.as_ref(), &devices, &config, &mut observers);
    drop(observers);
    progress.finish();
    // The rows of a failed run are kept too; a closed stdout does not fail the run.
    let csv_done = csv.map(CsvMetrics::finish).transpose();
    let report = trained.map_err(Failure::runtime)?;
    csv_done.map_err(Failure::runtime)?;
    if let Some(p) = &a.metrics_out {
        say!("metrics written to {}", p.display());
    }
    say!("trained {} steps in {:.2}s ({:.0} samples/s)", report.steps, report.seconds, report.samples_per_sec);
    if let Some(last) = report.epochs.last() {
        say!("final train loss {:.4} accuracy {:.4}", last.train.mean_loss(), last.train.accuracy());
        if let Some(t) = &last.test {
            say!("final {eval_name} accuracy: {:.4} ({}/{})", t.accuracy(), t.correct, t.count);
        }
    }
    if let Some(p) = &a.save {
        weights::save(&model, &report.weights, p).map_err(Failure::runtime)?;
        say!("weights saved to {}", p.display());
    }
    Ok(())
}

/// The arguments that decide a run's arithmetic: a checkpoint is only resumed by a run
/// that agrees on every one (the device count is free: the logical replicas are here).
fn run_fingerprint(
    a: &TrainArgs,
    model_name: &str,
    model: &Sequential,
    data_spec: &str,
    c: &TrainConfig,
    replicas: usize,
) -> BTreeMap<String, String> {
    let tensors: Vec<String> = model.param_infos().iter().map(|t| format!("{}{}", t.name, t.shape)).collect();
    let entries = [
        ("model", model_name.to_string()),
        ("tensors", tensors.join(" ")),
        ("data", data_spec.to_string()),
        ("epochs", c.epochs.to_string()),
        ("steps", format!("{:?}", c.max_steps)),
        ("batch_size", c.batch_size.to_string()),
        ("optimizer", format!("{:?}", c.optimizer)),
        ("schedule", format!("{:?}", c.schedule)),
        ("seed", c.seed.to_string()),
        ("shuffle", format!("{:?}", c.shuffle)),
        ("last_batch", format!("{:?}", c.last_batch)),
        ("replicas", replicas.to_string()),
        ("dropout", a.dropout.to_string()),
        ("bn_momentum", a.bn_momentum.to_string()),
    ];
    entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

impl Failure {
    fn with_context(self, what: &'static str) -> Failure {
        Failure { code: self.code, error: self.error.context(what) }
    }
}

// ---------------------------------------------------------------------------------------
// eval

fn cmd_eval(a: EvalArgs) -> CliResult {
    let devices = resolve_devices(&a.devices)?;
    if !a.weights.is_file() {
        return Err(Failure::usage(anyhow!("--weights '{}': no such file", a.weights.display())));
    }
    let source = a.model.resolve()?;
    let data_spec = a.data.clone().unwrap_or_else(|| source.default_data().to_string());
    let splits = load_data(&data_spec, source.flat(), a.seed, None)?;
    // Built-in data: its test split; a file: all of it.
    let data = splits.test.unwrap_or(splits.train);
    let model = build_model(&source, data.sample_shape().dims(), data.num_classes(), 0.5, 0.99)?;
    lockstep::train::check_data(&model, &data).map_err(Failure::usage)?;
    let store: ParamStore =
        weights::load(&model, &a.weights).map_err(Failure::usage).map_err(|f| f.with_context("--weights"))?;
    // No more ranks than samples: a device with no sample has nothing to predict.
    let devices = if devices.len() > data.len() {
        Devices::cpu(data.len(), devices.threads_per_device()).map_err(Failure::usage)?
    } else {
        devices
    };
    let classes = model.output_shape().numel();
    let config = TrainConfig { initial: Some(store), check_replicas_every: None, ..TrainConfig::default() };
    let all: Vec<usize> = (0..data.len()).collect();
    let (metrics, probs) = with_trainer(&model, &devices, &config, |t| {
        let m = t.evaluate(&data, config.eval_batch)?;
        let p = t.predict(Batch::gather(&data, &all))?;
        Ok((m, p))
    })
    .map_err(Failure::runtime)?;
    outln!("{} on {} ({} samples) on {}", a.weights.display(), data.name(), data.len(), devices);
    outln!(
        "loss {:.4} | accuracy {:.4} ({}/{})",
        metrics.mean_loss(),
        metrics.accuracy(),
        metrics.correct,
        metrics.count
    );
    // confusion[true][predicted]
    let mut confusion = vec![vec![0u64; classes]; classes];
    for (row, &y) in probs.chunks_exact(classes).zip(data.labels()) {
        let pred = row.iter().enumerate().fold(0, |best, (i, &v)| if v > row[best] { i } else { best });
        confusion[y as usize][pred] += 1;
    }
    let w = data.len().to_string().len().max(3);
    outln!("confusion matrix (rows: true class, columns: predicted class)");
    let mut head = format!("{:>w$} |", "");
    for c in 0..classes {
        let _ = write!(head, " {c:>w$}");
    }
    outln!("{head}");
    outln!("{}", "-".repeat(head.len()));
    for (c, row) in confusion.iter().enumerate() {
        let mut line = format!("{c:>w$} |");
        for v in row {
            let _ = write!(line, " {v:>w$}");
        }
        outln!("{line}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// inspect, devices

fn cmd_inspect(file: &Path) -> CliResult {
    if !file.is_file() {
        return Err(Failure::usage(anyhow!("'{}': no such file", file.display())));
    }
    let rows = weights::inspect(file).map_err(Failure::usage)?;
    let name_w = rows.iter().map(|r| r.0.len()).max().unwrap_or(4).max(4);
    outln!("{:<name_w$}  {:<5}  shape", "name", "dtype");
    let mut total = 0usize;
    for (name, dtype, shape) in &rows {
        total += shape.iter().product::<usize>();
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        outln!("{name:<name_w$}  {dtype:<5}  ({})", dims.join(", "));
    }
    outln!("{} tensors, {total} values", rows.len());
    Ok(())
}

fn cmd_devices() -> CliResult {
    use lockstep::cuda::probe;
    outln!("cpu: {} cores available (cpu:N makes N devices sharing them)", available_cores());
    match probe::gpus() {
        Ok(gpus) if gpus.is_empty() => outln!("cuda: the driver reports no GPU"),
        Ok(gpus) => {
            for g in &gpus {
                outln!(
                    "cuda:{}: {} | {:.1} GiB | compute capability {}.{} ({})",
                    g.ordinal,
                    g.name,
                    g.total_memory_bytes as f64 / (1u64 << 30) as f64,
                    g.compute_capability.0,
                    g.compute_capability.1,
                    g.arch()
                );
            }
            outln!("nccl: {}", probe::nccl_status().fix());
        }
        Err(e) => outln!("cuda: none ({e})"),
    }
    match "auto".parse::<DeviceSpec>().and_then(|s| s.resolve()) {
        Ok(d) => outln!("--devices auto: {d}"),
        Err(e) => outln!("--devices auto: unavailable ({e})"),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// bench

/// Parses `4K,256K,4M` into byte counts (K/M/G are powers of 1024).
fn parse_sizes(text: &str) -> CliResult<Vec<usize>> {
    text.split(',')
        .map(|t| {
            let t = t.trim();
            let (num, mult) = match t.char_indices().last() {
                Some((i, 'K' | 'k')) => (&t[..i], 1usize << 10),
                Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
                Some((i, 'G' | 'g')) => (&t[..i], 1 << 30),
                _ => (t, 1),
            };
            let bytes = num
                .parse::<usize>()
                .ok()
                .and_then(|n| n.checked_mul(mult))
                .ok_or_else(|| Failure::usage(anyhow!("--sizes: '{t}' is not a size (e.g. 4K, 256K, 4M, 64M)")))?;
            if bytes == 0 || bytes % 4 != 0 {
                return Err(Failure::usage(anyhow!("--sizes: {t} is not a positive multiple of 4 bytes (f32 values)")));
            }
            Ok(bytes)
        })
        .collect()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Which collective a timing loop runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AllreducePath {
    /// Fill the shard buffers once, then reduce-scatter again and again: what a training
    /// step pays (every rank reading the reduced chunks in place belongs to its update).
    Trainer,
    /// Classic in-place all-reduce: copy in, reduce-scatter, all-gather.
    Classic,
}

/// Median time of one collective over `ranks` threads; rank 0 times between barriers.
fn time_allreduce(ranks: usize, count: usize, iters: usize, warmup: usize, path: AllreducePath) -> CliResult<Duration> {
    let ex = ShmExchange::new(ranks, ranks, count)?;
    let warm = std::sync::atomic::AtomicBool::new(false);
    let times = std::thread::scope(|s| -> lockstep::Result<Vec<Duration>> {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let (ex, warm) = (&ex, &warm);
                s.spawn(move || -> lockstep::Result<Vec<Duration>> {
                    let me = ex.rank(r);
                    let run = || -> lockstep::Result<Vec<Duration>> {
                        let mut buf = vec![(r + 1) as f32; count];
                        me.shard_buffer(0).fill((r + 1) as f32);
                        let mut times = Vec::with_capacity(iters);
                        // Warm up for at least `warmup` iterations and 50 ms, so that the
                        // scheduler has spread the ranks over the cores before timing. Rank
                        // 0 decides; the others read its decision after the same barrier.
                        let start = Instant::now();
                        let mut i = 0usize;
                        let mut timed = 0usize;
                        while timed < iters {
                            if r == 0 && i >= warmup && start.elapsed() >= Duration::from_millis(50) {
                                warm.store(true, std::sync::atomic::Ordering::Release);
                            }
                            me.barrier()?;
                            let measuring = warm.load(std::sync::atomic::Ordering::Acquire);
                            me.barrier()?;
                            i += 1;
                            let t0 = Instant::now();
                            match path {
                                AllreducePath::Trainer => me.reduce_scatter()?,
                                AllreducePath::Classic => {
                                    me.all_reduce_sum(&mut buf)?;
                                    me.barrier()?;
                                }
                            }
                            if measuring {
                                times.push(t0.elapsed());
                                timed += 1;
                            }
                        }
                        Ok(times)
                    };
                    let out = run();
                    if out.is_err() {
                        ex.abort();
                    }
                    out
                })
            })
            .collect();
        let mut rank0 = Vec::new();
        for (r, h) in handles.into_iter().enumerate() {
            let t = h.join().map_err(|_| lockstep::Error::Worker {
                device: format!("cpu:{r}"),
                step: 0,
                cause: "benchmark rank panicked".into(),
            })??;
            if r == 0 {
                rank0 = t;
            }
        }
        Ok(rank0)
    })
    .map_err(Failure::runtime)?;
    Ok(median(times))
}

fn cmd_bench_allreduce(a: BenchAllreduceArgs) -> CliResult {
    let spec: DeviceSpec = a.devices.parse().map_err(Failure::usage)?;
    let ranks = match spec {
        DeviceSpec::Cpu { count, .. } => count,
        _ => {
            return Err(Failure::usage(anyhow!(
                "--devices '{}': bench allreduce measures the CPU collective; use cpu:N",
                a.devices
            )))
        }
    };
    let sizes = parse_sizes(&a.sizes)?;
    if a.iters == 0 {
        return Err(Failure::usage(anyhow!("--iters must be at least 1")));
    }
    let bus = 2.0 * (ranks as f64 - 1.0) / ranks as f64;
    outln!(
        "# lockstep bench allreduce: {ranks} rank(s) (threads, cpu:0..{}), shared memory, f32 sum, median of {} iterations after {} warm-up",
        ranks - 1,
        a.iters,
        a.warmup
    );
    outln!("# trainer: buffers filled once, then reduce-scatter (the trainer's path; ranks read the result in place)");
    outln!("# classic: in-place all_reduce_sum (copy in + reduce-scatter + all-gather)");
    outln!("# algbw = size / time; busbw = algbw * 2(n-1)/n");
    outln!(
        "# {:>12} {:>12} | {:>10} {:>11} {:>11} | {:>10} {:>11} {:>11}",
        "",
        "",
        "trainer",
        "",
        "",
        "classic",
        "",
        ""
    );
    outln!(
        "# {:>12} {:>12} | {:>10} {:>11} {:>11} | {:>10} {:>11} {:>11}",
        "size(B)",
        "count(f32)",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)"
    );
    for bytes in sizes {
        let count = bytes / 4;
        let mut cells = String::new();
        for path in [AllreducePath::Trainer, AllreducePath::Classic] {
            let t = time_allreduce(ranks, count, a.iters, a.warmup, path)?;
            let secs = t.as_secs_f64().max(1e-9);
            let algbw = bytes as f64 / secs / 1e9;
            let _ = write!(cells, " | {:>10.1} {:>11.2} {:>11.2}", secs * 1e6, algbw, algbw * bus);
        }
        outln!("  {bytes:>12} {count:>12}{cells}");
    }
    Ok(())
}

fn cmd_bench_step(a: BenchStepArgs) -> CliResult {
    let toy = a.model == ModelName::Toy;
    let batch_size = a.batch_size.unwrap_or(if toy { 64 } else { 128 });
    if batch_size == 0 {
        return Err(Failure::usage(anyhow!("--batch-size must be at least 1")));
    }
    if a.steps == 0 {
        return Err(Failure::usage(anyhow!("--steps must be at least 1")));
    }
    let devices = resolve_devices(&a.devices)?;
    let data_name = if toy { "toy-enlarged" } else { "digits" };
    let splits = load_data(data_name, toy, 0, None)?;
    let data = splits.train;
    let model = build_model(&ModelSource::Builtin(a.model), data.sample_shape().dims(), data.num_classes(), 0.5, 0.99)?;
    let optimizer = if toy { OptimizerConfig::sgd(0.05) } else { OptimizerConfig::adam(1e-3) };
    let config = TrainConfig { batch_size, optimizer, check_replicas_every: None, ..TrainConfig::default() };
    let total = a.warmup + a.steps;
    let batches: Vec<Batch> = (0..total.min(8) as usize)
        .map(|s| {
            let idx: Vec<usize> = (0..batch_size).map(|i| (s * batch_size + i) % data.len()).collect();
            Batch::gather(&data, &idx)
        })
        .collect();
    outln!(
        "lockstep bench step: {} ({} parameters) | devices: {} | global batch {batch_size} | {} steps after {} warm-up",
        a.model.as_str(),
        model.num_params(),
        devices,
        a.steps,
        a.warmup
    );
    let (walls, computes, reduces) = with_trainer(&model, &devices, &config, |t| {
        let (mut walls, mut computes, mut reduces) = (Vec::new(), Vec::new(), Vec::new());
        for s in 0..total {
            let r = t.step(batches[s as usize % batches.len()].clone())?;
            if s >= a.warmup {
                walls.push(r.wall);
                computes.push(r.compute);
                reduces.push(r.reduce);
            }
        }
        Ok((walls, computes, reduces))
    })
    .map_err(Failure::runtime)?;
    let sum: Duration = walls.iter().sum();
    let step = median(walls);
    outln!(
        "{:.0} samples/s | median step {:.3} ms (compute {:.3} ms, reduce {:.3} ms, slowest worker) | mean step {:.3} ms",
        (batch_size as u64 * a.steps) as f64 / sum.as_secs_f64().max(1e-12),
        step.as_secs_f64() * 1e3,
        median(computes).as_secs_f64() * 1e3,
        median(reduces).as_secs_f64() * 1e3,
        sum.as_secs_f64() * 1e3 / a.steps as f64
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// bench layers

/// Times forward, loss and backward of one device's share of a step, layer by layer, on
/// a pool of `--threads` threads (the optimiser and the all-reduce are `bench step`'s).
fn cmd_bench_layers(a: BenchLayersArgs) -> CliResult {
    let toy = a.model == ModelName::Toy;
    let batch_size = a.batch_size.unwrap_or(if toy { 64 } else { 256 });
    let threads = a.threads.unwrap_or_else(available_cores);
    if batch_size == 0 || threads == 0 || a.steps == 0 {
        return Err(Failure::usage(anyhow!("--batch-size, --threads and --steps must be at least 1")));
    }
    let data = load_data(if toy { "toy-enlarged" } else { "digits" }, toy, 0, None)?.train;
    let source = ModelSource::Builtin(a.model);
    let mut model = build_model(&source, data.sample_shape().dims(), data.num_classes(), 0.5, 0.99)?;
    let idx: Vec<usize> = (0..batch_size).map(|i| i % data.len()).collect();
    let batch = Batch::gather(&data, &idx);
    let mut store = model.init(0);
    let mut grads = vec![0.0f32; model.num_params()];
    let pool =
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().map_err(|e| Failure::runtime(anyhow!(e)))?;
    let mut dims = vec![batch_size];
    dims.extend_from_slice(batch.sample_shape.dims());
    let mut total = Duration::ZERO;
    pool.install(|| -> lockstep::Result<()> {
        for pass in 0..=a.steps {
            if pass == 1 {
                model.start_profile();
            }
            let t0 = Instant::now();
            let x = lockstep::Tensor::from_vec(batch.x.clone(), dims.clone())?;
            let ctx = lockstep::nn::Ctx::train(0, pass as u64, 0, lockstep::Device::Cpu(0));
            let logits = model.forward(x, &store.params, &mut store.buffers, &ctx)?;
            let (_, dlogits) = lockstep::nn::loss::softmax_cross_entropy(&logits, &batch.y)?;
            grads.fill(0.0);
            model.backward(dlogits, &store.params, &mut grads, &ctx)?;
            if pass > 0 {
                total += t0.elapsed();
            }
        }
        Ok(())
    })
    .map_err(Failure::runtime)?;
    let per = |d: Duration| d.as_secs_f64() * 1e3 / a.steps as f64;
    outln!(
        "lockstep bench layers: {} | {batch_size} samples | {threads} thread(s) | mean of {} passes",
        a.model.as_str(),
        a.steps
    );
    outln!("{:<12} {:<52} {:>10} {:>10} {:>7}", "layer", "", "fwd (ms)", "bwd (ms)", "share");
    let profile = model.profile();
    for ((name, f, b), layer) in profile.iter().zip(model.layers()) {
        outln!(
            "{name:<12} {:<52} {:>10.3} {:>10.3} {:>6.1}%",
            layer.describe(),
            per(*f),
            per(*b),
            100.0 * (f.as_secs_f64() + b.as_secs_f64()) / total.as_secs_f64().max(1e-12)
        );
    }
    let layers: Duration = profile.iter().map(|(_, f, b)| *f + *b).sum();
    outln!("{:<65} {:>10.3} ms (loss and the rest: {:.3} ms)", "pass", per(total), per(total.saturating_sub(layers)));
    outln!("{:.0} samples/s on this pass alone", batch_size as f64 * a.steps as f64 / total.as_secs_f64().max(1e-12));
    Ok(())
}

// ---------------------------------------------------------------------------------------
// plot

fn cmd_plot(a: PlotArgs) -> CliResult {
    let x = match a.x {
        PlotX::Step => lockstep::plot::XAxis::Step,
        PlotX::Epoch => lockstep::plot::XAxis::Epoch,
    };
    lockstep::plot::plot_metrics_csv(&a.csv, &a.out, x).map_err(Failure::usage)?;
    outln!("curves written to {}", a.out.display());
    Ok(())
}

// ---------------------------------------------------------------------------------------
// validation sets

/// Applies `--validation-split` or `--val-data`: the validation set takes the place of
/// the test split in the per-epoch evaluation and the final line. Returns the splits and
/// the name of what is evaluated ("validation" or "test").
fn with_validation(
    splits: Splits,
    fraction: Option<f64>,
    val_data: Option<&str>,
    seed: u64,
) -> CliResult<(Splits, &'static str)> {
    if let Some(f) = fraction {
        if !(f > 0.0 && f < 1.0) {
            return Err(Failure::usage(anyhow!("--validation-split must be strictly between 0 and 1, got {f}")));
        }
        let (train, val) = splits.train.split_validation(f, seed).map_err(Failure::usage)?;
        return Ok((Splits { train, test: Some(val) }, "validation"));
    }
    let Some(spec) = val_data else { return Ok((splits, "test")) };
    let val = match spec.strip_prefix("mnist:") {
        Some(dir) => load_mnist_dir(Path::new(dir))
            .map_err(Failure::usage)?
            .test
            .ok_or_else(|| Failure::usage(anyhow!("--val-data '{spec}': no test split")))?,
        None => {
            let path = Path::new(spec);
            if !path.is_file() {
                return Err(Failure::usage(anyhow!(
                    "--val-data '{spec}': no such file (expected a FILE.safetensors or mnist:DIR)"
                )));
            }
            load_safetensors_dataset(path).map_err(Failure::usage)?
        }
    };
    Ok((Splits { train: splits.train, test: Some(val) }, "validation"))
}

// ---------------------------------------------------------------------------------------
// predict

/// Inputs per `Trainer::predict` call: bounds the activations held at once.
const PREDICT_CHUNK: usize = 1024;

/// The inputs of `predict` and whether they came with labels. An IDX images file has
/// none: its samples get label 0 of 1 class, which nothing reads.
fn load_inputs(spec: &str, flat: bool) -> CliResult<(Dataset, bool)> {
    let path = Path::new(spec);
    if spec.starts_with("mnist:") || !path.exists() {
        let splits = load_data(spec, flat, 0, None)?;
        return Ok((splits.test.unwrap_or(splits.train), true));
    }
    if !path.is_file() {
        return Err(Failure::usage(anyhow!("--data '{spec}': not a file")));
    }
    if path.extension().is_some_and(|e| e == "safetensors") {
        return Ok((load_safetensors_dataset(path).map_err(Failure::usage)?, true));
    }
    let (pixels, [n, h, w]) = load_idx_images(path).map_err(Failure::usage)?;
    let data = Dataset::new(spec, [1, h, w], Features::U8(pixels), vec![0; n], 1).map_err(Failure::usage)?;
    Ok((data, false))
}

fn cmd_predict(a: PredictArgs) -> CliResult {
    if a.limit == Some(0) {
        return Err(Failure::usage(anyhow!("--limit must be at least 1")));
    }
    let devices = resolve_devices(&a.devices)?;
    if !a.weights.is_file() {
        return Err(Failure::usage(anyhow!("--weights '{}': no such file", a.weights.display())));
    }
    let source = a.model.resolve()?;
    let (data, labelled) = load_inputs(&a.data, source.flat())?;
    let n = a.limit.map_or(data.len(), |l| l.min(data.len()));
    // Unlabelled images give no class count: a built-in model then outputs MNIST's 10
    // (a weights file of another count is refused by name when it is loaded).
    let classes = if labelled { data.num_classes() } else { lockstep::data::idx::MNIST_CLASSES };
    let model = build_model(&source, data.sample_shape().dims(), classes, 0.5, 0.99)?;
    lockstep::train::check_data(&model, &data).map_err(Failure::usage)?;
    let store: ParamStore =
        weights::load(&model, &a.weights).map_err(Failure::usage).map_err(|f| f.with_context("--weights"))?;
    // No more ranks than inputs: every rank gets at least one sample of every chunk.
    let devices = if devices.len() > n {
        Devices::cpu(n, devices.threads_per_device()).map_err(Failure::usage)?
    } else {
        devices
    };
    let k = model.output_shape().numel();
    let config = TrainConfig { initial: Some(store), check_replicas_every: None, ..TrainConfig::default() };
    // ceil(n / PREDICT_CHUNK) chunks of near-equal sizes, each ≥ n / chunks ≥ the ranks.
    let chunks = n.div_ceil(PREDICT_CHUNK);
    let probs = with_trainer(&model, &devices, &config, |t| {
        let mut out = Vec::with_capacity(n * k);
        for c in 0..chunks {
            let rows: Vec<usize> = (c * n / chunks..(c + 1) * n / chunks).collect();
            out.extend(t.predict(Batch::gather(&data, &rows))?);
        }
        Ok(out)
    })
    .map_err(Failure::runtime)?;
    for (i, row) in probs.chunks_exact(k).enumerate() {
        let top = row.iter().enumerate().fold(0, |best, (c, &p)| if p > row[best] { c } else { best });
        outln!("{i}  {top}  {:.4}", row[top]);
    }
    Ok(())
}
