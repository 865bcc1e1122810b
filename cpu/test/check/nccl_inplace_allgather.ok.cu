// nccl_inplace_allgather.ok.cu: twin of nccl_inplace_allgather.bug.cu: each rank passes
// its own slice, recvbuff + rank * sendcount, as sendbuff.
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
    const size_t n = 256;  // elements per rank
    float* all;
    cudaMalloc(&all, n * nranks * sizeof(float));
    cudaMemset(all, 0, n * nranks * sizeof(float));
    ncclAllGather(all + rank * n, all, n, ncclFloat, comm, 0);
    cudaDeviceSynchronize();
    ncclCommDestroy(comm);
    MPI_Finalize();
    return 0;
}
