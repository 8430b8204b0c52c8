//! The optimiser step on a GPU: the launches of kernels/optim.cu — the update of one run
//! of the flat parameters, from the same scalars the CPU optimiser uses, and the global
//! gradient norm that clipping scales it by.
//!
//! Owns: [`Gpu::optimizer_step`], which checks its buffers and picks SGD's or Adam's
//! kernel by the configuration (AdamW is Adam's kernel with the decoupled `shrink`), then
//! queues its typed launch (declared below, beside them);
//! [`Gpu::grad_norm`] and [`Gpu::clip_factor`], the norm in [`super::GradNorm`]'s
//! association and `clip_grad_norm_`'s factor, left on the device for the update to read
//! (no wait on the host). It lives here rather than in `cuda::launch` because it reads
//! [`OptimizerConfig`] and [`StepScalars`]: `cuda` imports nothing of the optimiser, the
//! optimiser builds on `cuda`. The formulas are optim.cu's, held to
//! [`super::Optimizer::update`] and [`super::GradNorm`] by the host check at the end
//! of this file (bit for bit), which also holds the GPU to PyTorch's rules where one is
//! present.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use super::{norm_partials, MomentumKind, OptimizerConfig, StepScalars, NORM_LANES};
use crate::cuda::launch::{check_len, elem_cfg, DevIn, DevOut, Gpu};
use crate::{Error, Result};

crate::cuda::declare::kernels! {
    "optim.cu" {
        sgd_step {
            plain(
                p: Out, grad: In, buf: Out, clip: OptIn, step_size: F32, momentum: F32, weight_decay: F32,
                grad_divisor: F32, first: I32, nesterov: I32, n: Size,
            );
        }
        adam_step {
            plain(
                p: Out, grad: In, m: Out, v: Out, clip: OptIn, step_size: F32, beta1: F32, beta2: F32, eps: F32,
                weight_decay: F32, shrink: F32, grad_divisor: F32, bc2_sqrt: F32, n: Size,
            );
        }
        grad_norm { plain(grad: In, partials: OutF64, grad_divisor: F32, n: Size); }
        clip_factor { plain(partials: InF64, factor: Out, max_norm: F32, parts: Size); }
    }
}

/// Cap on the blocks of the norm's grid-stride loop over chunks.
const MAX_NORM_BLOCKS: usize = 65_535;

impl Gpu {
    /// One optimiser step on one run of the flat parameters, as the CPU optimiser
    /// (`optim::Optimizer::update`) computes it, from the step's scalars made on the host
    /// by `OptimizerConfig::scalars` (with the run's weight decay) and, when clipping,
    /// the factor [`Gpu::clip_factor`] left in `clip` (None: no clipping; the scalars'
    /// host-side `clip` is not read here). SGD uses `m` as its momentum buffer (written
    /// even without momentum) and ignores `v`. p, grad, m, v: (n); clip: (1)
    #[allow(clippy::too_many_arguments)]
    pub fn optimizer_step(
        &self,
        config: &OptimizerConfig,
        s: &StepScalars,
        p: &mut impl DevOut,
        grad: &impl DevIn,
        m: &mut impl DevOut,
        v: &mut impl DevOut,
        clip: Option<&CudaView<'_, f32>>,
    ) -> Result<()> {
        let p = &mut p.view_mut();
        let grad = &grad.view();
        let m = &mut m.view_mut();
        let n = p.len();
        check_len("optimizer_step", "grad", grad, n)?;
        check_len("optimizer_step", "m", m, n)?;
        if let Some(c) = clip {
            check_len("optimizer_step", "clip", c, 1)?;
        }
        if s.t == 0 {
            return Err(Error::config("optimizer step", "t is 1-based; got 0"));
        }
        if n == 0 {
            return Ok(());
        }
        match *config {
            OptimizerConfig::Sgd { momentum, momentum_kind, .. } => {
                let first = i32::from(s.t == 1);
                let nesterov = i32::from(momentum_kind == MomentumKind::Nesterov);
                // SAFETY: sgd_step_f32(float* p, const float* grad, float* buf, const float*
                // clip, float step_size, float momentum, float weight_decay, float
                // grad_divisor, int first, int nesterov, size_t n); p, grad and buf hold n
                // floats and clip, when given, one (checked); NULL clip is tested before use.
                unsafe {
                    sgd_step::plain(
                        self,
                        elem_cfg(n),
                        p,
                        grad,
                        m,
                        clip,
                        s.step_size,
                        momentum,
                        s.weight_decay,
                        s.grad_divisor,
                        first,
                        nesterov,
                        n,
                    )
                }
            }
            OptimizerConfig::Adam { beta1, beta2, eps, .. } | OptimizerConfig::AdamW { beta1, beta2, eps, .. } => {
                let v = &mut v.view_mut();
                check_len("optimizer_step", "v", v, n)?;
                // SAFETY: adam_step_f32(float* p, const float* grad, float* m, float* v,
                // const float* clip, float step_size, float beta1, float beta2, float eps,
                // float weight_decay, float shrink, float grad_divisor, float bc2_sqrt,
                // size_t n); the four buffers hold n floats and clip, when given, one
                // (checked); NULL clip is tested before use.
                unsafe {
                    adam_step::plain(
                        self,
                        elem_cfg(n),
                        p,
                        grad,
                        m,
                        v,
                        clip,
                        s.step_size,
                        beta1,
                        beta2,
                        eps,
                        s.weight_decay,
                        s.shrink,
                        s.grad_divisor,
                        s.bc2_sqrt,
                        n,
                    )
                }
            }
        }
    }

