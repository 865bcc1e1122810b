// dev/cuda/rope.cu: kernel lab for rotary position embeddings (llmc/rope.cuh), forward (queries and keys rotated in
// place in the packed qkv) and backward (their gradients rotated back), with as many key/value heads as query heads
// and with fewer (grouped-query attention).
// Build and run on the CPU backend (small sizes):
//   make build/lab/rope_bf16   (build/lab/rope_fp32: the fp32 build)
//   build/lab/rope_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/rope.cu -o rope
//   ./rope [variant] [-s]
// Cases: GPT-2 124M (B=8, T=1024, NH=NKV=12, HS=64), the same with NKV=4, and Llama-3 8B's attention at T=8192
// (B=1, NH=32, NKV=8, HS=128, theta 500000); -s: small shapes (T=37 with NKV == NH and NKV < NH, and T=8192 with a
// small head count, so that the error at t = 8191 is measured in every run).
// Variants (each validates and times forward and backward):
//   1  one thread per pair, scalar loads, the cos/sin table
//   2  llmc/rope.cuh rope_forward / rope_backward: x128::size pairs per thread, 16-byte loads, the table. The
//      trainer's.
//   3  as 2, but each angle computed in the kernel in fp32: powf for theta^(-2i/HS), sincosf of t * inv_freq (what
//      the table replaces: under --use_fast_math these are __powf and __sincosf, whose error grows with t; validated
//      with the looser tolerance that grows with t, below)
// Floor (llmc/rope.cuh): 2 * B*T*(NH+NKV)*HS * sizeof(floatX) + T*HS*4 bytes.
// Beyond the comparison with a double-precision reference, every variant must leave the value heads bit-identical,
// and must write every query and key element: run with a table of NaNs, every one of them must come out NaN (an
// in-place kernel's output cannot be poisoned beforehand).
// Every case also checks rope_forward_at (tokens each at its own position, the inference entry point) against
// rope_forward bit for bit: 41 of the case's rows, taken in no order, rotated at their positions.
#include "common.h"
#include "../../llmc/rope.cuh"

__global__ void rope_scalar_kernel(floatX* qkv, const float* table, int B, int T, int NH, int NKV, int HS,
                                   bool backward) {
    const size_t pair = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int half = HS / 2;
    if (pair >= (size_t)B * T * (NH + NKV) * half) return;
    const int i = (int)(pair % half);
    const size_t head = pair / half;
    const int h = (int)(head % (NH + NKV));
    const size_t position = head / (NH + NKV);
    const int t = (int)(position % T);
    floatX* x = qkv + position * (size_t)(NH + 2 * NKV) * HS + (size_t)h * HS + i;
    const float c = table[(size_t)t * HS + i];
    const float s = backward ? -table[(size_t)t * HS + half + i] : table[(size_t)t * HS + half + i];
    const float a = (float)x[0], b = (float)x[half];
    x[0] = (floatX)(a * c - b * s);
    x[half] = (floatX)(b * c + a * s);
}

// Variant 3: rope_kernel's traversal with the angles computed in place of the table reads
__global__ void rope_angles_in_kernel(floatX* qkv, float theta, int T, int NH, int NKV, int HS, size_t chunks,
                                      bool backward) {
    const size_t chunk = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (chunk >= chunks) return;
    const int half = HS / 2;
    const int chunks_per_head = half / x128::size;
    const int i = (int)(chunk % chunks_per_head) * x128::size;
    const size_t head = chunk / chunks_per_head;
    const int h = (int)(head % (NH + NKV));
    const size_t position = head / (NH + NKV);
    const int t = (int)(position % T);
    floatX* x = qkv + position * (size_t)(NH + 2 * NKV) * HS + (size_t)h * HS + i;
    const x128 low = load128(x);
    const x128 high = load128(x + half);
    x128 out_low, out_high;
    for (int k = 0; k < x128::size; k++) {
        const float inv_freq = powf(theta, -2.0f * (float)(i + k) / (float)HS);
        float s, c;
        sincosf((float)t * inv_freq, &s, &c);
        if (backward) s = -s;
        const float a = (float)low[k], b = (float)high[k];
        out_low[k] = (floatX)(a * c - b * s);
        out_high[k] = (floatX)(b * c + a * s);
    }
    store128(x, out_low);
    store128(x + half, out_high);
}

struct RopeCase {
    const char* name;
    int B, T, NH, NKV, HS;
    float theta;
};

