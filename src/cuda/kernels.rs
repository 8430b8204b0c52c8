//! The compilation of kernel files by NVRTC, and their loading into a context.
//!
//! Owns: the choice of what NVRTC makes for a GPU ([`choose_target`]), a process-wide
//! cache of compiled images keyed by (architecture, file) so each file is compiled once
//! per GPU architecture, on first use, and [`load_module`], the one way a kernel file gets
//! into a CUDA context. Nothing here knows which files exist: each owner declares its
//! file and kernels beside its launches ([`super::declare`]'s `kernels!`), and a launch
//! hands its kernel's file and source to the loader.
//!
//! # Cubins, not PTX
//!
//! Each file is compiled to SASS for the GPU's own architecture (`--gpu-architecture=sm_XY`,
//! `nvrtcGetCUBIN`) and loaded as a binary module. CUDA's minor-version compatibility
//! covers cubins: one made by any CUDA 13.x NVRTC loads on any CUDA 13 driver. PTX does
//! not: the driver JIT-compiles it and refuses PTX newer than itself (NVRTC 13.5 writes
//! `.version 9.5`, a CUDA 13.0 driver reads up to 9.0: `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`).
//! A GPU whose minor version NVRTC does not know gets the cubin of the newest known one of
//! its major version (SASS runs on later minor versions). PTX (`compute_XY`) is kept only
//! for a GPU of a major version newer than every architecture this NVRTC knows, where no
//! cubin can serve; the driver then finishes it for the GPU. A module
//! that fails to load is [`Error::KernelLoad`], which names the image, the NVRTC version
//! that made it and the CUDA version the driver reports.
//!
//! Naming rule, checked by the NVRTC tests (`super::nvrtc_tests`) against the sources:
//! kernels with a gradient partner are `<op>_<fwd|bwd>_<dtype>` ([`Dir::Fwd`], [`Dir::Bwd`]);
//! kernels outside autograd (fills, reductions, optimizer steps) are `<op>_<dtype>`
//! ([`Dir::Plain`]). Every `extern "C"` kernel is declared by its file's owner, and the
//! host-run kernel test holds every declared parameter list to the compiled kernel's.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{result, sys, Ptx};
use parking_lot::Mutex;

use super::probe::nvrtc_available;
use crate::{Error, Result};

/// What NVRTC is asked to make for one GPU architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// SASS for `sm_XY` (the number is 10·major + minor, e.g. 90 for an H100/H200).
    Cubin(u32),
    /// PTX for the virtual architecture `compute_XY`, finished by the driver.
    Ptx(u32),
}

impl Target {
    /// Parses `sm_80` (a cubin) or `compute_80` (PTX).
    #[cfg(test)]
    pub fn parse(arch: &str) -> Result<Target> {
        let bad = || Error::config("GPU architecture", format!("'{arch}' is neither sm_XY nor compute_XY"));
        let (make, digits): (fn(u32) -> Target, &str) = if let Some(d) = arch.strip_prefix("sm_") {
            (Target::Cubin, d)
        } else if let Some(d) = arch.strip_prefix("compute_") {
            (Target::Ptx, d)
        } else {
            return Err(bad());
        };
        digits.parse::<u32>().map(make).map_err(|_| bad())
    }

    /// The `--gpu-architecture` value: `sm_90` or `compute_90`.
    pub fn arch(self) -> String {
        match self {
            Target::Cubin(sm) => format!("sm_{sm}"),
            Target::Ptx(sm) => format!("compute_{sm}"),
        }
    }
}

