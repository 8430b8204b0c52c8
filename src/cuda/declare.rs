//! How a kernel of `kernels/` is declared: its name, its file and its typed parameter
//! list, written once, and what the declaration becomes.
//!
//! Owns: the ONE naming helper [`kernel_name`] and [`Dir`], the parameter kinds
//! ([`Kind`]: what a parameter is in Rust and which C++ type it is), the table types
//! ([`Kernel`], [`KernelFile`]), the [`Launcher`] a declared launch runs on, and the
//! `kernels!` macro that turns one list of declarations into both
//! - a typed `unsafe fn` per kernel, whose Rust parameters come from the declared kinds
//!   and which pushes them in the declared order, so the compiler checks every call
//!   site's order and types against the declaration; and
//! - a [`Kernel`] entry per kernel (file, name, parameter letters), gathered into its
//!   file's [`KernelFile`], which NVRTC compiles and the host-run tests hold to each
//!   compiled kernel's C++ signature (`cuda::host`), so a declaration that disagrees with
//!   its `.cu` fails a test on a machine without a GPU.
//!
//! The declarations themselves live with their owners (an op's `gpu.rs`, the optimiser's,
//! the codec's, [`super::buffers`]), beside the checked wrappers that call the typed
//! launches (lengths first). This file imports nothing of the crate but its `Result`, so
//! every other part of `cuda` may build on it.

use cudarc::driver::{CudaFunction, CudaStream};

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

/// What one declared parameter is: the Rust type its launch takes and the C++ type of
/// the kernel's parameter, as src/cuda/host/cuda_host.h's `type_code` letters it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `&CudaView<f32>` → `const float*` (r).
    In,
    /// `&mut CudaViewMut<f32>` → `float*` (w).
    Out,
    /// `Option<&CudaView<f32>>` → `const float*` (r), a 64-bit 0 (NULL) when None.
    OptIn,
    /// `Option<&mut CudaViewMut<f32>>` → `float*` (w), a 64-bit 0 (NULL) when None.
    OptOut,
    /// `&CudaView<u32>` → `const unsigned*` (R).
    InU32,
    /// `&mut CudaViewMut<u32>` → `unsigned*` (W).
    OutU32,
    /// `&CudaView<u8>` → `const unsigned char*` (b).
    InU8,
    /// `&mut CudaViewMut<u8>` → `unsigned char*` (B).
    OutU8,
    /// `&CudaView<f64>` → `const double*` (d).
    InF64,
    /// `&mut CudaViewMut<f64>` → `double*` (D).
    OutF64,
    /// `i32` → `int` (i).
    I32,
    /// `f32` → `float` (f).
    F32,
    /// `f64` → `double` (g).
    F64,
    /// `usize` → `size_t` (z).
    Size,
    /// `u64` → `unsigned long long` (z).
    U64,
    /// `&[i32; 12]` → 12 × `int` (12 × i): a window's N, C, H, W, KH, KW, SH, SW, PT, PL,
    /// OH, OW, in that order (`launch::WindowGeom::launch_args`).
    Geom,
}

impl Kind {
    /// The cuda_host.h letters of the C++ parameters this kind fills, in order.
    pub const fn letters(self) -> &'static str {
        match self {
            Kind::In | Kind::OptIn => "r",
            Kind::Out | Kind::OptOut => "w",
            Kind::InU32 => "R",
            Kind::OutU32 => "W",
            Kind::InU8 => "b",
            Kind::OutU8 => "B",
            Kind::InF64 => "d",
            Kind::OutF64 => "D",
            Kind::I32 => "i",
            Kind::F32 => "f",
            Kind::F64 => "g",
            Kind::Size | Kind::U64 => "z",
            Kind::Geom => "iiiiiiiiiiii",
        }
    }
}

/// One declared kernel: `<op>_<dir>_f32` of kernel file `file` (whose text is `source`),
/// with its parameters (name, kind) in the kernel's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernel {
    pub file: &'static str,
    pub source: &'static str,
    pub op: &'static str,
    pub dir: Dir,
    pub params: &'static [(&'static str, Kind)],
}

impl Kernel {
    /// The `extern "C"` name, from [`kernel_name`] (all float32 for now).
    pub fn name(&self) -> String {
        kernel_name(self.op, self.dir, "f32")
    }

    /// The parameter letters the kernel's C++ signature must have (cuda_host.h).
    pub fn letters(&self) -> String {
        self.params.iter().map(|&(_, kind)| kind.letters()).collect()
    }

