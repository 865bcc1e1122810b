// llmc/flash_attention.cuh: causal multi-head self-attention without the (B, NH, T, T) matrix, written by hand
// after FlashAttention-2 (Dao, 2023): queries and keys are tiled through shared memory, the softmax is kept online
// (a running max and sum per query row), and the forward pass stores only the output and the per-row log-sum-exp
// of the scaled scores (B, NH, T) floats; the backward pass recomputes the scores tile by tile from it.
// Same inputs, outputs and statistics as llmc/cudnn_att.cuh (q, k, v read in place from the packed (B, T, 3C)
// qkv, out (B, T, C), stats = max + log(sum exp) of scale * q.k over the attended keys), so a trainer can swap
// one for the other; unlike cuDNN it runs in fp32, bf16 and fp16 and on the CPU backend.
// Included by the trainers (-fa 1, their default without cuDNN) and by its labs; no library needed (nvcc or
// cpu/cucc). Lab files:
// dev/cuda/flash_attention_forward.cu, dev/cuda/flash_attention_backward.cu.
//
// Scheme. A block owns FLASH_ROWS rows of one (batch row, head), one row per thread: queries in the forward
// pass and in the dq pass, keys in the dk/dv pass. It streams the other side through shared memory FLASH_TILE
// rows at a time, as floats (inputs are converted once, on load; every sum is fp32 whatever floatX is). Tiles
// wholly above the causal diagonal are never loaded. The backward pass is deterministic without atomics: one
// kernel over query blocks computes dq (and delta = rowsum(dout * out), which the other needs), then one over
// key blocks computes dk and dv; each gradient element is summed by one thread in a fixed order. The price is
// recomputing the scores and dout.v^T in both passes: 7 tile products per (query, key) tile pair instead of 5.
//
// Both layouts of a streamed tile are kept in shared memory where a product needs them, so that every inner
// loop is an axpy over contiguous floats (one thread's scores over a tile's rows, or its accumulator over HS):
// on the GPU all threads of a warp read the same shared address (a broadcast), on the CPU backend the loops
// vectorize. Own rows are stored transposed, (HS, FLASH_ROWS), so a warp reading its rows' element d hits
// consecutive banks. A thread's scores live in registers (one per tile row, the loops over them unrolled); its
// probabilities (and ds) then go to its own column of shared memory, so that the loop accumulating them times
// a tile row stays rolled: one iteration per tile row, HS FMAs each. Unrolling it too would make each kernel
// FLASH_TILE * HS FMAs of straight-line code, and nvcc minutes per file.
//
// This is the portable path: plain fp32 FMAs on every GPU and precision. A tensor-core path (mma.sync or WMMA
// for bf16/fp16 on sm_80+) is not here because the CPU backend, where every test runs, could not run it: g++
// cannot compile mma.sync's inline PTX, and cpu/include has no nvcuda::wmma (fragments, load_matrix_sync,
// mma_sync, store_matrix_sync), which it would have to emulate first.
// Registers (nvcc 13, sm_80 and sm_90): at most 255 per thread and no spills, except dk/dv at HS = 128,
// whose two accumulators (256 floats) cannot fit and live in local memory.
#pragma once
#include <math.h>
#include "common.cuh"

constexpr int FLASH_ROWS = 64;  // rows a block owns, one per thread (the block size)
constexpr int FLASH_TILE = 32;  // rows of a streamed tile

// the head sizes with a compiled kernel (the switches in flash_attention_forward and flash_attention_backward)
bool flash_attention_support(int C, int NH, char* why, size_t why_size) {
    if (NH < 1 || C < 1 || C % NH != 0) {
        snprintf(why, why_size, "channels C=%d must be a positive multiple of the head count NH=%d", C, NH);
        return false;
    }
    const int HS = C / NH;
    if (HS != 16 && HS != 32 && HS != 64 && HS != 128) {
        snprintf(why, why_size, "flash attention: head size C/NH=%d must be 16, 32, 64 or 128", HS);
        return false;
    }
    return true;
}

