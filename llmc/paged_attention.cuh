// llmc/paged_attention.cuh: attention over a paged key/value cache, for inference (after vLLM's PagedAttention, Kwon
// et al., 2023): each sequence's keys and values live in fixed-size blocks of a shared pool, found through a block
// table, so sequences grow a block at a time without copying or reserving their longest length. Two kernels:
// paged_kv_write stores the key and value heads of new tokens into their cache slots, paged_attention_forward
// attends each query to its sequence's cached positions. Included by an inference program and by the lab
// dev/cuda/paged_attention.cu; builds with nvcc or cpu/cucc, nothing to link.
//
// Layout (X = sizeof(floatX)). One layer's cache: k_cache and v_cache, each (num_blocks, block_size, NKV, HS): a
// slot (block * block_size + offset) holds NKV heads of HS contiguous elements, so slot s starts at element
// s * NKV * HS and slots of one block are contiguous. Position p of sequence q lives in physical block
// block_table[q * max_blocks + p / block_size] (a (num_sequences, max_blocks) int table) at offset p % block_size.
// The tokens' rows are the packed qkv of doc/attention.md, (N, (NH + 2 NKV) HS) = [q heads | k heads | v heads];
// out is (N, NH HS). Queries and keys are expected roped (rope_forward_at) before they reach these kernels.
//
// paged_attention_forward: for query i (row i of qkv, sequence query_seq[i], context_len[i] = n >= 1 positions):
//   out[i, h] = sum_{p < n} softmax_p(q_h . k_p / sqrt(HS)) v_p,   k_p, v_p of kv head h / (NH / NKV)
// fp32 scores, softmax (online: running max and sum, exp2 of log2(e)-scaled scores) and sums; out rounded once to
// floatX. Causality is the caller's: a query sees exactly its context_len positions, so the tokens of a prefill chunk
// are queries of one sequence with context lengths p + 1 (after their keys and values are written).
//
// Floors. paged_kv_write: each token's 2 NKV HS elements read and written once: 4 N NKV HS X + 4 N (slots) bytes, no
// flops. paged_attention_forward: q read and out written once, 2 N NH HS X; each (sequence, position) a query reads
// has its key and value read once, 2 NKV HS X per position of the longest context per sequence (L); the table and
// the two int arrays: 2 NKV HS X * sum_seq L + 2 N NH HS X + 4 (sum_seq L / block_size + 2 N) bytes. Flops: 4 NH HS
// per (query, position): 4 NH HS sum_i context_len[i]. In decode (one query per sequence, L = n) that is 2 NH / (NKV X)
// flop per byte: 1 in bf16 without grouping, 4 with Llama-3 8B's NH / NKV = 4, far below a GPU's compute to
// bandwidth ratio (H200 bf16: ~200 flop/byte): memory-bound, and the floor is the cache's bytes. 64 sequences of
// 2560 positions on average: GPT-2 124M heads (NKV 12, HS 64) 503 MB, ~105 us at 4.8 TB/s; Llama-3 8B heads (NKV 8,
// HS 128) 671 MB, ~140 us. (Many queries of one sequence reuse each key and value: a long prefill is compute-bound,
// flash attention's job, not this kernel's.)
//
// The kernel (paged_attention_forward): a block per (query, query head), its warps splitting the context into
// 32-position tiles round-robin; each warp keeps an online softmax over its tiles, and the block merges the warps'
// (max, sum, accumulator) through shared memory at the end, in warp order: deterministic, no atomics. Per tile, lane j
// takes position tile + j: it looks up the slot through the table and computes q . k with 16-byte loads of its key row
// (q, scaled, sits in shared memory, read as a broadcast); the warp then takes the tile's max and rescales. For p . v,
// a head row is HS / x128::size 16-byte chunks (CHUNKS) and the warp covers 32 / CHUNKS rows at once, each lane one
// chunk of one row, the probabilities and slots passed by shuffles: the value loads are whole contiguous rows. The
// lanes' partial accumulators of different rows are summed by xor shuffles at the end. A query's context split over
// 4 warps keeps 4 tiles' loads in flight per (query, head); blocks of the same query's heads are consecutive in the
// grid, so the NH / NKV query heads of a kv head read its keys and values at about the same time and all but the
// first find them in L2 (the floor counts them once). Positions past the context are never read: the unwritten tail
// of a sequence's last block may hold anything.
// Not done: sharing a kv head's loads among its query heads within a block (registers for NH / NKV accumulators),
// splitting one long context over several blocks (flash decoding; pays off when N * NH is too small to fill the GPU).
//
// Constraints (paged_attention_support says why not, in one line): HS 16, 32, 64 or 128 (a compiled kernel each; HS /
// x128::size must divide 32), NH a multiple of NKV, block_size >= 1 (8, 16, 32 are the usual), every pointer 16-byte
// aligned (cudaMalloc's are; a layer's cache at an offset of whole slots keeps it), context_len[i] between 1 and
// max_blocks * block_size, the table's entries for those positions valid blocks. paged_kv_write: slots distinct
// (two tokens to one slot race); a negative slot skips the token (padding rows of a batch).
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-paged_attention_{bf16,fp32} and their lab-check- twins.
#pragma once
#include <math.h>
#include "common.cuh"

