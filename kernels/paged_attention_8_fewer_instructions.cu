// paged_attention_8_fewer_instructions.cu -- decode attention through the page table, fewer instructions per token.
//
// What it computes is what every paged_attention_<n>_*.cu computes (see paged_attention_5_half_warps.cu):
//     out[s][h] = softmax(scale * q[s][h] . k_t over t < seq_lens[s]) @ v_t,
//     k_t, v_t = key_cache/value_cache[block_tables[s][t / block_size]][t % block_size][h / group]
// with one thread block per KV head serving its GQA group (version 6) and split contexts merged by
// log-sum-exp (version 7), as version 7 does.
// What it adds to version 7 (paged_attention_7_split_context.cu): fewer instructions per token.
//   * a group's TOKENS partial dot products are summed by a "transposed" butterfly (each shuffle step
//     halves the number of values a lane carries, so TOKENS tokens cost TOKENS - 1 + log2(GROUP / TOKENS)
//     shuffles instead of TOKENS * log2(GROUP)), after which each lane holds ONE token's score: one exp2
//     per lane per step instead of one per token;
//   * the scale and log2(e) folded into q once: scores come out in the log2 domain, every exponential
//     is one exp2;
//   * the page looked up once per step, shifts instead of divisions for power-of-two block sizes, and
//     read through page_at(), a call the compiler may not inline: written inline, the same load made
//     the whole kernel ~1.4x slower on an H200 (benchmarks/RESULTS.md, "7 -> 8" of 2026-12-03: the
//     compiler schedules the step's row loads differently around it: the SASS has the same loads in the
//     same order either way, so the difference is in the stall bits or at run time);
//   * K and V kept as raw 16-bit words until used;
//   * 128 threads per block with __launch_bounds__;
//   * the output written in the input's dtype (no extra float32 buffer and cast kernel).
//
// Like version 5 it trusts its inputs: the host validates seq_lens and every page id before the launch
// (vllmini.attention), and a block table entry is read and dereferenced as it is (checking them in the
// kernel is version 9's one idea). The one thing this kernel still makes safe, for one min and one max,
// is the length: seq_lens[s] is clamped into 0 .. max_num_blocks_per_seq * block_size, so no read leaves
// the sequence's table row, and a length of 0 or less gives an output row of zeros.
//
// Shapes (contiguous): out [num_seqs, num_heads, head_size] in the input dtype (float32 or 16-bit bits);
// part_out float32 [num_seqs, num_heads, num_splits, head_size] and part_ml float32 [..., num_splits, 2]
// (only read and written when num_splits > 1; may be null otherwise); query [num_seqs, num_heads,
// head_size]; key_cache/value_cache [num_blocks, block_size, num_kv_heads, head_size]; block_tables
// int32 [num_seqs, max_num_blocks_per_seq]; seq_lens int32 [num_seqs].
//
// Launch (vllmini/cuda_kernels.py): grid = (num_seqs, num_heads / heads_per_block, num_splits),
// block = 128 threads (4 warps), dynamic shared memory = (128 / GROUP) * HBMAX * (head_size + 2) * 4
// bytes, GROUP = 32 lanes per token row for float32 and 16 for 16-bit types, HBMAX = 1 when
// heads_per_block is 1, else 4 (2 for 16-bit head sizes above 128). heads_per_block divides
// num_heads / num_kv_heads. Then, when num_splits > 1, the merge kernel with grid (num_seqs, num_heads)
// and 128 threads.
//
// Lane layout (as version 5): a group of GROUP lanes holds one token row, lane l owning the DIMS
// consecutive dims l*DIMS ..; a warp holds 32 / GROUP rows; each group takes TOKENS consecutive tokens
// per step and loads all their K and V rows before it uses any.
//
// Limits: head_size <= 256, any block size (powers of two take the shift path), blockDim.x = 128.