static void run_variant(int variant, bool backward, floatX* qkv, const float* table, const RopeCase& c,
                        int block_size) {
    if (variant == 1) {
        const size_t pairs = (size_t)c.B * c.T * (c.NH + c.NKV) * (c.HS / 2);
        const unsigned int grid = (unsigned int)CEIL_DIV(pairs, (size_t)block_size);
        rope_scalar_kernel<<<grid, block_size>>>(qkv, table, c.B, c.T, c.NH, c.NKV, c.HS, backward);
    } else if (variant == 2) {
        if (block_size == 256) {
            if (backward) rope_backward(qkv, table, c.B, c.T, c.NH, c.NKV, c.HS, 0);
            else rope_forward(qkv, table, c.B, c.T, c.NH, c.NKV, c.HS, 0);
        } else {
            rope_launch(backward, qkv, table, nullptr, c.B, c.T, c.NH, c.NKV, c.HS, block_size, 0);
        }
    } else {
        const size_t chunks = (size_t)c.B * c.T * (c.NH + c.NKV) * (c.HS / 2 / x128::size);
        rope_angles_in_kernel<<<(unsigned int)CEIL_DIV(chunks, (size_t)block_size), block_size>>>(
            qkv, c.theta, c.T, c.NH, c.NKV, c.HS, chunks, backward);
    }
    cudaCheck(cudaGetLastError());
}

// The rotation in double from the definition (llmc/rope.cuh's header), angles exact to double: the forward rotates by
// +angle, the backward by -angle; value heads copied.
static std::vector<float> rope_reference(const std::vector<float>& x, const RopeCase& c, bool backward) {
    std::vector<float> out(x);
    const int half = c.HS / 2, width = (c.NH + 2 * c.NKV) * c.HS;
    std::vector<double> inv_freq(half);
    for (int i = 0; i < half; i++) inv_freq[i] = pow((double)c.theta, -2.0 * i / c.HS);
    for (int b = 0; b < c.B; b++)
        for (int t = 0; t < c.T; t++)
            for (int i = 0; i < half; i++) {
                const double angle = (double)t * inv_freq[i];
                const double co = cos(angle), si = backward ? -sin(angle) : sin(angle);
                for (int h = 0; h < c.NH + c.NKV; h++) {
                    const size_t at = ((size_t)b * c.T + t) * width + (size_t)h * c.HS + i;
                    const double lo = x[at], hi = x[at + half];
                    out[at] = (float)(lo * co - hi * si);
                    out[at + half] = (float)(hi * co + lo * si);
                }
            }
    return out;
}

// Tolerances. Table variants (1, 2): cos and sin are within 2^-24 relative of the exact values at every t, then two
// fp32 products and a sum: |error| <= ~4 * 2^-24 * (|a c| + |b s|) <= 5e-7 for |a|, |b| <= 1 (a GPU may fuse a
// product into an fma: one rounding fewer): fp32 atol 1e-6. bf16: one rounding of the result to bf16 (<= 2^-8
// relative) after the same arithmetic: rtol 5e-3 on top. Variant 3: each angle is off by the fp32 rounding of
// t * inv_freq (2^-24 relative), __powf's error in inv_freq (lg2 with 22 bits of log2(theta) <= 19, then ex2 with 2
// ulp: ~4e-6 relative) and __sincosf's range reduction (|angle| 2^-24, plus 2^-20.5 absolute): with |angle| <= t the
// output moves by at most 2 * (t * 5e-6 + 2e-6); at T - 1 that is the tolerance.
static void tolerances(int variant, const RopeCase& c, float* atol, float* rtol) {
    *rtol = PRECISION_MODE == PRECISION_FP32 ? 0.0f : 5e-3f;
    *atol = variant == 3 ? 2.0f * ((float)(c.T - 1) * 5e-6f + 2e-6f) : 1e-6f;
}

