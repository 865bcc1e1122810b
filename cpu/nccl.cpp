// cpu/nccl.cpp: NCCL for the CPU backend, over MPI.
// Each MPI process is one "device". A communicator with nranks > 1 is an MPI communicator over its member
// processes; a communicator from ncclCommInitAll (one process driving several devices) or with nranks == 1
// talks through memory only and never touches MPI. Device memory is host memory and every call runs
// synchronously, so a collective has completed when its call returns (streams are accepted and ignored);
// grouped calls run at the outermost ncclGroupEnd.
//
// Why the reductions are done here and not by MPI_Allreduce: MPI may reduce in an order that differs between
// ranks and between runs, and this project promises bit-identical training runs with identical results on
// every rank. So MPI only moves bytes, and every element is reduced by the code below in a fixed order, on one
// rank, and every rank gets the same bits:
//  - fp32, fp64 and the integer types: rank order 0, 1, .., n-1, in the type itself.
//  - fp16 and bf16: ring order, rounding to the type at every hop, as NCCL's ring does on a GPU. An element has
//    an owner o (all-reduce: the rank whose chunk holds it, the buffer being cut into n near-equal chunks, chunk r
//    = elements [r*floor(count/n) + min(r, count%n), (r+1)*floor(count/n) + min(r+1, count%n)); reduce-scatter:
//    the rank that receives it; reduce: the root). Its reduction starts at rank o+1 and travels o+2, .., o-1 and
//    ends at o (all mod n): acc = x[o+1]; acc = T(float(acc) op float(x[o+k])) for k = 2, .., n, each hop computed
//    in fp32 and rounded to the type (round to nearest even). ncclAvg sums so, then divides by n in fp32 and
//    rounds once more. (A GPU's NCCL may also cut the chunks more finely and pick rings or trees by size; the
//    order here is one such ring, the same on every run and every rank.)
//
// Limits: calls come from one thread at a time; the process that calls ncclGetUniqueId must be a member of
// the communicator made from that id (it hosts the rendezvous); the rest of NCCL's API (ncclCommSplit,
// ncclAlltoAll, ncclGather, ncclScatter, ncclRedOpCreatePreMulSum, ...) is not provided, so a program that
// uses it fails to link rather than misbehave.
//
// Checking builds (cpu/cucc --check, -DCUCC_CHECK) also match every call across ranks, poll every wait under a
// watchdog and declare the memory each call reads and writes: see "checking mode" below.
//
// Build: g++ -std=c++17 -O2 -I/usr/local/cuda/include $(mpicxx --showme:compile) -c cpu/nccl.cpp
// (cpu/cucc does this for -lnccl). The declarations are the toolkit's own nccl.h, used as they are.
#include <nccl.h>
#define OMPI_SKIP_MPICXX 1  // the C API only, so linking needs -lmpi and not -lmpi_cxx
#include <mpi.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/prctl.h>
#include <unistd.h>
#include <deque>
#include <type_traits>
#ifdef CUCC_CHECK
#include <functional>
#include <string>
#include "cucc_check.h"
#endif
#include <utility>
#include <vector>

// ----------------------------------------------------------------------------
// errors

static char last_error[512] = "";

// Records the message for ncclGetLastError, prints it as one line on stderr, and returns res.
static ncclResult_t fail(ncclResult_t res, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof(last_error), fmt, ap);
    va_end(ap);
    fprintf(stderr, "NCCL (cpu backend) error: %s\n", last_error);
    return res;
}

// ----------------------------------------------------------------------------
// waiting (doc/backend.md, "Threads and waits")

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

extern "C" long __cucc_spin_ns(void);  // runtime.cpp: how long a wait spins before it sleeps; -1: it never sleeps

// A poll loop calls backoff_pause after each poll that found nothing: it returns at once while the wait is younger
// than __cucc_spin_ns(), then sleeps 5 us, doubling to 80 us. A peer process that shares this core so gets to
// run (MPI's own waits spin, at best yielding), and a long wait ends at most about 80 us late.
typedef struct {
    double start;
    long nap_ns;
} Backoff;

static Backoff backoff_start(void) {
    static int slack_set;
    if (!slack_set) {
        prctl(PR_SET_TIMERSLACK, 1000UL);  // sleeps of a few us, not Linux's default 50 us of slack
        slack_set = 1;
    }
    Backoff b = {now_s(), 5000};
    return b;
}

static void backoff_pause(Backoff* b) {
    long spin = __cucc_spin_ns();
    if (spin < 0 || (now_s() - b->start) * 1e9 < (double)spin) return;
    struct timespec t = {0, b->nap_ns};
    nanosleep(&t, NULL);
    if (b->nap_ns < 80000) b->nap_ns *= 2;
}

// Waits for every request (MPI_Waitall, with backoff_pause between tests; CUCC_SPIN_US=-1: MPI_Waitall itself).
static void wait_requests(int n, MPI_Request* reqs) {
    if (__cucc_spin_ns() < 0) {
        MPI_Waitall(n, reqs, MPI_STATUSES_IGNORE);
        return;
    }
    Backoff b = backoff_start();
    for (;;) {
        int done = 0;
        MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
        if (done) return;
        backoff_pause(&b);
    }
}

// ----------------------------------------------------------------------------
// communicators and queued operations

// bytes per element of each ncclDataType_t; 0 for the fp8 types, which this backend rejects
static const size_t type_sizes[ncclNumTypes] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 0, 0};

typedef enum { OP_ALLREDUCE, OP_REDUCESCATTER, OP_ALLGATHER, OP_BROADCAST, OP_REDUCE, OP_SEND, OP_RECV } OpKind;
static const char* op_names[] = {"ncclAllReduce", "ncclReduceScatter", "ncclAllGather", "ncclBroadcast",
                                 "ncclReduce", "ncclSend", "ncclRecv"};

// One NCCL call, as posted. count is per rank as NCCL counts it (recvcount for ReduceScatter, sendcount for
// AllGather). root is the root of Broadcast/Reduce, the peer of Send/Recv, 0 otherwise; op is ncclSum for
// calls that do not reduce, so that two matching calls compare equal field by field.
typedef struct {
    OpKind kind;
    const void* sendbuff;
    void* recvbuff;
    size_t count;
    ncclDataType_t type;
    ncclRedOp_t op;
    int root;
    ncclComm_t comm;
#ifdef CUCC_CHECK
    // checking mode (cpu/cucc --check): the stream it was called on, and its sequence number (the k-th
    // collective on its communicator, or the k-th send to / receive from its peer); both zero-initialised by
    // the aggregate initialisers below and set by SET_STREAM and at posting
    cudaStream_t stream;
    uint64_t seq;
#endif
} Op;

#ifdef CUCC_CHECK
#define SET_STREAM(o, s) ((o).stream = (s))
#else
#define SET_STREAM(o, s) ((void)0)
#endif

// A temporary buffer kept between calls, so that a training step does not allocate on every all-reduce.
typedef struct {
    char* p;
    size_t bytes;
} Scratch;

static char* xmalloc(size_t bytes) {
    char* p = (char*)malloc(bytes);
    if (!p) { fprintf(stderr, "NCCL (cpu backend): out of memory (%zu bytes)\n", bytes); exit(1); }
    return p;
}

static char* scratch_get(Scratch* s, size_t bytes) {
    if (bytes > s->bytes) {
        free(s->p);
        s->p = xmalloc(bytes);
        s->bytes = bytes;
    }
    return s->p;
}

// The communicators of one process that talk through memory: the ndev of one ncclCommInitAll, or a single
// communicator with nranks == 1. One thread may drive all of them, so nothing may block: a collective posted
// on one member waits in that member's queue until every member has posted its next collective, and the
// k-th collective of each member then runs together. A send waits, with a copy of its data, for its receive
// (or the receive for its send), per (sender, receiver) pair in posting order, as NCCL matches them.
typedef struct {
    std::vector<char> data;
#ifdef CUCC_CHECK
    Op op;  // the send
#endif
} Message;

typedef struct {
    int size;
    int alive;                          // members not yet destroyed
    std::vector<std::deque<Op>> colls;  // [member]: collectives waiting for the other members
    std::vector<std::deque<Message>> mail;  // [src * size + dst]: sends waiting for their receive
    std::vector<std::deque<Op>> recvs;      // [src * size + dst]: receives waiting for their send
    Scratch scratch;
} Clique;

// A send outside a group on an MPI communicator: its data is copied so that the call can return at once
// (as NCCL's does) and two ranks that both send before they receive do not deadlock.
typedef struct {
    char* data;
    std::vector<MPI_Request> reqs;
#ifdef CUCC_CHECK
    Op op;  // for the watchdog's report
#endif
} BufferedSend;

struct ncclComm {
    int rank;
    int nranks;
    int device;
    MPI_Comm mpi;        // MPI_COMM_NULL for clique members
    Clique* clique;      // NULL for MPI communicators
    std::vector<BufferedSend> sends;
    Scratch scratch;
#ifdef CUCC_CHECK
    // checking mode: an identity the same on every rank (from the unique id's key; the clique's address for
    // ncclCommInitAll), the number of collectives posted, and of sends to / receives from each peer
    uint64_t chk_id;
    uint64_t chk_colls;
    std::vector<uint64_t> chk_sends, chk_recvs;
#endif
};

static ncclComm_t new_comm(int rank, int nranks, int device, MPI_Comm mpi, Clique* clique) {
    ncclComm_t c = new ncclComm();
    c->rank = rank;
    c->nranks = nranks;
    c->device = device;
    c->mpi = mpi;
    c->clique = clique;
    c->scratch.p = NULL;
    c->scratch.bytes = 0;
#ifdef CUCC_CHECK
    c->chk_id = clique ? (uint64_t)(uintptr_t)clique : 0;
    c->chk_colls = 0;
    c->chk_sends.assign(nranks, 0);
    c->chk_recvs.assign(nranks, 0);
#endif
    return c;
}