#define WARP_SIZE 32
#define MAX_HEAD_SIZE 256
#define NUM_THREADS 128
#define LOG2E 1.4426950408889634f
// A GPU build may compile one head-size copy only (-DVLLMINI_ONLY_CHUNKS=ceil(head_size / 32), and
// -DVLLMINI_ONLY_GQA=0 or 1): a kernel's register count is the largest any of its copies needs, so the
// launcher compiles one module per (head-size chunks, GQA or not). 0 / -1 (the default): every copy.
#ifndef VLLMINI_ONLY_CHUNKS
#define VLLMINI_ONLY_CHUNKS 0
#endif
#ifndef VLLMINI_ONLY_GQA
#define VLLMINI_ONLY_GQA -1
#endif
#ifndef INFINITY  // NVRTC has no <math.h>; the bit patterns will do
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#endif

// ----------------------------------------------------------------------------- element types
// Each type says how a 32-bit word of stored bits becomes one (float32) or two (16-bit) floats, and how
// a float is rounded back for the output.
struct Float32 {
    typedef float storage;
    static constexpr int PER_WORD = 1;
    static __device__ __forceinline__ float lo(unsigned int w) { return __uint_as_float(w); }
    static __device__ __forceinline__ float hi(unsigned int w) { return __uint_as_float(w); }
    static __device__ __forceinline__ float elem(storage x) { return x; }
    static __device__ __forceinline__ unsigned int bits(storage x) { return __float_as_uint(x); }
    static __device__ __forceinline__ storage from_float(float x) { return x; }
};
struct Float16 {
    typedef unsigned short storage;
    static constexpr int PER_WORD = 2;
    static __device__ __forceinline__ float elem(unsigned short h) {
#ifndef __VLLMINI_EMULATOR__
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
#else
        return __emu::half_bits_to_float(h);
#endif
    }
    static __device__ __forceinline__ float lo(unsigned int w) {
#ifndef __VLLMINI_EMULATOR__
        float f;
        asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.f32.f16 %0, l;}" : "=f"(f) : "r"(w));
        return f;
#else
        return elem((unsigned short)(w & 0xffffu));
#endif
    }
    static __device__ __forceinline__ float hi(unsigned int w) {
#ifndef __VLLMINI_EMULATOR__
        float f;
        asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.f32.f16 %0, h;}" : "=f"(f) : "r"(w));
        return f;
#else
        return elem((unsigned short)(w >> 16));
#endif
    }
    static __device__ __forceinline__ unsigned int bits(unsigned short x) { return x; }
    static __device__ __forceinline__ unsigned short from_float(float x) {
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
    static constexpr int PER_WORD = 2;
    static __device__ __forceinline__ float elem(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }
    static __device__ __forceinline__ float lo(unsigned int w) { return __uint_as_float(w << 16); }
    static __device__ __forceinline__ float hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }
    static __device__ __forceinline__ unsigned int bits(unsigned short x) { return x; }
    static __device__ __forceinline__ unsigned short from_float(float x) {  // round to nearest even
        const unsigned int u = __float_as_uint(x);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // quiet NaN
        return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
};

// Element i (a compile-time index after unrolling) of a lane's row slice held as raw words.
template <typename Dtype, int W>
__device__ __forceinline__ float element(const unsigned int (&w)[W], int i) {
    if constexpr (Dtype::PER_WORD == 1) return Dtype::lo(w[i]);
    else return (i & 1) ? Dtype::hi(w[i >> 1]) : Dtype::lo(w[i >> 1]);
}

// This lane's DIMS elements of a row, as raw 32-bit words: whole 16-byte (8-, 4-byte) loads when the
// group covers the row exactly (the host checks 16-byte alignment), else element by element with zeros
// past head_size.
template <typename Dtype, int DIMS, int GROUP>
__device__ __forceinline__ void load_words(const typename Dtype::storage* __restrict__ row, int lane, int head_size,
                                           unsigned int (&w)[DIMS / Dtype::PER_WORD]) {
    typedef typename Dtype::storage T;
    constexpr int W = DIMS / Dtype::PER_WORD;
    const int d0 = lane * DIMS;
    if (head_size == DIMS * GROUP) {
        const T* p = row + d0;
        if constexpr (W % 4 == 0) {
#pragma unroll
            for (int c = 0; c < W / 4; c++) {
                const uint4 b = reinterpret_cast<const uint4*>(p)[c];
                w[4 * c] = b.x, w[4 * c + 1] = b.y, w[4 * c + 2] = b.z, w[4 * c + 3] = b.w;
            }
        } else if constexpr (W % 2 == 0) {
#pragma unroll
            for (int c = 0; c < W / 2; c++) {
                const uint2 b = reinterpret_cast<const uint2*>(p)[c];
                w[2 * c] = b.x, w[2 * c + 1] = b.y;
            }
        } else {
#pragma unroll
            for (int c = 0; c < W; c++) w[c] = reinterpret_cast<const unsigned int*>(p)[c];
        }
    } else {
#pragma unroll
        for (int c = 0; c < W; c++) {
            unsigned int word = 0;
#pragma unroll
            for (int j = 0; j < Dtype::PER_WORD; j++) {
                const int d = d0 + c * Dtype::PER_WORD + j;
                if (d < head_size) word |= Dtype::bits(row[d]) << (16 * j);
            }
            w[c] = word;
        }
    }
}

