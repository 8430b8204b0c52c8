// optim.cu — fused optimizer updates, one thread per parameter element.
//
// Owns: the SGD (momentum, weight decay) and Adam updates, with PyTorch's semantics so
// that a lockstep run can be checked against torch.optim. Not part of autograd, so the
// names carry no direction: `<op>_f32`.
// Both take the step's scalars as the host made them (optim::StepScalars, the same values
// the CPU optimiser uses): `grad_divisor`, the real size B of this global batch, divides
// the raw gradient first, since the replicas all-reduce gradient SUMS (DESIGN.md, exact
// averaging); `step_size` is lr (SGD) or lr / (1 - beta1^t) folded in float64 (Adam).
// Every replica runs the same update on the same inputs, so replicas stay identical.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// torch.optim.SGD(dampening=0, nesterov=False):
//   g = grad / grad_divisor + weight_decay * p
//   buf = g at the first step (first != 0), else momentum * buf + g
//   p -= step_size * buf         (with momentum == 0 this is p -= step_size * g)
// p, grad, buf: (n)
extern "C" __global__ void sgd_step_f32(float* p, const float* grad, float* buf, float step_size,
                                        float momentum, float weight_decay, float grad_divisor,
                                        int first, size_t n) {
    GRID_STRIDE(i, n) {
        const float g = grad[i] / grad_divisor + weight_decay * p[i];
        const float b = first ? g : momentum * buf[i] + g;
        buf[i] = b;
        p[i] -= step_size * b;
    }
}

// torch.optim.Adam(amsgrad=False), L2 weight decay added to the gradient:
//   g = grad / grad_divisor + weight_decay * p
//   m += (1 - beta1) * (g - m)
//   v = beta2 * v + (1 - beta2) * g * g
//   p -= step_size * (m / (sqrt(v) / bc2_sqrt + eps))
// with step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t), t the 1-based
// step, both from the host's float64 arithmetic.
// p, grad, m, v: (n)
extern "C" __global__ void adam_step_f32(float* p, const float* grad, float* m, float* v,
                                         float step_size, float beta1, float beta2, float eps,
                                         float weight_decay, float grad_divisor, float bc2_sqrt,
                                         size_t n) {
    GRID_STRIDE(i, n) {
        const float g = grad[i] / grad_divisor + weight_decay * p[i];
        const float mi = m[i] + (1.0f - beta1) * (g - m[i]);
        const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        p[i] -= step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
    }
}
