//! The flags that `train` and `generate` share for language models over text: the
//! built-in GPT's shape (`--layers`, `--heads`, `--width`, `--context`, which is also the
//! windows of text data); which data is text (`text:FILE`, `fortunes`), and how it is
//! loaded; and `generate` itself. A text run's evaluation period and Adam's betas are
//! `train`'s own flags (its length and its optimiser), and nanoGPT's defaults of a text
//! run are `train`'s settings. The model is the library's (`models::gpt`), the data its
//! (`data::text`); one file, so that `train.rs` names them in one line each.

use crate::data::text::{load_fortunes, load_text};
use crate::data::Splits;
use crate::models::GptConfig;
use serde::{Deserialize, Serialize};

use super::*;

/// The built-in GPT's shape: a group of its own in the help (`train -h`, `generate -h`),
/// stored as data in a training run's checkpoints.
#[derive(Args, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[command(next_help_heading = "The built-in GPT's shape")]
#[serde(deny_unknown_fields)]
pub(crate) struct GptArgs {
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
}

/// Whether `--data` names text: `fortunes`, `text:FILE`.
pub(crate) fn is_text(spec: &str) -> bool {
    spec == "fortunes" || spec.starts_with("text:")
}

impl GptArgs {
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
    // Last: its help heading goes on to the flags after it.
    #[command(flatten)]
    shape: GptArgs,
}

/// `lockstep generate`: prints the continuation of `--prompt`.
pub(crate) fn cmd_generate(a: GenerateArgs) -> CliResult {
    a.shape.check()?;
    let vocab = crate::data::text::BYTE_VOCAB;
    let mut model = match a.model.resolve()? {
        ModelSource::Builtin(ModelName::Gpt) => crate::models::gpt(a.shape.gpt(vocab, 0.0)).map_err(Failure::usage)?,
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
        crate::weights::load(&model, &a.weights).map_err(Failure::usage).map_err(|f| f.with_context("--weights"))?;
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
        crate::generate::Sampling { tokens: a.tokens, temperature: a.temperature, top_k: a.top_k, seed: a.seed };
    let out = crate::generate::generate(&mut model, &weights, &prompt, context, &sampling).map_err(Failure::usage)?;
    let bytes: Vec<u8> = out.iter().map(|&t| t as u8).collect();
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(&bytes)
        .and_then(|()| stdout.write_all(b"\n"))
        .map_err(|e| Failure::runtime(anyhow!("stdout: {e}")))?;
    Ok(())
}
