// llmc/moe_noise.cuh: the MoE router's training noise: router jitter (-rj EPS: the router reads its input times a
// per-element multiplier in U(1-EPS, 1+EPS)) and noisy top-k gating (-rn 1, Shazeer et al. 2017: the router's
// logits H = clean + N(0,1) * softplus(noise_logits), with the importance and load losses). The definition is the
// router-noise spec (doc/moe.md, "Router noise": seeds, generator, thr, the losses and their gradient); the rest of the MoE layer
// is doc/moe.md and llmc/moe_router.cuh. The noise is counter-based (squirrel_noise5 of a position
// and a per-pass seed), so the backward regenerates it instead of storing it, and C and PyTorch draw the same numbers.
// Included by the MoE trainer and by the kernel lab dev/cuda/moe_noise.cu (`make build/lab/moe_noise_bf16 && build/lab/moe_noise_bf16 -s`).
//
// Use per MoE layer m and training forward pass `pass` (the trainer's pass number, spec section 4):
//   forward   seed_j = moe_noise_seed(rank, pass, m, MOE_NOISE_JITTER), seed_n = ...(..., MOE_NOISE_GATING)
//             moe_jitter_forward(router_in, x)                  (training and EPS > 0; else the router reads x)
//             clean = router_in W_g^T, noise_logits = router_in W_noise^T        (the fp32 router GEMMs)
//             moe_noisy_logits_forward(H, clean, noise_logits, training)         (eval: H = clean)
//             moe_router_forward on H (probs, expert_index, gates, ...), slots, experts, combine as before
//             moe_noisy_losses_forward(importance, load, losses, ...)           (in eval too: they are reported)
//   backward  moe_combine_backward -> d_gates;  moe_importance_backward(d_gates += ...)
//             moe_router_backward(d_H from d_gates, aux, z);  moe_noisy_backward(d_clean, d_noise_logits from d_H)
//             router GEMM backwards from d_clean and d_noise_logits -> d_router_in (and dW_g, dW_noise from router_in)
//             moe_jitter_backward(dx += d_router_in * multiplier)       (with jitter; else d_router_in goes to dx)
//
// Shapes (N = B*T tokens of the group, C channels, E experts, k = top-k):
//   x, router_in, dx, d_router_in (N, C) floatX
//   clean, noise_logits, H, d_H, d_clean, d_noise_logits (N, E) fp32
//   expert_index (N, k) int, gates, d_gates (N, k) fp32 (as llmc/moe_common.cuh)
//   importance, load (E) fp32;  losses (2) fp32 = {L_imp, L_load} of this layer;  partials: scratch (see below)
// Sizes (moe_noise_support, on top of llmc/moe_common.cuh's moe_support): noisy gating needs k < E (thr is the (k+1)-th
// logit), E <= 256 (a warp holds a token's logits, 8 per lane at most), N*E < 2^31 and N*C < 2^32 (the noise
// positions are uint32), 0 <= EPS < 1 (a positive multiplier).
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-moe_noise_{bf16,fp32} and their lab-check- twins;
// moe-*noisy* and moe-*jitter* (the same noise as PyTorch).
#pragma once
#include <limits.h>
#include <math.h>
#include "common.cuh"
#include "moe_router.cuh"  // the router the noise feeds, and its size limits and refusals

#define MOE_NOISE_BLOCK_SIZE 256          // elementwise and warp-per-token kernels
#define MOE_NOISE_LOSSES_BLOCK_SIZE 512   // losses: 16 warps per block share one set of per-expert sums
#define MOE_NOISE_LOSSES_MAX_BLOCKS 256   // grid of the losses' first pass = the rows of the partials scratch

enum MoeNoiseKind { MOE_NOISE_JITTER = 0, MOE_NOISE_GATING = 1 };

// ----------------------------------------------------------------------------------------------------
// The generator (spec section 1). moe_uniform is exact in fp32: a 23-bit integer, doubled plus one, times 2^-24, so
// it lies in (0, 1) and log never sees 0.
__device__ __host__ inline float moe_uniform(unsigned int seed, unsigned int i) {
    return (float)((squirrel_noise5(i, seed) >> 9) * 2u + 1u) * (1.0f / 16777216.0f);
}

