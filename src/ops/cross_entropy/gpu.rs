//! The loss on a GPU: the declaration of kernels/cross_entropy.cu and the checked launch of
//! its one kernel, which makes each sample's softmax cross-entropy loss, its gradient and
//! whether the sample was classified right in one pass. Which labels are valid is
//! `super::check_labels`, made by the caller; the kernel never indexes with an out-of-range
//! label.

use crate::cuda::launch::{check_len, dim, elem_cfg, DevIn, DevOut, Gpu};
use crate::{Error, Result};
use cudarc::driver::CudaSlice;

crate::cuda::declare::kernels! {
    "cross_entropy.cu" {
        softmax_xent {
            fwd(
                logits: In, labels: InU32, loss: Out, dlogits: Out, correct: OutU32, n: Size, k: I32,
                label_smoothing: F32,
            );
        }
    }
}

// ---- checked launches ---------------------------------------------------------------

impl Gpu {
    /// logits: (N, K), labels: (N) -> loss: (N), dlogits: (N, K) = softmax - target
    /// (gradient of the summed loss; the target is (1 - eps)·onehot + eps/K with label
    /// smoothing eps, `ops::cross_entropy::CrossEntropy`), correct: (N) in {0, 1}.
    // The kernel's own argument list, buffer by buffer, as every checked launch takes it.
    #[allow(clippy::too_many_arguments)]
    pub fn softmax_xent_fwd(
        &self,
        logits: &impl DevIn,
        labels: &CudaSlice<u32>,
        loss: &mut impl DevOut,
        dlogits: &mut impl DevOut,
        correct: &mut CudaSlice<u32>,
        k: usize,
        label_smoothing: f32,
    ) -> Result<()> {
        let logits = &logits.view();
        let loss = &mut loss.view_mut();
        let dlogits = &mut dlogits.view_mut();
        let op = "softmax_xent_fwd";
        let n = labels.len();
        if k == 0 {
            return Err(Error::shape(op, "K (number of classes) must be positive"));
        }
        // The kernel trusts ε; `CrossEntropy::new` is the check a run makes.
        if !(0.0..1.0).contains(&label_smoothing) {
            return Err(Error::config("label smoothing", format!("must be in [0, 1), got {label_smoothing}")));
        }
        check_len(op, "logits", logits, n * k)?;
        check_len(op, "dlogits", dlogits, n * k)?;
        check_len(op, "loss", loss, n)?;
        check_len(op, "correct", correct, n)?;
        if n == 0 {
            return Ok(());
        }
        let ki = dim(op, "K", k)?;
        let (labels, correct) = (&labels.as_view(), &mut correct.as_view_mut());
        // SAFETY: softmax_xent_fwd_f32(const float*, const unsigned*, float*, float*,
        // unsigned*, size_t, int, float); lengths checked; out-of-range labels are never
        // used as an index by the kernel.
        unsafe { softmax_xent::fwd(self, elem_cfg(n), logits, labels, loss, dlogits, correct, n, ki, label_smoothing) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cuda::host::{checker_or_skip, elem_cfg, elem_cfgs, In, InU32, Out, OutU32, F32, I32, U64};
    use crate::ops::cross_entropy::cpu::softmax_xent_forward;
    use crate::testing::uniform;

    /// |got − want| ≤ 1e-6 + 1e-5·|want|, or both NaN: the GPU's expf and logf are within
    /// 2 ulp (the host's, the C library's, likewise), the kernel sums a row one value after
    /// another where the CPU sums in 16 lanes, and its gradient is exp(z − lse) where the
    /// CPU's is e^(z − max)/Σ: a few ulp of values of size ≤ 1e3 (the row of a large logit).
    #[track_caller]
    fn near(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let bound = 1e-6 + 1e-5 * (w as f64).abs();
            let ok = ((g as f64) - (w as f64)).abs() <= bound || (g.is_nan() && w.is_nan());
            assert!(ok, "{what}[{i}]: got {g}, the CPU's {w} (bound {bound:e})");
        }
    }

    /// The logits and labels of both checks: N = 300 rows of K = 10, values 4·U(−1, 1);
    /// rows 0 and 1 with their maximum 5.0 at classes 2 and 7, labelled 2 and 7 (the first
    /// maximum is the prediction, as in torch.argmax: the first is right, the second not);
    /// row 2 with a logit of 1000, its label (the row's maximum is subtracted before the
    /// exponentials);
    /// row 3 with a NaN first logit, labelled with the largest of the others (a NaN is never
    /// the maximum: the row is right, its loss and gradient NaN).
    fn inputs() -> (Vec<f32>, Vec<u32>, usize) {
        let (n, k) = (300, 10);
        let mut logits: Vec<f32> = uniform(7, n * k).iter().map(|v| 4.0 * v).collect();
        let mut g = crate::rng::SplitMix64::new(8);
        let mut labels: Vec<u32> = (0..n).map(|_| (g.next_u64() % k as u64) as u32).collect();
        for s in [0, 1] {
            logits[s * k + 2] = 5.0;
            logits[s * k + 7] = 5.0;
        }
        (labels[0], labels[1]) = (2, 7);
        logits[2 * k + 4] = 1000.0;
        labels[2] = 4;
        logits[3 * k] = f32::NAN;
        let row3 = &logits[3 * k..4 * k];
        labels[3] = (1..k).fold(1, |a, j| if row3[j] > row3[a] { j } else { a }) as u32;
        (logits, labels, k)
    }

    /// The CPU's loss, correct flags and gradient of `inputs()` under label smoothing `eps`.
    fn cpu(logits: &[f32], labels: &[u32], k: usize, eps: f32) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
        let n = labels.len();
        let (mut loss, mut correct, mut dlogits) = (vec![f32::NAN; n], vec![7; n], vec![f32::NAN; n * k]);
        softmax_xent_forward(logits, labels, k, eps, &mut loss, &mut correct, Some(&mut dlogits));
        assert_eq!(correct[..4], [1, 0, 1, 1], "the CPU's first maximum, never a NaN");
        assert!(loss[3].is_nan() && loss[..3].iter().all(|l| l.is_finite()));
        (loss, correct, dlogits)
    }

