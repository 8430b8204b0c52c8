//! Every CUDA kernel against a plain Rust reference (STYLE.md: the CPU is the oracle),
//! written here or, where tests/kernels_host.rs holds the same kernel to it, in
//! tests/common; on small random inputs, plus the no-driver behaviour of the probes.
//!
//! Without a CUDA driver (CI, laptops) each GPU test writes "skipped: no CUDA driver" to
//! stderr, visibly, and returns: that is the expected outcome there. The probe tests run
//! everywhere. References are computed in f64 from the same f32 inputs; tolerances are
//! stated per test: |gpu - ref| <= atol + rtol * |ref|.

mod common;

use std::io::Write;

use cudarc::driver::CudaSlice;
use lockstep::cuda::launch::Gpu;
use lockstep::cuda::probe::{self, NcclStatus, NO_DRIVER};
use lockstep::ops::batchnorm::gpu::{BnGeom, BnGrads, BnMerged, BnParams, BnSaved, BnStats, BnSums, BnUpdate};
use lockstep::ops::batchnorm::RunningUpdate;
use lockstep::ops::dropout::gpu::DropoutKey;
use lockstep::ops::window::WindowGeom;
use lockstep::rng::mix64;
use lockstep::Error;

use common::{
    assert_close, bias_nchw_bwd_ref, col2im_ref, dropout_keep, f64s, im2col_ref, sync_bn_cpu, sync_bn_global_sums,
    sync_bn_merge, BnInputs, Rng, ATOL_ELEM, ATOL_SUM, RTOL_ELEM, RTOL_SUM,
};

// ---- harness ----------------------------------------------------------------------

/// The GPU, or None after a loud skip line when this machine has no driver or no GPU.
fn gpu_or_skip(test: &str) -> Option<Gpu> {
    // Written to the stderr handle, not eprintln!, so the harness does not swallow it.
    let loud = |why: &str| {
        let _ = writeln!(std::io::stderr(), "{test}: skipped: {why}");
    };
    if probe::driver_available().is_err() {
        loud("no CUDA driver");
        return None;
    }
    match probe::gpu_count() {
        Ok(0) => {
            loud("no CUDA GPU");
            None
        }
        Ok(_) => Some(Gpu::new(0).expect("driver and GPU present, but Gpu::new(0) failed")),
        Err(e) => panic!("the CUDA driver is present but cannot count GPUs: {e}"),
    }
}

fn up<T: cudarc::driver::DeviceRepr>(gpu: &Gpu, v: &[T]) -> CudaSlice<T> {
    gpu.stream().clone_htod(v).expect("host to device copy")
}

fn down<T: cudarc::driver::DeviceRepr + Default + Clone>(gpu: &Gpu, d: &CudaSlice<T>) -> Vec<T> {
    gpu.stream().clone_dtoh(d).expect("device to host copy")
}

// ---- probes: run everywhere ------------------------------------------------------

#[test]
fn without_a_driver_probes_give_one_clear_error_and_no_panic() {
    if probe::driver_available().is_ok() {
        // A driver here: the probes must agree with each other instead.
        let count = probe::gpu_count().expect("gpu_count with a driver");
        let gpus = probe::gpus().expect("gpus with a driver");
        assert_eq!(gpus.len(), count);
        for (i, g) in gpus.iter().enumerate() {
            assert_eq!(g.ordinal, i);
            assert!(g.total_memory_bytes > 0 && g.compute_capability.0 >= 5, "{g:?}");
        }
        return;
    }
    let msg = "no CUDA driver found (libcuda.so.1); use --devices cpu:N";
    assert_eq!(NO_DRIVER, msg);
    match probe::driver_available() {
        Err(Error::CudaUnavailable(m)) => assert_eq!(m, msg),
        other => panic!("expected CudaUnavailable, got {other:?}"),
    }
    assert_eq!(probe::driver_available().unwrap_err().to_string(), msg, "Display is the one line");
    assert!(matches!(probe::gpu_count(), Err(Error::CudaUnavailable(m)) if m == msg));
    assert!(matches!(probe::gpus(), Err(Error::CudaUnavailable(m)) if m == msg));
    assert!(matches!(Gpu::new(0), Err(Error::CudaUnavailable(m)) if m == msg));
}

