//! Launching the kernels of `kernels/` on one GPU, with every argument checked first.
//!
//! Owns: [`Gpu`], one device's context, compute stream and loaded modules, and one safe
//! method per kernel. Each method checks the lengths of its buffers against the shapes
//! it is given (a wrong length is [`Error::Shape`], never an out-of-bounds write on the
//! device), then launches on the compute stream, asynchronously. The backend and the
//! layers decide *what* to launch; this file only makes each launch sound.
//! A `Gpu` belongs to the worker thread that created it (DESIGN.md: one thread per device).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceSlice, LaunchConfig,
    PushKernelArg,
};
use parking_lot::Mutex;

use super::kernels::{kernel_name, Dir};
use super::probe::driver_available;
use crate::nn::batchnorm::RunningUpdate;
use crate::nn::Geometry2d;
use crate::optim::{OptimizerConfig, StepScalars};
use crate::wire::{Codec, Compression, BLOCK};
use crate::{Error, Result};

/// Threads per block of the block-per-channel reductions; must equal `REDUCE_BLOCK` in
/// kernels/elementwise.cu and kernels/batchnorm.cu.
pub const REDUCE_BLOCK: u32 = 256;
/// Threads per block of kernels/codec.cu (`CODEC_THREADS`), one block per codec block of
/// 1,024 values.
pub const CODEC_THREADS: u32 = 256;
/// Threads per block of the grid-stride element loops.
const ELEM_BLOCK: u32 = 256;
/// Cap on blocks of an element loop; the grid-stride loop covers the rest.
const MAX_BLOCKS: usize = 65_535;

/// Launch shape for a grid-stride loop over `n` elements (`n > 0`).
fn elem_cfg(n: usize) -> LaunchConfig {
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
fn check_len<T>(op: &'static str, what: &str, buf: &impl DeviceSlice<T>, want: usize) -> Result<()> {
    if buf.len() == want {
        Ok(())
    } else {
        Err(Error::shape(op, format!("{what} has {} elements, expected {want}", buf.len())))
    }
}

/// A dimension as the `int` the kernels take.
fn dim(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::shape(op, format!("{what} = {v} does not fit in i32")))
}

/// Geometry of a 2-D window (a convolution's or a pooling's) on NCHW input, padding
/// asymmetric, no dilation. Built from the layers' own placement with [`ConvGeom::new`];
/// the fields stay public for tests that state a geometry outright.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGeom {
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

impl ConvGeom {
    /// A batch of `n` samples of `c` channels under the window placement `g`, the one the
    /// CPU layers use (`nn::window`), so the two backends share every pad.
    pub fn new(n: usize, c: usize, g: &Geometry2d) -> ConvGeom {
        let ((kh, kw), (stride_h, stride_w)) = (g.window.kernel, g.window.stride);
        let geom = ConvGeom {
            n,
            c,
            h: g.h,
            w: g.w,
            kh,
            kw,
            stride_h,
            stride_w,
            pad_top: g.pad_top,
            pad_left: g.pad_left,
            pad_bottom: g.pad_bottom,
            pad_right: g.pad_right,
        };
        debug_assert_eq!((geom.oh(), geom.ow()), (g.oh, g.ow), "the padded extent gives the placement's output");
        geom
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
}

/// Which of the optional BatchNorm parameters exist (Keras `scale` and `center`).
#[derive(Debug)]
pub struct BnParams<'a> {
    /// gamma: (C), None for `scale=False`.
    pub gamma: Option<CudaView<'a, f32>>,
    /// beta: (C), None for `center=False`.
    pub beta: Option<CudaView<'a, f32>>,
}

/// The geometry and constants of a BatchNorm pass over x: (N, C, H, W), hw = H·W.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BnGeom {
    pub n: usize,
    pub c: usize,
    pub hw: usize,
    pub eps: f32,
    /// Keras momentum (the weight of the old running value); read by the training forward.
    pub momentum: f32,
}

/// The per-channel buffers a training forward writes, (C) each: the running statistics
/// (updated in place) and the batch's mean and 1/sqrt(var + eps) (saved for backward).
#[derive(Debug)]
pub struct BnStats<'a> {
    pub running_mean: CudaViewMut<'a, f32>,
    pub running_var: CudaViewMut<'a, f32>,
    pub save_mean: CudaViewMut<'a, f32>,
    pub save_invstd: CudaViewMut<'a, f32>,
}

/// The statistics a training forward saved for its backward, (C) each.
#[derive(Debug)]
pub struct BnSaved<'a> {
    pub mean: CudaView<'a, f32>,
    pub invstd: CudaView<'a, f32>,
}

/// What a BatchNorm backward writes: dx (N, C, H, W), and accumulates into: dgamma and
/// dbeta (C), present exactly when gamma and beta are.
#[derive(Debug)]
pub struct BnGrads<'a> {
    pub dx: CudaViewMut<'a, f32>,
    pub dgamma: Option<CudaViewMut<'a, f32>>,
    pub dbeta: Option<CudaViewMut<'a, f32>>,
}

/// What a synchronized BatchNorm's training forward normalises with.
#[derive(Debug)]
pub struct BnMerged<'a> {
    /// (C, 4) per channel, in f64: the global batch's mean and BIASED variance, and what
    /// normalises (`nn::batchnorm::normaliser`: the mean and 1/sqrt(var + eps) as f32).
    pub stats: CudaView<'a, f64>,
    /// The running statistics' update for the global batch's count.
    pub update: RunningUpdate,
}

/// What a synchronized BatchNorm's training backward takes: the forward's saved
/// statistics and the per-channel sums.
#[derive(Debug)]
pub struct BnSums<'a> {
    /// From the forward (`batchnorm_sync_fwd`).
    pub saved: BnSaved<'a>,
    /// This shard's per-channel (Σ dy, Σ dy·x̂): (C, 2), f64.
    pub local: CudaView<'a, f64>,
    /// The global batch's: (C, 2), f64.
    pub global: CudaView<'a, f64>,
    /// Values per channel in the global batch.
    pub count: f64,
}

/// Where the parts of one slot's 16-bit wire lie in device memory, in bytes from the
/// wire's start (kernels/codec.cu): the 16-bit codes of the first `encoded` values at 0,
/// fp16's block exponents (one signed byte per 1,024 values) right after them, then, on a
/// 256-byte boundary, the `raw` f32 values past the encoded part. Wires of one buffer lie
/// [`WireGeom::bytes`] apart, a multiple of 256, so that every wire, code and float starts
/// aligned. What is encoded, and how, is the codec's (`exchange::codec`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireGeom {
    /// Bf16 or Fp16 (a codec exists for those alone).
    pub compression: Compression,
    /// Leading values of a slot that are encoded (the gradient).
    pub encoded: usize,
    /// Values after them that travel as f32 (the BatchNorm buffers).
    pub raw: usize,
}

