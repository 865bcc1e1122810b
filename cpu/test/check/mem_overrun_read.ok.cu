// mem_overrun_read (ok): the last thread of the forward difference does not read past the end. Correct twin
// of mem_overrun_read.bug.cu; no check may report it.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void forward_diff(const float* x, float* d, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float next = i + 1 < n ? x[i + 1] : 0.0f;  // the fix
    d[i] = next - x[i];
}

int main() {
    const int n = 100;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)((i * i) % 23);
    float *x, *d;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&d, sizeof r));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    forward_diff<<<1, 128>>>(x, d, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, d, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        float want = (i + 1 < n ? h[i + 1] : 0.0f) - h[i];
        if (r[i] != want) { fprintf(stderr, "d[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(x));
    CK(cudaFree(d));
    printf("ok\n");
    return 0;
}
