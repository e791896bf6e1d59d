// emu_check.h: bounds and race checks on every memory access of kernel code (included by emu_runtime.h).
//
// The in-process library is compiled with -fsanitize=thread, but WITHOUT ThreadSanitizer's runtime: the
// compiler still puts a call to __tsan_readN / __tsan_writeN(address) before every load and store it cannot
// prove private to a function, and this header defines those functions. The runtime's own code runs with
// `checking` off, so only the kernel's accesses (and the inline CUDA helpers it calls) are looked at.
//
// Bounds (every launch): an access must lie inside one buffer argument (a write: a buffer the kernel may
//   write, that is a non-const pointer), the block's shared memory, the thread's own stack or the library's
//   static data (__device__ / __constant__ variables, string literals). Anything else stops the launch
//   BEFORE the access happens, naming the thread, the address and the nearest buffer; Python turns the
//   return address into the kernel line. An argument passed as a raw address has no known extent: then
//   bounds are not checked for that launch.
// Races (racecheck launches): a shadow cell per byte of every buffer and of shared memory remembers the
//   last write and the last two reads (thread, sync time, return address). Two accesses to one byte by
//   two threads of a block, at least one a write, neither atomic, race unless a __syncthreads() or a warp
//   collective that both threads took part in (__syncwarp, a shuffle, a vote) came between them. Not
//   modelled: races between blocks (blocks run one after another), __threadfence, the order of blocks,
//   atomics mixed with plain accesses of the same byte, __device__ globals, and memory touched by C library
//   calls (memcpy, printf).
#pragma once

namespace __emu {

enum CheckBits { CHECK_BOUNDS = 1, CHECK_RACES = 2 };
// the last write and last two reads (by two different threads) of one byte; time 0 = none
struct Cell {
    uint32_t write_time, read_time[2];
    uint32_t write_pc, read_pc[2];  // return addresses, as offsets into this library
    uint16_t write_thread, read_thread[2], unused;
};
struct Span {  // memory the kernel may touch
    uintptr_t lo = 0, hi = 0;
    bool writable = false;
    bool shared = false;     // the block's shared memory (else a buffer argument or static data)
    Cell* shadow = nullptr;  // racecheck launches: one cell per byte (buffers and shared memory only)
};
constexpr int MAX_SPANS = 64;

inline int checks_asked = 0;  // what Python asked for the next launch (CheckBits)
inline Span spans[MAX_SPANS];
inline int n_spans = 0, n_buffers = 0;
inline unsigned char site_span[1024];  // per access site (hashed return address): the span it last touched
inline uintptr_t stack_lo = 0, stack_hi = 0;  // the running thread's fiber stack
inline uintptr_t module_base = 0;             // where this library is loaded (return addresses -> offsets)
inline uint32_t sync_time = 1, barrier_time = 1;  // sync events so far; the last __syncthreads() (or block start)
inline uint32_t* warp_sync = nullptr;  // [thread * 32 + lane]: sync time of the last collective both were in

// While a runtime function called from kernel code runs (a barrier, a collective, printf), nothing is checked.
struct Unchecked {
    int saved = checking;
    EMU_UNCHECKED Unchecked() { checking = 0; }
    EMU_UNCHECKED ~Unchecked() { checking = saved; }
};

EMU_UNCHECKED inline uint32_t pc_offset(const void* pc) {
    return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(pc) - module_base);
}

EMU_UNCHECKED inline Span* find_span(uintptr_t a, size_t size, bool write, unsigned char& cached) {
    Span* inside = nullptr;
    for (int i = 0; i < n_spans; ++i) {
        Span* s = &spans[i];
        if (a < s->lo || a + size > s->hi) continue;
        if (s->writable || !write) {
            cached = static_cast<unsigned char>(i);
            return s;
        }
        inside = s;
    }
    return inside;  // inside a buffer the kernel may not write (or nullptr: outside everything)
}

[[noreturn]] EMU_UNCHECKED void out_of_bounds(uintptr_t a, size_t size, bool write, const void* pc, bool const_buffer);
[[noreturn]] EMU_UNCHECKED void race(const Span* s, uintptr_t a, bool write, const void* pc, int other, bool other_wrote,
                                     uint32_t other_pc);

