// dev/cuda/adamw.cu: kernel lab for the AdamW step (decoupled weight decay) with and without fp32 master
// weights, stochastic rounding into floatX seeded by (seed, element index).
// Build and run (CPU backend; -DENABLE_FP32 for fp32):
//   make build/lab/adamw_bf16   (build/lab/adamw_fp32: the fp32 build)
//   build/lab/adamw_bf16 [variant] [-s]
// Variants:
//   1  llmc/adamw.cuh adamw_update (THE TRAINER'S): a thread per 16-byte chunk of parameters, x128/f128 loads.
//   2  a thread per element with scalar loads: the same arithmetic and rounding, to measure what the vector
//      loads buy; it must give bit-identical results (the rounding noise depends on the index only).
// Sizes: n = 124,475,904 (GPT-2 124M's parameter count); -s: n = 10,007 (not a multiple of the chunk: the
// element-by-element tail runs).
// Floor: with master weights (2 * sizeof(floatX) + 24) bytes per parameter, without (3 * sizeof(floatX) + 16);
// ~15 flops per parameter: memory-bound.
#include "common.h"
#include "../../llmc/adamw.cuh"

__global__ void adamw_scalar_kernel(floatX* params, float* master_params, const floatX* grads, float* m, float* v,
                                    size_t n, float learning_rate, float beta1, float beta2, float beta1_correction,
                                    float beta2_correction, float eps, float weight_decay, float grad_scale,
                                    unsigned int seed) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float old_param = master_params != nullptr ? master_params[i] : (float)params[i];
    const float new_param = adamw_element(old_param, __fmul_rn(grad_scale, (float)grads[i]), &m[i], &v[i],
                                          learning_rate, beta1, beta2, 1.0f / beta1_correction,
                                          1.0f / beta2_correction, eps, weight_decay);
    stochastic_rounding(new_param, &params[i], random_u32(seed, (unsigned int)i));
    if (master_params != nullptr) master_params[i] = new_param;
}

struct AdamWSettings {
    float learning_rate, beta1, beta2, beta1_correction, beta2_correction, eps, weight_decay, grad_scale;
    unsigned int seed;
};

static void adamw_run(int variant, int block_size, floatX* params, float* master, const floatX* grads, float* m,
                      float* v, size_t n, const AdamWSettings& s) {
    if (variant == 1)
        adamw_update(params, master, grads, m, v, n, s.learning_rate, s.beta1, s.beta2, s.beta1_correction,
                     s.beta2_correction, s.eps, s.weight_decay, s.grad_scale, s.seed, 0);
    else
        adamw_scalar_kernel<<<(unsigned int)CEIL_DIV(n, (size_t)block_size), block_size>>>(
            params, master, grads, m, v, n, s.learning_rate, s.beta1, s.beta2, s.beta1_correction, s.beta2_correction,
            s.eps, s.weight_decay, s.grad_scale, s.seed);
    cudaCheck(cudaGetLastError());
}

// The stochastic rounding rule, written again on the host from its definition: keep the upper 16 bits of
// the fp32 value, and step them one bf16 ulp away from zero iff the dropped 16 bits exceed the low 16 bits
// of the noise (so the expected result is the fp32 value). fp16 rounds to nearest, fp32 keeps the value.
static float rounding_reference(float value, unsigned int noise) {
#if defined(ENABLE_FP32)
    (void)noise;
    return value;
#elif defined(ENABLE_FP16)
    (void)noise;
    return (float)(half)value;
#else
    uint32_t bits;
    memcpy(&bits, &value, 4);
    uint32_t kept = bits & 0xFFFF0000u;
    if ((bits & 0xFFFFu) > (noise & 0xFFFFu)) kept += 0x10000u;  // sign-magnitude: +1 ulp in magnitude
    float rounded;
    memcpy(&rounded, &kept, 4);
    return rounded;
#endif
}

