// sync_x_syncwarp_mask (bug): a half-warp exchange whose __syncwarp names only the lower 16 lanes
// (0x0000ffff) but is executed by all 32 lanes: a lane outside the mask calls it. expect synccheck.
// expect: synccheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void halves(const int* in, int* out) {
    __shared__ int s[32];
    int lane = threadIdx.x;
    s[lane] = in[blockIdx.x * 32 + lane];
    __syncwarp(0x0000ffffu);  // bug: lanes 16-31 call it too, but are not in the mask
    out[blockIdx.x * 32 + lane] = s[lane ^ 8];
}

int main() {
    int h[64], r[64];
    for (int i = 0; i < 64; i++) h[i] = i * 3 + 1;
    int *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    halves<<<2, 32>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 64; i++)
        if (r[i] != h[i ^ 8]) { fprintf(stderr, "out[%d] = %d, want %d\n", i, r[i], h[i ^ 8]); return 1; }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
