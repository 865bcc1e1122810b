// dev/cuda/rmsnorm_forward.cu: kernel lab for RMSNorm forward (runtime eps, fp32 statistics), plain and fused with
// the residual add before it: residual = inp1 + inp2, normed = rmsnorm(residual).
// Build and run on the CPU backend (small sizes):
//   make build/lab/rmsnorm_forward_bf16   (build/lab/rmsnorm_forward_fp32: the fp32 build)
//   build/lab/rmsnorm_forward_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/rmsnorm_forward.cu -o rmsnorm_forward
//   ./rmsnorm_forward [variant] [-s]       (GPT-2 124M sizes by default: B=8, T=1024, C=768)
// Variants:
//   1  one block per row: block-wide reduction through shared memory, 16-byte loads
//   2  llmc/rmsnorm.cuh rmsnorm_forward: one warp per row, shuffle reductions only. The trainer's.
//   3  llmc/rmsnorm.cuh fused_residual_rmsnorm_forward: one warp per row adds the residual and norms it. The
//      trainer's. (The unfused pair, an add kernel then variant 2, reads the residual back: layernorm_forward's
//      lab times that comparison, which is the same here.)
// Every variant is validated at eps = 1e-5 (Llama's) and at eps = 1e-2, with rows whose mean square ranges from
// far above eps to far below it (and one all-zero row), so that an eps the kernel ignores or misplaces fails.
// Floors (see llmc/rmsnorm.cuh): rmsnorm 2*N*C*sizeof(floatX) + 4*N bytes; fused 4*N*C*sizeof(floatX) + 4*N.
#include "common.h"
#include "../../llmc/rmsnorm.cuh"

__global__ void rmsnorm_forward_block_per_row_kernel(floatX* out, float* rstd, const floatX* inp, const floatX* weight,
                                                     int C, float eps) {
    const floatX* x = inp + (size_t)blockIdx.x * C;
    float squares = 0.0f;
    for (int c = threadIdx.x * x128::size; c < C; c += blockDim.x * x128::size) {
        x128 v = load128(x + c);
        for (int k = 0; k < x128::size; k++) squares += (float)v[k] * (float)v[k];
    }
    const float s = rsqrtf(block_reduce<warp_reduce_sum>(squares) / C + eps);
    for (int c = threadIdx.x * x128::size; c < C; c += blockDim.x * x128::size) {
        x128 v = load128cs(x + c);
        x128 w = load128(weight + c);
        x128 result;
        for (int k = 0; k < x128::size; k++) result[k] = (floatX)((float)v[k] * s * (float)w[k]);
        store128(out + (size_t)blockIdx.x * C + c, result);
    }
    if (threadIdx.x == 0) rstd[blockIdx.x] = s;
}

struct RmsnormBuffers {
    floatX* inp1;
    floatX* inp2;
    floatX* weight;
    floatX* out;
    floatX* residual;
    float* rstd;
};

static void run_variant(int variant, const RmsnormBuffers* d, int N, int C, float eps, int block_size) {
    if (variant == 1) {
        rmsnorm_forward_block_per_row_kernel<<<N, block_size>>>(d->out, d->rstd, d->inp1, d->weight, C, eps);
        cudaCheck(cudaGetLastError());
    } else if (variant == 2) {
        if (block_size == 256) rmsnorm_forward(d->out, d->rstd, d->inp1, d->weight, N, 1, C, eps, 0);
        else rmsnorm_forward_launch(d->out, d->rstd, d->inp1, d->weight, N, C, eps, block_size, 0);
    } else {
        if (block_size == 256) {
            fused_residual_rmsnorm_forward(d->residual, d->out, d->rstd, d->inp1, d->inp2, d->weight, N, C, eps, 0);
        } else {
            fused_residual_rmsnorm_forward_launch(d->residual, d->out, d->rstd, d->inp1, d->inp2, d->weight, N, C, eps,
                                                  block_size, 0);
        }
    }
}

