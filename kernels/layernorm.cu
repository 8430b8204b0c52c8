// layernorm.cu — LayerNorm over the last dimension (rows of C values), float32 in and out,
// float64 inside.
//
// Owns: the forward (each row's mean and rstd, y = xhat * w + b, the statistics saved for
// the backward), the backward's dx, and dweight / dbias summed over the rows in a FIXED
// order: each chunk of `chunk` rows' column sums (layernorm_partial_bwd), then the chunks'
// sums in chunk order (layernorm_params_bwd). No atomics, so every result is a function
// of the inputs and the shape alone.
//
// The arithmetic is src/ops/layernorm/cpu.rs's (the CPU reference; its docs state the order),
// operation for operation, in double: a row's sums take LN_LANES lanes (lane j adds the
// elements i = j, j + 32, ... from 0.0), which meet in the fixed tree of ln_lane_tree;
// mean = sum / C, var = sum of squared deviations / C, rstd = 1 / sqrt(var + eps);
// xhat = (x - mean) * rstd, rounded to float where the CPU layer keeps it as float. The
// _rn intrinsics keep NVRTC from contracting a*b + c into an FMA (-fmad=true), which the
// CPU does not do; double division and sqrt are IEEE round-to-nearest on both, so the
// op's host check (src/ops/layernorm/gpu.rs) holds these kernels to the CPU bit for bit.
//
// Launch shapes (the op's gpu.rs): the row kernels run LN_BLOCK threads a
// block, one warp of LN_LANES threads a row (LN_BLOCK / LN_LANES rows a block, grid =
// ceil(rows / 8)); the column kernels are grid-stride loops of any shape.
// Backward kernels WRITE dx and ACCUMULATE (+=) into dweight and dbias.

#define LN_LANES 32
#define LN_BLOCK 256
#define LN_ROWS_PER_BLOCK (LN_BLOCK / LN_LANES)

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// The sum of one row's lane sums, v being this thread's; `part` is LN_BLOCK doubles, the
// row's lanes at part[base .. base + LN_LANES). Lane t adds lane t + s for s = 16, 8, 4, 2,
// 1 (src/ops/layernorm/cpu.rs's lane_tree). Every thread of the block calls it (it meets at
// __syncthreads), live row or not; the sum is returned to every lane of the row.
__device__ double ln_lane_tree(double v, double* part, unsigned lane, unsigned base) {
    part[base + lane] = v;
    __syncthreads();
    for (unsigned s = LN_LANES / 2; s > 0; s >>= 1) {
        if (lane < s) part[base + lane] = __dadd_rn(part[base + lane], part[base + lane + s]);
        __syncthreads();
    }
    const double total = part[base];
    __syncthreads();  // part is reused by the next call
    return total;
}

// x: (rows, C) -> y: (rows, C); weight: (C); bias: (C) or NULL (no shift);
// mean, rstd: (rows), written. grid = ceil(rows / LN_ROWS_PER_BLOCK), LN_BLOCK threads.
extern "C" __global__ void layernorm_fwd_f32(const float* x, float* y, const float* weight, const float* bias,
                                             double* mean, double* rstd, size_t rows, int c, float eps) {
    __shared__ double part[LN_BLOCK];
    const unsigned lane = threadIdx.x % LN_LANES, base = threadIdx.x - lane;
    const size_t row = (size_t)blockIdx.x * LN_ROWS_PER_BLOCK + threadIdx.x / LN_LANES;
    const bool live = row < rows;
    const float* xr = x + (live ? row : 0) * (size_t)c;
    double acc = 0.0;
    if (live)
        for (int i = (int)lane; i < c; i += LN_LANES) acc = __dadd_rn(acc, (double)xr[i]);
    const double mu = __ddiv_rn(ln_lane_tree(acc, part, lane, base), (double)c);
    acc = 0.0;
    if (live)
        for (int i = (int)lane; i < c; i += LN_LANES) {
            const double d = __dsub_rn((double)xr[i], mu);
            acc = __dadd_rn(acc, __dmul_rn(d, d));
        }
    const double var = __ddiv_rn(ln_lane_tree(acc, part, lane, base), (double)c);
    const double rs = __ddiv_rn(1.0, sqrt(__dadd_rn(var, (double)eps)));
    if (!live) return;
    float* yr = y + row * (size_t)c;
    for (int i = (int)lane; i < c; i += LN_LANES) {
        const double n = __dmul_rn(__dsub_rn((double)xr[i], mu), rs);
        const double scaled = __dmul_rn(n, (double)weight[i]);
        yr[i] = (float)(bias ? __dadd_rn(scaled, (double)bias[i]) : scaled);
    }
    if (lane == 0) {
        mean[row] = mu;
        rstd[row] = rs;
    }
}

