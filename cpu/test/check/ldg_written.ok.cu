// ldg_written (ok): __ldg only reads the read-only input; the buffer this kernel writes is read back with a
// plain load after the barrier. Correct twin of ldg_written.bug.cu; no check may report it.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void stage_and_rotate(const float* __restrict__ in, float* tmp, float* out) {
    int t = threadIdx.x, base = blockIdx.x * 64;
    tmp[base + t] = __ldg(&in[base + t]) * 2.0f;  // __ldg of read-only input: fine
    __syncthreads();
    out[base + t] = tmp[base + (t + 1) % 64];  // the fix: a coherent plain load
}

int main() {
    const int blocks = 3, n = blocks * 64;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 23) % 41) - 20.0f;
    float *in, *tmp, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&tmp, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    stage_and_rotate<<<blocks, 64>>>(in, tmp, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        float want = 2.0f * h[(i / 64) * 64 + (i % 64 + 1) % 64];
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in));
    CK(cudaFree(tmp));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
