// dev/cuda/layernorm_backward.cu: kernel lab for LayerNorm backward: dinp (B,T,C) +=, dweight and dbias (C) +=,
// deterministic (no float atomics).
// Build and run on the CPU backend (small sizes):
//   make build/lab/layernorm_backward_bf16   (build/lab/layernorm_backward_fp32: the fp32 build)
//   build/lab/layernorm_backward_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/layernorm_backward.cu -o layernorm_backward
//   ./layernorm_backward [variant] [-s]       (GPT-2 124M sizes by default: B=8, T=1024, C=768)
// Variants:
//   1  two independent kernels: one warp per row for dinp; one thread per channel summing dweight/dbias over
//      all rows in order (reads dout and inp twice from DRAM, the column sums are long serial chains)
//   2  llmc/layernorm.cuh layernorm_backward: one block per 32 rows computes dinp and that block's partial
//      dweight/dbias (second read of the rows from L1), then a reduction kernel adds the partials in block
//      order. The trainer's.
// Every variant is run twice from the same state to check that the results are bitwise identical.
// Floor (see llmc/layernorm.cuh): bytes = 4*N*C*sizeof(floatX) + 8*N.
#include "common.h"
#include "../../llmc/layernorm.cuh"

__global__ void layernorm_backward_dinp_kernel(floatX* dinp, const floatX* dout, const floatX* inp,
                                               const floatX* weight, const float* mean, const float* rstd, int N,
                                               int C) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= N) return;
    const int lane = threadIdx.x % 32;
    const size_t offset = (size_t)row * C;
    const float m = mean[row], s = rstd[row];
    float g_sum = 0.0f, gn_sum = 0.0f;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 d = load128(dout + offset + c);
        x128 x = load128(inp + offset + c);
        x128 w = load128(weight + c);
        for (int k = 0; k < x128::size; k++) {
            g_sum += (float)d[k] * (float)w[k];
            gn_sum += (float)d[k] * (float)w[k] * ((float)x[k] - m) * s;
        }
    }
    const float g_mean = warp_reduce_sum(g_sum) / C, gn_mean = warp_reduce_sum(gn_sum) / C;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 d = load128(dout + offset + c);
        x128 x = load128(inp + offset + c);
        x128 w = load128(weight + c);
        x128 old_dinp = load128(dinp + offset + c);
        x128 result;
        for (int k = 0; k < x128::size; k++) {
            const float n = ((float)x[k] - m) * s;
            result[k] = (floatX)((float)old_dinp[k] + s * ((float)d[k] * (float)w[k] - g_mean - n * gn_mean));
        }
        store128(dinp + offset + c, result);
    }
}

__global__ void layernorm_backward_columns_kernel(floatX* dweight, floatX* dbias, const floatX* dout,
                                                  const floatX* inp, const float* mean, const float* rstd, int N,
                                                  int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float dweight_sum = 0.0f, dbias_sum = 0.0f;
    for (int row = 0; row < N; row++) {
        const float d = (float)dout[(size_t)row * C + c];
        dweight_sum += d * ((float)inp[(size_t)row * C + c] - mean[row]) * rstd[row];
        dbias_sum += d;
    }
    dweight[c] = (floatX)((float)dweight[c] + dweight_sum);
    dbias[c] = (floatX)((float)dbias[c] + dbias_sum);
}

struct BackwardBuffers {
    floatX* dinp;
    floatX* dweight;
    floatX* dbias;
    float* scratch;
    floatX* dout;
    floatX* inp;
    floatX* weight;
    float* mean;
    float* rstd;
};