// max |got - want| over the query and key elements at position T - 1 (every sequence)
static double error_at_last_position(const floatX* d_result, const std::vector<float>& want, const RopeCase& c) {
    const size_t width = (size_t)(c.NH + 2 * c.NKV) * c.HS, n = (size_t)c.B * c.T * width;
    std::vector<floatX> got(n);
    cudaCheck(cudaMemcpy(got.data(), d_result, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    double worst = 0.0;
    for (int b = 0; b < c.B; b++)
        for (size_t e = 0; e < (size_t)(c.NH + c.NKV) * c.HS; e++) {
            const size_t at = ((size_t)b * c.T + c.T - 1) * width + e;
            worst = fmax(worst, fabs((double)(float)got[at] - (double)want[at]));
        }
    return worst;
}

// The value heads must be bit-identical to the input and, with a NaN table (variants 1 and 2), every query and key
// element NaN: the kernel read the table for, and wrote, every one of them.
static void check_heads(const char* name, const floatX* d_result, const std::vector<floatX>& input, const RopeCase& c,
                        bool expect_nan) {
    const size_t width = (size_t)(c.NH + 2 * c.NKV) * c.HS, rotated = (size_t)(c.NH + c.NKV) * c.HS;
    const size_t n = (size_t)c.B * c.T * width;
    std::vector<floatX> got(n);
    cudaCheck(cudaMemcpy(got.data(), d_result, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    size_t v_changed = 0, qk_not_nan = 0;
    for (size_t e = 0; e < n; e++) {
        if (e % width >= rotated) v_changed += memcmp(&got[e], &input[e], sizeof(floatX)) != 0;
        else if (expect_nan) qk_not_nan += !isnan((float)got[e]);
    }
    if (v_changed || qk_not_nan) {
        printf("FAIL %s: %zu value elements changed, %zu query/key elements not written from a NaN table\n", name,
               v_changed, qk_not_nan);
        exit(EXIT_FAILURE);
    }
    printf("  %-28s ok (v untouched%s)\n", name, expect_nan ? ", every q/k element written" : "");
}

// rope_forward_at (inference: one row per token, each at its own position) against rope_forward bit for bit: tokens
// taken from random rows (b, t) of the case, t = 0 and t = T - 1 among them, some rows taken twice, in no order; token
// i's row rotated at positions[i] = t must come out as rope_forward's row (b, t).
static void validate_at(const RopeCase& c, const float* d_table, const std::vector<floatX>& x) {
    const size_t width = (size_t)(c.NH + 2 * c.NKV) * c.HS, n = (size_t)c.B * c.T * width;
    const int N = 41;
    std::vector<int> rows = lab_random_ints(N, c.B * c.T);
    rows[0] = 0;
    rows[1] = c.T - 1;
    rows[2] = rows[5];
    std::vector<int> positions(N);
    std::vector<floatX> tokens((size_t)N * width);
    for (int i = 0; i < N; i++) {
        positions[i] = rows[i] % c.T;
        memcpy(&tokens[(size_t)i * width], &x[(size_t)rows[i] * width], width * sizeof(floatX));
    }
    floatX* d_rows;  // (B, T, width), rotated by rope_forward
    floatX* d_tokens;  // (N, width), rotated by rope_forward_at
    cudaCheck(cudaMalloc(&d_rows, n * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_tokens, tokens.size() * sizeof(floatX)));
    cudaCheck(cudaMemcpy(d_rows, x.data(), n * sizeof(floatX), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_tokens, tokens.data(), tokens.size() * sizeof(floatX), cudaMemcpyHostToDevice));
    int* d_positions = lab_ints_to_device(positions);
    rope_forward(d_rows, d_table, c.B, c.T, c.NH, c.NKV, c.HS, 0);
    rope_forward_at(d_tokens, d_table, d_positions, N, c.NH, c.NKV, c.HS, 0);
    std::vector<floatX> rotated(n);
    cudaCheck(cudaMemcpy(rotated.data(), d_rows, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(tokens.data(), d_tokens, tokens.size() * sizeof(floatX), cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; i++)
        if (memcmp(&tokens[(size_t)i * width], &rotated[(size_t)rows[i] * width], width * sizeof(floatX)) != 0) {
            printf("FAIL rope_forward_at: token %d (row %d, position %d) differs from rope_forward's row\n", i, rows[i],
                   positions[i]);
            exit(EXIT_FAILURE);
        }
    printf("  %-28s ok (%d tokens bit-identical to rope_forward's rows)\n", "rope_forward_at", N);
    cudaCheck(cudaFree(d_rows));
    cudaCheck(cudaFree(d_tokens));
    cudaCheck(cudaFree(d_positions));
}

static void run_case(const LabArgs& args, const RopeCase& c, bool timed) {
    const size_t width = (size_t)(c.NH + 2 * c.NKV) * c.HS, n = (size_t)c.B * c.T * width;
    printf("rope (%s) %s: B=%d T=%d NH=%d NKV=%d HS=%d theta=%g\n", PRECISION_NAME, c.name, c.B, c.T, c.NH, c.NKV,
           c.HS, c.theta);
    const std::vector<float> x = lab_random_rounded(n, -1.0f, 1.0f);
    const std::vector<float> dy = lab_random_rounded(n, -1.0f, 1.0f);
    const std::vector<float> forward_want = rope_reference(x, c, false);
    const std::vector<float> backward_want = rope_reference(dy, c, true);
    std::vector<floatX> x_floatX(n), dy_floatX(n);
    for (size_t e = 0; e < n; e++) {
        x_floatX[e] = (floatX)x[e];
        dy_floatX[e] = (floatX)dy[e];
    }

    float* d_table;
    cudaCheck(cudaMalloc(&d_table, (size_t)c.T * c.HS * sizeof(float)));
    rope_table_init(d_table, c.T, c.HS, c.theta);
    float* d_nan_table = lab_poisoned<float>((size_t)c.T * c.HS);
    floatX* d_qkv;
    cudaCheck(cudaMalloc(&d_qkv, n * sizeof(floatX)));

    if (args.variant == 0 || args.variant == 2) validate_at(c, d_table, x_floatX);
    for (int variant = 1; variant <= 3; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        float atol, rtol;
        tolerances(variant, c, &atol, &rtol);
        for (int backward = 0; backward <= 1; backward++) {
            const std::vector<floatX>& input = backward ? dy_floatX : x_floatX;
            const std::vector<float>& want = backward ? backward_want : forward_want;
            cudaCheck(cudaMemcpy(d_qkv, input.data(), n * sizeof(floatX), cudaMemcpyHostToDevice));
            run_variant(variant, backward, d_qkv, d_table, c, 256);
            cudaCheck(cudaDeviceSynchronize());
            lab_validate(backward ? "backward dqkv" : "forward qkv", d_qkv, want.data(), n, atol, rtol);
            printf("  %-28s max abs err %.3g at t = %d\n", "", error_at_last_position(d_qkv, want, c), c.T - 1);
            check_heads(backward ? "backward dv" : "forward v", d_qkv, input, c, false);
            if (variant != 3) {
                cudaCheck(cudaMemcpy(d_qkv, input.data(), n * sizeof(floatX), cudaMemcpyHostToDevice));
                run_variant(variant, backward, d_qkv, d_nan_table, c, 256);
                cudaCheck(cudaDeviceSynchronize());
                check_heads("coverage (NaN table)", d_qkv, input, c, true);
            }
        }
    }

    if (timed) {
        const int repeats = args.small ? 3 : 100;
        const int block_sizes[] = {128, 256, 512, 1024};
        const double bytes = 2.0 * c.B * c.T * (c.NH + c.NKV) * c.HS * sizeof(floatX) + (double)c.T * c.HS * 4;
        char sizes[160];
        snprintf(sizes, sizeof(sizes), "%s, B=%d T=%d NH=%d NKV=%d HS=%d", c.name, c.B, c.T, c.NH, c.NKV, c.HS);
        cudaCheck(cudaMemcpy(d_qkv, x_floatX.data(), n * sizeof(floatX), cudaMemcpyHostToDevice));
        for (int backward = 0; backward <= 1; backward++) {
            lab_print_header(backward ? "rope_backward" : "rope_forward", sizes);
            for (int variant = 1; variant <= 3; variant++) {
                if (args.variant != 0 && args.variant != variant) continue;
                for (int block_size : block_sizes) {
                    // in place: repeated calls keep rotating, which only the timing sees
                    float ms = lab_time_ms(repeats,
                                           [&]() { run_variant(variant, backward, d_qkv, d_table, c, block_size); });
                    lab_print_row(variant, block_size, ms, bytes, 0.0);
                }
            }
        }
    }
    cudaCheck(cudaFree(d_table));
    cudaCheck(cudaFree(d_nan_table));
    cudaCheck(cudaFree(d_qkv));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    // HS = 16 is the smallest head a 16-byte bf16 vector allows (8 pairs); T = 37 is no multiple of anything
    const RopeCase small_cases[] = {{"multi-head", 2, 37, 4, 4, 32, 10000.0f},
                                    {"grouped-query", 2, 37, 6, 2, 16, 500000.0f},
                                    {"long", 1, 8192, 2, 1, 16, 10000.0f}};
    const RopeCase full_cases[] = {{"GPT-2 124M", 8, 1024, 12, 12, 64, 10000.0f},
                                   {"GPT-2 124M grouped-query", 8, 1024, 12, 4, 64, 10000.0f},
                                   {"Llama-3 8B", 1, 8192, 32, 8, 128, 500000.0f}};
    const RopeCase* cases = args.small ? small_cases : full_cases;
    for (int k = 0; k < 3; k++) run_case(args, cases[k], args.small ? k == 0 : true);
    return 0;
}
