// dev/cuda/quantize.cu: kernel lab for weight-only quantisation (llmc/quantize.cuh), both formats: int8 with a
// per-output-channel absmax scale, and NF4 (64-weight absmax blocks, the absmax values double-quantised in groups of
// 256 blocks). For a weight W (OC, C): quantize_* (checked against a double-precision reference, code for code),
// dequantize_* (bit for bit), and matmul_forward_* out (N, OC) = inp (N, C) . dequant(W)^T + bias.
// Build and run on the CPU backend (small sizes):
//   make build/lab/quantize_bf16   (build/lab/quantize_fp32: the fp32 build)
//   build/lab/quantize_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/quantize.cu -o quantize
//   ./quantize [variant] [-s]
// Variants of the matmuls (each format):
//   1  a thread per output (n, o), dequantising row o's weights as it walks C (the baseline)
//   2  llmc/quantize.cuh matmul_forward_int8 / matmul_forward_nf4: a warp per output channel and a tile of up to 8
//      input rows, 16-byte code loads dequantised once into registers; timed at 2, 4 and 8 warps per block.
// Cases. -s: C = 64 and 128 with OC = 48 and 96, and C = 320, OC = 64 (320 NF4 blocks: a second absmax group of 64
// that begins inside row 51), N = 1, 3, 17 (17: three tiles, the last of one row); weights uniform in [-1, 1] with a
// zero row, and in one case an outlier weight (40) that sets its row's scale and its NF4 block's absmax; bias in all
// but N = 3. Full size: GPT-2 124M's qkv (2304, 768), fc (3072, 768) and proj (768, 3072) weights, Llama-3 8B's
// MLP (14336, 4096) and (4096, 14336), N = 1, 8, 64, weights Gaussian (0.02). Outputs and quantised buffers start
// poisoned (NaN bytes), so an element a kernel forgets fails.
// Reference. int8: the scale must equal fl(absmax / 127) exactly; a code is rint(W / scale) in double with the
// device's fp32 scale. NF4: the block absmax is exact; a code is the level nearest W / a_b in double; the group mean
// within fp32 summation error of the double mean; the group scale exactly max |fl(a_b - m_g)| over the device's m_g;
// the absmax codes rint((a_b - m_g) / fl(s_g / 127)) in double over the device's m_g and s_g. Ties: the device
// rounds an fp32 quotient, the reference the exact one, so a code may differ by one only where the exact value lies
// within fp32 rounding of a rounding boundary (a half-integer, or an NF4 midpoint): those are accepted, counted and
// printed; any other difference fails. The matmul reference sums, in double, the inputs times the fp32 dequantised
// weights (from the device's codes, as llmc/quantize.cuh defines them).
// Quantisation error: a Gaussian (OC, C) weight ((256, 1024) with -s, (4096, 4096) full size), max and RMS of
// W - dequant(W) (the matmul's fp32 values) relative to W's RMS.
// Floor (llmc/quantize.cuh): int8 OC C + 4 OC bytes of weights, NF4 OC C / 2 + OC C / 64 + 8 ceil(OC C / 16384), plus
// N C X inputs, N OC X outputs and OC X bias, X = sizeof(floatX); the timing rows give bytes / time against the
// GPU's peak bandwidth (memory-bound up to N ~ 7 in int8, ~3 in NF4; beyond, the CUDA cores' FMAs are the limit).
#include <algorithm>
#include "common.h"
#include "../../llmc/quantize.cuh"

static const float nf4_levels_host[16] = NF4_LEVELS;

// ----------------------------------------------------------------------------------------------------
// Variant 1: a thread per output (n, o)
__global__ void matmul_int8_serial_kernel(floatX* out, const floatX* inp, const int8_t* q, const float* scale,
                                          const floatX* bias, int N, int C, int OC) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= N * OC) return;
    const int n = idx / OC, o = idx % OC;
    float acc = 0.0f;
    for (int c = 0; c < C; c++)
        acc = fmaf((float)inp[(size_t)n * C + c], int8_weight(q[(size_t)o * C + c], scale[o]), acc);
    out[idx] = (floatX)(acc + (bias != NULL ? (float)bias[o] : 0.0f));
}

