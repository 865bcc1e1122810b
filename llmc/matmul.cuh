// llmc/matmul.cuh: the Linear layers of GPT-2: forward and backward GEMMs through cuBLASLt, with the bias
// and the tanh-GELU fused into cuBLASLt's epilogue (or, with gelu_fusion off, llmc/gelu.cuh's kernels), and
// a deterministic bias-gradient reduction. Weights are in PyTorch Linear layout (OC, C).
// The strided cuBLASLt call and the bias-gradient kernels here are also what llmc/expert_matmul.cuh (the MoE
// experts' batched and grouped GEMMs) and llmc/router_matmul.cuh (the router's fp32 GEMMs) build on.
// Included by the trainers; needs cublas_setup() first and links with -lcublas -lcublasLt (nvcc or
// cpu/cucc). Lab files: dev/cuda/matmul_forward.cu and dev/cuda/matmul_backward_bias.cu.
//
// Size rules (checked on every call, refused with one line): C and OC multiples of 8, all pointers 16-byte
// aligned, because the bias and GELU kernels move whole 16-byte vectors of a row and cuBLASLt's auxiliary
// GELU buffer needs a leading dimension that is a multiple of 8.
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-matmul_forward_{bf16,fp32},
// lab-matmul_backward_bias_{bf16,fp32} and their lab-check- twins; gpt-*, llama-* and moe-*.
#pragma once
#include <limits.h>
#include <algorithm>
#include "common.cuh"
#include "cublas_common.cuh"
#include "gelu.cuh"

// Rows of dout summed by one block of the bias-gradient kernel are spread over at most this many blocks
// along the rows; each writes one fp32 partial row, so the scratch is this many rows of OC floats.
#define MATMUL_BIAS_MAX_ROW_BLOCKS 64
#define MATMUL_BIAS_WARPS 8

// ----------------------------------------------------------------------------------------------------
// The model sizes the Linear layers support (a model's C, 3C and 4C are their channel counts); false with a
// one-line reason otherwise. Called by the trainers at start-up; every call also checks its own sizes.
bool matmul_support(int C, char* why, size_t why_size) {
    if (C < 1 || C % 8 != 0) {
        snprintf(why, why_size, "channels C=%d must be a multiple of 8 (matmul kernels move 16-byte vectors)", C);
        return false;
    }
    return true;
}

// ----------------------------------------------------------------------------------------------------
// Which rows of dout (., OC) the bias-gradient kernels sum for batch z (blockIdx.z in pass 1, blockIdx.y in pass 2),
// into dbias row z: rows [begin(z), end(z)). Equal batches (matmul_backward_bias: one; matmul_backward_batched: the
// experts' capacity buffers) or the dropless experts' contiguous row ranges of unequal, possibly zero, length.
struct MatmulStridedRows {
    int rows;  // per batch
    __device__ int begin(int z) const { return z * rows; }
    __device__ int end(int z) const { return (z + 1) * rows; }
};

// Bias gradient, deterministic in two passes: no atomics, every sum in an order fixed by the row ranges and OC alone.
// Pass 1: block (x, y, z) owns a strip of 32 * x128::size columns of batch z; its warps take rows begin(z) + y*W + w,
// stepping by gridDim.y * W, each lane summing its x128::size columns in fp32; the W warps' sums are added in warp
// order into partials[z][y][col]. Pass 2 adds the gridDim.y partial rows in order into dbias[z]. A batch without
// rows is skipped by both passes (whole blocks return before the barrier), so its dbias row is not even rewritten.
// Floor: rows * OC * sizeof(floatX) bytes read (the partials are ~64 * OC * 4 bytes per batch each way, negligible);
// rows * OC adds. One pass over dout.
template <class Rows>
__global__ void matmul_bias_partials_kernel(float* partials, const floatX* dout, Rows rows, int OC) {
    // (W, 32, x128::size + 1): the +1 pads each lane's run so that both the stores (lane varies) and the
    // column-ordered loads below hit distinct banks
    __shared__ float warp_sums[MATMUL_BIAS_WARPS * 32 * (x128::size + 1)];
    const int row_begin = rows.begin(blockIdx.z), row_end = rows.end(blockIdx.z);
    if (row_begin == row_end) return;
    partials += (size_t)blockIdx.z * gridDim.y * OC;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int strip = 32 * x128::size;
    const int col = blockIdx.x * strip + lane * x128::size;
    float sums[x128::size];
    for (int k = 0; k < x128::size; k++) sums[k] = 0.0f;
    if (col < OC) {
        for (int row = row_begin + blockIdx.y * MATMUL_BIAS_WARPS + warp; row < row_end;
             row += gridDim.y * MATMUL_BIAS_WARPS) {
            x128 packed = load128cs(dout + (size_t)row * OC + col);
            for (int k = 0; k < x128::size; k++) sums[k] += (float)packed[k];
        }
    }
    for (int k = 0; k < x128::size; k++) warp_sums[(warp * 32 + lane) * (x128::size + 1) + k] = sums[k];
    __syncthreads();
    for (int c = threadIdx.x; c < strip; c += blockDim.x) {
        const int owner = c / x128::size;
        const int k = c % x128::size;
        float total = 0.0f;
        for (int w = 0; w < MATMUL_BIAS_WARPS; w++) total += warp_sums[(w * 32 + owner) * (x128::size + 1) + k];
        if (blockIdx.x * strip + c < OC) partials[(size_t)blockIdx.y * OC + blockIdx.x * strip + c] = total;
    }
}

