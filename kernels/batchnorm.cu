// batchnorm.cu — BatchNormalization over (N, H, W) per channel, NCHW, float32.
//
// Owns: the training forward (batch statistics + running-stat update), the eval forward
// (running statistics) and the training backward (dx, dgamma, dbeta). The statistics are
// those of the shard this kernel sees, i.e. of one logical replica (DESIGN.md); averaging
// running stats across replicas is the trainer's job.
//
// Conventions (Keras BatchNormalization, which the MNIST example follows):
//   * mean and the variance used to normalise are the BIASED batch statistics (divide by M,
//     M = N*H*W); the running variance is updated with the UNBIASED one (times `unbias`),
//     as PyTorch and Keras do;
//   * running = keep * running + take * batch, the host's numbers (ops::batchnorm::cpu's
//     RunningUpdate: keep = momentum, take = 1 - momentum, unbias = M/(M-1) or 1 at M = 1),
//     blended here in float32 from float32 block sums where the CPU blends in float64;
//   * gamma == NULL means no scale (Keras scale=False): gamma is 1 and dgamma is not written;
//     beta == NULL means no shift (Keras center=False): beta is 0 and dbeta is not written;
//   * a shard with no sample (M == 0) leaves every output and running stat untouched.
// One block of REDUCE_BLOCK threads per channel: grid = (C). Sums are two-pass (mean
// first, then squared deviations) and combined by a fixed tree, so they are reproducible.
// Backward ACCUMULATES into dgamma and dbeta and WRITES dx.
//
// Synchronized BatchNorm (--sync-batchnorm: the statistics of the global batch, every
// logical replica's shard together; src/ops/batchnorm/) is four more kernels around the
// host's merge: batchnorm_moments_fwd (each channel's (mean, M2) of this shard, in f64),
// then the host gathers every replica's and merges them (global_moments of
// src/ops/batchnorm/cpu.rs, the CPU layer's own function), then batchnorm_sync_fwd
// (normalise with the merged statistics, move the running ones); in backward
// batchnorm_sums_bwd (each channel's (sum dy, sum dy*xhat) of this shard, in f64), the
// host's sum over the replicas (global_sums), then batchnorm_sync_bwd (dx from the global
// sums, dgamma and dbeta from the shard's own). Each mirrors the CPU layer's arithmetic
// (src/ops/batchnorm/cpu.rs) operation for operation (f64 per plane with eight
// accumulators, planes merged in sample order), so that on the same x a GPU replica hands
// the exchange the CPU's very payload; the op's host check (src/ops/batchnorm/gpu.rs)
// holds them to it bit for bit. The _rn intrinsics keep NVRTC from contracting a*b + c
// into one FMA (-fmad=true), which rounds once where the CPU rounds twice. One block per channel, as above; within it thread t computes the
// planes of samples t, t + 256, ... and thread 0 merges each round of 256 in sample order.

#define REDUCE_BLOCK 256

// Sum of v over the block, returned to every thread; `part` is REDUCE_BLOCK floats.
__device__ float block_sum(float v, float* part) {
    part[threadIdx.x] = v;
    __syncthreads();
    for (int stride = REDUCE_BLOCK / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) part[threadIdx.x] += part[threadIdx.x + stride];
        __syncthreads();
    }
    const float total = part[0];
    __syncthreads();  // part is reused by the next call
    return total;
}

// Index of element j (0 <= j < N*HW) of channel ch in an NCHW tensor.
__device__ size_t nchw_index(size_t j, int ch, int c, size_t hw) {
    return ((j / hw) * (size_t)c + ch) * hw + j % hw;
}

