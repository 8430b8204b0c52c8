//! What a weights file is, read from its header alone (no tensor's values): which built-in
//! model its tensor names make and the sizes its shapes give, so that a file given to the
//! wrong model is answered "these weights are a gpt (…); pass --model gpt" instead of by a
//! list of every tensor that differs; and the built-in language models' shapes (the GPT's,
//! the Llama's), which `eval`, `predict` and `generate` read from the file rather than ask
//! for. Heads are a size that shapes cannot tell (a width of 128 is 4 heads of 32 or 2 of
//! 64): a file `train` saved records them in its metadata (`weights::HEADS_KEY`); a nanoGPT
//! `state_dict` needs `--heads`. A Llama's window is another (no tensor of it depends on
//! the window): its file records it (`weights::CONTEXT_KEY`), or `--context` gives it.
//!
//! Loading itself, and its list of every problem, is the library's (`weights::load`).

use std::collections::BTreeMap;

use crate::models::{GptConfig, LlamaConfig};

use super::*;

/// The most blocks a file's names may number for it to be tried as the GPT: building the
/// probe costs memory per block, and a header can name millions.
const MAX_PROBED_BLOCKS: usize = 4096;

/// A weights file's tensor shapes and metadata.
pub(crate) struct Header {
    shapes: BTreeMap<String, Vec<usize>>,
    metadata: BTreeMap<String, String>,
}

impl Header {
    /// The header of `path` (`--weights`, `--init`: `flag` names it in errors).
    pub(crate) fn read(flag: &'static str, path: &Path) -> CliResult<Header> {
        let rows = weights::inspect(path).map_err(Failure::usage).map_err(|f| f.with_context(flag))?;
        let metadata = weights::read_file(path)
            .and_then(|f| f.metadata())
            .map_err(Failure::usage)
            .map_err(|f| f.with_context(flag))?;
        Ok(Header { shapes: rows.into_iter().map(|(name, _, shape)| (name, shape)).collect(), metadata })
    }

    /// The GPT's blocks: how many distinct N its `transformer.h.N.` names number.
    fn gpt_blocks(&self) -> usize {
        self.blocks("transformer.h.")
    }

    /// The Llama's layers: how many distinct N its `layers.N.` names number.
    fn llama_layers(&self) -> usize {
        self.blocks("layers.")
    }

    /// How many distinct N the names `<prefix>N.…` number.
    fn blocks(&self, prefix: &str) -> usize {
        let blocks: BTreeSet<&str> = self
            .shapes
            .keys()
            .filter_map(|n| n.strip_prefix(prefix)?.split('.').next())
            .filter(|i| i.parse::<usize>().is_ok())
            .collect();
        blocks.len()
    }

    /// The model that `name` is with this file's sizes where they change the tensors'
    /// names (the GPT's blocks), and small sizes elsewhere: a probe of names only.
    fn probe(&self, name: ModelName) -> Option<Graph> {
        match name {
            ModelName::Toy => models::toy_mlp(2, 2).ok(),
            ModelName::Convnet | ModelName::ConvnetNobn => models::convnet(ConvnetOptions {
                norm: if name == ModelName::Convnet { Norm::BatchNorm } else { Norm::None },
                ..ConvnetOptions::default()
            })
            .ok(),
            ModelName::Resnet8 => models::resnet(ResnetDepth::Resnet8, 10).ok(),
            ModelName::Resnet20 => models::resnet(ResnetDepth::Resnet20, 10).ok(),
            ModelName::Densenet => models::densenet(&models::DensenetConfig::default()).ok(),
            ModelName::Gpt => {
                let layers = self.gpt_blocks();
                if layers == 0 || layers > MAX_PROBED_BLOCKS {
                    return None;
                }
                let probe = GptConfig { context: 1, vocab: 2, layers, heads: 1, width: 1, dropout: 0.0 };
                models::gpt(probe).ok()
            }
            ModelName::Llama => {
                let layers = self.llama_layers();
                if layers == 0 || layers > MAX_PROBED_BLOCKS {
                    return None;
                }
                models::llama(LlamaConfig { hidden: 1, ..LlamaConfig::new(1, 2, layers, 1, 2) }).ok()
            }
        }
    }

    /// Whether the file holds exactly `model`'s tensors by name: every parameter and
    /// buffer, a tied tensor under any of its names, nothing else.
    fn names_match(&self, model: &Graph) -> bool {
        let infos = model.param_infos();
        let own = |n: &str| {
            model.aliases().iter().find(|(a, _)| a == n).map_or(n.to_string(), |(_, t)| infos[*t].name.clone())
        };
        let file: BTreeSet<String> = self.shapes.keys().map(|n| own(n)).collect();
        let wanted: BTreeSet<String> = infos.iter().chain(model.buffer_infos()).map(|t| t.name.clone()).collect();
        file == wanted
    }

