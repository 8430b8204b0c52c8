//! The run's record: what `lockstep train` stores in every checkpoint of how its run is
//! configured, and what `--resume DIR` does with it.
//!
//! Owns: [`RunRecord`] — the `TrainConfig` the run trains with and the command line's own
//! choices that it does not hold (the model and its sizes, the data, the batch size asked
//! for, the devices, the outputs) — stored as one JSON value under the checkpoint's
//! `lockstep.run` key and versioned by its `format`; [`restore`], which completes the
//! flags of a resumed run from it and refuses those that disagree; and a flag's value in
//! words ([`flag_words`]), as messages show it and as the processes of one run compare
//! it. What a checkpoint file holds besides, and the configuration the library compares
//! on loading, are `crate::checkpoint`'s; the flags themselves are `train.rs`'s.
//!
//! The rule of a resume, flag by flag: a flag not given takes the run's value; a flag
//! given must equal it, as data (`--lr 1e-1` is the run's 0.1), unless it may change
//! ([`MAY_CHANGE`]: the length, the devices, the outputs, checkpointing and logging); a
//! flag the run did not have may not be added (an `--augment` to a run without, Adam's
//! `--adam-eps` to an SGD run) unless it may change. `--init` is refused (a resumed run
//! continues from its checkpoint's weights) and `--time-limit` is each invocation's own.
//! A checkpoint of a lockstep from before the record (its flags stored as text, one
//! `stored.<flag>` entry each) is refused, naming the format; so is a record of a later
//! format than [`FORMAT`].

use std::collections::BTreeSet;

use crate::checkpoint::{self, Record};
use crate::data::augment::Augment;
use serde::{Deserialize, Serialize};

use super::TrainArgs;
use crate::cli::text::GptArgs;
use crate::cli::*;

/// The format of the record this lockstep writes, and the only one it reads: a change to
/// what [`RunRecord`] holds is a new format, but for a field that only adds what older
/// records lack and means nothing else when absent (`written_in`), which keeps the runs
/// in progress resumable.
pub(crate) const FORMAT: u64 = 1;

/// How a run is configured, as its checkpoints record it (`lockstep.run`, JSON):
/// `{"format": 1, "train": {...}, "cli": {...}}`.
#[derive(Serialize, Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct RunRecord {
    /// [`FORMAT`].
    format: u64,
    /// The library's configuration the run trains with: what a program of its own would
    /// hand `train_data_parallel`. Its time limit is the invocation's that wrote the
    /// checkpoint: a resume sets its own.
    train: TrainConfig,
    /// What the command line chose that `train` does not hold.
    cli: CliChoices,
}

/// The command line's choices that a `TrainConfig` does not hold, every one resolved (the
/// defaults taken) as the run used it.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
struct CliChoices {
    /// `--model`: a built-in name or a spec file.
    model: ModelChoice,
    /// `--layers`, `--heads`, `--width`, `--context`: the built-in GPT's shape, and the
    /// windows of text data.
    gpt: GptArgs,
    /// `--classes`: the model's outputs (the training data's classes when not given).
    classes: usize,
    dropout: f32,
    bn_momentum: f32,
    /// `--sync-batchnorm`: the model's BatchNorm layers synchronized.
    sync_batchnorm: bool,
    /// `--data` (the model's default when not given), `--test-data`, `--val-data`,
    /// `--validation-split`.
    data: String,
    test_data: Option<PathBuf>,
    val_data: Option<String>,
    validation_split: Option<f64>,
    /// `--batch-size` as asked: `train.batch_size` is at most the training set.
    batch_size: usize,
    /// How the run is counted: a text run's `train.epochs` are its evaluations, not an
    /// `--epochs` it was given.
    counted_in: CountedIn,
    devices: String,
    checkpoint_every: Option<u64>,
    keep_checkpoints: usize,
    /// `--save` and its `--save-dtype`: a resumed run writes its weights where the run
    /// was started to.
    save: Option<PathBuf>,
    save_dtype: Option<SaveDtypeName>,
    /// The checkpoint directory the record's checkpoints were written in, canonical: a
    /// resume from anywhere else is of a copy (or a move), whose `--save` and
    /// `--save-best` would replace the original run's files unless given anew. Absent from
    /// the records written before it (the format is the same: a record without it reads,
    /// and is not checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    written_in: Option<PathBuf>,
}

