// mem_bf162_odd (ok): the pair starting at an odd bf16 index is read as two scalar bf16 loads. Correct twin of
// mem_bf162_odd.bug.cu; no check may report it.
#include <cstdio>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

// out[i] = x[2i + 1] + x[2i + 2]: pairs that straddle the natural bf16x2 boundaries
__global__ void odd_pair_sums(const __nv_bfloat16* x, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = __bfloat162float(x[2 * i + 1]) + __bfloat162float(x[2 * i + 2]);  // the fix: scalar loads
}

int main() {
    const int n = 24, len = 2 * n + 2;
    __nv_bfloat16 h[len];
    float hf[len], r[n];
    for (int i = 0; i < len; i++) { hf[i] = (float)((i * 7) % 11) - 5.0f; h[i] = __float2bfloat16(hf[i]); }
    __nv_bfloat16* x;
    float* out;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    odd_pair_sums<<<1, 32>>>(x, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != hf[2 * i + 1] + hf[2 * i + 2]) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], hf[2 * i + 1] + hf[2 * i + 2]); return 1; }
    CK(cudaFree(x));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
