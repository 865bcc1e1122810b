// cpu/test/test_wmma.cu: the CPU backend's nvcuda::wmma (cpu/include/mma.h). Batched GEMMs D = s (A B + C) through
// wmma fragments, for every emulated shape (m16n16k16, m32n8k16, m8n32k16), both input types (__half, bf16), every
// layout of A, B, C and D, padded leading dimensions, several K tiles and two warps per block, against a
// double-precision host GEMM; on the CPU backend also bit for bit against a host loop in the documented summation
// order. A wrong-layout run must fail the comparison (the test can fail), and misuse (a partial warp, lanes at
// different places, a misaligned pointer or ldm) must abort with a clear report. `make test` builds it plain and
// with --check:
//   cpu/cucc -O2 -I dev/test cpu/test/test_wmma.cu -o build/test_wmma && build/test_wmma
//   cpu/cucc --check -O2 -I dev/test cpu/test/test_wmma.cu -o build/check/test_wmma && build/check/test_wmma
// On a GPU (nvcc -arch=sm_80 -I dev/test) the double-precision comparisons apply; the misuse cases are CPU-only.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <stdlib.h>
#include <vector>
#include "test_common.h"

using namespace nvcuda;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d: %s\n", __FILE__, __LINE__, \
    cudaGetErrorString(e_)); exit(1); } } while (0)

template <typename L> struct is_row_major { enum { value = 0 }; };
template <> struct is_row_major<wmma::row_major> { enum { value = 1 }; };

// Each warp computes one batch entry: D = scale * (A B + C), A (M, KT*K), B (KT*K, N), C and D (M, N), every matrix
// in its own layout with its own leading dimension. C == nullptr: the accumulator starts as fill_fragment(c_fill).
template <int M, int N, int K, typename T, typename LA, typename LB>
__global__ void batched_wmma_kernel(const T* A, const T* B, const float* C, float* D, int k_tiles, unsigned lda,
                                    unsigned ldb, unsigned ldc, unsigned ldd, size_t stride_a, size_t stride_b,
                                    size_t stride_c, size_t stride_d, int c_row_major, int d_row_major, float c_fill,
                                    float scale) {
    size_t batch = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    A += batch * stride_a;
    B += batch * stride_b;
    D += batch * stride_d;
    wmma::fragment<wmma::accumulator, M, N, K, float> acc;
    if (C) {
        wmma::load_matrix_sync(acc, C + batch * stride_c, ldc, c_row_major ? wmma::mem_row_major : wmma::mem_col_major);
    } else {
        wmma::fill_fragment(acc, c_fill);
    }
    for (int kt = 0; kt < k_tiles; kt++) {
        wmma::fragment<wmma::matrix_a, M, N, K, T, LA> a;
        wmma::fragment<wmma::matrix_b, M, N, K, T, LB> b;
        // the tile's first element: column kt*K of A, row kt*K of B
        wmma::load_matrix_sync(a, A + (is_row_major<LA>::value ? (size_t)kt * K : (size_t)kt * K * lda), lda);
        wmma::load_matrix_sync(b, B + (is_row_major<LB>::value ? (size_t)kt * K * ldb : (size_t)kt * K), ldb);
        wmma::mma_sync(acc, a, b, acc);
    }
    for (int i = 0; i < acc.num_elements; i++) acc.x[i] *= scale;  // element-wise, the same for every element
    wmma::store_matrix_sync(D, acc, ldd, d_row_major ? wmma::mem_row_major : wmma::mem_col_major);
}

static size_t offset_of(int r, int c, unsigned ld, int row_major) {
    return row_major ? (size_t)r * ld + c : (size_t)c * ld + r;
}
// elements a (rows, cols) matrix spans with leading dimension ld, rounded up to 16 so that the next batch entry
// starts 32-byte aligned
static size_t span_of(int rows, int cols, unsigned ld, int row_major) {
    size_t n = (size_t)(row_major ? rows : cols) * ld;
    return (n + 15) / 16 * 16;
}

static float to_float(__half v) { return __half2float(v); }
static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> static T from_float(float v);
template <> __half from_float<__half>(float v) { return __float2half(v); }
template <> __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

