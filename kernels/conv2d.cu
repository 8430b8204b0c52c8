// conv2d.cu — a 2-D convolution's own kernels: im2col and its adjoint (col2im) for NCHW
// tensors, and the bias add over channels with its reduction (src/ops/conv2d/cpu.rs and
// the CPU backend's unfolding, the reference). The contract every file of kernels/ keeps
// is kernels/README.md's.
//
// Owns: the data movement that turns a convolution into one matrix product per sample
// (done by cuBLAS on the host side, not here). Layout is the CPU backend's, so the two
// backends share one weight layout and one test oracle:
//   for sample n, col is (C*KH*KW, OH*OW) row-major,
//   row = (c*KH + kh)*KW + kw, column = oh*OW + ow,
//   col[row, oh*OW + ow] = x[n, c, oh*SH - PT + kh, ow*SW - PL + kw]  (0 outside x).
// Padding is asymmetric (top/left/bottom/right); only top and left appear here because
// bottom and right are already folded into OH = (H + PT + PB - KH)/SH + 1 (and OW alike)
// by the host, and reads past the bottom/right edge fall in the zero padding.
// No dilation.
//
// Groups (G > 1): the weight is (O, C/G, KH, KW), group k mapping channels k*C/G.. to
// filters k*O/G... A group of a few channels (a depthwise convolution) runs by the direct
// kernels below (conv2d_direct_*), a wider one by im2col and one GEMM a group on the host
// side; both sum their weight gradient per sample, then conv2d_params_sum adds the samples.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// Block size the block-per-channel reductions are written for; the host launches
// exactly this many threads per block (`REDUCE_BLOCK` of src/cuda/launch.rs).
#define REDUCE_BLOCK 256

// x: (N, C, H, W) -> col: (N, C*KH*KW, OH*OW)
extern "C" __global__ void im2col_fwd_f32(const float* x, float* col, int n, int c, int h, int w,
                                          int kh, int kw, int sh, int sw, int pt, int pl,
                                          int oh, int ow) {
    const size_t ohw = (size_t)oh * ow;
    const size_t rows = (size_t)c * kh * kw;
    const size_t total = (size_t)n * rows * ohw;
    GRID_STRIDE(i, total) {
        const size_t p = i % ohw;
        const size_t row = (i / ohw) % rows;
        const size_t s = i / (ohw * rows);
        const int oy = (int)(p / ow), ox = (int)(p % ow);
        const int kx = (int)(row % kw), ky = (int)((row / kw) % kh), ch = (int)(row / ((size_t)kw * kh));
        const int y = oy * sh - pt + ky, xx = ox * sw - pl + kx;
        col[i] = (y >= 0 && y < h && xx >= 0 && xx < w)
                     ? x[((s * c + ch) * h + y) * w + xx]
                     : 0.0f;
    }
}

// col2im, the adjoint of im2col_fwd: dx[n, c, y, x] = sum of every dcol entry that
// im2col_fwd read from (n, c, y, x). One thread per element of dx gathers its terms in
// a fixed (kh, kw) order, so there are no atomics and the result is reproducible.
// dx is WRITTEN (it is an input gradient).
// dcol: (N, C*KH*KW, OH*OW) -> dx: (N, C, H, W)
extern "C" __global__ void im2col_bwd_f32(const float* dcol, float* dx, int n, int c, int h,
                                          int w, int kh, int kw, int sh, int sw, int pt, int pl,
                                          int oh, int ow) {
    const size_t ohw = (size_t)oh * ow;
    const size_t rows = (size_t)c * kh * kw;
    const size_t total = (size_t)n * c * h * w;
    GRID_STRIDE(i, total) {
        const int xx = (int)(i % w);
        const int y = (int)((i / w) % h);
        const int ch = (int)((i / ((size_t)w * h)) % c);
        const size_t s = i / ((size_t)w * h * c);
        float acc = 0.0f;
        for (int ky = 0; ky < kh; ++ky) {
            const int ty = y + pt - ky;  // = oy * sh
            if (ty < 0 || ty % sh != 0) continue;
            const int oy = ty / sh;
            if (oy >= oh) continue;
            for (int kx = 0; kx < kw; ++kx) {
                const int tx = xx + pl - kx;  // = ox * sw
                if (tx < 0 || tx % sw != 0) continue;
                const int ox = tx / sw;
                if (ox >= ow) continue;
                const size_t row = ((size_t)ch * kh + ky) * kw + kx;
                acc += dcol[(s * rows + row) * ohw + (size_t)oy * ow + ox];
            }
        }
        dx[i] = acc;
    }
}

