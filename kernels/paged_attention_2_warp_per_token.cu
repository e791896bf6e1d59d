// paged_attention_2_warp_per_token.cu -- kernel 1 with a warp per token in pass 1 (float32 only).
//
// What it computes, for every sequence s and query head h (one new token per sequence):
//     kv = h / (num_heads / num_kv_heads)                      grouped-query / multi-query attention
//     for t in 0 .. seq_lens[s]-1:                              every token in the cache
//         page = block_tables[s][t / block_size]                logical block -> physical page
//         k_t  = k_cache[page][t % block_size][kv]              (head_size,)
//         v_t  = v_cache[page][t % block_size][kv]
//     score_t   = scale * q[s][h] . k_t
//     out[s][h] = sum_t softmax(score)_t * v_t                  (head_size,)
// the same numbers as vllmini.paged_attention(backend="torch").
//
// Version 2: version 1 (paged_attention_1_plain.cu) plus ONE idea, a warp per token. Kernel 1 gives each
// thread a whole token and a whole head_size loop, so the 32 threads of a warp read 32 different K rows
// at once (uncoalesced: 32 separate memory transactions for one load instruction). Here, in pass 1 only,
// the 32 lanes of a warp split the head dimensions of ONE token (lane l takes dims l, l + 32, ...), so a
// warp reads each K row in consecutive addresses, and the 32 partial dot products are summed with a
// butterfly of register shuffles (notebook 05a): after log2(32) = 5 steps every lane holds the whole sum.
// Warp w takes tokens w, w + 4, w + 8, ... (4 warps of 32 lanes in a block of 128). Passes 2 and 3, the
// shapes, the launch and the shared memory are kernel 1's. Notebook 05b's exercise 6 asks you to write
// its warp_sum (kernels/exercises/warp_reduction.cu is this file with warp_sum left to write).
//
// Shapes (contiguous, row-major, all float32 except the int32 tables):
//     out, q             [num_seqs, num_heads, head_size]
//     k_cache, v_cache   [num_blocks, block_size, num_kv_heads, head_size]
//     block_tables       int32 [num_seqs, max_num_blocks_per_seq]  (entries past a sequence's length unused)
//     seq_lens           int32 [num_seqs], each >= 1
//
// Launch: grid = (num_seqs, num_heads): blockIdx.x = sequence, blockIdx.y = query head, one thread block
// per (sequence, query head) pair. block = (128,): exactly NUM_THREADS = 128 threads (other sizes trap).
// Dynamic shared memory = (max_num_blocks_per_seq * block_size + 128) * 4 bytes:
//     scores   [max_num_blocks_per_seq * block_size] floats, one per token the block table can hold
//     scratch  [128] floats, one per thread, for the block-wide max and sum
// The three passes:
//   1. scores: warp w takes tokens w, w + 4, w + 8, ...; for each it looks up the page in the block
//      table, its lanes multiply their dims of q and k_t, warp_sum adds the 32 parts, lane 0 writes
//      scale * q . k_t to scores[t].
//   2. softmax: a block-wide max of the scores, then scores[t] = exp(scores[t] - max) and a block-wide
//      sum of those (each reduction: every thread writes its value to scratch, then a tree of halvings
//      with __syncthreads() between the steps).
//   3. output: thread i takes head dims i, i + 128, ...; it walks the block table page by page and sums
//      scores[t] * v_t[d] over the tokens, then divides by the sum.
//
// Build: plain CUDA C++, no includes. Python launches it with the same call on a GPU or a CPU:
//     kernel = cupy.RawKernel(source, "paged_attention_2_warp_per_token")           # NVRTC, on a GPU
//     kernel = vllmini.emulator.RawKernel(source, "paged_attention_2_warp_per_token")  # the CPU emulator
//     kernel((num_seqs, num_heads), (128,), (out, q, k_cache, v_cache, block_tables, seq_lens,
//            np.int32(block_size), np.int32(num_heads), np.int32(head_size), np.int32(num_kv_heads),
//            np.int32(max_num_blocks_per_seq), np.float32(scale)), shared_mem=shared_mem_bytes)
//
// Limits: the scores of the whole context sit in shared memory, so the context is bounded by it:
// 48 KiB (the default without opting in) holds about 12,000 tokens, an H100/H200's 227 KiB about
// 58,000. Any head_size. The host validates block ids and seq_lens before launch; the kernel trusts
// them. Page offsets are 64-bit integers, so caches larger than 2^31 elements are fine.
// GQA: each query head is its own thread block, so a KV head is read num_heads / num_kv_heads times.
// Still slow: K and V are each read in a separate pass over global memory, the whole context's scores
// sit in shared memory, and pass 3 reads V with one thread per dim (version 3 fuses the passes).

#define NUM_THREADS 128
#define WARP_SIZE 32
#define NUM_WARPS (NUM_THREADS / WARP_SIZE)
#ifndef INFINITY  // NVRTC has no <math.h>; the bit pattern will do
#define INFINITY __int_as_float(0x7f800000)
#endif

