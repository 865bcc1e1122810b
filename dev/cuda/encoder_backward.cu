// dev/cuda/encoder_backward.cu: kernel lab for the GPT-2 encoder backward: dwte[v] += sum of dout over the
// positions holding token v, dwpe[t] += sum over b of dout[b,t]; deterministic, no float atomics.
// Build and run on the CPU backend (small sizes):
//   make build/lab/encoder_backward_bf16   (build/lab/encoder_backward_fp32: the fp32 build)
//   build/lab/encoder_backward_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/encoder_backward.cu -o encoder_backward
//   ./encoder_backward [variant] [-s]       (GPT-2 124M sizes by default: B=8, T=1024, C=768, V=50257)
// Both variants bucket the positions by token on the host (encoder_upload_buckets of llmc/encoder.cuh) and
// use its dwpe kernel; they differ in how a bucket's rows are summed into dwte:
//   1  one thread per (bucket, vector of channels), summing the whole bucket alone (a frequent token
//      serialises)
//   2  llmc/encoder.cuh encoder_backward: 8 warps per (bucket, 32 vectors of channels) split the bucket's
//      rows and add their partial sums in warp order. The trainer's.
// With variant 2, encoder_backward_vocab_range (tensor parallelism: dwte rows [v0, v0 + Vs) per process) is
// validated over three ranges, one holding none of the batch's ids, and against encoder_backward's rows bit for bit.
// Times include the host bucketing and its copy. Every variant is run twice from the same state to check
// that the results are bitwise identical.
// Floor (see llmc/encoder.cuh): bytes = (B*T*C + 2*buckets*C + 2*T*C) * sizeof(floatX) + 20*B*T at most.
#include "common.h"
#include "../../llmc/encoder.cuh"

__global__ void encoder_backward_wte_sequential_kernel(floatX* dwte, const floatX* dout, const int* positions,
                                                       const int4* buckets, int num_buckets, int C,
                                                       unsigned int seed) {
    const int chunks = C / x128::size;
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)num_buckets * chunks) return;
    const int4 bucket = buckets[idx / chunks];
    const int c = (int)(idx % chunks) * x128::size;
    float sum[x128::size];
    for (int k = 0; k < x128::size; k++) sum[k] = 0.0f;
    for (int i = bucket.y; i < bucket.z; i++) {
        x128 d = load128cs(dout + (size_t)positions[i] * C + c);
        for (int k = 0; k < x128::size; k++) sum[k] += (float)d[k];
    }
    const size_t offset = (size_t)bucket.x * C + c;
    x128 old_value = load128(dwte + offset);
    x128 new_value;
    for (int k = 0; k < x128::size; k++) {
        stochastic_rounding((float)old_value[k] + sum[k], &new_value[k], random_u32(seed, (unsigned int)(offset + k)));
    }
    store128(dwte + offset, new_value);
}

static void encoder_backward_sequential(floatX* dwte, floatX* dwpe, const floatX* dout, const int* inputs_cpu,
                                        int B, int T, int C, unsigned int seed, int block_size) {
    static EncoderBuckets table = {};
    const int N = B * T;
    const int num_buckets = encoder_upload_buckets(&table, inputs_cpu, N, 0);
    const size_t padded_n = CEIL_DIV((size_t)N, (size_t)4) * 4;
    const size_t threads = (size_t)num_buckets * (C / x128::size);
    encoder_backward_wte_sequential_kernel<<<(unsigned int)CEIL_DIV(threads, (size_t)block_size), block_size>>>(
        dwte, dout, table.device_table, (const int4*)(table.device_table + padded_n), num_buckets, C, seed);
    cudaCheck(cudaGetLastError());
    encoder_backward_wpe_kernel<<<(unsigned int)CEIL_DIV((size_t)T * C / x128::size, (size_t)block_size),
                                  block_size>>>(dwpe, dout, B, T, C, seed + 1);
    cudaCheck(cudaGetLastError());
}

