// cpu/bench.cu: the CPU backend's benchmark (a benchmark, not a test: it prints numbers, asserts none).
//   make bench       builds it with cpu/cucc (and a --ucontext build to compare the fiber switches) and runs it
// It is an ordinary CUDA program, so `nvcc -arch=sm_80 cpu/bench.cu -lcublas -lcublasLt` measures a GPU
// with the same table. Rows:
//   rendezvous     per-thread cost of a warp rendezvous (__syncwarp in a 1x32 block): one fiber switch
//                  plus the bookkeeping; the target is <= 30 ns on 2 cores
//   launch         an empty kernel on 1x32 and 1x1024 threads (every thread is a fiber started and ended)
//   layernorm      256 x 768, warp per row (dev/test/sample_kernels.cuh), against a plain host loop
//   softmax        256 rows of 1024, block per row with shared memory, against a plain host loop
//   GEMM           1024^3 through cublasSgemm (fp32) and cublasLtMatmul (bf16 in/out, fp32 accumulate)
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <vector>
#include "../dev/test/sample_kernels.cuh"

#ifdef __CUCC__
const char* __cucc_context_switch_kind(void);
#endif

static void cuda_check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
        fprintf(stderr, "bench: %s: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
}

static double host_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

__global__ void warp_rendezvous(int iterations, int* sink) {
    int v = threadIdx.x;
    for (int i = 0; i < iterations; i++) __syncwarp();
    if (v == 1000000) *sink = v;  // never true: keeps the loop from being removed
}

__global__ void empty_kernel(void) {}

// Times `reps` calls of `work` between two events; returns ms per call (best of 3 rounds).
template <typename F>
static float time_ms(int reps, F work) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    work();  // warm-up
    cudaDeviceSynchronize();
    float best = 1e30f;
    for (int round = 0; round < 3; round++) {
        cudaEventRecord(a);
        for (int r = 0; r < reps; r++) work();
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        best = fminf(best, ms / reps);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return best;
}

static void layernorm_host(float* out, const float* x, const float* w, const float* b, int N, int C) {
    for (int r = 0; r < N; r++) {
        const float* xr = x + (size_t)r * C;
        float m = 0.0f, v = 0.0f;
        for (int i = 0; i < C; i++) m += xr[i];
        m /= C;
        for (int i = 0; i < C; i++) v += (xr[i] - m) * (xr[i] - m);
        float rs = 1.0f / sqrtf(v / C + 1e-5f);
        for (int i = 0; i < C; i++) out[(size_t)r * C + i] = (xr[i] - m) * rs * w[i] + b[i];
    }
}

static void softmax_host(float* out, const float* x, int R, int C) {
    for (int r = 0; r < R; r++) {
        const float* xr = x + (size_t)r * C;
        float mx = -INFINITY, s = 0.0f;
        for (int i = 0; i < C; i++) mx = fmaxf(mx, xr[i]);
        for (int i = 0; i < C; i++) s += (out[(size_t)r * C + i] = expf(xr[i] - mx));
        for (int i = 0; i < C; i++) out[(size_t)r * C + i] /= s;
    }
}

