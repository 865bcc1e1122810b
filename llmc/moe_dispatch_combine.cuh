// llmc/moe_dispatch_combine.cuh: the MoE layer's data movement: dispatch of token rows into the expert buffer,
// combine of the expert outputs weighted by the gates, and their backward passes, every output gathered by its one
// writer (no scatter-add, no atomics). Shapes, layouts and limits: llmc/moe_common.cuh; semantics: doc/moe.md,
// "Routing" 5.
// Lab: dev/cuda/moe_dispatch_combine.cu (e.g. `make build/lab/moe_dispatch_combine_bf16 &&
// build/lab/moe_dispatch_combine_bf16 -s`).
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-moe_dispatch_combine_{bf16,fp32} and their lab-check- twins;
// moe-* and check-moe-* (the layer's output and gradients against PyTorch).
#pragma once
#include "moe_common.cuh"

// ----------------------------------------------------------------------------------------------------
// Dispatch, gathered: one warp per row of expert_input (R rows); a used row copies its token's row of x, a
// padding row is written with zeros (so it adds nothing to the experts' weight gradients).
// Floor: read (kept rows)*C and write R*C floatX (a token chosen k times is read k times; k <= 2 in practice
// and the second read hits L2): bytes <= (N*k + R)*C*sizeof(floatX) + R*4.
__global__ void moe_dispatch_kernel(floatX* __restrict__ expert_input, const floatX* __restrict__ x,
                                    const int* __restrict__ row_choice, int num_rows, int k, int C) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= num_rows) return;
    const int lane = threadIdx.x % 32;
    const int choice = row_choice[row];
    floatX* destination = expert_input + (size_t)row * C;
    if (choice < 0) {
        for (int c = lane * x128::size; c < C; c += 32 * x128::size) store128(destination + c, x128::zeros());
        return;
    }
    const floatX* source = x + (size_t)(choice / k) * C;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) store128(destination + c, load128(source + c));
}

// Combine, gathered per token: one warp per token, out[t] = sum over kept j of gates[t,j] * expert_output[row],
// added in fp32 in the order j = 0..k-1 and rounded to floatX once; a token whose choices were all dropped gets 0.
// Floor: read (kept rows)*C floatX, write N*C floatX, plus N*k*8 bytes of routing.
__global__ void moe_combine_kernel(floatX* __restrict__ out, const floatX* __restrict__ expert_output,
                                   const int* __restrict__ choice_row, const float* __restrict__ gates, int N, int k,
                                   int C) {
    const int token = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (token >= N) return;
    const int lane = threadIdx.x % 32;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        float sum[x128::size];
        for (int i = 0; i < x128::size; i++) sum[i] = 0.0f;
        for (int j = 0; j < k; j++) {
            const int choice = token * k + j;
            const int row = choice_row[choice];
            if (row < 0) continue;
            const float gate = gates[choice];
            const x128 v = load128cs(expert_output + (size_t)row * C + c);
            for (int i = 0; i < x128::size; i++) sum[i] += gate * (float)v[i];
        }
        x128 result;
        for (int i = 0; i < x128::size; i++) result[i] = (floatX)sum[i];
        store128(out + (size_t)token * C + c, result);
    }
}

// Combine backward, gathered per expert row: warp w < R owns row w; a used row (choice t*k+j) writes
// d_expert_output = gate * dout[t] and d_gates[t, j] = <dout[t], expert_output[row]> (fp32, warp-reduced); a
// padding row writes zeros. Warp w < N*k also writes d_gates[w] = 0 if choice w was dropped (it has no row).
// The grid is max(R, N*k) warps. Floor: read 2*(kept rows)*C floatX (dout rows again from L2 for k >= 2),
// write R*C floatX, plus N*k*8 + R*4 bytes of routing.
__global__ void moe_combine_backward_kernel(floatX* __restrict__ d_expert_output, float* __restrict__ d_gates,
                                            const floatX* __restrict__ dout, const floatX* __restrict__ expert_output,
                                            const int* __restrict__ choice_row, const float* __restrict__ gates,
                                            const int* __restrict__ row_choice, int num_rows, int num_choices, int k,
                                            int C) {
    const int w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (w < num_choices && lane == 0 && choice_row[w] < 0) d_gates[w] = 0.0f;
    if (w >= num_rows) return;
    const int choice = row_choice[w];
    floatX* d_row = d_expert_output + (size_t)w * C;
    if (choice < 0) {
        for (int c = lane * x128::size; c < C; c += 32 * x128::size) store128(d_row + c, x128::zeros());
        return;
    }
    const float gate = gates[choice];
    const floatX* d_token = dout + (size_t)(choice / k) * C;
    const floatX* row = expert_output + (size_t)w * C;
    float dot = 0.0f;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        const x128 d = load128(d_token + c);
        const x128 v = load128cs(row + c);
        x128 result;
        for (int i = 0; i < x128::size; i++) {
            result[i] = (floatX)(gate * (float)d[i]);
            dot += (float)d[i] * (float)v[i];
        }
        store128(d_row + c, result);
    }
    dot = warp_reduce_sum(dot);
    if (lane == 0) d_gates[choice] = dot;
}

