//! Finding the CUDA libraries at run time, before anything can panic.
//!
//! lockstep loads the CUDA driver, NVRTC and NCCL with cudarc's dynamic loading, so one
//! binary builds and runs everywhere. The catch: cudarc's loader (`sys::culib()`)
//! *panics* when a library is missing. Every entry point of [`crate::cuda`] therefore
//! goes through a probe here first, which asks cudarc's own non-panicking
//! `is_culib_present()` (the very same list of names its loader will try), and turns a
//! missing library into [`Error::CudaUnavailable`] with the fix spelled out.
//!
//! # NCCL's library name
//!
//! cudarc looks for NCCL under the names of `cudarc::get_lib_name_candidates("nccl")`:
//! `libnccl.so`, `libnccl64*.so`, `libnccl.so.13` (the CUDA major version), `.12`, `.11`,
//! `.10`, `.9`, `.1` — never `libnccl.so.2`, the SONAME of NCCL 2 and the only name the
//! `nvidia-nccl-cu12/cu13` wheels ship. Preloading `libnccl.so.2` does not help (glibc's
//! `dlopen("libnccl.so")` matches loaded objects by file name or SONAME, and the SONAME is
//! `libnccl.so.2`), and glibc reads `LD_LIBRARY_PATH` once at process start, so the
//! process cannot fix its own search path either. The one clean fix is a `libnccl.so`
//! symlink in a directory on the loader path. [`nccl_status`] finds `libnccl.so.2` when
//! cudarc cannot, reports [`NcclStatus::NeedsLink`] with the exact commands, and
//! [`make_nccl_link`] creates the link. Until then the trainer uses the fallback
//! all-reduce (device-to-device copies), which is correct, only slower.
//!
//! # Which file was loaded
//!
//! cudarc tries the unversioned name first (`libnvrtc.so`, then `libnvrtc.so.13`, ...).
//! The CUDA 13 wheels ship only versioned names, while a system CUDA toolkit (of another
//! major version, say) installs `libnvrtc.so` in a system directory: that one wins, and
//! the bindings of CUDA 13 then call a library of another version. [`loaded_from`] names
//! the file each library was really loaded from, which `lockstep devices` prints: the
//! address of one of the library's functions, looked up in `/proc/self/maps`, where the
//! kernel lists the file behind every mapping (symlinks resolved). That needs no
//! dynamic-loader internals (`dladdr` reports the name the loader was given, which for
//! a library found through `LD_LIBRARY_PATH` may be a relative or symlinked one).

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The message when the CUDA driver library is not on this machine.
pub const NO_DRIVER: &str = "no CUDA driver found (libcuda.so.1); use --devices cpu:N";

/// The message when NVRTC (the runtime compiler for kernels/) is not found. Any CUDA 13.x
/// NVRTC serves any CUDA 13 driver: kernels are compiled to cubins for the GPU's own
/// architecture, which need no pin to the driver's version (PTX would).
pub const NO_NVRTC: &str = "NVRTC not found (libnvrtc.so.13), needed to compile lockstep's CUDA kernels: \
run `pip install 'nvidia-cuda-nvrtc>=13,<14'` (or scripts/install-nvrtc.sh) and add \
.../site-packages/nvidia/cu13/lib to LD_LIBRARY_PATH (any 13.x works with any CUDA 13 driver)";

/// Ok when the CUDA driver library (libcuda) can be loaded; no driver call is made.
pub fn driver_available() -> Result<()> {
    // SAFETY: is_culib_present only dlopens candidate names and drops the handles; it
    // calls no CUDA function and does not touch cudarc's loader state.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::CudaUnavailable(NO_DRIVER.to_string()))
    }
}

/// Ok when NVRTC can be loaded (cudarc tries `libnvrtc.so`, `libnvrtc.so.13`, ...).
pub fn nvrtc_available() -> Result<()> {
    // SAFETY: as in driver_available: a dlopen probe of candidate names, nothing more.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::CudaUnavailable(NO_NVRTC.to_string()))
    }
}

