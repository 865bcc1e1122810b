// dev/cuda/gelu.cu: kernel lab for GELU (tanh approximation), forward out = gelu(inp) and backward in place
// d *= gelu'(inp).
// Build and run on the CPU backend (small sizes):
//   make build/lab/gelu_bf16   (build/lab/gelu_fp32: the fp32 build)
//   build/lab/gelu_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/gelu.cu -o gelu
//   ./gelu [variant] [-s]       (GPT-2 124M sizes by default: N = B*T*4C = 8*1024*3072)
// Variants (each validates and times the forward and the backward):
//   1  one thread per element, scalar loads and stores
//   2  llmc/gelu.cuh gelu_forward / gelu_backward_inplace: 8 elements per thread, 16-byte vectors, a scalar
//      tail when N % 8 != 0. The trainer's.
// Floors (see llmc/gelu.cuh): forward 2*N*sizeof(floatX) bytes, backward 3*N*sizeof(floatX).
#include "common.h"
#include "../../llmc/gelu.cuh"

__global__ void gelu_forward_scalar_kernel(floatX* out, const floatX* inp, size_t N) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = (floatX)gelu_value((float)inp[i]);
}

__global__ void gelu_backward_scalar_kernel(floatX* d_in_out, const floatX* inp, size_t N) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) d_in_out[i] = (floatX)((float)d_in_out[i] * gelu_derivative((float)inp[i]));
}

static void run_forward(int variant, floatX* out, const floatX* inp, int N, int block_size) {
    if (variant == 1) {
        gelu_forward_scalar_kernel<<<CEIL_DIV(N, block_size), block_size>>>(out, inp, (size_t)N);
        cudaCheck(cudaGetLastError());
    } else if (block_size == 256) {
        gelu_forward(out, inp, N, 0);
    } else {
        gelu_forward_launch(out, inp, N, block_size, 0);
    }
}

static void run_backward(int variant, floatX* d, const floatX* inp, int N, int block_size) {
    if (variant == 1) {
        gelu_backward_scalar_kernel<<<CEIL_DIV(N, block_size), block_size>>>(d, inp, (size_t)N);
        cudaCheck(cudaGetLastError());
    } else if (block_size == 256) {
        gelu_backward_inplace(d, inp, N, 0);
    } else {
        gelu_backward_inplace_launch(d, inp, N, block_size, 0);
    }
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    int N = 8 * 1024 * 4 * 768;
    if (args.small) N = 3 * 37 * 4 * 48 + 5;  // not a multiple of 8: the vector kernel's tail runs

    // [-6, 6] covers both saturated ends and the curved middle
    std::vector<float> inp = lab_random_rounded(N, -6.0f, 6.0f);
    std::vector<float> dout = lab_random_rounded(N, -1.0f, 1.0f);
    std::vector<float> forward_reference(N), backward_reference(N);
    for (int i = 0; i < N; i++) {
        forward_reference[i] = (float)gelu_reference(inp[i]);
        backward_reference[i] = (float)(dout[i] * gelu_grad_reference(inp[i]));
    }

    floatX* d_inp = lab_to_device<floatX>(inp);
    floatX* d_out = lab_poisoned<floatX>(N);
    floatX* d_grad = lab_poisoned<floatX>(N);
    std::vector<floatX> dout_floatX(N);
    for (int i = 0; i < N; i++) dout_floatX[i] = (floatX)dout[i];

    // fp32: one exponential (a few ulp, also with __expf on the GPU for |2u| < 90) and a few fp32 operations;
    // the sigmoid form has no cancellation, so the relative error stays ~1e-6 even where gelu(x) ~ 1e-8:
    // rtol 1e-5; atol 1e-7 only for the exact zeros of the saturated ends. bf16: one rounding of the result
    // (<= 2^-8 relative) after the same fp32 arithmetic: rtol 5e-3.
    const float rtol = PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 5e-3f;
    const float atol = 1e-7f;
    const int repeats = args.small ? 3 : 100;
    const int block_sizes[] = {128, 256, 512, 1024};

    printf("gelu (%s): N=%d\n", PRECISION_NAME, N);
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        cudaCheck(cudaMemset(d_out, 0xff, (size_t)N * sizeof(floatX)));
        run_forward(variant, d_out, d_inp, N, 256);
        cudaCheck(cudaMemcpy(d_grad, dout_floatX.data(), (size_t)N * sizeof(floatX), cudaMemcpyHostToDevice));
        run_backward(variant, d_grad, d_inp, N, 256);
        cudaCheck(cudaDeviceSynchronize());
        lab_validate("forward out", d_out, forward_reference.data(), N, atol, rtol);
        lab_validate("backward dinp", d_grad, backward_reference.data(), N, atol, rtol);
    }
    const char* sizes = args.small ? "small sizes" : "GPT-2 124M sizes (B*T*4C)";
    for (int backward = 0; backward <= 1; backward++) {
        lab_print_header(backward ? "gelu_backward_inplace" : "gelu_forward", sizes);
        for (int variant = 1; variant <= 2; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            for (int block_size : block_sizes) {
                // in place: repeated backward calls keep scaling the gradient, which only the timing sees
                float ms = lab_time_ms(repeats, [&]() {
                    if (backward) run_backward(variant, d_grad, d_inp, N, block_size);
                    else run_forward(variant, d_out, d_inp, N, block_size);
                });
                lab_print_row(variant, block_size, ms, (backward ? 3.0 : 2.0) * N * sizeof(floatX), 0.0);
            }
        }
    }
    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_grad));
    return 0;
}
