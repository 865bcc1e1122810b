// cublas_bias_wide (ok): the correct twin of cublas_bias_wide.bug.cu, a bias buffer of one value per
// row of D. No check may report it.
#include <cstdio>
#include <math.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cublasLt.h>
#include <cuda_bf16.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d: cuBLAS status %d\n", __FILE__, __LINE__, (int)s_); return 1; } } while (0)

// small integers, so every sum below is exact in fp32
static float val(int i, int mod) { return (float)(i % mod - mod / 2); }

int main() {
    const int m = 768, n = 2, k = 4;
    const int nbias = m;  // one bias value per row of D
    static float hA[m * k], hB[k * n], hbias[m], hD[m * n];
    for (int i = 0; i < m * k; i++) hA[i] = val(i, 7);
    for (int i = 0; i < k * n; i++) hB[i] = val(i, 5);
    for (int i = 0; i < m; i++) hbias[i] = val(i, 3);
    float *A, *B, *D, *bias;
    CK(cudaMalloc(&A, sizeof hA));
    CK(cudaMalloc(&B, sizeof hB));
    CK(cudaMalloc(&D, sizeof hD));
    CK(cudaMalloc(&bias, nbias * sizeof(float)));
    CK(cudaMemcpy(A, hA, sizeof hA, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(B, hB, sizeof hB, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(bias, hbias, nbias * sizeof(float), cudaMemcpyHostToDevice));

    cublasLtHandle_t lt;
    CB(cublasLtCreate(&lt));
    cublasLtMatmulDesc_t desc;
    CB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;  // D = A B + bias, the bias one value per row of D
    CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    cublasLtMatrixLayout_t la, lb, ld;
    CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, m, k, m));
    CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, k, n, k));
    CB(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, m, n, m));
    const float alpha = 1.0f, beta = 0.0f;
    CB(cublasLtMatmul(lt, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, NULL, NULL, 0, 0));
    CK(cudaMemcpy(hD, D, sizeof hD, cudaMemcpyDeviceToHost));
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float want = hbias[i];
            for (int l = 0; l < k; l++) want += hA[i + l * m] * hB[l + j * k];
            if (hD[i + j * m] != want) { fprintf(stderr, "D[%d,%d] = %g, want %g\n", i, j, hD[i + j * m], want); return 1; }
        }
    CB(cublasLtMatrixLayoutDestroy(la));
    CB(cublasLtMatrixLayoutDestroy(lb));
    CB(cublasLtMatrixLayoutDestroy(ld));
    CB(cublasLtMatmulDescDestroy(desc));
    CB(cublasLtDestroy(lt));
    CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(D)); CK(cudaFree(bias));
    printf("ok\n");
    return 0;
}
