//! The seed models, as built-in examples.
//!
//! * [`toy_mlp`]: the lesson's MLP, Linear(2,30)–ReLU–Linear(30,20)–ReLU–Linear(20,2).
//! * [`convnet`]: the Keras guide's MNIST convnet: Rescaling(1/255) → Conv2d(12, 3×3,
//!   same, no bias) → BN → ReLU → Conv2d(24, 6×6, stride 2, valid, no bias) → BN → ReLU →
//!   Conv2d(32, 6×6, stride 2, same, bias) → BN → ReLU → GlobalAvgPool → Dense(256) →
//!   ReLU → Dropout → Dense(10).
//! * [`resnet`]: the CIFAR ResNet of He et al. (2016, section 4.2) for 1×28×28 inputs,
//!   `resnet8` (n = 1) and `resnet20` (n = 3): input normalisation → stem (3×3 conv 16,
//!   BN, ReLU) → three stages of n basic blocks (16, 32, 64 channels; the first block of
//!   the second and third stage strides 2, with a 1×1 conv + BN shortcut) → global mean →
//!   Dense(10).
//! * [`densenet`]: a DenseNet-BC (Huang et al. 2017) for 1×28×28 inputs, a graph: input
//!   normalisation → stem (3×3 conv, 2k channels) → dense blocks, each layer
//!   BN-ReLU-Conv1×1(4k)-BN-ReLU-Conv3×3(k) concatenated onto everything before it, with
//!   transitions BN-ReLU-Conv1×1(half)-AvgPool2d(2) between blocks → BN → ReLU → global
//!   mean → Dense(10); k = 12, blocks of (4, 4, 4) layers.
//! * [`gpt`]: nanoGPT's `GPT` (karpathy/nanoGPT `model.py`, `bias=True`): token and
//!   positional embeddings → dropout → n blocks of `x + attn(ln_1(x))`,
//!   `x + mlp(ln_2(x))` (MLP: Dense 4C, GELU, Dense C, dropout) → LayerNorm → a head
//!   tied to the token embedding, a logit per position and token.
//! * [`llama`]: Meta's Llama (`llama/model.py`'s `Transformer`): a token embedding (no
//!   position table) → n blocks of `h = x + attention(attention_norm(x))`,
//!   `out = h + feed_forward(ffn_norm(h))` (RMSNorm; attention with RoPE on q and k, no
//!   biases; the SwiGLU feed-forward `w2(silu(w1(x)) · w3(x))`) → RMSNorm → an untied
//!   head. Written node by node with the functional API (`nn::Value`).
//!
//! # Tensor names (the same as the PyTorch reference models' `state_dict`)
//! | model | names |
//! |---|---|
//! | toy | `dense0.weight` (30, 2), `dense0.bias`, `dense1.weight` (20, 30), `dense1.bias`, `dense2.weight` (2, 20), `dense2.bias` |
//! | convnet | `conv0.weight` (12, 1, 3, 3), `bn0.beta`, `bn0.running_mean`, `bn0.running_var`, `conv1.weight` (24, 12, 6, 6), `bn1.*`, `conv2.weight` (32, 24, 6, 6), `conv2.bias`, `bn2.*`, `dense0.weight` (256, 32), `dense0.bias`, `dense1.weight` (10, 256), `dense1.bias` |
//! | convnet-nobn | as convnet without the `bn*` tensors |
//! | gpt | nanoGPT's `state_dict` keys: `transformer.wte.weight` (V, C), `transformer.wpe.weight` (T, C), `transformer.h.{i}.ln_1.{weight,bias}`, `transformer.h.{i}.attn.c_attn.{weight,bias}` (3C, C), `transformer.h.{i}.attn.c_proj.{weight,bias}`, `transformer.h.{i}.ln_2.*`, `transformer.h.{i}.mlp.c_fc.{weight,bias}` (4C, C), `transformer.h.{i}.mlp.c_proj.{weight,bias}` (C, 4C), `transformer.ln_f.{weight,bias}`, and `lm_head.weight`, an alias of `transformer.wte.weight` (tied) |
//! | densenet | the PyTorch module's of [`densenet`]'s docs: `features.conv0.weight` (24, 1, 3, 3), `features.denseblock{b}.denselayer{i}.norm1.{weight,bias,running_mean,running_var,num_batches_tracked}`, `….conv1.weight` (48, C, 1, 1), `….norm2.*`, `….conv2.weight` (12, 48, 3, 3), `features.transition{b}.norm.*`, `features.transition{b}.conv.weight` (C/2, C, 1, 1), `features.norm_final.*`, `classifier.weight` (10, 90), `classifier.bias` |
//! | llama | Meta's `state_dict` keys: `tok_embeddings.weight` (V, C), `layers.{i}.attention_norm.weight` (C), `layers.{i}.attention.{wq,wk,wv,wo}.weight` (C, C), `layers.{i}.ffn_norm.weight`, `layers.{i}.feed_forward.{w1,w3}.weight` (F, C), `layers.{i}.feed_forward.w2.weight` (C, F), `norm.weight`, `output.weight` (V, C) |
//! | resnet8, resnet20 | the PyTorch module's of [`resnet`]'s docs: `stem.0.weight`, `stem.1.{weight,bias,running_mean,running_var,num_batches_tracked}`, `blocks.{k}.conv1.weight`, `blocks.{k}.bn1.*`, `blocks.{k}.conv2.weight`, `blocks.{k}.bn2.*`, `blocks.{k}.short.0.weight`, `blocks.{k}.short.1.*` (the blocks that change shape), `head.weight` (10, 64), `head.bias` |

