// llmc/tensor_parallel.cuh: tensor parallelism (Megatron-style, -tp N; doc/parallelism.md): the process groups,
// how a tensor of the model file is cut into the N slices the processes hold, and the collectives that join a layer
// split over N processes.
//
// With P processes and degree N (N divides P), consecutive processes form tensor-parallel groups of N: process r is
// member r % N of group r / N. The members of a group hold different slices of every split layer and compute on the
// same batch; the P/N processes with the same member index (one per group) hold the same slices and form the
// data-parallel group `dp`, over which gradients are averaged and ZeRO shards. Consecutive ranks keep the group's
// collectives, which sit on the critical path of every layer, inside a node.
//   members  the N members: the activations' all-reduce, reduce-scatter and all-gather (on the compute stream), the
//            classifier's row statistics, the gradient norm's sum, putting the model file together
//   dp       a MultiGpuConfig over the processes that hold the same slices, sharing the world's NCCL stream: the
//            gradients are averaged over it (overlapping the backward pass on that stream) and its ZeRO shards span it
// Two communicators are in use at once, the members' on the compute stream and dp's on the NCCL stream: every group
// collective first waits for what the NCCL stream has been given (llmc/multi_gpu.cuh, GroupComm). With sequence
// parallelism (-sp 1) the
// residual stream and the norms run on this member's B*T/N tokens: rows [member * B*T/N, (member + 1) * B*T/N) of the
// (B, T) batch in row-major order, which is what ncclReduceScatter and ncclAllGather cut and join.
// On the CPU backend NCCL runs over MPI (cpu/nccl.cpp), so the groups need all processes in one mpirun.
// Tests (dev/test/run_tests.sh NAME, patterns work): gpt-*-tp* and check-gpt-*-tp* (-tp against PyTorch),
// llama-*-tp*, train-gpt-cli (-tp against -tp 1 on distinct batches, refusals).
#pragma once
#include "common.cuh"
#include "multi_gpu.cuh"

typedef struct {
    int degree;             // N; 1: every layer whole, and nothing below is used
    int member;             // r % N: which slice of every split tensor this process holds
    int group;              // r / N (with N == 1 each process is a group of its own: r)
    int sequence_parallel;  // -sp 1: the residual stream and the norms on B*T/N tokens per member
    GroupComm members;      // the N members of this process's group (unused when N == 1)
    MultiGpuConfig dp;      // the processes holding the same slices (the world itself when N == 1)
} TensorParallel;

// Degree 1: every process is a group of its own, and the data-parallel group is the world.
static void tensor_parallel_none(TensorParallel* tp, const MultiGpuConfig* world) {
    memset(tp, 0, sizeof(*tp));
    tp->degree = 1;
    tp->group = world->process_rank;
    tp->dp = *world;
    tp->dp.used_mpi = 0;  // MPI belongs to the world's config
}

// This process's place in groups of `degree`: member r % N of group r / N
static void tensor_parallel_place(TensorParallel* tp, const MultiGpuConfig* world, int degree, int sequence_parallel) {
    tensor_parallel_none(tp, world);
    if (degree == 1) return;
    tp->degree = degree;
    tp->sequence_parallel = sequence_parallel;
    tp->member = world->process_rank % degree;
    tp->group = world->process_rank / degree;
}

// Collective over all processes of `world`. The caller has checked that degree divides world->num_processes.
static void tensor_parallel_init(TensorParallel* tp, const MultiGpuConfig* world, int degree, int sequence_parallel) {
    tensor_parallel_place(tp, world, degree, sequence_parallel);
    if (degree == 1) return;
    group_comm_split(&tp->members, world, degree, &tp->dp);
}

// The memory plan's layout (-pm): the degree's slices without communicators, for any process count: this process as
// member r % N of a data-parallel group of max(P / N, 1) processes. Nothing is sent or allocated.
static void tensor_parallel_plan(TensorParallel* tp, const MultiGpuConfig* world, int degree, int sequence_parallel) {
    tensor_parallel_place(tp, world, degree, sequence_parallel);
    if (degree == 1) return;
    tp->dp.num_processes = world->num_processes / degree > 0 ? world->num_processes / degree : 1;
    tp->dp.process_rank = tp->group % tp->dp.num_processes;
}

static void tensor_parallel_free(TensorParallel* tp) {
    if (tp->degree == 1) return;
    group_comm_free(&tp->members);
    if (tp->dp.nccl_comm != NULL) ncclCheck(ncclCommDestroy(tp->dp.nccl_comm));
}

