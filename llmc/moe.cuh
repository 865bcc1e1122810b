// llmc/moe.cuh: the Switch-Transformer MoE layer's own kernels, around the expert GEMMs: router softmax with
// fused top-k, deterministic slot assignment under the capacity limit, dispatch of token rows into per-expert
// buffers, combine of the expert outputs weighted by the gates, their backward passes, and the router's
// gradient through the gates, the load-balancing loss and the z-loss. The semantics are those of
// doc/moe.md; the router GEMM and the expert FFN (batched GEMMs over E) are not here.
// Included by the MoE trainer and by the kernel lab: dev/cuda/moe_router.cu, moe_slots.cu,
// moe_dispatch_combine.cu, moe_router_backward.cu (e.g. `make build/lab/moe_slots_bf16 && build/lab/moe_slots_bf16 -s`).
//
// Shapes (N = B*T tokens of one micro-batch, E experts, k = top-k, C channels, R = rows of the expert buffer):
//   logits, probs, d_logits (N, E) fp32          logsumexp (N) fp32
//   expert_index, choice_row (N, k) int           gates, d_gates (N, k) fp32
//   row_choice (R) int                            expert_count, kept_count (E) int
//   x, out, dout, dx (N, C) floatX                expert_input, expert_output and their gradients (R, C) floatX
//   scratch of the slot assignment and of the losses: moe_assign_slots_scratch_size ints, moe_router_losses_partials_size
//   floats (the caller's, so that no call allocates)
// A "choice" (t, j) is the j-th expert of token t, flattened as t*k + j. The expert buffer holds one row per kept
// choice, grouped by expert in expert order, in one of two layouts:
//   padded (a capacity limit): expert e owns rows [e*cap, (e+1)*cap), R = E*cap; the rows past its kept choices
//     are padding (zeros in expert_input), so that the experts run as one batched GEMM of equal shapes;
//   packed (dropless): expert e owns rows [offset_e, offset_e + count_e), offset_e = the choices routed to experts
//     below e, R = N*k, no padding: the experts run as one grouped GEMM of their exact row counts.
// choice_row[t, j] is the choice's row, or -1 when it was dropped; row_choice is the inverse map, the choice in
// each row or -1 for padding; together they let every kernel gather (one writer per output element, no
// scatter-add, no atomics). `capacity` is always what moe_capacity() returns (>= 1; dropless routing is
// capacity = N, which no expert can exceed since a token's k experts are distinct).
// Sizes supported (moe_support): C a multiple of 8 (16-byte vectors of a row), 1 <= E <= 256 (a warp holds a
// token's logits in 8 registers per lane), 1 <= k <= min(E, 32) (lane j keeps the j-th pick).
// Index arithmetic: element offsets into (N, E), (N, C) and (R, C) arrays are size_t (N*C, R*C pass 2^31 at
// production sizes: R = N*k rows dropless, times C); choice and row indices are int, which moe_assign_slots_launch
// bounds (N*k < 2^30 choices, E*capacity < 2^30 rows) for every kernel after it: at N = 65536 tokens, k = 32 and
// E = 256 they are 2^21 and at most 2^24. Grids are at most max(R, N*k) / 8 blocks of warps.
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-moe_router_{bf16,fp32}, lab-moe_slots_{bf16,fp32},
// lab-moe_dispatch_combine_{bf16,fp32}, lab-moe_router_backward_{bf16,fp32} and their lab-check- twins; moe-* and
// check-moe-* (routing, losses and gradients against PyTorch).
#pragma once
#include <limits.h>
#include <math.h>
#include "common.cuh"

#define MOE_MAX_EXPERTS 256
#define MOE_MAX_TOP_K 32
#define MOE_WARP_KERNEL_BLOCK_SIZE 256   // warp-per-item kernels: 8 items per block
#define MOE_SLOTS_BLOCK_SIZE 256         // slot count and assign passes: a tile of 512 choices per block
#define MOE_SLOTS_ITEMS 2                // choices per thread in a tile of the slot passes
#define MOE_SLOTS_SCAN_BLOCK_SIZE 1024   // the slot scan's one block: 1024 / E threads share each expert's tiles
#define MOE_LOSSES_BLOCK_SIZE 256        // the losses' first pass
#define MOE_LOSSES_MAX_BLOCKS 512        // its grid at most: the partials scratch holds 2 floats per block

// ----------------------------------------------------------------------------------------------------
// Router forward: one warp per token; lane owns experts lane, lane + 32, ... (LOGITS_PER_LANE of them, the
// smallest of 1, 2, 4, 8 that covers E, so E = 8 keeps one register per lane).
// logsumexp = max + log(sum exp(logit - max)) with either score (the z-loss reads it).
// Scores (doc/moe.md, "Routing options" 3 and 5), the gates times routed_scale (rsf) in both:
//   MOE_SCORE_SOFTMAX: probs = softmax(logits); gates = the pick's prob when k == 1, else prob / (sum of the k
//     picked probs, added in pick order);
//   MOE_SCORE_SIGMOID: the affinity a = sigmoid(logit); probs = a / (sum of the E affinities), what the balance
//     loss averages; gates = a / (sum of the k picked affinities, added in pick order), k == 1 too (DeepSeek-V3).
// Top-k is chosen on the logits, not on the rounded fp32 scores: both scores are strictly increasing, so the order
// of the logits is the order of the exact scores, and two different logits never tie just because their fp32
// scores rounded to the same value. Ties (equal logits) go to the lower expert index. Each pick is a warp
// argmax over (logit, index) pairs with xor shuffles: the order is total, so every lane ends with the same winner.
// With a balancing bias (sigmoid only; ibid. 4 and 6) the picks compare the keys a + bias[e] instead, one fp32
// rounding, ties to the lower index again; the gates still take the affinities a, never the keys.
// Device-limited routing (ibid. 9; group_limit M > 0): the experts are G = `groups` groups of E/G consecutive
// indices; a group's score is its largest key, the M groups of largest score are kept (ties to the lower group, the
// same warp argmax over (score, group)) and the picks skip every expert outside them, which starts them as taken.
// probs, logsumexp and the gates' denominators are unchanged: they read the picks' own scores.
// Floor: read N*E*4, write N*E*4 + N*k*8 + N*4 bytes; ~E*(10 + 5k) flops per token (sigmoid: E more exps):
// memory-bound. The device limit reads and writes nothing more; per token it adds G group maxima (E compares
// spread over the lanes, then G warp max reductions of 5 shuffles) and M group picks (G compares, 5 shuffle pairs
// each): ~E + 5G + M(G + 10) operations, at E = 256, G = 64, M = 4 under a tenth of the (10 + 5k)E above for k = 8.
// The warp's best (value, expert) pair: the larger value, ties to the lower expert; INT_MAX marks a lane without a
// candidate. Xor shuffles over a total order, so every lane ends with the same winner. Shared with the noisy
// gating's threshold search (llmc/moe_noise.cuh).
__device__ inline void moe_warp_argmax(float* best, int* best_expert) {
    for (int offset = 16; offset > 0; offset /= 2) {
        const float other = __shfl_xor_sync(0xffffffff, *best, offset);
        const int other_expert = __shfl_xor_sync(0xffffffff, *best_expert, offset);
        const bool other_wins = other_expert != INT_MAX &&
                                (*best_expert == INT_MAX || other > *best ||
                                 (other == *best && other_expert < *best_expert));
        if (other_wins) {
            *best = other;
            *best_expert = other_expert;
        }
    }
}

// the router's score functions (doc/moe.md; model-file header word 27)
#define MOE_SCORE_SOFTMAX 0
#define MOE_SCORE_SIGMOID 1