use crate::error::Error;
use crate::error::Result;
use crate::nn::Graph;
use crate::nn::{
    identity, residual, Activation, Add, AttentionMask, AvgPool2d, BatchNorm2d, Call, CausalSelfAttention, Concatenate,
    Conv2d, Dropout, Embedding, Gelu, GlobalAvgPool2d, Init, Layer, LayerNorm, Linear, Multiply, Padding, Permute,
    PositionalEmbedding, Relu, Rescaling, Reshape, RmsNorm, RotaryEmbedding, ScaledDotProductAttention, Sequential,
    Silu, Value,
};

/// Whether the convnet normalises after each convolution.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Norm {
    /// Keras `BatchNormalization(scale=False, center=True)`, eps 1e-3, with the momentum of
    /// [`ConvnetOptions::bn_momentum`].
    BatchNorm,
    /// No normalisation layers.
    None,
}

/// Options of the Keras guide's convnet. Their [`Default`] is `lockstep train`'s (the
/// command line reads its defaults from it): the guide's layers on MNIST's 1×28×28 images of
/// 10 classes, dropout 0.5, BatchNorm momentum 0.9.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct ConvnetOptions {
    pub norm: Norm,
    /// Dropout rate before the last Dense (the guide uses 0.5; 0 removes the layer).
    pub dropout: f32,
    /// Input image (channels, height, width); the guide's MNIST is (1, 28, 28).
    pub input: (usize, usize, usize),
    pub classes: usize,
    /// Keras momentum of the BatchNorm running statistics (the weight of the old value;
    /// PyTorch's momentum is 1 − this). The default 0.9 averages over ~10 steps, so that
    /// the running statistics follow the weights on a small dataset such as the digits
    /// (1,437 images: Keras's 0.99 averages over ~100 steps, and evaluates at chance for
    /// the first epochs); set 0.99 for Keras's own.
    pub bn_momentum: f32,
}

impl Default for ConvnetOptions {
    fn default() -> Self {
        ConvnetOptions { norm: Norm::BatchNorm, dropout: 0.5, input: (1, 28, 28), classes: 10, bn_momentum: 0.9 }
    }
}

/// The lesson's MLP: `inputs` → 30 → 20 → `classes` with ReLUs (2 → 2 in the lesson).
pub fn toy_mlp(inputs: usize, classes: usize) -> Result<Graph> {
    Sequential::new(
        [inputs],
        vec![
            Box::new(Linear::new(inputs, 30)),
            Box::new(Relu::new()),
            Box::new(Linear::new(30, 20)),
            Box::new(Relu::new()),
            Box::new(Linear::new(20, classes)),
        ],
    )
}

/// The Keras guide's convnet.
pub fn convnet(opts: ConvnetOptions) -> Result<Graph> {
    let (c, h, w) = opts.input;
    let bn = |ch| -> Vec<Box<dyn Layer>> {
        match opts.norm {
            Norm::BatchNorm => {
                vec![Box::new(BatchNorm2d::new(ch).scale(false).center(true).eps(1e-3).momentum(opts.bn_momentum))]
            }
            Norm::None => vec![],
        }
    };
    let mut layers: Vec<Box<dyn Layer>> = vec![Box::new(Rescaling::new(1.0 / 255.0, 0.0))];
    layers.push(Box::new(Conv2d::new(c, 12, (3, 3), 1, Padding::Same, false)?));
    layers.extend(bn(12));
    layers.push(Box::new(Relu::new()));
    layers.push(Box::new(Conv2d::new(12, 24, (6, 6), 2, Padding::Valid, false)?));
    layers.extend(bn(24));
    layers.push(Box::new(Relu::new()));
    layers.push(Box::new(Conv2d::new(24, 32, (6, 6), 2, Padding::Same, true)?));
    layers.extend(bn(32));
    layers.push(Box::new(Relu::new()));
    layers.push(Box::new(GlobalAvgPool2d::new()));
    layers.push(Box::new(Linear::new(32, 256)));
    layers.push(Box::new(Relu::new()));
    if opts.dropout > 0.0 {
        layers.push(Box::new(Dropout::new(opts.dropout)?));
    }
    layers.push(Box::new(Linear::new(256, opts.classes)));
    Sequential::new([c, h, w], layers)
}

