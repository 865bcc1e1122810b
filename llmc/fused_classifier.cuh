// llmc/fused_classifier.cuh: softmax + cross-entropy loss + its gradient over the logits, in one kernel that
// never materialises the probabilities; also fused_classifier_support, its start-up size check. Then the
// vocabulary-parallel classifier (tensor parallelism: each process holds a slice of every row's columns): three
// kernels around the caller's two all-reduces of per-row statistics, and vocab_parallel_classifier_support.
// Included by the trainers. Labs:
//   dev/cuda/fused_classifier.cu           `make build/lab/fused_classifier_bf16 && build/lab/fused_classifier_bf16 -s`
//   dev/cuda/vocab_parallel_classifier.cu  `make build/lab/vocab_parallel_classifier_bf16 &&
//                                           build/lab/vocab_parallel_classifier_bf16 -s`
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-fused_classifier_{bf16,fp32},
// lab-vocab_parallel_classifier_{bf16,fp32} and their lab-check- twins; gpt-* and moe-* (logits, loss and their
// gradient against PyTorch).
#pragma once
#include "common.cuh"

// ----------------------------------------------------------------------------------------------------
// One block per row of logits (Vp floatX, the first V real). Pass 1 keeps, per thread, a running maximum
// and a sum of exponentials rescaled whenever the maximum grows (online softmax), reduced over the block;
// pass 2 reads the row again and overwrites it with dloss * (softmax - onehot(target)), zeros past V.
// Floor: the row is read from DRAM once (pass 1 leaves it in L2 for pass 2: a 1024-thread block holds
// ~100 KiB of rows in flight at V = 50257) and written once: DRAM bytes = 2*N*Vp*sizeof(floatX) + 8*N
// (targets, losses), N*Vp*sizeof(floatX) + 8*N without the gradient; ~10 flops per element: memory-bound.
// Targets must lie in [0, V), or be -1: a masked target (a loss mask, doc/formats.md), whose loss and gradient row are
// 0 (its row is only written).

// This thread's running maximum and sum of exponentials over its 16-byte vectors of the row's first `real` values
// (online softmax: the sum rescaled whenever the maximum grows); `keep_cached`: a second pass reads the row soon.
__device__ inline void thread_online_softmax(const floatX* x, int real, bool keep_cached, float* thread_max,
                                             float* thread_sum) {
    const int stride = blockDim.x * x128::size;
    float running_max = -INFINITY, running_sum = 0.0f;
    for (int c = threadIdx.x * x128::size; c < real; c += stride) {
        x128 v = keep_cached ? load128(x + c) : load128cs(x + c);
        float chunk_max = -INFINITY;
        for (int k = 0; k < x128::size; k++) {
            if (c + k < real) chunk_max = fmaxf(chunk_max, (float)v[k]);
        }
        const float new_max = fmaxf(running_max, chunk_max);
        running_sum *= __expf(running_max - new_max);
        for (int k = 0; k < x128::size; k++) {
            if (c + k < real) running_sum += __expf((float)v[k] - new_max);
        }
        running_max = new_max;
    }
    *thread_max = running_max;
    *thread_sum = running_sum;
}

// Overwrites the row's `columns` values with dloss * (softmax - onehot(target)) from its maximum and the inverse of its
// sum of exponentials; 0 from column `real` on (padding).
__device__ inline void write_softmax_gradient(floatX* x, int columns, int real, int target, float row_max,
                                              float inverse_sum, float dloss) {
    const int stride = blockDim.x * x128::size;
    for (int c = threadIdx.x * x128::size; c < columns; c += stride) {
        x128 v = load128cs(x + c);
        x128 gradient;
        for (int k = 0; k < x128::size; k++) {
            const int column = c + k;
            const float probability = __expf((float)v[k] - row_max) * inverse_sum;
            const float indicator = column == target ? 1.0f : 0.0f;
            gradient[k] = (floatX)(column < real ? dloss * (probability - indicator) : 0.0f);
        }
        store128(x + c, gradient);
    }
}