// Box-Muller, the cosine branch. log(u) is computed as log1pf(u - 1) (u - 1 is exact for u in (0, 1)): the same
// value as logf to an ulp or two, but --use_fast_math (the GPU build) turns logf into __logf, whose absolute error
// near 1 (2^-21.4) exceeds |log u| for u > 1 - 4e-7 (one draw in ~3 million) and could make -2 log u negative: a
// NaN. log1pf is not replaced by fast math (no lg2.approx in the PTX). cosf is the spec's (__cosf on the GPU:
// ~2^-21 absolute, ~4e-6 in n at the largest radius).
__device__ __host__ inline float moe_normal(unsigned int seed, unsigned int i) {
    const float u1 = moe_uniform(seed, 2u * i);
    const float u2 = moe_uniform(seed, 2u * i + 1u);
    return sqrtf(-2.0f * log1pf(u1 - 1.0f)) * cosf(6.283185307f * u2);
}

// PyTorch's softplus (beta 1, threshold 20), the noise's standard deviation. Every kernel computes it with this one
// expression, so the forward's and the backward's std agree to the bit.
__device__ __host__ inline float moe_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// (1 - EPS) + (2 EPS) * u with the spec's two roundings: __fmul_rn/__fadd_rn keep nvcc from contracting them into
// one fma, which would differ from the PyTorch reference's fp32 in the last bit and move a bf16 rounding now and then.
__device__ inline float moe_jitter_multiplier(unsigned int seed, unsigned int i, float one_minus_eps, float two_eps) {
    return __fadd_rn(one_minus_eps, __fmul_rn(two_eps, moe_uniform(seed, i)));
}

// Seed of one forward pass, MoE layer and kind (spec section 1): the rank enters through rank_base, so every
// data-parallel rank draws its own noise for its own tokens.
unsigned int moe_noise_seed(unsigned int rank, unsigned int pass, int moe_layer, int kind) {
    const unsigned int rank_base = squirrel_noise5(rank, 20261201u);
    return squirrel_noise5(pass * 512u + (unsigned int)moe_layer * 2u + (unsigned int)kind, rank_base);
}

// ----------------------------------------------------------------------------------------------------
// Jitter: one thread per 16-byte vector of the flattened (N, C); the position of element (t, c) is t*C + c.
// router_in = x * multiplier in fp32, rounded to floatX once. Floor: read N*C, write N*C floatX.
__global__ void moe_jitter_forward_kernel(floatX* __restrict__ router_in, const floatX* __restrict__ x, size_t n,
                                          unsigned int seed, float one_minus_eps, float two_eps) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    const x128 v = load128(x + i);  // not streaming: the experts read x again
    x128 out;
    for (int j = 0; j < x128::size; j++) {
        out[j] = (floatX)((float)v[j] * moe_jitter_multiplier(seed, (unsigned int)(i + j), one_minus_eps, two_eps));
    }
    store128(router_in + i, out);
}

// dx += d_router_in * multiplier (the multipliers regenerated), in fp32 from dx's current value (it already holds
// the experts' gradient), one rounding. Floor: read 2*N*C, write N*C floatX.
__global__ void moe_jitter_backward_kernel(floatX* __restrict__ dx, const floatX* __restrict__ d_router_in, size_t n,
                                           unsigned int seed, float one_minus_eps, float two_eps) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    const x128 current = load128(dx + i);
    const x128 d = load128cs(d_router_in + i);
    x128 out;
    for (int j = 0; j < x128::size; j++) {
        const float m = moe_jitter_multiplier(seed, (unsigned int)(i + j), one_minus_eps, two_eps);
        out[j] = (floatX)((float)current[j] + (float)d[j] * m);
    }
    store128(dx + i, out);
}

// ----------------------------------------------------------------------------------------------------
// Noisy logits (training): H = clean + n * softplus(noise_logits), n = moe_normal(seed, t*E + e); one thread per 4
// consecutive elements of the flattened (N, E), 16-byte loads, a scalar tail when N*E is not a multiple of 4.
// Floor: read 2*N*E*4, write N*E*4 bytes (~100 flops per element: about balanced with the memory on an H100).
__global__ void moe_noisy_logits_kernel(float* __restrict__ H, const float* __restrict__ clean,
                                        const float* __restrict__ noise_logits, size_t n, unsigned int seed) {
    // size_t: the last block's threads pass n by up to 4 * blockDim.x, which in int could wrap past 2^31
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * f128::size;
    if (i >= n) return;
    if (i + f128::size <= n) {
        const f128 c = load128(clean + i);  // not streaming: the losses and the backward read them again
        const f128 z = load128(noise_logits + i);
        f128 h;
        for (int j = 0; j < f128::size; j++) h[j] = c[j] + moe_normal(seed, (unsigned int)(i + j)) * moe_softplus(z[j]);
        store128(H + i, h);
    } else {
        for (size_t j = i; j < n; j++) H[j] = clean[j] + moe_normal(seed, (unsigned int)j) * moe_softplus(noise_logits[j]);
    }
}

