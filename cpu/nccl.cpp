// cpu/nccl.cpp: NCCL for the CPU backend, over MPI.
// Each MPI process is one "device". A communicator with nranks > 1 is an MPI communicator over its member
// processes; a communicator from ncclCommInitAll (one process driving several devices) or with nranks == 1
// talks through memory only and never touches MPI. Device memory is host memory and every call runs
// synchronously, so a collective has completed when its call returns (streams are accepted and ignored);
// grouped calls run at the outermost ncclGroupEnd.
//
// Why the reductions are done here and not by MPI_Allreduce: MPI may reduce in an order that differs between
// ranks and between runs, and this project promises bit-identical training runs with identical results on
// every rank. So MPI only moves bytes, and every element is reduced by the code below in rank order
// 0, 1, .., n-1. fp16 and bf16 accumulate in fp32 and round once at the end; NCCL on a GPU rounds at every
// hop of its ring, so results may differ from a GPU in the last bit.
//
// Limits: calls come from one thread at a time; the process that calls ncclGetUniqueId must be a member of
// the communicator made from that id (it hosts the rendezvous); the rest of NCCL's API (ncclCommSplit,
// ncclAlltoAll, ncclGather, ncclScatter, ncclRedOpCreatePreMulSum, ...) is not provided, so a program that
// uses it fails to link rather than misbehave.
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
#include <unistd.h>
#include <deque>
#include <type_traits>
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
} Op;

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
} BufferedSend;

