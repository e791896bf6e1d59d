// paged_attention_7_split_context.cu -- decode attention that reads K and V through the page table.
//
// What it computes, for every sequence s and query head h (one new token per sequence):
//     kv = h / (num_heads / num_kv_heads)                      grouped-query / multi-query attention
//     for t in 0 .. seq_lens[s]-1:                              every token in the cache
//         page = block_tables[s][t / block_size]                logical block -> physical page
//         k_t  = key_cache  [page][t % block_size][kv]          (head_size,)
//         v_t  = value_cache[page][t % block_size][kv]
//     out[s][h] = softmax(scale * q . k_t over t) @ v_t         (head_size,)
// the same numbers as vllmini.paged_attention(backend="torch"), without gathering the pages first.
//
// Shapes (contiguous, row-major; query and caches float32, float16 or bfloat16, out always float32):
//     out, query      [num_seqs, num_heads, head_size]
//     key_cache,      [num_blocks, block_size, num_kv_heads, head_size]
//     value_cache
//     block_tables    int32 [num_seqs, max_num_blocks_per_seq]  (entries past a sequence's length unused)
//     seq_lens        int32 [num_seqs]
//     part_out        float32 [num_seqs, num_heads, num_splits, head_size]  (only with num_splits > 1;
//     part_ml         float32 [num_seqs, num_heads, num_splits, 2]           may be null otherwise)
//
// Entry points: paged_attention_7_split_context (float32), paged_attention_7_split_context_f16 and paged_attention_7_split_context_bf16 (the
// query and caches passed as their raw 16-bit patterns, unsigned short; widened to float in registers,
// so no cuda_fp16.h is needed and every architecture compiles them). The softmax and every sum are float32
// and out is float32; vllmini.cuda_kernels casts it to the query's dtype. One more entry point,
// paged_attention_7_split_context_merge (float32 in and out, for every input type), combines the pieces
// of a split context.
//
// Launch: grid = (num_seqs, num_heads / heads_per_block, num_splits), blockIdx.x = sequence, blockIdx.y =
// block of heads_per_block consecutive query heads that share one KV head, blockIdx.z = piece z of the
// context: tokens [z * pages_per_split * block_size, min(seq_len, (z + 1) * pages_per_split * block_size));
// one thread block per (sequence, KV head, piece) when heads_per_block = num_heads / num_kv_heads.
// heads_per_block divides num_heads / num_kv_heads and is at most 4 (2 for 16-bit head sizes above
// 128). block = NUM_WARPS * 32 threads (256 in vllmini). head_size is a run-time argument, but each
// entry point switches once on DIMS (and on heads_per_block == 1 or not) to a copy of the loop compiled
// for it, so the per-lane arrays live in registers and the loads can be vectorized. Dynamic shared
// memory = (blockDim.x / GROUP) * heads_per_block * (head_size + 2) * 4 bytes (the cross-group merge),
// as in version 6. With num_splits = 1 the block writes out itself (pages_per_split >=
// max_num_blocks_per_seq); with num_splits > 1 it writes its piece to part_out and part_ml, then the
// merge kernel runs with grid = (num_seqs, num_heads), block = 128 threads and no shared memory.
//
// How the block shares the work:
//   * scores: a token's row is split over a GROUP of lanes: the whole warp (GROUP = 32) for float32,
//     half a warp (GROUP = 16) for 16-bit types, whose rows are half as many bytes. Lane l of a group
//     owns the DIMS consecutive dims l*DIMS .. l*DIMS+DIMS-1 (DIMS = ceil(head_size / 32) for float32,
//     twice that for 16-bit), so one row is one coalesced read (one 16-byte load per lane for
//     head_size 128), and a butterfly of __shfl_xor_sync sums the group's partial dot products.
//     The tokens are dealt to the warps in chunks (warp w takes chunk w, w + NUM_WARPS, ...), each
//     group of the warp TOKENS consecutive tokens of it. A group issues the loads of all its TOKENS
//     K rows AND V rows of a step before it needs any of them, so many rows per warp are on their way
//     from memory at once (TOKENS * DIMS is about 32: 8 tokens per warp step for head_size 128).
//   * softmax: each group keeps an online softmax (running max m, running sum l, and its part of the
//     weighted sum of V rows in registers), so no array of scores is kept and any context length
//     works with a fixed amount of memory. K and V are each read once per (sequence, block of heads):
//     every K and V row a group loads is widened once and used by each of the block's query heads,
//     each with its own query slice, m, l and acc in registers.
//   * output: the groups write (m, l, acc) of each head to shared memory, and after one __syncthreads()
//     the threads split the (head, dimension) pairs to merge them:
//     out = sum_g e^(m_g - M) acc_g / sum_g e^(m_g - M) l_g.
//   * pieces (num_splits > 1): each block writes its piece's normalized output acc / l to part_out and
//     its (max, sum) = (M, sum_g e^(m_g - M) l_g) to part_ml; the merge kernel combines the pieces the
//     same way the block combined its groups: out = sum_s e^(m_s - M) l_s part_s / sum_s e^(m_s - M) l_s.
//
// Build: the file is plain CUDA C++ with no includes. vllmini.cuda_kernels compiles it with NVRTC
// through cupy.RawModule (GPU) or runs it on the CPU with vllmini.emulator.RawKernel; the CI test
// compiles it for sm_75, sm_80, sm_86, sm_89 and sm_90.
//
// Limits: head_size <= MAX_HEAD_SIZE (256; larger head sizes get NaN, and the host refuses them
// before launch); blockDim.x a multiple of 32 (up to 1024); any seq_len the block table can hold.
// The host (vllmini.attention) validates block ids and seq_lens before launch; the kernel trusts them.
// Page addresses are computed in 64-bit integers, so caches larger than 2^31 elements are fine.
// GQA: a KV head is read (num_heads / num_kv_heads) / heads_per_block times; once when one block
// serves its whole group.
//
// Version 6 (what it adds to paged_attention_5_half_warps.cu): one thread block per KV head. The
// heads_per_block query heads that share a KV head are served by one block, so each K and V row is
// loaded from memory and widened to float once per KV head, not once per query head (vLLM reads it
// once per query head; FlashDecoding and FlashInfer serve the whole group). The price: HBMAX copies of
// q, acc, m and l per lane, so the GQA copies take fewer TOKENS per step.
//
// Version 7 (what it adds to paged_attention_6_kv_head_blocks.cu): split contexts (FlashDecoding,
// vLLM's paged_attention_v2). A batch of a few long sequences gives versions 1-6 only num_seqs *
// num_kv_heads blocks, too few to fill the GPU; here the context is also cut into gridDim.z pieces of
// pages_per_split pages, one block each, and a second small kernel merges the pieces by log-sum-exp.
// A piece past the end of a shorter sequence is empty: max -inf, sum 0, output 0, weight 0 in the merge.

