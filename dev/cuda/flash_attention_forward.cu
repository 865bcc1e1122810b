// dev/cuda/flash_attention_forward.cu: kernel lab for causal multi-head attention forward without the (B, NH, T, T)
// matrix (llmc/flash_attention.cuh): inp (B, T, (NH + 2 NKV) HS) = [q | k | v] per position -> out (B, T, C) and the
// softmax statistics stats (B, NH, T) fp32, the log-sum-exp of each query row that the backward pass recomputes
// from. NKV key/value heads, each serving NH / NKV query heads (grouped-query attention, doc/attention.md).
// Build and run (CPU backend; -DENABLE_FP32 for fp32):
//   make build/lab/flash_attention_forward_bf16   (build/lab/flash_attention_forward_fp32: the fp32 build)
//   build/lab/flash_attention_forward_bf16 [variant] [-s]
// Variants:
//   1  llmc/attention.cuh attention_forward, the trainers' path without cuDNN, for comparison: cuBLAS GEMMs around
//      a causal softmax, att (B, NH, T, T) materialised; validated on out (it has no stats). NKV = NH only.
//   2  the flash algorithm without tiles (this file): one thread per query row, k and v read from global memory
//      key by key, online softmax in fp32.
//   3  llmc/flash_attention.cuh flash_attention_forward on the fp32 cores (THE FLASH PATH in fp32): a block of 64
//      query rows streams 32-key tiles of k (transposed) and v through shared memory as floats; key tiles above
//      the diagonal are skipped.
//   4  llmc/flash_attention.cuh flash_attention_forward on tensor cores (THE FLASH PATH in bf16 and fp16; not in
//      fp32 builds): 4 warps of 16 query rows each stream 64-key tiles in floatX; s = q k^T and o += p v are wmma
//      products with fp32 accumulators, the online softmax goes through each warp's shared-memory strip.
//   5  llmc/cudnn_att.cuh attention_forward_cudnn, cuDNN's fused flash attention, the target to match (bf16 or
//      fp16, built with -DENABLE_CUDNN: `make -C dev/cuda flash_attention_forward_cudnn`, GPU only). NKV = NH only.
// Sizes: B=4 T=256 C=768 NH=12 (the CPU backend comparison) and B=8 T=1024 C=768 NH=12 (GPT-2 124M), validated,
// then B=16, 32 and 64 at T=1024, timed only, all NKV = NH;
// -s: head sizes 16 (B=2 T=23 NH=3, the trainers' test model), 32 (T=64: whole blocks and tiles), 64 (T=70: two
// query blocks, a partial key tile) and 128 (T=40); then grouped-query attention at HS 64: NH=4 NKV=2 (T=70) and
// NH=4 NKV=1 (B=2 T=100), and at HS 16: NH=3 NKV=1 (B=2 T=23). Variants 1 and 5 skip the grouped sizes.
// Floor: flops 2 products of 2 * T*T*HS per head, halved by the mask: 2 * B*NH*T*T*HS (12.9 GFLOP at GPT-2 124M
// sizes); bytes (3 + 1) * B*T*C * sizeof(floatX) (qkv read once, out written) + 4 * B*NH*T (stats): 50 MB in
// bf16. Arithmetic intensity ~250 flop/byte: compute-bound on every GPU (an H100 needs 13 us at its dense bf16
// tensor peak, 190 us on its fp32 cores, 15 us to move the bytes); the timing rows count these useful flops for
// every variant (variant 1 computes the whole T*T, twice the useful flops, and moves O(T^2) bytes).
#include "common.h"
#include "../../llmc/attention.cuh"
#include "../../llmc/flash_attention.cuh"
#include "attention_reference.h"
#if defined(ENABLE_CUDNN)
#include "../../llmc/cudnn_att.cuh"
#endif