#[test]
fn nccl_status_never_panics_and_names_what_it_tried() {
    match probe::nccl_status() {
        NcclStatus::Available => {}
        NcclStatus::NeedsLink { found } => {
            assert!(found.exists(), "{found:?}");
            assert!(probe::nccl_status().fix().contains("ln -sf"));
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
    let link = probe::make_nccl_link(&fake, &link_dir).unwrap();
    assert_eq!(link, link_dir.join("libnccl.so"));
    assert_eq!(std::fs::read(&link).unwrap(), b"not really a library");
    // Idempotent: a second call replaces the link.
    probe::make_nccl_link(&fake, &link_dir).unwrap();
    assert_eq!(std::fs::read_link(&link).unwrap(), fake);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- elementwise.cu ------------------------------------------------------------------

#[test]
fn relu_and_rescale_match_the_reference() {
    let Some(gpu) = gpu_or_skip("relu_and_rescale_match_the_reference") else {
        return;
    };
    let mut rng = Rng(1);
    let n = 1000;
    let (x, dy) = (rng.vec(n), rng.vec(n));
    let (dx_d, dy_d) = (up(&gpu, &x), up(&gpu, &dy));
    let mut y_d = up(&gpu, &vec![0.0f32; n]);
    let mut dx_out = up(&gpu, &vec![0.0f32; n]);
    gpu.relu_fwd(&dx_d, &mut y_d).unwrap();
    gpu.relu_bwd(&dx_d, &dy_d, &mut dx_out).unwrap();
    let want_y: Vec<f64> = x.iter().map(|&v| v.max(0.0) as f64).collect();
    let want_dx: Vec<f64> = x.iter().zip(&dy).map(|(&v, &g)| if v > 0.0 { g as f64 } else { 0.0 }).collect();
    assert_close("relu y", &down(&gpu, &y_d), &want_y, 0.0, 0.0);
    assert_close("relu dx", &down(&gpu, &dx_out), &want_dx, 0.0, 0.0);

    let (scale, offset) = (1.0 / 255.0, -0.5);
    gpu.rescale_fwd(&dx_d, &mut y_d, scale, offset).unwrap();
    gpu.rescale_bwd(&dy_d, &mut dx_out, scale).unwrap();
    let want_y: Vec<f64> = x.iter().map(|&v| v as f64 * scale as f64 + offset as f64).collect();
    let want_dx: Vec<f64> = dy.iter().map(|&g| g as f64 * scale as f64).collect();
    assert_close("rescale y", &down(&gpu, &y_d), &want_y, RTOL_ELEM, ATOL_ELEM);
    assert_close("rescale dx", &down(&gpu, &dx_out), &want_dx, RTOL_ELEM, ATOL_ELEM);

    gpu.scale(&mut y_d, 0.25).unwrap();
    let want: Vec<f64> = want_y.iter().map(|v| v * 0.25).collect();
    assert_close("scale", &down(&gpu, &y_d), &want, RTOL_ELEM, ATOL_ELEM);
    gpu.fill(&mut y_d, 3.5).unwrap();
    assert_close("fill", &down(&gpu, &y_d), &vec![3.5; n], 0.0, 0.0);
    // A wrong length is a shape error, not a launch.
    let mut short = up(&gpu, &vec![0.0f32; n - 1]);
    assert!(matches!(gpu.relu_fwd(&dx_d, &mut short), Err(Error::Shape { op: "relu_fwd", .. })));
}

#[test]
fn bias_add_and_its_reduction_match_the_reference() {
    let Some(gpu) = gpu_or_skip("bias_add_and_its_reduction_match_the_reference") else {
        return;
    };
    let mut rng = Rng(2);
    // NCHW: N=3, C=5, H=W=7 (hw = 49, so a block of 256 threads covers 147 terms).
    let (n, c, hw) = (3, 5, 49);
    let (y0, bias, dy, dbias0) = (rng.vec(n * c * hw), rng.vec(c), rng.vec(n * c * hw), rng.vec(c));
    let mut y_d = up(&gpu, &y0);
    gpu.bias_nchw_fwd(&mut y_d, &up(&gpu, &bias), n, c, hw).unwrap();
    let want: Vec<f64> = (0..n * c * hw).map(|i| y0[i] as f64 + bias[(i / hw) % c] as f64).collect();
    assert_close("bias_nchw y", &down(&gpu, &y_d), &want, RTOL_ELEM, ATOL_ELEM);
    let mut db_d = up(&gpu, &dbias0);
    gpu.bias_nchw_bwd(&up(&gpu, &dy), &mut db_d, n, c, hw).unwrap();
    let want = bias_nchw_bwd_ref(&dy, &dbias0, (n, c, hw));
    assert_close("bias_nchw dbias (accumulated)", &down(&gpu, &db_d), &want, RTOL_SUM, ATOL_SUM);

    // (N, O): N=6, O=10.
    let (n, o) = (6, 10);
    let (y0, bias, dy, dbias0) = (rng.vec(n * o), rng.vec(o), rng.vec(n * o), rng.vec(o));
    let mut y_d = up(&gpu, &y0);
    gpu.bias_cols_fwd(&mut y_d, &up(&gpu, &bias), n, o).unwrap();
    let want: Vec<f64> = (0..n * o).map(|i| y0[i] as f64 + bias[i % o] as f64).collect();
    assert_close("bias_cols y", &down(&gpu, &y_d), &want, RTOL_ELEM, ATOL_ELEM);
    let mut db_d = up(&gpu, &dbias0);
    gpu.bias_cols_bwd(&up(&gpu, &dy), &mut db_d, n, o).unwrap();
    let want: Vec<f64> = (0..o).map(|j| dbias0[j] as f64 + (0..n).map(|s| dy[s * o + j] as f64).sum::<f64>()).collect();
    assert_close("bias_cols dbias (accumulated)", &down(&gpu, &db_d), &want, RTOL_SUM, ATOL_SUM);
}

// ---- conv.cu -----------------------------------------------------------------------

#[test]
fn im2col_and_col2im_match_the_reference_with_stride_and_asymmetric_padding() {
    let Some(gpu) = gpu_or_skip("im2col_and_col2im_match_the_reference_with_stride_and_asymmetric_padding") else {
        return;
    };
    let mut rng = Rng(3);
    let geoms = [
        // The Keras convnet's first layer: 3x3, stride 1, no padding.
        WindowGeom {
            n: 2,
            c: 1,
            h: 28,
            w: 28,
            kh: 3,
            kw: 3,
            stride_h: 1,
            stride_w: 1,
            pad_top: 0,
            pad_left: 0,
            pad_bottom: 0,
            pad_right: 0,
        },
        // TF "same" padding with stride 2 on an even size: 0 top/left, 1 bottom/right.
        WindowGeom {
            n: 2,
            c: 3,
            h: 8,
            w: 6,
            kh: 3,
            kw: 3,
            stride_h: 2,
            stride_w: 2,
            pad_top: 0,
            pad_left: 0,
            pad_bottom: 1,
            pad_right: 1,
        },
        // Everything different: 2x4 kernel, strides 2/3, padding 1/2/0/1.
        WindowGeom {
            n: 3,
            c: 2,
            h: 7,
            w: 9,
            kh: 2,
            kw: 4,
            stride_h: 2,
            stride_w: 3,
            pad_top: 1,
            pad_left: 2,
            pad_bottom: 0,
            pad_right: 1,
        },
    ];
    for g in &geoms {
        let x = rng.vec(g.x_len());
        let mut col_d = up(&gpu, &vec![f32::NAN; g.col_len()]);
        gpu.im2col_fwd(&up(&gpu, &x), &mut col_d, g).unwrap();
        // Pure copies and zeros: exact.
        assert_close(&format!("im2col {g:?}"), &down(&gpu, &col_d), &f64s(&im2col_ref(&x, g)), 0.0, 0.0);
        let dcol = rng.vec(g.col_len());
        let mut dx_d = up(&gpu, &vec![f32::NAN; g.x_len()]);
        gpu.im2col_bwd(&up(&gpu, &dcol), &mut dx_d, g).unwrap();
        // At most KH*KW terms per element.
        assert_close(&format!("col2im {g:?}"), &down(&gpu, &dx_d), &col2im_ref(&dcol, g), RTOL_SUM, ATOL_SUM);
    }
}

// ---- batchnorm.cu -------------------------------------------------------------------

#[test]
fn batchnorm_train_eval_and_backward_match_the_reference() {
    let Some(gpu) = gpu_or_skip("batchnorm_train_eval_and_backward_match_the_reference") else {
        return;
    };
    let mut rng = Rng(4);
    let (n, c, hw) = (4, 3, 25);
    let (momentum, eps) = (0.99f32, 1e-3f32);
    for (with_gamma, with_beta) in [(true, true), (false, true), (true, false), (false, false)] {
        let inputs = BnInputs::random(&mut rng, (n, c, hw));
        let BnInputs {
            x, dy, gamma, beta, running_mean: rm0, running_var: rv0, dgamma: dgamma0, dbeta: dbeta0, ..
        } = &inputs;
        let (g_d, b_d) = (up(&gpu, gamma), up(&gpu, beta));
        let params = || BnParams { gamma: with_gamma.then(|| g_d.as_view()), beta: with_beta.then(|| b_d.as_view()) };
        let x_d = up(&gpu, x);
        let mut y_d = up(&gpu, &vec![0.0f32; x.len()]);
        let (mut rm_d, mut rv_d) = (up(&gpu, rm0), up(&gpu, rv0));
        let (mut sm_d, mut si_d) = (up(&gpu, &vec![0.0f32; c]), up(&gpu, &vec![0.0f32; c]));
        let geom = BnGeom { n, c, hw, eps, momentum };
        let stats = BnStats {
            running_mean: rm_d.as_view_mut(),
            running_var: rv_d.as_view_mut(),
            save_mean: sm_d.as_view_mut(),
            save_invstd: si_d.as_view_mut(),
        };
        let u = RunningUpdate::new(momentum, n * hw);
        gpu.batchnorm_train_fwd(&x_d, &mut y_d, params(), stats, geom, BnUpdate::new(u.keep, u.take, u.unbias))
            .unwrap();

        let want = inputs.train_ref(with_gamma, with_beta, momentum, eps);
        let case = format!("gamma {with_gamma}, beta {with_beta}");
        // 100 terms per channel through mean and variance: 1e-4 relative, 1e-5 absolute.
        assert_close(&format!("bn y ({case})"), &down(&gpu, &y_d), &want.y, 1e-4, 1e-5);
        assert_close(&format!("bn running_mean ({case})"), &down(&gpu, &rm_d), &want.running_mean, 1e-5, 1e-6);
        assert_close(&format!("bn running_var ({case})"), &down(&gpu, &rv_d), &want.running_var, 1e-5, 1e-6);

        let mut dx_d = up(&gpu, &vec![0.0f32; x.len()]);
        let (mut dg_d, mut db_d) = (up(&gpu, dgamma0), up(&gpu, dbeta0));
        let saved = BnSaved { mean: sm_d.as_view(), invstd: si_d.as_view() };
        let grads = BnGrads {
            dx: dx_d.as_view_mut(),
            dgamma: with_gamma.then(|| dg_d.as_view_mut()),
            dbeta: with_beta.then(|| db_d.as_view_mut()),
        };
        gpu.batchnorm_train_bwd(&x_d, &up(&gpu, dy), params(), saved, grads, geom).unwrap();
        assert_close(&format!("bn dx ({case})"), &down(&gpu, &dx_d), &want.dx, 1e-4, 1e-5);
        // Absent parameters leave their gradient buffers untouched.
        assert_close(&format!("bn dgamma ({case})"), &down(&gpu, &dg_d), &want.dgamma, 1e-4, 1e-5);
        assert_close(&format!("bn dbeta ({case})"), &down(&gpu, &db_d), &want.dbeta, 1e-4, 1e-5);

        // Eval with the running stats just updated.
        let (rm, rv) = (down(&gpu, &rm_d), down(&gpu, &rv_d));
        gpu.batchnorm_eval_fwd(&x_d, &mut y_d, params(), (&rm_d, &rv_d), geom).unwrap();
        let want = inputs.eval_ref(with_gamma, with_beta, &rm, &rv, eps);
        assert_close(&format!("bn eval y ({case})"), &down(&gpu, &y_d), &want, 1e-5, 1e-6);
    }
}

/// The synchronized BatchNorm kernels on the GPU against the CPU layer (tests/common's
/// `sync_bn_cpu`), through the launches a GPU replica makes, bit for bit as on the host
/// (tests/kernels_host.rs): the kernels' f64 and f32 arithmetic is the layer's, operation
/// for operation, with the _rn intrinsics where NVRTC would fuse a multiply and an add,
/// and CUDA's f64 division, conversions and additions are IEEE's, as the CPU's.
#[test]
fn synchronized_batchnorm_kernels_equal_the_cpu_layer_bit_for_bit() {
    let Some(gpu) = gpu_or_skip("synchronized_batchnorm_kernels_equal_the_cpu_layer_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(12);
    let (momentum, eps) = (0.9f32, 1e-3f32);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let f32_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (n, c, hw, with_gamma, with_beta) in
        [(5, 3, 37, true, true), (3, 2, 64, false, true), (2, 2, 5, true, false), (300, 2, 9, false, false)]
    {
        let case = format!("N={n} C={c} HW={hw}, gamma {with_gamma}, beta {with_beta}");
        let inputs = BnInputs::random(&mut rng, (n, c, hw));
        let cpu = sync_bn_cpu(&inputs, with_gamma, with_beta, momentum, eps);
        let BnInputs {
            x, dy, gamma, beta, running_mean: rm0, running_var: rv0, dgamma: dgamma0, dbeta: dbeta0, ..
        } = &inputs;
        let geom = BnGeom { n, c, hw, eps, momentum };
        let (x_d, dy_d, g_d, b_d) = (up(&gpu, x), up(&gpu, dy), up(&gpu, gamma), up(&gpu, beta));
        let params = || BnParams { gamma: with_gamma.then(|| g_d.as_view()), beta: with_beta.then(|| b_d.as_view()) };

        let mut moments_d = up(&gpu, &vec![f64::NAN; 2 * c]);
        gpu.batchnorm_moments_fwd(&x_d, &mut moments_d.as_view_mut(), geom).unwrap();
        let moments = down(&gpu, &moments_d);
        assert_eq!(bits(&moments), bits(&cpu.sent_fwd[1..]), "{case}: the shard's moments vs the CPU layer's payload");
        let (count, stats, update) = sync_bn_merge(&moments, n * hw, momentum, eps);
        let stats_d = up(&gpu, &stats);
        let mut y_d = up(&gpu, &vec![f32::NAN; x.len()]);
        let (mut rm_d, mut rv_d) = (up(&gpu, rm0), up(&gpu, rv0));
        let (mut sm_d, mut si_d) = (up(&gpu, &vec![f32::NAN; c]), up(&gpu, &vec![f32::NAN; c]));
        let out = BnStats {
            running_mean: rm_d.as_view_mut(),
            running_var: rv_d.as_view_mut(),
            save_mean: sm_d.as_view_mut(),
            save_invstd: si_d.as_view_mut(),
        };
        let update = BnUpdate::new(update.keep, update.take, update.unbias);
        gpu.batchnorm_sync_fwd(&x_d, &mut y_d, params(), BnMerged { stats: stats_d.as_view(), update }, out, geom)
            .unwrap();
        assert_eq!(f32_bits(&down(&gpu, &y_d)), f32_bits(&cpu.y), "{case}: y");
        assert_eq!(f32_bits(&down(&gpu, &rm_d)), f32_bits(&cpu.running_mean), "{case}: running_mean");
        assert_eq!(f32_bits(&down(&gpu, &rv_d)), f32_bits(&cpu.running_var), "{case}: running_var");

        let mut sums_d = up(&gpu, &vec![f64::NAN; 2 * c]);
        let saved = || BnSaved { mean: sm_d.as_view(), invstd: si_d.as_view() };
        gpu.batchnorm_sums_bwd(&x_d, &dy_d, &saved(), &mut sums_d.as_view_mut(), geom).unwrap();
        let sums = down(&gpu, &sums_d);
        assert_eq!(bits(&sums), bits(&cpu.sent_bwd), "{case}: the shard's sums vs the CPU layer's payload");
        let global_d = up(&gpu, &sync_bn_global_sums(&sums));
        let mut dx_d = up(&gpu, &vec![f32::NAN; x.len()]);
        let (mut dg_d, mut db_d) = (up(&gpu, dgamma0), up(&gpu, dbeta0));
        let grads = BnGrads {
            dx: dx_d.as_view_mut(),
            dgamma: with_gamma.then(|| dg_d.as_view_mut()),
            dbeta: with_beta.then(|| db_d.as_view_mut()),
        };
        let sums = BnSums { saved: saved(), local: sums_d.as_view(), global: global_d.as_view(), count };
        gpu.batchnorm_sync_bwd(&x_d, &dy_d, params(), sums, grads, geom).unwrap();
        assert_eq!(f32_bits(&down(&gpu, &dx_d)), f32_bits(&cpu.dx), "{case}: dx");
        assert_eq!(f32_bits(&down(&gpu, &dg_d)), f32_bits(&cpu.dgamma), "{case}: dgamma");
        assert_eq!(f32_bits(&down(&gpu, &db_d)), f32_bits(&cpu.dbeta), "{case}: dbeta");
    }
}

// ---- pooling.cu, softmax_xent.cu -----------------------------------------------------

#[test]
fn global_average_pool_matches_the_reference() {
    let Some(gpu) = gpu_or_skip("global_average_pool_matches_the_reference") else {
        return;
    };
    let mut rng = Rng(5);
    let (nc, hw) = (2 * 64, 5 * 5);
    let (x, dy) = (rng.vec(nc * hw), rng.vec(nc));
    let mut y_d = up(&gpu, &vec![0.0f32; nc]);
    gpu.global_avgpool_fwd(&up(&gpu, &x), &mut y_d, nc, hw).unwrap();
    let want: Vec<f64> =
        (0..nc).map(|i| x[i * hw..(i + 1) * hw].iter().map(|&v| v as f64).sum::<f64>() / hw as f64).collect();
    assert_close("avgpool y", &down(&gpu, &y_d), &want, RTOL_SUM, ATOL_SUM);
    let mut dx_d = up(&gpu, &vec![0.0f32; nc * hw]);
    gpu.global_avgpool_bwd(&up(&gpu, &dy), &mut dx_d, nc, hw).unwrap();
    let want: Vec<f64> = (0..nc * hw).map(|i| dy[i / hw] as f64 / hw as f64).collect();
    assert_close("avgpool dx", &down(&gpu, &dx_d), &want, RTOL_ELEM, ATOL_ELEM);
}

// ---- dropout.cu ----------------------------------------------------------------------

#[test]
fn dropout_mask_is_the_documented_hash_and_backward_reuses_it() {
    let Some(gpu) = gpu_or_skip("dropout_mask_is_the_documented_hash_and_backward_reuses_it") else {
        return;
    };
    let mut rng = Rng(9);
    let n = 10_000;
    let rate = 0.3f32;
    let key = DropoutKey { seed: 42, step: 7, shard: 1, layer: 3, first: 0 };
    let x: Vec<f32> = rng.vec(n).iter().map(|v| v + 2.0).collect(); // never 0, so drops are visible
    let dy = rng.vec(n);
    let mut y_d = up(&gpu, &vec![0.0f32; n]);
    let mut dx_d = up(&gpu, &vec![0.0f32; n]);
    gpu.dropout_fwd(&up(&gpu, &x), &mut y_d, rate, key).unwrap();
    gpu.dropout_bwd(&up(&gpu, &dy), &mut dx_d, rate, key).unwrap();
    let (y, dx) = (down(&gpu, &y_d), down(&gpu, &dx_d));
    let scale = 1.0f32 / (1.0 - rate);
    let mut kept = 0;
    for i in 0..n {
        let keep = dropout_keep(key, i as u64, rate);
        kept += keep as usize;
        // Bitwise: one f32 multiply by the same f32 factor, 0 where dropped (so -0 for a
        // negative dy), as the CPU layer computes it.
        let factor = if keep { scale } else { 0.0 };
        assert_eq!(y[i].to_bits(), (x[i] * factor).to_bits(), "y[{i}]");
        assert_eq!(dx[i].to_bits(), (dy[i] * factor).to_bits(), "dx[{i}]");
    }
    // Binomial(10000, 0.7): sd = 46, so +-4 sd is 0.7 +- 0.0184.
    let frac = kept as f64 / n as f64;
    assert!((frac - 0.7).abs() < 0.0184, "kept fraction {frac}");
    // Another replica gets another mask.
    gpu.dropout_fwd(&up(&gpu, &x), &mut y_d, rate, DropoutKey { shard: 2, ..key }).unwrap();
    assert_ne!(down(&gpu, &y_d), y);
}

/// Runs everywhere: the library's mix64, under both the dropout reference's hash and the
/// test inputs, against values worked out by hand from the SplitMix64 definition
/// (mix64(0x9E3779B97F4A7C15) = 0xE220A8397B1DCDAF is the first output of SplitMix64
/// seeded with 0, Vigna's reference splitmix64.c).
#[test]
fn dropout_hash_reference_is_splitmix64() {
    assert_eq!(mix64(0x9E37_79B9_7F4A_7C15), 0xE220_A839_7B1D_CDAF);
    let key = DropoutKey { seed: 0, step: 0, shard: 0, layer: 0, first: 0 };
    // rate 0 keeps everything; rate 1 drops everything.
    assert!((0..1000).all(|i| dropout_keep(key, i, 0.0)));
    assert!((0..1000).all(|i| !dropout_keep(key, i, 1.0)));
}