/// The message when cuBLAS (the GPU replicas' GEMMs) is not found.
pub const NO_CUBLAS: &str = "cuBLAS not found (libcublas.so.13), needed to train on GPUs: \
run `pip install nvidia-cublas` and add .../site-packages/nvidia/cu13/lib to LD_LIBRARY_PATH";

/// Ok when cuBLAS can be loaded.
pub fn cublas_available() -> Result<()> {
    // SAFETY: as in driver_available: a dlopen probe of candidate names, nothing more.
    if unsafe { cudarc::cublas::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::CudaUnavailable(NO_CUBLAS.to_string()))
    }
}

/// The CUDA version the driver supports (`cuDriverGetVersion`), e.g. (13, 0); it does not
/// initialise the driver.
pub fn driver_cuda_version() -> Result<(i32, i32)> {
    driver_available()?;
    let mut v = 0;
    // SAFETY: CUresult cuDriverGetVersion(int* driverVersion); `v` is a valid out-pointer,
    // and the call is allowed before cuInit.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }.result()?;
    Ok((v / 1000, (v % 1000) / 10))
}

/// A CUDA library lockstep loads at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLib {
    Driver,
    Nvrtc,
    Cublas,
    Nccl,
}

impl CudaLib {
    /// All of them, in the order `lockstep devices` lists them.
    pub const ALL: [CudaLib; 4] = [CudaLib::Driver, CudaLib::Nvrtc, CudaLib::Cublas, CudaLib::Nccl];

    /// `driver`, `nvrtc`, `cublas`, `nccl`.
    pub fn name(self) -> &'static str {
        match self {
            CudaLib::Driver => "driver",
            CudaLib::Nvrtc => "nvrtc",
            CudaLib::Cublas => "cublas",
            CudaLib::Nccl => "nccl",
        }
    }

    /// Whether cudarc's loader finds it (a dlopen probe of its candidate names).
    fn present(self) -> bool {
        // SAFETY: each is_culib_present only dlopens candidate names and drops the handles.
        unsafe {
            match self {
                CudaLib::Driver => cudarc::driver::sys::is_culib_present(),
                CudaLib::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
                CudaLib::Cublas => cudarc::cublas::sys::is_culib_present(),
                CudaLib::Nccl => cudarc::nccl::sys::is_culib_present(),
            }
        }
    }
}

/// The file library `lib` is loaded from, as cudarc's loader opened it (loading it if it
/// was not yet): the `/proc/self/maps` entry holding one of its functions. A library
/// cudarc cannot find is [`Error::CudaUnavailable`]; so is a system without
/// `/proc/self/maps` (not Linux).
pub fn loaded_from(lib: CudaLib) -> Result<PathBuf> {
    if !lib.present() {
        return Err(Error::CudaUnavailable(format!("{}: not found by cudarc's loader", lib.name())));
    }
    // SAFETY: the library is present (checked above), so each culib() opens it instead of
    // panicking; the handles live for the process. A symbol is only looked up, never
    // called, so its type does not matter.
    let (library, symbol): (&'static libloading::Library, &str) = unsafe {
        match lib {
            CudaLib::Driver => (cudarc::driver::sys::culib(), "cuDriverGetVersion"),
            CudaLib::Nvrtc => (cudarc::nvrtc::sys::culib(), "nvrtcVersion"),
            CudaLib::Cublas => (cudarc::cublas::sys::culib(), "cublasCreate_v2"),
            CudaLib::Nccl => (cudarc::nccl::sys::culib(), "ncclGetVersion"),
        }
    };
    // SAFETY: as above: the address is read, nothing is called.
    let addr = unsafe { library.get::<*const std::ffi::c_void>(symbol.as_bytes()) }
        .map(|s| *s as usize)
        .map_err(|e| Error::CudaUnavailable(format!("{}: no {symbol} in the loaded library: {e}", lib.name())))?;
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(|e| Error::io("/proc/self/maps", e))?;
    mapping_path(&maps, addr).ok_or_else(|| {
        Error::CudaUnavailable(format!(
            "{}: {symbol} at {addr:#x} is in no file mapping of /proc/self/maps",
            lib.name()
        ))
    })
}