static Clique* new_clique(int size) {
    Clique* q = new Clique();
    q->size = size;
    q->alive = size;
    q->colls.resize(size);
    q->mail.resize((size_t)size * size);
    q->recvs.resize((size_t)size * size);
    q->scratch.p = NULL;
    q->scratch.bytes = 0;
    return q;
}

// ----------------------------------------------------------------------------
// checking mode (cpu/cucc --check; check "ncclcheck", see include/cucc_check.h)
//
// Every collective on an MPI communicator first exchanges a descriptor (sequence number on the communicator,
// kind, count, type, op, root) with every other member, and a difference is reported naming both ranks'
// calls; cliques compare their members' calls in memory. A send outside a group carries a descriptor that its
// receive checks; at ncclGroupEnd each rank sends every peer it has grouped sends/receives with a manifest of
// them (per-peer sequence number, count, type) and checks the peer's against its own, so a send without its
// receive in the peer's group, or with a different size, is reported before any data moves. Every wait polls
// (MPI_Testsome with short sleeps) and a wait without progress for CUCC_NCCL_TIMEOUT seconds (default 60)
// reports what it waits for. Each call is also an operation of the checker (cucc_check_op_begin on its
// stream), declaring the bytes it reads and writes, and one that is not ordered after the last operation of
// another communicator is reported: NCCL operations of two communicators in flight at once can deadlock.
// In-place calls must use NCCL's in-place pointers; any other overlap of sendbuff and recvbuff is reported.
// Limit: a grouped send or receive pairs only with a grouped one on the peer (an ungrouped partner of a
// grouped call is reported by the watchdog).
#ifdef CUCC_CHECK
static const int TAG_CHECK_COLL = 3;   // collective descriptors
static const int TAG_CHECK_P2P = 4;    // descriptors of sends outside groups
static const int TAG_CHECK_GROUP = 5;  // per-peer manifests of grouped sends and receives

static int chk_nccl(void) {
    static int on = -1;
    if (on < 0) on = cucc_check_on(CUCC_CHECK_NCCL) ? 1 : 0;
    return on;
}

// What one rank says about one of its calls; identical bytes on two ranks mean matching calls.
typedef struct {
    uint64_t seq;
    uint64_t count;
    int32_t kind, type, op, root;
} Desc;

static Desc desc_of(const Op& o) {
    Desc d;
    memset(&d, 0, sizeof(d));
    d.seq = o.seq;
    d.count = o.count;
    d.kind = o.kind;
    d.type = o.type;
    d.op = o.op;
    d.root = o.root;
    return d;
}

static int same_desc(const Desc& a, const Desc& b) {
    return a.seq == b.seq && a.count == b.count && a.kind == b.kind && a.type == b.type && a.op == b.op &&
           a.root == b.root;
}

static const char* type_name(int t) {
    static const char* names[] = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float",
                                  "double", "bfloat16", "fp8e4m3", "fp8e5m2"};
    return t >= 0 && t < ncclNumTypes ? names[t] : "?";
}

static const char* redop_name(int op) {
    static const char* names[] = {"sum", "prod", "max", "min", "avg"};
    return op >= 0 && op < ncclNumOps ? names[op] : "?";
}

// "ncclAllReduce(count 1024, float, sum)"
static std::string desc_str(const Desc& d) {
    char b[160];
    const char* name = d.kind >= 0 && d.kind <= OP_RECV ? op_names[d.kind] : "?";
    switch (d.kind) {
    case OP_ALLREDUCE: snprintf(b, sizeof(b), "%s(count %llu, %s, %s)", name, (unsigned long long)d.count,
                                type_name(d.type), redop_name(d.op)); break;
    case OP_REDUCESCATTER: snprintf(b, sizeof(b), "%s(recvcount %llu, %s, %s)", name, (unsigned long long)d.count,
                                    type_name(d.type), redop_name(d.op)); break;
    case OP_ALLGATHER: snprintf(b, sizeof(b), "%s(sendcount %llu, %s)", name, (unsigned long long)d.count,
                                type_name(d.type)); break;
    case OP_BROADCAST: snprintf(b, sizeof(b), "%s(count %llu, %s, root %d)", name, (unsigned long long)d.count,
                                type_name(d.type), d.root); break;
    case OP_REDUCE: snprintf(b, sizeof(b), "%s(count %llu, %s, %s, root %d)", name, (unsigned long long)d.count,
                             type_name(d.type), redop_name(d.op), d.root); break;
    default: snprintf(b, sizeof(b), "%s(count %llu, %s, peer %d)", name, (unsigned long long)d.count,
                      type_name(d.type), d.root); break;
    }
    return b;
}

static std::string comm_str(ncclComm_t c) {
    char b[96];
    if (c->clique) snprintf(b, sizeof(b), "communicator 0x%llx (ncclCommInitAll, %d members)",
                            (unsigned long long)c->chk_id, c->nranks);
    else snprintf(b, sizeof(b), "communicator 0x%llx (%d ranks)", (unsigned long long)c->chk_id, c->nranks);
    return b;
}

// "ncclAllReduce(count 1024, float, sum) as call #7 on communicator 0x.. (2 ranks)"; sends and receives are
// numbered per peer
static std::string call_str(const Op& o) {
    char b[64];
    if (o.kind == OP_SEND) snprintf(b, sizeof(b), " as send #%llu to rank %d on ", (unsigned long long)o.seq, o.root);
    else if (o.kind == OP_RECV) snprintf(b, sizeof(b), " as receive #%llu from rank %d on ", (unsigned long long)o.seq, o.root);
    else snprintf(b, sizeof(b), " as call #%llu on ", (unsigned long long)o.seq);
    return desc_str(desc_of(o)) + b + comm_str(o.comm);
}

static double chk_timeout(void) {
    static double t = -1;
    if (t < 0) {
        const char* e = getenv("CUCC_NCCL_TIMEOUT");
        t = e && atof(e) > 0 ? atof(e) : 60;
    }
    return t;
}

// Waits for every request, polling; after CUCC_NCCL_TIMEOUT seconds without one completing, reports what
// `what` says is pending (completed requests are MPI_REQUEST_NULL in reqs by then).
static void check_wait(std::vector<MPI_Request>* reqs, const std::function<std::string(const std::vector<MPI_Request>&)>& what) {
    if (reqs->empty()) return;
    std::vector<int> idx(reqs->size());
    Backoff b = backoff_start();
    for (;;) {
        int done = 0;
        MPI_Testsome((int)reqs->size(), reqs->data(), &done, idx.data(), MPI_STATUSES_IGNORE);
        if (done == MPI_UNDEFINED) break;
        if (done > 0) {
            b = backoff_start();
            continue;
        }
        if (now_s() - b.start > chk_timeout()) {
            cucc_check_report(CUCC_CHECK_NCCL, "%s; no progress for %g s (CUCC_NCCL_TIMEOUT): the peer never made the "
                              "matching call", what(*reqs).c_str(), chk_timeout());
        }
        backoff_pause(&b);
    }
    reqs->clear();
}

// what the data stage of the call being executed waits for, for the watchdog
static thread_local std::string chk_context;
static thread_local int chk_group_end = 0;  // inside ncclGroupEnd: the calls run belong to one group

// ---- memory, streams, and communicators in flight at once

// The last operation on each communicator (a clique counts as one): if it is ordered before a new operation,
// so is everything earlier on that communicator.
typedef struct {
    const void* key;
    uint32_t serial;
    Op op;
} LastOp;
static std::vector<LastOp> chk_last;
static thread_local std::vector<LastOp> chk_group_last;  // this group's, recorded at its end

static const void* comm_key(ncclComm_t c) { return c->clique ? (const void*)c->clique : (const void*)c; }

static void forget_comm(const void* key) {
    for (size_t i = 0; i < chk_last.size(); i++) {
        if (chk_last[i].key == key) { chk_last.erase(chk_last.begin() + i); return; }
    }
}

static void remember(const LastOp& l) {
    for (LastOp& x : chk_last) {
        if (x.key == l.key) { x = l; return; }
    }
    chk_last.push_back(l);
}

// Starts the checker's operation for o and declares the bytes this rank's part of it reads and writes.
static uint32_t chk_op_begin(const Op& o, int grouped) {
    uint32_t id = cucc_check_op_begin(o.stream, op_names[o.kind]);
    ncclComm_t c = o.comm;
    if (chk_nccl()) {  // first, as it is the more specific finding
        const void* key = comm_key(c);
        for (const LastOp& l : chk_last) {
            if (l.key == key || cucc_check_ordered(l.serial, id)) continue;
            char a[160], b[160];
            cucc_check_op_describe(id, a, sizeof(a));
            cucc_check_op_describe(l.serial, b, sizeof(b));
            cucc_check_report(CUCC_CHECK_NCCL, "rank %d starts %s (%s) while %s (%s) may still be in flight: it is not "
                              "ordered before it by stream order, events or synchronisation, and NCCL operations on two "
                              "communicators in flight at once can deadlock (put them on one stream, order them with "
                              "cudaEventRecord/cudaStreamWaitEvent, or issue them in one ncclGroupStart/ncclGroupEnd)",
                              c->rank, call_str(o).c_str(), a, call_str(l.op).c_str(), b);
        }
        LastOp l = {key, id, o};
        if (grouped) chk_group_last.push_back(l);
        else remember(l);
    }
    size_t bytes = o.count * type_sizes[o.type];
    int n = c->nranks, root = c->rank == o.root;
    if (bytes > 0) {
        switch (o.kind) {
        case OP_ALLREDUCE:
            cucc_check_read(o.sendbuff, bytes, "sendbuff");
            cucc_check_write(o.recvbuff, bytes, "recvbuff");
            break;
        case OP_REDUCESCATTER:
            cucc_check_read(o.sendbuff, bytes * n, "sendbuff");
            cucc_check_write(o.recvbuff, bytes, "recvbuff");
            break;
        case OP_ALLGATHER:
            cucc_check_read(o.sendbuff, bytes, "sendbuff");
            cucc_check_write(o.recvbuff, bytes * n, "recvbuff");
            break;
        case OP_BROADCAST:
            if (root) cucc_check_read(o.sendbuff, bytes, "sendbuff");
            cucc_check_write(o.recvbuff, bytes, "recvbuff");
            break;
        case OP_REDUCE:
            cucc_check_read(o.sendbuff, bytes, "sendbuff");
            if (root) cucc_check_write(o.recvbuff, bytes, "recvbuff");
            break;
        case OP_SEND: cucc_check_read(o.sendbuff, bytes, "sendbuff"); break;
        case OP_RECV: cucc_check_write(o.recvbuff, bytes, "recvbuff"); break;
        }
    }
    return id;
}

