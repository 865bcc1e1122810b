// llmc/rmsnorm.cuh: RMSNorm forward (plain, and fused with the residual add that precedes it) and backward,
// the Llama block's norm (doc/kernels.md, "RMSNorm"):
//   out = x * rstd * weight,  rstd = 1 / sqrt(mean_c(x^2) + eps),  no mean subtraction, no bias.
// eps is a runtime argument (Llama: 1e-5, RMSNORM_DEFAULT_EPS); statistics in fp32, rstd kept per row for the
// backward. Modelled on llmc/layernorm.cuh, with the same structure and the same deterministic backward scheme.
// Included by the kernel lab (dev/cuda/rmsnorm_forward.cu, dev/cuda/rmsnorm_backward.cu; e.g.
// `make build/lab/rmsnorm_forward_bf16 && build/lab/rmsnorm_forward_bf16 -s`).
// Size constraint: C % 8 == 0 (rows are moved as 16-byte vectors), eps > 0; a trainer checks both at start-up
// through rmsnorm_support. Any number of rows, any C otherwise.
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-rmsnorm_forward_{bf16,fp32},
// lab-rmsnorm_backward_{bf16,fp32} and their lab-check- twins; llama-* and moe-*llama*.
#pragma once
#include <math.h>
#include "common.cuh"

#define RMSNORM_DEFAULT_EPS 1e-5f

// ----------------------------------------------------------------------------------------------------
// Forward: one warp per row; each lane owns the 8-channel chunks lane, lane+32, ... of the row.
// Floor: read N*C and write N*C floatX, plus 4 bytes of rstd per row (weight, C, stays in L1/L2):
// DRAM bytes = 2*N*C*sizeof(floatX) + 4*N; ~4 flops per element: memory-bound.
// The row is read twice (sum of squares, output), the second time from L1 (a row is 1.5 KiB at C = 768).
// mean(x^2) is a sum of non-negative terms, so unlike layernorm's variance one pass has no cancellation.

// rstd of the row x (C), reduced over the warp; every lane gets it
__device__ inline float rmsnorm_row_rstd(const floatX* x, int C, float eps) {
    const int lane = threadIdx.x % 32;
    float squares = 0.0f;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 v = load128(x + c);
        for (int k = 0; k < x128::size; k++) squares += (float)v[k] * (float)v[k];
    }
    return rsqrtf(warp_reduce_sum(squares) / C + eps);
}

// out = x * rstd * weight for the row x, by this lane's chunks; one rounding to floatX
__device__ inline void rmsnorm_row_output(floatX* out, const floatX* x, const floatX* weight, int C, float rstd) {
    const int lane = threadIdx.x % 32;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 v = load128cs(x + c);
        x128 w = load128(weight + c);
        x128 result;
        for (int k = 0; k < x128::size; k++) result[k] = (floatX)((float)v[k] * rstd * (float)w[k]);
        store128(out + c, result);
    }
}

__global__ void rmsnorm_forward_kernel(floatX* __restrict__ out, float* __restrict__ rstd,
                                       const floatX* __restrict__ inp, const floatX* __restrict__ weight, int N,
                                       int C, float eps) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= N) return;  // the whole warp leaves together: no shuffle loses a lane
    const floatX* x = inp + (size_t)row * C;
    const float row_rstd = rmsnorm_row_rstd(x, C, eps);
    rmsnorm_row_output(out + (size_t)row * C, x, weight, C, row_rstd);
    if (threadIdx.x % 32 == 0 && rstd != nullptr) rstd[row] = row_rstd;
}

// residual = inp1 + inp2 (rounded to floatX), normed = rmsnorm(residual): the statistics are those of the
// rounded residual, exactly what a separate add followed by rmsnorm_forward would see.
// Floor: read 2*N*C, write 2*N*C floatX, plus 4*N: DRAM bytes = 4*N*C*sizeof(floatX) + 4*N.
__global__ void fused_residual_rmsnorm_forward_kernel(floatX* __restrict__ residual, floatX* __restrict__ normed,
                                                      float* __restrict__ rstd, const floatX* __restrict__ inp1,
                                                      const floatX* __restrict__ inp2,
                                                      const floatX* __restrict__ weight, int N, int C, float eps) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= N) return;
    const int lane = threadIdx.x % 32;
    const size_t offset = (size_t)row * C;
    floatX* x = residual + offset;
    // each lane later re-reads only the chunks it wrote itself, so no fence is needed
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 a = load128cs(inp1 + offset + c);
        x128 b = load128cs(inp2 + offset + c);
        x128 sum;
        for (int k = 0; k < x128::size; k++) sum[k] = (floatX)((float)a[k] + (float)b[k]);
        store128(x + c, sum);
    }
    const float row_rstd = rmsnorm_row_rstd(x, C, eps);
    rmsnorm_row_output(normed + offset, x, weight, C, row_rstd);
    if (lane == 0 && rstd != nullptr) rstd[row] = row_rstd;
}

