//! Every file of kernels/ compiles with NVRTC, without a single warning, for the GPU
//! generations lockstep targets (sm_80: A100, sm_90: H100/H200), and every kernel name
//! follows the naming rule of src/cuda/kernels.rs.
//!
//! Needs libnvrtc (no GPU, no driver): `scripts/install-nvrtc.sh` prints the directory to
//! put on LD_LIBRARY_PATH. Without it the compile tests FAIL, unless
//! LOCKSTEP_ALLOW_NO_NVRTC=1, in which case they print a loud "skipped" line instead.

use std::collections::BTreeSet;
use std::io::Write;

use lockstep::cuda::kernels::{compile_with_log, kernel_name, Dir, KERNEL_FILES};
use lockstep::cuda::nvrtc_available;
use lockstep::Error;

const ARCHS: &[&str] = &["sm_80", "sm_90"];

/// True when NVRTC is there; prints the loud skip line and returns false when it is not
/// and LOCKSTEP_ALLOW_NO_NVRTC=1; fails the test otherwise.
fn nvrtc_or_skip(test: &str) -> bool {
    match nvrtc_available() {
        Ok(()) => true,
        Err(e) if std::env::var("LOCKSTEP_ALLOW_NO_NVRTC").as_deref() == Ok("1") => {
            // Straight to the stderr handle, not eprintln!: the test harness captures the
            // macros of passing tests, and a skip must never be silent.
            let _ = writeln!(
                std::io::stderr(),
                "\n!!!!!!!! {test}: skipped: libnvrtc not found (LOCKSTEP_ALLOW_NO_NVRTC=1): {e}\n"
            );
            false
        }
        Err(e) => panic!("{e}\n(set LOCKSTEP_ALLOW_NO_NVRTC=1 to skip this test on purpose)"),
    }
}

