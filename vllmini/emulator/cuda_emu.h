// cuda_emu.h: the part of CUDA that vllmini's kernels use, for an ordinary C++17 compiler.
//
// vllmini.emulator compiles a translation unit made of this header, then the UNMODIFIED .cu source
// (after a #line directive, so messages name the kernel file), then a generated launcher and
// emu_runtime.h (the scheduler). Every CUDA thread of a block is a fiber with its own stack; the
// fibers of one block run one after another on one OS thread, each until it reaches __syncthreads()
// or a warp collective (see emu_runtime.h). The kernel's memory accesses are checked (emu_check.h).
// This is host C++: the kernel source runs inside the calling (Python) process, with its rights.
//
// Supported subset (anything else is a compile error from the C++ compiler, shown with the kernel line):
//   qualifiers   __global__ __device__ __host__ __forceinline__ __noinline__ __restrict__ __launch_bounds__
//                __align__(n) __constant__ (plain global; no host API to set it) __shared__ (static and
//                `extern __shared__ T name[];` dynamic shared memory)
//   built-ins    threadIdx blockIdx blockDim gridDim (uint3 / dim3) warpSize
//   sync         __syncthreads __syncthreads_count/_and/_or __syncwarp __threadfence(_block/_system)
//   warp         __shfl_sync __shfl_up_sync __shfl_down_sync __shfl_xor_sync (any 2/4/8-byte type, width)
//                __ballot_sync __any_sync __all_sync __activemask
//   atomics      atomicAdd atomicExch atomicMin atomicMax atomicAnd atomicOr atomicXor on int, unsigned,
//                long long, unsigned long long (atomicAdd also float, double, __half; atomicExch also float,
//                as in CUDA: no double); atomicSub (int, unsigned); atomicInc atomicDec (unsigned);
//                atomicCAS (any integer type)
//   vector types char2/4 uchar2/4 short2/4 int2/3/4 uint2/3/4 float2/3/4 double2 longlong2 with make_*
//   math         the C math library (expf, exp2f, logf, sqrtf, fmaxf, fabsf, fmaf, powf, tanhf, ...) plus
//                __expf __exp10f __logf __log2f __powf __sinf __cosf __tanf __fdividef rsqrtf __frcp_rn
//                __fsqrt_rn __saturatef __fmaf_rn __fadd_rn __fmul_rn min max INFINITY NAN FLT_MAX
//   bits         __popc __popcll __clz __clzll __ffs __ffsll __brev __float_as_int __int_as_float
//                __float_as_uint __uint_as_float __double_as_longlong __longlong_as_double
//   memory       __ldg (a plain load)
//   half types   __half __half2 __nv_bfloat16 with __float2half(_rn) __half2float __float2bfloat16(_rn)
//                __bfloat162float, arithmetic through float (cuda_fp16.h / cuda_bf16.h are accepted)
//   other        assert (raises a Python error naming the kernel line), __trap, printf, clock, clock64
//                (a counter: it advances by one per call). printf is a macro (so write printf, not
//                std::printf) for a wrapper that a stop never interrupts while stdio holds its lock.
// Not supported: cooperative groups, tensor cores (mma/wmma), inline PTX, textures/surfaces, cluster and
// grid-wide sync, dynamic parallelism, __constant__ set from the host, device-side malloc.
#pragma once

// Code the bounds and race checks skip (the runtime, the checks themselves, atomics): see emu_check.h
#if defined(__clang__)
#define EMU_UNCHECKED __attribute__((no_sanitize("thread")))
#else
#define EMU_UNCHECKED __attribute__((no_sanitize_thread))
#endif

#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS hides the ucontext functions without it
#endif

#include <cassert>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <type_traits>
#include <utility>
// Every system header the runtime uses comes in here, BEFORE the CUDA macros below: newer libstdc++
// headers spell attributes like __attribute__((__noinline__)), which the macro would break.
#include <algorithm>
#include <atomic>
#include <string>
#include <vector>
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#if defined(__linux__)
#include <link.h>
#endif

