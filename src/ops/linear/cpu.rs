//! A dense layer on the CPU: y = x·Wᵀ + b over rows (every position of every sample one
//! row), and its backward. The products are the backend's GEMM (`backend::cpu::gemm`);
//! what this file fixes is how the bias enters them and the order its gradient is summed
//! in, which kernels/linear.cu's bias kernels are held to.
//!
//! The gradient contract (`ops`): the backward ACCUMULATES into dweight and dbias and
//! WRITES dx.

use crate::backend::cpu::{gemm, Accumulate, Mat};

/// y = x·Wᵀ + b. x: (n, F) rows; weight: (O, F), as in PyTorch; bias: (O), or None
/// without one; y: (n, O), written. With a bias, y starts as the bias in every row (never
/// zeroed first) and the GEMM adds the product to it.
pub fn linear_forward(x: &[f32], weight: &[f32], bias: Option<&[f32]>, y: &mut [f32], n: usize, f: usize, o: usize) {
    assert_eq!(y.len(), n * o, "linear_forward: y of {} values for ({n}, {o})", y.len());
    let acc = match bias {
        Some(bias) => {
            assert_eq!(bias.len(), o, "linear_forward: a bias of {} for {o} outputs", bias.len());
            if o > 0 {
                y.chunks_exact_mut(o).for_each(|row| row.copy_from_slice(bias));
            }
            Accumulate::Add
        }
        None => Accumulate::Overwrite,
    };
    gemm(Mat::rows(x, n, f), Mat::rows(weight, o, f).t(), y, o, acc);
}

/// The backward of [`linear_forward`]. dout: (n, O); x: (n, F), the forward's input;
/// weight: (O, F). dweight: (O, F) += doutᵀ·x; dbias: (O) += Σ_n dout, the rows added into
/// it one after the other; dx: (n, F) = dout·W, written, when asked for.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    dout: &[f32],
    x: &[f32],
    weight: &[f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dx: Option<&mut [f32]>,
    n: usize,
    f: usize,
    o: usize,
) {
    gemm(Mat::rows(dout, n, o).t(), Mat::rows(x, n, f), dweight, f, Accumulate::Add);
    if let Some(dbias) = dbias {
        bias_backward(dout, dbias, o);
    }
    if let Some(dx) = dx {
        gemm(Mat::rows(dout, n, o), Mat::rows(weight, o, f), dx, f, Accumulate::Overwrite);
    }
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