void rmsnorm_forward_launch(floatX* out, float* rstd, const floatX* inp, const floatX* weight, int N, int C,
                            float eps, int block_size, cudaStream_t stream) {
    const int grid = CEIL_DIV(N, block_size / 32);
    rmsnorm_forward_kernel<<<grid, block_size, 0, stream>>>(out, rstd, inp, weight, N, C, eps);
    cudaCheck(cudaGetLastError());
}

// out (B,T,C); rstd (B,T) fp32, may be nullptr (a recompute needs only out)
void rmsnorm_forward(floatX* out, float* rstd, const floatX* inp, const floatX* weight, int B, int T, int C,
                     float eps, cudaStream_t stream) {
    rmsnorm_forward_launch(out, rstd, inp, weight, B * T, C, eps, 256, stream);
}

void fused_residual_rmsnorm_forward_launch(floatX* residual, floatX* normed, float* rstd, const floatX* inp1,
                                           const floatX* inp2, const floatX* weight, int N, int C, float eps,
                                           int block_size, cudaStream_t stream) {
    const int grid = CEIL_DIV(N, block_size / 32);
    fused_residual_rmsnorm_forward_kernel<<<grid, block_size, 0, stream>>>(residual, normed, rstd, inp1, inp2,
                                                                           weight, N, C, eps);
    cudaCheck(cudaGetLastError());
}

// residual (N,C) = inp1 + inp2; normed (N,C) = rmsnorm(residual); rstd (N), may be nullptr
void fused_residual_rmsnorm_forward(floatX* residual, floatX* normed, float* rstd, const floatX* inp1,
                                    const floatX* inp2, const floatX* weight, int N, int C, float eps,
                                    cudaStream_t stream) {
    fused_residual_rmsnorm_forward_launch(residual, normed, rstd, inp1, inp2, weight, N, C, eps, 256, stream);
}

// ----------------------------------------------------------------------------------------------------
// Backward. With n = x * rstd and g = dout * weight (rstd depends on x: d rstd / dx_c = -rstd^3 x_c / C):
//   dinp += rstd * (g - n * mean_c(g * n)),  dweight += sum_rows dout * n.
// dinp accumulates (+=) as layernorm_backward's does: the residual stream's gradient flows through it.
// Deterministic: each block owns RMSNORM_BACKWARD_ROWS consecutive rows and writes its own partial dweight row
// to scratch (no atomics); common.cuh's block_partials_accumulate adds the partials in block order.
// Floor: read dout, inp and dinp, write dinp (4*N*C floatX) plus rstd (4*N): DRAM bytes = 4*N*C*sizeof(floatX)
// + 4*N; the partials add 2 * (N/32) * C * 4 bytes (written, then read back), 1/64 of the floor in fp32 and
// 1/32 in bf16. ~12 flops per element: memory-bound.
//
// Within a block: phase 1, one warp per row, reduces mean_c(g*n) into shared memory; phase 2 gives each
// thread one 8-channel chunk of a "slice" of the rows (rows s, s+S, ... with S = how many copies of the C/8
// chunks fit in the block), where it writes dinp and accumulates dweight in registers; the slices are then
// added in slice order. dout and inp are read twice per block, the second time from L1.

#define RMSNORM_BACKWARD_ROWS 32        // rows per block: the partials cost 1/ROWS of the floor
#define RMSNORM_BACKWARD_BLOCK_SIZE 256

size_t rmsnorm_backward_scratch_floats(int B, int T, int C) {
    return (size_t)CEIL_DIV(B * T, RMSNORM_BACKWARD_ROWS) * C;
}

// dynamic shared memory of the main kernel: the slices' partial sums, 8 floats per chunk slot
static size_t rmsnorm_backward_shared_bytes(int C, int block_size) {
    const int chunks = C / x128::size;
    const int slices = chunks >= block_size ? 1 : block_size / chunks;
    return slices > 1 ? (size_t)slices * chunks * x128::size * sizeof(float) : 0;
}

