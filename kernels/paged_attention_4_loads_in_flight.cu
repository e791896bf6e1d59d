// paged_attention_4_loads_in_flight.cu -- kernel 3 with more bytes on their way from memory (float32 only).
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
// Version 4: version 3 (paged_attention_3_online_softmax.cu) plus ONE idea, keep enough bytes in flight.
// A read from HBM takes about half a microsecond; to stream at the GPU's bandwidth, each SM must have
// tens of kilobytes requested and not yet arrived (Little's law: bytes in flight = bandwidth x latency).
// Kernel 3's warp asks for one K row, waits, then one V row, 4 bytes a lane each time. Here three levers
// raise what a warp has on its way, and none of them changes the arithmetic:
//   * wide loads: lane l owns the DIMS = ceil(head_size / 32) CONSECUTIVE dims l*DIMS .. l*DIMS+DIMS-1,
//     so a lane reads its slice of a row in 16-byte loads (a float4: one instruction, 4 floats);
//   * many rows at once: a warp takes TOKENS consecutive tokens a step and issues the loads of all
//     their K AND V rows before it needs any (TOKENS * DIMS = 32: 8 tokens for head_size 128), so
//     2 * TOKENS rows are in flight per warp; the online softmax then takes the step's tokens together;
//   * more warps: 8 warps a block (256 threads) instead of 4.
// Each lane's slices live in registers, so their sizes must be known when the kernel is compiled: the
// loop is a template on DIMS and TOKENS, and the entry point switches once on ceil(head_size / 32) to
// the copy compiled for it (head_size stays a run-time argument).
//
// Shapes (contiguous, row-major, all float32 except the int32 tables):
//     out, query      [num_seqs, num_heads, head_size]
//     key_cache,      [num_blocks, block_size, num_kv_heads, head_size]
//     value_cache
//     block_tables    int32 [num_seqs, max_num_blocks_per_seq]  (entries past a sequence's length unused)
//     seq_lens        int32 [num_seqs]
//
// Launch: grid = (num_seqs, num_heads), blockIdx.x = sequence, blockIdx.y = query head (vLLM's
// layout); one thread block per (sequence, head) pair. block = NUM_WARPS * 32 threads (256 in vllmini;
// any multiple of 32 up to 1024). Dynamic shared memory = NUM_WARPS * (head_size + 2) * 4 bytes (the
// cross-warp merge of version 3).
//
// Build: plain CUDA C++ with no includes. vllmini.cuda_kernels compiles it with NVRTC through
// cupy.RawModule (GPU) or runs it on the CPU with vllmini.emulator.RawKernel; the CI test compiles it
// for sm_75, sm_80, sm_86, sm_89 and sm_90.
//
// Limits: head_size <= MAX_HEAD_SIZE (256; larger head sizes get NaN, and the host refuses them
// before launch); any seq_len the block table can hold. The host (vllmini.attention) validates block
// ids and seq_lens before launch; the kernel trusts them. Page addresses are 64-bit integers.
// GQA: each query head is its own thread block, so a KV head is read num_heads / num_kv_heads times
// (from L2 when lucky) -- the price of the simple grid (version 6 shares it). float32 only: 16-bit
// caches come with version 5.

#define WARP_SIZE 32
#define MAX_HEAD_SIZE 256
#ifndef INFINITY  // NVRTC has no <math.h>; the bit patterns will do
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#endif

// x[0..DIMS) = row[0..DIMS): whole 16-byte loads (float4, 4 floats) where DIMS is a multiple of 4, else
// 8-byte ones (float2) where it is even (the host checks the pointers are 16-byte aligned), else one
// float at a time. One 16-byte load instruction moves 4 times the bytes of a 4-byte one.
template <int DIMS>
__device__ __forceinline__ void load_slice(const float* __restrict__ row, float (&x)[DIMS]) {
    if constexpr (DIMS % 4 == 0) {
#pragma unroll
        for (int c = 0; c < DIMS / 4; c++) {
            const float4 f = reinterpret_cast<const float4*>(row)[c];
            x[4 * c] = f.x, x[4 * c + 1] = f.y, x[4 * c + 2] = f.z, x[4 * c + 3] = f.w;
        }
    } else if constexpr (DIMS % 2 == 0) {
#pragma unroll
        for (int c = 0; c < DIMS / 2; c++) {
            const float2 f = reinterpret_cast<const float2*>(row)[c];
            x[2 * c] = f.x, x[2 * c + 1] = f.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < DIMS; i++) x[i] = row[i];
    }
}

