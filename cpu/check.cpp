// cpu/check.cpp: the checking mode of the CPU backend (cpu/cucc --check; built into the "check" variant of
// libcucc_rt.a by cpu/Makefile). doc/backend.md, "Checking mode", is its specification.
//
// How it sees memory accesses. cucc --check compiles the program with GCC's ThreadSanitizer instrumentation
// (-fsanitize=thread) but links no ThreadSanitizer runtime: the __tsan_* calls that GCC puts before every load,
// store and atomic land in this file. Device, managed, pinned and shared memory all live in one reserved arena,
// so "is this access ours" is one subtraction and compare; everything else (stacks, the heap, globals) returns
// at once.
//
// What it keeps. For every byte of the arena a 24-byte shadow cell: the operation (launch, copy, cuBLAS or NCCL
// call, or a host epoch) that last wrote it and last read it, the thread of the launch that did, and the block's
// sync clock at the time (cpu/check.h). For shared memory the "operation" is the block run, so memory left by an
// earlier block reads as unwritten. Per 256-byte granule, the allocation it belongs to, for bounds, use after
// free and the names in reports. Per operation, its stream and a vector clock over the streams (slot 0 is the
// host), so "is A ordered before B" is one comparison.
//
// Launches run their blocks one after another on the calling thread (runtime.cpp), so none of this needs locks
// on the kernel path; the host path (managed and pinned memory, operations, allocations) takes one mutex.
#include "check.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;

cucc_check_thread* cucc_check_current;
cucc_check_block cucc_check_block_state;

// ----------------------------------------------------------------------------------------------
// Which checks are on, and the report.
static const char* const check_names[] = {CUCC_CHECK_RACE,   CUCC_CHECK_SYNC,  CUCC_CHECK_INIT,   CUCC_CHECK_MEM,
                                          CUCC_CHECK_HOST,   CUCC_CHECK_STREAM, CUCC_CHECK_LIMIT, CUCC_CHECK_LDG,
                                          CUCC_CHECK_HANG,   CUCC_CHECK_NCCL,  CUCC_CHECK_CUBLAS};
enum { NUM_CHECKS = sizeof(check_names) / sizeof(check_names[0]) };
static int check_enabled[NUM_CHECKS];
static int checks_parsed;

static void parse_checks(void) {
    for (int i = 0; i < NUM_CHECKS; i++) check_enabled[i] = 1;
    const char* off = getenv("CUCC_CHECK_OFF");
    if (off) {
        std::string s(off);
        size_t start = 0;
        while (start <= s.size()) {
            size_t comma = s.find(',', start);
            std::string name = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
            int found = name.empty();
            for (int i = 0; i < NUM_CHECKS; i++)
                if (name == check_names[i]) check_enabled[i] = 0, found = 1;
            if (!found) {
                fprintf(stderr, "cucc: CUCC_CHECK_OFF=%s: unknown check '%s' (expected racecheck, synccheck, initcheck, "
                        "memcheck, hostcheck, streamcheck, limitcheck, ldgcheck, hangcheck, ncclcheck, cublascheck)\n",
                        off, name.c_str());
                _exit(2);
            }
            if (comma == std::string::npos) break;
            start = comma + 1;
        }
    }
    checks_parsed = 1;
}

extern "C" int cucc_check_on(const char* check) {
    if (!checks_parsed) parse_checks();
    for (int i = 0; i < NUM_CHECKS; i++)
        if (check == check_names[i] || strcmp(check, check_names[i]) == 0) return check_enabled[i];
    return 1;
}

extern "C" void cucc_check_report(const char* check, const char* fmt, ...) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    const char* rank = getenv("OMPI_COMM_WORLD_RANK");
    fflush(stdout);
    if (rank)
        fprintf(stderr, "cucc: %s: %s, rank %s\n", check, msg, rank);
    else
        fprintf(stderr, "cucc: %s: %s\n", check, msg);
    fflush(stderr);
    _exit(CUCC_CHECK_EXIT);
}

// file:line of a code address (the return address of a hook, so the call itself is one byte before it), through
// addr2line: reports are rare, and cucc --check compiles with -g.
static const char* call_file;  // the place of a check called with its file and line instead of a code address
static int call_line;

static const char* source_line(const void* pc, char* buf, size_t n) {
    if (!pc && call_file) {
        snprintf(buf, n, "%s:%d", call_file, call_line);
        return buf;
    }
    snprintf(buf, n, "pc %p", pc);
    Dl_info info;
    if (!pc || !dladdr(pc, &info) || !info.dli_fname) return buf;
    char exe[4096];
    const char* file = info.dli_fname;
    ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (len > 0) {
        exe[len] = 0;
        if (!file[0] || strcmp(file, exe) == 0 || strchr(file, '/') == nullptr) file = exe;
    }
    char cmd[4400];
    // -i: the chain of inlined calls, innermost first; the first frame outside the backend's own headers (an
    // atomicAdd of cucc.h, say) is the program's line
    snprintf(cmd, sizeof(cmd), "addr2line -i -e '%s' 0x%lx 2>/dev/null", file,
             (unsigned long)((uintptr_t)pc - (uintptr_t)info.dli_fbase - 1));
    FILE* p = popen(cmd, "r");
    if (!p) return buf;
    char line[1024];
    int found = 0;
    while (fgets(line, sizeof(line), p)) {
        if (line[0] == '?') continue;
        line[strcspn(line, "\n")] = 0;
        char* paren = strstr(line, " (discriminator");
        if (paren) *paren = 0;
        if (!found || strstr(buf, "/cpu/include/")) snprintf(buf, n, "%s", line);
        found = 1;
    }
    pclose(p);
    return buf;
}

// ----------------------------------------------------------------------------------------------
// The arena: device, managed, pinned and shared memory in one reservation, each part a bump allocator that never
// reuses an address (so a freed allocation stays recognisable), with a 256-byte gap after every allocation.
static const size_t GiB = (size_t)1 << 30;
static const size_t DEVICE_BYTES = 256 * GiB;
static const size_t MANAGED_BYTES = 16 * GiB;
static const size_t PINNED_BYTES = 16 * GiB;
static const size_t WINDOW_BYTES = 16 << 20;  // per OS thread: dynamic shared memory, then static declarations
static const size_t DYNAMIC_WINDOW = 256 << 10;
static const int MAX_WINDOWS = 64;
static const size_t SHARED_BYTES = WINDOW_BYTES * MAX_WINDOWS;
static const size_t MANAGED_OFF = DEVICE_BYTES, PINNED_OFF = MANAGED_OFF + MANAGED_BYTES,
                    SHARED_OFF = PINNED_OFF + PINNED_BYTES, ARENA_BYTES = SHARED_OFF + SHARED_BYTES;
static const int GRANULE_SHIFT = 8;

struct cell {
    uint32_t w_op, r_op;    // operation (shared memory: block run) of the last write and read; 0: none
    uint32_t w_tid, r_tid;  // thread of the launch, with the flags below
    uint32_t w_clk, r_clk;  // the block's sync clock at the access
};
// r_tid holds the latest reader; R_MANY: other readers of its block are not ordered before it either; R_ONE_WARP
// (with R_MANY): those readers are all lanes of the latest reader's warp, so a __syncwarp of the whole warp orders them
static const uint32_t TID_MASK = 0x0fffffffu;
static const uint32_t W_ATOMIC = 1u << 31;
static const uint32_t R_LDG = 1u << 31, R_ATOMIC = 1u << 30, R_MANY = 1u << 29, R_ONE_WARP = 1u << 28;

static uintptr_t arena_base;
static size_t arena_limit;
static uintptr_t heap_start, heap_end;  // the host's malloc heap (brk): kernels must not touch it  // 0 until the arena exists: every address is then outside it
static cell* cells;
static uint32_t* granules;  // allocation id per granule

enum region { R_DEVICE, R_MANAGED, R_PINNED, R_SHARED };
static const char* const region_names[] = {"device", "managed", "pinned host", "shared"};

struct allocation {
    uintptr_t base;
    size_t size;
    int kind;  // CUCC_MEM_* or 0 for a static shared declaration
    int live;
};
static std::vector<allocation> allocations(1);  // id 0: none
static size_t bump[3] = {0, MANAGED_OFF, PINNED_OFF};
static std::recursive_mutex host_mutex;

static void* reserve(size_t bytes, const char* what) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        fprintf(stderr, "cucc: the checking mode cannot reserve %zu GiB of address space for %s\n", bytes / GiB, what);
        _exit(2);
    }
    return p;
}

