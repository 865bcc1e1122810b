// cpu/test/test_runtime.cu: tests of the CPU backend's execution model and runtime API, each against a
// plain host computation. It is an ordinary CUDA program: on a GPU,
//   nvcc -arch=sm_80 -I dev/test cpu/test/test_runtime.cu -o test_runtime
// runs the same checks; on the CPU backend (`make test` does this)
//   cpu/cucc -O2 -I dev/test cpu/test/test_runtime.cu -o build/test_runtime && ./build/test_runtime
// Covers: built-in indices in 1-3 dimensions, barriers (with count/and/or), warp shuffles of every kind
// and width, votes and warp reductions, partial warps, atomics under contention from many blocks,
// static and dynamic shared memory, cooperative groups, integer/float/bf16/fp16 intrinsics, __device__
// and __constant__ globals, the memory/stream/event/device API and launch-configuration errors, and two
// realistic kernels (a warp-per-row layernorm and a shared-memory softmax).
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <stdlib.h>
#include <vector>
#include "test_common.h"
#include "sample_kernels.cuh"

namespace cg = cooperative_groups;

#define CUDA_OK(call) check((call) == cudaSuccess, "%s at %s:%d", #call, __FILE__, __LINE__)

// ---------------------------------------------------------------------------------------------------
// Built-in indices: every thread writes its global linear id to the slot it computes from the indices.
__global__ void write_indices(int* out) {
    int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int per_block = blockDim.x * blockDim.y * blockDim.z;
    out[block * per_block + thread] = block * 100000 + thread;
}

static void test_indices(void) {
    dim3 grids[] = {dim3(3), dim3(2, 3), dim3(2, 2, 3)};
    dim3 blocks[] = {dim3(37), dim3(8, 5), dim3(4, 3, 5)};
    for (int c = 0; c < 3; c++) {
        dim3 g = grids[c], b = blocks[c];
        int nb = g.x * g.y * g.z, nt = b.x * b.y * b.z;
        int* d;
        cudaMalloc(&d, nb * nt * sizeof(int));
        write_indices<<<g, b>>>(d);
        std::vector<int> h(nb * nt);
        cudaMemcpy(h.data(), d, nb * nt * sizeof(int), cudaMemcpyDeviceToHost);
        int bad = 0;
        for (int blk = 0; blk < nb; blk++)
            for (int t = 0; t < nt; t++) bad += h[blk * nt + t] != blk * 100000 + t;
        check(bad == 0, "indices grid (%u,%u,%u) block (%u,%u,%u): %d wrong", g.x, g.y, g.z, b.x, b.y, b.z, bad);
        cudaFree(d);
    }
}

// ---------------------------------------------------------------------------------------------------
// Barriers: a two-phase exchange through shared memory is only right if __syncthreads orders it;
// the count/and/or variants against the host count of the predicate.
__global__ void reverse_through_shared(const int* in, int* out, int* counts) {
    __shared__ int buf[256];
    int t = threadIdx.x;
    int v = in[blockIdx.x * blockDim.x + t];
    buf[t] = v;
    __syncthreads();
    int r = buf[blockDim.x - 1 - t];
    __syncthreads();
    buf[t] = r * 2;
    __syncthreads();
    out[blockIdx.x * blockDim.x + t] = buf[(t + 1) % blockDim.x];
    int c = __syncthreads_count(v % 3 == 0);
    int a = __syncthreads_and(v >= 0);
    int o = __syncthreads_or(v == 7);
    if (t == 0) {
        counts[blockIdx.x * 3 + 0] = c;
        counts[blockIdx.x * 3 + 1] = a;
        counts[blockIdx.x * 3 + 2] = o;
    }
}

