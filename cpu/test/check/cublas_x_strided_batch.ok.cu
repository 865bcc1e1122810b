// cublas_x_strided_batch (ok): the C buffer holds all 4 batches of the strided-batched GEMM. Correct twin of
// cublas_x_strided_batch.bug.cu.
#include <cublas_v2.h>
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d: cuBLAS status %d\n", __FILE__, __LINE__, (int)s_); return 1; } } while (0)

int main() {
    const int m = 16, batches = 4, c_batches = 4;
    const long long stride = m * m;
    static float hA[batches * m * m], hB[batches * m * m], hC[batches * m * m];
    for (int i = 0; i < batches * m * m; i++) { hA[i] = (float)(i % 5 - 2); hB[i] = (float)(i % 3 - 1); }
    float *A, *B, *C;
    CK(cudaMalloc(&A, sizeof hA));
    CK(cudaMalloc(&B, sizeof hB));
    CK(cudaMalloc(&C, c_batches * stride * sizeof(float)));
    CK(cudaMemcpy(A, hA, sizeof hA, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(B, hB, sizeof hB, cudaMemcpyHostToDevice));
    cublasHandle_t h;
    CB(cublasCreate(&h));
    const float alpha = 1.0f, beta = 0.0f;
    CB(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, m, m, m, &alpha, A, m, stride, B, m, stride, &beta, C, m,
                                 stride, batches));
    CK(cudaMemcpy(hC, C, c_batches * stride * sizeof(float), cudaMemcpyDeviceToHost));
    for (int b = 0; b < c_batches; b++)
        for (int j = 0; j < m; j++)
            for (int i = 0; i < m; i++) {
                float want = 0.0f;
                for (int l = 0; l < m; l++) want += hA[b * stride + i + l * m] * hB[b * stride + l + j * m];
                if (hC[b * stride + i + j * m] != want) { fprintf(stderr, "C[%d][%d,%d] wrong\n", b, i, j); return 1; }
            }
    CB(cublasDestroy(h));
    CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(C));
    printf("ok\n");
    return 0;
}
