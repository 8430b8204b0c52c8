// linear.cu — a dense layer's bias: its add over the columns of (N, O) and its reduction
// over the rows; the matrix products are cuBLAS's (src/ops/linear/, the CPU reference).
// The contract every file of kernels/ keeps is kernels/README.md's.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// y[n, o] += bias[o], in place.
// y: (N, O) with total = N*O; bias: (O)
extern "C" __global__ void bias_cols_fwd_f32(float* y, const float* bias, int o, size_t total) {
    GRID_STRIDE(i, total) { y[i] += bias[i % (size_t)o]; }
}

// dbias[o] += sum over n of dy[n, o]; one thread per column, the rows added into the
// gradient's value one after the other, n ascending, as the CPU adds them (neighbouring
// threads read neighbouring columns, so the loads coalesce).
// dy: (N, O); dbias: (O)
extern "C" __global__ void bias_cols_bwd_f32(const float* dy, float* dbias, int n, int o) {
    GRID_STRIDE(j, (size_t)o) {
        float acc = dbias[j];
        for (int s = 0; s < n; ++s) acc += dy[(size_t)s * o + j];
        dbias[j] = acc;
    }
}
