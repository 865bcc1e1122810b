// dev/cuda/adamw_host.cu: lab and benchmark of the host AdamW for ZeRO-Offload (llmc/adamw_host.h): validated bit for
// bit against the device's adamw_update and against a double-precision reference, then timed against the machine's
// memory bandwidth, measured with a plain copy loop on the same OpenMP threads.
// Build and run on the CPU backend:
//   make build/lab/adamw_host_bf16   (build/lab/adamw_host_fp32: the fp32 build)
//   build/lab/adamw_host_bf16 [variant] [-s]
// On a GPU machine: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -Xcompiler -fopenmp,-fno-math-errno -I.
//   dev/cuda/adamw_host.cu -o adamw_host -lgomp   (the host loop then runs on the host's cores beside a real GPU,
//   whose kernel it must still match bit for bit: -ftz=true is the one setting it follows, adamw_device_flushes_subnormals)
// Variants (host code; the "block" column is the thread count):
//   1  llmc/adamw_host.h adamw_host_update: the trainer's (AVX2 where the CPU has it, else the baseline)
//   2  adamw_host_update_baseline: the loop compiled for the build's baseline (x86-64: SSE2)
//   3  adamw_host_update_avx2 (x86 CPUs with AVX2 only)
// Sizes: validation at n = 4,194,311 (-s: 10,007; neither a multiple of 8, so the kernel's tail runs), timing at
// n = 124,475,904 (GPT-2 124M's parameters; -s: 10,007).
// Bytes per parameter, the floor: reads grad, master, m, v (16), writes master, m, v (12) and the param (sizeof(floatX));
// the copy loop moves 8 bytes per float (read and write), both counted without the write-allocate reads a CPU adds.
// Needs -fno-math-errno to vectorise (llmc/adamw_host.h); the Makefile passes it.
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "common.h"
#include "../../llmc/adamw.cuh"
#include "../../llmc/adamw_host.h"

static int host_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

// The best of `repeats` timings after a warm-up (memory-bound loops: the best run is the one least disturbed by the
// other processes of a shared machine)
template <class Work>
static double best_ms(int repeats, Work work) {
    work();
    double best = 1e30;
    for (int r = 0; r < repeats; r++) {
        const double start = now_ms();
        work();
        best = fmin(best, now_ms() - start);
    }
    return best;
}

// dst = src, float by float, on every OpenMP thread: the machine's memory bandwidth as this program can use it
static void copy_floats(float* dst, const float* src, size_t n) {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) dst[i] = src[i];
}

static bool variant_available(int variant) {
    return variant != 3 || (ADAMW_HOST_AVX2 && __builtin_cpu_supports("avx2"));
}

struct Settings {
    float learning_rate, beta1, beta2, beta1_correction, beta2_correction, eps, weight_decay, grad_scale;
    unsigned int seed;
    int flush_subnormals;
};

static void host_run(int variant, floatX* params, float* master, const float* grads, float* m, float* v, size_t n,
                     const Settings& s) {
    const float inverse1 = 1.0f / s.beta1_correction, inverse2 = 1.0f / s.beta2_correction;
    if (variant == 1)
        adamw_host_update(params, master, grads, m, v, n, s.learning_rate, s.beta1, s.beta2, s.beta1_correction,
                          s.beta2_correction, s.eps, s.weight_decay, s.grad_scale, s.seed, s.flush_subnormals);
    else if (variant == 2)
        adamw_host_update_baseline(params, master, grads, m, v, n, s.learning_rate, s.beta1, s.beta2, inverse1,
                                   inverse2, s.eps, s.weight_decay, s.grad_scale, s.seed, s.flush_subnormals);
#if ADAMW_HOST_AVX2
    else
        adamw_host_update_avx2(params, master, grads, m, v, n, s.learning_rate, s.beta1, s.beta2, inverse1, inverse2,
                               s.eps, s.weight_decay, s.grad_scale, s.seed, s.flush_subnormals);
#endif
}

// pinned host memory, as ZeRO-Offload keeps its state
template <class T>
static T* pinned(size_t n) {
    T* p;
    cudaCheck(cudaMallocHost(&p, n * sizeof(T)));
    return p;
}

