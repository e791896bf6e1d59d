// read_ceiling.cu -- the read ceiling: how fast a plain kernel reads global memory (HBM) on this GPU.
//
// What it computes: the XOR of every 32-bit word of `data`, into sink[0] (which the caller zeroes first).
// The answer is of no interest; it is there so that the compiler cannot drop the loads, and so that a test
// can check that every byte was read exactly once. What matters is the time: nbytes / time is the read
// bandwidth that the paged-attention kernels (which must read every byte of K and V once) are measured
// against -- the "read ceiling" of notebook 07 and benchmarks/RESULTS.md.
//
// Shapes: data uint4 [n_vec] (16-byte vectors: pass any contiguous buffer of n_vec * 16 bytes);
// sink uint32 [1].
// Launch: a grid-stride loop, so any grid works; to fill the GPU, grid = 8 blocks per SM of 256 threads
// (benchmarks/cuda_timing.py, read_ceiling_us). Each thread issues UNROLL 16-byte loads before it uses
// any, so enough bytes are in flight to cover the memory latency; a warp's loads are coalesced (lane l
// reads vector l of the warp's 512 consecutive bytes). The XOR costs one instruction per loaded word and
// one shuffle butterfly and atomic per warp at the end: nothing that slows the reading.
//
// Build: plain CUDA C++, no includes (uint4 is a built-in vector type); NVRTC through CuPy on a GPU, or
// vllmini.emulator.RawKernel on the CPU (tests/test_read_ceiling.py checks the XOR there).

#define UNROLL 4

extern "C" __global__ void read_ceiling(
    const uint4* __restrict__ data,  // [n_vec]
    const long long n_vec,
    unsigned int* __restrict__ sink)  // [1]
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0u;
    for (; i + (UNROLL - 1) * stride < n_vec; i += UNROLL * stride) {  // UNROLL loads in flight at once
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) v[u] = data[i + u * stride];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n_vec; i += stride) {  // the last, partial round
        const uint4 v = data[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    for (int offset = 16; offset > 0; offset /= 2) acc ^= __shfl_xor_sync(0xffffffffu, acc, offset);
    if ((threadIdx.x & 31) == 0) atomicXor(sink, acc);  // one atomic per warp
}
