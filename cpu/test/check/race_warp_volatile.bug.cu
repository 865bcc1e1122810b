// race_warp_volatile (bug): the legacy warp-synchronous reduction over volatile shared memory with no
// __syncwarp: under independent thread scheduling lane t reads v[t + 16] while lane t + 16 updates it.
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void block_sum(const float* in, float* out) {
    __shared__ float s[64];
    int t = threadIdx.x;
    s[t] = in[blockIdx.x * 64 + t];
    __syncthreads();
    if (t < 32) {
        volatile float* v = s;  // bug: "warp-synchronous" code without __syncwarp between the steps
        v[t] += v[t + 32];
        v[t] += v[t + 16];
        v[t] += v[t + 8];
        v[t] += v[t + 4];
        v[t] += v[t + 2];
        v[t] += v[t + 1];
        if (t == 0) out[blockIdx.x] = v[0];
    }
}

int main() {
    const int blocks = 4, n = blocks * 64;
    float h[n], r[blocks];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 7) % 10);
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    block_sum<<<blocks, 64>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int b = 0; b < blocks; b++) {
        float want = 0.0f;
        for (int t = 0; t < 64; t++) want += h[b * 64 + t];
        if (r[b] != want) { fprintf(stderr, "sum[%d] = %g, want %g\n", b, r[b], want); return 1; }
    }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