/// What to compile for a GPU of architecture `sm` (10·major + minor) with an NVRTC that
/// knows the real architectures `supported` (`nvrtcGetSupportedArchs`): a cubin for `sm`
/// itself when NVRTC knows it; else a cubin for the newest known architecture of the same
/// major version and a lower minor one (SASS for X.y runs on X.z for z ≥ y, CUDA's binary
/// compatibility); else PTX for the newest known architecture below it, which the driver
/// JIT-compiles for the GPU (PTX runs on later majors, SASS does not). A GPU older than
/// everything NVRTC knows cannot be served.
pub fn choose_target(sm: u32, supported: &[u32]) -> Result<Target> {
    if let Some(same_major) = supported.iter().copied().filter(|&a| a / 10 == sm / 10 && a <= sm).max() {
        return Ok(Target::Cubin(same_major));
    }
    match supported.iter().copied().filter(|&a| a < sm).max() {
        Some(older) => Ok(Target::Ptx(older)),
        None => Err(Error::CudaUnavailable(format!(
            "NVRTC {} compiles for {}, not for this GPU's sm_{sm}: use an NVRTC that supports it",
            nvrtc_version().map_or_else(|_| "?".to_string(), |(a, b)| format!("{a}.{b}")),
            supported.iter().map(|a| format!("sm_{a}")).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// What NVRTC made for one kernel file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelImage {
    /// An ELF (`e_machine` EM_CUDA) holding SASS for `sm_XY`.
    Cubin { sm: u32, bytes: Vec<u8> },
    /// PTX text for `compute_XY`.
    Ptx { sm: u32, text: String },
}

impl KernelImage {
    /// `cubin for sm_90` or `PTX for compute_90`, for messages.
    pub fn describe(&self) -> String {
        match self {
            KernelImage::Cubin { sm, bytes } => format!("cubin for sm_{sm}, {} bytes", bytes.len()),
            KernelImage::Ptx { sm, .. } => format!("PTX for compute_{sm}"),
        }
    }

    /// cudarc's module input (its `Ptx` carries cubins too: `Ptx::from_binary`).
    fn to_module_source(&self) -> Ptx {
        match self {
            KernelImage::Cubin { bytes, .. } => Ptx::from_binary(bytes.clone()),
            KernelImage::Ptx { text, .. } => Ptx::from_src(text.clone()),
        }
    }
}

/// The output of one NVRTC compilation, with its log (what the NVRTC tests read).
#[cfg(test)]
#[derive(Debug, Clone)]
pub struct Compiled {
    pub image: KernelImage,
    /// NVRTC's log; empty when there was no warning.
    pub log: String,
}

/// The NVRTC that loads: (major, minor), e.g. (13, 0).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    nvrtc_available()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcResult nvrtcVersion(int* major, int* minor); both are valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::Nvrtc { file: "(none)".to_string(), log: format!("nvrtcVersion: {e:?}") })?;
    Ok((major, minor))
}

/// The real architectures the loaded NVRTC compiles for, e.g. [75, 80, 86, ..., 120].
pub fn supported_archs() -> Result<Vec<u32>> {
    nvrtc_available()?;
    let err =
        |call: &str, e: result::NvrtcError| Error::Nvrtc { file: "(none)".to_string(), log: format!("{call}: {e:?}") };
    let mut n: std::ffi::c_int = 0;
    // SAFETY: nvrtcResult nvrtcGetNumSupportedArchs(int* numArchs); `n` is a valid out-pointer.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) }.result().map_err(|e| err("nvrtcGetNumSupportedArchs", e))?;
    let mut archs = vec![0 as std::ffi::c_int; usize::try_from(n).unwrap_or(0)];
    if !archs.is_empty() {
        // SAFETY: nvrtcResult nvrtcGetSupportedArchs(int* supportedArchs) writes
        // numArchs ints, exactly the length of `archs`.
        unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
            .result()
            .map_err(|e| err("nvrtcGetSupportedArchs", e))?;
    }
    Ok(archs.into_iter().filter_map(|a| u32::try_from(a).ok()).collect())
}

/// Options given to NVRTC for every kernel file: the target architecture (`sm_XY` makes
/// SASS and a cubin, `compute_XY` PTX only) and the language standard.
fn nvrtc_options(target: Target) -> Vec<String> {
    vec![format!("--gpu-architecture={}", target.arch()), "--std=c++17".to_string()]
}

/// Compiles one kernel file for `arch` (`sm_80`: a cubin; `compute_80`: PTX) and returns
/// the image with NVRTC's log (warnings). A compile error is [`Error::Nvrtc`] carrying
/// the file and the log.
#[cfg(test)]
pub fn compile_with_log(file: &str, src: &str, arch: &str) -> Result<Compiled> {
    let (image, log) = compile_target(file, src, Target::parse(arch)?)?;
    Ok(Compiled { image, log })
}

/// Compiles one kernel file for `target`: the image and NVRTC's log (warnings, which only
/// the tests read: a warning fails them).
fn compile_target(file: &str, src: &str, target: Target) -> Result<(KernelImage, String)> {
    nvrtc_available()?;
    let nvrtc_err = |log: String| Error::Nvrtc { file: file.to_string(), log };
    let src_c = std::ffi::CString::new(src).map_err(|_| nvrtc_err("source contains a NUL byte".to_string()))?;
    let name_c = std::ffi::CString::new(file).map_err(|_| nvrtc_err("file name contains a NUL byte".to_string()))?;
    let prog =
        result::create_program(&src_c, Some(&name_c)).map_err(|e| nvrtc_err(format!("nvrtcCreateProgram: {e:?}")))?;
    // Destroys the program on every path out of this function.
    struct Program(sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: self.0 came from nvrtcCreateProgram and is destroyed only here, once.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let prog = Program(prog);
    let options = nvrtc_options(target);
    // SAFETY: prog.0 is a live program; the options are owned strings NVRTC copies.
    let compiled = unsafe { result::compile_program(prog.0, &options) };
    // SAFETY: prog.0 is a live program; the log exists after a compile, failed or not.
    let log = unsafe { result::get_program_log(prog.0) }.map(|raw| c_chars_to_string(&raw)).unwrap_or_default();
    if let Err(e) = compiled {
        return Err(nvrtc_err(format!("{e:?} with options {options:?}\n{log}")));
    }
    let image = match target {
        Target::Cubin(sm) => {
            let mut size = 0usize;
            // SAFETY: nvrtcResult nvrtcGetCUBINSize(nvrtcProgram, size_t*): prog.0 compiled
            // for a real architecture, `size` is a valid out-pointer.
            unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| nvrtc_err(format!("nvrtcGetCUBINSize: {e:?}")))?;
            let mut bytes = vec![0u8; size];
            // SAFETY: nvrtcResult nvrtcGetCUBIN(nvrtcProgram, char* cubin) writes exactly
            // the `size` bytes nvrtcGetCUBINSize reported, the length of `bytes`.
            unsafe { sys::nvrtcGetCUBIN(prog.0, bytes.as_mut_ptr().cast()) }
                .result()
                .map_err(|e| nvrtc_err(format!("nvrtcGetCUBIN: {e:?}")))?;
            KernelImage::Cubin { sm, bytes }
        }
        Target::Ptx(sm) => {
            // SAFETY: prog.0 compiled successfully, so its PTX is available.
            let ptx = unsafe { result::get_ptx(prog.0) }.map_err(|e| nvrtc_err(format!("nvrtcGetPTX: {e:?}")))?;
            KernelImage::Ptx { sm, text: c_chars_to_string(&ptx) }
        }
    };
    Ok((image, log))
}

/// NVRTC returns NUL-terminated C strings; trims at the first NUL.
fn c_chars_to_string(raw: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).trim_end().to_string()
}

type ImageCache = Mutex<HashMap<(u32, &'static str), Arc<KernelImage>>>;

/// The image of kernel file `file` (whose text is `source`) for a GPU of architecture `sm` (10·major + minor),
/// compiled on first use ([`choose_target`] says what) and shared by every device of
/// that architecture (all threads of the process).
pub fn cached_image(file: &'static str, source: &str, sm: u32) -> Result<Arc<KernelImage>> {
    static CACHE: OnceLock<ImageCache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (sm, file);
    if let Some(image) = cache.lock().get(&key) {
        return Ok(image.clone());
    }
    // Compile outside the lock: two threads may both compile the same file once, which
    // wastes a little time but never blocks one GPU's setup behind another's compile.
    let target = choose_target(sm, &supported_archs()?)?;
    let image = Arc::new(compile_target(file, source, target)?.0);
    Ok(cache.lock().entry(key).or_insert(image).clone())
}

/// Loads kernel file `file` (whose text is `source`) into `ctx`, compiled for its GPU's architecture. A module the
/// driver refuses is [`Error::KernelLoad`]: the image, the NVRTC version that made it and
/// the CUDA version of the driver, the two that have to agree.
pub fn load_module(ctx: &Arc<CudaContext>, file: &'static str, source: &str) -> Result<Arc<CudaModule>> {
    let (major, minor) = ctx.compute_capability()?;
    let sm = u32::try_from(major * 10 + minor)
        .map_err(|_| Error::config("compute capability", format!("{major}.{minor} of cuda:{}", ctx.ordinal())))?;
    let image = cached_image(file, source, sm)?;
    ctx.load_module(image.to_module_source()).map_err(|source| Error::KernelLoad {
        file: file.to_string(),
        image: image.describe(),
        nvrtc: nvrtc_version().map_or_else(|e| format!("unknown ({e})"), |(a, b)| format!("{a}.{b}")),
        driver: super::probe::driver_cuda_version()
            .map_or_else(|e| format!("unknown ({e})"), |(a, b)| format!("{a}.{b}")),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_known_architecture_gets_a_cubin() {
        // NVRTC 13.0's list (nvrtcGetSupportedArchs), as printed by the cubin test (nvrtc_tests.rs).
        let known = [75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];
        assert_eq!(choose_target(80, &known).unwrap(), Target::Cubin(80));
        assert_eq!(choose_target(90, &known).unwrap(), Target::Cubin(90));
        assert_eq!(choose_target(120, &known).unwrap(), Target::Cubin(120));
    }

    #[test]
    fn an_unknown_minor_version_gets_the_cubin_of_its_major() {
        // sm_86 SASS runs on an 8.9 GPU, sm_120's on 12.1: the newest known minor version
        // at or below the GPU's, never one above it (8.9's SASS does not run on 8.6).
        assert_eq!(choose_target(89, &[75, 80, 86, 90]).unwrap(), Target::Cubin(86));
        assert_eq!(choose_target(121, &[75, 80, 90, 120]).unwrap(), Target::Cubin(120));
        assert_eq!(choose_target(86, &[75, 80, 89, 90]).unwrap(), Target::Cubin(80));
    }

    #[test]
    fn a_major_version_newer_than_nvrtc_gets_ptx_of_the_newest_below() {
        // A GPU of a major version NVRTC does not know: PTX for the newest known
        // architecture under it, which the driver JIT-compiles forward; never PTX for an
        // architecture above the GPU.
        assert_eq!(choose_target(130, &[75, 80, 90, 120]).unwrap(), Target::Ptx(120));
        assert_eq!(choose_target(100, &[75, 80, 90, 120]).unwrap(), Target::Ptx(90));
    }

    #[test]
    fn an_architecture_older_than_nvrtc_is_refused_by_name() {
        // CUDA 13 dropped sm_70 (Volta): nothing NVRTC 13 makes runs there.
        let e = choose_target(70, &[75, 80, 90]).unwrap_err().to_string();
        assert!(e.contains("sm_70") && e.contains("sm_75, sm_80, sm_90"), "{e}");
    }

    #[test]
    fn targets_parse_and_print_both_ways() {
        assert_eq!(Target::parse("sm_90").unwrap(), Target::Cubin(90));
        assert_eq!(Target::parse("compute_80").unwrap(), Target::Ptx(80));
        assert_eq!(Target::Cubin(120).arch(), "sm_120");
        assert_eq!(Target::Ptx(90).arch(), "compute_90");
        for bad in ["sm90", "sm_", "gfx90a", "compute_x"] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }
}
