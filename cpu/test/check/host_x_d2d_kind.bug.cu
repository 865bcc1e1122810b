// host_x_d2d_kind (bug): a device-to-device snapshot of a buffer is made with cudaMemcpyHostToDevice (a
// copy-paste from the upload above it): the source is device memory. expect hostcheck.
// expect: hostcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void inc(float* a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] += 1.0f;
}

int main() {
    const int n = 128;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)i;
    float *a, *snap;
    CK(cudaMalloc(&a, sizeof h));
    CK(cudaMalloc(&snap, sizeof h));
    CK(cudaMemcpy(a, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(snap, a, sizeof h, cudaMemcpyHostToDevice /* bug: both are device buffers */));
    inc<<<n / 64, 64>>>(a, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, snap, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != (float)i) { fprintf(stderr, "snap[%d] = %g\n", i, r[i]); return 1; }
    CK(cudaFree(a)); CK(cudaFree(snap));
    printf("ok\n");
    return 0;
}
