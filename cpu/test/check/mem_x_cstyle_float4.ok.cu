// mem_x_cstyle_float4 (ok): rows padded to 8 floats, so (float4*)(p + 8 * r) is 16-byte aligned; the C-style
// casts stay. Correct twin of mem_x_cstyle_float4.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

#define STRIDE 8
__global__ void row_sums(const float* p, float* out, int rows) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float4 a = *(const float4*)(p + STRIDE * r);
    float2 b = *(const float2*)(p + STRIDE * r + 4);
    out[r] = a.x + a.y + a.z + a.w + b.x + b.y;
}

int main() {
    const int rows = 8, n = rows * STRIDE;
    float h[n], r[rows];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 9);
    float *p, *out;
    CK(cudaMalloc(&p, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(p, h, sizeof h, cudaMemcpyHostToDevice));
    row_sums<<<1, 32>>>(p, out, rows);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < rows; i++) {
        float want = 0.0f;
        for (int j = 0; j < 6; j++) want += h[i * STRIDE + j];
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(p)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
