// tanh.cu — the hyperbolic tangent (PyTorch's nn.Tanh()), forward and backward. The CPU
// reference is src/ops/tanh/cpu.rs, whose f32 expressions these compute in the same order
// (on z = |x|: below 0.625 an odd polynomial, above it 1 - 2 / (e^2z + 1) with e^2z by
// lockstep_exp of common.cuh; the sign put back by copysignf), so the two agree bit for
// bit. The contract every file of kernels/ keeps is kernels/README.md's.

// tanh(x), both forms computed and one selected, as the CPU's branch-free code does.
__device__ float tanh_value(float x) {
    const float z = fabsf(x);
    const float s = __fmul_rn(z, z);
    float p = __fadd_rn(__fmul_rn(-5.7049887e-3f, s), 2.063909e-2f);
    p = __fsub_rn(__fmul_rn(p, s), 5.3739716e-2f);
    p = __fadd_rn(__fmul_rn(p, s), 1.3331442e-1f);
    p = __fsub_rn(__fmul_rn(p, s), 3.333328e-1f);
    const float small = __fadd_rn(__fmul_rn(__fmul_rn(p, s), z), z);
    const float large = __fsub_rn(1.0f, __fdiv_rn(2.0f, __fadd_rn(lockstep_exp(__fadd_rn(z, z)), 1.0f)));
    return copysignf(z < 0.625f ? small : large, x);
}

// y = tanh(x)
// x, y: (n)
extern "C" __global__ void tanh_fwd_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = tanh_value(x[i]); }
}

// dx = dy * (1 - t * t), t = tanh(x): the slope the CPU's forward keeps, recomputed from x.
// x, dy, dx: (n)
extern "C" __global__ void tanh_bwd_f32(const float* x, const float* dy, float* dx, size_t n) {
    GRID_STRIDE(i, n) {
        const float t = tanh_value(x[i]);
        dx[i] = __fmul_rn(dy[i], __fsub_rn(1.0f, __fmul_rn(t, t)));
    }
}