/// The file behind the mapping of `maps` (the text of `/proc/<pid>/maps`) that contains
/// `addr`. Each line is `start-end perms offset dev inode [path]`; the path is the rest
/// of the line and may hold spaces.
fn mapping_path(maps: &str, addr: usize) -> Option<PathBuf> {
    maps.lines().find_map(|line| {
        let (range, rest) = line.split_once(' ')?;
        let (start, end) = range.split_once('-')?;
        let (start, end) = (usize::from_str_radix(start, 16).ok()?, usize::from_str_radix(end, 16).ok()?);
        if !(start..end).contains(&addr) {
            return None;
        }
        // perms, offset, dev, inode, then the path.
        let mut rest = rest.trim_start();
        for _ in 0..4 {
            rest = rest.split_once(char::is_whitespace).map_or("", |(_, r)| r).trim_start();
        }
        rest.starts_with('/').then(|| PathBuf::from(rest))
    })
}

/// Number of CUDA GPUs visible to this process (honours `CUDA_VISIBLE_DEVICES`).
/// A driver that reports no device gives `Ok(0)`; no driver at all is an error.
pub fn gpu_count() -> Result<usize> {
    driver_available()?;
    use cudarc::driver::{result, sys::CUresult};
    match result::init().and_then(|()| result::device::get_count()) {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        Err(e) if e.0 == CUresult::CUDA_ERROR_NO_DEVICE => Ok(0),
        Err(e) => Err(e.into()),
    }
}

/// What the driver says about one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Index in the driver's numbering (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    pub name: String,
    pub total_memory_bytes: usize,
    /// (major, minor), e.g. (9, 0) for an H100/H200.
    pub compute_capability: (u32, u32),
}

impl GpuInfo {
    /// NVRTC target for this GPU, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

/// Every visible GPU, without creating a context on any of them (a context costs memory
/// on the device and would be made by the worker thread anyway).
pub fn gpus() -> Result<Vec<GpuInfo>> {
    use cudarc::driver::{result::device, sys::CUdevice_attribute as A};
    let count = gpu_count()?;
    let mut out = Vec::with_capacity(count);
    for ordinal in 0..count {
        let dev = device::get(ordinal as i32)?;
        let name = device::get_name(dev)?;
        // SAFETY: `dev` was just returned by cuDeviceGet for an ordinal below the count.
        let (total, major, minor) = unsafe {
            (
                device::total_mem(dev)?,
                device::get_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                device::get_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            )
        };
        out.push(GpuInfo {
            ordinal,
            name,
            total_memory_bytes: total,
            compute_capability: (major as u32, minor as u32),
        });
    }
    Ok(out)
}

/// Whether GPU `a` can read and write GPU `b`'s memory directly (peer access), as the
/// driver reports it; without it, copies between them go through the host.
pub fn peer_access(a: usize, b: usize) -> Result<bool> {
    use cudarc::driver::{result::device, sys};
    let (da, db) = (device::get(a as i32)?, device::get(b as i32)?);
    let mut can = 0i32;
    // SAFETY: both handles come from cuDeviceGet; `can` is a valid out-pointer.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, da, db) }.result()?;
    Ok(can != 0)
}

/// Whether NCCL can be used, and if not, what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NcclStatus {
    /// cudarc's loader finds NCCL: the NCCL all-reduce is used.
    Available,
    /// Only `libnccl.so.2` exists (the name pip's NCCL wheels ship), which cudarc never
    /// tries. `found` is its real path; [`NcclStatus::fix`] says how to link it.
    NeedsLink { found: PathBuf },
    /// No NCCL anywhere the loader looks; `tried` lists the names.
    Missing { tried: Vec<String> },
}

