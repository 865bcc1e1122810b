// cpu/runtime.cpp: the CPU backend's execution model and CUDA runtime API.
// Built into cpu/build/<variant>/libcucc_rt.a by cpu/Makefile; cpu/cucc links it into every program.
//
// Execution model. A launch runs the blocks of its grid over OpenMP threads (dynamic schedule); the
// threads of one block run on fibers of one OS thread. A fiber ("runner") has its own stack and calls
// the kernel for one CUDA thread after another, as plain function calls, until one of them reaches a
// rendezvous (block barrier, warp shuffle/vote/sync) that it must wait at: the runner is then suspended
// with that thread, and a ready runner resumes, or a new runner starts the block's next threads. The
// last thread to arrive at a rendezvous completes it and wakes the others. So a kernel without
// rendezvous costs a function call per thread, and one with them a context switch per waiting thread
// per rendezvous. A fiber never migrates between OS threads, which is what makes thread_local threadIdx
// (set whenever a thread starts or resumes) and per-OS-thread static shared memory correct. Everything is synchronous: a launch, memcpy or event record completes before it returns,
// which is one valid schedule of CUDA's stream semantics.
//
// Faults a GPU would hang or misbehave on are reported here with the kernel, block and thread, then
// abort: a barrier that not every live thread reaches, divergent barriers, shuffles whose lanes
// disagree on the mask or read an exited lane.
#include "cucc.h"

#include <alloca.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#ifdef CUCC_CHECK
#include "check.h"
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;
// Non-zero while this OS thread runs a kernel's blocks: the GPU-numerics emulation of cucc.h applies only then.
thread_local int __cucc_device_code;

// -ftz=true builds (cucc.h's launcher calls __cucc_run_grid_ftz): the threads that run blocks set the SSE unit's
// FTZ (flush-to-zero, bit 15) and DAZ (denormals-are-zero, bit 6) bits while they do, and restore them after, so
// that host code between launches keeps IEEE subnormals.
#if defined(__x86_64__) || defined(__SSE__)
#include <xmmintrin.h>
static inline unsigned enter_device_code(int ftz) {
    __cucc_device_code = 1;
    if (!ftz) return 0;
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);
    return csr;
}
static inline void leave_device_code(int ftz, unsigned csr) {
    __cucc_device_code = 0;
    if (ftz) _mm_setcsr(csr);
}
#else
static inline unsigned enter_device_code(int) {
    __cucc_device_code = 1;
    return 0;
}
static inline void leave_device_code(int, unsigned) { __cucc_device_code = 0; }
#endif

// ----------------------------------------------------------------------------------------------
// Context switch. On x86-64, 14 instructions: push the callee-saved registers, swap stack pointers,
// pop. glibc's swapcontext also saves the signal mask with a system call per switch (~10x slower);
// it remains the portable fallback (and can be forced with -DCUCC_UCONTEXT to compare).
#if defined(__x86_64__) && !defined(CUCC_UCONTEXT)
struct fiber_context {
    void* sp;
};
extern "C" void cucc_switch_context(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl cucc_switch_context
    .type cucc_switch_context, @function
cucc_switch_context:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cucc_switch_context, .-cucc_switch_context
)");
static void context_init(fiber_context* c, char* stack, size_t size, void (*entry)(void)) {
    // The first switch pops six zero registers and "returns" into entry with rsp % 16 == 8, exactly
    // as if entry had been called. entry never returns, so its own return address is a null.
    void** sp = (void**)(((uintptr_t)(stack + size)) & ~(uintptr_t)15);
    *--sp = nullptr;
    *--sp = (void*)entry;
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    c->sp = sp;
}
static inline void context_switch(fiber_context* from, fiber_context* to) { cucc_switch_context(&from->sp, to->sp); }
static const char* context_switch_kind = "x86-64 register switch";
#else
#include <ucontext.h>
struct fiber_context {
    ucontext_t uc;
};
static void context_init(fiber_context* c, char* stack, size_t size, void (*entry)(void)) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, entry, 0);
}
static inline void context_switch(fiber_context* from, fiber_context* to) { swapcontext(&from->uc, &to->uc); }
static const char* context_switch_kind = "ucontext swapcontext";
#endif

// ----------------------------------------------------------------------------------------------
// Per-OS-thread state: a block in flight, its CUDA threads, the runners that execute them.
enum thread_run_state { THREAD_READY, THREAD_WAITING, THREAD_DONE };
enum wait_kind { WAIT_NONE, WAIT_BLOCK, WAIT_WARP };

// one CUDA thread of the block in flight
struct cuda_thread {
    uint3 tid;
    int lane, warp;
    int runner;  // the runner executing it, once started
    int state, wait;
    const char* what;  // the rendezvous it waits at, for diagnostics
    const char* file;
    int line;
    // warp operation in flight
    int op_kind;
    unsigned op_mask;
    uint64_t op_value;
    int op_src;
    void (*op_complete)(void* const*);  // CUCC_WARP_MATRIX: runs once when the warp has arrived
    uint64_t op_result;
    // block barrier results
    int bar_result, bar_live;
#ifdef CUCC_CHECK
    cucc_check_thread check;
#endif
};

// a fiber that executes CUDA threads one after another
struct runner {
    fiber_context ctx;
    int thread;  // the CUDA thread it is executing
};

struct warp_state {
    unsigned exists;   // lanes that are threads of the block (the last warp may be partial)
    unsigned live;     // lanes that have not returned
    unsigned waiting;  // lanes waiting at a warp operation
};

enum { MAX_BLOCK_THREADS = 1024, MAX_WARPS = 32 };

struct thread_state {
    // the block in flight
    const char* kernel;
    void (*body)(void*);
    void* closure;
    int nthreads, ndone;
    int next_unstarted;  // the next CUDA thread a runner starts
    uint3 next_tid;      // its threadIdx
    int in_kernel;
    cuda_thread* current;
    int current_runner;
    fiber_context scheduler;
    int bar_arrived, bar_count, bar_line;
    const char* bar_file;
    const char* bar_what;
    int queue[MAX_BLOCK_THREADS];  // ready runners
    int qhead, qsize;
    cuda_thread threads[MAX_BLOCK_THREADS];
    warp_state warps[MAX_WARPS];
    runner runners[MAX_BLOCK_THREADS];
    int free_runners[MAX_BLOCK_THREADS];  // runner slots not in use
    int nfree;
    int nslots;          // runner slots ever used (their stacks exist)
    int pending_free;    // a runner that ended; its slot is freed once off its stack
    // memory that outlives a block
    std::vector<char*> stacks;  // one per runner slot
    void* dyn_smem;
    size_t dyn_smem_bytes;
#if defined(__SANITIZE_ADDRESS__)
    const void* os_stack_bottom;
    size_t os_stack_size;
#endif
};

static thread_local thread_state* tls_state;

#if defined(__SANITIZE_ADDRESS__)
static const size_t FIBER_STACK_BYTES = 256 * 1024;  // ASan's redzones make frames larger
#else
static const size_t FIBER_STACK_BYTES = 64 * 1024;
#endif

static thread_state* get_thread_state(void) {
    if (!tls_state) {
        tls_state = new thread_state();
#if defined(__SANITIZE_ADDRESS__)
        pthread_attr_t attr;
        pthread_getattr_np(pthread_self(), &attr);
        void* addr;
        size_t size;
        pthread_attr_getstack(&attr, &addr, &size);
        pthread_attr_destroy(&attr);
        tls_state->os_stack_bottom = addr;
        tls_state->os_stack_size = size;
#endif
    }
    return tls_state;
}

