// common.cuh — what every kernel file is compiled with, in front of its own text (the
// declaration macro joins the two: src/cuda/declare.rs), so that it is written once:
//   * GRID_STRIDE, the grid-stride loop every element kernel walks (kernels/README.md);
//   * lockstep_exp, e^x by Cephes' expf, the very operations of the CPU's
//     `backend::simd::exp_f32`, each an _rn intrinsic so that NVRTC contracts no multiply
//     and add into an FMA, which the CPU does not do.

#ifndef LOCKSTEP_COMMON_CUH
#define LOCKSTEP_COMMON_CUH

#ifndef GRID_STRIDE
#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)
#endif

// e^x: n = round(x log2 e) (adding and subtracting 1.5 * 2^23), r = x - n ln 2 (two parts),
// a degree-6 polynomial, 2^n by the exponent bits; 0 below -87, +inf above 88, NaN stays NaN.
__device__ float lockstep_exp(float x) {
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

#endif  // LOCKSTEP_COMMON_CUH

