// residual.cu — a residual block's add, body + shortcut, which is also its backward's
// fan-in (dx = dbody + dshortcut), as src/model/residual/cpu.rs adds on the CPU.
// The contract every file of kernels/ keeps is kernels/README.md's.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// y = a + b
// a, b, y: (n)
extern "C" __global__ void residual_add_fwd_f32(const float* a, const float* b, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = a[i] + b[i]; }
}
