// dev/cuda/swiglu.cu: kernel lab for SwiGLU, forward out (N, H) = silu(gate) * up from inp (N, 2H) = [gate | up]
// per row, and backward dinp (N, 2H) = [dgate | dup] from dout (N, H) and inp.
// Build and run on the CPU backend (small sizes):
//   make build/lab/swiglu_bf16   (build/lab/swiglu_fp32: the fp32 build)
//   build/lab/swiglu_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/swiglu.cu -o swiglu
//   ./swiglu [variant] [-s]       (Llama-style sizes at GPT-2 124M's width: N = B*T = 8*1024, H = 2048)
// Variants (each validates and times the forward and the backward):
//   1  one thread per output element, scalar loads and stores
//   2  llmc/swiglu.cuh swiglu_forward / swiglu_backward: 8 elements per thread, 16-byte vectors. The trainer's.
// The backward of variant 2 is also validated in place (dinp = inp). The double-precision derivative that the
// reference uses is itself checked first against central differences.
// Floors (see llmc/swiglu.cuh): forward 3*N*H*sizeof(floatX) bytes, backward 5*N*H*sizeof(floatX).
#include "common.h"
#include "../../llmc/swiglu.cuh"

__global__ void swiglu_forward_scalar_kernel(floatX* out, const floatX* inp, int N, int H) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)N * H) return;
    const size_t row = i / H, c = i % H;
    const float x = (float)inp[row * 2 * H + c];
    out[i] = (floatX)(x * swiglu_sigmoid(x) * (float)inp[row * 2 * H + H + c]);
}

__global__ void swiglu_backward_scalar_kernel(floatX* dinp, const floatX* dout, const floatX* inp, int N, int H) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)N * H) return;
    const size_t row = i / H, c = i % H;
    const float x = (float)inp[row * 2 * H + c], u = (float)inp[row * 2 * H + H + c], d = (float)dout[i];
    const float s = swiglu_sigmoid(x);
    dinp[row * 2 * H + c] = (floatX)(d * u * s * (1.0f + x * (1.0f - s)));
    dinp[row * 2 * H + H + c] = (floatX)(d * x * s);
}

static void run_forward(int variant, floatX* out, const floatX* inp, int N, int H, int block_size) {
    if (variant == 1) {
        swiglu_forward_scalar_kernel<<<(unsigned int)CEIL_DIV((size_t)N * H, (size_t)block_size), block_size>>>(out, inp,
                                                                                                               N, H);
        cudaCheck(cudaGetLastError());
    } else if (block_size == 256) {
        swiglu_forward(out, inp, N, H, 0);
    } else {
        swiglu_forward_launch(out, inp, N, H, block_size, 0);
    }
}

static void run_backward(int variant, floatX* dinp, const floatX* dout, const floatX* inp, int N, int H,
                         int block_size) {
    if (variant == 1) {
        swiglu_backward_scalar_kernel<<<(unsigned int)CEIL_DIV((size_t)N * H, (size_t)block_size), block_size>>>(
            dinp, dout, inp, N, H);
        cudaCheck(cudaGetLastError());
    } else if (block_size == 256) {
        swiglu_backward(dinp, dout, inp, N, H, 0);
    } else {
        swiglu_backward_launch(dinp, dout, inp, N, H, block_size, 0);
    }
}

static double silu_double(double x) { return x / (1.0 + exp(-x)); }
// d silu / dx = s (1 + x (1 - s)), s = sigmoid(x)
static double silu_derivative_double(double x) {
    const double s = 1.0 / (1.0 + exp(-x));
    return s * (1.0 + x * (1.0 - s));
}

