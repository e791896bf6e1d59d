// paged_attention_2_warp_softmax.cu -- decode attention that reads K and V through the page table.
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
//
// Entry points: paged_attention_2_warp_softmax (float32), paged_attention_2_warp_softmax_f16 and paged_attention_2_warp_softmax_bf16 (the
// query and caches passed as their raw 16-bit patterns, unsigned short; widened to float in registers,
// so no cuda_fp16.h is needed and every architecture compiles them). The softmax and every sum are float32
// and out is float32; vllmini.cuda_kernels casts it to the query's dtype.
//
// Launch: grid = (num_seqs, num_heads), blockIdx.x = sequence, blockIdx.y = query head (vLLM's
// layout); one thread block per (sequence, head) pair. block = NUM_WARPS * 32 threads (256 in vllmini).
// Dynamic shared memory = NUM_WARPS * (head_size + 2) * 4 bytes (the cross-warp merge).
//
// How the block shares the work:
//   * scores: the tokens are dealt to the warps in chunks of TOKENS_PER_STEP (8) consecutive tokens
//     (warp w takes chunk w, w + NUM_WARPS, ...); inside a warp the 32 lanes split the head
//     dimensions (lane l owns dims l, l+32, l+64, ...), so a warp reads each K row coalesced and a
//     butterfly of __shfl_xor_sync sums the 32 partial dot products. A warp issues the loads of all
//     8 rows before it needs any of them, so 8 rows per warp are on their way from memory at once.
//   * softmax: each warp keeps an online softmax (running max m, running sum l, and its part of the
//     weighted sum of V rows in registers), so no array of scores is kept and any context length
//     works with a fixed amount of memory. K and V are each read once per (sequence, query head).
//   * output: the warps write (m, l, acc) to shared memory, and after one __syncthreads() the threads
//     split the head dimensions to merge them: out = sum_w e^(m_w - M) acc_w / sum_w e^(m_w - M) l_w.
//
// Build: the file is plain CUDA C++ with no includes. vllmini.cuda_kernels compiles it with NVRTC
// through cupy.RawModule (GPU) or runs it on the CPU with vllmini.emulator.RawKernel; the CI test
// compiles it for sm_75, sm_80, sm_86, sm_89 and sm_90.
//
// Limits: head_size <= MAX_HEAD_SIZE (256; larger head sizes get NaN, and the host refuses them
// before launch); blockDim.x a multiple of 32 (up to 1024); any seq_len the block table can hold.
// The host (vllmini.attention) validates block ids and seq_lens before launch; the kernel trusts them.
// Page addresses are computed in 64-bit integers, so caches larger than 2^31 elements are fine.
// GQA: each query head is its own thread block, so a KV head is read num_heads / num_kv_heads times
// (from L2 when lucky) -- the price of the simple grid.
//
// Version 2 of the course's kernels (kernels/paged_attention_<n>_<what it adds>.cu; version 1 is the
// plain kernel of notebook 05b): one thread block per (sequence, query head), warp-per-token scores with
// an online softmax per warp and one cross-warp merge. Reads through the page table on the fly. float32,
// float16 and bfloat16 inputs through one template. What it lacks is what later versions add: vector
// loads (3), half-warp groups for 16-bit types (4), one block per KV head and split contexts (5).

#define WARP_SIZE 32
#define MAX_HEAD_SIZE 256
#define DIMS_PER_LANE (MAX_HEAD_SIZE / WARP_SIZE)  // 8 registers of q, acc per lane
#define TOKENS_PER_STEP 8                          // tokens a warp has in flight at once
#ifndef INFINITY                                    // NVRTC has no <math.h>; the bit patterns will do
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#endif

// The element types. Each says how its stored bits become a float.
struct Float32 {
    typedef float storage;
    static __device__ float to_float(float x) { return x; }
};
struct Float16 {  // IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa bits
    typedef unsigned short storage;
    static __device__ float to_float(unsigned short h) {
        const unsigned int sign = (unsigned int)(h & 0x8000) << 16;
        const unsigned int rest = h & 0x7fff;  // exponent and mantissa
        if (rest >= 0x7c00) return __uint_as_float(sign | 0x7f800000 | (rest & 0x3ff) << 13);  // inf, NaN
        // Shift the bits into float position (exponent now biased by 127 - 112) and scale by 2^112:
        // exact for normal and subnormal halves alike.
        return __uint_as_float(sign | rest << 13) * 5.192296858534828e33f;
    }
};
struct BFloat16 {  // the top 16 bits of a float32
    typedef unsigned short storage;
    static __device__ float to_float(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }
};

