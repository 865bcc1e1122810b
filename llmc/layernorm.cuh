// llmc/layernorm.cuh: LayerNorm forward (plain, and fused with the residual add that precedes it) and
// backward, and the residual add alone, eps = 1e-5, statistics in fp32. Included by the trainers and by the kernel lab
// (dev/cuda/layernorm_forward.cu, dev/cuda/layernorm_backward.cu; e.g. `make build/lab/layernorm_forward_bf16 &&
// build/lab/layernorm_forward_bf16 -s`).
// Size constraint: C % 8 == 0 (rows are moved as 16-byte vectors); the trainer checks it at start-up
// through layernorm_support. Any number of rows, any C otherwise.
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-layernorm_forward_{bf16,fp32},
// lab-layernorm_backward_{bf16,fp32} and their lab-check- twins; gpt-* and moe-*.
#pragma once
#include "common.cuh"

#define LAYERNORM_EPS 1e-5f

// ----------------------------------------------------------------------------------------------------
// Forward: one warp per row; each lane owns the 8-channel chunks lane, lane+32, ... of the row.
// Floor: read N*C and write N*C floatX, plus 8 bytes of statistics per row (weight and bias, 2*C, stay in
// L1/L2): DRAM bytes = 2*N*C*sizeof(floatX) + 8*N; ~8 flops per element: memory-bound.
// The row is read three times (mean, centred variance, output): the second and third reads are served by
// L1 (a row is 1.5 KiB at C = 768), and the two-pass variance avoids the cancellation of E[x^2] - mean^2.

// mean and rstd of the row x (C), reduced over the warp; every lane gets them
__device__ inline void layernorm_row_statistics(const floatX* x, int C, float* mean, float* rstd) {
    const int lane = threadIdx.x % 32;
    float sum = 0.0f;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 v = load128(x + c);
        for (int k = 0; k < x128::size; k++) sum += (float)v[k];
    }
    const float m = warp_reduce_sum(sum) / C;
    float squares = 0.0f;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 v = load128(x + c);
        for (int k = 0; k < x128::size; k++) {
            float centred = (float)v[k] - m;
            squares += centred * centred;
        }
    }
    *mean = m;
    *rstd = rsqrtf(warp_reduce_sum(squares) / C + LAYERNORM_EPS);
}

// out = (x - mean) * rstd * weight + bias for the row x, by this lane's chunks
__device__ inline void layernorm_row_output(floatX* out, const floatX* x, const floatX* weight,
                                            const floatX* bias, int C, float mean, float rstd) {
    const int lane = threadIdx.x % 32;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 v = load128cs(x + c);
        x128 w = load128(weight + c);
        x128 b = load128(bias + c);
        x128 result;
        for (int k = 0; k < x128::size; k++) {
            result[k] = (floatX)(((float)v[k] - mean) * rstd * (float)w[k] + (float)b[k]);
        }
        store128(out + c, result);
    }
}

__global__ void layernorm_forward_kernel(floatX* __restrict__ out, float* __restrict__ mean,
                                         float* __restrict__ rstd, const floatX* __restrict__ inp,
                                         const floatX* __restrict__ weight, const floatX* __restrict__ bias, int N,
                                         int C) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= N) return;  // the whole warp leaves together: no shuffle loses a lane
    const floatX* x = inp + (size_t)row * C;
    float row_mean, row_rstd;
    layernorm_row_statistics(x, C, &row_mean, &row_rstd);
    layernorm_row_output(out + (size_t)row * C, x, weight, bias, C, row_mean, row_rstd);
    if (threadIdx.x % 32 == 0) {
        if (mean != nullptr) mean[row] = row_mean;
        if (rstd != nullptr) rstd[row] = row_rstd;
    }
}

