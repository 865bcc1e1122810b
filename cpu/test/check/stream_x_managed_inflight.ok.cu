// stream_x_managed_inflight (ok): the host writes managed input, launches, cudaDeviceSynchronize, and
// only then rewrites the input and reads the output. Correct twin of stream_x_managed_inflight.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void twice(const float* in, float* out, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) out[i] = 2.0f * in[i]; }

int main() {
    const int n = 128;
    float *in, *out;
    CK(cudaMallocManaged(&in, n * sizeof(float)));
    CK(cudaMallocManaged(&out, n * sizeof(float)));
    double total = 0.0;
    for (int step = 0; step < 2; step++) {
        for (int i = 0; i < n; i++) in[i] = (float)(i + step);
        twice<<<n / 64, 64>>>(in, out, n);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        for (int i = 0; i < n; i++) total += out[i];
    }
    printf("total %g\n", total);
    CK(cudaFree(in)); CK(cudaFree(out));
    return 0;
}
