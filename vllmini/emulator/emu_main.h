// emu_main.h: main() of the checked-mode executable (built with -fsanitize=address).
//
// Python writes a spec file and one file per memory region (buffers that overlap in memory, such as one
// tensor passed twice, form one region, so they share one allocation here as they do on the GPU). This
// program gives every region its own allocation with poisoned guard space on both sides, as large as the
// region itself (at least 64 KiB, at most 64 MiB), so an index that overshoots by up to a whole buffer
// still lands in poison and not in a neighbour. It prints where each buffer argument lives, launches the
// kernel, and writes the regions the kernel may have changed back to their files. An out-of-bounds access
// makes ASan print a report (with the kernel line) and exit; a kernel error (deadlock, bad mask, the time
// limit, ...) prints "emu-kernel-error: <message>" and exits with status 3.
//
// Spec: KERNEL GRIDx3 BLOCKx3 SCHEDULE SEED TIME_LIMIT_MS NUM_REGIONS NUM_ARGS, then one line per region
// "NBYTES INFILE OUTFILE|-", then one line per argument: "buffer REGION OFFSET NBYTES", "null", or
// "scalar NBYTES HEX".
#include <sanitizer/asan_interface.h>

static char* guarded_alloc(size_t size) {
    size_t guard = std::min<size_t>(std::max<size_t>(size, 65536), size_t(64) << 20);
    guard = (guard + 63) & ~size_t(63);
    char* base = static_cast<char*>(malloc(size + 2 * guard));
    if (!base) { fprintf(stderr, "emu: out of memory for a %zu-byte buffer\n", size); exit(2); }
    ASAN_POISON_MEMORY_REGION(base, guard);
    ASAN_POISON_MEMORY_REGION(base + guard + size, guard);
    return base + guard;
}

[[noreturn]] static void bad_spec(const char* what) {
    fprintf(stderr, "emu: bad spec (%s)\n", what);
    exit(2);
}

struct Region { char* data; size_t size; std::string out; };

static Region read_region(FILE* spec) {
    char in[4096], out[4096];
    unsigned long long size = 0;
    if (fscanf(spec, "%llu %4095s %4095s", &size, in, out) != 3) bad_spec("region");
    Region region{guarded_alloc(size), size, strcmp(out, "-") ? out : ""};
    FILE* f = fopen(in, "rb");
    if (!f || fread(region.data, 1, size, f) != size) bad_spec("cannot read a buffer");
    fclose(f);
    return region;
}

// One argument: *value is what the kernel gets (a pointer to the pointer, or to the scalar's bytes).
static void read_arg(FILE* spec, int i, const std::vector<Region>& regions, void** value, void** pointer) {
    char kind[16];
    unsigned long long a = 0, b = 0, size = 0;
    if (fscanf(spec, "%15s", kind) != 1) bad_spec("argument");
    if (!strcmp(kind, "buffer")) {  // buffer REGION OFFSET NBYTES
        if (fscanf(spec, "%llu %llu %llu", &a, &b, &size) != 3 || a >= regions.size()) bad_spec("buffer");
        *pointer = regions[a].data + b;
        fprintf(stderr, "emu-buffer %d %p %llu\n", i, *pointer, size);
        *value = pointer;
    } else if (!strcmp(kind, "null")) {
        *pointer = nullptr;
        *value = pointer;
    } else {  // scalar NBYTES HEX
        char hex[64];
        if (fscanf(spec, "%llu %63s", &size, hex) != 2 || size > 16) bad_spec("scalar");
        auto* bytes = static_cast<unsigned char*>(calloc(1, 16));
        for (unsigned long long k = 0; k < size; ++k) sscanf(hex + 2 * k, "%2hhx", &bytes[k]);
        *value = bytes;
    }
}

static unsigned long long time_limit_ms = 0;
static void* watchdog(void*) {  // stops the launch at the time limit; the process ends first otherwise
    timespec wait{static_cast<time_t>(time_limit_ms / 1000), static_cast<long>(time_limit_ms % 1000) * 1000000};
    while (nanosleep(&wait, &wait) != 0) {}
    emu_stop(1, __emu::TIME_LIMIT);
    return nullptr;
}

int main(int argc, char** argv) {
    FILE* spec = argc == 2 ? fopen(argv[1], "r") : nullptr;
    if (!spec) bad_spec("usage: emu SPEC");
    int kernel = 0, schedule = 0, num_regions = 0, num_args = 0;
    unsigned long long seed = 0;
    unsigned int grid[3], block[3];
    if (fscanf(spec, "%d %u %u %u %u %u %u %d %llu %llu %d %d", &kernel, &grid[0], &grid[1], &grid[2], &block[0],
               &block[1], &block[2], &schedule, &seed, &time_limit_ms, &num_regions, &num_args) != 12)
        bad_spec("header");
    std::vector<Region> regions;
    for (int r = 0; r < num_regions; ++r) regions.push_back(read_region(spec));
    std::vector<void*> values(num_args), pointers(num_args);
    for (int i = 0; i < num_args; ++i) read_arg(spec, i, regions, &values[i], &pointers[i]);
    fclose(spec);
    pthread_t timer;
    if (time_limit_ms > 0) pthread_create(&timer, nullptr, watchdog, nullptr);
    if (emu_launch(kernel, values.data(), grid, block, schedule, seed, 1) != 0) {
        fprintf(stderr, "emu-kernel-error: %s\n", emu_error());
        return 3;
    }
    for (const Region& region : regions) {
        if (region.out.empty()) continue;
        FILE* f = fopen(region.out.c_str(), "wb");
        if (!f || fwrite(region.data, 1, region.size, f) != region.size) bad_spec("cannot write an output");
        fclose(f);
    }
    return 0;
}
