// llmc/fused_classifier.cuh: softmax + cross-entropy loss + its gradient over the logits, in one kernel that
// never materialises the probabilities; also fused_classifier_support, its start-up size check.
// Included by the trainers and by
// dev/cuda/fused_classifier.cu (the kernel lab: `make build/lab/fused_classifier_bf16 && build/lab/fused_classifier_bf16 -s`).
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-fused_classifier_{bf16,fp32} and their lab-check- twins;
// gpt-* and moe-* (logits, loss and their gradient against PyTorch).
#pragma once
#include "common.cuh"

// ----------------------------------------------------------------------------------------------------
// One block per row of logits (Vp floatX, the first V real). Pass 1 keeps, per thread, a running maximum
// and a sum of exponentials rescaled whenever the maximum grows (online softmax), reduced over the block;
// pass 2 reads the row again and overwrites it with dloss * (softmax - onehot(target)), zeros past V.
// Floor: the row is read from DRAM once (pass 1 leaves it in L2 for pass 2: a 1024-thread block holds
// ~100 KiB of rows in flight at V = 50257) and written once: DRAM bytes = 2*N*Vp*sizeof(floatX) + 8*N
// (targets, losses), N*Vp*sizeof(floatX) + 8*N without the gradient; ~10 flops per element: memory-bound.
// Targets must lie in [0, V).

__global__ void fused_classifier_kernel(floatX* __restrict__ logits, float* __restrict__ losses, float dloss,
                                        const int* __restrict__ targets, int V, int Vp, bool write_dlogits) {
    floatX* x = logits + (size_t)blockIdx.x * Vp;
    const int target = targets[blockIdx.x];
    const int stride = blockDim.x * x128::size;

    // read before any thread of the block can overwrite the row (the reductions below are barriers)
    float target_logit = 0.0f;
    if (threadIdx.x == 0) target_logit = (float)x[target];

    float thread_max = -INFINITY, thread_sum = 0.0f;
    for (int c = threadIdx.x * x128::size; c < V; c += stride) {
        x128 v = load128(x + c);  // cached: pass 2 reads it again
        float chunk_max = -INFINITY;
        for (int k = 0; k < x128::size; k++) {
            if (c + k < V) chunk_max = fmaxf(chunk_max, (float)v[k]);
        }
        const float new_max = fmaxf(thread_max, chunk_max);
        thread_sum *= __expf(thread_max - new_max);
        for (int k = 0; k < x128::size; k++) {
            if (c + k < V) thread_sum += __expf((float)v[k] - new_max);
        }
        thread_max = new_max;
    }
    const float row_max = block_reduce<warp_reduce_max>(thread_max, true, -INFINITY);
    // a thread that saw no element has max -inf and sum 0: exp(-inf) = 0 keeps it at 0
    const float row_sum = block_reduce<warp_reduce_sum>(thread_sum * __expf(thread_max - row_max));
    if (threadIdx.x == 0) losses[blockIdx.x] = row_max + logf(row_sum) - target_logit;
    if (!write_dlogits) return;

    const float inverse_sum = 1.0f / row_sum;
    for (int c = threadIdx.x * x128::size; c < Vp; c += stride) {
        x128 v = load128cs(x + c);
        x128 gradient;
        for (int k = 0; k < x128::size; k++) {
            const int column = c + k;
            const float probability = __expf((float)v[k] - row_max) * inverse_sum;
            const float indicator = column == target ? 1.0f : 0.0f;
            gradient[k] = (floatX)(column < V ? dloss * (probability - indicator) : 0.0f);
        }
        store128(x + c, gradient);
    }
}

void fused_classifier_launch(floatX* logits, float* losses, float dloss, const int* targets, int B, int T, int V,
                             int Vp, bool write_dlogits, int block_size, cudaStream_t stream) {
    fused_classifier_kernel<<<B * T, block_size, 0, stream>>>(logits, losses, dloss, targets, V, Vp,
                                                              write_dlogits);
    cudaCheck(cudaGetLastError());
}

// logits (B,T,Vp), first V columns real; losses (B,T) = -log softmax(logits[b,t,:V])[targets[b,t]];
// with write_dlogits, logits become dloss * (softmax - onehot(target)), 0 in the padding columns
void fused_classifier(floatX* logits, float* losses, float dloss, const int* targets, int B, int T, int V, int Vp,
                      bool write_dlogits, cudaStream_t stream) {
    // 1024 threads hide the latency of a 50k-column row; a small vocabulary gets one thread per vector
    const int warps_for_row = CEIL_DIV(CEIL_DIV(Vp, x128::size), 32);
    const int block_size = warps_for_row < 32 ? 32 * warps_for_row : 1024;
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
