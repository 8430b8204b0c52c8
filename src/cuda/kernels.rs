//! The CUDA C sources of `kernels/`, their kernel names, and their compilation by NVRTC.
//!
//! Owns: the table of kernel files (embedded with `include_str!`, so the binary needs no
//! source tree at run time), the ONE naming helper [`kernel_name`], and a process-wide
//! cache of compiled PTX keyed by (arch, file) so each file is compiled once per GPU
//! architecture, on first use. Loading PTX into a context and launching is
//! [`super::launch`]'s job.
//!
//! Naming rule, checked by tests/kernels_nvrtc.rs against the sources:
//! kernels with a gradient partner are `<op>_<fwd|bwd>_<dtype>` ([`Dir::Fwd`], [`Dir::Bwd`]);
//! kernels outside autograd (fills, reductions, optimizer steps) are `<op>_<dtype>`
//! ([`Dir::Plain`]). Every `extern "C"` kernel appears in [`KERNEL_FILES`].

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::nvrtc::{result, Ptx};
use parking_lot::Mutex;

use super::probe::nvrtc_available;
use crate::{Error, Result};

/// Which pass a kernel belongs to; the middle part of its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dir {
    /// Forward pass: `<op>_fwd_<dtype>`.
    Fwd,
    /// Backward pass (gradients): `<op>_bwd_<dtype>`.
    Bwd,
    /// Not part of autograd (fill, scale, reduce, optimizer step): `<op>_<dtype>`.
    Plain,
}

/// The one place kernel names are made: `kernel_name("relu", Dir::Fwd, "f32")` is
/// `relu_fwd_f32`, `kernel_name("sgd_step", Dir::Plain, "f32")` is `sgd_step_f32`.
pub fn kernel_name(op: &str, dir: Dir, dtype: &str) -> String {
    match dir {
        Dir::Fwd => format!("{op}_fwd_{dtype}"),
        Dir::Bwd => format!("{op}_bwd_{dtype}"),
        Dir::Plain => format!("{op}_{dtype}"),
    }
}

/// One file of `kernels/`: its name, its source, and the (op, dir) of every kernel in it
/// (all float32 for now).
#[derive(Debug, Clone, Copy)]
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [(&'static str, Dir)],
}

impl KernelFile {
    /// The `extern "C"` names this file must define, from [`kernel_name`].
    pub fn kernel_names(&self, dtype: &str) -> Vec<String> {
        self.kernels.iter().map(|&(op, dir)| kernel_name(op, dir, dtype)).collect()
    }
}

macro_rules! kernel_file {
    ($name:literal, [$(($op:literal, $dir:ident)),* $(,)?]) => {
        KernelFile {
            name: $name,
            source: include_str!(concat!("../../kernels/", $name)),
            kernels: &[$(($op, Dir::$dir)),*],
        }
    };
}

/// Every kernel file, one per family.
pub const KERNEL_FILES: &[KernelFile] = &[
    kernel_file!(
        "elementwise.cu",
        [
            ("relu", Fwd),
            ("relu", Bwd),
            ("rescale", Fwd),
            ("rescale", Bwd),
            ("bias_nchw", Fwd),
            ("bias_nchw", Bwd),
            ("bias_cols", Fwd),
            ("bias_cols", Bwd),
            ("scale", Plain),
            ("fill", Plain),
        ]
    ),
    kernel_file!("conv.cu", [("im2col", Fwd), ("im2col", Bwd)]),
    kernel_file!("batchnorm.cu", [("batchnorm_train", Fwd), ("batchnorm_train", Bwd), ("batchnorm_eval", Fwd)]),
    kernel_file!(
        "pooling.cu",
        [("global_avgpool", Fwd), ("global_avgpool", Bwd), ("maxpool2d", Fwd), ("maxpool2d", Bwd)]
    ),
    kernel_file!("softmax_xent.cu", [("softmax_xent", Fwd)]),
    kernel_file!("optim.cu", [("sgd_step", Plain), ("adam_step", Plain)]),
    kernel_file!("reduce.cu", [("reduce_sum", Plain)]),
    kernel_file!("dropout.cu", [("dropout", Fwd), ("dropout", Bwd)]),
];

/// The kernel file called `name`.
pub fn kernel_file(name: &str) -> Result<&'static KernelFile> {
    KERNEL_FILES
        .iter()
        .find(|f| f.name == name)
        .ok_or_else(|| Error::config("kernel file", format!("no kernel file named '{name}'")))
}