    /// The built-in model whose tensors the file holds, and its sizes as the file gives
    /// them, in words.
    pub(crate) fn identify(&self) -> Option<(ModelName, String)> {
        let name = ModelName::value_variants()
            .iter()
            .copied()
            .find(|&n| self.probe(n).is_some_and(|m| self.names_match(&m)))?;
        let probe = self.probe(name)?;
        // The last parameter is the classifier's bias (or the GPT's head).
        let last = probe.param_infos().last().and_then(|t| self.shapes.get(&t.name));
        let sizes = match name {
            ModelName::Gpt => self.gpt_words(),
            ModelName::Llama => self.llama_words(),
            ModelName::Toy => {
                let features = self.shapes.get(&probe.param_infos()[0].name).and_then(|s| s.get(1));
                format!("{} features, {} classes", show(features), show(last.and_then(|s| s.first())))
            }
            _ => format!("{} classes", show(last.and_then(|s| s.first()))),
        };
        Some((name, sizes))
    }

    /// The GPT's sizes in words.
    fn gpt_words(&self) -> String {
        let dims = |n: &str| self.shapes.get(n).filter(|s| s.len() == 2);
        let (wte, wpe) = (dims("transformer.wte.weight").or(dims("lm_head.weight")), dims("transformer.wpe.weight"));
        let heads = match weights::recorded_heads(Path::new(""), &self.metadata) {
            Ok(Some(h)) => format!("{} heads", h[0]),
            _ => "heads not recorded".to_string(),
        };
        let blocks = self.gpt_blocks();
        format!(
            "{blocks} block{}, width {}, context {}, vocabulary {}, {heads}",
            if blocks == 1 { "" } else { "s" },
            show(wte.map(|s| &s[1])),
            show(wpe.map(|s| &s[0])),
            show(wte.map(|s| &s[0]))
        )
    }

    /// The built-in GPT these weights are: its sizes from the shapes, its heads from the
    /// metadata, or from `--heads` (`heads`) where the file records none.
    pub(crate) fn gpt(
        &self,
        flag: &'static str,
        path: &Path,
        heads: Option<usize>,
        command: WeightsFor,
    ) -> CliResult<GptConfig> {
        let shown = path.display();
        let dims = |n: &str| self.shapes.get(n).filter(|s| s.len() == 2);
        let (Some(wte), Some(wpe)) =
            (dims("transformer.wte.weight").or(dims("lm_head.weight")), dims("transformer.wpe.weight"))
        else {
            return Err(self.not_a(flag, path, ModelName::Gpt, command).unwrap_or_else(|| {
                Failure::usage(anyhow!(
                    "{flag} '{shown}': not a gpt's weights: no tensors 'transformer.wte.weight' (V, C) and 'transformer.wpe.weight' (T, C)"
                ))
            }));
        };
        let (vocab, width, context, layers) = (wte[0], wte[1], wpe[0], self.gpt_blocks());
        let heads = self.heads(flag, path, heads, ModelName::Gpt, layers, width)?;
        Ok(GptConfig { context, vocab, layers, heads, width, dropout: 0.0 })
    }

    /// The heads of every one of a built-in model's `layers` blocks (`model`'s, one count
    /// for all), `width` wide: the file's record, or `--heads` (`given`) where it has none.
    fn heads(
        &self,
        flag: &'static str,
        path: &Path,
        given: Option<usize>,
        model: ModelName,
        layers: usize,
        width: usize,
    ) -> CliResult<usize> {
        let (shown, name) = (path.display(), model.as_str());
        let recorded = weights::recorded_heads(path, &self.metadata).map_err(Failure::usage)?;
        let heads = match (recorded, given) {
            (Some(r), given) => {
                let h = r[0];
                if r.iter().any(|&x| x != h) || r.len() != layers {
                    return Err(Failure::usage(anyhow!(
                        "{flag} '{shown}': the file records attention heads {r:?} for {layers} blocks: the built-in {name} has one head count for every block; give its spec as --model FILE.json"
                    )));
                }
                if let Some(g) = given.filter(|&g| g != h) {
                    return Err(Failure::usage(anyhow!(
                        "--heads {g} disagrees with {flag} '{shown}', trained with {h} heads (its metadata records them): leave --heads out"
                    )));
                }
                h
            }
            (None, Some(g)) => g,
            (None, None) => {
                return Err(Failure::usage(anyhow!(
                    "{flag} '{shown}' does not record its attention heads (a file lockstep did not save, such as a PyTorch state_dict), and shapes cannot tell them: pass --heads H as it was trained"
                )))
            }
        };
        if heads == 0 || !width.is_multiple_of(heads) {
            return Err(Failure::usage(anyhow!(
                "--heads {heads} does not divide the width {width} of {flag} '{shown}': each head takes width/heads channels"
            )));
        }
        Ok(heads)
    }

