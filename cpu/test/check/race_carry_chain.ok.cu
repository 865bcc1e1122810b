// race_carry_chain (ok): the carry chain in two launches: the first writes each block's sum, the second
// adds the carries in order. Correct twin of race_carry_chain.bug.cu; no check may report it.
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
    if (threadIdx.x == 0) prefix[blockIdx.x] = s;
}

__global__ void add_carries(int* prefix, int blocks) {  // the fix: a second launch carries in order
    for (int b = 1; b < blocks; b++) prefix[b] += prefix[b - 1];
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
    add_carries<<<1, 1>>>(prefix, blocks);
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