// NCCL's in-place rules ("In-place operations"): AllReduce, Reduce and Broadcast in place have sendbuff ==
// recvbuff; ReduceScatter has recvbuff == sendbuff + rank * recvcount and AllGather sendbuff == recvbuff +
// rank * sendcount (in elements). Any other overlap of the bytes read and written is undefined.
static void chk_in_place(const Op& o) {
    ncclComm_t c = o.comm;
    size_t bytes = o.count * type_sizes[o.type];
    int n = c->nranks, me = c->rank;
    size_t sbytes = bytes, rbytes = bytes;
    const char* s = (const char*)o.sendbuff;
    const char* r = (const char*)o.recvbuff;
    const char* want;  // the sendbuff that would make the call in place
    const char* rule;
    switch (o.kind) {
    case OP_ALLREDUCE: want = r; rule = "sendbuff == recvbuff"; break;
    case OP_REDUCE:
        if (me != o.root) return;
        want = r; rule = "sendbuff == recvbuff"; break;
    case OP_BROADCAST:
        if (me != o.root) return;
        want = r; rule = "sendbuff == recvbuff"; break;
    case OP_REDUCESCATTER: sbytes = bytes * n; want = r - (size_t)me * bytes; rule = "recvbuff == sendbuff + rank * recvcount"; break;
    case OP_ALLGATHER: rbytes = bytes * n; want = r + (size_t)me * bytes; rule = "sendbuff == recvbuff + rank * sendcount"; break;
    default: return;
    }
    if (s == want || s + sbytes <= r || r + rbytes <= s) return;
    cucc_check_report(CUCC_CHECK_NCCL, "rank %d calls %s on %s with sendbuff %p (%zu bytes) overlapping recvbuff %p "
                      "(%zu bytes) but not in place: NCCL's in-place %s needs %s (%p here); any other overlap is "
                      "undefined", me, desc_str(desc_of(o)).c_str(), comm_str(c).c_str(), (const void*)s, sbytes,
                      (const void*)r, rbytes, op_names[o.kind], rule, (const void*)want);
}

// ---- matching calls across ranks

// Exchanges the collective's descriptor with every other member of its MPI communicator and reports a
// difference, naming both calls.
static void chk_coll_mpi(const Op& o) {
    ncclComm_t c = o.comm;
    int n = c->nranks, me = c->rank;
    Desc mine = desc_of(o);
    std::vector<Desc> all(n);
    std::vector<MPI_Request> reqs;
    std::vector<int> peers;
    for (int r = 0; r < n; r++) {
        if (r == me) continue;
        MPI_Request q;
        MPI_Irecv(&all[r], sizeof(Desc), MPI_BYTE, r, TAG_CHECK_COLL, c->mpi, &q);
        reqs.push_back(q);
        peers.push_back(r);
    }
    for (int r = 0; r < n; r++) {
        if (r == me) continue;
        MPI_Request q;
        MPI_Isend(&mine, sizeof(Desc), MPI_BYTE, r, TAG_CHECK_COLL, c->mpi, &q);
        reqs.push_back(q);
    }
    check_wait(&reqs, [&](const std::vector<MPI_Request>& left) {
        std::string s = "rank " + std::to_string(me) + " waits in " + call_str(o) + " for rank(s)";
        for (size_t i = 0; i < peers.size(); i++) {
            if (left[i] != MPI_REQUEST_NULL) s += " " + std::to_string(peers[i]);
        }
        s += ", which have not made call #" + std::to_string(o.seq) + " on it";
        return s;
    });
    for (int r = 0; r < n; r++) {
        if (r == me || same_desc(all[r], mine)) continue;
        cucc_check_report(CUCC_CHECK_NCCL, "rank %d calls %s as call #%llu on %s while rank %d calls %s (collectives "
                          "must be called in the same order with the same count, type, op and root on every rank)",
                          r, desc_str(all[r]).c_str(), (unsigned long long)all[r].seq, comm_str(c).c_str(), me,
                          desc_str(mine).c_str());
    }
}

// A receive outside a group: the sender's descriptor comes first and must match.
static void chk_recv_mpi(const Op& o) {
    ncclComm_t c = o.comm;
    Desc theirs;
    std::vector<MPI_Request> reqs(1);
    MPI_Irecv(&theirs, sizeof(Desc), MPI_BYTE, o.root, TAG_CHECK_P2P, c->mpi, &reqs[0]);
    check_wait(&reqs, [&](const std::vector<MPI_Request>&) {
        return "rank " + std::to_string(c->rank) + " waits in " + call_str(o) + " for rank " + std::to_string(o.root) +
               ", which has not made its ncclSend #" + std::to_string(o.seq) + " to rank " + std::to_string(c->rank) +
               " (a grouped ncclSend pairs only with a grouped ncclRecv in check builds)";
    });
    if (theirs.count != o.count || theirs.type != o.type || theirs.seq != o.seq) {
        cucc_check_report(CUCC_CHECK_NCCL, "rank %d's %s meets rank %d's ncclSend(count %llu, %s) #%llu to rank %d "
                          "(a send and its receive need the same count and type)", c->rank, call_str(o).c_str(), o.root,
                          (unsigned long long)theirs.count, type_name(theirs.type), (unsigned long long)theirs.seq,
                          c->rank);
    }
}

// One grouped send or receive, as a manifest lists it.
typedef struct {
    int32_t kind;  // OP_SEND or OP_RECV
    int32_t type;
    uint64_t seq;
    uint64_t count;
} Entry;

typedef struct {
    ncclComm_t comm;
    int peer;
    std::vector<Entry> mine, theirs;
    int got;
} Manifest;

static std::string entry_str(const Entry& e, int from, int to) {
    char b[160];
    if (e.kind == OP_SEND) snprintf(b, sizeof(b), "rank %d's ncclSend(count %llu, %s) #%llu to rank %d", from,
                                    (unsigned long long)e.count, type_name(e.type), (unsigned long long)e.seq, to);
    else snprintf(b, sizeof(b), "rank %d's ncclRecv(count %llu, %s) #%llu from rank %d", from,
                  (unsigned long long)e.count, type_name(e.type), (unsigned long long)e.seq, to);
    return b;
}

// Compares my grouped calls of one kind toward the peer with the peer's counterparts.
static void chk_pair(const Manifest& m, int kind) {
    int me = m.comm->rank, p = m.peer;
    std::vector<Entry> a, b;  // mine of `kind`, the peer's of the other kind
    for (const Entry& e : m.mine) if (e.kind == kind) a.push_back(e);
    for (const Entry& e : m.theirs) if (e.kind != kind) b.push_back(e);
    for (size_t i = 0; i < a.size() || i < b.size(); i++) {
        if (i < a.size() && i < b.size()) {
            if (a[i].seq == b[i].seq && a[i].count == b[i].count && a[i].type == b[i].type) continue;
            cucc_check_report(CUCC_CHECK_NCCL, "in a group on %s, %s meets %s (a send and its receive need the same "
                              "count and type)", comm_str(m.comm).c_str(), entry_str(a[i], me, p).c_str(),
                              entry_str(b[i], p, me).c_str());
        }
        int mine_left = i < a.size();  // the unmatched call is mine, else the peer's
        const Entry& e = mine_left ? a[i] : b[i];
        int from = mine_left ? me : p, to = mine_left ? p : me;
        size_t own = mine_left ? a.size() : b.size(), other = mine_left ? b.size() : a.size();
        cucc_check_report(CUCC_CHECK_NCCL, "in a group on %s, %s has no matching %s: rank %d's group posts %zu %s rank "
                          "%d, rank %d's %zu %s", comm_str(m.comm).c_str(), entry_str(e, from, to).c_str(),
                          e.kind == OP_SEND ? "ncclRecv" : "ncclSend", to, other,
                          e.kind == OP_SEND ? "ncclRecv(s) from" : "ncclSend(s) to", from, from, own,
                          e.kind == OP_SEND ? "ncclSend(s) to it" : "ncclRecv(s) from it");
    }
}