// silu_derivative_double against central differences of silu_double over [-12, 12]; exits non-zero when not
// within 1e-8 absolute (the differences' truncation error ~h^2 = 1e-10 at most, their rounding ~1e-16 / h)
static void check_reference_derivative(void) {
    double worst = 0.0;
    for (int i = 0; i <= 2400; i++) {
        const double x = -12.0 + 0.01 * i + 0.001;  // misses 0 and the grid's round numbers
        const double h = 1e-5;
        const double numeric = (silu_double(x + h) - silu_double(x - h)) / (2.0 * h);
        worst = fmax(worst, fabs(numeric - silu_derivative_double(x)));
    }
    if (!(worst <= 1e-8)) {
        printf("FAIL reference derivative: worst difference %.3g against central differences\n", worst);
        exit(EXIT_FAILURE);
    }
    printf("  %-28s ok (worst difference %.3g over [-12, 12])\n", "silu' vs differences", worst);
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    int N = 8 * 1024, H = 2048;
    if (args.small) { N = 3 * 37; H = 296; }  // H = 37 vectors of 8, not a power of 2
    const size_t nh = (size_t)N * H;

    printf("swiglu reference\n");
    check_reference_derivative();

    // gate over [-10, 10]: both saturated ends of the sigmoid (silu -> 0 and silu -> x) and the curved middle,
    // including the zero of silu' near -1.28; up and dout over [-2, 2]
    std::vector<float> inp(2 * nh);
    for (int row = 0; row < N; row++) {
        for (int c = 0; c < H; c++) {
            inp[(size_t)row * 2 * H + c] = lab_rand_uniform(-10.0f, 10.0f);
            inp[(size_t)row * 2 * H + H + c] = lab_rand_uniform(-2.0f, 2.0f);
        }
    }
    inp = lab_rounded(inp);
    std::vector<float> dout = lab_random_rounded(nh, -2.0f, 2.0f);
    std::vector<float> forward_reference(nh), backward_reference(2 * nh);
    for (int row = 0; row < N; row++) {
        for (int c = 0; c < H; c++) {
            const size_t i = (size_t)row * H + c, g = (size_t)row * 2 * H + c;
            const double gate = inp[g], up = inp[g + H], d = dout[i];
            forward_reference[i] = (float)(silu_double(gate) * up);
            backward_reference[g] = (float)(d * up * silu_derivative_double(gate));
            backward_reference[g + H] = (float)(d * silu_double(gate));
        }
    }

    floatX* d_inp = lab_to_device<floatX>(inp);
    floatX* d_dout = lab_to_device<floatX>(dout);
    floatX* d_out = lab_poisoned<floatX>(nh);
    floatX* d_dinp = lab_poisoned<floatX>(2 * nh);
    floatX* d_in_place = lab_poisoned<floatX>(2 * nh);

    // fp32: one exponential (__expf: ex2.approx after an fp32 product, a few ulp at |x| <= 10) and a few fp32
    // operations, no cancellation except in dgate's 1 + x (1 - s) near its zero at x ~ -1.28, where the absolute
    // error of the factor is ~|x| s ulp(1) ~ 1e-7 times |dout * up * s| <= 4: rtol 1e-5, atol 1e-6. bf16: the same
    // fp32 arithmetic on the same inputs, then one rounding of the result (<= 2^-8 relative): rtol 5e-3.
    const float rtol = PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 5e-3f;
    const float atol = 1e-6f;
    const int repeats = args.small ? 3 : 100;
    const int block_sizes[] = {128, 256, 512, 1024};

    printf("swiglu (%s): N=%d H=%d\n", PRECISION_NAME, N, H);
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        cudaCheck(cudaMemset(d_out, 0xff, nh * sizeof(floatX)));
        cudaCheck(cudaMemset(d_dinp, 0xff, 2 * nh * sizeof(floatX)));
        run_forward(variant, d_out, d_inp, N, H, 256);
        run_backward(variant, d_dinp, d_dout, d_inp, N, H, 256);
        cudaCheck(cudaDeviceSynchronize());
        lab_validate("forward out", d_out, forward_reference.data(), nh, atol, rtol);
        lab_validate("backward dinp", d_dinp, backward_reference.data(), 2 * nh, atol, rtol);
    }
    if (args.variant == 0 || args.variant == 2) {
        cudaCheck(cudaMemcpy(d_in_place, d_inp, 2 * nh * sizeof(floatX), cudaMemcpyDeviceToDevice));
        run_backward(2, d_in_place, d_dout, d_in_place, N, H, 256);
        cudaCheck(cudaDeviceSynchronize());
        printf("variant 2, backward in place (dinp = inp)\n");
        lab_validate("backward dinp", d_in_place, backward_reference.data(), 2 * nh, atol, rtol);
    }

    const char* sizes = args.small ? "small sizes" : "N = 8*1024, H = 2048";
    for (int backward = 0; backward <= 1; backward++) {
        lab_print_header(backward ? "swiglu_backward" : "swiglu_forward", sizes);
        for (int variant = 1; variant <= 2; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            for (int block_size : block_sizes) {
                float ms = lab_time_ms(repeats, [&]() {
                    if (backward) run_backward(variant, d_dinp, d_dout, d_inp, N, H, block_size);
                    else run_forward(variant, d_out, d_inp, N, H, block_size);
                });
                lab_print_row(variant, block_size, ms, (backward ? 5.0 : 3.0) * nh * sizeof(floatX), 0.0);
            }
        }
    }
    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_dinp));
    cudaCheck(cudaFree(d_in_place));
    return 0;
}
