//! Property-based fuzzing of the parsers that read untrusted input: the IDX loader, the
//! safetensors dataset loader and the model spec parser. Arbitrary bytes and mutations
//! of valid inputs must give a value or an error — never a panic, never an allocation
//! sized by an unchecked header. Case counts are kept modest (the whole file runs in a
//! few seconds); every crash found is kept below as a named regression test with its
//! bytes inline.

use std::path::{Path, PathBuf};

use lockstep::data::idx::{load_idx_images, load_idx_labels, save_idx_images, save_idx_labels};
use lockstep::data::safetensors_file::{load_safetensors_dataset, save_safetensors_dataset};
use lockstep::data::{Dataset, Features};
use lockstep::spec::ModelSpec;
use proptest::prelude::*;

/// A scratch file path named `tag` in a fresh temporary directory, removed with the guard.
fn scratch(tag: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(tag);
    (dir, path)
}

fn example(name: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(name)).unwrap()
}

/// A valid file's bytes, written by the library's own writer at `path`.
fn valid_idx(path: &Path, gz: bool) -> Vec<u8> {
    let p = path.with_extension(if gz { "gz" } else { "idx" });
    save_idx_images(&p, &(0..2 * 3 * 3).collect::<Vec<u8>>(), [2, 3, 3]).unwrap();
    std::fs::read(&p).unwrap()
}

fn valid_safetensors(path: &Path) -> Vec<u8> {
    let ds = Dataset::new("d", [1, 2, 2], Features::U8((0..8).collect()), vec![0, 1], 3).unwrap();
    let p = path.with_extension("base.safetensors");
    save_safetensors_dataset(&ds, &p).unwrap();
    std::fs::read(&p).unwrap()
}

/// `base` with up to 8 (position, byte) overwrites, and optionally cut to `cut` bytes.
fn mutate(mut base: Vec<u8>, edits: &[(usize, u8)], cut: Option<usize>) -> Vec<u8> {
    if !base.is_empty() {
        for &(i, b) in edits {
            let n = base.len();
            base[i % n] = b;
        }
    }
    if let Some(c) = cut {
        base.truncate(c % (base.len() + 1));
    }
    base
}

/// Loads `bytes` as IDX images and labels; any result but a panic is fine.
fn load_idx_bytes(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
    let _ = load_idx_images(path);
    let _ = load_idx_labels(path);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn idx_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let (_dir, path) = scratch("idx_arbitrary");
        load_idx_bytes(&path, &bytes);
    }

    #[test]
    fn idx_header_shaped_bytes(dtype in any::<u8>(), ndims in 0u8..6, dims in proptest::collection::vec(any::<u32>(), 0..6),
                               body in proptest::collection::vec(any::<u8>(), 0..32)) {
        // The bytes most likely to reach the size arithmetic: a plausible magic, then
        // dimensions anywhere in u32.
        let mut b = vec![0, 0, dtype, ndims];
        for d in &dims { b.extend_from_slice(&d.to_be_bytes()); }
        b.extend_from_slice(&body);
        let (_dir, path) = scratch("idx_header");
        load_idx_bytes(&path, &b);
    }

    #[test]
    fn idx_mutations(gz in any::<bool>(), edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
                     cut in proptest::option::of(any::<usize>())) {
        let (_dir, path) = scratch(if gz { "idx_mut_gz" } else { "idx_mut" });
        let bytes = mutate(valid_idx(&path, gz), &edits, cut);
        load_idx_bytes(&path, &bytes);
    }

    #[test]
    fn safetensors_arbitrary_and_mutated(bytes in proptest::collection::vec(any::<u8>(), 0..96),
                                         edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
                                         cut in proptest::option::of(any::<usize>())) {
        let (dir, path) = scratch("st.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        let _ = load_safetensors_dataset(&path);
        let mutated = mutate(valid_safetensors(&dir.path().join("st_base")), &edits, cut);
        std::fs::write(&path, &mutated).unwrap();
        let _ = load_safetensors_dataset(&path);
    }

    #[test]
    fn spec_arbitrary_strings(text in ".{0,80}") {
        let _ = ModelSpec::parse(&text, "fuzz.json");
    }

    #[test]
    fn spec_mutations(which in 0usize..3, edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
                      cut in proptest::option::of(any::<usize>())) {
        let name = ["toy_mlp.json", "mnist_convnet.json", "mnist_convnet_nobn.json"][which];
        let bytes = mutate(example(name).into_bytes(), &edits, cut);
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(spec) = ModelSpec::parse(&text, name) {
            // A spec that parses builds.
            spec.build().unwrap();
        }
    }

    #[test]
    fn spec_numbers_anywhere(which in 0usize..3, slot in any::<usize>(),
                             number in prop_oneof![any::<i64>().prop_map(|v| v.to_string()),
                                                   any::<f64>().prop_map(|v| format!("{v:e}")),
                                                   Just("1e400".to_string()), Just("-0".to_string()),
                                                   Just("18446744073709551616".to_string())]) {
        // Replace the slot-th number of a shipped spec with an arbitrary one.
        let name = ["toy_mlp.json", "mnist_convnet.json", "mnist_convnet_nobn.json"][which];
        let text = example(name);
        let spans: Vec<(usize, usize)> = {
            let b = text.as_bytes();
            let mut v = Vec::new();
            let mut i = 0;
            while i < b.len() {
                if b[i].is_ascii_digit() {
                    let s = i;
                    while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.') { i += 1; }
                    v.push((s, i));
                } else { i += 1; }
            }
            v
        };
        let (s, e) = spans[slot % spans.len()];
        let mutated = format!("{}{}{}", &text[..s], number, &text[e..]);
        if let Ok(spec) = ModelSpec::parse(&mutated, name) {
            spec.build().unwrap();
        }
    }
}

#[test]
fn save_idx_labels_then_fuzzed_headers_round_trip() {
    // The writer and the reader agree (a sanity check for the mutation bases above).
    let (_dir, p) = scratch("labels.idx");
    save_idx_labels(&p, &[1, 2, 3]).unwrap();
    assert_eq!(load_idx_labels(&p).unwrap(), vec![1, 2, 3]);
}
