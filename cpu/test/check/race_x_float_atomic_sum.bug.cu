// race_x_float_atomic_sum (bug): each block reduces in shared memory, then thread 0 adds the block sum into
// one global float with a plain `*sum += s[0]` (other blocks do the same: lost updates). expect racecheck.
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void total(const float* x, float* sum, int n) {
    __shared__ float s[128];
    int t = threadIdx.x, i = blockIdx.x * 128 + t;
    s[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int k = 64; k > 0; k >>= 1) {
        if (t < k) s[t] += s[t + k];
        __syncthreads();
    }
    if (t == 0) *sum += s[0];  // bug: not atomic across blocks
}

int main() {
    const int n = 1000, blocks = (n + 127) / 128;
    static float h[n];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 8) * 0.5f;
    float want = 0.0f;
    for (int i = 0; i < n; i++) want += h[i];
    float *x, *sum, r;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&sum, sizeof(float)));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemset(sum, 0, sizeof(float)));
    total<<<blocks, 128>>>(x, sum, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(&r, sum, sizeof r, cudaMemcpyDeviceToHost));
    if (r != want) { fprintf(stderr, "sum = %g, want %g\n", r, want); return 1; }
    CK(cudaFree(x)); CK(cudaFree(sum));
    printf("ok\n");
    return 0;
}
