//! `lockstep train`, `eval`, `predict` and `generate` run by another program in its own
//! process: what the Python package (python/) calls. A run is the command line's own
//! (`train::run`; `eval::evaluated`, `eval::predicted`, `text::generated`): the same flags,
//! parsed by the same parser with the same defaults and checks, the same data checks, the
//! same model, the same steps and the same bytes. Only its edges differ:
//!
//! - the data comes in memory ([`Data`]), in place of `--data`: samples and labels as
//!   arrays ([`Array`]), checked as a dataset file's tensors `x` and `y` are
//!   (`data::safetensors_file::dataset_from_arrays`), or a text's bytes or token ids,
//!   split as `--data text:FILE` splits a file's bytes;
//! - its lines go to the host's `say`, its events to the host's [`Observer`] (the command
//!   line's progress is not drawn);
//! - the host raises its stop flag (no signal is caught: the host's are its own);
//! - its end is returned ([`Trained`]: the report, the weights as the `--save` file's
//!   bytes), and a failure is a [`Refusal`] that says which kind it is, instead of an exit
//!   status.
//!
//! Owns nothing else: the flags are the subcommands', the work theirs.

use std::collections::BTreeSet;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::train::{Hosting, InMemory};
use super::{one_line, Cli, Command, Failure, EXIT_USAGE};
use crate::data::Dataset;
use crate::train::{HeldOut, Observer, TrainReport};

pub use crate::data::safetensors_file::Array;

/// Samples `x`: (N, C, H, W) or (N, F), float32 (finite) or uint8; and their labels `y`:
/// (N), integer class ids.
pub struct Samples<'a> {
    pub x: Array<'a>,
    pub y: Array<'a>,
}

/// What a hosted run trains on. (One value a run: its variants' sizes do not matter.)
#[allow(clippy::large_enum_variant)]
pub enum Data<'a> {
    /// A classifier's samples, and the held-out ones evaluated after every epoch.
    Samples { train: Samples<'a>, held_out: Option<Samples<'a>> },
    /// A language model's text (UTF-8 or any bytes: the built-in models read bytes), as
    /// `--data text:FILE` reads a file of it.
    Text(&'a [u8]),
    /// A language model's text as token ids: a one-dimensional array of integers (int64,
    /// int32 or uint8), each below 2^24, split as a text's bytes are.
    Tokens(Array<'a>),
}

/// A run's flags parsed and its data read, the arrays copied into its datasets ([`prepare`]):
/// what a host does while nothing else can change the arrays (Python: under the
/// interpreter's lock), before it lets go of them for the run.
pub struct Prepared<'a> {
    args: Box<super::train::TrainArgs>,
    given: BTreeSet<String>,
    data: InMemory<'a>,
}

/// A hosted run: its flags and data ([`prepare`]), what its lines call the model, where its
/// lines and events go, and the flag that stops it after the step it is in.
pub struct HostedRun<'a> {
    pub prepared: Prepared<'a>,
    /// What the run's lines call the model, in place of its `--model` (a converted
    /// model's spec is a temporary file).
    pub model_name: Option<String>,
    pub say: &'a dyn Fn(String),
    pub observer: &'a mut dyn Observer,
    pub stop: Arc<AtomicBool>,
}

/// What a hosted run gives back.
pub struct Trained {
    /// The run's report: every epoch's metrics, why it ended, the weights of its last step.
    pub report: TrainReport,
    /// Those weights as the bytes of the safetensors file `--save` writes (f32): PyTorch's
    /// names and layouts.
    pub weights: Vec<u8>,
    /// What the held-out set evaluated after every epoch was.
    pub held_out: HeldOut,
}

/// Why a hosted run did not train, and the one line the command line would print after
/// `error: `.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Bad flags or data: the command line's exit status 2.
    Usage(String),
    /// A file that cannot be read or written.
    File(String),
    /// The run failed while training (a device's error, a non-finite loss): exit 1.
    Run(String),
}

impl Refusal {
    /// The line.
    pub fn message(&self) -> &str {
        match self {
            Refusal::Usage(m) | Refusal::File(m) | Refusal::Run(m) => m,
        }
    }