/// The mean and standard deviation of Fashion-MNIST's 60,000 training images' pixels,
/// scaled to [0, 1], the standard deviation the population's (numpy's `mean()`, `std()`
/// of all 47,040,000 values in f64, which scripts/torch_resnet.py recomputes and checks):
/// the built-in ResNets' input normalisation.
pub const FASHION_MNIST_MEAN: f64 = 0.286_040_596_988_795_5;
pub const FASHION_MNIST_STD: f64 = 0.353_024_244_514_922_54;

/// The depth of a built-in ResNet: n basic blocks per stage, 6n + 2 layers.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ResnetDepth {
    /// n = 1: 8 layers, 77,754 parameters.
    Resnet8,
    /// n = 3: 20 layers, 272,186 parameters.
    Resnet20,
}

impl ResnetDepth {
    /// Blocks per stage.
    pub fn blocks(self) -> usize {
        match self {
            ResnetDepth::Resnet8 => 1,
            ResnetDepth::Resnet20 => 3,
        }
    }
}

/// The CIFAR ResNet of He et al. (2016, §4.2) for 1×28×28 images of `classes` classes, as
/// this PyTorch module, whose `state_dict` names its tensors (weights move between the
/// two by name: `lockstep train --save` files load into it with
/// `load_state_dict(strict=True)`, its saved safetensors load as `--init`):
///
/// ```python
/// class Basic(nn.Module):
///     def __init__(s, cin, cout, stride):
///         super().__init__()
///         s.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False); s.bn1 = nn.BatchNorm2d(cout)
///         s.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False);     s.bn2 = nn.BatchNorm2d(cout)
///         s.short = None
///         if stride != 1 or cin != cout:
///             s.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
///     def forward(s, x):
///         y = s.bn2(s.conv2(F.relu(s.bn1(s.conv1(x)))))
///         return F.relu(y + (x if s.short is None else s.short(x)))
///
/// class ResNet(nn.Module):          # n = 1: resnet8, n = 3: resnet20
///     def __init__(s, n, classes=10):
///         super().__init__()
///         s.stem = nn.Sequential(nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
///         layers, cin = [], 16
///         for i, c in enumerate((16, 32, 64)):
///             for b in range(n):
///                 layers.append(Basic(cin, c, 2 if (b == 0 and i > 0) else 1)); cin = c
///         s.blocks = nn.Sequential(*layers)
///         s.head = nn.Linear(64, classes)
///     def forward(s, x):             # x: (N, 1, 28, 28), already (x/255 - mean) / std
///         return s.head(s.blocks(s.stem(x)).mean((2, 3)))
/// ```
///
/// Its first layer, `normalize`, has no tensors: it takes the raw pixels (0..255) to
/// `(x/255 − mean)/std` with Fashion-MNIST's training-set [`FASHION_MNIST_MEAN`] and
/// [`FASHION_MNIST_STD`], as `x·(1/(255·std)) + (−mean/std)` in f32. BatchNorm is
/// PyTorch's (eps 1e-5, momentum 0.1, `num_batches_tracked`).
pub fn resnet(depth: ResnetDepth, classes: usize) -> Result<Graph> {
    let conv = |cin, cout, k, stride, pad| Conv2d::new(cin, cout, (k, k), stride, Padding::Explicit(pad, pad), false);
    let scale = 1.0 / (255.0 * FASHION_MNIST_STD);
    let offset = -FASHION_MNIST_MEAN / FASHION_MNIST_STD;
    let x = Value::input([1, 28, 28]);
    let x = Rescaling::new(scale as f32, offset as f32).named("normalize").call(&x);
    let x = conv(1, 16, 3, 1, 1)?.named("stem.0").call(&x);
    let x = BatchNorm2d::pytorch(16).named("stem.1").call(&x);
    let mut x = Relu::new().named("stem.2").call(&x); // (16, 28, 28)
    let (mut cin, mut k) = (16, 0);
    for (stage, c) in [16, 32, 64].into_iter().enumerate() {
        for b in 0..depth.blocks() {
            let stride = if b == 0 && stage > 0 { 2 } else { 1 };
            let at = |part: &str| format!("blocks.{k}.{part}");
            // y = bn2(conv2(relu(bn1(conv1(x))))); out = relu(y + (x or short(x)))
            let body = |x: &Value| -> Result<Value> {
                let y = conv(cin, c, 3, stride, 1)?.named(at("conv1")).call(x);
                let y = BatchNorm2d::pytorch(c).named(at("bn1")).call(&y);
                let y = Relu::new().named(at("relu")).call(&y);
                let y = conv(c, c, 3, 1, 1)?.named(at("conv2")).call(&y);
                Ok(BatchNorm2d::pytorch(c).named(at("bn2")).call(&y))
            };
            let projection = |x: &Value| -> Result<Value> {
                let s = conv(cin, c, 1, stride, 0)?.named(at("short.0")).call(x);
                Ok(BatchNorm2d::pytorch(c).named(at("short.1")).call(&s))
            };
            x = match stride != 1 || cin != c {
                true => residual(&x, &format!("blocks.{k}"), body, projection, Activation::Relu)?,
                false => residual(&x, &format!("blocks.{k}"), body, identity, Activation::Relu)?,
            }; // (c, h, w)
            (cin, k) = (c, k + 1);
        }
    }
    let x = GlobalAvgPool2d::new().named("pool").call(&x); // (64)
    Linear::new(64, classes).named("head").call(&x).model() // (classes)
}

