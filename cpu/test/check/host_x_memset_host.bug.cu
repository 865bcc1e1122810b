// host_x_memset_host (bug): the result buffer is cleared with cudaMemset on the host array instead of the
// device one (cudaMemset only takes device memory; it fails or corrupts). expect hostcheck.
// expect: hostcheck
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
    CK(cudaMemset(r, 0, sizeof r));  // bug: r is the host array
    CK(cudaMemcpy(acc, r, sizeof r, cudaMemcpyHostToDevice));
    add_to<<<1, n>>>(acc, v, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, acc, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != h[i]) { fprintf(stderr, "acc[%d] = %d\n", i, r[i]); return 1; }
    CK(cudaFree(acc)); CK(cudaFree(v));
    printf("ok\n");
    return 0;
}