    fn from_failure(f: Failure) -> Refusal {
        let line = one_line(&f.error);
        let file = f.error.chain().any(|c| c.is::<std::io::Error>())
            || matches!(f.error.downcast_ref::<crate::Error>(), Some(crate::Error::Io { .. }))
            || FILE_FLAGS.iter().any(|flag| line.starts_with(&format!("{flag} ")));
        match (file, f.code) {
            (true, _) => Refusal::File(line),
            (false, EXIT_USAGE) => Refusal::Usage(line),
            (false, _) => Refusal::Run(line),
        }
    }
}

/// The flags that name files, of the subcommands a host runs (every one whose value names a
/// FILE or a DIR but `--data`, which a host gives in memory: a test keeps the list so): a
/// refusal of one of their values is a file's.
const FILE_FLAGS: [&str; 10] = [
    "--save",
    "--save-best",
    "--init",
    "--metrics-out",
    "--checkpoint-dir",
    "--resume",
    "--model",
    "--val-data",
    "--test-data",
    "--weights",
];

/// `train`'s flags (without the program's name and the subcommand) parsed as the program
/// parses them, and `data` read as `train` reads a file of it: the samples checked and
/// copied into datasets (`--classes`, else their labels', the classes of each), a text's
/// ids checked.
pub fn prepare(flags: Vec<String>, data: Data<'_>) -> Result<Prepared<'_>, Refusal> {
    let (Command::Train(args), given) = parse("train", flags)? else { unreachable!("the subcommand is train") };
    let classes = args.model_data.classes;
    let dataset = |name: &str, s: &Samples<'_>, classes: Option<usize>| -> Result<Dataset, Refusal> {
        crate::data::safetensors_file::dataset_from_arrays(name, &s.x, &s.y, classes)
            .map_err(|e| Refusal::Usage(e.to_string()))
    };
    let data = match data {
        Data::Samples { train, held_out } => {
            let train = dataset("the training samples", &train, classes)?;
            let held = held_out.as_ref().map(|s| dataset("the held-out samples", s, classes)).transpose()?;
            InMemory::Samples(train, held)
        }
        Data::Text(bytes) => InMemory::Text(bytes),
        Data::Tokens(ids) => InMemory::Tokens(
            crate::data::safetensors_file::tokens_from_array("the tokens", &ids)
                .map_err(|e| Refusal::Usage(e.to_string()))?,
        ),
    };
    Ok(Prepared { args, given, data })
}

/// Runs `lockstep train` as [`prepare`] read it, in this process and on the calling thread
/// (the devices' threads are the run's own, and end with it).
pub fn train(run: HostedRun<'_>) -> Result<Trained, Refusal> {
    let Prepared { args, given, data } = run.prepared;
    let hosting = Hosting { data, say: run.say, observer: run.observer, stop: run.stop, model_name: run.model_name };
    let ended = super::train::run(*args, &given, Some(hosting)).map_err(Refusal::from_failure)?;
    let ended = ended.ok_or_else(|| Refusal::Usage("the run had nothing left to train".into()))?;
    let weights = crate::weights::to_safetensors_file_bytes(&ended.model, &ended.report.weights)
        .map_err(|e| Refusal::Run(e.to_string()))?;
    Ok(Trained { report: ended.report, weights, held_out: ended.held_out })
}

/// What [`evaluate`] gives: the loss and accuracy over the samples, and each sample's
/// probabilities (its row of `classes`).
pub struct Evaluation {
    pub loss: f64,
    pub accuracy: f64,
    pub correct: u64,
    pub count: u64,
    pub classes: usize,
    pub probabilities: Vec<f32>,
}

/// `lockstep eval` with `flags` (its `--weights`, `--model`, `--classes`, `--devices`;
/// no `--data`) on `samples`, checked as `train`'s are: the same model, weights and
/// arithmetic as the command line's.
pub fn evaluate(flags: Vec<String>, samples: &Samples<'_>) -> Result<Evaluation, Refusal> {
    let (Command::Eval(a), _) = parse("eval", flags)? else { unreachable!("the subcommand is eval") };
    let data =
        |classes| crate::data::safetensors_file::dataset_from_arrays("the samples", &samples.x, &samples.y, classes);
    let e = super::eval::evaluate_in_memory(&a, data).map_err(Refusal::from_failure)?;
    Ok(Evaluation {
        loss: e.metrics.mean_loss(),
        accuracy: e.metrics.accuracy(),
        correct: e.metrics.correct,
        count: e.metrics.count,
        classes: e.classes,
        probabilities: e.probabilities,
    })
}

