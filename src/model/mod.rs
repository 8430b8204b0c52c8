//! A model: a graph of named nodes ([`Graph`]: the engine every model runs on), the
//! builders that write one (a chain of layers, [`Sequential`]; node by node,
//! [`functional`]), the residual block that holds two branches ([`Residual`]), the layer types a spec may name ([`LAYER_TYPES`]) and how a
//! spec's layer objects are read by type ([`spec_objects`]), synchronized BatchNorm across
//! a model ([`sync_batchnorm`]), and the network run on one GPU ([`gpu`]).
//!
//! The ops a model is made of, each in its own folder, are `crate::ops`'; what a model is
//! trained with (the step, the replicas, the exchange) is `crate::train`'s.

pub mod functional;
#[cfg(feature = "cuda")]
pub mod gpu;
mod graph;
pub mod residual;
mod sequential;
pub mod spec_objects;
pub mod sync_batchnorm;

pub use functional::{Call, Named, Value};
pub use graph::{auto_names, Graph, GraphNode, ParamStore, Place, Source, TensorInfo, INPUT_NAME};
pub use residual::Residual;
pub use sequential::{NamedLayer, Sequential};
pub use sync_batchnorm::convert_sync_batchnorm;

use crate::ops::{self, LayerType};

/// Every layer type of the spec format, in the order its errors list them: the one line a
/// new op adds its entry to.
pub const LAYER_TYPES: &[LayerType] = &[
    ops::Rescaling::SPEC,
    ops::Conv2d::SPEC,
    ops::BatchNorm2d::SPEC,
    ops::Relu::SPEC,
    ops::Linear::SPEC,
    ops::Dropout::SPEC,
    ops::Flatten::SPEC,
    ops::GlobalAvgPool2d::SPEC,
    ops::MaxPool2d::SPEC,
    ops::Gelu::SPEC,
    ops::LayerNorm::SPEC,
    Residual::SPEC,
    ops::Embedding::SPEC,
    ops::PositionalEmbedding::SPEC,
    ops::CausalSelfAttention::SPEC,
    ops::Silu::SPEC,
    ops::Sigmoid::SPEC,
    ops::Tanh::SPEC,
    ops::RmsNorm::SPEC,
    ops::AvgPool2d::SPEC,
    ops::Upsample2d::SPEC,
    ops::Softmax::SPEC,
    ops::Reshape::SPEC,
    ops::Permute::SPEC,
    ops::Split::SPEC,
    ops::Add::SPEC,
    ops::Multiply::SPEC,
    ops::Concatenate::SPEC,
    ops::MatMul::SPEC,
    ops::RotaryEmbedding::SPEC,
    ops::ScaledDotProductAttention::SPEC,
];
