// positional.cu — the learned positional embedding: the table's first T rows added to
// every sample (a broadcast add), forward and backward (src/ops/positional/, the CPU
// reference, followed exactly: the host-run kernel test compares the two bit for bit).
// The backward gives each (t, c) the sum over n of dy[n, t, c], n ascending, added into
// the gradient's value, and copies dy to dx (dx = dy) when dx is asked for, in the same
// pass. The contract every file of kernels/ keeps is kernels/README.md's.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// y[n, t, c] = x[n, t, c] + weight[t, c]: the table's first T rows, broadcast over N.
// x, y: (N, T, C) with tc = T*C, total = N*T*C; weight: (T, C) (its first T rows)
extern "C" __global__ void positional_embedding_fwd_f32(const float* x, const float* weight,
                                                        float* y, size_t tc, size_t total) {
    GRID_STRIDE(i, total) { y[i] = x[i] + weight[i % tc]; }
}

// dweight[t, c] += dy[n, t, c] for n = 0, 1, ..., one add at a time into the gradient's
// value; dx = dy (WRITTEN) when dx is not NULL.
// dy, dx: (N, T, C) with tc = T*C; dweight: (T, C) (the table's first T rows)
extern "C" __global__ void positional_embedding_bwd_f32(const float* dy, float* dweight, float* dx,
                                                        int n, size_t tc) {
    GRID_STRIDE(j, tc) {
        float g = dweight[j];
        for (int s = 0; s < n; ++s) {
            const float d = dy[(size_t)s * tc + j];
            g += d;
            if (dx) dx[(size_t)s * tc + j] = d;
        }
        dweight[j] = g;
    }
}
