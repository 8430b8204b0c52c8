// elementwise.cu — float32 kernels that touch each element independently, plus the
// two per-channel bias reductions that pair with them.
//
// Owns: the residual add, relu, gelu (exact, erf-based), rescale (y = x*scale + offset), bias add for NCHW and (N, O) tensors with
// their reductions, scale-in-place, fill. Leaves matrix products to cuBLAS and anything
// that needs a cross-element reduction beyond a bias sum to its own file.
//
// Contract shared by every file in kernels/:
//   * `extern "C"` names are `<op>_<fwd|bwd>_f32` (or `<op>_f32` for kernels outside
//     autograd, listed in src/cuda/kernels.rs); they come from kernel_name() on the host.
//   * Element loops are grid-stride loops over `size_t`, so any grid size is correct.
//   * Backward kernels WRITE input gradients (dx) and ACCUMULATE (+=) into parameter
//     gradients (dbias, dgamma, ...), so several shards can share one gradient buffer.
//   * Reductions run in one fixed order for a fixed launch shape, so results are
//     bitwise reproducible run to run.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// Block size the block-per-channel reductions are written for; the host launches
// exactly this many threads per block (src/cuda/launch.rs REDUCE_BLOCK).
#define REDUCE_BLOCK 256

// y = max(x, 0)
// x, y: (n)
// y = a + b: a residual block's add (body + shortcut), and its backward's fan-in
// (dx = dbody + dshortcut), as src/nn/residual.rs adds on the CPU.
// a, b, y: (n)
extern "C" __global__ void residual_add_fwd_f32(const float* a, const float* b, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = a[i] + b[i]; }
}

extern "C" __global__ void relu_fwd_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = x[i] > 0.0f ? x[i] : 0.0f; }
}

// dx = dy where x > 0, else 0 (the subgradient at 0 is 0, as in PyTorch).
// x, dy, dx: (n)
extern "C" __global__ void relu_bwd_f32(const float* x, const float* dy, float* dx, size_t n) {
    GRID_STRIDE(i, n) { dx[i] = x[i] > 0.0f ? dy[i] : 0.0f; }
}

// GELU, x * Phi(x) (PyTorch's nn.GELU(), the erf form), in f32: the expressions and their
// order src/nn/gelu.rs's (the CPU reference, which says why): erfc(|x|/sqrt 2) by
// Numerical Recipes' erfcc, exp by Cephes' expf, every operation an _rn intrinsic so that
// NVRTC contracts no multiply and add into an FMA, which the CPU does not do.
#define GELU_FRAC_1_SQRT_2 0.70710677f
#define GELU_FRAC_1_SQRT_2PI 0.3989423f

// e^x: n = round(x log2 e) (adding and subtracting 1.5 * 2^23), r = x - n ln 2 (two parts), a degree-6 polynomial, 2^n
// by the exponent bits; 0 below -87, +inf above 88, NaN stays NaN.
__device__ float gelu_exp(float x) {
    const float c = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __fsub_rn(__fadd_rn(__fmul_rn(c, 1.442695f), 12582912.0f), 12582912.0f);
    const float r = __fsub_rn(__fsub_rn(c, __fmul_rn(n, 0.6933594f)), __fmul_rn(n, -2.1219444e-4f));
    float p = __fadd_rn(__fmul_rn(1.9875691e-4f, r), 0.0013981999f);
    p = __fadd_rn(__fmul_rn(p, r), 0.008333452f);
    p = __fadd_rn(__fmul_rn(p, r), 0.041665796f);
    p = __fadd_rn(__fmul_rn(p, r), 0.16666666f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fadd_rn(__fmul_rn(p, __fmul_rn(r, r)), r), 1.0f);
    const float e = __fmul_rn(p, __int_as_float(((int)n + 127) << 23));
    return x < -87.0f ? 0.0f : (x > 88.0f ? __int_as_float(0x7f800000) : e);
}

