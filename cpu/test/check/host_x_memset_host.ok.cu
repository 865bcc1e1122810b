// host_x_memset_host (ok): cudaMemset clears the device result buffer. Correct twin of host_x_memset_host.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void add_to(int* acc, const int* v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += v[i];
}

int main() {
    const int n = 64;
    static int h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = i * 3;
    int *acc, *v;
    CK(cudaMalloc(&acc, sizeof r));
    CK(cudaMalloc(&v, sizeof h));
    CK(cudaMemcpy(v, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemset(acc, 0, sizeof r));
    add_to<<<1, n>>>(acc, v, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, acc, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != h[i]) { fprintf(stderr, "acc[%d] = %d\n", i, r[i]); return 1; }
    CK(cudaFree(acc)); CK(cudaFree(v));
    printf("ok\n");
    return 0;
}
