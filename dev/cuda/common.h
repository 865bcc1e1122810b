// dev/cuda/common.h: what every kernel-lab file in dev/cuda/ shares: argument parsing, random inputs,
// copies to the device, validation against the CPU reference, and timing with the achieved bandwidth
// or throughput against the floor of the detected GPU.
//
// Convention of a lab file `dev/cuda/<kernel>.cu` (built by `make -C dev/cuda` for the GPU, or through the
// CPU backend by the top-level `make test`):
//   ./<kernel>            validate and time every variant at GPT-2 124M sizes
//   ./<kernel> N          only variant N
//   ./<kernel> [N] -s     small sizes (what `make test` runs on the CPU backend)
// Validation failure prints the first mismatches and exits non-zero. Timing rows:
//   variant, block size, time per call, GB/s (or TFLOP/s), % of the floor computed from bytes and flops.
#pragma once
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include "../../llmc/common.cuh"
#include "../../llmc/mfu.h"

struct LabArgs {
    int variant;  // 0 = all variants
    int small;    // 1: small sizes for the CPU backend
};

static LabArgs lab_parse_args(int argc, char** argv) {
    LabArgs a = {0, 0};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-s") == 0) a.small = 1;
        else if (argv[i][0] >= '0' && argv[i][0] <= '9') a.variant = atoi(argv[i]);
        else {
            fprintf(stderr, "usage: %s [variant] [-s]  (unknown argument '%s')\n", argv[0], argv[i]);
            exit(EXIT_FAILURE);
        }
    }
    return a;
}

// ----------------------------------------------------------------------------------------------------
// inputs
static uint64_t lab_rng_state = 0x853c49e6748fea9bull;
static float lab_rand_uniform(float lo, float hi) {
    lab_rng_state ^= lab_rng_state >> 12;
    lab_rng_state ^= lab_rng_state << 25;
    lab_rng_state ^= lab_rng_state >> 27;
    uint32_t r = (uint32_t)((lab_rng_state * 0x2545F4914F6CDD1Dull) >> 40);
    return lo + (hi - lo) * (float)r / 16777216.0f;
}
static std::vector<float> lab_random(size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = lab_rand_uniform(lo, hi);
    return v;
}
static std::vector<int> lab_random_ints(size_t n, int below) {
    std::vector<int> v(n);
    for (auto& x : v) x = (int)(lab_rand_uniform(0.0f, 1.0f) * below) % below;
    return v;
}

// the values as floatX holds them, so that a CPU reference sees exactly the inputs the device sees
static std::vector<float> lab_rounded(std::vector<float> values) {
    for (float& v : values) v = (float)(floatX)v;
    return values;
}
static std::vector<float> lab_random_rounded(size_t n, float lo, float hi) { return lab_rounded(lab_random(n, lo, hi)); }
// int results as floats, for lab_validate's float reference (exact below 2^24)
static std::vector<float> lab_as_floats(const std::vector<int>& values) { return std::vector<float>(values.begin(), values.end()); }

