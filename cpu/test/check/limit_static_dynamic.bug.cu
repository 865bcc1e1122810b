// limit_static_dynamic (bug): 40 KiB of static plus 40 KiB of dynamic shared memory in one block, over the
// 48 KiB a launch gets without cudaFuncSetAttribute. expect limitcheck.
// expect: limitcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

constexpr int S = 10240;  // 40 KiB of static shared floats
constexpr int D = 10240;  // bug: 40 KiB of dynamic shared floats; static + dynamic must stay within 48 KiB

__global__ void two_stage(const float* in, float* out, int d) {
    __shared__ float a[S];
    extern __shared__ float b[];
    for (int i = threadIdx.x; i < S; i += blockDim.x) a[i] = in[i];
    __syncthreads();
    for (int i = threadIdx.x; i < d; i += blockDim.x) b[i] = a[i] + a[S - 1 - i];
    __syncthreads();
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = b[d - 1 - i];
}

int main() {
    static float h[S], r[D];
    for (int i = 0; i < S; i++) h[i] = (float)((i * 7) % 31) - 15.0f;
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    two_stage<<<1, 256, D * sizeof(float)>>>(in, out, D);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < D; i++) {
        int j = D - 1 - i;
        if (r[i] != h[j] + h[S - 1 - j]) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], h[j] + h[S - 1 - j]); return 1; }
    }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