// xhat of element i of a row, as the forward rounded it for the CPU layer's cache.
__device__ float ln_xhat(float x, double mu, double rs) { return (float)__dmul_rn(__dsub_rn((double)x, mu), rs); }

// dx = rstd * ((g - sum g / C) - xhat * (sum g*xhat / C)), g = dy * w, per row.
// x, dy: (rows, C) -> dx: (rows, C); weight: (C); mean, rstd: (rows) from the forward.
// grid = ceil(rows / LN_ROWS_PER_BLOCK), LN_BLOCK threads.
extern "C" __global__ void layernorm_bwd_f32(const float* x, const float* dy, float* dx, const float* weight,
                                             const double* mean, const double* rstd, size_t rows, int c) {
    __shared__ double part[LN_BLOCK];
    const unsigned lane = threadIdx.x % LN_LANES, base = threadIdx.x - lane;
    const size_t row = (size_t)blockIdx.x * LN_ROWS_PER_BLOCK + threadIdx.x / LN_LANES;
    const bool live = row < rows;
    const size_t at = (live ? row : 0) * (size_t)c;
    const double mu = live ? mean[row] : 0.0, rs = live ? rstd[row] : 0.0;
    double sg = 0.0, sgx = 0.0;
    if (live)
        for (int i = (int)lane; i < c; i += LN_LANES) {
            const double g = __dmul_rn((double)dy[at + i], (double)weight[i]);
            sg = __dadd_rn(sg, g);
            sgx = __dadd_rn(sgx, __dmul_rn(g, (double)ln_xhat(x[at + i], mu, rs)));
        }
    const double mg = __ddiv_rn(ln_lane_tree(sg, part, lane, base), (double)c);
    const double mgx = __ddiv_rn(ln_lane_tree(sgx, part, lane, base), (double)c);
    if (!live) return;
    for (int i = (int)lane; i < c; i += LN_LANES) {
        const double g = __dmul_rn((double)dy[at + i], (double)weight[i]);
        const double xh = (double)ln_xhat(x[at + i], mu, rs);
        dx[at + i] = (float)__dmul_rn(rs, __dsub_rn(__dsub_rn(g, mg), __dmul_rn(xh, mgx)));
    }
}

// Each chunk of `chunk` rows' column sums, rows in order from 0.0: partials (chunks, 2, C),
// [k][0][j] = sum dy*xhat, [k][1][j] = sum dy over rows k*chunk .. min(rows, (k+1)*chunk),
// chunks = ceil(rows / chunk). x, dy: (rows, C); mean, rstd: (rows). Grid-stride over
// chunks * C, one (chunk, column) a thread.
extern "C" __global__ void layernorm_partial_bwd_f32(const float* x, const float* dy, const double* mean,
                                                     const double* rstd, double* partials, size_t rows, int c,
                                                     int chunk) {
    const size_t chunks = (rows + (size_t)chunk - 1) / (size_t)chunk;
    GRID_STRIDE(t, chunks * (size_t)c) {
        const size_t k = t / (size_t)c, j = t % (size_t)c;
        const size_t last = (k + 1) * (size_t)chunk < rows ? (k + 1) * (size_t)chunk : rows;
        double pw = 0.0, pb = 0.0;
        for (size_t r = k * (size_t)chunk; r < last; ++r) {
            const size_t i = r * (size_t)c + j;
            const double d = (double)dy[i];
            pw = __dadd_rn(pw, __dmul_rn(d, (double)ln_xhat(x[i], mean[r], rstd[r])));
            pb = __dadd_rn(pb, d);
        }
        partials[(2 * k) * (size_t)c + j] = pw;
        partials[(2 * k + 1) * (size_t)c + j] = pb;
    }
}

// dweight[j] += (float)(sum over chunks, in order, of partials[k][0][j]); dbias likewise
// from [k][1][j], when given (NULL: no bias). partials: (chunks, 2, C), chunks >= 1;
// dweight, dbias: (C). Grid-stride over C.
extern "C" __global__ void layernorm_params_bwd_f32(const double* partials, float* dweight, float* dbias,
                                                    size_t chunks, int c) {
    GRID_STRIDE(j, (size_t)c) {
        double sw = partials[j], sb = partials[(size_t)c + j];
        for (size_t k = 1; k < chunks; ++k) {
            sw = __dadd_rn(sw, partials[(2 * k) * (size_t)c + j]);
            sb = __dadd_rn(sb, partials[(2 * k + 1) * (size_t)c + j]);
        }
        dweight[j] = __fadd_rn(dweight[j], (float)sw);
        if (dbias) dbias[j] = __fadd_rn(dbias[j], (float)sb);
    }
}
