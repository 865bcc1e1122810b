// llmc/multi_gpu.cuh: the process group of a data-parallel run: one process per GPU, an NCCL communicator
// over all of them, the stream NCCL runs on, and the few host-level collectives the trainers need (a
// barrier, the sum of a loss over processes). Flags: -pi init method (mpi, tcp, fs), -pn processes,
// -pr this process's rank, -pg GPUs per node, -ps rank 0's IPv4 address (tcp), -pf a shared directory (fs).
//   mpi (default): start with `mpirun -np N`; rank and size come from MPI, rank 0's NCCL id goes by MPI_Bcast.
//   tcp: no MPI; rank 0 listens on -ps:12345 and hands the 128-byte NCCL id to the N-1 others.
//   fs:  no MPI; rank 0 writes the id to <-pf>/ncclUniqueId.sync (atomically), the others poll for it and
//        acknowledge, and rank 0 removes the file once all have it, so no stale id is left for the next run.
// A single process started without mpirun needs neither MPI nor other processes; it still gets a
// communicator (of one rank) so that the trainers' collectives need no special case.
// On the CPU backend (cpu/cucc, cpu/nccl.cpp) NCCL runs over MPI, so a communicator over several processes
// needs them in one MPI world: tcp and fs work only under mpirun there, and say so instead of hanging.
// Header-only: #include it from a .cu and link with -lnccl -lmpi (nvcc or cpu/cucc).
// Tested by dev/test/test_host_utils.cu and dev/test/test_multi_gpu.sh.
// Tests (dev/test/run_tests.sh NAME, patterns work): host-utils, multi-gpu, and every *-np* row.
#pragma once
#define OMPI_SKIP_MPICXX 1  // the C API only, so linking needs -lmpi and not -lmpi_cxx
#include <mpi.h>
#include <nccl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include "common.cuh"
#include "utils.h"

#define MULTI_GPU_TCP_PORT 12345
#define MULTI_GPU_ID_TIMEOUT_S 300  // how long the processes of a run may start apart

inline void nccl_check(ncclResult_t status, const char* file, int line) {
    if (status != ncclSuccess) {
        fprintf(stderr, "[NCCL ERROR] at %s:%d: %s\n", file, line, ncclGetErrorString(status));
        exit(EXIT_FAILURE);
    }
}
#define ncclCheck(err) (nccl_check((err), __FILE__, __LINE__))

// floatX as NCCL names it
static inline ncclDataType_t nccl_floatX(void) {
    return PRECISION_MODE == PRECISION_FP32 ? ncclFloat : (PRECISION_MODE == PRECISION_FP16 ? ncclHalf : ncclBfloat16);
}

typedef struct {
    int process_rank;
    int num_processes;
    int local_device_idx;
    ncclComm_t nccl_comm;
    cudaStream_t nccl_stream;
    cudaEvent_t compute_done;  // recorded on the compute stream; nccl_stream waits on it before reducing
    int used_mpi;              // this process called MPI_Init, so it must call MPI_Finalize
    float* device_scalar;      // 8 bytes of device memory for multi_gpu_cpu_sum and the barrier
} MultiGpuConfig;

static inline double multi_gpu_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline struct sockaddr_in multi_gpu_tcp_address(const char* server_ip, int port) {
    struct sockaddr_in address;
    memset(&address, 0, sizeof(address));
    address.sin_family = AF_INET;
    address.sin_port = htons((uint16_t)port);
    if (server_ip == NULL || inet_pton(AF_INET, server_ip, &address.sin_addr) != 1) {
        fprintf(stderr, "-ps '%s': expected the IPv4 address of rank 0 (e.g. 10.0.0.1)\n",
                server_ip ? server_ip : "(none)");
        exit(EXIT_FAILURE);
    }
    return address;
}