    /// `relu_fwd_f32(x: In, y: Out, n: Size)`, for messages.
    pub fn describe(&self) -> String {
        let params: Vec<String> = self.params.iter().map(|(name, kind)| format!("{name}: {kind:?}")).collect();
        format!("{}({})", self.name(), params.join(", "))
    }
}

/// One file of `kernels/`: its name, its source, and every kernel declared in it.
#[derive(Debug, Clone, Copy)]
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [Kernel],
}

impl KernelFile {
    /// The `extern "C"` names this file must define, from [`kernel_name`].
    pub fn kernel_names(&self, dtype: &str) -> Vec<String> {
        self.kernels.iter().map(|k| kernel_name(k.op, k.dir, dtype)).collect()
    }
}

/// What a declared launch runs on: a stream to queue on and the loaded function of a
/// declaration (`launch::Gpu`, which loads each file once and caches each function).
pub trait Launcher {
    /// The stream the launch is queued on.
    fn stream(&self) -> &std::sync::Arc<CudaStream>;
    /// The function of `kernel`, its file compiled and loaded on first use.
    fn function(&self, kernel: &'static Kernel) -> crate::Result<CudaFunction>;
}

/// What an absent optional buffer is pushed as: a 64-bit 0, which the kernels test for
/// NULL before use.
pub static NULL: u64 = 0;

/// Declares one kernel file and its kernels, once, in the module of their owner (an op's
/// `gpu.rs`, the optimiser's, the exchange's codec):
///
/// ```text
/// kernels! {
///     "relu.cu" {
///         relu {
///             fwd(x: In, y: Out, n: Size);
///             bwd(x: In, dy: In, dx: Out, n: Size);
///         }
///     }
/// }
/// ```
///
/// An op `op { ... }` holds its directions side by side, each `fwd`, `bwd` or `plain`
/// ([`Dir`]) with the kernel's parameters as `name: Kind`. It expands, in the invoking
/// module, to `pub mod op { ... }` with, per direction, a `const` [`Kernel`] (`FWD`, `BWD`,
/// `PLAIN`) and a typed launch `unsafe fn fwd(gpu: &impl Launcher, cfg: LaunchConfig,
/// x: &CudaView<'_, f32>, ...)`, and to `pub const KERNELS: KernelFile`, the file with its
/// source (`include_str!` of `kernels/common.cuh` then of `kernels/<file>`, so the binary
/// needs no source tree at run time) and its kernels, in declaration order.
macro_rules! kernels {
    (
        $file:literal {
            $( $op:ident { $( $dir:ident ( $( $param:ident : $kind:ident ),* $(,)? ) ; )+ } )+
        }
    ) => {
        /// The text of this module's kernel file, behind what every kernel file is compiled
        /// with (kernels/common.cuh).
        const SOURCE: &str = concat!(
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/common.cuh")),
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/", $file))
        );

        $(
            #[doc = concat!("The `", stringify!($op), "` kernels of kernels/", $file, ".")]
            pub mod $op {
                $(
                    $crate::cuda::declare::kernel!($file, super::SOURCE, $op, $dir, ($($param: $kind),*));
                )+
            }
        )+

        #[doc = concat!("kernels/", $file, " with the kernels declared in it.")]
        // What an op's entry names (`LayerType::kernels`); the other files' only the tests do.
        #[cfg_attr(not(test), allow(dead_code))]
        pub const KERNELS: $crate::cuda::declare::KernelFile = $crate::cuda::declare::KernelFile {
            name: $file,
            source: SOURCE,
            kernels: &[$($($crate::cuda::declare::kernel_const!($op, $dir)),+),+],
        };
    };
}
pub(crate) use kernels;

/// One declared kernel's `const` and typed launch (see `kernels!`).
macro_rules! kernel {
    ($file:literal, $source:path, $op:ident, fwd, $params:tt) => {
        $crate::cuda::declare::kernel!(@item $file, $source, $op, fwd, FWD, Fwd, $params);
    };
    ($file:literal, $source:path, $op:ident, bwd, $params:tt) => {
        $crate::cuda::declare::kernel!(@item $file, $source, $op, bwd, BWD, Bwd, $params);
    };
    ($file:literal, $source:path, $op:ident, plain, $params:tt) => {
        $crate::cuda::declare::kernel!(@item $file, $source, $op, plain, PLAIN, Plain, $params);
    };
    (@item $file:literal, $source:path, $op:ident, $fn:ident, $const:ident, $dir:ident, ($($param:ident: $kind:ident),*)) => {
        #[doc = concat!("The declaration of `", stringify!($op), "`'s ", stringify!($fn), " kernel.")]
        pub const $const: $crate::cuda::declare::Kernel = $crate::cuda::declare::Kernel {
            file: $file,
            source: $source,
            op: stringify!($op),
            dir: $crate::cuda::declare::Dir::$dir,
            params: &[$((stringify!($param), $crate::cuda::declare::Kind::$kind)),*],
        };

        #[doc = concat!(
            "Queues `", stringify!($op), "`'s ", stringify!($fn), " kernel on `gpu`'s stream with `cfg`, ",
            "the arguments pushed in the declared order: ", $("`", stringify!($param), ": ", stringify!($kind), "` "),*
        )]
        ///
        /// # Safety
        ///
        /// The caller guarantees what the kernel assumes of its arguments: every buffer
        /// holds at least the elements the kernel indexes for the sizes given, `cfg` is
        /// the launch shape the kernel is written for, and no buffer it writes aliases
        /// another argument.
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $fn(
            gpu: &impl $crate::cuda::declare::Launcher,
            cfg: ::cudarc::driver::LaunchConfig,
            $($param: $crate::cuda::declare::kind_type!($kind)),*
        ) -> $crate::Result<()> {
            #[allow(unused_imports)]
            use ::cudarc::driver::PushKernelArg as _;
            let f = gpu.function(&$const)?;
            let mut b = gpu.stream().launch_builder(&f);
            $($crate::cuda::declare::push_arg!(b, $kind, $param);)*
            // SAFETY: the arguments are pushed in the declared order with the declared
            // types (the host-run tests hold the declaration to the kernel's C++ signature:
            // cuda::host); the caller guarantees the rest (# Safety above).
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    };
}
pub(crate) use kernel;

