// race_x_reduce_loop (ok): shared-memory tree reduction over 256 threads with __syncthreads inside the loop
// (after every level), the last 32 values reduced with __shfl_down_sync. Correct twin of race_x_reduce_loop.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void block_sum(const float* in, float* out, int n) {
    __shared__ float s[256];
    int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
    s[t] = i < n ? in[i] : 0.0f;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride >= 32; stride >>= 1) {
        if (t < stride) s[t] += s[t + stride];
        __syncthreads();
    }
    if (t < 32) {
        float v = s[t];
        for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
        if (t == 0) out[blockIdx.x] = v;
    }
}

int main() {
    const int blocks = 3, n = blocks * 256 - 17;
    static float h[blocks * 256];
    float r[blocks];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 13) % 7) - 3.0f;
    float *in, *out;
    CK(cudaMalloc(&in, n * sizeof(float)));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, n * sizeof(float), cudaMemcpyHostToDevice));
    block_sum<<<blocks, 256>>>(in, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int b = 0; b < blocks; b++) {
        float want = 0.0f;
        for (int t = 0; t < 256 && b * 256 + t < n; t++) want += h[b * 256 + t];
        if (r[b] != want) { fprintf(stderr, "sum[%d] = %g, want %g\n", b, r[b], want); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
