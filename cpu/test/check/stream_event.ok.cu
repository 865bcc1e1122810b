// stream_event (ok): stream B waits on an event recorded on stream A after the kernel that writes what B's
// kernel reads. Correct twin of stream_event.bug.cu; no check may report it.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void scale(const float* x, float* y, int n, float a) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i];
}
__global__ void shift(const float* y, float* z, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) z[i] = y[i] + 1.0f;
}

int main() {
    const int n = 300;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 9) % 14) - 6.0f;
    float *x, *y, *z;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&y, sizeof h));
    CK(cudaMalloc(&z, sizeof h));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    cudaStream_t a, b;
    cudaEvent_t y_ready;
    CK(cudaStreamCreate(&a));
    CK(cudaStreamCreate(&b));
    CK(cudaEventCreateWithFlags(&y_ready, cudaEventDisableTiming));
    scale<<<(n + 127) / 128, 128, 0, a>>>(x, y, n, 3.0f);
    CK(cudaGetLastError());
    CK(cudaEventRecord(y_ready, a));  // the fix
    CK(cudaStreamWaitEvent(b, y_ready, 0));
    shift<<<(n + 127) / 128, 128, 0, b>>>(y, z, n);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(b));
    CK(cudaStreamSynchronize(a));
    CK(cudaMemcpy(r, z, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != 3.0f * h[i] + 1.0f) { fprintf(stderr, "z[%d] = %g, want %g\n", i, r[i], 3.0f * h[i] + 1.0f); return 1; }
    CK(cudaEventDestroy(y_ready));
    CK(cudaStreamDestroy(a));
    CK(cudaStreamDestroy(b));
    CK(cudaFree(x));
    CK(cudaFree(y));
    CK(cudaFree(z));
    printf("ok\n");
    return 0;
}
