// cpu/cublas.cpp: cuBLAS and cuBLASLt for the CPU backend, on top of OpenBLAS.
//
// The trainers call cublasGemmEx / cublasGemmStridedBatchedEx / cublasGemmGroupedBatchedEx and cublasLtMatmul
// with fused epilogues (bias, GELU, GELU backward, bias gradients). On the CPU backend device memory is host
// memory and every call runs synchronously, so each function here computes its result immediately on the
// pointers it is given; streams and workspaces are stored and otherwise ignored.
//
// Build: g++ -std=c++17 -O3 -I/usr/local/cuda/include -c cpu/cublas.cpp, link with -lopenblas.
// The declarations are the CUDA toolkit's own cublas_v2.h and cublasLt.h, so every signature here is exactly
// the one the GPU code compiles against.
//
// Threads: OpenBLAS parallelizes the product with its own pthreads. The conversions and the epilogue pass are
// deliberately single-threaded: OpenMP loops here left libgomp threads spinning while OpenBLAS ran, which halved
// its speed on a 2-core machine (bf16 1024^3 GEMM: 80 GFLOP/s with OpenMP passes, 210 without).
//
// How a GEMM runs: every product goes through OpenBLAS cblas_sgemm (column-major, the transpose flags and
// leading dimensions passed straight through). bf16/fp16 operands are first widened to fp32 copies in a
// thread-local scratch buffer, which is the same numerics as the GPU: products of the stored values
// accumulated in fp32. alpha*AB + beta*C and the epilogue are then applied in one pass over the fp32
// accumulator, rounding once to the output type, as the GPU does in registers. beta == 0 never reads C (it may
// hold NaN garbage, as on the GPU). Compute types that ask for reduced precision (FAST_TF32, FAST_16BF,
// FAST_16F) are computed in full fp32: the GPU is allowed, not required, to down-convert.
//
// What is not modelled returns CUBLAS_STATUS_NOT_SUPPORTED rather than computing something else: fp16 or
// integer accumulation, mixed A/B types, ReLU epilogues, non-column-major orders, pointer-array batches in
// cuBLASLt, per-row alpha vectors, fp8 scale factors and amax outputs.
#include <cublas_v2.h>
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cblas.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------------------------------------
// Element types

static size_t type_size(cudaDataType_t t) {
    return t == CUDA_R_32F ? 4 : 2;
}

static int float_type(int t) {  // the storage types this backend computes with
    return t == CUDA_R_32F || t == CUDA_R_16BF || t == CUDA_R_16F;
}

// bf16 <-> fp32 by bit manipulation, bit-exact with the toolkit's host __float2bfloat16 (round to nearest even,
// NaN to 0x7fff) but branch-free enough to vectorize; the toolkit's host versions cost ~1.6 ns per element.
static inline float to_float(float x) { return x; }
static inline float to_float(__nv_bfloat16 x) {
    uint32_t u = (uint32_t)((__nv_bfloat16_raw)x).x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float to_float(__half x) { return __half2float(x); }
template <typename T> static inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    __nv_bfloat16_raw r;
    r.x = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fff : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return __nv_bfloat16(r);
}
template <> inline __half from_float<__half>(float x) { return __float2half(x); }

// Type-dispatched access for the few per-element reads/writes that are not in a templated loop (aux matrix).
static inline float load(const void* p, cudaDataType_t t, int64_t i) {
    if (t == CUDA_R_16BF) return to_float(((const __nv_bfloat16*)p)[i]);
    if (t == CUDA_R_16F) return to_float(((const __half*)p)[i]);
    return ((const float*)p)[i];
}
static inline void store(void* p, cudaDataType_t t, int64_t i, float x) {
    if (t == CUDA_R_16BF) ((__nv_bfloat16*)p)[i] = from_float<__nv_bfloat16>(x);
    else if (t == CUDA_R_16F) ((__half*)p)[i] = from_float<__half>(x);
    else ((float*)p)[i] = x;
}

// ----------------------------------------------------------------------------------------------------------
// Scratch: fp32 copies of bf16/fp16 operands and the fp32 accumulator. One buffer per calling thread that only
// grows, so a training loop that repeats the same shapes allocates once.

static thread_local float* scratch = NULL;
static thread_local size_t scratch_cap = 0;

static float* scratch_get(size_t nfloats) {
    if (nfloats > scratch_cap) {
        free(scratch);
        scratch_cap = nfloats + nfloats / 4;
        scratch = (float*)malloc(scratch_cap * sizeof(float));
        if (scratch == NULL) scratch_cap = 0;
    }
    return scratch;
}

// Widens a rows x cols column-major matrix (leading dimension ld) to a packed fp32 copy (leading dimension rows).
template <typename T>
static void widen(const T* x, int64_t rows, int64_t cols, int64_t ld, float* out) {
    for (int64_t j = 0; j < cols; j++) {
        const T* col = x + j * ld;
        float* o = out + j * rows;
        for (int64_t i = 0; i < rows; i++) o[i] = to_float(col[i]);
    }
}

// Returns an fp32 view of a stored matrix: the matrix itself when it is fp32, else a widened copy in `buf`.
static const float* as_f32(const void* x, cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld, float* buf,
                           int64_t* ld_out) {
    if (t == CUDA_R_32F) { *ld_out = ld; return (const float*)x; }
    if (t == CUDA_R_16BF) widen((const __nv_bfloat16*)x, rows, cols, ld, buf);
    else widen((const __half*)x, rows, cols, ld, buf);
    *ld_out = rows > 1 ? rows : 1;  // BLAS wants ld >= 1 even for an empty matrix
    return buf;
}

// ----------------------------------------------------------------------------------------------------------
// GELU, tanh approximation, as cuBLASLt's GELU epilogues compute it. tanh(y) = 1 - 2/(exp(2y) + 1) costs a third
// of glibc's tanhf and errs by ~1e-7 absolute, which GELU turns into ~1e-7 relative; exp overflowing to inf gives
// exactly 1, so there is no NaN for large |y|.

#define GELU_SCALE 0.7978845608028654f  // sqrt(2/pi)

static inline float tanh_fast(float y) { return 1.0f - 2.0f / (expf(2.0f * y) + 1.0f); }

static inline float gelu(float x) {
    float cube = 0.044715f * x * x * x;
    return 0.5f * x * (1.0f + tanh_fast(GELU_SCALE * (x + cube)));
}

static inline float gelu_grad(float x) {
    float t = tanh_fast(GELU_SCALE * (x + 0.044715f * x * x * x));
    float dt = (1.0f - t * t) * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * dt;
}

// ----------------------------------------------------------------------------------------------------------
// One GEMM, everything resolved: D = epilogue(alpha * op(A) op(B) + beta * C). The cuBLAS entry points fill it
// with C == D and the default epilogue; cublasLtMatmul fills in its epilogue attributes.

typedef struct {
    cublasOperation_t transa, transb;
    int64_t m, n, k;
    float alpha, beta;
    const void* A; cudaDataType_t Atype; int64_t lda;
    const void* B; cudaDataType_t Btype; int64_t ldb;
    const void* C; int64_t ldc;  // C has D's type; never read when beta == 0
    void* D; cudaDataType_t Dtype; int64_t ldd;
    uint32_t epilogue;           // cublasLtEpilogue_t
    void* bias; cudaDataType_t bias_type;  // bias input, or bias gradient output for the BGRAD epilogues
    void* aux; cudaDataType_t aux_type; int64_t aux_ld;  // GELU input: written by GELU_AUX*, read by DGELU*
} Gemm;

static int epi_adds_bias(uint32_t e) {
    return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}
static int epi_gelu(uint32_t e) {
    return e == CUBLASLT_EPILOGUE_GELU || e == CUBLASLT_EPILOGUE_GELU_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX ||
           e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}
static int epi_writes_aux(uint32_t e) {
    return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}
static int epi_dgelu(uint32_t e) {
    return e == CUBLASLT_EPILOGUE_DGELU || e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}
static int epi_uses_aux(uint32_t e) { return epi_writes_aux(e) || epi_dgelu(e); }
static int epi_uses_bias(uint32_t e) {
    return epi_adds_bias(e) || e == CUBLASLT_EPILOGUE_DGELU_BGRAD || e == CUBLASLT_EPILOGUE_BGRADA ||
           e == CUBLASLT_EPILOGUE_BGRADB;
}
static int epi_supported(uint32_t e) {
    return e == CUBLASLT_EPILOGUE_DEFAULT || epi_uses_bias(e) || epi_gelu(e) || epi_dgelu(e);
}

