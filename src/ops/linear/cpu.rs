//! A dense layer on the CPU: y = x·Wᵀ + b over rows (every position of every sample one
//! row), and its backward. The products are the backend's GEMM (`backend::cpu::gemm`);
//! what this file fixes is how the bias enters them and the order its gradient is summed
//! in, which kernels/linear.cu's bias kernels are held to.
//!
//! The gradient contract (`ops`): the backward ACCUMULATES into dweight and dbias and
//! WRITES dx.

use crate::backend::cpu::{gemm, gemm_new, Accumulate, Mat};

/// y = x·Wᵀ + b. x: (n, F) rows; weight: (O, F), as in PyTorch; bias: (O), or None
/// without one → y: (n, O). With a bias, y starts as the bias in every row and the GEMM
/// adds the product to it; without one the GEMM writes y, never zeroed first.
pub fn linear_forward(x: &[f32], weight: &[f32], bias: Option<&[f32]>, n: usize, f: usize, o: usize) -> Vec<f32> {
    let (x, weight_t) = (Mat::rows(x, n, f), Mat::rows(weight, o, f).t());
    match bias {
        None => gemm_new(x, weight_t),
        Some(bias) => {
            assert_eq!(bias.len(), o, "linear_forward: a bias of {} for {o} outputs", bias.len());
            let mut y = Vec::with_capacity(n * o);
            for _ in 0..n {
                y.extend_from_slice(bias);
            }
            gemm(x, weight_t, &mut y, o, Accumulate::Add);
            y
        }
    }
}

/// The backward of [`linear_forward`]. dout: (n, O); x: (n, F), the forward's input;
/// weight: (O, F). dweight: (O, F) += doutᵀ·x; dbias: (O) += Σ_n dout, the rows added into
/// it one after the other. Returns dx: (n, F) = dout·W when `want_dx`.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    dout: &[f32],
    x: &[f32],
    weight: &[f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    want_dx: bool,
    n: usize,
    f: usize,
    o: usize,
) -> Option<Vec<f32>> {
    gemm(Mat::rows(dout, n, o).t(), Mat::rows(x, n, f), dweight, f, Accumulate::Add);
    if let Some(dbias) = dbias {
        bias_backward(dout, dbias, o);
    }
    want_dx.then(|| gemm_new(Mat::rows(dout, n, o), Mat::rows(weight, o, f)))
}

/// dbias (O) += Σ_n dout[n], each row of dout: (n, O) added into dbias in turn, n
/// ascending.
pub fn bias_backward(dout: &[f32], dbias: &mut [f32], o: usize) {
    for row in dout.chunks_exact(o) {
        for (g, v) in dbias.iter_mut().zip(row) {
            *g += v;
        }
    }
}
