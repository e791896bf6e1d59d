// layer_ops.cu -- the small steps of a decoder layer, one launch each (vllmini.model on a GPU, "cupy").
//
// Around its three GEMMs and the attention, a Llama layer in eager PyTorch launches a dozen small
// kernels: the residual add, the norm and its weight, the rotary embedding (a flip, a multiply, an
// add), the copy of q, the cache write (an index, two scatters), SiLU and the gate multiply. Each one
// reads and writes its tensor through HBM and costs a launch. Here each group is one kernel, and each
// computes what vllmini.model's PyTorch code computes, rounding where it rounds (so the two agree to a
// rounding step; tests/test_layer_ops.py checks them against each other and against float64):
//
//   add_rms_norm   r = x + residual (rounded; written back to residual), out = weight * round(r / rms(r))
//                  (residual == nullptr: r = x, nothing written back). Grid (num_tokens,): a block per
//                  row, hidden <= 8192 and a multiple of 8 (a thread holds up to ROW_VALUES elements, read
//                  16 bytes at a time: rows 16-byte aligned).
//   rope_and_cache rotate q and k by each token's position, write q to q_out and k, v into the token's
//                  cache slot (slot -1: a padding row, not written). Grid (num_tokens, num_heads + 2 *
//                  num_kv_heads): a block per head, head_size <= THREADS.
//   silu_and_mul   out = round(silu(gate)) * up, gate and up the two halves of a row. Grid (num_tokens,
//                  ceil(inner / THREADS)): a thread per element.
//
// vLLM has the same three (csrc/layernorm_kernels.cu fused_add_rms_norm, csrc/pos_encoding_kernels.cu
// with csrc/cache_kernels.cu, csrc/activation_kernels.cu silu_and_mul). These are plain: no vector loads;
// they move a few KB a token, where the GEMMs read the weights, and need only enough blocks to keep
// many loads in flight (one block per token left one SM to do a batch-1 row: 5-6 µs a launch on an H200).
//
// Shapes (contiguous rows): x, out, residual [num_tokens, hidden]; weight [hidden]; qkv [num_tokens,
// (num_heads + 2 * num_kv_heads) * head_size] (q, k, v side by side); cos, sin_signed [num_positions,
// head_size] (vllmini.model.rope_cos_sin: cos repeated over both halves, sin with the first half
// negated); positions, slot_mapping int64 [num_tokens]; q_out [num_tokens, num_heads, head_size];
// key_cache, value_cache [num_slots / block_size, block_size, num_kv_heads, head_size] = [num_slots,
// num_kv_heads * head_size]; gate_up [num_tokens, 2 * inner]. Block = (THREADS,), no dynamic shared memory.
//
// Never out of bounds: a position outside [0, num_positions) makes that token's q and k NaN (the
// sampler then stops the request with an error) and a slot outside [-1, num_slots) is not written.

#define THREADS 256
#define WARP_SIZE 32
#define ROW_VALUES 32  // add_rms_norm: elements a thread holds; rows of up to THREADS * 32 = 8192
#ifndef NAN  // NVRTC has no <math.h>
#define NAN __int_as_float(0x7fffffff)
#endif

// ----------------------------------------------------------------------------- element types
// How a stored element becomes a float and a float is rounded back (round to nearest even).
struct Float32 {
    typedef float storage;
    static __device__ __forceinline__ float load(float x) { return x; }
    static __device__ __forceinline__ float store(float x) { return x; }
};
struct Float16 {
    typedef unsigned short storage;
    static __device__ __forceinline__ float load(unsigned short h) {
#ifndef __VLLMINI_EMULATOR__
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
#else
        return __emu::half_bits_to_float(h);
#endif
    }
    static __device__ __forceinline__ unsigned short store(float x) {
#ifndef __VLLMINI_EMULATOR__
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return h;
#else
        return __emu::float_to_half_bits(x);
#endif
    }
};
struct BFloat16 {  // the top 16 bits of a float32
    typedef unsigned short storage;
    static __device__ __forceinline__ float load(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }
    static __device__ __forceinline__ unsigned short store(float x) {
        const unsigned int u = __float_as_uint(x);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // quiet NaN
        return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
};

// x rounded to the element type and back: what PyTorch's ops in that dtype keep between two steps.
template <typename T>
__device__ __forceinline__ float rounded(float x) { return T::load(T::store(x)); }

// The sum of every thread's `value`, returned to all threads of the block (THREADS threads).
__device__ __forceinline__ float block_sum(float value) {
    __shared__ float warp_sums[THREADS / WARP_SIZE];
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2)
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (lane == 0) warp_sums[warp] = value;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < THREADS / WARP_SIZE; ++w) total += warp_sums[w];  // the same order in every thread
    return total;
}

