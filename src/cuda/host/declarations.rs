//! Every kernel's declaration held to its source, for every kernel file the crate declares
//! (`train::kernel_files()`): the names and order of its parameters against the file's
//! text (no compiler needed), and their C++ types against the compiled kernel's signature
//! (the host library), so that a declaration out of step with its `.cu` fails here, not
//! on a GPU. Which kernels each file defines is held to its declaration by the NVRTC test
//! too (`cuda::nvrtc_tests`); that every kernel is also RUN on the host is the
//! conformance test's (an op's file) and its owner's test (the other files).

use std::collections::{BTreeMap, BTreeSet};

use super::checker_or_skip;
use crate::cuda::declare::{Kernel, Kind};
use crate::train::kernel_files;

/// The 12 parameters a [`Kind::Geom`] stands for, as the window kernels name them.
const GEOM_PARAMS: [&str; 12] = ["n", "c", "h", "w", "kh", "kw", "sh", "sw", "pt", "pl", "oh", "ow"];

/// The parameter names of every `extern "C"` kernel of a source, by kernel name.
fn parameter_names_in(source: &str) -> BTreeMap<String, Vec<String>> {
    let re = regex::Regex::new(r#"extern\s+"C"\s+__global__\s+void\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(([^)]*)\)"#).unwrap();
    let last_word = |p: &str| p.rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).next().unwrap().to_string();
    re.captures_iter(source)
        .map(|c| (c[1].to_string(), c[2].split(',').map(|p| last_word(p.trim())).collect()))
        .collect()
}

#[test]
fn every_declared_kernel_is_in_its_file_with_the_kernels_parameter_names() {
    // A declared order that swaps two parameters of one type (hw and total, both size_t)
    // passes the type letters below but not this.
    let mut names = BTreeSet::new();
    for file in kernel_files() {
        assert!(names.insert(file.name), "{} is declared twice", file.name);
        let in_source = parameter_names_in(file.source);
        let declared: BTreeSet<String> = file.kernels.iter().map(Kernel::name).collect();
        assert_eq!(in_source.keys().cloned().collect::<BTreeSet<_>>(), declared, "{}: defined vs declared", file.name);
        for k in file.kernels {
            assert_eq!(k.file, file.name, "{} is listed under {}", k.describe(), file.name);
            let names: Vec<&str> = k
                .params
                .iter()
                .flat_map(|&(name, kind)| if kind == Kind::Geom { GEOM_PARAMS.to_vec() } else { vec![name] })
                .collect();
            assert_eq!(
                names,
                in_source[&k.name()],
                "{}: declared names (left) vs {}'s (right)",
                k.describe(),
                file.name
            );
        }
    }
}

#[test]
fn every_declared_argument_list_is_the_kernels_signature() {
    let Some(k) = checker_or_skip("every_declared_argument_list_is_the_kernels_signature", kernel_files) else {
        return;
    };
    for file in kernel_files() {
        for kernel in file.kernels {
            // The letters of the C++ types the compiled kernel takes (cuda_host.h's
            // type_code), against those the declared kinds push.
            assert_eq!(
                k.signature(kernel),
                kernel.letters(),
                "{} in {}: the compiled kernel's letters (left) vs the declaration's (right)",
                kernel.describe(),
                file.name
            );
        }
    }
}
