// maxpool2d.cu — max pooling (Keras MaxPooling2D) over NCHW tensors, forward and backward.
// The CPU's (src/ops/maxpool2d/cpu.rs) is the reference, followed exactly, so the host-run
// kernel test compares the two bit for bit:
//   * a window is the one src/ops/window.rs places: output (oy, ox) covers rows
//     oy*SH - PT .. + KH and columns ox*SW - PL .. + KW, clipped to the plane, so a padded
//     position is never a candidate;
//   * ties and NaN as PyTorch's CPU kernel: scanning the window in row-major order, a
//     value wins when `v > best || isnan(v)` (the first maximum wins a tie, a NaN wins
//     over numbers, the last NaN over earlier ones); argmax is its index h*W + w in the
//     plane;
//   * backward gives each input the sum of dy over the outputs whose argmax it is, added
//     in row-major output order from 0, by one thread per input: no atomics.
//
// The contract every file of kernels/ keeps is kernels/README.md's.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// One thread per output element. `v != v` is isnan(v) (no fast-math here or on the host),
// written so that the same line compiles for NVRTC and as host C++.
// x: (N, C, H, W) -> y: (N, C, OH, OW), argmax: (N, C, OH, OW) u32 in 0..H*W
extern "C" __global__ void maxpool2d_fwd_f32(const float* x, float* y, unsigned int* argmax, int n,
                                             int c, int h, int w, int kh, int kw, int sh, int sw,
                                             int pt, int pl, int oh, int ow) {
    const size_t ohw = (size_t)oh * ow;
    const size_t total = (size_t)n * c * ohw;
    GRID_STRIDE(i, total) {
        const int ox = (int)(i % ow);
        const int oy = (int)((i / ow) % oh);
        const float* plane = x + (i / ohw) * ((size_t)h * w);
        const int ty = oy * sh - pt, tx = ox * sw - pl;
        const int y0 = ty < 0 ? 0 : ty, y1 = ty + kh < h ? ty + kh : h;
        const int x0 = tx < 0 ? 0 : tx, x1 = tx + kw < w ? tx + kw : w;
        // Starting from the first candidate is PyTorch's start from -inf: an all -inf
        // window keeps its first position, a NaN there wins at once.
        size_t at = (size_t)y0 * w + x0;
        float best = plane[at];
        for (int yy = y0; yy < y1; ++yy) {
            for (int xx = x0; xx < x1; ++xx) {
                const size_t p = (size_t)yy * w + xx;
                const float v = plane[p];
                if (v > best || v != v) {
                    best = v;
                    at = p;
                }
            }
        }
        y[i] = best;
        argmax[i] = (unsigned int)at;
    }
}

// One thread per input element: it visits the outputs whose window holds it, oy then ox
// ascending, and adds the dy of those whose argmax it is. dx is WRITTEN.
// dy, argmax: (N, C, OH, OW) -> dx: (N, C, H, W)
extern "C" __global__ void maxpool2d_bwd_f32(const float* dy, const unsigned int* argmax, float* dx,
                                             int n, int c, int h, int w, int kh, int kw, int sh,
                                             int sw, int pt, int pl, int oh, int ow) {
    const size_t hw = (size_t)h * w, ohw = (size_t)oh * ow;
    const size_t total = (size_t)n * c * hw;
    GRID_STRIDE(i, total) {
        const size_t p = i % hw;
        const int yy = (int)(p / w), xx = (int)(p % w);
        const float* d = dy + (i / hw) * ohw;
        const unsigned int* a = argmax + (i / hw) * ohw;
        // Output rows oy with oy*SH - PT <= yy < oy*SH - PT + KH (columns alike).
        const int ly = yy + pt - kh + 1, lx = xx + pl - kw + 1;
        const int oy0 = ly <= 0 ? 0 : (ly + sh - 1) / sh, ox0 = lx <= 0 ? 0 : (lx + sw - 1) / sw;
        const int hy = (yy + pt) / sh + 1, hx = (xx + pl) / sw + 1;
        const int oy1 = hy < oh ? hy : oh, ox1 = hx < ow ? hx : ow;
        float acc = 0.0f;
        for (int oy = oy0; oy < oy1; ++oy) {
            for (int ox = ox0; ox < ox1; ++ox) {
                const size_t o = (size_t)oy * ow + ox;
                if (a[o] == (unsigned int)p) acc += d[o];
            }
        }
        dx[i] = acc;
    }
}
