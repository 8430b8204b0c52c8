// codec.cu — 16-bit gradients on the wire (--grad-compression bf16|fp16) on a GPU: the
// codec of src/exchange/codec.rs, bit for bit.
//
// Owns: encoding slots into their wires, the sum of R wires (each decoded, added in f32
// in the canonical tree over wire indices, the sum encoded into one wire), and decoding a
// wire back to f32. What is encoded, the formats and the tree are codec.rs's and
// shm.rs's (`tree_sum`); this file only mirrors them, and the host check of its owner
// (src/exchange/gpu/codec.rs) holds every kernel to them bit for bit. Which wires meet where is the GPU exchange's
// (src/exchange/gpu/mod.rs). Not part of autograd: the names are `<op>_f32`.
//
// A wire, as bytes from its start (src/cuda/launch.rs's WireGeom computes the offsets):
//   codes  unsigned short[encoded]              at 0        the 16-bit codes
//   exps   signed char[ceil(encoded / 1024)]    at exps_at  fp16 only: block b's values
//                                                           were multiplied by 2^exps[b]
//   raw    float[raw]                           at raw_at   the values past the encoded
//                                                           part (BatchNorm buffers), f32
// Blocks are CODEC_BLOCK = 1024 values from the slot's start (codec.rs's BLOCK). Every
// kernel runs one CUDA block of CODEC_THREADS threads per 1024 values, the encoded part's
// blocks first, then the raw part's: grid.x = ceil(encoded / 1024) + ceil(raw / 1024),
// thread t taking values t, t + 256, t + 512, t + 768 of its block.
//
// Why the explicit _rn arithmetic: NVRTC contracts a*b + c into one fused multiply-add
// by default (-fmad=true), which rounds once where codec.rs rounds twice; __fmul_rn and
// __fadd_rn are never contracted. Why a scale of 2^0 is skipped rather than applied:
// CUDA's arithmetic returns its canonical NaN for a NaN operand, where codec.rs's x * 1.0
// keeps the NaN's sign and payload (and x * 1 = x for every other x).
// Denormals are kept (NVRTC's default -ftz=false), as on the CPU.

#define CODEC_BLOCK 1024
#define CODEC_THREADS 256
#define CODEC_PER_THREAD (CODEC_BLOCK / CODEC_THREADS)
#define FORMAT_BF16 1
#define FORMAT_FP16 2
// Levels of the canonical tree's stack: enough for 2^32 wires.
#define TREE_DEPTH 33

// codec.rs bf16_bits: the top 16 bits rounded to nearest even; every NaN is 0x7FC0.
__device__ unsigned short bf16_bits(float x) {
    const unsigned int b = __float_as_uint(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (unsigned short)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

__device__ float bf16_value(unsigned short h) { return __uint_as_float((unsigned int)h << 16); }

// The IEEE half-precision code of x, rounded to nearest even: the `half` crate's
// software conversion (f32_to_f16_fallback), which its F16C path and codec.rs's match
// bit for bit (codec.rs tests it). NaN keeps its sign and top payload bits, quieted.
__device__ unsigned short fp16_bits(float value) {
    const unsigned int x = __float_as_uint(value);
    const unsigned int sign = x & 0x80000000u, exp = x & 0x7F800000u, man = x & 0x007FFFFFu;
    if (exp == 0x7F800000u) {
        const unsigned int nan_bit = man == 0 ? 0u : 0x0200u;
        return (unsigned short)((sign >> 16) | 0x7C00u | nan_bit | (man >> 13));
    }
    const unsigned int half_sign = sign >> 16;
    const int half_exp = (int)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1F) return (unsigned short)(half_sign | 0x7C00u);
    if (half_exp <= 0) {
        if (14 - half_exp > 24) return (unsigned short)half_sign;
        const unsigned int m = man | 0x00800000u;
        unsigned int half_man = m >> (14 - half_exp);
        const unsigned int round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0 && (m & (3u * round_bit - 1u)) != 0) half_man += 1;
        return (unsigned short)(half_sign | half_man);
    }
    const unsigned int bits = half_sign | ((unsigned int)half_exp << 10) | (man >> 13);
    const unsigned int round_bit = 0x00001000u;
    if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0) return (unsigned short)(bits + 1u);
    return (unsigned short)bits;
}