// A fiber stack with a PROT_NONE guard page below it, so an overflow faults instead of corrupting
// the neighbouring fiber's stack.
static char* fiber_stack(thread_state* ts, int i) {
    while ((int)ts->stacks.size() <= i) {
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        char* base = (char*)mmap(nullptr, FIBER_STACK_BYTES + page, PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (base == MAP_FAILED) {
            fprintf(stderr, "cucc: cannot map a fiber stack (%zu KiB)\n", FIBER_STACK_BYTES / 1024);
            abort();
        }
        mprotect(base, page, PROT_NONE);
        ts->stacks.push_back(base + page);
    }
    return ts->stacks[i];
}

// ----------------------------------------------------------------------------------------------
// Switching between runners and the block's scheduler.
static void release_pending_runner(thread_state* ts) {
    if (ts->pending_free >= 0) {
        ts->free_runners[ts->nfree++] = ts->pending_free;
        ts->pending_free = -1;
    }
}

// Switches to runner `to` (or the scheduler when to < 0). `dying`: the current runner never resumes.
static void switch_to(thread_state* ts, fiber_context* from, int to, int dying) {
    fiber_context* to_ctx = to >= 0 ? &ts->runners[to].ctx : &ts->scheduler;
    if (to >= 0) {
        ts->current_runner = to;
        int t = ts->runners[to].thread;
        if (t >= 0) {
            ts->current = &ts->threads[t];
            threadIdx = ts->threads[t].tid;
#ifdef CUCC_CHECK
            cucc_check_current = &ts->threads[t].check;
#endif
        }
    }
#if defined(__SANITIZE_ADDRESS__)
    void* fake_stack = nullptr;
    const void* bottom = to >= 0 ? (const void*)ts->stacks[to] : ts->os_stack_bottom;
    size_t size = to >= 0 ? FIBER_STACK_BYTES : ts->os_stack_size;
    __sanitizer_start_switch_fiber(dying ? nullptr : &fake_stack, bottom, size);
    context_switch(from, to_ctx);
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
    (void)dying;
    context_switch(from, to_ctx);
#endif
    release_pending_runner(ts);
}

static void queue_push(thread_state* ts, int runner_index) {
    ts->queue[(ts->qhead + ts->qsize) % MAX_BLOCK_THREADS] = runner_index;
    ts->qsize++;
}
static int queue_pop(thread_state* ts) {
    if (ts->qsize == 0) return -1;
    int i = ts->queue[ts->qhead];
    ts->qhead = (ts->qhead + 1) % MAX_BLOCK_THREADS;
    ts->qsize--;
    return i;
}

static void runner_entry(void);

// The runner to run next: a ready one (resumed first, which keeps few stacks in use), else a new one
// to start the block's next threads; -1 when there is neither (the block is finished or deadlocked).
static int next_runner(thread_state* ts) {
    int r = queue_pop(ts);
    if (r >= 0 || ts->next_unstarted >= ts->nthreads) return r;
    r = ts->nfree > 0 ? ts->free_runners[--ts->nfree] : ts->nslots++;
    char* stack = fiber_stack(ts, r);
#if defined(__SANITIZE_ADDRESS__)
    // a runner that ended never unwound its last frames: their redzones would poison the new one's locals
    __asan_unpoison_memory_region(stack, FIBER_STACK_BYTES);
#endif
    ts->runners[r].thread = -1;
    context_init(&ts->runners[r].ctx, stack, FIBER_STACK_BYTES, runner_entry);
    return r;
}

// The current thread has marked itself waiting: run something else. Returns when it is woken.
static void yield_current(thread_state* ts) {
    int self = ts->current_runner;
    switch_to(ts, &ts->runners[self].ctx, next_runner(ts), 0);
}

static void print_thread(FILE* f, const cuda_thread* t) { fprintf(f, "(%u,%u,%u)", t->tid.x, t->tid.y, t->tid.z); }

// In a --check build the faults of barriers and warp operations are synccheck findings: one "cucc: synccheck:"
// line and the checking mode's exit status instead of an abort.
static int fault_is_synccheck(const char* fmt) { return strncmp(fmt, "__trap", 6) != 0 && strncmp(fmt, "internal", 8) != 0; }

[[noreturn]] static void fault(thread_state* ts, const cuda_thread* t, const char* fmt, ...) {
#ifdef CUCC_CHECK
    if (fault_is_synccheck(fmt) && cucc_check_on(CUCC_CHECK_SYNC)) {
        char msg[1500];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
        cucc_check_report(CUCC_CHECK_SYNC, "kernel '%s' block (%u,%u,%u) thread (%u,%u,%u): %s", ts->kernel, blockIdx.x,
                          blockIdx.y, blockIdx.z, t ? t->tid.x : 0, t ? t->tid.y : 0, t ? t->tid.z : 0, msg);
    }
#else
    (void)fault_is_synccheck;
#endif
    fprintf(stderr, "cucc: kernel '%s' block (%u,%u,%u)", ts->kernel, blockIdx.x, blockIdx.y, blockIdx.z);
    if (t) {
        fprintf(stderr, " thread ");
        print_thread(stderr, t);
    }
    fprintf(stderr, ": ");
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    fflush(stderr);
    abort();
}

[[noreturn]] static void report_deadlock(thread_state* ts) {
    int waiting = ts->nthreads - ts->ndone;
#ifdef CUCC_CHECK
    if (cucc_check_on(CUCC_CHECK_SYNC)) {
        const cuda_thread* t = nullptr;
        for (int i = 0; i < ts->next_unstarted && !t; i++)
            if (ts->threads[i].state == THREAD_WAITING) t = &ts->threads[i];
        cucc_check_report(CUCC_CHECK_SYNC, "deadlock in kernel '%s' block (%u,%u,%u): %d of %d threads wait and none can "
                          "proceed; thread (%u,%u,%u) waits at %s (%s:%d)", ts->kernel, blockIdx.x, blockIdx.y, blockIdx.z,
                          waiting, ts->nthreads, t ? t->tid.x : 0, t ? t->tid.y : 0, t ? t->tid.z : 0,
                          t ? t->what : "?", t ? t->file : "?", t ? t->line : 0);
    }
#endif
    fprintf(stderr, "cucc: deadlock in kernel '%s' block (%u,%u,%u): %d of %d threads wait and none can proceed\n",
            ts->kernel, blockIdx.x, blockIdx.y, blockIdx.z, waiting, ts->nthreads);
    // one line per distinct place, with the first thread and the count
    int shown = 0;
    std::vector<char> seen(ts->nthreads, 0);
    for (int i = 0; i < ts->next_unstarted && shown < 8; i++) {
        cuda_thread* t = &ts->threads[i];
        if (t->state != THREAD_WAITING || seen[i]) continue;
        int count = 0;
        for (int j = i; j < ts->next_unstarted; j++) {
            cuda_thread* u = &ts->threads[j];
            if (u->state == THREAD_WAITING && u->line == t->line && u->what == t->what && strcmp(u->file, t->file) == 0) {
                seen[j] = 1;
                count++;
            }
        }
        fprintf(stderr, "  %d thread(s), first ", count);
        print_thread(stderr, t);
        fprintf(stderr, ", wait at %s (%s:%d)", t->what, t->file, t->line);
        if (t->wait == WAIT_WARP) fprintf(stderr, " with mask 0x%08x", t->op_mask);
        fprintf(stderr, "\n");
        shown++;
    }
    fprintf(stderr, "  %d thread(s) have returned\n", ts->ndone);
    fflush(stderr);
    abort();
}

// ----------------------------------------------------------------------------------------------
// Warp rendezvous.
static void warp_complete(thread_state* ts, int warp, unsigned mask, cuda_thread* self) {
    warp_state* w = &ts->warps[warp];
    cuda_thread* lanes = &ts->threads[warp * 32];
    unsigned need = mask & w->live;
    int first = __builtin_ctz(need);
    cuda_thread* f0 = &lanes[first];
    uint64_t ballot = 0, reduced = 0;
    int reduce_kind = f0->op_src;
    int seen_any = 0;
    for (unsigned m = need; m; m &= m - 1) {
        cuda_thread* g = &lanes[__builtin_ctz(m)];
        if (g->op_mask != mask)
            fault(ts, g, "%s (%s:%d) with mask 0x%08x, while lane %d is at %s (%s:%d) with mask 0x%08x: lanes of a warp "
                  "operation must agree on the mask", g->what, g->file, g->line, g->op_mask, first, f0->what, f0->file,
                  f0->line, mask);
        if (g->op_kind != f0->op_kind || (g->op_kind == CUCC_WARP_REDUCE && g->op_src != reduce_kind))
            fault(ts, g, "%s (%s:%d) meets lane %d at %s (%s:%d): lanes of a warp are at different warp operations",
                  g->what, g->file, g->line, first, f0->what, f0->file, f0->line);
        if (g->op_kind == CUCC_WARP_MATRIX &&
            (g->line != f0->line || g->op_complete != f0->op_complete ||
             (g->file != f0->file && strcmp(g->file, f0->file) != 0)))
            fault(ts, g, "%s (%s:%d) meets lane %d at %s (%s:%d): the lanes of a warp must reach a wmma operation "
                  "together, at the same place", g->what, g->file, g->line, first, f0->what, f0->file, f0->line);
        if (g->op_value) ballot |= 1ull << g->lane;
        uint32_t v = (uint32_t)g->op_value;
        if (!seen_any) {
            reduced = v;
            seen_any = 1;
        } else {
            switch (reduce_kind) {
                case CUCC_REDUCE_ADD: reduced = (uint32_t)(reduced + v); break;
                case CUCC_REDUCE_MIN: reduced = v < reduced ? v : reduced; break;
                case CUCC_REDUCE_MAX: reduced = v > reduced ? v : reduced; break;
                case CUCC_REDUCE_AND: reduced &= v; break;
                case CUCC_REDUCE_OR: reduced |= v; break;
                case CUCC_REDUCE_XOR: reduced ^= v; break;
            }
        }
    }
    if (f0->op_kind == CUCC_WARP_MATRIX) {
        // nvcuda::wmma is warp-collective: every one of the 32 lanes must take part
        if (need != 0xffffffffu)
            fault(ts, f0, "%s (%s:%d) is reached by lanes 0x%08x of the warp only (the others %s): a wmma operation "
                  "needs all 32 lanes", f0->what, f0->file, f0->line, need,
                  w->exists != 0xffffffffu ? "are not threads of the block" : "have exited");
        if (f0->op_complete) {
            void* args[32];
            for (int l = 0; l < 32; l++) args[l] = (void*)(uintptr_t)lanes[l].op_value;
            f0->op_complete(args);
        }
    }
    for (unsigned m = need; m; m &= m - 1) {
        cuda_thread* g = &lanes[__builtin_ctz(m)];
        switch (g->op_kind) {
            case CUCC_WARP_SHFL: {
                int src = g->op_src;
                if (src < 0 || src >= 32 || !(w->exists & (1u << src)))
                    fault(ts, g, "%s (%s:%d) reads lane %d, which does not exist (the block has %d threads)", g->what,
                          g->file, g->line, src, ts->nthreads);
                // a lane outside the mask: CUDA leaves the value undefined (common in reductions over part of a warp
                // whose upper results go unused); it reads as all ones, NaN in every float format
                if (!(mask & (1u << src))) {
                    g->op_result = ~0ull;
                    break;
                }
                if (!(w->live & (1u << src)))
                    fault(ts, g, "%s (%s:%d) reads lane %d, which has exited", g->what, g->file, g->line, src);
                g->op_result = lanes[src].op_value;
                break;
            }
            case CUCC_WARP_VOTE: g->op_result = ballot; break;
            case CUCC_WARP_REDUCE: g->op_result = reduced; break;
            default: g->op_result = 0; break;
        }
    }
    w->waiting &= ~need;
#ifdef CUCC_CHECK
    // a wmma operation orders no memory accesses: it leaves the sync clock and the lanes' stamps alone
    int orders = f0->op_kind != CUCC_WARP_MATRIX;
    uint32_t clock = orders ? cucc_check_warp_done() : 0;
#endif
    for (unsigned m = need; m; m &= m - 1) {
        cuda_thread* g = &lanes[__builtin_ctz(m)];
#ifdef CUCC_CHECK
        if (orders && need == w->live) {
            g->check.warp_stamp = clock;
        } else if (orders) {
            g->check.part_stamp = clock;
            g->check.part_lanes = need;
        }
#endif
        g->state = THREAD_READY;
        g->wait = WAIT_NONE;
        if (g != self) queue_push(ts, g->runner);
    }
}

static thread_state* kernel_state(const char* what) {
    thread_state* ts = tls_state;
    if (!ts || !ts->in_kernel) {
        fprintf(stderr, "cucc: %s called outside a kernel\n", what);
        abort();
    }
    return ts;
}

uint64_t __cucc_warp_op(int kind, unsigned mask, uint64_t value, int src_lane, const char* what, const char* file,
                        int line) {
    thread_state* ts = kernel_state(what);
    cuda_thread* f = ts->current;
    warp_state* w = &ts->warps[f->warp];
    unsigned me = 1u << f->lane;
    if (!(mask & me))
        fault(ts, f, "%s (%s:%d) with mask 0x%08x, which does not include the calling lane %d", what, file, line, mask,
              f->lane);
    f->op_kind = kind;
    f->op_mask = mask;
    f->op_value = value;
    f->op_src = src_lane;
    f->what = what;
    f->file = file;
    f->line = line;
    f->state = THREAD_WAITING;
    f->wait = WAIT_WARP;
    w->waiting |= me;
    if (((mask & w->live) & ~w->waiting) == 0) {
        warp_complete(ts, f->warp, mask, f);
    } else {
        yield_current(ts);
    }
    return f->op_result;
}

void __cucc_warp_matrix_op(void* lane_arg, void (*complete)(void* const* lane_args), const char* what,
                           const char* file, int line) {
    thread_state* ts = kernel_state(what);
    ts->current->op_complete = complete;
    __cucc_warp_op(CUCC_WARP_MATRIX, 0xffffffffu, (uint64_t)(uintptr_t)lane_arg, 0, what, file, line);
}

void __cucc_kernel_fault(const char* check, const char* message, const char* file, int line) {
    thread_state* ts = kernel_state("a device-side check");
    const cuda_thread* t = ts->current;
#ifdef CUCC_CHECK
    if (cucc_check_on(check))
        cucc_check_report(check, "kernel '%s' block (%u,%u,%u) thread (%u,%u,%u): %s (%s:%d)", ts->kernel, blockIdx.x,
                          blockIdx.y, blockIdx.z, t->tid.x, t->tid.y, t->tid.z, message, file, line);
#else
    (void)check;
#endif
    fprintf(stderr, "cucc: kernel '%s' block (%u,%u,%u) thread (%u,%u,%u): %s (%s:%d)\n", ts->kernel, blockIdx.x,
            blockIdx.y, blockIdx.z, t->tid.x, t->tid.y, t->tid.z, message, file, line);
    fflush(stderr);
    abort();
}

unsigned __cucc_live_lanes(void) {
    thread_state* ts = kernel_state("__activemask");
    return ts->warps[ts->current->warp].live;
}

unsigned __cucc_lane_id(void) {
    thread_state* ts = kernel_state("a warp operation");
    return (unsigned)ts->current->lane;
}

// ----------------------------------------------------------------------------------------------
// Block barrier.
static void barrier_complete(thread_state* ts, cuda_thread* self) {
    int live = ts->nthreads - ts->ndone;
#ifdef CUCC_CHECK
    uint32_t clock = cucc_check_barrier_done(ts->bar_file, ts->bar_line);
#endif
    for (int i = 0; i < ts->next_unstarted; i++) {
        cuda_thread* g = &ts->threads[i];
        if (g->state != THREAD_WAITING || g->wait != WAIT_BLOCK) continue;
#ifdef CUCC_CHECK
        g->check.bar_stamp = clock;
        g->check.warp_stamp = clock;
        g->check.barriers++;
#endif
        g->bar_result = ts->bar_count;
        g->bar_live = live;
        g->state = THREAD_READY;
        g->wait = WAIT_NONE;
        if (g != self) queue_push(ts, g->runner);
    }
    ts->bar_arrived = 0;
    ts->bar_count = 0;
}

int __cucc_block_barrier(int predicate, int* live_threads, const char* what, const char* file, int line) {
    thread_state* ts = kernel_state(what);
    cuda_thread* f = ts->current;
    if (ts->bar_arrived == 0) {
        ts->bar_file = file;
        ts->bar_line = line;
        ts->bar_what = what;
    } else if (line != ts->bar_line || (file != ts->bar_file && strcmp(file, ts->bar_file) != 0)) {
        fault(ts, f, "reaches %s (%s:%d) while other threads wait at %s (%s:%d): a barrier must be reached by every "
              "live thread of the block at the same place", what, file, line, ts->bar_what, ts->bar_file, ts->bar_line);
    }
    f->what = what;
    f->file = file;
    f->line = line;
    f->state = THREAD_WAITING;
    f->wait = WAIT_BLOCK;
    ts->bar_arrived++;
    ts->bar_count += predicate != 0;
    if (ts->bar_arrived == ts->nthreads - ts->ndone) {
        barrier_complete(ts, f);
    } else {
        yield_current(ts);
    }
    *live_threads = f->bar_live;
    return f->bar_result;
}

// ----------------------------------------------------------------------------------------------
// Thread and runner life cycle, and the block scheduler.

// Bookkeeping when a CUDA thread returns: it no longer counts for its warp's or the block's rendezvous,
// which can complete a rendezvous that was waiting only for this thread.
static void thread_exit(thread_state* ts, cuda_thread* f) {
#ifdef CUCC_CHECK
    cucc_check_thread_end(&f->check);
#endif
    f->state = THREAD_DONE;
    f->what = "return";
    ts->ndone++;
    warp_state* w = &ts->warps[f->warp];
    w->live &= ~(1u << f->lane);
    unsigned pending = w->waiting;
    while (pending) {
        unsigned mask = ts->threads[f->warp * 32 + __builtin_ctz(pending)].op_mask;
        unsigned group = 0;
        for (unsigned m = pending; m; m &= m - 1) {
            int l = __builtin_ctz(m);
            if (ts->threads[f->warp * 32 + l].op_mask == mask) group |= 1u << l;
        }
        pending &= ~group;
        if (((mask & w->live) & ~w->waiting) == 0) warp_complete(ts, f->warp, mask, nullptr);
    }
    if (ts->bar_arrived > 0 && ts->bar_arrived == ts->nthreads - ts->ndone) barrier_complete(ts, nullptr);
}

// A runner starts CUDA threads one after another while there are unstarted ones; a thread that waits at
// a rendezvous keeps the runner (and its stack) until it is woken and returns.
static void runner_entry(void) {
    thread_state* ts = tls_state;
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    release_pending_runner(ts);
    int self = ts->current_runner;
    while (ts->next_unstarted < ts->nthreads) {
        // a thread's record is filled when it starts: only started threads are ever looked at
        int i = ts->next_unstarted++;
        cuda_thread* t = &ts->threads[i];
        t->tid = ts->next_tid;  // counted up rather than divided out: three divisions cost more than a small kernel
        if (++ts->next_tid.x == blockDim.x) {
            ts->next_tid.x = 0;
            if (++ts->next_tid.y == blockDim.y) {
                ts->next_tid.y = 0;
                ts->next_tid.z++;
            }
        }
        t->lane = i % 32;
        t->warp = i / 32;
        t->state = THREAD_READY;
        t->wait = WAIT_NONE;
        t->runner = self;
        ts->runners[self].thread = i;
        ts->current = t;
        threadIdx = t->tid;
#ifdef CUCC_CHECK
        cucc_check_thread_begin(&t->check, i);
        cucc_check_current = &t->check;
#endif
        ts->body(ts->closure);
        thread_exit(ts, t);
    }
    ts->pending_free = self;
    switch_to(ts, &ts->runners[self].ctx, next_runner(ts), 1);
    fault(ts, nullptr, "internal error: a finished runner was resumed");
}

static void run_block(thread_state* ts, uint3 block_index) {
    blockIdx = block_index;
    int n = ts->nthreads;
    for (int w = 0; w < MAX_WARPS; w++) {
        int lanes = n - w * 32;
        unsigned exists = lanes >= 32 ? 0xffffffffu : (lanes <= 0 ? 0u : (1u << lanes) - 1);
        ts->warps[w].exists = exists;
        ts->warps[w].live = exists;
        ts->warps[w].waiting = 0;
    }
    ts->qhead = 0;
    ts->qsize = 0;
    ts->ndone = 0;
    ts->next_unstarted = 0;
    ts->next_tid = make_uint3(0, 0, 0);
    ts->bar_arrived = 0;
    ts->bar_count = 0;
    ts->pending_free = -1;
    ts->nfree = 0;
    for (int r = ts->nslots - 1; r >= 0; r--) ts->free_runners[ts->nfree++] = r;
    while (ts->ndone < n) {
        int next = next_runner(ts);
        if (next < 0) report_deadlock(ts);
        switch_to(ts, &ts->scheduler, next, 0);
    }
#ifdef CUCC_CHECK
    cucc_check_current = nullptr;
#endif
}

// ----------------------------------------------------------------------------------------------
// Launch configuration and per-kernel attributes.
static thread_local cudaError_t last_error = cudaSuccess;
static std::mutex attribute_mutex;
static std::map<std::string, int> max_dynamic_shared;  // by kernel name, as raised by cudaFuncSetAttribute
#ifdef CUCC_CHECK
// the checking mode also keeps the instance a template's attribute was set for ("tiled<32>"), so that a launch of
// another instance ("tiled<64>") does not borrow it
static std::map<std::string, int> instance_dynamic_shared;
#endif
static const int DEFAULT_SHARED_PER_BLOCK = 48 * 1024;
static const int OPTIN_SHARED_PER_BLOCK = 227 * 1024;  // as on an H100/H200

// "ns::kernel<T, 4>" and "&kernel" name the same kernel as "kernel" at a launch site.
static std::string kernel_base_name(const char* name) {
    std::string s;
    int depth = 0;
    for (const char* p = name; *p; p++) {
        if (*p == '<') depth++;
        else if (*p == '>') depth--;
        else if (depth == 0 && *p != ' ' && *p != '&' && *p != '(' && *p != ')') s += *p;
    }
    size_t colon = s.rfind("::");
    return colon == std::string::npos ? s : s.substr(colon + 2);
}

#ifdef CUCC_CHECK
// "ns::kernel<T,4>" -> "kernel<T,4>" (cucc passes names without spaces); "" for a name without template arguments
static std::string kernel_instance_name(const char* name) {
    std::string s(name);
    size_t open = s.find('<');
    if (open == std::string::npos) return "";
    size_t colon = s.rfind("::", open);
    return colon == std::string::npos ? s : s.substr(colon + 2);
}
#endif

cudaError_t __cucc_func_set_attribute(const char* kernel_name, const void* func, cudaFuncAttribute attr, int value) {
    if (!func) return last_error = cudaErrorInvalidDeviceFunction;
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
        if (value < 0 || value > OPTIN_SHARED_PER_BLOCK) return last_error = cudaErrorInvalidValue;
        std::lock_guard<std::mutex> lock(attribute_mutex);
        max_dynamic_shared[kernel_base_name(kernel_name)] = value;
#ifdef CUCC_CHECK
        std::string instance = kernel_instance_name(kernel_name);
        if (!instance.empty()) instance_dynamic_shared[instance] = value;
#endif
        return cudaSuccess;
    }
    if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) {
        return (value >= -1 && value <= 100) ? cudaSuccess : (last_error = cudaErrorInvalidValue);
    }
    return last_error = cudaErrorInvalidValue;
}

