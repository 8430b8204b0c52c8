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
//   * running = keep * running + take * batch, the host's numbers (nn::batchnorm's
//     RunningUpdate: keep = momentum, take = 1 - momentum, unbias = M/(M-1) or 1 at M = 1),
//     blended here in float32 from float32 block sums where the CPU blends in float64;
//   * gamma == NULL means no scale (Keras scale=False): gamma is 1 and dgamma is not written;
//     beta == NULL means no shift (Keras center=False): beta is 0 and dbeta is not written;
//   * a shard with no sample (M == 0) leaves every output and running stat untouched.
// One block of REDUCE_BLOCK threads per channel: grid = (C). Sums are two-pass (mean
// first, then squared deviations) and combined by a fixed tree, so they are reproducible.
// Backward ACCUMULATES into dgamma and dbeta and WRITES dx.

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
