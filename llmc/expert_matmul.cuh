// llmc/expert_matmul.cuh: the MoE layer's expert FFN GEMMs: one batched cuBLASLt call over the E experts'
// (capacity, C) buffers (matmul_forward_batched / matmul_backward_batched), or, dropless, one grouped cuBLAS GEMM
// over the experts' exact row ranges of one packed buffer (matmul_forward_grouped / matmul_backward_grouped), with
// the bias and the GELU as in the dense Linear layer of llmc/matmul.cuh, whose strided cuBLASLt call and
// deterministic bias-gradient kernels they share. Included by the trainers; needs cublas_setup() first and links
// with -lcublas -lcublasLt (nvcc or cpu/cucc). Lab: dev/cuda/expert_matmul.cu.
//
// Size rules (checked on every call, refused with one line): as llmc/matmul.cuh's (C and OC multiples of 8, all
// pointers 16-byte aligned); the grouped versions also refuse groups outside [1, CUBLAS_GROUPED_MAX_GROUPS] and
// negative row counts.
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-expert_matmul_{bf16,fp32} and their lab-check- twins; moe-*
// (padded and dropless experts against PyTorch), production-sizes.
#pragma once
#include <limits.h>
#include <algorithm>
#include "common.cuh"
#include "cublas_common.cuh"
#include "gelu.cuh"
#include "matmul.cuh"

// start[g] = rows[0] + ... + rows[g-1] for g <= groups (start[groups] = total rows); a kernel argument, so that no
// launch needs a copy of the offsets first (1028 bytes, well under the 4 KiB a kernel's arguments may take)
struct MatmulGroupRows {
    int start[CUBLAS_GROUPED_MAX_GROUPS + 1];
    __device__ int begin(int g) const { return start[g]; }
    __device__ int end(int g) const { return start[g + 1]; }
};

// every batch keeps its own partial rows, so that all batches reduce in the same two launches
size_t matmul_batched_dbias_buffer_floats(int batch, int OC) { return (size_t)batch * matmul_dbias_buffer_floats(OC); }

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
// accumulate (+= instead of =) is for an output with no GELU between it and the GEMM (LoRA's update over the experts)
static void matmul_check_accumulate(const char* function, bool accumulate, const floatX* pre_gelu) {
    if (accumulate && pre_gelu != nullptr) {
        fprintf(stderr, "%s: accumulate with a GELU (pre_gelu) is not a sum the GEMM can make\n", function);
        exit(EXIT_FAILURE);
    }
}

// out[b] = inp[b] @ weight[b]^T + bias[b] (accumulate: out[b] += that); with pre_gelu: pre_gelu[b] = that, out[b] =
// gelu(pre_gelu[b]). As in matmul_forward, out[b]^T (OC, rows) = op(weight[b]) inp[b]^T in cuBLAS's column-major view.
void matmul_forward_batched(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias, int batch,
                            int rows, int C, int OC, cudaStream_t stream, floatX* pre_gelu = nullptr,
                            int gelu_fusion = 1, bool accumulate = false) {
    matmul_check_batched("matmul_forward_batched", batch, rows, C, OC);
    matmul_check_accumulate("matmul_forward_batched", accumulate, pre_gelu);
    const int64_t stride_weight = (int64_t)OC * C, stride_inp = (int64_t)rows * C, stride_out = (int64_t)rows * OC;
    if (pre_gelu != nullptr && gelu_fusion < 1) {
        matmul_cublaslt_strided(pre_gelu, CUBLAS_LOWP, weight, inp, bias, OC, rows, C, stream, true, false, false,
                                nullptr, false, batch, stride_weight, stride_inp, stride_out, OC);
        // the batches are contiguous, so one elementwise pass covers them all
        const size_t count = (size_t)batch * rows * OC;
        gelu_forward(out, pre_gelu, count, stream);
    } else {
        matmul_cublaslt_strided(out, CUBLAS_LOWP, weight, inp, bias, OC, rows, C, stream, true, false, accumulate,
                                pre_gelu, false, batch, stride_weight, stride_inp, stride_out, OC);
    }
}