static void arena_init(void) {
    if (arena_limit) return;
    arena_base = (uintptr_t)reserve(ARENA_BYTES, "its memory arena");
    cells = (cell*)reserve(ARENA_BYTES * sizeof(cell), "shadow memory");
    granules = (uint32_t*)reserve((ARENA_BYTES >> GRANULE_SHIFT) * sizeof(uint32_t), "the allocation map");
    arena_limit = ARENA_BYTES;
    // the start of the malloc heap: field 47 (start_brk) of /proc/self/stat
    FILE* f = fopen("/proc/self/stat", "r");
    char stat[4096];
    if (f && fgets(stat, sizeof(stat), f)) {
        char* p = strrchr(stat, ')');
        for (int field = 2; p && field < 47; field++) p = strchr(p + 1, ' ');
        if (p) heap_start = strtoull(p + 1, nullptr, 10);
    }
    if (f) fclose(f);
    heap_end = heap_start;
}

static inline region region_of(size_t off) {
    return off < MANAGED_OFF ? R_DEVICE : off < PINNED_OFF ? R_MANAGED : off < SHARED_OFF ? R_PINNED : R_SHARED;
}

static uint32_t register_allocation(uintptr_t p, size_t bytes, int kind) {
    allocations.push_back({p, bytes, kind, 1});
    uint32_t id = (uint32_t)(allocations.size() - 1);
    size_t g0 = (p - arena_base) >> GRANULE_SHIFT, g1 = (p - arena_base + bytes - 1) >> GRANULE_SHIFT;
    for (size_t g = g0; g <= g1; g++) granules[g] = id;
    return id;
}

static const char* kind_name(int kind) {
    return kind == CUCC_MEM_DEVICE ? "cudaMalloc" : kind == CUCC_MEM_MANAGED ? "cudaMallocManaged"
         : kind == CUCC_MEM_PINNED ? "cudaMallocHost" : "static __shared__";
}

// "0x..: 8 bytes past the end of the 4096-byte cudaMalloc allocation at 0x..", for reports.
static const char* describe_address(uintptr_t a, char* buf, size_t n) {
    size_t off = a - arena_base;
    if (off >= arena_limit) {
        snprintf(buf, n, "%#lx (not device memory)", (unsigned long)a);
        return buf;
    }
    uint32_t id = granules[off >> GRANULE_SHIFT];
    if (!id) {  // in a gap: name the allocation just below
        for (size_t g = off >> GRANULE_SHIFT; g > 0 && g + 4096 > (off >> GRANULE_SHIFT) && !id; g--) id = granules[g - 1];
    }
    if (!id) {
        snprintf(buf, n, "%#lx (in no allocation)", (unsigned long)a);
        return buf;
    }
    const allocation& al = allocations[id];
    if (a >= al.base + al.size)
        snprintf(buf, n, "%#lx, %lu bytes past the end of the %zu-byte %s allocation at %#lx%s", (unsigned long)a,
                 (unsigned long)(a - al.base - al.size), al.size, kind_name(al.kind), (unsigned long)al.base,
                 al.live ? "" : " (freed)");
    else
        snprintf(buf, n, "%#lx, byte %lu of the %zu-byte %s allocation at %#lx%s", (unsigned long)a,
                 (unsigned long)(a - al.base), al.size, kind_name(al.kind), (unsigned long)al.base,
                 al.live ? "" : " (freed)");
    return buf;
}

// ----------------------------------------------------------------------------------------------
// Operations, streams and vector clocks.
enum { MAX_SLOTS = 32, HOST_SLOT = 0, LEGACY_SLOT = 1 };
struct operation {
    uint16_t slot;
    uint32_t clock;
    const char* name;
    const void* stream;
};
static std::vector<operation> ops(1);
static std::vector<uint32_t> op_clocks(MAX_SLOTS);  // MAX_SLOTS per operation
static uint32_t stream_vc[MAX_SLOTS][MAX_SLOTS];
static int slot_in_use[MAX_SLOTS] = {1, 1};
static int slot_blocking[MAX_SLOTS] = {0, 1};
static std::unordered_map<const void*, int> stream_slots;
static std::unordered_map<const void*, std::vector<uint32_t>> event_clocks;
static uint32_t host_vc[MAX_SLOTS];
static uint32_t host_op;  // the host's current epoch as an operation; 0: make one at the next host access
static uint32_t current_op;
static const uint32_t* current_vc;

static int slot_of(cudaStream_t s) {
    if (s == 0 || s == cudaStreamLegacy || s == cudaStreamPerThread) return LEGACY_SLOT;
    auto it = stream_slots.find(s);
    if (it == stream_slots.end()) cucc_check_report(CUCC_CHECK_STREAM, "stream %p was not created (or was destroyed)", (void*)s);
    return it->second;
}

static void join(uint32_t* into, const uint32_t* from) {
    for (int i = 0; i < MAX_SLOTS; i++)
        if (from[i] > into[i]) into[i] = from[i];
}

// What work on `slot` waits for when issued now: its stream, the host, and the legacy default stream's implicit
// synchronisation with blocking streams.
static void issue_clock(int slot, uint32_t* vc) {
    memcpy(vc, stream_vc[slot], sizeof(stream_vc[slot]));
    join(vc, host_vc);
    if (slot == LEGACY_SLOT) {
        for (int s = 2; s < MAX_SLOTS; s++)
            if (slot_in_use[s] && slot_blocking[s]) join(vc, stream_vc[s]);
    } else if (slot_blocking[slot]) {
        join(vc, stream_vc[LEGACY_SLOT]);
    }
}

static uint32_t new_op(int slot, const uint32_t* vc, const char* name, const void* stream) {
    ops.push_back({(uint16_t)slot, vc[slot], name, stream});
    op_clocks.insert(op_clocks.end(), vc, vc + MAX_SLOTS);
    return (uint32_t)(ops.size() - 1);
}

static inline int ordered(uint32_t earlier, uint32_t later) {
    if (earlier == later || earlier == 0) return 1;
    const operation& e = ops[earlier];
    return op_clocks[(size_t)later * MAX_SLOTS + e.slot] >= e.clock;
}

static uint32_t host_epoch(void) {
    if (!host_op) host_op = new_op(HOST_SLOT, host_vc, "host code", nullptr);
    return host_op;
}

extern "C" const char* cucc_check_op_describe(uint32_t op, char* buf, size_t n) {
    if (op == 0 || op >= ops.size()) snprintf(buf, n, "no operation");
    else if (ops[op].slot == HOST_SLOT) snprintf(buf, n, "host code");
    else if (ops[op].slot == LEGACY_SLOT) snprintf(buf, n, "%s on the default stream (#%u)", ops[op].name, op);
    else snprintf(buf, n, "%s on stream %p (#%u)", ops[op].name, ops[op].stream, op);
    return buf;
}

extern "C" int cucc_check_ordered(uint32_t earlier, uint32_t later) { return ordered(earlier, later); }

static void land_pending_copies(uint32_t observer);

extern "C" uint32_t cucc_check_op_begin(cudaStream_t stream, const char* name) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    arena_init();
    int slot = slot_of(stream);
    uint32_t vc[MAX_SLOTS];
    issue_clock(slot, vc);
    vc[slot]++;
    memcpy(stream_vc[slot], vc, sizeof(vc));
    uint32_t op = new_op(slot, vc, name, stream);
    host_vc[HOST_SLOT]++;  // what the host does next is not ordered before this operation
    host_op = 0;
    land_pending_copies(op);
    current_op = op;
    current_vc = &op_clocks[(size_t)op * MAX_SLOTS];
    return op;
}

extern "C" void cucc_check_op_end(void) {
    current_op = 0;
    current_vc = nullptr;
}

// ----------------------------------------------------------------------------------------------
// Asynchronous copies into pinned host memory land when the host synchronises with them.
struct pending_copy {
    uint32_t op;
    void* dst;
    char* data;
    size_t count;
};
static std::vector<pending_copy> pending;

static void land_pending_copies(uint32_t observer) {
    for (size_t i = 0; i < pending.size();) {
        if (ordered(pending[i].op, observer)) {
            memcpy(pending[i].dst, pending[i].data, pending[i].count);
            free(pending[i].data);
            pending.erase(pending.begin() + i);
        } else {
            i++;
        }
    }
}

static void host_joined(void) {
    host_op = 0;
    if (!pending.empty()) land_pending_copies(host_epoch());
}

void cucc_check_stream_create(cudaStream_t s, unsigned flags) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    int slot = -1;
    for (int i = 2; i < MAX_SLOTS && slot < 0; i++)
        if (!slot_in_use[i]) slot = i;
    if (slot < 0)
        cucc_check_report(CUCC_CHECK_STREAM, "more than %d streams exist at once; the checking mode tracks at most that "
                          "many", MAX_SLOTS - 2);
    slot_in_use[slot] = 1;
    slot_blocking[slot] = !(flags & cudaStreamNonBlocking);
    // a new stream starts after everything the host has seen (its first operation waits for nothing else)
    join(stream_vc[slot], host_vc);
    stream_slots[s] = slot;
}

void cucc_check_stream_destroy(cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    auto it = stream_slots.find(s);
    if (it == stream_slots.end()) return;
    slot_in_use[it->second] = 0;  // its clock stays: a stream that reuses the slot continues after it
    stream_slots.erase(it);
}

