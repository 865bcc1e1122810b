// dev/cuda/rmsnorm_backward.cu: kernel lab for RMSNorm backward: dinp (B,T,C) +=, dweight (C) +=, deterministic
// (no float atomics).
// Build and run on the CPU backend (small sizes):
//   make build/lab/rmsnorm_backward_bf16   (build/lab/rmsnorm_backward_fp32: the fp32 build)
//   build/lab/rmsnorm_backward_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/rmsnorm_backward.cu -o rmsnorm_backward
//   ./rmsnorm_backward [variant] [-s]       (GPT-2 124M sizes by default: B=8, T=1024, C=768)
// Variants:
//   1  two independent kernels: one warp per row for dinp; one thread per channel summing dweight over all rows
//      in order (reads dout and inp twice from DRAM, the column sums are long serial chains)
//   2  llmc/rmsnorm.cuh rmsnorm_backward: one block per 32 rows computes dinp and that block's partial dweight
//      (second read of the rows from L1), then common.cuh's block_partials_accumulate adds the partials in block
//      order. The trainer's.
// The double-precision reference is itself checked first against central differences of the forward (in double).
// Every variant is run twice from the same state to check that the results are bitwise identical.
// Floor (see llmc/rmsnorm.cuh): bytes = 4*N*C*sizeof(floatX) + 4*N.
#include "common.h"
#include "../../llmc/rmsnorm.cuh"

__global__ void rmsnorm_backward_dinp_kernel(floatX* dinp, const floatX* dout, const floatX* inp, const floatX* weight,
                                             const float* rstd, int N, int C) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= N) return;
    const int lane = threadIdx.x % 32;
    const size_t offset = (size_t)row * C;
    const float s = rstd[row];
    float gn_sum = 0.0f;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 d = load128(dout + offset + c);
        x128 x = load128(inp + offset + c);
        x128 w = load128(weight + c);
        for (int k = 0; k < x128::size; k++) gn_sum += (float)d[k] * (float)w[k] * (float)x[k] * s;
    }
    const float gn_mean = warp_reduce_sum(gn_sum) / C;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 d = load128(dout + offset + c);
        x128 x = load128(inp + offset + c);
        x128 w = load128(weight + c);
        x128 old_dinp = load128(dinp + offset + c);
        x128 result;
        for (int k = 0; k < x128::size; k++) {
            result[k] = (floatX)((float)old_dinp[k] + s * ((float)d[k] * (float)w[k] - (float)x[k] * s * gn_mean));
        }
        store128(dinp + offset + c, result);
    }
}

__global__ void rmsnorm_backward_columns_kernel(floatX* dweight, const floatX* dout, const floatX* inp,
                                                const float* rstd, int N, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float dweight_sum = 0.0f;
    for (int row = 0; row < N; row++) {
        dweight_sum += (float)dout[(size_t)row * C + c] * (float)inp[(size_t)row * C + c] * rstd[row];
    }
    dweight[c] = (floatX)((float)dweight[c] + dweight_sum);
}

struct BackwardBuffers {
    floatX* dinp;
    floatX* dweight;
    float* scratch;
    floatX* dout;
    floatX* inp;
    floatX* weight;
    float* rstd;
};

static void run_variant(int variant, const BackwardBuffers* d, int B, int T, int C, int block_size) {
    const int N = B * T;
    if (variant == 1) {
        rmsnorm_backward_dinp_kernel<<<CEIL_DIV(N, block_size / 32), block_size>>>(d->dinp, d->dout, d->inp, d->weight,
                                                                                    d->rstd, N, C);
        cudaCheck(cudaGetLastError());
        rmsnorm_backward_columns_kernel<<<CEIL_DIV(C, block_size), block_size>>>(d->dweight, d->dout, d->inp, d->rstd,
                                                                                 N, C);
        cudaCheck(cudaGetLastError());
    } else if (block_size == RMSNORM_BACKWARD_BLOCK_SIZE) {
        rmsnorm_backward(d->dinp, d->dweight, d->scratch, d->dout, d->inp, d->weight, d->rstd, B, T, C, 0);
    } else {
        rmsnorm_backward_launch(d->dinp, d->dweight, d->scratch, d->dout, d->inp, d->weight, d->rstd, N, C, block_size,
                                0);
    }
}

static void upload(floatX* device, const std::vector<float>& host) {
    std::vector<floatX> converted(host.size());
    for (size_t i = 0; i < host.size(); i++) converted[i] = (floatX)host[i];
    cudaCheck(cudaMemcpy(device, converted.data(), host.size() * sizeof(floatX), cudaMemcpyHostToDevice));
}

static std::vector<char> download_bytes(const floatX* device, size_t n) {
    std::vector<char> bytes(n * sizeof(floatX));
    cudaCheck(cudaMemcpy(bytes.data(), device, bytes.size(), cudaMemcpyDeviceToHost));
    return bytes;
}

