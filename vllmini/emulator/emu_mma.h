// emu_mma.h: the warp-wide tensor-core product of the PTX instruction
//     mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32   D (16x8) = A (16x16) * B (16x8) + C
// for the CPU emulator. A kernel calls it through its own wrapper (kernels/paged_attention_10_tensor_cores.cu:
// the inline PTX on a GPU, __emu::mma_m16n8k16 here). Every lane of the warp must make the call, at the
// same line, as on the GPU (.aligned): it is a warp collective here, so a divergent call is an error.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), for lane l with
// g = l / 4 (groupID) and t = l % 4 (thread in group); a 32-bit register holds two 16-bit elements, the
// lower column (A) or row (B) in its low half:
//   A, row-major 16x16:  a[0] = A[g][2t..2t+1]    a[1] = A[g+8][2t..2t+1]
//                        a[2] = A[g][2t+8..2t+9]  a[3] = A[g+8][2t+8..2t+9]
//   B, "col" 16x8:       b[0] = B[2t..2t+1][g]    b[1] = B[2t+8..2t+9][g]
//   C and D, 16x8 fp32:  c[0], c[1] = C[g][2t], C[g][2t+1]     c[2], c[3] = C[g+8][2t], C[g+8][2t+1]
// How: each lane gathers the two rows of A and the two columns of B its four outputs need, with 16
// shuffles of 8 bytes (two registers each), then sums the products in double and rounds once to float
// (the tensor core's products are exact; its fp32 accumulation order is unspecified).
#pragma once

namespace __emu {

inline float mma_element(unsigned int word, int high, bool bf16) {
    const unsigned short h = static_cast<unsigned short>(high ? word >> 16 : word & 0xffffu);
    return bf16 ? bf16_bits_to_float(h) : half_bits_to_float(h);
}

inline void mma_m16n8k16(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2], const float (&c)[4],
                         bool bf16, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    const unsigned int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int g = static_cast<int>(tid % 32) / 4, t = static_cast<int>(tid % 4);
    auto pair = [](unsigned int lo, unsigned int hi) { return lo | (static_cast<unsigned long long>(hi) << 32); };
    auto gather = [&](unsigned long long mine, int src) {
        return warp_collective(OP_SHFL_IDX, 0xffffffffu, mine, src, 32, file, line);
    };
    float rows[2][16], cols[2][16];  // A[g][k], A[g+8][k]; B[k][2t], B[k][2t+1]
    for (int s = 0; s < 4; s++) {    // the lanes 4g + s hold rows g and g+8 of A; 4n + s column n of B
        const unsigned long long r0 = gather(pair(a[0], a[2]), 4 * g + s);
        const unsigned long long r1 = gather(pair(a[1], a[3]), 4 * g + s);
        const unsigned long long c0 = gather(pair(b[0], b[1]), 4 * (2 * t) + s);
        const unsigned long long c1 = gather(pair(b[0], b[1]), 4 * (2 * t + 1) + s);
        const unsigned long long got[4] = {r0, r1, c0, c1};
        float* dst[4] = {rows[0], rows[1], cols[0], cols[1]};
        for (int i = 0; i < 4; i++) {
            const unsigned int lo = static_cast<unsigned int>(got[i]), hi = static_cast<unsigned int>(got[i] >> 32);
            dst[i][2 * s] = mma_element(lo, 0, bf16);
            dst[i][2 * s + 1] = mma_element(lo, 1, bf16);
            dst[i][2 * s + 8] = mma_element(hi, 0, bf16);
            dst[i][2 * s + 9] = mma_element(hi, 1, bf16);
        }
    }
    for (int i = 0; i < 4; i++) {  // d[i] = D[g + 8 * (i / 2)][2t + i % 2]
        double sum = c[i];
        for (int k = 0; k < 16; k++) sum += static_cast<double>(rows[i / 2][k]) * cols[i % 2][k];
        d[i] = static_cast<float>(sum);
    }
}

}  // namespace __emu
