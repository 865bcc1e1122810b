// cublas_bias_type (bug): a GELU_BIAS epilogue with bf16 A/B/D and an fp32 bias (BIAS_DATA_TYPE
// CUDA_R_32F), a combination cuBLASLt does not document (bias type = D type for bf16). expect cublascheck.
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
    const int m = 64, n = 8, k = 16;
    static __nv_bfloat16 hA[m * k], hB[k * n], hD[m * n];
    static float hbias[m];
    for (int i = 0; i < m * k; i++) hA[i] = __float2bfloat16(val(i, 7));
    for (int i = 0; i < k * n; i++) hB[i] = __float2bfloat16(val(i, 5));
    for (int i = 0; i < m; i++) hbias[i] = val(i, 3);
    __nv_bfloat16 *A, *B, *D;
    void* bias;
    CK(cudaMalloc(&A, sizeof hA));
    CK(cudaMalloc(&B, sizeof hB));
    CK(cudaMalloc(&D, sizeof hD));
    CK(cudaMalloc(&bias, sizeof hbias));
    CK(cudaMemcpy(A, hA, sizeof hA, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(B, hB, sizeof hB, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(bias, hbias, sizeof hbias, cudaMemcpyHostToDevice));

    cublasLtHandle_t lt;
    CB(cublasLtCreate(&lt));
    cublasLtMatmulDesc_t desc;
    CB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_GELU_BIAS;
    cudaDataType_t bias_type = CUDA_R_32F;  // bug: for bf16 D cuBLASLt documents a bf16 bias
    CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    cublasLtMatrixLayout_t la, lb, ld;
    CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, m, k, m));
    CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, k));
    CB(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, m, n, m));
    cublasLtMatmulPreference_t pref;
    CB(cublasLtMatmulPreferenceCreate(&pref));
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    CB(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &heur, &found));
    if (found == 0) { fprintf(stderr, "no algorithm\n"); return 1; }
    const float alpha = 1.0f, beta = 0.0f;
    CB(cublasLtMatmul(lt, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &heur.algo, NULL, 0, 0));
    CK(cudaMemcpy(hD, D, sizeof hD, cudaMemcpyDeviceToHost));
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float x = hbias[i];
            for (int l = 0; l < k; l++) x += __bfloat162float(hA[i + l * m]) * __bfloat162float(hB[l + j * k]);
            float want = 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
            float got = __bfloat162float(hD[i + j * m]);
            if (fabsf(got - want) > 0.02f * fabsf(want) + 1e-2f) { fprintf(stderr, "D[%d,%d] = %g, want %g\n", i, j, got, want); return 1; }
        }
    CB(cublasLtMatmulPreferenceDestroy(pref));
    CB(cublasLtMatrixLayoutDestroy(la));
    CB(cublasLtMatrixLayoutDestroy(lb));
    CB(cublasLtMatrixLayoutDestroy(ld));
    CB(cublasLtMatmulDescDestroy(desc));
    CB(cublasLtDestroy(lt));
    CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(D)); CK(cudaFree(bias));
    printf("ok\n");
    return 0;
}
