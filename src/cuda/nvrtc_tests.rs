//! Every kernel file compiles with NVRTC, without a single warning, to a cubin for the GPU
//! generations lockstep targets (sm_80: A100, sm_90: H100/H200), whose ELF header says
//! EM_CUDA and that architecture and whose symbol table defines exactly the file's kernels;
//! the PTX fallback names every kernel too; every kernel name follows the naming rule of
//! [`super::kernels`]; and the kernel file table (`train::kernel_files`) is kernels/ on disk.
//!
//! Needs libnvrtc (no GPU, no driver): `scripts/install-nvrtc.sh` prints the directory to
//! put on LD_LIBRARY_PATH. Without it the compile tests FAIL, unless
//! LOCKSTEP_ALLOW_NO_NVRTC=1, in which case the one skip helper says they did not run.
//!
//! More NVRTC versions: LOCKSTEP_NVRTC_EXTRA_DIRS lists further library directories
//! (`:`-separated, e.g. NVRTC 13.0's beside the newest 13.x on LD_LIBRARY_PATH, as .ci/run
//! sets it). The cubin test then runs again in a child process per directory (this test
//! executable, the cubin test alone), with that directory first on LD_LIBRARY_PATH (the
//! loader reads it once, at process start), and checks that the child really loaded its
//! NVRTC from there and that every version differs. Unset, that test is skipped, saying so.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;

use super::declare::{kernel_name, Dir, Kernel};
use super::kernels::{compile_with_log, nvrtc_version, supported_archs, KernelImage};
use super::probe::{loaded_from, nvrtc_available, CudaLib};
use crate::testing::skip::{skip, Need};
use crate::testing::test_path;
use crate::train::kernel_files;
use crate::Error;

/// The architectures every kernel file must compile for, as 10·major + minor.
const SMS: &[u32] = &[80, 90];

/// Prints a line the test harness does not capture (it captures the print macros of
/// passing tests): what each child run of another NVRTC found.
fn loud(line: &str) {
    let _ = writeln!(std::io::stderr(), "\n!!!!!!!! {line}\n");
}

/// True when NVRTC is there; prints the loud skip line and returns false when it is not
/// and LOCKSTEP_ALLOW_NO_NVRTC=1; fails the test otherwise.
fn nvrtc_or_skip(test: &str) -> bool {
    match nvrtc_available() {
        Ok(()) => true,
        Err(e) if std::env::var("LOCKSTEP_ALLOW_NO_NVRTC").as_deref() == Ok("1") => {
            skip(test, Need::Tool, &format!("libnvrtc not found (LOCKSTEP_ALLOW_NO_NVRTC=1): {e}"));
            false
        }
        Err(e) => panic!("{e}\n(set LOCKSTEP_ALLOW_NO_NVRTC=1 to skip this test on purpose)"),
    }
}

/// What a cubin's ELF header and symbol table say.
#[derive(Debug)]
struct Cubin {
    /// e_ident[EI_ABIVERSION]: 7 (ELFABIVERSION_CUDA_V1) or 8 (ELFABIVERSION_CUDA_V2).
    abi_version: u8,
    e_flags: u32,
    /// The real architecture, decoded from e_flags by the ABI version.
    sm: u32,
    /// Names of the global function symbols: the kernels.
    functions: BTreeSet<String>,
}

/// EM_CUDA, NVIDIA's e_machine (ELF's registry, and LLVM's BinaryFormat/ELF.h).
const EM_CUDA: u16 = 190;

