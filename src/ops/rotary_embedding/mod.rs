//! Rotary position embeddings (RoPE) as Meta's Llama applies them to its queries and keys:
//! the layer (its spec entry `rotary_embedding`, its spec form, its table of cosines and
//! sines, made once for the layer's shape), built on its CPU forward and backward
//! ([`cpu`], which states the table's arithmetic and the rotation's); its GPU form is
//! [`gpu`] (kernels/rotary_embedding.cu), which uploads the same table.
//!
//! The input is (N, T, H, D), PyTorch's `(B, T, H, D)` queries or keys before the heads'
//! transpose: T positions, H heads of width D (even). Pair i of a head, (x[2i], x[2i+1]),
//! at position p (from `start`: p = start + t) turns by the angle p·base^(−2i/D):
//!   y[2i]   = x[2i]·cos − x[2i+1]·sin,   y[2i+1] = x[2i]·sin + x[2i+1]·cos.
//! The pairs are neighbours, as in Meta's Llama (`view_as_complex` of the last dimension
//! in pairs), not the two halves of the head that Keras-hub's `RotaryEmbedding` and
//! Hugging Face's Llama rotate. The backward is the inverse rotation. There are no
//! parameters: `base` is Keras-hub's `max_wavelength` and Llama's `theta` (`rope_theta`),
//! named here for what it is in the formula; `start` is the first position's index
//! (Llama's `start_pos`, Keras-hub's `start_index`).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod gpu;

use serde_json::{json, Value};

use super::spec::{Build, FieldResult, LayerType, MAX_DIM};
use super::{Ctx, InputGrad, Layer, LayerMemory, LayerShapes, Mode, Params, ParamsMut, F32};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// The default base of the angles (Llama's `theta`, Keras-hub's `max_wavelength`).
pub const DEFAULT_BASE: f64 = 10_000.0;

/// Rotary position embeddings over (N, T, H, D).
#[derive(Clone, Debug)]
pub struct RotaryEmbedding {
    base: f32,
    start: usize,
    /// The table for the last (T, D) seen: cos and sin, (T, D/2) each.
    table: Option<Table>,
    /// The training forward's input shape, for the backward.
    cached: Option<Shape>,
}

#[derive(Clone, Debug)]
struct Table {
    t: usize,
    d: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Default for RotaryEmbedding {
    fn default() -> RotaryEmbedding {
        RotaryEmbedding::new()
    }
}

impl RotaryEmbedding {
    /// Llama's: base 10000, positions from 0.
    pub fn new() -> RotaryEmbedding {
        RotaryEmbedding { base: DEFAULT_BASE as f32, start: 0, table: None, cached: None }
    }

    /// The same layer with angles p·base^(−2i/D); base must be positive and finite.
    pub fn with_base(mut self, base: f32) -> Result<RotaryEmbedding> {
        if !(base.is_finite() && base > 0.0) {
            return Err(Error::config("rotary embedding", format!("the base {base} is not a positive number")));
        }
        self.base = base;
        Ok(self)
    }

    /// The same layer with the first position's index `start` (Llama's `start_pos`).
    pub fn with_start(mut self, start: usize) -> RotaryEmbedding {
        self.start = start;
        self
    }

