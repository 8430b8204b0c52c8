// reduce.cu — the reduce step of the fallback all-reduce (used when NCCL is missing, or
// for several replicas on one GPU).
//
// Owns: summing K equally long buffers, staged side by side on one device, into one, in
// a fixed order (buffer 0, then 1, ..., K-1, left to right), then scaling. The copies
// that stage the buffers and broadcast the result are the collective's job
// (src/comm/), not a kernel's. Not part of autograd: the name is `<op>_f32`.

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