// At ncclGroupEnd, before any data moves: numbers the group's sends and receives on MPI communicators per
// peer, sends each peer the manifest of those toward it, and checks the peer's manifest against them.
static void chk_group_p2p(std::vector<Op>& ops) {
    std::vector<Manifest> mans;
    for (Op& o : ops) {
        if (o.comm->clique != NULL || (o.kind != OP_SEND && o.kind != OP_RECV)) continue;
        ncclComm_t c = o.comm;
        o.seq = o.kind == OP_SEND ? c->chk_sends[o.root]++ : c->chk_recvs[o.root]++;
        Manifest* m = NULL;
        for (Manifest& x : mans) if (x.comm == c && x.peer == o.root) m = &x;
        if (!m) {
            mans.push_back(Manifest());
            m = &mans.back();
            m->comm = c;
            m->peer = o.root;
            m->got = 0;
        }
        Entry e = {(int32_t)o.kind, (int32_t)o.type, o.seq, (uint64_t)o.count};
        m->mine.push_back(e);
    }
    if (mans.empty()) return;
    std::vector<MPI_Request> sends(mans.size());
    for (size_t i = 0; i < mans.size(); i++) {
        MPI_Isend(mans[i].mine.data(), (int)(mans[i].mine.size() * sizeof(Entry)), MPI_BYTE, mans[i].peer,
                  TAG_CHECK_GROUP, mans[i].comm->mpi, &sends[i]);
    }
    size_t left = mans.size();
    Backoff b = backoff_start();
    while (left > 0) {
        int progress = 0;
        for (Manifest& m : mans) {
            if (m.got) continue;
            int flag = 0, len = 0;
            MPI_Status st;
            MPI_Iprobe(m.peer, TAG_CHECK_GROUP, m.comm->mpi, &flag, &st);
            if (!flag) continue;
            MPI_Get_count(&st, MPI_BYTE, &len);
            m.theirs.resize(len / sizeof(Entry));
            MPI_Recv(m.theirs.data(), len, MPI_BYTE, m.peer, TAG_CHECK_GROUP, m.comm->mpi, MPI_STATUS_IGNORE);
            m.got = 1;
            left--;
            progress = 1;
        }
        if (progress) {
            b = backoff_start();
            continue;
        }
        if (now_s() - b.start > chk_timeout()) {
            std::string s;
            for (const Manifest& m : mans) {
                if (m.got) continue;
                int me = m.comm->rank;
                s += (s.empty() ? "" : "; ") + std::string("on ") + comm_str(m.comm) + ", rank " + std::to_string(me) +
                     "'s group has";
                for (const Entry& e : m.mine) s += " " + entry_str(e, me, m.peer);
                s += ", but rank " + std::to_string(m.peer) + " has posted no group with sends or receives toward rank " +
                     std::to_string(me);
            }
            cucc_check_report(CUCC_CHECK_NCCL, "ncclGroupEnd: %s; no progress for %g s (CUCC_NCCL_TIMEOUT)", s.c_str(),
                              chk_timeout());
        }
        backoff_pause(&b);
    }
    for (const Manifest& m : mans) {
        chk_pair(m, OP_SEND);
        chk_pair(m, OP_RECV);
    }
    check_wait(&sends, [&](const std::vector<MPI_Request>&) { return std::string("ncclGroupEnd: sending the manifests"); });
}
#endif  // CUCC_CHECK

// ----------------------------------------------------------------------------
// reduction: dst[i] = srcs[0][i] op srcs[1][i] op .. op srcs[n-1][i], always in this order; fp16 and bf16 in ring
// order from the element's owner (reduce_ring, see the top of the file)

// T is the stored type, A the accumulator: fp32 for fp16 and bf16 (one rounding at the end), the type itself
// otherwise. Integer sums and products wrap around, computed in unsigned arithmetic where that is defined.
static inline float widen(__half x) { return __half2float(x); }
static inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> static inline T widen(T x) { return x; }

template <typename T, typename A> static inline T narrow(A a) { return (T)a; }
template <> inline __half narrow<__half, float>(float a) { return __float2half_rn(a); }
template <> inline __nv_bfloat16 narrow<__nv_bfloat16, float>(float a) { return __float2bfloat16_rn(a); }

template <ncclRedOp_t OP, typename A> static inline A combine(A a, A b) {
    if constexpr (OP == ncclMax) {
        return b > a ? b : a;
    } else if constexpr (OP == ncclMin) {
        return b < a ? b : a;
    } else if constexpr (std::is_integral<A>::value) {
        typedef typename std::make_unsigned<A>::type U;
        return OP == ncclProd ? (A)((U)a * (U)b) : (A)((U)a + (U)b);
    } else {
        return OP == ncclProd ? a * b : a + b;  // ncclSum and ncclAvg both sum here
    }
}

template <typename T, typename A, ncclRedOp_t OP>
static void reduce_loop(void* dst, const void* const* srcs, int n, size_t count) {
    T* out = (T*)dst;
    for (size_t i = 0; i < count; i++) {
        A acc = widen(((const T*)srcs[0])[i]);
        for (int r = 1; r < n; r++) acc = combine<OP, A>(acc, widen(((const T*)srcs[r])[i]));
        if (OP == ncclAvg) acc = (A)(acc / n);  // sum, then divide: integer division for integer types
        out[i] = narrow<T, A>(acc);  // after every read of element i, so dst may be one of the srcs
    }
}

template <typename T, typename A>
static void reduce_typed(void* dst, const void* const* srcs, int n, size_t count, ncclRedOp_t op) {
    switch (op) {
    case ncclSum: reduce_loop<T, A, ncclSum>(dst, srcs, n, count); break;
    case ncclProd: reduce_loop<T, A, ncclProd>(dst, srcs, n, count); break;
    case ncclMax: reduce_loop<T, A, ncclMax>(dst, srcs, n, count); break;
    case ncclMin: reduce_loop<T, A, ncclMin>(dst, srcs, n, count); break;
    default: reduce_loop<T, A, ncclAvg>(dst, srcs, n, count); break;
    }
}

// fp16/bf16: the ring from owner + 1 to owner, rounding to T at every hop
template <typename T, ncclRedOp_t OP>
static void ring_loop(void* dst, const void* const* srcs, int n, size_t count, int owner) {
    T* out = (T*)dst;
    int first = (owner + 1) % n;
    for (size_t i = 0; i < count; i++) {
        T acc = ((const T*)srcs[first])[i];
        for (int k = 1; k < n; k++) {
            int r = (first + k) % n;
            acc = narrow<T, float>(combine<OP, float>(widen(acc), widen(((const T*)srcs[r])[i])));
        }
        if (OP == ncclAvg) acc = narrow<T, float>(widen(acc) / n);
        out[i] = acc;  // after every read of element i, so dst may be one of the srcs
    }
}

template <typename T>
static void ring_typed(void* dst, const void* const* srcs, int n, size_t count, ncclRedOp_t op, int owner) {
    switch (op) {
    case ncclSum: ring_loop<T, ncclSum>(dst, srcs, n, count, owner); break;
    case ncclProd: ring_loop<T, ncclProd>(dst, srcs, n, count, owner); break;
    case ncclMax: ring_loop<T, ncclMax>(dst, srcs, n, count, owner); break;
    case ncclMin: ring_loop<T, ncclMin>(dst, srcs, n, count, owner); break;
    default: ring_loop<T, ncclAvg>(dst, srcs, n, count, owner); break;
    }
}

// owner: the rank whose ring the elements follow (fp16 and bf16 only; the other types reduce in rank order)
static void reduce(void* dst, const void* const* srcs, int n, size_t count, ncclDataType_t type, ncclRedOp_t op,
                   int owner) {
    if (type == ncclFloat16) return ring_typed<__half>(dst, srcs, n, count, op, owner);
    if (type == ncclBfloat16) return ring_typed<__nv_bfloat16>(dst, srcs, n, count, op, owner);
    switch (type) {
    case ncclInt8: reduce_typed<int8_t, int8_t>(dst, srcs, n, count, op); break;
    case ncclUint8: reduce_typed<uint8_t, uint8_t>(dst, srcs, n, count, op); break;
    case ncclInt32: reduce_typed<int32_t, int32_t>(dst, srcs, n, count, op); break;
    case ncclUint32: reduce_typed<uint32_t, uint32_t>(dst, srcs, n, count, op); break;
    case ncclInt64: reduce_typed<int64_t, int64_t>(dst, srcs, n, count, op); break;
    case ncclUint64: reduce_typed<uint64_t, uint64_t>(dst, srcs, n, count, op); break;
    case ncclFloat16: reduce_typed<__half, float>(dst, srcs, n, count, op); break;
    case ncclFloat32: reduce_typed<float, float>(dst, srcs, n, count, op); break;
    case ncclFloat64: reduce_typed<double, double>(dst, srcs, n, count, op); break;
    default: reduce_typed<__nv_bfloat16, float>(dst, srcs, n, count, op); break;
    }
}

// ----------------------------------------------------------------------------
// collectives inside a clique: every member's buffers are in this process

// The first element of all-reduce chunk r of n (r = n: count): n near-equal chunks, the first count % n one longer.
static size_t allreduce_chunk_start(size_t count, int n, int r) {
    return count / n * r + (r < (int)(count % n) ? r : count % n);
}

static int is_reduction(OpKind k) { return k == OP_ALLREDUCE || k == OP_REDUCESCATTER || k == OP_REDUCE; }