impl NcclStatus {
    /// One paragraph for logs and `lockstep` diagnostics: what was found and what to do.
    pub fn fix(&self) -> String {
        match self {
            NcclStatus::Available => "NCCL found".to_string(),
            NcclStatus::NeedsLink { found } => {
                let dir = default_link_dir();
                format!(
                    "found {} but cudarc only loads it as libnccl.so; using the fallback all-reduce. \
                     To use NCCL: mkdir -p {d} && ln -sf {f} {d}/libnccl.so && export LD_LIBRARY_PATH={d}:$LD_LIBRARY_PATH",
                    found.display(),
                    f = found.display(),
                    d = dir.display()
                )
            }
            NcclStatus::Missing { tried } => format!(
                "NCCL not found (tried {}); using the fallback all-reduce. \
                 To use NCCL: pip install nvidia-nccl-cu13, then link its libnccl.so.2 as libnccl.so \
                 in a directory on LD_LIBRARY_PATH",
                tried.join(", ")
            ),
        }
    }
}

/// Where [`NcclStatus::fix`] suggests putting the `libnccl.so` link:
/// `$LOCKSTEP_NCCL_LINK_DIR`, else `$HOME/.cache/lockstep/nccl`.
pub fn default_link_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("LOCKSTEP_NCCL_LINK_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache/lockstep/nccl")
}

/// Probes NCCL the way cudarc will load it, then looks for `libnccl.so.2`.
pub fn nccl_status() -> NcclStatus {
    // SAFETY: a dlopen probe of cudarc's candidate names; no NCCL function is called.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return NcclStatus::Available;
    }
    let mut tried = cudarc::get_lib_name_candidates("nccl");
    tried.push("libnccl.so.2".to_string());
    match find_nccl_so2() {
        Some(found) => NcclStatus::NeedsLink { found },
        None => NcclStatus::Missing { tried },
    }
}

/// The real path of a loadable `libnccl.so.2`: first the directories of
/// `LD_LIBRARY_PATH`, then whatever `dlopen("libnccl.so.2")` resolves to (ld.so.cache,
/// system directories), read back from `/proc/self/maps`.
fn find_nccl_so2() -> Option<PathBuf> {
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("libnccl.so.2");
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    // SAFETY: loading NCCL runs its ELF initialisers, which only set up internal state
    // (NCCL does no work until a communicator is created); the handle is dropped below.
    let lib = unsafe { libloading::Library::new("libnccl.so.2") }.ok()?;
    let maps = std::fs::read_to_string("/proc/self/maps").ok();
    drop(lib);
    let maps = maps?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.contains("/libnccl.so"))
        .map(PathBuf::from)
}

