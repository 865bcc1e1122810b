// dev/cuda/prefix_attention.cu: kernel lab for attention to P shared keys and values beside causal self-attention
// (llmc/prefix_attention.cuh): prefix tuning's joint softmax and LLaMA-Adapter's gated one, each around flash
// attention (llmc/flash_attention.cuh) as the trainer runs them, forward and backward:
//   forward:  flash_attention_forward(out, stats, qkv), then prefix_attention_forward(joined, stats, out, ...)
//   backward: flash_attention_backward(dqkv, ..., dout, qkv, joint ? joined : out, stats), then
//             prefix_attention_backward(dqkv, dkeys, dvalues, dgate, ...)
// validated against a double-precision loop over the whole attention (the shared keys and the causal ones): joined,
// the joint statistics, dqkv = [dq | dk | dv], the shared keys' and values' gradients and the gate's.
// Build and run (CPU backend; -DENABLE_FP32 for fp32):
//   make build/lab/prefix_attention_bf16   (build/lab/prefix_attention_fp32: the fp32 build)
//   build/lab/prefix_attention_bf16 [variant] [-s]
// Variants: 1 joint (prefix tuning), 2 gated (LLaMA-Adapter).
// Sizes: -s: HS 16 (B=2 T=23 NH=3, P=5, the trainers' test model), HS 64 with grouped-query attention (B=2 T=70 NH=4
// NKV=2, P=8) and HS 128 (B=1 T=40 NH=2 NKV=1, P=3); without -s, B=4 T=256 C=768 NH=12 P=16 validated, then GPT-2
// 124M's B=8 T=1024, timed only. The timing rows are the shared keys' kernels alone (forward; backward), beside flash
// attention's.
// Floor (the shared keys' part): forward 4 B T NH P HS flops, backward 12 B T NH P HS; both read q and write an
// output of B T NH HS floatX, the backward also dout: at GPT-2 124M sizes with P = 16, 3.2 GFLOP forward against
// flash attention's 12.9, and 19 MB moved.
#include "common.h"
#include "../../llmc/flash_attention.cuh"
#include "../../llmc/prefix_attention.cuh"

static const int PREFIX_LAB_VARIANTS = 2;

