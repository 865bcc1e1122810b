// llmc/moe_balance.cuh: aux-loss-free balancing (doc/moe.md, "Routing options" 6): the step's expert loads and the
// balancing bias's update after each optimizer step, identical on every process that holds the same loads. The
// router adds the bias in its picks (llmc/moe_router.cuh).
// Lab: dev/cuda/moe_balance.cu, which holds the loads and the update to an exact integer host loop (e.g. `make
// build/lab/moe_balance_bf16 && build/lab/moe_balance_bf16 -s`).
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-moe_balance_{bf16,fp32} and their lab-check- twins;
// moe-*-bias-* and check-moe-*-bias-* (the biases after each step against PyTorch).
#pragma once
#include "moe_common.cuh"

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