/// The sizes of the built-in DenseNet; its [`Default`] is `--model densenet`'s.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct DensenetConfig {
    /// k: the channels each dense layer adds (the stem makes 2k, a bottleneck 4k).
    pub growth: usize,
    /// The dense layers of each block, one entry a block; a transition follows each block
    /// but the last, and halves the image (28 → 14 → 7 for three blocks).
    pub blocks: Vec<usize>,
    pub classes: usize,
}

impl Default for DensenetConfig {
    /// k = 12 and three blocks of 4 layers, 10 classes: 102,298 parameters, small enough
    /// to train on Fashion-MNIST on two cores.
    fn default() -> Self {
        DensenetConfig { growth: 12, blocks: vec![4, 4, 4], classes: 10 }
    }
}

/// A bottleneck's width, in growths (DenseNet-B's 4k).
const DENSENET_BOTTLENECK: usize = 4;

/// A DenseNet-BC (Huang et al. 2017, with bottlenecks and a compression of 0.5) for
/// 1×28×28 images, written node by node ([`Value`]): every dense layer reads all the
/// feature maps before it, and its output is concatenated onto them (a `concatenate` node
/// along the channels). Its tensors carry the names of this PyTorch module's `state_dict`
/// (scripts/torch_densenet_model.py; `lockstep train --save` files load into it with
/// `load_state_dict(strict=True)`, its saved safetensors load as `--init`):
///
/// ```python
/// class DenseLayer(nn.Module):
///     def __init__(s, cin, growth):
///         super().__init__()
///         s.norm1 = nn.BatchNorm2d(cin);        s.conv1 = nn.Conv2d(cin, 4 * growth, 1, bias=False)
///         s.norm2 = nn.BatchNorm2d(4 * growth); s.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)
///     def forward(s, x):              # (N, cin, H, W) -> (N, cin + growth, H, W)
///         h = s.conv2(F.relu(s.norm2(s.conv1(F.relu(s.norm1(x))))))
///         return torch.cat([x, h], 1)
///
/// class Transition(nn.Module):
///     def __init__(s, cin, cout):
///         super().__init__()
///         s.norm = nn.BatchNorm2d(cin); s.conv = nn.Conv2d(cin, cout, 1, bias=False)
///     def forward(s, x):              # (N, cin, H, W) -> (N, cout, H/2, W/2)
///         return F.avg_pool2d(s.conv(F.relu(s.norm(x))), 2)
///
/// class DenseNet(nn.Module):
///     def __init__(s, growth=12, blocks=(4, 4, 4), classes=10):
///         super().__init__()
///         c = 2 * growth
///         features = OrderedDict(conv0=nn.Conv2d(1, c, 3, padding=1, bias=False))
///         for b, layers in enumerate(blocks, start=1):
///             block = OrderedDict()
///             for i in range(1, layers + 1):
///                 block[f"denselayer{i}"] = DenseLayer(c, growth); c += growth
///             features[f"denseblock{b}"] = nn.Sequential(block)
///             if b < len(blocks):
///                 features[f"transition{b}"] = Transition(c, c // 2); c = c // 2
///         features["norm_final"] = nn.BatchNorm2d(c)
///         s.features = nn.Sequential(features)
///         s.classifier = nn.Linear(c, classes)
///     def forward(s, x):              # x: (N, 1, 28, 28), already (x/255 - mean) / std
///         return s.classifier(F.relu(s.features(x)).mean((2, 3)))
/// ```
///
/// Its first node, `normalize`, is the ResNets' (Fashion-MNIST's mean and standard
/// deviation: see [`resnet`]); BatchNorm is PyTorch's. The nodes without tensors are
/// named after the module's functions: `….relu1`, `….relu2` and `….concat` in a dense
/// layer ([`dense_layer`]), `….relu` and `….pool` in a transition ([`transition`]),
/// `features.relu_final` and `pool` at the end.
pub fn densenet(config: &DensenetConfig) -> Result<Graph> {
    let DensenetConfig { growth: k, ref blocks, classes } = *config;
    if k == 0 || blocks.is_empty() || blocks.contains(&0) {
        return Err(Error::config(
            "densenet",
            format!(
                "a DenseNet needs a growth of at least 1 and blocks of at least one layer, got growth {k} and blocks {blocks:?}"
            ),
        ));
    }
    let scale = 1.0 / (255.0 * FASHION_MNIST_STD);
    let offset = -FASHION_MNIST_MEAN / FASHION_MNIST_STD;
    let inputs = Value::input([1, 28, 28]);
    let x = Rescaling::new(scale as f32, offset as f32).named("normalize").call(&inputs);
    // x: (N, 2k, 28, 28)
    let mut c = 2 * k;
    let mut x = densenet_conv(1, c, 3)?.named("features.conv0").call(&x);
    for (b, &layers) in blocks.iter().enumerate() {
        for i in 1..=layers {
            x = dense_layer(&x, c, k, &format!("features.denseblock{}.denselayer{i}", b + 1))?;
            c += k;
        }
        if b + 1 < blocks.len() {
            x = transition(&x, c, &format!("features.transition{}", b + 1))?;
            c /= 2;
        }
    }
    // x: (N, c, H, W) → (N, c) → (N, classes)
    let x = BatchNorm2d::pytorch(c).named("features.norm_final").call(&x);
    let x = Relu::new().named("features.relu_final").call(&x);
    let x = GlobalAvgPool2d::new().named("pool").call(&x);
    Linear::new(c, classes).named("classifier").call(&x).model()
}