__global__ void matmul_nf4_serial_kernel(floatX* out, const floatX* inp, Nf4Weights q, const floatX* bias, int N,
                                         int C, int OC) {
    __shared__ float levels[16];
    nf4_levels_to_shared(levels);
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= N * OC) return;
    const int n = idx / OC, o = idx % OC;
    float acc = 0.0f;
    for (int c = 0; c < C; c++) {
        const size_t e = (size_t)o * C + c;
        const uint8_t byte = q.codes[e / 2];
        const float w = levels[e % 2 == 0 ? byte & 15 : byte >> 4] * nf4_block_absmax(q, (int)(e / NF4_BLOCK));
        acc = fmaf((float)inp[(size_t)n * C + c], w, acc);
    }
    out[idx] = (floatX)(acc + (bias != NULL ? (float)bias[o] : 0.0f));
}

// ----------------------------------------------------------------------------------------------------
// host side: the weights as floatX holds them, the quantised form copied back, its fp32 dequantised values
struct QuantCase {
    const char* name;
    int OC, C;
    std::vector<int> Ns;
    bool outlier;   // one weight of 40 (row 1, column C / 2 + 3)
    bool gaussian;  // N(0, 0.02) weights (full size), else uniform in [-1, 1]
};

static float lab_rand_gaussian(float sigma) {
    const float u1 = lab_rand_uniform(0.0f, 1.0f), u2 = lab_rand_uniform(0.0f, 1.0f);
    return sigma * sqrtf(-2.0f * logf(1.0f - u1)) * cosf(6.2831853f * u2);  // 1 - u1 in (0, 1]
}

static std::vector<float> make_weights(int OC, int C, bool gaussian, bool outlier, bool zero_row) {
    std::vector<float> w((size_t)OC * C);
    for (float& x : w) x = gaussian ? lab_rand_gaussian(0.02f) : lab_rand_uniform(-1.0f, 1.0f);
    if (zero_row)
        for (int c = 0; c < C; c++) w[(size_t)(OC / 3) * C + c] = 0.0f;
    if (outlier) w[(size_t)1 * C + C / 2 + 3] = 40.0f;
    return lab_rounded(w);
}

