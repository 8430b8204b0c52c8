//! `lockstep eval` and `lockstep predict`: saved weights applied to a dataset, on every
//! device given (the samples split across them).

use super::*;

#[derive(Args, Debug)]
pub(crate) struct EvalArgs {
    /// The weights to evaluate.
    #[arg(long, value_name = "FILE")]
    weights: PathBuf,
    /// toy, convnet, convnet-nobn, or a model spec FILE.json.
    #[arg(long, default_value = "convnet", value_name = "NAME|FILE.json", value_parser = parse_model_choice)]
    model: ModelChoice,
    /// toy, toy-enlarged, digits, fashion-mnist, mnist:DIR (their test split), or a FILE.safetensors [default: the model's data]
    #[arg(long)]
    data: Option<String>,
    /// The model's number of classes [default: what the weights hold].
    #[arg(long, value_name = "K")]
    classes: Option<usize>,
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
    /// toy, convnet, convnet-nobn, or a model spec FILE.json.
    #[arg(long, default_value = "convnet", value_name = "NAME|FILE.json", value_parser = parse_model_choice)]
    model: ModelChoice,
    /// The inputs: a FILE.safetensors (its x), an IDX images file (idx3, plain or .gz; no
    /// labels needed), mnist:DIR (its t10k images), or toy, toy-enlarged, digits,
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
    let splits = load_data(&data_spec, source.flat(), a.seed, None, a.classes)?;
    // Built-in data: its test split; a file: all of it.
    let data = splits.test.unwrap_or(splits.train);
    let classes = model_classes(&source, data.sample_shape().dims(), a.classes, &a.weights, data.num_classes())?;
    let model = build_model(&source, data.sample_shape().dims(), classes, 0.5, 0.99)?;
    check_model_classes(&model, a.classes, &[&data])?;
    crate::train::check_data(&model, &data).map_err(Failure::usage)?;
    let store: ParamStore =
        weights::load(&model, &a.weights).map_err(Failure::usage).map_err(|f| f.with_context("--weights"))?;
    // No more devices than samples: a device with no sample has nothing to predict.
    let devices = devices.first(data.len());
    let classes = model.output_shape().numel();
    let config = TrainConfig { initial: Some(store), check_replicas_every: None, ..TrainConfig::default() };
    let all: Vec<usize> = (0..data.len()).collect();
    let (metrics, probs) = with_trainer(&model, &devices, &config, |t| {
        let m = t.evaluate(&data, config.eval_batch)?;
        let p = t.predict(Batch::gather(&data, &all))?;
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

// ---------------------------------------------------------------------------------------
// predict

/// Inputs per `Trainer::predict` call: bounds the activations held at once.
const PREDICT_CHUNK: usize = 1024;

/// The inputs of `predict` and whether they came with labels. An IDX images file has
/// none: its samples get label 0 of 1 class, which nothing reads.
fn load_inputs(spec: &str, flat: bool, classes: Option<usize>) -> CliResult<(Dataset, bool)> {
    let path = Path::new(spec);
    if spec.starts_with("mnist:") || !path.exists() {
        let splits = load_data(spec, flat, 0, None, classes)?;
        return Ok((splits.test.unwrap_or(splits.train), true));
    }
    check_input_file("--data", path)?;
    if path.extension().is_some_and(|e| e == "safetensors") {
        return Ok((load_dataset_file(path, classes)?, true));
    }
    let (pixels, [n, h, w]) = load_idx_images(path).map_err(Failure::usage)?;
    let data = Dataset::new(spec, [1, h, w], Features::U8(pixels), vec![0; n], 1).map_err(Failure::usage)?;
    Ok((data, false))
}

pub(crate) fn cmd_predict(a: PredictArgs) -> CliResult {
    if a.limit == Some(0) {
        return Err(Failure::usage(anyhow!("--limit must be at least 1")));
    }
    let devices = resolve_devices(&a.devices)?;
    check_input_file("--weights", &a.weights)?;
    check_classes(a.classes)?;
    let source = a.model.resolve()?;
    let (data, labelled) = load_inputs(&a.data, source.flat(), a.classes)?;
    let n = a.limit.map_or(data.len(), |l| l.min(data.len()));
    // Unlabelled images give no class count: a built-in model then takes the weights'.
    let data_classes = if labelled { data.num_classes() } else { crate::data::idx::MNIST_CLASSES };
    let classes = model_classes(&source, data.sample_shape().dims(), a.classes, &a.weights, data_classes)?;
    let model = build_model(&source, data.sample_shape().dims(), classes, 0.5, 0.99)?;
    check_model_classes(&model, a.classes, &[&data])?;
    crate::train::check_data(&model, &data).map_err(Failure::usage)?;
    let store: ParamStore =
        weights::load(&model, &a.weights).map_err(Failure::usage).map_err(|f| f.with_context("--weights"))?;
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
            out.extend(t.predict(Batch::gather(&data, &rows))?);
        }
        Ok(out)
    })
    .map_err(Failure::runtime)?;
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

/// A CSV cell: quoted (quotes doubled) when it holds a comma, a quote or a line break.
fn csv_cell(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}
