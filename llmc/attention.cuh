// llmc/attention.cuh: causal multi-head self-attention, the hand-written path (no cuDNN): q, k, v are permuted
// into heads, preatt = q k^T and att @ v are cuBLAS strided-batched GEMMs, the causal softmax (with the
// 1/sqrt(HS) scale) and its backward are kernels here. Memory is O(T^2): att (B, NH, T, T) is kept for the
// backward pass. Also attention_support(), its start-up size check.
// Included by the trainers; needs cublas_setup() first; links with -lcublas -lcublasLt (nvcc or cpu/cucc).
// Lab files: dev/cuda/attention_forward.cu, dev/cuda/attention_backward.cu, dev/cuda/softmax_forward.cu.
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-attention_forward_{bf16,fp32},
// lab-attention_backward_{bf16,fp32}, lab-softmax_forward_{bf16,fp32} and their lab-check- twins; gpt-*-fa0 and
// moe-*-fa0 (the cuBLAS-and-softmax path against PyTorch).
#pragma once
#include <math.h>
#include "common.cuh"
#include "cublas_common.cuh"

// ----------------------------------------------------------------------------------------------------
// Layout changes between the packed per-position layout (B, T, parts, NH, HS) (c_attn's output, parts = 3
// for q|k|v; parts = 1 for an attention output or its gradient) and heads (parts, B, NH, T, HS), where every
// head's (T, HS) matrix is contiguous for the batched GEMMs. One thread moves one 16-byte chunk of a head
// row; consecutive threads take consecutive chunks of the heads layout, so the heads side is one contiguous
// stream and the packed side contiguous runs of HS elements.
// Floor: 2 * parts * B * T * C * sizeof(floatX) bytes (read once, written once), no flops.
template <bool to_heads>
__global__ void attention_permute_kernel(floatX* dst, const floatX* src, int B, int T, int NH, int HS, int parts) {
    const size_t chunk = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int chunks_per_row = HS / x128::size;
    if (chunk >= (size_t)parts * B * NH * T * chunks_per_row) return;
    const int d = (int)(chunk % chunks_per_row) * x128::size;
    size_t rest = chunk / chunks_per_row;
    const int t = (int)(rest % T);
    rest /= T;
    const int h = (int)(rest % NH);
    rest /= NH;
    const int b = (int)(rest % B);
    const int part = (int)(rest / B);
    const size_t heads_index = chunk * x128::size;
    const size_t packed_index = (((size_t)b * T + t) * parts + part) * NH * HS + (size_t)h * HS + d;
    if (to_heads) store128(dst + heads_index, load128cs(src + packed_index));
    else store128(dst + packed_index, load128cs(src + heads_index));
}