// sigmoid(x) in fp32, one definition for the forward and backward passes (the backward recomputes the affinities)
__device__ inline float moe_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Device-limited routing's kept groups for one token (a warp; lane owns experts and groups lane + 32*i, G <= E):
// returns the lane's bits i set for its experts outside the `limit` groups of largest best key, which the picks
// then treat as taken (bit i: expert lane + 32*i already picked).
template <int LOGITS_PER_LANE>
__device__ inline unsigned int moe_outside_kept_groups(const float* key, int E, int groups, int limit) {
    const int lane = threadIdx.x % 32;
    const int group_size = E / groups;
    float group_score[LOGITS_PER_LANE];
    for (int g = 0; g < groups; g++) {
        float best = -INFINITY;
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            const int e = lane + 32 * i;
            if (e < E && e / group_size == g) best = fmaxf(best, key[i]);
        }
        best = warp_reduce_max(best);
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            if (lane + 32 * i == g) group_score[i] = best;
        }
    }
    unsigned int group_taken = 0;  // bit i: group lane + 32*i already kept
    unsigned int inside = 0;       // bit i: expert lane + 32*i lies in a kept group
    for (int j = 0; j < limit; j++) {
        float best = -INFINITY;
        int best_group = INT_MAX;  // INT_MAX: no candidate
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            const int g = lane + 32 * i;
            if (g < groups && !((group_taken >> i) & 1u) && (best_group == INT_MAX || group_score[i] > best)) {
                best = group_score[i];
                best_group = g;
            }
        }
        moe_warp_argmax(&best, &best_group);
        if (best_group % 32 == lane) group_taken |= 1u << (best_group / 32);
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            const int e = lane + 32 * i;
            if (e < E && e / group_size == best_group) inside |= 1u << i;
        }
    }
    return ~inside;
}

template <int LOGITS_PER_LANE>
__global__ void moe_router_forward_kernel(float* __restrict__ probs, int* __restrict__ expert_index,
                                          float* __restrict__ gates, float* __restrict__ logsumexp,
                                          const float* __restrict__ logits,
                                          const float* __restrict__ balance_bias, int N, int E, int k, int score,
                                          float routed_scale, int groups, int group_limit) {
    const int token = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (token >= N) return;  // the whole warp leaves together
    const int lane = threadIdx.x % 32;
    const float* row = logits + (size_t)token * E;

    float logit[LOGITS_PER_LANE];
    float row_max = -INFINITY;
    for (int i = 0; i < LOGITS_PER_LANE; i++) {
        const int e = lane + 32 * i;
        logit[i] = e < E ? row[e] : -INFINITY;
        row_max = fmaxf(row_max, logit[i]);
    }
    row_max = warp_reduce_max(row_max);
    float sum = 0.0f;
    for (int i = 0; i < LOGITS_PER_LANE; i++) {
        if (lane + 32 * i < E) sum += expf(logit[i] - row_max);
    }
    sum = warp_reduce_sum(sum);
    // score[i]: what the gates take (the prob, or the affinity); prob written to probs
    float prob[LOGITS_PER_LANE];
    if (score == MOE_SCORE_SIGMOID) {
        float affinity_sum = 0.0f;
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            prob[i] = lane + 32 * i < E ? moe_sigmoid(logit[i]) : 0.0f;
            affinity_sum += prob[i];
        }
        affinity_sum = warp_reduce_sum(affinity_sum);
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            const int e = lane + 32 * i;
            if (e < E) probs[(size_t)token * E + e] = prob[i] / affinity_sum;
        }
    } else {
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            const int e = lane + 32 * i;
            prob[i] = expf(logit[i] - row_max) / sum;
            if (e < E) probs[(size_t)token * E + e] = prob[i];
        }
    }
    if (lane == 0) logsumexp[token] = row_max + logf(sum);
    // key[i]: what top-k compares (the logit, or with a balancing bias the affinity plus the bias)
    float key[LOGITS_PER_LANE];
    for (int i = 0; i < LOGITS_PER_LANE; i++) {
        const int e = lane + 32 * i;
        key[i] = balance_bias != nullptr && e < E ? prob[i] + balance_bias[e] : logit[i];
    }

    // bit i: expert lane + 32*i already picked, or (device limit) outside the kept groups
    unsigned int taken = group_limit > 0 ? moe_outside_kept_groups<LOGITS_PER_LANE>(key, E, groups, group_limit) : 0;
    int my_pick = 0;          // lane j < k keeps the j-th pick and its prob
    float my_pick_prob = 0.0f;
    float picked_sum = 0.0f;
    for (int j = 0; j < k; j++) {
        // this lane's best candidate: increasing i is increasing expert index, so '>' keeps the lower one on ties
        float best = -INFINITY;
        int best_expert = INT_MAX;  // INT_MAX: no candidate
        float candidate_prob = 0.0f;
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            const int e = lane + 32 * i;
            if (e < E && !((taken >> i) & 1u) && (best_expert == INT_MAX || key[i] > best)) {
                best = key[i];
                best_expert = e;
                candidate_prob = prob[i];
            }
        }
        moe_warp_argmax(&best, &best_expert);
        // the winner was its owner lane's own best candidate: take its prob from there
        const float p = __shfl_sync(0xffffffff, candidate_prob, best_expert % 32);
        if (best_expert % 32 == lane) taken |= 1u << (best_expert / 32);
        if (lane == j) {
            my_pick = best_expert;
            my_pick_prob = p;
        }
        picked_sum += p;
    }
    if (lane < k) {
        expert_index[(size_t)token * k + lane] = my_pick;
        const float gate = k == 1 && score == MOE_SCORE_SOFTMAX ? my_pick_prob : my_pick_prob / picked_sum;
        gates[(size_t)token * k + lane] = gate * routed_scale;
    }
}

// ----------------------------------------------------------------------------------------------------
// Slot assignment, three passes over tiles of the priority order p = j*N + t (every first choice in token order,
// then every second choice, ...; choice = t*k + j). A tile is MOE_SLOTS_ITEMS * blockDim.x consecutive
// priorities, one block each; warp w of a block takes the tile's priorities [w*32*ITEMS, (w+1)*32*ITEMS), 32 at a
// time (item i: lane x takes w*32*ITEMS + i*32 + x), so that the order inside a tile is (warp, item, lane).
//   1. count: block b counts its tile's choices per expert: counts[b, e];
//   2. scan (one block): per expert, the exclusive prefix of counts over the tiles in place (slot of the tile's
//      first choice of e), the totals expert_count[e] and kept_count[e] = min(total, capacity), and each expert's
//      first row (padded: e * capacity; packed: the choices routed to the experts below e);
//   3. assign: block b gives each choice of its tile its slot s = the tile's offset for e + the choices of e
//      before it in the tile; s >= capacity is dropped (-1), a kept choice gets row first_row[e] + s.
// Inside a tile, a choice's rank among the choices of its expert comes from the warp's peer mask (the lanes with
// the same expert: one ballot per bit of the expert index, as __match_any_sync would give, which the CPU backend
// lacks), the counts of earlier items of its warp and, after a scan over the warps in shared memory, the counts of
// earlier warps. Integers only and every count has one writer, so the result depends on expert_index alone (the
// same slots as one pass in priority order, doc/moe.md). Padded layout: rows [kept_count[e], capacity) of each
// expert are marked padding (-1) by the assign pass, grid-strided; the packed layout (dropless) has no padding.
// Floor: DRAM reads N*k*4 bytes of expert_index (the assign pass reads them again, from L2) and writes N*k*4
// (choice_row) + R*4 (row_choice) + 8*E; the counts and offsets, 2 * (N*k / tile) * E ints, stay in L2. At
// N = 65536, k = 1, E = 8 with CF 1.25 that is 0.8 MB (0.2 us at ~4.8 TB/s), at k = 8, E = 64 6.8 MB (1.4 us):
// below the three dependent launches (a few us), so what matters is that every pass spreads over the GPU:
// N*k / 512 blocks (128 at 65536 choices) instead of one block per expert, each of which walked all N*k choices.

// the lanes of this warp whose expert equals this lane's, among the lanes with valid set (every lane calls it);
// expert_bits: the bits of the largest expert index
__device__ inline unsigned int moe_warp_peers(int expert, bool valid, int expert_bits) {
    unsigned int peers = __ballot_sync(0xffffffff, valid);
    for (int b = 0; b < expert_bits; b++) {
        const bool bit = (expert >> b) & 1;
        const unsigned int ones = __ballot_sync(0xffffffff, bit);
        peers &= bit ? ones : ~ones;
    }
    return peers;
}

// choice (t*k + j) of priority p = j*N + t
__device__ inline int moe_choice_of_priority(int priority, int N, int k) { return (priority % N) * k + priority / N; }

