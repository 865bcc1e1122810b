// dev/cuda/layernorm_forward.cu: kernel lab for LayerNorm forward (eps 1e-5, fp32 statistics), plain and fused
// with the residual add before it: residual = inp1 + inp2, normed = layernorm(residual).
// Build and run on the CPU backend (small sizes):
//   make build/lab/layernorm_forward_bf16   (build/lab/layernorm_forward_fp32: the fp32 build)
//   build/lab/layernorm_forward_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/layernorm_forward.cu -o layernorm_forward
//   ./layernorm_forward [variant] [-s]       (GPT-2 124M sizes by default: B=8, T=1024, C=768)
// Variants:
//   1  layernorm_forward, one block per row: block-wide reductions through shared memory, 16-byte loads
//   2  llmc/layernorm.cuh layernorm_forward: one warp per row, shuffle reductions only. The trainer's.
//   3  residual add as its own kernel, then llmc layernorm_forward (two kernels, the residual read back)
//   4  llmc/layernorm.cuh fused_residual_layernorm_forward: one warp per row does both. The trainer's.
// Floors (see llmc/layernorm.cuh): layernorm 2*N*C*sizeof(floatX) + 8*N bytes; fused 4*N*C*sizeof(floatX) + 8*N.
#include "common.h"
#include "../../llmc/layernorm.cuh"

__global__ void layernorm_forward_block_per_row_kernel(floatX* out, float* mean, float* rstd, const floatX* inp,
                                                       const floatX* weight, const floatX* bias, int C) {
    const floatX* x = inp + (size_t)blockIdx.x * C;
    float sum = 0.0f;
    for (int c = threadIdx.x * x128::size; c < C; c += blockDim.x * x128::size) {
        x128 v = load128(x + c);
        for (int k = 0; k < x128::size; k++) sum += (float)v[k];
    }
    const float m = block_reduce<warp_reduce_sum>(sum, true) / C;
    float squares = 0.0f;
    for (int c = threadIdx.x * x128::size; c < C; c += blockDim.x * x128::size) {
        x128 v = load128(x + c);
        for (int k = 0; k < x128::size; k++) squares += ((float)v[k] - m) * ((float)v[k] - m);
    }
    const float s = rsqrtf(block_reduce<warp_reduce_sum>(squares) / C + LAYERNORM_EPS);
    for (int c = threadIdx.x * x128::size; c < C; c += blockDim.x * x128::size) {
        x128 v = load128cs(x + c);
        x128 w = load128(weight + c);
        x128 b = load128(bias + c);
        x128 result;
        for (int k = 0; k < x128::size; k++) result[k] = (floatX)(((float)v[k] - m) * s * (float)w[k] + (float)b[k]);
        store128(out + (size_t)blockIdx.x * C + c, result);
    }
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = m;
        rstd[blockIdx.x] = s;
    }
}

__global__ void residual_add_kernel(floatX* out, const floatX* inp1, const floatX* inp2, size_t n) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    x128 a = load128cs(inp1 + i);
    x128 b = load128cs(inp2 + i);
    x128 sum;
    for (int k = 0; k < x128::size; k++) sum[k] = (floatX)((float)a[k] + (float)b[k]);
    store128(out + i, sum);
}

struct LayernormBuffers {
    floatX* inp1;
    floatX* inp2;
    floatX* weight;
    floatX* bias;
    floatX* out;
    floatX* residual;
    float* mean;
    float* rstd;
};