// ---------------------------------------------------------------- qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__
#define __managed__
// A block's threads are fibers on ONE OS thread, so a thread_local object is one copy per block: exactly
// CUDA's shared memory. thread_local (unlike static) is also legal after `extern`, so dynamic shared
// memory (`extern __shared__ float smem[];`) compiles; the launcher defines it. emu_runtime.h fills all
// of it with 0xFF bytes (NaN as float, -1 as int) before every block.
#define __shared__ thread_local
#define __CUDACC__ 1
#define __CUDA_ARCH__ 800
#define __VLLMINI_EMULATOR__ 1

// ---------------------------------------------------------------- vector types (aggregates, CUDA alignment)
#define EMU_VEC2(T, N, A) struct __attribute__((aligned(A))) N##2 { T x, y; }; \
    static inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }
#define EMU_VEC3(T, N) struct N##3 { T x, y, z; }; \
    static inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }
#define EMU_VEC4(T, N, A) struct __attribute__((aligned(A))) N##4 { T x, y, z, w; }; \
    static inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
EMU_VEC2(char, char, 2) EMU_VEC4(char, char, 4)
EMU_VEC2(unsigned char, uchar, 2) EMU_VEC4(unsigned char, uchar, 4)
EMU_VEC2(short, short, 4) EMU_VEC4(short, short, 8)
EMU_VEC2(int, int, 8) EMU_VEC3(int, int) EMU_VEC4(int, int, 16)
EMU_VEC2(unsigned int, uint, 8) EMU_VEC3(unsigned int, uint) EMU_VEC4(unsigned int, uint, 16)
EMU_VEC2(float, float, 8) EMU_VEC3(float, float) EMU_VEC4(float, float, 16)
EMU_VEC2(double, double, 16)
EMU_VEC2(long long, longlong, 16)
#undef EMU_VEC2
#undef EMU_VEC3
#undef EMU_VEC4

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
    constexpr dim3() = default;
    constexpr dim3(unsigned int x_, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

// ---------------------------------------------------------------- half precision (storage + float math)
namespace __emu {
inline unsigned int f2u(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned short float_to_half_bits(float f) {  // round to nearest even, like __float2half_rn
    unsigned int u = f2u(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return static_cast<unsigned short>(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
    if (a >= 0x477ff000u) return static_cast<unsigned short>(sign | 0x7c00u);  // rounds to inf
    if (a < 0x38800000u) {  // subnormal half (or zero)
        float m = u2f(a) * 16777216.0f;  // 2^24: half subnormal unit = 2^-24
        unsigned int q = static_cast<unsigned int>(std::nearbyint(m));
        return static_cast<unsigned short>(sign | q);
    }
    unsigned int r = a + 0xfffu + ((a >> 13) & 1u);  // round mantissa 23 -> 10 bits, ties to even
    return static_cast<unsigned short>(sign | ((r - 0x38000000u) >> 13));
}
inline float half_bits_to_float(unsigned short h) {
    unsigned int sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 31) return u2f(sign | 0x7f800000u | (m << 13));
    if (e == 0) { float v = static_cast<float>(m) * (1.0f / 16777216.0f); return sign ? -v : v; }
    return u2f(sign | ((e + 112) << 23) | (m << 13));
}
inline unsigned short float_to_bf16_bits(float f) {
    unsigned int u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);  // quiet NaN
    return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_bits_to_float(unsigned short b) { return u2f(static_cast<unsigned int>(b) << 16); }
}  // namespace __emu

// H: 16 bits of storage, converted to and from float with TO / FROM; H2: a pair of them
#define EMU_HALF_TYPE(H, H2, TO, FROM)                                                          \
    struct H {                                                                                  \
        unsigned short __x;                                                                     \
        H() = default;                                                                          \
        H(float f) : __x(__emu::TO(f)) {}                                                       \
        H(double f) : H(static_cast<float>(f)) {}                                               \
        H(int i) : H(static_cast<float>(i)) {}                                                  \
        operator float() const { return __emu::FROM(__x); }                                     \
    };                                                                                          \
    struct __attribute__((aligned(4))) H2 { H x, y; };
EMU_HALF_TYPE(__half, __half2, float_to_half_bits, half_bits_to_float)
EMU_HALF_TYPE(__nv_bfloat16, __nv_bfloat162, float_to_bf16_bits, bf16_bits_to_float)
#undef EMU_HALF_TYPE
typedef __half half;
typedef __half2 half2;
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return static_cast<float>(h); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__half(a), __half(b)}; }
inline __half2 __float2half2_rn(float a) { return __half2{__half(a), __half(a)}; }
inline float2 __half22float2(__half2 h) { return float2{float(h.x), float(h.y)}; }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return static_cast<float>(b); }
inline float2 __bfloat1622float2(__nv_bfloat162 b) { return float2{float(b.x), float(b.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__nv_bfloat16(a), __nv_bfloat16(b)}; }
#define EMU_HALF_OPS(H)                                                                              \
    inline H operator+(H a, H b) { return H(float(a) + float(b)); }                                  \
    inline H operator-(H a, H b) { return H(float(a) - float(b)); }                                  \
    inline H operator*(H a, H b) { return H(float(a) * float(b)); }                                  \
    inline H operator/(H a, H b) { return H(float(a) / float(b)); }                                  \
    inline H operator-(H a) { H r = a; r.__x ^= 0x8000u; return r; }                                 \
    inline H& operator+=(H& a, H b) { return a = a + b; }                                            \
    inline H& operator-=(H& a, H b) { return a = a - b; }                                            \
    inline H& operator*=(H& a, H b) { return a = a * b; }                                            \
    inline H& operator/=(H& a, H b) { return a = a / b; }                                            \
    inline bool operator==(H a, H b) { return float(a) == float(b); }                                \
    inline bool operator!=(H a, H b) { return float(a) != float(b); }                                \
    inline bool operator<(H a, H b) { return float(a) < float(b); }                                  \
    inline bool operator<=(H a, H b) { return float(a) <= float(b); }                                \
    inline bool operator>(H a, H b) { return float(a) > float(b); }                                  \
    inline bool operator>=(H a, H b) { return float(a) >= float(b); }
EMU_HALF_OPS(__half)
EMU_HALF_OPS(__nv_bfloat16)
#undef EMU_HALF_OPS
inline __half __hadd(__half a, __half b) { return a + b; }
inline __half __hmul(__half a, __half b) { return a * b; }
inline __half __hsub(__half a, __half b) { return a - b; }
inline __half __hdiv(__half a, __half b) { return a / b; }
inline __half __hfma(__half a, __half b, __half c) { return __half(std::fma(float(a), float(b), float(c))); }
inline __half __hmax(__half a, __half b) { return float(a) < float(b) ? b : a; }
inline __half __hmin(__half a, __half b) { return float(b) < float(a) ? b : a; }

// ---------------------------------------------------------------- math intrinsics
#define warpSize 32
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float exp10f(float x) { return powf(10.0f, x); }
inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }
// CUDA's min/max accept any mix of arithmetic types and use the usual conversions.
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> min(A a, B b) { using C = std::common_type_t<A, B>; return C(b) < C(a) ? C(b) : C(a); }
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> max(A a, B b) { using C = std::common_type_t<A, B>; return C(a) < C(b) ? C(b) : C(a); }
inline int __mul24(int a, int b) { return a * b; }
inline unsigned int __umul24(unsigned int a, unsigned int b) { return a * b; }
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}