__global__ void moe_slots_count_kernel(int* __restrict__ tile_counts, const int* __restrict__ expert_index, int N,
                                       int E, int k, int expert_bits) {
    __shared__ int counts[MOE_MAX_EXPERTS];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int num_choices = N * k;  // < 2^30: moe_assign_slots_launch
    for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    const int warp_base = blockIdx.x * MOE_SLOTS_ITEMS * blockDim.x + warp * 32 * MOE_SLOTS_ITEMS;
    for (int i = 0; i < MOE_SLOTS_ITEMS; i++) {
        const int priority = warp_base + i * 32 + lane;
        const bool valid = priority < num_choices;
        const int expert = valid ? expert_index[moe_choice_of_priority(priority, N, k)] : 0;
        const unsigned int peers = moe_warp_peers(expert, valid, expert_bits);
        // the lowest lane of each group of peers adds the group: integer adds, in any order the same sum
        if (valid && __ffs(peers) - 1 == lane) atomicAdd(&counts[expert], __popc(peers));
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) tile_counts[(size_t)blockIdx.x * E + e] = counts[e];
}

// One block of at least E threads (any multiple of 32, up to 1024): thread (segment, e) = (x / E, x % E) owns
// expert e's counts over one contiguous range of tiles; segment sums, their exclusive scan per expert (thread e),
// then each thread writes its range's exclusive offsets. tile_offsets (tiles, E) and first_row (E) follow the counts
// in the scratch: the counts are never overwritten, so a grid that runs only partly (the CPU backend's edge mode)
// still scans counts, never the offsets of an earlier call.
__global__ void moe_slots_scan_kernel(const int* __restrict__ tile_counts, int* __restrict__ tile_offsets,
                                      int* __restrict__ first_row,
                                      int* __restrict__ expert_count, int* __restrict__ kept_count, int num_tiles,
                                      int E, int capacity, bool packed) {
    __shared__ int segment_sums[1024];  // (segment, E), segments * E <= blockDim.x
    __shared__ int totals[MOE_MAX_EXPERTS];
    const int e = threadIdx.x % E;
    const int segment = threadIdx.x / E;
    const int num_segments = blockDim.x / E;
    const int tiles_per_segment = CEIL_DIV(num_tiles, num_segments);
    const int first_tile = segment * tiles_per_segment;
    const int end_tile = min(first_tile + tiles_per_segment, num_tiles);
    const bool active = segment < num_segments;  // the last threads when E does not divide blockDim.x
    if (active) {
        int sum = 0;
        for (int tile = first_tile; tile < end_tile; tile++) sum += tile_counts[(size_t)tile * E + e];
        segment_sums[segment * E + e] = sum;
    }
    __syncthreads();
    if (threadIdx.x < E) {
        int running = 0;
        for (int s = 0; s < num_segments; s++) {
            const int count = segment_sums[s * E + e];
            segment_sums[s * E + e] = running;
            running += count;
        }
        totals[e] = running;
        expert_count[e] = running;
        kept_count[e] = min(running, capacity);
    }
    __syncthreads();
    if (active) {
        int running = segment_sums[segment * E + e];
        for (int tile = first_tile; tile < end_tile; tile++) {
            tile_offsets[(size_t)tile * E + e] = running;
            running += tile_counts[(size_t)tile * E + e];
        }
    }
    if (threadIdx.x < E) {
        int below = 0;  // packed rows are at most N*k < 2^30
        if (packed) {
            for (int other = 0; other < e; other++) below += totals[other];
        }
        first_row[e] = packed ? below : e * capacity;  // E * capacity < 2^30: moe_assign_slots_launch
    }
}

__global__ void moe_slots_assign_kernel(int* __restrict__ choice_row, int* __restrict__ row_choice,
                                        const int* __restrict__ tile_offsets, const int* __restrict__ first_row,
                                        const int* __restrict__ kept_count, const int* __restrict__ expert_index,
                                        int N, int E, int k, int expert_bits, int capacity, bool packed) {
    extern __shared__ int warp_counts[];  // (warps, E): this warp's choices of e so far, then the scan's offsets
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int num_warps = blockDim.x / 32;
    const int num_choices = N * k;
    const unsigned int lanes_below = (1u << lane) - 1u;
    for (int x = threadIdx.x; x < num_warps * E; x += blockDim.x) warp_counts[x] = 0;
    __syncthreads();
    int* my_counts = warp_counts + warp * E;
    const int warp_base = blockIdx.x * MOE_SLOTS_ITEMS * blockDim.x + warp * 32 * MOE_SLOTS_ITEMS;
    int choice[MOE_SLOTS_ITEMS], expert[MOE_SLOTS_ITEMS], rank[MOE_SLOTS_ITEMS];
    for (int i = 0; i < MOE_SLOTS_ITEMS; i++) {
        const int priority = warp_base + i * 32 + lane;
        const bool valid = priority < num_choices;
        choice[i] = valid ? moe_choice_of_priority(priority, N, k) : -1;
        expert[i] = valid ? expert_index[choice[i]] : 0;
        const unsigned int peers = moe_warp_peers(expert[i], valid, expert_bits);
        // the group's lowest lane alone reads and advances its expert's count, and hands the old one to its peers
        const int leader = valid ? __ffs(peers) - 1 : lane;
        int before = 0;
        if (valid && leader == lane) {
            before = my_counts[expert[i]];
            my_counts[expert[i]] = before + __popc(peers);
        }
        before = __shfl_sync(0xffffffff, before, leader);
        rank[i] = before + __popc(peers & lanes_below);
    }
    __syncthreads();
    // per expert, the warps' counts become offsets from the tile's first slot of e
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int running = tile_offsets[(size_t)blockIdx.x * E + e];
        for (int w = 0; w < num_warps; w++) {
            const int count = warp_counts[w * E + e];
            warp_counts[w * E + e] = running;
            running += count;
        }
    }
    __syncthreads();
    for (int i = 0; i < MOE_SLOTS_ITEMS; i++) {
        if (choice[i] < 0) continue;
        const int s = my_counts[expert[i]] + rank[i];
        const int row = s < capacity ? first_row[expert[i]] + s : -1;
        choice_row[choice[i]] = row;
        if (row >= 0) row_choice[row] = choice[i];
    }
    if (!packed) {
        const int num_rows = E * capacity;
        for (int row = blockIdx.x * blockDim.x + threadIdx.x; row < num_rows; row += gridDim.x * blockDim.x) {
            if (row % capacity >= kept_count[row / capacity]) row_choice[row] = -1;
        }
    }
}

// ----------------------------------------------------------------------------------------------------
// Dispatch, gathered: one warp per row of expert_input (R rows); a used row copies its token's row of x, a
// padding row is written with zeros (so it adds nothing to the experts' weight gradients).
// Floor: read (kept rows)*C and write R*C floatX (a token chosen k times is read k times; k <= 2 in practice
// and the second read hits L2): bytes <= (N*k + R)*C*sizeof(floatX) + R*4.
__global__ void moe_dispatch_kernel(floatX* __restrict__ expert_input, const floatX* __restrict__ x,
                                    const int* __restrict__ row_choice, int num_rows, int k, int C) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= num_rows) return;
    const int lane = threadIdx.x % 32;
    const int choice = row_choice[row];
    floatX* destination = expert_input + (size_t)row * C;
    if (choice < 0) {
        for (int c = lane * x128::size; c < C; c += 32 * x128::size) store128(destination + c, x128::zeros());
        return;
    }
    const floatX* source = x + (size_t)(choice / k) * C;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) store128(destination + c, load128(source + c));
}

// Combine, gathered per token: one warp per token, out[t] = sum over kept j of gates[t,j] * expert_output[row],
// added in fp32 in the order j = 0..k-1 and rounded to floatX once; a token whose choices were all dropped gets 0.
// Floor: read (kept rows)*C floatX, write N*C floatX, plus N*k*8 bytes of routing.
__global__ void moe_combine_kernel(floatX* __restrict__ out, const floatX* __restrict__ expert_output,
                                   const int* __restrict__ choice_row, const float* __restrict__ gates, int N, int k,
                                   int C) {
    const int token = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (token >= N) return;
    const int lane = threadIdx.x % 32;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        float sum[x128::size];
        for (int i = 0; i < x128::size; i++) sum[i] = 0.0f;
        for (int j = 0; j < k; j++) {
            const int choice = token * k + j;
            const int row = choice_row[choice];
            if (row < 0) continue;
            const float gate = gates[choice];
            const x128 v = load128cs(expert_output + (size_t)row * C + c);
            for (int i = 0; i < x128::size; i++) sum[i] += gate * (float)v[i];
        }
        x128 result;
        for (int i = 0; i < x128::size; i++) result[i] = (floatX)sum[i];
        store128(out + (size_t)token * C + c, result);
    }
}

