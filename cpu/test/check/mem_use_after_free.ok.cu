// mem_use_after_free (ok): the temporary buffer is freed after the last kernel that reads it. Correct twin
// of mem_use_after_free.bug.cu; no check may report it.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void square(const float* x, float* t, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) t[i] = x[i] * x[i];
}
__global__ void add_shifted(const float* t, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = t[i] + x[(i + 1) % n];
}

int main() {
    const int n = 128;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 3) % 10) - 4.0f;
    float *x, *tmp, *y;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&tmp, sizeof h));
    CK(cudaMalloc(&y, sizeof r));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    square<<<1, n>>>(x, tmp, n);
    CK(cudaGetLastError());
    add_shifted<<<1, n>>>(tmp, x, y, n);
    CK(cudaGetLastError());
    CK(cudaFree(tmp));  // the fix: freed after its last reader
    CK(cudaMemcpy(r, y, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != h[i] * h[i] + h[(i + 1) % n]) { fprintf(stderr, "y[%d] = %g, want %g\n", i, r[i], h[i] * h[i] + h[(i + 1) % n]); return 1; }
    CK(cudaFree(x));
    CK(cudaFree(y));
    printf("ok\n");
    return 0;
}
