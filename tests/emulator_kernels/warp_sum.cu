// warp_sum.cu: the correct twin of kernels/bugs/warp_sum_wrong_mask.cu (test kernel for the emulator).
//   out[w] = sum_{l < 32} x[32 * w + l];  x [32 * num_warps] float32, out [num_warps] float32
// Launch: block = (threads,) with threads a multiple of 32. Also a butterfly (xor) version that leaves
// the sum in every lane.
extern "C" __global__ void warp_sum(
    float* __restrict__ out,      // [num_warps]
    const float* __restrict__ x)  // [32 * num_warps]
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    for (int offset = 16; offset > 0; offset >>= 1)
        v += __shfl_down_sync(0xffffffff, v, offset);
    if ((threadIdx.x & 31) == 0) out[i / 32] = v;
}

extern "C" __global__ void warp_allsum(
    float* __restrict__ out,      // [32 * num_warps]: every lane gets its warp's sum
    const float* __restrict__ x)  // [32 * num_warps]
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    for (int mask = 16; mask > 0; mask >>= 1)
        v += __shfl_xor_sync(0xffffffff, v, mask);
    out[i] = v;
}
