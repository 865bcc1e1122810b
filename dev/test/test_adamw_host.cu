// dev/test/test_adamw_host.cu: the host AdamW for ZeRO-Offload (llmc/adamw_host.h) against the GPU kernel
// (llmc/adamw.cuh's adamw_update, run on the CPU backend with the GPU build's numerics) bit for bit over three steps,
// and against a double-precision reference from the definition with stated tolerances. Also: the kernel's
// subnormal-flush probe, that inputs whose v is subnormal tell a flushing build from an exact one (so the bit-for-bit
// comparison sees flushing), that the thread count does not change a bit, and that a missing buffer fails with one line.
// Build and run (CPU backend; one binary per working precision, and bf16 without the GPU's numerics flags):
//   make build/test_adamw_host_bf16      (_fp16, _fp32; _exact_bf16: no --use_fast_math, nothing flushed)
//   build/test_adamw_host_bf16
#include <omp.h>
#include <vector>
#include "test_common.h"
#include "../../llmc/adamw.cuh"
#include "../../llmc/adamw_host.h"

struct Step {
    float learning_rate, beta1, beta2, beta1_correction, beta2_correction, eps, weight_decay, grad_scale;
    unsigned int seed;
};

static Step step_settings(int t) {
    Step s = {1e-3f, 0.9f, 0.95f, 0.0f, 0.0f, 1e-8f, 0.1f, 0.7f, 1234567u + 77u * (unsigned int)t};
    s.beta1_correction = 1.0f - powf(s.beta1, (float)t);  // as llmc/optimizer.cuh computes them
    s.beta2_correction = 1.0f - powf(s.beta2, (float)t);
    return s;
}

// Optimizer state on both sides: the device's (what adamw_update updates) and the host's (adamw_host_update).
struct State {
    size_t n;
    std::vector<float> master, m, v;
    std::vector<floatX> params;
};

static State random_state(size_t n) {
    State s;
    s.n = n;
    s.master.resize(n);
    s.m.resize(n);
    s.v.resize(n);
    s.params.resize(n);
    fill_uniform(s.master.data(), n, -1.0f, 1.0f);
    fill_uniform(s.m.data(), n, -0.1f, 0.1f);
    fill_uniform(s.v.data(), n, 0.0f, 0.01f);
    for (size_t i = 0; i < n; i++) s.params[i] = (floatX)s.master[i];
    return s;
}

// gradients as floatX holds them (the device's gradient buffer), U(-1, 1)
static std::vector<float> random_grads(size_t n) {
    std::vector<float> g(n);
    fill_uniform(g.data(), n, -1.0f, 1.0f);
    for (float& x : g) x = (float)(floatX)x;
    return g;
}

// The optimizer's calls: one per tensor piece, each with its own seed (llmc/optimizer.cuh); the pieces start on
// 16-byte boundaries as the kernel requires. Same pieces on both sides.
static const size_t piece_end[2] = {4000, 0};  // 0: the end of the array