// One configuration. `b_layout_lie`: the data of B is stored in the other layout than the fragment reads (a wrong
// program), and the comparison must then fail.
template <int M, int N, int K, typename T, typename LA, typename LB>
static void run_case(const char* type_name, int c_layout, int d_layout, int use_c, int b_layout_lie) {
    const int k_tiles = 3, KT = k_tiles * K, batches = 4, warps_per_block = 2;
    const int a_rm = is_row_major<LA>::value, b_rm = is_row_major<LB>::value ^ b_layout_lie;
    // leading dimensions one 16-byte step beyond the minimum: exercises ldm != the matrix width
    // (the wrong-layout run gets a square B, so that reading it the other way stays inside it)
    const int b_side = KT > N ? KT : N;
    const unsigned lda = (a_rm ? KT : M) + 8, ldb = (b_layout_lie ? b_side : b_rm ? N : KT) + 8;
    const unsigned ldc = (c_layout ? N : M) + 4, ldd = (d_layout ? N : M) + 12;
    const size_t sa = span_of(M, KT, lda, a_rm);
    const size_t sb = b_layout_lie ? span_of(b_side, b_side, ldb, 1) : span_of(KT, N, ldb, b_rm);
    const size_t sc = span_of(M, N, ldc, c_layout), sd = span_of(M, N, ldd, d_layout);
    std::vector<T> a(sa * batches), b(sb * batches);
    std::vector<float> c(sc * batches), d(sd * batches);
    // padding holds values too: a kernel that reads it gets a wrong result
    for (auto& v : a) v = from_float<T>(test_rand_uniform(-1.0f, 1.0f));
    for (auto& v : b) v = from_float<T>(test_rand_uniform(-1.0f, 1.0f));
    fill_uniform(c.data(), c.size(), -1.0f, 1.0f);
    const float scale = 0.5f, c_fill = 0.375f;  // both exact: scaling adds no rounding

    T *d_a, *d_b;
    float *d_c, *d_d;
    CK(cudaMalloc(&d_a, a.size() * sizeof(T)));
    CK(cudaMalloc(&d_b, b.size() * sizeof(T)));
    CK(cudaMalloc(&d_c, c.size() * sizeof(float)));
    CK(cudaMalloc(&d_d, d.size() * sizeof(float)));
    CK(cudaMemcpy(d_a, a.data(), a.size() * sizeof(T), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_b, b.data(), b.size() * sizeof(T), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_c, c.data(), c.size() * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemset(d_d, 0xff, d.size() * sizeof(float)));  // NaN: an element nobody stores fails
    batched_wmma_kernel<M, N, K, T, LA, LB><<<batches / warps_per_block, 32 * warps_per_block>>>(
        d_a, d_b, use_c ? d_c : nullptr, d_d, k_tiles, lda, ldb, ldc, ldd, sa, sb, sc, sd, c_layout, d_layout, c_fill,
        scale);
    CK(cudaGetLastError());
    CK(cudaMemcpy(d.data(), d_d, d.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CK(cudaFree(d_a));
    CK(cudaFree(d_b));
    CK(cudaFree(d_c));
    CK(cudaFree(d_d));

    // The reference in double from the rounded inputs. The emulation (and a GPU, with its own order) adds KT products
    // to c in fp32: each of the KT additions rounds by at most 2^-24 relative to a partial sum bounded by
    // |c| + sum |a b|, so |error| <= KT 2^-24 (|c| + sum |a b|), times the exact scale. (Products are exact in fp32.)
    std::vector<float> got(batches * M * N);
    std::vector<double> want(batches * M * N), bound(batches * M * N);
    size_t bits_differ = 0;
    for (int q = 0; q < batches; q++)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                float c0 = use_c ? c[q * sc + offset_of(m, n, ldc, c_layout)] : c_fill;
                double sum = c0, mag = fabs(c0);
                float ordered = c0;  // the emulation's documented order: c, then k = 0, 1, .., KT-1, in fp32
                for (int k = 0; k < KT; k++) {
                    // the data's true layout, which is the fragment's unless b_layout_lie
                    float x = to_float(a[q * sa + offset_of(m, k, lda, a_rm)]);
                    float y = to_float(b[q * sb + offset_of(k, n, ldb, b_rm)]);
                    sum += (double)x * y;
                    mag += fabs((double)x * y);
                    ordered += x * y;
                }
                size_t i = ((size_t)q * M + m) * N + n;
                got[i] = d[q * sd + offset_of(m, n, ldd, d_layout)];
                want[i] = scale * sum;
                bound[i] = scale * KT * ldexp(mag, -24);
                float ordered_scaled = ordered * scale;
                if (memcmp(&got[i], &ordered_scaled, sizeof(float)) != 0) bits_differ++;
            }
    size_t bad = 0;
    double worst = 0.0;
    for (size_t i = 0; i < got.size(); i++) {
        double err = fabs((double)got[i] - want[i]);
        if (!(err <= bound[i])) bad++;
        if (err / bound[i] > worst) worst = err / bound[i];
    }
    char what[160];
    snprintf(what, sizeof what, "m%dn%dk%d %s A %s B %s C %s D %s", M, N, K, type_name, a_rm ? "row" : "col",
             is_row_major<LB>::value ? "row" : "col", use_c ? (c_layout ? "row" : "col") : "fill",
             d_layout ? "row" : "col");
    if (b_layout_lie) {
        // the negative control: B's data in the other layout must give a result outside the bound
        check(bad > 0, "%s, B stored %s-major: the wrong layout must fail the comparison (%zu of %zu outside)", what,
              b_rm ? "row" : "col", bad, got.size());
        return;
    }
    check(bad == 0, "%s: %zu of %zu elements outside the fp32 summation bound (worst err/bound %.3g)", what, bad,
          got.size(), worst);
#ifdef __CUCC__
    check(bits_differ == 0, "%s: %zu of %zu elements differ from the documented fp32 order bit for bit", what,
          bits_differ, got.size());
#endif
}

template <int M, int N, int K, typename T>
static void run_shape(const char* type_name) {
    for (int cl = 0; cl < 2; cl++)
        for (int dl = 0; dl < 2; dl++) {
            run_case<M, N, K, T, wmma::row_major, wmma::row_major>(type_name, cl, dl, 1, 0);
            run_case<M, N, K, T, wmma::row_major, wmma::col_major>(type_name, cl, dl, 1, 0);
            run_case<M, N, K, T, wmma::col_major, wmma::row_major>(type_name, cl, dl, 1, 0);
            run_case<M, N, K, T, wmma::col_major, wmma::col_major>(type_name, cl, dl, 1, 0);
        }
    run_case<M, N, K, T, wmma::row_major, wmma::col_major>(type_name, 1, 0, 0, 0);  // fill_fragment
    run_case<M, N, K, T, wmma::row_major, wmma::col_major>(type_name, 1, 1, 1, 1);  // must fail
    run_case<M, N, K, T, wmma::col_major, wmma::row_major>(type_name, 0, 1, 1, 1);  // must fail
}

// ---- misuse: each aborts with a report (CPU backend only; on a GPU these hang or are undefined) ----------------
// lanes 16-31 return before a warp-collective load
__global__ void partial_warp_kernel(const __half* a) {
    if (threadIdx.x >= 16) return;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> f;
    wmma::load_matrix_sync(f, a, 16);
}
// a block of 16 threads: the warp has only 16 lanes
__global__ void small_block_kernel(const __half* a) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> f;
    wmma::load_matrix_sync(f, a, 16);
}
// the two halves of the warp load at different places
__global__ void divergent_kernel(const __half* a) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> f;
    if (threadIdx.x < 16) {
        wmma::load_matrix_sync(f, a, 16);
    } else {
        wmma::load_matrix_sync(f, a, 16);
    }
}
__global__ void misaligned_kernel(const __half* a) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> f;
    wmma::load_matrix_sync(f, a + 8, 16);  // 16 bytes past a 256-byte aligned allocation
}
__global__ void bad_ldm_kernel(const __half* a) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> f;
    wmma::load_matrix_sync(f, a, 20);  // 40 bytes: not a multiple of 16
}

