// cpu/include/mma.h: the CPU backend's nvcuda::wmma (CUDA's warp matrix multiply-accumulate API), found before the
// toolkit's (device-only) header because cpu/cucc puts cpu/include first on the include path. doc/backend.md,
// "Tensor cores (wmma)", says what it models; cpu/test/test_wmma.cu tests it.
// Covered: the shapes m16n16k16, m32n8k16 and m8n32k16 with __half or __nv_bfloat16 inputs and a float
// accumulator; fragment (num_elements per lane as CUDA's mma.h declares them), fill_fragment, load_matrix_sync,
// mma_sync, store_matrix_sync, row_major/col_major, mem_row_major/mem_col_major. Not covered (a compile error):
// half accumulators, tf32, integer and sub-byte types, the Hopper-only shapes.
//
// The model, as on a GPU:
//  - load_matrix_sync, mma_sync and store_matrix_sync are warp-collective: all 32 lanes of the warp must reach
//    the same call (cpu/runtime.cpp's __cucc_warp_matrix_op reports a lane that has exited, a partial warp, or
//    lanes at different places). They order no memory accesses between lanes: a lane reading what
//    store_matrix_sync stored, or load_matrix_sync reading what other lanes wrote, needs __syncwarp() between,
//    and the checking mode reports the race otherwise.
//  - which lane holds which matrix element is unspecified by CUDA; here element i of lane l holds flat element
//    (32 i + l) mod (rows * cols) of the matrix in row-major order (a fragment with more slots than elements
//    / 32, like __half's matrix_a, holds each element more than once). It is unlike any GPU's mapping on
//    purpose: code that assumes a mapping gets wrong results instead of passing by luck.
//  - each lane loads and stores its own elements itself, so the checking mode sees every access (bounds,
//    uninitialised reads, races) with the lane that makes it; in the checking mode every lane of a load also reads
//    the whole matrix, since a GPU's lane may read any element. The pointer must be 256-bit aligned and ldm a
//    multiple of 16 bytes, as CUDA requires (a memcheck finding, or an abort, otherwise).
//  - mma_sync computes D = A B + C with every product exact in fp32 (11- or 8-bit significands: exact unless it
//    leaves fp32's exponent range) and the sums in fp32, rounded to nearest even after each addition, in a fixed
//    order: d[m][n] = (((c[m][n] + a[m][0] b[0][n]) + a[m][1] b[1][n]) + ...) + a[m][K-1] b[K-1][n]. A GPU's
//    order and internal precision are unspecified; code must tolerate K fp32 roundings per mma.
#pragma once
#include "cucc.h"

