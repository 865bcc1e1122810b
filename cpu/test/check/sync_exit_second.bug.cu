// sync_exit_second (bug): all threads pass the first barrier, then the upper half exits while the lower half
// waits at a second barrier (a barrier in code that is not reached by the whole block). expect synccheck.
// expect: synccheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void pair_products(const float* in, float* out) {
    __shared__ float s[64];
    __shared__ float r[32];
    int t = threadIdx.x, o = blockIdx.x * 64 + t;
    s[t] = in[o];
    __syncthreads();
    float v = s[t] + s[(t + 1) % 64];
    if (t >= 32) { out[o] = v; return; }  // bug: the upper half leaves between the two barriers
    r[t] = v;
    __syncthreads();
    out[o] = r[t] * r[31 - t];
}

int main() {
    const int blocks = 2, n = blocks * 64;
    float h[n], r[n], v[64];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 5) % 7) - 1.0f;
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    pair_products<<<blocks, 64>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int b = 0; b < blocks; b++) {
        for (int t = 0; t < 64; t++) v[t] = h[b * 64 + t] + h[b * 64 + (t + 1) % 64];
        for (int t = 0; t < 64; t++) {
            float want = t >= 32 ? v[t] : v[t] * v[31 - t];
            if (r[b * 64 + t] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", b * 64 + t, r[b * 64 + t], want); return 1; }
        }
    }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
