// paged_gather.cu: the correct twin of kernels/bugs/paged_gather_oob.cu (test kernel for the emulator).
//   out[t, :] = key_cache[block_table[t / block_size], t % block_size, kv_head, :]   for t < seq_len
// key_cache [num_blocks, block_size, num_kv_heads, head_size] float32; block_table [max_blocks] int32;
// out [seq_len, head_size] float32. Launch: grid = (seq_len,), block = (head_size,).
// A page id outside 0..num_blocks-1 is skipped (out keeps what it held) instead of read.
extern "C" __global__ void paged_gather(
    float* __restrict__ out,
    const float* __restrict__ key_cache,
    const int* __restrict__ block_table,
    const int num_blocks,
    const int block_size,
    const int num_kv_heads,
    const int kv_head,
    const int head_size) {
    const int t = blockIdx.x;
    const int d = threadIdx.x;
    const int page = block_table[t / block_size];
    if (page < 0 || page >= num_blocks) return;
    const long long row = ((long long)page * block_size + t % block_size) * num_kv_heads + kv_head;
    out[(long long)t * head_size + d] = key_cache[row * head_size + d];
}