// Without the kernel's name (a call that cucc did not rewrite) the attribute cannot be matched to a
// launch, so it is refused rather than silently ignored.
extern "C" cudaError_t cudaFuncSetAttribute(const void*, enum cudaFuncAttribute, int) {
    return last_error = cudaErrorNotSupported;
}

static int max_dynamic_shared_for(const char* kernel_name) {
    std::lock_guard<std::mutex> lock(attribute_mutex);
#ifdef CUCC_CHECK
    std::string instance = kernel_instance_name(kernel_name), base = kernel_base_name(kernel_name);
    if (!instance.empty()) {
        auto exact = instance_dynamic_shared.find(instance);
        if (exact != instance_dynamic_shared.end()) return exact->second;
        for (auto& other : instance_dynamic_shared)  // raised for another instance of the template only
            if (kernel_base_name(other.first.c_str()) == base) return DEFAULT_SHARED_PER_BLOCK;
    }
#endif
    auto it = max_dynamic_shared.find(kernel_base_name(kernel_name));
    return it == max_dynamic_shared.end() ? DEFAULT_SHARED_PER_BLOCK : it->second;
}

static cudaError_t validate_launch(const __cucc_launch_config& c, const char* name) {
    const dim3& g = c.grid;
    const dim3& b = c.block;
    if (b.x == 0 || b.y == 0 || b.z == 0 || b.x > 1024 || b.y > 1024 || b.z > 64) return cudaErrorInvalidConfiguration;
    if ((uint64_t)b.x * b.y * b.z > MAX_BLOCK_THREADS) return cudaErrorInvalidConfiguration;
    if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u || g.y > 65535 || g.z > 65535)
        return cudaErrorInvalidConfiguration;
    if (c.shared_bytes > (size_t)max_dynamic_shared_for(name)) return cudaErrorInvalidValue;
    return cudaSuccess;
}