#define WARP_SIZE 32
#define MAX_HEAD_SIZE 256
#ifndef INFINITY  // NVRTC has no <math.h>; the bit patterns will do
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#endif

// The element types. Each says how its stored bits become floats: one element, or a whole lane's row
// slice (DIMS consecutive elements) with the widest loads its size allows.
struct Float32 {
    typedef float storage;
    static __device__ float to_float(float x) { return x; }
};
struct Float16 {  // IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa bits
    typedef unsigned short storage;
    static __device__ float to_float(unsigned short h) {
#ifndef __VLLMINI_EMULATOR__
        // On a GPU, one conversion instruction (cuda_fp16.h's __half2float does the same; NVRTC in CI
        // has no CUDA headers, so we name the instruction). The emulator takes the bit-level path below.
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
#else
        const unsigned int sign = (unsigned int)(h & 0x8000) << 16;
        const unsigned int rest = h & 0x7fff;  // exponent and mantissa
        if (rest >= 0x7c00) return __uint_as_float(sign | 0x7f800000 | (rest & 0x3ff) << 13);  // inf, NaN
        // Shift the bits into float position (exponent now biased by 127 - 112) and scale by 2^112:
        // exact for normal and subnormal halves alike.
        return __uint_as_float(sign | rest << 13) * 5.192296858534828e33f;
#endif
    }
};
struct BFloat16 {  // the top 16 bits of a float32
    typedef unsigned short storage;
    static __device__ float to_float(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }
};