void cucc_check_event_record(cudaEvent_t e, cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    uint32_t vc[MAX_SLOTS];
    issue_clock(slot_of(s), vc);
    event_clocks[e].assign(vc, vc + MAX_SLOTS);
}

void cucc_check_event_destroy(cudaEvent_t e) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    event_clocks.erase(e);
}

void cucc_check_stream_wait_event(cudaStream_t s, cudaEvent_t e) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    auto it = event_clocks.find(e);
    if (it == event_clocks.end()) return;  // never recorded: waits for nothing, as in CUDA
    join(stream_vc[slot_of(s)], it->second.data());
}

void cucc_check_host_sync_stream(cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    uint32_t vc[MAX_SLOTS];
    issue_clock(slot_of(s), vc);
    join(host_vc, vc);
    host_joined();
}

void cucc_check_host_sync_event(cudaEvent_t e) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    auto it = event_clocks.find(e);
    if (it != event_clocks.end()) join(host_vc, it->second.data());
    host_joined();
}

// cudaStreamQuery and cudaEventQuery: work the host has not yet synchronised with answers "not ready" once (as on a
// GPU right after issuing it), so that a query whose answer is ignored does not count as a synchronisation; asked
// again, it is done, and the host is ordered after it.
static int covers(const uint32_t* vc, const uint32_t* work) {
    for (int i = 1; i < MAX_SLOTS; i++)
        if (work[i] > vc[i]) return 0;
    return 1;
}
static uint32_t queried_stream[MAX_SLOTS];  // the stream's own clock when it last answered "not ready"
static std::unordered_map<const void*, uint32_t> queried_event;

int cucc_check_query_stream(cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    int slot = slot_of(s);
    uint32_t vc[MAX_SLOTS];
    issue_clock(slot, vc);
    if (!covers(host_vc, vc) && queried_stream[slot] != vc[slot] + 1) {
        queried_stream[slot] = vc[slot] + 1;
        return 0;
    }
    join(host_vc, vc);
    host_joined();
    return 1;
}

int cucc_check_query_event(cudaEvent_t e) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    auto it = event_clocks.find(e);
    if (it == event_clocks.end()) return 1;
    uint32_t stamp = 1;
    for (int i = 1; i < MAX_SLOTS; i++) stamp = stamp * 31 + it->second[i];
    if (!covers(host_vc, it->second.data()) && queried_event[e] != stamp) {
        queried_event[e] = stamp;
        return 0;
    }
    join(host_vc, it->second.data());
    host_joined();
    return 1;
}

void cucc_check_host_sync_device(void) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    for (int s = 1; s < MAX_SLOTS; s++) join(host_vc, stream_vc[s]);
    host_joined();
}

// ----------------------------------------------------------------------------------------------
// The launch in flight.
struct launch_state {
    const char* kernel;
    uint32_t op;
    dim3 block;
    size_t dynamic_bytes;
    int max_dynamic;
    size_t static_bytes;  // static shared memory of the declarations this launch reached
    int window;
};
static launch_state launch;
static void report_unwritten_read(int shared_only);

// Publication between blocks of a launch, the pattern of CUDA's threadFenceReduction sample and of global locks: a
// block whose thread executes __threadfence() and then an atomic write (or volatile store) has published its writes
// made up to its sync clock then; a block that has read, atomically, a location another block wrote atomically has
// acquired what was published. Plain accesses of two blocks are then ordered. (Simpler than the memory model: any
// acquisition counts for every publisher.)
static std::unordered_map<uint32_t, uint32_t> published;  // block (linear) -> its sync clock when it published
static int block_acquired;

static thread_local int thread_window = -1;
static int windows_used;
// before each static declaration's memory in the window: the launch that last counted it, and its size
struct static_declaration {
    uint32_t counted_in;
    size_t bytes;
};
static size_t static_bump[MAX_WINDOWS];
static std::vector<std::pair<uint32_t, uint32_t>> exited_early;  // (tid, barriers) of threads that returned

static uintptr_t window_base(int w) { return arena_base + SHARED_OFF + (size_t)w * WINDOW_BYTES; }

const char* cucc_check_where(char* buf, size_t n) {
    if (!cucc_check_current) {
        snprintf(buf, n, "in host code");
        return buf;
    }
    snprintf(buf, n, "kernel '%s' block (%u,%u,%u) thread (%u,%u,%u)", launch.kernel, blockIdx.x, blockIdx.y,
             blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    return buf;
}

// "kernel 'k' block (1,0,0) thread (3,0,0) at f.cu:12 on stream 0x.." or "host code at f.cu:40"
static const char* where(const void* pc, char* buf, size_t n) {
    char src[1200], w[400];
    source_line(pc, src, sizeof(src));
    if (cucc_check_current) {
        cucc_check_where(w, sizeof(w));
        char op[300];
        cucc_check_op_describe(launch.op, op, sizeof(op));
        const char* on = strstr(op, " on ");
        snprintf(buf, n, "%s at %s%s", w, src, on ? on : "");
    } else {
        snprintf(buf, n, "host code at %s", src);
    }
    return buf;
}

// thread (x,y,z) of block (a,b,c) of the current launch, from a tid
static const char* describe_tid(uint32_t tid, char* buf, size_t n) {
    uint32_t per_block = launch.block.x * launch.block.y * launch.block.z;
    uint32_t b = tid / per_block, t = tid % per_block;
    snprintf(buf, n, "thread (%u,%u,%u) of block #%u", t % launch.block.x, (t / launch.block.x) % launch.block.y,
             t / (launch.block.x * launch.block.y), b);
    return buf;
}

// A kernel that runs longer than CUCC_CHECK_HANG_SECONDS (default 60) is reported with the block and thread that
// run: a wait that polls with plain loads is hoisted out of its loop by the compiler, so the spin detection of
// volatile and atomic loads (spin_check) never sees it.
static std::atomic<uint32_t> running_launch;  // the launch's op, 0 between launches
static std::atomic<long> launch_started;      // seconds, CLOCK_MONOTONIC

static long monotonic_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)t.tv_sec;
}

static void hang_watchdog(long limit) {
    for (;;) {
        sleep(1);
        uint32_t op = running_launch.load();
        if (op && monotonic_seconds() - launch_started.load() > limit && running_launch.load() == op &&
            cucc_check_on(CUCC_CHECK_HANG)) {
            const cucc_check_block& b = cucc_check_block_state;
            cucc_check_report(CUCC_CHECK_HANG, "kernel '%s' has run for over %ld s (CUCC_CHECK_HANG_SECONDS); block "
                              "(%u,%u,%u) is running: a thread that waits for another block (which may not have "
                              "started: blocks are not guaranteed to run at the same time) never finishes",
                              launch.kernel, limit, b.index.x, b.index.y, b.index.z);
        }
    }
}

static void start_hang_watchdog(void) {
    static int started;
    if (started) return;
    started = 1;
    const char* e = getenv("CUCC_CHECK_HANG_SECONDS");
    long limit = e && atol(e) > 0 ? atol(e) : 60;
    std::thread(hang_watchdog, limit).detach();
}

void cucc_check_launch_begin(const char* kernel, dim3 grid, dim3 block, size_t dynamic_shared, int max_dynamic_shared,
                             cudaStream_t stream, void** dynamic_smem_out) {
    (void)grid;
    start_hang_watchdog();
    uint32_t op = cucc_check_op_begin(stream, kernel);
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    if (thread_window < 0) {
        if (windows_used >= MAX_WINDOWS) {
            fprintf(stderr, "cucc: the checking mode supports launches from at most %d host threads\n", MAX_WINDOWS);
            _exit(2);
        }
        thread_window = windows_used++;
        static_bump[thread_window] = DYNAMIC_WINDOW;
    }
    launch.kernel = kernel;
    launch.op = op;
    launch.block = block;
    launch.dynamic_bytes = dynamic_shared;
    launch.max_dynamic = max_dynamic_shared;
    launch.static_bytes = 0;
    launch.window = thread_window;
    *dynamic_smem_out = (void*)window_base(thread_window);
    published.clear();
    heap_end = (uintptr_t)sbrk(0);
    launch_started.store(monotonic_seconds());
    running_launch.store(op);
}

void cucc_check_launch_end(void) {
    running_launch.store(0);
    report_unwritten_read(0);
    cucc_check_current = nullptr;
    cucc_check_op_end();
}

void cucc_check_block_begin(uint3 block_index, long block_linear, int nthreads, cucc_check_thread* threads,
                            size_t stride) {
    static uint32_t block_serial;
    cucc_check_block& b = cucc_check_block_state;
    b.serial = ++block_serial ? block_serial : ++block_serial;
    b.clock = 1;
    b.barriers = 0;
    b.first_tid = (uint32_t)(block_linear * nthreads) & TID_MASK;
    b.nthreads = nthreads;
    b.index = block_index;
    b.threads = (char*)threads;
    b.stride = stride;
    exited_early.clear();
    block_acquired = 0;
    // dynamic shared memory holds garbage at a block's start, as on a GPU
    if (launch.dynamic_bytes) memset((void*)window_base(launch.window), 0xff, launch.dynamic_bytes);
}