/// A bias-free `size`×`size` convolution of stride 1 that keeps the image's size.
fn densenet_conv(cin: usize, cout: usize, size: usize) -> Result<Conv2d> {
    let pad = size / 2;
    Conv2d::new(cin, cout, (size, size), 1, Padding::Explicit(pad, pad), false)
}

/// A DenseNet-B layer on `x` (its `channels` feature maps so far), its nodes named
/// `{name}.norm1`, `.relu1`, `.conv1`, `.norm2`, `.relu2`, `.conv2` and `.concat`:
/// BN-ReLU-Conv1×1(4·growth)-BN-ReLU-Conv3×3(growth), its output concatenated after `x`
/// along the channels. x: (N, channels, H, W) → (N, channels + growth, H, W).
pub fn dense_layer(x: &Value, channels: usize, growth: usize, name: &str) -> Result<Value> {
    let at = |part: &str| format!("{name}.{part}");
    let wide = DENSENET_BOTTLENECK * growth;
    // h: (N, channels, H, W) → (N, 4·growth, H, W) → (N, growth, H, W)
    let h = BatchNorm2d::pytorch(channels).named(at("norm1")).call(x);
    let h = Relu::new().named(at("relu1")).call(&h);
    let h = densenet_conv(channels, wide, 1)?.named(at("conv1")).call(&h);
    let h = BatchNorm2d::pytorch(wide).named(at("norm2")).call(&h);
    let h = Relu::new().named(at("relu2")).call(&h);
    let h = densenet_conv(wide, growth, 3)?.named(at("conv2")).call(&h);
    Ok(Concatenate::new(1).named(at("concat")).call_many(&[x, &h]))
}

/// A DenseNet-C transition on `x`, its nodes named `{name}.norm`, `.relu`, `.conv` and
/// `.pool`: BN-ReLU-Conv1×1 to half the channels (rounded down), AvgPool2d(2).
/// x: (N, channels, H, W) → (N, channels/2, H/2, W/2).
pub fn transition(x: &Value, channels: usize, name: &str) -> Result<Value> {
    let at = |part: &str| format!("{name}.{part}");
    let t = BatchNorm2d::pytorch(channels).named(at("norm")).call(x);
    let t = Relu::new().named(at("relu")).call(&t);
    let t = densenet_conv(channels, channels / 2, 1)?.named(at("conv")).call(&t);
    Ok(AvgPool2d::new((2, 2), (2, 2), Padding::Valid)?.named(at("pool")).call(&t))
}

/// nanoGPT's `GPTConfig` with `bias=True` (lockstep's `--model gpt` flags).
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct GptConfig {
    /// `block_size`: the context T, and the positional table's length.
    pub context: usize,
    /// `vocab_size`: 256 for bytes.
    pub vocab: usize,
    /// `n_layer`.
    pub layers: usize,
    /// `n_head`; must divide `width`.
    pub heads: usize,
    /// `n_embd`: C.
    pub width: usize,
    /// `dropout`: of the embeddings, the attention probabilities, and each block's two
    /// residual branches.
    pub dropout: f32,
}

impl Default for GptConfig {
    /// nanoGPT's CPU recipe (its README): 4 layers, 4 heads, 128 wide, a context of 64,
    /// bytes, no dropout.
    fn default() -> Self {
        GptConfig { context: 64, vocab: 256, layers: 4, heads: 4, width: 128, dropout: 0.0 }
    }
}

