// cublas_host_b (ok): the correct twin of cublas_host_b.bug.cu, B's device copy. No check may report it.
#include <cstdio>
#include <math.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cublasLt.h>
#include <cuda_bf16.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d: cuBLAS status %d\n", __FILE__, __LINE__, (int)s_); return 1; } } while (0)

static float val(int i, int mod) { return (float)(i % mod - mod / 2); }

int main() {
    const int m = 32, n = 16, k = 8;
    static float hA[m * k], hB[k * n], hC[m * n];
    for (int i = 0; i < m * k; i++) hA[i] = val(i, 7);
    for (int i = 0; i < k * n; i++) hB[i] = val(i, 5);
    float *A, *B, *C;
    CK(cudaMalloc(&A, sizeof hA));
    CK(cudaMalloc(&B, sizeof hB));
    CK(cudaMalloc(&C, sizeof hC));
    CK(cudaMemcpy(A, hA, sizeof hA, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(B, hB, sizeof hB, cudaMemcpyHostToDevice));
    cublasHandle_t h;
    CB(cublasCreate(&h));
    const float alpha = 1.0f, beta = 0.0f;
    const float* b_arg = B;  // the device copy
    CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, A, CUDA_R_32F, m, b_arg, CUDA_R_32F, k, &beta, C,
                    CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CK(cudaMemcpy(hC, C, sizeof hC, cudaMemcpyDeviceToHost));
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float want = 0.0f;
            for (int l = 0; l < k; l++) want += hA[i + l * m] * hB[l + j * k];
            if (hC[i + j * m] != want) { fprintf(stderr, "C[%d,%d] = %g, want %g\n", i, j, hC[i + j * m], want); return 1; }
        }
    CB(cublasDestroy(h));
    CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(C));
    printf("ok\n");
    return 0;
}
