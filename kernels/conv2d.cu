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
// No dilation, no groups.

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