// Rank 0 sends `id`, every other rank receives it, over TCP on server_ip:port. Both sides give up after
// timeout_s with one line saying who was missing.
static inline void multi_gpu_share_id_tcp(ncclUniqueId* id, int process_rank, int num_processes,
                                          const char* server_ip, int port, int timeout_s) {
    struct sockaddr_in address = multi_gpu_tcp_address(server_ip, port);
    double deadline = multi_gpu_now_s() + timeout_s;
    if (process_rank == 0) {
        int listener = socket(AF_INET, SOCK_STREAM, 0);
        int yes = 1;
        // a rerun right after a previous one must not fail on the old connections' TIME_WAIT
        setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
        if (listener < 0 || bind(listener, (struct sockaddr*)&address, sizeof(address)) != 0 ||
            listen(listener, num_processes) != 0) {
            fprintf(stderr, "-pi tcp: rank 0 cannot listen on %s:%d: %s\n", server_ip, port, strerror(errno));
            exit(EXIT_FAILURE);
        }
        for (int served = 0; served < num_processes - 1; served++) {
            struct pollfd waiting = {listener, POLLIN, 0};
            int left_ms = (int)((deadline - multi_gpu_now_s()) * 1000.0);
            if (left_ms <= 0 || poll(&waiting, 1, left_ms) <= 0) {
                fprintf(stderr, "-pi tcp: only %d of the %d other processes connected to %s:%d within %d s\n", served,
                        num_processes - 1, server_ip, port, timeout_s);
                exit(EXIT_FAILURE);
            }
            int connection = accept(listener, NULL, NULL);
            if (connection < 0) {
                fprintf(stderr, "-pi tcp: rank 0 cannot accept a connection on %s:%d: %s\n", server_ip, port,
                        strerror(errno));
                exit(EXIT_FAILURE);
            }
            size_t sent = 0;
            while (sent < sizeof(id->internal)) {
                ssize_t n = send(connection, id->internal + sent, sizeof(id->internal) - sent, MSG_NOSIGNAL);
                if (n <= 0) {
                    fprintf(stderr, "-pi tcp: rank 0 cannot send the NCCL id: %s\n", strerror(errno));
                    exit(EXIT_FAILURE);
                }
                sent += (size_t)n;
            }
            close(connection);
        }
        close(listener);
        return;
    }
    for (;;) {
        int connection = socket(AF_INET, SOCK_STREAM, 0);
        if (connection >= 0 && connect(connection, (struct sockaddr*)&address, sizeof(address)) == 0) {
            size_t received = 0;
            while (received < sizeof(id->internal)) {
                ssize_t n = recv(connection, id->internal + received, sizeof(id->internal) - received, 0);
                if (n <= 0) {
                    fprintf(stderr, "-pi tcp: rank %d: %s:%d closed the connection after %zu of %zu bytes of the id\n",
                            process_rank, server_ip, port, received, sizeof(id->internal));
                    exit(EXIT_FAILURE);
                }
                received += (size_t)n;
            }
            close(connection);
            return;
        }
        if (connection >= 0) close(connection);
        if (multi_gpu_now_s() > deadline) {
            fprintf(stderr, "-pi tcp: rank %d could not connect to rank 0 at %s:%d within %d s (is rank 0 running, "
                    "with the same -ps?)\n", process_rank, server_ip, port, timeout_s);
            exit(EXIT_FAILURE);
        }
        usleep(100 * 1000);  // rank 0 may not be listening yet
    }
}

static inline char* multi_gpu_fs_path(const char* fs_path, const char* name, int rank) {  // the caller frees it
    return rank < 0 ? string_format("%s/%s", fs_path, name) : string_format("%s/%s%d", fs_path, name, rank);
}

// Rank 0 publishes `id` in <fs_path>/ncclUniqueId.sync, every other rank reads it and leaves an
// acknowledgement ncclUniqueId.sync.ack<rank>; rank 0 then removes all of them.
static inline void multi_gpu_share_id_fs(ncclUniqueId* id, int process_rank, int num_processes, const char* fs_path,
                                         int timeout_s) {
    char* sync_path = multi_gpu_fs_path(fs_path, "ncclUniqueId.sync", -1);
    double deadline = multi_gpu_now_s() + timeout_s;
    if (process_rank == 0) {
        char* tmp_path;
        FILE* f = fopen_tmp_for(sync_path, &tmp_path);
        fwrite_check(id->internal, 1, sizeof(id->internal), f, tmp_path);
        commit_tmp(f, tmp_path, sync_path);
        free(tmp_path);
        for (int rank = 1; rank < num_processes; rank++) {
            char* ack_path = multi_gpu_fs_path(fs_path, "ncclUniqueId.sync.ack", rank);
            while (access(ack_path, F_OK) != 0) {
                if (multi_gpu_now_s() > deadline) {
                    fprintf(stderr, "-pi fs: rank %d did not read %s within %d s (is it running, with the same -pf?)\n",
                            rank, sync_path, timeout_s);
                    exit(EXIT_FAILURE);
                }
                usleep(50 * 1000);
            }
            free(ack_path);
        }
        for (int rank = 1; rank < num_processes; rank++) {
            char* ack_path = multi_gpu_fs_path(fs_path, "ncclUniqueId.sync.ack", rank);
            remove(ack_path);
            free(ack_path);
        }
        remove(sync_path);
        free(sync_path);
        return;
    }
    while (access(sync_path, F_OK) != 0) {
        if (multi_gpu_now_s() > deadline) {
            fprintf(stderr, "-pi fs: rank %d timed out after %d s waiting for %s (is rank 0 running, with the same -pf?)\n",
                    process_rank, timeout_s, sync_path);
            exit(EXIT_FAILURE);
        }
        usleep(50 * 1000);
    }
    FILE* f = fopen_check(sync_path, "rb");
    fread_check(id->internal, 1, sizeof(id->internal), f, sync_path);
    if (fgetc(f) != EOF) {
        fprintf(stderr, "%s: longer than an NCCL id (expected %zu bytes)\n", sync_path, sizeof(id->internal));
        exit(EXIT_FAILURE);
    }
    fclose_check(f, sync_path);
    char* ack_path = multi_gpu_fs_path(fs_path, "ncclUniqueId.sync.ack", process_rank);
    FILE* ack = fopen_check(ack_path, "wb");
    fclose_check(ack, ack_path);
    free(ack_path);
    free(sync_path);
}