// This lane's slice of a row: the fast load when the lane owns all DIMS dims, else element by element
// with a bounds check (head sizes that are not a multiple of 32, e.g. 80; zero past head_size).
template <int DIMS>
__device__ __forceinline__ void load_lane(const float* __restrict__ row, int lane, int head_size,
                                          float (&x)[DIMS]) {
    const int d0 = lane * DIMS;
    if (head_size == DIMS * WARP_SIZE) {
        load_slice<DIMS>(row + d0, x);
    } else {
#pragma unroll
        for (int i = 0; i < DIMS; i++) x[i] = d0 + i < head_size ? row[d0 + i] : 0.0f;
    }
}

// Sum of v over the 32 lanes of a warp; every lane gets the total.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}

// Dynamic shared memory, num_warps * (head_size + 2) floats, sized by the launch's shared_mem argument.
extern __shared__ float smem[];

// One (sequence, query head) pair; DIMS = dims per lane, TOKENS = tokens a warp handles per step.
template <int DIMS, int TOKENS>
__device__ void paged_attention_4_loads_in_flight_impl(
    float* __restrict__ out,                // [num_seqs, num_heads, head_size]
    const float* __restrict__ query,        // [num_seqs, num_heads, head_size]
    const float* __restrict__ key_cache,    // [num_blocks, block_size, kv_heads, head_size]
    const float* __restrict__ value_cache,  // [num_blocks, block_size, kv_heads, head_size]
    const int* __restrict__ block_tables,   // [num_seqs, max_num_blocks_per_seq]
    const int* __restrict__ seq_lens,       // [num_seqs]
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

    // This lane's slice of the query (zero past head_size).
    float q[DIMS];
    load_lane<DIMS>(query + ((long long)seq * num_heads + head) * head_size, lane, head_size, q);
    float acc[DIMS];  // this warp's sum of p_t * v_t, for this lane's dims
#pragma unroll
    for (int i = 0; i < DIMS; i++) acc[i] = 0.0f;
    float m = -INFINITY;  // running max of this warp's scores
    float l = 0.0f;       // running sum of exp(score - m)

    const int* table = block_tables + (long long)seq * max_num_blocks_per_seq;  // (max_num_blocks_per_seq,)
    const long long token_stride = (long long)num_kv_heads * head_size;         // next slot in a page
    const long long page_stride = (long long)block_size * token_stride;         // next page

    for (int start = warp * TOKENS; start < seq_len; start += num_warps * TOKENS) {
        // 1) Load the K and V rows of TOKENS consecutive tokens, all before using any. Past the end of
        //    the sequence a warp re-reads its last real token instead of branching (slots past seq_len
        //    may hold NaN and are never read); those copies get score -inf and weight 0 below.
        float k[TOKENS][DIMS], v[TOKENS][DIMS];
#pragma unroll
        for (int u = 0; u < TOKENS; u++) {
            const int t = min(start + u, seq_len - 1);
            const long long page = table[t / block_size];  // the page table lookup
            const long long offset = page * page_stride + (t % block_size) * token_stride + (long long)kv_head * head_size;
            load_lane<DIMS>(key_cache + offset, lane, head_size, k[u]);
            load_lane<DIMS>(value_cache + offset, lane, head_size, v[u]);
        }
        // 2) Scores: each lane's partial dot product, then the warp sums each token's 32 partials.
        float score[TOKENS];
#pragma unroll
        for (int u = 0; u < TOKENS; u++) {
            float partial = 0.0f;
#pragma unroll
            for (int i = 0; i < DIMS; i++) partial += q[i] * k[u][i];
            score[u] = start + u < seq_len ? warp_sum(partial) * scale : -INFINITY;
        }
        // 3) Online softmax: raise the running max, rescale what we have, add the new tokens.
        //    score[0] is always a real token, so m_new is finite and no exp(-inf - -inf) happens.
        float m_new = m;
#pragma unroll
        for (int u = 0; u < TOKENS; u++) m_new = fmaxf(m_new, score[u]);
        const float correction = expf(m - m_new);  // 0 on the first step (m = -inf)
        l *= correction;
#pragma unroll
        for (int i = 0; i < DIMS; i++) acc[i] *= correction;
#pragma unroll
        for (int u = 0; u < TOKENS; u++) {
            if (start + u >= seq_len) break;  // a re-read copy: 0 * inf would be NaN, so skip, not weigh 0
            const float p = expf(score[u] - m_new);
            l += p;
#pragma unroll
            for (int i = 0; i < DIMS; i++) acc[i] += p * v[u][i];
        }
        m = m_new;
    }

    // 4) Cross-warp merge through shared memory (smem, sized by the launch): [num_warps] maxes,
    //    [num_warps] sums, [num_warps, head_size] partial outputs.
    float* warp_max = smem;                  // (num_warps,)
    float* warp_l = smem + num_warps;        // (num_warps,)
    float* warp_acc = smem + 2 * num_warps;  // (num_warps, head_size)
    if (lane == 0) {
        warp_max[warp] = m;  // -inf (and l = 0, acc = 0) for a warp that got no tokens
        warp_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < DIMS; i++) {
        const int d = lane * DIMS + i;
        if (d < head_size) warp_acc[warp * head_size + d] = acc[i];
    }
    __syncthreads();  // every warp's partial result is in shared memory

    float global_max = -INFINITY;
    for (int w = 0; w < num_warps; w++) global_max = fmaxf(global_max, warp_max[w]);
    float denom = 0.0f;
    for (int w = 0; w < num_warps; w++) denom += expf(warp_max[w] - global_max) * warp_l[w];
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
        float numer = 0.0f;
        for (int w = 0; w < num_warps; w++) numer += expf(warp_max[w] - global_max) * warp_acc[w * head_size + d];
        out_row[d] = numer / denom;
    }
}

