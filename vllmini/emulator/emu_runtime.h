// emu_runtime.h: the emulator's scheduler. Included at the END of the generated translation unit, after
// cuda_emu.h, the kernel source and the generated launcher table.
//
// Execution model
//   * Blocks run one after another (x fastest, then y, then z) on the calling OS thread.
//   * Every CUDA thread of a block is a fiber: its own stack (mmap'd, with a guard page) and a saved
//     context. On x86-64 Linux a fiber switch is the 21 instructions of assembly below (save the
//     callee-saved registers and FP control words on the old stack, swap stack pointers, restore);
//     elsewhere (aarch64, macOS, or with -DEMU_UCONTEXT) it is ucontext's swapcontext, which is portable
//     but makes a system call per switch.
//   * The scheduler walks the threads in a fixed order ("in order", "reverse", or a seeded shuffle
//     redrawn on every pass) and runs each until it reaches __syncthreads(), a warp collective, or
//     returns. Nothing else switches, so a run is deterministic: a race shows up on every run.
//   * A barrier releases when every thread of the block has arrived at the same __syncthreads() line.
//     A warp collective completes when every lane named in its mask has arrived at the same collective
//     (same operation, mask and width; same line except for __syncwarp).
//   * Errors (deadlock, mismatched collectives, bad masks, a shuffle reading a lane outside the mask,
//     assert, __trap) stop the launch: the message goes back to Python, which raises KernelError.
//   * Every memory access of kernel code is checked first (emu_check.h): bounds on every launch, races
//     when asked. The runtime's own functions are EMU_UNCHECKED and use plain arrays, not std::vector.
//   * A fault inside a kernel (a fiber stack overflow into its guard page, a wild raw pointer, an integer
//     division by zero, an illegal instruction) is caught by a SIGSEGV/SIGBUS/SIGFPE/SIGILL handler on an
//     alternate stack that jumps back out of the launch, so Python gets an exception instead of a crash,
//     with the faulting instruction's kernel line (not in checked mode: AddressSanitizer reports those).
//   * Stopping: emu_stop (from another OS thread: Python's Ctrl-C handling or its time limit) sends the
//     launching thread EMU_STOP_SIGNAL, whose handler jumps out of the launch the same way, wherever the
//     launch is: even inside a thread that spins forever and never yields. Kernel printf blocks the
//     signal while stdio holds its lock, so a stop never leaves stdout locked.
//   * Shared memory is thread_local storage (one copy per OS thread = per block); before each block
//     the module's whole TLS block is filled with 0xFF bytes, so a read before the write reads NaN.
#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#ifdef EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__) && defined(__linux__) && !defined(EMU_UCONTEXT)
#define EMU_FAST_SWITCH 1
// emu_switch(save, next): push callee-saved registers and the FP control words, store the stack pointer
// in *save, load next as the stack pointer, pop the same set, return into the other fiber.
extern "C" void emu_switch(void** save, void* next) __attribute__((visibility("hidden")));
extern "C" void emu_fiber_start() __attribute__((visibility("hidden")));
extern "C" void emu_fiber_entry() __attribute__((visibility("hidden")));
asm(R"(
    .text
    .p2align 4
    .hidden emu_switch
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
    .p2align 4
    .hidden emu_fiber_start
    .globl emu_fiber_start
    .type emu_fiber_start, @function
emu_fiber_start:
    andq $-16, %rsp
    call emu_fiber_entry
    ud2
    .size emu_fiber_start, .-emu_fiber_start
)");
#endif