/// `lockstep predict` with `flags` (its `--weights`, `--model`, `--classes`, `--devices`,
/// `--limit`; no `--data`) on inputs `x`: (the model's classes, each input's
/// probabilities, a row of them an input).
pub fn predict(flags: Vec<String>, x: &Array<'_>) -> Result<(usize, Vec<f32>), Refusal> {
    // `--data` is predict's required flag; the inputs here are in memory.
    let flags = std::iter::once(format!("--data={}", super::train::IN_MEMORY)).chain(flags).collect();
    let (Command::Predict(a), _) = parse("predict", flags)? else { unreachable!("the subcommand is predict") };
    let data =
        crate::data::safetensors_file::inputs_from_array("the inputs", x).map_err(|e| Refusal::Usage(e.to_string()))?;
    super::eval::predict_in_memory(&a, &data).map_err(Refusal::from_failure)
}

/// `lockstep generate` with `flags` (its `--weights`, `--model`, `--prompt`, `--tokens`,
/// `--temperature`, `--top-k`, `--seed`, ...): the bytes it would print, its final newline
/// left out.
pub fn generate(flags: Vec<String>) -> Result<Vec<u8>, Refusal> {
    let (Command::Generate(a), _) = parse("generate", flags)? else { unreachable!("the subcommand is generate") };
    let mut text = Vec::new();
    let mut write = |bytes: &[u8]| -> crate::Result<()> {
        text.extend_from_slice(bytes);
        Ok(())
    };
    super::text::generated(&a, &mut write).map_err(Refusal::from_failure)?;
    text.pop();
    Ok(text)
}

/// `lockstep SUBCOMMAND FLAGS` parsed as the program parses it, and the flags typed.
fn parse(subcommand: &str, flags: Vec<String>) -> Result<(Command, BTreeSet<String>), Refusal> {
    let argv = ["lockstep", subcommand].into_iter().map(String::from).chain(flags);
    let (cli, matches) = Cli::parse_args(argv.map(Into::into))
        .map_err(|e| Refusal::Usage(super::clap_error_line(&e.render().to_string())))?;
    Ok((cli.command, super::typed(&matches, subcommand)))
}

/// The built-in models' names, as `--model` takes them.
pub fn builtin_models() -> Vec<&'static str> {
    use clap::ValueEnum as _;
    super::ModelName::value_variants().iter().map(|n| n.as_str()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FILE_FLAGS is every flag of train, eval, predict and generate whose value names a
    /// file or a directory, but `--data`.
    #[test]
    fn the_file_flags_are_the_subcommands_flags_that_name_files() {
        let mut tree = super::super::command_tree();
        tree.build();
        let mut found = BTreeSet::new();
        for sub in ["train", "eval", "predict", "generate"] {
            let cmd = tree.find_subcommand(sub).expect("a subcommand");
            for arg in cmd.get_arguments() {
                let names_a_file = arg
                    .get_value_names()
                    .is_some_and(|v| v.iter().any(|n| n.as_str().contains("FILE") || n.as_str().contains("DIR")));
                if let (true, Some(long)) = (names_a_file, arg.get_long()) {
                    found.insert(format!("--{long}"));
                }
            }
        }
        found.remove("--data");
        let listed: BTreeSet<String> = FILE_FLAGS.iter().map(|f| f.to_string()).collect();
        assert_eq!(listed, found);
    }

    /// The built-in models' names are `--model`'s: each parses as a built-in model.
    #[test]
    fn the_built_in_names_are_the_models_the_command_line_builds() {
        let names = builtin_models();
        assert!(names.contains(&"convnet") && names.contains(&"llama"), "{names:?}");
        for n in names {
            assert!(matches!(super::super::parse_model_choice(n), Ok(super::super::ModelChoice::Builtin(_))), "{n}");
        }
    }
}
