// init_partial_memcpy (ok): the buffer holds cap floats, cudaMemcpy fills n, and the kernel reads n. Correct
// twin of init_partial_memcpy.bug.cu; no check may report it.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void total(const float* x, int count, float* out) {
    __shared__ float s[256];
    int t = threadIdx.x;
    s[t] = t < count ? x[t] : 0.0f;
    __syncthreads();
    for (int half = 128; half > 0; half /= 2) {
        if (t < half) s[t] += s[t + half];
        __syncthreads();
    }
    if (t == 0) *out = s[0];
}

int main() {
    const int cap = 256, n = 200;
    float h[n], got, want = 0.0f;
    for (int i = 0; i < n; i++) { h[i] = (float)((i * 7) % 12) - 5.0f; want += h[i]; }
    float *x, *out;
    CK(cudaMalloc(&x, cap * sizeof(float)));
    CK(cudaMalloc(&out, sizeof(float)));
    CK(cudaMemcpy(x, h, n * sizeof(float), cudaMemcpyHostToDevice));
    total<<<1, 256>>>(x, n, out);  // the fix: read only what was copied
    CK(cudaGetLastError());
    CK(cudaMemcpy(&got, out, sizeof(float), cudaMemcpyDeviceToHost));
    if (got != want) { fprintf(stderr, "total = %g, want %g\n", got, want); return 1; }
    CK(cudaFree(x));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
