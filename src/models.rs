//! The seed models, as built-in examples.
//!
//! * [`toy_mlp`]: the lesson's MLP, Linear(2,30)–ReLU–Linear(30,20)–ReLU–Linear(20,2).
//! * [`convnet`]: the Keras guide's MNIST convnet: Rescaling(1/255) → Conv2d(12, 3×3,
//!   same, no bias) → BN → ReLU → Conv2d(24, 6×6, stride 2, valid, no bias) → BN → ReLU →
//!   Conv2d(32, 6×6, stride 2, same, bias) → BN → ReLU → GlobalAvgPool → Dense(256) →
//!   ReLU → Dropout → Dense(10).
//!
//! # Tensor names (the same as the PyTorch reference models' `state_dict`)
//! | model | names |
//! |---|---|
//! | toy | `dense0.weight` (30, 2), `dense0.bias`, `dense1.weight` (20, 30), `dense1.bias`, `dense2.weight` (2, 20), `dense2.bias` |
//! | convnet | `conv0.weight` (12, 1, 3, 3), `bn0.beta`, `bn0.running_mean`, `bn0.running_var`, `conv1.weight` (24, 12, 6, 6), `bn1.*`, `conv2.weight` (32, 24, 6, 6), `conv2.bias`, `bn2.*`, `dense0.weight` (256, 32), `dense0.bias`, `dense1.weight` (10, 256), `dense1.bias` |
//! | convnet-nobn | as convnet without the `bn*` tensors |

use crate::error::Result;
use crate::nn::{BatchNorm2d, Conv2d, Dropout, GlobalAvgPool2d, Layer, Linear, Padding, Relu, Rescaling, Sequential};

/// Whether the convnet normalises after each convolution.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Norm {
    /// Keras `BatchNormalization(scale=False, center=True)`, eps 1e-3, momentum 0.99.
    BatchNorm,
    /// No normalisation layers.
    None,
}

/// Options of the Keras guide's convnet.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct ConvnetOptions {
    pub norm: Norm,
    /// Dropout rate before the last Dense (the guide uses 0.5; 0 removes the layer).
    pub dropout: f32,
    /// Input image (channels, height, width); the guide's MNIST is (1, 28, 28).
    pub input: (usize, usize, usize),
    pub classes: usize,
    /// Keras momentum of the BatchNorm running statistics (the weight of the old value;
    /// Keras's default 0.99 averages over ~100 steps).
    pub bn_momentum: f32,
}

impl Default for ConvnetOptions {
    fn default() -> Self {
        ConvnetOptions { norm: Norm::BatchNorm, dropout: 0.5, input: (1, 28, 28), classes: 10, bn_momentum: 0.99 }
    }
}

/// The lesson's MLP: `inputs` → 30 → 20 → `classes` with ReLUs (2 → 2 in the lesson).
pub fn toy_mlp(inputs: usize, classes: usize) -> Result<Sequential> {
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
pub fn convnet(opts: ConvnetOptions) -> Result<Sequential> {
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
