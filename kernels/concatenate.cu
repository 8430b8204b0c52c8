// concatenate.cu — Concatenate, inputs joined along one axis, and its backward, the split
// (src/ops/concatenate/, the CPU reference: copies, so the two agree bit for bit). Seen from
// the axis, input i is a matrix (outer, inner) and the output (outer, total): input i's row
// o lies at columns offset..offset + inner of the output's row o. One launch per input.
// The contract every file of kernels/ keeps is kernels/README.md's.

// y[o, offset + j] = x[o, j]
// x: (outer, inner), y: (outer, total)
extern "C" __global__ void concatenate_fwd_f32(const float* x, float* y, size_t outer, size_t inner,
                                               size_t total, size_t offset) {
    GRID_STRIDE(i, outer * inner) {
        const size_t o = i / inner, j = i - o * inner;
        y[o * total + offset + j] = x[i];
    }
}

// dx[o, j] = dy[o, offset + j]
// dy: (outer, total), dx: (outer, inner)
extern "C" __global__ void concatenate_bwd_f32(const float* dy, float* dx, size_t outer, size_t inner,
                                               size_t total, size_t offset) {
    GRID_STRIDE(i, outer * inner) {
        const size_t o = i / inner, j = i - o * inner;
        dx[i] = dy[o * total + offset + j];
    }
}
