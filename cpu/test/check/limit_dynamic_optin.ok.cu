// limit_dynamic_optin (ok): 100 KiB of dynamic shared memory after raising the kernel's
// cudaFuncAttributeMaxDynamicSharedMemorySize. Correct twin of limit_dynamic_optin.bug.cu; nothing may report it.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void big_rotate(const float* in, float* out, int n) {
    __shared__ float scale;  // a little static shared memory besides the dynamic buffer
    extern __shared__ float buf[];
    if (threadIdx.x == 0) scale = 2.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = in[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = scale * buf[(i + 1) % n];
}

int main() {
    const int n = 25600;  // 100 KiB of floats
    const int bytes = n * sizeof(float);
    static float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 11) % 29) - 14.0f;
    float *in, *out;
    CK(cudaMalloc(&in, bytes));
    CK(cudaMalloc(&out, bytes));
    CK(cudaMemcpy(in, h, bytes, cudaMemcpyHostToDevice));
    CK(cudaFuncSetAttribute(big_rotate, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));  // the fix
    big_rotate<<<1, 256, bytes>>>(in, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, bytes, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != 2.0f * h[(i + 1) % n]) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], 2.0f * h[(i + 1) % n]); return 1; }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
