// dev/cuda/fused_classifier.cu: kernel lab for the fused classifier: per row of logits (B*T rows of Vp, the
// first V real) the cross-entropy loss -log softmax(logits)[target], and in place the gradient
// dloss * (softmax - onehot(target)), zero in the padding columns.
// Build and run on the CPU backend (small sizes):
//   make build/lab/fused_classifier_bf16   (build/lab/fused_classifier_fp32: the fp32 build)
//   build/lab/fused_classifier_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/fused_classifier.cu -o fused_classifier
//   ./fused_classifier [variant] [-s]       (GPT-2 124M sizes by default: B=8, T=1024, V=50257, Vp=50304)
// Variants:
//   1  one block per row, scalar loads, three passes over the row (maximum, sum of exponentials, gradient)
//   2  llmc/fused_classifier.cuh fused_classifier: one block per row, 16-byte loads, online maximum and sum
//      in one pass, the gradient in a second. The trainer's.
// Floor (see llmc/fused_classifier.cuh): bytes = 2*B*T*Vp*sizeof(floatX) + 8*B*T (B*T*Vp*sizeof(floatX) +
// 8*B*T for the loss alone).
#include "common.h"
#include "../../llmc/encoder.cuh"
#include "../../llmc/layernorm.cuh"
#include "../../llmc/fused_classifier.cuh"

__global__ void fused_classifier_three_pass_kernel(floatX* logits, float* losses, float dloss, const int* targets,
                                                   int V, int Vp, bool write_dlogits) {
    floatX* x = logits + (size_t)blockIdx.x * Vp;
    const int target = targets[blockIdx.x];
    if (target < 0) {  // masked: loss 0, gradient 0 (the same branch for the whole block)
        if (threadIdx.x == 0) losses[blockIdx.x] = 0.0f;
        for (int v = threadIdx.x; write_dlogits && v < Vp; v += blockDim.x) x[v] = (floatX)0.0f;
        return;
    }
    float thread_max = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) thread_max = fmaxf(thread_max, (float)x[v]);
    const float row_max = block_reduce<warp_reduce_max>(thread_max, true, -INFINITY);
    float thread_sum = 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) thread_sum += expf((float)x[v] - row_max);
    const float row_sum = block_reduce<warp_reduce_sum>(thread_sum);
    if (threadIdx.x == 0) losses[blockIdx.x] = row_max + logf(row_sum) - (float)x[target];
    __syncthreads();  // thread 0 has read the target logit before anyone overwrites it
    if (!write_dlogits) return;
    for (int v = threadIdx.x; v < Vp; v += blockDim.x) {
        float gradient = 0.0f;
        if (v < V) gradient = dloss * (expf((float)x[v] - row_max) / row_sum - (v == target ? 1.0f : 0.0f));
        x[v] = (floatX)gradient;
    }
}

static const int LLMC_BLOCK_SIZE = 0;  // run the llmc function itself, which picks its block size

static void run_variant(int variant, floatX* logits, float* losses, float dloss, const int* targets, int B, int T,
                        int V, int Vp, bool write_dlogits, int block_size) {
    if (variant == 1) {
        fused_classifier_three_pass_kernel<<<B * T, block_size>>>(logits, losses, dloss, targets, V, Vp,
                                                                  write_dlogits);
        cudaCheck(cudaGetLastError());
    } else if (block_size == LLMC_BLOCK_SIZE) {
        fused_classifier(logits, losses, dloss, targets, B, T, V, Vp, write_dlogits, 0);
    } else {
        fused_classifier_launch(logits, losses, dloss, targets, B, T, V, Vp, write_dlogits, block_size, 0);
    }
}

