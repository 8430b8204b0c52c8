// split.cu — one part of a tensor along an axis, and its gradient (src/ops/split/, the CPU
// reference): values moved, none computed, so both kernels give the CPU's bits.
//
// Around the axis the tensor is (outer, axis, inner); the part is its rows start..start+len
// of each outer block. Both kernels are grid-stride loops over their output, one thread a
// value (writes coalesced, and the reads too: a block's part is contiguous), of any launch
// shape. The backward WRITES every value of dx: the part's gradient in its place, 0 elsewhere
// (a graph sums the gradients of the parts of one tensor).

// x: (outer, axis, inner) -> y: (outer, len, inner).
extern "C" __global__ void split_fwd_f32(const float* x, float* y, size_t outer, size_t axis, size_t start,
                                         size_t len, size_t inner) {
    const size_t block = len * inner;
    GRID_STRIDE(i, outer * block) {
        const size_t o = i / block, r = i % block;
        y[i] = x[(o * axis + start) * inner + r];
    }
}

// dy: (outer, len, inner) -> dx: (outer, axis, inner).
extern "C" __global__ void split_bwd_f32(const float* dy, float* dx, size_t outer, size_t axis, size_t start,
                                         size_t len, size_t inner) {
    const size_t whole = axis * inner, block = len * inner;
    GRID_STRIDE(i, outer * whole) {
        const size_t o = i / whole, r = i % whole, row = r / inner;
        dx[i] = row >= start && row < start + len ? dy[o * block + (r - start * inner)] : 0.0f;
    }
}