    /// The spec entry: Keras-hub's `RotaryEmbedding(max_wavelength=10000)` as a layer of its
    /// own, on (T, H, D) samples, its pairs Llama's (the module docs).
    pub const SPEC: LayerType = LayerType {
        name: "rotary_embedding",
        fields:
            "`base` (10000; Keras-hub's `max_wavelength`, Llama's `theta`), `start` (0: the first position's index)",
        example: (&[4, 2, 6], r#"{"type": "rotary_embedding", "base": 500, "start": 3}"#),
        parse: |f| {
            let base = f.number("base", Some(DEFAULT_BASE), (|x| x > 0.0, "a positive number"))?;
            let start = f.custom(
                "start",
                |v| match v {
                    None => Ok(0),
                    Some(v) => v.as_u64().filter(|&s| s <= MAX_DIM).map(|s| s as usize).ok_or_else(|| {
                        format!("field 'start' must be a position: an integer from 0 to {MAX_DIM} (got {v})")
                    }),
                },
                |&s| json!(s),
            )?;
            Ok(Build::layer(move |input| {
                heads_of(input)?;
                RotaryEmbedding::new().with_base(base).map(|l| l.with_start(start)).map_err(|e| e.to_string())
            }))
        },
        #[cfg(feature = "cuda")]
        kernels: Some(&gpu::KERNELS),
        #[cfg(test)]
        conformance: crate::ops::spec::Conformance {
            input: crate::ops::spec::TestInput::Values,
            #[cfg(feature = "cuda")]
            host: Some(gpu::host_check),
        },
    };

    /// (T, H, D) of an input (N, T, H, D), or why it is not one.
    fn geometry(shape: &Shape, op: &'static str) -> Result<(usize, usize, usize)> {
        heads_of(shape).map_err(|why| Error::shape(op, why))
    }

    /// The table for (T, D), made when the shape is new.
    fn table(&mut self, t: usize, d: usize) -> &Table {
        if !self.table.as_ref().is_some_and(|tb| tb.t == t && tb.d == d) {
            let (cos, sin) = cpu::rope_table(t, d, self.base, self.start);
            self.table = Some(Table { t, d, cos, sin });
        }
        self.table.as_ref().expect("made above")
    }
}

/// (T, H, D) of an input (N, T, H, D) whose head width D is even, or the words for another.
fn heads_of(input: &Shape) -> FieldResult<(usize, usize, usize)> {
    match input.dims() {
        [_, t, h, d] if d % 2 == 0 => Ok((*t, *h, *d)),
        [_, _, _, d] => Err(format!(
            "rotates pairs (x[2i], x[2i+1]) of each head, but the head width D = {d} is odd (input {})",
            Shape::new(&input.dims()[1..])
        )),
        _ => Err(format!(
            "expects samples of heads (T, H, D), got samples of shape {}",
            Shape::new(&input.dims()[1.min(input.ndim())..])
        )),
    }
}

impl Layer for RotaryEmbedding {
    #[cfg(feature = "cuda")]
    fn gpu(&self) -> Option<Box<dyn crate::ops::gpu::GpuLayer>> {
        gpu::form(self)
    }

    fn kind(&self) -> &'static str {
        "rope"
    }

    fn spec(&self) -> Option<Value> {
        Some(json!({"type": "rotary_embedding", "base": self.base, "start": self.start}))
    }

    /// Nothing per sample (the backward needs only the table); the table once, T·D/2
    /// cosines and as many sines.
    fn memory(&self, shapes: &LayerShapes) -> Option<LayerMemory> {
        let (t, d) = match shapes.input.dims() {
            &[t, _, d] => (t as u64, d as u64),
            _ => return None,
        };
        Some(LayerMemory { per_layer: t.saturating_mul(d).saturating_mul(F32), ..LayerMemory::NONE })
    }

    fn output_shape(&self, input: &Shape) -> Result<Shape> {
        RotaryEmbedding::geometry(input, "RotaryEmbedding")?;
        Ok(input.clone())
    }

    // x: (N, T, H, D) → y: (N, T, H, D), in place
    fn forward(&mut self, mut x: Tensor, _p: Params<'_>, _b: ParamsMut<'_>, ctx: &Ctx) -> Result<Tensor> {
        let (t, h, d) = RotaryEmbedding::geometry(x.shape(), "RotaryEmbedding")?;
        let shape = x.shape().clone();
        let table = self.table(t, d);
        cpu::rope_forward(x.host_mut(), &table.cos, &table.sin, (t, h, d));
        self.cached = (ctx.mode == Mode::Train).then_some(shape);
        Ok(x)
    }

