// limit_x_static_48k_edge (bug): two static __shared__ arrays, a 12288-float tile (exactly 48 KiB) and a
// one-int counter, 48 KiB + 4 bytes of static shared memory: over the 48 KiB static limit (ptxas refuses).
// expect: limitcheck
// nvcc: refused (ptxas: too much shared data), so make check-cuda leaves it out
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

#define TILE_FLOATS 12288
__global__ void stage(const float* in, float* out, int n) {
    __shared__ float tile[TILE_FLOATS];
    __shared__ int count;
    int t = threadIdx.x;
    if (t == 0) count = 0;
    for (int i = t; i < n && i < TILE_FLOATS; i += blockDim.x) tile[i] = in[i];
    __syncthreads();
    for (int i = t; i < n && i < TILE_FLOATS; i += blockDim.x) {
        out[i] = tile[n - 1 - i];
        atomicAdd(&count, 1);
    }
    __syncthreads();
    if (t == 0) out[n] = (float)count;
}

int main() {
    const int n = 4096;
    static float h[n], r[n + 1];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 100);
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    stage<<<1, 256>>>(in, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != h[n - 1 - i]) { fprintf(stderr, "out[%d] = %g\n", i, r[i]); return 1; }
    if (r[n] != (float)n) { fprintf(stderr, "count = %g\n", r[n]); return 1; }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