struct ncclComm {
    int rank;
    int nranks;
    int device;
    MPI_Comm mpi;        // MPI_COMM_NULL for clique members
    Clique* clique;      // NULL for MPI communicators
    std::vector<BufferedSend> sends;
    Scratch scratch;
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
// reduction: dst[i] = srcs[0][i] op srcs[1][i] op .. op srcs[n-1][i], always in this order

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

static void reduce(void* dst, const void* const* srcs, int n, size_t count, ncclDataType_t type, ncclRedOp_t op) {
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

static int is_reduction(OpKind k) { return k == OP_ALLREDUCE || k == OP_REDUCESCATTER || k == OP_REDUCE; }

// Runs the matched k-th collective of every member. Results go to scratch first and are copied out after
// every input has been read, so in-place calls and any aliasing between members' buffers are safe.
static ncclResult_t clique_collective(Clique* q, const std::vector<Op>& ops) {
    int n = q->size;
    for (int m = 1; m < n; m++) {
        const Op& a = ops[0];
        const Op& b = ops[m];
        if (a.kind != b.kind || a.count != b.count || a.type != b.type || a.op != b.op || a.root != b.root) {
            return fail(ncclInvalidUsage, "ncclCommInitAll communicators: member %d posted %s (count %zu, type %d, "
                        "op %d, root %d) where member 0 posted %s (count %zu, type %d, op %d, root %d)", m,
                        op_names[b.kind], b.count, (int)b.type, (int)b.op, b.root, op_names[a.kind], a.count,
                        (int)a.type, (int)a.op, a.root);
        }
    }
    const Op& o = ops[0];
    size_t bytes = o.count * type_sizes[o.type];
    std::vector<const void*> srcs(n);
    if (o.kind == OP_ALLREDUCE || o.kind == OP_REDUCE) {
        char* tmp = scratch_get(&q->scratch, bytes);
        for (int m = 0; m < n; m++) srcs[m] = ops[m].sendbuff;
        reduce(tmp, srcs.data(), n, o.count, o.type, o.op);
        if (o.kind == OP_REDUCE) memcpy(ops[o.root].recvbuff, tmp, bytes);
        else for (int m = 0; m < n; m++) memcpy(ops[m].recvbuff, tmp, bytes);
    } else if (o.kind == OP_REDUCESCATTER) {
        char* tmp = scratch_get(&q->scratch, bytes * n);
        for (int m = 0; m < n; m++) {
            for (int r = 0; r < n; r++) srcs[r] = (const char*)ops[r].sendbuff + m * bytes;
            reduce(tmp + m * bytes, srcs.data(), n, o.count, o.type, o.op);
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
            q->mail[box].push_back(msg);
            return ncclSuccess;
        }
        Op r = q->recvs[box].front();
        q->recvs[box].pop_front();
        size_t want = r.count * type_sizes[r.type];
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
    if (msg.data.size() != bytes) {
        return fail(ncclInvalidUsage, "ncclRecv: rank %d expects %zu bytes from rank %d, which sent %zu", me, bytes,
                    o.root, msg.data.size());
    }
    memcpy(o.recvbuff, msg.data.data(), bytes);
    return ncclSuccess;
}

static ncclResult_t clique_post(const Op& o) {
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
    MPI_Waitall((int)reqs->size(), reqs->data(), MPI_STATUSES_IGNORE);
    reqs->clear();
}

// Frees the buffered sends that have completed; with wait, first waits for all of them.
static void finish_sends(ncclComm_t c, int wait) {
    size_t kept = 0;
    for (size_t i = 0; i < c->sends.size(); i++) {
        BufferedSend& s = c->sends[i];
        int done = 1;
        if (wait) MPI_Waitall((int)s.reqs.size(), s.reqs.data(), MPI_STATUSES_IGNORE);
        else MPI_Testall((int)s.reqs.size(), s.reqs.data(), &done, MPI_STATUSES_IGNORE);
        if (done) free(s.data);
        else c->sends[kept++] = s;
    }
    c->sends.resize(kept);
}

// AllReduce as reduce-scatter + all-gather: rank r owns the r-th of n near-equal chunks, receives that chunk
// from every rank, reduces it in rank order, and sends the result to every rank. Each element is therefore
// reduced once, in the same order, on one rank, and every rank ends with the same bits.
static void mpi_allreduce(const Op& o) {
    ncclComm_t c = o.comm;
    int n = c->nranks, me = c->rank;
    size_t es = type_sizes[o.type];
    std::vector<size_t> off(n + 1);
    for (int r = 0; r <= n; r++) off[r] = o.count / n * r + (r < (int)(o.count % n) ? r : o.count % n);
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
    reduce(recv + off[me] * es, srcs.data(), n, mine, o.type, o.op);
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
        reduce(recv, srcs.data(), n, o.count, o.type, o.op);
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
        reduce(recv, srcs.data(), n, o.count, o.type, o.op);
    }
}

// ----------------------------------------------------------------------------
// posting calls, and groups

static thread_local int group_depth = 0;
static thread_local std::vector<Op> group_ops;

static int is_mpi_p2p(const Op& o) { return o.comm->clique == NULL && (o.kind == OP_SEND || o.kind == OP_RECV); }

// Runs one call now (outside a group, or at ncclGroupEnd for everything but MPI sends and receives).
static ncclResult_t run(const Op& o) {
    ncclComm_t c = o.comm;
    if (c->clique) return clique_post(o);
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
    if (o.count == 0) return ncclSuccess;  // moves nothing on any rank: skipped everywhere, so still matched
    if ((needs_send && o.sendbuff == NULL) || (needs_recv && o.recvbuff == NULL)) {
        return fail(ncclInvalidArgument, "%s: %s is NULL", name, needs_send && o.sendbuff == NULL ? "sendbuff" : "recvbuff");
    }
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
    wait_all(&reqs);
    return res;
}

// ----------------------------------------------------------------------------
// the collective and point-to-point API

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    Op o = {OP_ALLREDUCE, sendbuff, recvbuff, count, datatype, op, 0, comm};
    return submit(o);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    Op o = {OP_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, op, 0, comm};
    return submit(o);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
    Op o = {OP_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm};
    return submit(o);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    Op o = {OP_BROADCAST, sendbuff, recvbuff, count, datatype, ncclSum, root, comm};
    return submit(o);
}

ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                       cudaStream_t stream) {
    return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
    Op o = {OP_REDUCE, sendbuff, recvbuff, count, datatype, op, root, comm};
    return submit(o);
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    Op o = {OP_SEND, sendbuff, NULL, count, datatype, ncclSum, peer, comm};
    return submit(o);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    Op o = {OP_RECV, NULL, recvbuff, count, datatype, ncclSum, peer, comm};
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