/// How a run's length is counted.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum CountedIn {
    /// `--epochs`, passes over the training data.
    Epochs,
    /// `--steps`: a run over text, evaluated every `--eval-every` steps.
    Steps,
}

impl RunRecord {
    /// The record of a run: its flags once resolved (`train`'s settings taken, the classes
    /// known), and the configuration built from them.
    pub(crate) fn new(args: &TrainArgs, config: &TrainConfig) -> RunRecord {
        let (m, d) = (&args.model_data, &args.ddp);
        let save = args.outputs.save.clone();
        let cli = CliChoices {
            model: m.model.clone(),
            gpt: m.gpt.clone(),
            classes: m.classes.expect("resolved before the record is made"),
            dropout: m.dropout.expect("resolved before the record is made"),
            bn_momentum: m.bn_momentum,
            sync_batchnorm: d.features.sync_batchnorm,
            data: m.data.clone().expect("resolved before the record is made"),
            test_data: m.test_data.clone(),
            val_data: m.val_data.clone(),
            validation_split: m.validation_split,
            batch_size: args.length.batch_size.expect("resolved before the record is made"),
            // A text run is given no --epochs: its settings count its evaluations.
            counted_in: if args.length.epochs.is_some() { CountedIn::Epochs } else { CountedIn::Steps },
            devices: d.devices.clone(),
            checkpoint_every: args.checkpoints.checkpoint_every,
            keep_checkpoints: args.checkpoints.keep_checkpoints,
            save_dtype: save.as_ref().map(|_| args.outputs.save_dtype),
            save,
            written_in: None,
        };
        // The run's state and handles are not configuration (`TrainConfig` skips them).
        let train = TrainConfig { initial: None, resume: None, checkpoint: None, stop: None, ..config.clone() };
        RunRecord { format: FORMAT, train, cli }
    }

