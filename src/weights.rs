//! Weights interchange: parameters AND buffers as safetensors, PyTorch layouts and names
//! (see `models` for the mapping of the seed models).
//!
//! Loading is all or nothing: every missing, unexpected, wrong-shape or wrong-dtype
//! tensor is reported by name in one error, and the store is only built when there is
//! none. F32, BF16 and F16 tensors load (what `model.to(torch.bfloat16)` or `.half()`
//! saves), converted to f32 exactly (every bf16 and f16 value is an f32); training runs
//! in f32 whatever was loaded. Saving writes f32, or bf16 / f16 rounded to nearest even as
//! PyTorch's `tensor.to(torch.bfloat16)` / `.to(torch.float16)` round ([`SaveDtype`]; NaN
//! becomes the quiet NaN, values past the format's range ±∞, as there).
//!
//! A file's metadata records what its shapes cannot say: the head count of every
//! attention layer ([`HEADS_KEY`]; a width of 128 is 4 heads of 32 or 2 of 64, the same
//! tensors either way), and the window a model of rotary positions was trained over
//! ([`CONTEXT_KEY`]; no tensor of a Llama depends on it). Loading into a model of other
//! heads is refused where the file records them; a file without the entry (a nanoGPT
//! `state_dict`) loads as before. The window is a record for the loader's builder (the
//! command line builds the Llama at it), not a condition: rotations of any window load.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
use crate::nn::{Graph, Init, ParamStore, TensorInfo};
use crate::safetensors_io::{self, MappedFile, TensorData};
use crate::wire::{bf16_bits, bf16_value, fp16_bits, fp16_value};

/// The metadata key of the attention layers' head counts, in the model's order, joined
/// by commas (`"4,4,4,4"` for the built-in GPT's four blocks); absent when the model
/// has no attention layer.
pub const HEADS_KEY: &str = "attention_heads";

/// The metadata key of the window (T positions) a model with rotary position
/// embeddings was trained over, a decimal count; absent when the model has no rotary
/// embedding (a position table's length is a shape, and a shape is in the file already).
pub const CONTEXT_KEY: &str = "context";

