// normalize_missing_sync.cu: a TEACHING kernel with a planted bug. Do not use it; kernels/ holds the real ones.
//
// What it computes: each row divided by its sum (the last step of a softmax):
//   out[row, t] = x[row, t] / sum_j x[row, j]
// Shapes: x, out [num_rows, n] float32, n a power of two <= 1024.
// Launch: grid = (num_rows,), block = (n,), no dynamic shared memory.
// The sum is a block reduction through shared memory: each round, thread t < k adds s[t + k] into s[t].
//
// THE BUG: the loop has no __syncthreads() after each round. Thread t may read s[t + k] before thread
// t + k has added its own partner in the round before, and every thread reads the total s[0] without
// waiting for thread 0 to finish. On a GPU the answer depends on timing (it is often right in small
// tests). Under vllmini.emulator it is wrong on EVERY run and under every schedule: whichever thread runs
// first after the barrier reads s[0] before the reduction is done. The fix (tests/emulator_kernels/
// normalize.cu): put `__syncthreads();` at the end of the loop body.
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
        // BUG: missing __syncthreads();
    }
    out[row + t] = x[row + t] / s[0];
}