// Runs the matched k-th collective of every member. Results go to scratch first and are copied out after
// every input has been read, so in-place calls and any aliasing between members' buffers are safe.
static ncclResult_t clique_collective(Clique* q, const std::vector<Op>& ops) {
    int n = q->size;
    for (int m = 1; m < n; m++) {
        const Op& a = ops[0];
        const Op& b = ops[m];
        if (a.kind != b.kind || a.count != b.count || a.type != b.type || a.op != b.op || a.root != b.root) {
#ifdef CUCC_CHECK
            if (chk_nccl()) {
                cucc_check_report(CUCC_CHECK_NCCL, "rank %d calls %s as call #%llu on %s while rank 0 calls %s (collectives "
                                  "must be called in the same order with the same count, type, op and root on every "
                                  "rank)", m, desc_str(desc_of(b)).c_str(), (unsigned long long)b.seq,
                                  comm_str(b.comm).c_str(), desc_str(desc_of(a)).c_str());
            }
#endif
            return fail(ncclInvalidUsage, "ncclCommInitAll communicators: member %d posted %s (count %zu, type %d, "
                        "op %d, root %d) where member 0 posted %s (count %zu, type %d, op %d, root %d)", m,
                        op_names[b.kind], b.count, (int)b.type, (int)b.op, b.root, op_names[a.kind], a.count,
                        (int)a.type, (int)a.op, a.root);
        }
    }
    const Op& o = ops[0];
    size_t bytes = o.count * type_sizes[o.type];
    std::vector<const void*> srcs(n);
    if (o.kind == OP_REDUCE) {
        char* tmp = scratch_get(&q->scratch, bytes);
        for (int m = 0; m < n; m++) srcs[m] = ops[m].sendbuff;
        reduce(tmp, srcs.data(), n, o.count, o.type, o.op, o.root);
        memcpy(ops[o.root].recvbuff, tmp, bytes);
    } else if (o.kind == OP_ALLREDUCE) {
        // chunk by chunk, each in its owner's ring (the chunks of mpi_allreduce)
        char* tmp = scratch_get(&q->scratch, bytes);
        size_t es = type_sizes[o.type];
        for (int r = 0; r < n; r++) {
            size_t lo = allreduce_chunk_start(o.count, n, r), hi = allreduce_chunk_start(o.count, n, r + 1);
            for (int m = 0; m < n; m++) srcs[m] = (const char*)ops[m].sendbuff + lo * es;
            reduce(tmp + lo * es, srcs.data(), n, hi - lo, o.type, o.op, r);
        }
        for (int m = 0; m < n; m++) memcpy(ops[m].recvbuff, tmp, bytes);
    } else if (o.kind == OP_REDUCESCATTER) {
        char* tmp = scratch_get(&q->scratch, bytes * n);
        for (int m = 0; m < n; m++) {
            for (int r = 0; r < n; r++) srcs[r] = (const char*)ops[r].sendbuff + m * bytes;
            reduce(tmp + m * bytes, srcs.data(), n, o.count, o.type, o.op, m);
        }
        for (int m = 0; m < n; m++) memcpy(ops[m].recvbuff, tmp + m * bytes, bytes);
    } else if (o.kind == OP_ALLGATHER) {
        char* tmp = scratch_get(&q->scratch, bytes * n);
        for (int m = 0; m < n; m++) memcpy(tmp + m * bytes, ops[m].sendbuff, bytes);
        for (int m = 0; m < n; m++) memcpy(ops[m].recvbuff, tmp, bytes * n);
    } else {  // OP_BROADCAST
        char* tmp = scratch_get(&q->scratch, bytes);
        memcpy(tmp, ops[o.root].sendbuff, bytes);
        for (int m = 0; m < n; m++) memcpy(ops[m].recvbuff, tmp, bytes);
    }
    return ncclSuccess;
}

static ncclResult_t clique_p2p(const Op& o) {
    Clique* q = o.comm->clique;
    int me = o.comm->rank;
    size_t bytes = o.count * type_sizes[o.type];
    if (o.kind == OP_SEND) {
        size_t box = (size_t)me * q->size + o.root;
        if (q->recvs[box].empty()) {
            Message msg;
            msg.data.assign((const char*)o.sendbuff, (const char*)o.sendbuff + bytes);
#ifdef CUCC_CHECK
            msg.op = o;
#endif
            q->mail[box].push_back(msg);
            return ncclSuccess;
        }
        Op r = q->recvs[box].front();
        q->recvs[box].pop_front();
        size_t want = r.count * type_sizes[r.type];
#ifdef CUCC_CHECK
        if (chk_nccl() && (r.count != o.count || r.type != o.type)) {
            cucc_check_report(CUCC_CHECK_NCCL, "rank %d's %s meets rank %d's %s (a send and its receive need the same "
                              "count and type)", me, call_str(o).c_str(), o.root, call_str(r).c_str());
        }
#endif
        if (want != bytes) {
            return fail(ncclInvalidUsage, "ncclSend: %zu bytes from rank %d to rank %d, whose ncclRecv expects %zu",
                        bytes, me, o.root, want);
        }
        memcpy(r.recvbuff, o.sendbuff, bytes);
        return ncclSuccess;
    }
    size_t box = (size_t)o.root * q->size + me;
    if (q->mail[box].empty()) {
        q->recvs[box].push_back(o);
        return ncclSuccess;
    }
    Message msg = std::move(q->mail[box].front());
    q->mail[box].pop_front();
#ifdef CUCC_CHECK
    if (chk_nccl() && (msg.op.count != o.count || msg.op.type != o.type)) {
        cucc_check_report(CUCC_CHECK_NCCL, "rank %d's %s meets rank %d's %s (a send and its receive need the same "
                          "count and type)", me, call_str(o).c_str(), o.root, call_str(msg.op).c_str());
    }
#endif
    if (msg.data.size() != bytes) {
        return fail(ncclInvalidUsage, "ncclRecv: rank %d expects %zu bytes from rank %d, which sent %zu", me, bytes,
                    o.root, msg.data.size());
    }
    memcpy(o.recvbuff, msg.data.data(), bytes);
    return ncclSuccess;
}

static ncclResult_t clique_post(const Op& in) {
#ifdef CUCC_CHECK
    Op o = in;
    ncclComm_t c = o.comm;
    if (o.kind == OP_SEND) o.seq = c->chk_sends[o.root]++;
    else if (o.kind == OP_RECV) o.seq = c->chk_recvs[o.root]++;
    else o.seq = c->chk_colls++;
    chk_op_begin(o, chk_group_end);  // its memory is declared when posted: it is ordered on its stream from here
    cucc_check_op_end();
#else
    const Op& o = in;
#endif
    if (o.kind == OP_SEND || o.kind == OP_RECV) return clique_p2p(o);
    Clique* q = o.comm->clique;
    q->colls[o.comm->rank].push_back(o);
    // only this member's queue can have been the last empty one, so at most one set of calls is now complete
    for (int m = 0; m < q->size; m++) {
        if (q->colls[m].empty()) return ncclSuccess;
    }
    std::vector<Op> ops(q->size);
    for (int m = 0; m < q->size; m++) {
        ops[m] = q->colls[m].front();
        q->colls[m].pop_front();
    }
    return clique_collective(q, ops);
}

#ifdef CUCC_CHECK
// At the end of a group: one thread drives every member of an ncclCommInitAll clique, so what a group posts
// on a clique must complete inside it (on a GPU the rest would deadlock).
static void chk_clique_leftovers(const std::vector<Op>& ops) {
    for (const Op& g : ops) {
        Clique* q = g.comm->clique;
        if (q == NULL) continue;
        for (int m = 0; m < q->size; m++) {
            if (q->colls[m].empty()) continue;
            const Op& o = q->colls[m].front();
            std::string missing;
            for (int j = 0; j < q->size; j++) {
                if (q->colls[j].empty()) missing += (missing.empty() ? "" : ", ") + std::to_string(j);
            }
            cucc_check_report(CUCC_CHECK_NCCL, "ncclGroupEnd: rank %d's %s is left waiting for rank(s) %s, which did not "
                              "call it (one thread driving ncclCommInitAll communicators must call every member's "
                              "collective inside one group)", m, call_str(o).c_str(), missing.c_str());
        }
        for (int s = 0; s < q->size; s++) for (int d = 0; d < q->size; d++) {
            size_t box = (size_t)s * q->size + d;
            if (!q->mail[box].empty()) {
                cucc_check_report(CUCC_CHECK_NCCL, "ncclGroupEnd: rank %d's %s has no matching ncclRecv from rank %d "
                                  "in the group", s, call_str(q->mail[box].front().op).c_str(), s);
            }
            if (!q->recvs[box].empty()) {
                cucc_check_report(CUCC_CHECK_NCCL, "ncclGroupEnd: rank %d's %s has no matching ncclSend to rank %d "
                                  "in the group", d, call_str(q->recvs[box].front()).c_str(), d);
            }
        }
    }
}
#endif

// ----------------------------------------------------------------------------
// collectives over MPI: point-to-point messages between the members, reductions done locally in rank order

static const int TAG_COLL = 1;  // collective traffic; user sends use TAG_P2P, so the two never match
static const int TAG_P2P = 2;
// MPI counts are int: a bigger buffer goes as several messages, which MPI matches in posting order.
static const size_t MAX_MESSAGE = (size_t)1 << 30;

// Scratch holds one row per peer (not for this rank, whose data is read in place): the row of rank r.
static size_t peer_row(int r, int me) { return r < me ? r : r - 1; }

static void post_send(std::vector<MPI_Request>* reqs, const void* buf, size_t bytes, int peer, int tag, MPI_Comm comm) {
    for (size_t off = 0; off < bytes; off += MAX_MESSAGE) {
        size_t len = bytes - off < MAX_MESSAGE ? bytes - off : MAX_MESSAGE;
        MPI_Request r;
        MPI_Isend((const char*)buf + off, (int)len, MPI_BYTE, peer, tag, comm, &r);
        reqs->push_back(r);
    }
}

static void post_recv(std::vector<MPI_Request>* reqs, void* buf, size_t bytes, int peer, int tag, MPI_Comm comm) {
    for (size_t off = 0; off < bytes; off += MAX_MESSAGE) {
        size_t len = bytes - off < MAX_MESSAGE ? bytes - off : MAX_MESSAGE;
        MPI_Request r;
        MPI_Irecv((char*)buf + off, (int)len, MPI_BYTE, peer, tag, comm, &r);
        reqs->push_back(r);
    }
}

static void wait_all(std::vector<MPI_Request>* reqs) {
#ifdef CUCC_CHECK
    if (chk_nccl()) {
        check_wait(reqs, [](const std::vector<MPI_Request>&) { return chk_context; });
        return;
    }
#endif
    wait_requests((int)reqs->size(), reqs->data());
    reqs->clear();
}

// Frees the buffered sends that have completed; with wait, first waits for all of them.
static void finish_sends(ncclComm_t c, int wait) {
    size_t kept = 0;
    for (size_t i = 0; i < c->sends.size(); i++) {
        BufferedSend& s = c->sends[i];
        int done = 1;
#ifdef CUCC_CHECK
        if (wait && chk_nccl()) {
            check_wait(&s.reqs, [&](const std::vector<MPI_Request>&) {
                return "rank " + std::to_string(c->rank) + "'s " + call_str(s.op) + " (outside a group) is never "
                       "received: rank " + std::to_string(s.op.root) + " posts no ncclRecv #" + std::to_string(s.op.seq) +
                       " from rank " + std::to_string(c->rank) + " before this communicator is finalised or destroyed";
            });
        } else
#endif
        if (wait) wait_requests((int)s.reqs.size(), s.reqs.data());
        else MPI_Testall((int)s.reqs.size(), s.reqs.data(), &done, MPI_STATUSES_IGNORE);
        if (done) free(s.data);
        else c->sends[kept++] = s;
    }
    c->sends.resize(kept);
}

