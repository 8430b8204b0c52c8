//! The token embedding, PyTorch's `nn.Embedding(V, C)` (nanoGPT's `wte`): token ids in,
//! the rows of a learned table out. The layer: the check of the ids ([`check_ids`], which
//! the data loaders and the GPU replica's staging call too), its spec entry (`embedding`),
//! its spec form and what it keeps for backward, built on its CPU forward and backward
//! ([`cpu`]); its GPU form is [`gpu`] (kernels/embedding.cu: a gather, and a deterministic
//! backward).
//!
//! Leaves to others: the positional table (`ops::positional`), weight tying with the LM
//! head (the model's), and where the ids come from (the text data).
//!
//! # Ids as values
//! The network's input is f32, so ids travel as f32 values: exact integers, as f32 holds
//! every integer below 2^24 ([`MAX_VOCAB`]). An id that is not an integer in [0, V) is an
//! error that names it and where it is, never a clamp or a wrap: `token id 300 at (row 2,
//! position 5) is at or above the vocabulary 256`.
//!
//! # Gradients
//! - `dweight[id]` += dout row, for every token in token order (n, t): the order of every
//!   addition is fixed, so the gradient is the same bits on any run, any thread count and
//!   (kernels/embedding.cu adds in the same order) on a GPU. PyTorch adds the same values;
//!   its order of additions for a repeated id may differ, within f32 rounding.
//! - The ids have no gradient. An embedding is the first trained layer of its network,
//!   which `Sequential` asks for no input gradient ([`InputGrad::Skip`]); asked for one
//!   ([`InputGrad::Needed`]: a trained layer before it) it is an error, as the gradient
//!   would stop there silently.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{Build, FieldResult, LayerType};
use super::{Ctx, Init, InputGrad, Layer, LayerMemory, LayerShapes, Mode, ParamSpec, Params, ParamsMut};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// The largest vocabulary: every id below 2^24 is an f32 integer exactly.
pub const MAX_VOCAB: usize = 1 << 24;

/// nanoGPT's initialisation of an embedding table (`_init_weights`): N(0, 0.02²).
const INIT_STD: f32 = 0.02;

/// The row of token id `id` in a table of `vocab` rows, or None when it is not an integer
/// in [0, vocab) (NaN and the infinities included; −0 is row 0).
fn row_of(id: f32, vocab: usize) -> Option<usize> {
    (id >= 0.0 && id.fract() == 0.0 && f64::from(id) < vocab as f64).then_some(id as usize)
}

/// What is wrong with the first bad id of `ids`, rows of `row_len` tokens each, for a
/// vocabulary of `vocab`: `token id 300 at (row 2, position 5) is at or above the
/// vocabulary 256`; None when every id is a row. For a caller that words its own error
/// (a data loader naming its file).
pub fn first_bad_id(ids: &[f32], row_len: usize, vocab: usize) -> Option<String> {
    let (i, &id) = ids.iter().enumerate().find(|(_, &id)| row_of(id, vocab).is_none())?;
    let why = if id.is_nan() {
        "is not a number".to_string()
    } else if id < 0.0 {
        "is negative".to_string()
    } else if f64::from(id) >= vocab as f64 {
        format!("is at or above the vocabulary {vocab}")
    } else {
        "is not an integer".to_string()
    };
    let at = match row_len {
        0 => format!("at {i}"),
        t => format!("at (row {}, position {})", i / t, i % t),
    };
    Some(format!("token id {id} {at} {why}"))
}

/// Errors unless every id of `ids` (rows of `row_len` tokens: (N, T) for a model's input,
/// (N, T + 1) for a window of text with its targets) is an integer in [0, vocab): an
/// [`Error::Config`] naming the first bad one, where it is and why (see
/// [`first_bad_id`]).
pub fn check_ids(ids: &[f32], row_len: usize, vocab: usize) -> Result<()> {
    match first_bad_id(ids, row_len, vocab) {
        Some(problem) => Err(Error::config("token ids", problem)),
        None => Ok(()),
    }
}

/// The tokens per sample of an input of token ids, (N, T), or the spec's words for another.
fn expect_tokens(input: &Shape) -> FieldResult<usize> {
    match input.dims() {
        [_, t] => Ok(*t),
        _ => Err(format!(
            "expects token ids (T), got samples of shape {}; an embedding is the first layer",
            Shape::new(&input.dims()[1..])
        )),
    }
}