// Were thread `other`'s access at sync time `t` and the running thread's access now ordered?
EMU_UNCHECKED inline bool ordered(int me, int other, uint32_t t) {
    if (t < barrier_time || other == me) return true;
    return (other >> 5) == (me >> 5) && warp_sync[me * 32 + (other & 31)] > t;
}

EMU_UNCHECKED inline void race_check(const Span* s, uintptr_t a, size_t size, bool write, const void* pc, int me) {
    Cell* cells = s->shadow + (a - s->lo);
    const uint32_t now = sync_time, here = pc_offset(pc);
    for (size_t i = 0; i < size; ++i) {
        Cell& c = cells[i];
        if (c.write_time && !ordered(me, c.write_thread, c.write_time))
            race(s, a + i, write, pc, c.write_thread, true, c.write_pc);
        if (write) {
            for (int r = 0; r < 2; ++r)
                if (c.read_time[r] && !ordered(me, c.read_thread[r], c.read_time[r]))
                    race(s, a + i, write, pc, c.read_thread[r], false, c.read_pc[r]);
            c.write_time = now, c.write_thread = static_cast<uint16_t>(me), c.write_pc = here;
        } else {
            if (c.read_time[0] && c.read_thread[0] != me) {  // keep the last reader that is not me
                c.read_time[1] = c.read_time[0], c.read_thread[1] = c.read_thread[0], c.read_pc[1] = c.read_pc[0];
            }
            c.read_time[0] = now, c.read_thread[0] = static_cast<uint16_t>(me), c.read_pc[0] = here;
        }
    }
}

// Every checked access goes through here (atomic: bounds only, never a race).
EMU_UNCHECKED inline void access(const void* p, size_t size, bool write, const void* pc, bool atomic = false) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    unsigned char& cached = site_span[(reinterpret_cast<uintptr_t>(pc) >> 2) & 1023];  // one site: one span, mostly
    Span* s = &spans[cached];
    if (!(a >= s->lo && a + size <= s->hi && (s->writable || !write))) {
        if (a >= stack_lo && a + size <= stack_hi) return;  // the thread's own locals: private, never a race
        s = find_span(a, size, write, cached);
        if (s == nullptr || (write && !s->writable)) {
            if (checking & CHECK_BOUNDS) out_of_bounds(a, size, write, pc, s != nullptr);
            return;
        }
    }
    if ((checking & CHECK_RACES) && s->shadow && !atomic) race_check(s, a, size, write, pc, static_cast<Fiber*>(cur)->lin);
}

EMU_UNCHECKED void check_atomic(const void* p, size_t size, const void* pc) {
    if (checking) access(p, size, true, pc, true);
}

// A sync event: a barrier released (every thread of the block), or a collective completed (the lanes of mask).
EMU_UNCHECKED inline void on_barrier() { barrier_time = ++sync_time; }
EMU_UNCHECKED inline void on_collective(int base, unsigned int mask) {
    if (!warp_sync) return;
    const uint32_t t = ++sync_time;
    for (int a = 0; a < 32; ++a)
        if ((mask >> a) & 1u)
            for (int b = 0; b < 32; ++b)
                if ((mask >> b) & 1u) warp_sync[(base + a) * 32 + b] = t;
}

}  // namespace __emu

// ---- the hooks the compiler calls before each access (see the top of this file)
#define EMU_HOOKS(N)                                                                                              \
    extern "C" EMU_UNCHECKED void __tsan_read##N(void* p) {                                                       \
        if (__emu::checking) __emu::access(p, N, false, __builtin_return_address(0));                             \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED void __tsan_write##N(void* p) {                                                      \
        if (__emu::checking) __emu::access(p, N, true, __builtin_return_address(0));                              \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED void __tsan_unaligned_read##N(void* p) {                                             \
        if (__emu::checking) __emu::access(p, N, false, __builtin_return_address(0));                             \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED void __tsan_unaligned_write##N(void* p) {                                            \
        if (__emu::checking) __emu::access(p, N, true, __builtin_return_address(0));                              \
    }