template <class Rows>
__global__ void matmul_bias_reduce_kernel(floatX* dbias, const float* partials, Rows rows, int num_partials, int OC) {
    const int col = (blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (col >= OC || rows.begin(blockIdx.y) == rows.end(blockIdx.y)) return;
    dbias += (size_t)blockIdx.y * OC;
    partials += (size_t)blockIdx.y * num_partials * OC;
    float sums[x128::size];
    for (int k = 0; k < x128::size; k++) sums[k] = 0.0f;
    for (int p = 0; p < num_partials; p++) {
        for (int k = 0; k < x128::size; k += f128::size) {
            f128 packed = load128(partials + (size_t)p * OC + col + k);
            for (int j = 0; j < f128::size; j++) sums[k + j] += packed[j];
        }
    }
    x128 bias = load128(dbias + col);
    for (int k = 0; k < x128::size; k++) bias[k] = (floatX)((float)bias[k] + sums[k]);
    store128(dbias + col, bias);
}

// ----------------------------------------------------------------------------------------------------
// host side

// Refusals are one line and exit: a size these kernels cannot handle must never run silently wrong.
static void matmul_require_multiple_of_8(const char* function, const char* name, int value) {
    if (value % 8 != 0) {
        fprintf(stderr, "%s: %s=%d must be a multiple of 8 (kernels move 16-byte vectors of a row)\n", function, name,
                value);
        exit(EXIT_FAILURE);
    }
}

static void matmul_require_aligned(const char* function, const void* a, const void* b, const void* c, const void* d,
                                   const void* e) {
    if (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d | (uintptr_t)e) % 16 != 0) {
        fprintf(stderr, "%s: every buffer must be 16-byte aligned\n", function);
        exit(EXIT_FAILURE);
    }
}

static void matmul_check_sizes(const char* function, int C, int OC) {
    matmul_require_multiple_of_8(function, "C", C);
    matmul_require_multiple_of_8(function, "OC", OC);
}

size_t matmul_dbias_buffer_floats(int OC) { return (size_t)MATMUL_BIAS_MAX_ROW_BLOCKS * OC; }

// dbias[z] (OC) += sum over rows [rows.begin(z), rows.end(z)) of dout (., OC), for z < batch; dbias (batch, OC).
// max_rows: the most rows of any batch, which spreads every batch over the same number of row blocks.
template <class Rows>
static void matmul_backward_bias_rows(const char* function, floatX* dbias, const floatX* dout, float* dbias_buffer,
                                      Rows rows, int batch, int max_rows, int OC, cudaStream_t stream) {
    matmul_require_multiple_of_8(function, "OC", OC);
    matmul_require_aligned(function, dbias, dout, dbias_buffer, nullptr, nullptr);
    // at least 4 rows per warp, so that small batches do not spread over blocks that each read almost nothing
    const int row_blocks = std::min(MATMUL_BIAS_MAX_ROW_BLOCKS, CEIL_DIV(max_rows, 4 * MATMUL_BIAS_WARPS));
    dim3 grid(CEIL_DIV(OC, 32 * x128::size), row_blocks, batch);
    matmul_bias_partials_kernel<<<grid, 32 * MATMUL_BIAS_WARPS, 0, stream>>>(dbias_buffer, dout, rows, OC);
    cudaCheck(cudaGetLastError());
    const int block_size = 256;
    dim3 reduce_grid(CEIL_DIV(OC / x128::size, block_size), batch);
    matmul_bias_reduce_kernel<<<reduce_grid, block_size, 0, stream>>>(dbias, dbias_buffer, rows, row_blocks, OC);
    cudaCheck(cudaGetLastError());
}

