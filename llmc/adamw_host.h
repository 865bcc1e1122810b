// llmc/adamw_host.h: the AdamW step of llmc/adamw.cuh on the host CPU, for ZeRO-Offload (`-oo 1`): the fp32
// master weights, m and v and an fp32 gradient shard live in (pinned) host memory, and the updated parameters are
// written in the working precision (floatX) into a host buffer that the trainer copies back to the device.
// Bit for bit what adamw_update with master weights computes from the same inputs, so that -oo 1 trains as -oo 0 does:
// the same IEEE fp32 operations in the same order (adamw_element), the same bias-correction reciprocals, the same
// stochastic rounding with the noise random_u32(seed, first_index + i) (i counted from the start of the call, as the
// kernel counts it), and subnormals flushed exactly when the device build flushes them (adamw_device_flushes_subnormals()).
// Gradients are fp32: the floatX gradient widened on the device (exact) before its copy, as ZeRO-Offload moves them.
// OpenMP threads over the parameters, each a vectorised (#pragma omp simd) loop. Floor: 28 + sizeof(floatX) bytes per
// parameter (grad, master, m, v read; master, m, v, param written), ~20 flops and, in bf16, a 32-bit hash.
// Plain host C++ that any .cu includes: with cpu/cucc (always -fopenmp) or nvcc, whose host compiler needs
// -Xcompiler -fopenmp (and -lgomp) for threads (without, the loop runs on one thread, with the same results). Build
// with -fno-math-errno, or the loop stays scalar (adamw_host_update below).
// Test: dev/test/test_adamw_host.cu; benchmark: dev/cuda/adamw_host.cu.
#pragma once
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "common.cuh"
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

// The device code never contracts a*b + c into an fma (adamw_element's __fmul_rn/__fadd_rn), so neither may this
// host code. GCC contracts with -ffp-contract=fast, the default of its GNU dialects, on a target with FMA instructions
// (-mfma, -march=haswell and later); its ISO dialects (-std=c++17, what cpu/cucc and the Makefile's nvcc pass) default
// to off. Clang contracts within an expression by default: switched off in the function below.
#if defined(__FMA__) && defined(__GNUC__) && !defined(__clang__) && !defined(__STRICT_ANSI__)
#error "llmc/adamw_host.h: GCC's GNU dialects with FMA contract a*b + c into fma: build with -std=c++17 or no -mfma"
#endif

// common.cuh's stochastic_rounding, restated for the host: bf16 keeps the upper 16 bits of the fp32 value and steps
// them one ulp away from zero iff the dropped 16 bits exceed the noise's low 16 bits (the device sets the dropped bits
// to all ones or all zeros and rounds to nearest: the same thing); a NaN becomes __float2bfloat16_rn's canonical NaN.
// fp16 rounds to nearest, fp32 keeps the value. Integer operations only, so the loop vectorises.
static inline floatX adamw_host_round(float value, unsigned int noise) {
#if defined(ENABLE_FP32)
    (void)noise;
    return value;
#elif defined(ENABLE_FP16)
    (void)noise;
    return __float2half_rn(value);
#else
    uint32_t bits;
    memcpy(&bits, &value, sizeof(bits));
    // signed comparisons of values below 2^31: SSE2 and AVX2 have no unsigned 32-bit compare
    const int32_t magnitude = (int32_t)(bits & 0x7fffffffu);
    const int32_t dropped = (int32_t)(bits & 0xffffu), threshold = (int32_t)(noise & 0xffffu);
    __nv_bfloat16_raw rounded;
    rounded.x = (unsigned short)(magnitude > 0x7f800000 ? 0x7fff : (int32_t)(bits >> 16) + (dropped > threshold));
    return rounded;
#endif
}

// The update of parameters [0, n), the loop shared out over the enclosing parallel region's threads. Inlined into
// each instruction-set variant below, so that one source gives both.
static inline __attribute__((always_inline)) void adamw_host_range(
    floatX* params, float* master_params, const float* grads, float* m, float* v, size_t num_parameters,
    float learning_rate, float beta1, float beta2, float beta1_correction_inverse, float beta2_correction_inverse,
    float eps, float weight_decay, float grad_scale, unsigned int seed, unsigned int first_noise_index,
    int flush_subnormals) {
#if defined(__SSE__)
    const unsigned int saved_csr = _mm_getcsr();
    if (flush_subnormals) _mm_setcsr(saved_csr | 0x8040u);  // FTZ (bit 15) and DAZ (bit 6)
#endif
    const float one_minus_beta1 = 1.0f - beta1, one_minus_beta2 = 1.0f - beta2;
    // 32-bit loop indices, which are the noise's indices too (the kernel's (unsigned int)i): a vector of them costs
    // half the instructions of 64-bit ones (15% of the loop's time here). Pieces of 2^30 parameters keep them in range.
    const size_t piece = (size_t)1 << 30;
    for (size_t base = 0; base < num_parameters; base += piece) {
        const unsigned int count = (unsigned int)(num_parameters - base < piece ? num_parameters - base : piece);
        const unsigned int first_index = first_noise_index + (unsigned int)base;  // the kernel's, modulo 2^32
#pragma omp for simd schedule(static)
        for (unsigned int j = 0; j < count; j++) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
            const size_t i = base + j;
            // adamw_element's operations, in its order
            const float grad = grad_scale * grads[i];
            const float param = master_params[i];
            const float new_m = beta1 * m[i] + one_minus_beta1 * grad;
            const float new_v = beta2 * v[i] + one_minus_beta2 * grad * grad;
            const float m_hat = new_m * beta1_correction_inverse;
            const float v_hat = new_v * beta2_correction_inverse;
            // (sqrtf): the C function itself, not cpu/cucc's fast-math macro of the name (exact outside kernels, but
            // a per-call test for device code that would keep the loop from vectorising)
            const float new_param = param - learning_rate * (m_hat / ((sqrtf)(v_hat) + eps) + weight_decay * param);
            m[i] = new_m;
            v[i] = new_v;
            master_params[i] = new_param;
            params[i] = adamw_host_round(new_param, random_u32(seed, first_index + j));
        }
    }