// A masked target's row (target -1): loss 0, and with write_dlogits a gradient of 0 over the `columns`. Every thread of
// the block takes this branch or none.
__device__ inline void masked_target_row(floatX* x, float* loss, int columns, bool write_dlogits) {
    if (threadIdx.x == 0) *loss = 0.0f;
    if (!write_dlogits) return;
    x128 zeros;
    for (int k = 0; k < x128::size; k++) zeros[k] = (floatX)0.0f;
    for (int c = threadIdx.x * x128::size; c < columns; c += blockDim.x * x128::size) store128(x + c, zeros);
}

__global__ void fused_classifier_kernel(floatX* __restrict__ logits, float* __restrict__ losses, float dloss,
                                        const int* __restrict__ targets, int V, int Vp, bool write_dlogits) {
    floatX* x = logits + (size_t)blockIdx.x * Vp;
    const int target = targets[blockIdx.x];
    if (target < 0) {
        masked_target_row(x, &losses[blockIdx.x], Vp, write_dlogits);
        return;
    }

    // read before any thread of the block can overwrite the row (the reductions below are barriers)
    float target_logit = 0.0f;
    if (threadIdx.x == 0) target_logit = (float)x[target];

    float thread_max, thread_sum;
    thread_online_softmax(x, V, true, &thread_max, &thread_sum);  // cached: pass 2 reads the row again
    const float row_max = block_reduce<warp_reduce_max>(thread_max, true, -INFINITY);
    // a thread that saw no element has max -inf and sum 0: exp(-inf) = 0 keeps it at 0
    const float row_sum = block_reduce<warp_reduce_sum>(thread_sum * __expf(thread_max - row_max));
    if (threadIdx.x == 0) losses[blockIdx.x] = row_max + logf(row_sum) - target_logit;
    if (!write_dlogits) return;
    write_softmax_gradient(x, Vp, V, target, row_max, 1.0f / row_sum, dloss);
}

void fused_classifier_launch(floatX* logits, float* losses, float dloss, const int* targets, int B, int T, int V,
                             int Vp, bool write_dlogits, int block_size, cudaStream_t stream) {
    fused_classifier_kernel<<<B * T, block_size, 0, stream>>>(logits, losses, dloss, targets, V, Vp,
                                                              write_dlogits);
    cudaCheck(cudaGetLastError());
}

// The block of a one-block-per-row classifier kernel over rows of `columns` floatX: 1024 threads hide the latency of a
// 50k-column row; a small vocabulary gets one thread per vector.
static int classifier_block_size(int columns) {
    const int warps_for_row = CEIL_DIV(CEIL_DIV(columns, x128::size), 32);
    return warps_for_row < 32 ? 32 * warps_for_row : 1024;
}

// logits (B,T,Vp), first V columns real; losses (B,T) = -log softmax(logits[b,t,:V])[targets[b,t]];
// with write_dlogits, logits become dloss * (softmax - onehot(target)), 0 in the padding columns; a target of -1
// (masked) gives loss 0 and a gradient row of 0
void fused_classifier(floatX* logits, float* losses, float dloss, const int* targets, int B, int T, int V, int Vp,
                      bool write_dlogits, cudaStream_t stream) {
    const int block_size = classifier_block_size(Vp);
    fused_classifier_launch(logits, losses, dloss, targets, B, T, V, Vp, write_dlogits, block_size, stream);
}

// ----------------------------------------------------------------------------------------------------
// The sizes the classifier supports; false with a one-line reason otherwise. Called by the trainers at start-up.
bool fused_classifier_support(int V, int Vp, char* why, size_t why_size) {
    if (V <= 0 || Vp < V) {
        snprintf(why, why_size, "V = %d, Vp = %d: the classifier needs 0 < V <= Vp", V, Vp);
        return false;
    }
    if (Vp % 8 != 0) {
        snprintf(why, why_size, "Vp = %d: the classifier needs Vp a multiple of 8 (16-byte aligned rows)", Vp);
        return false;
    }
    return true;
}

