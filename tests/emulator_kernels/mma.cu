// mma.cu: one mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16} per warp, its fragments loaded from plain
// row-major matrices by the PTX ISA's layout (test kernel for the emulator's model, emu_mma.h; on a GPU
// the same source checks the layout against the hardware).
//   d [warps, 16, 8] float32 = a [warps, 16, 16] (16-bit bits) . b [warps, 16, 8] (16-bit bits) + c [warps, 16, 8]
// Launch: block = 32 * warps threads, one block.
template <bool BF16>
__device__ __forceinline__ void mma(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2],
                                    const float (&c)[4]) {
#if defined(__VLLMINI_EMULATOR__)
    __emu::mma_m16n8k16(d, a, b, c, BF16);
#elif __CUDA_ARCH__ >= 800
    if constexpr (BF16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    __trap();
#endif
}

template <bool BF16>
__device__ void product(float* d, const unsigned short* a, const unsigned short* b, const float* c) {
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    a += w * 256, b += w * 128, c += w * 128, d += w * 128;
    auto two = [](unsigned short lo, unsigned short hi) { return (unsigned int)lo | ((unsigned int)hi << 16); };
    // A row-major 16x16: rows g / g + 8, columns 2t, 2t + 1 / 2t + 8, 2t + 9
    const unsigned int fa[4] = {two(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]),
                                two(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]),
                                two(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]),
                                two(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9])};
    // B 16x8 (k, n): rows 2t, 2t + 1 / 2t + 8, 2t + 9 of column g
    const unsigned int fb[2] = {two(b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]),
                                two(b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g])};
    // C, D 16x8: row g / g + 8, columns 2t, 2t + 1
    const float fc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
    float fd[4];
    mma<BF16>(fd, fa, fb, fc);
    d[g * 8 + 2 * t] = fd[0], d[g * 8 + 2 * t + 1] = fd[1];
    d[(g + 8) * 8 + 2 * t] = fd[2], d[(g + 8) * 8 + 2 * t + 1] = fd[3];
}

extern "C" __global__ void mma_f16(float* d, const unsigned short* a, const unsigned short* b, const float* c) {
    product<false>(d, a, b, c);
}

extern "C" __global__ void mma_bf16(float* d, const unsigned short* a, const unsigned short* b, const float* c) {
    product<true>(d, a, b, c);
}

// A lane that skips the product: the warp-wide instruction is then undefined; the emulator says so.
extern "C" __global__ void mma_divergent(float* d, const unsigned short* a, const unsigned short* b, const float* c) {
    if (threadIdx.x % 32 != 5) product<false>(d, a, b, c);
}
