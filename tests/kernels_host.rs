//! Every CUDA kernel of `kernels/`, run on the host, against a host reference.
//!
//! The kernels are otherwise only ever run on a GPU (tests/cuda_ops.rs), and most machines
//! that build lockstep have none, so without this file a kernel could be wrong for a long
//! time before anything ran it. Here the unmodified `kernels/*.cu` sources are compiled as
//! C++20 by the system compiler, with `tests/kernels_host/cuda_host.h` force-included to
//! supply the CUDA keywords, index variables and intrinsics they use, into a shared
//! library that this test loads. A launch runs the grid block by block, each block as
//! blockDim real threads that meet at a barrier for `__syncthreads()`: the same code NVRTC
//! compiles, run the way the GPU runs it, minus the parallelism between blocks.
//!
//! What is checked:
//!   * that every kernel of train::kernel_files() is launched here, by the test that says it checks
//!     it (each test's launches are recorded and compared with its entry of `CHECKED` when
//!     it ends, and the entries together, with the kernels of the ops whose host check is
//!     in their own folder (`ops::conformance` runs those), must be train::kernel_files()):
//!     a new kernel without a host check fails `every_kernel_in_kernels_is_checked_here`;
//!   * every kernel against a reference written here, in tests/common (the one
//!     tests/cuda_ops.rs holds the GPU to) or the CPU backend's own code (the CPU is the
//!     oracle), on small random inputs, under the launch shape src/cuda/launch.rs
//!     uses and, for grid-stride loops, under a grid too small to cover the data once;
//!   * every kernel's declaration (src/cuda/kernels.rs, the one list `Gpu`'s typed
//!     launches are made from): its parameter letters are the compiled kernel's C++
//!     signature (kind, constness, width) and its parameter names the kernel's, so a
//!     declaration out of step with its `.cu` fails here, not on a GPU;
//!   * the argument list of every launch: each call below passes its values in the order
//!     and with the types the matching `Gpu` method of the kernel owner's gpu.rs pushes them, and
//!     the harness checks them against the kernel's declaration and its C++ signature;
//!   * that no kernel writes outside its buffers or into a read-only one: every buffer is
//!     staged between guard bands, checked after each launch.
//!
//! Without a C++ compiler (`$CXX`, else `c++`) each test writes "<test>: skipped: no C++
//! compiler" to stderr, visibly, and returns. References are computed in f64 from the f32
//! inputs; tolerances are stated per test as |got - ref| <= atol + rtol * |ref|. The host
//! does not contract a*b + c into an FMA, and its expf/logf and 1/sqrt are the C
//! library's rather than the GPU's (within 2 ulp), so host results can differ from the
//! GPU's by rounding, which the tolerances allow. The
//! bitwise checks of ReLU, copies, dropout and the ordered sums would hold on a GPU too;
//! those of the optimisers against the CPU (at B = 32) hold here because nothing is
//! contracted.

mod common;

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::ffi::{c_char, c_void, CStr, CString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use lockstep::backend::cpu;
use lockstep::cuda::kernels::{Kernel, Kind};
use lockstep::cuda::launch::REDUCE_BLOCK;
use lockstep::exchange::codec::{Codec, Compression};
use lockstep::exchange::gpu::codec::{WireGeom, CODEC_THREADS};
use lockstep::nn::{loss, BatchNorm2d, Ctx, Embedding, Layer, LayerNorm, MaxPool2d, Padding, Sequential, Window2d};
use lockstep::ops::attention::gpu::ATTENTION_BLOCK;
use lockstep::ops::batchnorm::RunningUpdate;
use lockstep::ops::layernorm::gpu::{LN_BLOCK, LN_LANES};
use lockstep::ops::layernorm::{row_stats, ROW_CHUNK};
use lockstep::ops::maxpool2d::{maxpool2d_plane_bwd, maxpool2d_plane_fwd};
use lockstep::ops::window::WindowGeom;
use lockstep::optim::{
    clip_factor, norm_partials, DecayMask, DecayOn, GradNorm, MomentumKind, Optimizer, OptimizerConfig, NORM_CHUNK,
    NORM_LANES,
};
use lockstep::train::kernel_files;
use lockstep::{Device, Tensor};

use common::{
    assert_close, bias_nchw_bwd_ref, code_is_nan, codec_inputs, col2im_ref, device_wire, f64s, im2col_ref,
    shm_exchange, softmax_xent_ref, sync_bn_cpu, sync_bn_global_sums, sync_bn_merge, wire_parts, BnInputs, CodecInputs,
    Rng, ATOL_ELEM, ATOL_SUM, RTOL_ELEM, RTOL_SUM,
};

// ---- building and loading the kernels ----------------------------------------------

/// `lockstep_host_launch(name, gx, gy, gz, bx, by, bz, args)`: cuLaunchKernel's contract,
/// args[i] points at the value of parameter i. 0 on success, 1 for an unknown name, 2 for
/// an empty grid or block.
type LaunchFn = unsafe extern "C" fn(*const c_char, u32, u32, u32, u32, u32, u32, *mut *mut c_void) -> i32;
/// `lockstep_host_signature(name)`: one letter per parameter (see cuda_host.h), or NULL.
type SignatureFn = unsafe extern "C" fn(*const c_char) -> *const c_char;

/// The kernels compiled for the host, loaded for the life of the test process.
struct HostKernels {
    launch: LaunchFn,
    signature: SignatureFn,
    _lib: libloading::Library,
}

/// Why there are no host kernels: no compiler is a skip, anything else is a failure.
enum Unavailable {
    NoCompiler(String),
    Failed(String),
}

fn kernels_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels")
}

