// add.cu — Add, the sum of two or more inputs of one shape (src/ops/add/, the CPU
// reference), and y += x, the accumulation a graph sums a value's gradients with. The sum
// of K inputs is add_fwd of the first two, then add_into of each further one: the CPU's
// order, ((x0 + x1) + x2) + ..., each addition rounded once (__fadd_rn), so the two agree
// bit for bit. The backward is no kernel: each input's gradient is a copy of dy.
// The contract every file of kernels/ keeps is kernels/README.md's.

// y = a + b
// a, b, y: (n)
extern "C" __global__ void add_fwd_f32(const float* a, const float* b, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = __fadd_rn(a[i], b[i]); }
}

// y += x. x may not alias y.
// x, y: (n)
extern "C" __global__ void add_into_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = __fadd_rn(y[i], x[i]); }
}
