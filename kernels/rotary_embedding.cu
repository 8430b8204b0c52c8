// rotary_embedding.cu — rotary position embeddings as Meta's Llama applies them: each pair
// (x[2i], x[2i+1]) of a head at position p turned by the angle of the table's entry (p, i),
// forward and backward (the inverse rotation).
//
// Owns: the rotation and its inverse. Leaves the table (cos and sin, (T, D/2) each, made
// once on the host and uploaded) and the launches to src/ops/rotary_embedding/; the CPU
// reference is its cpu.rs (rope_forward, rope_backward), which the host check in its
// gpu.rs holds these kernels to, bit for bit: the same products and sum, each rounded
// (the _rn intrinsics keep NVRTC from contracting them into an FMA).
//
// Shapes: N batch, T positions, H heads, D the head width (even), half = D/2;
// x, y, dy, dx: (N, T, H, D), pairs = N*T*H*half; cos, sin: (T, half).

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// y0 = x0*cos - x1*sin, y1 = x0*sin + x1*cos for pair e, at position (e / half / H) mod T.
extern "C" __global__ void rotary_embedding_fwd_f32(const float* x, float* y, const float* cos_t, const float* sin_t,
                                                    size_t pairs, int t, int heads, int half) {
    GRID_STRIDE(e, pairs) {
        const size_t i = e % half;
        const size_t p = (e / half / heads) % t;
        const float c = cos_t[p * half + i], s = sin_t[p * half + i];
        const float x0 = x[2 * e], x1 = x[2 * e + 1];
        y[2 * e] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        y[2 * e + 1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
}

// dx0 = dy0*cos + dy1*sin, dx1 = dy1*cos - dy0*sin: the rotation by the opposite angle.
extern "C" __global__ void rotary_embedding_bwd_f32(const float* dy, float* dx, const float* cos_t,
                                                    const float* sin_t, size_t pairs, int t, int heads, int half) {
    GRID_STRIDE(e, pairs) {
        const size_t i = e % half;
        const size_t p = (e / half / heads) % t;
        const float c = cos_t[p * half + i], s = sin_t[p * half + i];
        const float d0 = dy[2 * e], d1 = dy[2 * e + 1];
        dx[2 * e] = __fadd_rn(__fmul_rn(d0, c), __fmul_rn(d1, s));
        dx[2 * e + 1] = __fsub_rn(__fmul_rn(d1, c), __fmul_rn(d0, s));
    }
}
