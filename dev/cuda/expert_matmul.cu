// dev/cuda/expert_matmul.cu: kernel lab for the MoE layer's GEMMs in llmc/expert_matmul.cuh and
// llmc/router_matmul.cuh: the expert FFN as one
// batched cuBLASLt call over E experts (matmul_forward_batched, matmul_backward_batched) or, dropless, as one
// grouped cuBLAS GEMM over the experts' unequal row ranges (matmul_forward_grouped, matmul_backward_grouped), and
// the router's GEMM with fp32 logits (matmul_forward_fp32_output, matmul_backward_fp32_dout).
// Build and run (CPU backend; -DENABLE_FP32 for fp32):
//   make build/lab/expert_matmul_bf16   (build/lab/expert_matmul_fp32: the fp32 build)
//   build/lab/expert_matmul_bf16 [variant] [-s]
// GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/expert_matmul.cu -lcublas -lcublasLt
// Variants (each validated, then timed):
//   1  matmul_forward_batched: out[e] = gelu(inp[e] @ weight[e]^T + bias[e]) with pre_gelu kept (GELU_AUX_BIAS
//      epilogue, gelu_fusion 1), the unfused GELU (gelu_fusion 0), the plain batched Linear with and without bias
//   2  matmul_backward_batched: dinp (with the GELU backward unfused, fused into DGELU, and without GELU),
//      dweight +=, dbias += (deterministic)
//   3  matmul_forward_fp32_output: router logits (N, E) fp32
//   4  matmul_backward_fp32_dout: router dinp +=, dweight += from fp32 d_logits
//   5  matmul_forward_grouped: dropless experts' rows packed in one buffer, cublasGemmGroupedBatchedEx, then bias and
//      GELU in one pass (gelu_fusion >= 1) or the GELU in its own (0); with and without bias and GELU; and more calls
//      in a row than the pinned staging ring of their pointer arrays has slots
//   6  matmul_backward_grouped: dinp (with the GELU backward, always its own pass, and without GELU),
//      dweight +=, dbias += (deterministic; also left alone when not asked for)
// Sizes: E=8 experts, capacity 1280 rows, C=768, OC=3072 (GPT-2 124M c_fc per expert; the router sees
// N = E * capacity tokens and OC = E); -s: E=4, capacity 9, C=48, OC=96.
// In every expert the last rows are padding (all-zero inp and dout, as dispatch leaves them), and the last
// expert received no token at all: its dweight and dbias must come back bit-identical to their start.
// Grouped sizes: 8 experts with rows {1298, 1, 1130, 0, 1517, 877, 1024, 2345} (total 8192, ~1024 each), the same
// C and OC; -s: 5 experts with rows {7, 0, 1, 70, 4}. The empty expert's dweight and dbias must come back
// bit-identical, and every row of the outputs is validated (they start poisoned).
// Floor: 2 * E*cap * C * OC flops per forward, twice that per backward (compute-bound), 2 * total * C * OC for the
// grouped ones; the router: 2 * N * C * E flops, but memory-bound at E = 8: (N*C + E*C) * sizeof(floatX) + N*E*4
// bytes.
#include "common.h"
#include "../../llmc/expert_matmul.cuh"
#include "../../llmc/router_matmul.cuh"

// zero rows [used, rows) of every expert's (rows, width) block, and every row of the last expert
static void zero_padding(std::vector<float>& v, int E, int rows, int used, int width) {
    for (int e = 0; e < E; e++)
        for (int r = (e == E - 1 ? 0 : used); r < rows; r++)
            for (int c = 0; c < width; c++) v[((size_t)e * rows + r) * width + c] = 0.0f;
}

