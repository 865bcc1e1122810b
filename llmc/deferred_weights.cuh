// llmc/deferred_weights.cuh: weight gradients computed after the input gradients: a pipeline's W passes (-pps zb,
// ZB-H1; doc/parallelism.md "Pipeline parallelism"). During a micro-batch's backward pass (B) each Linear layer's weight
// gradient is queued instead of computed, with a copy of its output gradient (which the next layer's backward
// overwrites) and, where the forward's input is not kept past its layer (a recomputed activation), of that input too;
// its W pass runs the queued GEMMs (matmul_backward_weight) in the order queued, so that each weight accumulates the
// micro-batches in the order the backward passes would have. Included by train_gpt.cu after llmc/matmul.cuh.
// Tests: pipeline-parallel-cli (-pps zb bit-identical to 1f1b, and in the checking build).
#pragma once
#include "common.cuh"

typedef struct {
    floatX* dweight;     // (OC, C) +=
    const floatX* inp;   // (N, C)
    const floatX* dout;  // (N, OC), in the queue's arena
    int N, C, OC;
} DeferredWeightGradient;
typedef struct {
    DeferredWeightGradient* jobs;
    int count, capacity;
    floatX* arena;  // the copies
    size_t used, size;
    int* group_first;  // the jobs in groups (a layer's each, in the order queued): group g's first job
    int num_groups;
} WeightGradientQueue;

static void weight_queue_allocate(WeightGradientQueue* q, int jobs, size_t values) {
    q->jobs = (DeferredWeightGradient*)malloc_check((size_t)jobs * sizeof(DeferredWeightGradient));
    q->group_first = (int*)malloc_check((size_t)(jobs + 1) * sizeof(int));
    q->capacity = jobs, q->count = 0, q->used = 0, q->size = values, q->num_groups = 0;
    cudaCheck(cudaMalloc((void**)&q->arena, values * sizeof(floatX)));
}
static void weight_queue_free(WeightGradientQueue* q) {
    free(q->jobs);
    free(q->group_first);
    cudaCheck(cudaFree(q->arena));
}
// the jobs queued from now on are a group of their own
static void weight_queue_begin_group(WeightGradientQueue* q) {
    if (q->num_groups == q->capacity) {
        fprintf(stderr, "weight_queue_begin_group: more than the queue's %d groups\n", q->capacity);
        exit(EXIT_FAILURE);
    }
    q->group_first[q->num_groups++] = q->count;
}
static floatX* weight_queue_copy(WeightGradientQueue* q, const floatX* values, size_t n, cudaStream_t stream) {
    if (q->used + n > q->size) {
        fprintf(stderr, "weight_queue_copy: %zu values over the queue's %zu\n", q->used + n, q->size);
        exit(EXIT_FAILURE);
    }
    floatX* at = q->arena + q->used;
    cudaCheck(cudaMemcpyAsync(at, values, n * sizeof(floatX), cudaMemcpyDeviceToDevice, stream));
    q->used += n;
    return at;
}
// dweight += dout^T inp, later: dout copied; inp copied when `copy_inp` (else it must stay as it is until the W pass)
static void weight_queue_defer(WeightGradientQueue* q, floatX* dweight, const floatX* inp, int copy_inp,
                               const floatX* dout, int N, int C, int OC, cudaStream_t stream) {
    if (q->count == q->capacity) {
        fprintf(stderr, "weight_queue_defer: more than the queue's %d weight gradients\n", q->capacity);
        exit(EXIT_FAILURE);
    }
    DeferredWeightGradient* j = &q->jobs[q->count++];
    j->dweight = dweight, j->N = N, j->C = C, j->OC = OC;
    j->dout = weight_queue_copy(q, dout, (size_t)N * OC, stream);
    j->inp = copy_inp ? weight_queue_copy(q, inp, (size_t)N * C, stream) : inp;
}
// the W pass: every queued weight gradient, in the order queued; the queue is empty after it
static void weight_queue_run(WeightGradientQueue* q, cudaStream_t stream) {
    for (int k = 0; k < q->count; k++) {
        const DeferredWeightGradient* j = &q->jobs[k];
        matmul_backward_weight(j->dweight, j->dout, j->inp, j->N, j->C, j->OC, stream);
    }
    q->count = 0, q->used = 0, q->num_groups = 0;
}
// ... or group by group: group g's (the caller runs every group in turn, then weight_queue_clear)
static void weight_queue_run_group(const WeightGradientQueue* q, int g, cudaStream_t stream) {
    int end = g + 1 < q->num_groups ? q->group_first[g + 1] : q->count;
    for (int k = q->group_first[g]; k < end; k++) {
        const DeferredWeightGradient* j = &q->jobs[k];
        matmul_backward_weight(j->dweight, j->dout, j->inp, j->N, j->C, j->OC, stream);
    }
}
static void weight_queue_clear(WeightGradientQueue* q) { q->count = 0, q->used = 0, q->num_groups = 0; }