// variant 4 (tensor cores) takes bf16 or fp16; variant 5 (cuDNN) is in -DENABLE_CUDNN builds, bf16 or fp16 too
static const int FLASH_LAB_VARIANTS = 5;
static bool flash_lab_has_variant(int variant) {
    if (variant <= 3) return true;
    if (sizeof(floatX) == sizeof(float)) return false;
#if defined(ENABLE_CUDNN)
    return true;
#else
    return variant == 4;
#endif
}
// variants 1 (the cuBLAS path) and 5 (cuDNN) take multi-head attention only
static bool flash_lab_variant_takes(int variant, int NH, int NKV) {
    return NKV == NH || (variant != 1 && variant != 5);
}

// Variant 2: thread per (b, h, query); HS <= 128
__global__ void flash_forward_untiled_kernel(floatX* out, float* stats, const floatX* inp, int B, int T, int NH,
                                             int NKV, int HS, float scale_log2) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= B * NH * T) return;
    const int t = row % T, h = (row / T) % NH, b = row / (NH * T);
    const int C = NH * HS, row_stride = (NH + 2 * NKV) * HS;
    const int kv = h / (NH / NKV);
    const floatX* q = inp + ((size_t)b * T + t) * row_stride + h * HS;
    float acc[128];
    for (int d = 0; d < HS; d++) acc[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int s = 0; s <= t; s++) {
        const floatX* k = inp + ((size_t)b * T + s) * row_stride + (NH + kv) * HS;
        float score = 0.0f;
        for (int d = 0; d < HS; d++) score += (float)q[d] * (float)k[d];
        score *= scale_log2;
        const float m_new = fmaxf(m, score);
        const float correction = exp2f(m - m_new);
        const float p = exp2f(score - m_new);
        l = l * correction + p;
        for (int d = 0; d < HS; d++) acc[d] = acc[d] * correction + p * (float)k[NKV * HS + d];
        m = m_new;
    }
    for (int d = 0; d < HS; d++) out[((size_t)b * T + t) * C + h * HS + d] = (floatX)(acc[d] / l);
    stats[row] = (m + log2f(l)) * 0.693147180559945f;
}

static void flash_forward_untiled(floatX* out, float* stats, const floatX* inp, int B, int T, int NH, int NKV, int C) {
    const int HS = C / NH;
    const int block_size = 64;
    flash_forward_untiled_kernel<<<CEIL_DIV(B * NH * T, block_size), block_size>>>(
        out, stats, inp, B, T, NH, NKV, HS, 1.44269504088896f / sqrtf((float)HS));
    cudaCheck(cudaGetLastError());
}

