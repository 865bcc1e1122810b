// stream_x_pinned_h2d (bug): double-buffered upload from one pinned staging buffer: cudaMemcpyAsync H2D of
// chunk 0 is queued on a stream, and the host refills the same pinned buffer with chunk 1 before the copy is
// known to be done (no cudaStreamSynchronize / event). expect streamcheck.
// expect: streamcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void accumulate(float* acc, const float* chunk, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += chunk[i];
}

int main() {
    const int n = 256;
    float *stage, *d_chunk, *acc;
    float r[n];
    CK(cudaMallocHost(&stage, n * sizeof(float)));
    CK(cudaMalloc(&d_chunk, n * sizeof(float)));
    CK(cudaMalloc(&acc, n * sizeof(float)));
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    CK(cudaMemsetAsync(acc, 0, n * sizeof(float), s));
    for (int c = 0; c < 2; c++) {
        // bug: no cudaStreamSynchronize before the host overwrites stage, which the previous copy may still read
        for (int i = 0; i < n; i++) stage[i] = (float)(c * 10 + i % 7);
        CK(cudaMemcpyAsync(d_chunk, stage, n * sizeof(float), cudaMemcpyHostToDevice, s));
        accumulate<<<n / 64, 64, 0, s>>>(acc, d_chunk, n);
        CK(cudaGetLastError());
    }
    CK(cudaMemcpyAsync(r, acc, sizeof r, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    for (int i = 0; i < n; i++)
        if (r[i] != (float)(10 + 2 * (i % 7))) { fprintf(stderr, "acc[%d] = %g\n", i, r[i]); return 1; }
    CK(cudaStreamDestroy(s));
    CK(cudaFreeHost(stage)); CK(cudaFree(d_chunk)); CK(cudaFree(acc));
    printf("ok\n");
    return 0;
}
