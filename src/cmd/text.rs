//! The flags of `train` (and `generate`) for language models over text: the built-in
//! GPT's shape (`--layers`, `--heads`, `--width`, `--context`), Adam's betas, and a text
//! run's evaluation period (`--eval-every`, `--eval-batches`); which data is text
//! (`text:FILE`, `fortunes`, a token file), and the defaults of a text run, nanoGPT's
//! CPU recipe. The model is the library's (`models::gpt`), the data its
//! (`data::text`); one file, so that `train.rs` names them in one line each.

use lockstep::data::text::{load_fortunes, load_text};
use lockstep::data::Splits;
use lockstep::models::GptConfig;

use crate::*;

#[derive(Args, Clone, Debug)]
pub(crate) struct TextArgs {
    /// The GPT's blocks (nanoGPT's n_layer).
    #[arg(long, value_name = "N", default_value_t = GptConfig::default().layers)]
    pub(crate) layers: usize,
    /// The GPT's attention heads (n_head); they must divide --width.
    #[arg(long, value_name = "H", default_value_t = GptConfig::default().heads)]
    pub(crate) heads: usize,
    /// The GPT's width (n_embd).
    #[arg(long, value_name = "C", default_value_t = GptConfig::default().width)]
    pub(crate) width: usize,
    /// Tokens per window of text data and the GPT's context (block_size).
    #[arg(long, value_name = "T", default_value_t = GptConfig::default().context)]
    pub(crate) context: usize,
    /// A text run: steps between evaluations on the validation part (each one an eval
    /// line, and where checkpoints fall by default) [default: 250].
    #[arg(long, value_name = "N")]
    pub(crate) eval_every: Option<usize>,
    /// A text run: batches of --batch-size validation windows each evaluation scores,
    /// drawn once from --seed [default: 20].
    #[arg(long, value_name = "K")]
    pub(crate) eval_batches: Option<usize>,
    /// Adam's and AdamW's beta1.
    #[arg(allow_negative_numbers = true, long, value_name = "B1", default_value_t = 0.9)]
    pub(crate) adam_beta1: f32,
    /// Adam's and AdamW's beta2 [default: 0.99 for text (nanoGPT's), else 0.999 (PyTorch's)].
    #[arg(allow_negative_numbers = true, long, value_name = "B2")]
    pub(crate) adam_beta2: Option<f32>,
}

/// The clap ids of these flags, as `train` stores them in checkpoints.
pub(crate) const STORED: [&str; 8] =
    ["layers", "heads", "width", "context", "eval_every", "eval_batches", "adam_beta1", "adam_beta2"];

/// Whether `--data` names text: `fortunes`, `text:FILE`.
pub(crate) fn is_text(spec: &str) -> bool {
    spec == "fortunes" || spec.starts_with("text:")
}

impl TextArgs {
    /// The checks that need no data.
    pub(crate) fn check(&self) -> CliResult {
        for (name, v) in
            [("--layers", self.layers), ("--heads", self.heads), ("--width", self.width), ("--context", self.context)]
        {
            if v == 0 {
                return Err(Failure::usage(anyhow!("{name} must be at least 1")));
            }
        }
        if !self.width.is_multiple_of(self.heads) {
            return Err(Failure::usage(anyhow!(
                "--heads {} does not divide --width {}: each head takes width/heads channels",
                self.heads,
                self.width
            )));
        }
        for (name, v) in [("--eval-every", self.eval_every), ("--eval-batches", self.eval_batches)] {
            if v == Some(0) {
                return Err(Failure::usage(anyhow!("{name} must be at least 1")));
            }
        }
        Ok(())
    }

    /// The built-in GPT of these flags, `dropout` its rate.
    pub(crate) fn gpt(&self, vocab: usize, dropout: f32) -> GptConfig {
        GptConfig { context: self.context, vocab, layers: self.layers, heads: self.heads, width: self.width, dropout }
    }

    /// Loads text `spec` (`fortunes`, `text:FILE`) as windows of `--context` tokens.
    pub(crate) fn load(&self, spec: &str) -> CliResult<Splits> {
        let splits = match spec.strip_prefix("text:") {
            Some(file) => {
                let path = Path::new(file);
                if !path.exists() {
                    return Err(Failure::usage(anyhow!("--data '{spec}': no such file")));
                }
                load_text(path, self.context)
            }
            None => load_fortunes(self.context),
        };
        splits.map_err(|e| Failure::usage(anyhow!("--data {spec}: {e}")))
    }