    /// The record of checkpoints written in `dir`.
    pub(crate) fn written_in(mut self, dir: &Path) -> RunRecord {
        self.cli.written_in = Some(std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf()));
        self
    }

    /// The record as the checkpoint stores it. Through its text, so that an f32 is
    /// written as its shortest form (`0.1`), not as the f64 it would widen to as a value.
    pub(crate) fn to_json(&self) -> CliResult<serde_json::Value> {
        let text = serde_json::to_string(self)
            .map_err(|e| Failure::usage(anyhow!("a checkpoint records the run's settings as JSON text: {e}")))?;
        Ok(serde_json::from_str(&text).expect("serde_json reads what it writes"))
    }

    /// The record of the checkpoint `path`, from its JSON: of this format, or refused.
    fn from_json(value: serde_json::Value, path: &Path) -> CliResult<RunRecord> {
        match value.get("format").and_then(serde_json::Value::as_u64) {
            Some(FORMAT) => {}
            Some(later) if later > FORMAT => {
                return Err(Failure::usage(anyhow!(
                    "{}: made by a later lockstep (its run record is format {later}, this one reads format {FORMAT}); resume it with that version",
                    path.display()
                )))
            }
            _ => {
                return Err(Failure::usage(anyhow!(
                    "{}: its run record has no format this lockstep reads (format {FORMAT})",
                    path.display()
                )))
            }
        }
        serde_json::from_value(value)
            .map_err(|e| Failure::usage(anyhow!("{}: its run record does not read: {e}", path.display())))
    }

    /// A resume of `dir`, which is not where the record's checkpoints were written (a
    /// copy of the run's directory, or the directory moved), is refused while it would
    /// write the run's `--save` or `--save-best` taken from the record: the original
    /// run's files, which a copy must not replace (nor, after a move, can it tell whose
    /// they are). Given on the command line, they are this run's own choice.
    fn check_copy(&self, dir: &Path, given: &BTreeSet<String>) -> CliResult {
        let Some(written_in) = &self.cli.written_in else { return Ok(()) };
        let here = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        if here == *written_in {
            return Ok(());
        }
        let outputs = [("save", &self.cli.save), ("save_best", &self.train.save_best)];
        let Some((id, path)) =
            outputs.iter().find_map(|(id, p)| p.as_ref().filter(|_| !given.contains(*id)).map(|p| (*id, p)))
        else {
            return Ok(());
        };
        let f = flag(id);
        Err(Failure::usage(anyhow!(
            "--resume '{}': its checkpoints were written in '{}', so this is a copy of that run's directory (or it was moved), and the run's {f} '{}' is the original run's file: give {f} FILE for this run's own output (the same path, to replace that file), or resume '{}' itself",
            dir.display(),
            written_in.display(),
            path.display(),
            written_in.display()
        )))
    }

    /// `args` completed with this record: the problems with the flags `given`, in the
    /// order of their clap ids (`--init` first), none if they all agree.
    fn restore_onto(self, args: &mut TrainArgs, given: &BTreeSet<String>) -> Vec<String> {
        let mut r = Restore { given, problems: Vec::new() };
        self.take_each(args, &mut r);
        r.problems.sort_by_key(|(id, _)| *id);
        let mut problems: Vec<String> = r.problems.into_iter().map(|(_, p)| p).collect();
        if given.contains("init") {
            problems.insert(0, "--init starts a run; a resumed run continues from its checkpoint's weights".into());
        }
        problems
    }

    /// Every flag the record gives back, taken by `r`: one line each, its clap id, its
    /// place in `args` and its value in the record (`take_if` for a setting the run may
    /// not have). [`flag_words`] lists the same flags, and a test holds the two equal.
    fn take_each(self, args: &mut TrainArgs, r: &mut Restore) {
        let RunRecord { train: t, cli: c, .. } = self;
        let m = &mut args.model_data;
        r.take("model", &mut m.model, c.model);
        r.take("data", &mut m.data, Some(c.data));
        r.take("classes", &mut m.classes, Some(c.classes));
        r.take("test_data", &mut m.test_data, c.test_data);
        r.take("validation_split", &mut m.validation_split, c.validation_split);
        r.take("val_data", &mut m.val_data, c.val_data);
        r.take("dropout", &mut m.dropout, Some(c.dropout));
        r.take("bn_momentum", &mut m.bn_momentum, c.bn_momentum);
        r.take("layers", &mut m.gpt.layers, c.gpt.layers);
        r.take("heads", &mut m.gpt.heads, c.gpt.heads);
        r.take("width", &mut m.gpt.width, c.gpt.width);
        r.take("context", &mut m.gpt.context, c.gpt.context);
        let o = &mut args.optim;
        let (sgd, adam) = match t.optimizer {
            OptimizerConfig::Sgd { momentum, momentum_kind, .. } => {
                (Some((momentum, momentum_kind == MomentumKind::Nesterov)), None)
            }
            OptimizerConfig::Adam { beta1, beta2, eps, .. } | OptimizerConfig::AdamW { beta1, beta2, eps, .. } => {
                (None, Some((beta1, beta2, eps)))
            }
        };
        r.take("optimizer", &mut o.optimizer, Some(OptimizerName::of(&t.optimizer)));
        r.take("lr", &mut o.lr, Some(t.optimizer.lr()));
        r.take("lr_schedule", &mut o.lr_schedule, Some(ScheduleName::of(t.schedule)));
        r.take_if("momentum", &mut o.momentum, sgd.map(|(momentum, _)| Some(momentum)));
        r.take_if("nesterov", &mut o.nesterov, sgd.map(|(_, nesterov)| nesterov));
        r.take("weight_decay", &mut o.weight_decay, Some(t.optimizer.weight_decay()));
        r.take("weight_decay_on", &mut o.weight_decay_on, DecayOnName::of(t.weight_decay_on));
        r.take("warmup_steps", &mut o.warmup_steps, Some(t.warmup_steps));
        r.take("clip_grad_norm", &mut o.clip_grad_norm, t.clip_grad_norm);
        r.take_if("adam_eps", &mut o.adam_eps, adam.map(|(_, _, eps)| Some(eps)));
        r.take_if("adam_beta1", &mut o.adam_beta1, adam.map(|(beta1, _, _)| Some(beta1)));
        r.take_if("adam_beta2", &mut o.adam_beta2, adam.map(|(_, beta2, _)| Some(beta2)));
        let l = &mut args.length;
        r.take_if("epochs", &mut l.epochs, (c.counted_in == CountedIn::Epochs).then_some(Some(t.epochs)));
        r.take("steps", &mut l.steps, t.max_steps);
        r.take("early_stopping", &mut l.early_stopping, t.early_stopping.map(|e| e.patience));
        r.take("allow_nonfinite", &mut l.allow_nonfinite, t.non_finite == NonFinite::Allow);
        r.take("batch_size", &mut l.batch_size, Some(c.batch_size));
        r.take("no_shuffle", &mut l.no_shuffle, t.shuffle == Shuffle::None);
        r.take("drop_last", &mut l.drop_last, t.last_batch == LastBatch::Drop);
        r.take("seed", &mut l.seed, t.seed);
        r.take("eval_every", &mut l.eval_every, t.eval_every);
        r.take("eval_batches", &mut l.eval_batches, t.eval_batches);
        r.take("augment", &mut args.regularize.augment, (!t.augment.is_none()).then_some(t.augment));
        r.take("label_smoothing", &mut args.regularize.label_smoothing, t.label_smoothing);
        let d = &mut args.ddp;
        r.take("devices", &mut d.devices, c.devices);
        r.take("replicas", &mut d.replicas, t.replicas);
        r.take("check_replicas_every", &mut d.check_replicas_every, t.check_replicas_every);
        r.take("accumulate", &mut d.features.accumulate, t.accumulate);
        r.take("sync_batchnorm", &mut d.features.sync_batchnorm, c.sync_batchnorm);
        r.take("grad_compression", &mut d.features.grad_compression, CompressionName::of(t.grad_compression));
        r.take("shard_optimizer", &mut d.features.shard_optimizer, t.optimizer_sharding == Sharding::Sharded);
        r.take("checkpoint_every", &mut args.checkpoints.checkpoint_every, c.checkpoint_every);
        r.take("keep_checkpoints", &mut args.checkpoints.keep_checkpoints, c.keep_checkpoints);
        r.take("save", &mut args.outputs.save, c.save);
        r.take_if("save_dtype", &mut args.outputs.save_dtype, c.save_dtype);
        r.take("save_best", &mut args.outputs.save_best, t.save_best);
    }
}