// x: (N, C, H, W), hw = H*W -> y: (N, C, H, W)
// gamma, beta: (C) or NULL; running_mean, running_var: (C), updated in place;
// save_mean, save_invstd: (C), written for the backward pass.
extern "C" __global__ void batchnorm_train_fwd_f32(const float* x, float* y, const float* gamma,
                                                   const float* beta, float* running_mean,
                                                   float* running_var, float* save_mean,
                                                   float* save_invstd, int n, int c, size_t hw,
                                                   float keep, float take, float unbias,
                                                   float eps) {
    __shared__ float part[REDUCE_BLOCK];
    const int ch = blockIdx.x;
    const size_t m = (size_t)n * hw;
    if (m == 0) return;
    float acc = 0.0f;
    for (size_t j = threadIdx.x; j < m; j += REDUCE_BLOCK) acc += x[nchw_index(j, ch, c, hw)];
    const float mean = block_sum(acc, part) / (float)m;
    acc = 0.0f;
    for (size_t j = threadIdx.x; j < m; j += REDUCE_BLOCK) {
        const float d = x[nchw_index(j, ch, c, hw)] - mean;
        acc += d * d;
    }
    const float var = block_sum(acc, part) / (float)m;
    const float invstd = rsqrtf(var + eps);
    const float g = gamma ? gamma[ch] : 1.0f;
    const float b = beta ? beta[ch] : 0.0f;
    for (size_t j = threadIdx.x; j < m; j += REDUCE_BLOCK) {
        const size_t i = nchw_index(j, ch, c, hw);
        y[i] = (x[i] - mean) * invstd * g + b;
    }
    if (threadIdx.x == 0) {
        running_mean[ch] = keep * running_mean[ch] + take * mean;
        running_var[ch] = keep * running_var[ch] + take * (var * unbias);
        save_mean[ch] = mean;
        save_invstd[ch] = invstd;
    }
}

// Eval mode: y = (x - running_mean) / sqrt(running_var + eps) * gamma + beta.
// One thread per element (no reduction).
// x: (N, C, H, W) with total = N*C*H*W, hw = H*W -> y: same; gamma, beta: (C) or NULL
extern "C" __global__ void batchnorm_eval_fwd_f32(const float* x, float* y, const float* gamma,
                                                  const float* beta, const float* running_mean,
                                                  const float* running_var, int c, size_t hw,
                                                  size_t total, float eps) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)blockDim.x * gridDim.x) {
        const int ch = (int)((i / hw) % (size_t)c);
        const float g = gamma ? gamma[ch] : 1.0f;
        const float b = beta ? beta[ch] : 0.0f;
        y[i] = (x[i] - running_mean[ch]) * rsqrtf(running_var[ch] + eps) * g + b;
    }
}

// Training backward, with xhat = (x - mean) * invstd:
//   dbeta  += sum(dy)             dgamma += sum(dy * xhat)
//   dx = g * invstd / M * (M * dy - sum(dy) - xhat * sum(dy * xhat))
// x, dy: (N, C, H, W) -> dx: (N, C, H, W); gamma: (C) or NULL;
// save_mean, save_invstd: (C) from the forward; dgamma, dbeta: (C) or NULL (NULL exactly
// when gamma / beta is NULL).
extern "C" __global__ void batchnorm_train_bwd_f32(const float* x, const float* dy, float* dx,
                                                   const float* gamma, const float* save_mean,
                                                   const float* save_invstd, float* dgamma,
                                                   float* dbeta, int n, int c, size_t hw) {
    __shared__ float part[REDUCE_BLOCK];
    const int ch = blockIdx.x;
    const size_t m = (size_t)n * hw;
    if (m == 0) return;
    const float mean = save_mean[ch], invstd = save_invstd[ch];
    float acc_dy = 0.0f, acc_dyx = 0.0f;
    for (size_t j = threadIdx.x; j < m; j += REDUCE_BLOCK) {
        const size_t i = nchw_index(j, ch, c, hw);
        acc_dy += dy[i];
        acc_dyx += dy[i] * (x[i] - mean) * invstd;
    }
    const float sum_dy = block_sum(acc_dy, part);
    const float sum_dyx = block_sum(acc_dyx, part);
    const float g = gamma ? gamma[ch] : 1.0f;
    const float k = g * invstd / (float)m;
    for (size_t j = threadIdx.x; j < m; j += REDUCE_BLOCK) {
        const size_t i = nchw_index(j, ch, c, hw);
        const float xhat = (x[i] - mean) * invstd;
        dx[i] = k * ((float)m * dy[i] - sum_dy - xhat * sum_dyx);
    }
    if (threadIdx.x == 0) {
        if (dgamma) dgamma[ch] += sum_dyx;
        if (dbeta) dbeta[ch] += sum_dy;
    }
}