static void device_step(State* s, const std::vector<float>& grads, const Step& st) {
    const size_t n = s->n;
    floatX *d_params, *d_grads;
    float *d_master, *d_m, *d_v;
    cudaCheck(cudaMalloc(&d_params, n * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_grads, n * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_master, n * sizeof(float)));
    cudaCheck(cudaMalloc(&d_m, n * sizeof(float)));
    cudaCheck(cudaMalloc(&d_v, n * sizeof(float)));
    std::vector<floatX> grads_x(n);
    for (size_t i = 0; i < n; i++) grads_x[i] = (floatX)grads[i];
    cudaCheck(cudaMemcpy(d_grads, grads_x.data(), n * sizeof(floatX), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_params, s->params.data(), n * sizeof(floatX), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_master, s->master.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_m, s->m.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_v, s->v.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    size_t begin = 0;
    for (int p = 0; p < 2; p++) {
        const size_t end = piece_end[p] ? piece_end[p] : n;
        adamw_update(d_params + begin, d_master + begin, d_grads + begin, d_m + begin, d_v + begin, end - begin,
                     st.learning_rate, st.beta1, st.beta2, st.beta1_correction, st.beta2_correction, st.eps,
                     st.weight_decay, st.grad_scale, st.seed + (unsigned int)p, 0);
        begin = end;
    }
    cudaCheck(cudaMemcpy(s->params.data(), d_params, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(s->master.data(), d_master, n * sizeof(float), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(s->m.data(), d_m, n * sizeof(float), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(s->v.data(), d_v, n * sizeof(float), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(d_params));
    cudaCheck(cudaFree(d_grads));
    cudaCheck(cudaFree(d_master));
    cudaCheck(cudaFree(d_m));
    cudaCheck(cudaFree(d_v));
}

// The host's loop: 0 adamw_host_update (what the trainer calls: AVX2 where the CPU has it), 1 its baseline (SSE2)
// variant, 2 its AVX2 variant, called directly so that both are tested on a machine with AVX2.
static const char* const host_variant_names[3] = {"adamw_host_update", "baseline", "avx2"};
static int host_variants(void) {
    return ADAMW_HOST_AVX2 && __builtin_cpu_supports("avx2") ? 3 : 2;
}

// The host update writes params from scratch: they are poisoned first (NaN in every precision).
static void host_step(State* s, const std::vector<float>& grads, const Step& st, int flush_subnormals, int variant = 0) {
    memset(s->params.data(), 0xff, s->n * sizeof(floatX));
    size_t begin = 0;
    for (int p = 0; p < 2; p++) {
        const size_t end = piece_end[p] ? piece_end[p] : s->n;
        floatX* params = s->params.data() + begin;
        float *master = s->master.data() + begin, *m = s->m.data() + begin, *v = s->v.data() + begin;
        const unsigned int seed = st.seed + (unsigned int)p;
        if (variant == 0) {
            adamw_host_update(params, master, grads.data() + begin, m, v, end - begin, st.learning_rate, st.beta1,
                              st.beta2, st.beta1_correction, st.beta2_correction, st.eps, st.weight_decay,
                              st.grad_scale, seed, flush_subnormals);
        } else {
            // the variants take the reciprocals, as adamw_host_update computes them
            const float inverse1 = 1.0f / st.beta1_correction, inverse2 = 1.0f / st.beta2_correction;
            if (variant == 1)
                adamw_host_update_baseline(params, master, grads.data() + begin, m, v, end - begin, st.learning_rate,
                                           st.beta1, st.beta2, inverse1, inverse2, st.eps, st.weight_decay,
                                           st.grad_scale, seed, flush_subnormals);
#if ADAMW_HOST_AVX2
            else
                adamw_host_update_avx2(params, master, grads.data() + begin, m, v, end - begin, st.learning_rate,
                                       st.beta1, st.beta2, inverse1, inverse2, st.eps, st.weight_decay, st.grad_scale,
                                       seed, flush_subnormals);
#endif
        }
        begin = end;
    }
}

// elements whose bytes differ in any of params, master, m, v
static size_t differing(const State& a, const State& b, size_t* first) {
    size_t count = 0;
    *first = (size_t)-1;
    for (size_t i = 0; i < a.n; i++) {
        const bool same = memcmp(&a.params[i], &b.params[i], sizeof(floatX)) == 0 &&
                          memcmp(&a.master[i], &b.master[i], 4) == 0 && memcmp(&a.m[i], &b.m[i], 4) == 0 &&
                          memcmp(&a.v[i], &b.v[i], 4) == 0;
        if (!same && count++ == 0) *first = i;
    }
    return count;
}

// Special elements among the random ones: a zero gradient; "tiny" ones whose v is subnormal (an input that a -ftz build
// reads as zero, and 0.95 v a result that it flushes) and whose gradient is ~1e-21 (so (1 - beta2) g^2 is subnormal
// too; fp16 rounds it to zero); large gradients; zero moments; an infinite and a NaN gradient (m, v and the parameter
// go non-finite: the bf16 parameter is the canonical NaN on both sides).
static const size_t tiny_first = 100, tiny_count = 40;
static void plant_specials(State* s, std::vector<float>* grads) {
    (*grads)[0] = 0.0f;
    for (size_t k = 0; k < tiny_count; k++) {
        const size_t i = tiny_first + k;
        (*grads)[i] = (float)(floatX)(test_rand_uniform(0.5f, 4.0f) * 1e-21f * (k % 2 ? 1.0f : -1.0f));
        s->v[i] = test_rand_uniform(0.5f, 4.0f) * 1e-40f;
        s->m[i] = 0.0f;
    }
    for (size_t i = 200; i < 210; i++) (*grads)[i] = (float)(floatX)(test_rand_uniform(-1e4f, 1e4f));
    for (size_t i = 300; i < 310; i++) s->m[i] = s->v[i] = 0.0f;
    (*grads)[400] = (float)(floatX)INFINITY;
    (*grads)[401] = (float)(floatX)NAN;  // bf16's canonical NaN, widened: the bits the device's gradient holds
}

static void test_bit_identity(int device_flushes, int variant) {
    const size_t n = 10007;  // not a multiple of the kernel's chunk: its element-wise tail runs too
    test_seed(1000 + variant);
    State device = random_state(n);
    std::vector<float> grads = random_grads(n);
    plant_specials(&device, &grads);
    State host = device;
    for (int t = 1; t <= 3; t++) {
        const Step st = step_settings(t);
        const State before = host;
        device_step(&device, grads, st);
        host_step(&host, grads, st, device_flushes, variant);
        size_t first;
        const size_t bad = differing(device, host, &first);
        check(bad == 0, "%s, step %d: host and device differ in %zu of %zu elements (first %zu: master %.9g vs %.9g, "
              "v %.9g vs %.9g)", host_variant_names[variant], t, bad, n, first, bad ? device.master[first] : 0.0,
              bad ? host.master[first] : 0.0, bad ? device.v[first] : 0.0, bad ? host.v[first] : 0.0);
        // the other flush setting must be told apart by the tiny elements, else this test could not see flushing: at
        // the first step, whose state has the planted subnormal v (later, a flushing build has zeroed it, and fp16
        // gradients cannot be tiny)
        if (t == 1) {
            State other = before;
            host_step(&other, grads, st, !device_flushes, variant);
            const size_t differ = differing(device, other, &first);
            check(differ > 0 && first >= tiny_first && first < tiny_first + tiny_count,
                  "host with flush_subnormals=%d must differ from the device (a %s build) on the tiny elements: %zu "
                  "elements differ, the first %zu", !device_flushes, device_flushes ? "flushing" : "exact", differ,
                  differ ? first : 0);
        }
        // the next step's gradients, again as floatX holds them (the host gets exactly the device's values)
        for (size_t i = 0; i < n; i++) {
            const float scale = i >= tiny_first && i < tiny_first + tiny_count ? 1e-21f : 1.0f;
            grads[i] = (float)(floatX)((-0.5f * grads[i] + test_rand_uniform(-0.5f, 0.5f)) * scale);
        }
    }
}

// The thread count only splits the loop: 1 and 3 threads give the same bits.
static void test_thread_count(void) {
    const size_t n = 10007;
    State one = random_state(n);
    std::vector<float> grads = random_grads(n);
    State three = one;
    const Step st = step_settings(4);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    host_step(&one, grads, st, 1);
    omp_set_num_threads(3);
    host_step(&three, grads, st, 1);
    omp_set_num_threads(threads);
    size_t first;
    const size_t bad = differing(one, three, &first);
    check(bad == 0, "1 and 3 threads differ in %zu elements", bad);
}

// The rounding rule from its definition (bf16: the upper 16 bits, one ulp away from zero iff the dropped bits exceed
// the noise's low 16; fp16 and fp32 round to nearest), in double from the fp32 value.
static double rounding_reference(float value, unsigned int noise) {
#if defined(ENABLE_FP32)
    (void)noise;
    return value;
#elif defined(ENABLE_FP16)
    (void)noise;
    return (double)(float)__float2half_rn(value);
#else
    uint32_t bits;
    memcpy(&bits, &value, 4);
    uint32_t kept = bits & 0xffff0000u;
    if ((bits & 0xffffu) > (noise & 0xffffu)) kept += 0x10000u;
    float rounded;
    memcpy(&rounded, &kept, 4);
    return rounded;
#endif
}

// One step against the definition in double: m, v, master within a few fp32 roundings, params one floatX ulp.
static void test_reference(void) {
    const size_t n = 10007;
    State s = random_state(n);
    std::vector<float> grads = random_grads(n);
    const Step st = step_settings(5);
    std::vector<double> want_m(n), want_v(n), want_master(n);
    for (size_t i = 0; i < n; i++) {
        const double g = (double)grads[i] * st.grad_scale;
        want_m[i] = st.beta1 * (double)s.m[i] + (1.0 - st.beta1) * g;
        want_v[i] = st.beta2 * (double)s.v[i] + (1.0 - st.beta2) * g * g;
        const double update = (want_m[i] / st.beta1_correction) / (sqrt(want_v[i] / st.beta2_correction) + st.eps);
        want_master[i] = s.master[i] - st.learning_rate * (update + st.weight_decay * s.master[i]);
    }
    host_step(&s, grads, st, 1);
    // m, v, master: a handful of fp32 operations on the same inputs, whose terms can cancel: 1e-6 relative plus ~4
    // ulps of the largest term (m: terms <= 0.1, ulp 7.5e-9: 3e-8; v: terms <= 0.025, ulp 1.9e-9: 1e-8; master: |p|
    // < 1: 2e-7). params: the stochastic rounding picks one of the two floatX neighbours of the fp32 value: within
    // one floatX ulp of the reference (relative 2^-7 bf16, 2^-10 fp16; fp32: the master's tolerance).
    check_close("m", s.m.data(), want_m.data(), n, 3e-8, 1e-6);
    check_close("v", s.v.data(), want_v.data(), n, 1e-8, 1e-6);
    check_close("master", s.master.data(), want_master.data(), n, 2e-7, 1e-6);
    std::vector<float> params(n);
    std::vector<double> rule(n);
    for (size_t i = 0; i < n; i++) {
        params[i] = (float)s.params[i];
        // the pieces' seeds and indices: piece 0 is [0, 4000) with seed, piece 1 the rest with seed + 1
        const unsigned int noise = i < piece_end[0] ? random_u32(st.seed, (unsigned int)i)
                                                    : random_u32(st.seed + 1, (unsigned int)(i - piece_end[0]));
        rule[i] = rounding_reference(s.master[i], noise);
    }
#if defined(ENABLE_FP32)
    check_close("params", params.data(), want_master.data(), n, 2e-7, 1e-6);
#elif defined(ENABLE_FP16)
    check_close("params", params.data(), want_master.data(), n, 6e-8, 1.0 / 1024.0);
#else
    check_close("params", params.data(), want_master.data(), n, 0.0, 1.0 / 128.0);
#endif
    check_close("params == rounding rule of master", params.data(), rule.data(), n, 0.0, 0.0);
    // the rounding must go both ways (a truncation would pass the ulp test): count the parameters rounded up in
    // magnitude among those that are not exact in floatX
    size_t inexact = 0, up = 0;
    for (size_t i = 0; i < n; i++) {
        if ((double)params[i] == (double)s.master[i]) continue;
        inexact++;
        up += fabs((double)params[i]) > fabs((double)s.master[i]);
    }
    if (PRECISION_MODE == PRECISION_FP32) check(inexact == 0, "fp32 params equal the master weights (%zu differ)", inexact);
    else check(up > inexact / 4 && up < inexact * 3 / 4, "params rounded up in %zu of %zu inexact elements", up, inexact);
}

int main(int argc, char** argv) {
    if (argc == 2 && strcmp(argv[1], "null-master") == 0) {
        float x = 1.0f;
        floatX p;
        adamw_host_update(&p, NULL, &x, &x, &x, 1, 1e-3f, 0.9f, 0.95f, 0.1f, 0.05f, 1e-8f, 0.0f, 1.0f, 1u, 0);
        return 0;
    }
    test_seed(20240917);
#if defined(CUCC_FTZ) && CUCC_FTZ
    const int build_flushes = 1;
#else
    const int build_flushes = 0;
#endif
    const int device_flushes = adamw_device_flushes_subnormals();
    check(device_flushes == build_flushes, "adamw_device_flushes_subnormals() = %d in a build with CUCC_FTZ = %d",
          device_flushes, build_flushes);
    printf("%s, %s build (the device %s subnormals), %d OpenMP threads, %d host loop variants\n", PRECISION_NAME,
           build_flushes ? "fast-math" : "exact", device_flushes ? "flushes" : "keeps", omp_get_max_threads(),
           host_variants());
    for (int variant = 0; variant < host_variants(); variant++) test_bit_identity(device_flushes, variant);
    test_thread_count();
    test_reference();
    const char* const null_master[] = {"adamw_host_update: params, master_params, grads, m and v must all be given",
                                       NULL};
    expect_child_failure(argv[0], "null-master", null_master);
    return test_summary("adamw_host");
}
