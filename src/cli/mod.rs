//! The `lockstep` command line: parse → validate → call the library.
//!
//! Owns: the command tree (`train`, `eval`, `predict`, `inspect`, `devices`, `plot`,
//! `bench allreduce|step|layers`; each one's arguments and work are in `cmd/`), what the
//! subcommands share (`--model` and `--data` resolution, `--devices`, writability
//! checks), and the mapping of failures to exit codes: 2 for a usage or input error (a
//! bad flag, a missing or malformed file, a device that is not there, a run that does not
//! fit in memory, a checkpoint directory another run holds), 1 for a failure while
//! running (a worker error, a non-finite loss, a replica mismatch), 128 + N for a run
//! stopped by signal N (130 SIGINT, 143 SIGTERM; `cmd/signals.rs`). Every failure is one
//! line `error: ...` on stderr; every input is checked BEFORE any work starts.
//!
//! Under an MPI launcher (`mpirun`, `srun`) every process runs the same command: the
//! world is started first (`crate::world::init`; a binary built without the `mpi`
//! feature refuses to train or bench as one of several processes), process 0 is the one
//! voice of the run, the others print only failures of their own, and a command that
//! succeeded everywhere ends MPI with `MPI_Finalize`.
//!
//! It leaves everything numerical to the library: models (`crate::models`), data
//! (`crate::data`), the trainer (`crate::train`), weights files
//! (`crate::weights`). The binary, `main.rs` and `cmd/`, is the only user of `anyhow`.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use crate::checkpoint::{CheckpointPolicy, Fallback};
use crate::data::digits::{load_digits, DigitsLayout};
use crate::data::idx::{load_idx_images, load_mnist_dir};
use crate::data::safetensors_file::{load_safetensors_dataset, load_safetensors_dataset_with_classes};
use crate::data::{toy, Dataset, Features, Splits};
use crate::devices::{available_cores, DeviceSpec, Devices};
use crate::exchange::shm::ShmGroup;
use crate::exchange::{Abort, Exchange};
use crate::models::{self, ConvnetOptions, DensenetConfig, Norm, ResnetDepth};
use crate::nn::{Graph, ParamStore};
use crate::observe::{CsvMetrics, Drawing, Fanout, JsonLines, Progress, StepLines, Stream};
use crate::optim::{LrSchedule, MomentumKind, Optimizer, OptimizerConfig, Sharding};
use crate::spec::ModelSpec;
use crate::train::{train_data_parallel_with, with_trainer, Batch, LastBatch, NonFinite, Shuffle, TrainConfig};
use crate::weights;

/// `println!` that ignores a closed stdout (`lockstep ... | head`) instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

pub mod allocator;
mod bench;
#[cfg(feature = "mpi")]
mod bench_mpi;
mod eval;
mod features;
mod files;
pub mod hosted;
mod identify;
mod regularize;
mod signals;
mod text;
mod timing;
mod train;

use bench::{
    cmd_bench_allreduce, cmd_bench_layers, cmd_bench_step, BenchAllreduceArgs, BenchLayersArgs, BenchStepArgs,
};
use eval::{cmd_eval, cmd_predict, EvalArgs, PredictArgs};
use files::{cmd_devices, cmd_inspect, cmd_plot, PlotArgs};
use text::{cmd_generate, GenerateArgs};
use train::{cmd_train, TrainArgs};

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

impl Cli {
    /// Parses `argv` (the program's name first) as the binary does, through
    /// [`command_tree`], and returns the matches too (which flags were typed).
    fn parse_args(argv: impl IntoIterator<Item = std::ffi::OsString>) -> Result<(Cli, clap::ArgMatches), clap::Error> {
        let mut tree = command_tree();
        tree.build();
        let argv = hyphen_values_joined(&tree, argv);
        let m = tree.try_get_matches_from(argv)?;
        Cli::from_arg_matches(&m).map(|cli| (cli, m))
    }
}

/// The flags of subcommand `sub` typed on the command line (not defaulted), by clap id:
/// what `train --resume` compares with the run's stored ones.
fn typed(matches: &clap::ArgMatches, sub: &str) -> BTreeSet<String> {
    let Some(m) = matches.subcommand_matches(sub) else { return BTreeSet::new() };
    m.ids()
        .filter(|id| m.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine))
        .map(|id| id.to_string())
        .collect()
}