#define PAGED_ATTENTION_MAX_WARPS 8   // warps of a paged_attention_forward block, at most (its shared arrays)
#define PAGED_ATTENTION_BLOCK_SIZE 128  // threads of the trainer-quality launch: 4 warps per (query, head)

// the shapes with a compiled kernel; false with a one-line reason otherwise
bool paged_attention_support(int NH, int NKV, int HS, int block_size, char* why, size_t why_size) {
    if (NH < 1 || NKV < 1 || NH % NKV != 0) {
        snprintf(why, why_size, "paged attention: the query head count NH=%d must be a positive multiple of the "
                 "key/value head count NKV=%d", NH, NKV);
        return false;
    }
    if (HS != 16 && HS != 32 && HS != 64 && HS != 128) {
        snprintf(why, why_size, "paged attention: head size %d must be 16, 32, 64 or 128", HS);
        return false;
    }
    if (block_size < 1) {
        snprintf(why, why_size, "paged attention: the cache's block size must be positive (got %d)", block_size);
        return false;
    }
    return true;
}

static void paged_attention_check(const char* who, int N, int NH, int NKV, int HS, int block_size) {
    char why[256];
    if (N < 0 || !paged_attention_support(NH, NKV, HS, block_size, why, sizeof(why))) {
        fprintf(stderr, "%s: %s\n", who, N < 0 ? "negative token count" : why);
        exit(EXIT_FAILURE);
    }
}

// ----------------------------------------------------------------------------------------------------
// paged_kv_write: one thread per 16-byte chunk of a token's [k heads | v heads] (2 NKV HS contiguous elements of its
// qkv row), copied to the same place in its slot. The place of slot s is s * NKV * HS whatever the block size.
__global__ void paged_kv_write_kernel(floatX* __restrict__ k_cache, floatX* __restrict__ v_cache,
                                      const floatX* __restrict__ qkv, const int* __restrict__ slots, int NH, int NKV,
                                      int HS, size_t chunks) {
    const size_t chunk = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (chunk >= chunks) return;
    const int kv_elements = NKV * HS;  // of one slot, in each cache
    const int chunks_per_token = 2 * kv_elements / x128::size;
    const size_t token = chunk / chunks_per_token;
    const int slot = slots[token];
    if (slot < 0) return;
    const int e = (int)(chunk % chunks_per_token) * x128::size;  // into the token's [k heads | v heads]
    const x128 value = load128(qkv + token * (size_t)(NH + 2 * NKV) * HS + (size_t)NH * HS + e);
    floatX* cache = e < kv_elements ? k_cache : v_cache;
    store128(cache + (size_t)slot * kv_elements + e % kv_elements, value);
}

void paged_kv_write_launch(floatX* k_cache, floatX* v_cache, const floatX* qkv, const int* slots, int N, int NH,
                           int NKV, int HS, int block_size, int threads_per_block, cudaStream_t stream) {
    paged_attention_check("paged_kv_write", N, NH, NKV, HS, block_size);
    const size_t chunks = (size_t)N * 2 * NKV * HS / x128::size;
    if (chunks == 0) return;  // a grid of 0 blocks is a launch error
    const unsigned int grid = (unsigned int)CEIL_DIV(chunks, (size_t)threads_per_block);
    paged_kv_write_kernel<<<grid, threads_per_block, 0, stream>>>(k_cache, v_cache, qkv, slots, NH, NKV, HS, chunks);
    cudaCheck(cudaGetLastError());
}

// One layer's KV cache: k_cache and v_cache, each (num_blocks, block_size, NKV, HS) floatX.
// Token i's key and value heads (from its row of the packed qkv (N, (NH + 2*NKV)*HS): [q heads | k heads | v heads])
// go to physical slot slots[i]: block slots[i] / block_size, offset slots[i] % block_size. slots (N) on the device,
// distinct; slots[i] < 0: token i is not written.
void paged_kv_write(floatX* k_cache, floatX* v_cache, const floatX* qkv, const int* slots, int N, int NH, int NKV,
                    int HS, int block_size, cudaStream_t stream) {
    paged_kv_write_launch(k_cache, v_cache, qkv, slots, N, NH, NKV, HS, block_size, 256, stream);
}

