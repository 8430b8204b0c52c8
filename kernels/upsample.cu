// upsample.cu — nearest upsampling by integer factors (Keras UpSampling2D, PyTorch
// nn.Upsample(mode="nearest")) over NCHW tensors, forward and backward. The CPU's
// (src/ops/upsample/cpu.rs) is the reference, followed exactly, so the host-run kernel test
// compares the two bit for bit: output (oy, ox) copies input (oy / SH, ox / SW); an input's
// gradient is the sum of dy over its SH x SW block, rows then columns in order, from 0 in
// float, by one thread per input: no atomics.
//
// The contract every file of kernels/ keeps is kernels/README.md's.

// One thread per output element.
// x: (planes, H, W) -> y: (planes, H*SH, W*SW)
extern "C" __global__ void upsample_fwd_f32(const float* x, float* y, size_t planes, int h, int w, int sh, int sw) {
    const size_t oh = (size_t)h * sh, ow = (size_t)w * sw;
    GRID_STRIDE(i, planes * oh * ow) {
        const size_t ox = i % ow, oy = (i / ow) % oh, p = i / (oh * ow);
        y[i] = x[(p * h + oy / sh) * w + ox / sw];
    }
}

// One thread per input element, summing its block. dx is WRITTEN.
// dy: (planes, H*SH, W*SW) -> dx: (planes, H, W)
extern "C" __global__ void upsample_bwd_f32(const float* dy, float* dx, size_t planes, int h, int w, int sh, int sw) {
    const size_t ow = (size_t)w * sw, oh = (size_t)h * sh;
    GRID_STRIDE(i, planes * h * w) {
        const size_t ix = i % w, iy = (i / w) % h, p = i / ((size_t)h * w);
        const float* block = dy + (p * oh + iy * sh) * ow + ix * sw;
        float acc = 0.0f;
        for (int a = 0; a < sh; ++a)
            for (int b = 0; b < sw; ++b) acc = __fadd_rn(acc, block[(size_t)a * ow + b]);
        dx[i] = acc;
    }
}