// dinp[b] (rows, C) = dout[b] @ weight[b] [* gelu'(pre_gelu[b])] (overwritten; accumulate: += without the GELU);
// dweight[b] (OC, C) += dout[b]^T @ inp[b] (NULL: not computed); dbias[b] (OC) += column sums of dout[b]
// (deterministic, all batches in two launches; dbias_buffer holds matmul_batched_dbias_buffer_floats(batch, OC)
// floats). pre_gelu (batch, rows, C).
void matmul_backward_batched(floatX* dinp, floatX* dweight, floatX* dbias, const floatX* dout, const floatX* inp,
                             const floatX* weight, float* dbias_buffer, int batch, int rows, int C, int OC,
                             cudaStream_t stream, const floatX* pre_gelu = nullptr, int gelu_fusion = 1,
                             bool accumulate = false) {
    matmul_check_batched("matmul_backward_batched", batch, rows, C, OC);
    matmul_check_accumulate("matmul_backward_batched", accumulate, pre_gelu);
    const int64_t stride_weight = (int64_t)OC * C, stride_inp = (int64_t)rows * C, stride_out = (int64_t)rows * OC;
    if (dbias != nullptr)
        matmul_backward_bias_rows("matmul_backward_batched", dbias, dout, dbias_buffer, MatmulStridedRows{rows}, batch,
                                  rows, OC, stream);
    // the DGELU epilogue only reads its auxiliary buffer; the const_cast is what the attribute's type asks for
    floatX* fused_gelu_input = (pre_gelu != nullptr && gelu_fusion >= 2) ? const_cast<floatX*>(pre_gelu) : nullptr;
    matmul_cublaslt_strided(dinp, CUBLAS_LOWP, weight, dout, nullptr, C, rows, OC, stream, false, false, accumulate,
                            fused_gelu_input, true, batch, stride_weight, stride_out, stride_inp, 0);
    if (pre_gelu != nullptr && gelu_fusion < 2) {
        const size_t count = (size_t)batch * rows * C;
        gelu_backward_inplace(dinp, pre_gelu, count, stream);
    }
    if (dweight != nullptr)  // NULL: frozen experts (fine-tuning), only the input's gradient is wanted
        matmul_cublaslt_strided(dweight, CUBLAS_LOWP, inp, dout, nullptr, C, OC, rows, stream, false, true, true,
                                nullptr, false, batch, stride_inp, stride_out, stride_weight, 0);
}

// ----------------------------------------------------------------------------------------------------
// The dropless MoE expert FFN: `groups` Linear layers (one per expert) on a packed (total, C) row buffer, group g
// owning rows [start_g, start_g + rows[g]), start_g = rows[0] + ... + rows[g-1], rows[] a host array (0 allowed).
// Shapes: inp (total, C), weight (groups, OC, C), bias (groups, OC), out and pre_gelu (total, OC). One
// cublasGemmGroupedBatchedEx per product, one GEMM per group with rows (group_size 1 each). Since C and OC are
// multiples of 8, every group's first row (start_g * C or start_g * OC elements in) is 16-byte aligned whenever the
// buffer is, as the GEMMs' vector loads and the kernels below need. Needs cuBLAS 12.5 or later (the first with the
// grouped GEMM); the CPU backend implements it.
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION < 120500
#error "llmc/expert_matmul.cuh: cublasGemmGroupedBatchedEx needs cuBLAS 12.5 or later"
#endif

// acc (total, OC) is what the grouped GEMM wrote; per row, x = acc + bias[g] for the row's group g (no bias: x = acc).
// Without pre_gelu (out == acc, launched only with a bias): out = x in place. With pre_gelu (== acc): pre_gelu = x
// (rewritten only when a bias changed it) and out = gelu(x). cublasGemmGroupedBatchedEx has no epilogue, so this pass
// replaces cuBLASLt's BIAS and GELU_AUX_BIAS epilogues. Each thread moves one x128 of a row (OC is a multiple of 8, so
// a vector never straddles rows) and finds the row's group by binary search over rows.start, which lives in the
// kernel's parameter space: a warp's 32 vectors span at most two rows once OC >= 32 * x128::size, so the search's
// loads are near-uniform constant-cache broadcasts and no per-row group table has to be built and copied first. The
// largest g with start[g] <= row has rows (an empty g has start[g + 1] = start[g]), so empty groups need no special
// case.
// Floor (total * OC = n elements): bias only 2n * sizeof(floatX) bytes (read acc, write out); bias + GELU 3n (read
// acc, write pre_gelu and out); GELU without bias 2n. The bias rows (groups * OC) come from L2. Against cuBLASLt's
// GELU_AUX_BIAS epilogue (the GEMM writes pre_gelu and out, 2n) that is 2n more, the GEMM's write of acc and this
// pass's read of it: the price of having no epilogue.
__global__ void matmul_grouped_bias_gelu_kernel(floatX* out, floatX* pre_gelu, const floatX* bias, MatmulGroupRows rows,
                                                int groups, int OC) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= (size_t)rows.start[groups] * OC) return;
    const int row = (int)(i / OC);
    const int col = (int)(i % OC);
    floatX* acc = pre_gelu != nullptr ? pre_gelu : out;
    x128 packed = load128cs(acc + i);
    if (bias != nullptr) {
        int lo = 0, hi = groups - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (rows.start[mid] <= row) lo = mid;
            else hi = mid - 1;
        }
        const x128 packed_bias = load128(bias + (size_t)lo * OC + col);
        for (int k = 0; k < x128::size; k++) packed[k] = (floatX)((float)packed[k] + (float)packed_bias[k]);
        if (pre_gelu == nullptr) {
            store128(out + i, packed);
            return;
        }
        store128(pre_gelu + i, packed);
    }
    for (int k = 0; k < x128::size; k++) packed[k] = (floatX)gelu_value((float)packed[k]);
    store128(out + i, packed);
}