// ----------------------------------------------------------------------------------------------------
// A token's routing order as thr needs it (spec section 3): which of this lane's experts are among the k picks
// (bit i: expert lane + 32*i) and the experts at positions k and k+1 of the order (H descending, ties to the lower
// index) with their values. Position k is the last pick, expert_index[t, k-1]; position k+1 is the best expert not
// picked, a warp argmax over (value, index) pairs as the router's picks are found, so every lane gets the same one.
struct MoeThresholds {
    unsigned int chosen;
    int kth, next;  // the experts at positions k and k+1
    float kth_value, next_value;
};

template <int LOGITS_PER_LANE>
__device__ inline MoeThresholds moe_thresholds(const float* h, const float* H_row, const int* picks, int E, int k) {
    const int lane = threadIdx.x % 32;
    MoeThresholds r;
    r.chosen = 0;
    for (int j = 0; j < k; j++) {
        const int p = picks[j];
        if (p % 32 == lane) r.chosen |= 1u << (p / 32);
    }
    r.kth = picks[k - 1];
    r.kth_value = H_row[r.kth];
    // increasing i is increasing expert index, so '>' keeps the lower one on ties
    float best = -INFINITY;
    int best_expert = INT_MAX;  // INT_MAX: no candidate on this lane
    for (int i = 0; i < LOGITS_PER_LANE; i++) {
        const int e = lane + 32 * i;
        if (e < E && !((r.chosen >> i) & 1u) && (best_expert == INT_MAX || h[i] > best)) {
            best = h[i];
            best_expert = e;
        }
    }
    moe_warp_argmax(&best, &best_expert);
    r.next = best_expert;  // k < E: some expert is not picked
    r.next_value = best;
    return r;
}

// mean and CV2 = (sum_e (v_e - mean)^2 / E) / mean^2 of v (E values), by one whole warp (every lane gets them).
// Two passes (the deviations, not sum v^2 - mean^2): a balanced load has a CV2 far below 1, which the one-pass form
// would lose to cancellation. Every kernel computes them this way, in the same order, so the backward's values are
// the forward's.
__device__ inline void moe_cv2_warp(float* mean, float* cv2, const float* v, int E) {
    const int lane = threadIdx.x % 32;
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32) sum += v[e];
    const float m = warp_reduce_sum(sum) / (float)E;
    float squares = 0.0f;
    for (int e = lane; e < E; e += 32) {
        const float d = v[e] - m;
        squares += d * d;
    }
    *mean = m;
    *cv2 = warp_reduce_sum(squares) / (float)E / (m * m);
}

// dCV2/dv_e = 2 / (E mean^2) * (v_e - mean - CV2 * mean)   (the mean's own derivative included)
__device__ inline float moe_cv2_grad(float v_e, float mean, float cv2, int E) {
    return 2.0f / ((float)E * mean * mean) * (v_e - mean - cv2 * mean);
}

