// paged_attention_10_tensor_cores.cu -- decode attention through the page table, a GQA group on tensor cores.
//
// What it computes is what every paged_attention_<n>_*.cu computes (see paged_attention_5_half_warps.cu):
//     out[s][h] = softmax(scale * q[s][h] . k_t over t < seq_lens[s]) @ v_t,
//     k_t, v_t = key_cache/value_cache[block_tables[s][t / block_size]][t % block_size][h / group]
// in float16 or bfloat16 (inputs and output), with float32 scores, softmax and sums.
//
// The one idea it adds to version 9 (paged_attention_9_guard.cu): the query heads of a GQA group that
// share a KV head are packed into one matrix tile, and both products run on the tensor cores,
// `mma.sync.aligned.m16n8k16` (16-bit inputs, float32 accumulators): per warp and step of 16 tokens,
//     S   (16 heads x 16 tokens) = Q (16 heads x head_size) . K^T    head_size / 16 k-steps x 2 token tiles
//     O^T (head_size x 8 heads) += V^T (head_size x 16 tokens) . P^T  head_size / 16 dim tiles, one k-step
// (the second product transposed, so a group of up to 8 heads fills its 8 columns instead of wasting 8 of
// 16 rows: half the accumulator registers). A decode step is memory-bound: the tile's padding costs
// nothing that matters, while version 9 did each head's multiply-adds on the CUDA cores and became
// issue-bound (68% of the read ceiling on GQA 32q/8kv). The rest is version 9's: one block per (sequence,
// head block, context piece), the online softmax in the log2 domain, the split contract (part_out,
// part_ml, the merge kernels below), the in-kernel guard on page ids and lengths.
//
// No shared memory and no transposes in the loop: the fragments come straight from 16-byte loads.
//   * K. The sum over dims in Q . K^T may run in any order, so the k index of the mma is a permutation
//     of the head dims: lane (g = lane / 4, t = lane % 4) loads tokens g's and 8 + g's rows in 16-byte
//     chunks 8 * (4c + t) .. +7 (c < head_size / 32; four lanes cover 64 contiguous bytes per load), and
//     words 0-1 / 2-3 of chunk c are its B registers for k-steps 2c / 2c + 1. Q is loaded the same way
//     (rows g, g + 8), so the A and B k indices name the same dims.
//   * V. V^T . P^T sums over tokens, and the A registers of an mma pair two consecutive k (= tokens) of
//     one row (a dim): lane (g, t) loads the rows of tokens 2t, 2t + 1, 2t + 8, 2t + 9 at dims
//     8 * (8c + g) .. +7 (c < head_size / 64), and pairs the halves of two rows with shifts and masks
//     (one PRMT each). Word w of chunk c gives dim tile 4c + w: its low halves row g, its high halves
//     row g + 8.
//   * P. The accumulator fragment of S (row g = head g; tokens 2t, 2t + 1 and 2t + 8, 2t + 9) is, element
//     for element, the B fragment of P^T: the probabilities stay in the registers that computed them,
//     rounded to the input type.
//   * Rows. A head's 16 scores of a step sit in the 4 lanes of a quad: its max and sum take two
//     shuffles, and each lane fetches the corrections of its two output columns with two more. Groups of
//     up to 8 heads use rows 0-7 of Q (rows 8-15 are zero registers); 9-16 heads take the copy that keeps
//     rows 8-15 and a second column tile of O^T.
//   * Pipeline. The next step's K is issued as soon as this step's scores are done, its V once P . V is
//     done, the page ids one step further ahead: every warp always has a step of loads in flight.
//
// Measured (H200, head size 128, block 16, B64 L4096, fp16, 2026-12-02, benchmarks/bench_tensor_cores.py,
// L2 flushed, median of 30): GQA 32q/8kv 267-269 us = 4.0 TB/s of K+V (91% of a 4.41 TB/s read ceiling,
// 1.07x cuDNN SDPA on a contiguous cache, version 9 1.50x), 32/4 140 us (1.05x), 64/8 277 us (1.10x);
// bfloat16 the same within 1%. 168 registers (3 blocks per SM), no spills.
//
// Shapes (contiguous), as version 9: out [num_seqs, num_heads, head_size] (16-bit bits); part_out
// float32 [num_seqs, num_heads, num_splits, head_size] and part_ml float32 [..., num_splits, 2] (only
// when num_splits > 1, else may be null); query [num_seqs, num_heads, head_size]; key_cache/value_cache
// [num_blocks, block_size, num_kv_heads, head_size]; block_tables int32 [num_seqs,
// max_num_blocks_per_seq]; seq_lens int32 [num_seqs]; error int32 [5] or null (version 9's guard:
// a bad page id is never dereferenced, page 0 is read instead, the sequence's rows come out NaN and the
// first violation is recorded as {1, sequence, table entry or -1 for seq_lens, value, limit}).
//
// Launch: grid = (num_seqs, num_heads / heads_per_block, num_splits), block = 128 threads (4 warps),
// dynamic shared memory = 4 * ROWS * (head_size + 2) * 4 bytes, ROWS = 8 when heads_per_block <= 8
// else 16. Splits: the grid's blocks fill whole waves of 3 per SM best (512 blocks on 132 SMs: 3 pieces). heads_per_block (1 .. 16) divides num_heads / num_kv_heads; pages_per_split * num_splits
// covers max_num_blocks_per_seq; when num_splits > 1, then the merge kernel with grid (num_seqs,
// num_heads), any block size.
// Limits: head_size 64 or 128 (other sizes: NaN rows; the host takes version 9), 16-byte aligned rows,
// sm_80 or newer (mma.sync m16n8k16 with bf16; an older GPU traps), any block size (multiples of 16
// look a step's page up once).
//
// Build: loaded by vllmini (NVRTC through CuPy); alone: nvcc -arch=sm_90 -c paged_attention_10_tensor_cores.cu
// A build may compile one copy only: -DVLLMINI_ONLY_HEAD=64|128 and -DVLLMINI_ONLY_ROWS16=0|1 (a kernel's
// register count is the largest any of its copies needs). The CPU emulator runs it too (vllmini.emulator;
// its model of the mma is vllmini/emulator/emu_mma.h).

