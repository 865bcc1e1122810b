// dev/cuda/moe_balance.cu: kernel lab for aux-loss-free balancing (doc/moe.md, "Routing options" 6): the step's
// loads, counts (Lm, E) += each micro-batch's expert_count (moe_add_counts), and after the optimizer step the
// balancing bias's update bias[m, e] += gamma * sign(sum_e' load[m, e'] - E * load[m, e]) (moe_balance_bias_update):
// the sign decided on integers, one fp32 rounding of the sum. The reference is a plain host loop on int64 and one
// fp32 addition per bias, so every result is compared exactly.
// Build and run on the CPU backend (small sizes):
//   make build/lab/moe_balance_bf16   (build/lab/moe_balance_fp32: the fp32 build)
//   build/lab/moe_balance_bf16 -s          (the fp32 build is the same: loads are ints, the bias fp32 either way)
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/moe_balance.cu -o moe_balance
//   ./moe_balance [variant] [-s]   (default: Lm = 58 MoE layers of E = 256 experts (DeepSeek-V3's shape) and Lm = 8
//                                   of E = 64 (the ds64 descriptor), 8 micro-batches a step; -s: Lm = 6 of E = 40
//                                   (Lm*E = 240, one partly empty block) and of E = 256, 3 micro-batches)
// Variants (each validates and times the add and the update):
//   1  one thread per layer: serial loops over the layer's E experts (the add; the total, then the E updates)
//   2  one block per layer: a thread per expert; the update sums the layer's total once (a shared-memory int64 tree),
//      then each thread moves its experts' biases
//   3  llmc/moe_balance.cuh moe_add_counts, moe_balance_bias_update: one thread per (layer, expert), each summing its
//      layer's E loads itself. The trainer's.
// Floor (see llmc/moe_balance.cuh): Lm*E*12 bytes for each (the add reads two ints and writes one; the update reads
// the load and reads and writes the bias). At Lm*E = 14848 that is 178 KB, ~0.04 us at ~4.8 TB/s: every variant is
// bound by its launch (a few us). Variant 3 also reads each layer's E loads E times from L1/L2 (Lm*E*E*4 bytes,
// 15 MB at E = 256), variant 2 once.
#include "common.h"
#include "../../llmc/moe_balance.cuh"

#define BALANCE_MAX_BLOCK 1024  // variant 2's shared-memory tree: one int64 per thread

__global__ void add_counts_thread_per_layer_kernel(int* counts, const int* add, int Lm, int E) {
    const int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= Lm) return;
    for (int e = 0; e < E; e++) counts[(size_t)m * E + e] += add[(size_t)m * E + e];
}

__global__ void bias_update_thread_per_layer_kernel(float* bias, const int* loads, int Lm, int E, float gamma) {
    const int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= Lm) return;
    const int* layer = loads + (size_t)m * E;
    long long total = 0;
    for (int e = 0; e < E; e++) total += layer[e];
    for (int e = 0; e < E; e++) {
        const long long excess = total - (long long)E * layer[e];
        bias[(size_t)m * E + e] += excess > 0 ? gamma : (excess < 0 ? -gamma : 0.0f);
    }
}

__global__ void add_counts_block_per_layer_kernel(int* counts, const int* add, int E) {
    const size_t layer = (size_t)blockIdx.x * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) counts[layer + e] += add[layer + e];
}

// the layer's total in int64: exact, so the tree's order does not matter
__global__ void bias_update_block_per_layer_kernel(float* bias, const int* loads, int E, float gamma) {
    __shared__ long long partial[BALANCE_MAX_BLOCK];
    const int* layer = loads + (size_t)blockIdx.x * E;
    long long sum = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) sum += layer[e];
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
        __syncthreads();
    }
    const long long total = partial[0];
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const long long excess = total - (long long)E * layer[e];
        bias[(size_t)blockIdx.x * E + e] += excess > 0 ? gamma : (excess < 0 ? -gamma : 0.0f);
    }
}

// counts (Lm, E) += add (Lm, E)
static void run_add(int variant, int* counts, const int* add, int Lm, int E, int block_size) {
    if (variant == 1) {
        add_counts_thread_per_layer_kernel<<<CEIL_DIV(Lm, block_size), block_size>>>(counts, add, Lm, E);
        cudaCheck(cudaGetLastError());
    } else if (variant == 2) {
        add_counts_block_per_layer_kernel<<<Lm, block_size>>>(counts, add, E);
        cudaCheck(cudaGetLastError());
    } else {
        moe_add_counts(counts, add, Lm * E, 0);
    }
}

