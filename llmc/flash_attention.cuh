// llmc/flash_attention.cuh: causal multi-head or grouped-query self-attention without the (B, NH, T, T) matrix,
// written by hand after FlashAttention-2 (Dao, 2023): queries and keys are tiled through shared memory, the
// softmax is kept online (a running max and sum per query row), and the forward pass stores only the output and
// the per-row log-sum-exp of the scaled scores (B, NH, T) floats; the backward pass recomputes the scores tile by
// tile from it.
// Same inputs, outputs and statistics as llmc/cudnn_att.cuh (q, k, v read in place from the packed qkv
// (B, T, (NH + 2 NKV) HS) of doc/attention.md, out (B, T, C = NH HS), stats = max + log(sum exp) of scale * q.k
// over the attended keys), so a trainer can swap one for the other (cuDNN's wrapper takes NKV = NH only); unlike
// cuDNN it runs in fp32, bf16 and fp16 and on the CPU backend.
// Included by the trainers (-fa 1, their default without cuDNN) and by its labs; no library needed (nvcc or
// cpu/cucc). Lab files:
// dev/cuda/flash_attention_forward.cu, dev/cuda/flash_attention_backward.cu.
//
// Two sets of kernels. The first below runs its products on the fp32 cores (plain FMAs): every precision, every
// GPU, and the trainers' path in fp32. The second, further down, runs them on tensor cores through nvcuda::wmma
// (bf16 and fp16 on sm_80+; the CPU backend emulates it in cpu/include/mma.h): the trainers' path in bf16 and fp16.
// flash_attention_forward and flash_attention_backward choose by precision (FLASH_DEFAULT_CORES); a caller may ask
// for the fp32 cores in any precision (the labs compare both).
//
// The fp32-core scheme. A block owns FLASH_ROWS rows of one (batch row, head), one row per thread: queries in the forward
// pass and in the dq pass, keys in the dk/dv pass. It streams the other side through shared memory FLASH_TILE
// rows at a time, as floats (inputs are converted once, on load; every sum is fp32 whatever floatX is). Tiles
// wholly above the causal diagonal are never loaded. The backward pass is deterministic without atomics: one
// kernel over query blocks computes dq (and delta = rowsum(dout * out), which the other needs), then one over
// key blocks computes dk and dv; each gradient element is summed by one thread in a fixed order. The price is
// recomputing the scores and dout.v^T in both passes: 7 tile products per (query, key) tile pair instead of 5.
//
// Grouped-query attention (NKV key/value heads, NH a multiple of NKV): query head h attends with key/value head
// h / (NH / NKV). The forward and dq passes keep a block per (query block, query head) and only read k and v from
// that head. dk and dv of a key/value head sum over its NH / NKV query heads; to keep that deterministic without
// atomics, the dk/dv pass (both kernel sets) has a block per (key block, key/value head) which loops over the
// group's query heads in order, each over its query tiles as with NKV = NH, accumulating in the same registers
// (fragments): no extra buffer, no extra kernel, the same tile products in all, and the block's keys and values
// loaded once per group instead of once per query head. The price is parallelism: NH / NKV times fewer dk/dv
// blocks, each NH / NKV times longer (GPT-2 124M sizes with NKV = 4: B=8 * 4 * 16 key blocks = 512 blocks of 4
// heads' work). The alternative, a block per query head writing fp32 partial dk, dv (B, NH, T, 2 HS) and a
// reduction kernel summing each group in order, keeps the NH-wide grid but writes and reads 16 * B*NH*T*HS bytes
// more and adds a launch. With NKV = NH every kernel does exactly what it did before, bit for bit.
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
// Registers of the fp32-core kernels (nvcc 13, sm_80 and sm_90): at most 255 per thread and no spills, except dk/dv
// at HS = 128, whose two accumulators (256 floats) cannot fit and live in local memory.
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-flash_attention_forward_{bf16,fp32},
// lab-flash_attention_backward_{bf16,fp32} and their lab-check- twins; gpt-*, llama-* and moe-* (the trainers'
// default attention against PyTorch).
#pragma once
#include <math.h>
#include "common.cuh"

constexpr int FLASH_ROWS = 64;  // rows a block owns, one per thread (the block size)
constexpr int FLASH_TILE = 32;  // rows of a streamed tile

