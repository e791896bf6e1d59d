// paged_attention_1_plain.cu -- the simplest correct paged-attention decode kernel (float32 only).
//
// What it computes, for every sequence s and query head h (one new token per sequence):
//     kv = h / (num_heads / num_kv_heads)                      grouped-query / multi-query attention
//     for t in 0 .. seq_lens[s]-1:                              every token in the cache
//         page = block_tables[s][t / block_size]                logical block -> physical page
//         k_t  = k_cache[page][t % block_size][kv]              (head_size,)
//         v_t  = v_cache[page][t % block_size][kv]
//     score_t   = scale * q[s][h] . k_t
//     out[s][h] = sum_t softmax(score)_t * v_t                  (head_size,)
// the same numbers as vllmini.paged_attention(backend="torch"). It is written to be read, not to be fast:
// no templates, no macros, no vector loads, no warp shuffles. The later kernels in this folder
// (paged_attention_2_... to 10_...) make it fast one idea at a time; notebooks 05b and 07 walk through them.
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
//   1. scores: thread i takes tokens i, i + 128, i + 256, ...; for each it looks up the page in the
//      block table and writes scale * q . k_t to scores[t] (a whole head_size loop per thread).
//   2. softmax: a block-wide max of the scores, then scores[t] = exp(scores[t] - max) and a block-wide
//      sum of those (each reduction: every thread writes its value to scratch, then a tree of halvings
//      with __syncthreads() between the steps).
//   3. output: thread i takes head dims i, i + 128, ...; it walks the block table page by page and sums
//      scores[t] * v_t[d] over the tokens, then divides by the sum.
//
// Build: plain CUDA C++, no includes. Python launches it with the same call on a GPU or a CPU:
//     kernel = cupy.RawKernel(source, "paged_attention_1_plain")           # NVRTC, on a GPU
//     kernel = vllmini.emulator.RawKernel(source, "paged_attention_1_plain")  # the CPU emulator
//     kernel((num_seqs, num_heads), (128,), (out, q, k_cache, v_cache, block_tables, seq_lens,
//            np.int32(block_size), np.int32(num_heads), np.int32(head_size), np.int32(num_kv_heads),
//            np.int32(max_num_blocks_per_seq), np.float32(scale)), shared_mem=shared_mem_bytes)
//
// Limits: the scores of the whole context sit in shared memory, so the context is bounded by it:
// 48 KiB (the default without opting in) holds about 12,000 tokens, an H100/H200's 227 KiB about
// 58,000. Any head_size. The host validates block ids and seq_lens before launch; the kernel trusts
// them. Page offsets are 64-bit integers, so caches larger than 2^31 elements are fine.
// GQA: each query head is its own thread block, so a KV head is read num_heads / num_kv_heads times.
// Slow on purpose: in pass 1 neighbouring threads read different K rows (uncoalesced), and K and V
// are each read once per pass over global memory.

#define NUM_THREADS 128
#ifndef INFINITY  // NVRTC has no <math.h>; the bit pattern will do
#define INFINITY __int_as_float(0x7f800000)
#endif

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

extern "C" __global__ void paged_attention_1_plain(
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
    const int seq_len = seq_lens[seq];
    const int kv_head = head / (num_heads / num_kv_heads);  // GQA: query heads share a KV head

    extern __shared__ float shared[];  // sized at launch, see the header
    float* scores = shared;                                          // [max_num_blocks_per_seq * block_size]
    float* scratch = shared + max_num_blocks_per_seq * block_size;   // [NUM_THREADS]

    const float* q_row = q + ((long long)seq * num_heads + head) * head_size;   // (head_size,)
    const int* table = block_tables + (long long)seq * max_num_blocks_per_seq;  // this sequence's row
    const long long token_stride = (long long)num_kv_heads * head_size;  // next slot in a page
    const long long page_stride = (long long)block_size * token_stride;  // next page

    // ---- pass 1: one score per token; thread tid takes tokens tid, tid + 128, ...
    float my_max = -INFINITY;
    for (int t = tid; t < seq_len; t += NUM_THREADS) {
        const long long page = table[t / block_size];  // the page table lookup
        const float* k = k_cache + page * page_stride + (t % block_size) * token_stride
                         + (long long)kv_head * head_size;  // (head_size,)
        float dot = 0.0f;
        for (int d = 0; d < head_size; d++) dot += q_row[d] * k[d];
        scores[t] = dot * scale;
        my_max = fmaxf(my_max, scores[t]);
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
