// race_partial_barrier (bug): the upper half of the block writes its shared slot and returns, so the barrier
// is reached by the lower half only, which then reads the upper half's writes: nothing orders them.
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void fold_halves(const float* in, float* out) {
    __shared__ float s[64];
    int t = threadIdx.x;
    s[t] = in[blockIdx.x * 64 + t] + 1.0f;
    if (t >= 32) return;  // bug: leaves before the barrier that publishes s[t]
    __syncthreads();
    out[blockIdx.x * 32 + t] = s[t] * s[t + 32];
}

int main() {
    const int blocks = 3;
    float h[blocks * 64], r[blocks * 32];
    for (int i = 0; i < blocks * 64; i++) h[i] = (float)((i * 5) % 11) - 3.0f;
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    fold_halves<<<blocks, 64>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int b = 0; b < blocks; b++)
        for (int t = 0; t < 32; t++) {
            float want = (h[b * 64 + t] + 1.0f) * (h[b * 64 + t + 32] + 1.0f);
            if (r[b * 32 + t] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", b * 32 + t, r[b * 32 + t], want); return 1; }
        }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