static void test_barriers(void) {
    int nb = 5, nt = 200;
    std::vector<int> h(nb * nt);
    for (auto& x : h) x = (int)(test_rand_u32() % 1000);
    h[3] = 7;  // block 0 has a 7, the others almost surely not
    int *din, *dout, *dcounts;
    cudaMalloc(&din, h.size() * 4);
    cudaMalloc(&dout, h.size() * 4);
    cudaMalloc(&dcounts, nb * 3 * 4);
    cudaMemcpy(din, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
    reverse_through_shared<<<nb, nt>>>(din, dout, dcounts);
    std::vector<int> out(h.size()), counts(nb * 3);
    cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(counts.data(), dcounts, counts.size() * 4, cudaMemcpyDeviceToHost);
    int bad = 0, bad_counts = 0;
    for (int b = 0; b < nb; b++) {
        int c = 0, o = 0;
        for (int t = 0; t < nt; t++) {
            int u = (t + 1) % nt;
            bad += out[b * nt + t] != 2 * h[b * nt + nt - 1 - u];
            c += h[b * nt + t] % 3 == 0;
            o |= h[b * nt + t] == 7;
        }
        bad_counts += counts[b * 3] != c || counts[b * 3 + 1] != 1 || counts[b * 3 + 2] != o;
    }
    check(bad == 0, "__syncthreads exchange: %d wrong", bad);
    check(bad_counts == 0, "__syncthreads_count/and/or: %d blocks wrong", bad_counts);
    cudaFree(din);
    cudaFree(dout);
    cudaFree(dcounts);
}

// ---------------------------------------------------------------------------------------------------
// Shuffles: each kind at widths 32, 16 and 8; out-of-segment sources keep the caller's value.
__global__ void shuffles(const float* in, float* out, int width) {
    int t = threadIdx.x;
    float v = in[t];
    float* o = out + t * 5;
    o[0] = __shfl_sync(0xffffffff, v, (t * 7 + 3) % 32, width);
    o[1] = __shfl_up_sync(0xffffffff, v, 3, width);
    o[2] = __shfl_down_sync(0xffffffff, v, 5, width);
    o[3] = __shfl_xor_sync(0xffffffff, v, 6, width);
    double dv = (double)v * 3.0;  // 8-byte values travel whole
    o[4] = (float)__shfl_xor_sync(0xffffffff, dv, 1, width);
}

static void test_shuffles(void) {
    int nt = 64;
    std::vector<float> h(nt);
    fill_uniform(h.data(), nt, -1, 1);
    float *din, *dout;
    cudaMalloc(&din, nt * 4);
    cudaMalloc(&dout, nt * 5 * 4);
    cudaMemcpy(din, h.data(), nt * 4, cudaMemcpyHostToDevice);
    int widths[] = {32, 16, 8};
    for (int w : widths) {
        shuffles<<<1, nt>>>(din, dout, w);
        std::vector<float> out(nt * 5);
        cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
        int bad = 0;
        for (int t = 0; t < nt; t++) {
            int lane = t % 32, base = t - lane, seg = lane & ~(w - 1), l = lane & (w - 1);
            float want0 = h[base + seg + (((t * 7 + 3) % 32) & (w - 1))];
            float want1 = l >= 3 ? h[t - 3] : h[t];
            float want2 = l + 5 < w ? h[t + 5] : h[t];
            float want3 = h[base + (lane ^ 6)];
            if (((lane ^ 6) & ~(w - 1)) != seg) want3 = h[t];
            float want4 = (float)((double)h[base + (lane ^ 1)] * 3.0);
            bad += out[t * 5] != want0 || out[t * 5 + 1] != want1 || out[t * 5 + 2] != want2 ||
                   out[t * 5 + 3] != want3 || out[t * 5 + 4] != want4;
        }
        check(bad == 0, "shuffles at width %d: %d threads wrong", w, bad);
    }
    cudaFree(din);
    cudaFree(dout);
}

// Votes, warp reductions and __activemask, on a block of 48 threads (a partial second warp) where
// lanes 0-9 of every warp return first, so the votes run over the remaining live lanes.
__global__ void votes(const int* in, unsigned* out) {
    int t = threadIdx.x;
    int lane = t % 32;
    if (lane < 10) return;
    unsigned live = __activemask();
    int v = in[t];
    unsigned* o = out + t * 8;
    o[0] = __ballot_sync(live, v > 50);
    o[1] = __any_sync(live, v > 95);
    o[2] = __all_sync(live, v >= 0);
    o[3] = __reduce_add_sync(live, (unsigned)v);
    o[4] = __reduce_max_sync(live, (unsigned)v);
    o[5] = __reduce_min_sync(live, (unsigned)v);
    o[6] = live;
    __syncwarp(live);
    o[7] = __reduce_xor_sync(live, (unsigned)v);
}

static void test_votes(void) {
    int nt = 48;
    std::vector<int> h(nt);
    for (auto& x : h) x = (int)(test_rand_u32() % 100);
    int* din;
    unsigned* dout;
    cudaMalloc(&din, nt * 4);
    cudaMalloc(&dout, nt * 8 * 4);
    cudaMemcpy(din, h.data(), nt * 4, cudaMemcpyHostToDevice);
    votes<<<1, nt>>>(din, dout);
    std::vector<unsigned> out(nt * 8);
    cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int t = 0; t < nt; t++) {
        int lane = t % 32, base = t - lane, lanes = base == 0 ? 32 : nt - 32;
        if (lane < 10) continue;
        unsigned ballot = 0, live = 0, sum = 0, mx = 0, mn = ~0u, x = 0;
        int any = 0;
        for (int l = 10; l < lanes; l++) {
            int v = h[base + l];
            live |= 1u << l;
            ballot |= (unsigned)(v > 50) << l;
            any |= v > 95;
            sum += v;
            mx = v > (int)mx ? v : mx;
            mn = (unsigned)v < mn ? v : mn;
            x ^= v;
        }
        unsigned* o = &out[t * 8];
        bad += o[0] != ballot || o[1] != (unsigned)any || o[2] != 1 || o[3] != sum || o[4] != mx || o[5] != mn ||
               o[6] != live || o[7] != x;
    }
    check(bad == 0, "votes/warp reductions/activemask on a partial warp: %d threads wrong", bad);
    cudaFree(din);
    cudaFree(dout);
}