// ---------------------------------------------------------------- bit tricks
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned int>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }

// ---------------------------------------------------------------- the emulator's state (see emu_runtime.h)
namespace __emu {
struct Fiber;  // one CUDA thread: its coordinates, state and stack (defined in emu_runtime.h)
struct ThreadView { uint3 tid; };  // the first member of every Fiber
inline ThreadView* cur = nullptr;  // the running thread (a plain global: one OS thread runs a launch)
inline uint3 thread_idx{0, 0, 0};  // its threadIdx: a copy in static data, which kernel code may read
inline uint3 block_idx{0, 0, 0};
inline dim3 block_dim, grid_dim;
enum Op { OP_SHFL_IDX = 1, OP_SHFL_UP, OP_SHFL_DOWN, OP_SHFL_XOR, OP_BALLOT, OP_ANY, OP_ALL, OP_SYNCWARP };
[[noreturn]] void fail(const char* file, int line, const char* fmt, ...);
unsigned long long warp_collective(int op, unsigned int mask, unsigned long long value, int arg, int width,
                                   const char* file, int line);
int block_barrier(int kind, int pred, const char* file, int line);
unsigned int active_mask();
int kernel_printf(const char* format, ...) __attribute__((format(printf, 1, 2)));
void check_atomic(const void* p, size_t size, const void* pc);  // bounds only: atomics never race
template <class T> inline unsigned long long to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "warp shuffles move 1 to 8 bytes");
    unsigned long long b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> inline T from_bits(unsigned long long b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}
}  // namespace __emu

