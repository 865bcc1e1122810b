// init_x_memset_half (ok): cudaMemset clears the whole counter array (size in bytes) before the kernel
// increments every counter. Correct twin of init_x_memset_half.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void bump(unsigned* counts, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) counts[i] += 1u + (unsigned)(i & 3);
}

int main() {
    const int n = 256;
    unsigned r[n];
    unsigned* counts;
    CK(cudaMalloc(&counts, n * sizeof(unsigned)));
    CK(cudaMemset(counts, 0, n * sizeof(unsigned)));
    bump<<<n / 64, 64>>>(counts, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, counts, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != 1u + (unsigned)(i & 3)) { fprintf(stderr, "counts[%d] = %u\n", i, r[i]); return 1; }
    CK(cudaFree(counts));
    printf("ok\n");
    return 0;
}