// ---------------------------------------------------------------------------------------------------
// Atomics from many blocks (which run on several OS threads): integer results are exact whatever the
// order; float adds of small integers are exact too.
__global__ void atomics(int* i, unsigned* u, unsigned long long* ull, float* f, double* d, int* mx, int* mn,
                        unsigned* cas_count, unsigned* exch, __nv_bfloat16* bf, unsigned* inc) {
    int g = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(i, 1);
    atomicSub(i, 2);
    atomicAdd(u, (unsigned)g);
    atomicAdd(ull, 1ull << 33);
    atomicAdd(f, 1.0f);
    atomicAdd(d, 0.5);
    atomicMax(mx, (g * 7919) % 10007);
    atomicMin(mn, (g * 7919) % 10007 - 5000);
    unsigned old = atomicCAS(cas_count, 0u, 0u);  // a CAS increment loop
    while (true) {
        unsigned seen = atomicCAS(cas_count, old, old + 1);
        if (seen == old) break;
        old = seen;
    }
    atomicExch(exch, 12345u);
    if (g < 64) atomicAdd(bf, __float2bfloat16(1.0f));
    atomicInc(inc, 9u);
    atomicOr(u + 1, 1u << (g % 32));
    atomicAnd(u + 2, ~(1u << (g % 31)));
    atomicXor(u + 3, 1u);
}

static void test_atomics(void) {
    int nb = 40, nt = 96, n = nb * nt;
    int *i, *mx, *mn;
    unsigned *u, *cas_count, *exch, *inc;
    unsigned long long* ull;
    float* f;
    double* d;
    __nv_bfloat16* bf;
    cudaMalloc(&i, 4); cudaMalloc(&mx, 4); cudaMalloc(&mn, 4); cudaMalloc(&u, 16); cudaMalloc(&cas_count, 4);
    cudaMalloc(&exch, 4); cudaMalloc(&inc, 4); cudaMalloc(&ull, 8); cudaMalloc(&f, 4); cudaMalloc(&d, 8);
    cudaMalloc(&bf, 2);
    int zero = 0, big = 1 << 30, small = -(1 << 30);
    unsigned uinit[4] = {0, 0, 0xffffffffu, 0};
    cudaMemcpy(i, &zero, 4, cudaMemcpyHostToDevice);
    cudaMemcpy(mx, &small, 4, cudaMemcpyHostToDevice);
    cudaMemcpy(mn, &big, 4, cudaMemcpyHostToDevice);
    cudaMemcpy(u, uinit, 16, cudaMemcpyHostToDevice);
    cudaMemset(cas_count, 0, 4);
    cudaMemset(exch, 0, 4);
    cudaMemset(inc, 0, 4);
    cudaMemset(ull, 0, 8);
    cudaMemset(f, 0, 4);
    cudaMemset(d, 0, 8);
    cudaMemset(bf, 0, 2);
    atomics<<<nb, nt>>>(i, u, ull, f, d, mx, mn, cas_count, exch, bf, inc);
    int hi, hmx, hmn;
    unsigned hu[4], hcas, hexch, hinc;
    unsigned long long hull;
    float hf;
    double hd;
    __nv_bfloat16 hbf;
    cudaMemcpy(&hi, i, 4, cudaMemcpyDeviceToHost); cudaMemcpy(&hmx, mx, 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(&hmn, mn, 4, cudaMemcpyDeviceToHost); cudaMemcpy(hu, u, 16, cudaMemcpyDeviceToHost);
    cudaMemcpy(&hcas, cas_count, 4, cudaMemcpyDeviceToHost); cudaMemcpy(&hexch, exch, 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(&hinc, inc, 4, cudaMemcpyDeviceToHost); cudaMemcpy(&hull, ull, 8, cudaMemcpyDeviceToHost);
    cudaMemcpy(&hf, f, 4, cudaMemcpyDeviceToHost); cudaMemcpy(&hd, d, 8, cudaMemcpyDeviceToHost);
    cudaMemcpy(&hbf, bf, 2, cudaMemcpyDeviceToHost);
    unsigned usum = 0;
    int want_mx = -(1 << 30), want_mn = 1 << 30;
    for (int g = 0; g < n; g++) {
        usum += g;
        want_mx = std::max(want_mx, (g * 7919) % 10007);
        want_mn = std::min(want_mn, (g * 7919) % 10007 - 5000);
    }
    check(hi == -n, "atomicAdd/atomicSub int: %d, want %d", hi, -n);
    check(hu[0] == usum, "atomicAdd unsigned: %u, want %u", hu[0], usum);
    check(hull == (unsigned long long)n << 33, "atomicAdd unsigned long long");
    check(hf == (float)n, "atomicAdd float: %f, want %d", hf, n);
    check(hd == 0.5 * n, "atomicAdd double");
    check(hmx == want_mx && hmn == want_mn, "atomicMax/atomicMin: %d %d, want %d %d", hmx, hmn, want_mx, want_mn);
    check(hcas == (unsigned)n, "atomicCAS increment loop: %u, want %d", hcas, n);
    check(hexch == 12345u, "atomicExch");
    check(__bfloat162float(hbf) == 64.0f, "atomicAdd bf16: %f, want 64", __bfloat162float(hbf));
    check(hinc == (unsigned)(n % 10), "atomicInc wraps: %u, want %d", hinc, n % 10);
    check(hu[1] == 0xffffffffu && hu[2] == 0x80000000u && hu[3] == (unsigned)(n & 1), "atomicOr/And/Xor");
    cudaFree(i); cudaFree(mx); cudaFree(mn); cudaFree(u); cudaFree(cas_count); cudaFree(exch); cudaFree(inc);
    cudaFree(ull); cudaFree(f); cudaFree(d); cudaFree(bf);
}

// ---------------------------------------------------------------------------------------------------
// Shared memory: a tiled transpose with static shared memory (2-D array, padded), and a dynamic
// shared buffer sized at launch, above the 48 KiB default once the attribute allows it.
template <int TILE>
__global__ void transpose_tiled(const float* in, float* out, int rows, int cols) {
    __shared__ float tile[TILE][TILE + 1];
    int x = blockIdx.x * TILE + threadIdx.x, y = blockIdx.y * TILE + threadIdx.y;
    if (x < cols && y < rows) tile[threadIdx.y][threadIdx.x] = in[y * cols + x];
    __syncthreads();
    int tx = blockIdx.y * TILE + threadIdx.x, ty = blockIdx.x * TILE + threadIdx.y;
    if (tx < rows && ty < cols) out[ty * rows + tx] = tile[threadIdx.x][threadIdx.y];
}

__global__ void dynamic_shared_sum(const float* in, float* out, int n_per_block) {
    extern __shared__ float buf[];
    for (int i = threadIdx.x; i < n_per_block; i += blockDim.x) buf[i] = in[blockIdx.x * n_per_block + i];
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int i = 0; i < n_per_block; i++) s += buf[i];
        out[blockIdx.x] = s;
    }
}

