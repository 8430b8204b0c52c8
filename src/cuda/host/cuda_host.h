// cuda_host.h — just enough CUDA for kernels/*.cu to compile as C++20 and run on the host.
//
// Owns: the CUDA keywords, built-in index variables and intrinsics the kernels use, and an
// emulated launch (lockstep_host::launch) that runs a grid block after block, each block on
// blockDim.x*y*z real threads that meet at a std::barrier for __syncthreads(). Only
// src/cuda/host (the host-run kernel checks) uses it: it force-includes this header (-include) in front of an
// unmodified copy of every kernel file, so the code that runs here is the code NVRTC
// compiles for the GPU.
//
// What the emulation keeps, and why it is enough for these kernels:
//   * blocks run one at a time, so `__shared__` can be `static`: one array in the program
//     is exactly the shared memory of the one block that is running;
//   * the threads of a block are real threads, so a kernel that reads another thread's
//     shared-memory slot before __syncthreads() races here as it would on the GPU;
//   * a thread that returns leaves the block's barrier (arrive_and_drop), as an exited
//     thread no longer holds up __syncthreads() on the GPU.
// What it leaves out: warps and their intrinsics, atomics, dynamic shared memory, streams.
// A kernel that uses them does not compile against this header, loudly, until they are
// added here. Float results differ from the GPU's in rounding only (no FMA contraction on
// the host; rsqrtf, expf and logf come from the C library here, from the GPU's within
// 2 ulp there), which is why the tests compare against f64 references with stated
// tolerances.

#pragma once

#include <barrier>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// ---- keywords ----------------------------------------------------------------------

#define __global__
#define __device__ inline
#define __shared__ static

// ---- built-in variables ------------------------------------------------------------

struct uint3 {
    unsigned int x, y, z;
};

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Set by the emulated launch on each thread it starts, before the kernel body runs.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace lockstep_host {
// The barrier of the block the calling thread belongs to.
inline thread_local std::barrier<>* block_barrier = nullptr;
}  // namespace lockstep_host

inline void __syncthreads() { lockstep_host::block_barrier->arrive_and_wait(); }

// ---- intrinsics --------------------------------------------------------------------

// rsqrtf is a CUDA intrinsic, not a C++ function; a macro keeps it clear of any rsqrtf a
// newer C library may declare.
inline float lockstep_host_rsqrtf(float x) { return 1.0f / std::sqrt(x); }
#define rsqrtf lockstep_host_rsqrtf

inline float __int_as_float(int v) { return std::bit_cast<float>(v); }
inline int __float_as_int(float v) { return std::bit_cast<int>(v); }
inline float __uint_as_float(unsigned int v) { return std::bit_cast<float>(v); }
inline unsigned int __float_as_uint(float v) { return std::bit_cast<unsigned int>(v); }

// The round-to-nearest arithmetic intrinsics the kernels use where NVRTC would otherwise
// contract a multiply and an add into one FMA: on the host every operation rounds on its
// own already (no contraction in ISO C++ mode, and no FMA instruction in x86-64's base
// set), so each is its plain operator.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }

// expf, logf and sqrtf are the C library's (<cmath>), as NVRTC provides them on the device.

// ---- the emulated launch -----------------------------------------------------------

