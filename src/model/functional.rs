//! Writing a model node by node, as Keras's functional API writes one: a model input is a
//! [`Value`], calling a layer on values ([`Call::call`], [`Call::call_many`]) writes a
//! node and gives its output's value, and the value a model ends with builds the
//! [`Graph`] ([`Value::model`]).
//!
//! ```
//! use lockstep::nn::{Call, Conv2d, GlobalAvgPool2d, Linear, Padding, Relu, Value};
//! # fn main() -> lockstep::Result<()> {
//! let inputs = Value::input([1, 28, 28]);
//! let x = Conv2d::new(1, 8, (3, 3), 1, Padding::Same, true)?.call(&inputs);
//! let x = Relu::new().call(&x);
//! let x = GlobalAvgPool2d::new().call(&x);
//! let outputs = Linear::new(8, 10).named("head").call(&x);
//! let model = outputs.model()?;
//! assert_eq!(model.layer_names()[3], "head");
//! # Ok(())
//! # }
//! ```
//!
//! Owns the draft a graph is written into and its values; nothing is checked until
//! [`Value::model`], where `Graph::build` checks every node (its inputs' count and shapes,
//! values nobody reads) and names the node at fault.

use std::cell::RefCell;
use std::rc::Rc;

use super::graph::{Graph, GraphNode, Source, INPUT_NAME};
use crate::error::{Error, Result};
use crate::ops::Layer;
use crate::tensor::Shape;

/// The graph a model's values are written into, shared by its values.
#[derive(Default)]
struct Draft {
    inputs: Vec<(String, Shape)>,
    nodes: Vec<GraphNode>,
    /// The first misuse (a value of another draft given to a node), reported by
    /// [`Value::model`].
    problem: Option<String>,
}

/// A value of a model being written: one of its inputs, or the output of a node.
/// Cloning a value clones the handle; the values of one model share its draft.
#[derive(Clone)]
pub struct Value {
    draft: Rc<RefCell<Draft>>,
    source: Source,
}

impl std::fmt::Debug for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = self.draft.borrow();
        match self.source {
            Source::Input(k) => write!(f, "Value(input {})", d.inputs[k].0),
            Source::Node(j) => write!(f, "Value(node {j}, {})", d.nodes[j].layer.describe()),
        }
    }
}

impl Value {
    /// The input of a new model, of per-sample shape `shape` (no batch dimension), named
    /// `input` (Keras's `keras.Input(shape)`).
    pub fn input(shape: impl Into<Shape>) -> Value {
        let draft = Draft { inputs: vec![(INPUT_NAME.to_string(), shape.into())], ..Draft::default() };
        Value { draft: Rc::new(RefCell::new(draft)), source: Source::Input(0) }
    }

    /// Another input of this value's model, named `name`, of per-sample shape `shape`.
    pub fn another_input(&self, name: impl Into<String>, shape: impl Into<Shape>) -> Value {
        let mut d = self.draft.borrow_mut();
        d.inputs.push((name.into(), shape.into()));
        Value { draft: self.draft.clone(), source: Source::Input(d.inputs.len() - 1) }
    }

    /// The model whose output is this value (Keras's `keras.Model(inputs, outputs)`):
    /// every node written for its inputs, in the order written, this value's node last.
    /// Its layers are fresh copies, so the draft may be built again. Errors name the node
    /// at fault: a node written but not read on the way to this value, a layer given
    /// inputs it does not take, shapes that do not meet.
    pub fn model(&self) -> Result<Graph> {
        let d = self.draft.borrow();
        if let Some(p) = &d.problem {
            return Err(Error::config("model", p.clone()));
        }
        let last = match self.source {
            Source::Node(j) => j,
            Source::Input(k) => {
                return Err(Error::config(
                    "model",
                    format!("the model's output is its input {}: call a layer on it", d.inputs[k].0),
                ))
            }
        };
        let nodes = d.nodes[..=last]
            .iter()
            .map(|n| GraphNode { name: n.name.clone(), layer: n.layer.boxed_clone(), inputs: n.inputs.clone() })
            .collect();
        if last + 1 < d.nodes.len() {
            let after = &d.nodes[last + 1];
            return Err(Error::config(
                "model",
                format!(
                    "a node ({}) was written after the model's output, and the output does not read it: end the model with the last node, or remove it",
                    after.name.clone().unwrap_or_else(|| after.layer.describe())
                ),
            ));
        }
        Graph::build(d.inputs.clone(), nodes)
    }

    /// Writes a node of `layer` (named `name`, or by kind) reading `inputs`.
    fn node(name: Option<String>, layer: Box<dyn Layer>, inputs: &[&Value]) -> Value {
        let draft = inputs.first().expect("a node reads at least one value").draft.clone();
        let mut d = draft.borrow_mut();
        if d.problem.is_none() {
            if let Some(other) = inputs.iter().find(|v| !Rc::ptr_eq(&v.draft, &draft)) {
                d.problem = Some(format!(
                    "{} is given values of two models ({other:?} is another model's): a node reads values of its own model",
                    layer.describe()
                ));
            }
        }
        d.nodes.push(GraphNode { name, layer, inputs: inputs.iter().map(|v| v.source).collect() });
        let source = Source::Node(d.nodes.len() - 1);
        drop(d);
        Value { draft, source }
    }
}