// Shared memory in bytes of each kernel for head size HS (the layouts are in the kernels)
static size_t flash_forward_shared_bytes(int HS) {
    return sizeof(float) * (HS * (FLASH_ROWS + 2 * FLASH_TILE) + FLASH_TILE * FLASH_ROWS);
}
static size_t flash_dq_shared_bytes(int HS) {
    return sizeof(float) * (HS * (2 * FLASH_ROWS + 3 * FLASH_TILE) + FLASH_TILE * FLASH_ROWS);
}
static size_t flash_dkv_shared_bytes(int HS) {
    return sizeof(float) * (HS * (2 * FLASH_ROWS + 4 * FLASH_TILE) + 2 * FLASH_TILE + 2 * FLASH_TILE * FLASH_ROWS);
}

// ----------------------------------------------------------------------------------------------------
// Rows [row0, row0 + ROWS) of one head of a (B, T, ...) tensor, times `scale`, into shared memory as floats:
// row-major (ROWS, HS) into row_major and/or transposed (HS, ROWS) into transposed (either may be null).
// `head` points at element 0 of the head at position 0 of the batch row; consecutive positions are row_stride
// elements apart (3C in the packed qkv, C in out and dout). Rows at or past T are zeros, so that a masked
// score or probability is never multiplied by a NaN. The whole block takes part; consecutive threads take
// consecutive 16-byte chunks, so each row is read as one contiguous run of HS elements.
template <int HS, int ROWS>
__device__ void flash_load_rows(float* row_major, float* transposed, const floatX* head, int row_stride, int row0,
                                int T, float scale) {
    constexpr int chunks_per_row = HS / x128::size;
    for (int chunk = threadIdx.x; chunk < ROWS * chunks_per_row; chunk += blockDim.x) {
        const int r = chunk / chunks_per_row;
        const int d0 = (chunk % chunks_per_row) * x128::size;
        float values[x128::size];
        if (row0 + r < T) {
            const x128 packed = load128(head + (size_t)(row0 + r) * row_stride + d0);
            for (int k = 0; k < x128::size; k++) values[k] = (float)packed[k] * scale;
        } else {
            for (int k = 0; k < x128::size; k++) values[k] = 0.0f;
        }
        if (row_major != nullptr)
            for (int k = 0; k < x128::size; k++) row_major[r * HS + d0 + k] = values[k];
        if (transposed != nullptr)
            for (int k = 0; k < x128::size; k++) transposed[(d0 + k) * ROWS + r] = values[k];
    }
}

// y (N) += a[0] * x[0, :] + a[a_stride] * x[1, :] + a[2 a_stride] * x[2, :] + a[3 a_stride] * x[3, :], x's rows
// x_stride apart, added in that order: every product below is a sum of such steps. Four rows at a time so that
// the CPU backend loads and stores y[n] once per four FMAs (y stays in registers on the GPU either way); the
// order of the additions is that of one row at a time.
template <int N>
__device__ inline void flash_add_rows4(float* y, const float* a, int a_stride, const float* x, int x_stride) {
    const float a0 = a[0], a1 = a[a_stride], a2 = a[2 * a_stride], a3 = a[3 * a_stride];
#pragma unroll
    for (int n = 0; n < N; n++)
        y[n] = y[n] + a0 * x[n] + a1 * x[x_stride + n] + a2 * x[2 * x_stride + n] + a3 * x[3 * x_stride + n];
}

// Both backward kernels' two products of a thread's own row against a streamed tile, over HS: s (FLASH_TILE) =
// own . tile and dp (FLASH_TILE) = own2 . tile2 (own rows transposed, (HS, FLASH_ROWS); tile rows (HS, FLASH_TILE))
template <int HS>
__device__ __forceinline__ void flash_scores_and_dp(float* s, float* dp, const float* own_t, const float* tile_t,
                                                    const float* own2_t, const float* tile2_t) {
#pragma unroll
    for (int j = 0; j < FLASH_TILE; j++) s[j] = dp[j] = 0.0f;
    for (int d = 0; d < HS; d += 4) {
        flash_add_rows4<FLASH_TILE>(s, own_t + d * FLASH_ROWS + threadIdx.x, FLASH_ROWS, tile_t + d * FLASH_TILE,
                                    FLASH_TILE);
        flash_add_rows4<FLASH_TILE>(dp, own2_t + d * FLASH_ROWS + threadIdx.x, FLASH_ROWS, tile2_t + d * FLASH_TILE,
                                    FLASH_TILE);
    }
}

