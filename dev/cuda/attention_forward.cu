// dev/cuda/attention_forward.cu: kernel lab for causal multi-head attention forward, the hand-written path:
// inp (B, T, 3C) = [q | k | v] per position -> out (B, T, C), with att (B, NH, T, T) kept.
// Build and run (CPU backend; -DENABLE_FP32 for fp32):
//   make build/lab/attention_forward_bf16   (build/lab/attention_forward_fp32: the fp32 build)
//   build/lab/attention_forward_bf16 [variant] [-s]
// Variants:
//   1  llmc/attention.cuh attention_forward (THE TRAINER'S): permute q, k, v into heads (qkvr), preatt = q k^T
//      as one strided-batched GEMM over B*NH into att, causal softmax in place, att @ v written straight into
//      out's layout (one batched call per batch row).
//   2  no permute: both GEMMs read q, k, v in place from inp (leading dimension 3C, head stride HS), one
//      batched call per batch row; the same softmax. Saves the permute pass but leaves no qkvr for backward.
// Sizes: B=8 T=1024 C=768 NH=12 (GPT-2 124M); -s: B=3 C=96 NH=3 (HS=32) at T=37 (rows not 16-byte aligned:
// the softmax's element path) and T=48 (its vector path).
// Floor: flops 2 GEMMs of 2 * B*NH*T*T*HS each = 4 * B*T*T*C; bytes: inp read, qkvr written (variant 1),
// att written by the GEMM, read and rewritten by the softmax, read by the second GEMM, out written:
// (3BTC + 3BTC + 4 * B*NH*T*T + BTC) * sizeof(floatX); the T^2 terms dominate (O(T^2) memory path).
#include "common.h"
#include "../../llmc/attention.cuh"
#include "attention_reference.h"

static void attention_forward_no_permute(floatX* out, floatX* att, const floatX* inp, int B, int T, int C, int NH) {
    const int HS = C / NH;
    const size_t head_att = (size_t)T * T;
    for (int b = 0; b < B; b++) {
        const floatX* q = inp + (size_t)b * T * 3 * C;
        attention_gemm(true, false, T, T, HS, q + C, 3 * C, HS, q, 3 * C, HS, att + b * NH * head_att, T, head_att, NH,
                       0);
    }
    attention_softmax_forward(att, att, 1.0f / sqrtf((float)HS), B * NH * T, T, 0);
    for (int b = 0; b < B; b++) {
        const floatX* v = inp + (size_t)b * T * 3 * C + 2 * C;
        attention_gemm(false, false, HS, T, T, v, 3 * C, HS, att + b * NH * head_att, T, head_att,
                       out + (size_t)b * T * C, C, HS, NH, 0);
    }
}

static void run_size(const LabArgs& args, int B, int T, int C, int NH) {
    const size_t n_inp = (size_t)B * T * 3 * C, n_att = (size_t)B * NH * T * T, n_out = (size_t)B * T * C;
    std::vector<float> inp = lab_random_rounded(n_inp, -1.0f, 1.0f);
    std::vector<float> qkvr_ref(n_inp), att_ref(n_att), out_ref(n_out);
    attention_forward_reference(qkvr_ref, att_ref, out_ref, inp, B, T, C, NH, NH);

    floatX* d_inp = lab_to_device<floatX>(inp);
    floatX* d_qkvr = lab_poisoned<floatX>(n_inp);
    floatX* d_att = lab_poisoned<floatX>(n_att);
    floatX* d_out = lab_poisoned<floatX>(n_out);

    // Tolerances. bf16: scores q.k (|.| <~ 2) are rounded to bf16 in att before the softmax (2^-9 relative:
    // <~ 4e-3 before the 1/sqrt(HS) scale, <~ 1e-3 after, which the softmax passes on as a relative error of
    // att), att is rounded again (2^-9) and out once more: 1e-2 relative and absolute is ~2.5 ulps of the
    // O(1) results. Masking, head or transpose mistakes give errors of the order of the values. fp32: two fp32
    // GEMMs over <= 1024 terms and expf (the GPU's fast-math expf errs by ~2 ulps): 2e-5.
#if defined(ENABLE_FP32)
    const float tol = 2e-5f;
#else
    const float tol = 1e-2f;
#endif
    char sizes[128];
    snprintf(sizes, sizeof(sizes), "B=%d T=%d C=%d NH=%d %s", B, T, C, NH, PRECISION_NAME);
    printf("attention_forward: %s\n", sizes);
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        cudaCheck(cudaMemset(d_att, 0xff, n_att * sizeof(floatX)));
        cudaCheck(cudaMemset(d_out, 0xff, n_out * sizeof(floatX)));
        if (variant == 1) attention_forward(d_out, d_qkvr, d_att, d_inp, B, T, C, NH, 0);
        if (variant == 2) attention_forward_no_permute(d_out, d_att, d_inp, B, T, C, NH);
        cudaCheck(cudaDeviceSynchronize());
        if (variant == 1) lab_validate("qkvr (permuted, exact)", d_qkvr, qkvr_ref.data(), n_inp, 0.0f, 0.0f);
        lab_validate("att", d_att, att_ref.data(), n_att, tol, tol);
        lab_validate("out", d_out, out_ref.data(), n_out, tol, tol);
    }

    lab_print_header("attention_forward", sizes);
    const int repeats = args.small ? 3 : 20;
    const double flops = 4.0 * B * T * T * C;
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        float ms = lab_time_ms(repeats, [&]() {
            if (variant == 1) attention_forward(d_out, d_qkvr, d_att, d_inp, B, T, C, NH, 0);
            if (variant == 2) attention_forward_no_permute(d_out, d_att, d_inp, B, T, C, NH);
        });
        lab_print_row(variant, 0, ms, 0.0, flops);
    }
    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_qkvr));
    cudaCheck(cudaFree(d_att));
    cudaCheck(cudaFree(d_out));
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
