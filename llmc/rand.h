// llmc/rand.h: the Mersenne Twister (mt19937) exactly as PyTorch's CPU generator uses it, so that the C
// trainers initialise weights and shuffle data with the same numbers as torch.manual_seed(seed) gives the
// PyTorch reference (train_gpt.py): randint32 = torch's generator->random(), randfloat32 = torch.rand,
// normal_ = torch.Tensor.normal_ on a contiguous float tensor (Box-Muller in blocks of 16 for n >= 16,
// the double-precision path with the generator's cached second sample for n < 16; normal_chunked the same numbers in
// pieces, for tensors too large to draw at once).
// Header-only: #include it from a .cu (nvcc or cpu/cucc). Tested against torch 1.13 in dev/test/test_host_utils.cu.
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>

// The sanitized build (cpu/cucc --sanitize: GCC's ASan and UBSan) leaves the functions that draw and round a whole
// model's initialisation uninstrumented: a production-size run (dev/test/test_production_runs.sh, GPT-2 1.5B) draws
// 1.5e9 numbers, which instrumented take twice as long, and its checks are for the kernels' index arithmetic at real
// sizes; these index a chunk of at most a few million (the small sanitized runs and test_host_utils cover them).
#ifdef __SANITIZE_ADDRESS__
#define UNINSTRUMENTED __attribute__((no_sanitize("address", "undefined")))
#else
#define UNINSTRUMENTED
#endif

#define MT19937_N 624
#define MT19937_M 397

typedef struct {
    uint32_t state[MT19937_N];
    int left;  // outputs left before the next twist, as torch counts them
    int next;  // index of the next word to temper
    // torch's generator keeps the second Box-Muller sample of its double path for the next call
    int has_next_double_normal_sample;
    double next_double_normal_sample;
} mt19937_state;

static inline void manual_seed(mt19937_state* s, uint32_t seed) {
    s->state[0] = seed;
    for (uint32_t j = 1; j < MT19937_N; j++) {
        s->state[j] = 1812433253u * (s->state[j - 1] ^ (s->state[j - 1] >> 30)) + j;
    }
    s->left = 1;
    s->next = 0;
    s->has_next_double_normal_sample = 0;
    s->next_double_normal_sample = 0.0;
}