// ----------------------------------------------------------------------------------------------------
// Forward. Block (query block, head h, batch row b); thread i of the block owns query q0 + i. Scores are kept in
// base 2: q is scaled by scale * log2(e) on load, so p = exp2(s - m) with s = q.k in those units.
// Per key tile: s (FLASH_TILE) = q . k_t, the running max m and sum l rescaled by exp2(m_old - m_new), and
// acc (HS) += p * v. stats = (m + log2(l)) * ln(2), the natural log-sum-exp of scale * q.k.
// Floor: 2 * B*NH*T*T*HS flops (two products, halved by the causal mask); bytes (3 + 1) * B*T*C * sizeof(floatX)
// (qkv read, out written) + 4 * B*NH*T (stats), with K and V re-read from L2 by every query block.
template <int HS>
__global__ void __launch_bounds__(FLASH_ROWS)
    flash_attention_forward_kernel(floatX* out, float* stats, const floatX* inp, int T, int NH, float scale_log2) {
    extern __shared__ float flash_forward_shared[];
    float* q_t = flash_forward_shared;     // (HS, FLASH_ROWS) this block's queries, times scale * log2(e)
    float* k_t = q_t + HS * FLASH_ROWS;    // (HS, FLASH_TILE) the key tile, transposed
    float* v_tile = k_t + HS * FLASH_TILE;  // (FLASH_TILE, HS) the value tile
    float* p_t = v_tile + FLASH_TILE * HS;  // (FLASH_TILE, FLASH_ROWS) each thread's probabilities, in its column
    const int C = NH * HS;
    const int h = blockIdx.y, b = blockIdx.z;
    // the longest query blocks (most key tiles) start first, so that short ones fill the tail
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FLASH_ROWS;
    const int query = q0 + threadIdx.x;
    const floatX* q_head = inp + (size_t)b * T * 3 * C + h * HS;
    flash_load_rows<HS, FLASH_ROWS>(nullptr, q_t, q_head, 3 * C, q0, T, scale_log2);

    float acc[HS];
    for (int d = 0; d < HS; d++) acc[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const int last_key = min(q0 + FLASH_ROWS, T) - 1;  // key tiles past it are masked for every query here
    for (int k0 = 0; k0 <= last_key; k0 += FLASH_TILE) {
        __syncthreads();  // every thread is done with the previous tile
        flash_load_rows<HS, FLASH_TILE>(nullptr, k_t, q_head + C, 3 * C, k0, T, 1.0f);
        flash_load_rows<HS, FLASH_TILE>(v_tile, nullptr, q_head + 2 * C, 3 * C, k0, T, 1.0f);
        __syncthreads();
        float s[FLASH_TILE];
#pragma unroll
        for (int j = 0; j < FLASH_TILE; j++) s[j] = 0.0f;
        for (int d = 0; d < HS; d += 4)
            flash_add_rows4<FLASH_TILE>(s, q_t + d * FLASH_ROWS + threadIdx.x, FLASH_ROWS, k_t + d * FLASH_TILE,
                                        FLASH_TILE);
        // key 0 is in the first tile and attended by every query, so m is finite from the first tile on and
        // exp2(m_old - m_new) is 0 there (acc and l are 0 anyway), never NaN
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < FLASH_TILE; j++) {
            if (k0 + j > query) s[j] = -INFINITY;
            tile_max = fmaxf(tile_max, s[j]);
        }
        const float m_new = fmaxf(m, tile_max);
        const float correction = exp2f(m - m_new);
        l *= correction;
#pragma unroll
        for (int d = 0; d < HS; d++) acc[d] *= correction;
#pragma unroll
        for (int j = 0; j < FLASH_TILE; j++) {
            const float p = k0 + j <= query ? exp2f(s[j] - m_new) : 0.0f;
            l += p;
            p_t[j * FLASH_ROWS + threadIdx.x] = p;
        }
        for (int j = 0; j < FLASH_TILE; j += 4)
            flash_add_rows4<HS>(acc, p_t + j * FLASH_ROWS + threadIdx.x, FLASH_ROWS, v_tile + j * HS, HS);
        m = m_new;
    }
    if (query >= T) return;
    const float inverse_l = 1.0f / l;
    floatX* out_row = out + ((size_t)b * T + query) * C + h * HS;
#pragma unroll
    for (int d0 = 0; d0 < HS; d0 += x128::size) {
        x128 packed;
        for (int k = 0; k < x128::size; k++) packed[k] = (floatX)(acc[d0 + k] * inverse_l);
        store128(out_row + d0, packed);
    }
    stats[((size_t)b * NH + h) * T + query] = (m + log2f(l)) * 0.693147180559945f;
}