namespace lockstep_host {

// A kernel called with cuLaunchKernel's argument contract: args[i] points at the value of
// the i-th parameter.
using Thunk = void (*)(void** args);

template <class... A, std::size_t... I>
void call_unpacked(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <class... A>
void call(void (*kernel)(A...), void** args) {
    call_unpacked(kernel, args, std::index_sequence_for<A...>{});
}

// One thunk per kernel, made from its function pointer: no signature is written by hand.
template <auto Kernel>
void thunk(void** args) {
    call(Kernel, args);
}

// One letter per parameter type, so the caller can check the kinds and order of the
// values it passes: r = const float*, w = float*, R = const unsigned*, W = unsigned*,
// b = const unsigned char*, B = unsigned char*, d = const double*, D = double*,
// i = int, u = unsigned, z = 64-bit unsigned (size_t, unsigned long long), f = float,
// g = double, ? = anything else.
template <class T>
constexpr char type_code() {
    if constexpr (std::is_pointer_v<T>) {
        using P = std::remove_pointer_t<T>;
        using V = std::remove_cv_t<P>;
        constexpr bool ro = std::is_const_v<P>;
        if constexpr (std::is_same_v<V, float>) return ro ? 'r' : 'w';
        else if constexpr (std::is_same_v<V, unsigned int>) return ro ? 'R' : 'W';
        else if constexpr (std::is_same_v<V, unsigned char>) return ro ? 'b' : 'B';
        else if constexpr (std::is_same_v<V, double>) return ro ? 'd' : 'D';
        else return '?';
    } else if constexpr (std::is_same_v<T, float>) {
        return 'f';
    } else if constexpr (std::is_same_v<T, double>) {
        return 'g';
    } else if constexpr (std::is_same_v<T, int>) {
        return 'i';
    } else if constexpr (std::is_same_v<T, unsigned int>) {
        return 'u';
    } else if constexpr (std::is_integral_v<T> && std::is_unsigned_v<T> && sizeof(T) == 8) {
        return 'z';
    } else {
        return '?';
    }
}

template <class... A>
struct Signature {
    static constexpr char codes[] = {type_code<A>()..., '\0'};
};

template <class... A>
constexpr const char* signature(void (*)(A...)) {
    return Signature<A...>::codes;
}

struct Kernel {
    const char* name;
    Thunk thunk;
    const char* signature;
};

// Runs the grid block by block (x fastest). One team of blockDim.x*y*z real threads runs
// every block of the launch in turn: each block gets a barrier of its own for
// __syncthreads() (a thread that returns early leaves only its block's), and the whole
// team meets at a second barrier before the next block starts, so no two blocks overlap
// and the static `__shared__` arrays belong to one block at a time. Starting the threads
// once per launch instead of once per block only saves time.
inline void launch(dim3 grid, dim3 block, Thunk kernel, void** args) {
    const unsigned threads = block.x * block.y * block.z;
    const unsigned blocks = grid.x * grid.y * grid.z;
    std::vector<std::unique_ptr<std::barrier<>>> block_barriers;
    block_barriers.reserve(blocks);
    for (unsigned b = 0; b < blocks; ++b) block_barriers.push_back(std::make_unique<std::barrier<>>(threads));
    std::barrier<> block_done(threads);
    std::vector<std::thread> team;
    team.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
        team.emplace_back([&, t] {
            threadIdx = uint3{t % block.x, t / block.x % block.y, t / (block.x * block.y)};
            blockDim = block;
            gridDim = grid;
            for (unsigned b = 0; b < blocks; ++b) {
                blockIdx = uint3{b % grid.x, b / grid.x % grid.y, b / (grid.x * grid.y)};
                block_barrier = block_barriers[b].get();
                kernel(args);
                block_barrier->arrive_and_drop();
                block_done.arrive_and_wait();
            }
        });
    }
    for (auto& t : team) t.join();
}

// One launch at a time in the whole process, as on one stream: `__shared__` arrays are
// statics, so two launches of one kernel from two test threads would share them.
inline std::mutex& launch_mutex() {
    static std::mutex m;
    return m;
}

// The exported entry point's body; `table` is the generated list of every kernel.
inline int launch_by_name(const Kernel* table, std::size_t count, const char* name, dim3 grid, dim3 block,
                          void** args) {
    for (std::size_t i = 0; i < count; ++i) {
        if (std::strcmp(table[i].name, name) != 0) continue;
        if (grid.x * grid.y * grid.z == 0 || block.x * block.y * block.z == 0) return 2;
        std::lock_guard<std::mutex> lock(launch_mutex());
        launch(grid, block, table[i].thunk, args);
        return 0;
    }
    return 1;
}

inline const char* signature_by_name(const Kernel* table, std::size_t count, const char* name) {
    for (std::size_t i = 0; i < count; ++i) {
        if (std::strcmp(table[i].name, name) == 0) return table[i].signature;
    }
    return nullptr;
}

}  // namespace lockstep_host