// The double-precision attention of row (b, t, h) with the shared keys, forward and backward, over the whole inputs:
// q, k, v from qkv (B, T, (NH + 2 NKV) HS), the shared keys kp and values vp (P, NKV HS), gate g (gated) or none.
struct PrefixReference {
    std::vector<float> joined, stats, dqkv, dkeys, dvalues;
    double dgate;
};
static PrefixReference prefix_reference(const std::vector<float>& qkv, const std::vector<float>& kp,
                                        const std::vector<float>& vp, const std::vector<float>& dout, double g,
                                        int gated, int B, int T, int NH, int NKV, int HS, int P) {
    const int row_stride = (NH + 2 * NKV) * HS, C = NH * HS, KVC = NKV * HS;
    const double scale = 1.0 / sqrt((double)HS);
    PrefixReference r;
    r.joined.assign((size_t)B * T * C, 0.0f), r.stats.assign((size_t)B * NH * T, 0.0f);
    r.dqkv.assign(qkv.size(), 0.0f), r.dkeys.assign((size_t)P * KVC, 0.0f), r.dvalues.assign((size_t)P * KVC, 0.0f);
    std::vector<double> dqkv(qkv.size(), 0.0), dkeys((size_t)P * KVC, 0.0), dvalues((size_t)P * KVC, 0.0);
    std::vector<double> s(P + T), p(P + T), dp(P + T), o(HS);
    r.dgate = 0.0;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < NH; h++) {
                const int j = h / (NH / NKV);
                const float* q = &qkv[((size_t)b * T + t) * row_stride + h * HS];
                const float* d_out = &dout[((size_t)b * T + t) * C + h * HS];
                // keys 0..P-1 the shared ones, P..P+t the causal ones
                auto key = [&](int i) {
                    return i < P ? &kp[(size_t)i * KVC + j * HS] : &qkv[((size_t)b * T + i - P) * row_stride + (NH + j) * HS];
                };
                auto value = [&](int i) {
                    return i < P ? &vp[(size_t)i * KVC + j * HS]
                                 : &qkv[((size_t)b * T + i - P) * row_stride + (NH + NKV + j) * HS];
                };
                const int n = P + t + 1;
                for (int i = 0; i < n; i++) {
                    double dot = 0.0;
                    for (int d = 0; d < HS; d++) dot += (double)q[d] * key(i)[d];
                    s[i] = scale * dot;
                }
                // the softmax parts: one over all keys (joint), or one over the shared and one over the causal (gated)
                auto normalise = [&](int from, int to, double* lse) {
                    double top = -INFINITY, sum = 0.0;
                    for (int i = from; i < to; i++) top = fmax(top, s[i]);
                    for (int i = from; i < to; i++) sum += exp(s[i] - top);
                    for (int i = from; i < to; i++) p[i] = exp(s[i] - top) / sum;
                    *lse = top + log(sum);
                };
                double lse, lse_causal;
                if (gated) normalise(0, P, &lse), normalise(P, n, &lse_causal);
                else normalise(0, n, &lse);
                r.stats[((size_t)b * NH + h) * T + t] = (float)(gated ? lse_causal : lse);
                for (int d = 0; d < HS; d++) {
                    double sum = 0.0;
                    for (int i = 0; i < n; i++) sum += (gated && i < P ? g : 1.0) * p[i] * value(i)[d];
                    o[d] = sum;
                    r.joined[((size_t)b * T + t) * C + h * HS + d] = (float)sum;
                }
                // backward: dp = dout' . v (dout' = g dout for the gated part), ds = p (dp - delta) per softmax part
                for (int i = 0; i < n; i++) {
                    double dot = 0.0;
                    for (int d = 0; d < HS; d++) dot += (double)d_out[d] * value(i)[d];
                    dp[i] = (gated && i < P ? g : 1.0) * dot;
                    if (gated && i < P) r.dgate += p[i] * dot;
                }
                double delta_shared = 0.0, delta_causal = 0.0;
                for (int i = 0; i < n; i++) (gated && i < P ? delta_shared : delta_causal) += p[i] * dp[i];
                if (!gated) delta_shared = delta_causal;
                for (int i = 0; i < n; i++) {
                    const double ds = p[i] * (dp[i] - (i < P ? delta_shared : delta_causal));
                    double* dq = &dqkv[((size_t)b * T + t) * row_stride + h * HS];
                    double* dk = i < P ? &dkeys[(size_t)i * KVC + j * HS]
                                       : &dqkv[((size_t)b * T + i - P) * row_stride + (NH + j) * HS];
                    double* dv = i < P ? &dvalues[(size_t)i * KVC + j * HS]
                                       : &dqkv[((size_t)b * T + i - P) * row_stride + (NH + NKV + j) * HS];
                    const double weight = (gated && i < P ? g : 1.0) * p[i];
                    for (int d = 0; d < HS; d++) {
                        dq[d] += scale * ds * key(i)[d];
                        dk[d] += scale * ds * q[d];
                        dv[d] += weight * d_out[d];
                    }
                }
            }
    for (size_t i = 0; i < dqkv.size(); i++) r.dqkv[i] = (float)dqkv[i];
    for (size_t i = 0; i < dkeys.size(); i++) r.dkeys[i] = (float)dkeys[i], r.dvalues[i] = (float)dvalues[i];
    return r;
}