// ----------------------------------------------------------------------------------------------------
// Losses, first pass: a grid of at most MOE_NOISE_LOSSES_MAX_BLOCKS blocks, warp w of the grid takes tokens
// w, w + (warps in the grid), ... (in that order); its lanes own experts lane, lane + 32, ... as in the router and
// add, per expert, Importance (the gates of the choices that picked it) and Load (P[t, e] = Phi((clean - thr) / std)).
// The warps' sums meet in shared memory and are added in warp order; partials[b, e] (importance) and
// partials[G + b, e] (load) are block b's. No atomics: the result depends only on N and the launch's block size.
// Floor: read 3*N*E*4 + N*k*8 bytes, write 2*G*E*4 (G = the grid's blocks).
template <int LOGITS_PER_LANE>
__global__ void moe_noisy_losses_partials_kernel(float* __restrict__ partials, const float* __restrict__ clean,
                                                 const float* __restrict__ noise_logits, const float* __restrict__ H,
                                                 const int* __restrict__ expert_index, const float* __restrict__ gates,
                                                 int N, int E, int k) {
    extern __shared__ float warp_sums[];  // (2, warps of the block, E): importance, then load
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int num_warps = blockDim.x / 32;
    const int grid_warps = gridDim.x * num_warps;
    float importance[LOGITS_PER_LANE], load[LOGITS_PER_LANE];
    for (int i = 0; i < LOGITS_PER_LANE; i++) importance[i] = load[i] = 0.0f;

    for (int t = blockIdx.x * num_warps + warp; t < N; t += grid_warps) {  // the same trip count for the whole warp
        const float* H_row = H + (size_t)t * E;
        const int* picks = expert_index + (size_t)t * k;
        float h[LOGITS_PER_LANE];
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            const int e = lane + 32 * i;
            h[i] = e < E ? H_row[e] : -INFINITY;
        }
        const MoeThresholds th = moe_thresholds<LOGITS_PER_LANE>(h, H_row, picks, E, k);
        for (int i = 0; i < LOGITS_PER_LANE; i++) {
            const int e = lane + 32 * i;
            if (e >= E) continue;
            const float thr = (th.chosen >> i) & 1u ? th.next_value : th.kth_value;
            const float u = (clean[(size_t)t * E + e] - thr) / moe_softplus(noise_logits[(size_t)t * E + e]);
            load[i] += 0.5f * erfcf(-u * 0.70710678118654752f);
        }
        for (int j = 0; j < k; j++) {
            const int p = picks[j];
            const float g = gates[(size_t)t * k + j];
            for (int i = 0; i < LOGITS_PER_LANE; i++) {
                if (lane + 32 * i == p) importance[i] += g;
            }
        }
    }
    for (int i = 0; i < LOGITS_PER_LANE; i++) {
        const int e = lane + 32 * i;
        if (e < E) {
            warp_sums[(size_t)warp * E + e] = importance[i];
            warp_sums[(size_t)(num_warps + warp) * E + e] = load[i];
        }
    }
    __syncthreads();
    for (int x = threadIdx.x; x < 2 * E; x += blockDim.x) {
        const int which = x / E, e = x % E;  // which 0: importance, 1: load
        float sum = 0.0f;
        for (int w = 0; w < num_warps; w++) sum += warp_sums[(size_t)(which * num_warps + w) * E + e];
        partials[(size_t)(which * gridDim.x + blockIdx.x) * E + e] = sum;
    }
}

// Losses, second pass: one block of 32*ceil(E/32) threads, thread e adds expert e's partials in block order and
// writes importance[e] and load[e]; then warp 0 takes mean and CV2 of both (moe_cv2_warp, as the backward will).
// losses[0] = w_imp * CV2(importance), losses[1] = w_load * CV2(load).
// Floor: read 2*G*E*4, write 2*E*4 + 8 bytes.
__global__ void moe_noisy_losses_final_kernel(float* __restrict__ importance, float* __restrict__ load,
                                              float* __restrict__ losses, const float* __restrict__ partials,
                                              int num_blocks, int E, float w_imp, float w_load) {
    const int e = threadIdx.x;
    if (e < E) {
        float imp = 0.0f, ld = 0.0f;
        for (int b = 0; b < num_blocks; b++) {
            imp += partials[(size_t)b * E + e];
            ld += partials[(size_t)(num_blocks + b) * E + e];
        }
        importance[e] = imp;
        load[e] = ld;
    }
    __syncthreads();  // the block's global writes are visible to warp 0 after the barrier
    if (threadIdx.x >= 32) return;
    float imp_mean, imp_cv2, load_mean, load_cv2;
    moe_cv2_warp(&imp_mean, &imp_cv2, importance, E);
    moe_cv2_warp(&load_mean, &load_cv2, load, E);
    if (threadIdx.x == 0) {
        losses[0] = w_imp * imp_cv2;
        losses[1] = w_load * load_cv2;
    }
}

// ----------------------------------------------------------------------------------------------------
// Importance backward: d_gates[t, j] += imp_scale * dCV2/dImportance_e for e = expert_index[t, j], imp_scale =
// loss_scale * w_imp; all k choices, dropped ones included (Importance is defined before dropping). One thread per
// choice; every warp takes mean and CV2 of the E importances itself (E loads from cache) before any lane leaves.
// Floor: read N*k*8 + E*4, write N*k*4 bytes.
__global__ void moe_importance_backward_kernel(float* __restrict__ d_gates, const float* __restrict__ importance,
                                               const int* __restrict__ expert_index, int num_choices, int E,
                                               float imp_scale) {
    float mean, cv2;
    moe_cv2_warp(&mean, &cv2, importance, E);
    const int choice = blockIdx.x * blockDim.x + threadIdx.x;
    if (choice >= num_choices) return;
    const int e = expert_index[choice];
    d_gates[choice] += imp_scale * moe_cv2_grad(importance[e], mean, cv2, E);
}

