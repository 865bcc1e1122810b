// mem_overrun_write (ok): the bounds guard is i < n. Correct twin of mem_overrun_write.bug.cu; no check may
// report it.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void ramp(float* y, int n, float step) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = step * (float)(i % 17);  // the fix
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