static void test_shared(void) {
    int rows = 45, cols = 70;
    std::vector<float> h(rows * cols);
    fill_uniform(h.data(), h.size(), -1, 1);
    float *din, *dout;
    cudaMalloc(&din, h.size() * 4);
    cudaMalloc(&dout, h.size() * 4);
    cudaMemcpy(din, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
    transpose_tiled<16><<<dim3((cols + 15) / 16, (rows + 15) / 16), dim3(16, 16)>>>(din, dout, rows, cols);
    std::vector<float> out(h.size());
    cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) bad += out[c * rows + r] != h[r * cols + c];
    check(bad == 0, "static shared tiled transpose: %d wrong", bad);
    cudaFree(din);
    cudaFree(dout);

    int nb = 3, per = 20000;  // 80,000 bytes of dynamic shared memory per block
    std::vector<float> v(nb * per);
    for (auto& x : v) x = (float)(test_rand_u32() % 16);  // small integers: the sum is exact
    cudaMalloc(&din, v.size() * 4);
    cudaMalloc(&dout, nb * 4);
    cudaMemcpy(din, v.data(), v.size() * 4, cudaMemcpyHostToDevice);
    cudaGetLastError();
    dynamic_shared_sum<<<nb, 128, per * sizeof(float)>>>(din, dout, per);
    check(cudaGetLastError() == cudaErrorInvalidValue, "dynamic shared memory over 48 KiB without the attribute fails");
    CUDA_OK(cudaFuncSetAttribute(dynamic_shared_sum, cudaFuncAttributeMaxDynamicSharedMemorySize, per * sizeof(float)));
    dynamic_shared_sum<<<nb, 128, per * sizeof(float)>>>(din, dout, per);
    check(cudaGetLastError() == cudaSuccess, "dynamic shared memory within the raised limit launches");
    float hout[3];
    cudaMemcpy(hout, dout, sizeof(hout), cudaMemcpyDeviceToHost);
    bad = 0;
    for (int b = 0; b < nb; b++) {
        double s = 0;
        for (int i = 0; i < per; i++) s += v[b * per + i];
        bad += hout[b] != (float)s;
    }
    check(bad == 0, "dynamic shared sum: %d blocks wrong", bad);
    check(cudaFuncSetAttribute(dynamic_shared_sum, cudaFuncAttributeMaxDynamicSharedMemorySize, 1 << 20) ==
              cudaErrorInvalidValue, "cudaFuncSetAttribute above the opt-in maximum fails");
    cudaFree(din);
    cudaFree(dout);
}

