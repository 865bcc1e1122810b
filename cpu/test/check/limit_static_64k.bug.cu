// limit_static_64k (bug): a kernel declares a 64 KiB static __shared__ array; static shared memory is limited
// to 48 KiB per block (nvcc refuses it; only dynamic shared memory can be raised). expect limitcheck.
// expect: limitcheck
// nvcc: refused (ptxas: too much shared data), so make check-cuda leaves it out
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

constexpr int TILE = 16384;  // bug: 64 KiB of floats; at most 12288 (48 KiB) fit

__global__ void reverse_tile(const float* in, float* out) {
    __shared__ float tile[TILE];
    for (int i = threadIdx.x; i < TILE; i += blockDim.x) tile[i] = in[i] * 0.5f;
    __syncthreads();
    for (int i = threadIdx.x; i < TILE; i += blockDim.x) out[i] = tile[TILE - 1 - i];
}

int main() {
    static float h[TILE], r[TILE];
    for (int i = 0; i < TILE; i++) h[i] = (float)((i * 13) % 101) - 50.0f;
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    reverse_tile<<<1, 256>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < TILE; i++)
        if (r[i] != 0.5f * h[TILE - 1 - i]) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], 0.5f * h[TILE - 1 - i]); return 1; }
    CK(cudaFree(in));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
