// race_nosync (bug): threads write shared memory and read a neighbour's slot with no __syncthreads
// between the write and the read. expect racecheck (the slots were zeroed behind a barrier first, so the
// read is of written memory: only the ordering is wrong).
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void neighbour_diff(const float* in, float* out) {
    __shared__ float s[128];
    int t = threadIdx.x;
    s[t] = 0.0f;
    __syncthreads();
    s[t] = in[blockIdx.x * 128 + t] * 2.0f;
    // bug: missing __syncthreads() here
    out[blockIdx.x * 128 + t] = s[(t + 1) % 128] - s[t];
}

int main() {
    const int n = 256;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 7) % 13);
    float *in, *out;
    CK(cudaMalloc(&in, n * sizeof(float)));
    CK(cudaMalloc(&out, n * sizeof(float)));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    neighbour_diff<<<n / 128, 128>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        int b = i / 128, t = i % 128;
        float want = 2.0f * (h[b * 128 + (t + 1) % 128] - h[i]);
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
