// dev/cuda/flash_attention_backward.cu: kernel lab for causal multi-head attention backward without the
// (B, NH, T, T) matrix (llmc/flash_attention.cuh): dout (B, T, C) and the forward pass's inp
// (B, T, (NH + 2 NKV) HS), out (B, T, C) and stats (B, NH, T) -> dinp (inp's layout) = [dq | dk | dv], attention
// recomputed from q, k and the stats. NKV key/value heads, each serving NH / NKV query heads (grouped-query
// attention, doc/attention.md): a key/value head's dk and dv sum over its query heads.
// Build and run (CPU backend; -DENABLE_FP32 for fp32):
//   make build/lab/flash_attention_backward_bf16   (build/lab/flash_attention_backward_fp32: the fp32 build)
//   build/lab/flash_attention_backward_bf16 [variant] [-s]
// Variants:
//   1  llmc/attention.cuh attention_backward, the trainers' path without cuDNN, for comparison: from the qkvr and
//      att (B, NH, T, T) that its own forward pass keeps (run here first), cuBLAS GEMMs around the softmax backward.
//      NKV = NH only.
//   2  the flash backward without tiles (this file): one thread per query row for delta and dq, then one thread
//      per key row (of a key/value head) for dk and dv over the group's query heads, every operand read from
//      global memory.
//   3  llmc/flash_attention.cuh flash_attention_backward on the fp32 cores (THE FLASH PATH in fp32): the dq pass
//      over 64-query blocks streaming 32-key tiles, then the dk/dv pass over 64-key blocks streaming 32-query
//      tiles, through shared memory as floats; tiles above the diagonal skipped; deterministic (no atomics): a dk/dv
//      block loops over its key/value head's query heads in order, in the same accumulators.
//   4  llmc/flash_attention.cuh flash_attention_backward on tensor cores (THE FLASH PATH in bf16 and fp16; not in
//      fp32 builds): the same two passes with 4 warps of 16 rows per block and 64-row tiles in floatX; the 7
//      products are wmma products with fp32 accumulators, p and ds rounded to floatX before their second product.
//   5  llmc/cudnn_att.cuh attention_backward_cudnn (deterministic, as the trainers' default -cd 1), the target to
//      match (bf16 or fp16, built with -DENABLE_CUDNN: `make -C dev/cuda flash_attention_backward_cudnn`, GPU only).
//      NKV = NH only.
// Sizes: B=4 T=256 C=768 NH=12 (the CPU backend comparison) and B=8 T=1024 C=768 NH=12 (GPT-2 124M), validated,
// then B=16, 32 and 64 at T=1024, timed only, all NKV = NH;
// -s: head sizes 16 (B=2 T=23 NH=3, the trainers' test model), 32 (T=64: whole blocks and tiles), 64
// (T=70) and 128 (T=40); then grouped-query attention at HS 64: NH=4 NKV=2 (T=70) and NH=4 NKV=1 (B=2 T=100), and
// at HS 16: NH=3 NKV=1 (B=2 T=23). Variants 1 and 5 skip the grouped sizes.
// Floor: flops 5 products (s = q k^T, dp = dout v^T, dv = p^T dout, dq = ds k, dk = ds^T q) of 2 * T*T*HS per head,
// halved by the mask: 5 * B*NH*T*T*HS (32 GFLOP at GPT-2 124M sizes, 2.5 times the forward); variants 2 and 3
// recompute s and dp in both passes, 7 products (45 GFLOP), the price of a backward without float atomics. Bytes
// (3 + 1 + 1 + 3) * B*T*C * sizeof(floatX) (qkv, out, dout read, dinp written) + 12 * B*NH*T (stats read, delta
// written and read): 101 MB in bf16. Compute-bound like the forward; the timing rows count the 5 useful products.
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

