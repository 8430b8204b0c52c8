//! `lockstep train`: its arguments, the checks that come before any work, the run's
//! observers (progress, JSON lines, CSV), checkpoints and resume, Ctrl-C, and the final
//! report. The training itself is `lockstep::train`'s.
//!
//! Under an MPI launcher every process runs this command with the same arguments; the
//! world's devices are every process's, `--replicas` counts them all, and process 0
//! alone prints, writes `--save`, `--metrics-out` and checkpoints.

use crate::*;

#[derive(Args, Debug)]
pub(crate) struct TrainArgs {
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

// ---------------------------------------------------------------------------------------
// train

pub(crate) fn cmd_train(a: TrainArgs) -> CliResult {
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
    let world = lockstep::world::current().map_err(Failure::usage)?;
    let voice = world.is_voice();
    // The world's devices: every process's.
    let in_world = devices.len() * world.size();
    if let Some(r) = a.replicas {
        if r % in_world != 0 {
            let among = match world.size() {
                1 => String::new(),
                p => format!(" ({p} processes × {})", devices.len()),
            };
            return Err(Failure::usage(anyhow!(
                "--replicas {r} cannot be shared evenly by {in_world} devices{among} (use a multiple of {in_world})"
            )));
        }
    }
    if let Some(p) = a.save.as_ref().filter(|_| voice) {
        check_writable("--save", p)?;
    }
    if let Some(p) = a.metrics_out.as_ref().filter(|_| voice) {
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
    // Process 0 writes the checkpoints; every process reads the one it resumes from.
    if let Some(d) = checkpoint_dir.as_ref().filter(|_| voice) {
        lockstep::checkpoint::prepare_dir(d).map_err(Failure::usage).map_err(|f| f.with_context("--checkpoint-dir"))?;
        if a.resume.is_none() {
            if let Some((step, _)) = lockstep::checkpoint::list(d).map_err(Failure::usage)?.last() {
                return Err(Failure::usage(anyhow!(
                    "--checkpoint-dir '{}' already holds checkpoints of a run (newest: step {step}); continue it with --resume, or choose another directory",
                    d.display()
                )));
            }
        }
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
        run_fingerprint(&a, &source.name(), &model, &data_spec, &splits.train, &config, a.replicas.unwrap_or(in_world));
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
            let fresh = Optimizer::new(config.optimizer, model.params_len());
            match lockstep::checkpoint::load_latest(&model, dir, &run_config, &fresh, fallback)
                .map_err(Failure::usage)?
            {
                None => return Err(Failure::usage(anyhow!("--resume '{}': no checkpoint in it", dir.display()))),
                Some((r, path, skipped)) => {
                    if voice {
                        for s in skipped {
                            eprintln!("lockstep: skipping corrupt checkpoint {}", s.display());
                        }
                        outln!("lockstep: resuming {} at step {} (epoch {})", path.display(), r.step, r.epoch + 1);
                    }
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
    // Under mpirun, Ctrl-C reaches the processes as SIGTERM (or SIGUSR1, which mpirun
    // forwards): the same stop, at a step every process agrees on.
    world.stop_on_signals(&stop).map_err(Failure::runtime)?;
    let config = TrainConfig { resume, checkpoint: policy, stop: Some(stop), ..config };

    let replicas = a.replicas.unwrap_or(in_world);
    // With --log-format json, stdout carries only JSON; the human lines go to stderr.
    let human = if a.log_format == LogFormat::Json { Stream::Stderr } else { Stream::Stdout };
    // One voice: process 0 of a world of several prints, the others keep quiet.
    macro_rules! say {
        ($($arg:tt)*) => { if voice { human.line(&format!($($arg)*)) } };
    }
    let shown = match world.size() {
        1 => devices.to_string(),
        p => format!("{p} processes × {devices}"),
    };
    say!(
        "lockstep: {} ({} parameters) | devices: {shown} | replicas: {replicas} | data: {} {} samples{}",
        source.name(),
        model.num_params(),
        splits.train.name(),
        splits.train.len(),
        splits.test.as_ref().map_or(String::new(), |t| format!(", {} {} samples", t.name(), t.len()))
    );
    if let Some(note) = devices.oversubscription_note(replicas) {
        say!("lockstep: note: {note}");
    }
    say!(
        "lockstep: {} | global batch {batch_size} | epochs {epochs}{} | seed {}{}",
        optimizer_text(&optimizer),
        a.steps.map_or(String::new(), |k| format!(" (at most {k} steps)")),
        a.seed,
        a.init.as_ref().map_or(String::new(), |p| format!(" | initial weights {}", p.display()))
    );

    let step_lines = if a.log_every_step { StepLines::Lesson } else { StepLines::Off };
    // mpirun gives process 0 a pseudo-terminal whatever its own output is: plain lines.
    let mut progress = match world.size() {
        1 => Progress::new(human, step_lines),
        _ => Progress::with_drawing(human, step_lines, Drawing::Lines),
    }
    .held_out(eval_name);
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
        train_data_parallel_with(&model, &splits.train, splits.test.as_ref(), &devices, &config, &mut observers);
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
        say!("metrics written to {}", p.display());
    }
    say!("trained {} steps in {:.2}s ({:.0} samples/s)", report.steps, report.seconds, report.samples_per_sec);
    if let Some(last) = report.epochs.last() {
        say!("final train loss {:.4} accuracy {:.4}", last.train.mean_loss(), last.train.accuracy());
        if let Some(t) = &last.test {
            say!("final {eval_name} accuracy: {:.4} ({}/{})", t.accuracy(), t.correct, t.count);
        }
    }
    if let Some(p) = a.save.as_ref().filter(|_| voice) {
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
    train: &Dataset,
    c: &TrainConfig,
    replicas: usize,
) -> BTreeMap<String, String> {
    let layers: Vec<String> = model.layers().iter().map(|l| l.describe()).collect();
    let entries = [
        ("model", model_name.to_string()),
        ("layers", layers.join(" → ")),
        ("data", data_spec.to_string()),
        ("train_samples", train.len().to_string()),
        ("train_digest", format!("{:016x}", train.digest())),
        ("validation_split", format!("{:?}", a.validation_split)),
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