static void run_variant(int variant, const LayernormBuffers* d, int N, int C, int block_size) {
    if (variant == 1) {
        layernorm_forward_block_per_row_kernel<<<N, block_size>>>(d->out, d->mean, d->rstd, d->inp1, d->weight,
                                                                  d->bias, C);
        cudaCheck(cudaGetLastError());
    } else if (variant == 2) {
        if (block_size == 256) layernorm_forward(d->out, d->mean, d->rstd, d->inp1, d->weight, d->bias, N, 1, C, 0);
        else layernorm_forward_launch(d->out, d->mean, d->rstd, d->inp1, d->weight, d->bias, N, C, block_size, 0);
    } else if (variant == 3) {
        const size_t n = (size_t)N * C;
        residual_add_kernel<<<(unsigned int)CEIL_DIV(n, (size_t)block_size * x128::size), block_size>>>(
            d->residual, d->inp1, d->inp2, n);
        cudaCheck(cudaGetLastError());
        layernorm_forward_launch(d->out, d->mean, d->rstd, d->residual, d->weight, d->bias, N, C, block_size, 0);
    } else {
        if (block_size == 256) {
            fused_residual_layernorm_forward(d->residual, d->out, d->mean, d->rstd, d->inp1, d->inp2, d->weight,
                                             d->bias, N, C, 0);
        } else {
            fused_residual_layernorm_forward_launch(d->residual, d->out, d->mean, d->rstd, d->inp1, d->inp2,
                                                    d->weight, d->bias, N, C, block_size, 0);
        }
    }
}

static std::vector<float> rounded_to_floatX(std::vector<float> values) {
    for (float& v : values) v = (float)(floatX)v;
    return values;
}

