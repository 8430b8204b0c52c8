// gelu.cu — GELU, x * Phi(x) (PyTorch's nn.GELU(), the erf form), forward and backward.
// The CPU reference is src/ops/gelu/, whose expressions and order these follow.
// The contract every file of kernels/ keeps is kernels/README.md's.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// GELU, x * Phi(x) (PyTorch's nn.GELU(), the erf form), in f32: the expressions and their
// order src/ops/gelu/'s (the CPU reference, which says why): erfc(|x|/sqrt 2) by
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