// Combine backward, gathered per expert row: warp w < R owns row w; a used row (choice t*k+j) writes
// d_expert_output = gate * dout[t] and d_gates[t, j] = <dout[t], expert_output[row]> (fp32, warp-reduced); a
// padding row writes zeros. Warp w < N*k also writes d_gates[w] = 0 if choice w was dropped (it has no row).
// The grid is max(R, N*k) warps. Floor: read 2*(kept rows)*C floatX (dout rows again from L2 for k >= 2),
// write R*C floatX, plus N*k*8 + R*4 bytes of routing.
__global__ void moe_combine_backward_kernel(floatX* __restrict__ d_expert_output, float* __restrict__ d_gates,
                                            const floatX* __restrict__ dout, const floatX* __restrict__ expert_output,
                                            const int* __restrict__ choice_row, const float* __restrict__ gates,
                                            const int* __restrict__ row_choice, int num_rows, int num_choices, int k,
                                            int C) {
    const int w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (w < num_choices && lane == 0 && choice_row[w] < 0) d_gates[w] = 0.0f;
    if (w >= num_rows) return;
    const int choice = row_choice[w];
    floatX* d_row = d_expert_output + (size_t)w * C;
    if (choice < 0) {
        for (int c = lane * x128::size; c < C; c += 32 * x128::size) store128(d_row + c, x128::zeros());
        return;
    }
    const float gate = gates[choice];
    const floatX* d_token = dout + (size_t)(choice / k) * C;
    const floatX* row = expert_output + (size_t)w * C;
    float dot = 0.0f;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        const x128 d = load128(d_token + c);
        const x128 v = load128cs(row + c);
        x128 result;
        for (int i = 0; i < x128::size; i++) {
            result[i] = (floatX)(gate * (float)d[i]);
            dot += (float)d[i] * (float)v[i];
        }
        store128(d_row + c, result);
    }
    dot = warp_reduce_sum(dot);
    if (lane == 0) d_gates[choice] = dot;
}

// Dispatch backward, gathered per token: dx[t] += sum over kept j of d_expert_input[row], added in fp32 to dx's
// value in the order j = 0..k-1, one rounding. Floor: read (kept rows)*C + N*C, write N*C floatX.
__global__ void moe_dispatch_backward_kernel(floatX* __restrict__ dx, const floatX* __restrict__ d_expert_input,
                                             const int* __restrict__ choice_row, int N, int k, int C) {
    const int token = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (token >= N) return;
    const int lane = threadIdx.x % 32;
    floatX* d_token = dx + (size_t)token * C;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        const x128 current = load128(d_token + c);
        float sum[x128::size];
        for (int i = 0; i < x128::size; i++) sum[i] = (float)current[i];
        for (int j = 0; j < k; j++) {
            const int choice = token * k + j;
            const int row = choice_row[choice];
            if (row < 0) continue;
            const x128 v = load128cs(d_expert_input + (size_t)row * C + c);
            for (int i = 0; i < x128::size; i++) sum[i] += (float)v[i];
        }
        x128 result;
        for (int i = 0; i < x128::size; i++) result[i] = (floatX)sum[i];
        store128(d_token + c, result);
    }
}

// ----------------------------------------------------------------------------------------------------
// Router backward: one warp per token, lanes own experts as in the forward. rsf = routed_scale.
// MOE_SCORE_SOFTMAX, with p = probs[t]:
//   dP_e  = loss_scale * aux_alpha * E * f_e / N              (load balancing, f_e = expert_count[e] / (N*k))
//         + gate part: k == 1: gate = rsf * p, so rsf * d_gates[t,0] on the picked expert;
//                      k >= 2: gate_j = rsf * p_j / S (S = sum of the picked probs), so for picked expert i_j
//                              dP_{i_j} += (rsf * d_gates[t,j] - sum_m d_gates[t,m] * gates[t,m]) / S
//   d_logits_e = p_e * (dP_e - sum_i p_i dP_i)                (softmax backward)
//              + loss_scale * z_coef * 2 * logsumexp[t] * p_e / N   (z-loss; d lse / d logit_e = p_e)
// MOE_SCORE_SIGMOID, with the affinities a = sigmoid(logits[t]) (recomputed, the forward's fp32 values), A their
// sum and q = probs[t] = a / A (what the balance loss averages):
//   dQ_e  = loss_scale * aux_alpha * E * f_e / N              (load balancing, through q)
//   dA_e  = (dQ_e - sum_i q_i dQ_i) / A                       (q = a / A)
//         + gate part, every k: gate_j = rsf * a_j / S (S = sum of the picked affinities), so for picked i_j
//                              dA_{i_j} += (rsf * d_gates[t,j] - sum_m d_gates[t,m] * gates[t,m]) / S
//   d_logits_e = dA_e * a_e * (1 - a_e)                       (sigmoid backward)
//              + loss_scale * z_coef * 2 * logsumexp[t] * exp(logit_e - logsumexp[t]) / N   (z-loss on the logits)
// With k == 1 the sigmoid gate is rsf whatever the logits: its gate part is exactly 0 (gates = rsf * a / a).
// A dropped choice has d_gates = 0 (moe_combine_backward writes it) but stays in S: the gates are defined
// before dropping. rsf = 1 leaves the softmax path bit-identical to the one without a routed scale.
// Floor: read N*E*4 (probs; sigmoid: the logits too) + N*k*12 + N*4 + E*4, write N*E*4 bytes.
template <int LOGITS_PER_LANE>
__global__ void moe_router_backward_kernel(float* __restrict__ d_logits, const float* __restrict__ probs,
                                           const float* __restrict__ logits, const int* __restrict__ expert_index,
                                           const float* __restrict__ gates, const float* __restrict__ d_gates,
                                           const float* __restrict__ logsumexp, const int* __restrict__ expert_count,
                                           int N, int E, int k, int score, float routed_scale, float aux_alpha,
                                           float z_coef, float loss_scale) {
    const int token = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (token >= N) return;
    const int lane = threadIdx.x % 32;
    const bool sigmoid = score == MOE_SCORE_SIGMOID;
    const float aux_per_count = loss_scale * aux_alpha * (float)E / ((float)N * (float)k * (float)N);
    // p: the probs (softmax) or the affinities (sigmoid); dp: the gradient of the loss with respect to them
    float p[LOGITS_PER_LANE], dp[LOGITS_PER_LANE];
    for (int i = 0; i < LOGITS_PER_LANE; i++) {
        const int e = lane + 32 * i;
        p[i] = e < E ? probs[(size_t)token * E + e] : 0.0f;
        dp[i] = e < E ? aux_per_count * (float)expert_count[e] : 0.0f;
    }
    float affinity_sum = 0.0f;
    if (sigmoid) {  // dp holds dQ: through q = a / A into dA; p becomes the affinities
        float dot = 0.0f;
        for (int i = 0; i < LOGITS_PER_LANE; i++) dot += p[i] * dp[i];
        dot = warp_reduce_sum(dot);
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            p[i] = lane + 32 * i < E ? moe_sigmoid(logits[(size_t)token * E + lane + 32 * i]) : 0.0f;
            affinity_sum += p[i];
        }
        affinity_sum = warp_reduce_sum(affinity_sum);
        for (int i = 0; i < LOGITS_PER_LANE; i++) dp[i] = (dp[i] - dot) / affinity_sum;
    }
    const int* picks = expert_index + (size_t)token * k;
    const float* d_gate = d_gates + (size_t)token * k;
    if (k == 1 && !sigmoid) {
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            if (lane + 32 * i == picks[0]) dp[i] += routed_scale * d_gate[0];
        }
    } else {
        float picked_sum = 0.0f, gate_dot = 0.0f;
        for (int j = 0; j < k; j++) {
            // every lane reads the pick's score itself (the sigmoid's from its logit, as the forward computed it)
            const size_t pick = (size_t)token * E + picks[j];
            picked_sum += sigmoid ? moe_sigmoid(logits[pick]) : probs[pick];
            gate_dot += d_gate[j] * gates[(size_t)token * k + j];
        }
        for (int j = 0; j < k; j++) {
            const float dp_pick = (routed_scale * d_gate[j] - gate_dot) / picked_sum;
            for (int i = 0; i < LOGITS_PER_LANE; i++) {
                if (lane + 32 * i == picks[j]) dp[i] += dp_pick;
            }
        }
    }
    const float z_scale = loss_scale * z_coef * 2.0f * logsumexp[token] / (float)N;
    if (sigmoid) {
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            const int e = lane + 32 * i;
            if (e < E) {
                const float softmax = expf(logits[(size_t)token * E + e] - logsumexp[token]);
                d_logits[(size_t)token * E + e] = dp[i] * p[i] * (1.0f - p[i]) + z_scale * softmax;
            }
        }
        return;
    }
    float dot = 0.0f;
    for (int i = 0; i < LOGITS_PER_LANE; i++) dot += p[i] * dp[i];
    dot = warp_reduce_sum(dot);
    for (int i = 0; i < LOGITS_PER_LANE; i++) {
        const int e = lane + 32 * i;
        if (e < E) d_logits[(size_t)token * E + e] = p[i] * (dp[i] - dot) + z_scale * p[i];
    }
}