// Launch configuration errors a GPU reports through cudaGetLastError (and does not run the kernel).
static void test_launch_errors(void) {
    int* d;
    cudaMalloc(&d, 4096 * sizeof(int));
    cudaMemset(d, 0, 4096 * sizeof(int));
    cudaGetLastError();
    write_indices<<<1, 1025>>>(d);
    check(cudaGetLastError() == cudaErrorInvalidConfiguration, "1025 threads per block: cudaErrorInvalidConfiguration");
    check(cudaGetLastError() == cudaSuccess, "cudaGetLastError resets the error");
    write_indices<<<1, dim3(2, 2, 65)>>>(d);
    check(cudaGetLastError() == cudaErrorInvalidConfiguration, "blockDim.z of 65: cudaErrorInvalidConfiguration");
    write_indices<<<dim3(1, 70000), 32>>>(d);
    check(cudaGetLastError() == cudaErrorInvalidConfiguration, "gridDim.y of 70000: cudaErrorInvalidConfiguration");
    write_indices<<<0, 32>>>(d);
    check(cudaPeekAtLastError() == cudaErrorInvalidConfiguration, "an empty grid: cudaErrorInvalidConfiguration (peek)");
    check(cudaGetLastError() == cudaErrorInvalidConfiguration, "peek does not reset the error");
    int h = -1;
    cudaMemcpy(&h, d, 4, cudaMemcpyDeviceToHost);
    check(h == 0, "a failed launch runs nothing");
    write_indices<<<1, 1024>>>(d);
    check(cudaGetLastError() == cudaSuccess, "1024 threads per block launches");
    cudaFree(d);
}

// ---------------------------------------------------------------------------------------------------
// Cooperative groups: tile ranks and a cg::reduce of each kind per 32-lane tile, and per 8-lane tile.
template <int N>
__global__ void cg_reduce(const float* in, float* out) {
    cg::thread_block block = cg::this_thread_block();
    cg::thread_block_tile<N> tile = cg::tiled_partition<N>(block);
    float v = in[block.thread_rank()];
    float s = cg::reduce(tile, v, cg::plus<float>());
    float mx = cg::reduce(tile, v, cg::greater<float>());
    float mn = cg::reduce(tile, v, cg::less<float>());
    block.sync();
    float* o = out + block.thread_rank() * 6;
    o[0] = s;
    o[1] = mx;
    o[2] = mn;
    o[3] = (float)tile.thread_rank();
    o[4] = (float)tile.meta_group_rank();
    o[5] = (float)tile.meta_group_size() + 1000.0f * (float)tile.size();
}

template <int N>
static void check_cg(const std::vector<float>& h, float* din, float* dout) {
    int nt = (int)h.size();
    cg_reduce<N><<<1, nt>>>(din, dout);
    std::vector<float> out(nt * 6);
    cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int t = 0; t < nt; t++) {
        int base = t - t % N;
        double s = 0;
        float mx = -1e30f, mn = 1e30f;
        for (int l = 0; l < N; l++) {
            s += h[base + l];
            mx = std::max(mx, h[base + l]);
            mn = std::min(mn, h[base + l]);
        }
        float* o = &out[t * 6];
        // the sum's order differs from the host loop: ~N ulp of tolerance
        bad += fabs(o[0] - s) > 1e-5 || o[1] != mx || o[2] != mn || o[3] != t % N || o[4] != t / N ||
               o[5] != (float)((nt + N - 1) / N) + 1000.0f * N;
    }
    check(bad == 0, "cooperative groups tile<%d> reduce/ranks: %d threads wrong", N, bad);
}

static void test_cooperative_groups(void) {
    int nt = 128;
    std::vector<float> h(nt);
    fill_uniform(h.data(), nt, -2, 2);
    float *din, *dout;
    cudaMalloc(&din, nt * 4);
    cudaMalloc(&dout, nt * 6 * 4);
    cudaMemcpy(din, h.data(), nt * 4, cudaMemcpyHostToDevice);
    check_cg<32>(h, din, dout);
    check_cg<8>(h, din, dout);
    cudaFree(din);
    cudaFree(dout);
}

// ---------------------------------------------------------------------------------------------------
// Intrinsics: integer bit operations exact; float intrinsics within a few ulp of libm in double;
// bf16/fp16 helpers against the conversion of the fp32 result (one rounding).
__global__ void intrinsics(const unsigned* ui, const float* f, float* out, int* iout) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned x = ui[t];
    iout[t * 6 + 0] = __popc(x);
    iout[t * 6 + 1] = __clz((int)x);
    iout[t * 6 + 2] = __ffs((int)x);
    iout[t * 6 + 3] = (int)__brev(x);
    iout[t * 6 + 4] = __float_as_int(f[t]);
    iout[t * 6 + 5] = (int)__byte_perm(x, 0x12345678u, 0x5140);
    float v = f[t];
    out[t * 8 + 0] = __expf(v);
    out[t * 8 + 1] = __logf(fabsf(v) + 0.1f);
    out[t * 8 + 2] = rsqrtf(fabsf(v) + 0.1f);
    out[t * 8 + 3] = __fdividef(v, 3.0f);
    out[t * 8 + 4] = __saturatef(v);
    out[t * 8 + 5] = __bfloat162float(__hfma(__float2bfloat16(v), __float2bfloat16(v), __float2bfloat16(0.5f)));
    out[t * 8 + 6] = __half2float(hexp(__float2half(v)));
    out[t * 8 + 7] = __ldg(&f[t]) + __ldcs(&f[t]);
}

