// stream_x_legacy_default (bug): a kernel on a cudaStreamNonBlocking stream writes a buffer, and a kernel on
// the legacy default stream reads it: a non-blocking stream does not synchronise with stream 0, and nothing
// else orders them. expect streamcheck.
// expect: streamcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void fill(int* a, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) a[i] = i * i; }
__global__ void neg(const int* a, int* b, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) b[i] = -a[i]; }

int main() {
    const int n = 128;
    int r[n];
    int *a, *b;
    CK(cudaMalloc(&a, sizeof r));
    CK(cudaMalloc(&b, sizeof r));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) /* bug: not ordered with stream 0 */);
    fill<<<n / 64, 64, 0, s>>>(a, n);
    CK(cudaGetLastError());
    neg<<<n / 64, 64>>>(a, b, n);  // legacy default stream
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(r, b, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != -i * i) { fprintf(stderr, "b[%d] = %d\n", i, r[i]); return 1; }
    CK(cudaStreamDestroy(s));
    CK(cudaFree(a)); CK(cudaFree(b));
    printf("ok\n");
    return 0;
}