// Sum of v over the 32 lanes of a warp; every lane gets the total.
__device__ float warp_sum(float v) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        v += __shfl_xor_sync(0xffffffff, v, offset);
    }
    return v;
}

// Dynamic shared memory, num_warps * (head_size + 2) floats, sized by the launch's shared_mem argument.
extern __shared__ float smem[];

template <typename Dtype>
__device__ void paged_attention_2_warp_softmax_impl(
    float* __restrict__ out,                                  // [num_seqs, num_heads, head_size]
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
    const float scale) {
    const int seq = blockIdx.x;
    const int head = blockIdx.y;
    const int kv_head = head / (num_heads / num_kv_heads);
    const int warp = threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    const int seq_len = seq_lens[seq];

    float* out_row = out + ((long long)seq * num_heads + head) * head_size;  // (head_size,)
    if (head_size > MAX_HEAD_SIZE || seq_len <= 0) {  // refused by the host; never a silent answer
        for (int d = threadIdx.x; d < head_size; d += blockDim.x) out_row[d] = seq_len <= 0 ? 0.0f : NAN;
        return;
    }

    // This lane's slice of the query: dims lane, lane + 32, ... (zero past head_size).
    const typename Dtype::storage* q_row = query + ((long long)seq * num_heads + head) * head_size;
    float q[DIMS_PER_LANE];
    float acc[DIMS_PER_LANE];  // this warp's sum of p_t * v_t, for this lane's dims
    for (int i = 0; i < DIMS_PER_LANE; i++) {
        const int d = lane + i * WARP_SIZE;
        q[i] = d < head_size ? Dtype::to_float(q_row[d]) : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY;  // running max of this warp's scores
    float l = 0.0f;       // running sum of exp(score - m)

    const int* table = block_tables + (long long)seq * max_num_blocks_per_seq;  // (max_num_blocks_per_seq,)
    const long long token_stride = (long long)num_kv_heads * head_size;         // next slot in a page
    const long long page_stride = (long long)block_size * token_stride;         // next page

    for (int start = warp * TOKENS_PER_STEP; start < seq_len; start += num_warps * TOKENS_PER_STEP) {
        // 1) Scores of TOKENS_PER_STEP consecutive tokens. First every lane multiplies its dims of q
        //    and k for all of them, then the warp sums each token's 32 partial products. Past the end
        //    of the sequence a warp re-reads its last real token instead of branching (slots past
        //    seq_len may hold NaN and are never read), so the loads of all the step's tokens can be in
        //    flight at once; those copies get score -inf and weight 0 below.
        float score[TOKENS_PER_STEP];
        long long offset[TOKENS_PER_STEP];  // element offset of each token's K/V row
        for (int u = 0; u < TOKENS_PER_STEP; u++) {
            const int t = min(start + u, seq_len - 1);
            const long long page = table[t / block_size];  // the page table lookup
            offset[u] = page * page_stride + (t % block_size) * token_stride + (long long)kv_head * head_size;
            const typename Dtype::storage* k_row = key_cache + offset[u];
            score[u] = 0.0f;
            for (int i = 0; i < DIMS_PER_LANE; i++) {
                const int d = lane + i * WARP_SIZE;
                if (d < head_size) score[u] += q[i] * Dtype::to_float(k_row[d]);
            }
        }
        for (int u = 0; u < TOKENS_PER_STEP; u++) {
            const float total = warp_sum(score[u]);  // butterfly: every lane gets the sum
            score[u] = start + u < seq_len ? total * scale : -INFINITY;
        }

        // 2) Online softmax: raise the running max, rescale what we have, add the new tokens.
        //    score[0] is always a real token, so m_new is finite and no exp(-inf - -inf) happens.
        float m_new = m;
        for (int u = 0; u < TOKENS_PER_STEP; u++) m_new = fmaxf(m_new, score[u]);
        const float correction = expf(m - m_new);  // 0 on the first step (m = -inf)
        l *= correction;
        for (int i = 0; i < DIMS_PER_LANE; i++) acc[i] *= correction;
        for (int u = 0; u < TOKENS_PER_STEP; u++) {
            const bool real = start + u < seq_len;
            const float p = real ? expf(score[u] - m_new) : 0.0f;
            l += p;
            const typename Dtype::storage* v_row = value_cache + offset[u];
            for (int i = 0; i < DIMS_PER_LANE; i++) {
                const int d = lane + i * WARP_SIZE;
                if (d < head_size && real) acc[i] += p * Dtype::to_float(v_row[d]);
            }
        }
        m = m_new;
    }

    // 3) Cross-warp merge through shared memory (smem, sized by the launch): [num_warps] maxes,
    //    [num_warps] sums, [num_warps, head_size] partial outputs.
    float* warp_max = smem;                       // (num_warps,)
    float* warp_l = smem + num_warps;             // (num_warps,)
    float* warp_acc = smem + 2 * num_warps;       // (num_warps, head_size)
    if (lane == 0) {
        warp_max[warp] = m;  // -inf (and l = 0, acc = 0) for a warp that got no tokens
        warp_l[warp] = l;
    }
    for (int i = 0; i < DIMS_PER_LANE; i++) {
        const int d = lane + i * WARP_SIZE;
        if (d < head_size) warp_acc[warp * head_size + d] = acc[i];
    }
    __syncthreads();  // every warp's partial result is in shared memory

    float global_max = -INFINITY;
    for (int w = 0; w < num_warps; w++) global_max = fmaxf(global_max, warp_max[w]);
    float denom = 0.0f;
    for (int w = 0; w < num_warps; w++) denom += expf(warp_max[w] - global_max) * warp_l[w];
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
        float numer = 0.0f;
        for (int w = 0; w < num_warps; w++) {
            numer += expf(warp_max[w] - global_max) * warp_acc[w * head_size + d];
        }
        out_row[d] = numer / denom;
    }
}

