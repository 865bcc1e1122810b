// cpu/test/test_cublas.cu: checks cuBLAS and cuBLASLt (cpu/cublas.cpp on the CPU backend, NVIDIA's libraries on
// a GPU) against a naive double-precision column-major GEMM on the host.
//
//   CPU backend: cpu/cucc -O2 -lcublas -lcublasLt -I dev/test cpu/test/test_cublas.cu -o build/test_cublas
//   GPU:         nvcc -arch=sm_80 -O2 -I dev/test cpu/test/test_cublas.cu -lcublas -lcublasLt -o test_cublas
//
// Shapes are not multiples of anything (m=37, n=23, k=61) and every leading dimension is larger than its matrix,
// so a routine that confuses rows with leading dimensions, or m with n, fails. Batches have gaps between matrices.
// Inputs are random and rounded to their storage type on the host first, so the reference multiplies exactly the
// stored values. Outputs are poisoned before each call: NaN where the routine must write (with beta == 0, C is NaN
// too: it must not be read), and a sentinel in the padding rows and batch gaps, which must come back untouched.
//
// Tolerances (|got - want| <= atol + rtol*|want|):
//   atol = 1e-5 * S, S = max over elements of |alpha| sum_l |a_il b_lj| + |beta c_ij| + |bias_i|: fp32 accumulation
//          of k=61 terms errs by at most ~k*2^-24*S = 4e-6 S. The FAST compute types may round inputs first on a
//          GPU: TF32 and FP16 (11-bit significands, 2 roundings per product) 2e-3 S, BF16 (8 bits) 1e-2 S.
//          GELU and its gradient have slopes below 1.2, so epilogues scale atol by 1.2.
//   rtol = one rounding to the output type: fp32 0, bf16 2^-8 (8-bit significand, round to nearest), fp16 2^-11.
// On a GPU the GELU epilogues may use a fast tanh (about 2^-11 relative), so there they get 2e-3 of the input
// magnitude more; on the CPU backend, whose tanh is good to ~1e-7, they do not, so an erf GELU would fail there.
//
// On a GPU, a configuration the CPU backend supports but cuBLASLt answers NOT_SUPPORTED is reported and skipped, and
// an expected error status is satisfied by any error: the CPU backend is held to the exact status.
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdlib.h>
#include "test_common.h"

#ifdef __NVCC__
#define ON_GPU 1
#else
#define ON_GPU 0
#endif

#define SENTINEL 7.0f  // exact in fp32, bf16 and fp16
#define GELU_SCALE 0.7978845608028654

static int skipped = 0;

static void cuda_check(cudaError_t err, const char* what) {
    if (err != cudaSuccess) {
        printf("CUDA error in %s: %s\n", what, cudaGetErrorString(err));
        exit(1);
    }
}

// ----------------------------------------------------------------------------------------------------------
// Matrices: host values (already rounded to the storage type) and the device copy

static float round_to(float x, cudaDataType_t t) {
    if (t == CUDA_R_16BF) return __bfloat162float(__float2bfloat16(x));
    if (t == CUDA_R_16F) return __half2float(__float2half(x));
    return x;
}

