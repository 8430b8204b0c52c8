// attention.cu — what attention needs besides its matrix products (causal self-attention, and
// scaled_dot_product_attention of q, k and v).
//
// Owns: the head split and merge (a permutation between the projections' rows and the
// per-head layout the strided-batched GEMMs read), and the softmax over T, causal or not,
// with its gradient. Leaves every product (the projections, q·kᵀ, P·v and their
// gradients) to cuBLAS, the dropout of the probabilities and of the output to dropout.cu
// (the masks ops::attention draws on the CPU, bit for bit), and the order of the launches
// to the GPU forms of src/ops/attention/ and src/ops/sdpa/ (scaled_dot_product_attention,
// which launches the softmax on its own q, k and v). The CPU reference is softmax_row and
// softmax_row_bwd (src/ops/attention/cpu.rs); the host check in src/ops/attention/gpu.rs
// runs these kernels against them.
//
// Shapes: N batch, T positions, H heads, D the head width, C = H*D; P parts (3 for the
// fused q, k, v; 1 for a single tensor).

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// Threads per block of the row kernels; the host launches exactly this many
// (src/ops/attention/gpu.rs ATTENTION_BLOCK). A power of two.
#define ATTENTION_BLOCK 128

// The head split: x (N, T, P*H*D) -> y (P, N, H, T, D), y[p, n, h, i, d] = x[n, i, (p*H + h)*D + d]:
// PyTorch's split(C, dim=2) then view(N, T, H, D).transpose(1, 2), made contiguous.
extern "C" __global__ void attention_heads_fwd_f32(const float* x, float* y, int n, int t, int parts,
                                                   int heads, int hd) {
    const size_t total = (size_t)parts * n * heads * t * hd;
    GRID_STRIDE(e, total) {
        // e indexes y: ((((p*N + s)*H + h)*T + i)*D + d)
        const size_t d = e % hd;
        const size_t i = (e / hd) % t;
        const size_t h = (e / ((size_t)hd * t)) % heads;
        const size_t s = (e / ((size_t)hd * t * heads)) % n;
        const size_t p = e / ((size_t)hd * t * heads * n);
        y[e] = x[((s * t + i) * parts + p) * heads * hd + h * hd + d];
    }
}

// The head merge, the split's adjoint (and inverse): dy (P, N, H, T, D) -> dx (N, T, P*H*D).
// Each dx element is written once, from the one dy element it came from.
extern "C" __global__ void attention_heads_bwd_f32(const float* dy, float* dx, int n, int t, int parts,
                                                   int heads, int hd) {
    const size_t total = (size_t)parts * n * heads * t * hd;
    GRID_STRIDE(e, total) {
        // e indexes dx: ((s*T + i)*P + p)*H*D + h*D + d
        const size_t d = e % hd;
        const size_t h = (e / hd) % heads;
        const size_t p = (e / ((size_t)hd * heads)) % parts;
        const size_t i = (e / ((size_t)hd * heads * parts)) % t;
        const size_t s = e / ((size_t)hd * heads * parts * t);
        dx[e] = dy[(((p * n + s) * heads + h) * t + i) * hd + d];
    }
}

// Tree reductions of ATTENTION_BLOCK values in shared memory, in one fixed order (the
// same for every launch): the block's result is in v[0] for every thread to read.
__device__ void attention_block_max(float* v) {
    for (int stride = ATTENTION_BLOCK / 2; stride > 0; stride /= 2) {
        __syncthreads();
        if ((int)threadIdx.x < stride) v[threadIdx.x] = fmaxf(v[threadIdx.x], v[threadIdx.x + stride]);
    }
    __syncthreads();
}

__device__ void attention_block_sum(float* v) {
    for (int stride = ATTENTION_BLOCK / 2; stride > 0; stride /= 2) {
        __syncthreads();
        if ((int)threadIdx.x < stride) v[threadIdx.x] = __fadd_rn(v[threadIdx.x], v[threadIdx.x + stride]);
    }
    __syncthreads();
}

// The softmax of the scores, one block per row (a grid-stride loop over rows): row r of
// (N*H*T, T) is position i = r % T, whose live columns are j <= last, last = i when
// `causal` is nonzero, T - 1 otherwise:
//   z_j = scale * s_j, m = max_{j<=last} z_j, e_j = exp(z_j - m),
//   p_j = e_j * (1 / sum_{j<=last} e_j), p_j = 0 for j > last (the mask's -inf).
// Thread k handles columns k, k + ATTENTION_BLOCK, ...; its partial sums run in that order and
// the tree above joins them, so a row's result is a function of T alone. The _rn
// intrinsics keep NVRTC from contracting scale*s - m into an FMA, which the CPU does not do.
// s, p: (rows, T); may not alias.
extern "C" __global__ void attention_softmax_fwd_f32(const float* s, float* p, int rows, int t, float scale,
                                                     int causal) {
    __shared__ float red[ATTENTION_BLOCK];
    for (size_t r = blockIdx.x; r < (size_t)rows; r += gridDim.x) {
        const float* sr = s + r * t;
        float* pr = p + r * t;
        const int live = causal ? (int)(r % t) + 1 : t;
        float mx = __int_as_float((int)0xff800000);  // -inf
        for (int j = threadIdx.x; j < live; j += ATTENTION_BLOCK) mx = fmaxf(mx, __fmul_rn(sr[j], scale));
        red[threadIdx.x] = mx;
        attention_block_max(red);
        mx = red[0];
        float sum = 0.0f;
        for (int j = threadIdx.x; j < live; j += ATTENTION_BLOCK) {
            const float e = expf(__fsub_rn(__fmul_rn(sr[j], scale), mx));
            pr[j] = e;
            sum = __fadd_rn(sum, e);
        }
        __syncthreads();  // every thread has read red[0] before it is overwritten
        red[threadIdx.x] = sum;
        attention_block_sum(red);
        const float inv = 1.0f / red[0];
        for (int j = threadIdx.x; j < t; j += ATTENTION_BLOCK) pr[j] = j < live ? __fmul_rn(pr[j], inv) : 0.0f;
        __syncthreads();  // red[0] read by all before the next row
    }
}

// The gradient of the softmax by the scores (scaled), one block per row, `last` as in the
// forward: dot = sum_{j<=last} dp_j * p_j, ds_j = scale * (p_j * (dp_j - dot)) for
// j <= last, ds_j = 0 beyond, the partial sums and their tree as in the forward.
// p, dp, ds: (rows, T); ds may not alias the others.
extern "C" __global__ void attention_softmax_bwd_f32(const float* p, const float* dp, float* ds, int rows, int t,
                                                     float scale, int causal) {
    __shared__ float red[ATTENTION_BLOCK];
    for (size_t r = blockIdx.x; r < (size_t)rows; r += gridDim.x) {
        const float* pr = p + r * t;
        const float* dr = dp + r * t;
        float* sr = ds + r * t;
        const int live = causal ? (int)(r % t) + 1 : t;
        float dot = 0.0f;
        for (int j = threadIdx.x; j < live; j += ATTENTION_BLOCK) dot = __fadd_rn(dot, __fmul_rn(dr[j], pr[j]));
        red[threadIdx.x] = dot;
        attention_block_sum(red);
        dot = red[0];
        for (int j = threadIdx.x; j < t; j += ATTENTION_BLOCK) {
            sr[j] = j < live ? __fmul_rn(scale, __fmul_rn(pr[j], __fsub_rn(dr[j], dot))) : 0.0f;
        }
        __syncthreads();  // red[0] read by all before the next row
    }
}
