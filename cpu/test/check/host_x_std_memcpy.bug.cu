// host_x_std_memcpy (bug): the results are fetched with the C library's memcpy from the device pointer
// (instead of cudaMemcpy): host code reading device memory, a segfault on a GPU. expect hostcheck.
// expect: hostcheck
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
    memcpy(r, a, sizeof r);  // bug: a is device memory
    (void)tmp;
    for (int i = 0; i < n; i++)
        if (r[i] != 5 * i) { fprintf(stderr, "a[%d] = %d\n", i, r[i]); return 1; }
    CK(cudaFree(a));
    printf("ok\n");
    return 0;
}
