// dev/cuda/matmul_backward_bias.cu: kernel lab for the Linear backward: the deterministic bias gradient
// dbias (OC) += sum over B*T rows of dout (B*T, OC), and, validated alongside, the whole matmul_backward
// (dinp with and without the GELU backward fused into cuBLASLt's DGELU epilogue, dweight, dbias).
// Build and run (CPU backend; -DENABLE_FP32 for fp32):
//   make build/lab/matmul_backward_bias_bf16   (build/lab/matmul_backward_bias_fp32: the fp32 build)
//   build/lab/matmul_backward_bias_bf16 [variant] [-s]
// Variants (of the bias gradient):
//   1  llmc/matmul.cuh matmul_backward_bias (THE TRAINER'S, called by matmul_backward): blocks own a strip of
//      32 * x128::size channels and a fixed share of rows; their fp32 partial rows are added in order by a
//      second small kernel. Its run also validates matmul_backward with gelu_fusion 1 and 2.
//   2  one thread per 16-byte chunk of channels walking every row: one pass, no scratch, as deterministic,
//      but only OC / x128::size threads.
// Sizes: B=8 T=1024 C=768 OC=3072 (GPT-2 124M c_fc); -s: B=3 T=37 C=96 OC=384.
// Floor (bias gradient): B*T * OC * sizeof(floatX) bytes read once; B*T*OC adds.
#include "common.h"
#include "../../llmc/matmul.cuh"
#include "matmul_reference.h"