/// The output of one NVRTC compilation.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub ptx: Ptx,
    /// NVRTC's log; empty when there was no warning.
    pub log: String,
}

/// Options given to NVRTC for every kernel file. `arch` is a real architecture such as
/// `sm_80`; NVRTC still emits PTX for it, which the driver finishes for the exact GPU.
fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string()]
}

/// Compiles one kernel file for `arch` (e.g. `sm_80`) and returns its PTX with NVRTC's
/// log (warnings). A compile error is [`Error::Nvrtc`] carrying the file and the log.
pub fn compile_with_log(file: &str, src: &str, arch: &str) -> Result<Compiled> {
    nvrtc_available()?;
    let nvrtc_err = |log: String| Error::Nvrtc { file: file.to_string(), log };
    let src_c = std::ffi::CString::new(src).map_err(|_| nvrtc_err("source contains a NUL byte".to_string()))?;
    let name_c = std::ffi::CString::new(file).map_err(|_| nvrtc_err("file name contains a NUL byte".to_string()))?;
    let prog =
        result::create_program(&src_c, Some(&name_c)).map_err(|e| nvrtc_err(format!("nvrtcCreateProgram: {e:?}")))?;
    // Destroys the program on every path out of this function.
    struct Program(cudarc::nvrtc::sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: self.0 came from nvrtcCreateProgram and is destroyed only here, once.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let prog = Program(prog);
    let options = nvrtc_options(arch);
    // SAFETY: prog.0 is a live program; the options are owned strings NVRTC copies.
    let compiled = unsafe { result::compile_program(prog.0, &options) };
    // SAFETY: prog.0 is a live program; the log exists after a compile, failed or not.
    let log = unsafe { result::get_program_log(prog.0) }.map(|raw| c_chars_to_string(&raw)).unwrap_or_default();
    if let Err(e) = compiled {
        return Err(nvrtc_err(format!("{e:?} with options {options:?}\n{log}")));
    }
    // SAFETY: prog.0 compiled successfully, so its PTX is available.
    let ptx = unsafe { result::get_ptx(prog.0) }.map_err(|e| nvrtc_err(format!("nvrtcGetPTX: {e:?}")))?;
    Ok(Compiled { ptx: Ptx::from_src(c_chars_to_string(&ptx)), log })
}

/// Compiles one kernel file for `arch`; warnings are dropped here (the test fails on them).
pub fn compile(file: &str, src: &str, arch: &str) -> Result<Ptx> {
    compile_with_log(file, src, arch).map(|c| c.ptx)
}

/// NVRTC returns NUL-terminated C strings; trims at the first NUL.
fn c_chars_to_string(raw: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).trim_end().to_string()
}

type PtxCache = Mutex<HashMap<(String, &'static str), Arc<Ptx>>>;

/// The PTX of kernel file `file` for `arch`, compiled on first use and shared by every
/// device of that architecture (all threads of the process).
pub fn cached_ptx(file: &str, arch: &str) -> Result<Arc<Ptx>> {
    static CACHE: OnceLock<PtxCache> = OnceLock::new();
    let kf = kernel_file(file)?;
    let cache = CACHE.get_or_init(Default::default);
    let key = (arch.to_string(), kf.name);
    if let Some(ptx) = cache.lock().get(&key) {
        return Ok(ptx.clone());
    }
    // Compile outside the lock: two threads may both compile the same file once, which
    // wastes a little time but never blocks one GPU's setup behind another's compile.
    let ptx = Arc::new(compile(kf.name, kf.source, arch)?);
    Ok(cache.lock().entry(key).or_insert(ptx).clone())
}