/// The SM number in `e_flags`, by ELF ABI version, as LLVM's BinaryFormat/ELF.h decodes
/// it (ELFObjectFileBase::getNVPTXCPUName): ELFABIVERSION_CUDA_V1 (7) keeps it in the low
/// byte (EF_CUDA_SM = 0xff; bits 8..12 hold the texture and addressing flags there);
/// ELFABIVERSION_CUDA_V2 (8), which newer NVRTCs write, in bits 8..16 (EF_CUDA_SM_MASK =
/// 0xff00, EF_CUDA_SM_OFFSET = 8). Either way it is the decimal number, 0x5a for sm_90.
fn sm_of(abi_version: u8, e_flags: u32) -> Result<u32, String> {
    match abi_version {
        7 => Ok(e_flags & 0xff),
        8 => Ok((e_flags & 0xff00) >> 8),
        v => Err(format!("unknown CUDA ELF ABI version {v} (e_flags {e_flags:#010x})")),
    }
}

#[test]
fn the_sm_number_is_read_by_the_elf_abi_version() {
    // ABI 8, as NVRTC 13.0 and 13.5 write it (printed by the cubin test): 0x06005a04 for
    // sm_90, 0x06005004 for sm_80: the SM in bits 8..16.
    assert_eq!(sm_of(8, 0x0600_5a04), Ok(90));
    assert_eq!(sm_of(8, 0x0600_5004), Ok(80));
    // ABI 7 (older NVRTCs): the SM in the low byte, beside EF_CUDA_TEXMODE_UNIFIED (0x100)
    // and EF_CUDA_64BIT_ADDRESS (0x400), the virtual SM in bits 16..24
    // (EF_CUDA_VIRTUAL_SM(x) = x << 16): sm_80 is 0x50 | 0x100 | 0x400 | 0x50 << 16.
    assert_eq!(sm_of(7, 0x0050_0550), Ok(80));
    // Read with the other ABI's rule, each of those would give another number.
    assert_eq!(sm_of(7, 0x0600_5a04), Ok(4));
    assert_eq!(sm_of(8, 0x0050_0550), Ok(5));
    assert!(sm_of(9, 0x0600_5a04).is_err());
}

/// Parses the ELF64 little-endian header and the global function symbols of `bytes`.
fn parse_cubin(bytes: &[u8]) -> Result<Cubin, String> {
    let u16_at = |o: usize| bytes.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]])).ok_or("truncated");
    let u32_at = |o: usize| bytes.get(o..o + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).ok_or("truncated");
    let u64_at =
        |o: usize| bytes.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize).ok_or("truncated");
    if bytes.get(..4) != Some(b"\x7fELF".as_slice()) {
        return Err(format!("no ELF magic: {:02x?}", &bytes[..bytes.len().min(4)]));
    }
    // e_ident: EI_CLASS 2 (64-bit), EI_DATA 1 (little-endian).
    if (bytes[4], bytes[5]) != (2, 1) {
        return Err(format!("not ELF64 little-endian: class {} data {}", bytes[4], bytes[5]));
    }
    let abi_version = bytes[8];
    let machine = u16_at(18)?;
    if machine != EM_CUDA {
        return Err(format!("e_machine {machine}, want EM_CUDA ({EM_CUDA})"));
    }
    let e_flags = u32_at(48)?;
    let sm = sm_of(abi_version, e_flags)?;
    // Section headers: e_shoff at 40, e_shentsize at 58, e_shnum at 60.
    let (shoff, shentsize, shnum) = (u64_at(40)?, u16_at(58)? as usize, u16_at(60)? as usize);
    let section = |i: usize| -> Result<(u32, usize, usize, usize), String> {
        let h = shoff + i * shentsize;
        // sh_type at 4, sh_offset at 24, sh_size at 32, sh_link at 40.
        Ok((u32_at(h + 4)?, u64_at(h + 24)?, u64_at(h + 32)?, u32_at(h + 40)? as usize))
    };
    let mut functions = BTreeSet::new();
    for i in 0..shnum {
        let (kind, offset, size, link) = section(i)?;
        const SHT_SYMTAB: u32 = 2;
        if kind != SHT_SYMTAB {
            continue;
        }
        let (_, str_off, str_size, _) = section(link)?;
        let strtab = bytes.get(str_off..str_off + str_size).ok_or("string table out of the file")?;
        // Elf64_Sym, 24 bytes: st_name (u32) at 0, st_info (u8) at 4.
        for sym in (offset..offset + size).step_by(24) {
            let (name, info) = (u32_at(sym)? as usize, bytes[sym + 4]);
            const STT_FUNC: u8 = 2;
            const STB_GLOBAL: u8 = 1;
            if info & 0xf == STT_FUNC && info >> 4 == STB_GLOBAL {
                let end = strtab[name..].iter().position(|&b| b == 0).ok_or("unterminated symbol name")?;
                functions.insert(String::from_utf8_lossy(&strtab[name..name + end]).into_owned());
            }
        }
    }
    Ok(Cubin { abi_version, e_flags, sm, functions })
}

