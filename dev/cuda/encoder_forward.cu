// dev/cuda/encoder_forward.cu: kernel lab for the GPT-2 encoder forward, out (B,T,C) = wte[inp[b,t]] + wpe[t].
// Build and run on the CPU backend (small sizes):
//   make build/lab/encoder_forward_bf16   (build/lab/encoder_forward_fp32: the fp32 build)
//   build/lab/encoder_forward_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/encoder_forward.cu -o encoder_forward
//   ./encoder_forward [variant] [-s]       (GPT-2 124M sizes by default: B=8, T=1024, C=768, V=50257)
// Variants:
//   1  one thread per element, scalar loads (the baseline the vectorised kernel is measured against)
//   2  llmc/encoder.cuh encoder_forward: one thread per 8 channels, 16-byte loads and stores. The trainer's.
// With variant 2, encoder_forward_vocab_range (tensor parallelism: wte rows [v0, v0 + Vs) per process) is validated
// over three ranges, one holding none of the batch's ids, and the two halves summed against encoder_forward; and
// encoder_forward_at (tokens each at its own position, for inference) against encoder_forward's rows bit for bit,
// with wpe and without.
// Floor (see llmc/encoder.cuh): bytes = (2*B*T*C + T*C) * sizeof(floatX) + 4*B*T.
#include "common.h"
#include "../../llmc/encoder.cuh"

__global__ void encoder_forward_scalar_kernel(floatX* out, const int* inp, const floatX* wte, const floatX* wpe,
                                              int B, int T, int C) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * T * C) return;
    size_t bt = idx / C;
    int t = (int)(bt % T);
    int c = (int)(idx % C);
    out[idx] = (floatX)((float)wte[(size_t)inp[bt] * C + c] + (float)wpe[(size_t)t * C + c]);
}

static void encoder_forward_scalar(floatX* out, const int* inp, const floatX* wte, const floatX* wpe, int B, int T,
                                   int C, int block_size) {
    size_t n = (size_t)B * T * C;
    encoder_forward_scalar_kernel<<<(unsigned int)CEIL_DIV(n, (size_t)block_size), block_size>>>(out, inp, wte, wpe,
                                                                                                 B, T, C);
    cudaCheck(cudaGetLastError());
}

// the values the device holds, so that the reference starts from exactly the same inputs
static std::vector<float> rounded_to_floatX(std::vector<float> values) {
    for (float& v : values) v = (float)(floatX)v;
    return values;
}

