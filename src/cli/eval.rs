//! `lockstep eval` and `lockstep predict`: saved weights applied to a dataset, on every
//! device given (the samples split across them). A classifier is scored by its loss,
//! accuracy and confusion matrix; a language model (the GPT, or a spec that starts with an
//! embedding) by its loss per token, perplexity and next-token accuracy over a text's
//! validation part. `predict` is a classifier's: a language model is pointed to
//! `generate`. The built-in GPT's sizes come from its weights (`identify`).

use super::identify::{load_weights, Header, WeightsFor};
use super::text::{is_builtin_data, is_text, load_text_data, not_a_language_model, not_text};
use crate::nn::loss::Metrics;

use super::*;

/// `eval --model`'s help: every built-in model, from the one list (`ModelName`).
fn model_help() -> String {
    format!("{}, or a model spec FILE.json", model_names(|_| true))
}

/// `predict --model`'s help: the built-in classifiers, from the same list.
fn classifier_help() -> String {
    format!(
        "The classifier: {}, or a model spec FILE.json (a language model such as gpt continues text with `generate` instead)",
        model_names(|n| !n.is_language_model())
    )
}

#[derive(Args, Debug)]
pub(crate) struct EvalArgs {
    /// The weights to evaluate.
    #[arg(long, value_name = "FILE")]
    weights: PathBuf,
    #[arg(long, default_value = "convnet", value_name = "NAME|FILE.json", value_parser = parse_model_choice, help = model_help())]
    model: ModelChoice,
    /// toy, toy-enlarged, digits, fashion-mnist, mnist:DIR (their test split), or a FILE.safetensors; for a language model fortunes or text:FILE (their validation part, the last tenth, in consecutive windows of the context) or a token file [default: the model's data]
    #[arg(long)]
    data: Option<String>,
    /// The model's number of classes [default: what the weights hold].
    #[arg(long, value_name = "K")]
    classes: Option<usize>,
    /// The gpt's or llama's attention heads, for weights that do not record them (a
    /// PyTorch state_dict) [default: the file's].
    #[arg(long, value_name = "H")]
    heads: Option<usize>,
    /// The llama's window, for weights that do not record it (a PyTorch state_dict)
    /// [default: the file's].
    #[arg(long, value_name = "T")]
    context: Option<usize>,
    #[arg(long, default_value = "auto", value_name = "SPEC")]
    devices: String,
    /// Seed of toy-enlarged's noise.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args, Debug)]
pub(crate) struct PredictArgs {
    /// The trained weights.
    #[arg(long, value_name = "FILE")]
    weights: PathBuf,
    #[arg(long, default_value = "convnet", value_name = "NAME|FILE.json", value_parser = parse_model_choice, help = classifier_help())]
    model: ModelChoice,
    /// The inputs, no labels needed: a FILE.safetensors (its x), an IDX images file (idx3,
    /// plain or .gz), mnist:DIR (its t10k images), or toy, toy-enlarged, digits,
    /// fashion-mnist (their test split).
    #[arg(long, value_name = "FILE|mnist:DIR")]
    data: String,
    /// The model's number of classes [default: what the weights hold].
    #[arg(long, value_name = "K")]
    classes: Option<usize>,
    /// Only the first N inputs.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    #[arg(long, default_value = "auto", value_name = "SPEC")]
    devices: String,
    /// text: `index  class  probability  [name]` per input; csv: a header, then index,
    /// class, name, probability and every class's probability; json: one object per line
    /// with the same fields. Names come from the data where it has them (Fashion-MNIST, a
    /// safetensors file's `class_names`).
    #[arg(long, value_enum, default_value = "text")]
    format: PredictFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PredictFormat {
    Text,
    Csv,
    Json,
}

// ---------------------------------------------------------------------------------------
// eval

pub(crate) fn cmd_eval(a: EvalArgs) -> CliResult {
    let devices = resolve_devices(&a.devices)?;
    check_input_file("--weights", &a.weights)?;
    check_classes(a.classes)?;
    let source = a.model.resolve()?;
    let data_spec = a.data.clone().unwrap_or_else(|| source.default_data().to_string());
    if source.is_language_model() {
        return eval_sequences(&a, &source, &data_spec, devices);
    }
    if a.heads.is_some() || a.context.is_some() {
        return Err(Failure::usage(anyhow!("--heads and --context go with --model gpt or llama, a language model")));
    }
    if is_text(&data_spec) {
        return Err(not_a_language_model(&source.name(), &data_spec));
    }
    let splits = load_data(&data_spec, source.flat(), a.seed, None, a.classes)?;
    // Built-in data: its test split; a file: all of it.
    let data = splits.test.unwrap_or(splits.train);
    let Evaluated { devices, classes, metrics, probabilities: probs } = evaluated(&a, &source, devices, &data)?;
    outln!("{} ({classes} classes) on {} ({} samples) on {}", a.weights.display(), data.name(), data.len(), devices);
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

/// `eval` on samples a host gives in memory (`cli::hosted::evaluate`): `cmd_eval`'s checks
/// that read no `--data`, the samples made with `--classes` (`samples`), then
/// [`evaluated`].
pub(crate) fn evaluate_in_memory(
    a: &EvalArgs,
    samples: impl FnOnce(Option<usize>) -> crate::Result<Dataset>,
) -> CliResult<Evaluated> {
    if let Some(spec) = &a.data {
        return Err(Failure::usage(anyhow!("--data {spec}: the samples are given in memory; give no --data")));
    }
    let devices = resolve_devices(&a.devices)?;
    check_input_file("--weights", &a.weights)?;
    check_classes(a.classes)?;
    let source = a.model.resolve()?;
    if source.is_language_model() {
        return Err(Failure::usage(anyhow!(
            "{}: a language model is scored on a text's windows (lockstep eval --data text:FILE), not on samples",
            source.name()
        )));
    }
    let data = samples(a.classes).map_err(Failure::usage)?;
    evaluated(a, &source, devices, &data)
}

/// `predict` on inputs a host gives in memory (`cli::hosted::predict`): `cmd_predict`'s
/// checks that read no `--data`, then [`predicted`] of the first `--limit` inputs.
pub(crate) fn predict_in_memory(a: &PredictArgs, data: &Dataset) -> CliResult<(usize, Vec<f32>)> {
    let (source, devices) = predict_checks(a)?;
    let n = a.limit.map_or(data.len(), |l| l.min(data.len()));
    predicted(a, &source, devices, data, data.num_classes(), n)
}

/// What [`evaluated`] gives: the devices it ran on, the model's classes, the metrics, and
/// every sample's probabilities (N × classes).
pub(crate) struct Evaluated {
    pub(crate) devices: Devices,
    pub(crate) classes: usize,
    pub(crate) metrics: Metrics,
    pub(crate) probabilities: Vec<f32>,
}

/// The weights of `a` scored on `data` (a classifier's samples): the model built for the
/// data and the weights, checked against both, run on `devices` (no more than samples).
/// `eval`'s work, and a host's (`cli::hosted::evaluate`).
pub(crate) fn evaluated(a: &EvalArgs, source: &ModelSource, devices: Devices, data: &Dataset) -> CliResult<Evaluated> {
    let classes = model_classes(source, data.sample_shape().dims(), a.classes, &a.weights, data.num_classes())?;
    let model = build_model(source, data.sample_shape().dims(), classes, 0.5, 0.99)?;
    if model.output_shape().ndim() != 1 {
        // A spec's sequence model that does not start with an embedding: its
        // labels are per position, which eval's confusion matrix is not.
        return Err(Failure::usage(anyhow!(
            "--model {}: its output {} is not a class per sample; eval scores a language model that starts with an embedding",
            source.name(),
            model.output_shape()
        )));
    }
    check_model_classes(&model, a.classes, &[data])?;
    crate::train::check_data(&model, data).map_err(Failure::usage)?;
    let store = load_weights(&model, source, "--weights", &a.weights, WeightsFor::Eval)?;
    // No more devices than samples: a device with no sample has nothing to predict.
    let devices = devices.first(data.len());
    let classes = model.output_shape().numel();
    let config = TrainConfig { initial: Some(store), check_replicas_every: None, ..TrainConfig::default() };
    let all: Vec<usize> = (0..data.len()).collect();
    let (metrics, probs) = with_trainer(&model, &devices, &config, |t| {
        let m = t.evaluate(data, config.eval_batch)?;
        let p = t.predict(Batch::gather(data, &all))?;
        Ok((m, p))
    })
    .map_err(Failure::runtime)?;
    if !metrics.mean_loss().is_finite() {
        return Err(Failure::runtime(anyhow!(
            "--weights '{}': the loss on {} is {}: the weights or the data overflow, and no accuracy of them means anything",
            a.weights.display(),
            data.name(),
            metrics.mean_loss()
        )));
    }
    Ok(Evaluated { devices, classes, metrics, probabilities: probs })
}

/// Tokens a language model's evaluation takes per chunk of windows (each device's
/// forward pass holds one chunk's activations): 512 windows of the built-in GPT's 64.
const EVAL_TOKENS_PER_CHUNK: usize = 32_768;

/// `eval` of a language model: loss per token, perplexity and next-token accuracy over a
/// text's validation part (`fortunes`, `text:FILE`: the last tenth, as `train` held it
/// out), cut into consecutive windows of the model's context so that every token but the
/// last partial window's is predicted once; or over every row of a token file.
fn eval_sequences(a: &EvalArgs, source: &ModelSource, spec: &str, devices: Devices) -> CliResult {
    let (model, what) = match source {
        ModelSource::Builtin(name) => {
            let header = Header::read("--weights", &a.weights)?;
            header.language_model(*name, "--weights", &a.weights, a.heads, a.context, WeightsFor::Eval)?
        }
        ModelSource::Spec(p, s) => {
            if a.heads.is_some() || a.context.is_some() {
                return Err(Failure::usage(anyhow!(
                    "--heads and --context go with --model gpt or llama: a spec FILE.json states its own"
                )));
            }
            (s.build().map_err(Failure::usage)?, p.display().to_string())
        }
    };
    let context = model.input_shape().numel();
    let data = if is_text(spec) {
        let held = load_text_data(spec, context)?.test.expect("a text has a validation part");
        // Window i starts at i·T; the last starts where a whole window and its next
        // token still fit (held.len() windows start at 0..len).
        let starts: Vec<usize> = (0..held.len()).step_by(context).collect();
        held.subset(held.name(), &starts)
    } else if is_builtin_data(spec) {
        return Err(not_text(&source.name(), spec));
    } else {
        load_data(spec, false, a.seed, None, a.classes)?.train
    };
    check_model_classes(&model, a.classes, &[&data])?;
    crate::train::check_data(&model, &data).map_err(Failure::usage)?;
    let store = load_weights(&model, source, "--weights", &a.weights, WeightsFor::Eval)?;
    let devices = devices.first(data.len());
    let eval_batch = (EVAL_TOKENS_PER_CHUNK / context).max(1);
    let config = TrainConfig { initial: Some(store), check_replicas_every: None, eval_batch, ..TrainConfig::default() };
    let metrics =
        with_trainer(&model, &devices, &config, |t| t.evaluate(&data, eval_batch)).map_err(Failure::runtime)?;
    let loss = metrics.mean_loss();
    if !loss.is_finite() {
        return Err(Failure::runtime(anyhow!(
            "--weights '{}': the loss on {} is {loss}: the weights or the data overflow, and no accuracy of them means anything",
            a.weights.display(),
            data.name()
        )));
    }
    outln!(
        "{} ({what}, context {context}) on {}: {} windows of {context} tokens on {devices}",
        a.weights.display(),
        data.name(),
        data.len()
    );
    outln!(
        "loss per token {loss:.4} | perplexity {:.4} | next-token accuracy {:.4} ({}/{})",
        loss.exp(),
        metrics.accuracy(),
        metrics.correct,
        metrics.count
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// predict

/// Inputs per `Trainer::predict` call: bounds the activations held at once.
const PREDICT_CHUNK: usize = 1024;

/// The inputs of `predict`, their labels never read: a safetensors file's `x` (its
/// `class_names` kept, for the names printed), an IDX images file, an MNIST directory's
/// test images, or a built-in dataset's test split. Returns them and the classes they
/// suggest where the weights do not say (the names' count, else MNIST's 10).
fn load_inputs(spec: &str, flat: bool) -> CliResult<(Dataset, usize)> {
    let unlabelled = |d: Dataset| {
        let k = d.class_names().map_or(crate::data::idx::MNIST_CLASSES, <[String]>::len);
        (d, k)
    };
    if let Some(dir) = spec.strip_prefix("mnist:") {
        let images = crate::data::idx::mnist_test_images(Path::new(dir)).map_err(Failure::usage)?;
        return Ok(unlabelled(idx_inputs(&images)?));
    }
    let path = Path::new(spec);
    if !path.exists() {
        let splits = load_data(spec, flat, 0, None, None)?;
        let data = splits.test.unwrap_or(splits.train);
        let k = data.num_classes();
        return Ok((data, k));
    }
    check_input_file("--data", path)?;
    if path.extension().is_some_and(|e| e == "safetensors") {
        let data = crate::data::safetensors_file::load_safetensors_inputs(path).map_err(Failure::usage)?;
        return Ok(unlabelled(data));
    }
    Ok(unlabelled(idx_inputs(path)?))
}

/// An IDX images file as inputs: label 0 of one class, which nothing reads.
fn idx_inputs(path: &Path) -> CliResult<Dataset> {
    let (pixels, [n, h, w]) = load_idx_images(path).map_err(Failure::usage)?;
    Dataset::new(path.display().to_string(), [1, h, w], Features::U8(pixels), vec![0; n], 1).map_err(Failure::usage)
}

/// The refusal of a language model by `predict`, pointing to what does its work.
fn predict_refuses_sequences(model: &str, weights: &Path) -> Failure {
    Failure::usage(anyhow!(
        "--model {model} is a language model: its output is a next-token distribution at every position, not a class per input. Continue a text with `lockstep generate --weights {w} --prompt TEXT`; score one with `lockstep eval --weights {w} --model {model} --data text:FILE`",
        w = weights.display()
    ))
}

/// `predict`'s checks that read no input: `--limit`, the model (a classifier), the
/// devices, the weights file, `--classes`.
fn predict_checks(a: &PredictArgs) -> CliResult<(ModelSource, Devices)> {
    if a.limit == Some(0) {
        return Err(Failure::usage(anyhow!("--limit must be at least 1")));
    }
    let source = a.model.resolve()?;
    if source.is_language_model() {
        return Err(predict_refuses_sequences(&source.name(), &a.weights));
    }
    let devices = resolve_devices(&a.devices)?;
    check_input_file("--weights", &a.weights)?;
    check_classes(a.classes)?;
    Ok((source, devices))
}

pub(crate) fn cmd_predict(a: PredictArgs) -> CliResult {
    let (source, devices) = predict_checks(&a)?;
    if is_text(&a.data) {
        return Err(not_a_language_model(&source.name(), &a.data));
    }
    let (data, data_classes) = load_inputs(&a.data, source.flat())?;
    let n = a.limit.map_or(data.len(), |l| l.min(data.len()));
    let (k, probs) = predicted(&a, &source, devices, &data, data_classes, n)?;
    let names = data.class_names();
    if a.format == PredictFormat::Csv {
        let columns: Vec<String> = (0..k).map(|c| format!("p{c}")).collect();
        outln!("index,class,name,probability,{}", columns.join(","));
    }
    for (i, row) in probs.chunks_exact(k).enumerate() {
        let top = row.iter().enumerate().fold(0, |best, (c, &p)| if p > row[best] { c } else { best });
        let name = names.map(|n| n[top].as_str());
        match a.format {
            PredictFormat::Text => match name {
                Some(name) => outln!("{i}  {top}  {:.4}  {name}", row[top]),
                None => outln!("{i}  {top}  {:.4}", row[top]),
            },
            PredictFormat::Csv => {
                let all: Vec<String> = row.iter().map(f32::to_string).collect();
                outln!("{i},{top},{},{},{}", csv_cell(name.unwrap_or("")), row[top], all.join(","));
            }
            PredictFormat::Json => {
                let v = serde_json::json!({
                    "index": i,
                    "class": top,
                    "name": name,
                    "probability": row[top],
                    "probabilities": row,
                });
                outln!("{v}");
            }
        }
    }
    Ok(())
}

/// The probabilities (n × the model's k classes, and k) that the weights of `a` give the
/// first `n` inputs of `data`, run on `devices` (no more than inputs) in chunks of
/// [`PREDICT_CHUNK`]. `predict`'s work, and a host's (`cli::hosted::predict`).
pub(crate) fn predicted(
    a: &PredictArgs,
    source: &ModelSource,
    devices: Devices,
    data: &Dataset,
    data_classes: usize,
    n: usize,
) -> CliResult<(usize, Vec<f32>)> {
    let classes = model_classes(source, data.sample_shape().dims(), a.classes, &a.weights, data_classes)?;
    let model = build_model(source, data.sample_shape().dims(), classes, 0.5, 0.99)?;
    if model.output_shape().ndim() != 1 {
        return Err(predict_refuses_sequences(&source.name(), &a.weights));
    }
    check_model_classes(&model, a.classes, &[data])?;
    // The inputs' shape only: their labels, where they have any, are not predict's.
    if data.sample_shape() != model.input_shape() {
        return Err(Failure::usage(anyhow!(
            "{}: samples of shape {} do not fit the model's input {}",
            data.name(),
            data.sample_shape(),
            model.input_shape()
        )));
    }
    let store = load_weights(&model, source, "--weights", &a.weights, WeightsFor::Predict)?;
    // No more devices than inputs: every device gets at least one sample of every chunk.
    let devices = devices.first(n);
    let k = model.output_shape().numel();
    let config = TrainConfig { initial: Some(store), check_replicas_every: None, ..TrainConfig::default() };
    // ceil(n / PREDICT_CHUNK) chunks of near-equal sizes, each ≥ n / chunks ≥ the devices.
    let chunks = n.div_ceil(PREDICT_CHUNK);
    let probs = with_trainer(&model, &devices, &config, |t| {
        let mut out = Vec::with_capacity(n * k);
        for c in 0..chunks {
            let rows: Vec<usize> = (c * n / chunks..(c + 1) * n / chunks).collect();
            out.extend(t.predict(Batch::gather(data, &rows))?);
        }
        Ok(out)
    })
    .map_err(Failure::runtime)?;
    Ok((k, probs))
}

/// A CSV cell: quoted (quotes doubled) when it holds a comma, a quote or a line break.
fn csv_cell(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}