// Router losses, deterministic (fixed grid, fixed reduction order, no atomics):
//   aux = aux_alpha * E * sum_e f_e P_e = aux_alpha * E / (N*k*N) * sum_t sum_e expert_count[e] * probs[t, e]
//   z   = z_coef * mean_t logsumexp[t]^2
// First pass: a grid of G <= MOE_LOSSES_MAX_BLOCKS blocks (G from N*E alone, so the sums do not depend on the GPU)
// strides over probs in 16-byte vectors and over logsumexp; each block reduces its two sums and writes
// partials[b] (weighted probs) and partials[G + b] (squared lse). Second pass: one warp adds the partials, lane l
// taking b = l, l + 32, ... in order, then a warp reduction.
// Floor: read N*E*4 + N*4 + E*4 bytes (the partials, 8*G bytes, stay in L2). At N = 65536: 16.8 MB with E = 64
// (3.5 us at ~4.8 TB/s), 2.4 MB with E = 8 (0.5 us, below the two launches). One block streaming them, as this
// kernel did before, reaches a single SM's bandwidth, a small fraction of the GPU's.
__global__ void moe_router_losses_partials_kernel(float* __restrict__ partials, const float* __restrict__ probs,
                                                  const float* __restrict__ logsumexp,
                                                  const int* __restrict__ expert_count, int N, int E) {
    __shared__ float weight[MOE_MAX_EXPERTS];  // expert_count[e] as a float, by expert
    for (int e = threadIdx.x; e < E; e += blockDim.x) weight[e] = (float)expert_count[e];
    __syncthreads();
    const size_t num_probs = (size_t)N * E;
    const size_t num_vectors = num_probs / f128::size;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    float weighted = 0.0f;
    for (size_t v = first; v < num_vectors; v += stride) {
        const f128 p = load128cs(probs + v * f128::size);
        int e = (int)((v * f128::size) % E);  // one division per vector, then the expert advances with a wrap
        for (int i = 0; i < f128::size; i++) {
            weighted += weight[e] * p[i];
            e = e + 1 == E ? 0 : e + 1;
        }
    }
    for (size_t i = num_vectors * f128::size + first; i < num_probs; i += stride) weighted += weight[i % E] * probs[i];
    float squares = 0.0f;
    for (size_t t = first; t < (size_t)N; t += stride) squares += logsumexp[t] * logsumexp[t];
    weighted = block_reduce<warp_reduce_sum>(weighted, true);
    squares = block_reduce<warp_reduce_sum>(squares);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = weighted;
        partials[gridDim.x + blockIdx.x] = squares;
    }
}

// one warp
__global__ void moe_router_losses_final_kernel(float* __restrict__ aux_and_z, const float* __restrict__ partials,
                                               int num_blocks, int N, int E, int k, float aux_alpha, float z_coef) {
    float weighted = 0.0f, squares = 0.0f;
    for (int b = threadIdx.x; b < num_blocks; b += 32) {
        weighted += partials[b];
        squares += partials[num_blocks + b];
    }
    weighted = warp_reduce_sum(weighted);
    squares = warp_reduce_sum(squares);
    if (threadIdx.x == 0) {
        aux_and_z[0] = aux_alpha * (float)E * (weighted / ((float)N * (float)k * (float)N));
        aux_and_z[1] = z_coef * squares / (float)N;
    }
}

// ----------------------------------------------------------------------------------------------------
// Sequence-wise balance loss (doc/moe.md, "Routing options" 7). The group's N tokens are S = N / T
// sequences of T consecutive tokens; c[s, e] = sequence s's choices routed to e before dropping, f = c / (T*k) a
// constant, P[s, e] = the mean over its tokens of probs (softmax probs, or the sigmoid affinities over their sum):
//   seq = alpha * E * mean_s sum_e f[s, e] P[s, e]
//       = alpha * E / (S*T*k*T) * sum_s sum_{t in s} sum_e c[s, e] probs[t, e]
//   d seq / d probs[t, e] = alpha * E * c[s(t), e] / (S*T*k*T)
// Forward, deterministic: one block per sequence counts its choices (shared-memory int atomics: exact in any order),
// writes them (the backward reads them) and reduces its weighted probs to partials[s]; one warp adds the partials
// in a fixed order. Floor: read N*k*4 + N*E*4, write S*E*4 + S*4 bytes (the same N*E read as moe_router_losses).
__global__ void moe_seq_losses_partials_kernel(float* __restrict__ partials, int* __restrict__ seq_count,
                                               const float* __restrict__ probs, const int* __restrict__ expert_index,
                                               int T, int E, int k) {
    __shared__ int count[MOE_MAX_EXPERTS];
    const int s = blockIdx.x;
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    const int* picks = expert_index + (size_t)s * T * k;
    for (int i = threadIdx.x; i < T * k; i += blockDim.x) atomicAdd(&count[picks[i]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) seq_count[(size_t)s * E + e] = count[e];
    const float* rows = probs + (size_t)s * T * E;
    float weighted = 0.0f;
    for (int i = threadIdx.x; i < T * E; i += blockDim.x) weighted += (float)count[i % E] * rows[i];
    weighted = block_reduce<warp_reduce_sum>(weighted);
    if (threadIdx.x == 0) partials[s] = weighted;
}

// one warp
__global__ void moe_seq_losses_final_kernel(float* __restrict__ seq_loss, const float* __restrict__ partials, int S,
                                            int T, int E, int k, float alpha) {
    float weighted = 0.0f;
    for (int s = threadIdx.x; s < S; s += 32) weighted += partials[s];
    weighted = warp_reduce_sum(weighted);
    if (threadIdx.x == 0) seq_loss[0] = alpha * (float)E * (weighted / ((float)S * (float)T * (float)k * (float)T));
}

// Backward, one warp per token as moe_router_backward: g_e = loss_scale * d seq / d probs[t, e], then through the
// score into the logits, added to d_logits (the other terms' gradient, moe_router_backward's):
//   softmax: d_logits_e += p_e * (g_e - sum_i p_i g_i)
//   sigmoid: d_logits_e += (g_e - sum_i q_i g_i) / A * a_e * (1 - a_e)   (q = probs = a / A, a = sigmoid(logits))
// Floor: read N*E*4 (probs; sigmoid: the logits too) + S*E*4, read and write N*E*4 bytes (d_logits).
template <int LOGITS_PER_LANE>
__global__ void moe_seq_loss_backward_kernel(float* __restrict__ d_logits, const float* __restrict__ probs,
                                             const float* __restrict__ logits, const int* __restrict__ seq_count,
                                             int N, int T, int E, int k, int score, float alpha, float loss_scale) {
    const int token = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (token >= N) return;
    const int lane = threadIdx.x % 32;
    const int S = N / T;
    const float per_count = loss_scale * alpha * (float)E / ((float)S * (float)T * (float)k * (float)T);
    const int* count = seq_count + (size_t)(token / T) * E;
    float p[LOGITS_PER_LANE], g[LOGITS_PER_LANE];
    float dot = 0.0f;
    for (int i = 0; i < LOGITS_PER_LANE; i++) {
        const int e = lane + 32 * i;
        p[i] = e < E ? probs[(size_t)token * E + e] : 0.0f;
        g[i] = e < E ? per_count * (float)count[e] : 0.0f;
        dot += p[i] * g[i];
    }
    dot = warp_reduce_sum(dot);
    if (score == MOE_SCORE_SIGMOID) {
        float a[LOGITS_PER_LANE], affinity_sum = 0.0f;
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            a[i] = lane + 32 * i < E ? moe_sigmoid(logits[(size_t)token * E + lane + 32 * i]) : 0.0f;
            affinity_sum += a[i];
        }
        affinity_sum = warp_reduce_sum(affinity_sum);
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            const int e = lane + 32 * i;
            if (e < E) d_logits[(size_t)token * E + e] += (g[i] - dot) / affinity_sum * a[i] * (1.0f - a[i]);
        }
        return;
    }
    for (int i = 0; i < LOGITS_PER_LANE; i++) {
        const int e = lane + 32 * i;
        if (e < E) d_logits[(size_t)token * E + e] += p[i] * (g[i] - dot);
    }
}