static size_t tsize(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

typedef struct {
    cudaDataType_t type;
    int rows, cols, ld, batch;
    long long stride;  // elements between batch matrices: a gap, rounded to a multiple of 8 (cuBLASLt's aux rule)
    size_t count;
    float* host;
    void* dev;
} Mat;

// A rows x cols matrix (batch of them), leading dimension ld; the whole buffer starts at `pad` and the valid
// region gets uniform [lo, hi) values, or NaN when lo and hi are both NaN.
static Mat mat_new(cudaDataType_t t, int rows, int cols, int ld, int batch, float lo, float hi, float pad) {
    Mat x;
    x.type = t; x.rows = rows; x.cols = cols; x.ld = ld; x.batch = batch;
    x.stride = ((long long)ld * cols + 5 + 7) / 8 * 8;
    x.count = (size_t)x.stride * batch;
    x.host = (float*)malloc(x.count * sizeof(float));
    for (size_t i = 0; i < x.count; i++) x.host[i] = pad;
    for (int b = 0; b < batch; b++)
        for (int j = 0; j < cols; j++)
            for (int i = 0; i < rows; i++)
                x.host[b * x.stride + i + (size_t)j * ld] = isnan(lo) ? NAN : round_to(test_rand_uniform(lo, hi), t);
    cuda_check(cudaMalloc(&x.dev, x.count * tsize(t)), "cudaMalloc");
    void* staging = malloc(x.count * tsize(t));
    for (size_t i = 0; i < x.count; i++) {
        if (t == CUDA_R_16BF) ((__nv_bfloat16*)staging)[i] = __float2bfloat16(x.host[i]);
        else if (t == CUDA_R_16F) ((__half*)staging)[i] = __float2half(x.host[i]);
        else ((float*)staging)[i] = x.host[i];
    }
    cuda_check(cudaMemcpy(x.dev, staging, x.count * tsize(t), cudaMemcpyHostToDevice), "upload");
    free(staging);
    return x;
}

static void mat_free(Mat* x) {
    free(x->host);
    cuda_check(cudaFree(x->dev), "cudaFree");
}

static float* download(const void* dev, size_t count, cudaDataType_t t) {
    void* staging = malloc(count * tsize(t));
    cuda_check(cudaMemcpy(staging, dev, count * tsize(t), cudaMemcpyDeviceToHost), "download");
    float* out = (float*)malloc(count * sizeof(float));
    for (size_t i = 0; i < count; i++) {
        if (t == CUDA_R_16BF) out[i] = __bfloat162float(((__nv_bfloat16*)staging)[i]);
        else if (t == CUDA_R_16F) out[i] = __half2float(((__half*)staging)[i]);
        else out[i] = ((float*)staging)[i];
    }
    free(staging);
    return out;
}

// want[] starts as the buffer's initial contents (sentinels in padding and gaps), expected values go on top
static double* want_from(const Mat* x) {
    double* w = (double*)malloc(x->count * sizeof(double));
    for (size_t i = 0; i < x->count; i++) w[i] = x->host[i];
    return w;
}

static void check_mat(const char* what, const Mat* x, const double* want, double atol, double rtol) {
    float* got = download(x->dev, x->count, x->type);
    check_close(what, got, want, x->count, atol, rtol);
    free(got);
}

static double out_rtol(cudaDataType_t t) {
    return t == CUDA_R_16BF ? 1.0 / 256 : t == CUDA_R_16F ? 1.0 / 2048 : 0.0;
}

static double acc_tol(cublasComputeType_t c) {
    if (c == CUBLAS_COMPUTE_32F_FAST_16BF) return 1e-2;
    if (c == CUBLAS_COMPUTE_32F_FAST_TF32 || c == CUBLAS_COMPUTE_32F_FAST_16F) return 2e-3;
    return 1e-5;
}

static const char* tname(cudaDataType_t t) {
    return t == CUDA_R_16BF ? "bf16" : t == CUDA_R_16F ? "fp16" : "fp32";
}
static char opname(cublasOperation_t op) { return op == CUBLAS_OP_N ? 'N' : 'T'; }

static double gelu_ref(double x) { return 0.5 * x * (1.0 + tanh(GELU_SCALE * (x + 0.044715 * x * x * x))); }
static double gelu_grad_ref(double x) {
    double t = tanh(GELU_SCALE * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x);
}

// ----------------------------------------------------------------------------------------------------------
// The reference. op(A)(i,l) and op(B)(l,j) of batch b, column-major.

static double opA(const Mat* A, cublasOperation_t t, int b, int i, int l) {
    return t == CUBLAS_OP_N ? A->host[b * A->stride + i + (size_t)l * A->ld] : A->host[b * A->stride + l + (size_t)i * A->ld];
}
static double opB(const Mat* B, cublasOperation_t t, int b, int l, int j) {
    return t == CUBLAS_OP_N ? B->host[b * B->stride + l + (size_t)j * B->ld] : B->host[b * B->stride + j + (size_t)l * B->ld];
}

// alpha * op(A) op(B) + beta * C for element (i,j) of batch b; *scale gets the magnitude bound S of its terms
static double ref_elem(const Mat* A, cublasOperation_t ta, const Mat* B, cublasOperation_t tb, int k, double alpha,
                       const Mat* C, double beta, int b, int i, int j, double* scale) {
    double s = 0.0, mag = 0.0;
    for (int l = 0; l < k; l++) {
        double p = opA(A, ta, b, i, l) * opB(B, tb, b, l, j);
        s += p;
        mag += fabs(p);
    }
    double x = alpha * s;
    *scale = fabs(alpha) * mag;
    if (beta != 0.0) {
        double c = C->host[b * C->stride + i + (size_t)j * C->ld];
        x += beta * c;
        *scale += fabs(beta * c);
    }
    return x;
}

// ----------------------------------------------------------------------------------------------------------
// cuBLAS GEMMs: GemmEx, Sgemm, the strided and pointer-array batched forms, all on the same case description

enum { API_GEMMEX, API_SGEMM, API_STRIDED_EX, API_SGEMM_STRIDED, API_BATCHED_EX };
static const char* api_name[] = {"GemmEx", "Sgemm", "GemmStridedBatchedEx", "SgemmStridedBatched", "GemmBatchedEx"};

typedef struct {
    int api;
    cublasOperation_t ta, tb;
    cudaDataType_t ab, ct;  // A/B type, C type
    cublasComputeType_t compute;
    int m, n, k, batch;
    float alpha, beta;
    int device_scalars;  // alpha/beta in device memory with CUBLAS_POINTER_MODE_DEVICE
} GemmCase;

static void gemm_case(cublasHandle_t h, const GemmCase* c) {
    char name[160];
    snprintf(name, sizeof(name), "%s %c%c A/B %s C %s compute %d batch %d m %d n %d k %d alpha %g beta %g%s",
             api_name[c->api], opname(c->ta), opname(c->tb), tname(c->ab), tname(c->ct), (int)c->compute, c->batch,
             c->m, c->n, c->k, c->alpha, c->beta, c->device_scalars ? " (device scalars)" : "");
    int ar = c->ta == CUBLAS_OP_N ? c->m : c->k, ac = c->ta == CUBLAS_OP_N ? c->k : c->m;
    int br = c->tb == CUBLAS_OP_N ? c->k : c->n, bc = c->tb == CUBLAS_OP_N ? c->n : c->k;
    Mat A = mat_new(c->ab, ar, ac, ar + 3, c->batch, -1.0f, 1.0f, 0.5f);
    Mat B = mat_new(c->ab, br, bc, br + 5, c->batch, -1.0f, 1.0f, 0.5f);
    float lo = c->beta == 0.0f ? NAN : -1.0f, hi = c->beta == 0.0f ? NAN : 1.0f;
    Mat C = mat_new(c->ct, c->m, c->n, c->m + 2, c->batch, lo, hi, SENTINEL);

    double* want = want_from(&C);
    double S = 0.0;
    for (int b = 0; b < c->batch; b++)
        for (int j = 0; j < c->n; j++)
            for (int i = 0; i < c->m; i++) {
                double s;
                want[b * C.stride + i + (size_t)j * C.ld] =
                    ref_elem(&A, c->ta, &B, c->tb, c->k, c->alpha, &C, c->beta, b, i, j, &s);
                if (s > S) S = s;
            }

    cublasStatus_t st;
    const float *alpha = &c->alpha, *beta = &c->beta;
    float* dev_scalars = NULL;
    if (c->device_scalars) {
        float hs[2] = {c->alpha, c->beta};
        cuda_check(cudaMalloc(&dev_scalars, sizeof(hs)), "cudaMalloc");
        cuda_check(cudaMemcpy(dev_scalars, hs, sizeof(hs), cudaMemcpyHostToDevice), "upload");
        alpha = dev_scalars;
        beta = dev_scalars + 1;
        cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE);
    }
    void** ptrs = NULL;  // device arrays of A, B, C pointers for GemmBatchedEx
    switch (c->api) {
    case API_GEMMEX:
        st = cublasGemmEx(h, c->ta, c->tb, c->m, c->n, c->k, alpha, A.dev, c->ab, A.ld, B.dev, c->ab, B.ld, beta, C.dev,
                          c->ct, C.ld, c->compute, CUBLAS_GEMM_DEFAULT);
        break;
    case API_SGEMM:
        st = cublasSgemm(h, c->ta, c->tb, c->m, c->n, c->k, alpha, (const float*)A.dev, A.ld, (const float*)B.dev,
                         B.ld, beta, (float*)C.dev, C.ld);
        break;
    case API_STRIDED_EX:
        st = cublasGemmStridedBatchedEx(h, c->ta, c->tb, c->m, c->n, c->k, alpha, A.dev, c->ab, A.ld, A.stride, B.dev,
                                        c->ab, B.ld, B.stride, beta, C.dev, c->ct, C.ld, C.stride, c->batch,
                                        c->compute, CUBLAS_GEMM_DEFAULT);
        break;
    case API_SGEMM_STRIDED:
        st = cublasSgemmStridedBatched(h, c->ta, c->tb, c->m, c->n, c->k, alpha, (const float*)A.dev, A.ld, A.stride,
                                       (const float*)B.dev, B.ld, B.stride, beta, (float*)C.dev, C.ld, C.stride,
                                       c->batch);
        break;
    default: {
        void* hp[3 * 64];
        for (int b = 0; b < c->batch; b++) {
            hp[b] = (char*)A.dev + b * A.stride * tsize(c->ab);
            hp[c->batch + b] = (char*)B.dev + b * B.stride * tsize(c->ab);
            hp[2 * c->batch + b] = (char*)C.dev + b * C.stride * tsize(c->ct);
        }
        cuda_check(cudaMalloc(&ptrs, 3 * c->batch * sizeof(void*)), "cudaMalloc");
        cuda_check(cudaMemcpy(ptrs, hp, 3 * c->batch * sizeof(void*), cudaMemcpyHostToDevice), "upload");
        st = cublasGemmBatchedEx(h, c->ta, c->tb, c->m, c->n, c->k, alpha, (const void* const*)ptrs, c->ab, A.ld,
                                 (const void* const*)(ptrs + c->batch), c->ab, B.ld, beta,
                                 (void* const*)(ptrs + 2 * c->batch), c->ct, C.ld, c->batch, c->compute,
                                 CUBLAS_GEMM_DEFAULT);
    }
    }
    cuda_check(cudaDeviceSynchronize(), "sync");
    check(st == CUBLAS_STATUS_SUCCESS, "%s: status %d", name, (int)st);
    if (st == CUBLAS_STATUS_SUCCESS) check_mat(name, &C, want, acc_tol(c->compute) * S, out_rtol(c->ct));
    if (c->device_scalars) {
        cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST);
        cuda_check(cudaFree(dev_scalars), "cudaFree");
    }
    if (ptrs) cuda_check(cudaFree(ptrs), "cudaFree");
    free(want);
    mat_free(&A);
    mat_free(&B);
    mat_free(&C);
}