namespace __emu {

enum State { ST_RUN = 0, ST_BARRIER, ST_WARP, ST_DONE };
// What a launch returns to Python; INTERRUPTED and TIME_LIMIT are also the reasons emu_stop takes.
enum Result { OK = 0, KERNEL_ERROR = 1, INTERRUPTED = 2, TIME_LIMIT = 3 };

struct Fiber : ThreadView {
#ifdef EMU_FAST_SWITCH
    void* sp = nullptr;
#else
    ucontext_t ctx;
#endif
    int lin = 0;    // linear thread id: x + y * bx + z * bx * by
    int state = ST_RUN;
    // the collective or barrier this thread waits at
    int op = 0, arg = 0, width = 32, line = 0;
    unsigned int mask = 0;
    const char* file = "";
    unsigned long long value = 0, result = 0;
};

struct Launch {
    void (*entry)(void**) = nullptr;
    void** args = nullptr;
    unsigned long long id = 0;  // Python's number for this launch, which emu_stop names
    // plain arrays, not std::vector: the runtime's code is compiled without the per-access checks
    // (EMU_UNCHECKED), and a std::vector method would not be inlined into it (see emu_check.h)
    Fiber fibers[1024];       // the block's threads (CUDA allows at most 1024), n of them in use
    char* stacks[1024] = {};  // their stacks, kept for later launches; n_stacks made so far
    int n_stacks = 0;
    size_t stack_size = 0;
    int order[1024] = {};
    int n = 0, n_done = 0, n_barrier = 0;
    int result = OK;
    unsigned long long blocks_done = 0;
#ifdef EMU_FAST_SWITCH
    void* scheduler_sp = nullptr;
#else
    ucontext_t scheduler;
#endif
    unsigned long long rng = 0;
    const void* main_bottom = nullptr;  // the scheduler's stack, for AddressSanitizer's fiber bookkeeping
    size_t main_size = 0;
};
inline Launch L;
inline char error_message[4096];
inline int checking = 0;  // what the memory checks do now (emu_check.h): 0 while the runtime's code runs

EMU_UNCHECKED inline Fiber* self() { return static_cast<Fiber*>(cur); }
template <class T> struct Span_of {  // a range-for over part of an array
    T *b, *e;
    EMU_UNCHECKED T* begin() const { return b; }
    EMU_UNCHECKED T* end() const { return e; }
};
EMU_UNCHECKED inline Span_of<Fiber> fibers_in_use() { return {L.fibers, L.fibers + L.n}; }

#ifdef EMU_FAST_SWITCH
#define EMU_SWAP_TO_SCHEDULER(f) emu_switch(&(f)->sp, L.scheduler_sp)
#define EMU_SWAP_TO_FIBER(f) emu_switch(&L.scheduler_sp, (f)->sp)
#else
#define EMU_SWAP_TO_SCHEDULER(f) swapcontext(&(f)->ctx, &L.scheduler)
#define EMU_SWAP_TO_FIBER(f) swapcontext(&L.scheduler, &(f)->ctx)
#endif

EMU_UNCHECKED inline void to_scheduler() {  // a fiber gives control back to the scheduler
    Fiber* f = self();
#ifdef EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, L.main_bottom, L.main_size);
    EMU_SWAP_TO_SCHEDULER(f);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    EMU_SWAP_TO_SCHEDULER(f);
#endif
}

[[noreturn]] EMU_UNCHECKED inline void to_scheduler_final() {  // a fiber that has finished leaves for good
    Fiber* f = self();
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(nullptr, L.main_bottom, L.main_size);
#endif
    EMU_SWAP_TO_SCHEDULER(f);
    abort();  // never resumed
}

EMU_UNCHECKED inline void describe_thread(char* buf, size_t size, const Fiber* f) {
    snprintf(buf, size, "thread (%u,%u,%u) of block (%u,%u,%u) [warp %d lane %d]", f->tid.x, f->tid.y, f->tid.z,
             block_idx.x, block_idx.y, block_idx.z, f->lin / 32, f->lin % 32);
}
}  // namespace __emu
#include "emu_check.h"  // bounds and race checks of kernel code's memory accesses
namespace __emu {

EMU_UNCHECKED inline void to_fiber(Fiber* f) {  // the scheduler resumes a fiber
    cur = f;
    thread_idx = f->tid;
    stack_lo = reinterpret_cast<uintptr_t>(L.stacks[f->lin]);
    stack_hi = stack_lo + L.stack_size;
#ifdef EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, L.stacks[f->lin], L.stack_size);
    EMU_SWAP_TO_FIBER(f);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    EMU_SWAP_TO_FIBER(f);
#endif
}


// Called from inside a fiber: record the error (naming thread `who`, unless an error came first) and
// leave for good; the scheduler sees L.result and abandons the launch.
[[noreturn]] EMU_UNCHECKED inline void vfail(const Fiber* who, const char* file, int line, const char* format, va_list ap) {
    checking = 0;
    if (!L.result) {
        char msg[3072], where[160];
        vsnprintf(msg, sizeof msg, format, ap);
        describe_thread(where, sizeof where, who);
        snprintf(error_message, sizeof error_message, "%s:%d: %s: %s", file, line, where, msg);
        L.result = KERNEL_ERROR;
    }
    self()->state = ST_DONE;
    to_scheduler_final();
}
[[noreturn]] EMU_UNCHECKED inline void fail_as(const Fiber* who, const char* file, int line, const char* format, ...) {
    va_list ap;
    va_start(ap, format);
    vfail(who, file, line, format, ap);
}
[[noreturn]] EMU_UNCHECKED void fail(const char* file, int line, const char* format, ...) {
    va_list ap;
    va_start(ap, format);
    vfail(self(), file, line, format, ap);
}

EMU_UNCHECKED inline const char* op_name(int op) {
    switch (op) {
        case OP_SHFL_IDX: return "__shfl_sync";
        case OP_SHFL_UP: return "__shfl_up_sync";
        case OP_SHFL_DOWN: return "__shfl_down_sync";
        case OP_SHFL_XOR: return "__shfl_xor_sync";
        case OP_BALLOT: return "__ballot_sync";
        case OP_ANY: return "__any_sync";
        case OP_ALL: return "__all_sync";
        case OP_SYNCWARP: return "__syncwarp";
        default: return "?";
    }
}

EMU_UNCHECKED inline unsigned int active_mask() {
    Unchecked runtime;
    Fiber* f = self();
    int base = f->lin & ~31;
    unsigned int mask = 0;
    for (int lane = 0; lane < 32 && base + lane < L.n; ++lane)
        if (L.fibers[base + lane].state != ST_DONE) mask |= 1u << lane;
    return mask;
}

// Complete the collective that thread f just arrived at, if every lane of its mask is there.
EMU_UNCHECKED inline void try_complete_collective(Fiber* f) {
    const int base = f->lin & ~31, lane = f->lin & 31;
    for (int l = 0; l < 32; ++l) {
        if (!((f->mask >> l) & 1u)) continue;
        if (base + l >= L.n)
            fail(f->file, f->line, "%s with mask 0x%08x names lane %d, but the block has only %d threads", op_name(f->op),
                 f->mask, l, L.n);
        Fiber* g = &L.fibers[base + l];
        if (g->state == ST_DONE)
            fail(f->file, f->line, "%s with mask 0x%08x names lane %d, which has already exited", op_name(f->op), f->mask, l);
        if (g->state != ST_WARP) return;  // not there yet
        bool same = g->op == f->op && g->mask == f->mask && g->width == f->width &&
                    (f->op == OP_SYNCWARP || (g->line == f->line && !strcmp(g->file, f->file)));
        if (!same)
            fail(f->file, f->line,
                 "lanes of one mask are at different warp collectives: lane %d is at %s(mask 0x%08x, width %d) "
                 "line %d, lane %d is at %s(mask 0x%08x, width %d) line %d",
                 lane, op_name(f->op), f->mask, f->width, f->line, l, op_name(g->op), g->mask, g->width, g->line);
    }
    // everyone is here: compute each lane's result
    on_collective(base, f->mask);
    unsigned int votes = 0;
    for (int l = 0; l < 32; ++l)
        if (((f->mask >> l) & 1u) && L.fibers[base + l].value) votes |= 1u << l;
    const int w = f->width;
    for (int l = 0; l < 32; ++l) {
        if (!((f->mask >> l) & 1u)) continue;
        Fiber* g = &L.fibers[base + l];
        int seg = l & ~(w - 1), src = l;
        switch (g->op) {
            case OP_SHFL_IDX: src = seg + (g->arg & (w - 1)); break;
            case OP_SHFL_UP: src = (l - seg) >= g->arg ? l - g->arg : l; break;
            case OP_SHFL_DOWN: src = (l - seg) + g->arg < w ? l + g->arg : l; break;
            case OP_SHFL_XOR: src = ((l ^ g->arg) & 31) < seg + w ? ((l ^ g->arg) & 31) : l; break;
            default: break;
        }
        switch (g->op) {
            case OP_SHFL_IDX: case OP_SHFL_UP: case OP_SHFL_DOWN: case OP_SHFL_XOR:
                if (!((f->mask >> src) & 1u))
                    fail_as(g, g->file, g->line, "%s(mask 0x%08x) reads lane %d, which is not in the mask",
                            op_name(g->op), g->mask, src);
                g->result = L.fibers[base + src].value;
                break;
            case OP_BALLOT: g->result = votes; break;
            case OP_ANY: g->result = votes != 0; break;
            case OP_ALL: g->result = votes == f->mask; break;
            default: g->result = 0;
        }
    }
    for (int l = 0; l < 32; ++l)
        if ((f->mask >> l) & 1u) L.fibers[base + l].state = ST_RUN;
}

EMU_UNCHECKED unsigned long long warp_collective(int op, unsigned int mask, unsigned long long value, int arg, int width,
                                   const char* file, int line) {
    Unchecked runtime;
    Fiber* f = self();
    const int lane = f->lin & 31;
    f->file = file;
    f->line = line;
    if (!((mask >> lane) & 1u))
        fail(file, line, "%s called with mask 0x%08x, which does not include the caller's own lane %d", op_name(op), mask,
             lane);
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail(file, line, "%s width %d is not a power of two between 1 and 32", op_name(op), width);
    f->op = op;
    f->mask = mask;
    f->value = value;
    f->arg = arg;
    f->width = width;
    f->state = ST_WARP;
    try_complete_collective(f);
    if (f->state == ST_WARP) to_scheduler();
    return f->result;
}

EMU_UNCHECKED inline void try_release_barrier(Fiber* f) {
    if (L.n_barrier + L.n_done < L.n) return;
    if (L.n_done > 0) {
        int first = -1;
        for (int i = 0; i < L.n && first < 0; ++i)
            if (L.fibers[i].state == ST_DONE) first = i;
        fail_as(f, f->file, f->line,
             "deadlock: __syncthreads() is waited on by %d threads, but %d threads of the block (first: thread %d) "
             "have already returned and will never arrive (a barrier inside a branch not all threads take)",
             L.n_barrier, L.n_done, first);
    }
    int count = 0;
    for (Fiber& g : fibers_in_use()) {
        if (g.line != f->line || strcmp(g.file, f->file))
            fail_as(f, f->file, f->line, "threads wait at different __syncthreads(): thread %d at line %d, thread %d at line %d",
                 f->lin, f->line, g.lin, g.line);
        count += g.value != 0;
    }
    for (Fiber& g : fibers_in_use()) {
        g.result = g.op == 1 ? count : g.op == 2 ? count == L.n : g.op == 3 ? count > 0 : 0;
        g.state = ST_RUN;
    }
    L.n_barrier = 0;
    on_barrier();
}

EMU_UNCHECKED int block_barrier(int kind, int pred, const char* file, int line) {
    Unchecked runtime;
    Fiber* f = self();
    f->op = kind;
    f->value = pred;
    f->file = file;
    f->line = line;
    f->state = ST_BARRIER;
    L.n_barrier++;
    try_release_barrier(f);
    if (f->state == ST_BARRIER) to_scheduler();
    return static_cast<int>(f->result);
}

EMU_UNCHECKED inline void fiber_main() {
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &L.main_bottom, &L.main_size);
#endif
    checking = checks_asked;
    L.entry(L.args);
    checking = 0;
    Fiber* f = self();
    f->state = ST_DONE;
    L.n_done++;
    // a thread that returns may complete a barrier (an error: see try_release_barrier)
    if (L.n_barrier > 0)
        for (Fiber& g : fibers_in_use())
            if (g.state == ST_BARRIER) { try_release_barrier(&g); break; }
    to_scheduler_final();
}

}  // namespace __emu
extern "C" EMU_UNCHECKED void emu_fiber_entry() { __emu::fiber_main(); }
namespace __emu {

// ---- shared memory poisoning: fill this module's thread-local storage with 0xFF bytes
struct TlsRange {
    char* start = nullptr;  // this library's thread-local storage: the running block's shared memory
    size_t size = 0;
    uintptr_t module_lo = 0, module_hi = 0;  // its loaded segments: code, constants, __device__ variables
};
#if defined(__linux__)
EMU_UNCHECKED inline int find_tls(struct dl_phdr_info* info, size_t, void* data) {
    auto* out = static_cast<TlsRange*>(data);
    uintptr_t me = reinterpret_cast<uintptr_t>(&find_tls);
    bool mine = false;
    size_t tls_size = 0;
    uintptr_t module_lo = UINTPTR_MAX, module_hi = 0;
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const auto& ph = info->dlpi_phdr[i];
        if (ph.p_type == PT_LOAD && me >= info->dlpi_addr + ph.p_vaddr && me < info->dlpi_addr + ph.p_vaddr + ph.p_memsz)
            mine = true;
        if (ph.p_type == PT_LOAD) {
            uintptr_t lo = info->dlpi_addr + ph.p_vaddr, hi = lo + ph.p_memsz;
            module_lo = std::min(module_lo, lo);
            module_hi = std::max(module_hi, hi);
        }
        if (ph.p_type == PT_TLS) tls_size = ph.p_memsz;
    }
    if (!mine) return 0;
    out->start = static_cast<char*>(info->dlpi_tls_data);
    out->size = tls_size;
    out->module_lo = module_lo;
    out->module_hi = module_hi;
    return 1;
}
#endif
inline thread_local char tls_anchor;  // touching it makes the loader allocate this module's TLS block
EMU_UNCHECKED inline TlsRange shared_memory_range() {
    TlsRange range;
    tls_anchor = 1;
#if defined(__linux__)
    dl_iterate_phdr(find_tls, &range);
#endif
    return range;  // elsewhere (macOS): not found, shared memory is not poisoned
}