void cucc_check_thread_begin(cucc_check_thread* t, int linear_index) {
    t->tid = (cucc_check_block_state.first_tid + (uint32_t)linear_index) & TID_MASK;
    t->bar_stamp = 0;
    t->warp_stamp = 0;
    t->part_stamp = 0;
    t->part_lanes = 0;
    t->barriers = 0;
    t->exited = 0;
    t->fenced = 0;
    t->warp = linear_index / 32;
    t->spin_addr = 0;
    t->spin_value = 0;
    t->spin_count = 0;
}

void cucc_check_thread_end(cucc_check_thread* t) {
    t->exited = 1;
    // returning before the block's first barrier is legal (an early return); after one, the thread must have
    // passed every barrier the block passes
    if (t->barriers > 0) exited_early.push_back({t->tid, t->barriers});
}

uint32_t cucc_check_barrier_done(const char* file, int line) {
    cucc_check_block& b = cucc_check_block_state;
    b.barriers++;
    if (!exited_early.empty() && cucc_check_on(CUCC_CHECK_SYNC)) {
        for (auto& e : exited_early) {
            if (e.second < b.barriers) {
                char who[200], w[400];
                describe_tid(e.first, who, sizeof(who));
                cucc_check_report(CUCC_CHECK_SYNC, "%s returned after %u barrier(s) while the rest of its block reaches "
                                  "barrier %u at %s:%d: every thread must reach every barrier, %s", who, e.second,
                                  b.barriers, file, line, cucc_check_where(w, sizeof(w)));
            }
        }
    }
    return ++b.clock;
}

uint32_t cucc_check_warp_done(void) { return ++cucc_check_block_state.clock; }

void cucc_check_block_end(void) { report_unwritten_read(1); }

void* cucc_check_static_shared(void** slot, size_t bytes, size_t align) {
    if (!*slot) {
        std::lock_guard<std::recursive_mutex> lock(host_mutex);
        size_t& bump_off = static_bump[launch.window];
        size_t start = (bump_off + sizeof(static_declaration) + align - 1) & ~(align - 1);
        if (start + bytes + 256 > WINDOW_BYTES) {
            fprintf(stderr, "cucc: the checking mode's static shared memory window (%zu MiB) is full\n", WINDOW_BYTES >> 20);
            _exit(2);
        }
        bump_off = ((start + bytes + 255) & ~(size_t)255) + 256;
        register_allocation(window_base(launch.window) + start, bytes ? bytes : 1, 0);
        *slot = (void*)(window_base(launch.window) + start);
        *((static_declaration*)*slot - 1) = {0, bytes};
    }
    static_declaration* decl = (static_declaration*)*slot - 1;
    if (decl->counted_in != launch.op) {  // first time this launch reaches the declaration: count it
        decl->counted_in = launch.op;
        launch.static_bytes += bytes;
        if (cucc_check_on(CUCC_CHECK_LIMIT)) {
            char w[400];
            if (launch.static_bytes > 48 * 1024)
                cucc_check_report(CUCC_CHECK_LIMIT, "%zu bytes of static __shared__ memory, more than the 48 KiB a kernel "
                                  "may declare (ptxas refuses it), %s", launch.static_bytes, cucc_check_where(w, sizeof(w)));
            size_t limit = launch.max_dynamic > 48 * 1024 ? (size_t)227 * 1024 : (size_t)48 * 1024;
            if (launch.static_bytes + launch.dynamic_bytes > limit)
                cucc_check_report(CUCC_CHECK_LIMIT, "%zu bytes of static plus %zu bytes of dynamic shared memory exceed the "
                                  "block's %zu KiB (%s), so the launch fails on a GPU, %s", launch.static_bytes,
                                  launch.dynamic_bytes, limit / 1024,
                                  limit > 48 * 1024 ? "the opt-in maximum" : "raise it with cudaFuncSetAttribute",
                                  cucc_check_where(w, sizeof(w)));
        }
    }
    return *slot;
}

// ----------------------------------------------------------------------------------------------
// The access check.
enum access_mode {
    A_READ = 1,
    A_WRITE = 2,
    A_ATOMIC = 4,     // atomic read-modify-write, load or store
    A_VOLATILE = 8,   // a volatile access: an atomic in global memory (legacy flags), plain in shared memory
    A_LDG = 16,       // __ldg: the read-only data cache
    A_RANGE = 32,     // an aggregate copy of that many bytes (alignment checked only for 4, 8 and 16)
    A_UNALIGNED = 64  // the compiler knows it may be misaligned
};

[[noreturn]] static void report_access(const char* check, const void* pc, const char* fmt, ...) {
    char msg[1200], w[1800];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    cucc_check_report(check, "%s, %s", msg, where(pc, w, sizeof(w)));
}

// a thread's index in the current block, if it is one of its threads (ids are taken modulo TID_MASK + 1, so a block may
// straddle the wrap)
static inline uint32_t index_in_block(uint32_t tid) { return (tid - cucc_check_block_state.first_tid) & TID_MASK; }

static inline int same_block(uint32_t tid) {
    return index_in_block(tid) < (uint32_t)cucc_check_block_state.nthreads;
}

// Whether an access by `tid` at sync clock `clk` of this launch is ordered before the current thread's access.
static inline int ordered_in_launch(uint32_t tid, uint32_t clk) {
    const cucc_check_thread* t = cucc_check_current;
    if (tid == t->tid) return 1;
    if (!same_block(tid)) {
        if (!block_acquired) return 0;
        auto it = published.find(tid / (uint32_t)cucc_check_block_state.nthreads);
        return it != published.end() && it->second >= clk;
    }
    // a rendezvous orders the other thread's access only if that thread took part in it: one that has returned
    // took part in none after its last
    const cucc_check_block& b = cucc_check_block_state;
    const cucc_check_thread* other = (const cucc_check_thread*)(b.threads + (size_t)index_in_block(tid) * b.stride);
    uint32_t bar = t->bar_stamp, warp = t->warp_stamp;
    if (other->exited) {
        bar = bar < other->bar_stamp ? bar : other->bar_stamp;
        warp = warp < other->warp_stamp ? warp : other->warp_stamp;
    }
    if (bar > clk) return 1;
    uint32_t other_index = index_in_block(tid);
    if ((int)(other_index / 32) != t->warp) return 0;
    return warp > clk || (t->part_stamp > clk && ((t->part_lanes >> (other_index % 32)) & 1));
}

static inline int warp_of(uint32_t tid) { return (int)(index_in_block(tid) / 32); }

// Whether the readers of a cell with R_MANY (the latest `r_tid` at sync clock `clk`, and others unordered before it)
// are all ordered before the current thread: by a block barrier, or, when they are lanes of one warp and the current
// thread is one too, by a rendezvous of the whole warp (__syncwarp, a shuffle, a vote).
static inline int readers_ordered(uint32_t r_tid, uint32_t clk) {
    const cucc_check_thread* t = cucc_check_current;
    const uint32_t reader = r_tid & TID_MASK;
    if (!same_block(reader)) return 0;
    if (t->bar_stamp > clk) return 1;
    return (r_tid & R_ONE_WARP) && warp_of(reader) == t->warp && t->warp_stamp > clk;
}

static const char* access_word(int mode) {
    return (mode & A_ATOMIC) ? "atomic" : (mode & A_LDG) ? "__ldg read" : (mode & A_WRITE) ? "write" : "read";
}

// A read of unwritten memory is reported when its block (shared memory) or launch (global memory) ends, unless a
// race is found first: a thread that reads before another thread writes without a barrier between them is a
// race, and the runners' order makes it look like a read of unwritten memory.
struct unwritten_read_state {
    int pending;
    region r;
    char message[3000];
};
static unwritten_read_state unwritten_read;

static void remember_unwritten_read(uintptr_t a, int mode, region r, const void* pc) {
    char addr[300], w[1800];
    unwritten_read.pending = 1;
    unwritten_read.r = r;
    snprintf(unwritten_read.message, sizeof(unwritten_read.message), "%s of %s memory that nothing has written%s: %s, %s",
             access_word(mode), region_names[r], r == R_SHARED ? " in this block" : "",
             describe_address(a, addr, sizeof(addr)), where(pc, w, sizeof(w)));
}

static void report_unwritten_read(int shared_only) {
    if (unwritten_read.pending && (!shared_only || unwritten_read.r == R_SHARED))
        cucc_check_report(CUCC_CHECK_INIT, "%s", unwritten_read.message);
}

