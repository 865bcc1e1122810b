// llmc/expert_parallel.cuh: expert parallelism for the MoE trainer (train_moe -ep N): the process groups, and
// the all-to-all that carries token rows to the processes that own their experts and back.
//
// With P data-parallel processes and degree N (N divides P and the expert count E), consecutive processes form
// expert groups of N: process r is member r % N of group r / N and owns the E/N experts
// [(r % N) * E/N, (r % N + 1) * E/N) of every MoE layer; the P/N processes with the same r % N (one per group)
// hold the same experts, their "replicas". Consecutive ranks keep the all-to-all inside a node for N <= the GPUs
// per node, as Megatron and DeepSpeed arrange it. Everything else of the model stays replicated over all P.
//   members           the N members of this process's expert group: the all-to-all, sums over the group's
//                     experts (the gradient norm), gathering all experts for a checkpoint
//   replicas          a MultiGpuConfig over this process's replicas (P/N of them), sharing the world's NCCL
//                     stream and events: the expert gradients are averaged over it and its ZeRO shards span it
// Every process routes its own B*T tokens (the routing group of doc/moe.md); the rows of one MoE layer
// travel in two layouts:
//   dispatch layout (at the tokens' process): by global expert e, rows_src[e] rows each, from offset
//                     sum_{e' < e} rows_src[e'];
//   expert layout (at the owner): by local expert l, then by group member s, rows_own[s * E_l + l] rows each
//                     (what member s sends for the owner's l-th expert), so that each local expert's rows are
//                     contiguous for its GEMM.
// The counts are host arrays: equal to the capacity in the padded layout (no exchange needed), the exact counts
// in the dropless packed one (exchanged first, expert_parallel_exchange_counts).
// Row offsets and element counts are size_t: rows times C passes 2^31 at production sizes (dropless, degree 8 with
// N*k = 2^19 choices each: 2^22 rows at an owner); a single count of rows stays an int (at most N*k < 2^30,
// which moe_assign_slots_launch requires).
// Two communicators are in use at once: the group's on the compute stream, and the world's (and the replicas') on
// the NCCL stream, where the gradient reductions overlap the backward pass: every group operation first waits for
// what the NCCL stream has been given (llmc/multi_gpu.cuh, GroupComm).
// On the CPU backend NCCL runs over MPI (cpu/nccl.cpp), so the groups need all processes in one mpirun.
// Tests (dev/test/run_tests.sh NAME, patterns work): moe-*-ep* and check-moe-*-ep* (-ep against PyTorch and against
// -ep 1), train-moe-cli.
#pragma once
#include "common.cuh"
#include "moe_common.cuh"
#include "multi_gpu.cuh"

typedef struct {
    int degree;             // N; 1: every process holds every expert and nothing below is used
    int member;             // r % N: which slice of the experts this process owns
    int group;              // r / N (with N == 1, each process is a group of its own: r)
    GroupComm members;      // the N members of this process's group (unused when N == 1)
    MultiGpuConfig replicas;  // the processes holding the same experts (the world itself when N == 1)
    int* device_counts;     // 2 * MOE_MAX_EXPERTS ints: the count exchange's send and receive buffers
} ExpertParallel;

// Expert parallelism of degree 1: every process is a group of its own, and the replicas are the world.
static void expert_parallel_none(ExpertParallel* ep, const MultiGpuConfig* world) {
    memset(ep, 0, sizeof(*ep));
    ep->degree = 1;
    ep->group = world->process_rank;
    ep->replicas = *world;
    ep->replicas.used_mpi = 0;  // MPI belongs to the world's config
}

// Collective over all processes of `world`. The caller has checked that degree divides world->num_processes.
static void expert_parallel_init(ExpertParallel* ep, const MultiGpuConfig* world, int degree) {
    expert_parallel_none(ep, world);
    if (degree == 1) return;
    ep->degree = degree;
    ep->member = world->process_rank % degree;
    ep->group = world->process_rank / degree;
    group_comm_split(&ep->members, world, degree, &ep->replicas);
    cudaCheck(cudaMalloc((void**)&ep->device_counts, 2 * MOE_MAX_EXPERTS * sizeof(int)));
}

// The memory plan's layout (-pm): the sizes of degree N over `world`'s processes, as process 0 of it. Nothing is
// created or sent.
static void expert_parallel_plan(ExpertParallel* ep, const MultiGpuConfig* world, int degree) {
    expert_parallel_none(ep, world);
    ep->degree = degree;
    ep->group = 0;
    ep->replicas.num_processes = world->num_processes / degree > 0 ? world->num_processes / degree : 1;
    ep->replicas.process_rank = 0;
}

static void expert_parallel_free(ExpertParallel* ep) {
    if (ep->degree == 1) return;
    group_comm_free(&ep->members);
    if (ep->replicas.nccl_comm != NULL) ncclCheck(ncclCommDestroy(ep->replicas.nccl_comm));
    cudaCheck(cudaFree(ep->device_counts));
}