// ----------------------------------------------------------------------------------------------------
// paged_attention_forward: a block per (query i, query head h), blockIdx.x = i * NH + h; blockDim.x / 32 warps
// (at most PAGED_ATTENTION_MAX_WARPS). scale_log2 = log2(e) / sqrt(HS), folded into q so that exp2 gives the softmax.
template <int HS>
__global__ void paged_attention_kernel(floatX* __restrict__ out, const floatX* __restrict__ qkv,
                                       const floatX* __restrict__ k_cache, const floatX* __restrict__ v_cache,
                                       const int* __restrict__ block_table, int max_blocks,
                                       const int* __restrict__ query_seq, const int* __restrict__ context_len, int NH,
                                       int NKV, int block_size, float scale_log2) {
    constexpr int CHUNKS = HS / x128::size;  // 16-byte chunks of a head row
    constexpr int ROWS = 32 / CHUNKS;        // rows a warp covers at once in p . v
    static_assert(CHUNKS >= 1 && 32 % CHUNKS == 0, "HS / x128::size must divide 32");
    __shared__ float q_shared[HS];                                    // q * scale_log2
    __shared__ float warp_max[PAGED_ATTENTION_MAX_WARPS];             // each warp's running max (log2 units)
    __shared__ float warp_sum[PAGED_ATTENTION_MAX_WARPS];             // its sum of exp2(score - max)
    __shared__ float warp_acc[PAGED_ATTENTION_MAX_WARPS * HS];        // its sum of exp2(score - max) v
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int i = blockIdx.x / NH, h = blockIdx.x % NH;
    const int kv_head = h / (NH / NKV);
    const size_t kv_stride = (size_t)NKV * HS;  // elements from one slot to the next
    const floatX* k_head = k_cache + (size_t)kv_head * HS;
    const floatX* v_head = v_cache + (size_t)kv_head * HS;
    const int n = context_len[i];
    const int* table = block_table + (size_t)query_seq[i] * max_blocks;

    if (threadIdx.x < CHUNKS) {
        const x128 q = load128(qkv + (size_t)i * (NH + 2 * NKV) * HS + (size_t)h * HS + threadIdx.x * x128::size);
        for (int k = 0; k < x128::size; k++) q_shared[threadIdx.x * x128::size + k] = (float)q[k] * scale_log2;
    }
    __syncthreads();

    const int chunk = lane % CHUNKS, row = lane / CHUNKS;  // this lane's part of p . v
    float running_max = -INFINITY;  // the same on every lane
    float sum = 0.0f;               // this lane's positions' share
    float acc[x128::size];          // chunk `chunk` of sum p v over the rows `row` + multiples of ROWS
    for (int k = 0; k < x128::size; k++) acc[k] = 0.0f;
    for (int tile = warp * 32; tile < n; tile += warps * 32) {
        const int valid = min(32, n - tile);  // positions of this tile in the context, the same on every lane
        const int p = tile + lane;
        int slot = 0;
        float score = -INFINITY;
        if (lane < valid) {
            slot = table[p / block_size] * block_size + p % block_size;
            const floatX* k_row = k_head + (size_t)slot * kv_stride;
            score = 0.0f;
            for (int c = 0; c < CHUNKS; c++) {
                const x128 k = load128(k_row + c * x128::size);
                for (int j = 0; j < x128::size; j++) score += q_shared[c * x128::size + j] * (float)k[j];
            }
        }
        const float new_max = fmaxf(running_max, warp_reduce_max(score));  // finite: valid >= 1
        const float correction = exp2f(running_max - new_max);            // 0 on the first tile
        const float prob = lane < valid ? exp2f(score - new_max) : 0.0f;
        sum = sum * correction + prob;
        for (int k = 0; k < x128::size; k++) acc[k] *= correction;
        for (int r = 0; r < valid; r += ROWS) {  // rows r .. r + ROWS - 1 of the tile, lane in row r + `row`
            const int source = r + row;
            const float row_prob = __shfl_sync(0xffffffff, prob, source);
            const int row_slot = __shfl_sync(0xffffffff, slot, source);
            if (source < valid) {
                const x128 v = load128(v_head + (size_t)row_slot * kv_stride + chunk * x128::size);
                for (int k = 0; k < x128::size; k++) acc[k] += row_prob * (float)v[k];
            }
        }
        running_max = new_max;
    }
    // the warp's totals: sum over lanes, acc over the lanes holding the same chunk (lanes CHUNKS apart)
    sum = warp_reduce_sum(sum);
    for (int offset = CHUNKS; offset < 32; offset *= 2)
        for (int k = 0; k < x128::size; k++) acc[k] += __shfl_xor_sync(0xffffffff, acc[k], offset);
    if (lane == 0) {
        warp_max[warp] = running_max;  // -INFINITY, with sum and acc 0, for a warp the context did not reach
        warp_sum[warp] = sum;
    }
    if (row == 0)
        for (int k = 0; k < x128::size; k++) warp_acc[warp * HS + chunk * x128::size + k] = acc[k];
    __syncthreads();

    // merge the warps in order: thread c < CHUNKS writes chunk c of the output
    if (threadIdx.x >= CHUNKS) return;
    float block_max = -INFINITY;
    for (int w = 0; w < warps; w++) block_max = fmaxf(block_max, warp_max[w]);
    float total = 0.0f, o[x128::size];
    for (int k = 0; k < x128::size; k++) o[k] = 0.0f;
    for (int w = 0; w < warps; w++) {
        const float weight = exp2f(warp_max[w] - block_max);  // 0 for a warp without positions
        total += warp_sum[w] * weight;
        for (int k = 0; k < x128::size; k++) o[k] += warp_acc[w * HS + threadIdx.x * x128::size + k] * weight;
    }
    x128 result;
    for (int k = 0; k < x128::size; k++) result[k] = (floatX)(o[k] / total);
    store128(out + (size_t)i * NH * HS + (size_t)h * HS + threadIdx.x * x128::size, result);
}

