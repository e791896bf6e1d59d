// emu_main.h: main() of the checked-mode executable (built with -fsanitize=address).
//
// Python writes a spec file and one file per buffer; this program gives every buffer its own allocation
// with poisoned guard space on both sides, as large as the buffer itself (at least 64 KiB, at most
// 64 MiB), so an index that overshoots by up to a whole buffer still lands in poison and not in a
// neighbour. It prints where each buffer lives, launches the kernel, and writes the buffers the kernel
// may have changed back to their files. An out-of-bounds access
// makes ASan print a report (with the kernel line) and exit; a kernel error (deadlock, bad mask, ...)
// prints "emu-kernel-error: <message>" and exits with status 3.
#include <sanitizer/asan_interface.h>
#include <vector>

static char* guarded_alloc(size_t n) {
    size_t guard = std::min<size_t>(std::max<size_t>(n, 65536), size_t(64) << 20);
    guard = (guard + 63) & ~size_t(63);
    char* base = static_cast<char*>(malloc(n + 2 * guard));
    if (!base) { fprintf(stderr, "emu: out of memory for a %zu-byte buffer\n", n); exit(2); }
    ASAN_POISON_MEMORY_REGION(base, guard);
    ASAN_POISON_MEMORY_REGION(base + guard + n, guard);
    return base + guard;
}

static std::vector<char> read_file(const char* path) {
    std::vector<char> data;
    FILE* f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "emu: cannot read %s\n", path); exit(2); }
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) data.insert(data.end(), buf, buf + n);
    fclose(f);
    return data;
}

int main(int argc, char** argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s SPEC\n", argv[0]); return 2; }
    FILE* spec = fopen(argv[1], "r");
    if (!spec) { fprintf(stderr, "emu: cannot open %s\n", argv[1]); return 2; }
    int kernel = 0, schedule = 0, nargs = 0;
    unsigned long long seed = 0;
    unsigned int grid[3], block[3];
    if (fscanf(spec, "%d %u %u %u %u %u %u %d %llu %d", &kernel, &grid[0], &grid[1], &grid[2], &block[0], &block[1],
               &block[2], &schedule, &seed, &nargs) != 10) { fprintf(stderr, "emu: bad spec\n"); return 2; }
    std::vector<void*> values(nargs), pointers(nargs);
    std::vector<std::string> outputs(nargs);
    std::vector<size_t> sizes(nargs);
    for (int i = 0; i < nargs; ++i) {
        char kind[16], path[4096], out[4096];
        unsigned long long n = 0;
        if (fscanf(spec, "%15s", kind) != 1) return 2;
        if (!strcmp(kind, "ptr")) {  // ptr NBYTES INFILE OUTFILE|-
            if (fscanf(spec, "%llu %4095s %4095s", &n, path, out) != 3) return 2;
            std::vector<char> data = read_file(path);
            char* p = guarded_alloc(n);
            memcpy(p, data.data(), std::min<size_t>(n, data.size()));
            pointers[i] = p;
            sizes[i] = n;
            if (strcmp(out, "-")) outputs[i] = out;
            fprintf(stderr, "emu-buffer %d %p %llu\n", i, static_cast<void*>(p), n);
        } else if (!strcmp(kind, "alias")) {  // alias J: the same buffer as argument J
            int j;
            if (fscanf(spec, "%d", &j) != 1) return 2;
            pointers[i] = pointers[j];
        } else if (!strcmp(kind, "null")) {
            pointers[i] = nullptr;
        } else {  // scalar NBYTES HEX
            char hex[64];
            if (fscanf(spec, "%llu %63s", &n, hex) != 2) return 2;
            unsigned char* v = static_cast<unsigned char*>(calloc(1, 16));
            for (unsigned long long b = 0; b < n; ++b) sscanf(hex + 2 * b, "%2hhx", &v[b]);
            values[i] = v;
            continue;
        }
        values[i] = &pointers[i];
    }
    fclose(spec);
    if (emu_launch(kernel, values.data(), grid, block, schedule, seed) != 0) {
        fprintf(stderr, "emu-kernel-error: %s\n", emu_error());
        return 3;
    }
    for (int i = 0; i < nargs; ++i) {
        if (outputs[i].empty()) continue;
        FILE* f = fopen(outputs[i].c_str(), "wb");
        if (!f || fwrite(pointers[i], 1, sizes[i], f) != sizes[i]) { fprintf(stderr, "emu: cannot write output\n"); return 2; }
        fclose(f);
    }
    return 0;
}
