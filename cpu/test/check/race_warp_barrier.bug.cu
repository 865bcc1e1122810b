// race_warp_barrier (bug): a barrier that covers only part of the block: __syncwarp orders the writes of one
// warp, but each thread then reads the slot written by a thread of the other warp.
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void swap_warps(const float* in, float* out) {
    __shared__ float s[64];
    int t = threadIdx.x;
    s[t] = 0.0f;  // zeroed behind a barrier, so the bug's early reads read written memory
    __syncthreads();
    s[t] = in[blockIdx.x * 64 + t] * 3.0f;
    __syncwarp();  // bug: the reader below is in the other warp; this needs __syncthreads()
    out[blockIdx.x * 64 + t] = s[t] + s[(t + 32) % 64];
}

int main() {
    const int blocks = 2, n = blocks * 64;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 3) % 17);
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    swap_warps<<<blocks, 64>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        int b = i / 64, t = i % 64;
        float want = 3.0f * (h[i] + h[b * 64 + (t + 32) % 64]);
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
