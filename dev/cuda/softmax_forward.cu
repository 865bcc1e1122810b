// dev/cuda/softmax_forward.cu: kernel lab for the causal softmax inside attention: att = softmax(scale * preatt)
// over each row of (B*NH*T, T), row r attending to its first r % T + 1 entries, zeros after them.
// Build and run (CPU backend; -DENABLE_FP32 for fp32):
//   make build/lab/softmax_forward_bf16   (build/lab/softmax_forward_fp32: the fp32 build)
//   build/lab/softmax_forward_bf16 [variant] [-s]
// Variants:
//   1  llmc/attention.cuh attention_softmax_forward (THE TRAINER'S, used in place on att): a warp per row,
//      one online pass for the max and the sum together (16-byte chunks), one pass to write.
//   2  a block per row, three passes (max, sum, write) with block-wide reductions through shared memory: more
//      threads per row, for short grids; the same 16-byte chunk loads.
// Sizes: B*NH = 8*12 (b, h) pairs, T=1024 (GPT-2 124M); -s: B*NH = 3*3 at T=37 (element path: rows are
// not 16-byte aligned) and T=64 (vector path).
// Floor: per (b, h) reads T(T+1)/2 elements (the causal part) and writes T*T:
// B*NH * (T(T+1)/2 + T^2) * sizeof(floatX) bytes; memory-bound (~5 flops per element read).
#include "common.h"
#include "../../llmc/attention.cuh"

template <bool vector_rows>
__global__ void softmax_block_per_row_kernel(floatX* att, const floatX* preatt, float scale, int rows, int T) {
    const int row = blockIdx.x;
    const int valid = row % T + 1;
    const floatX* in_row = preatt + (size_t)row * T;
    const int step = blockDim.x * x128::size;
    float local_max = -INFINITY;
    for (int i = threadIdx.x * x128::size; i < valid; i += step) {
        float values[x128::size];
        attention_load_chunk<vector_rows>(values, in_row, i, valid, T);
        for (int k = 0; k < x128::size; k++) local_max = fmaxf(local_max, scale * values[k]);
    }
    const float row_max = block_reduce<warp_reduce_max>(local_max, true, -INFINITY);
    float local_sum = 0.0f;
    for (int i = threadIdx.x * x128::size; i < valid; i += step) {
        float values[x128::size];
        attention_load_chunk<vector_rows>(values, in_row, i, valid, T);
        for (int k = 0; k < x128::size; k++) local_sum += expf(scale * values[k] - row_max);
    }
    const float inverse_sum = 1.0f / block_reduce<warp_reduce_sum>(local_sum);
    for (int i = threadIdx.x * x128::size; i < T; i += step) {
        float values[x128::size];
        attention_load_chunk<vector_rows>(values, in_row, i, valid, T);
        for (int k = 0; k < x128::size; k++) values[k] = expf(scale * values[k] - row_max) * inverse_sum;
        attention_store_chunk<vector_rows>(att + (size_t)row * T, values, i, T);
    }
}

static void softmax_block_per_row(floatX* att, const floatX* preatt, float scale, int rows, int T, int block_size) {
    if (attention_vector_rows(T, att, preatt, att))
        softmax_block_per_row_kernel<true><<<rows, block_size>>>(att, preatt, scale, rows, T);
    else
        softmax_block_per_row_kernel<false><<<rows, block_size>>>(att, preatt, scale, rows, T);
    cudaCheck(cudaGetLastError());
}

static void run_size(const LabArgs& args, int BNH, int T) {
    const int rows = BNH * T;
    const size_t n = (size_t)rows * T;
    const float scale = 1.0f / sqrtf(64.0f);
    // scores spread over +-16 before the scale (+-2 after): rows are neither flat nor one-hot; the part past
    // the causal boundary is random too, and must not leak into the result
    std::vector<float> preatt = lab_random(n, -16.0f, 16.0f);
    for (auto& x : preatt) x = (float)(floatX)x;  // the reference sees exactly what the device sees
    std::vector<float> att_ref(n);
    for (int r = 0; r < rows; r++) {
        const int valid = r % T + 1;
        const float* x = &preatt[(size_t)r * T];
        double max_value = -1e300, sum = 0.0;
        for (int s = 0; s < valid; s++) max_value = fmax(max_value, (double)scale * x[s]);
        for (int s = 0; s < valid; s++) sum += exp((double)scale * x[s] - max_value);
        for (int s = 0; s < T; s++)
            att_ref[(size_t)r * T + s] = s < valid ? (float)(exp((double)scale * x[s] - max_value) / sum) : 0.0f;
    }
    floatX* d_preatt = lab_to_device<floatX>(preatt);
    floatX* d_att = lab_poisoned<floatX>(n);
    floatX* d_inplace = lab_poisoned<floatX>(n);

    // Tolerances. bf16: inputs are exact, the sum is fp32; the output is rounded once (2^-9 relative): 5e-3
    // relative (~1.3 ulps; the fp32 exp and sum add ~1e-6) and 1e-5 absolute for tiny probabilities.
    // fp32: expf (the GPU's fast-math expf errs by ~2 ulps) and an fp32 sum over <= 1024 terms: 1e-5 relative,
    // 1e-7 absolute.
#if defined(ENABLE_FP32)
    const float rtol = 1e-5f, atol = 1e-7f;
#else
    const float rtol = 5e-3f, atol = 1e-5f;
#endif
    char sizes[128];
    snprintf(sizes, sizeof(sizes), "rows=%d (B*NH=%d) T=%d %s", rows, BNH, T, PRECISION_NAME);
    printf("softmax_forward: %s\n", sizes);
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        cudaCheck(cudaMemset(d_att, 0xff, n * sizeof(floatX)));
        if (variant == 1) attention_softmax_forward(d_att, d_preatt, scale, rows, T, 0);
        if (variant == 2) softmax_block_per_row(d_att, d_preatt, scale, rows, T, 128);
        lab_validate("att", d_att, att_ref.data(), n, atol, rtol);
        if (variant == 1) {
            cudaCheck(cudaMemcpy(d_inplace, d_preatt, n * sizeof(floatX), cudaMemcpyDeviceToDevice));
            attention_softmax_forward(d_inplace, d_inplace, scale, rows, T, 0);
            lab_validate("att (in place)", d_inplace, att_ref.data(), n, atol, rtol);
        }
    }

    lab_print_header("softmax_forward", sizes);
    const int repeats = args.small ? 3 : 20;
    const double bytes = (double)BNH * ((double)T * (T + 1) / 2 + (double)T * T) * sizeof(floatX);
    if (args.variant == 0 || args.variant == 1) {
        float ms = lab_time_ms(repeats, [&]() { attention_softmax_forward(d_att, d_preatt, scale, rows, T, 0); });
        lab_print_row(1, 256, ms, bytes, 0.0);
    }
    if (args.variant == 0 || args.variant == 2) {
        const int block_sizes[] = {32, 64, 128, 256};
        for (int block_size : block_sizes) {
            float ms = lab_time_ms(repeats, [&]() { softmax_block_per_row(d_att, d_preatt, scale, rows, T, block_size); });
            lab_print_row(2, block_size, ms, bytes, 0.0);
        }
    }
    cudaCheck(cudaFree(d_preatt));
    cudaCheck(cudaFree(d_att));
    cudaCheck(cudaFree(d_inplace));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    if (args.small) {
        run_size(args, 9, 37);
        run_size(args, 9, 64);
    } else {
        run_size(args, 96, 1024);
    }
    return 0;
}