// block_tables[seq][idx]. __noinline__ on purpose (see the header): a call, not an inlined load.
__device__ __noinline__ int page_at(const int* __restrict__ table, int idx) { return table[idx]; }

// ----------------------------------------------------------------------------- one (sequence, head block, split)

extern __shared__ float smem[];

// The launch's arguments (shapes in the header), as the extern "C" entry points at the end receive them;
// attend, dispatch and entry take them (VLLMINI_PARAMS, T = the element's storage type) and pass them
// on (VLLMINI_ARGS) in this one order.
#define VLLMINI_PARAMS(T)                                                                                     \
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml, const T* __restrict__ query,  \
        const T* __restrict__ key_cache, const T* __restrict__ value_cache, const int* __restrict__ block_tables, \
        const int* __restrict__ seq_lens, const int block_size,                                                 \
        const int num_heads, const int head_size, const int num_kv_heads, const int max_num_blocks_per_seq,     \
        const int heads_per_block, const int pages_per_split, const float scale
#define VLLMINI_ARGS                                                                                          \
    out, part_out, part_ml, query, key_cache, value_cache, block_tables, seq_lens, block_size,                    \
        num_heads, head_size, num_kv_heads, max_num_blocks_per_seq, heads_per_block, pages_per_split, scale

template <typename Dtype, int DIMS, int TOKENS, int GROUP, int HBMAX>
__device__ void attend(VLLMINI_PARAMS(typename Dtype::storage)) {
    typedef typename Dtype::storage T;
    constexpr int W = DIMS / Dtype::PER_WORD;      // raw words per lane per row
    constexpr int ROWS = WARP_SIZE / GROUP;         // token rows a warp holds at once
    constexpr int WARP_STEP = ROWS * TOKENS;        // tokens a warp takes per step
    constexpr int LOG2_TOKENS = TOKENS >= 16 ? 4 : TOKENS >= 8 ? 3 : TOKENS >= 4 ? 2 : TOKENS >= 2 ? 1 : 0;
    static_assert((1 << LOG2_TOKENS) == TOKENS && TOKENS <= GROUP, "TOKENS: a power of two, at most GROUP");
    const int seq = blockIdx.x;
    const int head0 = blockIdx.y * heads_per_block;  // first query head of this block
    const int split = blockIdx.z;
    const int num_splits = gridDim.z;
    const int kv_head = head0 / (num_heads / num_kv_heads);
    const int group = threadIdx.x / GROUP;
    const int lane = threadIdx.x % GROUP;
    const int warp = threadIdx.x / WARP_SIZE;
    constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
    constexpr int NUM_GROUPS = NUM_THREADS / GROUP;
    const int group_base = (threadIdx.x % WARP_SIZE) - lane;  // this group's first lane in the warp

    // The sequence's length (checked by the host), clamped so that no read leaves the table row: 0 reads
    // nothing and gives a row of zeros.
    const int seq_len = min(max(seq_lens[seq], 0), max_num_blocks_per_seq * block_size);
    const int split_len = pages_per_split * block_size;
    const int t_begin = split * split_len;
    const int t_end = min(seq_len, t_begin + split_len);

    // This lane's slice of the block's queries, pre-multiplied by scale * log2(e): scores come out in
    // the log2 domain and every exponential is one exp2.
    float q[HBMAX][DIMS];
#pragma unroll
    for (int h = 0; h < HBMAX; h++) {
        unsigned int w[W];
        if (h < heads_per_block) {
            load_words<Dtype, DIMS, GROUP>(query + ((long long)seq * num_heads + head0 + h) * head_size, lane,
                                           head_size, w);
        } else {
#pragma unroll
            for (int c = 0; c < W; c++) w[c] = 0;
        }
#pragma unroll
        for (int i = 0; i < DIMS; i++) q[h][i] = element<Dtype>(w, i) * (scale * LOG2E);
    }
    float acc[HBMAX][DIMS];
    float m[HBMAX], l[HBMAX];  // running max (log2 domain) and this lane's share of the running sum
#pragma unroll
    for (int h = 0; h < HBMAX; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < DIMS; i++) acc[h][i] = 0.0f;
    }

    const int* table = block_tables + (long long)seq * max_num_blocks_per_seq;
    const long long token_stride = (long long)num_kv_heads * head_size;
    const long long page_stride = (long long)block_size * token_stride;
    const T* k_base = key_cache + (long long)kv_head * head_size;
    const T* v_base = value_cache + (long long)kv_head * head_size;
    const int shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;

    // After the transposed butterfly, lane `lane` of a group holds the score of token `my_token` of the
    // group's TOKENS; token u is held by lane `token_lane(u)` (and by the lanes that differ from it only
    // in the bits below GROUP / TOKENS).
    int my_token = 0;
