// stream_x_query_poll (ok): the host polls cudaStreamQuery until it returns cudaSuccess (doing CPU work in
// between) before reading the pinned results. Correct twin of stream_x_query_poll.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void cube(const int* a, int* b, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) b[i] = a[i] * a[i] * a[i]; }

int main() {
    const int n = 128;
    int *h, *res, *a, *b;
    CK(cudaMallocHost(&h, n * sizeof(int)));
    CK(cudaMallocHost(&res, n * sizeof(int)));
    CK(cudaMalloc(&a, n * sizeof(int)));
    CK(cudaMalloc(&b, n * sizeof(int)));
    for (int i = 0; i < n; i++) h[i] = i % 9 - 4;
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    CK(cudaMemcpyAsync(a, h, n * sizeof(int), cudaMemcpyHostToDevice, s));
    cube<<<n / 64, 64, 0, s>>>(a, b, n);
    CK(cudaGetLastError());
    CK(cudaMemcpyAsync(res, b, n * sizeof(int), cudaMemcpyDeviceToHost, s));
    long spins = 0;
    cudaError_t q;
    while ((q = cudaStreamQuery(s)) == cudaErrorNotReady) spins++;  // CPU work would go here
    CK(q);
    for (int i = 0; i < n; i++) {
        int v = i % 9 - 4;
        if (res[i] != v * v * v) { fprintf(stderr, "res[%d] = %d\n", i, res[i]); return 1; }
    }
    printf("ok (%ld polls)\n", spins);
    CK(cudaStreamDestroy(s));
    CK(cudaFreeHost(h)); CK(cudaFreeHost(res)); CK(cudaFree(a)); CK(cudaFree(b));
    return 0;
}