// ----------------------------------------------------------------------------------------------------
// The vocabulary-parallel classifier (tensor parallelism over N processes). Each process holds a slice of the logits,
// (rows, Vs) with Vs = Vp / N, whose local column j is global column v0 + j (v0 = rank * Vs); global columns >= V are
// padding. The row's softmax needs the maximum and the sum of exponentials over all slices, so the two passes of
// fused_classifier_kernel become three kernels with the caller's all-reduces between them:
//   vocab_parallel_classifier_stats     per row: the slice's max, its sum of exp(logit - its max), the target's logit
//   (caller: ncclMax over stats[0, rows))
//   vocab_parallel_classifier_rescale   the slice's sum rescaled to the row max
//   (caller: ncclSum over stats[2 rows, 4 rows): the sums and the target logits, one all-reduce)
//   vocab_parallel_classifier_finish    the loss (the same on every process) and, in place, the slice's gradient
// stats (4, rows) floats, four arrays of `rows`: [0] the row max (the slice's until the ncclMax), [1] the slice's own
// max, [2] the slice's sum of exponentials over its real columns, [3] the target's logit if the slice holds it, else 0.
// A slice without a real column has own max -inf and sum 0, and keeps sum 0 through the rescale.
// Floor, per process, with R = rows: the all-reduces between the passes evict the slice from L2 (a slice at GPT-2
// 124M sizes, R = 8192 and Vs = 25152, is 412 MB in bf16), so the slice is read from DRAM twice, not once as in
// fused_classifier_kernel, and written once:
//   stats   R*Vs*sizeof(floatX) + 20*R bytes (targets in, four stats out), ~6 flops per element
//   rescale 16*R bytes
//   finish  2*R*Vs*sizeof(floatX) + 20*R bytes (three stats and targets in, losses out), ~6 flops per element;
//           16*R without the gradient
// 3*R*Vs*sizeof(floatX) + 56*R bytes in all: memory-bound, 1.5 times fused_classifier_kernel's bytes per element, on
// 1/N of the columns. Targets must lie in [0, V), or be -1 (masked: loss 0, gradient row 0, as fused_classifier's).

// the slice's real columns are [0, real): none past V
__device__ inline int vocab_parallel_real_columns(int Vs, int v0, int V) { return max(0, min(Vs, V - v0)); }

__global__ void vocab_parallel_classifier_stats_kernel(float* __restrict__ stats, const floatX* __restrict__ logits,
                                                       const int* __restrict__ targets, int rows, int Vs, int v0,
                                                       int V) {
    const int row = blockIdx.x;
    const floatX* x = logits + (size_t)row * Vs;
    const int real = vocab_parallel_real_columns(Vs, v0, V);
    // the finish kernel reads the row again only after the all-reduces: streaming
    float thread_max, thread_sum;
    thread_online_softmax(x, real, false, &thread_max, &thread_sum);
    const float slice_max = block_reduce<warp_reduce_max>(thread_max, true, -INFINITY);
    // a thread that saw an element has a sum >= 1; one that saw none has max -inf and sum 0, and so has every thread
    // of a slice without a real column, where exp(-inf - -inf) would be NaN: it adds 0
    const float slice_sum =
        block_reduce<warp_reduce_sum>(thread_sum > 0.0f ? thread_sum * __expf(thread_max - slice_max) : 0.0f);
    if (threadIdx.x != 0) return;
    const int target = targets[row] - v0;  // local column, outside [0, real) when another slice holds it
    stats[row] = slice_max;
    stats[rows + row] = slice_max;
    stats[2 * rows + row] = slice_sum;
    stats[3 * rows + row] = target >= 0 && target < real ? (float)x[target] : 0.0f;
}

// one thread per row
__global__ void vocab_parallel_classifier_rescale_kernel(float* __restrict__ stats, int rows) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const float sum = stats[2 * rows + row];
    // a slice without a real column (sum 0, own max -inf) stays 0 whatever the row max
    stats[2 * rows + row] = sum > 0.0f ? sum * __expf(stats[rows + row] - stats[row]) : 0.0f;
}

