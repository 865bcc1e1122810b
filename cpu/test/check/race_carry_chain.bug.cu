// race_carry_chain (bug): a carry chain inside one launch: block b adds the prefix that block b - 1 writes
// in the same kernel, but blocks are not ordered. expect racecheck (prefix is zeroed first, so only the
// ordering is wrong).
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__device__ int warp_sum(const int* x) {  // one warp sums 32 * 4 consecutive ints
    int s = 0;
    for (int j = 0; j < 4; j++) s += x[j * 32 + threadIdx.x];
    for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffffu, s, off);
    return s;
}

__global__ void chunk_prefix(const int* x, int* prefix) {
    int s = warp_sum(x + blockIdx.x * 128);
    if (threadIdx.x == 0) {
        if (blockIdx.x > 0) s += prefix[blockIdx.x - 1];  // bug: written by another block of this launch
        prefix[blockIdx.x] = s;
    }
}

int main() {
    const int blocks = 8, n = blocks * 128;
    static int h[n];
    int r[blocks];
    for (int i = 0; i < n; i++) h[i] = (i * 13) % 7 - 2;
    int *x, *prefix;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&prefix, sizeof r));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemset(prefix, 0, sizeof r));
    chunk_prefix<<<blocks, 32>>>(x, prefix);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, prefix, sizeof r, cudaMemcpyDeviceToHost));
    int want = 0;
    for (int b = 0; b < blocks; b++) {
        for (int j = 0; j < 128; j++) want += h[b * 128 + j];
        if (r[b] != want) { fprintf(stderr, "prefix[%d] = %d, want %d\n", b, r[b], want); return 1; }
    }
    CK(cudaFree(x));
    CK(cudaFree(prefix));
    printf("ok\n");
    return 0;
}