// x[0..DIMS) = row[0..DIMS) as floats. Whole 16-byte (else 8-byte) loads where the slice is a multiple
// of that size (the host checks the pointers are 16-byte aligned); one element at a time otherwise.
template <typename Dtype, int DIMS>
__device__ __forceinline__ void load_slice(const typename Dtype::storage* __restrict__ row, float (&x)[DIMS]) {
    typedef typename Dtype::storage T;
    constexpr int BYTES = DIMS * (int)sizeof(T);
    if constexpr (BYTES % 16 == 0) {
        constexpr int PER = 16 / sizeof(T);  // elements per 16-byte load
#pragma unroll
        for (int c = 0; c < DIMS / PER; c++) {
            uint4 bits = reinterpret_cast<const uint4*>(row)[c];
            const T* e = reinterpret_cast<const T*>(&bits);
#pragma unroll
            for (int i = 0; i < PER; i++) x[c * PER + i] = Dtype::to_float(e[i]);
        }
    } else if constexpr (BYTES % 8 == 0) {
        constexpr int PER = 8 / sizeof(T);
#pragma unroll
        for (int c = 0; c < DIMS / PER; c++) {
            uint2 bits = reinterpret_cast<const uint2*>(row)[c];
            const T* e = reinterpret_cast<const T*>(&bits);
#pragma unroll
            for (int i = 0; i < PER; i++) x[c * PER + i] = Dtype::to_float(e[i]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < DIMS; i++) x[i] = Dtype::to_float(row[i]);
    }
}

// This lane's slice of a row: the fast load when the lane's group covers the row exactly, else element
// by element with a bounds check (head sizes that are not a multiple of the group, e.g. 80; zero past
// head_size). `lane` is the lane's index in its group of GROUP lanes.
template <typename Dtype, int DIMS, int GROUP>
__device__ __forceinline__ void load_lane(const typename Dtype::storage* __restrict__ row, int lane, int head_size,
                                          float (&x)[DIMS]) {
    const int d0 = lane * DIMS;
    if (head_size == DIMS * GROUP) {
        load_slice<Dtype, DIMS>(row + d0, x);
    } else {
#pragma unroll
        for (int i = 0; i < DIMS; i++) x[i] = d0 + i < head_size ? Dtype::to_float(row[d0 + i]) : 0.0f;
    }
}

// Sum of v over each aligned group of GROUP lanes (32: the whole warp; 16: each half); every lane of a
// group gets its group's total. All 32 lanes must call it.
template <int GROUP>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int offset = GROUP / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}

// Dynamic shared memory, (blockDim.x / GROUP) * heads_per_block * (head_size + 2) floats, sized by the
// launch's shared_mem.
extern __shared__ float smem[];