static float* device_random(size_t n, float lo, float hi) {
    std::vector<float> h(n);
    for (auto& x : h) x = lo + (hi - lo) * (float)rand() / (float)RAND_MAX;
    float* d;
    cuda_check(cudaMalloc(&d, n * sizeof(float)), "cudaMalloc");
    cudaMemcpy(d, h.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    return d;
}

int main(void) {
    cudaDeviceProp prop;
    cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
#ifdef __CUCC__
    printf("fiber switch: %s\n", __cucc_context_switch_kind());
#endif
    printf("%-34s %12s %12s\n", "benchmark", "device", "host loop");

    int* sink;
    cudaMalloc(&sink, sizeof(int));
    const int iters = 20000;
    float ms = time_ms(1, [&] { warp_rendezvous<<<1, 32>>>(iters, sink); });
    printf("%-34s %9.1f ns %12s\n", "rendezvous per thread (1x32)", ms * 1e6 / (iters * 32.0), "");

    ms = time_ms(200, [&] { empty_kernel<<<1, 32>>>(); });
    printf("%-34s %9.2f us %12s\n", "launch, 1x32 empty kernel", ms * 1e3, "");
    ms = time_ms(200, [&] { empty_kernel<<<1, 1024>>>(); });
    printf("%-34s %9.2f us %12s\n", "launch, 1x1024 empty kernel", ms * 1e3, "");

    int N = 256, C = 768;
    float* x = device_random((size_t)N * C, -2, 2);
    float* w = device_random(C, 0.5f, 1.5f);
    float* b = device_random(C, -0.5f, 0.5f);
    float *out, *mean, *rstd;
    cudaMalloc(&out, (size_t)N * C * sizeof(float));
    cudaMalloc(&mean, N * sizeof(float));
    cudaMalloc(&rstd, N * sizeof(float));
    ms = time_ms(10, [&] { layernorm_forward<<<N / 8, 256>>>(out, mean, rstd, x, w, b, N, C); });
    cuda_check(cudaGetLastError(), "layernorm_forward");
    std::vector<float> hx((size_t)N * C), hw(C), hb(C), hout((size_t)N * C);
    cudaMemcpy(hx.data(), x, hx.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(hw.data(), w, C * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(hb.data(), b, C * 4, cudaMemcpyDeviceToHost);
    double t0 = host_ms();
    for (int r = 0; r < 10; r++) layernorm_host(hout.data(), hx.data(), hw.data(), hb.data(), N, C);
    double host = (host_ms() - t0) / 10;
    printf("%-34s %9.3f ms %9.3f ms\n", "layernorm 256x768 (warp/row)", ms, host);

    int R = 256, K = 1024;
    float* s = device_random((size_t)R * K, -8, 8);
    float* so;
    cudaMalloc(&so, (size_t)R * K * sizeof(float));
    ms = time_ms(10, [&] { softmax_forward<<<R, 256, 8 * sizeof(float)>>>(so, s, K); });
    cuda_check(cudaGetLastError(), "softmax_forward");
    std::vector<float> hs((size_t)R * K), hso((size_t)R * K);
    cudaMemcpy(hs.data(), s, hs.size() * 4, cudaMemcpyDeviceToHost);
    t0 = host_ms();
    for (int r = 0; r < 10; r++) softmax_host(hso.data(), hs.data(), R, K);
    host = (host_ms() - t0) / 10;
    printf("%-34s %9.3f ms %9.3f ms\n", "softmax 256x1024 (block/row, smem)", ms, host);

    int M = 1024;
    double flops = 2.0 * M * M * M;
    float* A = device_random((size_t)M * M, -1, 1);
    float* B = device_random((size_t)M * M, -1, 1);
    float* Cm;
    cudaMalloc(&Cm, (size_t)M * M * sizeof(float));
    cublasHandle_t handle;
    cublasCreate(&handle);
    float one = 1.0f, zero = 0.0f;
    ms = time_ms(5, [&] { cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, M, M, M, &one, A, M, B, M, &zero, Cm, M); });
    printf("%-34s %9.1f GF %12s\n", "GEMM 1024^3 fp32 (cublasSgemm)", flops / (ms * 1e-3) * 1e-9, "");

    std::vector<__nv_bfloat16> hbf((size_t)M * M);
    for (auto& v : hbf) v = __float2bfloat16((float)rand() / (float)RAND_MAX - 0.5f);
    __nv_bfloat16 *Ab, *Bb, *Db;
    cudaMalloc(&Ab, hbf.size() * 2);
    cudaMalloc(&Bb, hbf.size() * 2);
    cudaMalloc(&Db, hbf.size() * 2);
    cudaMemcpy(Ab, hbf.data(), hbf.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(Bb, hbf.data(), hbf.size() * 2, cudaMemcpyHostToDevice);
    cublasLtHandle_t lt;
    cublasLtCreate(&lt);
    cublasLtMatmulDesc_t desc;
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayout_t layout;
    cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, M, M, M);
    ms = time_ms(5, [&] {
        cublasLtMatmul(lt, desc, &one, Ab, layout, Bb, layout, &zero, Db, layout, Db, layout, nullptr, nullptr, 0, 0);
    });
    printf("%-34s %9.1f GF %12s\n", "GEMM 1024^3 bf16 (cublasLtMatmul)", flops / (ms * 1e-3) * 1e-9, "");
    cublasLtMatrixLayoutDestroy(layout);
    cublasLtMatmulDescDestroy(desc);
    cublasLtDestroy(lt);
    cublasDestroy(handle);
    return 0;
}