static void run_variant(int variant, const BackwardBuffers* d, int B, int T, int C, int block_size) {
    const int N = B * T;
    if (variant == 1) {
        layernorm_backward_dinp_kernel<<<CEIL_DIV(N, block_size / 32), block_size>>>(d->dinp, d->dout, d->inp,
                                                                                      d->weight, d->mean, d->rstd,
                                                                                      N, C);
        cudaCheck(cudaGetLastError());
        layernorm_backward_columns_kernel<<<CEIL_DIV(C, block_size), block_size>>>(d->dweight, d->dbias, d->dout,
                                                                                   d->inp, d->mean, d->rstd, N, C);
        cudaCheck(cudaGetLastError());
    } else if (block_size == LAYERNORM_BACKWARD_BLOCK_SIZE) {
        layernorm_backward(d->dinp, d->dweight, d->dbias, d->scratch, d->dout, d->inp, d->weight, d->mean, d->rstd,
                           B, T, C, 0);
    } else {
        layernorm_backward_launch(d->dinp, d->dweight, d->dbias, d->scratch, d->dout, d->inp, d->weight, d->mean,
                                  d->rstd, N, C, block_size, 0);
    }
}

static std::vector<float> rounded_to_floatX(std::vector<float> values) {
    for (float& v : values) v = (float)(floatX)v;
    return values;
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

// validates the selected variants at (B, T, C), then times them if asked
static void run_lab(const LabArgs* args, int B, int T, int C, bool timed) {
    const int N = B * T;
    const size_t n = (size_t)N * C;

    std::vector<float> inp(n);
    for (int row = 0; row < N; row++) {
        float offset = lab_rand_uniform(-2.0f, 2.0f), scale = lab_rand_uniform(0.5f, 3.0f);
        for (int c = 0; c < C; c++) inp[(size_t)row * C + c] = lab_rand_uniform(-1.0f, 1.0f) * scale + offset;
    }
    inp = rounded_to_floatX(inp);
    std::vector<float> dout = rounded_to_floatX(lab_random(n));
    std::vector<float> weight = rounded_to_floatX(lab_random(C, 0.5f, 1.5f));
    // the accumulated outputs start from random contents (+=)
    std::vector<float> dinp_initial = rounded_to_floatX(lab_random(n));
    std::vector<float> dweight_initial = rounded_to_floatX(lab_random(C));
    std::vector<float> dbias_initial = rounded_to_floatX(lab_random(C));

    // mean and rstd as the forward computes them (fp32 values of the floatX inputs); the reference uses the
    // same fp32 statistics, so it checks the backward alone
    std::vector<float> mean(N), rstd(N);
    for (int row = 0; row < N; row++) {
        const float* x = inp.data() + (size_t)row * C;
        double m = 0.0, v = 0.0;
        for (int c = 0; c < C; c++) m += x[c];
        m /= C;
        for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
        mean[row] = (float)m;
        rstd[row] = (float)(1.0 / sqrt(v / C + 1e-5));
    }
    std::vector<float> dinp_reference(n);
    std::vector<double> dweight_sum(dweight_initial.begin(), dweight_initial.end());
    std::vector<double> dbias_sum(dbias_initial.begin(), dbias_initial.end());
    for (int row = 0; row < N; row++) {
        const size_t offset = (size_t)row * C;
        double g_mean = 0.0, gn_mean = 0.0;
        for (int c = 0; c < C; c++) {
            const double nrm = ((double)inp[offset + c] - mean[row]) * rstd[row];
            g_mean += (double)dout[offset + c] * weight[c];
            gn_mean += (double)dout[offset + c] * weight[c] * nrm;
        }
        g_mean /= C;
        gn_mean /= C;
        for (int c = 0; c < C; c++) {
            const double nrm = ((double)inp[offset + c] - mean[row]) * rstd[row];
            const double g = (double)dout[offset + c] * weight[c];
            dinp_reference[offset + c] = (float)(dinp_initial[offset + c] + rstd[row] * (g - g_mean - nrm * gn_mean));
            dweight_sum[c] += dout[offset + c] * nrm;
            dbias_sum[c] += dout[offset + c];
        }
    }
    std::vector<float> dweight_reference(dweight_sum.begin(), dweight_sum.end());
    std::vector<float> dbias_reference(dbias_sum.begin(), dbias_sum.end());

    BackwardBuffers d;
    d.dinp = lab_poisoned<floatX>(n);
    d.dweight = lab_poisoned<floatX>(C);
    d.dbias = lab_poisoned<floatX>(C);
    const size_t scratch_floats = layernorm_backward_scratch_floats(B, T, C);
    d.scratch = lab_poisoned<float>(scratch_floats);  // the kernel must write every partial it reads
    d.dout = lab_to_device<floatX>(dout);
    d.inp = lab_to_device<floatX>(inp);
    d.weight = lab_to_device<floatX>(weight);
    d.mean = lab_to_device<float>(mean);
    d.rstd = lab_to_device<float>(rstd);

    // dinp: fp32 row sums of C terms and a few operations per element (|dinp| ~ 1..10, errors ~1e-6
    // relative): fp32 rtol 1e-5, atol 1e-5; bf16 adds one rounding of the result (<= 2^-8): rtol 5e-3.
    // dweight/dbias: sums over N rows in fp32 (32-row partials, then the partials) against double; the
    // rounding errors of the N terms add up like a random walk: at N = 8192 (|sum| up to ~100) the largest
    // error seen is 3e-5 absolute, ~1e-6 relative, so fp32 rtol 1e-5 and atol 5e-5 for the sums near 0;
    // bf16 adds one rounding of the result (<= 2^-8 relative): rtol 5e-3.
    const float rtol = PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 5e-3f;
    const float dinp_atol = 1e-5f;
    const float sums_atol = 5e-5f;
    const double bytes = 4.0 * n * sizeof(floatX) + 8.0 * N;
    const int repeats = args->small ? 3 : 50;
    const int block_sizes[] = {128, 256, 512};

    printf("layernorm_backward (%s): B=%d T=%d C=%d\n", PRECISION_NAME, B, T, C);
    for (int variant = 1; variant <= 2; variant++) {
        if (args->variant != 0 && args->variant != variant) continue;
        printf("variant %d\n", variant);
        std::vector<char> first[3];
        for (int run = 0; run < 2; run++) {
            upload(d.dinp, dinp_initial);
            upload(d.dweight, dweight_initial);
            upload(d.dbias, dbias_initial);
            cudaCheck(cudaMemset(d.scratch, 0xff, scratch_floats * sizeof(float)));
            run_variant(variant, &d, B, T, C, LAYERNORM_BACKWARD_BLOCK_SIZE);
            cudaCheck(cudaDeviceSynchronize());
            std::vector<char> results[3] = {download_bytes(d.dinp, n), download_bytes(d.dweight, C),
                                            download_bytes(d.dbias, C)};
            if (run == 0) {
                for (int i = 0; i < 3; i++) first[i] = results[i];
            } else if (results[0] != first[0] || results[1] != first[1] || results[2] != first[2]) {
                printf("FAIL: two runs from the same state differ\n");
                exit(EXIT_FAILURE);
            }
        }
        lab_validate("dinp", d.dinp, dinp_reference.data(), n, dinp_atol, rtol);
        lab_validate("dweight", d.dweight, dweight_reference.data(), C, sums_atol, rtol);
        lab_validate("dbias", d.dbias, dbias_reference.data(), C, sums_atol, rtol);
        printf("  %-28s ok (two runs bitwise identical)\n", "determinism");
    }
    if (timed) lab_print_header("layernorm_backward", args->small ? "small sizes" : "GPT-2 124M sizes");
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
    cudaCheck(cudaFree(d.dbias));
    cudaCheck(cudaFree(d.scratch));
    cudaCheck(cudaFree(d.dout));
    cudaCheck(cudaFree(d.inp));
    cudaCheck(cudaFree(d.weight));
    cudaCheck(cudaFree(d.mean));
    cudaCheck(cudaFree(d.rstd));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    if (!args.small) {
        run_lab(&args, 8, 1024, 768, true);
        return 0;
    }
    // N = 111: the last block of 32 rows is partial. C = 296 (37 vectors in bf16) gives a block several
    // slices of rows; C = 2056 (257 vectors) gives one slice, with a thread owning two channel chunks.
    run_lab(&args, 3, 37, 296, true);
    run_lab(&args, 2, 19, 2056, false);
    return 0;
}