#pragma unroll
    for (int s = 0; s < LOG2_TOKENS; s++) my_token += ((lane & (GROUP >> (s + 1))) ? 1 : 0) * (TOKENS >> (s + 1));

    for (int chunk = t_begin + warp * WARP_STEP; chunk < t_end; chunk += NUM_WARPS * WARP_STEP) {
        const int start = chunk + (group % ROWS) * TOKENS;  // this group's first token
        // 1) The page(s) of the step, looked up once when the step's tokens share a page.
        const int t_first = min(start, t_end - 1);
        const int t_last = min(start + TOKENS - 1, t_end - 1);
        const int i_first = shift >= 0 ? t_first >> shift : t_first / block_size;
        const int i_last = shift >= 0 ? t_last >> shift : t_last / block_size;
        const int page_first = page_at(table, i_first);
        // 2) Every K and V row of the step, loaded before any is used (past the end: the last real token
        //    again, scored -inf below).
        unsigned int k[TOKENS][W], v[TOKENS][W];
#pragma unroll
        for (int u = 0; u < TOKENS; u++) {
            const int t = min(start + u, t_end - 1);
            int idx, slot;
            if (shift >= 0) {
                idx = t >> shift;
                slot = t & (block_size - 1);
            } else {
                idx = t / block_size;
                slot = t - idx * block_size;
            }
            const int page = (i_first == i_last || idx == i_first) ? page_first : page_at(table, idx);
            const long long offset = page * page_stride + slot * token_stride;
            load_words<Dtype, DIMS, GROUP>(k_base + offset, lane, head_size, k[u]);
            load_words<Dtype, DIMS, GROUP>(v_base + offset, lane, head_size, v[u]);
        }
        // 3) Partial dot products of every head with every token; each K element widened once.
        float part[HBMAX][TOKENS];
#pragma unroll
        for (int u = 0; u < TOKENS; u++) {
#pragma unroll
            for (int h = 0; h < HBMAX; h++) part[h][u] = 0.0f;
#pragma unroll
            for (int i = 0; i < DIMS; i++) {
                const float kx = element<Dtype>(k[u], i);
#pragma unroll
                for (int h = 0; h < HBMAX; h++) part[h][u] += q[h][i] * kx;
            }
        }
        // 4) The transposed butterfly: at each step a lane keeps half its values, sends the other half
        //    to its partner, and adds what it gets; then plain butterflies over the remaining lanes.
        float score[HBMAX];
#pragma unroll
        for (int h = 0; h < HBMAX; h++) {
#pragma unroll
            for (int s = 0; s < LOG2_TOKENS; s++) {
                const int offset = GROUP >> (s + 1);
                const int half = TOKENS >> (s + 1);
                const bool upper = (lane & offset) != 0;
#pragma unroll
                for (int j = 0; j < half; j++) {
                    const float keep = upper ? part[h][j + half] : part[h][j];
                    const float send = upper ? part[h][j] : part[h][j + half];
                    part[h][j] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
                }
            }
            float total = part[h][0];
#pragma unroll
            for (int offset = GROUP / (2 * TOKENS); offset > 0; offset /= 2)
                total += __shfl_xor_sync(0xffffffffu, total, offset);
            score[h] = start + my_token < t_end ? total : -INFINITY;
        }
        // 5) Online softmax in the log2 domain: the step's max over the group's distinct tokens, one exp2
        //    per lane, then each lane fetches the TOKENS weights and adds its dims of p_u * v_u.
        float p[HBMAX], correction[HBMAX];
#pragma unroll
        for (int h = 0; h < HBMAX; h++) {
            float step_max = score[h];
#pragma unroll
            for (int s = 0; s < LOG2_TOKENS; s++)
                step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, GROUP >> (s + 1)));
            const float m_new = fmaxf(m[h], step_max);
            const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // no -inf - -inf
            correction[h] = exp2f(m[h] - m_use);
            p[h] = exp2f(score[h] - m_use);  // 0 for tokens past the end
            l[h] = l[h] * correction[h] + p[h];
            m[h] = m_new;
        }