#define WARP_SIZE 32
#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / WARP_SIZE)
#define STEP 16  // tokens a warp takes per step: one k-step of P . V
#define LOG2E 1.4426950408889634f
#ifndef VLLMINI_ONLY_HEAD
#define VLLMINI_ONLY_HEAD 0
#endif
#ifndef VLLMINI_ONLY_ROWS16
#define VLLMINI_ONLY_ROWS16 -1
#endif
#ifndef INFINITY  // NVRTC has no <math.h>; the bit patterns will do
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#endif

// ----------------------------------------------------------------------------- element types
// Both store 16 bits; `pack` rounds two floats into one 32-bit register (lo in the low half), as the
// mma's A and B registers hold them.
struct Float16 {
    static constexpr bool IS_BF16 = false;
    static __device__ __forceinline__ unsigned short from_float(float x) {
#ifndef __VLLMINI_EMULATOR__
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return h;
#else
        return __emu::float_to_half_bits(x);
#endif
    }
    static __device__ __forceinline__ float to_float(unsigned short h) {
#ifndef __VLLMINI_EMULATOR__
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
#else
        return __emu::half_bits_to_float(h);
#endif
    }
    static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
#if !defined(__VLLMINI_EMULATOR__) && __CUDA_ARCH__ >= 800
        unsigned int r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
#else
        return (unsigned int)from_float(lo) | ((unsigned int)from_float(hi) << 16);
#endif
    }
};
struct BFloat16 {  // the top 16 bits of a float32
    static constexpr bool IS_BF16 = true;
    static __device__ __forceinline__ unsigned short from_float(float x) {  // round to nearest even
        const unsigned int u = __float_as_uint(x);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // quiet NaN
        return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    static __device__ __forceinline__ float to_float(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }
    static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
#if !defined(__VLLMINI_EMULATOR__) && __CUDA_ARCH__ >= 800
        unsigned int r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
#else
        return (unsigned int)from_float(lo) | ((unsigned int)from_float(hi) << 16);
#endif
    }
};