// ---- synchronized BatchNorm ---------------------------------------------------------

// Sum of v[0..len] in f64 with eight accumulators, as ops::batchnorm::cpu's sum_f64 (the order
// is fixed by the length alone). Iterator sums start from -0.0, Rust's identity of f64
// addition (-0.0 + x is x for every x).
__device__ double sum_f64(const float* v, size_t len) {
    double acc[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    const size_t chunks = len / 8;
    for (size_t k = 0; k < chunks; ++k)
        for (int j = 0; j < 8; ++j) acc[j] = __dadd_rn(acc[j], (double)v[8 * k + j]);
    double tail = -0.0;
    for (size_t i = 8 * chunks; i < len; ++i) tail = __dadd_rn(tail, (double)v[i]);
    double total = -0.0;
    for (int j = 0; j < 8; ++j) total = __dadd_rn(total, acc[j]);
    return __dadd_rn(total, tail);
}

// Sum of (v - m)^2 in f64, as ops::batchnorm::cpu's sum_sq_dev_f64.
__device__ double sum_sq_dev_f64(const float* v, size_t len, double m) {
    double acc[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    const size_t chunks = len / 8;
    for (size_t k = 0; k < chunks; ++k)
        for (int j = 0; j < 8; ++j) {
            const double d = __dsub_rn((double)v[8 * k + j], m);
            acc[j] = __dadd_rn(acc[j], __dmul_rn(d, d));
        }
    double tail = -0.0;
    for (size_t i = 8 * chunks; i < len; ++i) {
        const double d = __dsub_rn((double)v[i], m);
        tail = __dadd_rn(tail, __dmul_rn(d, d));
    }
    double total = -0.0;
    for (int j = 0; j < 8; ++j) total = __dadd_rn(total, acc[j]);
    return __dadd_rn(total, tail);
}

// ops::batchnorm::cpu's Moments::merge (Chan, Golub, LeVeque): (count, mean, m2) += b's values.
__device__ void merge_moments(double* count, double* mean, double* m2, double b_count, double b_mean,
                              double b_m2) {
    if (b_count == 0.0) return;
    if (*count == 0.0) {
        *count = b_count;
        *mean = b_mean;
        *m2 = b_m2;
        return;
    }
    const double delta = __dsub_rn(b_mean, *mean), total = __dadd_rn(*count, b_count);
    *mean = __dadd_rn(*mean, __ddiv_rn(__dmul_rn(delta, b_count), total));
    const double cross = __ddiv_rn(__dmul_rn(__dmul_rn(__dmul_rn(delta, delta), *count), b_count), total);
    *m2 = __dadd_rn(*m2, __dadd_rn(b_m2, cross));
    *count = total;
}

// x: (N, C, H, W), hw = H*W -> moments: (C, 2), each channel's (mean, M2) in f64, M2 the
// sum of squared deviations: each plane's mean and M2 (sum_f64 / hw, sum_sq_dev_f64),
// merged in sample order. A channel of no sample is (0, 0), as the layer's. grid = (C).
extern "C" __global__ void batchnorm_moments_fwd_f32(const float* x, double* moments, int n, int c, size_t hw) {
    __shared__ double plane_mean[REDUCE_BLOCK];
    __shared__ double plane_m2[REDUCE_BLOCK];
    const int ch = blockIdx.x;
    double count = 0.0, mean = 0.0, m2 = 0.0;
    for (int first = 0; first < n; first += REDUCE_BLOCK) {
        const int s = first + (int)threadIdx.x;
        if (s < n) {
            const float* p = x + ((size_t)s * c + ch) * hw;
            const double pm = __ddiv_rn(sum_f64(p, hw), (double)hw);
            plane_mean[threadIdx.x] = pm;
            plane_m2[threadIdx.x] = sum_sq_dev_f64(p, hw, pm);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const int last = n - first < REDUCE_BLOCK ? n - first : REDUCE_BLOCK;
            for (int t = 0; t < last; ++t) merge_moments(&count, &mean, &m2, (double)hw, plane_mean[t], plane_m2[t]);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        moments[2 * (size_t)ch] = mean;
        moments[2 * (size_t)ch + 1] = m2;
    }
}

// Training forward with the merged statistics of the global batch:
//   stats: (C, 4) per channel (mean, var, mean_f32, invstd_f32) in f64, var BIASED and
//   mean_f32 = (float)mean, invstd_f32 = (float)(1 / sqrt(var + eps)) as the host's layer
//   computes them (exact in f64);
//   y = ((x - mean_f32) * invstd_f32) * gamma + beta, in f32 as the CPU layer (its xhat
//   times gamma plus beta; gamma 1 and beta 0 when absent);
//   running = keep * running + take * mean (running_var: + (take * var) * unbias), in f64
//   and rounded to f32: ops::batchnorm::cpu's RunningUpdate for the GLOBAL count;
//   save_mean, save_invstd = mean_f32, invstd_f32, for the backward.
// x, y: (N, C, H, W) with total = N*C*H*W, hw = H*W; gamma, beta: (C) or NULL;
// running_mean, running_var, save_mean, save_invstd: (C). A grid-stride loop over the
// elements; the per-channel writes by the first C threads.
extern "C" __global__ void batchnorm_sync_fwd_f32(const float* x, float* y, const float* gamma, const float* beta,
                                                  const double* stats, float* running_mean, float* running_var,
                                                  float* save_mean, float* save_invstd, int c, size_t hw,
                                                  size_t total, double keep, double take, double unbias) {
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t step = (size_t)blockDim.x * gridDim.x;
    for (size_t ch = first; ch < (size_t)c; ch += step) {
        const double mean = stats[4 * ch], var = stats[4 * ch + 1];
        running_mean[ch] = (float)__dadd_rn(__dmul_rn(keep, (double)running_mean[ch]), __dmul_rn(take, mean));
        running_var[ch] =
            (float)__dadd_rn(__dmul_rn(keep, (double)running_var[ch]), __dmul_rn(__dmul_rn(take, var), unbias));
        save_mean[ch] = (float)stats[4 * ch + 2];
        save_invstd[ch] = (float)stats[4 * ch + 3];
    }
    for (size_t i = first; i < total; i += step) {
        const size_t ch = (i / hw) % (size_t)c;
        const float mu = (float)stats[4 * ch + 2], is = (float)stats[4 * ch + 3];
        const float g = gamma ? gamma[ch] : 1.0f;
        const float b = beta ? beta[ch] : 0.0f;
        const float xhat = __fmul_rn(__fsub_rn(x[i], mu), is);
        y[i] = __fadd_rn(__fmul_rn(xhat, g), b);
    }
}

// Each plane's (sum dy, sum dy*xhat) in f64 with eight accumulators, as ops::batchnorm::cpu's
// sums_dy_dyx; xhat = (x - mean) * invstd in f32, the very xhat the forward made.
__device__ void sums_dy_dyx(const float* x, const float* dy, size_t len, float mean, float invstd, double* sd,
                            double* sdx) {
    double a[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    double b[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    const size_t chunks = len / 8;
    for (size_t k = 0; k < chunks; ++k)
        for (int j = 0; j < 8; ++j) {
            const size_t i = 8 * k + j;
            const float xhat = __fmul_rn(__fsub_rn(x[i], mean), invstd);
            a[j] = __dadd_rn(a[j], (double)dy[i]);
            b[j] = __dadd_rn(b[j], __dmul_rn((double)dy[i], (double)xhat));
        }
    double ta = -0.0, tb = -0.0;
    for (size_t i = 8 * chunks; i < len; ++i) {
        const float xhat = __fmul_rn(__fsub_rn(x[i], mean), invstd);
        ta = __dadd_rn(ta, (double)dy[i]);
        tb = __dadd_rn(tb, __dmul_rn((double)dy[i], (double)xhat));
    }
    double sa = -0.0, sb = -0.0;
    for (int j = 0; j < 8; ++j) {
        sa = __dadd_rn(sa, a[j]);
        sb = __dadd_rn(sb, b[j]);
    }
    *sd = __dadd_rn(sa, ta);
    *sdx = __dadd_rn(sb, tb);
}

// x, dy: (N, C, H, W), hw = H*W; save_mean, save_invstd: (C) from batchnorm_sync_fwd ->
// sums: (C, 2), each channel's (sum dy, sum dy*xhat) over this shard in f64: the planes'
// sums added in sample order from 0, as the CPU layer. grid = (C).
extern "C" __global__ void batchnorm_sums_bwd_f32(const float* x, const float* dy, const float* save_mean,
                                                  const float* save_invstd, double* sums, int n, int c,
                                                  size_t hw) {
    __shared__ double plane_sd[REDUCE_BLOCK];
    __shared__ double plane_sdx[REDUCE_BLOCK];
    const int ch = blockIdx.x;
    double sd = 0.0, sdx = 0.0;
    for (int first = 0; first < n; first += REDUCE_BLOCK) {
        const int s = first + (int)threadIdx.x;
        if (s < n) {
            const size_t at = ((size_t)s * c + ch) * hw;
            sums_dy_dyx(x + at, dy + at, hw, save_mean[ch], save_invstd[ch], &plane_sd[threadIdx.x],
                        &plane_sdx[threadIdx.x]);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const int last = n - first < REDUCE_BLOCK ? n - first : REDUCE_BLOCK;
            for (int t = 0; t < last; ++t) {
                sd = __dadd_rn(sd, plane_sd[t]);
                sdx = __dadd_rn(sdx, plane_sdx[t]);
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        sums[2 * (size_t)ch] = sd;
        sums[2 * (size_t)ch + 1] = sdx;
    }
}

// Training backward with the global batch's sums, as the CPU layer:
//   dgamma += (float)local sum dy*xhat, dbeta += (float)local sum dy (the shard's own: the
//   gradient exchange adds the shards');
//   dx = k * ((dy - md) - xhat * mdx), k = gamma * invstd, md = (float)(global sum dy /
//   count), mdx = (float)(global sum dy*xhat / count), count the global batch's values per
//   channel.
// x, dy, dx: (N, C, H, W) with total = N*C*H*W, hw = H*W; gamma: (C) or NULL; save_mean,
// save_invstd: (C); local, global: (C, 2); dgamma, dbeta: (C) or NULL (NULL exactly when
// gamma / beta is). A grid-stride loop; the per-channel adds by the first C threads.
extern "C" __global__ void batchnorm_sync_bwd_f32(const float* x, const float* dy, float* dx, const float* gamma,
                                                  const float* save_mean, const float* save_invstd,
                                                  const double* local, const double* global, float* dgamma,
                                                  float* dbeta, int c, size_t hw, size_t total, double count) {
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t step = (size_t)blockDim.x * gridDim.x;
    for (size_t ch = first; ch < (size_t)c; ch += step) {
        if (dgamma) dgamma[ch] = __fadd_rn(dgamma[ch], (float)local[2 * ch + 1]);
        if (dbeta) dbeta[ch] = __fadd_rn(dbeta[ch], (float)local[2 * ch]);
    }
    for (size_t i = first; i < total; i += step) {
        const size_t ch = (i / hw) % (size_t)c;
        const float g = gamma ? gamma[ch] : 1.0f;
        const float k = __fmul_rn(g, save_invstd[ch]);
        const float md = (float)__ddiv_rn(global[2 * ch], count);
        const float mdx = (float)__ddiv_rn(global[2 * ch + 1], count);
        const float xhat = __fmul_rn(__fsub_rn(x[i], save_mean[ch]), save_invstd[ch]);
        dx[i] = __fmul_rn(k, __fsub_rn(__fsub_rn(dy[i], md), __fmul_rn(xhat, mdx)));
    }
}

// num_batches_tracked of a training forward: rounded back to its integer (the average
// over logical replicas multiplies by 1/R, off by an ulp for some R), plus one, as
// src/ops/batchnorm/cpu.rs's count_up. count: (n), n = 1
extern "C" __global__ void batchnorm_count_fwd_f32(float* count, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        count[i] = __fadd_rn(rintf(count[i]), 1.0f);
    }
}
