// mem_x_before_start (bug): a backward difference d[i] = x[i] - x[i - 1] computed by every thread, so thread 0
// reads x[-1], four bytes before the start of the cudaMalloc buffer. expect memcheck.
// expect: memcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void back_diff(const float* x, float* d, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float prev = x[i - 1] /* bug: i == 0 reads x[-1] */;
    d[i] = x[i] - prev;
}

int main() {
    const int n = 96;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 10);
    float *pad, *x, *d;
    CK(cudaMalloc(&pad, 64));  // an allocation just before x
    CK(cudaMemset(pad, 0, 64));
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&d, sizeof r));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    back_diff<<<(n + 31) / 32, 32>>>(x, d, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, d, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 1; i < n; i++)
        if (r[i] != h[i] - h[i - 1]) { fprintf(stderr, "d[%d] = %g\n", i, r[i]); return 1; }
    CK(cudaFree(pad)); CK(cudaFree(x)); CK(cudaFree(d));
    printf("ok\n");
    return 0;
}
