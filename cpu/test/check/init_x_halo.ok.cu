// init_x_halo (ok): the 1D stencil's shared tile gets its two halo cells from threads 0 and 127 (zero at the
// array's ends) before the barrier. Correct twin of init_x_halo.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void stencil(const float* in, float* out, int n) {
    __shared__ float tile[130];
    int t = threadIdx.x, i = blockIdx.x * 128 + t;
    tile[t + 1] = in[i];
    if (t == 0) tile[0] = i > 0 ? in[i - 1] : 0.0f;
    if (t == 127) tile[129] = i + 1 < n ? in[i + 1] : 0.0f;
    __syncthreads();
    out[i] = 0.25f * tile[t] + 0.5f * tile[t + 1] + 0.25f * tile[t + 2];
}

int main() {
    const int n = 384;
    static float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 8);
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    stencil<<<n / 128, 128>>>(in, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        float want = 0.25f * (i > 0 ? h[i - 1] : 0.0f) + 0.5f * h[i] + 0.25f * (i + 1 < n ? h[i + 1] : 0.0f);
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