static void test_intrinsics(void) {
    int nt = 64;
    std::vector<unsigned> u(nt);
    std::vector<float> f(nt);
    for (auto& x : u) x = test_rand_u32() >> (test_rand_u32() % 20);
    fill_uniform(f.data(), nt, -2, 2);
    unsigned* du;
    float *df, *dout;
    int* diout;
    cudaMalloc(&du, nt * 4);
    cudaMalloc(&df, nt * 4);
    cudaMalloc(&dout, nt * 8 * 4);
    cudaMalloc(&diout, nt * 6 * 4);
    cudaMemcpy(du, u.data(), nt * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(df, f.data(), nt * 4, cudaMemcpyHostToDevice);
    intrinsics<<<2, 32>>>(du, df, dout, diout);
    std::vector<float> out(nt * 8);
    std::vector<int> iout(nt * 6);
    cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(iout.data(), diout, iout.size() * 4, cudaMemcpyDeviceToHost);
    int bad_int = 0;
    std::vector<double> want(nt * 8);
    std::vector<float> got_fast(nt * 5);
    for (int t = 0; t < nt; t++) {
        unsigned x = u[t];
        unsigned rev = 0;
        for (int b = 0; b < 32; b++) rev |= ((x >> b) & 1u) << (31 - b);
        int clz = 0;
        while (clz < 32 && !(x & (0x80000000u >> clz))) clz++;
        int ffs = 0;
        for (int b = 0; b < 32; b++) if (x & (1u << b)) { ffs = b + 1; break; }
        int fbits;
        memcpy(&fbits, &f[t], 4);
        unsigned char bytes[8];
        unsigned y = 0x12345678u;
        memcpy(bytes, &x, 4);
        memcpy(bytes + 4, &y, 4);
        unsigned perm = bytes[0] | (bytes[4] << 8) | (bytes[1] << 16) | (bytes[5] << 24);
        int* o = &iout[t * 6];
        bad_int += o[0] != __builtin_popcount(x) || o[1] != clz || o[2] != ffs || (unsigned)o[3] != rev ||
                   o[4] != fbits || (unsigned)o[5] != perm;
        double v = f[t];
        want[t * 8 + 0] = exp(v);
        want[t * 8 + 1] = log(fabs(v) + 0.1f);
        want[t * 8 + 2] = 1.0 / sqrt(fabs(v) + 0.1f);
        want[t * 8 + 3] = v / 3.0;
        want[t * 8 + 4] = v < 0 ? 0 : (v > 1 ? 1 : v);
        want[t * 8 + 5] = __bfloat162float(__float2bfloat16((float)(
            (double)__bfloat162float(__float2bfloat16(f[t])) * __bfloat162float(__float2bfloat16(f[t])) + 0.5)));
        want[t * 8 + 6] = __half2float(__float2half((float)exp((double)__half2float(__float2half(f[t])))));
        want[t * 8 + 7] = 2.0 * v;
    }
    check(bad_int == 0, "integer intrinsics: %d threads wrong", bad_int);
    // fast-math intrinsics: the GPU's approximations are within ~2 ulp; 1e-6 relative covers both
    std::vector<float> fast, bf;
    std::vector<double> want_fast, want_bf;
    for (int t = 0; t < nt; t++) {
        for (int k = 0; k < 5; k++) { fast.push_back(out[t * 8 + k]); want_fast.push_back(want[t * 8 + k]); }
        for (int k = 5; k < 8; k++) { bf.push_back(out[t * 8 + k]); want_bf.push_back(want[t * 8 + k]); }
    }
    check_close("float intrinsics", fast.data(), want_fast.data(), fast.size(), 1e-7, 1e-6);
    // bf16/fp16: one rounding of the fp32 result; the fp32 fma and the double reference can round to
    // neighbouring 16-bit values, so allow one bf16 ulp (2^-7 relative)
    check_close("bf16/fp16 helpers", bf.data(), want_bf.data(), bf.size(), 1e-3, 8e-3);
    cudaFree(du);
    cudaFree(df);
    cudaFree(dout);
    cudaFree(diout);
}

// __device__ and __constant__ globals, set and read with cudaMemcpyToSymbol / FromSymbol.
__constant__ float scale_constant[4];
__device__ int device_counter;

__global__ void use_globals(float* out) {
    out[threadIdx.x] = scale_constant[threadIdx.x % 4] * (float)threadIdx.x;
    atomicAdd(&device_counter, 1);
}

static void test_globals(void) {
    float scales[4] = {0.5f, -2.0f, 3.0f, 0.25f};
    int zero = 0;
    CUDA_OK(cudaMemcpyToSymbol(scale_constant, scales, sizeof(scales)));
    CUDA_OK(cudaMemcpyToSymbol(device_counter, &zero, sizeof(int)));
    float* d;
    cudaMalloc(&d, 64 * 4);
    use_globals<<<1, 64>>>(d);
    float h[64];
    int count = -1;
    cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost);
    CUDA_OK(cudaMemcpyFromSymbol(&count, device_counter, sizeof(int)));
    int bad = 0;
    for (int t = 0; t < 64; t++) bad += h[t] != scales[t % 4] * (float)t;
    check(bad == 0 && count == 64, "__constant__/__device__ globals: %d wrong, counter %d", bad, count);
    cudaFree(d);
}