// device copy of host floats converted to T
template <class T>
static T* lab_to_device(const std::vector<float>& h) {
    std::vector<T> t(h.size());
    for (size_t i = 0; i < h.size(); i++) t[i] = (T)h[i];
    T* d;
    cudaCheck(cudaMalloc(&d, t.size() * sizeof(T) + 16));
    cudaCheck(cudaMemcpy(d, t.data(), t.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
static int* lab_ints_to_device(const std::vector<int>& h) {
    int* d;
    cudaCheck(cudaMalloc(&d, h.size() * sizeof(int)));
    cudaCheck(cudaMemcpy(d, h.data(), h.size() * sizeof(int), cudaMemcpyHostToDevice));
    return d;
}
// device buffer of n elements filled with NaN bytes, so an element a kernel forgets to write fails validation
template <class T>
static T* lab_poisoned(size_t n) {
    T* d;
    cudaCheck(cudaMalloc(&d, n * sizeof(T) + 16));
    cudaCheck(cudaMemset(d, 0xff, n * sizeof(T)));
    return d;
}

// ----------------------------------------------------------------------------------------------------
// references: GELU in the tanh approximation (what llmc/gelu.cuh and cuBLASLt's GELU epilogues compute) and
// its derivative, in double, for every lab that applies it
static double gelu_reference(double x) {
    return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}
static double gelu_grad_reference(double x) {
    const double s = sqrt(2.0 / M_PI);
    const double t = tanh(s * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * s * (1.0 + 3.0 * 0.044715 * x * x);
}

// ----------------------------------------------------------------------------------------------------
// validation: |got - want| <= atol + rtol * |want| for every element; prints the first mismatches and
// exits non-zero on failure (a lab run must fail loudly).
template <class T>
static void lab_validate(const char* name, const T* device_result, const float* reference, size_t n, float atol,
                         float rtol) {
    std::vector<T> got(n);
    cudaCheck(cudaMemcpy(got.data(), device_result, n * sizeof(T), cudaMemcpyDeviceToHost));
    size_t bad = 0;
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        float g = (float)got[i];
        float err = fabsf(g - reference[i]);
        if (!(err <= atol + rtol * fabsf(reference[i]))) {
            if (bad < 5) printf("  %s[%zu]: got %.8g, want %.8g\n", name, i, g, reference[i]);
            bad++;
        }
        if (err > worst) worst = err;
    }
    if (bad) {
        printf("FAIL %s: %zu of %zu elements outside atol %.2g rtol %.2g\n", name, bad, n, atol, rtol);
        exit(EXIT_FAILURE);
    }
    printf("  %-28s ok (max abs err %.3g over %zu elements)\n", name, worst, n);
}

// determinism: the device buffer's bytes equal the other's (a rerun must reproduce every bit); exits
// non-zero when not
static void lab_require_identical(const char* name, const void* device_a, const void* device_b, size_t bytes) {
    std::vector<char> a(bytes), b(bytes);
    cudaCheck(cudaMemcpy(a.data(), device_a, bytes, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(b.data(), device_b, bytes, cudaMemcpyDeviceToHost));
    if (memcmp(a.data(), b.data(), bytes) != 0) {
        printf("FAIL %s: a second run gives different bits\n", name);
        exit(EXIT_FAILURE);
    }
    printf("  %-28s ok (bit-identical rerun)\n", name);
}

// ----------------------------------------------------------------------------------------------------
// timing
static int lab_on_cpu_backend(void) {
#ifdef __CUCC__
    return 1;
#else
    return 0;
#endif
}

// Peak DRAM bandwidth (GB/s) and dense bf16 tensor throughput (TFLOP/s) of the detected GPU, for the
// "% of floor" column, from llmc/mfu.h's table (the project's one table of GPU peaks); 0 when unknown (the
// column is then left out).
static void lab_device_peaks(double* bandwidth_gbs, double* bf16_tflops) {
    cudaDeviceProp p;
    cudaCheck(cudaGetDeviceProperties(&p, 0));
    const GpuPeakFlops* g = gpu_peaks_find(p.name);
    *bandwidth_gbs = g != NULL ? g->dram_gbs : 0.0;
    *bf16_tflops = g != NULL ? g->bf16 : 0.0;
}

// Runs kernel() repeatedly after a warm-up and returns milliseconds per call (CUDA events). In the checking build
// (cpu/cucc --check: the lab-check rows, which are there to validate) one timed call and no warm-up: its time measures
// the instrumentation, and a repeat launches the same checked code again (3 repeats were half of those rows' time).
template <class Kernel>
static float lab_time_ms(int repeats, Kernel kernel) {
#ifdef CUCC_CHECK
    const int warmups = 0;
    repeats = 1;
#else
    const int warmups = 1;
#endif
    cudaEvent_t start, stop;
    cudaCheck(cudaEventCreate(&start));
    cudaCheck(cudaEventCreate(&stop));
    for (int i = 0; i < warmups; i++) kernel();
    cudaCheck(cudaGetLastError());
    cudaCheck(cudaDeviceSynchronize());
    cudaCheck(cudaEventRecord(start));
    for (int i = 0; i < repeats; i++) kernel();
    cudaCheck(cudaEventRecord(stop));
    cudaCheck(cudaEventSynchronize(stop));
    float ms = 0.0f;
    cudaCheck(cudaEventElapsedTime(&ms, start, stop));
    cudaCheck(cudaEventDestroy(start));
    cudaCheck(cudaEventDestroy(stop));
    return ms / repeats;
}

static void lab_print_header(const char* kernel, const char* sizes) {
    printf("%s: %s%s\n", kernel, sizes, lab_on_cpu_backend() ? "  [CPU backend: times are CPU times]" : "");
    printf("  %-8s %6s %12s %12s %10s\n", "variant", "block", "time (ms)", "throughput", "% floor");
}

// One timing row. Memory-bound kernels pass bytes (flops 0); compute-bound ones pass flops.
static void lab_print_row(int variant, int block_size, float ms, double bytes, double flops) {
    double bandwidth_peak, tflops_peak;
    lab_device_peaks(&bandwidth_peak, &tflops_peak);
    char throughput[32], percent[16] = "-";
    if (flops > 0) {
        double tflops = flops / (ms * 1e-3) / 1e12;
        snprintf(throughput, sizeof(throughput), "%.2f TFLOP/s", tflops);
        if (tflops_peak > 0 && !lab_on_cpu_backend()) snprintf(percent, sizeof(percent), "%.1f%%", 100.0 * tflops / tflops_peak);
    } else {
        double gbs = bytes / (ms * 1e-3) / 1e9;
        snprintf(throughput, sizeof(throughput), "%.1f GB/s", gbs);
        if (bandwidth_peak > 0 && !lab_on_cpu_backend()) snprintf(percent, sizeof(percent), "%.1f%%", 100.0 * gbs / bandwidth_peak);
    }
    printf("  %-8d %6d %12.4f %12s %10s\n", variant, block_size, ms, throughput, percent);
}