// Noisy backward: one warp per token, lanes own experts as in the router. With std = softplus(noise_logits),
// u = (clean - thr) / std, phi = the normal density, g_e = load_scale * dCV2/dLoad_e (load_scale = loss_scale *
// w_load) and a_e = g_e * phi(u_e) / std_e (the load loss's derivative in clean[t, e]):
//   dH_e       = d_H[t, e] - (e == position k   ? sum of a_i over the experts i not picked : 0)
//                          - (e == position k+1 ? sum of a_i over the k picks             : 0)     (thr's gradient)
//   d_clean_e  = dH_e + a_e                                         (H = clean + n*std, and P's direct dependence)
//   d_std_e    = n_e * dH_e - a_e * u_e                             (n regenerated from the seed)
//   d_noise_logits_e = d_std_e * (noise_logits > 20 ? 1 : sigmoid)  (softplus' derivative as PyTorch takes it)
// a_e and a_e * u_e are taken as 0 where phi underflows to 0: there std may be 0 (flush-to-zero of softplus(x <
// -87)) or u infinite, and 0/0 or 0 * inf would be a NaN where the true gradient is 0.
// d_clean may be d_H (in place): every element is read and written by the same lane, reads first.
// Floor: read 4*N*E*4 + N*k*4 + E*4, write 2*N*E*4 bytes.
template <int LOGITS_PER_LANE>
__global__ void moe_noisy_backward_kernel(float* d_clean, float* __restrict__ d_noise_logits, const float* d_H,
                                          const float* __restrict__ clean, const float* __restrict__ noise_logits,
                                          const float* __restrict__ H, const int* __restrict__ expert_index,
                                          const float* __restrict__ load, int N, int E, int k, float load_scale,
                                          unsigned int seed) {
    const int token = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (token >= N) return;  // the whole warp leaves together
    const int lane = threadIdx.x % 32;
    float mean, cv2;
    moe_cv2_warp(&mean, &cv2, load, E);
    const size_t row = (size_t)token * E;
    const int* picks = expert_index + (size_t)token * k;

    float h[LOGITS_PER_LANE], a[LOGITS_PER_LANE], au[LOGITS_PER_LANE];
    for (int i = 0; i < LOGITS_PER_LANE; i++) {
        const int e = lane + 32 * i;
        h[i] = e < E ? H[row + e] : -INFINITY;
    }
    const MoeThresholds th = moe_thresholds<LOGITS_PER_LANE>(h, H + row, picks, E, k);
    float picked_sum = 0.0f, rest_sum = 0.0f;
    for (int i = 0; i < LOGITS_PER_LANE; i++) {
        const int e = lane + 32 * i;
        a[i] = au[i] = 0.0f;
        if (e >= E) continue;
        const bool picked = (th.chosen >> i) & 1u;
        const float thr = picked ? th.next_value : th.kth_value;
        const float std = moe_softplus(noise_logits[row + e]);
        const float u = (clean[row + e] - thr) / std;
        const float phi = 0.39894228040143268f * expf(-0.5f * u * u);
        if (phi > 0.0f) {  // else a = 0, and a * u must not become 0 * inf
            a[i] = load_scale * moe_cv2_grad(load[e], mean, cv2, E) * phi / std;
            au[i] = a[i] * u;
        }
        if (picked) picked_sum += a[i];
        else rest_sum += a[i];
    }
    picked_sum = warp_reduce_sum(picked_sum);
    rest_sum = warp_reduce_sum(rest_sum);
    for (int i = 0; i < LOGITS_PER_LANE; i++) {
        const int e = lane + 32 * i;
        if (e >= E) continue;
        float dh = d_H[row + e];
        if (e == th.kth) dh -= rest_sum;
        if (e == th.next) dh -= picked_sum;
        const float z = noise_logits[row + e];
        const float ez = expf(z);
        const float sigmoid = z > 20.0f ? 1.0f : ez / (1.0f + ez);
        const float n = moe_normal(seed, (unsigned int)(row + e));
        d_clean[row + e] = dh + a[i];
        d_noise_logits[row + e] = (n * dh - au[i]) * sigmoid;
    }
}