// ----------------------------------------------------------------------------------------------------
// Backward, with p = exp2(s - stats * log2(e)) recomputed from the stored statistics, dp = dout . v,
// ds = p * (dp - delta) where delta = rowsum(dout * out) (= sum_k p * dp, the softmax backward's row dot), and
// dq = scale * ds k, dk = scale * ds^T q, dv = p^T dout.
// Floor: 5 products of 2 * B*NH*T*T*HS flops halved by the mask = 5 * B*NH*T*T*HS (2.5 times the forward; this
// path does 7, the price of determinism without atomics); bytes (3 + 1 + 1 + 3) * B*T*C * sizeof(floatX) (qkv,
// out, dout read, dinp written) + 12 * B*NH*T (stats read, delta written and read).

// dq pass. Block (query block, h, b); thread i owns query q0 + i; it also writes delta for its query, which the
// dk/dv pass reads. Per key tile: s and dp (FLASH_TILE) from the transposed k and v tiles, then dq (HS) += ds * k.
template <int HS>
__global__ void __launch_bounds__(FLASH_ROWS)
    flash_attention_backward_dq_kernel(floatX* dinp, float* delta, const floatX* dout, const floatX* inp,
                                       const floatX* out, const float* stats, int T, int NH, float scale_log2,
                                       float scale) {
    extern __shared__ float flash_dq_shared[];
    float* q_t = flash_dq_shared;               // (HS, FLASH_ROWS) this block's queries, times scale * log2(e)
    float* dout_t = q_t + HS * FLASH_ROWS;      // (HS, FLASH_ROWS) their output gradients
    float* k_t = dout_t + HS * FLASH_ROWS;      // (HS, FLASH_TILE) the key tile, transposed
    float* k_tile = k_t + HS * FLASH_TILE;      // (FLASH_TILE, HS) the key tile
    float* v_t = k_tile + HS * FLASH_TILE;      // (HS, FLASH_TILE) the value tile, transposed
    float* ds_t = v_t + HS * FLASH_TILE;        // (FLASH_TILE, FLASH_ROWS) each thread's ds, in its column
    const int C = NH * HS;
    const int h = blockIdx.y, b = blockIdx.z;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FLASH_ROWS;
    const int query = q0 + threadIdx.x;
    const floatX* q_head = inp + (size_t)b * T * 3 * C + h * HS;
    flash_load_rows<HS, FLASH_ROWS>(nullptr, q_t, q_head, 3 * C, q0, T, scale_log2);
    flash_load_rows<HS, FLASH_ROWS>(nullptr, dout_t, dout + (size_t)b * T * C + h * HS, C, q0, T, 1.0f);
    __syncthreads();

    // this query's base-2 log-sum-exp and delta; a query past T keeps 0s (its p is masked to 0 below)
    const size_t row = ((size_t)b * NH + h) * T + query;
    float stat_log2 = 0.0f, row_delta = 0.0f;
    if (query < T) {
        stat_log2 = stats[row] * 1.44269504088896f;
        const floatX* out_row = out + ((size_t)b * T + query) * C + h * HS;
        for (int d0 = 0; d0 < HS; d0 += x128::size) {
            const x128 packed = load128(out_row + d0);
            for (int k = 0; k < x128::size; k++)
                row_delta += dout_t[(d0 + k) * FLASH_ROWS + threadIdx.x] * (float)packed[k];
        }
        delta[row] = row_delta;
    }

    float dq[HS];
    for (int d = 0; d < HS; d++) dq[d] = 0.0f;
    const int last_key = min(q0 + FLASH_ROWS, T) - 1;
    for (int k0 = 0; k0 <= last_key; k0 += FLASH_TILE) {
        __syncthreads();
        flash_load_rows<HS, FLASH_TILE>(k_tile, k_t, q_head + C, 3 * C, k0, T, 1.0f);
        flash_load_rows<HS, FLASH_TILE>(nullptr, v_t, q_head + 2 * C, 3 * C, k0, T, 1.0f);
        __syncthreads();
        float s[FLASH_TILE], dp[FLASH_TILE];
        flash_scores_and_dp<HS>(s, dp, q_t, k_t, dout_t, v_t);
#pragma unroll
        for (int j = 0; j < FLASH_TILE; j++) {
            const float p = (k0 + j <= query && query < T) ? exp2f(s[j] - stat_log2) : 0.0f;
            ds_t[j * FLASH_ROWS + threadIdx.x] = p * (dp[j] - row_delta);
        }
        for (int j = 0; j < FLASH_TILE; j += 4)
            flash_add_rows4<HS>(dq, ds_t + j * FLASH_ROWS + threadIdx.x, FLASH_ROWS, k_tile + j * HS, HS);
    }
    if (query >= T) return;
    floatX* dq_row = dinp + ((size_t)b * T + query) * 3 * C + h * HS;
#pragma unroll
    for (int d0 = 0; d0 < HS; d0 += x128::size) {
        x128 packed;
        for (int k = 0; k < x128::size; k++) packed[k] = (floatX)(dq[d0 + k] * scale);
        store128(dq_row + d0, packed);
    }
}