/// The head count of every attention layer of `model`, in order (inside residual
/// blocks too), as each layer writes itself back as a spec (`Layer::spec`), and a
/// scaled dot-product attention's from its input (H, T, D); a layer of the user's own,
/// which has no spec form, is not looked into.
pub fn attention_heads(model: &Graph) -> Vec<usize> {
    fn walk(v: &serde_json::Value, out: &mut Vec<usize>) {
        match v {
            serde_json::Value::Object(m) => {
                if m.get("type").and_then(|t| t.as_str()) == Some("causal_self_attention") {
                    out.extend(m.get("heads").and_then(serde_json::Value::as_u64).map(|h| h as usize));
                }
                m.values().for_each(|v| walk(v, out));
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut heads = Vec::new();
    for (l, shapes) in model.layers().iter().zip(model.layer_shapes()) {
        match l.spec() {
            Some(spec) if spec_type(&spec) == Some(SDPA_TYPE) => heads.extend(shapes.input.dims().first()),
            Some(spec) => walk(&spec, &mut heads),
            None => {}
        }
    }
    heads
}

/// The spec type of a scaled dot-product attention, whose samples are (H, T, D).
const SDPA_TYPE: &str = "scaled_dot_product_attention";

/// The spec type of a rotary embedding, whose samples are (T, H, D).
const ROTARY_TYPE: &str = "rotary_embedding";

/// The `type` of a layer's spec form.
fn spec_type(spec: &serde_json::Value) -> Option<&str> {
    spec.get("type").and_then(serde_json::Value::as_str)
}

/// The window [`CONTEXT_KEY`] records for `model`: the positions its rotary embeddings
/// turn (per-sample (T, H, D); the largest T where they differ); None without one.
pub fn rotary_context(model: &Graph) -> Option<usize> {
    let rotary = |l: &dyn crate::nn::Layer| l.spec().is_some_and(|s| spec_type(&s) == Some(ROTARY_TYPE));
    let windows = model.layers().iter().zip(model.layer_shapes()).filter(|(l, _)| rotary(&***l));
    windows.filter_map(|(_, s)| s.input.dims().first().copied()).max()
}

/// The window a file's metadata records ([`CONTEXT_KEY`]): None when it records none, an
/// error when the entry is not a positive integer.
pub fn recorded_context(path: &Path, metadata: &BTreeMap<String, String>) -> Result<Option<usize>> {
    let Some(text) = metadata.get(CONTEXT_KEY) else { return Ok(None) };
    match text.trim().parse::<usize>() {
        Ok(t) if t > 0 => Ok(Some(t)),
        _ => {
            Err(Error::format(path, format!("metadata {CONTEXT_KEY} = '{text}' is not a window (a positive integer)")))
        }
    }
}

/// The head counts a file's metadata records ([`HEADS_KEY`]): None when it records
/// none, an error when the entry is not a list of positive integers.
pub fn recorded_heads(path: &Path, metadata: &BTreeMap<String, String>) -> Result<Option<Vec<usize>>> {
    let Some(text) = metadata.get(HEADS_KEY) else { return Ok(None) };
    let heads: Option<Vec<usize>> =
        text.split(',').map(|h| h.trim().parse::<usize>().ok().filter(|&h| h > 0)).collect();
    match heads {
        Some(h) if !h.is_empty() => Ok(Some(h)),
        _ => Err(Error::format(
            path,
            format!(
                "metadata {HEADS_KEY} = '{text}' is not a list of head counts (positive integers joined by commas)"
            ),
        )),
    }
}

fn heads_text(heads: &[usize]) -> String {
    heads.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// The dtype a weights file is written in (`--save-dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveDtype {
    F32,
    /// bfloat16, rounded to nearest even.
    Bf16,
    /// IEEE half precision, rounded to nearest even.
    F16,
}

impl SaveDtype {
    /// The safetensors dtype.
    fn dtype(self) -> Dtype {
        match self {
            SaveDtype::F32 => Dtype::F32,
            SaveDtype::Bf16 => Dtype::BF16,
            SaveDtype::F16 => Dtype::F16,
        }
    }

    /// Little-endian bytes of `values` in this dtype.
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            SaveDtype::F32 => le_bytes(values),
            SaveDtype::Bf16 => values.iter().flat_map(|&v| bf16_bits(v).to_le_bytes()).collect(),
            SaveDtype::F16 => values.iter().flat_map(|&v| fp16_bits(v).to_le_bytes()).collect(),
        }
    }
}

fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Serialises `(name, shape, values)` triples as safetensors bytes (f32), in that order,
/// with `metadata`: the same inputs give the same bytes.
pub fn to_safetensors_bytes(
    tensors: &[(String, Vec<usize>, &[f32])],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, v)| le_bytes(v)).collect();
    let views: Vec<TensorData<'_>> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), data)| TensorData { name, dtype: Dtype::F32, shape, data })
        .collect();
    safetensors_io::serialize(&views, metadata)
}

/// Saves every parameter and buffer of `model` from `store` to `path` (atomically), f32,
/// in the model's order: the same weights always make the same file.
pub fn save(model: &Graph, store: &ParamStore, path: &Path) -> Result<()> {
    save_as(model, store, path, SaveDtype::F32)
}

/// [`save`] in `dtype` (bf16 and f16 rounded to nearest even, as PyTorch rounds).
pub fn save_as(model: &Graph, store: &ParamStore, path: &Path, dtype: SaveDtype) -> Result<()> {
    write_atomic(path, &file_bytes(model, store, dtype)?)
}