    /// `config` with these settings, for a run over text (`text`) or not.
    pub(crate) fn config(&self, config: TrainConfig, text: bool) -> TrainConfig {
        match text {
            true => TrainConfig { eval_every: self.eval_every, eval_batches: self.eval_batches, ..config },
            false => config,
        }
    }

    /// The flags as a checkpoint stores them.
    pub(crate) fn stored(&self) -> Vec<(&'static str, String)> {
        let mut out = vec![
            ("layers", self.layers.to_string()),
            ("heads", self.heads.to_string()),
            ("width", self.width.to_string()),
            ("context", self.context.to_string()),
            ("adam_beta1", self.adam_beta1.to_string()),
        ];
        out.extend(self.adam_beta2.map(|b| ("adam_beta2", b.to_string())));
        out.extend(self.eval_every.map(|n| ("eval_every", n.to_string())));
        out.extend(self.eval_batches.map(|n| ("eval_batches", n.to_string())));
        out
    }
}

// ---------------------------------------------------------------------------------------
// generate

#[derive(Args, Clone, Debug)]
pub(crate) struct GenerateArgs {
    /// The trained weights (`train --save`, or a nanoGPT state_dict saved as safetensors).
    #[arg(long, value_name = "FILE")]
    weights: PathBuf,
    /// gpt (with --layers, --heads, --width, --context as trained), or a model spec FILE.json.
    #[arg(long, default_value = "gpt", value_name = "NAME|FILE.json", value_parser = parse_model_choice)]
    model: ModelChoice,
    #[command(flatten)]
    shape: TextArgs,
    /// The text to continue (its bytes are the tokens); one longer than the context is
    /// cropped to its last --context bytes, as nanoGPT crops.
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Tokens (bytes) to generate.
    #[arg(long, value_name = "N", default_value_t = 500)]
    tokens: usize,
    /// Divides the logits: below 1 is more conservative, above 1 more varied.
    #[arg(long, value_name = "T", default_value_t = 0.8)]
    temperature: f32,
    /// Draw only from the K most likely tokens [default: all].
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// Seed of the draws: the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// `lockstep generate`: prints the continuation of `--prompt`.
pub(crate) fn cmd_generate(a: GenerateArgs) -> CliResult {
    a.shape.check()?;
    let vocab = lockstep::data::text::BYTE_VOCAB;
    let mut model = match a.model.resolve()? {
        ModelSource::Builtin(ModelName::Gpt) => {
            lockstep::models::gpt(a.shape.gpt(vocab, 0.0)).map_err(Failure::usage)?
        }
        ModelSource::Builtin(other) => {
            return Err(Failure::usage(anyhow!(
                "--model {}: generate needs a language model (gpt or a spec FILE.json)",
                other.as_str()
            )))
        }
        ModelSource::Spec(_, spec) => spec.build().map_err(Failure::usage)?,
    };
    let context = model.input_shape().numel();
    if model.input_shape().ndim() != 1 || model.output_shape().ndim() != 2 {
        return Err(Failure::usage(anyhow!(
            "--model: generate needs a language model, input (T) ids and output (T, V) logits; this one maps {} to {}",
            model.input_shape(),
            model.output_shape()
        )));
    }
    check_input_file("--weights", &a.weights)?;
    let weights =
        lockstep::weights::load(&model, &a.weights).map_err(Failure::usage).map_err(|f| f.with_context("--weights"))?;
    let mut prompt: Vec<u32> = a.prompt.bytes().map(u32::from).collect();
    if prompt.is_empty() {
        return Err(Failure::usage(anyhow!("--prompt is empty: give at least one byte (the default is a newline)")));
    }
    if prompt.len() > context {
        eprintln!(
            "lockstep: the prompt's {} bytes are cropped to its last {context}, the model's context",
            prompt.len()
        );
        prompt.drain(..prompt.len() - context);
    }
    let sampling =
        lockstep::generate::Sampling { tokens: a.tokens, temperature: a.temperature, top_k: a.top_k, seed: a.seed };
    let out =
        lockstep::generate::generate(&mut model, &weights, &prompt, context, &sampling).map_err(Failure::usage)?;
    let bytes: Vec<u8> = out.iter().map(|&t| t as u8).collect();
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(&bytes)
        .and_then(|()| stdout.write_all(b"\n"))
        .map_err(|e| Failure::runtime(anyhow!("stdout: {e}")))?;
    Ok(())
}