// dbias (OC) += sum over the N rows of dout (N, OC)
void matmul_backward_bias(floatX* dbias, const floatX* dout, float* dbias_buffer, int N, int OC, cudaStream_t stream) {
    matmul_backward_bias_rows("matmul_backward_bias", dbias, dout, dbias_buffer, MatmulStridedRows{N}, 1, N, OC,
                              stream);
}

// D (m, n) = op(A) op(B) (+ D when accumulate), all column-major as cuBLAS sees them, with the epilogue:
// + bias (m) if given; with gelu_aux and !gelu_backward, gelu_aux = the pre-activation and D = its GELU;
// with gelu_aux and gelu_backward, D *= gelu'(gelu_aux). gelu_aux has D's shape and leading dimension m.
// batch > 1: `batch` such products in one call, the b-th on A + b*stride_a, B + b*stride_b, D (and gelu_aux,
// which has D's shape) + b*stride_d, bias + b*stride_bias (strides in elements). D is floatX (d_type
// CUBLAS_LOWP) or fp32 (CUDA_R_32F, the router's logits); bias and gelu_aux only come with a floatX D, since
// cuBLASLt takes them in D's type.
static void matmul_cublaslt_strided(void* d, cudaDataType_t d_type, const floatX* a, const floatX* b,
                                    const floatX* bias, int m, int n, int k, cudaStream_t stream, bool trans_a,
                                    bool trans_b, bool accumulate, floatX* gelu_aux, bool gelu_backward, int batch,
                                    int64_t stride_a, int64_t stride_b, int64_t stride_d, int64_t stride_bias) {
    matmul_require_aligned("matmul", d, a, b, bias, gelu_aux);
    cublasLtMatmulDesc_t desc;
    cublasCheck(cublasLtMatmulDescCreate(&desc, cublas_compute, CUDA_R_32F));
    cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));

    cublasLtMatrixLayout_t layout_a, layout_b, layout_d;
    cublasCheck(trans_a ? cublasLtMatrixLayoutCreate(&layout_a, CUBLAS_LOWP, k, m, k)
                        : cublasLtMatrixLayoutCreate(&layout_a, CUBLAS_LOWP, m, k, m));
    cublasCheck(trans_b ? cublasLtMatrixLayoutCreate(&layout_b, CUBLAS_LOWP, n, k, n)
                        : cublasLtMatrixLayoutCreate(&layout_b, CUBLAS_LOWP, k, n, k));
    cublasCheck(cublasLtMatrixLayoutCreate(&layout_d, d_type, m, n, m));
    if (batch > 1) {
        const cublasLtMatrixLayout_t layouts[3] = {layout_a, layout_b, layout_d};
        const int64_t strides[3] = {stride_a, stride_b, stride_d};
        for (int i = 0; i < 3; i++) {
            cublasCheck(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                                         sizeof(batch)));
            cublasCheck(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                         &strides[i], sizeof(strides[i])));
        }
    }

    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    if (gelu_aux != nullptr && gelu_backward) epilogue = CUBLASLT_EPILOGUE_DGELU;
    else if (gelu_aux != nullptr) epilogue = bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    else if (bias != nullptr) epilogue = CUBLASLT_EPILOGUE_BIAS;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    if (bias != nullptr) {
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
        if (batch > 1)
            cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &stride_bias,
                                                       sizeof(stride_bias)));
    }
    if (gelu_aux != nullptr) {
        int64_t aux_ld = m;
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &gelu_aux,
                                                   sizeof(gelu_aux)));
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
        if (batch > 1)
            cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &stride_d,
                                                       sizeof(stride_d)));
    }

    cublasLtMatmulPreference_t preference;
    cublasCheck(cublasLtMatmulPreferenceCreate(&preference));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                     &cublaslt_workspace_size, sizeof(cublaslt_workspace_size)));
    cublasLtMatmulHeuristicResult_t heuristic;
    int returned = 0;
    cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(cublaslt_handle, desc, layout_a, layout_b, layout_d,
                                                           layout_d, preference, 1, &heuristic, &returned);
    if (status != CUBLAS_STATUS_SUCCESS || returned == 0) {
        fprintf(stderr,
                "matmul: cuBLASLt has no algorithm for m=%d n=%d k=%d batch=%d trans_a=%d trans_b=%d epilogue=%d (%s)\n",
                m, n, k, batch, (int)trans_a, (int)trans_b, (int)epilogue, cublasGetStatusString(status));
        exit(EXIT_FAILURE);
    }
    const float alpha = 1.0f;
    const float beta = accumulate ? 1.0f : 0.0f;
    cublasCheck(cublasLtMatmul(cublaslt_handle, desc, &alpha, a, layout_a, b, layout_b, &beta, d, layout_d, d, layout_d,
                               &heuristic.algo, cublaslt_workspace, cublaslt_workspace_size, stream));
    cublasCheck(cublasLtMatmulPreferenceDestroy(preference));
    cublasCheck(cublasLtMatrixLayoutDestroy(layout_a));
    cublasCheck(cublasLtMatrixLayoutDestroy(layout_b));
    cublasCheck(cublasLtMatrixLayoutDestroy(layout_d));
    cublasCheck(cublasLtMatmulDescDestroy(desc));
}

