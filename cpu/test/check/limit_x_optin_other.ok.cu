// limit_x_optin_other (ok): cudaFuncSetAttribute raises the dynamic shared limit of both kernels before
// each is launched with 96 KiB. Correct twin of limit_x_optin_other.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__device__ void stage_sum(const float* in, float* out, float* smem, int n) {
    int t = threadIdx.x;
    for (int i = t; i < n; i += blockDim.x) smem[i] = in[i];
    __syncthreads();
    if (t == 0) {
        float s = 0.0f;
        for (int i = 0; i < n; i++) s += smem[i];
        *out = s;
    }
}
__global__ void gemm_a(const float* in, float* out, int n) { extern __shared__ float smem[]; stage_sum(in, out, smem, n); }
__global__ void gemm_b(const float* in, float* out, int n) { extern __shared__ float smem[]; stage_sum(in, out, smem + n, n); }

int main() {
    const int n = 8192;
    const size_t bytes = 96 * 1024;
    static float h[n];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 4);
    float *in, *out, r[2];
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaFuncSetAttribute(gemm_a, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    CK(cudaFuncSetAttribute(gemm_b, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    gemm_a<<<1, 256, bytes>>>(in, out, n);
    CK(cudaGetLastError());
    gemm_b<<<1, 256, bytes>>>(in, out + 1, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    if (r[0] != 12288.0f || r[1] != 12288.0f) { fprintf(stderr, "sums %g %g\n", r[0], r[1]); return 1; }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
