// nccl_x_allgather_small (bug): ncclAllGather of sendcount floats per rank into a receive buffer sized
// sendcount (not nranks * sendcount): NCCL writes past its end. expect ncclcheck.
// expect: ncclcheck
// ranks: 2
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#include <nccl.h>
#include <cuda_runtime.h>
#include <stdio.h>

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
    const size_t count = 128;
    float *send, *recv;
    cudaMalloc(&send, count * sizeof(float));
    cudaMalloc(&recv, count /* bug: nranks * count needed */ * sizeof(float));
    cudaMemset(send, 0, count * sizeof(float));
    ncclAllGather(send, recv, count, ncclFloat, comm, 0);
    cudaDeviceSynchronize();
    cudaFree(send);
    cudaFree(recv);
    ncclCommDestroy(comm);
    MPI_Finalize();
    return 0;
}