__global__ void bias_column_per_thread_kernel(floatX* dbias, const floatX* dout, int N, int OC) {
    const int col = (blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (col >= OC) return;
    float sums[x128::size];
    for (int k = 0; k < x128::size; k++) sums[k] = 0.0f;
    for (int row = 0; row < N; row++) {
        x128 packed = load128cs(dout + (size_t)row * OC + col);
        for (int k = 0; k < x128::size; k++) sums[k] += (float)packed[k];
    }
    x128 bias = load128(dbias + col);
    for (int k = 0; k < x128::size; k++) bias[k] = (floatX)((float)bias[k] + sums[k]);
    store128(dbias + col, bias);
}

static void bias_column_per_thread(floatX* dbias, const floatX* dout, int N, int OC, int block_size) {
    bias_column_per_thread_kernel<<<CEIL_DIV(OC / x128::size, block_size), block_size>>>(dbias, dout, N, OC);
    cudaCheck(cudaGetLastError());
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    const int B = args.small ? 3 : 8, T = args.small ? 37 : 1024, C = args.small ? 96 : 768, OC = 4 * C;
    const int N = B * T;
    cublas_setup();

    std::vector<float> dout = lab_random_rounded((size_t)N * OC, -1.0f, 1.0f);
    std::vector<float> inp = lab_random_rounded((size_t)N * C, -1.0f, 1.0f);
    std::vector<float> weight = lab_random_rounded((size_t)OC * C, -1.0f / sqrtf((float)OC), 1.0f / sqrtf((float)OC));
    std::vector<float> pre_gelu = lab_random_rounded((size_t)N * C, -3.0f, 3.0f);
    // gradients accumulate (+=) onto what is there
    std::vector<float> dweight_init = lab_random_rounded((size_t)OC * C, -1.0f, 1.0f);
    std::vector<float> dbias_init = lab_random_rounded(OC, -1.0f, 1.0f);

    // CPU references in double: dinp = dout @ weight, dweight += dout^T @ inp, dbias += the column sums of dout
    std::vector<float> dinp_ref((size_t)N * C), dinp_gelu_ref((size_t)N * C), dweight_ref((size_t)OC * C), dbias_ref(OC);
    matmul_reference(dinp_ref.data(), dout.data(), OC, 1, weight.data(), C, 1, nullptr, 0, N, C, OC);
    for (size_t i = 0; i < dinp_ref.size(); i++) dinp_gelu_ref[i] = (float)(dinp_ref[i] * gelu_grad_reference(pre_gelu[i]));
    matmul_reference(dweight_ref.data(), dout.data(), 1, OC, inp.data(), C, 1, dweight_init.data(), C, OC, C, N);
    for (int o = 0; o < OC; o++) {
        double bias_sum = dbias_init[o];
        for (int n = 0; n < N; n++) bias_sum += dout[(size_t)n * OC + o];
        dbias_ref[o] = (float)bias_sum;
    }

    floatX* d_dout = lab_to_device<floatX>(dout);
    floatX* d_inp = lab_to_device<floatX>(inp);
    floatX* d_weight = lab_to_device<floatX>(weight);
    floatX* d_pre_gelu = lab_to_device<floatX>(pre_gelu);
    floatX* d_dinp = lab_poisoned<floatX>((size_t)N * C);
    floatX* d_dbias = lab_to_device<floatX>(dbias_init);
    float* d_buffer = lab_poisoned<float>(matmul_dbias_buffer_floats(OC));

    // Tolerances. bf16: inputs are exact in bf16 and sums are fp32, so the error is the final rounding (half
    // an ulp: 2^-9 relative) plus, for the unfused GELU backward, the rounding of dinp before the multiply
    // (another half ulp): 1e-2 relative (2.5 ulps), 1e-2 absolute near zero. fp32: a sum of K products
    // ~U(-1,1)^2 in fp32 errs by ~K * 2^-24 * 0.33 (2e-8 K); atol = 1e-7 K (5x that), rtol 1e-5.
#if defined(ENABLE_FP32)
    const float rtol = 1e-5f, atol_dinp = 1e-7f * OC, atol_sum = 1e-7f * N;
#else
    const float rtol = 1e-2f, atol_dinp = 1e-2f, atol_sum = 1e-2f;
#endif
    char sizes[128];
    snprintf(sizes, sizeof(sizes), "B=%d T=%d C=%d OC=%d %s", B, T, C, OC, PRECISION_NAME);
    printf("matmul_backward_bias: %s\n", sizes);
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        if (variant == 1) {
            for (int gelu_fusion = 1; gelu_fusion <= 2; gelu_fusion++) {
                floatX* fresh_dweight = lab_to_device<floatX>(dweight_init);
                floatX* fresh_dbias = lab_to_device<floatX>(dbias_init);
                cudaCheck(cudaMemset(d_dinp, 0xff, (size_t)N * C * sizeof(floatX)));
                matmul_backward(d_dinp, fresh_dweight, fresh_dbias, d_dout, d_inp, d_weight, d_buffer, B, T, C, OC, 0,
                                d_pre_gelu, gelu_fusion);
                printf(" matmul_backward, gelu_fusion %d\n", gelu_fusion);
                lab_validate("dinp * gelu'(pre_gelu)", d_dinp, dinp_gelu_ref.data(), (size_t)N * C, atol_dinp, rtol);
                lab_validate("dweight (+=)", fresh_dweight, dweight_ref.data(), (size_t)OC * C, atol_sum, rtol);
                lab_validate("dbias (+=)", fresh_dbias, dbias_ref.data(), OC, atol_sum, rtol);
                cudaCheck(cudaFree(fresh_dweight));
                cudaCheck(cudaFree(fresh_dbias));
            }
            printf(" matmul_backward, no GELU, no bias\n");
            floatX* fresh_dweight = lab_to_device<floatX>(dweight_init);
            cudaCheck(cudaMemset(d_dinp, 0xff, (size_t)N * C * sizeof(floatX)));
            matmul_backward(d_dinp, fresh_dweight, nullptr, d_dout, d_inp, d_weight, d_buffer, B, T, C, OC, 0);
            lab_validate("dinp", d_dinp, dinp_ref.data(), (size_t)N * C, atol_dinp, rtol);
            lab_validate("dweight (+=)", fresh_dweight, dweight_ref.data(), (size_t)OC * C, atol_sum, rtol);
            cudaCheck(cudaFree(fresh_dweight));
        }
        printf(" bias gradient alone\n");
        floatX* fresh_dbias = lab_to_device<floatX>(dbias_init);
        if (variant == 1) matmul_backward_bias(fresh_dbias, d_dout, d_buffer, N, OC, 0);
        if (variant == 2) bias_column_per_thread(fresh_dbias, d_dout, N, OC, 128);
        lab_validate("dbias (+=)", fresh_dbias, dbias_ref.data(), OC, atol_sum, rtol);
        cudaCheck(cudaFree(fresh_dbias));
    }

    lab_print_header("matmul_backward_bias", sizes);
    const int repeats = args.small ? 3 : 20;
    const double bytes = (double)N * OC * sizeof(floatX);
    if (args.variant == 0 || args.variant == 1) {
        float ms = lab_time_ms(repeats, [&]() { matmul_backward_bias(d_dbias, d_dout, d_buffer, N, OC, 0); });
        lab_print_row(1, 32 * MATMUL_BIAS_WARPS, ms, bytes, 0.0);
    }
    if (args.variant == 0 || args.variant == 2) {
        const int block_sizes[] = {32, 64, 128, 256};
        for (int block_size : block_sizes) {
            float ms = lab_time_ms(repeats, [&]() { bias_column_per_thread(d_dbias, d_dout, N, OC, block_size); });
            lab_print_row(2, block_size, ms, bytes, 0.0);
        }
    }

    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_weight));
    cudaCheck(cudaFree(d_pre_gelu));
    cudaCheck(cudaFree(d_dinp));
    cudaCheck(cudaFree(d_dbias));
    cudaCheck(cudaFree(d_buffer));
    cublas_teardown();
    return 0;
}