// One (sequence, KV head) pair: the heads_per_block query heads that share the KV head. A group of GROUP
// lanes holds one token's row (DIMS dims per lane): GROUP = 32 for float32, 16 for 16-bit types, whose
// rows are half as many bytes -- so a warp works on two tokens at once and every shuffle, exp and page
// lookup serves two tokens. Each group takes TOKENS consecutive tokens per step; the groups of the block
// share the sequence in chunks. Each K and V row is loaded and widened once and used by every head of
// the block (HBMAX: the most heads a copy serves; heads h >= heads_per_block are computed on a zero query
// and never written).
template <typename Dtype, int DIMS, int TOKENS, int GROUP, int HBMAX>
__device__ void paged_attention_7_split_context_impl(
    float* __restrict__ out,                                  // [num_seqs, num_heads, head_size]
    float* __restrict__ part_out,                             // [num_seqs, num_heads, num_splits, head_size]
    float* __restrict__ part_ml,                              // [num_seqs, num_heads, num_splits, 2]
    const typename Dtype::storage* __restrict__ query,        // [num_seqs, num_heads, head_size]
    const typename Dtype::storage* __restrict__ key_cache,    // [num_blocks, block_size, kv_heads, head_size]
    const typename Dtype::storage* __restrict__ value_cache,  // [num_blocks, block_size, kv_heads, head_size]
    const int* __restrict__ block_tables,                     // [num_seqs, max_num_blocks_per_seq]
    const int* __restrict__ seq_lens,                         // [num_seqs]
    const int block_size,
    const int num_heads,
    const int head_size,
    const int num_kv_heads,
    const int max_num_blocks_per_seq,
    const int heads_per_block,
    const int pages_per_split,
    const float scale) {
    constexpr int GROUPS_PER_WARP = WARP_SIZE / GROUP;
    const int seq = blockIdx.x;
    const int head0 = blockIdx.y * heads_per_block;  // this block's first query head
    const int split = blockIdx.z;                     // this block's piece of the context
    const int num_splits = gridDim.z;
    const int kv_head = head0 / (num_heads / num_kv_heads);
    const int group = threadIdx.x / GROUP;  // this lane's group in the block
    const int lane = threadIdx.x % GROUP;   // this lane's place in its group
    const int num_groups = blockDim.x / GROUP;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    const int seq_len = seq_lens[seq];
    const int t_begin = split * pages_per_split * block_size;                 // this piece's tokens:
    const int t_end = min(seq_len, t_begin + pages_per_split * block_size);  // t_begin .. t_end-1
    float* out_rows = out + ((long long)seq * num_heads + head0) * head_size;  // (heads_per_block, head_size)

    // This lane's slice of each head's query (zero past head_size, and for heads past heads_per_block).
    float q[HBMAX][DIMS];
#pragma unroll
    for (int h = 0; h < HBMAX; h++) {
        if (h < heads_per_block) {
            load_lane<Dtype, DIMS, GROUP>(query + ((long long)seq * num_heads + head0 + h) * head_size, lane, head_size,
                                          q[h]);
        } else {
#pragma unroll
            for (int i = 0; i < DIMS; i++) q[h][i] = 0.0f;
        }
    }
    float acc[HBMAX][DIMS];  // this group's sum of p_t * v_t per head, for this lane's dims
    float m[HBMAX];          // running max of this group's scores, per head
    float l[HBMAX];          // running sum of exp(score - m), per head
#pragma unroll
    for (int h = 0; h < HBMAX; h++) {
#pragma unroll
        for (int i = 0; i < DIMS; i++) acc[h][i] = 0.0f;
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }

    const int* table = block_tables + (long long)seq * max_num_blocks_per_seq;  // (max_num_blocks_per_seq,)
    const long long token_stride = (long long)num_kv_heads * head_size;         // next slot in a page
    const long long page_stride = (long long)block_size * token_stride;         // next page

    // The loop bound is the same for every lane of a warp (the shuffles need all 32): a warp takes a chunk
    // of GROUPS_PER_WARP * TOKENS consecutive tokens per step, and its group g the g-th TOKENS of them.
    constexpr int WARP_STEP = GROUPS_PER_WARP * TOKENS;
    for (int chunk = t_begin + warp * WARP_STEP; chunk < t_end; chunk += num_warps * WARP_STEP) {
        const int start = chunk + (group % GROUPS_PER_WARP) * TOKENS;  // this group's first token
        // 1) Load the K and V rows of TOKENS consecutive tokens, all before using any. Past the end of
        //    the piece a group re-reads its last real token instead of branching (slots past seq_len
        //    may hold NaN and are never read); those copies get score -inf and are skipped below.
        float k[TOKENS][DIMS], v[TOKENS][DIMS];
#pragma unroll
        for (int u = 0; u < TOKENS; u++) {
            const int t = min(start + u, t_end - 1);
            const long long page = table[t / block_size];  // the page table lookup
            const long long offset = page * page_stride + (t % block_size) * token_stride + (long long)kv_head * head_size;
            load_lane<Dtype, DIMS, GROUP>(key_cache + offset, lane, head_size, k[u]);
            load_lane<Dtype, DIMS, GROUP>(value_cache + offset, lane, head_size, v[u]);
        }
#pragma unroll
        for (int h = 0; h < HBMAX; h++) {  // every head of the block uses the same K and V rows
            // 2) Scores: each lane's partial dot product, then the group sums each token's partials.
            float score[TOKENS];
#pragma unroll
            for (int u = 0; u < TOKENS; u++) {
                float partial = 0.0f;
#pragma unroll
                for (int i = 0; i < DIMS; i++) partial += q[h][i] * k[u][i];
                const float total = group_sum<GROUP>(partial);  // every lane of the warp takes part
                score[u] = start + u < t_end ? total * scale : -INFINITY;
            }
            // 3) Online softmax: raise the running max, rescale what we have, add the new tokens. A group
            //    whose tokens all lie past the end (possible at the tail when a warp holds two groups) has
            //    m_new = -inf and changes nothing.
            float m_new = m[h];
#pragma unroll
            for (int u = 0; u < TOKENS; u++) m_new = fmaxf(m_new, score[u]);
            if (m_new == -INFINITY) continue;
            const float correction = expf(m[h] - m_new);  // 0 on the group's first real step (m = -inf)
            l[h] *= correction;
#pragma unroll
            for (int i = 0; i < DIMS; i++) acc[h][i] *= correction;
#pragma unroll
            for (int u = 0; u < TOKENS; u++) {
                if (start + u >= t_end) break;  // a re-read copy: 0 * inf would be NaN, so skip, not weigh 0
                const float p = expf(score[u] - m_new);
                l[h] += p;
#pragma unroll
                for (int i = 0; i < DIMS; i++) acc[h][i] += p * v[u][i];
            }
            m[h] = m_new;
        }
    }

    // 4) Cross-group merge through shared memory (smem, sized by the launch for heads_per_block heads):
    //    [num_groups, heads_per_block] maxes, [num_groups, heads_per_block] sums,
    //    [num_groups, heads_per_block, head_size] partial outputs.
    float* group_max = smem;                                     // (num_groups, heads_per_block)
    float* group_l = smem + num_groups * heads_per_block;        // (num_groups, heads_per_block)
    float* group_acc = smem + 2 * num_groups * heads_per_block;  // (num_groups, heads_per_block, head_size)
#pragma unroll
    for (int h = 0; h < HBMAX; h++) {
        if (h >= heads_per_block) break;
        if (lane == 0) {
            group_max[group * heads_per_block + h] = m[h];  // -inf (and l = 0, acc = 0) for a group that got no tokens
            group_l[group * heads_per_block + h] = l[h];
        }
#pragma unroll
        for (int i = 0; i < DIMS; i++) {
            const int d = lane * DIMS + i;
            if (d < head_size) group_acc[(group * heads_per_block + h) * head_size + d] = acc[h][i];
        }
    }
    __syncthreads();  // every group's partial result is in shared memory

    for (int e = threadIdx.x; e < heads_per_block * head_size; e += blockDim.x) {
        const int h = e / head_size, d = e % head_size;
        float global_max = -INFINITY;
        for (int g = 0; g < num_groups; g++) global_max = fmaxf(global_max, group_max[g * heads_per_block + h]);
        const float m_ref = global_max == -INFINITY ? 0.0f : global_max;  // an empty piece: no -inf - -inf
        float denom = 0.0f;
        for (int g = 0; g < num_groups; g++)
            denom += expf(group_max[g * heads_per_block + h] - m_ref) * group_l[g * heads_per_block + h];
        float numer = 0.0f;
        for (int g = 0; g < num_groups; g++)
            numer += expf(group_max[g * heads_per_block + h] - m_ref) *
                     group_acc[(g * heads_per_block + h) * head_size + d];
        if (num_splits == 1) {
            out_rows[h * head_size + d] = numer / denom;
        } else {  // this piece's normalized output and (max, sum); an empty piece has denom 0: output 0
            const long long piece = ((long long)seq * num_heads + head0 + h) * num_splits + split;
            part_out[piece * head_size + d] = denom > 0.0f ? numer / denom : 0.0f;
            if (d == 0) {
                part_ml[piece * 2] = global_max;
                part_ml[piece * 2 + 1] = denom;
            }
        }
    }
}