// The launch that thread `ts` runs blocks of.
static void set_launch(thread_state* ts, const __cucc_launch_config& cfg, const char* name, void (*body)(void*),
                       void* closure) {
    ts->kernel = name;
    ts->body = body;
    ts->closure = closure;
    ts->nthreads = (int)(cfg.block.x * cfg.block.y * cfg.block.z);
    blockDim = cfg.block;
    gridDim = cfg.grid;
}

static void prepare_thread_for_launch(thread_state* ts, const __cucc_launch_config& cfg, const char* name,
                                      void (*body)(void*), void* closure) {
    set_launch(ts, cfg, name, body, closure);
    // Dynamic shared memory. Under AddressSanitizer it has exactly the launch's size, so that an overflow
    // is seen; otherwise the buffer only grows (launches alternate between sizes, and reallocating large
    // buffers every launch costs page faults). New memory is filled with 0xff (NaN as float, bf16 and
    // fp16) so that reading unwritten shared memory shows up rather than reading plausible zeros.
#if defined(__SANITIZE_ADDRESS__)
    int reallocate = ts->dyn_smem_bytes != cfg.shared_bytes || !ts->dyn_smem;
#else
    int reallocate = ts->dyn_smem_bytes < cfg.shared_bytes || !ts->dyn_smem;
#endif
    if (reallocate) {
        free(ts->dyn_smem);
        ts->dyn_smem = nullptr;
        if (posix_memalign(&ts->dyn_smem, 128, cfg.shared_bytes ? cfg.shared_bytes : 1) != 0) {
            fprintf(stderr, "cucc: cannot allocate %zu bytes of dynamic shared memory\n", cfg.shared_bytes);
            abort();
        }
        memset(ts->dyn_smem, 0xff, cfg.shared_bytes);
        ts->dyn_smem_bytes = cfg.shared_bytes;
    }
    ts->in_kernel = 1;
}

static uint3 block_index_of(long i, const dim3& g) {
    uint3 b;
    b.x = (unsigned)(i % g.x);
    b.y = (unsigned)((i / g.x) % g.y);
    b.z = (unsigned)(i / ((long)g.x * g.y));
    return b;
}

// CUCC_PROFILE=1: time every launch and print, at exit, each kernel's launches and total time (host
// time of the whole grid), largest first.
struct kernel_profile {
    long launches;
    double ms;
};
static std::mutex profile_mutex;
static std::map<std::string, kernel_profile>* profile_table;

static void print_kernel_profile(void) {
    std::vector<std::pair<double, std::string>> rows;
    double total = 0.0;
    for (auto& e : *profile_table) {
        rows.push_back({e.second.ms, e.first});
        total += e.second.ms;
    }
    std::sort(rows.rbegin(), rows.rend());
    fprintf(stderr, "cucc profile: %-40s %10s %12s %7s\n", "kernel", "launches", "total ms", "share");
    for (auto& r : rows) {
        const kernel_profile& k = (*profile_table)[r.second];
        fprintf(stderr, "cucc profile: %-40.40s %10ld %12.2f %6.1f%%\n", r.second.c_str(), k.launches, k.ms,
                100.0 * k.ms / total);
    }
}

static int profiling_enabled(void) {
    static int enabled = -1;
    if (enabled < 0) {
        const char* e = getenv("CUCC_PROFILE");
        enabled = e && *e && strcmp(e, "0") != 0;
        if (enabled) {
            profile_table = new std::map<std::string, kernel_profile>();
            atexit(print_kernel_profile);
        }
    }
    return enabled;
}

// ----------------------------------------------------------------------------------------------
// Threads and waits (doc/backend.md, "Threads and waits"). A process's cores are its own only when it does not share
// them: every process of a node starting a thread per core, and every idle thread spinning, turns a machine with
// more threads than cores into one that spends its time spinning (measured on 2 cores: two processes of 2 threads
// each ran a step 5-15x slower than one alone). libgomp and OpenBLAS read their settings from the environment in
// their constructors, which run after this .preinit_array function and after libc's, and libc's discards changes
// made to the environment before it. So this function, the first code of the process, computes the defaults from
// its envp and, when one of them is missing, executes the program again (/proc/self/exe, the same pid, arguments
// and environment) with them added:
//  - OMP_NUM_THREADS, when unset: max(1, the cores this process may run on / the processes of its node,
//    OMPI_COMM_WORLD_LOCAL_SIZE). The kernels' blocks and OpenBLAS's GEMMs run on that one OpenMP team.
//  - GOMP_SPINCOUNT, when neither it nor OMP_WAIT_POLICY is set and the process runs more than one thread (one has
//    no team to wait for): CUCC_SPIN_US microseconds of libgomp's spin loop
//    (one `pause` per iteration, timed here). An idle OpenMP thread spins that long, then sleeps on a futex;
//    libgomp's own default spins 300000 iterations (8 ms at this machine's 27 ns per pause).
//  - OMPI_MCA_mpi_yield_when_idle=1, when unset and the node's processes hold more threads than it has cores: what
//    Open MPI sets itself on a node it knows to be oversubscribed (mpirun knows only of its own processes).
// Setting OMP_NUM_THREADS (to 1, or with GOMP_SPINCOUNT or OMP_WAIT_POLICY) by hand starts a program without the second
// execution (under valgrind, say, which would not follow it). The NCCL waits (nccl.cpp) spin for CUCC_SPIN_US too,
// then sleep: __cucc_spin_ns. CUCC_SPIN_US=-1 keeps libgomp's and Open MPI's spinning waits
// (cpu/bench_oversubscription.sh measures both).
static const long DEFAULT_SPIN_US = 50;