/// The bytes [`save`] writes: what a host program (`cli::hosted`) is handed instead of a
/// file.
pub fn to_safetensors_file_bytes(model: &Graph, store: &ParamStore) -> Result<Vec<u8>> {
    file_bytes(model, store, SaveDtype::F32)
}

/// The bytes of a weights file of `model`'s tensors from `store`, in `dtype`.
fn file_bytes(model: &Graph, store: &ParamStore, dtype: SaveDtype) -> Result<Vec<u8>> {
    let mut named = Vec::new();
    for (infos, flat) in [(model.param_infos(), &store.params), (model.buffer_infos(), &store.buffers)] {
        for t in infos {
            let values = &flat[t.range.clone()];
            named.push(match t.init {
                // A count is PyTorch's int64 (`num_batches_tracked`), whatever the dtype.
                Init::Count => (t.name.as_str(), t.shape.dims(), Dtype::I64, count_bytes(values)),
                _ => (t.name.as_str(), t.shape.dims(), dtype.dtype(), dtype.encode(values)),
            });
        }
    }
    // A tied tensor under its other name too, as PyTorch's `state_dict` lists both.
    for (alias, t) in model.aliases() {
        let t = &model.param_infos()[*t];
        named.push((alias.as_str(), t.shape.dims(), dtype.dtype(), dtype.encode(&store.params[t.range.clone()])));
    }
    let tensors: Vec<TensorData<'_>> =
        named.iter().map(|(name, shape, dtype, data)| TensorData { name, dtype: *dtype, shape, data }).collect();
    let mut meta =
        BTreeMap::from([("format".to_string(), "pt".to_string()), ("producer".to_string(), "lockstep".to_string())]);
    let heads = attention_heads(model);
    if !heads.is_empty() {
        meta.insert(HEADS_KEY.to_string(), heads_text(&heads));
    }
    if let Some(t) = rotary_context(model) {
        meta.insert(CONTEXT_KEY.to_string(), t.to_string());
    }
    safetensors_io::serialize(&tensors, &meta)
}

/// A count's values as int64 little-endian bytes, each rounded to its integer.
fn count_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|&v| (v.round_ties_even() as i64).to_le_bytes()).collect()
}

/// The values of an integer tensor view (I64, I32) as f32, for a count: None for another
/// dtype, or a value past 2^24 (beyond which f32 does not count by ones).
fn count_values(view: &TensorView<'_>) -> Option<Vec<f32>> {
    let ints: Vec<i64> = match view.dtype() {
        Dtype::I64 => view.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect(),
        Dtype::I32 => {
            view.data().chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64).collect()
        }
        _ => return None,
    };
    ints.iter().all(|v| (0..=1 << 24).contains(v)).then(|| ints.iter().map(|&v| v as f32).collect())
}

/// Maps a safetensors file after checking its header length (see `safetensors_io`).
pub fn read_file(path: &Path) -> Result<MappedFile> {
    safetensors_io::map_file(path)
}

/// Parses safetensors bytes, naming the file on error.
pub fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    safetensors_io::check_keys(path, bytes)?;
    SafeTensors::deserialize(bytes).map_err(|e| Error::format(path, format!("not a valid safetensors file: {e}")))
}