// ----------------------------------------------------------------------------------------------------
// CPU references in double, one Linear per expert e < E: inp (E, rows, C), weight (E, OC, C), bias (E, OC). The
// grouped variants call them once per group, with E = 1 and pointers to the group's rows and weights.
static void forward_ref(float* pre, float* out, const float* inp, const float* weight, const float* bias, int E,
                        int rows, int C, int OC) {
    for (int e = 0; e < E; e++)
        for (int r = 0; r < rows; r++)
            for (int o = 0; o < OC; o++) {
                double sum = bias != nullptr ? bias[(size_t)e * OC + o] : 0.0;
                const float* x = &inp[((size_t)e * rows + r) * C];
                const float* w = &weight[((size_t)e * OC + o) * C];
                for (int c = 0; c < C; c++) sum += (double)x[c] * w[c];
                pre[((size_t)e * rows + r) * OC + o] = (float)sum;
                out[((size_t)e * rows + r) * OC + o] = (float)gelu_reference(sum);
            }
}

// dinp (E, rows, C) = dout @ weight [* gelu'(pre_gelu)] (+ dinp_start when given); dweight = start + dout^T @ inp;
// dbias = start + column sums of dout; dweight and dbias nullptr: dinp alone. Every sum adds its terms in row (or OC)
// order; the loops run along rows of the operands so that GPT-2-sized references take seconds, not minutes.
static void backward_ref(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                         const float* weight, const float* pre_gelu, const float* dinp_start, int E, int rows, int C,
                         int OC) {
    std::vector<double> acc((size_t)OC * C);
    for (int e = 0; e < E; e++) {
        const float* d = &dout[(size_t)e * rows * OC];
        const float* x = &inp[(size_t)e * rows * C];
        const float* w = &weight[(size_t)e * OC * C];
        for (int r = 0; r < rows; r++) {
            for (int c = 0; c < C; c++) acc[c] = 0.0;
            for (int o = 0; o < OC; o++) {
                const double dd = d[(size_t)r * OC + o];
                for (int c = 0; c < C; c++) acc[c] += dd * w[(size_t)o * C + c];
            }
            for (int c = 0; c < C; c++) {
                const size_t i = ((size_t)e * rows + r) * C + c;
                double sum = acc[c];
                if (pre_gelu != nullptr) sum *= gelu_grad_reference(pre_gelu[i]);
                if (dinp_start != nullptr) sum += dinp_start[i];
                dinp[i] = (float)sum;
            }
        }
        if (dweight == nullptr) continue;
        for (int o = 0; o < OC; o++) {
            double bias_sum = dbias[(size_t)e * OC + o];
            for (int r = 0; r < rows; r++) bias_sum += d[(size_t)r * OC + o];
            dbias[(size_t)e * OC + o] = (float)bias_sum;
        }
        float* dw = &dweight[(size_t)e * OC * C];
        for (size_t i = 0; i < (size_t)OC * C; i++) acc[i] = dw[i];
        for (int r = 0; r < rows; r++)
            for (int o = 0; o < OC; o++) {
                const double dd = d[(size_t)r * OC + o];
                for (int c = 0; c < C; c++) acc[(size_t)o * C + c] += dd * x[(size_t)r * C + c];
            }
        for (size_t i = 0; i < (size_t)OC * C; i++) dw[i] = (float)acc[i];
    }
}

template <class T>
static void upload(T* device, const std::vector<float>& host) {
    std::vector<T> t(host.size());
    for (size_t i = 0; i < host.size(); i++) t[i] = (T)host[i];
    cudaCheck(cudaMemcpy(device, t.data(), t.size() * sizeof(T), cudaMemcpyHostToDevice));
}

