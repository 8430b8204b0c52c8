// embedding.cu — the token embedding, a gather of table rows by id, forward and backward.
//
// Owns: those kernels, and the deterministic embedding backward. The CPU layer
// (src/ops/embedding/) is the reference, and every sum here adds
// the same f32 values in the same order as theirs, so the host-run kernel test compares
// the two bit for bit:
//   * token ids arrive as floats (the network's input, exact integers below 2^24); an id
//     that is not an integer in [0, vocab) is never used as an index: the forward writes
//     NaN for its row and the backward skips it. The host refuses such ids by name before
//     they are copied (ops::embedding::check_ids), so on a run these guards never fire;
//     they only keep a bad id from reading or writing outside the table;
//   * the embedding backward adds each token's dy row into its id's gradient row in token
//     order (n, t), starting from the gradient's value (it ACCUMULATES, as the CPU does
//     `dweight[id] += dy`): no atomics, so the result is the same bits every run. A stable
//     counting sort of the token positions by id makes that order cheap to follow:
//       1. embedding_count_bwd: one thread per vocabulary row counts its tokens
//          (offsets[v + 1] = count);
//       2. embedding_offsets_bwd: one block turns the counts into offsets, an inclusive
//          scan of offsets[1..=V] (offsets[0] = 0); integers, so any order of the
//          additions gives the same offsets;
//       3. embedding_sort_bwd: one thread per row writes its tokens' positions, in token
//          order, at order[offsets[v]..offsets[v + 1]];
//       4. embedding_bwd: one thread per (row, column) adds its tokens' dy in that order.
//     Steps 1 and 3 read all M = N*T ids once per vocabulary row: O(V*M) reads (V = 256,
//     M = 768 for nanoGPT's CPU recipe: 2·10^5, nothing), which a GPT-2 vocabulary of
//     50257 at M = 8192 turns into 4·10^8 cached reads, a few milliseconds; a radix sort
//     would be the next step there. Step 4 reads each dy value once.
//
// The contract every file of kernels/ keeps is kernels/README.md's.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

// Threads of the one block embedding_offsets_bwd runs as; the host launches exactly this
// many (src/cuda/launch.rs REDUCE_BLOCK).
#define REDUCE_BLOCK 256

// The table row of token id `id`, or -1 for an id that is not an integer in [0, vocab).
// NaN fails both comparisons; (float)vocab is exact for vocab <= 2^24.
__device__ int embedding_row(float id, int vocab) {
    if (!(id >= 0.0f) || !(id < (float)vocab)) return -1;
    const int v = (int)id;
    return (float)v == id ? v : -1;
}

// y[i, :] = weight[ids[i], :], NaN for an id that is not a row.
// ids: (m), weight: (vocab, c) -> y: (m, c)
extern "C" __global__ void embedding_fwd_f32(const float* ids, const float* weight, float* y,
                                             size_t m, int vocab, int c) {
    GRID_STRIDE(i, m * (size_t)c) {
        const int v = embedding_row(ids[i / c], vocab);
        y[i] = v < 0 ? __int_as_float(0x7fc00000) : weight[(size_t)v * c + i % c];
    }
}

// offsets[v + 1] = the number of tokens of id v (offsets[0] is left to the scan).
// ids: (m) -> offsets: (vocab + 1)
extern "C" __global__ void embedding_count_bwd_f32(const float* ids, unsigned int* offsets,
                                                   size_t m, int vocab) {
    GRID_STRIDE(v, (size_t)vocab) {
        unsigned int count = 0;
        for (size_t i = 0; i < m; ++i) count += embedding_row(ids[i], vocab) == (int)v;
        offsets[v + 1] = count;
    }
}

// offsets[0] = 0, offsets[v + 1] = the tokens of ids 0..=v: one block of REDUCE_BLOCK
// threads, each scanning a contiguous chunk of the counts, then adding the chunks before
// its own (summed by thread 0).
// offsets: (vocab + 1), counts in 1..=vocab -> offsets
extern "C" __global__ void embedding_offsets_bwd_f32(unsigned int* offsets, int vocab) {
    __shared__ unsigned int chunk_total[REDUCE_BLOCK];
    const int tid = threadIdx.x;
    const int per = (vocab + REDUCE_BLOCK - 1) / REDUCE_BLOCK;
    const int lo = tid * per < vocab ? tid * per : vocab;
    const int hi = lo + per < vocab ? lo + per : vocab;
    unsigned int run = 0;
    for (int v = lo; v < hi; ++v) {
        run += offsets[v + 1];
        offsets[v + 1] = run;
    }
    chunk_total[tid] = run;
    __syncthreads();
    if (tid == 0) {
        unsigned int before = 0;
        for (int k = 0; k < REDUCE_BLOCK; ++k) {
            const unsigned int total = chunk_total[k];
            chunk_total[k] = before;
            before += total;
        }
        offsets[0] = 0;
    }
    __syncthreads();
    const unsigned int base = chunk_total[tid];
    for (int v = lo; v < hi; ++v) offsets[v + 1] += base;
}

// order[offsets[v] + k] = the position of the k-th token of id v, positions ascending: the
// token positions sorted by id, stably. Never writes past offsets[v + 1] or m.
// ids: (m), offsets: (vocab + 1) -> order: (m)
extern "C" __global__ void embedding_sort_bwd_f32(const float* ids, const unsigned int* offsets,
                                                  unsigned int* order, size_t m, int vocab) {
    GRID_STRIDE(v, (size_t)vocab) {
        size_t at = offsets[v];
        const size_t end = offsets[v + 1] < m ? offsets[v + 1] : m;
        for (size_t i = 0; i < m && at < end; ++i) {
            if (embedding_row(ids[i], vocab) == (int)v) order[at++] = (unsigned int)i;
        }
    }
}

// dweight[v, j] += dy[i, j] for the tokens i of id v, in token order, one add at a time
// into the gradient's value (as the CPU's dweight[id] += dy). A row without tokens is
// left as it is.
// dy: (m, c), offsets: (vocab + 1), order: (m) -> dweight: (vocab, c)
extern "C" __global__ void embedding_bwd_f32(const float* dy, const unsigned int* offsets,
                                             const unsigned int* order, float* dweight, size_t m,
                                             int vocab, int c) {
    GRID_STRIDE(i, (size_t)vocab * c) {
        const size_t v = i / c, j = i % c;
        const size_t begin = offsets[v];
        const size_t end = offsets[v + 1] < m ? offsets[v + 1] : m;
        if (begin >= end) continue;
        float g = dweight[i];
        for (size_t k = begin; k < end; ++k) {
            const size_t token = order[k];
            if (token < m) g += dy[token * c + j];
        }
        dweight[i] = g;
    }
}