/// `argv` with every value that starts with '-' joined to its flag (`--clip-grad-norm
/// -1e-3` → `--clip-grad-norm=-1e-3`, `--prompt -abc` → `--prompt=-abc`), which clap would
/// otherwise read as a flag of its own (it takes `-1` as a number, not `-1e-3` or `-1s`):
/// the flag's own check then says what is wrong with the value. A word after a flag that
/// takes a value is that value unless it is a flag itself: it starts with `--` (a mistyped
/// `--save --epoch` stays an error, not a file named `--epoch`) or it is one of the
/// command's short flags (`-h`). Such a value is written with `=`: `--prompt=--help`.
/// `tree` is built ([`clap::Command::build`]), so that its help flags are among its
/// arguments; everything after `--` is left as it is.
fn hyphen_values_joined(
    tree: &clap::Command,
    argv: impl IntoIterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    let mut words = argv.into_iter().peekable();
    let mut out: Vec<std::ffi::OsString> = words.next().into_iter().collect();
    let mut cmd = tree;
    while let Some(word) = words.next() {
        let Some(text) = word.to_str() else {
            out.push(word);
            continue;
        };
        if text == "--" {
            out.push(word);
            out.extend(words);
            break;
        }
        let flag = match (text.strip_prefix("--"), short_name(text)) {
            (Some(long), _) => cmd.get_arguments().find(|a| a.get_long() == Some(long)),
            (None, Some(c)) => cmd.get_arguments().find(|a| a.get_short() == Some(c)),
            _ => None,
        };
        let Some(flag) = flag.filter(|a| a.get_action().takes_values()) else {
            if let Some(sub) = cmd.find_subcommand(text).filter(|_| !text.starts_with('-')) {
                cmd = sub;
            }
            out.push(word);
            continue;
        };
        let is_flag = |w: &str| {
            w.starts_with("--") || short_name(w).is_some_and(|c| cmd.get_arguments().any(|a| a.get_short() == Some(c)))
        };
        match words.peek().and_then(|w| w.to_str()) {
            Some(value) if value.starts_with('-') && value != "-" && !is_flag(value) => {
                let name = flag.get_long().map_or_else(|| text.to_string(), |l| format!("--{l}"));
                out.push(format!("{name}={value}").into());
                words.next();
            }
            // A value that is a subcommand's name (`--model toy`) is not one here.
            Some(value) if !value.starts_with('-') => {
                out.push(word);
                out.extend(words.next());
            }
            _ => out.push(word),
        }
    }
    out
}

/// The letter of a short flag as typed alone: `o` of `-o`; None for anything else.
fn short_name(word: &str) -> Option<char> {
    let mut letters = word.strip_prefix('-')?.chars();
    match (letters.next(), letters.next()) {
        (Some(c), None) if c != '-' => Some(c),
        _ => None,
    }
}

/// The command tree as the binary parses it. Every flag that takes a value also takes a
/// negative number (`--seed -1`, `--validation-split -0.1`), which clap would otherwise
/// read as a flag `-1` and refuse as "unexpected argument '-1' found": the flag's own
/// check then says what is wrong with the value, and a flag of unsigned integers says
/// that it takes none below 0.
fn command_tree() -> clap::Command {
    fn negatives_are_values(cmd: clap::Command) -> clap::Command {
        cmd.mut_args(|a| {
            if !a.get_action().takes_values() {
                return a;
            }
            let a = a.allow_negative_numbers(true);
            let t = a.get_value_parser().type_id();
            if t == std::any::TypeId::of::<u64>() {
                a.value_parser(unsigned::<u64>)
            } else if t == std::any::TypeId::of::<usize>() {
                a.value_parser(unsigned::<usize>)
            } else if t == std::any::TypeId::of::<u32>() {
                a.value_parser(unsigned::<u32>)
            } else {
                a
            }
        })
        .mut_subcommands(negatives_are_values)
    }
    negatives_are_values(Cli::command())
}

/// An unsigned integer flag's value; a negative number is refused as one.
fn unsigned<T: std::str::FromStr>(text: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    text.parse::<T>().map_err(|e| match text.trim().strip_prefix('-').map(str::parse::<f64>) {
        Some(Ok(_)) => "a negative number: this flag takes a whole number, 0 or more".to_string(),
        _ => e.to_string(),
    })
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a model data-parallel on every device given (default: the convnet on the embedded digits).
    Train(Box<TrainArgs>),
    /// Loss, accuracy and confusion matrix of saved weights on a dataset.
    Eval(EvalArgs),
    /// The top class and its probability for every input, one line each: `index  class  probability`.
    Predict(PredictArgs),
    /// Continue a prompt with a trained language model (the GPT, the Llama), byte by byte.
    Generate(Box<GenerateArgs>),
    /// List the tensors of a safetensors file (name, dtype, shape), or a model spec's graph.
    Inspect {
        /// The safetensors file (weights or a dataset), or a model spec (`.json`: its graph,
        /// node by node).
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
enum ModelName {
    /// The lesson's 2-30-20-2 MLP.
    Toy,
    /// The Keras guide's MNIST convnet, with BatchNorm.
    Convnet,
    /// The convnet without BatchNorm.
    ConvnetNobn,
    /// He et al.'s CIFAR ResNet-8 for 1×28×28 images (PyTorch's tensor names).
    Resnet8,
    /// He et al.'s CIFAR ResNet-20 for 1×28×28 images (PyTorch's tensor names).
    Resnet20,
    /// A DenseNet-BC for 1×28×28 images, growth 12, blocks of 4, 4, 4 (PyTorch's tensor names).
    Densenet,
    /// nanoGPT's GPT over bytes (--layers, --heads, --width, --context; its tensor names).
    Gpt,
    /// Meta's Llama over bytes: RMSNorm, RoPE, SwiGLU, no biases (--layers, --heads, --width, --context; Meta's tensor names).
    Llama,
}

impl ModelName {
    fn as_str(self) -> &'static str {
        match self {
            ModelName::Toy => "toy",
            ModelName::Convnet => "convnet",
            ModelName::ConvnetNobn => "convnet-nobn",
            ModelName::Resnet8 => "resnet8",
            ModelName::Resnet20 => "resnet20",
            ModelName::Densenet => "densenet",
            ModelName::Gpt => "gpt",
            ModelName::Llama => "llama",
        }
    }

    /// Whether it is a language model over text: the GPT, the Llama.
    fn is_language_model(self) -> bool {
        matches!(self, ModelName::Gpt | ModelName::Llama)
    }
}

/// `--model`: a built-in name, or a model spec file (anything ending in `.json`, or an
/// existing file; see `crate::spec`). As data (a checkpoint's record), which of the two
/// it is says itself: `{"builtin": "convnet"}`, `{"spec": "model.json"}`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum ModelChoice {
    Builtin(ModelName),
    Spec(PathBuf),
}