// One byte accessed by a kernel thread. `op` is the launch (global memory) or the block run (shared memory).
static inline void kernel_byte(cell* c, uintptr_t a, int mode, region r, uint32_t op, const void* pc) {
    const cucc_check_thread* t = cucc_check_current;
    const uint32_t me = t->tid, clk = cucc_check_block_state.clock;
    const int shared = r == R_SHARED;
    const int atomic = (mode & A_ATOMIC) || ((mode & A_VOLATILE) && !shared);
    char other[200], opname[300], addr[300];
    if (mode & A_READ) {
        if (c->w_op != op) {
            if ((r == R_DEVICE || shared) && (shared || c->w_op == 0) && !unwritten_read.pending &&
                cucc_check_on(CUCC_CHECK_INIT))
                remember_unwritten_read(a, mode, r, pc);
            if (!shared && !ordered(c->w_op, op) && cucc_check_on(CUCC_CHECK_STREAM))
                report_access(CUCC_CHECK_STREAM, pc, "reads %s, written by %s, which is not ordered before this kernel "
                              "(no event or synchronisation between them)", describe_address(a, addr, sizeof(addr)),
                              cucc_check_op_describe(c->w_op, opname, sizeof(opname)));
        } else {
            uint32_t writer = c->w_tid & TID_MASK;
            if ((mode & A_LDG) && cucc_check_on(CUCC_CHECK_LDG))
                report_access(CUCC_CHECK_LDG, pc, "__ldg of %s, which %s of this kernel wrote: __ldg is only for data "
                              "that is read-only for the whole kernel", describe_address(a, addr, sizeof(addr)),
                              writer == me ? "this thread" : describe_tid(writer, other, sizeof(other)));
            if (writer != me && !(atomic || (c->w_tid & W_ATOMIC)) && !ordered_in_launch(writer, c->w_clk) &&
                cucc_check_on(CUCC_CHECK_RACE))
                report_access(CUCC_CHECK_RACE, pc, "read of %s memory %s, written by %s with no %s between them",
                              region_names[r], describe_address(a, addr, sizeof(addr)),
                              describe_tid(writer, other, sizeof(other)),
                              same_block(writer) ? "barrier" : "kernel boundary (threads of different blocks)");
        }
        uint32_t flags = ((mode & A_LDG) ? R_LDG : 0) | (atomic ? R_ATOMIC : 0);
        if (c->r_op == op) {
            flags |= c->r_tid & R_LDG;  // read through __ldg in this launch: no write may follow
            uint32_t reader = c->r_tid & TID_MASK;
            int earlier_unordered = (c->r_tid & R_MANY) ? !readers_ordered(c->r_tid, c->r_clk)
                                                        : !ordered_in_launch(reader, c->r_clk);
            if (earlier_unordered) {  // keep what the unordered earlier readers were: several, one warp's, __ldg, atomic
                const int many = reader != me || (c->r_tid & R_MANY);
                const int one_warp = same_block(reader) && warp_of(reader) == t->warp &&
                                     (!(c->r_tid & R_MANY) || (c->r_tid & R_ONE_WARP));
                flags = (flags & ~R_ATOMIC) | (c->r_tid & R_LDG) | (c->r_tid & flags & R_ATOMIC) |
                        (many ? R_MANY : 0) | (many && one_warp ? R_ONE_WARP : 0);
            }
        } else {
            c->r_op = op;
        }
        c->r_tid = me | flags;
        c->r_clk = clk;
    }
    if (mode & A_WRITE) {
        if (c->w_op == op) {
            uint32_t writer = c->w_tid & TID_MASK;
            if (writer != me && !(atomic || (c->w_tid & W_ATOMIC)) && !ordered_in_launch(writer, c->w_clk) &&
                cucc_check_on(CUCC_CHECK_RACE))
                report_access(CUCC_CHECK_RACE, pc, "write of %s memory %s, also written by %s with no %s between them",
                              region_names[r], describe_address(a, addr, sizeof(addr)),
                              describe_tid(writer, other, sizeof(other)),
                              same_block(writer) ? "barrier" : "kernel boundary (threads of different blocks)");
        } else if (!shared && !ordered(c->w_op, op) && cucc_check_on(CUCC_CHECK_STREAM)) {
            report_access(CUCC_CHECK_STREAM, pc, "writes %s, also written by %s, which is not ordered before this kernel",
                          describe_address(a, addr, sizeof(addr)), cucc_check_op_describe(c->w_op, opname, sizeof(opname)));
        }
        if (c->r_op == op) {
            uint32_t reader = c->r_tid & TID_MASK;
            if ((c->r_tid & R_LDG) && cucc_check_on(CUCC_CHECK_LDG))
                report_access(CUCC_CHECK_LDG, pc, "writes %s, which this kernel reads with __ldg (only for data that is "
                              "read-only for the whole kernel)", describe_address(a, addr, sizeof(addr)));
            int unordered = (c->r_tid & R_MANY) ? !readers_ordered(c->r_tid, c->r_clk)
                                                : reader != me && !ordered_in_launch(reader, c->r_clk);
            if (unordered && !(atomic || (c->r_tid & R_ATOMIC)) && cucc_check_on(CUCC_CHECK_RACE))
                report_access(CUCC_CHECK_RACE, pc, "write of %s memory %s, which %s%s read with no %s between them",
                              region_names[r], describe_address(a, addr, sizeof(addr)),
                              describe_tid(reader, other, sizeof(other)), (c->r_tid & R_MANY) ? " and others" : "",
                              same_block(reader) ? "barrier" : "kernel boundary (threads of different blocks)");
        } else if (!shared && !ordered(c->r_op, op) && cucc_check_on(CUCC_CHECK_STREAM)) {
            report_access(CUCC_CHECK_STREAM, pc, "writes %s, which %s reads, and that is not ordered before this kernel",
                          describe_address(a, addr, sizeof(addr)), cucc_check_op_describe(c->r_op, opname, sizeof(opname)));
        }
        if (c->w_op != op && c->r_op != op) c->r_op = 0;
        c->w_op = op;
        c->w_tid = me | (atomic ? W_ATOMIC : 0);
        c->w_clk = clk;
    }
}

// One byte of managed or pinned memory accessed by host code.
static inline void host_byte(cell* c, uintptr_t a, int mode, region r, const void* pc) {
    uint32_t op = host_epoch();
    char opname[300], addr[300], w[1400];
    if (!cucc_check_on(CUCC_CHECK_STREAM)) return;
    if ((mode & A_READ) && !ordered(c->w_op, op))
        cucc_check_report(CUCC_CHECK_STREAM, "host code reads %s memory %s, written by %s, before synchronising with it, "
                          "%s", region_names[r], describe_address(a, addr, sizeof(addr)),
                          cucc_check_op_describe(c->w_op, opname, sizeof(opname)), where(pc, w, sizeof(w)));
    if (mode & A_WRITE) {
        if (!ordered(c->w_op, op))
            cucc_check_report(CUCC_CHECK_STREAM, "host code writes %s memory %s, written by %s, before synchronising with "
                              "it, %s", region_names[r], describe_address(a, addr, sizeof(addr)),
                              cucc_check_op_describe(c->w_op, opname, sizeof(opname)), where(pc, w, sizeof(w)));
        if (!ordered(c->r_op, op))
            cucc_check_report(CUCC_CHECK_STREAM, "host code writes %s memory %s, which %s still reads (the host has not "
                              "synchronised with it), %s", region_names[r], describe_address(a, addr, sizeof(addr)),
                              cucc_check_op_describe(c->r_op, opname, sizeof(opname)), where(pc, w, sizeof(w)));
        c->w_op = op;
        c->r_op = 0;
    } else if (ordered(c->r_op, op)) {
        c->r_op = op;
    }
}

// Bounds of an access inside the arena: the allocation (or static shared declaration) must be live and hold it.
static inline void check_bounds(size_t off, size_t n, region r, int mode, const void* pc) {
    uintptr_t a = arena_base + off;
    char addr[300];
    if (r == R_SHARED && off - (SHARED_OFF + (size_t)launch.window * WINDOW_BYTES) < DYNAMIC_WINDOW) {
        size_t in = off - (SHARED_OFF + (size_t)launch.window * WINDOW_BYTES);
        if (in + n > launch.dynamic_bytes && cucc_check_on(CUCC_CHECK_MEM))
            report_access(CUCC_CHECK_MEM, pc, "%zu-byte %s at byte %zu of dynamic shared memory, which has %zu bytes in "
                          "this launch", n, access_word(mode), in, launch.dynamic_bytes);
        return;
    }
    uint32_t id = granules[off >> GRANULE_SHIFT];
    const allocation& al = allocations[id];
    if ((!id || !al.live || a + n > al.base + al.size || a < al.base) && cucc_check_on(CUCC_CHECK_MEM))
        report_access(CUCC_CHECK_MEM, pc, "%zu-byte %s %s %s", n, access_word(mode),
                      id && !al.live ? "of freed memory" : "out of bounds", describe_address(a, addr, sizeof(addr)));
}