/// Every `kernels/*.cu`, sorted by name, with its source.
fn kernel_sources() -> Vec<(PathBuf, String)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(kernels_dir())
        .expect("kernels/ is readable")
        .map(|e| e.expect("kernels/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    files.into_iter().map(|p| (p.clone(), std::fs::read_to_string(&p).expect("kernel source"))).collect()
}

/// The `extern "C" __global__ void NAME(` kernels a source defines, in order.
fn kernel_names_in(source: &str) -> Vec<String> {
    static RE: OnceLock<regex::Regex> = OnceLock::new();
    let re = RE.get_or_init(|| {
        regex::Regex::new(r#"extern\s+"C"\s+__global__\s+void\s+([A-Za-z_][A-Za-z0-9_]*)\s*\("#).unwrap()
    });
    re.captures_iter(source).map(|c| c[1].to_string()).collect()
}

/// The macros a source `#define`s, so the generated unit can forget them before the next
/// file: NVRTC compiles each file as its own program, and two files may define one macro
/// differently.
fn macros_in(source: &str) -> BTreeSet<String> {
    let re = regex::Regex::new(r"(?m)^\s*#\s*define\s+([A-Za-z_][A-Za-z0-9_]*)").unwrap();
    re.captures_iter(source).map(|c| c[1].to_string()).collect()
}

/// The translation unit: each kernel file inside a namespace of its own (so helpers of
/// the same name in two files stay apart, as in two NVRTC programs), its macros undefined
/// after it, then the table of thunks and the two exported functions.
fn translation_unit(sources: &[(PathBuf, String)]) -> String {
    let mut tu = String::from("// Generated by tests/kernels_host.rs; cuda_host.h is force-included.\n\n");
    let mut table = String::new();
    for (path, source) in sources {
        let stem = path.file_stem().unwrap().to_string_lossy();
        let ns: String = format!("lockstep_kernels_{stem}")
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        tu += &format!("namespace {ns} {{\n#include \"{}\"\n}}  // namespace {ns}\n", path.display());
        for m in macros_in(source) {
            tu += &format!("#undef {m}\n");
        }
        tu += "\n";
        for name in kernel_names_in(source) {
            let f = format!("&{ns}::{name}");
            table += &format!("    {{\"{name}\", &lockstep_host::thunk<{f}>, lockstep_host::signature({f})}},\n");
        }
    }
    tu += &format!("static const lockstep_host::Kernel kernels[] = {{\n{table}}};\n");
    tu += r#"
static constexpr std::size_t kernel_count = sizeof kernels / sizeof kernels[0];

extern "C" int lockstep_host_launch(const char* name, unsigned gx, unsigned gy, unsigned gz,
                                    unsigned bx, unsigned by, unsigned bz, void** args) {
    return lockstep_host::launch_by_name(kernels, kernel_count, name, dim3(gx, gy, gz),
                                         dim3(bx, by, bz), args);
}

extern "C" const char* lockstep_host_signature(const char* name) {
    return lockstep_host::signature_by_name(kernels, kernel_count, name);
}
"#;
    tu
}

/// Compiles every kernel file into a shared library and loads it.
fn build() -> Result<HostKernels, Unavailable> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    if Command::new(&cxx).arg("--version").output().is_err() {
        return Err(Unavailable::NoCompiler(format!("`{cxx}` not found; set CXX")));
    }
    let dir = std::env::temp_dir().join(format!("lockstep-kernels-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Unavailable::Failed(format!("{}: {e}", dir.display())))?;
    let (unit, lib_path) = (dir.join("kernels_host.cpp"), dir.join("libkernels_host.so"));
    std::fs::write(&unit, translation_unit(&kernel_sources()))
        .map_err(|e| Unavailable::Failed(format!("{}: {e}", unit.display())))?;
    let header = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda/host/cuda_host.h");
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-include"])
        .arg(&header)
        .arg(&unit)
        .arg("-o")
        .arg(&lib_path)
        .output()
        .map_err(|e| Unavailable::Failed(format!("running {cxx}: {e}")))?;
    if !out.status.success() {
        return Err(Unavailable::Failed(format!(
            "{cxx} failed ({}) on {}:\n{}",
            out.status,
            unit.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    // SAFETY: the library was just built from kernels/ and cuda_host.h; loading it runs
    // only the C++ runtime's static initialisers.
    let lib = unsafe { libloading::Library::new(&lib_path) }
        .map_err(|e| Unavailable::Failed(format!("loading {}: {e}", lib_path.display())))?;
    // SAFETY: both symbols are defined by translation_unit() with exactly these types.
    let (launch, signature) = unsafe {
        let launch = *lib.get::<LaunchFn>(b"lockstep_host_launch\0").map_err(|e| Unavailable::Failed(e.to_string()))?;
        let signature =
            *lib.get::<SignatureFn>(b"lockstep_host_signature\0").map_err(|e| Unavailable::Failed(e.to_string()))?;
        (launch, signature)
    };
    // The loaded library stays mapped; its files are no longer needed.
    let _ = std::fs::remove_dir_all(&dir);
    Ok(HostKernels { launch, signature, _lib: lib })
}

/// The host kernels as one test uses them: every launch is recorded, and when the test
/// ends (without a panic of its own) the kernels it launched must be its entry of
/// [`CHECKED`], so that the table cannot claim a check that does not run.
struct Checked {
    kernels: &'static HostKernels,
    test: &'static str,
    ran: RefCell<BTreeSet<String>>,
}

impl Checked {
    /// Launches a declared kernel (see [`HostKernels::launch`]), its arguments held to the
    /// declaration's letters first: the host check and `Gpu`'s typed launch of the kernel
    /// push the same list.
    #[track_caller]
    fn launch(&self, name: &str, cfg: Cfg, args: &mut [Arg<'_>]) {
        let declared = declared(name);
        check_fits(&declared.describe(), &declared.letters(), args);
        self.ran.borrow_mut().insert(name.to_string());
        self.kernels.launch(name, cfg, args);
    }
}

/// The declaration of kernel `name` in train::kernel_files(), or a panic naming it.
#[track_caller]
fn declared(name: &str) -> &'static Kernel {
    kernel_files()
        .into_iter()
        .flat_map(|f| f.kernels)
        .find(|k| k.name() == name)
        .unwrap_or_else(|| panic!("{name} is not declared in src/cuda/kernels.rs"))
}

/// Panics unless `args` fill parameters `letters` (cuda_host.h's), one by one.
#[track_caller]
fn check_fits(what: &str, letters: &str, args: &[Arg<'_>]) {
    assert_eq!(letters.len(), args.len(), "{what} [{letters}]: {} arguments given", args.len());
    for (i, (a, &code)) in args.iter().zip(letters.as_bytes()).enumerate() {
        assert!(
            a.fits(code),
            "{what} [{letters}]: argument {i} is {} but parameter {i} is '{}'",
            a.describe(),
            code as char
        );
    }
}

impl Drop for Checked {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let claimed: BTreeSet<String> = CHECKED
            .iter()
            .find(|(test, _)| *test == self.test)
            .unwrap_or_else(|| panic!("{} is not in CHECKED", self.test))
            .1
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(*self.ran.borrow(), claimed, "{}: the kernels it launched vs its CHECKED entry", self.test);
    }
}

/// The host kernels, built once per test process; None after a loud skip line when there
/// is no C++ compiler. A compiler that fails is a test failure, with its log.
fn kernels_or_skip(test: &'static str) -> Option<Checked> {
    static KERNELS: OnceLock<Result<HostKernels, Unavailable>> = OnceLock::new();
    match KERNELS.get_or_init(build) {
        Ok(k) => Some(Checked { kernels: k, test, ran: RefCell::new(BTreeSet::new()) }),
        Err(Unavailable::NoCompiler(why)) => {
            // Written to the stderr handle, not eprintln!, so the harness does not swallow it.
            let _ = writeln!(std::io::stderr(), "{test}: skipped: no C++ compiler ({why})");
            None
        }
        Err(Unavailable::Failed(log)) => panic!("building the host kernels failed:\n{log}"),
    }
}

// ---- launching -----------------------------------------------------------------------

/// One kernel argument, as the matching `Gpu` method pushes it.
enum Arg<'a> {
    /// A buffer the kernel reads: `const float*` (launch.rs passes a `view()`).
    In(&'a [f32]),
    /// A buffer the kernel writes or updates: `float*` (a `view_mut()`).
    Out(&'a mut [f32]),
    /// `const unsigned*` (labels).
    InU32(&'a [u32]),
    /// `unsigned*` (the correct flags).
    OutU32(&'a mut [u32]),
    /// `const unsigned char*` (16-bit wires, as bytes).
    InU8(&'a [u8]),
    /// `unsigned char*`.
    OutU8(&'a mut [u8]),
    /// `const double*` (synchronized BatchNorm's statistics).
    InF64(&'a [f64]),
    /// `double*`.
    OutF64(&'a mut [f64]),
    /// An absent optional buffer: a 64-bit 0 in a pointer slot, as launch.rs passes `&null`.
    Null,
    /// `int` (launch.rs's i32 dimensions).
    I32(i32),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
    /// `size_t` or `unsigned long long` (launch.rs's usize lengths and u64 dropout keys).
    U64(u64),
}
use Arg::{In, InF64, InU32, InU8, Null, Out, OutF64, OutU32, OutU8, F32, F64, I32, U64};

impl Arg<'_> {
    /// Whether this value may fill a parameter of type `code` (cuda_host.h's letters).
    fn fits(&self, code: u8) -> bool {
        match self {
            In(_) => code == b'r',
            Out(_) => code == b'w',
            InU32(_) => code == b'R',
            OutU32(_) => code == b'W',
            InU8(_) => code == b'b',
            OutU8(_) => code == b'B',
            InF64(_) => code == b'd',
            OutF64(_) => code == b'D',
            Null => b"rwRWbBdD".contains(&code),
            I32(_) => code == b'i',
            F32(_) => code == b'f',
            F64(_) => code == b'g',
            U64(_) => code == b'z',
        }
    }

    fn describe(&self) -> &'static str {
        match self {
            In(_) => "In (const float*)",
            Out(_) => "Out (float*)",
            InU32(_) => "InU32 (const unsigned*)",
            OutU32(_) => "OutU32 (unsigned*)",
            InU8(_) => "InU8 (const unsigned char*)",
            OutU8(_) => "OutU8 (unsigned char*)",
            InF64(_) => "InF64 (const double*)",
            OutF64(_) => "OutF64 (double*)",
            Null => "Null (64-bit 0)",
            I32(_) => "I32 (int)",
            F32(_) => "F32 (float)",
            F64(_) => "F64 (double)",
            U64(_) => "U64 (size_t / unsigned long long)",
        }
    }

    /// The bytes of a buffer argument, as the kernel sees them; None for a value.
    fn bytes(&self) -> Option<Vec<u8>> {
        Some(match self {
            In(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Out(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            InU32(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            OutU32(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            InU8(v) => v.to_vec(),
            OutU8(v) => v.to_vec(),
            InF64(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            OutF64(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            _ => return None,
        })
    }

    /// Copies a written buffer's bytes back into the argument (read-only ones are left).
    fn write_back(&mut self, b: &[u8]) {
        match self {
            Out(v) => {
                v.iter_mut().zip(b.chunks_exact(4)).for_each(|(x, c)| *x = f32::from_ne_bytes(c.try_into().unwrap()))
            }
            OutU32(v) => {
                v.iter_mut().zip(b.chunks_exact(4)).for_each(|(x, c)| *x = u32::from_ne_bytes(c.try_into().unwrap()))
            }
            OutU8(v) => v.copy_from_slice(b),
            OutF64(v) => {
                v.iter_mut().zip(b.chunks_exact(8)).for_each(|(x, c)| *x = f64::from_ne_bytes(c.try_into().unwrap()))
            }
            _ => {}
        }
    }

    fn read_only(&self) -> bool {
        matches!(self, In(_) | InU32(_) | InU8(_) | InF64(_))
    }
}

/// Grid and block, as a `LaunchConfig` has them.
#[derive(Clone, Copy, Debug)]
struct Cfg {
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
}

/// launch.rs's ELEM_BLOCK and MAX_BLOCKS (private there).
const ELEM_BLOCK: u32 = 256;
const MAX_BLOCKS: usize = 65_535;

/// launch.rs's `elem_cfg`: ceil(n / 256) blocks of 256 threads, clamped to 65535 blocks.
fn elem_cfg(n: usize) -> Cfg {
    let blocks = n.div_ceil(ELEM_BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
    Cfg { grid: (blocks, 1, 1), block: (ELEM_BLOCK, 1, 1) }
}

/// launch.rs's `channel_cfg`: one block of REDUCE_BLOCK threads per channel.
fn channel_cfg(c: i32) -> Cfg {
    Cfg { grid: (c as u32, 1, 1), block: (REDUCE_BLOCK, 1, 1) }
}

/// 3 blocks of 32 threads: fewer threads than elements in every test that uses it, so
/// each thread goes round its grid-stride loop several times.
const FEW: Cfg = Cfg { grid: (3, 1, 1), block: (32, 1, 1) };

/// The launch shape launch.rs uses for `n` elements, then [`FEW`].
fn elem_cfgs(n: usize) -> [Cfg; 2] {
    [elem_cfg(n), FEW]
}

/// Guard band on each side of every staged buffer, in bytes (a multiple of 8, so that
/// the buffer starts as aligned as a double), and what fills it: the f32 NaN
/// 0x7FA00BAD in every 4-byte word, so a stray read of a float poisons the result too.
const GUARD: usize = 256;
const GUARD_WORD: u64 = 0x7FA0_0BAD_7FA0_0BAD;

/// A buffer copied between guard bands for the duration of one launch, in 8-byte words
/// (aligned for any element type).
struct Staged {
    words: Vec<u64>,
    /// The buffer's bytes.
    len: usize,
}

impl Staged {
    fn new(bytes: &[u8]) -> Staged {
        let len = bytes.len();
        let mut s = Staged { words: vec![GUARD_WORD; (2 * GUARD + len).div_ceil(8)], len };
        s.all_mut()[GUARD..GUARD + len].copy_from_slice(bytes);
        s
    }

    fn all(&self) -> &[u8] {
        // SAFETY: any initialised u64 memory is valid as bytes; the slice covers exactly
        // the vector's 8·len bytes and borrows it.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.words.len() * 8) }
    }

    fn all_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `all`; every byte pattern is a valid u64, so writes through the
        // bytes keep the vector valid; the slice borrows it mutably.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.words.len() * 8) }
    }

    fn body_ptr(&mut self) -> u64 {
        self.all_mut()[GUARD..].as_mut_ptr() as u64
    }

    fn body(&self) -> &[u8] {
        &self.all()[GUARD..GUARD + self.len]
    }

    fn guards_intact(&self) -> bool {
        let pattern = GUARD_WORD.to_ne_bytes();
        let all = self.all();
        let ok = |range: std::ops::Range<usize>| range.into_iter().all(|o| all[o] == pattern[o % 8]);
        ok(0..GUARD) && ok(GUARD + self.len..all.len())
    }
}

/// One argument cell: the value's bytes first, as cuLaunchKernel reads `sizeof(param)`
/// bytes from each pointer it is given.
#[repr(C, align(8))]
struct Cell([u8; 8]);

impl Cell {
    fn of(bytes: &[u8]) -> Cell {
        let mut c = [0u8; 8];
        c[..bytes.len()].copy_from_slice(bytes);
        Cell(c)
    }
}

impl HostKernels {
    /// The kernel's parameter letters, or a panic naming an unknown kernel.
    fn signature(&self, name: &str) -> String {
        let c = CString::new(name).unwrap();
        // SAFETY: lockstep_host_signature takes a NUL-terminated name and returns NULL or
        // a pointer to a static NUL-terminated string.
        let sig = unsafe { (self.signature)(c.as_ptr()) };
        assert!(!sig.is_null(), "no kernel {name} in kernels/");
        // SAFETY: non-null, static and NUL-terminated (above).
        unsafe { CStr::from_ptr(sig) }.to_str().unwrap().to_string()
    }

    /// Launches kernel `name` on `cfg` with `args`, and waits for it. Panics if the
    /// arguments do not match the kernel's parameters, or if the kernel wrote outside a
    /// buffer or into a read-only one.
    #[track_caller]
    fn launch(&self, name: &str, cfg: Cfg, args: &mut [Arg<'_>]) {
        check_fits(name, &self.signature(name), args);
        let mut staged: Vec<Option<Staged>> = args.iter().map(|a| a.bytes().map(|b| Staged::new(&b))).collect();
        let mut cells: Vec<Cell> = args
            .iter()
            .zip(&mut staged)
            .map(|(a, s)| match (a, s) {
                (_, Some(s)) => Cell::of(&s.body_ptr().to_ne_bytes()),
                (Null, None) => Cell::of(&0u64.to_ne_bytes()),
                (I32(v), None) => Cell::of(&v.to_ne_bytes()),
                (F32(v), None) => Cell::of(&v.to_ne_bytes()),
                (F64(v), None) => Cell::of(&v.to_ne_bytes()),
                (U64(v), None) => Cell::of(&v.to_ne_bytes()),
                _ => unreachable!("every buffer is staged"),
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = cells.iter_mut().map(|c| c.0.as_mut_ptr().cast()).collect();
        let c_name = CString::new(name).unwrap();
        let ((gx, gy, gz), (bx, by, bz)) = (cfg.grid, cfg.block);
        // SAFETY: every parameter's letter was checked against its argument above, so each
        // pointer in `ptrs` points at a value of the parameter's type and width (an int, a
        // float or a double in the first bytes of its 8-byte cell); every buffer is a
        // staged copy with the length launch.rs checks for this kernel, plus guard bands,
        // starting 8-byte aligned; `staged` and `cells` outlive the call, which returns
        // after the last block has finished.
        let rc = unsafe { (self.launch)(c_name.as_ptr(), gx, gy, gz, bx, by, bz, ptrs.as_mut_ptr()) };
        assert_eq!(rc, 0, "{name}: launch on {cfg:?} refused");
        for (i, (a, s)) in args.iter_mut().zip(&staged).enumerate() {
            let Some(s) = s else { continue };
            assert!(s.guards_intact(), "{name}: argument {i} was written outside its {} bytes", s.len);
            if a.read_only() {
                assert!(a.bytes().as_deref() == Some(s.body()), "{name}: read-only argument {i} changed");
            } else {
                a.write_back(s.body());
            }
        }
    }
}

// ---- bitwise comparison (inputs, assert_close, references: tests/common) -------------

/// got and want equal bit for bit (so -0 is not 0, and a NaN matches only its own bits).
#[track_caller]
fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}]: got {g}, want {w}");
    }
}

// ---- coverage: runs everywhere -------------------------------------------------------

/// The kernels this file checks, by the test that checks them (each test's launches are
/// held to its entry: [`Checked`]).
const CHECKED: &[(&str, &[&str])] = &[
    ("every_declared_argument_list_is_the_kernels_signature", &[]),
    ("relu_fwd_and_bwd_match_the_reference", &["relu_fwd_f32", "relu_bwd_f32"]),
    ("scale_and_fill_match_the_reference", &["scale_f32", "fill_f32"]),
    ("bias_adds_and_their_reductions_match_the_reference", &["bias_nchw_fwd_f32", "bias_nchw_bwd_f32"]),
    (
        "im2col_and_col2im_match_the_cpu_backend_with_stride_and_asymmetric_padding",
        &["im2col_fwd_f32", "im2col_bwd_f32"],
    ),
    (
        "batchnorm_train_eval_and_backward_match_the_reference",
        &["batchnorm_train_fwd_f32", "batchnorm_eval_fwd_f32", "batchnorm_train_bwd_f32"],
    ),
    ("maxpool2d_matches_the_cpu_layer_bit_for_bit", &["maxpool2d_fwd_f32", "maxpool2d_bwd_f32"]),
    ("softmax_cross_entropy_matches_the_cpu_loss", &["softmax_xent_fwd_f32"]),
    (
        "sgd_adam_and_adamw_match_the_cpu_optimizer_over_several_steps",
        &["sgd_step_f32", "adam_step_f32", "grad_norm_f32", "clip_factor_f32"],
    ),
    ("the_gradient_norm_kernels_equal_the_cpu_norm_bit_for_bit", &["grad_norm_f32", "clip_factor_f32"]),
    ("reduce_sum_adds_the_buffers_left_to_right_and_scales", &["reduce_sum_f32"]),
    ("codec_kernels_equal_the_codec_bit_for_bit", &["wire_encode_f32", "wire_reduce_f32", "wire_decode_f32"]),
    (
        "synchronized_batchnorm_kernels_equal_the_cpu_layer_bit_for_bit",
        &["batchnorm_moments_fwd_f32", "batchnorm_sync_fwd_f32", "batchnorm_sums_bwd_f32", "batchnorm_sync_bwd_f32"],
    ),
    ("batchnorm_count_equals_the_cpu_count_bit_for_bit", &["batchnorm_count_fwd_f32"]),
    (
        "embedding_kernels_equal_the_cpu_layer_bit_for_bit",
        &[
            "embedding_fwd_f32",
            "embedding_count_bwd_f32",
            "embedding_offsets_bwd_f32",
            "embedding_sort_bwd_f32",
            "embedding_bwd_f32",
        ],
    ),
    (
        "attention_kernels_match_the_cpu_layer",
        &[
            "attention_heads_fwd_f32",
            "attention_heads_bwd_f32",
            "attention_softmax_fwd_f32",
            "attention_softmax_bwd_f32",
        ],
    ),
    (
        "layernorm_kernels_equal_the_cpu_layer_bit_for_bit",
        &["layernorm_fwd_f32", "layernorm_bwd_f32", "layernorm_partial_bwd_f32", "layernorm_params_bwd_f32"],
    ),
];

#[test]
fn every_kernel_in_kernels_is_checked_here() {
    let found: BTreeSet<String> = kernel_sources().iter().flat_map(|(_, s)| kernel_names_in(s)).collect();
    let table: BTreeSet<String> = kernel_files().iter().flat_map(|f| f.kernel_names("f32")).collect();
    assert_eq!(found, table, "kernels/ scanned here vs the kernel file table (train::kernel_files)");
    let checked: BTreeSet<String> = CHECKED.iter().flat_map(|(_, ks)| ks.iter().map(|s| s.to_string())).collect();
    // An op's kernel file may have its host check in its own folder instead (its gpu.rs),
    // which the crate's conformance test holds to every kernel of the file.
    let ops: BTreeSet<String> =
        lockstep::model::LAYER_TYPES.iter().filter_map(|t| t.kernels).flat_map(|f| f.kernel_names("f32")).collect();
    let unchecked: Vec<&String> = found.iter().filter(|k| !checked.contains(*k) && !ops.contains(*k)).collect();
    assert!(unchecked.is_empty(), "kernels without a host check here or in their op's folder: {unchecked:?}");
    let gone: Vec<&String> = checked.difference(&found).collect();
    assert!(gone.is_empty(), "checks here of kernels that are gone: {gone:?}");
}

/// The 12 parameters a [`Kind::Geom`] stands for, as the window kernels name them.
const GEOM_PARAMS: [&str; 12] = ["n", "c", "h", "w", "kh", "kw", "sh", "sw", "pt", "pl", "oh", "ow"];

/// The parameter names of every `extern "C"` kernel of a source, by kernel name.
fn parameter_names_in(source: &str) -> std::collections::BTreeMap<String, Vec<String>> {
    let re = regex::Regex::new(r#"extern\s+"C"\s+__global__\s+void\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(([^)]*)\)"#).unwrap();
    let last_word = |p: &str| p.rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).next().unwrap().to_string();
    re.captures_iter(source)
        .map(|c| (c[1].to_string(), c[2].split(',').map(|p| last_word(p.trim())).collect()))
        .collect()
}

#[test]
fn every_declared_kernel_is_in_its_file_with_the_kernels_parameter_names() {
    // Runs without a compiler: the declarations against the sources' text. A declared
    // order that swaps two parameters of one type (hw and total, both size_t) passes the
    // letters but not this.
    for file in kernel_files() {
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
    let Some(k) = kernels_or_skip("every_declared_argument_list_is_the_kernels_signature") else {
        return;
    };
    let mut checked = 0;
    for file in kernel_files() {
        for kernel in file.kernels {
            // The letters of the C++ types the compiled kernel takes (cuda_host.h's
            // type_code), against those the declared kinds push.
            assert_eq!(
                k.kernels.signature(&kernel.name()),
                kernel.letters(),
                "{} in {}: the compiled kernel's letters (left) vs the declaration's (right)",
                kernel.describe(),
                file.name
            );
            checked += 1;
        }
    }
    // 53 kernels, as kernels_nvrtc.rs counts them from the files.
    assert_eq!(checked, 53);
}

// ---- elementwise.cu ------------------------------------------------------------------

#[test]
fn relu_fwd_and_bwd_match_the_reference() {
    let Some(k) = kernels_or_skip("relu_fwd_and_bwd_match_the_reference") else {
        return;
    };
    let mut rng = Rng(1);
    let n = 3000;
    let (mut x, dy) = (rng.vec(n), rng.vec(n));
    // The kink: 0 and -0 are not positive, so both give y = +0 and dx = 0.
    (x[0], x[1]) = (0.0, -0.0);
    let want_y: Vec<f32> = x.iter().map(|&v| if v > 0.0 { v } else { 0.0 }).collect();
    let want_dx: Vec<f32> = x.iter().zip(&dy).map(|(&v, &g)| if v > 0.0 { g } else { 0.0 }).collect();
    for cfg in elem_cfgs(n) {
        let (mut y, mut dx) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        // As Gpu::relu_fwd pushes them: x, y, n.
        k.launch("relu_fwd_f32", cfg, &mut [In(&x), Out(&mut y), U64(n as u64)]);
        // As Gpu::relu_bwd: x, dy, dx, n.
        k.launch("relu_bwd_f32", cfg, &mut [In(&x), In(&dy), Out(&mut dx), U64(n as u64)]);
        // A comparison and a copy: exact.
        assert_bits(&format!("relu y {cfg:?}"), &y, &want_y);
        assert_bits(&format!("relu dx {cfg:?}"), &dx, &want_dx);
    }
}

#[test]
fn scale_and_fill_match_the_reference() {
    let Some(k) = kernels_or_skip("scale_and_fill_match_the_reference") else {
        return;
    };
    let mut rng = Rng(2);
    let n = 2500;
    let x = rng.vec(n);
    for cfg in elem_cfgs(n) {
        // As Gpu::scale: x, s, n. One multiply by 0.25 (a power of two): exact.
        let mut y = x.clone();
        k.launch("scale_f32", cfg, &mut [Out(&mut y), F32(0.25), U64(n as u64)]);
        let want: Vec<f32> = x.iter().map(|&v| v * 0.25).collect();
        assert_bits(&format!("scale {cfg:?}"), &y, &want);
        // As Gpu::fill: x, v, n.
        k.launch("fill_f32", cfg, &mut [Out(&mut y), F32(3.5), U64(n as u64)]);
        assert_bits(&format!("fill {cfg:?}"), &y, &vec![3.5; n]);
    }
}


// ---- conv.cu -------------------------------------------------------------------------

/// The CPU backend's geometry for one sample, when both strides agree.
fn cpu_geom(g: &WindowGeom) -> Option<cpu::Im2colGeom> {
    (g.stride_h == g.stride_w).then(|| cpu::Im2colGeom {
        c: g.c,
        h: g.h,
        w: g.w,
        kh: g.kh,
        kw: g.kw,
        stride: g.stride_h,
        pad_top: g.pad_top,
        pad_left: g.pad_left,
        oh: g.oh(),
        ow: g.ow(),
    })
}

/// launch.rs's `conv_args`: N, C, H, W, KH, KW, SH, SW, PT, PL, OH, OW as ints.
fn conv_args(g: &WindowGeom) -> [i32; 12] {
    [g.n, g.c, g.h, g.w, g.kh, g.kw, g.stride_h, g.stride_w, g.pad_top, g.pad_left, g.oh(), g.ow()]
        .map(|v| i32::try_from(v).unwrap())
}


// ---- batchnorm.cu --------------------------------------------------------------------

/// An optional read-only parameter: the buffer, or the 64-bit 0 launch.rs passes for None.
fn opt(present: bool, v: &[f32]) -> Arg<'_> {
    if present {
        In(v)
    } else {
        Null
    }
}

/// An optional gradient buffer: the buffer, or the 64-bit 0 launch.rs passes for None.
fn opt_mut(present: bool, v: &mut [f32]) -> Arg<'_> {
    if present {
        Out(v)
    } else {
        Null
    }
}

/// The running statistics `nn::BatchNorm2d`'s training forward leaves for `inputs`.
fn cpu_running_stats(
    inputs: &BnInputs,
    with_gamma: bool,
    with_beta: bool,
    momentum: f32,
    eps: f32,
) -> (Vec<f32>, Vec<f32>) {
    let (n, c, hw) = inputs.shape;
    let layer = BatchNorm2d::new(c).scale(with_gamma).center(with_beta).momentum(momentum).eps(eps);
    let model = Sequential::new([c, hw, 1], vec![Box::new(layer)]).expect("one BatchNorm layer");
    // Each tensor at its place in the flat layout (which pads every tensor start).
    let mut params = vec![0.0f32; model.params_len()];
    let given = [(with_gamma, &inputs.gamma), (with_beta, &inputs.beta)];
    for (t, (_, v)) in model.param_infos().iter().zip(given.iter().filter(|(on, _)| *on)) {
        params[t.range.clone()].copy_from_slice(v);
    }
    let mut buffers = vec![0.0f32; model.buffers_len()];
    let (rm, rv) = (&model.buffer_infos()[0].range, &model.buffer_infos()[1].range);
    buffers[rm.clone()].copy_from_slice(&inputs.running_mean);
    buffers[rv.clone()].copy_from_slice(&inputs.running_var);
    let x = lockstep::Tensor::from_vec(inputs.x.clone(), vec![n, c, hw, 1]).expect("x");
    model.clone().forward(x, &params, &mut buffers, &Ctx::train(0, 0, 0, lockstep::Device::Cpu(0))).expect("forward");
    (buffers[rm.clone()].to_vec(), buffers[rv.clone()].to_vec())
}


// ---- pooling.cu ----------------------------------------------------------------------


// ---- softmax_xent.cu -----------------------------------------------------------------

#[test]
fn softmax_cross_entropy_matches_the_cpu_loss() {
    let Some(k) = kernels_or_skip("softmax_cross_entropy_matches_the_cpu_loss") else {
        return;
    };
    let mut rng = Rng(7);
    let (n, kk) = (300, 10);
    let mut logits: Vec<f32> = rng.vec(n * kk).iter().map(|v| 4.0 * v).collect();
    let mut labels: Vec<u32> = (0..n).map(|_| (rng.next_u64() % kk as u64) as u32).collect();
    // Ties: samples 0 and 1 have their maximum 3.0 at classes 2 and 7. The first maximum
    // (2) is the prediction, as in ops::cross_entropy and torch.argmax: label 2 is correct, label 7
    // is not.
    for s in [0, 1] {
        logits[s * kk + 2] = 3.0;
        logits[s * kk + 7] = 3.0;
    }
    (labels[0], labels[1]) = (2, 7);
    // Large logits: the row maximum is subtracted before exp.
    logits[2 * kk + 4] = 1000.0;
    // Plain cross-entropy, and PyTorch's label smoothing (ops::cross_entropy::CrossEntropy).
    for eps in [0.0f32, 0.1, 0.5] {
        let ce = loss::CrossEntropy::new(eps).unwrap();
        // Each sample alone through the CPU loss: its loss, its correct flag, its dlogits.
        let cpu: Vec<(f64, u64, Vec<f32>)> = (0..n)
            .map(|s| {
                let row = Tensor::from_vec(logits[s * kk..(s + 1) * kk].to_vec(), [1, kk]).unwrap();
                let (m, d) = ce.with_grad(&row, &labels[s..s + 1]).unwrap();
                (m.loss_sum, m.correct, d.host().to_vec())
            })
            .collect();
        assert_eq!((cpu[0].1, cpu[1].1), (1, 0), "the CPU loss breaks ties to the first maximum");
        let (want_loss, want_dl) = softmax_xent_ref(&logits, &labels, kk, eps);

        for cfg in elem_cfgs(n) {
            let mut loss = vec![f32::NAN; n];
            let mut dlogits = vec![f32::NAN; n * kk];
            let mut correct = vec![7u32; n];
            // As Gpu::softmax_xent_fwd: logits, labels, loss, dlogits, correct, n, K (int),
            // label smoothing (float).
            k.launch(
                "softmax_xent_fwd_f32",
                cfg,
                &mut [
                    In(&logits),
                    InU32(&labels),
                    Out(&mut loss),
                    Out(&mut dlogits),
                    OutU32(&mut correct),
                    U64(n as u64),
                    I32(kk as i32),
                    F32(eps),
                ],
            );
            // tests/cuda_ops.rs's tolerance (expf/logf within 2 ulp on the GPU): 1e-5
            // relative plus 1e-6 absolute, against the f64 reference and the CPU loss alike.
            let what = |x: &str| format!("xent {x}, eps {eps}, {cfg:?}");
            assert_close(&what("loss"), &loss, &want_loss, 1e-5, 1e-6);
            assert_close(&what("dlogits"), &dlogits, &want_dl, 1e-5, 1e-6);
            let cpu_loss: Vec<f64> = cpu.iter().map(|c| c.0).collect();
            let cpu_dl: Vec<f64> = cpu.iter().flat_map(|c| f64s(&c.2)).collect();
            assert_close(&what("loss vs ops::cross_entropy"), &loss, &cpu_loss, 1e-5, 1e-6);
            assert_close(&what("dlogits vs ops::cross_entropy"), &dlogits, &cpu_dl, 1e-5, 1e-6);
            let cpu_correct: Vec<u32> = cpu.iter().map(|c| c.1 as u32).collect();
            assert_eq!(correct, cpu_correct, "correct flags vs ops::cross_entropy, eps {eps}, {cfg:?}");
        }
    }

    // A label >= K: loss NaN, not correct, and dlogits the softmax (no one-hot to
    // subtract). The CPU loss refuses such a label before computing anything.
    let (logits, labels) = (vec![1.0f32, 2.0, 3.0], vec![3u32]);
    let (mut loss, mut dlogits, mut correct) = (vec![0.0f32], vec![0.0f32; 3], vec![7u32]);
    k.launch(
        "softmax_xent_fwd_f32",
        elem_cfg(1),
        &mut [
            In(&logits),
            InU32(&labels),
            Out(&mut loss),
            Out(&mut dlogits),
            OutU32(&mut correct),
            U64(1),
            I32(3),
            F32(0.0),
        ],
    );
    assert!(loss[0].is_nan() && correct[0] == 0, "loss {loss:?}, correct {correct:?}");
    // softmax([1, 2, 3]) = e^[1,2,3] / (e + e² + e³) = [0.09003057, 0.24472847, 0.66524096]
    assert_close("xent dlogits, bad label", &dlogits, &[0.090_030_57, 0.244_728_47, 0.665_240_96], 1e-5, 1e-6);
}

// ---- optim.cu ------------------------------------------------------------------------

/// The launch shape of `Gpu::grad_norm` for `n` values (one block of NORM_LANES threads
/// per chunk), then a grid of one block, which strides over every chunk.
fn norm_cfgs(n: usize) -> [Cfg; 2] {
    let block = (NORM_LANES as u32, 1, 1);
    [Cfg { grid: (norm_partials(n) as u32, 1, 1), block }, Cfg { grid: (1, 1, 1), block }]
}

/// As `Gpu::grad_norm` then `Gpu::clip_factor`: the factor of the gradient sum `g` (÷ B)
/// for `max_norm`, left on the "device".
fn clip_factor_on_device(k: &Checked, cfg: Cfg, g: &[f32], batch: f32, max_norm: f32) -> f32 {
    let n = g.len();
    let mut partials = vec![0.0f64; norm_partials(n)];
    // As Gpu::grad_norm: grad, partials, grad_divisor, n.
    k.launch("grad_norm_f32", cfg, &mut [In(g), OutF64(&mut partials), F32(batch), U64(n as u64)]);
    let mut factor = [0.0f32];
    // As Gpu::clip_factor: partials, factor, max_norm, parts (one thread works).
    let parts = partials.len() as u64;
    k.launch("clip_factor_f32", elem_cfg(1), &mut [InF64(&partials), Out(&mut factor), F32(max_norm), U64(parts)]);
    factor[0]
}

#[test]
fn sgd_adam_and_adamw_match_the_cpu_optimizer_over_several_steps() {
    let Some(k) = kernels_or_skip("sgd_adam_and_adamw_match_the_cpu_optimizer_over_several_steps") else {
        return;
    };
    let mut rng = Rng(8);
    let n = 1000;
    let steps = 5;
    let p0 = rng.vec(n);
    // A weight (2-D) at 0..600 that decays, a bias at 600..1000 that does not (--weight-decay-on
    // weights): the replicas cut each piece into runs, the kernel takes each run's scalars.
    let decay = DecayMask::of_tensors([(0..600, 2), (600..1000, 1)], DecayOn::Weights);
    let classic = MomentumKind::Classic;
    // B = 32 and B = 3: the kernel divides the raw gradient by B as the CPU does, so no
    // batch size is special.
    for batch in [32.0f32, 3.0] {
        let grads: Vec<Vec<f32>> = (0..steps).map(|_| rng.vec(n).iter().map(|v| batch * v).collect()).collect();
        let configs = [
            OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, momentum_kind: classic, weight_decay: 1e-4 },
            OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, momentum_kind: MomentumKind::Nesterov, weight_decay: 5e-4 },
            OptimizerConfig::Sgd { lr: 0.05, momentum: 0.0, momentum_kind: classic, weight_decay: 0.0 },
            OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 1e-2 },
            OptimizerConfig::Adam { lr: 1e-2, beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 0.0 },
            OptimizerConfig::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 },
        ];
        // Without clipping, and clipped to a norm (about 0.3·sqrt(1000/3) ≈ 5.5 here) that
        // cuts every step.
        for max_norm in [None, Some(1.5f32)] {
            for config in configs {
                let mut cpu = Optimizer::new(config, n);
                let mut cpu_p = p0.clone();
                let mut p = p0.clone();
                let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
                for (t, g) in grads.iter().enumerate() {
                    // The very scalars the GPU replica hands the kernel (Gpu::optimizer_step).
                    let mut s = cpu.begin_step(0.7, batch);
                    let cfg = if t % 2 == 0 { elem_cfg(n) } else { FEW };
                    let factor = max_norm.map(|c| {
                        let mut norm = GradNorm::default();
                        norm.add(0, &g[..300], batch);
                        norm.add(300, &g[300..], batch);
                        s.clip = clip_factor(norm.norm(), c);
                        assert!(s.clip < 1.0, "the test clips");
                        let on_device = clip_factor_on_device(&k, norm_cfgs(n)[t % 2], g, batch, c);
                        assert_eq!(on_device.to_bits(), s.clip.to_bits(), "clip factor, step {t}");
                        [on_device]
                    });
                    let clip = || match &factor {
                        Some(f) => In(f),
                        None => Null,
                    };
                    for (run, rs) in decay.split(0..n, &s) {
                        cpu.update(run.start, &mut cpu_p[run.clone()], &g[run.clone()], &rs);
                        let (p, g, m, v) =
                            (&mut p[run.clone()], &g[run.clone()], &mut m[run.clone()], &mut v[run.clone()]);
                        let len = U64(run.len() as u64);
                        match config {
                            OptimizerConfig::Sgd { momentum, momentum_kind, .. } => {
                                // As Gpu::optimizer_step: p, grad, buf, clip, step_size,
                                // momentum, weight_decay, grad_divisor, first, nesterov, n.
                                let nesterov = I32(i32::from(momentum_kind == MomentumKind::Nesterov));
                                k.launch(
                                    "sgd_step_f32",
                                    cfg,
                                    &mut [
                                        Out(p),
                                        In(g),
                                        Out(m),
                                        clip(),
                                        F32(rs.step_size),
                                        F32(momentum),
                                        F32(rs.weight_decay),
                                        F32(rs.grad_divisor),
                                        I32(i32::from(rs.t == 1)),
                                        nesterov,
                                        len,
                                    ],
                                );
                            }
                            OptimizerConfig::Adam { beta1, beta2, eps, .. }
                            | OptimizerConfig::AdamW { beta1, beta2, eps, .. } => {
                                // As Gpu::optimizer_step: p, grad, m, v, clip, step_size,
                                // beta1, beta2, eps, weight_decay, shrink, grad_divisor,
                                // bc2_sqrt, n.
                                k.launch(
                                    "adam_step_f32",
                                    cfg,
                                    &mut [
                                        Out(p),
                                        In(g),
                                        Out(m),
                                        Out(v),
                                        clip(),
                                        F32(rs.step_size),
                                        F32(beta1),
                                        F32(beta2),
                                        F32(eps),
                                        F32(rs.weight_decay),
                                        F32(rs.shrink),
                                        F32(rs.grad_divisor),
                                        F32(rs.bc2_sqrt),
                                        len,
                                    ],
                                );
                            }
                        }
                    }
                }
                let what = format!("{config:?}, B = {batch}, clip {max_norm:?}, after {steps} steps");
                // Bitwise: the kernel (here without FMA contraction, as the CPU loop runs)
                // and the CPU do the same f32 operations in the same order on the same
                // scalars (optim::StepScalars, made once on the host). On a GPU, contracted
                // multiply-adds round once where this rounds twice; tests/cuda_ops.rs
                // bounds it.
                assert_bits(&format!("p: {what}"), &p, &cpu_p);
                let state = cpu.state();
                for (name, values) in &state {
                    let got = if *name == "m" { &m } else { &v };
                    assert_bits(&format!("{name}: {what}"), got, values);
                }
                if matches!(config, OptimizerConfig::Sgd { momentum, .. } if momentum == 0.0) {
                    assert!(state.is_empty(), "plain SGD keeps no state on the CPU");
                }
            }
        }
    }
}

#[test]
fn the_gradient_norm_kernels_equal_the_cpu_norm_bit_for_bit() {
    let Some(k) = kernels_or_skip("the_gradient_norm_kernels_equal_the_cpu_norm_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(9);
    // Two whole chunks and part of a third, as a resnet's sum is cut.
    let n = 2 * NORM_CHUNK + 300;
    let batch = 24.0f32;
    let g: Vec<f32> = rng.vec(n).iter().map(|v| batch * v).collect();
    let mut cpu = GradNorm::default();
    cpu.add(0, &g[..5000], batch);
    cpu.add(5000, &g[5000..], batch);
    let norm = cpu.norm();
    // The exact norm, in f64 from the f32 mean gradient, to f32 rounding.
    let exact = g.iter().map(|&x| ((x / batch) as f64).powi(2)).sum::<f64>().sqrt();
    assert!((norm as f64 - exact).abs() <= 1e-6 * exact, "{norm} against {exact}");
    for cfg in norm_cfgs(n) {
        // Clipped (C below the norm) and not (above it): the factor is the CPU's, bitwise.
        for max_norm in [norm / 3.0, norm * 2.0] {
            let factor = clip_factor_on_device(&k, cfg, &g, batch, max_norm);
            assert_eq!(factor.to_bits(), clip_factor(norm, max_norm).to_bits(), "{cfg:?}, C = {max_norm}");
        }
        // A piece that starts on a chunk writes the partials from that chunk on: the
        // partials of two pieces are those of the whole.
        let mut whole = vec![0.0f64; norm_partials(n)];
        k.launch("grad_norm_f32", cfg, &mut [In(&g), OutF64(&mut whole), F32(batch), U64(n as u64)]);
        let mut second = vec![0.0f64; norm_partials(n - NORM_CHUNK)];
        let rest = &g[NORM_CHUNK..];
        k.launch("grad_norm_f32", cfg, &mut [In(rest), OutF64(&mut second), F32(batch), U64(rest.len() as u64)]);
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&whole[1..]), bits(&second), "{cfg:?}");
    }
}

// ---- embedding.cu --------------------------------------------------------------------

/// A one-layer network of `layer` over per-sample inputs `input`, its weights from seed 5,
/// and a gradient buffer that starts at random values (backward accumulates into it).
fn one_layer(input: &[usize], layer: Box<dyn Layer>, rng: &mut Rng) -> (Sequential, Vec<f32>, Vec<f32>) {
    let net = Sequential::new(input, vec![layer]).unwrap();
    let params = net.init(5).params;
    let grads = rng.vec(net.params_len());
    (net, params, grads)
}

/// As Gpu::embedding_bwd runs its four kernels on `cfg` (the offsets kernel on its one
/// block always): the counting sort's offsets and order, and dweight accumulated.
fn embedding_bwd_on_host(
    k: &Checked,
    cfg: Option<Cfg>,
    ids: &[f32],
    dy: &[f32],
    dweight: &mut [f32],
    vocab: usize,
    c: usize,
) -> (Vec<u32>, Vec<u32>) {
    let m = ids.len();
    let (mut offsets, mut order) = (vec![u32::MAX; vocab + 1], vec![u32::MAX; m]);
    let (vi, ci) = (vocab as i32, c as i32);
    let one_block = Cfg { grid: (1, 1, 1), block: (REDUCE_BLOCK, 1, 1) };
    // As Gpu::embedding_bwd pushes them: ids, offsets, m, vocab; offsets, vocab; ids,
    // offsets, order, m, vocab; dy, offsets, order, dweight, m, vocab, c.
    let over_rows = cfg.unwrap_or(elem_cfg(vocab));
    k.launch("embedding_count_bwd_f32", over_rows, &mut [In(ids), OutU32(&mut offsets), U64(m as u64), I32(vi)]);
    k.launch("embedding_offsets_bwd_f32", one_block, &mut [OutU32(&mut offsets), I32(vi)]);
    k.launch(
        "embedding_sort_bwd_f32",
        over_rows,
        &mut [In(ids), InU32(&offsets), OutU32(&mut order), U64(m as u64), I32(vi)],
    );
    k.launch(
        "embedding_bwd_f32",
        cfg.unwrap_or(elem_cfg(vocab * c)),
        &mut [In(dy), InU32(&offsets), InU32(&order), Out(dweight), U64(m as u64), I32(vi), I32(ci)],
    );
    (offsets, order)
}

#[test]
fn embedding_kernels_equal_the_cpu_layer_bit_for_bit() {
    let Some(k) = kernels_or_skip("embedding_kernels_equal_the_cpu_layer_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(21);
    // (V, C, N, T): ids repeating many times over a small vocabulary; and a vocabulary of
    // 600, over 256, so the offsets kernel's threads scan chunks of 3 counts, with rows
    // that no token uses.
    for (vocab, c, n, t) in [(7, 5, 3, 11), (600, 3, 4, 50)] {
        let m = n * t;
        let ids: Vec<f32> = (0..m).map(|_| (rng.next_u64() % vocab as u64) as f32).collect();
        let dy = rng.vec(m * c);
        let (mut net, params, grads) = one_layer(&[t], Box::new(Embedding::new(vocab, c).unwrap()), &mut rng);
        let w = net.param_infos()[0].range.clone();
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let want_y = net.forward(Tensor::from_vec(ids.clone(), [n, t]).unwrap(), &params, &mut [], &ctx).unwrap();
        let mut want_grads = grads.clone();
        net.backward(Tensor::from_vec(dy.clone(), [n, t, c]).unwrap(), &params, &mut want_grads, &ctx).unwrap();
        // The sort, from its definition: each row's offset is the tokens of the rows
        // before it, and its tokens are listed in token order.
        let mut want_order: Vec<u32> = (0..m as u32).collect();
        want_order.sort_by_key(|&i| ids[i as usize] as u32);
        let mut want_offsets = vec![0u32; vocab + 1];
        for &id in &ids {
            want_offsets[id as usize + 1] += 1;
        }
        for v in 0..vocab {
            want_offsets[v + 1] += want_offsets[v];
        }
        let case = format!("(V, C, N, T) = ({vocab}, {c}, {n}, {t})");
        for cfg in [None, Some(FEW)] {
            let mut y = vec![f32::NAN; m * c];
            // As Gpu::embedding_fwd: ids, weight, y, m, vocab, c.
            k.launch(
                "embedding_fwd_f32",
                cfg.unwrap_or(elem_cfg(m * c)),
                &mut [In(&ids), In(&params[w.clone()]), Out(&mut y), U64(m as u64), I32(vocab as i32), I32(c as i32)],
            );
            // A copy of the rows: exact.
            assert_bits(&format!("embedding y {case} {cfg:?}"), &y, want_y.host());
            let mut dweight = grads[w.clone()].to_vec();
            let (offsets, order) = embedding_bwd_on_host(&k, cfg, &ids, &dy, &mut dweight, vocab, c);
            assert_eq!(offsets, want_offsets, "offsets {case} {cfg:?}");
            assert_eq!(order, want_order, "order {case} {cfg:?}");
            // Each (row, column) adds its tokens' dy in token order into the gradient's
            // value, as the CPU layer's `dweight[id] += dy` loop does: the same f32 adds.
            assert_bits(&format!("embedding dweight {case} {cfg:?}"), &dweight, &want_grads[w.clone()]);
        }
    }

    // Ids the host refuses (check_ids) never index the table on the device: the forward
    // writes NaN rows for them, the backward skips them. Reference: the CPU layer on the
    // good tokens alone, in their order.
    let (vocab, c, m) = (7, 4, 20);
    let mut ids: Vec<f32> = (0..m).map(|_| (rng.next_u64() % vocab as u64) as f32).collect();
    let bad = [(0, 7.0), (5, -1.0), (9, 2.5), (12, f32::NAN), (13, 1e30), (19, f32::NEG_INFINITY)];
    for &(i, v) in &bad {
        ids[i] = v;
    }
    let good: Vec<usize> = (0..m).filter(|i| bad.iter().all(|&(b, _)| b != *i)).collect();
    let dy = rng.vec(m * c);
    let (mut net, params, grads) = one_layer(&[good.len()], Box::new(Embedding::new(vocab, c).unwrap()), &mut rng);
    let w = net.param_infos()[0].range.clone();
    let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
    let good_ids: Vec<f32> = good.iter().map(|&i| ids[i]).collect();
    let good_dy: Vec<f32> = good.iter().flat_map(|&i| dy[i * c..(i + 1) * c].to_vec()).collect();
    let y_good = net.forward(Tensor::from_vec(good_ids, [1, good.len()]).unwrap(), &params, &mut [], &ctx).unwrap();
    let mut want_grads = grads.clone();
    net.backward(Tensor::from_vec(good_dy, [1, good.len(), c]).unwrap(), &params, &mut want_grads, &ctx).unwrap();
    let mut want_y = vec![f32::NAN; m * c];
    for (j, &i) in good.iter().enumerate() {
        want_y[i * c..(i + 1) * c].copy_from_slice(&y_good.host()[j * c..(j + 1) * c]);
    }
    let mut y = vec![0.0; m * c];
    k.launch(
        "embedding_fwd_f32",
        elem_cfg(m * c),
        &mut [In(&ids), In(&params[w.clone()]), Out(&mut y), U64(m as u64), I32(vocab as i32), I32(c as i32)],
    );
    let canonical = |v: &[f32]| v.iter().map(|&x| if x.is_nan() { f32::NAN } else { x }).collect::<Vec<_>>();
    assert_bits("embedding y with bad ids", &canonical(&y), &want_y);
    let mut dweight = grads[w.clone()].to_vec();
    let (offsets, _) = embedding_bwd_on_host(&k, None, &ids, &dy, &mut dweight, vocab, c);
    assert_eq!(offsets[vocab] as usize, good.len(), "bad ids are counted in no row");
    assert_bits("embedding dweight with bad ids", &dweight, &want_grads[w]);
}

// ---- reduce.cu -----------------------------------------------------------------------

#[test]
fn reduce_sum_adds_the_buffers_left_to_right_and_scales() {
    let Some(k) = kernels_or_skip("reduce_sum_adds_the_buffers_left_to_right_and_scales") else {
        return;
    };
    let mut rng = Rng(9);
    let n = 1001;
    for (kk, scale) in [(4, 0.125f32), (1, 1.0), (3, 1.0 / 3.0)] {
        let src = rng.vec(kk * n);
        // Bitwise: the kernel's order is buffer 0, 1, ..., K-1 in f32, then the scale.
        let want: Vec<f32> = (0..n).map(|i| (0..kk).fold(0.0f32, |acc, r| acc + src[r * n + i]) * scale).collect();
        for cfg in elem_cfgs(n) {
            let mut dst = vec![f32::NAN; n];
            // As Gpu::reduce_sum: src, dst, K (int), scale, n.
            k.launch("reduce_sum_f32", cfg, &mut [In(&src), Out(&mut dst), I32(kk as i32), F32(scale), U64(n as u64)]);
            assert_bits(&format!("reduce_sum K={kk} {cfg:?}"), &dst, &want);
        }
    }
}

// ---- codec.cu ------------------------------------------------------------------------

/// codec.cu against src/exchange/codec.rs: each kernel bit for bit on the same wires. The
/// encode kernel's wire is the codec's; the decode kernel's values are the codec's (NaN
/// payloads included: a block holding a NaN is unscaled, and the kernel skips the scale
/// of 2^0 there); the reduce kernel's sum is `Codec::reduce`'s, the canonical tree over
/// the wires — except which NaN a sum holding a NaN gives: CUDA returns its canonical NaN
/// for arithmetic on a NaN, x86 one of the operands' (which one depending on the order a
/// compiler gave the operands: even here, 3 of the fp16 sums' NaN codes differ in sign or
/// payload), so there a NaN must match a NaN (bf16 turns every NaN into 0x7FC0, so it
/// matches bit for bit anyway).
/// Then the whole GPU exchange (encode each slot, the wires side by side, reduce, decode)
/// against the shared-memory exchange on the same slots, on 1 and 2 members.
#[test]
fn codec_kernels_equal_the_codec_bit_for_bit() {
    let Some(k) = kernels_or_skip("codec_kernels_equal_the_codec_bit_for_bit") else {
        return;
    };
    let (encoded, raw) = (6 * 1024 + 300, 700);
    let len = encoded + raw;
    for compression in [Compression::Bf16, Compression::Fp16] {
        let codec = Codec::new(compression, encoded).unwrap();
        let g = WireGeom::new(&codec, len);
        assert_eq!(g.payload(), codec.wire(0..len).bytes(), "{compression:?}: the bytes a wire carries");
        let mut rng = Rng(40 + compression as u64);
        for r in [1usize, 2, 3, 5] {
            let case = format!("{compression:?}, {r} wires");
            let CodecInputs { slots, wires: cpu_wires, stride, src } = codec_inputs(&codec, &mut rng, r, encoded, raw);
            // Encode: all r slots in one launch (grid.y = r), slot j at j·stride, as
            // Gpu::wire_encode pushes it: src, wires, format, encoded, raw, stride,
            // wire bytes, exps_at, raw_at.
            let mut wires = vec![0u8; r * g.bytes()];
            let cfg = Cfg { grid: (g.blocks() as u32, r as u32, 1), block: (CODEC_THREADS, 1, 1) };
            k.launch(
                "wire_encode_f32",
                cfg,
                &mut [
                    In(&src),
                    OutU8(&mut wires),
                    I32(g.format()),
                    U64(encoded as u64),
                    U64(raw as u64),
                    U64(stride as u64),
                    U64(g.bytes() as u64),
                    U64(g.exps_at() as u64),
                    U64(g.raw_at() as u64),
                ],
            );
            for (j, w) in cpu_wires.iter().enumerate() {
                let got = &wires[j * g.bytes()..(j + 1) * g.bytes()];
                let bad = got.iter().zip(device_wire(&g, w)).position(|(a, b)| *a != b);
                assert_eq!(bad, None, "{case}: wire {j}, first byte off the codec's");
            }

            // Reduce: the codec's own wires, side by side, as Gpu::wire_reduce pushes them:
            // wires, out, R, format, encoded, raw, wire bytes, exps_at, raw_at.
            let side_by_side: Vec<u8> = cpu_wires.iter().flat_map(|w| device_wire(&g, w)).collect();
            let mut out = vec![0u8; g.bytes()];
            let cfg = Cfg { grid: (g.blocks() as u32, 1, 1), block: (CODEC_THREADS, 1, 1) };
            k.launch(
                "wire_reduce_f32",
                cfg,
                &mut [
                    InU8(&side_by_side),
                    OutU8(&mut out),
                    I32(r as i32),
                    I32(g.format()),
                    U64(encoded as u64),
                    U64(raw as u64),
                    U64(g.bytes() as u64),
                    U64(g.exps_at() as u64),
                    U64(g.raw_at() as u64),
                ],
            );
            let mut cpu_sum = codec.wire(0..len);
            codec.reduce(&cpu_wires.iter().collect::<Vec<_>>(), 0..len, &mut cpu_sum);
            let (codes, exps, raw_sum) = wire_parts(&g, &out);
            let (want_codes, want_exps, want_raw) = cpu_sum.parts();
            assert_eq!(exps, want_exps, "{case}: the sum's block exponents");
            let mut nans = 0;
            for (i, (&a, &b)) in codes.iter().zip(want_codes).enumerate() {
                if code_is_nan(compression, b) {
                    assert!(code_is_nan(compression, a), "{case}: sum code {i} is {a:#06x}, the codec's NaN {b:#06x}");
                    nans += 1;
                } else {
                    assert_eq!(a, b, "{case}: sum code {i}");
                }
            }
            assert!(nans > 0, "{case}: the specials reach the sum");
            for (i, (a, b)) in raw_sum.iter().zip(want_raw).enumerate() {
                assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{case}: raw sum {i}: {a} vs {b}");
            }
            if r == 5 {
                // The order the kernel must follow shows: left to right, raw value 0 sums
                // to 1, in the canonical tree to 1 + 2^-23 (codec_slot).
                let sequential = (0..r).fold(0.0f32, |acc, s| acc + slots[s][encoded]);
                assert_eq!((sequential, want_raw[0]), (1.0, 1.0 + 2f32.powi(-23)), "{case}");
            }

            // Decode: the codec's sum, as Gpu::wire_decode pushes it: wire, dst, format,
            // encoded, raw, exps_at, raw_at.
            let mut want = vec![0.0f32; len];
            codec.decode(&cpu_sum, 0..len, &mut want);
            for cfg in elem_cfgs(len) {
                let mut dst = vec![f32::NAN; len];
                k.launch(
                    "wire_decode_f32",
                    cfg,
                    &mut [
                        InU8(&device_wire(&g, &cpu_sum)),
                        Out(&mut dst),
                        I32(g.format()),
                        U64(encoded as u64),
                        U64(raw as u64),
                        U64(g.exps_at() as u64),
                        U64(g.raw_at() as u64),
                    ],
                );
                assert_bits(&format!("{case}: decoded sum {cfg:?}"), &dst, &want);
            }

            // The GPU exchange's chain on the kernels' own wires, against the shared-memory
            // exchange on the same slots (r logical replicas on 1 member, and on r
            // members when r is 1 or 5 — any device count with R fixed reads the same
            // sum).
            let mut reduced = vec![0u8; g.bytes()];
            k.launch(
                "wire_reduce_f32",
                cfg,
                &mut [
                    InU8(&wires),
                    OutU8(&mut reduced),
                    I32(r as i32),
                    I32(g.format()),
                    U64(encoded as u64),
                    U64(raw as u64),
                    U64(g.bytes() as u64),
                    U64(g.exps_at() as u64),
                    U64(g.raw_at() as u64),
                ],
            );
            let mut gpu_sum = vec![f32::NAN; len];
            k.launch(
                "wire_decode_f32",
                elem_cfg(len),
                &mut [
                    InU8(&reduced),
                    Out(&mut gpu_sum),
                    I32(g.format()),
                    U64(encoded as u64),
                    U64(raw as u64),
                    U64(g.exps_at() as u64),
                    U64(g.raw_at() as u64),
                ],
            );
            for members in [1, r] {
                for (member, cpu) in shm_exchange(members, codec, &slots).iter().enumerate() {
                    for (i, (a, b)) in gpu_sum.iter().zip(cpu).enumerate() {
                        assert!(
                            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                            "{case}: value {i} of the GPU chain {a} vs the CPU exchange's {b} ({members} members, member {member})"
                        );
                    }
                }
            }
        }
    }
}

// ---- batchnorm.cu: synchronized BatchNorm ----------------------------------------------


/// (N, C, HW, with gamma, with beta) of the synchronized BatchNorm checks: HW 37 (four
/// chunks of eight and a tail), 64 (no tail), 5 (only a tail); N = 300, more samples than
/// a block's 256 threads; N = 1.
const SYNC_BN_CASES: [(usize, usize, usize, bool, bool); 5] = [
    (5, 3, 37, true, true),
    (3, 2, 64, false, true),
    (2, 2, 5, true, false),
    (300, 2, 9, false, false),
    (1, 3, 16, true, true),
];


/// launch.rs's `rows_cfg` of the LayerNorm row kernels: one warp of LN_LANES threads a
/// row, LN_BLOCK threads a block.
fn ln_rows_cfg(rows: usize) -> Cfg {
    let blocks = rows.div_ceil((LN_BLOCK / LN_LANES) as usize) as u32;
    Cfg { grid: (blocks, 1, 1), block: (LN_BLOCK, 1, 1) }
}


/// Causal self-attention's kernels (kernels/attention.cu) against ops::attention's CPU code:
/// the head split and merge are permutations, equal bit for bit, each other's inverse;
/// the causal softmax and its gradient against `causal_softmax_row` and
/// `causal_softmax_row_bwd` within 2e-6 relative to the row's largest value (the kernel
/// sums in a tree of 128 partial sums, the CPU in 16 lanes (`backend::simd::sum`), and
/// the host's expf is the C library's, the CPU's `simd::exp_f32`), their masked columns
/// exactly 0. T = 5 (one partial sum a column) and
/// T = 200 (two columns a thread), under the one-block-a-row launch and a grid too small
/// to cover the rows once.
#[test]
fn attention_kernels_match_the_cpu_layer() {
    use lockstep::ops::attention::{causal_softmax_row, causal_softmax_row_bwd};
    let Some(k) = kernels_or_skip("attention_kernels_match_the_cpu_layer") else {
        return;
    };
    let (n, t, parts, heads, hd) = (2usize, 5usize, 3usize, 2usize, 4usize);
    let len = parts * n * heads * t * hd;
    let x = Rng(0xa77e).vec(len);
    let mut want = vec![0.0f32; len];
    for p in 0..parts {
        for s in 0..n {
            for h in 0..heads {
                for i in 0..t {
                    for d in 0..hd {
                        want[(((p * n + s) * heads + h) * t + i) * hd + d] =
                            x[((s * t + i) * parts + p) * heads * hd + h * hd + d];
                    }
                }
            }
        }
    }
    let geom = |v: usize| I32(v as i32);
    for cfg in elem_cfgs(len) {
        let mut y = vec![f32::NAN; len];
        // As Gpu::attention_heads_fwd pushes them: x, y, n, t, parts, heads, hd.
        k.launch(
            "attention_heads_fwd_f32",
            cfg,
            &mut [In(&x), Out(&mut y), geom(n), geom(t), geom(parts), geom(heads), geom(hd)],
        );
        assert_bits("attention heads split", &y, &want);
        let mut back = vec![f32::NAN; len];
        // As Gpu::attention_heads_bwd: dy, dx, n, t, parts, heads, hd.
        k.launch(
            "attention_heads_bwd_f32",
            cfg,
            &mut [In(&y), Out(&mut back), geom(n), geom(t), geom(parts), geom(heads), geom(hd)],
        );
        assert_bits("attention heads merge of the split", &back, &x);
    }
    let row_cfgs = |rows: usize| {
        [
            Cfg { grid: (rows.min(65_535) as u32, 1, 1), block: (ATTENTION_BLOCK, 1, 1) },
            Cfg { grid: (3, 1, 1), block: (ATTENTION_BLOCK, 1, 1) },
        ]
    };
    for t in [5usize, 200] {
        let rows = 2 * t; // two (sample, head) pairs of T positions
        let scale = 1.0 / (hd as f32).sqrt();
        let mut rng = Rng(0x50f7 + t as u64);
        let s: Vec<f32> = rng.vec(rows * t).iter().map(|v| 4.0 * v).collect();
        let dp = rng.vec(rows * t);
        let mut want_p = s.clone();
        for (r, row) in want_p.chunks_exact_mut(t).enumerate() {
            causal_softmax_row(row, r % t, scale);
        }
        let mut want_ds = dp.clone();
        for (r, (row, p)) in want_ds.chunks_exact_mut(t).zip(want_p.chunks_exact(t)).enumerate() {
            causal_softmax_row_bwd(p, row, r % t, scale);
        }
        let close = |what: &str, got: &[f32], want: &[f32]| {
            for (r, (g, w)) in got.chunks_exact(t).zip(want.chunks_exact(t)).enumerate() {
                let scale = w.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
                for (j, (a, b)) in g.iter().zip(w).enumerate() {
                    if j > r % t {
                        assert_eq!(a.to_bits(), 0, "{what} T = {t}: row {r}, masked column {j} is {a}");
                    } else {
                        assert!((a - b).abs() <= 2e-6 * scale, "{what} T = {t}: row {r}, column {j}: {a} vs {b}");
                    }
                }
            }
        };
        for cfg in row_cfgs(rows) {
            let mut p = vec![f32::NAN; rows * t];
            // As Gpu::attention_softmax_fwd: s, p, rows, t, scale.
            k.launch("attention_softmax_fwd_f32", cfg, &mut [In(&s), Out(&mut p), geom(rows), geom(t), F32(scale)]);
            close("softmax", &p, &want_p);
            let mut ds = vec![f32::NAN; rows * t];
            // As Gpu::attention_softmax_bwd: p, dp, ds, rows, t, scale (from the CPU's p,
            // so that the gradient is checked alone).
            k.launch(
                "attention_softmax_bwd_f32",
                cfg,
                &mut [In(&want_p), In(&dp), Out(&mut ds), geom(rows), geom(t), F32(scale)],
            );
            close("softmax gradient", &ds, &want_ds);
        }
    }
}
