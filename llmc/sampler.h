// llmc/sampler.h: host-side sampling for the trainers' text generation: a seedable xorshift* generator
// (the same numbers on every run and every rank for a given seed) and a draw from softmax(logits).
// Header-only: #include it from a .cu (built by nvcc or cpu/cucc). Tested by dev/test/test_host_utils.cu.
#pragma once
#include <math.h>
#include <stdint.h>

// xorshift64* (Vigna): 64-bit state, returns the high 32 bits of the scrambled state
static inline unsigned int random_u32_host(uint64_t* state) {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (unsigned int)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}

// uniform in [0, 1): 24 bits, so that the float is exact and never rounds up to 1
static inline float random_f32_host(uint64_t* state) {
    return (float)(random_u32_host(state) >> 8) / 16777216.0f;
}

// Index i drawn with probability softmax(logits[:n])[i], using coin in [0, 1) as the uniform variate.
// Subtracting the max keeps exp() finite; the cumulative walk is in double so that rounding cannot make
// the total fall short of coin * sum, and the last index catches whatever rounding is left.
static inline int sample_softmax(const float* logits, int n, float coin) {
    double max_logit = -INFINITY;
    for (int i = 0; i < n; i++) max_logit = fmax(max_logit, (double)logits[i]);
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += exp((double)logits[i] - max_logit);
    double target = (double)coin * sum;
    double cumulative = 0.0;
    for (int i = 0; i < n; i++) {
        cumulative += exp((double)logits[i] - max_logit);
        if (target < cumulative) return i;
    }
    return n - 1;
}
