// stream_x_event_host (bug): the host waits with cudaEventSynchronize on an event recorded before the kernel
// that writes the managed results, then reads them. expect streamcheck.
// expect: streamcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void halve(float* m, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) m[i] *= 0.5f; }

int main() {
    const int n = 128;
    float* m;
    CK(cudaMallocManaged(&m, n * sizeof(float)));
    for (int i = 0; i < n; i++) m[i] = (float)(2 * i);
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    cudaEvent_t before, after;
    CK(cudaEventCreateWithFlags(&before, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&after, cudaEventDisableTiming));
    CK(cudaEventRecord(before, s));
    halve<<<n / 64, 64, 0, s>>>(m, n);
    CK(cudaGetLastError());
    CK(cudaEventRecord(after, s));
    CK(cudaEventSynchronize(before /* bug: does not cover the kernel */));
    for (int i = 0; i < n; i++)
        if (m[i] != (float)i) { fprintf(stderr, "m[%d] = %g\n", i, m[i]); return 1; }
    CK(cudaStreamSynchronize(s));
    CK(cudaEventDestroy(before)); CK(cudaEventDestroy(after));
    CK(cudaStreamDestroy(s));
    CK(cudaFree(m));
    printf("ok\n");
    return 0;
}