/// Calling a layer on values writes a node (Keras's `layer(x)`): implemented for every
/// layer, built-in or of the user's own.
pub trait Call: Sized {
    /// A node of this layer reading `x`; its output's value.
    fn call(self, x: &Value) -> Value {
        self.call_many(&[x])
    }

    /// A node of this layer (a merge) reading `xs`, in the order the layer takes them.
    /// An empty list is a node reading nothing, which [`Value::model`] cannot be given:
    /// it panics, naming the layer.
    fn call_many(self, xs: &[&Value]) -> Value;

    /// This layer, its node named `name` (its tensors `name.weight`, ...).
    fn named(self, name: impl Into<String>) -> Named<Self> {
        Named { name: name.into(), layer: self }
    }
}

/// A layer with the name its node takes: [`Call::named`].
pub struct Named<L> {
    name: String,
    layer: L,
}

impl<L: Layer + 'static> Call for L {
    fn call_many(self, xs: &[&Value]) -> Value {
        assert!(!xs.is_empty(), "{} is called on no value", self.describe());
        Value::node(None, Box::new(self), xs)
    }
}

impl Call for Box<dyn Layer> {
    fn call_many(self, xs: &[&Value]) -> Value {
        assert!(!xs.is_empty(), "{} is called on no value", self.describe());
        Value::node(None, self, xs)
    }
}

impl<L: Layer + 'static> Call for Named<L> {
    fn call_many(self, xs: &[&Value]) -> Value {
        assert!(!xs.is_empty(), "{} is called on no value", self.layer.describe());
        Value::node(Some(self.name), Box::new(self.layer), xs)
    }
}

impl Call for Named<Box<dyn Layer>> {
    fn call_many(self, xs: &[&Value]) -> Value {
        assert!(!xs.is_empty(), "{} is called on no value", self.layer.describe());
        Value::node(Some(self.name), self.layer, xs)
    }
}

/// `&a + &b`: a node of [`crate::nn::Add`] reading `a` and `b` (nanoGPT's `x + attn(x)`).
impl std::ops::Add<&Value> for &Value {
    type Output = Value;
    fn add(self, rhs: &Value) -> Value {
        crate::ops::Add::new().call_many(&[self, rhs])
    }
}

/// `a + b` on values by value: as `&a + &b`.
impl std::ops::Add for Value {
    type Output = Value;
    fn add(self, rhs: Value) -> Value {
        &self + &rhs
    }
}

/// `&a * &b`: a node of [`crate::nn::Multiply`] reading `a` and `b` (a gated MLP's
/// `silu(w1(x)) * w3(x)`).
impl std::ops::Mul<&Value> for &Value {
    type Output = Value;
    fn mul(self, rhs: &Value) -> Value {
        crate::ops::Multiply::new().call_many(&[self, rhs])
    }
}

/// `a * b` on values by value: as `&a * &b`.
impl std::ops::Mul for Value {
    type Output = Value;
    fn mul(self, rhs: Value) -> Value {
        &self * &rhs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{LayerNorm, Linear};

    /// nanoGPT's block, `x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))`, with a dense layer
    /// standing in for each of the two: the residual adds are nodes of their own, and the
    /// tensor names are the module's.
    #[test]
    fn a_transformer_block_reads_as_nanogpt_writes_it() {
        let x = Value::input([4, 8]);
        let attn = |x: &Value| Linear::new(8, 8).named("h.0.attn.c_proj").call(x);
        let mlp = |x: &Value| Linear::new(8, 8).named("h.0.mlp.c_proj").call(x);
        let x = &x + &attn(&LayerNorm::new(8).named("h.0.ln_1").call(&x));
        let x = &x + &mlp(&LayerNorm::new(8).named("h.0.ln_2").call(&x));
        let model = x.model().unwrap();
        assert_eq!(model.layer_names(), ["h.0.ln_1", "h.0.attn.c_proj", "add0", "h.0.ln_2", "h.0.mlp.c_proj", "add1"]);
        assert_eq!(model.output_shape().dims(), &[4, 8]);
        assert!(!model.is_chain());
        assert!(model.param_infos().iter().any(|t| t.name == "h.0.ln_2.weight"));
    }

    #[test]
    fn misuses_are_named_when_the_model_is_built() {
        // Values of two models given to one node.
        let (a, b) = (Value::input([3]), Value::input([3]));
        let e = (&a + &b).model().err().unwrap().to_string();
        assert!(e.contains("values of two models"), "{e}");
        // A node written after the output that the output does not read.
        let x = Value::input([3]);
        let y = Linear::new(3, 2).call(&x);
        let _dangling = Linear::new(3, 4).named("dangling").call(&x);
        let e = y.model().err().unwrap().to_string();
        assert!(e.contains("a node (dangling) was written after the model's output"), "{e}");
        // The input as the output.
        let e = x.model().err().unwrap().to_string();
        assert!(e.contains("the model's output is its input"), "{e}");
    }
}