static inline void spin_check(uintptr_t a, size_t n, const void* pc) {
    cucc_check_thread* t = cucc_check_current;
    uint64_t value = 0;
    memcpy(&value, (const void*)a, n < 8 ? n : 8);
    if (t->spin_addr == a && t->spin_value == value) {
        if (++t->spin_count > (1u << 22) && cucc_check_on(CUCC_CHECK_HANG)) {
            char addr[300];
            report_access(CUCC_CHECK_HANG, pc, "this thread has read %s over 4 million times without it changing: it "
                          "waits for a thread that cannot run until it finishes (blocks of a grid are not guaranteed to "
                          "run at the same time, or in any order)", describe_address(a, addr, sizeof(addr)));
        }
    } else {
        t->spin_addr = a;
        t->spin_value = value;
        t->spin_count = 1;
    }
}

// An atomic on a __device__ variable (an ordinary global here, outside the arena, so without shadow cells): only its
// part in publication between blocks is tracked, by the block that last wrote it atomically in this launch.
static std::unordered_map<uintptr_t, std::pair<uint32_t, uint32_t>> global_atomics;  // address -> (launch, block)

static void global_variable_atomic(uintptr_t a, int mode) {
    uint32_t block = cucc_check_current->tid / (uint32_t)cucc_check_block_state.nthreads;
    auto& last = global_atomics[a];
    if ((mode & A_READ) && last.first == launch.op && last.second != block) block_acquired = 1;
    if (mode & A_WRITE) {
        last = {launch.op, block};
        if (cucc_check_current->fenced) {
            uint32_t& clock = published[block];
            if (cucc_check_block_state.clock > clock) clock = cucc_check_block_state.clock;
        }
    }
}

static void access(uintptr_t a, size_t n, int mode, const void* pc) {
    size_t off = a - arena_base;
    if (off >= arena_limit) {
        if (!cucc_check_current) return;
        if (a - heap_start < heap_end - heap_start && cucc_check_on(CUCC_CHECK_MEM))
            report_access(CUCC_CHECK_MEM, pc, "%zu-byte %s of host memory %#lx (the malloc heap) in a kernel: a GPU "
                          "cannot reach it (an illegal address)", n, access_word(mode), (unsigned long)a);
        if (mode & A_ATOMIC) global_variable_atomic(a, mode);
        return;
    }
    region r = region_of(off);
    if (!cucc_check_current) {  // host code
        if (r == R_DEVICE) {
            if (!cucc_check_on(CUCC_CHECK_HOST)) return;
            char addr[300], w[1400];
            cucc_check_report(CUCC_CHECK_HOST, "host code %s device memory %s (a GPU faults: only kernels and cudaMemcpy "
                              "may touch it), %s", (mode & A_WRITE) ? "writes" : "reads",
                              describe_address(a, addr, sizeof(addr)), where(pc, w, sizeof(w)));
        }
        if (r == R_SHARED) return;
        std::lock_guard<std::recursive_mutex> lock(host_mutex);
        check_bounds(off, n, r, mode, pc);
        for (size_t i = 0; i < n; i++) host_byte(&cells[off + i], a + i, mode, r, pc);
        return;
    }
    if (!(mode & A_UNALIGNED) && (n == 2 || n == 4 || n == 8 || n == 16) && (a & (n - 1)) &&
        (!(mode & A_RANGE) || n >= 4) && cucc_check_on(CUCC_CHECK_MEM)) {
        char addr[300];
        report_access(CUCC_CHECK_MEM, pc, "misaligned %zu-byte %s at %s (a GPU needs %zu-byte alignment)", n,
                      access_word(mode), describe_address(a, addr, sizeof(addr)), n);
    }
    check_bounds(off, n, r, mode, pc);
    if (r != R_SHARED) {  // polling loops: atomics (atomicCAS, atomicAdd(p, 0)) or volatile loads of one unchanging value
        if ((mode & A_ATOMIC) || (mode & (A_VOLATILE | A_WRITE)) == A_VOLATILE) spin_check(a, n, pc);
        else if ((mode & A_WRITE) && cucc_check_current->spin_addr == a) cucc_check_current->spin_count = 0;
    }
    uint32_t op = r == R_SHARED ? cucc_check_block_state.serial : launch.op;
    if (r != R_SHARED && (mode & (A_ATOMIC | A_VOLATILE))) {
        const cell* c = &cells[off];
        if ((mode & A_READ) && c->w_op == op && (c->w_tid & W_ATOMIC) && !same_block(c->w_tid & TID_MASK))
            block_acquired = 1;
        if ((mode & A_WRITE) && cucc_check_current->fenced) {
            uint32_t& clock = published[cucc_check_current->tid / (uint32_t)cucc_check_block_state.nthreads];
            if (cucc_check_block_state.clock > clock) clock = cucc_check_block_state.clock;
        }
    }
    // A byte's new shadow state depends only on its old one and on the access, so a byte whose cell equals the first
    // byte's old cell (a value written whole, the common case) takes the first byte's new cell without the checks:
    // they would find what the first byte's found, and that would have been reported already.
    if (n == 0) return;
    cell* first = &cells[off];
    const cell old_first = *first;
    kernel_byte(first, a, mode, r, op, pc);
    for (size_t i = 1; i < n; i++) {
        cell* c = &cells[off + i];
        if (memcmp(c, &old_first, sizeof(cell)) == 0) *c = *first;
        else kernel_byte(c, a + i, mode, r, op, pc);
    }
}

// ----------------------------------------------------------------------------------------------
// Library operations (cuBLAS, NCCL, copies) declare what they read and write.

// An operand outside its allocation is the library call's misuse: reported by its library's check.
static const char* library_check(uint32_t op) {
    const char* name = op && op < ops.size() ? ops[op].name : "";
    return strncmp(name, "nccl", 4) == 0 ? CUCC_CHECK_NCCL : strncmp(name, "cublas", 6) == 0 ? CUCC_CHECK_CUBLAS
                                                                                           : CUCC_CHECK_MEM;
}
// initcheck = 0: a copy's device-to-device source, whose unwritten bytes move along unused (cucc_check_memcpy)
static void op_bytes(const void* p, size_t bytes, int write, const char* what, int initcheck = 1) {
    if (!bytes) return;
    uintptr_t a = (uintptr_t)p;
    size_t off = a - arena_base;
    char opname[300], addr[300], mine[300];
    if (off >= arena_limit) return;  // host memory: nothing to track
    region r = region_of(off);
    uint32_t id = granules[off >> GRANULE_SHIFT];
    const allocation& al = allocations[id];
    const char* check = library_check(current_op);
    if ((!id || !al.live || a + bytes > al.base + al.size) && cucc_check_on(check))
        cucc_check_report(check, "%s: %s (%zu bytes from %s) %s",
                          cucc_check_op_describe(current_op, mine, sizeof(mine)), what, bytes,
                          describe_address(a, addr, sizeof(addr)),
                          id && !al.live ? "is freed memory" : "runs past the end of its allocation");
    for (size_t i = 0; i < bytes; i++) {
        cell* c = &cells[off + i];
        if (!write) {
            if (initcheck && r == R_DEVICE && c->w_op == 0 && cucc_check_on(CUCC_CHECK_INIT))
                cucc_check_report(CUCC_CHECK_INIT, "%s: %s reads %s, which nothing has written",
                                  cucc_check_op_describe(current_op, mine, sizeof(mine)), what,
                                  describe_address(a + i, addr, sizeof(addr)));
            if (!ordered(c->w_op, current_op) && cucc_check_on(CUCC_CHECK_STREAM))
                cucc_check_report(CUCC_CHECK_STREAM, "%s: %s reads %s, written by %s, which is not ordered before it",
                                  cucc_check_op_describe(current_op, mine, sizeof(mine)), what, describe_address(a + i, addr, sizeof(addr)),
                                  cucc_check_op_describe(c->w_op, opname, sizeof(opname)));
            if (c->r_op == 0 || ordered(c->r_op, current_op)) c->r_op = current_op;
        } else {
            if (!ordered(c->w_op, current_op) && cucc_check_on(CUCC_CHECK_STREAM))
                cucc_check_report(CUCC_CHECK_STREAM, "%s: %s writes %s, also written by %s, which is not ordered before it",
                                  cucc_check_op_describe(current_op, mine, sizeof(mine)), what, describe_address(a + i, addr, sizeof(addr)),
                                  cucc_check_op_describe(c->w_op, opname, sizeof(opname)));
            if (!ordered(c->r_op, current_op) && cucc_check_on(CUCC_CHECK_STREAM))
                cucc_check_report(CUCC_CHECK_STREAM, "%s: %s writes %s, which %s reads, and that is not ordered before it",
                                  cucc_check_op_describe(current_op, mine, sizeof(mine)), what, describe_address(a + i, addr, sizeof(addr)),
                                  cucc_check_op_describe(c->r_op, opname, sizeof(opname)));
            c->w_op = current_op;
            c->w_tid = 0;
            c->r_op = 0;
        }
    }
}

static void require_op(const char* fn) {
    if (!current_op) {
        fprintf(stderr, "cucc: internal error: %s outside an operation\n", fn);
        _exit(2);
    }
}

