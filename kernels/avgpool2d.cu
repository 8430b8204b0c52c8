// avgpool2d.cu — average pooling (Keras AveragePooling2D, PyTorch AvgPool2d) over NCHW
// tensors, forward and backward. The CPU's (src/ops/avgpool2d/cpu.rs) is the reference,
// followed exactly, so the host-run kernel test compares the two bit for bit:
//   * a window is the one src/ops/window.rs places: output (oy, ox) covers rows
//     oy*SH - PT .. + KH and columns ox*SW - PL .. + KW, clipped to the plane;
//   * its sum is taken in row-major order from 0 in float, then divided by its count:
//     KH*KW when count_pad is 1 (valid, and PyTorch's explicit pads with
//     count_include_pad=True), the window's in-plane values when 0 (Keras's "same");
//   * backward gives each input the sum of dy / count over the windows that hold it,
//     added in row-major output order from 0, by one thread per input: no atomics.
//
// The contract every file of kernels/ keeps is kernels/README.md's.

// The count output (oy, ox) divides by: KH*KW, or its clipped window's area.
__device__ int avgpool2d_count(int count_pad, int oy, int ox, int h, int w, int kh, int kw, int sh, int sw, int pt,
                               int pl) {
    if (count_pad) return kh * kw;
    const int ty = oy * sh - pt, tx = ox * sw - pl;
    const int y0 = ty < 0 ? 0 : ty, y1 = ty + kh < h ? ty + kh : h;
    const int x0 = tx < 0 ? 0 : tx, x1 = tx + kw < w ? tx + kw : w;
    return (y1 - y0) * (x1 - x0);
}

// One thread per output element.
// x: (N, C, H, W) -> y: (N, C, OH, OW)
extern "C" __global__ void avgpool2d_fwd_f32(const float* x, float* y, int count_pad, int n, int c, int h, int w,
                                             int kh, int kw, int sh, int sw, int pt, int pl, int oh, int ow) {
    const size_t ohw = (size_t)oh * ow;
    const size_t total = (size_t)n * c * ohw;
    GRID_STRIDE(i, total) {
        const int ox = (int)(i % ow);
        const int oy = (int)((i / ow) % oh);
        const float* plane = x + (i / ohw) * ((size_t)h * w);
        const int ty = oy * sh - pt, tx = ox * sw - pl;
        const int y0 = ty < 0 ? 0 : ty, y1 = ty + kh < h ? ty + kh : h;
        const int x0 = tx < 0 ? 0 : tx, x1 = tx + kw < w ? tx + kw : w;
        float sum = 0.0f;
        for (int yy = y0; yy < y1; ++yy)
            for (int xx = x0; xx < x1; ++xx) sum = __fadd_rn(sum, plane[(size_t)yy * w + xx]);
        y[i] = __fdiv_rn(sum, (float)avgpool2d_count(count_pad, oy, ox, h, w, kh, kw, sh, sw, pt, pl));
    }
}

// One thread per input element: it visits the outputs whose window holds it, oy then ox
// ascending, and adds each one's dy / count. dx is WRITTEN.
// dy: (N, C, OH, OW) -> dx: (N, C, H, W)
extern "C" __global__ void avgpool2d_bwd_f32(const float* dy, float* dx, int count_pad, int n, int c, int h, int w,
                                             int kh, int kw, int sh, int sw, int pt, int pl, int oh, int ow) {
    const size_t hw = (size_t)h * w, ohw = (size_t)oh * ow;
    const size_t total = (size_t)n * c * hw;
    GRID_STRIDE(i, total) {
        const size_t p = i % hw;
        const int yy = (int)(p / w), xx = (int)(p % w);
        const float* d = dy + (i / hw) * ohw;
        // Output rows oy with oy*SH - PT <= yy < oy*SH - PT + KH (columns alike).
        const int ly = yy + pt - kh + 1, lx = xx + pl - kw + 1;
        const int oy0 = ly <= 0 ? 0 : (ly + sh - 1) / sh, ox0 = lx <= 0 ? 0 : (lx + sw - 1) / sw;
        const int hy = (yy + pt) / sh + 1, hx = (xx + pl) / sw + 1;
        const int oy1 = hy < oh ? hy : oh, ox1 = hx < ow ? hx : ow;
        float acc = 0.0f;
        for (int oy = oy0; oy < oy1; ++oy)
            for (int ox = ox0; ox < ox1; ++ox) {
                const float count = (float)avgpool2d_count(count_pad, oy, ox, h, w, kh, kw, sh, sw, pt, pl);
                acc = __fadd_rn(acc, __fdiv_rn(d[(size_t)oy * ow + ox], count));
            }
        dx[i] = acc;
    }
}
