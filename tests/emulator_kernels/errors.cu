// errors.cu: kernels that break CUDA's rules in ways the emulator must report (tests/test_emulator.py).

// threads >= n return early, the rest wait at a barrier that the returned threads never reach
extern "C" __global__ void early_return_barrier(float* __restrict__ out, const int n) {
    __shared__ float s[256];
    const int t = threadIdx.x;
    if (t >= n) return;
    s[t] = (float)t;
    __syncthreads();
    out[t] = s[n - 1 - t];
}

// the two halves of the block wait at different __syncthreads() calls
extern "C" __global__ void divergent_barrier(float* __restrict__ out) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.0f;
}

// odd and even lanes call different collectives with the same mask
extern "C" __global__ void mismatched_collectives(float* __restrict__ out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x & 1) v = __shfl_xor_sync(0xffffffffu, v, 1);
    else v = __shfl_down_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}

// lane 5 exits, the rest shuffle with a full mask
extern "C" __global__ void exited_lane_in_mask(float* __restrict__ out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);
}

// a kernel assert
extern "C" __global__ void failing_assert(const int* __restrict__ x) {
    assert(x[threadIdx.x] >= 0);
}

// reads far outside the buffer: a segmentation fault on a real machine
extern "C" __global__ void wild_read(const float* __restrict__ x, float* __restrict__ out, const long long index) {
    out[threadIdx.x] = x[index];
}

// a local array far larger than the fiber stack
extern "C" __global__ void huge_local_array(float* __restrict__ out, const int n) {
    volatile float big[1 << 20];  // 4 MiB
    for (int i = 0; i < n; ++i) big[i] = (float)i;
    out[threadIdx.x] = big[n - 1];
}
