// dev/cuda/matmul_forward.cu: kernel lab for the Linear forward out = gelu(inp @ weight^T + bias), with the
// pre-activation kept (the GPT-2 MLP's c_fc), and the plain Linear without GELU.
// Build and run (CPU backend; -DENABLE_FP32 for fp32):
//   make build/lab/matmul_forward_bf16   (build/lab/matmul_forward_fp32: the fp32 build)
//   build/lab/matmul_forward_bf16 [variant] [-s]
// GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/matmul_forward.cu -lcublas -lcublasLt
// Variants:
//   1  llmc/matmul.cuh matmul_forward, gelu_fusion = 1: cuBLASLt with the GELU_AUX_BIAS epilogue (THE TRAINER'S).
//      Its run also validates the plain Linear (BIAS epilogue, and no bias at all).
//   2  llmc/matmul.cuh matmul_forward, gelu_fusion = 0: cuBLASLt BIAS epilogue, then the GELU kernel.
//   3  a hand-written tiled GEMM (64 x 128 tile, 256 threads of 4 x 8 outputs) with bias and GELU in its
//      epilogue, for reference: what cuBLASLt is measured against.
// Sizes: B=8 T=1024 C=768 OC=3072 (GPT-2 124M c_fc); -s: B=3 T=37 C=96 OC=384.
// Floor: 2 * B*T * C * OC flops (compute-bound: ~5 TFLOP per TB moved at these sizes); bytes: inputs once,
// outputs (out and pre_gelu) once: (B*T*C + OC*C + OC + 2 * B*T*OC) * sizeof(floatX).
#include "common.h"
#include "../../llmc/matmul.cuh"
#include "matmul_reference.h"

#define TILE_ROWS 64   // rows of inp (B*T) per block
#define TILE_COLS 128  // output channels per block
#define TILE_K 32
#define TILE_THREADS 256

// out = gelu(pre_gelu), pre_gelu = inp @ weight^T + bias, one 64 x 128 tile per block. Both operand tiles
// are staged in shared memory k-major (fp32), so that the inner loop reads a thread's 4 rows and 8 columns
// as contiguous runs; each thread owns 4 rows x 8 consecutive channels, written as 16-byte stores.
__global__ void matmul_tiled_kernel(floatX* out, floatX* pre_gelu, const floatX* inp, const floatX* weight,
                                    const floatX* bias, int N, int C, int OC) {
    __shared__ float inp_tile[TILE_K][TILE_ROWS];
    __shared__ float weight_tile[TILE_K][TILE_COLS];
    const int tx = threadIdx.x % 16;  // 8 channels each
    const int ty = threadIdx.x / 16;  // 4 rows each
    const int row0 = blockIdx.y * TILE_ROWS;
    const int col0 = blockIdx.x * TILE_COLS;
    float acc[4][8];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < C; k0 += TILE_K) {
        const int chunks_per_row = TILE_K / x128::size;
        for (int c = threadIdx.x; c < TILE_ROWS * chunks_per_row; c += blockDim.x) {
            const int r = c / chunks_per_row, kk = (c % chunks_per_row) * x128::size;
            x128 packed = (row0 + r < N && k0 + kk < C) ? load128(inp + (size_t)(row0 + r) * C + k0 + kk) : x128::zeros();
            for (int e = 0; e < x128::size; e++) inp_tile[kk + e][r] = (float)packed[e];
        }
        for (int c = threadIdx.x; c < TILE_COLS * chunks_per_row; c += blockDim.x) {
            const int r = c / chunks_per_row, kk = (c % chunks_per_row) * x128::size;
            x128 packed = (col0 + r < OC && k0 + kk < C) ? load128(weight + (size_t)(col0 + r) * C + k0 + kk)
                                                         : x128::zeros();
            for (int e = 0; e < x128::size; e++) weight_tile[kk + e][r] = (float)packed[e];
        }
        __syncthreads();
        for (int kk = 0; kk < TILE_K; kk++) {
            float a[4], b[8];
            for (int i = 0; i < 4; i++) a[i] = inp_tile[kk][ty * 4 + i];
            for (int j = 0; j < 8; j++) b[j] = weight_tile[kk][tx * 8 + j];
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 8; j++) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }

    const int col = col0 + tx * 8;
    if (col >= OC) return;
    for (int i = 0; i < 4; i++) {
        const int row = row0 + ty * 4 + i;
        if (row >= N) break;
        for (int j0 = 0; j0 < 8; j0 += x128::size) {
            x128 packed_pre, packed_out;
            for (int j = 0; j < x128::size; j++) {
                const float x = acc[i][j0 + j] + (bias != nullptr ? (float)bias[col + j0 + j] : 0.0f);
                packed_pre[j] = (floatX)x;
                packed_out[j] = (floatX)gelu_value(x);
            }
            store128(pre_gelu + (size_t)row * OC + col + j0, packed_pre);
            store128(out + (size_t)row * OC + col + j0, packed_out);
        }
    }
}