// x (n) = its sum over the members, in place (Megatron's g in the forward pass, f in the backward pass)
static void tensor_parallel_all_reduce(const TensorParallel* tp, floatX* x, size_t n, cudaStream_t stream) {
    group_after_reductions(&tp->members, stream);
    ncclCheck(ncclAllReduce(x, x, n, nccl_floatX(), ncclSum, tp->members.comm, stream));
}
// out (n) = member's chunk of the sum over the members of in (N * n): a row-parallel layer's output onto this
// member's tokens under sequence parallelism
static void tensor_parallel_reduce_scatter(const TensorParallel* tp, floatX* out, const floatX* in, size_t n,
                                           cudaStream_t stream) {
    group_after_reductions(&tp->members, stream);
    ncclCheck(ncclReduceScatter(in, out, n, nccl_floatX(), ncclSum, tp->members.comm, stream));
}
// out (N * n) = every member's in (n), in member order: the tokens of a sequence-parallel stream put together
static void tensor_parallel_all_gather(const TensorParallel* tp, floatX* out, const floatX* in, size_t n,
                                       cudaStream_t stream) {
    group_after_reductions(&tp->members, stream);
    ncclCheck(ncclAllGather(in, out, n, nccl_floatX(), tp->members.comm, stream));
}
// the same for float values (the classifier's row statistics) with `op`
static void tensor_parallel_all_reduce_float(const TensorParallel* tp, float* x, size_t n, ncclRedOp_t op,
                                             cudaStream_t stream) {
    group_after_reductions(&tp->members, stream);
    ncclCheck(ncclAllReduce(x, x, n, ncclFloat, op, tp->members.comm, stream));
}
// ... and for ints (an MoE layer's expert counts; exact in any order)
static void tensor_parallel_all_reduce_int(const TensorParallel* tp, int* x, size_t n, cudaStream_t stream) {
    group_after_reductions(&tp->members, stream);
    ncclCheck(ncclAllReduce(x, x, n, ncclInt32, ncclSum, tp->members.comm, stream));
}
// bytes * N = every member's `bytes`, in member order (device buffers)
static void tensor_parallel_all_gather_bytes(const TensorParallel* tp, void* out, const void* in, size_t bytes,
                                             cudaStream_t stream) {
    group_after_reductions(&tp->members, stream);
    ncclCheck(ncclAllGather(in, out, bytes, ncclChar, tp->members.comm, stream));
}
// The sum of a host float over the members (the gradient norm's split part), the same on every member.
static float tensor_parallel_float_sum(const TensorParallel* tp, float value, cudaStream_t stream) {
    return tp->degree == 1 ? value : group_float_sum(&tp->members, value, stream);
}

// ----------------------------------------------------------------------------------------------------
// How a tensor of the model file is cut. A tensor is `layers` matrices of (rows, cols), one after another. A split
// by rows cuts each of its row parts (qkv's q, k and v heads; SwiGLU's gate and up halves; one part otherwise) into N
// equal runs of rows, member m taking run m of every part, in part order (a column-parallel layer's weight and bias,
// and the vocabulary-parallel embedding); a split by columns gives member m columns [m cols/N, (m+1) cols/N) of
// every row (a row-parallel layer's weight). A tensor that is not split is replicated: every member holds it whole.
#define TENSOR_SPLIT_MAX_PARTS 3
typedef enum { SPLIT_NONE, SPLIT_ROWS, SPLIT_COLUMNS } TensorSplitKind;
typedef struct {
    TensorSplitKind kind;
    size_t layers, rows, cols;
    int num_parts;                              // SPLIT_ROWS: the row parts
    size_t part_rows[TENSOR_SPLIT_MAX_PARTS];   // their sizes, adding up to rows
} TensorSplit;

// elements of one member's slice
static size_t tensor_split_slice_size(const TensorSplit* s, int degree) {
    return s->kind == SPLIT_NONE ? s->layers * s->rows * s->cols : s->layers * s->rows * s->cols / degree;
}

// Member `member`'s slice of the whole tensor, or the inverse (to_whole: the slice written into its place in the
// whole tensor), of values of `elem` bytes (the parameters, or the optimizer state's fp32). Host memory on both sides.
// At degree 1 the one slice is the whole tensor.
static void tensor_split_copy(const TensorSplit* s, int member, int degree, void* whole_values, void* slice_values,
                              size_t elem, int to_whole) {
    char* whole = (char*)whole_values;
    char* slice = (char*)slice_values;
    size_t n = s->layers * s->rows * s->cols;
    if (s->kind == SPLIT_NONE) {
        if (to_whole) memcpy(whole, slice, n * elem);
        else memcpy(slice, whole, n * elem);
        return;
    }
    size_t at = 0;  // in the slice, in values
    for (size_t l = 0; l < s->layers; l++) {
        char* matrix = whole + l * s->rows * s->cols * elem;
        if (s->kind == SPLIT_COLUMNS) {
            size_t width = s->cols / degree;
            for (size_t r = 0; r < s->rows; r++, at += width) {
                char* row = matrix + (r * s->cols + (size_t)member * width) * elem;
                if (to_whole) memcpy(row, slice + at * elem, width * elem);
                else memcpy(slice + at * elem, row, width * elem);
            }
            continue;
        }
        size_t first = 0;  // the part's first row
        for (int p = 0; p < s->num_parts; p++) {
            size_t run = s->part_rows[p] / degree * s->cols;
            char* rows = matrix + (first + (size_t)member * (s->part_rows[p] / degree)) * s->cols * elem;
            if (to_whole) memcpy(rows, slice + at * elem, run * elem);
            else memcpy(slice + at * elem, rows, run * elem);
            at += run;
            first += s->part_rows[p];
        }
    }
}
