// race_global_ww (bug): two blocks of one launch store different values to the same global element
// (block b writes out[b / 2] instead of out[b]): a cross-block write/write race. expect racecheck.
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void block_max(const float* x, float* out) {
    __shared__ float s[64];
    int t = threadIdx.x;
    s[t] = x[blockIdx.x * 64 + t];
    __syncthreads();
    for (int half = 32; half > 0; half /= 2) {
        if (t < half) s[t] = fmaxf(s[t], s[t + half]);
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x / 2] = s[0];  // bug: out[blockIdx.x]
}

int main() {
    const int blocks = 4, n = blocks * 64;
    float h[n], r[blocks];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 29) % 61) - (float)(i / 64) * 5.0f;
    float *x, *out;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemset(out, 0, sizeof r));
    block_max<<<blocks, 64>>>(x, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int b = 0; b < blocks; b++) {
        float want = h[b * 64];
        for (int t = 1; t < 64; t++) want = fmaxf(want, h[b * 64 + t]);
        if (r[b] != want) { fprintf(stderr, "max[%d] = %g, want %g\n", b, r[b], want); return 1; }
    }
    CK(cudaFree(x));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