// ----------------------------------------------------------------------------------------------------
// host side

// The sizes these kernels support beyond moe_support (llmc/moe_common.cuh); false with a one-line reason otherwise.
// Called by the trainer at start-up with its group size N = B*T.
bool moe_noise_support(int N, int C, int E, int k, bool noisy_gating, float jitter_eps, char* why, size_t why_size) {
    if (!(jitter_eps >= 0.0f && jitter_eps < 1.0f)) {
        snprintf(why, why_size, "router jitter EPS = %g: needs 0 <= EPS < 1 (the multiplier U(1-EPS, 1+EPS) must be "
                 "positive)", jitter_eps);
        return false;
    }
    if (jitter_eps > 0.0f && (C <= 0 || C % 8 != 0 || (unsigned long long)N * C >= (1ull << 32))) {
        snprintf(why, why_size, "router jitter with N = %d, C = %d: needs C a positive multiple of 8 and N*C < 2^32 "
                 "(the noise positions t*C + c are uint32)", N, C);
        return false;
    }
    if (!noisy_gating) return true;
    if (E < 2 || E > MOE_MAX_EXPERTS || k < 1 || k >= E || k > MOE_MAX_TOP_K) {
        snprintf(why, why_size, "noisy top-k gating with E = %d, top-k = %d: needs 1 <= k < E <= %d and k <= %d "
                 "(the load loss's threshold is the (k+1)-th logit)", E, k, MOE_MAX_EXPERTS, MOE_MAX_TOP_K);
        return false;
    }
    if ((unsigned long long)N * E >= (1ull << 31)) {
        snprintf(why, why_size, "noisy top-k gating with N = %d, E = %d: needs N*E < 2^31 (the noise positions)", N, E);
        return false;
    }
    return true;
}

// N*E < 2^31 (moe_noise_support) also bounds the choices N*k < N*E, which the importance backward counts in int
static void moe_noise_require_router(const char* function, int N, int E, int k, int block_size) {
    moe_require(N >= 1 && E >= 2 && E <= MOE_MAX_EXPERTS && k >= 1 && k < E && k <= MOE_MAX_TOP_K,
                      function, "needs N >= 1 and 1 <= k < E <= 256, k <= 32 (noisy gating: see moe_noise_support)");
    moe_require((size_t)N * E < (1ull << 31), function, "needs N*E < 2^31 (the noise positions; see moe_noise_support)");
    moe_require(block_size >= 32 && block_size <= 1024 && block_size % 32 == 0, function,
                      "block size must be a multiple of 32, at most 1024");
}

void moe_jitter_forward_launch(floatX* router_in, const floatX* x, int N, int C, float eps, unsigned int seed,
                               int block_size, cudaStream_t stream) {
    moe_require(N >= 1 && C > 0 && C % 8 == 0, "moe_jitter_forward",
                      "needs N >= 1 and C a positive multiple of 8");
    moe_require_aligned("moe_jitter_forward", router_in, x, nullptr);
    const size_t n = (size_t)N * C;
    const int grid = (int)CEIL_DIV(n / x128::size, (size_t)block_size);
    moe_jitter_forward_kernel<<<grid, block_size, 0, stream>>>(router_in, x, n, seed, 1.0f - eps, 2.0f * eps);
    cudaCheck(cudaGetLastError());
}

// router_in (N, C) = x (N, C) * multiplier, multiplier[t, c] = (1 - eps) + 2 eps * moe_uniform(seed, t*C + c);
// training passes with eps > 0 only (otherwise the router reads x itself)
void moe_jitter_forward(floatX* router_in, const floatX* x, int N, int C, float eps, unsigned int seed,
                        cudaStream_t stream) {
    moe_jitter_forward_launch(router_in, x, N, C, eps, seed, MOE_NOISE_BLOCK_SIZE, stream);
}

void moe_jitter_backward_launch(floatX* dx, const floatX* d_router_in, int N, int C, float eps, unsigned int seed,
                                int block_size, cudaStream_t stream) {
    moe_require(N >= 1 && C > 0 && C % 8 == 0, "moe_jitter_backward",
                      "needs N >= 1 and C a positive multiple of 8");
    moe_require_aligned("moe_jitter_backward", dx, d_router_in, nullptr);
    const size_t n = (size_t)N * C;
    const int grid = (int)CEIL_DIV(n / x128::size, (size_t)block_size);
    moe_jitter_backward_kernel<<<grid, block_size, 0, stream>>>(dx, d_router_in, n, seed, 1.0f - eps, 2.0f * eps);
    cudaCheck(cudaGetLastError());
}