/// The flags a record holds, by clap id, each in words (None: not set), in the order of
/// [`RunRecord::restore_onto`]: what the processes of a run compare before any work.
pub(crate) fn flag_words(args: &TrainArgs) -> Vec<(&'static str, Option<String>)> {
    let (m, o, l, d) = (&args.model_data, &args.optim, &args.length, &args.ddp);
    let (c, out, reg) = (&args.checkpoints, &args.outputs, &args.regularize);
    vec![
        ("model", m.model.set()),
        ("data", m.data.set()),
        ("classes", m.classes.set()),
        ("test_data", m.test_data.set()),
        ("validation_split", m.validation_split.set()),
        ("val_data", m.val_data.set()),
        ("dropout", m.dropout.set()),
        ("bn_momentum", m.bn_momentum.set()),
        ("layers", m.gpt.layers.set()),
        ("heads", m.gpt.heads.set()),
        ("width", m.gpt.width.set()),
        ("context", m.gpt.context.set()),
        ("optimizer", o.optimizer.set()),
        ("lr", o.lr.set()),
        ("lr_schedule", o.lr_schedule.set()),
        ("momentum", o.momentum.set()),
        ("nesterov", o.nesterov.set()),
        ("weight_decay", o.weight_decay.set()),
        ("weight_decay_on", o.weight_decay_on.set()),
        ("warmup_steps", o.warmup_steps.set()),
        ("clip_grad_norm", o.clip_grad_norm.set()),
        ("adam_eps", o.adam_eps.set()),
        ("adam_beta1", o.adam_beta1.set()),
        ("adam_beta2", o.adam_beta2.set()),
        ("epochs", l.epochs.set()),
        ("steps", l.steps.set()),
        ("early_stopping", l.early_stopping.set()),
        ("allow_nonfinite", l.allow_nonfinite.set()),
        ("batch_size", l.batch_size.set()),
        ("no_shuffle", l.no_shuffle.set()),
        ("drop_last", l.drop_last.set()),
        ("seed", l.seed.set()),
        ("eval_every", l.eval_every.set()),
        ("eval_batches", l.eval_batches.set()),
        ("augment", reg.augment.set()),
        ("label_smoothing", reg.label_smoothing.set()),
        ("devices", d.devices.set()),
        ("replicas", d.replicas.set()),
        ("check_replicas_every", d.check_replicas_every.set()),
        ("accumulate", d.features.accumulate.set()),
        ("sync_batchnorm", d.features.sync_batchnorm.set()),
        ("grad_compression", d.features.grad_compression.set()),
        ("shard_optimizer", d.features.shard_optimizer.set()),
        ("checkpoint_every", c.checkpoint_every.set()),
        ("keep_checkpoints", c.keep_checkpoints.set()),
        ("save", out.save.set()),
        ("save_dtype", out.save.as_ref().and(out.save_dtype.set())),
        ("save_best", out.save_best.set()),
    ]
}