#define threadIdx (static_cast<const uint3&>(::__emu::thread_idx))
#define blockIdx (static_cast<const uint3&>(::__emu::block_idx))
#define blockDim (static_cast<const dim3&>(::__emu::block_dim))
#define gridDim (static_cast<const dim3&>(::__emu::grid_dim))

// The trailing file/line arguments default to the CALLER's position, so errors name the kernel line.
#define EMU_HERE const char *__file = __builtin_FILE(), int __line = __builtin_LINE()

// ---------------------------------------------------------------- barriers
inline void __syncthreads(EMU_HERE) { __emu::block_barrier(0, 1, __file, __line); }
inline int __syncthreads_count(int p, EMU_HERE) { return __emu::block_barrier(1, p != 0, __file, __line); }
inline int __syncthreads_and(int p, EMU_HERE) { return __emu::block_barrier(2, p != 0, __file, __line); }
inline int __syncthreads_or(int p, EMU_HERE) { return __emu::block_barrier(3, p != 0, __file, __line); }
inline void __syncwarp(unsigned int mask = 0xffffffffu, EMU_HERE) {
    __emu::warp_collective(__emu::OP_SYNCWARP, mask, 0, 0, 32, __file, __line);
}
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
inline unsigned int __activemask() { return __emu::active_mask(); }

// ---------------------------------------------------------------- warp shuffles and votes
template <class T> inline T __shfl_sync(unsigned int mask, T var, int src_lane, int width = 32, EMU_HERE) {
    return __emu::from_bits<T>(__emu::warp_collective(__emu::OP_SHFL_IDX, mask, __emu::to_bits(var), src_lane,
                                                      width, __file, __line));
}
template <class T> inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = 32, EMU_HERE) {
    return __emu::from_bits<T>(__emu::warp_collective(__emu::OP_SHFL_UP, mask, __emu::to_bits(var),
                                                      static_cast<int>(delta), width, __file, __line));
}
template <class T> inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = 32, EMU_HERE) {
    return __emu::from_bits<T>(__emu::warp_collective(__emu::OP_SHFL_DOWN, mask, __emu::to_bits(var),
                                                      static_cast<int>(delta), width, __file, __line));
}
template <class T> inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = 32, EMU_HERE) {
    return __emu::from_bits<T>(__emu::warp_collective(__emu::OP_SHFL_XOR, mask, __emu::to_bits(var), lane_mask,
                                                      width, __file, __line));
}
inline unsigned int __ballot_sync(unsigned int mask, int pred, EMU_HERE) {
    return static_cast<unsigned int>(
        __emu::warp_collective(__emu::OP_BALLOT, mask, pred != 0, 0, 32, __file, __line));
}
inline int __any_sync(unsigned int mask, int pred, EMU_HERE) {
    return static_cast<int>(__emu::warp_collective(__emu::OP_ANY, mask, pred != 0, 0, 32, __file, __line));
}
inline int __all_sync(unsigned int mask, int pred, EMU_HERE) {
    return static_cast<int>(__emu::warp_collective(__emu::OP_ALL, mask, pred != 0, 0, 32, __file, __line));
}

