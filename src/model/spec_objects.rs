//! The layer objects of a spec, read by their `type` ([`read_layer`], which looks the type
//! up in [`super::LAYER_TYPES`] and hands the object's fields to its entry), a residual
//! block's lists of them ([`read_layers`]), and the way back: the objects that build given layers
//! again ([`layers_to_spec`]).
//!
//! Owns what needs the list of layer types; the entry every op writes and the field reader
//! are `ops::spec`'s, the file format around the objects `crate::spec`'s.

use serde_json::{json, Map, Value};

use super::{NamedLayer, LAYER_TYPES};
use crate::ops::spec::{Build, Built, FieldResult, Fields};
use crate::ops::Layer;
use crate::tensor::Shape;

/// One layer object of a spec, read: its type (an entry of [`LAYER_TYPES`]), the name it
/// gives its layer if any (`"name": "stem.0"`), what each of its fields resolved to (its
/// default where absent), and how it builds. A residual block holds lists of them.
#[derive(Clone)]
pub struct LayerObject {
    type_name: &'static str,
    name: Option<String>,
    fields: Vec<(&'static str, Value)>,
    build: Build,
}

impl LayerObject {
    /// The spec's name of the layer type, from [`LAYER_TYPES`].
    pub fn type_name(&self) -> &'static str {
        self.type_name
    }

    /// The name the object gives the first layer it builds, if it gives one.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The object as a spec writes it, every field resolved.
    pub fn resolved(&self) -> Value {
        let mut map = Map::new();
        map.insert("type".into(), json!(self.type_name));
        if let Some(n) = &self.name {
            map.insert("name".into(), json!(n));
        }
        for (k, v) in &self.fields {
            map.insert((*k).into(), v.clone());
        }
        Value::Object(map)
    }

    /// Fresh layers for inputs of `input` (batch included), the first one named as the
    /// object says; the others (a `"activation": "relu"`'s ReLU) are named by kind.
    pub fn build(&self, input: &Shape) -> FieldResult<Vec<NamedLayer>> {
        self.build_many(std::slice::from_ref(input))
    }

    /// [`LayerObject::build`] for the inputs of these shapes (a merge's several, in its
    /// `inbound` order).
    pub fn build_many(&self, inputs: &[Shape]) -> FieldResult<Vec<NamedLayer>> {
        let layers = self.build.build_many(inputs)?;
        Ok(layers.into_iter().enumerate().map(|(i, l)| (if i == 0 { self.name.clone() } else { None }, l)).collect())
    }

    /// What the object builds for inputs of these shapes: a chain of layers, or the nodes
    /// of a small graph (a residual block's), unnamed by the object (its name is the
    /// caller's to give).
    pub fn built(&self, inputs: &[Shape]) -> FieldResult<Built> {
        self.build.build(inputs)
    }
}

/// Two objects are equal when they are of one type, give one name and their fields
/// resolve alike: they build the same layers.
impl PartialEq for LayerObject {
    fn eq(&self, other: &LayerObject) -> bool {
        self.type_name == other.type_name && self.name == other.name && self.fields == other.fields
    }
}

impl std::fmt::Debug for LayerObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerObject")
            .field("type_name", &self.type_name)
            .field("name", &self.name)
            .field("fields", &self.fields)
            .finish()
    }
}

/// The type names, for errors: `rescaling, conv2d, ...`.
pub fn type_list() -> String {
    LAYER_TYPES.iter().map(|t| t.name).collect::<Vec<_>>().join(", ")
}

/// Reads one layer object; `at` names it in errors (`layer 3`, `layers[1]`), followed by
/// its type once known (`layer 3 (conv2d): field 'filters' ...`).
pub fn read_layer(v: &Value, at: &str) -> FieldResult<LayerObject> {
    let Value::Object(map) = v else {
        return Err(format!("{at}: expected an object such as {{\"type\": \"dense\", \"units\": 10}} (got {v})"));
    };
    let kind = match map.get("type") {
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(format!("{at}: field 'type' must be a string (got {other})")),
        None => return Err(format!("{at}: missing field 'type' (one of: {})", type_list())),
    };
    let at = |detail: String| format!("{at} ({kind}): {detail}");
    let ty = LAYER_TYPES
        .iter()
        .find(|t| t.name == kind)
        .ok_or_else(|| at(format!("unknown type '{kind}' (one of: {})", type_list())))?;
    let name = match map.get("name") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 256 && !s.chars().any(char::is_control) => {
            Some(s.clone())
        }
        Some(v) => {
            return Err(at(format!("field 'name' must be a non-empty string of at most 256 characters (got {v})")))
        }
    };
    let mut f = Fields::new(map);
    let build = (ty.parse)(&mut f).map_err(at)?;
    let fields = f.finish().map_err(at)?;
    Ok(LayerObject { type_name: ty.name, name, fields, build })
}

/// The layer objects that build `layers` (named `names`) again, each written by its own
/// `Layer::spec` with its name where it is not the one it would be given by kind, or the
/// first layer without a spec form: (its name, its description).
pub fn layers_to_spec(layers: &[Box<dyn Layer>], names: &[String]) -> Result<Vec<Value>, (String, String)> {
    let auto = super::auto_names(layers.iter().map(|l| (None, l.kind())));
    layers
        .iter()
        .zip(names)
        .zip(auto)
        .map(|((l, name), auto)| {
            let mut v = l.spec().ok_or_else(|| (name.clone(), l.describe()))?;
            if *name != auto {
                if let Value::Object(map) = &mut v {
                    map.insert("name".into(), json!(name));
                }
            }
            Ok(v)
        })
        .collect()
}

/// A residual block's list of layer objects (`layers`, `shortcut`) read from field `name` of
/// `f`: required, or empty when absent if `required` is false.
pub fn read_layers(f: &mut Fields<'_>, name: &'static str, required: bool) -> FieldResult<Vec<LayerObject>> {
    let read = |v: Option<&Value>| match v {
        None if required => Err(format!("missing field '{name}' (a list of layer objects)")),
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => {
            items.iter().enumerate().map(|(j, v)| read_layer(v, &format!("{name}[{j}]"))).collect()
        }
        Some(v) => Err(format!("field '{name}' must be a list of layer objects (got {v})")),
    };
    f.custom(name, read, |objects: &Vec<LayerObject>| Value::Array(objects.iter().map(LayerObject::resolved).collect()))
}