    /// The Llama's sizes in words.
    fn llama_words(&self) -> String {
        let dims = |n: &str| self.shapes.get(n).filter(|s| s.len() == 2);
        let (tok, w1) = (dims("tok_embeddings.weight"), dims("layers.0.feed_forward.w1.weight"));
        let heads = match weights::recorded_heads(Path::new(""), &self.metadata) {
            Ok(Some(h)) => format!("{} heads", h[0]),
            _ => "heads not recorded".to_string(),
        };
        let context = match weights::recorded_context(Path::new(""), &self.metadata) {
            Ok(Some(t)) => format!("context {t}"),
            _ => "context not recorded".to_string(),
        };
        let layers = self.llama_layers();
        format!(
            "{layers} layer{}, width {}, feed-forward {}, {context}, vocabulary {}, {heads}",
            if layers == 1 { "" } else { "s" },
            show(tok.map(|s| &s[1])),
            show(w1.map(|s| &s[0])),
            show(tok.map(|s| &s[0]))
        )
    }

    /// The built-in Llama these weights are: its sizes from the shapes (the feed-forward's
    /// width from `w1`'s, whatever rule made it), its heads and window from the metadata,
    /// or from `--heads` and `--context` (`heads`, `context`) where the file records none.
    pub(crate) fn llama(
        &self,
        flag: &'static str,
        path: &Path,
        heads: Option<usize>,
        context: Option<usize>,
        command: WeightsFor,
    ) -> CliResult<LlamaConfig> {
        let shown = path.display();
        let dims = |n: &str| self.shapes.get(n).filter(|s| s.len() == 2);
        let (Some(tok), Some(w1)) = (dims("tok_embeddings.weight"), dims("layers.0.feed_forward.w1.weight")) else {
            return Err(self.not_a(flag, path, ModelName::Llama, command).unwrap_or_else(|| {
                Failure::usage(anyhow!(
                    "{flag} '{shown}': not a llama's weights: no tensors 'tok_embeddings.weight' (V, C) and 'layers.0.feed_forward.w1.weight' (F, C)"
                ))
            }));
        };
        let (vocab, width, hidden, layers) = (tok[0], tok[1], w1[0], self.llama_layers());
        let heads = self.heads(flag, path, heads, ModelName::Llama, layers, width)?;
        let recorded = weights::recorded_context(path, &self.metadata).map_err(Failure::usage)?;
        let context = match (recorded, context) {
            (Some(t), Some(g)) if g != t => {
                return Err(Failure::usage(anyhow!(
                    "--context {g} disagrees with {flag} '{shown}', trained over windows of {t} (its metadata records them): leave --context out"
                )))
            }
            (Some(t), _) => t,
            (None, Some(g)) => g,
            (None, None) => {
                return Err(Failure::usage(anyhow!(
                    "{flag} '{shown}' does not record its window (a file lockstep did not save, such as a PyTorch state_dict), and no tensor's shape holds it: pass --context T as it was trained"
                )))
            }
        };
        if context == 0 {
            return Err(Failure::usage(anyhow!("--context must be at least 1")));
        }
        Ok(LlamaConfig { hidden, ..LlamaConfig::new(context, vocab, layers, heads, width) })
    }

    /// The built-in language model `name` (the gpt or the llama) these weights are, and
    /// its sizes in words: `heads` and `context` are `--heads` and `--context`, for a file
    /// that does not record them.
    pub(crate) fn language_model(
        &self,
        name: ModelName,
        flag: &'static str,
        path: &Path,
        heads: Option<usize>,
        context: Option<usize>,
        command: WeightsFor,
    ) -> CliResult<(Graph, String)> {
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        match name {
            ModelName::Gpt => {
                if context.is_some() {
                    return Err(Failure::usage(anyhow!(
                        "--context goes with --model llama: a gpt's window is its position table's length, read from the file"
                    )));
                }
                let g = self.gpt(flag, path, heads, command)?;
                let what = format!(
                    "gpt: {} block{}, width {}, {} heads, vocabulary {}",
                    g.layers,
                    plural(g.layers),
                    g.width,
                    g.heads,
                    g.vocab
                );
                Ok((models::gpt(g).map_err(Failure::usage)?, what))
            }
            ModelName::Llama => {
                let l = self.llama(flag, path, heads, context, command)?;
                let what = format!(
                    "llama: {} layer{}, width {}, feed-forward {}, {} heads, vocabulary {}",
                    l.layers,
                    plural(l.layers),
                    l.width,
                    l.hidden,
                    l.heads,
                    l.vocab
                );
                Ok((models::llama(l).map_err(Failure::usage)?, what))
            }
            other => Err(Failure::usage(anyhow!(
                "--model {}: not a language model (gpt, llama, or a spec FILE.json)",
                other.as_str()
            ))),
        }
    }