// validate = 0: timing only (the larger batches, whose double-precision reference would take minutes of host time;
// every kernel is the same code at B = 8, validated there)
static void run_size(const LabArgs& args, int B, int T, int C, int NH, int NKV, int validate) {
    const size_t n_inp = (size_t)B * T * (NH + 2 * NKV) * (C / NH), n_att = (size_t)B * NH * T * T;
    const size_t n_out = (size_t)B * T * C;
    const size_t n_stats = (size_t)B * NH * T;
    std::vector<float> inp = lab_random_rounded(n_inp, -1.0f, 1.0f);
    std::vector<float> qkvr_ref, att_ref, out_ref, stats_ref;
    if (validate) {
        qkvr_ref.resize(n_inp), att_ref.resize(n_att), out_ref.resize(n_out), stats_ref.resize(n_stats);
        attention_forward_reference(qkvr_ref, att_ref, out_ref, inp, B, T, C, NH, NKV);
        attention_stats_reference(stats_ref, inp, B, T, C, NH, NKV);
    }

    floatX* d_inp = lab_to_device<floatX>(inp);
    floatX* d_qkvr = lab_poisoned<floatX>(n_inp);
    floatX* d_att = lab_poisoned<floatX>(n_att);
    floatX* d_out = lab_poisoned<floatX>(n_out);
    floatX* d_out_again = lab_poisoned<floatX>(n_out);
    float* d_stats = lab_poisoned<float>(n_stats);
    float* d_stats_again = lab_poisoned<float>(n_stats);

    // Tolerances of variants 2 and 3. The inputs are exact in floatX and every operation is fp32, so each result
    // is its fp32 computation's error plus one rounding to floatX. fp32 errors grow like a random walk, sqrt(n) * 2^-24
    // per sum of n terms: the scores (HS <= 128 terms, scaled |s| <~ 3) err by ~2e-6 absolute in the exponent,
    // which is a relative error of p; exp2 (ex2.approx) adds 2 ulps; the weighted sum over T <= 1024 keys ~2e-6
    // relative. So out (|out| <= 1) and stats (|stats| <~ 10) are within ~5e-6 of the reference before the final
    // rounding: atol 2e-5 and, for fp32, rtol 2e-5. The rounding to floatX of out errs by at most half an ulp:
    // 2^-8 relative in bf16, 2^-11 in fp16: rtol 4e-3 and 5e-4. stats are fp32 in every precision. A key left out,
    // a wrong mask or a wrong rescale changes out by ~p * |v| >= 1/T ~ 1e-3 and stats by >= 1e-3: far outside.
    // Variant 1 has attention_forward.cu's tolerances (scores and att rounded to floatX in between: 1e-2 bf16;
    // fp16 is that argument with 2^-11 in place of 2^-8, 8 times smaller: 2e-3).
    // Variant 4 rounds each probability to floatX before p v (relative 2^-9 in bf16, 2^-12 in fp16) and sums the
    // rounded ones into l, so out is a convex combination of v's rows whose weights err by at most twice that:
    // |out - ref| <= 2^-8 max|v| = 3.9e-3 in bf16 (4.9e-4 in fp16) before out's own rounding (rtol): atol 4e-3 and
    // 5e-4. stats = log l errs by at most 2^-9 (2^-12) absolute plus the fp32 5e-6: 2e-3 and 3e-4. A wrong mask
    // still moves out by >= |v| / T, 1.4e-2 at the -s sizes.
#if defined(ENABLE_FP32)
    const float out_rtol = 2e-5f, cublas_path_tol = 2e-5f;
#elif defined(ENABLE_FP16)
    const float out_rtol = 5e-4f, cublas_path_tol = 2e-3f;
#else
    const float out_rtol = 4e-3f, cublas_path_tol = 1e-2f;
#endif
    const float atol = 2e-5f, stats_rtol = 2e-5f;
#if defined(ENABLE_FP16)
    const float tensor_atol = 5e-4f, tensor_stats_atol = 3e-4f;
#else
    const float tensor_atol = 4e-3f, tensor_stats_atol = 2e-3f;
#endif

    char sizes[128];
    snprintf(sizes, sizeof(sizes), "B=%d T=%d C=%d NH=%d NKV=%d %s", B, T, C, NH, NKV, PRECISION_NAME);
    printf("flash_attention_forward: %s\n", sizes);
    auto run_variant = [&](int variant, floatX* out, float* stats) {
        if (variant == 1) attention_forward(out, d_qkvr, d_att, d_inp, B, T, C, NH, 0);
        if (variant == 2) flash_forward_untiled(out, stats, d_inp, B, T, NH, NKV, C);
        if (variant == 3) flash_attention_forward(out, stats, d_inp, B, T, NH, NKV, C, 0, FLASH_FP32_CORES);
        if (variant == 4) flash_attention_forward(out, stats, d_inp, B, T, NH, NKV, C, 0, FLASH_TENSOR_CORES);
#if defined(ENABLE_CUDNN)
        if (variant == 5) attention_forward_cudnn(out, stats, d_inp, B, T, NH, C, 0);
#endif
    };
    if (!validate) printf("timing only (the kernels are validated at B=8)\n");
    for (int variant = 1; validate && variant <= FLASH_LAB_VARIANTS; variant++) {
        if ((args.variant != 0 && args.variant != variant) || !flash_lab_has_variant(variant)) continue;
        if (!flash_lab_variant_takes(variant, NH, NKV)) {
            printf("variant %d: skipped, it takes NKV = NH only\n", variant);
            continue;
        }
        printf("variant %d\n", variant);
        cudaCheck(cudaMemset(d_out, 0xff, n_out * sizeof(floatX)));
        cudaCheck(cudaMemset(d_stats, 0xff, n_stats * sizeof(float)));
        run_variant(variant, d_out, d_stats);
        cudaCheck(cudaDeviceSynchronize());
        if (variant == 1 || variant == 5) {  // cuDNN: no documented order or precision inside; the cuBLAS path's bound
            lab_validate("out", d_out, out_ref.data(), n_out, cublas_path_tol, cublas_path_tol);
            if (variant == 5) lab_validate("stats", d_stats, stats_ref.data(), n_stats, cublas_path_tol, stats_rtol);
            continue;
        }
        lab_validate("out", d_out, out_ref.data(), n_out, variant == 4 ? tensor_atol : atol, out_rtol);
        lab_validate("stats", d_stats, stats_ref.data(), n_stats, variant == 4 ? tensor_stats_atol : atol, stats_rtol);
        cudaCheck(cudaMemset(d_out_again, 0xff, n_out * sizeof(floatX)));
        cudaCheck(cudaMemset(d_stats_again, 0xff, n_stats * sizeof(float)));
        run_variant(variant, d_out_again, d_stats_again);
        cudaCheck(cudaDeviceSynchronize());
        lab_require_identical("out", d_out, d_out_again, n_out * sizeof(floatX));
        lab_require_identical("stats", d_stats, d_stats_again, n_stats * sizeof(float));
    }

    lab_print_header("flash_attention_forward", sizes);
    const int repeats = args.small ? 3 : (lab_on_cpu_backend() ? 5 : 20);
    const double flops = 2.0 * B * NH * (double)T * T * (C / NH);
    for (int variant = 1; variant <= FLASH_LAB_VARIANTS; variant++) {
        if ((args.variant != 0 && args.variant != variant) || !flash_lab_has_variant(variant)) continue;
        if (!flash_lab_variant_takes(variant, NH, NKV)) continue;
        float ms = lab_time_ms(repeats, [&]() { run_variant(variant, d_out, d_stats); });
        lab_print_row(variant, variant == 1 ? 0 : 64, ms, 0.0, flops);
    }
    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_qkvr));
    cudaCheck(cudaFree(d_att));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_out_again));
    cudaCheck(cudaFree(d_stats));
    cudaCheck(cudaFree(d_stats_again));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    if (args.variant != 0 && !flash_lab_has_variant(args.variant)) {
        fprintf(stderr, "%s: variant %d is not in this build (4: bf16 or fp16; 5: bf16 or fp16 with -DENABLE_CUDNN)\n",
                argv[0], args.variant);
        exit(EXIT_FAILURE);
    }
    cublas_setup();
#if defined(ENABLE_CUDNN)
    cudnn_attention_setup();
#endif
    if (args.small) {
        run_size(args, 2, 23, 48, 3, 3, 1);
        run_size(args, 1, 64, 64, 2, 2, 1);
        run_size(args, 1, 70, 128, 2, 2, 1);
        run_size(args, 1, 40, 128, 1, 1, 1);
        run_size(args, 1, 70, 256, 4, 2, 1);
        run_size(args, 2, 100, 256, 4, 1, 1);
        run_size(args, 2, 23, 48, 3, 1, 1);
    } else {
        run_size(args, 4, 256, 768, 12, 12, 1);
        run_size(args, 8, 1024, 768, 12, 12, 1);
        for (int B = 16; B <= 64; B *= 2) run_size(args, B, 1024, 768, 12, 12, 0);
    }
#if defined(ENABLE_CUDNN)
    cudnn_attention_teardown();
#endif
    cublas_teardown();
    return 0;
}