UNINSTRUMENTED static uint32_t mt19937_mix(uint32_t u, uint32_t v) {
    uint32_t y = (u & 0x80000000u) | (v & 0x7fffffffu);
    return (y >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

UNINSTRUMENTED static void mt19937_twist(mt19937_state* s) {
    uint32_t* st = s->state;
    for (int j = 0; j < MT19937_N - MT19937_M; j++) st[j] = st[j + MT19937_M] ^ mt19937_mix(st[j], st[j + 1]);
    for (int j = MT19937_N - MT19937_M; j < MT19937_N - 1; j++) {
        st[j] = st[j + MT19937_M - MT19937_N] ^ mt19937_mix(st[j], st[j + 1]);
    }
    st[MT19937_N - 1] = st[MT19937_M - 1] ^ mt19937_mix(st[MT19937_N - 1], st[0]);
    s->left = MT19937_N;
    s->next = 0;
}

static inline uint32_t randint32(mt19937_state* s) {
    if (--s->left <= 0) mt19937_twist(s);
    uint32_t y = s->state[s->next++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

// torch builds 64 random bits from two draws, the first one high
static inline uint64_t randint64(mt19937_state* s) {
    uint64_t high = randint32(s);
    uint64_t low = randint32(s);
    return (high << 32) | low;
}

// uniform in [0, 1) with 24 random bits (torch.rand for float32)
static inline float randfloat32(mt19937_state* s) {
    return (float)(randint32(s) & ((1u << 24) - 1)) * (1.0f / (float)(1u << 24));
}

// n consecutive randfloat32 draws into out, the very numbers of n calls: each stretch of the state between twists
// is tempered in one loop, without a call and a twist test per number (GPT-2 1.5B's initialisation draws 1.5e9, in
// the sanitized build too)
UNINSTRUMENTED static void randfloat32_fill(float* out, size_t n, mt19937_state* s) {
    size_t i = 0;
    while (i < n) {
        if (s->left <= 1) {  // randint32's twist: the draw after it takes state[0] and leaves left at N
            mt19937_twist(s);
            s->left++;
        }
        size_t k = (size_t)(s->left - 1) < n - i ? (size_t)(s->left - 1) : n - i;
        const uint32_t* st = s->state + s->next;
        for (size_t j = 0; j < k; j++) {
            uint32_t y = st[j];
            y ^= y >> 11;
            y ^= (y << 7) & 0x9d2c5680u;
            y ^= (y << 15) & 0xefc60000u;
            y ^= y >> 18;
            out[i + j] = (float)(y & ((1u << 24) - 1)) * (1.0f / (float)(1u << 24));
        }
        s->next += (int)k;
        s->left -= (int)k;
        i += k;
    }
}

// uniform in [0, 1) with 53 random bits (torch.rand for float64)
static inline double randfloat64(mt19937_state* s) {
    return (double)(randint64(s) & ((1ull << 53) - 1)) * (1.0 / (double)(1ull << 53));
}

// Box-Muller on 16 uniforms in place: pairs element j with element j + 8. The C library's functions themselves, in
// parentheses past any macro of a fast-math build (this is host code, whose results are torch's), and sincosf for
// the pair: glibc computes sinf, cosf and sincosf with one range reduction and the same polynomials, so it gives
// their bits (the same for each of the 2^24 angles a draw can make) at one reduction's cost.
UNINSTRUMENTED static void normal_fill_16(float* data, float mean, float std) {
    for (int j = 0; j < 8; j++) {
        float u1 = 1.0f - data[j];
        float u2 = data[j + 8];
        float radius = (sqrtf)(-2.0f * (logf)(u1));
        float theta = (float)(2.0 * M_PI * (double)u2);
        float sin_theta, cos_theta;
        (sincosf)(theta, &sin_theta, &cos_theta);
        data[j] = radius * cos_theta * std + mean;
        data[j + 8] = radius * sin_theta * std + mean;
    }
}

static inline void normal_(float* data, size_t n, float mean, float std, mt19937_state* s) {
    if (n >= 16) {
        randfloat32_fill(data, n, s);
        for (size_t i = 0; i + 16 <= n; i += 16) normal_fill_16(data + i, mean, std);
        if (n % 16 != 0) {
            // torch redraws the last 16 elements, overlapping the last full block
            float* tail = data + n - 16;
            randfloat32_fill(tail, 16, s);
            normal_fill_16(tail, mean, std);
        }
        return;
    }
    for (size_t i = 0; i < n; i++) {
        if (s->has_next_double_normal_sample) {
            data[i] = (float)(s->next_double_normal_sample * std + mean);
            s->has_next_double_normal_sample = 0;
            continue;
        }
        double u1 = randfloat64(s);
        double u2 = randfloat64(s);
        double radius = sqrt(-2.0 * log(1.0 - u2));
        double theta = 2.0 * M_PI * u1;
        s->next_double_normal_sample = radius * sin(theta);
        s->has_next_double_normal_sample = 1;
        data[i] = (float)(radius * cos(theta) * std + mean);
    }
}

// normal_ for n >= 16 without room for all n numbers: the same numbers, made in pieces of at most `chunk` (a multiple
// of 16) in `buf` and handed over in order as take(ctx, offset, values, count); for n not a multiple of 16, torch's
// redrawn last 16 come last, at offset n - 16, over 16 - n % 16 values already handed over. GPT-2 1.5B's largest
// tensor would take 2 GB of fp32 draws at once.
static inline void normal_chunked(size_t n, float mean, float std, mt19937_state* s, float* buf, size_t chunk,
                                  void (*take)(void* ctx, size_t offset, const float* values, size_t count), void* ctx) {
    size_t full = n / 16 * 16;
    for (size_t at = 0; at < full; at += chunk) {
        size_t k = full - at < chunk ? full - at : chunk;
        randfloat32_fill(buf, k, s);
        for (size_t i = 0; i < k; i += 16) normal_fill_16(buf + i, mean, std);
        take(ctx, at, buf, k);
    }
    if (n % 16 != 0) {
        randfloat32_fill(buf, n % 16, s);  // normal_'s draws for the partial last block, which it never uses
        randfloat32_fill(buf, 16, s);
        normal_fill_16(buf, mean, std);
        take(ctx, n - 16, buf, 16);
    }
}
