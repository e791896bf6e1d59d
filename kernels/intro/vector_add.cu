// vector_add.cu -- the first kernel of the course (notebook 05a): out[i] = x[i] + y[i].
//
// Every thread runs this same function; only its coordinates differ. Thread threadIdx.x of thread
// block blockIdx.x handles element i = blockIdx.x * blockDim.x + threadIdx.x. The last block may have
// threads past the end of the arrays, so each thread checks i < n before touching memory.
//
// Shapes: x, y, out float32 [n]. Launch: grid = (ceil(n / threads),), block = (threads,), any threads
// up to 1024; no shared memory. Python, on a GPU or on the CPU (vllmini.emulator), the same call:
//     kernel = RawKernel(source, "vector_add")
//     kernel((num_blocks,), (threads,), (x, y, out, np.int32(n)))

extern "C" __global__ void vector_add(const float* x, const float* y, float* out, const int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;  // this thread's element
    if (i < n) out[i] = x[i] + y[i];
}
