// host_x_std_memcpy (ok): the results are fetched with cudaMemcpy DeviceToHost, then memcpy'd between host
// buffers. Correct twin of host_x_std_memcpy.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)
#include <cstring>

__global__ void iota(int* a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] = 5 * i;
}

int main() {
    const int n = 64;
    int r[n], tmp[n];
    int* a;
    CK(cudaMalloc(&a, sizeof r));
    iota<<<1, n>>>(a, n);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(tmp, a, sizeof tmp, cudaMemcpyDeviceToHost));
    memcpy(r, tmp, sizeof r);
    for (int i = 0; i < n; i++)
        if (r[i] != 5 * i) { fprintf(stderr, "a[%d] = %d\n", i, r[i]); return 1; }
    CK(cudaFree(a));
    printf("ok\n");
    return 0;
}