// NAME's value in envp, or NULL (getenv reads libc's environment, which is not set up yet in a .preinit_array function)
static const char* env_value(char** envp, const char* name) {
    size_t n = strlen(name);
    for (char** e = envp; e && *e; e++)
        if (strncmp(*e, name, n) == 0 && (*e)[n] == '=') return *e + n + 1;
    return nullptr;
}

static long spin_us_of(const char* text) {
    if (!text || !*text) return DEFAULT_SPIN_US;
    char* end;
    long us = strtol(text, &end, 10);
    if (*end != '\0' || us < -1) {
        fprintf(stderr, "cucc: CUCC_SPIN_US=%s: expected microseconds (0 or more), or -1 for spinning waits\n", text);
        _exit(2);
    }
    return us;
}

extern "C" long __cucc_spin_ns(void) {
    static long ns = -2;
    if (ns == -2) {
        long us = spin_us_of(getenv("CUCC_SPIN_US"));
        ns = us < 0 ? -1 : us * 1000;
    }
    return ns;
}

// nanoseconds per iteration of a `pause` loop like libgomp's (the fastest of 3 rounds of 256)
static double pause_ns(void) {
    double best = 1e9;
    for (int round = 0; round < 3; round++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (int i = 0; i < 256; i++) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#else
            __asm__ __volatile__("" ::: "memory");
#endif
        }
        clock_gettime(CLOCK_MONOTONIC, &b);
        double ns = ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / 256.0;
        if (ns < best) best = ns;
    }
    return best > 0.1 ? best : 0.1;
}

static void default_threads_and_waits(int, char** argv, char** envp) {
    cpu_set_t allowed;
    long node_cores = sysconf(_SC_NPROCESSORS_ONLN), cores = node_cores;
    if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0) cores = CPU_COUNT(&allowed);
    if (cores < 1) cores = 1;
    if (node_cores < cores) node_cores = cores;
    const char* local = env_value(envp, "OMPI_COMM_WORLD_LOCAL_SIZE");
    long processes = local && atol(local) > 0 ? atol(local) : 1;
    const char* given = env_value(envp, "OMP_NUM_THREADS");
    long threads = given && atol(given) > 0 ? atol(given) : (cores / processes > 1 ? cores / processes : 1);
    long spin_us = spin_us_of(env_value(envp, "CUCC_SPIN_US"));

    static char threads_var[48], spin_var[48], yield_var[] = "OMPI_MCA_mpi_yield_when_idle=1";
    const char* added[3];
    int n_added = 0;
    if (!given || !*given) {
        snprintf(threads_var, sizeof(threads_var), "OMP_NUM_THREADS=%ld", threads);
        added[n_added++] = threads_var;
    }
    // one thread has no team to wait for: its spin count is moot (and the program need not run again for it)
    if (spin_us >= 0 && threads > 1 && !env_value(envp, "GOMP_SPINCOUNT") && !env_value(envp, "OMP_WAIT_POLICY")) {
        snprintf(spin_var, sizeof(spin_var), "GOMP_SPINCOUNT=%ld", (long)(spin_us * 1000.0 / pause_ns()));
        added[n_added++] = spin_var;
    }
    if (spin_us >= 0 && processes * threads > node_cores && !env_value(envp, "OMPI_MCA_mpi_yield_when_idle"))
        added[n_added++] = yield_var;
    if (n_added == 0) return;
    size_t count = 0;
    while (envp && envp[count]) count++;
    char** env = (char**)alloca((count + n_added + 1) * sizeof(char*));
    for (size_t i = 0; i < count; i++) env[i] = envp[i];
    for (int i = 0; i < n_added; i++) env[count + i] = (char*)added[i];
    env[count + n_added] = nullptr;
    execve("/proc/self/exe", argv, env);
    // no /proc: run on with the libraries' own defaults
}
__attribute__((section(".preinit_array"), used)) static void (*const cucc_preinit)(int, char**, char**) =
    default_threads_and_waits;

// ----------------------------------------------------------------------------------------------
// Production sizes on a CPU: CUCC_EDGE_BLOCKS=K (doc/backend.md, "Edge mode"). Only the first and last K blocks of
// every grid run (all of them when the grid has at most 2K); device allocations are lazily backed and not
// poisoned; memset/memcpy check their whole range and move only its first and last K * 64 KiB; cuBLAS(Lt) and
// NCCL check their full arguments and compute only edges (cublas.cpp, nccl.cpp). Read once, at the first use.
static long edge_k = -1;
extern "C" int __cucc_edge_blocks(void) {
    if (edge_k < 0) {
        const char* e = getenv("CUCC_EDGE_BLOCKS");
        long k = e && *e ? strtol(e, nullptr, 10) : 0;
        if (k < 0) k = 0;
#ifdef CUCC_CHECK
        if (k > 0) {
            fprintf(stderr, "cucc: CUCC_EDGE_BLOCKS does not combine with the checking mode (--check)\n");
            exit(1);
        }
#endif
        edge_k = k;
    }
    return (int)edge_k;
}
static const size_t EDGE_BYTES_PER_K = 64 * 1024;
static const size_t EDGE_DEVICE_BYTES = (size_t)143771 << 20;  // what cudaMemGetInfo reports in edge mode (H200)

static void run_grid(const __cucc_launch_config& cfg, const char* kernel_name, void (*body)(void*), void* closure,
                     int ftz);