// AllReduce as reduce-scatter + all-gather: rank r owns the r-th of n near-equal chunks, receives that chunk
// from every rank, reduces it (in rank order, or fp16/bf16 in r's ring), and sends the result to every rank. Each element is therefore
// reduced once, in the same order, on one rank, and every rank ends with the same bits.
static void mpi_allreduce(const Op& o) {
    ncclComm_t c = o.comm;
    int n = c->nranks, me = c->rank;
    size_t es = type_sizes[o.type];
    std::vector<size_t> off(n + 1);
    for (int r = 0; r <= n; r++) off[r] = allreduce_chunk_start(o.count, n, r);
    size_t mine = off[me + 1] - off[me];
    char* tmp = scratch_get(&c->scratch, mine * es * (n - 1));
    const char* send = (const char*)o.sendbuff;
    char* recv = (char*)o.recvbuff;
    std::vector<const void*> srcs(n);
    std::vector<MPI_Request> reqs;
    for (int r = 0; r < n; r++) {
        if (r == me) { srcs[r] = send + off[me] * es; continue; }
        srcs[r] = tmp + peer_row(r, me) * mine * es;
        post_recv(&reqs, (char*)srcs[r], mine * es, r, TAG_COLL, c->mpi);
        post_send(&reqs, send + off[r] * es, (off[r + 1] - off[r]) * es, r, TAG_COLL, c->mpi);
    }
    wait_all(&reqs);
    reduce(recv + off[me] * es, srcs.data(), n, mine, o.type, o.op, me);
    for (int r = 0; r < n; r++) {
        if (r == me) continue;
        post_recv(&reqs, recv + off[r] * es, (off[r + 1] - off[r]) * es, r, TAG_COLL, c->mpi);
        post_send(&reqs, recv + off[me] * es, mine * es, r, TAG_COLL, c->mpi);
    }
    wait_all(&reqs);
}

static void mpi_collective(const Op& o) {
    ncclComm_t c = o.comm;
    int n = c->nranks, me = c->rank;
    size_t bytes = o.count * type_sizes[o.type];
    const char* send = (const char*)o.sendbuff;
    char* recv = (char*)o.recvbuff;
    std::vector<const void*> srcs(n);
    std::vector<MPI_Request> reqs;
    if (o.kind == OP_ALLREDUCE) {
        mpi_allreduce(o);
    } else if (o.kind == OP_REDUCESCATTER) {
        // in place, recvbuff is sendbuff + me * bytes: srcs[me] then aliases the output, element by element
        char* tmp = scratch_get(&c->scratch, bytes * (n - 1));
        for (int r = 0; r < n; r++) {
            if (r == me) { srcs[r] = send + me * bytes; continue; }
            srcs[r] = tmp + peer_row(r, me) * bytes;
            post_recv(&reqs, (char*)srcs[r], bytes, r, TAG_COLL, c->mpi);
            post_send(&reqs, send + r * bytes, bytes, r, TAG_COLL, c->mpi);
        }
        wait_all(&reqs);
        reduce(recv, srcs.data(), n, o.count, o.type, o.op, me);
    } else if (o.kind == OP_ALLGATHER) {
        for (int r = 0; r < n; r++) {
            if (r == me) continue;
            post_recv(&reqs, recv + r * bytes, bytes, r, TAG_COLL, c->mpi);
            post_send(&reqs, send, bytes, r, TAG_COLL, c->mpi);
        }
        if (recv + me * bytes != send) memcpy(recv + me * bytes, send, bytes);  // equal when in place
        wait_all(&reqs);
    } else if (o.kind == OP_BROADCAST) {
        if (me == o.root) {
            for (int r = 0; r < n; r++) {
                if (r != me) post_send(&reqs, send, bytes, r, TAG_COLL, c->mpi);
            }
            if (recv != send) memcpy(recv, send, bytes);
        } else {
            post_recv(&reqs, recv, bytes, o.root, TAG_COLL, c->mpi);
        }
        wait_all(&reqs);
    } else {  // OP_REDUCE
        if (me != o.root) {
            post_send(&reqs, send, bytes, o.root, TAG_COLL, c->mpi);
            wait_all(&reqs);
            return;
        }
        char* tmp = scratch_get(&c->scratch, bytes * (n - 1));
        for (int r = 0; r < n; r++) {
            if (r == me) { srcs[r] = send; continue; }
            srcs[r] = tmp + peer_row(r, me) * bytes;
            post_recv(&reqs, (char*)srcs[r], bytes, r, TAG_COLL, c->mpi);
        }
        wait_all(&reqs);
        reduce(recv, srcs.data(), n, o.count, o.type, o.op, o.root);
    }
}

// ----------------------------------------------------------------------------
// posting calls, and groups

static thread_local int group_depth = 0;
static thread_local std::vector<Op> group_ops;

static int is_mpi_p2p(const Op& o) { return o.comm->clique == NULL && (o.kind == OP_SEND || o.kind == OP_RECV); }

#ifdef CUCC_CHECK
// run() in checking mode, for MPI communicators: numbers the call, matches it with the peers' (descriptors),
// and makes it an operation of the checker that declares its memory.
static ncclResult_t run_checked(const Op& in) {
    Op o = in;
    ncclComm_t c = o.comm;
    finish_sends(c, 0);
    size_t bytes = o.count * type_sizes[o.type];
    if (o.kind == OP_SEND) o.seq = c->chk_sends[o.root]++;
    else if (o.kind == OP_RECV) o.seq = c->chk_recvs[o.root]++;
    else o.seq = c->chk_colls++;
    if (chk_nccl()) {
        if (o.kind == OP_RECV) chk_recv_mpi(o);
        else if (o.kind != OP_SEND) chk_coll_mpi(o);
    }
    chk_op_begin(o, chk_group_end);
    chk_context = "rank " + std::to_string(c->rank) + " waits in " + call_str(o) + " for data from its peers";
    if (o.kind == OP_SEND) {
        BufferedSend s;
        s.data = xmalloc(bytes + sizeof(Desc));
        memcpy(s.data, o.sendbuff, bytes);
        Desc d = desc_of(o);
        memcpy(s.data + bytes, &d, sizeof(d));
        if (chk_nccl()) post_send(&s.reqs, s.data + bytes, sizeof(d), o.root, TAG_CHECK_P2P, c->mpi);
        post_send(&s.reqs, s.data, bytes, o.root, TAG_P2P, c->mpi);
        s.op = o;
        c->sends.push_back(s);
    } else if (o.kind == OP_RECV) {
        std::vector<MPI_Request> reqs;
        post_recv(&reqs, o.recvbuff, bytes, o.root, TAG_P2P, c->mpi);
        wait_all(&reqs);
    } else if (o.count > 0) {
        mpi_collective(o);
    }
    cucc_check_op_end();
    return ncclSuccess;
}
#endif

// Runs one call now (outside a group, or at ncclGroupEnd for everything but MPI sends and receives).
static ncclResult_t run(const Op& o) {
    ncclComm_t c = o.comm;
    if (c->clique) return clique_post(o);
#ifdef CUCC_CHECK
    return run_checked(o);
#endif
    finish_sends(c, 0);
    size_t bytes = o.count * type_sizes[o.type];
    if (o.kind == OP_SEND) {
        BufferedSend s;
        s.data = xmalloc(bytes);
        memcpy(s.data, o.sendbuff, bytes);
        post_send(&s.reqs, s.data, bytes, o.root, TAG_P2P, c->mpi);
        c->sends.push_back(s);
    } else if (o.kind == OP_RECV) {
        std::vector<MPI_Request> reqs;
        post_recv(&reqs, o.recvbuff, bytes, o.root, TAG_P2P, c->mpi);
        wait_all(&reqs);
    } else {
        mpi_collective(o);
    }
    return ncclSuccess;
}

// Checks the arguments as NCCL does, then runs the call or, inside a group, keeps it for ncclGroupEnd.
static ncclResult_t submit(const Op& o) {
    const char* name = op_names[o.kind];
    if (o.comm == NULL) return fail(ncclInvalidArgument, "%s: comm is NULL", name);
    if ((int)o.type < 0 || (int)o.type >= ncclNumTypes || type_sizes[o.type] == 0) {
        return fail(ncclInvalidArgument, "%s: datatype %d is not supported (the fp8 types are not, here)", name,
                    (int)o.type);
    }
    if (is_reduction(o.kind) && ((int)o.op < 0 || (int)o.op >= ncclNumOps)) {
        return fail(ncclInvalidArgument, "%s: reduction op %d is not one of ncclSum, ncclProd, ncclMax, ncclMin, "
                    "ncclAvg", name, (int)o.op);
    }
    if (o.root < 0 || o.root >= o.comm->nranks) {
        return fail(ncclInvalidArgument, "%s: %s %d is out of range for %d ranks", name,
                    o.kind == OP_SEND || o.kind == OP_RECV ? "peer" : "root", o.root, o.comm->nranks);
    }
    int is_root = o.comm->rank == o.root;
    int needs_send = o.kind != OP_RECV && (o.kind != OP_BROADCAST || is_root);
    int needs_recv = o.kind != OP_SEND && (o.kind != OP_REDUCE || is_root);
#ifdef CUCC_CHECK
    // in checking mode a collective of count 0 on an MPI communicator is still matched with the other ranks'
    int chk_zero = o.count == 0 && o.comm->clique == NULL && o.kind != OP_SEND && o.kind != OP_RECV && chk_nccl();
    if (o.count == 0 && chk_zero) {
        if (group_depth > 0) group_ops.push_back(o);
        else run(o);
        return ncclSuccess;
    }
#endif
    if (o.count == 0) return ncclSuccess;  // moves nothing on any rank: skipped everywhere, so still matched
    if ((needs_send && o.sendbuff == NULL) || (needs_recv && o.recvbuff == NULL)) {
        return fail(ncclInvalidArgument, "%s: %s is NULL", name, needs_send && o.sendbuff == NULL ? "sendbuff" : "recvbuff");
    }
#ifdef CUCC_CHECK
    if (chk_nccl()) chk_in_place(o);
#endif
    if (group_depth > 0) {
        group_ops.push_back(o);
        return ncclSuccess;
    }
    return run(o);
}