// Pick the copy of the loop compiled for this head size and head count. float32: groups of 32 lanes,
// DIMS = ceil(head_size / 32) dims per lane, TOKENS tokens per step, about 32 / DIMS and at most 16
// (every copy keeps about as many values in registers). 16-bit types: groups of 16 lanes, so DIMS =
// 2 * ceil(head_size / 32) (one 16-byte load per lane for head_size 128), TOKENS about 32 / DIMS.
// heads_per_block 1 takes a copy with HBMAX = 1; larger values a copy serving up to HBMAX = 4 heads
// (2 for 16-bit head sizes above 128), with fewer TOKENS (TH) for the registers its queries and
// accumulators take.
template <typename Dtype>
__device__ void paged_attention_7_split_context_dispatch(
    float* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml,
    const typename Dtype::storage* __restrict__ q,
    const typename Dtype::storage* __restrict__ k_cache, const typename Dtype::storage* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, const int block_size,
    const int num_heads, const int head_size, const int num_kv_heads, const int max_num_blocks_per_seq,
    const int heads_per_block, const int pages_per_split, const float scale) {
    const int seq_len = seq_lens[blockIdx.x];
    const int hb_max = sizeof(typename Dtype::storage) == 2 && head_size > 4 * WARP_SIZE ? 2 : 4;
    if (head_size > MAX_HEAD_SIZE || head_size < 1 || seq_len <= 0 ||
        heads_per_block < 1 || heads_per_block > hb_max) {  // refused by the host
        const long long row0 = (long long)blockIdx.x * num_heads + blockIdx.y * heads_per_block;
        for (int e = threadIdx.x; e < heads_per_block * head_size; e += blockDim.x) {
            if (gridDim.z == 1) {
                out[row0 * head_size + e] = NAN;
            } else {  // NaN pieces, so the merge writes NaN rows
                const long long piece = (row0 + e / head_size) * gridDim.z + blockIdx.z;
                part_out[piece * head_size + e % head_size] = NAN;
                if (e % head_size == 0) part_ml[piece * 2] = part_ml[piece * 2 + 1] = NAN;
            }
        }
        return;
    }
#define VLLMINI_IMPL(D, T, G, H)                                                                                  \
    paged_attention_7_split_context_impl<Dtype, D, T, G, H>(out, part_out, part_ml, q, k_cache, v_cache,         \
                                                             block_tables, seq_lens, block_size, num_heads,       \
                                                             head_size, num_kv_heads, max_num_blocks_per_seq,     \
                                                             heads_per_block, pages_per_split, scale);
#define VLLMINI_CASE(D, T, TH) \
    case D: if (heads_per_block == 1) { VLLMINI_IMPL(D, T, 32, 1) } else { VLLMINI_IMPL(D, TH, 32, 4) } break;
#define VLLMINI_CASE16(D, T, TH, H) \
    case 2 * D: if (heads_per_block == 1) { VLLMINI_IMPL(2 * D, T, 16, 1) } else { VLLMINI_IMPL(2 * D, TH, 16, H) } break;
    if constexpr (sizeof(typename Dtype::storage) == 4) {
        switch ((head_size + WARP_SIZE - 1) / WARP_SIZE) {
            VLLMINI_CASE(1, 16, 16)
            VLLMINI_CASE(2, 16, 8)
            VLLMINI_CASE(3, 8, 4)
            VLLMINI_CASE(4, 8, 4)
            VLLMINI_CASE(5, 6, 3)
            VLLMINI_CASE(6, 5, 2)
            VLLMINI_CASE(7, 4, 2)
            VLLMINI_CASE(8, 4, 2)
        }
    } else {
        switch (2 * ((head_size + WARP_SIZE - 1) / WARP_SIZE)) {  // dims per lane in a group of 16
            VLLMINI_CASE16(1, 16, 8, 4)
            VLLMINI_CASE16(2, 8, 4, 4)
            VLLMINI_CASE16(3, 5, 2, 4)
            VLLMINI_CASE16(4, 4, 2, 4)
            VLLMINI_CASE16(5, 3, 2, 2)
            VLLMINI_CASE16(6, 3, 2, 2)
            VLLMINI_CASE16(7, 2, 1, 2)
            VLLMINI_CASE16(8, 2, 1, 2)
        }
    }
#undef VLLMINI_CASE16
#undef VLLMINI_CASE
#undef VLLMINI_IMPL
}

