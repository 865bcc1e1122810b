// init_x_d2h_unwritten (bug): a kernel computes n - 1 forward differences into an n-element output; the host
// copies all n back and adds them up, so the total includes one element nothing wrote (garbage on a GPU).
// expect: initcheck
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
    const int m = n /* bug: only n - 1 were written */;
    CK(cudaMemcpy(r, d, m * sizeof(float), cudaMemcpyDeviceToHost));
    double total = 0.0;
    for (int i = 0; i < m; i++) total += r[i];
    printf("total %g\n", total);
    CK(cudaFree(x)); CK(cudaFree(d));
    return 0;
}