// ----------------------------------------------------------------------------- the tensor-core product
// d = A (16x16) . B (16x8) + c for the whole warp; every lane calls it with its fragment registers
// (layouts in vllmini/emulator/emu_mma.h and the PTX ISA). On a GPU one instruction; in the emulator a
// model of it.
template <typename Dtype>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2],
                                          const float (&c)[4]) {
#if defined(__VLLMINI_EMULATOR__)
    __emu::mma_m16n8k16(d, a, b, c, Dtype::IS_BF16);
#elif __CUDA_ARCH__ >= 800
    if constexpr (Dtype::IS_BF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%10, %11, %12, %13};"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
              "f"(c[3]));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%10, %11, %12, %13};"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
              "f"(c[3]));
    }
#else
    __trap();  // no m16n8k16 before sm_80: the host never picks this version there
#endif
}

// ----------------------------------------------------------------------------- the guard (as version 9)

// Record the first violation (sequence, table entry or -1 for seq_lens, value, limit); later ones are dropped.
__device__ __forceinline__ void record_error(int* error, int seq, int entry, int value, int limit) {
    if (atomicCAS(error, 0, 1) == 0) {
        error[1] = seq;
        error[2] = entry;
        error[3] = value;
        error[4] = limit;
    }
}

// block_tables[seq][idx], checked when the guard is on: a bad id is recorded, marks the sequence bad and
// is replaced by page 0, so it is never dereferenced.
__device__ __forceinline__ int load_page(const int* __restrict__ table, int idx, int num_blocks, int* error, int seq,
                                         bool& bad) {
    int page = table[idx];
    if (error != nullptr && (unsigned int)page >= (unsigned int)num_blocks) {
        record_error(error, seq, idx, page, num_blocks);
        bad = true;
        page = 0;
    }
    return page;
}

// ----------------------------------------------------------------------------- one (sequence, head block, split)

extern __shared__ float smem[];

// The launch's arguments (shapes in the header), in the entry points' order.
#define VLLMINI_V6_PARAMS                                                                                        \
    unsigned short *__restrict__ out, float *__restrict__ part_out, float *__restrict__ part_ml,                  \
        const unsigned short *__restrict__ query, const unsigned short *__restrict__ key_cache,                   \
        const unsigned short *__restrict__ value_cache, const int *__restrict__ block_tables,                     \
        const int *__restrict__ seq_lens, int *error, const int num_blocks, const int block_size,                 \
        const int num_heads, const int head_size, const int num_kv_heads, const int max_num_blocks_per_seq,     \
        const int heads_per_block, const int pages_per_split, const float scale
#define VLLMINI_V6_ARGS                                                                                          \
    out, part_out, part_ml, query, key_cache, value_cache, block_tables, seq_lens, error, num_blocks, block_size, \
        num_heads, head_size, num_kv_heads, max_num_blocks_per_seq, heads_per_block, pages_per_split, scale

// Two 16-bit halves, one from each word: the low (HIGH = false) or high halves of lo and hi.
template <bool HIGH>
__device__ __forceinline__ unsigned int pair_halves(unsigned int lo, unsigned int hi) {
    if constexpr (HIGH) return (lo >> 16) | (hi & 0xffff0000u);
    else return (lo & 0xffffu) | (hi << 16);
}

