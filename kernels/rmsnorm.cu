// rmsnorm.cu — RMSNorm over the last dimension (rows of C values), float32 in and out,
// float64 inside: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) (PyTorch's
// nn.RMSNorm, Llama's).
//
// Owns: the forward (each row's rstd, saved for the backward), the backward's dx, and
// dweight summed over the rows in a FIXED order: each chunk of `chunk` rows' column sums
// (rmsnorm_partial_bwd), then the chunks' sums in chunk order (rmsnorm_params_bwd). No
// atomics, so every result is a function of the inputs and the shape alone.
//
// The arithmetic is src/ops/rmsnorm/cpu.rs's (the CPU reference; its docs state the order),
// operation for operation, in double: a row's sums take RMS_LANES lanes (lane j adds the
// elements i = j, j + 32, ... from 0.0), which meet in the fixed tree of rms_lane_tree
// (kernels/layernorm.cu's); xhat = x * rstd, rounded to float where the CPU layer keeps it
// as float. The _rn intrinsics keep NVRTC from contracting a*b + c into an FMA; double
// division and sqrt are IEEE round-to-nearest on both sides, so the op's host check
// (src/ops/rmsnorm/gpu.rs) holds these kernels to the CPU bit for bit.
//
// Launch shapes (the op's gpu.rs): the row kernels run RMS_BLOCK threads a block, one warp
// of RMS_LANES threads a row (grid = ceil(rows / 8)); the column kernels are grid-stride
// loops of any shape. Backward kernels WRITE dx and ACCUMULATE (+=) into dweight.

#define RMS_LANES 32
#define RMS_BLOCK 256
#define RMS_ROWS_PER_BLOCK (RMS_BLOCK / RMS_LANES)

// The sum of one row's lane sums, v being this thread's; `part` is RMS_BLOCK doubles, the
// row's lanes at part[base .. base + RMS_LANES). Lane t adds lane t + s for s = 16, 8, 4,
// 2, 1. Every thread of the block calls it (it meets at __syncthreads), live row or not;
// the sum is returned to every lane of the row.
__device__ double rms_lane_tree(double v, double* part, unsigned lane, unsigned base) {
    part[base + lane] = v;
    __syncthreads();
    for (unsigned s = RMS_LANES / 2; s > 0; s >>= 1) {
        if (lane < s) part[base + lane] = __dadd_rn(part[base + lane], part[base + lane + s]);
        __syncthreads();
    }
    const double total = part[base];
    __syncthreads();  // part is reused by the next call
    return total;
}

// x: (rows, C) -> y: (rows, C); weight: (C); rstd: (rows), written.
// grid = ceil(rows / RMS_ROWS_PER_BLOCK), RMS_BLOCK threads.
extern "C" __global__ void rmsnorm_fwd_f32(const float* x, float* y, const float* weight, double* rstd, size_t rows,
                                           int c, float eps) {
    __shared__ double part[RMS_BLOCK];
    const unsigned lane = threadIdx.x % RMS_LANES, base = threadIdx.x - lane;
    const size_t row = (size_t)blockIdx.x * RMS_ROWS_PER_BLOCK + threadIdx.x / RMS_LANES;
    const bool live = row < rows;
    const float* xr = x + (live ? row : 0) * (size_t)c;
    double acc = 0.0;
    if (live)
        for (int i = (int)lane; i < c; i += RMS_LANES) acc = __dadd_rn(acc, __dmul_rn((double)xr[i], (double)xr[i]));
    const double ms = __ddiv_rn(rms_lane_tree(acc, part, lane, base), (double)c);
    const double rs = __ddiv_rn(1.0, sqrt(__dadd_rn(ms, (double)eps)));
    if (!live) return;
    float* yr = y + row * (size_t)c;
    for (int i = (int)lane; i < c; i += RMS_LANES) yr[i] = (float)__dmul_rn(__dmul_rn((double)xr[i], rs), (double)weight[i]);
    if (lane == 0) rstd[row] = rs;
}

// xhat of element i of a row, as the forward rounded it for the CPU layer's cache.
__device__ float rms_xhat(float x, double rs) { return (float)__dmul_rn((double)x, rs); }

// dx = rstd * (g - xhat * (sum g*xhat / C)), g = dy * w, per row.
// x, dy: (rows, C) -> dx: (rows, C); weight: (C); rstd: (rows) from the forward.
// grid = ceil(rows / RMS_ROWS_PER_BLOCK), RMS_BLOCK threads.
extern "C" __global__ void rmsnorm_bwd_f32(const float* x, const float* dy, float* dx, const float* weight,
                                           const double* rstd, size_t rows, int c) {
    __shared__ double part[RMS_BLOCK];
    const unsigned lane = threadIdx.x % RMS_LANES, base = threadIdx.x - lane;
    const size_t row = (size_t)blockIdx.x * RMS_ROWS_PER_BLOCK + threadIdx.x / RMS_LANES;
    const bool live = row < rows;
    const size_t at = (live ? row : 0) * (size_t)c;
    const double rs = live ? rstd[row] : 0.0;
    double sgx = 0.0;
    if (live)
        for (int i = (int)lane; i < c; i += RMS_LANES) {
            const double g = __dmul_rn((double)dy[at + i], (double)weight[i]);
            sgx = __dadd_rn(sgx, __dmul_rn(g, (double)rms_xhat(x[at + i], rs)));
        }
    const double mgx = __ddiv_rn(rms_lane_tree(sgx, part, lane, base), (double)c);
    if (!live) return;
    for (int i = (int)lane; i < c; i += RMS_LANES) {
        const double g = __dmul_rn((double)dy[at + i], (double)weight[i]);
        const double xh = (double)rms_xhat(x[at + i], rs);
        dx[at + i] = (float)__dmul_rn(rs, __dsub_rn(g, __dmul_rn(xh, mgx)));
    }
}

// Each chunk of `chunk` rows' column sums, rows in order from 0.0: partials (chunks, C),
// [k][j] = sum dy*xhat over rows k*chunk .. min(rows, (k+1)*chunk), chunks =
// ceil(rows / chunk). x, dy: (rows, C); rstd: (rows). Grid-stride over chunks * C, one
// (chunk, column) a thread.
extern "C" __global__ void rmsnorm_partial_bwd_f32(const float* x, const float* dy, const double* rstd,
                                                   double* partials, size_t rows, int c, int chunk) {
    const size_t chunks = (rows + (size_t)chunk - 1) / (size_t)chunk;
    GRID_STRIDE(t, chunks * (size_t)c) {
        const size_t k = t / (size_t)c, j = t % (size_t)c;
        const size_t last = (k + 1) * (size_t)chunk < rows ? (k + 1) * (size_t)chunk : rows;
        double pw = 0.0;
        for (size_t r = k * (size_t)chunk; r < last; ++r) {
            const size_t i = r * (size_t)c + j;
            pw = __dadd_rn(pw, __dmul_rn((double)dy[i], (double)rms_xhat(x[i], rstd[r])));
        }
        partials[k * (size_t)c + j] = pw;
    }
}

// dweight[j] += (float)(sum over chunks, in order, of partials[k][j]). partials:
// (chunks, C), chunks >= 1; dweight: (C). Grid-stride over C.
extern "C" __global__ void rmsnorm_params_bwd_f32(const double* partials, float* dweight, size_t chunks, int c) {
    GRID_STRIDE(j, (size_t)c) {
        double sw = partials[j];
        for (size_t k = 1; k < chunks; ++k) sw = __dadd_rn(sw, partials[k * (size_t)c + j]);
        dweight[j] = __fadd_rn(dweight[j], (float)sw);
    }
}
