// cublas_batched_host_array (ok): the correct twin of cublas_batched_host_array.bug.cu, the
// pointer arrays copied to device memory. No check may report it.
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
    const int m = 16, n = 8, k = 4, batch = 3;
    static float hA[batch][m * k], hB[batch][k * n], hC[batch][m * n];
    for (int b = 0; b < batch; b++) {
        for (int i = 0; i < m * k; i++) hA[b][i] = val(i + b, 7);
        for (int i = 0; i < k * n; i++) hB[b][i] = val(i + 2 * b, 5);
    }
    float *A, *B, *C;
    CK(cudaMalloc(&A, sizeof hA));
    CK(cudaMalloc(&B, sizeof hB));
    CK(cudaMalloc(&C, sizeof hC));
    CK(cudaMemcpy(A, hA, sizeof hA, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(B, hB, sizeof hB, cudaMemcpyHostToDevice));
    void* hp[3 * batch];  // the A, B and C pointers of every product
    for (int b = 0; b < batch; b++) {
        hp[b] = A + b * m * k;
        hp[batch + b] = B + b * k * n;
        hp[2 * batch + b] = C + b * m * n;
    }
    void** dp;
    CK(cudaMalloc(&dp, sizeof hp));
    CK(cudaMemcpy(dp, hp, sizeof hp, cudaMemcpyHostToDevice));
    void** ptrs = dp;  // the device copy of the pointer arrays
    cublasHandle_t h;
    CB(cublasCreate(&h));
    const float alpha = 1.0f, beta = 0.0f;
    CB(cublasGemmBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, (const void* const*)ptrs, CUDA_R_32F, m,
                           (const void* const*)(ptrs + batch), CUDA_R_32F, k, &beta, (void* const*)(ptrs + 2 * batch),
                           CUDA_R_32F, m, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CK(cudaMemcpy(hC, C, sizeof hC, cudaMemcpyDeviceToHost));
    for (int b = 0; b < batch; b++)
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                float want = 0.0f;
                for (int l = 0; l < k; l++) want += hA[b][i + l * m] * hB[b][l + j * k];
                if (hC[b][i + j * m] != want) { fprintf(stderr, "C%d[%d,%d] = %g, want %g\n", b, i, j, hC[b][i + j * m], want); return 1; }
            }
    CB(cublasDestroy(h));
    CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(C)); CK(cudaFree(dp));
    printf("ok\n");
    return 0;
}
