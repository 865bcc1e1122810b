// dev/cuda/attention_backward.cu: kernel lab for causal multi-head attention backward, the hand-written path:
// dout (B, T, C), the kept qkvr (q, k, v in heads) and att (B, NH, T, T) -> dinp (B, T, 3C) = [dq | dk | dv].
// Build and run (CPU backend; -DENABLE_FP32 for fp32):
//   make build/lab/attention_backward_bf16   (build/lab/attention_backward_fp32: the fp32 build)
//   build/lab/attention_backward_bf16 [variant] [-s]
// Variants:
//   1  llmc/attention.cuh attention_backward (THE TRAINER'S): dout permuted into heads (scratch), datt = dout v^T,
//      dv = att^T dout, the causal softmax backward in place on datt (with the 1/sqrt(HS) scale), dq = datt k,
//      dk = datt^T q, each one strided-batched GEMM over B*NH into dqkvr, then permuted back into dinp.
//   2  no permutes: the GEMMs read dout and write dq, dk, dv straight in the packed layouts (leading dimensions
//      C and 3C, head stride HS), one batched call per batch row; the same softmax backward.
// Sizes: B=8 T=1024 C=768 NH=12 (GPT-2 124M); -s: B=3 C=96 NH=3 (HS=32) at T=37 and T=48 (the softmax
// backward's element and vector paths).
// Floor: flops 4 GEMMs of 2 * B*NH*T*T*HS = 8 * B*T*T*C; bytes dominated by the T^2 tensors: att read by
// two GEMMs and the softmax, datt written, read and rewritten by the softmax, read by two GEMMs:
// ~ 8 * B*NH*T*T * sizeof(floatX), plus O(B*T*C) for dout, qkvr, dqkvr and dinp.
#include "common.h"
#include "../../llmc/attention.cuh"
#include "attention_reference.h"

static void attention_backward_no_permute(floatX* dinp, floatX* datt, const floatX* dout, const floatX* qkvr,
                                          const floatX* att, int B, int T, int C, int NH) {
    const int HS = C / NH;
    const size_t head = (size_t)T * HS;
    const size_t head_att = (size_t)T * T;
    const size_t qkv_part = (size_t)B * T * C;
    for (int b = 0; b < B; b++) {
        const floatX* v = qkvr + 2 * qkv_part + b * NH * head;
        const floatX* dout_b = dout + (size_t)b * T * C;
        floatX* dinp_b = dinp + (size_t)b * T * 3 * C;
        attention_gemm(true, false, T, T, HS, v, HS, head, dout_b, C, HS, datt + b * NH * head_att, T, head_att, NH, 0);
        attention_gemm(false, true, HS, T, T, dout_b, C, HS, att + b * NH * head_att, T, head_att, dinp_b + 2 * C,
                       3 * C, HS, NH, 0);
    }
    attention_softmax_backward(datt, datt, att, 1.0f / sqrtf((float)HS), B * NH * T, T, 0);
    for (int b = 0; b < B; b++) {
        const floatX* q = qkvr + b * NH * head;
        const floatX* k = qkvr + qkv_part + b * NH * head;
        floatX* dinp_b = dinp + (size_t)b * T * 3 * C;
        attention_gemm(false, false, HS, T, T, k, HS, head, datt + b * NH * head_att, T, head_att, dinp_b, 3 * C, HS,
                       NH, 0);
        attention_gemm(false, true, HS, T, T, q, HS, head, datt + b * NH * head_att, T, head_att, dinp_b + C, 3 * C,
                       HS, NH, 0);
    }
}