template <class T>
static std::vector<T> to_host(const T* d, size_t n) {
    std::vector<T> h(n);
    cudaCheck(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

// a code against the reference: equal, or one off where the exact value is within `window` of the boundary between
// the two; returns false on any other difference, counts the accepted ties
static bool code_matches(int got, int want, double boundary_distance, double window, long* ties) {
    if (got == want) return true;
    if (abs(got - want) == 1 && boundary_distance <= window) {
        (*ties)++;
        return true;
    }
    return false;
}

static void fail(const char* what) {
    printf("FAIL %s\n", what);
    exit(EXIT_FAILURE);
}

// int8: checks the device's scale and codes; returns the fp32 dequantised weights (OC, C)
static std::vector<float> check_int8(const std::vector<float>& w, const int8_t* d_q, const float* d_scale, int OC,
                                     int C) {
    const std::vector<int8_t> q = to_host(d_q, (size_t)OC * C);
    const std::vector<float> scale = to_host(d_scale, (size_t)OC);
    long ties = 0;
    char what[256];
    for (int o = 0; o < OC; o++) {
        double absmax = 0.0;
        for (int c = 0; c < C; c++) absmax = fmax(absmax, fabs((double)w[(size_t)o * C + c]));
        const float want_scale = (float)(absmax / 127.0);  // double then float: the correctly rounded fp32 quotient
        if (memcmp(&scale[o], &want_scale, sizeof(float)) != 0) {
            snprintf(what, sizeof(what), "int8 scale[%d]: got %.9g, want %.9g", o, scale[o], want_scale);
            fail(what);
        }
        for (int c = 0; c < C; c++) {
            const size_t e = (size_t)o * C + c;
            const double ratio = scale[o] > 0.0f ? (double)w[e] / scale[o] : 0.0;
            const int want = (int)std::max(-127.0, std::min(127.0, nearbyint(ratio)));
            const double frac = fabs(ratio - floor(ratio) - 0.5);  // distance to the half-integer between
            if (!code_matches(q[e], want, frac, 1e-5, &ties)) {
                snprintf(what, sizeof(what), "int8 q[%d, %d]: got %d, want %d (W / scale = %.9g)", o, c, q[e], want,
                         ratio);
                fail(what);
            }
        }
    }
    printf("  %-28s ok (scales exact, codes exact but %ld within fp32 rounding of a half-integer)\n", "quantize_int8",
           ties);
    std::vector<float> dq((size_t)OC * C);
    for (size_t e = 0; e < dq.size(); e++) dq[e] = (float)q[e] * scale[e / C];
    return dq;
}

// NF4: checks the device's codes, absmax codes, group means and scales; returns the fp32 dequantised weights
static std::vector<float> check_nf4(const std::vector<float>& w, const Nf4Weights& d, int OC, int C) {
    const int blocks = (int)((size_t)OC * C / NF4_BLOCK), groups = CEIL_DIV(blocks, NF4_GROUP);
    const std::vector<uint8_t> codes = to_host(d.codes, (size_t)OC * C / 2);
    const std::vector<int8_t> absmax_codes = to_host(d.absmax_codes, (size_t)blocks);
    const std::vector<float> group_scale = to_host(d.group_scale, (size_t)groups);
    const std::vector<float> group_mean = to_host(d.group_mean, (size_t)groups);
    std::vector<float> absmax(blocks);
    for (int b = 0; b < blocks; b++) {
        double a = 0.0;
        for (int k = 0; k < NF4_BLOCK; k++) a = fmax(a, fabs((double)w[(size_t)b * NF4_BLOCK + k]));
        absmax[b] = (float)a;  // exact: a floatX value
    }
    long ties = 0, absmax_ties = 0;
    char what[256];
    std::vector<float> dq((size_t)OC * C);
    for (int g = 0; g < groups; g++) {
        const int first = g * NF4_GROUP, n = std::min(NF4_GROUP, blocks - first);
        double sum = 0.0;
        for (int b = first; b < first + n; b++) sum += absmax[b];
        const double mean = sum / n, m = group_mean[g];
        // fp32 sum of n <= 256 positive terms: relative error below n 2^-24, 2^-16 is a bound with room
        if (!(fabs(m - mean) <= mean * 1.5e-5 + 1e-30)) {
            snprintf(what, sizeof(what), "nf4 group_mean[%d]: got %.9g, want %.9g", g, m, mean);
            fail(what);
        }
        double deviation = 0.0;
        for (int b = first; b < first + n; b++) deviation = fmax(deviation, fabs((double)absmax[b] - m));
        const float want_scale = (float)deviation;  // max of the rounded differences = rounding of the max
        if (memcmp(&group_scale[g], &want_scale, sizeof(float)) != 0) {
            snprintf(what, sizeof(what), "nf4 group_scale[%d]: got %.9g, want %.9g", g, group_scale[g], want_scale);
            fail(what);
        }
        const float step = group_scale[g] / 127.0f;  // host IEEE division: llmc's __fdiv_rn
        for (int b = first; b < first + n; b++) {
            const double ratio = step > 0.0f ? ((double)absmax[b] - m) / step : 0.0;
            const int want = (int)std::max(-127.0, std::min(127.0, nearbyint(ratio)));
            // two fp32 roundings (the difference, the quotient) of a value below 128: within 2^-16
            if (!code_matches(absmax_codes[b], want, fabs(ratio - floor(ratio) - 0.5), 3e-5, &absmax_ties)) {
                snprintf(what, sizeof(what), "nf4 absmax_codes[%d]: got %d, want %d ((a - m) / step = %.9g)", b,
                         absmax_codes[b], want, ratio);
                fail(what);
            }
            const float a = fmaf((float)absmax_codes[b], step, group_mean[g]);  // nf4_block_absmax
            for (int k = 0; k < NF4_BLOCK; k++) {
                const size_t e = (size_t)b * NF4_BLOCK + k;
                const double x = absmax[b] > 0.0f ? (double)w[e] / absmax[b] : 0.0;
                int want_code = 0;
                for (int l = 1; l < 16; l++)
                    if (fabs(x - nf4_levels_host[l]) < fabs(x - nf4_levels_host[want_code])) want_code = l;
                const int got = e % 2 == 0 ? codes[e / 2] & 15 : codes[e / 2] >> 4;
                const int low = std::min(got, want_code);
                const double midpoint = 0.5 * ((double)nf4_levels_host[low] + nf4_levels_host[std::min(low + 1, 15)]);
                // x in [-1, 1]: the fp32 quotient and the fp32 midpoint are within 2^-24 of the exact ones
                if (!code_matches(got, want_code, fabs(x - midpoint), 1e-6, &ties)) {
                    snprintf(what, sizeof(what), "nf4 code of W[%zu, %zu]: got %d, want %d (W / absmax = %.9g)",
                             e / C, e % C, got, want_code, x);
                    fail(what);
                }
                dq[e] = nf4_levels_host[got] * a;
            }
        }
    }
    printf("  %-28s ok (%d blocks in %d groups; codes exact but %ld at an NF4 midpoint, absmax codes exact but %ld "
           "at a half-integer)\n", "quantize_nf4", blocks, groups, ties, absmax_ties);
    return dq;
}

// dequantize_*'s output, bit for bit the floatX rounding of the fp32 dequantised weights
static void check_dequantized(const char* name, const floatX* d_w, const std::vector<float>& dq) {
    const std::vector<floatX> got = to_host(d_w, dq.size());
    for (size_t e = 0; e < dq.size(); e++) {
        const floatX want = (floatX)dq[e];
        if (memcmp(&got[e], &want, sizeof(floatX)) != 0) {
            printf("FAIL %s[%zu]: got %.9g, want %.9g\n", name, e, (float)got[e], (float)want);
            exit(EXIT_FAILURE);
        }
    }
    printf("  %-28s ok (bit for bit (floatX) of the fp32 dequantised weights, %zu elements)\n", name, dq.size());
}

// matmul output rows `rows` against the double reference: |got - want| <= 1e-5 sum_c |x w| (fp32 accumulation over
// C <= 14336 terms in a few sequential runs and a butterfly: its error stays far below that) + half an ulp of floatX
static void check_matmul(const char* name, const floatX* d_out, const std::vector<float>& inp,
                         const std::vector<float>& dq, const std::vector<float>& bias, bool with_bias, int N, int C,
                         int OC, const std::vector<int>& rows) {
#if defined(ENABLE_FP32)
    const double rtol = 1e-6;
#elif defined(ENABLE_FP16)
    const double rtol = 5e-4;
#else
    const double rtol = 4e-3;
#endif
    const std::vector<floatX> got = to_host(d_out, (size_t)N * OC);
    double worst = 0.0;
    for (int n : rows)
        for (int o = 0; o < OC; o++) {
            double sum = with_bias ? bias[o] : 0.0, magnitude = with_bias ? fabs(bias[o]) : 0.0;
            for (int c = 0; c < C; c++) {
                const double p = (double)inp[(size_t)n * C + c] * dq[(size_t)o * C + c];
                sum += p;
                magnitude += fabs(p);
            }
            const double g = (float)got[(size_t)n * OC + o], err = fabs(g - sum);
            if (!(err <= 1e-5 * magnitude + rtol * fabs(sum) + 1e-30)) {
                printf("FAIL %s: out[%d, %d] = %.9g, want %.9g (sum |x w| %.3g)\n", name, n, o, g, sum, magnitude);
                exit(EXIT_FAILURE);
            }
            worst = std::max(worst, err);
        }
    printf("  %-28s ok (max abs err %.3g over %zu of %d rows)\n", name, worst, rows.size(), N);
}

// ----------------------------------------------------------------------------------------------------
struct DeviceWeights {
    int8_t* q;
    float* scale;
    Nf4Weights nf4;
};

static void run_matmul(bool nf4, int variant, int warps, floatX* out, const floatX* inp, const DeviceWeights& d,
                       const floatX* bias, int N, int C, int OC) {
    if (variant == 1) {
        const int threads = 128, grid = CEIL_DIV(N * OC, threads);
        if (nf4) matmul_nf4_serial_kernel<<<grid, threads>>>(out, inp, d.nf4, bias, N, C, OC);
        else matmul_int8_serial_kernel<<<grid, threads>>>(out, inp, d.q, d.scale, bias, N, C, OC);
        cudaCheck(cudaGetLastError());
    } else if (warps == QUANTIZE_WARPS) {
        if (nf4) matmul_forward_nf4(out, inp, &d.nf4, bias, N, C, OC, 0);
        else matmul_forward_int8(out, inp, d.q, d.scale, bias, N, C, OC, 0);
    } else {
        if (nf4) matmul_forward_nf4_launch(out, inp, &d.nf4, bias, N, C, OC, warps, 0);
        else matmul_forward_int8_launch(out, inp, d.q, d.scale, bias, N, C, OC, warps, 0);
    }
}

static double weight_bytes(bool nf4, int OC, int C) {
    return nf4 ? (double)nf4_bytes(OC, C) : (double)OC * C + 4.0 * OC;
}

static void run_case(const LabArgs& args, const QuantCase& k, bool timed) {
    const int OC = k.OC, C = k.C;
    const size_t n_w = (size_t)OC * C;
    printf("quantize (%s) %s: W (%d, %d), N = ", PRECISION_NAME, k.name, OC, C);
    for (int N : k.Ns) printf("%d ", N);
    printf("\n");
    const std::vector<float> w = make_weights(OC, C, k.gaussian, k.outlier, true);
    const int max_N = *std::max_element(k.Ns.begin(), k.Ns.end());
    const std::vector<float> inp = lab_random_rounded((size_t)max_N * C, -1.0f, 1.0f);
    const std::vector<float> bias = lab_random_rounded((size_t)OC, -1.0f, 1.0f);
    floatX* d_w = lab_to_device<floatX>(w);
    floatX* d_inp = lab_to_device<floatX>(inp);
    floatX* d_bias = lab_to_device<floatX>(bias);
    DeviceWeights d;
    d.q = lab_poisoned<int8_t>(n_w);
    d.scale = lab_poisoned<float>((size_t)OC);
    nf4_allocate(&d.nf4, OC, C);
    cudaCheck(cudaMemset(d.nf4.codes, 0xff, n_w / 2));
    floatX* d_dequant = lab_poisoned<floatX>(n_w);
    floatX* d_out = lab_poisoned<floatX>((size_t)max_N * OC);
    floatX* d_out_again = lab_poisoned<floatX>((size_t)max_N * OC);

    quantize_int8(d.q, d.scale, d_w, OC, C, 0);
    quantize_nf4(&d.nf4, d_w, OC, C, 0);
    cudaCheck(cudaDeviceSynchronize());
    std::vector<float> dq[2];
    dq[0] = check_int8(w, d.q, d.scale, OC, C);
    dq[1] = check_nf4(w, d.nf4, OC, C);
    dequantize_int8(d_dequant, d.q, d.scale, OC, C, 0);
    cudaCheck(cudaDeviceSynchronize());
    check_dequantized("dequantize_int8", d_dequant, dq[0]);
    cudaCheck(cudaMemset(d_dequant, 0xff, n_w * sizeof(floatX)));
    dequantize_nf4(d_dequant, &d.nf4, OC, C, 0);
    cudaCheck(cudaDeviceSynchronize());
    check_dequantized("dequantize_nf4", d_dequant, dq[1]);

    for (int format = 0; format < 2; format++) {
        const bool nf4 = format == 1;
        for (int N : k.Ns) {
            const bool with_bias = N != 3;
            std::vector<int> rows;  // the rows checked: all with -s, the first, a middle and the last at full size
            if (args.small) for (int n = 0; n < N; n++) rows.push_back(n);
            else rows = N == 1 ? std::vector<int>{0} : std::vector<int>{0, N / 2 + 1, N - 1};
            for (int variant = 1; variant <= 2; variant++) {
                if (args.variant != 0 && args.variant != variant) continue;
                if (variant == 1 && !args.small && N > 8) continue;  // the baseline is slow at full size
                char name[96];
                snprintf(name, sizeof(name), "%s v%d N=%d%s", nf4 ? "matmul_nf4" : "matmul_int8", variant, N,
                         with_bias ? "" : " (no bias)");
                cudaCheck(cudaMemset(d_out, 0xff, (size_t)N * OC * sizeof(floatX)));
                run_matmul(nf4, variant, QUANTIZE_WARPS, d_out, d_inp, d, with_bias ? d_bias : NULL, N, C, OC);
                cudaCheck(cudaDeviceSynchronize());
                check_matmul(name, d_out, inp, dq[format], bias, with_bias, N, C, OC, rows);
                if (variant == 2 && N == max_N) {  // another block shape: the same sums, so the same bits
                    cudaCheck(cudaMemset(d_out_again, 0xff, (size_t)N * OC * sizeof(floatX)));
                    run_matmul(nf4, variant, 8, d_out_again, d_inp, d, with_bias ? d_bias : NULL, N, C, OC);
                    cudaCheck(cudaDeviceSynchronize());
                    lab_require_identical("  8 warps per block", d_out, d_out_again, (size_t)N * OC * sizeof(floatX));
                }
            }
        }
    }

    if (timed) {
        const int repeats = args.small ? 1 : 50;
        for (int format = 0; format < 2; format++) {
            const bool nf4 = format == 1;
            for (int N : k.Ns) {
                const double bytes = weight_bytes(nf4, OC, C) + ((double)N * C + (double)N * OC + OC) * sizeof(floatX);
                char sizes[160];
                snprintf(sizes, sizeof(sizes), "W (%d, %d), N=%d, %.3g MB floor", OC, C, N, bytes / 1e6);
                lab_print_header(nf4 ? "matmul_forward_nf4" : "matmul_forward_int8", sizes);
                for (int variant = 1; variant <= 2; variant++) {
                    if (args.variant != 0 && args.variant != variant) continue;
                    for (int warps : {2, 4, 8}) {
                        if (variant == 1 && warps != 4) continue;  // one row for the baseline (128 threads)
                        const float ms = lab_time_ms(variant == 1 ? std::min(repeats, 3) : repeats, [&]() {
                            run_matmul(nf4, variant, warps, d_out, d_inp, d, d_bias, N, C, OC);
                        });
                        lab_print_row(variant, warps * 32, ms, bytes, 0.0);
                    }
                }
            }
        }
    }

    cudaCheck(cudaFree(d_w));
    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_bias));
    cudaCheck(cudaFree(d.q));
    cudaCheck(cudaFree(d.scale));
    nf4_free(&d.nf4);
    cudaCheck(cudaFree(d_dequant));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_out_again));
}

