// split_merge.cu -- notebook 07's exercise: write the split-context merge, by log-sum-exp.
//
// A long context is cut into num_splits pieces, each attended by its own thread block (version 7's split
// contexts, FlashDecoding). Piece s of a (sequence, head) row leaves three things behind:
//     m_s    the largest score in the piece (natural units: score = scale * q . k)
//     l_s    the sum over the piece of exp(score - m_s)
//     o_s    the piece's output: sum over the piece of exp(score - m_s) * v, divided by l_s   (head_size,)
// A piece with no tokens (past the end of a shorter sequence) has m_s = -INFINITY, l_s = 0, o_s = 0.
// The whole row's softmax output, by log-sum-exp: with M = max_s m_s and w_s = l_s * exp(m_s - M),
//     out = sum_s w_s * o_s / sum_s w_s
// (exp(m_s - M) <= 1, so nothing overflows however large the scores; version 7's merge kernel does the
// same in the log2 domain, with exp2f).
//
// Shapes (contiguous, float32):
//     out        [num_seqs, num_heads, head_size]
//     part_out   [num_seqs, num_heads, num_splits, head_size]   o_s
//     part_ml    [num_seqs, num_heads, num_splits, 2]           (m_s, l_s)
// Launch: grid = (num_seqs, num_heads), one thread block per row; block = (128,) (any size up to 1024
// works); no dynamic shared memory; num_splits <= MAX_SPLITS.
//
// YOUR PART: steps 1 and 2 of the kernel (look for TODO); step 3 and the barrier are given. As given,
// the file compiles and runs, but every piece gets the same weight, so the output is the plain average
// of the pieces' outputs: wrong. Check your version with
//     from vllmini.course.cuda_exercises import check_split_merge_kernel
//     check_split_merge_kernel(source)     # source: the text of this file, with your steps 1 and 2
// which runs it on the CPU emulator (checked mode, then the race detector) against a float64 reference,
// with scores in the hundreds too, where exp(m_s) on its own overflows.
// Worked solution: kernels/exercises/solutions/split_merge.cu.

#define MAX_SPLITS 256
#ifndef INFINITY  // NVRTC has no <math.h>; the bit pattern will do
#define INFINITY __int_as_float(0x7f800000)
#endif

extern "C" __global__ void split_merge(
    float* out,             // [num_seqs, num_heads, head_size]
    const float* part_out,  // [num_seqs, num_heads, num_splits, head_size]
    const float* part_ml,   // [num_seqs, num_heads, num_splits, 2]
    const int num_splits,
    const int head_size)
{
    if (num_splits > MAX_SPLITS) __trap();
    __shared__ float weight[MAX_SPLITS];  // w_s of every piece, shared by the block

    const long long row = (long long)blockIdx.x * gridDim.y + blockIdx.y;  // (sequence, head)
    const float* ml = part_ml + row * num_splits * 2;                       // (m_s, l_s) pairs
    const float* o = part_out + row * num_splits * head_size;               // [num_splits, head_size]

    // 1. M = the largest m_s (every thread finds it: num_splits values, cheap)
    float M = -INFINITY;
    // TODO: loop over the pieces and keep the largest m_s (ml[2 * s] is m_s, ml[2 * s + 1] is l_s)

    // 2. each piece's weight w_s = l_s * exp(m_s - M), one thread per piece
    for (int s = threadIdx.x; s < num_splits; s += blockDim.x) {
        weight[s] = 1.0f;  // TODO: the weight of piece s (as given, every piece counts the same: wrong)
    }
    __syncthreads();  // every weight is written before any thread reads them

    // 3. out = sum_s w_s o_s / sum_s w_s; thread tid takes dims tid, tid + blockDim.x, ...
    float total = 0.0f;
    for (int s = 0; s < num_splits; s++) total += weight[s];
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < num_splits; s++) acc += weight[s] * o[(long long)s * head_size + d];
        out[row * head_size + d] = acc / total;
    }
}
