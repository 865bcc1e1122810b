// llmc/moe_router.cuh: the MoE router's kernels: the scores (softmax, or sigmoid affinities) with fused top-k, the
// gates, device-limited routing and the balancing bias in the picks (forward), and the gradient of the logits
// through the gates, the load-balancing loss and the z-loss (backward). Shapes and limits: llmc/moe_common.cuh;
// semantics: doc/moe.md, "Routing" and "Routing options".
// Labs: dev/cuda/moe_router.cu (forward) and dev/cuda/moe_router_backward.cu (e.g. `make build/lab/moe_router_bf16
// && build/lab/moe_router_bf16 -s`).
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-moe_router_{bf16,fp32}, lab-moe_router_backward_{bf16,fp32}
// and their lab-check- twins; moe-* and check-moe-* (routing and router gradients against PyTorch).
#pragma once
#include "moe_common.cuh"

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
// Grouped routing (ibid. 9 and 11; group_limit M > 0): the experts are G = `groups` groups of E/G consecutive
// indices; a group's score is its largest key (MOE_GROUP_MAX_KEY, device-limited routing) or the fp32 sum of its two
// largest affinity + bias (MOE_GROUP_TOP2_SUM, the model's expert groups; sigmoid scores, bias 0 without one), the
// M groups of largest score are kept (ties to the lower group, the same warp argmax over (score, group)) and the
// picks skip every expert outside them, which starts them as taken. probs, logsumexp and the gates' denominators
// are unchanged: they read the picks' own scores.
// Floor: read N*E*4, write N*E*4 + N*k*8 + N*4 bytes; ~E*(10 + 5k) flops per token (sigmoid: E more exps):
// memory-bound. Grouped routing reads and writes nothing more; per token it adds G group scores (E compares
// spread over the lanes, then G warp argmax reductions of 5 shuffle pairs; the top-2 sum E more compares and G max
// reductions) and M group picks (G compares, 5 shuffle pairs each): ~2E + 15G + M(G + 10) operations, at E = 256,
// G = 8, M = 4 (DeepSeek-V3's shape) about a tenth of the (10 + 5k)E above for k = 8.
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

// sigmoid(x) in fp32, one definition for the forward and backward passes (the backward recomputes the affinities)
__device__ inline float moe_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Grouped routing's kept groups for one token (a warp; lane owns experts and groups lane + 32*i, G <= E):
// returns the lane's bits i set for its experts outside the `limit` groups of largest score, which the picks then
// treat as taken (bit i: expert lane + 32*i already picked). A group's score sums its `top` (1 or 2) largest
// group_key values, the largest first; the second is the largest of the other experts, so equal values count twice.
template <int LOGITS_PER_LANE>
__device__ inline unsigned int moe_outside_kept_groups(const float* group_key, int E, int groups, int limit, int top) {
    const int lane = threadIdx.x % 32;
    const int group_size = E / groups;
    float group_score[LOGITS_PER_LANE];
    for (int g = 0; g < groups; g++) {
        float best = -INFINITY;
        int best_expert = INT_MAX;  // INT_MAX: no candidate
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            const int e = lane + 32 * i;
            if (e < E && e / group_size == g && (best_expert == INT_MAX || group_key[i] > best)) {
                best = group_key[i];
                best_expert = e;
            }
        }
        moe_warp_argmax(&best, &best_expert);
        if (top == 2) {
            float second = -INFINITY;
            for (int i = 0; i < LOGITS_PER_LANE; i++) {
                const int e = lane + 32 * i;
                if (e < E && e / group_size == g && e != best_expert) second = fmaxf(second, group_key[i]);
            }
            best += warp_reduce_max(second);
        }
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
                                          float routed_scale, int groups, int group_limit, int group_score) {
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

    // bit i: expert lane + 32*i already picked, or (grouped routing) outside the kept groups
    unsigned int taken = 0;
    if (group_limit > 0 && group_score == MOE_GROUP_TOP2_SUM) {
        float group_key[LOGITS_PER_LANE];  // the affinity + bias, bias 0 without one
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            const int e = lane + 32 * i;
            group_key[i] = balance_bias != nullptr && e < E ? key[i] : prob[i];
        }
        taken = moe_outside_kept_groups<LOGITS_PER_LANE>(group_key, E, groups, group_limit, 2);
    } else if (group_limit > 0) {
        taken = moe_outside_kept_groups<LOGITS_PER_LANE>(key, E, groups, group_limit, 1);
    }
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

