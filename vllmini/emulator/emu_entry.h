// emu_entry.h: the C functions Python calls through ctypes (part of the generated translation unit).
// The library is built with -fvisibility=hidden and these five are the only exported symbols, so every
// kernel library keeps its own runtime state even when several are loaded into one process.
#define EMU_API __attribute__((visibility("default")))
extern "C" {
EMU_API int emu_kernel_count() { return static_cast<int>(sizeof(__emu_table) / sizeof(__emu_table[0])); }

EMU_API int emu_kernel_index(const char* name) {
    for (int k = 0; k < emu_kernel_count(); ++k)
        if (!strcmp(__emu_table[k].name, name)) return k;
    return -1;
}

// Parameter codes of kernel k, e.g. "Pmf4;Pcf4;Si4;" (see __emu::param_code).
EMU_API const char* emu_signature(int k) {
    static std::vector<std::string> sigs;
    if (sigs.empty())
        for (int i = 0; i < emu_kernel_count(); ++i) sigs.push_back(__emu_table[i].signature());
    return sigs[k].c_str();
}

EMU_API const char* emu_error() { return __emu::error_message; }

// Run kernel k over the whole grid. args[i] points to the value of parameter i. 0 = ok, -1 = error.
EMU_API int emu_launch(int k, void** args, const unsigned int* grid, const unsigned int* block, int schedule,
                       unsigned long long seed) {
    int rc = __emu::launch(__emu_table[k].entry, args, grid, block, schedule, seed);
    fflush(stdout);  // the kernel's printf output appears now, not whenever the C buffer fills
    return rc;
}
}