impl WireGeom {
    /// The wire of a slot of `width` values under `codec`.
    pub fn new(codec: &Codec, width: usize) -> WireGeom {
        let encoded = codec.encoded_len().min(width);
        WireGeom { compression: codec.compression(), encoded, raw: width - encoded }
    }

    /// Values of a slot: `encoded + raw`.
    pub fn width(&self) -> usize {
        self.encoded + self.raw
    }

    /// fp16's block exponents (none for bf16).
    pub fn exponents(&self) -> usize {
        match self.compression {
            Compression::Fp16 => self.encoded.div_ceil(BLOCK),
            _ => 0,
        }
    }

    /// Byte offset of the block exponents.
    pub fn exps_at(&self) -> usize {
        2 * self.encoded
    }

    /// Byte offset of the raw f32 part.
    pub fn raw_at(&self) -> usize {
        (self.exps_at() + self.exponents()).div_ceil(256) * 256
    }

    /// Bytes from one wire's start to the next's (at least 256).
    pub fn bytes(&self) -> usize {
        (self.raw_at() + 4 * self.raw).div_ceil(256).max(1) * 256
    }

    /// Bytes a wire carries (codes, exponents, raw values; no padding): what crosses
    /// between ranks for one slot, as the codec's `Wire::bytes` counts it.
    pub fn payload(&self) -> usize {
        2 * self.encoded + self.exponents() + 4 * self.raw
    }

    /// The kernels' `format`: FORMAT_BF16 (1) or FORMAT_FP16 (2).
    pub fn format(&self) -> i32 {
        match self.compression {
            Compression::Fp16 => 2,
            _ => 1,
        }
    }

    /// CUDA blocks per wire: one per 1,024 values, the encoded part's then the raw part's.
    pub fn blocks(&self) -> usize {
        self.encoded.div_ceil(BLOCK) + self.raw.div_ceil(BLOCK)
    }
}