// Two groups with different shapes, transposes, alpha and beta: 2 problems in the first, 1 in the second.
static void grouped_case(cublasHandle_t h, cudaDataType_t t) {
    cublasOperation_t ta[2] = {CUBLAS_OP_N, CUBLAS_OP_T}, tb[2] = {CUBLAS_OP_T, CUBLAS_OP_N};
    int m[2] = {37, 19}, n[2] = {23, 29}, k[2] = {61, 13}, size[2] = {2, 1};
    float alpha[2] = {1.25f, -0.5f}, beta[2] = {0.0f, 0.75f};
    int lda[2], ldb[2], ldc[2];
    Mat A[3], B[3], C[3];
    void* hp[9];
    for (int p = 0, g = 0; p < 3; p++) {
        g = p < 2 ? 0 : 1;
        int ar = ta[g] == CUBLAS_OP_N ? m[g] : k[g], ac = ta[g] == CUBLAS_OP_N ? k[g] : m[g];
        int br = tb[g] == CUBLAS_OP_N ? k[g] : n[g], bc = tb[g] == CUBLAS_OP_N ? n[g] : k[g];
        lda[g] = ar + 3; ldb[g] = br + 1; ldc[g] = m[g] + 4;
        A[p] = mat_new(t, ar, ac, lda[g], 1, -1.0f, 1.0f, 0.5f);
        B[p] = mat_new(t, br, bc, ldb[g], 1, -1.0f, 1.0f, 0.5f);
        C[p] = mat_new(t, m[g], n[g], ldc[g], 1, beta[g] == 0.0f ? NAN : -1.0f, beta[g] == 0.0f ? NAN : 1.0f, SENTINEL);
        hp[p] = A[p].dev; hp[3 + p] = B[p].dev; hp[6 + p] = C[p].dev;
    }
    void** ptrs;
    cuda_check(cudaMalloc(&ptrs, sizeof(hp)), "cudaMalloc");
    cuda_check(cudaMemcpy(ptrs, hp, sizeof(hp), cudaMemcpyHostToDevice), "upload");
    cublasStatus_t st = cublasGemmGroupedBatchedEx(h, ta, tb, m, n, k, alpha, (const void* const*)ptrs, t, lda,
                                                   (const void* const*)(ptrs + 3), t, ldb, beta,
                                                   (void* const*)(ptrs + 6), t, ldc, 2, size, CUBLAS_COMPUTE_32F);
    cuda_check(cudaDeviceSynchronize(), "sync");
    char name[96];
    snprintf(name, sizeof(name), "GemmGroupedBatchedEx %s", tname(t));
    if (ON_GPU && st == CUBLAS_STATUS_NOT_SUPPORTED) {
        printf("skip: %s not supported here\n", name);
        skipped++;
    } else {
        check(st == CUBLAS_STATUS_SUCCESS, "%s: status %d", name, (int)st);
    }
    for (int p = 0; p < 3 && st == CUBLAS_STATUS_SUCCESS; p++) {
        int g = p < 2 ? 0 : 1;
        double* want = want_from(&C[p]);
        double S = 0.0;
        for (int j = 0; j < n[g]; j++)
            for (int i = 0; i < m[g]; i++) {
                double s;
                want[i + (size_t)j * ldc[g]] = ref_elem(&A[p], ta[g], &B[p], tb[g], k[g], alpha[g], &C[p], beta[g], 0, i, j, &s);
                if (s > S) S = s;
            }
        char what[128];
        snprintf(what, sizeof(what), "%s problem %d (group %d)", name, p, g);
        check_mat(what, &C[p], want, 1e-5 * S, out_rtol(t));
        free(want);
    }
    for (int p = 0; p < 3; p++) { mat_free(&A[p]); mat_free(&B[p]); mat_free(&C[p]); }
    cuda_check(cudaFree(ptrs), "cudaFree");
}