// double-precision rmsnorm of the rows x (N, C)
static void rmsnorm_reference(std::vector<float>* out, std::vector<float>* rstd, const std::vector<float>& x,
                              const std::vector<float>& weight, int N, int C, double eps) {
    for (int row = 0; row < N; row++) {
        const float* r = x.data() + (size_t)row * C;
        double squares = 0.0;
        for (int c = 0; c < C; c++) squares += (double)r[c] * r[c];
        const double s = 1.0 / sqrt(squares / C + eps);
        for (int c = 0; c < C; c++) (*out)[(size_t)row * C + c] = (float)(r[c] * s * weight[c]);
        (*rstd)[row] = (float)s;
    }
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    int B = 8, T = 1024, C = 768;
    if (args.small) { B = 3; T = 37; C = 296; }  // 296 = 37 vectors of 8: lanes with one and with two chunks
    const int N = B * T;
    const size_t n = (size_t)N * C;

    // a scale per row, log-uniform over [1e-3, 3] (mean squares ~3e-7 .. 3, on both sides of either eps), and an
    // offset so that the rows are not centred; row 1 is all zeros (out 0, rstd 1/sqrt(eps))
    std::vector<float> inp1 = lab_random(n), inp2 = lab_random(n);
    for (int row = 0; row < N; row++) {
        const float scale = row == 1 ? 0.0f : expf(lab_rand_uniform(logf(1e-3f), logf(3.0f)));
        const float offset = lab_rand_uniform(-0.5f, 0.5f) * scale;
        for (int c = 0; c < C; c++) inp1[(size_t)row * C + c] = inp1[(size_t)row * C + c] * scale + offset;
    }
    inp1 = lab_rounded(inp1);
    inp2 = lab_rounded(inp2);
    std::vector<float> weight = lab_random_rounded(C, -1.5f, 1.5f);
    // residual as the kernel stores it: the floatX rounding of the exact sum (the fp32 sum of two floatX values
    // is exact in bf16 and correctly rounded in fp32, like this double sum rounded once)
    std::vector<float> residual(n);
    for (size_t i = 0; i < n; i++) residual[i] = (float)(floatX)((double)inp1[i] + (double)inp2[i]);

    RmsnormBuffers d;
    d.inp1 = lab_to_device<floatX>(inp1);
    d.inp2 = lab_to_device<floatX>(inp2);
    d.weight = lab_to_device<floatX>(weight);
    d.out = lab_poisoned<floatX>(n);
    d.residual = lab_poisoned<floatX>(n);
    d.rstd = lab_poisoned<float>(N);

    // fp32: rstd is an fp32 sum of C non-negative terms (relative error <= ~C * 2^-24 in the worst case, ~sqrt(C)
    // * 2^-24 typically) and rsqrt.approx (2^-22.9), the output two fp32 products more: rtol 1e-5 for out and
    // rstd; atol 1e-6 only for the zero row's outputs and the signed zeros of weight products near 0 (|out| ~ 1).
    // bf16: the output is rounded once to bf16 (half an ulp, <= 2^-8 relative) after the same fp32 arithmetic:
    // rtol 5e-3. rstd is fp32 in both precisions, from the same floatX inputs as the reference: rtol 1e-5.
    const float rtol = PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 5e-3f;
    const float atol = 1e-6f;
    const int repeats = args.small ? 3 : 100;
    const int block_sizes[] = {64, 128, 256, 512};
    const float epsilons[] = {RMSNORM_DEFAULT_EPS, 1e-2f};

    printf("rmsnorm_forward (%s): B=%d T=%d C=%d\n", PRECISION_NAME, B, T, C);
    for (float eps : epsilons) {
        std::vector<float> plain_out(n), plain_rstd(N), fused_out(n), fused_rstd(N);
        rmsnorm_reference(&plain_out, &plain_rstd, inp1, weight, N, C, eps);
        rmsnorm_reference(&fused_out, &fused_rstd, residual, weight, N, C, eps);
        for (int variant = 1; variant <= 3; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            cudaCheck(cudaMemset(d.out, 0xff, n * sizeof(floatX)));
            cudaCheck(cudaMemset(d.residual, 0xff, n * sizeof(floatX)));
            cudaCheck(cudaMemset(d.rstd, 0xff, N * sizeof(float)));
            run_variant(variant, &d, N, C, eps, 256);
            cudaCheck(cudaDeviceSynchronize());
            printf("variant %d, eps %g\n", variant, eps);
            const bool fused = variant == 3;
            if (fused) lab_validate("residual", d.residual, residual.data(), n, 0.0f, 0.0f);
            lab_validate("out", d.out, fused ? fused_out.data() : plain_out.data(), n, atol, rtol);
            lab_validate("rstd", d.rstd, fused ? fused_rstd.data() : plain_rstd.data(), N, 0.0f, 1e-5f);
        }
        if (args.variant == 0 || args.variant == 2) {
            // a recompute asks for the output only
            cudaCheck(cudaMemset(d.out, 0xff, n * sizeof(floatX)));
            rmsnorm_forward(d.out, nullptr, d.inp1, d.weight, B, T, C, eps, 0);
            cudaCheck(cudaDeviceSynchronize());
            printf("variant 2 without rstd, eps %g\n", eps);
            lab_validate("out", d.out, plain_out.data(), n, atol, rtol);
        }
    }

    lab_print_header("rmsnorm_forward", args.small ? "small sizes" : "GPT-2 124M sizes");
    for (int variant = 1; variant <= 3; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        const double bytes = (variant <= 2 ? 2.0 : 4.0) * n * sizeof(floatX) + 4.0 * N;
        for (int block_size : block_sizes) {
            float ms = lab_time_ms(repeats, [&]() { run_variant(variant, &d, N, C, RMSNORM_DEFAULT_EPS, block_size); });
            lab_print_row(variant, block_size, ms, bytes, 0.0);
        }
    }
    cudaCheck(cudaFree(d.inp1));
    cudaCheck(cudaFree(d.inp2));
    cudaCheck(cudaFree(d.weight));
    cudaCheck(cudaFree(d.out));
    cudaCheck(cudaFree(d.residual));
    cudaCheck(cudaFree(d.rstd));
    return 0;
}