/// The built-in models that `keep` keeps, by name, in `ModelName`'s order: "toy,
/// convnet, …, gpt", for help and messages.
fn model_names(keep: impl Fn(ModelName) -> bool) -> String {
    let names: Vec<&str> =
        ModelName::value_variants().iter().copied().filter(|&n| keep(n)).map(ModelName::as_str).collect();
    names.join(", ")
}

fn parse_model_choice(text: &str) -> Result<ModelChoice, String> {
    if let Ok(name) = ModelName::from_str(text, false) {
        return Ok(ModelChoice::Builtin(name));
    }
    let path = Path::new(text);
    if text.ends_with(".json") || path.is_file() {
        return Ok(ModelChoice::Spec(path.to_path_buf()));
    }
    Err(format!("expected {} or a model spec FILE.json", model_names(|_| true)))
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
                check_input_file("--model", path)?;
                let spec = ModelSpec::from_file(path).map_err(Failure::usage)?;
                Ok(ModelSource::Spec(path.clone(), spec))
            }
        }
    }
}

impl ModelSource {
    /// Whether the model takes flat samples (F,): the toy MLP, or a spec whose input
    /// shape has one dimension. Flat models get the toy data by default (and on it the
    /// lesson's recipe: `train`'s `take_defaults`), image models the digits.
    fn flat(&self) -> bool {
        match self {
            ModelSource::Builtin(name) => *name == ModelName::Toy,
            ModelSource::Spec(_, spec) => spec.input_shape.len() == 1,
        }
    }

    /// Whether the model is a built-in language model (the GPT, the Llama), or a spec
    /// that starts with an embedding: a language model, whose data is text.
    fn is_language_model(&self) -> bool {
        match self {
            ModelSource::Builtin(name) => name.is_language_model(),
            ModelSource::Spec(_, spec) => spec.layers.first().is_some_and(|l| l.type_name() == "embedding"),
        }
    }

    fn name(&self) -> String {
        match self {
            ModelSource::Builtin(name) => name.as_str().to_string(),
            ModelSource::Spec(path, _) => path.display().to_string(),
        }
    }