// ---------------------------------------------------------------- atomics
// Threads never run at the same time (fibers switch only at barriers and collectives), so a plain
// read-modify-write is atomic here. Each returns the old value, as in CUDA. They are bounds-checked, and
// never reported as a race (EMU_UNCHECKED keeps the compiler's per-access checks out of them).
#define EMU_ATOMIC(NAME, T, EXPR) EMU_UNCHECKED inline T NAME(T* p, T v) { \
    __emu::check_atomic(p, sizeof(T), __builtin_return_address(0)); T old = *p; *p = (EXPR); return old; }
#define EMU_ATOMIC_INTS(NAME, EXPR) EMU_ATOMIC(NAME, int, EXPR) EMU_ATOMIC(NAME, unsigned int, EXPR) \
    EMU_ATOMIC(NAME, unsigned long long, EXPR) EMU_ATOMIC(NAME, long long, EXPR)
EMU_ATOMIC_INTS(atomicAdd, old + v)
EMU_ATOMIC(atomicAdd, float, old + v)
EMU_ATOMIC(atomicAdd, double, old + v)
EMU_ATOMIC(atomicAdd, __half, old + v)
EMU_ATOMIC(atomicSub, int, old - v)
EMU_ATOMIC(atomicSub, unsigned int, old - v)
EMU_ATOMIC_INTS(atomicExch, v)
EMU_ATOMIC(atomicExch, float, v)
EMU_ATOMIC_INTS(atomicMin, v < old ? v : old)
EMU_ATOMIC_INTS(atomicMax, old < v ? v : old)
EMU_ATOMIC_INTS(atomicAnd, old & v)
EMU_ATOMIC_INTS(atomicOr, old | v)
EMU_ATOMIC_INTS(atomicXor, old ^ v)
#undef EMU_ATOMIC_INTS
#undef EMU_ATOMIC
EMU_UNCHECKED inline unsigned int atomicInc(unsigned int* p, unsigned int v) {
    __emu::check_atomic(p, 4, __builtin_return_address(0));
    unsigned int o = *p; *p = o >= v ? 0 : o + 1; return o;
}
EMU_UNCHECKED inline unsigned int atomicDec(unsigned int* p, unsigned int v) {
    __emu::check_atomic(p, 4, __builtin_return_address(0));
    unsigned int o = *p; *p = (o == 0 || o > v) ? v : o - 1; return o;
}
template <class T> EMU_UNCHECKED inline T atomicCAS(T* p, T compare, T v) {
    static_assert(std::is_integral_v<T>, "atomicCAS works on int, unsigned, unsigned long long, unsigned short");
    __emu::check_atomic(p, sizeof(T), __builtin_return_address(0));
    T old = *p;
    if (old == compare) *p = v;
    return old;
}
#define atomicAdd_block atomicAdd
#define atomicAdd_system atomicAdd
#define atomicMax_block atomicMax
#define atomicMin_block atomicMin

// ---------------------------------------------------------------- misc
#define printf ::__emu::kernel_printf  // the C printf, never cut short by a stop (see emu_runtime.h)
inline long long clock64() { static long long t = 0; return t += 1; }
#define clock() (static_cast<long>(clock64()))
[[noreturn]] inline void __trap(EMU_HERE) { __emu::fail(__file, __line, "__trap() called"); }
#undef assert
#define assert(e) ((e) ? (void)0 : ::__emu::fail(__FILE__, __LINE__, "assert(%s) failed", #e))
#undef EMU_HERE
#include "emu_mma.h"  // the tensor-core product mma.sync m16n8k16 (a warp collective)
