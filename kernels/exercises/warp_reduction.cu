// warp_reduction.cu -- notebook 05b's exercise: write the warp reduction of a warp-per-token kernel.
//
// The same numbers as paged_attention_1_plain.cu (float32; shapes, launch and shared memory as there),
// with one change, in pass 1 only: a whole warp computes one token's score. Kernel 1 gives each thread a
// whole token and a whole head_size loop, so neighbouring threads read different K rows (uncoalesced).
// Here the 32 lanes of a warp split the head dimensions of ONE token (lane l takes dims l, l + 32, ...),
// so a warp reads each K row in consecutive addresses; then the 32 partial dot products must be summed.
// Warp w takes tokens w, w + 4, w + 8, ... (4 warps of 32 lanes in a block of 128).
//
// YOUR PART: the body of warp_sum() below (look for TODO). Everything else is given and correct. As
// given, the file compiles and runs, but warp_sum returns each lane's own partial sum, so the scores --
// and the output -- are wrong. Check your version with
//     from vllmini.course.cuda_exercises import check_warp_reduction_kernel
//     check_warp_reduction_kernel(source)     # source: the text of this file, with your warp_sum
// which runs it on the CPU emulator (checked mode) against a float64 reference, on random block tables.
// Worked solution: kernels/paged_attention_2_warp_per_token.cu, version 2 of the course's kernels; this
// file is that one with warp_sum's body taken out (tests/test_exercises.py checks that nothing else differs).
//
// Launch: grid = (num_seqs, num_heads), block = (128,), dynamic shared memory =
// (max_num_blocks_per_seq * block_size + 128) * 4 bytes; the arguments of paged_attention_1_plain.
// The entry point keeps version 2's name, paged_attention_2_warp_per_token.

#define NUM_THREADS 128
#define WARP_SIZE 32
#define NUM_WARPS (NUM_THREADS / WARP_SIZE)
#ifndef INFINITY  // NVRTC has no <math.h>; the bit pattern will do
#define INFINITY __int_as_float(0x7f800000)
#endif

// The sum of v over the 32 lanes of this warp, returned to every lane.
__device__ float warp_sum(float v) {
    // TODO: a butterfly of register shuffles (notebook 05a, section 5). At each step every lane adds the
    // value held by the lane whose index differs from its own in one bit: __shfl_xor_sync(mask, v, offset)
    // returns v of lane (lane ^ offset). Which offsets, in which order, so that after log2(32) = 5 steps
    // every lane holds the sum of all 32 values? Which lanes take part (the mask)?
    return v;  // wrong until you write the steps above: only this lane's share
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