static std::vector<float> rounded_to_floatX(std::vector<float> values) {
    for (float& v : values) v = (float)(floatX)v;
    return values;
}

static void run_variant(int variant, floatX* dwte, floatX* dwpe, const floatX* dout, const int* d_inp,
                        const int* inp, int B, int T, int C, unsigned int seed, int block_size) {
    if (variant == 1) encoder_backward_sequential(dwte, dwpe, dout, inp, B, T, C, seed, block_size);
    else encoder_backward(dwte, dwpe, dout, d_inp, inp, B, T, C, seed, 0);
}

// encoder_backward_vocab_range, as tensor parallelism calls it: each process holds the dwte rows [v0, v0 + Vs) (here
// in a buffer of its own, so that a write outside them is one the checking build sees) and one process sums dwpe.
// Three ranges: the two halves of the vocabulary (the frequent token in the first) and the padding rows [V, Vp),
// which hold none of the batch's ids and must come out unchanged. Each range's rows must also equal the rows of
// encoder_backward's result from the same state bit for bit, and its dwpe encoder_backward's dwpe.
static void validate_vocab_ranges(const std::vector<int>& inp, const std::vector<float>& dout,
                                  const std::vector<float>& dwte_initial, const std::vector<float>& dwpe_initial,
                                  const floatX* d_dout, const int* d_inp, int B, int T, int C, int V,
                                  unsigned int seed, float atol, float rtol) {
    const int Vp = (int)(dwte_initial.size() / C);
    const size_t dwpe_n = dwpe_initial.size();
    floatX* d_dwte = lab_to_device<floatX>(dwte_initial);
    floatX* d_dwpe = lab_to_device<floatX>(dwpe_initial);
    encoder_backward(d_dwte, d_dwpe, d_dout, d_inp, inp.data(), B, T, C, seed, 0);
    std::vector<floatX> whole_dwte(dwte_initial.size()), whole_dwpe(dwpe_n);
    cudaCheck(cudaMemcpy(whole_dwte.data(), d_dwte, whole_dwte.size() * sizeof(floatX), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(whole_dwpe.data(), d_dwpe, dwpe_n * sizeof(floatX), cudaMemcpyDeviceToHost));

    struct { int v0, Vs; bool with_dwpe; } ranges[] = {
        {0, Vp / 2, true}, {Vp / 2, Vp - Vp / 2, false}, {V, Vp - V, true}};
    for (int r = 0; r < 3; r++) {
        const int v0 = ranges[r].v0, Vs = ranges[r].Vs;
        const size_t slice_n = (size_t)Vs * C;
        std::vector<double> sum(dwte_initial.begin() + (size_t)v0 * C, dwte_initial.begin() + (size_t)v0 * C + slice_n);
        int held = 0;  // positions whose id the range holds
        for (int bt = 0; bt < B * T; bt++) {
            if (inp[bt] < v0 || inp[bt] >= v0 + Vs) continue;
            held++;
            for (int c = 0; c < C; c++) sum[(size_t)(inp[bt] - v0) * C + c] += dout[(size_t)bt * C + c];
        }
        const std::vector<float> reference(sum.begin(), sum.end());
        floatX* d_slice = lab_to_device<floatX>(std::vector<float>(
            dwte_initial.begin() + (size_t)v0 * C, dwte_initial.begin() + (size_t)v0 * C + slice_n));
        floatX* d_range_dwpe = ranges[r].with_dwpe ? lab_to_device<floatX>(dwpe_initial) : nullptr;
        encoder_backward_vocab_range(d_slice, d_range_dwpe, d_dout, d_inp, inp.data(), B, T, C, v0, Vs, seed, 0);
        cudaCheck(cudaDeviceSynchronize());
        printf("vocabulary range [%d, %d)%s, %d positions hold its ids\n", v0, v0 + Vs,
               ranges[r].with_dwpe ? " with dwpe" : "", held);
        lab_validate("dwte (range)", d_slice, reference.data(), slice_n, atol, rtol);
        std::vector<floatX> slice(slice_n), range_dwpe(dwpe_n);
        cudaCheck(cudaMemcpy(slice.data(), d_slice, slice_n * sizeof(floatX), cudaMemcpyDeviceToHost));
        if (memcmp(slice.data(), whole_dwte.data() + (size_t)v0 * C, slice_n * sizeof(floatX)) != 0) {
            printf("FAIL: the range's dwte rows differ from encoder_backward's\n");
            exit(EXIT_FAILURE);
        }
        printf("  %-28s ok (bit-identical to encoder_backward's rows)\n", "dwte rows");
        if (d_range_dwpe != nullptr) {
            cudaCheck(cudaMemcpy(range_dwpe.data(), d_range_dwpe, dwpe_n * sizeof(floatX), cudaMemcpyDeviceToHost));
            if (memcmp(range_dwpe.data(), whole_dwpe.data(), dwpe_n * sizeof(floatX)) != 0) {
                printf("FAIL: the range's dwpe differs from encoder_backward's\n");
                exit(EXIT_FAILURE);
            }
            printf("  %-28s ok (bit-identical to encoder_backward's)\n", "dwpe");
            cudaCheck(cudaFree(d_range_dwpe));
        }
        cudaCheck(cudaFree(d_slice));
    }
    cudaCheck(cudaFree(d_dwte));
    cudaCheck(cudaFree(d_dwpe));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    int B = 8, T = 1024, C = 768, V = 50257, maxT = 1024;
    if (args.small) { B = 3; T = 37; C = 296; V = 263; maxT = 40; }  // C = 296: a partial 256-channel slice
    const int Vp = CEIL_DIV(V, 128) * 128;
    const int N = B * T;
    const unsigned int seed = 1337;

    // one token on every 16th position makes a bucket far larger than the rest, as frequent tokens do
    std::vector<int> inp = lab_random_ints((size_t)N, V);
    for (int i = 0; i < N; i += 16) inp[i] = 7;
    std::vector<float> dout = rounded_to_floatX(lab_random((size_t)N * C));
    // dwte and dwpe accumulate (+=): they start from random contents, and rows no token touches must keep them
    std::vector<float> dwte_initial = rounded_to_floatX(lab_random((size_t)Vp * C));
    std::vector<float> dwpe_initial = rounded_to_floatX(lab_random((size_t)maxT * C));

    std::vector<double> dwte_sum(dwte_initial.begin(), dwte_initial.end());
    std::vector<double> dwpe_sum(dwpe_initial.begin(), dwpe_initial.end());
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < C; c++) {
                double d = dout[((size_t)b * T + t) * C + c];
                dwte_sum[(size_t)inp[b * T + t] * C + c] += d;
                dwpe_sum[(size_t)t * C + c] += d;
            }
    std::vector<float> dwte_reference(dwte_sum.begin(), dwte_sum.end());
    std::vector<float> dwpe_reference(dwpe_sum.begin(), dwpe_sum.end());

    floatX* d_dout = lab_to_device<floatX>(dout);
    int* d_inp = lab_ints_to_device(inp);
    floatX* d_dwte = lab_poisoned<floatX>((size_t)Vp * C);
    floatX* d_dwpe = lab_poisoned<floatX>((size_t)maxT * C);
    const size_t dwte_bytes = (size_t)Vp * C * sizeof(floatX), dwpe_bytes = (size_t)maxT * C * sizeof(floatX);
    std::vector<floatX> dwte_start((size_t)Vp * C), dwpe_start((size_t)maxT * C);
    for (size_t i = 0; i < dwte_start.size(); i++) dwte_start[i] = (floatX)dwte_initial[i];
    for (size_t i = 0; i < dwpe_start.size(); i++) dwpe_start[i] = (floatX)dwpe_initial[i];
    std::vector<floatX> first_dwte((size_t)Vp * C), first_dwpe((size_t)maxT * C);
    std::vector<floatX> again_dwte((size_t)Vp * C), again_dwpe((size_t)maxT * C);

    // fp32: sums of up to B*T/16 + a few terms of |d| <= 1 in an order other than the reference's, each
    // partial sum rounded to 2^-24 relative: observed errors stay under 1e-5 absolute at both sizes, so
    // atol 2e-5 and rtol 1e-5. bf16: stochastic rounding lands on one of the two bf16 neighbours of the
    // fp32 sum, an error below one bf16 ulp (2^-7 relative): rtol 8e-3, atol for sums that cancel near 0.
    const float rtol = PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 8e-3f;
    const float atol = PRECISION_MODE == PRECISION_FP32 ? 2e-5f : 1e-4f;
    int buckets = 0, largest_bucket = 0;
    {
        std::vector<int> count(V, 0);
        for (int t : inp) {
            buckets += count[t]++ == 0;
            largest_bucket = count[t] > largest_bucket ? count[t] : largest_bucket;
        }
    }
    const double bytes = ((double)N * C + 2.0 * buckets * C + 2.0 * T * C) * sizeof(floatX) + 20.0 * N;
    const int repeats = args.small ? 3 : 50;
    const int block_sizes[] = {64, 128, 256, 512};

    printf("encoder_backward (%s): B=%d T=%d C=%d V=%d, %d distinct tokens, largest bucket %d\n", PRECISION_NAME, B,
           T, C, V, buckets, largest_bucket);
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        for (int run = 0; run < 2; run++) {
            cudaCheck(cudaMemcpy(d_dwte, dwte_start.data(), dwte_bytes, cudaMemcpyHostToDevice));
            cudaCheck(cudaMemcpy(d_dwpe, dwpe_start.data(), dwpe_bytes, cudaMemcpyHostToDevice));
            run_variant(variant, d_dwte, d_dwpe, d_dout, d_inp, inp.data(), B, T, C, seed, 256);
            cudaCheck(cudaDeviceSynchronize());
            cudaCheck(cudaMemcpy(run == 0 ? first_dwte.data() : again_dwte.data(), d_dwte, dwte_bytes,
                                 cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(run == 0 ? first_dwpe.data() : again_dwpe.data(), d_dwpe, dwpe_bytes,
                                 cudaMemcpyDeviceToHost));
        }
        lab_validate("dwte", d_dwte, dwte_reference.data(), (size_t)Vp * C, atol, rtol);
        lab_validate("dwpe", d_dwpe, dwpe_reference.data(), (size_t)maxT * C, atol, rtol);
        if (memcmp(first_dwte.data(), again_dwte.data(), dwte_bytes) != 0 ||
            memcmp(first_dwpe.data(), again_dwpe.data(), dwpe_bytes) != 0) {
            printf("FAIL: two runs from the same state differ\n");
            return EXIT_FAILURE;
        }
        printf("  %-28s ok (two runs bitwise identical)\n", "determinism");
    }
    if (args.variant == 0 || args.variant == 2)
        validate_vocab_ranges(inp, dout, dwte_initial, dwpe_initial, d_dout, d_inp, B, T, C, V, seed, atol, rtol);
    lab_print_header("encoder_backward", args.small ? "small sizes" : "GPT-2 124M sizes");
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        for (int block_size : block_sizes) {
            if (variant == 2 && block_size != 256) continue;  // the llmc kernel's block is fixed: 8 warps
            float ms = lab_time_ms(repeats, [&]() {
                run_variant(variant, d_dwte, d_dwpe, d_dout, d_inp, inp.data(), B, T, C, seed, block_size);
            });
            lab_print_row(variant, block_size, ms, bytes, 0.0);
        }
    }
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_dwte));
    cudaCheck(cudaFree(d_dwpe));
    return 0;
}
