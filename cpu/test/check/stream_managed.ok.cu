// stream_managed (ok): the host reads the managed memory a kernel wrote only after cudaDeviceSynchronize.
// Correct twin of stream_managed.bug.cu; no check may report it.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void cube(float* m, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) m[i] = m[i] * m[i] * m[i];
}

int main() {
    const int n = 256;
    float* m;
    CK(cudaMallocManaged(&m, n * sizeof(float), cudaMemAttachGlobal));
    for (int i = 0; i < n; i++) m[i] = (float)(i % 9) - 4.0f;  // the host writes before any kernel runs
    cube<<<n / 64, 64>>>(m, n);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());  // the fix
    for (int i = 0; i < n; i++) {
        float v = (float)(i % 9) - 4.0f;
        if (m[i] != v * v * v) { fprintf(stderr, "m[%d] = %g, want %g\n", i, m[i], v * v * v); return 1; }
    }
    CK(cudaFree(m));
    printf("ok\n");
    return 0;
}