static std::vector<float> rounded_to_floatX(std::vector<float> values) {
    for (float& v : values) v = (float)(floatX)v;
    return values;
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    int B = 8, T = 1024, V = 50257, Vp = 50304;
    if (args.small) { B = 3; T = 37; V = 263; Vp = 280; }  // 17 padding columns: one vector straddles V
    const int N = B * T;
    const size_t n = (size_t)N * Vp;
    const float dloss = 1.0f / N;  // the mean over the batch, as the trainer uses it

    // logits of a trained-looking spread; the padding columns hold NaN, which no result may pick up
    std::vector<float> logits = rounded_to_floatX(lab_random(n, -8.0f, 8.0f));
    for (int row = 0; row < N; row++)
        for (int v = V; v < Vp; v++) logits[(size_t)row * Vp + v] = NAN;
    std::vector<int> targets = lab_random_ints(N, V);
    targets[0] = 0;
    targets[N - 1] = V - 1;  // the first and the last real column
    for (int row = 3; row < N - 1; row += 7) targets[row] = -1;  // masked targets (a loss mask): loss and gradient 0

    std::vector<float> loss_reference(N), dlogits_reference(n);
    for (int row = 0; row < N; row++) {
        const float* x = logits.data() + (size_t)row * Vp;
        double m = -INFINITY, sum = 0.0;
        for (int v = 0; v < V; v++) m = x[v] > m ? x[v] : m;
        for (int v = 0; v < V; v++) sum += exp((double)x[v] - m);
        const int masked = targets[row] < 0;
        loss_reference[row] = masked ? 0.0f : (float)(m + log(sum) - x[targets[row]]);
        for (int v = 0; v < Vp; v++) {
            double gradient = v < V && !masked
                                  ? dloss * (exp((double)x[v] - m) / sum - (v == targets[row] ? 1.0 : 0.0)) : 0.0;
            dlogits_reference[(size_t)row * Vp + v] = (float)gradient;
        }
    }

    floatX* d_logits = lab_poisoned<floatX>(n);
    float* d_losses = lab_poisoned<float>(N);
    int* d_targets = lab_ints_to_device(targets);
    std::vector<floatX> logits_floatX(n);
    for (size_t i = 0; i < n; i++) logits_floatX[i] = (floatX)logits[i];
    const size_t logits_bytes = n * sizeof(floatX);

    // losses are fp32 in both precisions, from the same floatX logits as the reference: the sum of V
    // exponentials in fp32 (per-thread chains, then a tree) is within ~1e-6 relative of the double sum, and
    // exp keeps a few ulp: loss ~ 10, rtol 1e-5, atol 1e-5. dlogits: exp(x - max) / sum in fp32, ~2e-6
    // relative: fp32 rtol 1e-5; bf16 rounds the result once (<= 2^-8 relative): rtol 5e-3. The atol, a
    // millionth of dloss, only covers the target column where softmax - 1 can cancel. fp16 (10-bit
    // mantissa, rtol 5e-3 covers it) stores gradients below 6e-5 as subnormals spaced 2^-24 apart: atol 2^-24.
    const float dlogits_rtol = PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 5e-3f;
    const float dlogits_atol = PRECISION_MODE == PRECISION_FP16 ? 5.9604645e-8f : 1e-6f * dloss;
    const int repeats = args.small ? 3 : 20;
    const int block_sizes[] = {128, 256, 512, 1024};

    // the start-up check: the lab's sizes and GPT-2's pass, each unsupported size is refused with a reason
    struct { int C, V, Vp; bool supported; } cases[] = {
        {768, 50257, 50304, true}, {48, V, Vp, true}, {1600, 50257, 50304, true}, {100, 50257, 50304, false},
        {0, 50257, 50304, false}, {768, 50257, 50257, false}, {768, 50305, 50304, false}, {768, 0, 128, false}};
    for (const auto& c : cases) {
        char why[256] = "";
        // the classifier's own check, with the encoder's and layernorm's that the trainer makes beside it
        const bool supported = encoder_support(c.C, why, sizeof(why)) && layernorm_support(c.C, why, sizeof(why)) &&
                               fused_classifier_support(c.V, c.Vp, why, sizeof(why));
        if (supported != c.supported || (!c.supported && why[0] == 0)) {
            printf("FAIL fused_classifier_support(V=%d, Vp=%d) with C=%d should say %s\n", c.V, c.Vp, c.C,
                   c.supported ? "supported" : "unsupported, with a reason");
            return EXIT_FAILURE;
        }
    }
    printf("fused_classifier_support: ok (%d cases)\n", (int)(sizeof(cases) / sizeof(cases[0])));

    printf("fused_classifier (%s): B=%d T=%d V=%d Vp=%d\n", PRECISION_NAME, B, T, V, Vp);
    // variant 2 runs as the trainer calls it (the llmc function picks the block size) and with 1024 threads,
    // where most threads of a small row see no element at all
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        const int validated_block_sizes[] = {1024, LLMC_BLOCK_SIZE};
        for (int b = 0; b < (variant == 1 ? 1 : 2); b++) {
            const int block_size = validated_block_sizes[b];
            if (block_size == LLMC_BLOCK_SIZE) printf("variant %d, as the trainer calls it\n", variant);
            else printf("variant %d, block %d\n", variant, block_size);
            for (int write_dlogits = 1; write_dlogits >= 0; write_dlogits--) {
                cudaCheck(cudaMemcpy(d_logits, logits_floatX.data(), logits_bytes, cudaMemcpyHostToDevice));
                cudaCheck(cudaMemset(d_losses, 0xff, N * sizeof(float)));
                run_variant(variant, d_logits, d_losses, dloss, d_targets, B, T, V, Vp, write_dlogits, block_size);
                cudaCheck(cudaDeviceSynchronize());
                lab_validate(write_dlogits ? "losses" : "losses (no dlogits)", d_losses, loss_reference.data(), N,
                             1e-5f, 1e-5f);
                if (write_dlogits) {
                    lab_validate("dlogits", d_logits, dlogits_reference.data(), n, dlogits_atol, dlogits_rtol);
                } else {
                    std::vector<floatX> after(n);
                    cudaCheck(cudaMemcpy(after.data(), d_logits, logits_bytes, cudaMemcpyDeviceToHost));
                    if (memcmp(after.data(), logits_floatX.data(), logits_bytes) != 0) {
                        printf("FAIL: the logits changed although no gradient was asked for\n");
                        return EXIT_FAILURE;
                    }
                    printf("  %-28s ok (untouched)\n", "logits (no dlogits)");
                }
            }
        }
    }
    lab_print_header("fused_classifier", args.small ? "small sizes" : "GPT-2 124M sizes");
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        for (int block_size : block_sizes) {
            // the gradient overwrites the logits: each call is timed on the previous call's gradient, which
            // costs the same
            float ms = lab_time_ms(repeats, [&]() {
                run_variant(variant, d_logits, d_losses, dloss, d_targets, B, T, V, Vp, true, block_size);
            });
            lab_print_row(variant, block_size, ms, 2.0 * n * sizeof(floatX) + 8.0 * N, 0.0);
        }
    }
    cudaCheck(cudaFree(d_logits));
    cudaCheck(cudaFree(d_losses));
    cudaCheck(cudaFree(d_targets));
    return 0;
}