// ----------------------------------------------------------------------------------------------------------
// cuBLASLt matmul with epilogues

static int epi_has(cublasLtEpilogue_t e, int what) {
    // what: 'b' adds bias, 'g' GELU, 'a' writes aux, 'd' GELU gradient, 'r' bias gradient of D rows
    switch (what) {
    case 'b': return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case 'g': return e == CUBLASLT_EPILOGUE_GELU || e == CUBLASLT_EPILOGUE_GELU_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX ||
                     e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case 'a': return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case 'd': return e == CUBLASLT_EPILOGUE_DGELU || e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case 'r': return e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
    }
    return 0;
}

static const char* epi_name(cublasLtEpilogue_t e) {
    switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT: return "DEFAULT";
    case CUBLASLT_EPILOGUE_BIAS: return "BIAS";
    case CUBLASLT_EPILOGUE_GELU: return "GELU";
    case CUBLASLT_EPILOGUE_GELU_BIAS: return "GELU_BIAS";
    case CUBLASLT_EPILOGUE_GELU_AUX: return "GELU_AUX";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return "GELU_AUX_BIAS";
    case CUBLASLT_EPILOGUE_DGELU: return "DGELU";
    case CUBLASLT_EPILOGUE_DGELU_BGRAD: return "DGELU_BGRAD";
    case CUBLASLT_EPILOGUE_BGRADA: return "BGRADA";
    case CUBLASLT_EPILOGUE_BGRADB: return "BGRADB";
    default: return "other";
    }
}

typedef struct {
    cublasOperation_t ta, tb;
    cudaDataType_t ab, dt;  // A/B type, C/D type
    cublasComputeType_t compute;
    cublasLtEpilogue_t epi;
    int bias_type, aux_type;  // -1: attribute left unset (then it is the type of D)
    int m, n, k, batch;
    float alpha, beta;
    int in_place;  // C and D the same buffer
} LtCase;

static cublasLtHandle_t lt;
static void* lt_workspace;
#define LT_WORKSPACE_SIZE (32 << 20)

static void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const void* v, size_t size) {
    cublasStatus_t st = cublasLtMatmulDescSetAttribute(d, attr, v, size);
    if (st != CUBLAS_STATUS_SUCCESS) check(0, "cublasLtMatmulDescSetAttribute %d: status %d", (int)attr, (int)st);
}

static cublasLtMatrixLayout_t make_layout(const Mat* x) {
    cublasLtMatrixLayout_t l;
    cublasStatus_t st = cublasLtMatrixLayoutCreate(&l, x->type, x->rows, x->cols, x->ld);
    if (x->batch > 1 && st == CUBLAS_STATUS_SUCCESS) {
        int32_t count = x->batch;
        int64_t stride = x->stride;
        st = cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count));
        if (st == CUBLAS_STATUS_SUCCESS)
            st = cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                  sizeof(stride));
    }
    if (st != CUBLAS_STATUS_SUCCESS) check(0, "matrix layout: status %d", (int)st);
    return l;
}

// Heuristic then matmul, as llm.c does it. Returns the status of whichever failed first.
static cublasStatus_t lt_matmul(cublasLtMatmulDesc_t desc, float alpha, const Mat* A, const Mat* B, float beta,
                                const Mat* C, const Mat* D) {
    cublasLtMatrixLayout_t la = make_layout(A), lb = make_layout(B), lc = make_layout(C), ld = make_layout(D);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    uint64_t ws = LT_WORKSPACE_SIZE;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, ld, pref, 1, &heur, &found);
    if (st == CUBLAS_STATUS_SUCCESS && found == 0) st = CUBLAS_STATUS_NOT_SUPPORTED;
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmul(lt, desc, &alpha, A->dev, la, B->dev, lb, &beta, C->dev, lc, D->dev, ld, &heur.algo,
                            lt_workspace, LT_WORKSPACE_SIZE, 0);
    cuda_check(cudaDeviceSynchronize(), "sync");
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatrixLayoutDestroy(ld);
    return st;
}

