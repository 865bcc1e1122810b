// stream_pinned_d2h (bug): cudaMemcpyAsync copies device results into pinned host memory (cudaMallocHost) on
// a stream, and the host reads them before cudaStreamSynchronize. expect streamcheck.
// expect: streamcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void squares(float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = (float)(i % 37) * (float)(i % 37) - 5.0f;
}

int main() {
    const int n = 400;
    float *d, *h;
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    CK(cudaMalloc(&d, n * sizeof(float)));
    CK(cudaMallocHost(&h, n * sizeof(float)));
    squares<<<(n + 127) / 128, 128, 0, s>>>(d, n);
    CK(cudaGetLastError());
    CK(cudaMemcpyAsync(h, d, n * sizeof(float), cudaMemcpyDeviceToHost, s));
    // bug: CK(cudaStreamSynchronize(s)) is missing: the copy may still be in flight
    for (int i = 0; i < n; i++) {
        float want = (float)(i % 37) * (float)(i % 37) - 5.0f;
        if (h[i] != want) { fprintf(stderr, "h[%d] = %g, want %g\n", i, h[i], want); return 1; }
    }
    CK(cudaStreamDestroy(s));
    CK(cudaFreeHost(h));
    CK(cudaFree(d));
    printf("ok\n");
    return 0;
}
