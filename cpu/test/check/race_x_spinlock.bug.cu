// race_x_spinlock (bug): the global merge of block histograms with the spin lock's acquire commented out:
// the blocks' plain read-modify-writes of the shared bins race across blocks. expect racecheck.
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void merge(const int* keys, int n, int* lock, int* bins) {
    __shared__ int local[16];
    int t = threadIdx.x;
    if (t < 16) local[t] = 0;
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + t; i < n; i += gridDim.x * blockDim.x) atomicAdd(&local[keys[i] & 15], 1);
    __syncthreads();
    if (t == 0) {
        // bug: the lock is never acquired: while (atomicCAS(lock, 0, 1) != 0) {}
        __threadfence();
    }
    __syncthreads();
    if (t < 16) bins[t] += local[t];  // inside the critical section
    __threadfence();
    __syncthreads();
    if (t == 0) atomicExch(lock, 0);
}

int main() {
    const int n = 4096;
    static int h[n];
    int want[16] = {0}, r[16];
    for (int i = 0; i < n; i++) { h[i] = (i * 37 + 11) % 101; want[h[i] & 15]++; }
    int *keys, *lock, *bins;
    CK(cudaMalloc(&keys, sizeof h));
    CK(cudaMalloc(&lock, sizeof(int)));
    CK(cudaMalloc(&bins, sizeof r));
    CK(cudaMemcpy(keys, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemset(lock, 0, sizeof(int)));
    CK(cudaMemset(bins, 0, sizeof r));
    merge<<<8, 128>>>(keys, n, lock, bins);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, bins, sizeof r, cudaMemcpyDeviceToHost));
    for (int b = 0; b < 16; b++)
        if (r[b] != want[b]) { fprintf(stderr, "bins[%d] = %d, want %d\n", b, r[b], want[b]); return 1; }
    CK(cudaFree(keys)); CK(cudaFree(lock)); CK(cudaFree(bins));
    printf("ok\n");
    return 0;
}