// The entry points CuPy and the emulator look up by name, one per element type. vLLM's argument order,
// with the split's partial results, num_kv_heads, max_num_blocks_per_seq, heads_per_block, pages_per_split
// and scale.
extern "C" __global__ void paged_attention_7_split_context(
    float* __restrict__ out,                // [num_seqs, num_heads, head_size]
    float* __restrict__ part_out,           // [num_seqs, num_heads, num_splits, head_size] (num_splits > 1)
    float* __restrict__ part_ml,            // [num_seqs, num_heads, num_splits, 2] (num_splits > 1)
    const float* __restrict__ q,            // [num_seqs, num_heads, head_size]
    const float* __restrict__ k_cache,      // [num_blocks, block_size, num_kv_heads, head_size]
    const float* __restrict__ v_cache,      // [num_blocks, block_size, num_kv_heads, head_size]
    const int* __restrict__ block_tables,   // [num_seqs, max_num_blocks_per_seq]
    const int* __restrict__ seq_lens,       // [num_seqs]
    const int block_size, const int num_heads, const int head_size,
    const int num_kv_heads, const int max_num_blocks_per_seq, const int heads_per_block,
    const int pages_per_split, const float scale) {
    paged_attention_7_split_context_dispatch<Float32>(out, part_out, part_ml, q, k_cache, v_cache, block_tables, seq_lens,
                                         block_size, num_heads, head_size, num_kv_heads, max_num_blocks_per_seq,
                                         heads_per_block, pages_per_split, scale);
}