/// Which NVRTC this process loaded: "NVRTC 13.5 from /path/libnvrtc.so.13".
fn which_nvrtc() -> (String, PathBuf) {
    let (major, minor) = nvrtc_version().expect("nvrtcVersion");
    let path = loaded_from(CudaLib::Nvrtc).expect("the file NVRTC was loaded from");
    (format!("{major}.{minor}"), path)
}

#[test]
fn every_kernel_file_compiles_to_a_cubin_without_warnings() {
    if !nvrtc_or_skip("every_kernel_file_compiles_to_a_cubin_without_warnings") {
        return;
    }
    let (version, path) = which_nvrtc();
    // One line the parent of a child run (below) reads back.
    println!("cubin test: NVRTC {version} from {}", path.display());
    if let Ok(dir) = std::env::var("LOCKSTEP_NVRTC_EXPECT_DIR") {
        let dir = PathBuf::from(dir).canonicalize().expect("LOCKSTEP_NVRTC_EXPECT_DIR exists");
        assert!(path.starts_with(&dir), "NVRTC was loaded from {}, not from {}", path.display(), dir.display());
    }
    let supported = supported_archs().expect("nvrtcGetSupportedArchs");
    eprintln!("NVRTC {version} compiles for {supported:?}");
    let mut failures = Vec::new();
    for &sm in SMS {
        assert!(supported.contains(&sm), "NVRTC {version} does not list sm_{sm}: {supported:?}");
    }
    for file in kernel_files() {
        let want: BTreeSet<String> = file.kernel_names("f32").into_iter().collect();
        for &sm in SMS {
            match compile_with_log(file.name, file.source, &format!("sm_{sm}")) {
                Ok(c) => {
                    if !c.log.is_empty() {
                        failures.push(format!("{} [sm_{sm}] warnings:\n{}", file.name, c.log));
                    }
                    let KernelImage::Cubin { sm: made_for, bytes } = &c.image else {
                        failures.push(format!("{} [sm_{sm}]: not a cubin: {}", file.name, c.image.describe()));
                        continue;
                    };
                    assert_eq!(*made_for, sm);
                    match parse_cubin(bytes) {
                        Ok(cubin) => {
                            eprintln!(
                                "{} [sm_{sm}]: {} bytes, ELF ABI {}, e_flags {:#010x} -> sm_{}",
                                file.name,
                                bytes.len(),
                                cubin.abi_version,
                                cubin.e_flags,
                                cubin.sm
                            );
                            if cubin.sm != sm {
                                failures.push(format!("{} [sm_{sm}]: the ELF says sm_{}", file.name, cubin.sm));
                            }
                            if cubin.functions != want {
                                failures.push(format!(
                                    "{} [sm_{sm}]: functions {:?}, want {want:?}",
                                    file.name, cubin.functions
                                ));
                            }
                        }
                        Err(e) => failures.push(format!("{} [sm_{sm}]: {e}", file.name)),
                    }
                }
                Err(Error::Nvrtc { file, log }) => failures.push(format!("{file} [sm_{sm}]:\n{log}")),
                Err(e) => failures.push(format!("{} [sm_{sm}]: {e}", file.name)),
            }
        }
    }
    assert!(failures.is_empty(), "NVRTC {version}: {} problem(s):\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn the_ptx_fallback_defines_every_kernel() {
    if !nvrtc_or_skip("the_ptx_fallback_defines_every_kernel") {
        return;
    }
    // compute_80: what a GPU newer than this NVRTC would get (kernels::choose_target).
    let mut failures = Vec::new();
    for file in kernel_files() {
        match compile_with_log(file.name, file.source, "compute_80") {
            Ok(c) => {
                let KernelImage::Ptx { sm: 80, text } = &c.image else {
                    panic!("{}: compute_80 gave {}", file.name, c.image.describe());
                };
                if !c.log.is_empty() {
                    failures.push(format!("{} [compute_80] warnings:\n{}", file.name, c.log));
                }
                if !text.lines().any(|l| l.trim() == ".target sm_80") {
                    failures.push(format!("{}: no `.target sm_80` in the PTX", file.name));
                }
                for name in file.kernel_names("f32") {
                    if !text.contains(&format!(".entry {name}(")) {
                        failures.push(format!("{}: no entry point {name} in the PTX", file.name));
                    }
                }
            }
            Err(e) => failures.push(format!("{}: {e}", file.name)),
        }
    }
    assert!(failures.is_empty(), "{} problem(s):\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn every_kernel_file_compiles_with_every_listed_nvrtc() {
    let Some(dirs) = std::env::var("LOCKSTEP_NVRTC_EXTRA_DIRS").ok().filter(|d| !d.is_empty()) else {
        skip(
            "every_kernel_file_compiles_with_every_listed_nvrtc",
            Need::Tool,
            "LOCKSTEP_NVRTC_EXTRA_DIRS is not set (.ci/run sets it to NVRTC 13.0's directory)",
        );
        return;
    };
    if !nvrtc_or_skip("every_kernel_file_compiles_with_every_listed_nvrtc") {
        return;
    }
    let (main_version, main_path) = which_nvrtc();
    let mut seen = vec![(main_version, main_path.display().to_string())];
    let exe = std::env::current_exe().unwrap();
    let inherited = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    for dir in dirs.split(':').filter(|d| !d.is_empty()) {
        let out = std::process::Command::new(&exe)
            .args([
                "--exact",
                &test_path(module_path!(), "every_kernel_file_compiles_to_a_cubin_without_warnings"),
                "--nocapture",
            ])
            .env("LD_LIBRARY_PATH", format!("{dir}:{inherited}"))
            .env("LOCKSTEP_NVRTC_EXPECT_DIR", dir)
            .env_remove("LOCKSTEP_ALLOW_NO_NVRTC")
            .env_remove("LOCKSTEP_NVRTC_EXTRA_DIRS")
            .output()
            .expect("runs this test binary again");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && stdout.contains("1 passed"), "with {dir}:\n{stdout}\n{stderr}");
        let line = stdout
            .lines()
            .find_map(|l| Some(&l[l.find("cubin test: NVRTC ")? + "cubin test: NVRTC ".len()..]))
            .unwrap_or_else(|| panic!("with {dir}: the child named no NVRTC:\n{stdout}"));
        let (version, path) = line.split_once(" from ").unwrap();
        loud(&format!("every_kernel_file_compiles_with_every_listed_nvrtc: NVRTC {version} from {path}: passed"));
        seen.push((version.to_string(), path.to_string()));
    }
    let versions: BTreeSet<&str> = seen.iter().map(|(v, _)| v.as_str()).collect();
    assert_eq!(versions.len(), seen.len(), "each NVRTC listed must be another version: {seen:?}");
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

#[test]
fn the_devices_listing_names_the_nvrtc_file() {
    if !nvrtc_or_skip("the_devices_listing_names_the_nvrtc_file") {
        return;
    }
    // The binary is where cargo builds it beside this test executable (target/release/deps/
    // holds the test, target/release/ the binary), when the same `cargo test` built it (it
    // does for the integration tests; `--lib` alone does not). A copy of this executable
    // carried elsewhere (the GPU check's .gpu/lib_tests) has none there, and gpu-check.sh
    // runs `lockstep devices` itself.
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().and_then(|deps| deps.parent()).map(|dir| dir.join("lockstep"));
    let Some(bin) = bin.filter(|b| b.is_file()) else {
        skip(
            "the_devices_listing_names_the_nvrtc_file",
            Need::Tool,
            &format!("no lockstep binary beside the directory of {}", exe.display()),
        );
        return;
    };
    let (version, path) = which_nvrtc();
    let out = std::process::Command::new(&bin).arg("devices").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let want = format!("nvrtc: {} (NVRTC {version})", path.display());
    assert!(stdout.lines().any(|l| l == want), "want the line {want:?} in:\n{stdout}");
    assert!(path.file_name().unwrap().to_string_lossy().starts_with("libnvrtc.so"), "{}", path.display());
    assert!(path.is_absolute() && path.is_file(), "{}", path.display());
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
    for file in kernel_files() {
        let in_source: BTreeSet<String> = extern_c_kernels(file.source).into_iter().collect();
        let in_table: BTreeSet<String> = file.kernel_names("f32").into_iter().collect();
        assert_eq!(
            in_source, in_table,
            "{}: extern \"C\" kernels vs the kernel file table (train::kernel_files)",
            file.name
        );
        for name in &in_source {
            let (op, dir, dtype) =
                parse_name(name).unwrap_or_else(|| panic!("{}: '{name}' breaks the naming rule", file.name));
            assert_eq!(&kernel_name(&op, dir, &dtype), name, "the name rebuilds through the one helper");
            assert!(all.insert(name.clone()), "{name} is defined in two files");
        }
        for &Kernel { op, dir, .. } in file.kernels {
            assert!(!op.ends_with("_fwd") && !op.ends_with("_bwd"), "{op}: the direction belongs in Dir");
            if dir == Dir::Plain {
                assert!(
                    file.kernels.iter().all(|k| k.op != op || k.dir == Dir::Plain),
                    "{op} is both plain and directional"
                );
            }
        }
    }
    // And every kernel declared is one the files define: no count to keep, the table and
    // the sources are held to each other above, file by file.
    let declared: BTreeSet<String> = kernel_files().iter().flat_map(|f| f.kernel_names("f32")).collect();
    assert_eq!(all, declared, "the kernels defined in kernels/ vs those declared");
}

/// Every `kernels/*.cu` is in train::kernel_files() and every entry is a file there, with the
/// text on disk: a kernel file left out of the table would be compiled by no test and loaded
/// by no GPU.
#[test]
fn kernel_files_on_disk_are_the_kernel_files_table() {
    // Where it was built, or (the GPU machine runs the test executables from a copy of the
    // repository) the working directory's copy.
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let dir = if built.is_dir() { built } else { PathBuf::from("kernels") };
    let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
        .expect("kernels/ is readable")
        .map(|e| e.expect("kernels/ entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".cu") || name.ends_with(".h"))
        .collect();
    let table: BTreeSet<String> = kernel_files().iter().map(|f| f.name.to_string()).collect();
    assert_eq!(on_disk, table, "kernels/ vs train::kernel_files() (a file must be listed, a listed file must exist)");
    // Each file is compiled behind kernels/common.cuh, the one place of what they share.
    let common = std::fs::read_to_string(dir.join("common.cuh")).unwrap();
    for file in kernel_files() {
        let text = std::fs::read_to_string(dir.join(file.name)).unwrap();
        assert_eq!(
            format!("{common}{text}"),
            file.source,
            "{}: the embedded source is common.cuh and the file's",
            file.name
        );
    }
}