static void run_size(const LabArgs& args, int B, int T, int C, int NH, int NKV, int P, int validate) {
    const int HS = C / NH, KVC = NKV * HS, QKV = (NH + 2 * NKV) * HS;
    const size_t n_qkv = (size_t)B * T * QKV, n_out = (size_t)B * T * C, n_stats = (size_t)B * NH * T;
    const size_t n_keys = (size_t)P * KVC, rows = (size_t)B * T * NH;
    // the shared keys at the causal keys' scale, so that both parts of the joint softmax carry weight
    std::vector<float> qkv = lab_random_rounded(n_qkv, -1.0f, 1.0f), dout = lab_random_rounded(n_out, -1.0f, 1.0f);
    std::vector<float> kp = lab_random_rounded(n_keys, -1.0f, 1.0f), vp = lab_random_rounded(n_keys, -1.0f, 1.0f);
    std::vector<float> gate = lab_random_rounded(1, 0.5f, 1.0f);
    PrefixShape shape = {B, T, NH, NKV, HS, P, KVC};

    floatX* d_qkv = lab_to_device<floatX>(qkv);
    floatX* d_dout = lab_to_device<floatX>(dout);
    floatX* d_keys = lab_to_device<floatX>(kp);
    floatX* d_values = lab_to_device<floatX>(vp);
    floatX* d_gate = lab_to_device<floatX>(gate);
    floatX* d_out = lab_poisoned<floatX>(n_out);
    floatX* d_joined = lab_poisoned<floatX>(n_out);
    float* d_stats = lab_poisoned<float>(n_stats);
    float* d_delta = lab_poisoned<float>(rows);
    floatX* d_dqkv = lab_poisoned<floatX>(n_qkv);
    floatX* d_dkeys = lab_poisoned<floatX>(n_keys);
    floatX* d_dvalues = lab_poisoned<floatX>(n_keys);
    floatX* d_dgate = lab_poisoned<floatX>(1);
    float* d_scratch = lab_poisoned<float>(rows * (2 * P + 1));
    std::vector<unsigned char> first_dqkv(n_qkv * sizeof(floatX));

    // Tolerances: flash attention's (dev/cuda/flash_attention_forward.cu and _backward.cu: the fp32 sums, the final
    // rounding to floatX, and in bf16 and fp16 the tensor-core path's rounded probabilities) with the shared keys as
    // more keys of the same scale: the joined output is one more rounding of a convex combination (rtol the
    // rounding, 2^-8 in bf16), and the shared keys' gradients sum B T NH / NKV rows of terms of order 1 / (P + T)
    // (p times q or dout) in fp32, a random walk of ~sqrt(rows) 2^-24 relative, plus the inputs' roundings (delta
    // from the rounded out: flash attention's 2e-3 argument in bf16). A shared key left out or summed into the
    // wrong head moves a result by p |v| >= 1 / (P + T): far outside.
    const float group_growth = sqrtf((float)(NH / NKV));
#if defined(ENABLE_FP32)
    const float atol = 2e-5f * group_growth, rtol = 2e-5f, keys_atol = 1e-4f;
#elif defined(ENABLE_FP16)
    const float atol = 5e-4f * group_growth, rtol = 5e-4f, keys_atol = 2e-3f;
#else
    const float atol = 4e-3f * group_growth, rtol = 4e-3f, keys_atol = 1.5e-2f;
#endif
    char sizes[160];
    snprintf(sizes, sizeof(sizes), "B=%d T=%d C=%d NH=%d NKV=%d P=%d %s", B, T, C, NH, NKV, P, PRECISION_NAME);
    printf("prefix_attention: %s\n", sizes);
    auto run_variant = [&](int variant, int backward) {
        const floatX* gate_or_none = variant == 2 ? d_gate : nullptr;
        floatX* joined = variant == 2 ? d_joined : d_out;
        flash_attention_forward(d_out, d_stats, d_qkv, B, T, NH, NKV, C, 0);
        prefix_attention_forward(joined, d_stats, d_out, d_qkv, d_keys, d_values, gate_or_none, shape, 0);
        if (!backward) return;
        flash_attention_backward(d_dqkv, d_delta, d_dout, d_qkv, variant == 2 ? d_out : joined, d_stats, B, T, NH, NKV,
                                 C, 0);
        cudaCheck(cudaMemset(d_dgate, 0, sizeof(floatX)));
        prefix_attention_backward(d_dqkv, d_dkeys, d_dvalues, d_dgate, d_scratch, d_scratch + rows * P,
                                  d_scratch + 2 * rows * P, d_dout, d_qkv, joined, d_stats, d_keys, d_values,
                                  gate_or_none, shape, 0, 0);
    };
    for (int variant = 1; validate && variant <= PREFIX_LAB_VARIANTS; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d (%s)\n", variant, variant == 1 ? "joint" : "gated");
        PrefixReference ref = prefix_reference(qkv, kp, vp, dout, gate[0], variant == 2, B, T, NH, NKV, HS, P);
        for (int pass = 0; pass < 2; pass++) {  // the second pass must reproduce the first's bits
            cudaCheck(cudaMemset(d_out, 0xff, n_out * sizeof(floatX)));
            cudaCheck(cudaMemset(d_joined, 0xff, n_out * sizeof(floatX)));
            cudaCheck(cudaMemset(d_dqkv, 0xff, n_qkv * sizeof(floatX)));
            cudaCheck(cudaMemset(d_dkeys, 0xff, n_keys * sizeof(floatX)));
            cudaCheck(cudaMemset(d_dvalues, 0xff, n_keys * sizeof(floatX)));
            run_variant(variant, 1);
            cudaCheck(cudaDeviceSynchronize());
            if (pass == 1) {
                std::vector<unsigned char> again(n_qkv * sizeof(floatX));
                cudaCheck(cudaMemcpy(again.data(), d_dqkv, again.size(), cudaMemcpyDeviceToHost));
                if (memcmp(again.data(), first_dqkv.data(), again.size()) != 0) {
                    printf("FAIL dqkv: a second run differs\n");
                    exit(EXIT_FAILURE);
                }
                printf("  dqkv again                   ok (bit-identical)\n");
                continue;
            }
            cudaCheck(cudaMemcpy(first_dqkv.data(), d_dqkv, first_dqkv.size(), cudaMemcpyDeviceToHost));
            lab_validate("joined", variant == 2 ? d_joined : d_out, ref.joined.data(), n_out, atol, rtol);
            if (variant == 1) lab_validate("stats", d_stats, ref.stats.data(), n_stats, atol, rtol);
            lab_validate("dqkv = [dq | dk | dv]", d_dqkv, ref.dqkv.data(), n_qkv, atol, rtol);
            lab_validate("dkeys", d_dkeys, ref.dkeys.data(), n_keys, keys_atol, rtol);
            lab_validate("dvalues", d_dvalues, ref.dvalues.data(), n_keys, keys_atol, rtol);
            if (variant == 2) {
                float want = (float)ref.dgate;
                lab_validate("dgate", d_dgate, &want, 1, keys_atol * sqrtf((float)P), rtol);
            }
        }
    }
    lab_print_header("prefix_attention", sizes);
    const int repeats = args.small ? 3 : (lab_on_cpu_backend() ? 5 : 20);
    const double bytes = 3.0 * n_out * sizeof(floatX), flops = 4.0 * rows * P * HS;
    for (int variant = 1; variant <= PREFIX_LAB_VARIANTS; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        float forward_ms = lab_time_ms(repeats, [&]() { run_variant(variant, 0); });
        float flash_ms = lab_time_ms(repeats, [&]() { flash_attention_forward(d_out, d_stats, d_qkv, B, T, NH, NKV, C, 0); });
        printf("  forward: flash attention %.3f ms, with the shared keys %.3f ms\n", flash_ms, forward_ms);
        lab_print_row(variant, 32 * PREFIX_WARPS, forward_ms - flash_ms, bytes, flops);
    }
    void* buffers[] = {d_qkv,  d_dout,  d_keys,  d_values, d_gate,    d_out,   d_joined,
                       d_stats, d_delta, d_dqkv, d_dkeys,  d_dvalues, d_dgate, d_scratch};
    for (void* b : buffers) cudaCheck(cudaFree(b));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    cudaCheck(cudaSetDevice(0));
    if (args.small) {
        run_size(args, 2, 23, 48, 3, 3, 5, 1);
        run_size(args, 2, 70, 256, 4, 2, 8, 1);
        run_size(args, 1, 40, 256, 2, 1, 3, 1);
    } else {
        run_size(args, 4, 256, 768, 12, 12, 16, 1);
        run_size(args, 8, 1024, 768, 12, 12, 16, 0);
    }
    return 0;
}