// dk/dv pass. Block (key block, h, b); thread j owns key k0 + j. Query tiles from the one holding query k0 (the
// first that attends it) to the end. Per query tile: s and dp (FLASH_TILE) from the transposed q and dout tiles,
// then dv (HS) += p * dout and dk (HS) += ds * q from their row-major copies.
template <int HS>
__global__ void __launch_bounds__(FLASH_ROWS)
    flash_attention_backward_dkv_kernel(floatX* dinp, const floatX* dout, const floatX* inp, const float* stats,
                                        const float* delta, int T, int NH, float scale_log2, float scale) {
    extern __shared__ float flash_dkv_shared[];
    float* k_t = flash_dkv_shared;                 // (HS, FLASH_ROWS) this block's keys, times scale * log2(e)
    float* v_t = k_t + HS * FLASH_ROWS;            // (HS, FLASH_ROWS) their values
    float* q_t = v_t + HS * FLASH_ROWS;            // (HS, FLASH_TILE) the query tile, transposed
    float* q_tile = q_t + HS * FLASH_TILE;         // (FLASH_TILE, HS) the query tile
    float* dout_t = q_tile + HS * FLASH_TILE;      // (HS, FLASH_TILE) its output gradients, transposed
    float* dout_tile = dout_t + HS * FLASH_TILE;   // (FLASH_TILE, HS) its output gradients
    float* stat_log2 = dout_tile + HS * FLASH_TILE;  // (FLASH_TILE) its base-2 log-sum-exps
    float* tile_delta = stat_log2 + FLASH_TILE;    // (FLASH_TILE) its deltas
    float* p_t = tile_delta + FLASH_TILE;          // (FLASH_TILE, FLASH_ROWS) each thread's p, in its column
    float* ds_t = p_t + FLASH_TILE * FLASH_ROWS;   // (FLASH_TILE, FLASH_ROWS) and ds
    const int C = NH * HS;
    const int h = blockIdx.y, b = blockIdx.z;
    // blocks of early keys are attended by the most queries: in block order they start first
    const int k0 = blockIdx.x * FLASH_ROWS;
    const int key = k0 + threadIdx.x;
    const floatX* q_head = inp + (size_t)b * T * 3 * C + h * HS;
    const floatX* dout_head = dout + (size_t)b * T * C + h * HS;
    const float* head_stats = stats + ((size_t)b * NH + h) * T;
    const float* head_delta = delta + ((size_t)b * NH + h) * T;
    flash_load_rows<HS, FLASH_ROWS>(nullptr, k_t, q_head + C, 3 * C, k0, T, scale_log2);
    flash_load_rows<HS, FLASH_ROWS>(nullptr, v_t, q_head + 2 * C, 3 * C, k0, T, 1.0f);

    float dk[HS], dv[HS];
    for (int d = 0; d < HS; d++) dk[d] = dv[d] = 0.0f;
    for (int q0 = k0 / FLASH_TILE * FLASH_TILE; q0 < T; q0 += FLASH_TILE) {
        __syncthreads();
        flash_load_rows<HS, FLASH_TILE>(q_tile, q_t, q_head, 3 * C, q0, T, 1.0f);
        flash_load_rows<HS, FLASH_TILE>(dout_tile, dout_t, dout_head, C, q0, T, 1.0f);
        for (int i = threadIdx.x; i < FLASH_TILE; i += blockDim.x) {
            stat_log2[i] = q0 + i < T ? head_stats[q0 + i] * 1.44269504088896f : 0.0f;
            tile_delta[i] = q0 + i < T ? head_delta[q0 + i] : 0.0f;
        }
        __syncthreads();
        float s[FLASH_TILE], dp[FLASH_TILE];
        flash_scores_and_dp<HS>(s, dp, k_t, q_t, v_t, dout_t);
#pragma unroll
        for (int i = 0; i < FLASH_TILE; i++) {
            // query q0 + i attends this key when it is not before it; queries past T are zero rows, masked too
            const float p = (q0 + i >= key && q0 + i < T) ? exp2f(s[i] - stat_log2[i]) : 0.0f;
            p_t[i * FLASH_ROWS + threadIdx.x] = p;
            ds_t[i * FLASH_ROWS + threadIdx.x] = p * (dp[i] - tile_delta[i]);
        }
        for (int i = 0; i < FLASH_TILE; i += 4) {
            flash_add_rows4<HS>(dv, p_t + i * FLASH_ROWS + threadIdx.x, FLASH_ROWS, dout_tile + i * HS, HS);
            flash_add_rows4<HS>(dk, ds_t + i * FLASH_ROWS + threadIdx.x, FLASH_ROWS, q_tile + i * HS, HS);
        }
    }
    if (key >= T) return;
    floatX* dk_row = dinp + ((size_t)b * T + key) * 3 * C + C + h * HS;
    floatX* dv_row = dk_row + C;
#pragma unroll
    for (int d0 = 0; d0 < HS; d0 += x128::size) {
        x128 packed_k, packed_v;
        for (int k = 0; k < x128::size; k++) {
            packed_k[k] = (floatX)(dk[d0 + k] * scale);
            packed_v[k] = (floatX)dv[d0 + k];
        }
        store128(dk_row + d0, packed_k);
        store128(dv_row + d0, packed_v);
    }
}

