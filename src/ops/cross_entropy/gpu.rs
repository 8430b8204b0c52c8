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
