// permute.cu — a tensor's axes put in another order (src/ops/permute/, the CPU reference):
// values moved, none computed, so every kernel here gives the CPU's bits.
//
// Owns two moves, each in a forward and a backward (the backward is the inverse
// permutation, so each pair shares one device function; the launches hand the backward
// the inverse's geometry):
//   * permute_{fwd,bwd}: any permutation, one thread per output value (writes coalesced),
//     gathering from the input through the reduced plan of one sample (src/ops/permute/
//     cpu.rs's Plan): `geom` holds its `rank` output dimensions, then each output axis's
//     stride in the sample, as unsigned; samples lie `per` values apart on both sides;
//   * permute_tiled_{fwd,bwd}: the plan that is a batch of 2-D transposes, (batches, rows,
//     cols) -> (batches, cols, rows), through a PERMUTE_TILE x PERMUTE_TILE tile of shared
//     memory (a column of padding keeps the transposed reads off one bank), so that both
//     the reads and the writes of a warp are rows: the last two axes swapped, channels
//     first <-> last, (T, H*D) -> (H*D, T).
//
// Launch shapes (the op's gpu.rs): the gathers are grid-stride loops of any shape; the
// tiled kernels walk the tiles block by block (tile t, t + gridDim.x, ...) and the tile's
// values thread by thread in steps of the block's shape, so any grid and block are
// correct; the launch's is (32, 8) threads and one block a tile, up to MAX_BLOCKS.

#define PERMUTE_TILE 32

// y[s, i] = x[s, src(i)], src(i) the sum over output axes j of i's coordinate along j
// times geom[rank + j]. x, y: (n, per); geom: (2 * rank).
__device__ void permute_gather(const float* x, float* y, size_t n, size_t per, int rank, const unsigned* geom) {
    GRID_STRIDE(i, n * per) {
        const size_t s = i / per;
        size_t r = i % per, at = 0;
        for (int j = rank - 1; j >= 0; --j) {
            const size_t d = geom[j];
            at += (r % d) * (size_t)geom[rank + j];
            r /= d;
        }
        y[i] = x[s * per + at];
    }
}

// x: (batches, rows, cols) -> y: (batches, cols, rows).
__device__ void permute_transpose(const float* x, float* y, size_t batches, int rows, int cols) {
    __shared__ float tile[PERMUTE_TILE][PERMUTE_TILE + 1];
    const size_t tiles_r = ((size_t)rows + PERMUTE_TILE - 1) / PERMUTE_TILE;
    const size_t tiles_c = ((size_t)cols + PERMUTE_TILE - 1) / PERMUTE_TILE;
    const size_t tiles = batches * tiles_r * tiles_c;
    const size_t plane = (size_t)rows * (size_t)cols;
    // The loop's bounds are the block's alone, so every thread meets every barrier.
    for (size_t t = blockIdx.x; t < tiles; t += gridDim.x) {
        const size_t b = t / (tiles_r * tiles_c), rc = t % (tiles_r * tiles_c);
        const int r0 = (int)(rc / tiles_c) * PERMUTE_TILE, c0 = (int)(rc % tiles_c) * PERMUTE_TILE;
        const float* xb = x + b * plane;
        float* yb = y + b * plane;
        for (int i = threadIdx.y; i < PERMUTE_TILE; i += blockDim.y)
            for (int j = threadIdx.x; j < PERMUTE_TILE; j += blockDim.x)
                if (r0 + i < rows && c0 + j < cols) tile[i][j] = xb[(size_t)(r0 + i) * cols + c0 + j];
        __syncthreads();
        // Output row c0 + i holds input column c0 + i: its values are the tile's column i.
        for (int i = threadIdx.y; i < PERMUTE_TILE; i += blockDim.y)
            for (int j = threadIdx.x; j < PERMUTE_TILE; j += blockDim.x)
                if (c0 + i < cols && r0 + j < rows) yb[(size_t)(c0 + i) * rows + r0 + j] = tile[j][i];
        __syncthreads();  // the tile is refilled by the next round
    }
}

// y = x permuted. x, y: (n, per); geom: the forward plan's (2 * rank).
extern "C" __global__ void permute_fwd_f32(const float* x, float* y, size_t n, size_t per, int rank,
                                           const unsigned* geom) {
    permute_gather(x, y, n, per, rank, geom);
}

// dx = dy permuted back. dy, dx: (n, per); geom: the inverse plan's (2 * rank).
extern "C" __global__ void permute_bwd_f32(const float* dy, float* dx, size_t n, size_t per, int rank,
                                           const unsigned* geom) {
    permute_gather(dy, dx, n, per, rank, geom);
}

// x: (batches, rows, cols) -> y: (batches, cols, rows).
extern "C" __global__ void permute_tiled_fwd_f32(const float* x, float* y, size_t batches, int rows, int cols) {
    permute_transpose(x, y, batches, rows, cols);
}

// dy: (batches, rows, cols) -> dx: (batches, cols, rows), rows and cols dy's: the forward's
// transpose back, so the launch passes the forward's (cols, rows).
extern "C" __global__ void permute_tiled_bwd_f32(const float* dy, float* dx, size_t batches, int rows, int cols) {
    permute_transpose(dy, dx, batches, rows, cols);
}