extern "C" void cucc_check_read(const void* p, size_t bytes, const char* what) {
    require_op("cucc_check_read");
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    op_bytes(p, bytes, 0, what);
}
extern "C" void cucc_check_write(void* p, size_t bytes, const char* what) {
    require_op("cucc_check_write");
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    op_bytes(p, bytes, 1, what);
}

static void op_matrix(const void* p, size_t rows, size_t cols, size_t ld, size_t elem, size_t batch, long long stride,
                      int write, const char* what) {
    if (!rows || !cols || !batch) return;
    // bounds of the whole span first, so that an overrun is named as the operand's, not as one column's
    uintptr_t lo = (uintptr_t)p, hi = (uintptr_t)p;
    for (size_t b = 0; b < batch; b += batch - 1 ? batch - 1 : 1) {
        uintptr_t first = (uintptr_t)p + (uintptr_t)((long long)b * stride * (long long)elem);
        uintptr_t last = first + ((cols - 1) * ld + rows) * elem;
        if (first < lo) lo = first;
        if (last > hi) hi = last;
        if (batch == 1) break;
    }
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    {
        size_t off = lo - arena_base;
        if (off < arena_limit) {
            uint32_t id = granules[off >> GRANULE_SHIFT];
            const allocation& al = allocations[id];
            const char* check = library_check(current_op);
            if ((!id || !al.live || hi > al.base + al.size || lo < al.base) && cucc_check_on(check)) {
                char opname[300], addr[300];
                cucc_check_report(check, "%s: %s (%zu x %zu, ld %zu, %zu byte(s) per element, batch %zu) spans "
                                  "%zu bytes from %s, past the end of its allocation",
                                  cucc_check_op_describe(current_op, opname, sizeof(opname)), what, rows, cols, ld, elem,
                                  batch, (size_t)(hi - lo), describe_address(lo, addr, sizeof(addr)));
            }
        }
    }
    for (size_t b = 0; b < batch; b++)
        for (size_t j = 0; j < cols; j++)
            op_bytes((const char*)p + ((long long)b * stride + (long long)(j * ld)) * (long long)elem, rows * elem, write,
                     what);
}

extern "C" void cucc_check_read_matrix(const void* p, size_t rows, size_t cols, size_t ld, size_t elem, size_t batch,
                                       long long stride, const char* what) {
    require_op("cucc_check_read_matrix");
    op_matrix(p, rows, cols, ld, elem, batch, stride, 0, what);
}
extern "C" void cucc_check_write_matrix(void* p, size_t rows, size_t cols, size_t ld, size_t elem, size_t batch,
                                        long long stride, const char* what) {
    require_op("cucc_check_write_matrix");
    op_matrix(p, rows, cols, ld, elem, batch, stride, 1, what);
}

extern "C" size_t cucc_check_allocation(const void* p, void** base) {
    size_t off = (uintptr_t)p - arena_base;
    if (base) *base = nullptr;
    if (off >= arena_limit || region_of(off) == R_SHARED) return 0;
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    uint32_t id = granules[off >> GRANULE_SHIFT];
    const allocation& al = allocations[id];
    if (!id || !al.live || (uintptr_t)p >= al.base + al.size || (uintptr_t)p < al.base) return 0;
    if (base) *base = (void*)al.base;
    return al.size;
}

// ----------------------------------------------------------------------------------------------
// Allocation, copies and memset.
cudaError_t cucc_check_malloc(void** p, size_t bytes, int kind) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    arena_init();
    size_t& b = bump[kind - 1];
    size_t end = kind == CUCC_MEM_DEVICE ? MANAGED_OFF : kind == CUCC_MEM_MANAGED ? PINNED_OFF : SHARED_OFF;
    size_t start = (b + 255) & ~(size_t)255;
    if (start + bytes + 256 > end) return cudaErrorMemoryAllocation;
    b = ((start + bytes + 255) & ~(size_t)255) + 256;  // at least a 256-byte gap to the next allocation
    uintptr_t a = arena_base + start;
    register_allocation(a, bytes, kind);
    // GPU memory is not zeroed: new memory reads as NaN in every float format
    if (kind != CUCC_MEM_PINNED) memset((void*)a, 0xff, bytes);
    *p = (void*)a;
    return cudaSuccess;
}

cudaError_t cucc_check_free(void* p, int kind) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    size_t off = (uintptr_t)p - arena_base;
    uint32_t id = off < arena_limit ? granules[off >> GRANULE_SHIFT] : 0;
    allocation* al = id ? &allocations[id] : nullptr;
    if (!al || al->base != (uintptr_t)p || al->kind != kind) return cudaErrorInvalidValue;
    if (!al->live) {
        char addr[300];
        cucc_check_report(CUCC_CHECK_MEM, "%s of %s, which is already freed", kind == CUCC_MEM_PINNED ? "cudaFreeHost" : "cudaFree",
                          describe_address((uintptr_t)p, addr, sizeof(addr)));
    }
    // cudaFree waits for the device: everything before it is done
    for (int s = 1; s < MAX_SLOTS; s++) join(host_vc, stream_vc[s]);
    host_joined();
    al->live = 0;
    // give the pages back; the addresses stay reserved and are never handed out again
    uintptr_t lo = (al->base + 4095) & ~(uintptr_t)4095, hi = (al->base + al->size) & ~(uintptr_t)4095;
    if (hi > lo) {
        madvise((void*)lo, hi - lo, MADV_DONTNEED);
        uintptr_t clo = (uintptr_t)&cells[lo - arena_base], chi = (uintptr_t)&cells[hi - arena_base];
        clo = (clo + 4095) & ~(uintptr_t)4095;
        chi &= ~(uintptr_t)4095;
        if (chi > clo) madvise((void*)clo, chi - clo, MADV_DONTNEED);
    }
    return cudaSuccess;
}

static int is_device_side(const void* p) {
    size_t off = (uintptr_t)p - arena_base;
    return off < arena_limit && (region_of(off) == R_DEVICE || region_of(off) == R_MANAGED);
}

static const char* memcpy_kind_name(cudaMemcpyKind k) {
    switch (k) {
        case cudaMemcpyHostToHost: return "cudaMemcpyHostToHost";
        case cudaMemcpyHostToDevice: return "cudaMemcpyHostToDevice";
        case cudaMemcpyDeviceToHost: return "cudaMemcpyDeviceToHost";
        case cudaMemcpyDeviceToDevice: return "cudaMemcpyDeviceToDevice";
        default: return "cudaMemcpyDefault";
    }
}

cudaError_t cucc_check_memcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream,
                              int async, const char* name) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    arena_init();
    if (kind != cudaMemcpyDefault && cucc_check_on(CUCC_CHECK_HOST)) {
        int want_dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
        int want_src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
        char addr[300];
        // managed memory is valid either way; only plain device and host memory must match the kind
        size_t doff = (uintptr_t)dst - arena_base, soff = (uintptr_t)src - arena_base;
        int dst_device = doff < arena_limit && region_of(doff) == R_DEVICE;
        int src_device = soff < arena_limit && region_of(soff) == R_DEVICE;
        int dst_managed = doff < arena_limit && region_of(doff) == R_MANAGED;
        int src_managed = soff < arena_limit && region_of(soff) == R_MANAGED;
        if (!dst_managed && dst_device != want_dst_device)
            cucc_check_report(CUCC_CHECK_HOST, "%s(..., %s): the destination %s is %s memory", name, memcpy_kind_name(kind),
                              describe_address((uintptr_t)dst, addr, sizeof(addr)), dst_device ? "device" : "host");
        if (!src_managed && src_device != want_src_device)
            cucc_check_report(CUCC_CHECK_HOST, "%s(..., %s): the source %s is %s memory", name, memcpy_kind_name(kind),
                              describe_address((uintptr_t)src, addr, sizeof(addr)), src_device ? "device" : "host");
    }
    cucc_check_op_begin(stream, name);
    // device to device: unwritten bytes move along, unused; to the host: the program is about to use them
    op_bytes(src, count, 0, "the source", !is_device_side(dst));
    op_bytes(dst, count, 1, "the destination");
    size_t doff = (uintptr_t)dst - arena_base, soff = (uintptr_t)src - arena_base;
    // a copy of unwritten device bytes leaves the destination unwritten (what a kernel then reads is garbage)
    if (doff < arena_limit && soff < arena_limit && region_of(soff) == R_DEVICE)
        for (size_t i = 0; i < count; i++)
            if (cells[soff + i].w_op == 0) cells[doff + i].w_op = 0;
    uint32_t op = current_op;
    cucc_check_op_end();
    if (async && doff < arena_limit && region_of(doff) == R_PINNED && is_device_side(src)) {
        // lands when the host synchronises with this copy; until then the destination holds 0xff
        char* data = (char*)malloc(count);
        if (!data) return cudaErrorMemoryAllocation;
        memcpy(data, src, count);
        memset(dst, 0xff, count);
        pending.push_back({op, dst, data, count});
    } else {
        memmove(dst, src, count);
    }
    if (!async) {  // the synchronous form returns when the copy is done: the host is ordered after it
        join(host_vc, &op_clocks[(size_t)op * MAX_SLOTS]);
        host_joined();
    }
    return cudaSuccess;
}