// The sum of a host float over the group (the gradient norm's expert part, each member holding other experts).
static float expert_parallel_float_sum(const ExpertParallel* ep, float value, cudaStream_t stream) {
    return ep->degree == 1 ? value : group_float_sum(&ep->members, value, stream);
}

// recv (N * bytes) = every member's send (bytes), in member order: the group's experts from each member's own.
static void expert_parallel_allgather(const ExpertParallel* ep, void* recv, const void* send, size_t bytes,
                                      cudaStream_t stream) {
    if (ep->degree == 1) {
        cudaCheck(cudaMemcpyAsync(recv, send, bytes, cudaMemcpyDeviceToDevice, stream));
    } else {
        group_after_reductions(&ep->members, stream);
        ncclCheck(ncclAllGather(send, recv, bytes, ncclChar, ep->members.comm, stream));
    }
    cudaCheck(cudaStreamSynchronize(stream));
}

// The dropless counts: rows_src (E, host) are this process's rows per global expert; on return rows_own
// (N * E_l, host) holds, for each member s and local expert l, what s sends for this process's l-th expert.
// One synchronisation: the GEMMs' shapes and the transfers' sizes are host values.
static void expert_parallel_exchange_counts(const ExpertParallel* ep, int* rows_own, const int* rows_src, int E,
                                            cudaStream_t stream) {
    int E_l = E / ep->degree;
    if (ep->degree == 1) {
        memcpy(rows_own, rows_src, (size_t)E * sizeof(int));
        return;
    }
    int* send = ep->device_counts;
    int* recv = ep->device_counts + MOE_MAX_EXPERTS;
    group_after_reductions(&ep->members, stream);
    cudaCheck(cudaMemcpyAsync(send, rows_src, (size_t)E * sizeof(int), cudaMemcpyHostToDevice, stream));
    ncclCheck(ncclGroupStart());
    for (int s = 0; s < ep->degree; s++) {
        ncclCheck(ncclSend(send + s * E_l, E_l, ncclInt32, s, ep->members.comm, stream));
        ncclCheck(ncclRecv(recv + s * E_l, E_l, ncclInt32, s, ep->members.comm, stream));
    }
    ncclCheck(ncclGroupEnd());
    cudaCheck(cudaMemcpyAsync(rows_own, recv, (size_t)E * sizeof(int), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
}

// Moves the rows of one MoE layer (C floatX each) between the dispatch layout `src` and the expert layout `own`
// (see the top): to_experts = 1 sends src's rows to their experts' owners, 0 brings own's rows back. Rows for
// this process's own experts are copied on the device; the rest go as one NCCL group of sends and receives per
// (member, local expert) block, on `stream` (the compute waits for them anyway).
static void expert_parallel_exchange(const ExpertParallel* ep, floatX* src, floatX* own, const int* rows_src,
                                     const int* rows_own, int E, int C, int to_experts, cudaStream_t stream) {
    int N = ep->degree, E_l = E / N;
    size_t src_offset[MOE_MAX_EXPERTS + 1], own_offset[MOE_MAX_EXPERTS + 1];  // own: index l * N + s
    src_offset[0] = own_offset[0] = 0;
    for (int e = 0; e < E; e++) src_offset[e + 1] = src_offset[e] + (size_t)rows_src[e];
    for (int i = 0; i < E; i++) own_offset[i + 1] = own_offset[i] + (size_t)rows_own[(i % N) * E_l + i / N];
    if (N > 1) group_after_reductions(&ep->members, stream);
    ncclCheck(ncclGroupStart());
    for (int s = 0; s < N; s++) {
        for (int l = 0; l < E_l; l++) {
            int e = s * E_l + l;
            floatX* at_src = src + src_offset[e] * C;
            floatX* at_own = own + own_offset[l * N + s] * C;
            size_t src_elements = (size_t)rows_src[e] * C, own_elements = (size_t)rows_own[s * E_l + l] * C;
            if (s == ep->member) {
                if (to_experts) cudaCheck(cudaMemcpyAsync(at_own, at_src, src_elements * sizeof(floatX),
                                                          cudaMemcpyDeviceToDevice, stream));
                else cudaCheck(cudaMemcpyAsync(at_src, at_own, src_elements * sizeof(floatX), cudaMemcpyDeviceToDevice,
                                               stream));
                continue;
            }
            // empty blocks are skipped on both sides alike: both know the counts
            if (src_elements > 0) {
                if (to_experts) ncclCheck(ncclSend(at_src, src_elements, nccl_floatX(), s, ep->members.comm, stream));
                else ncclCheck(ncclRecv(at_src, src_elements, nccl_floatX(), s, ep->members.comm, stream));
            }
            if (own_elements > 0) {
                if (to_experts) ncclCheck(ncclRecv(at_own, own_elements, nccl_floatX(), s, ep->members.comm, stream));
                else ncclCheck(ncclSend(at_own, own_elements, nccl_floatX(), s, ep->members.comm, stream));
            }
        }
    }
    ncclCheck(ncclGroupEnd());
}
