// multiply.cu — Multiply, the elementwise product of two or more inputs of one shape
// (src/ops/multiply/, the CPU reference). The product of K inputs is multiply_fwd of the
// first two, then multiply_into of each further one: the CPU's order, ((x0 · x1) · x2) · ...,
// each product rounded once (__fmul_rn), so the two agree bit for bit. The backward is the
// same two kernels: dx_i = ((dy · x_a) · x_b) · ... over the other inputs in order.
// The contract every file of kernels/ keeps is kernels/README.md's.

// y = a · b
// a, b, y: (n)
extern "C" __global__ void multiply_fwd_f32(const float* a, const float* b, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = __fmul_rn(a[i], b[i]); }
}

// y ·= x. x may not alias y.
// x, y: (n)
extern "C" __global__ void multiply_into_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = __fmul_rn(y[i], x[i]); }
}
