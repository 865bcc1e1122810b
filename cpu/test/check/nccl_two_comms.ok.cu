// nccl_two_comms.ok.cu: twin of nccl_two_comms.bug.cu: the second stream waits on an event
// recorded after the first all-reduce, so the two are never in flight at once.
// ranks: 2
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#include <nccl.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank, nranks, ndev = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    if (cudaGetDeviceCount(&ndev) == cudaSuccess && ndev > 0) cudaSetDevice(rank % ndev);
    ncclUniqueId id;
    if (rank == 0) ncclGetUniqueId(&id);
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t comm;
    ncclCommInitRank(&comm, nranks, id, rank);
    const size_t n = 1024;
    float *a, *b;
    cudaMalloc(&a, n * sizeof(float));
    cudaMalloc(&b, n * sizeof(float));
    cudaMemset(a, 0, n * sizeof(float));
    cudaMemset(b, 0, n * sizeof(float));
    ncclUniqueId id2;
    if (rank == 0) ncclGetUniqueId(&id2);
    MPI_Bcast(&id2, sizeof(id2), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t comm2;
    ncclCommInitRank(&comm2, nranks, id2, rank);
    cudaStream_t s1, s2;
    cudaStreamCreate(&s1);
    cudaStreamCreate(&s2);
    ncclAllReduce(a, a, n, ncclFloat, ncclSum, comm, s1);
    cudaEvent_t done;
    cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    cudaEventRecord(done, s1);
    cudaStreamWaitEvent(s2, done, 0);
    ncclAllReduce(b, b, n, ncclFloat, ncclSum, comm2, s2);
    cudaStreamSynchronize(s1);
    cudaStreamSynchronize(s2);
    ncclCommDestroy(comm2);
    cudaDeviceSynchronize();
    ncclCommDestroy(comm);
    MPI_Finalize();
    return 0;
}