template <typename Dtype, int HEAD, bool ROWS16>
__device__ void attend(VLLMINI_V6_PARAMS) {
    constexpr int KSTEPS = HEAD / 16;   // k-steps of Q . K^T
    constexpr int MTILES = HEAD / 16;   // 16-dim row tiles of O^T = V^T . P^T
    constexpr int HTILES = ROWS16 ? 2 : 1;  // 8-head column tiles of O^T
    constexpr int KCHUNKS = HEAD / 32;  // 16-byte chunks a lane loads of a K row (4 lanes a row)
    constexpr int VCHUNKS = HEAD / 64;  // 16-byte chunks a lane loads of a V row (8 lanes a row)
    constexpr int ROWS = ROWS16 ? 16 : 8;
    const int seq = blockIdx.x;
    const int head0 = blockIdx.y * heads_per_block;  // first query head of this block
    const int split = blockIdx.z;
    const int num_splits = gridDim.z;
    const int kv_head = head0 / (num_heads / num_kv_heads);
    const int warp = threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;  // the fragments' groupID and thread-in-group

    // The sequence's length, checked (a bad one reads nothing and gives NaN rows).
    bool bad = false;
    int seq_len = seq_lens[seq];
    const int max_len = max_num_blocks_per_seq * block_size;
    if (seq_len < 1 || seq_len > max_len) {
        if (error != nullptr && threadIdx.x == 0 && split == 0) record_error(error, seq, -1, seq_len, max_len);
        bad = true;
        seq_len = 0;
    }
    const int split_len = pages_per_split * block_size;
    const int t_begin = split * split_len;
    const int t_end = min(seq_len, t_begin + split_len);

    // Q as A fragments: q_lo[j] = registers 0 and 2 (row g), q_hi[j] = registers 1 and 3 (row g + 8) of
    // k-step j. Rows past heads_per_block are zero.
    unsigned int q_lo[KSTEPS][2], q_hi[ROWS16 ? KSTEPS : 1][2];
    auto load_q = [&](int row, unsigned int(&q)[KSTEPS][2]) {
#pragma unroll
        for (int c = 0; c < KCHUNKS; c++) {
            uint4 w = make_uint4(0u, 0u, 0u, 0u);
            if (row < heads_per_block)
                w = *reinterpret_cast<const uint4*>(query + ((long long)seq * num_heads + head0 + row) * HEAD +
                                                    8 * (4 * c + t));
            q[2 * c][0] = w.x, q[2 * c][1] = w.y, q[2 * c + 1][0] = w.z, q[2 * c + 1][1] = w.w;
        }
    };
    load_q(g, q_lo);
    if constexpr (ROWS16) load_q(g + 8, q_hi);

    // O^T as D fragments: acc[x][j] = heads 8x + 2t, 8x + 2t + 1 at dim row g (0, 1) and g + 8 (2, 3)
    // of dim tile j.
    float acc[HTILES][MTILES][4];
    float m[2], l[2];  // per row (g, g + 8): running max (log2 domain), this lane's share of the sum
#pragma unroll
    for (int x = 0; x < HTILES; x++) {
#pragma unroll
        for (int j = 0; j < MTILES; j++) acc[x][j][0] = acc[x][j][1] = acc[x][j][2] = acc[x][j][3] = 0.0f;
    }
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;

    const int* table = block_tables + (long long)seq * max_num_blocks_per_seq;
    const long long token_stride = (long long)num_kv_heads * HEAD;
    const long long page_stride = (long long)block_size * token_stride;
    const unsigned short* k_base = key_cache + (long long)kv_head * HEAD;
    const unsigned short* v_base = value_cache + (long long)kv_head * HEAD;
    const int shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
    const bool one_page = (block_size % STEP) == 0;  // a step's 16 tokens share a page
    const float qk_scale = scale * LOG2E;

    // Token start + u's row in the cache (minus the head's offset); past the end: the last real token
    // again, its score -inf below. `page`: the step's page when its 16 tokens share one, else unused.
    auto row_offset = [&](int start, int page, int u) -> long long {
        const int tok = min(start + u, t_end - 1);
        int idx, slot;
        if (shift >= 0) {
            idx = tok >> shift;
            slot = tok & (block_size - 1);
        } else {
            idx = tok / block_size;
            slot = tok - idx * block_size;
        }
        if (!one_page) page = load_page(table, idx, num_blocks, error, seq, bad);
        return page * page_stride + slot * token_stride;
    };
    auto step_page = [&](int start) -> int {  // looked up once per step when its tokens share a page
        if (!one_page || start >= t_end) return 0;
        return load_page(table, shift >= 0 ? start >> shift : start / block_size, num_blocks, error, seq, bad);
    };
    // A step's loads: K rows of tokens g and 8 + g, V rows of tokens 2t, 2t + 1, 2t + 8, 2t + 9.
    uint4 kw[2][KCHUNKS], vw[4][VCHUNKS];
    auto load_k = [&](int start, int page) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const unsigned short* row = k_base + row_offset(start, page, 8 * i + g);
#pragma unroll
            for (int c = 0; c < KCHUNKS; c++) kw[i][c] = *reinterpret_cast<const uint4*>(row + 8 * (4 * c + t));
        }
    };
    auto load_v = [&](int start, int page) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const unsigned short* row = v_base + row_offset(start, page, 2 * t + (i & 1) + 8 * (i >> 1));