// Dispatch backward, gathered per token: dx[t] += sum over kept j of d_expert_input[row], added in fp32 to dx's
// value in the order j = 0..k-1, one rounding. Floor: read (kept rows)*C + N*C, write N*C floatX.
__global__ void moe_dispatch_backward_kernel(floatX* __restrict__ dx, const floatX* __restrict__ d_expert_input,
                                             const int* __restrict__ choice_row, int N, int k, int C) {
    const int token = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (token >= N) return;
    const int lane = threadIdx.x % 32;
    floatX* d_token = dx + (size_t)token * C;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        const x128 current = load128(d_token + c);
        float sum[x128::size];
        for (int i = 0; i < x128::size; i++) sum[i] = (float)current[i];
        for (int j = 0; j < k; j++) {
            const int choice = token * k + j;
            const int row = choice_row[choice];
            if (row < 0) continue;
            const x128 v = load128cs(d_expert_input + (size_t)row * C + c);
            for (int i = 0; i < x128::size; i++) sum[i] += (float)v[i];
        }
        x128 result;
        for (int i = 0; i < x128::size; i++) result[i] = (floatX)sum[i];
        store128(d_token + c, result);
    }
}

// ----------------------------------------------------------------------------------------------------
// host side

void moe_dispatch_launch(floatX* expert_input, const floatX* x, const int* row_choice, int num_rows, int k, int C,
                         int block_size, cudaStream_t stream) {
    moe_require(C % 8 == 0 && num_rows >= 1, "moe_dispatch", "needs C a multiple of 8 and at least one row");
    moe_require_aligned("moe_dispatch", expert_input, x, nullptr);
    moe_dispatch_kernel<<<moe_warp_grid(num_rows, block_size), block_size, 0, stream>>>(expert_input, x, row_choice,
                                                                                        num_rows, k, C);
    cudaCheck(cudaGetLastError());
}

// expert_input (num_rows, C) = x (N, C) rows by row_choice, zeros in padding rows
void moe_dispatch(floatX* expert_input, const floatX* x, const int* row_choice, int num_rows, int k, int C,
                  cudaStream_t stream) {
    moe_dispatch_launch(expert_input, x, row_choice, num_rows, k, C, MOE_WARP_KERNEL_BLOCK_SIZE, stream);
}

void moe_combine_launch(floatX* out, const floatX* expert_output, const int* choice_row, const float* gates, int N,
                        int k, int C, int block_size, cudaStream_t stream) {
    moe_require(C % 8 == 0, "moe_combine", "needs C a multiple of 8");
    moe_require_aligned("moe_combine", out, expert_output, nullptr);
    moe_combine_kernel<<<moe_warp_grid(N, block_size), block_size, 0, stream>>>(out, expert_output, choice_row, gates,
                                                                               N, k, C);
    cudaCheck(cudaGetLastError());
}

// out (N, C) = sum over kept choices of gate * expert_output[choice_row] (R, C); 0 if all dropped
void moe_combine(floatX* out, const floatX* expert_output, const int* choice_row, const float* gates, int N, int k,
                 int C, cudaStream_t stream) {
    moe_combine_launch(out, expert_output, choice_row, gates, N, k, C, MOE_WARP_KERNEL_BLOCK_SIZE, stream);
}

void moe_combine_backward_launch(floatX* d_expert_output, float* d_gates, const floatX* dout,
                                 const floatX* expert_output, const int* choice_row, const float* gates,
                                 const int* row_choice, int N, int num_rows, int k, int C, int block_size,
                                 cudaStream_t stream) {
    moe_require(C % 8 == 0 && num_rows >= 1, "moe_combine_backward", "needs C a multiple of 8 and at least one row");
    moe_require_aligned("moe_combine_backward", d_expert_output, dout, expert_output);
    const int num_choices = N * k;
    const int warps = num_rows > num_choices ? num_rows : num_choices;
    moe_combine_backward_kernel<<<moe_warp_grid(warps, block_size), block_size, 0, stream>>>(
        d_expert_output, d_gates, dout, expert_output, choice_row, gates, row_choice, num_rows, num_choices, k, C);
    cudaCheck(cudaGetLastError());
}

// d_expert_output (num_rows, C) = gate * dout[token] in used rows, 0 in padding rows;
// d_gates (N, k) = <dout[t], expert_output[choice_row]> for kept choices, 0 for dropped ones
void moe_combine_backward(floatX* d_expert_output, float* d_gates, const floatX* dout, const floatX* expert_output,
                          const int* choice_row, const float* gates, const int* row_choice, int N, int num_rows, int k,
                          int C, cudaStream_t stream) {
    moe_combine_backward_launch(d_expert_output, d_gates, dout, expert_output, choice_row, gates, row_choice, N,
                                num_rows, k, C, MOE_WARP_KERNEL_BLOCK_SIZE, stream);
}

void moe_dispatch_backward_launch(floatX* dx, const floatX* d_expert_input, const int* choice_row, int N, int k, int C,
                                  int block_size, cudaStream_t stream) {
    moe_require(C % 8 == 0, "moe_dispatch_backward", "needs C a multiple of 8");
    moe_require_aligned("moe_dispatch_backward", dx, d_expert_input, nullptr);
    moe_dispatch_backward_kernel<<<moe_warp_grid(N, block_size), block_size, 0, stream>>>(dx, d_expert_input,
                                                                                         choice_row, N, k, C);
    cudaCheck(cudaGetLastError());
}

// dx (N, C) += sum over kept choices of d_expert_input[choice_row] (R, C)
void moe_dispatch_backward(floatX* dx, const floatX* d_expert_input, const int* choice_row, int N, int k, int C,
                           cudaStream_t stream) {
    moe_dispatch_backward_launch(dx, d_expert_input, choice_row, N, k, C, MOE_WARP_KERNEL_BLOCK_SIZE, stream);
}