// Whether this process was started by an MPI launcher (Open MPI's mpirun, or a PMI/PMIx one such as srun).
static inline int multi_gpu_launched_by_mpi(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") != NULL || getenv("PMI_SIZE") != NULL || getenv("PMIX_RANK") != NULL;
}

static inline MultiGpuConfig multi_gpu_config_init(const char* init_method, int num_processes, int process_rank,
                                                   int gpus_per_node, const char* server_ip, const char* fs_path) {
    MultiGpuConfig c;
    memset(&c, 0, sizeof(c));
    const char* method = init_method != NULL ? init_method : "mpi";
    int is_mpi = strcmp(method, "mpi") == 0;
    int is_tcp = strcmp(method, "tcp") == 0;
    int is_fs = strcmp(method, "fs") == 0;
    if (!is_mpi && !is_tcp && !is_fs) {
        fprintf(stderr, "unknown -pi '%s' (expected mpi, tcp or fs)\n", method);
        exit(EXIT_FAILURE);
    }
    if (gpus_per_node < 1) {
        fprintf(stderr, "-pg %d: expected at least 1 GPU per node\n", gpus_per_node);
        exit(EXIT_FAILURE);
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    if (is_mpi) {
        c.num_processes = 1;
        c.process_rank = 0;
        if (multi_gpu_launched_by_mpi()) {
            MPI_Init(NULL, NULL);
            c.used_mpi = 1;
            MPI_Comm_rank(MPI_COMM_WORLD, &c.process_rank);
            MPI_Comm_size(MPI_COMM_WORLD, &c.num_processes);
        }
        if (num_processes > 1 && num_processes != c.num_processes) {
            fprintf(stderr, "-pn %d: but %d process%s started (with -pi mpi the process count comes from mpirun -np)\n",
                    num_processes, c.num_processes, c.num_processes == 1 ? " was" : "es were");
            exit(EXIT_FAILURE);
        }
        const char* local_rank = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
        c.local_device_idx = local_rank != NULL ? atoi(local_rank) : c.process_rank % gpus_per_node;
        if (c.num_processes > 1) {
            if (c.process_rank == 0) ncclCheck(ncclGetUniqueId(&id));
            MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
        }
    } else {
        if (num_processes < 1) {
            fprintf(stderr, "-pn %d: expected at least 1 process\n", num_processes);
            exit(EXIT_FAILURE);
        }
        if (process_rank < 0 || process_rank >= num_processes) {
            fprintf(stderr, "-pr %d: out of range for -pn %d (expected 0 to %d)\n", process_rank, num_processes,
                    num_processes - 1);
            exit(EXIT_FAILURE);
        }
        if (is_tcp && num_processes > 1) multi_gpu_tcp_address(server_ip, MULTI_GPU_TCP_PORT);
        if (is_fs && num_processes > 1 && (fs_path == NULL || fs_path[0] == '\0')) {
            fprintf(stderr, "-pi fs: expected -pf, a directory all %d processes share\n", num_processes);
            exit(EXIT_FAILURE);
        }
#ifdef __CUCC__
        // NCCL over MPI cannot join processes that are not in one MPI world: refuse now, not hang later
        const char* world_size = getenv("OMPI_COMM_WORLD_SIZE");
        if (num_processes > 1 && (world_size == NULL || atoi(world_size) != num_processes)) {
            fprintf(stderr, "-pi tcp/fs needs the GPU build; on the CPU backend start the processes with mpirun "
                    "(-np %d)\n", num_processes);
            exit(EXIT_FAILURE);
        }
#endif
        c.num_processes = num_processes;
        c.process_rank = process_rank;
        c.local_device_idx = process_rank % gpus_per_node;
        if (num_processes > 1) {
            if (process_rank == 0) ncclCheck(ncclGetUniqueId(&id));
            if (is_tcp) {
                multi_gpu_share_id_tcp(&id, process_rank, num_processes, server_ip, MULTI_GPU_TCP_PORT,
                                       MULTI_GPU_ID_TIMEOUT_S);
            } else {
                multi_gpu_share_id_fs(&id, process_rank, num_processes, fs_path, MULTI_GPU_ID_TIMEOUT_S);
            }
        }
    }
    int device_count = 0;
    cudaCheck(cudaGetDeviceCount(&device_count));
    if (c.local_device_idx >= device_count) {
        fprintf(stderr, "process rank %d wants CUDA device %d, but this node has %d (check -pg and the processes per "
                "node)\n", c.process_rank, c.local_device_idx, device_count);
        exit(EXIT_FAILURE);
    }
    cudaCheck(cudaSetDevice(c.local_device_idx));
    if (c.num_processes == 1) ncclCheck(ncclGetUniqueId(&id));
    ncclCheck(ncclCommInitRank(&c.nccl_comm, c.num_processes, id, c.process_rank));
    cudaCheck(cudaStreamCreate(&c.nccl_stream));
    cudaCheck(cudaEventCreateWithFlags(&c.compute_done, cudaEventDisableTiming));
    cudaCheck(cudaMalloc((void**)&c.device_scalar, sizeof(uint64_t)));
    return c;
}

static inline void multi_gpu_config_free(MultiGpuConfig* c) {
    ncclCheck(ncclCommDestroy(c->nccl_comm));
    cudaCheck(cudaStreamDestroy(c->nccl_stream));
    cudaCheck(cudaEventDestroy(c->compute_done));
    cudaCheck(cudaFree(c->device_scalar));
    if (c->used_mpi) MPI_Finalize();
    c->nccl_comm = NULL;
    c->used_mpi = 0;
}

// Groups of `degree` consecutive processes of `world` (process r is member r % degree of group r / degree), and across
// them the processes with the same member index, one per group (expert and tensor parallelism). Collective over the
// world, degree > 1 dividing its process count: *group_comm over this process's group; *across, a copy of the world's
// config (its NCCL stream and events), becomes the config over this process's peers in the other groups (its rank: the
// group; its communicator NULL when there is one group). The first member of each group makes its group's id, the
// processes of group 0 their peers' ids, all travel through one all-gather over the world; each process joins its group
// first, then its peers, so no process waits on one that waits on it.
static void multi_gpu_split_groups(const MultiGpuConfig* world, int degree, ncclComm_t* group_comm,
                                   MultiGpuConfig* across) {
    int P = world->num_processes, member = world->process_rank % degree, group = world->process_rank / degree;
    ncclUniqueId mine[2];
    memset(mine, 0, sizeof(mine));
    if (member == 0) ncclCheck(ncclGetUniqueId(&mine[0]));
    if (group == 0 && P / degree > 1) ncclCheck(ncclGetUniqueId(&mine[1]));
    char* device_ids;
    cudaCheck(cudaMalloc((void**)&device_ids, (size_t)P * sizeof(mine)));
    cudaCheck(cudaMemcpy(device_ids + (size_t)world->process_rank * sizeof(mine), mine, sizeof(mine),
                         cudaMemcpyHostToDevice));
    ncclCheck(ncclAllGather(device_ids + (size_t)world->process_rank * sizeof(mine), device_ids, sizeof(mine),
                            ncclChar, world->nccl_comm, world->nccl_stream));
    cudaCheck(cudaStreamSynchronize(world->nccl_stream));
    ncclUniqueId* all = (ncclUniqueId*)malloc_check((size_t)P * sizeof(mine));
    cudaCheck(cudaMemcpy(all, device_ids, (size_t)P * sizeof(mine), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(device_ids));
    ncclCheck(ncclCommInitRank(group_comm, degree, all[2 * (group * degree) + 0], member));
    across->process_rank = group;
    across->num_processes = P / degree;
    across->nccl_comm = NULL;
    if (P / degree > 1) ncclCheck(ncclCommInitRank(&across->nccl_comm, P / degree, all[2 * member + 1], group));
    free(all);
}

// The communicator of this process's group (multi_gpu_split_groups: expert and tensor parallelism) and what its
// collectives need. They run on the compute stream while the world's gradient reductions run on its NCCL stream, and
// NCCL operations of two communicators in flight at the same time can deadlock (each GPU may start them in a different
// order): so every group collective first waits for what the NCCL stream has been given (group_after_reductions; the
// reductions issued later wait for the compute stream anyway). cpu/cucc --check reports the unordered case.
typedef struct {
    ncclComm_t comm;                // the members of this process's group
    cudaStream_t nccl_stream;       // the world's
    float* device_scalar;           // for group_float_sum
    cudaEvent_t reductions_issued;  // recorded on the NCCL stream before each group collective
} GroupComm;

// Collective over the world (multi_gpu_split_groups, whose `across` it fills in too).
static void group_comm_split(GroupComm* g, const MultiGpuConfig* world, int degree, MultiGpuConfig* across) {
    multi_gpu_split_groups(world, degree, &g->comm, across);
    g->nccl_stream = world->nccl_stream;
    cudaCheck(cudaMalloc((void**)&g->device_scalar, sizeof(float)));
    cudaCheck(cudaEventCreateWithFlags(&g->reductions_issued, cudaEventDisableTiming));
}

static void group_comm_free(GroupComm* g) {
    ncclCheck(ncclCommDestroy(g->comm));
    cudaCheck(cudaFree(g->device_scalar));
    cudaCheck(cudaEventDestroy(g->reductions_issued));
}

// Orders a group collective on `stream` after everything issued so far on the NCCL stream (see GroupComm).
static void group_after_reductions(const GroupComm* g, cudaStream_t stream) {
    cudaCheck(cudaEventRecord(g->reductions_issued, g->nccl_stream));
    cudaCheck(cudaStreamWaitEvent(stream, g->reductions_issued, 0));
}

// The sum of a host float over the group's members, the same on every member.
static float group_float_sum(const GroupComm* g, float value, cudaStream_t stream) {
    float sum;
    group_after_reductions(g, stream);
    cudaCheck(cudaMemcpyAsync(g->device_scalar, &value, sizeof(float), cudaMemcpyHostToDevice, stream));
    ncclCheck(ncclAllReduce(g->device_scalar, g->device_scalar, 1, ncclFloat, ncclSum, g->comm, stream));
    cudaCheck(cudaMemcpyAsync(&sum, g->device_scalar, sizeof(float), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    return sum;
}

// Returns once every process has called it: an all-reduce completes only when all ranks took part.
static inline void multi_gpu_barrier(const MultiGpuConfig* c) {
    if (c->num_processes == 1) return;
    ncclCheck(ncclAllReduce(c->device_scalar, c->device_scalar, 1, ncclFloat, ncclSum, c->nccl_comm, c->nccl_stream));
    cudaCheck(cudaStreamSynchronize(c->nccl_stream));
}

// The sum over processes of one host value of `type` (`bytes` long), in place: the same on every rank.
static inline void multi_gpu_cpu_sum(void* value, ncclDataType_t type, size_t bytes, const MultiGpuConfig* c) {
    if (c->num_processes == 1) return;
    cudaCheck(cudaMemcpyAsync(c->device_scalar, value, bytes, cudaMemcpyHostToDevice, c->nccl_stream));
    ncclCheck(ncclAllReduce(c->device_scalar, c->device_scalar, 1, type, ncclSum, c->nccl_comm, c->nccl_stream));
    cudaCheck(cudaMemcpyAsync(value, c->device_scalar, bytes, cudaMemcpyDeviceToHost, c->nccl_stream));
    cudaCheck(cudaStreamSynchronize(c->nccl_stream));
}

// ... of a host float (a loss)
static inline float multi_gpu_cpu_float_sum(float value, const MultiGpuConfig* c) {
    multi_gpu_cpu_sum(&value, ncclFloat, sizeof(value), c);
    return value;
}

// ... of a host count (exact, where a float's would not be past 2^24)
static inline uint64_t multi_gpu_cpu_count_sum(uint64_t value, const MultiGpuConfig* c) {
    multi_gpu_cpu_sum(&value, ncclUint64, sizeof(value), c);
    return value;
}