// ---------------------------------------------------------------------------------------------------
// Realistic kernels (dev/test/sample_kernels.cuh) against double-precision host loops.
static void test_realistic_kernels(void) {
    int N = 37, C = 200;
    std::vector<float> x(N * C), w(C), b(C);
    fill_uniform(x.data(), x.size(), -3, 3);
    fill_uniform(w.data(), C, 0.5f, 1.5f);
    fill_uniform(b.data(), C, -0.5f, 0.5f);
    float *dx, *dw, *db, *dout, *dmean, *drstd;
    cudaMalloc(&dx, x.size() * 4); cudaMalloc(&dw, C * 4); cudaMalloc(&db, C * 4);
    cudaMalloc(&dout, x.size() * 4); cudaMalloc(&dmean, N * 4); cudaMalloc(&drstd, N * 4);
    cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dw, w.data(), C * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(db, b.data(), C * 4, cudaMemcpyHostToDevice);
    layernorm_forward<<<(N + 3) / 4, 128>>>(dout, dmean, drstd, dx, dw, db, N, C);
    std::vector<float> out(N * C), mean(N), rstd(N);
    cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(mean.data(), dmean, N * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(rstd.data(), drstd, N * 4, cudaMemcpyDeviceToHost);
    std::vector<double> want(N * C), want_mean(N), want_rstd(N);
    for (int r = 0; r < N; r++) {
        double m = 0, v = 0;
        for (int i = 0; i < C; i++) m += x[r * C + i];
        m /= C;
        for (int i = 0; i < C; i++) v += (x[r * C + i] - m) * (x[r * C + i] - m);
        double rs = 1.0 / sqrt(v / C + 1e-5);
        want_mean[r] = m;
        want_rstd[r] = rs;
        for (int i = 0; i < C; i++) want[r * C + i] = (x[r * C + i] - m) * rs * w[i] + b[i];
    }
    // fp32 sums of C=200 terms of magnitude ~3: ~1e-5 absolute error is the fp32 floor
    check_close("layernorm out", out.data(), want.data(), out.size(), 1e-4, 1e-4);
    check_close("layernorm mean", mean.data(), want_mean.data(), N, 1e-5, 1e-5);
    check_close("layernorm rstd", rstd.data(), want_rstd.data(), N, 1e-5, 1e-5);

    int R = 19, K = 1000;
    std::vector<float> s(R * K);
    fill_uniform(s.data(), s.size(), -8, 8);
    float *ds, *dso;
    cudaMalloc(&ds, s.size() * 4);
    cudaMalloc(&dso, s.size() * 4);
    cudaMemcpy(ds, s.data(), s.size() * 4, cudaMemcpyHostToDevice);
    softmax_forward<<<R, 256, 8 * sizeof(float)>>>(dso, ds, K);
    std::vector<float> so(s.size());
    cudaMemcpy(so.data(), dso, so.size() * 4, cudaMemcpyDeviceToHost);
    std::vector<double> want_s(s.size());
    for (int r = 0; r < R; r++) {
        double mx = -1e300, sum = 0;
        for (int i = 0; i < K; i++) mx = std::max(mx, (double)s[r * K + i]);
        for (int i = 0; i < K; i++) sum += exp(s[r * K + i] - mx);
        for (int i = 0; i < K; i++) want_s[r * K + i] = exp(s[r * K + i] - mx) / sum;
    }
    // probabilities up to 1: expf within 2 ulp and a 1000-term fp32 sum, ~1e-6 relative
    check_close("softmax", so.data(), want_s.data(), so.size(), 1e-7, 1e-5);
    cudaFree(dx); cudaFree(dw); cudaFree(db); cudaFree(dout); cudaFree(dmean); cudaFree(drstd);
    cudaFree(ds); cudaFree(dso);
}

// ---------------------------------------------------------------------------------------------------
// Runtime API: memory in every direction, memset, frees, streams, events, device queries, errors.
__global__ void spin_work(float* x, int n, int reps) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    for (int r = 0; r < reps; r++) v = v * 0.999f + 0.001f;
    x[i] = v;
}

