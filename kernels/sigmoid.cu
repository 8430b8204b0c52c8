// sigmoid.cu — the logistic sigmoid, 1 / (1 + e^-x) (PyTorch's nn.Sigmoid()), forward and
// backward. The CPU reference is src/ops/sigmoid/cpu.rs, whose f32 expressions these
// compute in the same order (e^-x by lockstep_exp of common.cuh), so the two agree bit for
// bit. The contract every file of kernels/ keeps is kernels/README.md's.

// sigmoid(x) = 1 / (1 + e^-x)
__device__ float sigmoid_value(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, lockstep_exp(-x)));
}

// y = sigmoid(x)
// x, y: (n)
extern "C" __global__ void sigmoid_fwd_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = sigmoid_value(x[i]); }
}

// dx = dy * (s * (1 - s)), s = sigmoid(x): the slope the CPU's forward keeps, recomputed
// from x.
// x, dy, dx: (n)
extern "C" __global__ void sigmoid_bwd_f32(const float* x, const float* dy, float* dx, size_t n) {
    GRID_STRIDE(i, n) {
        const float s = sigmoid_value(x[i]);
        dx[i] = __fmul_rn(dy[i], __fmul_rn(s, __fsub_rn(1.0f, s)));
    }
}
