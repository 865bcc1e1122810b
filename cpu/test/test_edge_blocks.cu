// cpu/test/test_edge_blocks.cu: the CPU backend's edge mode, CUCC_EDGE_BLOCKS=K (doc/backend.md, "Edge mode"),
// which the test sets itself (K = 2) before its first CUDA call:
//  - only the first and last K blocks of a grid run (a 2^31-1-block grid, a 2D grid), every block of a grid of at
//    most 2K blocks;
//  - device allocations are lazily backed (an 8 GiB one costs nothing) and not poisoned;
//  - memset and memcpy move only their first and last K * 64 KiB, and abort on a range past an allocation;
//  - a GEMM computes its four corner blocks (128K rows x 128K columns, k <= 256K here) as a host reference, and leaves
//    the rest alone; an operand past its allocation aborts; a strided batch runs its first and last K matrices.
// Prints "test_edge_blocks: N passed, N failed" last.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include "test_common.h"
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>


static const int K = 2;

__global__ void mark_blocks(unsigned char* ran, unsigned long long* count) {
    size_t b = (size_t)blockIdx.y * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) ran[b] = 1;
    atomicAdd(count, 1ull);
}

// Runs f in a child process; returns 1 if it aborted (SIGABRT) with a "cucc: edge mode" line, as a GPU would fault.
template <typename F>
static int aborts(F f) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        freopen("/dev/null", "w", stderr);
        f();
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

static void test_grids(void) {
    // 2^31 - 1 blocks of 64 threads: the grid a production-size index computation overflows int on
    const size_t nb = 2147483647u;
    unsigned char* ran;
    unsigned long long* count;
    check(cudaMalloc(&ran, nb) == cudaSuccess, "an 8 GiB-scale (2 GiB) allocation is lazily backed");
    cudaMalloc(&count, sizeof(*count));
    cudaMemset(count, 0, sizeof(*count));
    mark_blocks<<<(unsigned)nb, 64>>>(ran, count);
    check(cudaGetLastError() == cudaSuccess, "launch of a 2^31-1-block grid");
    unsigned long long c;
    cudaMemcpy(&c, count, sizeof(c), cudaMemcpyDeviceToHost);
    check(c == 2ull * K * 64, "%llu threads ran, want %d (2K blocks of 64)", c, 2 * K * 64);
    int edges_ran = 1;
    for (int i = 0; i < K; i++) edges_ran &= ran[i] == 1 && ran[nb - 1 - i] == 1;
    check(edges_ran, "the first and last %d blocks ran", K);
    check(ran[K] == 0 && ran[nb - 1 - K] == 0 && ran[nb / 2] == 0, "the blocks in between did not run, and the "
          "allocation is not poisoned (untouched memory reads 0)");
    cudaFree(ran);

    // a 2D grid (1000, 3): linear blocks 0, 1, 2998, 2999
    cudaMalloc(&ran, 3000);
    cudaMemset(count, 0, sizeof(*count));
    mark_blocks<<<dim3(1000, 3), 32>>>(ran, count);
    cudaMemcpy(&c, count, sizeof(c), cudaMemcpyDeviceToHost);
    check(c == 2ull * K * 32 && ran[0] && ran[1] && ran[2998] && ran[2999] && !ran[2] && !ran[1500] && !ran[2997],
          "2D grid: blocks (0,0), (1,0), (998,2), (999,2) ran and no other (%llu threads)", c);
    cudaFree(ran);

    // a grid of at most 2K blocks runs whole
    cudaMalloc(&ran, 4);
    cudaMemset(count, 0, sizeof(*count));
    mark_blocks<<<3, 32>>>(ran, count);
    cudaMemcpy(&c, count, sizeof(c), cudaMemcpyDeviceToHost);
    check(c == 3 * 32 && ran[0] && ran[1] && ran[2], "a grid of 3 <= 2K blocks runs every block");
    cudaFree(ran);
    cudaFree(count);
}

