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
//!     it ends, and the entries together must be train::kernel_files()): a new kernel without a
//!     host check fails `every_kernel_in_kernels_is_checked_here`;
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
use lockstep::nn::{
    BatchNorm2d, Ctx, Dropout, Layer, LayerNorm, MaxPool2d, Padding, PositionalEmbedding, Sequential, Window2d,
};
use lockstep::ops::batchnorm::RunningUpdate;
use lockstep::ops::dropout::gpu::DropoutKey;
use lockstep::ops::gelu::{gelu_grad, gelu_value};
use lockstep::ops::layernorm::gpu::{LN_BLOCK, LN_LANES};
use lockstep::ops::layernorm::{row_stats, ROW_CHUNK};
use lockstep::ops::maxpool2d::{maxpool2d_plane_bwd, maxpool2d_plane_fwd};
use lockstep::ops::window::WindowGeom;
use lockstep::train::kernel_files;
use lockstep::{Device, Tensor};

use common::{
    assert_close, bias_nchw_bwd_ref, col2im_ref, dropout_keep, f64s, im2col_ref, sync_bn_cpu, sync_bn_global_sums,
    sync_bn_merge, BnInputs, Rng, ATOL_ELEM, ATOL_SUM, RTOL_ELEM, RTOL_SUM,
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
    let header = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kernels_host/cuda_host.h");
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
use Arg::{In, InF64, InU32, Null, Out, OutF64, OutU32, F32, F64, I32, U64};

impl Arg<'_> {
    /// Whether this value may fill a parameter of type `code` (cuda_host.h's letters).
    fn fits(&self, code: u8) -> bool {
        match self {
            In(_) => code == b'r',
            Out(_) => code == b'w',
            InU32(_) => code == b'R',
            OutU32(_) => code == b'W',
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
            OutF64(v) => {
                v.iter_mut().zip(b.chunks_exact(8)).for_each(|(x, c)| *x = f64::from_ne_bytes(c.try_into().unwrap()))
            }
            _ => {}
        }
    }

    fn read_only(&self) -> bool {
        matches!(self, In(_) | InU32(_) | InF64(_))
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
    ("residual_add_equals_the_cpu_block_bit_for_bit", &["residual_add_fwd_f32"]),
    ("relu_fwd_and_bwd_match_the_reference", &["relu_fwd_f32", "relu_bwd_f32"]),
    ("gelu_fwd_and_bwd_equal_the_cpu_layer_bit_for_bit", &["gelu_fwd_f32", "gelu_bwd_f32"]),
    ("rescale_scale_and_fill_match_the_reference", &["rescale_fwd_f32", "rescale_bwd_f32", "scale_f32", "fill_f32"]),
    (
        "bias_adds_and_their_reductions_match_the_reference",
        &["bias_nchw_fwd_f32", "bias_nchw_bwd_f32", "bias_cols_fwd_f32", "bias_cols_bwd_f32"],
    ),
    (
        "im2col_and_col2im_match_the_cpu_backend_with_stride_and_asymmetric_padding",
        &["im2col_fwd_f32", "im2col_bwd_f32"],
    ),
    (
        "batchnorm_train_eval_and_backward_match_the_reference",
        &["batchnorm_train_fwd_f32", "batchnorm_eval_fwd_f32", "batchnorm_train_bwd_f32"],
    ),
    ("global_average_pool_matches_the_reference", &["global_avgpool_fwd_f32", "global_avgpool_bwd_f32"]),
    ("maxpool2d_matches_the_cpu_layer_bit_for_bit", &["maxpool2d_fwd_f32", "maxpool2d_bwd_f32"]),
    ("dropout_masks_equal_the_cpu_layer_bit_for_bit", &["dropout_fwd_f32", "dropout_bwd_f32"]),
    (
        "synchronized_batchnorm_kernels_equal_the_cpu_layer_bit_for_bit",
        &["batchnorm_moments_fwd_f32", "batchnorm_sync_fwd_f32", "batchnorm_sums_bwd_f32", "batchnorm_sync_bwd_f32"],
    ),
    ("batchnorm_count_equals_the_cpu_count_bit_for_bit", &["batchnorm_count_fwd_f32"]),
    (
        "positional_embedding_kernels_equal_the_cpu_layer_bit_for_bit",
        &["positional_embedding_fwd_f32", "positional_embedding_bwd_f32"],
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
    assert_eq!(found, checked, "a kernel without a host check here, or a check of a kernel that is gone");
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
fn residual_add_equals_the_cpu_block_bit_for_bit() {
    let Some(k) = kernels_or_skip("residual_add_equals_the_cpu_block_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(31);
    let n = 3000;
    let (mut a, mut b) = (rng.vec(n), rng.vec(n));
    // Signed zeros, an infinity against its opposite (NaN), a NaN passing through.
    (a[0], b[0], a[1], b[1], a[2], b[2], a[3]) = (0.0, -0.0, -0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN);
    let mut want = a.clone();
    lockstep::model::residual::add_in_place(&mut want, &b);
    for cfg in elem_cfgs(n) {
        let mut y = vec![f32::NAN; n];
        // As Gpu::residual_add pushes them: a, b, y, n.
        k.launch("residual_add_fwd_f32", cfg, &mut [In(&a), In(&b), Out(&mut y), U64(n as u64)]);
        assert_bits(&format!("residual add {cfg:?}"), &y, &want);
    }
}

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
fn gelu_fwd_and_bwd_equal_the_cpu_layer_bit_for_bit() {
    let Some(k) = kernels_or_skip("gelu_fwd_and_bwd_equal_the_cpu_layer_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(21);
    let n = 3000;
    // Over [-10, 10): both tails and the middle; then the signed zeros, the far tail (y and
    // dx round to -0), the infinities and a NaN.
    let mut x: Vec<f32> = rng.vec(n).iter().map(|v| 10.0 * v).collect();
    let dy = rng.vec(n);
    x[..8].copy_from_slice(&[0.0, -0.0, -20.0, 1e-3, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -8.0]);
    // The CPU layer's own arithmetic (ops::gelu), value by value.
    let want_y: Vec<f32> = x.iter().map(|&v| gelu_value(v)).collect();
    let want_dx: Vec<f32> = x.iter().zip(&dy).map(|(&v, &g)| gelu_grad(v, g)).collect();
    for cfg in elem_cfgs(n) {
        let (mut y, mut dx) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        // As Gpu::gelu_fwd pushes them: x, y, n.
        k.launch("gelu_fwd_f32", cfg, &mut [In(&x), Out(&mut y), U64(n as u64)]);
        // As Gpu::gelu_bwd: x, dy, dx, n.
        k.launch("gelu_bwd_f32", cfg, &mut [In(&x), In(&dy), Out(&mut dx), U64(n as u64)]);
        // Both sides evaluate the same f32 operations in the same order, uncontracted (erfcc's
        // polynomial by Estrin's scheme, exp by Cephes' polynomial, no library function), so
        // the results are equal bit for bit, here and on a GPU. A NaN's sign and payload are
        // the compiler's choice of operand order (and the GPU's NaN is canonical), so NaNs
        // compare as NaNs.
        let canonical = |v: &[f32]| v.iter().map(|&x| if x.is_nan() { f32::NAN } else { x }).collect::<Vec<_>>();
        assert_bits(&format!("gelu y {cfg:?}"), &canonical(&y), &canonical(&want_y));
        assert_bits(&format!("gelu dx {cfg:?}"), &canonical(&dx), &canonical(&want_dx));
    }
}

#[test]
fn rescale_scale_and_fill_match_the_reference() {
    let Some(k) = kernels_or_skip("rescale_scale_and_fill_match_the_reference") else {
        return;
    };
    let mut rng = Rng(2);
    let n = 2500;
    let x: Vec<f32> = rng.vec(n).iter().map(|v| 255.0 * v).collect();
    let dy = rng.vec(n);
    let (scale, offset) = (1.0f32 / 255.0, -0.5f32);
    let want_y: Vec<f64> = x.iter().map(|&v| v as f64 * scale as f64 + offset as f64).collect();
    let want_dx: Vec<f64> = dy.iter().map(|&g| g as f64 * scale as f64).collect();
    for cfg in elem_cfgs(n) {
        let (mut y, mut dx) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        // As Gpu::rescale_fwd: x, y, scale, offset, n.
        k.launch("rescale_fwd_f32", cfg, &mut [In(&x), Out(&mut y), F32(scale), F32(offset), U64(n as u64)]);
        // As Gpu::rescale_bwd: dy, dx, scale, n.
        k.launch("rescale_bwd_f32", cfg, &mut [In(&dy), Out(&mut dx), F32(scale), U64(n as u64)]);
        // x*scale rounds once and + offset once, each within half an ulp of a value of
        // magnitude <= 1.5: 1e-6 relative plus 1e-7 absolute.
        assert_close(&format!("rescale y {cfg:?}"), &y, &want_y, RTOL_ELEM, ATOL_ELEM);
        assert_close(&format!("rescale dx {cfg:?}"), &dx, &want_dx, RTOL_ELEM, ATOL_ELEM);

        // As Gpu::scale: x, s, n. One multiply by 0.25 (a power of two): exact.
        k.launch("scale_f32", cfg, &mut [Out(&mut dx), F32(0.25), U64(n as u64)]);
        let want: Vec<f32> = dy.iter().map(|&g| g * scale * 0.25).collect();
        assert_bits(&format!("scale {cfg:?}"), &dx, &want);
        // As Gpu::fill: x, v, n.
        k.launch("fill_f32", cfg, &mut [Out(&mut y), F32(3.5), U64(n as u64)]);
        assert_bits(&format!("fill {cfg:?}"), &y, &vec![3.5; n]);
    }
}

#[test]
fn bias_adds_and_their_reductions_match_the_reference() {
    let Some(k) = kernels_or_skip("bias_adds_and_their_reductions_match_the_reference") else {
        return;
    };
    let mut rng = Rng(3);
    // NCHW with M = N*H*W below one block (3*49 = 147 of 256 threads busy) and above it
    // (4*100 = 400: threads 0..143 sum two terms each before the tree).
    for (n, c, hw) in [(3, 5, 49), (4, 3, 100)] {
        let (y0, bias, dy, dbias0) = (rng.vec(n * c * hw), rng.vec(c), rng.vec(n * c * hw), rng.vec(c));
        let total = n * c * hw;
        let want: Vec<f64> = (0..total).map(|i| y0[i] as f64 + bias[(i / hw) % c] as f64).collect();
        for cfg in elem_cfgs(total) {
            let mut y = y0.clone();
            // As Gpu::bias_nchw_fwd: y, bias, C (int), hw, total.
            k.launch(
                "bias_nchw_fwd_f32",
                cfg,
                &mut [Out(&mut y), In(&bias), I32(c as i32), U64(hw as u64), U64(total as u64)],
            );
            // One f32 add: half an ulp.
            assert_close(&format!("bias_nchw y {cfg:?}"), &y, &want, RTOL_ELEM, ATOL_ELEM);
        }
        let mut dbias = dbias0.clone();
        // As Gpu::bias_nchw_bwd: dy, dbias, N (int), C (int), hw; grid = (C).
        let cfg = channel_cfg(c as i32);
        k.launch(
            "bias_nchw_bwd_f32",
            cfg,
            &mut [In(&dy), Out(&mut dbias), I32(n as i32), I32(c as i32), U64(hw as u64)],
        );
        let want = bias_nchw_bwd_ref(&dy, &dbias0, (n, c, hw));
        // Up to 400 terms of magnitude <= 1, in f32: 1e-5 relative plus 1e-5 absolute.
        assert_close(&format!("bias_nchw dbias (accumulated), N={n} C={c} HW={hw}"), &dbias, &want, RTOL_SUM, ATOL_SUM);
    }

    // (N, O) with O above one block (300 columns), so two blocks share the columns, and
    // the FEW grid with fewer threads than columns.
    let (n, o) = (7, 300);
    let (y0, bias, dy, dbias0) = (rng.vec(n * o), rng.vec(o), rng.vec(n * o), rng.vec(o));
    let total = n * o;
    let want_y: Vec<f64> = (0..total).map(|i| y0[i] as f64 + bias[i % o] as f64).collect();
    let want_db: Vec<f64> =
        (0..o).map(|j| dbias0[j] as f64 + (0..n).map(|s| dy[s * o + j] as f64).sum::<f64>()).collect();
    for (cfg_fwd, cfg_bwd) in [(elem_cfg(total), elem_cfg(o)), (FEW, FEW)] {
        let mut y = y0.clone();
        // As Gpu::bias_cols_fwd: y, bias, O (int), total.
        k.launch("bias_cols_fwd_f32", cfg_fwd, &mut [Out(&mut y), In(&bias), I32(o as i32), U64(total as u64)]);
        assert_close(&format!("bias_cols y {cfg_fwd:?}"), &y, &want_y, RTOL_ELEM, ATOL_ELEM);
        let mut dbias = dbias0.clone();
        // As Gpu::bias_cols_bwd: dy, dbias, N (int), O (int); one thread per column.
        k.launch("bias_cols_bwd_f32", cfg_bwd, &mut [In(&dy), Out(&mut dbias), I32(n as i32), I32(o as i32)]);
        // 7 rows summed in order, plus the old value.
        assert_close(&format!("bias_cols dbias (accumulated) {cfg_bwd:?}"), &dbias, &want_db, RTOL_SUM, ATOL_SUM);
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

#[test]
fn im2col_and_col2im_match_the_cpu_backend_with_stride_and_asymmetric_padding() {
    let Some(k) = kernels_or_skip("im2col_and_col2im_match_the_cpu_backend_with_stride_and_asymmetric_padding") else {
        return;
    };
    let mut rng = Rng(4);
    let geom = |(n, c, h, w), (kh, kw), (stride_h, stride_w), (pad_top, pad_left, pad_bottom, pad_right)| WindowGeom {
        n,
        c,
        h,
        w,
        kh,
        kw,
        stride_h,
        stride_w,
        pad_top,
        pad_left,
        pad_bottom,
        pad_right,
    };
    let geoms = [
        // The Keras convnet's first layer, smaller: 3x3, stride 1, no padding.
        geom((2, 1, 12, 12), (3, 3), (1, 1), (0, 0, 0, 0)),
        // TF "same" padding with stride 2 on an even size: 0 top/left, 1 bottom/right.
        geom((2, 3, 8, 6), (3, 3), (2, 2), (0, 0, 1, 1)),
        // Stride 2, every pad different (1/2/0/1), a 3x2 kernel: the CPU backend's case.
        geom((2, 2, 7, 9), (3, 2), (2, 2), (1, 2, 0, 1)),
        // Everything different: 2x4 kernel, strides 2/3, padding 1/2/0/1 (no CPU twin).
        geom((3, 2, 7, 9), (2, 4), (2, 3), (1, 2, 0, 1)),
    ];
    for g in &geoms {
        let x = rng.vec(g.x_len());
        let dcol = rng.vec(g.col_len());
        let want_col = im2col_ref(&x, g);
        let want_dx = col2im_ref(&dcol, g);
        for cfg in [elem_cfg(g.col_len()), FEW] {
            let mut col = vec![f32::NAN; g.col_len()];
            let mut args = vec![In(&x), Out(&mut col)];
            args.extend(conv_args(g).map(I32));
            // As Gpu::im2col_fwd: x, col, then conv_args.
            k.launch("im2col_fwd_f32", cfg, &mut args);
            // Copies and zeros: exact.
            assert_bits(&format!("im2col {g:?} {cfg:?}"), &col, &want_col);
        }
        for cfg in [elem_cfg(g.x_len()), FEW] {
            let mut dx = vec![f32::NAN; g.x_len()];
            let mut args = vec![In(&dcol), Out(&mut dx)];
            args.extend(conv_args(g).map(I32));
            // As Gpu::im2col_bwd: dcol, dx, then conv_args.
            k.launch("im2col_bwd_f32", cfg, &mut args);
            // At most KH*KW = 9 terms per element, in f32.
            assert_close(&format!("col2im {g:?} {cfg:?}"), &dx, &want_dx, RTOL_SUM, ATOL_SUM);
            let Some(cg) = cpu_geom(g) else { continue };
            let (per_x, per_col) = (g.c * g.h * g.w, cg.col_rows() * cg.col_cols());
            let mut cpu_col = vec![0.0; g.col_len()];
            let mut cpu_dx = vec![0.0; g.x_len()];
            for s in 0..g.n {
                cpu::im2col(&x[s * per_x..(s + 1) * per_x], &cg, &mut cpu_col[s * per_col..(s + 1) * per_col]);
                cpu::col2im(&dcol[s * per_col..(s + 1) * per_col], &cg, &mut cpu_dx[s * per_x..(s + 1) * per_x]);
            }
            // One layout for both backends (conv.cu's promise): the CPU's col equals the
            // reference, and its col2im adds each dx element's terms in the kernel's
            // order, (kh, kw) ascending from 0, so the two agree bit for bit.
            assert_bits(&format!("cpu im2col {g:?}"), &cpu_col, &want_col);
            assert_bits(&format!("col2im vs cpu::col2im {g:?} {cfg:?}"), &dx, &cpu_dx);
        }
    }
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

#[test]
fn batchnorm_train_eval_and_backward_match_the_reference() {
    let Some(k) = kernels_or_skip("batchnorm_train_eval_and_backward_match_the_reference") else {
        return;
    };
    let mut rng = Rng(5);
    let (momentum, eps) = (0.99f32, 1e-3f32);
    // (N, C, HW, with gamma, with beta): every combination of the optional parameters at
    // M = 100 (< REDUCE_BLOCK: idle threads add 0), then M = 400 (threads sum strided
    // terms before the tree), M = 1 (the running variance takes the biased one) and
    // M = 0 (nothing is written).
    let cases = [
        (4, 3, 25, true, true),
        (4, 3, 25, false, true),
        (4, 3, 25, true, false),
        (4, 3, 25, false, false),
        (4, 2, 100, true, true),
        (1, 2, 1, true, true),
        (0, 2, 9, true, true),
    ];
    for (n, c, hw, with_gamma, with_beta) in cases {
        let case = format!("N={n} C={c} HW={hw}, gamma {with_gamma}, beta {with_beta}");
        let total = n * c * hw;
        let inputs = BnInputs::random(&mut rng, (n, c, hw));
        let BnInputs {
            x, dy, gamma, beta, running_mean: rm0, running_var: rv0, dgamma: dgamma0, dbeta: dbeta0, ..
        } = &inputs;
        let (sm0, si0) = (vec![-7.0f32; c], vec![-7.0f32; c]);

        let mut y = vec![f32::NAN; total];
        let (mut rm, mut rv, mut sm, mut si) = (rm0.clone(), rv0.clone(), sm0.clone(), si0.clone());
        // As Gpu::batchnorm_train_fwd: x, y, gamma or 0, beta or 0, running_mean,
        // running_var, save_mean, save_invstd, N (int), C (int), hw, keep, take, unbias
        // (RunningUpdate's, rounded to f32), eps.
        let u = RunningUpdate::new(momentum, n * hw);
        k.launch(
            "batchnorm_train_fwd_f32",
            channel_cfg(c as i32),
            &mut [
                In(x),
                Out(&mut y),
                opt(with_gamma, gamma),
                opt(with_beta, beta),
                Out(&mut rm),
                Out(&mut rv),
                Out(&mut sm),
                Out(&mut si),
                I32(n as i32),
                I32(c as i32),
                U64(hw as u64),
                F32(u.keep as f32),
                F32(u.take as f32),
                F32(u.unbias as f32),
                F32(eps),
            ],
        );
        let mut dx = vec![f32::NAN; total];
        let (mut dgamma, mut dbeta) = (dgamma0.clone(), dbeta0.clone());
        let (sm_fwd, si_fwd) = (sm.clone(), si.clone());
        // As Gpu::batchnorm_train_bwd: x, dy, dx, gamma or 0, save_mean, save_invstd,
        // dgamma or 0, dbeta or 0, N (int), C (int), hw; dgamma is given exactly when
        // gamma is.
        k.launch(
            "batchnorm_train_bwd_f32",
            channel_cfg(c as i32),
            &mut [
                In(x),
                In(dy),
                Out(&mut dx),
                opt(with_gamma, gamma),
                In(&sm_fwd),
                In(&si_fwd),
                opt_mut(with_gamma, &mut dgamma),
                opt_mut(with_beta, &mut dbeta),
                I32(n as i32),
                I32(c as i32),
                U64(hw as u64),
            ],
        );
        if n == 0 {
            // M = 0: every statistic and parameter gradient is left as it was.
            assert_bits(&format!("bn running_mean ({case})"), &rm, rm0);
            assert_bits(&format!("bn running_var ({case})"), &rv, rv0);
            assert_bits(&format!("bn save_mean ({case})"), &sm, &sm0);
            assert_bits(&format!("bn save_invstd ({case})"), &si, &si0);
            assert_bits(&format!("bn dgamma ({case})"), &dgamma, dgamma0);
            assert_bits(&format!("bn dbeta ({case})"), &dbeta, dbeta0);
            continue;
        }

        // The reference tests/cuda_ops.rs holds the GPU to, in f64 (tests/common).
        let want = inputs.train_ref(with_gamma, with_beta, momentum, eps);
        // Tolerances of tests/cuda_ops.rs: up to 400 terms per channel through mean and
        // variance, 1e-4 relative and 1e-5 absolute; the running stats, one blend of
        // those, 1e-5 and 1e-6.
        assert_close(&format!("bn y ({case})"), &y, &want.y, 1e-4, 1e-5);
        assert_close(&format!("bn running_mean ({case})"), &rm, &want.running_mean, 1e-5, 1e-6);
        assert_close(&format!("bn running_var ({case})"), &rv, &want.running_var, 1e-5, 1e-6);
        // The CPU layer itself (f64 moments, RunningUpdate in f64) and the kernel (f32 block
        // sums, the same RunningUpdate rounded to f32): the one place the backends differ,
        // held to the same bound. (M = 1 is the kernel's edge alone: both replicas refuse
        // to train on one value per channel before any launch.)
        if n * hw > 1 {
            let (cpu_rm, cpu_rv) = cpu_running_stats(&inputs, with_gamma, with_beta, momentum, eps);
            assert_close(&format!("bn running_mean vs the CPU layer ({case})"), &rm, &f64s(&cpu_rm), 1e-5, 1e-6);
            assert_close(&format!("bn running_var vs the CPU layer ({case})"), &rv, &f64s(&cpu_rv), 1e-5, 1e-6);
        }
        assert_close(&format!("bn save_mean ({case})"), &sm, &want.save_mean, 1e-5, 1e-6);
        // invstd = 1/sqrt(var + eps) is up to 1/sqrt(eps) ~ 32 (at M = 1, var = 0).
        assert_close(&format!("bn save_invstd ({case})"), &si, &want.save_invstd, 1e-4, 1e-5);
        assert_close(&format!("bn dx ({case})"), &dx, &want.dx, 1e-4, 1e-5);
        // Absent parameters leave their gradient buffers untouched.
        assert_close(&format!("bn dgamma ({case})"), &dgamma, &want.dgamma, 1e-4, 1e-5);
        assert_close(&format!("bn dbeta ({case})"), &dbeta, &want.dbeta, 1e-4, 1e-5);

        // Eval with the running stats just updated.
        let want = inputs.eval_ref(with_gamma, with_beta, &rm, &rv, eps);
        for cfg in elem_cfgs(total) {
            let mut y = vec![f32::NAN; total];
            // As Gpu::batchnorm_eval_fwd: x, y, gamma or 0, beta or 0, running_mean,
            // running_var, C (int), hw, total, eps.
            k.launch(
                "batchnorm_eval_fwd_f32",
                cfg,
                &mut [
                    In(x),
                    Out(&mut y),
                    opt(with_gamma, gamma),
                    opt(with_beta, beta),
                    In(&rm),
                    In(&rv),
                    I32(c as i32),
                    U64(hw as u64),
                    U64(total as u64),
                    F32(eps),
                ],
            );
            // Four float ops per element: 1e-5 relative, 1e-6 absolute.
            assert_close(&format!("bn eval y ({case}) {cfg:?}"), &y, &want, 1e-5, 1e-6);
        }
    }
}

// ---- pooling.cu ----------------------------------------------------------------------

#[test]
fn global_average_pool_matches_the_reference() {
    let Some(k) = kernels_or_skip("global_average_pool_matches_the_reference") else {
        return;
    };
    let mut rng = Rng(6);
    let (nc, hw) = (2 * 64, 5 * 5);
    let (x, dy) = (rng.vec(nc * hw), rng.vec(nc));
    let want_y: Vec<f64> =
        (0..nc).map(|i| x[i * hw..(i + 1) * hw].iter().map(|&v| v as f64).sum::<f64>() / hw as f64).collect();
    let want_dx: Vec<f64> = (0..nc * hw).map(|i| dy[i / hw] as f64 / hw as f64).collect();
    for (cfg_fwd, cfg_bwd) in [(elem_cfg(nc), elem_cfg(nc * hw)), (FEW, FEW)] {
        let (mut y, mut dx) = (vec![f32::NAN; nc], vec![f32::NAN; nc * hw]);
        // As Gpu::global_avgpool_fwd: x, y, nc, hw.
        k.launch("global_avgpool_fwd_f32", cfg_fwd, &mut [In(&x), Out(&mut y), U64(nc as u64), U64(hw as u64)]);
        // As Gpu::global_avgpool_bwd: dy, dx, nc, hw.
        k.launch("global_avgpool_bwd_f32", cfg_bwd, &mut [In(&dy), Out(&mut dx), U64(nc as u64), U64(hw as u64)]);
        // 25 terms then a division; one division.
        assert_close(&format!("avgpool y {cfg_fwd:?}"), &y, &want_y, RTOL_SUM, ATOL_SUM);
        assert_close(&format!("avgpool dx {cfg_bwd:?}"), &dx, &want_dx, RTOL_ELEM, ATOL_ELEM);
    }
}

#[test]
fn maxpool2d_matches_the_cpu_layer_bit_for_bit() {
    let Some(k) = kernels_or_skip("maxpool2d_matches_the_cpu_layer_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(11);
    let cases = [
        // Overlapping windows (stride < pool): inputs that win several windows sum them.
        ((2, 3, 7, 7), Window2d::new((3, 3), (2, 2), Padding::Valid)),
        // Same padding with a pad at the bottom (rows 0 / 1) and both sides (columns 1 / 1),
        // unequal strides.
        ((2, 2, 5, 6), Window2d::new((2, 3), (2, 1), Padding::Same)),
        // The common 2×2 pool, with a ragged edge (row and column 6 unread).
        ((1, 2, 7, 7), Window2d::new((2, 2), (2, 2), Padding::Valid)),
        // Pads 1 / 2 on the rows: a window may hold a single row; every input in up to 12.
        ((3, 1, 5, 4), Window2d::new((4, 3), (1, 1), Padding::Same)),
    ];
    for ((n, c, h, w), window) in cases {
        let g = window.over(h, w).unwrap().launch_geom(n, c);
        let case = format!("{window:?} on ({n}, {c}, {h}, {w})");
        // Nine levels in [-1, 1] (so windows hold ties, and -0 beside 0), two NaNs and a -inf.
        let mut x: Vec<f32> = rng.vec(g.x_len()).iter().map(|v| (v * 4.0).round() / 4.0).collect();
        let len = x.len();
        (x[5], x[len - 3], x[7]) = (f32::NAN, f32::NAN, f32::NEG_INFINITY);
        let dy = rng.vec(g.pooled_len());

        // The CPU: y through the layer, argmax and dx from the functions it runs per plane.
        let mut net = Sequential::new(
            [c, h, w],
            vec![Box::new(MaxPool2d::new(window.kernel, window.stride, window.padding).unwrap()) as Box<dyn Layer>],
        )
        .unwrap();
        let layer_y = net
            .forward(Tensor::from_vec(x.clone(), [n, c, h, w]).unwrap(), &[], &mut [], &Ctx::eval(Device::Cpu(0)))
            .unwrap();
        let placed = window.over(h, w).unwrap();
        let (hw, ohw) = (h * w, g.oh() * g.ow());
        let (mut want_y, mut want_argmax, mut want_dx) =
            (vec![0.0; g.pooled_len()], vec![0u32; g.pooled_len()], vec![0.0; len]);
        for p in 0..n * c {
            let (o, i) = (p * ohw..(p + 1) * ohw, p * hw..(p + 1) * hw);
            maxpool2d_plane_fwd(&x[i.clone()], &placed, &mut want_y[o.clone()], &mut want_argmax[o.clone()]);
            maxpool2d_plane_bwd(&dy[o.clone()], &want_argmax[o], &mut want_dx[i]);
        }
        assert_bits(&format!("the layer vs its plane function, {case}"), layer_y.host(), &want_y);
        assert!(want_y.iter().any(|v| v.is_nan()) && want_dx.iter().any(|&v| v != 0.0), "{case}: the cases bite");

        for cfg in [elem_cfg(g.pooled_len()), FEW] {
            let (mut y, mut argmax) = (vec![f32::NAN; g.pooled_len()], vec![u32::MAX; g.pooled_len()]);
            let mut args = vec![In(&x), Out(&mut y), OutU32(&mut argmax)];
            args.extend(conv_args(&g).map(I32));
            // As Gpu::maxpool2d_fwd: x, y, argmax, then conv_args.
            k.launch("maxpool2d_fwd_f32", cfg, &mut args);
            // A maximum is one of its inputs, and the scan order is the CPU's: exact, NaN
            // payloads and the sign of a winning zero included.
            assert_bits(&format!("maxpool y {case} {cfg:?}"), &y, &want_y);
            assert_eq!(argmax, want_argmax, "maxpool argmax {case} {cfg:?}");
        }
        for cfg in [elem_cfg(g.x_len()), FEW] {
            let mut dx = vec![f32::NAN; len];
            let mut args = vec![In(&dy), InU32(&want_argmax), Out(&mut dx)];
            args.extend(conv_args(&g).map(I32));
            // As Gpu::maxpool2d_bwd: dy, argmax, dx, then conv_args.
            k.launch("maxpool2d_bwd_f32", cfg, &mut args);
            // Each input adds the dy of the windows it won in row-major output order, from
            // 0, as maxpool2d_plane_bwd does: the same f32 additions, bit for bit.
            assert_bits(&format!("maxpool dx {case} {cfg:?}"), &dx, &want_dx);
        }
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

#[test]
fn positional_embedding_kernels_equal_the_cpu_layer_bit_for_bit() {
    let Some(k) = kernels_or_skip("positional_embedding_kernels_equal_the_cpu_layer_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(22);
    // A table of P = 9 positions used for T = 5: rows 5..9 take no part.
    let (p, n, t, c) = (9, 3, 5, 4);
    let (tc, total) = (t * c, n * t * c);
    let (x, dy) = (rng.vec(total), rng.vec(total));
    let (mut net, params, grads) = one_layer(&[t, c], Box::new(PositionalEmbedding::new(p, c).unwrap()), &mut rng);
    let w = net.param_infos()[0].range.clone();
    let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
    let want_y = net.forward(Tensor::from_vec(x.clone(), [n, t, c]).unwrap(), &params, &mut [], &ctx).unwrap();
    let mut want_grads = grads.clone();
    let want_dx =
        net.backward_input(Tensor::from_vec(dy.clone(), [n, t, c]).unwrap(), &params, &mut want_grads, &ctx).unwrap();
    assert_eq!(want_grads[w.start + tc..w.end], grads[w.start + tc..w.end], "rows past T get nothing");
    let first_rows = w.start..w.start + tc;
    for cfg in elem_cfgs(total) {
        let mut y = vec![f32::NAN; total];
        // As Gpu::positional_embedding_fwd: x, weight (its first T rows), y, tc, total.
        k.launch(
            "positional_embedding_fwd_f32",
            cfg,
            &mut [In(&x), In(&params[first_rows.clone()]), Out(&mut y), U64(tc as u64), U64(total as u64)],
        );
        // One f32 add per value, as the CPU's: exact.
        assert_bits(&format!("positional y {cfg:?}"), &y, want_y.host());
    }
    for cfg in elem_cfgs(tc) {
        for with_dx in [true, false] {
            let mut dweight = grads[first_rows.clone()].to_vec();
            let mut dx = vec![f32::NAN; total];
            // As Gpu::positional_embedding_bwd: dy, dweight (its first T rows), dx or NULL, n, tc.
            let dx_arg = if with_dx { Out(&mut dx) } else { Null };
            k.launch(
                "positional_embedding_bwd_f32",
                cfg,
                &mut [In(&dy), Out(&mut dweight), dx_arg, I32(n as i32), U64(tc as u64)],
            );
            // dy added over n in order into the gradient's value, as the CPU's loop: the
            // same f32 adds; dx a copy.
            assert_bits(&format!("positional dweight {cfg:?} dx {with_dx}"), &dweight, &want_grads[first_rows.clone()]);
            if with_dx {
                assert_bits(&format!("positional dx {cfg:?}"), &dx, want_dx.host());
            } else {
                assert!(dx.iter().all(|v| v.is_nan()), "no dx written without one");
            }
        }
    }
}

// ---- dropout.cu ----------------------------------------------------------------------

/// What the CPU `Dropout` layer outputs for `x` (N, F) at layer index `layer` of a model,
/// in training step `step` of logical replica `shard`: the layer runs inside a
/// `Sequential` behind `layer` dropouts of rate 0 (the identity), which only move it to
/// that index. Its backward multiplies dout by the very per-element factors its forward
/// used, so the forward of dy is also what its backward returns for dy.
fn cpu_dropout(x: &[f32], f: usize, rate: f32, seed: u64, step: u64, shard: usize, layer: usize) -> Vec<f32> {
    cpu_dropout_at(x, f, rate, (seed, step, shard, layer), 0)
}

/// [`cpu_dropout`] of a micro-batch whose first sample is sample `offset` of its shard.
fn cpu_dropout_at(x: &[f32], f: usize, rate: f32, key: (u64, u64, usize, usize), offset: usize) -> Vec<f32> {
    let (seed, step, shard, layer) = key;
    let mut layers: Vec<Box<dyn Layer>> = (0..layer).map(|_| Box::new(Dropout::new(0.0).unwrap()) as _).collect();
    layers.push(Box::new(Dropout::new(rate).unwrap()));
    let mut net = Sequential::new([f], layers).unwrap();
    let ctx = Ctx { sample_offset: offset, ..Ctx::train(seed, step, shard, Device::Cpu(0)) };
    let x = Tensor::from_vec(x.to_vec(), [x.len() / f, f]).unwrap();
    net.forward(x, &[], &mut [], &ctx).unwrap().into_vec()
}

#[test]
fn dropout_masks_equal_the_cpu_layer_bit_for_bit() {
    let Some(k) = kernels_or_skip("dropout_masks_equal_the_cpu_layer_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(10);
    let (n, f) = (4000, 100);
    let x: Vec<f32> = rng.vec(n).iter().map(|v| v + 2.0).collect(); // never 0, so drops are visible
    let dy = rng.vec(n);
    let (seed, step, shard, layer) = (42u64, 7u64, 1usize, 3usize);
    let rate = 0.3f32;
    let want_y = cpu_dropout(&x, f, rate, seed, step, shard, layer);
    let want_dx = cpu_dropout(&dy, f, rate, seed, step, shard, layer);
    let scale = 1.0f32 / (1.0 - rate);
    for cfg in elem_cfgs(n) {
        let (mut y, mut dx) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        let key = [U64(seed), U64(step), U64(shard as u64), U64(layer as u64), U64(0)];
        let mut args = vec![In(&x), Out(&mut y), F32(rate)];
        args.extend(key);
        args.push(U64(n as u64));
        // As Gpu::dropout (fwd): x, y, rate, seed, step, shard, layer, first, n.
        k.launch("dropout_fwd_f32", cfg, &mut args);
        let key = [U64(seed), U64(step), U64(shard as u64), U64(layer as u64), U64(0)];
        let mut args = vec![In(&dy), Out(&mut dx), F32(rate)];
        args.extend(key);
        args.push(U64(n as u64));
        // As Gpu::dropout (bwd): dy, dx, rate, seed, step, shard, layer, first, n.
        k.launch("dropout_bwd_f32", cfg, &mut args);
        // Bitwise: one mask, from the same integer hash, and one f32 multiply by the same
        // f32 1/(1 - rate) on both sides.
        assert_bits(&format!("dropout y vs nn::Dropout {cfg:?}"), &y, &want_y);
        assert_bits(&format!("dropout dx vs nn::Dropout {cfg:?}"), &dx, &want_dx);
        // And the mask is the documented function of rng (what cuda_ops.rs checks on a GPU).
        let dkey = DropoutKey { seed, step, shard: shard as u64, layer: layer as u64, first: 0 };
        let mut kept = 0;
        for i in 0..n {
            let keep = dropout_keep(dkey, i as u64, rate);
            kept += keep as usize;
            assert_eq!(y[i].to_bits(), (x[i] * if keep { scale } else { 0.0 }).to_bits(), "y[{i}]");
        }
        // Binomial(4000, 0.7): sd = 29, so +-4 sd is 0.7 +- 0.029.
        let frac = kept as f64 / n as f64;
        assert!((frac - 0.7).abs() < 0.029, "kept fraction {frac}");
    }

    // Another shard, step or layer: another mask.
    for (s, r, l) in [(step + 1, shard, layer), (step, shard + 1, layer), (step, shard, layer + 1)] {
        let mut y = vec![0.0f32; n];
        let mut args = vec![In(&x), Out(&mut y), F32(rate), U64(seed), U64(s), U64(r as u64), U64(l as u64)];
        args.extend([U64(0), U64(n as u64)]);
        k.launch("dropout_fwd_f32", elem_cfg(n), &mut args);
        assert_bits(&format!("dropout y, step {s} shard {r} layer {l}"), &y, &cpu_dropout(&x, f, rate, seed, s, r, l));
        assert_ne!(y, want_y);
    }
    // launch.rs accepts rate 0 and 1 (the CPU layer refuses 1): all kept, unscaled; all
    // dropped, to dy * 0 (so -0 for a negative dy) and never NaN although 1/(1 - rate) is
    // infinite.
    for (rate, want) in [(0.0f32, dy.clone()), (1.0, dy.iter().map(|v| v * 0.0).collect())] {
        let mut dx = vec![f32::NAN; n];
        let mut args = vec![In(&dy), Out(&mut dx), F32(rate), U64(seed), U64(step), U64(shard as u64)];
        args.extend([U64(layer as u64), U64(0), U64(n as u64)]);
        k.launch("dropout_bwd_f32", elem_cfg(n), &mut args);
        assert_bits(&format!("dropout dx at rate {rate}"), &dx, &want);
    }
    // A later micro-batch of an accumulated step: rows 25..40 of the shard (first = 25·F)
    // get the masks the CPU layer draws at sample_offset 25, which are the whole shard's
    // rows 25..40 (gradient accumulation draws the unaccumulated step's masks).
    let (from, rows) = (25usize, 15usize);
    let part = &x[from * f..(from + rows) * f];
    let mut y = vec![f32::NAN; rows * f];
    let mut args = vec![In(part), Out(&mut y), F32(rate), U64(seed), U64(step), U64(shard as u64)];
    args.extend([U64(layer as u64), U64((from * f) as u64), U64((rows * f) as u64)]);
    k.launch("dropout_fwd_f32", elem_cfg(rows * f), &mut args);
    let cpu_part = cpu_dropout_at(part, f, rate, (seed, step, shard, layer), from);
    assert_bits("dropout of a later micro-batch vs nn::Dropout at its offset", &y, &cpu_part);
    assert_bits("dropout of a later micro-batch vs the whole shard's rows", &y, &want_y[from * f..(from + rows) * f]);
}

// ---- batchnorm.cu: synchronized BatchNorm ----------------------------------------------

/// The synchronized BatchNorm kernels against the CPU layer (ops::batchnorm, as
/// `--sync-batchnorm` runs it on CPU devices; tests/common's `sync_bn_cpu`), bit for bit:
/// the shard's per-channel (mean, M2) a GPU replica hands the exchange is the CPU layer's
/// very payload; merged by the same function (`Synchronized::moments`, tests/common's
/// `sync_bn_merge`), the statistics normalise into the CPU layer's y and move the running
/// statistics to its values; the backward's (Σ dy, Σ dy·x̂) is its payload again, and dx,
/// dγ, dβ (accumulated onto earlier values) are its own. Bitwise because every kernel
/// makes the layer's f32 and f64 operations in its order, and the host does not contract
/// them (the GPU, with the _rn intrinsics, neither: tests/cuda_ops.rs holds it to the
/// same). Cases: planes whose length is and is not a multiple of the eight accumulators
/// (a tail, or only a tail), more samples than a block has threads (two rounds of planes
/// merged in order), every combination of γ and β.
#[test]
fn synchronized_batchnorm_kernels_equal_the_cpu_layer_bit_for_bit() {
    let Some(k) = kernels_or_skip("synchronized_batchnorm_kernels_equal_the_cpu_layer_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(12);
    let (momentum, eps) = (0.9f32, 1e-3f32);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (n, c, hw, with_gamma, with_beta) in SYNC_BN_CASES {
        let case = format!("N={n} C={c} HW={hw}, gamma {with_gamma}, beta {with_beta}");
        let total = n * c * hw;
        let inputs = BnInputs::random(&mut rng, (n, c, hw));
        let BnInputs {
            x, dy, gamma, beta, running_mean: rm0, running_var: rv0, dgamma: dgamma0, dbeta: dbeta0, ..
        } = &inputs;
        let cpu = sync_bn_cpu(&inputs, with_gamma, with_beta, momentum, eps);

        // As Gpu::batchnorm_moments_fwd: x, moments, N (int), C (int), hw.
        let mut moments = vec![f64::NAN; 2 * c];
        k.launch(
            "batchnorm_moments_fwd_f32",
            channel_cfg(c as i32),
            &mut [In(x), OutF64(&mut moments), I32(n as i32), I32(c as i32), U64(hw as u64)],
        );
        assert_eq!(cpu.sent_fwd[0], (n * hw) as f64, "{case}: the payload's count");
        assert_eq!(bits(&moments), bits(&cpu.sent_fwd[1..]), "{case}: the shard's moments vs the CPU layer's payload");
        let (count, stats, u) = sync_bn_merge(&moments, n * hw, momentum, eps);
        // Recorder's replica 0 has 37 values per channel.
        assert_eq!(count, (37 + n * hw) as f64, "{case}");
        let (want_sm, want_si): (Vec<f32>, Vec<f32>) =
            stats.chunks_exact(4).map(|s| (s[2] as f32, s[3] as f32)).unzip();
        for cfg in elem_cfgs(total) {
            let (mut y, mut rm, mut rv) = (vec![f32::NAN; total], rm0.clone(), rv0.clone());
            let (mut sm, mut si) = (vec![f32::NAN; c], vec![f32::NAN; c]);
            // As Gpu::batchnorm_sync_fwd: x, y, gamma or 0, beta or 0, stats, running_mean,
            // running_var, save_mean, save_invstd, C (int), hw, total, keep, take, unbias.
            k.launch(
                "batchnorm_sync_fwd_f32",
                cfg,
                &mut [
                    In(x),
                    Out(&mut y),
                    opt(with_gamma, gamma),
                    opt(with_beta, beta),
                    InF64(&stats),
                    Out(&mut rm),
                    Out(&mut rv),
                    Out(&mut sm),
                    Out(&mut si),
                    I32(c as i32),
                    U64(hw as u64),
                    U64(total as u64),
                    F64(u.keep),
                    F64(u.take),
                    F64(u.unbias),
                ],
            );
            assert_bits(&format!("sync bn y ({case}) {cfg:?}"), &y, &cpu.y);
            assert_bits(&format!("sync bn running_mean ({case})"), &rm, &cpu.running_mean);
            assert_bits(&format!("sync bn running_var ({case})"), &rv, &cpu.running_var);
            assert_bits(&format!("sync bn save_mean ({case})"), &sm, &want_sm);
            assert_bits(&format!("sync bn save_invstd ({case})"), &si, &want_si);

            // As Gpu::batchnorm_sums_bwd: x, dy, save_mean, save_invstd, sums, N (int),
            // C (int), hw.
            let mut sums = vec![f64::NAN; 2 * c];
            k.launch(
                "batchnorm_sums_bwd_f32",
                channel_cfg(c as i32),
                &mut [In(x), In(dy), In(&sm), In(&si), OutF64(&mut sums), I32(n as i32), I32(c as i32), U64(hw as u64)],
            );
            assert_eq!(bits(&sums), bits(&cpu.sent_bwd), "{case}: the shard's sums vs the CPU layer's payload");
            let global = sync_bn_global_sums(&sums);
            let (mut dx, mut dgamma, mut dbeta) = (vec![f32::NAN; total], dgamma0.clone(), dbeta0.clone());
            // As Gpu::batchnorm_sync_bwd: x, dy, dx, gamma or 0, save_mean, save_invstd,
            // local, global, dgamma or 0, dbeta or 0, C (int), hw, total, count.
            k.launch(
                "batchnorm_sync_bwd_f32",
                cfg,
                &mut [
                    In(x),
                    In(dy),
                    Out(&mut dx),
                    opt(with_gamma, gamma),
                    In(&sm),
                    In(&si),
                    InF64(&sums),
                    InF64(&global),
                    opt_mut(with_gamma, &mut dgamma),
                    opt_mut(with_beta, &mut dbeta),
                    I32(c as i32),
                    U64(hw as u64),
                    U64(total as u64),
                    F64(count),
                ],
            );
            assert_bits(&format!("sync bn dx ({case}) {cfg:?}"), &dx, &cpu.dx);
            assert_bits(&format!("sync bn dgamma ({case})"), &dgamma, &cpu.dgamma);
            assert_bits(&format!("sync bn dbeta ({case})"), &dbeta, &cpu.dbeta);
        }
    }
}

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

#[test]
fn batchnorm_count_equals_the_cpu_count_bit_for_bit() {
    let Some(k) = kernels_or_skip("batchnorm_count_equals_the_cpu_count_bit_for_bit") else {
        return;
    };
    // Counts as the average over R logical replicas leaves them: whole, an ulp off either
    // side (5 · 7 · (1/7) in f32), and large.
    for v in [0.0f32, 1.0, 4.999_999_5, 5.000_000_5, 123_456.0, 16_777_215.0] {
        let mut count = vec![v];
        // As Gpu::batchnorm_count pushes them: count, n = 1.
        k.launch("batchnorm_count_fwd_f32", elem_cfg(1), &mut [Out(&mut count), U64(1)]);
        assert_bits(&format!("count of {v}"), &count, &[lockstep::ops::batchnorm::count_up(v)]);
    }
}

/// launch.rs's `rows_cfg` of the LayerNorm row kernels: one warp of LN_LANES threads a
/// row, LN_BLOCK threads a block.
fn ln_rows_cfg(rows: usize) -> Cfg {
    let blocks = rows.div_ceil((LN_BLOCK / LN_LANES) as usize) as u32;
    Cfg { grid: (blocks, 1, 1), block: (LN_BLOCK, 1, 1) }
}

#[test]
fn layernorm_kernels_equal_the_cpu_layer_bit_for_bit() {
    let Some(k) = kernels_or_skip("layernorm_kernels_equal_the_cpu_layer_bit_for_bit") else {
        return;
    };
    // (N, T, C, bias): 150 rows of 40 (three chunks of rows, 64, 64 and 22, and a lane
    // tail of 8); 6 rows of 5 without a bias (rows shorter than the 32 lanes, one short
    // chunk); 70 rows of the GPT's 128 (four whole lane rounds, two chunks).
    for (n, t, c, use_bias) in [(3usize, 50usize, 40usize, true), (2, 3, 5, false), (1, 70, 128, true)] {
        let rows = n * t;
        let eps = 1e-5f32;
        let mut rng = Rng(0x1a7e + c as u64);
        // Rows off centre (mean 3, spread 2), so that the mean and the deviations matter.
        let x: Vec<f32> = rng.vec(rows * c).iter().map(|v| 3.0 + 2.0 * v).collect();
        let dy = rng.vec(rows * c);
        let w: Vec<f32> = rng.vec(c).iter().map(|v| 1.0 + 0.5 * v).collect();
        let b = rng.vec(c);
        // The gradients start non-zero: the kernels, as the layer, accumulate into them.
        let (dw0, db0) = (rng.vec(c), rng.vec(c));

        // The CPU layer (the oracle), through a Sequential: its output, its input's
        // gradient and its parameters' gradients accumulated onto dw0, db0.
        let ln = if use_bias { LayerNorm::new(c) } else { LayerNorm::new(c).without_bias() };
        let mut model = Sequential::new([t, c], vec![Box::new(ln) as Box<dyn Layer>]).unwrap();
        let infos = model.param_infos().to_vec();
        let (mut params, mut grads) = (vec![0.0f32; model.params_len()], vec![0.0f32; model.params_len()]);
        params[infos[0].range.clone()].copy_from_slice(&w);
        grads[infos[0].range.clone()].copy_from_slice(&dw0);
        if use_bias {
            params[infos[1].range.clone()].copy_from_slice(&b);
            grads[infos[1].range.clone()].copy_from_slice(&db0);
        }
        let ctx = Ctx::train(0, 0, 0, Device::Cpu(0));
        let want_y = model.forward(Tensor::from_vec(x.clone(), [n, t, c]).unwrap(), &params, &mut [], &ctx).unwrap();
        let d = Tensor::from_vec(dy.clone(), [n, t, c]).unwrap();
        let want_dx = model.backward_input(d, &params, &mut grads, &ctx).unwrap();
        let want_dw = grads[infos[0].range.clone()].to_vec();
        let want_db = if use_bias { grads[infos[1].range.clone()].to_vec() } else { db0.clone() };
        let (want_mean, want_rstd): (Vec<f64>, Vec<f64>) = x.chunks_exact(c).map(|r| row_stats(r, eps)).unzip();

        let what = |part: &str| format!("layernorm ({n}, {t}, {c}), bias {use_bias}: {part}");
        let (mut y, mut mean, mut rstd) = (vec![f32::NAN; rows * c], vec![f64::NAN; rows], vec![f64::NAN; rows]);
        let bias = if use_bias { In(&b) } else { Null };
        // As Gpu::layernorm_fwd pushes them: x, y, weight, bias, mean, rstd, rows, c, eps.
        k.launch(
            "layernorm_fwd_f32",
            ln_rows_cfg(rows),
            &mut [
                In(&x),
                Out(&mut y),
                In(&w),
                bias,
                OutF64(&mut mean),
                OutF64(&mut rstd),
                U64(rows as u64),
                I32(c as i32),
                F32(eps),
            ],
        );
        // Every operation is the layer's, in its order, uncontracted, with IEEE division
        // and square root: equal bit for bit.
        assert_bits(&what("y"), &y, want_y.host());
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&mean), bits(&want_mean), "{}", what("saved mean"));
        assert_eq!(bits(&rstd), bits(&want_rstd), "{}", what("saved rstd"));

        let mut dx = vec![f32::NAN; rows * c];
        // As Gpu::layernorm_bwd: x, dy, dx, weight, mean, rstd, rows, c.
        k.launch(
            "layernorm_bwd_f32",
            ln_rows_cfg(rows),
            &mut [In(&x), In(&dy), Out(&mut dx), In(&w), InF64(&mean), InF64(&rstd), U64(rows as u64), I32(c as i32)],
        );
        assert_bits(&what("dx"), &dx, want_dx.host());

        let chunks = rows.div_ceil(ROW_CHUNK);
        for (cfg_partial, cfg_params) in elem_cfgs(chunks * c).into_iter().zip(elem_cfgs(c)) {
            let mut partials = vec![f64::NAN; chunks * 2 * c];
            let (mut dw, mut db) = (dw0.clone(), db0.clone());
            // As Gpu::layernorm_params_bwd: first x, dy, mean, rstd, partials, rows, c,
            // chunk; then partials, dweight, dbias, chunks, c.
            k.launch(
                "layernorm_partial_bwd_f32",
                cfg_partial,
                &mut [
                    In(&x),
                    In(&dy),
                    InF64(&mean),
                    InF64(&rstd),
                    OutF64(&mut partials),
                    U64(rows as u64),
                    I32(c as i32),
                    I32(ROW_CHUNK as i32),
                ],
            );
            let dbias = if use_bias { Out(&mut db) } else { Null };
            k.launch(
                "layernorm_params_bwd_f32",
                cfg_params,
                &mut [InF64(&partials), Out(&mut dw), dbias, U64(chunks as u64), I32(c as i32)],
            );
            assert_bits(&what(&format!("dweight {cfg_partial:?}")), &dw, &want_dw);
            assert_bits(&what(&format!("dbias {cfg_partial:?}")), &db, &want_db);
        }
    }
}