// ----------------------------------------------------------------------------------------------------
// Aux-loss-free balancing (doc/moe.md, "Routing options" 6). The step's loads: counts (n) += the
// expert_count of a forward pass (n = Lm * E ints), once per micro-batch. The update, after the optimizer step, on
// the loads summed over the micro-batches and the processes: bias[m, e] += gamma * sign(sum_e' load[m, e'] -
// E * load[m, e]), the sign decided on integers (int64: E * load cannot overflow), one fp32 rounding of the sum, so
// every process that holds the same loads writes the same bits. One thread per (layer, expert), each summing its
// layer's E loads itself: Lm * E <= a few thousand values, one launch either way. Floor: Lm*E*12 bytes (tiny).
__global__ void moe_add_counts_kernel(int* __restrict__ counts, const int* __restrict__ add, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) counts[i] += add[i];
}

__global__ void moe_balance_bias_update_kernel(float* __restrict__ bias, const int* __restrict__ loads, int Lm, int E,
                                               float gamma) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= Lm * E) return;
    const int* layer = loads + (size_t)(i / E) * E;
    long long total = 0;
    for (int e = 0; e < E; e++) total += layer[e];
    const long long excess = total - (long long)E * loads[i];  // sign(mean load - load) times E
    bias[i] += excess > 0 ? gamma : (excess < 0 ? -gamma : 0.0f);
}

// ----------------------------------------------------------------------------------------------------
// host side

// Rows per expert buffer: ceil(k * CF * N / E), evaluated in double as ((k * CF) * N) / E so that the PyTorch
// reference (math.ceil(k * cf * N / E) with the same decimal cf) gets the same integer; CF is a double for the
// same reason (a float 1.1 is not the double 1.1). An expert receives at most N choices (a token's k experts are
// distinct), so the result is clamped to N, and CF <= 0 (dropless) gives N: every choice fits.
int moe_capacity(int N, int E, int k, double capacity_factor) {
    if (capacity_factor <= 0.0) return N;
    const double rows = ceil((double)k * capacity_factor * (double)N / (double)E);
    return rows < (double)N ? (int)rows : N;
}

// The sizes these kernels support; false with a one-line reason otherwise. Called by the trainer at start-up.
bool moe_support(int C, int E, int k, int H, char* why, size_t why_size) {
    if (C <= 0 || C % 8 != 0) {
        snprintf(why, why_size, "C = %d: the MoE dispatch and combine kernels need C a positive multiple of 8 "
                 "(16-byte vectors of 8 bf16)", C);
        return false;
    }
    if (E < 1 || E > MOE_MAX_EXPERTS) {
        snprintf(why, why_size, "E = %d experts: the router kernels hold a token's logits in one warp, "
                 "1 <= E <= %d", E, MOE_MAX_EXPERTS);
        return false;
    }
    if (k < 1 || k > E || k > MOE_MAX_TOP_K) {
        snprintf(why, why_size, "top-k = %d: needs 1 <= k <= E (%d) and k <= %d (one lane per pick)", k, E,
                 MOE_MAX_TOP_K);
        return false;
    }
    if (H <= 0 || H % 8 != 0) {
        snprintf(why, why_size, "expert hidden size H = %d: the expert GEMMs need H a positive multiple of 8", H);
        return false;
    }
    return true;
}

// Refusals are one line and exit: these are programming errors of the caller, never data-dependent.
static void moe_require(bool condition, const char* function, const char* what) {
    if (!condition) {
        fprintf(stderr, "%s: %s\n", function, what);
        exit(EXIT_FAILURE);
    }
}