    /// The partial sums of squares of `grad / grad_divisor`, one per chunk of
    /// [`super::NORM_CHUNK`] values, in [`super::GradNorm`]'s association. A piece of the sum
    /// that starts at chunk k writes `partials` from k: its offset must be a multiple of
    /// NORM_CHUNK. grad: (n) -> partials: (ceil(n / NORM_CHUNK))
    pub fn grad_norm(&self, grad: &impl DevIn, partials: &mut CudaViewMut<'_, f64>, grad_divisor: f32) -> Result<()> {
        let grad = &grad.view();
        let n = grad.len();
        let chunks = norm_partials(n);
        check_len("grad_norm", "partials", partials, chunks)?;
        if n == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (chunks.min(MAX_NORM_BLOCKS) as u32, 1, 1),
            block_dim: (NORM_LANES as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: grad_norm_f32(const float* grad, double* partials, float grad_divisor,
        // size_t n); grad holds n floats and partials ceil(n / NORM_CHUNK) doubles
        // (checked); blocks of NORM_LANES = the kernel's NORM_THREADS threads, its shared
        // array's size.
        unsafe { grad_norm::plain(self, cfg, grad, partials, grad_divisor, n) }
    }

    /// `clip_grad_norm_`'s factor min(1, max_norm / (norm + 1e-6)) from the chunks' sums
    /// [`Gpu::grad_norm`] wrote, added in order, into `factor`, on the device.
    /// partials: (parts) -> factor: (1)
    pub fn clip_factor(&self, partials: &CudaView<'_, f64>, factor: &mut impl DevOut, max_norm: f32) -> Result<()> {
        let factor = &mut factor.view_mut();
        check_len("clip_factor", "factor", factor, 1)?;
        let parts = partials.len();
        // SAFETY: clip_factor_f32(const double* partials, float* factor, float max_norm,
        // size_t parts); partials holds `parts` doubles, factor one float (checked); one
        // thread does the work.
        unsafe { clip_factor::plain(self, elem_cfg(1), partials, factor, max_norm, parts) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cuda::host::{
        checker_or_skip, elem_cfg, Cfg, Checker, In, InF64, Null, Out, OutF64, F32, FEW, I32, U64,
    };
    use crate::optim::{clip_factor as cpu_clip_factor, DecayMask, DecayOn, GradNorm, Optimizer, NORM_CHUNK};
    use crate::testing::{assert_bits, assert_close, uniform};

    /// The launch shape of `Gpu::grad_norm` for `n` values (one block of NORM_LANES threads
    /// per chunk), then a grid of one block, which strides over every chunk.
    fn norm_cfgs(n: usize) -> [Cfg; 2] {
        let block = (NORM_LANES as u32, 1, 1);
        [Cfg { grid: (norm_partials(n) as u32, 1, 1), block }, Cfg { grid: (1, 1, 1), block }]
    }

    /// As `Gpu::grad_norm` then `Gpu::clip_factor`: the factor of the gradient sum `g` (÷ B)
    /// for `max_norm`, left on the "device".
    fn clip_factor_on_host(k: &Checker, cfg: Cfg, g: &[f32], batch: f32, max_norm: f32) -> f32 {
        let n = g.len();
        let mut partials = vec![0.0f64; norm_partials(n)];
        // As Gpu::grad_norm: grad, partials, grad_divisor, n.
        k.launch(&grad_norm::PLAIN, cfg, &mut [In(g), OutF64(&mut partials), F32(batch), U64(n as u64)]);
        let mut factor = [0.0f32];
        // As Gpu::clip_factor: partials, factor, max_norm, parts (one thread works).
        let parts = partials.len() as u64;
        k.launch(
            &clip_factor::PLAIN,
            elem_cfg(1),
            &mut [InF64(&partials), Out(&mut factor), F32(max_norm), U64(parts)],
        );
        factor[0]
    }

    /// SGD (plain, with classic and Nesterov momentum) and Adam and AdamW (with and without
    /// decay) over five steps against the CPU optimiser, bit for bit: the kernel (here
    /// without FMA contraction, as the CPU loop runs) and the CPU do the same f32
    /// operations in the same order on the same scalars (`optim::StepScalars`, made once on
    /// the host). On a GPU, contracted multiply-adds round once where this rounds twice
    /// (`sgd_and_adam_follow_pytorch_on_a_gpu` bounds it). A weight that decays and a bias
    /// that does not, each run with its own scalars; B = 32 and B = 3 (the kernel divides
    /// the raw gradient by B as the CPU does, so no batch size is special); unclipped, and
    /// clipped by the factor the norm kernels leave on the device, itself the CPU's.
    fn sgd_adam_and_adamw_equal_the_cpu_optimizer(k: &Checker) {
        let n = 1000;
        let steps = 5;
        let p0 = uniform(8, n);
        // A weight (2-D) at 0..600 that decays, a bias at 600..1000 that does not
        // (--weight-decay-on weights): the replicas cut each piece into runs, the kernel
        // takes each run's scalars.
        let decay = DecayMask::of_tensors([(0..600, 2), (600..1000, 1)], DecayOn::Weights);
        let classic = MomentumKind::Classic;
        for batch in [32.0f32, 3.0] {
            let grads: Vec<Vec<f32>> =
                (0..steps).map(|t| uniform(9 + t as u64, n).iter().map(|v| batch * v).collect()).collect();
            let configs = [
                OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, momentum_kind: classic, weight_decay: 1e-4 },
                OptimizerConfig::Sgd {
                    lr: 0.1,
                    momentum: 0.9,
                    momentum_kind: MomentumKind::Nesterov,
                    weight_decay: 5e-4,
                },
                OptimizerConfig::Sgd { lr: 0.05, momentum: 0.0, momentum_kind: classic, weight_decay: 0.0 },
                OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 1e-2 },
                OptimizerConfig::Adam { lr: 1e-2, beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 0.0 },
                OptimizerConfig::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 },
            ];
            // Without clipping, and clipped to a norm (about 0.58·sqrt(1000) ≈ 18 here)
            // that cuts every step.
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
                            s.clip = cpu_clip_factor(norm.norm(), c);
                            assert!(s.clip < 1.0, "the test clips");
                            let on_device = clip_factor_on_host(k, norm_cfgs(n)[t % 2], g, batch, c);
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
                                        &sgd_step::PLAIN,
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
                                        &adam_step::PLAIN,
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

    /// The gradient norm's kernels against `optim::GradNorm` and `optim::clip_factor`, bit
    /// for bit: two whole chunks and part of a third (as a resnet's sum is cut), clipped
    /// and not, under both launch shapes; and a piece that starts on a chunk writes the
    /// partials of the whole from that chunk on.
    fn the_gradient_norm_equals_the_cpu_norm(k: &Checker) {
        let n = 2 * NORM_CHUNK + 300;
        let batch = 24.0f32;
        let g: Vec<f32> = uniform(10, n).iter().map(|v| batch * v).collect();
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
                let factor = clip_factor_on_host(k, cfg, &g, batch, max_norm);
                assert_eq!(factor.to_bits(), cpu_clip_factor(norm, max_norm).to_bits(), "{cfg:?}, C = {max_norm}");
            }
            let mut whole = vec![0.0f64; norm_partials(n)];
            k.launch(&grad_norm::PLAIN, cfg, &mut [In(&g), OutF64(&mut whole), F32(batch), U64(n as u64)]);
            let mut second = vec![0.0f64; norm_partials(n - NORM_CHUNK)];
            let rest = &g[NORM_CHUNK..];
            k.launch(&grad_norm::PLAIN, cfg, &mut [In(rest), OutF64(&mut second), F32(batch), U64(rest.len() as u64)]);
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&whole[1..]), bits(&second), "{cfg:?}");
        }
    }

    /// kernels/optim.cu run on the host against the CPU optimiser and gradient norm.
    #[test]
    fn the_kernels_run_on_the_host_as_the_cpu_optimizer() {
        const TEST: &str = "the_kernels_run_on_the_host_as_the_cpu_optimizer";
        let Some(k) = checker_or_skip(TEST, crate::train::kernel_files) else { return };
        sgd_adam_and_adamw_equal_the_cpu_optimizer(&k);
        the_gradient_norm_equals_the_cpu_norm(&k);
        let file: std::collections::BTreeSet<String> = KERNELS.kernels.iter().map(|k| k.name()).collect();
        assert_eq!(k.ran(), file, "the kernels run here vs those of {}", KERNELS.name);
    }

    // ---- on a GPU ---------------------------------------------------------------------------

    fn up<T: cudarc::driver::DeviceRepr>(gpu: &Gpu, v: &[T]) -> cudarc::driver::CudaSlice<T> {
        gpu.stream().clone_htod(v).expect("host to device copy")
    }

    fn down<T: cudarc::driver::DeviceRepr + Default + Clone>(gpu: &Gpu, d: &cudarc::driver::CudaSlice<T>) -> Vec<T> {
        gpu.stream().clone_dtoh(d).expect("device to host copy")
    }

    fn f64s(v: &[f32]) -> Vec<f64> {
        v.iter().map(|&x| x as f64).collect()
    }

    /// SGD with momentum and Adam on a GPU against PyTorch's update rules, written out in
    /// f64 below (torch.optim.SGD and torch.optim.Adam's documented algorithms), over three
    /// steps.
    #[test]
    fn sgd_and_adam_follow_pytorch_on_a_gpu() {
        if !crate::ops::conformance::gpu_or_skip("sgd_and_adam_follow_pytorch_on_a_gpu") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let n = 257;
        let p0 = uniform(7, n);
        let grads: Vec<Vec<f32>> = (0..3).map(|t| uniform(70 + t, n).iter().map(|v| 32.0 * v).collect()).collect();
        let batch = 32.0f32; // the gradients are sums over a batch of 32

        // SGD: torch.optim.SGD(lr=0.1, momentum=0.9, weight_decay=1e-4), formulas in optim.cu.
        let sgd =
            OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, momentum_kind: MomentumKind::Classic, weight_decay: 1e-4 };
        let (lr, mu, wd) = (0.1f64, 0.9f32 as f64, 1e-4f32 as f64);
        let (mut p_d, mut buf_d, mut unused) = (up(&gpu, &p0), up(&gpu, &vec![0.0f32; n]), up(&gpu, &[0.0f32]));
        let (mut p, mut buf) = (f64s(&p0), vec![0.0f64; n]);
        for (t, gr) in grads.iter().enumerate() {
            let s = sgd.scalars(t as u64 + 1, 1.0, batch);
            gpu.optimizer_step(&sgd, &s, &mut p_d, &up(&gpu, gr), &mut buf_d, &mut unused, None).unwrap();
            for i in 0..n {
                let g = gr[i] as f64 / batch as f64 + wd * p[i];
                buf[i] = mu * buf[i] + g;
                p[i] -= lr * buf[i];
            }
        }
        // f32 steps against f64: 1e-5 relative plus 1e-6 absolute.
        assert_close("sgd p after 3 steps", &down(&gpu, &p_d), &p, 1e-5, 1e-6);
        assert_close("sgd momentum buffer", &down(&gpu, &buf_d), &buf, 1e-5, 1e-6);

        // Adam: torch.optim.Adam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2).
        let adam = OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 1e-2 };
        let (mut p_d, mut m_d, mut v_d) = (up(&gpu, &p0), up(&gpu, &vec![0.0f32; n]), up(&gpu, &vec![0.0f32; n]));
        let (mut p, mut m, mut v) = (f64s(&p0), vec![0.0f64; n], vec![0.0f64; n]);
        let (b1, b2, eps, wd) = (0.9f32 as f64, 0.999f32 as f64, 1e-8f32 as f64, 1e-2f32 as f64);
        for (t, gr) in grads.iter().enumerate() {
            let t = t as u64 + 1;
            let s = adam.scalars(t, 1.0, batch);
            gpu.optimizer_step(&adam, &s, &mut p_d, &up(&gpu, gr), &mut m_d, &mut v_d, None).unwrap();
            let (bc1, bc2): (f64, f64) = (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32));
            for i in 0..n {
                let g = gr[i] as f64 / batch as f64 + wd * p[i];
                m[i] += (1.0 - b1) * (g - m[i]);
                v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                p[i] -= (1e-3f32 as f64 / bc1) * m[i] / (v[i].sqrt() / bc2.sqrt() + eps);
            }
        }
        // Each Adam step moves p by about lr = 1e-3, so 1e-6 absolute is 0.1% of a step.
        assert_close("adam p after 3 steps", &down(&gpu, &p_d), &p, 1e-5, 1e-6);
        assert_close("adam m", &down(&gpu, &m_d), &m, 1e-5, 1e-6);
        assert_close("adam v", &down(&gpu, &v_d), &v, 1e-5, 1e-9);
        let zeroth = adam.scalars(0, 1.0, 1.0);
        assert!(matches!(
            gpu.optimizer_step(&adam, &zeroth, &mut p_d, &up(&gpu, &grads[0]), &mut m_d, &mut v_d, None),
            Err(Error::Config { .. })
        ));
    }

    /// Issue 18's kernels on a GPU: the gradient norm and clip factor bitwise the CPU's
    /// `GradNorm` (every operation rounds on its own: the _rn intrinsics), and Nesterov SGD
    /// and AdamW with the clip factor read on the device and a run without decay, against
    /// the CPU optimiser within the tolerance of `sgd_and_adam_follow_pytorch_on_a_gpu`
    /// (contracted multiply-adds round once where the CPU rounds twice).
    #[test]
    fn nesterov_adamw_and_the_clip_follow_the_cpu_optimizer_on_a_gpu() {
        if !crate::ops::conformance::gpu_or_skip("nesterov_adamw_and_the_clip_follow_the_cpu_optimizer_on_a_gpu") {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let n = 2 * NORM_CHUNK + 77;
        let p0 = uniform(11, n);
        let batch = 16.0f32;
        let grads: Vec<Vec<f32>> = (0..3).map(|t| uniform(110 + t, n).iter().map(|v| batch * v).collect()).collect();
        let nesterov =
            OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, momentum_kind: MomentumKind::Nesterov, weight_decay: 1e-3 };
        let adamw = OptimizerConfig::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
        for config in [nesterov, adamw] {
            let mut cpu = Optimizer::new(config, n);
            let mut p = p0.clone();
            let (mut p_d, mut m_d, mut v_d) = (up(&gpu, &p0), up(&gpu, &vec![0.0f32; n]), up(&gpu, &vec![0.0f32; n]));
            let mut partials = gpu.stream().alloc_zeros::<f64>(norm_partials(n)).unwrap();
            let mut factor = up(&gpu, &[0.0f32]);
            for g in &grads {
                let mut s = cpu.begin_step(0.5, batch);
                let mut norm = GradNorm::default();
                norm.add(0, g, batch);
                s.clip = cpu_clip_factor(norm.norm(), 1.0);
                let g_d = up(&gpu, g);
                gpu.grad_norm(&g_d, &mut partials.slice_mut(..), batch).unwrap();
                gpu.clip_factor(&partials.slice(..), &mut factor, 1.0).unwrap();
                assert_eq!(down(&gpu, &factor)[0].to_bits(), s.clip.to_bits(), "{config:?}: clip factor");
                // The first half decays, the second not: two runs, as the replicas cut them.
                let h = n / 2;
                for (r, rs) in [(0..h, s), (h..n, s.without_decay())] {
                    cpu.update(r.start, &mut p[r.clone()], &g[r.clone()], &rs);
                    let clip = factor.slice(0..1);
                    gpu.optimizer_step(
                        &config,
                        &rs,
                        &mut p_d.slice_mut(r.clone()),
                        &g_d.slice(r.clone()),
                        &mut m_d.slice_mut(r.clone()),
                        &mut v_d.slice_mut(r.clone()),
                        Some(&clip),
                    )
                    .unwrap();
                }
            }
            let want: Vec<f64> = p.iter().map(|&x| x as f64).collect();
            assert_close(&format!("{config:?}: p after 3 clipped steps"), &down(&gpu, &p_d), &want, 1e-5, 1e-6);
        }
    }
}