    /// The refusal of weights that are another built-in model than `asked` (for
    /// `command`), naming what they are; None when they are not another one.
    fn not_a(&self, flag: &'static str, path: &Path, asked: ModelName, command: WeightsFor) -> Option<Failure> {
        let (name, sizes) = self.identify().filter(|(n, _)| *n != asked)?;
        Some(wrong_model(flag, path, &name, &sizes, asked.as_str(), command))
    }
}

/// The command a weights file is given to, for the advice of [`load_weights`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum WeightsFor {
    Train,
    Eval,
    Predict,
    Generate,
}

fn show(v: Option<&usize>) -> String {
    v.map_or_else(|| "?".to_string(), usize::to_string)
}

fn wrong_model(flag: &str, path: &Path, name: &ModelName, sizes: &str, asked: &str, command: WeightsFor) -> Failure {
    let shown = path.display();
    let advice = match (command, name) {
        (WeightsFor::Generate, n) if !n.is_language_model() => {
            "generate continues text with a language model's weights (a gpt's or a llama's)".to_string()
        }
        (WeightsFor::Predict, n) if n.is_language_model() => {
            format!(
                "predict classifies; a {} continues text: lockstep generate --model {} --weights {}",
                n.as_str(),
                n.as_str(),
                path.display()
            )
        }
        _ => format!("pass --model {}", name.as_str()),
    };
    Failure::usage(anyhow!(
        "{flag} '{shown}': these weights are a {} ({sizes}; read from the file), not a {asked}: {advice}",
        name.as_str()
    ))
}

/// Loads `path` (given as `flag`) into `model`, built from `source`. Weights of another
/// built-in model are refused by naming what they are and the `--model` to pass; a gpt
/// of other sizes than `train`'s flags, by the flags that build it; anything else by the
/// library's list of every problem.
pub(crate) fn load_weights(
    model: &Graph,
    source: &ModelSource,
    flag: &'static str,
    path: &Path,
    command: WeightsFor,
) -> CliResult<ParamStore> {
    let err = match weights::load(model, path) {
        Ok(store) => return Ok(store),
        Err(e @ crate::Error::WeightsMismatch { .. }) => e,
        Err(e) => return Err(Failure::usage(e).with_context(flag)),
    };
    let fallback = || Failure::usage(err).with_context(flag);
    let Ok(header) = Header::read(flag, path) else { return Err(fallback()) };
    let Some((name, sizes)) = header.identify() else { return Err(fallback()) };
    let asked = match source {
        ModelSource::Builtin(n) if *n == name => {
            // The same model of other sizes: only train's language models take their
            // sizes from flags.
            if !name.is_language_model() || command != WeightsFor::Train {
                return Err(fallback());
            }
            let flags = match name {
                ModelName::Gpt => {
                    let Ok(g) = header.gpt(flag, path, None, command) else { return Err(fallback()) };
                    format!("--layers {} --width {} --context {} --heads {}", g.layers, g.width, g.context, g.heads)
                }
                _ => {
                    // A Llama's weights fit any window: the flags that change its tensors.
                    let context = weights::recorded_context(path, &header.metadata).ok().flatten().or(Some(1));
                    let Ok(l) = header.llama(flag, path, None, context, command) else { return Err(fallback()) };
                    format!("--layers {} --width {} --heads {}", l.layers, l.width, l.heads)
                }
            };
            return Err(Failure::usage(anyhow!(
                "{flag} '{}': these weights are a {} ({sizes}; read from the file), not the one the flags build: pass {flags}",
                path.display(),
                name.as_str()
            )));
        }
        // A model of the file's very names (a spec of the built-in GPT) is the right one
        // with other sizes or heads: the library's list names them.
        _ if header.names_match(model) => return Err(fallback()),
        ModelSource::Builtin(n) => n.as_str().to_string(),
        ModelSource::Spec(p, _) => format!("model of {}", p.display()),
    };
    Err(wrong_model(flag, path, &name, &sizes, &asked, command))
}