static void profiled_run_grid(const __cucc_launch_config& cfg, const char* kernel_name, void (*body)(void*),
                              void* closure, int ftz) {
    if (!profiling_enabled()) {
        run_grid(cfg, kernel_name, body, closure, ftz);
        return;
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    run_grid(cfg, kernel_name, body, closure, ftz);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    std::lock_guard<std::mutex> lock(profile_mutex);
    kernel_profile& k = (*profile_table)[kernel_name];
    k.launches++;
    k.ms += (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) * 1e-6;
}

void __cucc_run_grid(const __cucc_launch_config& cfg, const char* kernel_name, void (*body)(void*), void* closure) {
    profiled_run_grid(cfg, kernel_name, body, closure, 0);
}
void __cucc_run_grid_ftz(const __cucc_launch_config& cfg, const char* kernel_name, void (*body)(void*), void* closure) {
    profiled_run_grid(cfg, kernel_name, body, closure, 1);
}

static void run_grid(const __cucc_launch_config& cfg, const char* kernel_name, void (*body)(void*), void* closure,
                     int ftz) {
    thread_state* caller = get_thread_state();
    if (caller->in_kernel) {
        fprintf(stderr, "cucc: kernel '%s' launched from inside kernel '%s': dynamic parallelism is not supported\n",
                kernel_name, caller->kernel);
        abort();
    }
    cudaError_t err = validate_launch(cfg, kernel_name);
    if (err != cudaSuccess) {
#ifdef CUCC_CHECK
        if (cucc_check_on(CUCC_CHECK_LIMIT))
            cucc_check_report(CUCC_CHECK_LIMIT, "the launch of kernel '%s' with grid (%u,%u,%u), block (%u,%u,%u) and %zu "
                              "bytes of dynamic shared memory (at most %d for it) fails on a GPU with %s", kernel_name,
                              cfg.grid.x, cfg.grid.y, cfg.grid.z, cfg.block.x, cfg.block.y, cfg.block.z, cfg.shared_bytes,
                              max_dynamic_shared_for(kernel_name), cudaGetErrorName(err));
#endif
        last_error = err;
        return;
    }
    long nblocks = (long)cfg.grid.x * cfg.grid.y * cfg.grid.z;
#ifdef CUCC_CHECK
    __cucc_edge_blocks();  // refuses CUCC_EDGE_BLOCKS in a checked build
    // the checking mode runs the blocks one after another on this thread, in order (check.h says why)
    void* dynamic_smem;
    cucc_check_launch_begin(kernel_name, cfg.grid, cfg.block, cfg.shared_bytes, max_dynamic_shared_for(kernel_name),
                            cfg.stream, &dynamic_smem);
    set_launch(caller, cfg, kernel_name, body, closure);
    caller->dyn_smem = dynamic_smem;
    caller->in_kernel = 1;
    unsigned csr = enter_device_code(ftz);
    for (long i = 0; i < nblocks; i++) {
        uint3 b = block_index_of(i, cfg.grid);
        cucc_check_block_begin(b, i, caller->nthreads, &caller->threads[0].check, sizeof(cuda_thread));
        run_block(caller, b);
        cucc_check_block_end();
    }
    leave_device_code(ftz, csr);
    caller->in_kernel = 0;
    caller->dyn_smem = nullptr;
    caller->dyn_smem_bytes = 0;
    cucc_check_launch_end();
    return;
#endif
    // edge mode: the blocks run are j = 0 .. nrun-1, block j < k being block j and the others the last k
    long k = __cucc_edge_blocks(), nrun = nblocks, skip = 0;
    if (k > 0 && nblocks > 2 * k) {
        nrun = 2 * k;
        skip = nblocks - 2 * k;
    }
#define CUCC_EDGE_BLOCK(j) ((j) < k || skip == 0 ? (j) : (j) + skip)
    int nthreads = omp_get_max_threads();
    if (nrun == 1 || nthreads == 1) {
        prepare_thread_for_launch(caller, cfg, kernel_name, body, closure);
        unsigned csr = enter_device_code(ftz);
        for (long j = 0; j < nrun; j++) run_block(caller, block_index_of(CUCC_EDGE_BLOCK(j), cfg.grid));
        leave_device_code(ftz, csr);
        caller->in_kernel = 0;
        return;
    }
    long chunk = nrun / ((long)nthreads * 8);
    if (chunk < 1) chunk = 1;
#pragma omp parallel
    {
        thread_state* ts = get_thread_state();
        prepare_thread_for_launch(ts, cfg, kernel_name, body, closure);
        unsigned csr = enter_device_code(ftz);
#pragma omp for schedule(dynamic, chunk)
        for (long j = 0; j < nrun; j++) run_block(ts, block_index_of(CUCC_EDGE_BLOCK(j), cfg.grid));
        leave_device_code(ftz, csr);
        ts->in_kernel = 0;
    }
}

void* __cucc_dynamic_shared(void) { return kernel_state("extern __shared__")->dyn_smem; }

void* __cucc_static_shared(void** per_thread_slot, size_t bytes, size_t align) {
#ifdef CUCC_CHECK
    return cucc_check_static_shared(per_thread_slot, bytes, align < 16 ? 16 : align);
#endif
    if (!*per_thread_slot) {
        if (align < 16) align = 16;
        if (posix_memalign(per_thread_slot, align, bytes ? bytes : 1) != 0) {
            fprintf(stderr, "cucc: cannot allocate %zu bytes of static shared memory\n", bytes);
            abort();
        }
        memset(*per_thread_slot, 0xff, bytes);
    }
    return *per_thread_slot;
}

void __cucc_trap(const char* file, int line) {
    thread_state* ts = kernel_state("__trap");
    fault(ts, ts->current, "__trap() at %s:%d", file, line);
}

long long clock64(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000ll + t.tv_nsec;
}

const char* __cucc_context_switch_kind(void) { return context_switch_kind; }

// ----------------------------------------------------------------------------------------------
// Memory. Device memory is host memory; allocations are tracked so that cudaFree of a pointer that
// cudaMalloc did not return is an error, as on a GPU, and are filled with 0xff (NaN in every float
// format) because GPU memory is not zeroed and a kernel that reads what nobody wrote must not pass.
static std::mutex memory_mutex;
static std::map<void*, size_t> device_allocations;
static std::map<void*, size_t> host_allocations;
static size_t device_bytes_in_use = 0;

// Edge mode: device allocations are mmap'ed with MAP_NORESERVE (pages exist once touched) and not poisoned.
static int edge_mapped(const std::map<void*, size_t>& table) {
    return &table == &device_allocations && __cucc_edge_blocks() > 0;
}

static cudaError_t tracked_alloc(void** ptr, size_t size, std::map<void*, size_t>& table, int poison) {
    if (!ptr) return last_error = cudaErrorInvalidValue;
    *ptr = nullptr;
    if (size == 0) return cudaSuccess;
    void* p = nullptr;
    if (edge_mapped(table)) {
        p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return last_error = cudaErrorMemoryAllocation;
        poison = 0;
    } else if (posix_memalign(&p, 256, size) != 0) {
        return last_error = cudaErrorMemoryAllocation;
    }
    if (poison) memset(p, 0xff, size);
    std::lock_guard<std::mutex> lock(memory_mutex);
    table[p] = size;
    if (&table == &device_allocations) device_bytes_in_use += size;
    *ptr = p;
    return cudaSuccess;
}

static cudaError_t tracked_free(void* ptr, std::map<void*, size_t>& table) {
    if (!ptr) return cudaSuccess;
    size_t size;
    {
        std::lock_guard<std::mutex> lock(memory_mutex);
        auto it = table.find(ptr);
        if (it == table.end()) return last_error = cudaErrorInvalidValue;
        size = it->second;
        if (&table == &device_allocations) device_bytes_in_use -= it->second;
        table.erase(it);
    }
    if (edge_mapped(table)) munmap(ptr, size);
    else free(ptr);
    return cudaSuccess;
}

// Edge mode: 1 if [p, p + bytes) lies inside one live device allocation, 0 if it starts inside one and runs past
// its end (or bytes overflow), -1 if p is in none (host memory). cublas.cpp and nccl.cpp check their operands so.
extern "C" int __cucc_edge_range(const void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(memory_mutex);
    auto it = device_allocations.upper_bound((void*)p);
    if (it == device_allocations.begin()) return -1;
    --it;
    uintptr_t base = (uintptr_t)it->first, q = (uintptr_t)p;
    if (q >= base + it->second) return -1;
    return bytes <= it->second - (q - base) ? 1 : 0;
}

// Edge mode: a copy's or memset's pointer that is device memory (or must be, by the copy's kind) is checked over
// the whole range; a failure is a line and an abort, as a GPU's illegal address would end the program.
static void edge_check(const char* name, const char* which, const void* p, size_t bytes, int must_be_device) {
    int r = __cucc_edge_range(p, bytes);
    if (r == 1 || (r == -1 && !must_be_device)) return;
    fprintf(stderr, "cucc: edge mode: %s: %s %p + %zu bytes %s\n", name, which, p, bytes,
            r == 0 ? "runs past the end of its device allocation" : "is not device memory");
    fflush(stderr);
    abort();
}

// Edge mode: runs f(offset, length) on the first and last K * 64 KiB of [0, count) (all of it when shorter).
template <typename F>
static void edge_windows(size_t count, F f) {
    size_t e = (size_t)__cucc_edge_blocks() * EDGE_BYTES_PER_K;
    if (count <= 2 * e) {
        f(0, count);
    } else {
        f(0, e);
        f(count - e, e);
    }
}

extern "C" {

#ifdef CUCC_CHECK
// the checking mode places every allocation in its arena (check.cpp), which tracks bounds and frees
static cudaError_t checked_alloc(void** ptr, size_t size, int kind) {
    if (!ptr) return last_error = cudaErrorInvalidValue;
    *ptr = nullptr;
    if (size == 0) return cudaSuccess;
    cudaError_t err = cucc_check_malloc(ptr, size, kind);
    return err == cudaSuccess ? err : (last_error = err);
}
cudaError_t cudaMalloc(void** devPtr, size_t size) { return checked_alloc(devPtr, size, CUCC_MEM_DEVICE); }
cudaError_t cudaMallocManaged(void** devPtr, size_t size, unsigned int flags) {
    if (flags != cudaMemAttachGlobal && flags != cudaMemAttachHost) return last_error = cudaErrorInvalidValue;
    return checked_alloc(devPtr, size, CUCC_MEM_MANAGED);
}
cudaError_t cudaFree(void* devPtr) {
    if (!devPtr) return cudaSuccess;
    cudaError_t err = cucc_check_free(devPtr, CUCC_MEM_DEVICE);
    if (err != cudaSuccess) err = cucc_check_free(devPtr, CUCC_MEM_MANAGED);
    return err == cudaSuccess ? err : (last_error = err);
}
cudaError_t cudaMallocHost(void** ptr, size_t size) { return checked_alloc(ptr, size, CUCC_MEM_PINNED); }
cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int) { return checked_alloc(pHost, size, CUCC_MEM_PINNED); }
cudaError_t cudaFreeHost(void* ptr) {
    if (!ptr) return cudaSuccess;
    cudaError_t err = cucc_check_free(ptr, CUCC_MEM_PINNED);
    return err == cudaSuccess ? err : (last_error = err);
}
#else
cudaError_t cudaMalloc(void** devPtr, size_t size) { return tracked_alloc(devPtr, size, device_allocations, 1); }
cudaError_t cudaMallocManaged(void** devPtr, size_t size, unsigned int flags) {
    if (flags != cudaMemAttachGlobal && flags != cudaMemAttachHost) return last_error = cudaErrorInvalidValue;
    return tracked_alloc(devPtr, size, device_allocations, 1);
}
cudaError_t cudaFree(void* devPtr) { return tracked_free(devPtr, device_allocations); }
cudaError_t cudaMallocHost(void** ptr, size_t size) { return tracked_alloc(ptr, size, host_allocations, 0); }
cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int) { return tracked_alloc(pHost, size, host_allocations, 0); }
cudaError_t cudaFreeHost(void* ptr) { return tracked_free(ptr, host_allocations); }
#endif

