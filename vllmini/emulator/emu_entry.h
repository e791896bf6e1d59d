// emu_entry.h: the C functions Python calls through ctypes (part of the generated translation unit).
// The library is built with -fvisibility=hidden and these six are the only exported symbols, so every
// kernel library keeps its own runtime state even when several are loaded into one process.
#define EMU_API __attribute__((visibility("default")))
extern "C" {
// Parameter codes of kernel k, e.g. "Pmf4;Pcf4;Si4;" (see __emu::param_code).
EMU_API const char* emu_signature(int k) {
    static std::vector<std::string> signatures;
    if (signatures.empty())
        for (const auto& entry : __emu_table) signatures.push_back(entry.signature());
    return signatures[k].c_str();
}

EMU_API const char* emu_error() { return __emu::error_message; }

// The facts behind the last error (__emu::error_info: out of bounds, race, signal), 16 numbers.
EMU_API void emu_error_info(unsigned long long* out) { memcpy(out, __emu::error_info, sizeof __emu::error_info); }

// What the next launch checks (emu_check.h's CheckBits) and the memory its buffer arguments cover:
// n regions of (start, end, writable). Returns 0, or -1 when there are too many regions to check bounds.
EMU_API int emu_set_checks(int checks, const unsigned long long* regions, int n) {
    if (n > __emu::MAX_SPANS - 2) {
        __emu::checks_asked = checks & ~__emu::CHECK_BOUNDS, __emu::n_buffers = 0;
        return -1;
    }
    for (int i = 0; i < n; ++i)
        __emu::spans[i] = __emu::Span{regions[3 * i], regions[3 * i + 1], regions[3 * i + 2] != 0, false, nullptr};
    __emu::n_buffers = n;
    __emu::checks_asked = checks;
    return 0;
}

// Run kernel k over the whole grid; args[i] points to the value of parameter i. Returns a __emu::Result:
// OK, KERNEL_ERROR, or INTERRUPTED / TIME_LIMIT when emu_stop(id, ...) stopped it (message: emu_error).
EMU_API int emu_launch(int k, void** args, const unsigned int* grid, const unsigned int* block, int schedule,
                       unsigned long long seed, unsigned long long id) {
    int result = __emu::launch(__emu_table[k].entry, args, grid, block, schedule, seed, id);
    fflush(stdout);  // the kernel's printf output appears now, not whenever the C buffer fills
    return result;
}

// From any OS thread: stop launch `id` with reason 2 (INTERRUPTED) or 3 (TIME_LIMIT), within
// microseconds, even if one of its threads spins forever; a launch that has not started yet stops at once.
EMU_API void emu_stop(unsigned long long id, int reason) { __emu::request_stop(id, reason); }
}