    /// kernels/cross_entropy.cu run on the host against the CPU's loss (`super::super::cpu`),
    /// plain and with PyTorch's label smoothing, under the launch's own shape and a grid too
    /// small to cover the rows; then a label ≥ K, which the CPU refuses before computing
    /// anything (`check_labels`) and the kernel turns into a NaN loss.
    #[test]
    fn the_kernel_runs_on_the_host_as_the_cpu_loss() {
        const TEST: &str = "the_kernel_runs_on_the_host_as_the_cpu_loss";
        let Some(kh) = checker_or_skip(TEST, crate::train::kernel_files) else { return };
        let (logits, labels, k) = inputs();
        let n = labels.len();
        for eps in [0.0f32, 0.1, 0.5] {
            let (want_loss, want_correct, want_dl) = cpu(&logits, &labels, k, eps);
            for cfg in elem_cfgs(n) {
                let (mut loss, mut dlogits, mut correct) = (vec![f32::NAN; n], vec![f32::NAN; n * k], vec![7u32; n]);
                // As Gpu::softmax_xent_fwd pushes them: logits, labels, loss, dlogits,
                // correct, n, K (int), label smoothing (float).
                kh.launch(
                    &softmax_xent::FWD,
                    cfg,
                    &mut [
                        In(&logits),
                        InU32(&labels),
                        Out(&mut loss),
                        Out(&mut dlogits),
                        OutU32(&mut correct),
                        U64(n as u64),
                        I32(k as i32),
                        F32(eps),
                    ],
                );
                near(&format!("loss, eps {eps}, {cfg:?}"), &loss, &want_loss);
                near(&format!("dlogits, eps {eps}, {cfg:?}"), &dlogits, &want_dl);
                assert_eq!(correct, want_correct, "correct flags, eps {eps}, {cfg:?}");
            }
        }

        // A label ≥ K: loss NaN, not correct, and dlogits the softmax (no one-hot to
        // subtract).
        let (logits, labels) = (vec![1.0f32, 2.0, 3.0], vec![3u32]);
        let (mut loss, mut dlogits, mut correct) = (vec![0.0f32], vec![0.0f32; 3], vec![7u32]);
        kh.launch(
            &softmax_xent::FWD,
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
        near("dlogits, a bad label", &dlogits, &[0.090_030_57, 0.244_728_47, 0.665_240_96]);
        let file: std::collections::BTreeSet<String> = KERNELS.kernels.iter().map(|k| k.name()).collect();
        assert_eq!(kh.ran(), file, "the kernels run here vs those of {}", KERNELS.name);
    }

    /// The kernel on a GPU against the CPU's loss, within the host check's bounds.
    #[test]
    fn the_kernel_runs_on_a_gpu_as_the_cpu_loss() {
        const TEST: &str = "the_kernel_runs_on_a_gpu_as_the_cpu_loss";
        if !crate::ops::conformance::gpu_or_skip(TEST) {
            return;
        }
        let gpu = Gpu::new(0).unwrap();
        let s = gpu.stream();
        let (logits, labels, k) = inputs();
        let n = labels.len();
        for eps in [0.0f32, 0.1, 0.5] {
            let (want_loss, want_correct, want_dl) = cpu(&logits, &labels, k, eps);
            let (mut loss, mut dl) = (s.alloc_zeros::<f32>(n).unwrap(), s.alloc_zeros::<f32>(n * k).unwrap());
            let mut correct = s.clone_htod(&vec![7u32; n]).unwrap();
            let (x, y) = (s.clone_htod(&logits).unwrap(), s.clone_htod(&labels).unwrap());
            gpu.softmax_xent_fwd(&x, &y, &mut loss, &mut dl, &mut correct, k, eps).unwrap();
            near(&format!("gpu loss, eps {eps}"), &s.clone_dtoh(&loss).unwrap(), &want_loss);
            near(&format!("gpu dlogits, eps {eps}"), &s.clone_dtoh(&dl).unwrap(), &want_dl);
            assert_eq!(s.clone_dtoh(&correct).unwrap(), want_correct, "gpu correct flags, eps {eps}");
        }
    }
}
