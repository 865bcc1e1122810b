// nccl_x_bcast_root (ok): every rank passes root 0 to the ncclBroadcast. Correct twin of nccl_x_bcast_root.bug.cu.
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
    const size_t n = 256;
    float h[n];
    for (size_t i = 0; i < n; i++) h[i] = rank == 0 ? (float)i : -1.0f;
    float* buf;
    cudaMalloc(&buf, n * sizeof(float));
    cudaMemcpy(buf, h, sizeof h, cudaMemcpyHostToDevice);
    cudaStream_t s;
    cudaStreamCreate(&s);
    ncclBroadcast(buf, buf, n, ncclFloat, 0, comm, s);
    cudaStreamSynchronize(s);
    cudaMemcpy(h, buf, sizeof h, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (size_t i = 0; i < n; i++) bad += h[i] != (float)i;
    if (bad) fprintf(stderr, "rank %d: %d wrong\n", rank, bad);
    cudaFree(buf);
    cudaStreamDestroy(s);
    ncclCommDestroy(comm);
    MPI_Finalize();
    return bad ? 1 : 0;
}
