// stream_x_wrong_event (ok): the consumer stream waits on the event recorded after the producing kernel.
// Correct twin of stream_x_wrong_event.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void produce(float* a, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) a[i] = 0.5f * (float)i; }
__global__ void consume(const float* a, float* b, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) b[i] = a[i] + 1.0f; }

int main() {
    const int n = 256;
    float r[n];
    float *a, *b;
    CK(cudaMalloc(&a, n * sizeof(float)));
    CK(cudaMalloc(&b, n * sizeof(float)));
    cudaStream_t ps, cs;
    CK(cudaStreamCreateWithFlags(&ps, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    cudaEvent_t start, done;
    CK(cudaEventCreate(&start));
    CK(cudaEventCreate(&done));
    CK(cudaEventRecord(start, ps));
    produce<<<n / 64, 64, 0, ps>>>(a, n);
    CK(cudaGetLastError());
    CK(cudaEventRecord(done, ps));
    CK(cudaStreamWaitEvent(cs, done, 0));
    consume<<<n / 64, 64, 0, cs>>>(a, b, n);
    CK(cudaGetLastError());
    CK(cudaEventSynchronize(done));
    CK(cudaStreamSynchronize(cs));
    float ms;
    CK(cudaEventElapsedTime(&ms, start, done));
    CK(cudaMemcpy(r, b, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != 0.5f * (float)i + 1.0f) { fprintf(stderr, "b[%d] = %g\n", i, r[i]); return 1; }
    CK(cudaEventDestroy(start)); CK(cudaEventDestroy(done));
    CK(cudaStreamDestroy(ps)); CK(cudaStreamDestroy(cs));
    CK(cudaFree(a)); CK(cudaFree(b));
    printf("ok\n");
    return 0;
}