static void attention_permute(floatX* dst, const floatX* src, bool to_heads, int B, int T, int NH, int HS, int parts,
                              cudaStream_t stream) {
    const size_t chunks = (size_t)parts * B * NH * T * (HS / x128::size);
    const int block_size = 256;
    const unsigned int grid = (unsigned int)CEIL_DIV(chunks, (size_t)block_size);
    if (to_heads) attention_permute_kernel<true><<<grid, block_size, 0, stream>>>(dst, src, B, T, NH, HS, parts);
    else attention_permute_kernel<false><<<grid, block_size, 0, stream>>>(dst, src, B, T, NH, HS, parts);
    cudaCheck(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------
// Causal softmax over rows of (B, NH, T, T): row r is query position t = r % T, so only its first t + 1
// entries are attended; the rest are written as 0 (the att @ v GEMM and the backward read whole rows).
// A warp owns a row and walks it in 16-byte chunks, lane i taking chunks i, i + 32, ... vector_rows: T is a
// multiple of x128::size, so every row starts 16-byte aligned and whole chunks are read and written; else
// elements are moved one at a time (same traversal).

// values[k] = row[i + k] for i + k < valid, -inf beyond (so exp() of it is 0 and max ignores it); a chunk
// wholly past the causal boundary is not read at all
template <bool vector_rows>
__device__ inline void attention_load_chunk(float* values, const floatX* row, int i, int valid, int length) {
    if (i >= valid) {
        for (int k = 0; k < x128::size; k++) values[k] = -INFINITY;
    } else if (vector_rows) {
        x128 packed = load128(row + i);
        for (int k = 0; k < x128::size; k++) values[k] = i + k < valid ? (float)packed[k] : -INFINITY;
    } else {
        for (int k = 0; k < x128::size; k++) values[k] = (i + k < valid && i + k < length) ? (float)row[i + k] : -INFINITY;
    }
}

template <bool vector_rows>
__device__ inline void attention_store_chunk(floatX* row, const float* values, int i, int length) {
    if (vector_rows) {
        x128 packed;
        for (int k = 0; k < x128::size; k++) packed[k] = (floatX)values[k];
        store128(row + i, packed);
    } else {
        for (int k = 0; k < x128::size; k++)
            if (i + k < length) row[i + k] = (floatX)values[k];
    }
}

// att = causal_softmax(scale * preatt), row-wise; att may be preatt (in place: each lane reads a chunk before
// it writes it, and no lane touches another's chunks). One pass to find the max and the sum together (online
// softmax: the running sum is rescaled when the max grows), one pass to write.
// Floor per (b, h): reads T(T+1)/2 elements, writes T*T: (T(T+1)/2 + T^2) * sizeof(floatX) bytes, ~5 flops
// per read element.
template <bool vector_rows>
__global__ void attention_softmax_forward_kernel(floatX* att, const floatX* preatt, float scale, int rows, int T) {
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int valid = row % T + 1;
    const floatX* in_row = preatt + (size_t)row * T;
    floatX* out_row = att + (size_t)row * T;

    float running_max = -INFINITY;
    float running_sum = 0.0f;
    for (int i = lane * x128::size; i < valid; i += 32 * x128::size) {
        float values[x128::size];
        attention_load_chunk<vector_rows>(values, in_row, i, valid, T);
        float chunk_max = -INFINITY;
        for (int k = 0; k < x128::size; k++) chunk_max = fmaxf(chunk_max, scale * values[k]);
        const float new_max = fmaxf(running_max, chunk_max);
        running_sum *= expf(running_max - new_max);
        for (int k = 0; k < x128::size; k++) running_sum += expf(scale * values[k] - new_max);
        running_max = new_max;
    }
    const float row_max = warp_reduce_max(running_max);
    // lanes that saw nothing hold max -inf and sum 0: their rescale factor is exp(-inf) = 0
    const float row_sum = warp_reduce_sum(running_max == -INFINITY ? 0.0f : running_sum * expf(running_max - row_max));
    const float inverse_sum = 1.0f / row_sum;

    for (int i = lane * x128::size; i < T; i += 32 * x128::size) {
        float values[x128::size];
        attention_load_chunk<vector_rows>(values, in_row, i, valid, T);
        for (int k = 0; k < x128::size; k++) values[k] = expf(scale * values[k] - row_max) * inverse_sum;
        attention_store_chunk<vector_rows>(out_row, values, i, T);
    }
}

// dpreatt = scale * att * (datt - sum(att * datt)) on the causal part of each row, 0 elsewhere. dpreatt may be
// datt (in place, same argument as the forward).
// Floor per (b, h): reads 2 * T(T+1)/2 elements, writes T*T: (T(T+1) + T^2) * sizeof(floatX) bytes.
template <bool vector_rows>
__global__ void attention_softmax_backward_kernel(floatX* dpreatt, const floatX* datt, const floatX* att, float scale,
                                                  int rows, int T) {
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int valid = row % T + 1;
    const floatX* att_row = att + (size_t)row * T;
    const floatX* datt_row = datt + (size_t)row * T;

    float partial_dot = 0.0f;
    for (int i = lane * x128::size; i < valid; i += 32 * x128::size) {
        float probabilities[x128::size], gradients[x128::size];
        attention_load_chunk<vector_rows>(probabilities, att_row, i, valid, T);
        attention_load_chunk<vector_rows>(gradients, datt_row, i, valid, T);
        for (int k = 0; k < x128::size; k++)
            if (i + k < valid) partial_dot += probabilities[k] * gradients[k];
    }
    const float dot = warp_reduce_sum(partial_dot);

    for (int i = lane * x128::size; i < T; i += 32 * x128::size) {
        float probabilities[x128::size], gradients[x128::size], result[x128::size];
        attention_load_chunk<vector_rows>(probabilities, att_row, i, valid, T);
        attention_load_chunk<vector_rows>(gradients, datt_row, i, valid, T);
        for (int k = 0; k < x128::size; k++)
            result[k] = i + k < valid ? scale * probabilities[k] * (gradients[k] - dot) : 0.0f;
        attention_store_chunk<vector_rows>(dpreatt + (size_t)row * T, result, i, T);
    }
}

static bool attention_vector_rows(int T, const void* a, const void* b, const void* c) {
    return T % x128::size == 0 && (uintptr_t)a % 16 == 0 && (uintptr_t)b % 16 == 0 && (uintptr_t)c % 16 == 0;
}

// att (rows, T) = causal softmax of scale * preatt (rows, T); rows = B * NH * T
void attention_softmax_forward(floatX* att, const floatX* preatt, float scale, int rows, int T, cudaStream_t stream) {
    const int block_size = 256;
    const int grid = CEIL_DIV(rows, block_size / 32);
    if (attention_vector_rows(T, att, preatt, att))
        attention_softmax_forward_kernel<true><<<grid, block_size, 0, stream>>>(att, preatt, scale, rows, T);
    else
        attention_softmax_forward_kernel<false><<<grid, block_size, 0, stream>>>(att, preatt, scale, rows, T);
    cudaCheck(cudaGetLastError());
}

void attention_softmax_backward(floatX* dpreatt, const floatX* datt, const floatX* att, float scale, int rows, int T,
                                cudaStream_t stream) {
    const int block_size = 256;
    const int grid = CEIL_DIV(rows, block_size / 32);
    if (attention_vector_rows(T, dpreatt, datt, att))
        attention_softmax_backward_kernel<true><<<grid, block_size, 0, stream>>>(dpreatt, datt, att, scale, rows, T);
    else
        attention_softmax_backward_kernel<false><<<grid, block_size, 0, stream>>>(dpreatt, datt, att, scale, rows, T);
    cudaCheck(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------
// Sizes. Head rows are moved in 16-byte chunks, 8 elements in every precision so that a model's support does
// not depend on the build.
bool attention_support(int C, int NH, char* why, size_t why_size) {
    if (NH < 1 || C < 1 || C % NH != 0) {
        snprintf(why, why_size, "channels C=%d must be a positive multiple of the head count NH=%d", C, NH);
        return false;
    }
    if ((C / NH) % 8 != 0) {
        snprintf(why, why_size, "head size C/NH=%d must be a multiple of 8 (attention permutes 16-byte vectors)",
                 C / NH);
        return false;
    }
    return true;
}

static void attention_require_support(const char* function, int C, int NH, const void* p1, const void* p2,
                                      const void* p3, const void* p4) {
    char why[256];
    if (!attention_support(C, NH, why, sizeof(why))) {
        fprintf(stderr, "%s: %s\n", function, why);
        exit(EXIT_FAILURE);
    }
    if ((uintptr_t)p1 % 16 || (uintptr_t)p2 % 16 || (uintptr_t)p3 % 16 || (uintptr_t)p4 % 16) {
        fprintf(stderr, "%s: buffers must be 16-byte aligned\n", function);
        exit(EXIT_FAILURE);
    }
}

// C (m, n) = op(A) op(B) for each of `batches` matrices, column-major as cuBLAS sees them
static void attention_gemm(bool trans_a, bool trans_b, int m, int n, int k, const floatX* a, int lda, size_t stride_a,
                           const floatX* b, int ldb, size_t stride_b, floatX* c, int ldc, size_t stride_c, int batches,
                           cudaStream_t stream) {
    const float alpha = 1.0f;
    const float beta = 0.0f;
    cublasCheck(cublasSetStream(cublas_handle, stream));
    cublasCheck(cublasGemmStridedBatchedEx(cublas_handle, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                           trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha, a, CUBLAS_LOWP, lda,
                                           (long long)stride_a, b, CUBLAS_LOWP, ldb, (long long)stride_b, &beta, c,
                                           CUBLAS_LOWP, ldc, (long long)stride_c, batches, cublas_compute,
                                           CUBLAS_GEMM_DEFAULT));
}

// ----------------------------------------------------------------------------------------------------
// Row-major (T, HS) head matrices are column-major (HS, T) to cuBLAS, and row-major att (T, T) (query t, key s)
// is column-major (s, t). Every product below is written in that column-major view.

void attention_forward(floatX* out, floatX* qkvr, floatX* att, const floatX* inp, int B, int T, int C, int NH,
                       cudaStream_t stream) {
    attention_require_support("attention_forward", C, NH, out, qkvr, att, inp);
    const int HS = C / NH;
    const size_t head = (size_t)T * HS;
    const size_t head_att = (size_t)T * T;
    floatX* q = qkvr;
    floatX* k = qkvr + (size_t)B * T * C;
    floatX* v = qkvr + 2 * (size_t)B * T * C;
    attention_permute(qkvr, inp, true, B, T, NH, HS, 3, stream);
    // preatt (s, t) = k (HS, s)^T q (HS, t), written into att and normalised there in place
    attention_gemm(true, false, T, T, HS, k, HS, head, q, HS, head, att, T, head_att, B * NH, stream);
    attention_softmax_forward(att, att, 1.0f / sqrtf((float)HS), B * NH * T, T, stream);
    // out (HS, t) = v (HS, s) att (s, t), written straight into out's (B, T, NH, HS) layout: head h of batch
    // row b starts at out + b*T*C + h*HS with leading dimension C. The stride from head to head is constant
    // only within one batch row, hence one call per batch row (and no unpermute pass, no scratch).
    for (int b = 0; b < B; b++)
        attention_gemm(false, false, HS, T, T, v + b * NH * head, HS, head, att + b * NH * head_att, T, head_att,
                       out + (size_t)b * T * C, C, HS, NH, stream);
}

void attention_backward(floatX* dinp, floatX* dqkvr, floatX* datt, floatX* scratch, const floatX* dout,
                        const floatX* qkvr, const floatX* att, int B, int T, int C, int NH, cudaStream_t stream) {
    attention_require_support("attention_backward", C, NH, dinp, dqkvr, datt, scratch);
    attention_require_support("attention_backward", C, NH, dout, qkvr, att, nullptr);
    const int HS = C / NH;
    const size_t head = (size_t)T * HS;
    const size_t head_att = (size_t)T * T;
    const size_t qkv_part = (size_t)B * T * C;
    const floatX* q = qkvr;
    const floatX* k = qkvr + qkv_part;
    const floatX* v = qkvr + 2 * qkv_part;
    floatX* dq = dqkvr;
    floatX* dk = dqkvr + qkv_part;
    floatX* dv = dqkvr + 2 * qkv_part;
    // dout into heads, so that every product below is one batched call over B * NH
    floatX* dout_heads = scratch;
    attention_permute(dout_heads, dout, true, B, T, NH, HS, 1, stream);
    // datt (s, t) = v (HS, s)^T dout (HS, t)
    attention_gemm(true, false, T, T, HS, v, HS, head, dout_heads, HS, head, datt, T, head_att, B * NH, stream);
    // dv (HS, s) = dout (HS, t) att (s, t)^T
    attention_gemm(false, true, HS, T, T, dout_heads, HS, head, att, T, head_att, dv, HS, head, B * NH, stream);
    attention_softmax_backward(datt, datt, att, 1.0f / sqrtf((float)HS), B * NH * T, T, stream);
    // with dpreatt in datt: dq (HS, t) = k (HS, s) dpreatt (s, t); dk (HS, s) = q (HS, t) dpreatt (s, t)^T
    attention_gemm(false, false, HS, T, T, k, HS, head, datt, T, head_att, dq, HS, head, B * NH, stream);
    attention_gemm(false, true, HS, T, T, q, HS, head, datt, T, head_att, dk, HS, head, B * NH, stream);
    attention_permute(dinp, dqkvr, false, B, T, NH, HS, 3, stream);
}
