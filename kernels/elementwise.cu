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

// GELU, exact (PyTorch nn.GELU(), approximate='none'), in double from the float input and
// rounded once, the expressions and their order src/nn/gelu.rs's (the CPU reference):
// cdf = Phi(x) = erfc(-x/sqrt 2)/2 (erfc, not 1 + erf, which cancels for x << 0) and
// pdf = phi(x) = exp(-x*x/2)/sqrt(2 pi). The _rn intrinsics keep NVRTC from contracting a
// multiply and an add into an FMA, which the CPU does not do.
#define GELU_FRAC_1_SQRT_2 0.70710678118654752440
#define GELU_FRAC_1_SQRT_2PI 0.39894228040143267794

// y = x * Phi(x)
// x, y: (n)
extern "C" __global__ void gelu_fwd_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) {
        const double v = (double)x[i];
        const double cdf = __dmul_rn(0.5, erfc(__dmul_rn(-v, GELU_FRAC_1_SQRT_2)));
        y[i] = (float)__dmul_rn(v, cdf);
    }
}

// dx = dy * (Phi(x) + x * phi(x))
// x, dy, dx: (n)
extern "C" __global__ void gelu_bwd_f32(const float* x, const float* dy, float* dx, size_t n) {
    GRID_STRIDE(i, n) {
        const double v = (double)x[i];
        const double cdf = __dmul_rn(0.5, erfc(__dmul_rn(-v, GELU_FRAC_1_SQRT_2)));
        const double pdf = __dmul_rn(exp(__dmul_rn(__dmul_rn(-0.5, v), v)), GELU_FRAC_1_SQRT_2PI);
        dx[i] = (float)__dmul_rn((double)dy[i], __dadd_rn(cdf, __dmul_rn(v, pdf)));
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