// The entry points CuPy and the emulator look up by name, one per element type. vLLM's argument order,
// with num_kv_heads, max_num_blocks_per_seq and scale.
extern "C" __global__ void paged_attention_2_warp_softmax(
    float* __restrict__ out,                // [num_seqs, num_heads, head_size]
    const float* __restrict__ q,            // [num_seqs, num_heads, head_size]
    const float* __restrict__ k_cache,      // [num_blocks, block_size, num_kv_heads, head_size]
    const float* __restrict__ v_cache,      // [num_blocks, block_size, num_kv_heads, head_size]
    const int* __restrict__ block_tables,   // [num_seqs, max_num_blocks_per_seq]
    const int* __restrict__ seq_lens,       // [num_seqs]
    const int block_size, const int num_heads, const int head_size,
    const int num_kv_heads, const int max_num_blocks_per_seq, const float scale) {
    paged_attention_2_warp_softmax_impl<Float32>(out, q, k_cache, v_cache, block_tables, seq_lens, block_size, num_heads,
                                     head_size, num_kv_heads, max_num_blocks_per_seq, scale);
}

extern "C" __global__ void paged_attention_2_warp_softmax_f16(  // q, k_cache, v_cache: float16 bits
    float* __restrict__ out, const unsigned short* __restrict__ q, const unsigned short* __restrict__ k_cache,
    const unsigned short* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int block_size, const int num_heads, const int head_size,
    const int num_kv_heads, const int max_num_blocks_per_seq, const float scale) {
    paged_attention_2_warp_softmax_impl<Float16>(out, q, k_cache, v_cache, block_tables, seq_lens, block_size, num_heads,
                                     head_size, num_kv_heads, max_num_blocks_per_seq, scale);
}

extern "C" __global__ void paged_attention_2_warp_softmax_bf16(  // q, k_cache, v_cache: bfloat16 bits
    float* __restrict__ out, const unsigned short* __restrict__ q, const unsigned short* __restrict__ k_cache,
    const unsigned short* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int block_size, const int num_heads, const int head_size,
    const int num_kv_heads, const int max_num_blocks_per_seq, const float scale) {
    paged_attention_2_warp_softmax_impl<BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, block_size, num_heads,
                                      head_size, num_kv_heads, max_num_blocks_per_seq, scale);
}
