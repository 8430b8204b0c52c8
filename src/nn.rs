//! The layers a model is built from, and the model itself, as a program names them:
//! `use lockstep::nn::{Conv2d, Linear, Relu, Sequential};` (PyTorch's `torch.nn`). Each
//! op lives in its own folder of `crate::ops`; the model, its builders and the list of
//! layer types in `crate::model`. This module only gathers their names.

pub use crate::model::{
    convert_sync_batchnorm, Call, Graph, GraphNode, Named, NamedLayer, ParamStore, Residual, Sequential, Source,
    TensorInfo, Value, INPUT_NAME, LAYER_TYPES,
};
pub use crate::ops::cross_entropy as loss;
pub use crate::ops::{
    merge_takes_several, Activation, Add, Arity, AttentionMask, AvgPool2d, BatchNorm2d, CausalSelfAttention,
    Concatenate, Conv2d, Ctx, Dropout, Embedding, Flatten, Gelu, GlobalAvgPool2d, Init, InputGrad, Layer, LayerMemory,
    LayerNorm, LayerShapes, LayerType, Linear, MatMul, MaxPool2d, Mode, Multiply, Padding, ParamSpec, Params,
    ParamsMut, Permute, PositionalEmbedding, ProfileRow, Relu, Rescaling, Reshape, RmsNorm, RotaryEmbedding,
    ScaledDotProductAttention, Sigmoid, Silu, Softmax, Split, Tanh, Upsample2d, Window2d,
};