ncclResult_t ncclGroupStart() {
    group_depth++;
    return ncclSuccess;
}

// The grouped MPI sends and receives are all posted first and waited for last, so any pattern of them
// (an all-to-all, a ring, a send to self) completes; the other calls run in between, in posting order.
ncclResult_t ncclGroupEnd() {
    if (group_depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd: not in a group (no ncclGroupStart)");
    if (--group_depth > 0) return ncclSuccess;
    std::vector<Op> ops;
    ops.swap(group_ops);
    std::vector<MPI_Request> reqs;
#ifdef CUCC_CHECK
    // number and match the grouped sends and receives before any data moves; each call is an operation
    if (chk_nccl()) chk_group_p2p(ops);
    else {
        for (Op& o : ops) {
            if (is_mpi_p2p(o)) o.seq = o.kind == OP_SEND ? o.comm->chk_sends[o.root]++ : o.comm->chk_recvs[o.root]++;
        }
    }
    chk_group_last.clear();
    chk_group_end = 1;
    chk_context = "ncclGroupEnd waits for";
    for (const Op& o : ops) {
        if (!is_mpi_p2p(o)) continue;
        chk_op_begin(o, 1);
        cucc_check_op_end();
        chk_context += (chk_context.size() > 22 ? ", " : " ") + std::string("rank ") + std::to_string(o.comm->rank) +
                       "'s " + call_str(o);
    }
    std::string p2p_context = chk_context;
#endif
    for (const Op& o : ops) {
        if (!is_mpi_p2p(o)) continue;
        size_t bytes = o.count * type_sizes[o.type];
        if (o.kind == OP_SEND) post_send(&reqs, o.sendbuff, bytes, o.root, TAG_P2P, o.comm->mpi);
        else post_recv(&reqs, o.recvbuff, bytes, o.root, TAG_P2P, o.comm->mpi);
    }
    ncclResult_t res = ncclSuccess;
    for (const Op& o : ops) {
        if (is_mpi_p2p(o)) continue;
        ncclResult_t r = run(o);
        if (res == ncclSuccess) res = r;
    }
#ifdef CUCC_CHECK
    chk_context = p2p_context;
    chk_group_end = 0;
    for (const LastOp& l : chk_group_last) remember(l);
    chk_group_last.clear();
    if (chk_nccl()) chk_clique_leftovers(ops);
#endif
    wait_all(&reqs);
    return res;
}

// ----------------------------------------------------------------------------
// the collective and point-to-point API

// Edge mode (CUCC_EDGE_BLOCKS=K, cpu/runtime.cpp; doc/backend.md "Edge mode"): a collective's buffers are checked
// over their whole extent against the device allocations (as NCCL would fault on them); AllReduce, Broadcast and
// Reduce then move and reduce only the first and last K * 16384 elements (two calls on the two windows, so every
// rank must be in edge mode with the same K); ReduceScatter and AllGather run in full.
extern "C" int __cucc_edge_blocks(void);
extern "C" int __cucc_edge_range(const void* p, size_t bytes);
static const size_t EDGE_ELEMENTS_PER_K = 16384;

static void edge_buffer(const Op& o, const char* which, const void* p, size_t bytes) {
    if (bytes == 0) return;
    int r = __cucc_edge_range(p, bytes);
    if (r == 1) return;
    fprintf(stderr, "cucc: edge mode: %s (count %zu): %s %p + %zu bytes %s\n", op_names[o.kind], o.count, which, p,
            bytes, r == 0 ? "runs past the end of its device allocation" : "is not device memory");
    fflush(stderr);
    abort();
}

static ncclResult_t submit_edges(const Op& o) {
    size_t k = (size_t)__cucc_edge_blocks();
    if (k == 0 || o.comm == NULL || (int)o.type < 0 || (int)o.type >= ncclNumTypes || type_sizes[o.type] == 0)
        return submit(o);
    size_t es = type_sizes[o.type], n = (size_t)o.comm->nranks, bytes = o.count * es;
    int is_root = o.comm->rank == o.root;
    size_t send_bytes = o.kind == OP_REDUCESCATTER ? bytes * n : bytes;
    size_t recv_bytes = o.kind == OP_ALLGATHER ? bytes * n : bytes;
    if (o.kind != OP_BROADCAST || is_root) edge_buffer(o, "sendbuff", o.sendbuff, send_bytes);
    if (o.kind != OP_REDUCE || is_root) edge_buffer(o, "recvbuff", o.recvbuff, recv_bytes);
    size_t e = k * EDGE_ELEMENTS_PER_K;
    if (o.count <= 2 * e || (o.kind != OP_ALLREDUCE && o.kind != OP_BROADCAST && o.kind != OP_REDUCE)) return submit(o);
    Op a = o, b = o;
    a.count = b.count = e;
    size_t off = (o.count - e) * es;
    b.sendbuff = o.sendbuff ? (const char*)o.sendbuff + off : NULL;
    b.recvbuff = o.recvbuff ? (char*)o.recvbuff + off : NULL;
    ncclResult_t r = submit(a);
    return r != ncclSuccess ? r : submit(b);
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    Op o = {OP_ALLREDUCE, sendbuff, recvbuff, count, datatype, op, 0, comm};
    SET_STREAM(o, stream);
    return submit_edges(o);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    Op o = {OP_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, op, 0, comm};
    SET_STREAM(o, stream);
    return submit_edges(o);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
    Op o = {OP_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm};
    SET_STREAM(o, stream);
    return submit_edges(o);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    Op o = {OP_BROADCAST, sendbuff, recvbuff, count, datatype, ncclSum, root, comm};
    SET_STREAM(o, stream);
    return submit_edges(o);
}

ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                       cudaStream_t stream) {
    return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
    Op o = {OP_REDUCE, sendbuff, recvbuff, count, datatype, op, root, comm};
    SET_STREAM(o, stream);
    return submit_edges(o);
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    Op o = {OP_SEND, sendbuff, NULL, count, datatype, ncclSum, peer, comm};
    SET_STREAM(o, stream);
    return submit(o);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    Op o = {OP_RECV, NULL, recvbuff, count, datatype, ncclSum, peer, comm};
    SET_STREAM(o, stream);
    return submit(o);
}

// ----------------------------------------------------------------------------
// creating communicators

// A unique id is 128 random bytes; its head says which MPI_COMM_WORLD rank created it (-1 if MPI was not
// initialised then) and a per-creator serial number that picks the MPI tags of its rendezvous.
typedef struct {
    uint32_t magic;
    int32_t creator;
    uint32_t serial;
    unsigned char key[16];
} IdHead;

static const uint32_t ID_MAGIC = 0x6363636e;
static uint32_t id_serial = 0;
// Rendezvous messages travel on MPI_COMM_WORLD (the only communicator every process shares) with tags
// [16384, 32767], within the 32767 that MPI guarantees: requests in the lower half, replies in the upper.
static const int TAG_JOIN = 16384;
static const int TAG_REPLY = 16384 + 8192;
static const int TAG_SPAN = 8192;

typedef struct {
    unsigned char key[16];
    int32_t nranks;
    int32_t rank;
    int32_t world_rank;
} JoinRequest;

static void finalize_mpi(void) {
    int done;
    MPI_Finalized(&done);
    if (!done) MPI_Finalize();
}

// MPI starts only when a communicator spans processes (nranks == 1 and ncclCommInitAll never need it); if the
// program did not initialise MPI itself, we do, and finalise at exit.
static void ensure_mpi(void) {
    int ready;
    MPI_Initialized(&ready);
    if (ready) return;
    int provided;
    MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
    atexit(finalize_mpi);
}

