//! Launching kernels on one GPU: the mechanics every checked launch shares, knowing no op.
//!
//! Owns: [`Gpu`], one device's context, compute stream and loaded functions (looked up
//! once per declaration, [`Launcher`]), and what every owner's launches share: the
//! buffer traits [`DevIn`] / [`DevOut`], the length and dimension checks ([`check_len`],
//! [`dim`]) and the launch shapes (`elem_cfg`, `channel_cfg`). The launches themselves
//! live with their kernels' owners: each op's `gpu.rs` (`ops::relu::gpu`, ...), the
//! optimiser's (`optim::gpu`), the codec's (`exchange::gpu::codec`) and the runtime's own
//! buffer kernels (`cuda::buffers`): one safe method of `Gpu` per kernel, which checks the
//! lengths of its buffers against the shapes it is given (a wrong length is
//! [`Error::Shape`], never an out-of-bounds write on the device), then queues the
//! kernel's typed launch on the compute stream, asynchronously.
//! A `Gpu` belongs to the worker thread that created it (DESIGN.md: one thread per device).
//!
//! (Not to be confused with `world::launch`, which detects how the *process* was launched:
//! mpirun, srun or by hand.)

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceSlice, LaunchConfig,
};
use parking_lot::Mutex;

use super::declare::{Dir, Kernel, Launcher};
use super::probe::driver_available;
use crate::{Error, Result};

/// Threads per block of the block-per-channel reductions; must equal `REDUCE_BLOCK` in
/// kernels/relu.cu and kernels/batchnorm.cu.
pub const REDUCE_BLOCK: u32 = 256;
/// Threads per block of the grid-stride element loops.
const ELEM_BLOCK: u32 = 256;
/// Cap on blocks of an element loop; the grid-stride loop covers the rest.
pub(crate) const MAX_BLOCKS: usize = 65_535;

/// Launch shape for a grid-stride loop over `n` elements (`n > 0`).
pub(crate) fn elem_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(ELEM_BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (ELEM_BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// Launch shape for the block-per-channel reductions: grid = (C), REDUCE_BLOCK threads.
pub(crate) fn channel_cfg(c: i32) -> LaunchConfig {
    LaunchConfig { grid_dim: (c as u32, 1, 1), block_dim: (REDUCE_BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// A device buffer of f32 that a kernel reads: a whole allocation or a view into one
/// (a tensor inside a replica's flat parameter buffer).
pub trait DevIn: DeviceSlice<f32> {
    fn view(&self) -> CudaView<'_, f32>;
}

/// A device buffer of f32 that a kernel writes: a whole allocation or a mutable view.
pub trait DevOut: DeviceSlice<f32> {
    fn view_mut(&mut self) -> CudaViewMut<'_, f32>;
}

impl DevIn for CudaSlice<f32> {
    fn view(&self) -> CudaView<'_, f32> {
        self.as_view()
    }
}

impl DevIn for CudaView<'_, f32> {
    fn view(&self) -> CudaView<'_, f32> {
        self.slice(..)
    }
}

impl DevIn for CudaViewMut<'_, f32> {
    fn view(&self) -> CudaView<'_, f32> {
        self.as_view()
    }
}

impl DevOut for CudaSlice<f32> {
    fn view_mut(&mut self) -> CudaViewMut<'_, f32> {
        self.as_view_mut()
    }
}

impl DevOut for CudaViewMut<'_, f32> {
    fn view_mut(&mut self) -> CudaViewMut<'_, f32> {
        self.slice_mut(..)
    }
}

/// Errors unless buffer `what` of `op` holds exactly `want` elements.
pub(crate) fn check_len<T>(op: &'static str, what: &str, buf: &impl DeviceSlice<T>, want: usize) -> Result<()> {
    if buf.len() == want {
        Ok(())
    } else {
        Err(Error::shape(op, format!("{what} has {} elements, expected {want}", buf.len())))
    }
}

/// A dimension as the `int` the kernels take.
pub(crate) fn dim(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::shape(op, format!("{what} = {v} does not fit in i32")))
}

/// One GPU as one worker thread sees it: context, compute stream, loaded kernel modules.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// Functions looked up once, by their declaration's (file, op, dir): a step launches
    /// dozens of kernels, and a lookup by name in the driver on each launch would cost
    /// more than some of the kernels.
    functions: Mutex<HashMap<(&'static str, &'static str, Dir), CudaFunction>>,
}

impl Gpu {
    /// Opens GPU `ordinal` (its primary context) with a fresh, non-default compute stream.
    /// No driver is a [`Error::CudaUnavailable`], never a panic.
    pub fn new(ordinal: usize) -> Result<Self> {
        driver_available()?;
        let count = super::probe::gpu_count()?;
        if ordinal >= count {
            return Err(Error::CudaUnavailable(format!("cuda:{ordinal} asked for, but {count} GPU(s) are visible")));
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let stream = ctx.new_stream()?;
        Ok(Gpu {
            ctx,
            stream,
            arch: format!("sm_{major}{minor}"),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// Launches on `stream` (of an open context), e.g. another component's stream on the
    /// same GPU.
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context().clone();
        let (major, minor) = ctx.compute_capability()?;
        Ok(Gpu {
            ctx,
            stream,
            arch: format!("sm_{major}{minor}"),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launch of this `Gpu` goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// NVRTC target of this GPU, e.g. `sm_90`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Blocks until all work queued on the compute stream is done.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
}

impl Launcher for Gpu {
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Kernel `kernel` (`<op>_<dir>_f32` of its file), compiling and loading the file on
    /// first use; each function is looked up in the driver once per `Gpu`.
    fn function(&self, kernel: &'static Kernel) -> Result<CudaFunction> {
        let key = (kernel.file, kernel.op, kernel.dir);
        if let Some(f) = self.functions.lock().get(&key) {
            return Ok(f.clone());
        }
        let module = {
            let mut modules = self.modules.lock();
            match modules.get(kernel.file) {
                Some(m) => m.clone(),
                None => {
                    let m = super::kernels::load_module(&self.ctx, kernel.file, kernel.source)?;
                    modules.insert(kernel.file, m.clone());
                    m
                }
            }
        };
        let f = module.load_function(&kernel.name())?;
        self.functions.lock().insert(key, f.clone());
        Ok(f)
    }
}