    fn default_data(&self) -> &'static str {
        if self.is_language_model() {
            "fortunes"
        } else if self.flat() {
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

impl ScheduleName {
    /// The schedule of this name.
    fn schedule(self) -> LrSchedule {
        match self {
            ScheduleName::Constant => LrSchedule::Constant,
            ScheduleName::Cosine => LrSchedule::Cosine { floor: 0.1 },
        }
    }

    /// The name of the library's `schedule` (a cosine to another floor than the command
    /// line's is still a cosine: the run's fingerprint compares the floor).
    fn of(schedule: LrSchedule) -> ScheduleName {
        match schedule {
            LrSchedule::Constant => ScheduleName::Constant,
            LrSchedule::Cosine { .. } => ScheduleName::Cosine,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OptimizerName {
    /// torch.optim.SGD (--momentum, --nesterov; --weight-decay is the coupled L2).
    Sgd,
    /// torch.optim.Adam (--weight-decay is the coupled L2).
    Adam,
    /// torch.optim.AdamW (--weight-decay is decoupled: p *= 1 - lr·wd before the step).
    Adamw,
}

impl OptimizerName {
    /// The name of the library's `optimizer`.
    fn of(optimizer: &OptimizerConfig) -> OptimizerName {
        match optimizer {
            OptimizerConfig::Sgd { .. } => OptimizerName::Sgd,
            OptimizerConfig::Adam { .. } => OptimizerName::Adam,
            OptimizerConfig::AdamW { .. } => OptimizerName::Adamw,
        }
    }
}

/// `--weight-decay-on`: which parameters weight decay applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DecayOnName {
    /// Tensors of 2 or more dimensions (linear and convolution weights); not BatchNorm's
    /// parameters nor the biases.
    Weights,
    /// Every parameter.
    All,
}

impl DecayOnName {
    fn decay_on(self) -> crate::optim::DecayOn {
        match self {
            DecayOnName::Weights => crate::optim::DecayOn::Weights,
            DecayOnName::All => crate::optim::DecayOn::All,
        }
    }

    /// The name of the library's `on`.
    fn of(on: crate::optim::DecayOn) -> DecayOnName {
        match on {
            crate::optim::DecayOn::Weights => DecayOnName::Weights,
            crate::optim::DecayOn::All => DecayOnName::All,
        }
    }
}

/// `--grad-compression`: how gradients travel between the replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CompressionName {
    /// f32, as computed.
    None,
    /// bfloat16 (rounded to nearest even), summed in f32.
    Bf16,
    /// IEEE half precision scaled per block of 1,024 values by a power of two, summed in f32.
    Fp16,
}

impl CompressionName {
    fn compression(self) -> crate::exchange::codec::Compression {
        use crate::exchange::codec::Compression;
        match self {
            CompressionName::None => Compression::None,
            CompressionName::Bf16 => Compression::Bf16,
            CompressionName::Fp16 => Compression::Fp16,
        }
    }

    /// The name of the library's `compression`.
    fn of(compression: crate::exchange::codec::Compression) -> CompressionName {
        use crate::exchange::codec::Compression;
        match compression {
            Compression::None => CompressionName::None,
            Compression::Bf16 => CompressionName::Bf16,
            Compression::Fp16 => CompressionName::Fp16,
        }
    }
}

/// `--save-dtype`: the dtype of a saved weights file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
enum SaveDtypeName {
    F32,
    /// bfloat16, rounded to nearest even (PyTorch's `.to(torch.bfloat16)`).
    Bf16,
    /// IEEE half precision, rounded to nearest even (PyTorch's `.half()`).
    F16,
}

impl SaveDtypeName {
    fn dtype(self) -> weights::SaveDtype {
        match self {
            SaveDtypeName::F32 => weights::SaveDtype::F32,
            SaveDtypeName::Bf16 => weights::SaveDtype::Bf16,
            SaveDtypeName::F16 => weights::SaveDtype::F16,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Failures and exit codes

/// A failure and the exit code it maps to.
#[derive(Debug)]
struct Failure {
    code: u8,
    error: anyhow::Error,
    /// Said already (a run stopped by a signal says how it ended): no `error:` line.
    quiet: bool,
}

impl Failure {
    /// A usage or input error: exit 2.
    fn usage(e: impl Into<anyhow::Error>) -> Failure {
        Failure { code: EXIT_USAGE, error: e.into(), quiet: false }
    }

    /// A failure while running: exit 1.
    fn runtime(e: impl Into<anyhow::Error>) -> Failure {
        Failure { code: EXIT_RUNTIME, error: e.into(), quiet: false }
    }

    /// An exit with `code` whose reason has been printed.
    fn silent(code: u8) -> Failure {
        Failure { code, error: anyhow!("exit {code}"), quiet: true }
    }
}

/// Library errors met after validation: input-shaped ones still exit 2.
impl From<crate::Error> for Failure {
    fn from(e: crate::Error) -> Failure {
        use crate::Error as E;
        let code = match &e {
            E::Config { .. }
            | E::DeviceSpec { .. }
            | E::Format { .. }
            | E::WeightsMismatch { .. }
            | E::Data { .. }
            | E::Locked { .. }
            | E::OutOfMemory { .. }
            | E::CudaUnavailable(_)
            | E::Mpi(_)
            | E::Processes { .. } => EXIT_USAGE,
            _ => EXIT_RUNTIME,
        };
        Failure { code, error: e.into(), quiet: false }
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

/// clap's message of a bad command line as one line: its paragraphs — the error, then its
/// tips (`tip: a similar argument exists: '--epochs'`) — each on one line, joined by "; ",
/// without the usage and the pointer to `--help` that follow them.
fn clap_error_line(rendered: &str) -> String {
    let body = rendered.lines().map(str::trim);
    let body = body.take_while(|l| !(l.starts_with("Usage:") || l.starts_with("For more information")));
    let mut paragraphs = vec![String::new()];
    for line in body {
        let last = paragraphs.last_mut().expect("one at least");
        match (line.is_empty(), last.is_empty()) {
            (true, true) => {}
            (true, false) => paragraphs.push(String::new()),
            (false, empty) => {
                if !empty {
                    last.push(' ');
                }
                last.push_str(line);
            }
        }
    }
    paragraphs.retain(|p| !p.is_empty());
    let line = paragraphs.join("; ");
    line.strip_prefix("error: ").unwrap_or(&line).to_string()
}

/// The `lockstep` program: parses the command line, runs the command, and maps what
/// happened to an exit code. The binary (src/main.rs) is this and its allocator.
pub fn main() -> ExitCode {
    let parsed = Cli::parse_args(std::env::args_os());
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
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
            eprintln!("error: {}", clap_error_line(&e.render().to_string()));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    // The world first: MPI's initialisation, or the refusal of a launched process in a
    // binary without MPI. Looking at files and at the machine needs no world.
    let world = match (crate::world::init(), &cli.command) {
        (Ok(w), _) => Some(w),
        (Err(_), Command::Devices | Command::Inspect { .. } | Command::Plot(_)) => None,
        (Err(e), _) => {
            if crate::world::init_reports(&e) {
                // One write: mpirun does not interleave it with another process's line.
                use std::io::Write as _;
                let _ = std::io::stderr().write_all(format!("error: {}\n", one_line(&e.into())).as_bytes());
            } else {
                // The process that says it must be heard: a launcher ends every process
                // of a launch as soon as one of them fails, and one that left first could
                // cut process 0 off before its line reached the launcher (seen once in
                // eight launches). The silent ones leave a moment later.
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let across = world.is_some_and(|w| w.size() > 1);
    let result = match cli.command {
        Command::Train(a) => cmd_train(*a, &typed(&matches, "train")),
        Command::Eval(_) | Command::Predict(_) if across => {
            Err(Failure::usage(anyhow!("eval and predict run in one process: start them without mpirun or srun")))
        }
        Command::Eval(a) => cmd_eval(a),
        Command::Predict(a) => cmd_predict(a),
        Command::Generate(a) => cmd_generate(*a),
        Command::Inspect { file } => cmd_inspect(&file),
        Command::Devices => cmd_devices(),
        Command::Bench(BenchCommand::Allreduce(a)) => cmd_bench_allreduce(a),
        Command::Bench(BenchCommand::Step(a)) => cmd_bench_step(a),
        Command::Bench(BenchCommand::Layers(a)) => cmd_bench_layers(a),
        Command::Plot(a) => cmd_plot(a),
    };
    match result {
        Ok(()) => {
            if let Some(w) = world {
                w.finalize();
            }
            ExitCode::SUCCESS
        }
        Err(f) => {
            // The other processes must not wait for this one (a failure in training has
            // told them already; one of the binary's own checks, run before any
            // collective and on process 0 alone for its files, tells them here). An
            // error every process reaches by the same decision (the handshake's
            // disagreeing arguments) is told to nobody: each reports its own, and a
            // notice could overtake the decision on another process.
            let told = f.error.downcast_ref::<crate::Error>();
            if let Some(w) = world.filter(|_| !f.quiet && !told.is_some_and(crate::world::agreed)) {
                w.fail_with(&one_line(&f.error));
            }
            // One voice: a process other than 0 prints only failures of its own.
            let quiet = f.quiet || matches!(world.zip(told), Some((w, e)) if !w.reports(e));
            if !quiet {
                // Not eprintln!: under mpirun, stderr may be a pipe whose reader (mpirun,
                // ended by Ctrl-C) is gone, and the exit code must still be ours; and one
                // write, which mpirun does not interleave with another process's.
                use std::io::Write as _;
                let line = format!("error: {}\n", one_line(&f.error));
                let _ = std::io::stderr().write_all(line.as_bytes());
            }
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
) -> CliResult<Graph> {
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
        ModelName::Resnet8 | ModelName::Resnet20 => match sample {
            [1, 28, 28] => {
                let depth = if name == ModelName::Resnet8 { ResnetDepth::Resnet8 } else { ResnetDepth::Resnet20 };
                Ok(models::resnet(depth, classes)?)
            }
            _ => Err(Failure::usage(anyhow!(
                "the {} model takes 1x28x28 images (as Fashion-MNIST's), the data has samples of shape {sample:?}",
                name.as_str()
            ))),
        },
        ModelName::Densenet => match sample {
            [1, 28, 28] => Ok(models::densenet(&DensenetConfig { classes, ..DensenetConfig::default() })?),
            _ => Err(Failure::usage(anyhow!(
                "the densenet model takes 1x28x28 images (as Fashion-MNIST's), the data has samples of shape {sample:?}"
            ))),
        },
        // The flags' shape but for the context, which the data's windows give.
        ModelName::Gpt => match sample {
            [context] => Ok(models::gpt(models::GptConfig {
                context: *context,
                vocab: classes,
                dropout,
                ..models::GptConfig::default()
            })?),
            _ => Err(Failure::usage(anyhow!(
                "the gpt model takes sequences of token ids (T,), the data has samples of shape {sample:?}"
            ))),
        },
        // The flags' shape but for the window, which the data's give; no dropout.
        ModelName::Llama => match sample {
            [context] => {
                let d = models::LlamaConfig::default();
                Ok(models::llama(models::LlamaConfig::new(*context, classes, d.layers, d.heads, d.width))?)
            }
            _ => Err(Failure::usage(anyhow!(
                "the llama model takes sequences of token ids (T,), the data has samples of shape {sample:?}"
            ))),
        },
    }
}

/// What `--data` accepts, for messages.
const DATA_CHOICES: &str =
    "toy, toy-enlarged, digits, fashion-mnist, mnist:DIR, fortunes, text:FILE or a FILE.safetensors";

/// Loads `--data`: a built-in name, or a safetensors file (plus an optional test file).
/// Built-in data takes the layout of a flat model (`flat`) or of an image model.
/// `classes` (`--classes`) is the model's class count when stated: files are then read
/// with it (an MNIST directory's labels may go past 9, a safetensors file's past its
/// largest label), and every label must lie below it.
fn load_data(spec: &str, flat: bool, seed: u64, test_file: Option<&Path>, classes: Option<usize>) -> CliResult<Splits> {
    let builtin = match spec {
        "toy" => Some(toy::toy()),
        "toy-enlarged" => Some(toy::toy_enlarged(TOY_ENLARGE_FACTOR, seed).map_err(Failure::usage)?),
        "digits" => {
            Some(load_digits(if flat { DigitsLayout::Flat8 } else { DigitsLayout::Image28 }).map_err(Failure::usage)?)
        }
        "fashion-mnist" => Some(
            crate::data::fashion_mnist::load_fashion_mnist()
                .map_err(Failure::usage)
                .map_err(|f| f.with_context("--data fashion-mnist"))?,
        ),
        _ => match spec.strip_prefix("mnist:") {
            Some(dir) => Some(load_mnist(Path::new(dir), classes)?),
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
    check_input_file("--data", path).map_err(|f| match path.exists() {
        true => f,
        false => Failure::usage(anyhow!("--data '{spec}': no such file (expected {DATA_CHOICES})")),
    })?;
    let train = load_dataset_file(path, classes)?;
    let test = test_file
        .map(|p| {
            check_input_file("--test-data", p)?;
            load_dataset_file(p, classes)
        })
        .transpose()?;
    Ok(Splits { train, test })
}

/// A safetensors dataset, read with the stated class count if there is one.
fn load_dataset_file(path: &Path, classes: Option<usize>) -> CliResult<Dataset> {
    match classes {
        Some(k) => load_safetensors_dataset_with_classes(path, k),
        None => load_safetensors_dataset(path),
    }
    .map_err(Failure::usage)
}

/// An MNIST-format directory, read with the stated class count if there is one.
fn load_mnist(dir: &Path, classes: Option<usize>) -> CliResult<Splits> {
    match classes {
        Some(k) => crate::data::idx::load_mnist_dir_with_classes(dir, k),
        None => load_mnist_dir(dir),
    }
    .map_err(Failure::usage)
}

/// Fails unless `path` is a regular file (or a link to one), saying what it is instead:
/// missing, a directory, a FIFO, a socket or a device. A FIFO would block a reader
/// forever and a directory cannot be read; "no such file" would hide both.
fn check_input_file(flag: &str, path: &Path) -> CliResult {
    use std::os::unix::fs::FileTypeExt as _;
    let what = match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "no such file".to_string(),
        Err(e) => format!("cannot be read: {e}"),
        Ok(m) if m.is_file() => return Ok(()),
        Ok(m) if m.is_dir() => "is a directory, not a file".to_string(),
        Ok(m) => {
            let t = m.file_type();
            let kind = if t.is_fifo() {
                "a FIFO"
            } else if t.is_socket() {
                "a socket"
            } else if t.is_block_device() || t.is_char_device() {
                "a device"
            } else {
                "not a file"
            };
            format!("is not a regular file ({kind})")
        }
    };
    Err(Failure::usage(anyhow!("{flag} '{}': {what}", path.display())))
}

/// `--classes`, when given, is at least 2.
fn check_classes(classes: Option<usize>) -> CliResult {
    if classes.is_some_and(|k| k < 2) {
        return Err(Failure::usage(anyhow!("--classes must be at least 2 (a classifier of one class is not one)")));
    }
    Ok(())
}

/// Fails when the model's classes (the last dimension of its output: a vocabulary for a
/// sequence model) disagree with what the user stated with `--classes`, or with the
/// names `data` gives its classes (a file's `class_names`): a 10-class model would
/// otherwise print a 3-name file's classes as if they were its own, or a run's first line
/// say "7 classes" of a model of 4 outputs.
fn check_model_classes(model: &Graph, stated: Option<usize>, data: &[&Dataset]) -> CliResult {
    let out = model.output_shape();
    let classes = out.dims().last().copied().unwrap_or(1);
    if let Some(k) = stated.filter(|&k| k != classes) {
        return Err(Failure::usage(anyhow!(
            "--classes {k} disagrees with the model, whose output {out} has {classes} classes"
        )));
    }
    for d in data {
        if let Some(names) = d.class_names().filter(|n| n.len() != classes) {
            let shown: Vec<&str> = names.iter().take(4).map(String::as_str).collect();
            let more = if names.len() > 4 { ", …" } else { "" };
            return Err(Failure::usage(anyhow!(
                "dataset {}: names {} classes ({}{more}: its class_names), but the model has {classes} outputs",
                d.name(),
                names.len(),
                shown.join(", ")
            )));
        }
    }
    Ok(())
}

/// The class count of a model that loads `weights`: `--classes` when given; for a
/// built-in model, the first dimension of its last parameter in the file (the final
/// Dense layer's bias), so that the weights, not the data at hand, size it; else
/// `fallback`. A spec fixes its own outputs.
fn model_classes(
    source: &ModelSource,
    sample: &[usize],
    stated: Option<usize>,
    weights: &Path,
    fallback: usize,
) -> CliResult<usize> {
    if let Some(k) = stated {
        return Ok(k);
    }
    if let ModelSource::Spec(..) = source {
        return Ok(fallback);
    }
    let defaults = ConvnetOptions::default();
    let probe = build_model(source, sample, fallback, defaults.dropout, defaults.bn_momentum)?;
    let Some(last) = probe.param_infos().last() else { return Ok(fallback) };
    let rows = weights::inspect(weights).map_err(Failure::usage).map_err(|f| f.with_context("--weights"))?;
    Ok(rows.into_iter().find(|(name, _, shape)| *name == last.name && shape.len() == 1).map_or(fallback, |r| r.2[0]))
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
        OptimizerConfig::Sgd { lr, momentum, momentum_kind, weight_decay } => {
            let nesterov = if momentum_kind == MomentumKind::Nesterov { " (nesterov)" } else { "" };
            format!("sgd lr {lr} momentum {momentum}{nesterov} weight decay {weight_decay}")
        }
        OptimizerConfig::Adam { lr, beta1, beta2, eps, weight_decay } => {
            format!("adam lr {lr} betas ({beta1}, {beta2}) eps {eps} weight decay {weight_decay}")
        }
        OptimizerConfig::AdamW { lr, beta1, beta2, eps, weight_decay } => {
            format!("adamw lr {lr} betas ({beta1}, {beta2}) eps {eps} decoupled weight decay {weight_decay}")
        }
    }
}

impl Failure {
    fn with_context(self, what: &'static str) -> Failure {
        Failure { code: self.code, error: self.error.context(what), quiet: self.quiet }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every flag of every command that takes a value takes a negative number as one,
    /// so that its own check (or the unsigned parser) says what is wrong with it.
    #[test]
    fn every_flag_that_takes_a_value_takes_a_negative_number() {
        fn walk(cmd: &clap::Command, at: &str, refused: &mut Vec<String>) {
            for a in cmd.get_arguments().filter(|a| a.get_action().takes_values()) {
                if !a.is_allow_negative_numbers_set() {
                    refused.push(format!("{at} --{}", a.get_long().unwrap_or(a.get_id().as_str())));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{at} {}", sub.get_name()), refused);
            }
        }
        let mut refused = Vec::new();
        walk(&command_tree(), "lockstep", &mut refused);
        assert!(refused.is_empty(), "these would read -1 as a flag: {refused:?}");
    }

    #[test]
    fn a_negative_count_is_refused_as_negative_and_a_negative_fraction_by_its_own_check() {
        let argv = |args: &[&str]| ["lockstep"].iter().chain(args).map(Into::into).collect::<Vec<std::ffi::OsString>>();
        for args in [&["train", "--seed", "-1"][..], &["train", "--epochs", "-3"], &["bench", "step", "--steps", "-2"]]
        {
            let e = Cli::parse_args(argv(args)).unwrap_err().to_string();
            assert!(e.contains(&format!("invalid value '{}'", args[args.len() - 1])), "{args:?}: {e}");
            assert!(e.contains("a negative number: this flag takes a whole number, 0 or more"), "{args:?}: {e}");
        }
        // A negative fraction parses; `train`'s own check refuses it, naming the range
        // (tests/cli_hostile.rs).
        assert!(Cli::parse_args(argv(&["train", "--validation-split", "-0.1"])).is_ok());
    }

    /// Issue 41: `help eval` and `help predict` listed three models of six. Every list of
    /// models is `ModelName`'s: eval's and train's name all of them, predict's every
    /// classifier (and points a language model to generate); generate takes none of
    /// train's shape flags, which it reads from the weights.
    #[test]
    fn every_command_lists_every_model_it_takes() {
        let tree = command_tree();
        let help = |cmd: &str, arg: &str| {
            let sub = tree.find_subcommand(cmd).unwrap();
            let a = sub.get_arguments().find(|a| a.get_id() == arg).unwrap_or_else(|| panic!("{cmd} --{arg}"));
            a.get_help().map(|h| h.to_string()).unwrap_or_default()
        };
        for name in ModelName::value_variants() {
            for cmd in ["train", "eval"] {
                assert!(help(cmd, "model").contains(name.as_str()), "{cmd} --model: {name:?}: {}", help(cmd, "model"));
            }
            let predict = help("predict", "model");
            assert_eq!(predict.contains(&format!("{}, ", name.as_str())), !name.is_language_model(), "{predict}");
        }
        assert!(help("predict", "model").contains("`generate`"));
        // generate reads a built-in model's sizes from its weights: it takes only what no
        // shape tells, the heads and (a Llama's) window, for files that do not record them.
        let generate: Vec<String> =
            tree.find_subcommand("generate").unwrap().get_arguments().map(|a| a.get_id().to_string()).collect();
        for train_only in ["layers", "width"] {
            assert!(!generate.contains(&train_only.to_string()), "generate --{train_only}");
        }
        assert!(help("generate", "context").contains("do not record it"), "{}", help("generate", "context"));
    }

    fn argv(args: &[&str]) -> Vec<std::ffi::OsString> {
        ["lockstep"].iter().chain(args).map(Into::into).collect()
    }

    /// A value that starts with '-' but is no number clap knows (`-1e-3`, `-1s`, `-abc`)
    /// is its flag's, short flags' too; a word that is a flag (`--epochs`, `-h`) is not a
    /// value, and `=` gives it as one.
    #[test]
    fn a_value_that_starts_with_a_hyphen_is_its_flags() {
        let train = |args: &[&str]| match Cli::parse_args(argv(&[&["train"], args].concat())) {
            Ok((Cli { command: Command::Train(a) }, _)) => Ok(*a),
            Ok(_) => unreachable!("a train command"),
            Err(e) => Err(e),
        };
        let a = train(&["--clip-grad-norm", "-1e-3", "--lr", "-1E+2", "--model", "toy"]).unwrap();
        assert_eq!((a.optim.clip_grad_norm, a.optim.lr), (Some(-1e-3), Some(-1e2)));
        assert_eq!(a.model_data.model, ModelChoice::Builtin(ModelName::Toy));
        let e = train(&["--time-limit", "-1s"]).unwrap_err().to_string();
        assert!(
            e.contains("invalid value '-1s' for '--time-limit <DURATION>': '-1s' is not a duration (negative"),
            "{e}"
        );
        // A missing value stays one: the next flag is not taken for a file name.
        let e = train(&["--save", "--epochs", "3"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue, "{e}");
        assert!(e.to_string().contains("a value is required for '--save <FILE>'"), "{e}");
        assert_eq!(train(&["--save", "-h"]).unwrap_err().kind(), clap::error::ErrorKind::InvalidValue);
        assert_eq!(train(&["--save=--epochs"]).unwrap().outputs.save, Some(PathBuf::from("--epochs")));
        // After `--`, nothing is joined (train takes no word there).
        assert!(train(&["--", "--save", "-x"]).is_err());
        // The value as the subcommand's matches hold it (by clap id).
        let value = |args: &[&str], id: &str| -> PathBuf {
            let (_, m) = Cli::parse_args(argv(args)).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            let (_, sub) = m.subcommand().expect("a subcommand");
            match sub.try_get_one::<String>(id) {
                Ok(Some(s)) => PathBuf::from(s),
                _ => sub.get_one::<PathBuf>(id).expect("the flag is given").clone(),
            }
        };
        let generate = |prompt: &[&str]| value(&[&["generate", "--weights", "w"], prompt].concat(), "prompt");
        assert_eq!(generate(&["--prompt", "-abc"]), Path::new("-abc"));
        assert_eq!(generate(&["--prompt", "-"]), Path::new("-"));
        assert_eq!(generate(&["--prompt=--help"]), Path::new("--help"));
        assert_eq!(value(&["plot", "m.csv", "-o", "-x.png"], "out"), Path::new("-x.png"));
    }

    /// A mistyped flag keeps clap's tip, on the one line of the error.
    #[test]
    fn a_mistyped_flag_keeps_claps_tip() {
        for (typed, meant) in [("--epoch", "--epochs"), ("--devcies", "--devices"), ("--batchsize", "--batch-size")] {
            let e = Cli::parse_args(argv(&["train", typed, "3"])).unwrap_err();
            assert_eq!(
                clap_error_line(&e.render().to_string()),
                format!("unexpected argument '{typed}' found; tip: a similar argument exists: '{meant}'")
            );
        }
        let e = Cli::parse_args(argv(&["train", "--optimizer", "adamx"])).unwrap_err();
        assert_eq!(
            clap_error_line(&e.render().to_string()),
            "invalid value 'adamx' for '--optimizer <OPTIMIZER>' [possible values: sgd, adam, adamw]; tip: a similar value exists: 'adam'"
        );
    }

    /// `train -h` groups its flags under headings (clap's help_heading): none is left
    /// under the bare "Options" but help itself.
    #[test]
    fn every_train_flag_has_a_heading() {
        let mut tree = command_tree();
        tree.build();
        let train = tree.find_subcommand("train").expect("a train command");
        let bare: Vec<&str> = train
            .get_arguments()
            .filter(|a| a.get_help_heading().is_none() && a.get_id() != "help")
            .map(|a| a.get_id().as_str())
            .collect();
        assert!(bare.is_empty(), "flags without a heading in train -h: {bare:?}");
    }
}
