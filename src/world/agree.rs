//! What the processes of a run must agree on, compared before any work: a list of named
//! settings, each in words, the same list on every process.
//!
//! One collective compares a digest of every setting; only where one differs does a
//! second gather the two texts, so that the refusal names the first difference in the
//! words a person set it with: `process 1 has --dropout 0.1, process 0 has 0.5`. Every
//! process reaches the same verdict from the same gathered words, and none waits for
//! another. The callers choose the list: the trainer (`train::processes`: the
//! configuration, the model's layers, the data), and the binary (its flags).

use super::World;
use crate::digest::Fnv1a;
use crate::error::{Error, Result};

/// One setting: its name ("--lr", "layer 4") and its value in words.
pub type Setting = (String, String);

fn digest((name, value): &Setting) -> u64 {
    Fnv1a::new().bytes(name.as_bytes()).bytes(&[0]).bytes(value.as_bytes()).finish()
}

/// Text as words for a gather (its bytes, 8 to a word, after its length).
fn words(text: &str) -> Vec<u64> {
    let mut w = vec![text.len() as u64];
    w.extend(text.as_bytes().chunks(8).map(|c| {
        let mut b = [0u8; 8];
        b[..c.len()].copy_from_slice(c);
        u64::from_le_bytes(b)
    }));
    w
}

fn text(words: &[u64]) -> String {
    let len = words.first().copied().unwrap_or(0) as usize;
    let bytes: Vec<u8> = words[1..].iter().flat_map(|w| w.to_le_bytes()).take(len).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The part of two long values that differs: their first differing item, an item being
/// what lies between `{ } ( ) ,` (`lr: 0.1` of two optimisers' words); the whole values
/// when they are short or have no such items.
fn narrowed(a: &str, b: &str) -> (String, String) {
    const SHORT: usize = 40;
    if a.len() <= SHORT && b.len() <= SHORT {
        return (a.to_string(), b.to_string());
    }
    let items = |s: &str| -> Vec<String> {
        s.split(['{', '}', '(', ')', ',']).map(str::trim).filter(|t| !t.is_empty()).map(String::from).collect()
    };
    let (ia, ib) = (items(a), items(b));
    match ia.iter().zip(&ib).find(|(x, y)| x != y) {
        Some((x, y)) if ia.len() == ib.len() => (x.clone(), y.clone()),
        _ => (a.to_string(), b.to_string()),
    }
}

impl World {
    /// Refuses, on every process alike, a run whose processes were given different
    /// `settings`, naming the first that differs (in list order) and the lowest process
    /// that differs from process 0. Free in a world of one.
    pub fn agree(&self, settings: &[Setting]) -> Result<()> {
        if self.size() == 1 {
            return Ok(());
        }
        let mut mine = vec![settings.len() as u64];
        mine.extend(settings.iter().map(digest));
        // Processes with lists of other lengths gather what the longest sent.
        let longest = self.all_gather(&[mine.len() as u64])?.into_iter().max().unwrap_or(0) as usize;
        mine.resize(longest, 0);
        let all = self.all_gather(&mine)?;
        let of = |q: usize| &all[q * longest..(q + 1) * longest];
        let first = (1..self.size()).find_map(|q| {
            (1..longest).find(|&i| of(q)[i] != of(0)[i]).map(|i| (q, i - 1)).or_else(|| {
                // Equal digests and another count: the shorter list lacks the rest.
                (of(q)[0] != of(0)[0]).then(|| (q, of(q)[0].min(of(0)[0]) as usize))
            })
        });
        let Some((q, i)) = first else { return Ok(()) };
        // The differing setting's words, from every process (the same index everywhere).
        let said = match settings.get(i) {
            Some((name, value)) => format!("{name}\u{0}{value}"),
            None => "\u{0}".to_string(),
        };
        let mine = words(&said);
        let longest = self.all_gather(&[mine.len() as u64])?.into_iter().max().unwrap_or(1) as usize;
        let mut padded = mine;
        padded.resize(longest, 0);
        let all = self.all_gather(&padded)?;
        let setting = |p: usize| -> (String, String) {
            let t = text(&all[p * longest..(p + 1) * longest]);
            let (name, value) = t.split_once('\u{0}').unwrap_or(("", ""));
            (name.to_string(), value.to_string())
        };
        let ((theirs_name, theirs), (first_name, first)) = (setting(q), setting(0));
        let detail = match (theirs_name.is_empty(), first_name.is_empty()) {
            (true, _) => format!("process {q} has no {first_name}, process 0 has {first_name} {first}"),
            (_, true) => format!("process {q} has {theirs_name} {theirs}, process 0 has no {theirs_name}"),
            _ if theirs_name != first_name => {
                format!("process {q} has {theirs_name} {theirs} where process 0 has {first_name} {first}")
            }
            _ => {
                let (a, b) = narrowed(&theirs, &first);
                format!("process {q} has {theirs_name} {a}, process 0 has {b}")
            }
        };
        Err(Error::Processes { detail })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_travel_as_words_and_long_values_are_narrowed_to_what_differs() {
        for t in ["", "a", "12345678", "--dropout\u{0}0.5 é"] {
            assert_eq!(text(&words(t)), t);
        }
        let a = "Adam { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }";
        let b = "Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }";
        assert_eq!(narrowed(a, b), ("lr: 0.1".into(), "lr: 0.01".into()));
        assert_eq!(narrowed("0.1", "0.5"), ("0.1".into(), "0.5".into()));
        // A world of one agrees with itself.
        let world = crate::world::current().unwrap();
        assert!(world.agree(&[("--lr".into(), "0.1".into())]).is_ok());
    }
}
