// llmc/optimizer.cuh: a model's trainable parameters as one flat floatX buffer of named tensors, with their
// gradients and the AdamW state, sharded for ZeRO-1 — the part of training that does not depend on the model.
// The trainers (train_gpt.cu, train_moe.cu) describe their tensors (sizes in buffer order, weight decay or
// not), point their own structs into `params_memory`/`grads_memory`, and call:
//   sharded_parameters_allocate      parameters and gradients (padded so that every shard is equal)
//   sharded_parameters_allocate_optimizer   m, v and fp32 master weights for this process's shard
//   sharded_parameters_zero_grad     before the first micro-step of a step
//   sharded_parameters_reduce_slices        average a set of slices over processes during the backward pass
//   sharded_parameters_reduce_and_norm      wait for that, global norm of the unscaled gradient
//   sharded_parameters_apply_update  clip, undo the FP16 loss scale, AdamW, all-gather (ZeRO-1)
//   sharded_parameters_write_state / read_state   the optimizer state in checkpoints
// Deterministic: the global norm is a fixed-order reduction, the stochastic-rounding seeds come from a host
// generator that is identical on every process, and every process updates identical values.
#pragma once
#include "common.cuh"
#include "adamw.cuh"
#include "copy_cast.cuh"
#include "global_norm.cuh"
#include "multi_gpu.cuh"
#include "utils.h"

#define MAX_PARAMETER_TENSORS 64

typedef struct {
    float learning_rate, beta1, beta2, eps, weight_decay, grad_clip;
} AdamWConfig;

typedef struct {
    int num_tensors;
    size_t sizes[MAX_PARAMETER_TENSORS];  // in buffer order
    int decays[MAX_PARAMETER_TENSORS];    // 1: weight decay applies (matrices), 0: not (biases, LayerNorms)
    size_t num_parameters;                // real parameters
    size_t num_parameters_padded;         // rounded up so that ZeRO shards are equal and 16-byte aligned
    floatX* params_memory;
    floatX* grads_memory;
    // optimizer state for [shard_offset, shard_offset + shard_size) of the flat buffer (all of it without ZeRO)
    size_t shard_offset, shard_size;
    float* m_memory;
    float* v_memory;
    float* master_weights;  // fp32 copy of the shard, or NULL
    float* norm_partials;
    float* norm_result;
    unsigned long long rng_state;  // host generator of stochastic-rounding seeds (identical on every process)
    float loss_scale;              // FP16 dynamic loss scaling (1 otherwise)
    int good_steps;                // steps since the loss scale last changed
} ShardedParameters;

static void sharded_parameters_allocate(ShardedParameters* p, int num_tensors, const size_t* sizes, const int* decays,
                                        int num_processes) {
    if (num_tensors > MAX_PARAMETER_TENSORS) {
        fprintf(stderr, "sharded_parameters_allocate: %d tensors, at most %d\n", num_tensors, MAX_PARAMETER_TENSORS);
        exit(EXIT_FAILURE);
    }
    memset(p, 0, sizeof(*p));
    p->num_tensors = num_tensors;
    for (int i = 0; i < num_tensors; i++) {
        p->sizes[i] = sizes[i];
        p->decays[i] = decays[i];
        p->num_parameters += sizes[i];
    }
    size_t quantum = (size_t)num_processes * 8;
    p->num_parameters_padded = CEIL_DIV(p->num_parameters, quantum) * quantum;
    cudaCheck(cudaMalloc((void**)&p->params_memory, p->num_parameters_padded * sizeof(floatX)));
    cudaCheck(cudaMalloc((void**)&p->grads_memory, p->num_parameters_padded * sizeof(floatX)));
    cudaCheck(cudaMemset(p->params_memory, 0, p->num_parameters_padded * sizeof(floatX)));
    cudaCheck(cudaMemset(p->grads_memory, 0, p->num_parameters_padded * sizeof(floatX)));
    size_t partials = global_norm_num_partials(p->num_parameters_padded);
    cudaCheck(cudaMalloc((void**)&p->norm_partials, partials * sizeof(float)));
    cudaCheck(cudaMalloc((void**)&p->norm_result, sizeof(float)));
    p->rng_state = 13371337ull;
    p->loss_scale = PRECISION_MODE == PRECISION_FP16 ? 65536.0f : 1.0f;
}

// m, v (and fp32 master weights when use_master_weights and the parameters are not fp32 already) for
// this process's shard: all parameters with ZeRO-0, a 1/num_processes slice with ZeRO-1.
static void sharded_parameters_allocate_optimizer(ShardedParameters* p, int use_master_weights, int process_rank,
                                                  int num_processes, int zero_stage) {
    size_t n = p->num_parameters_padded;
    p->shard_size = zero_stage >= 1 ? n / num_processes : n;
    p->shard_offset = zero_stage >= 1 ? (size_t)process_rank * p->shard_size : 0;
    cudaCheck(cudaMalloc((void**)&p->m_memory, p->shard_size * sizeof(float)));
    cudaCheck(cudaMalloc((void**)&p->v_memory, p->shard_size * sizeof(float)));
    cudaCheck(cudaMemset(p->m_memory, 0, p->shard_size * sizeof(float)));
    cudaCheck(cudaMemset(p->v_memory, 0, p->shard_size * sizeof(float)));
    p->master_weights = NULL;
    if (use_master_weights && PRECISION_MODE != PRECISION_FP32) {
        cudaCheck(cudaMalloc((void**)&p->master_weights, p->shard_size * sizeof(float)));
        copy_and_cast(p->master_weights, p->params_memory + p->shard_offset, p->shard_size, 0);
    }
}