// y[n, c, h, w] += bias[c], in place.
// y: (N, C, H, W) with hw = H*W and total = N*C*H*W; bias: (C)
extern "C" __global__ void bias_nchw_fwd_f32(float* y, const float* bias, int c, size_t hw,
                                             size_t total) {
    GRID_STRIDE(i, total) { y[i] += bias[(i / hw) % (size_t)c]; }
}

// dbias[c] += sum over (n, h, w) of dy[n, c, h, w].
// One block of REDUCE_BLOCK threads per channel: grid = (C). Each thread sums a strided
// subset in a fixed order, then a fixed tree combines the partial sums.
// dy: (N, C, H, W) with hw = H*W; dbias: (C)
extern "C" __global__ void bias_nchw_bwd_f32(const float* dy, float* dbias, int n, int c,
                                             size_t hw) {
    __shared__ float part[REDUCE_BLOCK];
    const int ch = blockIdx.x;
    const size_t m = (size_t)n * hw;
    float acc = 0.0f;
    for (size_t j = threadIdx.x; j < m; j += REDUCE_BLOCK) {
        const size_t s = j / hw, p = j % hw;
        acc += dy[(s * (size_t)c + ch) * hw + p];
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int stride = REDUCE_BLOCK / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) part[threadIdx.x] += part[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) dbias[ch] += part[0];
}

// ---- groups: the direct path ----------------------------------------------------------------
// src/ops/conv2d/cpu.rs's `Direct` is the reference: every sum below is its sum, term for
// term in its order, from 0, uncontracted. Where the CPU adds w*0 for a padded position,
// these skip it: the same sum, since a sum from +0 is never -0 and adding +-0 to anything
// else leaves it. The geometry is the window's 12 ints, then O and G.

// y[n, f, oy, ox] = sum over ci, i, j (in that order) of
//   w[f, ci, i, j] * x[n, k*C/G + ci, oy*SH - PT + i, ox*SW - PL + j],  k = f / (O/G).
// x: (N, C, H, W), weight: (O, C/G, KH, KW) -> y: (N, O, OH, OW), WRITTEN
extern "C" __global__ void conv2d_direct_fwd_f32(const float* x, const float* weight, float* y,
                                                 int n, int c, int h, int w, int kh, int kw,
                                                 int sh, int sw, int pt, int pl, int oh, int ow,
                                                 int o, int groups) {
    const int cpg = c / groups, opg = o / groups;
    const size_t total = (size_t)n * o * oh * ow;
    GRID_STRIDE(idx, total) {
        const int ox = (int)(idx % ow), oy = (int)((idx / ow) % oh);
        const int f = (int)((idx / ((size_t)ow * oh)) % o);
        const size_t s = idx / ((size_t)ow * oh * o);
        const int k = f / opg;
        float acc = 0.0f;
        for (int ci = 0; ci < cpg; ++ci) {
            const float* xc = x + (s * c + (size_t)k * cpg + ci) * h * w;
            const float* wf = weight + ((size_t)f * cpg + ci) * kh * kw;
            for (int i = 0; i < kh; ++i) {
                const int yy = oy * sh - pt + i;
                if (yy < 0 || yy >= h) continue;
                for (int j = 0; j < kw; ++j) {
                    const int xx = ox * sw - pl + j;
                    if (xx < 0 || xx >= w) continue;
                    acc = __fadd_rn(acc, __fmul_rn(wf[i * kw + j], xc[(size_t)yy * w + xx]));
                }
            }
        }
        y[idx] = acc;
    }
}

