// relu.cu — ReLU, max(x, 0), forward and backward (src/ops/relu/, the CPU reference).
// The contract every file of kernels/ keeps is kernels/README.md's.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// y = max(x, 0), as the CPU compares: x < 0 gives +0, anything else (−0, NaN) itself.
// x, y: (n)
extern "C" __global__ void relu_fwd_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = x[i] < 0.0f ? 0.0f : x[i]; }
}

// dx = dy where x > 0, else 0 (the subgradient at 0 is 0, as in PyTorch).
// x, dy, dx: (n)
extern "C" __global__ void relu_bwd_f32(const float* x, const float* dy, float* dx, size_t n) {
    GRID_STRIDE(i, n) { dx[i] = x[i] > 0.0f ? dy[i] : 0.0f; }
}
