// race_war_shared (bug): write-after-read in shared memory: each thread reads its neighbour's slot, then
// overwrites its own slot with no barrier between, while the thread below may not have read it yet.
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void rotate_scale(const float* in, float* out) {
    __shared__ float s[128];
    int t = threadIdx.x;
    s[t] = in[blockIdx.x * 128 + t];
    __syncthreads();
    float v = s[(t + 1) % 128];
    // bug: a __syncthreads() is missing here: thread t - 1 may still have to read s[t]
    s[t] = v * 0.5f;
    __syncthreads();
    out[blockIdx.x * 128 + t] = s[t] + s[(t + 127) % 128];
}

int main() {
    const int blocks = 2, n = blocks * 128;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 11) % 23);
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    rotate_scale<<<blocks, 128>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        int b = i / 128, t = i % 128;
        float want = 0.5f * (h[b * 128 + (t + 1) % 128] + h[i]);
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