// bias (Lm, E) moved by gamma against loads (Lm, E); variant 3 has one block size, the trainer's (256)
static void run_update(int variant, float* bias, const int* loads, int Lm, int E, float gamma, int block_size) {
    if (variant == 1) {
        bias_update_thread_per_layer_kernel<<<CEIL_DIV(Lm, block_size), block_size>>>(bias, loads, Lm, E, gamma);
        cudaCheck(cudaGetLastError());
    } else if (variant == 2) {
        bias_update_block_per_layer_kernel<<<Lm, block_size>>>(bias, loads, E, gamma);  // block_size a power of 2
        cudaCheck(cudaGetLastError());
    } else {
        moe_balance_bias_update(bias, loads, Lm, E, gamma, 0);
    }
}

// exits non-zero unless the device ints equal the expected ones (ints above 2^24 do not survive lab_validate's floats)
static void validate_ints(const char* name, const int* device_result, const std::vector<int>& expected) {
    std::vector<int> got(expected.size());
    cudaCheck(cudaMemcpy(got.data(), device_result, got.size() * sizeof(int), cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (got[i] != expected[i]) {
            if (bad < 5) printf("  %s[%zu]: got %d, want %d\n", name, i, got[i], expected[i]);
            bad++;
        }
    }
    if (bad) {
        printf("FAIL %s: %zu of %zu elements differ\n", name, bad, got.size());
        exit(EXIT_FAILURE);
    }
    printf("  %-28s ok (exact over %zu elements)\n", name, got.size());
}

// K micro-batches' counts (K, Lm, E), each layer of its own kind (m % 6), so that every kind meets every width:
//   0  random loads in [0, 50): every sign, some at the mean by chance
//   1  every expert the same load: nothing moves
//   2  experts 0 and E-1 exactly at the mean (7 a micro-batch), the others at 5 and 9: the zero sign among others
//   3  one expert takes every choice: it moves down, all others up
//   4  loads near 2^26 a micro-batch: E * load and the layer's total pass 2^31, so only int64 gets the sign right
//   5  random loads of 0 or 1 a micro-batch: few distinct loads, many experts on either side of the mean
static std::vector<int> balance_counts(int K, int Lm, int E) {
    std::vector<int> counts((size_t)K * Lm * E);
    for (int b = 0; b < K; b++) {
        for (int m = 0; m < Lm; m++) {
            int* c = counts.data() + ((size_t)b * Lm + m) * E;
            const std::vector<int> random = lab_random_ints(E, m % 6 == 5 ? 2 : 50);
            for (int e = 0; e < E; e++) {
                switch (m % 6) {
                    case 0: c[e] = random[e]; break;
                    case 1: c[e] = 11; break;
                    case 2: c[e] = e == 0 || e == E - 1 ? 7 : (e < E / 2 ? 5 : 9); break;
                    case 3: c[e] = e == E / 3 ? 100 : 0; break;
                    case 4: c[e] = (1 << 26) - (1 << 20) + random[e] * (1 << 15); break;
                    default: c[e] = random[e]; break;
                }
            }
        }
    }
    return counts;
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    struct Case { int Lm, E, K; };
    const Case full_cases[] = {{58, 256, 8}, {8, 64, 8}};
    const Case small_cases[] = {{6, 40, 3}, {6, 256, 3}};
    const Case* cases = args.small ? small_cases : full_cases;
    const int num_cases = args.small ? (int)(sizeof(small_cases) / sizeof(small_cases[0]))
                                     : (int)(sizeof(full_cases) / sizeof(full_cases[0]));
    // biases in [-0.01, 0.01] as a trained model's, and every fourth in [1, 4], where bias + gamma is not exact (an
    // ulp of 1.2e-7 to 2.4e-7) and the fp32 rounding of the sum is what is compared
    const float gamma = 0.001f;
    const int block_sizes[] = {64, 128, 256, 512};
    const int repeats = args.small || lab_on_cpu_backend() ? 3 : 100;  // CPU-backend times are only indicative

    printf("moe_balance (%s build; loads are ints, the bias fp32)\n", PRECISION_NAME);
    for (int c = 0; c < num_cases; c++) {
        const int Lm = cases[c].Lm, E = cases[c].E, K = cases[c].K;
        const size_t n = (size_t)Lm * E;
        const std::vector<int> counts = balance_counts(K, Lm, E);
        std::vector<float> bias = lab_random(n, -0.01f, 0.01f);
        for (size_t i = 0; i < n; i += 4) bias[i] = lab_rand_uniform(1.0f, 4.0f);

        // reference: the loads summed over the micro-batches, then per expert the sign of (total - E * load) in
        // int64 and one fp32 addition (gamma, -gamma or nothing)
        std::vector<int> loads(n, 0);
        for (int b = 0; b < K; b++)
            for (size_t i = 0; i < n; i++) loads[i] += counts[(size_t)b * n + i];
        std::vector<float> expected(n);
        int moved_up = 0, moved_down = 0;
        for (int m = 0; m < Lm; m++) {
            long long total = 0;
            for (int e = 0; e < E; e++) total += loads[(size_t)m * E + e];
            for (int e = 0; e < E; e++) {
                const size_t i = (size_t)m * E + e;
                const long long excess = total - (long long)E * loads[i];
                const float step = excess > 0 ? gamma : (excess < 0 ? -gamma : 0.0f);
                expected[i] = bias[i] + step;
                moved_up += excess > 0;
                moved_down += excess < 0;
            }
        }

        int* d_counts = lab_ints_to_device(counts);
        int* d_loads = lab_ints_to_device(std::vector<int>(n, 0));
        float* d_bias = lab_to_device<float>(bias);
        printf("Lm=%d E=%d, %d micro-batches: %d biases up, %d down, %zu unchanged\n", Lm, E, K, moved_up, moved_down,
               n - moved_up - moved_down);
        for (int variant = 1; variant <= 3; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            // the loads accumulate and the update works in place: nothing to poison; they start from the zero loads
            // and the host's bias, and each of +gamma, -gamma and 0 occurs, so a skipped element shows
            cudaCheck(cudaMemset(d_loads, 0, n * sizeof(int)));
            cudaCheck(cudaMemcpy(d_bias, bias.data(), n * sizeof(float), cudaMemcpyHostToDevice));
            // block 64 < E = 256 makes variant 2's threads take several experts each
            const int block_size = variant == 2 ? 64 : 256;
            for (int b = 0; b < K; b++) run_add(variant, d_loads, d_counts + (size_t)b * n, Lm, E, block_size);
            cudaCheck(cudaDeviceSynchronize());
            printf("variant %d\n", variant);
            validate_ints("loads", d_loads, loads);
            run_update(variant, d_bias, d_loads, Lm, E, gamma, block_size);
            cudaCheck(cudaDeviceSynchronize());
            // integers, then one correctly rounded fp32 addition on either side (fast math leaves additions alone)
            lab_validate("bias", d_bias, expected.data(), n, 0.0f, 0.0f);
        }

        // timed on loads below 50 per call, so that the repeated adds stay far from int overflow
        int* d_timing_counts = lab_ints_to_device(lab_random_ints(n, 50));
        cudaCheck(cudaMemset(d_loads, 0, n * sizeof(int)));
        char sizes[64];
        snprintf(sizes, sizeof(sizes), "Lm=%d E=%d", Lm, E);
        for (int update = 0; update <= 1; update++) {
            lab_print_header(update ? "moe_balance_bias_update" : "moe_add_counts", sizes);
            for (int variant = 1; variant <= 3; variant++) {
                if (args.variant != 0 && args.variant != variant) continue;
                for (int block_size : block_sizes) {
                    if (variant == 3 && block_size != 256) continue;  // the header's launch has one block size
                    // repeated: the loads keep growing and the biases keep moving, which only the timing sees
                    float ms = lab_time_ms(repeats, [&]() {
                        if (update) run_update(variant, d_bias, d_loads, Lm, E, gamma, block_size);
                        else run_add(variant, d_loads, d_timing_counts, Lm, E, block_size);
                    });
                    lab_print_row(variant, block_size, ms, 12.0 * n, 0.0);
                }
            }
        }
        cudaCheck(cudaFree(d_counts));
        cudaCheck(cudaFree(d_timing_counts));
        cudaCheck(cudaFree(d_loads));
        cudaCheck(cudaFree(d_bias));
    }
    return 0;
}