// residual = inp1 + inp2 (rounded to floatX), normed = layernorm(residual): the statistics are those of the
// rounded residual, exactly what a separate add followed by layernorm_forward would see.
// Floor: read 2*N*C, write 2*N*C floatX, plus 8*N: DRAM bytes = 4*N*C*sizeof(floatX) + 8*N.
__global__ void fused_residual_layernorm_forward_kernel(floatX* __restrict__ residual, floatX* __restrict__ normed,
                                                        float* __restrict__ mean, float* __restrict__ rstd,
                                                        const floatX* __restrict__ inp1,
                                                        const floatX* __restrict__ inp2,
                                                        const floatX* __restrict__ weight,
                                                        const floatX* __restrict__ bias, int N, int C) {
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
    float row_mean, row_rstd;
    layernorm_row_statistics(x, C, &row_mean, &row_rstd);
    layernorm_row_output(normed + offset, x, weight, bias, C, row_mean, row_rstd);
    if (lane == 0) {
        if (mean != nullptr) mean[row] = row_mean;
        if (rstd != nullptr) rstd[row] = row_rstd;
    }
}

void layernorm_forward_launch(floatX* out, float* mean, float* rstd, const floatX* inp, const floatX* weight,
                              const floatX* bias, int N, int C, int block_size, cudaStream_t stream) {
    const int grid = CEIL_DIV(N, block_size / 32);
    layernorm_forward_kernel<<<grid, block_size, 0, stream>>>(out, mean, rstd, inp, weight, bias, N, C);
    cudaCheck(cudaGetLastError());
}

// out (B,T,C); mean, rstd (B,T) fp32, either may be nullptr
void layernorm_forward(floatX* out, float* mean, float* rstd, const floatX* inp, const floatX* weight,
                       const floatX* bias, int B, int T, int C, cudaStream_t stream) {
    layernorm_forward_launch(out, mean, rstd, inp, weight, bias, B * T, C, 256, stream);
}

void fused_residual_layernorm_forward_launch(floatX* residual, floatX* normed, float* mean, float* rstd,
                                             const floatX* inp1, const floatX* inp2, const floatX* weight,
                                             const floatX* bias, int N, int C, int block_size,
                                             cudaStream_t stream) {
    const int grid = CEIL_DIV(N, block_size / 32);
    fused_residual_layernorm_forward_kernel<<<grid, block_size, 0, stream>>>(residual, normed, mean, rstd, inp1,
                                                                             inp2, weight, bias, N, C);
    cudaCheck(cudaGetLastError());
}

// residual (N,C) = inp1 + inp2; normed (N,C) = layernorm(residual); mean, rstd (N), either may be nullptr
void fused_residual_layernorm_forward(floatX* residual, floatX* normed, float* mean, float* rstd,
                                      const floatX* inp1, const floatX* inp2, const floatX* weight,
                                      const floatX* bias, int N, int C, cudaStream_t stream) {
    fused_residual_layernorm_forward_launch(residual, normed, mean, rstd, inp1, inp2, weight, bias, N, C, 256,
                                            stream);
}

// ----------------------------------------------------------------------------------------------------
// Backward. With n = (x - mean) * rstd and g = dout * weight:
//   dinp += rstd * (g - mean_c(g) - n * mean_c(g * n)),  dweight += sum_rows dout * n,  dbias += sum_rows dout.
// Deterministic: each block owns LAYERNORM_BACKWARD_ROWS consecutive rows and writes its own partial
// dweight/dbias row to scratch (no atomics); common.cuh's block_partials_accumulate adds the partials in block order.
// Floor: read dout, inp and dinp, write dinp (4*N*C floatX) plus mean and rstd (8*N):
// DRAM bytes = 4*N*C*sizeof(floatX) + 8*N; the partials add 2 * (N/32) * 2C * 4 bytes (written, then read
// back), 1/32 of the floor in fp32 and 1/16 in bf16. ~14 flops per element: memory-bound.
//
// Within a block: phase 1, one warp per row, reduces mean_c(g) and mean_c(g*n) into shared memory; phase 2
// gives each thread one 8-channel chunk of a "slice" of the rows (rows s, s+S, ... with S = how many copies
// of the C/8 chunks fit in the block), where it writes dinp and accumulates dweight/dbias in registers;
// the slices are then added in slice order. dout and inp are read twice per block, the second time from L1.

#define LAYERNORM_BACKWARD_ROWS 32        // rows per block: the partials cost 1/ROWS of the floor
#define LAYERNORM_BACKWARD_BLOCK_SIZE 256

size_t layernorm_backward_scratch_floats(int B, int T, int C) {
    return (size_t)CEIL_DIV(B * T, LAYERNORM_BACKWARD_ROWS) * 2 * C;
}