// double-precision rmsnorm of one row: out = x * rstd * weight; returns rstd
static double rmsnorm_row_double(double* out, const double* x, const double* weight, int C, double eps) {
    double squares = 0.0;
    for (int c = 0; c < C; c++) squares += x[c] * x[c];
    const double s = 1.0 / sqrt(squares / C + eps);
    for (int c = 0; c < C; c++) out[c] = x[c] * s * weight[c];
    return s;
}

// the backward formula the reference below uses, dx = rstd * (g - n * mean_c(g * n)) and dweight = dout * n, for
// one row, against central differences of L = sum_c dout_c * rmsnorm(x)_c in double; exits non-zero when not
// within 1e-7 relative (the differences' truncation error is ~h^2 = 1e-12 relative, their rounding ~1e-16 / h)
static void check_reference_formula(int C, double eps) {
    std::vector<double> x(C), weight(C), dout(C), out(C), dx(C), dweight(C);
    for (int c = 0; c < C; c++) {
        x[c] = lab_rand_uniform(-0.1f, 0.1f) + 0.02;
        weight[c] = lab_rand_uniform(-1.5f, 1.5f);
        dout[c] = lab_rand_uniform(-1.0f, 1.0f);
    }
    const double s = rmsnorm_row_double(out.data(), x.data(), weight.data(), C, eps);
    double gn_mean = 0.0;
    for (int c = 0; c < C; c++) gn_mean += dout[c] * weight[c] * x[c] * s;
    gn_mean /= C;
    for (int c = 0; c < C; c++) {
        dx[c] = s * (dout[c] * weight[c] - x[c] * s * gn_mean);
        dweight[c] = dout[c] * x[c] * s;
    }
    auto loss = [&](const std::vector<double>& xs, const std::vector<double>& ws) {
        std::vector<double> o(C);
        rmsnorm_row_double(o.data(), xs.data(), ws.data(), C, eps);
        double l = 0.0;
        for (int c = 0; c < C; c++) l += dout[c] * o[c];
        return l;
    };
    double worst = 0.0, largest = 0.0;
    for (int c = 0; c < C; c++) {
        const double h = 1e-6 * fmax(fabs(x[c]), 1e-3);
        std::vector<double> plus = x, minus = x;
        plus[c] += h;
        minus[c] -= h;
        const double numeric_dx = (loss(plus, weight) - loss(minus, weight)) / (2.0 * h);
        std::vector<double> wplus = weight, wminus = weight;
        wplus[c] += 1e-6;
        wminus[c] -= 1e-6;
        const double numeric_dweight = (loss(x, wplus) - loss(x, wminus)) / 2e-6;
        worst = fmax(worst, fmax(fabs(numeric_dx - dx[c]), fabs(numeric_dweight - dweight[c])));
        largest = fmax(largest, fmax(fabs(dx[c]), fabs(dweight[c])));
    }
    if (!(worst <= 1e-7 * largest)) {
        printf("FAIL reference formula: worst difference %.3g against central differences (largest gradient %.3g)\n",
               worst, largest);
        exit(EXIT_FAILURE);
    }
    printf("  %-28s ok (worst difference %.3g, largest gradient %.3g, C=%d, eps %g)\n", "reference vs differences",
           worst, largest, C, eps);
}

