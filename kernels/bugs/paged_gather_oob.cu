// paged_gather_oob.cu: a TEACHING kernel with a planted bug. Do not use it; kernels/ holds the real ones.
//
// What it computes: the keys of ONE sequence, gathered through its block table into a contiguous array:
//   out[t, :] = key_cache[block_table[t / block_size], t % block_size, kv_head, :]   for t < seq_len
// Shapes:
//   key_cache   [num_blocks, block_size, num_kv_heads, head_size]  float32
//   block_table [max_num_blocks_per_seq]                          int32 (physical page of each logical block)
//   out         [seq_len, head_size]                              float32
// Launch: grid = (seq_len,), block = (head_size,): one block per token, one thread per dimension.
//
// THE BUG: the page id read from the block table is used without checking it against num_blocks, and
// the host skipped validating the table. A stale or corrupt entry (say 7 in a 4-page cache) makes the
// kernel read past the end of key_cache. On a GPU that silently returns whatever lies there (or faults
// far later); under vllmini.emulator's checked mode it raises OutOfBoundsError naming the line marked
// below. The fix: validate block tables on the host (vllmini.paged_attention does), and/or check
// `page < num_blocks` here.
extern "C" __global__ void paged_gather(
    float* __restrict__ out,                // [seq_len, head_size]
    const float* __restrict__ key_cache,    // [num_blocks, block_size, num_kv_heads, head_size]
    const int* __restrict__ block_table,    // [max_num_blocks_per_seq]
    const int num_blocks,
    const int block_size,
    const int num_kv_heads,
    const int kv_head,
    const int head_size) {
    const int t = blockIdx.x;
    const int d = threadIdx.x;
    const int page = block_table[t / block_size];  // BUG: no `page < num_blocks` check
    const long long row = ((long long)page * block_size + t % block_size) * num_kv_heads + kv_head;
    out[(long long)t * head_size + d] = key_cache[row * head_size + d];  // <- the out-of-bounds read
}