#[test]
fn every_kernel_file_compiles_without_warnings() {
    if !nvrtc_or_skip("every_kernel_file_compiles_without_warnings") {
        return;
    }
    let mut failures = Vec::new();
    for file in KERNEL_FILES {
        for arch in ARCHS {
            match compile_with_log(file.name, file.source, arch) {
                Ok(c) => {
                    let ptx = c.ptx.to_src();
                    eprintln!("{} [{arch}]: {} bytes of PTX, log: {:?}", file.name, ptx.len(), c.log);
                    if !c.log.is_empty() {
                        failures.push(format!("{} [{arch}] warnings:\n{}", file.name, c.log));
                    }
                    for name in file.kernel_names("f32") {
                        if !ptx.contains(&format!(".entry {name}(")) {
                            failures.push(format!("{} [{arch}]: no entry point {name} in the PTX", file.name));
                        }
                    }
                }
                Err(Error::Nvrtc { file, log }) => {
                    eprintln!("{file} [{arch}] FAILED:\n{log}");
                    failures.push(format!("{file} [{arch}]:\n{log}"));
                }
                Err(e) => failures.push(format!("{} [{arch}]: {e}", file.name)),
            }
        }
    }
    assert!(failures.is_empty(), "{} problem(s):\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn a_broken_kernel_is_an_nvrtc_error_with_the_log() {
    if !nvrtc_or_skip("a_broken_kernel_is_an_nvrtc_error_with_the_log") {
        return;
    }
    let src = "extern \"C\" __global__ void oops_fwd_f32(float* x) { x[0] = undeclared_thing; }";
    match compile_with_log("oops.cu", src, "sm_80") {
        Err(Error::Nvrtc { file, log }) => {
            assert_eq!(file, "oops.cu");
            assert!(log.contains("undeclared_thing"), "log should name the bad identifier: {log}");
        }
        other => panic!("expected Error::Nvrtc, got {other:?}"),
    }
}

#[test]
fn a_warning_shows_up_in_the_log() {
    if !nvrtc_or_skip("a_warning_shows_up_in_the_log") {
        return;
    }
    // An unused variable: a warning, not an error. The compile test relies on warnings
    // reaching Compiled::log, so check that they do.
    let src = "extern \"C\" __global__ void warn_fwd_f32(float* x) { int unused_var = 3; x[0] = 1.0f; }";
    let c = compile_with_log("warn.cu", src, "sm_80").expect("a warning is not an error");
    assert!(c.log.contains("unused_var"), "expected a warning naming unused_var, log: {:?}", c.log);
}

/// The `extern "C"` kernel names a source defines, read from the text:
/// `extern "C" __global__ void NAME(`.
fn extern_c_kernels(source: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = source;
    const DECL: &str = "extern \"C\" __global__";
    while let Some(pos) = rest.find(DECL) {
        rest = &rest[pos + DECL.len()..];
        let decl: String = rest.chars().take_while(|&c| c != '(').collect();
        names.push(decl.split_whitespace().last().unwrap_or_default().to_string());
    }
    names
}

/// Parses a name by the rule: `<op>_<fwd|bwd>_<dtype>` or `<op>_<dtype>`, op made of
/// lowercase words joined by `_`, dtype one of f32/f16/bf16.
fn parse_name(name: &str) -> Option<(String, Dir, String)> {
    let (rest, dtype) = name.rsplit_once('_')?;
    if !["f32", "f16", "bf16"].contains(&dtype) {
        return None;
    }
    let (op, dir) = match rest.rsplit_once('_') {
        Some((op, "fwd")) => (op, Dir::Fwd),
        Some((op, "bwd")) => (op, Dir::Bwd),
        _ => (rest, Dir::Plain),
    };
    let word_ok = |w: &str| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    op.split('_').all(word_ok).then(|| (op.to_string(), dir, dtype.to_string()))
}

#[test]
fn kernel_names_follow_the_rule_and_match_the_table() {
    assert_eq!(kernel_name("relu", Dir::Fwd, "f32"), "relu_fwd_f32");
    assert_eq!(kernel_name("relu", Dir::Bwd, "f32"), "relu_bwd_f32");
    assert_eq!(kernel_name("sgd_step", Dir::Plain, "f32"), "sgd_step_f32");
    assert_eq!(parse_name("Relu_fwd_f32"), None);
    assert_eq!(parse_name("relu_fwd_f64"), None);
    let mut all = BTreeSet::new();
    for file in KERNEL_FILES {
        let in_source: BTreeSet<String> = extern_c_kernels(file.source).into_iter().collect();
        let in_table: BTreeSet<String> = file.kernel_names("f32").into_iter().collect();
        assert_eq!(in_source, in_table, "{}: extern \"C\" kernels vs the KERNEL_FILES table", file.name);
        for name in &in_source {
            let (op, dir, dtype) =
                parse_name(name).unwrap_or_else(|| panic!("{}: '{name}' breaks the naming rule", file.name));
            assert_eq!(&kernel_name(&op, dir, &dtype), name, "the name rebuilds through the one helper");
            assert!(all.insert(name.clone()), "{name} is defined in two files");
        }
        for &(op, dir) in file.kernels {
            assert!(!op.ends_with("_fwd") && !op.ends_with("_bwd"), "{op}: the direction belongs in Dir");
            if dir == Dir::Plain {
                assert!(
                    file.kernels.iter().all(|&(o, d)| o != op || d == Dir::Plain),
                    "{op} is both plain and directional"
                );
            }
        }
    }
    // 25 = 10 elementwise + 2 conv + 3 batchnorm + 4 pooling + 1 softmax_xent + 2 optim
    //      + 1 reduce + 2 dropout, counted from the files.
    assert_eq!(all.len(), 25, "{all:?}");
}

/// Every `kernels/*.cu` is in KERNEL_FILES and every entry is a file there, with the text
/// on disk: a kernel file left out of the table would be compiled by no test and loaded
/// by no GPU.
#[test]
fn kernel_files_on_disk_are_the_kernel_files_table() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
        .expect("kernels/ is readable")
        .map(|e| e.expect("kernels/ entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".cu") || name.ends_with(".cuh") || name.ends_with(".h"))
        .collect();
    let table: BTreeSet<String> = KERNEL_FILES.iter().map(|f| f.name.to_string()).collect();
    assert_eq!(on_disk, table, "kernels/ vs KERNEL_FILES (a file must be listed, a listed file must exist)");
    for file in KERNEL_FILES {
        let text = std::fs::read_to_string(dir.join(file.name)).unwrap();
        assert_eq!(text, file.source, "{}: the embedded source is the file's", file.name);
    }
}
