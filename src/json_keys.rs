//! Keys given twice in a JSON text (a leaf).
//!
//! Owns: finding the first object key that appears twice, and where it is. serde_json
//! reads an object into a map, so `{"units": 10, "units": 5}` silently keeps the last
//! value; every JSON a user writes or a file brings (a model spec, a safetensors header)
//! is run through [`first_duplicate`] before it is believed. How the place is worded is
//! the caller's (`spec` says "layer 1 (dense)", `safetensors_io` "tensor 'x'"), which walks
//! the parsed value along [`Duplicate::path`].

use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};

/// One step from a value into a part of it.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Step {
    /// An object's value under this key.
    Key(String),
    /// A list's element at this index.
    Index(usize),
}

/// A key given twice: the object holding it (the steps from the top) and the key.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Duplicate {
    pub path: Vec<Step>,
    pub key: String,
}

/// The first key given twice in `text` (in reading order), or `None` when there is none
/// or `text` is not JSON (its syntax error is the caller's to report).
pub fn first_duplicate(text: &str) -> Option<Duplicate> {
    let found = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_str(text);
    // Spec files and headers are bounded (16 MB, 100 MB), and serde_json's recursion
    // limit (128 levels) holds here as for any parse.
    let _ = Walk { found: &found }.deserialize(&mut de);
    found.into_inner()
}

/// Visits every value; on a key given twice, records it and fails, each enclosing level
/// adding its step to the path as the failure returns through it.
struct Walk<'a> {
    found: &'a RefCell<Option<Duplicate>>,
}

impl Walk<'_> {
    fn step_out(&self, step: Step) {
        if let Some(d) = self.found.borrow_mut().as_mut() {
            d.path.insert(0, step);
        }
    }
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_i128<E>(self, _: i128) -> Result<(), E> {
        Ok(())
    }
    fn visit_u128<E>(self, _: u128) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0;
        loop {
            match seq.next_element_seed(Walk { found: self.found }) {
                Ok(Some(())) => i += 1,
                Ok(None) => return Ok(()),
                Err(e) => {
                    self.step_out(Step::Index(i));
                    return Err(e);
                }
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                *self.found.borrow_mut() = Some(Duplicate { path: Vec::new(), key });
                return Err(A::Error::custom("a key given twice"));
            }
            if let Err(e) = map.next_value_seed(Walk { found: self.found }) {
                self.step_out(Step::Key(key));
                return Err(e);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_first_key_given_twice_and_its_place() {
        assert_eq!(first_duplicate(r#"{"a": 1, "b": [1, {"c": 2}]}"#), None);
        assert_eq!(first_duplicate(r#"{"a": 1, "a": 1}"#), Some(Duplicate { path: vec![], key: "a".into() }));
        assert_eq!(
            first_duplicate(r#"{"a": [0, {"x": 1}, {"y": {"z": 1, "z": 2}}], "b": 1, "b": 2}"#),
            Some(Duplicate {
                path: vec![Step::Key("a".into()), Step::Index(2), Step::Key("y".into())],
                key: "z".into()
            })
        );
        // Keys are compared after unescaping: "\u0061" is "a".
        assert_eq!(first_duplicate(r#"{"a": 1, "\u0061": 2}"#).map(|d| d.key), Some("a".into()));
        // Not JSON: the caller's parse reports it.
        assert_eq!(first_duplicate(r#"{"a": "#), None);
        // The same key in two objects is not a duplicate.
        assert_eq!(first_duplicate(r#"[{"a": 1}, {"a": 2}]"#), None);
    }
}