static void run_size(const LabArgs& args, int B, int T, int C, int NH) {
    const size_t n_qkv = (size_t)B * T * 3 * C, n_att = (size_t)B * NH * T * T, n_out = (size_t)B * T * C;
    std::vector<float> qkvr = lab_random(n_qkv, -1.0f, 1.0f);
    std::vector<float> dout = lab_random(n_out, -1.0f, 1.0f);
    // att: causal softmax rows of random logits with a spread of 3, so rows are neither uniform nor one-hot
    std::vector<float> att(n_att, 0.0f);
    std::vector<float> logits = lab_random(n_att, -3.0f, 3.0f);
    std::vector<double> row(T);
    for (size_t r = 0; r < (size_t)B * NH * T; r++) {
        const int t = (int)(r % T);
        for (int s = 0; s <= t; s++) row[s] = logits[r * T + s];
        attention_causal_softmax(row.data(), t);
        for (int s = 0; s <= t; s++) att[r * T + s] = (float)row[s];
    }
    for (auto* v : {&qkvr, &dout, &att}) *v = lab_rounded(*v);  // the reference sees exactly what the device sees
    std::vector<float> dinp_ref(n_qkv);
    attention_backward_reference(dinp_ref, dout, qkvr, att, B, T, C, NH, NH);

    floatX* d_qkvr = lab_to_device<floatX>(qkvr);
    floatX* d_dout = lab_to_device<floatX>(dout);
    floatX* d_att = lab_to_device<floatX>(att);
    floatX* d_dinp = lab_poisoned<floatX>(n_qkv);
    floatX* d_dqkvr = lab_poisoned<floatX>(n_qkv);
    floatX* d_datt = lab_poisoned<floatX>(n_att);
    floatX* d_scratch = lab_poisoned<floatX>(n_out);

    // Tolerances. bf16: datt (|.| ~ sqrt(HS)/3 ~ 2) is rounded to bf16 (~4e-3 absolute) before datt - dot
    // cancels it down; dpreatt is rounded again, then summed over up to T keys into dq, dk (each term's error
    // scaled by att or dpreatt, which sum to O(1) over a row), and dq, dk, dv rounded once more: 2e-2
    // relative and absolute (~5 ulps of O(1) results). Errors of a wrong transpose, head or mask are O(1).
    // fp32: the same chain without the bf16 roundings, fp32 GEMMs over <= 1024 terms: 2e-5.
#if defined(ENABLE_FP32)
    const float tol = 2e-5f;
#else
    const float tol = 2e-2f;
#endif
    char sizes[128];
    snprintf(sizes, sizeof(sizes), "B=%d T=%d C=%d NH=%d %s", B, T, C, NH, PRECISION_NAME);
    printf("attention_backward: %s\n", sizes);
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        cudaCheck(cudaMemset(d_dinp, 0xff, n_qkv * sizeof(floatX)));
        cudaCheck(cudaMemset(d_datt, 0xff, n_att * sizeof(floatX)));
        if (variant == 1)
            attention_backward(d_dinp, d_dqkvr, d_datt, d_scratch, d_dout, d_qkvr, d_att, B, T, C, NH, 0);
        if (variant == 2) attention_backward_no_permute(d_dinp, d_datt, d_dout, d_qkvr, d_att, B, T, C, NH);
        cudaCheck(cudaDeviceSynchronize());
        lab_validate("dinp = [dq | dk | dv]", d_dinp, dinp_ref.data(), n_qkv, tol, tol);
    }

    lab_print_header("attention_backward", sizes);
    const int repeats = args.small ? 3 : 20;
    const double flops = 8.0 * B * T * T * C;
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        float ms = lab_time_ms(repeats, [&]() {
            if (variant == 1)
                attention_backward(d_dinp, d_dqkvr, d_datt, d_scratch, d_dout, d_qkvr, d_att, B, T, C, NH, 0);
            if (variant == 2) attention_backward_no_permute(d_dinp, d_datt, d_dout, d_qkvr, d_att, B, T, C, NH);
        });
        lab_print_row(variant, 0, ms, 0.0, flops);
    }
    cudaCheck(cudaFree(d_qkvr));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_att));
    cudaCheck(cudaFree(d_dinp));
    cudaCheck(cudaFree(d_dqkvr));
    cudaCheck(cudaFree(d_datt));
    cudaCheck(cudaFree(d_scratch));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    cublas_setup();
    if (args.small) {
        run_size(args, 3, 37, 96, 3);
        run_size(args, 3, 48, 96, 3);
    } else {
        run_size(args, 8, 1024, 768, 12);
    }
    cublas_teardown();
    return 0;
}
