// sync_loop_barrier (bug): a tile loop holding __syncthreads whose trip count depends on threadIdx: threads
// 0-15 run one iteration more than the rest, which go on to the barrier after the loop. expect synccheck.
// expect: synccheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void tiled_sum(const float* in, float* out, int tiles) {
    __shared__ float s[64];
    int t = threadIdx.x;
    int mine = t < 16 ? tiles : tiles - 1;  // threads 0-15 also take the last tile
    float acc = 0.0f;
    for (int k = 0; k < mine; k++) {  // bug: the barriers below are reached a different number of times
        s[t] = in[k * 64 + t];
        __syncthreads();
        acc += s[63 - t];
        __syncthreads();
    }
    s[t] = acc;
    __syncthreads();
    out[t] = s[t] + s[t ^ 1];
}

int main() {
    const int tiles = 3;
    float h[tiles * 64], r[64], acc[64];
    for (int i = 0; i < tiles * 64; i++) h[i] = (float)((i * 17) % 9) - 4.0f;
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    tiled_sum<<<1, 64>>>(in, out, tiles);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int t = 0; t < 64; t++) {
        acc[t] = 0.0f;
        for (int k = 0; k < (t < 16 ? tiles : tiles - 1); k++) acc[t] += h[k * 64 + 63 - t];
    }
    for (int t = 0; t < 64; t++)
        if (r[t] != acc[t] + acc[t ^ 1]) { fprintf(stderr, "out[%d] = %g, want %g\n", t, r[t], acc[t] + acc[t ^ 1]); return 1; }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
