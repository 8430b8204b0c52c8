//! [`Sequential`]: a model's layers one after another, as PyTorch's `nn.Sequential` and
//! Keras's `Sequential` write one: the builder of a chain, a [`Graph`] whose every node
//! reads the one before it (the first the model's input). Nothing runs here; the graph
//! runs every model alike.

use super::graph::{Graph, GraphNode, Source, INPUT_NAME};
use crate::error::{Error, Result};
use crate::ops::Layer;
use crate::tensor::Shape;

/// A layer with the name its caller gives it, or None: named by kind (`conv0`).
pub type NamedLayer = (Option<String>, Box<dyn Layer>);

/// The builder of a chain of layers: `Sequential::new(input_shape, layers)` is the
/// [`Graph`] of those layers in order.
pub struct Sequential;

impl Sequential {
    /// The chain of `layers` over inputs of per-sample shape `input_shape` (e.g.
    /// `[1, 28, 28]`), checking that every layer accepts the previous layer's output.
    /// Layers are named by kind, numbered per kind in order (`conv0`, `bn0`, `conv1`).
    #[allow(clippy::new_ret_no_self)]
    pub fn new(input_shape: impl Into<Shape>, layers: Vec<Box<dyn Layer>>) -> Result<Graph> {
        let layers = layers.into_iter().map(|l| (None, l)).collect();
        Sequential::named(input_shape, layers)
    }

    /// [`Sequential::new`] with names of the caller's where given (`stem.0`,
    /// `blocks.3`: the names of a PyTorch module's `state_dict`), the others named by
    /// kind as `new` names them, numbered per kind among themselves. Two tensors of one
    /// name are refused (two layers may share a name that prefixes different tensors).
    pub fn named(input_shape: impl Into<Shape>, layers: Vec<NamedLayer>) -> Result<Graph> {
        if layers.is_empty() {
            return Err(Error::config("model", "a Sequential needs at least one layer"));
        }
        let nodes = layers
            .into_iter()
            .enumerate()
            .map(|(j, (name, layer))| {
                GraphNode::new(name, layer, vec![if j == 0 { Source::Input(0) } else { Source::Node(j - 1) }])
            })
            .collect();
        Graph::build(vec![(INPUT_NAME.to_string(), input_shape.into())], nodes)
    }
}