// dynamic shared memory of the main kernel: the slices' partial sums, 16 floats per chunk slot
static size_t layernorm_backward_shared_bytes(int C, int block_size) {
    const int chunks = C / x128::size;
    const int slices = chunks >= block_size ? 1 : block_size / chunks;
    return slices > 1 ? (size_t)slices * chunks * 2 * x128::size * sizeof(float) : 0;
}

__global__ void layernorm_backward_kernel(floatX* __restrict__ dinp, float* __restrict__ partials,
                                          const floatX* __restrict__ dout, const floatX* __restrict__ inp,
                                          const floatX* __restrict__ weight, const float* __restrict__ mean,
                                          const float* __restrict__ rstd, int N, int C) {
    extern __shared__ float slice_sums[];  // (slices, C/8, 2, 8): dweight then dbias per chunk
    __shared__ float row_mean[LAYERNORM_BACKWARD_ROWS];
    __shared__ float row_rstd[LAYERNORM_BACKWARD_ROWS];
    __shared__ float row_g_mean[LAYERNORM_BACKWARD_ROWS];   // mean_c(dout * weight)
    __shared__ float row_gn_mean[LAYERNORM_BACKWARD_ROWS];  // mean_c(dout * weight * n)
    const int first_row = blockIdx.x * LAYERNORM_BACKWARD_ROWS;
    const int rows = min(LAYERNORM_BACKWARD_ROWS, N - first_row);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int warps = blockDim.x / 32;

    // phase 1: per-row reductions
    for (int r = warp; r < rows; r += warps) {
        const size_t offset = (size_t)(first_row + r) * C;
        const float m = mean[first_row + r];
        const float s = rstd[first_row + r];
        float g_sum = 0.0f, gn_sum = 0.0f;
        for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
            x128 d = load128(dout + offset + c);
            x128 x = load128(inp + offset + c);
            x128 w = load128(weight + c);
            for (int k = 0; k < x128::size; k++) {
                float g = (float)d[k] * (float)w[k];
                g_sum += g;
                gn_sum += g * ((float)x[k] - m) * s;
            }
        }
        g_sum = warp_reduce_sum(g_sum);
        gn_sum = warp_reduce_sum(gn_sum);
        if (lane == 0) {
            row_mean[r] = m;
            row_rstd[r] = s;
            row_g_mean[r] = g_sum / C;
            row_gn_mean[r] = gn_sum / C;
        }
    }
    __syncthreads();

    // phase 2: dinp, and this block's dweight/dbias partials
    const int chunks = C / x128::size;
    const int slices = chunks >= (int)blockDim.x ? 1 : blockDim.x / chunks;
    float* block_partials = partials + (size_t)blockIdx.x * 2 * C;  // (2, C): dweight then dbias
    for (int slot = threadIdx.x; slot < slices * chunks; slot += blockDim.x) {
        const int slice = slot / chunks;
        const int c = (slot % chunks) * x128::size;
        const x128 w = load128(weight + c);
        float dweight_sum[x128::size], dbias_sum[x128::size];
        for (int k = 0; k < x128::size; k++) dweight_sum[k] = dbias_sum[k] = 0.0f;
        for (int r = slice; r < rows; r += slices) {
            const size_t offset = (size_t)(first_row + r) * C + c;
            const x128 d = load128cs(dout + offset);
            const x128 x = load128cs(inp + offset);
            const x128 old_dinp = load128cs(dinp + offset);
            const float m = row_mean[r], s = row_rstd[r], g_mean = row_g_mean[r], gn_mean = row_gn_mean[r];
            x128 new_dinp;
            for (int k = 0; k < x128::size; k++) {
                const float n = ((float)x[k] - m) * s;
                const float g = (float)d[k] * (float)w[k];
                new_dinp[k] = (floatX)((float)old_dinp[k] + s * (g - g_mean - n * gn_mean));
                dweight_sum[k] += (float)d[k] * n;
                dbias_sum[k] += (float)d[k];
            }
            store128(dinp + offset, new_dinp);
        }
        if (slices == 1) {
            for (int k = 0; k < x128::size; k += f128::size) {
                f128 dw, db;
                for (int j = 0; j < f128::size; j++) {
                    dw[j] = dweight_sum[k + j];
                    db[j] = dbias_sum[k + j];
                }
                store128(block_partials + c + k, dw);
                store128(block_partials + C + c + k, db);
            }
        } else {
            float* mine = slice_sums + (size_t)slot * 2 * x128::size;
            for (int k = 0; k < x128::size; k++) {
                mine[k] = dweight_sum[k];
                mine[x128::size + k] = dbias_sum[k];
            }
        }
    }
    if (slices == 1) return;  // uniform over the block: no thread is left at the barrier below
    __syncthreads();
    for (int chunk = threadIdx.x; chunk < chunks; chunk += blockDim.x) {
        float sum[2 * x128::size];
        for (int k = 0; k < 2 * x128::size; k++) sum[k] = 0.0f;
        for (int slice = 0; slice < slices; slice++) {
            const float* theirs = slice_sums + ((size_t)slice * chunks + chunk) * 2 * x128::size;
            for (int k = 0; k < 2 * x128::size; k++) sum[k] += theirs[k];
        }
        const int c = chunk * x128::size;
        for (int k = 0; k < x128::size; k += f128::size) {
            f128 dw, db;
            for (int j = 0; j < f128::size; j++) {
                dw[j] = sum[k + j];
                db[j] = sum[x128::size + k + j];
            }
            store128(block_partials + c + k, dw);
            store128(block_partials + C + c + k, db);
        }
    }
}

