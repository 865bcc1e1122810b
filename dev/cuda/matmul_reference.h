// dev/cuda/matmul_reference.h: the double-precision CPU references the Linear-layer labs (matmul_forward.cu,
// matmul_backward_bias.cu) validate against: one strided GEMM serves the forward and both backward products,
// which are the same stored matrices read with different transposes.
#pragma once
#include <math.h>
#include <vector>

// out (M, N) = init + a @ b in double, rounded to float at the end. a is read as (M, K) with element (m, k) at
// a[m * a_m + k * a_k], b as (K, N) with (k, n) at b[k * b_k + n * b_n]: transposes are only strides.
// init (m, n) is init[m * init_m + n] (init_m = 0 broadcasts a bias row), or nothing when init is nullptr;
// the sum starts from it, as the device's accumulating (+=) GEMMs do.
static void matmul_reference(float* out, const float* a, size_t a_m, size_t a_k, const float* b, size_t b_k,
                             size_t b_n, const float* init, size_t init_m, int M, int N, int K) {
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double sum = init != nullptr ? init[m * init_m + n] : 0.0;
            for (int k = 0; k < K; k++) sum += (double)a[m * a_m + k * a_k] * b[k * b_k + n * b_n];
            out[(size_t)m * N + n] = (float)sum;
        }
}
