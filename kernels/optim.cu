// optim.cu — fused optimizer updates, one thread per parameter element.
//
// Owns: the SGD (momentum, weight decay) and Adam updates, with PyTorch's semantics so
// that a lockstep run can be checked against torch.optim. Not part of autograd, so the
// names carry no direction: `<op>_f32`.
// Both take `grad_scale`, applied to the raw gradient before anything else: the replicas
// all-reduce gradient SUMS, and the trainer passes grad_scale = 1/B (B = this global
// batch's real size) so the update sees the mean gradient (DESIGN.md, exact averaging).
// Every replica runs the same update on the same inputs, so replicas stay identical.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// torch.optim.SGD(dampening=0, nesterov=False):
//   g = grad * grad_scale + weight_decay * p
//   buf = momentum * buf + g     (buf starts at 0, so the first step gives buf = g as in torch)
//   p -= lr * buf                (with momentum == 0 this is p -= lr * g)
// p, grad, buf: (n)
extern "C" __global__ void sgd_step_f32(float* p, const float* grad, float* buf, float lr,
                                        float momentum, float weight_decay, float grad_scale,
                                        size_t n) {
    GRID_STRIDE(i, n) {
        const float g = grad[i] * grad_scale + weight_decay * p[i];
        const float b = momentum * buf[i] + g;
        buf[i] = b;
        p[i] -= lr * b;
    }
}

// torch.optim.Adam(amsgrad=False), L2 weight decay added to the gradient:
//   g = grad * grad_scale + weight_decay * p
//   m += (1 - beta1) * (g - m)
//   v = beta2 * v + (1 - beta2) * g * g
//   p -= (lr / bc1) * m / (sqrt(v) / bc2_sqrt + eps)
// with bc1 = 1 - beta1^t and bc2_sqrt = sqrt(1 - beta2^t), t the 1-based step, computed
// by the host in float64 (so the CPU and CUDA backends use the very same two numbers).
// p, grad, m, v: (n)
extern "C" __global__ void adam_step_f32(float* p, const float* grad, float* m, float* v,
                                         float lr, float beta1, float beta2, float eps,
                                         float weight_decay, float grad_scale, float bc1,
                                         float bc2_sqrt, size_t n) {
    GRID_STRIDE(i, n) {
        const float g = grad[i] * grad_scale + weight_decay * p[i];
        const float mi = m[i] + (1.0f - beta1) * (g - m[i]);
        const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        p[i] -= (lr / bc1) * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
}
