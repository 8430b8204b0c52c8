//! Language models over text on the command line: `train`'s flags of the built-in GPT's
//! and Llama's shape (`--layers`, `--heads`, `--width`, `--context`, which is also the
//! windows of text data); which data is text (`text:FILE`, `fortunes`), how it is loaded,
//! and what a language model given other data is told; and `generate`, which reads the
//! model's shape from its weights (`identify`). A text run's evaluation period and Adam's
//! betas are `train`'s own flags (its length and its optimiser), and nanoGPT's defaults of
//! a text run are `train`'s settings. The models are the library's (`models::gpt`,
//! `models::llama`), the data its (`data::text`); one file, so that `train.rs` names them
//! in one line each.

use crate::data::text::{load_fortunes, load_text};
use crate::data::Splits;
use crate::models::{GptConfig, LlamaConfig};
use serde::{Deserialize, Serialize};

use super::*;

/// The built-in GPT's and Llama's shape: a group of its own in `train -h`, stored as
/// data in a training run's checkpoints.
#[derive(Args, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[command(next_help_heading = "The built-in GPT's and Llama's shape")]
#[serde(deny_unknown_fields)]
pub(crate) struct GptArgs {
    /// The GPT's blocks (nanoGPT's n_layer), the Llama's layers (n_layers).
    #[arg(long, value_name = "N", default_value_t = GptConfig::default().layers)]
    pub(crate) layers: usize,
    /// The attention heads (n_head); they must divide --width (the Llama's into heads of an even width).
    #[arg(long, value_name = "H", default_value_t = GptConfig::default().heads)]
    pub(crate) heads: usize,
    /// The width (n_embd; the Llama's dim, its feed-forward Meta's 8/3 of it rounded up to a multiple of 256).
    #[arg(long, value_name = "C", default_value_t = GptConfig::default().width)]
    pub(crate) width: usize,
    /// Tokens per window of text data and the model's context (block_size, max_seq_len).
    #[arg(long, value_name = "T", default_value_t = GptConfig::default().context)]
    pub(crate) context: usize,
}

/// Whether `--data` names text: `fortunes`, `text:FILE`.
pub(crate) fn is_text(spec: &str) -> bool {
    spec == "fortunes" || spec.starts_with("text:")
}