// The pass after the product. W holds alpha * op(A) op(B) in fp32 (it may be D itself when D is fp32, in which
// case beta * C is already in it and add_c is 0). row_sums gets the DGELU_BGRAD bias gradient: the sum over the n
// columns of the final output, in fp32, before its rounding to D's type.
template <typename T>
static void epilogue_pass(const Gemm* g, const float* W, int64_t ldw, int add_c, const float* bias32,
                          float* row_sums) {
    const T* C = (const T*)g->C;
    T* D = (T*)g->D;
    const uint32_t e = g->epilogue;
    const int gelu_on = epi_gelu(e), aux_out = epi_writes_aux(e), dgelu_on = epi_dgelu(e);
    if (row_sums) for (int64_t i = 0; i < g->m; i++) row_sums[i] = 0.0f;
    for (int64_t j = 0; j < g->n; j++) {
        for (int64_t i = 0; i < g->m; i++) {
            float x = W[i + j * ldw];
            if (add_c) x += g->beta * to_float(C[i + j * g->ldc]);
            if (bias32) x += bias32[i];
            if (aux_out) store(g->aux, g->aux_type, i + j * g->aux_ld, x);
            if (gelu_on) x = gelu(x);
            if (dgelu_on) x *= gelu_grad(load(g->aux, g->aux_type, i + j * g->aux_ld));
            D[i + j * g->ldd] = from_float<T>(x);
            if (row_sums) row_sums[i] += x;
        }
    }
}

// out[c] = sum over l < len of X(c, l), with X(c, l) at X[l + c*ld] (contiguous) or X[c + l*ld] (strided).
static void sum_lines(const float* X, int64_t ld, int64_t count, int64_t len, int contiguous, float* out) {
    if (contiguous) {
        for (int64_t c = 0; c < count; c++) {
            float s = 0.0f;
            for (int64_t l = 0; l < len; l++) s += X[l + c * ld];
            out[c] = s;
        }
    } else {
        for (int64_t c = 0; c < count; c++) out[c] = 0.0f;
        for (int64_t l = 0; l < len; l++)
            for (int64_t c = 0; c < count; c++) out[c] += X[c + l * ld];
    }
}

static cublasStatus_t run_gemm_full(const Gemm* g) {
    const int64_t m = g->m, n = g->n, k = g->k;
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    const int ta = g->transa != CUBLAS_OP_N, tb = g->transb != CUBLAS_OP_N;
    const uint32_t e = g->epilogue;
    // stored shapes of A (m x k, or k x m when transposed) and B (k x n, or n x k)
    const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k;
    const int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
    const int64_t a_sz = g->Atype == CUDA_R_32F ? 0 : a_rows * a_cols;
    const int64_t b_sz = g->Btype == CUDA_R_32F ? 0 : b_rows * b_cols;
    const int64_t w_sz = g->Dtype == CUDA_R_32F ? 0 : m * n;
    float* s = scratch_get((size_t)(a_sz + b_sz + w_sz + (m > n ? m : n)));
    if (s == NULL) return CUBLAS_STATUS_ALLOC_FAILED;
    float *a_buf = s, *b_buf = s + a_sz, *w = s + a_sz + b_sz, *vec = s + a_sz + b_sz + w_sz;

    int64_t lda32, ldb32;
    const float* A32 = as_f32(g->A, g->Atype, a_rows, a_cols, g->lda, a_buf, &lda32);
    const float* B32 = as_f32(g->B, g->Btype, b_rows, b_cols, g->ldb, b_buf, &ldb32);
    const CBLAS_TRANSPOSE cta = ta ? CblasTrans : CblasNoTrans, ctb = tb ? CblasTrans : CblasNoTrans;

    const float* bias32 = NULL;
    if (epi_adds_bias(e)) {
        for (int64_t i = 0; i < m; i++) vec[i] = load(g->bias, g->bias_type, i);
        bias32 = vec;
    }
    float* row_sums = e == CUBLASLT_EPILOGUE_DGELU_BGRAD ? vec : NULL;
    const int needs_pass = bias32 || epi_gelu(e) || epi_dgelu(e);

    if (g->Dtype == CUDA_R_32F) {
        // accumulate straight into D: OpenBLAS applies beta (and with beta == 0 writes D without reading it)
        float* D = (float*)g->D;
        if (g->beta != 0.0f && g->C != g->D)
            for (int64_t j = 0; j < n; j++) memcpy(D + j * g->ldd, (const float*)g->C + j * g->ldc, m * sizeof(float));
        cblas_sgemm(CblasColMajor, cta, ctb, m, n, k, g->alpha, A32, lda32, B32, ldb32, g->beta, D, g->ldd);
        if (needs_pass) epilogue_pass<float>(g, D, g->ldd, 0, bias32, row_sums);
    } else {
        cblas_sgemm(CblasColMajor, cta, ctb, m, n, k, g->alpha, A32, lda32, B32, ldb32, 0.0f, w, m);
        int add_c = g->beta != 0.0f;
        if (g->Dtype == CUDA_R_16BF) epilogue_pass<__nv_bfloat16>(g, w, m, add_c, bias32, row_sums);
        else epilogue_pass<__half>(g, w, m, add_c, bias32, row_sums);
    }

    // bias gradients: the GELU one sums the output rows, BGRADA sums op(A) over k (length m), BGRADB sums
    // op(B) over k (length n); none of them is scaled by alpha
    int64_t nb = 0;
    if (e == CUBLASLT_EPILOGUE_DGELU_BGRAD) nb = m;
    if (e == CUBLASLT_EPILOGUE_BGRADA) { sum_lines(A32, lda32, m, k, ta, vec); nb = m; }
    if (e == CUBLASLT_EPILOGUE_BGRADB) { sum_lines(B32, ldb32, n, k, !tb, vec); nb = n; }
    for (int64_t i = 0; i < nb; i++) store(g->bias, g->bias_type, i, vec[i]);
    return CUBLAS_STATUS_SUCCESS;
}

// ----------------------------------------------------------------------------------------------------------
// Edge mode (CUCC_EDGE_BLOCKS=K, cpu/runtime.cpp; doc/backend.md "Edge mode"): every operand's whole extent is
// checked against the device allocations, then only the output's first and last 128*K rows times its first and
// last 128*K columns are computed (four corner blocks, with the inner dimension cut to its first 256*K terms), and
// of a batch only the first and last K matrices.
extern "C" int __cucc_edge_blocks(void);
extern "C" int __cucc_edge_range(const void* p, size_t bytes);
static const int64_t EDGE_ROWS_PER_K = 128;

// bytes spanned by a rows x cols column-major matrix with leading dimension ld
static size_t matrix_span(int64_t rows, int64_t cols, int64_t ld, size_t es) {
    return rows == 0 || cols == 0 ? 0 : (size_t)((cols - 1) * ld + rows) * es;
}
static void edge_operand(const char* what, const void* p, int64_t rows, int64_t cols, int64_t ld, size_t es) {
    size_t bytes = matrix_span(rows, cols, ld, es);
    if (p == NULL || bytes == 0) return;
    int r = __cucc_edge_range(p, bytes);
    if (r == 1) return;
    fprintf(stderr, "cucc: edge mode: cuBLAS operand %s (%lld x %lld, ld %lld, %zu bytes at %p) %s\n", what,
            (long long)rows, (long long)cols, (long long)ld, bytes, p,
            r == 0 ? "runs past the end of its device allocation" : "is not device memory");
    fflush(stderr);
    abort();
}
// 1 when batch b of count is skipped in edge mode
static int edge_skip_batch(int64_t b, int64_t count) {
    int64_t k = __cucc_edge_blocks();
    return k > 0 && count > 2 * k && b >= k && b < count - k;
}

static cublasStatus_t run_gemm(const Gemm* g) {
    int64_t k = __cucc_edge_blocks();
    if (k <= 0) return run_gemm_full(g);
    const int ta = g->transa != CUBLAS_OP_N, tb = g->transb != CUBLAS_OP_N;
    const uint32_t e = g->epilogue;
    size_t sa = type_size(g->Atype), sb = type_size(g->Btype), sd = type_size(g->Dtype);
    edge_operand("A", g->A, ta ? g->k : g->m, ta ? g->m : g->k, g->lda, sa);
    edge_operand("B", g->B, tb ? g->n : g->k, tb ? g->k : g->n, g->ldb, sb);
    if (g->beta != 0.0f) edge_operand("C", g->C, g->m, g->n, g->ldc, sd);
    edge_operand("D", g->D, g->m, g->n, g->ldd, sd);
    if (epi_uses_bias(e)) edge_operand("bias", g->bias, e == CUBLASLT_EPILOGUE_BGRADB ? g->n : g->m, 1, 1, type_size(g->bias_type));
    if (epi_uses_aux(e)) edge_operand("aux", g->aux, g->m, g->n, g->aux_ld, type_size(g->aux_type));
    const int64_t w = EDGE_ROWS_PER_K * k;
    int64_t r0[2] = {0, g->m - w}, rn[2] = {w, w}, c0[2] = {0, g->n - w}, cn[2] = {w, w};
    int nr = 2, nc = 2;
    if (g->m <= 2 * w) { rn[0] = g->m; nr = 1; }
    if (g->n <= 2 * w) { cn[0] = g->n; nc = 1; }
    for (int ri = 0; ri < nr; ri++) {
        for (int ci = 0; ci < nc; ci++) {
            Gemm s = *g;
            int64_t i0 = r0[ri], j0 = c0[ci];
            s.m = rn[ri];
            s.n = cn[ci];
            s.k = g->k < 2 * w ? g->k : 2 * w;  // the inner dimension cut to its first 256K terms
            s.A = (const char*)g->A + (ta ? i0 * g->lda : i0) * (int64_t)sa;
            s.B = (const char*)g->B + (tb ? j0 : j0 * g->ldb) * (int64_t)sb;
            if (g->C) s.C = (const char*)g->C + (i0 + j0 * g->ldc) * (int64_t)sd;
            s.D = (char*)g->D + (i0 + j0 * g->ldd) * (int64_t)sd;
            if (g->bias) s.bias = (char*)g->bias + (e == CUBLASLT_EPILOGUE_BGRADB ? j0 : i0) * (int64_t)type_size(g->bias_type);
            if (g->aux) s.aux = (char*)g->aux + (i0 + j0 * g->aux_ld) * (int64_t)type_size(g->aux_type);
            cublasStatus_t st = run_gemm_full(&s);
            if (st != CUBLAS_STATUS_SUCCESS) return st;
        }
    }
    return CUBLAS_STATUS_SUCCESS;
}