#pragma unroll
            for (int c = 0; c < VCHUNKS; c++) vw[i][c] = *reinterpret_cast<const uint4*>(row + 8 * (8 * c + g));
        }
    };

    // 1) The pipeline: a step's K and V are in flight while the step before it computes -- the next K is
    //    issued as soon as this step's scores no longer need kw, the next V once P . V no longer needs
    //    vw -- and the page ids run one step further ahead, so no load waits on a table lookup.
    constexpr int STRIDE = NUM_WARPS * STEP;  // the warps take steps in turn
    int first = t_begin + warp * STEP;
    int page_next = step_page(first + STRIDE);
    if (first < t_end) {
        const int page = step_page(first);
        load_k(first, page);
        load_v(first, page);
    }
    for (int start = first; start < t_end; start += STRIDE) {
        const int next = start + STRIDE;
        const int page_after = step_page(next + STRIDE);
        // 2) S = Q . K^T, two tiles of 8 tokens: s[i][0..1] = row g, tokens 8i + 2t, 8i + 2t + 1; [2..3] row g + 8.
        float s[2][4];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
            for (int c = 0; c < KCHUNKS; c++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {  // k-step 2c + h: words 2h, 2h + 1 of chunk c
                    const int j = 2 * c + h;
                    const unsigned int a[4] = {q_lo[j][0], ROWS16 ? q_hi[ROWS16 ? j : 0][0] : 0u, q_lo[j][1],
                                               ROWS16 ? q_hi[ROWS16 ? j : 0][1] : 0u};
                    const unsigned int b[2] = {h ? kw[i][c].z : kw[i][c].x, h ? kw[i][c].w : kw[i][c].y};
                    const float cin[4] = {s[i][0], s[i][1], s[i][2], s[i][3]};
                    mma_16816<Dtype>(s[i], a, b, cin);
                }
            }
        }
        if (next < t_end) load_k(next, page_next);  // kw is free
        // 3) Online softmax per row in the log2 domain; a row's 16 scores are in the 4 lanes of a quad.
        unsigned int p[2][2];  // P^T as B fragments: heads 8x + g; tokens 2t, 2t + 1 (0) and 2t + 8, 2t + 9 (1)
        float correction[2];
#pragma unroll
        for (int r = 0; r < HTILES; r++) {
            float x[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {  // e: (tile e / 2, column e % 2) -> token 8 (e / 2) + 2t + e % 2
                const int tok = start + 8 * (e / 2) + 2 * t + (e % 2);
                x[e] = tok < t_end ? s[e / 2][2 * r + e % 2] * qk_scale : -INFINITY;
            }
            float step_max = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
            step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 1));
            step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 2));
            const float m_new = fmaxf(m[r], step_max);
            const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // no -inf - -inf
            correction[r] = exp2f(m[r] - m_use);
            float px[4];