__global__ void rmsnorm_backward_kernel(floatX* __restrict__ dinp, float* __restrict__ partials,
                                        const floatX* __restrict__ dout, const floatX* __restrict__ inp,
                                        const floatX* __restrict__ weight, const float* __restrict__ rstd, int N,
                                        int C) {
    extern __shared__ float slice_sums[];  // (slices, C/8, 8): dweight per chunk
    __shared__ float row_rstd[RMSNORM_BACKWARD_ROWS];
    __shared__ float row_gn_mean[RMSNORM_BACKWARD_ROWS];  // mean_c(dout * weight * n)
    const int first_row = blockIdx.x * RMSNORM_BACKWARD_ROWS;
    const int rows = min(RMSNORM_BACKWARD_ROWS, N - first_row);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int warps = blockDim.x / 32;

    // phase 1: per-row reductions
    for (int r = warp; r < rows; r += warps) {
        const size_t offset = (size_t)(first_row + r) * C;
        const float s = rstd[first_row + r];
        float gn_sum = 0.0f;
        for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
            x128 d = load128(dout + offset + c);
            x128 x = load128(inp + offset + c);
            x128 w = load128(weight + c);
            for (int k = 0; k < x128::size; k++) gn_sum += (float)d[k] * (float)w[k] * (float)x[k] * s;
        }
        gn_sum = warp_reduce_sum(gn_sum);
        if (lane == 0) {
            row_rstd[r] = s;
            row_gn_mean[r] = gn_sum / C;
        }
    }
    __syncthreads();

    // phase 2: dinp, and this block's dweight partials
    const int chunks = C / x128::size;
    const int slices = chunks >= (int)blockDim.x ? 1 : blockDim.x / chunks;
    float* block_partials = partials + (size_t)blockIdx.x * C;
    for (int slot = threadIdx.x; slot < slices * chunks; slot += blockDim.x) {
        const int slice = slot / chunks;
        const int c = (slot % chunks) * x128::size;
        const x128 w = load128(weight + c);
        float dweight_sum[x128::size];
        for (int k = 0; k < x128::size; k++) dweight_sum[k] = 0.0f;
        for (int r = slice; r < rows; r += slices) {
            const size_t offset = (size_t)(first_row + r) * C + c;
            const x128 d = load128cs(dout + offset);
            const x128 x = load128cs(inp + offset);
            const x128 old_dinp = load128cs(dinp + offset);
            const float s = row_rstd[r], gn_mean = row_gn_mean[r];
            x128 new_dinp;
            for (int k = 0; k < x128::size; k++) {
                const float n = (float)x[k] * s;
                const float g = (float)d[k] * (float)w[k];
                new_dinp[k] = (floatX)((float)old_dinp[k] + s * (g - n * gn_mean));
                dweight_sum[k] += (float)d[k] * n;
            }
            store128(dinp + offset, new_dinp);
        }
        if (slices == 1) {
            for (int k = 0; k < x128::size; k += f128::size) {
                f128 dw;
                for (int j = 0; j < f128::size; j++) dw[j] = dweight_sum[k + j];
                store128(block_partials + c + k, dw);
            }
        } else {
            float* mine = slice_sums + (size_t)slot * x128::size;
            for (int k = 0; k < x128::size; k++) mine[k] = dweight_sum[k];
        }
    }
    if (slices == 1) return;  // uniform over the block: no thread is left at the barrier below
    __syncthreads();
    for (int chunk = threadIdx.x; chunk < chunks; chunk += blockDim.x) {
        float sum[x128::size];
        for (int k = 0; k < x128::size; k++) sum[k] = 0.0f;
        for (int slice = 0; slice < slices; slice++) {
            const float* theirs = slice_sums + ((size_t)slice * chunks + chunk) * x128::size;
            for (int k = 0; k < x128::size; k++) sum[k] += theirs[k];
        }
        const int c = chunk * x128::size;
        for (int k = 0; k < x128::size; k += f128::size) {
            f128 dw;
            for (int j = 0; j < f128::size; j++) dw[j] = sum[k + j];
            store128(block_partials + c + k, dw);
        }
    }
}

void rmsnorm_backward_launch(floatX* dinp, floatX* dweight, float* scratch, const floatX* dout, const floatX* inp,
                             const floatX* weight, const float* rstd, int N, int C, int block_size,
                             cudaStream_t stream) {
    const int blocks = CEIL_DIV(N, RMSNORM_BACKWARD_ROWS);
    const size_t shared_bytes = rmsnorm_backward_shared_bytes(C, block_size);
    if (shared_bytes > 48 * 1024) {
        cudaCheck(cudaFuncSetAttribute(rmsnorm_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)shared_bytes));
    }
    rmsnorm_backward_kernel<<<blocks, block_size, shared_bytes, stream>>>(dinp, scratch, dout, inp, weight, rstd, N,
                                                                         C);
    cudaCheck(cudaGetLastError());
    if (dweight != nullptr)  // NULL: a frozen norm's, whose partials are left unsummed
        block_partials_accumulate(dweight, nullptr, scratch, blocks, C, stream);
}

// dinp (B,T,C) +=; dweight (C) +=; scratch holds rmsnorm_backward_scratch_floats(B, T, C) floats
void rmsnorm_backward(floatX* dinp, floatX* dweight, float* scratch, const floatX* dout, const floatX* inp,
                      const floatX* weight, const float* rstd, int B, int T, int C, cudaStream_t stream) {
    rmsnorm_backward_launch(dinp, dweight, scratch, dout, inp, weight, rstd, B * T, C, RMSNORM_BACKWARD_BLOCK_SIZE,
                            stream);
}

// ----------------------------------------------------------------------------------------------------
// The sizes and eps the rmsnorm kernels support; false with a one-line reason otherwise. Called by a trainer at
// start-up.
bool rmsnorm_support(int C, float eps, char* why, size_t why_size) {
    if (C <= 0 || C % 8 != 0) {
        snprintf(why, why_size, "C = %d: the rmsnorm kernels need C a positive multiple of 8 (16-byte vectors of 8 bf16)", C);
        return false;
    }
    if (!(eps > 0.0f) || isinf(eps)) {
        snprintf(why, why_size, "eps = %g: rmsnorm needs a finite eps > 0 (an all-zero row would divide by zero)", eps);
        return false;
    }
    return true;
}