// the head sizes with a compiled kernel (the switches in flash_attention_forward and flash_attention_backward)
bool flash_attention_support(int C, int NH, int NKV, char* why, size_t why_size) {
    if (NH < 1 || C < 1 || C % NH != 0) {
        snprintf(why, why_size, "channels C=%d must be a positive multiple of the head count NH=%d", C, NH);
        return false;
    }
    if (NKV < 1 || NH % NKV != 0) {
        snprintf(why, why_size, "the query head count NH=%d must be a multiple of the key/value head count NKV=%d", NH,
                 NKV);
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
// elements apart ((NH + 2 NKV) HS in the packed qkv, C in out and dout). Rows at or past T are zeros, so that a masked
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
// Floor: 2 * B*NH*T*T*HS flops (two products, halved by the causal mask); bytes (NH + 2 NKV + NH) * B*T*HS *
// sizeof(floatX) (qkv read, out written; (3 + 1) * B*T*C when NKV = NH) + 4 * B*NH*T (stats), with K and V re-read
// from L2 by every query block of every query head they serve.
template <int HS>
__global__ void __launch_bounds__(FLASH_ROWS)
    flash_attention_forward_kernel(floatX* out, float* stats, const floatX* inp, int T, int NH, int NKV,
                                   float scale_log2) {
    extern __shared__ float flash_forward_shared[];
    float* q_t = flash_forward_shared;     // (HS, FLASH_ROWS) this block's queries, times scale * log2(e)
    float* k_t = q_t + HS * FLASH_ROWS;    // (HS, FLASH_TILE) the key tile, transposed
    float* v_tile = k_t + HS * FLASH_TILE;  // (FLASH_TILE, HS) the value tile
    float* p_t = v_tile + FLASH_TILE * HS;  // (FLASH_TILE, FLASH_ROWS) each thread's probabilities, in its column
    const int C = NH * HS, row_stride = (NH + 2 * NKV) * HS;
    const int h = blockIdx.y, b = blockIdx.z;
    // the longest query blocks (most key tiles) start first, so that short ones fill the tail
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FLASH_ROWS;
    const int query = q0 + threadIdx.x;
    const floatX* q_head = inp + (size_t)b * T * row_stride + h * HS;
    const floatX* k_head = inp + (size_t)b * T * row_stride + (NH + h / (NH / NKV)) * HS;
    const floatX* v_head = k_head + NKV * HS;
    flash_load_rows<HS, FLASH_ROWS>(nullptr, q_t, q_head, row_stride, q0, T, scale_log2);

    float acc[HS];
    for (int d = 0; d < HS; d++) acc[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const int last_key = min(q0 + FLASH_ROWS, T) - 1;  // key tiles past it are masked for every query here
    for (int k0 = 0; k0 <= last_key; k0 += FLASH_TILE) {
        __syncthreads();  // every thread is done with the previous tile
        flash_load_rows<HS, FLASH_TILE>(nullptr, k_t, k_head, row_stride, k0, T, 1.0f);
        flash_load_rows<HS, FLASH_TILE>(v_tile, nullptr, v_head, row_stride, k0, T, 1.0f);
        __syncthreads();
        if (query >= T) continue;  // a row past T (the last block's) only helps load the tiles
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
// path does 7, the price of determinism without atomics); bytes (2 (NH + 2 NKV) + 2 NH) * B*T*HS * sizeof(floatX)
// (qkv, out, dout read, dinp written; (3 + 1 + 1 + 3) * B*T*C when NKV = NH) + 12 * B*NH*T (stats read, delta
// written and read).

// dq pass. Block (query block, h, b); thread i owns query q0 + i; it also writes delta for its query, which the
// dk/dv pass reads. Per key tile: s and dp (FLASH_TILE) from the transposed k and v tiles, then dq (HS) += ds * k.
template <int HS>
__global__ void __launch_bounds__(FLASH_ROWS)
    flash_attention_backward_dq_kernel(floatX* dinp, float* delta, const floatX* dout, const floatX* inp,
                                       const floatX* out, const float* stats, int T, int NH, int NKV,
                                       float scale_log2, float scale) {
    extern __shared__ float flash_dq_shared[];
    float* q_t = flash_dq_shared;               // (HS, FLASH_ROWS) this block's queries, times scale * log2(e)
    float* dout_t = q_t + HS * FLASH_ROWS;      // (HS, FLASH_ROWS) their output gradients
    float* k_t = dout_t + HS * FLASH_ROWS;      // (HS, FLASH_TILE) the key tile, transposed
    float* k_tile = k_t + HS * FLASH_TILE;      // (FLASH_TILE, HS) the key tile
    float* v_t = k_tile + HS * FLASH_TILE;      // (HS, FLASH_TILE) the value tile, transposed
    float* ds_t = v_t + HS * FLASH_TILE;        // (FLASH_TILE, FLASH_ROWS) each thread's ds, in its column
    const int C = NH * HS, row_stride = (NH + 2 * NKV) * HS;
    const int h = blockIdx.y, b = blockIdx.z;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FLASH_ROWS;
    const int query = q0 + threadIdx.x;
    const floatX* q_head = inp + (size_t)b * T * row_stride + h * HS;
    const floatX* k_head = inp + (size_t)b * T * row_stride + (NH + h / (NH / NKV)) * HS;
    const floatX* v_head = k_head + NKV * HS;
    flash_load_rows<HS, FLASH_ROWS>(nullptr, q_t, q_head, row_stride, q0, T, scale_log2);
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
        flash_load_rows<HS, FLASH_TILE>(k_tile, k_t, k_head, row_stride, k0, T, 1.0f);
        flash_load_rows<HS, FLASH_TILE>(nullptr, v_t, v_head, row_stride, k0, T, 1.0f);
        __syncthreads();
        if (query >= T) continue;  // a row past T (the last block's) only helps load the tiles
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
    floatX* dq_row = dinp + ((size_t)b * T + query) * row_stride + h * HS;
#pragma unroll
    for (int d0 = 0; d0 < HS; d0 += x128::size) {
        x128 packed;
        for (int k = 0; k < x128::size; k++) packed[k] = (floatX)(dq[d0 + k] * scale);
        store128(dq_row + d0, packed);
    }
}

// dk/dv pass. Block (key block, key/value head kv, b); thread j owns key k0 + j. For each query head of the group
// kv serves, in order, query tiles from the one holding query k0 (the first that attends it) to the end. Per
// query tile: s and dp (FLASH_TILE) from the transposed q and dout tiles, then dv (HS) += p * dout and
// dk (HS) += ds * q from their row-major copies.
template <int HS>
__global__ void __launch_bounds__(FLASH_ROWS)
    flash_attention_backward_dkv_kernel(floatX* dinp, const floatX* dout, const floatX* inp, const float* stats,
                                        const float* delta, int T, int NH, int NKV, float scale_log2,
                                        float scale) {
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
    const int C = NH * HS, row_stride = (NH + 2 * NKV) * HS, group = NH / NKV;
    const int kv = blockIdx.y, b = blockIdx.z;
    // blocks of early keys are attended by the most queries: in block order they start first
    const int k0 = blockIdx.x * FLASH_ROWS;
    const int key = k0 + threadIdx.x;
    const floatX* k_head = inp + (size_t)b * T * row_stride + (NH + kv) * HS;
    flash_load_rows<HS, FLASH_ROWS>(nullptr, k_t, k_head, row_stride, k0, T, scale_log2);
    flash_load_rows<HS, FLASH_ROWS>(nullptr, v_t, k_head + NKV * HS, row_stride, k0, T, 1.0f);

    float dk[HS], dv[HS];
    for (int d = 0; d < HS; d++) dk[d] = dv[d] = 0.0f;
    for (int h = kv * group; h < (kv + 1) * group; h++) {
        const floatX* q_head = inp + (size_t)b * T * row_stride + h * HS;
        const floatX* dout_head = dout + (size_t)b * T * C + h * HS;
        const float* head_stats = stats + ((size_t)b * NH + h) * T;
        const float* head_delta = delta + ((size_t)b * NH + h) * T;
        for (int q0 = k0 / FLASH_TILE * FLASH_TILE; q0 < T; q0 += FLASH_TILE) {
            __syncthreads();
            flash_load_rows<HS, FLASH_TILE>(q_tile, q_t, q_head, row_stride, q0, T, 1.0f);
            flash_load_rows<HS, FLASH_TILE>(dout_tile, dout_t, dout_head, C, q0, T, 1.0f);
            for (int i = threadIdx.x; i < FLASH_TILE; i += blockDim.x) {
                stat_log2[i] = q0 + i < T ? head_stats[q0 + i] * 1.44269504088896f : 0.0f;
                tile_delta[i] = q0 + i < T ? head_delta[q0 + i] : 0.0f;
            }
            __syncthreads();
            if (key >= T) continue;  // a key past T (the last block's) only helps load the tiles
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
    }
    if (key >= T) return;
    floatX* dk_row = dinp + ((size_t)b * T + key) * row_stride + (NH + kv) * HS;
    floatX* dv_row = dk_row + NKV * HS;
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
// The tensor-core path (bf16 and fp16, sm_80+), after FlashAttention-2 with CUDA's warp matrix API (nvcuda::wmma;
// on the CPU backend cpu/include/mma.h, which checks that the warp calls it together and how it touches memory).
// A block of 4 warps owns 64 rows, 16 per warp; it streams 64-row tiles of the other side through shared memory
// in floatX, and every product is a warp's 16-row strip times a tile, on tensor cores with fp32 accumulators:
//   forward:   s = q k^T; the online softmax by the lanes; o = o * correction + p v
//   dq pass:   s = q k^T, dp = dout v^T; ds = p (dp - delta) by the lanes; dq += ds k
//   dk/dv:     s^T = k q^T, dp^T = v dout^T; p^T, ds^T by the lanes; dv += p^T dout, dk += ds^T q
// A fragment's element-to-lane mapping is unspecified, so the lanes' elementwise work (mask, exp2, rescaling)
// goes through the warp's own shared-memory strips: products are stored there as fp32, the lanes read them by
// rows (lane = 2 * row + half: two lanes per row, half of the columns each, partial row results combined with
// one shuffle) and write p or ds there in floatX for the next product. dq, dk and dv stay in fragments across
// tiles; the forward's o is rescaled every tile, so it lives in the warp's strip as fp32 and is loaded into an
// accumulator fragment for each p v.
// Numerics, as in FlashAttention-2 and cuDNN: the probabilities and ds are rounded to floatX before the second
// product of each pair; every sum is fp32 (tensor-core products of floatX values are exact in fp32). The row sum
// l adds the rounded probabilities, the weights that p v uses, so out stays a convex combination of v's rows.
// Masked work skipped: tiles above the diagonal, on the diagonal tile each warp's columns past its last row, in the
// last block the warps whose rows all lie past T, and in the last tile the 16-column fragments past T.
// Floors as the fp32-core kernels' above; at GPT-2 124M sizes (B=8, T=1024, bf16) the forward's 12.9 GFLOP need
// 13 us at an H100's dense bf16 tensor peak against 190 us on its fp32 cores.
#if !defined(ENABLE_FP32)
#include <mma.h>

constexpr int FLASH_WMMA_ROWS = 64;     // rows a block owns, 16 per warp
constexpr int FLASH_WMMA_TILE = 64;     // rows of a streamed tile (= FLASH_WMMA_ROWS: the diagonal tile is aligned)
constexpr int FLASH_WMMA_THREADS = 128;
// Row padding of the shared-memory matrices, 16 bytes: leading dimensions stay multiples of 16 bytes and 16-row
// offsets multiples of 32 bytes (wmma's requirements), and consecutive rows start in different banks.
constexpr int FLASH_PAD_X = 16 / sizeof(floatX);
constexpr int FLASH_PAD_F = 4;
constexpr int FLASH_LDS = FLASH_WMMA_TILE + FLASH_PAD_F;  // a warp's fp32 strip of a product with a tile
constexpr int FLASH_LDP = FLASH_WMMA_TILE + FLASH_PAD_X;  // a warp's floatX strip of p or ds

// the columns of a tile that hold the rows before T (n of them from the tile's start, n > 0), in whole 16-column
// fragments: the products skip the fragments past T, which are zero rows
__device__ inline int flash_columns_before(int n) { return min(FLASH_WMMA_TILE, (n + 15) / 16 * 16); }

typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, floatX, nvcuda::wmma::row_major> FlashFragA;
typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, floatX, nvcuda::wmma::row_major> FlashFragB;
// x^T for a row-major x: a row-major (N, K) matrix read column-major is its (K, N) transpose
typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, floatX, nvcuda::wmma::col_major> FlashFragBT;
typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> FlashFragC;

// Shared memory in bytes: the block's matrices (floatX rows of HS + FLASH_PAD_X), then 4 warps' strips
static size_t flash_wmma_forward_shared_bytes(int HS) {
    const size_t strips = sizeof(float) * 16 * FLASH_LDS + sizeof(floatX) * 16 * FLASH_LDP +
                          sizeof(float) * 16 * (HS + FLASH_PAD_F);
    return sizeof(floatX) * (FLASH_WMMA_ROWS + 2 * FLASH_WMMA_TILE) * (HS + FLASH_PAD_X) + 4 * strips;
}
static size_t flash_wmma_dq_shared_bytes(int HS) {
    const size_t strips = sizeof(float) * 2 * 16 * FLASH_LDS + sizeof(floatX) * 16 * FLASH_LDP;
    return sizeof(floatX) * (2 * FLASH_WMMA_ROWS + 2 * FLASH_WMMA_TILE) * (HS + FLASH_PAD_X) + 4 * strips;
}
static size_t flash_wmma_dkv_shared_bytes(int HS) {
    const size_t strips = sizeof(float) * 2 * 16 * FLASH_LDS + sizeof(floatX) * 2 * 16 * FLASH_LDP;
    return sizeof(floatX) * (2 * FLASH_WMMA_ROWS + 2 * FLASH_WMMA_TILE) * (HS + FLASH_PAD_X) +
           sizeof(float) * 2 * FLASH_WMMA_TILE + 4 * strips;
}

// Rows [row0, row0 + ROWS) of one head into shared memory as they are, row-major with leading dimension ld; rows
// at or past T are zeros (a masked probability is never multiplied by garbage). The whole block takes part.
template <int HS, int ROWS>
__device__ void flash_copy_rows(floatX* dst, int ld, const floatX* head, int row_stride, int row0, int T) {
    constexpr int chunks_per_row = HS / x128::size;
    for (int chunk = threadIdx.x; chunk < ROWS * chunks_per_row; chunk += blockDim.x) {
        const int r = chunk / chunks_per_row;
        const int d0 = (chunk % chunks_per_row) * x128::size;
        const x128 values = row0 + r < T ? load128(head + (size_t)(row0 + r) * row_stride + d0) : x128::zeros();
        store128(dst + r * ld + d0, values);
    }
}

// The warp's out (16, columns [n_begin, n_end)) fp32 = a (16, K) . x^T for x (rows [n_begin, n_end), K), all
// row-major in shared memory; n_begin and n_end multiples of 16, the same for the whole warp
template <int K>
__device__ void flash_warp_product_abt(float* out, int ld_out, const floatX* a, int ld_a, const floatX* x, int ld_x,
                                       int n_begin, int n_end) {
    FlashFragA a_frag[K / 16];
#pragma unroll
    for (int k = 0; k < K / 16; k++) nvcuda::wmma::load_matrix_sync(a_frag[k], a + 16 * k, ld_a);
    for (int n = n_begin; n < n_end; n += 16) {
        FlashFragC c;
        nvcuda::wmma::fill_fragment(c, 0.0f);
#pragma unroll
        for (int k = 0; k < K / 16; k++) {
            FlashFragBT b;
            nvcuda::wmma::load_matrix_sync(b, x + n * ld_x + 16 * k, ld_x);
            nvcuda::wmma::mma_sync(c, a_frag[k], b, c);
        }
        nvcuda::wmma::store_matrix_sync(out + n, c, ld_out, nvcuda::wmma::mem_row_major);
    }
}

// acc (16, N) fragments += a (16, columns [k_begin, k_end)) . x (rows [k_begin, k_end), N), both row-major in
// shared memory; k_begin and k_end multiples of 16 within [0, FLASH_WMMA_TILE], the same for the whole warp. The
// loops have constant trip counts (fully unrolled, a range test inside) so the fragments stay in registers.
template <int N>
__device__ void flash_warp_product_ab(FlashFragC* acc, const floatX* a, int ld_a, const floatX* x, int ld_x,
                                      int k_begin, int k_end) {
    FlashFragA a_frag[FLASH_WMMA_TILE / 16];
#pragma unroll
    for (int k = 0; k < FLASH_WMMA_TILE / 16; k++)
        if (16 * k >= k_begin && 16 * k < k_end) nvcuda::wmma::load_matrix_sync(a_frag[k], a + 16 * k, ld_a);
#pragma unroll
    for (int n = 0; n < N / 16; n++) {
#pragma unroll
        for (int k = 0; k < FLASH_WMMA_TILE / 16; k++) {
            if (16 * k < k_begin || 16 * k >= k_end) continue;
            FlashFragB b;
            nvcuda::wmma::load_matrix_sync(b, x + 16 * k * ld_x + 16 * n, ld_x);
            nvcuda::wmma::mma_sync(acc[n], a_frag[k], b, acc[n]);
        }
    }
}

// The warp writes rows (16, HS) of fp32 fragments, times scale, to global rows of dst (row_stride apart) from
// first_row on, those before T: through its strip `staging` (16, HS + FLASH_PAD_F) fp32, the lanes by half rows
template <int HS>
__device__ void flash_warp_write_rows(floatX* dst, int row_stride, int first_row, int T, const FlashFragC* frags,
                                      float* staging, float scale) {
    constexpr int ld = HS + FLASH_PAD_F;
    const int lane = threadIdx.x % 32, r = lane / 2, half = lane % 2;
    __syncwarp();  // every lane is done with what the strip held before
#pragma unroll
    for (int n = 0; n < HS / 16; n++)
        nvcuda::wmma::store_matrix_sync(staging + 16 * n, frags[n], ld, nvcuda::wmma::mem_row_major);
    __syncwarp();
    if (first_row + r >= T) return;
    floatX* row = dst + (size_t)(first_row + r) * row_stride;
    for (int d0 = half * HS / 2; d0 < (half + 1) * HS / 2; d0 += x128::size) {
        x128 packed;
        for (int k = 0; k < x128::size; k++) packed[k] = (floatX)(staging[r * ld + d0 + k] * scale);
        store128(row + d0, packed);
    }
}

// Forward. Block (query block, h, b); warp w owns queries q0 + 16 w .. + 15; lane 2 r + half owns half of query
// q0 + 16 w + r's columns and keeps that row's running max m (the same in both lanes) and its half of the sum l.
template <int HS>
__global__ void __launch_bounds__(FLASH_WMMA_THREADS)
    flash_attention_forward_wmma_kernel(floatX* out, float* stats, const floatX* inp, int T, int NH, int NKV,
                                        float scale_log2) {
    constexpr int LDX = HS + FLASH_PAD_X, LDO = HS + FLASH_PAD_F, TILE = FLASH_WMMA_TILE;
    extern __shared__ __align__(128) unsigned char flash_forward_wmma_shared[];
    floatX* q = (floatX*)flash_forward_wmma_shared;  // (ROWS, HS) this block's queries
    floatX* k = q + FLASH_WMMA_ROWS * LDX;           // (TILE, HS) the key tile
    floatX* v = k + TILE * LDX;                      // (TILE, HS) the value tile
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 2, half = lane % 2;
    float* s = (float*)(v + TILE * LDX) + warp * 16 * (FLASH_LDS + LDO) +
               warp * 16 * FLASH_LDP * sizeof(floatX) / sizeof(float);  // (16, TILE) this warp's scores
    floatX* p = (floatX*)(s + 16 * FLASH_LDS);                           // (16, TILE) its probabilities
    float* o = (float*)(p + 16 * FLASH_LDP);                             // (16, HS) its output accumulator
    const int C = NH * HS, row_stride = (NH + 2 * NKV) * HS;
    const int h = blockIdx.y, b = blockIdx.z;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FLASH_WMMA_ROWS;  // the longest query blocks start first
    const int query = q0 + 16 * warp + r;
    const floatX* q_head = inp + (size_t)b * T * row_stride + h * HS;
    const floatX* k_head = inp + (size_t)b * T * row_stride + (NH + h / (NH / NKV)) * HS;
    const floatX* v_head = k_head + NKV * HS;
    flash_copy_rows<HS, FLASH_WMMA_ROWS>(q, LDX, q_head, row_stride, q0, T);
    for (int d = half * HS / 2; d < (half + 1) * HS / 2; d++) o[r * LDO + d] = 0.0f;

    float m = -INFINITY, l = 0.0f;
    const int last_key = min(q0 + FLASH_WMMA_ROWS, T) - 1;
    for (int k0 = 0; k0 <= last_key; k0 += TILE) {
        __syncthreads();
        flash_copy_rows<HS, TILE>(k, LDX, k_head, row_stride, k0, T);
        flash_copy_rows<HS, TILE>(v, LDX, v_head, row_stride, k0, T);
        __syncthreads();
        if (q0 + 16 * warp >= T) continue;  // a warp of rows past T (the last block's) only helps load the tiles
        // on the diagonal tile (k0 == q0) the keys past this warp's last query are masked for all its rows, and on
        // the last one the keys past T
        const int columns = min(k0 == q0 ? 16 * (warp + 1) : TILE, flash_columns_before(T - k0));
        flash_warp_product_abt<HS>(s, FLASH_LDS, q + 16 * warp * LDX, LDX, k, LDX, 0, columns);
        __syncwarp();
        // k0 <= q0 <= query, so key k0 is attended and the max is finite from the first tile on
        float tile_max = -INFINITY;
        for (int j = half * TILE / 2; j < (half + 1) * TILE / 2; j++)
            if (k0 + j <= query) tile_max = fmaxf(tile_max, s[r * FLASH_LDS + j] * scale_log2);
        const float m_new = fmaxf(m, fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1)));
        const float correction = exp2f(m - m_new);
        float tile_sum = 0.0f;
        for (int j = half * TILE / 2; j < (half + 1) * TILE / 2; j++) {
            const floatX pj = (floatX)(k0 + j <= query ? exp2f(s[r * FLASH_LDS + j] * scale_log2 - m_new) : 0.0f);
            tile_sum += (float)pj;
            p[r * FLASH_LDP + j] = pj;
        }
        l = l * correction + tile_sum;
        for (int d = half * HS / 2; d < (half + 1) * HS / 2; d++) o[r * LDO + d] *= correction;
        m = m_new;
        __syncwarp();
        FlashFragC acc[HS / 16];
#pragma unroll
        for (int n = 0; n < HS / 16; n++)
            nvcuda::wmma::load_matrix_sync(acc[n], o + 16 * n, LDO, nvcuda::wmma::mem_row_major);
        flash_warp_product_ab<HS>(acc, p, FLASH_LDP, v, LDX, 0, columns);
        __syncwarp();  // a lane may store an element of o that another lane loaded: wmma orders neither
#pragma unroll
        for (int n = 0; n < HS / 16; n++)
            nvcuda::wmma::store_matrix_sync(o + 16 * n, acc[n], LDO, nvcuda::wmma::mem_row_major);
        __syncwarp();
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    if (query >= T) return;
    const float inverse_l = 1.0f / l;
    floatX* out_row = out + ((size_t)b * T + query) * C + h * HS;
    for (int d0 = half * HS / 2; d0 < (half + 1) * HS / 2; d0 += x128::size) {
        x128 packed;
        for (int k = 0; k < x128::size; k++) packed[k] = (floatX)(o[r * LDO + d0 + k] * inverse_l);
        store128(out_row + d0, packed);
    }
    if (half == 0) stats[((size_t)b * NH + h) * T + query] = (m + log2f(l)) * 0.693147180559945f;
}

// dq pass. Block (query block, h, b); warp w owns queries q0 + 16 w .. + 15, and writes their delta for the dk/dv
// pass; dq (16, HS) stays in fragments.
template <int HS>
__global__ void __launch_bounds__(FLASH_WMMA_THREADS)
    flash_attention_backward_dq_wmma_kernel(floatX* dinp, float* delta, const floatX* dout, const floatX* inp,
                                            const floatX* out, const float* stats, int T, int NH, int NKV,
                                            float scale_log2, float scale) {
    constexpr int LDX = HS + FLASH_PAD_X, TILE = FLASH_WMMA_TILE;
    static_assert(16 * (HS + FLASH_PAD_F) <= 2 * 16 * FLASH_LDS, "dq's staging reuses the s and dp strips");
    extern __shared__ __align__(128) unsigned char flash_dq_wmma_shared[];
    floatX* q = (floatX*)flash_dq_wmma_shared;      // (ROWS, HS) this block's queries
    floatX* dout_rows = q + FLASH_WMMA_ROWS * LDX;   // (ROWS, HS) their output gradients
    floatX* k = dout_rows + FLASH_WMMA_ROWS * LDX;   // (TILE, HS) the key tile
    floatX* v = k + TILE * LDX;                      // (TILE, HS) the value tile
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 2, half = lane % 2;
    float* s = (float*)(v + TILE * LDX) + warp * 2 * 16 * FLASH_LDS +
               warp * 16 * FLASH_LDP * sizeof(floatX) / sizeof(float);  // (16, TILE) this warp's scores
    float* dp = s + 16 * FLASH_LDS;                                     // (16, TILE) dout . v
    floatX* ds = (floatX*)(dp + 16 * FLASH_LDS);                        // (16, TILE) ds
    const int C = NH * HS, row_stride = (NH + 2 * NKV) * HS;
    const int h = blockIdx.y, b = blockIdx.z;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FLASH_WMMA_ROWS;
    const int query = q0 + 16 * warp + r;
    const floatX* q_head = inp + (size_t)b * T * row_stride + h * HS;
    const floatX* k_head = inp + (size_t)b * T * row_stride + (NH + h / (NH / NKV)) * HS;
    const floatX* v_head = k_head + NKV * HS;
    flash_copy_rows<HS, FLASH_WMMA_ROWS>(q, LDX, q_head, row_stride, q0, T);
    flash_copy_rows<HS, FLASH_WMMA_ROWS>(dout_rows, LDX, dout + (size_t)b * T * C + h * HS, C, q0, T);
    __syncthreads();

    // this query's base-2 log-sum-exp and delta = dout . out; a query past T keeps 0s (its p is masked to 0)
    const size_t row = ((size_t)b * NH + h) * T + query;
    float stat_log2 = 0.0f, row_delta = 0.0f;
    if (query < T) {
        stat_log2 = stats[row] * 1.44269504088896f;
        const floatX* out_row = out + ((size_t)b * T + query) * C + h * HS;
        for (int d0 = half * HS / 2; d0 < (half + 1) * HS / 2; d0 += x128::size) {
            const x128 packed = load128(out_row + d0);
            for (int j = 0; j < x128::size; j++)
                row_delta += (float)dout_rows[(16 * warp + r) * LDX + d0 + j] * (float)packed[j];
        }
    }
    row_delta += __shfl_xor_sync(0xffffffffu, row_delta, 1);
    if (query < T && half == 0) delta[row] = row_delta;

    FlashFragC dq[HS / 16];
#pragma unroll
    for (int n = 0; n < HS / 16; n++) nvcuda::wmma::fill_fragment(dq[n], 0.0f);
    const int last_key = min(q0 + FLASH_WMMA_ROWS, T) - 1;
    for (int k0 = 0; k0 <= last_key; k0 += TILE) {
        __syncthreads();
        flash_copy_rows<HS, TILE>(k, LDX, k_head, row_stride, k0, T);
        flash_copy_rows<HS, TILE>(v, LDX, v_head, row_stride, k0, T);
        __syncthreads();
        if (q0 + 16 * warp >= T) continue;  // a warp of rows past T (the last block's) only helps load the tiles
        const int columns = min(k0 == q0 ? 16 * (warp + 1) : TILE, flash_columns_before(T - k0));
        flash_warp_product_abt<HS>(s, FLASH_LDS, q + 16 * warp * LDX, LDX, k, LDX, 0, columns);
        flash_warp_product_abt<HS>(dp, FLASH_LDS, dout_rows + 16 * warp * LDX, LDX, v, LDX, 0, columns);
        __syncwarp();
        for (int j = half * TILE / 2; j < (half + 1) * TILE / 2; j++) {
            const int i = r * FLASH_LDS + j;
            const bool attended = k0 + j <= query && query < T;
            const float pj = attended ? exp2f(s[i] * scale_log2 - stat_log2) : 0.0f;
            ds[r * FLASH_LDP + j] = (floatX)(attended ? pj * (dp[i] - row_delta) : 0.0f);
        }
        __syncwarp();
        flash_warp_product_ab<HS>(dq, ds, FLASH_LDP, k, LDX, 0, columns);
    }
    flash_warp_write_rows<HS>(dinp + (size_t)b * T * row_stride + h * HS, row_stride, q0 + 16 * warp, T, dq, s,
                              scale);
}

// dk/dv pass. Block (key block, key/value head kv, b); warp w owns keys k0 + 16 w .. + 15; lane 2 r + half
// computes half of key k0 + 16 w + r's p and ds against the query tile, dk and dv (16, HS) stay in fragments.
// For each query head of the group kv serves, in order, query tiles from the diagonal (q0 = k0, the first that
// attends these keys) to the end.
template <int HS>
__global__ void __launch_bounds__(FLASH_WMMA_THREADS)
    flash_attention_backward_dkv_wmma_kernel(floatX* dinp, const floatX* dout, const floatX* inp, const float* stats,
                                             const float* delta, int T, int NH, int NKV, float scale_log2,
                                             float scale) {
    constexpr int LDX = HS + FLASH_PAD_X, TILE = FLASH_WMMA_TILE;
    static_assert(16 * (HS + FLASH_PAD_F) <= 2 * 16 * FLASH_LDS, "dk's and dv's staging reuses the s and dp strips");
    extern __shared__ __align__(128) unsigned char flash_dkv_wmma_shared[];
    floatX* k = (floatX*)flash_dkv_wmma_shared;       // (ROWS, HS) this block's keys
    floatX* v = k + FLASH_WMMA_ROWS * LDX;            // (ROWS, HS) their values
    floatX* q = v + FLASH_WMMA_ROWS * LDX;            // (TILE, HS) the query tile
    floatX* dout_tile = q + TILE * LDX;               // (TILE, HS) its output gradients
    float* stat_log2 = (float*)(dout_tile + TILE * LDX);  // (TILE) its base-2 log-sum-exps
    float* tile_delta = stat_log2 + TILE;                 // (TILE) its deltas
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 2, half = lane % 2;
    float* s_t = tile_delta + TILE + warp * 2 * 16 * FLASH_LDS +
                 warp * 2 * 16 * FLASH_LDP * sizeof(floatX) / sizeof(float);  // (16, TILE) k . q^T, this warp's
    float* dp_t = s_t + 16 * FLASH_LDS;                                       // (16, TILE) v . dout^T
    floatX* p_t = (floatX*)(dp_t + 16 * FLASH_LDS);                           // (16, TILE) p^T
    floatX* ds_t = p_t + 16 * FLASH_LDP;                                      // (16, TILE) ds^T
    const int C = NH * HS, row_stride = (NH + 2 * NKV) * HS, group = NH / NKV;
    const int kv = blockIdx.y, b = blockIdx.z;
    const int k0 = blockIdx.x * FLASH_WMMA_ROWS;  // blocks of early keys have the most query tiles: they start first
    const int key = k0 + 16 * warp + r;
    const floatX* k_head = inp + (size_t)b * T * row_stride + (NH + kv) * HS;
    flash_copy_rows<HS, FLASH_WMMA_ROWS>(k, LDX, k_head, row_stride, k0, T);
    flash_copy_rows<HS, FLASH_WMMA_ROWS>(v, LDX, k_head + NKV * HS, row_stride, k0, T);

    FlashFragC dk[HS / 16], dv[HS / 16];
#pragma unroll
    for (int n = 0; n < HS / 16; n++) {
        nvcuda::wmma::fill_fragment(dk[n], 0.0f);
        nvcuda::wmma::fill_fragment(dv[n], 0.0f);
    }
    for (int h = kv * group; h < (kv + 1) * group; h++) {
        const floatX* q_head = inp + (size_t)b * T * row_stride + h * HS;
        const floatX* dout_head = dout + (size_t)b * T * C + h * HS;
        const float* head_stats = stats + ((size_t)b * NH + h) * T;
        const float* head_delta = delta + ((size_t)b * NH + h) * T;
        for (int q0 = k0; q0 < T; q0 += TILE) {
            __syncthreads();
            flash_copy_rows<HS, TILE>(q, LDX, q_head, row_stride, q0, T);
            flash_copy_rows<HS, TILE>(dout_tile, LDX, dout_head, C, q0, T);
            for (int i = threadIdx.x; i < TILE; i += blockDim.x) {
                stat_log2[i] = q0 + i < T ? head_stats[q0 + i] * 1.44269504088896f : 0.0f;
                tile_delta[i] = q0 + i < T ? head_delta[q0 + i] : 0.0f;
            }
            __syncthreads();
            if (k0 + 16 * warp >= T) continue;  // a warp of keys past T (the last block's) only helps load the tiles
            // on the diagonal tile the queries before this warp's first key attend none of its keys, and on the last
            // one the queries past T none
            const int first = q0 == k0 ? 16 * warp : 0, end = flash_columns_before(T - q0);
            flash_warp_product_abt<HS>(s_t, FLASH_LDS, k + 16 * warp * LDX, LDX, q, LDX, first, end);
            flash_warp_product_abt<HS>(dp_t, FLASH_LDS, v + 16 * warp * LDX, LDX, dout_tile, LDX, first, end);
            __syncwarp();
            for (int i = half * TILE / 2; i < (half + 1) * TILE / 2; i++) {
                // query q0 + i attends this key when it is not before it; queries past T are zero rows, masked too
                const int e = r * FLASH_LDS + i;
                const bool attended = q0 + i >= key && q0 + i < T;
                const float pi = attended ? exp2f(s_t[e] * scale_log2 - stat_log2[i]) : 0.0f;
                p_t[r * FLASH_LDP + i] = (floatX)pi;
                ds_t[r * FLASH_LDP + i] = (floatX)(attended ? pi * (dp_t[e] - tile_delta[i]) : 0.0f);
            }
            __syncwarp();
            flash_warp_product_ab<HS>(dv, p_t, FLASH_LDP, dout_tile, LDX, first, end);
            flash_warp_product_ab<HS>(dk, ds_t, FLASH_LDP, q, LDX, first, end);
        }
    }
    floatX* dk_rows = dinp + (size_t)b * T * row_stride + (NH + kv) * HS;
    flash_warp_write_rows<HS>(dk_rows, row_stride, k0 + 16 * warp, T, dk, s_t, scale);
    flash_warp_write_rows<HS>(dk_rows + NKV * HS, row_stride, k0 + 16 * warp, T, dv, s_t, 1.0f);
}

template <int HS>
static void flash_attention_forward_wmma_launch(floatX* out, float* stats, const floatX* inp, int B, int T, int NH,
                                                int NKV, cudaStream_t stream) {
    const size_t shared_bytes = flash_wmma_forward_shared_bytes(HS);
    if (shared_bytes > 48 * 1024) {
        cudaCheck(cudaFuncSetAttribute(flash_attention_forward_wmma_kernel<HS>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared_bytes));
    }
    const dim3 grid(CEIL_DIV(T, FLASH_WMMA_ROWS), NH, B);
    const float scale_log2 = 1.44269504088896f / sqrtf((float)HS);
    flash_attention_forward_wmma_kernel<HS><<<grid, FLASH_WMMA_THREADS, shared_bytes, stream>>>(out, stats, inp, T, NH,
                                                                                               NKV, scale_log2);
    cudaCheck(cudaGetLastError());
}

template <int HS>
static void flash_attention_backward_wmma_launch(floatX* dinp, float* delta, const floatX* dout, const floatX* inp,
                                                 const floatX* out, const float* stats, int B, int T, int NH,
                                                 int NKV, cudaStream_t stream) {
    const size_t dq_bytes = flash_wmma_dq_shared_bytes(HS), dkv_bytes = flash_wmma_dkv_shared_bytes(HS);
    if (dq_bytes > 48 * 1024) {
        cudaCheck(cudaFuncSetAttribute(flash_attention_backward_dq_wmma_kernel<HS>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dq_bytes));
    }
    if (dkv_bytes > 48 * 1024) {
        cudaCheck(cudaFuncSetAttribute(flash_attention_backward_dkv_wmma_kernel<HS>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dkv_bytes));
    }
    // dq: a block per (query block, query head); dk/dv: a block per (key block, key/value head)
    const dim3 dq_grid(CEIL_DIV(T, FLASH_WMMA_ROWS), NH, B), dkv_grid(CEIL_DIV(T, FLASH_WMMA_ROWS), NKV, B);
    const float scale = 1.0f / sqrtf((float)HS);
    const float scale_log2 = 1.44269504088896f * scale;
    flash_attention_backward_dq_wmma_kernel<HS><<<dq_grid, FLASH_WMMA_THREADS, dq_bytes, stream>>>(
        dinp, delta, dout, inp, out, stats, T, NH, NKV, scale_log2, scale);
    cudaCheck(cudaGetLastError());
    flash_attention_backward_dkv_wmma_kernel<HS><<<dkv_grid, FLASH_WMMA_THREADS, dkv_bytes, stream>>>(
        dinp, dout, inp, stats, delta, T, NH, NKV, scale_log2, scale);
    cudaCheck(cudaGetLastError());
}
#endif  // !ENABLE_FP32

// ----------------------------------------------------------------------------------------------------
// Launchers, one instance per head size. Over 48 KiB of shared memory a kernel must opt in (the forward at
// HS = 128, the backward from HS = 64, dk/dv from HS = 32); the largest, 144.25 KiB (dk/dv at HS = 128), fits
// sm_80's 163 KiB and sm_90's 227.

template <int HS>
static void flash_attention_forward_launch(floatX* out, float* stats, const floatX* inp, int B, int T, int NH,
                                           int NKV, cudaStream_t stream) {
    const size_t shared_bytes = flash_forward_shared_bytes(HS);
    if (shared_bytes > 48 * 1024) {
        cudaCheck(cudaFuncSetAttribute(flash_attention_forward_kernel<HS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)shared_bytes));
    }
    const dim3 grid(CEIL_DIV(T, FLASH_ROWS), NH, B);
    const float scale_log2 = 1.44269504088896f / sqrtf((float)HS);
    flash_attention_forward_kernel<HS><<<grid, FLASH_ROWS, shared_bytes, stream>>>(out, stats, inp, T, NH, NKV,
                                                                                  scale_log2);
    cudaCheck(cudaGetLastError());
}

template <int HS>
static void flash_attention_backward_launch(floatX* dinp, float* delta, const floatX* dout, const floatX* inp,
                                            const floatX* out, const float* stats, int B, int T, int NH, int NKV,
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
    // dq: a block per (query block, query head); dk/dv: a block per (key block, key/value head)
    const dim3 dq_grid(CEIL_DIV(T, FLASH_ROWS), NH, B), dkv_grid(CEIL_DIV(T, FLASH_ROWS), NKV, B);
    const float scale = 1.0f / sqrtf((float)HS);
    const float scale_log2 = 1.44269504088896f * scale;
    flash_attention_backward_dq_kernel<HS><<<dq_grid, FLASH_ROWS, dq_bytes, stream>>>(
        dinp, delta, dout, inp, out, stats, T, NH, NKV, scale_log2, scale);
    cudaCheck(cudaGetLastError());
    flash_attention_backward_dkv_kernel<HS><<<dkv_grid, FLASH_ROWS, dkv_bytes, stream>>>(
        dinp, dout, inp, stats, delta, T, NH, NKV, scale_log2, scale);
    cudaCheck(cudaGetLastError());
}

// Which cores the products run on. The fp32-core kernels take every precision; the tensor-core ones bf16 and fp16,
// where they are the trainers' path (cuDNN's numerics: probabilities rounded to floatX before their product).
enum FlashCores { FLASH_FP32_CORES, FLASH_TENSOR_CORES };
#if defined(ENABLE_FP32)
constexpr FlashCores FLASH_DEFAULT_CORES = FLASH_FP32_CORES;
#else
constexpr FlashCores FLASH_DEFAULT_CORES = FLASH_TENSOR_CORES;
#endif

static void flash_attention_require_support(const char* function, int C, int NH, int NKV, const void* a,
                                            const void* b, const void* c, const void* d, int cores) {
    char why[256];
    if (!flash_attention_support(C, NH, NKV, why, sizeof(why))) {
        fprintf(stderr, "%s: %s\n", function, why);
        exit(EXIT_FAILURE);
    }
    if (cores != FLASH_FP32_CORES && (cores != FLASH_TENSOR_CORES || sizeof(floatX) == sizeof(float))) {
        fprintf(stderr, "%s: the tensor-core kernels take bf16 or fp16, not %s\n", function, PRECISION_NAME);
        exit(EXIT_FAILURE);
    }
    if ((uintptr_t)a % 16 || (uintptr_t)b % 16 || (uintptr_t)c % 16 || (uintptr_t)d % 16) {
        fprintf(stderr, "%s: buffers must be 16-byte aligned\n", function);
        exit(EXIT_FAILURE);
    }
}

template <int HS>
static void flash_attention_forward_on(FlashCores cores, floatX* out, float* stats, const floatX* inp, int B, int T,
                                       int NH, int NKV, cudaStream_t stream) {
#if !defined(ENABLE_FP32)
    if (cores == FLASH_TENSOR_CORES) {
        flash_attention_forward_wmma_launch<HS>(out, stats, inp, B, T, NH, NKV, stream);
        return;
    }
#endif
    flash_attention_forward_launch<HS>(out, stats, inp, B, T, NH, NKV, stream);
}

template <int HS>
static void flash_attention_backward_on(FlashCores cores, floatX* dinp, float* delta, const floatX* dout,
                                        const floatX* inp, const floatX* out, const float* stats, int B, int T, int NH,
                                        int NKV, cudaStream_t stream) {
#if !defined(ENABLE_FP32)
    if (cores == FLASH_TENSOR_CORES) {
        flash_attention_backward_wmma_launch<HS>(dinp, delta, dout, inp, out, stats, B, T, NH, NKV, stream);
        return;
    }
#endif
    flash_attention_backward_launch<HS>(dinp, delta, dout, inp, out, stats, B, T, NH, NKV, stream);
}

// out (B, T, C) and stats (B, NH, T) fp32 from inp (B, T, (NH + 2 NKV) HS) = [q | k | v] per position, HS = C / NH
// (doc/attention.md); query head h attends with key/value head h / (NH / NKV)
void flash_attention_forward(floatX* out, float* stats, const floatX* inp, int B, int T, int NH, int NKV, int C,
                             cudaStream_t stream, FlashCores cores = FLASH_DEFAULT_CORES) {
    flash_attention_require_support("flash_attention_forward", C, NH, NKV, out, stats, inp, nullptr, cores);
    switch (C / NH) {
        case 16: flash_attention_forward_on<16>(cores, out, stats, inp, B, T, NH, NKV, stream); break;
        case 32: flash_attention_forward_on<32>(cores, out, stats, inp, B, T, NH, NKV, stream); break;
        case 64: flash_attention_forward_on<64>(cores, out, stats, inp, B, T, NH, NKV, stream); break;
        case 128: flash_attention_forward_on<128>(cores, out, stats, inp, B, T, NH, NKV, stream); break;
    }
}

// dinp (B, T, (NH + 2 NKV) HS) = [dq | dk | dv], inp's layout, overwritten, from dout (B, T, C) and the forward
// pass's inp, out and stats; a key/value head's dk and dv sum over its NH / NKV query heads. delta: scratch of
// B * NH * T floats
void flash_attention_backward(floatX* dinp, float* delta, const floatX* dout, const floatX* inp, const floatX* out,
                              const float* stats, int B, int T, int NH, int NKV, int C, cudaStream_t stream,
                              FlashCores cores = FLASH_DEFAULT_CORES) {
    flash_attention_require_support("flash_attention_backward", C, NH, NKV, dinp, delta, dout, inp, cores);
    flash_attention_require_support("flash_attention_backward", C, NH, NKV, out, stats, nullptr, nullptr, cores);
    switch (C / NH) {
        case 16: flash_attention_backward_on<16>(cores, dinp, delta, dout, inp, out, stats, B, T, NH, NKV, stream);
            break;
        case 32: flash_attention_backward_on<32>(cores, dinp, delta, dout, inp, out, stats, B, T, NH, NKV, stream);
            break;
        case 64: flash_attention_backward_on<64>(cores, dinp, delta, dout, inp, out, stats, B, T, NH, NKV, stream);
            break;
        case 128: flash_attention_backward_on<128>(cores, dinp, delta, dout, inp, out, stats, B, T, NH, NKV, stream);
            break;
    }
}
