// race_x_warp_readers (bug): every lane of a warp reads one shared word, then lane 0 overwrites it with no
// __syncwarp between: the write races with the other lanes' reads. Twin of race_x_warp_readers.ok.cu.
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void scale_then_count(const float* in, float* out) {
    __shared__ float word[2];  // one per warp
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) word[warp] = in[blockIdx.x * 2 + warp];
    __syncwarp();
    const float mine = word[warp] * (float)(lane + 1);
    if (lane == 0) word[warp] = -1.0f;
    __syncwarp();
    out[blockIdx.x * 64 + threadIdx.x] = mine + word[warp];
}

int main() {
    float h[4] = {1.5f, -2.0f, 3.25f, 0.5f}, r[128];
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    scale_then_count<<<2, 64>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 128; i++) {
        float want = h[i / 32] * (float)(i % 32 + 1) - 1.0f;
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
