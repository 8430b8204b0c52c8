// rescaling.cu — Keras's Rescaling, y = x * scale + offset, forward and backward
// (src/ops/rescaling/, the CPU reference).
// The contract every file of kernels/ keeps is kernels/README.md's.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// y = x * scale + offset (Keras Rescaling): the multiply rounded, then the add, as the CPU
// computes them (the _rn intrinsics keep NVRTC from contracting the two into an FMA).
// x, y: (n)
extern "C" __global__ void rescale_fwd_f32(const float* x, float* y, float scale, float offset,
                                           size_t n) {
    GRID_STRIDE(i, n) { y[i] = __fadd_rn(__fmul_rn(x[i], scale), offset); }
}

// dx = dy * scale
// dy, dx: (n)
extern "C" __global__ void rescale_bwd_f32(const float* dy, float* dx, float scale, size_t n) {
    GRID_STRIDE(i, n) { dx[i] = dy[i] * scale; }
}