// dx[n, ch, y, x] = sum over the group's filters f = k*O/G + fl, then i, then j (each
// ascending) of w[f, ch - k*C/G, i, j] * dy[n, f, oy, ox] for the taps with
// oy*SH = y + PT - i and ox*SW = x + PL - j inside dy; k = ch / (C/G). One thread per
// element of dx, no atomics.
// dy: (N, O, OH, OW), weight: (O, C/G, KH, KW) -> dx: (N, C, H, W), WRITTEN
extern "C" __global__ void conv2d_direct_bwd_f32(const float* dy, const float* weight, float* dx,
                                                 int n, int c, int h, int w, int kh, int kw,
                                                 int sh, int sw, int pt, int pl, int oh, int ow,
                                                 int o, int groups) {
    const int cpg = c / groups, opg = o / groups;
    const size_t total = (size_t)n * c * h * w;
    GRID_STRIDE(idx, total) {
        const int xx = (int)(idx % w), yy = (int)((idx / w) % h);
        const int ch = (int)((idx / ((size_t)w * h)) % c);
        const size_t s = idx / ((size_t)w * h * c);
        const int k = ch / cpg, ci = ch % cpg;
        float acc = 0.0f;
        for (int fl = 0; fl < opg; ++fl) {
            const int f = k * opg + fl;
            const float* wf = weight + ((size_t)f * cpg + ci) * kh * kw;
            const float* dyf = dy + (s * o + f) * oh * ow;
            for (int i = 0; i < kh; ++i) {
                const int ty = yy + pt - i;  // = oy * sh
                if (ty < 0 || ty % sh != 0 || ty / sh >= oh) continue;
                const int oy = ty / sh;
                for (int j = 0; j < kw; ++j) {
                    const int tx = xx + pl - j;  // = ox * sw
                    if (tx < 0 || tx % sw != 0 || tx / sw >= ow) continue;
                    acc = __fadd_rn(acc, __fmul_rn(wf[i * kw + j], dyf[(size_t)oy * ow + tx / sw]));
                }
            }
        }
        dx[idx] = acc;
    }
}

// One sample's weight gradient, per sample (the samples are added by conv2d_params_sum):
// part[n, f, ci, i, j] = sum over ox of (sum over oy of dy[n, f, oy, ox] * x[n, k*C/G + ci,
// oy*SH - PT + i, ox*SW - PL + j]), each column's sum over the rows first, k = f / (O/G).
// x: (N, C, H, W), dy: (N, O, OH, OW) -> part: (N, O, C/G, KH, KW), WRITTEN
extern "C" __global__ void conv2d_direct_params_bwd_f32(const float* x, const float* dy,
                                                        float* part, int n, int c, int h, int w,
                                                        int kh, int kw, int sh, int sw, int pt,
                                                        int pl, int oh, int ow, int o,
                                                        int groups) {
    const int cpg = c / groups, opg = o / groups;
    const size_t total = (size_t)n * o * cpg * kh * kw;
    GRID_STRIDE(idx, total) {
        const int j = (int)(idx % kw), i = (int)((idx / kw) % kh);
        const int ci = (int)((idx / ((size_t)kw * kh)) % cpg);
        const int f = (int)((idx / ((size_t)kw * kh * cpg)) % o);
        const size_t s = idx / ((size_t)kw * kh * cpg * o);
        const float* xc = x + (s * c + (size_t)(f / opg) * cpg + ci) * h * w;
        const float* dyf = dy + (s * o + f) * oh * ow;
        float tot = 0.0f;
        for (int ox = 0; ox < ow; ++ox) {
            const int xx = ox * sw - pl + j;
            if (xx < 0 || xx >= w) continue;
            float col = 0.0f;
            for (int oy = 0; oy < oh; ++oy) {
                const int yy = oy * sh - pt + i;
                if (yy < 0 || yy >= h) continue;
                col = __fadd_rn(col, __fmul_rn(dyf[(size_t)oy * ow + ox], xc[(size_t)yy * w + xx]));
            }
            tot = __fadd_rn(tot, col);
        }
        part[idx] = tot;
    }
}

// dweight[i] += (part[0, i] + part[1, i] + ... + part[N-1, i]): the samples' weight
// gradients summed in sample order from 0, then ACCUMULATED.
// part: (N, len) -> dweight: (len)
extern "C" __global__ void conv2d_params_sum_bwd_f32(const float* part, float* dweight, int n,
                                                     size_t len) {
    GRID_STRIDE(i, len) {
        float acc = 0.0f;
        for (int s = 0; s < n; ++s) acc = __fadd_rn(acc, part[(size_t)s * len + i]);
        dweight[i] = __fadd_rn(dweight[i], acc);
    }
}
