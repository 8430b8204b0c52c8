// global_avg_pool.cu — global average pooling, the mean over (H, W) of NCHW tensors,
// forward and backward (src/ops/global_avg_pool/, the CPU reference).
// The contract every file of kernels/ keeps is kernels/README.md's.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// y[n, c] = mean over (h, w) of x[n, c, h, w]; one thread per (n, c): the plane's values
// added in order from -0, then multiplied by 1/(H*W) rounded to float, as the CPU does.
// x: (N, C, H, W) with nc = N*C, hw = H*W -> y: (N, C)
extern "C" __global__ void global_avgpool_fwd_f32(const float* x, float* y, size_t nc, size_t hw) {
    GRID_STRIDE(i, nc) {
        const float* row = x + i * hw;
        float acc = -0.0f;
        for (size_t p = 0; p < hw; ++p) acc += row[p];
        y[i] = acc * (1.0f / (float)hw);
    }
}

// dx[n, c, h, w] = dy[n, c] * (1/(H*W) rounded to float), as the CPU does; dx is WRITTEN.
// dy: (N, C) -> dx: (N, C, H, W) with nc = N*C, hw = H*W
extern "C" __global__ void global_avgpool_bwd_f32(const float* dy, float* dx, size_t nc,
                                                  size_t hw) {
    GRID_STRIDE(i, nc * hw) { dx[i] = dy[i / hw] * (1.0f / (float)hw); }
}