    // dout: (N, T, H, D) → dx: (N, T, H, D), the inverse rotation, in place
    fn backward(
        &mut self,
        mut dout: Tensor,
        _p: Params<'_>,
        _dp: ParamsMut<'_>,
        input_grad: InputGrad,
        _ctx: &Ctx,
    ) -> Result<Option<Tensor>> {
        let shape = self
            .cached
            .take()
            .ok_or_else(|| Error::config("RotaryEmbedding backward", "no training forward to differentiate"))?;
        if dout.shape() != &shape {
            return Err(Error::shape("RotaryEmbedding backward", format!("dout {} for input {shape}", dout.shape())));
        }
        if input_grad == InputGrad::Skip {
            return Ok(None);
        }
        let (t, h, d) = RotaryEmbedding::geometry(&shape, "RotaryEmbedding backward")?;
        let table = self.table(t, d);
        cpu::rope_backward(dout.host_mut(), &table.cos, &table.sin, (t, h, d));
        Ok(Some(dout))
    }

    fn boxed_clone(&self) -> Box<dyn Layer> {
        Box::new(RotaryEmbedding { base: self.base, start: self.start, table: None, cached: None })
    }

    fn describe(&self) -> String {
        format!("RotaryEmbedding(base {}, start {})", self.base, self.start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tensor::Device;

    /// scripts/torch_rope.py's inputs for (T, H, D): x and dy (1, T, H, D) by the script's
    /// formulas (every value exact in f32).
    fn case(t: usize, h: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
        let n = t * h * d;
        let x = (0..n).map(|i| ((i * 37 % 23) as f32 - 11.0) / 8.0).collect();
        let dy = (0..n).map(|i| ((i * 13 % 17) as f32 - 8.0) / 16.0).collect();
        (x, dy)
    }

    /// The output of scripts/torch_rope.py (PyTorch's own float32 throughout): for case A,
    /// (T, H, D) = (4, 2, 8), base 10000, from position 0, and case B, (3, 1, 8), base 500,
    /// from position 1000: the table's (cos, sin) per (t, i) as `torch.polar` made them,
    /// then (y, dx) per element.
    /// // torch 2.15.0+cu132
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)]
    const TABLE_A: &[(f32, f32)] = &[
        (1.0, 0.0),
        (1.0, 0.0),
        (1.0, 0.0),
        (1.0, 0.0),
        (0.5403022766113281, 0.8414709568023682),
        (0.9950041770935059, 0.0998334214091301),
        (0.9999499917030334, 0.009999833069741726),
        (0.9999995231628418, 0.0009999999310821295),
        (-0.416146844625473, 0.9092974066734314),
        (0.9800665974617004, 0.19866932928562164),
        (0.9998000264167786, 0.019998665899038315),
        (0.9999979734420776, 0.0019999986980110407),
        (-0.9899924993515015, 0.14112000167369843),
        (0.9553365111351013, 0.29552021622657776),
        (0.9995500445365906, 0.029995499178767204),
        (0.9999955296516418, 0.0029999956022948027),
    ];
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)]
    const TORCH_A: &[(f32, f32)] = &[
        (-1.375, -0.5),
        (0.375, 0.3125),
        (-0.75, 0.0625),
        (1.0, -0.1875),
        (-0.125, -0.4375),
        (-1.25, 0.375),
        (0.5, 0.125),
        (-0.625, -0.125),
        (1.125, -0.375),
        (0.0, 0.4375),
        (-1.125, 0.1875),
        (0.625, -0.0625),
        (-0.5, -0.3125),
        (1.25, 0.5),
        (0.125, 0.25),
        (-1.0, 0.0),
        (0.7207783460617065, -0.5558110475540161),
        (0.4284898638725281, -0.05978339910507202),
        (1.3431724309921265, 0.3171783983707428),
        (0.38602200150489807, 0.030989816412329674),
        (-0.8837060928344727, -0.19186554849147797),
        (0.8662064075469971, -0.43560314178466797),
        (-0.24862487614154816, 0.37512481212615967),
        (-1.3752492666244507, 0.12462493777275085),
        (0.8337165713310242, -0.3830893933773041),
        (-0.08967509865760803, -0.09742948412895203),
        (1.0074833631515503, 0.45403310656547546),
        (-0.024542100727558136, 0.14288616180419922),
        (-1.2549374103546143, -0.06562182307243347),
        (0.4874752163887024, -0.3118593990802765),
        (-0.6261246800422668, 0.5002497434616089),
        (1.124374508857727, 0.24949988722801208),
        (1.022959589958191, -0.22732435166835785),
        (0.46816518902778625, 0.10403671115636826),
        (0.7118762731552124, -0.42794913053512573),
        (-0.36586496233940125, 0.4056054651737213),
        (1.2472501993179321, 0.058737751096487045),
        (0.1499733328819275, -0.18871241807937622),
        (-1.0014979839324951, -0.43674910068511963),
        (0.7479984760284424, 0.37587422132492065),
        (-1.0942288637161255, -0.16568052768707275),
        (-0.9131884574890137, -0.0616438202559948),
        (0.4188523292541504, -0.280607134103775),
        (-0.8078908920288086, 0.5032801032066345),
        (0.879824697971344, 0.18621258437633514),
        (-0.2324511706829071, -0.06623724848031998),
        (-1.3757472038269043, -0.31149935722351074),
        (0.37224921584129333, 0.5006240010261536),
        (0.6013743877410889, -0.24749812483787537),
        (-1.0958324670791626, -0.035280000418424606),
        (0.24998319149017334, -0.3865942358970642),
        (-1.2311105728149414, -0.4037882089614868),
        (0.5185222029685974, 0.3142341077327728),
        (-0.6097210645675659, 0.05309828370809555),
        (1.1249949932098389, -0.18881165981292725),
        (0.0033749949652701616, -0.43693554401397705),
        (1.0255415439605713, -0.353607177734375),
        (-0.7775053381919861, -0.17666906118392944),
        (-0.8470685482025146, -0.23023715615272522),
        (1.0464104413986206, -0.3213111460208893),
        (0.15493924915790558, 0.4429273009300232),
        (-0.9958006143569946, 0.17429259419441223),
        (0.7511216402053833, -0.06343721598386765),
        (-0.37274834513664246, -0.3123111128807068),
    ];
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)]
    const TABLE_B: &[(f32, f32)] = &[
        (0.5623790621757507, 0.8268795609474182),
        (-0.5507487058639526, -0.834671139717102),
        (0.739098072052002, 0.6735978126525879),
        (-0.9994674324989319, -0.032631825655698776),
        (-0.3919404447078705, 0.919990599155426),
        (-0.3632831573486328, -0.9316787719726562),
        (0.708246111869812, 0.7059656381607056),
        (-0.9991141557693481, -0.0420827753841877),
        (-0.9859117269515991, 0.16726654767990112),
        (-0.15963198244571686, -0.9871765971183777),
        (0.6759780049324036, 0.7369217872619629),
        (-0.9986714720726013, -0.051529962569475174),
    ];
    #[rustfmt::skip]
    #[allow(clippy::excessive_precision)]
    const TORCH_B: &[(f32, f32)] = &[
        (-1.0833510160446167, -0.02278965711593628),
        (-0.9260672926902771, 0.5891832113265991),
        (1.2477326393127441, 0.12207905203104019),
        (0.07525467872619629, 0.15543232858181),
        (0.7496100068092346, -0.0707562267780304),
        (-1.0080723762512207, 0.5718607902526855),
        (-0.520128607749939, -0.120854452252388),
        (0.6083512306213379, 0.12901240587234497),
        (-0.4409329891204834, 0.5494735240936279),
        (1.0349894762039185, 0.17352253198623657),
        (0.9909927845001221, -0.009885668754577637),
        (0.8210866451263428, 0.1973949670791626),
        (-1.2365801334381104, 0.13165590167045593),
        (0.5323248505592346, 0.5747373104095459),
        (-0.16697204113006592, -0.24977853894233704),
        (0.9938538074493408, 0.010520693846046925),
        (-0.6767088174819946, 0.16284465789794922),
        (0.4951667785644531, 0.534772515296936),
        (0.027300173416733742, -0.11158353090286255),
        (-1.3972758054733276, 0.2985156774520874),
        (-1.2362873554229736, -0.44914916157722473),
        (-0.0533258318901062, -0.15756753087043762),
        (0.17881417274475098, -0.38094305992126465),
        (1.3860557079315186, -0.10551019757986069),
    ];
    /// A training forward and backward of one sample (1, T, H, D): (y, dx).
    fn run(layer: &mut RotaryEmbedding, x: &[f32], dy: &[f32], (t, h, d): (usize, usize, usize)) -> [Vec<f32>; 2] {
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let x = Tensor::from_vec(x.to_vec(), [x.len() / (t * h * d), t, h, d]).unwrap();
        let shape = x.shape().clone();
        let y = layer.forward(x, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &ctx).unwrap();
        let dy = Tensor::from_vec(dy.to_vec(), shape).unwrap();
        let none = ParamsMut::new(&mut [], &[]);
        let dx = layer.backward(dy, Params::new(&[], &[]), none, InputGrad::Needed, &ctx).unwrap().unwrap();
        [y.into_vec(), dx.into_vec()]
    }

    /// The table is within 1 ulp of PyTorch's (the libraries' powers and cosines on either
    /// side: cpu.rs's "The table"), and equal to it but for one value: case B's cosine of
    /// the angle 1001, −0.39194041 here, 1 ulp from PyTorch's −0.39194044; this op's is the
    /// correctly rounded one (mpmath at 200 bits gives it). The
    /// rotation and its
    /// gradient are within 1 ulp of PyTorch's: its vectorised complex product (AVX2,
    /// AVX-512) rounds one of its two products inside a fused multiply-add, which this op
    /// (as PyTorch's scalar loop, and as the kernel) rounds apart (cpu.rs's "The rotation").
    #[test]
    fn rotary_embedding_matches_pytorchs_llama_rotation() {
        let ulps = |a: f32, b: f32| (a.to_bits() as i64 - b.to_bits() as i64).abs();
        for (name, (t, h, d, start, base), table, torch, differ) in
            [("A", (4, 2, 8, 0, 10_000.0), TABLE_A, TORCH_A, 0), ("B", (3, 1, 8, 1000, 500.0), TABLE_B, TORCH_B, 1)]
        {
            let (cos, sin) = cpu::rope_table(t, d, base, start);
            let mut off = 0;
            for (i, &(c, s)) in table.iter().enumerate() {
                assert!(
                    ulps(cos[i], c) <= 1 && ulps(sin[i], s) <= 1,
                    "{name}: table ({i}): ({}, {}) vs PyTorch ({c}, {s})",
                    cos[i],
                    sin[i]
                );
                off += usize::from(cos[i] != c) + usize::from(sin[i] != s);
            }
            assert_eq!(off, differ, "{name}: table values 1 ulp from PyTorch's");
            let mut layer = RotaryEmbedding::new().with_base(base).unwrap().with_start(start);
            let (x, dy) = case(t, h, d);
            let [y, dx] = run(&mut layer, &x, &dy, (t, h, d));
            for (i, &(ty, tdx)) in torch.iter().enumerate() {
                // Within 4 ulp: PyTorch's x·cos − y·sin may be contracted into an FMA where
                // the vector width allows (2 ulp apart on an AVX-512 Xeon), ours is not.
                assert!(ulps(y[i], ty) <= 4, "{name}: y[{i}] {} vs PyTorch {ty}", y[i]);
                assert!(ulps(dx[i], tdx) <= 4, "{name}: dx[{i}] {} vs PyTorch {tdx}", dx[i]);
            }
        }
    }

    #[test]
    fn results_are_bitwise_independent_of_the_thread_count_and_the_mode_and_the_backward_inverts() {
        // 7 samples of (T, H, D) = (40, 6, 64): 1,680 positions in tasks of 85 (CHUNK / 384).
        let (n, t, h, d) = (7, 40, 6, 64);
        let mut g = crate::rng::SplitMix64::new(3);
        let x: Vec<f32> = (0..n * t * h * d).map(|_| g.next_f32() * 2.0 - 1.0).collect();
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| run(&mut RotaryEmbedding::new().with_start(5), &x, &x, (t, h, d)))
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let [y1, dx1] = on(1);
        for threads in [2, 3] {
            let [y, dx] = on(threads);
            assert_eq!((bits(&y), bits(&dx)), (bits(&y1), bits(&dx1)), "{threads} threads");
        }
        let mut layer = RotaryEmbedding::new().with_start(5);
        let xt = Tensor::from_vec(x.clone(), [n, t, h, d]).unwrap();
        let eval = Ctx::eval(Device::Cpu(0));
        let y = layer.forward(xt, Params::new(&[], &[]), ParamsMut::new(&mut [], &[]), &eval).unwrap();
        assert_eq!(bits(y.host()), bits(&y1), "evaluation computes the training output");
        // The backward turns the forward's output back into its input, to the roundings of
        // two turns of values below 1 (each within 1.5 ulp of 1): |Δ| ≤ 8 ulp of 1, 2^-21.
        let [_, dx] = run(&mut RotaryEmbedding::new().with_start(5), &x, &y1, (t, h, d));
        for (i, (a, b)) in dx.iter().zip(&x).enumerate() {
            assert!((a - b).abs() <= 2f32.powi(-21), "dx[{i}] = {a}, the input {b}");
        }
    }

    #[test]
    fn an_odd_head_width_and_other_shapes_are_refused_by_name() {
        use crate::spec::model_from_spec_str;
        let e = RotaryEmbedding::new().output_shape(&Shape::new([2, 4, 3, 7])).unwrap_err().to_string();
        assert!(e.contains("RotaryEmbedding") && e.contains("head width D = 7 is odd"), "{e}");
        let spec = r#"{"input_shape": [4, 3, 7], "layers": [{"type": "rotary_embedding"}]}"#;
        let e = model_from_spec_str(spec, "m.json").unwrap_err().to_string();
        assert!(e.contains("head width D = 7 is odd") && e.contains("(4, 3, 7)"), "{e}");
        let spec = r#"{"input_shape": [4, 8], "layers": [{"type": "rotary_embedding"}]}"#;
        let e = model_from_spec_str(spec, "m.json").unwrap_err().to_string();
        assert!(e.contains("expects samples of heads (T, H, D), got samples of shape (4, 8)"), "{e}");
        for (fields, want) in [
            (r#""base": 0"#, "field 'base' must be a positive number"),
            (r#""start": -1"#, "field 'start' must be a position"),
            (r#""start": 1.5"#, "field 'start' must be a position"),
            (r#""theta": 10"#, "unknown field 'theta'"),
        ] {
            let spec = format!(r#"{{"input_shape": [4, 2, 8], "layers": [{{"type": "rotary_embedding", {fields}}}]}}"#);
            let e = model_from_spec_str(&spec, "m.json").unwrap_err().to_string();
            assert!(e.contains(want), "{fields}: {e}");
        }
        assert!(RotaryEmbedding::new().with_base(f32::INFINITY).is_err());
    }

    #[test]
    fn the_spec_entry_reads_its_defaults_and_the_memory_counts_the_table() {
        use crate::spec::model_from_spec_str;
        let m =
            model_from_spec_str(r#"{"input_shape": [16, 4, 32], "layers": [{"type": "rotary_embedding"}]}"#, "m.json")
                .unwrap();
        assert_eq!(m.layer_names(), ["rope0"]);
        assert_eq!(m.layers()[0].describe(), "RotaryEmbedding(base 10000, start 0)");
        assert!(m.param_infos().is_empty());
        // The table: T·D/2 cosines and as many sines, 4 bytes each, once a layer.
        let mem = m.layers()[0].memory(&m.layer_shapes()[0]).unwrap();
        assert_eq!(mem, LayerMemory { per_layer: 16 * 32 * 4, ..LayerMemory::NONE });
        // Backward needs a training forward.
        let d = Tensor::from_vec(vec![0.0; 16 * 4 * 32], [1, 16, 4, 32]).unwrap();
        let e = RotaryEmbedding::new().backward(
            d,
            Params::new(&[], &[]),
            ParamsMut::new(&mut [], &[]),
            InputGrad::Needed,
            &Ctx::eval(Device::Cpu(0)),
        );
        assert!(e.unwrap_err().to_string().contains("no training forward"));
    }
}