// ----------------------------------------------------------------------------------------------------------
// Argument checks shared by the cuBLAS entry points

struct cublasContext {
    cudaStream_t stream;
    void* workspace;
    size_t workspace_size;
    cublasMath_t math_mode;
    cublasPointerMode_t pointer_mode;
};

static int valid_op(cublasOperation_t op) {
    return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C;  // OP_C is OP_T for real data
}

// A/B must share a type; C is that type or fp32; the FAST compute types are defined for fp32 data only.
static cublasStatus_t check_types(int at, int bt, int ct, int compute) {
    if (!float_type(at) || !float_type(ct) || at != bt) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (ct != at && ct != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
    switch (compute) {
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
        return CUBLAS_STATUS_SUCCESS;
    case CUBLAS_COMPUTE_32F_FAST_TF32:
    case CUBLAS_COMPUTE_32F_FAST_16BF:
    case CUBLAS_COMPUTE_32F_FAST_16F:
        return at == CUDA_R_32F && ct == CUDA_R_32F ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
    default:
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
}

static cublasStatus_t check_shape(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
                                  int64_t lda, int64_t ldb, int64_t ldc) {
    if (!valid_op(ta) || !valid_op(tb) || m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
    int64_t a_rows = ta == CUBLAS_OP_N ? m : k, b_rows = tb == CUBLAS_OP_N ? k : n;
    if (lda < (a_rows > 1 ? a_rows : 1) || ldb < (b_rows > 1 ? b_rows : 1) || ldc < (m > 1 ? m : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    return CUBLAS_STATUS_SUCCESS;
}

static Gemm plain_gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha,
                       const void* A, cudaDataType_t at, int64_t lda, const void* B, cudaDataType_t bt, int64_t ldb,
                       float beta, void* C, cudaDataType_t ct, int64_t ldc) {
    Gemm g;
    memset(&g, 0, sizeof(g));
    g.transa = ta; g.transb = tb;
    g.m = m; g.n = n; g.k = k;
    g.alpha = alpha; g.beta = beta;
    g.A = A; g.Atype = at; g.lda = lda;
    g.B = B; g.Btype = bt; g.ldb = ldb;
    g.C = C; g.ldc = ldc;
    g.D = C; g.Dtype = ct; g.ldd = ldc;
    g.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    return g;
}

// ----------------------------------------------------------------------------------------------------------
// Checking mode (cpu/cucc --check; cpu/include/cucc_check.h). Every GEMM entry point is one operation on its
// stream that declares each operand as the GPU library accesses it: A and B read (as stored, before the
// transposition), C read only when beta != 0 (cuBLAS: "if beta == 0, C does not have to be a valid input"), D
// written, the bias vector read (or written, for the bias gradient epilogues), the GELU aux matrix written
// (GELU_AUX*) or read (DGELU*), alpha and beta read in device pointer mode, the workspace written, and the
// pointer arrays of the batched and grouped forms read from device memory (as the real library does) before
// any matrix they point to. Reads are declared before writes, so an in-place C == D reads C first. Each
// operand is first checked here against its allocation (a cublascheck report naming it and the bytes it
// needs), then declared through cucc_check_read_matrix/cucc_check_write_matrix (initcheck, streamcheck; and
// memcheck when cublascheck is turned off). Empty products (m == 0 or n == 0) touch nothing; alpha == 0 reads
// neither A nor B (the BLAS convention), except the matrix a BGRADA/BGRADB epilogue sums.
#ifdef CUCC_CHECK
#include "cucc_check.h"

#include <stdarg.h>
#include <stdio.h>

#include <string>
#include <vector>

typedef struct {
    const void* p;
    int64_t rows, cols, ld, batch, stride;  // stride in elements
    size_t elem;
    std::string what;
    int write;
} ChkOperand;

typedef struct {
    const char* fn;  // the entry point, for reports and as the operation's name
    cudaStream_t stream;
    int has_stream;  // 0 for the heuristic query, which runs nothing
    std::vector<ChkOperand> ops;
} ChkCall;

static const char* chk_type_name(int t) {
    switch (t) {
    case CUDA_R_32F: return "fp32";
    case CUDA_R_16BF: return "bf16";
    case CUDA_R_16F: return "fp16";
    case CUDA_R_64F: return "fp64";
    case CUDA_R_8I: return "int8";
    case CUDA_R_32I: return "int32";
    case CUDA_R_8F_E4M3: return "fp8 e4m3";
    case CUDA_R_8F_E5M2: return "fp8 e5m2";
    }
    return "another type";
}

// cublasSgemm and friends forward to the Ex forms; the name reports use is the one the program called
static thread_local const char* chk_name_override = NULL;
static const char* chk_name(const char* own) {
    const char* n = chk_name_override ? chk_name_override : own;
    chk_name_override = NULL;
    return n;
}

static int chk_on(void) { return cucc_check_on(CUCC_CHECK_CUBLAS); }

__attribute__((noreturn, format(printf, 2, 3))) static void chk_fail(const ChkCall* c, const char* fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (!c->has_stream) cucc_check_report(CUCC_CHECK_CUBLAS, "%s: %s", c->fn, msg);
    if (c->stream == 0) cucc_check_report(CUCC_CHECK_CUBLAS, "%s: %s, on the default stream", c->fn, msg);
    cucc_check_report(CUCC_CHECK_CUBLAS, "%s: %s, on stream %p", c->fn, msg, (void*)c->stream);
}

// "A (37 x 61 fp32, ld 40)", "bias (768 fp32)", "C (3 x 37 x 23 bf16, ld 39, stride 900)"
static std::string chk_describe(const ChkOperand* o, const char* tname) {
    char buf[200];
    if (o->cols == 1 && o->batch == 1)
        snprintf(buf, sizeof(buf), "%s (%lld %s)", o->what.c_str(), (long long)o->rows, tname);
    else if (o->batch == 1)
        snprintf(buf, sizeof(buf), "%s (%lld x %lld %s, ld %lld)", o->what.c_str(), (long long)o->rows,
                 (long long)o->cols, tname, (long long)o->ld);
    else
        snprintf(buf, sizeof(buf), "%s (%lld x %lld x %lld %s, ld %lld, stride %lld)", o->what.c_str(),
                 (long long)o->batch, (long long)o->rows, (long long)o->cols, tname, (long long)o->ld,
                 (long long)o->stride);
    return buf;
}

// Adds an operand and checks at once that all of its bytes lie in one live device allocation, so that a pointer
// array is known to be readable before its entries are. Matrix b is at p + b * stride elements, column j at
// + j * ld elements; the bytes it covers run from its lowest to its highest element.
static void chk_add(ChkCall* c, const void* p, int64_t rows, int64_t cols, int64_t ld, int type_or_bytes,
                    int64_t batch, int64_t stride, const std::string& what, int write) {
    if (rows <= 0 || cols <= 0 || batch <= 0) return;
    // type_or_bytes: a cudaDataType_t (elements of that type) or, negated, a raw element size in bytes
    size_t elem = type_or_bytes < 0 ? (size_t)-type_or_bytes : type_size((cudaDataType_t)type_or_bytes);
    const char* tname = type_or_bytes < 0 ? (type_or_bytes == -1 ? "bytes" : "pointers")
                                          : chk_type_name(type_or_bytes);
    ChkOperand o = {p, rows, cols, ld, batch, stride, elem, what, write};
    if (chk_on()) {
        __int128 lo = 0, hi = (__int128)(cols - 1) * ld + rows;  // elements, relative to p
        __int128 last = (__int128)(batch - 1) * stride;
        if (last < 0) lo += last; else hi += last;
        const char* start = (const char*)p + (int64_t)(lo * (__int128)elem);
        __int128 need = (hi - lo) * (__int128)elem;
        if (p == NULL) chk_fail(c, "%s is a null pointer", chk_describe(&o, tname).c_str());
        void* base = NULL;
        size_t size = cucc_check_allocation(start, &base);
        if (size == 0)
            chk_fail(c, "%s at %p is not in a live device allocation (host memory, or freed?)",
                     chk_describe(&o, tname).c_str(), (const void*)start);
        size_t left = size - (size_t)(start - (const char*)base);
        if (need > (__int128)left)
            chk_fail(c, "%s needs %llu bytes at %p but its allocation has %zu bytes left",
                     chk_describe(&o, tname).c_str(), (unsigned long long)need, (const void*)start, left);
    }
    c->ops.push_back(o);
}

// The operation: every read, then every write.
static void chk_run(ChkCall* c) {
    cucc_check_op_begin(c->stream, c->fn);
    for (int pass = 0; pass < 2; pass++)
        for (size_t i = 0; i < c->ops.size(); i++) {
            const ChkOperand* o = &c->ops[i];
            if (o->write != pass) continue;
            if (o->write)
                cucc_check_write_matrix((void*)o->p, o->rows, o->cols, o->ld, o->elem, o->batch, o->stride,
                                        o->what.c_str());
            else
                cucc_check_read_matrix(o->p, o->rows, o->cols, o->ld, o->elem, o->batch, o->stride, o->what.c_str());
        }
    cucc_check_op_end();
}

// The workspace: 256-byte aligned, as cuBLAS (cublasSetWorkspace) and cuBLASLt (cublasLtMatmul, parameter
// workspace) document it must be, and all `size` bytes in one allocation. The library may write any of them, but
// only the first 256 are declared written: enough for streamcheck to see two unordered operations on different
// streams sharing a workspace, without shadowing a 32 MiB workspace on every call.
static void chk_workspace(ChkCall* c, const void* ws, size_t size) {
    if (ws == NULL || size == 0) return;
    if (chk_on() && (uintptr_t)ws % 256 != 0)
        chk_fail(c, "workspace %p is not aligned to 256 bytes, which the cuBLAS documentation requires", ws);
    chk_add(c, ws, (int64_t)size, 1, (int64_t)size, -1, 1, 0, "workspace", 1);
    c->ops.back().rows = c->ops.back().ld = size < 256 ? (int64_t)size : 256;
}

// alpha and beta, fp32 scalars: device memory in device pointer mode (else host memory, not checked here)
static float chk_scalar(ChkCall* c, const void* p, int device, const char* what) {
    if (device) chk_add(c, p, 1, 1, 1, CUDA_R_32F, 1, 0, what, 0);
    else if (chk_on() && p && cucc_check_allocation(p, NULL))  // a GPU reads a host pointer here: a fault or garbage
        chk_fail(c, "%s %p is device memory, but the pointer mode is HOST (set CUBLAS_POINTER_MODE_DEVICE, or pass a "
                 "host scalar)", what, p);
    return *(const float*)p;
}

// One plain cuBLAS GEMM (C = alpha op(A) op(B) + beta C), batch of them at the given element strides.
static void chk_plain(ChkCall* c, const char* suffix, cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                      int64_t n, int64_t k, float alpha, float beta, const void* A, int at, int64_t lda, int64_t sa,
                      const void* B, int bt, int64_t ldb, int64_t sb, const void* C, int ct, int64_t ldc, int64_t sc,
                      int64_t batch) {
    if (m <= 0 || n <= 0) return;
    if (k > 0 && alpha != 0.0f) {
        chk_add(c, A, ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, lda, at, batch, sa,
                std::string("A") + suffix, 0);
        chk_add(c, B, tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, ldb, bt, batch, sb,
                std::string("B") + suffix, 0);
    }
    if (beta != 0.0f) chk_add(c, C, m, n, ldc, ct, batch, sc, std::string("C") + suffix, 0);
    chk_add(c, C, m, n, ldc, ct, batch, sc, std::string("C") + suffix, 1);
}

static void chk_start(ChkCall* c, const char* fn, cudaStream_t stream, int has_stream) {
    c->fn = fn;
    c->stream = stream;
    c->has_stream = has_stream;
}
#endif  // CUCC_CHECK

// ----------------------------------------------------------------------------------------------------------
// cuBLAS: handle

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
    if (handle == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    *handle = (cublasHandle_t)calloc(1, sizeof(struct cublasContext));
    if (*handle == NULL) return CUBLAS_STATUS_ALLOC_FAILED;
    (*handle)->math_mode = CUBLAS_DEFAULT_MATH;
    (*handle)->pointer_mode = CUBLAS_POINTER_MODE_HOST;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    free(handle);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->stream = stream;
#ifdef CUCC_CHECK
    // documented (cublasSetStream): "unconditionally resets the cuBLAS library workspace back to the default
    // workspace pool", so a workspace set before is no longer the one the GEMMs write
    handle->workspace = NULL;
    handle->workspace_size = 0;
#endif
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t* stream) {
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (stream == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    *stream = handle->stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t size) {
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
#ifdef CUCC_CHECK
    {  // documented: 256-byte aligned (else CUBLAS_STATUS_INVALID_VALUE), device memory of `size` bytes
        ChkCall c;
        chk_start(&c, "cublasSetWorkspace", handle->stream, 0);
        chk_workspace(&c, workspace, size);
    }
#endif
    handle->workspace = workspace;
    handle->workspace_size = size;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->math_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = handle->math_mode;
    return CUBLAS_STATUS_SUCCESS;
}

// Host and device pointer modes read alpha/beta the same way: device memory is host memory here.
cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE) return CUBLAS_STATUS_INVALID_VALUE;
    handle->pointer_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t* mode) {
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = handle->pointer_mode;
    return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t status) {
    switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasGetStatusString(cublasStatus_t status) {
    switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "the operation completed successfully";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR: return "error detected trying to check the license";
    }
    return "unknown error";
}

// ----------------------------------------------------------------------------------------------------------
// cuBLAS: GEMMs. alpha and beta are fp32 scalars for every compute type accepted here.

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
#ifdef CUCC_CHECK
    const char* fn = chk_name("cublasGemmEx");
#endif
    (void)algo;  // one algorithm here
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    cublasStatus_t st = check_shape(transa, transb, m, n, k, lda, ldb, ldc);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    st = check_types(Atype, Btype, Ctype, computeType);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
#ifdef CUCC_CHECK
    {
        ChkCall c;
        chk_start(&c, fn, handle->stream, 1);
        const int dev = handle->pointer_mode == CUBLAS_POINTER_MODE_DEVICE;
        float a = chk_scalar(&c, alpha, dev, "alpha"), b = chk_scalar(&c, beta, dev, "beta");
        chk_plain(&c, "", transa, transb, m, n, k, a, b, A, Atype, lda, 0, B, Btype, ldb, 0, C, Ctype, ldc, 0, 1);
        chk_workspace(&c, handle->workspace, handle->workspace_size);
        chk_run(&c);
    }
#endif
    Gemm g = plain_gemm(transa, transb, m, n, k, *(const float*)alpha, A, Atype, lda, B, Btype, ldb,
                        *(const float*)beta, C, Ctype, ldc);
    return run_gemm(&g);
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                              int k, const float* alpha, const float* A, int lda, const float* B, int ldb,
                              const float* beta, float* C, int ldc) {
#ifdef CUCC_CHECK
    chk_name_override = "cublasSgemm";
#endif
    return cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb, beta, C,
                        CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long int strideA, const void* B, cudaDataType Btype, int ldb,
                                          long long int strideB, const void* beta, void* C, cudaDataType Ctype,
                                          int ldc, long long int strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
#ifdef CUCC_CHECK
    const char* fn = chk_name("cublasGemmStridedBatchedEx");
#endif
    (void)algo;
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    cublasStatus_t st = check_shape(transa, transb, m, n, k, lda, ldb, ldc);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (batchCount < 0) return CUBLAS_STATUS_INVALID_VALUE;
    st = check_types(Atype, Btype, Ctype, computeType);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
#ifdef CUCC_CHECK
    {
        ChkCall c;
        chk_start(&c, fn, handle->stream, 1);
        const int dev = handle->pointer_mode == CUBLAS_POINTER_MODE_DEVICE;
        float a = chk_scalar(&c, alpha, dev, "alpha"), b = chk_scalar(&c, beta, dev, "beta");
        chk_plain(&c, "", transa, transb, m, n, k, a, b, A, Atype, lda, strideA, B, Btype, ldb, strideB, C, Ctype,
                  ldc, strideC, batchCount);
        chk_workspace(&c, handle->workspace, handle->workspace_size);
        chk_run(&c);
    }
#endif
    for (int b = 0; b < batchCount; b++) {
        if (edge_skip_batch(b, batchCount)) continue;
        Gemm g = plain_gemm(transa, transb, m, n, k, *(const float*)alpha,
                            (const char*)A + b * strideA * type_size(Atype), Atype, lda,
                            (const char*)B + b * strideB * type_size(Btype), Btype, ldb, *(const float*)beta,
                            (char*)C + b * strideC * type_size(Ctype), Ctype, ldc);
        st = run_gemm(&g);
        if (st != CUBLAS_STATUS_SUCCESS) return st;
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                         int m, int n, int k, const float* alpha, const float* A, int lda,
                                         long long int strideA, const float* B, int ldb, long long int strideB,
                                         const float* beta, float* C, int ldc, long long int strideC,
                                         int batchCount) {
#ifdef CUCC_CHECK
    chk_name_override = "cublasSgemmStridedBatched";
#endif
    return cublasGemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, strideA, B,
                                      CUDA_R_32F, ldb, strideB, beta, C, CUDA_R_32F, ldc, strideC, batchCount,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t cublasGemmBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m,
                                   int n, int k, const void* alpha, const void* const Aarray[], cudaDataType Atype,
                                   int lda, const void* const Barray[], cudaDataType Btype, int ldb, const void* beta,
                                   void* const Carray[], cudaDataType Ctype, int ldc, int batchCount,
                                   cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
#ifdef CUCC_CHECK
    const char* fn = chk_name("cublasGemmBatchedEx");
#endif
    (void)algo;
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    cublasStatus_t st = check_shape(transa, transb, m, n, k, lda, ldb, ldc);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (batchCount < 0) return CUBLAS_STATUS_INVALID_VALUE;
    st = check_types(Atype, Btype, Ctype, computeType);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
#ifdef CUCC_CHECK
    {
        // the pointer arrays are device memory, read before the matrices they point to
        ChkCall c;
        chk_start(&c, fn, handle->stream, 1);
        const int dev = handle->pointer_mode == CUBLAS_POINTER_MODE_DEVICE;
        float a = chk_scalar(&c, alpha, dev, "alpha"), b = chk_scalar(&c, beta, dev, "beta");
        const int ab = m > 0 && n > 0 && k > 0 && a != 0.0f, cc = m > 0 && n > 0;
        if (ab) {
            chk_add(&c, Aarray, batchCount, 1, batchCount, -(int)sizeof(void*), 1, 0, "Aarray", 0);
            chk_add(&c, Barray, batchCount, 1, batchCount, -(int)sizeof(void*), 1, 0, "Barray", 0);
        }
        if (cc) chk_add(&c, Carray, batchCount, 1, batchCount, -(int)sizeof(void*), 1, 0, "Carray", 0);
        for (int i = 0; i < batchCount && cc; i++) {
            char sfx[24];
            snprintf(sfx, sizeof(sfx), "[%d]", i);
            chk_plain(&c, sfx, transa, transb, m, n, k, a, b, ab ? Aarray[i] : NULL, Atype, lda, 0,
                      ab ? Barray[i] : NULL, Btype, ldb, 0, Carray[i], Ctype, ldc, 0, 1);
        }
        chk_workspace(&c, handle->workspace, handle->workspace_size);
        chk_run(&c);
    }
#endif
    for (int b = 0; b < batchCount; b++) {
        Gemm g = plain_gemm(transa, transb, m, n, k, *(const float*)alpha, Aarray[b], Atype, lda, Barray[b], Btype,
                            ldb, *(const float*)beta, Carray[b], Ctype, ldc);
        st = run_gemm(&g);
        if (st != CUBLAS_STATUS_SUCCESS) return st;
    }
    return CUBLAS_STATUS_SUCCESS;
}

// Groups of GEMMs: group g has its own shapes, transposes, alpha_array[g] and beta_array[g], and covers the next
// group_size[g] entries of the pointer arrays. Everything is checked before anything is computed.
cublasStatus_t cublasGemmGroupedBatchedEx(cublasHandle_t handle, const cublasOperation_t transa_array[],
                                          const cublasOperation_t transb_array[], const int m_array[],
                                          const int n_array[], const int k_array[], const void* alpha_array,
                                          const void* const Aarray[], cudaDataType_t Atype, const int lda_array[],
                                          const void* const Barray[], cudaDataType_t Btype, const int ldb_array[],
                                          const void* beta_array, void* const Carray[], cudaDataType_t Ctype,
                                          const int ldc_array[], int group_count, const int group_size[],
                                          cublasComputeType_t computeType) {
#ifdef CUCC_CHECK
    const char* fn = chk_name("cublasGemmGroupedBatchedEx");
#endif
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (group_count < 0) return CUBLAS_STATUS_INVALID_VALUE;
    for (int g = 0; g < group_count; g++) {
        if (group_size[g] < 0) return CUBLAS_STATUS_INVALID_VALUE;
        cublasStatus_t st = check_shape(transa_array[g], transb_array[g], m_array[g], n_array[g], k_array[g],
                                        lda_array[g], ldb_array[g], ldc_array[g]);
        if (st != CUBLAS_STATUS_SUCCESS) return st;
    }
    cublasStatus_t st = check_types(Atype, Btype, Ctype, computeType);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    const float* alphas = (const float*)alpha_array;
    const float* betas = (const float*)beta_array;
#ifdef CUCC_CHECK
    {
        // the shapes, alphas and betas are host arrays; the A, B and C pointer arrays device memory, each entry
        // read (before its matrix) when its GEMM needs that matrix
        ChkCall c;
        chk_start(&c, fn, handle->stream, 1);
        for (int g = 0, i = 0; g < group_count; g++) {
            const int64_t m = m_array[g], n = n_array[g], k = k_array[g];
            const int ab = m > 0 && n > 0 && k > 0 && alphas[g] != 0.0f, cc = m > 0 && n > 0;
            for (int j = 0; j < group_size[g]; j++, i++) {
                char sfx[24];
                snprintf(sfx, sizeof(sfx), "[%d]", i);
                if (ab) {
                    chk_add(&c, &Aarray[i], 1, 1, 1, -(int)sizeof(void*), 1, 0, std::string("Aarray") + sfx, 0);
                    chk_add(&c, &Barray[i], 1, 1, 1, -(int)sizeof(void*), 1, 0, std::string("Barray") + sfx, 0);
                }
                if (cc) chk_add(&c, &Carray[i], 1, 1, 1, -(int)sizeof(void*), 1, 0, std::string("Carray") + sfx, 0);
                if (cc)
                    chk_plain(&c, sfx, transa_array[g], transb_array[g], m, n, k, alphas[g], betas[g],
                              ab ? Aarray[i] : NULL, Atype, lda_array[g], 0, ab ? Barray[i] : NULL, Btype,
                              ldb_array[g], 0, Carray[i], Ctype, ldc_array[g], 0, 1);
            }
        }
        chk_workspace(&c, handle->workspace, handle->workspace_size);
        chk_run(&c);
    }
#endif
    int p = 0;
    for (int g = 0; g < group_count; g++) {
        for (int i = 0; i < group_size[g]; i++, p++) {
            Gemm gm = plain_gemm(transa_array[g], transb_array[g], m_array[g], n_array[g], k_array[g], alphas[g],
                                 Aarray[p], Atype, lda_array[g], Barray[p], Btype, ldb_array[g], betas[g], Carray[p],
                                 Ctype, ldc_array[g]);
            st = run_gemm(&gm);
            if (st != CUBLAS_STATUS_SUCCESS) return st;
        }
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemmGroupedBatched(cublasHandle_t handle, const cublasOperation_t transa_array[],
                                         const cublasOperation_t transb_array[], const int m_array[],
                                         const int n_array[], const int k_array[], const float alpha_array[],
                                         const float* const Aarray[], const int lda_array[],
                                         const float* const Barray[], const int ldb_array[],
                                         const float beta_array[], float* const Carray[], const int ldc_array[],
                                         int group_count, const int group_size[]) {
#ifdef CUCC_CHECK
    chk_name_override = "cublasSgemmGroupedBatched";
#endif
    return cublasGemmGroupedBatchedEx(handle, transa_array, transb_array, m_array, n_array, k_array, alpha_array,
                                      (const void* const*)Aarray, CUDA_R_32F, lda_array, (const void* const*)Barray,
                                      CUDA_R_32F, ldb_array, beta_array, (void* const*)Carray, CUDA_R_32F, ldc_array,
                                      group_count, group_size, CUBLAS_COMPUTE_32F);
}

// ----------------------------------------------------------------------------------------------------------
// cuBLASLt: descriptors. Each descriptor is one of our structs stored inside the toolkit's semi-opaque type (so the
// toolkit's inline *Init helpers work on stack storage too); attributes are read and written through a table of
// (attribute, offset, size), with the exact-size rule the toolkit documents.

typedef struct {
    int attr;
    size_t offset, size;
} AttrField;

static const AttrField* find_field(const AttrField* t, int n, int attr) {
    for (int i = 0; i < n; i++) if (t[i].attr == attr) return &t[i];
    return NULL;
}

static cublasStatus_t attr_set(void* obj, const AttrField* t, int n, int attr, const void* buf, size_t size) {
    const AttrField* f = find_field(t, n, attr);
    if (obj == NULL || f == NULL || buf == NULL || size != f->size) return CUBLAS_STATUS_INVALID_VALUE;
    memcpy((char*)obj + f->offset, buf, size);
    return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t attr_get(const void* obj, const AttrField* t, int n, int attr, void* buf, size_t size,
                               size_t* written) {
    const AttrField* f = find_field(t, n, attr);
    if (obj == NULL || f == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    if (size == 0) {
        if (written == NULL) return CUBLAS_STATUS_INVALID_VALUE;
        *written = f->size;
        return CUBLAS_STATUS_SUCCESS;
    }
    if (buf == NULL || size != f->size) return CUBLAS_STATUS_INVALID_VALUE;
    memcpy(buf, (const char*)obj + f->offset, size);
    if (written) *written = size;
    return CUBLAS_STATUS_SUCCESS;
}

#define FIELD(attr, type, member) {attr, offsetof(type, member), sizeof(((type*)0)->member)}
#define NFIELDS(t) ((int)(sizeof(t) / sizeof(t[0])))

struct cublasLtContext {
    int unused;
};

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
    if (handle == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    *handle = (cublasLtHandle_t)calloc(1, sizeof(struct cublasLtContext));
    return *handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    free(handle);
    return CUBLAS_STATUS_SUCCESS;
}

const char* cublasLtGetStatusName(cublasStatus_t status) { return cublasGetStatusName(status); }
const char* cublasLtGetStatusString(cublasStatus_t status) { return cublasGetStatusString(status); }

// Matrix layout

typedef struct {
    uint64_t rows, cols;
    int64_t ld, batch_stride, plane_offset;
    uint32_t type;
    int32_t order, batch_count;
    uint32_t batch_mode;
} Layout;
static_assert(sizeof(Layout) <= sizeof(cublasLtMatrixLayoutOpaque_t), "Layout must fit the toolkit's storage");

static const AttrField layout_fields[] = {
    FIELD(CUBLASLT_MATRIX_LAYOUT_TYPE, Layout, type),
    FIELD(CUBLASLT_MATRIX_LAYOUT_ORDER, Layout, order),
    FIELD(CUBLASLT_MATRIX_LAYOUT_ROWS, Layout, rows),
    FIELD(CUBLASLT_MATRIX_LAYOUT_COLS, Layout, cols),
    FIELD(CUBLASLT_MATRIX_LAYOUT_LD, Layout, ld),
    FIELD(CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, Layout, batch_count),
    FIELD(CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, Layout, batch_stride),
    FIELD(CUBLASLT_MATRIX_LAYOUT_PLANE_OFFSET, Layout, plane_offset),
    FIELD(CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, Layout, batch_mode),
};

cublasStatus_t cublasLtMatrixLayoutInit_internal(cublasLtMatrixLayout_t layout, size_t size, cudaDataType type,
                                                 uint64_t rows, uint64_t cols, int64_t ld) {
    if (layout == NULL || size < sizeof(Layout)) return CUBLAS_STATUS_ALLOC_FAILED;
    Layout* l = (Layout*)layout;
    memset(l, 0, sizeof(*l));
    l->type = type;
    l->order = CUBLASLT_ORDER_COL;
    l->rows = rows;
    l->cols = cols;
    l->ld = ld;
    l->batch_count = 1;
    l->batch_mode = CUBLASLT_BATCH_MODE_STRIDED;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
    if (layout == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    *layout = (cublasLtMatrixLayout_t)malloc(sizeof(cublasLtMatrixLayoutOpaque_t));
    if (*layout == NULL) return CUBLAS_STATUS_ALLOC_FAILED;
    return cublasLtMatrixLayoutInit_internal(*layout, sizeof(cublasLtMatrixLayoutOpaque_t), type, rows, cols, ld);
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
    free(layout);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t size) {
    return attr_set(layout, layout_fields, NFIELDS(layout_fields), attr, buf, size);
}

cublasStatus_t cublasLtMatrixLayoutGetAttribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                                                void* buf, size_t size, size_t* written) {
    return attr_get(layout, layout_fields, NFIELDS(layout_fields), attr, buf, size, written);
}

// Matmul descriptor. Every documented attribute can be set and read back; the ones this backend does not model
// (fp8 scaling, amax, emulation, vector alpha) make the matmul NOT_SUPPORTED when given non-default values.

typedef struct {
    int32_t compute_type, scale_type, pointer_mode, transa, transb, transc, fill_mode;
    uint32_t epilogue;
    const void* bias;
    int64_t bias_batch_stride;
    int32_t bias_type, aux_type;
    void* aux;
    int64_t aux_ld, aux_batch_stride, alpha_vector_batch_stride;
    int32_t sm_count_target;
    int8_t fast_accum;
    const void *a_scale, *b_scale, *c_scale, *d_scale;
    void *amax_d, *aux_scale, *aux_amax, *d_out_scale, *emulation;
    int32_t a_scale_mode, b_scale_mode, c_scale_mode, d_scale_mode, aux_scale_mode, d_out_scale_mode;
} MatmulDesc;
static_assert(sizeof(MatmulDesc) <= sizeof(cublasLtMatmulDescOpaque_t), "MatmulDesc must fit the toolkit's storage");

static const AttrField desc_fields[] = {
    FIELD(CUBLASLT_MATMUL_DESC_COMPUTE_TYPE, MatmulDesc, compute_type),
    FIELD(CUBLASLT_MATMUL_DESC_SCALE_TYPE, MatmulDesc, scale_type),
    FIELD(CUBLASLT_MATMUL_DESC_POINTER_MODE, MatmulDesc, pointer_mode),
    FIELD(CUBLASLT_MATMUL_DESC_TRANSA, MatmulDesc, transa),
    FIELD(CUBLASLT_MATMUL_DESC_TRANSB, MatmulDesc, transb),
    FIELD(CUBLASLT_MATMUL_DESC_TRANSC, MatmulDesc, transc),
    FIELD(CUBLASLT_MATMUL_DESC_FILL_MODE, MatmulDesc, fill_mode),
    FIELD(CUBLASLT_MATMUL_DESC_EPILOGUE, MatmulDesc, epilogue),
    FIELD(CUBLASLT_MATMUL_DESC_BIAS_POINTER, MatmulDesc, bias),
    FIELD(CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, MatmulDesc, bias_batch_stride),
    FIELD(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, MatmulDesc, aux),
    FIELD(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, MatmulDesc, aux_ld),
    FIELD(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, MatmulDesc, aux_batch_stride),
    FIELD(CUBLASLT_MATMUL_DESC_ALPHA_VECTOR_BATCH_STRIDE, MatmulDesc, alpha_vector_batch_stride),
    FIELD(CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, MatmulDesc, sm_count_target),
    FIELD(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, MatmulDesc, a_scale),
    FIELD(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, MatmulDesc, b_scale),
    FIELD(CUBLASLT_MATMUL_DESC_C_SCALE_POINTER, MatmulDesc, c_scale),
    FIELD(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, MatmulDesc, d_scale),
    FIELD(CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, MatmulDesc, amax_d),
    FIELD(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, MatmulDesc, aux_type),
    FIELD(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_SCALE_POINTER, MatmulDesc, aux_scale),
    FIELD(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_AMAX_POINTER, MatmulDesc, aux_amax),
    FIELD(CUBLASLT_MATMUL_DESC_FAST_ACCUM, MatmulDesc, fast_accum),
    FIELD(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, MatmulDesc, bias_type),
    FIELD(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, MatmulDesc, a_scale_mode),
    FIELD(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, MatmulDesc, b_scale_mode),
    FIELD(CUBLASLT_MATMUL_DESC_C_SCALE_MODE, MatmulDesc, c_scale_mode),
    FIELD(CUBLASLT_MATMUL_DESC_D_SCALE_MODE, MatmulDesc, d_scale_mode),
    FIELD(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_SCALE_MODE, MatmulDesc, aux_scale_mode),
    FIELD(CUBLASLT_MATMUL_DESC_D_OUT_SCALE_POINTER, MatmulDesc, d_out_scale),
    FIELD(CUBLASLT_MATMUL_DESC_D_OUT_SCALE_MODE, MatmulDesc, d_out_scale_mode),
    FIELD(CUBLASLT_MATMUL_DESC_EMULATION_DESCRIPTOR, MatmulDesc, emulation),
};

cublasStatus_t cublasLtMatmulDescInit_internal(cublasLtMatmulDesc_t desc, size_t size, cublasComputeType_t compute,
                                               cudaDataType_t scale) {
    if (desc == NULL || size < sizeof(MatmulDesc)) return CUBLAS_STATUS_ALLOC_FAILED;
    MatmulDesc* d = (MatmulDesc*)desc;
    memset(d, 0, sizeof(*d));
    d->compute_type = compute;
    d->scale_type = scale;
    d->pointer_mode = CUBLASLT_POINTER_MODE_HOST;
    d->transa = d->transb = d->transc = CUBLAS_OP_N;
    d->fill_mode = CUBLAS_FILL_MODE_FULL;
    d->epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    d->bias_type = d->aux_type = -1;  // -1: the type of D
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
    if (desc == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    *desc = (cublasLtMatmulDesc_t)malloc(sizeof(cublasLtMatmulDescOpaque_t));
    if (*desc == NULL) return CUBLAS_STATUS_ALLOC_FAILED;
    return cublasLtMatmulDescInit_internal(*desc, sizeof(cublasLtMatmulDescOpaque_t), compute, scale);
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
    free(desc);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
    return attr_set(desc, desc_fields, NFIELDS(desc_fields), attr, buf, size);
}

cublasStatus_t cublasLtMatmulDescGetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              void* buf, size_t size, size_t* written) {
    return attr_get(desc, desc_fields, NFIELDS(desc_fields), attr, buf, size, written);
}

// Heuristic preference: stored so it can be read back; there is only one algorithm to choose.

typedef struct {
    uint64_t max_workspace, impl_mask;
    uint32_t search_mode, reduction_mask, align_a, align_b, align_c, align_d;
    float max_waves;
} Preference;
static_assert(sizeof(Preference) <= sizeof(cublasLtMatmulPreferenceOpaque_t), "Preference must fit");

static const AttrField pref_fields[] = {
    FIELD(CUBLASLT_MATMUL_PREF_SEARCH_MODE, Preference, search_mode),
    FIELD(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, Preference, max_workspace),
    FIELD(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, Preference, reduction_mask),
    FIELD(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, Preference, align_a),
    FIELD(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, Preference, align_b),
    FIELD(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, Preference, align_c),
    FIELD(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, Preference, align_d),
    FIELD(CUBLASLT_MATMUL_PREF_MAX_WAVES_COUNT, Preference, max_waves),
    FIELD(CUBLASLT_MATMUL_PREF_IMPL_MASK, Preference, impl_mask),
};

cublasStatus_t cublasLtMatmulPreferenceInit_internal(cublasLtMatmulPreference_t pref, size_t size) {
    if (pref == NULL || size < sizeof(Preference)) return CUBLAS_STATUS_ALLOC_FAILED;
    Preference* p = (Preference*)pref;
    memset(p, 0, sizeof(*p));
    p->search_mode = CUBLASLT_SEARCH_BEST_FIT;
    p->reduction_mask = CUBLASLT_REDUCTION_SCHEME_MASK;
    p->align_a = p->align_b = p->align_c = p->align_d = 256;
    p->impl_mask = ~(uint64_t)0;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
    if (pref == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    *pref = (cublasLtMatmulPreference_t)malloc(sizeof(cublasLtMatmulPreferenceOpaque_t));
    if (*pref == NULL) return CUBLAS_STATUS_ALLOC_FAILED;
    return cublasLtMatmulPreferenceInit_internal(*pref, sizeof(cublasLtMatmulPreferenceOpaque_t));
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
    free(pref);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t size) {
    return attr_set(pref, pref_fields, NFIELDS(pref_fields), attr, buf, size);
}

cublasStatus_t cublasLtMatmulPreferenceGetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, void* buf,
                                                    size_t size, size_t* written) {
    return attr_get(pref, pref_fields, NFIELDS(pref_fields), attr, buf, size, written);
}

} // extern "C"

// ----------------------------------------------------------------------------------------------------------
// cuBLASLt: checking a matmul configuration. The heuristic query and the matmul run the same checks, so a
// configuration this backend cannot compute is refused at the heuristic already, as the GPU library does.

typedef struct {
    Gemm g;  // everything but the pointers and alpha/beta
    int batch;
    int64_t stride_a, stride_b, stride_c, stride_d, stride_bias, stride_aux;  // in elements of each type
} LtPlan;

static cublasStatus_t check_layout(const Layout* l) {
    if (l->order != CUBLASLT_ORDER_COL || l->plane_offset != 0 || l->batch_mode != CUBLASLT_BATCH_MODE_STRIDED)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (l->rows > INT32_MAX || l->cols > INT32_MAX || l->ld < (int64_t)(l->rows > 1 ? l->rows : 1) ||
        l->batch_count < 1)
        return CUBLAS_STATUS_INVALID_VALUE;
    return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t lt_plan(const MatmulDesc* d, const Layout* a, const Layout* b, const Layout* c,
                              const Layout* dl, LtPlan* p) {
    if (d == NULL || a == NULL || b == NULL || dl == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    if (c == NULL) c = dl;  // C is optional when beta == 0
    const Layout* ls[4] = {a, b, c, dl};
    for (int i = 0; i < 4; i++) {
        cublasStatus_t st = check_layout(ls[i]);
        if (st != CUBLAS_STATUS_SUCCESS) return st;
    }
    // what this backend does not model
    if (d->scale_type != CUDA_R_32F || d->transc != CUBLAS_OP_N || d->fill_mode != CUBLAS_FILL_MODE_FULL ||
        (d->pointer_mode != CUBLASLT_POINTER_MODE_HOST && d->pointer_mode != CUBLASLT_POINTER_MODE_DEVICE) ||
        d->a_scale || d->b_scale || d->c_scale || d->d_scale || d->amax_d || d->aux_scale || d->aux_amax ||
        d->d_out_scale || d->emulation || d->a_scale_mode || d->b_scale_mode || d->c_scale_mode ||
        d->d_scale_mode || d->aux_scale_mode || d->d_out_scale_mode || !epi_supported(d->epilogue))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    cublasOperation_t ta = (cublasOperation_t)d->transa, tb = (cublasOperation_t)d->transb;
    if (!valid_op(ta) || !valid_op(tb)) return CUBLAS_STATUS_INVALID_VALUE;
    cublasStatus_t st = check_types(a->type, b->type, dl->type, d->compute_type);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (c->type != dl->type) return CUBLAS_STATUS_NOT_SUPPORTED;

    // shapes: D is m x n, op(A) m x k, op(B) k x n, C like D; all batch counts equal
    int64_t m = dl->rows, n = dl->cols;
    int64_t k = ta == CUBLAS_OP_N ? a->cols : a->rows;
    int64_t am = ta == CUBLAS_OP_N ? a->rows : a->cols;
    int64_t bk = tb == CUBLAS_OP_N ? b->rows : b->cols, bn = tb == CUBLAS_OP_N ? b->cols : b->rows;
    if (am != m || bk != k || bn != n || (int64_t)c->rows != m || (int64_t)c->cols != n)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (a->batch_count != dl->batch_count || b->batch_count != dl->batch_count || c->batch_count != dl->batch_count)
        return CUBLAS_STATUS_INVALID_VALUE;

    // epilogue operands: bias and aux default to D's type
    uint32_t e = d->epilogue;
    cudaDataType_t bias_type = (cudaDataType_t)(d->bias_type == -1 ? (int)dl->type : d->bias_type);
    cudaDataType_t aux_type = (cudaDataType_t)(d->aux_type == -1 ? (int)dl->type : d->aux_type);
    if (epi_uses_bias(e) && !float_type(bias_type)) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (epi_uses_aux(e)) {
        if (!float_type(aux_type)) return CUBLAS_STATUS_NOT_SUPPORTED;
        if (d->aux_ld < m || d->aux_ld % 8 != 0) return CUBLAS_STATUS_INVALID_VALUE;  // documented: >= rows, % 8
    }

    Gemm* g = &p->g;
    memset(p, 0, sizeof(*p));
    g->transa = ta; g->transb = tb;
    g->m = m; g->n = n; g->k = k;
    g->Atype = (cudaDataType_t)a->type; g->lda = a->ld;
    g->Btype = (cudaDataType_t)b->type; g->ldb = b->ld;
    g->ldc = c->ld;
    g->Dtype = (cudaDataType_t)dl->type; g->ldd = dl->ld;
    g->epilogue = e;
    g->bias_type = bias_type;
    g->aux_type = aux_type; g->aux_ld = d->aux_ld;
    p->batch = dl->batch_count;
    p->stride_a = a->batch_stride; p->stride_b = b->batch_stride;
    p->stride_c = c->batch_stride; p->stride_d = dl->batch_stride;
    p->stride_bias = d->bias_batch_stride; p->stride_aux = d->aux_batch_stride;
    return CUBLAS_STATUS_SUCCESS;
}

#ifdef CUCC_CHECK
// Checking mode: the configuration rules cuBLASLt documents, enforced at the heuristic query and at the matmul
// (a GPU refuses these; this backend would otherwise compute some of them):
//  - the epilogue is a cublasLtEpilogue_t value (cublasLt.h);
//  - no epilogue for integer or complex A/B ("Epilogue is not supported", cublasLtMatmul, datatypes supported);
//  - for regular (fp64/fp32/fp16/bf16) data the bias, and the bias gradient, have D's type: the "Bias Type" column
//    of that table (bf16 C/D: bf16 bias, fp16: fp16, fp32: fp32) and CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE ("same
//    type as the elements of output matrix (Dtype)", exceptions only for IMMA and fp8 kernels), and
//    CUBLASLT_MATMUL_DESC_BIAS_POINTER (bias gradient: "the same type as the output elements");
//  - the GELU aux matrix has D's type (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE: exceptions only for fp8);
//  - CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: GELU aux "must be divisible by 8 and be no less than the number of
//    rows in the output matrix", ReLU bit-mask divisible by 128 and no less than the rows;
//    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE: divisible by 8 (GELU) or 128 (ReLU);
//  - the workspace is 256-byte aligned (cublasLtMatmul, parameter workspace) - checked with the operands.
static const char* lt_epi_name(uint32_t e) {
    switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT: return "DEFAULT";
    case CUBLASLT_EPILOGUE_RELU: return "RELU";
    case CUBLASLT_EPILOGUE_RELU_AUX: return "RELU_AUX";
    case CUBLASLT_EPILOGUE_BIAS: return "BIAS";
    case CUBLASLT_EPILOGUE_RELU_BIAS: return "RELU_BIAS";
    case CUBLASLT_EPILOGUE_RELU_AUX_BIAS: return "RELU_AUX_BIAS";
    case CUBLASLT_EPILOGUE_DRELU: return "DRELU";
    case CUBLASLT_EPILOGUE_DRELU_BGRAD: return "DRELU_BGRAD";
    case CUBLASLT_EPILOGUE_GELU: return "GELU";
    case CUBLASLT_EPILOGUE_GELU_AUX: return "GELU_AUX";
    case CUBLASLT_EPILOGUE_GELU_BIAS: return "GELU_BIAS";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return "GELU_AUX_BIAS";
    case CUBLASLT_EPILOGUE_DGELU: return "DGELU";
    case CUBLASLT_EPILOGUE_DGELU_BGRAD: return "DGELU_BGRAD";
    case CUBLASLT_EPILOGUE_BGRADA: return "BGRADA";
    case CUBLASLT_EPILOGUE_BGRADB: return "BGRADB";
    }
    return NULL;
}

static void lt_check_rules(ChkCall* c, const MatmulDesc* d, const Layout* a, const Layout* dl) {
    if (!chk_on() || d == NULL || a == NULL || dl == NULL) return;
    const uint32_t e = d->epilogue;
    const char* en = lt_epi_name(e);
    if (en == NULL) chk_fail(c, "epilogue %u is not a cublasLtEpilogue_t value", e);
    if (e == CUBLASLT_EPILOGUE_DEFAULT) return;
    const int at = (int)a->type, dt = (int)dl->type;
    if (at == CUDA_R_8I || at == CUDA_C_8I || at == CUDA_C_32F || at == CUDA_C_64F || at == CUDA_C_16F ||
        at == CUDA_C_16BF)
        chk_fail(c, "epilogue %s with %s A/B: cuBLASLt documents no epilogue for integer or complex data "
                 "(cublasLtMatmul, datatypes supported)", en, chk_type_name(at));
    const int relu_aux = e == CUBLASLT_EPILOGUE_RELU_AUX || e == CUBLASLT_EPILOGUE_RELU_AUX_BIAS ||
                         e == CUBLASLT_EPILOGUE_DRELU || e == CUBLASLT_EPILOGUE_DRELU_BGRAD;
    const int gelu_aux = epi_uses_aux(e);
    const int bias = epi_uses_bias(e) || e == CUBLASLT_EPILOGUE_RELU_BIAS || e == CUBLASLT_EPILOGUE_RELU_AUX_BIAS ||
                     e == CUBLASLT_EPILOGUE_DRELU_BGRAD;
    const int regular = at == CUDA_R_32F || at == CUDA_R_16F || at == CUDA_R_16BF || at == CUDA_R_64F;
    if (regular && bias && d->bias_type != -1 && d->bias_type != dt)
        chk_fail(c, "epilogue %s: bias data type %s with %s D; for %s A/B cuBLASLt documents the bias%s type as "
                 "D's type (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE; cublasLtMatmul, datatypes supported, Bias Type)",
                 en, chk_type_name(d->bias_type), chk_type_name(dt), chk_type_name(at),
                 epi_adds_bias(e) ? "" : " gradient");
    if (regular && gelu_aux && d->aux_type != -1 && d->aux_type != dt)
        chk_fail(c, "epilogue %s: aux data type %s with %s D; cuBLASLt documents the GELU input matrix as D's "
                 "type except for fp8 kernels (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE)",
                 en, chk_type_name(d->aux_type), chk_type_name(dt));
    if (gelu_aux || relu_aux) {
        const int64_t q = gelu_aux ? 8 : 128, rows = (int64_t)dl->rows;
        if (d->aux_ld < rows || d->aux_ld % q != 0)
            chk_fail(c, "epilogue %s: aux leading dimension %lld must be a multiple of %lld and at least D's %lld "
                     "rows (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD)", en, (long long)d->aux_ld, (long long)q,
                     (long long)rows);
        if (dl->batch_count > 1 && d->aux_batch_stride % q != 0)
            chk_fail(c, "epilogue %s: aux batch stride %lld must be a multiple of %lld "
                     "(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE)", en, (long long)d->aux_batch_stride,
                     (long long)q);
    }
}

// The operands of one cublasLtMatmul (batch p->batch, each at its own stride), as the GPU library accesses them.
static void lt_check_operands(ChkCall* c, const LtPlan* p, const Gemm* g, const Layout* a, const Layout* b,
                              const void* A, const void* B, const void* C, void* D, const void* bias, void* aux,
                              void* workspace, size_t workspace_size) {
    const int64_t m = g->m, n = g->n, k = g->k, batch = p->batch;
    const uint32_t e = g->epilogue;
    if (m > 0 && n > 0) {
        if (k > 0 && (g->alpha != 0.0f || e == CUBLASLT_EPILOGUE_BGRADA))
            chk_add(c, A, (int64_t)a->rows, (int64_t)a->cols, a->ld, (int)a->type, batch, p->stride_a, "A", 0);
        if (k > 0 && (g->alpha != 0.0f || e == CUBLASLT_EPILOGUE_BGRADB))
            chk_add(c, B, (int64_t)b->rows, (int64_t)b->cols, b->ld, (int)b->type, batch, p->stride_b, "B", 0);
        if (g->beta != 0.0f) chk_add(c, C, m, n, g->ldc, g->Dtype, batch, p->stride_c, "C", 0);
        if (epi_adds_bias(e)) chk_add(c, bias, m, 1, m, g->bias_type, batch, p->stride_bias, "bias", 0);
        if (epi_dgelu(e)) chk_add(c, aux, m, n, g->aux_ld, g->aux_type, batch, p->stride_aux, "aux", 0);
        chk_add(c, D, m, n, g->ldd, g->Dtype, batch, p->stride_d, "D", 1);
        if (epi_writes_aux(e)) chk_add(c, aux, m, n, g->aux_ld, g->aux_type, batch, p->stride_aux, "aux", 1);
        if (e == CUBLASLT_EPILOGUE_DGELU_BGRAD || e == CUBLASLT_EPILOGUE_BGRADA)
            chk_add(c, bias, m, 1, m, g->bias_type, batch, p->stride_bias, "bias gradient", 1);
        if (e == CUBLASLT_EPILOGUE_BGRADB)
            chk_add(c, bias, n, 1, n, g->bias_type, batch, p->stride_bias, "bias gradient", 1);
    }
    chk_workspace(c, workspace, workspace_size);
}
#endif  // CUCC_CHECK

extern "C" {

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* returned) {
    (void)pref;
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (requested <= 0 || results == NULL || returned == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    *returned = 0;
#ifdef CUCC_CHECK
    {
        ChkCall c;
        chk_start(&c, "cublasLtMatmulAlgoGetHeuristic", 0, 0);
        lt_check_rules(&c, (const MatmulDesc*)desc, (const Layout*)Adesc, (const Layout*)Ddesc);
    }
#endif
    LtPlan p;
    cublasStatus_t st = lt_plan((const MatmulDesc*)desc, (const Layout*)Adesc, (const Layout*)Bdesc,
                                (const Layout*)Cdesc, (const Layout*)Ddesc, &p);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    memset(&results[0], 0, sizeof(results[0]));
    results[0].workspaceSize = 0;
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    *returned = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspace_size, cudaStream_t stream) {
    (void)algo; (void)workspace; (void)workspace_size; (void)stream;  // one algorithm, no workspace, synchronous
    if (handle == NULL) return CUBLAS_STATUS_NOT_INITIALIZED;
    LtPlan p;
    const MatmulDesc* d = (const MatmulDesc*)desc;
#ifdef CUCC_CHECK
    ChkCall cc;
    chk_start(&cc, "cublasLtMatmul", stream, 1);
    lt_check_rules(&cc, d, (const Layout*)Adesc, (const Layout*)Ddesc);
#endif
    cublasStatus_t st = lt_plan(d, (const Layout*)Adesc, (const Layout*)Bdesc, (const Layout*)Cdesc,
                                (const Layout*)Ddesc, &p);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (alpha == NULL || beta == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    Gemm g = p.g;
#ifdef CUCC_CHECK
    const int dev_scalars = d->pointer_mode == CUBLASLT_POINTER_MODE_DEVICE;  // checked before they are read
    g.alpha = chk_scalar(&cc, alpha, dev_scalars, "alpha");
    g.beta = chk_scalar(&cc, beta, dev_scalars, "beta");
#else
    g.alpha = *(const float*)alpha;
    g.beta = *(const float*)beta;
#endif
    if (g.beta != 0.0f && C == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    if (C == D && g.ldc != g.ldd) return CUBLAS_STATUS_INVALID_VALUE;  // in place needs one layout
    if (epi_uses_bias(g.epilogue) && d->bias == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    if (epi_uses_aux(g.epilogue) && d->aux == NULL) return CUBLAS_STATUS_INVALID_VALUE;
#ifdef CUCC_CHECK
    lt_check_operands(&cc, &p, &g, (const Layout*)Adesc, (const Layout*)Bdesc, A, B, C, D, d->bias, d->aux,
                      workspace, workspace_size);
    chk_run(&cc);
#endif
    size_t sa = type_size(g.Atype), sb = type_size(g.Btype), sd = type_size(g.Dtype);
    for (int b = 0; b < p.batch; b++) {
        if (edge_skip_batch(b, p.batch)) continue;
        g.A = (const char*)A + b * p.stride_a * sa;
        g.B = (const char*)B + b * p.stride_b * sb;
        g.C = C ? (const char*)C + b * p.stride_c * sd : NULL;
        g.D = (char*)D + b * p.stride_d * sd;
        g.bias = d->bias ? (char*)d->bias + b * p.stride_bias * type_size(g.bias_type) : NULL;
        g.aux = d->aux ? (char*)d->aux + b * p.stride_aux * type_size(g.aux_type) : NULL;
        st = run_gemm(&g);
        if (st != CUBLAS_STATUS_SUCCESS) return st;
    }
    return CUBLAS_STATUS_SUCCESS;
}

} // extern "C"