static void lt_case(const LtCase* c) {
    char name[200];
    snprintf(name, sizeof(name), "cublasLtMatmul %s %c%c A/B %s D %s bias %d aux %d batch %d m %d n %d k %d beta %g%s",
             epi_name(c->epi), opname(c->ta), opname(c->tb), tname(c->ab), tname(c->dt), c->bias_type, c->aux_type,
             c->batch, c->m, c->n, c->k, c->beta, c->in_place ? " in place" : "");
    const int m = c->m, n = c->n, k = c->k, batch = c->batch;
    const cublasLtEpilogue_t e = c->epi;
    const int bgrada = e == CUBLASLT_EPILOGUE_BGRADA, bgradb = e == CUBLASLT_EPILOGUE_BGRADB;
    const int bias_in = epi_has(e, 'b'), bias_out = epi_has(e, 'r') || bgrada || bgradb;
    const int gelu = epi_has(e, 'g'), aux_out = epi_has(e, 'a'), dgelu = epi_has(e, 'd');
    cudaDataType_t bias_t = c->bias_type < 0 ? c->dt : (cudaDataType_t)c->bias_type;
    cudaDataType_t aux_t = c->aux_type < 0 ? c->dt : (cudaDataType_t)c->aux_type;

    int ar = c->ta == CUBLAS_OP_N ? m : k, ac = c->ta == CUBLAS_OP_N ? k : m;
    int br = c->tb == CUBLAS_OP_N ? k : n, bc = c->tb == CUBLAS_OP_N ? n : k;
    Mat A = mat_new(c->ab, ar, ac, ar + 3, batch, -1.0f, 1.0f, 0.5f);
    Mat B = mat_new(c->ab, br, bc, br + 5, batch, -1.0f, 1.0f, 0.5f);
    float lo = c->beta == 0.0f ? NAN : -1.0f, hi = c->beta == 0.0f ? NAN : 1.0f;
    Mat C = mat_new(c->dt, m, n, m + 2, batch, lo, hi, SENTINEL);
    Mat D = c->in_place ? C : mat_new(c->dt, m, n, m + 6, batch, NAN, NAN, SENTINEL);
    int aux_ld = (m + 7) / 8 * 8 + 8;  // a multiple of 8, as cuBLASLt requires, and larger than m
    Mat X = mat_new(aux_t, m, n, aux_ld, batch, dgelu ? -3.0f : NAN, dgelu ? 3.0f : NAN, SENTINEL);
    int nbias = bgradb ? n : m;
    Mat V = mat_new(bias_t, nbias, 1, nbias, batch, bias_in ? -1.0f : NAN, bias_in ? 1.0f : NAN, SENTINEL);

    // reference
    double *want_d = want_from(&D), *want_x = want_from(&X), *want_v = want_from(&V);
    double S = 0.0, G = 0.0, row_abs_max = 0.0;
    double* row_sum = (double*)malloc(m * sizeof(double));
    double* row_abs = (double*)malloc(m * sizeof(double));
    for (int b = 0; b < batch; b++) {
        for (int i = 0; i < m; i++) row_sum[i] = row_abs[i] = 0.0;
        for (int j = 0; j < n; j++) {
            for (int i = 0; i < m; i++) {
                double s;
                double x = ref_elem(&A, c->ta, &B, c->tb, k, c->alpha, &C, c->beta, b, i, j, &s);
                if (bias_in) {
                    double bias = V.host[b * V.stride + i];
                    x += bias;
                    s += fabs(bias);
                }
                if (aux_out) want_x[b * X.stride + i + (size_t)j * X.ld] = x;
                if (fabs(x) > G) G = fabs(x);
                if (gelu) x = gelu_ref(x);
                if (dgelu) x *= gelu_grad_ref(X.host[b * X.stride + i + (size_t)j * X.ld]);
                want_d[b * D.stride + i + (size_t)j * D.ld] = x;
                row_sum[i] += x;
                row_abs[i] += fabs(x);
                if (s > S) S = s;
            }
        }
        for (int i = 0; i < m; i++) if (row_abs[i] > row_abs_max) row_abs_max = row_abs[i];
        if (epi_has(e, 'r')) for (int i = 0; i < m; i++) want_v[b * V.stride + i] = row_sum[i];
        for (int i = 0; i < m && bgrada; i++) {
            double s = 0.0;
            for (int l = 0; l < k; l++) s += opA(&A, c->ta, b, i, l);
            want_v[b * V.stride + i] = s;
        }
        for (int j = 0; j < n && bgradb; j++) {
            double s = 0.0;
            for (int l = 0; l < k; l++) s += opB(&B, c->tb, b, l, j);
            want_v[b * V.stride + j] = s;
        }
    }

    cublasLtMatmulDesc_t desc;
    if (cublasLtMatmulDescCreate(&desc, c->compute, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) check(0, "desc create");
    int32_t ta = c->ta, tb = c->tb;
    uint32_t epi = e;
    set_desc(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    set_desc(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    set_desc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
    if (bias_in || bias_out) {
        int64_t stride = V.stride;
        set_desc(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &V.dev, sizeof(V.dev));
        if (batch > 1) set_desc(desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &stride, sizeof(stride));
        if (c->bias_type >= 0) set_desc(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &c->bias_type, sizeof(int32_t));
    }
    if (aux_out || dgelu) {
        int64_t ld = X.ld, stride = X.stride;
        set_desc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &X.dev, sizeof(X.dev));
        set_desc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld));
        if (batch > 1) set_desc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &stride, sizeof(stride));
        if (c->aux_type >= 0)
            set_desc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &c->aux_type, sizeof(int32_t));
    }
    cublasStatus_t st = lt_matmul(desc, c->alpha, &A, &B, c->beta, &C, &D);
    cublasLtMatmulDescDestroy(desc);

    if (ON_GPU && st == CUBLAS_STATUS_NOT_SUPPORTED) {
        printf("skip: %s not supported here\n", name);
        skipped++;
    } else {
        check(st == CUBLAS_STATUS_SUCCESS, "%s: status %d", name, (int)st);
    }
    if (st == CUBLAS_STATUS_SUCCESS) {
        double atol = (gelu || dgelu ? 1.2 : 1.0) * acc_tol(c->compute) * S;
        if (ON_GPU && (gelu || dgelu)) atol += 2e-3 * (G + S);
        char what[240];
        snprintf(what, sizeof(what), "%s: D", name);
        check_mat(what, &D, want_d, atol, out_rtol(c->dt));
        if (aux_out) {
            snprintf(what, sizeof(what), "%s: aux", name);
            check_mat(what, &X, want_x, acc_tol(c->compute) * S, out_rtol(aux_t));
        }
        if (bias_out) {
            // DGELU_BGRAD sums n outputs (each within atol); a GPU may sum them after rounding to D's type
            double batol = bgrada || bgradb ? 1e-5 * k : n * atol + out_rtol(c->dt) * row_abs_max;
            snprintf(what, sizeof(what), "%s: bias gradient", name);
            check_mat(what, &V, want_v, batol, out_rtol(bias_t));
        }
    }
    free(row_sum); free(row_abs);
    free(want_d); free(want_x); free(want_v);
    mat_free(&A); mat_free(&B); mat_free(&C); mat_free(&X); mat_free(&V);
    if (!c->in_place) mat_free(&D);
}

// ----------------------------------------------------------------------------------------------------------
// Status codes for bad arguments and for what is not supported. On a GPU any error satisfies an expected error.

static void check_status(cublasStatus_t got, cublasStatus_t want, const char* what) {
    int ok = got == want || (ON_GPU && want != CUBLAS_STATUS_SUCCESS && got != CUBLAS_STATUS_SUCCESS);
    check(ok, "%s: status %d, want %d", what, (int)got, (int)want);
}

