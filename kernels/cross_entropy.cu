// cross_entropy.cu — fused softmax + cross-entropy on logits, forward and gradient at once.
//
// Owns: the loss head of classifiers. The loss is the SUM over samples (DESIGN.md: the
// replicas back-propagate sums and the trainer divides by the global batch size once,
// after the all-reduce), so dlogits here is the gradient of the sum: softmax - target,
// with no 1/N. With label smoothing eps (PyTorch's cross_entropy(label_smoothing=eps)) the
// target is (1 - eps)*onehot + eps/K and the loss (1 - eps)*(lse - z[label]) +
// (eps/K)*sum_c (lse - z[c]); eps = 0 is the plain loss, bit for bit. The same
// expressions as ops::cross_entropy::cpu (the CPU reference), but for the order of the
// row's sum (one after another here, in 16 lanes there) and the gradient's softmax
// (exp(z - lse) here, e^(z - max) / sum there), which its host check allows. It is one
// kernel named `_fwd` because the gradient costs nothing extra once the softmax is known;
// there is no separate `_bwd`.
// Numerics: log-sum-exp with the row max subtracted, in float32.
// Ties in the argmax go to the lowest index, as in the CPU backend and torch.argmax.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// One thread per sample (K, the class count, is small: 2 or 10 in the built-in models).
// logits: (N, K), labels: (N) u32 -> loss: (N), dlogits: (N, K), correct: (N) u32 in {0, 1}
// label_smoothing: eps in [0, 1) (checked by the launch).
// A label >= K gives loss = NaN (the trainer's non-finite check then stops the run).
extern "C" __global__ void softmax_xent_fwd_f32(const float* logits, const unsigned int* labels,
                                                float* loss, float* dlogits,
                                                unsigned int* correct, size_t n, int k,
                                                float label_smoothing) {
    // The target of the label's class and of every other one: (1, 0) exactly for eps = 0.
    const float off = label_smoothing / (float)k;
    const float on = (1.0f - label_smoothing) + off;
    GRID_STRIDE(s, n) {
        const float* z = logits + s * (size_t)k;
        float* dz = dlogits + s * (size_t)k;
        // The first maximum, from -inf as the CPU's fold: a NaN logit is never the maximum,
        // not even the first one.
        int arg = 0;
        float mx = __int_as_float((int)0xff800000);  // -inf
        for (int j = 0; j < k; ++j) {
            if (z[j] > mx) { mx = z[j]; arg = j; }
        }
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) sum += expf(z[j] - mx);
        const float lse = logf(sum) + mx;
        const unsigned int label = labels[s];
        for (int j = 0; j < k; ++j) {
            dz[j] = expf(z[j] - lse) - ((unsigned int)j == label ? on : off);
        }
        if (label < (unsigned int)k) {
            const float nll = lse - z[label];
            if (label_smoothing == 0.0f) {
                loss[s] = nll;
            } else {
                float smooth = 0.0f;  // sum_c -log p_c, class by class
                for (int j = 0; j < k; ++j) smooth += lse - z[j];
                loss[s] = (1.0f - label_smoothing) * nll + smooth * off;
            }
            correct[s] = (unsigned int)arg == label ? 1u : 0u;
        } else {
            loss[s] = __int_as_float(0x7fc00000);  // quiet NaN
            correct[s] = 0u;
        }
    }
}