// encoder_forward_vocab_range, as tensor parallelism calls it: each process holds the wte rows [v0, v0 + Vs) (here in
// a buffer of its own, so that a read outside them is one the checking build sees) and one process adds wpe. Three
// ranges: the two halves of the vocabulary, which summed give encoder_forward's output bit for bit (an id outside a
// range adds an exact 0), and the padding rows [V, Vp), which hold none of the batch's ids.
static void validate_vocab_ranges(const std::vector<float>& wte, const std::vector<float>& wpe,
                                  const std::vector<int>& inp, const int* d_inp, const floatX* d_wpe, int B, int T,
                                  int C, int V, float atol, float rtol) {
    const int Vp = (int)(wte.size() / C);
    const size_t n = (size_t)B * T * C;
    struct { int v0, Vs; bool with_wpe; } ranges[] = {
        {0, Vp / 2, true}, {Vp / 2, Vp - Vp / 2, false}, {V, Vp - V, true}};
    std::vector<floatX> halves_sum(n);  // the two halves' outputs summed as an all-reduce in floatX would
    for (int r = 0; r < 3; r++) {
        const int v0 = ranges[r].v0, Vs = ranges[r].Vs;
        std::vector<float> reference(n);
        int held = 0;  // positions whose id the range holds
        for (int bt = 0; bt < B * T; bt++) {
            const bool in_range = inp[bt] >= v0 && inp[bt] < v0 + Vs;
            held += in_range;
            for (int c = 0; c < C; c++) {
                double sum = in_range ? (double)wte[(size_t)inp[bt] * C + c] : 0.0;
                if (ranges[r].with_wpe) sum += (double)wpe[(size_t)(bt % T) * C + c];
                reference[(size_t)bt * C + c] = (float)sum;
            }
        }
        floatX* d_wte_slice = lab_to_device<floatX>(
            std::vector<float>(wte.begin() + (size_t)v0 * C, wte.begin() + (size_t)(v0 + Vs) * C));
        floatX* d_out = lab_poisoned<floatX>(n);
        encoder_forward_vocab_range(d_out, d_inp, d_wte_slice, ranges[r].with_wpe ? d_wpe : nullptr, B, T, C, v0, Vs,
                                    0);
        cudaCheck(cudaDeviceSynchronize());
        printf("vocabulary range [%d, %d)%s, %d positions hold its ids\n", v0, v0 + Vs,
               ranges[r].with_wpe ? " with wpe" : "", held);
        lab_validate("out (range)", d_out, reference.data(), n, atol, rtol);
        if (r < 2) {
            std::vector<floatX> out(n);
            cudaCheck(cudaMemcpy(out.data(), d_out, n * sizeof(floatX), cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < n; i++)
                halves_sum[i] = r == 0 ? out[i] : (floatX)((float)halves_sum[i] + (float)out[i]);
        }
        cudaCheck(cudaFree(d_wte_slice));
        cudaCheck(cudaFree(d_out));
    }
    floatX* d_wte = lab_to_device<floatX>(wte);
    floatX* d_whole = lab_poisoned<floatX>(n);
    encoder_forward(d_whole, d_inp, d_wte, d_wpe, B, T, C, 0);
    std::vector<floatX> whole(n);
    cudaCheck(cudaMemcpy(whole.data(), d_whole, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    if (memcmp(whole.data(), halves_sum.data(), n * sizeof(floatX)) != 0) {
        printf("FAIL: the two halves' outputs summed differ from encoder_forward's output\n");
        exit(EXIT_FAILURE);
    }
    printf("  %-28s ok (bit-identical to the whole vocabulary's)\n", "halves summed");
    cudaCheck(cudaFree(d_wte));
    cudaCheck(cudaFree(d_whole));
}

// encoder_forward_at (inference: one row per token, each at its own position) against encoder_forward bit for bit,
// with wpe and without (NULL, -arch llama): tokens taken from random rows (b, t), t = 0 and t = T - 1 among them, some
// rows taken twice, in no order; token i = (inp[b, t], position t) must come out as encoder_forward's row (b, t).
static void validate_at(const std::vector<int>& inp, const int* d_inp, const floatX* d_wte, const floatX* d_wpe,
                        int B, int T, int C) {
    const int N = 29;
    std::vector<int> rows = lab_random_ints(N, B * T);
    rows[0] = 0;
    rows[1] = T - 1;
    rows[2] = rows[7];
    std::vector<int> tokens(N), positions(N);
    for (int i = 0; i < N; i++) {
        tokens[i] = inp[rows[i]];
        positions[i] = rows[i] % T;
    }
    int* d_tokens = lab_ints_to_device(tokens);
    int* d_positions = lab_ints_to_device(positions);
    floatX* d_rows = lab_poisoned<floatX>((size_t)B * T * C);
    floatX* d_at = lab_poisoned<floatX>((size_t)N * C);
    std::vector<floatX> want((size_t)B * T * C), got((size_t)N * C);
    for (int with_wpe = 1; with_wpe >= 0; with_wpe--) {
        const floatX* wpe = with_wpe ? d_wpe : nullptr;
        encoder_forward(d_rows, d_inp, d_wte, wpe, B, T, C, 0);
        cudaCheck(cudaMemset(d_at, 0xff, (size_t)N * C * sizeof(floatX)));
        encoder_forward_at(d_at, d_tokens, d_positions, d_wte, wpe, N, C, 0);
        cudaCheck(cudaMemcpy(want.data(), d_rows, want.size() * sizeof(floatX), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(got.data(), d_at, got.size() * sizeof(floatX), cudaMemcpyDeviceToHost));
        for (int i = 0; i < N; i++)
            if (memcmp(&got[(size_t)i * C], &want[(size_t)rows[i] * C], C * sizeof(floatX)) != 0) {
                printf("FAIL encoder_forward_at%s: token %d (row %d, position %d) differs from encoder_forward's row\n",
                       with_wpe ? "" : " without wpe", i, rows[i], positions[i]);
                exit(EXIT_FAILURE);
            }
        printf("  %-28s ok (%d tokens bit-identical to encoder_forward's rows%s)\n", "encoder_forward_at", N,
               with_wpe ? "" : ", wpe NULL");
    }
    cudaCheck(cudaFree(d_tokens));
    cudaCheck(cudaFree(d_positions));
    cudaCheck(cudaFree(d_rows));
    cudaCheck(cudaFree(d_at));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    int B = 8, T = 1024, C = 768, V = 50257, maxT = 1024;
    if (args.small) { B = 3; T = 37; C = 48; V = 263; maxT = 40; }
    const int Vp = CEIL_DIV(V, 128) * 128;

    std::vector<float> wte = rounded_to_floatX(lab_random((size_t)Vp * C));
    std::vector<float> wpe = rounded_to_floatX(lab_random((size_t)maxT * C));
    std::vector<int> inp = lab_random_ints((size_t)B * T, V);
    const size_t n = (size_t)B * T * C;
    std::vector<float> reference(n);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < C; c++) {
                double sum = (double)wte[(size_t)inp[b * T + t] * C + c] + (double)wpe[(size_t)t * C + c];
                reference[((size_t)b * T + t) * C + c] = (float)sum;
            }

    floatX* d_wte = lab_to_device<floatX>(wte);
    floatX* d_wpe = lab_to_device<floatX>(wpe);
    int* d_inp = lab_ints_to_device(inp);
    floatX* d_out = lab_poisoned<floatX>(n);

    // the sum of two floatX values is exact in fp32 and rounded once to floatX, as the reference's double sum
    // is: fp32 agrees to within fp32 rounding (2^-24, tolerance 1e-6 relative); bf16 to half a bf16 ulp
    // (2^-8 relative, tolerance 4e-3)
    const float rtol = PRECISION_MODE == PRECISION_FP32 ? 1e-6f : 4e-3f;
    const float atol = 1e-7f;
    const double bytes = (2.0 * B * T * C + (double)T * C) * sizeof(floatX) + 4.0 * B * T;
    const int repeats = args.small ? 3 : 100;
    const int block_sizes[] = {128, 256, 512, 1024};

    printf("encoder_forward (%s): B=%d T=%d C=%d V=%d\n", PRECISION_NAME, B, T, C, V);
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        cudaCheck(cudaMemset(d_out, 0xff, n * sizeof(floatX)));
        if (variant == 1) encoder_forward_scalar(d_out, d_inp, d_wte, d_wpe, B, T, C, 256);
        else encoder_forward(d_out, d_inp, d_wte, d_wpe, B, T, C, 0);
        cudaCheck(cudaDeviceSynchronize());
        printf("variant %d\n", variant);
        lab_validate("out", d_out, reference.data(), n, atol, rtol);
    }
    if (args.variant == 0 || args.variant == 2)
        validate_vocab_ranges(wte, wpe, inp, d_inp, d_wpe, B, T, C, V, atol, rtol);
    if (args.variant == 0 || args.variant == 2) validate_at(inp, d_inp, d_wte, d_wpe, B, T, C);
    lab_print_header("encoder_forward", args.small ? "small sizes" : "GPT-2 124M sizes");
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        for (int block_size : block_sizes) {
            float ms = lab_time_ms(repeats, [&]() {
                if (variant == 1) encoder_forward_scalar(d_out, d_inp, d_wte, d_wpe, B, T, C, block_size);
                else encoder_forward_launch(d_out, d_inp, d_wte, d_wpe, B, T, C, block_size, 0);
            });
            lab_print_row(variant, block_size, ms, bytes, 0.0);
        }
    }
    cudaCheck(cudaFree(d_wte));
    cudaCheck(cudaFree(d_wpe));
    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_out));
    return 0;
}