// ---------------------------------------------------------------------------------------
// resume

/// The flags that may differ from the run's on `--resume` (clap ids).
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

/// `args` completed with the record of the run in `dir` (see the rule above): the flags
/// `given` on the command line are compared with it, the others take its values.
/// Process 0 (`voice`), which writes the outputs, also refuses to resume a copy of the
/// run's directory onto the original run's output files ([`check_copy`]).
pub(crate) fn restore(args: &mut TrainArgs, given: &BTreeSet<String>, dir: &Path, voice: bool) -> CliResult {
    // A checkpoint that keeps no record (one a program of its own wrote through the
    // library): the flags given decide, and the configuration check on loading compares
    // what it can.
    let Some(record) = newest_record(dir, args.checkpoints.resume_fallback)? else { return Ok(()) };
    if voice {
        record.check_copy(dir, given)?;
    }
    let problems = record.restore_onto(args, given);
    if problems.is_empty() {
        return Ok(());
    }
    let free = ["--epochs", "--steps", "--devices", "--early-stopping", "--save", "--save-dtype", "--save-best"];
    Err(Failure::usage(anyhow!(
        "--resume '{}': {} (only {}, checkpoint and logging flags may change when resuming)",
        dir.display(),
        problems.join("; "),
        free.join(", ")
    )))
}