#pragma unroll
            for (int e = 0; e < 4; e++) px[e] = exp2f(x[e] - m_use);  // 0 past the end
            l[r] = l[r] * correction[r] + (px[0] + px[1]) + (px[2] + px[3]);
            m[r] = m_new;
            p[r][0] = Dtype::pack(px[0], px[1]);
            p[r][1] = Dtype::pack(px[2], px[3]);
        }
        // 4) O^T = O^T * correction + V^T . P^T: A pairs tokens (2t, 2t + 1) and (2t + 8, 2t + 9) of dims
        //    rows g (low halves) and g + 8 (high halves); each lane scales its columns, heads 2t and 2t + 1,
        //    by their rows' corrections (held by lanes 8t and 8t + 4).
#pragma unroll
        for (int x = 0; x < HTILES; x++) {
            const float corr0 = __shfl_sync(0xffffffffu, correction[x], 8 * t);
            const float corr1 = __shfl_sync(0xffffffffu, correction[x], 8 * t + 4);
#pragma unroll
            for (int j = 0; j < MTILES; j++) {
                const int c = j / 4, w = j % 4;  // chunk and word of tile j's dims (rows g, g + 8)
                const unsigned int* v0 = reinterpret_cast<const unsigned int*>(&vw[0][c]);
                const unsigned int* v1 = reinterpret_cast<const unsigned int*>(&vw[1][c]);
                const unsigned int* v2 = reinterpret_cast<const unsigned int*>(&vw[2][c]);
                const unsigned int* v3 = reinterpret_cast<const unsigned int*>(&vw[3][c]);
                const unsigned int a[4] = {pair_halves<false>(v0[w], v1[w]), pair_halves<true>(v0[w], v1[w]),
                                           pair_halves<false>(v2[w], v3[w]), pair_halves<true>(v2[w], v3[w])};
                const float cin[4] = {acc[x][j][0] * corr0, acc[x][j][1] * corr1, acc[x][j][2] * corr0,
                                      acc[x][j][3] * corr1};
                mma_16816<Dtype>(acc[x][j], a, p[x], cin);
            }
        }
        if (next < t_end) load_v(next, page_next);  // vw is free
        page_next = page_after;
    }

    // 5) Each row's sum over its quad; then the warps' partial results through shared memory:
    //    [NUM_WARPS][ROWS] maxes and sums, then [NUM_WARPS][ROWS][HEAD] outputs.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    float* warp_m = smem;
    float* warp_l = smem + NUM_WARPS * ROWS;
    float* warp_acc = smem + 2 * NUM_WARPS * ROWS;
#pragma unroll
    for (int r = 0; r < HTILES; r++) {
        const int row = g + 8 * r;
        if (row < heads_per_block && t == 0) {
            warp_m[warp * ROWS + row] = m[r];
            warp_l[warp * ROWS + row] = l[r];
        }
    }
#pragma unroll
    for (int x = 0; x < HTILES; x++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {  // head 8x + 2t + e % 2, dim row g + 8 (e / 2) of each tile
            const int head = 8 * x + 2 * t + e % 2;
            if (head < heads_per_block) {
#pragma unroll
                for (int j = 0; j < MTILES; j++) {
                    const int d = 8 * (8 * (j / 4) + g) + 2 * (j % 4) + e / 2;
                    warp_acc[(warp * ROWS + head) * HEAD + d] = acc[x][j][e];
                }
            }
        }
    }
    bad = __syncthreads_or(bad);  // every warp's partial result is in shared memory; any bad page?

    for (int e = threadIdx.x; e < heads_per_block * HEAD; e += NUM_THREADS) {
        const int h = e / HEAD, d = e % HEAD;
        float mx = -INFINITY;
        for (int w = 0; w < NUM_WARPS; w++) mx = fmaxf(mx, warp_m[w * ROWS + h]);
        const float m_use = mx == -INFINITY ? 0.0f : mx;
        float denom = 0.0f, numer = 0.0f;
        for (int w = 0; w < NUM_WARPS; w++) {
            const float weight = exp2f(warp_m[w * ROWS + h] - m_use);
            denom += weight * warp_l[w * ROWS + h];
            numer += weight * warp_acc[(w * ROWS + h) * HEAD + d];
        }
        const long long row = (long long)seq * num_heads + head0 + h;  // (sequence, query head)
        if (num_splits == 1) {
            // no finite score at all: attend to nothing, 0, as the torch backend does
            out[row * HEAD + d] = Dtype::from_float(bad ? NAN : (denom == 0.0f ? 0.0f : numer / denom));
        } else {
            // an empty split (past the end of a shorter sequence) has denom 0: weight 0 in the merge
            part_out[(row * num_splits + split) * HEAD + d] = bad ? NAN : (denom > 0.0f ? numer / denom : 0.0f);
            if (d == 0) {
                part_ml[(row * num_splits + split) * 2] = mx;
                part_ml[(row * num_splits + split) * 2 + 1] = bad ? NAN : denom;
            }
        }
    }
}