/// nanoGPT's `GPT` for `config`, its tensors named as its `state_dict` and initialised as
/// its `_init_weights`: N(0, 0.02) for every Linear and Embedding weight, the residual
/// projections (`c_proj`) N(0, (0.02/√(2·layers))²), zero biases, LayerNorm ones and
/// zeros. Input: (T) token ids; output: (T, V) logits.
pub fn gpt(config: GptConfig) -> Result<Graph> {
    let GptConfig { context, vocab, layers, heads, width, dropout } = config;
    if layers == 0 {
        return Err(Error::config("layers", "a GPT needs at least one block"));
    }
    if heads == 0 || width % heads != 0 {
        return Err(Error::config("heads", format!("{heads} heads do not divide the width {width}")));
    }
    let normal = |std: f64| Init::Normal { std: std as f32 };
    let proj_std = 0.02 / (2.0 * layers as f64).sqrt();
    let tokens = Value::input([context]);
    let x = Embedding::new(vocab, width)?.named("transformer.wte").call(&tokens);
    let x = PositionalEmbedding::new(context, width)?.named("transformer.wpe").call(&x);
    let mut x = Dropout::new(dropout)?.named("transformer.drop").call(&x); // (T, C)
    for i in 0..layers {
        let block = format!("transformer.h.{i}");
        let at = |part: &str| format!("{block}.{part}");
        // x = x + attn(ln_1(x))
        let attn = |x: &Value| -> Result<Value> {
            let a = LayerNorm::new(width).named(at("ln_1")).call(x);
            let attn = CausalSelfAttention::new(width, heads)?.with_dropout(dropout)?.with_proj_std(proj_std as f32)?;
            Ok(attn.named(at("attn")).call(&a))
        };
        x = residual(&x, &block, attn, identity, Activation::Linear)?;
        // x = x + mlp(ln_2(x))
        let mlp = |x: &Value| -> Result<Value> {
            let m = LayerNorm::new(width).named(at("ln_2")).call(x);
            let m = Linear::new(width, 4 * width).with_init(normal(0.02)).named(at("mlp.c_fc")).call(&m);
            let m = Gelu::new().named(at("mlp.gelu")).call(&m);
            let m = Linear::new(4 * width, width).with_init(normal(proj_std)).named(at("mlp.c_proj")).call(&m);
            Ok(Dropout::new(dropout)?.named(at("mlp.dropout")).call(&m))
        };
        x = residual(&x, &block, mlp, identity, Activation::Linear)?; // (T, C)
    }
    let x = LayerNorm::new(width).named("transformer.ln_f").call(&x);
    let head = Linear::new(width, vocab).without_bias().with_init(normal(0.02)).tied_to("transformer.wte.weight");
    head.named("lm_head").call(&x).model() // (T, V)
}

/// The rounding of Meta's feed-forward width (`ModelArgs.multiple_of`, 256 by default).
pub const LLAMA_MULTIPLE_OF: usize = 256;

/// Meta's hidden width F of the SwiGLU feed-forward for a model `width` C wide (its
/// `FeedForward.__init__`, given 4C): two thirds of 4C, so that its three matrices hold
/// about the weights of a 4C MLP's two, rounded up to a multiple of `multiple_of`:
/// F = multiple_of · ⌈⌊8C/3⌋ / multiple_of⌉. C = 128, 256: ⌊1024/3⌋ = 341 → 512;
/// C = 32, 32: 85 → 96; C = 4096 (Llama 2's 7B), 256: 10922 → 11008.
pub fn llama_hidden(width: usize, multiple_of: usize) -> usize {
    let hidden = 2 * (4 * width) / 3;
    multiple_of * hidden.div_ceil(multiple_of)
}

/// Meta's Llama `ModelArgs` at a small size (lockstep's `--model llama` flags).
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct LlamaConfig {
    /// `max_seq_len`: the window T of the model's input. No tensor depends on it (the
    /// positions enter through RoPE's angles), so a weights file records it
    /// (`weights::CONTEXT_KEY`).
    pub context: usize,
    /// `vocab_size`: 256 for bytes.
    pub vocab: usize,
    /// `n_layers`.
    pub layers: usize,
    /// `n_heads`; the width must be heads of an even width D (RoPE turns pairs).
    pub heads: usize,
    /// `dim`: C.
    pub width: usize,
    /// The feed-forward's hidden width F: [`llama_hidden`] of the width, as Meta computes it.
    pub hidden: usize,
    /// `norm_eps` of every RMSNorm: 1e-5.
    pub norm_eps: f32,
    /// `rope_theta`: RoPE's base, 10000.
    pub rope_base: f32,
}