// double-precision layernorm of the rows x (N, C)
static void layernorm_reference(std::vector<float>* out, std::vector<float>* mean, std::vector<float>* rstd,
                                const std::vector<float>& x, const std::vector<float>& weight,
                                const std::vector<float>& bias, int N, int C) {
    for (int row = 0; row < N; row++) {
        const float* r = x.data() + (size_t)row * C;
        double m = 0.0, v = 0.0;
        for (int c = 0; c < C; c++) m += r[c];
        m /= C;
        for (int c = 0; c < C; c++) v += (r[c] - m) * (r[c] - m);
        const double s = 1.0 / sqrt(v / C + 1e-5);
        for (int c = 0; c < C; c++) (*out)[(size_t)row * C + c] = (float)((r[c] - m) * s * weight[c] + bias[c]);
        (*mean)[row] = (float)m;
        (*rstd)[row] = (float)s;
    }
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    int B = 8, T = 1024, C = 768;
    if (args.small) { B = 3; T = 37; C = 296; }  // 296 = 37 vectors of 8: lanes with one and with two chunks
    const int N = B * T;
    const size_t n = (size_t)N * C;

    // an offset and a spread per row, so that mean and variance differ between rows and the mean is not ~0
    std::vector<float> inp1 = lab_random(n), inp2 = lab_random(n);
    for (int row = 0; row < N; row++) {
        float offset = lab_rand_uniform(-2.0f, 2.0f), scale = lab_rand_uniform(0.5f, 3.0f);
        for (int c = 0; c < C; c++) inp1[(size_t)row * C + c] = inp1[(size_t)row * C + c] * scale + offset;
    }
    inp1 = rounded_to_floatX(inp1);
    inp2 = rounded_to_floatX(inp2);
    std::vector<float> weight = rounded_to_floatX(lab_random(C, 0.5f, 1.5f));
    std::vector<float> bias = rounded_to_floatX(lab_random(C, -0.5f, 0.5f));
    // residual as the kernel stores it: the floatX rounding of the exact sum (the fp32 sum of two floatX values
    // is exact in bf16 and correctly rounded in fp32, like this double sum rounded once)
    std::vector<float> residual(n);
    for (size_t i = 0; i < n; i++) residual[i] = (float)(floatX)((double)inp1[i] + (double)inp2[i]);

    std::vector<float> ln_out(n), ln_mean(N), ln_rstd(N), fused_out(n), fused_mean(N), fused_rstd(N);
    layernorm_reference(&ln_out, &ln_mean, &ln_rstd, inp1, weight, bias, N, C);
    layernorm_reference(&fused_out, &fused_mean, &fused_rstd, residual, weight, bias, N, C);

    LayernormBuffers d;
    d.inp1 = lab_to_device<floatX>(inp1);
    d.inp2 = lab_to_device<floatX>(inp2);
    d.weight = lab_to_device<floatX>(weight);
    d.bias = lab_to_device<floatX>(bias);
    d.out = lab_poisoned<floatX>(n);
    d.residual = lab_poisoned<floatX>(n);
    d.mean = lab_poisoned<float>(N);
    d.rstd = lab_poisoned<float>(N);

    // fp32: the statistics are fp32 sums of C terms in another order than the reference (relative error
    // ~sqrt(C) * 2^-24 < 1e-6), the output a few fp32 operations more: rtol 1e-5, atol 1e-5 for outputs
    // near 0 (|out| ~ 3, so the absolute errors of the terms are ~3e-7). bf16: the output is rounded once to
    // bf16 (half an ulp, <= 2^-8 relative) after the same fp32 arithmetic: rtol 5e-3. mean and rstd are
    // fp32 in both precisions, from the same floatX inputs as the reference: rtol 1e-5.
    const float rtol = PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 5e-3f;
    const float atol = 1e-5f;
    const int repeats = args.small ? 3 : 100;
    const int block_sizes[] = {64, 128, 256, 512};

    printf("layernorm_forward (%s): B=%d T=%d C=%d\n", PRECISION_NAME, B, T, C);
    for (int variant = 1; variant <= 4; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        cudaCheck(cudaMemset(d.out, 0xff, n * sizeof(floatX)));
        cudaCheck(cudaMemset(d.residual, 0xff, n * sizeof(floatX)));
        cudaCheck(cudaMemset(d.mean, 0xff, N * sizeof(float)));
        cudaCheck(cudaMemset(d.rstd, 0xff, N * sizeof(float)));
        run_variant(variant, &d, N, C, 256);
        cudaCheck(cudaDeviceSynchronize());
        printf("variant %d\n", variant);
        const bool fused = variant >= 3;
        if (fused) lab_validate("residual", d.residual, residual.data(), n, 0.0f, 0.0f);
        lab_validate("out", d.out, fused ? fused_out.data() : ln_out.data(), n, atol, rtol);
        lab_validate("mean", d.mean, fused ? fused_mean.data() : ln_mean.data(), N, 1e-6f, 1e-5f);
        lab_validate("rstd", d.rstd, fused ? fused_rstd.data() : ln_rstd.data(), N, 0.0f, 1e-5f);
    }
    if (args.variant == 0 || args.variant == 2) {
        // the recompute passes of the trainer ask for the output only
        cudaCheck(cudaMemset(d.out, 0xff, n * sizeof(floatX)));
        layernorm_forward(d.out, nullptr, nullptr, d.inp1, d.weight, d.bias, B, T, C, 0);
        cudaCheck(cudaDeviceSynchronize());
        printf("variant 2 without mean and rstd\n");
        lab_validate("out", d.out, ln_out.data(), n, atol, rtol);
    }

    lab_print_header("layernorm_forward", args.small ? "small sizes" : "GPT-2 124M sizes");
    for (int variant = 1; variant <= 4; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        const double bytes = (variant <= 2 ? 2.0 : 4.0) * n * sizeof(floatX) + 8.0 * N;
        for (int block_size : block_sizes) {
            float ms = lab_time_ms(repeats, [&]() { run_variant(variant, &d, N, C, block_size); });
            lab_print_row(variant, block_size, ms, bytes, 0.0);
        }
    }
    cudaCheck(cudaFree(d.inp1));
    cudaCheck(cudaFree(d.inp2));
    cudaCheck(cudaFree(d.weight));
    cudaCheck(cudaFree(d.bias));
    cudaCheck(cudaFree(d.out));
    cudaCheck(cudaFree(d.residual));
    cudaCheck(cudaFree(d.mean));
    cudaCheck(cudaFree(d.rstd));
    return 0;
}
