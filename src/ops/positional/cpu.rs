//! The positional embedding on the CPU: the table's first T rows added to every sequence,
//! and their gradient, summed over the batch in a fixed order. The reference
//! kernels/positional.cu is held to, bit for bit: one f32 add a value forward, and the
//! same adds in the same order backward. Its dx is dout itself, which the layer hands on.

/// y = x + weight, in place over x: (N, T, C), weight: (T, C), the table's first T rows,
/// added to each of the N sequences.
pub fn positional_forward(x: &mut [f32], weight: &[f32]) {
    for seq in x.chunks_exact_mut(weight.len()) {
        for (v, p) in seq.iter_mut().zip(weight) {
            *v += p;
        }
    }
}

/// dweight: (T, C), the table's first T rows, += Σ_n dout[n] of dout: (N, T, C), each
/// sequence added into the gradient's value in turn, n ascending.
pub fn positional_backward(dout: &[f32], dweight: &mut [f32]) {
    for seq in dout.chunks_exact(dweight.len()) {
        for (g, d) in dweight.iter_mut().zip(seq) {
            *g += d;
        }
    }
}
