// init_x_d2h_unwritten (ok): the host copies back and adds up only the n - 1 differences the kernel wrote.
// Correct twin of init_x_d2h_unwritten.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void diffs(const float* x, float* d, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n - 1) d[i] = x[i + 1] - x[i];
}

int main() {
    const int n = 100;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)(i * i % 13);
    float *x, *d;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&d, sizeof r));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    diffs<<<(n + 31) / 32, 32>>>(x, d, n);
    CK(cudaGetLastError());
    const int m = n - 1;
    CK(cudaMemcpy(r, d, m * sizeof(float), cudaMemcpyDeviceToHost));
    double total = 0.0;
    for (int i = 0; i < m; i++) total += r[i];
    printf("total %g\n", total);
    CK(cudaFree(x)); CK(cudaFree(d));
    return 0;
}