static int run_misuse(const char* name) {
    __half* a;
    CK(cudaMalloc(&a, 1024 * sizeof(__half)));
    CK(cudaMemset(a, 0, 1024 * sizeof(__half)));
    if (!strcmp(name, "partial_warp")) partial_warp_kernel<<<1, 32>>>(a);
    else if (!strcmp(name, "small_block")) small_block_kernel<<<1, 16>>>(a);
    else if (!strcmp(name, "divergent")) divergent_kernel<<<1, 32>>>(a);
    else if (!strcmp(name, "misaligned")) misaligned_kernel<<<1, 32>>>(a);
    else if (!strcmp(name, "bad_ldm")) bad_ldm_kernel<<<1, 32>>>(a);
    else {
        fprintf(stderr, "test_wmma: unknown case %s\n", name);
        return 2;
    }
    CK(cudaDeviceSynchronize());
    return 0;  // reaching here is the failure the parent reports
}

int main(int argc, char** argv) {
    if (argc > 1) return run_misuse(argv[1]);
    test_seed(20240611);
    run_shape<16, 16, 16, __half>("half");
    run_shape<16, 16, 16, __nv_bfloat16>("bf16");
    run_shape<32, 8, 16, __half>("half");
    run_shape<32, 8, 16, __nv_bfloat16>("bf16");
    run_shape<8, 32, 16, __half>("half");
    run_shape<8, 32, 16, __nv_bfloat16>("bf16");
#ifdef __CUCC__
    const char* partial[] = {"wmma::load_matrix_sync", "needs all 32 lanes", "have exited", NULL};
    const char* small[] = {"needs all 32 lanes", "are not threads of the block", NULL};
    const char* divergent[] = {"must reach a wmma operation together, at the same place", NULL};
    const char* misaligned[] = {"must be 256-bit (32-byte) aligned", NULL};
    const char* bad_ldm[] = {"ldm must be a multiple of 16 bytes", NULL};
    expect_child_failure(argv[0], "partial_warp", partial);
    expect_child_failure(argv[0], "small_block", small);
    expect_child_failure(argv[0], "divergent", divergent);
    expect_child_failure(argv[0], "misaligned", misaligned);
    expect_child_failure(argv[0], "bad_ldm", bad_ldm);
#endif
    return test_summary("test_wmma");
}
