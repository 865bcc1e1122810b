// race_warp_volatile (ok): the block reduction's last warp uses __shfl_down_sync instead of volatile
// shared memory. Correct twin of race_warp_volatile.bug.cu; no check may report it.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void block_sum(const float* in, float* out) {
    __shared__ float s[64];
    int t = threadIdx.x;
    s[t] = in[blockIdx.x * 64 + t];
    __syncthreads();
    if (t < 32) {  // the fix: the warp reduces in registers with shuffles
        float v = s[t] + s[t + 32];
        for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
        if (t == 0) out[blockIdx.x] = v;
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
