// softmax.cu — softmax over the last dimension (rows of C values), float32 in and out, the
// sums in float64 (Keras's Softmax(axis=-1), PyTorch's softmax(x, dim=-1)). The arithmetic
// is src/ops/softmax/cpu.rs's (the CPU reference; its docs state it), operation for
// operation: the row's max; e = e^(x - max) in float (lockstep_exp of common.cuh); the sum
// of e over SM_LANES lanes (lane j adds the elements i = j, j + 32, ... from 0.0) meeting in
// the fixed tree of sm_lane_tree (kernels/layernorm.cu's); y = e / sum in double, rounded
// once. The backward recomputes y from x the same way, then dot = sum dy*y over the same
// lanes and dx = y * (dy - dot) in double. The _rn intrinsics keep NVRTC from contracting;
// double division is IEEE on both sides, so the host check holds these kernels to the CPU
// bit for bit.
//
// Launch shape (the op's gpu.rs): SM_BLOCK threads a block, one warp of SM_LANES threads a
// row, grid = ceil(rows / 8). dx is WRITTEN.

#define SM_LANES 32
#define SM_BLOCK 256
#define SM_ROWS_PER_BLOCK (SM_BLOCK / SM_LANES)

// The sum of one row's lane sums (lane t adds lane t + s for s = 16, 8, 4, 2, 1); `part`
// is SM_BLOCK doubles. Every thread of the block calls it (it meets at __syncthreads).
__device__ double sm_lane_tree(double v, double* part, unsigned lane, unsigned base) {
    part[base + lane] = v;
    __syncthreads();
    for (unsigned s = SM_LANES / 2; s > 0; s >>= 1) {
        if (lane < s) part[base + lane] = __dadd_rn(part[base + lane], part[base + lane + s]);
        __syncthreads();
    }
    const double total = part[base];
    __syncthreads();  // part is reused by the next call
    return total;
}

// The row's largest value, NaN passed over (fmaxf); `part` is SM_BLOCK floats. Every
// thread of the block calls it.
__device__ float sm_lane_max(float v, float* part, unsigned lane, unsigned base) {
    part[base + lane] = v;
    __syncthreads();
    for (unsigned s = SM_LANES / 2; s > 0; s >>= 1) {
        if (lane < s) part[base + lane] = fmaxf(part[base + lane], part[base + lane + s]);
        __syncthreads();
    }
    const float total = part[base];
    __syncthreads();
    return total;
}

// The row's max and its sum of e^(x - max): what y = e^(x - max) / sum needs.
__device__ void sm_row_stats(const float* xr, int c, bool live, float* fpart, double* part, unsigned lane,
                             unsigned base, float* max, double* sum) {
    float m = -__int_as_float(0x7f800000);  // -inf
    if (live)
        for (int i = (int)lane; i < c; i += SM_LANES) m = fmaxf(m, xr[i]);
    *max = sm_lane_max(m, fpart, lane, base);
    double acc = 0.0;
    if (live)
        for (int i = (int)lane; i < c; i += SM_LANES) acc = __dadd_rn(acc, (double)lockstep_exp(__fsub_rn(xr[i], *max)));
    *sum = sm_lane_tree(acc, part, lane, base);
}

// y of one element, from the row's max and sum.
__device__ float sm_y(float x, float max, double sum) {
    return (float)__ddiv_rn((double)lockstep_exp(__fsub_rn(x, max)), sum);
}

// x: (rows, C) -> y: (rows, C). grid = ceil(rows / SM_ROWS_PER_BLOCK), SM_BLOCK threads.
extern "C" __global__ void softmax_fwd_f32(const float* x, float* y, size_t rows, int c) {
    __shared__ double part[SM_BLOCK];
    __shared__ float fpart[SM_BLOCK];
    const unsigned lane = threadIdx.x % SM_LANES, base = threadIdx.x - lane;
    const size_t row = (size_t)blockIdx.x * SM_ROWS_PER_BLOCK + threadIdx.x / SM_LANES;
    const bool live = row < rows;
    const float* xr = x + (live ? row : 0) * (size_t)c;
    float max;
    double sum;
    sm_row_stats(xr, c, live, fpart, part, lane, base, &max, &sum);
    if (!live) return;
    float* yr = y + row * (size_t)c;
    for (int i = (int)lane; i < c; i += SM_LANES) yr[i] = sm_y(xr[i], max, sum);
}

// dx = y * (dy - sum dy*y), y recomputed from x. x, dy: (rows, C) -> dx: (rows, C).
// grid = ceil(rows / SM_ROWS_PER_BLOCK), SM_BLOCK threads.
extern "C" __global__ void softmax_bwd_f32(const float* x, const float* dy, float* dx, size_t rows, int c) {
    __shared__ double part[SM_BLOCK];
    __shared__ float fpart[SM_BLOCK];
    const unsigned lane = threadIdx.x % SM_LANES, base = threadIdx.x - lane;
    const size_t row = (size_t)blockIdx.x * SM_ROWS_PER_BLOCK + threadIdx.x / SM_LANES;
    const bool live = row < rows;
    const size_t at = (live ? row : 0) * (size_t)c;
    float max;
    double sum;
    sm_row_stats(x + at, c, live, fpart, part, lane, base, &max, &sum);
    double acc = 0.0;
    if (live)
        for (int i = (int)lane; i < c; i += SM_LANES)
            acc = __dadd_rn(acc, __dmul_rn((double)dy[at + i], (double)sm_y(x[at + i], max, sum)));
    const double dot = sm_lane_tree(acc, part, lane, base);
    if (!live) return;
    for (int i = (int)lane; i < c; i += SM_LANES) {
        const double yi = (double)sm_y(x[at + i], max, sum);
        dx[at + i] = (float)__dmul_rn(yi, __dsub_rn((double)dy[at + i], dot));
    }
}