// validates the selected variants at (B, T, C), then times them if asked
static void run_lab(const LabArgs* args, int B, int T, int C, bool timed) {
    const int N = B * T;
    const size_t n = (size_t)N * C;

    std::vector<float> inp(n);
    for (int row = 0; row < N; row++) {
        float offset = lab_rand_uniform(-1.0f, 1.0f), scale = lab_rand_uniform(0.5f, 3.0f);
        for (int c = 0; c < C; c++) inp[(size_t)row * C + c] = lab_rand_uniform(-1.0f, 1.0f) * scale + offset;
    }
    inp = lab_rounded(inp);
    std::vector<float> dout = lab_random_rounded(n, -1.0f, 1.0f);
    std::vector<float> weight = lab_random_rounded(C, -1.5f, 1.5f);
    // the accumulated outputs start from random contents (+=)
    std::vector<float> dinp_initial = lab_random_rounded(n, -1.0f, 1.0f);
    std::vector<float> dweight_initial = lab_random_rounded(C, -1.0f, 1.0f);

    // rstd as the forward computes it (the fp32 value for the floatX inputs, eps 1e-5); the reference uses the same
    // fp32 rstd, so it checks the backward alone
    std::vector<float> rstd(N);
    for (int row = 0; row < N; row++) {
        const float* x = inp.data() + (size_t)row * C;
        double squares = 0.0;
        for (int c = 0; c < C; c++) squares += (double)x[c] * x[c];
        rstd[row] = (float)(1.0 / sqrt(squares / C + RMSNORM_DEFAULT_EPS));
    }
    std::vector<float> dinp_reference(n);
    std::vector<double> dweight_sum(dweight_initial.begin(), dweight_initial.end());
    for (int row = 0; row < N; row++) {
        const size_t offset = (size_t)row * C;
        const double s = rstd[row];
        double gn_mean = 0.0;
        for (int c = 0; c < C; c++) gn_mean += (double)dout[offset + c] * weight[c] * inp[offset + c] * s;
        gn_mean /= C;
        for (int c = 0; c < C; c++) {
            const double nrm = (double)inp[offset + c] * s;
            const double g = (double)dout[offset + c] * weight[c];
            dinp_reference[offset + c] = (float)(dinp_initial[offset + c] + s * (g - nrm * gn_mean));
            dweight_sum[c] += dout[offset + c] * nrm;
        }
    }
    std::vector<float> dweight_reference(dweight_sum.begin(), dweight_sum.end());

    BackwardBuffers d;
    d.dinp = lab_poisoned<floatX>(n);
    d.dweight = lab_poisoned<floatX>(C);
    const size_t scratch_floats = rmsnorm_backward_scratch_floats(B, T, C);
    d.scratch = lab_poisoned<float>(scratch_floats);  // the kernel must write every partial it reads
    d.dout = lab_to_device<floatX>(dout);
    d.inp = lab_to_device<floatX>(inp);
    d.weight = lab_to_device<floatX>(weight);
    d.rstd = lab_to_device<float>(rstd);

    // dinp: fp32 row sums of C terms and a few operations per element (|dinp| ~ 1..5, errors ~1e-6 relative):
    // fp32 rtol 1e-5, atol 1e-5; bf16 adds one rounding of the result (<= 2^-8): rtol 5e-3.
    // dweight: sums over N rows in fp32 (32-row partials, then the partials) against double, the rounding errors of
    // the N terms adding up like a random walk (as layernorm_backward's lab: ~1e-6 relative at N = 8192): fp32 rtol
    // 1e-5 and atol 5e-5 for the sums near 0; bf16 adds one rounding of the result (<= 2^-8 relative): rtol 5e-3.
    const float rtol = PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 5e-3f;
    const float dinp_atol = 1e-5f;
    const float dweight_atol = 5e-5f;
    const double bytes = 4.0 * n * sizeof(floatX) + 4.0 * N;
    const int repeats = args->small ? 3 : 50;
    const int block_sizes[] = {128, 256, 512};

    printf("rmsnorm_backward (%s): B=%d T=%d C=%d\n", PRECISION_NAME, B, T, C);
    for (int variant = 1; variant <= 2; variant++) {
        if (args->variant != 0 && args->variant != variant) continue;
        printf("variant %d\n", variant);
        std::vector<char> first[2];
        for (int run = 0; run < 2; run++) {
            upload(d.dinp, dinp_initial);
            upload(d.dweight, dweight_initial);
            cudaCheck(cudaMemset(d.scratch, 0xff, scratch_floats * sizeof(float)));
            run_variant(variant, &d, B, T, C, RMSNORM_BACKWARD_BLOCK_SIZE);
            cudaCheck(cudaDeviceSynchronize());
            std::vector<char> results[2] = {download_bytes(d.dinp, n), download_bytes(d.dweight, C)};
            if (run == 0) {
                for (int i = 0; i < 2; i++) first[i] = results[i];
            } else if (results[0] != first[0] || results[1] != first[1]) {
                printf("FAIL: two runs from the same state differ\n");
                exit(EXIT_FAILURE);
            }
        }
        lab_validate("dinp", d.dinp, dinp_reference.data(), n, dinp_atol, rtol);
        lab_validate("dweight", d.dweight, dweight_reference.data(), C, dweight_atol, rtol);
        printf("  %-28s ok (two runs bitwise identical)\n", "determinism");
    }
    if (timed) lab_print_header("rmsnorm_backward", args->small ? "small sizes" : "GPT-2 124M sizes");
    for (int variant = 1; variant <= 2 && timed; variant++) {
        if (args->variant != 0 && args->variant != variant) continue;
        for (int block_size : block_sizes) {
            // += outputs drift over the repeats; only the timing sees them
            float ms = lab_time_ms(repeats, [&]() { run_variant(variant, &d, B, T, C, block_size); });
            lab_print_row(variant, block_size, ms, bytes, 0.0);
        }
    }
    cudaCheck(cudaFree(d.dinp));
    cudaCheck(cudaFree(d.dweight));
    cudaCheck(cudaFree(d.scratch));
    cudaCheck(cudaFree(d.dout));
    cudaCheck(cudaFree(d.inp));
    cudaCheck(cudaFree(d.weight));
    cudaCheck(cudaFree(d.rstd));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    printf("rmsnorm_backward reference\n");
    check_reference_formula(48, 1e-5);
    check_reference_formula(48, 1e-2);  // eps comparable to mean(x^2): its place in rstd matters
    if (!args.small) {
        run_lab(&args, 8, 1024, 768, true);
        return 0;
    }
    // N = 111: the last block of 32 rows is partial. C = 296 (37 vectors in bf16) gives a block several slices of
    // rows; C = 2056 (257 vectors) gives one slice, with a thread owning two channel chunks.
    run_lab(&args, 3, 37, 296, true);
    run_lab(&args, 2, 19, 2056, false);
    return 0;
}