#pragma unroll
        for (int h = 0; h < HBMAX; h++) {
#pragma unroll
            for (int i = 0; i < DIMS; i++) acc[h][i] *= correction[h];
        }
#pragma unroll
        for (int u = 0; u < TOKENS; u++) {
            int src = group_base;
#pragma unroll
            for (int s = 0; s < LOG2_TOKENS; s++) src += ((u >> (LOG2_TOKENS - 1 - s)) & 1) * (GROUP >> (s + 1));
            float pu[HBMAX];
#pragma unroll
            for (int h = 0; h < HBMAX; h++) pu[h] = __shfl_sync(0xffffffffu, p[h], src);
            if (start + u >= t_end) continue;  // a re-read copy: p = 0, but 0 * inf would be NaN
#pragma unroll
            for (int i = 0; i < DIMS; i++) {
                const float vx = element<Dtype>(v[u], i);
#pragma unroll
                for (int h = 0; h < HBMAX; h++) acc[h][i] += pu[h] * vx;
            }
        }
    }

    // 6) Each group's sum: its lanes' shares over the distinct-token lanes (the other lanes are copies).
#pragma unroll
    for (int h = 0; h < HBMAX; h++) {
#pragma unroll
        for (int s = 0; s < LOG2_TOKENS; s++) l[h] += __shfl_xor_sync(0xffffffffu, l[h], GROUP >> (s + 1));
    }

    // 7) Merge the groups through shared memory: [NUM_GROUPS][HBMAX] maxes and sums, then
    //    [NUM_GROUPS][HBMAX][head_size] partial outputs.
    float* group_m = smem;
    float* group_l = smem + NUM_GROUPS * HBMAX;
    float* group_acc = smem + 2 * NUM_GROUPS * HBMAX;
#pragma unroll
    for (int h = 0; h < HBMAX; h++) {
        if (lane == 0) {
            group_m[group * HBMAX + h] = m[h];
            group_l[group * HBMAX + h] = l[h];
        }
#pragma unroll
        for (int i = 0; i < DIMS; i++) {
            const int d = lane * DIMS + i;
            if (d < head_size) group_acc[(group * HBMAX + h) * head_size + d] = acc[h][i];
        }
    }
    __syncthreads();  // every group's partial result is in shared memory

    for (int e = threadIdx.x; e < heads_per_block * head_size; e += NUM_THREADS) {
        const int h = e / head_size, d = e - h * head_size;
        float mx = -INFINITY;
        for (int g = 0; g < NUM_GROUPS; g++) mx = fmaxf(mx, group_m[g * HBMAX + h]);
        const float m_use = mx == -INFINITY ? 0.0f : mx;
        float denom = 0.0f, numer = 0.0f;
        for (int g = 0; g < NUM_GROUPS; g++) {
            const float w = exp2f(group_m[g * HBMAX + h] - m_use);
            denom += w * group_l[g * HBMAX + h];
            numer += w * group_acc[(g * HBMAX + h) * head_size + d];
        }
        const long long row = (long long)seq * num_heads + head0 + h;  // (sequence, query head)
        if (num_splits == 1) {
            // no finite score at all (every one -inf): attend to nothing, 0, as the torch backend does
            out[row * head_size + d] = Dtype::from_float(denom == 0.0f ? 0.0f : numer / denom);
        } else {
            // an empty split (past the end of a shorter sequence) has denom 0: weight 0 in the merge
            part_out[(row * num_splits + split) * head_size + d] = denom > 0.0f ? numer / denom : 0.0f;
            if (d == 0) {
                part_ml[(row * num_splits + split) * 2] = mx;
                part_ml[(row * num_splits + split) * 2 + 1] = denom;
            }
        }
    }
}

