// silu.cu — SiLU, x * sigmoid(x) (PyTorch's nn.SiLU()), forward and backward. The CPU
// reference is src/ops/silu/cpu.rs, whose f32 expressions these compute in the same order
// (e^-x by lockstep_exp of common.cuh), so the two agree bit for bit.
// The contract every file of kernels/ keeps is kernels/README.md's.

// sigmoid(x) = 1 / (1 + e^-x)
__device__ float silu_sigmoid(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, lockstep_exp(-x)));
}

// y = x * sigmoid(x)
// x, y: (n)
extern "C" __global__ void silu_fwd_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = __fmul_rn(x[i], silu_sigmoid(x[i])); }
}

// dx = dy * (s * (1 + x * (1 - s))), s = sigmoid(x): the slope the CPU's forward keeps,
// recomputed from x.
// x, dy, dx: (n)
extern "C" __global__ void silu_bwd_f32(const float* x, const float* dy, float* dx, size_t n) {
    GRID_STRIDE(i, n) {
        const float v = x[i];
        const float s = silu_sigmoid(v);
        const float slope = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(v, __fsub_rn(1.0f, s))));
        dx[i] = __fmul_rn(dy[i], slope);
    }
}