/// The `const` of one declared direction: `op::FWD`, `BWD` or `PLAIN`.
macro_rules! kernel_const {
    ($op:ident, fwd) => {
        $op::FWD
    };
    ($op:ident, bwd) => {
        $op::BWD
    };
    ($op:ident, plain) => {
        $op::PLAIN
    };
}
pub(crate) use kernel_const;

/// The Rust type of a parameter of kind `$kind` ([`Kind`]).
macro_rules! kind_type {
    (In) => { &::cudarc::driver::CudaView<'_, f32> };
    (Out) => { &mut ::cudarc::driver::CudaViewMut<'_, f32> };
    (OptIn) => { Option<&::cudarc::driver::CudaView<'_, f32>> };
    (OptOut) => { Option<&mut ::cudarc::driver::CudaViewMut<'_, f32>> };
    (InU32) => { &::cudarc::driver::CudaView<'_, u32> };
    (OutU32) => { &mut ::cudarc::driver::CudaViewMut<'_, u32> };
    (InU8) => { &::cudarc::driver::CudaView<'_, u8> };
    (OutU8) => { &mut ::cudarc::driver::CudaViewMut<'_, u8> };
    (InF64) => { &::cudarc::driver::CudaView<'_, f64> };
    (OutF64) => { &mut ::cudarc::driver::CudaViewMut<'_, f64> };
    (I32) => { i32 };
    (F32) => { f32 };
    (F64) => { f64 };
    (Size) => { usize };
    (U64) => { u64 };
    (Geom) => { &[i32; 12] };
}
pub(crate) use kind_type;

/// Pushes parameter `$p` of kind `$kind` onto launch builder `$b`: a buffer as its
/// device pointer, an absent optional one as [`NULL`], a value by reference, a geometry
/// as its 12 ints.
macro_rules! push_arg {
    ($b:ident, OptIn, $p:ident) => {
        match $p {
            Some(v) => $b.arg(v),
            None => $b.arg(&$crate::cuda::declare::NULL),
        };
    };
    ($b:ident, OptOut, $p:ident) => {
        match $p {
            Some(v) => $b.arg(v),
            None => $b.arg(&$crate::cuda::declare::NULL),
        };
    };
    ($b:ident, Geom, $p:ident) => {
        for v in $p {
            $b.arg(v);
        }
    };
    ($b:ident, I32, $p:ident) => {
        $b.arg(&$p);
    };
    ($b:ident, F32, $p:ident) => {
        $b.arg(&$p);
    };
    ($b:ident, F64, $p:ident) => {
        $b.arg(&$p);
    };
    ($b:ident, Size, $p:ident) => {
        $b.arg(&$p);
    };
    ($b:ident, U64, $p:ident) => {
        $b.arg(&$p);
    };
    ($b:ident, $buffer:ident, $p:ident) => {
        $b.arg($p);
    };
}
pub(crate) use push_arg;