extern "C" __global__ void paged_attention_7_split_context_f16(  // q, k_cache, v_cache: float16 bits
    float* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml,
    const unsigned short* __restrict__ q, const unsigned short* __restrict__ k_cache,
    const unsigned short* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int block_size, const int num_heads, const int head_size,
    const int num_kv_heads, const int max_num_blocks_per_seq, const int heads_per_block,
    const int pages_per_split, const float scale) {
    paged_attention_7_split_context_dispatch<Float16>(out, part_out, part_ml, q, k_cache, v_cache, block_tables, seq_lens,
                                         block_size, num_heads, head_size, num_kv_heads, max_num_blocks_per_seq,
                                         heads_per_block, pages_per_split, scale);
}

extern "C" __global__ void paged_attention_7_split_context_bf16(  // q, k_cache, v_cache: bfloat16 bits
    float* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml,
    const unsigned short* __restrict__ q, const unsigned short* __restrict__ k_cache,
    const unsigned short* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int block_size, const int num_heads, const int head_size,
    const int num_kv_heads, const int max_num_blocks_per_seq, const int heads_per_block,
    const int pages_per_split, const float scale) {
    paged_attention_7_split_context_dispatch<BFloat16>(out, part_out, part_ml, q, k_cache, v_cache, block_tables, seq_lens,
                                          block_size, num_heads, head_size, num_kv_heads, max_num_blocks_per_seq,
                                          heads_per_block, pages_per_split, scale);
}

// The merge of a split context (grid (num_seqs, num_heads), any block size; out is float32 for every
// input type): with M = max_s m_s and w_s = l_s * e^(m_s - M), out = sum_s w_s part_out_s / sum_s w_s,
// 0 when every piece is empty. A NaN piece (a bad head_size or seq_len) makes the row NaN.
extern "C" __global__ void paged_attention_7_split_context_merge(
    float* __restrict__ out,             // [num_seqs, num_heads, head_size]
    const float* __restrict__ part_out,  // [num_seqs, num_heads, num_splits, head_size]
    const float* __restrict__ part_ml,   // [num_seqs, num_heads, num_splits, 2]
    const int num_splits, const int head_size) {
    const long long row = (long long)blockIdx.x * gridDim.y + blockIdx.y;  // (sequence, query head)
    const float* ml = part_ml + row * num_splits * 2;                      // (num_splits, 2)
    float global_max = -INFINITY;
    for (int s = 0; s < num_splits; s++) global_max = fmaxf(global_max, ml[2 * s]);
    const float m_ref = global_max == -INFINITY ? 0.0f : global_max;  // every piece empty: no -inf - -inf
    float denom = 0.0f;
    for (int s = 0; s < num_splits; s++) denom += expf(ml[2 * s] - m_ref) * ml[2 * s + 1];
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
        float numer = 0.0f;
        for (int s = 0; s < num_splits; s++)
            numer += expf(ml[2 * s] - m_ref) * ml[2 * s + 1] * part_out[(row * num_splits + s) * head_size + d];
        out[row * head_size + d] = denom == 0.0f ? 0.0f : numer / denom;  // a NaN denom stays NaN
    }
}