__global__ void vocab_parallel_classifier_finish_kernel(floatX* __restrict__ logits, float* __restrict__ losses,
                                                        const float* __restrict__ stats, float dloss,
                                                        const int* __restrict__ targets, int rows, int Vs, int v0,
                                                        int V, bool write_dlogits) {
    const int row = blockIdx.x;
    floatX* x = logits + (size_t)row * Vs;
    if (targets[row] < 0) {
        masked_target_row(x, &losses[row], Vs, write_dlogits);
        return;
    }
    const float row_max = stats[row], row_sum = stats[2 * rows + row];
    // the target logit comes from the stats (read before any process overwrote its slice), not from the row
    if (threadIdx.x == 0) losses[row] = row_max + logf(row_sum) - stats[3 * rows + row];
    if (!write_dlogits) return;

    write_softmax_gradient(x, Vs, vocab_parallel_real_columns(Vs, v0, V), targets[row] - v0, row_max, 1.0f / row_sum,
                           dloss);
}

void vocab_parallel_classifier_stats_launch(float* stats, const floatX* logits, const int* targets, int rows, int Vs,
                                            int v0, int V, int block_size, cudaStream_t stream) {
    vocab_parallel_classifier_stats_kernel<<<rows, block_size, 0, stream>>>(stats, logits, targets, rows, Vs, v0, V);
    cudaCheck(cudaGetLastError());
}

void vocab_parallel_classifier_finish_launch(floatX* logits, float* losses, const float* stats, float dloss,
                                             const int* targets, int rows, int Vs, int v0, int V, bool write_dlogits,
                                             int block_size, cudaStream_t stream) {
    vocab_parallel_classifier_finish_kernel<<<rows, block_size, 0, stream>>>(logits, losses, stats, dloss, targets,
                                                                             rows, Vs, v0, V, write_dlogits);
    cudaCheck(cudaGetLastError());
}

// stats (4, rows) from the slice logits (rows, Vs) and targets (rows) (global ids); the caller then all-reduces
// stats[0, rows) with ncclMax, in place
void vocab_parallel_classifier_stats(float* stats, const floatX* logits, const int* targets, int rows, int Vs, int v0,
                                     int V, cudaStream_t stream) {
    vocab_parallel_classifier_stats_launch(stats, logits, targets, rows, Vs, v0, V, classifier_block_size(Vs),
                                           stream);
}

// after the ncclMax: stats[2 rows + row] *= exp(own max - row max); the caller then all-reduces stats[2 rows, 4 rows)
// with ncclSum, in place
void vocab_parallel_classifier_rescale(float* stats, int rows, cudaStream_t stream) {
    const int block_size = 256;
    vocab_parallel_classifier_rescale_kernel<<<CEIL_DIV(rows, block_size), block_size, 0, stream>>>(stats, rows);
    cudaCheck(cudaGetLastError());
}

// after the ncclSum: losses (rows) = row max + log(sum) - target logit; with write_dlogits the slice logits (rows, Vs)
// become dloss * (softmax - onehot(target)) over their columns, 0 in the padding columns
void vocab_parallel_classifier_finish(floatX* logits, float* losses, const float* stats, float dloss,
                                      const int* targets, int rows, int Vs, int v0, int V, bool write_dlogits,
                                      cudaStream_t stream) {
    // without the gradient a block only writes its loss
    const int block_size = write_dlogits ? classifier_block_size(Vs) : 32;
    vocab_parallel_classifier_finish_launch(logits, losses, stats, dloss, targets, rows, Vs, v0, V, write_dlogits,
                                            block_size, stream);
}

// The sizes the vocabulary-parallel classifier supports over N processes; false with a one-line reason otherwise.
bool vocab_parallel_classifier_support(int V, int Vp, int N, char* why, size_t why_size) {
    if (!fused_classifier_support(V, Vp, why, why_size)) return false;
    if (N <= 0 || Vp % N != 0 || (Vp / N) % 8 != 0) {
        snprintf(why, why_size,
                 "Vp = %d over %d processes: the vocabulary-parallel classifier needs Vp / N a whole multiple of 8 "
                 "(16-byte aligned slice rows)", Vp, N);
        return false;
    }
    return true;
}