static void test_runtime_api(void) {
    // memcpy in every direction, through pinned host memory, and memset
    size_t n = 1000;
    std::vector<float> src(n), dst(n, 0.0f);
    fill_uniform(src.data(), n, -1, 1);
    float *d1, *d2, *pinned;
    CUDA_OK(cudaMalloc(&d1, n * 4));
    CUDA_OK(cudaMalloc(&d2, n * 4));
    CUDA_OK(cudaMallocHost(&pinned, n * 4));
    unsigned char first_byte;
    memcpy(&first_byte, d1, 1);
    check(first_byte == 0xff, "new device memory is poisoned (0xff), not zero");
    CUDA_OK(cudaMemcpy(d1, src.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d2, d1, n * 4, cudaMemcpyDeviceToDevice));
    CUDA_OK(cudaMemcpy(pinned, d2, n * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dst.data(), pinned, n * 4, cudaMemcpyHostToHost));
    check(memcmp(dst.data(), src.data(), n * 4) == 0, "memcpy H2D, D2D, D2H, H2H round trip");
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUDA_OK(cudaMemsetAsync(d2, 0, n * 4, stream));
    CUDA_OK(cudaMemcpyAsync(dst.data(), d2, n * 4, cudaMemcpyDefault, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    int nonzero = 0;
    for (float v : dst) nonzero += v != 0.0f;
    check(nonzero == 0, "cudaMemsetAsync + cudaMemcpyAsync(Default) on a stream");
    check(cudaMemcpy(dst.data(), d2, 4, (cudaMemcpyKind)17) == cudaErrorInvalidMemcpyDirection,
          "invalid memcpy direction is refused");
    int not_ours;
    check(cudaFree(&not_ours) == cudaErrorInvalidValue, "cudaFree of a pointer cudaMalloc did not return fails");
    cudaGetLastError();
    CUDA_OK(cudaFree(nullptr));

    // events time real work on a stream
    cudaEvent_t start, stop, untimed;
    CUDA_OK(cudaEventCreate(&start));
    CUDA_OK(cudaEventCreate(&stop));
    CUDA_OK(cudaEventCreateWithFlags(&untimed, cudaEventDisableTiming));
    CUDA_OK(cudaEventRecord(start, stream));
    spin_work<<<(n + 127) / 128, 128, 0, stream>>>(d1, (int)n, 2000);
    CUDA_OK(cudaEventRecord(stop, stream));
    CUDA_OK(cudaStreamWaitEvent(stream, stop, 0));
    CUDA_OK(cudaEventSynchronize(stop));
    float ms = -1.0f;
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    check(ms > 0.0f && ms < 60000.0f, "cudaEventElapsedTime gives a positive time (%.3f ms)", ms);
    CUDA_OK(cudaEventRecord(untimed, stream));
    check(cudaEventElapsedTime(&ms, start, untimed) == cudaErrorInvalidResourceHandle,
          "elapsed time with a cudaEventDisableTiming event fails");
    cudaGetLastError();
    CUDA_OK(cudaEventDestroy(start));
    CUDA_OK(cudaEventDestroy(stop));
    CUDA_OK(cudaEventDestroy(untimed));
    CUDA_OK(cudaStreamDestroy(stream));
    CUDA_OK(cudaDeviceSynchronize());

    // device queries
    int count = 0, dev = -1;
    CUDA_OK(cudaGetDeviceCount(&count));
    check(count >= 1, "at least one device");
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaGetDevice(&dev));
    check(dev == 0, "cudaGetDevice after cudaSetDevice(0)");
    check(cudaSetDevice(count) == cudaErrorInvalidDevice, "cudaSetDevice beyond the count fails");
    cudaGetLastError();
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    check(prop.warpSize == 32 && prop.maxThreadsPerBlock == 1024 && prop.sharedMemPerBlock == 48 * 1024 &&
              prop.multiProcessorCount >= 1 && strlen(prop.name) > 0,
          "device properties (%s, %d SMs)", prop.name, prop.multiProcessorCount);
    int smem_optin = 0;
    CUDA_OK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    check(smem_optin == (int)prop.sharedMemPerBlockOptin && smem_optin > 48 * 1024, "opt-in shared memory attribute");
    size_t free_b = 0, total_b = 0;
    CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
    check(total_b > 0 && free_b <= total_b, "cudaMemGetInfo");
    check(strcmp(cudaGetErrorString(cudaErrorInvalidValue), "invalid argument") == 0 &&
              strcmp(cudaGetErrorName(cudaErrorInvalidConfiguration), "cudaErrorInvalidConfiguration") == 0,
          "error strings and names");
    float* managed;
    CUDA_OK(cudaMallocManaged(&managed, n * 4, cudaMemAttachGlobal));
    managed[3] = 2.0f;  // host-writable, as managed memory is
    spin_work<<<(n + 127) / 128, 128>>>(managed, 4, 1);
    CUDA_OK(cudaDeviceSynchronize());
    check(managed[3] == 2.0f * 0.999f + 0.001f, "managed memory written on the host, updated by a kernel");
    CUDA_OK(cudaFree(managed));
    cudaFree(d1);
    cudaFree(d2);
    cudaFreeHost(pinned);
}

int main(void) {
    test_seed(1234);
    test_indices();
    test_barriers();
    test_shuffles();
    test_votes();
    test_atomics();
    test_shared();
    test_launch_errors();
    test_cooperative_groups();
    test_intrinsics();
    test_globals();
    test_realistic_kernels();
    test_runtime_api();
    return test_summary("test_runtime");
}