/// f32 values of a tensor view (little-endian bytes).
pub fn f32_values(view: &TensorView<'_>) -> Vec<f32> {
    view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// The first value of `values` that is NaN or infinite, with its index.
pub fn first_non_finite(values: &[f32]) -> Option<(usize, f32)> {
    values.iter().position(|v| !v.is_finite()).map(|i| (i, values[i]))
}

/// The values of an F32, BF16 or F16 tensor view as f32 (exact: every bf16 and f16 value
/// is an f32); `None` for any other dtype.
pub fn float_values(view: &TensorView<'_>) -> Option<Vec<f32>> {
    let halves = || view.data().chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    match view.dtype() {
        Dtype::F32 => Some(f32_values(view)),
        Dtype::BF16 => Some(halves().map(bf16_value).collect()),
        Dtype::F16 => Some(halves().map(fp16_value).collect()),
        _ => None,
    }
}

/// Loads weights (F32, BF16 or F16) for `model` from `path`. Every problem is listed in
/// one error: a missing, unexpected, mis-shaped or mis-typed tensor, and a tensor holding
/// NaN or an infinity (named with the index of its first such value: weights like that
/// train to NaN, and evaluate to a chance accuracy that looks like a result), and
/// attention heads other than the file records ([`HEADS_KEY`]).
pub fn load(model: &Graph, path: &Path) -> Result<ParamStore> {
    let file = read_file(path)?;
    let st = file.parse()?;
    let mut problems = Vec::new();
    if let Some(recorded) = recorded_heads(path, &file.metadata()?)? {
        let heads = attention_heads(model);
        if recorded != heads {
            problems.push(format!(
                "the file records attention heads {} ({HEADS_KEY}), the model has {}",
                heads_text(&recorded),
                if heads.is_empty() { "no attention layer".to_string() } else { heads_text(&heads) }
            ));
        }
    }
    let mut store = ParamStore { params: vec![0.0; model.params_len()], buffers: vec![0.0; model.buffers_len()] };
    let expected: Vec<(&TensorInfo, bool)> =
        model.param_infos().iter().map(|t| (t, true)).chain(model.buffer_infos().iter().map(|t| (t, false))).collect();
    // A tied tensor loads from its own name or from any alias (a file written by
    // safetensors' `save_model` keeps one name of a shared tensor); where the file holds
    // several, they must agree.
    let names_of = |i: usize, info: &TensorInfo| -> Vec<String> {
        let aliases = model.aliases().iter().filter(|(_, t)| *t == i).map(|(a, _)| a.clone());
        std::iter::once(info.name.clone()).chain(aliases).collect()
    };
    for (i, (info, is_param)) in expected.iter().enumerate() {
        let names = if *is_param { names_of(i, info) } else { vec![info.name.clone()] };
        let present: Vec<&String> = names.iter().filter(|n| st.tensor(n).is_ok()).collect();
        if let [first, rest @ ..] = present.as_slice() {
            let bytes = |n: &str| st.tensor(n).map(|v| (v.dtype(), v.shape().to_vec(), v.data().to_vec())).ok();
            for other in rest {
                if bytes(first) != bytes(other) {
                    problems.push(format!("tensor '{other}' differs from '{first}', the tensor it is tied to"));
                }
            }
        }
        let name = present.first().map_or(info.name.as_str(), |n| n.as_str());
        match st.tensor(name) {
            Err(_) => problems.push(format!("missing tensor '{}' {}", info.name, info.shape)),
            Ok(view) => match float_values(&view)
                .or_else(|| (info.init == Init::Count).then(|| count_values(&view)).flatten())
            {
                None if info.init == Init::Count => problems.push(format!(
                    "tensor '{}' has dtype {:?}, expected I64, I32 or a float (a count in 0..=2^24)",
                    info.name,
                    view.dtype()
                )),
                None => problems.push(format!(
                    "tensor '{}' has dtype {:?}, expected F32, BF16 or F16",
                    info.name,
                    view.dtype()
                )),
                Some(_) if view.shape() != info.shape.dims() => problems.push(format!(
                    "tensor '{}' has shape {:?}, expected {}",
                    info.name,
                    view.shape(),
                    info.shape
                )),
                Some(values) => match first_non_finite(&values) {
                    Some((i, v)) => problems.push(format!("tensor '{}' holds {v} at index {i}", info.name)),
                    None => {
                        let dst = if *is_param { &mut store.params } else { &mut store.buffers };
                        dst[info.range.clone()].copy_from_slice(&values);
                    }
                },
            },
        }
    }
    let known: std::collections::HashSet<&str> =
        expected.iter().map(|(t, _)| t.name.as_str()).chain(model.aliases().iter().map(|(a, _)| a.as_str())).collect();
    let mut unexpected: Vec<String> =
        st.names().into_iter().filter(|n| !known.contains(n)).map(|n| format!("unexpected tensor '{n}'")).collect();
    unexpected.sort();
    problems.extend(unexpected);
    if !problems.is_empty() {
        return Err(Error::WeightsMismatch { path: path.to_path_buf(), problems });
    }
    Ok(store)
}

/// One line per tensor of a safetensors file: name, dtype, shape. For `lockstep inspect`:
/// only the header is read.
pub fn inspect(path: &Path) -> Result<Vec<(String, String, Vec<usize>)>> {
    let file = read_file(path)?;
    let (_, header) = SafeTensors::read_metadata(&file)
        .map_err(|e| Error::format(path, format!("not a valid safetensors file: {e}")))?;
    let mut rows: Vec<_> =
        header.tensors().into_iter().map(|(n, t)| (n, format!("{:?}", t.dtype), t.shape.clone())).collect();
    rows.sort();
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models;

    #[test]
    fn weights_round_trip_bitwise_and_inspect_lists_them() {
        let dir = tempfile::tempdir().unwrap();
        let model = models::convnet(models::ConvnetOptions::default()).unwrap();
        let store = model.init(3);
        let path = dir.path().join("convnet.safetensors");
        save(&model, &store, &path).unwrap();
        assert_eq!(load(&model, &path).unwrap(), store);
        let rows = inspect(&path).unwrap();
        assert!(rows.contains(&("bn1.running_var".to_string(), "F32".to_string(), vec![24])));
        assert!(rows.contains(&("conv0.weight".to_string(), "F32".to_string(), vec![12, 1, 3, 3])));
        assert_eq!(rows.len(), model.param_infos().len() + model.buffer_infos().len());
    }

    #[test]
    fn every_problem_is_listed_and_nothing_is_loaded() {
        let model = models::toy_mlp(2, 2).unwrap();
        let store = model.init(1);
        let mut tensors: Vec<(String, Vec<usize>, &[f32])> = Vec::new();
        for t in model.param_infos() {
            match t.name.as_str() {
                "dense2.bias" => {} // missing
                "dense0.weight" => tensors.push((t.name.clone(), vec![2, 30], &store.params[t.range.clone()])), // transposed
                _ => tensors.push((t.name.clone(), t.shape.dims().to_vec(), &store.params[t.range.clone()])),
            }
        }
        tensors.retain(|(n, _, _)| n != "dense1.bias");
        let extra = [1.0f32];
        tensors.push(("head.weight".into(), vec![1], &extra));
        let mut bytes_views: Vec<(String, Vec<usize>, Vec<u8>, Dtype)> =
            tensors.iter().map(|(n, s, v)| (n.clone(), s.clone(), le_bytes(v), Dtype::F32)).collect();
        // dense1.bias as f64: the right shape, the wrong dtype
        let b1 = &store.params[model.param_infos()[3].range.clone()];
        bytes_views.push((
            "dense1.bias".into(),
            vec![20],
            b1.iter().flat_map(|v| (*v as f64).to_le_bytes()).collect(),
            Dtype::F64,
        ));
        let views: Vec<(String, TensorView<'_>)> =
            bytes_views.iter().map(|(n, s, b, d)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad-toy.safetensors");
        std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
        let err = load(&model, &path).unwrap_err();
        let Error::WeightsMismatch { problems, .. } = &err else { panic!("{err}") };
        assert_eq!(
            problems,
            &vec![
                "tensor 'dense0.weight' has shape [2, 30], expected (30, 2)".to_string(),
                "tensor 'dense1.bias' has dtype F64, expected F32, BF16 or F16".to_string(),
                "missing tensor 'dense2.bias' (2)".to_string(),
                "unexpected tensor 'head.weight'".to_string(),
            ]
        );
    }

    #[test]
    fn saving_the_same_weights_twice_gives_the_same_bytes() {
        // The issue: six identical runs gave two sha256s (the metadata's order varied).
        let dir = tempfile::tempdir().unwrap();
        let model = models::convnet(models::ConvnetOptions::default()).unwrap();
        let store = model.init(5);
        let (a, b) = (dir.path().join("a.safetensors"), dir.path().join("b.safetensors"));
        save(&model, &store, &a).unwrap();
        save(&model, &store, &b).unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    }

    #[test]
    fn non_finite_weights_are_named_with_their_first_index() {
        let dir = tempfile::tempdir().unwrap();
        let model = models::toy_mlp(2, 2).unwrap();
        let mut store = model.init(1);
        // Index 7 and 9 of dense0.weight (30, 2), index 5 of dense1.bias (20), wherever the
        // flat layout puts those tensors.
        let at = |name: &str, i: usize| model.param_infos().iter().find(|t| t.name == name).unwrap().range.start + i;
        store.params[at("dense0.weight", 7)] = f32::NAN;
        store.params[at("dense0.weight", 9)] = f32::INFINITY;
        store.params[at("dense1.bias", 5)] = f32::NEG_INFINITY;
        let path = dir.path().join("nan.safetensors");
        save(&model, &store, &path).unwrap();
        let err = load(&model, &path).unwrap_err();
        let Error::WeightsMismatch { problems, .. } = &err else { panic!("{err}") };
        assert_eq!(
            problems,
            &vec![
                "tensor 'dense0.weight' holds NaN at index 7".to_string(),
                "tensor 'dense1.bias' holds -inf at index 5".to_string()
            ]
        );
    }

    /// Issue 41: `generate --heads 4` on weights of 2 heads ran silently; the shapes are
    /// the same. The file records the heads; another count is refused by name, and a file
    /// without the record (a nanoGPT state_dict) loads into either.
    #[test]
    fn the_attention_heads_are_recorded_and_other_heads_refused() {
        let gpt = |heads| {
            models::gpt(models::GptConfig { context: 4, vocab: 8, layers: 2, heads, width: 8, dropout: 0.0 }).unwrap()
        };
        let (two, four) = (gpt(2), gpt(4));
        assert_eq!((attention_heads(&two), attention_heads(&four)), (vec![2, 2], vec![4, 4]));
        let store = two.init(1);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpt.safetensors");
        save(&two, &store, &path).unwrap();
        let meta = read_file(&path).unwrap().metadata().unwrap();
        assert_eq!(meta.get(HEADS_KEY).map(String::as_str), Some("2,2"));
        assert_eq!(load(&two, &path).unwrap(), store);
        let err = load(&four, &path).unwrap_err();
        let Error::WeightsMismatch { problems, .. } = &err else { panic!("{err}") };
        assert_eq!(
            problems,
            &vec!["the file records attention heads 2,2 (attention_heads), the model has 4,4".to_string()]
        );
        // The same tensors, no metadata.
        let tensors: Vec<(String, Vec<usize>, &[f32])> = two
            .param_infos()
            .iter()
            .map(|t| (t.name.clone(), t.shape.dims().to_vec(), &store.params[t.range.clone()]))
            .collect();
        let bare = dir.path().join("bare.safetensors");
        std::fs::write(&bare, to_safetensors_bytes(&tensors, &BTreeMap::new()).unwrap()).unwrap();
        assert!(load(&four, &bare).is_ok());
        // A model without attention records nothing.
        let toy = models::toy_mlp(2, 2).unwrap();
        let toy_path = dir.path().join("toy.safetensors");
        save(&toy, &toy.init(1), &toy_path).unwrap();
        assert!(!read_file(&toy_path).unwrap().metadata().unwrap().contains_key(HEADS_KEY));
    }
}
