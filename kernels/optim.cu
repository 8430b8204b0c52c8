// optim.cu — fused optimizer updates, one thread per parameter element, and the global
// gradient norm that clipping scales them by.
//
// Owns: the SGD (momentum, Nesterov, weight decay), Adam and AdamW updates, with PyTorch's
// semantics so that a lockstep run can be checked against torch.optim, and the norm of
// the summed gradient with torch.nn.utils.clip_grad_norm_'s factor. Not part of autograd,
// so the names carry no direction: `<op>_f32`.
// The updates take the step's scalars as the host made them (optim::StepScalars, the same
// values the CPU optimiser uses): `grad_divisor`, the real size B of this global batch,
// divides the raw gradient first, since the replicas all-reduce gradient SUMS (DESIGN.md,
// exact averaging); `step_size` is lr (SGD) or lr / (1 - beta1^t) folded in float64
// (Adam); `weight_decay` and `shrink` are those of the run of parameters being updated
// (0 and 1 where the parameters do not decay: the host cuts the flat buffer into runs).
// `clip` is NULL without clipping, else the one float clip_factor_f32 wrote.
// Every replica runs the same update on the same inputs, so replicas stay identical.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// The gradient value the updates read: the sum's mean, clipped.
__device__ float mean_grad(const float* grad, size_t i, float grad_divisor, const float* clip) {
    const float g = grad[i] / grad_divisor;
    return clip ? g * clip[0] : g;
}

// torch.optim.SGD(dampening=0, nesterov=0|1), after clip_grad_norm_:
//   g = grad / grad_divisor * clip + weight_decay * p
//   buf = g at the first step (first != 0), else momentum * buf + g
//   p -= step_size * (nesterov ? g + momentum * buf : buf)
//   (with momentum == 0 this is p -= step_size * g)
// p, grad, buf: (n); clip: (1) or NULL
extern "C" __global__ void sgd_step_f32(float* p, const float* grad, float* buf, const float* clip,
                                        float step_size, float momentum, float weight_decay,
                                        float grad_divisor, int first, int nesterov, size_t n) {
    GRID_STRIDE(i, n) {
        const float g = mean_grad(grad, i, grad_divisor, clip) + weight_decay * p[i];
        const float b = first ? g : momentum * buf[i] + g;
        buf[i] = b;
        p[i] -= step_size * (nesterov ? g + momentum * b : b);
    }
}

// torch.optim.Adam(amsgrad=False) with L2 weight decay added to the gradient, and
// torch.optim.AdamW (weight_decay = 0, shrink = 1 - lr * wd), after clip_grad_norm_:
//   g = grad / grad_divisor * clip + weight_decay * p
//   m += (1 - beta1) * (g - m)
//   v = beta2 * v + (1 - beta2) * g * g
//   p = p * shrink - step_size * (m / (sqrt(v) / bc2_sqrt + eps))
// with step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t), t the 1-based
// step, both from the host's float64 arithmetic.
// p, grad, m, v: (n); clip: (1) or NULL
extern "C" __global__ void adam_step_f32(float* p, const float* grad, float* m, float* v,
                                         const float* clip, float step_size, float beta1,
                                         float beta2, float eps, float weight_decay, float shrink,
                                         float grad_divisor, float bc2_sqrt, size_t n) {
    GRID_STRIDE(i, n) {
        const float g = mean_grad(grad, i, grad_divisor, clip) + weight_decay * p[i];
        const float mi = m[i] + (1.0f - beta1) * (g - m[i]);
        const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * shrink - step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
    }
}

// The norm of the gradient (grad / grad_divisor) in optim::GradNorm's one association, so
// that a GPU's norm is bitwise the CPU's on the same sum: chunk b of NORM_CHUNK values is
// block b's (a grid-stride over chunks); thread t adds the squares of values t, t + 256, ...
// of it in f64, the 256 partial sums are added pairwise (t += t + s for s = 128, ..., 1),
// and partials[b] is the chunk's sum. The _rn intrinsics keep NVRTC from contracting
// a*b + c into one FMA, which rounds once where the CPU rounds twice.
// grad: (n) -> partials: (ceil(n / NORM_CHUNK))
#define NORM_THREADS 256
#define NORM_CHUNK (16 * NORM_THREADS)

extern "C" __global__ void grad_norm_f32(const float* grad, double* partials, float grad_divisor,
                                         size_t n) {
    __shared__ double part[NORM_THREADS];
    const size_t chunks = (n + NORM_CHUNK - 1) / NORM_CHUNK;
    for (size_t b = blockIdx.x; b < chunks; b += gridDim.x) {
        const size_t end = (b + 1) * NORM_CHUNK < n ? (b + 1) * NORM_CHUNK : n;
        double acc = 0.0;
        for (size_t i = b * NORM_CHUNK + threadIdx.x; i < end; i += NORM_THREADS) {
            const double g = (double)(grad[i] / grad_divisor);
            acc = __dadd_rn(acc, __dmul_rn(g, g));
        }
        part[threadIdx.x] = acc;
        __syncthreads();
        for (int stride = NORM_THREADS / 2; stride > 0; stride >>= 1) {
            if (threadIdx.x < stride) part[threadIdx.x] = __dadd_rn(part[threadIdx.x], part[threadIdx.x + stride]);
            __syncthreads();
        }
        if (threadIdx.x == 0) partials[b] = part[0];
        __syncthreads();  // part is reused by the next chunk
    }
}

// clip_grad_norm_'s factor from the chunks' sums, added in order (one thread):
//   norm = (float)sqrt(sum of partials); f = max_norm / (norm + 1e-6); factor = min(f, 1)
// (a NaN norm gives NaN, as torch.clamp does).
// partials: (parts) -> factor: (1)
extern "C" __global__ void clip_factor_f32(const double* partials, float* factor, float max_norm,
                                           size_t parts) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double total = 0.0;
    for (size_t b = 0; b < parts; ++b) total = __dadd_rn(total, partials[b]);
    const float norm = (float)sqrt(total);
    const float f = max_norm / __fadd_rn(norm, 1e-6f);
    factor[0] = f > 1.0f ? 1.0f : f;
}
