// llmc/matmul.cuh: the Linear layers of GPT-2: forward and backward GEMMs through cuBLASLt, with the bias
// and the tanh-GELU fused into cuBLASLt's epilogue (or, with gelu_fusion off, in small kernels here), and
// a deterministic bias-gradient reduction. Weights are in PyTorch Linear layout (OC, C).
// Also the MoE layer's GEMMs: the expert FFN as one batched cuBLASLt call over the E experts' (capacity, C)
// buffers (matmul_forward_batched / matmul_backward_batched), and the router's GEMM with fp32 logits
// (matmul_forward_fp32_output / matmul_backward_fp32_dout). Lab: dev/cuda/matmul_batched.cu.
// Included by the trainers; needs cublas_setup() first and links with -lcublas -lcublasLt (nvcc or
// cpu/cucc). Lab files: dev/cuda/matmul_forward.cu and dev/cuda/matmul_backward_bias.cu.
//
// Size rules (checked on every call, refused with one line): C and OC multiples of 8, all pointers 16-byte
// aligned, because the bias and GELU kernels move whole 16-byte vectors of a row and cuBLASLt's auxiliary
// GELU buffer needs a leading dimension that is a multiple of 8.
#pragma once
#include <algorithm>
#include "common.cuh"
#include "cublas_common.cuh"

// Rows of dout summed by one block of the bias-gradient kernel are spread over at most this many blocks
// along the rows; each writes one fp32 partial row, so the scratch is this many rows of OC floats.
#define MATMUL_BIAS_MAX_ROW_BLOCKS 64
#define MATMUL_BIAS_WARPS 8

// ----------------------------------------------------------------------------------------------------
// GELU, tanh approximation (GPT-2's), for the unfused path. cuBLASLt's epilogue computes the same formula.
#define MATMUL_GELU_SCALE 0.7978845608028654f  // sqrt(2 / pi)

__device__ inline float matmul_gelu_tanh(float x) {
    float cube = 0.044715f * x * x * x;
    return 0.5f * x * (1.0f + tanhf(MATMUL_GELU_SCALE * (x + cube)));
}

__device__ inline float matmul_gelu_tanh_grad(float x) {
    float cube = 0.044715f * x * x * x;
    float tanh_out = tanhf(MATMUL_GELU_SCALE * (x + cube));
    float sech2 = 1.0f - tanh_out * tanh_out;
    return 0.5f * (1.0f + tanh_out) + 0.5f * x * sech2 * MATMUL_GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
}

// Floor: reads and writes n elements once: 2 * n * sizeof(floatX) bytes, ~20 flops per element.
__global__ void matmul_gelu_forward_kernel(floatX* out, const floatX* inp, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    x128 packed_inp = load128cs(inp + i);
    x128 packed_out;
    for (int k = 0; k < x128::size; k++) packed_out[k] = (floatX)matmul_gelu_tanh((float)packed_inp[k]);
    store128(out + i, packed_out);
}

// d_in_out *= gelu'(inp), in place. Floor: 3 * n * sizeof(floatX) bytes.
__global__ void matmul_gelu_backward_inplace_kernel(floatX* d_in_out, const floatX* inp, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    x128 packed_grad = load128cs(d_in_out + i);
    x128 packed_inp = load128cs(inp + i);
    for (int k = 0; k < x128::size; k++)
        packed_grad[k] = (floatX)((float)packed_grad[k] * matmul_gelu_tanh_grad((float)packed_inp[k]));
    store128(d_in_out + i, packed_grad);
}