// Pick the copy of the loop compiled for this head size: DIMS = ceil(head_size / 32) dims per lane and
// TOKENS = 32 / DIMS tokens per step (so every copy keeps about the same number of rows in registers).
__device__ void paged_attention_4_loads_in_flight_dispatch(
    float* __restrict__ out, const float* __restrict__ q, const float* __restrict__ k_cache,
    const float* __restrict__ v_cache, const int* __restrict__ block_tables, const int* __restrict__ seq_lens, const int block_size,
    const int num_heads, const int head_size, const int num_kv_heads, const int max_num_blocks_per_seq,
    const float scale) {
    const int seq_len = seq_lens[blockIdx.x];
    if (head_size > MAX_HEAD_SIZE || head_size < 1 || seq_len <= 0) {  // refused by the host
        float* out_row = out + ((long long)blockIdx.x * num_heads + blockIdx.y) * head_size;
        for (int d = threadIdx.x; d < head_size; d += blockDim.x) out_row[d] = NAN;
        return;
    }
#define VLLMINI_CASE(D, T)                                                                                  \
    case D:                                                                                                    \
        paged_attention_4_loads_in_flight_impl<D, T>(out, q, k_cache, v_cache, block_tables, seq_lens, block_size,     \
                                             num_heads, head_size, num_kv_heads, max_num_blocks_per_seq, scale); \
        break;
    switch ((head_size + WARP_SIZE - 1) / WARP_SIZE) {
        VLLMINI_CASE(1, 16)
        VLLMINI_CASE(2, 16)
        VLLMINI_CASE(3, 8)
        VLLMINI_CASE(4, 8)
        VLLMINI_CASE(5, 6)
        VLLMINI_CASE(6, 5)
        VLLMINI_CASE(7, 4)
        VLLMINI_CASE(8, 4)
    }
#undef VLLMINI_CASE
}

// The entry point CuPy and the emulator look up by name. vLLM's argument order,
// with num_kv_heads, max_num_blocks_per_seq and scale.
extern "C" __global__ void paged_attention_4_loads_in_flight(
    float* __restrict__ out,                // [num_seqs, num_heads, head_size]
    const float* __restrict__ q,            // [num_seqs, num_heads, head_size]
    const float* __restrict__ k_cache,      // [num_blocks, block_size, num_kv_heads, head_size]
    const float* __restrict__ v_cache,      // [num_blocks, block_size, num_kv_heads, head_size]
    const int* __restrict__ block_tables,   // [num_seqs, max_num_blocks_per_seq]
    const int* __restrict__ seq_lens,       // [num_seqs]
    const int block_size, const int num_heads, const int head_size,
    const int num_kv_heads, const int max_num_blocks_per_seq, const float scale) {
    paged_attention_4_loads_in_flight_dispatch(out, q, k_cache, v_cache, block_tables, seq_lens, block_size, num_heads,
                                         head_size, num_kv_heads, max_num_blocks_per_seq, scale);
}