/// One GPU as one worker thread sees it: context, compute stream, loaded kernel modules.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// Functions looked up once: a step launches dozens of kernels, and a lookup by name
    /// in the driver on each launch would cost more than some of the kernels.
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

    /// Kernel `<op>_<dir>_f32` of kernel file `file`, compiling and loading the file on
    /// first use.
    pub fn function(&self, file: &'static str, op: &'static str, dir: Dir) -> Result<CudaFunction> {
        if let Some(f) = self.functions.lock().get(&(file, op, dir)) {
            return Ok(f.clone());
        }
        let module = {
            let mut modules = self.modules.lock();
            match modules.get(file) {
                Some(m) => m.clone(),
                None => {
                    let m = super::kernels::load_module(&self.ctx, file)?;
                    modules.insert(file, m.clone());
                    m
                }
            }
        };
        let f = module.load_function(&kernel_name(op, dir, "f32"))?;
        self.functions.lock().insert((file, op, dir), f.clone());
        Ok(f)
    }

    /// Blocks until all work queued on the compute stream is done.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    // ---- elementwise.cu -------------------------------------------------------------

    /// y = max(x, 0). x, y: (n)
    pub fn relu_fwd(&self, x: &impl DevIn, y: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let n = x.len();
        check_len("relu_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("elementwise.cu", "relu", Dir::Fwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(y).arg(&n);
        // SAFETY: arguments match relu_fwd_f32(const float*, float*, size_t); x and y hold
        // n floats each (checked above), and the kernel touches indices < n only.
        unsafe { b.launch(elem_cfg(n)) }?;
        Ok(())
    }

    /// dx = dy where x > 0, else 0. x, dy, dx: (n)
    pub fn relu_bwd(&self, x: &impl DevIn, dy: &impl DevIn, dx: &mut impl DevOut) -> Result<()> {
        let x = &x.view();
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let n = x.len();
        check_len("relu_bwd", "dy", dy, n)?;
        check_len("relu_bwd", "dx", dx, n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("elementwise.cu", "relu", Dir::Bwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(dy).arg(dx).arg(&n);
        // SAFETY: arguments match relu_bwd_f32(const float*, const float*, float*, size_t);
        // all three buffers hold n floats (checked above).
        unsafe { b.launch(elem_cfg(n)) }?;
        Ok(())
    }

    /// y = x * scale + offset. x, y: (n)
    pub fn rescale_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, scale: f32, offset: f32) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let n = x.len();
        check_len("rescale_fwd", "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("elementwise.cu", "rescale", Dir::Fwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(y).arg(&scale).arg(&offset).arg(&n);
        // SAFETY: arguments match rescale_fwd_f32(const float*, float*, float, float, size_t);
        // x and y hold n floats (checked above).
        unsafe { b.launch(elem_cfg(n)) }?;
        Ok(())
    }

    /// dx = dy * scale. dy, dx: (n)
    pub fn rescale_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, scale: f32) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let n = dy.len();
        check_len("rescale_bwd", "dx", dx, n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("elementwise.cu", "rescale", Dir::Bwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(dy).arg(dx).arg(&scale).arg(&n);
        // SAFETY: arguments match rescale_bwd_f32(const float*, float*, float, size_t);
        // dy and dx hold n floats (checked above).
        unsafe { b.launch(elem_cfg(n)) }?;
        Ok(())
    }

    /// `y += bias[c]`, in place. y: (N, C, H, W) with hw = H*W; bias: (C)
    pub fn bias_nchw_fwd(&self, y: &mut impl DevOut, bias: &impl DevIn, n: usize, c: usize, hw: usize) -> Result<()> {
        let y = &mut y.view_mut();
        let bias = &bias.view();
        let total = n * c * hw;
        check_len("bias_nchw_fwd", "y", y, total)?;
        check_len("bias_nchw_fwd", "bias", bias, c)?;
        if total == 0 {
            return Ok(());
        }
        let ci = dim("bias_nchw_fwd", "C", c)?;
        let f = self.function("elementwise.cu", "bias_nchw", Dir::Fwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(y).arg(bias).arg(&ci).arg(&hw).arg(&total);
        // SAFETY: arguments match bias_nchw_fwd_f32(float*, const float*, int, size_t,
        // size_t); y holds N*C*HW floats and bias C (checked), and (i / hw) % C < C.
        unsafe { b.launch(elem_cfg(total)) }?;
        Ok(())
    }

    /// `dbias[c] += Σ_(n,h,w) dy`. dy: (N, C, H, W) with hw = H*W; dbias: (C)
    pub fn bias_nchw_bwd(&self, dy: &impl DevIn, dbias: &mut impl DevOut, n: usize, c: usize, hw: usize) -> Result<()> {
        let dy = &dy.view();
        let dbias = &mut dbias.view_mut();
        check_len("bias_nchw_bwd", "dy", dy, n * c * hw)?;
        check_len("bias_nchw_bwd", "dbias", dbias, c)?;
        if c == 0 {
            return Ok(());
        }
        let (ni, ci) = (dim("bias_nchw_bwd", "N", n)?, dim("bias_nchw_bwd", "C", c)?);
        let f = self.function("elementwise.cu", "bias_nchw", Dir::Bwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(dy).arg(dbias).arg(&ni).arg(&ci).arg(&hw);
        // SAFETY: arguments match bias_nchw_bwd_f32(const float*, float*, int, int, size_t);
        // one block of REDUCE_BLOCK threads per channel as the kernel requires; dy holds
        // N*C*HW floats and dbias C (checked).
        unsafe { b.launch(channel_cfg(ci)) }?;
        Ok(())
    }

    /// `y += bias[o]`, in place. y: (N, O); bias: (O)
    pub fn bias_cols_fwd(&self, y: &mut impl DevOut, bias: &impl DevIn, n: usize, o: usize) -> Result<()> {
        let y = &mut y.view_mut();
        let bias = &bias.view();
        let total = n * o;
        check_len("bias_cols_fwd", "y", y, total)?;
        check_len("bias_cols_fwd", "bias", bias, o)?;
        if total == 0 {
            return Ok(());
        }
        let oi = dim("bias_cols_fwd", "O", o)?;
        let f = self.function("elementwise.cu", "bias_cols", Dir::Fwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(y).arg(bias).arg(&oi).arg(&total);
        // SAFETY: arguments match bias_cols_fwd_f32(float*, const float*, int, size_t);
        // y holds N*O floats, bias O (checked), and i % O < O.
        unsafe { b.launch(elem_cfg(total)) }?;
        Ok(())
    }

    /// `dbias[o] += Σ_n dy[n, o]`. dy: (N, O); dbias: (O)
    pub fn bias_cols_bwd(&self, dy: &impl DevIn, dbias: &mut impl DevOut, n: usize, o: usize) -> Result<()> {
        let dy = &dy.view();
        let dbias = &mut dbias.view_mut();
        check_len("bias_cols_bwd", "dy", dy, n * o)?;
        check_len("bias_cols_bwd", "dbias", dbias, o)?;
        if o == 0 {
            return Ok(());
        }
        let (ni, oi) = (dim("bias_cols_bwd", "N", n)?, dim("bias_cols_bwd", "O", o)?);
        let f = self.function("elementwise.cu", "bias_cols", Dir::Bwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(dy).arg(dbias).arg(&ni).arg(&oi);
        // SAFETY: arguments match bias_cols_bwd_f32(const float*, float*, int, int);
        // dy holds N*O floats and dbias O (checked).
        unsafe { b.launch(elem_cfg(o)) }?;
        Ok(())
    }

    /// x *= s, in place. x: (n)
    pub fn scale(&self, x: &mut impl DevOut, s: f32) -> Result<()> {
        let x = &mut x.view_mut();
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let f = self.function("elementwise.cu", "scale", Dir::Plain)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(&s).arg(&n);
        // SAFETY: arguments match scale_f32(float*, float, size_t); n is x's length.
        unsafe { b.launch(elem_cfg(n)) }?;
        Ok(())
    }

    /// x = v everywhere. x: (n)
    pub fn fill(&self, x: &mut impl DevOut, v: f32) -> Result<()> {
        let x = &mut x.view_mut();
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let f = self.function("elementwise.cu", "fill", Dir::Plain)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(&v).arg(&n);
        // SAFETY: arguments match fill_f32(float*, float, size_t); n is x's length.
        unsafe { b.launch(elem_cfg(n)) }?;
        Ok(())
    }

    // ---- conv.cu --------------------------------------------------------------------

    fn conv_args(g: &ConvGeom, op: &'static str) -> Result<[i32; 12]> {
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

    /// x: (N, C, H, W) -> col: (N, C*KH*KW, OH*OW), the CPU backend's layout.
    pub fn im2col_fwd(&self, x: &impl DevIn, col: &mut impl DevOut, g: &ConvGeom) -> Result<()> {
        let x = &x.view();
        let col = &mut col.view_mut();
        let a = Self::conv_args(g, "im2col_fwd")?;
        check_len("im2col_fwd", "x", x, g.x_len())?;
        check_len("im2col_fwd", "col", col, g.col_len())?;
        if g.col_len() == 0 {
            return Ok(());
        }
        let f = self.function("conv.cu", "im2col", Dir::Fwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(col);
        for v in &a {
            b.arg(v);
        }
        // SAFETY: arguments match im2col_fwd_f32(const float*, float*, 12 x int); x and col
        // have the lengths the geometry implies (checked), and the kernel reads x only at
        // in-bounds (y, x) and writes col below N*C*KH*KW*OH*OW.
        unsafe { b.launch(elem_cfg(g.col_len())) }?;
        Ok(())
    }

    /// col2im: dcol: (N, C*KH*KW, OH*OW) -> dx: (N, C, H, W), dx written.
    pub fn im2col_bwd(&self, dcol: &impl DevIn, dx: &mut impl DevOut, g: &ConvGeom) -> Result<()> {
        let dcol = &dcol.view();
        let dx = &mut dx.view_mut();
        let a = Self::conv_args(g, "im2col_bwd")?;
        check_len("im2col_bwd", "dcol", dcol, g.col_len())?;
        check_len("im2col_bwd", "dx", dx, g.x_len())?;
        if g.x_len() == 0 {
            return Ok(());
        }
        let f = self.function("conv.cu", "im2col", Dir::Bwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(dcol).arg(dx);
        for v in &a {
            b.arg(v);
        }
        // SAFETY: arguments match im2col_bwd_f32(const float*, float*, 12 x int); lengths
        // checked; the kernel reads dcol only at oy < OH, ox < OW, and writes dx below N*C*H*W.
        unsafe { b.launch(elem_cfg(g.x_len())) }?;
        Ok(())
    }

    // ---- batchnorm.cu ---------------------------------------------------------------

    fn check_bn_params(op: &'static str, p: &BnParams<'_>, c: usize) -> Result<()> {
        if let Some(g) = &p.gamma {
            check_len(op, "gamma", g, c)?;
        }
        if let Some(b) = &p.beta {
            check_len(op, "beta", b, c)?;
        }
        Ok(())
    }

    /// Training forward: batch statistics over (N, H, W), running stats updated as
    /// `nn::batchnorm::RunningUpdate` says for the Keras momentum of `g`.
    /// x, y: (N, C, H, W) with hw = H*W; every buffer of `stats`: (C)
    pub fn batchnorm_train_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        params: BnParams<'_>,
        stats: BnStats<'_>,
        g: BnGeom,
    ) -> Result<()> {
        let BnGeom { n, c, hw, eps, momentum } = g;
        let x = &x.view();
        let y = &mut y.view_mut();
        let BnStats { mut running_mean, mut running_var, mut save_mean, mut save_invstd } = stats;
        let op = "batchnorm_train_fwd";
        check_len(op, "x", x, n * c * hw)?;
        check_len(op, "y", y, n * c * hw)?;
        Self::check_bn_params(op, &params, c)?;
        for (what, buf) in [
            ("running_mean", &running_mean),
            ("running_var", &running_var),
            ("save_mean", &save_mean),
            ("save_invstd", &save_invstd),
        ] {
            check_len(op, what, buf, c)?;
        }
        if c == 0 {
            return Ok(());
        }
        let (ni, ci) = (dim(op, "N", n)?, dim(op, "C", c)?);
        let null: u64 = 0;
        let f = self.function("batchnorm.cu", "batchnorm_train", Dir::Fwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(y);
        match &params.gamma {
            Some(g) => b.arg(g),
            None => b.arg(&null),
        };
        match &params.beta {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        let u = RunningUpdate::new(momentum, n * hw);
        let (keep, take, unbias) = (u.keep as f32, u.take as f32, u.unbias as f32);
        b.arg(&mut running_mean).arg(&mut running_var).arg(&mut save_mean).arg(&mut save_invstd);
        b.arg(&ni).arg(&ci).arg(&hw).arg(&keep).arg(&take).arg(&unbias).arg(&eps);
        // SAFETY: arguments match batchnorm_train_fwd_f32(const float* x, float* y, const
        // float* gamma, const float* beta, float* running_mean, float* running_var, float*
        // save_mean, float* save_invstd, int n, int c, size_t hw, float keep, float take,
        // float unbias, float eps); absent parameters are a 64-bit 0 the kernel tests for
        // NULL; every buffer length checked; grid = (C), REDUCE_BLOCK threads.
        unsafe { b.launch(channel_cfg(ci)) }?;
        Ok(())
    }

    /// Eval forward with the running statistics `running` = (mean, var).
    /// x, y: (N, C, H, W), hw = H*W; running mean and var: (C)
    pub fn batchnorm_eval_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        params: BnParams<'_>,
        running: (&impl DevIn, &impl DevIn),
        g: BnGeom,
    ) -> Result<()> {
        let BnGeom { n, c, hw, eps, .. } = g;
        let x = &x.view();
        let y = &mut y.view_mut();
        let running_mean = &running.0.view();
        let running_var = &running.1.view();
        let op = "batchnorm_eval_fwd";
        let total = n * c * hw;
        check_len(op, "x", x, total)?;
        check_len(op, "y", y, total)?;
        Self::check_bn_params(op, &params, c)?;
        check_len(op, "running_mean", running_mean, c)?;
        check_len(op, "running_var", running_var, c)?;
        if total == 0 {
            return Ok(());
        }
        let ci = dim(op, "C", c)?;
        let null: u64 = 0;
        let f = self.function("batchnorm.cu", "batchnorm_eval", Dir::Fwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(y);
        match &params.gamma {
            Some(g) => b.arg(g),
            None => b.arg(&null),
        };
        match &params.beta {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        b.arg(running_mean).arg(running_var).arg(&ci).arg(&hw).arg(&total).arg(&eps);
        // SAFETY: arguments match batchnorm_eval_fwd_f32(const float* x, float* y, const
        // float* gamma, const float* beta, const float* running_mean, const float*
        // running_var, int c, size_t hw, size_t total, float eps); lengths checked; the
        // channel index (i / hw) % C is below C.
        unsafe { b.launch(elem_cfg(total)) }?;
        Ok(())
    }

    /// Training backward from the forward's `saved` statistics: `grads.dx` written;
    /// dgamma, dbeta accumulated (given exactly when gamma, beta exist in `params`).
    /// x, dy, dx: (N, C, H, W), hw = H*W; saved, dgamma, dbeta: (C)
    pub fn batchnorm_train_bwd(
        &self,
        x: &impl DevIn,
        dy: &impl DevIn,
        params: BnParams<'_>,
        saved: BnSaved<'_>,
        grads: BnGrads<'_>,
        g: BnGeom,
    ) -> Result<()> {
        let BnGeom { n, c, hw, .. } = g;
        let x = &x.view();
        let dy = &dy.view();
        let BnGrads { mut dx, mut dgamma, mut dbeta } = grads;
        let (gamma, save_mean, save_invstd) = (params.gamma, saved.mean, saved.invstd);
        let op = "batchnorm_train_bwd";
        for (what, buf) in [("x", x), ("dy", dy)] {
            check_len(op, what, buf, n * c * hw)?;
        }
        check_len(op, "dx", &dx, n * c * hw)?;
        for (what, buf) in [("save_mean", &save_mean), ("save_invstd", &save_invstd)] {
            check_len(op, what, buf, c)?;
        }
        if gamma.is_some() != dgamma.is_some() {
            return Err(Error::shape(op, "dgamma must be given exactly when gamma is"));
        }
        if params.beta.is_some() != dbeta.is_some() {
            return Err(Error::shape(op, "dbeta must be given exactly when beta is"));
        }
        if let Some(g) = &gamma {
            check_len(op, "gamma", g, c)?;
        }
        for (what, g) in [("dgamma", &dgamma), ("dbeta", &dbeta)] {
            if let Some(g) = g {
                check_len(op, what, g, c)?;
            }
        }
        if c == 0 {
            return Ok(());
        }
        let (ni, ci) = (dim(op, "N", n)?, dim(op, "C", c)?);
        let null: u64 = 0;
        let f = self.function("batchnorm.cu", "batchnorm_train", Dir::Bwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(dy).arg(&mut dx);
        match &gamma {
            Some(g) => b.arg(g),
            None => b.arg(&null),
        };
        b.arg(&save_mean).arg(&save_invstd);
        match &mut dgamma {
            Some(g) => b.arg(g),
            None => b.arg(&null),
        };
        match &mut dbeta {
            Some(g) => b.arg(g),
            None => b.arg(&null),
        };
        b.arg(&ni).arg(&ci).arg(&hw);
        // SAFETY: arguments match batchnorm_train_bwd_f32(const float* x, const float* dy,
        // float* dx, const float* gamma, const float* save_mean, const float* save_invstd,
        // float* dgamma, float* dbeta, int n, int c, size_t hw); lengths checked; absent
        // optional buffers are a 64-bit 0 the kernel tests for NULL before use; grid = (C),
        // REDUCE_BLOCK threads as the kernel requires.
        unsafe { b.launch(channel_cfg(ci)) }?;
        Ok(())
    }

    // ---- batchnorm.cu: synchronized BatchNorm ----------------------------------------

    /// Each channel's (mean, M2) of this shard in f64, the CPU layer's arithmetic (planes
    /// merged in sample order). x: (N, C, H, W), hw = H*W -> moments: (C, 2)
    pub fn batchnorm_moments_fwd(&self, x: &impl DevIn, moments: &mut CudaViewMut<'_, f64>, g: BnGeom) -> Result<()> {
        let BnGeom { n, c, hw, .. } = g;
        let x = &x.view();
        let op = "batchnorm_moments_fwd";
        check_len(op, "x", x, n * c * hw)?;
        check_len(op, "moments", moments, 2 * c)?;
        if c == 0 {
            return Ok(());
        }
        let (ni, ci) = (dim(op, "N", n)?, dim(op, "C", c)?);
        let f = self.function("batchnorm.cu", "batchnorm_moments", Dir::Fwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(moments).arg(&ni).arg(&ci).arg(&hw);
        // SAFETY: arguments match batchnorm_moments_fwd_f32(const float* x, double*
        // moments, int n, int c, size_t hw); x holds N*C*HW floats and moments 2C doubles
        // (checked); grid = (C), REDUCE_BLOCK threads, as the kernel's shared arrays need.
        unsafe { b.launch(channel_cfg(ci)) }?;
        Ok(())
    }

    /// Training forward with the global batch's statistics (`merged`): the running
    /// statistics move as its update says (for the global count), the saved ones are set.
    /// x, y: (N, C, H, W) with hw = H*W; every buffer of `out`: (C)
    pub fn batchnorm_sync_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        params: BnParams<'_>,
        merged: BnMerged<'_>,
        out: BnStats<'_>,
        g: BnGeom,
    ) -> Result<()> {
        let BnGeom { n, c, hw, .. } = g;
        let BnMerged { stats, update } = merged;
        let stats = &stats;
        let x = &x.view();
        let y = &mut y.view_mut();
        let BnStats { mut running_mean, mut running_var, mut save_mean, mut save_invstd } = out;
        let op = "batchnorm_sync_fwd";
        let total = n * c * hw;
        check_len(op, "x", x, total)?;
        check_len(op, "y", y, total)?;
        Self::check_bn_params(op, &params, c)?;
        check_len(op, "stats", stats, 4 * c)?;
        for (what, buf) in [
            ("running_mean", &running_mean),
            ("running_var", &running_var),
            ("save_mean", &save_mean),
            ("save_invstd", &save_invstd),
        ] {
            check_len(op, what, buf, c)?;
        }
        if c == 0 {
            return Ok(());
        }
        let ci = dim(op, "C", c)?;
        let null: u64 = 0;
        let f = self.function("batchnorm.cu", "batchnorm_sync", Dir::Fwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(y);
        match &params.gamma {
            Some(g) => b.arg(g),
            None => b.arg(&null),
        };
        match &params.beta {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        b.arg(stats).arg(&mut running_mean).arg(&mut running_var).arg(&mut save_mean).arg(&mut save_invstd);
        b.arg(&ci).arg(&hw).arg(&total).arg(&update.keep).arg(&update.take).arg(&update.unbias);
        // SAFETY: arguments match batchnorm_sync_fwd_f32(const float* x, float* y, const
        // float* gamma, const float* beta, const double* stats, float* running_mean,
        // float* running_var, float* save_mean, float* save_invstd, int c, size_t hw,
        // size_t total, double keep, double take, double unbias); absent parameters are a
        // 64-bit 0 the kernel tests for NULL; every length checked; the channel index
        // (i / hw) % C is below C.
        unsafe { b.launch(elem_cfg(total.max(c))) }?;
        Ok(())
    }

    /// Each channel's (Σ dy, Σ dy·x̂) of this shard in f64, x̂ recomputed from x and the
    /// forward's saved statistics as the CPU layer's cached one.
    /// x, dy: (N, C, H, W), hw = H*W; saved: (C) -> sums: (C, 2)
    pub fn batchnorm_sums_bwd(
        &self,
        x: &impl DevIn,
        dy: &impl DevIn,
        saved: &BnSaved<'_>,
        sums: &mut CudaViewMut<'_, f64>,
        g: BnGeom,
    ) -> Result<()> {
        let BnGeom { n, c, hw, .. } = g;
        let x = &x.view();
        let dy = &dy.view();
        let op = "batchnorm_sums_bwd";
        check_len(op, "x", x, n * c * hw)?;
        check_len(op, "dy", dy, n * c * hw)?;
        check_len(op, "save_mean", &saved.mean, c)?;
        check_len(op, "save_invstd", &saved.invstd, c)?;
        check_len(op, "sums", sums, 2 * c)?;
        if c == 0 {
            return Ok(());
        }
        let (ni, ci) = (dim(op, "N", n)?, dim(op, "C", c)?);
        let f = self.function("batchnorm.cu", "batchnorm_sums", Dir::Bwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(dy).arg(&saved.mean).arg(&saved.invstd).arg(sums).arg(&ni).arg(&ci).arg(&hw);
        // SAFETY: arguments match batchnorm_sums_bwd_f32(const float* x, const float* dy,
        // const float* save_mean, const float* save_invstd, double* sums, int n, int c,
        // size_t hw); lengths checked; grid = (C), REDUCE_BLOCK threads.
        unsafe { b.launch(channel_cfg(ci)) }?;
        Ok(())
    }

    /// Training backward with the forward's statistics and the global batch's sums
    /// (`sums`): `grads.dx` written;
    /// dgamma, dbeta accumulated from this shard's own sums (given exactly when gamma,
    /// beta exist in `params`). x, dy, dx: (N, C, H, W), hw = H*W; saved, dgamma, dbeta: (C)
    pub fn batchnorm_sync_bwd(
        &self,
        x: &impl DevIn,
        dy: &impl DevIn,
        params: BnParams<'_>,
        sums: BnSums<'_>,
        grads: BnGrads<'_>,
        g: BnGeom,
    ) -> Result<()> {
        let BnGeom { n, c, hw, .. } = g;
        let BnSums { saved, local, global, count } = sums;
        let (local, global) = (&local, &global);
        let x = &x.view();
        let dy = &dy.view();
        let BnGrads { mut dx, mut dgamma, mut dbeta } = grads;
        let op = "batchnorm_sync_bwd";
        let total = n * c * hw;
        for (what, buf) in [("x", x), ("dy", dy)] {
            check_len(op, what, buf, total)?;
        }
        check_len(op, "dx", &dx, total)?;
        check_len(op, "save_mean", &saved.mean, c)?;
        check_len(op, "save_invstd", &saved.invstd, c)?;
        check_len(op, "local", local, 2 * c)?;
        check_len(op, "global", global, 2 * c)?;
        if params.gamma.is_some() != dgamma.is_some() {
            return Err(Error::shape(op, "dgamma must be given exactly when gamma is"));
        }
        if params.beta.is_some() != dbeta.is_some() {
            return Err(Error::shape(op, "dbeta must be given exactly when beta is"));
        }
        if let Some(g) = &params.gamma {
            check_len(op, "gamma", g, c)?;
        }
        for (what, g) in [("dgamma", &dgamma), ("dbeta", &dbeta)] {
            if let Some(g) = g {
                check_len(op, what, g, c)?;
            }
        }
        if c == 0 {
            return Ok(());
        }
        let ci = dim(op, "C", c)?;
        let null: u64 = 0;
        let f = self.function("batchnorm.cu", "batchnorm_sync", Dir::Bwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(dy).arg(&mut dx);
        match &params.gamma {
            Some(g) => b.arg(g),
            None => b.arg(&null),
        };
        b.arg(&saved.mean).arg(&saved.invstd).arg(local).arg(global);
        match &mut dgamma {
            Some(g) => b.arg(g),
            None => b.arg(&null),
        };
        match &mut dbeta {
            Some(g) => b.arg(g),
            None => b.arg(&null),
        };
        b.arg(&ci).arg(&hw).arg(&total).arg(&count);
        // SAFETY: arguments match batchnorm_sync_bwd_f32(const float* x, const float* dy,
        // float* dx, const float* gamma, const float* save_mean, const float* save_invstd,
        // const double* local, const double* global, float* dgamma, float* dbeta, int c,
        // size_t hw, size_t total, double count); lengths checked; absent optional
        // buffers are a 64-bit 0 the kernel tests for NULL before use.
        unsafe { b.launch(elem_cfg(total.max(c))) }?;
        Ok(())
    }

    // ---- pooling.cu -----------------------------------------------------------------

    /// x: (N, C, H, W) with nc = N*C, hw = H*W -> y: (N, C), the spatial mean.
    pub fn global_avgpool_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, nc: usize, hw: usize) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        check_len("global_avgpool_fwd", "x", x, nc * hw)?;
        check_len("global_avgpool_fwd", "y", y, nc)?;
        if nc == 0 {
            return Ok(());
        }
        let f = self.function("pooling.cu", "global_avgpool", Dir::Fwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(y).arg(&nc).arg(&hw);
        // SAFETY: arguments match global_avgpool_fwd_f32(const float*, float*, size_t,
        // size_t); x holds nc*hw floats and y nc (checked).
        unsafe { b.launch(elem_cfg(nc)) }?;
        Ok(())
    }

    /// dy: (N, C) -> dx: (N, C, H, W) = dy / (H*W), written.
    pub fn global_avgpool_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, nc: usize, hw: usize) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        check_len("global_avgpool_bwd", "dy", dy, nc)?;
        check_len("global_avgpool_bwd", "dx", dx, nc * hw)?;
        if nc * hw == 0 {
            return Ok(());
        }
        let f = self.function("pooling.cu", "global_avgpool", Dir::Bwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(dy).arg(dx).arg(&nc).arg(&hw);
        // SAFETY: arguments match global_avgpool_bwd_f32(const float*, float*, size_t,
        // size_t); lengths checked.
        unsafe { b.launch(elem_cfg(nc * hw)) }?;
        Ok(())
    }

    /// Max pooling: y = the maximum of each window, argmax = its index h*W + w in the
    /// plane (ties to the first in row-major order, NaN wins: `nn::pool`).
    /// x: (N, C, H, W) -> y, argmax: (N, C, OH, OW)
    pub fn maxpool2d_fwd(
        &self,
        x: &impl DevIn,
        y: &mut impl DevOut,
        argmax: &mut CudaSlice<u32>,
        g: &ConvGeom,
    ) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        let op = "maxpool2d_fwd";
        let a = Self::conv_args(g, op)?;
        check_len(op, "x", x, g.x_len())?;
        check_len(op, "y", y, g.pooled_len())?;
        check_len(op, "argmax", argmax, g.pooled_len())?;
        if g.pooled_len() == 0 {
            return Ok(());
        }
        let f = self.function("pooling.cu", "maxpool2d", Dir::Fwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(x).arg(y).arg(argmax);
        for v in &a {
            b.arg(v);
        }
        // SAFETY: arguments match maxpool2d_fwd_f32(const float*, float*, unsigned*,
        // 12 x int); x, y and argmax have the lengths the geometry implies (checked), and
        // the kernel reads x only inside the plane (the window clipped to 0..H, 0..W) and
        // writes y and argmax below N*C*OH*OW.
        unsafe { b.launch(elem_cfg(g.pooled_len())) }?;
        Ok(())
    }

    /// Backward of [`Gpu::maxpool2d_fwd`]: `dx[i]` = sum of dy over the outputs whose
    /// argmax is i, in row-major output order; dx is written.
    /// dy, argmax: (N, C, OH, OW) -> dx: (N, C, H, W)
    pub fn maxpool2d_bwd(
        &self,
        dy: &impl DevIn,
        argmax: &CudaSlice<u32>,
        dx: &mut impl DevOut,
        g: &ConvGeom,
    ) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        let op = "maxpool2d_bwd";
        let a = Self::conv_args(g, op)?;
        check_len(op, "dy", dy, g.pooled_len())?;
        check_len(op, "argmax", argmax, g.pooled_len())?;
        check_len(op, "dx", dx, g.x_len())?;
        if g.x_len() == 0 {
            return Ok(());
        }
        let f = self.function("pooling.cu", "maxpool2d", Dir::Bwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(dy).arg(argmax).arg(dx);
        for v in &a {
            b.arg(v);
        }
        // SAFETY: arguments match maxpool2d_bwd_f32(const float*, const unsigned*, float*,
        // 12 x int); lengths checked; the kernel reads dy and argmax only at oy < OH,
        // ox < OW of its own plane and writes dx below N*C*H*W, one element per thread.
        unsafe { b.launch(elem_cfg(g.x_len())) }?;
        Ok(())
    }

    // ---- softmax_xent.cu ------------------------------------------------------------

    /// logits: (N, K), labels: (N) -> loss: (N), dlogits: (N, K) = softmax - onehot
    /// (gradient of the summed loss), correct: (N) in {0, 1}.
    pub fn softmax_xent_fwd(
        &self,
        logits: &impl DevIn,
        labels: &CudaSlice<u32>,
        loss: &mut impl DevOut,
        dlogits: &mut impl DevOut,
        correct: &mut CudaSlice<u32>,
        k: usize,
    ) -> Result<()> {
        let logits = &logits.view();
        let loss = &mut loss.view_mut();
        let dlogits = &mut dlogits.view_mut();
        let op = "softmax_xent_fwd";
        let n = labels.len();
        if k == 0 {
            return Err(Error::shape(op, "K (number of classes) must be positive"));
        }
        check_len(op, "logits", logits, n * k)?;
        check_len(op, "dlogits", dlogits, n * k)?;
        check_len(op, "loss", loss, n)?;
        check_len(op, "correct", correct, n)?;
        if n == 0 {
            return Ok(());
        }
        let ki = dim(op, "K", k)?;
        let f = self.function("softmax_xent.cu", "softmax_xent", Dir::Fwd)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(logits).arg(labels).arg(loss).arg(dlogits).arg(correct).arg(&n).arg(&ki);
        // SAFETY: arguments match softmax_xent_fwd_f32(const float*, const unsigned*,
        // float*, float*, unsigned*, size_t, int); lengths checked; out-of-range labels
        // are never used as an index by the kernel.
        unsafe { b.launch(elem_cfg(n)) }?;
        Ok(())
    }

    // ---- optim.cu -------------------------------------------------------------------

    /// One optimiser step on one run of the flat parameters, as the CPU optimiser
    /// (`optim::Optimizer::update`) computes it, from the step's scalars made on the host
    /// by `OptimizerConfig::scalars`. SGD uses `m` as its momentum buffer (written even
    /// without momentum) and ignores `v`. p, grad, m, v: (n)
    pub fn optimizer_step(
        &self,
        config: &OptimizerConfig,
        s: &StepScalars,
        p: &mut impl DevOut,
        grad: &impl DevIn,
        m: &mut impl DevOut,
        v: &mut impl DevOut,
    ) -> Result<()> {
        let p = &mut p.view_mut();
        let grad = &grad.view();
        let m = &mut m.view_mut();
        let n = p.len();
        check_len("optimizer_step", "grad", grad, n)?;
        check_len("optimizer_step", "m", m, n)?;
        if s.t == 0 {
            return Err(Error::config("optimizer step", "t is 1-based; got 0"));
        }
        if n == 0 {
            return Ok(());
        }
        match *config {
            OptimizerConfig::Sgd { momentum, weight_decay, .. } => {
                let first = i32::from(s.t == 1);
                let f = self.function("optim.cu", "sgd_step", Dir::Plain)?;
                let mut b = self.stream.launch_builder(&f);
                b.arg(p).arg(grad).arg(m).arg(&s.step_size).arg(&momentum).arg(&weight_decay);
                b.arg(&s.grad_divisor).arg(&first).arg(&n);
                // SAFETY: arguments match sgd_step_f32(float* p, const float* grad, float*
                // buf, float step_size, float momentum, float weight_decay, float
                // grad_divisor, int first, size_t n); p, grad and buf hold n floats (checked).
                unsafe { b.launch(elem_cfg(n)) }?;
            }
            OptimizerConfig::Adam { beta1, beta2, eps, weight_decay, .. } => {
                let v = &mut v.view_mut();
                check_len("optimizer_step", "v", v, n)?;
                let f = self.function("optim.cu", "adam_step", Dir::Plain)?;
                let mut b = self.stream.launch_builder(&f);
                b.arg(p).arg(grad).arg(m).arg(v);
                b.arg(&s.step_size).arg(&beta1).arg(&beta2).arg(&eps).arg(&weight_decay);
                b.arg(&s.grad_divisor).arg(&s.bc2_sqrt).arg(&n);
                // SAFETY: arguments match adam_step_f32(float* p, const float* grad, float*
                // m, float* v, float step_size, float beta1, float beta2, float eps, float
                // weight_decay, float grad_divisor, float bc2_sqrt, size_t n); the four
                // buffers hold n floats (checked).
                unsafe { b.launch(elem_cfg(n)) }?;
            }
        }
        Ok(())
    }

    // ---- reduce.cu ------------------------------------------------------------------

    /// `dst = scale * (src[0] + ... + src[K-1])`, left to right. src: (K, n) -> dst: (n)
    pub fn reduce_sum(&self, src: &impl DevIn, dst: &mut impl DevOut, k: usize, scale: f32) -> Result<()> {
        let src = &src.view();
        let dst = &mut dst.view_mut();
        let n = dst.len();
        check_len("reduce_sum", "src", src, k * n)?;
        if n == 0 {
            return Ok(());
        }
        let ki = dim("reduce_sum", "K", k)?;
        let f = self.function("reduce.cu", "reduce_sum", Dir::Plain)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(src).arg(dst).arg(&ki).arg(&scale).arg(&n);
        // SAFETY: arguments match reduce_sum_f32(const float*, float*, int, float, size_t);
        // src holds K*n floats and dst n (checked); two CudaSlices never alias.
        unsafe { b.launch(elem_cfg(n)) }?;
        Ok(())
    }

    // ---- codec.cu -------------------------------------------------------------------

    /// Encodes slots `0..k` of `src` (slot j at `j·stride`, `g.width()` values each) into
    /// wires `0..k` of `wires` (wire j at `j·g.bytes()`), as `exchange::codec` encodes.
    /// src: (k, stride) f32 (the last slot may end at its width) -> wires: (k, bytes)
    pub fn wire_encode(
        &self,
        src: &impl DevIn,
        stride: usize,
        k: usize,
        wires: &mut CudaViewMut<'_, u8>,
        g: &WireGeom,
    ) -> Result<()> {
        let src = &src.view();
        let op = "wire_encode";
        if k == 0 || g.width() == 0 {
            return Ok(());
        }
        if stride < g.width() || src.len() < (k - 1) * stride + g.width() {
            return Err(Error::shape(
                op,
                format!("src has {} values for {k} slots of {} every {stride}", src.len(), g.width()),
            ));
        }
        check_len(op, "wires", wires, k * g.bytes())?;
        let grid_y = u32::try_from(k)
            .ok()
            .filter(|&y| y <= 65_535)
            .ok_or_else(|| Error::shape(op, format!("{k} slots: a launch's grid holds at most 65535 in y")))?;
        let blocks = u32::try_from(g.blocks()).map_err(|_| Error::shape(op, "too many blocks of 1024 values"))?;
        let f = self.function("codec.cu", "wire_encode", Dir::Plain)?;
        let mut b = self.stream.launch_builder(&f);
        let (format, bytes, exps_at, raw_at) = (g.format(), g.bytes(), g.exps_at(), g.raw_at());
        b.arg(src).arg(wires).arg(&format).arg(&g.encoded).arg(&g.raw).arg(&stride).arg(&bytes);
        b.arg(&exps_at).arg(&raw_at);
        let cfg = LaunchConfig { grid_dim: (blocks, grid_y, 1), block_dim: (CODEC_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: arguments match wire_encode_f32(const float* src, unsigned char* wires,
        // int format, size_t encoded, size_t raw, size_t src_stride, size_t wire_bytes,
        // size_t exps_at, size_t raw_at); slot j (j < k = grid.y) reads src[j·stride ..
        // j·stride + encoded + raw], inside src (checked), and writes wire j's codes,
        // exponents and raw values, all below (j + 1)·bytes (WireGeom's layout);
        // CODEC_THREADS threads a block as the kernel's shared array needs.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The codec's sum of wires `0..r` of `wires` (in logical-replica order) into `out`:
    /// each decoded, added in the canonical tree in f32, encoded (`Codec::reduce`).
    /// wires: (r, bytes) -> out: (bytes)
    pub fn wire_reduce(
        &self,
        wires: &CudaView<'_, u8>,
        r: usize,
        out: &mut CudaViewMut<'_, u8>,
        g: &WireGeom,
    ) -> Result<()> {
        let op = "wire_reduce";
        check_len(op, "wires", wires, r * g.bytes())?;
        check_len(op, "out", out, g.bytes())?;
        if g.width() == 0 {
            return Ok(());
        }
        if r == 0 {
            return Err(Error::shape(op, "a sum of no wire"));
        }
        let ri = dim(op, "R", r)?;
        let blocks = u32::try_from(g.blocks()).map_err(|_| Error::shape(op, "too many blocks of 1024 values"))?;
        let f = self.function("codec.cu", "wire_reduce", Dir::Plain)?;
        let mut b = self.stream.launch_builder(&f);
        let (format, bytes, exps_at, raw_at) = (g.format(), g.bytes(), g.exps_at(), g.raw_at());
        b.arg(wires).arg(out).arg(&ri).arg(&format).arg(&g.encoded).arg(&g.raw).arg(&bytes);
        b.arg(&exps_at).arg(&raw_at);
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (CODEC_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: arguments match wire_reduce_f32(const unsigned char* wires, unsigned
        // char* out, int r, int format, size_t encoded, size_t raw, size_t wire_bytes,
        // size_t exps_at, size_t raw_at); wires holds r wires and out one (checked), and
        // the kernel touches each only inside WireGeom's layout.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// A wire decoded to f32 (`Codec::decode`). wire: (bytes) -> dst: (encoded + raw)
    pub fn wire_decode(&self, wire: &CudaView<'_, u8>, dst: &mut impl DevOut, g: &WireGeom) -> Result<()> {
        let dst = &mut dst.view_mut();
        let op = "wire_decode";
        check_len(op, "wire", wire, g.bytes())?;
        check_len(op, "dst", dst, g.width())?;
        if g.width() == 0 {
            return Ok(());
        }
        let f = self.function("codec.cu", "wire_decode", Dir::Plain)?;
        let mut b = self.stream.launch_builder(&f);
        let (format, exps_at, raw_at) = (g.format(), g.exps_at(), g.raw_at());
        b.arg(wire).arg(dst).arg(&format).arg(&g.encoded).arg(&g.raw).arg(&exps_at).arg(&raw_at);
        // SAFETY: arguments match wire_decode_f32(const unsigned char* wire, float* dst,
        // int format, size_t encoded, size_t raw, size_t exps_at, size_t raw_at); dst
        // holds encoded + raw floats and wire one wire (checked).
        unsafe { b.launch(elem_cfg(g.width())) }?;
        Ok(())
    }

    // ---- dropout.cu -----------------------------------------------------------------

    /// Inverted dropout; the mask of element i is the hash of (key, key.first + i). x, y: (n)
    pub fn dropout_fwd(&self, x: &impl DevIn, y: &mut impl DevOut, rate: f32, key: DropoutKey) -> Result<()> {
        let x = &x.view();
        let y = &mut y.view_mut();
        self.dropout(Dir::Fwd, x, y, rate, key)
    }

    /// Backward of [`Gpu::dropout_fwd`] with the same `rate` and `key`. dy, dx: (n)
    pub fn dropout_bwd(&self, dy: &impl DevIn, dx: &mut impl DevOut, rate: f32, key: DropoutKey) -> Result<()> {
        let dy = &dy.view();
        let dx = &mut dx.view_mut();
        self.dropout(Dir::Bwd, dy, dx, rate, key)
    }

    fn dropout(&self, dir: Dir, src: &impl DevIn, dst: &mut impl DevOut, rate: f32, key: DropoutKey) -> Result<()> {
        let src = &src.view();
        let dst = &mut dst.view_mut();
        let n = src.len();
        check_len("dropout", "output", dst, n)?;
        if !(0.0..=1.0).contains(&rate) {
            return Err(Error::config("dropout rate", format!("{rate} is outside [0, 1]")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function("dropout.cu", "dropout", dir)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(src).arg(dst).arg(&rate).arg(&key.seed).arg(&key.step).arg(&key.replica).arg(&key.layer);
        b.arg(&key.first).arg(&n);
        // SAFETY: arguments match dropout_{fwd,bwd}_f32(const float*, float*, float,
        // 5 x unsigned long long, size_t); both buffers hold n floats (checked).
        unsafe { b.launch(elem_cfg(n)) }?;
        Ok(())
    }
}

/// What a dropout mask is a function of (DESIGN.md: randomness derives from the seed,
/// the step and the logical replica), plus the layer's index in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropoutKey {
    pub seed: u64,
    pub step: u64,
    pub replica: u64,
    pub layer: u64,
    /// Mask index of the buffer's first element (within its logical replica's shard: a
    /// later micro-batch of an accumulated step starts past 0).
    pub first: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wire_lays_out_codes_exponents_and_floats_on_aligned_starts() {
        // The convnet's slot: its gradient encoded, its BatchNorm buffers raw.
        let model = crate::models::convnet(crate::models::ConvnetOptions::default()).unwrap();
        let (p, b) = (model.params_len(), model.buffers_len());
        for compression in [Compression::Bf16, Compression::Fp16] {
            let codec = Codec::new(compression, p).unwrap();
            let g = WireGeom::new(&codec, p + b);
            assert_eq!((g.encoded, g.raw, g.width()), (p, b, p + b));
            // What crosses is the codec's count, padding aside.
            assert_eq!(g.payload(), codec.wire(0..p + b).bytes(), "{compression:?}");
            let exps = if compression == Compression::Fp16 { p.div_ceil(BLOCK) } else { 0 };
            assert_eq!((g.exps_at(), g.exponents()), (2 * p, exps));
            assert!(g.raw_at() >= g.exps_at() + exps && g.raw_at() % 256 == 0 && g.raw_at() - (2 * p + exps) < 256);
            assert!(g.bytes() >= g.raw_at() + 4 * b && g.bytes() % 256 == 0 && g.bytes() - (g.raw_at() + 4 * b) < 256);
            assert_eq!(g.blocks(), p.div_ceil(BLOCK) + b.div_ceil(BLOCK));
        }
        // A slot shorter than the encoded length is all codes; an empty one still spaces
        // wires 256 bytes apart.
        let codec = Codec::new(Compression::Fp16, 3000).unwrap();
        let g = WireGeom::new(&codec, 1000);
        assert_eq!((g.encoded, g.raw, g.exponents(), g.raw_at(), g.bytes()), (1000, 0, 1, 2048, 2048));
        assert_eq!(WireGeom::new(&codec, 0).bytes(), 256);
    }
}