// Pick the copy compiled for this head size and row count.
template <typename Dtype>
__device__ void entry(VLLMINI_V6_PARAMS) {
    const bool rows16 = heads_per_block > 8;
    if (head_size == 128 && (VLLMINI_ONLY_HEAD == 0 || VLLMINI_ONLY_HEAD == 128)) {
        if (!rows16) {
            if constexpr (VLLMINI_ONLY_ROWS16 != 1) attend<Dtype, 128, false>(VLLMINI_V6_ARGS);
        } else if constexpr (VLLMINI_ONLY_ROWS16 != 0) {
            attend<Dtype, 128, true>(VLLMINI_V6_ARGS);
        }
    } else if (head_size == 64 && (VLLMINI_ONLY_HEAD == 0 || VLLMINI_ONLY_HEAD == 64)) {
        if (!rows16) {
            if constexpr (VLLMINI_ONLY_ROWS16 != 1) attend<Dtype, 64, false>(VLLMINI_V6_ARGS);
        } else if constexpr (VLLMINI_ONLY_ROWS16 != 0) {
            attend<Dtype, 64, true>(VLLMINI_V6_ARGS);
        }
    } else {  // refused by the host
        for (int e = threadIdx.x; e < heads_per_block * head_size; e += blockDim.x)
            out[((long long)blockIdx.x * num_heads + blockIdx.y * heads_per_block) * head_size + e] =
                Dtype::from_float(NAN);
    }
}

// ----------------------------------------------------------------------------- entry points
// 16-bit values travel as their raw bits (unsigned short).

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_10_tensor_cores_f16(VLLMINI_V6_PARAMS) {
    entry<Float16>(VLLMINI_V6_ARGS);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_10_tensor_cores_bf16(VLLMINI_V6_PARAMS) {
    entry<BFloat16>(VLLMINI_V6_ARGS);
}

// The merge of a split context (grid (num_seqs, num_heads), any block size), as version 9's: with
// M = max_s m_s and w_s = l_s * 2^(m_s - M), out = sum_s w_s * part_out_s / sum_s w_s. A NaN part (a bad
// page) makes the row NaN.
template <typename Dtype>
__device__ void merge(unsigned short* __restrict__ out, const float* __restrict__ part_out,
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
        for (int s = 0; s < num_splits; s++)
            numer += ml[2 * s + 1] * exp2f(ml[2 * s] - m_use) * part_out[(row * num_splits + s) * head_size + d];
        out[row * head_size + d] = Dtype::from_float(denom == 0.0f ? 0.0f : numer / denom);  // NaN stays NaN
    }
}

extern "C" __global__ void paged_attention_10_tensor_cores_merge_f16(unsigned short* __restrict__ out,
                                                                    const float* __restrict__ part_out,
                                                                    const float* __restrict__ part_ml,
                                                                    const int num_splits, const int head_size) {
    merge<Float16>(out, part_out, part_ml, num_splits, head_size);
}

extern "C" __global__ void paged_attention_10_tensor_cores_merge_bf16(unsigned short* __restrict__ out,
                                                                     const float* __restrict__ part_out,
                                                                     const float* __restrict__ part_ml,
                                                                     const int num_splits, const int head_size) {
    merge<BFloat16>(out, part_out, part_ml, num_splits, head_size);
}
