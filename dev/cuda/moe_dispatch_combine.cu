// dev/cuda/moe_dispatch_combine.cu: kernel lab for the MoE data movement around the expert GEMMs, forward and
// backward: dispatch (token rows into the expert buffer, padded (E, capacity, C) with zeros in padding rows, or
// packed dropless (N*k, C)), combine (each token's kept expert outputs weighted by its gates), combine backward
// (d_expert_output and d_gates) and dispatch backward (dx += the token's rows of d_expert_input).
// doc/moe.md; the layouts: llmc/moe_common.cuh.
// Build and run on the CPU backend (small sizes):
//   make build/lab/moe_dispatch_combine_bf16   (build/lab/moe_dispatch_combine_fp32: the fp32 build)
//   build/lab/moe_dispatch_combine_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/moe_dispatch_combine.cu -o moe_dispatch_combine
//   ./moe_dispatch_combine [variant] [-s]   (default: N = 8*1024, E = 8, C = 768, k = 1 and 2 at CF 1.25;
//                                            -s: N = 69, E = 4, C = 48, k = 1 and 2 at CF 0.5, k = 2 dropless
//                                            packed)
// Variants:
//   1  llmc/moe_dispatch_combine.cuh moe_dispatch: one warp per destination row, its source found through row_choice. The trainer's.
//   2  dispatch scattered: one warp per (token, choice) copies to its row, a second kernel zeroes padding rows
//   3  llmc/moe_dispatch_combine.cuh moe_combine: one warp per token gathers its kept rows. The trainer's (a scatter-add is the
//      only other form, and it would need float atomics).
//   4  llmc/moe_dispatch_combine.cuh moe_combine_backward: one warp per expert row (d_expert_output row and its d_gate), dropped
//      choices' d_gates zeroed by the first N*k warps. The trainer's.
//   5  combine backward per token: one warp per token writes its k rows and d_gates, a second kernel zeroes
//      padding rows
//   6  llmc/moe_dispatch_combine.cuh moe_dispatch_backward: one warp per token gathers its kept rows into dx. The trainer's.
// Floors (see llmc/moe_dispatch_combine.cuh; kept = rows used, R = the buffer's rows, s = sizeof(floatX)):
//   dispatch         (kept + R)*C*s + 4*R        combine            (kept + N)*C*s + 8*N*k
//   combine backward (2*kept + R)*C*s + 8*N*k + 4*R                 dispatch backward  (kept + 2*N)*C*s + 4*N*k
#include "common.h"
#include "../../llmc/moe_dispatch_combine.cuh"
#include "moe_reference.h"

__global__ void dispatch_scatter_kernel(floatX* expert_input, const floatX* x, const int* choice_row,
                                        int num_choices, int k, int C) {
    const int choice = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (choice >= num_choices) return;
    const int row = choice_row[choice];
    if (row < 0) return;
    const int lane = threadIdx.x % 32;
    const floatX* source = x + (size_t)(choice / k) * C;
    floatX* destination = expert_input + (size_t)row * C;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) store128(destination + c, load128(source + c));
}

// rows [kept_count[e], capacity) of every expert's buffer = 0 (the padded layout; the packed one has no padding)
__global__ void zero_padding_rows_kernel(floatX* buffer, const int* kept_count, int num_rows, int C, int capacity) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= num_rows || row % capacity < kept_count[row / capacity]) return;
    const int lane = threadIdx.x % 32;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) store128(buffer + (size_t)row * C + c, x128::zeros());
}

__global__ void combine_backward_per_token_kernel(floatX* d_expert_output, float* d_gates, const floatX* dout,
                                                  const floatX* expert_output, const int* choice_row,
                                                  const float* gates, int N, int k, int C) {
    const int token = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (token >= N) return;
    const int lane = threadIdx.x % 32;
    const floatX* d_token = dout + (size_t)token * C;
    for (int j = 0; j < k; j++) {
        const int choice = token * k + j;
        if (choice_row[choice] < 0) {
            if (lane == 0) d_gates[choice] = 0.0f;
            continue;
        }
        const size_t row = (size_t)choice_row[choice];
        const float gate = gates[choice];
        float dot = 0.0f;
        for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
            const x128 d = load128(d_token + c);
            const x128 v = load128cs(expert_output + row * C + c);
            x128 result;
            for (int i = 0; i < x128::size; i++) {
                result[i] = (floatX)(gate * (float)d[i]);
                dot += (float)d[i] * (float)v[i];
            }
            store128(d_expert_output + row * C + c, result);
        }
        dot = warp_reduce_sum(dot);
        if (lane == 0) d_gates[choice] = dot;
    }
}