ncclResult_t ncclGetVersion(int* version) {
    if (version == NULL) return fail(ncclInvalidArgument, "ncclGetVersion: version is NULL");
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
    if (uniqueId == NULL) return fail(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
    FILE* f = fopen("/dev/urandom", "rb");
    size_t got = f ? fread(uniqueId->internal, 1, NCCL_UNIQUE_ID_BYTES, f) : 0;
    if (f) fclose(f);
    if (got != NCCL_UNIQUE_ID_BYTES) return fail(ncclSystemError, "ncclGetUniqueId: cannot read /dev/urandom");
    IdHead h;
    memcpy(&h, uniqueId->internal, sizeof(h));  // keeps the random key
    int ready;
    MPI_Initialized(&ready);
    h.magic = ID_MAGIC;
    h.creator = -1;
    if (ready) MPI_Comm_rank(MPI_COMM_WORLD, &h.creator);
    h.serial = id_serial++;
    memcpy(uniqueId->internal, &h, sizeof(h));
    return ncclSuccess;
}

// Waits for the creator's reply and returns its length in ints. The creator answers only from inside its
// own ncclCommInitRank with this id: a process that makes an id must also join that communicator here.
static int wait_reply(int creator, int tag) {
    time_t start = time(NULL);
    int warned = 0, flag = 0, count = 0;
    MPI_Status st;
    for (;;) {
        MPI_Iprobe(creator, tag, MPI_COMM_WORLD, &flag, &st);
        if (flag) break;
#ifdef CUCC_CHECK
        if (chk_nccl() && time(NULL) - start > chk_timeout()) {
            cucc_check_report(CUCC_CHECK_NCCL, "ncclCommInitRank waits for MPI rank %d, which created the unique id and "
                              "has not called ncclCommInitRank with it; no progress for %g s (CUCC_NCCL_TIMEOUT)",
                              creator, chk_timeout());
        }
#endif
        if (!warned && time(NULL) - start > 60) {
            fprintf(stderr, "NCCL (cpu backend): ncclCommInitRank still waiting for MPI rank %d, which created the "
                    "unique id; in this backend the creator must be a member of the communicator\n", creator);
            warned = 1;
        }
        usleep(50);
    }
    MPI_Get_count(&st, MPI_INT, &count);
    return count;
}

// Rendezvous at the id's creator, collective over the members only: each member sends (rank, world rank),
// the creator answers with the world rank of every comm rank, and MPI_Comm_create_group (also collective over
// the members only) makes the communicator. So communicators over any subsets form in any interleaving.
static ncclResult_t join_via_creator(const IdHead* h, int nranks, int rank, int world_rank, MPI_Comm* out) {
    int join_tag = TAG_JOIN + (int)(h->serial % TAG_SPAN);
    int reply_tag = TAG_REPLY + (int)(h->serial % TAG_SPAN);
    std::vector<int> reply(nranks + 1, -1);  // [0]: 0 if the members agree; then world rank of each comm rank
    if (world_rank == h->creator) {
        std::vector<int> members;
        int bad = 0;
        reply[1 + rank] = world_rank;
        for (int i = 0; i < nranks - 1; i++) {
            JoinRequest q;
            MPI_Status st;
            MPI_Recv(&q, sizeof(q), MPI_BYTE, MPI_ANY_SOURCE, join_tag, MPI_COMM_WORLD, &st);
            members.push_back(st.MPI_SOURCE);
            if (memcmp(q.key, h->key, sizeof(q.key)) != 0 || q.nranks != nranks || q.rank < 0 || q.rank >= nranks ||
                reply[1 + q.rank] != -1) {
                bad = 1;
            } else {
                reply[1 + q.rank] = q.world_rank;
            }
        }
        reply[0] = bad;
        for (int m : members) MPI_Send(reply.data(), nranks + 1, MPI_INT, m, reply_tag, MPI_COMM_WORLD);
    } else {
        JoinRequest q;
        memcpy(q.key, h->key, sizeof(q.key));
        q.nranks = nranks;
        q.rank = rank;
        q.world_rank = world_rank;
        MPI_Send(&q, sizeof(q), MPI_BYTE, h->creator, join_tag, MPI_COMM_WORLD);
        int len = wait_reply(h->creator, reply_tag);
        std::vector<int> got(len);
        MPI_Recv(got.data(), len, MPI_INT, h->creator, reply_tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        if (len == nranks + 1) reply = got;
        else reply[0] = 1;
    }
    if (reply[0] != 0) {
        return fail(ncclInvalidUsage, "ncclCommInitRank: the members of the communicator disagree (different ids or "
                    "nranks, or two members with the same rank); this member has rank %d of %d", rank, nranks);
    }
    MPI_Group world_group, group;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Group_incl(world_group, nranks, reply.data() + 1, &group);
    MPI_Comm_create_group(MPI_COMM_WORLD, group, join_tag, out);
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    return ncclSuccess;
}

// An id made before MPI was initialised does not know its creator's rank (the processes shared it some other
// way, e.g. through a file), so the only meeting point is MPI_COMM_WORLD itself, which every process must join.
static ncclResult_t join_via_world(const IdHead* h, int nranks, int rank, int world_rank, int world_size,
                                   MPI_Comm* out) {
    if (nranks != world_size) {
        return fail(ncclInvalidUsage, "ncclCommInitRank: the unique id was made before MPI was initialised, so it "
                    "can only form a communicator over all %d MPI processes, not %d", world_size, nranks);
    }
    JoinRequest q;
    memcpy(q.key, h->key, sizeof(q.key));
    q.nranks = nranks;
    q.rank = rank;
    q.world_rank = world_rank;
    std::vector<JoinRequest> all(world_size);
    MPI_Allgather(&q, sizeof(q), MPI_BYTE, all.data(), sizeof(q), MPI_BYTE, MPI_COMM_WORLD);
    std::vector<int> seen(nranks, 0);
    for (const JoinRequest& a : all) {
        if (memcmp(a.key, h->key, sizeof(a.key)) != 0 || a.nranks != nranks || a.rank < 0 || a.rank >= nranks ||
            seen[a.rank]++) {
            return fail(ncclInvalidUsage, "ncclCommInitRank: the MPI processes disagree (different ids or nranks, "
                        "or two with the same rank); this one has rank %d of %d", rank, nranks);
        }
    }
    MPI_Comm_split(MPI_COMM_WORLD, 0, rank, out);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
    if (comm == NULL) return fail(ncclInvalidArgument, "ncclCommInitRank: comm is NULL");
    *comm = NULL;
    if (nranks < 1) return fail(ncclInvalidArgument, "ncclCommInitRank: nranks %d is not positive", nranks);
    if (rank < 0 || rank >= nranks) {
        return fail(ncclInvalidArgument, "ncclCommInitRank: rank %d is out of range for %d ranks", rank, nranks);
    }
    IdHead h;
    memcpy(&h, commId.internal, sizeof(h));
    if (h.magic != ID_MAGIC) return fail(ncclInvalidArgument, "ncclCommInitRank: the id is not from ncclGetUniqueId");
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) device = 0;
    if (nranks == 1) {
        *comm = new_comm(0, 1, device, MPI_COMM_NULL, new_clique(1));
        return ncclSuccess;
    }
    ensure_mpi();
    int world_rank, world_size;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    if (nranks > world_size) {
        return fail(ncclInvalidUsage, "ncclCommInitRank: nranks %d but only %d MPI processes (launch with mpirun -np)",
                    nranks, world_size);
    }
    if (h.creator >= world_size) {
        return fail(ncclInvalidArgument, "ncclCommInitRank: the id was made by MPI rank %d, not in this job", h.creator);
    }
    MPI_Comm mc;
    ncclResult_t res = h.creator < 0 ? join_via_world(&h, nranks, rank, world_rank, world_size, &mc)
                                     : join_via_creator(&h, nranks, rank, world_rank, &mc);
    if (res != ncclSuccess) return res;
    *comm = new_comm(rank, nranks, device, mc, NULL);
#ifdef CUCC_CHECK
    memcpy(&(*comm)->chk_id, h.key, sizeof((*comm)->chk_id));  // the same on every member
#endif
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config) {
    // every communicator here is blocking and has no tunables, so a valid config changes nothing
    if (config != NULL && config->magic != 0xcafebeef) {
        return fail(ncclInvalidArgument, "ncclCommInitRankConfig: config not set with NCCL_CONFIG_INITIALIZER");
    }
    return ncclCommInitRank(comm, nranks, commId, rank);
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
    if (comms == NULL) return fail(ncclInvalidArgument, "ncclCommInitAll: comms is NULL");
    if (ndev < 1) return fail(ncclInvalidArgument, "ncclCommInitAll: ndev %d is not positive", ndev);
    for (int i = 0; devlist != NULL && i < ndev; i++) {
        if (devlist[i] < 0) return fail(ncclInvalidArgument, "ncclCommInitAll: devlist[%d] = %d", i, devlist[i]);
        for (int j = 0; j < i; j++) {
            if (devlist[j] == devlist[i]) {
                return fail(ncclInvalidUsage, "ncclCommInitAll: device %d listed twice, as NCCL forbids", devlist[i]);
            }
        }
    }
    Clique* q = new_clique(ndev);
    for (int i = 0; i < ndev; i++) comms[i] = new_comm(i, ndev, devlist ? devlist[i] : i, MPI_COMM_NULL, q);
    return ncclSuccess;
}

// ----------------------------------------------------------------------------
// queries and teardown

static void release(ncclComm_t c) {
#ifdef CUCC_CHECK
    forget_comm(comm_key(c));  // (a clique's entry may name this member)
#endif
    if (c->mpi != MPI_COMM_NULL) {
        int done;
        MPI_Finalized(&done);
        if (!done) MPI_Comm_free(&c->mpi);
    }
    if (c->clique && --c->clique->alive == 0) {
        free(c->clique->scratch.p);
        delete c->clique;
    }
    free(c->scratch.p);
    delete c;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    if (comm == NULL) return fail(ncclInvalidArgument, "ncclCommFinalize: comm is NULL");
    if (comm->mpi != MPI_COMM_NULL) finish_sends(comm, 1);
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (comm == NULL) return fail(ncclInvalidArgument, "ncclCommDestroy: comm is NULL");
    if (comm->mpi != MPI_COMM_NULL) finish_sends(comm, 1);
    release(comm);
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (comm == NULL) return ncclSuccess;  // as NCCL: aborting nothing is fine
    // Unfinished buffered sends are left to MPI (MPI_Request_free); their copies must outlive them, so they
    // are deliberately not freed.
    for (BufferedSend& s : comm->sends) {
        for (MPI_Request& r : s.reqs) MPI_Request_free(&r);
    }
    comm->sends.clear();
    release(comm);
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
    if (comm == NULL || count == NULL) return fail(ncclInvalidArgument, "ncclCommCount: NULL argument");
    *count = comm->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
    if (comm == NULL || device == NULL) return fail(ncclInvalidArgument, "ncclCommCuDevice: NULL argument");
    *device = comm->device;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
    if (comm == NULL || rank == NULL) return fail(ncclInvalidArgument, "ncclCommUserRank: NULL argument");
    *rank = comm->rank;
    return ncclSuccess;
}

// Every call completes synchronously, so there is never an asynchronous error to report.
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
    if (comm == NULL || asyncError == NULL) return fail(ncclInvalidArgument, "ncclCommGetAsyncError: NULL argument");
    *asyncError = ncclSuccess;
    return ncclSuccess;
}

const char* ncclGetLastError(ncclComm_t comm) { return last_error; }

const char* ncclGetErrorString(ncclResult_t result) {
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}