// Phi(x): 1 - erfc(z)/2 for x >= 0, erfc(z)/2 below, z = |x|/sqrt 2,
// erfc(z) = t exp(q(t) - x^2/2), t = 1/(1 + z/2).
__device__ float gelu_cdf(float x) {
    const float z = __fmul_rn(fabsf(x), GELU_FRAC_1_SQRT_2);
    const float t = __fdiv_rn(1.0f, __fadd_rn(1.0f, __fmul_rn(0.5f, z)));
    // q(t) by Estrin's scheme, in the CPU's order: pairs c_2i + c_2i+1 t, then t^2, t^4, t^8.
    const float t2 = __fmul_rn(t, t);
    const float t4 = __fmul_rn(t2, t2);
    const float t8 = __fmul_rn(t4, t4);
    const float p01 = __fadd_rn(-1.2655122f, __fmul_rn(1.0000237f, t));
    const float p23 = __fadd_rn(0.37409195f, __fmul_rn(0.09678418f, t));
    const float p45 = __fadd_rn(-0.18628806f, __fmul_rn(0.27886808f, t));
    const float p67 = __fadd_rn(-1.135204f, __fmul_rn(1.4885159f, t));
    const float p89 = __fadd_rn(-0.82215226f, __fmul_rn(0.17087276f, t));
    const float q = __fadd_rn(__fadd_rn(__fadd_rn(p01, __fmul_rn(p23, t2)), __fmul_rn(__fadd_rn(p45, __fmul_rn(p67, t2)), t4)),
                              __fmul_rn(p89, t8));
    const float erfc = __fmul_rn(t, gelu_exp(__fsub_rn(q, __fmul_rn(__fmul_rn(0.5f, x), x))));
    return x >= 0.0f ? __fsub_rn(1.0f, __fmul_rn(0.5f, erfc)) : __fmul_rn(0.5f, erfc);
}

// y = x * Phi(x)
// x, y: (n)
extern "C" __global__ void gelu_fwd_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = __fmul_rn(x[i], gelu_cdf(x[i])); }
}

// dx = dy * (Phi(x) + x * phi(x)), phi(x) = exp(-x^2/2)/sqrt(2 pi)
// x, dy, dx: (n)
extern "C" __global__ void gelu_bwd_f32(const float* x, const float* dy, float* dx, size_t n) {
    GRID_STRIDE(i, n) {
        const float v = x[i];
        const float pdf = __fmul_rn(gelu_exp(__fmul_rn(__fmul_rn(-0.5f, v), v)), GELU_FRAC_1_SQRT_2PI);
        dx[i] = __fmul_rn(dy[i], __fadd_rn(gelu_cdf(v), __fmul_rn(v, pdf)));
    }
}

// y = x * scale + offset (Keras Rescaling)
// x, y: (n)
extern "C" __global__ void rescale_fwd_f32(const float* x, float* y, float scale, float offset,
                                           size_t n) {
    GRID_STRIDE(i, n) { y[i] = x[i] * scale + offset; }
}

// dx = dy * scale
// dy, dx: (n)
extern "C" __global__ void rescale_bwd_f32(const float* dy, float* dx, float scale, size_t n) {
    GRID_STRIDE(i, n) { dx[i] = dy[i] * scale; }
}

// y[n, c, h, w] += bias[c], in place.
// y: (N, C, H, W) with hw = H*W and total = N*C*H*W; bias: (C)
extern "C" __global__ void bias_nchw_fwd_f32(float* y, const float* bias, int c, size_t hw,
                                             size_t total) {
    GRID_STRIDE(i, total) { y[i] += bias[(i / hw) % (size_t)c]; }
}

// dbias[c] += sum over (n, h, w) of dy[n, c, h, w].
// One block of REDUCE_BLOCK threads per channel: grid = (C). Each thread sums a strided
// subset in a fixed order, then a fixed tree combines the partial sums.
// dy: (N, C, H, W) with hw = H*W; dbias: (C)
extern "C" __global__ void bias_nchw_bwd_f32(const float* dy, float* dbias, int n, int c,
                                             size_t hw) {
    __shared__ float part[REDUCE_BLOCK];
    const int ch = blockIdx.x;
    const size_t m = (size_t)n * hw;
    float acc = 0.0f;
    for (size_t j = threadIdx.x; j < m; j += REDUCE_BLOCK) {
        const size_t s = j / hw, p = j % hw;
        acc += dy[(s * (size_t)c + ch) * hw + p];
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int stride = REDUCE_BLOCK / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) part[threadIdx.x] += part[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) dbias[ch] += part[0];
}

// y[n, o] += bias[o], in place.
// y: (N, O) with total = N*O; bias: (O)
extern "C" __global__ void bias_cols_fwd_f32(float* y, const float* bias, int o, size_t total) {
    GRID_STRIDE(i, total) { y[i] += bias[i % (size_t)o]; }
}

// dbias[o] += sum over n of dy[n, o]; one thread per column, rows summed in order
// (neighbouring threads read neighbouring columns, so the loads coalesce).
// dy: (N, O); dbias: (O)
extern "C" __global__ void bias_cols_bwd_f32(const float* dy, float* dbias, int n, int o) {
    GRID_STRIDE(j, (size_t)o) {
        float acc = 0.0f;
        for (int s = 0; s < n; ++s) acc += dy[(size_t)s * o + j];
        dbias[j] += acc;
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