namespace nvcuda {
namespace wmma {

struct row_major;
struct col_major;
struct matrix_a;
struct matrix_b;
struct accumulator;
enum layout_t { mem_row_major, mem_col_major };

// the matrix a fragment holds: A is M x K, B is K x N, the accumulator M x N
template <typename Use, int M, int N, int K> struct __cucc_dims;
template <int M, int N, int K> struct __cucc_dims<matrix_a, M, N, K> { enum { rows = M, cols = K }; };
template <int M, int N, int K> struct __cucc_dims<matrix_b, M, N, K> { enum { rows = K, cols = N }; };
template <int M, int N, int K> struct __cucc_dims<accumulator, M, N, K> { enum { rows = M, cols = N }; };

template <int M, int N, int K>
struct __cucc_shape_supported {
    enum { value = (M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) || (M == 8 && N == 32 && K == 16) };
};

// elements per lane, as CUDA's mma.h declares them: __half inputs hold 16 in every shape, the rest one per lane
// and matrix element
template <typename Use, int M, int N, int K, typename T>
struct __cucc_frag_size {
    enum { value = std::is_same<T, __half>::value && !std::is_same<Use, accumulator>::value
                       ? 16 : __cucc_dims<Use, M, N, K>::rows * __cucc_dims<Use, M, N, K>::cols / 32 };
};

template <typename T, int size>
struct __align__(8) __frag_base {
    enum { num_elements = size };
    enum { num_storage_elements = size };
    typedef T element_type;
    typedef T storage_element_type;
    T x[size];
};

template <typename Use, int m, int n, int k, typename T, typename Layout = void>
class fragment : public __frag_base<T, __cucc_frag_size<Use, m, n, k, T>::value> {
    static_assert(__cucc_shape_supported<m, n, k>::value,
                  "wmma on the CPU backend: only the shapes m16n16k16, m32n8k16 and m8n32k16 are emulated");
    static_assert(std::is_same<Use, accumulator>::value ? std::is_same<T, float>::value
                      : (std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value),
                  "wmma on the CPU backend: only __half or __nv_bfloat16 inputs with a float accumulator are emulated");
    static_assert(std::is_same<Use, accumulator>::value ? std::is_void<Layout>::value
                      : (std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value),
                  "wmma: matrix_a and matrix_b fragments need row_major or col_major, accumulators no layout");
};

template <typename T> struct __cucc_same { typedef T type; };

template <typename T, int size>
inline void fill_fragment(__frag_base<T, size>& f, const typename __cucc_same<T>::type& v) {
    for (int i = 0; i < size; i++) f.x[i] = v;
}

inline float __cucc_wmma_float(__half v) { return __half2float(v); }
inline float __cucc_wmma_float(__nv_bfloat16 v) { return __bfloat162float(v); }
inline float __cucc_wmma_float(float v) { return v; }

// CUDA: "mptr must be a 256-bit aligned pointer", "ldm must be a multiple of 8 for __half element type or
// multiple of 4 for float element type" (16 bytes)
inline void __cucc_wmma_check_pointer(const void* p, unsigned ldm, size_t elem_bytes, const char* what,
                                      const char* file, int line) {
    char msg[200];
    if ((uintptr_t)p % 32 != 0) {
        snprintf(msg, sizeof msg, "%s of %p: the pointer must be 256-bit (32-byte) aligned", what, p);
        __cucc_kernel_fault("memcheck", msg, file, line);
    }
    if (ldm * elem_bytes % 16 != 0) {
        snprintf(msg, sizeof msg, "%s with ldm %u: ldm must be a multiple of 16 bytes (%zu elements)", what, ldm,
                 16 / elem_bytes);
        __cucc_kernel_fault("memcheck", msg, file, line);
    }
}

// the offset in memory of element (r, c) of a matrix stored row- or column-major with leading dimension ldm
inline size_t __cucc_wmma_offset(int r, int c, unsigned ldm, bool row_major_memory) {
    return row_major_memory ? (size_t)r * ldm + c : (size_t)c * ldm + r;
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void __cucc_wmma_load(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm, bool row_major_memory) {
    typedef __cucc_dims<Use, M, N, K> dims;
    int lane = (int)__cucc_lane_id();
#ifdef CUCC_CHECK
    // which lane reads which element is unspecified, so in the checking mode lanes 0 and 1 read every element: a
    // race with an earlier write of any thread but the reader (another warp's, or any lane's: it is not both of these
    // two), or an unwritten element, is seen whatever mapping a GPU has. (The other lanes add nothing for a write
    // that a rendezvous orders before the whole warp's load or before none of it; they read their own elements.)
    if (lane < 2) {
        for (int e = 0; e < dims::rows * dims::cols; e++) {
            T v = p[__cucc_wmma_offset(e / dims::cols, e % dims::cols, ldm, row_major_memory)];
            asm volatile("" : : "m"(v));  // keeps the read
        }
    }
#endif
    for (int i = 0; i < f.num_elements; i++) {
        int e = (32 * i + lane) % (dims::rows * dims::cols);
        f.x[i] = p[__cucc_wmma_offset(e / dims::cols, e % dims::cols, ldm, row_major_memory)];
    }
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline typename std::enable_if<!std::is_same<Use, accumulator>::value>::type
load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm, const char* file = __builtin_FILE(),
                 int line = __builtin_LINE()) {
    __cucc_wmma_check_pointer(p, ldm, sizeof(T), "wmma::load_matrix_sync", file, line);
    __cucc_warp_matrix_op(nullptr, nullptr, "wmma::load_matrix_sync", file, line);
    __cucc_wmma_load(f, p, ldm, std::is_same<Layout, row_major>::value);
}

template <int M, int N, int K>
inline void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* p, unsigned ldm, layout_t layout,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    __cucc_wmma_check_pointer(p, ldm, sizeof(float), "wmma::load_matrix_sync", file, line);
    __cucc_warp_matrix_op(nullptr, nullptr, "wmma::load_matrix_sync", file, line);
    __cucc_wmma_load(f, p, ldm, layout == mem_row_major);
}

template <int M, int N, int K>
inline void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm, layout_t layout,
                              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    __cucc_wmma_check_pointer(p, ldm, sizeof(float), "wmma::store_matrix_sync", file, line);
    __cucc_warp_matrix_op(nullptr, nullptr, "wmma::store_matrix_sync", file, line);
    int lane = (int)__cucc_lane_id();
    for (int i = 0; i < f.num_elements; i++) {
        int e = 32 * i + lane;  // an accumulator holds each element once
        p[__cucc_wmma_offset(e / N, e % N, ldm, layout == mem_row_major)] = f.x[i];
    }
}

// one lane's operands of mma_sync, which the last lane to arrive reads for all 32
template <int M, int N, int K, typename T, typename LA, typename LB>
struct __cucc_mma_operands {
    fragment<accumulator, M, N, K, float>* d;
    const fragment<matrix_a, M, N, K, T, LA>* a;
    const fragment<matrix_b, M, N, K, T, LB>* b;
    const fragment<accumulator, M, N, K, float>* c;
};

// gathers the matrix (rows x cols, row-major) that the 32 lanes' fragments hold; a replicated element is read
// from its first slot
template <typename Frag>
inline void __cucc_wmma_gather(float* out, int elements, const Frag* const* lanes) {
    for (int l = 0; l < 32; l++)
        for (int i = 0; i < Frag::num_elements && 32 * i + l < elements; i++) out[32 * i + l] = __cucc_wmma_float(lanes[l]->x[i]);
}

template <int M, int N, int K, typename T, typename LA, typename LB>
void __cucc_mma_complete(void* const* lane_args) {
    typedef __cucc_mma_operands<M, N, K, T, LA, LB> operands;
    const fragment<matrix_a, M, N, K, T, LA>* a[32];
    const fragment<matrix_b, M, N, K, T, LB>* b[32];
    const fragment<accumulator, M, N, K, float>* c[32];
    for (int l = 0; l < 32; l++) {
        const operands* o = (const operands*)lane_args[l];
        a[l] = o->a;
        b[l] = o->b;
        c[l] = o->c;
    }
    float A[M * K], B[K * N], D[M * N];  // row-major
    __cucc_wmma_gather(A, M * K, a);
    __cucc_wmma_gather(B, K * N, b);
    __cucc_wmma_gather(D, M * N, c);
    // Two rows of D in registers, k outside n: each D[m][n] still adds its products in k order, so the bits are
    // those of a dot product per element; the loop over n vectorises and each B row loaded serves both rows
    // (16x16x16 on the host: 0.55 us, against 1.7-2.5 us as one dot product per element).
    static_assert(M % 2 == 0, "wmma shapes have an even M");
    for (int m = 0; m < M; m += 2) {
        float row0[N], row1[N];
        for (int n = 0; n < N; n++) {
            row0[n] = D[m * N + n];
            row1[n] = D[(m + 1) * N + n];
        }
        for (int k = 0; k < K; k++) {
            const float a0 = A[m * K + k], a1 = A[(m + 1) * K + k];
            for (int n = 0; n < N; n++) {
                row0[n] += a0 * B[k * N + n];
                row1[n] += a1 * B[k * N + n];
            }
        }
        for (int n = 0; n < N; n++) {
            D[m * N + n] = row0[n];
            D[(m + 1) * N + n] = row1[n];
        }
    }
    // written only now: d may be c
    for (int l = 0; l < 32; l++) {
        fragment<accumulator, M, N, K, float>* d = ((const operands*)lane_args[l])->d;
        for (int i = 0; i < d->num_elements; i++) d->x[i] = D[32 * i + l];
    }
}

template <int M, int N, int K, typename T, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
                     const fragment<matrix_b, M, N, K, T, LB>& b, const fragment<accumulator, M, N, K, float>& c,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    __cucc_mma_operands<M, N, K, T, LA, LB> mine{&d, &a, &b, &c};
    __cucc_warp_matrix_op(&mine, &__cucc_mma_complete<M, N, K, T, LA, LB>, "wmma::mma_sync", file, line);
}

}  // namespace wmma
}  // namespace nvcuda
