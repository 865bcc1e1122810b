// limit_x_static_48k_edge (ok): the tile is 12287 floats and the counter one int: exactly 48 KiB of static
// shared memory, the limit itself. Correct twin of limit_x_static_48k_edge.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

#define TILE_FLOATS 12287
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