/// A table of `vocab` learned vectors of `width` values, looked up by token id.
#[derive(Clone, Debug)]
pub struct Embedding {
    vocab: usize,
    width: usize,
    /// The ids of the training forward, (N, T) flattened: the rows backward adds into.
    ids: Option<Vec<u32>>,
}

impl Embedding {
    /// `nn.Embedding(vocab, width)`: ids in 0..vocab (at most `MAX_VOCAB`), rows of
    /// `width` values, the table initialised N(0, 0.02²) as nanoGPT does.
    pub fn new(vocab: usize, width: usize) -> Result<Embedding> {
        if vocab == 0 || width == 0 {
            return Err(Error::config("embedding", format!("vocabulary {vocab} and width {width} must be positive")));
        }
        if vocab > MAX_VOCAB {
            return Err(Error::config(
                "embedding",
                format!("a vocabulary of {vocab} is above {MAX_VOCAB} (2^24), the ids f32 holds exactly"),
            ));
        }
        Ok(Embedding { vocab, width, ids: None })
    }

    /// The number of rows: ids are 0..vocab.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The values per row, C.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The spec entry: PyTorch's `nn.Embedding(vocab, width)` over samples of T token ids.
    pub const SPEC: LayerType = LayerType {
        name: "embedding",
        fields: "`vocab` (ids are 0..vocab), `width`; samples of token ids (T)",
        example: (&[8], r#"{"type": "embedding", "vocab": 16, "width": 4}"#),
        parse: |f| {
            let vocab = f.size("vocab", None)?;
            let width = f.size("width", None)?;
            Ok(Build::layer(move |input| {
                expect_tokens(input)?;
                Embedding::new(vocab, width).map_err(|e| e.to_string())
            }))
        },
        #[cfg(feature = "cuda")]
        kernels: Some(&gpu::KERNELS),
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Ids { vocab: 16 },
            #[cfg(feature = "cuda")]
            host: Some(gpu::host_check),
        },
    };
}

impl Layer for Embedding {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "embedding"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "embedding", "vocab": self.vocab, "width": self.width}))
    }

    /// Its ids, 4 bytes each (u32), for the rows backward adds into.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        Some(LayerMemory { kept_per_sample: (shapes.input.numel() as u64).saturating_mul(4), ..LayerMemory::NONE })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        match input.dims() {
            &[n, t] => Ok(Shape::new([n, t, self.width])),
            _ => Err(Error::shape("Embedding", format!("expects token ids (N, T), got {input}"))),
        }
    }

    fn params(&self) -> Vec<ParamSpec> {
        vec![ParamSpec {
            name: "weight".into(),
            shape: Shape::new([self.vocab, self.width]),
            init: Init::Normal { std: INIT_STD },
        }]
    }

    /// The ids of a batch the network is about to copy where they are read unchecked (a
    /// GPU replica's staging): each an integer in 0..vocab.
    fn check_input(&self, x: &[f32], input: &Shape) -> Result<()> {
        check_ids(x, input.numel(), self.vocab)
    }

    // ids: (N, T) → y: (N, T, C) = weight[ids]
    fn forward(&mut self, x: Tensor, params: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let out_shape = self.output_shape(x.shape())?;
        let (ids, t, c) = (x.host(), x.shape().dims()[1], self.width);
        check_ids(ids, t, self.vocab)?;
        let mut y = vec![0.0; ids.len() * c];
        cpu::embedding_forward(ids, params.get(0), c, &mut y);
        self.ids = (ctx.mode == Mode::Train).then(|| ids.iter().map(|&id| id as u32).collect());
        Tensor::from_vec_on(y, out_shape, x.device())
    }

    // dout: (N, T, C) → dweight (V, C) += dout[n, t] at row ids[n, t], (n, t) in order; no dx
    fn backward(
        &mut self,
        dout: Tensor,
        _p: Params<'_>,
        mut dparams: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        if input_grad == InputGrad::Needed {
            return Err(needs_input_grad());
        }
        let ids = self
            .ids
            .take()
            .ok_or_else(|| Error::config("Embedding backward", "no training forward to differentiate"))?;
        let c = self.width;
        if dout.numel() != ids.len() * c || dout.shape().dims().last() != Some(&c) {
            return Err(Error::shape(
                "Embedding backward",
                format!("dout {} for {} cached tokens of width {c}", dout.shape(), ids.len()),
            ));
        }
        cpu::embedding_backward(&ids, dout.host(), c, dparams.get(0));
        Ok(None)
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(Embedding { ids: None, ..self.clone() })
    }

    fn describe(&self) -> String {
        format!("Embedding({}, {})", self.vocab, self.width)
    }
}