cudaError_t cucc_check_memset(void* dst, int value, size_t count, cudaStream_t stream, const char* name) {
    std::lock_guard<std::recursive_mutex> lock(host_mutex);
    arena_init();
    cucc_check_op_begin(stream, name);
    size_t doff = (uintptr_t)dst - arena_base;
    if ((doff >= arena_limit || region_of(doff) == R_SHARED) && cucc_check_on(CUCC_CHECK_HOST)) {
        char addr[300];
        cucc_check_report(CUCC_CHECK_HOST, "%s of %s, which is not device memory", name,
                          describe_address((uintptr_t)dst, addr, sizeof(addr)));
    }
    op_bytes(dst, count, 1, "the destination");
    cucc_check_op_end();
    memset(dst, value, count);
    return cudaSuccess;
}

// ----------------------------------------------------------------------------------------------
// The hooks GCC's -fsanitize=thread instrumentation calls. Memory orders are ignored: kernels run one thread at
// a time here, so every atomic is simply performed (sequentially consistent) after its check.
#define CUCC_PC __builtin_return_address(0)
extern "C" {
void __tsan_init(void) {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit(void) {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
void __tsan_read_range(void* p, unsigned long n) { access((uintptr_t)p, n, A_READ | A_RANGE, CUCC_PC); }
void __tsan_write_range(void* p, unsigned long n) { access((uintptr_t)p, n, A_WRITE | A_RANGE, CUCC_PC); }
void __tsan_atomic_thread_fence(int) {
    if (cucc_check_current) cucc_check_current->fenced = 1;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
void __tsan_atomic_signal_fence(int) {}
}

#define CUCC_PLAIN_HOOKS(N)                                                                                          \
    extern "C" void __tsan_read##N(void* p) { access((uintptr_t)p, N, A_READ, CUCC_PC); }                            \
    extern "C" void __tsan_write##N(void* p) { access((uintptr_t)p, N, A_WRITE, CUCC_PC); }                          \
    extern "C" void __tsan_unaligned_read##N(void* p) { access((uintptr_t)p, N, A_READ | A_UNALIGNED, CUCC_PC); }    \
    extern "C" void __tsan_unaligned_write##N(void* p) { access((uintptr_t)p, N, A_WRITE | A_UNALIGNED, CUCC_PC); }  \
    extern "C" void __tsan_volatile_read##N(void* p) { access((uintptr_t)p, N, A_READ | A_VOLATILE, CUCC_PC); }      \
    extern "C" void __tsan_volatile_write##N(void* p) { access((uintptr_t)p, N, A_WRITE | A_VOLATILE, CUCC_PC); }
CUCC_PLAIN_HOOKS(1)
CUCC_PLAIN_HOOKS(2)
CUCC_PLAIN_HOOKS(4)
CUCC_PLAIN_HOOKS(8)
CUCC_PLAIN_HOOKS(16)

#define CUCC_ATOMIC_HOOKS(N, T)                                                                                      \
    extern "C" T __tsan_atomic##N##_load(const volatile T* a, int) {                                                 \
        access((uintptr_t)a, sizeof(T), A_READ | A_ATOMIC, CUCC_PC);                                                 \
        return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                                 \
    }                                                                                                                \
    extern "C" void __tsan_atomic##N##_store(volatile T* a, T v, int) {                                              \
        access((uintptr_t)a, sizeof(T), A_WRITE | A_ATOMIC, CUCC_PC);                                                \
        __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                                    \
    }                                                                                                                \
    extern "C" T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                                              \
        access((uintptr_t)a, sizeof(T), A_READ | A_WRITE | A_ATOMIC, CUCC_PC);                                       \
        return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                                          \
    }                                                                                                                \
    extern "C" T __tsan_atomic##N##_fetch_add(volatile T* a, T v, int) {                                             \
        access((uintptr_t)a, sizeof(T), A_READ | A_WRITE | A_ATOMIC, CUCC_PC);                                       \
        return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                                           \
    }                                                                                                                \
    extern "C" T __tsan_atomic##N##_fetch_sub(volatile T* a, T v, int) {                                             \
        access((uintptr_t)a, sizeof(T), A_READ | A_WRITE | A_ATOMIC, CUCC_PC);                                       \
        return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                                           \
    }                                                                                                                \
    extern "C" T __tsan_atomic##N##_fetch_and(volatile T* a, T v, int) {                                             \
        access((uintptr_t)a, sizeof(T), A_READ | A_WRITE | A_ATOMIC, CUCC_PC);                                       \
        return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                                           \
    }                                                                                                                \
    extern "C" T __tsan_atomic##N##_fetch_or(volatile T* a, T v, int) {                                              \
        access((uintptr_t)a, sizeof(T), A_READ | A_WRITE | A_ATOMIC, CUCC_PC);                                       \
        return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                                            \
    }                                                                                                                \
    extern "C" T __tsan_atomic##N##_fetch_xor(volatile T* a, T v, int) {                                             \
        access((uintptr_t)a, sizeof(T), A_READ | A_WRITE | A_ATOMIC, CUCC_PC);                                       \
        return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                                           \
    }                                                                                                                \
    extern "C" T __tsan_atomic##N##_fetch_nand(volatile T* a, T v, int) {                                            \
        access((uintptr_t)a, sizeof(T), A_READ | A_WRITE | A_ATOMIC, CUCC_PC);                                       \
        return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST);                                                          \
    }                                                                                                                \
    extern "C" int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {                  \
        access((uintptr_t)a, sizeof(T), A_READ | A_WRITE | A_ATOMIC, CUCC_PC);                                       \
        return __atomic_compare_exchange_n(a, c, v, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                          \
    }                                                                                                                \
    extern "C" int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {                    \
        access((uintptr_t)a, sizeof(T), A_READ | A_WRITE | A_ATOMIC, CUCC_PC);                                       \
        return __atomic_compare_exchange_n(a, c, v, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                          \
    }                                                                                                                \
    extern "C" T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {                        \
        access((uintptr_t)a, sizeof(T), A_READ | A_WRITE | A_ATOMIC, CUCC_PC);                                       \
        __atomic_compare_exchange_n(a, &c, v, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                                \
        return c;                                                                                                    \
    }
CUCC_ATOMIC_HOOKS(8, char)
CUCC_ATOMIC_HOOKS(16, short)
CUCC_ATOMIC_HOOKS(32, int)
CUCC_ATOMIC_HOOKS(64, long long)

// The program's memcpy, memmove and memset (cucc --check links it with --wrap; the backend's own calls were renamed
// to the __real_ functions when its libraries were built): host code copying device memory with libc is as wrong as
// dereferencing it, and inside a kernel they are accesses like any other.
extern "C" void* __real_memcpy(void* d, const void* s, size_t n);
extern "C" void* __real_memmove(void* d, const void* s, size_t n);
extern "C" void* __real_memset(void* d, int c, size_t n);
extern "C" void* __wrap_memcpy(void* d, const void* s, size_t n) {
    if (n) {
        access((uintptr_t)s, n, A_READ | A_RANGE | A_UNALIGNED, CUCC_PC);
        access((uintptr_t)d, n, A_WRITE | A_RANGE | A_UNALIGNED, CUCC_PC);
    }
    return __real_memcpy(d, s, n);
}
extern "C" void* __wrap_memmove(void* d, const void* s, size_t n) {
    if (n) {
        access((uintptr_t)s, n, A_READ | A_RANGE | A_UNALIGNED, CUCC_PC);
        access((uintptr_t)d, n, A_WRITE | A_RANGE | A_UNALIGNED, CUCC_PC);
    }
    return __real_memmove(d, s, n);
}
extern "C" void* __wrap_memset(void* d, int c, size_t n) {
    if (n) access((uintptr_t)d, n, A_WRITE | A_RANGE | A_UNALIGNED, CUCC_PC);
    return __real_memset(d, c, n);
}

// __ldg and reinterpret_cast (cucc.h), which know their call's file and line
extern "C" void __cucc_check_ldg(const void* p, size_t n, const char* file, int line) {
    call_file = file;
    call_line = line;
    access((uintptr_t)p, n, A_READ | A_LDG, nullptr);
}

extern "C" void __cucc_check_cast(const void* p, size_t align, const char* file, int line) {
    uintptr_t a = (uintptr_t)p;
    if (!cucc_check_current || a - arena_base >= arena_limit || !(a & (align - 1)) || !cucc_check_on(CUCC_CHECK_MEM))
        return;
    call_file = file;
    call_line = line;
    char addr[300];
    report_access(CUCC_CHECK_MEM, nullptr, "a cast of %s to a pointer to a type that needs %zu-byte alignment "
                  "(a load or store through it faults on a GPU)", describe_address(a, addr, sizeof(addr)), align);
}
