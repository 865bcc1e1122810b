// ldg_x_inplace (ok): the scaling kernel is called out of place (in != out), so __ldg reads data that is
// read-only for the whole kernel. Correct twin of ldg_x_inplace.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void scale(const float* in, float* out, float s, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = s * __ldg(&in[i]);
}

int main() {
    const int n = 512;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 10);
    float *a, *b;
    CK(cudaMalloc(&a, sizeof h));
    CK(cudaMalloc(&b, sizeof h));
    CK(cudaMemcpy(a, h, sizeof h, cudaMemcpyHostToDevice));
    scale<<<2, 64>>>(a, b, 3.0f, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, b, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != 3.0f * h[i]) { fprintf(stderr, "out[%d] = %g\n", i, r[i]); return 1; }
    CK(cudaFree(a)); CK(cudaFree(b));
    printf("ok\n");
    return 0;
}
