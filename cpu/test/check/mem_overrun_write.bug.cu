// mem_overrun_write (bug): an off-by-one bounds guard (i <= n) makes thread n store one element past the
// end of an n-float cudaMalloc buffer. expect memcheck.
// expect: memcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void ramp(float* y, int n, float step) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) y[i] = step * (float)(i % 17);  // bug: must be i < n
}

int main() {
    const int n = 100;
    float r[n];
    float* y;
    CK(cudaMalloc(&y, n * sizeof(float)));
    ramp<<<1, 128>>>(y, n, 0.25f);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, y, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != 0.25f * (float)(i % 17)) { fprintf(stderr, "y[%d] = %g, want %g\n", i, r[i], 0.25f * (float)(i % 17)); return 1; }
    CK(cudaFree(y));
    printf("ok\n");
    return 0;
}