/// The record of the newest checkpoint of `dir` whose header reads (older ones are tried
/// only with `--resume-fallback`; the checksum is checked when it is loaded), or None when
/// it keeps none.
fn newest_record(dir: &Path, fallback: bool) -> CliResult<Option<RunRecord>> {
    // The record of one run: a directory holding two would resume whichever is newest.
    checkpoint::check_one_run(dir).map_err(Failure::usage)?;
    let files = checkpoint::list(dir).map_err(Failure::usage)?;
    let mut first_error = None;
    for (_, path) in files.iter().rev() {
        match checkpoint::read_record(path) {
            Ok((_, Record::Json(value))) => return RunRecord::from_json(value, path).map(Some),
            Ok((_, Record::Absent)) => return Ok(None),
            Ok((_, Record::EarlierFlags)) => {
                return Err(Failure::usage(anyhow!(
                    "{}: made by an earlier lockstep (the run's flags stored as text, before the run record of format {FORMAT}); resume it with that version or start again",
                    path.display()
                )))
            }
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

/// The flags of a resume, taken one by one: the problems found, by clap id.
struct Restore<'a> {
    given: &'a BTreeSet<String>,
    problems: Vec<(&'static str, String)>,
}

impl Restore<'_> {
    /// The flag `id`, `mine` in `args`: the run's `value` when it was not given; compared
    /// with it when it was (unless it may change).
    fn take<T: Flag>(&mut self, id: &'static str, mine: &mut T, value: T) {
        self.take_if(id, mine, Some(value))
    }

    /// The same of a setting the run may not have (None: its optimiser has no such
    /// setting, or it is not counted in epochs): a flag given for it is one the run did
    /// not have, and one not given is left as it is.
    fn take_if<T: Flag>(&mut self, id: &'static str, mine: &mut T, value: Option<T>) {
        if !self.given.contains(id) {
            if let Some(v) = value {
                *mine = v;
            }
            return;
        }
        let Some(given) = mine.set().filter(|_| !MAY_CHANGE.contains(&id)) else { return };
        let f = flag(id);
        match value.as_ref().and_then(|v| v.set().map(|words| (v, words))) {
            Some((v, _)) if *v == *mine => {}
            Some((_, theirs)) => self.problems.push((id, format!("{f} {given} differs from the run's {f} {theirs}"))),
            None => self.problems.push((id, format!("the run had no {f}"))),
        }
    }
}

// ---------------------------------------------------------------------------------------
// flags in words

/// `--batch-size` for the clap id `batch_size`.
pub(crate) fn flag(id: &str) -> String {
    format!("--{}", id.replace('_', "-"))
}

/// The command line's name of a value (`adamw`, `bf16`).
pub(crate) fn enum_name<T: ValueEnum>(v: &T) -> String {
    v.to_possible_value().map_or(String::new(), |p| p.get_name().to_string())
}

/// A value as messages write it: a number as Rust prints it (`0.1`, `1`), a name as the
/// command line takes it.
trait Words {
    fn words(&self) -> String;
}

macro_rules! words_by_display {
    ($($t:ty),*) => {$(
        impl Words for $t {
            fn words(&self) -> String {
                self.to_string()
            }
        }
    )*};
}
words_by_display!(f32, f64, u64, usize, String);

macro_rules! words_by_name {
    ($($t:ty),*) => {$(
        impl Words for $t {
            fn words(&self) -> String {
                enum_name(self)
            }
        }
    )*};
}
words_by_name!(OptimizerName, ScheduleName, DecayOnName, CompressionName, SaveDtypeName);

impl Words for PathBuf {
    fn words(&self) -> String {
        self.display().to_string()
    }
}

impl Words for Augment {
    fn words(&self) -> String {
        self.name()
    }
}

impl Words for ModelChoice {
    fn words(&self) -> String {
        match self {
            ModelChoice::Builtin(n) => n.as_str().to_string(),
            ModelChoice::Spec(p) => p.display().to_string(),
        }
    }
}

/// A flag as it is set: its value in words, or None when it is not (an absent option, an
/// unset switch).
trait Flag: PartialEq {
    fn set(&self) -> Option<String>;
}

impl<T: Words + PartialEq> Flag for Option<T> {
    fn set(&self) -> Option<String> {
        self.as_ref().map(Words::words)
    }
}

impl Flag for bool {
    fn set(&self) -> Option<String> {
        self.then(|| "true".to_string())
    }
}

macro_rules! flag_always_set {
    ($($t:ty),*) => {$(
        impl Flag for $t {
            fn set(&self) -> Option<String> {
                Some(self.words())
            }
        }
    )*};
}
flag_always_set!(f32, u64, usize, String, ModelChoice, DecayOnName, CompressionName, SaveDtypeName);

#[cfg(test)]
mod tests {
    use super::super::tests::{parsed, parsed_given, resolved};
    use super::*;

    /// The flags a record does not hold: how one invocation starts (`--init`) and stops
    /// (`--time-limit`), what it says, and where it finds or writes its checkpoints.
    const NOT_RECORDED: [&str; 8] = [
        "init",
        "time_limit",
        "log_format",
        "log_every_step",
        "metrics_out",
        "checkpoint_dir",
        "resume",
        "resume_fallback",
    ];

    #[test]
    fn every_flag_is_recorded_or_named_as_not() {
        let ids: BTreeSet<&str> = flag_words(&parsed(&[])).into_iter().map(|(id, _)| id).collect();
        let command = <TrainArgs as clap::Args>::augment_args(clap::Command::new("train"));
        let all: BTreeSet<String> = command.get_arguments().map(|a| a.get_id().to_string()).collect();
        let named: BTreeSet<String> = ids.iter().chain(&NOT_RECORDED).map(|s| s.to_string()).collect();
        assert_eq!(all, named, "a flag is neither in the record (flag_words) nor in NOT_RECORDED");
        assert!(ids.iter().all(|id| !NOT_RECORDED.contains(id)));
    }

    /// Runs that between them set every recorded flag to other than its default, in the
    /// sets that the conflicts and the kinds of run allow; `files` holds their data files.
    fn runs(files: &Path) -> Vec<Vec<String>> {
        let splits = crate::data::toy::toy();
        let (train, test) = (files.join("train.safetensors"), files.join("test.safetensors"));
        let save = crate::data::safetensors_file::save_safetensors_dataset;
        save(&splits.train, &train).unwrap();
        save(splits.test.as_ref().unwrap(), &test).unwrap();
        let (train, test) = (train.display(), test.display());
        let text = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
        let toy = "--model=toy --data=toy-enlarged --classes=2 --epochs=2 --steps=9 --batch-size=4 \
            --optimizer=sgd --lr=0.1 --lr-schedule=constant --momentum=0.9 --nesterov --weight-decay=5e-4 \
            --weight-decay-on=all --warmup-steps=3 --clip-grad-norm=0.5 --seed=7 --devices=cpu:2 \
            --replicas=4 --check-replicas-every=3 --checkpoint-dir=ck --checkpoint-every=4 \
            --keep-checkpoints=5 --no-shuffle --drop-last --allow-nonfinite --accumulate=2 \
            --grad-compression=bf16 --shard-optimizer --label-smoothing=0.1 --validation-split=0.2 \
            --early-stopping=2 --save-best=b.safetensors --save=w.safetensors --save-dtype=bf16";
        let convnet = "--data=digits --dropout=0.25 --bn-momentum=0.5 --augment=crop=2,flip \
            --sync-batchnorm --devices=cpu:1";
        let gpt = format!(
            "--model=gpt --data=text:{text} --layers=1 --heads=2 --width=16 --context=8 --eval-every=5 \
            --eval-batches=2 --adam-eps=1e-6 --adam-beta1=0.8 --adam-beta2=0.95 --devices=cpu:1 --steps=20"
        );
        let files = [
            format!("--model=toy --data={train} --test-data={test} --devices=cpu:1"),
            format!("--model=toy --data={train} --val-data={test} --devices=cpu:1"),
        ];
        let runs = [toy.to_string(), convnet.to_string(), gpt].into_iter().chain(files);
        runs.map(|r| r.split_whitespace().map(String::from).collect()).collect()
    }

    /// A run's flags, resolved, go into its record and come back from it through JSON
    /// onto the flags of `lockstep train --resume DIR` alone, which resolve to the same
    /// flags and record: every recorded flag, the runs above between them setting each one
    /// to other than its default.
    #[test]
    fn every_recorded_flag_comes_back_from_the_record() {
        let files = tempfile::tempdir().unwrap();
        let (defaults, _) = resolved(parsed(&["--devices=cpu:1"]));
        let defaults = flag_words(&defaults);
        let mut changed: BTreeSet<&str> = BTreeSet::new();
        for argv in runs(files.path()) {
            let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
            let (run, record) = resolved(parsed(&argv));
            let json = record.to_json().unwrap();
            let mut resumed = parsed(&["--resume=ck"]);
            let problems = RunRecord::from_json(json.clone(), Path::new("ck"))
                .unwrap()
                .restore_onto(&mut resumed, &BTreeSet::new());
            assert!(problems.is_empty(), "{problems:?}");
            let (resumed, again) = resolved(resumed);
            assert_eq!(again.to_json().unwrap(), json, "{argv:?}");
            let (want, got) = (flag_words(&run), flag_words(&resumed));
            assert_eq!(want, got, "{argv:?}");
            for ((id, w), (_, d)) in want.iter().zip(&defaults) {
                if w != d {
                    changed.insert(id);
                }
            }
        }
        let unchanged: Vec<&str> = defaults.iter().map(|(id, _)| *id).filter(|id| !changed.contains(id)).collect();
        assert!(unchanged.is_empty(), "no run sets {unchanged:?} to other than its default");
    }

    /// The record's JSON, as a checkpoint holds it: a sample of its fields, floats written
    /// as typed (`0.1`, not the f64 `0.10000000149011612`).
    #[test]
    fn the_record_is_json_of_the_train_config_and_the_command_lines_choices() {
        let (_, record) = resolved(parsed(&["--model=toy", "--lr=0.1", "--devices=cpu:1", "--label-smoothing=0.1"]));
        let json = record.to_json().unwrap();
        assert_eq!(json["format"], 1);
        let sgd =
            serde_json::json!({"sgd": {"lr": 0.1, "momentum": 0.0, "momentum_kind": "classic", "weight_decay": 0.0}});
        assert_eq!(json["train"]["optimizer"], sgd);
        assert_eq!((&json["train"]["augment"], &json["train"]["label_smoothing"]), (&"none".into(), &0.1.into()));
        assert_eq!(json["train"]["shuffle"], "seeded");
        assert_eq!(json["cli"]["model"], serde_json::json!({"builtin": "toy"}));
        assert_eq!(json["cli"]["data"], "toy");
        assert_eq!(json["cli"]["counted_in"], "epochs");
        assert!(json["train"].get("initial").is_none() && json["train"].get("stop").is_none(), "{json}");
        assert!(json.to_string().contains(r#""lr":0.1,"#), "{json}");
    }

    #[test]
    fn a_record_of_another_format_is_refused_naming_it() {
        let (_, record) = resolved(parsed(&["--model=toy", "--devices=cpu:1"]));
        let mut json = record.to_json().unwrap();
        json["format"] = 2.into();
        let path = Path::new("ck/checkpoint-1");
        let e = RunRecord::from_json(json.clone(), path).unwrap_err().error.to_string();
        assert_eq!(
            e,
            "ck/checkpoint-1: made by a later lockstep (its run record is format 2, this one reads format 1); resume it with that version"
        );
        json["format"] = 1.into();
        json["cli"]["colour"] = "blue".into();
        let e = RunRecord::from_json(json, path).unwrap_err().error.to_string();
        assert!(e.starts_with("ck/checkpoint-1: its run record does not read: unknown field `colour`"), "{e}");
    }

    /// The rule of a resume, flag by flag, on the record of an SGD run of the toy.
    #[test]
    fn given_flags_are_compared_as_data_and_may_not_be_added() {
        let (_, record) = resolved(parsed(&["--model=toy", "--lr=0.1", "--devices=cpu:1"]));
        let json = record.to_json().unwrap();
        let resume = |argv: &[&str]| {
            let (mut args, given) = parsed_given(argv);
            let problems = RunRecord::from_json(json.clone(), Path::new("ck")).unwrap().restore_onto(&mut args, &given);
            (args, problems)
        };
        // The same values written another way agree; what may change does.
        let (args, none) = resume(&["--lr=1e-1", "--model=toy", "--epochs=9", "--devices=cpu:2"]);
        assert!(none.is_empty(), "{none:?}");
        assert_eq!((args.length.epochs, args.ddp.devices.as_str(), args.optim.lr), (Some(9), "cpu:2", Some(0.1)));
        // Adam's settings were not the run's (an SGD run's momentum of 0 was); --init
        // comes first, the rest by flag.
        let (_, p) = resume(&["--adam-eps=1e-8", "--momentum=0", "--lr=0.2", "--init=w", "--augment=flip"]);
        assert_eq!(
            p,
            [
                "--init starts a run; a resumed run continues from its checkpoint's weights",
                "the run had no --adam-eps",
                "the run had no --augment",
                "--lr 0.2 differs from the run's --lr 0.1",
            ]
        );
    }
}
