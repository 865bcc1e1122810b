// mem_x_cstyle_float4 (bug): rows of 6 floats are read as float4 + float2 through C-style casts; row r starts
// at p + 6 * r, which is only 8-byte aligned for odd r, so the float4 load faults. expect memcheck.
// expect: memcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

#define STRIDE 6
__global__ void row_sums(const float* p, float* out, int rows) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float4 a = *(const float4*)(p + STRIDE * r);  // bug: misaligned for odd rows
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