impl GptArgs {
    /// The checks that need no data: every size in 1..=2^20 (a spec's bound on a size,
    /// `spec::MAX_DIM`), the heads dividing the width.
    pub(crate) fn check(&self) -> CliResult {
        for (name, v) in
            [("--layers", self.layers), ("--heads", self.heads), ("--width", self.width), ("--context", self.context)]
        {
            if v == 0 {
                return Err(Failure::usage(anyhow!("{name} must be at least 1")));
            }
            if v as u64 > crate::spec::MAX_DIM {
                return Err(Failure::usage(anyhow!(
                    "{name} {v} is more than {}, the largest size of a model (as in a model spec)",
                    crate::spec::MAX_DIM
                )));
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

    /// The built-in Llama of these flags (no dropout: Meta's has none).
    pub(crate) fn llama(&self, vocab: usize) -> LlamaConfig {
        LlamaConfig::new(self.context, vocab, self.layers, self.heads, self.width)
    }

    /// Loads text `spec` (`fortunes`, `text:FILE`) as windows of `--context` tokens.
    pub(crate) fn load(&self, spec: &str) -> CliResult<Splits> {
        load_text_data(spec, self.context)
    }
}

/// Text `spec` (`fortunes`, `text:FILE`) as windows of `context` tokens, its training and
/// validation parts (the first nine tenths by position, and the rest).
pub(crate) fn load_text_data(spec: &str, context: usize) -> CliResult<Splits> {
    let splits = match spec.strip_prefix("text:") {
        Some(file) => {
            let path = Path::new(file);
            if !path.exists() {
                return Err(Failure::usage(anyhow!("--data '{spec}': no such file")));
            }
            load_text(path, context)
        }
        None => load_fortunes(context),
    };
    splits.map_err(|e| Failure::usage(anyhow!("--data {spec}: {e}")))
}

/// Whether `--data` names one of the built-in datasets of images or points (or an
/// MNIST directory): data no language model reads.
pub(crate) fn is_builtin_data(spec: &str) -> bool {
    matches!(spec, "toy" | "toy-enlarged" | "digits" | "fashion-mnist") || spec.starts_with("mnist:")
}

/// The refusal of data that is not a language model's: what such a model trains on.
pub(crate) fn not_text(model: &str, spec: &str) -> Failure {
    Failure::usage(anyhow!(
        "--data {spec}: the {model} model is a language model, which reads text: --data fortunes, text:FILE, or a token file (FILE.safetensors holding 'tokens')"
    ))
}

/// The refusal of text for a model that does not read it.
pub(crate) fn not_a_language_model(model: &str, spec: &str) -> Failure {
    Failure::usage(anyhow!(
        "--data {spec} is text, which a language model reads (--model gpt, llama, or a spec FILE.json that starts with an embedding); the {model} model does not"
    ))
}

// ---------------------------------------------------------------------------------------
// generate

#[derive(Args, Clone, Debug)]
pub(crate) struct GenerateArgs {
    /// The trained weights (`train --save`, or a PyTorch state_dict saved as safetensors).
    #[arg(long, value_name = "FILE")]
    weights: PathBuf,
    /// gpt or llama (its sizes read from --weights), or a model spec FILE.json.
    #[arg(long, default_value = "gpt", value_name = "NAME|FILE.json", value_parser = parse_model_choice)]
    model: ModelChoice,
    /// The gpt's or llama's attention heads, for weights that do not record them (a
    /// PyTorch state_dict); a file `train` saved records its own [default: the file's].
    #[arg(long, value_name = "H")]
    heads: Option<usize>,
    /// The llama's window, for weights that do not record it (a PyTorch state_dict); a
    /// file `train` saved records its own [default: the file's].
    #[arg(long, value_name = "T")]
    context: Option<usize>,
    /// The text to continue (its bytes are the tokens); one longer than the model's context
    /// is cropped to its last context bytes, as nanoGPT crops.
    #[arg(long, default_value = "\n")]
    prompt: String,
    #[arg(long, value_name = "N", default_value_t = 500, help = tokens_help())]
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

/// `generate --tokens`'s help, its bound the library's.
fn tokens_help() -> String {
    format!("Tokens (bytes) to generate, each printed as it is drawn; at most {}", crate::generate::MAX_TOKENS)
}

/// `lockstep generate`: prints the continuation of `--prompt`, each byte as it is drawn.
pub(crate) fn cmd_generate(a: GenerateArgs) -> CliResult {
    // Each byte is written and flushed as it is drawn: a long generation shows itself
    // going. A reader that has gone (`| head -c 100`) ends the generation, not the
    // program's exit status.
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    let mut closed = false;
    let mut write = |bytes: &[u8]| -> crate::Result<()> {
        match stdout.write_all(bytes).and_then(|()| stdout.flush()) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                closed = true;
                Err(crate::Error::config("stdout", "closed"))
            }
            r => r.map_err(|e| crate::Error::io("stdout", e)),
        }
    };
    match generated(&a, &mut write) {
        Err(_) if closed => Ok(()),
        r => r,
    }
}

/// The text `a` asks for, each byte handed to `write` as it is drawn, then a newline:
/// `generate`'s work, and a host's (`cli::hosted::generate`).
pub(crate) fn generated(a: &GenerateArgs, write: &mut dyn FnMut(&[u8]) -> crate::Result<()>) -> CliResult {
    use super::identify::{load_weights, Header, WeightsFor};
    use crate::generate::MAX_TOKENS;
    if a.tokens > MAX_TOKENS {
        return Err(Failure::usage(anyhow!(
            "--tokens {} is more than {MAX_TOKENS}, the most one generate prints (each token is a forward pass over the window)",
            a.tokens
        )));
    }
    let source = a.model.resolve()?;
    if (a.heads.is_some() || a.context.is_some()) && matches!(source, ModelSource::Spec(..)) {
        return Err(Failure::usage(anyhow!(
            "--heads and --context go with --model gpt or llama: a spec FILE.json states its own"
        )));
    }
    check_input_file("--weights", &a.weights)?;
    let mut model = match &source {
        ModelSource::Builtin(name) if name.is_language_model() => {
            let header = Header::read("--weights", &a.weights)?;
            header.language_model(*name, "--weights", &a.weights, a.heads, a.context, WeightsFor::Generate)?.0
        }
        ModelSource::Builtin(other) => {
            return Err(Failure::usage(anyhow!(
                "--model {}: generate needs a language model (gpt, llama or a spec FILE.json)",
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
    let weights = load_weights(&model, &source, "--weights", &a.weights, WeightsFor::Generate)?;
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
    let drawn = crate::generate::generate(&mut model, &weights, &prompt, context, &sampling, |t| write(&[t as u8]))
        .and_then(|()| write(b"\n"));
    drawn.map_err(Failure::from)
}
