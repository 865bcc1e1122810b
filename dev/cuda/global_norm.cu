// dev/cuda/global_norm.cu: kernel lab for the squared global gradient norm, deterministic: sum of squares of
// several tensors into a fixed set of fp32 partials, then one fixed-order sum of the partials.
// Build and run (CPU backend; -DENABLE_FP32 for fp32):
//   make build/lab/global_norm_bf16   (build/lab/global_norm_fp32: the fp32 build)
//   build/lab/global_norm_bf16 [variant] [-s]
// Variants:
//   1  llmc/global_norm.cuh global_norm_squared + global_norm_aggregate (THE TRAINER'S): 128 blocks, each
//      over a contiguous segment walked in tiles of 256 x 8 16-byte chunks, 8 consecutive ones per thread;
//      one block adds the 128 partials.
//   2  a single block strides over every tensor and accumulates in its threads' registers across tensors:
//      one launch per tensor still, no partials array, but one block's worth of memory parallelism.
// Sizes: GPT-2 124M's gradient as two tensors (124,475,904 elements: the wte block 38,597,376 and the rest);
// -s: tensors of 10,007 and 4,099 elements (tails that are not whole 16-byte chunks).
// Floor: count * sizeof(floatX) bytes read once, 2 flops per element: memory-bound.
#include "common.h"
#include "../../llmc/global_norm.cuh"

// accumulator (one float per thread of the single block) += squares of its strided share of values; the
// last call of a sequence reduces them (fixed order) into out[0]
__global__ void global_norm_single_block_kernel(float* out, float* accumulator, const floatX* values, size_t count,
                                                bool reset, bool finish) {
    const size_t chunks = count / x128::size;
    float sum = reset ? 0.0f : accumulator[threadIdx.x];
    for (size_t c = threadIdx.x; c < chunks; c += blockDim.x) {
        x128 packed = load128cs(values + c * x128::size);
        for (int k = 0; k < x128::size; k++) sum += (float)packed[k] * (float)packed[k];
    }
    if (threadIdx.x < count % x128::size) {
        const float value = (float)values[chunks * x128::size + threadIdx.x];
        sum += value * value;
    }
    accumulator[threadIdx.x] = sum;
    if (finish) {
        const float total = block_reduce<warp_reduce_sum>(sum);
        if (threadIdx.x == 0) out[0] = total;
    }
}

static void global_norm_run(int variant, int block_size, float* out, float* partials, const floatX* const* tensors,
                            const size_t* counts, int num_tensors) {
    for (int i = 0; i < num_tensors; i++) {
        if (variant == 1) {
            global_norm_squared(partials, tensors[i], counts[i], 0);
            global_norm_aggregate(out, partials, global_norm_num_partials(counts[i]), i > 0, 0);
        } else
            global_norm_single_block_kernel<<<1, block_size>>>(out, partials, tensors[i], counts[i], i == 0,
                                                               i == num_tensors - 1);
        cudaCheck(cudaGetLastError());
    }
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    const size_t counts[2] = {args.small ? (size_t)10007 : (size_t)38597376,
                              args.small ? (size_t)4099 : (size_t)(124475904 - 38597376)};
    std::vector<float> hosts[2];
    floatX* tensors[2];
    double reference = 0.0;
    for (int i = 0; i < 2; i++) {
        hosts[i] = lab_random(counts[i], -1.0f, 1.0f);
        for (auto& x : hosts[i]) {
            x = (float)(floatX)x;  // the reference sees exactly what the device sees
            reference += (double)x * x;
        }
        tensors[i] = lab_to_device<floatX>(hosts[i]);
    }
    const size_t total = counts[0] + counts[1];
    const float reference_f = (float)reference;
    float* d_out = lab_poisoned<float>(1);
    // both variants' scratch: the tiles' partials, or one float per thread of the single block (<= 1024)
    size_t partials = global_norm_num_partials(counts[0] > counts[1] ? counts[0] : counts[1]);
    if (partials < 1024) partials = 1024;
    float* d_partials = lab_poisoned<float>(partials);

    // Tolerance: squares are exact in fp32 for floatX inputs; fp32 sums of n terms of ~1/3 err by ~n * 2^-24
    // relative in the worst case and ~sqrt(n) * 2^-24 typically. Each partial holds n / 128 terms (llmc) or
    // n / block (single block) terms before a tree over the partials: 1e-5 relative covers both at these
    // sizes (~1e-6 expected at 124M). A lost or doubled chunk changes the sum by >= 1/n relative: ~5e-5 at
    // -s; at 124M a lost chunk would hide below it, which is why -s runs with sizes where it cannot.
    const float rtol = 1e-5f;
    char sizes[128];
    snprintf(sizes, sizeof(sizes), "tensors of %zu + %zu elements %s", counts[0], counts[1], PRECISION_NAME);
    printf("global_norm: %s\n", sizes);
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        float results[2];
        for (int run = 0; run < 2; run++) {
            cudaCheck(cudaMemset(d_out, 0xff, sizeof(float)));
            cudaCheck(cudaMemset(d_partials, 0xff, partials * sizeof(float)));
            global_norm_run(variant, 512, d_out, d_partials, tensors, counts, 2);
            cudaCheck(cudaMemcpy(&results[run], d_out, sizeof(float), cudaMemcpyDeviceToHost));
        }
        lab_validate("sum of squares", d_out, &reference_f, 1, 0.0f, rtol);
        if (memcmp(&results[0], &results[1], sizeof(float)) != 0) {
            printf("FAIL sum of squares: two runs differ (%.9g, %.9g): not deterministic\n", results[0], results[1]);
            exit(EXIT_FAILURE);
        }
        printf("  %-28s ok (bit-identical over two runs)\n", "determinism");
    }

    lab_print_header("global_norm", sizes);
    const int repeats = args.small ? 3 : 20;
    const double bytes = (double)total * sizeof(floatX);
    if (args.variant == 0 || args.variant == 1) {
        float ms = lab_time_ms(repeats, [&]() { global_norm_run(1, 0, d_out, d_partials, tensors, counts, 2); });
        lab_print_row(1, GLOBAL_NORM_BLOCK_SIZE, ms, bytes, 0.0);
    }
    if (args.variant == 0 || args.variant == 2) {
        const int block_sizes[] = {256, 512, 1024};
        for (int block_size : block_sizes) {
            float ms = lab_time_ms(repeats,
                                   [&]() { global_norm_run(2, block_size, d_out, d_partials, tensors, counts, 2); });
            lab_print_row(2, block_size, ms, bytes, 0.0);
        }
    }
    for (int i = 0; i < 2; i++) cudaCheck(cudaFree(tensors[i]));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_partials));
    return 0;
}