void layernorm_backward_launch(floatX* dinp, floatX* dweight, floatX* dbias, float* scratch, const floatX* dout,
                               const floatX* inp, const floatX* weight, const float* mean, const float* rstd, int N,
                               int C, int block_size, cudaStream_t stream) {
    const int blocks = CEIL_DIV(N, LAYERNORM_BACKWARD_ROWS);
    const size_t shared_bytes = layernorm_backward_shared_bytes(C, block_size);
    if (shared_bytes > 48 * 1024) {
        cudaCheck(cudaFuncSetAttribute(layernorm_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)shared_bytes));
    }
    layernorm_backward_kernel<<<blocks, block_size, shared_bytes, stream>>>(dinp, scratch, dout, inp, weight, mean,
                                                                           rstd, N, C);
    cudaCheck(cudaGetLastError());
    if (dweight != nullptr)  // NULL: a frozen norm's, whose partials are left unsummed
        block_partials_accumulate(dweight, dbias, scratch, blocks, C, stream);
}

// dinp (B,T,C) +=; dweight, dbias (C) +=; scratch holds layernorm_backward_scratch_floats(B, T, C) floats
void layernorm_backward(floatX* dinp, floatX* dweight, floatX* dbias, float* scratch, const floatX* dout,
                        const floatX* inp, const floatX* weight, const float* mean, const float* rstd, int B, int T,
                        int C, cudaStream_t stream) {
    layernorm_backward_launch(dinp, dweight, dbias, scratch, dout, inp, weight, mean, rstd, B * T, C,
                              LAYERNORM_BACKWARD_BLOCK_SIZE, stream);
}

// ----------------------------------------------------------------------------------------------------
// The residual add alone, out = a + b over n values (out may be a or b): a pipeline stage's output, whose final norm
// is the next stage's, and a sum of two gradients. Floor: read 2n and write n floatX: memory-bound, one add each.
__global__ void residual_forward_kernel(floatX* out, const floatX* a, const floatX* b, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (floatX)((float)a[i] + (float)b[i]);
}
void residual_forward(floatX* out, const floatX* a, const floatX* b, size_t n, cudaStream_t stream) {
    const int block_size = 256;
    residual_forward_kernel<<<(unsigned int)CEIL_DIV(n, (size_t)block_size), block_size, 0, stream>>>(out, a, b, n);
    cudaCheck(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------
// The sizes the layernorm kernels support; false with a one-line reason otherwise. Called by the trainers at start-up.
bool layernorm_support(int C, char* why, size_t why_size) {
    if (C <= 0 || C % 8 != 0) {
        snprintf(why, why_size, "C = %d: the layernorm kernels need C a positive multiple of 8 (16-byte vectors of 8 bf16)", C);
        return false;
    }
    return true;
}