static void status_tests(cublasHandle_t h) {
    const int m = 37, n = 23, k = 61;
    Mat A = mat_new(CUDA_R_32F, m, k, m, 1, -1.0f, 1.0f, 0.0f);
    Mat B = mat_new(CUDA_R_32F, k, n, k, 1, -1.0f, 1.0f, 0.0f);
    Mat C = mat_new(CUDA_R_32F, m, n, m, 1, -1.0f, 1.0f, 0.0f);
    float one = 1.0f, zero = 0.0f;
    const cublasOperation_t N = CUBLAS_OP_N;
    check_status(cublasGemmEx(NULL, N, N, m, n, k, &one, A.dev, CUDA_R_32F, m, B.dev, CUDA_R_32F, k, &zero, C.dev,
                              CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 CUBLAS_STATUS_NOT_INITIALIZED, "GemmEx null handle");
    check_status(cublasSgemm(h, N, N, -1, n, k, &one, (float*)A.dev, m, (float*)B.dev, k, &zero, (float*)C.dev, m),
                 CUBLAS_STATUS_INVALID_VALUE, "Sgemm m < 0");
    check_status(cublasSgemm(h, N, N, m, n, -2, &one, (float*)A.dev, m, (float*)B.dev, k, &zero, (float*)C.dev, m),
                 CUBLAS_STATUS_INVALID_VALUE, "Sgemm k < 0");
    check_status(cublasSgemm(h, N, N, m, n, k, &one, (float*)A.dev, m - 1, (float*)B.dev, k, &zero, (float*)C.dev, m),
                 CUBLAS_STATUS_INVALID_VALUE, "Sgemm lda < m");
    check_status(cublasSgemm(h, CUBLAS_OP_T, N, m, n, k, &one, (float*)A.dev, k - 1, (float*)B.dev, k, &zero,
                             (float*)C.dev, m),
                 CUBLAS_STATUS_INVALID_VALUE, "Sgemm transposed lda < k");
    check_status(cublasSgemm(h, N, N, m, n, k, &one, (float*)A.dev, m, (float*)B.dev, k - 1, &zero, (float*)C.dev, m),
                 CUBLAS_STATUS_INVALID_VALUE, "Sgemm ldb < k");
    check_status(cublasSgemm(h, N, N, m, n, k, &one, (float*)A.dev, m, (float*)B.dev, k, &zero, (float*)C.dev, m - 1),
                 CUBLAS_STATUS_INVALID_VALUE, "Sgemm ldc < m");
    check_status(cublasGemmStridedBatchedEx(h, N, N, m, n, k, &one, A.dev, CUDA_R_32F, m, 0, B.dev, CUDA_R_32F, k, 0,
                                            &zero, C.dev, CUDA_R_32F, m, 0, -1, CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT),
                 CUBLAS_STATUS_INVALID_VALUE, "GemmStridedBatchedEx batchCount < 0");
    check_status(cublasGemmEx(h, N, N, m, n, k, &one, A.dev, CUDA_R_32F, m, B.dev, CUDA_R_16BF, k, &zero, C.dev,
                              CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 CUBLAS_STATUS_NOT_SUPPORTED, "GemmEx A fp32, B bf16");
    check_status(cublasGemmEx(h, N, N, m, n, k, &one, A.dev, CUDA_R_32F, m, B.dev, CUDA_R_32F, k, &zero, C.dev,
                              CUDA_R_16BF, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 CUBLAS_STATUS_NOT_SUPPORTED, "GemmEx fp32 inputs, bf16 output");
    check_status(cublasGemmEx(h, N, N, m, n, k, &one, A.dev, CUDA_R_32F, m, B.dev, CUDA_R_32F, k, &zero, C.dev,
                              CUDA_R_32F, m, CUBLAS_COMPUTE_16F, CUBLAS_GEMM_DEFAULT),
                 CUBLAS_STATUS_NOT_SUPPORTED, "GemmEx fp16 accumulation of fp32 data");
    check_status(cublasGemmEx(h, N, N, m, n, k, &one, A.dev, CUDA_R_16BF, m, B.dev, CUDA_R_16BF, k, &zero, C.dev,
                              CUDA_R_16BF, m, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT),
                 CUBLAS_STATUS_NOT_SUPPORTED, "GemmEx TF32 compute on bf16 data");

    // handle state round trips
    cudaStream_t s = (cudaStream_t)0, got_s = (cudaStream_t)1;
    check(cublasSetStream(h, s) == CUBLAS_STATUS_SUCCESS && cublasGetStream(h, &got_s) == CUBLAS_STATUS_SUCCESS &&
          got_s == s, "cublasSetStream/GetStream");
    cublasMath_t mode;
    check(cublasSetMathMode(h, CUBLAS_TF32_TENSOR_OP_MATH) == CUBLAS_STATUS_SUCCESS &&
          cublasGetMathMode(h, &mode) == CUBLAS_STATUS_SUCCESS && mode == CUBLAS_TF32_TENSOR_OP_MATH,
          "cublasSetMathMode/GetMathMode");
    cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
    cublasPointerMode_t pm;
    check(cublasGetPointerMode(h, &pm) == CUBLAS_STATUS_SUCCESS && pm == CUBLAS_POINTER_MODE_HOST, "pointer mode");
    check(strcmp(cublasGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED") == 0,
          "cublasGetStatusName");

    // cuBLASLt: descriptor attributes round trip, with the documented size rules
    cublasLtMatmulDesc_t desc;
    check(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS, "desc create");
    uint32_t epi = CUBLASLT_EPILOGUE_GELU_AUX_BIAS, epi_back = 0;
    size_t written = 0;
    check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)) ==
              CUBLAS_STATUS_SUCCESS &&
          cublasLtMatmulDescGetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi_back, sizeof(epi_back), &written) ==
              CUBLAS_STATUS_SUCCESS &&
          epi_back == epi && written == sizeof(epi), "desc epilogue round trip");
    check(cublasLtMatmulDescGetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, NULL, 0, &written) ==
              CUBLAS_STATUS_SUCCESS && written == sizeof(int64_t), "desc size query");
    int64_t wide = 0;
    check_status(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &wide, sizeof(wide)),
                 CUBLAS_STATUS_INVALID_VALUE, "desc attribute of the wrong size");
    int64_t ld_back = 0;
    cublasLtMatrixLayout_t la;
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, 37, 61, 40);
    check(cublasLtMatrixLayoutGetAttribute(la, CUBLASLT_MATRIX_LAYOUT_LD, &ld_back, sizeof(ld_back), &written) ==
              CUBLAS_STATUS_SUCCESS && ld_back == 40, "layout ld round trip");
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatmulDescDestroy(desc);

    // cuBLASLt: bad shapes and what is not supported
    cublasLtMatrixLayout_t lA, lB, lC, lbad;
    cublasLtMatrixLayoutCreate(&lA, CUDA_R_32F, m, k, m);
    cublasLtMatrixLayoutCreate(&lB, CUDA_R_32F, k, n, k);
    cublasLtMatrixLayoutCreate(&lC, CUDA_R_32F, m, n, m);
    cublasLtMatrixLayoutCreate(&lbad, CUDA_R_32F, m + 1, k, m + 1);  // A with one row too many
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    check_status(cublasLtMatmul(NULL, desc, &one, A.dev, lA, B.dev, lB, &zero, C.dev, lC, C.dev, lC, NULL, NULL, 0, 0),
                 CUBLAS_STATUS_NOT_INITIALIZED, "cublasLtMatmul null handle");
    check_status(cublasLtMatmul(lt, desc, &one, A.dev, lbad, B.dev, lB, &zero, C.dev, lC, C.dev, lC, NULL, NULL, 0, 0),
                 CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul A rows != D rows");
    int32_t order = CUBLASLT_ORDER_COL32;
    cublasLtMatrixLayout_t lcol32;
    cublasLtMatrixLayoutCreate(&lcol32, CUDA_R_32F, m, k, 32 * m);
    cublasLtMatrixLayoutSetAttribute(lcol32, CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof(order));
    check_status(cublasLtMatmul(lt, desc, &one, A.dev, lcol32, B.dev, lB, &zero, C.dev, lC, C.dev, lC, NULL, NULL, 0, 0),
                 CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmul COL32 order for fp32");
    // aux leading dimension smaller than the rows of D
    epi = CUBLASLT_EPILOGUE_GELU_AUX;
    int64_t bad_ld = 8;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &A.dev, sizeof(A.dev));
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &bad_ld, sizeof(bad_ld));
    check_status(cublasLtMatmul(lt, desc, &one, A.dev, lA, B.dev, lB, &zero, C.dev, lC, C.dev, lC, NULL, NULL, 0, 0),
                 CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul aux ld < rows");
#if !ON_GPU
    // the CPU backend's own limits (a GPU computes these): ReLU epilogues, row-major order
    cublasLtMatmulHeuristicResult_t heur;
    int found = -1;
    epi = CUBLASLT_EPILOGUE_RELU;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
    check_status(cublasLtMatmul(lt, desc, &one, A.dev, lA, B.dev, lB, &zero, C.dev, lC, C.dev, lC, NULL, NULL, 0, 0),
                 CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmul RELU epilogue");
    check(cublasLtMatmulAlgoGetHeuristic(lt, desc, lA, lB, lC, lC, NULL, 1, &heur, &found) ==
              CUBLAS_STATUS_NOT_SUPPORTED && found == 0, "heuristic refuses the RELU epilogue");
    epi = CUBLASLT_EPILOGUE_DEFAULT;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
    check(cublasLtMatmulAlgoGetHeuristic(lt, desc, lA, lB, lC, lC, NULL, 1, &heur, &found) ==
              CUBLAS_STATUS_SUCCESS && found == 1 && heur.state == CUBLAS_STATUS_SUCCESS && heur.workspaceSize == 0,
          "heuristic: one algorithm, no workspace");
    order = CUBLASLT_ORDER_ROW;
    cublasLtMatrixLayoutSetAttribute(lcol32, CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof(order));
    check_status(cublasLtMatmul(lt, desc, &one, A.dev, lcol32, B.dev, lB, &zero, C.dev, lC, C.dev, lC, NULL, NULL, 0, 0),
                 CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmul row-major order");
#endif
    cublasLtMatrixLayoutDestroy(lA);
    cublasLtMatrixLayoutDestroy(lB);
    cublasLtMatrixLayoutDestroy(lC);
    cublasLtMatrixLayoutDestroy(lbad);
    cublasLtMatrixLayoutDestroy(lcol32);
    cublasLtMatmulDescDestroy(desc);
    mat_free(&A);
    mat_free(&B);
    mat_free(&C);
}

// ----------------------------------------------------------------------------------------------------------

int main(void) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        printf("test_cublas: no CUDA device\n");
        return 1;
    }
    test_seed(1234);
    cublasHandle_t h;
    check(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
    check(cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS, "cublasLtCreate");
    cuda_check(cudaMalloc(&lt_workspace, LT_WORKSPACE_SIZE), "cudaMalloc");

    const cublasOperation_t ops[2] = {CUBLAS_OP_N, CUBLAS_OP_T};
    // A/B type, C type: every pair cuBLAS accepts with fp32 accumulation
    const cudaDataType_t types[5][2] = {{CUDA_R_32F, CUDA_R_32F}, {CUDA_R_16BF, CUDA_R_16BF},
                                        {CUDA_R_16BF, CUDA_R_32F}, {CUDA_R_16F, CUDA_R_16F},
                                        {CUDA_R_16F, CUDA_R_32F}};

    // GemmEx: every type pair, transpose pair, beta zero (C is NaN) and not
    for (int t = 0; t < 5; t++)
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 2; b++)
                for (int z = 0; z < 2; z++) {
                    GemmCase c = {API_GEMMEX, ops[a], ops[b], types[t][0], types[t][1], CUBLAS_COMPUTE_32F,
                                  37, 23, 61, 1, 1.25f, z ? 0.75f : 0.0f, 0};
                    gemm_case(h, &c);
                }
    // the FAST compute types on fp32 data
    const cublasComputeType_t fast[3] = {CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_32F_FAST_16BF,
                                         CUBLAS_COMPUTE_32F_FAST_16F};
    for (int f = 0; f < 3; f++) {
        GemmCase c = {API_GEMMEX, CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_32F, CUDA_R_32F, fast[f], 37, 23, 61, 1, -0.5f, 0.25f, 0};
        gemm_case(h, &c);
    }
    // Sgemm: every transpose pair; alpha/beta from device memory; k = 0 leaves beta * C
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++) {
            GemmCase c = {API_SGEMM, ops[a], ops[b], CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F, 37, 23, 61, 1, 0.75f,
                          (a + b) % 2 ? 0.0f : -1.5f, 0};
            gemm_case(h, &c);
        }
    {
        GemmCase c = {API_SGEMM, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F, 37, 23, 61, 1,
                      2.0f, 0.5f, 1};
        gemm_case(h, &c);
        GemmCase z = {API_SGEMM, CUBLAS_OP_N, CUBLAS_OP_N, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F, 37, 23, 0, 1,
                      1.0f, 0.5f, 0};
        gemm_case(h, &z);
        z.beta = 0.0f;
        gemm_case(h, &z);
    }
    // batched forms: strided (every type pair) and pointer arrays
    for (int t = 0; t < 5; t++) {
        GemmCase c = {API_STRIDED_EX, ops[t % 2], ops[(t / 2) % 2], types[t][0], types[t][1], CUBLAS_COMPUTE_32F,
                      37, 23, 61, 3, 1.25f, t % 2 ? 0.0f : 0.5f, 0};
        gemm_case(h, &c);
    }
    {
        GemmCase c = {API_SGEMM_STRIDED, CUBLAS_OP_T, CUBLAS_OP_T, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F, 37, 23, 61,
                      4, 1.0f, -0.5f, 0};
        gemm_case(h, &c);
        GemmCase p = {API_BATCHED_EX, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16BF, CUDA_R_16BF, CUBLAS_COMPUTE_32F, 37, 23, 61,
                      3, 0.5f, 0.0f, 0};
        gemm_case(h, &p);
    }
    grouped_case(h, CUDA_R_32F);
    grouped_case(h, CUDA_R_16BF);

    // cuBLASLt: every epilogue, transpose pair and D type; beta alternates between 0 (C is NaN) and not, C and D
    // alternate between distinct and the same buffer
    const cublasLtEpilogue_t epis[10] = {CUBLASLT_EPILOGUE_DEFAULT, CUBLASLT_EPILOGUE_BIAS, CUBLASLT_EPILOGUE_GELU,
                                         CUBLASLT_EPILOGUE_GELU_BIAS, CUBLASLT_EPILOGUE_GELU_AUX,
                                         CUBLASLT_EPILOGUE_GELU_AUX_BIAS, CUBLASLT_EPILOGUE_DGELU,
                                         CUBLASLT_EPILOGUE_DGELU_BGRAD, CUBLASLT_EPILOGUE_BGRADA,
                                         CUBLASLT_EPILOGUE_BGRADB};
    const cudaDataType_t lt_types[4][2] = {{CUDA_R_32F, CUDA_R_32F}, {CUDA_R_16BF, CUDA_R_16BF},
                                           {CUDA_R_16BF, CUDA_R_32F}, {CUDA_R_16F, CUDA_R_16F}};
    int variant = 0;
    for (int ei = 0; ei < 10; ei++)
        for (int t = 0; t < 4; t++)
            for (int a = 0; a < 2; a++)
                for (int b = 0; b < 2; b++, variant++) {
                    LtCase c = {ops[a], ops[b], lt_types[t][0], lt_types[t][1], CUBLAS_COMPUTE_32F, epis[ei], -1, -1,
                                37, 23, 61, 1, 1.25f, variant % 2 ? 0.0f : 0.5f, (variant / 2) % 2};
                    lt_case(&c);
                }
    // strided batches with per-batch bias, aux and bias-gradient buffers
    for (int ei = 0; ei < 10; ei++) {
        LtCase c = {CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_16BF, CUDA_R_16BF, CUBLAS_COMPUTE_32F, epis[ei], -1, -1,
                    37, 23, 61, 3, 0.75f, ei % 2 ? 0.0f : -0.5f, 0};
        lt_case(&c);
    }
    // bias and aux types other than D's, and the FAST compute types
    {
        LtCase c = {CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_16BF, CUDA_R_16BF, CUBLAS_COMPUTE_32F,
                    CUBLASLT_EPILOGUE_GELU_AUX_BIAS, CUDA_R_32F, -1, 37, 23, 61, 1, 1.0f, 0.0f, 0};
        lt_case(&c);
        c.epi = CUBLASLT_EPILOGUE_BGRADB;
        lt_case(&c);
        c.epi = CUBLASLT_EPILOGUE_DGELU;
        c.bias_type = -1;
        c.aux_type = CUDA_R_32F;
        lt_case(&c);
        for (int f = 0; f < 3; f++) {
            LtCase d = {CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_32F, CUDA_R_32F, fast[f], CUBLASLT_EPILOGUE_GELU_BIAS, -1, -1,
                        37, 23, 61, 1, 1.0f, 0.5f, 0};
            lt_case(&d);
        }
    }
    // shapes large enough for the multi-threaded paths, as in a GPT-2 MLP
    {
        LtCase c = {CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_16BF, CUDA_R_16BF, CUBLAS_COMPUTE_32F,
                    CUBLASLT_EPILOGUE_GELU_AUX_BIAS, -1, -1, 384, 200, 96, 1, 1.0f, 0.0f, 0};
        lt_case(&c);
        c.epi = CUBLASLT_EPILOGUE_DGELU_BGRAD;
        c.m = 300; c.n = 256; c.k = 150; c.ta = CUBLAS_OP_N;
        lt_case(&c);
        c.epi = CUBLASLT_EPILOGUE_BGRADB;
        c.tb = CUBLAS_OP_T;
        c.dt = CUDA_R_32F;
        c.beta = 1.0f;
        lt_case(&c);
    }

    status_tests(h);

    check(cublasLtDestroy(lt) == CUBLAS_STATUS_SUCCESS, "cublasLtDestroy");
    check(cublasDestroy(h) == CUBLAS_STATUS_SUCCESS, "cublasDestroy");
    cuda_check(cudaFree(lt_workspace), "cudaFree");
    if (skipped) printf("%d configurations skipped: not supported by this cuBLASLt\n", skipped);
    return test_summary("test_cublas");
}