static void poison(void* device, size_t bytes) { cudaCheck(cudaMemset(device, 0xff, bytes)); }

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    const int E = args.small ? 4 : 8, rows = args.small ? 9 : 1280, C = args.small ? 48 : 768, OC = args.small ? 96 : 3072;
    const int used = rows - (args.small ? 2 : 256);  // rows filled by tokens; the rest of each expert is padding
    const int N = E * rows;                          // router tokens
    const size_t n_inp = (size_t)E * rows * C, n_out = (size_t)E * rows * OC, n_w = (size_t)E * OC * C;
    cublas_setup();

    // weights ~ 1/sqrt(fan-in) so that pre-activations and input gradients are O(1)
    std::vector<float> inp = lab_random_rounded(n_inp, -1.0f, 1.0f);
    zero_padding(inp, E, rows, used, C);
    std::vector<float> weight = lab_random_rounded(n_w, -1.0f / sqrtf((float)C), 1.0f / sqrtf((float)C));
    std::vector<float> bias = lab_random_rounded((size_t)E * OC, -0.5f, 0.5f);
    std::vector<float> dout = lab_random_rounded(n_out, -1.0f, 1.0f);
    zero_padding(dout, E, rows, used, OC);
    std::vector<float> pre_gelu_in = lab_random_rounded(n_inp, -2.0f, 2.0f);  // the backward's GELU input, (E, rows, C)
    std::vector<float> dweight_start = lab_random_rounded(n_w, -1.0f, 1.0f);
    std::vector<float> dbias_start = lab_random_rounded((size_t)E * OC, -1.0f, 1.0f);
    // router: weight (E, C), d_logits (N, E) fp32 (not rounded: the function rounds it), dinp starts random
    std::vector<float> router_w = lab_random_rounded((size_t)E * C, -1.0f / sqrtf((float)C), 1.0f / sqrtf((float)C));
    std::vector<float> dlogits = lab_random((size_t)N * E, -1.0f, 1.0f);
    std::vector<float> dlogits_rounded(dlogits.size());
    for (size_t i = 0; i < dlogits.size(); i++) dlogits_rounded[i] = (float)(floatX)dlogits[i];
    std::vector<float> router_dinp_start = lab_random_rounded((size_t)N * C, -1.0f, 1.0f);
    std::vector<float> router_dw_start = lab_random_rounded((size_t)E * C, -1.0f, 1.0f);

    // Grouped (dropless): G experts with unequal rows packed into one (total, C) buffer, one expert with 0 rows and
    // one with 1; in -s the 70-row expert spans several row blocks of the bias gradient, the others fewer.
    const std::vector<int> group_rows = args.small ? std::vector<int>{7, 0, 1, 70, 4}
                                                   : std::vector<int>{1298, 1, 1130, 0, 1517, 877, 1024, 2345};
    const int G = (int)group_rows.size();
    std::vector<size_t> group_start(G + 1, 0);
    for (int g = 0; g < G; g++) group_start[g + 1] = group_start[g] + group_rows[g];
    const int total = (int)group_start[G];
    const size_t ng_inp = (size_t)total * C, ng_out = (size_t)total * OC, ng_w = (size_t)G * OC * C;
    std::vector<float> g_inp = lab_random_rounded(ng_inp, -1.0f, 1.0f);
    std::vector<float> g_weight = lab_random_rounded(ng_w, -1.0f / sqrtf((float)C), 1.0f / sqrtf((float)C));
    std::vector<float> g_bias = lab_random_rounded((size_t)G * OC, -0.5f, 0.5f);
    std::vector<float> g_dout = lab_random_rounded(ng_out, -1.0f, 1.0f);
    std::vector<float> g_pre_gelu_in = lab_random_rounded(ng_inp, -2.0f, 2.0f);
    std::vector<float> g_dweight_start = lab_random_rounded(ng_w, -1.0f, 1.0f);
    std::vector<float> g_dbias_start = lab_random_rounded((size_t)G * OC, -1.0f, 1.0f);

    floatX* d_inp = lab_to_device<floatX>(inp);
    floatX* d_weight = lab_to_device<floatX>(weight);
    floatX* d_bias = lab_to_device<floatX>(bias);
    floatX* d_dout = lab_to_device<floatX>(dout);
    floatX* d_pre_in = lab_to_device<floatX>(pre_gelu_in);
    floatX* d_out = lab_poisoned<floatX>(n_out);
    floatX* d_pre = lab_poisoned<floatX>(n_out);
    floatX* d_dinp = lab_poisoned<floatX>(n_inp);
    floatX* d_dweight = lab_poisoned<floatX>(n_w);
    floatX* d_dbias = lab_poisoned<floatX>((size_t)E * OC);
    float* d_dbias_buffer = lab_poisoned<float>(matmul_batched_dbias_buffer_floats(E, OC));
    floatX* d_router_w = lab_to_device<floatX>(router_w);
    float* d_logits = lab_poisoned<float>((size_t)N * E);
    float* d_dlogits = lab_to_device<float>(dlogits);
    floatX* d_dlogits_scratch = lab_poisoned<floatX>((size_t)N * E);
    floatX* d_router_dinp = lab_poisoned<floatX>((size_t)N * C);
    floatX* d_router_dw = lab_poisoned<floatX>((size_t)E * C);
    floatX* dg_inp = lab_to_device<floatX>(g_inp);
    floatX* dg_weight = lab_to_device<floatX>(g_weight);
    floatX* dg_bias = lab_to_device<floatX>(g_bias);
    floatX* dg_dout = lab_to_device<floatX>(g_dout);
    floatX* dg_pre_in = lab_to_device<floatX>(g_pre_gelu_in);
    floatX* dg_out = lab_poisoned<floatX>(ng_out);
    floatX* dg_pre = lab_poisoned<floatX>(ng_out);
    floatX* dg_dinp = lab_poisoned<floatX>(ng_inp);
    floatX* dg_dweight = lab_poisoned<floatX>(ng_w);
    floatX* dg_dbias = lab_poisoned<floatX>((size_t)G * OC);
    float* dg_dbias_buffer = lab_poisoned<float>(matmul_grouped_dbias_buffer_floats(G, OC));

    // Tolerances (|got - want| <= atol + rtol |want|). fp32: fp32 accumulation of <= 3072 products errs by
    // ~sqrt(K) * 2^-24 * sum|terms| ~ 1e-5 at these sizes; forward outputs get 1e-5, gradients (sums up to 1280
    // or 3072 terms added to O(1) start values) 1e-4; GELU outputs 5e-4 (the GPU's --use_fast_math tanh and
    // cuBLASLt's epilogue err by ~2^-11 relative). bf16: inputs are exact in bf16, so the error is the result's
    // rounding (half an ulp, 2^-9) plus, when the GELU is a separate kernel, the rounding of its input (slope
    // <= 1.13): 1e-2 relative with 1e-2 absolute for results near zero. The router's fp32 logits are not
    // rounded at all: 1e-5 in both builds (bf16 products are exact in fp32, only the fp32 sum errs).
    // Padding: an expert with no tokens must leave dweight and dbias exactly as they were (tolerance 0).
    // Grouped: the bias is added after the GEMM's output was rounded to floatX, so a bf16 pre-activation is rounded
    // twice (2^-9 |acc| + 2^-9 |acc + bias|, < 5e-3 here): inside the same 1e-2; in fp32 both roundings are 2^-24.
