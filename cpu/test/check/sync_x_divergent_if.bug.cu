// sync_x_divergent_if (bug): the first warp does extra work guarded by "if (threadIdx.x < 32)" and calls
// __syncthreads() inside the branch; the second warp skips it and waits at the barrier after the branch.
// A barrier in divergent code: expect synccheck.
// expect: synccheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void scale_rows(const float* in, float* out) {
    __shared__ float s[64];
    __shared__ float scale;
    int t = threadIdx.x;
    s[t] = in[blockIdx.x * 64 + t];
    if (t < 32) {
        if (t == 0) scale = 2.0f;
        __syncthreads();  // bug: only the first warp reaches this barrier
        s[t] *= scale;
    }
    __syncthreads();
    out[blockIdx.x * 64 + t] = s[63 - t];
}

int main() {
    const int n = 2 * 64;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 9);
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    scale_rows<<<2, 64>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        int b = i / 64, t = i % 64, src = 63 - t;
        float want = h[b * 64 + src] * (src < 32 ? 2.0f : 1.0f);
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
