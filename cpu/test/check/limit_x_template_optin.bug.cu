// limit_x_template_optin (bug): a templated kernel instance tiled<64> is launched with 64 KiB of dynamic shared
// memory, but cudaFuncSetAttribute raised the limit of tiled<32> (another instance, another kernel).
// expect: limitcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

template <int ROWS>
__global__ void tiled(const float* in, float* out, int cols) {
    extern __shared__ float tile[];
    int t = threadIdx.x;
    for (int i = t; i < ROWS * cols; i += blockDim.x) tile[i] = in[i];
    __syncthreads();
    for (int c = t; c < cols; c += blockDim.x) {
        float s = 0.0f;
        for (int r = 0; r < ROWS; r++) s += tile[r * cols + c];
        out[c] = s;
    }
}

int main() {
    const int rows = 64, cols = 256;
    const size_t bytes = rows * cols * sizeof(float);  // 64 KiB
    static float h[rows * cols];
    float r[cols];
    for (int i = 0; i < rows * cols; i++) h[i] = (float)(i % 3);
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaFuncSetAttribute(tiled<32>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    tiled<64><<<1, 256, bytes>>>(in, out, cols);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int c = 0; c < cols; c++) {
        float want = 0.0f;
        for (int k = 0; k < rows; k++) want += h[k * cols + c];
        if (r[c] != want) { fprintf(stderr, "out[%d] = %g\n", c, r[c]); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