// ----------------------------------------------------------------------------- add + RMSNorm
// One block per token: the row's sum of squares is a block reduction. A thread reads its part of x, the
// residual and the weight in 16-byte chunks (8 16-bit or 4 float32 elements; chunk c = thread + k *
// THREADS), every chunk before it uses any, so all of the row's loads are in flight at once: the weight
// too, which a barrier would otherwise hold back until after the reduction. On an H200 a batch-1 row of
// 2,048 bf16 takes 2.6 µs a launch, against 4.7 µs with one element per load and the weight read after.
// The host guarantees hidden % 8 == 0 and 16-byte aligned rows (vllmini.model.RMSNorm).
template <typename T>
__device__ void add_rms_norm_row(typename T::storage* __restrict__ out, typename T::storage* __restrict__ residual,
                                 const typename T::storage* __restrict__ x,
                                 const typename T::storage* __restrict__ weight, int hidden, float eps) {
    typedef typename T::storage S;
    constexpr int PER_CHUNK = 16 / sizeof(S), CHUNKS = ROW_VALUES / PER_CHUNK;
    const long long row = (long long)blockIdx.x * hidden;
    const int chunks = hidden / PER_CHUNK;
    const uint4* x_row = reinterpret_cast<const uint4*>(x + row);
    uint4* res_row = reinterpret_cast<uint4*>(residual + row);  // unused when residual == nullptr
    uint4 xs[CHUNKS], rs[CHUNKS], ws[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int c = threadIdx.x + k * THREADS;
        if (c >= chunks) continue;
        xs[k] = x_row[c];
        ws[k] = reinterpret_cast<const uint4*>(weight)[c];
        if (residual != nullptr) rs[k] = res_row[c];
    }
    float r[ROW_VALUES];  // this thread's elements of x + residual, rounded as PyTorch rounds the sum
    float squares = 0.0f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int c = threadIdx.x + k * THREADS;
        const S* xe = reinterpret_cast<const S*>(&xs[k]);
        S* re = reinterpret_cast<S*>(&rs[k]);
#pragma unroll
        for (int j = 0; j < PER_CHUNK; ++j) {
            float v = c < chunks ? T::load(xe[j]) : 0.0f;
            if (residual != nullptr && c < chunks) {
                v = rounded<T>(v + T::load(re[j]));
                re[j] = T::store(v);  // the next residual
            }
            r[k * PER_CHUNK + j] = v;
            squares += v * v;
        }
        if (residual != nullptr && c < chunks) res_row[c] = rs[k];
    }
    const float inv_rms = rsqrtf(block_sum(squares) / hidden + eps);
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int c = threadIdx.x + k * THREADS;
        if (c >= chunks) continue;
        const S* we = reinterpret_cast<const S*>(&ws[k]);
        uint4 o;
        S* oe = reinterpret_cast<S*>(&o);
#pragma unroll
        for (int j = 0; j < PER_CHUNK; ++j) oe[j] = T::store(T::load(we[j]) * rounded<T>(r[k * PER_CHUNK + j] * inv_rms));
        reinterpret_cast<uint4*>(out + row)[c] = o;
    }
}

// ----------------------------------------------------------------------------- RoPE + cache write
// One block per (token, head): blockIdx.y < num_heads a query head, then the key heads, then the value
// heads; thread d < head_size owns element d. Element d of a rotated head is x[d] * cos[d] + x[partner] *
// sin_signed[d], partner the same pair's other half (d +- head_size / 2); PyTorch rounds x * cos first (a
// multiply, then an addcmul).
template <typename T>
__device__ void rope_and_cache_row(typename T::storage* __restrict__ q_out, typename T::storage* __restrict__ key_cache,
                                   typename T::storage* __restrict__ value_cache,
                                   const typename T::storage* __restrict__ qkv,
                                   const typename T::storage* __restrict__ cos,
                                   const typename T::storage* __restrict__ sin_signed,
                                   const long long* __restrict__ positions, const long long* __restrict__ slot_mapping,
                                   int num_heads, int num_kv_heads, int head_size, int num_positions, int num_slots) {
    const int token = blockIdx.x, head = blockIdx.y, d = threadIdx.x, half = head_size / 2;
    if (d >= head_size) return;
    const int kv_size = num_kv_heads * head_size;
    const typename T::storage* x = qkv + ((long long)token * (num_heads + 2 * num_kv_heads) + head) * head_size;
    const long long slot = slot_mapping[token];
    const bool write = slot >= 0 && slot < num_slots;  // -1: a padding row
    if (head >= num_heads + num_kv_heads) {  // a value head: copied as it is
        if (write) value_cache[slot * kv_size + (head - num_heads - num_kv_heads) * head_size + d] = x[d];
        return;
    }
    const long long pos = positions[token];
    float value = NAN;  // a position outside the table: NaN, the table is never read out of range
    if (pos >= 0 && pos < num_positions) {
        const int partner = d < half ? d + half : d - half;
        const float x_cos = rounded<T>(T::load(x[d]) * T::load(cos[pos * head_size + d]));
        value = fmaf(T::load(x[partner]), T::load(sin_signed[pos * head_size + d]), x_cos);
    }
    if (head < num_heads)
        q_out[((long long)token * num_heads + head) * head_size + d] = T::store(value);
    else if (write)
        key_cache[slot * kv_size + (head - num_heads) * head_size + d] = T::store(value);
}