/// Creates `dir/libnccl.so` pointing at `found` (the fix for [`NcclStatus::NeedsLink`]),
/// replacing an older link. Takes effect for processes started with `dir` on
/// `LD_LIBRARY_PATH`; returns the link's path.
pub fn make_nccl_link(found: &Path, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let link = dir.join("libnccl.so");
    match std::fs::remove_file(&link) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(&link, e)),
    }
    #[cfg(unix)]
    std::os::unix::fs::symlink(found, &link).map_err(|e| Error::io(&link, e))?;
    #[cfg(not(unix))]
    std::fs::copy(found, &link).map_err(|e| Error::io(&link, e))?;
    Ok(link)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn the_mapping_that_holds_an_address_names_its_file() {
        // Three lines as Linux writes them: a library's text segment, an anonymous
        // mapping, and a path with a space in it.
        let maps = "\
7f0000000000-7f0000200000 r-xp 00001000 08:01 1234                       /opt/cu13/lib/libnvrtc.so.13
7f0000200000-7f0000300000 rw-p 00000000 00:00 0 
7f0000300000-7f0000400000 r-xp 00000000 08:01 99   /home/a b/libcublas.so.13
";
        assert_eq!(mapping_path(maps, 0x7f00_0000_0000), Some(PathBuf::from("/opt/cu13/lib/libnvrtc.so.13")));
        assert_eq!(mapping_path(maps, 0x7f00_001f_ffff), Some(PathBuf::from("/opt/cu13/lib/libnvrtc.so.13")));
        assert_eq!(mapping_path(maps, 0x7f00_0020_0000), None, "anonymous: no file");
        assert_eq!(mapping_path(maps, 0x7f00_0030_0010), Some(PathBuf::from("/home/a b/libcublas.so.13")));
        assert_eq!(mapping_path(maps, 0x7f00_0040_0000), None, "end is exclusive");
    }

    #[test]
    fn this_processs_own_code_is_found_in_its_maps() {
        // The address of a function of this test binary lies in the binary's own file.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let addr = the_mapping_that_holds_an_address_names_its_file as fn() as usize;
        let path = mapping_path(&maps, addr).expect("the test's code is file-backed");
        assert_eq!(path, std::env::current_exe().unwrap().canonicalize().unwrap());
    }

    #[test]
    fn without_a_driver_probes_give_one_clear_error_and_no_panic() {
        if driver_available().is_ok() {
            // A driver here: the probes must agree with each other instead.
            let count = gpu_count().expect("gpu_count with a driver");
            let gpus = gpus().expect("gpus with a driver");
            assert_eq!(gpus.len(), count);
            for (i, g) in gpus.iter().enumerate() {
                assert_eq!(g.ordinal, i);
                assert!(g.total_memory_bytes > 0 && g.compute_capability.0 >= 5, "{g:?}");
            }
            return;
        }
        let msg = "no CUDA driver found (libcuda.so.1); use --devices cpu:N";
        assert_eq!(NO_DRIVER, msg);
        match driver_available() {
            Err(Error::CudaUnavailable(m)) => assert_eq!(m, msg),
            other => panic!("expected CudaUnavailable, got {other:?}"),
        }
        assert_eq!(driver_available().unwrap_err().to_string(), msg, "Display is the one line");
        assert!(matches!(gpu_count(), Err(Error::CudaUnavailable(m)) if m == msg));
        assert!(matches!(gpus(), Err(Error::CudaUnavailable(m)) if m == msg));
        assert!(matches!(crate::cuda::Gpu::new(0), Err(Error::CudaUnavailable(m)) if m == msg));
    }

    #[test]
    fn nccl_status_never_panics_and_names_what_it_tried() {
        match nccl_status() {
            NcclStatus::Available => {}
            NcclStatus::NeedsLink { found } => {
                assert!(found.exists(), "{found:?}");
                assert!(nccl_status().fix().contains("ln -sf"));
            }
            NcclStatus::Missing { tried } => {
                // cudarc's own names, then the SONAME pip's wheels ship, which cudarc never tries.
                assert!(tried.iter().any(|t| t == "libnccl.so"), "{tried:?}");
                assert_eq!(tried.last().map(String::as_str), Some("libnccl.so.2"), "{tried:?}");
            }
        }
    }

    #[test]
    fn needs_link_says_exactly_what_to_run_and_make_nccl_link_does_it() {
        let dir = std::env::temp_dir().join(format!("lockstep-nccl-link-{}", std::process::id()));
        let fake = dir.join("wheel/libnccl.so.2");
        std::fs::create_dir_all(fake.parent().unwrap()).unwrap();
        std::fs::write(&fake, b"not really a library").unwrap();
        let status = NcclStatus::NeedsLink { found: fake.clone() };
        let fix = status.fix();
        assert!(fix.contains(&format!("ln -sf {} ", fake.display())), "{fix}");
        assert!(fix.contains("/libnccl.so && export LD_LIBRARY_PATH="), "{fix}");
        let link_dir = dir.join("links");
        let link = make_nccl_link(&fake, &link_dir).unwrap();
        assert_eq!(link, link_dir.join("libnccl.so"));
        assert_eq!(std::fs::read(&link).unwrap(), b"not really a library");
        // Idempotent: a second call replaces the link.
        make_nccl_link(&fake, &link_dir).unwrap();
        assert_eq!(std::fs::read_link(&link).unwrap(), fake);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