EMU_HOOKS(1)
EMU_HOOKS(2)
EMU_HOOKS(4)
EMU_HOOKS(8)
EMU_HOOKS(16)
#undef EMU_HOOKS
extern "C" EMU_UNCHECKED void __tsan_read_range(void* p, unsigned long size) {
    if (__emu::checking) __emu::access(p, size, false, __builtin_return_address(0));
}
extern "C" EMU_UNCHECKED void __tsan_write_range(void* p, unsigned long size) {
    if (__emu::checking) __emu::access(p, size, true, __builtin_return_address(0));
}
extern "C" EMU_UNCHECKED void __tsan_init() {}
extern "C" EMU_UNCHECKED void __tsan_func_entry(void*) {}
extern "C" EMU_UNCHECKED void __tsan_func_exit() {}
extern "C" EMU_UNCHECKED void __tsan_vptr_update(void**, void*) {}
extern "C" EMU_UNCHECKED void __tsan_vptr_read(void**) {}
// C++ atomics (std::atomic, __atomic builtins) in kernel or runtime code: done here, seq_cst, unchecked.
#define EMU_TSAN_ATOMICS(BITS, T)                                                                                 \
    extern "C" EMU_UNCHECKED T __tsan_atomic##BITS##_load(const volatile T* p, int) {                             \
        return __atomic_load_n(p, __ATOMIC_SEQ_CST);                                                              \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED void __tsan_atomic##BITS##_store(volatile T* p, T v, int) {                          \
        __atomic_store_n(p, v, __ATOMIC_SEQ_CST);                                                                 \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED T __tsan_atomic##BITS##_exchange(volatile T* p, T v, int) {                          \
        return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);                                                       \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED T __tsan_atomic##BITS##_fetch_add(volatile T* p, T v, int) {                         \
        return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);                                                        \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED T __tsan_atomic##BITS##_fetch_sub(volatile T* p, T v, int) {                         \
        return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST);                                                        \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED T __tsan_atomic##BITS##_fetch_and(volatile T* p, T v, int) {                         \
        return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST);                                                        \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED T __tsan_atomic##BITS##_fetch_or(volatile T* p, T v, int) {                          \
        return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);                                                         \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED T __tsan_atomic##BITS##_fetch_xor(volatile T* p, T v, int) {                         \
        return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST);                                                        \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED T __tsan_atomic##BITS##_fetch_nand(volatile T* p, T v, int) {                        \
        return __atomic_fetch_nand(p, v, __ATOMIC_SEQ_CST);                                                       \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED int __tsan_atomic##BITS##_compare_exchange_strong(volatile T* p, T* e, T v, int, int) { \
        return __atomic_compare_exchange_n(p, e, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                   \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED int __tsan_atomic##BITS##_compare_exchange_weak(volatile T* p, T* e, T v, int, int) { \
        return __atomic_compare_exchange_n(p, e, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                    \
    }                                                                                                             \
    extern "C" EMU_UNCHECKED T __tsan_atomic##BITS##_compare_exchange_val(volatile T* p, T e, T v, int, int) {    \
        __atomic_compare_exchange_n(p, &e, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                         \
        return e;                                                                                                 \
    }
EMU_TSAN_ATOMICS(8, unsigned char)
EMU_TSAN_ATOMICS(16, unsigned short)
EMU_TSAN_ATOMICS(32, unsigned int)
EMU_TSAN_ATOMICS(64, unsigned long long)
#undef EMU_TSAN_ATOMICS
extern "C" EMU_UNCHECKED void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
extern "C" EMU_UNCHECKED void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

// ---- reports: the facts go to Python through emu_error_info (see emu_entry.h), which writes the message
namespace __emu {
enum ErrorKind { ERR_OTHER = 0, ERR_BOUNDS = 1, ERR_RACE = 2, ERR_SIGNAL = 3 };
// [0] kind, [1] address, [2] size, [3] write, [4] pc, [6] the other access's pc, [8] it wrote, [9] shared
// memory, [10] a const buffer, [11] the signal. A pc is a return address (or, for a signal, the faulting
// instruction + 1) as an offset into this library; 0 = unknown.
inline unsigned long long error_info[16];

[[noreturn]] EMU_UNCHECKED inline void leave_with_error() {
    checking = 0;
    L.result = KERNEL_ERROR;
    self()->state = ST_DONE;
    to_scheduler_final();
}

// error_message: "<thread>" (out of bounds) or "<thread>|<other thread>" (race); Python writes the rest.
[[noreturn]] EMU_UNCHECKED void out_of_bounds(uintptr_t a, size_t size, bool write, const void* pc, bool const_buffer) {
    checking = 0;
    if (!L.result) {
        char where[160];
        describe_thread(where, sizeof where, self());
        memset(error_info, 0, sizeof error_info);
        error_info[4] = pc_offset(pc);
        if (reinterpret_cast<uintptr_t>(__builtin_frame_address(0)) < stack_lo) {  // the stack ran out
            snprintf(error_message, sizeof error_message,
                     "%s: stack overflow: the thread's local variables need more than the %zu KiB fiber stack "
                     "(set VLLMINI_EMULATOR_STACK_KB to more)", where, L.stack_size / 1024);
        } else {
            unsigned long long info[] = {ERR_BOUNDS, a, size, write, pc_offset(pc), 0, 0, 0, 0, 0, const_buffer};
            memcpy(error_info, info, sizeof info);
            snprintf(error_message, sizeof error_message, "%s", where);
        }
    }
    leave_with_error();
}

[[noreturn]] EMU_UNCHECKED void race(const Span* s, uintptr_t a, bool write, const void* pc, int other, bool other_wrote,
                                     uint32_t other_pc) {
    checking = 0;
    if (!L.result) {
        char where[160], other_where[160];
        describe_thread(where, sizeof where, self());
        describe_thread(other_where, sizeof other_where, &L.fibers[other]);
        unsigned long long info[] = {ERR_RACE, a, 1, write, pc_offset(pc), 0, other_pc, 0, other_wrote, s->shared};
        memset(error_info, 0, sizeof error_info);
        memcpy(error_info, info, sizeof info);
        snprintf(error_message, sizeof error_message, "%s|%s", where, other_where);
    }
    leave_with_error();
}

// Before a launch: the spans Python gave (buffers), then shared memory, static data; racecheck shadows.
// module_lo..module_hi: this library's loaded segments (0, 0 where unknown: then no bounds are checked).
EMU_UNCHECKED inline bool begin_checks(char* shared_lo, size_t shared_size, uintptr_t module_lo, uintptr_t module_hi) {
    memset(error_info, 0, sizeof error_info);
    n_spans = n_buffers;
    memset(site_span, 0, sizeof site_span);
    if (shared_lo) spans[n_spans++] = Span{reinterpret_cast<uintptr_t>(shared_lo),
                                           reinterpret_cast<uintptr_t>(shared_lo) + shared_size, true, true, nullptr};
    Dl_info self_info{};
    if (!module_base && dladdr(reinterpret_cast<void*>(&begin_checks), &self_info))
        module_base = reinterpret_cast<uintptr_t>(self_info.dli_fbase);
    if (module_hi == 0) checks_asked &= ~CHECK_BOUNDS;
    spans[n_spans++] = Span{module_lo, module_hi, true, false, nullptr};
    sync_time = barrier_time = 1;
    if (!(checks_asked & CHECK_RACES)) return true;
    for (int i = 0; i < n_spans; ++i) {
        Span& s = spans[i];
        if (i >= n_buffers && !s.shared) continue;  // static data is not race-checked
        void* p = mmap(nullptr, (s.hi - s.lo) * sizeof(Cell), PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            snprintf(error_message, sizeof error_message, "racecheck: no memory for the shadow of a %zu-byte %s "
                     "(%zu bytes: 32 per byte); use smaller inputs", static_cast<size_t>(s.hi - s.lo),
                     s.shared ? "shared memory" : "buffer", static_cast<size_t>(s.hi - s.lo) * sizeof(Cell));
            return false;
        }
        s.shadow = static_cast<Cell*>(p);
    }
    warp_sync = static_cast<uint32_t*>(calloc(static_cast<size_t>(L.n + 32) * 32, sizeof(uint32_t)));
    return warp_sync != nullptr;
}

EMU_UNCHECKED inline void end_checks() {
    checking = 0;
    for (int i = 0; i < n_spans; ++i)
        if (spans[i].shadow) {
            munmap(spans[i].shadow, (spans[i].hi - spans[i].lo) * sizeof(Cell));
            spans[i].shadow = nullptr;
        }
    free(warp_sync);
    warp_sync = nullptr;
}
}  // namespace __emu
