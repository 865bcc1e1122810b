// nccl_order.ok.cu: twin of nccl_order.bug.cu: every rank calls ncclAllReduce, then ncclBroadcast.
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
    ncclAllReduce(a, a, n, ncclFloat, ncclSum, comm, 0);
    ncclBroadcast(b, b, n, ncclFloat, 0, comm, 0);
    cudaDeviceSynchronize();
    ncclCommDestroy(comm);
    MPI_Finalize();
    return 0;
}