/// The error of a backward asked for the ids' gradient, on either backend.
fn needs_input_grad() -> Error {
    Error::config(
        "Embedding backward",
        "token ids have no gradient: an embedding must be the first trained layer of its network",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::nn::Sequential;
    use crate::spec::model_from_spec_str;
    use crate::tensor::Device;

    /// The ranges of a layer of one tensor of `len` values, as `Sequential` lays it out.
    fn one_tensor(len: usize) -> Vec<std::ops::Range<usize>> {
        vec![0..len; 1]
    }

    fn train() -> Ctx<'static> {
        Ctx::train(0, 0, 0, Device::Cpu(0))
    }

    /// The layer's forward of `ids` (N, T) over `weight`, in `ctx`'s mode.
    fn forward(e: &mut Embedding, weight: &[f32], ids: &[f32], n: usize, ctx: &Ctx) -> Result<Tensor> {
        let ranges = one_tensor(weight.len());
        let x = Tensor::from_vec(ids.to_vec(), [n, ids.len() / n]).unwrap();
        e.forward(x, Params::new(weight, &ranges), ParamsMut::new(&mut [], &[]), ctx)
    }

    /// The training forward of `ids`, then the backward of `dout` into `dweight`.
    fn forward_backward(e: &mut Embedding, ids: &[f32], n: usize, dout: &[f32], dweight: &mut [f32]) {
        let weight = vec![0.0; e.vocab * e.width];
        let y = forward(e, &weight, ids, n, &train()).unwrap();
        let d = Tensor::from_vec(dout.to_vec(), y.shape().clone()).unwrap();
        let ranges = one_tensor(dweight.len());
        let dx =
            e.backward(d, Params::new(&weight, &ranges), ParamsMut::new(dweight, &ranges), InputGrad::Skip, &train());
        assert!(dx.unwrap().is_none(), "ids have no gradient");
    }

    #[test]
    fn forward_gathers_the_rows_of_the_ids() {
        // weight (5, 3): row r is [10r, 10r + 1, 10r + 2].
        let weight: Vec<f32> = (0..5).flat_map(|r| (0..3).map(move |j| (10 * r + j) as f32)).collect();
        let mut e = Embedding::new(5, 3).unwrap();
        let y = forward(&mut e, &weight, &[0.0, 4.0, 2.0, 2.0, 2.0, -0.0], 2, &Ctx::eval(Device::Cpu(0))).unwrap();
        assert_eq!(y.shape().dims(), [2, 3, 3]);
        #[rustfmt::skip]
        assert_eq!(y.host(), [
            0.0, 1.0, 2.0,   40.0, 41.0, 42.0,  20.0, 21.0, 22.0,
            20.0, 21.0, 22.0, 20.0, 21.0, 22.0,  0.0, 1.0, 2.0,
        ]);
        assert!(e.ids.is_none(), "an evaluation forward keeps nothing");
    }

    #[test]
    fn backward_adds_the_rows_of_repeated_ids_in_token_order() {
        // ids (2, 3) = [[1, 3, 1], [0, 1, 3]], width 2; dweight starts nonzero (backward
        // accumulates). Row 1 receives tokens (0, 0), (0, 2), (1, 1) in that order, row 3
        // tokens (0, 1), (1, 2), row 0 token (1, 0); rows 2 and 4 none. Row 1's column 0
        // gets 1e8, 1, −1e8: in f32, token order gives (1e8 + 1) − 1e8 = 0 (1 is below
        // half an ulp of 1e8, which is 4), where the order 1e8 − 1e8 + 1 would give 1.
        let ids = [1.0, 3.0, 1.0, 0.0, 1.0, 3.0];
        #[rustfmt::skip]
        let dout = [
            1e8, 0.5,   2.0, -3.0,   1.0, 0.25,
            7.0, 1.0,   -1e8, 0.125, 0.5, 0.5,
        ];
        let start = [0.5f32, -0.5, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0];
        let mut dweight = start;
        let mut e = Embedding::new(5, 2).unwrap();
        forward_backward(&mut e, &ids, 2, &dout, &mut dweight);
        // The f64 sums in token order, each step rounded to f32 as the layer's f32 adds
        // are (derived by hand from the table above):
        //   row 0: (0.5 + 7, −0.5 + 1)               = (7.5, 0.5)
        //   row 1: ((0 + 1e8 + 1) − 1e8, 1 + 0.5 + 0.25 + 0.125) = (0, 1.875)
        //   row 3: (2 + 2 + 0.5, 0 − 3 + 0.5)         = (4.5, −2.5)
        let f32_step = |acc: f64, v: f64| (acc + v) as f32 as f64;
        let row1_col0 = [1e8, 1.0, -1e8].into_iter().fold(0.0, f32_step);
        assert_eq!(row1_col0, 0.0, "the order the sum is defined by loses the 1");
        assert_eq!(dweight, [7.5, 0.5, 0.0, 1.875, 0.0, 0.0, 4.5, -2.5, 0.0, 0.0]);
        // Against the exact sums in f64: equal wherever no rounding happens, and row 1's
        // column 0 is 1 away only because of the f32 rounding the order fixes.
        let exact = [7.5, 0.5, 1.0, 1.875, 0.0, 0.0, 4.5, -2.5, 0.0, 0.0];
        for (i, (&g, &w)) in dweight.iter().zip(&exact).enumerate() {
            let allowed = if i == 2 { 1.0 } else { 0.0 };
            assert!((f64::from(g) - w).abs() <= allowed, "dweight[{i}] = {g}, exact {w}");
        }
    }

    #[test]
    fn backward_is_bitwise_the_same_every_run_and_in_any_thread_pool() {
        // 12 × 64 tokens over a vocabulary of 16 (so every id repeats ~48 times), width 8:
        // random dout, run in pools of 1 and 4 threads, twice each.
        let (n, t, v, c) = (12, 64, 16, 8);
        let mut g = crate::rng::SplitMix64::new(7);
        let ids: Vec<f32> = (0..n * t).map(|_| (g.next_u64() % v as u64) as f32).collect();
        let dout: Vec<f32> = (0..n * t * c).map(|_| g.next_f64() as f32 * 2.0 - 1.0).collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut dweight = vec![0.0f32; v * c];
                forward_backward(&mut Embedding::new(v, c).unwrap(), &ids, n, &dout, &mut dweight);
                dweight
            })
        };
        let first = run(1);
        for threads in [1, 4, 4] {
            let again = run(threads);
            assert!(first.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads");
        }
        // And it is the plain loop in token order (the definition above).
        let mut want = vec![0.0f32; v * c];
        for (tok, &id) in ids.iter().enumerate() {
            for j in 0..c {
                want[id as usize * c + j] += dout[tok * c + j];
            }
        }
        assert!(first.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn a_bad_id_is_named_with_its_place_and_why() {
        let weight = vec![0.0; 256 * 2];
        let mut ids = vec![1.0f32; 3 * 6];
        let cases = [
            (300.0, "token id 300 at (row 2, position 5) is at or above the vocabulary 256"),
            (256.0, "token id 256 at (row 2, position 5) is at or above the vocabulary 256"),
            (-1.0, "token id -1 at (row 2, position 5) is negative"),
            (2.5, "token id 2.5 at (row 2, position 5) is not an integer"),
            (f32::NAN, "token id NaN at (row 2, position 5) is not a number"),
            (f32::INFINITY, "token id inf at (row 2, position 5) is at or above the vocabulary 256"),
            (f32::NEG_INFINITY, "token id -inf at (row 2, position 5) is negative"),
        ];
        for (bad, want) in cases {
            ids[2 * 6 + 5] = bad;
            let e = forward(&mut Embedding::new(256, 2).unwrap(), &weight, &ids, 3, &train()).unwrap_err();
            assert_eq!(e.to_string(), format!("invalid token ids: {want}"));
            assert_eq!(first_bad_id(&ids, 6, 256).as_deref(), Some(want));
            // Rows of T + 1 (a window with its targets) place it otherwise: index 17 of
            // rows of 7 is (row 2, position 3).
            let windows = first_bad_id(&ids, 7, 256).unwrap();
            assert!(windows.contains("at (row 2, position 3)"), "{windows}");
        }
        ids[2 * 6 + 5] = 255.0;
        assert!(check_ids(&ids, 6, 256).is_ok());
        // The first bad id is the one named.
        (ids[3], ids[9]) = (-2.0, 999.0);
        assert_eq!(first_bad_id(&ids, 6, 256).unwrap(), "token id -2 at (row 0, position 3) is negative");
        // The GPU staging's check is the same.
        let layer = Embedding::new(256, 2).unwrap();
        let e = layer.check_input(&ids, &Shape::new([6])).unwrap_err().to_string();
        assert!(e.contains("token id -2 at (row 0, position 3)"), "{e}");
    }

    #[test]
    fn shapes_and_the_gradient_of_the_ids_are_refused_by_name() {
        let mut e = Embedding::new(10, 4).unwrap();
        let err = e.output_shape(&Shape::new([2, 3, 4])).unwrap_err().to_string();
        assert!(err.contains("expects token ids (N, T), got (2, 3, 4)"), "{err}");
        assert_eq!(e.output_shape(&Shape::new([2, 7])).unwrap().dims(), [2, 7, 4]);
        // Asked for the ids' gradient (a trained layer before it): an error, not zeros.
        let weight = vec![0.0; 40];
        let y = forward(&mut e, &weight, &[1.0, 2.0], 1, &train()).unwrap();
        let ranges = one_tensor(40);
        let mut dweight = vec![0.0; 40];
        let d = Tensor::from_vec(vec![1.0; 8], y.shape().clone()).unwrap();
        let err = e
            .backward(
                d,
                Params::new(&weight, &ranges),
                ParamsMut::new(&mut dweight, &ranges),
                InputGrad::Needed,
                &train(),
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("token ids have no gradient"), "{err}");
        // A backward without a training forward.
        let d = Tensor::from_vec(vec![1.0; 8], [1, 2, 4]).unwrap();
        let err = Embedding::new(10, 4)
            .unwrap()
            .backward(
                d,
                Params::new(&weight, &ranges),
                ParamsMut::new(&mut dweight, &ranges),
                InputGrad::Skip,
                &train(),
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("no training forward"), "{err}");
        assert!(Embedding::new(0, 4).is_err() && Embedding::new(4, 0).is_err());
        assert!(Embedding::new(MAX_VOCAB + 1, 4).unwrap_err().to_string().contains("2^24"));
    }

    #[test]
    fn the_spec_builds_it_over_token_ids_and_names_a_wrong_input() {
        let spec = r#"{"input_shape": [64], "layers": [{"type": "embedding", "vocab": 256, "width": 128}]}"#;
        let model = model_from_spec_str(spec, "gpt.json").unwrap();
        assert_eq!(model.layer_names(), ["embedding0"]);
        assert_eq!(model.output_shape().dims(), [64, 128]);
        assert_eq!(model.layers()[0].describe(), "Embedding(256, 128)");
        let weight = &model.param_infos()[0];
        assert_eq!((weight.name.as_str(), weight.shape.dims()), ("embedding0.weight", &[256, 128][..]));
        assert_eq!(weight.init, Init::Normal { std: 0.02 });
        let shapes = &model.layer_shapes()[0];
        assert_eq!(
            model.layers()[0].memory(shapes),
            Some(LayerMemory { kept_per_sample: 64 * 4, ..LayerMemory::NONE })
        );
        // nanoGPT's N(0, 0.02²): the table's spread, within 5% over 32768 draws.
        let store = model.init(3);
        let w = &store.params[weight.range.clone()];
        let sd = (w.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / w.len() as f64).sqrt();
        assert!((sd - 0.02).abs() < 0.001, "std {sd}");

        let err = model_from_spec_str(
            r#"{"input_shape": [4, 8], "layers": [{"type": "embedding", "vocab": 256, "width": 128}]}"#,
            "m.json",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("expects token ids (T), got samples of shape (4, 8)"), "{err}");
        let err = model_from_spec_str(r#"{"input_shape": [4], "layers": [{"type": "embedding", "width": 8}]}"#, "m")
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing field 'vocab'"), "{err}");
        // Through a Sequential, the forward refuses a bad id at the layer.
        let mut net = Sequential::new([3], vec![Box::new(Embedding::new(4, 2).unwrap()) as Box<dyn Layer>]).unwrap();
        let store = net.init(0);
        let x = Tensor::from_vec(vec![0.0, 3.0, 4.0], [1, 3]).unwrap();
        let err = net.forward(x, &store.params, &mut [], &train()).unwrap_err().to_string();
        assert!(err.contains("token id 4 at (row 0, position 2) is at or above the vocabulary 4"), "{err}");
    }
}
