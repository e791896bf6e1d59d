// run_order.cu -- in which order do the threads run? (notebook 05a, the emulator section)
//     before[t] = how many threads got to the first line before thread t; after[t] the same after the barrier
//
// atomicAdd(counter, 1) adds 1 to *counter and returns the old value, as one indivisible step, so no two
// threads get the same number: it numbers the threads in the order they arrive. On a GPU that order
// changes from run to run; on vllmini.emulator it is fixed by the schedule (in order, reversed, or a
// seeded random order): blocks one after another, and inside a block every thread runs until the barrier.
//
// Shapes: counter int32 [1] (zero before the launch), before, after int32 [num_blocks * threads].
// Launch: grid = (num_blocks,), block = (threads,); no shared memory.

extern "C" __global__ void run_order(int* counter, int* before, int* after) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    before[t] = atomicAdd(counter, 1);  // the how-manieth thread to arrive here
    __syncthreads();                    // wait for the whole block
    after[t] = atomicAdd(counter, 1);
}
