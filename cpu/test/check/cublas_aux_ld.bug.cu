// cublas_aux_ld (bug): a GELU_AUX epilogue whose aux leading dimension is the column count n = 8, less
// than D's 16 rows (cuBLASLt requires a multiple of 8 no less than the rows). expect cublascheck.
// expect: cublascheck
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
    const int m = 16, n = 8, k = 4;
    static float hA[m * k], hB[k * n], hD[m * n], hX[m * n];
    for (int i = 0; i < m * k; i++) hA[i] = val(i, 7);
    for (int i = 0; i < k * n; i++) hB[i] = val(i, 5);
    float *A, *B, *D, *aux;
    CK(cudaMalloc(&A, sizeof hA));
    CK(cudaMalloc(&B, sizeof hB));
    CK(cudaMalloc(&D, sizeof hD));
    CK(cudaMalloc(&aux, sizeof hX));  // the GELU input, m x n
    CK(cudaMemcpy(A, hA, sizeof hA, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(B, hB, sizeof hB, cudaMemcpyHostToDevice));

    cublasLtHandle_t lt;
    CB(cublasLtCreate(&lt));
    cublasLtMatmulDesc_t desc;
    CB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_GELU_AUX;
    int64_t aux_ld = n;  // bug: the aux leading dimension counts rows of D, m
    CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
    CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
    cublasLtMatrixLayout_t la, lb, ld;
    CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, m, k, m));
    CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, k, n, k));
    CB(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, m, n, m));
    const float alpha = 1.0f, beta = 0.0f;
    CB(cublasLtMatmul(lt, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, NULL, NULL, 0, 0));
    CK(cudaMemcpy(hD, D, sizeof hD, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hX, aux, sizeof hX, cudaMemcpyDeviceToHost));
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float x = 0.0f;
            for (int l = 0; l < k; l++) x += hA[i + l * m] * hB[l + j * k];
            float want = 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
            if (hX[i + j * m] != x || fabsf(hD[i + j * m] - want) > 1e-3f * (1.0f + fabsf(want))) {
                fprintf(stderr, "(%d,%d): aux %g D %g, want %g %g\n", i, j, hX[i + j * m], hD[i + j * m], x, want);
                return 1;
            }
        }
    CB(cublasLtMatrixLayoutDestroy(la));
    CB(cublasLtMatrixLayoutDestroy(lb));
    CB(cublasLtMatrixLayoutDestroy(ld));
    CB(cublasLtMatmulDescDestroy(desc));
    CB(cublasLtDestroy(lt));
    CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(D)); CK(cudaFree(aux));
    printf("ok\n");
    return 0;
}