// Pick the copy compiled for this head size. float32: groups of 32 lanes, DIMS = ceil(head_size / 32);
// 16-bit: groups of 16 lanes, DIMS = 2 * ceil(head_size / 32). TOKENS (a power of two) keeps about 32
// raw words of K (and as many of V) per lane in flight; a block serving a GQA group (HBMAX > 1) keeps
// fewer, for the registers its queries and accumulators take.
template <typename Dtype, bool GQA>
__device__ void dispatch(VLLMINI_PARAMS(typename Dtype::storage)) {
    if (head_size > MAX_HEAD_SIZE || head_size < 1) {  // refused by the host
        for (int e = threadIdx.x; e < heads_per_block * head_size; e += blockDim.x)
            out[((long long)blockIdx.x * num_heads + blockIdx.y * heads_per_block) * head_size + e] =
                Dtype::from_float(NAN);
        return;
    }
#define VLLMINI_IMPL(C, D, T, G, H)                                                                                \
    case C:                                                                                                       \
        if constexpr (VLLMINI_ONLY_CHUNKS == 0 || VLLMINI_ONLY_CHUNKS == C)                                       \
            attend<Dtype, D, T, G, H>(VLLMINI_ARGS);                                                           \
        break;
    if constexpr (sizeof(typename Dtype::storage) == 4) {
        switch ((head_size + WARP_SIZE - 1) / WARP_SIZE) {  // C: 32-dim chunks of the head
            VLLMINI_IMPL(1, 1, 16, 32, GQA ? 4 : 1)
            VLLMINI_IMPL(2, 2, 16, 32, GQA ? 4 : 1)
            VLLMINI_IMPL(3, 3, 8, 32, GQA ? 4 : 1)
            VLLMINI_IMPL(4, 4, GQA ? 4 : 8, 32, GQA ? 4 : 1)
            VLLMINI_IMPL(5, 5, 4, 32, GQA ? 4 : 1)
            VLLMINI_IMPL(6, 6, 4, 32, GQA ? 4 : 1)
            VLLMINI_IMPL(7, 7, GQA ? 2 : 4, 32, GQA ? 4 : 1)
            VLLMINI_IMPL(8, 8, GQA ? 2 : 4, 32, GQA ? 4 : 1)
        }
    } else {
        switch ((head_size + WARP_SIZE - 1) / WARP_SIZE) {  // DIMS = 2 * C: groups of 16 lanes
            VLLMINI_IMPL(1, 2, 16, 16, GQA ? 4 : 1)
            VLLMINI_IMPL(2, 4, 16, 16, GQA ? 4 : 1)
            VLLMINI_IMPL(3, 6, 8, 16, GQA ? 4 : 1)
            VLLMINI_IMPL(4, 8, GQA ? 4 : 8, 16, GQA ? 4 : 1)
            VLLMINI_IMPL(5, 10, 4, 16, GQA ? 2 : 1)
            VLLMINI_IMPL(6, 12, 4, 16, GQA ? 2 : 1)
            VLLMINI_IMPL(7, 14, GQA ? 2 : 4, 16, GQA ? 2 : 1)
            VLLMINI_IMPL(8, 16, GQA ? 2 : 4, 16, GQA ? 2 : 1)
        }
    }
#undef VLLMINI_IMPL
}

