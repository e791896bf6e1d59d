// block_sum.cu -- a sum over a thread block through shared memory (notebook 05a).
//     out[b] = x[b * blockDim.x] + ... + x[b * blockDim.x + blockDim.x - 1]
//
// Each thread writes its element to shared memory (one array the whole block sees), then a tree of
// halvings adds the upper half onto the lower half until scratch[0] holds the sum: 128 -> 64 -> ... -> 1
// values. __syncthreads() between the steps makes every thread wait until all writes of the step are
// done; without it a thread may read a slot its neighbour has not written yet. The same reduction
// finds the softmax's max and sum in kernels/paged_attention_1_plain.cu.
//
// Shapes: x float32 [num_blocks * threads], out float32 [num_blocks]. Launch: grid = (num_blocks,),
// block = (threads,) with threads a power of two <= 1024, shared_mem = threads * 4 bytes.

extern "C" __global__ void block_sum(const float* x, float* out) {
    extern __shared__ float scratch[];  // [blockDim.x], sized at launch
    const int tid = threadIdx.x;
    scratch[tid] = x[blockIdx.x * blockDim.x + tid];
    __syncthreads();  // every thread's value is in scratch
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (tid < half) scratch[tid] += scratch[tid + half];
        __syncthreads();  // this step's sums are written before the next step reads them
    }
    if (tid == 0) out[blockIdx.x] = scratch[0];
}
