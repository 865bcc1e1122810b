// llmc/moe_losses.cuh: the MoE router's losses, deterministic (fixed grids and reduction orders; the sequence-wise
// counts' shared-memory int atomics are exact in any order): the load-balancing (Switch) loss and the z-loss, and the
// sequence-wise balance loss with its gradient. The gradients of the first two are the router backward's
// (llmc/moe_router.cuh). Shapes: llmc/moe_common.cuh; semantics: doc/moe.md, "Routing options" 7 and the Switch losses.
// Lab: dev/cuda/moe_losses.cu, which holds the three losses and the sequence-wise loss's gradient to
// double-precision loops (e.g. `make build/lab/moe_losses_bf16 && build/lab/moe_losses_bf16 -s`).
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-moe_losses_{bf16,fp32} and their lab-check- twins;
// moe-*-seq-*, moe-* and check-moe-* (the aux, z and sequence-wise losses against PyTorch).
#pragma once
#include "moe_router.cuh"  // the scores the losses average (moe_sigmoid)

// Router losses, deterministic (fixed grid, fixed reduction order, no atomics):
//   aux = aux_alpha * E * sum_e f_e P_e = aux_alpha * E / (N*k*N) * sum_t sum_e expert_count[e] * probs[t, e]
//   z   = z_coef * mean_t logsumexp[t]^2
// First pass: a grid of G <= MOE_LOSSES_MAX_BLOCKS blocks (G from N*E alone, so the sums do not depend on the GPU)
// strides over probs in 16-byte vectors and over logsumexp; each block reduces its two sums and writes
// partials[b] (weighted probs) and partials[G + b] (squared lse). Second pass: one warp adds the partials, lane l
// taking b = l, l + 32, ... in order, then a warp reduction.
// Floor: read N*E*4 + N*4 + E*4 bytes (the partials, 8*G bytes, stay in L2). At N = 65536: 16.8 MB with E = 64
// (3.5 us at ~4.8 TB/s), 2.4 MB with E = 8 (0.5 us, below the two launches). One block streaming them (the lab's
// variant 1) reaches a single SM's bandwidth, a small fraction of the GPU's.
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
// host side

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
