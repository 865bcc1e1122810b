// race_x_warp_readers_other_warp (bug): the lanes of two warps read one shared word, then thread 0 overwrites it
// after a __syncwarp(), which orders its own warp's reads only: the write races with warp 1's. Twin of
// race_x_warp_readers_other_warp.ok.cu; it keeps the checking mode from taking a warp's sync for a block's.
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void scale_then_reset(const float* in, float* out) {
    __shared__ float word;
    if (threadIdx.x == 0) word = in[blockIdx.x];
    __syncthreads();
    const float mine = word * (float)(threadIdx.x + 1);
    __syncwarp();
    if (threadIdx.x == 0) word = -1.0f;
    __syncthreads();
    out[blockIdx.x * 64 + threadIdx.x] = mine + word;
}

int main() {
    float h[2] = {1.5f, -2.0f}, r[128];
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    scale_then_reset<<<2, 64>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 128; i++) {
        float want = h[i / 64] * (float)(i % 64 + 1) - 1.0f;
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