static void matmul_tiled(floatX* out, floatX* pre_gelu, const floatX* inp, const floatX* weight, const floatX* bias,
                         int N, int C, int OC) {
    dim3 grid(CEIL_DIV(OC, TILE_COLS), CEIL_DIV(N, TILE_ROWS));
    matmul_tiled_kernel<<<grid, TILE_THREADS>>>(out, pre_gelu, inp, weight, bias, N, C, OC);
    cudaCheck(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------
// CPU reference: pre = inp @ weight^T (+ bias) in double, out = gelu(pre)
static void linear_reference(std::vector<float>& pre, std::vector<float>& out, const std::vector<float>& inp,
                             const std::vector<float>& weight, const float* bias, int N, int C, int OC) {
    matmul_reference(pre.data(), inp.data(), C, 1, weight.data(), 1, C, bias, 0, N, OC, C);
    for (size_t i = 0; i < pre.size(); i++) out[i] = (float)gelu_reference(pre[i]);
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    const int B = args.small ? 3 : 8, T = args.small ? 37 : 1024, C = args.small ? 96 : 768, OC = 4 * C;
    const int N = B * T;
    cublas_setup();

    // weights ~ 1/sqrt(C) so that pre-activations are O(1), where GELU is not just identity or zero
    const float weight_scale = 1.0f / sqrtf((float)C);
    std::vector<float> inp = lab_random_rounded((size_t)N * C, -1.0f, 1.0f);
    std::vector<float> weight = lab_random_rounded((size_t)OC * C, -weight_scale, weight_scale);
    std::vector<float> bias = lab_random_rounded(OC, -0.5f, 0.5f);
    std::vector<float> pre_ref((size_t)N * OC), out_ref((size_t)N * OC);
    std::vector<float> plain_ref((size_t)N * OC);
    linear_reference(pre_ref, out_ref, inp, weight, bias.data(), N, C, OC);

    floatX* d_inp = lab_to_device<floatX>(inp);
    floatX* d_weight = lab_to_device<floatX>(weight);
    floatX* d_bias = lab_to_device<floatX>(bias);
    floatX* d_out = lab_poisoned<floatX>((size_t)N * OC);
    floatX* d_pre = lab_poisoned<floatX>((size_t)N * OC);

    // Tolerances. fp32: fp32 accumulation over C <= 768 terms of size ~1/sqrt(C) errs by ~1e-6; 1e-5 covers it.
    // GELU outputs get 5e-4: on the GPU, --use_fast_math and cuBLASLt's epilogue use a hardware tanh whose
    // relative error is ~2^-11. bf16: inputs are exact in bf16, so the error is the rounding of the result
    // (half an ulp, 2^-9 relative) and, without fusion, GELU of the rounded pre-activation (slope <= 1.13, one
    // more half ulp): 1e-2 relative (2.5 ulps) with 1e-2 absolute for results near zero.
#if defined(ENABLE_FP32)
    const float tol_linear = 1e-5f, tol_gelu = 5e-4f;
#else
    const float tol_linear = 1e-2f, tol_gelu = 1e-2f;
#endif
    char sizes[128];
    snprintf(sizes, sizeof(sizes), "B=%d T=%d C=%d OC=%d %s", B, T, C, OC, PRECISION_NAME);
    printf("matmul_forward: %s\n", sizes);
    for (int variant = 1; variant <= 3; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        cudaCheck(cudaMemset(d_out, 0xff, (size_t)N * OC * sizeof(floatX)));
        cudaCheck(cudaMemset(d_pre, 0xff, (size_t)N * OC * sizeof(floatX)));
        if (variant == 1) matmul_forward(d_out, d_inp, d_weight, d_bias, B, T, C, OC, 0, d_pre, 1);
        if (variant == 2) matmul_forward(d_out, d_inp, d_weight, d_bias, B, T, C, OC, 0, d_pre, 0);
        if (variant == 3) matmul_tiled(d_out, d_pre, d_inp, d_weight, d_bias, N, C, OC);
        cudaCheck(cudaDeviceSynchronize());
        lab_validate("pre_gelu", d_pre, pre_ref.data(), (size_t)N * OC, tol_linear, tol_linear);
        lab_validate("out = gelu(pre_gelu)", d_out, out_ref.data(), (size_t)N * OC, tol_gelu, tol_gelu);
        if (variant == 1) {
            // the plain Linear: BIAS epilogue, then DEFAULT (no bias)
            cudaCheck(cudaMemset(d_out, 0xff, (size_t)N * OC * sizeof(floatX)));
            matmul_forward(d_out, d_inp, d_weight, d_bias, B, T, C, OC, 0);
            lab_validate("out (bias, no gelu)", d_out, pre_ref.data(), (size_t)N * OC, tol_linear, tol_linear);
            matmul_reference(plain_ref.data(), inp.data(), C, 1, weight.data(), 1, C, nullptr, 0, N, OC, C);
            cudaCheck(cudaMemset(d_out, 0xff, (size_t)N * OC * sizeof(floatX)));
            matmul_forward(d_out, d_inp, d_weight, nullptr, B, T, C, OC, 0);
            lab_validate("out (no bias, no gelu)", d_out, plain_ref.data(), (size_t)N * OC, tol_linear, tol_linear);
        }
    }

    lab_print_header("matmul_forward", sizes);
    const int repeats = args.small ? 3 : 20;
    const double flops = 2.0 * N * C * OC;
    for (int variant = 1; variant <= 3; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        float ms = lab_time_ms(repeats, [&]() {
            if (variant == 1) matmul_forward(d_out, d_inp, d_weight, d_bias, B, T, C, OC, 0, d_pre, 1);
            if (variant == 2) matmul_forward(d_out, d_inp, d_weight, d_bias, B, T, C, OC, 0, d_pre, 0);
            if (variant == 3) matmul_tiled(d_out, d_pre, d_inp, d_weight, d_bias, N, C, OC);
        });
        lab_print_row(variant, variant == 3 ? TILE_THREADS : 0, ms, 0.0, flops);
    }

    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_weight));
    cudaCheck(cudaFree(d_bias));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_pre));
    cublas_teardown();
    return 0;
}