impl LlamaConfig {
    /// A Llama of these sizes, its feed-forward width Meta's rule with `multiple_of` 256,
    /// its eps and RoPE base Meta's defaults.
    pub fn new(context: usize, vocab: usize, layers: usize, heads: usize, width: usize) -> LlamaConfig {
        let hidden = llama_hidden(width, LLAMA_MULTIPLE_OF);
        LlamaConfig { context, vocab, layers, heads, width, hidden, norm_eps: 1e-5, rope_base: 10_000.0 }
    }
}

impl Default for LlamaConfig {
    /// The GPT's CPU recipe's sizes (nanoGPT's README): 4 layers, 4 heads, 128 wide, a
    /// window of 64, bytes; the feed-forward 512 wide.
    fn default() -> Self {
        let g = GptConfig::default();
        LlamaConfig::new(g.context, g.vocab, g.layers, g.heads, g.width)
    }
}

/// Meta's Llama for `config`, its tensors named as Meta's `state_dict` (the module's
/// table) and initialised as scripts/torch_llama_model.py initialises: N(0, 0.02) for
/// every projection and the token table, the residual projections (`attention.wo`,
/// `feed_forward.w2`) N(0, (0.02/√(2·layers))²), the RMSNorm weights ones. No dropout
/// (Meta's has none), no biases. Input: (T) token ids; output: (T, V) logits.
pub fn llama(config: LlamaConfig) -> Result<Graph> {
    let LlamaConfig { context, vocab, layers, heads, width, hidden, norm_eps, rope_base } = config;
    if layers == 0 {
        return Err(Error::config("layers", "a Llama needs at least one layer"));
    }
    if heads == 0 || width % heads != 0 || (width / heads) % 2 != 0 {
        return Err(Error::config(
            "heads",
            format!("{heads} heads do not cut the width {width} into heads of an even width (RoPE turns pairs)"),
        ));
    }
    let residual_std = (0.02 / (2.0 * layers as f64).sqrt()) as f32;
    let sizes = Sizes { heads, width, hidden, residual_std, rope_base };
    let tokens = Value::input([context]);
    let mut x = Embedding::new(vocab, width)?.named("tok_embeddings").call(&tokens); // (T, C)
    for i in 0..layers {
        let at = |part: &str| format!("layers.{i}.{part}");
        // h = x + attention(attention_norm(x))
        let a = RmsNorm::new(width).eps(norm_eps).named(at("attention_norm")).call(&x);
        let a = attention(&a, &at("attention"), &sizes)?;
        let h = Add::new().named(at("attention_residual")).call_many(&[&x, &a]);
        // out = h + feed_forward(ffn_norm(h))
        let f = RmsNorm::new(width).eps(norm_eps).named(at("ffn_norm")).call(&h);
        let f = feed_forward(&f, &at("feed_forward"), &sizes);
        x = Add::new().named(at("ffn_residual")).call_many(&[&h, &f]);
    }
    let x = RmsNorm::new(width).eps(norm_eps).named("norm").call(&x);
    let head = Linear::new(width, vocab).without_bias().with_init(Init::Normal { std: 0.02 });
    head.named("output").call(&x).model() // (T, V)
}

/// The sizes one Llama block is built of.
struct Sizes {
    heads: usize,
    width: usize,
    hidden: usize,
    residual_std: f32,
    rope_base: f32,
}

/// A bias-free projection from `from` to `to` features, N(0, std²).
fn projection(from: usize, to: usize, std: f32) -> Linear {
    Linear::new(from, to).without_bias().with_init(Init::Normal { std })
}

/// Meta's `Attention.forward` (no cache) on x: (T, C), its nodes named under `at`.
fn attention(x: &Value, at: &str, s: &Sizes) -> Result<Value> {
    let (h, c) = (s.heads, s.width);
    let d = (c / h) as i64;
    let node = |name: &str| format!("{at}.{name}");
    let xq = projection(c, c, 0.02).named(node("wq")).call(x); // (T, C)
    let xk = projection(c, c, 0.02).named(node("wk")).call(x);
    let xv = projection(c, c, 0.02).named(node("wv")).call(x);
    // .view(T, H, D): the window is read from the input, so that a shorter one (a
    // prompt's first tokens) runs too.
    let by_heads = |v: &Value, name: &str| -> Result<Value> {
        Ok(Reshape::new(&[-1, h as i64, d])?.named(node(name)).call(v)) // (T, H, D)
    };
    let (xq, xk, xv) = (by_heads(&xq, "q_heads")?, by_heads(&xk, "k_heads")?, by_heads(&xv, "v_heads")?);
    let rope = || RotaryEmbedding::new().with_base(s.rope_base);
    let xq = rope()?.named(node("q_rope")).call(&xq); // (T, H, D)
    let xk = rope()?.named(node("k_rope")).call(&xk);
    // .transpose(1, 2): (T, H, D) → (H, T, D), Permute's dims counted from 1.
    let transpose =
        |v: &Value, name: &str| -> Result<Value> { Ok(Permute::new(&[2, 1, 3])?.named(node(name)).call(v)) };
    let (q, k, v) = (transpose(&xq, "q_t")?, transpose(&xk, "k_t")?, transpose(&xv, "v_t")?); // (H, T, D)
    let y = ScaledDotProductAttention::new(AttentionMask::Causal).named(node("sdpa")).call_many(&[&q, &k, &v]);
    let y = transpose(&y, "y_t")?; // (T, H, D)
    let y = Reshape::new(&[-1, c as i64])?.named(node("y_merged")).call(&y); // (T, C)
    Ok(projection(c, c, s.residual_std).named(node("wo")).call(&y))
}

