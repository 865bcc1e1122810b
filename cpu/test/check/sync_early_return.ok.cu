// sync_early_return (ok, no bug twin): the common `if (i >= n) return;` bounds guard before any barrier;
// the threads left reach every barrier together. Correct CUDA; synccheck (and every check) must stay silent.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void smooth(const float* in, float* out, int n) {
    __shared__ float s[128];
    int t = threadIdx.x, i = blockIdx.x * 128 + t;
    if (i >= n) return;
    s[t] = in[i];
    __syncthreads();
    float right = (t + 1 < 128 && i + 1 < n) ? s[t + 1] : 0.0f;
    out[i] = 2.0f * s[t] + right;
}

int main() {
    const int n = 200;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 13) % 21) - 10.0f;
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    smooth<<<(n + 127) / 128, 128>>>(in, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        float right = (i % 128 + 1 < 128 && i + 1 < n) ? h[i + 1] : 0.0f;
        if (r[i] != 2.0f * h[i] + right) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], 2.0f * h[i] + right); return 1; }
    }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