struct MoeBuffers {
    floatX* x;                // (N, C)
    floatX* expert_input;     // (R, C)
    floatX* expert_output;    // (R, C), NaN in padding rows
    floatX* out;              // (N, C)
    floatX* dout;             // (N, C)
    floatX* d_expert_output;  // (R, C)
    float* d_gates;           // (N, k)
    floatX* d_expert_input;   // (R, C), NaN in padding rows
    floatX* dx;               // (N, C)
    int* choice_row;          // (N, k)
    float* gates;             // (N, k)
    int* row_choice;          // (R)
    int* kept_count;          // (E)
};

// packed: the dropless layout (num_rows = N*k, no padding rows); otherwise padded, num_rows = E*capacity
static void run_variant(int variant, const MoeBuffers* d, int N, int k, int C, int capacity, int num_rows, bool packed,
                        int block_size) {
    const int rows_per_block = block_size / 32;
    if (variant == 1) {
        moe_dispatch_launch(d->expert_input, d->x, d->row_choice, num_rows, k, C, block_size, 0);
    } else if (variant == 2) {
        dispatch_scatter_kernel<<<CEIL_DIV(N * k, rows_per_block), block_size>>>(d->expert_input, d->x, d->choice_row,
                                                                                 N * k, k, C);
        cudaCheck(cudaGetLastError());
        if (!packed) {
            zero_padding_rows_kernel<<<CEIL_DIV(num_rows, rows_per_block), block_size>>>(d->expert_input,
                                                                                         d->kept_count, num_rows, C,
                                                                                         capacity);
            cudaCheck(cudaGetLastError());
        }
    } else if (variant == 3) {
        moe_combine_launch(d->out, d->expert_output, d->choice_row, d->gates, N, k, C, block_size, 0);
    } else if (variant == 4) {
        moe_combine_backward_launch(d->d_expert_output, d->d_gates, d->dout, d->expert_output, d->choice_row, d->gates,
                                    d->row_choice, N, num_rows, k, C, block_size, 0);
    } else if (variant == 5) {
        combine_backward_per_token_kernel<<<CEIL_DIV(N, rows_per_block), block_size>>>(
            d->d_expert_output, d->d_gates, d->dout, d->expert_output, d->choice_row, d->gates, N, k, C);
        cudaCheck(cudaGetLastError());
        if (!packed) {
            zero_padding_rows_kernel<<<CEIL_DIV(num_rows, rows_per_block), block_size>>>(d->d_expert_output,
                                                                                         d->kept_count, num_rows, C,
                                                                                         capacity);
            cudaCheck(cudaGetLastError());
        }
    } else {
        moe_dispatch_backward_launch(d->dx, d->d_expert_input, d->choice_row, N, k, C, block_size, 0);
    }
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    struct Case { int N, E, k, C; double cf; };  // cf <= 0: dropless, in the packed layout
    const Case full_cases[] = {{8 * 1024, 8, 1, 768, 1.25}, {8 * 1024, 8, 2, 768, 1.25}, {8 * 1024, 8, 2, 768, 0.0}};
    // C = 48: 6 (bf16) or 12 (fp32) vectors per row, fewer than the 32 lanes of a warp
    const Case small_cases[] = {{69, 4, 1, 48, 0.5}, {69, 4, 2, 48, 0.5}, {69, 4, 2, 48, 0.0}};
    const Case* cases = args.small ? small_cases : full_cases;
    const int num_cases = 3;
    const int block_sizes[] = {64, 128, 256, 512};
    const int repeats = args.small || lab_on_cpu_backend() ? 3 : 100;  // CPU-backend times are only indicative

    printf("moe_dispatch_combine (%s)\n", PRECISION_NAME);
    for (int c = 0; c < num_cases; c++) {
        const int N = cases[c].N, E = cases[c].E, k = cases[c].k, C = cases[c].C;
        const int capacity = moe_capacity(N, E, k, cases[c].cf);
        const bool packed = cases[c].cf <= 0.0;
        const size_t num_choices = (size_t)N * k, num_rows = packed ? num_choices : (size_t)E * capacity;
        const size_t token_elements = (size_t)N * C, row_elements = num_rows * C;

        std::vector<int> expert_index = moe_skewed_routing(N, E, k);
        const MoeSlots slots = moe_slots_reference(expert_index, N, E, k, capacity, packed);
        const std::vector<int>& choice_row = slots.choice_row;
        const std::vector<int>& row_choice = slots.row_choice;
        const std::vector<int>& kept_count = slots.kept_count;
        std::vector<float> gates = lab_random(num_choices, 0.05f, 1.0f);
        std::vector<float> x = lab_random_rounded(token_elements, -1.0f, 1.0f);
        std::vector<float> dout = lab_random_rounded(token_elements, -1.0f, 1.0f);
        std::vector<float> dx_before = lab_random_rounded(token_elements, -1.0f, 1.0f);
        std::vector<float> expert_output = lab_random_rounded(row_elements, -1.0f, 1.0f);
        std::vector<float> d_expert_input = lab_random_rounded(row_elements, -1.0f, 1.0f);
        // padding rows hold NaN: a kernel that reads one fails validation
        for (size_t r = 0; r < num_rows; r++) {
            if (row_choice[r] >= 0) continue;
            for (int i = 0; i < C; i++) expert_output[r * C + i] = d_expert_input[r * C + i] = NAN;
        }
        int kept_rows = 0, tokens_all_dropped = 0;
        for (int e = 0; e < E; e++) kept_rows += kept_count[e];
        for (int t = 0; t < N; t++) {
            bool any = false;
            for (int j = 0; j < k; j++) any = any || choice_row[(size_t)t * k + j] >= 0;
            tokens_all_dropped += !any;
        }
        printf("N=%d E=%d k=%d C=%d CF=%g (%s): capacity %d, %d of %d rows used, %d tokens with every choice dropped\n",
               N, E, k, C, cases[c].cf, packed ? "packed" : "padded", capacity, kept_rows, (int)num_rows,
               tokens_all_dropped);
        if (args.small && cases[c].cf > 0.0 && tokens_all_dropped == 0) {
            printf("FAIL: the capacity-limited inputs drop no token entirely\n");
            exit(EXIT_FAILURE);
        }

        // double-precision references of the semantics
        std::vector<float> expert_input_ref(row_elements, 0.0f), out_ref(token_elements, 0.0f);
        std::vector<float> d_expert_output_ref(row_elements, 0.0f), d_gates_ref(num_choices, 0.0f);
        std::vector<float> dx_ref(token_elements);
        for (size_t r = 0; r < num_rows; r++) {
            if (row_choice[r] < 0) continue;
            const int t = row_choice[r] / k;
            for (int i = 0; i < C; i++) expert_input_ref[r * C + i] = x[(size_t)t * C + i];
        }
        for (int t = 0; t < N; t++) {
            for (int i = 0; i < C; i++) {
                double sum = 0.0, d_sum = dx_before[(size_t)t * C + i];
                for (int j = 0; j < k; j++) {
                    const int choice = t * k + j;
                    if (choice_row[choice] < 0) continue;
                    const size_t row = (size_t)choice_row[choice];
                    sum += (double)gates[choice] * expert_output[row * C + i];
                    d_sum += d_expert_input[row * C + i];
                }
                out_ref[(size_t)t * C + i] = (float)sum;
                dx_ref[(size_t)t * C + i] = (float)d_sum;
            }
            for (int j = 0; j < k; j++) {
                const int choice = t * k + j;
                if (choice_row[choice] < 0) continue;
                const size_t row = (size_t)choice_row[choice];
                double dot = 0.0;
                for (int i = 0; i < C; i++) {
                    d_expert_output_ref[row * C + i] = (float)((double)gates[choice] * dout[(size_t)t * C + i]);
                    dot += (double)dout[(size_t)t * C + i] * expert_output[row * C + i];
                }
                d_gates_ref[choice] = (float)dot;
            }
        }

        MoeBuffers d;
        d.x = lab_to_device<floatX>(x);
        d.expert_input = lab_poisoned<floatX>(row_elements);
        d.expert_output = lab_to_device<floatX>(expert_output);
        d.out = lab_poisoned<floatX>(token_elements);
        d.dout = lab_to_device<floatX>(dout);
        d.d_expert_output = lab_poisoned<floatX>(row_elements);
        d.d_gates = lab_poisoned<float>(num_choices);
        d.d_expert_input = lab_to_device<floatX>(d_expert_input);
        d.dx = lab_to_device<floatX>(dx_before);
        d.choice_row = lab_ints_to_device(choice_row);
        d.gates = lab_to_device<float>(gates);
        d.row_choice = lab_ints_to_device(row_choice);
        d.kept_count = lab_ints_to_device(kept_count);
        std::vector<floatX> dx_before_floatX(dx_before.begin(), dx_before.end());

        // Tolerances. Copies (dispatch) are exact. Outputs rounded once to floatX from fp32 arithmetic: bf16 half
        // an ulp is 2^-9 = 1.95e-3 relative, so rtol 4e-3; fp32 rtol 1e-6; atol 1e-6 for the fp32 rounding of
        // sums of two terms that cancel. d_gates: fp32 dot of C products of |values| <= 1, each lane adding C/32
        // of them then 5 butterfly levels: |error| <= (C/32 + 6) * 2^-24 * C, the bound used as atol.
        const float rtol = PRECISION_MODE == PRECISION_FP32 ? 1e-6f : 4e-3f;
        const float dot_atol = (float)((C / 32 + 6) * C) * 5.97e-8f;
        for (int variant = 1; variant <= 6; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            cudaCheck(cudaMemset(d.expert_input, 0xff, row_elements * sizeof(floatX)));
            cudaCheck(cudaMemset(d.out, 0xff, token_elements * sizeof(floatX)));
            cudaCheck(cudaMemset(d.d_expert_output, 0xff, row_elements * sizeof(floatX)));
            cudaCheck(cudaMemset(d.d_gates, 0xff, num_choices * sizeof(float)));
            cudaCheck(cudaMemcpy(d.dx, dx_before_floatX.data(), token_elements * sizeof(floatX), cudaMemcpyHostToDevice));
            run_variant(variant, &d, N, k, C, capacity, (int)num_rows, packed, 256);
            cudaCheck(cudaDeviceSynchronize());
            printf("variant %d\n", variant);
            if (variant <= 2) lab_validate("expert_input", d.expert_input, expert_input_ref.data(), row_elements, 0.0f, 0.0f);
            if (variant == 3) lab_validate("out", d.out, out_ref.data(), token_elements, 1e-6f, rtol);
            if (variant == 4 || variant == 5) {
                lab_validate("d_expert_output", d.d_expert_output, d_expert_output_ref.data(), row_elements, 1e-6f, rtol);
                lab_validate("d_gates", d.d_gates, d_gates_ref.data(), num_choices, dot_atol, 0.0f);
            }
            if (variant == 6) lab_validate("dx", d.dx, dx_ref.data(), token_elements, 1e-6f, rtol);
        }

        char sizes[96];
        snprintf(sizes, sizeof(sizes), "N=%d E=%d k=%d C=%d capacity=%d %s", N, E, k, C, capacity,
                 packed ? "packed" : "padded");
        lab_print_header("moe_dispatch_combine", sizes);
        const double s = sizeof(floatX);
        const double kept_bytes = (double)kept_rows * C * s, row_bytes = (double)row_elements * s;
        const double token_bytes = (double)token_elements * s;
        const double floors[7] = {0.0,
                                  kept_bytes + row_bytes + 4.0 * num_rows,
                                  kept_bytes + row_bytes + 4.0 * num_rows,
                                  kept_bytes + token_bytes + 8.0 * num_choices,
                                  2.0 * kept_bytes + row_bytes + 8.0 * num_choices + 4.0 * num_rows,
                                  2.0 * kept_bytes + row_bytes + 8.0 * num_choices + 4.0 * num_rows,
                                  kept_bytes + 2.0 * token_bytes + 4.0 * num_choices};
        for (int variant = 1; variant <= 6; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            for (int block_size : block_sizes) {
                float ms = lab_time_ms(repeats, [&]() {
                    run_variant(variant, &d, N, k, C, capacity, (int)num_rows, packed, block_size);
                });
                lab_print_row(variant, block_size, ms, floors[variant], 0.0);
            }
        }
        cudaCheck(cudaFree(d.x));
        cudaCheck(cudaFree(d.expert_input));
        cudaCheck(cudaFree(d.expert_output));
        cudaCheck(cudaFree(d.out));
        cudaCheck(cudaFree(d.dout));
        cudaCheck(cudaFree(d.d_expert_output));
        cudaCheck(cudaFree(d.d_gates));
        cudaCheck(cudaFree(d.d_expert_input));
        cudaCheck(cudaFree(d.dx));
        cudaCheck(cudaFree(d.choice_row));
        cudaCheck(cudaFree(d.gates));
        cudaCheck(cudaFree(d.row_choice));
        cudaCheck(cudaFree(d.kept_count));
    }
    return 0;
}
