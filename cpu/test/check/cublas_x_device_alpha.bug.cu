// cublas_x_device_alpha (bug): alpha and beta live in device memory (cudaMalloc) but the handle is left in
// the default CUBLAS_POINTER_MODE_HOST, so cuBLAS dereferences device pointers on the host.
// expect: cublascheck
#include <cublas_v2.h>
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d: cuBLAS status %d\n", __FILE__, __LINE__, (int)s_); return 1; } } while (0)

int main() {
    const int m = 8;
    float hA[m * m], hB[m * m], hC[m * m], hs[2] = {2.0f, 0.0f};
    for (int i = 0; i < m * m; i++) { hA[i] = (float)(i % 4); hB[i] = (float)(i % 5 - 2); }
    float *A, *B, *C, *scal;
    CK(cudaMalloc(&A, sizeof hA));
    CK(cudaMalloc(&B, sizeof hB));
    CK(cudaMalloc(&C, sizeof hC));
    CK(cudaMalloc(&scal, sizeof hs));
    CK(cudaMemcpy(A, hA, sizeof hA, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(B, hB, sizeof hB, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(scal, hs, sizeof hs, cudaMemcpyHostToDevice));
    cublasHandle_t h;
    CB(cublasCreate(&h));
    // bug: cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE) is missing
    CB(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, m, m, scal, A, m, B, m, scal + 1, C, m));
    CK(cudaMemcpy(hC, C, sizeof hC, cudaMemcpyDeviceToHost));
    for (int j = 0; j < m; j++)
        for (int i = 0; i < m; i++) {
            float want = 0.0f;
            for (int l = 0; l < m; l++) want += hA[i + l * m] * hB[l + j * m];
            if (hC[i + j * m] != 2.0f * want) { fprintf(stderr, "C[%d,%d] wrong\n", i, j); return 1; }
        }
    CB(cublasDestroy(h));
    CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(C)); CK(cudaFree(scal));
    printf("ok\n");
    return 0;
}
