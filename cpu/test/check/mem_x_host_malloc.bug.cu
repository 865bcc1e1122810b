// mem_x_host_malloc (bug): the host passes a malloc() buffer (pageable host memory) straight to a kernel
// instead of copying it to the device: the kernel's loads are of a host address (an illegal address on a
// GPU without HMM/ATS). expect memcheck.
// expect: memcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)
#include <cstdlib>

__global__ void square(const float* in, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] * in[i];
}

int main() {
    const int n = 256;
    float* h = (float*)malloc(n * sizeof(float));
    float r[n];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 11) - 5.0f;
    float *d_in, *out;
    CK(cudaMalloc(&d_in, n * sizeof(float)));
    CK(cudaMalloc(&out, n * sizeof(float)));
    CK(cudaMemcpy(d_in, h, n * sizeof(float), cudaMemcpyHostToDevice));
    square<<<n / 64, 64>>>(h /* bug: the host buffer, not d_in */, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != h[i] * h[i]) { fprintf(stderr, "out[%d] = %g\n", i, r[i]); return 1; }
    CK(cudaFree(d_in)); CK(cudaFree(out));
    free(h);
    printf("ok\n");
    return 0;
}
