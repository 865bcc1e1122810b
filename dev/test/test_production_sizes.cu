// dev/test/test_production_sizes.cu: llmc kernels whose element counts pass 2^31 at production sizes, run at those
// sizes in the CPU backend's edge mode (doc/backend.md, "Edge mode"; the test sets CUCC_EDGE_BLOCKS=2 itself before
// its first CUDA call): every grid runs only its first and last 2 blocks, and device memory is lazily backed, so
// buffers of several GiB cost only what those blocks touch. The elements those blocks write are checked against plain
// double-precision host loops; an element count or index product cut to 32 bits drops or moves them and fails.
//   make build/test_production_sizes && build/test_production_sizes
//   build/test_production_sizes_sanitize: the same under cpu/cucc --sanitize, where UBSan also reports any signed
//   overflow in the kernels' index arithmetic
// bf16 (the default floatX). Built with nvcc it runs whole on a GPU (24 GiB at most). Prints
// "test_production_sizes: N passed, N failed" last. The cases:
//  - gelu_forward and gelu_backward_inplace over N = 2^32 + 5 elements, the dropless experts' hidden activations
//    under 8-way expert parallelism (65536 tokens x top-8 x 8 senders = 2^22 rows) times H = 1024; the 5 make the
//    last thread take the scalar tail; the 8 elements past N must stay untouched;
//  - matmul_forward_grouped with bias and GELU: 8 experts x 65536 rows, C = 1600, OC = 6400 (GPT-2 1.5B's c_fc),
//    3.4e9 output elements, so the bias-and-GELU pass finds row, column and expert of offsets past 2^31;
//  - encoder_forward at B = 2048, T = 1024, C = 1600: 3.4e9 output elements.
#include <stdlib.h>
#include <vector>
#include "test_common.h"
#include "../../llmc/encoder.cuh"
#include "../../llmc/expert_matmul.cuh"

static const int EDGE_BLOCKS = 2;

// [begin, end) of the elements that the first or the last EDGE_BLOCKS blocks of a launch over `count` elements,
// `per_block` elements per block, write
struct Range {
    size_t begin, end;
};
static Range head_range(size_t count, size_t per_block) {
    return Range{0, std::min(count, EDGE_BLOCKS * per_block)};
}
static Range tail_range(size_t count, size_t per_block) {
    const size_t blocks = CEIL_DIV(count, per_block);
    return Range{blocks > EDGE_BLOCKS ? (blocks - EDGE_BLOCKS) * per_block : 0, count};
}

static std::vector<floatX> random_floatX(size_t n, float lo, float hi) {
    std::vector<floatX> v(n);
    for (size_t i = 0; i < n; i++) v[i] = (floatX)test_rand_uniform(lo, hi);
    return v;
}

// host <-> device copies of a few elements at an offset (edge mode moves short copies whole)
static void upload(floatX* device, size_t offset, const std::vector<floatX>& host) {
    cudaCheck(cudaMemcpy(device + offset, host.data(), host.size() * sizeof(floatX), cudaMemcpyHostToDevice));
}
static std::vector<float> download(const floatX* device, Range r) {
    std::vector<floatX> host(r.end - r.begin);
    cudaCheck(cudaMemcpy(host.data(), device + r.begin, host.size() * sizeof(floatX), cudaMemcpyDeviceToHost));
    std::vector<float> values(host.size());
    for (size_t i = 0; i < host.size(); i++) values[i] = (float)host[i];
    return values;
}
static void poison(floatX* device, Range r) {
    cudaCheck(cudaMemset(device + r.begin, 0xff, (r.end - r.begin) * sizeof(floatX)));
}