static cudaError_t copy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream, int async,
                        const char* name) {
    if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return last_error = cudaErrorInvalidMemcpyDirection;
    if (count == 0) return cudaSuccess;
    if (!dst || !src) return last_error = cudaErrorInvalidValue;
#ifdef CUCC_CHECK
    cudaError_t err = cucc_check_memcpy(dst, src, count, kind, stream, async, name);
    return err == cudaSuccess ? err : (last_error = err);
#else
    (void)stream, (void)async;
    if (__cucc_edge_blocks() > 0 && kind != cudaMemcpyHostToHost) {
        edge_check(name, "destination", dst, count, kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice);
        edge_check(name, "source", src, count, kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice);
        edge_windows(count, [&](size_t off, size_t len) { memmove((char*)dst + off, (const char*)src + off, len); });
        return cudaSuccess;
    }
    memmove(dst, src, count);
    return cudaSuccess;
#endif
}
static cudaError_t fill(void* devPtr, int value, size_t count, cudaStream_t stream, const char* name) {
    if (count == 0) return cudaSuccess;
    if (!devPtr) return last_error = cudaErrorInvalidValue;
#ifdef CUCC_CHECK
    return cucc_check_memset(devPtr, value, count, stream, name);
#else
    (void)stream;
    if (__cucc_edge_blocks() > 0) {
        edge_check(name, "destination", devPtr, count, 1);
        edge_windows(count, [&](size_t off, size_t len) { memset((char*)devPtr + off, value, len); });
        return cudaSuccess;
    }
    memset(devPtr, value, count);
    return cudaSuccess;
#endif
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
    return copy(dst, src, count, kind, 0, 0, "cudaMemcpy");
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream) {
    return copy(dst, src, count, kind, stream, 1, "cudaMemcpyAsync");
}
cudaError_t cudaMemset(void* devPtr, int value, size_t count) { return fill(devPtr, value, count, 0, "cudaMemset"); }
cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
    return fill(devPtr, value, count, stream, "cudaMemsetAsync");
}
// A __device__ or __constant__ variable is an ordinary global here; the symbol is its address (host memory, so the
// checking mode does not track it, and the copy's kind is not checked against it).
cudaError_t cudaMemcpyToSymbol(const void* symbol, const void* src, size_t count, size_t offset, enum cudaMemcpyKind kind) {
    if (!symbol) return last_error = cudaErrorInvalidSymbol;
    return copy((char*)symbol + offset, src, count, kind == cudaMemcpyHostToDevice ? cudaMemcpyDefault : kind, 0, 0,
                "cudaMemcpyToSymbol");
}
cudaError_t cudaMemcpyFromSymbol(void* dst, const void* symbol, size_t count, size_t offset, enum cudaMemcpyKind kind) {
    if (!symbol) return last_error = cudaErrorInvalidSymbol;
    return copy(dst, (const char*)symbol + offset, count, kind == cudaMemcpyDeviceToHost ? cudaMemcpyDefault : kind, 0,
                0, "cudaMemcpyFromSymbol");
}

static size_t meminfo_kib(const char* key) {
    FILE* f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    size_t value = 0;
    size_t keylen = strlen(key);
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, key, keylen) == 0 && line[keylen] == ':') {
            value = strtoull(line + keylen + 1, nullptr, 10);
            break;
        }
    }
    fclose(f);
    return value;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
    if (!free_bytes || !total_bytes) return last_error = cudaErrorInvalidValue;
    if (__cucc_edge_blocks() > 0) {
        // edge mode: allocations are lazily backed, so the device is an H200's 141 GiB whatever the host has
        std::lock_guard<std::mutex> lock(memory_mutex);
        *total_bytes = EDGE_DEVICE_BYTES;
        *free_bytes = EDGE_DEVICE_BYTES > device_bytes_in_use ? EDGE_DEVICE_BYTES - device_bytes_in_use : 0;
        return cudaSuccess;
    }
    *total_bytes = meminfo_kib("MemTotal") * 1024;
    *free_bytes = meminfo_kib("MemAvailable") * 1024;
    return cudaSuccess;
}

// ----------------------------------------------------------------------------------------------
// Streams and events. Work completes when it is issued, so synchronisation has nothing to wait for;
// an event records the host clock when it is recorded, which makes elapsed times real CPU times.
struct CUstream_st {
    unsigned flags;
    int priority;
};
struct CUevent_st {
    unsigned flags;
    int recorded;
    double time_ms;
};

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int flags, int priority) {
    if (!s) return last_error = cudaErrorInvalidValue;
    if (flags != cudaStreamDefault && flags != cudaStreamNonBlocking) return last_error = cudaErrorInvalidValue;
    *s = new CUstream_st{flags, priority};
#ifdef CUCC_CHECK
    cucc_check_stream_create(*s, flags);
#endif
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) { return cudaStreamCreateWithPriority(s, flags, 0); }
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithPriority(s, cudaStreamDefault, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    if (!s) return last_error = cudaErrorInvalidResourceHandle;
#ifdef CUCC_CHECK
    cucc_check_stream_destroy(s);
#endif
    delete s;
    return cudaSuccess;
}
// Work is complete when issued; the checking mode still orders the host after the stream's work here and no sooner.
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
#ifdef CUCC_CHECK
    cucc_check_host_sync_stream(s);
#else
    (void)s;
#endif
    return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
#ifdef CUCC_CHECK
    return cucc_check_query_stream(s) ? cudaSuccess : cudaErrorNotReady;
#else
    (void)s;
    return cudaSuccess;
#endif
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t event, unsigned int) {
    if (!event) return last_error = cudaErrorInvalidResourceHandle;
#ifdef CUCC_CHECK
    cucc_check_stream_wait_event(s, event);
#else
    (void)s;
#endif
    return cudaSuccess;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return cudaSuccess;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
    if (!e) return last_error = cudaErrorInvalidValue;
    *e = new CUevent_st{flags, 0, 0.0};
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    if (!e) return last_error = cudaErrorInvalidResourceHandle;
#ifdef CUCC_CHECK
    cucc_check_event_destroy(e);
#endif
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    if (!e) return last_error = cudaErrorInvalidResourceHandle;
    e->recorded = 1;
    e->time_ms = now_ms();
#ifdef CUCC_CHECK
    cucc_check_event_record(e, s);
#else
    (void)s;
#endif
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    if (!e) return last_error = cudaErrorInvalidResourceHandle;
#ifdef CUCC_CHECK
    cucc_check_host_sync_event(e);
#endif
    return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
    if (!e) return last_error = cudaErrorInvalidResourceHandle;
#ifdef CUCC_CHECK
    return cucc_check_query_event(e) ? cudaSuccess : cudaErrorNotReady;
#else
    return cudaSuccess;
#endif
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    if (!ms || !start || !end) return last_error = cudaErrorInvalidResourceHandle;
    if ((start->flags & cudaEventDisableTiming) || (end->flags & cudaEventDisableTiming))
        return last_error = cudaErrorInvalidResourceHandle;
    if (!start->recorded || !end->recorded) return last_error = cudaErrorInvalidResourceHandle;
    *ms = (float)(end->time_ms - start->time_ms);
    return cudaSuccess;
}

// ----------------------------------------------------------------------------------------------
// Devices. One device per local MPI rank (as a GPU node gives each rank its own GPU), or as many as
// CUCC_DEVICE_COUNT says; all of them are this CPU and share its memory.
static thread_local int current_device = 0;

static int device_count(void) {
    const char* s = getenv("CUCC_DEVICE_COUNT");
    if (!s) s = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    int n = s ? atoi(s) : 1;
    return n < 1 ? 1 : n;
}

cudaError_t cudaGetDeviceCount(int* count) {
    if (!count) return last_error = cudaErrorInvalidValue;
    *count = device_count();
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= device_count()) return last_error = cudaErrorInvalidDevice;
    current_device = device;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
    if (!device) return last_error = cudaErrorInvalidValue;
    *device = current_device;
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
#ifdef CUCC_CHECK
    cucc_check_host_sync_device();
#endif
    return cudaSuccess;
}
cudaError_t cudaDeviceReset(void) { return cudaSuccess; }
cudaError_t cudaDriverGetVersion(int* v) {
    if (!v) return last_error = cudaErrorInvalidValue;
    *v = CUDART_VERSION;
    return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
    if (!v) return last_error = cudaErrorInvalidValue;
    *v = CUDART_VERSION;
    return cudaSuccess;
}