// ----------------------------------------------------------------------------- entry points
// One per element type; 16-bit values travel as their raw bits (unsigned short). heads_per_block 1
// takes the copy compiled for one head per block (fewer registers), larger values the GQA copy.
template <typename Dtype>
__device__ void entry(VLLMINI_PARAMS(typename Dtype::storage)) {
    if (heads_per_block == 1) {
        if constexpr (VLLMINI_ONLY_GQA != 1) dispatch<Dtype, false>(VLLMINI_ARGS);
    } else if constexpr (VLLMINI_ONLY_GQA != 0) {
        dispatch<Dtype, true>(VLLMINI_ARGS);
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_8_fewer_instructions(
    float* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml, const float* __restrict__ query,
    const float* __restrict__ key_cache, const float* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int block_size, const int num_heads,
    const int head_size, const int num_kv_heads, const int max_num_blocks_per_seq, const int heads_per_block,
    const int pages_per_split, const float scale) {
    entry<Float32>(VLLMINI_ARGS);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_8_fewer_instructions_f16(
    unsigned short* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml, const unsigned short* __restrict__ query,
    const unsigned short* __restrict__ key_cache, const unsigned short* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int block_size, const int num_heads,
    const int head_size, const int num_kv_heads, const int max_num_blocks_per_seq, const int heads_per_block,
    const int pages_per_split, const float scale) {
    entry<Float16>(VLLMINI_ARGS);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_8_fewer_instructions_bf16(
    unsigned short* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml, const unsigned short* __restrict__ query,
    const unsigned short* __restrict__ key_cache, const unsigned short* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int block_size, const int num_heads,
    const int head_size, const int num_kv_heads, const int max_num_blocks_per_seq, const int heads_per_block,
    const int pages_per_split, const float scale) {
    entry<BFloat16>(VLLMINI_ARGS);
}

// The merge of a split context (grid (num_seqs, num_heads), any block size): with M = max_s m_s and
// w_s = l_s * 2^(m_s - M), out = sum_s w_s * part_out_s / sum_s w_s. A NaN part makes the row NaN.
template <typename Dtype>
__device__ void merge(typename Dtype::storage* __restrict__ out, const float* __restrict__ part_out,
                      const float* __restrict__ part_ml, const int num_splits, const int head_size) {
    const long long row = (long long)blockIdx.x * gridDim.y + blockIdx.y;  // (sequence, head)
    const float* ml = part_ml + row * num_splits * 2;
    float mx = -INFINITY;
    for (int s = 0; s < num_splits; s++) mx = fmaxf(mx, ml[2 * s]);
    const float m_use = mx == -INFINITY ? 0.0f : mx;
    float denom = 0.0f;
    for (int s = 0; s < num_splits; s++) denom += ml[2 * s + 1] * exp2f(ml[2 * s] - m_use);
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
        float numer = 0.0f;
        for (int s = 0; s < num_splits; s++) {
            numer += ml[2 * s + 1] * exp2f(ml[2 * s] - m_use) * part_out[(row * num_splits + s) * head_size + d];
        }
        out[row * head_size + d] = Dtype::from_float(denom == 0.0f ? 0.0f : numer / denom);  // NaN stays NaN
    }
}

extern "C" __global__ void paged_attention_8_fewer_instructions_merge(float* __restrict__ out, const float* __restrict__ part_out,
                                  const float* __restrict__ part_ml, const int num_splits, const int head_size) {
    merge<Float32>(out, part_out, part_ml, num_splits, head_size);
}

extern "C" __global__ void paged_attention_8_fewer_instructions_merge_f16(unsigned short* __restrict__ out, const float* __restrict__ part_out,
                                  const float* __restrict__ part_ml, const int num_splits, const int head_size) {
    merge<Float16>(out, part_out, part_ml, num_splits, head_size);
}

extern "C" __global__ void paged_attention_8_fewer_instructions_merge_bf16(unsigned short* __restrict__ out, const float* __restrict__ part_out,
                                  const float* __restrict__ part_ml, const int num_splits, const int head_size) {
    merge<BFloat16>(out, part_out, part_ml, num_splits, head_size);
}