// The sum of v over the 32 lanes of this warp, returned to every lane.
__device__ float warp_sum(float v) {
    // Butterfly: at each step lane l adds the value of lane l ^ offset, so after the steps 16, 8, 4, 2, 1
    // every lane has added all 32 values. All 32 lanes take part (mask 0xffffffff).
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// The largest value over the block: every thread passes its own v and gets the block's maximum.
__device__ float block_max(float v, float* scratch) {
    const int tid = threadIdx.x;
    scratch[tid] = v;
    __syncthreads();
    for (int half = NUM_THREADS / 2; half > 0; half /= 2) {  // 64, 32, ..., 1: halve the live values
        if (tid < half) scratch[tid] = fmaxf(scratch[tid], scratch[tid + half]);
        __syncthreads();
    }
    const float result = scratch[0];
    __syncthreads();  // everyone has read scratch[0] before scratch is reused
    return result;
}

// The sum over the block, the same way.
__device__ float block_sum(float v, float* scratch) {
    const int tid = threadIdx.x;
    scratch[tid] = v;
    __syncthreads();
    for (int half = NUM_THREADS / 2; half > 0; half /= 2) {
        if (tid < half) scratch[tid] += scratch[tid + half];
        __syncthreads();
    }
    const float result = scratch[0];
    __syncthreads();
    return result;
}

extern "C" __global__ void paged_attention_2_warp_per_token(
    float* out,                        // [num_seqs, num_heads, head_size]
    const float* q,                    // [num_seqs, num_heads, head_size]
    const float* k_cache,              // [num_blocks, block_size, num_kv_heads, head_size]
    const float* v_cache,              // [num_blocks, block_size, num_kv_heads, head_size]
    const int* block_tables,           // [num_seqs, max_num_blocks_per_seq]
    const int* seq_lens,               // [num_seqs]
    const int block_size,
    const int num_heads,
    const int head_size,
    const int num_kv_heads,
    const int max_num_blocks_per_seq,
    const float scale)
{
    if (blockDim.x != NUM_THREADS) __trap();  // the reductions assume exactly 128 threads

    const int seq = blockIdx.x;   // which sequence this thread block serves
    const int head = blockIdx.y;  // which query head
    const int tid = threadIdx.x;  // this thread, 0 .. 127
    const int warp = tid / WARP_SIZE;  // 0 .. 3
    const int lane = tid % WARP_SIZE;  // 0 .. 31
    const int seq_len = seq_lens[seq];
    const int kv_head = head / (num_heads / num_kv_heads);  // GQA: query heads share a KV head

    extern __shared__ float shared[];  // sized at launch, see the header
    float* scores = shared;                                          // [max_num_blocks_per_seq * block_size]
    float* scratch = shared + max_num_blocks_per_seq * block_size;   // [NUM_THREADS]

    const float* q_row = q + ((long long)seq * num_heads + head) * head_size;   // (head_size,)
    const int* table = block_tables + (long long)seq * max_num_blocks_per_seq;  // this sequence's row
    const long long token_stride = (long long)num_kv_heads * head_size;  // next slot in a page
    const long long page_stride = (long long)block_size * token_stride;  // next page

    // ---- pass 1: one score per token; warp w takes tokens w, w + 4, ...; its lanes split the dims
    float my_max = -INFINITY;
    for (int t = warp; t < seq_len; t += NUM_WARPS) {  // the same t for all 32 lanes of the warp
        const long long page = table[t / block_size];  // the page table lookup
        const float* k = k_cache + page * page_stride + (t % block_size) * token_stride
                         + (long long)kv_head * head_size;  // (head_size,)
        float partial = 0.0f;  // this lane's share of q . k: dims lane, lane + 32, ...
        for (int d = lane; d < head_size; d += WARP_SIZE) partial += q_row[d] * k[d];
        const float dot = warp_sum(partial);  // every lane of the warp now holds the whole q . k
        if (lane == 0) scores[t] = dot * scale;  // one writer per token
        my_max = fmaxf(my_max, dot * scale);
    }

    // ---- pass 2: softmax over the whole context: max, then exp and sum
    const float max_score = block_max(my_max, scratch);  // also a barrier: every score is written
    float my_sum = 0.0f;
    for (int t = tid; t < seq_len; t += NUM_THREADS) {
        scores[t] = expf(scores[t] - max_score);  // <= 1, so no overflow
        my_sum += scores[t];
    }
    const float sum = block_sum(my_sum, scratch);  // also a barrier: every weight is written

    // ---- pass 3: out = sum_t weight_t * v_t; thread tid takes dims tid, tid + 128, ...
    const int num_blocks = (seq_len + block_size - 1) / block_size;  // pages this sequence uses
    for (int d = tid; d < head_size; d += NUM_THREADS) {
        float acc = 0.0f;
        for (int b = 0; b < num_blocks; b++) {  // walk the block table
            const long long page = table[b];
            const float* v_page = v_cache + page * page_stride + (long long)kv_head * head_size + d;
            const int tokens_here = min(block_size, seq_len - b * block_size);  // the last page may be partial
            for (int i = 0; i < tokens_here; i++) acc += scores[b * block_size + i] * v_page[i * token_stride];
        }
        out[((long long)seq * num_heads + head) * head_size + d] = acc / sum;
    }
}