static void test_memory(void) {
    const size_t bytes = 10u << 20, edge = (size_t)K * 64 * 1024;
    unsigned char* d;
    cudaMalloc(&d, bytes);
    cudaMemset(d, 0x11, bytes);
    int ok = d[0] == 0x11 && d[edge - 1] == 0x11 && d[bytes - edge] == 0x11 && d[bytes - 1] == 0x11 && d[edge] == 0 &&
             d[bytes / 2] == 0 && d[bytes - edge - 1] == 0;
    check(ok, "cudaMemset writes the first and last K * 64 KiB only");
    static unsigned char h[10u << 20];
    memset(h, 0x22, sizeof(h));
    cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    ok = d[0] == 0x22 && d[bytes - 1] == 0x22 && d[bytes - edge] == 0x22 && d[bytes / 2] == 0;
    check(ok, "cudaMemcpy copies the first and last K * 64 KiB only");
    check(aborts([&] { cudaMemcpy(d + 1, h, bytes, cudaMemcpyHostToDevice); }),
          "cudaMemcpy one byte past the end of the allocation aborts, though only the edges are copied");
    check(aborts([&] { cudaMemset(d, 0, bytes + 4096); }), "cudaMemset past the end of the allocation aborts");
    check(aborts([&] { cudaMemcpy(h, h + 1, 16, cudaMemcpyHostToDevice); }),
          "cudaMemcpy HostToDevice to host memory aborts");
    cudaFree(d);
}

static void test_gemm(void) {
    const int m = 700, n = 600, kk = 37, w = 128 * K;
    cublasHandle_t handle;
    cublasCreate(&handle);
    float *A, *B, *C;
    cudaMalloc(&A, (size_t)m * kk * sizeof(float));
    cudaMalloc(&B, (size_t)kk * n * sizeof(float));
    cudaMalloc(&C, (size_t)m * n * sizeof(float));
    // operands written from the host: memcpy in edge mode would move only the edges
    for (int i = 0; i < m * kk; i++) A[i] = (float)((i * 37 % 101) - 50) / 64.0f;
    for (int i = 0; i < kk * n; i++) B[i] = (float)((i * 53 % 97) - 48) / 64.0f;
    const float one = 1.0f, zero = 0.0f;
    // C (m x n) = A (m x k) * B (k x n), column-major
    cublasStatus_t st = cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, kk, &one, A, m, B, kk, &zero, C, m);
    check(st == CUBLAS_STATUS_SUCCESS, "edge GEMM returns success (%d)", (int)st);
    size_t bad = 0, corner = 0, untouched_bad = 0;
    for (int j = 0; j < n; j++) {
        for (int i = 0; i < m; i++) {
            int in_rows = i < w || i >= m - w, in_cols = j < w || j >= n - w;
            float got = C[i + (size_t)j * m];
            if (in_rows && in_cols) {
                double ref = 0.0;
                for (int p = 0; p < kk; p++) ref += (double)A[i + (size_t)p * m] * B[p + (size_t)j * kk];
                corner++;
                if (fabs(got - ref) > 1e-5 * (1.0 + fabs(ref))) bad++;
            } else if (got != 0.0f) {
                untouched_bad++;
            }
        }
    }
    check(bad == 0 && corner == (size_t)4 * w * w, "the four %d x %d corner blocks match the host reference (%zu of "
          "%zu wrong)", w, w, bad, corner);
    check(untouched_bad == 0, "the rest of C is not computed (%zu elements written)", untouched_bad);
    check(aborts([&] { cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, kk + 1, &one, A, m, B, kk + 1, &zero, C, m); }),
          "a GEMM whose A and B extend past their allocations aborts");
    // strided batch of 7: matrices 0, 1, 5, 6 computed
    const int bm = 4, batch = 7;
    float *X, *Y;
    cudaMalloc(&X, bm * bm * batch * sizeof(float));
    cudaMalloc(&Y, bm * bm * batch * sizeof(float));
    for (int i = 0; i < bm * bm * batch; i++) X[i] = 1.0f;
    for (int i = 0; i < bm * bm * batch; i++) Y[i] = -1.0f;
    cublasSgemmStridedBatched(handle, CUBLAS_OP_N, CUBLAS_OP_N, bm, bm, bm, &one, X, bm, bm * bm, X, bm, bm * bm, &zero,
                              Y, bm, bm * bm, batch);
    int ok = 1;
    for (int b = 0; b < batch; b++) ok &= Y[b * bm * bm] == ((b < K || b >= batch - K) ? (float)bm : -1.0f);
    check(ok, "a strided batch of 7 computes matrices 0, 1, 5, 6 only");
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
    cudaFree(X);
    cudaFree(Y);
    cublasDestroy(handle);
}

int main(void) {
    setenv("CUCC_EDGE_BLOCKS", "2", 1);
    test_grids();
    test_memory();
    test_gemm();
    return test_summary("test_edge_blocks");
}