static double gelu_double(double x) { return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); }
static double gelu_derivative_double(double x) {
    const double s = sqrt(2.0 / M_PI), t = tanh(s * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * s * (1.0 + 3.0 * 0.044715 * x * x);
}

// bf16 outputs of fp32 arithmetic: one rounding to 8 significant bits (relative 2^-8 = 3.9e-3) dominates; the fp32
// exponential and division (fast-math approximations included) add ~1e-6. atol for results that round to near zero.
static const double RTOL = 5e-3, ATOL = 1e-6;

static void test_gelu(void) {
    const size_t N = (1ull << 32) + 5;
    const size_t per_block = 256 * x128::size;  // gelu_forward's block: 256 threads of 8 elements
    floatX *inp, *out, *d;
    cudaCheck(cudaMalloc(&inp, N * sizeof(floatX)));
    cudaCheck(cudaMalloc(&out, (N + 8) * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d, (N + 8) * sizeof(floatX)));
    const Range ranges[2] = {head_range(N, per_block), tail_range(N, per_block)};
    const Range past_end = {N, N + 8};
    std::vector<floatX> x[2], dout[2];
    for (int e = 0; e < 2; e++) {
        x[e] = random_floatX(ranges[e].end - ranges[e].begin, -6.0f, 6.0f);
        dout[e] = random_floatX(ranges[e].end - ranges[e].begin, -1.0f, 1.0f);
        upload(inp, ranges[e].begin, x[e]);
        upload(d, ranges[e].begin, dout[e]);
        poison(out, ranges[e]);
    }
    poison(out, past_end);
    poison(d, past_end);
    gelu_forward(out, inp, N, 0);
    gelu_backward_inplace(d, inp, N, 0);
    cudaCheck(cudaDeviceSynchronize());
    for (int e = 0; e < 2; e++) {
        const size_t n = ranges[e].end - ranges[e].begin;
        std::vector<double> want_out(n), want_d(n);
        for (size_t i = 0; i < n; i++) {
            want_out[i] = gelu_double((float)x[e][i]);
            want_d[i] = (float)dout[e][i] * gelu_derivative_double((float)x[e][i]);
        }
        const char* which = e == 0 ? "first" : "last";
        char what[128];
        snprintf(what, sizeof(what), "gelu_forward, N = 2^32 + 5, %s %zu elements", which, n);
        check_close(what, download(out, ranges[e]).data(), want_out.data(), n, ATOL, RTOL);
        snprintf(what, sizeof(what), "gelu_backward_inplace, N = 2^32 + 5, %s %zu elements", which, n);
        check_close(what, download(d, ranges[e]).data(), want_d.data(), n, ATOL, RTOL);
    }
    std::vector<float> after_out = download(out, past_end), after_d = download(d, past_end);
    int untouched = 1;
    for (int i = 0; i < 8; i++) untouched &= isnan(after_out[i]) && isnan(after_d[i]);
    check(untouched, "gelu: the 8 elements past N keep their poison");
    cudaCheck(cudaFree(inp));
    cudaCheck(cudaFree(out));
    cudaCheck(cudaFree(d));
}

static void test_grouped_bias_gelu(void) {
    const int G = 8, C = 1600, OC = 6400;
    const size_t rows_per_group = 65536, total = G * rows_per_group, count = total * OC;
    const size_t per_block = 256 * x128::size;  // the bias-and-GELU pass: 256 threads of one x128 each
    std::vector<int> rows(G, (int)rows_per_group);
    floatX *inp, *weight, *bias, *out, *pre_gelu;
    // inp and weight are zero (edge mode clears only their ends, but its untouched memory reads 0 anyway), so the
    // GEMM's accumulator in pre_gelu is 0 where it is computed (the corners, in edge mode) and where it is not, and
    // pre_gelu = bias[g], out = gelu(bias[g]) for every row of expert g
    cudaCheck(cudaMalloc(&inp, total * C * sizeof(floatX)));
    cudaCheck(cudaMalloc(&weight, (size_t)G * OC * C * sizeof(floatX)));
    cudaCheck(cudaMemset(inp, 0, total * C * sizeof(floatX)));
    cudaCheck(cudaMemset(weight, 0, (size_t)G * OC * C * sizeof(floatX)));
    cudaCheck(cudaMalloc(&bias, (size_t)G * OC * sizeof(floatX)));
    cudaCheck(cudaMalloc(&out, count * sizeof(floatX)));
    cudaCheck(cudaMalloc(&pre_gelu, count * sizeof(floatX)));
    std::vector<floatX> bias_host = random_floatX((size_t)G * OC, -3.0f, 3.0f);
    upload(bias, 0, bias_host);
    const Range ranges[2] = {head_range(count, per_block), tail_range(count, per_block)};
    for (int e = 0; e < 2; e++) {
        poison(out, ranges[e]);
        cudaCheck(cudaMemset(pre_gelu + ranges[e].begin, 0, (ranges[e].end - ranges[e].begin) * sizeof(floatX)));
    }
    matmul_forward_grouped(out, inp, weight, bias, G, rows.data(), C, OC, 0, pre_gelu, 1);
    cudaCheck(cudaDeviceSynchronize());
    for (int e = 0; e < 2; e++) {
        const size_t n = ranges[e].end - ranges[e].begin;
        std::vector<double> want_pre(n), want_out(n);
        for (size_t i = 0; i < n; i++) {
            const size_t element = ranges[e].begin + i, group = element / OC / rows_per_group;
            const double b = (float)bias_host[group * OC + element % OC];
            want_pre[i] = b;
            want_out[i] = gelu_double(b);
        }
        const char* which = e == 0 ? "first" : "last";
        char what[160];
        snprintf(what, sizeof(what), "matmul_forward_grouped, 8 x 65536 rows x OC 6400, pre_gelu, %s %zu elements",
                 which, n);
        check_close(what, download(pre_gelu, ranges[e]).data(), want_pre.data(), n, 0.0, 0.0);
        snprintf(what, sizeof(what), "matmul_forward_grouped, 8 x 65536 rows x OC 6400, out, %s %zu elements", which,
                 n);
        check_close(what, download(out, ranges[e]).data(), want_out.data(), n, ATOL, RTOL);
    }
    floatX* buffers[] = {inp, weight, bias, out, pre_gelu};
    for (floatX* p : buffers) cudaCheck(cudaFree(p));
}

static void test_encoder_forward(void) {
    const int B = 2048, T = 1024, C = 1600, V = 32;
    const size_t N = (size_t)B * T, count = N * C;
    const size_t per_block = 256 * x128::size;  // encoder_forward's block: 256 threads of one x128 each
    floatX *out, *wte, *wpe;
    int* tokens;
    cudaCheck(cudaMalloc(&out, count * sizeof(floatX)));
    cudaCheck(cudaMalloc(&wte, (size_t)V * C * sizeof(floatX)));
    cudaCheck(cudaMalloc(&wpe, (size_t)T * C * sizeof(floatX)));
    cudaCheck(cudaMalloc(&tokens, N * sizeof(int)));
    cudaCheck(cudaMemset(tokens, 0, N * sizeof(int)));  // the positions between the checked ones read wte row 0
    // wte whole (100 KiB: edge mode moves it whole); of wpe the rows of the first and last positions
    std::vector<floatX> wte_host = random_floatX((size_t)V * C, -1.0f, 1.0f);
    std::vector<floatX> wpe_head = random_floatX((size_t)4 * C, -1.0f, 1.0f), wpe_tail = random_floatX((size_t)4 * C, -1.0f, 1.0f);
    upload(wte, 0, wte_host);
    upload(wpe, 0, wpe_head);
    upload(wpe, (size_t)(T - 4) * C, wpe_tail);
    const Range ranges[2] = {head_range(count, per_block), tail_range(count, per_block)};
    std::vector<int> tokens_host[2];
    for (int e = 0; e < 2; e++) {
        const size_t first = ranges[e].begin / C, last = (ranges[e].end - 1) / C;  // positions covered
        tokens_host[e].resize(last - first + 1);
        for (int& t : tokens_host[e]) t = (int)(test_rand_u32() % V);
        cudaCheck(cudaMemcpy(tokens + first, tokens_host[e].data(), tokens_host[e].size() * sizeof(int),
                             cudaMemcpyHostToDevice));
        poison(out, ranges[e]);
    }
    encoder_forward(out, tokens, wte, wpe, B, T, C, 0);
    cudaCheck(cudaDeviceSynchronize());
    for (int e = 0; e < 2; e++) {
        const size_t n = ranges[e].end - ranges[e].begin, first = ranges[e].begin / C;
        std::vector<double> want(n);
        for (size_t i = 0; i < n; i++) {
            const size_t element = ranges[e].begin + i, position = element / C, c = element % C;
            const size_t t = position % T;
            const floatX wpe_value = t < 4 ? wpe_head[t * C + c] : wpe_tail[(t - (T - 4)) * C + c];
            want[i] = (double)(float)wte_host[(size_t)tokens_host[e][position - first] * C + c] + (double)(float)wpe_value;
        }
        char what[128];
        snprintf(what, sizeof(what), "encoder_forward, B*T*C = 2048*1024*1600, %s %zu elements",
                 e == 0 ? "first" : "last", n);
        check_close(what, download(out, ranges[e]).data(), want.data(), n, ATOL, RTOL);
    }
    cudaCheck(cudaFree(out));
    cudaCheck(cudaFree(wte));
    cudaCheck(cudaFree(wpe));
    cudaCheck(cudaFree(tokens));
}

int main(void) {
    setenv("CUCC_EDGE_BLOCKS", "2", 1);  // EDGE_BLOCKS, before the first CUDA call reads it
    test_seed(12);
    cublas_setup();
    test_gelu();
    test_grouped_bias_gelu();
    test_encoder_forward();
    cublas_teardown();
    return test_summary("test_production_sizes");
}