// the groups' row offsets, after refusing what the kernels cannot handle
static MatmulGroupRows matmul_group_rows(const char* function, int groups, const int* rows, int C, int OC) {
    matmul_check_sizes(function, C, OC);
    if (groups < 1 || groups > CUBLAS_GROUPED_MAX_GROUPS) {
        fprintf(stderr, "%s: groups=%d must be in [1, %d] (the offsets are a kernel argument)\n", function, groups,
                CUBLAS_GROUPED_MAX_GROUPS);
        exit(EXIT_FAILURE);
    }
    MatmulGroupRows offsets;
    int64_t total = 0;
    for (int g = 0; g < groups; g++) {
        offsets.start[g] = (int)total;
        total += rows[g];
        if (rows[g] < 0 || total > INT_MAX) {
            fprintf(stderr, "%s: rows[%d]=%d must be >= 0 (and the total rows must fit an int)\n", function, g,
                    rows[g]);
            exit(EXIT_FAILURE);
        }
    }
    offsets.start[groups] = (int)total;
    return offsets;
}

// One cublasGemmGroupedBatchedEx of `count` GEMMs, one per group (group_size 1), column-major as cuBLAS sees them:
// C_i (m_i, n_i) = op(A_i) op(B_i) (+ C_i when accumulate), floatX data, fp32 accumulation; the transposes and
// leading dimensions are the same for all. pointers is device memory holding the count A addresses, then the count
// B, then the count C (cuBLAS reads them on the device); m, n, k are host arrays, as are the alphas and betas
// (host pointer mode).
static void matmul_grouped_gemm(void* const* pointers, int count, const int* m, const int* n, const int* k,
                                bool trans_a, bool trans_b, int lda, int ldb, int ldc, bool accumulate,
                                cudaStream_t stream) {
    cublasOperation_t op_a[CUBLAS_GROUPED_MAX_GROUPS], op_b[CUBLAS_GROUPED_MAX_GROUPS];
    int lda_array[CUBLAS_GROUPED_MAX_GROUPS], ldb_array[CUBLAS_GROUPED_MAX_GROUPS];
    int ldc_array[CUBLAS_GROUPED_MAX_GROUPS];
    int group_size[CUBLAS_GROUPED_MAX_GROUPS];
    float alpha[CUBLAS_GROUPED_MAX_GROUPS], beta[CUBLAS_GROUPED_MAX_GROUPS];
    for (int i = 0; i < count; i++) {
        op_a[i] = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
        op_b[i] = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
        lda_array[i] = lda;
        ldb_array[i] = ldb;
        ldc_array[i] = ldc;
        group_size[i] = 1;
        alpha[i] = 1.0f;
        beta[i] = accumulate ? 1.0f : 0.0f;
    }
    cublasCheck(cublasSetStream(cublas_handle, stream));
    cublasCheck(cublasGemmGroupedBatchedEx(cublas_handle, op_a, op_b, m, n, k, alpha, (const void* const*)pointers,
                                           CUBLAS_LOWP, lda_array, (const void* const*)(pointers + count), CUBLAS_LOWP,
                                           ldb_array, beta, pointers + 2 * count, CUBLAS_LOWP, ldc_array, count,
                                           group_size, cublas_compute));
}