// ----------------------------------------------------------------------------------------------------
// Launchers, one instance per head size. Over 48 KiB of shared memory a kernel must opt in (the forward at
// HS = 128, the backward from HS = 64, dk/dv from HS = 32); the largest, 144.25 KiB (dk/dv at HS = 128), fits
// sm_80's 163 KiB and sm_90's 227.

template <int HS>
static void flash_attention_forward_launch(floatX* out, float* stats, const floatX* inp, int B, int T, int NH,
                                           cudaStream_t stream) {
    const size_t shared_bytes = flash_forward_shared_bytes(HS);
    if (shared_bytes > 48 * 1024) {
        cudaCheck(cudaFuncSetAttribute(flash_attention_forward_kernel<HS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)shared_bytes));
    }
    const dim3 grid(CEIL_DIV(T, FLASH_ROWS), NH, B);
    const float scale_log2 = 1.44269504088896f / sqrtf((float)HS);
    flash_attention_forward_kernel<HS><<<grid, FLASH_ROWS, shared_bytes, stream>>>(out, stats, inp, T, NH, scale_log2);
    cudaCheck(cudaGetLastError());
}

template <int HS>
static void flash_attention_backward_launch(floatX* dinp, float* delta, const floatX* dout, const floatX* inp,
                                            const floatX* out, const float* stats, int B, int T, int NH,
                                            cudaStream_t stream) {
    const size_t dq_bytes = flash_dq_shared_bytes(HS), dkv_bytes = flash_dkv_shared_bytes(HS);
    if (dq_bytes > 48 * 1024) {
        cudaCheck(cudaFuncSetAttribute(flash_attention_backward_dq_kernel<HS>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dq_bytes));
    }
    if (dkv_bytes > 48 * 1024) {
        cudaCheck(cudaFuncSetAttribute(flash_attention_backward_dkv_kernel<HS>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dkv_bytes));
    }
    const dim3 grid(CEIL_DIV(T, FLASH_ROWS), NH, B);
    const float scale = 1.0f / sqrtf((float)HS);
    const float scale_log2 = 1.44269504088896f * scale;
    flash_attention_backward_dq_kernel<HS><<<grid, FLASH_ROWS, dq_bytes, stream>>>(dinp, delta, dout, inp, out, stats,
                                                                                    T, NH, scale_log2, scale);
    cudaCheck(cudaGetLastError());
    flash_attention_backward_dkv_kernel<HS><<<grid, FLASH_ROWS, dkv_bytes, stream>>>(dinp, dout, inp, stats, delta, T,
                                                                                      NH, scale_log2, scale);
    cudaCheck(cudaGetLastError());
}

