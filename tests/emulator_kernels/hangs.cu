// hangs.cu: kernels that run too long or forever, and corners of argument passing (tests/test_emulator.py).

// thread 0 waits for thread 1's flag. Threads switch only at barriers, collectives and returns, so in
// order (thread 0 first) it spins forever; in reverse (thread 1 first) it finishes at once.
extern "C" __global__ void spin_wait(volatile int* flag) {
    if (threadIdx.x == 0) {
        while (flag[0] == 0) {
        }
    } else {
        flag[0] = 1;
    }
}

// one add per thread: with a grid of 2^31 - 1 blocks it takes hours, but never waits on anything
extern "C" __global__ void count_blocks(unsigned long long* count) { atomicAdd(count, 1ull); }

// out[i] = x[i] + 1: called with x and out the same tensor (or overlapping views of one)
extern "C" __global__ void add_one(const float* x, float* out) {
    out[threadIdx.x] = x[threadIdx.x] + 1.0f;
}

// a templated kernel anywhere in a source must not break the plain kernels around it
template <typename T>
__global__ void scale(T* x, T factor) {
    x[threadIdx.x] *= factor;
}

extern "C" __global__ void plain_after_template(float* out) { out[threadIdx.x] = 2.0f * threadIdx.x; }