static void validate(const LabArgs& args, size_t n, const Settings& s) {
    printf("adamw_host (%s): validation at n=%zu, flush_subnormals=%d\n", PRECISION_NAME, n, s.flush_subnormals);
    // inputs as lab adamw.cu draws them: the gradients as floatX holds them (the host gets them widened to fp32)
    const std::vector<float> master0 = lab_random(n, -1.0f, 1.0f);
    const std::vector<float> grads = lab_random_rounded(n, -1.0f, 1.0f);
    const std::vector<float> m0 = lab_random(n, -0.1f, 0.1f);
    const std::vector<float> v0 = lab_random(n, 0.0f, 0.01f);

    // the device's step: adamw_update with master weights
    floatX* d_params = lab_to_device<floatX>(master0);
    float* d_master = lab_to_device<float>(master0);
    floatX* d_grads = lab_to_device<floatX>(grads);
    float* d_m = lab_to_device<float>(m0);
    float* d_v = lab_to_device<float>(v0);
    adamw_update(d_params, d_master, d_grads, d_m, d_v, n, s.learning_rate, s.beta1, s.beta2, s.beta1_correction,
                 s.beta2_correction, s.eps, s.weight_decay, s.grad_scale, s.seed, 0);
    cudaCheck(cudaDeviceSynchronize());
    std::vector<floatX> device_params(n);
    std::vector<float> device_master(n), device_m(n), device_v(n);
    cudaCheck(cudaMemcpy(device_params.data(), d_params, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(device_master.data(), d_master, n * sizeof(float), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(device_m.data(), d_m, n * sizeof(float), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(device_v.data(), d_v, n * sizeof(float), cudaMemcpyDeviceToHost));

    // the definition in double (as lab adamw.cu), for the tolerances of lab adamw.cu: m 3e-8 + 1e-6 relative, v 1e-8 +
    // 1e-6, master 2e-7 + 1e-6 (a few fp32 roundings of terms up to 0.1, 0.025 and 1)
    std::vector<float> want_master(n), want_m(n), want_v(n);
    for (size_t i = 0; i < n; i++) {
        const double g = (double)grads[i] * s.grad_scale;
        const double mi = s.beta1 * (double)m0[i] + (1.0 - s.beta1) * g;
        const double vi = s.beta2 * (double)v0[i] + (1.0 - s.beta2) * g * g;
        const double update = (mi / s.beta1_correction) / (sqrt(vi / s.beta2_correction) + s.eps);
        want_master[i] = (float)(master0[i] - s.learning_rate * (update + s.weight_decay * master0[i]));
        want_m[i] = (float)mi;
        want_v[i] = (float)vi;
    }

    floatX* params = pinned<floatX>(n);
    float *master = pinned<float>(n), *host_grads = pinned<float>(n), *m = pinned<float>(n), *v = pinned<float>(n);
    for (int variant = 1; variant <= 3; variant++) {
        if ((args.variant != 0 && args.variant != variant) || !variant_available(variant)) continue;
        printf("variant %d\n", variant);
        memcpy(master, master0.data(), n * sizeof(float));
        memcpy(host_grads, grads.data(), n * sizeof(float));
        memcpy(m, m0.data(), n * sizeof(float));
        memcpy(v, v0.data(), n * sizeof(float));
        memset(params, 0xff, n * sizeof(floatX));  // poison: NaN in every precision
        host_run(variant, params, master, host_grads, m, v, n, s);
        const bool same = memcmp(params, device_params.data(), n * sizeof(floatX)) == 0 &&
                          memcmp(master, device_master.data(), n * sizeof(float)) == 0 &&
                          memcmp(m, device_m.data(), n * sizeof(float)) == 0 &&
                          memcmp(v, device_v.data(), n * sizeof(float)) == 0;
        if (!same) {
            printf("FAIL: params, master, m or v differ from the device's adamw_update\n");
            exit(EXIT_FAILURE);
        }
        printf("  %-28s ok (params, master, m, v bit-identical to adamw_update)\n", "device");
        // lab_validate reads device memory: compare through copies there
        float* d_check = lab_to_device<float>(std::vector<float>(master, master + n));
        lab_validate("master (fp32)", d_check, want_master.data(), n, 2e-7f, 1e-6f);
        cudaCheck(cudaMemcpy(d_check, m, n * sizeof(float), cudaMemcpyHostToDevice));
        lab_validate("m", d_check, want_m.data(), n, 3e-8f, 1e-6f);
        cudaCheck(cudaMemcpy(d_check, v, n * sizeof(float), cudaMemcpyHostToDevice));
        lab_validate("v", d_check, want_v.data(), n, 1e-8f, 1e-6f);
        cudaCheck(cudaFree(d_check));
    }
    cudaCheck(cudaFreeHost(params));
    cudaCheck(cudaFreeHost(master));
    cudaCheck(cudaFreeHost(host_grads));
    cudaCheck(cudaFreeHost(m));
    cudaCheck(cudaFreeHost(v));
    cudaCheck(cudaFree(d_params));
    cudaCheck(cudaFree(d_master));
    cudaCheck(cudaFree(d_grads));
    cudaCheck(cudaFree(d_m));
    cudaCheck(cudaFree(d_v));
}

static void benchmark(const LabArgs& args, size_t n, const Settings& s) {
    const int threads = host_threads(), repeats = args.small ? 3 : 10;
    floatX* params = pinned<floatX>(n);
    float *master = pinned<float>(n), *grads = pinned<float>(n), *m = pinned<float>(n), *v = pinned<float>(n);
    // the copy moves as many bytes as the update reads: two arrays of 2n floats (16n bytes of reads and writes)
    float *copy_src = pinned<float>(2 * n), *copy_dst = pinned<float>(2 * n);
    // first touch on the threads that use the pages (and no page faults in the timings)
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        master[i] = 0.01f * (float)(i % 199) - 1.0f;
        grads[i] = 0.001f * (float)(i % 97) - 0.05f;
        m[i] = 0.0f;
        v[i] = 0.0f;
        params[i] = (floatX)0.0f;
    }
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < 2 * n; i++) {
        copy_src[i] = (float)(i % 1000);
        copy_dst[i] = 0.0f;
    }
    const double copy_ms = best_ms(repeats, [&]() { copy_floats(copy_dst, copy_src, 2 * n); });
    const double copy_gbs = 16.0 * n / (copy_ms * 1e-3) / 1e9;
    const double bytes = (double)n * (28 + sizeof(floatX));
    printf("adamw_host (%s): n=%zu, %d threads, best of %d%s\n", PRECISION_NAME, n, threads, repeats,
           lab_on_cpu_backend() ? "  [CPU backend build: host code, real times]" : "");
    printf("  %-30s %10s %10s %12s\n", "loop", "threads", "time (ms)", "GB/s");
    printf("  %-30s %10d %10.2f %12.2f\n", "copy (memory bandwidth)", threads, copy_ms, copy_gbs);
    const char* names[4] = {"", "1 adamw_host_update", "2 baseline", "3 avx2"};
    for (int variant = 1; variant <= 3; variant++) {
        if ((args.variant != 0 && args.variant != variant) || !variant_available(variant)) continue;
        const double ms = best_ms(repeats, [&]() { host_run(variant, params, master, grads, m, v, n, s); });
        const double gbs = bytes / (ms * 1e-3) / 1e9;
        printf("  %-30s %10d %10.2f %12.2f   %.0f%% of the copy's\n", names[variant], threads, ms, gbs,
               100.0 * gbs / copy_gbs);
    }
    cudaCheck(cudaFreeHost(params));
    cudaCheck(cudaFreeHost(master));
    cudaCheck(cudaFreeHost(grads));
    cudaCheck(cudaFreeHost(m));
    cudaCheck(cudaFreeHost(v));
    cudaCheck(cudaFreeHost(copy_src));
    cudaCheck(cudaFreeHost(copy_dst));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    Settings s = {1e-3f, 0.9f, 0.95f, 1.0f - powf(0.9f, 5.0f), 1.0f - powf(0.95f, 5.0f), 1e-8f, 0.1f, 0.7f, 1234567u, 0};
    s.flush_subnormals = adamw_device_flushes_subnormals();
    validate(args, args.small ? 10007 : 4194311, s);
    benchmark(args, args.small ? 10007 : 124475904, s);
    return 0;
}
