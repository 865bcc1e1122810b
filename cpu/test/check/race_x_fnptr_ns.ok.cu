// race_x_fnptr_ns (ok): a namespaced kernel launched through a function pointer smooths shared values in
// place with a barrier between the neighbours' reads and the stores. Correct twin of race_x_fnptr_ns.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

namespace filters {
__global__ void smooth(const float* in, float* out, int n) {
    __shared__ float s[130];
    int t = threadIdx.x + 1, i = blockIdx.x * 128 + threadIdx.x;
    s[t] = in[i];
    if (threadIdx.x == 0) s[0] = blockIdx.x > 0 ? in[i - 1] : 0.0f;
    if (threadIdx.x == 127) s[129] = i + 1 < n ? in[i + 1] : 0.0f;
    __syncthreads();
    float v = s[t - 1] + s[t] + s[t + 1];
    __syncthreads();
    s[t] = v;
    __syncthreads();
    out[i] = s[t];
}
__global__ void copy(const float* in, float* out, int n) { int i = blockIdx.x * 128 + threadIdx.x; out[i] = in[i]; (void)n; }
}  // namespace filters

typedef void (*kernel_t)(const float*, float*, int);

int main(int argc, char**) {
    const int n = 512;
    static float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 10);
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    kernel_t k = argc > 5 ? filters::copy : filters::smooth;
    k<<<n / 128, 128>>>(in, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        float want = (i > 0 ? h[i - 1] : 0.0f) + h[i] + (i + 1 < n ? h[i + 1] : 0.0f);
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
