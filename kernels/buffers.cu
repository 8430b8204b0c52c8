// buffers.cu — what the runtime does to whole buffers, knowing no op: the ordered sum of K
// buffers (the reduce step of the fallback all-reduce, and of gradient accumulation),
// scaling in place, filling. Not part of autograd: the names are `<op>_f32`.
// The contract every file of kernels/ keeps is kernels/README.md's.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// dst[i] = scale * (src[0, i] + src[1, i] + ... + src[K-1, i]), summed left to right.
// src: (K, n) -> dst: (n). dst may not alias src.
extern "C" __global__ void reduce_sum_f32(const float* src, float* dst, int k, float scale,
                                          size_t n) {
    GRID_STRIDE(i, n) {
        float acc = 0.0f;
        for (int r = 0; r < k; ++r) acc += src[(size_t)r * n + i];
        dst[i] = acc * scale;
    }
}

// x *= s, in place. x: (n)
extern "C" __global__ void scale_f32(float* x, float s, size_t n) {
    GRID_STRIDE(i, n) { x[i] *= s; }
}

// x = v. x: (n)
extern "C" __global__ void fill_f32(float* x, float v, size_t n) {
    GRID_STRIDE(i, n) { x[i] = v; }
}
