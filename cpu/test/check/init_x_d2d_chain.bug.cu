// init_x_d2d_chain (bug): a kernel fills n - 1 of a buffer's n elements (its guard is i < n - 1), the buffer is
// copied device-to-device, and a second kernel reads all n elements of the copy: the last was never
// written. expect initcheck.
// expect: initcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void produce(float* a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n - 1 /* bug: the last element is skipped */) a[i] = (float)(i % 5) + 0.5f;
}
__global__ void consume(const float* b, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 2.0f * b[i];
}

int main() {
    const int n = 200;
    float r[n];
    float *a, *b, *out;
    CK(cudaMalloc(&a, n * sizeof(float)));
    CK(cudaMalloc(&b, n * sizeof(float)));
    CK(cudaMalloc(&out, n * sizeof(float)));
    produce<<<(n + 63) / 64, 64>>>(a, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(b, a, n * sizeof(float), cudaMemcpyDeviceToDevice));
    consume<<<(n + 63) / 64, 64>>>(b, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n - 1; i++)
        if (r[i] != 2.0f * ((float)(i % 5) + 0.5f)) { fprintf(stderr, "out[%d] = %g\n", i, r[i]); return 1; }
    CK(cudaFree(a)); CK(cudaFree(b)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