// ----------------------------------------------------------------------------------------------------
// host side

void moe_router_forward_launch(float* probs, int* expert_index, float* gates, float* logsumexp, const float* logits,
                               const float* balance_bias, int N, int E, int k, int score, float routed_scale,
                               int groups, int group_limit, int group_score, int block_size, cudaStream_t stream) {
    moe_require(E >= 1 && E <= MOE_MAX_EXPERTS && k >= 1 && k <= E && k <= MOE_MAX_TOP_K, "moe_router_forward",
                "needs 1 <= k <= E <= 256 and k <= 32 (see moe_support)");
    moe_require(score == MOE_SCORE_SOFTMAX || score == MOE_SCORE_SIGMOID, "moe_router_forward",
                "score must be MOE_SCORE_SOFTMAX or MOE_SCORE_SIGMOID");
    moe_require(balance_bias == nullptr || score == MOE_SCORE_SIGMOID, "moe_router_forward",
                "a balancing bias needs sigmoid scores");
    moe_require(group_limit == 0 || (groups >= 1 && E % groups == 0 && group_limit <= groups &&
                                     group_limit * (E / groups) >= k), "moe_router_forward",
                "a group limit M needs groups G dividing E, M <= G and M * E / G >= k");
    moe_require(group_limit == 0 || group_score == MOE_GROUP_MAX_KEY ||
                (group_score == MOE_GROUP_TOP2_SUM && score == MOE_SCORE_SIGMOID && E / groups >= 2),
                "moe_router_forward", "summing a group's two largest affinities needs sigmoid scores, E / G >= 2");
    const int grid = moe_warp_grid(N, block_size);
    if (E <= 32) {
        moe_router_forward_kernel<1><<<grid, block_size, 0, stream>>>(probs, expert_index, gates, logsumexp, logits,
                                                                      balance_bias, N, E, k, score, routed_scale,
                                                                      groups, group_limit, group_score);
    } else if (E <= 64) {
        moe_router_forward_kernel<2><<<grid, block_size, 0, stream>>>(probs, expert_index, gates, logsumexp, logits,
                                                                      balance_bias, N, E, k, score, routed_scale,
                                                                      groups, group_limit, group_score);
    } else if (E <= 128) {
        moe_router_forward_kernel<4><<<grid, block_size, 0, stream>>>(probs, expert_index, gates, logsumexp, logits,
                                                                      balance_bias, N, E, k, score, routed_scale,
                                                                      groups, group_limit, group_score);
    } else {
        moe_router_forward_kernel<8><<<grid, block_size, 0, stream>>>(probs, expert_index, gates, logsumexp, logits,
                                                                      balance_bias, N, E, k, score, routed_scale,
                                                                      groups, group_limit, group_score);
    }
    cudaCheck(cudaGetLastError());
}

// logits (N, E) -> probs (N, E) (sigmoid: the normalised affinities), expert_index (N, k) in descending order of
// the key, gates (N, k) (times routed_scale), logsumexp (N); balance_bias (E) or NULL (no bias: the key is the logit);
// group_limit M > 0: the picks among the M of the `groups` expert groups of the largest scores (group_score:
// MOE_GROUP_MAX_KEY or MOE_GROUP_TOP2_SUM), 0: among all E
void moe_router_forward(float* probs, int* expert_index, float* gates, float* logsumexp, const float* logits,
                        const float* balance_bias, int N, int E, int k, int score, float routed_scale, int groups,
                        int group_limit, int group_score, cudaStream_t stream) {
    moe_router_forward_launch(probs, expert_index, gates, logsumexp, logits, balance_bias, N, E, k, score,
                              routed_scale, groups, group_limit, group_score, MOE_WARP_KERNEL_BLOCK_SIZE, stream);
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
