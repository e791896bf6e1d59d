// warp_sum.cu -- a sum over the 32 threads of a warp with register shuffles (notebook 05a).
//     out[i] = sum of x over the warp of thread i  (every lane gets the sum)
//
// __shfl_xor_sync(0xffffffff, v, k) gives each lane the value v of lane (lane ^ k), straight from that
// lane's registers: no shared memory, no __syncthreads(). Five steps with k = 16, 8, 4, 2, 1 (the
// "butterfly") leave the sum of all 32 values in every lane. The mask 0xffffffff says all 32 lanes take
// part. The scores of kernels/paged_attention_2_... and later are summed this way.
//
// Shapes: x, out float32 [num_warps * 32]. Launch: grid = (num_blocks,), block = (threads,) with
// threads a multiple of 32; no shared memory.

extern "C" __global__ void warp_sum(const float* x, float* out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    for (int k = 16; k > 0; k /= 2)              // 16, 8, 4, 2, 1
        v += __shfl_xor_sync(0xffffffff, v, k);  // add the value of lane (lane ^ k)
    out[i] = v;
}
