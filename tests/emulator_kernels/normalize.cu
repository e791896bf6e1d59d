// normalize.cu: the correct twin of kernels/bugs/normalize_missing_sync.cu (test kernel for the emulator).
//   out[row, t] = x[row, t] / sum_j x[row, j];  x, out [num_rows, n] float32, n a power of two <= 1024
// Launch: grid = (num_rows,), block = (n,).
extern "C" __global__ void normalize_rows(
    float* __restrict__ out,      // [num_rows, n]
    const float* __restrict__ x,  // [num_rows, n]
    const int n) {
    __shared__ float s[1024];
    const int t = threadIdx.x;
    const long long row = (long long)blockIdx.x * n;
    s[t] = x[row + t];
    __syncthreads();
    for (int k = n / 2; k > 0; k >>= 1) {
        if (t < k) s[t] += s[t + k];
        __syncthreads();  // every round finishes before the next reads it
    }
    out[row + t] = x[row + t] / s[0];
}
