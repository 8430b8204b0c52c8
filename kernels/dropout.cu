// dropout.cu — inverted dropout whose mask is a pure function of position, never stored.
//
// Owns: dropout forward and backward. The keep/drop decision for element `idx` of layer
// `layer` at `step` in logical replica `shard` is a counter-based hash, so
//   * the backward recomputes the mask instead of keeping it in memory;
//   * a micro-batch of an accumulated step draws the whole shard's masks: element i of
//     its buffer is element idx = first + i of the logical replica's shard;
//   * the CPU backend gets bit-identical masks by running the same few integer lines
//     (src/ops/dropout/cpu.rs, which these kernels are held to on the host and on a GPU);
//   * the mask does not depend on which device computes a logical replica (DESIGN.md).
//
// The hash is the SplitMix64 finaliser (Steele, Lea, Flood 2014; the mixer of Java's
// SplittableRandom), applied to key + idx * golden ratio:
//   mix64(z): z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
//             z = (z ^ (z >> 27)) * 0x94D049BB133111EB;
//             z ^= z >> 31
//   key  = mix64(mix64(mix64(seed + step * G) + shard * G) + layer * G), G = 0x9E3779B97F4A7C15
//   z    = mix64(key + idx * G), idx = first + i
//   keep = (z >> 40) / 2^24 >= rate      (24 uniform bits; exact in float32)
// Each element is multiplied by its factor: 1 / (1 - rate) (computed in float32) where
// kept, 0 where dropped. A dropped element is therefore x * 0, not a literal 0: -0 for a
// negative x and NaN for a NaN, bit for bit what the CPU layer (src/ops/dropout/) computes, so
// a non-finite value is not hidden on one backend and seen on the other.
// All arithmetic is modulo 2^64.

#define GRID_STRIDE(i, n) \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)blockDim.x * gridDim.x)

#define GOLDEN 0x9E3779B97F4A7C15ull

__device__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ unsigned long long dropout_key(unsigned long long seed, unsigned long long step,
                                          unsigned long long shard, unsigned long long layer) {
    return mix64(mix64(mix64(seed + step * GOLDEN) + shard * GOLDEN) + layer * GOLDEN);
}

__device__ bool dropout_keep(unsigned long long key, unsigned long long idx, float rate) {
    const unsigned long long z = mix64(key + idx * GOLDEN);
    return (float)(z >> 40) * (1.0f / 16777216.0f) >= rate;
}

// y = x * (keep ? 1 / (1 - rate) : 0)
// x, y: (n)
extern "C" __global__ void dropout_fwd_f32(const float* x, float* y, float rate,
                                           unsigned long long seed, unsigned long long step,
                                           unsigned long long shard, unsigned long long layer,
                                           unsigned long long first, size_t n) {
    const unsigned long long key = dropout_key(seed, step, shard, layer);
    const float scale = 1.0f / (1.0f - rate);
    GRID_STRIDE(i, n) { y[i] = x[i] * (dropout_keep(key, first + i, rate) ? scale : 0.0f); }
}

// dx = dy * (keep ? 1 / (1 - rate) : 0), with the same mask as the forward (same arguments).
// dy, dx: (n)
extern "C" __global__ void dropout_bwd_f32(const float* dy, float* dx, float rate,
                                           unsigned long long seed, unsigned long long step,
                                           unsigned long long shard, unsigned long long layer,
                                           unsigned long long first, size_t n) {
    const unsigned long long key = dropout_key(seed, step, shard, layer);
    const float scale = 1.0f / (1.0f - rate);
    GRID_STRIDE(i, n) { dx[i] = dy[i] * (dropout_keep(key, first + i, rate) ? scale : 0.0f); }
}