#if defined(ENABLE_FP32)
    const float tol_linear = 1e-5f, tol_gelu = 5e-4f, tol_grad = 1e-4f;
#else
    const float tol_linear = 1e-2f, tol_gelu = 1e-2f, tol_grad = 1e-2f;
#endif
    const float tol_logits = 1e-5f;
    char sizes[160];
    snprintf(sizes, sizeof(sizes), "E=%d capacity=%d (%d used) C=%d OC=%d, router N=%d %s", E, rows, used, C, OC, N,
             PRECISION_NAME);
    printf("expert_matmul: %s\n", sizes);
    printf("grouped: %d experts, rows {", G);
    for (int g = 0; g < G; g++) printf("%s%d", g ? ", " : "", group_rows[g]);
    printf("} (total %d)\n", total);

    if (args.variant == 0 || args.variant == 1) {
        printf("variant 1: matmul_forward_batched\n");
        std::vector<float> pre_ref(n_out), out_ref(n_out), plain_ref(n_out), unused(n_out);
        forward_ref(pre_ref.data(), out_ref.data(), inp.data(), weight.data(), bias.data(), E, rows, C, OC);
        for (int fusion = 1; fusion >= 0; fusion--) {
            poison(d_out, n_out * sizeof(floatX));
            poison(d_pre, n_out * sizeof(floatX));
            matmul_forward_batched(d_out, d_inp, d_weight, d_bias, E, rows, C, OC, 0, d_pre, fusion);
            cudaCheck(cudaDeviceSynchronize());
            printf(" gelu_fusion %d\n", fusion);
            lab_validate("pre_gelu", d_pre, pre_ref.data(), n_out, tol_linear, tol_linear);
            lab_validate("out = gelu(pre_gelu)", d_out, out_ref.data(), n_out, tol_gelu, tol_gelu);
        }
        poison(d_out, n_out * sizeof(floatX));
        matmul_forward_batched(d_out, d_inp, d_weight, d_bias, E, rows, C, OC, 0);
        cudaCheck(cudaDeviceSynchronize());
        lab_validate("out (bias, no gelu)", d_out, pre_ref.data(), n_out, tol_linear, tol_linear);
        forward_ref(plain_ref.data(), unused.data(), inp.data(), weight.data(), nullptr, E, rows, C, OC);
        poison(d_out, n_out * sizeof(floatX));
        matmul_forward_batched(d_out, d_inp, d_weight, nullptr, E, rows, C, OC, 0);
        cudaCheck(cudaDeviceSynchronize());
        lab_validate("out (no bias, no gelu)", d_out, plain_ref.data(), n_out, tol_linear, tol_linear);
    }

    if (args.variant == 0 || args.variant == 2) {
        printf("variant 2: matmul_backward_batched\n");
        std::vector<float> dinp_gelu_ref(n_inp), dinp_plain_ref(n_inp);
        std::vector<float> dweight_ref = dweight_start, dbias_ref = dbias_start;
        backward_ref(dinp_gelu_ref.data(), dweight_ref.data(), dbias_ref.data(), dout.data(), inp.data(), weight.data(),
                     pre_gelu_in.data(), nullptr, E, rows, C, OC);
        backward_ref(dinp_plain_ref.data(), nullptr, nullptr, dout.data(), inp.data(), weight.data(), nullptr, nullptr,
                     E, rows, C, OC);
        // fusion 2: DGELU epilogue; 1: the GELU backward kernel; 0 here means no GELU at all
        for (int fusion = 2; fusion >= 0; fusion--) {
            poison(d_dinp, n_inp * sizeof(floatX));
            poison(d_dbias_buffer, matmul_batched_dbias_buffer_floats(E, OC) * sizeof(float));
            upload(d_dweight, dweight_start);
            upload(d_dbias, dbias_start);
            matmul_backward_batched(d_dinp, d_dweight, d_dbias, d_dout, d_inp, d_weight, d_dbias_buffer, E, rows, C, OC,
                                    0, fusion > 0 ? d_pre_in : nullptr, fusion);
            cudaCheck(cudaDeviceSynchronize());
            printf(" %s\n", fusion == 2 ? "GELU fused (DGELU)" : fusion == 1 ? "GELU unfused" : "no GELU");
            lab_validate("dinp", d_dinp, fusion > 0 ? dinp_gelu_ref.data() : dinp_plain_ref.data(), n_inp, tol_grad,
                         tol_grad);
            lab_validate("dweight (accumulated)", d_dweight, dweight_ref.data(), n_w, tol_grad, tol_grad);
            lab_validate("dbias (accumulated)", d_dbias, dbias_ref.data(), (size_t)E * OC, tol_grad, tol_grad);
            lab_validate("dweight of empty expert", d_dweight + (size_t)(E - 1) * OC * C,
                         &dweight_start[(size_t)(E - 1) * OC * C], (size_t)OC * C, 0.0f, 0.0f);
            lab_validate("dbias of empty expert", d_dbias + (size_t)(E - 1) * OC, &dbias_start[(size_t)(E - 1) * OC],
                         OC, 0.0f, 0.0f);
        }
    }

    if (args.variant == 0 || args.variant == 3) {
        printf("variant 3: matmul_forward_fp32_output (router)\n");
        std::vector<float> logits_ref((size_t)N * E), unused((size_t)N * E);
        forward_ref(logits_ref.data(), unused.data(), inp.data(), router_w.data(), nullptr, 1, N, C, E);
        poison(d_logits, (size_t)N * E * sizeof(float));
        matmul_forward_fp32_output(d_logits, d_inp, d_router_w, N, C, E, 0);
        cudaCheck(cudaDeviceSynchronize());
        lab_validate("logits (fp32)", d_logits, logits_ref.data(), (size_t)N * E, tol_logits, tol_logits);
    }

    if (args.variant == 0 || args.variant == 4) {
        printf("variant 4: matmul_backward_fp32_dout (router)\n");
        std::vector<float> dinp_ref((size_t)N * C), dw_ref = router_dw_start, dbias_unused((size_t)E, 0.0f);
        // the function rounds d_logits to floatX first (documented), so the reference uses the rounded values
        backward_ref(dinp_ref.data(), dw_ref.data(), dbias_unused.data(), dlogits_rounded.data(), inp.data(),
                     router_w.data(), nullptr, router_dinp_start.data(), 1, N, C, E);
        poison(d_dlogits_scratch, (size_t)N * E * sizeof(floatX));
        upload(d_router_dinp, router_dinp_start);
        upload(d_router_dw, router_dw_start);
        matmul_backward_fp32_dout(d_router_dinp, d_router_dw, d_dlogits, d_inp, d_router_w, d_dlogits_scratch, N, C, E,
                                  0);
        cudaCheck(cudaDeviceSynchronize());
        lab_validate("dinp (accumulated)", d_router_dinp, dinp_ref.data(), (size_t)N * C, tol_grad, tol_grad);
        lab_validate("dweight (accumulated)", d_router_dw, dw_ref.data(), (size_t)E * C, tol_grad, tol_grad);
    }

    if (args.variant == 0 || args.variant == 5) {
        printf("variant 5: matmul_forward_grouped\n");
        std::vector<float> pre_ref(ng_out), out_ref(ng_out), plain_pre_ref(ng_out), plain_out_ref(ng_out);
        for (int g = 0; g < G; g++) {
            const size_t r0 = group_start[g];
            const float* w = g_weight.data() + (size_t)g * OC * C;
            forward_ref(pre_ref.data() + r0 * OC, out_ref.data() + r0 * OC, g_inp.data() + r0 * C, w,
                        g_bias.data() + (size_t)g * OC, 1, group_rows[g], C, OC);
            forward_ref(plain_pre_ref.data() + r0 * OC, plain_out_ref.data() + r0 * OC, g_inp.data() + r0 * C, w,
                        nullptr, 1, group_rows[g], C, OC);
        }
        // every gelu_fusion level with GELU (0: the GELU in its own pass; 1 and 2: with the bias in one pass)
        const struct { bool bias, gelu; int fusion; } cases[] = {{true, true, 2},  {true, true, 1},  {true, true, 0},
                                                                 {false, true, 1}, {false, true, 0}, {true, false, 1},
                                                                 {false, false, 1}};
        for (const auto& c : cases) {
            poison(dg_out, ng_out * sizeof(floatX));
            poison(dg_pre, ng_out * sizeof(floatX));
            matmul_forward_grouped(dg_out, dg_inp, dg_weight, c.bias ? dg_bias : nullptr, G, group_rows.data(), C, OC,
                                   0, c.gelu ? dg_pre : nullptr, c.fusion);
            cudaCheck(cudaDeviceSynchronize());
            printf(" %s, %s", c.bias ? "bias" : "no bias", c.gelu ? "gelu" : "no gelu");
            if (c.gelu) printf(", gelu_fusion %d", c.fusion);
            printf("\n");
            const std::vector<float>& want_pre = c.bias ? pre_ref : plain_pre_ref;
            if (c.gelu) {
                lab_validate("pre_gelu", dg_pre, want_pre.data(), ng_out, tol_linear, tol_linear);
                lab_validate("out = gelu(pre_gelu)", dg_out, (c.bias ? out_ref : plain_out_ref).data(), ng_out,
                             tol_gelu, tol_gelu);
            } else {
                lab_validate("out", dg_out, want_pre.data(), ng_out, tol_linear, tol_linear);
            }
        }
        // the pinned staging ring of the pointer arrays wraps: CUBLAS_GROUPED_STAGING_SLOTS + 1 calls with no host
        // synchronisation between them, all but the last writing into dg_pre, the last into dg_out; a call that read
        // another's pointers would leave dg_out poisoned, and a slot rewritten before its copy has read it is what
        // the checking build (cpu/cucc --check) reports
        poison(dg_out, ng_out * sizeof(floatX));
        for (int i = 0; i <= CUBLAS_GROUPED_STAGING_SLOTS; i++)
            matmul_forward_grouped(i < CUBLAS_GROUPED_STAGING_SLOTS ? dg_pre : dg_out, dg_inp, dg_weight, dg_bias, G,
                                   group_rows.data(), C, OC, 0);
        cudaCheck(cudaDeviceSynchronize());
        printf(" bias, no gelu, %d calls in a row (the staging ring wraps)\n", CUBLAS_GROUPED_STAGING_SLOTS + 1);
        lab_validate("out", dg_out, pre_ref.data(), ng_out, tol_linear, tol_linear);
    }

    if (args.variant == 0 || args.variant == 6) {
        printf("variant 6: matmul_backward_grouped\n");
        std::vector<float> dinp_gelu_ref(ng_inp), dinp_plain_ref(ng_inp);
        std::vector<float> dweight_ref = g_dweight_start, dbias_ref = g_dbias_start;
        for (int g = 0; g < G; g++) {
            const size_t r0 = group_start[g];
            const float* w = g_weight.data() + (size_t)g * OC * C;
            backward_ref(dinp_gelu_ref.data() + r0 * C, dweight_ref.data() + (size_t)g * OC * C,
                         dbias_ref.data() + (size_t)g * OC, g_dout.data() + r0 * OC, g_inp.data() + r0 * C, w,
                         g_pre_gelu_in.data() + r0 * C, nullptr, 1, group_rows[g], C, OC);
            backward_ref(dinp_plain_ref.data() + r0 * C, nullptr, nullptr, g_dout.data() + r0 * OC,
                         g_inp.data() + r0 * C, w, nullptr, nullptr, 1, group_rows[g], C, OC);
        }
        // with GELU (its backward is always a separate pass), then without, with and without dbias
        const struct { bool gelu, dbias; } cases[] = {{true, true}, {false, true}, {false, false}};
        for (const auto& c : cases) {
            poison(dg_dinp, ng_inp * sizeof(floatX));
            poison(dg_dbias_buffer, matmul_grouped_dbias_buffer_floats(G, OC) * sizeof(float));
            upload(dg_dweight, g_dweight_start);
            upload(dg_dbias, g_dbias_start);
            matmul_backward_grouped(dg_dinp, dg_dweight, c.dbias ? dg_dbias : nullptr, dg_dout, dg_inp, dg_weight,
                                    dg_dbias_buffer, G, group_rows.data(), C, OC, 0, c.gelu ? dg_pre_in : nullptr);
            cudaCheck(cudaDeviceSynchronize());
            printf(" %s, %s", c.gelu ? "gelu" : "no gelu", c.dbias ? "dbias" : "no dbias");
            printf("\n");
            lab_validate("dinp", dg_dinp, (c.gelu ? dinp_gelu_ref : dinp_plain_ref).data(), ng_inp, tol_grad, tol_grad);
            lab_validate("dweight (accumulated)", dg_dweight, dweight_ref.data(), ng_w, tol_grad, tol_grad);
            if (c.dbias) lab_validate("dbias (accumulated)", dg_dbias, dbias_ref.data(), (size_t)G * OC, tol_grad, tol_grad);
            else lab_validate("dbias (not asked for)", dg_dbias, g_dbias_start.data(), (size_t)G * OC, 0.0f, 0.0f);
            for (int g = 0; g < G; g++) {
                if (group_rows[g] != 0) continue;
                lab_validate("dweight of empty expert", dg_dweight + (size_t)g * OC * C,
                             g_dweight_start.data() + (size_t)g * OC * C, (size_t)OC * C, 0.0f, 0.0f);
                lab_validate("dbias of empty expert", dg_dbias + (size_t)g * OC, g_dbias_start.data() + (size_t)g * OC,
                             OC, 0.0f, 0.0f);
            }
        }
    }

    lab_print_header("expert_matmul", sizes);
    const int repeats = args.small ? 3 : 20;
    const double expert_flops = 2.0 * E * rows * C * OC, router_flops = 2.0 * N * C * E;
    const double grouped_flops = 2.0 * total * C * OC;
    for (int variant = 1; variant <= 6; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        float ms = lab_time_ms(repeats, [&]() {
            if (variant == 1) matmul_forward_batched(d_out, d_inp, d_weight, d_bias, E, rows, C, OC, 0, d_pre, 1);
            if (variant == 2)
                matmul_backward_batched(d_dinp, d_dweight, d_dbias, d_dout, d_inp, d_weight, d_dbias_buffer, E, rows, C,
                                        OC, 0, d_pre_in, 2);
            if (variant == 3) matmul_forward_fp32_output(d_logits, d_inp, d_router_w, N, C, E, 0);
            if (variant == 4)
                matmul_backward_fp32_dout(d_router_dinp, d_router_dw, d_dlogits, d_inp, d_router_w, d_dlogits_scratch,
                                          N, C, E, 0);
            if (variant == 5)
                matmul_forward_grouped(dg_out, dg_inp, dg_weight, dg_bias, G, group_rows.data(), C, OC, 0, dg_pre, 1);
            if (variant == 6)
                matmul_backward_grouped(dg_dinp, dg_dweight, dg_dbias, dg_dout, dg_inp, dg_weight, dg_dbias_buffer, G,
                                        group_rows.data(), C, OC, 0, dg_pre_in);
        });
        const double flops = variant == 1 ? expert_flops : variant == 2 ? 2.0 * expert_flops
                           : variant == 3 ? router_flops : variant == 4 ? 2.0 * router_flops
                           : variant == 5 ? grouped_flops : 2.0 * grouped_flops;
        lab_print_row(variant, 0, ms, 0.0, flops);
    }

    floatX* device_buffers[] = {d_inp, d_weight, d_bias, d_dout, d_pre_in, d_out, d_pre, d_dinp, d_dweight, d_dbias,
                                d_router_w, d_dlogits_scratch, d_router_dinp, d_router_dw, dg_inp, dg_weight, dg_bias,
                                dg_dout, dg_pre_in, dg_out, dg_pre, dg_dinp, dg_dweight, dg_dbias};
    for (floatX* p : device_buffers) cudaCheck(cudaFree(p));
    cudaCheck(cudaFree(d_dbias_buffer));
    cudaCheck(cudaFree(dg_dbias_buffer));
    cudaCheck(cudaFree(d_logits));
    cudaCheck(cudaFree(d_dlogits));
    cublas_teardown();
    return 0;
}