static void cpu_model_name(char* out, size_t n) {
    snprintf(out, n, "unknown CPU");
    FILE* f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, "model name", 10) == 0) {
            char* colon = strchr(line, ':');
            if (colon) {
                colon++;
                while (*colon == ' ') colon++;
                colon[strcspn(colon, "\n")] = 0;
                snprintf(out, n, "%s", colon);
            }
            break;
        }
    }
    fclose(f);
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
    if (!prop) return last_error = cudaErrorInvalidValue;
    if (device < 0 || device >= device_count()) return last_error = cudaErrorInvalidDevice;
    memset(prop, 0, sizeof(*prop));
    char model[200];
    cpu_model_name(model, sizeof(model));
    snprintf(prop->name, sizeof(prop->name), "CPU backend (cucc): %s", model);
    prop->totalGlobalMem = __cucc_edge_blocks() > 0 ? EDGE_DEVICE_BYTES : meminfo_kib("MemTotal") * 1024;
    prop->sharedMemPerBlock = DEFAULT_SHARED_PER_BLOCK;
    prop->sharedMemPerBlockOptin = OPTIN_SHARED_PER_BLOCK;
    prop->sharedMemPerMultiprocessor = OPTIN_SHARED_PER_BLOCK + 1024;
    prop->regsPerBlock = 65536;
    prop->regsPerMultiprocessor = 65536;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = MAX_BLOCK_THREADS;
    prop->maxThreadsDim[0] = 1024;
    prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 2147483647;
    prop->maxGridSize[1] = 65535;
    prop->maxGridSize[2] = 65535;
    prop->totalConstMem = 65536;
    prop->major = 8;
    prop->minor = 0;
    prop->multiProcessorCount = omp_get_max_threads();
    prop->maxThreadsPerMultiProcessor = 2048;
    prop->maxBlocksPerMultiProcessor = 32;
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    prop->l2CacheSize = l2 > 0 ? (int)l2 : 0;
    prop->concurrentKernels = 1;
    prop->unifiedAddressing = 1;
    prop->managedMemory = 1;
    prop->canMapHostMemory = 1;
    prop->integrated = 1;  // true: the "device" is the host and shares its memory
    prop->memoryBusWidth = 64;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
    if (!value) return last_error = cudaErrorInvalidValue;
    struct cudaDeviceProp p;
    cudaError_t err = cudaGetDeviceProperties(&p, device);
    if (err != cudaSuccess) return err;
    switch (attr) {
        case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
        case cudaDevAttrMaxBlockDimX: *value = p.maxThreadsDim[0]; break;
        case cudaDevAttrMaxBlockDimY: *value = p.maxThreadsDim[1]; break;
        case cudaDevAttrMaxBlockDimZ: *value = p.maxThreadsDim[2]; break;
        case cudaDevAttrMaxGridDimX: *value = p.maxGridSize[0]; break;
        case cudaDevAttrMaxGridDimY: *value = p.maxGridSize[1]; break;
        case cudaDevAttrMaxGridDimZ: *value = p.maxGridSize[2]; break;
        case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)p.sharedMemPerBlock; break;
        case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)p.sharedMemPerBlockOptin; break;
        case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = (int)p.sharedMemPerMultiprocessor; break;
        case cudaDevAttrWarpSize: *value = p.warpSize; break;
        case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
        case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
        case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
        case cudaDevAttrL2CacheSize: *value = p.l2CacheSize; break;
        case cudaDevAttrMaxThreadsPerMultiProcessor: *value = p.maxThreadsPerMultiProcessor; break;
        case cudaDevAttrMaxRegistersPerBlock: *value = p.regsPerBlock; break;
        case cudaDevAttrTotalConstantMemory: *value = (int)p.totalConstMem; break;
        case cudaDevAttrIntegrated: *value = p.integrated; break;
        case cudaDevAttrUnifiedAddressing: *value = p.unifiedAddressing; break;
        case cudaDevAttrManagedMemory: *value = p.managedMemory; break;
        case cudaDevAttrGlobalMemoryBusWidth: *value = p.memoryBusWidth; break;
        default: return last_error = cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes* attr, const void* func) {
    if (!attr || !func) return last_error = cudaErrorInvalidDeviceFunction;
    memset(attr, 0, sizeof(*attr));
    attr->maxThreadsPerBlock = MAX_BLOCK_THREADS;
    attr->maxDynamicSharedSizeBytes = DEFAULT_SHARED_PER_BLOCK;
    attr->ptxVersion = 80;
    attr->binaryVersion = 80;
    return cudaSuccess;
}

// Occupancy of the CPU "SM": as on a GPU, 2048 resident threads per SM, bounded by shared memory.
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* numBlocks, const void* func, int blockSize,
                                                          size_t dynamicSMemSize) {
    if (!numBlocks || !func || blockSize <= 0 || blockSize > MAX_BLOCK_THREADS) return last_error = cudaErrorInvalidValue;
    int by_threads = 2048 / blockSize;
    int by_smem = dynamicSMemSize ? (int)((OPTIN_SHARED_PER_BLOCK + 1024) / dynamicSMemSize) : 32;
    int n = by_threads < by_smem ? by_threads : by_smem;
    *numBlocks = n < 32 ? n : 32;
    return cudaSuccess;
}

// ----------------------------------------------------------------------------------------------
// The rest of the runtime API a small CUDA program commonly uses. Pitched copies and memsets are row by row (one
// operation per row in the checking mode); hints (prefetch, advice, cache configuration, limits) change nothing.
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind kind, cudaStream_t stream) {
    if (width > dpitch || width > spitch) return last_error = cudaErrorInvalidPitchValue;
    for (size_t r = 0; r < height; r++) {
        cudaError_t err = copy((char*)dst + r * dpitch, (const char*)src + r * spitch, width, kind, stream, 1,
                               "cudaMemcpy2DAsync");
        if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
}
cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                         enum cudaMemcpyKind kind) {
    if (width > dpitch || width > spitch) return last_error = cudaErrorInvalidPitchValue;
    for (size_t r = 0; r < height; r++) {
        cudaError_t err = copy((char*)dst + r * dpitch, (const char*)src + r * spitch, width, kind, 0, 0, "cudaMemcpy2D");
        if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
}
cudaError_t cudaMemset2DAsync(void* devPtr, size_t pitch, int value, size_t width, size_t height, cudaStream_t stream) {
    if (width > pitch) return last_error = cudaErrorInvalidPitchValue;
    for (size_t r = 0; r < height; r++) {
        cudaError_t err = fill((char*)devPtr + r * pitch, value, width, stream, "cudaMemset2DAsync");
        if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
}
cudaError_t cudaMemset2D(void* devPtr, size_t pitch, int value, size_t width, size_t height) {
    return cudaMemset2DAsync(devPtr, pitch, value, width, height, 0);
}
// Stream-ordered allocation: every operation has completed when issued, so the stream adds nothing.
cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t) { return cudaMalloc(devPtr, size); }
cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t) { return cudaFree(devPtr); }
// Page-locking existing host memory: it is host memory either way (the checking mode does not track it).
cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int) {
    return ptr && size ? cudaSuccess : (last_error = cudaErrorInvalidValue);
}
cudaError_t cudaHostUnregister(void* ptr) { return ptr ? cudaSuccess : (last_error = cudaErrorInvalidValue); }
cudaError_t cudaHostGetDevicePointer(void** pDevice, void* pHost, unsigned int flags) {
    if (!pDevice || !pHost || flags != 0) return last_error = cudaErrorInvalidValue;
    *pDevice = pHost;  // one address space
    return cudaSuccess;
}
// A host function on a stream runs when the work before it has: here, at once.
cudaError_t cudaLaunchHostFunc(cudaStream_t, cudaHostFn_t fn, void* userData) {
    if (!fn) return last_error = cudaErrorInvalidValue;
    fn(userData);
    return cudaSuccess;
}
cudaError_t cudaStreamAddCallback(cudaStream_t stream, cudaStreamCallback_t callback, void* userData, unsigned int flags) {
    if (!callback || flags != 0) return last_error = cudaErrorInvalidValue;
    callback(stream, cudaSuccess, userData);
    return cudaSuccess;
}
cudaError_t cudaStreamGetFlags(cudaStream_t s, unsigned int* flags) {
    if (!flags) return last_error = cudaErrorInvalidValue;
    *flags = s && s != cudaStreamLegacy && s != cudaStreamPerThread ? s->flags : cudaStreamDefault;
    return cudaSuccess;
}
cudaError_t cudaMemPrefetchAsync(const void* devPtr, size_t, struct cudaMemLocation, unsigned int, cudaStream_t) {
    return devPtr ? cudaSuccess : (last_error = cudaErrorInvalidValue);
}
cudaError_t cudaMemAdvise(const void* devPtr, size_t, enum cudaMemoryAdvise, struct cudaMemLocation) {
    return devPtr ? cudaSuccess : (last_error = cudaErrorInvalidValue);
}
cudaError_t cudaDeviceSetLimit(enum cudaLimit, size_t) { return cudaSuccess; }
cudaError_t cudaDeviceGetLimit(size_t* pValue, enum cudaLimit limit) {
    if (!pValue) return last_error = cudaErrorInvalidValue;
    *pValue = limit == cudaLimitStackSize ? 64 * 1024 : limit == cudaLimitPrintfFifoSize ? 1 << 20
            : limit == cudaLimitMallocHeapSize ? 8 << 20 : 0;
    return cudaSuccess;
}
cudaError_t cudaDeviceSetCacheConfig(enum cudaFuncCache) { return cudaSuccess; }
cudaError_t cudaFuncSetCacheConfig(const void* func, enum cudaFuncCache) {
    return func ? cudaSuccess : (last_error = cudaErrorInvalidDeviceFunction);
}
cudaError_t cudaSetDeviceFlags(unsigned int) { return cudaSuccess; }

cudaError_t cudaGetLastError(void) {
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return last_error; }

const char* cudaGetErrorName(cudaError_t error) {
    switch (error) {
        case cudaSuccess: return "cudaSuccess";
        case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
        case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
        case cudaErrorInitializationError: return "cudaErrorInitializationError";
        case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
        case cudaErrorInvalidSymbol: return "cudaErrorInvalidSymbol";
        case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
        case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
        case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
        case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
        case cudaErrorNoDevice: return "cudaErrorNoDevice";
        case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
        case cudaErrorNotReady: return "cudaErrorNotReady";
        case cudaErrorNotSupported: return "cudaErrorNotSupported";
        case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
        case cudaErrorAssert: return "cudaErrorAssert";
        case cudaErrorInvalidPitchValue: return "cudaErrorInvalidPitchValue";
        default: return "cudaErrorUnknown";
    }
}
const char* cudaGetErrorString(cudaError_t error) {
    switch (error) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorMemoryAllocation: return "out of memory";
        case cudaErrorInitializationError: return "initialization error";
        case cudaErrorInvalidConfiguration: return "invalid configuration argument";
        case cudaErrorInvalidSymbol: return "invalid device symbol";
        case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
        case cudaErrorInvalidDevice: return "invalid device ordinal";
        case cudaErrorInvalidDeviceFunction: return "invalid device function";
        case cudaErrorInvalidResourceHandle: return "invalid resource handle";
        case cudaErrorNoDevice: return "no CUDA-capable device is detected";
        case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
        case cudaErrorNotReady: return "device not ready";
        case cudaErrorNotSupported: return "operation not supported";
        case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
        case cudaErrorAssert: return "device-side assert triggered";
        case cudaErrorInvalidPitchValue: return "invalid pitch argument";
        default: return "unrecognized error code";
    }
}

}  // extern "C"