// Variant 2, pass 1: thread per (b, h, query): delta = dout . out, dq = scale * sum_key ds * k; HS <= 128
__global__ void flash_backward_untiled_dq_kernel(floatX* dinp, float* delta, const floatX* dout, const floatX* inp,
                                                 const floatX* out, const float* stats, int B, int T, int NH, int NKV,
                                                 int HS) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= B * NH * T) return;
    const int t = row % T, h = (row / T) % NH, b = row / (NH * T);
    const int C = NH * HS, row_stride = (NH + 2 * NKV) * HS;
    const int kv = h / (NH / NKV);
    const float scale = 1.0f / sqrtf((float)HS);
    const floatX* q = inp + ((size_t)b * T + t) * row_stride + h * HS;
    const floatX* g = dout + ((size_t)b * T + t) * C + h * HS;
    const floatX* o = out + ((size_t)b * T + t) * C + h * HS;
    float row_delta = 0.0f;
    for (int d = 0; d < HS; d++) row_delta += (float)g[d] * (float)o[d];
    delta[row] = row_delta;
    float dq[128];
    for (int d = 0; d < HS; d++) dq[d] = 0.0f;
    for (int s = 0; s <= t; s++) {
        const floatX* k = inp + ((size_t)b * T + s) * row_stride + (NH + kv) * HS;
        float score = 0.0f, dp = 0.0f;
        for (int d = 0; d < HS; d++) {
            score += (float)q[d] * (float)k[d];
            dp += (float)g[d] * (float)k[NKV * HS + d];
        }
        const float ds = expf(score * scale - stats[row]) * (dp - row_delta);
        for (int d = 0; d < HS; d++) dq[d] += ds * (float)k[d];
    }
    for (int d = 0; d < HS; d++) dinp[((size_t)b * T + t) * row_stride + h * HS + d] = (floatX)(dq[d] * scale);
}

// Variant 2, pass 2: thread per (b, key/value head kv, key): over the query heads h that kv serves,
// dv = sum_h sum_query p * dout, dk = scale * sum_h sum_query ds * q
__global__ void flash_backward_untiled_dkv_kernel(floatX* dinp, const float* delta, const floatX* dout,
                                                  const floatX* inp, const float* stats, int B, int T, int NH, int NKV,
                                                  int HS) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= B * NKV * T) return;
    const int s = row % T, kv = (row / T) % NKV, b = row / (NKV * T);
    const int C = NH * HS, row_stride = (NH + 2 * NKV) * HS, group = NH / NKV;
    const float scale = 1.0f / sqrtf((float)HS);
    const floatX* k = inp + ((size_t)b * T + s) * row_stride + (NH + kv) * HS;
    float dk[128], dv[128];
    for (int d = 0; d < HS; d++) dk[d] = dv[d] = 0.0f;
    for (int h = kv * group; h < (kv + 1) * group; h++) {
        for (int t = s; t < T; t++) {
            const floatX* q = inp + ((size_t)b * T + t) * row_stride + h * HS;
            const floatX* g = dout + ((size_t)b * T + t) * C + h * HS;
            const size_t query_row = ((size_t)b * NH + h) * T + t;
            float score = 0.0f, dp = 0.0f;
            for (int d = 0; d < HS; d++) {
                score += (float)q[d] * (float)k[d];
                dp += (float)g[d] * (float)k[NKV * HS + d];
            }
            const float p = expf(score * scale - stats[query_row]);
            const float ds = p * (dp - delta[query_row]);
            for (int d = 0; d < HS; d++) {
                dv[d] += p * (float)g[d];
                dk[d] += ds * (float)q[d];
            }
        }
    }
    floatX* dk_row = dinp + ((size_t)b * T + s) * row_stride + (NH + kv) * HS;
    for (int d = 0; d < HS; d++) {
        dk_row[d] = (floatX)(dk[d] * scale);
        dk_row[NKV * HS + d] = (floatX)dv[d];
    }
}

static void flash_backward_untiled(floatX* dinp, float* delta, const floatX* dout, const floatX* inp,
                                   const floatX* out, const float* stats, int B, int T, int NH, int NKV, int C) {
    const int block_size = 64;
    flash_backward_untiled_dq_kernel<<<CEIL_DIV(B * NH * T, block_size), block_size>>>(dinp, delta, dout, inp, out,
                                                                                     stats, B, T, NH, NKV, C / NH);
    cudaCheck(cudaGetLastError());
    flash_backward_untiled_dkv_kernel<<<CEIL_DIV(B * NKV * T, block_size), block_size>>>(dinp, delta, dout, inp, stats,
                                                                                       B, T, NH, NKV, C / NH);
    cudaCheck(cudaGetLastError());
}