EMU_UNCHECKED inline unsigned long long next_random() {  // splitmix64
    unsigned long long z = (L.rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Append to msg what the threads of the block that wait at a barrier or collective wait for (at most 6),
// the first after `lead`.
EMU_UNCHECKED inline int describe_waiting(char* msg, int len, int size, const char* lead) {
    int shown = 0;
    for (Fiber& g : fibers_in_use()) {
        if ((g.state != ST_BARRIER && g.state != ST_WARP) || shown >= 6 || len >= size - 200) continue;
        len += snprintf(msg + len, size - len, "%sthread %d waits at %s (%s:%d)", shown ? "; " : lead, g.lin,
                        g.state == ST_BARRIER ? "__syncthreads()" : op_name(g.op), g.file, g.line);
        int base = g.lin & ~31;
        for (int l = 0; g.state == ST_WARP && l < 32; ++l)
            if (((g.mask >> l) & 1u) && L.fibers[base + l].state != ST_WARP) {
                int other = base + l < L.n ? L.fibers[base + l].state : ST_DONE;
                len += snprintf(msg + len, size - len, " for lane %d, which %s", l,
                                other == ST_BARRIER ? "waits at __syncthreads()"
                                : other == ST_DONE  ? "has returned"
                                                    : "waits at another collective");
                break;
            }
        shown++;
    }
    return len;
}

EMU_UNCHECKED inline void fill_stack(Fiber& f) {  // a fresh start: the fiber's first switch enters fiber_main
#ifdef EMU_FAST_SWITCH
    // a stack that emu_switch "returns" into emu_fiber_start: FP control words, six zeroed registers,
    // then the return address
    void** top = reinterpret_cast<void**>(L.stacks[f.lin] + L.stack_size) - 2;
    top[0] = reinterpret_cast<void*>(&emu_fiber_start);
    top -= 6;
    for (int r = 0; r < 6; ++r) top[r] = nullptr;
    top -= 1;
    const unsigned int fp_words[2] = {0x1f80u, 0x037fu};  // MXCSR and x87 control word defaults
    memcpy(top, fp_words, 8);
    f.sp = top;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = L.stacks[f.lin];
    f.ctx.uc_stack.ss_size = L.stack_size;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
#endif
}

// schedule: 0 = in order, 1 = reverse, 2 = seeded shuffle redrawn on every pass. Returns L.result.
EMU_UNCHECKED inline int run_block(int schedule, TlsRange shared) {
    if (shared.start) memset(shared.start, 0xff, shared.size);
    on_barrier();  // nothing of the block before orders anything of this one
    L.n_done = L.n_barrier = 0;
    for (Fiber& f : fibers_in_use()) {
        f.state = ST_RUN;
        f.value = f.result = 0;
        f.op = f.line = 0;
        f.file = "";
        fill_stack(f);
    }
    for (;;) {
        if (schedule == 2)
            for (int i = L.n - 1; i > 0; --i) {
                const int j = static_cast<int>(next_random() % (i + 1)), t = L.order[i];
                L.order[i] = L.order[j], L.order[j] = t;
            }
        bool progressed = false;
        for (int k = 0; k < L.n; ++k) {
            const int i = L.order[k];
            Fiber* f = &L.fibers[i];
            if (f->state != ST_RUN) continue;
            to_fiber(f);
            cur = nullptr;
            checking = 0;
            progressed = true;
            if (L.result) return L.result;
        }
        if (L.n_done == L.n) return OK;
        if (!progressed) {  // everyone waits: describe who waits where
            char msg[3072];
            int len = snprintf(msg, sizeof msg, "deadlock in block (%u,%u,%u): ", block_idx.x, block_idx.y, block_idx.z);
            len = describe_waiting(msg, len, sizeof msg, "");
            snprintf(msg + len, sizeof msg - len, "; %d of %d threads have returned", L.n_done, L.n);
            snprintf(error_message, sizeof error_message, "%s", msg);
            return L.result = KERNEL_ERROR;
        }
    }
}

EMU_UNCHECKED inline size_t stack_bytes() {
    const char* env = getenv("VLLMINI_EMULATOR_STACK_KB");
    size_t kb = env ? strtoull(env, nullptr, 10) : 0;
#ifdef EMU_ASAN
    if (kb == 0) kb = 1024;
#else
    if (kb == 0) kb = 256;
#endif
    return kb * 1024;
}

// ---- leaving a launch from a signal handler: memory faults, and stops asked for by another thread
#define EMU_STOP_SIGNAL SIGURG  // ignored by default, so one arriving late does nothing; Python leaves it alone
EMU_UNCHECKED inline sigjmp_buf abandon;                       // the end of launch(): faults and stops jump here
inline volatile sig_atomic_t in_grid = 0;        // 1 while run_grid runs, so a jump to `abandon` is safe
inline pthread_mutex_t stop_mutex = PTHREAD_MUTEX_INITIALIZER;
inline pthread_t launch_thread;                  // the OS thread that runs launch running_id
inline unsigned long long running_id = 0;        // 0 = no launch in progress (both under stop_mutex)
inline std::atomic<unsigned long long> stop_id{0};  // the launch asked to stop, and why
inline std::atomic<int> stop_reason{OK};

EMU_UNCHECKED inline void set_running(unsigned long long id) {
    pthread_mutex_lock(&stop_mutex);
    running_id = id;
    launch_thread = pthread_self();
    pthread_mutex_unlock(&stop_mutex);
}

// Any thread: stop launch `id` (INTERRUPTED or TIME_LIMIT), now if it runs, at its start if it has not begun.
EMU_UNCHECKED inline void request_stop(unsigned long long id, int reason) {
    pthread_mutex_lock(&stop_mutex);
    stop_reason = reason;
    stop_id = id;
    if (running_id == id) pthread_kill(launch_thread, EMU_STOP_SIGNAL);
    pthread_mutex_unlock(&stop_mutex);
}

[[noreturn]] EMU_UNCHECKED inline void stop_now() {  // on the launching thread: say where the launch was, then leave
    in_grid = 0;
    checking = 0;  // it may have interrupted kernel code
    L.result = stop_reason;
    int len = snprintf(error_message, sizeof error_message, "%s in block (%u,%u,%u) of grid (%u,%u,%u) (%llu blocks "
                       "finished before it)", L.result == TIME_LIMIT ? "time limit reached" : "interrupted",
                       block_idx.x, block_idx.y, block_idx.z, grid_dim.x, grid_dim.y, grid_dim.z, L.blocks_done);
    const int size = sizeof error_message;
    if (cur && self()->state == ST_RUN) {
        char where[160];
        describe_thread(where, sizeof where, self());
        len += snprintf(error_message + len, size - len, ": %s was running and had not reached a barrier, a warp "
                        "collective or its end (a spin-wait on another thread, or a very long loop?)", where);
    }
    len += snprintf(error_message + len, size - len, "; threads of the block not finished: %d of %d",
                    L.n - L.n_done, L.n);
    describe_waiting(error_message, len, size, ": ");
    siglongjmp(abandon, 1);
}

EMU_UNCHECKED inline void on_stop_signal(int) {
    if (in_grid && stop_id == L.id) stop_now();  // else run_grid sees stop_id before its next block
}

struct SavedHandlers { stack_t alt_stack; struct sigaction segv, bus, fpe, ill, stop; };
inline SavedHandlers saved;  // the handlers a launch replaced, put back when it ends
EMU_UNCHECKED inline struct sigaction* saved_action(int sig) {
    return sig == SIGBUS ? &saved.bus : sig == SIGFPE ? &saved.fpe : sig == SIGILL ? &saved.ill : &saved.segv;
}
constexpr int FAULT_SIGNALS[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};  // a kernel's fault: KernelError, never a crash

// Where the faulting instruction is, as an offset into this library + 1 (0: unknown or elsewhere, e.g. libc).
EMU_UNCHECKED inline unsigned long long fault_pc(void* context) {
    uintptr_t pc = 0;
#if defined(__linux__) && defined(__x86_64__)
    pc = static_cast<uintptr_t>(static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_RIP]);
#elif defined(__linux__) && defined(__aarch64__)
    pc = static_cast<uintptr_t>(static_cast<ucontext_t*>(context)->uc_mcontext.pc);
#endif
    Dl_info where{};
    if (!pc || !module_base || !dladdr(reinterpret_cast<void*>(pc), &where) ||
        reinterpret_cast<uintptr_t>(where.dli_fbase) != module_base)
        return 0;
    return pc - module_base + 1;
}

EMU_UNCHECKED inline const char* signal_text(int sig, int code) {
    switch (sig) {
        case SIGFPE:
            return code == FPE_INTDIV || code == FPE_INTOVF
                       ? "integer division by zero (SIGFPE: x / 0 or x % 0 on integers, or INT_MIN / -1)"
                       : "arithmetic exception (SIGFPE)";
        case SIGILL: return "illegal instruction (SIGILL)";
        case SIGBUS: return "bus error (SIGBUS)";
        default: return "segmentation fault";
    }
}

EMU_UNCHECKED inline void on_fault(int sig, siginfo_t* info, void* context) {
    if (!in_grid || !pthread_equal(pthread_self(), launch_thread)) {
        // not the kernel's fault (another thread's): the old handler takes it when the instruction faults again
        sigaction(sig, saved_action(sig), nullptr);
        return;
    }
    checking = 0;
    char where[160] = "the launcher";
    if (cur) describe_thread(where, sizeof where, self());
    const char* addr = static_cast<const char*>(info->si_addr);
    long page = sysconf(_SC_PAGESIZE);
    bool overflow = false;
    // a fault in a guard page: kernels are built with -fstack-clash-protection, so even a frame larger than
    // the stack touches its pages top down and faults there first, before it writes anywhere else
    for (char* stack : Span_of<char*>{L.stacks, L.stacks + L.n_stacks}) overflow |= sig == SIGSEGV && addr >= stack - page && addr < stack;
    memset(error_info, 0, sizeof error_info);
    error_info[0] = ERR_SIGNAL;
    error_info[1] = reinterpret_cast<uintptr_t>(addr);
    error_info[4] = fault_pc(context);
    error_info[11] = sig;
    if (overflow)
        snprintf(error_message, sizeof error_message,
                 "%s: stack overflow: the thread's local variables need more than the %zu KiB fiber stack "
                 "(set VLLMINI_EMULATOR_STACK_KB to more)", where, L.stack_size / 1024);
    else if (sig == SIGSEGV || sig == SIGBUS)
        snprintf(error_message, sizeof error_message,
                 "%s: %s at address %p: the kernel touched memory it does not own (an index out of bounds?); "
                 "run it with checked=True to find the line", where, signal_text(sig, info->si_code), info->si_addr);
    else
        snprintf(error_message, sizeof error_message, "%s: %s", where, signal_text(sig, info->si_code));
    in_grid = 0;
    L.result = KERNEL_ERROR;
    siglongjmp(abandon, 1);
}

// Install the fault handlers (not under AddressSanitizer, which has its own) and the stop handler.
EMU_UNCHECKED inline void install_handlers() {
    struct sigaction action{};
    sigemptyset(&action.sa_mask);
    for (int sig : FAULT_SIGNALS) sigaddset(&action.sa_mask, sig);  // the handlers never interrupt each other
    sigaddset(&action.sa_mask, EMU_STOP_SIGNAL);
    action.sa_flags = SA_ONSTACK;
    action.sa_handler = on_stop_signal;
    sigaction(EMU_STOP_SIGNAL, &action, &saved.stop);
#ifndef EMU_ASAN
    static char alt_stack[1 << 16];
    stack_t stack{};
    stack.ss_sp = alt_stack;
    stack.ss_size = sizeof alt_stack;
    sigaltstack(&stack, &saved.alt_stack);
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    action.sa_sigaction = on_fault;
    for (int sig : FAULT_SIGNALS) sigaction(sig, &action, saved_action(sig));
#endif
}

// Put the old handlers back. SIG_IGN first discards a stop signal still pending (POSIX says so), so a late
// one never reaches the old handler.
EMU_UNCHECKED inline void restore_handlers() {
    struct sigaction ignore{};
    ignore.sa_handler = SIG_IGN;
    sigaction(EMU_STOP_SIGNAL, &ignore, nullptr);
    sigaction(EMU_STOP_SIGNAL, &saved.stop, nullptr);
#ifndef EMU_ASAN
    for (int sig : FAULT_SIGNALS) sigaction(sig, saved_action(sig), nullptr);
    sigaltstack(&saved.alt_stack, nullptr);
#endif
}

EMU_UNCHECKED int kernel_printf(const char* format, ...) {  // blocks the stop signal while stdio holds its lock
    Unchecked runtime;
    sigset_t stop, old;
    sigemptyset(&stop);
    sigaddset(&stop, EMU_STOP_SIGNAL);
    pthread_sigmask(SIG_BLOCK, &stop, &old);
    va_list ap;
    va_start(ap, format);
    int written = vprintf(format, ap);
    va_end(ap);
    pthread_sigmask(SIG_SETMASK, &old, nullptr);  // a stop that came meanwhile is handled here
    return written;
}

EMU_UNCHECKED inline void run_grid(const unsigned int grid[3], int schedule, TlsRange shared) {
    for (unsigned int z = 0; z < grid[2]; ++z)
        for (unsigned int y = 0; y < grid[1]; ++y)
            for (unsigned int x = 0; x < grid[0]; ++x) {
                block_idx = uint3{x, y, z};
                if (stop_id == L.id) stop_now();
                if (run_block(schedule, shared) != OK) return;
                L.blocks_done++;
            }
}

// Set up L for a launch: sizes, fibers, stacks (kept for later launches), the thread order.
EMU_UNCHECKED inline bool prepare(void (*entry)(void**), void** args, const unsigned int grid[3], const unsigned int block[3],
                    int schedule, unsigned long long seed, unsigned long long id) {
    L.result = OK;
    L.blocks_done = 0;
    error_message[0] = 0;
    memset(error_info, 0, sizeof error_info);
    L.entry = entry;
    L.args = args;
    L.id = id;
    L.rng = seed;
    L.n = static_cast<int>(block[0] * block[1] * block[2]);
    grid_dim = dim3(grid[0], grid[1], grid[2]);
    block_dim = dim3(block[0], block[1], block[2]);
    if (L.stack_size == 0) L.stack_size = stack_bytes();
    long page = sysconf(_SC_PAGESIZE);
    while (L.n_stacks < L.n) {
        void* p = mmap(nullptr, L.stack_size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            snprintf(error_message, sizeof error_message, "out of memory for thread stacks");
            return false;
        }
        mprotect(p, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting memory
        L.stacks[L.n_stacks++] = static_cast<char*>(p) + page;
    }
    for (int i = 0; i < L.n; ++i) {
        L.fibers[i] = Fiber();
        L.fibers[i].lin = i;
        L.fibers[i].tid = uint3{i % block[0], (i / block[0]) % block[1], i / (block[0] * block[1])};
        L.order[i] = schedule == 1 ? L.n - 1 - i : i;
    }
    return true;
}

EMU_UNCHECKED inline int launch(void (*entry)(void**), void** args, const unsigned int grid[3], const unsigned int block[3],
                  int schedule, unsigned long long seed, unsigned long long id) {
    if (!prepare(entry, args, grid, block, schedule, seed, id)) return KERNEL_ERROR;
    TlsRange shared = shared_memory_range();
    if (!begin_checks(shared.start, shared.size, shared.module_lo, shared.module_hi)) {
        end_checks();
        return KERNEL_ERROR;
    }
    install_handlers();
    set_running(id);
    if (sigsetjmp(abandon, 1) == 0) {
        in_grid = 1;
        run_grid(grid, schedule, shared);
    }
    in_grid = 0;
    end_checks();
    set_running(0);  // from here on, request_stop sends no signal
    restore_handlers();
    cur = nullptr;
    return L.result;
}

// How arguments are described to Python: one code per parameter, e.g. "Pcf4" = pointer to const float,
// "Si4" = 4-byte signed integer scalar. Kinds: f float, i signed int, u unsigned int, h __half,
// b __nv_bfloat16, B bool, c char, v void, s other struct; vector types add "x<lanes>".
template <class T> struct Code {
    static void put(char* o) {
        if constexpr (std::is_void_v<T>) strcpy(o, "v0");
        else if constexpr (std::is_same_v<T, bool>) strcpy(o, "B1");
        else if constexpr (std::is_same_v<T, char>) strcpy(o, "c1");
        else if constexpr (std::is_floating_point_v<T>) sprintf(o, "f%d", (int)sizeof(T));
        else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) sprintf(o, "i%d", (int)sizeof(T));
        else if constexpr (std::is_integral_v<T>) sprintf(o, "u%d", (int)sizeof(T));
        else if constexpr (std::is_enum_v<T>) sprintf(o, "i%d", (int)sizeof(T));
        else if constexpr (std::is_same_v<T, __half>) strcpy(o, "h2");
        else if constexpr (std::is_same_v<T, __nv_bfloat16>) strcpy(o, "b2");
        else if constexpr (std::is_same_v<T, __half2>) strcpy(o, "h2x2");
        else if constexpr (std::is_same_v<T, __nv_bfloat162>) strcpy(o, "b2x2");
        else if constexpr (std::is_same_v<T, float2>) strcpy(o, "f4x2");
        else if constexpr (std::is_same_v<T, float4>) strcpy(o, "f4x4");
        else if constexpr (std::is_same_v<T, int2>) strcpy(o, "i4x2");
        else if constexpr (std::is_same_v<T, int4>) strcpy(o, "i4x4");
        else if constexpr (std::is_same_v<T, uint2>) strcpy(o, "u4x2");
        else if constexpr (std::is_same_v<T, uint4>) strcpy(o, "u4x4");
        else if constexpr (std::is_same_v<T, double2>) strcpy(o, "f8x2");
        else sprintf(o, "s%d", (int)sizeof(T));
    }
};
template <class T> inline void param_code(std::string& out) {
    char buf[32];
    if constexpr (std::is_pointer_v<T>) {
        using E = std::remove_pointer_t<T>;
        if constexpr (std::is_pointer_v<E>) {
            out += "X;";
            return;
        } else {
            out += std::is_const_v<E> ? "Pc" : "Pm";
            Code<std::remove_cv_t<E>>::put(buf);
        }
    } else {
        out += "S";
        Code<std::remove_cv_t<T>>::put(buf);
    }
    out += buf;
    out += ";";
}
template <class... A> inline std::string signature(void (*)(A...)) {
    std::string s;
    (param_code<A>(s), ...);
    return s;
}
template <class... A, size_t... I>
EMU_UNCHECKED inline void invoke(void (*k)(A...), void** a, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<A>*>(a[I])...);
}
// Call kernel k with arguments a[i] (each a pointer to the value, as in cuLaunchKernel's kernelParams).
template <class... A> EMU_UNCHECKED inline void call(void (*k)(A...), void** a) { invoke(k, a, std::index_sequence_for<A...>()); }

struct KernelEntry { const char* name; void (*entry)(void**); std::string (*signature)(); };

}  // namespace __emu