#if defined(__SSE__)
    _mm_setcsr(saved_csr);
#endif
}

// The loop compiled for the build's baseline (x86-64: SSE2, 4 floats a vector) and, on x86 with GCC or Clang, for AVX2
// (8 floats a vector, and 32-bit integer multiplies for the rounding noise), chosen at run time. Measured on this
// project's 2-core machine (dev/cuda/adamw_host.cu, bf16, 124M parameters, one thread): 8.1 GB/s with SSE2, 10.7 GB/s
// with AVX2, against 13.2 GB/s for a plain copy; in bf16 the rounding noise's hash (three 32-bit multiplies) makes the
// loop compute-bound on such a core (fp32, without it: 18.4 GB/s on 2 threads). Both variants give the same bits: the
// same IEEE operations (AVX2 brings no fma), under the same MXCSR.
void adamw_host_update_baseline(floatX* params, float* master_params, const float* grads, float* m, float* v, size_t n,
                                float learning_rate, float beta1, float beta2, float beta1_inverse, float beta2_inverse,
                                float eps, float weight_decay, float grad_scale, unsigned int seed,
                                int flush_subnormals, unsigned int first_index = 0) {
#pragma omp parallel
    adamw_host_range(params, master_params, grads, m, v, n, learning_rate, beta1, beta2, beta1_inverse, beta2_inverse,
                     eps, weight_decay, grad_scale, seed, first_index, flush_subnormals);
}
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ADAMW_HOST_AVX2 1
__attribute__((target("avx2"))) void adamw_host_update_avx2(floatX* params, float* master_params, const float* grads,
                                                             float* m, float* v, size_t n, float learning_rate,
                                                             float beta1, float beta2, float beta1_inverse,
                                                             float beta2_inverse, float eps, float weight_decay,
                                                             float grad_scale, unsigned int seed,
                                                             int flush_subnormals, unsigned int first_index = 0) {
#pragma omp parallel
    adamw_host_range(params, master_params, grads, m, v, n, learning_rate, beta1, beta2, beta1_inverse, beta2_inverse,
                     eps, weight_decay, grad_scale, seed, first_index, flush_subnormals);
}
#else
#define ADAMW_HOST_AVX2 0
#endif

// One AdamW step over n parameters, in place on master_params, m and v (fp32, n each), from grads (fp32, n); writes the
// new parameters rounded to floatX into params (n). The arguments are adamw_update's (beta1_correction = 1 - beta1^t,
// beta2_correction = 1 - beta2^t, computed by the caller once for both), plus flush_subnormals: 1 to flush subnormal
// inputs and results to zero as a -ftz=true device build does (the x86 FTZ and DAZ bits, set on the OpenMP threads
// for the update and restored after). Vectorising needs -fno-math-errno (GCC defines __NO_MATH_ERRNO__): with C's
// errno semantics GCC calls sqrtf through a branch and leaves the loop scalar (the same bits, 2.5x slower here).
void adamw_host_update(floatX* params, float* master_params, const float* grads, float* m, float* v,
                       size_t num_parameters, float learning_rate, float beta1, float beta2, float beta1_correction,
                       float beta2_correction, float eps, float weight_decay, float grad_scale, unsigned int seed,
                       int flush_subnormals, unsigned int first_index = 0) {
    if (num_parameters == 0) return;
    if (params == NULL || master_params == NULL || grads == NULL || m == NULL || v == NULL) {
        fprintf(stderr, "adamw_host_update: params, master_params, grads, m and v must all be given\n");
        exit(EXIT_FAILURE);
    }
#if !defined(__SSE__)
    if (flush_subnormals) {
        fprintf(stderr, "adamw_host_update: flushing subnormals (a -ftz=true device build) is implemented for x86 "
                        "hosts only\n");
        exit(EXIT_FAILURE);
    }
#endif
    // what adamw_update passes its kernel, computed as it does (host fp32 divisions)
    const float beta1_correction_inverse = 1.0f / beta1_correction;
    const float beta2_correction_inverse = 1.0f / beta2_correction;
#if ADAMW_HOST_AVX2
    if (__builtin_cpu_supports("avx2")) {
        adamw_host_update_avx2(params, master_params, grads, m, v, num_parameters, learning_rate, beta1, beta2,
                               beta1_correction_inverse, beta2_correction_inverse, eps, weight_decay, grad_scale, seed,
                               flush_subnormals, first_index);
        return;
    }
#endif
    adamw_host_update_baseline(params, master_params, grads, m, v, num_parameters, learning_rate, beta1, beta2,
                               beta1_correction_inverse, beta2_correction_inverse, eps, weight_decay, grad_scale, seed,
                               flush_subnormals, first_index);
}