// The f32 value of an IEEE half code (exact): `half`'s f16_to_f32_fallback.
__device__ float fp16_value(unsigned short i) {
    const unsigned int h = i;
    if ((h & 0x7FFFu) == 0) return __uint_as_float(h << 16);
    const unsigned int half_sign = h & 0x8000u, half_exp = h & 0x7C00u, half_man = h & 0x03FFu;
    if (half_exp == 0x7C00u) {
        if (half_man == 0) return __uint_as_float((half_sign << 16) | 0x7F800000u);
        return __uint_as_float((half_sign << 16) | 0x7FC00000u | (half_man << 13));
    }
    const unsigned int sign = half_sign << 16;
    if (half_exp == 0) {
        // A subnormal, normalised by its leading zeros as a 16-bit number (6..15: the
        // mantissa is nonzero and below 2^10).
        unsigned int lz = 0;
        for (unsigned int bit = 0x8000u; (half_man & bit) == 0; bit >>= 1) ++lz;
        const unsigned int e = lz - 6u;
        const unsigned int exp = (127u - 15u - e) << 23;
        const unsigned int m = (half_man << (14u + e)) & 0x7FFFFFu;
        return __uint_as_float(sign | exp | m);
    }
    const unsigned int exp = (unsigned int)((int)(half_exp >> 10) - 15 + 127) << 23;
    return __uint_as_float(sign | exp | (half_man << 13));
}

// 2^e for e in [-126, 127].
__device__ float pow2(int e) { return __uint_as_float((unsigned int)(127 + e) << 23); }

// codec.rs fp16_exponent, from the block's largest |x| bit pattern `top`: M in
// [2^E, 2^(E+1)) gives e = 14 - E, clamped to [-126, 126]; 0 for zeros, NaN or infinity.
__device__ int fp16_exponent(unsigned int top) {
    if (top == 0 || top >= 0x7F800000u) return 0;
    const int e = 14 - ((int)(top >> 23) - 127);
    return e < -126 ? -126 : (e > 126 ? 126 : e);
}

// x * 2^e rounded to f32 (as codec.rs's `x * scale`), then to fp16.
__device__ unsigned short fp16_scaled(float x, int e) { return fp16_bits(e == 0 ? x : __fmul_rn(x, pow2(e))); }

// fp16 code h of a block scaled by 2^e, decoded: fp16_value(h) * 2^-e.
__device__ float fp16_unscaled(unsigned short h, int e) {
    const float v = fp16_value(h);
    return e == 0 ? v : __fmul_rn(v, pow2(-e));
}

// The largest of every thread's v over the block, returned to every thread (an unsigned
// maximum: the same whatever the order). `part` is CODEC_THREADS values.
__device__ unsigned int block_max(unsigned int v, unsigned int* part) {
    part[threadIdx.x] = v;
    __syncthreads();
    for (int stride = CODEC_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride && part[threadIdx.x + stride] > part[threadIdx.x])
            part[threadIdx.x] = part[threadIdx.x + stride];
        __syncthreads();
    }
    const unsigned int top = part[0];
    __syncthreads();
    return top;
}

// Value i (< encoded) of a wire, decoded.
__device__ float decoded(const unsigned char* wire, size_t i, int format, size_t exps_at) {
    const unsigned short h = ((const unsigned short*)wire)[i];
    if (format == FORMAT_BF16) return bf16_value(h);
    return fp16_unscaled(h, ((const signed char*)(wire + exps_at))[i / CODEC_BLOCK]);
}

// Writes this thread's values v[j] (value base + threadIdx.x + j * CODEC_THREADS of the
// encoded part, those below `encoded`) into `wire`: bf16 each alone; fp16 scaled by the
// exponent of the whole block's largest magnitude, which thread 0 stores. Every thread of
// the block calls it (block_max meets at barriers).
__device__ void encode_block(const float* v, size_t base, size_t encoded, unsigned char* wire, int format,
                             size_t exps_at, unsigned int* part) {
    unsigned short* codes = (unsigned short*)wire;
    if (format == FORMAT_BF16) {
        for (int j = 0; j < CODEC_PER_THREAD; ++j) {
            const size_t i = base + threadIdx.x + (size_t)j * CODEC_THREADS;
            if (i < encoded) codes[i] = bf16_bits(v[j]);
        }
        return;
    }
    unsigned int top = 0;
    for (int j = 0; j < CODEC_PER_THREAD; ++j) {
        const size_t i = base + threadIdx.x + (size_t)j * CODEC_THREADS;
        const unsigned int m = __float_as_uint(v[j]) & 0x7FFFFFFFu;
        if (i < encoded && m > top) top = m;
    }
    const int e = fp16_exponent(block_max(top, part));
    if (threadIdx.x == 0) ((signed char*)(wire + exps_at))[base / CODEC_BLOCK] = (signed char)e;
    for (int j = 0; j < CODEC_PER_THREAD; ++j) {
        const size_t i = base + threadIdx.x + (size_t)j * CODEC_THREADS;
        if (i < encoded) codes[i] = fp16_scaled(v[j], e);
    }
}

// shm.rs tree_sum's canonical tree, one element at a time: sum(0..n) = sum(0..p) +
// sum(p..n), p the largest power of two below n (a+b, (a+b)+c, (a+b)+(c+d), ...). Pushing
// the values in order and adding the top two whenever they cover equal powers of two
// (the binary counter of the count pushed) leaves the balanced sums of the descending
// powers of two that make up n; adding those from the last one back gives the tree.
// Only the stack's first `depth` entries are ever read, so it starts unset.
struct Tree {
    float stack[TREE_DEPTH];
    int depth = 0;
    unsigned long long pushed = 0;
};