static void sharded_parameters_free(ShardedParameters* p) {
    cudaCheck(cudaFree(p->params_memory));
    cudaCheck(cudaFree(p->grads_memory));
    cudaCheck(cudaFree(p->m_memory));
    cudaCheck(cudaFree(p->v_memory));
    cudaCheck(cudaFree(p->master_weights));
    cudaCheck(cudaFree(p->norm_partials));
    cudaCheck(cudaFree(p->norm_result));
}

static size_t sharded_parameters_offset(const ShardedParameters* p, int tensor) {
    size_t offset = 0;
    for (int i = 0; i < tensor; i++) offset += p->sizes[i];
    return offset;
}

static void sharded_parameters_zero_grad(ShardedParameters* p, cudaStream_t stream) {
    cudaCheck(cudaMemsetAsync(p->grads_memory, 0, p->num_parameters_padded * sizeof(floatX), stream));
}

// xorshift64*: the same sequence on every process, so that stochastic rounding agrees everywhere
static unsigned int sharded_parameters_next_seed(ShardedParameters* p) {
    p->rng_state ^= p->rng_state >> 12;
    p->rng_state ^= p->rng_state << 25;
    p->rng_state ^= p->rng_state >> 27;
    return (unsigned int)((p->rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}

static ncclDataType_t nccl_floatX(void) {
    return PRECISION_MODE == PRECISION_FP32 ? ncclFloat : (PRECISION_MODE == PRECISION_FP16 ? ncclHalf : ncclBfloat16);
}

// The gradient reduction, overlapped with the backward pass: as soon as the backward pass has finished with
// slice `layer` of each listed tensor (a tensor stacked over num_layers layers; layer < 0: the whole tensor),
// these slices are averaged over processes on the NCCL stream, in one NCCL group, while the main stream goes
// on. ZeRO-0 all-reduces them; ZeRO-1 reduces each piece of a slice to the process whose shard holds it (the
// reduce-scatter of the whole buffer, done slice by slice), so each process ends with the average of its shard.
// The trainer must cover every tensor exactly once per step (on the last micro-step).
static void sharded_parameters_reduce_slices(ShardedParameters* p, const int* tensors, int count, int layer,
                                             int num_layers, const MultiGpuConfig* mg, int zero_stage,
                                             cudaStream_t stream) {
    if (mg->num_processes == 1) return;
    cudaCheck(cudaEventRecord(mg->compute_done, stream));
    cudaCheck(cudaStreamWaitEvent(mg->nccl_stream, mg->compute_done, 0));
    ncclCheck(ncclGroupStart());
    for (int j = 0; j < count; j++) {
        int i = tensors[j];
        size_t n = layer >= 0 ? p->sizes[i] / num_layers : p->sizes[i];
        size_t begin = sharded_parameters_offset(p, i) + (layer >= 0 ? (size_t)layer * n : 0);
        size_t end = begin + n;
        if (zero_stage == 0) {
            ncclCheck(ncclAllReduce(p->grads_memory + begin, p->grads_memory + begin, n, nccl_floatX(), ncclAvg,
                                    mg->nccl_comm, mg->nccl_stream));
            continue;
        }
        for (int r = 0; r < mg->num_processes; r++) {
            size_t shard_begin = (size_t)r * p->shard_size, shard_end = shard_begin + p->shard_size;
            size_t a = begin > shard_begin ? begin : shard_begin;
            size_t b = end < shard_end ? end : shard_end;
            if (a < b) {
                ncclCheck(ncclReduce(p->grads_memory + a, p->grads_memory + a, b - a, nccl_floatX(), ncclAvg, r,
                                     mg->nccl_comm, mg->nccl_stream));
            }
        }
    }
    ncclCheck(ncclGroupEnd());
}

// After the micro-steps' backward passes: waits for the overlapped reduction (sharded_parameters_reduce_slices)
// and returns the global norm of the unscaled gradient, identical on every process (inf or NaN when an FP16
// gradient overflowed). The padding past the last tensor is never reduced: it stays zero everywhere.
static float sharded_parameters_reduce_and_norm(ShardedParameters* p, const MultiGpuConfig* mg, int zero_stage,
                                                cudaStream_t stream) {
    if (mg->num_processes > 1) {
        cudaCheck(cudaEventRecord(mg->compute_done, mg->nccl_stream));
        cudaCheck(cudaStreamWaitEvent(stream, mg->compute_done, 0));
    }
    // with ZeRO-1 each process holds the reduced gradient of its shard only: the squares are summed over processes
    size_t offset = zero_stage >= 1 ? p->shard_offset : 0;
    size_t count = zero_stage >= 1 ? p->shard_size : p->num_parameters_padded;
    global_norm_squared(p->norm_partials, p->grads_memory + offset, count, stream);
    global_norm_aggregate(p->norm_result, p->norm_partials, global_norm_num_partials(count), false, stream);
    float norm2;
    cudaCheck(cudaMemcpyAsync(&norm2, p->norm_result, sizeof(float), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    if (zero_stage >= 1 && mg->num_processes > 1) norm2 = multi_gpu_cpu_float_sum(norm2, mg);
    return sqrtf(norm2) / p->loss_scale;
}

// Gradient clipping as torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when below 1.
static float sharded_parameters_clip_scale(float norm, float max_norm) {
    float coef = max_norm / (norm + 1e-6f);
    return coef < 1.0f ? coef : 1.0f;
}

// The update of step t (from 1) for a gradient of norm `norm`: AdamW over this process's shard, one call
// per tensor piece (weight decay on the matrices only), then the all-gather of the parameters under
// ZeRO-1. An overflowed FP16 gradient skips the update and halves the loss scale; a run of 1000 good
// steps doubles it again. Returns 1 if the parameters were updated.
static int sharded_parameters_apply_update(ShardedParameters* p, const AdamWConfig* opt, float norm, int t,
                                           const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream) {
    if (!isfinite(norm)) {
        if (PRECISION_MODE == PRECISION_FP16) {
            p->loss_scale *= 0.5f;
            p->good_steps = 0;
        }
        return 0;
    }
    float grad_scale = sharded_parameters_clip_scale(norm, opt->grad_clip) / p->loss_scale;
    float beta1_correction = 1.0f - powf(opt->beta1, (float)t);
    float beta2_correction = 1.0f - powf(opt->beta2, (float)t);
    unsigned int seed = sharded_parameters_next_seed(p);
    size_t shard_begin = p->shard_offset, shard_end = p->shard_offset + p->shard_size;
    size_t tensor_begin = 0;
    for (int i = 0; i < p->num_tensors; i++) {
        size_t tensor_end = tensor_begin + p->sizes[i];
        size_t begin = tensor_begin > shard_begin ? tensor_begin : shard_begin;
        size_t end = tensor_end < shard_end ? tensor_end : shard_end;
        if (begin < end) {
            size_t local = begin - shard_begin;
            adamw_update(p->params_memory + begin, p->master_weights ? p->master_weights + local : nullptr,
                         p->grads_memory + begin, p->m_memory + local, p->v_memory + local, end - begin,
                         opt->learning_rate, opt->beta1, opt->beta2, beta1_correction, beta2_correction, opt->eps,
                         p->decays[i] ? opt->weight_decay : 0.0f, grad_scale, seed + (unsigned int)i, stream);
        }
        tensor_begin = tensor_end;
    }
    if (zero_stage >= 1 && mg->num_processes > 1) {
        cudaCheck(cudaEventRecord(mg->compute_done, stream));
        cudaCheck(cudaStreamWaitEvent(mg->nccl_stream, mg->compute_done, 0));
        ncclCheck(ncclAllGather(p->params_memory + p->shard_offset, p->params_memory, p->shard_size, nccl_floatX(),
                                mg->nccl_comm, mg->nccl_stream));
        cudaCheck(cudaEventRecord(mg->compute_done, mg->nccl_stream));
        cudaCheck(cudaStreamWaitEvent(stream, mg->compute_done, 0));
    }
    if (PRECISION_MODE == PRECISION_FP16 && ++p->good_steps >= 1000) {
        p->loss_scale *= 2.0f;
        p->good_steps = 0;
    }
    return 1;
}

// The optimizer state of this process's shard in a checkpoint: m, v, then the master weights if any.
static void sharded_parameters_write_state(const ShardedParameters* p, FILE* f, const char* path) {
    float* host = (float*)malloc_check(p->shard_size * sizeof(float));
    float* device_buffers[3] = {p->m_memory, p->v_memory, p->master_weights};
    for (int i = 0; i < (p->master_weights ? 3 : 2); i++) {
        cudaCheck(cudaMemcpy(host, device_buffers[i], p->shard_size * sizeof(float), cudaMemcpyDeviceToHost));
        fwrite_check(host, sizeof(float), p->shard_size, f, path);
    }
    free(host);
}

static void sharded_parameters_read_state(ShardedParameters* p, FILE* f, const char* path) {
    float* host = (float*)malloc_check(p->shard_size * sizeof(float));
    float* device_buffers[3] = {p->m_memory, p->v_memory, p->master_weights};
    for (int i = 0; i < (p->master_weights ? 3 : 2); i++) {
        fread_check(host, sizeof(float), p->shard_size, f, path);
        cudaCheck(cudaMemcpy(device_buffers[i], host, p->shard_size * sizeof(float), cudaMemcpyHostToDevice));
    }
    free(host);
}