// threads_per_block: a multiple of 32 up to 32 * PAGED_ATTENTION_MAX_WARPS, the warps that split each context
void paged_attention_forward_launch(floatX* out, const floatX* qkv, const floatX* k_cache, const floatX* v_cache,
                                    const int* block_table, int max_blocks, const int* query_seq,
                                    const int* context_len, int N, int NH, int NKV, int HS, int block_size,
                                    int threads_per_block, cudaStream_t stream) {
    paged_attention_check("paged_attention_forward", N, NH, NKV, HS, block_size);
    if (threads_per_block < 32 || threads_per_block > 32 * PAGED_ATTENTION_MAX_WARPS || threads_per_block % 32 != 0) {
        fprintf(stderr, "paged_attention_forward: %d threads per block: need a multiple of 32 up to %d\n",
                threads_per_block, 32 * PAGED_ATTENTION_MAX_WARPS);
        exit(EXIT_FAILURE);
    }
    if (N == 0) return;
    const unsigned int grid = (unsigned int)N * NH;
    const float scale_log2 = 1.44269504088896341f / sqrtf((float)HS);
#define PAGED_ATTENTION_CASE(S)                                                                                      \
    case S:                                                                                                          \
        paged_attention_kernel<S><<<grid, threads_per_block, 0, stream>>>(out, qkv, k_cache, v_cache, block_table,   \
                                                                          max_blocks, query_seq, context_len, NH,    \
                                                                          NKV, block_size, scale_log2);              \
        break;
    switch (HS) {
        PAGED_ATTENTION_CASE(16)
        PAGED_ATTENTION_CASE(32)
        PAGED_ATTENTION_CASE(64)
        PAGED_ATTENTION_CASE(128)
    }
#undef PAGED_ATTENTION_CASE
    cudaCheck(cudaGetLastError());
}

// out (N, NH*HS): query i (the NH query heads of row i of qkv) attends to positions 0 .. context_len[i]-1 of
// sequence query_seq[i], whose position p lives in physical block
// block_table[query_seq[i] * max_blocks + p / block_size] at offset p % block_size. softmax(q.k / sqrt(HS)) v, fp32
// accumulation; GQA: query head h reads kv head h / (NH / NKV). context_len[i] >= 1. block_table
// (num_sequences, max_blocks), query_seq (N) and context_len (N) on the device.
void paged_attention_forward(floatX* out, const floatX* qkv, const floatX* k_cache, const floatX* v_cache,
                             const int* block_table, int max_blocks, const int* query_seq, const int* context_len,
                             int N, int NH, int NKV, int HS, int block_size, cudaStream_t stream) {
    paged_attention_forward_launch(out, qkv, k_cache, v_cache, block_table, max_blocks, query_seq, context_len, N, NH,
                                   NKV, HS, block_size, PAGED_ATTENTION_BLOCK_SIZE, stream);
}