// dx (N, C) += d_router_in (N, C) * multiplier (the forward's, regenerated from the same seed and eps)
void moe_jitter_backward(floatX* dx, const floatX* d_router_in, int N, int C, float eps, unsigned int seed,
                         cudaStream_t stream) {
    moe_jitter_backward_launch(dx, d_router_in, N, C, eps, seed, MOE_NOISE_BLOCK_SIZE, stream);
}

void moe_noisy_logits_forward_launch(float* H, const float* clean, const float* noise_logits, int N, int E,
                                     unsigned int seed, bool training, int block_size, cudaStream_t stream) {
    const size_t n = (size_t)N * E;
    moe_require(N >= 1 && E >= 1 && n < (1ull << 31), "moe_noisy_logits_forward", "needs N, E >= 1, N*E < 2^31");
    if (!training) {
        if (H != clean) cudaCheck(cudaMemcpyAsync(H, clean, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
        return;
    }
    moe_require_aligned("moe_noisy_logits_forward", H, clean, noise_logits);
    const int grid = (int)CEIL_DIV(CEIL_DIV(n, (size_t)f128::size), (size_t)block_size);
    moe_noisy_logits_kernel<<<grid, block_size, 0, stream>>>(H, clean, noise_logits, n, seed);
    cudaCheck(cudaGetLastError());
}

// H (N, E) = clean + moe_normal(seed, t*E + e) * softplus(noise_logits) in training; H = clean in evaluation
// (a copy, none when H is clean). All fp32.
void moe_noisy_logits_forward(float* H, const float* clean, const float* noise_logits, int N, int E,
                              unsigned int seed, bool training, cudaStream_t stream) {
    moe_noisy_logits_forward_launch(H, clean, noise_logits, N, E, seed, training, MOE_NOISE_BLOCK_SIZE, stream);
}

// floats of scratch moe_noisy_losses_forward needs for its partial sums (two rows of E per block of its first pass)
size_t moe_noisy_losses_partials_size(int E) { return (size_t)2 * MOE_NOISE_LOSSES_MAX_BLOCKS * E; }

void moe_noisy_losses_forward_launch(float* importance, float* load, float* losses, float* partials,
                                     const float* clean, const float* noise_logits, const float* H,
                                     const int* expert_index, const float* gates, int N, int E, int k, float w_imp,
                                     float w_load, int block_size, cudaStream_t stream) {
    moe_noise_require_router("moe_noisy_losses_forward", N, E, k, block_size);
    const int num_warps = block_size / 32;
    const int blocks = CEIL_DIV(N, num_warps) < MOE_NOISE_LOSSES_MAX_BLOCKS ? CEIL_DIV(N, num_warps)
                                                                             : MOE_NOISE_LOSSES_MAX_BLOCKS;
    const size_t shared = (size_t)2 * num_warps * E * sizeof(float);
    moe_require(shared <= 48 * 1024, "moe_noisy_losses_forward",
                      "block size * E too large: the per-warp sums must fit 48 KiB of shared memory");
    if (E <= 32) {
        moe_noisy_losses_partials_kernel<1><<<blocks, block_size, shared, stream>>>(partials, clean, noise_logits, H,
                                                                                    expert_index, gates, N, E, k);
    } else if (E <= 64) {
        moe_noisy_losses_partials_kernel<2><<<blocks, block_size, shared, stream>>>(partials, clean, noise_logits, H,
                                                                                    expert_index, gates, N, E, k);
    } else if (E <= 128) {
        moe_noisy_losses_partials_kernel<4><<<blocks, block_size, shared, stream>>>(partials, clean, noise_logits, H,
                                                                                    expert_index, gates, N, E, k);
    } else {
        moe_noisy_losses_partials_kernel<8><<<blocks, block_size, shared, stream>>>(partials, clean, noise_logits, H,
                                                                                    expert_index, gates, N, E, k);
    }
    cudaCheck(cudaGetLastError());
    moe_noisy_losses_final_kernel<<<1, 32 * CEIL_DIV(E, 32), 0, stream>>>(importance, load, losses, partials, blocks, E,
                                                                          w_imp, w_load);
    cudaCheck(cudaGetLastError());
}

// importance (E) = sum of the gates (N, k) of the choices of e, load (E) = sum_t Phi((clean - thr) / softplus(
// noise_logits)), losses[0] = w_imp * CV2(importance), losses[1] = w_load * CV2(load) (device, fp32); thr from H
// and expert_index (k < E). partials: moe_noisy_losses_partials_size(E) floats of scratch. In evaluation too (H =
// clean); deterministic.
void moe_noisy_losses_forward(float* importance, float* load, float* losses, float* partials, const float* clean,
                              const float* noise_logits, const float* H, const int* expert_index, const float* gates,
                              int N, int E, int k, float w_imp, float w_load, cudaStream_t stream) {
    moe_noisy_losses_forward_launch(importance, load, losses, partials, clean, noise_logits, H, expert_index, gates, N,
                                    E, k, w_imp, w_load, MOE_NOISE_LOSSES_BLOCK_SIZE, stream);
}

void moe_importance_backward_launch(float* d_gates, const float* importance, const int* expert_index, int N, int E,
                                    int k, float w_imp, float loss_scale, int block_size, cudaStream_t stream) {
    moe_noise_require_router("moe_importance_backward", N, E, k, block_size);
    const int num_choices = N * k;
    moe_importance_backward_kernel<<<CEIL_DIV(num_choices, block_size), block_size, 0, stream>>>(
        d_gates, importance, expert_index, num_choices, E, loss_scale * w_imp);
    cudaCheck(cudaGetLastError());
}

// d_gates (N, k) += loss_scale * w_imp * dCV2/dImportance[expert_index[t, j]]; before moe_router_backward
void moe_importance_backward(float* d_gates, const float* importance, const int* expert_index, int N, int E, int k,
                             float w_imp, float loss_scale, cudaStream_t stream) {
    moe_importance_backward_launch(d_gates, importance, expert_index, N, E, k, w_imp, loss_scale,
                                   MOE_NOISE_BLOCK_SIZE, stream);
}

void moe_noisy_backward_launch(float* d_clean, float* d_noise_logits, const float* d_H, const float* clean,
                               const float* noise_logits, const float* H, const int* expert_index, const float* load,
                               int N, int E, int k, float w_load, float loss_scale, unsigned int seed, int block_size,
                               cudaStream_t stream) {
    moe_noise_require_router("moe_noisy_backward", N, E, k, block_size);
    const int grid = CEIL_DIV(N, block_size / 32);
    const float load_scale = loss_scale * w_load;
    if (E <= 32) {
        moe_noisy_backward_kernel<1><<<grid, block_size, 0, stream>>>(d_clean, d_noise_logits, d_H, clean, noise_logits,
                                                                      H, expert_index, load, N, E, k, load_scale, seed);
    } else if (E <= 64) {
        moe_noisy_backward_kernel<2><<<grid, block_size, 0, stream>>>(d_clean, d_noise_logits, d_H, clean, noise_logits,
                                                                      H, expert_index, load, N, E, k, load_scale, seed);
    } else if (E <= 128) {
        moe_noisy_backward_kernel<4><<<grid, block_size, 0, stream>>>(d_clean, d_noise_logits, d_H, clean, noise_logits,
                                                                      H, expert_index, load, N, E, k, load_scale, seed);
    } else {
        moe_noisy_backward_kernel<8><<<grid, block_size, 0, stream>>>(d_clean, d_noise_logits, d_H, clean, noise_logits,
                                                                      H, expert_index, load, N, E, k, load_scale, seed);
    }
    cudaCheck(cudaGetLastError());
}

// d_clean, d_noise_logits (N, E) from d_H (N, E) (moe_router_backward's d_logits: gates, aux, z-loss) plus the load
// loss's gradient (loss_scale * w_load * dCV2/dLoad, through clean, std and thr), through H = clean + n * std with
// n regenerated from the training pass's seed. load (E) is moe_noisy_losses_forward's. d_clean may be d_H.
void moe_noisy_backward(float* d_clean, float* d_noise_logits, const float* d_H, const float* clean,
                        const float* noise_logits, const float* H, const int* expert_index, const float* load, int N,
                        int E, int k, float w_load, float loss_scale, unsigned int seed, cudaStream_t stream) {
    moe_noisy_backward_launch(d_clean, d_noise_logits, d_H, clean, noise_logits, H, expert_index, load, N, E, k,
                              w_load, loss_scale, seed, MOE_NOISE_BLOCK_SIZE, stream);
}