// ----------------------------------------------------------------------------------------------------
// Bias gradient, deterministic in two passes: no atomics, every sum in an order fixed by (N, OC) alone.
// Pass 1: block (x, y) owns a strip of 32 * x128::size columns; its warps take rows y*W + w, stepping by
// gridDim.y * W, each lane summing its x128::size columns in fp32; the W warps' sums are added in warp
// order into partials[y][col]. Pass 2 adds the gridDim.y partial rows in order into dbias.
// Floor: N * OC * sizeof(floatX) bytes read (the partials are ~64 * OC * 4 bytes each way, negligible);
// N * OC adds. One pass over dout.
__global__ void matmul_bias_partials_kernel(float* partials, const floatX* dout, int N, int OC) {
    // (W, 32, x128::size + 1): the +1 pads each lane's run so that both the stores (lane varies) and the
    // column-ordered loads below hit distinct banks
    __shared__ float warp_sums[MATMUL_BIAS_WARPS * 32 * (x128::size + 1)];
    // blockIdx.z is the batch (an expert): its own (N, OC) dout and its own gridDim.y partial rows; 0 for
    // the single matrix of matmul_backward_bias
    dout += (size_t)blockIdx.z * N * OC;
    partials += (size_t)blockIdx.z * gridDim.y * OC;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int strip = 32 * x128::size;
    const int col = blockIdx.x * strip + lane * x128::size;
    float sums[x128::size];
    for (int k = 0; k < x128::size; k++) sums[k] = 0.0f;
    if (col < OC) {
        for (int row = blockIdx.y * MATMUL_BIAS_WARPS + warp; row < N; row += gridDim.y * MATMUL_BIAS_WARPS) {
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

__global__ void matmul_bias_reduce_kernel(floatX* dbias, const float* partials, int num_partials, int OC) {
    const int col = (blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (col >= OC) return;
    // blockIdx.y is the batch, as in the partials kernel (0 for one matrix)
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

// dst (n) = src (n) rounded to floatX: the router's fp32 logit gradient made a GEMM operand. In the FP32 build
// it is a plain copy. Floor: n * (4 + sizeof(floatX)) bytes, one pass.
__global__ void matmul_cast_to_floatX_kernel(floatX* dst, const float* src, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = (floatX)src[i];
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
// every batch keeps its own partial rows, so that all batches reduce in the same two launches
size_t matmul_batched_dbias_buffer_floats(int batch, int OC) { return (size_t)batch * matmul_dbias_buffer_floats(OC); }

// dbias[b] (OC) += sum over the N rows of dout[b] (N, OC), for b < batch; dbias (batch, OC), dout (batch, N, OC)
static void matmul_backward_bias_strided(const char* function, floatX* dbias, const floatX* dout, float* dbias_buffer,
                                         int batch, int N, int OC, cudaStream_t stream) {
    matmul_require_multiple_of_8(function, "OC", OC);
    matmul_require_aligned(function, dbias, dout, dbias_buffer, nullptr, nullptr);
    // at least 4 rows per warp, so that small N does not spread over blocks that each read almost nothing
    const int row_blocks = std::min(MATMUL_BIAS_MAX_ROW_BLOCKS, CEIL_DIV(N, 4 * MATMUL_BIAS_WARPS));
    dim3 grid(CEIL_DIV(OC, 32 * x128::size), row_blocks, batch);
    matmul_bias_partials_kernel<<<grid, 32 * MATMUL_BIAS_WARPS, 0, stream>>>(dbias_buffer, dout, N, OC);
    cudaCheck(cudaGetLastError());
    const int block_size = 256;
    dim3 reduce_grid(CEIL_DIV(OC / x128::size, block_size), batch);
    matmul_bias_reduce_kernel<<<reduce_grid, block_size, 0, stream>>>(dbias, dbias_buffer, row_blocks, OC);
    cudaCheck(cudaGetLastError());
}

// dbias (OC) += sum over the N rows of dout (N, OC)
void matmul_backward_bias(floatX* dbias, const floatX* dout, float* dbias_buffer, int N, int OC, cudaStream_t stream) {
    matmul_backward_bias_strided("matmul_backward_bias", dbias, dout, dbias_buffer, 1, N, OC, stream);
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
        const int block_size = 256;
        matmul_gelu_forward_kernel<<<CEIL_DIV(count / x128::size, block_size), block_size, 0, stream>>>(out, pre_gelu,
                                                                                                         count);
        cudaCheck(cudaGetLastError());
    } else {
        matmul_cublaslt(out, weight, inp, bias, OC, N, C, stream, true, false, false, pre_gelu, false);
    }
}

// dinp (B,T,C) = dout @ weight [* gelu'(pre_gelu)]; dweight (OC,C) += dout^T @ inp; dbias (OC) += column sums.
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
        const int block_size = 256;
        matmul_gelu_backward_inplace_kernel<<<CEIL_DIV(count / x128::size, block_size), block_size, 0, stream>>>(
            dinp, pre_gelu, count);
        cudaCheck(cudaGetLastError());
    }
    // dweight, column-major (C, OC), += inp (C, N column-major) @ dout^T (N, OC)
    matmul_cublaslt(dweight, inp, dout, nullptr, C, OC, N, stream, false, true, true, nullptr, false);
}

// ----------------------------------------------------------------------------------------------------
// The MoE expert FFN: `batch` independent Linear layers (one per expert) on equally sized row buffers, each
// one cuBLASLt call with a batch count and strided batch offsets. Shapes: inp (batch, rows, C),
// weight (batch, OC, C), bias (batch, OC), out and pre_gelu (batch, rows, OC). rows is the expert capacity;
// padding rows hold zeros in inp (and in dout below), so they add nothing to dweight and dbias.
static void matmul_check_batched(const char* function, int batch, int rows, int C, int OC) {
    matmul_check_sizes(function, C, OC);
    if (batch < 1 || rows < 1) {
        fprintf(stderr, "%s: batch=%d and rows=%d must be at least 1\n", function, batch, rows);
        exit(EXIT_FAILURE);
    }
}

// out[b] = inp[b] @ weight[b]^T + bias[b]; with pre_gelu: pre_gelu[b] = that, out[b] = gelu(pre_gelu[b]).
// As in matmul_forward, out[b]^T (OC, rows) = op(weight[b]) inp[b]^T in cuBLAS's column-major view.
void matmul_forward_batched(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias, int batch,
                            int rows, int C, int OC, cudaStream_t stream, floatX* pre_gelu = nullptr,
                            int gelu_fusion = 1) {
    matmul_check_batched("matmul_forward_batched", batch, rows, C, OC);
    const int64_t stride_weight = (int64_t)OC * C, stride_inp = (int64_t)rows * C, stride_out = (int64_t)rows * OC;
    if (pre_gelu != nullptr && gelu_fusion < 1) {
        matmul_cublaslt_strided(pre_gelu, CUBLAS_LOWP, weight, inp, bias, OC, rows, C, stream, true, false, false,
                                nullptr, false, batch, stride_weight, stride_inp, stride_out, OC);
        // the batches are contiguous, so one elementwise pass covers them all
        const size_t count = (size_t)batch * rows * OC;
        const int block_size = 256;
        matmul_gelu_forward_kernel<<<CEIL_DIV(count / x128::size, block_size), block_size, 0, stream>>>(out, pre_gelu,
                                                                                                         count);
        cudaCheck(cudaGetLastError());
    } else {
        matmul_cublaslt_strided(out, CUBLAS_LOWP, weight, inp, bias, OC, rows, C, stream, true, false, false, pre_gelu,
                                false, batch, stride_weight, stride_inp, stride_out, OC);
    }
}

// dinp[b] (rows, C) = dout[b] @ weight[b] [* gelu'(pre_gelu[b])] (overwritten); dweight[b] (OC, C) +=
// dout[b]^T @ inp[b]; dbias[b] (OC) += column sums of dout[b] (deterministic, all batches in two launches;
// dbias_buffer holds matmul_batched_dbias_buffer_floats(batch, OC) floats). pre_gelu (batch, rows, C).
void matmul_backward_batched(floatX* dinp, floatX* dweight, floatX* dbias, const floatX* dout, const floatX* inp,
                             const floatX* weight, float* dbias_buffer, int batch, int rows, int C, int OC,
                             cudaStream_t stream, const floatX* pre_gelu = nullptr, int gelu_fusion = 1) {
    matmul_check_batched("matmul_backward_batched", batch, rows, C, OC);
    const int64_t stride_weight = (int64_t)OC * C, stride_inp = (int64_t)rows * C, stride_out = (int64_t)rows * OC;
    if (dbias != nullptr)
        matmul_backward_bias_strided("matmul_backward_batched", dbias, dout, dbias_buffer, batch, rows, OC, stream);
    // the DGELU epilogue only reads its auxiliary buffer; the const_cast is what the attribute's type asks for
    floatX* fused_gelu_input = (pre_gelu != nullptr && gelu_fusion >= 2) ? const_cast<floatX*>(pre_gelu) : nullptr;
    matmul_cublaslt_strided(dinp, CUBLAS_LOWP, weight, dout, nullptr, C, rows, OC, stream, false, false, false,
                            fused_gelu_input, true, batch, stride_weight, stride_out, stride_inp, 0);
    if (pre_gelu != nullptr && gelu_fusion < 2) {
        const size_t count = (size_t)batch * rows * C;
        const int block_size = 256;
        matmul_gelu_backward_inplace_kernel<<<CEIL_DIV(count / x128::size, block_size), block_size, 0, stream>>>(
            dinp, pre_gelu, count);
        cudaCheck(cudaGetLastError());
    }
    matmul_cublaslt_strided(dweight, CUBLAS_LOWP, inp, dout, nullptr, C, OC, rows, stream, false, true, true, nullptr,
                            false, batch, stride_inp, stride_out, stride_weight, 0);
}

// ----------------------------------------------------------------------------------------------------
// The MoE router's GEMM: logits in fp32 (the router runs in fp32 from its logits on), inputs in floatX.
// C must be a multiple of 8 (the operands' leading dimension); OC (the expert count) may be any size >= 1.

// out (N, OC) fp32 = inp (N, C) @ weight^T (OC, C), fp32 accumulation rounded once to fp32, no bias
void matmul_forward_fp32_output(float* out, const floatX* inp, const floatX* weight, int N, int C, int OC,
                                cudaStream_t stream) {
    matmul_require_multiple_of_8("matmul_forward_fp32_output", "C", C);
    matmul_cublaslt_strided(out, CUDA_R_32F, weight, inp, nullptr, OC, N, C, stream, true, false, false, nullptr,
                            false, 1, 0, 0, 0, 0);
}

// dinp (N, C) += dout @ weight (accumulates: the router's input also receives the experts' gradient);
// dweight (OC, C) += dout^T @ inp. dout (N, OC) is fp32, but a GEMM's A and B share one type, so it is first
// rounded to floatX into dout_scratch (N * OC elements); the GEMMs then accumulate in fp32 as everywhere.
void matmul_backward_fp32_dout(floatX* dinp, floatX* dweight, const float* dout, const floatX* inp,
                               const floatX* weight, floatX* dout_scratch, int N, int C, int OC, cudaStream_t stream) {
    matmul_require_multiple_of_8("matmul_backward_fp32_dout", "C", C);
    const size_t count = (size_t)N * OC;
    const int block_size = 256;
    matmul_cast_to_floatX_kernel<<<CEIL_DIV(count, (size_t)block_size), block_size, 0, stream>>>(dout_scratch, dout,
                                                                                                  count);
    cudaCheck(cudaGetLastError());
    matmul_cublaslt_strided(dinp, CUBLAS_LOWP, weight, dout_scratch, nullptr, C, N, OC, stream, false, false, true,
                            nullptr, false, 1, 0, 0, 0, 0);
    matmul_cublaslt_strided(dweight, CUBLAS_LOWP, inp, dout_scratch, nullptr, C, OC, N, stream, false, true, true,
                            nullptr, false, 1, 0, 0, 0, 0);
}