// The groups with rows, in order, into active; returns how many. Only they get a GEMM: an empty group has nothing
// to compute, and its dweight and dbias nothing to add.
static int matmul_grouped_active(int groups, const int* rows, int* active) {
    int count = 0;
    for (int g = 0; g < groups; g++)
        if (rows[g] > 0) active[count++] = g;
    return count;
}

// A grouped call's pointer arrays go through a pinned staging slot (llmc/cublas_common.cuh): the host fills the slot
// that matmul_grouped_staging returns, once the copy issued from it a ring of calls ago has finished (no wait unless
// the host is that far ahead of the GPU); matmul_grouped_upload then copies its first n pointers into
// cublas_grouped_pointers, ordered on the GEMMs' stream before them, and records when the slot has been read.
static void** matmul_grouped_staging(void) {
    cudaCheck(cudaEventSynchronize(cublas_grouped_staged[cublas_grouped_slot]));
    return cublas_grouped_staging + (size_t)cublas_grouped_slot * CUBLAS_GROUPED_POINTERS;
}

static void* const* matmul_grouped_upload(int n, cudaStream_t stream) {
    const int slot = cublas_grouped_slot;
    cudaCheck(cudaMemcpyAsync(cublas_grouped_pointers, cublas_grouped_staging + (size_t)slot * CUBLAS_GROUPED_POINTERS,
                              n * sizeof(void*), cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaEventRecord(cublas_grouped_staged[slot], stream));
    cublas_grouped_slot = (slot + 1) % CUBLAS_GROUPED_STAGING_SLOTS;
    return cublas_grouped_pointers;
}

// all groups' partial rows, as in the batched version: empty groups' rows are left untouched
size_t matmul_grouped_dbias_buffer_floats(int groups, int OC) { return matmul_batched_dbias_buffer_floats(groups, OC); }

// out (total, OC) = per group g: inp_g @ weight[g]^T + bias[g] (accumulate: out += that); with pre_gelu: pre_gelu =
// that, out = gelu(pre_gelu).
// As in matmul_forward, out_g^T (OC, rows[g]) = op(weight[g]) inp_g^T in cuBLAS's column-major view. The GEMM writes
// into pre_gelu when there is one (else into out), then one pass adds the bias and applies the GELU; gelu_fusion 0
// keeps the GELU in its own pass after the bias one (the dense path's kernel), as the batched version does.
void matmul_forward_grouped(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias, int groups,
                            const int* rows, int C, int OC, cudaStream_t stream, floatX* pre_gelu = nullptr,
                            int gelu_fusion = 1, bool accumulate = false) {
    const MatmulGroupRows offsets = matmul_group_rows("matmul_forward_grouped", groups, rows, C, OC);
    matmul_check_accumulate("matmul_forward_grouped", accumulate, pre_gelu);
    matmul_require_aligned("matmul_forward_grouped", out, inp, weight, bias, pre_gelu);
    int active[CUBLAS_GROUPED_MAX_GROUPS];
    const int count = matmul_grouped_active(groups, rows, active);
    if (count == 0) return;  // no rows: nothing to write
    floatX* acc = pre_gelu != nullptr ? pre_gelu : out;
    void** host_pointers = matmul_grouped_staging();
    int m[CUBLAS_GROUPED_MAX_GROUPS], n[CUBLAS_GROUPED_MAX_GROUPS], k[CUBLAS_GROUPED_MAX_GROUPS];
    for (int i = 0; i < count; i++) {
        const int g = active[i];
        host_pointers[i] = (void*)(weight + (size_t)g * OC * C);
        host_pointers[count + i] = (void*)(inp + (size_t)offsets.start[g] * C);
        host_pointers[2 * count + i] = acc + (size_t)offsets.start[g] * OC;
        m[i] = OC;
        n[i] = rows[g];
        k[i] = C;
    }
    void* const* pointers = matmul_grouped_upload(3 * count, stream);
    matmul_grouped_gemm(pointers, count, m, n, k, true, false, C, C, OC, accumulate, stream);
    if (bias == nullptr && pre_gelu == nullptr) return;
    const size_t vectors = (size_t)offsets.start[groups] * OC / x128::size;
    const int block_size = 256;
    const int grid = (int)CEIL_DIV(vectors, (size_t)block_size);
    if (pre_gelu != nullptr && gelu_fusion < 1) {
        if (bias != nullptr) {
            matmul_grouped_bias_gelu_kernel<<<grid, block_size, 0, stream>>>(pre_gelu, nullptr, bias, offsets, groups,
                                                                             OC);
            cudaCheck(cudaGetLastError());
        }
        gelu_forward(out, pre_gelu, vectors * x128::size, stream);
    } else {
        matmul_grouped_bias_gelu_kernel<<<grid, block_size, 0, stream>>>(out, pre_gelu, bias, offsets, groups, OC);
        cudaCheck(cudaGetLastError());
    }
}

// dinp (total, C) = per group dout_g @ weight[g] [* gelu'(pre_gelu)] (overwritten; accumulate: += without the
// GELU); dweight[g] (OC, C) += dout_g^T @ inp_g (NULL: not computed); dbias[g] (OC) += column sums of dout_g
// (deterministic, all groups in two launches; dbias_buffer holds matmul_grouped_dbias_buffer_floats(groups, OC)
// floats). pre_gelu (total, C). Groups without rows add nothing. The grouped GEMM has no DGELU epilogue, so the GELU
// backward is always its own in-place pass over dinp (the dense path's kernel, 3 * total * C * sizeof(floatX) bytes):
// unlike the batched version there is no gelu_fusion to choose.
void matmul_backward_grouped(floatX* dinp, floatX* dweight, floatX* dbias, const floatX* dout, const floatX* inp,
                             const floatX* weight, float* dbias_buffer, int groups, const int* rows, int C, int OC,
                             cudaStream_t stream, const floatX* pre_gelu = nullptr, bool accumulate = false) {
    const MatmulGroupRows offsets = matmul_group_rows("matmul_backward_grouped", groups, rows, C, OC);
    matmul_check_accumulate("matmul_backward_grouped", accumulate, pre_gelu);
    matmul_require_aligned("matmul_backward_grouped", dinp, dweight, dout, inp, weight);
    matmul_require_aligned("matmul_backward_grouped", pre_gelu, nullptr, nullptr, nullptr, nullptr);
    int active[CUBLAS_GROUPED_MAX_GROUPS];
    const int count = matmul_grouped_active(groups, rows, active);
    if (count == 0) return;  // no rows: dinp is empty and nothing is added
    int max_rows = 0;
    for (int g = 0; g < groups; g++) max_rows = std::max(max_rows, rows[g]);
    if (dbias != nullptr)
        matmul_backward_bias_rows("matmul_backward_grouped", dbias, dout, dbias_buffer, offsets, groups, max_rows, OC,
                                  stream);
    // two products, their pointers in one upload: dinp_g^T (C, rows) = weight[g] as stored, (C, OC) column-major,
    // times dout_g^T (OC, rows); then dweight[g], column-major (C, OC), += inp_g (C, rows) @ (dout_g^T)^T (rows, OC)
    void** host_pointers = matmul_grouped_staging();
    void** dinp_pointers = host_pointers;
    void** dweight_pointers = host_pointers + 3 * count;
    int C_array[CUBLAS_GROUPED_MAX_GROUPS], OC_array[CUBLAS_GROUPED_MAX_GROUPS], rows_array[CUBLAS_GROUPED_MAX_GROUPS];
    for (int i = 0; i < count; i++) {
        const int g = active[i];
        const floatX* dout_g = dout + (size_t)offsets.start[g] * OC;
        dinp_pointers[i] = (void*)(weight + (size_t)g * OC * C);
        dinp_pointers[count + i] = (void*)dout_g;
        dinp_pointers[2 * count + i] = dinp + (size_t)offsets.start[g] * C;
        dweight_pointers[i] = (void*)(inp + (size_t)offsets.start[g] * C);
        dweight_pointers[count + i] = (void*)dout_g;
        dweight_pointers[2 * count + i] = dweight != nullptr ? dweight + (size_t)g * OC * C : nullptr;
        C_array[i] = C;
        OC_array[i] = OC;
        rows_array[i] = rows[g];
    }
    void* const* pointers = matmul_grouped_upload(6 * count, stream);
    matmul_grouped_gemm(pointers, count, C_array, rows_array, OC_array, false, false, C, OC, C, accumulate, stream);
    if (pre_gelu != nullptr) {
        gelu_backward_inplace(dinp, pre_gelu, (size_t)offsets.start[groups] * C, stream);
    }
    if (dweight != nullptr)  // NULL: frozen experts (fine-tuning), only the input's gradient is wanted
        matmul_grouped_gemm(pointers + 3 * count, count, C_array, OC_array, rows_array, false, true, C, OC, C, true,
                            stream);
}