static void run_case(const LabArgs& args, size_t n, bool with_master) {
    const AdamWSettings s = {1e-3f, 0.9f, 0.95f, 1.0f - powf(0.9f, 5.0f), 1.0f - powf(0.95f, 5.0f), 1e-8f, 0.1f, 0.7f,
                             1234567u};
    // params ~ weights, grads ~ U(-1,1) before the 0.7 scale, m ~ U(-0.1, 0.1), v ~ U(0, 0.01): steps of a few
    // lr, so the update is visible at bf16 resolution only through the rounding
    std::vector<float> params = lab_random(n, -1.0f, 1.0f);
    std::vector<float> grads = lab_random(n, -1.0f, 1.0f);
    std::vector<float> m = lab_random(n, -0.1f, 0.1f);
    std::vector<float> v = lab_random(n, 0.0f, 0.01f);
    for (auto& x : grads) x = (float)(floatX)x;
    std::vector<float> params_x(params);  // the floatX parameters: master rounded to nearest
    for (auto& x : params_x) x = (float)(floatX)x;
    // without master weights the update starts from the floatX value
    const std::vector<float>& start = with_master ? params : params_x;

    std::vector<float> new_params_ref(n), m_ref(n), v_ref(n);
    for (size_t i = 0; i < n; i++) {
        double g = (double)grads[i] * s.grad_scale;
        double mi = s.beta1 * (double)m[i] + (1.0 - s.beta1) * g;
        double vi = s.beta2 * (double)v[i] + (1.0 - s.beta2) * g * g;
        double update = (mi / s.beta1_correction) / (sqrt(vi / s.beta2_correction) + s.eps);
        new_params_ref[i] = (float)(start[i] - s.learning_rate * (update + s.weight_decay * start[i]));
        m_ref[i] = (float)mi;
        v_ref[i] = (float)vi;
    }

    // Tolerances. m, v and the fp32 master: a handful of fp32 operations on the same inputs, so a few fp32
    // ulps of the terms summed, which can cancel: 1e-6 relative plus an absolute ~4 ulps of the largest term
    // (m: terms <= 0.1, ulp 7.5e-9: 3e-8; v: terms <= 0.025, ulp 1.9e-9: 1e-8; master: |p| < 1: 2e-7). floatX params: the stochastic rounding of the fp32
    // value is one of its two floatX neighbours, so params are within one floatX ulp of the reference value
    // (relative 2^-7 for bf16, 2^-10 for fp16, fp32: the master tolerance). With master weights they are also
    // checked bit for bit against the rounding rule applied on the host to the device's own master value.
#if defined(ENABLE_FP32)
    const float params_atol = 2e-7f, params_rtol = 1e-6f;
#elif defined(ENABLE_FP16)
    const float params_atol = 6e-8f, params_rtol = 1.0f / 1024.0f;  // 2^-24: one ulp among fp16 subnormals
#else
    const float params_atol = 0.0f, params_rtol = 1.0f / 128.0f;
#endif
    printf("adamw: n=%zu %s, %s master weights\n", n, PRECISION_NAME, with_master ? "with" : "without");
    floatX* d_params = lab_poisoned<floatX>(n);
    float* d_master = with_master ? lab_poisoned<float>(n) : nullptr;
    floatX* d_grads = lab_to_device<floatX>(grads);
    float* d_m = lab_poisoned<float>(n);
    float* d_v = lab_poisoned<float>(n);
    std::vector<floatX> first_result;
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        // inputs are restored before each run: the step updates them in place
        floatX* fresh_params = lab_to_device<floatX>(params_x);
        cudaCheck(cudaMemcpy(d_params, fresh_params, n * sizeof(floatX), cudaMemcpyDeviceToDevice));
        cudaCheck(cudaFree(fresh_params));
        if (with_master) cudaCheck(cudaMemcpy(d_master, params.data(), n * sizeof(float), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d_m, m.data(), n * sizeof(float), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d_v, v.data(), n * sizeof(float), cudaMemcpyHostToDevice));
        adamw_run(variant, 256, d_params, d_master, d_grads, d_m, d_v, n, s);
        cudaCheck(cudaDeviceSynchronize());
        lab_validate("m", d_m, m_ref.data(), n, 3e-8f, 1e-6f);
        lab_validate("v", d_v, v_ref.data(), n, 1e-8f, 1e-6f);
        if (with_master) lab_validate("master params (fp32)", d_master, new_params_ref.data(), n, 2e-7f, 1e-6f);
        lab_validate("params (floatX, 1 ulp)", d_params, new_params_ref.data(), n, params_atol, params_rtol);
        std::vector<floatX> result(n);
        cudaCheck(cudaMemcpy(result.data(), d_params, n * sizeof(floatX), cudaMemcpyDeviceToHost));
        if (with_master) {
            std::vector<float> master(n), expected(n);
            cudaCheck(cudaMemcpy(master.data(), d_master, n * sizeof(float), cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < n; i++) expected[i] = rounding_reference(master[i], random_u32(s.seed, (unsigned)i));
            lab_validate("params == rounding(master)", d_params, expected.data(), n, 0.0f, 0.0f);
        }
        if (first_result.empty()) {
            first_result = result;
        } else if (memcmp(first_result.data(), result.data(), n * sizeof(floatX)) != 0) {
            printf("FAIL params: variants 1 and 2 differ (the rounding must depend on (seed, index) only)\n");
            exit(EXIT_FAILURE);
        }
    }

    char sizes[128];
    snprintf(sizes, sizeof(sizes), "n=%zu %s, %s master weights", n, PRECISION_NAME, with_master ? "with" : "without");
    lab_print_header("adamw", sizes);
    const int repeats = args.small ? 3 : 20;
    const double bytes = (double)n * (with_master ? 2 * sizeof(floatX) + 24 : 3 * sizeof(floatX) + 16);
    if (args.variant == 0 || args.variant == 1) {
        float ms = lab_time_ms(repeats, [&]() { adamw_run(1, 512, d_params, d_master, d_grads, d_m, d_v, n, s); });
        lab_print_row(1, 512, ms, bytes, 0.0);
    }
    if (args.variant == 0 || args.variant == 2) {
        const int block_sizes[] = {128, 256, 512, 1024};
        for (int block_size : block_sizes) {
            float ms = lab_time_ms(repeats,
                                   [&]() { adamw_run(2, block_size, d_params, d_master, d_grads, d_m, d_v, n, s); });
            lab_print_row(2, block_size, ms, bytes, 0.0);
        }
    }
    cudaCheck(cudaFree(d_params));
    if (d_master != nullptr) cudaCheck(cudaFree(d_master));
    cudaCheck(cudaFree(d_grads));
    cudaCheck(cudaFree(d_m));
    cudaCheck(cudaFree(d_v));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    const size_t n = args.small ? 10007 : 124475904;
    run_case(args, n, true);
    run_case(args, n, false);
    return 0;
}