// one floatX product, as the GPT trainer's Linear layers use it
static void matmul_cublaslt(floatX* d, const floatX* a, const floatX* b, const floatX* bias, int m, int n, int k,
                            cudaStream_t stream, bool trans_a, bool trans_b, bool accumulate, floatX* gelu_aux,
                            bool gelu_backward) {
    matmul_cublaslt_strided(d, CUBLAS_LOWP, a, b, bias, m, n, k, stream, trans_a, trans_b, accumulate, gelu_aux,
                            gelu_backward, 1, 0, 0, 0, 0);
}

// out (B,T,OC) = inp (B,T,C) @ weight^T + bias. With pre_gelu: pre_gelu = that, out = gelu(pre_gelu).
// Row-major (N, C) is column-major (C, N) to cuBLAS: out^T (OC, N) = op(weight) inp^T, where weight as
// stored is column-major (C, OC) and op transposes it.
void matmul_forward(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias, int B, int T, int C,
                    int OC, cudaStream_t stream, floatX* pre_gelu = nullptr, int gelu_fusion = 1) {
    matmul_check_sizes("matmul_forward", C, OC);
    const int N = B * T;
    if (pre_gelu != nullptr && gelu_fusion < 1) {
        matmul_cublaslt(pre_gelu, weight, inp, bias, OC, N, C, stream, true, false, false, nullptr, false);
        const size_t count = (size_t)N * OC;
        gelu_forward(out, pre_gelu, count, stream);
    } else {
        matmul_cublaslt(out, weight, inp, bias, OC, N, C, stream, true, false, false, pre_gelu, false);
    }
}

// dweight (OC, C) += dout^T @ inp over N rows, alone: the weight gradient of matmul_backward, or a pipeline's W pass
// (-pps zb), which computes it after the input gradients. dweight column-major (C, OC) += inp (C, N column-major) @
// dout^T (N, OC).
void matmul_backward_weight(floatX* dweight, const floatX* dout, const floatX* inp, int N, int C, int OC,
                            cudaStream_t stream) {
    matmul_cublaslt(dweight, inp, dout, nullptr, C, OC, N, stream, false, true, true, nullptr, false);
}

// dinp (B,T,C) = dout @ weight [* gelu'(pre_gelu)]; dweight (OC,C) += dout^T @ inp; dbias (OC) += column sums
// (dweight and dbias NULL: a frozen layer's, not computed).
void matmul_backward(floatX* dinp, floatX* dweight, floatX* dbias, const floatX* dout, const floatX* inp,
                     const floatX* weight, float* dbias_buffer, int B, int T, int C, int OC, cudaStream_t stream,
                     const floatX* pre_gelu = nullptr, int gelu_fusion = 1) {
    matmul_check_sizes("matmul_backward", C, OC);
    const int N = B * T;
    if (dbias != nullptr) matmul_backward_bias(dbias, dout, dbias_buffer, N, OC, stream);
    // dinp^T (C, N) = weight as stored, (C, OC) column-major, times dout^T (OC, N); the epilogue only reads
    // its auxiliary buffer, the const_cast is what the cuBLASLt attribute's type asks for
    floatX* fused_gelu_input = (pre_gelu != nullptr && gelu_fusion >= 2) ? const_cast<floatX*>(pre_gelu) : nullptr;
    matmul_cublaslt(dinp, weight, dout, nullptr, C, N, OC, stream, false, false, false, fused_gelu_input, true);
    if (pre_gelu != nullptr && gelu_fusion < 2) {
        const size_t count = (size_t)N * C;
        gelu_backward_inplace(dinp, pre_gelu, count, stream);
    }
    if (dweight != nullptr) matmul_backward_weight(dweight, dout, inp, N, C, OC, stream);  // none for a frozen weight
}