static void moe_require_aligned(const char* function, const void* a, const void* b, const void* c) {
    moe_require(((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) % 16 == 0, function, "buffers must be 16-byte aligned");
}

static int moe_warp_grid(size_t warps, int block_size) { return (int)CEIL_DIV(warps, (size_t)(block_size / 32)); }

void moe_router_forward_launch(float* probs, int* expert_index, float* gates, float* logsumexp, const float* logits,
                               const float* balance_bias, int N, int E, int k, int score, float routed_scale,
                               int groups, int group_limit, int block_size, cudaStream_t stream) {
    moe_require(E >= 1 && E <= MOE_MAX_EXPERTS && k >= 1 && k <= E && k <= MOE_MAX_TOP_K, "moe_router_forward",
                "needs 1 <= k <= E <= 256 and k <= 32 (see moe_support)");
    moe_require(score == MOE_SCORE_SOFTMAX || score == MOE_SCORE_SIGMOID, "moe_router_forward",
                "score must be MOE_SCORE_SOFTMAX or MOE_SCORE_SIGMOID");
    moe_require(balance_bias == nullptr || score == MOE_SCORE_SIGMOID, "moe_router_forward",
                "a balancing bias needs sigmoid scores");
    moe_require(group_limit == 0 || (groups >= 1 && E % groups == 0 && group_limit <= groups &&
                                     group_limit * (E / groups) >= k), "moe_router_forward",
                "a device limit M needs groups G dividing E, M <= G and M * E / G >= k");
    const int grid = moe_warp_grid(N, block_size);
    if (E <= 32) {
        moe_router_forward_kernel<1><<<grid, block_size, 0, stream>>>(probs, expert_index, gates, logsumexp, logits,
                                                                      balance_bias, N, E, k, score, routed_scale,
                                                                      groups, group_limit);
    } else if (E <= 64) {
        moe_router_forward_kernel<2><<<grid, block_size, 0, stream>>>(probs, expert_index, gates, logsumexp, logits,
                                                                      balance_bias, N, E, k, score, routed_scale,
                                                                      groups, group_limit);
    } else if (E <= 128) {
        moe_router_forward_kernel<4><<<grid, block_size, 0, stream>>>(probs, expert_index, gates, logsumexp, logits,
                                                                      balance_bias, N, E, k, score, routed_scale,
                                                                      groups, group_limit);
    } else {
        moe_router_forward_kernel<8><<<grid, block_size, 0, stream>>>(probs, expert_index, gates, logsumexp, logits,
                                                                      balance_bias, N, E, k, score, routed_scale,
                                                                      groups, group_limit);
    }
    cudaCheck(cudaGetLastError());
}

// logits (N, E) -> probs (N, E) (sigmoid: the normalised affinities), expert_index (N, k) in descending order of
// the key, gates (N, k) (times routed_scale), logsumexp (N); balance_bias (E) or NULL (no bias: the key is the logit);
// group_limit M > 0: the picks among the M of the `groups` expert groups with the largest keys (device-limited
// routing), 0: among all E
void moe_router_forward(float* probs, int* expert_index, float* gates, float* logsumexp, const float* logits,
                        const float* balance_bias, int N, int E, int k, int score, float routed_scale, int groups,
                        int group_limit, cudaStream_t stream) {
    moe_router_forward_launch(probs, expert_index, gates, logsumexp, logits, balance_bias, N, E, k, score,
                              routed_scale, groups, group_limit, MOE_WARP_KERNEL_BLOCK_SIZE, stream);
}

// the bits of the largest expert index E - 1 (0 for E = 1): what moe_warp_peers compares
static int moe_expert_bits(int E) {
    int bits = 0;
    while ((1 << bits) < E) bits++;
    return bits;
}

// ints of scratch moe_assign_slots_launch needs with this block size: the count of each expert in each tile of
// MOE_SLOTS_ITEMS * block_size choices, their offsets, then the experts' first rows
size_t moe_assign_slots_launch_scratch_size(int N, int E, int k, int block_size) {
    const size_t tiles = CEIL_DIV((size_t)N * k, (size_t)MOE_SLOTS_ITEMS * block_size);
    return (2 * tiles + 1) * E;  // counts and offsets (tiles, E) each, first rows (E)
}

// ints of scratch moe_assign_slots needs
size_t moe_assign_slots_scratch_size(int N, int E, int k) {
    return moe_assign_slots_launch_scratch_size(N, E, k, MOE_SLOTS_BLOCK_SIZE);
}

void moe_assign_slots_launch(int* choice_row, int* row_choice, int* expert_count, int* kept_count, int* scratch,
                             const int* expert_index, int N, int E, int k, int capacity, bool packed, int block_size,
                             cudaStream_t stream) {
    moe_require(N >= 1 && E >= 1 && E <= MOE_MAX_EXPERTS && k >= 1 && k <= E, "moe_assign_slots",
                "needs N >= 1 and 1 <= k <= E <= 256 (see moe_support)");
    moe_require(capacity >= 1, "moe_assign_slots", "capacity must be >= 1 rows (use moe_capacity; dropless = N)");
    moe_require(!packed || capacity == N, "moe_assign_slots", "the packed layout is for dropless routing (capacity N)");
    moe_require(block_size >= 32 && block_size <= 1024 && block_size % 32 == 0, "moe_assign_slots",
                "block size must be a multiple of 32, at most 1024");
    // choices and rows are int indices (choice_row, row_choice); 2^30 leaves a tile's headroom past the last one
    moe_require((size_t)N * k < (1u << 30) && (size_t)E * capacity < (1u << 30), "moe_assign_slots",
                "needs N*k < 2^30 choices and E*capacity < 2^30 rows (int indices)");
    const int tiles = (int)CEIL_DIV((size_t)N * k, (size_t)MOE_SLOTS_ITEMS * block_size);
    const int expert_bits = moe_expert_bits(E);
    int* tile_counts = scratch;                        // (tiles, E)
    int* tile_offsets = scratch + (size_t)tiles * E;   // (tiles, E)
    int* first_row = scratch + 2 * (size_t)tiles * E;  // (E)
    moe_slots_count_kernel<<<tiles, block_size, 0, stream>>>(tile_counts, expert_index, N, E, k, expert_bits);
    cudaCheck(cudaGetLastError());
    moe_slots_scan_kernel<<<1, MOE_SLOTS_SCAN_BLOCK_SIZE, 0, stream>>>(tile_counts, tile_offsets, first_row,
                                                                       expert_count, kept_count, tiles, E, capacity,
                                                                       packed);
    cudaCheck(cudaGetLastError());
    const size_t shared = (size_t)(block_size / 32) * E * sizeof(int);  // <= 32 KiB
    moe_slots_assign_kernel<<<tiles, block_size, shared, stream>>>(choice_row, row_choice, tile_offsets, first_row,
                                                                   kept_count, expert_index, N, E, k, expert_bits,
                                                                   capacity, packed);
    cudaCheck(cudaGetLastError());
}

// expert_index (N, k) -> choice_row (N, k) (-1: dropped), row_choice (R) (-1: padding row), expert_count (E) =
// choices routed to e before dropping, kept_count (E) = rows of e used. Padded layout: R = E * capacity; packed
// (dropless, capacity = N): R = N * k. scratch: moe_assign_slots_scratch_size(N, E, k) ints.
void moe_assign_slots(int* choice_row, int* row_choice, int* expert_count, int* kept_count, int* scratch,
                      const int* expert_index, int N, int E, int k, int capacity, bool packed, cudaStream_t stream) {
    moe_assign_slots_launch(choice_row, row_choice, expert_count, kept_count, scratch, expert_index, N, E, k,
                            capacity, packed, MOE_SLOTS_BLOCK_SIZE, stream);
}

void moe_dispatch_launch(floatX* expert_input, const floatX* x, const int* row_choice, int num_rows, int k, int C,
                         int block_size, cudaStream_t stream) {
    moe_require(C % 8 == 0 && num_rows >= 1, "moe_dispatch", "needs C a multiple of 8 and at least one row");
    moe_require_aligned("moe_dispatch", expert_input, x, nullptr);
    moe_dispatch_kernel<<<moe_warp_grid(num_rows, block_size), block_size, 0, stream>>>(expert_input, x, row_choice,
                                                                                        num_rows, k, C);
    cudaCheck(cudaGetLastError());
}

// expert_input (num_rows, C) = x (N, C) rows by row_choice, zeros in padding rows
void moe_dispatch(floatX* expert_input, const floatX* x, const int* row_choice, int num_rows, int k, int C,
                  cudaStream_t stream) {
    moe_dispatch_launch(expert_input, x, row_choice, num_rows, k, C, MOE_WARP_KERNEL_BLOCK_SIZE, stream);
}

void moe_combine_launch(floatX* out, const floatX* expert_output, const int* choice_row, const float* gates, int N,
                        int k, int C, int block_size, cudaStream_t stream) {
    moe_require(C % 8 == 0, "moe_combine", "needs C a multiple of 8");
    moe_require_aligned("moe_combine", out, expert_output, nullptr);
    moe_combine_kernel<<<moe_warp_grid(N, block_size), block_size, 0, stream>>>(out, expert_output, choice_row, gates,
                                                                               N, k, C);
    cudaCheck(cudaGetLastError());
}

// out (N, C) = sum over kept choices of gate * expert_output[choice_row] (R, C); 0 if all dropped
void moe_combine(floatX* out, const floatX* expert_output, const int* choice_row, const float* gates, int N, int k,
                 int C, cudaStream_t stream) {
    moe_combine_launch(out, expert_output, choice_row, gates, N, k, C, MOE_WARP_KERNEL_BLOCK_SIZE, stream);
}

void moe_combine_backward_launch(floatX* d_expert_output, float* d_gates, const floatX* dout,
                                 const floatX* expert_output, const int* choice_row, const float* gates,
                                 const int* row_choice, int N, int num_rows, int k, int C, int block_size,
                                 cudaStream_t stream) {
    moe_require(C % 8 == 0 && num_rows >= 1, "moe_combine_backward", "needs C a multiple of 8 and at least one row");
    moe_require_aligned("moe_combine_backward", d_expert_output, dout, expert_output);
    const int num_choices = N * k;
    const int warps = num_rows > num_choices ? num_rows : num_choices;
    moe_combine_backward_kernel<<<moe_warp_grid(warps, block_size), block_size, 0, stream>>>(
        d_expert_output, d_gates, dout, expert_output, choice_row, gates, row_choice, num_rows, num_choices, k, C);
    cudaCheck(cudaGetLastError());
}

// d_expert_output (num_rows, C) = gate * dout[token] in used rows, 0 in padding rows;
// d_gates (N, k) = <dout[t], expert_output[choice_row]> for kept choices, 0 for dropped ones
void moe_combine_backward(floatX* d_expert_output, float* d_gates, const floatX* dout, const floatX* expert_output,
                          const int* choice_row, const float* gates, const int* row_choice, int N, int num_rows, int k,
                          int C, cudaStream_t stream) {
    moe_combine_backward_launch(d_expert_output, d_gates, dout, expert_output, choice_row, gates, row_choice, N,
                                num_rows, k, C, MOE_WARP_KERNEL_BLOCK_SIZE, stream);
}

void moe_dispatch_backward_launch(floatX* dx, const floatX* d_expert_input, const int* choice_row, int N, int k, int C,
                                  int block_size, cudaStream_t stream) {
    moe_require(C % 8 == 0, "moe_dispatch_backward", "needs C a multiple of 8");
    moe_require_aligned("moe_dispatch_backward", dx, d_expert_input, nullptr);
    moe_dispatch_backward_kernel<<<moe_warp_grid(N, block_size), block_size, 0, stream>>>(dx, d_expert_input,
                                                                                         choice_row, N, k, C);
    cudaCheck(cudaGetLastError());
}

// dx (N, C) += sum over kept choices of d_expert_input[choice_row] (R, C)
void moe_dispatch_backward(floatX* dx, const floatX* d_expert_input, const int* choice_row, int N, int k, int C,
                           cudaStream_t stream) {
    moe_dispatch_backward_launch(dx, d_expert_input, choice_row, N, k, C, MOE_WARP_KERNEL_BLOCK_SIZE, stream);
}

void moe_router_backward_launch(float* d_logits, const float* probs, const float* logits, const int* expert_index,
                                const float* gates, const float* d_gates, const float* logsumexp,
                                const int* expert_count, int N, int E, int k, int score, float routed_scale,
                                float aux_alpha, float z_coef, float loss_scale, int block_size, cudaStream_t stream) {
    moe_require(E >= 1 && E <= MOE_MAX_EXPERTS && k >= 1 && k <= E, "moe_router_backward",
                "needs 1 <= k <= E <= 256 (see moe_support)");
    moe_require(score == MOE_SCORE_SOFTMAX || score == MOE_SCORE_SIGMOID, "moe_router_backward",
                "score must be MOE_SCORE_SOFTMAX or MOE_SCORE_SIGMOID");
    const int grid = moe_warp_grid(N, block_size);
    if (E <= 32) {
        moe_router_backward_kernel<1><<<grid, block_size, 0, stream>>>(d_logits, probs, logits, expert_index, gates,
                                                                       d_gates, logsumexp, expert_count, N, E, k,
                                                                       score, routed_scale, aux_alpha, z_coef,
                                                                       loss_scale);
    } else if (E <= 64) {
        moe_router_backward_kernel<2><<<grid, block_size, 0, stream>>>(d_logits, probs, logits, expert_index, gates,
                                                                       d_gates, logsumexp, expert_count, N, E, k,
                                                                       score, routed_scale, aux_alpha, z_coef,
                                                                       loss_scale);
    } else if (E <= 128) {
        moe_router_backward_kernel<4><<<grid, block_size, 0, stream>>>(d_logits, probs, logits, expert_index, gates,
                                                                       d_gates, logsumexp, expert_count, N, E, k,
                                                                       score, routed_scale, aux_alpha, z_coef,
                                                                       loss_scale);
    } else {
        moe_router_backward_kernel<8><<<grid, block_size, 0, stream>>>(d_logits, probs, logits, expert_index, gates,
                                                                       d_gates, logsumexp, expert_count, N, E, k,
                                                                       score, routed_scale, aux_alpha, z_coef,
                                                                       loss_scale);
    }
    cudaCheck(cudaGetLastError());
}

// d_logits (N, E) = gradient through the gates (d_gates), the load-balancing loss and the z-loss (these two
// multiplied by loss_scale), through the softmax or the sigmoid (which reads the logits; softmax does not); fp32
void moe_router_backward(float* d_logits, const float* probs, const float* logits, const int* expert_index,
                         const float* gates, const float* d_gates, const float* logsumexp, const int* expert_count,
                         int N, int E, int k, int score, float routed_scale, float aux_alpha, float z_coef,
                         float loss_scale, cudaStream_t stream) {
    moe_router_backward_launch(d_logits, probs, logits, expert_index, gates, d_gates, logsumexp, expert_count, N, E,
                               k, score, routed_scale, aux_alpha, z_coef, loss_scale, MOE_WARP_KERNEL_BLOCK_SIZE,
                               stream);
}

// floats of scratch moe_router_losses needs: two partial sums per block of its first pass
size_t moe_router_losses_partials_size(void) { return 2 * MOE_LOSSES_MAX_BLOCKS; }

void moe_router_losses_launch(float* aux_and_z, float* partials, const float* probs, const float* logsumexp,
                              const int* expert_count, int N, int E, int k, float aux_alpha, float z_coef,
                              int block_size, cudaStream_t stream) {
    moe_require(N >= 1 && E >= 1 && E <= MOE_MAX_EXPERTS && k >= 1, "moe_router_losses",
                "needs N >= 1 and 1 <= E <= 256 (see moe_support)");
    moe_require(block_size >= 32 && block_size <= 1024 && block_size % 32 == 0, "moe_router_losses",
                "block size must be a multiple of 32, at most 1024");
    moe_require((uintptr_t)probs % 16 == 0, "moe_router_losses", "probs must be 16-byte aligned");
    // at least 4 vectors (16 probabilities) per thread: small groups need few blocks
    const size_t vectors = CEIL_DIV((size_t)N * E, (size_t)f128::size);
    const size_t blocks = CEIL_DIV(vectors, (size_t)4 * block_size);
    const int grid = blocks < MOE_LOSSES_MAX_BLOCKS ? (int)blocks : MOE_LOSSES_MAX_BLOCKS;
    moe_router_losses_partials_kernel<<<grid, block_size, 0, stream>>>(partials, probs, logsumexp, expert_count, N,
                                                                       E);
    cudaCheck(cudaGetLastError());
    moe_router_losses_final_kernel<<<1, 32, 0, stream>>>(aux_and_z, partials, grid, N, E, k, aux_alpha, z_coef);
    cudaCheck(cudaGetLastError());
}

// aux_and_z[0] = load-balancing loss, aux_and_z[1] = z-loss (device, fp32); partials:
// moe_router_losses_partials_size() floats of scratch
void moe_router_losses(float* aux_and_z, float* partials, const float* probs, const float* logsumexp,
                       const int* expert_count, int N, int E, int k, float aux_alpha, float z_coef,
                       cudaStream_t stream) {
    moe_router_losses_launch(aux_and_z, partials, probs, logsumexp, expert_count, N, E, k, aux_alpha, z_coef,
                             MOE_LOSSES_BLOCK_SIZE, stream);
}

// The sequence-wise balance loss of a group of N / T sequences of T tokens (N a multiple of T): seq_loss[0]
// (device, fp32); seq_count (N / T, E) ints, each sequence's choices per expert before dropping (the backward's
// input); partials: N / T floats of scratch
void moe_seq_losses(float* seq_loss, int* seq_count, float* partials, const float* probs, const int* expert_index,
                    int N, int T, int E, int k, float alpha, cudaStream_t stream) {
    moe_require(T >= 1 && N >= T && N % T == 0 && E >= 1 && E <= MOE_MAX_EXPERTS && k >= 1 && k <= E,
                "moe_seq_losses", "needs N a multiple of T and 1 <= k <= E <= 256");
    const int S = N / T;
    moe_seq_losses_partials_kernel<<<S, 256, 0, stream>>>(partials, seq_count, probs, expert_index, T, E, k);
    cudaCheck(cudaGetLastError());
    moe_seq_losses_final_kernel<<<1, 32, 0, stream>>>(seq_loss, partials, S, T, E, k, alpha);
    cudaCheck(cudaGetLastError());
}

// d_logits (N, E) += the sequence-wise loss's gradient (times loss_scale) through the softmax or the sigmoid
void moe_seq_loss_backward(float* d_logits, const float* probs, const float* logits, const int* seq_count, int N,
                           int T, int E, int k, int score, float alpha, float loss_scale, cudaStream_t stream) {
    moe_require(T >= 1 && N >= T && N % T == 0 && E >= 1 && E <= MOE_MAX_EXPERTS && k >= 1 && k <= E,
                "moe_seq_loss_backward", "needs N a multiple of T and 1 <= k <= E <= 256");
    const int block_size = MOE_WARP_KERNEL_BLOCK_SIZE, grid = moe_warp_grid(N, block_size);
    if (E <= 32) {
        moe_seq_loss_backward_kernel<1><<<grid, block_size, 0, stream>>>(d_logits, probs, logits, seq_count, N, T, E,
                                                                         k, score, alpha, loss_scale);
    } else if (E <= 64) {
        moe_seq_loss_backward_kernel<2><<<grid, block_size, 0, stream>>>(d_logits, probs, logits, seq_count, N, T, E,
                                                                         k, score, alpha, loss_scale);
    } else if (E <= 128) {
        moe_seq_loss_backward_kernel<4><<<grid, block_size, 0, stream>>>(d_logits, probs, logits, seq_count, N, T, E,
                                                                         k, score, alpha, loss_scale);
    } else {
        moe_seq_loss_backward_kernel<8><<<grid, block_size, 0, stream>>>(d_logits, probs, logits, seq_count, N, T, E,
                                                                         k, score, alpha, loss_scale);
    }
    cudaCheck(cudaGetLastError());
}

// counts (n) += add (n), ints
void moe_add_counts(int* counts, const int* add, int n, cudaStream_t stream) {
    moe_add_counts_kernel<<<CEIL_DIV(n, 256), 256, 0, stream>>>(counts, add, n);
    cudaCheck(cudaGetLastError());
}

// bias (Lm, E) fp32 moved by gamma against the loads (Lm, E) (the step's choices per expert before dropping)
void moe_balance_bias_update(float* bias, const int* loads, int Lm, int E, float gamma, cudaStream_t stream) {
    moe_balance_bias_update_kernel<<<CEIL_DIV(Lm * E, 256), 256, 0, stream>>>(bias, loads, Lm, E, gamma);
    cudaCheck(cudaGetLastError());
}