// the quantisation error of a Gaussian weight (the model's weights as floatX): max and RMS of W - dequant(W), the
// matmul's fp32 values, relative to W's RMS
static void quantisation_error(int OC, int C) {
    const std::vector<float> w = make_weights(OC, C, true, false, false);
    const size_t n_w = (size_t)OC * C;
    floatX* d_w = lab_to_device<floatX>(w);
    DeviceWeights d;
    d.q = lab_poisoned<int8_t>(n_w);
    d.scale = lab_poisoned<float>((size_t)OC);
    nf4_allocate(&d.nf4, OC, C);
    quantize_int8(d.q, d.scale, d_w, OC, C, 0);
    quantize_nf4(&d.nf4, d_w, OC, C, 0);
    cudaCheck(cudaDeviceSynchronize());
    double rms = 0.0;
    for (float x : w) rms += (double)x * x;
    rms = sqrt(rms / n_w);
    printf("quantisation error (%s), Gaussian W (%d, %d), relative to RMS(W) = %.4g:\n", PRECISION_NAME, OC, C, rms);
    for (int format = 0; format < 2; format++) {
        const std::vector<float> dq = format == 0 ? check_int8(w, d.q, d.scale, OC, C) : check_nf4(w, d.nf4, OC, C);
        double max_err = 0.0, sq = 0.0;
        for (size_t e = 0; e < n_w; e++) {
            const double err = fabs((double)w[e] - dq[e]);
            max_err = std::max(max_err, err);
            sq += err * err;
        }
        printf("  %-5s %5.2f bits/weight: max |W - dequant(W)| / RMS(W) = %.4f, RMS(W - dequant(W)) / RMS(W) = %.4f\n",
               format == 0 ? "int8" : "nf4", 8.0 * weight_bytes(format == 1, OC, C) / n_w, max_err / rms,
               sqrt(sq / n_w) / rms);
    }
    cudaCheck(cudaFree(d_w));
    cudaCheck(cudaFree(d.q));
    cudaCheck(cudaFree(d.scale));
    nf4_free(&d.nf4);
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    if (args.small) {
        // the timing code runs once (the first case): on the CPU backend the times mean nothing
        run_case(args, {"C 64, OC 48", 48, 64, {1, 3, 17}, false, false}, true);
        run_case(args, {"C 64, OC 96, outlier", 96, 64, {1, 3, 17}, true, false}, false);
        run_case(args, {"C 128, OC 48, outlier", 48, 128, {1, 3, 17}, true, false}, false);
        run_case(args, {"C 128, OC 96", 96, 128, {1, 3, 17}, false, false}, false);
        run_case(args, {"C 320, OC 64: two absmax groups", 64, 320, {1, 3, 17}, false, false}, false);
        quantisation_error(256, 1024);
    } else {
        run_case(args, {"GPT-2 124M qkv", 2304, 768, {1, 8, 64}, false, true}, true);
        run_case(args, {"GPT-2 124M fc", 3072, 768, {1, 8, 64}, false, true}, true);
        run_case(args, {"GPT-2 124M proj", 768, 3072, {1, 8, 64}, false, true}, true);
        run_case(args, {"Llama-3 8B up", 14336, 4096, {1, 8, 64}, false, true}, true);
        run_case(args, {"Llama-3 8B down", 4096, 14336, {1, 8, 64}, false, true}, true);
        quantisation_error(4096, 4096);
    }
    return 0;
}