// validate = 0: timing only (the larger batches, whose double-precision reference would take minutes of host time;
// every kernel is the same code at B = 8, validated there), out and stats then from the flash forward pass
static void run_size(const LabArgs& args, int B, int T, int C, int NH, int NKV, int validate) {
    const size_t n_inp = (size_t)B * T * (NH + 2 * NKV) * (C / NH), n_att = (size_t)B * NH * T * T;
    const size_t n_out = (size_t)B * T * C;
    const size_t n_stats = (size_t)B * NH * T;
    std::vector<float> inp = lab_random_rounded(n_inp, -1.0f, 1.0f);
    std::vector<float> dout = lab_random_rounded(n_out, -1.0f, 1.0f);
    // the forward pass in double gives what the backward receives: out rounded to floatX as the forward stores it,
    // stats in fp32; the reference gradient is the exact one of q, k, v (att in fp32, 2^-24 relative)
    std::vector<float> qkvr_ref, att_ref, out_ref, stats_ref, dinp_ref;
    floatX* d_inp = lab_to_device<floatX>(inp);
    floatX* d_dout = lab_to_device<floatX>(dout);
    floatX* d_out;
    float* d_stats;
    if (validate) {
        qkvr_ref.resize(n_inp), att_ref.resize(n_att), out_ref.resize(n_out), stats_ref.resize(n_stats);
        dinp_ref.resize(n_inp);
        attention_forward_reference(qkvr_ref, att_ref, out_ref, inp, B, T, C, NH, NKV);
        attention_stats_reference(stats_ref, inp, B, T, C, NH, NKV);
        attention_backward_reference(dinp_ref, dout, qkvr_ref, att_ref, B, T, C, NH, NKV);
        d_out = lab_to_device<floatX>(out_ref);
        d_stats = lab_to_device<float>(stats_ref);
    } else {
        d_out = lab_poisoned<floatX>(n_out);
        d_stats = lab_poisoned<float>(n_stats);
        flash_attention_forward(d_out, d_stats, d_inp, B, T, NH, NKV, C, 0);
    }
    floatX* d_dinp = lab_poisoned<floatX>(n_inp);
    floatX* d_dinp_again = lab_poisoned<floatX>(n_inp);
    float* d_delta = lab_poisoned<float>(n_stats);
    // variant 1's own state: its forward pass's qkvr and att, its backward's scratch
    floatX* d_qkvr = lab_poisoned<floatX>(n_inp);
    floatX* d_att = lab_poisoned<floatX>(n_att);
    floatX* d_out_cublas = lab_poisoned<floatX>(n_out);
    floatX* d_dqkvr = lab_poisoned<floatX>(n_inp);
    floatX* d_datt = lab_poisoned<floatX>(n_att);
    floatX* d_scratch = lab_poisoned<floatX>(n_out);

    // Tolerances of variants 2 and 3. q, k, v, dout and out are exact in floatX and every operation is fp32, so a
    // result errs by its fp32 computation, by the out it is given, and by one rounding to floatX. fp32 sums err like
    // a random walk, sqrt(n) * 2^-24 relative, over HS <= 128 (scores, dp) and T <= 1024 terms (dq, dk, dv), and the
    // stats are rounded to fp32 (|stats| <~ 10: 5e-7 absolute, a relative error of every p): together <~ 5e-6 of
    // results of order 1. out enters only through delta = dout . out: rounded to floatX (half an ulp, 2^-8
    // relative in bf16, 2^-11 in fp16), it moves delta by ~2^-9 * sqrt(HS) * rms(dout) * rms(out) and dq, dk by
    // that times scale * rms(q or k): about 2^-9 * 0.58^3 = 4e-4 in bf16 (scale * sqrt(HS) = 1), 5e-5 in fp16, at
    // one standard deviation; atol is 5 of them (2e-3, 3e-4), and 2e-5 in fp32, where out's rounding is 2^-24.
    // rtol is the final rounding: 2^-8 in bf16 (4e-3), 2^-11 in fp16 (5e-4), and 2e-5 for fp32's sums. A missed
    // tile, a wrong mask or a wrong transpose changes results by p * |q|, p * |dout| >= 1e-3 / T... and by O(0.1)
    // for whole rows. Variant 1 has attention_backward.cu's tolerances (2e-2 in bf16, 2e-5 in fp32; fp16 the bf16
    // argument with 2^-11 for 2^-8, 8 times smaller: 3e-3).
    // Variant 4 also rounds p and ds to floatX (relative 2^-9 in bf16, 2^-12 in fp16) before dv = p^T dout,
    // dq = ds k and dk = ds^T q. Those roundings are independent with random signs, so each gradient errs like a
    // random walk: 2^-9 / sqrt(3) * sqrt(sum of its squared terms), and a gradient of order 1 has terms of order
    // 1 / sqrt(n): about 1e-3 at one standard deviation in bf16; atol 4e-3 (bf16), 5e-4 (fp16: 8 times smaller).
    // Grouped-query attention: dk and dv of a key/value head sum NH / NKV times as many terms of the same size (one
    // set per query head it serves), so their random-walk errors grow by sqrt(NH / NKV), and so does atol (the
    // variant 4 errors at NH=4 NKV=1 grow so: max 1.3e-3 against 6e-4 with NKV = NH in fp16). A query head summed
    // into the wrong key/value head, or left out, moves whole rows by O(0.1): far outside.
    const float group_growth = sqrtf((float)(NH / NKV));
#if defined(ENABLE_FP32)
    const float rtol = 2e-5f, atol = 2e-5f * group_growth, cublas_path_tol = 2e-5f;
#elif defined(ENABLE_FP16)
    const float rtol = 5e-4f, atol = 3e-4f * group_growth, cublas_path_tol = 3e-3f;
#else
    const float rtol = 4e-3f, atol = 2e-3f * group_growth, cublas_path_tol = 2e-2f;
#endif
#if defined(ENABLE_FP16)
    const float tensor_atol = 5e-4f * group_growth;
#else
    const float tensor_atol = 4e-3f * group_growth;
#endif

    char sizes[128];
    snprintf(sizes, sizeof(sizes), "B=%d T=%d C=%d NH=%d NKV=%d %s", B, T, C, NH, NKV, PRECISION_NAME);
    printf("flash_attention_backward: %s\n", sizes);
    if ((args.variant == 0 || args.variant == 1) && flash_lab_variant_takes(1, NH, NKV))
        attention_forward(d_out_cublas, d_qkvr, d_att, d_inp, B, T, C, NH, 0);
    auto run_variant = [&](int variant, floatX* dinp) {
        if (variant == 1) attention_backward(dinp, d_dqkvr, d_datt, d_scratch, d_dout, d_qkvr, d_att, B, T, C, NH, 0);
        if (variant == 2) flash_backward_untiled(dinp, d_delta, d_dout, d_inp, d_out, d_stats, B, T, NH, NKV, C);
        if (variant == 3)
            flash_attention_backward(dinp, d_delta, d_dout, d_inp, d_out, d_stats, B, T, NH, NKV, C, 0,
                                     FLASH_FP32_CORES);
        if (variant == 4)
            flash_attention_backward(dinp, d_delta, d_dout, d_inp, d_out, d_stats, B, T, NH, NKV, C, 0,
                                     FLASH_TENSOR_CORES);
#if defined(ENABLE_CUDNN)
        if (variant == 5) attention_backward_cudnn(dinp, d_dout, d_inp, d_out, d_stats, B, T, NH, C, 0);
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
        cudaCheck(cudaMemset(d_dinp, 0xff, n_inp * sizeof(floatX)));
        cudaCheck(cudaMemset(d_delta, 0xff, n_stats * sizeof(float)));
        run_variant(variant, d_dinp);
        cudaCheck(cudaDeviceSynchronize());
        if (variant == 1 || variant == 5) {  // cuDNN: no documented order or precision inside; the cuBLAS path's bound
            lab_validate("dinp = [dq | dk | dv]", d_dinp, dinp_ref.data(), n_inp, cublas_path_tol, cublas_path_tol);
            continue;
        }
        lab_validate("dinp = [dq | dk | dv]", d_dinp, dinp_ref.data(), n_inp, variant == 4 ? tensor_atol : atol, rtol);
        cudaCheck(cudaMemset(d_dinp_again, 0xff, n_inp * sizeof(floatX)));
        cudaCheck(cudaMemset(d_delta, 0xff, n_stats * sizeof(float)));
        run_variant(variant, d_dinp_again);
        cudaCheck(cudaDeviceSynchronize());
        lab_require_identical("dinp", d_dinp, d_dinp_again, n_inp * sizeof(floatX));
    }

    lab_print_header("flash_attention_backward", sizes);
    const int repeats = args.small ? 3 : (lab_on_cpu_backend() ? 5 : 20);
    const double flops = 5.0 * B * NH * (double)T * T * (C / NH);
    for (int variant = 1; variant <= FLASH_LAB_VARIANTS; variant++) {
        if ((args.variant != 0 && args.variant != variant) || !flash_lab_has_variant(variant)) continue;
        if (!flash_lab_variant_takes(variant, NH, NKV)) continue;
        float ms = lab_time_ms(repeats, [&]() { run_variant(variant, d_dinp); });
        lab_print_row(variant, variant == 1 ? 0 : 64, ms, 0.0, flops);
    }
    for (void* p : {(void*)d_inp, (void*)d_dout, (void*)d_out, (void*)d_stats, (void*)d_dinp, (void*)d_dinp_again,
                    (void*)d_delta, (void*)d_qkvr, (void*)d_att, (void*)d_out_cublas, (void*)d_dqkvr, (void*)d_datt,
                    (void*)d_scratch})
        cudaCheck(cudaFree(p));
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