// ----------------------------------------------------------------------------- SiLU * up
// One thread per output element: grid (tokens, ceil(inner / THREADS)).
template <typename T>
__device__ void silu_and_mul_row(typename T::storage* __restrict__ out,
                                 const typename T::storage* __restrict__ gate_up, int inner) {
    const long long token = blockIdx.x;
    const int i = blockIdx.y * THREADS + threadIdx.x;
    if (i >= inner) return;
    const float g = T::load(gate_up[token * 2 * inner + i]), up = T::load(gate_up[token * 2 * inner + inner + i]);
    out[token * inner + i] = T::store(rounded<T>(g / (1.0f + expf(-g))) * up);
}

// ----------------------------------------------------------------------------- entry points
// One per op and element type: <op> (float32), <op>_f16, <op>_bf16 (16-bit elements as raw bits). They are
// written out, not generated by a macro: the emulator reads each entry point's parameters from the text.

extern "C" __global__ void __launch_bounds__(THREADS) add_rms_norm(
    float* out, float* residual, const float* x, const float* weight, int hidden, float eps) {
    add_rms_norm_row<Float32>(out, residual, x, weight, hidden, eps);
}
extern "C" __global__ void __launch_bounds__(THREADS) rope_and_cache(
    float* q_out, float* key_cache, float* value_cache, const float* qkv, const float* cos,
    const float* sin_signed, const long long* positions, const long long* slot_mapping, int num_heads,
    int num_kv_heads, int head_size, int num_positions, int num_slots) {
    rope_and_cache_row<Float32>(q_out, key_cache, value_cache, qkv, cos, sin_signed, positions, slot_mapping, num_heads,
                      num_kv_heads, head_size, num_positions, num_slots);
}
extern "C" __global__ void __launch_bounds__(THREADS) silu_and_mul(float* out, const float* gate_up, int inner) {
    silu_and_mul_row<Float32>(out, gate_up, inner);
}

extern "C" __global__ void __launch_bounds__(THREADS) add_rms_norm_f16(
    unsigned short* out, unsigned short* residual, const unsigned short* x, const unsigned short* weight, int hidden, float eps) {
    add_rms_norm_row<Float16>(out, residual, x, weight, hidden, eps);
}
extern "C" __global__ void __launch_bounds__(THREADS) rope_and_cache_f16(
    unsigned short* q_out, unsigned short* key_cache, unsigned short* value_cache, const unsigned short* qkv, const unsigned short* cos,
    const unsigned short* sin_signed, const long long* positions, const long long* slot_mapping, int num_heads,
    int num_kv_heads, int head_size, int num_positions, int num_slots) {
    rope_and_cache_row<Float16>(q_out, key_cache, value_cache, qkv, cos, sin_signed, positions, slot_mapping, num_heads,
                      num_kv_heads, head_size, num_positions, num_slots);
}
extern "C" __global__ void __launch_bounds__(THREADS) silu_and_mul_f16(unsigned short* out, const unsigned short* gate_up, int inner) {
    silu_and_mul_row<Float16>(out, gate_up, inner);
}

extern "C" __global__ void __launch_bounds__(THREADS) add_rms_norm_bf16(
    unsigned short* out, unsigned short* residual, const unsigned short* x, const unsigned short* weight, int hidden, float eps) {
    add_rms_norm_row<BFloat16>(out, residual, x, weight, hidden, eps);
}
extern "C" __global__ void __launch_bounds__(THREADS) rope_and_cache_bf16(
    unsigned short* q_out, unsigned short* key_cache, unsigned short* value_cache, const unsigned short* qkv, const unsigned short* cos,
    const unsigned short* sin_signed, const long long* positions, const long long* slot_mapping, int num_heads,
    int num_kv_heads, int head_size, int num_positions, int num_slots) {
    rope_and_cache_row<BFloat16>(q_out, key_cache, value_cache, qkv, cos, sin_signed, positions, slot_mapping, num_heads,
                      num_kv_heads, head_size, num_positions, num_slots);
}
extern "C" __global__ void __launch_bounds__(THREADS) silu_and_mul_bf16(unsigned short* out, const unsigned short* gate_up, int inner) {
    silu_and_mul_row<BFloat16>(out, gate_up, inner);
}
