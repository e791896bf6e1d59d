// basics.cu: small correct kernels that exercise the emulator's CUDA subset (tests/test_emulator.py).

// out[i] = x[i] + y[i], i < n; any 1-D launch
extern "C" __global__ void vector_add(const float* __restrict__ x, const float* __restrict__ y,
                                      float* __restrict__ out, const int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + y[i];
}

// out[b] = sum of x[b * blockDim.x : (b + 1) * blockDim.x] in float64, block a power of two <= 512
extern "C" __global__ void block_sum(const double* __restrict__ x, double* __restrict__ out) {
    __shared__ double s[512];
    const int t = threadIdx.x;
    s[t] = x[blockIdx.x * blockDim.x + t];
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (t < k) s[t] += s[t + k];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

// out[b, :] = x[b, :] reversed, through dynamic shared memory (shared_mem = blockDim.x * 4 bytes)
extern "C" __global__ void reverse_rows(const int* __restrict__ x, int* __restrict__ out) {
    extern __shared__ int buf[];
    const int t = threadIdx.x, n = blockDim.x;
    buf[t] = x[blockIdx.x * n + t];
    __syncthreads();
    out[blockIdx.x * n + t] = buf[n - 1 - t];
}

// hist[v] += 1 for every v in values (v < num_bins); total[0] += sum of values as float; max_seen[0] = max
extern "C" __global__ void histogram(const int* __restrict__ values, const int n, int* __restrict__ hist,
                                     float* __restrict__ total, int* __restrict__ max_seen) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    atomicAdd(&hist[values[i]], 1);
    atomicAdd(total, (float)values[i]);
    atomicMax(max_seen, values[i]);
}

// a 2-D launch: out[y, x] = 1000 * (blockIdx.y * blockDim.y + threadIdx.y) + blockIdx.x * blockDim.x + threadIdx.x
extern "C" __global__ void coords(int* __restrict__ out, const int width) {
    const int xx = blockIdx.x * blockDim.x + threadIdx.x, yy = blockIdx.y * blockDim.y + threadIdx.y;
    out[yy * width + xx] = 1000 * yy + xx;
}

// votes and broadcasts: per warp, ballot of x > 0, count, and lane 0's value broadcast to every lane
extern "C" __global__ void warp_votes(const float* __restrict__ x, unsigned int* __restrict__ ballots,
                                      int* __restrict__ any_all, float* __restrict__ bcast) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int b = __ballot_sync(0xffffffffu, x[i] > 0.0f);
    const int a = __any_sync(0xffffffffu, x[i] > 0.0f), l = __all_sync(0xffffffffu, x[i] > 0.0f);
    const float v0 = __shfl_sync(0xffffffffu, x[i], 0);
    if ((threadIdx.x & 31) == 0) { ballots[i / 32] = b; any_all[2 * (i / 32)] = a; any_all[2 * (i / 32) + 1] = l; }
    bcast[i] = v0;
}

// fp16/bf16 round trip and math intrinsics: out[i] = (float)half(x[i]), (float)bf16(x[i]), __expf, rsqrtf
extern "C" __global__ void conversions(const float* __restrict__ x, __half* __restrict__ h,
                                       __nv_bfloat16* __restrict__ b, float* __restrict__ out, const int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    h[i] = __float2half(x[i]);
    b[i] = __float2bfloat16(x[i]);
    out[4 * i] = __half2float(h[i]);
    out[4 * i + 1] = __bfloat162float(b[i]);
    out[4 * i + 2] = __expf(fminf(x[i], 10.0f));
    out[4 * i + 3] = fmaxf(rsqrtf(fabsf(x[i]) + 1.0f), -INFINITY);
}

// reads shared memory that nobody wrote: shows the poison (NaN) the emulator fills it with
extern "C" __global__ void read_unwritten_shared(float* __restrict__ out) {
    __shared__ float s[64];
    if (threadIdx.x == 0) s[0] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = s[threadIdx.x];
}

// reads dynamic shared memory before anything is written: every value is the poison (NaN)
extern "C" __global__ void read_unwritten_dynamic(float* __restrict__ out) {
    extern __shared__ float dyn[];
    out[blockIdx.x * blockDim.x + threadIdx.x] = dyn[threadIdx.x];
    __syncthreads();
    dyn[threadIdx.x] = 1.0f;  // written only after the read: the next block must see NaN again
}
