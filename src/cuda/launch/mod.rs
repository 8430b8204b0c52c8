//! Launching the kernels of `kernels/` on one GPU, with every argument checked first.
//!
//! Owns: [`Gpu`], one device's context, compute stream and loaded functions (looked up
//! once per declaration, [`Launcher`]), and what every family's launches share: the
//! buffer traits [`DevIn`] / [`DevOut`], the length and dimension checks, the launch
//! shapes (`elem_cfg`, `channel_cfg`) and the window geometry [`WindowGeom`] (a
//! convolution's and a pooling's). Each family of kernels has its own file, one `impl Gpu`
//! of one safe method per kernel: `elementwise`, `conv`, `batchnorm`, `layernorm` (whose
//! parameter gradients, two kernels in a fixed order, are one method), `pooling`, `loss`
//! (softmax_xent), `reduce`, `dropout`, `codec`, `embedding` (whose backward is one method
//! over the four kernels of its sort and sums), `attention`. A method checks the lengths of its
//! buffers against the shapes it is given (a wrong length is [`Error::Shape`], never an
//! out-of-bounds write on the device), then queues the kernel's typed launch
//! (`cuda::kernels`, declared once) on the compute stream, asynchronously. The optimiser's
//! launch is `optim::gpu`'s, so that nothing in `cuda` imports the optimiser; the layers
//! and the backend decide *what* to launch; these files only make each launch sound.
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

mod attention;
mod batchnorm;
mod codec;
mod conv;
mod dropout;
mod elementwise;
mod embedding;
mod layernorm;
mod loss;
mod pooling;
mod reduce;

pub use attention::{HeadsGeom, ATTENTION_BLOCK};
pub use batchnorm::{BnGeom, BnGrads, BnMerged, BnParams, BnSaved, BnStats, BnSums, BnUpdate};
pub use codec::{WireGeom, CODEC_THREADS};
pub use dropout::DropoutKey;
pub use layernorm::{LnGrads, LnParams, LnSaved, LN_BLOCK, LN_LANES};

/// Threads per block of the block-per-channel reductions; must equal `REDUCE_BLOCK` in
/// kernels/elementwise.cu and kernels/batchnorm.cu.
pub const REDUCE_BLOCK: u32 = 256;
/// Threads per block of the grid-stride element loops.
const ELEM_BLOCK: u32 = 256;
/// Cap on blocks of an element loop; the grid-stride loop covers the rest.
const MAX_BLOCKS: usize = 65_535;

/// Launch shape for a grid-stride loop over `n` elements (`n > 0`).
pub(crate) fn elem_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(ELEM_BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (ELEM_BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// Launch shape for the block-per-channel reductions: grid = (C), REDUCE_BLOCK threads.
fn channel_cfg(c: i32) -> LaunchConfig {
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

/// Geometry of a 2-D window (a convolution's or a pooling's) on NCHW input, padding
/// asymmetric, no dilation. The layers build it from their own placement
/// (`nn::Geometry2d::launch_geom`, so the two backends share every pad); the fields stay
/// public for tests that state a geometry outright.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowGeom {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride_h: usize,
    pub stride_w: usize,
    pub pad_top: usize,
    pub pad_left: usize,
    pub pad_bottom: usize,
    pub pad_right: usize,
}

impl WindowGeom {
    /// A batch of `n` samples of `c` channels of (H, W) = `hw` under a window of `kernel`
    /// (KH, KW) moved by `stride` (SH, SW), with the plane padded by
    /// `pads` = [top, left, bottom, right].
    pub fn new(
        n: usize,
        c: usize,
        (h, w): (usize, usize),
        (kh, kw): (usize, usize),
        (stride_h, stride_w): (usize, usize),
        [pad_top, pad_left, pad_bottom, pad_right]: [usize; 4],
    ) -> WindowGeom {
        WindowGeom { n, c, h, w, kh, kw, stride_h, stride_w, pad_top, pad_left, pad_bottom, pad_right }
    }

    /// Output height: (H + PT + PB - KH) / SH + 1 (0 when the kernel does not fit).
    pub fn oh(&self) -> usize {
        (self.h + self.pad_top + self.pad_bottom).checked_sub(self.kh).map_or(0, |v| v / self.stride_h + 1)
    }
    /// Output width: (W + PL + PR - KW) / SW + 1 (0 when the kernel does not fit).
    pub fn ow(&self) -> usize {
        (self.w + self.pad_left + self.pad_right).checked_sub(self.kw).map_or(0, |v| v / self.stride_w + 1)
    }
    /// Elements of x: N*C*H*W.
    pub fn x_len(&self) -> usize {
        self.n * self.c * self.h * self.w
    }
    /// Elements of col: N * (C*KH*KW) * (OH*OW).
    pub fn col_len(&self) -> usize {
        self.n * self.c * self.kh * self.kw * self.oh() * self.ow()
    }
    /// Elements of a pooling's output (and its argmax): N*C*OH*OW.
    pub fn pooled_len(&self) -> usize {
        self.n * self.c * self.oh() * self.ow()
    }

    /// The 12 ints a window kernel takes ([`Kind::Geom`](super::declare::Kind::Geom)):
    /// N, C, H, W, KH, KW, SH, SW, PT, PL, OH, OW; a zero stride or a dimension past i32
    /// is [`Error::Shape`] of `op`.
    fn launch_args(&self, op: &'static str) -> Result<[i32; 12]> {
        let g = self;
        if g.stride_h == 0 || g.stride_w == 0 {
            return Err(Error::shape(op, format!("stride must be positive, got {g:?}")));
        }
        Ok([
            dim(op, "N", g.n)?,
            dim(op, "C", g.c)?,
            dim(op, "H", g.h)?,
            dim(op, "W", g.w)?,
            dim(op, "KH", g.kh)?,
            dim(op, "KW", g.kw)?,
            dim(op, "SH", g.stride_h)?,
            dim(op, "SW", g.stride_w)?,
            dim(op, "PT", g.pad_top)?,
            dim(op, "PL", g.pad_left)?,
            dim(op, "OH", g.oh())?,
            dim(op, "OW", g.ow())?,
        ])
    }
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
                    let m = super::kernels::load_module(&self.ctx, kernel.file)?;
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