/// Meta's `FeedForward.forward`, SwiGLU, on x: (T, C), its nodes named under `at`:
/// w2(silu(w1(x)) · w3(x)).
fn feed_forward(x: &Value, at: &str, s: &Sizes) -> Value {
    let node = |name: &str| format!("{at}.{name}");
    let gate = projection(s.width, s.hidden, 0.02).named(node("w1")).call(x); // (T, F)
    let gate = Silu::new().named(node("silu")).call(&gate);
    let up = projection(s.width, s.hidden, 0.02).named(node("w3")).call(x); // (T, F)
    let gated = Multiply::new().named(node("gate")).call_many(&[&gate, &up]); // (T, F)
    projection(s.hidden, s.width, s.residual_std).named(node("w2")).call(&gated)
    // (T, C)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resnets_have_the_pytorch_modules_tensors() {
        // PyTorch: sum(p.numel() for p in ResNet(1).parameters()) = 77,754 and
        // ResNet(3) = 272,186 (scripts/torch_resnet.py prints them).
        let r8 = resnet(ResnetDepth::Resnet8, 10).unwrap();
        assert_eq!(r8.num_params(), 77_754);
        let r20 = resnet(ResnetDepth::Resnet20, 10).unwrap();
        assert_eq!(r20.num_params(), 272_186);
        let names: Vec<&str> = r8.param_infos().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(&names[..3], ["stem.0.weight", "stem.1.weight", "stem.1.bias"]);
        assert!(names.contains(&"blocks.1.short.0.weight") && names.contains(&"blocks.2.bn2.bias"), "{names:?}");
        assert!(!names.iter().any(|n| n.starts_with("blocks.0.short")), "{names:?}");
        assert_eq!(names.last(), Some(&"head.bias"));
        let buffers: Vec<&str> = r8.buffer_infos().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(&buffers[..3], ["stem.1.running_mean", "stem.1.running_var", "stem.1.num_batches_tracked"]);
        assert_eq!(r8.output_shape().dims(), &[10]);
    }

    #[test]
    fn the_densenet_has_the_pytorch_modules_tensors() {
        // PyTorch: sum(p.numel() for p in DenseNet().parameters()) = 102,298, and its
        // state_dict's first and last keys (scripts/torch_densenet.py prints the count).
        let m = densenet(&DensenetConfig::default()).unwrap();
        assert_eq!(m.num_params(), 102_298);
        let names: Vec<&str> = m.param_infos().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            &names[..4],
            [
                "features.conv0.weight",
                "features.denseblock1.denselayer1.norm1.weight",
                "features.denseblock1.denselayer1.norm1.bias",
                "features.denseblock1.denselayer1.conv1.weight"
            ]
        );
        assert!(names.contains(&"features.transition2.conv.weight"), "{names:?}");
        assert!(!names.iter().any(|n| n.contains("transition3")), "{names:?}");
        assert_eq!(
            &names[names.len() - 4..],
            ["features.norm_final.weight", "features.norm_final.bias", "classifier.weight", "classifier.bias"]
        );
        let buffers: Vec<&str> = m.buffer_infos().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(buffers.len(), 3 * 27, "27 BatchNorms: 2 in each of 12 dense layers, 2 transitions, the last");
        // The feature maps: 24 + 4·12 = 72 channels at 28×28, halved to 36, + 48 = 84 at
        // 14×14, halved to 42, + 48 = 90 at 7×7.
        let shape = |name: &str| {
            let j = m.layer_names().iter().position(|n| n == name).unwrap();
            m.layer_shapes()[j].output.dims().to_vec()
        };
        assert_eq!(shape("features.denseblock1.denselayer4.concat"), [72, 28, 28]);
        assert_eq!(shape("features.transition1.pool"), [36, 14, 14]);
        assert_eq!(shape("features.denseblock3.denselayer4.concat"), [90, 7, 7]);
        assert_eq!(m.output_shape().dims(), &[10]);
        let bad = DensenetConfig { blocks: vec![4, 0], ..DensenetConfig::default() };
        assert!(densenet(&bad).unwrap_err().to_string().contains("blocks [4, 0]"));
    }
}
