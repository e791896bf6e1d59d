// paged_attention_3_online_softmax.cu -- kernel 2 in one pass, with an online softmax (float32 only).
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
// Version 3: version 2 (paged_attention_2_warp_per_token.cu) plus ONE idea, the online softmax. Kernel 2
// keeps every score in shared memory and reads the context twice (K in pass 1, V in pass 3), with two
// block-wide reductions in between. Here each warp keeps three running values over the tokens it takes:
// the largest score so far m, the sum l of exp(score - m), and acc, the sum of exp(score - m) * v_t in
// registers (lane l holds dims l, l + 32, ...). When a larger score arrives, l and acc are rescaled by
// exp(m_old - m_new), so no score is kept and K and V are read in the same pass. At the end the 4 warps'
// (m, l, acc) are merged once through shared memory: out = sum_w e^(m_w - M) acc_w / sum_w e^(m_w - M) l_w.
// Milakov and Gimelshein, "Online normalizer calculation for softmax", 2018 (arXiv:1805.02867).
//
// Shapes (contiguous, row-major, all float32 except the int32 tables):
//     out, q             [num_seqs, num_heads, head_size]
//     k_cache, v_cache   [num_blocks, block_size, num_kv_heads, head_size]
//     block_tables       int32 [num_seqs, max_num_blocks_per_seq]  (entries past a sequence's length unused)
//     seq_lens           int32 [num_seqs], each >= 1
//
// Launch: grid = (num_seqs, num_heads), block = (128,) as kernels 1 and 2 (other sizes trap). Dynamic
// shared memory = 4 * (head_size + 2) * 4 bytes, the merge's [4] maxes, [4] sums and [4, head_size]
// outputs, whatever the context length: any seq_len the block table can hold.
//
// Limits: head_size <= MAX_HEAD_SIZE (256: acc lives in 8 registers a lane; larger head sizes get NaN,
// and the host refuses them before launch). The host validates block ids and seq_lens before launch;
// the kernel trusts them. Page offsets are 64-bit integers.
// Still slow: a warp has one K row and one V row in flight at a time, 4 bytes a lane (version 4 keeps
// more bytes on their way), and each query head of a GQA group reads its KV head again.

#define NUM_THREADS 128
#define WARP_SIZE 32
#define NUM_WARPS (NUM_THREADS / WARP_SIZE)
#define MAX_HEAD_SIZE 256
#define DIMS_PER_LANE (MAX_HEAD_SIZE / WARP_SIZE)  // 8 registers of acc a lane
#ifndef INFINITY  // NVRTC has no <math.h>; the bit pattern will do
#define INFINITY __int_as_float(0x7f800000)
#endif
#define NAN __int_as_float(0x7fffffff)

// The sum of v over the 32 lanes of this warp, returned to every lane.
__device__ float warp_sum(float v) {
    // Butterfly: at each step lane l adds the value of lane l ^ offset, so after the steps 16, 8, 4, 2, 1
    // every lane has added all 32 values. All 32 lanes take part (mask 0xffffffff).
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

extern "C" __global__ void paged_attention_3_online_softmax(
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
    if (blockDim.x != NUM_THREADS) __trap();  // the merge assumes exactly 4 warps

    const int seq = blockIdx.x;   // which sequence this thread block serves
    const int head = blockIdx.y;  // which query head
    const int tid = threadIdx.x;  // this thread, 0 .. 127
    const int warp = tid / WARP_SIZE;  // 0 .. 3
    const int lane = tid % WARP_SIZE;  // 0 .. 31
    const int seq_len = seq_lens[seq];
    const int kv_head = head / (num_heads / num_kv_heads);  // GQA: query heads share a KV head

    float* out_row = out + ((long long)seq * num_heads + head) * head_size;  // (head_size,)
    if (head_size > MAX_HEAD_SIZE) {  // refused by the host; never a silent answer
        for (int d = tid; d < head_size; d += NUM_THREADS) out_row[d] = NAN;
        return;
    }

    const float* q_row = q + ((long long)seq * num_heads + head) * head_size;   // (head_size,)
    const int* table = block_tables + (long long)seq * max_num_blocks_per_seq;  // this sequence's row
    const long long token_stride = (long long)num_kv_heads * head_size;  // next slot in a page
    const long long page_stride = (long long)block_size * token_stride;  // next page

    // ---- one pass: warp w takes tokens w, w + 4, ...; its lanes split the dims
    float m = -INFINITY;  // the largest score this warp has seen
    float l = 0.0f;       // sum of exp(score - m) over its tokens
    float acc[DIMS_PER_LANE];  // sum of exp(score - m) * v_t, dims lane, lane + 32, ...
    for (int i = 0; i < DIMS_PER_LANE; i++) acc[i] = 0.0f;
    for (int t = warp; t < seq_len; t += NUM_WARPS) {  // the same t for all 32 lanes of the warp
        const long long page = table[t / block_size];  // the page table lookup
        const long long row = page * page_stride + (t % block_size) * token_stride + (long long)kv_head * head_size;
        const float* k = k_cache + row;  // (head_size,)
        const float* v = v_cache + row;  // (head_size,)
        float partial = 0.0f;  // this lane's share of q . k: dims lane, lane + 32, ...
        for (int d = lane; d < head_size; d += WARP_SIZE) partial += q_row[d] * k[d];
        const float score = warp_sum(partial) * scale;  // every lane of the warp holds it

        const float m_new = fmaxf(m, score);
        const float correction = expf(m - m_new);  // rescales what we have; 0 on the warp's first token
        const float p = expf(score - m_new);       // this token's weight, <= 1
        l = l * correction + p;
        for (int i = 0; i < DIMS_PER_LANE; i++) {
            const int d = lane + i * WARP_SIZE;
            if (d < head_size) acc[i] = acc[i] * correction + p * v[d];
        }
        m = m_new;
    }

    // ---- merge the 4 warps through shared memory (sized at launch, see the header)
    extern __shared__ float shared[];
    float* warp_max = shared;                  // [NUM_WARPS]
    float* warp_l = shared + NUM_WARPS;        // [NUM_WARPS]
    float* warp_acc = shared + 2 * NUM_WARPS;  // [NUM_WARPS, head_size]
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
    for (int w = 0; w < NUM_WARPS; w++) global_max = fmaxf(global_max, warp_max[w]);
    float denom = 0.0f;
    for (int w = 0; w < NUM_WARPS; w++) denom += expf(warp_max[w] - global_max) * warp_l[w];
    for (int d = tid; d < head_size; d += NUM_THREADS) {  // thread tid takes dims tid, tid + 128
        float numer = 0.0f;
        for (int w = 0; w < NUM_WARPS; w++) numer += expf(warp_max[w] - global_max) * warp_acc[w * head_size + d];
        out_row[d] = numer / denom;
    }
}