__device__ void tree_push(Tree& t, float v) {
    t.stack[t.depth++] = v;
    t.pushed += 1;
    for (unsigned long long c = t.pushed; (c & 1ull) == 0; c >>= 1) {
        t.depth -= 1;
        t.stack[t.depth - 1] = __fadd_rn(t.stack[t.depth - 1], t.stack[t.depth]);
    }
}

__device__ float tree_total(const Tree& t) {
    float acc = t.stack[t.depth - 1];
    for (int d = t.depth - 2; d >= 0; --d) acc = __fadd_rn(t.stack[d], acc);
    return acc;
}

// wires: k wires of wire_bytes bytes; src: k slots of src_stride floats, slot j encoded
// into wire j (grid.y = k). encoded + raw values of each slot are read.
extern "C" __global__ void wire_encode_f32(const float* src, unsigned char* wires, int format, size_t encoded,
                                           size_t raw, size_t src_stride, size_t wire_bytes, size_t exps_at,
                                           size_t raw_at) {
    __shared__ unsigned int part[CODEC_THREADS];
    const float* slot = src + (size_t)blockIdx.y * src_stride;
    unsigned char* wire = wires + (size_t)blockIdx.y * wire_bytes;
    const size_t encoded_blocks = (encoded + CODEC_BLOCK - 1) / CODEC_BLOCK;
    if (blockIdx.x >= encoded_blocks) {
        // The raw part travels as it is.
        float* out = (float*)(wire + raw_at);
        const size_t base = (blockIdx.x - encoded_blocks) * (size_t)CODEC_BLOCK;
        for (int j = 0; j < CODEC_PER_THREAD; ++j) {
            const size_t i = base + threadIdx.x + (size_t)j * CODEC_THREADS;
            if (i < raw) out[i] = slot[encoded + i];
        }
        return;
    }
    const size_t base = blockIdx.x * (size_t)CODEC_BLOCK;
    float v[CODEC_PER_THREAD];
    for (int j = 0; j < CODEC_PER_THREAD; ++j) {
        const size_t i = base + threadIdx.x + (size_t)j * CODEC_THREADS;
        v[j] = i < encoded ? slot[i] : 0.0f;
    }
    encode_block(v, base, encoded, wire, format, exps_at, part);
}

// wires: r wires of wire_bytes bytes, in logical-replica order -> out: one wire, their
// sum (codec.rs Codec::reduce): each value decoded from every wire, added in the
// canonical tree in f32, encoded; the raw part's floats added in the same tree.
extern "C" __global__ void wire_reduce_f32(const unsigned char* wires, unsigned char* out, int r, int format,
                                           size_t encoded, size_t raw, size_t wire_bytes, size_t exps_at,
                                           size_t raw_at) {
    __shared__ unsigned int part[CODEC_THREADS];
    const size_t encoded_blocks = (encoded + CODEC_BLOCK - 1) / CODEC_BLOCK;
    if (blockIdx.x >= encoded_blocks) {
        const size_t base = (blockIdx.x - encoded_blocks) * (size_t)CODEC_BLOCK;
        for (int j = 0; j < CODEC_PER_THREAD; ++j) {
            const size_t i = base + threadIdx.x + (size_t)j * CODEC_THREADS;
            if (i >= raw) continue;
            Tree t;
            for (int q = 0; q < r; ++q) tree_push(t, ((const float*)(wires + (size_t)q * wire_bytes + raw_at))[i]);
            ((float*)(out + raw_at))[i] = tree_total(t);
        }
        return;
    }
    const size_t base = blockIdx.x * (size_t)CODEC_BLOCK;
    float v[CODEC_PER_THREAD];
    for (int j = 0; j < CODEC_PER_THREAD; ++j) {
        const size_t i = base + threadIdx.x + (size_t)j * CODEC_THREADS;
        v[j] = 0.0f;
        if (i >= encoded) continue;
        Tree t;
        for (int q = 0; q < r; ++q) tree_push(t, decoded(wires + (size_t)q * wire_bytes, i, format, exps_at));
        v[j] = tree_total(t);
    }
    encode_block(v, base, encoded, out, format, exps_at, part);
}

// wire -> dst: (encoded + raw) floats, the codes decoded, the raw part copied
// (codec.rs Codec::decode). A grid-stride loop over the values.
extern "C" __global__ void wire_decode_f32(const unsigned char* wire, float* dst, int format, size_t encoded,
                                           size_t raw, size_t exps_at, size_t raw_at) {
    const size_t n = encoded + raw;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        dst[i] = i < encoded ? decoded(wire, i, format, exps_at) : ((const float*)(wire + raw_at))[i - encoded];
    }
}