static void flash_attention_require_support(const char* function, int C, int NH, const void* a, const void* b,
                                            const void* c, const void* d) {
    char why[256];
    if (!flash_attention_support(C, NH, why, sizeof(why))) {
        fprintf(stderr, "%s: %s\n", function, why);
        exit(EXIT_FAILURE);
    }
    if ((uintptr_t)a % 16 || (uintptr_t)b % 16 || (uintptr_t)c % 16 || (uintptr_t)d % 16) {
        fprintf(stderr, "%s: buffers must be 16-byte aligned\n", function);
        exit(EXIT_FAILURE);
    }
}

// out (B, T, C) and stats (B, NH, T) fp32 from inp (B, T, 3C) = [q | k | v] per position
void flash_attention_forward(floatX* out, float* stats, const floatX* inp, int B, int T, int NH, int C,
                             cudaStream_t stream) {
    flash_attention_require_support("flash_attention_forward", C, NH, out, stats, inp, nullptr);
    switch (C / NH) {
        case 16: flash_attention_forward_launch<16>(out, stats, inp, B, T, NH, stream); break;
        case 32: flash_attention_forward_launch<32>(out, stats, inp, B, T, NH, stream); break;
        case 64: flash_attention_forward_launch<64>(out, stats, inp, B, T, NH, stream); break;
        case 128: flash_attention_forward_launch<128>(out, stats, inp, B, T, NH, stream); break;
    }
}

// dinp (B, T, 3C) = [dq | dk | dv], overwritten, from dout (B, T, C) and the forward pass's inp, out and stats;
// delta: scratch of B * NH * T floats
void flash_attention_backward(floatX* dinp, float* delta, const floatX* dout, const floatX* inp, const floatX* out,
                              const float* stats, int B, int T, int NH, int C, cudaStream_t stream) {
    flash_attention_require_support("flash_attention_backward", C, NH, dinp, delta, dout, inp);
    flash_attention_require_support("flash_attention_backward", C, NH, out, stats, nullptr, nullptr);
    switch (C / NH) {
        case 16: flash_attention_backward_launch<16>(dinp, delta, dout, inp, out, stats, B, T, NH, stream); break;
        case 32: flash_attention_backward_launch<32>(dinp, delta, dout, inp, out, stats, B, T, NH, stream); break;
        case 64: flash_attention_backward_launch<64>(dinp, delta, dout, inp, out, stats, B, T, NH, stream); break;
        case 128: flash_attention_backward_launch<128>(dinp, delta, dout, inp, out, stats, B, T, NH, stream); break;
    }
}
