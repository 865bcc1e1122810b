// cublas_stream_order (bug): a GEMM on stream s2 reads C, which a GEMM on stream s1 writes, with
// nothing ordering s2 after s1. expect streamcheck.
// expect: streamcheck
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
    const int m = 16, n = 16, k = 16;
    static float hA[m * k], hB[k * n], hE[m * n];
    for (int i = 0; i < m * k; i++) hA[i] = val(i, 7);
    for (int i = 0; i < k * n; i++) hB[i] = val(i, 5);
    float *A, *B, *C, *E;
    CK(cudaMalloc(&A, sizeof hA));
    CK(cudaMalloc(&B, sizeof hB));
    CK(cudaMalloc(&C, sizeof hE));
    CK(cudaMalloc(&E, sizeof hE));
    CK(cudaMemcpy(A, hA, sizeof hA, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(B, hB, sizeof hB, cudaMemcpyHostToDevice));
    cudaStream_t s1, s2;
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t done;
    CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    cublasHandle_t h;
    CB(cublasCreate(&h));
    const float alpha = 1.0f, beta = 0.0f;
    CB(cublasSetStream(h, s1));
    CB(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, A, m, B, k, &beta, C, m));  // C = A B on s1
    // bug: s2 reads C without waiting for s1's GEMM (an event recorded on s1 and waited on by s2)
    CB(cublasSetStream(h, s2));
    CB(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, C, m, B, k, &beta, E, m));  // E = C B on s2
    CK(cudaStreamSynchronize(s2));
    CK(cudaMemcpy(hE, E, sizeof hE, cudaMemcpyDeviceToHost));
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float want = 0.0f;
            for (int l = 0; l < k; l++) {
                float c = 0.0f;
                for (int q = 0; q < k; q++) c += hA[i + q * m] * hB[q + l * k];
                want += c * hB[l + j * k];
            }
            if (hE[i + j * m] != want) { fprintf(stderr, "E[%d,%d] = %g, want %g\n", i, j, hE[i + j * m], want); return 1; }
        }
    CB(cublasDestroy(h));
    CK(cudaEventDestroy(done));
    CK(cudaStreamDestroy(s1)); CK(cudaStreamDestroy(s2));
    CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(C)); CK(cudaFree(E));
    printf("ok\n");
    return 0;
}
