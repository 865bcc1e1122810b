// host_deref_write (bug): host code stores a scalar parameter through the cudaMalloc pointer (a segfault on
// a GPU) instead of copying it. expect hostcheck.
// expect: hostcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void axpy(const float* alpha, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += *alpha * x[i];
}

int main() {
    const int n = 200;
    const float a = 2.5f;
    float hx[n], hy[n], r[n];
    for (int i = 0; i < n; i++) { hx[i] = (float)(i % 13) - 6.0f; hy[i] = (float)(i % 4); }
    float *alpha, *x, *y;
    CK(cudaMalloc(&alpha, sizeof(float)));
    CK(cudaMalloc(&x, sizeof hx));
    CK(cudaMalloc(&y, sizeof hy));
    CK(cudaMemcpy(x, hx, sizeof hx, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(y, hy, sizeof hy, cudaMemcpyHostToDevice));
    *alpha = a;  // bug: a device pointer written on the host; needs cudaMemcpy
    axpy<<<(n + 127) / 128, 128>>>(alpha, x, y, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, y, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != hy[i] + a * hx[i]) { fprintf(stderr, "y[%d] = %g, want %g\n", i, r[i], hy[i] + a * hx[i]); return 1; }
    CK(cudaFree(alpha));
    CK(cudaFree(x));
    CK(cudaFree(y));
    printf("ok\n");
    return 0;
}
