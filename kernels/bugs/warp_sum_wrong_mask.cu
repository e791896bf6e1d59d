// warp_sum_wrong_mask.cu: a TEACHING kernel with a planted bug. Do not use it; kernels/ holds the real ones.
//
// What it computes: the sum of each warp's 32 values, by a shuffle-down tree inside the warp:
//   out[w] = sum_{l < 32} x[32 * w + l]
// Shapes: x [32 * num_warps] float32, out [num_warps] float32.
// Launch: grid = (num_warps * 32 / threads,), block = (threads,) with threads a multiple of 32.
//
// THE BUG: the shuffles name only lanes 0..15 in their mask (0x0000ffff), yet all 32 lanes execute them
// and lane 0 reads lane 16 in the first step. CUDA leaves that undefined: on a GPU it usually still
// gives the right sum, so the bug hides until a compiler or GPU generation changes. vllmini.emulator
// raises KernelError on every run: a lane calls a collective whose mask leaves itself out, or a lane
// reads a lane that is not in the mask. The fix (tests/emulator_kernels/warp_sum.cu): mask 0xffffffff.
extern "C" __global__ void warp_sum(
    float* __restrict__ out,      // [num_warps]
    const float* __restrict__ x)  // [32 * num_warps]
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    for (int offset = 16; offset > 0; offset >>= 1)
        v += __shfl_down_sync(0x0000ffff, v, offset);  // BUG: should be 0xffffffff
    if ((threadIdx.x & 31) == 0) out[i / 32] = v;
}
